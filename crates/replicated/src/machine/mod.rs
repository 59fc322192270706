//! The runtime's state machine: what openraft hands committed entries to.
//!
//! It owns the service's state, the session table and the snapshots, and
//! applies each run of committed entries in three steps (the paper's
//! execution layer, §6):
//!
//! 1. **Admit**, in log order: each operation's session decides whether it
//!    is new, a retry of one applied before (answered from the table), or
//!    for an unknown session (`session`). Sessions open and close here.
//! 2. **Plan**: the new operations' footprints give the dependency graph
//!    (`schedule`): conflicting operations keep their log order.
//! 3. **Execute** the plan with up to `apply_threads` workers (`exec`),
//!    then record every reply in the session table and answer the
//!    entries' waiters.
//!
//! Invariants (checked where they are kept):
//! - A run is applied under the gate's write lock, and snapshots and reads
//!   take its read lock: both see the state between two runs, never half
//!   of one (`apply`, `Builder::build_snapshot`, `Machine::read`).
//! - `applied` names the last entry of the last whole run; a snapshot's
//!   log id is the `applied` it was taken at.
//! - After a run every admitted operation's reply is recorded
//!   (`Sessions::settled`, asserted).

pub mod exec;
pub mod schedule;
pub mod session;
pub mod snapshot;

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine, Snapshot};
use openraft::type_config::alias::SnapshotOf;
use openraft::EntryPayload;

use blizzard_env::Env;

use self::schedule::Plan;
use self::session::{Admit, Sessions};
use self::snapshot::{Header, SnapshotStore};
use crate::service::{Position, Service};
use crate::types::{session_id, BatchReply, LogId, OpKind, OpReply, Raft, SnapshotMeta, StoredMembership};

/// How committed operations are applied.
#[derive(Clone, Debug)]
pub struct MachineConfig {
    /// Workers applying commuting operations at once (1: serial, in log
    /// order).
    pub apply_threads: usize,
    /// For the simulator's checkers only: a planted bug.
    pub plant: Option<Planted>,
}

impl Default for MachineConfig {
    fn default() -> Self {
        MachineConfig { apply_threads: 1, plant: None }
    }
}

/// Bugs the simulator plants to show its checkers catch them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Planted {
    /// Apply every operation of a run at once, conflicts or not.
    ParallelConflicts,
    /// Apply retries again instead of answering them from the sessions.
    SkipSessionDedup,
    /// Apply an update again when its reply is forgotten (the client
    /// acknowledged it) instead of saying so: only a copy that arrives
    /// after the client moved on, as a duplicating network delivers it,
    /// comes to this.
    ApplyForgotten,
}

/// What the gate protects: the state between runs.
struct Applied {
    last: Option<LogId>,
    membership: StoredMembership,
    sessions: Sessions,
}

/// Counters for `/metrics` and the benchmarks.
#[derive(Default, Debug)]
pub struct MachineStats {
    pub runs: AtomicU64,
    pub entries: AtomicU64,
    pub ops_applied: AtomicU64,
    pub ops_answered_from_sessions: AtomicU64,
    pub snapshots_built: AtomicU64,
    pub snapshots_installed: AtomicU64,
}

struct Inner<S: Service> {
    env: Env,
    service: Arc<S>,
    gate: tokio::sync::RwLock<Applied>,
    store: SnapshotStore,
    /// The newest snapshot built or installed: (meta, image).
    current: Mutex<Option<(SnapshotMeta, Bytes)>>,
    cfg: MachineConfig,
    stats: MachineStats,
}

/// The state machine openraft applies to. Cheap to clone.
pub struct Machine<S: Service> {
    inner: Arc<Inner<S>>,
}

impl<S: Service> Clone for Machine<S> {
    fn clone(&self) -> Self {
        Machine { inner: self.inner.clone() }
    }
}

