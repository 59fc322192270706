//! A certificate directory turned into a rustls configuration, checked
//! before anything is served: a bad directory is one line at start-up,
//! never a failed handshake at the first client.
//!
//! | check | error names |
//! |---|---|
//! | directory and files exist, readable | the path, and `blizzard ca` to make them |
//! | PEM parses, at least one certificate, one private key | the file |
//! | the certificate is valid now (not before / not after) | the dates |
//! | the key belongs to the certificate | both files |
//! | the certificate chains to `ca-cert.pem` for its use (when there) | the CA file |
//! | `ca-cert.pem` present when peers must be verified | the flag that needs it |

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use x509_parser::prelude::*;

use crate::{provider, TlsError, CA_CERT, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY};

/// The server configuration for the directory `dir` (`ca-cert.pem`,
/// `server-cert.pem`, `server-key.pem`), checked at `now`.
///
/// Client certificates: with `verify_peer`, every client must present one
/// signed by the CA in `ca-cert.pem` (required then); without, a client
/// may present none, and one it presents is still verified against the CA
/// (when the directory has one) and refused if it does not chain.
pub fn server_config(dir: &Path, verify_peer: bool, now: SystemTime) -> Result<Arc<ServerConfig>, TlsError> {
    check_dir(dir)?;
    let cert_path = dir.join(SERVER_CERT);
    let chain = certs(&cert_path)?;
    let key = key(&dir.join(SERVER_KEY))?;
    check_validity(&cert_path, &chain[0], now)?;
    let ca_path = dir.join(CA_CERT);
    let roots = if ca_path.exists() {
        let roots = certs(&ca_path)?;
        check_chain(&cert_path, &chain, &ca_path, &roots, now, true)?;
        Some(roots)
    } else if verify_peer {
        return Err(TlsError::new(format!(
            "{} is missing: --tls-verify-peer checks client certificates against that CA; add the CA's certificate there",
            ca_path.display()
        )));
    } else {
        None
    };
    let p = provider();
    let builder = ServerConfig::builder_with_provider(p.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new(format!("TLS protocol versions: {e}")))?;
    let builder = match roots {
        Some(roots) => {
            let store = root_store(&ca_path, roots)?;
            // No CA names in the certificate request: a client that picks
            // its certificate by the names a server asks for (GnuTLS:
            // libnbd, qemu) would otherwise send none when its CA is
            // another one, and be served as anonymous instead of refused.
            // Asked for nothing in particular, it sends what it has, and
            // a certificate that does not chain to the CA is refused
            // (issue 56).
            let v =
                WebPkiClientVerifier::builder_with_provider(Arc::new(store), p).clear_root_hint_subjects();
            let v = if verify_peer { v } else { v.allow_unauthenticated() };
            let v = v.build().map_err(|e| TlsError::new(format!("{}: {e}", ca_path.display())))?;
            builder.with_client_cert_verifier(v)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_single_cert(chain, key).map_err(|e| {
        TlsError::new(format!(
            "{} does not belong to {} ({e}): give the key the certificate was issued for",
            dir.join(SERVER_KEY).display(),
            cert_path.display()
        ))
    })?;
    // The server picks the suite in its own order (`provider()`: AES-128-GCM
    // first), not the client's: GnuTLS (libnbd, qemu) lists AES-256-GCM
    // first, which costs more per byte for no protection a block store's
    // traffic needs.
    cfg.ignore_client_order = true;
    Ok(Arc::new(cfg))
}

/// A client configuration for the directory `dir`: trusts the CA in
/// `ca-cert.pem`, and presents `client-cert.pem`/`client-key.pem` if they
/// are there (checked at `now` as a server's are).
pub fn client_config(dir: &Path, now: SystemTime) -> Result<Arc<ClientConfig>, TlsError> {
    check_dir(dir)?;
    let ca_path = dir.join(CA_CERT);
    let store = root_store(&ca_path, certs(&ca_path)?)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new(format!("TLS protocol versions: {e}")))?
        .with_root_certificates(store);
    let cert_path = dir.join(CLIENT_CERT);
    if !cert_path.exists() {
        return Ok(Arc::new(builder.with_no_client_auth()));
    }
    let chain = certs(&cert_path)?;
    check_validity(&cert_path, &chain[0], now)?;
    check_chain(&cert_path, &chain, &ca_path, &certs(&ca_path)?, now, false)?;
    let key_path = dir.join(CLIENT_KEY);
    let cfg = builder.with_client_auth_cert(chain, key(&key_path)?).map_err(|e| {
        TlsError::new(format!(
            "{} does not belong to {} ({e}): give the key the certificate was issued for",
            key_path.display(),
            cert_path.display()
        ))
    })?;
    Ok(Arc::new(cfg))
}

/// The name a client checks a server's certificate against, for an
/// address `host:port` (an IP or a DNS name).
pub fn server_name(host: &str) -> Option<ServerName<'static>> {
    ServerName::try_from(host.to_string()).ok()
}

