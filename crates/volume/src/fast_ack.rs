//! Flush-epoch commits with fast acknowledgment (Blizzard §2.5.2).
//!
//! Writes are acknowledged at once and tagged with the current epoch (the
//! number of flushes so far). They are issued to the blob store strictly in
//! epoch order: a write of epoch N+1 is issued only after every write of
//! epochs ≤ N is durable ("retired"). Within an epoch writes go out in
//! parallel, except that a write overlapping an earlier one not yet durable
//! is held back until that one is, so the later of two acknowledged writes
//! to a byte always wins. Writes behind a held one that overlap nothing
//! held or in flight go out meanwhile: at a high queue depth of random
//! writes a few collide with a write waiting for its sync, and holding the
//! whole queue behind them would cap the epoch at one batch per sync.
//!
//! After the first `CACHED_AFTER` writes of an epoch, writes go out through
//! the tractservers' write caches (`write_cached`): a write is "written"
//! when every replica has applied it and "durable" only once a sync
//! covering its receipt succeeds. Syncs are batched: one starts when an
//! epoch is closed and all its writes are written, when a quarter of the
//! exposure limit is written, or `SYNC_DELAY` after the first write left
//! unsynced; one sync at a time. So a tractserver pays one `fdatasync` per
//! batch instead of one per few writes (a disk with a write cache and an
//! occasional FLUSH, which is what the epoch protocol needs). A write
//! issued after its epoch was already closed skips the cache: someone is
//! waiting for it, and one durable write is one round trip, not two.
//!
//! Invariants:
//! - `issue_epoch` only grows, and only past an epoch that is closed (a
//!   flush came after it), has nothing queued and nothing in flight, where
//!   a write stays in flight until a sync covering it succeeded. Hence
//!   after a crash the blob holds every write of epochs < R, some of R, and
//!   none after R (prefix consistency).
//! - A written-but-unsynced write keeps its range in `inflight_ranges`, so
//!   no later overlapping write goes out before it is durable; a failed
//!   sync can therefore write it again without undoing a newer one.
//! - A write goes out only when no earlier write overlapping it is queued,
//!   held or in flight (`pump`): held writes are older than queued ones, so
//!   a queued write is checked against everything held, and a held one
//!   against the held writes before it.
//! - Until a write is durable its data is in the write cache; reads overlay
//!   the cache on the blob, so no read returns data older than an
//!   acknowledged write.
//! - Acknowledged-but-not-durable data is bounded by `ExposureLimits`.
//! - On a replicated volume a write goes out only once its tracts' intent
//!   bits are durable, and holds them until it is durable (synced): a
//!   cached write not yet synced may be lost by one replica's tractserver
//!   and kept by another's, so until then its tracts may differ
//!   (`intent`).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use blizzard_env::{Env, Instant};

use crate::cache::{Data, WriteCache};
use crate::engine::{AllocExtent, Commit, Engine};
use crate::intent::{IntentGuard, IntentLog};
use crate::io::{BlobIo, CacheReceipt};
use crate::retry::{self, Refusal};
use crate::striping::Striping;
use crate::superblock::ExposureLimits;
use crate::superblock::Superblock;
use crate::write_through;
use crate::{extent_io, PlantedBug, VolumeError};

struct Op {
    seq: u64,
    epoch: u64,
    offset: u64,
    data: Data,
    acked_at: Instant,
    /// Write durably now rather than through the cache (its epoch is
    /// already closed).
    durable: bool,
}

struct Flight {
    epoch: u64,
    offset: u64,
    len: u64,
    acked_at: Instant,
    /// Kept to write it again if a sync fails.
    data: Data,
    /// Its tracts' intent bits, held from before it is issued until it is
    /// durable.
    intent: Option<IntentGuard>,
}

/// Writers and flushers fail while a write is stuck on a full disk, and
/// go on once it lands.
impl retry::Stuck for FastAck {
    fn stuck(&self, e: VolumeError) {
        let first = self.lock().refusal.stuck(e.clone());
        if first {
            tracing::error!(error = %e, "{}", retry::STUCK);
        }
        self.changed.notify_waiters();
        self.room.notify_waiters();
    }

