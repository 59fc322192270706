//! A client of a replica group: finds the leader, opens a session, and
//! sends updates exactly once and reads linearizably, retrying across
//! leader changes.
//!
//! Exactly once: each update gets the next sequence number of the
//! client's session and keeps it through every retry, so the group
//! applies it once and answers every retry with the first reply
//! (`machine::session`). The client tells the group which replies it has
//! (`acked_below`: the lowest number still outstanding), so the group
//! forgets them. The numbers in flight span fewer than half of
//! `session::REPLIES_MAX` (from the lowest outstanding to the newest): a
//! session holds the replies of at most that many numbers from its
//! `acked_below` on, so the reply of an update still being retried is
//! never dropped to make room for later ones (it would be answered
//! `ReplyForgotten`, an error, though it applied once).
//!
//! Finding the leader: a member that is not the leader answers
//! `NotLeader` with the leader it knows; the client goes there. A member
//! that cannot be reached, or a leader that does not answer within the
//! attempt timeout, sends the client to the next member. One loop does
//! this for every kind of request ([`Client::call`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;

use blizzard_env::Env;
use blizzard_proto::ErrorCode;
use blizzard_rpc::{Conn, RpcError};

use crate::machine::session::REPLIES_MAX;
use crate::proto::{encode_ops, Replicated, Reply, Request, Status};
use crate::types::{Op, OpKind, OpReply};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("no leader answered within {waited:?} (tried {tried}; last: {last}): check `blizzard kv status` and that a majority of members is up")]
    NoLeader { waited: Duration, tried: String, last: String },
    #[error("the session expired (the group forgot it, or never opened it): earlier operations may or may not have applied; open a new client")]
    SessionExpired,
    #[error("the group refused the operation: {0}")]
    Rejected(String),
    #[error("the read failed: {0}")]
    Read(String),
    #[error("{addr} belongs to another cluster: {message}")]
    WrongCluster { addr: String, message: String },
    #[error("unexpected answer from {addr}: {what}")]
    Protocol { addr: String, what: String },
}

/// How hard a client tries.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// One attempt at one member.
    pub attempt_timeout: Duration,
    /// All attempts at one request.
    pub request_timeout: Duration,
    /// Pause before trying again while no member knows a leader.
    pub election_pause: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            attempt_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(30),
            election_pause: Duration::from_millis(20),
        }
    }
}

pub struct Client {
    env: Env,
    members: Vec<String>,
    cfg: ClientConfig,
    /// The member to try first: the last leader seen.
    leader: Mutex<Option<String>>,
    conns: tokio::sync::Mutex<BTreeMap<String, Conn<Replicated>>>,
    session: AtomicU64,
    next_seq: AtomicU64,
    outstanding: Mutex<BTreeSet<u64>>,
    /// Woken when the lowest outstanding number moves (`begin` waits).
    window_moved: Notify,
}

