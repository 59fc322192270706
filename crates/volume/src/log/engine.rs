//! The log engine: assignment, durability in LSN order, checkpoints,
//! recovery. See `log/mod.rs` for the design and its invariants.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use blizzard_env::{Env, Instant};

use super::perm::Permutation;
use super::record::{decode_header, encode_header, BlockHeader, Checkpoint, Kind, HEADER_LEN, UNMAPPED};
use crate::cache::{Data, WriteCache};
use crate::engine::Runs;
use crate::io::BlobIo;
use crate::retry::{self, Refusal};
use crate::superblock::{ExposureLimits, LogExtent, LogGeometry, LOG_EXTENTS_MAX};
use crate::{PlantedBug, VolumeError};

/// Where the log lives in the blob.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogGeom {
    pub tract_size: u64,
    pub block_size: u64,
    /// Bytes one expanded block occupies: data + one header chunk.
    pub stride: u64,
    pub per_tract: u64,
    pub vblocks: u64,
    pub pblocks: u64,
    pub ckpt_tracts: [u64; 2],
    pub ckpt_slot_tracts: u64,
    /// Where the physical blocks live, in order (see [`LogGeometry`]). The
    /// last extent is always the last region of the blob, so growing the
    /// log without moving the checkpoints only lengthens it.
    pub extents: Vec<LogExtent>,
}

/// Physical blocks for `vblocks` virtual ones. Slack lets writes find free
/// blocks while superseded ones wait for the next checkpoint.
fn pblocks_for(vblocks: u64) -> u64 {
    vblocks + (vblocks / 4).max(32)
}

fn vblocks_for(size: u64, block_size: u64) -> Result<u64, VolumeError> {
    let vblocks = size.div_ceil(block_size);
    if vblocks >= UNMAPPED as u64 / 2 {
        return Err(VolumeError::Invalid("too many blocks for a log volume; use a larger block size".into()));
    }
    Ok(vblocks)
}

impl LogGeom {
    /// Lays out a new log volume of `size` bytes.
    pub fn plan(size: u64, block_size: u64, tract_size: u64) -> Result<LogGeom, VolumeError> {
        let stride = block_size + HEADER_LEN as u64;
        if stride > tract_size {
            return Err(VolumeError::Invalid(format!(
                "log mode needs block size + 4 KiB ({stride}) to fit in a tract ({tract_size}); pick a smaller block size"
            )));
        }
        let vblocks = vblocks_for(size, block_size)?;
        let pblocks = pblocks_for(vblocks);
        let ckpt = Checkpoint::encoded_len(vblocks);
        let slot = ckpt.div_ceil(tract_size);
        Ok(LogGeom {
            tract_size,
            block_size,
            stride,
            per_tract: tract_size / stride,
            vblocks,
            pblocks,
            ckpt_tracts: [1, 1 + slot],
            ckpt_slot_tracts: slot,
            extents: vec![LogExtent { first_tract: 1 + 2 * slot, blocks: pblocks }],
        })
    }

    /// The geometry of this log grown to `size` bytes (more virtual
    /// blocks than now). Blocks `0..pblocks` stay where they are, so the
    /// block map needs no copying; new physical blocks are appended. If the
    /// bigger checkpoint still fits its slots, the last extent (always at
    /// the end of the blob) just gets longer; otherwise new, larger slots
    /// go after the end of the blob, followed by a new extent for the new
    /// blocks. The old slots are then unused.
    pub fn grow(&self, size: u64) -> Result<LogGeom, VolumeError> {
        let vblocks = vblocks_for(size, self.block_size)?;
        if vblocks <= self.vblocks {
            return Err(VolumeError::Invalid("a log grows only by adding blocks".into()));
        }
        let pblocks = pblocks_for(vblocks).max(self.pblocks);
        let added = pblocks - self.pblocks;
        let mut g = self.clone();
        g.vblocks = vblocks;
        g.pblocks = pblocks;
        if Checkpoint::encoded_len(vblocks) <= self.ckpt_slot_tracts * self.tract_size {
            if let Some(last) = g.extents.last_mut() {
                last.blocks += added;
            }
            return Ok(g);
        }
        if self.extents.len() >= LOG_EXTENTS_MAX {
            return Err(VolumeError::Unsupported(format!(
                "this log volume has been grown past its checkpoint space {LOG_EXTENTS_MAX} times; grow it in fewer, larger steps"
            )));
        }
        // Room for twice the blocks, so the slots move O(log growth) times.
        // It costs tract numbers only: a checkpoint writes its own length.
        let room = (vblocks * 2).min(UNMAPPED as u64 / 2);
        let slot = Checkpoint::encoded_len(room).div_ceil(self.tract_size);
        let end = self.total_tracts();
        g.ckpt_tracts = [end, end + slot];
        g.ckpt_slot_tracts = slot;
        g.extents.push(LogExtent { first_tract: end + 2 * slot, blocks: added });
        Ok(g)
    }

    /// The geometry for a smaller `size`: fewer virtual blocks, the same
    /// ring and checkpoint slots (the physical blocks the dropped virtual
    /// ones used become free slack).
    pub fn shrink(&self, size: u64) -> Result<LogGeom, VolumeError> {
        let vblocks = vblocks_for(size, self.block_size)?;
        if vblocks >= self.vblocks {
            return Err(VolumeError::Invalid("a log shrinks only by dropping blocks".into()));
        }
        Ok(LogGeom { vblocks, ..self.clone() })
    }

