//! The log engine: assignment, durability in LSN order, checkpoints,
//! recovery. See `log/mod.rs` for the design and its invariants.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use blizzard_env::{Env, Instant};

use super::perm::Permutation;
use super::record::{decode_block, encode_header, BlockHeader, Checkpoint, Kind, HEADER_LEN, UNMAPPED};
use crate::cache::{Data, WriteCache};
use crate::io::BlobIo;
use crate::superblock::{ExposureLimits, LogGeometry};
use crate::{PlantedBug, VolumeError};

/// Where the log lives in the blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub log_first_tract: u64,
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
        let vblocks = size.div_ceil(block_size);
        if vblocks >= UNMAPPED as u64 / 2 {
            return Err(VolumeError::Invalid(
                "too many blocks for a log volume; use a larger block size".into(),
            ));
        }
        // Slack lets writes find free blocks while superseded ones wait for
        // the next checkpoint.
        let pblocks = vblocks + (vblocks / 4).max(32);
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
            log_first_tract: 1 + 2 * slot,
        })
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
            log_first_tract: l.log_first_tract,
        }
    }

    pub fn superblock_part(&self) -> LogGeometry {
        LogGeometry {
            physical_blocks: self.pblocks,
            checkpoint_tracts: self.ckpt_tracts,
            checkpoint_slot_tracts: self.ckpt_slot_tracts,
            log_first_tract: self.log_first_tract,
        }
    }

    pub fn total_tracts(&self) -> u64 {
        self.log_first_tract + self.pblocks.div_ceil(self.per_tract)
    }

    fn loc(&self, p: u64) -> (u64, u32) {
        (self.log_first_tract + p / self.per_tract, ((p % self.per_tract) * self.stride) as u32)
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
}

