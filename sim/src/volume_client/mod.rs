//! Volume clients: simulated hosts that run a replicated
//! [`blizzard_volume::Volume`] over the simulated cluster, which the
//! harness crashes mid-write and restarts (`cluster::run_blob_sim`).
//!
//! What outlives a crash is kept in harness memory ([`VolumeShared`]), as a
//! real test keeps a client's event log in a file: every operation is
//! logged before it is issued and marked acknowledged after it completed
//! (`blizzard_crashcheck::checker::LoggedOp`), with one write-id sequence
//! and one flush-epoch counter across lives (a crash closes the epoch), and
//! what the last verified recovery left on the volume.
//!
//! Each life: connect; open the volume (the first life creates it:
//! write-through or fast-ack, from the seed), which claims it (a writer
//! epoch above every earlier one, `volume::intent::claim`) and reconciles
//! every tract its write-intent bitmap names, retried while a tractserver
//! it needs is down; then two checks:
//! - (a) replica agreement: every replica of every tract of the blob holds
//!   the same bytes (`Blob::read_replicas`);
//! - (b) contents: the volume read once and checked against the op log
//!   under the commit mode's contract (`blizzard_crashcheck::checker`):
//!   write-through, acknowledged writes present; fast-ack, a prefix of
//!   flush epochs with every write before an acknowledged durable flush.
//!
//! Then the workload while faults last: tagged writes (and some trims) of
//! 512 B to 32 KiB at a queue depth of a few, never two overlapping ones in
//! flight, a flush every few writes. Once faults stop: a durable flush, a
//! last open (recovery) with both checks, a clean close, and one more open
//! that must find nothing to reconcile and the volume unchanged.
//!
//! The volume runs over [`ClientBlobIo`] on the simulated network, behind
//! a thin [`SimBlobIo`] that only changes how `sync` is sent: one
//! `Blob::sync` per tractserver, in address order. `Blob::sync` sends its
//! `SyncDisk`s in the iteration order of a `std` `HashMap`, which is drawn
//! per process, so a fast-ack volume made the simulation differ from run to
//! run of one seed (the order of the sends decides which message draws
//! which latency). With one server per call that order is fixed.
//!
//! Checking across lives. The checker's model is one run from a zeroed
//! volume, after which a prefix of flush epochs survives. Over several
//! crashes that no longer holds: a write lost in the first crash stays lost
//! while later lives' writes, in later epochs, land. So each check covers
//! the operations since the last verified recovery, on top of what that
//! recovery read ([`check_since`]): its sectors count as acknowledged
//! writes of an epoch before all others, made durable by a flush. A sector
//! that goes back to an older write, or loses what the recovery read
//! without a write or trim since, is a violation.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::future::{BoxFuture, LocalBoxFuture};
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::Rng;

use blizzard_client::{Blob, Client, ClientConfig, ClientError};
use blizzard_core::reconcile::Reconciled;
use blizzard_crashcheck::checker::{check, Contract, LoggedOp, OpKind, Violation};
use blizzard_crashcheck::tag::{fill, parse, Sector, SECTOR};
use blizzard_env::Env;
use blizzard_volume::io::{BlobIo, CacheReceipt, IoError};
use blizzard_volume::lease::{Lease, Leased, Writer};
use blizzard_volume::{
    manage, ClientBlobIo, CommitMode, ExposureLimits, FlushPolicy, PlantedBug, Volume, VolumeError,
    VolumeSpec,
};

use crate::Trace;

mod check;
mod io;

pub use check::check_since;
use check::{describe_at, explain};
pub use io::SimBlobIo;
use io::{create_volume, open_volume};