    pub fn from_superblock(l: &LogGeometry, size: u64, block_size: u64, tract_size: u64) -> LogGeom {
        let stride = block_size + HEADER_LEN as u64;
        LogGeom {
            tract_size,
            block_size,
            stride,
            per_tract: (tract_size / stride).max(1),
            vblocks: size.div_ceil(block_size),
            pblocks: l.physical_blocks,
            ckpt_tracts: l.checkpoint_tracts,
            ckpt_slot_tracts: l.checkpoint_slot_tracts,
            extents: l.extents.clone(),
        }
    }

    pub fn superblock_part(&self) -> LogGeometry {
        LogGeometry {
            physical_blocks: self.pblocks,
            checkpoint_tracts: self.ckpt_tracts,
            checkpoint_slot_tracts: self.ckpt_slot_tracts,
            extents: self.extents.clone(),
        }
    }

    /// Tracts the blob needs: up to the end of the last region in use.
    pub fn total_tracts(&self) -> u64 {
        let slots = self.ckpt_tracts.iter().map(|t| t + self.ckpt_slot_tracts);
        let logs = self.extents.iter().map(|x| x.first_tract + x.blocks.div_ceil(self.per_tract));
        slots.chain(logs).max().unwrap_or(1)
    }

    /// Tract and byte offset of physical block `p`.
    pub fn loc(&self, p: u64) -> (u64, u32) {
        let mut rel = p;
        let mut first = 0;
        for (i, x) in self.extents.iter().enumerate() {
            first = x.first_tract;
            // `p < pblocks` always lands inside an extent; anything else
            // maps past the last one, as a single-extent log always did.
            if rel < x.blocks || i + 1 == self.extents.len() {
                break;
            }
            rel -= x.blocks;
        }
        (first + rel / self.per_tract, ((rel % self.per_tract) * self.stride) as u32)
    }
}

struct Pending {
    vblock: u64,
    phys: u32,
    kind: Kind,
    durable: bool,
    acked_at: Instant,
}

struct State {
    /// Changes only in [`LogEngine::grow`], with the log drained; blocks
    /// keep their location across a change, so a read may use either.
    geom: Arc<LogGeom>,
    map: Vec<u32>,
    alloc: Vec<bool>,
    /// Superseded since the last checkpoint: still allocated until the next
    /// checkpoint is durable (the last one may still reference them).
    pending_free: Vec<u32>,
    perm: Permutation,
    next_lsn: u64,
    /// Every LSN below this is applied to `map`.
    applied_lsn: u64,
    curr_epoch: u64,
    window: BTreeMap<u64, Pending>,
    cache: WriteCache,
    ckpt_seq: u64,
    since_ckpt: u64,
    quiescing: bool,
    ckpt_running: bool,
    /// Bumped whenever freed blocks are released for reuse; a read that
    /// spans a release retries (its physical block may have been reused).
    free_gen: u64,
    out_bytes: u64,
    /// Set when a resize's superblock write failed: it may have reached
    /// some replicas, so this incarnation must not write under either
    /// geometry; reopening settles the superblock and picks one.
    fenced: Option<String>,
    /// Whether changes and flushes are refused (`retry`): for good once a
    /// record or checkpoint can never land (another process claimed the
    /// volume: `VolumeError::Fenced`, `intent::claim`), or while one is
    /// stuck on a full disk. The record stays unapplied meanwhile, so the
    /// map never passes it.
    refusal: Refusal,
}

/// Changes and flushes fail while a record is stuck on a full disk, and
/// go on once it lands.
impl retry::Stuck for LogEngine {
    fn stuck(&self, e: VolumeError) {
        let first = self.lock().refusal.stuck(e.clone());
        if first {
            tracing::error!(error = %e, "{}", retry::STUCK);
        }
        self.changed.notify_waiters();
    }

    fn unstuck(&self) {
        if self.lock().refusal.unstuck() {
            tracing::info!("the log writes stuck on a full disk landed; writes and flushes go on");
        }
    }
}

pub struct LogEngine {
    env: Env,
    io: Arc<dyn BlobIo>,
    /// Fixed at creation (the geometry's may be read without the lock).
    block_size: u64,
    limits: ExposureLimits,
    planted: PlantedBug,
    state: Mutex<State>,
    changed: Notify,
    block_locks: Mutex<HashMap<u64, Arc<tokio::sync::Mutex<()>>>>,
    ckpt_lock: tokio::sync::Mutex<()>,
}

