//! The real world: tokio timers, OS entropy, TCP and unix sockets, and
//! files or block devices accessed with positional I/O on tokio's blocking
//! pool, made durable with `fdatasync`.
//!
//! Disks are opened three times: buffered, with `O_DIRECT` where the file
//! system allows it, and read-only with readahead off (the probe). Writes
//! go through the page cache, all but the largest; the group commit's
//! `fdatasync` sends them to the device together. Large aligned reads
//! are copied from the page cache when the range is there (looked for
//! through the probe without waiting for the device, [`read_cached`]),
//! else read direct; writes of at least [`DIRECT_WRITE_MIN`] (a blob's
//! whole tracts, a newcomer's copies) and the zero-fill go direct, so
//! moving gigabytes through does not fill the cache. The kernel keeps the two
//! views of a range coherent (a direct write first writes back and drops
//! the cached pages it covers), and `fdatasync` flushes the device's cache
//! for both.
//!
//! Tract data was once written direct too, as FDS tractservers use raw
//! disks. Measured on one machine (`bench/row.sh`, `blizzard up` with 1 MiB
//! blocks, page cache kept as `bench/nbd.sh` keeps it), buffered writes in
//! pieces of at most [`BUFFERED_WRITE_MAX`] gave 636–690 against 443–468
//! MB/s for 1 MiB writes at QD 8, and 57k against 13–15k IOPS for the 4 KiB
//! reads at QD 32 that followed (they found the data cached).
//!
//! Why the pieces: given 1 MiB in one `pwrite`, ext4 caches it in large
//! folios, and a later 4 KiB write dirties a whole folio, which the next
//! `fdatasync` writes back whole: 4 KiB random writes at QD 32 after 1 MiB
//! ones fell from 22–27k to 8–13k IOPS, at twice the CPU per write. In
//! 64 KiB pieces they stay at 23–25k.
//!
//! Why the largest writes go direct anyway: through the page cache, whole
//! 8 MiB tracts written 3-way (`bench/blob.sh`, 4 tractservers on one
//! disk) moved 182–193 MB/s at 10 CPU s/GB, both cores busy writing back
//! and reclaiming 12 GiB of cached pages; direct, they had moved 754 MB/s
//! at 2.2 s/GB. Volumes write at most one block (1 MiB) per request, below
//! the bound, so what they write stays cached for the reads that follow.

// This module *is* the real side of the seam: the one place allowed to
// call the clock, the OS entropy source, sockets and files directly.
#![allow(clippy::disallowed_methods)]

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::{RngCore, SeedableRng};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::zero_fill::ZeroFill;
use crate::{aligned_buffer, BoxStream, Clock, Disk, Disks, Instant, Listener, Net, Rng, DIRECT_IO_ALIGN};

pub struct RealClock;

impl Clock for RealClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn system_time(&self) -> SystemTime {
        SystemTime::now()
    }
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        tokio::time::sleep(d).boxed()
    }
}

pub struct RealRng(Mutex<rand::rngs::StdRng>);

impl RealRng {
    pub fn new() -> Self {
        RealRng(Mutex::new(rand::rngs::StdRng::from_os_rng()))
    }
}

impl Default for RealRng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng for RealRng {
    fn next_u64(&self) -> u64 {
        match self.0.lock() {
            Ok(mut r) => r.next_u64(),
            Err(poisoned) => poisoned.into_inner().next_u64(),
        }
    }
}

pub struct RealNet;

fn unix_path(addr: &str) -> Option<&str> {
    addr.strip_prefix("unix:")
}

impl Net for RealNet {
    fn connect(&self, addr: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let addr = addr.to_string();
        async move {
            if let Some(path) = unix_path(&addr) {
                let s = UnixStream::connect(path).await?;
                Ok(Box::new(s) as BoxStream)
            } else {
                let s = TcpStream::connect(&addr).await?;
                // Small control messages must not wait for Nagle.
                s.set_nodelay(true)?;
                Ok(Box::new(s) as BoxStream)
            }
        }
        .boxed()
    }