/// The volume: 16 data tracts of 16 KiB, so a write of a few KiB often
/// crosses blocks and therefore tracts.
pub const VOLUME_BYTES: u64 = 256 << 10;
/// Striping unit: 4 KiB blocks, 4 tracts to a segment.
const BLOCK_SIZE: u32 = 4096;
const SEGMENT_TRACTS: u32 = 4;
/// How long one step (an open, a check, an operation) is retried before the
/// cluster counts as stuck: far beyond any fault the harness injects.
const RETRY_FOR: Duration = Duration::from_secs(180);
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// Write ids at or above this stand for the sectors the last verified
/// recovery read ([`check_since`]); real ids count up from 1.
const SETTLED: u64 = 1 << 62;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A volume client's fixed parameters, drawn from the seed.
#[derive(Clone, Debug)]
pub struct VolumeConfig {
    pub name: String,
    pub meta: String,
    pub replication: u8,
    pub mode: CommitMode,
    /// Writes and trims in flight at once.
    pub depth: usize,
    /// Operations (writes, trims, flushes) issued over all lives, at most.
    pub ops_max: usize,
    /// Stop the faults when the workload is done (no blob clients do).
    pub ends_faults: bool,
    /// Take the volume's lease (design 0007) on every create and open,
    /// taking it over from the previous life: the claimed writer epoch is
    /// then at least the lease's fencing token.
    pub lease: bool,
    /// Where the volume's replicas live (design 0009); `any` where the
    /// table has no section for it.
    pub placement: blizzard_core::Placement,
}

impl VolumeConfig {
    fn spec(&self) -> VolumeSpec {
        VolumeSpec {
            name: self.name.clone(),
            size_bytes: VOLUME_BYTES,
            mode: self.mode,
            flush: FlushPolicy::Durable,
            replication: self.replication,
            block_size: Some(BLOCK_SIZE),
            segment_tracts: SEGMENT_TRACTS,
            // Small, so fast-ack writes wait for room now and then.
            exposure: ExposureLimits { bytes_max: 128 << 10, writes_max: 32, age_ms_max: 1000 },
            placement: self.placement,
        }
    }

    fn contract(&self) -> Contract {
        blizzard_crashcheck::real::contract_for(self.mode, FlushPolicy::Durable)
    }
}

/// Counters for the report.
#[derive(Clone, Copy, Debug, Default)]
pub struct VolumeStats {
    pub lives: u64,
    /// Tracts recovery reconciled (named by an intent bitmap), and the
    /// chunks it found different and repaired.
    pub tracts_reconciled: u64,
    pub chunk_repairs: u64,
    /// Volume-wide replica-agreement checks and content checks passed.
    pub replica_checks: u64,
    pub volume_checks: u64,
    /// Writes and trims acknowledged.
    pub acked_ops: u64,
    /// The volume was created hybrid (design 0009).
    pub hybrid: u64,
}

/// What a volume client keeps outside its process.
pub struct VolState {
    cfg: VolumeConfig,
    created: bool,
    /// The workload's random stream, continued across lives.
    rng: SmallRng,
    next_id: u64,
    epoch: u64,
    since_flush: u32,
    flush_every: u32,
    issued: usize,
    /// Per sector, the write id the last verified recovery read (0: zeros).
    base: Vec<u64>,
    /// Operations since then.
    ops: Vec<LoggedOp>,
    /// Writes and trims issued in this life and not completed.
    inflight: usize,
    /// This life's open volume, for the harness to ask what is undurable.
    vol: Weak<Volume>,
    phase: &'static str,
    done: bool,
    stats: VolumeStats,
}

/// The state of one volume client, shared by its lives and the harness.
#[derive(Clone)]
pub struct VolumeShared(Arc<Mutex<VolState>>);

/// A planned operation, before it gets an id and epoch.
#[derive(Clone, Copy, Debug)]
struct Planned {
    kind: OpKind,
    offset: u64,
    len: u64,
}

impl VolumeShared {
    pub fn new(cfg: VolumeConfig, rng: SmallRng) -> VolumeShared {
        let sectors = (VOLUME_BYTES / SECTOR as u64) as usize;
        VolumeShared(Arc::new(Mutex::new(VolState {
            cfg,
            created: false,
            rng,
            next_id: 1,
            // Epoch 0 is what the last verified recovery read (`check_since`).
            epoch: 1,
            since_flush: 0,
            flush_every: 3,
            issued: 0,
            base: vec![0; sectors],
            ops: Vec::new(),
            inflight: 0,
            vol: Weak::new(),
            phase: "starting",
            done: false,
            stats: VolumeStats::default(),
        })))
    }