/// Checkpoint after this many applied writes (and whenever freed blocks
/// pile up past half the slack).
const CKPT_EVERY: u64 = 4096;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl LogEngine {
    /// Writes the first checkpoint of a new log volume.
    pub async fn format(io: &Arc<dyn BlobIo>, geom: &LogGeom, seed: u64) -> Result<(), VolumeError> {
        let c = Checkpoint {
            seq: 1,
            next_lsn: 1,
            epoch: 0,
            perm: Permutation::new(geom.pblocks, seed),
            map: vec![UNMAPPED; geom.vblocks as usize],
        };
        write_checkpoint(io, geom, &c).await
    }

    /// Opens a log volume: loads the newest checkpoint, rolls forward, and
    /// makes a new checkpoint durable before returning.
    pub async fn open(
        env: Env,
        io: Arc<dyn BlobIo>,
        geom: LogGeom,
        limits: ExposureLimits,
        planted: PlantedBug,
    ) -> Result<Arc<LogEngine>, VolumeError> {
        Self::open_as(env, io, geom, limits, planted, false).await
    }

    /// Opens a log to read it as it is (a snapshot's): recovered in
    /// memory, nothing written.
    pub async fn open_read_only(
        env: Env,
        io: Arc<dyn BlobIo>,
        geom: LogGeom,
    ) -> Result<Arc<LogEngine>, VolumeError> {
        Self::open_as(env, io, geom, ExposureLimits::default(), PlantedBug::None, true).await
    }

    async fn open_as(
        env: Env,
        io: Arc<dyn BlobIo>,
        geom: LogGeom,
        limits: ExposureLimits,
        planted: PlantedBug,
        read_only: bool,
    ) -> Result<Arc<LogEngine>, VolumeError> {
        let mut best: Option<Checkpoint> = None;
        for slot in 0..2 {
            // A checkpoint belongs to exactly one geometry: one for another
            // size (left by a resize that did not commit, or overwritten
            // by one) is not a candidate.
            let found = read_checkpoint(&io, &geom, slot).await?.filter(|c| c.perm.n == geom.pblocks);
            if let Some(c) = found {
                if best.as_ref().is_none_or(|b| c.seq > b.seq) {
                    best = Some(c);
                }
            }
        }
        let Some(ckpt) = best else {
            return Err(VolumeError::Unsupported(
                "neither checkpoint of this log volume is intact; it cannot be recovered".into(),
            ));
        };
        let mut alloc = vec![false; geom.pblocks as usize];
        for &p in &ckpt.map {
            if let Some(a) = alloc.get_mut(p as usize) {
                *a = true;
            }
        }
        let mut st = State {
            geom: Arc::new(geom.clone()),
            map: ckpt.map.clone(),
            alloc,
            pending_free: Vec::new(),
            perm: ckpt.perm,
            next_lsn: ckpt.next_lsn,
            applied_lsn: ckpt.next_lsn,
            curr_epoch: ckpt.epoch,
            window: BTreeMap::new(),
            cache: WriteCache::new(),
            ckpt_seq: ckpt.seq,
            since_ckpt: 0,
            quiescing: false,
            ckpt_running: false,
            free_gen: 0,
            out_bytes: 0,
            fenced: None,
            refusal: Refusal::default(),
        };
        let rolled = roll_forward(&io, &mut st, planted).await?;
        tracing::debug!(checkpoint = ckpt.seq, rolled, next_lsn = st.next_lsn, "log volume recovered");
        // A crash closes the epoch it happened in.
        st.curr_epoch += 1;
        let engine = Arc::new(LogEngine {
            env,
            io,
            block_size: geom.block_size,
            limits,
            planted,
            state: Mutex::new(st),
            changed: Notify::new(),
            block_locks: Mutex::new(HashMap::new()),
            ckpt_lock: tokio::sync::Mutex::new(()),
        });
        if read_only {
            // A snapshot's view: nothing is written (no write comes).
            return Ok(engine);
        }
        // Durable before any new write: new writes carry the new seq.
        engine.checkpoint().await?;
        Ok(engine)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn bs(&self) -> u64 {
        self.block_size
    }

    /// The log's current geometry.
    pub fn geom(&self) -> Arc<LogGeom> {
        self.lock().geom.clone()
    }

    fn fenced(st: &State) -> Result<(), VolumeError> {
        st.refusal.check()?;
        match &st.fenced {
            None => Ok(()),
            Some(why) => Err(VolumeError::Unsupported(format!(
                "{why}; reopen the volume (recovery settles the superblock)"
            ))),
        }
    }

    /// A record or checkpoint can never land (another process claimed the
    /// volume, or a permanent refusal): everything waiting on the log
    /// fails instead of waiting forever. The first failure is kept.
    fn fail(&self, e: VolumeError) {
        if e.kind() != crate::ErrorKind::Fenced {
            tracing::error!(error = %e, "{}", retry::FAILED);
        }
        self.lock().refusal.fail(e);
        self.changed.notify_waiters();
    }

    /// Undurable writes and bytes.
    /// For each virtual block in `first..first + count`: whether the
    /// applied block map holds it, and the acknowledged writes not yet
    /// applied that overlap the byte range `[offset, offset + len)`.
    pub fn allocation(&self, offset: u64, len: u64) -> (Vec<bool>, Vec<(u64, Data)>) {
        let bs = self.bs();
        let st = self.lock();
        let first = offset / bs;
        let last = (offset + len - 1) / bs;
        let mapped = (first..=last).map(|v| st.map.get(v as usize).is_some_and(|&p| p != UNMAPPED)).collect();
        (mapped, st.cache.snapshot(offset, len))
    }

    pub fn outstanding(&self) -> (u64, u64) {
        let st = self.lock();
        (st.window.len() as u64, st.out_bytes)
    }

    async fn admit(&self, blocks: u64) -> Result<(), VolumeError> {
        let bytes = blocks * self.bs();
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait = {
                let st = self.lock();
                Self::fenced(&st)?;
                let now = self.env.now();
                let age_max = Duration::from_millis(self.limits.age_ms_max as u64);
                // LSNs are assigned in acknowledgment order: the first is the oldest.
                let oldest = st.window.values().next().map(|p| p.acked_at);
                let too_old = oldest.is_some_and(|t| now.duration_since(t) >= age_max);
                let n = st.window.len() as u64;
                let busy = n > 0
                    && (st.out_bytes + bytes > self.limits.bytes_max
                        || n + blocks > self.limits.writes_max as u64
                        || too_old);
                if !busy && !st.quiescing {
                    return Ok(());
                }
                oldest
                    .map(|t| age_max.saturating_sub(now.duration_since(t)))
                    .unwrap_or(age_max)
                    .max(Duration::from_millis(1))
            };
            let _ = self.env.timeout(wait, notified).await;
        }
    }

    fn block_lock(&self, v: u64) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.block_locks).entry(v).or_default().clone()
    }

    fn forget_block_lock(&self, v: u64, l: &Arc<tokio::sync::Mutex<()>>) {
        let mut m = lock(&self.block_locks);
        if m.get(&v).is_some_and(|x| Arc::ptr_eq(x, l) && Arc::strong_count(x) == 2) {
            m.remove(&v);
        }
    }

    /// Writes `data` (or zeros) at volume byte `offset`: one log record per
    /// virtual block, partial blocks merged with their current content.
    pub async fn write(self: &Arc<Self>, offset: u64, data: Data) -> Result<(), VolumeError> {
        let bs = self.bs();
        let end = offset + data.len();
        let first = offset / bs;
        let last = (end - 1) / bs;
        self.admit(last - first + 1).await?;
        for v in first..=last {
            let (bs_start, bs_end) = (v * bs, (v + 1) * bs);
            let (a, b) = (offset.max(bs_start), end.min(bs_end));
            let part = data.slice(a - offset, b - offset);
            let l = self.block_lock(v);
            let guard = l.lock().await;
            let record = if a == bs_start && b == bs_end {
                match part {
                    // A block that holds nothing (never written, its last
                    // record a trim, or a trim of it in flight) reads as
                    // zeros in every state a crash can leave from here on
                    // that this trim could: a record would change nothing
                    // (a later FLUSH still waits for the trim in flight,
                    // as for every record before it). Skipping it
                    // makes mkfs's whole-volume discard of a new volume
                    // free instead of a record per block (7.5 s per GiB).
                    Data::Zero(_) if self.holds_nothing(v) => {
                        drop(guard);
                        self.forget_block_lock(v, &l);
                        continue;
                    }
                    Data::Zero(_) => None,
                    Data::Bytes(bytes) => Some(bytes),
                }
            } else {
                // Read the rest of the block first (the read-before-write a
                // partial write costs in log mode).
                let old = self.read_block(v).await?;
                let mut m = BytesMut::from(&old[..]);
                part.copy_to(&mut m[(a - bs_start) as usize..(b - bs_start) as usize]);
                Some(m.freeze())
            };
            self.assign_and_issue(v, record).await?;
            drop(guard);
            self.forget_block_lock(v, &l);
        }
        Ok(())
    }

    /// Whether block `v` reads as zeros and will after every record in
    /// flight applies: unmapped with no record in flight, or its newest
    /// record in flight a trim (records apply in LSN order, so a later
    /// trim would change nothing). The caller holds its block lock, so no
    /// record of it can start meanwhile.
    fn holds_nothing(&self, v: u64) -> bool {
        let bs = self.bs();
        let st = self.lock();
        match st.cache.snapshot(v * bs, bs).as_slice() {
            [] => st.map[v as usize] == UNMAPPED,
            [(at, Data::Zero(len))] => *at == v * bs && *len == bs,
            _ => false,
        }
    }

    /// Assigns the next LSN and free physical block to a record of block
    /// `v` (`None` = trim), caches it, and issues it.
    async fn assign_and_issue(self: &Arc<Self>, v: u64, data: Option<Bytes>) -> Result<(), VolumeError> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let assigned = {
                let mut st = self.lock();
                Self::fenced(&st)?;
                if st.quiescing {
                    None
                } else if let Some(phys) = alloc_next(&mut st) {
                    let lsn = st.next_lsn;
                    st.next_lsn += 1;
                    let kind = if data.is_some() { Kind::Data } else { Kind::Trim };
                    let cached = match &data {
                        Some(b) => Data::Bytes(b.clone()),
                        None => Data::Zero(self.bs()),
                    };
                    st.cache.insert(v * self.bs(), cached, lsn);
                    st.out_bytes += self.bs();
                    st.window.insert(
                        lsn,
                        Pending { vblock: v, phys, kind, durable: false, acked_at: self.env.now() },
                    );
                    let h = BlockHeader { kind, vblock: v, epoch: st.curr_epoch, lsn, ckpt_seq: st.ckpt_seq };
                    Some((lsn, phys, h, st.geom.clone()))
                } else {
                    // Every free block is waiting for a checkpoint to be
                    // released: take one, then try again.
                    drop(st);
                    self.spawn_checkpoint();
                    None
                }
            };
            let Some((lsn, phys, h, geom)) = assigned else {
                notified.await;
                continue;
            };
            let me = self.clone();
            tokio::spawn(async move {
                let payload = data.unwrap_or_default();
                let (tract, off) = geom.loc(phys as u64);
                let mut expanded = BytesMut::with_capacity(geom.stride as usize);
                if payload.is_empty() {
                    // A trim record has no data; its data part is left as is.
                    expanded.extend_from_slice(&encode_header(&h, &[]));
                } else {
                    expanded.extend_from_slice(&payload);
                    expanded.extend_from_slice(&encode_header(&h, &payload));
                }
                let at = if payload.is_empty() { off + geom.block_size as u32 } else { off };
                let expanded = expanded.freeze();
                let io = &me.io;
                let written =
                    retry::until_landed(&me.env, "log write", &*me, || io.write(tract, at, expanded.clone()))
                        .await;
                if let Err(e) = written {
                    // Never lands: the record stays unapplied.
                    tracing::debug!(lsn, "log record refused for good");
                    me.fail(VolumeError::Io(e));
                    return;
                }
                me.complete(lsn);
            });
            return Ok(());
        }
    }

    /// A record became durable: apply every durable record at the head of
    /// the log, in LSN order.
    fn complete(self: &Arc<Self>, lsn: u64) {
        let want_ckpt = {
            let mut st = self.lock();
            if let Some(p) = st.window.get_mut(&lsn) {
                p.durable = true;
            }
            if self.planted == PlantedBug::AdvanceMapOutOfOrder {
                // Planted: apply as soon as durable, ignoring LSN order.
                if let Some(p) = st.window.remove(&lsn) {
                    self.apply(&mut st, lsn, &p);
                }
                while st.applied_lsn < st.next_lsn && !st.window.contains_key(&st.applied_lsn) {
                    st.applied_lsn += 1;
                }
            }
            loop {
                let head = st.applied_lsn;
                match st.window.get(&head) {
                    Some(p) if p.durable => {
                        let Some(p) = st.window.remove(&head) else { break };
                        self.apply(&mut st, head, &p);
                        st.applied_lsn += 1;
                    }
                    _ => break,
                }
            }
            let slack = (st.geom.pblocks - st.geom.vblocks) as usize;
            (st.since_ckpt >= CKPT_EVERY || st.pending_free.len() > slack / 2) && !st.ckpt_running
        };
        if want_ckpt {
            self.spawn_checkpoint();
        }
        self.changed.notify_waiters();
    }

    fn apply(&self, st: &mut State, lsn: u64, p: &Pending) {
        let v = p.vblock as usize;
        let old = st.map[v];
        if old != UNMAPPED {
            st.pending_free.push(old);
        }
        match p.kind {
            Kind::Data => st.map[v] = p.phys,
            Kind::Trim => {
                st.map[v] = UNMAPPED;
                st.pending_free.push(p.phys);
            }
        }
        st.cache.remove_owned(p.vblock * self.bs(), self.bs(), lsn);
        st.out_bytes = st.out_bytes.saturating_sub(self.bs());
        st.since_ckpt += 1;
    }

    /// Closes the epoch; with `durable`, waits until everything written
    /// before is applied (durable, and every earlier record too).
    pub async fn flush(self: &Arc<Self>, durable: bool) -> Result<(), VolumeError> {
        let target = {
            let mut st = self.lock();
            st.curr_epoch += 1;
            st.next_lsn
        };
        if !durable || self.planted == PlantedBug::AckDurableFlushEarly {
            return Ok(());
        }
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let st = self.lock();
                if st.applied_lsn >= target {
                    return Ok(());
                }
                Self::fenced(&st)?;
            }
            notified.await;
        }
    }

    /// The current content of virtual block `v`.
    async fn read_block(&self, v: u64) -> Result<Bytes, VolumeError> {
        let b = self.read(v * self.bs(), self.bs()).await?;
        Ok(b)
    }

    /// Reads `[offset, offset + len)`: unapplied writes from the cache, the
    /// rest through the block map.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        let bs = self.bs();
        loop {
            let (snap, maps, gen, geom) = {
                let st = self.lock();
                let first = offset / bs;
                let last = (offset + len - 1) / bs;
                let maps: Vec<u32> = (first..=last).map(|v| st.map[v as usize]).collect();
                (st.cache.snapshot(offset, len), maps, st.free_gen, st.geom.clone())
            };
            let mut buf = BytesMut::zeroed(len as usize);
            let first = offset / bs;
            let reads = maps.iter().enumerate().filter_map(|(i, &p)| {
                if p == UNMAPPED {
                    return None;
                }
                let v = first + i as u64;
                let (a, b) = (offset.max(v * bs), (offset + len).min((v + 1) * bs));
                let (tract, off) = geom.loc(p as u64);
                let fut = self.io.read(tract, off + (a - v * bs) as u32, (b - a) as u32);
                Some(async move { (a, fut.await) })
            });
            for (a, r) in futures::future::join_all(reads).await {
                let got = r?;
                let at = (a - offset) as usize;
                buf[at..at + got.len()].copy_from_slice(&got);
            }
            WriteCache::overlay(&snap, offset, &mut buf);
            // A checkpoint released blocks meanwhile: one we read may have
            // been reused. Read again.
            if self.lock().free_gen == gen {
                return Ok(buf.freeze());
            }
        }
    }

    fn spawn_checkpoint(self: &Arc<Self>) {
        {
            let mut st = self.lock();
            if st.ckpt_running {
                return;
            }
            st.ckpt_running = true;
        }
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.checkpoint_inner().await {
                tracing::warn!(error = %e, "checkpoint failed; will retry");
            }
            me.lock().ckpt_running = false;
            me.changed.notify_waiters();
        });
    }

    /// Takes a checkpoint now and waits for it.
    pub async fn checkpoint(self: &Arc<Self>) -> Result<(), VolumeError> {
        self.lock().ckpt_running = true;
        let r = self.checkpoint_inner().await;
        self.lock().ckpt_running = false;
        self.changed.notify_waiters();
        r
    }

    /// Quiesce: new writes wait; the log drains to a point where every
    /// assigned record is applied. The caller holds `ckpt_lock` and clears
    /// `quiescing` when done.
    async fn drain(&self) -> Result<(), VolumeError> {
        self.lock().quiescing = true;
        if self.planted != PlantedBug::AdvanceMapOutOfOrder {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                {
                    let st = self.lock();
                    if st.window.is_empty() {
                        break;
                    }
                    if let Err(e) = Self::fenced(&st) {
                        drop(st);
                        self.lock().quiescing = false;
                        return Err(e);
                    }
                }
                notified.await;
            }
        }
        Ok(())
    }

    async fn checkpoint_inner(self: &Arc<Self>) -> Result<(), VolumeError> {
        let _one = self.ckpt_lock.lock().await;
        // A fenced incarnation must not write under a geometry the
        // superblock may no longer name.
        Self::fenced(&self.lock())?;
        self.drain().await?;
        let (c, geom) = {
            let st = self.lock();
            let c = Checkpoint {
                seq: st.ckpt_seq + 1,
                next_lsn: st.next_lsn,
                epoch: st.curr_epoch,
                perm: st.perm,
                map: st.map.clone(),
            };
            (c, st.geom.clone())
        };
        let (io, geom, c) = (&self.io, &geom, &c);
        if let Err(e) =
            retry::until_landed(&self.env, "checkpoint write", &**self, || write_checkpoint(io, geom, c))
                .await
        {
            self.lock().quiescing = false;
            self.fail(e);
            return Self::fenced(&self.lock());
        }
        {
            let mut st = self.lock();
            st.ckpt_seq = c.seq;
            // The checkpoint no longer references these: reusable now.
            let freed = std::mem::take(&mut st.pending_free);
            for p in freed {
                if let Some(a) = st.alloc.get_mut(p as usize) {
                    *a = false;
                }
            }
            st.free_gen += 1;
            st.since_ckpt = 0;
            st.quiescing = false;
        }
        self.changed.notify_waiters();
        Ok(())
    }

    /// Grows the log to `new` (from [`LogGeom::grow`]); `commit` writes
    /// the superblock that names it. Steps, each durable before the next
    /// (design 0003, "Resizing a log volume"):
    ///
    /// 1. drain the log; new writes wait until the end;
    /// 2. extend the blob to the new geometry's tracts;
    /// 3. write checkpoint seq+1 *in the new geometry*: the current block
    ///    map (unmapped for the new blocks) and a fresh permutation over
    ///    the new physical block count. The old geometry never reads it: it
    ///    is in the new slots (or, in a shared slot, the one the old
    ///    geometry's newest checkpoint is not in) and decodes only for the
    ///    new block counts;
    /// 4. `commit`: the superblock, the one switch between geometries;
    /// 5. switch in memory and release blocks superseded since the last
    ///    checkpoint (the new checkpoint does not reference them).
    ///
    /// Nothing is written to the log between 1 and 5, so the old
    /// geometry's state stays exactly as it was until the superblock
    /// names the new one. A failure before 4 leaves the old geometry in
    /// use; a failed 4 fences this incarnation (see `State::fenced`).
    pub async fn grow<F>(self: &Arc<Self>, new: LogGeom, commit: F) -> Result<(), VolumeError>
    where
        F: Future<Output = Result<(), VolumeError>>,
    {
        let _one = self.ckpt_lock.lock().await;
        Self::fenced(&self.lock())?;
        self.drain().await?;
        let c = {
            let st = self.lock();
            let mut map = st.map.clone();
            map.resize(new.vblocks as usize, UNMAPPED);
            Checkpoint {
                seq: st.ckpt_seq + 1,
                next_lsn: st.next_lsn,
                epoch: st.curr_epoch,
                perm: Permutation::new(new.pblocks, self.env.random_u64()),
                map,
            }
        };
        let prepared = async {
            self.io.extend_to(new.total_tracts()).await?;
            write_checkpoint(&self.io, &new, &c).await
        }
        .await;
        let committed = match prepared {
            Ok(()) => commit.await,
            Err(e) => {
                self.lock().quiescing = false;
                self.changed.notify_waiters();
                return Err(e);
            }
        };
        {
            let mut st = self.lock();
            st.quiescing = false;
            if let Err(e) = &committed {
                st.fenced = Some(format!("a resize failed writing the superblock ({e})"));
            } else {
                let mut alloc = vec![false; new.pblocks as usize];
                for &p in &c.map {
                    if let Some(a) = alloc.get_mut(p as usize) {
                        *a = true;
                    }
                }
                st.alloc = alloc;
                st.pending_free.clear();
                st.map = c.map;
                st.perm = c.perm;
                st.ckpt_seq = c.seq;
                st.geom = Arc::new(new);
                st.free_gen += 1;
                st.since_ckpt = 0;
            }
        }
        self.changed.notify_waiters();
        committed
    }
}