    fn bind(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        let addr = addr.to_string();
        async move {
            if let Some(path) = unix_path(&addr) {
                // A stale socket file from a previous run would make bind fail.
                let _ = std::fs::remove_file(path);
                let l = UnixListener::bind(path)?;
                Ok(Box::new(RealUnixListener { l, path: path.to_string() }) as Box<dyn Listener>)
            } else {
                let l = TcpListener::bind(&addr).await?;
                let local = l.local_addr()?.to_string();
                Ok(Box::new(RealTcpListener { l, local }) as Box<dyn Listener>)
            }
        }
        .boxed()
    }
}

pub(crate) struct RealTcpListener {
    pub(crate) l: TcpListener,
    pub(crate) local: String,
}

impl Listener for RealTcpListener {
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        async move {
            let (s, peer) = self.l.accept().await?;
            s.set_nodelay(true)?;
            Ok((Box::new(s) as BoxStream, peer.to_string()))
        }
        .boxed()
    }
    fn local_addr(&self) -> String {
        self.local.clone()
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.l.as_fd())
    }
}

pub(crate) struct RealUnixListener {
    pub(crate) l: UnixListener,
    pub(crate) path: String,
}

impl Listener for RealUnixListener {
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        async move {
            let (s, _) = self.l.accept().await?;
            Ok((Box::new(s) as BoxStream, format!("unix:{}", self.path)))
        }
        .boxed()
    }
    fn local_addr(&self) -> String {
        format!("unix:{}", self.path)
    }
    fn fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.l.as_fd())
    }
}

pub struct RealDisks;

impl Disks for RealDisks {
    fn open(&self, path: &Path, create_len: Option<u64>) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>> {
        let path = path.to_path_buf();
        async move {
            let disk = tokio::task::spawn_blocking(move || RealDisk::open(path, create_len))
                .await
                .map_err(io::Error::other)??;
            Ok(Arc::new(disk) as Arc<dyn Disk>)
        }
        .boxed()
    }

    fn remove(&self, path: &Path) -> BoxFuture<'static, io::Result<()>> {
        let path = path.to_path_buf();
        async move {
            tokio::task::spawn_blocking(move || {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                    Err(e) => return Err(e),
                }
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    File::open(dir)?.sync_all()?;
                }
                Ok(())
            })
            .await
            .map_err(io::Error::other)?
        }
        .boxed()
    }

    fn list(&self, dir: &Path, prefix: &str) -> BoxFuture<'static, io::Result<Vec<PathBuf>>> {
        let (dir, prefix) = (dir.to_path_buf(), prefix.to_string());
        async move {
            tokio::task::spawn_blocking(move || {
                let entries = match std::fs::read_dir(&dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
                    Err(e) => return Err(e),
                };
                let mut out = Vec::new();
                for e in entries {
                    let e = e?;
                    if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix))
                        && e.file_type()?.is_file()
                    {
                        out.push(e.path());
                    }
                }
                out.sort();
                Ok(out)
            })
            .await
            .map_err(io::Error::other)?
        }
        .boxed()
    }
}

struct RealDisk {
    file: Arc<File>,
    /// The same file opened with O_DIRECT, if the file system supports it.
    direct: Option<Arc<File>>,
    /// The same file again, read-only, with readahead off
    /// (`POSIX_FADV_RANDOM`): large reads look in the page cache through
    /// it first ([`read_cached`]).
    probe: Option<Arc<File>>,
    len: u64,
    /// How long this disk's last `fdatasync` took, in microseconds.
    last_sync_us: Arc<AtomicU64>,
    /// Bytes written through the page cache since the last `fdatasync`
    /// began: what the next one has to write back ([`Disk::sync_alone`]).
    unsynced: Arc<AtomicU64>,
    /// Writes register here while the file's unwritten space is being
    /// zero-filled (`zero_fill.rs`).
    zero_fill: Arc<ZeroFill>,
}

