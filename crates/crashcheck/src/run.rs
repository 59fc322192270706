//! Crash trials. One trial, from one seed: format a volume on a fresh
//! in-memory blob, drive a random tagged workload with several operations
//! in flight, stop at a random moment (the client process dies: every task
//! is dropped, writes not yet issued vanish), let each in-flight blob write
//! land or not on each replica, reopen the volume (its recovery runs), read
//! it back in one pass and check it against the op log.
//!
//! Everything runs on a paused-clock tokio runtime with seeded latencies,
//! so a seed replays a trial exactly.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_env::{Env, RealClock, RealDisks, RealNet};
use blizzard_volume::io::BlobIo;
use blizzard_volume::{CommitMode, ExposureLimits, FlushPolicy, PlantedBug, Volume, VolumeSpec};

use crate::checker::{
    check, check_replicas_agree, check_snapshot, check_zero_past, expected_snapshot, Contract, LoggedOp,
    OpKind, Violation,
};
use crate::mem::MemBlob;
use crate::tag::{fill, SECTOR};

#[derive(Clone, Debug)]
pub struct CheckConfig {
    pub mode: CommitMode,
    pub flush: FlushPolicy,
    pub replication: u8,
    pub volume_size: u64,
    pub tract_size: u32,
    pub block_size: u32,
    pub segment_tracts: u32,
    /// Most client operations before the crash.
    pub ops_max: usize,
    pub planted: PlantedBug,
    /// A torn in-flight write may leave chunks corrupt (power loss), not
    /// only land some whole chunks. On for the log mode, whose recovery
    /// must survive it; see `mem`.
    pub corrupt_tears: bool,
    /// Half the trials take snapshots among their writes (design 0011);
    /// each is read back after recovery.
    pub snapshots: bool,
    /// Half the trials shrink and grow the volume among their writes
    /// (not with snapshots in log mode, whose log cannot grow then).
    pub resizes: bool,
}

impl CheckConfig {
    pub fn new(mode: CommitMode, flush: FlushPolicy) -> Self {
        CheckConfig {
            mode,
            flush,
            replication: 2,
            volume_size: 4 << 20,
            tract_size: 16 << 10,
            block_size: 4096,
            segment_tracts: 4,
            ops_max: 160,
            planted: PlantedBug::None,
            corrupt_tears: mode == CommitMode::Log,
            snapshots: true,
            resizes: true,
        }
    }

    fn contract(&self) -> Contract {
        Contract {
            acked_writes_durable: self.mode == CommitMode::WriteThrough,
            acked_flushes_durable: self.mode == CommitMode::WriteThrough
                || self.flush == FlushPolicy::Durable,
        }
    }
}

/// The outcome of one trial.
#[derive(Debug)]
pub struct Trial {
    pub seed: u64,
    pub ops: usize,
    pub acked: usize,
    pub in_flight_at_crash: usize,
    /// LSVD trials: objects the volume deleted (cleaning ran) before the crash.
    pub objects_deleted: u64,
    /// LSVD trials: a snapshot was taken and read back after recovery.
    pub snapshot_checked: bool,
    /// The volume was shrunk and grown back before the crash, or the
    /// crash cut a resize off (recovery grew it back).
    pub resized: bool,
    /// A snapshot deletion was acknowledged before the crash, or cut off
    /// by it.
    pub deleted: bool,
    /// A rollback was acknowledged before the crash, or cut off by it.
    pub rolled_back: bool,
    pub violation: Option<Violation>,
}

/// Seeded randomness for the volume under test.
struct SeededRng(Mutex<SmallRng>);

impl blizzard_env::Rng for SeededRng {
    fn next_u64(&self) -> u64 {
        match self.0.lock() {
            Ok(mut r) => r.random(),
            Err(p) => p.into_inner().random(),
        }
    }
}

/// An env whose clock is tokio's (paused in trials, hence virtual) and
/// whose randomness is seeded. No network or disks are used.
pub fn trial_env(seed: u64) -> Env {
    trial_env_with(seed, Arc::new(RealDisks))
}

