//! The accept loop and the server's life cycle.
//!
//! Each connection is one task: handshake, then transmission. A connection
//! that fails (a vanished client, garbage, a protocol violation) ends by
//! itself and is logged; it never touches another connection or the accept
//! loop. Shutdown: stop accepting, let every connection finish the requests
//! it has in flight (bounded by `shutdown_grace`), then flush every open
//! volume durably.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, info, warn};

use blizzard_env::{BoxStream, Env, Listener};
use blizzard_volume::VolumeError;

use crate::exports::{Exports, Registry};
use crate::{handshake, metrics, proto, transmission, NbdConfig, NbdError};

/// A one-way signal: once triggered, every current and future waiter
/// returns. (tokio's watch channel is banned for the simulator; Notify
/// with a flag does the same.)
#[derive(Default)]
pub(crate) struct Signal {
    set: AtomicBool,
    notify: Notify,
}

impl Signal {
    pub(crate) fn trigger(&self) {
        self.set.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    pub(crate) async fn wait(&self) {
        loop {
            let n = self.notify.notified();
            tokio::pin!(n);
            // Register before checking the flag, so a trigger in between
            // is not missed.
            n.as_mut().enable();
            if self.is_set() {
                return;
            }
            n.await;
        }
    }
}

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub(crate) env: Env,
    pub(crate) cfg: NbdConfig,
    pub(crate) registry: Registry,
    pub(crate) shutdown: Signal,
    /// Server-wide budget of buffered payload bytes (one permit per byte).
    pub(crate) budget: Arc<Semaphore>,
}

/// A running NBD server.
pub struct Server {
    local_addr: String,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Server {
    /// Binds `listen` (`host:port`, port 0 for any, or `unix:/path`) through
    /// the env and starts serving the volumes of `exports`.
    pub async fn start(
        env: Env,
        exports: Arc<dyn Exports>,
        listen: &str,
        cfg: NbdConfig,
    ) -> Result<Server, NbdError> {
        let smallest = cfg.buffered_bytes_max.min(cfg.connection_buffered_bytes_max);
        if smallest < proto::PAYLOAD_MAX as usize || smallest > u32::MAX as usize {
            return Err(NbdError::Config(format!(
                "buffered byte limits must lie between the {}-byte maximum request and 4 GiB",
                proto::PAYLOAD_MAX
            )));
        }
        if cfg.requests_in_flight_max == 0 || cfg.connections_max == 0 {
            return Err(NbdError::Config(
                "requests_in_flight_max and connections_max must be positive".into(),
            ));
        }
        if let Some(d) = &cfg.default_export {
            if proto::nbd_string(d.as_bytes()).is_err() || d.is_empty() {
                return Err(NbdError::Config(format!("default export {d:?} is not a valid export name")));
            }
        }
        let listener =
            env.bind(listen).await.map_err(|source| NbdError::Bind { addr: listen.to_string(), source })?;
        let local_addr = listener.local_addr();
        let shared = Arc::new(Shared {
            env,
            budget: Arc::new(Semaphore::new(cfg.buffered_bytes_max)),
            cfg,
            registry: Registry::new(exports),
            shutdown: Signal::default(),
        });
        // The metrics endpoint is bound before anything is served, so a
        // bad address fails the start with nothing left running.
        if let Some(m) = &shared.cfg.metrics_listen {
            let l = shared.env.bind(m).await.map_err(|source| NbdError::Bind { addr: m.clone(), source })?;
            info!(addr = %l.local_addr(), "NBD metrics at /metrics");
            let (for_render, for_stop) = (shared.clone(), shared.clone());
            let render: blizzard_metrics::Render = Arc::new(move || {
                let figures: Vec<_> = for_render
                    .registry
                    .opened()
                    .iter()
                    .map(|(name, v)| metrics::Figures::of(name, v))
                    .collect();
                metrics::render(&figures)
            });
            tokio::spawn(blizzard_metrics::serve(shared.env.clone(), l, render, async move {
                for_stop.shutdown.wait().await
            }));
        }
        info!(addr = %local_addr, "NBD server listening");
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Server { local_addr, shared, accept: Some(accept) })
    }

    /// Opens the export `name` now rather than at its first client (a
    /// server started for one volume fails at once if it cannot serve it:
    /// missing, or held by another process).
    pub async fn open_export(&self, name: &str) -> Result<(), VolumeError> {
        self.shared.registry.get(name).await.map(|_| ())
    }

