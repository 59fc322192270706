//! An LSVD volume: the journal in front, the object log behind, and the
//! destager moving records from one to the other (design 0008).
//!
//! | operation | path | acknowledged when |
//! |---|---|---|
//! | write | a journal record (split at the ring's record size) | written to the cache file, and every earlier record too |
//! | trim | a journal record with no data | the same |
//! | flush | `fdatasync` of the journal (group commit) | every acknowledged record is durable |
//! | read | journal map, then object map, then zeros | — |
//! | destage (background) | sync the journal, coalesce the next records into one object, create it, apply it, move the journal's tail | — |
//! | clean (background, idle) | copy the least-live objects' live pieces into one object at the head, checkpoint, then delete them | — |
//!
//! Invariants kept here (numbered as in the design):
//! 1. an object holds only journal records a sync covered (`destage_step`
//!    syncs before it takes records, and asserts `upto < synced`);
//! 2. journal space is released only after the header's tail moved past
//!    it durably and the objects holding it were durable
//!    (`reclaim`, which asserts the released records are folded);
//! 3. objects are created one at a time, in seq order (one destager task);
//! 4. a journal record a read is using is not released (`pins`); an
//!    object is deleted only after a durable checkpoint in which it is
//!    dead (`write_checkpoint`), and a read that finds it gone looks its
//!    range up again.
//!
//! The journal map changes only in record order (`applied`), so it always
//! equals what replaying the journal would give; a write is acknowledged
//! only once it is applied.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use blizzard_env::{Env, Instant};

use crate::error::LsvdError;
use crate::extent_map::{ExtentMap, Loc};
use crate::format::{
    block_crcs, check_snapshot_name, Descriptor, ObjExtent, ObjectHeader, ObjectKind, RecordKind, SECTOR,
};
use crate::journal::{Journal, RecMeta, Ring};
use crate::objlog::{self, LogState, ObjectLog};
use crate::read_cache::{CacheStats, ReadCache};
use crate::store::{checkpoint_name, snapshot_name, Counts, Store};
use crate::Planted;

mod clean;
mod destage;

use destage::{destager, landed};

/// The read cache's file name, beside the cache (journal) file.
pub const READ_CACHE_FILE: &str = "read-cache";

/// Tunables of an open volume.
#[derive(Clone, Debug)]
pub struct Config {
    /// Size of the cache file when it is created.
    pub cache_bytes: u64,
    /// Size of the read cache ([`READ_CACHE_FILE`] beside the cache
    /// file); 0: none, every read of object data is a request.
    pub read_cache_bytes: u64,
    /// Seal an object smaller than the target once records have waited
    /// this long (the object store never lags the cache by much more).
    pub destage_delay: Duration,
    /// Objects between map checkpoints.
    pub checkpoint_every: u64,
    /// Pause between tries of a put the object store failed.
    pub retry_pause: Duration,
    /// Clean (garbage-collect) once live data falls below this share of
    /// the data stored in objects (the paper's 70 %)...
    pub gc_live_ratio: f64,
    /// ...and at least this many object bytes are stored.
    pub gc_min_bytes: u64,
    /// Cleaning copies holes of at most this many bytes between the pieces
    /// it moves, so sequential ranges come back together (defragmentation,
    /// the paper's §4.6: 8 KiB); 0: never.
    pub defrag_hole_max: u64,
    pub planted: Planted,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            cache_bytes: 1 << 30,
            read_cache_bytes: 0,
            destage_delay: Duration::from_millis(500),
            checkpoint_every: 64,
            retry_pause: Duration::from_millis(200),
            gc_live_ratio: 0.7,
            gc_min_bytes: 64 << 20,
            defrag_hole_max: 8 << 10,
            planted: Planted::None,
        }
    }
}

/// Where bytes live in the journal: record `seq` at `pos`, `at` bytes into
/// its data; or zeros (a trim record).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JLoc {
    pub seq: u64,
    pub pos: u64,
    pub at: u64,
    pub zero: bool,
}

impl Loc for JLoc {
    fn advance(self, by: u64) -> Self {
        if self.zero {
            self
        } else {
            JLoc { at: self.at + by, ..self }
        }
    }
}