    fn lock(&self) -> MutexGuard<'_, VolState> {
        crate::env::lock(&self.0)
    }

    pub fn config(&self) -> VolumeConfig {
        self.lock().cfg.clone()
    }

    pub fn stats(&self) -> VolumeStats {
        self.lock().stats
    }

    /// Finished its final checks.
    pub fn done(&self) -> bool {
        self.lock().done
    }

    pub fn phase(&self) -> &'static str {
        self.lock().phase
    }

    /// A new life begins (the host started or restarted): returns its
    /// number, from 1. The previous life's epoch is closed.
    pub fn start_life(&self) -> u64 {
        let mut s = self.lock();
        s.stats.lives += 1;
        s.epoch += 1;
        s.since_flush = 0;
        s.inflight = 0;
        s.vol = Weak::new();
        s.phase = "connecting";
        s.stats.lives
    }

    /// (writes and trims the client is waiting for, writes the volume
    /// acknowledged but has not made durable): what a crash now cuts off.
    pub fn in_flight(&self) -> (usize, u64) {
        let s = self.lock();
        let undurable = s.vol.upgrade().map_or(0, |v| v.outstanding().0);
        (s.inflight, undurable)
    }

    fn set_phase(&self, phase: &'static str) {
        self.lock().phase = phase;
    }

    fn exhausted(&self) -> bool {
        let s = self.lock();
        s.issued >= s.cfg.ops_max
    }

    fn draw(&self) -> Planned {
        let mut s = self.lock();
        s.issued += 1;
        if s.since_flush >= s.flush_every {
            s.since_flush = 0;
            s.flush_every = s.rng.random_range(1..=6);
            return Planned { kind: OpKind::Flush, offset: 0, len: 0 };
        }
        s.since_flush += 1;
        let sectors = VOLUME_BYTES / SECTOR as u64;
        let r = &mut s.rng;
        let len = match r.random_range(0..10) {
            0 => r.random_range(33..=64u64),
            1..=3 => r.random_range(9..=32),
            _ => r.random_range(1..=8),
        };
        // A hot quarter makes overwrites common.
        let region = if r.random_bool(0.6) { sectors / 4 } else { sectors };
        let mut start = r.random_range(0..=region - len);
        if r.random_bool(0.5) {
            start -= start % 8;
        }
        let kind = if r.random_ratio(1, 12) { OpKind::Trim } else { OpKind::Write };
        Planned { kind, offset: start * SECTOR as u64, len: len * SECTOR as u64 }
    }

    /// Logs `p` as issued now: it gets the next id and the current epoch
    /// (a flush closes it).
    fn log(&self, p: Planned) -> LoggedOp {
        let mut s = self.lock();
        let op = LoggedOp {
            id: s.next_id,
            kind: p.kind,
            offset: p.offset,
            len: p.len,
            epoch: s.epoch,
            acked: false,
        };
        s.next_id += 1;
        match p.kind {
            OpKind::Flush | OpKind::Snapshot | OpKind::Resize | OpKind::Rollback => s.epoch += 1,
            OpKind::Write | OpKind::Trim => s.inflight += 1,
            OpKind::DeleteSnapshot => {}
        }
        s.ops.push(op.clone());
        op
    }

    fn ack(&self, op: &LoggedOp) {
        let mut s = self.lock();
        if let Some(o) = s.ops.iter_mut().rev().find(|o| o.id == op.id) {
            o.acked = true;
        }
        if !matches!(
            op.kind,
            OpKind::Flush | OpKind::Snapshot | OpKind::Resize | OpKind::DeleteSnapshot | OpKind::Rollback
        ) {
            s.inflight = s.inflight.saturating_sub(1);
            s.stats.acked_ops += 1;
        }
    }

    /// A recovery's image passed the checks: it is the new base.
    fn settle(&self, image: &[u8]) {
        let mut s = self.lock();
        s.base = image
            .chunks(SECTOR)
            .enumerate()
            .map(|(i, sector)| match parse(sector, (i * SECTOR) as u64) {
                Sector::Written { id, .. } => id,
                Sector::Zero | Sector::Garbage => 0,
            })
            .collect();
        s.ops.clear();
    }
}

/// Everything one life needs.
pub struct Life {
    pub env: Env,
    pub host: String,
    pub shared: VolumeShared,
    /// Set when the faults stop (the liveness phase).
    pub faults_over: Arc<AtomicBool>,
    pub trace: Trace,
}

impl Life {
    fn note(&self, what: impl std::fmt::Display) {
        self.trace.event(&self.host, what);
    }

    fn faults_over(&self) -> bool {
        self.faults_over.load(Ordering::Relaxed)
    }