/// `fdatasync` calls running in this process right now, on any disk.
static SYNCS_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// [`Disk::sync_alone`] runs the sync on the calling thread only if this
/// disk's last one took less than this. A lone durable write waits for an
/// `fdatasync` of ≈ 200 µs on a virtual disk; sending it to the blocking
/// pool added two thread wake-ups (to the pool thread and back), each an
/// idle vCPU woken by an interrupt, which measured ≈ 100 µs per write at
/// queue depth 1. Above this bound (a spinning disk, a stalled device) the
/// hand-offs cost little by comparison and blocking the runtime thread —
/// which in `blizzard up` also serves NBD, the metadata server and the
/// other tractservers — would cost a lot, so the pool is used.
const INLINE_SYNC_MAX: Duration = Duration::from_millis(1);

/// ... and only if at most this many bytes were written since the last
/// sync began. The last sync's time says how quick the device is, not how
/// much the next sync has to write back: after a lone 1 MiB write it
/// writes back a megabyte, which held the runtime thread (and every NBD
/// request it serves) for 0.7 ms on average and up to 3.6 ms, 13% of that
/// thread's time under 1 MiB writes at QD 8 (`perf trace`). A few small
/// writes, the case the inline sync is for, stay under it.
const INLINE_SYNC_DIRTY_MAX: u64 = 64 << 10;

/// Whether [`Disk::sync_alone`] runs its `fdatasync` on the calling
/// thread: the last one was quick, little was written since, and no other
/// sync is running (it would make this one wait behind it).
fn sync_inline(last_sync_us: u64, unsynced: u64, syncs_running: usize) -> bool {
    u128::from(last_sync_us) < INLINE_SYNC_MAX.as_micros()
        && unsynced <= INLINE_SYNC_DIRTY_MAX
        && syncs_running == 0
}

/// One `fdatasync`, counted in [`SYNCS_RUNNING`] and timed.
fn timed_sync(file: &File, last_sync_us: &AtomicU64, unsynced: &AtomicU64) -> io::Result<()> {
    SYNCS_RUNNING.fetch_add(1, Ordering::SeqCst);
    // Before the sync: a write landing while it runs may or may not be
    // written back by it, so it counts towards the next one.
    unsynced.store(0, Ordering::Relaxed);
    let start = std::time::Instant::now();
    let res = file.sync_data();
    let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
    last_sync_us.store(us, Ordering::Relaxed);
    SYNCS_RUNNING.fetch_sub(1, Ordering::SeqCst);
    res
}

/// Writes up to this many bytes (all pieces together) are issued inline;
/// larger ones go through the blocking pool. Reads use the same bound (and
/// larger reads go around the page cache when aligned). It sits above a
/// 64 KiB volume block plus its chunk entries: sending every such write
/// through the pool cost two thread switches each, and the group commit's
/// `fdatasync` writes buffered blocks back together anyway (1 MiB
/// sequential NBD writes in 64 KiB blocks: 400 → 610 MB/s, 3.7 → 2.1 ms CPU
/// per write).
const INLINE_WRITE_MAX: usize = 256 << 10;

/// Largest piece handed to one buffered `pwrite`: bounds the folios the
/// page cache builds, so a later small write dirties little (module docs).
const BUFFERED_WRITE_MAX: usize = 64 << 10;

/// Writes at least this large, aligned, go around the page cache (module
/// docs): above a volume's largest block, so volume writes stay cached.
const DIRECT_WRITE_MIN: usize = 4 << 20;

fn write_buffered(file: &File, offset: u64, data: &[u8]) -> io::Result<()> {
    for (i, part) in data.chunks(BUFFERED_WRITE_MAX).enumerate() {
        file.write_all_at(part, offset + (i * BUFFERED_WRITE_MAX) as u64)?;
    }
    Ok(())
}

/// One write on the blocking pool: direct if it is large and aligned and
/// the file allows it, else buffered. A buffer not aligned in memory is
/// copied into one that is (the page cache would copy it too).
fn write_blocking(file: &File, direct: Option<&File>, offset: u64, data: &Bytes) -> io::Result<()> {
    match direct {
        Some(d) if data.len() >= DIRECT_WRITE_MIN && direct_ok(offset, data.len()) => {
            if (data.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN) {
                d.write_all_at(data, offset)
            } else {
                let mut b = aligned_buffer(data.len());
                b.extend_from_slice(data);
                d.write_all_at(&b, offset)
            }
        }
        _ => write_buffered(file, offset, data),
    }
}

