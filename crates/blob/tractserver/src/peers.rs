//! Reaching the rest of the cluster from a tractserver: other
//! tractservers by id (their addresses learned from the metadata
//! service's TLT, and learned again when a peer seems to have moved), and
//! the metadata service itself. Connections are shared per address
//! (`blizzard_rpc::ConnCache`, the metadata server's cache too); every
//! call is bounded by the request timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;

use blizzard_core::tlt::Tlt;
use blizzard_core::TsId;
use blizzard_env::Env;
use blizzard_proto::{Reply, Request};
use blizzard_rpc::{ConnCache, MetaService, RpcError};

pub struct Peers {
    env: Env,
    /// The metadata service (its leader found by `MetaService`).
    pub meta: Arc<MetaService>,
    request_timeout: Duration,
    /// Tractserver addresses by id, as the TLT last named them.
    addrs: Mutex<HashMap<TsId, String>>,
    conns: ConnCache,
}

impl Peers {
    pub fn new(env: Env, meta: Arc<MetaService>, request_timeout: Duration) -> Peers {
        Peers { env, meta, request_timeout, addrs: Mutex::default(), conns: ConnCache::default() }
    }

    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    fn addrs(&self) -> MutexGuard<'_, HashMap<TsId, String>> {
        self.addrs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The metadata service's current TLT (validated: it came off the
    /// network).
    pub async fn fetch_tlt(&self) -> Result<Tlt, RpcError> {
        let (reply, _, addr) =
            self.meta.call(&Request::GetTlt { have_version: 0 }, self.request_timeout).await?;
        match reply {
            Reply::Tlt(Some(t)) if t.validate().is_ok() => Ok(t),
            _ => Err(RpcError::ConnectionLost(format!("{addr}: no valid TLT"))),
        }
    }

    /// Calls a server by address.
    pub async fn call_addr(&self, addr: &str, req: &Request) -> Result<Reply, RpcError> {
        let c = self.conns.get(&self.env, addr).await?;
        c.call_timeout(&self.env, self.request_timeout, req, Bytes::new()).await.map(|(r, _)| r)
    }

    /// Calls a server by address with a data part, returning the reply's.
    pub async fn call_addr_data(
        &self,
        addr: &str,
        req: &Request,
        data: Bytes,
    ) -> Result<(Reply, Bytes), RpcError> {
        let c = self.conns.get(&self.env, addr).await?;
        c.call_timeout(&self.env, self.request_timeout, req, data).await
    }

    /// A tractserver's address: the one known, or (`refresh`, or none
    /// known) the TLT's.
    async fn addr_of(&self, id: TsId, refresh: bool) -> Result<String, RpcError> {
        if !refresh {
            if let Some(a) = self.addrs().get(&id) {
                return Ok(a.clone());
            }
        }
        let tlt = self.fetch_tlt().await?;
        let mut addrs = self.addrs();
        for m in &tlt.members {
            addrs.insert(m.id, m.addr.clone());
        }
        addrs.get(&id).cloned().ok_or_else(|| RpcError::Connect {
            addr: id.to_string(),
            message: "tractserver is not in the TLT".into(),
        })
    }

    /// Calls another tractserver.
    pub async fn call(&self, id: TsId, req: &Request) -> Result<Reply, RpcError> {
        self.call_data(id, req).await.map(|(r, _)| r)
    }

    /// Calls another tractserver, with the reply's data. A peer that
    /// cannot be reached is looked up again once: it may have restarted
    /// on another address.
    pub async fn call_data(&self, id: TsId, req: &Request) -> Result<(Reply, Bytes), RpcError> {
        let mut last = None;
        for attempt in 0..2 {
            let addr = self.addr_of(id, attempt > 0).await?;
            let res = match self.conns.get(&self.env, &addr).await {
                Ok(c) => c.call_timeout(&self.env, self.request_timeout, req, Bytes::new()).await,
                Err(e) => Err(e),
            };
            match res {
                Ok(r) => return Ok(r),
                Err(e @ RpcError::Remote { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(RpcError::ConnectionLost(id.to_string())))
    }
}