    /// Runs `f` until it succeeds, pausing between tries, for at most
    /// [`RETRY_FOR`].
    async fn retry<T, E: std::fmt::Display, F: std::future::Future<Output = Result<T, E>>>(
        &self,
        what: &str,
        mut f: impl FnMut() -> F,
    ) -> Result<T, BoxError> {
        let deadline = self.env.now() + RETRY_FOR;
        let mut tries = 0u32;
        loop {
            match f().await {
                Ok(v) => return Ok(v),
                Err(e) => {
                    tries += 1;
                    self.note(format!("{what} failed (try {tries}): {e}"));
                    if self.env.now() > deadline {
                        return Err(format!(
                            "{}: {what} still failing {} s on: {e}",
                            self.host,
                            RETRY_FOR.as_secs()
                        )
                        .into());
                    }
                    self.env.sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// One life of the volume client; `Err` is a violation.
    pub async fn run(self) -> Result<(), BoxError> {
        let life = self.shared.start_life();
        let cfg = self.shared.config();
        self.note(format!("life {life} ({:?}, {}-way, depth {})", cfg.mode, cfg.replication, cfg.depth));
        let mut cc = ClientConfig::new(cfg.meta.clone());
        cc.request_timeout = Duration::from_secs(2);
        cc.attempts = 30;
        cc.backoff_max = Duration::from_millis(500);
        cc.connect_timeout = Duration::from_secs(120);
        let client = Client::connect(self.env.clone(), cc).await?;
        let vol = self.open(&client, &cfg).await?;
        self.verify(&client, &cfg, &vol, "after recovery").await?;
        if !self.faults_over() {
            self.shared.set_phase("workload");
            self.workload(&cfg, &vol).await?;
        }
        // Final phase: once faults are over and the cluster whole, a last
        // recovery, the checks, a clean close, and an open that must find
        // nothing to do.
        self.shared.set_phase("waiting for the faults to end");
        while !self.faults_over() {
            self.env.sleep(Duration::from_millis(50)).await;
        }
        self.wait_replicated(&client).await?;
        self.shared.set_phase("final");
        self.retry("durable flush", || vol.flush_durable()).await?;
        let flush = self.shared.log(Planned { kind: OpKind::Flush, offset: 0, len: 0 });
        self.shared.ack(&flush);
        drop(vol);
        let vol = self.open(&client, &cfg).await?;
        self.verify(&client, &cfg, &vol, "final, after recovery").await?;
        self.retry("clean close", || vol.quiesce()).await?;
        drop(vol);
        let vol = self.open(&client, &cfg).await?;
        let dirty = vol.recovery().dirty_tracts;
        // Unless a bit flipped in tract 0 since (the harness's rot): a
        // bitmap page unreadable on a replica makes recovery reconcile
        // every tract (`full`).
        if dirty != 0 && !vol.recovery().full {
            return Err(format!(
                "{}: the open after a clean close found {dirty} tracts to reconcile",
                self.host
            )
            .into());
        }
        self.verify(&client, &cfg, &vol, "after a clean close").await?;
        self.retry("clean close", || vol.quiesce()).await?;
        let mut s = self.shared.lock();
        s.vol = Weak::new();
        s.done = true;
        s.phase = "done";
        drop(s);
        self.note("done: replicas agree and the volume holds what its contract says, after every recovery");
        Ok(())
    }

    /// Opens the volume (the first life creates it), running its recovery;
    /// retried while it fails (a tractserver it needs is down).
    async fn open(&self, client: &Client, cfg: &VolumeConfig) -> Result<Arc<Volume>, BoxError> {
        self.shared.set_phase("opening");
        let spec = cfg.spec();
        // A holder of its own per open: the previous open's lease (this
        // life's, or a crashed life's) is taken over.
        let writer = cfg.lease.then(|| Writer {
            holder: format!("{}/{:08x}", self.host, self.env.random_u64() as u32),
            ttl: blizzard_volume::lease::TTL,
            take_over: true,
        });
        let vol = self
            .retry("open", || async {
                if self.shared.lock().created {
                    return open_volume(self.env.clone(), client, &cfg.name, writer.as_ref()).await;
                }
                match create_volume(self.env.clone(), client, &spec, writer.as_ref()).await {
                    Ok((v, placement)) => {
                        let mut s = self.shared.lock();
                        s.created = true;
                        s.stats.hybrid = u64::from(placement == blizzard_core::Placement::Hybrid);
                        Ok(v)
                    }
                    Err(VolumeError::Exists(n)) => {
                        // A create cut off by a crash (or whose reply was
                        // lost): nothing was written to it yet.
                        let _ = manage::delete(self.env.clone(), client, &n).await;
                        Err(VolumeError::Exists(n))
                    }
                    Err(e) => Err(e),
                }
            })
            .await?;
        let rec = *vol.recovery();
        {
            let mut s = self.shared.lock();
            s.stats.tracts_reconciled += rec.reconciled.tracts;
            s.stats.chunk_repairs += rec.reconciled.chunk_repairs;
        }
        self.note(format!(
            "opened: writer {}, {} tracts marked, {} chunk repairs",
            rec.writer, rec.dirty_tracts, rec.reconciled.chunk_repairs
        ));
        let vol = Arc::new(vol);
        self.shared.lock().vol = Arc::downgrade(&vol);
        Ok(vol)
    }

    /// The two checks; on success what was read becomes the base.
    async fn verify(
        &self,
        client: &Client,
        cfg: &VolumeConfig,
        vol: &Volume,
        when: &str,
    ) -> Result<(), BoxError> {
        self.shared.set_phase("checking");
        let blob = self.retry("open blob", || manage::find_blob(client, &cfg.name)).await?;
        self.check_replicas(client, cfg, &blob, when).await?;
        let image = self.retry("volume read", || vol.read(0, vol.size())).await?;
        let (base, ops) = {
            let s = self.shared.lock();
            (s.base.clone(), s.ops.clone())
        };
        if let Err(v) = check_since(&base, &ops, &image, cfg.contract()) {
            return Err(format!(
                "{}: volume contents {when} break the {:?} contract: {}",
                self.host,
                cfg.mode,
                explain(&v, &base)
            )
            .into());
        }
        self.shared.settle(&image);
        let mut s = self.shared.lock();
        s.stats.replica_checks += 1;
        s.stats.volume_checks += 1;
        drop(s);
        self.note(format!("checked {when}: replicas agree, {} ops since the last check allowed", ops.len()));
        Ok(())
    }

    /// (a) Every replica of every tract of the blob holds the same bytes.
    async fn check_replicas(
        &self,
        client: &Client,
        cfg: &VolumeConfig,
        blob: &Blob,
        when: &str,
    ) -> Result<(), BoxError> {
        let ts = client.tract_size();
        // Every tract at once: a check is one round trip, not one per tract.
        let reads =
            (0..blob.size_tracts()).map(|t| self.retry("replica read", move || blob.read_replicas(t, 0, ts)));
        let all = futures::future::join_all(reads).await;
        for (t, replicas) in all.into_iter().enumerate() {
            let replicas = replicas?;
            if replicas.len() != cfg.replication as usize {
                return Err(format!(
                    "{}: tract {t} has {} replicas, not {}",
                    self.host,
                    replicas.len(),
                    cfg.replication
                )
                .into());
            }
            for (i, r) in replicas.iter().enumerate().skip(1) {
                let Some(at) = r.iter().zip(&replicas[0]).position(|(a, b)| a != b) else { continue };
                let tlt = client.tlt();
                let row = tlt.locate(blob.id(), blizzard_core::TractNo(t as i64));
                let who = |k: usize| {
                    tlt.rows[row]
                        .members
                        .get(k)
                        .map(|&m| tlt.members[m as usize].addr.clone())
                        .unwrap_or_default()
                };
                return Err(format!(
                    "{}: replicas of tract {t} disagree {when}: at offset {at}, replica 0 ({}) holds {} but replica {i} ({}) holds {}",
                    self.host,
                    who(0),
                    describe_at(t as u64, &replicas[0], at),
                    who(i),
                    describe_at(t as u64, r, at),
                )
                .into());
            }
        }
        Ok(())
    }

    /// Waits until the cluster reports every row fully replicated.
    async fn wait_replicated(&self, client: &Client) -> Result<(), BoxError> {
        self.shared.set_phase("waiting for full replication");
        let deadline = self.env.now() + RETRY_FOR;
        loop {
            let last = match client.cluster_status().await {
                Ok(s) if s.fully_replicated() => return Ok(()),
                Ok(s) => format!("rows filling {}, degraded {}", s.rows_filling, s.rows_degraded),
                Err(e) => e.to_string(),
            };
            if self.env.now() > deadline {
                return Err(format!(
                    "{}: liveness: not fully replicated {} s after faults stopped: {last}",
                    self.host,
                    RETRY_FOR.as_secs()
                )
                .into());
            }
            self.env.sleep(Duration::from_millis(100)).await;
        }
    }

    /// Tagged writes, trims and flushes while faults last (as the crash
    /// checker's `drive`: a flush waits for the writes before it, and no
    /// two overlapping writes are in flight at once).
    async fn workload(&self, cfg: &VolumeConfig, vol: &Arc<Volume>) -> Result<(), BoxError> {
        type Done = (LoggedOp, Result<(), String>);
        let mut inflight: FuturesUnordered<LocalBoxFuture<'static, Done>> = FuturesUnordered::new();
        let mut ranges: Vec<(u64, u64, u64)> = Vec::new();
        let mut next: Option<Planned> = None;
        loop {
            let p = match next.take() {
                Some(p) => p,
                None if self.faults_over() => break,
                None if self.shared.exhausted() => {
                    if cfg.ends_faults {
                        self.faults_over.store(true, Ordering::Relaxed);
                    }
                    break;
                }
                None => self.shared.draw(),
            };
            let blocked = match p.kind {
                OpKind::Flush => !ranges.is_empty(),
                _ => {
                    ranges.len() >= cfg.depth
                        || ranges.iter().any(|(_, a, b)| *a < p.offset + p.len && p.offset < *b)
                }
            };
            if blocked {
                if let Some(done) = inflight.next().await {
                    ranges.retain(|(id, _, _)| *id != done.0.id);
                    self.completed(done)?;
                }
                next = Some(p);
                continue;
            }
            let op = self.shared.log(p);
            match op.kind {
                OpKind::Flush => {
                    self.retry("flush", || vol.flush()).await?;
                    self.shared.ack(&op);
                    self.note(format!("ack flush {} (epoch {})", op.id, op.epoch));
                }
                // This client's planner takes none (the crash checker's
                // trials do).
                OpKind::Snapshot | OpKind::Resize | OpKind::DeleteSnapshot | OpKind::Rollback => {
                    return Err("the simulated volume client plans no snapshots or resizes".into())
                }
                OpKind::Write | OpKind::Trim => {
                    ranges.push((op.id, op.offset, op.offset + op.len));
                    inflight.push(issue(
                        self.env.clone(),
                        vol.clone(),
                        op,
                        self.trace.clone(),
                        self.host.clone(),
                    ));
                }
            }
        }
        while let Some(done) = inflight.next().await {
            self.completed(done)?;
        }
        Ok(())
    }

    fn completed(&self, (op, r): (LoggedOp, Result<(), String>)) -> Result<(), BoxError> {
        match r {
            Ok(()) => {
                self.shared.ack(&op);
                let what = if op.kind == OpKind::Trim { "trim" } else { "write" };
                self.note(format!("ack {what} {} [{}, +{}) epoch {}", op.id, op.offset, op.len, op.epoch));
                Ok(())
            }
            Err(e) => Err(format!("{}: op {} never succeeded: {e}", self.host, op.id).into()),
        }
    }
}

/// A write (its sectors tagged with its id and epoch) or trim, retried
/// until it succeeds: one log entry, the same bytes every time.
fn issue(
    env: Env,
    vol: Arc<Volume>,
    op: LoggedOp,
    trace: Trace,
    host: String,
) -> LocalBoxFuture<'static, (LoggedOp, Result<(), String>)> {
    async move {
        let data = (op.kind == OpKind::Write).then(|| {
            let mut b = vec![0u8; op.len as usize];
            fill(&mut b, op.offset, op.id, op.epoch);
            Bytes::from(b)
        });
        let mut tries = 0;
        loop {
            let r = match &data {
                Some(d) => vol.write(op.offset, d.clone(), false).await,
                None => vol.trim(op.offset, op.len).await,
            };
            match r {
                Ok(()) => return (op, Ok(())),
                Err(e) => {
                    tries += 1;
                    trace.event(&host, format!("op {} failed (try {tries}), retrying: {e}", op.id));
                    if tries > 50 {
                        return (op, Err(e.to_string()));
                    }
                    env.sleep(RETRY_PAUSE).await;
                }
            }
        }
    }
    .boxed_local()
}