/// Whether number `next` may be sent while `lowest` is the lowest one
/// outstanding (module header).
fn window_admits(lowest: Option<u64>, next: u64) -> bool {
    next - lowest.unwrap_or(next) < (REPLIES_MAX / 2) as u64
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// What one attempt came to.
enum Attempt {
    Done(Reply, Bytes),
    /// Try `Some(addr)` next, or the next member.
    Elsewhere(Option<String>, String),
    Fail(ClientError),
}

impl Client {
    /// A client of the group whose members listen at `members` (any one is
    /// enough to find the others' leader).
    pub fn new(env: &Env, members: Vec<String>, cfg: ClientConfig) -> Client {
        Client {
            env: env.clone(),
            members,
            cfg,
            leader: Mutex::new(None),
            conns: tokio::sync::Mutex::new(BTreeMap::new()),
            session: AtomicU64::new(0),
            next_seq: AtomicU64::new(1),
            outstanding: Mutex::new(BTreeSet::new()),
            window_moved: Notify::new(),
        }
    }

    /// The session id (0 before [`Client::open_session`]).
    pub fn session(&self) -> u64 {
        self.session.load(Ordering::Acquire)
    }

    /// The member last seen leading.
    pub fn leader(&self) -> Option<String> {
        lock(&self.leader).clone()
    }

    async fn conn(&self, addr: &str) -> Result<Conn<Replicated>, RpcError> {
        let mut g = self.conns.lock().await;
        if let Some(c) = g.get(addr).filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = Conn::<Replicated>::connect(&self.env, addr).await?;
        g.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    async fn attempt(&self, addr: &str, req: &Request, data: &[Bytes]) -> Attempt {
        let call = async {
            let c = self.conn(addr).await?;
            let (first, more) = match data.split_first() {
                Some((f, m)) => (f.clone(), m.to_vec()),
                None => (Bytes::new(), Vec::new()),
            };
            c.call_pieces(req, first, more).await
        };
        match self.env.timeout(self.cfg.attempt_timeout, call).await {
            Err(_) => {
                if let Some(c) = self.conns.lock().await.remove(addr) {
                    c.close();
                }
                Attempt::Elsewhere(None, format!("{addr}: no answer in {:?}", self.cfg.attempt_timeout))
            }
            Ok(Ok((Reply::NotLeader { leader }, _))) => {
                let hint = leader.map(|(_, a)| a).filter(|a| a != addr);
                Attempt::Elsewhere(hint, format!("{addr}: not the leader"))
            }
            Ok(Ok((reply, data))) => Attempt::Done(reply, data),
            Ok(Err(RpcError::Remote { reply, .. })) if reply.code == ErrorCode::WrongCluster => {
                Attempt::Fail(ClientError::WrongCluster { addr: addr.to_string(), message: reply.message })
            }
            Ok(Err(e)) => {
                self.conns.lock().await.remove(addr);
                Attempt::Elsewhere(None, e.to_string())
            }
        }
    }

    /// Sends `req` to the leader, wherever it is (the one retry loop).
    async fn call(&self, req: &Request, data: &[Bytes]) -> Result<(Reply, Bytes), ClientError> {
        let start = self.env.now();
        let mut next = 0usize;
        let mut tried: Vec<String> = Vec::new();
        let mut last: String;
        let mut target = self.leader();
        loop {
            let addr = match target.take() {
                Some(a) => a,
                None => {
                    let a = self.members[next % self.members.len().max(1)].clone();
                    next += 1;
                    a
                }
            };
            if !tried.contains(&addr) {
                tried.push(addr.clone());
            }
            match self.attempt(&addr, req, data).await {
                Attempt::Done(reply, data) => {
                    *lock(&self.leader) = Some(addr);
                    return Ok((reply, data));
                }
                Attempt::Fail(e) => return Err(e),
                Attempt::Elsewhere(hint, why) => {
                    last = why;
                    if lock(&self.leader).as_deref() == Some(addr.as_str()) {
                        *lock(&self.leader) = None;
                    }
                    // Without a hint, a full round of members with no
                    // leader among them: an election is under way.
                    if hint.is_none() && next.is_multiple_of(self.members.len().max(1)) {
                        self.env.sleep(self.cfg.election_pause).await;
                    }
                    target = hint;
                }
            }
            let waited = self.env.now().saturating_duration_since(start);
            if waited >= self.cfg.request_timeout {
                return Err(ClientError::NoLeader { waited, tried: tried.join(", "), last });
            }
        }
    }

    async fn submit_one(&self, op: Op) -> Result<OpReply, ClientError> {
        let (req, data) = encode_ops(std::slice::from_ref(&op));
        let (reply, _) = self.call(&req, &data).await?;
        match reply {
            Reply::Submitted(mut r) if r.len() == 1 => Ok(r.remove(0)),
            other => Err(ClientError::Protocol {
                addr: self.leader().unwrap_or_default(),
                what: format!("{other:?}"),
            }),
        }
    }

    /// Opens the session updates run in (once, before the first update).
    pub async fn open_session(&self) -> Result<u64, ClientError> {
        let op = Op { session: 0, seq: 0, acked_below: 0, kind: OpKind::OpenSession };
        match self.submit_one(op).await? {
            OpReply::SessionOpened(id) => {
                self.session.store(id, Ordering::Release);
                Ok(id)
            }
            other => Err(ClientError::Protocol {
                addr: self.leader().unwrap_or_default(),
                what: format!("{other:?}"),
            }),
        }
    }

    /// Applies an update exactly once; returns the service's reply.
    pub async fn update(&self, bytes: Bytes) -> Result<Bytes, ClientError> {
        let seq = self.begin().await?;
        let result = self.update_as(seq, bytes).await;
        self.end(seq);
        result
    }

    /// Sends an update, then the same update again with the same number,
    /// as a client whose reply was lost would: both answers (the second
    /// must be the first's, not a second application). For tests of
    /// exactly-once.
    pub async fn update_twice(
        &self,
        bytes: Bytes,
    ) -> (Result<Bytes, ClientError>, Result<Bytes, ClientError>) {
        let seq = match self.begin().await {
            Ok(s) => s,
            Err(e) => return (Err(e.clone()), Err(e)),
        };
        let first = self.update_as(seq, bytes.clone()).await;
        let again = self.update_as(seq, bytes).await;
        self.end(seq);
        (first, again)
    }

    /// Takes the next sequence number (opening the session first if need
    /// be), within the window of outstanding updates.
    async fn begin(&self) -> Result<u64, ClientError> {
        if self.session() == 0 {
            self.open_session().await?;
        }
        loop {
            // Registered before the check, so a move in between wakes it.
            let moved = self.window_moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            {
                let mut out = lock(&self.outstanding);
                let next = self.next_seq.load(Ordering::Acquire);
                if window_admits(out.first().copied(), next) {
                    self.next_seq.store(next + 1, Ordering::Release);
                    out.insert(next);
                    return Ok(next);
                }
            }
            moved.await;
        }
    }

    fn end(&self, seq: u64) {
        lock(&self.outstanding).remove(&seq);
        self.window_moved.notify_waiters();
    }

    /// Sends update `seq` (again, if it was sent before). The numbers a
    /// client uses must grow: replies below the lowest outstanding one are
    /// forgotten by the group. For tests that number updates themselves.
    pub async fn update_as(&self, seq: u64, bytes: Bytes) -> Result<Bytes, ClientError> {
        let acked_below = lock(&self.outstanding).first().copied().unwrap_or(seq).min(seq);
        let op = Op { session: self.session(), seq, acked_below, kind: OpKind::Update(bytes) };
        match self.submit_one(op).await? {
            OpReply::Applied(b) => Ok(b),
            OpReply::SessionExpired => Err(ClientError::SessionExpired),
            OpReply::Rejected(why) => Err(ClientError::Rejected(why)),
            OpReply::ReplyForgotten => Err(ClientError::Rejected(format!(
                "update {seq} was applied before, and its reply is gone (it was acknowledged already)"
            ))),
            other => Err(ClientError::Protocol {
                addr: self.leader().unwrap_or_default(),
                what: format!("{other:?}"),
            }),
        }
    }

    /// A linearizable read.
    pub async fn read(&self, query: Bytes) -> Result<Bytes, ClientError> {
        match self.call(&Request::Read, &[query]).await? {
            (Reply::ReadDone(Ok(b)), _) => Ok(b),
            (Reply::ReadDone(Err(e)), _) => Err(ClientError::Read(e)),
            (other, _) => Err(ClientError::Protocol {
                addr: self.leader().unwrap_or_default(),
                what: format!("{other:?}"),
            }),
        }
    }

    /// Ends the session (its replies are forgotten).
    pub async fn close_session(&self) -> Result<(), ClientError> {
        let id = self.session();
        if id == 0 {
            return Ok(());
        }
        let op = Op { session: id, seq: 0, acked_below: 0, kind: OpKind::CloseSession };
        self.submit_one(op).await?;
        self.session.store(0, Ordering::Release);
        Ok(())
    }

    /// Every reachable member's status (unreachable ones as errors).
    pub async fn statuses(&self) -> Vec<(String, Result<Status, String>)> {
        let mut out = Vec::new();
        for addr in &self.members {
            let r = match self.attempt(addr, &Request::Status, &[]).await {
                Attempt::Done(Reply::Status(s), _) => Ok(s),
                Attempt::Done(other, _) => Err(format!("answered {other:?}")),
                Attempt::Elsewhere(_, why) => Err(why),
                Attempt::Fail(e) => Err(e.to_string()),
            };
            out.push((addr.clone(), r));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_spans_fewer_numbers_than_a_session_remembers() {
        let half = (REPLIES_MAX / 2) as u64;
        assert!(window_admits(None, 7));
        assert!(window_admits(Some(5), 5 + half - 1));
        assert!(!window_admits(Some(5), 5 + half), "one update retried holds back the rest");
    }

    /// The update that found the window full waits for the lowest
    /// outstanding one, not merely for any to end.
    #[tokio::test]
    #[allow(clippy::disallowed_methods, reason = "a unit test waiting in real time")]
    async fn a_slow_update_holds_the_window_until_it_ends() {
        let c = Client::new(&Env::real(), Vec::new(), ClientConfig::default());
        c.session.store(1, Ordering::Release);
        let first = c.begin().await.expect("a number");
        for _ in 1..REPLIES_MAX / 2 {
            let s = c.begin().await.expect("a number");
            c.end(s);
        }
        let waiting = c.begin();
        tokio::pin!(waiting);
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut waiting).await.is_err());
        c.end(first);
        let next = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("admitted once the lowest moved")
            .expect("a number");
        assert_eq!(next, first + (REPLIES_MAX / 2) as u64);
    }
}
