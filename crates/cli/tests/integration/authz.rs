//! Issue 56, point 2: who may ask what of which volume, over real sockets
//! with real certificates. A metadata server and three tractservers, each
//! with its own certificate and `TlsNet` (mutual TLS at the env seam, as
//! the binary runs them), and two volumes: `victim` (its access list:
//! `vm1` read-write, `vmro` read-only; served by `nbd1`, which holds its
//! lease) and `other` (`vm2` read-write).
//!
//! Every request kind of the blob protocol is sent, from every identity,
//! at `victim`: each must be refused (`Forbidden`) exactly where the
//! table says ([`EXPECTED`], the design's table of roles and scopes), and
//! answered (with whatever the request itself comes to) everywhere else.
//! Requests are made harmless past the check (a row version no row has, a
//! lease of 0 ms, a revocation of no certificate), so one run sends them
//! all. Then, through the client library: `vm2` cannot read `victim`'s
//! tracts from a tractserver, list it, or open it, while it reads its own
//! volume; `vm1` reads and writes `victim`.
//!
//! `planted_no_scope_check_is_caught`: tractservers that check roles only
//! (`PlantedBug::NoScopeCheck`) fail the same table.
//!
//! `revocation_closes_connections_and_refuses_at_once`: `ca revoke`'s
//! request from an admin: the revoked client's open connection to a
//! tractserver is closed, and its next ones refused, within 5 s (the time
//! is printed, not asserted).

// Real sockets and time.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;

use blizzard_client::{Client, ClientConfig};
use blizzard_core::{BlobId, TractNo};
use blizzard_env::{Env, RealClock, RealNet};
use blizzard_metaserver::server::{MetaConfig, MetaHandle};
use blizzard_proto::scope::ScopeEntry;
use blizzard_proto::{
    Assignment, BatchedWrite, ErrorCode, ExtendMode, Heartbeat, Onward, Opcode, Reply, Request, TractAddr,
};
use blizzard_rpc::{Blob, Conn, RpcError};
use blizzard_tls::{ClusterTls, Issue, Role, TlsNet};
use blizzard_tractserver::{PlantedBug, TractServerConfig, TractServerHandle};
use blizzard_volume::access::AccessChange;
use blizzard_volume::{manage, VolumeSpec};

/// Every identity the test speaks as, with its role.
const IDS: [(&str, Role); 8] = [
    ("meta1", Role::Meta),
    ("ts1", Role::Tractserver),
    ("root", Role::Admin),
    ("vm1", Role::Client),
    ("vmro", Role::Client),
    ("vm2", Role::Client),
    ("nbd1", Role::Nbd),
    ("nbd2", Role::Nbd),
];

/// What each identity may send at `victim`, by kind of request (the design's
/// table, written out; `Ping`, `Hello`, `GetTlt`, `ClusterStatus`,
/// `ClusterParams`, `ListBlobs` and `SyncDisk` go to everyone).
fn expected(who: &str, op: Opcode) -> bool {
    use Opcode::*;
    let public = matches!(op, Ping | Hello | GetTlt | ClusterStatus | ClusterParams | ListBlobs | SyncDisk);
    let reads = matches!(op, ReadTract | MappedTract | GetBlob);
    let writes = matches!(
        op,
        WriteTract
            | WriteTractCached
            | WriteTractForward
            | WriteTracts
            | TrimTract
            | DeleteTract
            | DigestTract
    );
    let leases = matches!(op, AcquireVolume | RenewVolume | ReleaseVolume);
    let admin_ops = matches!(op, SetVolumeAccess | DropVolume | Revoke);
    let server_ops = matches!(
        op,
        ListRowTracts | CopyTract | CopyTractChanges | MetaPrepare | MetaCommit | MetaAbort | Heartbeat
    );
    match who {
        "meta1" => true,
        "ts1" => !(op == AssignRows || leases || admin_ops || op == AttachReader),
        "root" => !(server_ops || op == AssignRows),
        "vm1" => public || reads || writes || leases,
        "vmro" => public || reads,
        "vm2" => public,
        "nbd1" => public || reads || writes || leases || matches!(op, ExtendBlob | GetScope | AttachReader),
        "nbd2" => public || op == GetBlob || leases || matches!(op, GetScope | AttachReader),
        _ => false,
    }
}

/// A row version no row has: anything the check lets through fails there.
const NO_ROW: u64 = 1 << 40;

