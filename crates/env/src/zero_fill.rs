//! Zero-filling a disk file's unwritten extents in the background.
//!
//! A disk file is created with fallocate(2) (`RealDisk::open`), which on
//! ext4 and XFS reserves *unwritten* extents. The first write into an
//! unwritten block converts it, a metadata change that the next
//! `fdatasync` must commit through the file system's journal. Measured on
//! this project's machine (ext4 on a virtio disk): a 4 KiB write to each of
//! two pages plus an `fdatasync` took 320–380 µs in a fresh fallocated file
//! and 160–185 µs in a written one. A tractserver's durable writes are
//! exactly that shape, so on a new disk every first write to a page paid
//! twice, for as long as the disk had unwritten space: all of a 5-second
//! random-write benchmark, and the first pass of a VM's disk.
//!
//! So, once a file is open, a thread writes zeros over everything the file
//! system still reports as a hole, until none is left. Raw block devices
//! have no extents and are left alone.
//!
//! Invariants, and how they are kept:
//! - Zeros go only where a reader already sees zeros: ranges `lseek`
//!   reports as holes. On ext4 and XFS these are unwritten extents with no
//!   cached page; a page written by anyone (dirty in the page cache, or
//!   written back) is data, so a write from this or an earlier (killed)
//!   process is never zeroed. What a crash does to a half-done zero write
//!   is again zeros or an unwritten block: nothing a reader can tell apart.
//! - Zeros never land on a write of this process: the thread zeroes one
//!   window at a time, asks `lseek` for holes only after every write in
//!   progress that overlaps the window has finished, and a write that
//!   overlaps the window waits until the window is done, then lands on top.
//! - All opens of one file in this process share one [`ZeroFill`] (keyed by
//!   device and inode), so a disk reopened while an old handle lives (a
//!   server restarted inside a test) still coordinates with the one thread.

// Part of the real side of the seam (see `real.rs`): it times and paces
// itself with the system clock and runs its own thread.
#![allow(clippy::disallowed_methods)]

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;

use bytes::Bytes;

use crate::{aligned_buffer, DIRECT_IO_ALIGN};

/// Zeros are written one window at a time: a write overlapping the window
/// waits at most for one such device write (≈ 1–2 ms at 1 MiB).
const WINDOW: u64 = 1 << 20;

/// The thread makes its zeros durable after this many bytes (see `run`).
const SYNC_EVERY: u64 = 64 << 20;

/// After each window the thread rests as long as the window took, so
/// foreground I/O keeps at least half of the device's time.
const REST_FACTOR: u32 = 1;

/// Coordination between one file's writers and its zero-filling thread.
#[derive(Default)]
pub(crate) struct ZeroFill {
    /// Set once no hole is left: writes then skip every step below.
    done: AtomicBool,
    /// Bytes of the file the running filler has not reached yet; 0 when no
    /// filler runs (done, or stopped by an error).
    left: AtomicU64,
    state: Mutex<State>,
    changed: Condvar,
    #[cfg(test)]
    after_holes: Mutex<Option<AfterHoles>>,
}

#[derive(Default)]
struct State {
    /// The window being zeroed now.
    zeroing: Option<(u64, u64)>,
    /// Ranges of writes in progress (one entry per range, duplicates kept).
    writing: Vec<(u64, u64)>,
    /// A thread is zero-filling this file.
    running: bool,
}

/// Called by the filler with a window's start once it knows the window's
/// holes and before it writes zeros there (tests pause it at that point).
#[cfg(test)]
type AfterHoles = Box<dyn Fn(u64) + Send>;

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// Every [`ZeroFill`] alive in this process, by (device, inode).
type Registry = HashMap<(u64, u64), Weak<ZeroFill>>;

fn registry() -> MutexGuard<'static, Registry> {
    static FILES: OnceLock<Mutex<Registry>> = OnceLock::new();
    lock(FILES.get_or_init(Default::default))
}

/// The state is a few ranges with no invariant a panic could break
/// half-way, so a poisoned lock is used as is.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes in progress, registered with [`ZeroFill::begin_write`]; dropping
/// it lets the zero-filling thread near them go on.
pub(crate) struct Writing {
    zf: Arc<ZeroFill>,
    ranges: Vec<(u64, u64)>,
}

impl Drop for Writing {
    fn drop(&mut self) {
        let mut st = lock(&self.zf.state);
        for r in &self.ranges {
            if let Some(i) = st.writing.iter().position(|w| w == r) {
                st.writing.swap_remove(i);
            }
        }
        drop(st);
        self.zf.changed.notify_all();
    }
}

