//! A deterministic in-memory blob for the crash checker, with the fault
//! model the checker needs:
//!
//! | event                         | effect                                              |
//! |-------------------------------|-----------------------------------------------------|
//! | write/trim issued             | in flight for a seeded random (virtual) latency     |
//! | write/trim completes          | applied to every replica at once, then acknowledged |
//! | cached write completes        | kept apart (a tractserver's page cache): reads see it over the stored bytes; a sync naming it applies it to every replica |
//! | crash                         | each in-flight op and each cached write not yet synced, on each replica independently, lands whole, not at all, or torn: some of its 4 KiB chunks land (a tractserver that died mid-write); unissued ops never existed |
//! | crash, with corrupt tears     | as above, but a torn op's chunk may also be left **corrupt**: torn inside the chunk by power loss, which the store's chunk CRC reports |
//! | read                          | one replica, chosen by the seed (or the one [`MemBlob::pin_reads`] names); a replica whose range has a corrupt chunk is skipped; none left is `Corrupt` |
//! | read of all replicas          | every replica (recovery compares them); any corrupt chunk fails it `Corrupt` |
//! | write covering a corrupt chunk| whole chunk: it is good again; part of it: `Corrupt` on that replica (the store cannot merge with a chunk it cannot read) |
//! | reconcile a tract             | digests (a CRC per chunk, or corrupt, per replica) planned by `blizzard_core::reconcile::plan`; each repair is an op to one replica, in flight like any op, so a crash can cut the reconciliation short |
//!
//! Tearing lands whole 4 KiB chunks or, with corrupt tears, leaves them
//! corrupt: below 4 KiB the blob store's own chunk CRCs turn a torn chunk
//! into a read error (tested at the blob layer), which is what a corrupt
//! chunk models. Corrupt tears are off by default: only the log commit
//! mode promises to recover from them (design 0003); a torn unacknowledged
//! write in the other modes leaves its range unreadable until rewritten.
//!
//! For tests that crash at a chosen point, [`MemBlob::hold_after`] lets a
//! number of ops complete and keeps every later one in flight forever, and
//! [`MemBlob::crash_each`] decides each held op's fate per replica.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_core::reconcile::{chunk_digest, plan, ChunkState, Reconciled, RepairAction};
use blizzard_env::Env;
use blizzard_volume::io::{BlobIo, CacheReceipt, IoError};

/// The server name in this store's receipts (the token is the op id).
const RECEIPT_TAG: &str = "mem";

#[derive(Clone, Debug)]
enum Kind {
    Write(Bytes),
    Trim(u32),
}

#[derive(Clone, Debug)]
struct Pending {
    tract: u64,
    offset: u32,
    kind: Kind,
    /// The one replica it changes (a reconciliation's repair), or all.
    only: Option<usize>,
}

impl Pending {
    fn reaches(&self, replica: usize) -> bool {
        self.only.is_none_or(|o| o == replica)
    }
}

const CHUNK: u32 = 4096;

/// Zeros to lend a read of a tract never written (no allocation).
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

/// A zero-filled range of `len` bytes.
fn zeros(len: usize) -> Bytes {
    match ZEROS.get(..len) {
        Some(z) => Bytes::from_static(z),
        None => Bytes::from(vec![0u8; len]),
    }
}

#[derive(Clone)]
struct State {
    /// Per replica, each written tract's bytes up to the end of its last
    /// write (zeros beyond). Shared, copied on write: a read with no
    /// cached write over it is a slice (recovery reads the whole volume
    /// once per replica), and a fork clones pointers. (Zero-filling whole
    /// tracts at their first write was a fifth of a log-mode trial.)
    replicas: Vec<BTreeMap<u64, Bytes>>,
    /// Per replica, the (tract, chunk) pairs a crash left corrupt.
    corrupt: Vec<BTreeSet<(u64, u32)>>,
    /// Per replica, the (tract, chunk) pairs that hold data, as a
    /// tractserver's chunk table says (`BlobIo::mapped`, digests' holes):
    /// a write maps every chunk it touches, a trim unmaps those it covers
    /// whole.
    mapped: Vec<BTreeSet<(u64, u32)>>,
    corrupt_tears: bool,
    /// Ops still allowed to complete; later ones stay in flight.
    hold_after: Option<u64>,
    size_tracts: u64,
    inflight: BTreeMap<u64, Pending>,
    /// Cached writes that completed and await a sync: readers see them, a
    /// crash treats them like ops in flight.
    volatile: BTreeMap<u64, Pending>,
    next_op: u64,
    rng: SmallRng,
    latency_us: (u64, u64),
    /// Reads go to this replica first (the checker reads the recovered
    /// volume once per replica to find blocks the replicas disagree on).
    pinned: Option<usize>,
}