/// Fills `buf` from the page cache if the range is there, without
/// waiting for the device: true if it did. A large read of data written
/// or read moments ago (a volume read back after a sequential fill) is
/// then a copy instead of a device read; the device's own rate was the
/// bound of 1 MiB reads here (`docs/benchmarks.md`).
///
/// `probe` has readahead off, so looking costs at most one page on a
/// miss: the first page is asked for with `RWF_NOWAIT`, then the last,
/// then the rest. A plain `RWF_NOWAIT` read of the whole range would on a
/// miss start the device reading it into the cache (readahead, or the
/// whole range with readahead off), and the direct read that follows
/// would read it a second time. Measured on this kernel (6.18): eight
/// 4 KiB probes of a cold file with readahead off left 32 KiB in the
/// cache; eight 1 MiB `RWF_NOWAIT` reads left 8 MiB.
fn read_cached(probe: &File, buf: &mut [u8], offset: u64) -> bool {
    const PAGE: usize = 4096;
    let len = buf.len();
    if len < 2 * PAGE {
        return false;
    }
    let nowait = |b: &mut [u8], at: usize| -> bool {
        let mut done = 0;
        while done < b.len() {
            let mut bufs = [io::IoSliceMut::new(&mut b[done..])];
            match rustix::io::preadv2(
                probe,
                &mut bufs,
                offset + (at + done) as u64,
                rustix::io::ReadWriteFlags::NOWAIT,
            ) {
                Ok(n) if n > 0 => done += n,
                // A miss (EAGAIN), the end of the file, or an error: the
                // direct read decides.
                _ => return false,
            }
        }
        true
    };
    let (first, rest) = buf.split_at_mut(PAGE);
    let (middle, last) = rest.split_at_mut(len - 2 * PAGE);
    nowait(first, 0) && nowait(last, len - PAGE) && nowait(middle, PAGE)
}

fn direct_ok(offset: u64, len: usize) -> bool {
    offset.is_multiple_of(DIRECT_IO_ALIGN as u64) && len.is_multiple_of(DIRECT_IO_ALIGN) && len > 0
}

impl RealDisk {
    /// `read_at`, and with `piece` the CRC32C of each piece, computed on
    /// the thread that read (`Disk::read_at_crcs`).
    fn read(
        &self,
        offset: u64,
        len: usize,
        piece: Option<usize>,
    ) -> BoxFuture<'static, io::Result<(Bytes, Vec<u32>)>> {
        let file = self.file.clone();
        let small = len <= INLINE_WRITE_MAX;
        // Small reads go through the page cache (where small writes are),
        // large ones around it.
        let direct = self.direct.clone().filter(|_| !small && direct_ok(offset, len));
        let probe = self.probe.clone();
        let disk_len = self.len;
        async move {
            check_range(offset, len as u64, disk_len)?;
            if small {
                // Cached data is copied right here; only a read that would
                // wait for the device goes to the blocking pool.
                let mut buf = aligned_buffer(len);
                buf.resize(len, 0);
                let mut bufs = [io::IoSliceMut::new(&mut buf)];
                if let Ok(n) =
                    rustix::io::preadv2(&*file, &mut bufs, offset, rustix::io::ReadWriteFlags::NOWAIT)
                {
                    if n == len {
                        let crcs = piece.map(|p| crate::crcs_of(&buf, p)).unwrap_or_default();
                        return Ok((buf.freeze(), crcs));
                    }
                }
            }
            tokio::task::spawn_blocking(move || {
                let mut buf = aligned_buffer(len);
                buf.resize(len, 0);
                match (&direct, &probe) {
                    (Some(_), Some(p)) if read_cached(p, &mut buf, offset) => {}
                    (Some(d), _) => d.read_exact_at(&mut buf, offset)?,
                    (None, _) => file.read_exact_at(&mut buf, offset)?,
                }
                let crcs = piece.map(|p| crate::crcs_of(&buf, p)).unwrap_or_default();
                Ok((buf.freeze(), crcs))
            })
            .await
            .map_err(io::Error::other)?
        }
        .boxed()
    }

    fn open(path: PathBuf, create_len: Option<u64>) -> io::Result<RealDisk> {
        let exists = path.exists();
        if !exists {
            let Some(len) = create_len else {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("disk {} does not exist; give a size to create it", path.display()),
                ));
            };
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let f = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
            // Allocate every block now: a disk that runs out of space under a
            // write we already promised to store would be a lie.
            rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), 0, len)?;
            f.sync_all()?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                File::open(dir)?.sync_all()?;
            }
        }
        let mut file = OpenOptions::new().read(true).write(true).open(&path)?;
        // Works for regular files and block devices alike.
        let len = file.seek(SeekFrom::End(0))?;
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&path)
            .map_err(|e| tracing::info!(path = %path.display(), error = %e, "no O_DIRECT here; all disk I/O buffered"))
            .ok()
            .map(Arc::new);
        let probe = direct.as_ref().and_then(|_| {
            let f = OpenOptions::new().read(true).open(&path).ok()?;
            rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::Random).ok()?;
            Some(Arc::new(f))
        });
        let file = Arc::new(file);
        let zero_fill = ZeroFill::open(&path, &file, direct.as_ref())?;
        Ok(RealDisk {
            file,
            direct,
            probe,
            len,
            last_sync_us: Arc::new(AtomicU64::new(0)),
            unsynced: Arc::new(AtomicU64::new(0)),
            zero_fill,
        })
    }
}