impl ZeroFill {
    /// The shared state of `file`, starting its zero-filling thread if the
    /// file is a regular file with holes and no thread runs for it yet.
    pub(crate) fn open(
        path: &std::path::Path,
        file: &Arc<File>,
        direct: Option<&Arc<File>>,
    ) -> io::Result<Arc<ZeroFill>> {
        let meta = file.metadata()?;
        let key = (meta.dev(), meta.ino());
        let mut files = registry();
        files.retain(|_, w| w.strong_count() > 0);
        let zf = match files.get(&key).and_then(Weak::upgrade) {
            Some(zf) => zf,
            None => {
                let zf = Arc::new(ZeroFill::default());
                files.insert(key, Arc::downgrade(&zf));
                zf
            }
        };
        drop(files);
        if !meta.file_type().is_file() {
            zf.done.store(true, Ordering::Release);
            return Ok(zf);
        }
        let len = meta.len();
        let unwritten = holes(file, 0, len)?.iter().map(|(a, b)| b - a).sum::<u64>();
        let mut st = lock(&zf.state);
        if st.running {
            // The thread started by an earlier open goes on.
        } else if unwritten == 0 {
            zf.done.store(true, Ordering::Release);
        } else {
            st.running = true;
            zf.left.store(len, Ordering::Relaxed);
            let filler = Filler {
                zf: Arc::downgrade(&zf),
                file: file.clone(),
                direct: direct.cloned(),
                len,
                path: path.to_path_buf(),
            };
            tracing::info!(
                disk = %path.display(),
                mib = unwritten >> 20,
                "zero-filling the disk's unwritten space in the background; until it is done, the first \
                 durable write to each of its pages costs about twice as much"
            );
            std::thread::Builder::new().name("zero-fill".into()).spawn(move || filler.run(unwritten))?;
        }
        drop(st);
        Ok(zf)
    }

    /// Whether every hole has been filled.
    pub(crate) fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Bytes of the file the filler has not reached yet (0: none runs).
    pub(crate) fn left(&self) -> u64 {
        self.left.load(Ordering::Relaxed)
    }

    /// The window being zeroed now (for tests aiming writes at it).
    #[cfg(test)]
    pub(crate) fn zeroing(&self) -> Option<(u64, u64)> {
        lock(&self.state).zeroing
    }

    /// Registers `writes` as in progress, first waiting for any window
    /// being zeroed that overlaps them (at most one device write of
    /// [`WINDOW`] bytes). Keep the result until the writes have returned.
    /// `None` once the file has no holes left.
    pub(crate) fn begin_write(self: &Arc<Self>, writes: &[(u64, Bytes)]) -> Option<Writing> {
        // Waiting, `register` cannot fail.
        self.register(writes, true).ok().flatten()
    }

    /// [`begin_write`](Self::begin_write) for a thread that must not block:
    /// `Err` if the writes would have to wait.
    pub(crate) fn try_begin_write(
        self: &Arc<Self>,
        writes: &[(u64, Bytes)],
    ) -> Result<Option<Writing>, WouldWait> {
        self.register(writes, false)
    }

    fn register(self: &Arc<Self>, writes: &[(u64, Bytes)], wait: bool) -> Result<Option<Writing>, WouldWait> {
        if self.is_done() {
            return Ok(None);
        }
        let ranges: Vec<(u64, u64)> = writes.iter().map(|(o, b)| (*o, *o + b.len() as u64)).collect();
        let mut st = lock(&self.state);
        while st.zeroing.is_some_and(|z| ranges.iter().any(|r| overlaps(*r, z))) {
            if !wait {
                return Err(WouldWait);
            }
            st = self.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.writing.extend_from_slice(&ranges);
        Ok(Some(Writing { zf: self.clone(), ranges }))
    }
}

/// Writes that would wait for a window of zeros (see
/// [`ZeroFill::try_begin_write`]).
#[derive(Debug)]
pub(crate) struct WouldWait;

/// `[start, end)`'s holes, as `lseek` reports them.
fn holes(file: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let hole = rustix::fs::seek(file, rustix::fs::SeekFrom::Hole(pos))?;
        if hole >= end {
            break;
        }
        let data = match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(hole)) {
            Ok(d) => d.min(end),
            // No data after `hole`: the hole runs to the end of the file.
            Err(rustix::io::Errno::NXIO) => end,
            Err(e) => return Err(e.into()),
        };
        out.push((hole, data));
        pos = data;
    }
    Ok(out)
}

/// The zero-filling thread of one file.
struct Filler {
    /// Weak, so the thread stops once every handle of the disk is gone.
    zf: Weak<ZeroFill>,
    file: Arc<File>,
    direct: Option<Arc<File>>,
    len: u64,
    path: PathBuf,
}