/// [`trial_env`] with these disks.
pub fn trial_env_with(seed: u64, disks: Arc<dyn blizzard_env::Disks>) -> Env {
    Env {
        clock: Arc::new(RealClock),
        rng: Arc::new(SeededRng(Mutex::new(SmallRng::seed_from_u64(seed)))),
        net: Arc::new(RealNet),
        disks,
    }
}

/// A one-thread runtime with a paused clock: latencies and timeouts are
/// virtual, so a seed replays exactly.
pub fn runtime() -> tokio::runtime::Runtime {
    match tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build() {
        Ok(rt) => rt,
        Err(e) => panic!("cannot build a tokio runtime for a crash trial: {e}"),
    }
}

/// A planned client operation.
#[derive(Clone, Debug)]
pub(crate) struct Planned {
    pub(crate) op: LoggedOp,
}

pub(crate) fn plan(rng: &mut SmallRng, cfg: &CheckConfig) -> Vec<Planned> {
    let n = rng.random_range(1..=cfg.ops_max);
    let snapshots = cfg.snapshots && rng.random_bool(0.5);
    let resizes = cfg.resizes && rng.random_bool(0.5) && !(snapshots && cfg.mode == CommitMode::Log);
    let rollbacks = snapshots && cfg.mode != CommitMode::Log;
    plan_ops_with(rng, cfg.volume_size, n, Extras { snapshots, resizes, rollbacks })
        .into_iter()
        .map(|op| Planned { op })
        .collect()
}

/// The name the workload gives snapshot op `id`.
pub fn snapshot_name(id: u64) -> String {
    format!("s{id}")
}

/// `n` random client operations on a volume of `volume_size` bytes:
/// tagged writes of 4 KiB to 1 MiB (half of them 4 KiB-aligned, most in a
/// hot region so overwrites are common), some trims, and a flush every
/// few writes.
pub fn plan_ops(rng: &mut SmallRng, volume_size: u64, n: usize) -> Vec<LoggedOp> {
    plan_ops_with(rng, volume_size, n, Extras::default())
}

/// What a workload does besides writes, trims and flushes.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras {
    /// Snapshots, about one op in 16, and deletions of earlier ones, about
    /// one op in 24.
    pub snapshots: bool,
    /// A shrink and a grow back, about one op in 24.
    pub resizes: bool,
    /// Rollbacks to earlier snapshots, about one op in 32 (with
    /// `snapshots`; a served log volume refuses them).
    pub rollbacks: bool,
}