fn meta_of(h: &Header) -> SnapshotMeta {
    SnapshotMeta { last_log_id: h.last, last_membership: h.membership.clone() }
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl<S: Service> Machine<S> {
    /// Loads the newest snapshot in `dir` (if any) into `service`.
    pub async fn open(env: &Env, dir: &Path, service: Arc<S>, cfg: MachineConfig) -> io::Result<Machine<S>> {
        let store = SnapshotStore::new(env, dir);
        let mut applied =
            Applied { last: None, membership: StoredMembership::default(), sessions: Sessions::default() };
        let mut current = None;
        if let Some((h, image)) = store.latest().await.map_err(io_err)? {
            let (_, state) = snapshot::decode(&image).map_err(io_err)?;
            service
                .restore(&state)
                .map_err(|e| io_err(format!("restoring the snapshot at {:?}: {e}", h.last)))?;
            tracing::info!(last = ?h.last, bytes = image.len(), sessions = h.sessions.len(), "loaded snapshot");
            current = Some((meta_of(&h), image));
            applied = Applied { last: h.last, membership: h.membership, sessions: h.sessions };
        }
        Ok(Machine {
            inner: Arc::new(Inner {
                env: env.clone(),
                service,
                gate: tokio::sync::RwLock::new(applied),
                store,
                current: Mutex::new(current),
                cfg,
                stats: MachineStats::default(),
            }),
        })
    }

    pub fn service(&self) -> &Arc<S> {
        &self.inner.service
    }

    pub fn stats(&self) -> &MachineStats {
        &self.inner.stats
    }

    /// The last applied entry.
    pub async fn applied(&self) -> Option<LogId> {
        self.inner.gate.read().await.last
    }

    /// Answers a read from the state between runs.
    pub async fn read(&self, query: &Bytes) -> Result<Bytes, String> {
        let _g = self.inner.gate.read().await;
        self.inner.service.read(query)
    }

    /// Applies one run of committed entries (the module header's steps).
    async fn apply_run(&self, run: Vec<EntryResponder<Raft>>) -> io::Result<()> {
        let inner = &*self.inner;
        let mut g = inner.gate.write().await;
        let skip_dedup = inner.cfg.plant == Some(Planted::SkipSessionDedup);
        let apply_forgotten = inner.cfg.plant == Some(Planted::ApplyForgotten);

        /// Where each op's reply comes from.
        enum Slot {
            Now(OpReply),
            Run(usize),
            SameAs(u64, u64),
        }
        let mut slots: Vec<Vec<Slot>> = Vec::with_capacity(run.len());
        // The ops to apply: (op, where it sits, its session and seq).
        let mut ops: Vec<(S::Op, Position)> = Vec::new();
        let mut owners: Vec<(u64, u64)> = Vec::new();
        let mut footprints = Vec::new();
        for (entry, _) in &run {
            let index = entry.log_id.index;
            let mut entry_slots = Vec::new();
            match &entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Membership(m) => {
                    g.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                }
                EntryPayload::Normal(batch) => {
                    for (pos, op) in batch.ops.iter().enumerate() {
                        let slot = match &op.kind {
                            OpKind::OpenSession => Slot::Now(g.sessions.open(session_id(index, pos), index)),
                            OpKind::CloseSession => Slot::Now(g.sessions.close(op.session)),
                            OpKind::Update(bytes) => {
                                let admit = g.sessions.admit(op.session, op.seq, op.acked_below, index);
                                let planted_apply = match &admit {
                                    Admit::Apply | Admit::Answer(OpReply::SessionExpired) => false,
                                    Admit::Answer(OpReply::ReplyForgotten) => skip_dedup || apply_forgotten,
                                    Admit::Answer(_) | Admit::SameAs { .. } => skip_dedup,
                                };
                                match admit {
                                    Admit::Answer(r) if !planted_apply => {
                                        inner
                                            .stats
                                            .ops_answered_from_sessions
                                            .fetch_add(1, Ordering::Relaxed);
                                        Slot::Now(r)
                                    }
                                    Admit::SameAs { seq } if !planted_apply => Slot::SameAs(op.session, seq),
                                    _ => match inner.service.decode(bytes) {
                                        Ok(decoded) => {
                                            footprints.push(inner.service.footprint(&decoded));
                                            ops.push((decoded, Position { index, op: pos as u32 }));
                                            owners.push((op.session, op.seq));
                                            Slot::Run(ops.len() - 1)
                                        }
                                        Err(e) => {
                                            let r = OpReply::Rejected(format!("undecodable operation: {e}"));
                                            g.sessions.record(op.session, op.seq, r.clone());
                                            Slot::Now(r)
                                        }
                                    },
                                }
                            }
                        };
                        entry_slots.push(slot);
                    }
                }
            }
            slots.push(entry_slots);
        }

        let n_ops = ops.len();
        let replies = if inner.cfg.plant == Some(Planted::ParallelConflicts) {
            // The planted bug: no edges at all. Workers then finish
            // conflicting operations in whatever order they happen to,
            // which differs from replica to replica; drawn here from this
            // member's own random stream, so a seed replays it.
            let mut order: Vec<usize> = (0..n_ops).collect();
            inner.env.shuffle(&mut order);
            let mut slots: Vec<Option<(S::Op, Position)>> = ops.into_iter().map(Some).collect();
            let shuffled: Vec<(S::Op, Position)> = order.iter().filter_map(|&i| slots[i].take()).collect();
            let out = exec::run(&inner.service, shuffled, &Plan::unordered(n_ops), 1).await;
            let mut replies = vec![Bytes::new(); n_ops];
            for (r, &i) in out.into_iter().zip(&order) {
                replies[i] = r;
            }
            replies
        } else if inner.cfg.apply_threads <= 1 {
            exec::run(&inner.service, ops, &Plan::serial(n_ops), 1).await
        } else {
            let svc = &inner.service;
            let refs: Vec<&S::Op> = ops.iter().map(|(o, _)| o).collect();
            let groups = schedule::groups(&refs, &footprints, |a, b| svc.commutes(a, b));
            exec::run_groups(&inner.service, ops, &groups, inner.cfg.apply_threads).await
        };
        for ((session, seq), r) in owners.iter().zip(&replies) {
            g.sessions.record(*session, *seq, OpReply::Applied(r.clone()));
        }
        assert!(g.sessions.settled() || skip_dedup, "every admitted operation's reply is recorded");

        // Answer the waiters (the leader's), in log order.
        let mut entries = 0;
        for ((entry, responder), entry_slots) in run.into_iter().zip(slots) {
            entries += 1;
            g.last = Some(entry.log_id);
            let Some(responder) = responder else { continue };
            let replies = entry_slots
                .into_iter()
                .map(|s| match s {
                    Slot::Now(r) => r,
                    Slot::Run(i) => OpReply::Applied(replies[i].clone()),
                    Slot::SameAs(session, seq) => g
                        .sessions
                        .get(session)
                        .and_then(|s| s.replies.get(&seq).cloned())
                        .unwrap_or(OpReply::ReplyForgotten),
                })
                .collect();
            responder.send(BatchReply { replies });
        }
        inner.stats.runs.fetch_add(1, Ordering::Relaxed);
        inner.stats.entries.fetch_add(entries, Ordering::Relaxed);
        inner.stats.ops_applied.fetch_add(n_ops as u64, Ordering::Relaxed);
        Ok(())
    }
}

