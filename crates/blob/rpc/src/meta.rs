//! Calling the metadata service, which may be several replicas of which
//! one leads (design 0007): `--meta ADDR[,ADDR...]` everywhere. The one
//! retry loop every caller of the metadata service shares (tractservers'
//! heartbeats and TLT fetches, clients, the command line).
//!
//! The loop: try the replica that answered last (the first listed at
//! first). A replica that cannot be reached, does not answer in time, or
//! answers `NotLeader` sends the caller to the next one in the list; once
//! every replica was tried in a round without an answer (an election in
//! progress, or the service down), pause and go round again, until the
//! caller's deadline. Any other answer, errors included, is returned:
//! it came from a replica that could judge the request.
//!
//! Followers answer reads of the table themselves (design 0007), so a
//! table fetch is answered while the leader is being replaced.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_proto::{ErrorCode, Reply, Request};

use crate::conn::RpcError;
use crate::conns::ConnCache;

/// Longest pause between rounds of the list.
const PAUSE_MAX: Duration = Duration::from_millis(500);
const PAUSE_MIN: Duration = Duration::from_millis(20);

/// Parses `ADDR[,ADDR...]` (spaces around commas allowed, empty entries
/// refused).
pub fn parse_meta_list(list: &str) -> Result<Vec<String>, String> {
    let addrs: Vec<String> = list.split(',').map(|a| a.trim().to_string()).collect();
    if addrs.iter().any(|a| a.is_empty()) {
        return Err(format!(
            "--meta {list:?}: give the metadata replicas' addresses separated by commas, e.g. 127.0.0.1:7000,127.0.0.1:7001"
        ));
    }
    Ok(addrs)
}

/// The metadata service as one caller sees it (module header).
pub struct MetaService {
    env: Env,
    addrs: Vec<String>,
    /// The replica to try first: the one that answered last.
    first: AtomicUsize,
    conns: ConnCache,
    /// One attempt at one replica.
    pub attempt_timeout: Duration,
}

/// What one attempt came to.
#[derive(Debug, PartialEq, Eq)]
enum Next {
    /// An answer (success or an error the replica could judge).
    Answer,
    /// Ask the next replica.
    Elsewhere,
}

fn judge(res: &Result<(Reply, Bytes), RpcError>) -> Next {
    match res {
        Ok(_) => Next::Answer,
        Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::NotLeader => Next::Elsewhere,
        Err(RpcError::Remote { .. } | RpcError::Decode { .. }) => Next::Answer,
        Err(
            RpcError::Connect { .. }
            | RpcError::ConnectionLost(_)
            | RpcError::Timeout(_)
            | RpcError::NoGrant(_),
        ) => Next::Elsewhere,
    }
}

impl MetaService {
    /// `addrs`: every replica's address (one for a single metadata server).
    pub fn new(env: &Env, addrs: Vec<String>) -> MetaService {
        MetaService {
            env: env.clone(),
            addrs,
            first: AtomicUsize::new(0),
            conns: ConnCache::default(),
            attempt_timeout: Duration::from_secs(2),
        }
    }

    /// From `ADDR[,ADDR...]`.
    pub fn parse(env: &Env, list: &str) -> Result<MetaService, String> {
        Ok(MetaService::new(env, parse_meta_list(list)?))
    }

    pub fn addrs(&self) -> &[String] {
        &self.addrs
    }

    /// The list as given (for messages).
    pub fn describe(&self) -> String {
        self.addrs.join(",")
    }

    /// The replica that answered last.
    pub fn current(&self) -> String {
        self.addrs
            .get(self.first.load(Ordering::Relaxed) % self.addrs.len().max(1))
            .cloned()
            .unwrap_or_default()
    }

    /// Sends `req` to the leader (module header) within `deadline`; the
    /// reply, its data and the address of the replica that answered.
    pub async fn call(&self, req: &Request, deadline: Duration) -> Result<(Reply, Bytes, String), RpcError> {
        self.call_with(|_| req.clone(), deadline).await
    }

    /// As [`MetaService::call`], with the request made for each attempt
    /// from the address it goes to (a heartbeat to a replica that did not
    /// answer the last one carries what the tractserver stores, even when
    /// it was not asked for it: that replica may be a new leader).
    pub async fn call_with(
        &self,
        make: impl Fn(&str) -> Request,
        deadline: Duration,
    ) -> Result<(Reply, Bytes, String), RpcError> {
        let n = self.addrs.len();
        if n == 0 {
            return Err(RpcError::Connect {
                addr: String::new(),
                message: "no metadata address given".into(),
            });
        }
        let end = self.env.now() + deadline;
        let mut at = self.first.load(Ordering::Relaxed) % n;
        let mut pause = PAUSE_MIN;
        let mut last: Option<RpcError> = None;
        loop {
            for _ in 0..n {
                let left = end.saturating_duration_since(self.env.now());
                if left.is_zero() {
                    return Err(last.unwrap_or_else(|| RpcError::Timeout(self.describe())));
                }
                let addr = &self.addrs[at];
                let req = make(addr);
                let attempt = async {
                    let c = self.conns.get(&self.env, addr).await?;
                    c.call_timeout(&self.env, self.attempt_timeout.min(left), &req, Bytes::new()).await
                };
                let res = match self.env.timeout(self.attempt_timeout.min(left), attempt).await {
                    Ok(r) => r,
                    Err(_) => Err(RpcError::Timeout(addr.clone())),
                };
                match judge(&res) {
                    Next::Answer => {
                        self.first.store(at, Ordering::Relaxed);
                        return res.map(|(r, d)| (r, d, addr.clone()));
                    }
                    Next::Elsewhere => {
                        // A broken connection is dialled again next time; one
                        // that only did not answer in time is kept: the
                        // traffic that keeps the cluster alive (heartbeats,
                        // lease renewals) then never waits on a new
                        // connection, whatever is queued at the replica's
                        // port (issue 56). A dead peer's connection breaks
                        // on its own once the peer is back (a reset).
                        if matches!(res, Err(RpcError::Connect { .. } | RpcError::ConnectionLost(_))) {
                            self.conns.forget(addr);
                        }
                        last = res.err();
                        at = (at + 1) % n;
                    }
                }
            }
            let left = end.saturating_duration_since(self.env.now());
            if left.is_zero() {
                return Err(last.unwrap_or_else(|| RpcError::Timeout(self.describe())));
            }
            self.env.sleep(pause.min(left)).await;
            pause = (pause * 2).min(PAUSE_MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_proto::ErrorReply;

    #[test]
    fn lists_parse() {
        assert_eq!(parse_meta_list("a:1").expect("one address"), vec!["a:1"]);
        assert_eq!(parse_meta_list("a:1, b:2,c:3").expect("three addresses"), vec!["a:1", "b:2", "c:3"]);
        assert!(parse_meta_list("a:1,,b:2").is_err());
        assert!(parse_meta_list("").is_err());
    }

    #[test]
    fn only_not_leader_and_lost_connections_move_on() {
        let remote = |code| Err(RpcError::Remote { addr: "a".into(), reply: ErrorReply::new(code, "x") });
        assert_eq!(judge(&remote(ErrorCode::NotLeader)), Next::Elsewhere);
        assert_eq!(judge(&remote(ErrorCode::NotReady)), Next::Answer, "a replica's own answer");
        assert_eq!(judge(&Err(RpcError::Timeout("a".into()))), Next::Elsewhere);
        assert_eq!(judge(&Err(RpcError::ConnectionLost("a".into()))), Next::Elsewhere);
        assert_eq!(judge(&Ok((Reply::Done, Bytes::new()))), Next::Answer);
    }
}
