//! Connections kept by address and reused while open: a tractserver's
//! to its peers and the metadata service, the metadata server's to the
//! tractservers it pushes assignments to, a caller's to the metadata
//! replicas. Ordered, so closing them happens in the same order on every
//! run (the simulator replays runs exactly).

use std::collections::BTreeMap;
use std::sync::Mutex;

use blizzard_env::Env;

use crate::conn::{RpcConn, RpcError};

#[derive(Default)]
pub struct ConnCache {
    conns: Mutex<BTreeMap<String, RpcConn>>,
}

impl ConnCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, RpcConn>> {
        blizzard_env::lock(&self.conns)
    }

    /// The open connection to `addr`, or a new one. Two callers that find
    /// none at once may both connect; the later one's is kept.
    pub async fn get(&self, env: &Env, addr: &str) -> Result<RpcConn, RpcError> {
        if let Some(c) = self.lock().get(addr).filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let c = RpcConn::connect(env, addr).await?;
        self.lock().insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Drops the connection to `addr` (after it failed): the next `get`
    /// connects again.
    pub fn forget(&self, addr: &str) {
        self.lock().remove(addr);
    }
}
