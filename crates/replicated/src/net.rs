//! Raft's network: openraft's `RaftNetworkV2` over `blizzard_rpc`
//! connections to each peer, dialled through the env seam (so the
//! simulator hosts it), one connection per peer, re-dialled after any
//! failure.
//!
//! Every call is bounded by openraft's soft deadline (a partition can eat
//! a reply on an open connection: without a deadline replication to that
//! peer would wait forever). Failures map to openraft's kinds: a peer that
//! cannot be dialled or whose connection dropped is `Unreachable` (openraft
//! backs off), no reply in time is `Timeout`, anything else (a peer of
//! another cluster, an undecodable reply) is `Network`.

use std::time::Duration;

use bytes::Bytes;

use openraft::error::{NetworkError, RPCError, ReplicationClosed, StreamingError, Timeout, Unreachable};
use openraft::network::{RPCOption, RPCTypes, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::type_config::alias::SnapshotOf;
use openraft::RaftNetworkV2;

use blizzard_env::Env;
use blizzard_rpc::{Conn, RpcError};

use crate::proto::{encode_entries, AppendResult, Replicated, Reply, Request};
use crate::types::{Member, NodeId, Raft, Vote};

/// Bytes of a snapshot image per chunk sent.
pub const SNAPSHOT_CHUNK: usize = 4 << 20;

/// Makes a [`Peer`] for each member openraft replicates to.
pub struct Network {
    env: Env,
    cluster: u128,
    me: NodeId,
    copy_payloads: bool,
}

impl Network {
    /// With `copy_payloads`, an append's bodies are joined into one buffer
    /// before sending (the zero-copy path turned off, for comparison).
    pub fn new(env: &Env, cluster: u128, me: NodeId, copy_payloads: bool) -> Network {
        Network { env: env.clone(), cluster, me, copy_payloads }
    }
}

impl RaftNetworkFactory<Raft> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: NodeId, node: &Member) -> Peer {
        Peer {
            env: self.env.clone(),
            cluster: self.cluster,
            me: self.me,
            target,
            addr: node.addr.clone(),
            conn: None,
            copy_payloads: self.copy_payloads,
        }
    }
}

/// One peer, dialled lazily.
pub struct Peer {
    env: Env,
    cluster: u128,
    me: NodeId,
    target: NodeId,
    addr: String,
    conn: Option<Conn<Replicated>>,
    copy_payloads: bool,
}

type RpcErr = RPCError<Raft>;

impl Peer {
    async fn call(
        &mut self,
        req: Request,
        data: Bytes,
        more: Vec<Bytes>,
        ttl: Duration,
        action: RPCTypes,
    ) -> Result<Reply, RpcErr> {
        let timeout =
            |_| RPCError::Timeout(Timeout { action, id: self.me, target: self.target, timeout: ttl });
        let deadline = self.env.now() + ttl;
        let conn = match &self.conn {
            Some(c) if !c.is_closed() => c.clone(),
            _ => {
                let c = self
                    .env
                    .timeout(ttl, Conn::<Replicated>::connect(&self.env, &self.addr))
                    .await
                    .map_err(timeout)?
                    .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))?;
                self.conn = Some(c.clone());
                c
            }
        };
        let left = deadline.saturating_duration_since(self.env.now());
        match self.env.timeout(left, conn.call_pieces(&req, data, more)).await {
            Err(elapsed) => {
                // The connection may be stuck for good (a partition that ate
                // the reply): dial afresh next time.
                conn.close();
                self.conn = None;
                Err(timeout(elapsed))
            }
            Ok(Ok((reply, _))) => Ok(reply),
            Ok(Err(e)) => {
                self.conn = None;
                Err(match &e {
                    RpcError::Connect { .. }
                    | RpcError::ConnectionLost(_)
                    | RpcError::Timeout(_)
                    | RpcError::NoGrant(_) => RPCError::Unreachable(Unreachable::new(&e)),
                    RpcError::Remote { .. } | RpcError::Decode { .. } => {
                        tracing::warn!(peer = self.target, addr = %self.addr, error = %e, "peer refused a Raft message");
                        RPCError::Network(NetworkError::new(&e))
                    }
                })
            }
        }
    }

    fn unexpected(&self, what: &str, reply: &Reply) -> RpcErr {
        RPCError::Network(NetworkError::from_string(format!(
            "peer {} ({}) answered {what} with {reply:?}",
            self.target, self.addr
        )))
    }

    async fn vote_call(
        &mut self,
        rpc: VoteRequest<Raft>,
        option: RPCOption,
        pre: bool,
    ) -> Result<VoteResponse<Raft>, RpcErr> {
        let req = Request::Vote {
            cluster: self.cluster,
            vote: rpc.vote,
            last: rpc.last_log_id,
            transfer: rpc.leadership_transfer,
            pre,
        };
        match self.call(req, Bytes::new(), Vec::new(), option.soft_ttl(), RPCTypes::Vote).await? {
            Reply::Voted { vote, granted, last } => Ok(VoteResponse::new(vote, last, granted)),
            other => Err(self.unexpected("a vote", &other)),
        }
    }
}