/// [`plan_ops`] with `extras` among the ops; each closes the epoch, as a
/// flush does.
pub fn plan_ops_with(rng: &mut SmallRng, volume_size: u64, n: usize, extras: Extras) -> Vec<LoggedOp> {
    // Often a flush every few writes: many epochs in flight at a crash is
    // where ordering bugs show.
    let flush_every =
        if rng.random_bool(0.4) { rng.random_range(1..=4usize) } else { rng.random_range(1..=64usize) };
    let sectors = volume_size / SECTOR as u64;
    // A hot region makes overwrites common.
    let hot = rng.random_range(8..=sectors.min(2048));
    let mut epoch = 0;
    let mut out = Vec::with_capacity(n);
    let mut since_flush = 0;
    for i in 0..n {
        let id = i as u64 + 1;
        if since_flush >= flush_every {
            out.push(LoggedOp { id, kind: OpKind::Flush, offset: 0, len: 0, epoch, acked: false });
            epoch += 1;
            since_flush = 0;
            continue;
        }
        if extras.snapshots && i > 0 && rng.random_ratio(1, 16) {
            out.push(LoggedOp { id, kind: OpKind::Snapshot, offset: 0, len: 0, epoch, acked: false });
            epoch += 1;
            since_flush = 0;
            continue;
        }
        // Snapshots not deleted (a rollback to a deleted one is refused:
        // an op that fails with no crash must not be planned, as its
        // epoch would be taken as done).
        let live = |out: &[LoggedOp]| -> Vec<u64> {
            out.iter()
                .filter(|o| o.kind == OpKind::Snapshot)
                .map(|o| o.id)
                .filter(|id| !out.iter().any(|d| d.kind == OpKind::DeleteSnapshot && d.offset == *id))
                .collect()
        };
        if extras.snapshots && rng.random_ratio(1, 24) {
            let taken = live(&out);
            if !taken.is_empty() {
                let of = taken[rng.random_range(0..taken.len())];
                out.push(LoggedOp {
                    id,
                    kind: OpKind::DeleteSnapshot,
                    offset: of,
                    len: 0,
                    epoch,
                    acked: false,
                });
                continue;
            }
        }
        if extras.rollbacks && rng.random_ratio(1, 32) {
            let taken = live(&out);
            if !taken.is_empty() {
                let to = taken[rng.random_range(0..taken.len())];
                out.push(LoggedOp { id, kind: OpKind::Rollback, offset: to, len: 0, epoch, acked: false });
                epoch += 1;
                since_flush = 0;
                continue;
            }
        }
        if extras.resizes && i > 0 && rng.random_ratio(1, 24) {
            // Down to any sector from a quarter of the volume up.
            let to = rng.random_range(sectors / 4..sectors) * SECTOR as u64;
            out.push(LoggedOp {
                id,
                kind: OpKind::Resize,
                offset: to,
                len: volume_size - to,
                epoch,
                acked: false,
            });
            epoch += 1;
            since_flush = 0;
            continue;
        }
        since_flush += 1;
        // 4 KiB .. 1 MiB, in sectors; aligned to 4 KiB half the time.
        let len_sectors = match rng.random_range(0..10) {
            0 => rng.random_range(256..=2048u64),
            1..=3 => rng.random_range(16..=128),
            _ => rng.random_range(8..=16),
        }
        .min(sectors);
        let region = if rng.random_bool(0.6) { hot } else { sectors };
        let mut start = rng.random_range(0..=region.saturating_sub(len_sectors));
        if rng.random_bool(0.5) {
            start -= start % 8;
        }
        let kind = if rng.random_ratio(1, 12) { OpKind::Trim } else { OpKind::Write };
        out.push(LoggedOp {
            id,
            kind,
            offset: start * SECTOR as u64,
            len: len_sectors * SECTOR as u64,
            epoch,
            acked: false,
        });
    }
    out
}

/// What a workload drives: a volume of one backend or another.
pub trait Target: Send + Sync + 'static {
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), String>>;
    fn trim(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), String>>;
    /// A flush under the volume's policy.
    fn flush(&self) -> BoxFuture<'_, Result<(), String>>;
    /// Takes snapshot `name`.
    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        let _ = name;
        Box::pin(async { Err("this target takes no snapshots".to_string()) })
    }
    /// Rolls the volume back to snapshot `name`.
    fn rollback<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        let _ = name;
        Box::pin(async { Err("this target takes no snapshots".to_string()) })
    }
    /// Deletes snapshot `name`.
    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        let _ = name;
        Box::pin(async { Err("this target takes no snapshots".to_string()) })
    }
    /// Resizes the volume to `size` bytes.
    fn resize(&self, size: u64, allow_shrink: bool) -> BoxFuture<'_, Result<(), String>> {
        let _ = (size, allow_shrink);
        Box::pin(async { Err("this target is not resized".to_string()) })
    }
}

/// A [`OpKind::Resize`]: down to `to` bytes, then up by `by`.
pub async fn shrink_and_grow<T: Target + ?Sized>(vol: &T, to: u64, by: u64) -> Result<(), String> {
    vol.resize(to, true).await?;
    vol.resize(to + by, false).await
}

