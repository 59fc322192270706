//! One member of a replica group: the log store, the state machine and
//! openraft, behind one listening address that serves its peers (Raft's
//! messages) and its clients (operations and reads) alike.
//!
//! The request path of an update, on the leader:
//!
//! 1. A `Submit` frame arrives; its ops' bytes are slices of the frame's
//!    data part (`proto::decode_ops`).
//! 2. Each op joins the **batcher**'s queue. The batcher takes everything
//!    queued (up to `max_batch_ops` / `max_batch_bytes`) into one `Batch`,
//!    one Raft entry, and hands it to openraft without waiting for it to
//!    commit (`client_write_ff`): entries stay in submission order. At
//!    most `max_inflight_batches` are handed over and not yet committed;
//!    while they replicate, the next batch fills up (batching, §5).
//! 3. openraft appends the entry (the log store writes the ops' bytes as
//!    they are), replicates it (the network sends them as they are),
//!    commits and applies it (`machine`), and the batcher's waiter hands
//!    each op its reply.
//!
//! Reads: a `Read` joins the read batcher's queue; each round confirms
//! leadership once for every read queued before it started (ReadIndex:
//! a heartbeat quorum) and waits until everything committed before then
//! is applied, then answers them all from the state machine:
//! linearizable, at one heartbeat round per batch of reads.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use openraft::async_runtime::watch::WatchReceiver;
use openraft::error::{ClientWriteError, RaftError};
use openraft::impls::ProgressResponder;
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, VoteRequest};
use openraft::{ReadPolicy, ServerState, SnapshotPolicy};
use tokio::sync::{mpsc, oneshot, Semaphore};

use blizzard_core::crc::crc32c;
use blizzard_env::Env;
use blizzard_proto::{ErrorCode, ErrorReply};
use blizzard_rpc::authz::Authorized;
use blizzard_rpc::{serve, Caller, Conn, ServerLimits, ServerTasks, Shutdown, ShutdownHandle};

mod status;

use self::status::{metrics_text, status_of};
use crate::log::{LogConfig, LogStore};
use crate::machine::snapshot::SNAPSHOT_LEN_MAX;
use crate::machine::{Machine, MachineConfig};
use crate::net::Network;
use crate::proto::{decode_entries, decode_ops, AppendResult, Replicated, Reply, Request, Status};
use crate::service::Service;
use crate::types::{
    Batch, LogId, Member, NodeId, Op, OpKind, OpReply, Raft, SnapshotMeta, Vote, BATCH_OPS_MAX,
};

/// Raft's timing (milliseconds).
#[derive(Clone, Debug)]
pub struct Timing {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing { heartbeat_ms: 50, election_min_ms: 150, election_max_ms: 300 }
    }
}

/// Everything a member is started with.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub id: NodeId,
    /// Where to listen (may differ from `members[id]`, e.g. `0.0.0.0:P`).
    pub listen: String,
    /// Every member's id and address, this one's included: the same list on
    /// every member (its hash names the cluster).
    pub members: BTreeMap<NodeId, String>,
    pub data_dir: PathBuf,
    pub timing: Timing,
    /// Take a snapshot after this many entries since the last.
    pub snapshot_every: u64,
    /// Many client operations per Raft entry (off: one each).
    pub batching: bool,
    pub max_batch_ops: usize,
    pub max_batch_bytes: usize,
    /// Batches handed to Raft and not yet committed, at most: while they
    /// replicate, new operations queue and form the next, larger batch.
    /// (Handing each batch over as soon as it formed left no queue to
    /// batch: about 1.03 operations per entry under 64 clients.)
    pub max_inflight_batches: usize,
    /// Copy each operation's bytes out of the frame it arrived in, and
    /// join an entry's bodies before writing and sending (the zero-copy
    /// path turned off, for the benchmark's comparison).
    pub copy_payloads: bool,
    pub machine: MachineConfig,
    pub log: LogConfig,
    /// How long a new member other than the lowest-numbered waits for the
    /// group to be initialized before it initializes it itself.
    pub init_grace: Duration,
    /// Where to serve `GET /metrics` (Prometheus text), if anywhere.
    pub metrics_listen: Option<String>,
}

