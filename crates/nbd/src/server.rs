//! The accept loop and the server's life cycle.
//!
//! Each connection is one task: handshake, then transmission. A connection
//! that fails (a vanished client, garbage, a protocol violation) ends by
//! itself and is logged; it never touches another connection or the accept
//! loop. Shutdown: stop accepting, let every connection finish the requests
//! it has in flight (bounded by `shutdown_grace`), then flush every open
//! volume durably.
//!
//! Quiescing for a hand-over (`upgrade`): the accept loop stops accepting
//! and sets `pause`; each connection's reader stops at its next request
//! boundary, its in-flight requests finish and are answered, and its task
//! returns the connection [`Parked`] (socket, unread bytes, negotiated
//! state). The loop hands the listener and the parked connections to the
//! hand-over, which gives them back if it fails: then every parked
//! connection resumes here (`resume`), as it would in the successor.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tracing::{debug, error, info, warn};

use blizzard_env::admission::{Admission, AdmissionLimits, Pending};
use blizzard_env::{BoxStream, Env, Flag, Listener};
use blizzard_volume::{Volume, VolumeError};

use crate::exports::{Exports, Registry};
use crate::handshake::{Negotiated, Outcome};
use crate::proto::Session;
use crate::tls::TlsState;
use crate::transmission::Served;
use crate::{handshake, metrics, proto, tls, transmission, upgrade, NbdConfig, NbdError};

/// What every connection of a server shares.
pub(crate) struct Shared {
    pub(crate) env: Env,
    pub(crate) cfg: NbdConfig,
    pub(crate) registry: Registry,
    pub(crate) shutdown: Flag,
    /// Set while a hand-over quiesces the server: readers stop at their
    /// next request boundary and their connections park.
    pub(crate) pause: Flag,
    /// Set once a successor has taken every connection over.
    pub(crate) handed_over: Flag,
    /// Server-wide budget of buffered payload bytes (one permit per byte).
    pub(crate) budget: Arc<Semaphore>,
    /// TLS handshakes and refusals, for `/metrics`.
    pub(crate) guard: metrics::Guard,
    /// Connections still negotiating (`blizzard_env::admission`): none
    /// waits for another, and when too many are pending the oldest silent
    /// one is dropped for the newest.
    pub(crate) admission: Arc<Admission>,
    /// Connections in the transmission phase (bounded by
    /// `connections_max`; negotiating ones are the admission's).
    pub(crate) transmitting: AtomicUsize,
    /// Client certificates revoked (`Exports::revoked`, polled): refused
    /// at their TLS handshake, their connections closed.
    pub(crate) revocations: Arc<blizzard_env::Revocations>,
}

impl Shared {
    pub(crate) fn new(env: Env, exports: Arc<dyn Exports>, cfg: NbdConfig) -> Arc<Shared> {
        let admission = Admission::new(AdmissionLimits::with_deadline(cfg.negotiation_timeout));
        Arc::new(Shared {
            env,
            budget: Arc::new(Semaphore::new(cfg.buffered_bytes_max)),
            cfg,
            registry: Registry::new(exports),
            shutdown: Flag::new(),
            pause: Flag::new(),
            handed_over: Flag::new(),
            guard: metrics::Guard::default(),
            admission,
            transmitting: AtomicUsize::new(0),
            revocations: Arc::default(),
        })
    }
}

/// A connection in the transmission phase, stopped at a request boundary
/// with nothing in flight: what a hand-over moves to another process.
pub(crate) struct Parked {
    pub(crate) stream: BoxStream,
    /// Bytes read from the socket but not used (the start of requests not
    /// yet begun): the next reader reads them first.
    pub(crate) leftover: Vec<u8>,
    pub(crate) peer: String,
    pub(crate) export: String,
    pub(crate) session: Session,
    /// The transmission flags the client was told.
    pub(crate) flags: u16,
    /// The connection runs inside TLS: its session lives in this process
    /// and cannot be handed over.
    pub(crate) tls: bool,
}

/// A request to the accept loop to quiesce for a hand-over.
pub(crate) struct Quiesce {
    pub(crate) reply: oneshot::Sender<Result<Quiesced, String>>,
}