impl Target for Volume {
    fn write(&self, offset: u64, data: Bytes) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { Volume::write(self, offset, data, false).await.map_err(|e| e.to_string()) })
    }
    fn trim(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { Volume::trim(self, offset, len).await.map_err(|e| e.to_string()) })
    }
    fn flush(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { Volume::flush(self).await.map_err(|e| e.to_string()) })
    }
    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { Volume::snapshot(self, name).await.map(|_| ()).map_err(|e| e.to_string()) })
    }
    fn resize(&self, size: u64, allow_shrink: bool) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move { Volume::resize(self, size, allow_shrink).await.map_err(|e| e.to_string()) })
    }
    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { Volume::delete_snapshot(self, name).await.map_err(|e| e.to_string()) })
    }
    fn rollback<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move { Volume::rollback(self, name).await.map(|_| ()).map_err(|e| e.to_string()) })
    }
}

/// Which of its flushes, snapshots and resizes a trial crashes inside:
/// half the trials the last resize, the last snapshot or the last flush
/// (one of those it has, at random); the rest crash after their last op.
pub(crate) fn pick_cut(rng: &mut SmallRng, planned: &[Planned]) -> Option<usize> {
    if !rng.random_bool(0.5) {
        return None;
    }
    let last = |k: OpKind| planned.iter().rposition(|p| p.op.kind == k);
    let have: Vec<usize> =
        [OpKind::Resize, OpKind::Snapshot, OpKind::DeleteSnapshot, OpKind::Rollback, OpKind::Flush]
            .into_iter()
            .filter_map(last)
            .collect();
    if have.is_empty() {
        return None;
    }
    Some(have[rng.random_range(0..have.len())])
}

/// Runs the workload until the crash point: after the last op, or inside
/// op `cut` (a flush, snapshot or resize: it gets `tail` to run, and no
/// later op is issued). Returns the op log with acknowledgments.
pub(crate) async fn drive<T: Target>(
    vol: Arc<T>,
    planned: Vec<Planned>,
    depth: usize,
    tail: Duration,
    cut: Option<usize>,
    env: Env,
) -> Vec<LoggedOp> {
    let log: Arc<Mutex<Vec<LoggedOp>>> = Arc::new(Mutex::new(planned.iter().map(|p| p.op.clone()).collect()));
    let mark = |log: &Arc<Mutex<Vec<LoggedOp>>>, i: usize| {
        if let Ok(mut l) = log.lock() {
            l[i].acked = true;
        }
    };
    let mut inflight = FuturesUnordered::new();
    let mut ranges: Vec<(usize, u64, u64)> = Vec::new();
    for (i, p) in planned.iter().enumerate() {
        let op = p.op.clone();
        // Clients do not issue a flush before earlier writes complete, nor
        // overlapping writes at once (NBD leaves those undefined).
        loop {
            let blocked = match op.kind {
                OpKind::Flush
                | OpKind::Snapshot
                | OpKind::Resize
                | OpKind::DeleteSnapshot
                | OpKind::Rollback => !ranges.is_empty(),
                _ => ranges.iter().any(|(_, a, b)| *a < op.offset + op.len && op.offset < *b),
            } || ranges.len() >= depth;
            if !blocked {
                break;
            }
            match inflight.next().await {
                Some(done) => {
                    ranges.retain(|(j, _, _)| *j != done);
                }
                None => break,
            }
        }
        let vol = vol.clone();
        let log2 = log.clone();
        if cut == Some(i) {
            // The crash comes while this runs (with the writes before it).
            let run = async {
                let ok = match op.kind {
                    OpKind::Flush => vol.flush().await.is_ok(),
                    OpKind::Snapshot => vol.snapshot(&snapshot_name(op.id)).await.is_ok(),
                    OpKind::Resize => shrink_and_grow(&*vol, op.offset, op.len).await.is_ok(),
                    OpKind::DeleteSnapshot => vol.delete_snapshot(&snapshot_name(op.offset)).await.is_ok(),
                    OpKind::Rollback => vol.rollback(&snapshot_name(op.offset)).await.is_ok(),
                    OpKind::Write | OpKind::Trim => false,
                };
                if ok {
                    mark(&log2, i);
                }
            };
            let _ = env.timeout(tail, run).await;
            // Later ops were never issued: as if never planned.
            if let Ok(mut l) = log.lock() {
                l.truncate(i + 1);
            }
            break;
        }
        match op.kind {
            OpKind::Flush => {
                if vol.flush().await.is_ok() {
                    mark(&log2, i);
                }
            }
            OpKind::Snapshot => {
                // Nothing is in flight (above): the snapshot must hold
                // exactly the ops before it.
                if vol.snapshot(&snapshot_name(op.id)).await.is_ok() {
                    mark(&log2, i);
                }
            }
            OpKind::Resize => {
                if shrink_and_grow(&*vol, op.offset, op.len).await.is_ok() {
                    mark(&log2, i);
                }
            }
            OpKind::DeleteSnapshot => {
                if vol.delete_snapshot(&snapshot_name(op.offset)).await.is_ok() {
                    mark(&log2, i);
                }
            }
            OpKind::Rollback => {
                if vol.rollback(&snapshot_name(op.offset)).await.is_ok() {
                    mark(&log2, i);
                }
            }
            OpKind::Write | OpKind::Trim => {
                ranges.push((i, op.offset, op.offset + op.len));
                inflight.push(async move {
                    let r = if op.kind == OpKind::Write {
                        let mut b = vec![0u8; op.len as usize];
                        fill(&mut b, op.offset, op.id, op.epoch);
                        vol.write(op.offset, Bytes::from(b)).await
                    } else {
                        vol.trim(op.offset, op.len).await
                    };
                    if r.is_ok() {
                        mark(&log2, i);
                    }
                    i
                });
            }
        }
    }
    // Let some in-flight work finish, then the process dies.
    let _ = env.timeout(tail, async { while inflight.next().await.is_some() {} }).await;
    drop(inflight);
    let out = match log.lock() {
        Ok(l) => l.clone(),
        Err(p) => p.into_inner().clone(),
    };
    out
}