impl NodeConfig {
    pub fn new(id: NodeId, members: BTreeMap<NodeId, String>, data_dir: PathBuf) -> NodeConfig {
        let listen = members.get(&id).cloned().unwrap_or_default();
        NodeConfig {
            id,
            listen,
            members,
            data_dir,
            timing: Timing::default(),
            snapshot_every: 10_000,
            batching: true,
            max_batch_ops: 1024,
            max_batch_bytes: 4 << 20,
            max_inflight_batches: 2,
            copy_payloads: false,
            machine: MachineConfig::default(),
            log: LogConfig::default(),
            init_grace: Duration::from_secs(5),
            metrics_listen: None,
        }
    }
}

/// The id of the cluster a member list makes: the same on every member
/// started with the same list, different for any other list.
pub fn cluster_id(members: &BTreeMap<NodeId, String>) -> u128 {
    let text: String = members.iter().map(|(id, a)| format!("{id}={a};")).collect();
    let mut id = 0u128;
    for i in 0..4u8 {
        let mut salted = vec![i, b'#'];
        salted.extend_from_slice(text.as_bytes());
        id = (id << 32) | crc32c(&salted) as u128;
    }
    id
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("member {id} is not in the member list ({members}): give --id one of its ids")]
    NotAMember { id: NodeId, members: String },
    #[error("a group needs 1 to {max} members, not {n}")]
    Members { n: usize, max: usize },
    #[error("{0}")]
    Log(String),
    #[error("opening the state machine in {dir}: {error}")]
    Machine { dir: String, error: std::io::Error },
    #[error("invalid Raft timing: {0}")]
    Config(String),
    #[error("starting Raft: {0}")]
    Raft(String),
    #[error("cannot listen on {addr}: {error} (is another process using it?)")]
    Listen { addr: String, error: std::io::Error },
}

/// An op waiting for its entry to apply.
struct Pending {
    op: Op,
    reply: oneshot::Sender<Result<OpReply, Reply>>,
}

/// A read waiting for its round.
struct PendingRead {
    query: Bytes,
    reply: oneshot::Sender<Reply>,
}

/// A snapshot being received, chunk by chunk.
struct Incoming {
    vote: Vote,
    last: Option<LogId>,
    total: u64,
    buf: Vec<u8>,
}

struct Inner<S: Service> {
    env: Env,
    cfg: NodeConfig,
    cluster: u128,
    raft: openraft::Raft<Raft, Machine<S>>,
    machine: Machine<S>,
    log: LogStore,
    submit: mpsc::Sender<Pending>,
    reads: mpsc::Sender<PendingRead>,
    incoming: Mutex<Option<Incoming>>,
    /// The session of this member's own updates ([`Node::propose`]).
    local: Mutex<LocalSession>,
}

/// Whether a member listens itself or is hosted (`Node::start_hosted`).
enum Listen {
    Own,
    Hosted,
}

/// The session a member's own updates go in, numbered like a client's.
#[derive(Default)]
struct LocalSession {
    id: u64,
    next_seq: u64,
    outstanding: std::collections::BTreeSet<u64>,
}

/// Why [`Node::propose`] did not apply an update.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// Not the leader (any more): the update did not apply, or it may
    /// still commit under the next leader (it was in the log when this
    /// member lost leadership). Nothing is retried.
    #[error("this member is not the leader (the leader is {})", leader.as_ref().map_or("unknown".to_string(), |(id, a)| format!("member {id} at {a}")))]
    NotLeader { leader: Option<(NodeId, String)> },
    #[error("the service refused the update: {0}")]
    Rejected(String),
    #[error("the member is stopping")]
    Stopping,
}

/// A running member. Dropping it does not stop it: call [`Node::stop`].
pub struct Node<S: Service> {
    inner: Arc<Inner<S>>,
    tasks: Mutex<Option<ServerTasks>>,
    /// The address it listens on (the listener's own, e.g. with the port
    /// the system picked).
    pub addr: String,
}

/// Ops queued for the batcher before submitters wait.
const SUBMIT_QUEUE: usize = 64 << 10;