/// The next free physical block in permutation order, marked allocated.
fn alloc_next(st: &mut State) -> Option<u32> {
    for _ in 0..st.perm.n {
        let p = st.perm.next_position();
        if !st.alloc[p as usize] {
            st.alloc[p as usize] = true;
            return Some(p as u32);
        }
    }
    None
}

async fn write_checkpoint(io: &Arc<dyn BlobIo>, geom: &LogGeom, c: &Checkpoint) -> Result<(), VolumeError> {
    let mut bytes = c.encode();
    // Whole chunks only: a tractserver merges a partial chunk with the old
    // one, which fails if a crash left that chunk corrupt, and the slot
    // could then never be rewritten. The slot is whole tracts, so it fits.
    let chunk = blizzard_core::limits::CHUNK_SIZE as usize;
    let room = (geom.ckpt_slot_tracts * geom.tract_size) as usize;
    bytes.resize(bytes.len().next_multiple_of(chunk).min(room.max(bytes.len())), 0);
    let bytes = Bytes::from(bytes);
    let first = geom.ckpt_tracts[(c.seq % 2) as usize];
    let ts = geom.tract_size as usize;
    let writes = bytes.chunks(ts).enumerate().map(|(i, _)| {
        let part = bytes.slice(i * ts..((i + 1) * ts).min(bytes.len()));
        io.write(first + i as u64, 0, part)
    });
    for r in futures::future::join_all(writes).await {
        r?;
    }
    Ok(())
}

