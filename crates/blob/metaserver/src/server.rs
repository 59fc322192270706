//! The metadata server (FDS §2.2, §3.1): collects heartbeats, builds the
//! TLT, hands it to clients, and changes rows with the assignment protocol
//! (`rounds`). Its decisions are a replicated state (`machine`, design
//! 0007) kept by a runtime group of replicas (`blizzard meta --peers`), or
//! in memory by a single server, which then rebuilds the table from the
//! tractservers' reports after a restart (`replica`).
//!
//! Every replica listens on one address for its peers (the runtime's
//! frames) and for tractservers and clients (the blob protocol). Who
//! answers what:
//!
//! | request | leader | follower |
//! |---|---|---|
//! | `Heartbeat` | answered once leadership is confirmed (a quorum round at most `replica::confirmation_window` old): the answer extends the tractserver's lease | `NotLeader` |
//! | `GetTlt`, `ClusterParams` | from the applied state | from the applied state (a stale table is caught by row versions) |
//! | `ClusterStatus` | heartbeats and the applied state | `NotLeader` |
//! | `AcquireVolume`, `RenewVolume`, `ReleaseVolume` | proposed (`volumes`), once this leader has taken over (`ExtendAll` applied); `NotReady` before | `NotLeader` |
//! | `SetVolumeAccess`, `DropVolume`, `Revoke`, `AttachReader` | proposed (`access`), as leases are | `NotLeader` |
//! | `GetScope` | from the applied state | from the applied state (a caller takes only a newer table) |
//!
//! Phases, on the leader: `waiting` (no table served yet; built or
//! rebuilt by `rounds`), `ready` (the table is served; heartbeats keep
//! member state current and every round runs `plan`).
//!
//! Invariant (FDS §3.1): a new row version is given to clients only after
//! every tractserver of the old and new row has durably stored it, so a
//! client can never hold a version its tractservers do not know.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_core::limits::{tract_size_valid, NAME_LEN_MAX, REPLICATION_MAX};
use blizzard_core::tlt::Tlt;
use blizzard_core::{DiskClass, TsId};
use blizzard_env::{Env, Instant};
use blizzard_proto::{
    ClusterParams, ClusterStatus, ErrorCode, ErrorReply, FillProgress, Heartbeat, HeartbeatAction,
    HeartbeatReply, MemberStatus, Reply, Request,
};
use blizzard_replicated::proto::Replicated;
use blizzard_rpc::either::{Either, EitherService};
use blizzard_rpc::{
    serve, Blob, Caller, ConnCache, ServerLimits, ServerTasks, Service, Shutdown, ShutdownHandle,
};

use crate::machine::MetaReply;
use crate::plan::{assignment_is_stale, Member};
use crate::replica::{confirmation_window, GroupConfig, Replica, ReplicaError};
use crate::tlt_builder::row_counts;
use crate::volumes;

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
    /// A replica of a group (`--id`, `--peers`, `--data`); none: a single
    /// server keeping its state in memory.
    pub group: Option<GroupConfig>,
    /// Every volume lease a new leader inherits lasts at least this long
    /// from its takeover (design 0007).
    pub volume_lease_ttl: Duration,
    /// A single server's directory for what it cannot rebuild after a
    /// restart: access lists and revocations (`scope_store`). Without
    /// one it refuses to keep them. (A group keeps them in its log.)
    pub solo_data: Option<std::path::PathBuf>,
    /// A bug planted on purpose (the simulator shows its checks catch it);
    /// never set outside tests.
    pub plant: MetaPlant,
}

/// Bugs the simulator plants in the metadata service to show that its
/// checks catch them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MetaPlant {
    #[default]
    None,
    /// The leader changes a row's members without bumping its version, and
    /// the checks that would refuse it (`plan::check_change` in the round
    /// and in the replicated `Serve`) are off: one (row, version) names two
    /// memberships.
    ForgetRowBump,
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
            group: None,
            volume_lease_ttl: Duration::from_secs(10),
            solo_data: None,
            plant: MetaPlant::None,
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
    AssignFailed { id: TsId, error: blizzard_rpc::RpcError },
    #[error("replicated state: {0}")]
    Replica(String),
    #[error("starting the replica: {0}")]
    Start(#[from] blizzard_replicated::node::NodeError),
}

