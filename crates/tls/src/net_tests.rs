//! `TlsNet` over real sockets: both ends authenticated, roles carried to
//! the server, and every kind of bad peer refused without stopping the
//! listener.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::path::Path;
use std::sync::Arc;
use std::time::SystemTime;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use blizzard_env::{peer_of, BoxStream, Listener, Net, RealClock, RealNet};

use crate::*;

fn now() -> SystemTime {
    SystemTime::now()
}

/// A CA in `root/NAME-ca` and, from it, `root/NAME-ROLE` for each role
/// (servers named for 127.0.0.1 only).
fn make(root: &Path, ca: &str, roles: &[(&str, Role)]) {
    init_ca(&root.join(ca), ca, now()).unwrap();
    for (name, role) in roles {
        let req = Issue { name: name.to_string(), role: *role, hosts: vec!["127.0.0.1".into()] };
        issue(&root.join(ca), &req, &root.join(name), now()).unwrap();
    }
}

fn net(dir: &Path) -> TlsNet {
    TlsNet::new(Arc::new(RealNet), ClusterTls::load(dir, now()).unwrap(), Arc::new(RealClock))
}

/// Serves an echo of one line per connection on `l`, forever; each
/// connection's peer is sent back first, as `name/role\n`.
fn echo(l: Box<dyn Listener>) {
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else { return };
            tokio::spawn(async move {
                let who = peer_of(&*s).map(|p| format!("{}/{}\n", p.name, p.role)).unwrap_or("none\n".into());
                let _ = s.write_all(who.as_bytes()).await;
                let mut b = [0u8; 4];
                if s.read_exact(&mut b).await.is_ok() {
                    let _ = s.write_all(&b).await;
                }
            });
        }
    });
}

/// Says "ping" on `s` and reads back what the echo server says.
async fn ping(mut s: BoxStream) -> String {
    s.write_all(b"ping").await.unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 1];
    while s.read_exact(&mut b).await.is_ok() {
        got.push(b[0]);
    }
    String::from_utf8(got).unwrap()
}

#[tokio::test]
async fn both_ends_are_authenticated_and_the_server_learns_the_role() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), "ca", &[("ts1", Role::Tractserver), ("alice", Role::Client)]);
    let server = net(&d.path().join("ts1"));
    let l = server.bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    echo(l);
    let s = net(&d.path().join("alice")).connect(&addr).await.unwrap();
    let theirs = peer_of(&*s).unwrap();
    assert_eq!((theirs.name.as_str(), theirs.role.as_str()), ("ts1", "tractserver"));
    assert_eq!(ping(s).await, "alice/client\nping");
    // A server certificate dials too (tractservers copy from each other).
    let s = server.connect(&addr).await.unwrap();
    assert_eq!(ping(s).await, "ts1/tractserver\nping");
}

#[tokio::test]
async fn bad_peers_are_refused_and_the_listener_serves_on() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), "ca", &[("ts1", Role::Tractserver), ("alice", Role::Client)]);
    make(d.path(), "other-ca", &[("mallory", Role::Client), ("fake-ts", Role::Tractserver)]);
    let l = net(&d.path().join("ts1")).bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    echo(l);

    // A plain client: no TLS, so nothing of its bytes reaches the server.
    let mut plain = RealNet.connect(&addr).await.unwrap();
    plain.write_all(b"ping plain bytes, not a ClientHello").await.unwrap();
    let mut got = Vec::new();
    let _ = plain.read_to_end(&mut got).await;
    assert!(!String::from_utf8_lossy(&got).contains("ping"), "a plain client was served: {got:?}");

    // A stalled peer holds a handshake task, not the listener.
    let _stalled = RealNet.connect(&addr).await.unwrap();

    // A certificate from another CA: refused by the server.
    let mallory = net(&d.path().join("mallory"));
    let served = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        match mallory.connect(&addr).await {
            Err(_) => String::new(),
            Ok(s) => ping(s).await,
        }
    })
    .await
    .expect("a client of another CA hung");
    let refused = served.is_empty();
    assert!(refused, "a client certificate of another CA was served");

    // A server of another CA: the client refuses it.
    let fake = net(&d.path().join("fake-ts")).bind("127.0.0.1:0").await.unwrap();
    let fake_addr = fake.local_addr();
    echo(fake);
    let e = net(&d.path().join("alice")).connect(&fake_addr).await.err().unwrap();
    assert!(e.to_string().contains("TLS with"), "{e}");

    // A name the server's certificate does not hold ("localhost", when it
    // names 127.0.0.1 only).
    let port = addr.rsplit(':').next().unwrap();
    let e = net(&d.path().join("alice")).connect(&format!("localhost:{port}")).await.err().unwrap();
    assert!(e.to_string().contains("names this host"), "{e}");

    // And the listener still serves a good client.
    let s = net(&d.path().join("alice")).connect(&addr).await.unwrap();
    assert_eq!(ping(s).await, "alice/client\nping");
}

