//! Online upgrade (Ursa §5.2): a running server hands its listening socket
//! and every live connection to a newly started process, so clients keep
//! their disks across a restart of the server binary. QEMU, nbdfuse and
//! libnbd never reconnect: a closed socket is a lost disk.
//!
//! The old server listens on a hand-over socket (a unix seqpacket socket,
//! mode 0600, peers of other users refused; `blizzard_env::HandoverConn`).
//! A successor ([`Server::upgrade_from`]) connects and the two exchange
//! `wire` messages:
//!
//! 1. new → old `Hello`.
//! 2. The old server quiesces: stops accepting, and every connection's
//!    reader stops at a request boundary once its in-flight requests are
//!    answered (`server::quiesce`; connections still negotiating finish
//!    the handshake first).
//! 3. The old server makes every open volume durable (`Volume::quiesce`),
//!    then releases each (its lease given up, so the successor can take
//!    it without waiting for it to lapse): nothing acknowledged is left
//!    only in its memory.
//! 4. old → new `Listener` with the listening socket, then one
//!    `Connection` per connection with its socket, its negotiated state
//!    and the bytes read from it but not used. Bytes the client sent that
//!    were not read stay in the kernel's socket buffer for the successor.
//! 5. The successor opens the volumes (checking each connection would get
//!    the transmission flags it was told) and answers `Ready`, or
//!    releases what it opened and answers `Failed`.
//! 6. old → new `Commit`; the old server closes its copies of the sockets
//!    and its process exits; the successor serves.
//!
//! Never leave clients with nobody serving:
//!
//! | failure | old server | successor |
//! |---|---|---|
//! | before step 4 (quiesce times out, a flush fails) | answers `Refused`, reopens what it released, resumes every connection | exits with the reason |
//! | at or after step 4, before `Commit` (a send fails, `Failed`, no `Ready` within [`READY_WAIT`]) | reopens its volumes (waiting while the successor's lease lapses) and resumes every connection from its own copies of the sockets | never reads a socket it was sent without `Commit`; releases its volumes and exits |
//! | after `Commit` | exits 0 | serves |
//!
//! The successor reads a connection only after `Commit`, and the old
//! server never again after sending it, so the two never serve one socket
//! at once. A successor that dies after `Commit` is a crash like any other.
//!
//! ## A server that owns its storage ([`Backing`])
//!
//! `blizzard up` runs the blob store its volumes live on in the same
//! process, so the successor needs the disks as well as the sockets. The
//! old server stops its backing after step 3 (every volume durable and
//! released) and before step 4; the successor starts its own after step
//! 4, before step 5. The backing is exclusive (`blizzard up` holds a lock
//! on its data directory while its cluster runs), and its `start` waits
//! for it, so the two never run it at once. Whoever fails gives it back:
//!
//! | failure | old server | successor |
//! |---|---|---|
//! | before the old backing stopped | as in the table above | as above |
//! | after it stopped, before `Commit` | starts its backing again (waiting while the successor still holds it), then reopens its volumes and resumes, as above | stops its backing (if it started it) after releasing its volumes, and exits |

mod wire;

use std::collections::BTreeSet;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use blizzard_env::{adopt_listener, adopt_stream, stream_fd, Env, HandoverConn, HandoverListener, Listener};
use blizzard_volume::VolumeError;

use crate::exports::Exports;
use crate::proto::Session;
use crate::server::{
    check_config, open_waiting, serve_metrics, Back, Parked, Quiesce, Quiesced, Server, Shared,
};
use crate::{handshake, NbdConfig, NbdError};

pub use wire::WireError;
pub(crate) use wire::CONNECTIONS_MAX;
use wire::{ConnState, Message, MESSAGE_MAX};

/// How long the old server waits for its successor's Hello.
const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How long a successor waits for the listener beyond the old server's
/// `shutdown_grace` (its drain): the flushes and releases.
const FLUSH_WAIT: Duration = Duration::from_secs(60);
/// Between the messages of one burst.
const STEP_WAIT: Duration = Duration::from_secs(10);
/// How long the old server waits for Ready: the successor opens the
/// volumes (after a clean release there is nothing to reconcile).
pub const READY_WAIT: Duration = Duration::from_secs(60);
/// How long a successor waits for Commit after Ready.
const COMMIT_WAIT: Duration = Duration::from_secs(10);
/// How long a successor retries binding the metrics address the old
/// server is giving up.
const METRICS_BIND_WAIT: Duration = Duration::from_secs(5);

