//! The env seam. Library crates reach time, randomness, the network and
//! disks only through [`Env`]; the `blizzard` binary hands them
//! [`Env::real`], the simulator (`blizzard-sim`) hands them a deterministic
//! one built from the same traits. `clippy.toml` forbids the direct calls
//! elsewhere and names this crate as the replacement.
//!
//! The traits return boxed futures so that one `Env` type serves both
//! worlds without making every server generic.

pub mod admission;
mod group_commit;
mod handover;
mod local;
mod model;
mod peer;
mod real;
pub mod sync;
mod zero_fill;

use std::any::Any;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite};
pub use tokio::time::Instant;

pub use group_commit::GroupCommit;
pub use handover::{
    adopt_listener, adopt_stream, stream_fd, HandoverConn, HandoverListener, HANDOVER_FDS_MAX,
};
pub use local::LocalNet;
pub use model::DiskModel;
pub use peer::{peer_of, Authenticated, Peer, Revocations};
pub use real::{raise_fd_limit, RealClock, RealDisks, RealNet, RealRng};
pub use sync::{lock, Flag};

/// A byte stream to a peer: TCP, unix socket or simulated link. `Any`
/// lets the real side find the socket under a stream ([`stream_fd`]) to
/// hand it to another process; every `'static` type is `Any`, so this
/// asks nothing more of a stream.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin + Any {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Stream for T {}

pub type BoxStream = Box<dyn Stream>;

/// Time. `now` is monotonic; `system_time` is wall-clock time for humans.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
    fn system_time(&self) -> SystemTime;
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()>;
}

/// Randomness. The simulator's is seeded, so a seed replays a run.
pub trait Rng: Send + Sync {
    fn next_u64(&self) -> u64;
}

/// Stream sockets. An address is `host:port` for TCP or `unix:/path` for a
/// unix socket.
pub trait Net: Send + Sync {
    fn connect(&self, addr: &str) -> BoxFuture<'static, io::Result<BoxStream>>;
    fn bind(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>>;

    /// Binds a listener that is not one of the cluster's: an NBD server's
    /// port (whose TLS is NBD's own STARTTLS) or an HTTP `/metrics`
    /// endpoint (which Prometheus and curl reach as plain HTTP), whatever
    /// carries the cluster's connections. Only a net that
    /// changes the cluster's connections (`blizzard_tls::TlsNet`) makes
    /// it differ from [`Net::bind`].
    fn bind_plain(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        self.bind(addr)
    }

    /// Attaches `endpoint` to `addr`, the address of a listener this net
    /// bound that is still open, so callers in the same process can reach
    /// the server behind it without a stream ([`Net::endpoint`]). Returns
    /// whether this net keeps endpoints (only [`LocalNet`] does).
    fn attach_endpoint(&self, _addr: &str, _endpoint: Endpoint) -> bool {
        false
    }

    /// The endpoint attached to `addr`, while its listener is open.
    fn endpoint(&self, _addr: &str) -> Option<Endpoint> {
        None
    }
}

/// What a server attaches to its address for callers in its own process
/// (`blizzard_rpc` attaches its service); opaque here.
pub type Endpoint = Arc<dyn std::any::Any + Send + Sync>;

pub trait Listener: Send + Sync {
    /// The next connection and the peer's address.
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>>;
    /// The address peers should dial (with the real port if bound to 0).
    fn local_addr(&self) -> String;
    /// The OS socket under this listener, to hand to another process (an
    /// NBD server's online upgrade, [`HandoverConn`]); `None` where there
    /// is none (the simulator).
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }
}

/// Opens disks: a raw block device or one large file.
pub trait Disks: Send + Sync {
    /// Opens `path`; if it does not exist and `create_len` is given, creates
    /// a file of that many bytes with its space allocated up front (and its
    /// directory, if missing).
    fn open(&self, path: &Path, create_len: Option<u64>) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>>;

    /// Removes the disk file at `path`, durably (its directory is synced
    /// before this returns). A file already gone is not an error. For
    /// stores made of many files (a log's segments, snapshots).
    fn remove(&self, path: &Path) -> BoxFuture<'static, io::Result<()>> {
        let e = io::Error::new(io::ErrorKind::Unsupported, format!("cannot remove {}", path.display()));
        Box::pin(async move { Err(e) })
    }

    /// The disk files directly in `dir` whose names start with `prefix`,
    /// sorted by name (empty if `dir` does not exist).
    fn list(&self, dir: &Path, prefix: &str) -> BoxFuture<'static, io::Result<Vec<PathBuf>>> {
        let e =
            io::Error::new(io::ErrorKind::Unsupported, format!("cannot list {}/{prefix}*", dir.display()));
        Box::pin(async move { Err(e) })
    }
}