    /// The address clients dial (the real port if bound to port 0).
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Stops accepting, waits for in-flight requests (at most
    /// `shutdown_grace`), then flushes every open volume durably and
    /// releases its lease. Returns
    /// the first flush error; every volume is flushed regardless.
    pub async fn shutdown(mut self) -> Result<(), NbdError> {
        self.shared.shutdown.trigger();
        if let Some(a) = self.accept.take() {
            if let Err(e) = a.await {
                warn!(error = %e, "NBD accept loop ended abnormally");
            }
        }
        let mut first = None;
        for (name, v) in self.shared.registry.opened() {
            // Durable, marked clean (the next open reconciles nothing),
            // and its lease given up (the next opener need not wait).
            match v.release().await {
                Ok(()) => debug!(volume = %name, "flushed at shutdown"),
                Err(source) => {
                    warn!(volume = %name, error = %source, "flush at shutdown failed");
                    first.get_or_insert(NbdError::Flush { name, error: source });
                }
            }
        }
        info!(addr = %self.local_addr, "NBD server stopped");
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Dropped without `shutdown`: still stop accepting and let the
        // connections wind down, so nothing keeps serving in the background.
        self.shared.shutdown.trigger();
    }
}

async fn accept_loop(listener: Box<dyn Listener>, shared: Arc<Shared>) {
    let mut conns: JoinSet<()> = JoinSet::new();
    let stop = shared.shutdown.wait();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            _ = &mut stop => break,
            Some(done) = conns.join_next(), if !conns.is_empty() => {
                if let Err(e) = done {
                    // A panic in one connection is a bug, but it must not
                    // take the server down.
                    warn!(error = %e, "NBD connection task failed");
                }
            }
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    if conns.len() >= shared.cfg.connections_max {
                        warn!(%peer, max = shared.cfg.connections_max, "too many NBD connections; closing");
                        drop(stream);
                        continue;
                    }
                    conns.spawn(connection(stream, peer, shared.clone()));
                }
                Err(e) => {
                    // Typically out of file descriptors: back off instead of
                    // spinning.
                    warn!(error = %e, "NBD accept failed");
                    shared.env.sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    drop(listener);
    let drained = shared
        .env
        .timeout(shared.cfg.shutdown_grace, async {
            while let Some(done) = conns.join_next().await {
                if let Err(e) = done {
                    warn!(error = %e, "NBD connection task failed");
                }
            }
        })
        .await;
    if drained.is_err() {
        warn!(left = conns.len(), "NBD connections still busy after the shutdown grace; dropping them");
        conns.abort_all();
        while conns.join_next().await.is_some() {}
    }
}

async fn connection(stream: BoxStream, peer: String, shared: Arc<Shared>) {
    debug!(%peer, "NBD connection");
    let mut stream = tokio::io::BufReader::with_capacity(transmission::READ_BUF_LEN, stream);
    let negotiated = match handshake::negotiate(&mut stream, &shared, &peer).await {
        Ok(Some(n)) => n,
        Ok(None) => {
            debug!(%peer, "NBD client ended negotiation");
            return;
        }
        Err(e) => {
            e.log(&peer, "handshake");
            return;
        }
    };
    debug!(%peer, export = %negotiated.name, structured = negotiated.session.structured, "NBD transmission");
    match transmission::serve(stream, negotiated, shared, &peer).await {
        Ok(()) => debug!(%peer, "NBD connection closed"),
        Err(e) => e.log(&peer, "transmission"),
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConnError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("client sent nothing for {0:?}")]
    Timeout(Duration),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("export {name:?} unavailable: {reason}")]
    Export { name: String, reason: String },
    #[error("server shutting down")]
    Shutdown,
}

impl ConnError {
    /// Protocol violations are the client's bug and worth a warning; a
    /// client going away or the server stopping is routine.
    pub(crate) fn log(&self, peer: &str, phase: &str) {
        match self {
            ConnError::Protocol(_) | ConnError::Export { .. } => {
                warn!(%peer, phase, error = %self, "NBD connection dropped")
            }
            ConnError::Io(_) | ConnError::Timeout(_) | ConnError::Shutdown => {
                debug!(%peer, phase, error = %self, "NBD connection ended")
            }
        }
    }
}