/// What a volume reports about itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Info {
    pub name: String,
    pub uuid: u128,
    pub size: u64,
    /// Newest object applied, and this writer's epoch.
    pub head: u64,
    pub epoch: u64,
    /// Data bytes in the journal not yet in objects: what is lost if the
    /// cache disk dies (the volume then comes back as the objects' prefix).
    pub dirty_bytes: u64,
    pub cache_used: u64,
    pub cache_len: u64,
    /// Live and total data bytes in objects.
    pub live_bytes: u64,
    pub stored_bytes: u64,
    pub objects: u64,
    pub map_extents: u64,
    /// What the open found: the checkpoint it started from, the objects
    /// it rolled forward over, the journal records it replayed.
    pub recovered_checkpoint: u64,
    pub rolled: u64,
    pub replayed: u64,
    /// The read cache's hits, misses and lines (zeros without one).
    pub read_cache: CacheStats,
}

struct State {
    ring: Ring,
    jmap: ExtentMap<JLoc>,
    log: LogState,
    /// Records written whose turn to be applied has not come.
    done: BTreeSet<u64>,
    /// Every record below this seq is written and applied to `jmap`.
    applied: u64,
    /// Every record up to this seq is in a durable object.
    folded: u64,
    /// Data bytes and write/trim records of records after `folded`.
    dirty_bytes: u64,
    dirty_records: u64,
    dirty_since: Option<Instant>,
    /// Journal records reads are using: seq → readers.
    pins: BTreeMap<u64, u32>,
    failed: Option<LsvdError>,
    space_wanted: u32,
    drain_wanted: u32,
    stopping: bool,
    objects_since_checkpoint: u64,
    /// Cleaned objects and the seq of the object that took their live
    /// data: deleted once a checkpoint at or after it is durable.
    doomed: Vec<(u64, u64)>,
    /// Seq of the newest durable checkpoint (0: none).
    checkpoint: u64,
    /// Checkpoints this writer wrote or found at open, oldest first (the
    /// newest two kept; a snapshot's checkpoint is never deleted here).
    checkpoints: std::collections::VecDeque<u64>,
    /// This volume's snapshots: name → (seq, the objects of this volume
    /// its map reads). Cleaning never picks those objects, so they exist
    /// while the snapshot does.
    snapshots: BTreeMap<String, (u64, BTreeSet<u64>)>,
    /// Snapshots asked for, taken by the destager between its steps.
    snap_requests: Vec<(String, tokio::sync::oneshot::Sender<Result<u64, LsvdError>>)>,
}

impl State {
    /// Objects some snapshot needs.
    fn protected(&self) -> BTreeSet<u64> {
        self.snapshots.values().flat_map(|(_, objs)| objs.iter().copied()).collect()
    }

    /// Whether checkpoint `seq` is a snapshot's (kept while it exists).
    fn snapshot_checkpoint(&self, seq: u64) -> bool {
        self.snapshots.values().any(|(s, _)| *s == seq)
    }
}

/// The objects of this volume (above `floor`, a clone's bases) that the
/// map at checkpoint `c` reads: what a snapshot at `c` needs kept.
fn needed_by(objects: impl IntoIterator<Item = crate::format::ObjStat>, floor: u64) -> BTreeSet<u64> {
    objects.into_iter().filter(|o| o.live > 0 && o.seq > floor).map(|o| o.seq).collect()
}

struct Inner {
    env: Env,
    log: ObjectLog,
    journal: Journal,
    cfg: Config,
    epoch: u64,
    /// This open's nonce, in every object it makes.
    writer: u64,
    /// Cleaning's threshold: the descriptor's, else the config's.
    gc_live_ratio: f64,
    /// (checkpoint, objects rolled, records replayed) at open.
    opened: (u64, u64, u64),
    state: Mutex<State>,
    /// Applied records, released space, destaged objects: waiters re-check.
    changed: Notify,
    /// Wakes the destager.
    work: Notify,
}