    fn unstuck(&self) {
        if self.lock().refusal.unstuck() {
            tracing::info!("the writes stuck on a full disk landed; writes and flushes go on");
        }
    }
}

/// What to do about syncing after a state change.
enum SyncAction {
    Nothing,
    /// Sync these written writes (seq, receipt).
    Start(Vec<(u64, CacheReceipt)>),
    /// Nothing urgent: sync after `SYNC_DELAY`.
    Timer,
}

#[derive(Default)]
struct State {
    /// Flushes so far; new writes are tagged with it.
    curr_epoch: u64,
    /// The epoch whose writes may be issued now.
    issue_epoch: u64,
    queue: VecDeque<Op>,
    /// Writes of `issue_epoch` taken from the queue but held back, in
    /// acknowledgment order, because they overlap an earlier write that is
    /// not durable yet.
    held: VecDeque<Op>,
    /// The held writes' ranges: (start, seq) → end. They may overlap one
    /// another.
    held_ranges: BTreeMap<(u64, u64), u64>,
    /// The longest held write, so an overlap search knows how far before
    /// a range to look.
    held_len_max: u64,
    inflight: BTreeMap<u64, Flight>,
    /// The in-flight ranges by offset (start → end). They never overlap:
    /// `pump` holds back a write that overlaps one in flight.
    inflight_ranges: BTreeMap<u64, u64>,
    inflight_per_epoch: BTreeMap<u64, usize>,
    cache: WriteCache,
    next_seq: u64,
    out_bytes: u64,
    out_writes: u64,
    /// Written through the write cache, not yet covered by a sync.
    unsynced: Vec<(u64, CacheReceipt)>,
    unsynced_bytes: u64,
    /// A sync is under way.
    syncing: bool,
    /// A `SYNC_DELAY` timer is pending.
    sync_timer: bool,
    /// The timer fired while a sync was under way: start the next at once.
    sync_due: bool,
    /// Writes issued whose blob write has not returned yet.
    writing: u64,
    /// Writes issued so far in `issue_epoch`.
    issued_in_epoch: u64,
    /// Whether new writes and flushes are refused (`retry`): for good
    /// once a write this instance acknowledged can never land (another
    /// process claimed the volume: `VolumeError::Fenced`,
    /// `intent::claim`), or while one is stuck on a full disk. Either way
    /// the write stays in flight, so no later epoch is issued and the
    /// blob keeps a prefix of the acknowledged writes.
    refusal: Refusal,
}

pub struct FastAck {
    env: Env,
    io: Arc<dyn BlobIo>,
    striping: Striping,
    intent: Option<Arc<IntentLog>>,
    limits: ExposureLimits,
    planted: PlantedBug,
    state: Mutex<State>,
    /// Epochs retired (flushes wait on it).
    changed: Notify,
    /// A write became durable, so there may be room under the exposure
    /// limits. Woken one waiter at a time: each admitted writer passes it
    /// on while room remains, so a completion does not wake every waiting
    /// writer at once.
    room: Notify,
}

/// Longest a written write waits for a sync when nothing asks for one
/// (capped at a quarter of the volume's age limit).
const SYNC_DELAY: Duration = Duration::from_millis(10);

/// The first writes of each epoch are written durably; only later ones go
/// through the write cache. A small epoch (an application that flushes
/// every few writes) then costs one round trip per write, as before the
/// cache, instead of a write and a sync; a large one (no flushes for a
/// while) gets the batched syncs. A small exposure limit lowers it (to a
/// sixteenth of the limit), so even a volume that may hold only a few
/// undurable writes uses the cache for most of a long epoch.
const CACHED_AFTER: u64 = 64;

const SYNC_BATCH_DIV: u64 = 4;

