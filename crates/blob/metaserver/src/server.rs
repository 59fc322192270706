//! The metadata server (FDS §2.2, §3.1): collects heartbeats, builds the
//! TLT, hands it to clients, and changes rows with the assignment protocol.
//! It stores nothing durable: after a restart it rebuilds the table from
//! the assignments the tractservers report in their heartbeats.
//!
//! Phases:
//! - `waiting`: no TLT yet. If any tractserver reports a stored assignment,
//!   the table is rebuilt from the reports once every tractserver they name
//!   has reported, or after the rebuild grace period. Otherwise the first
//!   table is built once `init_tractservers` have registered.
//! - `ready`: the TLT is served; heartbeats keep member state current.
//!   A member silent for `dead_after` is declared dead and replaced in
//!   every row by a live member, which copies the row's tracts from the
//!   survivors (FDS §3.2; see `recover`).
//!
//! Invariant (FDS §3.1): a new row version is given to clients only after
//! every tractserver of the old and new row has durably stored it, so a
//! client can never hold a version its tractservers do not know.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::SeedableRng;

use blizzard_core::limits::{tract_size_valid, NAME_LEN_MAX, REPLICATION_MAX};
use blizzard_core::tlt::{Pending, Tlt, TltMember, TltRow};
use blizzard_core::TsId;
use blizzard_env::{Env, Instant};
use blizzard_proto::{
    AssignedRow, Assignment, ClusterParams, ClusterStatus, ErrorCode, ErrorReply, FillProgress, Heartbeat,
    HeartbeatAction, HeartbeatReply, MemberStatus, Reply, Request,
};
use blizzard_rpc::{
    serve, Caller, RpcConn, RpcError, ServerLimits, ServerTasks, Service, Shutdown, ShutdownHandle,
};

use crate::plan::{self, assignment_for, assignment_is_stale, Filling, Member, RowChange, Rules, View};
use crate::tlt_builder::{build_rows, row_counts, BuildParams, BuilderMember};