/// The hand-over socket of the server in process `pid`, in `dir` (the
/// CLI's default: `$XDG_RUNTIME_DIR`, else the temporary directory).
pub fn socket_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("blizzard-nbd-{pid}.upgrade"))
}

/// Why a hand-over failed. Each says which side keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error(
        "cannot reach the hand-over socket {path}: {source} (is it a running `blizzard nbd` of this user, and its socket?)"
    )]
    Connect { path: String, source: std::io::Error },
    #[error("hand-over, {step}: {source}")]
    Io { step: &'static str, source: std::io::Error },
    #[error("hand-over, {step}: no answer within {wait:?}")]
    Timeout { step: &'static str, wait: Duration },
    #[error("hand-over, {step}: {source}")]
    Wire { step: &'static str, source: WireError },
    #[error("hand-over, {step}: expected {expected}, got {got} with {fds} descriptors")]
    Unexpected { step: &'static str, expected: &'static str, got: &'static str, fds: usize },
    #[error("the old process refused the hand-over and keeps serving: {0}")]
    Refused(String),
    #[error("the new process could not take over and the old one keeps serving: {0}")]
    Failed(String),
    #[error("cannot quiesce: {0}")]
    Quiesce(String),
    /// Boxed: a volume error is large, the others are small.
    #[error("volume {name:?}: {error}")]
    Volume { name: String, error: Box<VolumeError> },
    #[error(
        "a connection whose client sent transmission flags {told:#x} would get {now:#x} here: do both processes run with the same --read-only?"
    )]
    Flags { told: u16, now: u16 },
    #[error("{what} has no socket to hand over (an in-process pipe?)")]
    NotASocket { what: String },
    #[error(
        "the connection from {peer} runs inside TLS, whose session lives in this process and cannot be handed over; upgrade once the TLS clients have disconnected"
    )]
    Tls { peer: String },
    #[error("the server is stopping")]
    Stopping,
    #[error("the storage the volumes live on: {0}")]
    Backing(String),
}

async fn send(
    conn: &HandoverConn,
    step: &'static str,
    m: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<(), UpgradeError> {
    debug_assert_eq!(fds.len(), m.fds());
    let b = m.encode().map_err(|source| UpgradeError::Wire { step, source })?;
    conn.send(&b, fds).await.map_err(|source| UpgradeError::Io { step, source })
}

async fn recv(
    conn: &HandoverConn,
    env: &Env,
    step: &'static str,
    wait: Duration,
) -> Result<(Message, Vec<OwnedFd>), UpgradeError> {
    let r =
        env.timeout(wait, conn.recv(MESSAGE_MAX)).await.map_err(|_| UpgradeError::Timeout { step, wait })?;
    let (b, fds) = r.map_err(|source| UpgradeError::Io { step, source })?;
    let m = Message::decode(&b).map_err(|source| UpgradeError::Wire { step, source })?;
    if fds.len() != m.fds() {
        return Err(UpgradeError::Unexpected {
            step,
            expected: "its descriptors",
            got: m.name(),
            fds: fds.len(),
        });
    }
    Ok((m, fds))
}

fn unexpected(step: &'static str, expected: &'static str, m: &Message, fds: usize) -> UpgradeError {
    UpgradeError::Unexpected { step, expected, got: m.name(), fds }
}

/// The old server's side: waits for successors on `l`; once one has taken
/// over, sets `handed_over` (and stops the rest of the server).
pub(crate) async fn serve_upgrades(
    l: HandoverListener,
    shared: Arc<Shared>,
    quiesce: mpsc::Sender<Quiesce>,
    backing: Option<Arc<dyn Backing>>,
) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shared.shutdown.wait() => return,
            r = l.accept() => r,
        };
        let (conn, pid) = match accepted {
            Ok(c) => c,
            Err(e) => {
                warn!(socket = %l.path().display(), error = %e, "hand-over socket: a connection refused");
                shared.env.sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        info!(pid, "process {pid} asks for the hand-over of the listener and every connection");
        match hand_over(&conn, pid, &shared, &quiesce, backing.as_deref()).await {
            Ok(n) => {
                info!(pid, connections = n, "hand-over done: process {pid} serves the listener and {n} connections; this server stops");
                shared.handed_over.set();
                // The metrics endpoint and anything else waiting for it.
                shared.shutdown.set();
                return;
            }
            Err(e) => warn!(
                pid,
                error = %e,
                "hand-over to process {pid} failed; this server serves on (fix what the error says, then start the new process again)"
            ),
        }
    }
}