impl FastAck {
    pub fn new(
        env: Env,
        io: Arc<dyn BlobIo>,
        striping: Striping,
        limits: ExposureLimits,
        intent: Option<Arc<IntentLog>>,
        planted: PlantedBug,
    ) -> Arc<FastAck> {
        Arc::new(FastAck {
            env,
            io,
            striping,
            intent,
            limits,
            planted,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            room: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// When the oldest undurable write was acknowledged. Sequence numbers
    /// follow acknowledgment order, so it is the first of the queue or of
    /// the in-flight map.
    fn oldest(st: &State) -> Option<Instant> {
        let q = st.queue.front().map(|o| o.acked_at);
        let h = st.held.front().map(|o| o.acked_at);
        let f = st.inflight.values().next().map(|f| f.acked_at);
        [q, h, f].into_iter().flatten().min()
    }

    /// Acknowledges a write (or, with `Data::Zero`, a trim) once it fits
    /// under the exposure limits.
    pub async fn write(self: &Arc<Self>, offset: u64, data: Data) -> Result<(), VolumeError> {
        let len = data.len();
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait = {
                let st = self.lock();
                st.refusal.check()?;
                let now = self.env.now();
                let age_max = Duration::from_millis(self.limits.age_ms_max as u64);
                let too_old = Self::oldest(&st).filter(|t| now.duration_since(*t) >= age_max);
                let busy = st.out_writes > 0
                    && (st.out_bytes + len > self.limits.bytes_max
                        || st.out_writes >= self.limits.writes_max as u64
                        || too_old.is_some());
                if !busy {
                    break;
                }
                // Wake on progress, or when the oldest write would age out.
                Self::oldest(&st)
                    .map(|t| age_max.saturating_sub(now.duration_since(t)))
                    .unwrap_or(age_max)
                    .max(Duration::from_millis(1))
            };
            let _ = self.env.timeout(wait, notified).await;
        }
        let issue = {
            let mut st = self.lock();
            let seq = st.next_seq;
            st.next_seq += 1;
            let epoch = st.curr_epoch;
            st.cache.insert(offset, data.clone(), seq);
            st.out_bytes += len;
            st.out_writes += 1;
            st.queue.push_back(Op { seq, epoch, offset, data, acked_at: self.env.now(), durable: false });
            let room = st.out_writes < self.limits.writes_max as u64 && st.out_bytes < self.limits.bytes_max;
            (self.pump(&mut st, false), room)
        };
        let (issue, room) = issue;
        self.spawn(issue);
        if room {
            self.room.notify_one();
        }
        Ok(())
    }

    /// Closes the current epoch. With `durable`, waits until every write
    /// acknowledged before it is durable.
    pub async fn flush(self: &Arc<Self>, durable: bool) -> Result<(), VolumeError> {
        let (closed, issue) = {
            let mut st = self.lock();
            st.refusal.check()?;
            let closed = st.curr_epoch;
            st.curr_epoch += 1;
            self.retire(&mut st);
            let issue = self.pump(&mut st, false);
            (closed, (issue, self.sync_action(&mut st)))
        };
        let (issue, sync) = issue;
        self.spawn(issue);
        self.run(sync);
        self.changed.notify_waiters();
        if !durable || self.planted == PlantedBug::AckDurableFlushEarly {
            return Ok(());
        }
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.lock();
                if st.issue_epoch > closed {
                    return Ok(());
                }
                st.refusal.check()?;
            }
            notified.await;
        }
    }

    /// A write can never land (another process claimed the volume, or a
    /// permanent refusal): writers and flushers waiting on this instance
    /// fail instead of waiting forever. The first failure is kept.
    fn fail(&self, e: VolumeError) {
        if e.kind() != crate::ErrorKind::Fenced {
            tracing::error!(error = %e, "{}", retry::FAILED);
        }
        self.lock().refusal.fail(e);
        self.changed.notify_waiters();
        self.room.notify_waiters();
    }