impl Disk for RealDisk {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
        let read = self.read(offset, len, None);
        async move { read.await.map(|(b, _)| b) }.boxed()
    }

    fn read_at_crcs(
        &self,
        offset: u64,
        len: usize,
        piece: usize,
    ) -> BoxFuture<'static, io::Result<(Bytes, Vec<u32>)>> {
        self.read(offset, len, Some(piece))
    }

    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
        let file = self.file.clone();
        let direct = self.direct.clone();
        let disk_len = self.len;
        let zero_fill = self.zero_fill.clone();
        let unsynced = self.unsynced.clone();
        async move {
            let mut total = 0usize;
            for (off, b) in &writes {
                check_range(*off, b.len() as u64, disk_len)?;
                total += b.len();
            }
            unsynced.fetch_add(total as u64, Ordering::Relaxed);
            // Small writes go to the page cache right here: copying a few
            // KiB costs less than the two thread switches of a trip to the
            // blocking pool, and the group commit's fdatasync then sends all
            // of them to the device together instead of one request each.
            // Unless they would have to wait for zeros landing where they go
            // (`zero_fill.rs`): a runtime thread never blocks on that.
            if total <= INLINE_WRITE_MAX {
                if let Ok(writing) = zero_fill.try_begin_write(&writes) {
                    for (off, b) in &writes {
                        write_buffered(&file, *off, b)?;
                    }
                    drop(writing);
                    return Ok(());
                }
            }
            tokio::task::spawn_blocking(move || {
                // Held until the writes return; may wait for one window of
                // zeros overlapping them.
                let _writing = zero_fill.begin_write(&writes);
                for (off, b) in &writes {
                    write_blocking(&file, direct.as_deref(), *off, b)?;
                }
                Ok(())
            })
            .await
            .map_err(io::Error::other)?
        }
        .boxed()
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        let file = self.file.clone();
        let last = self.last_sync_us.clone();
        let unsynced = self.unsynced.clone();
        async move {
            tokio::task::spawn_blocking(move || timed_sync(&file, &last, &unsynced))
                .await
                .map_err(io::Error::other)?
        }
        .boxed()
    }

    fn preparing_left(&self) -> u64 {
        self.zero_fill.left()
    }

    fn prefetch(&self, offset: u64, len: u64) {
        let len = len.min(self.len.saturating_sub(offset));
        if let Some(len) = std::num::NonZeroU64::new(len) {
            // Starts readahead and returns; a failure only costs speed.
            if let Err(e) = rustix::fs::fadvise(&*self.file, offset, Some(len), rustix::fs::Advice::WillNeed)
            {
                tracing::debug!(error = %e, offset, len, "fadvise(WILLNEED) failed");
            }
        }
    }

    fn sync_alone(&self) -> BoxFuture<'static, io::Result<()>> {
        let file = self.file.clone();
        let last = self.last_sync_us.clone();
        let unsynced = self.unsynced.clone();
        let fallback = self.sync();
        async move {
            // Decided when polled, not when called: another sync may have
            // started in between.
            if sync_inline(
                last.load(Ordering::Relaxed),
                unsynced.load(Ordering::Relaxed),
                SYNCS_RUNNING.load(Ordering::SeqCst),
            ) {
                // Invariant kept: the same fdatasync as `sync`, so the same
                // writes are durable when it returns; only the thread differs.
                timed_sync(&file, &last, &unsynced)
            } else {
                fallback.await
            }
        }
        .boxed()
    }
}