/// What a server's volumes live on when the server runs it itself
/// (`blizzard up`: its embedded blob store); module docs, "A server that
/// owns its storage".
pub trait Backing: Send + Sync + 'static {
    /// Starts it, waiting while another process holds it, so that volumes
    /// can be opened. An error says why it cannot.
    fn start(&self) -> futures::future::BoxFuture<'_, Result<(), String>>;
    /// Stops it (every volume released first), so another process can
    /// start it.
    fn stop(&self) -> futures::future::BoxFuture<'_, ()>;
}

/// How far a hand-over got, for undoing it.
#[derive(Default)]
struct Progress {
    /// Volumes released: the registry must open them afresh.
    released: bool,
    /// The backing stopped: it must be started again before that.
    stopped_backing: bool,
    /// Descriptors sent: the successor knows, no Refused is needed.
    sent: bool,
}

async fn hand_over(
    conn: &HandoverConn,
    pid: u32,
    shared: &Arc<Shared>,
    quiesce: &mpsc::Sender<Quiesce>,
    backing: Option<&dyn Backing>,
) -> Result<usize, UpgradeError> {
    match recv(conn, &shared.env, "waiting for Hello", HELLO_WAIT).await? {
        (Message::Hello { pid: said }, _) if said == pid => {}
        (Message::Hello { pid: said }, _) => {
            let why = format!("Hello says process {said}, the socket says {pid}");
            refuse(conn, &why).await;
            return Err(UpgradeError::Refused(why));
        }
        (m, fds) => return Err(unexpected("waiting for Hello", "Hello", &m, fds.len())),
    }
    let (reply, answer) = oneshot::channel();
    quiesce.send(Quiesce { reply }).await.map_err(|_| UpgradeError::Stopping)?;
    let Quiesced { listener, mut parked, back } = match answer.await {
        Ok(Ok(q)) => q,
        Ok(Err(why)) => {
            refuse(conn, &why).await;
            return Err(UpgradeError::Quiesce(why));
        }
        Err(_) => return Err(UpgradeError::Stopping),
    };
    let mut progress = Progress::default();
    match transfer(conn, shared, &*listener, &mut parked, &mut progress, backing).await {
        Ok(()) => {
            // Released, and now another process's: never flush them here.
            shared.registry.clear();
            let n = parked.len();
            let _ = back.send(Back::Done);
            Ok(n)
        }
        Err(e) => {
            if !progress.sent {
                refuse(conn, &e.to_string()).await;
            }
            if progress.released {
                shared.registry.clear();
            }
            if let (true, Some(b)) = (progress.stopped_backing, backing) {
                restart_backing(shared, b).await;
            }
            let _ = back.send(Back::Resume(listener, parked));
            Err(e)
        }
    }
}