impl<S: Service> Node<S> {
    /// Opens the member's data, starts Raft, listens, and (on a group that
    /// was never started) initializes the group with its member list.
    pub async fn start(env: Env, cfg: NodeConfig, service: Arc<S>) -> Result<Node<S>, NodeError> {
        Ok(Self::open(env, cfg, service, Listen::Own).await?.0)
    }

    /// As [`Node::start`], but listening is left to the caller: the
    /// returned service answers this member's frames (its peers' and its
    /// clients'), for a server that hosts them beside a protocol of its
    /// own on one address (the metadata server, design 0007). `cfg.listen`
    /// is not used; `members[id]` must reach that server.
    pub async fn start_hosted(
        env: Env,
        cfg: NodeConfig,
        service: Arc<S>,
    ) -> Result<(Node<S>, Arc<dyn blizzard_rpc::Service<Replicated>>), NodeError> {
        Self::open(env, cfg, service, Listen::Hosted).await
    }

    async fn open(
        env: Env,
        cfg: NodeConfig,
        service: Arc<S>,
        listen: Listen,
    ) -> Result<(Node<S>, Arc<dyn blizzard_rpc::Service<Replicated>>), NodeError> {
        let members_text =
            || cfg.members.iter().map(|(i, a)| format!("{i}={a}")).collect::<Vec<_>>().join(",");
        if !cfg.members.contains_key(&cfg.id) {
            return Err(NodeError::NotAMember { id: cfg.id, members: members_text() });
        }
        if cfg.members.is_empty() || cfg.members.len() > crate::codec::MEMBERS_MAX {
            return Err(NodeError::Members { n: cfg.members.len(), max: crate::codec::MEMBERS_MAX });
        }
        crate::rt::seed_thread_rng(env.random_u64());
        let cluster = cluster_id(&cfg.members);
        let log_cfg = LogConfig { copy_payloads: cfg.copy_payloads, ..cfg.log.clone() };
        let log = LogStore::open(&env, &cfg.data_dir, cluster, cfg.id, log_cfg)
            .await
            .map_err(|e| NodeError::Log(format!("{e} (members given: {})", members_text())))?;
        let machine = Machine::open(&env, &cfg.data_dir, service, cfg.machine.clone())
            .await
            .map_err(|error| NodeError::Machine { dir: cfg.data_dir.display().to_string(), error })?;
        let t = &cfg.timing;
        let config = openraft::Config {
            cluster_name: format!("{cluster:032x}"),
            heartbeat_interval: t.heartbeat_ms,
            election_timeout_min: t.election_min_ms,
            election_timeout_max: t.election_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(cfg.snapshot_every.max(1)),
            // Followers this far behind get a snapshot instead.
            max_in_snapshot_log_to_keep: cfg.snapshot_every.clamp(1, 10_000),
            install_snapshot_timeout: 10_000,
            enable_pre_vote: Some(true),
            // A restarted leader holds an election like anyone else. With
            // openraft's default it took its old term up again at once,
            // and its linearizable reads then waited only for its commit
            // point as saved before the crash, which the log saves lazily
            // (`log`): the simulator caught a read that missed writes
            // acknowledged after that point. A new term's first entry
            // (the leader's no-op) is what every read waits for now.
            enable_leader_restore: Some(false),
            max_payload_entries: 256,
            ..Default::default()
        }
        .validate()
        .map_err(|e| NodeError::Config(e.to_string()))?;
        let raft = openraft::Raft::new(
            cfg.id,
            Arc::new(config),
            Network::new(&env, cluster, cfg.id, cfg.copy_payloads),
            log.clone(),
            machine.clone(),
        )
        .await
        .map_err(|e| NodeError::Raft(e.to_string()))?;

        let listener = match listen {
            Listen::Own => Some(
                env.bind(&cfg.listen)
                    .await
                    .map_err(|error| NodeError::Listen { addr: cfg.listen.clone(), error })?,
            ),
            Listen::Hosted => None,
        };
        let addr = match &listener {
            Some(l) => l.local_addr(),
            None => cfg.members.get(&cfg.id).cloned().unwrap_or_default(),
        };
        let (submit, submit_rx) = mpsc::channel(SUBMIT_QUEUE);
        let (reads, reads_rx) = mpsc::channel(SUBMIT_QUEUE);
        let inner = Arc::new(Inner {
            env: env.clone(),
            cfg,
            cluster,
            raft,
            machine,
            log,
            submit,
            reads,
            incoming: Mutex::new(None),
            local: Mutex::new(LocalSession::default()),
        });
        let (shutdown_handle, shutdown) = ShutdownHandle::new();
        // Roles are checked on authenticated connections (`authz`): a group
        // hosted by a server takes client operations only from members.
        let allows = match listener {
            Some(_) => crate::authz::allows_own,
            None => crate::authz::allows_hosted,
        };
        let service = Authorized::<Replicated>::wrap(
            Arc::new(Front { inner: inner.clone() }),
            allows,
            "runtime member",
        );
        let mut tasks = vec![
            tokio::spawn(batcher(inner.clone(), submit_rx, shutdown.clone())),
            tokio::spawn(read_rounds(inner.clone(), reads_rx, shutdown.clone())),
        ];
        if let Some(l) = listener {
            let served = serve(env.clone(), l, service.clone(), ServerLimits::default(), shutdown.clone());
            tasks.push(tokio::spawn(served));
        }
        if let Some(addr) = inner.cfg.metrics_listen.clone() {
            let l = env.bind_plain(&addr).await.map_err(|error| NodeError::Listen { addr, error })?;
            let for_metrics = inner.clone();
            let render: blizzard_metrics::Render = Arc::new(move || metrics_text(&for_metrics));
            let mut stop = shutdown.clone();
            tasks.push(tokio::spawn(blizzard_metrics::serve(env.clone(), l, render, async move {
                stop.wait().await
            })));
        }
        let node = Node { inner, tasks: Mutex::new(Some(ServerTasks::new(shutdown_handle, tasks))), addr };
        node.initialize_if_new().await?;
        Ok((node, service))
    }