    /// Reads through the write cache.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        // Snapshot first: a write durable while the blob read is under way
        // leaves the cache, but its data is in the snapshot.
        let snap = self.lock().cache.snapshot(offset, len);
        let data = extent_io::read(&self.io, &self.striping, offset, len).await?;
        if snap.is_empty() {
            return Ok(data);
        }
        // Unique unless it is the blob's own buffer: copied only then.
        let mut buf = data.try_into_mut().unwrap_or_else(|shared| BytesMut::from(&shared[..]));
        WriteCache::overlay(&snap, offset, &mut buf);
        Ok(buf.freeze())
    }

    /// Undurable writes, and the bytes they hold (for status and tests).
    /// Acknowledged writes not yet durable that overlap the range.
    pub fn cached(&self, offset: u64, len: u64) -> Vec<(u64, Data)> {
        self.lock().cache.snapshot(offset, len)
    }

    pub fn outstanding(&self) -> (u64, u64) {
        let st = self.lock();
        (st.out_writes, st.out_bytes)
    }

    /// Advances `issue_epoch` past every closed epoch with nothing queued
    /// or in flight.
    fn retire(&self, st: &mut State) {
        while st.issue_epoch < st.curr_epoch
            && st.held.is_empty()
            && st.queue.front().is_none_or(|o| o.epoch != st.issue_epoch)
            && st.inflight_per_epoch.get(&st.issue_epoch).copied().unwrap_or(0) == 0
        {
            st.inflight_per_epoch.remove(&st.issue_epoch);
            st.issue_epoch += 1;
            st.issued_in_epoch = 0;
        }
    }

    /// Takes every write that may be issued now: held writes no longer
    /// blocked (only worth a look when `freed`, i.e. writes left flight),
    /// then queued writes of the issue epoch, holding back each one that
    /// overlaps an earlier write not durable yet.
    fn pump(&self, st: &mut State, freed: bool) -> Vec<Op> {
        let mut out = Vec::new();
        if freed && !st.held.is_empty() {
            for op in std::mem::take(&mut st.held) {
                let (a, b) = (op.offset, op.offset + op.data.len());
                // The held writes before this one are still in
                // `held_ranges`; those already issued were removed.
                if Self::overlaps_inflight(st, a, b) || Self::overlaps_held(st, a, b, op.seq) {
                    st.held.push_back(op);
                } else {
                    st.held_ranges.remove(&(a, op.seq));
                    self.issue(st, op, &mut out);
                }
            }
            if st.held.is_empty() {
                st.held_len_max = 0;
            }
        }
        while let Some(front) = st.queue.front() {
            let allowed = front.epoch == st.issue_epoch || self.planted == PlantedBug::IssueAcrossEpochs;
            if !allowed {
                break;
            }
            let Some(op) = st.queue.pop_front() else { break };
            let (a, b) = (op.offset, op.offset + op.data.len());
            // Every held write is older than every queued one.
            if Self::overlaps_inflight(st, a, b) || Self::overlaps_held(st, a, b, op.seq) {
                st.held_ranges.insert((a, op.seq), b);
                st.held_len_max = st.held_len_max.max(b - a);
                st.held.push_back(op);
            } else {
                self.issue(st, op, &mut out);
            }
        }
        out
    }

    fn overlaps_inflight(st: &State, a: u64, b: u64) -> bool {
        // In-flight ranges are disjoint, so only the last one starting
        // before `b` can overlap [a, b).
        st.inflight_ranges.range(..b).next_back().is_some_and(|(_, &end)| end > a)
    }

    /// Whether a held write older than `seq` overlaps [a, b).
    fn overlaps_held(st: &State, a: u64, b: u64, seq: u64) -> bool {
        if st.held_ranges.is_empty() {
            return false;
        }
        let from = (a.saturating_sub(st.held_len_max), 0);
        st.held_ranges.range(from..(b, 0)).any(|(&(_, s), &end)| s < seq && end > a)
    }

    /// Puts a write in flight.
    fn issue(&self, st: &mut State, mut op: Op, out: &mut Vec<Op>) {
        if !op.data.is_empty() {
            st.inflight_ranges.insert(op.offset, op.offset + op.data.len());
        }
        let cached_after = CACHED_AFTER.min(self.limits.writes_max as u64 / 16);
        op.durable = op.epoch < st.curr_epoch || st.issued_in_epoch < cached_after;
        st.issued_in_epoch += 1;
        st.writing += 1;
        st.inflight.insert(
            op.seq,
            Flight {
                epoch: op.epoch,
                offset: op.offset,
                len: op.data.len(),
                acked_at: op.acked_at,
                data: op.data.clone(),
                intent: None,
            },
        );
        *st.inflight_per_epoch.entry(op.epoch).or_default() += 1;
        out.push(op);
    }

    fn spawn(self: &Arc<Self>, ops: Vec<Op>) {
        for op in ops {
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.hold_intent(&op).await {
                    me.fail(e);
                    return;
                }
                let (m, o) = (&me, &op);
                let written = retry::until_landed(&me.env, "acknowledged write", &*me, || async move {
                    if o.durable {
                        extent_io::write(&m.io, &m.striping, o.offset, &o.data)
                            .await
                            .map(|_| CacheReceipt::new())
                    } else {
                        extent_io::write_cached(&m.io, &m.striping, o.offset, &o.data).await
                    }
                })
                .await;
                let receipt = match written {
                    Ok(r) => r,
                    Err(e) => {
                        // Never lands: it stays in flight.
                        me.fail(VolumeError::Io(e));
                        return;
                    }
                };
                if receipt.is_empty() {
                    // Durable already (a durable write, a trim, or a store
                    // without a write cache).
                    me.complete(&[op.seq], false);
                } else {
                    me.written(op.seq, receipt);
                }
            });
        }
    }

    /// Before a write goes out: its tracts' intent bits, durable, kept in
    /// its flight until it is durable (a write issued again after a failed
    /// sync still holds them). Retried like the write itself: it was
    /// acknowledged. `Err`: it never will be (another process claimed the
    /// volume, or a permanent refusal).
    async fn hold_intent(&self, op: &Op) -> Result<(), VolumeError> {
        let Some(intent) = &self.intent else { return Ok(()) };
        let held = self.lock().inflight.get(&op.seq).is_none_or(|f| f.intent.is_some());
        if held {
            return Ok(());
        }
        let tracts = &self.striping.tracts(op.offset, op.data.len());
        let guard =
            retry::until_landed(&self.env, "setting a write's intent bits", self, || intent.enter(tracts))
                .await?;
        if let Some(f) = self.lock().inflight.get_mut(&op.seq) {
            f.intent = Some(guard);
        }
        Ok(())
    }

    /// A cached write reached every replica: it waits for a sync.
    fn written(self: &Arc<Self>, seq: u64, receipt: CacheReceipt) {
        let action = {
            let mut st = self.lock();
            st.writing = st.writing.saturating_sub(1);
            let Some(len) = st.inflight.get(&seq).map(|f| f.len) else { return };
            st.unsynced.push((seq, receipt));
            st.unsynced_bytes += len;
            self.sync_action(&mut st)
        };
        self.run(action);
    }

    /// Whether to start a sync now, later, or not at all.
    fn sync_action(&self, st: &mut State) -> SyncAction {
        if st.syncing || st.unsynced.is_empty() {
            return SyncAction::Nothing;
        }
        // A closed epoch cannot retire (and a durable flush cannot return)
        // until its writes are synced: one sync once all of them are
        // written (only the issue epoch has writes out).
        let epoch_waits = st.curr_epoch > st.issue_epoch && st.writing == 0;
        // Held writes wait for this sync, and nothing else is being
        // written that a later one could batch with.
        let held_waits = !st.held.is_empty() && st.writing == 0;
        let full = st.unsynced.len() as u64 >= (self.limits.writes_max as u64 / SYNC_BATCH_DIV).max(1)
            || st.unsynced_bytes >= (self.limits.bytes_max / SYNC_BATCH_DIV).max(1);
        if epoch_waits || held_waits || full || st.sync_due || self.planted == PlantedBug::SkipCacheSync {
            st.syncing = true;
            st.sync_due = false;
            st.unsynced_bytes = 0;
            return SyncAction::Start(std::mem::take(&mut st.unsynced));
        }
        if st.sync_timer {
            return SyncAction::Nothing;
        }
        st.sync_timer = true;
        SyncAction::Timer
    }

    fn run(self: &Arc<Self>, action: SyncAction) {
        match action {
            SyncAction::Nothing => {}
            SyncAction::Timer => {
                let me = self.clone();
                let delay = SYNC_DELAY.min(Duration::from_millis(self.limits.age_ms_max as u64 / 4));
                tokio::spawn(async move {
                    me.env.sleep(delay).await;
                    let action = {
                        let mut st = me.lock();
                        st.sync_timer = false;
                        st.sync_due = true;
                        me.sync_action(&mut st)
                    };
                    me.run(action);
                });
            }
            SyncAction::Start(batch) => {
                let me = self.clone();
                tokio::spawn(async move {
                    let receipt: CacheReceipt = batch.iter().flat_map(|(_, r)| r.iter().cloned()).collect();
                    let seqs: Vec<u64> = batch.iter().map(|(s, _)| *s).collect();
                    let synced = if me.planted == PlantedBug::SkipCacheSync {
                        Ok(())
                    } else {
                        me.io.sync(receipt).await
                    };
                    match synced {
                        Ok(()) => me.complete(&seqs, true),
                        Err(e) => {
                            // The writes may be gone from a tractserver
                            // that restarted: write them again. They are
                            // still in flight, so nothing newer overlapping
                            // them went out meanwhile.
                            tracing::warn!(writes = seqs.len(), error = %e, "sync of cached writes failed; writing them again");
                            me.env.sleep(retry::RETRY_PAUSE).await;
                            let (again, action) = {
                                let mut st = me.lock();
                                st.syncing = false;
                                let again: Vec<Op> = seqs
                                    .iter()
                                    .filter_map(|s| {
                                        st.inflight.get(s).map(|f| Op {
                                            seq: *s,
                                            epoch: f.epoch,
                                            offset: f.offset,
                                            data: f.data.clone(),
                                            acked_at: f.acked_at,
                                            durable: false,
                                        })
                                    })
                                    .collect();
                                st.writing += again.len() as u64;
                                (again, me.sync_action(&mut st))
                            };
                            me.spawn(again);
                            me.run(action);
                        }
                    }
                });
            }
        }
    }

    /// Writes became durable (`synced`: through the sync under way).
    fn complete(self: &Arc<Self>, seqs: &[u64], synced: bool) {
        let mut released = Vec::new();
        let (issue, action) = {
            let mut st = self.lock();
            if synced {
                st.syncing = false;
            } else {
                // A durable write returned.
                st.writing = st.writing.saturating_sub(seqs.len() as u64);
            }
            for seq in seqs {
                let Some(mut f) = st.inflight.remove(seq) else { continue };
                released.extend(f.intent.take());
                if st.inflight_ranges.get(&f.offset) == Some(&(f.offset + f.len)) {
                    st.inflight_ranges.remove(&f.offset);
                }
                st.cache.remove_owned(f.offset, f.len, *seq);
                if let Some(n) = st.inflight_per_epoch.get_mut(&f.epoch) {
                    *n = n.saturating_sub(1);
                }
                st.out_bytes -= f.len;
                st.out_writes -= 1;
            }
            self.retire(&mut st);
            (self.pump(&mut st, true), self.sync_action(&mut st))
        };
        // Durable on every replica: their tracts may be unmarked.
        for g in released {
            g.finish(true);
        }
        self.spawn(issue);
        self.run(action);
        self.changed.notify_waiters();
        self.room.notify_one();
    }
}

