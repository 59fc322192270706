//! The cluster's own connections over mutual TLS (design 0010, point 2).
//!
//! [`TlsNet`] wraps a process's [`Net`]: every stream it dials and every
//! stream it accepts is TLS in which both ends present a certificate the
//! cluster's CA signed. What a server learns of its peer (name and role)
//! travels with the accepted stream ([`blizzard_env::Authenticated`]), and
//! each server checks the role before a request changes anything
//! (`blizzard_rpc::authz`).
//!
//! | side | checks | a failure |
//! |---|---|---|
//! | dial | the server's certificate chains to the CA, is a server certificate, names the host dialled (a unix socket: any name) | the dial fails, naming the address and what to check |
//! | accept | the peer presents a client-usable certificate chaining to the CA | the connection is dropped; the accept loop carries on |
//! | accept | the handshake ends within [`HANDSHAKE_TIMEOUT`] | as above |
//!
//! Handshakes on the accepting side each run in a task of their own, as
//! pending connections of the listener's [`Admission`] (issue 56): none
//! waits for another, a connection costs a task and its socket until its
//! first byte arrives (no TLS state, no buffer), and when too many are
//! pending the oldest is dropped to make room for the newest, so peers
//! that connect and stall, trickle bytes or vanish can delay nobody. A
//! finished session gets its read buffer only then ([`Transport`]).
//!
//! The simulator and in-process pipes (`LocalNet` above this net) carry
//! no TLS: a server cannot tell and need not.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::FutureExt;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, ServerConfig, SignatureScheme};
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, Mutex};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use blizzard_env::admission::{Admission, AdmissionCounts, AdmissionLimits, Pending};
use blizzard_env::{Authenticated, BoxStream, Clock, Listener, Net, Peer};

use crate::load::{certs, check_chain, check_dir, check_validity, key, root_store};
use crate::transport::{Transport, TRANSPORT_READ_BUFFER};
use crate::{provider, PeerIdentity, TlsError, CA_CERT, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY};

/// How long a peer has to finish its TLS handshake, either way, counted
/// on the accepting side from the connection's arrival. A handshake takes
/// a few milliseconds; the bound only decides how long a stalled peer
/// holds its place.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

/// Connections a listener holds before their handshake is done (module
/// header; `blizzard_env::admission`).
pub const ADMISSION: AdmissionLimits = AdmissionLimits::with_deadline(HANDSHAKE_TIMEOUT);

/// How often a listener logs the handshakes it gave up on (at most).
const DROPPED_LOG_EVERY: Duration = Duration::from_secs(10);

/// A process's credentials for the cluster, read from one certificate
/// directory: `ca-cert.pem`, and either `server-cert.pem`/`server-key.pem`
/// (a server role: it serves and dials with that certificate) or
/// `client-cert.pem`/`client-key.pem` (a client: it only dials).
pub struct ClusterTls {
    /// Serving side: client certificates required and verified.
    server: Option<Arc<ServerConfig>>,
    /// Dialling a host:port: the server's name checked.
    client: Arc<ClientConfig>,
    /// Dialling a unix socket: the chain checked, not the name.
    client_unix: Arc<ClientConfig>,
    /// Who this process is, as its own certificate says.
    pub identity: PeerIdentity,
}

impl ClusterTls {
    /// Reads and checks the directory at `now`; every failure is one line
    /// naming the file and what to do.
    pub fn load(dir: &Path, now: SystemTime) -> Result<ClusterTls, TlsError> {
        check_dir(dir)?;
        let ca_path = dir.join(CA_CERT);
        if !ca_path.exists() {
            return Err(TlsError::new(format!(
                "{} is missing: cluster connections check every peer against the cluster's CA; copy its ca-cert.pem there",
                ca_path.display()
            )));
        }
        let roots = certs(&ca_path)?;
        let (cert_path, key_path, is_server) = if dir.join(SERVER_CERT).exists() {
            (dir.join(SERVER_CERT), dir.join(SERVER_KEY), true)
        } else if dir.join(CLIENT_CERT).exists() {
            (dir.join(CLIENT_CERT), dir.join(CLIENT_KEY), false)
        } else {
            return Err(TlsError::new(format!(
                "{} holds neither server-cert.pem nor client-cert.pem: cluster connections need this process's own certificate (`blizzard ca issue NAME --role ROLE`)",
                dir.display()
            )));
        };
        let chain = certs(&cert_path)?;
        check_validity(&cert_path, &chain[0], now)?;
        // Every certificate here also dials, so it must serve as a client's.
        check_chain(&cert_path, &chain, &ca_path, &roots, now, false)?;
        if is_server {
            check_chain(&cert_path, &chain, &ca_path, &roots, now, true)?;
        }
        let identity = PeerIdentity::of(chain[0].as_ref())
            .ok_or_else(|| TlsError::new(format!("{} does not parse as X.509", cert_path.display())))?;
        let store = Arc::new(root_store(&ca_path, roots)?);
        let p = provider();
        let mismatch = |e: rustls::Error| {
            TlsError::new(format!(
                "{} does not belong to {} ({e}): give the key the certificate was issued for",
                key_path.display(),
                cert_path.display()
            ))
        };
        let server = if is_server {
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(store.clone(), p.clone())
                    .build()
                    .map_err(|e| TlsError::new(format!("{}: {e}", ca_path.display())))?;
            let mut cfg = ServerConfig::builder_with_provider(p.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::new(format!("TLS protocol versions: {e}")))?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key(&key_path)?)
                .map_err(mismatch)?;
            cfg.ignore_client_order = true;
            Some(Arc::new(cfg))
        } else {
            None
        };
        let named = WebPkiServerVerifier::builder_with_provider(store, p.clone())
            .build()
            .map_err(|e| TlsError::new(format!("{}: {e}", ca_path.display())))?;
        let client_with = |verifier: Arc<dyn ServerCertVerifier>| -> Result<Arc<ClientConfig>, TlsError> {
            let cfg = ClientConfig::builder_with_provider(p.clone())
                .with_safe_default_protocol_versions()
                .map_err(|e| TlsError::new(format!("TLS protocol versions: {e}")))?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_client_auth_cert(chain.clone(), key(&key_path)?)
                .map_err(mismatch)?;
            Ok(Arc::new(cfg))
        };
        let client = client_with(named.clone())?;
        let client_unix = client_with(Arc::new(AnyName(named)))?;
        Ok(ClusterTls { server, client, client_unix, identity })
    }
}

