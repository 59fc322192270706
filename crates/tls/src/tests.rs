//! Certificate directories made by `ca`, loaded by `load`, and the checks
//! that refuse bad ones; a handshake between the two configurations.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::{ClientConnection, ServerConnection};

use crate::*;

const YEAR: Duration = Duration::from_secs(365 * 86_400);

/// The real time: rustls checks certificates against the real clock
/// during a handshake.
#[allow(clippy::disallowed_methods)]
fn now() -> SystemTime {
    SystemTime::now()
}

fn local() -> Vec<String> {
    vec!["localhost".into(), "127.0.0.1".into()]
}

/// A CA in `root/ca`, an NBD server's directory `root/server` and a
/// client's `root/client`, issued at `at`.
fn make(root: &Path, at: SystemTime) {
    init_ca(&root.join("ca"), "test CA", at).unwrap();
    let server = Issue { name: "nbd-1".into(), role: Role::Nbd, hosts: local() };
    issue(&root.join("ca"), &server, &root.join("server"), at).unwrap();
    let client = Issue { name: "alice".into(), role: Role::Client, hosts: vec![] };
    issue(&root.join("ca"), &client, &root.join("client"), at).unwrap();
}

/// Runs a handshake between the two configurations in memory; the
/// server's view of the client, or the first error either side hit.
fn handshake(
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
) -> Result<Option<PeerIdentity>, rustls::Error> {
    handshake_suite(server, client).map(|(peer, _)| peer)
}

/// [`handshake`], also returning the cipher suite the two agreed on.
fn handshake_suite(
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
) -> Result<(Option<PeerIdentity>, Option<rustls::CipherSuite>), rustls::Error> {
    let mut s = ServerConnection::new(server).unwrap();
    let mut c = ClientConnection::new(client, server_name("localhost").unwrap()).unwrap();
    for _ in 0..20 {
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).unwrap();
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            s.read_tls(&mut rd).unwrap();
        }
        s.process_new_packets()?;
        let mut buf = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut buf).unwrap();
        }
        let mut rd = &buf[..];
        while !rd.is_empty() {
            c.read_tls(&mut rd).unwrap();
        }
        c.process_new_packets()?;
        if !s.is_handshaking() && !c.is_handshaking() {
            let peer = s.peer_certificates().and_then(|p| PeerIdentity::of(p[0].as_ref()));
            return Ok((peer, s.negotiated_cipher_suite().map(|c| c.suite())));
        }
    }
    panic!("handshake did not finish");
}

#[test]
fn issued_directories_load_and_shake_hands() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), now());
    let server = server_config(&d.path().join("server"), true, now()).unwrap();
    let client = client_config(&d.path().join("client"), now()).unwrap();
    let peer = handshake(server, client).unwrap().unwrap();
    assert_eq!((peer.name.as_str(), peer.role), ("alice", Some(Role::Client)));
    assert!(!peer.serial.is_empty() && peer.serial.bytes().all(|b| b.is_ascii_hexdigit()), "{}", peer.serial);
    assert_eq!(peer.to_string(), "alice (client)");
    // A client with only the CA (no certificate of its own) is refused when
    // peers are verified, and let in when they are not.
    let anon = d.path().join("anon");
    std::fs::create_dir(&anon).unwrap();
    std::fs::copy(d.path().join("ca").join(CA_CERT), anon.join(CA_CERT)).unwrap();
    let anon = client_config(&anon, now()).unwrap();
    let strict = server_config(&d.path().join("server"), true, now()).unwrap();
    assert!(handshake(strict, anon.clone()).is_err());
    let lax = server_config(&d.path().join("server"), false, now()).unwrap();
    assert_eq!(handshake(lax, anon).unwrap(), None);
    // Key files are private.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.path().join("server").join(SERVER_KEY)).unwrap().permissions().mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");
}

#[test]
fn a_client_certificate_from_another_ca_is_refused_even_when_optional() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    make(a.path(), now());
    make(b.path(), now());
    // b's client trusts a's CA (so it accepts a's server), but its own
    // certificate is b's.
    let mixed = b.path().join("client");
    std::fs::copy(a.path().join("ca").join(CA_CERT), mixed.join(CA_CERT)).unwrap();
    let client = client_config(&mixed, now());
    // The client's own check catches it first...
    let e = client.unwrap_err().to_string();
    assert!(e.contains("is not signed by the CA"), "{e}");
    // ...and a server refuses it, even with client certificates optional.
    std::fs::remove_file(mixed.join(CLIENT_CERT)).unwrap();
    let plain = client_config(&mixed, now()).unwrap();
    let lax = server_config(&a.path().join("server"), false, now()).unwrap();
    assert!(handshake(lax, plain).is_ok());
}