/// The fast-ack engine behind `Volume`.
impl Engine for Arc<FastAck> {
    fn read(&self, offset: u64, len: u64) -> futures::future::BoxFuture<'_, Result<Bytes, VolumeError>> {
        Box::pin(async move {
            write_through::settle_suspects(self.intent.as_ref(), &self.striping, offset, len).await?;
            FastAck::read(self, offset, len).await
        })
    }

    fn write(
        &self,
        offset: u64,
        data: Data,
        fua: bool,
    ) -> futures::future::BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            FastAck::write(self, offset, data).await?;
            if fua {
                // FUA: durable before acknowledged. Everything before it
                // becomes durable too (epoch order).
                FastAck::flush(self, true).await?;
            }
            Ok(())
        })
    }

    fn flush(&self, durable: bool) -> futures::future::BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(FastAck::flush(self, durable))
    }

    fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> futures::future::BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>> {
        // The cache first (`write_through::blob_allocation` says why).
        let cached = self.cached(offset, len);
        Box::pin(async move {
            write_through::blob_allocation(&self.io, &self.striping, offset, len, &cached).await
        })
    }

    fn outstanding(&self) -> (u64, u64) {
        FastAck::outstanding(self)
    }

    fn resize<'a>(
        &'a self,
        next: Superblock,
        commit: Commit<'a>,
    ) -> futures::future::BoxFuture<'a, Result<Superblock, VolumeError>> {
        Box::pin(write_through::grow_in_place(&self.io, &self.striping, self.intent.as_ref(), next, commit))
    }

    fn reach(&self) -> u64 {
        self.striping.bytes_in(self.io.reach_tracts())
    }

    fn quiesce(&self) -> futures::future::BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            FastAck::flush(self, true).await?;
            match &self.intent {
                Some(i) => i.close().await,
                None => Ok(()),
            }
        })
    }

    fn intent(&self) -> Option<&Arc<IntentLog>> {
        self.intent.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::IoError;
    use futures::future::BoxFuture;
    use futures::FutureExt;
    use tokio::sync::Semaphore;

    /// A blob whose writes land at once and whose syncs wait for a permit
    /// from the test; it records every write in the order it arrived.
    struct GatedSyncs {
        writes: Mutex<Vec<(u64, u32, u8)>>,
        /// Tract → its bytes, as written.
        tracts: Mutex<BTreeMap<u64, Vec<u8>>>,
        gate: Arc<Semaphore>,
    }

    impl GatedSyncs {
        fn new(permits: usize) -> Arc<GatedSyncs> {
            Arc::new(GatedSyncs {
                writes: Mutex::new(Vec::new()),
                tracts: Mutex::new(BTreeMap::new()),
                gate: Arc::new(Semaphore::new(permits)),
            })
        }

        fn land(&self, tract: u64, offset: u32, data: &[u8]) {
            self.writes.lock().expect("test lock").push((tract, offset, data[0]));
            let mut tracts = self.tracts.lock().expect("test lock");
            let t = tracts.entry(tract).or_insert_with(|| vec![0; 1 << 20]);
            t[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        }
    }

    impl BlobIo for GatedSyncs {
        fn tract_size(&self) -> u32 {
            1 << 20
        }
        fn replication(&self) -> u8 {
            1
        }
        fn size_tracts(&self) -> u64 {
            64
        }
        fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
            async move { Ok(tracts) }.boxed()
        }
        fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
            self.land(tract, offset, &data);
            async { Ok(()) }.boxed()
        }
        fn read(&self, _: u64, _: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
            async move { Ok(Bytes::from(vec![0; len as usize])) }.boxed()
        }
        fn read_replicas(&self, _: u64, _: u32, _: u32) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
            async { Ok(Vec::new()) }.boxed()
        }
        fn trim(&self, _: u64, _: u32, _: u32) -> BoxFuture<'static, Result<(), IoError>> {
            async { Ok(()) }.boxed()
        }
        fn write_cached(
            &self,
            tract: u64,
            offset: u32,
            data: Bytes,
        ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
            self.land(tract, offset, &data);
            async { Ok(vec![("gated".to_string(), 0)]) }.boxed()
        }
        fn sync(&self, _: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
            let gate = self.gate.clone();
            async move {
                let permit = gate.acquire().await.map_err(|e| IoError::Other(e.to_string()))?;
                permit.forget();
                Ok(())
            }
            .boxed()
        }
    }

    /// Fast-ack over `io`: one 1 MiB tract per segment, 64 KiB blocks, and
    /// at most `writes_max` writes not yet durable.
    fn fast_ack(io: Arc<GatedSyncs>, writes_max: u32) -> Arc<FastAck> {
        let striping =
            Striping { tract_size: 1 << 20, block_size: 64 << 10, segment_tracts: 1, first_tract: 0 };
        let limits = ExposureLimits { bytes_max: 64 << 20, writes_max, age_ms_max: 60_000 };
        FastAck::new(Env::real(), io, striping, limits, None, PlantedBug::None)
    }

    async fn settle() {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    /// A write that overlaps one waiting for its sync is held back, but the
    /// writes behind it that overlap nothing still go out; the held one
    /// follows once the sync covered what it overlaps, so the last write
    /// to a byte still lands last.
    #[tokio::test]
    async fn writes_behind_a_held_write_go_out() {
        let io = GatedSyncs::new(0);
        // A sixteenth of 16 writes: only the first write of the epoch is
        // written durably, the rest through the cache.
        let fa = fast_ack(io.clone(), 16);
        let block = |v: u8| Data::Bytes(Bytes::from(vec![v; 4096]));

        fa.write(0, block(1)).await.expect("fast-ack call");
        settle().await;
        fa.write(0, block(2)).await.expect("fast-ack call");
        settle().await;
        // Overlaps the write of 2, which waits for a sync: held.
        fa.write(0, block(3)).await.expect("fast-ack call");
        // Overlap nothing: out at once, behind the held write.
        fa.write(1 << 20, block(4)).await.expect("fast-ack call");
        fa.write(2 << 20, block(5)).await.expect("fast-ack call");
        settle().await;
        let seen: Vec<u8> = io.writes.lock().expect("test lock").iter().map(|w| w.2).collect();
        assert_eq!(seen, vec![1, 2, 4, 5], "the held write went out early, or blocked the ones behind it");

        // Let every sync through: the held write goes out after the one it
        // overlaps became durable, and a durable flush covers it.
        io.gate.add_permits(1000);
        fa.flush(true).await.expect("fast-ack call");
        let at_zero: Vec<u8> = io
            .writes
            .lock()
            .expect("test lock")
            .iter()
            .filter(|w| w.0 == 0 && w.1 == 0)
            .map(|w| w.2)
            .collect();
        assert_eq!(at_zero, vec![1, 2, 3]);
        assert_eq!(fa.outstanding(), (0, 0));
    }

    /// Writes overlapping one another while held keep their order, also
    /// when a later one overlaps only a held write, not the one in flight:
    /// the blob ends up as the last write to each byte left it.
    #[tokio::test]
    async fn held_writes_keep_last_writer_wins() {
        let io = GatedSyncs::new(1000);
        let fa = fast_ack(io.clone(), 64);
        let mut model = vec![0u8; 3 * 4096];
        for v in 1..=30u8 {
            // [0, 4K), then [0, 8K) (held behind it), then [4K, 12K), which
            // overlaps only the held one, and so on.
            let (off, len) = match v % 3 {
                1 => (0, 4096),
                2 => (0, 8192),
                _ => (4096, 8192),
            };
            model[off..off + len].fill(v);
            fa.write(off as u64, Data::Bytes(Bytes::from(vec![v; len]))).await.expect("fast-ack call");
            if v % 7 == 0 {
                settle().await;
            }
        }
        fa.flush(true).await.expect("fast-ack call");
        let tracts = io.tracts.lock().expect("test lock");
        assert_eq!(&tracts[&0][..model.len()], &model[..]);
    }
}
