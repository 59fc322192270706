//! Crash trials of LSVD volumes (design 0008): the same tagged workloads
//! and prefix checker as the blob-store volumes, over the in-memory object
//! store and an in-memory cache disk, each with the fault model below.
//!
//! | event | effect |
//! |---|---|
//! | cache disk write | completes after a seeded (virtual) latency; until a sync covers it, it is *unsynced*: reads see it |
//! | cache disk sync | every write completed before it started becomes durable |
//! | crash | each unsynced write is lost, kept, or torn: each 512-byte sector of it kept or not (power loss); a write not completed never happened |
//! | crash, cache lost (1 trial in 8) | the cache disk is gone: the volume must come back as a prefix from the object store alone (flushes promised nothing about that) |
//! | object put | lands after a seeded latency and is answered after another: a crash before it lands loses it, a crash after it landed but before the answer leaves it stored while the writer never learned so |
//! | object get | a seeded latency, then done |
//! | object list, delete | done at once |
//!
//! Cleaning (GC) runs in most trials: objects rewritten (small holes
//! between the pieces copied plugged in two trials of three), checkpoints
//! written and objects deleted while the workload runs and when it crashes.
//!
//! The contract checked: prefix consistency over flush epochs, and (cache
//! kept) every write acknowledged before an acknowledged flush survives.
//! Three trials in four take a snapshot right after an early flush; once
//! the volume has been recovered, written and cleaned, the snapshot must
//! read as exactly the writes acknowledged before it, whatever the crash
//! (the object store keeps it; the cache plays no part).
//! A quarter of the trials crash again while the volume is being
//! recovered (its claim, the journal's new header), then recover.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path as OPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_env::{Clock, Disk, Disks, RealClock};
use blizzard_lsvd::volume::{self, Config};
pub use blizzard_lsvd::Planted;
use blizzard_lsvd::{LsvdError, LsvdSnapshot, LsvdVolume, Store};

use crate::checker::{check, Contract, LoggedOp, OpKind, Violation};
use crate::run::{drive, plan_ops, runtime, trial_env_with, Planned, Target, Trial};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const SECTOR: usize = 512;

// ------------------------------------------------------------ the cache disk

struct DiskState {
    durable: Vec<u8>,
    /// Completed writes no sync covered yet, in completion order.
    unsynced: Vec<(u64, Bytes)>,
}

struct DiskInner {
    state: Mutex<DiskState>,
    rng: Mutex<SmallRng>,
    clock: Arc<dyn Clock>,
}

/// An in-memory disk that loses, keeps or tears unsynced writes at a crash.
#[derive(Clone)]
pub struct MemDisk(Arc<DiskInner>);

impl MemDisk {
    fn new(len: u64, seed: u64) -> MemDisk {
        MemDisk(Arc::new(DiskInner {
            state: Mutex::new(DiskState { durable: vec![0; len as usize], unsynced: Vec::new() }),
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            clock: Arc::new(RealClock),
        }))
    }

    fn latency(&self) -> Duration {
        Duration::from_micros(lock(&self.0.rng).random_range(1..40))
    }

    /// The crash: each unsynced write lost, kept, or torn sector by sector.
    fn crash(&self, rng: &mut SmallRng) {
        let mut s = lock(&self.0.state);
        let writes = std::mem::take(&mut s.unsynced);
        for (off, b) in writes {
            let at = off as usize;
            match rng.random_range(0..3) {
                0 => {}
                1 => s.durable[at..at + b.len()].copy_from_slice(&b),
                _ => {
                    for (i, sec) in b.chunks(SECTOR).enumerate() {
                        if rng.random_bool(0.5) {
                            let a = at + i * SECTOR;
                            s.durable[a..a + sec.len()].copy_from_slice(sec);
                        }
                    }
                }
            }
        }
    }
}