pub struct LsvdVolume {
    inner: Arc<Inner>,
    destager: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Creates a volume under `store`'s prefix: writes its descriptor. A
/// prefix that already holds one is refused.
pub async fn create(
    env: &Env,
    store: &Store,
    name: &str,
    size: u64,
    object_bytes: u64,
) -> Result<Descriptor, LsvdError> {
    create_with(env, store, name, size, object_bytes, None).await
}

/// [`create`] with a cleaning threshold of its own (percent live; `None`:
/// whoever opens it decides, by default the paper's 70 %).
pub async fn create_with(
    env: &Env,
    store: &Store,
    name: &str,
    size: u64,
    object_bytes: u64,
    gc_live_pct: Option<u8>,
) -> Result<Descriptor, LsvdError> {
    let created_secs =
        env.clock.system_time().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let desc = Descriptor {
        uuid: env.random_u128(),
        name: name.to_string(),
        size,
        object_bytes,
        created_secs,
        base: Vec::new(),
        gc_live_pct,
    };
    objlog::create(store, &desc).await?;
    Ok(desc)
}

/// What the object store holds of a volume, read without opening it (no
/// claim, no cache): `blizzard volume info`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub desc: Descriptor,
    /// Newest object, and the newest journal record it folds: what the
    /// volume comes back as if its cache is lost.
    pub head: u64,
    pub journal_seq: u64,
    pub objects: u64,
    pub live_bytes: u64,
    pub stored_bytes: u64,
    /// The checkpoint recovery started from, and objects rolled over.
    pub checkpoint: u64,
    pub rolled: u64,
    /// When the newest data object was created (seconds since the Unix
    /// epoch, the store's clock), if there is one.
    pub newest_object_secs: Option<i64>,
}

/// Reads the volume under `store` as recovery would, changing nothing: a
/// process writing it carries on. `expected` is the name it must have.
pub async fn inspect(store: &Store, expected: Option<&str>) -> Result<Summary, LsvdError> {
    let rec = objlog::recover(store.clone(), expected, None).await?;
    let (live, stored) = rec.state.utilization(rec.log.desc().base_upto());
    let newest = store.newest("d").await?.map(|(_, t)| t);
    Ok(Summary {
        desc: rec.log.desc().clone(),
        head: rec.state.head,
        journal_seq: rec.state.journal_seq,
        objects: rec.state.objects.range(rec.log.desc().base_upto() + 1..).count() as u64,
        live_bytes: live,
        stored_bytes: stored,
        checkpoint: rec.checkpoint,
        rolled: rec.rolled,
        newest_object_secs: newest,
    })
}

/// Deletes every object of the volume under `store`: data objects and
/// claims, checkpoints, snapshots, and the descriptor last (so a delete
/// cut off part way still names the volume and can be run again), then
/// a clone's reference on its base. Only if the descriptor is volume
/// `uuid`'s: another volume's objects are refused; and not while a clone
/// reads one of its snapshots (`InUse`, naming the clones). A prefix
/// with no descriptor is cleared of whatever log it holds.
/// Returns the number of objects deleted.
pub async fn destroy(store: &Store, uuid: u128) -> Result<u64, LsvdError> {
    let desc = match objlog::read_descriptor(store, None).await {
        Ok(d) if d.uuid != uuid => {
            return Err(LsvdError::OtherVolume {
                at: format!("prefix {:?}", store.prefix()),
                found: format!("{} ({:032x})", d.name, d.uuid),
                expected: format!("{uuid:032x}"),
            })
        }
        Ok(d) => Some(d),
        Err(LsvdError::NotFound(_)) => None,
        Err(e) => return Err(e),
    };
    let clones = crate::snapshot::live_clones(store, None).await?;
    if !clones.is_empty() {
        let names: Vec<&str> = clones.iter().map(|c| c.name.as_str()).collect();
        return Err(LsvdError::InUse(format!(
            "the volume's snapshots are the base of clone(s) {}: delete them first",
            names.join(", ")
        )));
    }
    let mut n = 0;
    for dir in ["s", "d", "c", "k"] {
        for name in store.list_paths(dir).await? {
            store.delete(&name).await?;
            n += 1;
        }
    }
    if store.get(crate::store::DESCRIPTOR).await?.is_some() {
        store.delete(crate::store::DESCRIPTOR).await?;
        n += 1;
    }
    if let Some(parent) = desc.as_ref().and_then(|d| d.base.last()) {
        store.at(&parent.prefix).delete(&crate::store::clone_ref_name(&parent.snapshot, uuid)).await?;
    }
    Ok(n)
}