/// The quiesced server's listener and connections, lent to a hand-over;
/// `back` says whether they were handed over or come back.
pub(crate) struct Quiesced {
    pub(crate) listener: Box<dyn Listener>,
    pub(crate) parked: Vec<Parked>,
    pub(crate) back: oneshot::Sender<Back>,
}

pub(crate) enum Back {
    /// The successor serves them: the accept loop ends.
    Done,
    /// The hand-over failed: serve them again.
    Resume(Box<dyn Listener>, Vec<Parked>),
}

/// A running NBD server.
pub struct Server {
    local_addr: String,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    quiesce: mpsc::Sender<Quiesce>,
    upgrades: Option<JoinHandle<()>>,
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
        check_config(&cfg)?;
        // NBD's own port, not one of the cluster's: its TLS is NBD's
        // STARTTLS (`tls`), whatever carries the cluster's connections.
        let listener = env
            .bind_plain(listen)
            .await
            .map_err(|source| NbdError::Bind { addr: listen.to_string(), source })?;
        let shared = Shared::new(env, exports, cfg);
        // The metrics endpoint is bound before anything is served, so a
        // bad address fails the start with nothing left running.
        if let Some(m) = shared.cfg.metrics_listen.clone() {
            let l = shared
                .env
                .bind_plain(&m)
                .await
                .map_err(|source| NbdError::Bind { addr: m.clone(), source })?;
            serve_metrics(&shared, l);
        }
        Ok(Server::launch(shared, listener, Vec::new()))
    }

    /// Serves `listener` and resumes the `parked` connections (a
    /// successor's, after a hand-over).
    pub(crate) fn launch(shared: Arc<Shared>, listener: Box<dyn Listener>, parked: Vec<Parked>) -> Server {
        let local_addr = listener.local_addr();
        info!(addr = %local_addr, "NBD server listening");
        let (quiesce, requests) = mpsc::channel(1);
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), parked, requests));
        tokio::spawn(follow_revocations(shared.clone()));
        Server { local_addr, shared, accept: Some(accept), quiesce, upgrades: None }
    }

    /// Listens for a successor on the hand-over socket at `path` (see
    /// [`crate::upgrade`]): a process started with `--upgrade-from` that
    /// connects there takes over the listener and every connection.
    pub fn listen_for_upgrades(&mut self, path: &std::path::Path) -> Result<(), NbdError> {
        self.listen_for_upgrades_backing(path, None)
    }

    /// [`Server::listen_for_upgrades`] for a server that runs the storage
    /// its volumes live on (`backing`, see [`crate::upgrade::Backing`]): a
    /// hand-over stops it before the successor starts its own.
    pub fn listen_for_upgrades_backing(
        &mut self,
        path: &std::path::Path,
        backing: Option<Arc<dyn upgrade::Backing>>,
    ) -> Result<(), NbdError> {
        let l = blizzard_env::HandoverListener::bind(path)
            .map_err(|source| NbdError::Bind { addr: path.display().to_string(), source })?;
        info!(socket = %path.display(), "hand-over socket ready: a successor started with --upgrade-from takes over here");
        let task = upgrade::serve_upgrades(l, self.shared.clone(), self.quiesce.clone(), backing);
        self.upgrades = Some(tokio::spawn(task));
        Ok(())
    }

    /// Returns once a successor has taken over every connection (never, if
    /// none does); then [`Server::shutdown`] has nothing left to flush.
    pub async fn handed_over(&self) {
        self.shared.handed_over.wait().await
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
        self.shared.shutdown.set();
        if let Some(a) = self.accept.take() {
            if let Err(e) = a.await {
                warn!(error = %e, "NBD accept loop ended abnormally");
            }
        }
        if let Some(u) = self.upgrades.take() {
            let _ = u.await;
        }
        let mut first = None;
        for (name, v) in self.shared.registry.opened() {
            // Durable, marked clean (the next open reconciles nothing),
            // and its lease given up (the next opener need not wait).
            match v.release().await {
                Ok(()) => debug!(volume = %name, "flushed at shutdown"),
                Err(source) => {
                    warn!(volume = %name, error = %source, "flush at shutdown failed");
                    first.get_or_insert(NbdError::Flush { name, error: Box::new(source) });
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
        self.shared.shutdown.set();
    }
}

/// Checks the bounds of a configuration before anything starts.
pub(crate) fn check_config(cfg: &NbdConfig) -> Result<(), NbdError> {
    let smallest = cfg.buffered_bytes_max.min(cfg.connection_buffered_bytes_max);
    if smallest < proto::PAYLOAD_MAX as usize || smallest > u32::MAX as usize {
        return Err(NbdError::Config(format!(
            "buffered byte limits must lie between the {}-byte maximum request and 4 GiB",
            proto::PAYLOAD_MAX
        )));
    }
    if cfg.requests_in_flight_max == 0 || cfg.connections_max == 0 {
        return Err(NbdError::Config("requests_in_flight_max and connections_max must be positive".into()));
    }
    if cfg.connections_max > upgrade::CONNECTIONS_MAX as usize {
        return Err(NbdError::Config(format!(
            "connections_max must be at most {} (what one hand-over carries)",
            upgrade::CONNECTIONS_MAX
        )));
    }
    if let Some(d) = &cfg.default_export {
        if proto::nbd_string(d.as_bytes()).is_err() || d.is_empty() {
            return Err(NbdError::Config(format!("default export {d:?} is not a valid export name")));
        }
    }
    Ok(())
}

/// How often the server asks for revoked certificates: a revoked client's
/// connections close within about this long (the issue asks for 5 s).
const REVOCATIONS_EVERY: Duration = Duration::from_secs(1);

/// Keeps `shared.revocations` up to date (`Exports::revoked`) until
/// shutdown.
async fn follow_revocations(shared: Arc<Shared>) {
    let mut failing = false;
    loop {
        match shared.registry.revoked().await {
            Ok(serials) => {
                failing = false;
                shared.revocations.adopt(&serials);
            }
            Err(e) if !failing => {
                failing = true;
                warn!(error = %e, "cannot learn which certificates are revoked; the ones known stay refused");
            }
            Err(_) => {}
        }
        tokio::select! {
            biased;
            _ = shared.shutdown.wait() => return,
            _ = shared.env.sleep(REVOCATIONS_EVERY) => {}
        }
    }
}

/// Serves `/metrics` of the open exports on `l` until shutdown.
pub(crate) fn serve_metrics(shared: &Arc<Shared>, l: Box<dyn Listener>) {
    info!(addr = %l.local_addr(), "NBD metrics at /metrics");
    let (for_render, for_stop) = (shared.clone(), shared.clone());
    let render: blizzard_metrics::Render = Arc::new(move || {
        let figures: Vec<_> =
            for_render.registry.opened().iter().map(|(name, v)| metrics::Figures::of(name, v)).collect();
        metrics::render(&figures, for_render.guard.now(), for_render.admission.counts())
    });
    tokio::spawn(blizzard_metrics::serve(shared.env.clone(), l, render, async move {
        for_stop.shutdown.wait().await
    }));
}

type Conns = JoinSet<Option<Parked>>;

/// What woke the accept loop.
enum Event {
    Stop,
    Joined(Result<Option<Parked>, JoinError>),
    Accepted(std::io::Result<(BoxStream, String)>),
    Quiesce(Quiesce),
}

async fn accept_loop(
    listener: Box<dyn Listener>,
    shared: Arc<Shared>,
    parked: Vec<Parked>,
    mut requests: mpsc::Receiver<Quiesce>,
) {
    let mut listener = listener;
    let mut conns: Conns = JoinSet::new();
    for p in parked {
        conns.spawn(resume(p, shared.clone()));
    }
    let stop = shared.shutdown.wait();
    tokio::pin!(stop);
    loop {
        let event = tokio::select! {
            biased;
            _ = &mut stop => Event::Stop,
            Some(done) = conns.join_next(), if !conns.is_empty() => Event::Joined(done),
            Some(q) = requests.recv() => Event::Quiesce(q),
            r = listener.accept() => Event::Accepted(r),
        };
        match event {
            Event::Stop => break,
            Event::Joined(done) => joined(done, &mut conns, &shared),
            Event::Accepted(Ok((stream, peer))) => {
                if shared.transmitting.load(Ordering::Relaxed) >= shared.cfg.connections_max {
                    warn!(%peer, max = shared.cfg.connections_max, "too many NBD connections; closing");
                    drop(stream);
                    continue;
                }
                conns.spawn(connection(stream, peer, shared.clone()));
            }
            Event::Accepted(Err(e)) => {
                // Typically out of file descriptors: back off instead of
                // spinning.
                warn!(error = %e, "NBD accept failed");
                shared.env.sleep(Duration::from_millis(100)).await;
            }
            Event::Quiesce(q) => {
                let parked = match quiesce(&mut conns, &shared).await {
                    Ok(p) => p,
                    Err(why) => {
                        let _ = q.reply.send(Err(why));
                        continue;
                    }
                };
                let (back, answer) = oneshot::channel();
                let lent = Quiesced { listener, parked, back };
                if let Err(Ok(q)) = q.reply.send(Ok(lent)) {
                    // The hand-over is gone already: serve on.
                    listener = q.listener;
                    resume_all(q.parked, &mut conns, &shared);
                    continue;
                }
                match answer.await {
                    Ok(Back::Done) => return,
                    Ok(Back::Resume(l, parked)) => {
                        listener = l;
                        resume_all(parked, &mut conns, &shared);
                    }
                    Err(_) => {
                        error!(
                            "a hand-over ended without giving the listener back; this server stops serving"
                        );
                        return;
                    }
                }
            }
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

/// A connection task ended: a parked one (its reader stopped for a
/// hand-over that has since failed or timed out) serves on.
fn joined(done: Result<Option<Parked>, JoinError>, conns: &mut Conns, shared: &Arc<Shared>) {
    match done {
        Ok(Some(p)) => {
            conns.spawn(resume(p, shared.clone()));
        }
        Ok(None) => {}
        // A panic in one connection is a bug, but it must not take the
        // server down.
        Err(e) => warn!(error = %e, "NBD connection task failed"),
    }
}

fn resume_all(parked: Vec<Parked>, conns: &mut Conns, shared: &Arc<Shared>) {
    shared.pause.reset();
    if !parked.is_empty() {
        info!(connections = parked.len(), "resuming the connections the hand-over gave back");
    }
    for p in parked {
        conns.spawn(resume(p, shared.clone()));
    }
}

/// Stops every connection at a request boundary once its in-flight
/// requests are answered, and collects them. Connections still in the
/// handshake finish it first. If some are still busy after
/// `shutdown_grace`, gives up: every connection serves on, and the reason
/// is returned.
async fn quiesce(conns: &mut Conns, shared: &Arc<Shared>) -> Result<Vec<Parked>, String> {
    shared.pause.set();
    let busy = conns.len();
    info!(connections = busy, "quiescing for a hand-over: no new connections, each stops at a request boundary once its requests in flight are answered");
    let mut parked = Vec::new();
    let drained = shared
        .env
        .timeout(shared.cfg.shutdown_grace, async {
            while let Some(done) = conns.join_next().await {
                match done {
                    Ok(Some(p)) => parked.push(p),
                    Ok(None) => {}
                    Err(e) => warn!(error = %e, "NBD connection task failed"),
                }
            }
        })
        .await;
    if drained.is_err() {
        let left = conns.len();
        resume_all(parked, conns, shared);
        return Err(format!(
            "{left} connections still had requests in flight (or were still negotiating) after {:?}; is the cluster reachable?",
            shared.cfg.shutdown_grace
        ));
    }
    info!(
        parked = parked.len(),
        "quiesced: every connection stopped at a request boundary, nothing in flight"
    );
    Ok(parked)
}

async fn connection(stream: BoxStream, peer: String, shared: Arc<Shared>) -> Option<Parked> {
    debug!(%peer, "NBD connection");
    // Pending until the negotiation ends: it then holds a place of its own
    // (`transmitting`), or none.
    let pending = shared.admission.admit(&peer);
    let negotiated = pending.run(&*shared.env.clock, negotiate(stream, &peer, &shared, &pending)).await;
    drop(pending);
    let negotiated = match negotiated {
        Ok(n) => n,
        Err(why) => {
            debug!(%peer, "NBD negotiation {why}");
            return None;
        }
    };
    match negotiated {
        Ok(Some((stream, leftover, negotiated, tls))) => {
            debug!(%peer, export = %negotiated.name, structured = negotiated.session.structured, tls, "NBD transmission");
            transmit(stream, leftover, negotiated, tls, peer, shared).await
        }
        Ok(None) => {
            debug!(%peer, "NBD client ended negotiation");
            None
        }
        Err(e) => {
            e.log(&peer, "handshake");
            None
        }
    }
}

/// The handshake, with TLS if the client starts it: the stream to serve
/// (inside TLS or not), the bytes read past the last option (the start of
/// the first request, usually nothing), the negotiated export, and whether
/// TLS is on. `None`: the client aborted.
async fn negotiate(
    stream: BoxStream,
    peer: &str,
    shared: &Shared,
    pending: &Pending,
) -> Result<Option<(BoxStream, Vec<u8>, Negotiated, bool)>, ConnError> {
    let mut stream = tokio::io::BufReader::with_capacity(NEGOTIATION_READ_BUF, stream);
    let no_zeroes = handshake::greet(&mut stream, shared, peer).await?;
    // The client spoke (its flags): it is dropped only after every silent one.
    pending.heard();
    let mut state = TlsState::of(shared.cfg.tls.as_ref());
    // The name a verified client certificate gives (access lists name it),
    // and its serial number (revocations name that).
    let mut client: Option<String> = None;
    let mut serial: Option<String> = None;
    loop {
        match handshake::negotiate(&mut stream, shared, peer, no_zeroes, state, client.as_deref()).await? {
            Outcome::Aborted => return Ok(None),
            Outcome::Ready(mut n) => {
                n.serial = serial;
                let leftover = stream.buffer().to_vec();
                return Ok(Some((stream.into_inner(), leftover, n, state.active)));
            }
            Outcome::StartTls => {
                // Whatever the client sent before our ACK came in plain
                // text; it must not be read as if it came through TLS.
                if !stream.buffer().is_empty() {
                    return Err(ConnError::Protocol(format!(
                        "{} bytes sent after NBD_OPT_STARTTLS before the server's reply (plain text injected ahead of TLS?)",
                        stream.buffer().len()
                    )));
                }
                let Some(tls) = shared.cfg.tls.as_ref() else {
                    return Err(ConnError::Protocol("STARTTLS acknowledged without TLS configured".into()));
                };
                let (inner, identity) = tls::accept(stream.into_inner(), tls, shared).await?;
                if let Some(id) = identity.as_ref().filter(|id| shared.revocations.is_revoked(&id.serial)) {
                    return Err(ConnError::Tls(format!(
                        "the client certificate of {:?} (serial {}) is revoked",
                        id.name, id.serial
                    )));
                }
                serial = identity.as_ref().map(|id| id.serial.clone());
                match &identity {
                    Some(id) => {
                        info!(%peer, client = %id, "NBD client upgraded to TLS with a verified certificate")
                    }
                    None => debug!(%peer, "NBD client upgraded to TLS without a certificate"),
                }
                // Only a client's certificate (a `client`'s or an
                // `admin`'s) names an NBD client: one a blizzard CA
                // issued for a server role (tractserver, meta, nbd) is no
                // identity here, whatever its name.
                client = identity
                    .filter(|id| {
                        id.role.is_none_or(|r| {
                            matches!(r, blizzard_tls::Role::Client | blizzard_tls::Role::Admin)
                        })
                    })
                    .map(|id| id.name)
                    .filter(|n| !n.is_empty());
                stream = tokio::io::BufReader::with_capacity(NEGOTIATION_READ_BUF, inner);
                state.active = true;
            }
        }
    }
}

/// What a negotiating connection buffers of its client's bytes: options
/// are small, and the transmission phase has a buffer of its own
/// (`transmission::READ_BUF_LEN`), so a peer that connects and stalls
/// costs little.
const NEGOTIATION_READ_BUF: usize = 4096;

/// One connection in the transmission phase, counted while it lasts.
struct Transmitting<'a>(&'a Shared);

impl<'a> Transmitting<'a> {
    fn new(shared: &'a Shared) -> Transmitting<'a> {
        shared.transmitting.fetch_add(1, Ordering::Relaxed);
        Transmitting(shared)
    }
}

impl Drop for Transmitting<'_> {
    fn drop(&mut self) {
        self.0.transmitting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The transmission phase of a connection; `Some` if it parked.
async fn transmit(
    stream: BoxStream,
    leftover: Vec<u8>,
    n: Negotiated,
    tls: bool,
    peer: String,
    shared: Arc<Shared>,
) -> Option<Parked> {
    let counted = Transmitting::new(&shared);
    // The volume knows who uses it while this lasts: a rollback is
    // refused, naming this client.
    let who = match &n.serial {
        Some(serial) => format!("NBD client {peer} (certificate serial {serial}) on export {}", n.name),
        None => format!("NBD client {peer} on export {}", n.name),
    };
    let user = n.volume.attach(who);
    let served = transmission::serve(stream, leftover, &n, shared.clone(), &peer).await;
    drop(user);
    drop(counted);
    match served {
        Ok(Served::Closed) => {
            debug!(%peer, "NBD connection closed");
            None
        }
        Ok(Served::Parked { stream, leftover }) => {
            debug!(%peer, leftover = leftover.len(), "NBD connection parked for a hand-over");
            let flags = handshake::transmission_flags(n.session.structured, n.read_only);
            Some(Parked { stream, leftover, peer, export: n.name, session: n.session, flags, tls })
        }
        Err(e) => {
            e.log(&peer, "transmission");
            None
        }
    }
}

/// How long a connection given back by a failed hand-over (or adopted by
/// a successor) waits for its volume's lease: a successor that died
/// holding it, or a release that failed, leaves it to lapse
/// (`blizzard_volume::lease::TTL`).
const RESUME_OPEN_WAIT: Duration = Duration::from_secs(30);

/// The volume `name`, open; waits while its lease is held elsewhere (up
/// to [`RESUME_OPEN_WAIT`]).
pub(crate) async fn open_waiting(shared: &Shared, name: &str) -> Result<Arc<Volume>, VolumeError> {
    let start = shared.env.now();
    loop {
        match shared.registry.get(name).await {
            Err(VolumeError::Held { .. }) if shared.env.now().duration_since(start) < RESUME_OPEN_WAIT => {
                shared.env.sleep(Duration::from_millis(250)).await;
            }
            r => return r,
        }
    }
}

/// Serves a parked connection again: its volume opened in this server
/// (the same flags as the client was told), then the transmission phase
/// from where it stopped.
async fn resume(p: Parked, shared: Arc<Shared>) -> Option<Parked> {
    let volume = match open_waiting(&shared, &p.export).await {
        Ok(v) => v,
        Err(e) => {
            error!(peer = %p.peer, export = %p.export, error = %e, "cannot open the volume of a resumed NBD connection; closing it (its client loses the disk: reconnect it)");
            return None;
        }
    };
    // Read-only if the volume is, or if the client was told so (its
    // access list said so where it negotiated).
    let read_only = volume.is_read_only() || p.flags & proto::NBD_FLAG_READ_ONLY != 0;
    let flags = handshake::transmission_flags(p.session.structured, read_only);
    if flags != p.flags {
        error!(peer = %p.peer, export = %p.export, told = p.flags, now = flags, "a resumed NBD connection was told other transmission flags than this server would give (read-only differs?); closing it");
        return None;
    }
    debug!(peer = %p.peer, export = %p.export, "NBD connection resumed");
    // (A TLS connection is never handed over: a resumed one has no certificate.)
    let n = Negotiated { name: p.export, volume, session: p.session, read_only, serial: None };
    transmit(p.stream, p.leftover, n, p.tls, p.peer, shared).await
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
    #[error("{0}")]
    Tls(String),
}

impl ConnError {
    /// Protocol violations are the client's bug and worth a warning; a
    /// client going away or the server stopping is routine.
    pub(crate) fn log(&self, peer: &str, phase: &str) {
        match self {
            // A refused certificate or a garbled handshake is worth an
            // operator's attention: someone tried and failed.
            ConnError::Protocol(_) | ConnError::Export { .. } | ConnError::Tls(_) => {
                warn!(%peer, phase, error = %self, "NBD connection dropped")
            }
            ConnError::Io(_) | ConnError::Timeout(_) | ConnError::Shutdown => {
                debug!(%peer, phase, error = %self, "NBD connection ended")
            }
        }
    }
}