#[tokio::test]
async fn a_unix_socket_checks_the_ca_not_the_name() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), "ca", &[("ts1", Role::Tractserver), ("alice", Role::Client)]);
    let path = d.path().join("ts.sock");
    let l = net(&d.path().join("ts1")).bind(&format!("unix:{}", path.display())).await.unwrap();
    let addr = l.local_addr();
    echo(l);
    let s = net(&d.path().join("alice")).connect(&addr).await.unwrap();
    assert_eq!(ping(s).await, "alice/client\nping");
}

#[tokio::test]
async fn a_client_certificate_cannot_serve_and_directories_are_checked() {
    let d = tempfile::tempdir().unwrap();
    make(d.path(), "ca", &[("alice", Role::Client)]);
    let e = net(&d.path().join("alice")).bind("127.0.0.1:0").await.err().unwrap();
    assert!(e.to_string().contains("server-cert.pem"), "{e}");
    let load = |p: &Path| ClusterTls::load(p, now()).err().unwrap().to_string();
    assert!(load(&d.path().join("none")).contains("does not exist"));
    // The CA's own directory holds no certificate of a process.
    assert!(load(&d.path().join("ca")).contains("neither"), "{}", load(&d.path().join("ca")));
    std::fs::remove_file(d.path().join("alice/ca-cert.pem")).unwrap();
    assert!(load(&d.path().join("alice")).contains("ca-cert.pem is missing"));
}

/// Issue 56: more idle peers than the listener keeps pending, and more
/// trickling a byte at a time, hold up no handshake: a legitimate dial
/// made after all of them connects, every time. (Before, 64 idle peers
/// made every new handshake wait for one of them to time out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_peers_hold_up_no_handshake() {
    blizzard_env::raise_fd_limit();
    let d = tempfile::tempdir().unwrap();
    make(d.path(), "ca", &[("ts1", Role::Tractserver), ("alice", Role::Client)]);
    let l = net(&d.path().join("ts1")).bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr();
    echo(l);
    let client = net(&d.path().join("alice"));
    let mut held = Vec::new();
    // Past the per-source bound (1,024), so the oldest are pushed out.
    for i in 0..1300 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if i % 10 == 0 {
            // The start of a 16 KiB record: the server waits for the rest.
            s.write_all(&[0x16, 0x03, 0x01, 0x40]).await.unwrap();
        }
        held.push(s);
        if i % 100 == 99 {
            let s = client.connect(&addr).await.unwrap();
            assert_eq!(ping(s).await, "alice/client\nping", "after {} idle peers", i + 1);
        }
    }
    // Some of the oldest idle peers were closed to make room.
    let mut closed = 0;
    for s in &mut held[..300] {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(std::time::Duration::from_millis(1), s.read(&mut b)).await {
            closed += 1;
        }
    }
    assert!(closed > 0, "no idle peer was pushed out");
}
