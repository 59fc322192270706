//! The scope table this tractserver enforces (design 0010, issue 56):
//! learned from the metadata service and kept here, as the TLT is, so a
//! request is judged against memory (`blizzard_rpc::authz::Scoped`,
//! `blizzard_proto::scope::check`) and costs no round trip.
//!
//! | event | fetched | adopted |
//! |---|---|---|
//! | start | the whole table | it |
//! | a heartbeat reply names a newer version | the table, in a task of its own (the heartbeat loop never waits) | if newer than the one here |
//! | a request is refused under the table here (a lease taken a moment ago, a list changed since the last heartbeat) | once, by a fetch that starts after the refusal; concurrent refusals share one fetch | if newer; the request is judged again |
//! | the metadata service cannot be reached | nothing | the table here stays (a refused request stays refused) |
//!
//! A table is only ever replaced by a newer version, whichever replica
//! answered. Its revocations are adopted with it: the connections of the
//! certificates they name close (`Revocations`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_env::lock;
use blizzard_proto::scope::Scope;
use blizzard_proto::{Reply, Request};
use blizzard_rpc::authz::{Revocations, ScopeSource};
use blizzard_rpc::MetaService;

/// How long one fetch of the table may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);

pub struct ScopeCache {
    meta: Arc<MetaService>,
    table: Mutex<Arc<Scope>>,
    revocations: Arc<Revocations>,
    /// One fetch at a time; its count, so a refusal waits for a fetch
    /// that started after it.
    fetching: tokio::sync::Mutex<()>,
    fetches_started: AtomicU64,
}

impl ScopeCache {
    pub fn new(meta: Arc<MetaService>) -> ScopeCache {
        ScopeCache {
            meta,
            table: Mutex::new(Arc::new(Scope::default())),
            revocations: Arc::default(),
            fetching: tokio::sync::Mutex::new(()),
            fetches_started: AtomicU64::new(0),
        }
    }

    pub fn version(&self) -> u64 {
        lock(&self.table).version
    }

    /// Takes `t` if it is newer than the table here.
    fn adopt(&self, t: Scope) {
        let mut cur = lock(&self.table);
        if t.version <= cur.version {
            return;
        }
        tracing::debug!(
            version = t.version,
            volumes = t.volumes.len(),
            revoked = t.revoked.len(),
            "scope table"
        );
        self.revocations.adopt(t.revoked.keys());
        *cur = Arc::new(t);
    }

    /// Fetches the table if the metadata service has a newer one. `Err`
    /// says why it could not ask (logged by the caller, if worth it).
    pub async fn fetch(&self) -> Result<(), String> {
        let _one = self.fetching.lock().await;
        self.fetch_locked().await
    }

    async fn fetch_locked(&self) -> Result<(), String> {
        self.fetches_started.fetch_add(1, Ordering::AcqRel);
        let req = Request::GetScope { have_version: self.version() };
        match self.meta.call(&req, FETCH_TIMEOUT).await {
            Ok((Reply::Scope(Some(t)), _, _)) => {
                self.adopt(t);
                Ok(())
            }
            Ok((Reply::Scope(None), _, _)) => Ok(()),
            Ok((other, _, from)) => Err(format!("{from} answered the scope table with {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A version newer than the table here exists (a heartbeat said so):
    /// fetched in the background.
    pub fn newer_exists(self: &Arc<Self>, version: u64) {
        if version <= self.version() {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            if let Err(e) = me.fetch().await {
                tracing::warn!(error = %e, "cannot fetch the scope table; requests are judged by the one held ({})", me.version());
            }
        });
    }
}

impl ScopeSource for ScopeCache {
    fn current(&self) -> Arc<Scope> {
        lock(&self.table).clone()
    }

    fn refresh(self: Arc<Self>) -> BoxFuture<'static, ()> {
        let started_before = self.fetches_started.load(Ordering::Acquire);
        async move {
            let _one = self.fetching.lock().await;
            // Fetches run one at a time, under this lock: one that started
            // after the refusal has finished, and its table is as new as
            // another would get.
            if self.fetches_started.load(Ordering::Acquire) > started_before {
                return;
            }
            if let Err(e) = self.fetch_locked().await {
                tracing::debug!(error = %e, "cannot fetch the scope table for a refused request");
            }
        }
        .boxed()
    }

    fn revocations(&self) -> Arc<Revocations> {
        self.revocations.clone()
    }
}