impl Disk for MemDisk {
    fn len(&self) -> u64 {
        lock(&self.0.state).durable.len() as u64
    }

    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
        let s = lock(&self.0.state);
        let (off, end) = (offset as usize, offset as usize + len);
        let r = if end > s.durable.len() {
            Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))
        } else {
            let mut out = s.durable[off..end].to_vec();
            for (o, b) in &s.unsynced {
                let (o, bend) = (*o as usize, *o as usize + b.len());
                let (a, z) = (o.max(off), bend.min(end));
                if a < z {
                    out[a - off..z - off].copy_from_slice(&b[a - o..z - o]);
                }
            }
            Ok(Bytes::from(out))
        };
        Box::pin(async move { r })
    }

    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
        let sleep = self.0.clock.sleep(self.latency());
        let me = self.0.clone();
        // The write happens when the latency is over; a crash before that
        // (the task dropped) means it never happened.
        Box::pin(async move {
            sleep.await;
            let mut s = lock(&me.state);
            for (off, b) in writes {
                if off as usize + b.len() > s.durable.len() {
                    return Err(io::Error::other("write past the end"));
                }
                s.unsynced.push((off, b));
            }
            Ok(())
        })
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        let me = self.0.clone();
        let n = lock(&self.0.state).unsynced.len();
        let sleep = self.0.clock.sleep(self.latency());
        Box::pin(async move {
            sleep.await;
            let mut s = lock(&me.state);
            // Only what completed before the sync started is covered.
            let n = n.min(s.unsynced.len());
            let covered: Vec<(u64, Bytes)> = s.unsynced.drain(..n).collect();
            for (off, b) in covered {
                s.durable[off as usize..off as usize + b.len()].copy_from_slice(&b);
            }
            Ok(())
        })
    }
}

/// The trial's disks, by path.
#[derive(Clone)]
pub struct MemDisks {
    disks: Arc<Mutex<BTreeMap<PathBuf, MemDisk>>>,
    seed: u64,
}

impl MemDisks {
    pub fn new(seed: u64) -> MemDisks {
        MemDisks { disks: Arc::new(Mutex::new(BTreeMap::new())), seed }
    }

    /// Every disk crashes.
    pub fn crash(&self, rng: &mut SmallRng) {
        for d in lock(&self.disks).values() {
            d.crash(rng);
        }
    }

    /// Every disk is gone (the cache device died).
    pub fn lose_all(&self) {
        lock(&self.disks).clear();
    }
}

impl Disks for MemDisks {
    fn open(&self, path: &Path, create_len: Option<u64>) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>> {
        let mut m = lock(&self.disks);
        let r = match (m.get(path), create_len) {
            (Some(d), _) => Ok(Arc::new(d.clone()) as Arc<dyn Disk>),
            (None, Some(len)) => {
                let d = MemDisk::new(len, self.seed ^ m.len() as u64);
                m.insert(path.to_path_buf(), d.clone());
                Ok(Arc::new(d) as Arc<dyn Disk>)
            }
            (None, None) => {
                Err(io::Error::new(io::ErrorKind::NotFound, format!("no disk {}", path.display())))
            }
        };
        Box::pin(async move { r })
    }

    fn remove(&self, path: &Path) -> BoxFuture<'static, io::Result<()>> {
        lock(&self.disks).remove(path);
        Box::pin(async { Ok(()) })
    }

    fn list(&self, dir: &Path, prefix: &str) -> BoxFuture<'static, io::Result<Vec<PathBuf>>> {
        let out: Vec<PathBuf> = lock(&self.disks)
            .keys()
            .filter(|p| {
                p.parent() == Some(dir)
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix))
            })
            .cloned()
            .collect();
        Box::pin(async move { Ok(out) })
    }
}

// ---------------------------------------------------------- the object store

/// The in-memory object store with seeded latencies around each request,
/// so a crash can fall before a put lands or between landing and its answer.
#[derive(Debug)]
pub struct SlowStore {
    inner: InMemory,
    rng: Mutex<SmallRng>,
}

impl fmt::Display for SlowStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SlowStore({})", self.inner)
    }
}

impl SlowStore {
    pub fn new(seed: u64) -> SlowStore {
        SlowStore { inner: InMemory::new(), rng: Mutex::new(SmallRng::seed_from_u64(seed)) }
    }

    fn delay(&self, max_us: u64) -> BoxFuture<'static, ()> {
        let d = Duration::from_micros(lock(&self.rng).random_range(0..max_us));
        RealClock.sleep(d)
    }
}

