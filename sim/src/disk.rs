//! The simulated disk: in-memory, seeded, with a written-down fault model
//! (TigerBeetle's `testing/storage.zig` does the same beside its fake).
//!
//! A [`SimDisk`]'s state lives in an `Arc` owned by the harness through a
//! host's [`SimDisks`] registry, not by the host's software: when the harness
//! crashes a host (turmoil `crash`/`bounce` drops its tasks) it calls
//! [`SimDisks::crash`], and the next incarnation opens the same disks and
//! finds what a real tractserver would find after power loss.
//!
//! Each disk holds two images, stored sparsely in `CHUNK_SIZE` pages (a
//! disk sized for many tract slots costs memory only for what was written):
//! the *visible* image (what reads return: durable data plus every write
//! not yet synced, like a page cache) and the *durable* image (what survives
//! a crash), plus the list of pending writes between them, in order.
//!
//! # Fault model
//!
//! | Fault | Injected when | What the system above must survive |
//! |---|---|---|
//! | Lost unsynced write | [`SimDisk::crash`]: each pending write independently, weight `crash_lost_weight` | Anything not acknowledged after `sync` may vanish; acknowledged (synced) data never does. The group commit must `sync` before acking (design 0002). |
//! | Kept unsynced write | [`SimDisk::crash`]: weight `crash_kept_weight` | Unacknowledged writes may nevertheless be on disk after restart: recovery must not assume "not synced ⇒ not there" (e.g. a slot entry whose generation is newer than anything acknowledged). |
//! | Torn write | [`SimDisk::crash`]: weight `crash_torn_weight`; each [`SECTOR_SIZE`] sector the write touches is kept or lost by a fair coin | A multi-sector structure (chunk, slot entry pair, positions slot) may be half old, half new: CRCs must catch it, and the A/B positions slots must leave one readable. Sectors themselves are atomic: a byte never mixes within a sector. |
//! | Reordered persistence | [`SimDisk::crash`]: the fates of pending writes are independent | A later unsynced write may survive while an earlier one is lost: no ordering between writes without a `sync` between them. |
//! | Bit rot | [`SimDisk::flip_bit`], [`SimDisk::corrupt_random`]: only when a test asks | Durable data changes under the system: reads must verify CRCs end to end and fall back to another replica (the scrubber repairs later). |
//! | EIO on write / sync | [`SimDisk::fail_writes`], [`SimDisk::fail_syncs`]: the next `n` calls, when a test asks | An error must reach the client as a failed write, never as an ack. A failed write changes nothing; a failed sync leaves its writes pending (they may still be lost or torn on crash), as Linux's `fdatasync` may. |
//! | Full disk | [`SimDisk::set_full`]: while a test (or the cluster simulation's chaos schedule) says so | A device out of space (a thin-provisioned volume, a copy-on-write file system: preallocating does not rule it out) fails writes with ENOSPC after storing any prefix of them, the last piece cut at a page boundary. The failed write must not be acknowledged, and memory must still describe the disk afterwards: a later write, a restart or a crash must find every acknowledged byte. |
//! | Slow disk | [`FaultConfig::io_latency`] + up to `io_latency_jitter` per operation, simulated time | Timeouts, queues and the write-speed measurement must cope with slow disks; nothing may assume I/O is instant. |
//!
//! Not injected (yet): misdirected writes (a write landing at the wrong
//! offset) and latent read errors. A tractserver that runs out of tract
//! slots is the slot allocator's business above, not a disk fault.
//!
//! Not faults, but checked: an access past the end of the disk is an
//! `InvalidInput` error and changes nothing; it never panics.
//!
//! Determinism: every choice draws from the disk's own generator, seeded
//! from the registry's seed and the disk's path; pending writes are kept in
//! order and disks in a `BTreeMap`, so a seed replays every crash outcome.
//!
//! A subtlety of the two images: bit rot is applied to the durable image,
//! and to the visible one only where no pending write covers the byte (the
//! page cache holds the newer data there, and the write will overwrite the
//! rotten byte on the medium). Reads of clean data see rot at once, as with
//! direct I/O: the strictest choice for the CRC checks above.