fn check_range(offset: u64, len: u64, disk_len: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= disk_len => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("disk access [{offset}, +{len}) is past the disk's end ({disk_len})"),
        )),
    }
}

/// Raises this process's limit on open descriptors to the most it may
/// have (the hard limit), as servers that hold many connections do (Go's
/// runtime does it at start; systemd leaves the soft limit at 1,024 for
/// `select`'s sake, which nothing here uses). A server at its limit
/// cannot accept even a legitimate connection, and the limit is the
/// cheapest bound an attacker who opens idle connections can reach
/// (issue 56). Returns (before, after); `None` if the limits cannot be
/// read.
pub fn raise_fd_limit() -> Option<(u64, u64)> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let before = getrlimit(Resource::Nofile);
    let soft = before.current?;
    let Some(hard) = before.maximum else {
        // No hard limit: nothing to raise to.
        return Some((soft, soft));
    };
    if soft >= hard {
        return Some((soft, soft));
    }
    match setrlimit(Resource::Nofile, Rlimit { current: Some(hard), maximum: Some(hard) }) {
        Ok(()) => Some((soft, hard)),
        Err(_) => Some((soft, soft)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lone sync runs inline only when it is quick and small, and alone.
    #[test]
    fn a_lone_sync_runs_inline_only_when_quick_and_small() {
        assert!(sync_inline(200, 4096, 0));
        assert!(sync_inline(200, INLINE_SYNC_DIRTY_MAX, 0));
        // A megabyte to write back goes to the pool, however quick the
        // last sync was.
        assert!(!sync_inline(200, 1 << 20, 0));
        assert!(!sync_inline(200, INLINE_SYNC_DIRTY_MAX + 1, 0));
        // A slow device, or another sync running.
        assert!(!sync_inline(5_000, 4096, 0));
        assert!(!sync_inline(200, 4096, 1));
    }

    /// Writes count towards the next sync; a sync starts the count again.
    #[tokio::test]
    async fn writes_count_until_a_sync() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let disk = RealDisk::open(dir.path().join("d"), Some(4 << 20))?;
        disk.write_at(vec![(0, Bytes::from(vec![1u8; 4096])), (1 << 20, Bytes::from(vec![2u8; 1 << 20]))])
            .await?;
        assert_eq!(disk.unsynced.load(Ordering::Relaxed), 4096 + (1 << 20));
        disk.sync_alone().await?;
        assert_eq!(disk.unsynced.load(Ordering::Relaxed), 0);
        Ok(())
    }

    /// A created disk has its full size, and synced writes read back.
    #[tokio::test]
    async fn real_disk_round_trip() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("d");
        let d = RealDisks.open(&path, Some(16 << 20)).await?;
        assert_eq!(d.len(), 16 << 20);
        d.write_at(vec![(4096, Bytes::from_static(b"tract")), (0, Bytes::from_static(b"sb"))]).await?;
        d.sync().await?;
        assert_eq!(&d.read_at(4096, 5).await?[..], b"tract");
        assert_eq!(&d.read_at(0, 2).await?[..], b"sb");
        // Writes from aligned and unaligned buffers read back.
        let page: Vec<u8> = (0..8192).map(|i| (i % 253) as u8).collect();
        d.write_at(vec![(8192, Bytes::from(page.clone())), (16384, Bytes::copy_from_slice(&page[..4096]))])
            .await?;
        let odd = Bytes::from([&[7u8][..], &page[..]].concat()).slice(1..);
        d.write_at(vec![(32768, odd)]).await?;
        assert_eq!(&d.read_at(8192, 8192).await?[..], &page[..]);
        assert_eq!(&d.read_at(16384, 4096).await?[..], &page[..4096]);
        assert_eq!(&d.read_at(32768, 8192).await?[..], &page[..]);
        assert_eq!(&d.read_at(8190, 4).await?[..], &[0, 0, page[0], page[1]]);
        assert!(d.read_at((16 << 20) - 1, 2).await.is_err());
        // A large aligned read goes around the page cache and still sees
        // the buffered write before it.
        let big: Vec<u8> = (0..INLINE_WRITE_MAX * 2).map(|i| (i % 251) as u8).collect();
        d.write_at(vec![(65536, Bytes::from(big.clone()))]).await?;
        assert_eq!(&d.read_at(65536, big.len()).await?[..], &big[..]);
        // With the checksums of each piece, large (blocking pool) and small
        // (inline) alike.
        for (at, len) in [(65536, big.len()), (65536 + 4096, 8192)] {
            let (b, crcs) = d.read_at_crcs(at as u64, len, 4096).await?;
            assert_eq!(&b[..], &big[at - 65536..at - 65536 + len]);
            assert_eq!(crcs, crate::crcs_of(&b, 4096));
            assert_eq!(crcs.len(), len / 4096);
        }
        // Prefetching is only a hint: a range past the end is cut, nothing
        // read changes.
        d.prefetch(0, 64 << 20);
        d.prefetch(16 << 20, 4096);
        assert_eq!(&d.read_at(8192, 8192).await?[..], &page[..]);
        // A write large enough to go direct, from an unaligned buffer and
        // from an aligned one, over a range whose start is cached from a
        // buffered write: small reads (cached) and large ones see it.
        let at = 8u64 << 20;
        d.write_at(vec![(at, Bytes::from(vec![1u8; 4096]))]).await?;
        assert_eq!(&d.read_at(at, 4096).await?[..], &[1u8; 4096][..]);
        let huge: Vec<u8> = (0..DIRECT_WRITE_MIN).map(|i| (i % 241) as u8).collect();
        let odd = Bytes::from([&[9u8][..], &huge[..]].concat()).slice(1..);
        d.write_at(vec![(at, odd)]).await?;
        assert_eq!(&d.read_at(at, 4096).await?[..], &huge[..4096]);
        assert_eq!(&d.read_at(at, huge.len()).await?[..], &huge[..]);
        let mut aligned = aligned_buffer(huge.len());
        aligned.extend_from_slice(&huge[..]);
        aligned[0] = 77;
        d.write_at(vec![(at, aligned.freeze())]).await?;
        assert_eq!(d.read_at(at, 1).await?[0], 77);
        d.sync().await?;
        drop(d);
        let d = RealDisks.open(&path, None).await?;
        assert_eq!(&d.read_at(4096, 5).await?[..], b"tract");
        assert_eq!(&d.read_at(8192, 8192).await?[..], &page[..]);
        assert_eq!(d.read_at(8 << 20, 1).await?[0], 77);
        assert_eq!(&d.read_at((8 << 20) + 1, 4095).await?[..], &huge[1..4096]);
        assert!(RealDisks.open(&dir.path().join("missing"), None).await.is_err());
        Ok(())
    }

    /// A large read is copied from the page cache only when the whole
    /// range is there: a range dropped from the cache, whole or in the
    /// middle, is left to the direct read (and `read_at` returns the same
    /// bytes either way).
    #[tokio::test]
    async fn large_reads_come_from_the_cache_only_when_all_of_it_is_there() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("d");
        let d = RealDisks.open(&path, Some(16 << 20)).await?;
        let big: Vec<u8> = (0..1usize << 20).map(|i| (i % 249) as u8).collect();
        d.write_at(vec![(1 << 20, Bytes::from(big.clone()))]).await?;
        d.sync().await?;
        let probe = File::open(&path)?;
        rustix::fs::fadvise(&probe, 0, None, rustix::fs::Advice::Random)?;
        let mut buf = vec![0u8; big.len()];
        assert!(read_cached(&probe, &mut buf, 1 << 20), "just written: cached");
        assert!(buf == big);
        assert!(!read_cached(&probe, &mut [0u8; 4096], 0), "too small to look for");

        // Dropped from the cache (it is clean after the sync): a miss.
        let drop_range = |off: u64, len: u64| {
            rustix::fs::fadvise(&probe, off, std::num::NonZeroU64::new(len), rustix::fs::Advice::DontNeed)
        };
        drop_range(1 << 20, 1 << 20)?;
        assert!(!read_cached(&probe, &mut buf, 1 << 20), "dropped: a miss");
        // Only the middle gone: still a miss.
        d.read_at(1 << 20, 4096).await?;
        d.read_at((2 << 20) - 4096, 4096).await?;
        drop_range((1 << 20) + 65536, 65536)?;
        assert!(!read_cached(&probe, &mut buf, 1 << 20), "a hole in the middle is a miss");
        assert_eq!(&d.read_at(1 << 20, big.len()).await?[..], &big[..]);
        Ok(())
    }

    /// Zero-filling leaves no hole in a fresh disk file and never lands on
    /// data written while it runs (small inline writes and large ones on
    /// the blocking pool, from several tasks, racing its windows), nor on data written
    /// before it started. (Shown to catch writes that skip `begin_write`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn zero_fill_keeps_every_write() -> io::Result<()> {
        const TASKS: u64 = 4;
        const BLOCK: u64 = 512 << 10;
        let dir = tempfile::tempdir()?;
        for seed in 0..4u64 {
            let path = dir.path().join(format!("d{seed}"));
            let len = 64u64 << 20;
            let before = RealDisks.open(&path, Some(len)).await?;
            // Inside the first block, which no task below writes.
            before.write_at(vec![(4096, Bytes::from(vec![0xEE; 4096]))]).await?;
            // A second open shares the first one's filler.
            let d = Arc::new(RealDisk::open(path.clone(), None)?);
            drop(before);
            let mut tasks = Vec::new();
            for t in 0..TASKS {
                let d = d.clone();
                tasks.push(tokio::spawn(async move {
                    // Each task writes inside its own blocks (block % TASKS == t),
                    // all but block 0.
                    let mut rng = rand::rngs::StdRng::seed_from_u64(seed * TASKS + t);
                    let mut written: Vec<(u64, u8, usize)> = Vec::new();
                    let mut rounds = 0u32;
                    while !d.zero_fill.is_done() || rounds < 50 {
                        assert!(rounds < 1_000_000, "zero-fill did not finish");
                        rounds += 1;
                        let mut block = (rng.next_u64() % (len / BLOCK / TASKS - 1) + 1) * TASKS + t;
                        // Every other write aims at the window being zeroed.
                        if let Some((z, _)) = d.zero_fill.zeroing().filter(|_| rounds.is_multiple_of(2)) {
                            let mut near = z / BLOCK..(z / BLOCK + TASKS).min(len / BLOCK);
                            block = near.find(|b| b % TASKS == t && *b != 0).unwrap_or(block);
                        }
                        let pages = 1u64 << (rng.next_u64() % 8);
                        let off = block * BLOCK + (rng.next_u64() % (BLOCK / 4096 - pages + 1)) * 4096;
                        let n = (pages * 4096) as usize;
                        let tag = (rounds % 251) as u8 + 1;
                        let mut data = aligned_buffer(n);
                        data.resize(n, tag);
                        d.write_at(vec![(off, data.freeze())]).await?;
                        written.retain(|&(o, _, l)| o + l as u64 <= off || off + n as u64 <= o);
                        written.push((off, tag, n));
                    }
                    for (off, tag, l) in written {
                        let got = d.read_at(off, l).await?;
                        assert!(got.iter().all(|&b| b == tag), "write at {off} (+{l}) was overwritten");
                    }
                    io::Result::Ok(())
                }));
            }
            for t in tasks {
                t.await.map_err(io::Error::other)??;
            }
            assert!(
                d.read_at(4096, 4096).await?.iter().all(|&b| b == 0xEE),
                "a write from before was zeroed"
            );
            let file = File::open(&path)?;
            assert_eq!(rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(0))?, len, "a hole is left");
        }
        Ok(())
    }
}