/// Starts this server's backing again after a failed hand-over stopped
/// it: until it starts (the successor may still hold it while it gives
/// up), or the server stops. Its connections wait meanwhile.
async fn restart_backing(shared: &Shared, b: &dyn Backing) {
    loop {
        match b.start().await {
            Ok(()) => {
                info!("the storage is back after the failed hand-over; resuming");
                return;
            }
            Err(e) if shared.shutdown.is_set() => {
                warn!(error = %e, "cannot start the storage again, and the server is stopping");
                return;
            }
            Err(e) => {
                warn!(error = %e, "cannot start the storage again after the failed hand-over; trying again in 1 s");
                shared.env.sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn refuse(conn: &HandoverConn, why: &str) {
    if let Err(e) = send(conn, "sending Refused", &Message::Refused { reason: why.to_string() }, &[]).await {
        warn!(error = %e, "cannot tell the new process the hand-over is refused");
    }
}

async fn transfer(
    conn: &HandoverConn,
    shared: &Shared,
    listener: &dyn Listener,
    // `&mut`: a `Parked` is `Send` but not `Sync` (its stream), and this
    // future must be `Send`.
    parked: &mut [Parked],
    progress: &mut Progress,
    backing: Option<&dyn Backing>,
) -> Result<(), UpgradeError> {
    // Every socket found before anything is released; the messages built
    // now, so no `&Parked` lives across an await.
    let lfd = listener.fd().ok_or_else(|| UpgradeError::NotASocket { what: "the listener".into() })?;
    let mut conns = Vec::with_capacity(parked.len());
    for p in parked.iter() {
        if p.tls {
            return Err(UpgradeError::Tls { peer: p.peer.clone() });
        }
        let fd = stream_fd(&*p.stream)
            .ok_or_else(|| UpgradeError::NotASocket { what: format!("the connection from {}", p.peer) })?;
        let m = Message::Connection(ConnState {
            export: p.export.clone(),
            peer: p.peer.clone(),
            size: p.session.size,
            flags: p.flags,
            structured: p.session.structured,
            base_allocation: p.session.base_allocation,
            leftover: p.leftover.clone(),
        });
        conns.push((m, fd));
    }
    // Everything acknowledged made durable, the volumes still open: a
    // failure here loses nothing and the connections serve on.
    for (name, v) in shared.registry.opened() {
        v.quiesce()
            .await
            .map_err(|error| UpgradeError::Volume { name: name.clone(), error: Box::new(error) })?;
    }
    // The leases given up, every one even if one fails, so the successor
    // (or this server, resuming) need not wait for them to lapse.
    progress.released = true;
    let mut first = None;
    for (name, v) in shared.registry.opened() {
        match v.release().await {
            Ok(()) => info!(volume = %name, "volume flushed and released for the successor"),
            Err(error) => {
                first.get_or_insert(UpgradeError::Volume { name, error: Box::new(error) });
            }
        }
    }
    if let Some(e) = first {
        return Err(e);
    }
    // The storage given up for the successor (module docs).
    if let Some(b) = backing {
        progress.stopped_backing = true;
        b.stop().await;
        info!("storage stopped for the successor");
    }
    progress.sent = true;
    let m = Message::Listener { connections: conns.len() as u32, addr: listener.local_addr() };
    send(conn, "sending the listener", &m, &[lfd]).await?;
    for (m, fd) in &conns {
        send(conn, "sending a connection", m, &[*fd]).await?;
    }
    info!(
        connections = conns.len(),
        "listener and connections sent; waiting for the new process to open the volumes"
    );
    match recv(conn, &shared.env, "waiting for Ready", READY_WAIT).await? {
        (Message::Ready, _) => {}
        (Message::Failed { reason }, _) => return Err(UpgradeError::Failed(reason)),
        (m, fds) => return Err(unexpected("waiting for Ready", "Ready or Failed", &m, fds.len())),
    }
    send(conn, "sending Commit", &Message::Commit, &[]).await
}

impl Server {
    /// Takes over from the server listening for successors on `socket`
    /// ([`Server::listen_for_upgrades`]): receives its listener and every
    /// live connection, opens their volumes (and the default export's) and
    /// resumes each connection where the old server stopped it. On an
    /// error, the old server keeps serving (see the module's table).
    pub async fn upgrade_from(
        env: Env,
        exports: Arc<dyn Exports>,
        socket: &Path,
        cfg: NbdConfig,
    ) -> Result<Server, NbdError> {
        Server::upgrade_from_backing(env, exports, socket, cfg, None).await
    }

    /// [`Server::upgrade_from`] for a server that runs the storage its
    /// volumes live on (`backing`, module docs): started once the old
    /// server has stopped its own, stopped again if the hand-over fails.
    pub async fn upgrade_from_backing(
        env: Env,
        exports: Arc<dyn Exports>,
        socket: &Path,
        cfg: NbdConfig,
        backing: Option<Arc<dyn Backing>>,
    ) -> Result<Server, NbdError> {
        check_config(&cfg)?;
        let (conn, old) = HandoverConn::connect(socket)
            .map_err(|source| UpgradeError::Connect { path: socket.display().to_string(), source })?;
        info!(old, socket = %socket.display(), "asking process {old} for its listener and connections");
        send(&conn, "sending Hello", &Message::Hello { pid: std::process::id() }, &[]).await?;
        let wait = cfg.shutdown_grace + FLUSH_WAIT;
        let (m, mut fds) = recv(&conn, &env, "waiting for the listener", wait).await?;
        let (count, addr) = match m {
            Message::Listener { connections, addr } => (connections, addr),
            Message::Refused { reason } => return Err(UpgradeError::Refused(reason).into()),
            m => return Err(unexpected("waiting for the listener", "Listener", &m, fds.len()).into()),
        };
        let adopting = |source| UpgradeError::Io { step: "adopting a socket", source };
        let listener = fds.pop().map(adopt_listener).transpose().map_err(adopting)?;
        let listener = listener.ok_or(UpgradeError::NotASocket { what: "the Listener message".into() })?;
        let mut parked = Vec::new();
        for _ in 0..count {
            let (m, mut fds) = recv(&conn, &env, "waiting for a connection", STEP_WAIT).await?;
            let c = match m {
                Message::Connection(c) => c,
                m => return Err(unexpected("waiting for a connection", "Connection", &m, fds.len()).into()),
            };
            let Some(fd) = fds.pop() else {
                return Err(UpgradeError::NotASocket { what: "a Connection message".into() }.into());
            };
            let (stream, _) = adopt_stream(fd).map_err(adopting)?;
            let session =
                Session { size: c.size, structured: c.structured, base_allocation: c.base_allocation };
            parked.push(Parked {
                stream,
                leftover: c.leftover,
                peer: c.peer,
                export: c.export,
                session,
                flags: c.flags,
                // Only plain connections are ever sent.
                tls: false,
            });
        }
        if let Some(b) = &backing {
            info!("starting the storage the old server stopped");
            if let Err(why) = b.start().await {
                let _ = send(&conn, "sending Failed", &Message::Failed { reason: why.clone() }, &[]).await;
                return Err(UpgradeError::Backing(why).into());
            }
        }
        info!(connections = count, %addr, "received the listener and connections; opening their volumes");
        let shared = Shared::new(env, exports, cfg);
        // (export, structured, flags) of each: no `&Parked` across an
        // await (a `Parked` is not `Sync`), so this future stays `Send`.
        let wants: Vec<(String, bool, u16)> =
            parked.iter().map(|p| (p.export.clone(), p.session.structured, p.flags)).collect();
        let ready = match open_all(&shared, &wants).await {
            Ok(()) => send(&conn, "sending Ready", &Message::Ready, &[]).await,
            Err(e) => {
                release_all(&shared).await;
                if let Some(b) = &backing {
                    b.stop().await;
                }
                let _ = send(&conn, "sending Failed", &Message::Failed { reason: e.to_string() }, &[]).await;
                return Err(e.into());
            }
        };
        let committed = match ready {
            Ok(()) => match recv(&conn, &shared.env, "waiting for Commit", COMMIT_WAIT).await {
                Ok((Message::Commit, _)) => Ok(()),
                Ok((m, fds)) => Err(unexpected("waiting for Commit", "Commit", &m, fds.len())),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        if let Err(e) = committed {
            // Without Commit the old server may be serving these sockets:
            // never touch them.
            release_all(&shared).await;
            if let Some(b) = &backing {
                b.stop().await;
            }
            return Err(e.into());
        }
        info!(old, connections = parked.len(), %addr, "hand-over from process {old} done: serving its connections");
        if let Some(m) = shared.cfg.metrics_listen.clone() {
            bind_metrics(&shared, &m).await;
        }
        Ok(Server::launch(shared, listener, parked))
    }
}

/// Opens every export a connection uses (`wants`: export, structured
/// replies, the flags it was told), and the default export, and checks
/// each connection would be told the flags it was told.
async fn open_all(shared: &Shared, wants: &[(String, bool, u16)]) -> Result<(), UpgradeError> {
    let mut names: BTreeSet<String> = wants.iter().map(|w| w.0.clone()).collect();
    names.extend(shared.cfg.default_export.clone());
    for name in names {
        open_waiting(shared, &name)
            .await
            .map_err(|error| UpgradeError::Volume { name: name.clone(), error: Box::new(error) })?;
        info!(volume = %name, "volume opened");
    }
    for (export, structured, told) in wants {
        let v = open_waiting(shared, export)
            .await
            .map_err(|error| UpgradeError::Volume { name: export.clone(), error: Box::new(error) })?;
        // Read-only as the volume is, or as the client was told (an access
        // list can make one client read-only on a writable volume).
        let read_only = v.is_read_only() || told & crate::proto::NBD_FLAG_READ_ONLY != 0;
        let now = handshake::transmission_flags(*structured, read_only);
        if now != *told {
            return Err(UpgradeError::Flags { told: *told, now });
        }
    }
    Ok(())
}

/// Releases every volume this process opened (a hand-over it gives up on).
async fn release_all(shared: &Shared) {
    for (name, v) in shared.registry.opened() {
        if let Err(e) = v.release().await {
            warn!(volume = %name, error = %e, "releasing a volume after a failed hand-over");
        }
    }
    shared.registry.clear();
}

/// Binds the metrics address, which the old server gives up as it stops.
async fn bind_metrics(shared: &Arc<Shared>, addr: &str) {
    let start = shared.env.now();
    loop {
        match shared.env.bind_plain(addr).await {
            Ok(l) => return serve_metrics(shared, l),
            Err(e) if shared.env.now().duration_since(start) >= METRICS_BIND_WAIT => {
                warn!(%addr, error = %e, "cannot bind the metrics address after the hand-over; serving without /metrics");
                return;
            }
            Err(_) => shared.env.sleep(Duration::from_millis(100)).await,
        }
    }
}