    /// On a member that has never been part of a group: the member with
    /// the lowest id initializes the group with the member list at once;
    /// the others wait to hear from it, and initialize with the same list
    /// themselves only if nobody did within `init_grace` (the lowest is
    /// down at first start). openraft allows several members to
    /// initialize with the same list, but several candidates of one term
    /// at once can stall an election (each voter's lease on the first
    /// leader it saw outlives its step-down), so one goes first.
    async fn initialize_if_new(&self) -> Result<(), NodeError> {
        let inner = &self.inner;
        let initialized =
            || async { inner.raft.is_initialized().await.map_err(|e| NodeError::Raft(e.to_string())) };
        if initialized().await? {
            return Ok(());
        }
        let lowest = inner.cfg.members.keys().next().copied() == Some(inner.cfg.id);
        if !lowest {
            let inner2 = self.inner.clone();
            let env = inner.env.clone();
            tokio::spawn(async move {
                env.sleep(inner2.cfg.init_grace).await;
                if let Ok(false) = inner2.raft.is_initialized().await {
                    tracing::warn!(id = inner2.cfg.id, grace = ?inner2.cfg.init_grace, "no member initialized the group; initializing it here");
                    let _ = initialize(&inner2).await;
                }
            });
            return Ok(());
        }
        initialize(inner).await
    }

    pub fn raft_handle(&self) -> openraft::Raft<Raft, Machine<S>> {
        self.inner.raft.clone()
    }

    pub fn raft(&self) -> &openraft::Raft<Raft, Machine<S>> {
        &self.inner.raft
    }

    pub fn machine(&self) -> &Machine<S> {
        &self.inner.machine
    }

    pub fn log(&self) -> &LogStore {
        &self.inner.log
    }

    pub fn cluster(&self) -> u128 {
        self.inner.cluster
    }

    /// This member's view of the group.
    pub fn status(&self) -> Status {
        status_of(&self.inner)
    }

    /// The term this member leads in, if it believes it leads.
    pub fn leading_term(&self) -> Option<u64> {
        let m = self.inner.raft.metrics().borrow_watched().clone();
        (m.state == ServerState::Leader).then_some(m.current_term)
    }

    /// The leader as far as this member knows (not itself).
    pub fn leader_hint(&self) -> Option<(NodeId, String)> {
        match leader_hint(&self.inner) {
            Reply::NotLeader { leader } => leader,
            _ => None,
        }
    }