#[derive(Clone, Debug)]
pub struct MetaConfig {
    pub listen: String,
    /// Tract size for a new cluster (a restarted server adopts the stored one).
    pub tract_size: u32,
    /// Members per TLT row: the cluster's maximum replication level.
    pub replication: u8,
    /// m, for 1-way tables (FDS §2.2).
    pub permutations: u32,
    /// Weight 1-way tables by each disk's measured speed.
    pub weighted: bool,
    /// A new cluster's first TLT is built once this many tractservers have
    /// registered.
    pub init_tractservers: usize,
    pub heartbeat_interval: Duration,
    /// A tractserver silent this long is declared dead and its rows are
    /// re-replicated elsewhere. Tractservers stop serving after two thirds
    /// of it without an answered heartbeat (their lease), so a cut-off
    /// server has stopped before its rows are given away.
    pub dead_after: Duration,
    /// Replace dead members automatically. Off only for tests and for
    /// planned maintenance (like Ceph's `noout`).
    pub recovery: bool,
    /// Give live tractservers that hold no TLT position (new ones, or ones
    /// back from the dead with nothing) their share of entries (FDS §3.4).
    /// Off keeps them as spares for replacing failed members.
    pub grow: bool,
    /// After a restart, how long to wait for tractservers named in the
    /// reported assignments before rebuilding without them.
    pub rebuild_grace: Duration,
    pub request_timeout: Duration,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`), if anywhere.
    pub metrics_listen: Option<String>,
}

impl MetaConfig {
    pub fn new(listen: impl Into<String>) -> Self {
        MetaConfig {
            listen: listen.into(),
            tract_size: blizzard_core::limits::TRACT_SIZE_DEFAULT,
            replication: 1,
            permutations: 20,
            weighted: false,
            init_tractservers: 1,
            heartbeat_interval: Duration::from_millis(500),
            dead_after: Duration::from_secs(5),
            recovery: true,
            grow: true,
            rebuild_grace: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            metrics_listen: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot listen on {addr}: {error}")]
    Bind { addr: String, error: std::io::Error },
    #[error("the cluster has no TLT yet")]
    NotReady,
    #[error("invalid TLT change: {0}")]
    BadChange(String),
    #[error("tractserver {id} did not accept its new assignment: {error}")]
    AssignFailed { id: TsId, error: RpcError },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Ready,
}

struct State {
    phase: Phase,
    members: BTreeMap<TsId, Member>,
    tlt: Option<Arc<Tlt>>,
    /// Per row, the members still copying it (FDS §3.2). Kept beside the
    /// TLT, not in it: clients write to every member alike; only the
    /// members themselves (through their assignments) need to know.
    filling: BTreeMap<usize, BTreeSet<TsId>>,
    /// Members declared dead. A dead member that heartbeats again is told
    /// to stop serving until it has stored its current assignment.
    dead: BTreeSet<TsId>,
    /// When the TLT was first served by this metadata server, or when this
    /// server last woke from a stall: silence is counted from no earlier
    /// than this, so neither a member that has not heartbeated since a
    /// restart nor every member at once after the metadata server itself
    /// was paused is declared dead before it had `dead_after` to report.
    ready_since: Option<Instant>,
    last_recover: Option<Instant>,
    /// Versions handed out by a change whose assignment round failed: the
    /// next change numbers above them, so one (row, version) never names
    /// two memberships on the tractservers that stored the failed round.
    row_version_floor: HashMap<usize, u64>,
    tlt_version_floor: u64,
    /// Members that may hold an assignment from a change that was never
    /// served (its round failed part-way; a push can even arrive late,
    /// after a partition heals). Every later change pushes them their
    /// current assignment too, whose newer table version then outranks the
    /// unserved one, until a push to them succeeds.
    unsettled: BTreeSet<TsId>,
    first_report: Option<Instant>,
    last_complaint: Option<Instant>,
}

pub struct MetaServer {
    env: Env,
    cfg: MetaConfig,
    /// Every version this lifetime hands out (row or table) is above this:
    /// its start time in milliseconds, shifted left 20 bits. A metadata
    /// server keeps no state, and one restarted right after a round failed
    /// part-way may never hear from the members that stored that round; its
    /// floors alone would then let it number a new round the same, so one
    /// (row, version) would name two memberships. Started later, it numbers
    /// above every earlier lifetime (unless that one handed out over a
    /// million versions per millisecond it lived, or the clock went back,
    /// where the floors still apply).
    version_base: u64,
    state: Mutex<State>,
    /// Serializes TLT changes: one assignment round at a time.
    change: tokio::sync::Mutex<()>,
    /// Ordered so connections close in the same order on every run.
    conns: Mutex<BTreeMap<String, RpcConn>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn err(code: ErrorCode, msg: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, msg)
}

impl MetaServer {
    pub fn new(env: Env, cfg: MetaConfig) -> Result<MetaServer, MetaError> {
        if !tract_size_valid(cfg.tract_size) {
            return Err(MetaError::Config(format!(
                "tract size {} must be a power of two between 4 KiB and 64 MiB",
                cfg.tract_size
            )));
        }
        if cfg.replication == 0 || cfg.replication > REPLICATION_MAX {
            return Err(MetaError::Config(format!("replication must be 1..={REPLICATION_MAX}")));
        }
        if cfg.permutations == 0 {
            return Err(MetaError::Config("permutations must be at least 1".into()));
        }
        let started_ms = env
            .clock
            .system_time()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        Ok(MetaServer {
            version_base: started_ms.min(u64::MAX >> 21) << 20,
            env,
            cfg,
            state: Mutex::new(State {
                phase: Phase::Waiting,
                members: BTreeMap::new(),
                tlt: None,
                filling: BTreeMap::new(),
                dead: BTreeSet::new(),
                ready_since: None,
                last_recover: None,
                row_version_floor: HashMap::new(),
                tlt_version_floor: 0,
                unsettled: BTreeSet::new(),
                first_report: None,
                last_complaint: None,
            }),
            change: tokio::sync::Mutex::new(()),
            conns: Mutex::new(BTreeMap::new()),
        })
    }

    /// The TLT being served, once there is one.
    pub fn tlt(&self) -> Option<Arc<Tlt>> {
        lock(&self.state).tlt.clone()
    }

    fn heartbeat(&self, hb: Heartbeat) -> Result<Reply, ErrorReply> {
        if hb.addr.is_empty() || hb.addr.len() > NAME_LEN_MAX || hb.domain.len() > NAME_LEN_MAX {
            return Err(err(ErrorCode::BadRequest, "address or failure domain is empty or too long"));
        }
        let now = self.env.now();
        let mut st = lock(&self.state);
        if let Some(tlt) = &st.tlt {
            if hb.tract_size != tlt.tract_size {
                return Err(err(
                    ErrorCode::WrongCluster,
                    format!("disk has {}-byte tracts but the cluster uses {}", hb.tract_size, tlt.tract_size),
                ));
            }
            if let Some(a) = hb.assignment.as_ref().filter(|a| a.cluster_id != tlt.cluster_id) {
                return Err(err(
                    ErrorCode::WrongCluster,
                    format!("disk belongs to cluster {:032x}, this is {:032x}", a.cluster_id, tlt.cluster_id),
                ));
            }
        }
        let domain = if hb.domain.is_empty() { hb.ts_id.to_string() } else { hb.domain.clone() };
        // Heartbeats carry the assignment only when asked (while the TLT is
        // being built or rebuilt): keep the last one a member reported.
        let reported =
            hb.assignment.clone().or_else(|| st.members.get(&hb.ts_id).and_then(|m| m.reported.clone()));
        if reported.is_some() && st.first_report.is_none() {
            st.first_report = Some(now);
        }
        // Compared with the table, not with the last heartbeat: a table
        // rebuilt after a restart lists members it has not heard from yet
        // with no address, and their first heartbeat must fill it in.
        let moved = st
            .tlt
            .as_ref()
            .is_some_and(|t| t.member_index(hb.ts_id).is_some_and(|i| t.members[i as usize].addr != hb.addr));
        st.members.insert(
            hb.ts_id,
            Member {
                addr: hb.addr.clone(),
                domain,
                last_heartbeat: now,
                slots_total: hb.slots_total,
                slots_used: hb.slots_used,
                load: hb.load,
                disk_mbps: hb.disk_mbps,
                reported,
                filled: hb.filled.clone(),
                fill: hb.fill,
            },
        );
        // A member that came back on a new address (or whose address the
        // table lacked): clients must learn it, so the table's version
        // moves (row versions do not: same members).
        if moved {
            if let Some(tlt) = st.tlt.clone() {
                if let Some(i) = tlt.member_index(hb.ts_id) {
                    let mut t = (*tlt).clone();
                    t.members[i as usize].addr = hb.addr.clone();
                    t.version = t.version.max(self.version_base) + 1;
                    tracing::info!(id = %hb.ts_id, addr = %hb.addr, "tractserver moved; TLT version {}", t.version);
                    st.tlt = Some(Arc::new(t));
                }
            }
        }
        let ms = self.cfg.heartbeat_interval.as_millis().min(u32::MAX as u128) as u32;
        // A member declared dead, or reporting rows at older versions than
        // the table's, may serve a client holding an old TLT what newer
        // writes have replaced: it must stop serving until `recover` has
        // given it its current assignment.
        let stale = st.phase == Phase::Ready
            && st.tlt.as_ref().is_some_and(|t| {
                st.members
                    .get(&hb.ts_id)
                    .and_then(|m| m.reported.as_ref())
                    .is_some_and(|a| assignment_is_stale(t, hb.ts_id, a))
            });
        let action = if st.dead.contains(&hb.ts_id) || stale {
            HeartbeatAction::StopServing
        } else {
            HeartbeatAction::Continue
        };
        Ok(Reply::Heartbeat(HeartbeatReply {
            action,
            interval_ms: ms,
            send_assignment: st.phase == Phase::Waiting,
            lease_ms: self.lease().as_millis().min(u32::MAX as u128) as u32,
        }))
    }

    /// How long a tractserver may serve after sending a heartbeat that was
    /// answered: well inside `dead_after`, so it has stopped serving (and
    /// cannot hand out data a newer row version has overwritten) by the
    /// time its rows are given to others.
    fn lease(&self) -> Duration {
        self.cfg.dead_after * 2 / 3
    }

    /// Advances the phase: rebuild or build the first TLT when possible;
    /// once ready, detect dead members and re-replicate their rows.
    pub async fn tick(&self) {
        let _change = self.change.lock().await;
        let (phase, members, first_report) = {
            let st = lock(&self.state);
            (st.phase, st.members.clone(), st.first_report)
        };
        if phase == Phase::Ready {
            let r = self.recover().await;
            lock(&self.state).last_recover = Some(self.env.now());
            if let Err(e) = r {
                let now = self.env.now();
                let mut st = lock(&self.state);
                if st.last_complaint.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(5)) {
                    tracing::warn!(error = %e, "recovery round failed; retrying");
                    st.last_complaint = Some(now);
                }
            }
            return;
        }
        let now = self.env.now();
        let reports: Vec<&Assignment> = members.values().filter_map(|m| m.reported.as_ref()).collect();
        let result = if !reports.is_empty() {
            let named: BTreeSet<TsId> =
                reports.iter().flat_map(|a| a.rows.iter().flat_map(|r| r.members.iter().copied())).collect();
            let all_here = named.iter().all(|id| members.contains_key(id));
            let grace_over = first_report.is_some_and(|t| now.duration_since(t) >= self.cfg.rebuild_grace);
            if !(all_here || grace_over) {
                return;
            }
            self.rebuild(&members)
        } else if members.len() >= self.cfg.init_tractservers.max(1) {
            self.initial_build(&members).await.map(|t| (t, BTreeMap::new()))
        } else {
            return;
        };
        match result {
            Ok((tlt, filling)) => {
                tracing::info!(
                    rows = tlt.rows.len(),
                    members = tlt.members.len(),
                    replication = tlt.replication,
                    version = tlt.version,
                    "TLT ready"
                );
                let mut st = lock(&self.state);
                st.tlt = Some(tlt);
                st.filling = filling;
                st.phase = Phase::Ready;
                st.ready_since = Some(now);
            }
            Err(e) => {
                let mut st = lock(&self.state);
                if st.last_complaint.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
                    tracing::error!(error = %e, "cannot build the TLT yet");
                    st.last_complaint = Some(now);
                }
            }
        }
    }

    /// A new cluster: build the table and store every member's positions.
    async fn initial_build(&self, members: &BTreeMap<TsId, Member>) -> Result<Arc<Tlt>, MetaError> {
        let ids: Vec<TsId> = members.keys().copied().collect();
        let builder: Vec<BuilderMember> = members
            .iter()
            .map(|(id, m)| BuilderMember { id: *id, domain: m.domain.clone(), weight: m.disk_mbps })
            .collect();
        let params = BuildParams {
            replication: self.cfg.replication,
            permutations: self.cfg.permutations,
            weighted: self.cfg.weighted,
        };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(self.env.random_u64());
        let rows =
            build_rows(&builder, &params, &mut rng).map_err(|e| MetaError::BadChange(e.to_string()))?;
        let tlt = Tlt {
            cluster_id: self.env.random_u128().max(1),
            tract_size: self.cfg.tract_size,
            replication: self.cfg.replication,
            version: 1,
            members: ids
                .iter()
                .map(|id| {
                    let m = &members[id];
                    TltMember { id: *id, addr: m.addr.clone(), domain: m.domain.clone() }
                })
                .collect(),
            rows: rows.into_iter().map(|members| TltRow::new(1, members)).collect(),
        };
        tlt.validate().map_err(|e| MetaError::BadChange(e.to_string()))?;
        self.push_assignments(&tlt, &BTreeMap::new(), &ids).await?;
        Ok(Arc::new(tlt))
    }

    /// A restarted metadata server: the table is what the tractservers say,
    /// row by row taking the highest version reported.
    fn rebuild(&self, members: &BTreeMap<TsId, Member>) -> Result<(Arc<Tlt>, Filling), MetaError> {
        let reports: Vec<&Assignment> = members.values().filter_map(|m| m.reported.as_ref()).collect();
        let Some(newest) = reports.iter().max_by_key(|a| a.tlt_version) else {
            return Err(MetaError::NotReady);
        };
        let len = newest.tlt_len as usize;
        // Per row, the report from the newest assignment round that named
        // it (highest table version, then row version): the previous
        // server's latest decision about the row. Not simply the highest
        // row version: a round that failed part-way leaves a version that
        // was never served on the members it reached, and the server then
        // pushed the row's served version to the ones it could reach, in a
        // newer round; a member cut off meanwhile still holds the unserved
        // one (it is given its current assignment once it reports).
        let mut rows: Vec<Option<(&AssignedRow, u64)>> = vec![None; len];
        for a in reports.iter().filter(|a| a.cluster_id == newest.cluster_id) {
            for r in &a.rows {
                if let Some(slot) = rows.get_mut(r.row as usize) {
                    if slot.is_none_or(|(cur, tv)| (a.tlt_version, r.version) > (tv, cur.version)) {
                        *slot = Some((r, a.tlt_version));
                    }
                }
            }
        }
        let rows: Vec<Option<&AssignedRow>> = rows.into_iter().map(|r| r.map(|(r, _)| r)).collect();
        let missing = rows.iter().filter(|r| r.is_none()).count();
        if missing > 0 {
            return Err(MetaError::BadChange(format!(
                "{missing} of {len} TLT rows are held by no reporting tractserver; start the missing tractservers"
            )));
        }
        let ids: BTreeSet<TsId> = rows
            .iter()
            .flatten()
            .flat_map(|r| r.members.iter().copied().chain(r.pending.iter().map(|p| p.id)))
            .collect();
        let ids: Vec<TsId> = ids.into_iter().collect();
        let index: HashMap<TsId, u32> = ids.iter().enumerate().map(|(i, id)| (*id, i as u32)).collect();
        let tlt = Tlt {
            cluster_id: newest.cluster_id,
            tract_size: newest.tract_size,
            replication: newest.replication,
            version: newest.tlt_version,
            members: ids
                .iter()
                .map(|id| match members.get(id) {
                    Some(m) => TltMember { id: *id, addr: m.addr.clone(), domain: m.domain.clone() },
                    // Named by others but silent: listed so rows stay whole.
                    None => TltMember { id: *id, addr: String::new(), domain: id.to_string() },
                })
                .collect(),
            rows: rows
                .iter()
                .flatten()
                .map(|r| TltRow {
                    version: r.version,
                    members: r.members.iter().filter_map(|m| index.get(m).copied()).collect(),
                    pending: r
                        .pending
                        .iter()
                        .filter_map(|p| index.get(&p.id).map(|&member| Pending { column: p.column, member }))
                        .collect(),
                })
                .collect(),
        };
        tlt.validate()
            .map_err(|e| MetaError::BadChange(format!("reported assignments are inconsistent: {e}")))?;
        if tlt.tract_size != self.cfg.tract_size || tlt.replication != self.cfg.replication {
            tracing::warn!(
                tract_size = tlt.tract_size,
                replication = tlt.replication,
                "adopting the cluster's stored parameters, which differ from this server's flags"
            );
        }
        let filling: Filling = rows
            .iter()
            .flatten()
            .map(|r| {
                let holder = |id: &TsId| r.members.contains(id) || r.pending.iter().any(|p| p.id == *id);
                (r.row as usize, r.filling.iter().copied().filter(holder).collect::<BTreeSet<TsId>>())
            })
            .filter(|(_, f)| !f.is_empty())
            .collect();
        tracing::info!(
            version = tlt.version,
            rows_filling = filling.len(),
            "rebuilt the TLT from tractserver reports"
        );
        Ok((Arc::new(tlt), filling))
    }

    /// Sends each of `ids` its assignment under `tlt` and waits for all to
    /// store it.
    async fn push_assignments(&self, tlt: &Tlt, filling: &Filling, ids: &[TsId]) -> Result<(), MetaError> {
        let calls = ids.iter().map(|id| async move {
            // A member that left every row is not in the table any more:
            // its address is the one it heartbeats from.
            let addr = match tlt.member_index(*id) {
                Some(i) => tlt.members[i as usize].addr.clone(),
                None => lock(&self.state).members.get(id).map(|m| m.addr.clone()).unwrap_or_default(),
            };
            let assignment = assignment_for(tlt, filling, *id);
            let req = Request::AssignRows { assignment: assignment.clone() };
            let res = match self.conn(&addr).await {
                Ok(c) => c.call_timeout(&self.env, self.cfg.request_timeout, &req, Bytes::new()).await,
                Err(e) => Err(e),
            };
            // What it holds now, for judging whether it may serve.
            if res.is_ok() {
                if let Some(m) = lock(&self.state).members.get_mut(id) {
                    m.reported = Some(assignment);
                }
            }
            res.map(|_| ()).map_err(|error| MetaError::AssignFailed { id: *id, error })
        });
        for r in futures::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    async fn conn(&self, addr: &str) -> Result<RpcConn, RpcError> {
        if let Some(c) = lock(&self.conns).get(addr).filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = RpcConn::connect(&self.env, addr).await?;
        lock(&self.conns).insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Changes the members of some rows: bumps their versions, has every
    /// tractserver of the old and new rows store its new assignment, and
    /// only then serves the new table (FDS §3.1). Giving a row its current
    /// members just bumps its version.
    pub async fn reassign_rows(&self, changes: &[(usize, Vec<TsId>)]) -> Result<Arc<Tlt>, MetaError> {
        let _change = self.change.lock().await;
        let (cur, filling) = {
            let st = lock(&self.state);
            (st.tlt.clone().ok_or(MetaError::NotReady)?, st.filling.clone())
        };
        let changes: Vec<RowChange> = changes
            .iter()
            .map(|(row, ids)| RowChange {
                row: *row,
                members: ids.clone(),
                filling: filling.get(row).cloned().unwrap_or_default(),
                pending: cur
                    .rows
                    .get(*row)
                    .map(|r| {
                        r.pending
                            .iter()
                            .map(|p| (p.column, cur.members[p.member as usize].id))
                            .filter(|(_, id)| !ids.contains(id))
                            .collect()
                    })
                    .unwrap_or_default(),
                bump: true,
            })
            .collect();
        let t = self.commit(&cur, &changes).await?;
        tracing::info!(rows = changes.len(), version = t.version, "TLT rows reassigned");
        Ok(t)
    }

    /// Applies row changes to `cur`: new versions for changed memberships,
    /// every live tractserver of the old and new rows stores its new
    /// assignment, and only then is the table served. Runs under `change`.
    async fn commit(&self, cur: &Arc<Tlt>, changes: &[RowChange]) -> Result<Arc<Tlt>, MetaError> {
        let (members, mut filling, dead, floors, tlt_floor) = {
            let st = lock(&self.state);
            (
                st.members.clone(),
                st.filling.clone(),
                st.dead.clone(),
                st.row_version_floor.clone(),
                st.tlt_version_floor,
            )
        };
        let mut t = (**cur).clone();
        let mut affected = BTreeSet::new();
        let mut bumped = Vec::new();
        for c in changes {
            let Some(r) = t.rows.get(c.row) else {
                return Err(MetaError::BadChange(format!("row {} does not exist", c.row)));
            };
            affected.extend(
                r.members
                    .iter()
                    .chain(r.pending.iter().map(|p| &p.member))
                    .map(|&m| t.members[m as usize].id),
            );
            if c.members.len() != t.replication as usize {
                return Err(MetaError::BadChange(format!("row {} needs {} members", c.row, t.replication)));
            }
            let mut index = |t: &mut Tlt, id: TsId| -> Result<u32, MetaError> {
                affected.insert(id);
                match t.member_index(id) {
                    Some(i) => Ok(i),
                    None => {
                        let Some(m) = members.get(&id) else {
                            return Err(MetaError::BadChange(format!("tractserver {id} is not registered")));
                        };
                        t.members.push(TltMember { id, addr: m.addr.clone(), domain: m.domain.clone() });
                        Ok((t.members.len() - 1) as u32)
                    }
                }
            };
            let mut idx = Vec::with_capacity(c.members.len());
            for id in &c.members {
                idx.push(index(&mut t, *id)?);
            }
            let mut pending = Vec::with_capacity(c.pending.len());
            for (column, id) in &c.pending {
                pending.push(Pending { column: *column, member: index(&mut t, *id)? });
            }
            let r = &mut t.rows[c.row];
            r.members = idx;
            r.pending = pending;
            // Only the row's holders can be filling it: a filling member
            // replaced by a committed pending one leaves the row, and a
            // mark it kept would wait forever for a report.
            let c_filling: BTreeSet<TsId> = c
                .filling
                .iter()
                .copied()
                .filter(|id| c.members.contains(id) || c.pending.iter().any(|(_, p)| p == id))
                .collect();
            if c.bump {
                r.version =
                    r.version.max(floors.get(&c.row).copied().unwrap_or(0)).max(self.version_base) + 1;
                bumped.push((c.row, r.version));
            }
            if c_filling.is_empty() {
                filling.remove(&c.row);
            } else {
                filling.insert(c.row, c_filling);
            }
        }
        t.version = t.version.max(tlt_floor).max(self.version_base) + 1;
        t.validate().map_err(|e| MetaError::BadChange(e.to_string()))?;
        // FDS §3.1's invariant, checked rather than trusted: a refused
        // change is logged and retried next round, never served.
        plan::check_change(cur, &t, &floors, tlt_floor)
            .map_err(|e| MetaError::BadChange(format!("invariant violated, change not served: {e}")))?;
        {
            let mut st = lock(&self.state);
            st.row_version_floor.extend(bumped);
            st.tlt_version_floor = t.version;
        }
        // A dead member cannot store anything: it is told to stop serving
        // when it heartbeats again, and then given its assignment.
        let unsettled = lock(&self.state).unsettled.clone();
        let ids: Vec<TsId> = affected.union(&unsettled).copied().filter(|id| !dead.contains(id)).collect();
        lock(&self.state).unsettled.extend(ids.iter().copied());
        self.push_assignments(&t, &filling, &ids).await?;
        let t = Arc::new(t);
        let mut st = lock(&self.state);
        for id in &ids {
            st.unsettled.remove(id);
        }
        st.tlt = Some(t.clone());
        st.filling = filling;
        Ok(t)
    }

    /// One recovery round (FDS §3.2; the cases are `plan`'s): snapshot
    /// the view, plan, apply the plan's member states, commit its row
    /// changes and settle its members in one assignment round, log.
    async fn recover(&self) -> Result<(), MetaError> {
        let now = self.env.now();
        let (cur, members, filling, dead, ready_since) = {
            let mut st = lock(&self.state);
            let Some(cur) = st.tlt.clone() else { return Ok(()) };
            // Rounds start every half heartbeat interval after the last one
            // ended; a much longer gap means this process was stalled, and
            // heartbeats may be queued.
            if st.last_recover.is_some_and(|t| now.duration_since(t) > self.cfg.heartbeat_interval * 4) {
                tracing::warn!("metadata server was stalled; restarting every member's silence clock");
                st.ready_since = Some(now);
            }
            (cur, st.members.clone(), st.filling.clone(), st.dead.clone(), st.ready_since.unwrap_or(now))
        };
        let silent: BTreeMap<TsId, Duration> = members
            .iter()
            .map(|(id, m)| (*id, now.duration_since(m.last_heartbeat.max(ready_since))))
            .collect();
        let view = View {
            tlt: &cur,
            members: &members,
            filling: &filling,
            dead: &dead,
            silent: &silent,
            silence: now.duration_since(ready_since),
        };
        let rules =
            Rules { dead_after: self.cfg.dead_after, recovery: self.cfg.recovery, grow: self.cfg.grow };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(self.env.random_u64());
        let plan = plan::plan(&view, &rules, &mut rng);
        for (id, silent) in &plan.died {
            tracing::error!(%id, silent_ms = silent.as_millis() as u64, "tractserver declared dead");
        }
        {
            let mut st = lock(&self.state);
            st.dead = plan.dead.clone();
            st.tlt_version_floor = st.tlt_version_floor.max(plan.tlt_floor);
            for (row, v) in &plan.row_floors {
                let f = st.row_version_floor.entry(*row).or_default();
                *f = (*f).max(*v);
            }
            // Settled members get their assignment in this round (`commit`
            // pushes every unsettled member), in a table version above any
            // handed out before, so no older push still in flight can
            // replace it; until then their heartbeats keep them from serving.
            st.unsettled.extend(plan.settle().copied());
        }
        if plan.stuck > 0 {
            let mut st = lock(&self.state);
            if st.last_complaint.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(10)) {
                tracing::error!(
                    rows = plan.stuck,
                    "rows name a dead tractserver and cannot be re-replicated (no complete member alive, or no \
                     live tractserver outside the row's failure domains): restart the dead tractservers or add new ones"
                );
                st.last_complaint = Some(now);
            }
        }
        if !plan.commits() {
            return Ok(());
        }
        let t = self.commit(&cur, &plan.changes).await?;
        for id in &plan.returned {
            let filling = lock(&self.state).filling.clone();
            let rows = assignment_for(&t, &filling, *id).rows.len();
            tracing::info!(%id, rows, "declared-dead tractserver is back and holds its current assignment");
        }
        for id in &plan.stale {
            tracing::info!(%id, "gave a tractserver with a stale assignment its current one");
        }
        for (rows, what) in plan.summary(&cur).into_iter().filter(|(n, _)| *n > 0) {
            tracing::info!(rows, version = t.version, "{what}");
        }
        let joined: BTreeSet<TsId> = plan
            .changes
            .iter()
            .flat_map(|c| c.pending.iter().map(|(_, id)| *id))
            .filter(|id| {
                !cur.rows.iter().any(|r| r.pending.iter().any(|p| cur.members[p.member as usize].id == *id))
            })
            .collect();
        for id in joined {
            tracing::info!(%id, "tractserver joined the TLT: copying its share of rows (pending)");
        }
        Ok(())
    }

    pub fn status(&self) -> ClusterStatus {
        let now = self.env.now();
        let st = lock(&self.state);
        let (rows, primaries) = match &st.tlt {
            Some(t) => {
                let rows: Vec<Vec<u32>> = t.rows.iter().map(|r| r.members.clone()).collect();
                row_counts(t.members.len(), &rows)
            }
            None => (vec![], vec![]),
        };
        let mut ids: BTreeSet<TsId> = st.members.keys().copied().collect();
        if let Some(t) = &st.tlt {
            ids.extend(t.members.iter().map(|m| m.id));
        }
        let members = ids
            .into_iter()
            .map(|id| {
                let pos = st.tlt.as_ref().and_then(|t| t.member_index(id)).map(|i| i as usize);
                let (r, p) = pos.map(|i| (rows[i], primaries[i])).unwrap_or((0, 0));
                match st.members.get(&id) {
                    Some(m) => {
                        let age = now.duration_since(m.last_heartbeat);
                        MemberStatus {
                            id,
                            addr: m.addr.clone(),
                            domain: m.domain.clone(),
                            // Three missed heartbeats show as down (silent, not
                            // yet dead); `dead_after` declares it dead.
                            alive: age < self.cfg.heartbeat_interval * 3 && !st.dead.contains(&id),
                            last_heartbeat_ms: age.as_millis() as u64,
                            slots_total: m.slots_total,
                            slots_used: m.slots_used,
                            load: m.load,
                            rows: r,
                            primaries: p,
                            dead: st.dead.contains(&id),
                            fill: m.fill,
                        }
                    }
                    None => MemberStatus {
                        id,
                        addr: String::new(),
                        domain: String::new(),
                        alive: false,
                        last_heartbeat_ms: u64::MAX,
                        slots_total: 0,
                        slots_used: 0,
                        load: 0,
                        rows: r,
                        primaries: p,
                        dead: st.dead.contains(&id),
                        fill: FillProgress::default(),
                    },
                }
            })
            .collect();
        let t = st.tlt.as_ref();
        ClusterStatus {
            phase: match st.phase {
                Phase::Waiting if st.first_report.is_some() => "recovering".into(),
                Phase::Waiting => "waiting".into(),
                Phase::Ready => "ready".into(),
            },
            cluster_id: t.map(|t| t.cluster_id).unwrap_or(0),
            tract_size: t.map(|t| t.tract_size).unwrap_or(self.cfg.tract_size),
            replication: t.map(|t| t.replication).unwrap_or(self.cfg.replication),
            tlt_version: t.map(|t| t.version).unwrap_or(0),
            tlt_rows: t.map(|t| t.rows.len() as u32).unwrap_or(0),
            members,
            rows_filling: st.filling.values().filter(|f| !f.is_empty()).count() as u32,
            rows_degraded: t.map_or(0, |t| {
                t.rows
                    .iter()
                    .filter(|r| r.members.iter().any(|&m| st.dead.contains(&t.members[m as usize].id)))
                    .count() as u32
            }),
        }
    }

    /// The cluster's state as Prometheus metrics.
    pub fn metrics_text(&self) -> String {
        let s = self.status();
        let count = |f: &dyn Fn(&MemberStatus) -> bool| s.members.iter().filter(|m| f(m)).count() as f64;
        let (up, dead) = (count(&|m| m.alive), count(&|m| m.dead));
        let down = s.members.len() as f64 - up - dead;
        let sum = |f: &dyn Fn(&FillProgress) -> u64| s.members.iter().map(|m| f(&m.fill) as f64).sum::<f64>();
        blizzard_metrics::Text::new()
            .gauges(
                "blizzard_tractservers",
                "Tractservers known to the metadata server, by state.",
                &[(&[("state", "up")], up), (&[("state", "down")], down), (&[("state", "dead")], dead)],
            )
            .gauge("blizzard_tlt_version", "Version of the TLT being served.", s.tlt_version as f64)
            .gauge("blizzard_tlt_rows", "Rows in the TLT.", s.tlt_rows as f64)
            .gauge("blizzard_replication", "Members per TLT row.", s.replication as f64)
            .gauge("blizzard_ready", "1 once a TLT is served.", if s.phase == "ready" { 1.0 } else { 0.0 })
            .gauge("blizzard_rows_filling", "Rows with a member still copying them.", s.rows_filling as f64)
            .gauge(
                "blizzard_rows_degraded",
                "Rows naming a dead tractserver not replaced yet.",
                s.rows_degraded as f64,
            )
            .gauge(
                "blizzard_recovery_tracts_total",
                "Tracts the copying members have found to copy.",
                sum(&|f| f.tracts_total),
            )
            .gauge(
                "blizzard_recovery_tracts_done",
                "Tracts copied so far by copying members.",
                sum(&|f| f.tracts_done),
            )
            .counter(
                "blizzard_recovery_bytes_total",
                "Bytes copied for re-replication, as reported by live tractservers since they started.",
                sum(&|f| f.bytes_done),
            )
            .finish()
    }

    fn handle(&self, req: Request) -> Result<Reply, ErrorReply> {
        match req {
            Request::Ping => Ok(Reply::Done),
            Request::Heartbeat(hb) => self.heartbeat(hb),
            // Always the whole table: a metadata server rebuilt after a
            // restart may reuse a version number for a table that differs
            // in addresses, so "you are current" cannot be trusted on the
            // version alone. Clients fetch only when something is stale.
            Request::GetTlt { have_version: _ } => match self.tlt() {
                Some(t) => Ok(Reply::Tlt(Some((*t).clone()))),
                None => Err(err(ErrorCode::NotReady, "the cluster has no TLT yet; waiting for tractservers")),
            },
            Request::ClusterStatus => Ok(Reply::ClusterStatus(self.status())),
            Request::ClusterParams => {
                let t = self.tlt();
                Ok(Reply::ClusterParams(ClusterParams {
                    tract_size: t.as_ref().map(|t| t.tract_size).unwrap_or(self.cfg.tract_size),
                    replication: t.as_ref().map(|t| t.replication).unwrap_or(self.cfg.replication),
                    cluster_id: t.as_ref().map(|t| t.cluster_id).unwrap_or(0),
                }))
            }
            other => Err(err(ErrorCode::BadRequest, format!("{:?} is for tractservers", other.opcode()))),
        }
    }
}

impl Service for MetaServer {
    fn call(
        self: Arc<Self>,
        req: Request,
        _data: Bytes,
        _caller: Caller,
    ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
        async move { (self.handle(req), Bytes::new()) }.boxed()
    }
}

/// A running metadata server.
pub struct MetaHandle {
    pub addr: String,
    pub server: Arc<MetaServer>,
    tasks: ServerTasks,
}

impl MetaHandle {
    pub async fn stop(self) {
        self.tasks.stop().await;
    }

    pub async fn wait(self) {
        self.tasks.wait().await;
    }
}

/// Binds and starts the metadata server and its phase ticker.
pub async fn start(env: Env, cfg: MetaConfig) -> Result<MetaHandle, MetaError> {
    let server = Arc::new(MetaServer::new(env.clone(), cfg.clone())?);
    let listener =
        env.bind(&cfg.listen).await.map_err(|error| MetaError::Bind { addr: cfg.listen.clone(), error })?;
    let addr = listener.local_addr();
    tracing::info!(%addr, "metadata server listening");
    let (shutdown, rx) = ShutdownHandle::new();
    let mut tasks = vec![
        tokio::spawn(serve(env.clone(), listener, server.clone(), ServerLimits::default(), rx.clone())),
        tokio::spawn(ticker(env.clone(), server.clone(), cfg.heartbeat_interval, rx.clone())),
    ];
    if let Some(m) = &cfg.metrics_listen {
        let l = env.bind(m).await.map_err(|error| MetaError::Bind { addr: m.clone(), error })?;
        tracing::info!(addr = %l.local_addr(), "metrics at /metrics");
        let s = server.clone();
        let mut rx = rx;
        tasks.push(tokio::spawn(blizzard_metrics::serve(
            env,
            l,
            Arc::new(move || s.metrics_text()),
            async move { rx.wait().await },
        )));
    }
    Ok(MetaHandle { addr, server, tasks: ServerTasks::new(shutdown, tasks) })
}

async fn ticker(env: Env, server: Arc<MetaServer>, interval: Duration, mut shutdown: Shutdown) {
    let period = (interval / 2).max(Duration::from_millis(5));
    loop {
        server.tick().await;
        tokio::select! {
            biased;
            _ = shutdown.wait() => return,
            _ = env.sleep(period) => {}
        }
    }
}
