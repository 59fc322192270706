//! Connections to tractservers and the metadata server. Each peer gets two
//! connections: one for small messages and one for bulk data, so a control
//! message or a 4 KiB write never waits behind an 8 MiB tract (FDS §4:
//! small and large messages travel on separate flows).

use std::collections::BTreeMap;
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

type Slot = Arc<tokio::sync::Mutex<Option<RpcConn>>>;

pub struct Pool {
    env: Env,
    timeout: Duration,
    /// Ordered: dropping the pool closes connections in the same order on
    /// every run, which the simulator's exact replay depends on.
    conns: Mutex<BTreeMap<(String, Lane), Slot>>,
}

impl Pool {
    pub fn new(env: Env, timeout: Duration) -> Pool {
        Pool { env, timeout, conns: Mutex::new(BTreeMap::new()) }
    }

    async fn conn(&self, addr: &str, lane: Lane) -> Result<RpcConn, RpcError> {
        let slot = {
            let mut m = match self.conns.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            m.entry((addr.to_string(), lane)).or_default().clone()
        };
        // One dial per peer and lane at a time; others wait and share it.
        let mut g = slot.lock().await;
        if let Some(c) = g.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = match self.env.timeout(self.timeout, RpcConn::connect(&self.env, addr)).await {
            Ok(r) => r?,
            Err(_) => return Err(RpcError::Timeout(addr.to_string())),
        };
        *g = Some(c.clone());
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
