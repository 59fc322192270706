//! Issue 26, point 2: an authenticated cluster. Three metadata replicas, two
//! tractservers and an NBD server, each a real process with a certificate
//! of its role from one CA (`blizzard ca`), every connection between them
//! mutual TLS; a client certificate writes and reads a volume through NBD
//! over TLS (nbdcopy). Then what must be refused is:
//!
//! - a client without a certificate learns nothing from the cluster;
//! - a process with a client certificate cannot register as a tractserver
//!   (its heartbeat is `Forbidden`), nor can an NBD server's certificate
//!   (the process exits naming the reason), and a client certificate
//!   cannot even serve;
//! - a tractserver without a certificate, or with one from another CA,
//!   cannot join: the cluster keeps its two members;
//! - a metadata server or tractserver does not start without
//!   certificates unless `--insecure` is given.
//!
//! The metadata server's `/metrics` stays plain HTTP.

// Real processes, sockets and files in real time, outside the env seam.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_proto::{ErrorCode, Heartbeat, Request};
use blizzard_rpc::{Conn, RpcError};

use crate::common::{
    blizzard, free_port, http_get, meta_args, nbd, ok, replica_args, s, spawn_tractserver_with, tool,
    DumpLogsOnPanic, Proc, Procs,
};

/// Members `blizzard status` shows as up.
fn members_up(meta: &str, certs: &Path) -> usize {
    let text = ok(blizzard(&["status", "--meta", meta, "--tls-certificates", &s(certs)]));
    text.lines().filter(|l| l.split_whitespace().nth(4) == Some("up")).count()
}

