//! The volume's view of its blob: tract reads, writes and trims that are
//! durable on every replica when they complete. [`ClientBlobIo`] is the real
//! blob store; the crash checker substitutes a deterministic in-memory one
//! that can lose in-flight writes.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

pub use blizzard_client::CacheReceipt;
use blizzard_client::{Blob, ClientError, ErrorCode};
use blizzard_core::reconcile::Reconciled;

use crate::ErrorKind;

#[derive(Debug, Clone, thiserror::Error)]
pub enum IoError {
    /// Transparent: its message is the client's, and an error chain
    /// (`{:#}`) prints it once.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Stored bytes failed their checksum (a chunk torn by power loss, or
    /// damaged since): what a tractserver reports as `Corrupt`. Used by
    /// stores other than the real client, which reports it through
    /// [`ClientError`].
    #[error("corrupt: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Other(String),
    /// This process no longer holds the volume's lease (`lease`): taken
    /// over, or given up. Treated as fenced: no change goes out again.
    #[error("{0}")]
    LeaseLost(String),
}

impl IoError {
    /// Whether the read failed because stored bytes are damaged, not
    /// because the store could not be reached: retrying will not help, and
    /// log recovery may treat the range as never written (a write torn by
    /// a crash). Transient failures are never corruption: recovery must
    /// not end the log early because a server was briefly down.
    pub fn is_corrupt(&self) -> bool {
        match self {
            IoError::Corrupt(_) => true,
            // Every replica answered and none returned the range intact.
            IoError::Client(ClientError::NoIntactReplica { .. }) => true,
            // `read_replicas` asks every replica; one reporting damage fails it.
            IoError::Client(ClientError::Rejected { reply, .. }) => reply.code == ErrorCode::Corrupt,
            _ => false,
        }
    }

    /// What the failure means, coarsely: whether retrying can help, and
    /// what a frontend reports.
    pub fn kind(&self) -> ErrorKind {
        if self.fenced_by().is_some() {
            return ErrorKind::Fenced;
        }
        if self.is_corrupt() {
            return ErrorKind::Corrupt;
        }
        match self {
            IoError::Client(ClientError::DiskFull { .. }) => ErrorKind::NoSpace,
            IoError::Client(
                ClientError::NoSuchBlob(_)
                | ClientError::BlobExists(_)
                | ClientError::PastEnd { .. }
                | ClientError::Invalid(_),
            ) => ErrorKind::Invalid,
            IoError::Client(ClientError::Rejected { reply, .. }) => match reply.code {
                ErrorCode::BadFrame
                | ErrorCode::UnknownOpcode
                | ErrorCode::BadRequest
                | ErrorCode::OutOfRange
                | ErrorCode::NoSuchBlob
                | ErrorCode::BlobExists
                | ErrorCode::WrongCluster => ErrorKind::Invalid,
                _ => ErrorKind::Unavailable,
            },
            _ => ErrorKind::Unavailable,
        }
    }

    /// The newest writer epoch a tractserver has seen for the blob, when
    /// it refused this change because another process claimed the blob
    /// since (`intent::claim`).
    pub fn fenced_by(&self) -> Option<u64> {
        match self {
            IoError::Client(ClientError::Fenced { newest, .. }) => Some(*newest),
            // The newer holder's epoch is not known here: 0 says so.
            IoError::LeaseLost(_) => Some(0),
            _ => None,
        }
    }
}