#[test]
fn bad_directories_are_one_line_errors() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), now());
    let server = d.path().join("server");
    let check = |dir: &Path, verify: bool, at: SystemTime, want: &str| {
        let e = server_config(dir, verify, at).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} lacks {want:?}");
        assert!(!e.contains('\n'), "{e:?}");
    };
    check(&d.path().join("nowhere"), false, now(), "does not exist");
    // Expired, and not yet valid.
    check(&server, false, now() + 3 * YEAR, "expired on");
    check(&server, false, now() - 2 * YEAR, "not valid before");
    // The key of another certificate.
    let other = d.path().join("other");
    let o = Issue { name: "nbd-2".into(), role: Role::Nbd, hosts: local() };
    issue(&d.path().join("ca"), &o, &other, now()).unwrap();
    let swapped = d.path().join("swapped");
    std::fs::create_dir(&swapped).unwrap();
    for f in [CA_CERT, SERVER_CERT] {
        std::fs::copy(server.join(f), swapped.join(f)).unwrap();
    }
    std::fs::copy(other.join(SERVER_KEY), swapped.join(SERVER_KEY)).unwrap();
    check(&swapped, false, now(), "does not belong to");
    // Another CA's certificate.
    let e = tempfile::tempdir().unwrap();
    make(e.path(), now());
    std::fs::copy(e.path().join("ca").join(CA_CERT), swapped.join(CA_CERT)).unwrap();
    std::fs::copy(other.join(SERVER_KEY), swapped.join(SERVER_KEY)).unwrap();
    std::fs::copy(other.join(SERVER_CERT), swapped.join(SERVER_CERT)).unwrap();
    check(&swapped, false, now(), "is not signed by the CA");
    // A client's certificate used as a server's.
    let c = d.path().join("client");
    let misuse = d.path().join("misuse");
    std::fs::create_dir(&misuse).unwrap();
    std::fs::copy(c.join(CA_CERT), misuse.join(CA_CERT)).unwrap();
    std::fs::copy(c.join(CLIENT_CERT), misuse.join(SERVER_CERT)).unwrap();
    std::fs::copy(c.join(CLIENT_KEY), misuse.join(SERVER_KEY)).unwrap();
    check(&misuse, false, now(), "is not a server certificate");
    // Garbage, an empty certificate file, a missing key.
    std::fs::write(swapped.join(SERVER_CERT), b"not pem at all").unwrap();
    check(&swapped, false, now(), "holds no certificate");
    std::fs::remove_file(swapped.join(SERVER_KEY)).unwrap();
    std::fs::copy(other.join(SERVER_CERT), swapped.join(SERVER_CERT)).unwrap();
    check(&swapped, false, now(), "cannot read");
    // Verifying clients needs the CA.
    std::fs::remove_file(other.join(CA_CERT)).unwrap();
    check(&other, true, now(), "--tls-verify-peer");
    assert!(server_config(&other, false, now()).is_ok());
}

#[test]
fn issuing_never_overwrites() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), now());
    let e = init_ca(&d.path().join("ca"), "again", now()).unwrap_err().to_string();
    assert!(e.contains("exists already"), "{e}");
    let again = Issue { name: "alice".into(), role: Role::Client, hosts: vec![] };
    let e = issue(&d.path().join("ca"), &again, &d.path().join("client"), now()).unwrap_err().to_string();
    assert!(e.contains("exists already"), "{e}");
    let e = issue(&d.path().join("nope"), &again, &d.path().join("x"), now()).unwrap_err().to_string();
    assert!(e.contains("blizzard ca init"), "{e}");
}

#[test]
fn up_credentials_are_made_once_and_renewed_when_due() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("tls");
    let first = ensure_up_credentials(&dir, &local(), now()).unwrap();
    assert!(first.made);
    let cert = || std::fs::read(dir.join(SERVER_CERT)).unwrap();
    let before = cert();
    let again = ensure_up_credentials(&dir, &local(), now() + YEAR).unwrap();
    assert!(!again.made);
    assert_eq!(cert(), before);
    server_config(&first.server_dir, true, now()).unwrap();
    client_config(&first.client_dir, now()).unwrap();
    // A new host, and a certificate close to its end, get a new one from
    // the same CA; the client's directory still works with it.
    let mut hosts = local();
    hosts.push("10.1.2.3".into());
    assert!(ensure_up_credentials(&dir, &hosts, now()).unwrap().made);
    let renewed = cert();
    assert_ne!(renewed, before);
    let late = now() + 2 * YEAR - Duration::from_secs(86_400);
    assert!(ensure_up_credentials(&dir, &hosts, late).unwrap().made);
    assert_ne!(cert(), renewed);
    server_config(&dir, true, late).unwrap();
    // Renewed now (as the handshake's clock is), it shakes hands.
    std::fs::remove_file(dir.join(SERVER_CERT)).unwrap();
    ensure_up_credentials(&dir, &hosts, now()).unwrap();
    let s = server_config(&dir, true, now()).unwrap();
    let c = client_config(&first.client_dir, now()).unwrap();
    assert!(handshake(s, c).is_ok());
}

/// The server's order of cipher suites wins: AES-128-GCM, though a client
/// like GnuTLS (here rustls with its default order) lists AES-256-GCM
/// first.
#[test]
fn the_server_picks_aes_128_gcm_whatever_the_client_prefers() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), now());
    let p = rustls::crypto::ring::default_provider();
    assert_eq!(p.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_256_GCM_SHA384);
    let mut roots = rustls::RootCertStore::empty();
    let ca = std::fs::read(d.path().join("ca").join(CA_CERT)).unwrap();
    use rustls::pki_types::pem::PemObject;
    roots.add(rustls::pki_types::CertificateDer::from_pem_slice(&ca).unwrap()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(p))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let server = server_config(&d.path().join("server"), false, now()).unwrap();
    let (_, suite) = handshake_suite(server, Arc::new(client)).unwrap();
    assert_eq!(suite, Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256));
}