use std::collections::BTreeMap;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_env::{Disk, Disks};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng as _, SeedableRng};

use crate::env::{derive_seed, lock};
use crate::SimError;

/// The unit a crash tears writes at: sectors are written atomically, so a
/// torn write leaves each sector wholly old or wholly new.
pub const SECTOR_SIZE: u64 = 512;

/// The sparse storage granule: one integrity chunk.
const PAGE_SIZE: u64 = CHUNK_SIZE as u64;

const _: () = assert!(PAGE_SIZE.is_multiple_of(SECTOR_SIZE));

/// The errno a failing disk reports.
const EIO: i32 = 5;
/// The errno a full disk reports.
const ENOSPC: i32 = 28;

/// How a disk misbehaves. The crash weights are relative: with the default
/// 1/1/1 each pending write is lost, kept or torn with probability 1/3. All
/// three zero means every pending write is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultConfig {
    pub crash_lost_weight: u32,
    pub crash_kept_weight: u32,
    pub crash_torn_weight: u32,
    /// Added to every read, write and sync, in simulated time.
    pub io_latency: Duration,
    /// A uniformly random extra delay in `[0, io_latency_jitter]` per
    /// operation, drawn from the disk's generator.
    pub io_latency_jitter: Duration,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            crash_lost_weight: 1,
            crash_kept_weight: 1,
            crash_torn_weight: 1,
            io_latency: Duration::ZERO,
            io_latency_jitter: Duration::ZERO,
        }
    }
}

impl FaultConfig {
    /// A disk whose crashes keep every completed write: for tests that are
    /// about something else and want no crash losses.
    pub fn crash_keeps_all() -> Self {
        FaultConfig { crash_lost_weight: 0, crash_kept_weight: 1, crash_torn_weight: 0, ..Self::default() }
    }
}

/// What one crash did to the pending writes, for the run's trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CrashReport {
    pub lost: usize,
    pub kept: usize,
    pub torn: usize,
}

impl CrashReport {
    pub fn add(&mut self, other: CrashReport) {
        self.lost += other.lost;
        self.kept += other.kept;
        self.torn += other.torn;
    }
}

/// A sparse byte image: absent pages read as zeros.
#[derive(Clone, Default)]
struct Pages(BTreeMap<u64, Box<[u8]>>);

impl Pages {
    fn read(&self, offset: u64, buf: &mut [u8]) {
        let mut done = 0usize;
        while done < buf.len() {
            let at = offset + done as u64;
            let (page, in_page) = (at / PAGE_SIZE, (at % PAGE_SIZE) as usize);
            let n = (PAGE_SIZE as usize - in_page).min(buf.len() - done);
            let dst = &mut buf[done..done + n];
            match self.0.get(&page) {
                Some(p) => dst.copy_from_slice(&p[in_page..in_page + n]),
                None => dst.fill(0),
            }
            done += n;
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let (page, in_page) = (at / PAGE_SIZE, (at % PAGE_SIZE) as usize);
            let n = (PAGE_SIZE as usize - in_page).min(data.len() - done);
            let p = self.0.entry(page).or_insert_with(|| vec![0u8; PAGE_SIZE as usize].into_boxed_slice());
            p[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
            done += n;
        }
    }

    fn flip(&mut self, offset: u64, bit: u8) {
        let mut b = [0u8];
        self.read(offset, &mut b);
        b[0] ^= 1 << bit;
        self.write(offset, &b);
    }
}

/// A completed write not yet made durable.
struct Pending {
    seq: u64,
    offset: u64,
    data: Bytes,
}

struct DiskState {
    config: FaultConfig,
    visible: Pages,
    durable: Pages,
    /// In completion order (ascending `seq`).
    pending: Vec<Pending>,
    next_seq: u64,
    rng: SmallRng,
    fail_writes: u64,
    fail_syncs: u64,
    /// Out of space ([`SimDisk::set_full`]).
    full: bool,
    /// Writes failed with ENOSPC so far.
    refused: u64,
}

struct DiskInner {
    len: u64,
    state: Mutex<DiskState>,
}

/// One simulated disk. Cloning gives another handle to the same disk.
#[derive(Clone)]
pub struct SimDisk(Arc<DiskInner>);

fn check_range(offset: u64, len: u64, disk_len: u64) -> Result<(), SimError> {
    match offset.checked_add(len) {
        Some(end) if end <= disk_len => Ok(()),
        _ => Err(SimError::OutOfRange { offset, len, disk_len }),
    }
}

impl SimDisk {
    /// A zero-filled disk of `len` bytes whose fault choices draw from `seed`.
    pub fn new(len: u64, seed: u64, config: FaultConfig) -> SimDisk {
        SimDisk(Arc::new(DiskInner {
            len,
            state: Mutex::new(DiskState {
                config,
                visible: Pages::default(),
                durable: Pages::default(),
                pending: Vec::new(),
                next_seq: 0,
                rng: SmallRng::seed_from_u64(seed),
                fail_writes: 0,
                fail_syncs: 0,
                full: false,
                refused: 0,
            }),
        }))
    }