/// One request of each kind, at `victim`'s tract 1 (or the blob itself),
/// harmless once past the check.
fn requests(victim: BlobId, nowhere: BlobId) -> Vec<(Request, &'static str)> {
    let addr = TractAddr { blob: victim, incarnation: 1, tract: TractNo(1), row_version: NO_ROW, writer: 0 };
    let rt = blizzard_proto::RowTract { blob: victim, tract: TractNo(1) };
    let hb = Heartbeat {
        ts_id: blizzard_core::TsId(77),
        // Empty: refused as malformed by a server that may take it.
        addr: String::new(),
        domain: String::new(),
        tract_size: 1 << 20,
        slots_total: 1,
        slots_used: 0,
        load: 0,
        disk_mbps: 0,
        assignment: None,
        filled: vec![],
        fill: Default::default(),
        class: Default::default(),
        journal_used: 0,
        journal_bytes: 0,
    };
    // Another cluster's: refused as such by a tractserver that may take it.
    let assignment = Assignment { cluster_id: 1, tract_size: 1 << 20, ..Default::default() };
    let entries = vec![
        ScopeEntry { identity: "vm1".into(), read_only: false },
        ScopeEntry { identity: "vmro".into(), read_only: true },
    ];
    vec![
        (Request::Ping, "ts"),
        (Request::Hello { session: 9, epoch: 1 }, "ts"),
        (Request::WriteTract { addr, offset: 0, crcs: vec![] }, "ts"),
        (Request::ReadTract { addr, offset: 0, len: 4096 }, "ts"),
        (Request::DeleteTract { addr }, "ts"),
        (Request::TrimTract { addr, offset: 0, len: 4096 }, "ts"),
        (Request::MappedTract { addr }, "ts"),
        (Request::WriteTractCached { addr, offset: 0, crcs: vec![] }, "ts"),
        (Request::SyncDisk, "ts"),
        (Request::ListRowTracts { row: 0, row_version: NO_ROW, after: None }, "ts"),
        (Request::CopyTract { row: 0, row_version: NO_ROW, tract: rt }, "ts"),
        (Request::DigestTract { addr }, "ts"),
        (
            Request::WriteTractForward {
                addr,
                offset: 0,
                crcs: vec![],
                to: Vec::<Onward>::new(),
                on_behalf: None,
            },
            "ts",
        ),
        (
            Request::CopyTractChanges {
                row: 0,
                row_version: NO_ROW,
                tract: rt,
                incarnation: 1,
                have: vec![],
            },
            "ts",
        ),
        (
            Request::WriteTracts {
                cached: false,
                writes: vec![BatchedWrite { addr, offset: 0, len: 0, crcs: vec![] }],
            },
            "ts",
        ),
        (Request::CreateBlob { blob: victim, row_version: NO_ROW, incarnation: 2, replication: 1 }, "ts"),
        (Request::ExtendBlob { blob: victim, row_version: NO_ROW, mode: ExtendMode::To, tracts: 1 }, "ts"),
        (Request::DeleteBlob { blob: victim, row_version: NO_ROW }, "ts"),
        (Request::GetBlob { blob: victim, row_version: NO_ROW }, "ts"),
        (Request::ListBlobs, "ts"),
        (
            Request::MetaPrepare {
                blob: victim,
                row_version: NO_ROW,
                txn: 1,
                expected_version: 0,
                new: None,
            },
            "ts",
        ),
        (Request::MetaCommit { blob: victim, row_version: NO_ROW, txn: 1 }, "ts"),
        (Request::MetaAbort { blob: victim, row_version: NO_ROW, txn: 1 }, "ts"),
        (Request::AssignRows { assignment }, "ts"),
        (Request::Heartbeat(hb), "meta"),
        (Request::GetTlt { have_version: 0 }, "meta"),
        (Request::ClusterStatus, "meta"),
        (Request::ClusterParams, "meta"),
        // 0 ms: refused as malformed by a server that may take it.
        (
            Request::AcquireVolume { blob: victim, holder: "probe".into(), ttl_ms: 0, take_over: false },
            "meta",
        ),
        (Request::RenewVolume { blob: victim, holder: "probe".into(), token: 1, ttl_ms: 0 }, "meta"),
        // A token no lease has: nothing is released.
        (Request::ReleaseVolume { blob: victim, token: u64::MAX }, "meta"),
        // The list it has already.
        (Request::SetVolumeAccess { blob: victim, name: "victim".into(), entries }, "meta"),
        (Request::DropVolume { blob: nowhere }, "meta"),
        (Request::Revoke { serial: "ffffffffffffffff".into(), name: "nobody".into() }, "meta"),
        (Request::GetScope { have_version: u64::MAX }, "meta"),
        // Of a volume no test reads from: registering changes nothing here.
        (Request::AttachReader { blob: nowhere }, "meta"),
    ]
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    meta: Option<MetaHandle>,
    tss: Vec<TractServerHandle>,
    meta_addr: String,
    victim: BlobId,
    other: BlobId,
    /// nbd1's lease on victim.
    nbd1_token: u64,
}