impl RaftNetworkV2<Raft> for Peer {
    type SnapshotData = Bytes;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<Raft>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<Raft>, RpcErr> {
        let (count, heads, mut body) = encode_entries(&rpc.entries);
        if self.copy_payloads {
            body = vec![crate::codec::join(&body)];
        }
        let req = Request::Append {
            cluster: self.cluster,
            vote: rpc.vote,
            prev: rpc.prev_log_id,
            commit: rpc.leader_commit,
            count,
            heads,
        };
        // The bodies go out as they are: slices of the buffers the ops
        // arrived in (zero-copy).
        match self.call(req, Bytes::new(), body, option.soft_ttl(), RPCTypes::AppendEntries).await? {
            Reply::Appended(a) => Ok(match a {
                AppendResult::Success => AppendEntriesResponse::Success,
                AppendResult::PartialSuccess(id) => AppendEntriesResponse::PartialSuccess(id),
                AppendResult::Conflict => AppendEntriesResponse::Conflict,
                AppendResult::HigherVote(v) => AppendEntriesResponse::HigherVote(v),
            }),
            other => Err(self.unexpected("an append", &other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<Raft>,
        option: RPCOption,
    ) -> Result<VoteResponse<Raft>, RpcErr> {
        self.vote_call(rpc, option, false).await
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<Raft>,
        option: RPCOption,
    ) -> Result<VoteResponse<Raft>, RpcErr> {
        self.vote_call(rpc, option, true).await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: SnapshotOf<Raft, Bytes>,
        cancel: impl std::future::Future<Output = ReplicationClosed> + Send + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<Raft>, StreamingError<Raft>> {
        let image = snapshot.snapshot;
        let total = image.len() as u64;
        let mut cancel = std::pin::pin!(cancel);
        let mut offset = 0usize;
        loop {
            let end = (offset + SNAPSHOT_CHUNK).min(image.len());
            let req = Request::Snapshot {
                cluster: self.cluster,
                vote,
                meta: snapshot.meta.clone(),
                offset: offset as u64,
                total,
            };
            let chunk = image.slice(offset..end);
            let reply = tokio::select! {
                biased;
                closed = &mut cancel => return Err(StreamingError::Closed(closed)),
                r = self.call(req, chunk, Vec::new(), option.soft_ttl(), RPCTypes::InstallSnapshot) => r?,
            };
            match reply {
                Reply::SnapshotDone { vote } => return Ok(SnapshotResponse::new(vote)),
                Reply::SnapshotMore if end < image.len() => offset = end,
                other => {
                    return Err(StreamingError::Network(NetworkError::from_string(format!(
                        "peer {} answered snapshot bytes {offset}..{end} of {total} with {other:?}",
                        self.target
                    ))))
                }
            }
        }
    }
}