/// One disk. Writes become durable only after `sync` returns; what a crash
/// does to writes not yet synced is the disk's fault model (real hardware,
/// or `blizzard-sim`'s simulated disk, which documents its own).
pub trait Disk: Send + Sync {
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Reads exactly `len` bytes at `offset`.
    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>>;
    /// [`Disk::read_at`], with the CRC32C of each `piece` bytes read (the
    /// last piece may be shorter). A real disk computes them on the thread
    /// that ran a large read, so the checksums of 1 MiB reads take a second
    /// core instead of the runtime thread's time.
    fn read_at_crcs(
        &self,
        offset: u64,
        len: usize,
        piece: usize,
    ) -> BoxFuture<'static, io::Result<(Bytes, Vec<u32>)>> {
        let read = self.read_at(offset, len);
        async move {
            let b = read.await?;
            let crcs = crcs_of(&b, piece);
            Ok((b, crcs))
        }
        .boxed()
    }
    /// Writes each `(offset, bytes)`; one call, so a server can hand one
    /// request's data, CRCs and table entry over in one go.
    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>>;
    /// Makes every completed write durable (`fdatasync`).
    fn sync(&self) -> BoxFuture<'static, io::Result<()>>;
    /// Same as [`Disk::sync`], for a caller with nothing else to do until it
    /// returns (a group commit with a single waiter). A disk may then run it
    /// on the calling thread, saving the hand-offs to and from a helper
    /// thread; it must still fall back to [`Disk::sync`] whenever blocking
    /// the caller could stall other work for long.
    fn sync_alone(&self) -> BoxFuture<'static, io::Result<()>> {
        self.sync()
    }
    /// Bytes of background work of its own the disk still has ahead,
    /// sharing the device with the server's I/O (a real disk file being
    /// zero-filled: the part the filler has not reached yet); 0 when none.
    /// Shown in `/metrics`; benchmarks wait for 0 before measuring.
    fn preparing_left(&self) -> u64 {
        0
    }
    /// A hint: `len` bytes at `offset` will soon be written in pieces
    /// smaller than a page, so bring them into the page cache now, in the
    /// background (`POSIX_FADV_WILLNEED`). A buffered write into part of a
    /// page the cache does not hold makes the kernel read that page first,
    /// synchronously, on the writing thread. Changes nothing a read or a
    /// crash sees; a disk without a page cache ignores it.
    fn prefetch(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }
}

/// Alignment of direct (page-cache bypassing) disk I/O: buffer addresses,
/// offsets and lengths that are multiples of it go straight to the device.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// The CRC32C of each `piece` bytes of `data` (the last may be shorter).
pub fn crcs_of(data: &[u8], piece: usize) -> Vec<u32> {
    data.chunks(piece.max(1)).map(blizzard_core::crc::crc32c).collect()
}

/// An empty buffer with room for at least `len` bytes whose first byte is
/// aligned for direct I/O, so data read from the network into it can go to
/// the disk without another copy.
pub fn aligned_buffer(len: usize) -> BytesMut {
    let mut b = BytesMut::with_capacity(len + DIRECT_IO_ALIGN);
    let pad = b.as_ptr().align_offset(DIRECT_IO_ALIGN).min(DIRECT_IO_ALIGN);
    b.put_bytes(0, pad);
    b.advance(pad);
    b
}

/// The outside world as a server sees it.
#[derive(Clone)]
pub struct Env {
    pub clock: Arc<dyn Clock>,
    pub rng: Arc<dyn Rng>,
    pub net: Arc<dyn Net>,
    pub disks: Arc<dyn Disks>,
}

/// A deadline passed before the operation finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

impl Env {
    /// The real world: system clock, OS entropy, TCP/unix sockets, files.
    pub fn real() -> Env {
        Env {
            clock: Arc::new(RealClock),
            rng: Arc::new(RealRng::new()),
            net: Arc::new(RealNet),
            disks: Arc::new(RealDisks),
        }
    }

    /// This env, with connections among the servers it starts made as
    /// in-memory pipes ([`LocalNet`]): for servers sharing one process.
    pub fn with_local_net(&self) -> Env {
        Env { net: Arc::new(LocalNet::new(self.net.clone())), ..self.clone() }
    }

    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    pub fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        self.clock.sleep(d)
    }

    /// Runs `fut` for at most `d`.
    pub async fn timeout<F: std::future::Future>(&self, d: Duration, fut: F) -> Result<F::Output, Elapsed> {
        let sleep = self.clock.sleep(d);
        tokio::select! {
            biased;
            out = fut => Ok(out),
            _ = sleep => Err(Elapsed),
        }
    }

    pub fn random_u64(&self) -> u64 {
        self.rng.next_u64()
    }

    pub fn random_u128(&self) -> u128 {
        (self.rng.next_u64() as u128) << 64 | self.rng.next_u64() as u128
    }

    /// A uniform integer in `0..n` (n > 0).
    pub fn random_below(&self, n: u64) -> u64 {
        debug_assert!(n > 0);
        // Lemire's multiply-shift: unbiased enough for placement and jitter.
        ((self.rng.next_u64() as u128 * n.max(1) as u128) >> 64) as u64
    }

    /// Shuffles `v` in place (Fisher–Yates) with this env's randomness.
    pub fn shuffle<T>(&self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.random_below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }

    pub async fn connect(&self, addr: &str) -> io::Result<BoxStream> {
        self.net.connect(addr).await
    }

    pub async fn bind(&self, addr: &str) -> io::Result<Box<dyn Listener>> {
        self.net.bind(addr).await
    }

    /// [`Net::bind_plain`]: for an NBD port or a `/metrics` endpoint.
    pub async fn bind_plain(&self, addr: &str) -> io::Result<Box<dyn Listener>> {
        self.net.bind_plain(addr).await
    }

    pub async fn open_disk(&self, path: &Path, create_len: Option<u64>) -> io::Result<Arc<dyn Disk>> {
        self.disks.open(path, create_len).await
    }

    pub async fn remove_disk(&self, path: &Path) -> io::Result<()> {
        self.disks.remove(path).await
    }

    pub async fn list_disks(&self, dir: &Path, prefix: &str) -> io::Result<Vec<PathBuf>> {
        self.disks.list(dir, prefix).await
    }
}