impl Fixture {
    fn env(&self, who: &str) -> Env {
        tls_env(&self.root.join(who))
    }

    async fn client(&self, who: &str) -> Client {
        let mut cfg = ClientConfig::new(self.meta_addr.clone());
        cfg.request_timeout = Duration::from_secs(5);
        cfg.attempts = 3;
        Client::connect(self.env(who), cfg).await.unwrap()
    }

    async fn stop(mut self) {
        for t in self.tss.drain(..) {
            t.stop().await;
        }
        if let Some(m) = self.meta.take() {
            m.stop().await;
        }
    }
}

fn tls_env(dir: &Path) -> Env {
    let tls = ClusterTls::load(dir, SystemTime::now()).unwrap();
    let net = TlsNet::new(Arc::new(RealNet), tls, Arc::new(RealClock));
    Env { net: Arc::new(net), ..Env::real() }
}

/// The CA, every identity's certificate, the cluster, and the two volumes.
async fn fixture(plant: PlantedBug) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let now = SystemTime::now();
    blizzard_tls::init_ca(&root.join("ca"), "authz test CA", now).unwrap();
    let hosts = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    for (name, role) in IDS.iter().copied().chain([("ts2", Role::Tractserver), ("ts3", Role::Tractserver)]) {
        let req = Issue { name: name.into(), role, hosts: hosts.clone() };
        blizzard_tls::issue(&root.join("ca"), &req, &root.join(name), now).unwrap();
    }
    let mut m = MetaConfig::new("127.0.0.1:0");
    m.tract_size = 1 << 20;
    m.replication = 3;
    m.init_tractservers = 3;
    m.heartbeat_interval = Duration::from_millis(100);
    m.solo_data = Some(root.join("meta-data"));
    let meta = blizzard_metaserver::server::start(tls_env(&root.join("meta1")), m).await.unwrap();
    let meta_addr = meta.addr.clone();
    let mut tss = Vec::new();
    for (i, name) in ["ts1", "ts2", "ts3"].iter().enumerate() {
        let mut cfg =
            TractServerConfig::new(root.join(format!("ts{i}.disk")), "127.0.0.1:0", meta_addr.clone());
        cfg.disk_size = Some(96 << 20);
        cfg.heartbeat_interval = Duration::from_millis(100);
        cfg.planted_bug = plant;
        tss.push(blizzard_tractserver::start(tls_env(&root.join(name)), cfg).await.unwrap());
    }
    let mut fx = Fixture {
        _dir: dir,
        root,
        meta: Some(meta),
        tss,
        meta_addr,
        victim: BlobId(0),
        other: BlobId(0),
        nbd1_token: 0,
    };
    let admin = fx.client("root").await;
    let env = fx.env("root");
    for name in ["victim", "other"] {
        let mut spec = VolumeSpec::new(name, 8 << 20);
        spec.replication = 3;
        spec.segment_tracts = 4;
        let v = manage::create(env.clone(), &admin, &spec).await.unwrap();
        v.close().await.unwrap();
    }
    for (vol, id, read_only) in [("victim", "vm1", false), ("victim", "vmro", true), ("other", "vm2", false)]
    {
        let change = AccessChange::Allow { identity: id.into(), read_only };
        manage::set_access(&admin, vol, &change).await.unwrap();
    }
    fx.victim = manage::find_blob(&admin, "victim").await.unwrap().id();
    fx.other = manage::find_blob(&admin, "other").await.unwrap().id();
    // nbd1 serves victim: it holds the lease (as an NBD server would).
    let nbd1 = fx.client("nbd1").await;
    let lease =
        nbd1.acquire_volume(manage::blob_id("victim"), "nbd1-process", Duration::from_secs(600), false).await;
    let lease = lease.unwrap();
    assert_eq!(lease.status, blizzard_proto::LeaseStatus::Granted);
    fx.nbd1_token = lease.token;
    fx
}