    /// The disk's size in bytes.
    pub fn size(&self) -> u64 {
        self.0.len
    }

    pub fn faults(&self) -> FaultConfig {
        lock(&self.0.state).config.clone()
    }

    /// Changes the fault model from now on (e.g. make one disk slow).
    pub fn set_faults(&self, config: FaultConfig) {
        lock(&self.0.state).config = config;
    }

    /// Makes the next `n` `write_at` calls fail with EIO, changing nothing.
    pub fn fail_writes(&self, n: u64) {
        lock(&self.0.state).fail_writes = n;
    }

    /// Runs the disk out of space (`true`) or gives the space back. While
    /// full, every `write_at` stores a random prefix of its pieces (the last
    /// one cut at a page boundary, as a short buffered `pwrite` followed by
    /// a failing one leaves it: the kernel copies page by page and stops at
    /// the first page it finds no room for) and fails with ENOSPC; syncs
    /// still work.
    pub fn set_full(&self, full: bool) {
        lock(&self.0.state).full = full;
    }

    /// How many writes failed for lack of space.
    pub fn writes_refused(&self) -> u64 {
        lock(&self.0.state).refused
    }

    /// Makes the next `n` `sync` calls fail with EIO, leaving their writes
    /// pending.
    pub fn fail_syncs(&self, n: u64) {
        lock(&self.0.state).fail_syncs = n;
    }

    /// How many completed writes are not yet durable.
    pub fn pending_writes(&self) -> usize {
        lock(&self.0.state).pending.len()
    }

    /// The durable image of `[offset, offset + len)`: what a crash that
    /// loses every pending write would leave. For checkers.
    pub fn read_durable(&self, offset: u64, len: usize) -> Result<Vec<u8>, SimError> {
        check_range(offset, len as u64, self.0.len)?;
        let mut buf = vec![0u8; len];
        lock(&self.0.state).durable.read(offset, &mut buf);
        Ok(buf)
    }

    /// Power loss: decides the fate of every pending write (lost, kept or
    /// torn at sector granularity, see the module's fault model), applies
    /// the survivors to the durable image in completion order, and makes the
    /// visible image equal to it. Nothing is pending afterwards.
    pub fn crash(&self) -> CrashReport {
        let mut guard = lock(&self.0.state);
        let st = &mut *guard;
        let mut report = CrashReport::default();
        let c = &st.config;
        let (lost_w, kept_w, torn_w) =
            (c.crash_lost_weight as u64, c.crash_kept_weight as u64, c.crash_torn_weight as u64);
        let total = lost_w + kept_w + torn_w;
        for p in std::mem::take(&mut st.pending) {
            let pick = if total == 0 { 0 } else { st.rng.random_range(0..total) };
            if pick < lost_w {
                report.lost += 1;
            } else if pick < lost_w + kept_w {
                report.kept += 1;
                st.durable.write(p.offset, &p.data);
            } else {
                report.torn += 1;
                let end = p.offset + p.data.len() as u64;
                let mut at = p.offset;
                while at < end {
                    let next = ((at / SECTOR_SIZE + 1) * SECTOR_SIZE).min(end);
                    if st.rng.random_bool(0.5) {
                        let piece = &p.data[(at - p.offset) as usize..(next - p.offset) as usize];
                        st.durable.write(at, piece);
                    }
                    at = next;
                }
            }
        }
        st.visible = st.durable.clone();
        tracing::debug!(lost = report.lost, kept = report.kept, torn = report.torn, "sim disk crash");
        report
    }