impl Filler {
    fn run(self, unwritten: u64) {
        let started = Instant::now();
        let zeros = {
            let mut b = aligned_buffer(WINDOW as usize);
            b.resize(WINDOW as usize, 0);
            b.freeze()
        };
        let mut window = 0u64;
        let mut unsynced = 0u64;
        let result = loop {
            let Some(zf) = self.zf.upgrade() else {
                return; // the disk was closed; a later open starts over
            };
            // Skip straight to the next hole (`lseek` refuses offsets at
            // or past the end).
            let next = match window < self.len {
                false => None,
                true => match rustix::fs::seek(&*self.file, rustix::fs::SeekFrom::Hole(window)) {
                    Ok(h) if h < self.len => Some(h - h % WINDOW),
                    Ok(_) => None,
                    Err(e) => break Err(e.into()),
                },
            };
            let Some(start) = next else { break self.file.sync_data() };
            let end = (start + WINDOW).min(self.len);
            let t = Instant::now();
            match self.fill_window(&zf, start, end, &zeros) {
                Ok(n) => unsynced += n,
                Err(e) => break Err(e),
            }
            // Synced as it goes, so a device with a write-back cache never
            // holds much of it: a flush is device-wide, and a server's next
            // fdatasync would otherwise wait for gigabytes of zeros.
            if unsynced >= SYNC_EVERY {
                if let Err(e) = self.file.sync_data() {
                    break Err(e);
                }
                unsynced = 0;
            }
            window = end;
            zf.left.store(self.len - end, Ordering::Relaxed);
            drop(zf);
            std::thread::sleep(t.elapsed() * REST_FACTOR);
        };
        let Some(zf) = self.zf.upgrade() else { return };
        let mut st = lock(&zf.state);
        st.running = false;
        zf.left.store(0, Ordering::Relaxed);
        match result {
            Ok(()) => {
                zf.done.store(true, Ordering::Release);
                tracing::info!(
                    disk = %self.path.display(),
                    mib = unwritten >> 20,
                    secs = started.elapsed().as_secs_f64(),
                    "disk fully written: zero-fill done"
                );
            }
            Err(e) => tracing::warn!(
                disk = %self.path.display(),
                error = %e,
                "zero-filling stopped; the disk works, but first writes into its unwritten space stay \
                 slower until the next start"
            ),
        }
    }

    /// Zeroes the holes of `[start, end)` with no write of this process
    /// overlapping it; returns how many bytes it wrote.
    fn fill_window(&self, zf: &ZeroFill, start: u64, end: u64, zeros: &Bytes) -> io::Result<u64> {
        let mut st = lock(&zf.state);
        while st.writing.iter().any(|w| overlaps(*w, (start, end))) {
            st = zf.changed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        st.zeroing = Some((start, end));
        drop(st);
        // Holes are asked for only now: every write that overlapped the
        // window has returned (its pages are data), and new ones wait.
        let result = holes(&self.file, start, end).and_then(|hs| {
            #[cfg(test)]
            if let Some(f) = &*lock(&zf.after_holes) {
                f(start);
            }
            hs.into_iter().try_fold(0, |sum, (a, b)| {
                let n = (b - a) as usize;
                match &self.direct {
                    Some(d)
                        if a.is_multiple_of(DIRECT_IO_ALIGN as u64) && n.is_multiple_of(DIRECT_IO_ALIGN) =>
                    {
                        d.write_all_at(&zeros[..n], a)?
                    }
                    _ => self.file.write_all_at(&zeros[..n], a)?,
                }
                Ok(sum + (b - a))
            })
        });
        lock(&zf.state).zeroing = None;
        zf.changed.notify_all();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// The filler asks for a window's holes only after every write in
    /// progress there has returned: a write registered but not yet in the
    /// file (a hole to `lseek`) must not be zeroed once it lands. The filler
    /// is paused between its `lseek` and its zero write, the one moment a
    /// filler that did not wait would overwrite the data. (Shown to catch
    /// a `fill_window` that skips its wait.)
    #[test]
    fn filler_waits_for_writes_in_progress() -> io::Result<()> {
        const LEN: u64 = 16 * WINDOW;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("disk");
        let file =
            std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
        rustix::fs::fallocate(&file, rustix::fs::FallocateFlags::empty(), 0, LEN)?;
        let file = Arc::new(file);
        let zf = ZeroFill::open(&path, &file, None)?;
        assert!(zf.left() > WINDOW, "progress starts at the file's length");
        // The last window: the filler spends many windows getting there.
        let target = LEN - WINDOW;
        let (reached_tx, reached_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        *lock(&zf.after_holes) = Some(Box::new(move |start| {
            if start == target {
                let _ = reached_tx.send(());
                let _ = go_rx.recv();
            }
        }));
        let off = target + 8192;
        let data = Bytes::from(vec![0xAB; 4096]);
        let writing = zf.begin_write(&[(off, data.clone())]);
        assert!(writing.is_some(), "the file had holes");
        // A correct filler waits for the write and does not get here.
        let raced = reached_rx.recv_timeout(Duration::from_secs(2)).is_ok();
        file.write_all_at(&data, off)?;
        drop(writing);
        let _ = go_tx.send(());
        let deadline = Instant::now() + Duration::from_secs(60);
        while !zf.is_done() {
            assert!(Instant::now() < deadline, "zero-fill did not finish");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(zf.left(), 0, "progress ends at 0");
        let mut got = vec![0u8; 4096];
        file.read_exact_at(&mut got, off)?;
        assert!(got.iter().all(|&b| b == 0xAB), "the write was zeroed (filler passed it: {raced})");
        Ok(())
    }
}
