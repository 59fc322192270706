//! The volume's view of its blob: tract reads, writes and trims that are
//! durable on every replica when they complete. [`ClientBlobIo`] is the real
//! blob store; the crash checker substitutes a deterministic in-memory one
//! that can lose in-flight writes.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_client::{Blob, ClientError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum IoError {
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("{0}")]
    Other(String),
}

/// One blob, as the volume uses it. Every method's future is `'static` so
/// engines can run I/O on their own tasks.
pub trait BlobIo: Send + Sync + 'static {
    fn tract_size(&self) -> u32;
    fn replication(&self) -> u8;
    /// Size in tracts as last known.
    fn size_tracts(&self) -> u64;
    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>>;
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
}