#[test]
fn an_authenticated_cluster_serves_its_own_and_refuses_the_rest() {
    let nbdcopy = tool("nbdcopy", "libnbd-bin");
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let _logs = DumpLogsOnPanic(dir.to_path_buf());
    let ca = dir.join("ca");
    let other_ca = dir.join("other-ca");
    ok(blizzard(&["ca", "init", &s(&ca)]));
    ok(blizzard(&["ca", "init", &s(&other_ca), "--name", "another cluster"]));
    for (name, role) in [("meta1", "meta"), ("meta2", "meta"), ("meta3", "meta")].into_iter().chain([
        ("ts0", "tractserver"),
        ("ts1", "tractserver"),
        ("nbd1", "nbd"),
        ("admin", "admin"),
    ]) {
        ok(blizzard(&["ca", "issue", name, "--role", role, &s(&ca)]));
    }
    ok(blizzard(&["ca", "issue", "ts9", "--role", "tractserver", &s(&other_ca)]));
    let certs = |name: &str| ca.join(name);

    // Three metadata replicas: their Raft traffic is mutual TLS too.
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let meta_addr = addrs.join(",");
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut metas: Vec<Proc> = (0..3)
        .map(|i| {
            let mut args = meta_args(&addrs[i], 2, 2, (i == 0).then_some(metrics.as_str()));
            // meta_args says --insecure; this cluster has certificates.
            args.retain(|a| a != "--insecure");
            let mut args = replica_args(dir, &addrs, i, args);
            args.extend(["--tls-certificates".to_string(), s(&certs(&format!("meta{}", i + 1)))]);
            Proc::spawn(
                &format!("meta{}", i + 1),
                &args,
                dir.join(format!("meta{}.log", i + 1)),
                addrs[i].clone(),
            )
        })
        .collect();
    let meta = metas.remove(0);
    let ts: Vec<Proc> = (0..2)
        .map(|i| {
            let c = s(&certs(&format!("ts{i}")));
            spawn_tractserver_with(dir, &meta_addr, i, "64MiB", &["--tls-certificates", &c])
        })
        .collect();
    let mut procs = Procs { meta, ts };
    procs.wait_listening(Duration::from_secs(60));
    let start = Instant::now();
    while members_up(&meta_addr, &certs("admin")) < 2 {
        assert!(start.elapsed() < Duration::from_secs(30), "the tractservers did not join");
        procs.check_running();
        std::thread::sleep(Duration::from_millis(100));
    }

    // Without a certificate a client learns nothing.
    let (listed, text) = blizzard(&["volume", "list", "--meta", &meta_addr]);
    assert!(!listed, "a client without a certificate listed volumes:\n{text}");

    // With one: a volume, served by an NBD server of its own certificate,
    // written and read back over NBD with TLS by a client certificate.
    let admin = s(&certs("admin"));
    ok(blizzard(&[
        "volume",
        "create",
        "v",
        "--size",
        "8MiB",
        "--replication",
        "2",
        // Eight 1 MiB tracts per segment: the volume fits the small disks.
        "--segment-tracts",
        "8",
        "--meta",
        &meta_addr,
        "--tls-certificates",
        &admin,
    ]));
    let mut server = nbd(dir, &meta_addr, "nbd", "v", &["--tls-certificates", &s(&certs("nbd1"))]);
    server.wait_log("NBD export", Duration::from_secs(30));
    let uri = format!("nbds+unix:///v?socket={}&tls-certificates={admin}", server.addr);
    let data: Vec<u8> = (0..4u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(dir.join("in.img"), &data).unwrap();
    let copy = |from: &str, to: &str| {
        let out = Command::new(&nbdcopy).args([from, to]).output().unwrap();
        assert!(out.status.success(), "nbdcopy {from} {to}: {}", String::from_utf8_lossy(&out.stderr));
    };
    copy(&s(&dir.join("in.img")), &uri);
    copy(&uri, &s(&dir.join("out.img")));
    let back = std::fs::read(dir.join("out.img")).unwrap();
    assert!(back[..data.len()] == data[..], "the volume read back other bytes than were written");

    // A process holding a client certificate cannot register as a
    // tractserver: its heartbeat is refused for its role.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let refused = rt.block_on(async {
        let tls = blizzard_tls::ClusterTls::load(&certs("admin"), std::time::SystemTime::now()).unwrap();
        let base = Env::real();
        let net = blizzard_tls::TlsNet::new(base.net.clone(), tls, base.clock.clone());
        let env = Env { net: Arc::new(net), ..base };
        let c = Conn::<blizzard_rpc::Blob>::connect(&env, &addrs[0]).await.unwrap();
        let hb = Heartbeat {
            ts_id: blizzard_core::TsId(77),
            addr: "127.0.0.1:1".into(),
            domain: String::new(),
            tract_size: 1 << 20,
            slots_total: 64,
            slots_used: 0,
            load: 0,
            disk_mbps: 0,
            assignment: None,
            filled: Vec::new(),
            fill: Default::default(),
            class: Default::default(),
            journal_used: 0,
            journal_bytes: 0,
        };
        c.call(&Request::Heartbeat(hb), Bytes::new()).await
    });
    match refused {
        Err(RpcError::Remote { reply, .. }) => {
            assert_eq!(reply.code, ErrorCode::Forbidden, "{reply:?}");
            assert!(reply.message.contains("(admin)"), "{}", reply.message);
        }
        other => panic!("a client certificate's heartbeat was not refused: {other:?}"),
    }

    // Nor can the blizzard binary with an NBD server's certificate: the
    // metadata service refuses it and it exits saying why.
    let mut as_nbd =
        spawn_tractserver_with(dir, &meta_addr, 2, "64MiB", &["--tls-certificates", &s(&certs("nbd1"))]);
    assert!(!as_nbd.wait_exit(Duration::from_secs(30)).success());
    let text = as_nbd.log_text();
    assert!(text.contains("refused this tractserver") && text.contains("(nbd)"), "{text}");
    // A client certificate cannot serve at all.
    let mut as_client = spawn_tractserver_with(dir, &meta_addr, 3, "64MiB", &["--tls-certificates", &admin]);
    assert!(!as_client.wait_exit(Duration::from_secs(30)).success());
    assert!(as_client.log_text().contains("server-cert.pem"), "{}", as_client.log_text());

    // Without a certificate, or with one from another CA, a tractserver
    // cannot join: it never hears from the metadata server.
    let mut plain = spawn_tractserver_with(dir, &meta_addr, 4, "64MiB", &[]);
    let mut foreign = spawn_tractserver_with(
        dir,
        &meta_addr,
        5,
        "64MiB",
        &["--tls-certificates", &s(&other_ca.join("ts9"))],
    );
    std::thread::sleep(Duration::from_secs(3));
    for p in [&mut plain, &mut foreign] {
        assert!(!p.log_text().contains(" listening on "), "{} joined:\n{}", p.name, p.log_text());
    }
    assert_eq!(members_up(&meta_addr, &certs("admin")), 2);
    let refusals = std::iter::once(&procs.meta).chain(&metas).map(|m| m.log_text()).collect::<String>();
    assert!(refusals.contains("TLS handshake failed"), "no metadata replica logged a refusal");
    drop((plain, foreign));

    // /metrics is plain HTTP still.
    let text = rt.block_on(http_get(&metrics, "/metrics"));
    assert!(text.contains("blizzard_"), "{text}");
    procs.check_running();
    metas.iter_mut().for_each(Proc::check_running);
    server.check_running();
}

#[test]
fn a_cluster_server_needs_certificates_or_insecure() {
    let listen = format!("127.0.0.1:{}", free_port());
    let d = tempfile::tempdir().unwrap();
    let refused = |args: &[&str], want: &str| {
        let out = Command::new(crate::common::bin::blizzard_bin()).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "blizzard {args:?} started:\n{text}");
        assert!(text.contains(want), "{text}");
    };
    // Refused at once without certificates, even on loopback, and with
    // both (the certificates would go unused).
    refused(&["meta", "--listen", &listen], "--insecure");
    let disk = s(&d.path().join("ts.disk"));
    refused(&["tractserver", "--disk", &disk, "--meta", &listen, "--listen", "127.0.0.1:0"], "--insecure");
    ok(blizzard(&["ca", "init", &s(&d.path().join("ca"))]));
    ok(blizzard(&["ca", "issue", "m", "--role", "meta", &s(&d.path().join("ca"))]));
    let certs = s(&d.path().join("ca/m"));
    refused(&["meta", "--listen", &listen, "--insecure", "--tls-certificates", &certs], "one or the other");
    // With --insecure it serves.
    let args: Vec<String> =
        ["meta", "--listen", &listen, "--insecure"].iter().map(|a| a.to_string()).collect();
    let mut meta = Proc::spawn("meta", &args, d.path().join("meta.log"), listen.clone());
    meta.wait_log("metadata server listening", Duration::from_secs(30));
}
