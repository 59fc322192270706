//! A deterministic in-memory blob for the crash checker, with the fault
//! model the checker needs:
//!
//! | event                         | effect                                              |
//! |-------------------------------|-----------------------------------------------------|
//! | write/trim issued             | in flight for a seeded random (virtual) latency     |
//! | write/trim completes          | applied to every replica at once, then acknowledged |
//! | crash                         | each in-flight op, on each replica independently, lands whole, not at all, or torn: some of its 4 KiB chunks land (a tractserver that died mid-write); unissued ops never existed |
//! | read                          | one replica, chosen by the seed                     |
//! | read of all replicas          | every replica (recovery compares them)              |
//!
//! Tearing is at 4 KiB chunk granularity: below that the blob store's own
//! chunk CRCs turn a torn chunk into a read error, tested at the blob layer.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_env::Env;
use blizzard_volume::io::{BlobIo, IoError};

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
}

struct State {
    replicas: Vec<BTreeMap<u64, Vec<u8>>>,
    size_tracts: u64,
    inflight: BTreeMap<u64, Pending>,
    next_op: u64,
    rng: SmallRng,
    latency_us: (u64, u64),
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
                size_tracts: 0,
                inflight: BTreeMap::new(),
                next_op: 0,
                rng: SmallRng::seed_from_u64(seed),
                latency_us,
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

    fn apply(replica: &mut BTreeMap<u64, Vec<u8>>, tract_size: u32, p: &Pending) {
        let t = replica.entry(p.tract).or_insert_with(|| vec![0u8; tract_size as usize]);
        let at = p.offset as usize;
        match &p.kind {
            Kind::Write(b) => t[at..at + b.len()].copy_from_slice(b),
            Kind::Trim(n) => t[at..at + *n as usize].fill(0),
        }
    }

    /// An independent copy of the blob, in-flight ops included (for
    /// trying every crash outcome of one crash point).
    pub fn fork(&self) -> MemBlob {
        let st = self.lock();
        let copy = State {
            replicas: st.replicas.clone(),
            size_tracts: st.size_tracts,
            inflight: st.inflight.clone(),
            next_op: st.next_op,
            rng: st.rng.clone(),
            latency_us: st.latency_us,
        };
        MemBlob {
            env: self.env.clone(),
            tract_size: self.tract_size,
            replication: self.replication,
            state: Arc::new(Mutex::new(copy)),
        }
    }

    /// Ops issued and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.lock().inflight.len()
    }

    /// The crash: each op in flight lands, or not, on each replica, as
    /// `lands(op index, replica)` says.
    pub fn crash_with(&self, mut lands: impl FnMut(usize, usize) -> bool) -> CrashOutcome {
        let mut st = self.lock();
        let ops: Vec<Pending> = std::mem::take(&mut st.inflight).into_values().collect();
        let mut out = CrashOutcome { in_flight: ops.len(), landed: 0 };
        let ts = self.tract_size;
        for (i, p) in ops.iter().enumerate() {
            for r in 0..st.replicas.len() {
                if lands(i, r) {
                    Self::apply(&mut st.replicas[r], ts, p);
                    out.landed += 1;
                }
            }
        }
        out
    }

    /// The crash with the seed deciding, per (op, replica): whole, nothing,
    /// or torn (each 4 KiB chunk of the op by its own coin).
    pub fn crash(&self, rng: &mut SmallRng) -> CrashOutcome {
        let mut st = self.lock();
        let ops: Vec<Pending> = std::mem::take(&mut st.inflight).into_values().collect();
        let mut out = CrashOutcome { in_flight: ops.len(), landed: 0 };
        let ts = self.tract_size;
        for p in &ops {
            for r in 0..st.replicas.len() {
                match rng.random_range(0..3) {
                    0 => {}
                    1 => {
                        Self::apply(&mut st.replicas[r], ts, p);
                        out.landed += 1;
                    }
                    _ => {
                        // Torn: chunk by chunk, aligned to the tract.
                        let len = match &p.kind {
                            Kind::Write(b) => b.len() as u32,
                            Kind::Trim(n) => *n,
                        };
                        let mut at = p.offset;
                        while at < p.offset + len {
                            let next = ((at / 4096 + 1) * 4096).min(p.offset + len);
                            if rng.random_bool(0.5) {
                                let (s0, s1) = ((at - p.offset) as usize, (next - p.offset) as usize);
                                let piece = Pending {
                                    tract: p.tract,
                                    offset: at,
                                    kind: match &p.kind {
                                        Kind::Write(b) => Kind::Write(b.slice(s0..s1)),
                                        Kind::Trim(_) => Kind::Trim(next - at),
                                    },
                                };
                                Self::apply(&mut st.replicas[r], ts, &piece);
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
        let len = match &kind {
            Kind::Write(b) => b.len() as u64,
            Kind::Trim(n) => *n as u64,
        };
        let me = self.clone();
        async move {
            if offset as u64 + len > me.tract_size as u64 {
                return Err(IoError::Other(format!("range [{offset}, +{len}) outside the tract")));
            }
            let (id, wait) = {
                let mut st = me.lock();
                if tract >= st.size_tracts {
                    return Err(IoError::Other(format!("tract {tract} past the end of the blob")));
                }
                let id = st.next_op;
                st.next_op += 1;
                st.inflight.insert(id, Pending { tract, offset, kind });
                let (lo, hi) = st.latency_us;
                let us = if hi > lo { st.rng.random_range(lo..=hi) } else { lo };
                (id, Duration::from_micros(us))
            };
            me.env.sleep(wait).await;
            let mut st = me.lock();
            if let Some(p) = st.inflight.remove(&id) {
                let ts = me.tract_size;
                for r in st.replicas.iter_mut() {
                    Self::apply(r, ts, &p);
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn read_replica(st: &State, r: usize, tract: u64, offset: u32, len: u32) -> Bytes {
        match st.replicas[r].get(&tract) {
            Some(t) => Bytes::copy_from_slice(&t[offset as usize..offset as usize + len as usize]),
            None => Bytes::from(vec![0u8; len as usize]),
        }
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

    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        self.op(tract, offset, Kind::Trim(len))
    }

    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        let me = self.clone();
        async move {
            if offset as u64 + len as u64 > me.tract_size as u64 {
                return Err(IoError::Other("read outside the tract".into()));
            }
            let mut st = me.lock();
            let n = st.replicas.len();
            let r = if n > 1 { st.rng.random_range(0..n) } else { 0 };
            Ok(Self::read_replica(&st, r, tract, offset, len))
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
            Ok((0..st.replicas.len()).map(|r| Self::read_replica(&st, r, tract, offset, len)).collect())
        }
        .boxed()
    }
}