/// What the leader knows beyond the replicated state: heartbeats, and
/// when it started leading.
pub(crate) struct State {
    /// The term this replica leads in, once it took over (`rounds`).
    pub term: Option<u64>,
    pub members: BTreeMap<TsId, Member>,
    /// When this replica took over, or the TLT was first served, or this
    /// server last woke from a stall: silence is counted from no earlier
    /// than this, so neither a member that has not heartbeated to this
    /// leader yet nor every member at once after the server itself was
    /// paused is declared dead before it had `dead_after` to report.
    pub ready_since: Option<Instant>,
    pub last_recover: Option<Instant>,
    pub first_report: Option<Instant>,
    /// Members told to send their stored assignment with their next
    /// heartbeat: the one after that answers (`Member::stores_nothing`).
    pub asked: BTreeSet<TsId>,
    pub last_complaint: Option<Instant>,
    /// When the last quorum round that confirmed leadership started.
    pub confirmed: Option<Instant>,
}

pub struct MetaServer {
    pub(crate) env: Env,
    pub(crate) cfg: MetaConfig,
    /// Every version this lifetime hands out (row or table) is above this:
    /// its start time in milliseconds, shifted left 20 bits. A single
    /// server keeps no state, and one restarted right after a round failed
    /// part-way may never hear from the members that stored that round; its
    /// floors alone would then let it number a new round the same, so one
    /// (row, version) would name two memberships. Started later, it numbers
    /// above every earlier lifetime (unless that one handed out over a
    /// million versions per millisecond it lived, or the clock went back,
    /// where the floors still apply). A group's floors are replicated.
    pub(crate) version_base: u64,
    pub(crate) replica: Replica,
    pub(crate) state: Mutex<State>,
    /// Serializes rounds: one assignment round at a time.
    pub(crate) change: tokio::sync::Mutex<()>,
    /// One leadership confirmation at a time; heartbeats share it.
    confirming: tokio::sync::Mutex<()>,
    /// To the tractservers rounds push assignments to.
    pub(crate) conns: ConnCache,
    /// The scope table this replica enforces (`access`).
    pub(crate) scope: crate::access::ScopeCache,
}

pub(crate) use blizzard_env::lock;

fn err(code: ErrorCode, msg: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, msg)
}

fn validate(cfg: &MetaConfig) -> Result<(), MetaError> {
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
    Ok(())
}