/// Formats, runs and stops at the crash point. Returns the blob (with its
/// in-flight ops still pending) and the op log.
fn run_until_crash(seed: u64, cfg: &CheckConfig) -> Result<(MemBlob, Vec<LoggedOp>, SmallRng), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let planned = plan(&mut rng, cfg);
    let depth = rng.random_range(1..=8usize);
    let tail = Duration::from_micros(rng.random_range(0..3000));
    let cut = pick_cut(&mut rng, &planned);
    let env = trial_env(rng.random());
    let mem = MemBlob::new(env.clone(), rng.random(), cfg.tract_size, cfg.replication, (50, 2000));
    mem.set_corrupt_tears(cfg.corrupt_tears);
    let spec = VolumeSpec {
        name: "crash".into(),
        size_bytes: cfg.volume_size,
        mode: cfg.mode,
        flush: cfg.flush,
        replication: cfg.replication,
        block_size: Some(cfg.block_size),
        segment_tracts: cfg.segment_tracts,
        exposure: ExposureLimits { bytes_max: 2 << 20, writes_max: 64, age_ms_max: 1000 },
        placement: Default::default(),
    };
    let rt = runtime();
    let log = rt.block_on(async {
        let io: Arc<dyn BlobIo> = Arc::new(mem.clone());
        let fresh = Volume::format(env.clone(), io.clone(), &spec).await.map_err(|e| e.to_string())?;
        drop(fresh);
        let vol = Arc::new(Volume::open(env.clone(), io, cfg.planted).await.map_err(|e| e.to_string())?);
        Ok::<_, String>(drive(vol, planned, depth, tail, cut, env).await)
    })?;
    // The client process dies here: its tasks are dropped mid-flight.
    drop(rt);
    Ok((mem, log, rng))
}

/// What recovery left: the volume read once (each read from a replica the
/// seed picks), then once more per replica with reads sent to that replica.
struct Recovered {
    image: Bytes,
    per_replica: Vec<Bytes>,
    /// Each snapshot op of the log that opened: its index in the log, and
    /// its image read once, then once per replica.
    snapshots: Vec<(usize, Bytes, Vec<Bytes>)>,
    /// Snapshot ops that did not open, with why.
    missing: Vec<(usize, String)>,
    /// The volume was smaller than formatted (a resize cut off): its size
    /// then; it was grown back before it was read.
    grown_back: Option<u64>,
}