/// The CA's verifier, minus the name check: for unix sockets, which have
/// no host name (the socket file's permissions say who may dial it).
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForNameContext {
                ..
            })) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A [`Net`] whose every connection is mutual TLS with the cluster's CA.
pub struct TlsNet {
    inner: Arc<dyn Net>,
    tls: Arc<ClusterTls>,
    clock: Arc<dyn Clock>,
}

impl TlsNet {
    /// `clock` bounds the handshakes.
    pub fn new(inner: Arc<dyn Net>, tls: ClusterTls, clock: Arc<dyn Clock>) -> TlsNet {
        TlsNet { inner, tls: Arc::new(tls), clock }
    }
}

/// The peer a TLS session authenticated, from its first certificate.
fn peer(certs: Option<&[CertificateDer<'_>]>) -> Option<Peer> {
    let id = PeerIdentity::of(certs?.first()?.as_ref())?;
    Some(Peer {
        name: id.name,
        role: id.role.map(|r| r.name().to_string()).unwrap_or_default(),
        serial: id.serial,
    })
}

fn failed(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, msg)
}

impl Net for TlsNet {
    fn connect(&self, addr: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let dial = self.inner.connect(addr);
        let tls = self.tls.clone();
        let clock = self.clock.clone();
        let addr = addr.to_string();
        async move {
            let (cfg, name) = match addr.strip_prefix("unix:") {
                Some(_) => (tls.client_unix.clone(), "localhost".to_string()),
                None => (tls.client.clone(), host_of(&addr).to_string()),
            };
            let name = ServerName::try_from(name)
                .map_err(|e| failed(format!("{addr}: not a host name a certificate can name: {e}")))?;
            let stream = dial.await?;
            let handshake = TlsConnector::from(cfg).connect(name, Transport::new(stream));
            let mut s = tokio::select! {
                biased;
                r = handshake => r.map_err(|e| failed(format!(
                    "TLS with {addr} failed: {e} (is it a blizzard server started with --tls-certificates from this cluster's CA, whose certificate names this host?)"
                )))?,
                _ = clock.sleep(HANDSHAKE_TIMEOUT) => {
                    return Err(failed(format!("TLS with {addr}: no handshake within {HANDSHAKE_TIMEOUT:?} (is it a blizzard server started with --tls-certificates?)")));
                }
            };
            s.get_mut().0.buffer(TRANSPORT_READ_BUFFER);
            let peer = peer(s.get_ref().1.peer_certificates()).unwrap_or_default();
            Ok(Box::new(Authenticated::new(Box::new(s), peer)) as BoxStream)
        }
        .boxed()
    }

    fn bind(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        let Some(cfg) = self.tls.server.clone() else {
            let who = self.tls.identity.to_string();
            let addr = addr.to_string();
            return async move {
                Err(failed(format!(
                    "cannot serve cluster connections on {addr} with the client certificate of {who}: a server needs server-cert.pem (`blizzard ca issue NAME --role tractserver|meta|nbd`)"
                )))
            }
            .boxed();
        };
        let bound = self.inner.bind(addr);
        let clock = self.clock.clone();
        async move {
            let inner: Arc<dyn Listener> = Arc::from(bound.await?);
            let local = inner.local_addr();
            let (tx, rx) = mpsc::channel(64);
            let admission = Admission::new(ADMISSION);
            let task = tokio::spawn(accept_loop(inner, TlsAcceptor::from(cfg), clock, tx, admission));
            Ok(Box::new(TlsListener { local, accepted: Mutex::new(rx), task }) as Box<dyn Listener>)
        }
        .boxed()
    }

    fn bind_plain(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        self.inner.bind_plain(addr)
    }