#[async_trait::async_trait]
impl ObjectStore for SlowStore {
    async fn put_opts(
        &self,
        location: &OPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let (before, after) = (self.delay(3000), self.delay(1000));
        before.await;
        let r = self.inner.put_opts(location, payload, opts).await;
        after.await;
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &OPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &OPath, options: GetOptions) -> object_store::Result<GetResult> {
        self.delay(300).await;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(&self, location: &OPath, ranges: &[Range<u64>]) -> object_store::Result<Vec<Bytes>> {
        self.delay(300).await;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<OPath>>,
    ) -> BoxStream<'static, object_store::Result<OPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&OPath>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&OPath>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &OPath, to: &OPath, options: CopyOptions) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

// ----------------------------------------------------------------- trials

/// One LSVD crash configuration.
#[derive(Clone, Debug)]
pub struct LsvdCheck {
    pub volume_size: u64,
    pub object_bytes: u64,
    pub cache_bytes: u64,
    pub ops_max: usize,
    pub planted: Planted,
}

impl Default for LsvdCheck {
    fn default() -> Self {
        LsvdCheck {
            volume_size: 4 << 20,
            object_bytes: 64 << 10,
            cache_bytes: 1 << 20,
            ops_max: 160,
            planted: Planted::None,
        }
    }
}

/// The volume under test; it takes the snapshot [`SNAPSHOT`] right after
/// flush number `snap_after` (counting from 0) returns. The workload
/// issues a flush only once every earlier write completed and before any
/// later one starts, so the snapshot must hold exactly the writes
/// acknowledged before it (and no later one).
struct Lsvd {
    v: LsvdVolume,
    snap_after: Option<u64>,
    flushes: std::sync::atomic::AtomicU64,
    snap: Mutex<SnapState>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SnapState {
    /// Not asked for (yet).
    None,
    /// Asked for; the crash may have come first.
    Started,
    /// Taken: it must open and read as it was.
    Taken,
}

const SNAPSHOT: &str = "s";

impl Target for Lsvd {
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.v.write(offset, data, false).await.map_err(|e| e.to_string()) })
    }
    fn trim(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { self.v.trim(offset, len).await.map_err(|e| e.to_string()) })
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            self.v.flush().await.map_err(|e| e.to_string())?;
            let n = self.flushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.snap_after == Some(n) {
                *lock(&self.snap) = SnapState::Started;
                if self.v.snapshot(SNAPSHOT).await.is_ok() {
                    *lock(&self.snap) = SnapState::Taken;
                }
            }
            Ok(())
        })
    }
}

const CACHE: &str = "/cache/journal";
const PREFIX: &str = "vol";

fn volume_config(c: &LsvdCheck, rng: &mut SmallRng) -> Config {
    Config {
        cache_bytes: c.cache_bytes,
        // A small read cache: lines evicted and refilled all the time,
        // and its file's unsynced writes lost or torn by each crash.
        read_cache_bytes: c.cache_bytes / 4,
        // Often a small delay: many small objects, destaging racing writes.
        destage_delay: Duration::from_micros(rng.random_range(50..5000)),
        checkpoint_every: rng.random_range(1..6),
        retry_pause: Duration::from_millis(1),
        // Cleaning runs often: the hot region is overwritten again and again.
        gc_live_ratio: 0.7,
        gc_min_bytes: rng.random_range(128u64..1024) << 10,
        // Defragmentation off, at the paper's 8 KiB, or plugging large holes.
        defrag_hole_max: [0, 8 << 10, 64 << 10][rng.random_range(0..3usize)],
        planted: c.planted,
    }
}