async fn read_checkpoint(
    io: &Arc<dyn BlobIo>,
    geom: &LogGeom,
    slot: usize,
) -> Result<Option<Checkpoint>, VolumeError> {
    let len = Checkpoint::encoded_len(geom.vblocks) as usize;
    let ts = geom.tract_size as usize;
    let first = geom.ckpt_tracts[slot];
    let reads = (0..len.div_ceil(ts)).map(|i| io.read(first + i as u64, 0, (len - i * ts).min(ts) as u32));
    let mut buf = Vec::with_capacity(len);
    for r in futures::future::join_all(reads).await {
        match r {
            Ok(b) => buf.extend_from_slice(&b),
            // A checkpoint write torn by power loss reads as damaged, just
            // as one torn at chunk granularity fails its CRC: the other
            // slot holds the previous checkpoint, which is still complete
            // (blocks it references are released only after the newer
            // checkpoint is durable).
            Err(e) if e.is_corrupt() => {
                tracing::warn!(slot, error = %e, "checkpoint slot unreadable; using the other");
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Checkpoint::decode(&buf, geom.vblocks))
}

/// The range from every replica, or `None` if any replica holds it
/// damaged. Failures that are not damage (a server unreachable) are
/// errors: recovery must not mistake an outage for the end of the log.
async fn read_intact(
    io: &Arc<dyn BlobIo>,
    tract: u64,
    offset: u32,
    len: u32,
) -> Result<Option<Bytes>, VolumeError> {
    match io.read_replicas(tract, offset, len).await {
        // Replicas of a write in flight at the crash may differ: only a
        // block the same on every replica was written whole.
        Ok(copies) if copies.windows(2).all(|w| w[0] == w[1]) => Ok(copies.into_iter().next()),
        Ok(_) => Ok(None),
        Err(e) if e.is_corrupt() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What roll-forward accepts at the next position.
struct Expect {
    lsn: u64,
    ckpt_seq: u64,
    vblocks: u64,
    planted: PlantedBug,
}

/// The record at physical block `p` if it is the next one: intact on
/// every replica, with the expected LSN and checkpoint seq. `None` for
/// anything else, damaged included.
///
/// The header chunk is read first. It alone decides a trim record: a trim
/// is written as its header chunk only and its CRC covers the header only,
/// so its data part holds whatever the block held before, possibly bytes a
/// crash tore, which must not make an intact, acknowledged trim (and every
/// record after it) unrecoverable. A data record's data part is read only
/// once its header says it is the next record.
async fn next_record(
    io: &Arc<dyn BlobIo>,
    geom: &LogGeom,
    p: u64,
    want: &Expect,
) -> Result<Option<BlockHeader>, VolumeError> {
    let (tract, off) = geom.loc(p);
    let bs = geom.block_size as u32;
    let Some(hdr) = read_intact(io, tract, off + bs, HEADER_LEN).await? else { return Ok(None) };
    let Some(raw) = decode_header(&hdr) else { return Ok(None) };
    let h = raw.header;
    let is_next =
        want.planted == PlantedBug::ReuseWithoutSeq || (h.lsn == want.lsn && h.ckpt_seq == want.ckpt_seq);
    if !is_next || h.vblock >= want.vblocks {
        return Ok(None);
    }
    let data = match h.kind {
        Kind::Trim => Bytes::new(),
        Kind::Data => match read_intact(io, tract, off, bs).await? {
            Some(d) => d,
            None => return Ok(None),
        },
    };
    if want.planted != PlantedBug::SkipReadCrc && !raw.crc_holds(&data) {
        return Ok(None);
    }
    Ok(Some(h))
}

/// Roll-forward (recovery): from the checkpoint's position, visit free
/// physical blocks in permutation order and apply each that is the next
/// record, stopping at the first that is not. Returns records applied.
///
/// A block that cannot be read intact (replicas differ, its CRC fails, or
/// the store reports it `Corrupt`: a chunk torn by power loss) is treated
/// exactly like any other block that is not the next record: the end of
/// the log. That is always prefix-consistent, and it loses nothing a flush
/// promised: a record is applied, and a durable flush returns, only once
/// it and every earlier record were durable on every replica, so a block
/// the crash tore (in flight, never applied) comes after the last record
/// any flush covered. Recovery cannot tell such a block from an applied
/// one damaged later on every replica; ending the log there keeps the
/// volume openable and consistent rather than unrecoverable.
async fn roll_forward(io: &Arc<dyn BlobIo>, st: &mut State, planted: PlantedBug) -> Result<u64, VolumeError> {
    let geom = st.geom.clone();
    let mut applied = 0;
    let mut visited = 0;
    let mut skipped_hole = false;
    while visited < geom.pblocks {
        let saved = st.perm;
        let p = st.perm.next_position();
        visited += 1;
        if st.alloc[p as usize] {
            continue;
        }
        let expected = st.next_lsn;
        let want = Expect { lsn: expected, ckpt_seq: st.ckpt_seq, vblocks: st.map.len() as u64, planted };
        match next_record(io, &geom, p, &want).await? {
            Some(h) => {
                let v = h.vblock as usize;
                let old = st.map[v];
                if old != UNMAPPED {
                    st.pending_free.push(old);
                }
                st.alloc[p as usize] = true;
                match h.kind {
                    Kind::Data => st.map[v] = p as u32,
                    Kind::Trim => {
                        st.map[v] = UNMAPPED;
                        st.pending_free.push(p as u32);
                    }
                }
                st.curr_epoch = st.curr_epoch.max(h.epoch);
                st.next_lsn = expected.max(h.lsn) + 1;
                st.applied_lsn = st.next_lsn;
                applied += 1;
            }
            None if planted == PlantedBug::RollForwardPastHole && !skipped_hole => {
                // Planted: step over one hole and keep going.
                skipped_hole = true;
                st.next_lsn += 1;
                st.applied_lsn = st.next_lsn;
            }
            None => {
                // The writer's next record goes here.
                st.perm = saved;
                break;
            }
        }
    }
    Ok(applied)
}

mod as_engine;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every physical block has its own place, inside the blob, clear of
    /// both checkpoint slots, and unmoved by growth.
    fn check_layout(g: &LogGeom, before: Option<&LogGeom>) {
        let mut seen = std::collections::HashSet::new();
        let slot = |t: u64| g.ckpt_tracts.iter().any(|&s| (s..s + g.ckpt_slot_tracts).contains(&t));
        for p in 0..g.pblocks {
            let (t, off) = g.loc(p);
            assert!(seen.insert((t, off)), "block {p} shares a place");
            assert!(t >= 1 && t < g.total_tracts(), "block {p} at tract {t} outside 1..{}", g.total_tracts());
            assert!(!slot(t), "block {p} at tract {t} inside a checkpoint slot");
            assert!(off as u64 + g.stride <= g.tract_size);
            if let Some(b) = before.filter(|b| p < b.pblocks) {
                assert_eq!(b.loc(p), (t, off), "block {p} moved");
            }
        }
        assert!(g.ckpt_slot_tracts * g.tract_size >= Checkpoint::encoded_len(g.vblocks));
        assert_eq!(g.extents.iter().map(|x| x.blocks).sum::<u64>(), g.pblocks);
    }

    /// Growing keeps old blocks in place; it lengthens the last extent
    /// while the checkpoint fits its slots, and otherwise moves the slots
    /// past the end of the blob and adds an extent after them.
    #[test]
    fn growth_keeps_blocks_and_moves_slots_only_when_needed() -> Result<(), VolumeError> {
        let g0 = LogGeom::plan(1 << 20, 4096, 16 << 10)?;
        check_layout(&g0, None);
        let g1 = g0.grow(3 << 20)?;
        check_layout(&g1, Some(&g0));
        assert_eq!((g1.ckpt_tracts, g1.extents.len()), (g0.ckpt_tracts, 1), "fits: grows in place");
        let g2 = g1.grow(32 << 20)?;
        check_layout(&g2, Some(&g1));
        assert_eq!(g2.extents.len(), 2);
        assert_eq!(g2.ckpt_tracts[0], g1.total_tracts(), "new slots start where the blob ended");
        let g3 = g2.grow(40 << 20)?;
        check_layout(&g3, Some(&g2));
        assert_eq!((g3.ckpt_tracts, g3.extents.len()), (g2.ckpt_tracts, 2), "headroom: no move");
        let g4 = g3.grow(200 << 20)?;
        check_layout(&g4, Some(&g3));
        assert_eq!(g4.extents.len(), 3);
        let back = LogGeom::from_superblock(&g4.superblock_part(), 200 << 20, 4096, 16 << 10);
        assert_eq!(back, g4);
        assert!(g4.grow(200 << 20).is_err(), "no growth without new blocks");
        Ok(())
    }
}