impl MetaServer {
    pub fn new(env: Env, cfg: MetaConfig, replica: Replica) -> Result<MetaServer, MetaError> {
        validate(&cfg)?;
        let started_ms = env
            .clock
            .system_time()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0));
        Ok(MetaServer {
            version_base: started_ms.min(u64::MAX >> 21) << 20,
            env,
            cfg,
            replica,
            state: Mutex::new(State {
                term: None,
                members: BTreeMap::new(),
                ready_since: None,
                last_recover: None,
                first_report: None,
                asked: BTreeSet::new(),
                last_complaint: None,
                confirmed: None,
            }),
            change: tokio::sync::Mutex::new(()),
            confirming: tokio::sync::Mutex::new(()),
            conns: ConnCache::default(),
            scope: Default::default(),
        })
    }

    /// The TLT being served, once there is one (this replica's applied
    /// state).
    pub fn tlt(&self) -> Option<Arc<Tlt>> {
        self.replica.read(|s| s.tlt.clone())
    }

    /// Whether this replica leads and has taken over.
    pub fn is_leader(&self) -> bool {
        let term = lock(&self.state).term;
        term.is_some() && self.replica.leading_term() == term
    }

    /// This replica's view of its group, if it is one.
    pub fn group_status(&self) -> Option<blizzard_replicated::proto::Status> {
        self.replica.group_status()
    }

    pub(crate) fn wall_ms(&self) -> u64 {
        self.env
            .clock
            .system_time()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(0))
    }

    /// Logs `what` at most once per `every`.
    pub(crate) fn complain(&self, every: Duration, what: &str) {
        let now = self.env.now();
        let mut st = lock(&self.state);
        if st.last_complaint.is_none_or(|t| now.duration_since(t) >= every) {
            tracing::warn!("{what}");
            st.last_complaint = Some(now);
        }
    }

    pub(crate) fn not_leader(&self) -> ErrorReply {
        let (id, msg) = match self.replica.leader_hint() {
            Some((id, addr)) => {
                (id, format!("this metadata replica does not lead; replica {id} at {addr} does: ask it (give every replica to --meta)"))
            }
            None => (0, "this metadata replica does not lead, and no leader is known yet (an election is under way, or a majority of replicas is down): retry, or check `blizzard status`".to_string()),
        };
        ErrorReply { code: ErrorCode::NotLeader, current_version: id, message: msg }
    }

    /// Confirms leadership for a heartbeat answer (module header), sharing
    /// a recent confirmation.
    async fn confirm_leadership(&self) -> Result<(), ErrorReply> {
        if !self.is_leader() {
            return Err(self.not_leader());
        }
        let window = confirmation_window(self.cfg.dead_after, self.cfg.heartbeat_interval);
        let fresh = |st: &State, now: Instant| st.confirmed.is_some_and(|t| now.duration_since(t) < window);
        if fresh(&lock(&self.state), self.env.now()) {
            return Ok(());
        }
        let _one = self.confirming.lock().await;
        if fresh(&lock(&self.state), self.env.now()) {
            return Ok(());
        }
        let started = self.env.now();
        match self.replica.confirm().await {
            Ok(()) if self.is_leader() => {
                lock(&self.state).confirmed = Some(started);
                Ok(())
            }
            _ => Err(self.not_leader()),
        }
    }

    async fn heartbeat(&self, hb: Heartbeat) -> Result<Reply, ErrorReply> {
        if hb.addr.is_empty() || hb.addr.len() > NAME_LEN_MAX || hb.domain.len() > NAME_LEN_MAX {
            return Err(err(ErrorCode::BadRequest, "address or failure domain is empty or too long"));
        }
        self.confirm_leadership().await?;
        let now = self.env.now();
        let (tlt, dead) = self.replica.read(|s| (s.tlt.clone(), s.dead.contains(&hb.ts_id)));
        if let Some(tlt) = &tlt {
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
        let (action, asked, moved) = {
            let mut st = lock(&self.state);
            let domain = if hb.domain.is_empty() { hb.ts_id.to_string() } else { hb.domain.clone() };
            // Heartbeats carry the assignment only when asked: keep the last
            // one a member reported.
            let reported =
                hb.assignment.clone().or_else(|| st.members.get(&hb.ts_id).and_then(|m| m.reported.clone()));
            if reported.is_some() && st.first_report.is_none() {
                st.first_report = Some(now);
            }
            let asked = reported.is_none() && hb.assignment.is_none();
            // Its answer to our last ask: nothing stored. (A heartbeat not
            // asked for carries no assignment either, and says nothing.)
            let answered = st.asked.remove(&hb.ts_id);
            let stores_nothing = hb.assignment.is_none()
                && (answered || st.members.get(&hb.ts_id).is_some_and(|m| m.stores_nothing));
            if tlt.is_none() || asked {
                st.asked.insert(hb.ts_id);
            }
            st.members.insert(
                hb.ts_id,
                Member {
                    addr: hb.addr.clone(),
                    domain,
                    class: hb.class,
                    journal: (hb.journal_used, hb.journal_bytes),
                    last_heartbeat: now,
                    slots_total: hb.slots_total,
                    slots_used: hb.slots_used,
                    load: hb.load,
                    disk_mbps: hb.disk_mbps,
                    reported,
                    stores_nothing,
                    filled: hb.filled.clone(),
                    fill: hb.fill,
                },
            );
            // A member declared dead, or reporting rows at older versions than
            // the table's, may serve a client holding an old TLT what newer
            // writes have replaced: it must stop serving until a round has
            // given it its current assignment.
            let stale = tlt.as_ref().is_some_and(|t| {
                st.members
                    .get(&hb.ts_id)
                    .and_then(|m| m.reported.as_ref())
                    .is_some_and(|a| assignment_is_stale(t, hb.ts_id, a))
            });
            let action = if dead || stale { HeartbeatAction::StopServing } else { HeartbeatAction::Continue };
            // Back on a new address (or one the table lacked): clients learn it
            // from the next table. Served before this answer unless a round is
            // running (that round's successor serves it, `rounds`).
            let moved = tlt.as_ref().is_some_and(|t| {
                t.member_index(hb.ts_id).is_some_and(|i| t.members[i as usize].addr != hb.addr)
            });
            (action, asked, moved)
        };
        if moved {
            if let Ok(_round) = self.change.try_lock() {
                if let Err(e) = self.serve_moved().await {
                    tracing::warn!(error = %e, "could not serve a moved tractserver's address yet");
                }
            }
        }
        let ms = self.cfg.heartbeat_interval.as_millis().min(u32::MAX as u128) as u32;
        Ok(Reply::Heartbeat(HeartbeatReply {
            action,
            interval_ms: ms,
            // While no table is served the reports are what it is rebuilt
            // from; a leader new to this member asks for what it stores,
            // to judge it (a member that stores nothing has nothing to send).
            send_assignment: tlt.is_none() || asked,
            lease_ms: self.lease().as_millis().min(u32::MAX as u128) as u32,
            scope_version: self.replica.read(|s| s.scope.version),
        }))
    }

    /// How long a tractserver may serve after sending a heartbeat that was
    /// answered: well inside `dead_after`, so it has stopped serving (and
    /// cannot hand out data a newer row version has overwritten) by the
    /// time its rows are given to others.
    fn lease(&self) -> Duration {
        self.cfg.dead_after * 2 / 3
    }

    pub fn status(&self) -> ClusterStatus {
        let now = self.env.now();
        let now_ms = self.wall_ms();
        let (tlt, dead, filling, leases) = self
            .replica
            .read(|s| (s.tlt.clone(), s.dead.clone(), s.filling.clone(), volumes::listed(&s.leases, now_ms)));
        let leading = self.is_leader();
        let st = lock(&self.state);
        let (rows, primaries) = match &tlt {
            Some(t) => {
                let rows: Vec<Vec<u32>> = t.rows.iter().map(|r| r.members.clone()).collect();
                row_counts(t.members.len(), &rows)
            }
            None => (vec![], vec![]),
        };
        let mut ids: BTreeSet<TsId> = st.members.keys().copied().collect();
        if let Some(t) = &tlt {
            ids.extend(t.members.iter().map(|m| m.id));
        }
        let members = ids
            .into_iter()
            .map(|id| {
                let pos = tlt.as_ref().and_then(|t| t.member_index(id)).map(|i| i as usize);
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
                            alive: age < self.cfg.heartbeat_interval * 3 && !dead.contains(&id),
                            last_heartbeat_ms: age.as_millis() as u64,
                            slots_total: m.slots_total,
                            slots_used: m.slots_used,
                            load: m.load,
                            rows: r,
                            primaries: p,
                            dead: dead.contains(&id),
                            fill: m.fill,
                            class: m.class,
                            journal_used: m.journal.0,
                            journal_bytes: m.journal.1,
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
                        dead: dead.contains(&id),
                        fill: FillProgress::default(),
                        class: DiskClass::default(),
                        journal_used: 0,
                        journal_bytes: 0,
                    },
                }
            })
            .collect();
        let t = tlt.as_ref();
        ClusterStatus {
            phase: if !leading {
                "follower".into()
            } else if tlt.is_some() {
                "ready".into()
            } else if st.first_report.is_some() {
                "recovering".into()
            } else {
                "waiting".into()
            },
            cluster_id: t.map(|t| t.cluster_id).unwrap_or(0),
            tract_size: t.map(|t| t.tract_size).unwrap_or(self.cfg.tract_size),
            replication: t.map(|t| t.replication).unwrap_or(self.cfg.replication),
            tlt_version: t.map(|t| t.version).unwrap_or(0),
            tlt_rows: t.map(|t| t.rows.len() as u32).unwrap_or(0),
            sections: t.map(|t| t.sections.clone()).unwrap_or_default(),
            members,
            rows_filling: filling.values().filter(|f| !f.is_empty()).count() as u32,
            rows_degraded: t.map_or(0, |t| {
                t.rows
                    .iter()
                    .filter(|r| r.members.iter().any(|&m| dead.contains(&t.members[m as usize].id)))
                    .count() as u32
            }),
            leases,
        }
    }

    /// The cluster's state as Prometheus metrics.
    pub fn metrics_text(&self) -> String {
        let s = self.status();
        let count = |f: &dyn Fn(&MemberStatus) -> bool| s.members.iter().filter(|m| f(m)).count() as f64;
        let (up, dead) = (count(&|m| m.alive), count(&|m| m.dead));
        let down = s.members.len() as f64 - up - dead;
        let sum = |f: &dyn Fn(&FillProgress) -> u64| s.members.iter().map(|m| f(&m.fill) as f64).sum::<f64>();
        let group = self.group_status();
        blizzard_metrics::Text::new()
            .gauge(
                "blizzard_meta_leader",
                "1 if this metadata replica leads (a single server always does), else 0.",
                self.is_leader() as u8 as f64,
            )
            .gauge(
                "blizzard_meta_term",
                "This replica's Raft term (0 for a single server).",
                group.as_ref().map_or(0.0, |g| g.term as f64),
            )
            .gauge(
                "blizzard_meta_applied_index",
                "Index of the last replicated entry this replica applied (-1: none, or a single server).",
                group.as_ref().and_then(|g| g.applied).map_or(-1.0, |a| a as f64),
            )
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

    /// A volume lease request (`volumes`): through the log, on a leader
    /// that has taken over (every lease its predecessors granted extended
    /// by `ExtendAll`, so none is given away early).
    /// Whether this replica may propose a change a client asked for: it
    /// leads, and has taken over (`ExtendAll` applied).
    pub(crate) fn ready_to_propose(&self) -> Result<(), ErrorReply> {
        let Some(term) = self.replica.leading_term() else { return Err(self.not_leader()) };
        if lock(&self.state).term != Some(term) {
            return Err(err(
                ErrorCode::NotReady,
                "this metadata replica is taking over as leader; retry shortly",
            ));
        }
        Ok(())
    }

    /// A lease request from `peer` (the name on its certificate, "" for none).
    async fn volume_lease(&self, req: Request, peer: &str) -> Result<Reply, ErrorReply> {
        self.ready_to_propose()?;
        let now_ms = self.wall_ms();
        let Some(op) = volumes::op_for(&req, now_ms, peer) else {
            return Err(err(ErrorCode::BadRequest, "not a lease request"));
        };
        let (blob, op) = op?;
        let caller = match &req {
            Request::AcquireVolume { holder, .. } | Request::RenewVolume { holder, .. } => holder.as_str(),
            _ => "",
        };
        match self.replica.propose(&op).await {
            Ok(MetaReply::Lease(o)) => Ok(Reply::VolumeLease(volumes::reply_for(blob, caller, &o, now_ms))),
            Ok(MetaReply::Done) => Ok(Reply::Done),
            Ok(MetaReply::Refused(why)) => Err(err(ErrorCode::BadRequest, why)),
            Err(ReplicaError::NotLeader(_)) => Err(self.not_leader()),
            Err(ReplicaError::Refused(why)) => Err(err(ErrorCode::Internal, why)),
        }
    }

    async fn handle(&self, req: Request, caller: &Caller) -> Result<Reply, ErrorReply> {
        match req {
            Request::Ping => Ok(Reply::Done),
            Request::Heartbeat(hb) => self.heartbeat(hb).await,
            // Always the whole table: a single server rebuilt after a
            // restart may reuse a version number for a table that differs
            // in addresses, so "you are current" cannot be trusted on the
            // version alone. Clients fetch only when something is stale.
            Request::GetTlt { have_version: _ } => match self.tlt() {
                Some(t) => Ok(Reply::Tlt(Some((*t).clone()))),
                None if self.is_leader() => {
                    Err(err(ErrorCode::NotReady, "the cluster has no TLT yet; waiting for tractservers"))
                }
                None => Err(self.not_leader()),
            },
            Request::ClusterStatus if self.is_leader() => Ok(Reply::ClusterStatus(self.status())),
            Request::ClusterStatus => Err(self.not_leader()),
            Request::AcquireVolume { .. } | Request::RenewVolume { .. } | Request::ReleaseVolume { .. } => {
                let peer = caller.peer().map(|p| p.name.clone()).unwrap_or_default();
                self.volume_lease(req, &peer).await
            }
            Request::SetVolumeAccess { .. }
            | Request::DropVolume { .. }
            | Request::Revoke { .. }
            | Request::AttachReader { .. } => {
                let peer = caller.peer().map(|p| p.name.clone()).unwrap_or_default();
                self.change_scope(req, &peer).await
            }
            Request::GetScope { have_version } => Ok(self.get_scope(have_version)),
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
        caller: Caller,
    ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
        async move { (self.handle(req, &caller).await, Bytes::new()) }.boxed()
    }
}

/// The service as peers reach it: on an authenticated cluster, each
/// request runs only if the peer's role may send it
/// (`blizzard_proto::authz`: only tractservers register and heartbeat,
/// only metadata replicas change the table, only admins change access
/// lists) and on the volumes its certificate's scope allows
/// (`blizzard_proto::scope`: a client's leases on the volumes it may
/// write); the runtime's own frames are checked by the runtime
/// (`blizzard_replicated::authz`).
fn authorized(server: Arc<MetaServer>) -> Arc<dyn Service<Blob>> {
    blizzard_rpc::authz::Scoped::wrap(server.clone(), server, "metadata server")
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
        self.server.replica.shutdown().await;
    }

    pub async fn wait(self) {
        self.tasks.wait().await;
        self.server.replica.shutdown().await;
    }
}