    /// Confirms this member still leads (a heartbeat quorum, ReadIndex) and
    /// waits until everything committed before the call is applied here.
    pub async fn confirm_leadership(&self) -> Result<(), ProposeError> {
        match self.inner.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
            Ok(_) => Ok(()),
            Err(e) => Err(match e.api_error() {
                Some(openraft::error::LinearizableReadError::ForwardToLeader(f)) => ProposeError::NotLeader {
                    leader: f.leader_id.zip(f.leader_node.as_ref().map(|n| n.addr.clone())),
                },
                _ => ProposeError::NotLeader { leader: self.leader_hint() },
            }),
        }
    }

    /// Applies an update of the service through the log, from this member
    /// (which must lead): the server a service runs in proposes its own
    /// decisions this way (design 0007). The update goes in this member's
    /// own session, so a retry a peer's duplicate delivery causes is
    /// answered once; this call itself never retries: on `NotLeader` the
    /// update did not apply or may still (see [`ProposeError`]).
    pub async fn propose(&self, update: Bytes) -> Result<Bytes, ProposeError> {
        if !self.inner.raft.is_leader() {
            return Err(ProposeError::NotLeader { leader: self.leader_hint() });
        }
        for _ in 0..2 {
            let session = self.local_session().await?;
            let (seq, acked_below) = {
                let mut l = lock_local(&self.inner.local);
                l.next_seq += 1;
                let seq = l.next_seq;
                l.outstanding.insert(seq);
                (seq, l.outstanding.first().copied().unwrap_or(seq))
            };
            let op = Op { session, seq, acked_below, kind: OpKind::Update(update.clone()) };
            let r = self.submit_local(op).await;
            lock_local(&self.inner.local).outstanding.remove(&seq);
            match r? {
                OpReply::Applied(b) => return Ok(b),
                // Forgotten (a long-lived leader's session evicted): never
                // applied, so a new session may send it again.
                OpReply::SessionExpired => lock_local(&self.inner.local).id = 0,
                OpReply::Rejected(why) => return Err(ProposeError::Rejected(why)),
                other => return Err(ProposeError::Rejected(format!("unexpected reply {other:?}"))),
            }
        }
        Err(ProposeError::Rejected("the member's session expired twice in a row".into()))
    }

    async fn local_session(&self) -> Result<u64, ProposeError> {
        let id = lock_local(&self.inner.local).id;
        if id != 0 {
            return Ok(id);
        }
        let op = Op { session: 0, seq: 0, acked_below: 0, kind: OpKind::OpenSession };
        match self.submit_local(op).await? {
            OpReply::SessionOpened(id) => {
                let mut l = lock_local(&self.inner.local);
                *l = LocalSession { id, next_seq: 0, outstanding: Default::default() };
                Ok(id)
            }
            other => Err(ProposeError::Rejected(format!("opening a session: {other:?}"))),
        }
    }

    async fn submit_local(&self, op: Op) -> Result<OpReply, ProposeError> {
        let (tx, rx) = oneshot::channel();
        self.inner.submit.send(Pending { op, reply: tx }).await.map_err(|_| ProposeError::Stopping)?;
        match rx.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(Reply::NotLeader { leader })) => Err(ProposeError::NotLeader { leader }),
            Ok(Err(other)) => Err(ProposeError::Rejected(format!("{other:?}"))),
            Err(_) => Err(ProposeError::NotLeader { leader: self.leader_hint() }),
        }
    }

    /// Stops serving and shuts Raft down (what it had made durable stays).
    pub async fn stop(self) {
        self.shutdown().await;
    }

    /// As [`Node::stop`], for a member shared by reference (a hosted one);
    /// a second call does nothing.
    pub async fn shutdown(&self) {
        let tasks = match self.tasks.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(t) = tasks {
            t.stop().await;
            let _ = self.inner.raft.shutdown().await;
        }
    }
}