    /// Bit rot: flips bit `bit` (0..8) of the byte at `offset` on the medium
    /// (see the module doc for how that shows through pending writes).
    pub fn flip_bit(&self, offset: u64, bit: u8) -> Result<(), SimError> {
        check_range(offset, 1, self.0.len)?;
        if bit >= 8 {
            return Err(SimError::BadBit(bit));
        }
        let mut st = lock(&self.0.state);
        st.durable.flip(offset, bit);
        let cached = st.pending.iter().any(|p| offset >= p.offset && offset - p.offset < p.data.len() as u64);
        if !cached {
            st.visible.flip(offset, bit);
        }
        Ok(())
    }

    /// What a read of `[offset, offset + len)` would return now, for the
    /// harness (no latency, no fault drawn).
    pub fn peek(&self, offset: u64, len: usize) -> Vec<u8> {
        self.read_now(offset, len)
    }

    /// Bit rot at a place chosen by the disk's generator within `range`
    /// (clipped to the disk). Returns the offset and bit flipped.
    pub fn corrupt_random(&self, range: Range<u64>) -> Result<(u64, u8), SimError> {
        let end = range.end.min(self.0.len);
        if range.start >= end {
            return Err(SimError::OutOfRange {
                offset: range.start,
                len: range.end.saturating_sub(range.start),
                disk_len: self.0.len,
            });
        }
        let (offset, bit) = {
            let mut st = lock(&self.0.state);
            (st.rng.random_range(range.start..end), st.rng.random_range(0..8u8))
        };
        self.flip_bit(offset, bit)?;
        Ok((offset, bit))
    }

    /// The configured latency plus jitter for one operation.
    fn latency(&self) -> Duration {
        let mut st = lock(&self.0.state);
        let c = &st.config;
        let (base, jitter) = (c.io_latency, c.io_latency_jitter);
        if jitter.is_zero() {
            return base;
        }
        let extra = st.rng.random_range(0..=jitter.as_nanos().min(u64::MAX as u128) as u64);
        base + Duration::from_nanos(extra)
    }

    fn read_now(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        lock(&self.0.state).visible.read(offset, &mut buf);
        buf
    }

    fn write_now(&self, writes: Vec<(u64, Bytes)>) -> Result<(), SimError> {
        let mut st = lock(&self.0.state);
        if st.fail_writes > 0 {
            st.fail_writes -= 1;
            return Err(SimError::InjectedEio { op: "write" });
        }
        // Out of space: which piece the space runs out in, and how many of
        // its sectors made it.
        let cut = if st.full {
            let piece = st.rng.random_range(0..writes.len().max(1));
            // A short write ends where the file system failed to find room
            // for the next page: at a page boundary of the disk, or before
            // the piece's first byte.
            let keep = writes.get(piece).map_or(0, |(off, d)| {
                let end = off + d.len() as u64;
                let mut cuts = vec![0usize];
                let mut b = (off / PAGE_SIZE + 1) * PAGE_SIZE;
                while b < end {
                    cuts.push((b - off) as usize);
                    b += PAGE_SIZE;
                }
                cuts[st.rng.random_range(0..cuts.len())]
            });
            Some((piece, keep))
        } else {
            None
        };
        for (i, (offset, data)) in writes.into_iter().enumerate() {
            let data = match cut {
                Some((piece, _)) if i > piece => break,
                Some((piece, keep)) if i == piece => data.slice(..keep.min(data.len())),
                _ => data,
            };
            if data.is_empty() {
                continue;
            }
            st.visible.write(offset, &data);
            let seq = st.next_seq;
            st.next_seq += 1;
            st.pending.push(Pending { seq, offset, data });
        }
        match cut {
            Some(_) => {
                st.refused += 1;
                Err(SimError::NoSpace)
            }
            None => Ok(()),
        }
    }