    fn attach_endpoint(&self, addr: &str, endpoint: blizzard_env::Endpoint) -> bool {
        self.inner.attach_endpoint(addr, endpoint)
    }

    fn endpoint(&self, addr: &str) -> Option<blizzard_env::Endpoint> {
        self.inner.endpoint(addr)
    }
}

/// `host` of `host:port` (brackets of an IPv6 address removed).
fn host_of(addr: &str) -> &str {
    let host = match addr.rfind(':') {
        Some(i) => &addr[..i],
        None => addr,
    };
    host.trim_start_matches('[').trim_end_matches(']')
}

type Accepted = io::Result<(BoxStream, String)>;

/// Accepts on `inner` and runs each handshake in a task of its own, as a
/// pending connection of `admission`; the ones that succeed go to `tx`.
/// Ends when the listener is dropped.
async fn accept_loop(
    inner: Arc<dyn Listener>,
    acceptor: TlsAcceptor,
    clock: Arc<dyn Clock>,
    tx: mpsc::Sender<Accepted>,
    admission: Arc<Admission>,
) {
    let mut logged = (clock.now(), admission.counts());
    loop {
        let (stream, addr) = match inner.accept().await {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors and the like: the oldest pending
                // handshake gives its up, else pause instead of spinning.
                tracing::warn!(error = %e, "cluster listener cannot accept");
                if !admission.evict_one() {
                    clock.sleep(Duration::from_millis(50)).await;
                }
                continue;
            }
        };
        let (acceptor, tx, admission2, clock2) =
            (acceptor.clone(), tx.clone(), admission.clone(), clock.clone());
        tokio::spawn(async move {
            let pending = admission2.admit(&addr);
            let s = match pending.run(&*clock2, handshake(stream, &acceptor, &pending)).await {
                Ok(Ok(Some(s))) => s,
                // Closed before sending anything: a port scan, a health check.
                Ok(Ok(None)) => return,
                Ok(Err(e)) => {
                    tracing::warn!(peer = %addr, error = %e, "cluster connection refused: TLS handshake failed (a peer without a certificate from this cluster's CA?)");
                    return;
                }
                // Counted; logged in sum by the accept loop.
                Err(why) => {
                    tracing::debug!(peer = %addr, "cluster connection dropped: TLS handshake {why}");
                    return;
                }
            };
            let Some(peer) = peer(s.get_ref().1.peer_certificates()) else {
                tracing::warn!(peer = %addr, "cluster connection refused: its certificate does not parse");
                return;
            };
            tracing::debug!(peer = %addr, %peer, "cluster connection authenticated");
            let _ = tx.send(Ok((Box::new(Authenticated::new(Box::new(s), peer)) as BoxStream, addr))).await;
        });
        logged = log_dropped(&*clock, &admission, logged);
    }
}

/// The server side of one handshake: waits for the peer's first byte
/// before it spends anything on the connection, then runs TLS. `None`:
/// the peer closed without sending anything.
async fn handshake(
    mut stream: BoxStream,
    acceptor: &TlsAcceptor,
    pending: &Pending,
) -> io::Result<Option<tokio_rustls::server::TlsStream<Transport<BoxStream>>>> {
    let mut first = [0u8; 1];
    if stream.read(&mut first).await? == 0 {
        return Ok(None);
    }
    pending.heard();
    let mut s = acceptor.accept(Transport::with_prefix(stream, &first)).await?;
    s.get_mut().0.buffer(TRANSPORT_READ_BUFFER);
    Ok(Some(s))
}

/// Logs, at most every [`DROPPED_LOG_EVERY`], how many handshakes were
/// given up since the last line (one line, not one per attacker's
/// connection); returns what to compare with next.
fn log_dropped(
    clock: &dyn Clock,
    admission: &Admission,
    last: (blizzard_env::Instant, AdmissionCounts),
) -> (blizzard_env::Instant, AdmissionCounts) {
    let now = clock.now();
    if now.duration_since(last.0) < DROPPED_LOG_EVERY {
        return last;
    }
    let c = admission.counts();
    let (evicted, timed_out) = (c.evicted - last.1.evicted, c.timed_out - last.1.timed_out);
    if evicted + timed_out > 0 {
        tracing::warn!(
            evicted,
            timed_out,
            pending = c.pending,
            "cluster connections dropped unfinished since the last report: evicted ones made room for newer connections, timed-out ones did not finish their TLS handshake within {HANDSHAKE_TIMEOUT:?} (peers that stall cannot delay the others; if these are your own processes, check their certificates and the network)"
        );
    }
    (now, c)
}

struct TlsListener {
    local: String,
    accepted: Mutex<mpsc::Receiver<Accepted>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // The loop holds the socket: closing the listener closes it.
        self.task.abort();
    }
}

impl Listener for TlsListener {
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        async move {
            match self.accepted.lock().await.recv().await {
                Some(a) => a,
                None => Err(io::Error::other("the TLS accept loop ended")),
            }
        }
        .boxed()
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }

    // No `fd`: a TLS session's state cannot be handed to another process.
}