impl Recovered {
    /// The commit mode's contract, then replica agreement: after recovery
    /// every block must read the same whichever replica serves it.
    fn check(&self, log: &[LoggedOp], contract: Contract) -> Result<(), Violation> {
        check(log, &self.image, contract)?;
        if let Some(size) = self.grown_back {
            check_zero_past(&self.image, size)?;
        }
        check_replicas_agree(&self.per_replica)?;
        // An acknowledged snapshot survives the crash; any that opens
        // (acknowledged or cut off) reads exactly the ops before it.
        // A deletion (issued: every op in the log was) lets its snapshot
        // go; an acknowledged one makes it go.
        let deleting =
            |i: usize| log.iter().filter(move |o| o.kind == OpKind::DeleteSnapshot && o.offset == log[i].id);
        for (i, why) in &self.missing {
            if log[*i].acked && deleting(*i).next().is_none() {
                return Err(Violation::LostSnapshot { name: snapshot_name(log[*i].id), why: why.clone() });
            }
        }
        for (i, _, _) in &self.snapshots {
            if deleting(*i).any(|d| d.acked) {
                return Err(Violation::DeletedSnapshotRemains { name: snapshot_name(log[*i].id) });
            }
        }
        for (i, image, per_replica) in &self.snapshots {
            let name = snapshot_name(log[*i].id);
            if let Some(want) = expected_snapshot(log, *i, image.len()) {
                check_snapshot(&name, &want, image)?;
            }
            check_replicas_agree(per_replica).map_err(|v| Violation::InSnapshot(Box::new(v)))?;
        }
        Ok(())
    }

    /// Whether a snapshot was read back.
    fn snapshot_checked(&self) -> bool {
        !self.snapshots.is_empty()
    }
}

/// Reopens the volume (running recovery) and reads it: once in one pass,
/// then once through each replica.
fn recover(mem: &MemBlob, seed: u64, cfg: &CheckConfig, log: &[LoggedOp]) -> Result<Recovered, String> {
    let rt = runtime();
    rt.block_on(async {
        let env = trial_env(seed ^ 0x5eed);
        let blob = mem.reopen(env.clone());
        let io: Arc<dyn BlobIo> = Arc::new(blob.clone());
        let vol =
            Volume::open(env.clone(), io, cfg.planted).await.map_err(|e| format!("recovery failed: {e}"))?;
        // Cut off between a shrink and its grow back: grown here, as an
        // operator would (what it gains must read as zeros).
        let grown_back = Some(vol.size()).filter(|&s| s < cfg.volume_size);
        if grown_back.is_some() {
            vol.resize(cfg.volume_size, false)
                .await
                .map_err(|e| format!("growing the recovered volume back: {e}"))?;
        }
        let read = |what: String| {
            let vol = &vol;
            async move { vol.read(0, vol.size()).await.map_err(|e| format!("{what}: {e}")) }
        };
        let image = read("reading the recovered volume".into()).await?;
        let mut per_replica = Vec::new();
        if cfg.replication > 1 {
            for r in 0..cfg.replication as usize {
                blob.pin_reads(Some(r));
                per_replica.push(read(format!("reading the recovered volume through replica {r}")).await?);
            }
            blob.pin_reads(None);
        }
        let (mut snapshots, mut missing) = (Vec::new(), Vec::new());
        for (i, op) in log.iter().enumerate().filter(|(_, o)| o.kind == OpKind::Snapshot) {
            let name = snapshot_name(op.id);
            let io: Arc<dyn BlobIo> = Arc::new(blob.clone());
            let snap = match Volume::open_snapshot(env.clone(), io, &name).await {
                Ok(s) => s,
                Err(e) => {
                    missing.push((i, e.to_string()));
                    continue;
                }
            };
            let whole =
                snap.read(0, snap.size()).await.map_err(|e| format!("reading snapshot {name}: {e}"))?;
            let mut each = Vec::new();
            if cfg.replication > 1 {
                for r in 0..cfg.replication as usize {
                    blob.pin_reads(Some(r));
                    each.push(
                        snap.read(0, snap.size())
                            .await
                            .map_err(|e| format!("reading snapshot {name} through replica {r}: {e}"))?,
                    );
                }
                blob.pin_reads(None);
            }
            snapshots.push((i, whole, each));
        }
        Ok(Recovered { image, per_replica, snapshots, missing, grown_back })
    })
}