    /// Makes the pending writes with `seq < mark` durable.
    fn sync_now(&self, mark: u64) -> Result<(), SimError> {
        let mut guard = lock(&self.0.state);
        let st = &mut *guard;
        if st.fail_syncs > 0 {
            st.fail_syncs -= 1;
            return Err(SimError::InjectedEio { op: "sync" });
        }
        let n = st.pending.partition_point(|p| p.seq < mark);
        for p in st.pending.drain(..n) {
            st.durable.write(p.offset, &p.data);
        }
        Ok(())
    }
}

fn eio(e: SimError) -> io::Error {
    match e {
        SimError::InjectedEio { .. } => io::Error::from_raw_os_error(EIO),
        SimError::NoSpace => io::Error::from_raw_os_error(ENOSPC),
        other => other.into(),
    }
}

#[allow(clippy::disallowed_methods, reason = "the simulated disk's latency is simulated time")]
async fn delay(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

impl Disk for SimDisk {
    fn len(&self) -> u64 {
        self.0.len
    }

    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
        let disk = self.clone();
        async move {
            check_range(offset, len as u64, disk.0.len)?;
            delay(disk.latency()).await;
            Ok(Bytes::from(disk.read_now(offset, len)))
        }
        .boxed()
    }

    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
        let disk = self.clone();
        async move {
            // Validate every piece first: a rejected call changes nothing.
            for (offset, data) in &writes {
                check_range(*offset, data.len() as u64, disk.0.len)?;
            }
            delay(disk.latency()).await;
            disk.write_now(writes).map_err(eio)
        }
        .boxed()
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        // The durability promise covers writes completed before the call,
        // not those that complete while the sync is in flight.
        let mark = lock(&self.0.state).next_seq;
        let disk = self.clone();
        async move {
            delay(disk.latency()).await;
            disk.sync_now(mark).map_err(eio)
        }
        .boxed()
    }
}

struct DisksState {
    seed: u64,
    config: FaultConfig,
    disks: BTreeMap<PathBuf, SimDisk>,
}

/// One host's disks by path. Owned by the harness and handed to each
/// incarnation of the host's software, so disks outlive crashes.
#[derive(Clone)]
pub struct SimDisks(Arc<Mutex<DisksState>>);

impl SimDisks {
    /// A registry whose disks get the default fault model and generators
    /// seeded from `seed` and their path.
    pub fn new(seed: u64) -> SimDisks {
        SimDisks::with_faults(seed, FaultConfig::default())
    }

    /// A registry whose newly created disks get `config`.
    pub fn with_faults(seed: u64, config: FaultConfig) -> SimDisks {
        SimDisks(Arc::new(Mutex::new(DisksState { seed, config, disks: BTreeMap::new() })))
    }

    pub fn get(&self, path: &Path) -> Option<SimDisk> {
        lock(&self.0).disks.get(path).cloned()
    }

    /// Every disk, in path order.
    pub fn disks(&self) -> Vec<(PathBuf, SimDisk)> {
        lock(&self.0).disks.iter().map(|(p, d)| (p.clone(), d.clone())).collect()
    }

    /// Crashes every disk (in path order): the harness calls this when it
    /// crashes the host.
    pub fn crash(&self) -> CrashReport {
        let mut report = CrashReport::default();
        for (_, d) in self.disks() {
            report.add(d.crash());
        }
        report
    }

    fn open_now(&self, path: &Path, create_len: Option<u64>) -> Result<SimDisk, SimError> {
        let mut st = lock(&self.0);
        if let Some(d) = st.disks.get(path) {
            return Ok(d.clone());
        }
        let Some(len) = create_len else {
            return Err(SimError::NoSuchDisk(path.to_path_buf()));
        };
        let seed = derive_seed(st.seed, &format!("disk:{}", path.display()));
        let disk = SimDisk::new(len, seed, st.config.clone());
        st.disks.insert(path.to_path_buf(), disk.clone());
        Ok(disk)
    }
}

