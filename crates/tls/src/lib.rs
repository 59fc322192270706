//! TLS for blizzard's servers and clients.
//!
//! - `load`: a certificate directory in the layout qemu, nbdkit and libnbd
//!   read (`ca-cert.pem`, `server-cert.pem`, `server-key.pem`; a client's
//!   `client-cert.pem`, `client-key.pem`) turned into a rustls
//!   configuration, checked at start-up: files present and parseable, the
//!   key matching the certificate, the certificate valid now and signed by
//!   the CA. Every failure is one line naming the file and what to do.
//! - `ca`: the certificates `blizzard ca init` / `blizzard ca issue` and
//!   `blizzard up` make (rcgen): a CA, and certificates for a role.
//! - `identity`: what a peer's certificate says it is (its name, its role).
//! - `net`: the cluster's own connections as mutual TLS, at the env seam
//!   (`TlsNet` wraps a process's `Net`).
//! - `transport`: what a TLS session reads its socket through (unbuffered
//!   until the handshake is done).
//!
//! Cryptography is ring's, passed to every configuration explicitly (no
//! process-wide provider is assumed).

mod ca;
mod identity;
mod load;
mod net;
mod transport;

pub use ca::{ensure_up_credentials, init_ca, issue, Issue, Role, UpCredentials};
pub use identity::{identity_of_file, serial_hex, PeerIdentity, ROLE_PREFIX};
pub use load::{client_config, server_config, server_name};
pub use net::{ClusterTls, TlsNet, HANDSHAKE_TIMEOUT};
pub use transport::{Transport, TRANSPORT_READ_BUFFER};

#[cfg(test)]
mod net_tests;
#[cfg(test)]
mod tests;

/// The files of a certificate directory, as qemu (`tls-creds-x509`), nbdkit
/// (`--tls-certificates`) and libnbd (`tls-certificates=`) name them.
pub const CA_CERT: &str = "ca-cert.pem";
/// The CA's private key (only in the CA's own directory).
pub const CA_KEY: &str = "ca-key.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
pub const CLIENT_CERT: &str = "client-cert.pem";
pub const CLIENT_KEY: &str = "client-key.pem";

/// A certificate directory that cannot be used, said in one line: which
/// file, what is wrong with it, what to do.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(pub String);

impl TlsError {
    pub(crate) fn new(msg: impl Into<String>) -> TlsError {
        TlsError(msg.into())
    }
}

/// The crypto provider every configuration here uses: ring's, with its
/// cipher suites ordered AES-128-GCM first, then AES-256-GCM, then
/// ChaCha20-Poly1305 (TLS 1.3 before TLS 1.2 within each).
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites.sort_by_key(|s| suite_rank(s.suite()));
    std::sync::Arc::new(p)
}

/// Lower ranks first (a stable sort keeps TLS 1.3 ahead of TLS 1.2).
fn suite_rank(s: rustls::CipherSuite) -> u8 {
    let name = format!("{s:?}");
    if name.contains("AES_128_GCM") {
        0
    } else if name.contains("AES_256_GCM") {
        1
    } else {
        2
    }
}