impl<S: Service> RaftStateMachine<Raft> for Machine<S> {
    type SnapshotData = Bytes;
    type SnapshotBuilder = Builder<S>;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
        let g = self.inner.gate.read().await;
        Ok((g.last, g.membership.clone()))
    }

    async fn apply<Strm>(&mut self, entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<Raft>, io::Error>> + Unpin + Send,
    {
        let run: Vec<EntryResponder<Raft>> = entries.try_collect().await?;
        self.apply_run(run).await
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        Builder { machine: self.clone() }
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, image: Bytes) -> Result<(), io::Error> {
        let inner = &*self.inner;
        let (h, state) = snapshot::decode(&image).map_err(|e| io_err(format!("received snapshot: {e}")))?;
        if h.last != meta.last_log_id {
            return Err(io_err(format!(
                "received snapshot says it is at {:?}, its meta says {:?}",
                h.last, meta.last_log_id
            )));
        }
        // Durable before it counts: a crash after this finds it.
        inner.store.save(&h.last, &image).await.map_err(io_err)?;
        let mut g = inner.gate.write().await;
        inner.service.restore(&state).map_err(|e| io_err(format!("restoring a received snapshot: {e}")))?;
        *g = Applied { last: h.last, membership: h.membership.clone(), sessions: h.sessions.clone() };
        *lock(&inner.current) = Some((meta_of(&h), image));
        inner.stats.snapshots_installed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(last = ?h.last, "installed a snapshot from the leader");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<SnapshotOf<Raft, Bytes>>, io::Error> {
        Ok(lock(&self.inner.current).clone().map(|(meta, snapshot)| Snapshot { meta, snapshot }))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Builds snapshots (openraft runs it beside `apply`).
pub struct Builder<S: Service> {
    machine: Machine<S>,
}

impl<S: Service> RaftSnapshotBuilder<Raft> for Builder<S> {
    type SnapshotData = Bytes;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<Raft, Bytes>, io::Error> {
        let inner = &*self.machine.inner;
        // The consistent copy, between runs (cheap: persistent structures).
        let (header, state) = {
            let g = inner.gate.read().await;
            let h = Header { last: g.last, membership: g.membership.clone(), sessions: g.sessions.clone() };
            (h, inner.service.snapshot())
        };
        let mut pieces = Vec::new();
        inner.service.write_snapshot(&state, &mut |b| pieces.push(b));
        let image = snapshot::encode(&header, &pieces);
        inner.store.save(&header.last, &image).await.map_err(io_err)?;
        let meta = meta_of(&header);
        *lock(&inner.current) = Some((meta.clone(), image.clone()));
        inner.stats.snapshots_built.fetch_add(1, Ordering::Relaxed);
        tracing::info!(last = ?header.last, bytes = image.len(), "built a snapshot");
        Ok(Snapshot { meta, snapshot: image })
    }
}