async fn initialize<S: Service>(inner: &Inner<S>) -> Result<(), NodeError> {
    let members: BTreeMap<NodeId, Member> =
        inner.cfg.members.iter().map(|(id, addr)| (*id, Member { addr: addr.clone() })).collect();
    match inner.raft.initialize(members).await {
        Ok(()) => {
            tracing::info!(id = inner.cfg.id, members = inner.cfg.members.len(), "initialized a new group");
            Ok(())
        }
        // Another member's log reached it first: it is a member already.
        Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Ok(()),
        Err(e) => Err(NodeError::Raft(format!("initializing the group: {e}"))),
    }
}

/// Who leads, as far as this member knows (for `NotLeader`).
fn leader_hint<S: Service>(inner: &Inner<S>) -> Reply {
    let m = inner.raft.metrics().borrow_watched().clone();
    let leader = m
        .current_leader
        .filter(|id| *id != inner.cfg.id)
        .and_then(|id| m.membership_config.membership().get_node(&id).map(|n| (id, n.addr.clone())));
    Reply::NotLeader { leader }
}

fn forward_reply(f: &openraft::error::ForwardToLeader<Raft>) -> Reply {
    Reply::NotLeader { leader: f.leader_id.zip(f.leader_node.as_ref().map(|n| n.addr.clone())) }
}