/// One random crash trial of an LSVD volume.
pub fn lsvd_trial(seed: u64, c: &LsvdCheck) -> Trial {
    let failed = |e: String| Trial {
        seed,
        ops: 0,
        acked: 0,
        in_flight_at_crash: 0,
        objects_deleted: 0,
        snapshot_checked: false,
        resized: false,
        deleted: false,
        rolled_back: false,
        violation: Some(Violation::TrialFailed(e)),
    };
    let mut rng = SmallRng::seed_from_u64(seed);
    let n = rng.random_range(1..=c.ops_max);
    let planned: Vec<Planned> =
        plan_ops(&mut rng, c.volume_size, n).into_iter().map(|op| Planned { op }).collect();
    // Three trials in four take a snapshot after one of the flushes
    // (early ones more often: more overwrites and cleaning follow).
    let flushes = planned.iter().filter(|p| p.op.kind == OpKind::Flush).count() as u64;
    let snap_after =
        (flushes > 0 && rng.random_ratio(3, 4)).then(|| rng.random_range(0..flushes.div_ceil(2)));
    let depth = rng.random_range(1..=8usize);
    let tail = Duration::from_micros(rng.random_range(0..3000));
    let objects: Arc<SlowStore> = Arc::new(SlowStore::new(rng.random()));
    let disks = MemDisks::new(rng.random());
    let cfg = volume_config(c, &mut rng);
    let env = trial_env_with(rng.random(), Arc::new(disks.clone()));
    let store = Store::new(objects.clone(), PREFIX);
    let rt = runtime();
    let log: Result<(Vec<LoggedOp>, SnapState), String> = rt.block_on(async {
        volume::create(&env, &store, "crash", c.volume_size, c.object_bytes)
            .await
            .map_err(|e| e.to_string())?;
        let v = LsvdVolume::open(env.clone(), store.clone(), Some("crash"), Path::new(CACHE), cfg.clone())
            .await
            .map_err(|e| e.to_string())?;
        let target =
            Arc::new(Lsvd { v, snap_after, flushes: Default::default(), snap: Mutex::new(SnapState::None) });
        let log = drive(target.clone(), planned, depth, tail, None, env.clone()).await;
        let snap = *lock(&target.snap);
        Ok((log, snap))
    });
    // The process dies: every task is dropped where it stands.
    drop(rt);
    let deleted = store.counts().now().deletes;
    let (log, snap) = match log {
        Ok(l) => l,
        Err(e) => return failed(e),
    };
    disks.crash(&mut rng);
    let cache_lost = rng.random_ratio(1, 8);
    if cache_lost {
        disks.lose_all();
    }
    if rng.random_ratio(1, 4) {
        // Crash again while recovering: the open is cut off after a few
        // (virtual) microseconds, its claim or journal header in flight.
        let cut = Duration::from_micros(rng.random_range(0..4000));
        let rt = runtime();
        rt.block_on(async {
            let env = trial_env_with(seed ^ 0xc0ffee, Arc::new(disks.clone()));
            let open =
                LsvdVolume::open(env.clone(), store.clone(), Some("crash"), Path::new(CACHE), cfg.clone());
            let _ = env.timeout(cut, open).await;
        });
        drop(rt);
        disks.crash(&mut rng);
    }
    let contract = Contract { acked_writes_durable: false, acked_flushes_durable: !cache_lost };
    let rt = runtime();
    let image: Result<(Vec<u8>, Option<Bytes>), String> = rt.block_on(async {
        let env = trial_env_with(seed ^ 0x5eed, Arc::new(disks.clone()));
        let v = LsvdVolume::open(env, store.clone(), Some("crash"), Path::new(CACHE), cfg.clone())
            .await
            .map_err(|e| format!("recovery failed: {e}"))?;
        let img =
            v.read(0, c.volume_size).await.map(|b| b.to_vec()).map_err(|e| format!("reading back: {e}"))?;
        v.close().await.map_err(|e| format!("closing: {e}"))?;
        // The snapshot, once its volume was reopened, written and cleaned.
        let snap_img = match LsvdSnapshot::open(store.clone(), Some("crash"), SNAPSHOT).await {
            Ok(s) => Some(s.read(0, c.volume_size).await.map_err(|e| format!("reading the snapshot: {e}"))?),
            Err(LsvdError::NotFound(_)) if snap != SnapState::Taken => None,
            Err(e) => return Err(format!("opening the snapshot ({snap:?}): {e}")),
        };
        Ok((img, snap_img))
    });
    drop(rt);
    let snapshot_checked = matches!(&image, Ok((_, Some(_))));
    let violation = match image {
        Ok((img, snap_img)) => check(&log, &img, contract).err().or_else(|| {
            let snap_img = snap_img?;
            check_snapshot(&log, snap_after?, &snap_img).err()
        }),
        Err(e) => Some(Violation::Unrecoverable(e)),
    };
    Trial {
        seed,
        ops: log.len(),
        acked: log.iter().filter(|o| o.acked).count(),
        in_flight_at_crash: 0,
        objects_deleted: deleted,
        snapshot_checked,
        resized: false,
        deleted: false,
        rolled_back: false,
        violation,
    }
}

/// Checks a snapshot taken right after flush number `after`: it holds
/// every write acknowledged before that flush, and nothing issued after.
fn check_snapshot(log: &[LoggedOp], after: u64, image: &[u8]) -> Result<(), Violation> {
    let Some(at) =
        log.iter().enumerate().filter(|(_, o)| o.kind == OpKind::Flush).nth(after as usize).map(|(i, _)| i)
    else {
        return Err(Violation::TrialFailed(format!("a snapshot after flush {after}, which the log lacks")));
    };
    let contract = Contract { acked_writes_durable: true, acked_flushes_durable: true };
    check(&log[..=at], image, contract).map_err(|v| Violation::InSnapshot(Box::new(v)))
}

/// Runs `crashes` trials from seed `first`; returns the violations, each
/// with its seed (for `blizzard crashcheck-lsvd`).
pub fn lsvd_trials(first: u64, crashes: u64, c: &LsvdCheck) -> Vec<(u64, Violation)> {
    let mut out = Vec::new();
    for seed in first..first + crashes {
        if let Some(v) = lsvd_trial(seed, c).violation {
            out.push((seed, v));
        }
        if (seed - first + 1).is_multiple_of(1000) {
            tracing::info!(done = seed - first + 1, violations = out.len(), "LSVD crash trials");
        }
    }
    out
}
