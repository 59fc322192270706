//! Connections to tractservers and the metadata server. Each peer gets two
//! connections: one for small messages and one for bulk data, so a control
//! message or a 4 KiB write never waits behind an 8 MiB tract (FDS §4:
//! small and large messages travel on separate flows).
//!
//! Every connection opens with `Hello` (this pool's session and the peer's
//! current epoch). Dialing a peer again after a connection to it failed or
//! timed out raises the peer's epoch, so the peer refuses whatever the old
//! connections still deliver (`blizzard_rpc::Caller`): a write given up on
//! and retried cannot land after a newer one.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_proto::{Reply, Request};
use blizzard_rpc::{RpcConn, RpcError};

/// Messages carrying more data than this use the bulk connection.
pub const BULK_THRESHOLD: usize = 64 << 10;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Lane {
    Control,
    Bulk,
}

/// A lane's connection and the epoch it said hello with.
type Slot = Arc<tokio::sync::Mutex<Option<(RpcConn, u64)>>>;

pub struct Pool {
    env: Env,
    timeout: Duration,
    /// Random per pool: the peers' `Hello` session.
    session: u64,
    /// Ordered: dropping the pool closes connections in the same order on
    /// every run, which the simulator's exact replay depends on.
    conns: Mutex<BTreeMap<(String, Lane), Slot>>,
    /// Per peer, the epoch its connections open with.
    epochs: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Pool {
    pub fn new(env: Env, timeout: Duration) -> Pool {
        let session = env.random_u64();
        Pool {
            env,
            timeout,
            session,
            conns: Mutex::new(BTreeMap::new()),
            epochs: Mutex::new(BTreeMap::new()),
        }
    }

    async fn conn(&self, addr: &str, lane: Lane) -> Result<RpcConn, RpcError> {
        let slot = lock(&self.conns).entry((addr.to_string(), lane)).or_default().clone();
        let epoch =
            lock(&self.epochs).entry(addr.to_string()).or_insert_with(|| Arc::new(AtomicU64::new(1))).clone();
        // One dial per peer and lane at a time; others wait and share it.
        let mut g = slot.lock().await;
        let current = epoch.load(Ordering::Acquire);
        let failed = match g.take() {
            Some((c, e)) if !c.is_closed() && e == current => {
                *g = Some((c.clone(), e));
                return Ok(c);
            }
            // Superseded by the other lane's reconnect: the peer refuses
            // changes from it now.
            Some((c, _)) if !c.is_closed() => {
                c.close();
                false
            }
            // Failed (or timed out) at the current epoch.
            Some((_, e)) => e == current,
            None => false,
        };
        // Invariant: after a connection to this peer failed, the next ones
        // open at a higher epoch than any before, so nothing still in
        // flight on the old ones can be applied after what follows.
        let e = if failed { epoch.fetch_add(1, Ordering::AcqRel) + 1 } else { current };
        let hello = Request::Hello { session: self.session, epoch: e };
        let dial = async {
            let c = RpcConn::connect(&self.env, addr).await?;
            c.call(&hello, Bytes::new()).await?;
            Ok::<RpcConn, RpcError>(c)
        };
        let c = match self.env.timeout(self.timeout, dial).await {
            Ok(r) => r?,
            Err(_) => return Err(RpcError::Timeout(addr.to_string())),
        };
        *g = Some((c.clone(), e));
        Ok(c)
    }

    /// Sends `req` to `addr` on the lane its size calls for.
    pub async fn call(&self, addr: &str, req: &Request, data: Bytes) -> Result<(Reply, Bytes), RpcError> {
        if addr.is_empty() {
            return Err(RpcError::Connect {
                addr: "?".into(),
                message: "tractserver has no known address".into(),
            });
        }
        let big = data.len() > BULK_THRESHOLD
            || matches!(req, Request::ReadTract { len, .. } if *len as usize > BULK_THRESHOLD);
        let lane = if big { Lane::Bulk } else { Lane::Control };
        let c = self.conn(addr, lane).await?;
        c.call_timeout(&self.env, self.timeout, req, data).await
    }
}