/// Takes queued ops into entries, in order (module header, step 2).
async fn batcher<S: Service>(inner: Arc<Inner<S>>, mut rx: mpsc::Receiver<Pending>, mut stop: Shutdown) {
    let max_ops = if inner.cfg.batching { inner.cfg.max_batch_ops.clamp(1, BATCH_OPS_MAX) } else { 1 };
    // Without batching nothing waits for a slot: one operation per entry,
    // as many in flight as the clients send.
    let slots = inner.cfg.batching.then(|| Arc::new(Semaphore::new(inner.cfg.max_inflight_batches.max(1))));
    loop {
        let first = tokio::select! {
            biased;
            _ = stop.wait() => return,
            p = rx.recv() => p,
        };
        let Some(first) = first else { return };
        // Operations arriving while every slot is taken wait in the queue
        // and join this batch.
        let slot = match &slots {
            Some(s) => {
                let acquired = tokio::select! {
                    biased;
                    _ = stop.wait() => return,
                    p = s.clone().acquire_owned() => p,
                };
                acquired.ok()
            }
            None => None,
        };
        let mut bytes = op_len(&first.op);
        let mut batch = vec![first];
        while batch.len() < max_ops && bytes < inner.cfg.max_batch_bytes {
            match rx.try_recv() {
                Ok(p) => {
                    bytes += op_len(&p.op);
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let (ops, waiters): (Vec<Op>, Vec<_>) = batch.into_iter().map(|p| (p.op, p.reply)).unzip();
        let (responder, committed, done) = ProgressResponder::new();
        // The slot is free once the entry commits (or fails: the responder
        // is then dropped, and so is the commit sender).
        tokio::spawn(async move {
            let _ = committed.await;
            drop(slot);
        });
        if let Err(e) = inner.raft.client_write_ff(Batch { ops }, Some(responder)).await {
            tracing::error!(error = %e, "Raft stopped; failing the batch");
            for w in waiters {
                let _ = w.send(Err(Reply::NotLeader { leader: None }));
            }
            continue;
        }
        let hint = inner.clone();
        tokio::spawn(async move {
            let outcome = done.await;
            match outcome {
                Ok(Ok(resp)) => {
                    let mut replies = resp.data.replies.into_iter();
                    for w in waiters {
                        let r =
                            replies.next().unwrap_or(OpReply::Rejected("no reply for this operation".into()));
                        let _ = w.send(Ok(r));
                    }
                }
                Ok(Err(ClientWriteError::ForwardToLeader(f)))
                | Ok(Err(ClientWriteError::LogEntryDiscarded(f))) => {
                    // Not committed here, or unknown (a new leader may still
                    // commit it): the client retries with the same numbers,
                    // and its session keeps that exactly once.
                    for w in waiters {
                        let _ = w.send(Err(forward_reply(&f)));
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "batch refused");
                    for w in waiters {
                        let _ = w.send(Err(leader_hint(&hint)));
                    }
                }
                Err(_) => {
                    for w in waiters {
                        let _ = w.send(Err(leader_hint(&hint)));
                    }
                }
            }
        });
    }
}

fn op_len(op: &Op) -> usize {
    match &op.kind {
        OpKind::Update(b) => b.len() + 32,
        _ => 32,
    }
}

/// Answers reads in rounds (module header).
async fn read_rounds<S: Service>(
    inner: Arc<Inner<S>>,
    mut rx: mpsc::Receiver<PendingRead>,
    mut stop: Shutdown,
) {
    loop {
        let first = tokio::select! {
            biased;
            _ = stop.wait() => return,
            r = rx.recv() => r,
        };
        let Some(first) = first else { return };
        let mut round = vec![first];
        while let Ok(r) = rx.try_recv() {
            round.push(r);
        }
        match inner.raft.ensure_linearizable(ReadPolicy::ReadIndex).await {
            Ok(_) => {
                for r in round {
                    let res = inner.machine.read(&r.query).await;
                    let _ = r.reply.send(Reply::ReadDone(res));
                }
            }
            Err(e) => {
                let reply = match e.api_error() {
                    Some(openraft::error::LinearizableReadError::ForwardToLeader(f)) => forward_reply(f),
                    _ => leader_hint(&inner),
                };
                for r in round {
                    let _ = r.reply.send(reply.clone());
                }
            }
        }
    }
}

/// The listener's side: peers' Raft messages and clients' requests.
struct Front<S: Service> {
    inner: Arc<Inner<S>>,
}

fn err(code: ErrorCode, message: impl Into<String>) -> ErrorReply {
    ErrorReply::new(code, message)
}

impl<S: Service> Front<S> {
    fn check_cluster(&self, cluster: u128) -> Result<(), ErrorReply> {
        if cluster == self.inner.cluster {
            return Ok(());
        }
        Err(err(
            ErrorCode::WrongCluster,
            format!(
                "member {} belongs to cluster {:032x} (members {:?}), the sender to {cluster:032x}: start every member with the same --peers",
                self.inner.cfg.id, self.inner.cluster, self.inner.cfg.members
            ),
        ))
    }

    async fn handle(&self, req: Request, data: Bytes) -> Result<Reply, ErrorReply> {
        let inner = &self.inner;
        let fatal =
            |e: &dyn std::fmt::Display| err(ErrorCode::NotReady, format!("Raft is not running here: {e}"));
        match req {
            Request::Append { cluster, vote, prev, commit, count, heads } => {
                self.check_cluster(cluster)?;
                let entries = decode_entries(count, &heads, &data)
                    .map_err(|e| err(ErrorCode::BadRequest, format!("append entries: {e}")))?;
                let rpc = AppendEntriesRequest { vote, prev_log_id: prev, entries, leader_commit: commit };
                let r = inner.raft.append_entries(rpc).await.map_err(|e| fatal(&e))?;
                Ok(Reply::Appended(match r {
                    AppendEntriesResponse::Success => AppendResult::Success,
                    AppendEntriesResponse::PartialSuccess(id) => AppendResult::PartialSuccess(id),
                    AppendEntriesResponse::Conflict => AppendResult::Conflict,
                    AppendEntriesResponse::HigherVote(v) => AppendResult::HigherVote(v),
                }))
            }
            Request::Vote { cluster, vote, last, transfer, pre } => {
                self.check_cluster(cluster)?;
                let rpc = VoteRequest { vote, last_log_id: last, leadership_transfer: transfer };
                let r = if pre { inner.raft.pre_vote(rpc).await } else { inner.raft.vote(rpc).await };
                let r = r.map_err(|e| fatal(&e))?;
                Ok(Reply::Voted { vote: r.vote, granted: r.vote_granted, last: r.last_log_id })
            }
            Request::Snapshot { cluster, vote, meta, offset, total } => {
                self.check_cluster(cluster)?;
                self.snapshot_chunk(vote, meta, offset, total, data).await
            }
            Request::Submit { heads } => {
                let mut ops = decode_ops(&heads, &data)
                    .map_err(|e| err(ErrorCode::BadRequest, format!("submit: {e}")))?;
                if inner.cfg.copy_payloads {
                    for op in &mut ops {
                        if let OpKind::Update(b) = &op.kind {
                            op.kind = OpKind::Update(Bytes::copy_from_slice(b));
                        }
                    }
                }
                if !inner.raft.is_leader() {
                    return Ok(leader_hint(inner));
                }
                let mut waits = Vec::with_capacity(ops.len());
                for op in ops {
                    let (tx, rx) = oneshot::channel();
                    inner
                        .submit
                        .send(Pending { op, reply: tx })
                        .await
                        .map_err(|_| err(ErrorCode::NotReady, "this member is stopping; try another"))?;
                    waits.push(rx);
                }
                let mut replies = Vec::with_capacity(waits.len());
                for w in waits {
                    match w.await {
                        Ok(Ok(r)) => replies.push(r),
                        Ok(Err(not_leader)) => return Ok(not_leader),
                        Err(_) => return Ok(leader_hint(inner)),
                    }
                }
                Ok(Reply::Submitted(replies))
            }
            Request::Read => {
                if !inner.raft.is_leader() {
                    return Ok(leader_hint(inner));
                }
                let (tx, rx) = oneshot::channel();
                inner
                    .reads
                    .send(PendingRead { query: data, reply: tx })
                    .await
                    .map_err(|_| err(ErrorCode::NotReady, "this member is stopping; try another"))?;
                Ok(rx.await.unwrap_or_else(|_| leader_hint(inner)))
            }
            Request::Status => Ok(Reply::Status(status_of(inner))),
        }
    }

    async fn snapshot_chunk(
        &self,
        vote: Vote,
        meta: SnapshotMeta,
        offset: u64,
        total: u64,
        data: Bytes,
    ) -> Result<Reply, ErrorReply> {
        if total > SNAPSHOT_LEN_MAX {
            return Err(err(ErrorCode::BadRequest, format!("a snapshot of {total} bytes is over the limit")));
        }
        let complete = {
            let mut g = match self.inner.incoming.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if offset == 0 {
                *g = Some(Incoming { vote, last: meta.last_log_id, total, buf: Vec::new() });
            }
            let Some(inc) = g.as_mut().filter(|i| {
                i.vote == vote
                    && i.last == meta.last_log_id
                    && i.total == total
                    && i.buf.len() as u64 == offset
            }) else {
                *g = None;
                return Err(err(ErrorCode::Conflict, "snapshot chunk out of order; the leader starts again"));
            };
            if offset + data.len() as u64 > total {
                *g = None;
                return Err(err(ErrorCode::BadRequest, "snapshot chunk past the announced size"));
            }
            inc.buf.extend_from_slice(&data);
            if inc.buf.len() as u64 == total {
                g.take().map(|i| Bytes::from(i.buf))
            } else {
                None
            }
        };
        let Some(image) = complete else { return Ok(Reply::SnapshotMore) };
        let snapshot = openraft::type_config::alias::SnapshotOf::<Raft, Bytes> { meta, snapshot: image };
        let r = self
            .inner
            .raft
            .install_full_snapshot(vote, snapshot)
            .await
            .map_err(|e| err(ErrorCode::NotReady, format!("installing the snapshot: {e}")))?;
        Ok(Reply::SnapshotDone { vote: r.vote })
    }
}

impl<S: Service> blizzard_rpc::Service<Replicated> for Front<S> {
    fn call(
        self: Arc<Self>,
        req: Request,
        data: Bytes,
        _caller: Caller,
    ) -> futures::future::BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
        Box::pin(async move { (self.handle(req, data).await, Bytes::new()) })
    }
}

/// Asks `addr` for its status (for tools; clients use `client::Client`).
pub async fn status_of_member(env: &Env, addr: &str, timeout: Duration) -> Result<Status, String> {
    let call = async {
        let c = Conn::<Replicated>::connect(env, addr).await.map_err(|e| e.to_string())?;
        match c.call(&Request::Status, Bytes::new()).await.map_err(|e| e.to_string())? {
            (Reply::Status(s), _) => Ok(s),
            (other, _) => Err(format!("{addr} answered a status request with {other:?}")),
        }
    };
    env.timeout(timeout, call).await.map_err(|_| format!("{addr} did not answer in {timeout:?}"))?
}

fn lock_local(m: &Mutex<LocalSession>) -> std::sync::MutexGuard<'_, LocalSession> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}