/// Sends every request from every identity; the (identity, opcode)
/// pairs whose outcome differs from [`expected`], with what happened.
async fn mismatches(fx: &Fixture) -> Vec<String> {
    let ts_addr = fx.tss[0].addr.clone();
    let nowhere = manage::blob_id("no-such-volume");
    let mut out = Vec::new();
    for (who, _) in IDS {
        let env = fx.env(who);
        let to_ts = Conn::<Blob>::connect(&env, &ts_addr).await.unwrap();
        let to_meta = Conn::<Blob>::connect(&env, &fx.meta_addr).await.unwrap();
        for (req, server) in requests(fx.victim, nowhere) {
            let op = req.opcode();
            let conn = if server == "ts" { &to_ts } else { &to_meta };
            let got = conn.call(&req, Bytes::new()).await;
            let refused =
                matches!(&got, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::Forbidden);
            let want_allowed = expected(who, op);
            if refused == want_allowed {
                out.push(format!("{who} {op:?}: {} ({got:?})", if refused { "refused" } else { "allowed" }));
            }
        }
    }
    out
}

/// Every tractserver's listing, as `who` sees it.
async fn listed(fx: &Fixture, who: &str) -> BTreeSet<BlobId> {
    let env = fx.env(who);
    let mut all = BTreeSet::new();
    for t in &fx.tss {
        let c = Conn::<Blob>::connect(&env, &t.addr).await.unwrap();
        if let Ok((Reply::Blobs(v), _)) = c.call(&Request::ListBlobs, Bytes::new()).await {
            all.extend(v.into_iter().map(|m| m.blob));
        }
    }
    all
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

#[test]
fn every_request_of_every_role_and_scope_is_as_the_table_says() {
    blizzard_env::raise_fd_limit();
    rt().block_on(async {
        let fx = fixture(PlantedBug::None).await;
        let wrong = mismatches(&fx).await;
        assert!(wrong.is_empty(), "outcomes other than the table's:\n{}", wrong.join("\n"));

        // Listings: a client sees the volumes its name is on.
        let (vm1, vm2, root) =
            (listed(&fx, "vm1").await, listed(&fx, "vm2").await, listed(&fx, "root").await);
        assert!(root.contains(&fx.victim) && root.contains(&fx.other), "{root:?}");
        assert!(vm1.contains(&fx.victim) && !vm1.contains(&fx.other), "{vm1:?}");
        assert!(vm2.contains(&fx.other) && !vm2.contains(&fx.victim), "{vm2:?}");

        // vm2 speaking the blob protocol straight to the tractservers, for
        // victim's tracts at their real row versions: refused; its own
        // volume reads.
        let vm2 = fx.client("vm2").await;
        let e = manage::info(&vm2, "victim").await.expect_err("vm2 read victim's record");
        assert!(e.to_string().contains("does not name \"vm2\""), "{e}");
        assert!(manage::info(&vm2, "other").await.is_ok());
        let tlt = vm2.tlt();
        let victim = vm2.open_blob(fx.victim).await;
        assert!(victim.is_err(), "vm2 opened victim's blob");
        let row = tlt.locate(fx.victim, TractNo(1));
        for member in tlt.rows[row].members.iter() {
            let addr = &tlt.members[*member as usize].addr;
            let c = Conn::<Blob>::connect(&fx.env("vm2"), addr).await.unwrap();
            let a = TractAddr {
                blob: fx.victim,
                incarnation: 0,
                tract: TractNo(1),
                row_version: tlt.rows[row].version,
                writer: 0,
            };
            let r = c.call(&Request::ReadTract { addr: a, offset: 0, len: 4096 }, Bytes::new()).await;
            match r {
                Err(RpcError::Remote { reply, .. }) => {
                    assert_eq!(reply.code, ErrorCode::Forbidden, "{reply:?}");
                    assert!(reply.message.contains("victim"), "{}", reply.message);
                }
                other => panic!("vm2 read victim's tract 1 from {addr}: {other:?}"),
            }
        }

        // Once nbd1 lets victim go, vm1 opens it as a volume (its lease
        // now) and writes and reads it; vmro reads it, and its write is
        // refused by the tractservers for its list, not its lease.
        let nbd1 = fx.client("nbd1").await;
        nbd1.release_volume(manage::blob_id("victim"), fx.nbd1_token).await.unwrap();
        let vm1 = fx.client("vm1").await;
        let v = manage::open(fx.env("vm1"), &vm1, "victim").await.unwrap();
        v.write(4096, Bytes::from(vec![7u8; 4096]), true).await.unwrap();
        assert_eq!(&v.read(4096, 4096).await.unwrap()[..], &[7u8; 4096][..]);
        v.close().await.unwrap();
        let vmro = fx.client("vmro").await;
        let v = manage::open_read_only(&vmro, "victim").await.unwrap();
        assert_eq!(&v.read(4096, 4096).await.unwrap()[..], &[7u8; 4096][..]);
        let b = vmro.open_blob(fx.victim).await.unwrap();
        let e = b.write(1, 0, Bytes::from(vec![8u8; 4096])).await.expect_err("a read-only entry wrote");
        assert!(e.to_string().contains("read-only"), "{e}");
        let e = manage::open(fx.env("vmro"), &vmro, "victim").await.err().expect("vmro took victim's lease");
        assert!(e.to_string().contains("read-only"), "{e}");

        // An NBD server that serves victim read-only (no lease: `blizzard
        // nbd --read-only`) registers as its reader and reads it; it still
        // writes nothing of it. A client certificate registers nothing.
        let to_ts = Conn::<Blob>::connect(&fx.env("nbd2"), &fx.tss[0].addr).await.unwrap();
        let a = TractAddr { blob: fx.victim, incarnation: 1, tract: TractNo(1), row_version: NO_ROW, writer: 0 };
        let forbidden = |r: &Result<(Reply, Bytes), RpcError>| {
            matches!(r, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::Forbidden)
        };
        let read = Request::ReadTract { addr: a, offset: 0, len: 4096 };
        assert!(forbidden(&to_ts.call(&read, Bytes::new()).await), "nbd2 read victim before registering");
        let nbd2 = fx.client("nbd2").await;
        let v = manage::open_read_only(&nbd2, "victim").await.unwrap();
        assert_eq!(&v.read(4096, 4096).await.unwrap()[..], &[7u8; 4096][..]);
        assert!(!forbidden(&to_ts.call(&read, Bytes::new()).await), "a registered reader refused");
        let write = Request::WriteTract { addr: a, offset: 0, crcs: vec![] };
        assert!(forbidden(&to_ts.call(&write, Bytes::new()).await), "a reader wrote");
        assert!(!vm1.attach_reader(manage::blob_id("other")).await.unwrap(), "a client registered");
        fx.stop().await;
    });
}

#[test]
fn planted_no_scope_check_is_caught() {
    blizzard_env::raise_fd_limit();
    rt().block_on(async {
        let fx = fixture(PlantedBug::NoScopeCheck).await;
        let wrong = mismatches(&fx).await;
        assert!(
            wrong.iter().any(|w| w.starts_with("vm2 ReadTract: allowed")),
            "tractservers without the per-volume check passed the table:\n{}",
            wrong.join("\n")
        );
        fx.stop().await;
    });
}

#[test]
fn revocation_closes_connections_and_refuses_at_once() {
    blizzard_env::raise_fd_limit();
    rt().block_on(async {
        let fx = fixture(PlantedBug::None).await;
        let env = fx.env("vm1");
        let open = Conn::<Blob>::connect(&env, &fx.tss[1].addr).await.unwrap();
        assert!(open.call(&Request::Ping, Bytes::new()).await.is_ok());
        let serial = blizzard_tls::identity_of_file(&fx.root.join("vm1/client-cert.pem")).unwrap().serial;
        let admin = fx.client("root").await;
        let revoked_at = Instant::now();
        admin.revoke(&serial, "vm1").await.unwrap();
        // Its open connection closes; a new one is refused (closed at
        // once, or answered `Forbidden`).
        let mut closed = None;
        let mut refused = None;
        while (closed.is_none() || refused.is_none()) && revoked_at.elapsed() < Duration::from_secs(30) {
            if closed.is_none() && open.call(&Request::Ping, Bytes::new()).await.is_err() {
                closed = Some(revoked_at.elapsed());
            }
            if refused.is_none() {
                let c = Conn::<Blob>::connect(&env, &fx.tss[2].addr).await;
                let r = match c {
                    Ok(c) => c.call(&Request::Ping, Bytes::new()).await.map(|_| ()),
                    Err(e) => Err(e),
                };
                match r {
                    Err(RpcError::Remote { reply, .. }) if reply.code != ErrorCode::Forbidden => {
                        panic!("a revoked certificate's ping: {reply:?}")
                    }
                    Err(_) => refused = Some(revoked_at.elapsed()),
                    Ok(()) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "revocation: vm1's open connection closed after {closed:?}, a new one refused after {refused:?}"
        );
        assert!(closed.is_some(), "vm1's connection stayed open");
        assert!(refused.is_some(), "vm1 was not refused");
        // The metadata service refuses it too, and other identities carry on.
        let r = match Conn::<Blob>::connect(&env, &fx.meta_addr).await {
            Ok(c) => c.call(&Request::ClusterStatus, Bytes::new()).await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert!(
            matches!(&r, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::Forbidden)
                || matches!(&r, Err(RpcError::ConnectionLost(_))),
            "{r:?}"
        );
        assert!(manage::info(&fx.client("vmro").await, "victim").await.is_ok());
        fx.stop().await;
    });
}

/// The NBD side of a revocation: `blizzard nbd`'s server (in this
/// process, with nbd1's certificates, client certificates required) holds
/// a connection of libnbd's (`nbdsh`) with vm1's certificate open; once an
/// admin revokes vm1, that connection is closed and a new one (`nbdinfo`)
/// refused, within 5 s (the server asks the cluster every second; the
/// times are printed, not asserted).
#[test]
fn revocation_closes_an_open_nbd_connection() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let nbdsh = crate::common::tool("nbdsh", "python3-libnbd");
    let nbdinfo = crate::common::tool("nbdinfo", "libnbd-bin");
    blizzard_env::raise_fd_limit();
    let rt = rt();
    let (fx, server) = rt.block_on(async {
        let fx = fixture(PlantedBug::None).await;
        // The NBD server takes victim from nbd1's lease holder (itself).
        let nbd1 = fx.client("nbd1").await;
        nbd1.release_volume(manage::blob_id("victim"), fx.nbd1_token).await.unwrap();
        let tls = blizzard_tls::server_config(&fx.root.join("nbd1"), true, SystemTime::now()).unwrap();
        let cfg = blizzard_nbd::NbdConfig {
            tls: Some(blizzard_nbd::NbdTls { config: tls, required: true }),
            ..blizzard_nbd::NbdConfig::default()
        };
        let exports = blizzard_nbd::ClientExports::new(fx.env("nbd1"), nbd1);
        let server = blizzard_nbd::Server::start(fx.env("nbd1"), exports, "127.0.0.1:0", cfg).await.unwrap();
        (fx, server)
    });
    let uri = |who: &str| {
        format!("nbds://{}/victim?tls-certificates={}", server.local_addr(), fx.root.join(who).display())
    };
    // Reads block 0 every 20 ms until the connection fails.
    let script = format!(
        r#"import time
h.set_uri_allow_local_file(True)
h.connect_uri({:?})
h.pread(4096, 0)
print("open", flush=True)
while True:
    try:
        h.pread(4096, 0)
    except Exception as e:
        print("closed", e, flush=True)
        break
    time.sleep(0.02)
"#,
        uri("vm1")
    );
    // nbdsh runs the first `python3` on PATH: the distribution's, which has
    // the module, not a pyenv's.
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let mut held = Command::new(&nbdsh)
        .env("PATH", path)
        .args(["-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(held.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    if first != "open" {
        let out = held.wait_with_output().unwrap();
        panic!("vm1's NBD connection did not open: {}", String::from_utf8_lossy(&out.stderr));
    }
    let serial = blizzard_tls::identity_of_file(&fx.root.join("vm1/client-cert.pem")).unwrap().serial;
    let revoked_at = Instant::now();
    rt.block_on(async { fx.client("root").await.revoke(&serial, "vm1").await.unwrap() });
    let next = lines.next().and_then(|l| l.ok()).unwrap_or_default();
    let closed = revoked_at.elapsed();
    assert!(next.starts_with("closed"), "vm1's NBD connection: {next:?}");
    let _ = held.wait();
    let out = Command::new(&nbdinfo).arg(uri("vm1")).output().unwrap();
    let refused = revoked_at.elapsed();
    assert!(!out.status.success(), "a revoked certificate opened an NBD connection");
    // Another client carries on.
    let out = Command::new(&nbdinfo).arg(uri("vmro")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    println!(
        "revocation (NBD): vm1's open connection closed after {closed:?}, a new one refused by {refused:?}"
    );
    rt.block_on(async {
        server.shutdown().await.unwrap();
        fx.stop().await;
    });
}