pub(crate) fn check_dir(dir: &Path) -> Result<(), TlsError> {
    if !dir.is_dir() {
        return Err(TlsError::new(format!(
            "TLS certificate directory {} does not exist: make one with `blizzard ca init` and `blizzard ca issue`, or give --tls off",
            dir.display()
        )));
    }
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::NotFound {
            "; a certificate directory holds ca-cert.pem, server-cert.pem and server-key.pem (or client-*.pem): `blizzard ca issue` writes them"
        } else {
            ""
        };
        TlsError::new(format!("cannot read {}: {e}{hint}", path.display()))
    })
}

/// Every certificate in a PEM file; at least one.
pub(crate) fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(format!("{} is not a PEM certificate file: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError::new(format!(
            "{} holds no certificate (no BEGIN CERTIFICATE block)",
            path.display()
        )));
    }
    Ok(certs)
}

pub(crate) fn key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
        TlsError::new(format!(
            "{} holds no usable private key (PKCS#8, PKCS#1 or SEC1 PEM): {e}",
            path.display()
        ))
    })
}

pub(crate) fn root_store(
    ca_path: &Path,
    roots: Vec<CertificateDer<'static>>,
) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for c in roots {
        store.add(c).map_err(|e| {
            TlsError::new(format!("{} is not a usable CA certificate: {e}", ca_path.display()))
        })?;
    }
    Ok(store)
}

fn date(t: ASN1Time) -> String {
    t.to_datetime().to_string()
}

/// The certificate's validity period covers `now`.
pub(crate) fn check_validity(
    path: &Path,
    cert: &CertificateDer<'_>,
    now: SystemTime,
) -> Result<(), TlsError> {
    let (_, x) = X509Certificate::from_der(cert.as_ref())
        .map_err(|e| TlsError::new(format!("{} does not parse as X.509: {e}", path.display())))?;
    let v = x.validity();
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    if secs > v.not_after.timestamp() {
        return Err(TlsError::new(format!(
            "{} expired on {}: issue a new certificate (`blizzard ca issue`)",
            path.display(),
            date(v.not_after)
        )));
    }
    if secs < v.not_before.timestamp() {
        return Err(TlsError::new(format!(
            "{} is not valid before {}: check this host's clock",
            path.display(),
            date(v.not_before)
        )));
    }
    Ok(())
}

/// The certificate chains to one of `roots` for a server's use (or a
/// client's).
pub(crate) fn check_chain(
    path: &Path,
    chain: &[CertificateDer<'static>],
    ca_path: &Path,
    roots: &[CertificateDer<'static>],
    now: SystemTime,
    server: bool,
) -> Result<(), TlsError> {
    let anchors = roots
        .iter()
        .map(|c| webpki::anchor_from_trusted_cert(c).map(|a| a.to_owned()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::new(format!("{} is not a usable CA certificate: {e}", ca_path.display())))?;
    let ee = webpki::EndEntityCert::try_from(&chain[0])
        .map_err(|e| TlsError::new(format!("{} is not a usable certificate: {e}", path.display())))?;
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let usage = if server { webpki::KeyUsage::server_auth() } else { webpki::KeyUsage::client_auth() };
    let algs = provider().signature_verification_algorithms.all;
    ee.verify_for_usage(
        algs,
        &anchors,
        &chain[1..],
        UnixTime::since_unix_epoch(std::time::Duration::from_secs(secs)),
        usage,
        None,
        None,
    )
    .map(|_| ())
    .map_err(|e| {
        let why = match e {
            // A CA of another name, or one of the same name with
            // another key.
            webpki::Error::UnknownIssuer | webpki::Error::InvalidSignatureForPublicKey => {
                "is not signed by the CA in".to_string()
            }
            webpki::Error::RequiredEkuNotFoundContext(_) => format!(
                "is not a {} certificate (extended key usage) for the CA in",
                if server { "server" } else { "client" }
            ),
            other => format!("does not verify ({other:?}) against"),
        };
        TlsError::new(format!(
            "{} {why} {}: issue it from that CA (`blizzard ca issue`)",
            path.display(),
            ca_path.display()
        ))
    })
}