/// What a crash does to one in-flight op on one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    Nothing,
    Whole,
    /// Every chunk it covers is left corrupt (torn inside by power loss).
    Corrupt,
}

#[derive(Clone)]
pub struct MemBlob {
    env: Env,
    tract_size: u32,
    replication: u8,
    state: Arc<Mutex<State>>,
}

/// What a crash did to the ops in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CrashOutcome {
    pub in_flight: usize,
    /// (op, replica) pairs that landed.
    pub landed: usize,
}

impl MemBlob {
    pub fn new(env: Env, seed: u64, tract_size: u32, replication: u8, latency_us: (u64, u64)) -> MemBlob {
        MemBlob {
            env,
            tract_size,
            replication,
            state: Arc::new(Mutex::new(State {
                replicas: vec![BTreeMap::new(); replication.max(1) as usize],
                corrupt: vec![BTreeSet::new(); replication.max(1) as usize],
                mapped: vec![BTreeSet::new(); replication.max(1) as usize],
                corrupt_tears: false,
                hold_after: None,
                size_tracts: 0,
                inflight: BTreeMap::new(),
                volatile: BTreeMap::new(),
                next_op: 0,
                rng: SmallRng::seed_from_u64(seed),
                latency_us,
                pinned: None,
            })),
        }
    }