/// One blob, as the volume uses it. Every method's future is `'static` so
/// engines can run I/O on their own tasks.
pub trait BlobIo: Send + Sync + 'static {
    fn tract_size(&self) -> u32;
    fn replication(&self) -> u8;
    /// Size in tracts as last known.
    fn size_tracts(&self) -> u64;
    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>>;
    /// One past the last tract that may hold data: [`BlobIo::size_tracts`]
    /// unless something older than the blob's size lies beyond it (a
    /// volume's frozen layers, `snap::layered`).
    fn reach_tracts(&self) -> u64 {
        self.size_tracts()
    }
    /// Durable on every replica when it returns `Ok`.
    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>>;
    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>>;
    /// The range from every replica, for recovery (replicas may disagree
    /// about a write that was in flight when a client crashed).
    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>>;
    /// Unmaps the range: reads as zeros, space reusable. Durable on `Ok`.
    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>>;
    /// Which `CHUNK_SIZE` chunks of the tract hold data (bit i, LSB first;
    /// missing bits are holes). A store that cannot tell reports every
    /// chunk as data, which is always safe.
    fn mapped(&self, _tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        let chunks = (self.tract_size() / blizzard_core::limits::CHUNK_SIZE) as usize;
        async move { Ok(vec![0xff; chunks.div_ceil(8)]) }.boxed()
    }
    /// Applied on every replica when it returns `Ok` (readers see it at
    /// once), durable only after [`BlobIo::sync`] of the returned receipt
    /// succeeds: a write cache. A store without one makes it durable at
    /// once and returns an empty receipt.
    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        let w = self.write(tract, offset, data);
        async move { w.await.map(|_| CacheReceipt::new()) }.boxed()
    }
    /// Makes the cached writes behind `receipt` (receipts may be
    /// concatenated) durable. On error they may be lost and must be
    /// written again.
    fn sync(&self, _receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        async { Ok(()) }.boxed()
    }
    /// Changes from now on carry writer epoch `epoch`; the store refuses
    /// changes with an older epoch than the newest it has seen for the
    /// blob (`intent::claim`). A store without fencing ignores it.
    fn set_writer(&self, _epoch: u64) {}
    /// The lowest writer epoch this process may claim: its volume lease's
    /// fencing token (`lease::Leased`), so two holders never claim the
    /// same epoch. 0 without a lease.
    fn writer_floor(&self) -> u64 {
        0
    }
    /// Gives up the right to change the blob (the volume's lease), after
    /// a clean close. Nothing to give up without a lease.
    fn release(&self) -> BoxFuture<'static, Result<(), IoError>> {
        async { Ok(()) }.boxed()
    }
    /// Makes every replica of `tract` hold the same bytes, chunk by chunk
    /// copied from the first replica that can read it (design 0005). Every
    /// replica must be reachable. A store with one replica has nothing to do.
    fn reconcile(&self, _tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        async { Ok(Reconciled { tracts: 1, ..Reconciled::default() }) }.boxed()
    }
}

/// The real blob store.
pub struct ClientBlobIo {
    blob: Blob,
}

impl ClientBlobIo {
    pub fn new(blob: Blob) -> Arc<ClientBlobIo> {
        Arc::new(ClientBlobIo { blob })
    }

    pub fn blob(&self) -> &Blob {
        &self.blob
    }
}

impl BlobIo for ClientBlobIo {
    fn tract_size(&self) -> u32 {
        self.blob.client().tract_size()
    }

    fn replication(&self) -> u8 {
        self.blob.replication()
    }

    fn size_tracts(&self) -> u64 {
        self.blob.size_tracts()
    }

    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.extend_to(tracts).await?) }.boxed()
    }

    fn mapped(&self, tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.mapped(tract).await?) }.boxed()
    }

    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.write(tract, offset, data).await?) }.boxed()
    }

    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.write_cached(tract, offset, data).await?) }.boxed()
    }

    fn sync(&self, receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.sync(receipt).await?) }.boxed()
    }

    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.read(tract, offset, len).await?) }.boxed()
    }

    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.read_replicas(tract, offset, len).await?) }.boxed()
    }

    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.trim(tract, offset, len).await?) }.boxed()
    }

    fn set_writer(&self, epoch: u64) {
        self.blob.set_writer(epoch);
    }
    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        let b = self.blob.clone();
        async move { Ok(b.reconcile(tract).await?) }.boxed()
    }
}
