//! NBD over TLS against libnbd (nbdinfo, nbdcopy), qemu-img and a client
//! written from the spec: what a client learns before a required upgrade
//! (nothing), client certificates, a STARTTLS injection, and handshakes
//! that stall, are garbage or break off while others are served.

#![allow(clippy::unwrap_used)]
// Real processes, files and sockets outside the env seam.
#![allow(clippy::disallowed_methods)]

use crate::common;
use crate::tools::{fails, need, run};

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use blizzard_env::{BoxStream, Env};
use blizzard_nbd::proto::*;
use blizzard_nbd::{NbdConfig, NbdTls};
use blizzard_tls::{issue, Issue, Role};
use blizzard_volume::{CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 4 << 20;

/// A CA with an NBD server's directory `server`, a client's `client`, a
/// directory `anon` with only the CA, `rogue`: a client certificate
/// from another CA of the same name, next to this CA's certificate, and
/// `stranger`: one from a CA of another name (a client picking its
/// certificate by the CA names a server asks for would send none).
struct Certs {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Certs {
    fn new() -> Certs {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let now = SystemTime::now();
        let hosts = vec!["localhost".to_string(), "127.0.0.1".to_string()];
        blizzard_tls::init_ca(&root.join("ca"), "test CA", now).unwrap();
        let server = Issue { name: "nbd-test".into(), role: Role::Nbd, hosts };
        issue(&root.join("ca"), &server, &root.join("server"), now).unwrap();
        let client = Issue { name: "alice".into(), role: Role::Client, hosts: vec![] };
        issue(&root.join("ca"), &client, &root.join("client"), now).unwrap();
        for name in ["bob", "carol"] {
            let c = Issue { name: name.into(), role: Role::Client, hosts: vec![] };
            issue(&root.join("ca"), &c, &root.join(name), now).unwrap();
        }
        // A tractserver's certificate named "alice", laid out as a
        // client's: it must not pass for alice.
        let ts = Issue { name: "alice".into(), role: Role::Tractserver, hosts: vec![] };
        issue(&root.join("ca"), &ts, &root.join("ts-alice"), now).unwrap();
        for (from, to) in [("server-cert.pem", "client-cert.pem"), ("server-key.pem", "client-key.pem")] {
            std::fs::rename(root.join("ts-alice").join(from), root.join("ts-alice").join(to)).unwrap();
        }
        std::fs::create_dir(root.join("anon")).unwrap();
        std::fs::copy(root.join("ca/ca-cert.pem"), root.join("anon/ca-cert.pem")).unwrap();
        blizzard_tls::init_ca(&root.join("other-ca"), "test CA", now).unwrap();
        let mallory = Issue { name: "mallory".into(), role: Role::Client, hosts: vec![] };
        issue(&root.join("other-ca"), &mallory, &root.join("rogue"), now).unwrap();
        std::fs::copy(root.join("ca/ca-cert.pem"), root.join("rogue/ca-cert.pem")).unwrap();
        blizzard_tls::init_ca(&root.join("stranger-ca"), "someone else's CA", now).unwrap();
        let eve = Issue { name: "alice".into(), role: Role::Client, hosts: vec![] };
        issue(&root.join("stranger-ca"), &eve, &root.join("stranger"), now).unwrap();
        std::fs::copy(root.join("ca/ca-cert.pem"), root.join("stranger/ca-cert.pem")).unwrap();
        Certs { _dir: dir, root }
    }

    fn dir(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    fn server_tls(&self, verify_peer: bool, required: bool) -> NbdTls {
        let config =
            blizzard_tls::server_config(&self.dir("server"), verify_peer, SystemTime::now()).unwrap();
        NbdTls { config, required }
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn vols() -> [blizzard_volume::VolumeSpec; 2] {
    [
        spec("disk", SIZE, CommitMode::WriteThrough, FlushPolicy::Durable),
        spec("copy", SIZE, CommitMode::FastAck, FlushPolicy::Durable),
    ]
}

fn nbds(addr: &str, export: &str, certs: &Path) -> String {
    format!("nbds://{addr}/{export}?tls-certificates={}", certs.display())
}

/// A raw connection that has read the greeting and sent fixed-newstyle
/// flags.
async fn raw(addr: &str) -> BoxStream {
    let mut s = Env::real().connect(addr).await.unwrap();
    greet(&mut s).await;
    send_raw(&mut s, &(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes()).await;
    s
}

/// Sends STARTTLS on a raw connection, expects its ACK, and runs a TLS
/// handshake as a client of `dir`.
async fn start_tls(mut s: BoxStream, dir: &Path) -> std::io::Result<BoxStream> {
    send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
    let (h, _) = read_option_reply(&mut s).await;
    assert_eq!((h.option, h.reply_type), (NBD_OPT_STARTTLS, NBD_REP_ACK));
    tls_handshake(s, dir).await
}

/// A TLS handshake as a client of `dir` on `s`.
async fn tls_handshake(s: BoxStream, dir: &Path) -> std::io::Result<BoxStream> {
    let cfg = blizzard_tls::client_config(dir, SystemTime::now()).unwrap();
    let name = blizzard_tls::server_name("localhost").unwrap();
    let s = tokio_rustls::TlsConnector::from(cfg).connect(name, s).await?;
    Ok(Box::new(s))
}

/// Negotiates `export` with GO on `s` (no structured replies asked);
/// returns the transmission flags.
async fn go(s: &mut BoxStream, export: &str) -> (u32, u16) {
    let req = InfoRequest { name: export.into(), info: vec![] };
    send_option(s, &ClientOption::Go(req)).await;
    let replies = read_option_replies(s).await;
    let last = replies.last().unwrap().0.reply_type;
    let flags = replies
        .iter()
        .find(|(h, d)| h.reply_type == NBD_REP_INFO && d.len() == 12)
        .map_or(0, |(_, d)| u16::from_be_bytes([d[10], d[11]]));
    (last, flags)
}

/// Every reply to an INFO and a GO for `export`: (type, data) each.
async fn info_and_go(s: &mut BoxStream, export: &str) -> Vec<Vec<(u32, Vec<u8>)>> {
    let mut out = Vec::new();
    for opt in [ClientOption::Info, ClientOption::Go] {
        send_option(s, &opt(InfoRequest { name: export.into(), info: vec![] })).await;
        let replies = read_option_replies(s).await;
        out.push(replies.into_iter().map(|(h, d)| (h.reply_type, d.to_vec())).collect());
    }
    out
}

/// A FUA write of a 4 KiB pattern at `offset` and a read of it, over
/// simple replies.
async fn write_then_read(s: &mut BoxStream, offset: u64, round: u64) {
    let data = pattern(offset, 4096, round);
    let w = Request { flags: NBD_CMD_FLAG_FUA, command: NBD_CMD_WRITE, cookie: 1, offset, len: 4096 };
    let mut b = w.encode().to_vec();
    b.extend_from_slice(&data);
    send_raw(s, &b).await;
    let mut rep = [0u8; SIMPLE_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    assert_eq!(&rep[4..8], &[0, 0, 0, 0], "write errno");
    let r = Request { flags: 0, command: NBD_CMD_READ, cookie: 2, offset, len: 4096 };
    send_raw(s, &r.encode()).await;
    s.read_exact(&mut rep).await.unwrap();
    assert_eq!(&rep[4..8], &[0, 0, 0, 0], "read errno");
    let mut got = vec![0u8; 4096];
    s.read_exact(&mut got).await.unwrap();
    assert!(got == data, "read back other bytes at {offset}");
}

/// With TLS required, a client that does not upgrade is refused every
/// option but STARTTLS and ABORT, and learns no export's name or size;
/// EXPORT_NAME ends its connection. libnbd without TLS is refused.
#[test]
fn required_tls_tells_a_plain_client_nothing() {
    need("nbdinfo", "libnbd-bin");
    let certs = Certs::new();
    let rt = rt();
    let cfg = NbdConfig { tls: Some(certs.server_tls(false, true)), ..NbdConfig::default() };
    let fx = rt.block_on(start(&vols(), cfg));
    rt.block_on(async {
        let mut s = raw(&fx.addr).await;
        let options: Vec<ClientOption> = vec![
            ClientOption::List,
            ClientOption::Info(InfoRequest { name: "disk".into(), info: vec![NBD_INFO_NAME] }),
            ClientOption::Go(InfoRequest { name: "".into(), info: vec![] }),
            ClientOption::StructuredReply,
            ClientOption::ListMetaContext(MetaContextRequest { export: "disk".into(), queries: vec![] }),
        ];
        for o in &options {
            send_option(&mut s, o).await;
            let replies = read_option_replies(&mut s).await;
            assert_eq!(replies.len(), 1, "{o:?}: {replies:?}");
            let (h, msg) = &replies[0];
            assert_eq!((h.option, h.reply_type), (o.code(), NBD_REP_ERR_TLS_REQD), "{o:?}");
            let msg = String::from_utf8_lossy(msg);
            assert!(!msg.contains("disk") && !msg.contains(&SIZE.to_string()), "{msg}");
        }
        send_raw_option(&mut s, 4242, b"x").await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_TLS_REQD);
        send_raw_option(&mut s, NBD_OPT_EXPORT_NAME, b"disk").await;
        assert!(closed_by_server(&mut s).await);
        // ABORT is still answered.
        let mut s = raw(&fx.addr).await;
        send_option(&mut s, &ClientOption::Abort).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
    });
    let plain = format!("nbd://{}/disk", fx.addr);
    let out = fails("nbdinfo", &[&plain]);
    assert!(!out.contains("export-size"), "{out}");
    let out = fails("nbdinfo", &["--list", &format!("nbd://{}", fx.addr)]);
    assert!(!out.contains("\"disk\"") && !out.contains("\"copy\""), "{out}");
    // The same client over TLS sees everything.
    let list = run("nbdinfo", &["--list", &nbds(&fx.addr, "", &certs.dir("client"))]);
    assert!(list.contains("disk") && list.contains("copy"), "{list}");
    assert!(list.contains("with TLS"), "{list}");
    rt.block_on(fx.stop());
}

/// libnbd's nbdinfo and nbdcopy and qemu-img over TLS with client
/// certificates required: data written through one tool reads back
/// through the others. A client without a certificate, or with one from
/// another CA, is refused.
#[test]
fn third_party_clients_over_tls_with_client_certificates() {
    need("nbdinfo", "libnbd-bin");
    need("nbdcopy", "libnbd-bin");
    need("qemu-img", "qemu-utils");
    let certs = Certs::new();
    let rt = rt();
    let cfg = NbdConfig { tls: Some(certs.server_tls(true, true)), ..NbdConfig::default() };
    let fx = rt.block_on(start(&vols(), cfg));
    let client = certs.dir("client");
    let info = run("nbdinfo", &[&nbds(&fx.addr, "disk", &client)]);
    assert!(info.contains(&format!("export-size: {SIZE}")) && info.contains("with TLS"), "{info}");

    let dir = tempfile::tempdir().unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let src = dir.path().join("src.img");
    let mut img = vec![0u8; SIZE as usize];
    for (i, chunk) in img.chunks_mut(65536).enumerate() {
        if i % 3 != 1 {
            chunk.copy_from_slice(&pattern(i as u64 * 65536, 65536, 7));
        }
    }
    std::fs::write(&src, &img).unwrap();
    // qemu-img in (the qemu way: a tls-creds-x509 object).
    let obj = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", client.display());
    let (host, port) = fx.addr.rsplit_once(':').unwrap();
    let target = format!("driver=nbd,host={host},port={port},export=disk,tls-creds=tls0");
    run(
        "qemu-img",
        &["convert", "-n", "-f", "raw", &p(&src), "--object", &obj, "--target-image-opts", &target],
    );
    // nbdcopy out of it, and from it into the other export (4 TLS
    // connections each), and back out.
    let out = dir.path().join("out.img");
    run("nbdcopy", &[&nbds(&fx.addr, "disk", &client), &p(&out)]);
    assert!(std::fs::read(&out).unwrap() == img, "qemu-img in, nbdcopy out differs");
    run("nbdcopy", &[&nbds(&fx.addr, "disk", &client), &nbds(&fx.addr, "copy", &client)]);
    let out2 = dir.path().join("out2.img");
    run("nbdcopy", &[&nbds(&fx.addr, "copy", &client), &p(&out2)]);
    assert!(std::fs::read(&out2).unwrap() == img, "copy between TLS exports differs");

    // No certificate, and a certificate from another CA: refused.
    fails("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("anon"))]);
    fails("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("rogue"))]);
    let anon = format!("tls-creds-x509,id=tls0,endpoint=client,dir={}", certs.dir("anon").display());
    fails("qemu-img", &["info", "--object", &anon, "--image-opts", &target]);
    // The server is still serving.
    run("nbdinfo", &[&nbds(&fx.addr, "disk", &client)]);
    rt.block_on(fx.stop());
}

/// Client certificates optional (`--tls require` without
/// `--tls-verify-peer`): a client with no certificate is served as
/// anonymous, but one that has a certificate from another CA is refused,
/// not taken for anonymous, even when that CA's name differs from the
/// cluster's (the server names no CA it wants, so GnuTLS sends whatever
/// certificate it has instead of quietly none: issue 56).
#[test]
fn a_presented_certificate_is_always_verified() {
    need("nbdinfo", "libnbd-bin");
    let certs = Certs::new();
    let rt = rt();
    let cfg = NbdConfig { tls: Some(certs.server_tls(false, true)), ..NbdConfig::default() };
    let fx = rt.block_on(start(&vols(), cfg));
    let info = run("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("anon"))]);
    assert!(info.contains("with TLS"), "{info}");
    run("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("client"))]);
    for foreign in ["rogue", "stranger"] {
        let out = fails("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir(foreign))]);
        assert!(!out.contains("export-size"), "{foreign}: {out}");
    }
    rt.block_on(fx.stop());
}

/// TLS offered (`--tls on`): plain clients are served as before, TLS ones
/// inside TLS. Options negotiated before STARTTLS are forgotten (the
/// structured replies asked for in plain text do not count inside), and a
/// second STARTTLS is invalid.
#[test]
fn offered_tls_serves_both_and_starts_over_inside() {
    need("nbdinfo", "libnbd-bin");
    let certs = Certs::new();
    let rt = rt();
    let cfg = NbdConfig { tls: Some(certs.server_tls(false, false)), ..NbdConfig::default() };
    let fx = rt.block_on(start(&vols(), cfg));
    let info = run("nbdinfo", &[&format!("nbd://{}/disk", fx.addr)]);
    assert!(info.contains("without TLS"), "{info}");
    let info = run("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("anon"))]);
    assert!(info.contains("with TLS"), "{info}");
    rt.block_on(async {
        let mut s = raw(&fx.addr).await;
        send_option(&mut s, &ClientOption::StructuredReply).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
        let mut s = start_tls(s, &certs.dir("client")).await.unwrap();
        send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_INVALID);
        let (last, flags) = go(&mut s, "disk").await;
        assert_eq!(last, NBD_REP_ACK);
        // DF is offered only with structured replies: not negotiated in
        // this TLS session.
        assert_eq!(flags & NBD_FLAG_SEND_DF, 0, "{flags:#x}");
        // Transmission works inside TLS.
        write_then_read(&mut s, 8192, 1).await;
    });
    rt.block_on(fx.stop());
}

/// A STARTTLS followed at once by plain bytes (injected ahead of the
/// client's TLS) ends the connection. Handshakes that stall, send garbage
/// or break off end only their own connection, within the handshake
/// timeout, while other clients are served.
#[test]
fn bad_tls_handshakes_end_only_their_connection() {
    need("nbdinfo", "libnbd-bin");
    let certs = Certs::new();
    let rt = rt();
    let cfg = NbdConfig {
        tls: Some(certs.server_tls(false, true)),
        handshake_timeout: Duration::from_millis(800),
        ..NbdConfig::default()
    };
    let fx = rt.block_on(start(&vols(), cfg));
    let ok = || run("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("client"))]);
    rt.block_on(async {
        // Injection: STARTTLS and a GO in one write.
        let mut s = raw(&fx.addr).await;
        let mut b = ClientOption::StartTls.encode();
        b.extend_from_slice(&ClientOption::Go(InfoRequest { name: "disk".into(), info: vec![] }).encode());
        send_raw(&mut s, &b).await;
        let (h, _) = read_option_reply(&mut s).await;
        assert_eq!(h.reply_type, NBD_REP_ACK);
        // The server hangs up rather than go on into TLS.
        let r = tls_handshake(s, &certs.dir("client")).await;
        assert!(r.is_err(), "the server went on into TLS after bytes injected ahead of it");
    });
    // Stalled: STARTTLS acknowledged, then nothing, while libnbd clients
    // come and go; the server drops it after the timeout.
    let stalled = rt.block_on(async {
        let mut s = raw(&fx.addr).await;
        send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
        s
    });
    ok();
    rt.block_on(async {
        let mut s = stalled;
        assert!(closed_by_server(&mut s).await);
        // Garbage instead of a ClientHello.
        let mut s = raw(&fx.addr).await;
        send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
        send_raw(&mut s, &[0x55; 4096]).await;
        assert!(closed_by_server(&mut s).await);
        // A ClientHello cut short, then the client goes away.
        let mut s = raw(&fx.addr).await;
        send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
        assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
        send_raw(&mut s, &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc]).await;
        s.shutdown().await.unwrap();
        drop(s);
        // A TLS client whose handshake fails (no certificate is fine here,
        // but this one distrusts the server: another CA).
        let s = raw(&fx.addr).await;
        let e = start_tls(s, &certs.dir("other-ca")).await;
        assert!(e.is_err());
    });
    ok();
    rt.block_on(fx.stop());
}

/// A TLS session lives in the server's process: a hand-over while a TLS
/// client is connected is refused before anything is released, and every
/// client, TLS or plain, keeps its disk on the old server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_connection_refuses_a_hand_over_and_keeps_its_disk() -> R {
    let certs = Certs::new();
    let cfg = NbdConfig { tls: Some(certs.server_tls(false, false)), ..NbdConfig::default() };
    let mut fx = start(&vols(), cfg).await;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("old.upgrade");
    fx.server.listen_for_upgrades(&socket)?;
    let mut tls = start_tls(raw(&fx.addr).await, &certs.dir("client")).await?;
    assert_eq!(go(&mut tls, "disk").await.0, NBD_REP_ACK);
    write_then_read(&mut tls, 0, 1).await;
    let mut plain = raw(&fx.addr).await;
    assert_eq!(go(&mut plain, "disk").await.0, NBD_REP_ACK);

    let exports = blizzard_nbd::ClientExports::new(fx.env.clone(), fx.client.clone());
    let e = blizzard_nbd::Server::upgrade_from(fx.env.clone(), exports, &socket, NbdConfig::default())
        .await
        .err()
        .ok_or("a hand-over with a TLS connection was taken")?;
    let e = e.to_string();
    assert!(e.contains("TLS") && e.contains("refused"), "{e}");
    write_then_read(&mut tls, 4096, 2).await;
    write_then_read(&mut plain, 8192, 3).await;
    write_then_read(&mut tls, 0, 4).await;
    drop((tls, plain));
    fx.stop().await;
    Ok(())
}

/// Sends one 4 KiB write and returns its reply's errno.
async fn write_errno(s: &mut BoxStream, offset: u64) -> u32 {
    let w = Request { flags: 0, command: NBD_CMD_WRITE, cookie: 9, offset, len: 4096 };
    let mut b = w.encode().to_vec();
    b.extend_from_slice(&[0xee; 4096]);
    send_raw(s, &b).await;
    let mut rep = [0u8; SIMPLE_REPLY_LEN];
    s.read_exact(&mut rep).await.unwrap();
    u32::from_be_bytes([rep[4], rep[5], rep[6], rep[7]])
}

/// An export with an access list (alice read-write, bob read-only) is
/// listed and opened only for them: carol (a certificate from the same
/// CA, not on the list) and clients without a certificate do not see it,
/// and INFO and GO answer them exactly as for a name no volume has (no
/// existence oracle, issue 56), as they do a tractserver's certificate
/// that bears alice's name; bob is told READ_ONLY and his writes fail
/// with EPERM. An export without a list stays open to all. The list
/// changes while the server holds the volume, for the next connection.
#[test]
fn access_lists_decide_who_sees_and_writes_an_export() {
    use blizzard_volume::access::AccessChange;
    need("nbdinfo", "libnbd-bin");
    let certs = Certs::new();
    let rt = rt();
    let fx = rt.block_on(async {
        // The list is set before the server starts (it holds no volume
        // yet either way: volumes open at a client's first use).
        let fx =
            start(&vols(), NbdConfig { tls: Some(certs.server_tls(false, false)), ..NbdConfig::default() })
                .await;
        for (id, ro) in [("alice", false), ("bob", true)] {
            let c = AccessChange::Allow { identity: id.into(), read_only: ro };
            blizzard_volume::manage::set_access(&fx.client, "disk", &c).await.unwrap();
        }
        fx
    });
    let list = |dir: &str| run("nbdinfo", &["--list", &nbds(&fx.addr, "", &certs.dir(dir))]);
    let (alice, carol) = (list("client"), list("carol"));
    assert!(alice.contains("\"disk\"") && alice.contains("\"copy\""), "{alice}");
    assert!(!carol.contains("\"disk\"") && carol.contains("\"copy\""), "{carol}");
    let plain = run("nbdinfo", &["--list", &format!("nbd://{}", fx.addr)]);
    assert!(!plain.contains("\"disk\"") && plain.contains("\"copy\""), "{plain}");
    let bob = run("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("bob"))]);
    assert!(bob.contains("is_read_only: true"), "{bob}");
    fails("nbdinfo", &[&nbds(&fx.addr, "disk", &certs.dir("carol"))]);
    rt.block_on(async {
        // Refused: carol, a TLS client without a certificate, a plain
        // client; EXPORT_NAME ends the connection.
        for who in [Some("carol"), Some("anon"), Some("ts-alice"), None] {
            let mut s = match who {
                Some(d) => start_tls(raw(&fx.addr).await, &certs.dir(d)).await.unwrap(),
                None => raw(&fx.addr).await,
            };
            let refused = info_and_go(&mut s, "disk").await;
            let unknown = info_and_go(&mut s, "no-such-volume").await;
            assert_eq!(refused[0][0].0, NBD_REP_ERR_UNKNOWN, "{who:?}");
            assert_eq!(refused.iter().map(|r| r.len()).collect::<Vec<_>>(), vec![1, 1], "{who:?}");
            // Byte for byte the same but for the name itself.
            let text = |r: &[Vec<(u32, Vec<u8>)>]| {
                r.iter().map(|x| (x[0].0, String::from_utf8_lossy(&x[0].1).to_string())).collect::<Vec<_>>()
            };
            let same = |r: &[Vec<(u32, Vec<u8>)>], name: &str| {
                text(r).into_iter().map(|(t, m)| (t, m.replace(name, "NAME"))).collect::<Vec<_>>()
            };
            assert_eq!(same(&refused, "disk"), same(&unknown, "no-such-volume"), "{who:?}");
            // The open export is still open to them.
            assert_eq!(go(&mut s, "copy").await.0, NBD_REP_ACK, "{who:?}");
        }
        let mut s = start_tls(raw(&fx.addr).await, &certs.dir("carol")).await.unwrap();
        send_raw_option(&mut s, NBD_OPT_EXPORT_NAME, b"disk").await;
        assert!(closed_by_server(&mut s).await);
        // alice writes; bob reads it and cannot write.
        let mut a = start_tls(raw(&fx.addr).await, &certs.dir("client")).await.unwrap();
        let (last, flags) = go(&mut a, "disk").await;
        assert_eq!((last, flags & NBD_FLAG_READ_ONLY), (NBD_REP_ACK, 0));
        write_then_read(&mut a, 0, 5).await;
        let mut b = start_tls(raw(&fx.addr).await, &certs.dir("bob")).await.unwrap();
        let (last, flags) = go(&mut b, "disk").await;
        assert_eq!(last, NBD_REP_ACK);
        assert_ne!(flags & NBD_FLAG_READ_ONLY, 0, "{flags:#x}");
        assert_eq!(write_errno(&mut b, 0).await, NBD_EPERM);
        let r = Request { flags: 0, command: NBD_CMD_READ, cookie: 3, offset: 0, len: 4096 };
        send_raw(&mut b, &r.encode()).await;
        let mut rep = [0u8; SIMPLE_REPLY_LEN];
        b.read_exact(&mut rep).await.unwrap();
        assert_eq!(&rep[4..8], &[0, 0, 0, 0]);
        let mut got = vec![0u8; 4096];
        b.read_exact(&mut got).await.unwrap();
        assert!(got == pattern(0, 4096, 5), "bob reads what alice wrote");
        // The list changes while the server holds the volume: bob's next
        // connection is refused at once; the one he has keeps what it was
        // given; alice is unaffected.
        let c = AccessChange::Deny { identity: "bob".into() };
        let left = blizzard_volume::manage::set_access(&fx.client, "disk", &c).await.unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        let mut b2 = start_tls(raw(&fx.addr).await, &certs.dir("bob")).await.unwrap();
        assert_eq!(go(&mut b2, "disk").await.0, NBD_REP_ERR_UNKNOWN, "bob denied while served");
        let r = Request { flags: 0, command: NBD_CMD_READ, cookie: 4, offset: 0, len: 4096 };
        send_raw(&mut b, &r.encode()).await;
        b.read_exact(&mut rep).await.unwrap();
        assert_eq!(&rep[4..8], &[0, 0, 0, 0], "bob's open connection still reads");
        b.read_exact(&mut got).await.unwrap();
        let mut a2 = start_tls(raw(&fx.addr).await, &certs.dir("client")).await.unwrap();
        assert_eq!(go(&mut a2, "disk").await.0, NBD_REP_ACK);
        drop((a, b, a2, b2));
    });
    rt.block_on(fx.stop());
}