/// Binds, starts the replica (of a group, or alone) and the round ticker.
pub async fn start(env: Env, cfg: MetaConfig) -> Result<MetaHandle, MetaError> {
    validate(&cfg)?;
    let listener =
        env.bind(&cfg.listen).await.map_err(|error| MetaError::Bind { addr: cfg.listen.clone(), error })?;
    let addr = listener.local_addr();
    let (replica, front) = match &cfg.group {
        None => {
            let store = match &cfg.solo_data {
                Some(dir) => {
                    Some(crate::scope_store::ScopeStore::open(&env, dir).await.map_err(MetaError::Config)?)
                }
                None => None,
            };
            (Replica::solo(cfg.plant, store), None)
        }
        Some(g) => {
            let (r, front) = Replica::group(&env, g, cfg.plant).await?;
            (r, Some(front))
        }
    };
    let server = Arc::new(MetaServer::new(env.clone(), cfg.clone(), replica)?);
    match &cfg.group {
        Some(g) => tracing::info!(%addr, id = g.id, replicas = g.peers.len(), "metadata replica listening"),
        None => tracing::info!(%addr, "metadata server listening"),
    }
    let (shutdown, rx) = ShutdownHandle::new();
    let served = match front {
        // One address for the replica's peers and its clients (module header).
        Some(front) => {
            let both: Arc<dyn Service<Either<Replicated, Blob>>> =
                Arc::new(EitherService { left: front, right: authorized(server.clone()) });
            tokio::spawn(serve(env.clone(), listener, both, ServerLimits::default(), rx.clone()))
        }
        None => tokio::spawn(serve(
            env.clone(),
            listener,
            authorized(server.clone()),
            ServerLimits::default(),
            rx.clone(),
        )),
    };
    let mut tasks =
        vec![served, tokio::spawn(ticker(env.clone(), server.clone(), cfg.heartbeat_interval, rx.clone()))];
    if let Some(m) = &cfg.metrics_listen {
        let l = env.bind_plain(m).await.map_err(|error| MetaError::Bind { addr: m.clone(), error })?;
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
        // Revocations the log brought close the connections they name.
        server.scope_table();
        tokio::select! {
            biased;
            _ = shutdown.wait() => return,
            _ = env.sleep(period) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_proto::Opcode;
    use blizzard_replicated::proto::{OP_APPEND, OP_READ, OP_SNAPSHOT, OP_STATUS, OP_SUBMIT, OP_VOTE};
    use blizzard_rpc::either::OneOf;
    use blizzard_rpc::Protocol;

    /// One listener, two protocols (`blizzard_rpc::either`): no opcode is
    /// both, and each side's errors reach its callers in its own form.
    #[test]
    fn the_runtime_and_the_blob_protocol_share_a_listener() {
        let runtime = [OP_APPEND, OP_VOTE, OP_SNAPSHOT, OP_SUBMIT, OP_READ, OP_STATUS];
        for op in runtime {
            assert!(Opcode::from_u16(op).is_none(), "opcode {op:#x} is in both protocols");
        }
        for op in Opcode::ALL {
            assert!(!runtime.contains(&(op as u16)));
        }
        let e = ErrorReply { code: ErrorCode::NotLeader, current_version: 2, message: "ask 2".into() };
        let blob = <Either<Replicated, Blob>>::encode_response(&Ok(OneOf::Right(Err(e.clone()))));
        assert_eq!(Blob::decode_response(Opcode::Heartbeat as u16, &blob), Some(Ok(Err(e.clone()))));
        let raft = <Either<Replicated, Blob>>::encode_response(&Ok(OneOf::Left(Err(e.clone()))));
        assert_eq!(Replicated::decode_response(OP_STATUS, &raft), Some(Ok(Err(e))));
    }
}