pub struct LogEngine {
    env: Env,
    io: Arc<dyn BlobIo>,
    pub geom: LogGeom,
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
const RETRY_PAUSE: Duration = Duration::from_millis(200);

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
        let mut best: Option<Checkpoint> = None;
        for slot in 0..2 {
            if let Some(c) = read_checkpoint(&io, &geom, slot).await? {
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
        };
        let rolled = roll_forward(&io, &geom, &mut st, planted).await?;
        tracing::debug!(checkpoint = ckpt.seq, rolled, next_lsn = st.next_lsn, "log volume recovered");
        // A crash closes the epoch it happened in.
        st.curr_epoch += 1;
        let engine = Arc::new(LogEngine {
            env,
            io,
            geom,
            limits,
            planted,
            state: Mutex::new(st),
            changed: Notify::new(),
            block_locks: Mutex::new(HashMap::new()),
            ckpt_lock: tokio::sync::Mutex::new(()),
        });
        // Durable before any new write: new writes carry the new seq.
        engine.checkpoint().await?;
        Ok(engine)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn bs(&self) -> u64 {
        self.geom.block_size
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

    async fn admit(&self, blocks: u64) {
        let bytes = blocks * self.bs();
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let wait = {
                let st = self.lock();
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
                    return;
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
        self.admit(last - first + 1).await;
        for v in first..=last {
            let (bs_start, bs_end) = (v * bs, (v + 1) * bs);
            let (a, b) = (offset.max(bs_start), end.min(bs_end));
            let part = data.slice(a - offset, b - offset);
            let l = self.block_lock(v);
            let guard = l.lock().await;
            let record = if a == bs_start && b == bs_end {
                match part {
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

    /// Assigns the next LSN and free physical block to a record of block
    /// `v` (`None` = trim), caches it, and issues it.
    async fn assign_and_issue(self: &Arc<Self>, v: u64, data: Option<Bytes>) -> Result<(), VolumeError> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let assigned = {
                let mut st = self.lock();
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
                    Some((lsn, phys, h))
                } else {
                    // Every free block is waiting for a checkpoint to be
                    // released: take one, then try again.
                    drop(st);
                    self.spawn_checkpoint();
                    None
                }
            };
            let Some((lsn, phys, h)) = assigned else {
                notified.await;
                continue;
            };
            let me = self.clone();
            tokio::spawn(async move {
                let payload = data.unwrap_or_default();
                let (tract, off) = me.geom.loc(phys as u64);
                let mut expanded = BytesMut::with_capacity(me.geom.stride as usize);
                if payload.is_empty() {
                    // A trim record has no data; its data part is left as is.
                    expanded.extend_from_slice(&encode_header(&h, &[]));
                } else {
                    expanded.extend_from_slice(&payload);
                    expanded.extend_from_slice(&encode_header(&h, &payload));
                }
                let at = if payload.is_empty() { off + me.geom.block_size as u32 } else { off };
                let expanded = expanded.freeze();
                loop {
                    match me.io.write(tract, at, expanded.clone()).await {
                        Ok(()) => break,
                        Err(e) => {
                            tracing::warn!(lsn, error = %e, "log write failed; retrying");
                            me.env.sleep(RETRY_PAUSE).await;
                        }
                    }
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
            let slack = (self.geom.pblocks - self.geom.vblocks) as usize;
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
            if self.lock().applied_lsn >= target {
                return Ok(());
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
            let (snap, maps, gen) = {
                let st = self.lock();
                let first = offset / bs;
                let last = (offset + len - 1) / bs;
                let maps: Vec<u32> = (first..=last).map(|v| st.map[v as usize]).collect();
                (st.cache.snapshot(offset, len), maps, st.free_gen)
            };
            let mut buf = BytesMut::zeroed(len as usize);
            let first = offset / bs;
            let reads = maps.iter().enumerate().filter_map(|(i, &p)| {
                if p == UNMAPPED {
                    return None;
                }
                let v = first + i as u64;
                let (a, b) = (offset.max(v * bs), (offset + len).min((v + 1) * bs));
                let (tract, off) = self.geom.loc(p as u64);
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

    async fn checkpoint_inner(self: &Arc<Self>) -> Result<(), VolumeError> {
        let _one = self.ckpt_lock.lock().await;
        // Quiesce: new writes wait; the log drains to a point where every
        // assigned record is applied.
        self.lock().quiescing = true;
        if self.planted != PlantedBug::AdvanceMapOutOfOrder {
            loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.lock().window.is_empty() {
                    break;
                }
                notified.await;
            }
        }
        let c = {
            let st = self.lock();
            Checkpoint {
                seq: st.ckpt_seq + 1,
                next_lsn: st.next_lsn,
                epoch: st.curr_epoch,
                perm: st.perm,
                map: st.map.clone(),
            }
        };
        let written = loop {
            match write_checkpoint(&self.io, &self.geom, &c).await {
                Ok(()) => break Ok(()),
                Err(e) => {
                    tracing::warn!(error = %e, "checkpoint write failed; retrying");
                    self.env.sleep(RETRY_PAUSE).await;
                }
            }
        };
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
        written
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
    let bytes = Bytes::from(c.encode());
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
        buf.extend_from_slice(&r?);
    }
    Ok(Checkpoint::decode(&buf, geom.vblocks))
}

/// Roll-forward (recovery): from the checkpoint's position, visit free
/// physical blocks in permutation order and apply each that is the next
/// record, stopping at the first that is not. Returns records applied.
async fn roll_forward(
    io: &Arc<dyn BlobIo>,
    geom: &LogGeom,
    st: &mut State,
    planted: PlantedBug,
) -> Result<u64, VolumeError> {
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
        let (tract, off) = geom.loc(p);
        let copies = io.read_replicas(tract, off, geom.stride as u32).await?;
        let agree = copies.windows(2).all(|w| w[0] == w[1]);
        let header = copies
            .first()
            .filter(|_| agree)
            .and_then(|b| decode_block(b, geom.block_size as usize, planted != PlantedBug::SkipReadCrc));
        let expected = st.next_lsn;
        let seq_ok = |h: &BlockHeader| {
            planted == PlantedBug::ReuseWithoutSeq || (h.lsn == expected && h.ckpt_seq == st.ckpt_seq)
        };
        match header.filter(seq_ok) {
            Some(h) if (h.vblock as usize) < st.map.len() => {
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
            _ if planted == PlantedBug::RollForwardPastHole && !skipped_hole => {
                // Planted: step over one hole and keep going.
                skipped_hole = true;
                st.next_lsn += 1;
                st.applied_lsn = st.next_lsn;
            }
            _ => {
                // The writer's next record goes here.
                st.perm = saved;
                break;
            }
        }
    }
    Ok(applied)
}