    /// The same blob seen from a new process life (after a crash).
    pub fn reopen(&self, env: Env) -> MemBlob {
        MemBlob { env, ..self.clone() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Reads go to `replica` first (falling back, like the client, past a
    /// replica whose range is corrupt); `None` lets the seed choose.
    pub fn pin_reads(&self, replica: Option<usize>) {
        self.lock().pinned = replica;
    }

    /// Tears that leave chunks corrupt, on or off (see the fault model).
    pub fn set_corrupt_tears(&self, on: bool) {
        self.lock().corrupt_tears = on;
    }

    /// The next `n` ops complete as usual; every later one is issued but
    /// stays in flight until a crash decides it. `None` lifts the hold.
    pub fn hold_after(&self, n: Option<u64>) {
        self.lock().hold_after = n;
    }

    fn len_of(kind: &Kind) -> u32 {
        match kind {
            Kind::Write(b) => b.len() as u32,
            Kind::Trim(n) => *n,
        }
    }

    /// The chunks `[offset, +len)` touches, each with whether it is covered whole.
    fn chunks(offset: u32, len: u32) -> impl Iterator<Item = (u32, bool)> {
        let end = offset + len;
        let first = offset / CHUNK;
        let last = if len == 0 { first } else { (end - 1) / CHUNK + 1 };
        (first..last).map(move |c| (c, offset <= c * CHUNK && (c + 1) * CHUNK <= end))
    }

    fn damaged(corrupt: &BTreeSet<(u64, u32)>, tract: u64, offset: u32, len: u32) -> bool {
        Self::chunks(offset, len).any(|(c, _)| corrupt.contains(&(tract, c)))
    }

    /// Applies `p` to replica `r`. A chunk covered whole is good again; a
    /// corrupt chunk covered in part cannot be merged: the op fails there.
    fn apply(st: &mut State, r: usize, tract_size: u32, p: &Pending) -> Result<(), IoError> {
        let len = Self::len_of(&p.kind);
        let corrupt = &mut st.corrupt[r];
        if Self::chunks(p.offset, len).any(|(c, whole)| !whole && corrupt.contains(&(p.tract, c))) {
            return Err(IoError::Corrupt(format!(
                "tract {} has a corrupt chunk under a partial write",
                p.tract
            )));
        }
        for (c, _) in Self::chunks(p.offset, len) {
            corrupt.remove(&(p.tract, c));
        }
        debug_assert!(p.offset as u64 + len as u64 <= tract_size as u64);
        let range = p.offset as usize..p.offset as usize + len as usize;
        Self::modify(st, r, p.tract, range, |t| match &p.kind {
            Kind::Write(b) => t.copy_from_slice(b),
            Kind::Trim(_) => t.fill(0),
        });
        for (c, whole) in Self::chunks(p.offset, len) {
            match &p.kind {
                Kind::Write(_) => {
                    st.mapped[r].insert((p.tract, c));
                }
                Kind::Trim(_) if whole => {
                    st.mapped[r].remove(&(p.tract, c));
                }
                Kind::Trim(_) => {}
            }
        }
        Ok(())
    }

    /// Changes `range` of the stored bytes of `tract` on replica `r`,
    /// copying them first only if a reader still holds them.
    fn modify(st: &mut State, r: usize, tract: u64, range: Range<usize>, change: impl FnOnce(&mut [u8])) {
        let stored = st.replicas[r].remove(&tract);
        let mut t = match stored.map(Bytes::try_into_mut) {
            Some(Ok(unique)) => unique,
            Some(Err(shared)) => BytesMut::from(&shared[..]),
            None => BytesMut::new(),
        };
        if t.len() < range.end {
            t.resize(range.end, 0);
        }
        change(&mut t[range]);
        st.replicas[r].insert(tract, t.freeze());
    }

    fn mark_corrupt(st: &mut State, r: usize, p: &Pending) {
        for (c, _) in Self::chunks(p.offset, Self::len_of(&p.kind)) {
            st.corrupt[r].insert((p.tract, c));
        }
    }

    /// Test hook: marks the chunks under `[offset, +len)` of `tract`
    /// corrupt on `replica`, as damage found later would.
    pub fn corrupt(&self, replica: usize, tract: u64, offset: u32, len: u32) {
        let mut st = self.lock();
        let p = Pending { tract, offset, kind: Kind::Trim(len), only: None };
        Self::mark_corrupt(&mut st, replica, &p);
    }

    /// Test hook: the stored bytes of one replica, corrupt or not.
    pub fn peek(&self, replica: usize, tract: u64, offset: u32, len: u32) -> Bytes {
        Self::read_replica(&self.lock(), replica, tract, offset, len)
    }

    /// Test hook: overwrites stored bytes of one replica in place, leaving
    /// corrupt marks as they are (garbage that passes the store's CRC, as
    /// an older write's bytes would).
    pub fn poke(&self, replica: usize, tract: u64, offset: u32, data: &[u8]) {
        let mut st = self.lock();
        let at = offset as usize;
        Self::modify(&mut st, replica, tract, at..at + data.len(), |t| t.copy_from_slice(data));
    }

    /// An independent copy of the blob, in-flight ops included (for
    /// trying every crash outcome of one crash point).
    pub fn fork(&self) -> MemBlob {
        let copy = self.lock().clone();
        MemBlob {
            env: self.env.clone(),
            tract_size: self.tract_size,
            replication: self.replication,
            state: Arc::new(Mutex::new(copy)),
        }
    }

    /// Ops whose fate a crash decides: issued and not completed, or
    /// cached and not synced.
    pub fn in_flight(&self) -> usize {
        let st = self.lock();
        st.inflight.len() + st.volatile.len()
    }

    /// In flight and unsynced cached ops, in issue order, taken out.
    fn take_undecided(st: &mut State) -> Vec<Pending> {
        let mut all = std::mem::take(&mut st.inflight);
        all.append(&mut std::mem::take(&mut st.volatile));
        all.into_values().collect()
    }

    /// The crash: each op in flight lands, or not, on each replica, as
    /// `lands(op index, replica)` says.
    pub fn crash_with(&self, mut lands: impl FnMut(usize, usize) -> bool) -> CrashOutcome {
        self.crash_each(|i, r| if lands(i, r) { Landing::Whole } else { Landing::Nothing })
    }

    /// The crash: each op in flight (in issue order) meets the fate
    /// `landing(op index, replica)` says on each replica.
    pub fn crash_each(&self, mut landing: impl FnMut(usize, usize) -> Landing) -> CrashOutcome {
        let mut st = self.lock();
        let ops: Vec<Pending> = Self::take_undecided(&mut st);
        let mut out = CrashOutcome { in_flight: ops.len(), landed: 0 };
        let ts = self.tract_size;
        for (i, p) in ops.iter().enumerate() {
            for r in 0..st.replicas.len() {
                if !p.reaches(r) {
                    continue;
                }
                match landing(i, r) {
                    Landing::Nothing => {}
                    Landing::Whole => {
                        if Self::apply(&mut st, r, ts, p).is_ok() {
                            out.landed += 1;
                        }
                    }
                    Landing::Corrupt => Self::mark_corrupt(&mut st, r, p),
                }
            }
        }
        out
    }

    /// The crash with the seed deciding, per (op, replica): whole, nothing,
    /// or torn (each 4 KiB chunk of the op by its own coin).
    pub fn crash(&self, rng: &mut SmallRng) -> CrashOutcome {
        let mut st = self.lock();
        let ops: Vec<Pending> = Self::take_undecided(&mut st);
        let mut out = CrashOutcome { in_flight: ops.len(), landed: 0 };
        let ts = self.tract_size;
        for p in &ops {
            for r in 0..st.replicas.len() {
                if !p.reaches(r) {
                    continue;
                }
                match rng.random_range(0..3) {
                    0 => {}
                    1 => {
                        if Self::apply(&mut st, r, ts, p).is_ok() {
                            out.landed += 1;
                        }
                    }
                    _ => {
                        // Torn: chunk by chunk, aligned to the tract.
                        let len = Self::len_of(&p.kind);
                        let mut at = p.offset;
                        while at < p.offset + len {
                            let next = ((at / CHUNK + 1) * CHUNK).min(p.offset + len);
                            let (s0, s1) = ((at - p.offset) as usize, (next - p.offset) as usize);
                            let piece = Pending {
                                only: p.only,
                                tract: p.tract,
                                offset: at,
                                kind: match &p.kind {
                                    Kind::Write(b) => Kind::Write(b.slice(s0..s1)),
                                    Kind::Trim(_) => Kind::Trim(next - at),
                                },
                            };
                            // Without corrupt tears the draw is the same
                            // coin as always, so seeds of those runs replay.
                            let fate = if st.corrupt_tears {
                                rng.random_range(0..3)
                            } else {
                                u32::from(rng.random_bool(0.5))
                            };
                            match fate {
                                0 => {}
                                1 => {
                                    let _ = Self::apply(&mut st, r, ts, &piece);
                                }
                                _ => Self::mark_corrupt(&mut st, r, &piece),
                            }
                            at = next;
                        }
                    }
                }
            }
        }
        out
    }

    fn op(&self, tract: u64, offset: u32, kind: Kind) -> BoxFuture<'static, Result<(), IoError>> {
        let op = self.op_as(tract, offset, kind, false, None);
        async move { op.await.map(|_| ()) }.boxed()
    }

    /// Whether replica `r` holds data in chunk `c` of `tract`: mapped there,
    /// or written by a cached write that reaches it and is not synced yet
    /// (its chunk table has it, as a tractserver's page cache would).
    fn holds(st: &State, r: usize, tract: u64, c: u32) -> bool {
        st.mapped[r].contains(&(tract, c))
            || st.volatile.values().any(|p| {
                p.tract == tract
                    && p.reaches(r)
                    && matches!(p.kind, Kind::Write(_))
                    && Self::chunks(p.offset, Self::len_of(&p.kind)).any(|(x, _)| x == c)
            })
    }

    /// What each replica holds in each chunk of `tract`, as a tractserver's
    /// digest reports it (reads see unsynced cached writes, as they do).
    fn digests(st: &State, tract: u64, tract_size: u32) -> Vec<Vec<ChunkState>> {
        (0..st.replicas.len())
            .map(|r| {
                if !st.replicas[r].contains_key(&tract) && !st.volatile.values().any(|p| p.tract == tract) {
                    return Vec::new();
                }
                let bytes = Self::read_replica(st, r, tract, 0, tract_size);
                bytes
                    .chunks(CHUNK as usize)
                    .enumerate()
                    .map(|(c, b)| {
                        if st.corrupt[r].contains(&(tract, c as u32)) {
                            ChunkState::Unreadable
                        } else if Self::holds(st, r, tract, c as u32) {
                            ChunkState::Data(chunk_digest(b))
                        } else {
                            ChunkState::Hole
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Issues an op; a `cached` one completes into `volatile` (not applied
    /// to the replicas until synced) and returns its id.
    fn op_as(
        &self,
        tract: u64,
        offset: u32,
        kind: Kind,
        cached: bool,
        only: Option<usize>,
    ) -> BoxFuture<'static, Result<u64, IoError>> {
        let len = match &kind {
            Kind::Write(b) => b.len() as u64,
            Kind::Trim(n) => *n as u64,
        };
        let me = self.clone();
        async move {
            if offset as u64 + len > me.tract_size as u64 {
                return Err(IoError::Other(format!("range [{offset}, +{len}) outside the tract")));
            }
            let (id, wait, held) = {
                let mut st = me.lock();
                if tract >= st.size_tracts {
                    return Err(IoError::Other(format!("tract {tract} past the end of the blob")));
                }
                let id = st.next_op;
                st.next_op += 1;
                st.inflight.insert(id, Pending { tract, offset, kind, only });
                let held = match &mut st.hold_after {
                    Some(0) => true,
                    Some(n) => {
                        *n -= 1;
                        false
                    }
                    None => false,
                };
                let (lo, hi) = st.latency_us;
                let us = if hi > lo { st.rng.random_range(lo..=hi) } else { lo };
                (id, Duration::from_micros(us), held)
            };
            if held {
                // In flight until the crash decides it.
                futures::future::pending::<()>().await;
            }
            me.env.sleep(wait).await;
            let mut st = me.lock();
            let mut result = Ok(id);
            if cached {
                if let Some(p) = st.inflight.remove(&id) {
                    st.volatile.insert(id, p);
                }
                return result;
            }
            if let Some(p) = st.inflight.remove(&id) {
                let ts = me.tract_size;
                for r in (0..st.replicas.len()).filter(|r| p.reaches(*r)) {
                    if let Err(e) = Self::apply(&mut st, r, ts, &p) {
                        result = Err(e);
                    }
                }
            }
            result
        }
        .boxed()
    }

    /// A replica's bytes as a reader sees them: unsynced cached writes
    /// (held by the tractserver's page cache) over the stored ones.
    fn read_replica(st: &State, r: usize, tract: u64, offset: u32, len: u32) -> Bytes {
        let range = offset as usize..offset as usize + len as usize;
        let stored = match st.replicas[r].get(&tract) {
            Some(t) if t.len() >= range.end => t.slice(range),
            Some(t) if t.len() > range.start => {
                let mut b = t[range.start..].to_vec();
                b.resize(len as usize, 0);
                Bytes::from(b)
            }
            _ => zeros(len as usize),
        };
        let (lo, hi) = (offset as u64, offset as u64 + len as u64);
        let overlaps = |p: &&Pending| {
            let (a, z) = (p.offset as u64, p.offset as u64 + Self::len_of(&p.kind) as u64);
            p.tract == tract && a.max(lo) < z.min(hi)
        };
        if !st.volatile.values().any(|p| overlaps(&p)) {
            return stored;
        }
        let mut b = stored.to_vec();
        for p in st.volatile.values().filter(overlaps) {
            let (a, z) = (p.offset as u64, p.offset as u64 + Self::len_of(&p.kind) as u64);
            let (s, e) = (a.max(lo), z.min(hi));
            let dst = &mut b[(s - lo) as usize..(e - lo) as usize];
            match &p.kind {
                Kind::Write(d) => dst.copy_from_slice(&d[(s - a) as usize..(e - a) as usize]),
                Kind::Trim(_) => dst.fill(0),
            }
        }
        Bytes::from(b)
    }
}

impl BlobIo for MemBlob {
    fn tract_size(&self) -> u32 {
        self.tract_size
    }

    fn replication(&self) -> u8 {
        self.replication
    }

    fn size_tracts(&self) -> u64 {
        self.lock().size_tracts
    }

    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        let me = self.clone();
        async move {
            let mut st = me.lock();
            st.size_tracts = st.size_tracts.max(tracts);
            Ok(st.size_tracts)
        }
        .boxed()
    }

    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        self.op(tract, offset, Kind::Write(data))
    }

    /// Lands in `volatile`: visible to reads, decided by a crash like an op
    /// in flight until a sync names it.
    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        let op = self.op_as(tract, offset, Kind::Write(data), true, None);
        async move { Ok(vec![(RECEIPT_TAG.to_string(), op.await?)]) }.boxed()
    }

    /// After a (virtual) latency, applies the named cached writes to every
    /// replica in issue order; a crash before then decides them instead.
    fn sync(&self, receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        let me = self.clone();
        async move {
            let wait = {
                let mut st = me.lock();
                let (lo, hi) = st.latency_us;
                Duration::from_micros(if hi > lo { st.rng.random_range(lo..=hi) } else { lo })
            };
            me.env.sleep(wait).await;
            let mut st = me.lock();
            let mut ids: Vec<u64> = receipt.iter().map(|(_, id)| *id).collect();
            ids.sort_unstable();
            let ts = me.tract_size;
            let mut result = Ok(());
            for id in ids {
                if let Some(p) = st.volatile.remove(&id) {
                    for r in (0..st.replicas.len()).filter(|r| p.reaches(*r)) {
                        if let Err(e) = Self::apply(&mut st, r, ts, &p) {
                            result = Err(e);
                        }
                    }
                }
            }
            result
        }
        .boxed()
    }

    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        self.op(tract, offset, Kind::Trim(len))
    }

    /// The real client's algorithm on the replicas in memory: digests,
    /// [`plan`], then each repair as an op to one replica (in flight for a
    /// latency like any op, so a crash can cut a reconciliation short).
    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        let me = self.clone();
        async move {
            let chunks = me.tract_size / CHUNK;
            let (p, sources) = {
                let st = me.lock();
                let d = Self::digests(&st, tract, me.tract_size);
                let p = plan(&d, chunks, 256);
                let sources: Vec<Bytes> = p
                    .repairs
                    .iter()
                    .map(|r| {
                        Self::read_replica(&st, r.source, tract, r.first_chunk * CHUNK, r.chunks * CHUNK)
                    })
                    .collect();
                (p, sources)
            };
            let mut done = Reconciled {
                tracts: 1,
                chunks_compared: chunks as u64,
                chunk_repairs: p.chunk_repairs(),
                unreadable_chunks: p.unreadable.len() as u64,
                ..Reconciled::default()
            };
            let mut ops = Vec::new();
            for (r, data) in p.repairs.iter().zip(sources) {
                for &t in &r.targets {
                    let kind = match r.action {
                        RepairAction::Copy => {
                            done.bytes_copied += data.len() as u64;
                            Kind::Write(data.clone())
                        }
                        RepairAction::Trim => Kind::Trim(r.chunks * CHUNK),
                    };
                    ops.push(me.op_as(tract, r.first_chunk * CHUNK, kind, false, Some(t)));
                }
            }
            for r in futures::future::join_all(ops).await {
                r?;
            }
            Ok(done)
        }
        .boxed()
    }

    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        let me = self.clone();
        async move {
            if offset as u64 + len as u64 > me.tract_size as u64 {
                return Err(IoError::Other("read outside the tract".into()));
            }
            let mut st = me.lock();
            let n = st.replicas.len();
            let r = match st.pinned {
                Some(p) => p % n,
                None if n > 1 => st.rng.random_range(0..n),
                None => 0,
            };
            // Like the client: a replica that reports damage is skipped.
            (0..n)
                .map(|i| (r + i) % n)
                .find(|&r| !Self::damaged(&st.corrupt[r], tract, offset, len))
                .map(|r| Self::read_replica(&st, r, tract, offset, len))
                .ok_or_else(|| IoError::Corrupt(format!("tract {tract}: no replica holds the range intact")))
        }
        .boxed()
    }

    /// The union over the replicas, as the real client's.
    fn mapped(&self, tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        let me = self.clone();
        async move {
            let st = me.lock();
            let chunks = me.tract_size / CHUNK;
            let mut b = vec![0u8; (chunks as usize).div_ceil(8)];
            for c in 0..chunks {
                if (0..st.replicas.len()).any(|r| Self::holds(&st, r, tract, c)) {
                    b[c as usize / 8] |= 1 << (c % 8);
                }
            }
            Ok(b)
        }
        .boxed()
    }

    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        let me = self.clone();
        async move {
            if offset as u64 + len as u64 > me.tract_size as u64 {
                return Err(IoError::Other("read outside the tract".into()));
            }
            let st = me.lock();
            if st.corrupt.iter().any(|c| Self::damaged(c, tract, offset, len)) {
                return Err(IoError::Corrupt(format!("tract {tract}: a replica reports a corrupt chunk")));
            }
            Ok((0..st.replicas.len()).map(|r| Self::read_replica(&st, r, tract, offset, len)).collect())
        }
        .boxed()
    }
}