impl Disks for SimDisks {
    fn open(&self, path: &Path, create_len: Option<u64>) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>> {
        let result =
            self.open_now(path, create_len).map(|d| Arc::new(d) as Arc<dyn Disk>).map_err(io::Error::from);
        futures::future::ready(result).boxed()
    }

    /// Removal is durable at once (a real `unlink` followed by a directory
    /// sync, which `Disks::remove` promises). A handle still open keeps
    /// working on the removed disk's state, as an open file does.
    fn remove(&self, path: &Path) -> BoxFuture<'static, io::Result<()>> {
        lock(&self.0).disks.remove(path);
        futures::future::ready(Ok(())).boxed()
    }

    fn list(&self, dir: &Path, prefix: &str) -> BoxFuture<'static, io::Result<Vec<PathBuf>>> {
        let st = lock(&self.0);
        // `disks` is a BTreeMap: already sorted by path.
        let out = st
            .disks
            .keys()
            .filter(|p| {
                p.parent() == Some(dir)
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix))
            })
            .cloned()
            .collect();
        futures::future::ready(Ok(out)).boxed()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use futures::executor::block_on;

    const OLD: u8 = 0xAA;
    const NEW: u8 = 0x55;

    fn disk(seed: u64, config: FaultConfig) -> SimDisk {
        SimDisk::new(64 * 1024, seed, config)
    }

    fn write(d: &SimDisk, offset: u64, data: Vec<u8>) -> io::Result<()> {
        block_on(d.write_at(vec![(offset, Bytes::from(data))]))
    }

    // Synced data survives a crash under every seed, even when every
    // pending write would be lost.
    #[test]
    fn synced_data_survives_crash() -> io::Result<()> {
        for seed in 0..50 {
            let d = disk(seed, FaultConfig::default());
            write(&d, 4096, b"tract data".to_vec())?;
            block_on(d.sync())?;
            write(&d, 8192, b"unsynced".to_vec())?;
            d.crash();
            assert_eq!(&block_on(d.read_at(4096, 10))?[..], b"tract data");
            assert_eq!(d.pending_writes(), 0);
        }
        Ok(())
    }

    // Over many seeds an unsynced write is sometimes lost, sometimes kept and
    // sometimes torn, and every sector ends wholly old or wholly new.
    #[test]
    fn unsynced_writes_lost_kept_or_torn_at_sector_granularity() -> io::Result<()> {
        let (mut lost, mut kept, mut torn) = (0, 0, 0);
        for seed in 0..200 {
            let d = disk(seed, FaultConfig::default());
            // Old content over sectors 0..8, durable.
            write(&d, 0, vec![OLD; 8 * 512])?;
            block_on(d.sync())?;
            // An unaligned unsynced write touching sectors 0..=5.
            let (off, len) = (100u64, 2700usize);
            write(&d, off, vec![NEW; len])?;
            assert_eq!(block_on(d.read_at(off, len))?, vec![NEW; len], "reads see pending writes");
            let report = d.crash();
            assert_eq!(report.lost + report.kept + report.torn, 1);
            let after = block_on(d.read_at(0, 8 * 512))?;
            let (mut new_sectors, mut old_sectors) = (0, 0);
            for (s, sector) in after.chunks(512).enumerate() {
                let (s0, s1) = (s as u64 * 512, s as u64 * 512 + 512);
                let covered = |i: u64| i >= off && i < off + len as u64;
                // Bytes outside the write are old; inside, all old or all new.
                let inside: Vec<u8> =
                    (s0..s1).filter(|&i| covered(i)).map(|i| sector[(i - s0) as usize]).collect();
                assert!((s0..s1).filter(|&i| !covered(i)).all(|i| sector[(i - s0) as usize] == OLD));
                if inside.is_empty() {
                    continue;
                }
                if inside.iter().all(|&b| b == NEW) {
                    new_sectors += 1;
                } else if inside.iter().all(|&b| b == OLD) {
                    old_sectors += 1;
                } else {
                    panic!("seed {seed}: sector {s} mixes old and new bytes");
                }
            }
            match (new_sectors, old_sectors) {
                (0, _) => lost += 1,
                (_, 0) => kept += 1,
                _ => torn += 1,
            }
            if report.lost == 1 {
                assert_eq!(new_sectors, 0, "seed {seed}: a lost write left data");
            }
            if report.kept == 1 {
                assert_eq!(old_sectors, 0, "seed {seed}: a kept write is incomplete");
            }
        }
        assert!(lost > 20 && kept > 20 && torn > 20, "lost {lost} kept {kept} torn {torn}");
        Ok(())
    }

    // A crash replays: the same seed gives the same post-crash image.
    #[test]
    fn crash_outcome_is_a_function_of_the_seed() -> io::Result<()> {
        let image = |seed| -> io::Result<Bytes> {
            let d = disk(seed, FaultConfig::default());
            for i in 0..16u64 {
                write(&d, i * 1000, vec![i as u8 + 1; 1500])?;
            }
            d.crash();
            block_on(d.read_at(0, 20_000))
        };
        assert_eq!(image(3)?, image(3)?);
        assert_ne!(image(3)?, image(4)?);
        Ok(())
    }

    // Accesses past the end are InvalidInput errors that change nothing.
    #[test]
    fn out_of_range_access_errors() -> io::Result<()> {
        let d = disk(1, FaultConfig::default());
        let len = Disk::len(&d);
        assert_eq!(len, 64 * 1024);
        let kind = |r: io::Result<Bytes>| r.err().map(|e| e.kind());
        assert_eq!(kind(block_on(d.read_at(len - 1, 2))), Some(io::ErrorKind::InvalidInput));
        assert_eq!(kind(block_on(d.read_at(u64::MAX, 2))), Some(io::ErrorKind::InvalidInput));
        assert!(block_on(d.read_at(len - 1, 1)).is_ok());
        assert!(block_on(d.read_at(len, 0)).is_ok());
        let r =
            block_on(d.write_at(vec![(0, Bytes::from_static(b"ok")), (len - 1, Bytes::from_static(b"no"))]));
        assert_eq!(r.err().map(|e| e.kind()), Some(io::ErrorKind::InvalidInput));
        assert_eq!(&block_on(d.read_at(0, 2))?[..], &[0, 0], "a rejected call writes nothing");
        assert_eq!(d.pending_writes(), 0);
        assert!(d.flip_bit(len, 0).is_err());
        assert!(d.corrupt_random(len..len + 10).is_err());
        Ok(())
    }

    fn bit_diff(a: &[u8], b: &[u8]) -> u32 {
        a.iter().zip(b).map(|(x, y)| (x ^ y).count_ones()).sum()
    }

    // flip_bit changes exactly one bit, durably; corrupt_random likewise.
    #[test]
    fn flip_bit_changes_exactly_one_bit() -> io::Result<()> {
        let d = disk(9, FaultConfig::default());
        write(&d, 0, (0..=255u8).cycle().take(8192).collect())?;
        block_on(d.sync())?;
        let before = block_on(d.read_at(0, 8192))?;
        d.flip_bit(4097, 3).map_err(io::Error::from)?;
        let after = block_on(d.read_at(0, 8192))?;
        assert_eq!(bit_diff(&before, &after), 1);
        assert_eq!(after[4097], before[4097] ^ 0b1000);
        d.crash();
        assert_eq!(block_on(d.read_at(0, 8192))?, after, "rot is on the medium");
        assert!(matches!(d.flip_bit(0, 8), Err(SimError::BadBit(8))));

        let (offset, _bit) = d.corrupt_random(100..200).map_err(io::Error::from)?;
        assert!((100..200).contains(&offset));
        let again = block_on(d.read_at(0, 8192))?;
        assert_eq!(bit_diff(&after, &again), 1);
        Ok(())
    }

    // A flip under a pending write is masked by the cached write and then
    // overwritten by it: visible and durable images stay consistent.
    #[test]
    fn flip_under_pending_write_is_overwritten() -> io::Result<()> {
        let d = disk(2, FaultConfig::crash_keeps_all());
        write(&d, 0, vec![7; 512])?;
        d.flip_bit(10, 0).map_err(io::Error::from)?;
        assert_eq!(block_on(d.read_at(10, 1))?, vec![7]);
        block_on(d.sync())?;
        assert_eq!(d.read_durable(0, 512).map_err(io::Error::from)?, vec![7; 512]);
        Ok(())
    }

    // Injected EIO: the next n writes (or syncs) fail and change nothing.
    #[test]
    fn injected_eio_fails_then_recovers() -> io::Result<()> {
        let d = disk(
            4,
            FaultConfig {
                crash_lost_weight: 1,
                crash_kept_weight: 0,
                crash_torn_weight: 0,
                ..Default::default()
            },
        );
        d.fail_writes(2);
        for _ in 0..2 {
            let e = write(&d, 0, vec![1; 8]).err().map(|e| e.raw_os_error());
            assert_eq!(e, Some(Some(EIO)));
        }
        assert_eq!(block_on(d.read_at(0, 8))?, vec![0; 8]);
        write(&d, 0, vec![1; 8])?;
        d.fail_syncs(1);
        assert!(block_on(d.sync()).is_err());
        assert_eq!(d.pending_writes(), 1, "a failed sync leaves writes pending");
        d.crash();
        assert_eq!(block_on(d.read_at(0, 8))?, vec![0; 8], "and they can be lost");
        Ok(())
    }

    // sync covers the writes completed before it was called, not later ones.
    #[test]
    fn sync_covers_only_earlier_writes() -> io::Result<()> {
        let d = disk(
            5,
            FaultConfig {
                crash_lost_weight: 1,
                crash_kept_weight: 0,
                crash_torn_weight: 0,
                ..Default::default()
            },
        );
        write(&d, 0, vec![1; 4])?;
        let sync = d.sync();
        write(&d, 512, vec![2; 4])?;
        block_on(sync)?;
        assert_eq!(d.pending_writes(), 1);
        d.crash();
        assert_eq!(block_on(d.read_at(0, 4))?, vec![1; 4]);
        assert_eq!(block_on(d.read_at(512, 4))?, vec![0; 4]);
        Ok(())
    }

    // The registry creates zero-filled disks, refuses unknown ones without a
    // size, and hands back the same disk (with its data) on reopen.
    #[test]
    fn registry_open_create_reopen() -> io::Result<()> {
        let disks = SimDisks::new(11);
        let path = Path::new("/dev/sim0");
        let e = block_on(disks.open(path, None)).err().map(|e| e.kind());
        assert_eq!(e, Some(io::ErrorKind::NotFound));
        let d = block_on(disks.open(path, Some(1 << 30)))?;
        assert_eq!(d.len(), 1 << 30);
        assert_eq!(block_on(d.read_at((1 << 30) - 4, 4))?, vec![0; 4]);
        block_on(d.write_at(vec![(1 << 29, Bytes::from_static(b"superblock"))]))?;
        block_on(d.sync())?;
        drop(d);
        disks.crash();
        let d = block_on(disks.open(path, None))?;
        assert_eq!(&block_on(d.read_at(1 << 29, 10))?[..], b"superblock");
        assert_eq!(disks.disks().len(), 1);
        assert!(disks.get(path).is_some());
        Ok(())
    }

    // Injected latency is paid in simulated time, jitter within its bound.
    #[tokio::test(start_paused = true)]
    #[allow(clippy::disallowed_methods, reason = "measures simulated time in a test")]
    async fn latency_is_simulated_time() -> io::Result<()> {
        let ms = Duration::from_millis;
        let d = disk(6, FaultConfig { io_latency: ms(3), io_latency_jitter: ms(2), ..Default::default() });
        for _ in 0..10 {
            let t0 = tokio::time::Instant::now();
            d.write_at(vec![(0, Bytes::from_static(b"x"))]).await?;
            let took = t0.elapsed();
            assert!(took >= ms(3) && took <= ms(5), "took {took:?}");
        }
        let t0 = tokio::time::Instant::now();
        d.sync().await?;
        assert!(t0.elapsed() >= ms(3));
        Ok(())
    }
}