/// Whether anything is stored under the prefix's log directories: a
/// prefix with objects but no descriptor is a deleted or cut-off volume's
/// remains, which a new volume there would roll forward over.
pub async fn holds_objects(store: &Store) -> Result<bool, LsvdError> {
    for dir in ["d", "c", "s", "k"] {
        if !store.list(dir).await?.is_empty() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// A read's plan: where each piece of the range comes from.
enum Src {
    Zero,
    Journal(JLoc),
    Object(objlog::ObjLoc),
}

impl Inner {
    /// The header of data object `seq` of this writer, holding `data`.
    fn data_header(&self, seq: u64, journal_seq: u64, data: &Bytes, extents: Vec<ObjExtent>) -> ObjectHeader {
        ObjectHeader {
            kind: ObjectKind::Data,
            uuid: self.log.desc().uuid,
            seq,
            epoch: self.epoch,
            writer: self.writer,
            journal_seq,
            data_len: data.len() as u64,
            extents,
            crcs: block_crcs(data),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Each critical section leaves the state whole, so poisoning
        // carries no information.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `f` returns `Some` (re-checked after every change).
    async fn wait_for<T>(&self, mut f: impl FnMut(&mut State) -> Option<T>) -> T {
        loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if let Some(v) = f(&mut self.lock()) {
                return v;
            }
            n.await;
        }
    }

    fn fail(&self, e: LsvdError) -> LsvdError {
        let mut s = self.lock();
        if s.failed.is_none() {
            tracing::error!(error = %e, "LSVD volume failed: later writes and flushes fail until it is reopened");
            s.failed = Some(e.clone());
        }
        drop(s);
        self.changed.notify_waiters();
        e
    }

    fn check_failed(s: &State) -> Result<(), LsvdError> {
        match &s.failed {
            Some(e) => Err(LsvdError::Failed(Box::new(e.clone()))),
            None => Ok(()),
        }
    }

    /// Applies written records to the journal map in seq order.
    fn apply_done(&self, s: &mut State) {
        while s.done.remove(&s.applied) {
            let Some(r) = s.ring.get(s.applied).copied() else {
                panic!("record {} written but not in the ring", s.applied)
            };
            apply_record(s, &r, self.env.now());
            s.applied += 1;
        }
    }

    /// Appends one record, and returns once it and every earlier record
    /// are written and applied.
    async fn append(
        &self,
        kind: RecordKind,
        offset: u64,
        len: u64,
        data: Option<Bytes>,
    ) -> Result<(), LsvdError> {
        let recs = loop {
            let n = self.changed.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            {
                let mut s = self.lock();
                Self::check_failed(&s)?;
                if let Some(recs) = s.ring.reserve(kind, offset, len) {
                    break recs;
                }
                s.space_wanted += 1;
            }
            self.work.notify_one();
            n.await;
            self.lock().space_wanted -= 1;
        };
        if let Err(e) = self.journal.append(&recs, data).await {
            // A reserved record that never reached the file breaks the
            // chain replay walks: nothing after it could be recovered.
            return Err(self.fail(e));
        }
        let last = recs[recs.len() - 1].seq;
        {
            let mut s = self.lock();
            s.done.extend(recs.iter().map(|r| r.seq));
            self.apply_done(&mut s);
            if s.dirty_bytes >= self.log.desc().object_bytes {
                self.work.notify_one();
            }
        }
        self.changed.notify_waiters();
        self.wait_for(|s| (s.applied > last).then_some(())).await;
        Ok(())
    }
}

/// Applies a record to the journal map and the dirty counts.
fn apply_record(s: &mut State, r: &RecMeta, now: Instant) {
    let loc = JLoc { seq: r.seq, pos: r.pos, at: 0, zero: r.kind == RecordKind::Trim };
    match r.kind {
        RecordKind::Write | RecordKind::Trim => {
            s.jmap.insert(r.vol_offset, r.len, Some(loc));
            s.dirty_records += 1;
            if r.kind == RecordKind::Write {
                s.dirty_bytes += r.len;
            }
            s.dirty_since.get_or_insert(now);
        }
        RecordKind::Wrap => {}
    }
}

impl LsvdVolume {
    /// Opens the volume under `store` for writing (recovery, the claim,
    /// then the journal's replay) with its cache file at `cache`.
    /// `name`, if given, must be the volume's name.
    pub async fn open(
        env: Env,
        store: Store,
        name: Option<&str>,
        cache: &Path,
        cfg: Config,
    ) -> Result<LsvdVolume, LsvdError> {
        let mut rec = objlog::recover(store, name, None).await?;
        if cfg.read_cache_bytes > 0 {
            let path = cache.with_file_name(READ_CACHE_FILE);
            rec.log.set_read_cache(ReadCache::open(&env, &path, cfg.read_cache_bytes).await?);
        }
        let writer = env.random_u64();
        let epoch = objlog::claim(&rec.log, &mut rec.state, writer).await?;
        // This process is the writer now: nothing else deletes objects.
        let floor = rec.log.desc().base_upto();
        let mut snapshots = BTreeMap::new();
        for (r, c) in crate::snapshot::load_all(&rec.log).await? {
            snapshots.insert(r.name, (r.seq, needed_by(c.objects, floor)));
        }
        let checkpoints = crate::snapshot::tidy_checkpoints(&rec.log, &snapshots).await?;
        let folded = rec.state.journal_seq;
        let (journal, ring, replay) =
            Journal::open(&env, cache, cfg.cache_bytes, rec.log.desc().uuid, folded).await?;
        tracing::info!(
            volume = %rec.log.desc().name,
            checkpoint = rec.checkpoint,
            rolled = rec.rolled,
            epoch,
            replayed = replay.records.len(),
            skipped = replay.skipped,
            cache_created = replay.created,
            "LSVD volume opened"
        );
        let mut s = State {
            applied: ring.next_seq(),
            ring,
            jmap: ExtentMap::new(),
            log: rec.state,
            done: BTreeSet::new(),
            folded,
            dirty_bytes: 0,
            dirty_records: 0,
            dirty_since: None,
            pins: BTreeMap::new(),
            failed: None,
            space_wanted: 0,
            drain_wanted: 0,
            stopping: false,
            objects_since_checkpoint: 0,
            doomed: Vec::new(),
            checkpoint: rec.checkpoint,
            checkpoints,
            snapshots,
            snap_requests: Vec::new(),
        };
        let now = env.now();
        for r in &replay.records {
            apply_record(&mut s, r, now);
        }
        let gc_live_ratio = rec.log.desc().gc_live_pct.map_or(cfg.gc_live_ratio, |p| f64::from(p) / 100.0);
        let inner = Arc::new(Inner {
            env,
            log: rec.log,
            journal,
            cfg,
            epoch,
            writer,
            gc_live_ratio,
            opened: (rec.checkpoint, rec.rolled, replay.records.len() as u64),
            state: Mutex::new(s),
            changed: Notify::new(),
            work: Notify::new(),
        });
        let task = tokio::spawn(destager(inner.clone()));
        Ok(LsvdVolume { inner, destager: Mutex::new(Some(task)) })
    }

    pub fn size(&self) -> u64 {
        self.inner.log.desc().size
    }

    pub fn name(&self) -> &str {
        &self.inner.log.desc().name
    }

    /// Requests sent to the object store so far.
    pub fn counts(&self) -> &Arc<Counts> {
        self.inner.log.store().counts()
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), LsvdError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(LsvdError::OutOfRange { offset, len, size: self.size() }),
        }
    }

    fn check_aligned(offset: u64, len: u64) -> Result<(), LsvdError> {
        if !offset.is_multiple_of(SECTOR) || !len.is_multiple_of(SECTOR) {
            return Err(LsvdError::Invalid(format!(
                "[{offset}, +{len}): LSVD volumes are written in whole {SECTOR}-byte sectors"
            )));
        }
        Ok(())
    }

    /// Writes `data` at `offset` (sectors); with `fua`, durable on return.
    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), LsvdError> {
        self.check(offset, data.len() as u64)?;
        Self::check_aligned(offset, data.len() as u64)?;
        let max = self.inner.lock().ring.record_data_max();
        let mut at = 0u64;
        while at < data.len() as u64 {
            let n = (data.len() as u64 - at).min(max);
            let piece = data.slice(at as usize..(at + n) as usize);
            self.inner.append(RecordKind::Write, offset + at, n, Some(piece)).await?;
            at += n;
        }
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeros (sectors).
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), LsvdError> {
        self.check(offset, len)?;
        Self::check_aligned(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.inner.append(RecordKind::Trim, offset, len, None).await
    }

    /// Every acknowledged write is durable when this returns (one
    /// `fdatasync` of the journal, shared by concurrent flushes).
    pub async fn flush(&self) -> Result<(), LsvdError> {
        Inner::check_failed(&self.inner.lock())?;
        if let Err(e) = self.inner.journal.sync().await {
            return Err(self.inner.fail(e));
        }
        Ok(())
    }

    /// Reads `[offset, offset + len)`.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, LsvdError> {
        self.check(offset, len)?;
        // An object the map named may be deleted by cleaning before it is
        // read (its data had moved): look the range up again.
        let mut tries = 0;
        loop {
            tries += 1;
            match self.read_once(offset, len).await {
                Err(LsvdError::NotFound(_)) if tries < 4 => continue,
                r => return r,
            }
        }
    }

    async fn read_once(&self, offset: u64, len: u64) -> Result<Bytes, LsvdError> {
        let mut plan: Vec<(u64, u64, Src)> = Vec::new();
        let pinned: Vec<u64>;
        {
            let mut s = self.inner.lock();
            for p in s.jmap.lookup(offset, len) {
                match p.loc {
                    Some(j) if j.zero => plan.push((p.start, p.len, Src::Zero)),
                    Some(j) => plan.push((p.start, p.len, Src::Journal(j))),
                    None => {
                        for q in s.log.map.lookup(p.start, p.len) {
                            plan.push((q.start, q.len, q.loc.map_or(Src::Zero, Src::Object)));
                        }
                    }
                }
            }
            pinned = plan
                .iter()
                .filter_map(|(_, _, src)| match src {
                    Src::Journal(j) => Some(j.seq),
                    _ => None,
                })
                .collect();
            for &seq in &pinned {
                *s.pins.entry(seq).or_default() += 1;
            }
        }
        let _unpin = Unpin { inner: &self.inner, seqs: pinned };
        let reads = plan.iter().map(|(_, plen, src)| async move {
            match src {
                Src::Zero => Ok(None),
                Src::Journal(j) => self.inner.journal.read(j.pos, j.at, *plen).await.map(Some),
                Src::Object(o) => self.inner.log.read(o.seq, o.off, *plen).await.map(Some),
            }
        });
        let parts = futures::future::join_all(reads).await;
        let mut out = BytesMut::zeroed(len as usize);
        for ((start, plen, _), part) in plan.iter().zip(parts) {
            if let Some(b) = part? {
                let at = (start - offset) as usize;
                out[at..at + *plen as usize].copy_from_slice(&b);
            }
        }
        Ok(out.freeze())
    }

    /// What `[offset, offset + len)` holds, as consecutive `(len, data)`
    /// runs from `offset`: `false` where it reads as zeros because nothing
    /// was written or it was trimmed (journal map first, then the object
    /// map), `true` where it may hold data.
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, LsvdError> {
        self.check(offset, len)?;
        let s = self.inner.lock();
        let mut runs: Vec<(u64, bool)> = Vec::new();
        let mut push = |n: u64, data: bool| match runs.last_mut() {
            Some(last) if last.1 == data => last.0 += n,
            _ if n > 0 => runs.push((n, data)),
            _ => {}
        };
        for p in s.jmap.lookup(offset, len) {
            match p.loc {
                Some(j) => push(p.len, !j.zero),
                None => {
                    for q in s.log.map.lookup(p.start, p.len) {
                        push(q.len, q.loc.is_some());
                    }
                }
            }
        }
        Ok(runs)
    }

    /// Waits until every record written so far is in a durable object
    /// (tests, snapshots, a clean hand-over).
    pub async fn drain(&self) -> Result<(), LsvdError> {
        let target = {
            let mut s = self.inner.lock();
            s.drain_wanted += 1;
            s.applied - 1
        };
        self.inner.work.notify_one();
        let r = self
            .inner
            .wait_for(|s| {
                if let Some(e) = &s.failed {
                    return Some(Err(LsvdError::Failed(Box::new(e.clone()))));
                }
                (s.folded >= target || s.dirty_records == 0).then_some(Ok(()))
            })
            .await;
        self.inner.lock().drain_wanted -= 1;
        r
    }

    /// Takes snapshot `name` of the volume as it is now: every write
    /// acknowledged before the call is in it (the journal is drained into
    /// objects first). O(1) in data: a checkpoint of the map and a small
    /// record. Returns the seq it names.
    pub async fn snapshot(&self, name: &str) -> Result<u64, LsvdError> {
        check_snapshot_name(name).map_err(LsvdError::Invalid)?;
        if self.inner.lock().snapshots.contains_key(name) {
            return Err(self.snapshot_exists(name));
        }
        self.drain().await?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        {
            let mut s = self.inner.lock();
            Inner::check_failed(&s)?;
            s.snap_requests.push((name.to_string(), tx));
        }
        self.inner.work.notify_one();
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(LsvdError::Invalid(format!(
                "volume {:?} was closed before snapshot {name:?} was taken",
                self.name()
            ))),
        }
    }

    fn snapshot_exists(&self, name: &str) -> LsvdError {
        LsvdError::InUse(format!(
            "volume {:?} already has a snapshot {name:?}: pick another name, or delete it first",
            self.name()
        ))
    }

    /// Deletes snapshot `name`: its record, then its checkpoint; the
    /// objects only it needed are cleaned like any dead object. Refused
    /// while a clone reads it.
    pub async fn delete_snapshot(&self, name: &str) -> Result<(), LsvdError> {
        check_snapshot_name(name).map_err(LsvdError::Invalid)?;
        let Some(seq) = self.inner.lock().snapshots.get(name).map(|(seq, _)| *seq) else {
            return Err(LsvdError::NotFound(format!("snapshot {name:?} of volume {:?}", self.name())));
        };
        let store = self.inner.log.store();
        let clones = crate::snapshot::live_clones(store, Some(name)).await?;
        if !clones.is_empty() {
            let names: Vec<&str> = clones.iter().map(|c| c.name.as_str()).collect();
            return Err(LsvdError::InUse(format!(
                "snapshot {name:?} of volume {:?} is the base of clone(s) {}: delete them first",
                self.name(),
                names.join(", ")
            )));
        }
        // The record first: once it is gone nothing opens the snapshot,
        // and only then may cleaning take its objects.
        let key = snapshot_name(name);
        landed(&self.inner, "deleting a snapshot", || store.delete(&key)).await?;
        let drop_checkpoint = {
            let mut s = self.inner.lock();
            s.snapshots.remove(name);
            !s.snapshot_checkpoint(seq) && !s.checkpoints.contains(&seq) && s.checkpoint != seq
        };
        if drop_checkpoint {
            let key = checkpoint_name(seq);
            landed(&self.inner, "deleting a snapshot's checkpoint", || store.delete(&key)).await?;
        }
        self.inner.work.notify_one();
        Ok(())
    }

    /// This volume's snapshots: name and seq, oldest first.
    pub fn snapshots(&self) -> Vec<(String, u64)> {
        let s = self.inner.lock();
        let mut v: Vec<(String, u64)> = s.snapshots.iter().map(|(n, (seq, _))| (n.clone(), *seq)).collect();
        v.sort_by_key(|(_, seq)| *seq);
        v
    }

    pub fn info(&self) -> Info {
        let s = self.inner.lock();
        let (live, stored) = s.log.utilization(self.inner.log.desc().base_upto());
        let d = self.inner.log.desc();
        Info {
            name: d.name.clone(),
            uuid: d.uuid,
            size: d.size,
            head: s.log.head,
            epoch: self.inner.epoch,
            dirty_bytes: s.dirty_bytes,
            cache_used: s.ring.used(),
            cache_len: s.ring.area_len(),
            live_bytes: live,
            stored_bytes: stored,
            objects: s.log.objects.range(self.inner.log.desc().base_upto() + 1..).count() as u64,
            map_extents: s.log.map.extents() as u64,
            recovered_checkpoint: self.inner.opened.0,
            rolled: self.inner.opened.1,
            replayed: self.inner.opened.2,
            read_cache: self.inner.log.read_cache().map(|c| c.stats()).unwrap_or_default(),
        }
    }

    /// Flushes and stops the destager. What is not destaged stays in the
    /// journal for the next open.
    pub async fn close(&self) -> Result<(), LsvdError> {
        let r = self.flush().await;
        self.inner.lock().stopping = true;
        self.inner.work.notify_one();
        let task = self.destager.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = task {
            let _ = t.await;
        }
        r
    }
}

impl Drop for LsvdVolume {
    fn drop(&mut self) {
        if let Some(t) = self.destager.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

/// Releases a read's pins of journal records.
struct Unpin<'a> {
    inner: &'a Inner,
    seqs: Vec<u64>,
}

impl Drop for Unpin<'_> {
    fn drop(&mut self) {
        if self.seqs.is_empty() {
            return;
        }
        let mut s = self.inner.lock();
        for seq in &self.seqs {
            if let Some(n) = s.pins.get_mut(seq) {
                *n -= 1;
                if *n == 0 {
                    s.pins.remove(seq);
                }
            }
        }
        let wanted = s.space_wanted > 0;
        drop(s);
        if wanted {
            self.inner.work.notify_one();
        }
    }
}