/// A second crash, during recovery: the volume is reopened with its
/// first `ops` blob operations allowed to complete and every later one
/// held in flight (its claim, superblock repair, reconciliation or bitmap
/// clearing cut short), then the process dies again and the held ops land
/// or not, replica by replica.
fn crash_during_recovery(mem: &MemBlob, seed: u64, cfg: &CheckConfig, ops: u64, rng: &mut SmallRng) {
    let rt = runtime();
    rt.block_on(async {
        let env = trial_env(seed ^ 0xc0ffee);
        mem.hold_after(Some(ops));
        let io: Arc<dyn BlobIo> = Arc::new(mem.reopen(env.clone()));
        // Held ops never complete: the (virtual) timeout ends the attempt.
        let _ = env.timeout(Duration::from_secs(60), Volume::open(env.clone(), io, cfg.planted)).await;
    });
    drop(rt);
    mem.hold_after(None);
    mem.crash(rng);
}

/// One random crash trial.
pub fn trial(seed: u64, cfg: &CheckConfig) -> Trial {
    let (mem, log, mut rng) = match run_until_crash(seed, cfg) {
        Ok(x) => x,
        Err(e) => {
            return Trial {
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
            }
        }
    };
    let in_flight = mem.in_flight();
    mem.crash(&mut rng);
    // A quarter of the replicated trials crash again while recovering.
    if cfg.replication > 1 && rng.random_ratio(1, 4) {
        let ops = rng.random_range(0..12);
        crash_during_recovery(&mem, seed, cfg, ops, &mut rng);
    }
    let acked_resize = log.iter().any(|o| o.kind == OpKind::Resize && o.acked);
    let (violation, snapshot_checked, resized) = match recover(&mem, seed, cfg, &log) {
        Ok(r) => (
            r.check(&log, cfg.contract()).err(),
            r.snapshot_checked(),
            acked_resize || r.grown_back.is_some(),
        ),
        Err(e) => (Some(Violation::Unrecoverable(e)), false, acked_resize),
    };
    Trial {
        seed,
        ops: log.len(),
        acked: log.iter().filter(|o| o.acked).count(),
        in_flight_at_crash: in_flight,
        objects_deleted: 0,
        snapshot_checked,
        resized,
        deleted: log.iter().any(|o| o.kind == OpKind::DeleteSnapshot),
        rolled_back: log.iter().any(|o| o.kind == OpKind::Rollback),
        violation,
    }
}

/// Every way the in-flight ops of one crash point can land (replication
/// 1, at most `max_in_flight` ops): 2^n recoveries, each checked.
pub fn exhaustive(seed: u64, cfg: &CheckConfig, max_in_flight: usize) -> Result<usize, (u64, Violation)> {
    let mut cfg = cfg.clone();
    cfg.replication = 1;
    let Ok((mem, log, _)) = run_until_crash(seed, &cfg) else { return Ok(0) };
    let n = mem.in_flight();
    if n > max_in_flight {
        return Ok(0);
    }
    for mask in 0..(1u64 << n) {
        let fork = mem.fork();
        fork.crash_with(|op, _| mask & (1 << op) != 0);
        match recover(&fork, seed, &cfg, &log) {
            Ok(r) => {
                if let Err(v) = r.check(&log, cfg.contract()) {
                    return Err((mask, v));
                }
            }
            Err(e) => return Err((mask, Violation::Unrecoverable(e))),
        }
    }
    Ok(1 << n)
}
