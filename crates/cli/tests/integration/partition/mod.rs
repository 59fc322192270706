//! Network partitions across real processes: every tractserver runs in its
//! own network namespace, joined to the root namespace (the metadata
//! server's and this test's) by a veth pair; the root namespace routes
//! between them. A continuous verified load runs from this process (as in
//! `fault_recovery`) while one tractserver at a time is cut off:
//!
//! 1. **Cut link.** The root side of one member's veth goes down: it is
//!    unreachable for everybody. The cluster must declare it dead and bring
//!    its rows back to full replication while a tract of its rows is
//!    rewritten. When the link comes back, raw reads sent to it with the
//!    row version of a table snapshotted before the cut must all be refused
//!    (it still holds the tract's old bytes), and a client that never
//!    refreshed its table must read the new bytes.
//! 2. **Cut from the metadata server only** (an nftables rule in the
//!    member's namespace drops its packets to the metadata server's port):
//!    clients can still reach it, so the only thing that stops it serving
//!    is its lease. Raw reads sent to it throughout must be refused once
//!    the lease has run out (before it is declared dead), and stay refused
//!    after its rows have moved and after the rule is gone.
//!
//! After each step every replica of every tract must equal the model.
//!
//! Needs root, `ip` (iproute2) and network namespaces, and `nft` for step
//! 2. Not running as root, it prints why and passes (unless
//! `CI_REQUIRE_NETNS=1`, as CI sets); running as root, a missing tool or
//! namespaces that cannot be made fail it: a root run that skipped would
//! pass without testing anything.
//! Addresses are 10.231.N.0/24 (N = 1.. per tractserver), reachable only
//! inside this machine: an `unreachable` route for 10.231.0.0/16 in the
//! root namespace keeps packets for a cut member from leaving by the
//! default route, and the namespaces route only that /16. Everything made
//! (namespaces, veths, the route, `net.ipv4.ip_forward`) is undone on
//! drop, also when the test fails; leftovers of a killed run (names carry
//! the pid) are removed by the next run.
//!
//! The random choices come from a seed printed at the start; set
//! `PARTITION_SEED` to reuse one.

// The test drives real processes, sockets and `ip` in real time, outside
// the env seam, and a failure must stop it with its context.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use crate::common;

mod netns;
use netns::*;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::task::JoinHandle;

use blizzard_client::{Blob, Client, ClientConfig, ClientError};
use blizzard_core::{Tlt, TractNo};
use blizzard_env::Env;
use blizzard_proto::{ClusterStatus, ErrorCode, Reply, Request, TractAddr};
use blizzard_rpc::{RpcConn, RpcError};

use common::{describe, free_port, meta_args, Proc, Procs, Shared};

const TRACTSERVERS: usize = 7;
const REPLICATION: u8 = 3;
const TRACT_SIZE: usize = 1 << 20;
const BLOBS: usize = 3;
const TRACTS_PER_BLOB: u64 = 16;
const WRITERS: u64 = 3;
const READERS: u64 = 2;
const MAX_IO: usize = 64 << 10;
const TS_PORT: u16 = 7000;
/// What a heartbeat reply grants: two thirds of `dead_after`.
const LEASE: Duration = Duration::from_millis(common::DEAD_AFTER_MS * 2 / 3);
/// The clients' deadline per request. A cut link gives no reset, only
/// silence, so a request to the cut member ends at this deadline; the
/// default (10 s) would only make each step slower.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);
/// Raw reads: how often, how much (one CRC piece), and their deadlines.
const PROBE_PERIOD: Duration = Duration::from_millis(10);
const PROBE_LEN: u32 = 4096;
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_millis(300);
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// After a cut heals, raw reads go on at least this long, and at least
/// `PROBE_AFTER_REJOIN` after the member is back in the status.
const PROBE_MIN: Duration = Duration::from_secs(3);
const PROBE_AFTER_REJOIN: Duration = Duration::from_secs(1);
/// How long step 1 keeps the link down: past the tractserver's deadline for
/// a heartbeat (10 s, `TractServerConfig::request_timeout`), so it gives
/// the pending one up and dials again, and its first heartbeat after the
/// heal is a fresh one, answered `StopServing` with a current lease: the
/// case the fence exists for. (A shorter cut heals with the pending
/// heartbeat retransmitted, whose lease, counted from its sending, has
/// already run out.)
const LONG_CUT: Duration = Duration::from_secs(11);
/// How long a healed member may take to be a member again.
const REJOIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The metadata server in the root namespace on every address, and one
/// tractserver in each namespace. `procs.meta.addr` is the loopback address
/// this process uses.
fn start_cluster(dir: &Path, net: &TestNet) -> (Procs, u16) {
    let port = free_port();
    let meta = Proc::spawn(
        "meta",
        &meta_args(&format!("0.0.0.0:{port}"), REPLICATION, TRACTSERVERS, None),
        dir.join("meta.log"),
        format!("127.0.0.1:{port}"),
    );
    let mut procs = Procs { meta, ts: Vec::new() };
    for n in 1..=TRACTSERVERS {
        let disk = dir.join(format!("ts{n}.disk")).display().to_string();
        let ns = net.ns(n);
        let meta_addr = format!("{}:{port}", TestNet::gateway(n));
        let listen = format!("{}:{TS_PORT}", TestNet::member_ip(n));
        let bin = common::blizzard_bin();
        let args: Vec<String> = [
            "netns",
            "exec",
            &ns,
            &bin,
            "tractserver",
            "--insecure",
            "--disk",
            &disk,
            "--create-size",
            "256MiB",
            "--meta",
            &meta_addr,
            "--listen",
            &listen,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let name = format!("ts{n}");
        // `ip netns exec` execs the server, so the child's pid is the
        // server's and the guard's SIGKILL reaches it.
        procs.ts.push(Proc::spawn_program(
            &name,
            &net.ip,
            &args,
            dir.join(format!("{name}.log")),
            String::new(),
        ));
    }
    procs.wait_listening(Duration::from_secs(30));
    for (i, p) in procs.ts.iter().enumerate() {
        assert_eq!(
            p.addr,
            format!("{}:{TS_PORT}", TestNet::member_ip(i + 1)),
            "{} listens elsewhere",
            p.name
        );
    }
    (procs, port)
}

fn client_config(meta: &str) -> ClientConfig {
    let mut cfg = ClientConfig::new(meta.to_string());
    cfg.request_timeout = REQUEST_TIMEOUT;
    cfg
}

/// Member `n` (1-based, as in the namespace names) listening on `addr`.
fn member_number(procs: &Procs, addr: &str) -> usize {
    procs.ts.iter().position(|p| p.addr == addr).unwrap() + 1
}

/// The first `REPLICATION` members of the row of tract 0 of `blob` in
/// `tlt`, and the row's version.
fn probe_row(tlt: &Tlt, blob: &Blob) -> (Vec<String>, u64) {
    let row = &tlt.rows[tlt.locate(blob.id(), TractNo(0))];
    let members =
        row.members.iter().take(REPLICATION as usize).map(|&m| tlt.members[m as usize].addr.clone());
    (members.collect(), row.version)
}

/// A raw read of the first piece of tract 0 of `blob`, at `row_version`:
/// straight to one server, with none of the client's retries or replica
/// choice.
fn raw_read(blob: &Blob, row_version: u64) -> Request {
    Request::ReadTract {
        addr: TractAddr {
            blob: blob.id(),
            incarnation: blob.incarnation(),
            tract: TractNo(0),
            row_version,
            writer: blob.writer(),
        },
        offset: 0,
        len: PROBE_LEN,
    }
}

/// What one raw read got.
#[derive(Clone, Debug)]
enum Answer {
    /// Bytes, named by the known content they equal (or "unknown").
    Data(&'static str),
    Refused(ErrorCode),
    NoConnection,
    Timeout,
    ConnectionLost,
    Unexpected(String),
}

impl Answer {
    fn label(&self) -> String {
        match self {
            Answer::Data(what) => format!("DATA ({what})"),
            Answer::Refused(code) => format!("refused {code:?}"),
            Answer::NoConnection => "no connection".into(),
            Answer::Timeout => "timeout".into(),
            Answer::ConnectionLost => "connection lost".into(),
            Answer::Unexpected(e) => format!("unexpected: {e}"),
        }
    }

    fn is_data(&self) -> bool {
        matches!(self, Answer::Data(_))
    }

    fn is_connection_failure(&self) -> bool {
        matches!(self, Answer::NoConnection | Answer::Timeout | Answer::ConnectionLost)
    }

    /// A refusal of the kind a server that must not serve gives.
    fn is_refusal(&self) -> bool {
        matches!(self, Answer::Refused(ErrorCode::NotOwner | ErrorCode::StaleVersion | ErrorCode::NotReady))
    }
}

/// One raw read: when it was sent and what came back.
#[derive(Clone, Debug)]
struct Probe {
    sent: Instant,
    answer: Answer,
}

/// Known contents of the probed piece, to name what a read returned.
type Known = Vec<(&'static str, Bytes)>;

async fn raw_call(env: &Env, conn: &mut Option<RpcConn>, addr: &str, req: &Request, known: &Known) -> Answer {
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = match env.timeout(PROBE_CONNECT_TIMEOUT, RpcConn::connect(env, addr)).await {
            Ok(Ok(c)) => Some(c),
            Ok(Err(_)) => return Answer::NoConnection,
            Err(_) => return Answer::Timeout,
        };
    }
    let c = conn.as_ref().unwrap();
    let answer = match c.call_timeout(env, PROBE_TIMEOUT, req, Bytes::new()).await {
        Ok((Reply::Read { .. }, data)) => {
            Answer::Data(known.iter().find(|(_, k)| *k == data).map_or("unknown", |(name, _)| *name))
        }
        Ok((other, _)) => Answer::Unexpected(format!("{other:?}")),
        Err(RpcError::Remote { reply, .. }) => Answer::Refused(reply.code),
        Err(RpcError::Connect { .. }) => Answer::NoConnection,
        Err(RpcError::Timeout(_)) => Answer::Timeout,
        Err(RpcError::ConnectionLost(_)) => Answer::ConnectionLost,
        Err(e) => Answer::Unexpected(e.to_string()),
    };
    if matches!(answer, Answer::Timeout | Answer::ConnectionLost) {
        *conn = None;
    }
    answer
}

/// Raw reads sent to one server every `PROBE_PERIOD` by a task until
/// stopped.
struct Prober {
    probes: Arc<StdMutex<Vec<Probe>>>,
    stop: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Prober {
    fn start(addr: String, req: Request, known: Known) -> Prober {
        let probes = Arc::new(StdMutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (probes.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let env = Env::real();
            let mut conn = None;
            while !s.load(Ordering::SeqCst) {
                let sent = Instant::now();
                let answer = raw_call(&env, &mut conn, &addr, &req, &known).await;
                p.lock().unwrap().push(Probe { sent, answer });
                tokio::time::sleep(PROBE_PERIOD).await;
            }
        });
        Prober { probes, stop, task }
    }

    fn snapshot(&self) -> Vec<Probe> {
        self.probes.lock().unwrap().clone()
    }

    async fn stop(self) -> Vec<Probe> {
        self.stop.store(true, Ordering::SeqCst);
        let probes = self.probes.clone();
        self.task.await.unwrap();
        let done = probes.lock().unwrap().clone();
        done
    }
}

/// How many answers of each kind.
fn counts<'a>(probes: impl IntoIterator<Item = &'a Probe>) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for p in probes {
        *out.entry(p.answer.label()).or_insert(0) += 1;
    }
    out
}

/// Milliseconds from `origin` to `t` (negative before it).
fn ms(t: Instant, origin: Instant) -> f64 {
    if t >= origin {
        t.duration_since(origin).as_secs_f64() * 1000.0
    } else {
        -(origin.duration_since(t).as_secs_f64() * 1000.0)
    }
}

/// Writes `data` over tract 0 of the probe blob in a task, as the load
/// writes (under the gate and the tract's model lock, the model updated on
/// success); the task returns when it was acknowledged.
fn write_probe_tract(shared: &Arc<Shared>, data: Bytes) -> JoinHandle<Result<Instant, ClientError>> {
    let shared = shared.clone();
    tokio::spawn(async move {
        let _pause = shared.gate.read().await;
        let mut model = shared.model[BLOBS][0].lock().await;
        shared.blobs[BLOBS].write_tract(0, data.clone()).await?;
        model.copy_from_slice(&data);
        Ok(Instant::now())
    })
}

fn random_tract(rng: &mut SmallRng) -> Bytes {
    let mut data = vec![0u8; TRACT_SIZE];
    rng.fill(&mut data[..]);
    Bytes::from(data)
}

/// Whether `addr` is a member again after a cut healed: alive, no longer
/// dead, holding rows again (its old ones were given away; it rejoins as
/// a new server does, taking its share of entries, copied while pending),
/// and the cluster fully replicated with nobody copying.
fn rejoined(s: &ClusterStatus, addr: &str) -> bool {
    s.fully_replicated()
        && !common::copying(s)
        && s.members.iter().any(|m| m.addr == addr && m.alive && !m.dead && m.rows > 0)
}

/// After a cut heals: polls the status until `victim` has [`rejoined`],
/// printing when it was first alive again, and keeps the prober going at
/// least `PROBE_MIN` after `healed` and `PROBE_AFTER_REJOIN` after the
/// rejoin; returns the probes sent since `healed`.
async fn watch_rejoin(
    client: &Client,
    procs: &mut Procs,
    step: &str,
    victim: &str,
    healed: Instant,
    prober: Prober,
) -> Vec<Probe> {
    let mut alive_at = None;
    let mut last = None;
    let rejoined_at = loop {
        procs.check_running();
        if let Ok(s) = client.cluster_status().await {
            if alive_at.is_none() && s.members.iter().any(|m| m.addr == victim && m.alive) {
                alive_at = Some(Instant::now());
            }
            let done = rejoined(&s, victim);
            last = Some(s);
            if done {
                break Instant::now();
            }
        }
        if healed.elapsed() > REJOIN_TIMEOUT {
            let status = last.as_ref().map_or("no status".into(), |s| describe(s, &[victim.to_string()]));
            panic!(
                "{step}: {victim} is not a member again {REJOIN_TIMEOUT:?} after the cut healed:\n{status}"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let until = (healed + PROBE_MIN).max(rejoined_at + PROBE_AFTER_REJOIN);
    tokio::time::sleep(until.saturating_duration_since(Instant::now())).await;
    let probes: Vec<Probe> = prober.stop().await.into_iter().filter(|p| p.sent >= healed).collect();
    let first_answer = probes.iter().find(|p| matches!(p.answer, Answer::Refused(_) | Answer::Data(_)));
    println!(
        "{step}: after the cut healed, {victim} first answered a raw read at {:?} ms, was alive in the status \
         at {:?} ms and a member again (its share of new rows, not dead) at {:.0} ms; raw reads with the old row version, \
         {:.1} s in all: {:?}",
        first_answer.map(|p| ms(p.sent, healed).round()),
        alive_at.map(|t| ms(t, healed).round()),
        ms(rejoined_at, healed),
        ms(Instant::now(), healed) / 1000.0,
        counts(&probes)
    );
    println!("{}", describe(last.as_ref().unwrap(), &[victim.to_string()]));
    probes
}

/// Fails the test on any answer in `probes` other than a refusal or a
/// connection failure: data, or an error a refusing server would not give.
fn assert_all_refused(step: &str, what: &str, probes: &[Probe], origin: Instant) {
    let bad: Vec<String> = probes
        .iter()
        .filter(|p| !p.answer.is_refusal() && !p.answer.is_connection_failure())
        .map(|p| format!("{:.0} ms: {}", ms(p.sent, origin), p.answer.label()))
        .collect();
    assert!(
        bad.is_empty(),
        "{step}: {what}: {} raw reads with an old row version were not refused (STALE READ if DATA):\n{}\nall: {:?}",
        bad.len(),
        bad[..bad.len().min(20)].join("\n"),
        counts(probes)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tractserver_never_serves_stale_data() {
    // As root nothing excuses a skip; otherwise only CI insists.
    let require = is_root() || std::env::var("CI_REQUIRE_NETNS").is_ok_and(|v| v == "1");
    // Declared before the processes, so dropped after them: a namespace
    // is removed with nothing left running in it.
    let net = match setup_net(TRACTSERVERS) {
        Ok(net) => net,
        Err(why) => {
            assert!(
                !require,
                "the partition test cannot run (as root, or with CI_REQUIRE_NETNS=1): {why}; install \
                 iproute2 and nftables, and run where network namespaces can be made"
            );
            eprintln!("SKIPPING the partition test: {why}");
            return;
        }
    };
    let nft = tool("nft");
    assert!(
        nft.is_some() || !require,
        "no `nft` for the one-way partition (Debian: nftables), and the test must not skip it (root, or \
         CI_REQUIRE_NETNS=1)"
    );

    let seed = match std::env::var("PARTITION_SEED") {
        Ok(s) => s.parse().expect("PARTITION_SEED must be a u64"),
        Err(_) => Env::real().random_u64(),
    };
    println!("seed {seed} (set PARTITION_SEED={seed} to reuse it)");
    let mut rng = SmallRng::seed_from_u64(seed);
    let test_start = Instant::now();

    let dir = tempfile::tempdir().unwrap();
    let (mut procs, meta_port) = start_cluster(dir.path(), &net);
    let meta = procs.meta.addr.clone();
    let client = Client::connect(Env::real(), client_config(&meta)).await.unwrap();
    assert_eq!(client.tract_size() as usize, TRACT_SIZE);

    // The load's blobs, and one more of a single tract that only the test
    // body writes (tract T below): its content at every moment is known.
    let start = Instant::now();
    let (mut blobs, mut model) =
        common::fill_blobs(&client, &mut rng, BLOBS, TRACTS_PER_BLOB, REPLICATION).await;
    let (probe_blobs, probe_model) = common::fill_blobs(&client, &mut rng, 1, 1, REPLICATION).await;
    let probe_blob = probe_blobs[0].clone();
    blobs.extend(probe_blobs);
    model.extend(probe_model);
    println!(
        "filled {BLOBS} blobs of {TRACTS_PER_BLOB} tracts and the probe blob in {:.1?}",
        start.elapsed()
    );
    let shared = Arc::new(Shared::new(blobs, model, BLOBS, TRACT_SIZE, MAX_IO));
    let load = common::start_load(&shared, seed, WRITERS, READERS);

    let ops_before = shared.ops();
    tokio::time::sleep(Duration::from_secs(2)).await;
    procs.check_running();
    shared.assert_no_failures("on a healthy cluster");
    let (w, r) = shared.ops();
    println!("steady state: {} writes and {} reads in 2 s", w - ops_before.0, r - ops_before.1);
    assert!(w > ops_before.0 && r > ops_before.1, "the load made no progress on a healthy cluster");
    common::verify(&shared, "before any cut").await;

    // 1. The link of a member of T's row goes down.
    let step = "step 1 (link down)";
    let env = Env::real();
    let d1 = random_tract(&mut rng);
    write_probe_tract(&shared, d1.clone()).await.unwrap().unwrap();
    let stale_tlt = client.tlt();
    let (row, old_version) = probe_row(&stale_tlt, &probe_blob);
    let victim = row[rng.random_range(0..row.len())].clone();
    let n = member_number(&procs, &victim);
    // A second client that fetches its table now and is not used again
    // until the cut has healed: it still names the victim for T.
    let stale_client = Client::connect(Env::real(), client_config(&meta)).await.unwrap();
    let stale_blob = stale_client.open_blob(probe_blob.id()).await.unwrap();
    let stale_client_version = stale_client.tlt().version;
    let d2 = random_tract(&mut rng);
    let known: Known = vec![
        ("D1, T before the cut", d1.slice(..PROBE_LEN as usize)),
        ("D2, T after its row moved", d2.slice(..PROBE_LEN as usize)),
    ];
    // The raw read is not blind: while the victim serves, it returns D1.
    let req = raw_read(&probe_blob, old_version);
    let answer = raw_call(&env, &mut None, &victim, &req, &known).await;
    assert!(
        matches!(answer, Answer::Data("D1, T before the cut")),
        "{step}: a raw read of T before the cut got {answer:?}"
    );

    let ops_before = shared.ops();
    net.set_link(n, false);
    // Counted from when the command returned: the link is down by then.
    let cut = Instant::now();
    println!(
        "{step}: link of ts{n} ({victim}) down; T is tract 0 of blob {} in row {row:?} at version {old_version}",
        probe_blob.id()
    );
    let write_d2 = write_probe_tract(&shared, d2.clone());
    let status =
        common::wait_recovered(&client, &mut procs, &shared, step, cut, std::slice::from_ref(&victim)).await;
    assert!(status.members.iter().any(|m| m.addr == victim && m.dead), "{step}: {victim} is not dead");
    let acked = write_d2.await.unwrap().unwrap_or_else(|e| panic!("{step}: writing D2 to T failed: {e}"));
    let (new_row, new_version) = probe_row(&client.tlt(), &probe_blob);
    println!(
        "{step}: D2 written to T, acknowledged {:.0} ms after the cut; T's row is now {new_row:?} at version \
         {new_version}",
        ms(acked, cut)
    );
    assert!(!new_row.contains(&victim) && new_version > old_version, "{step}: T's row did not move");
    shared.assert_no_failures(step);
    let (w, r) = shared.ops();
    println!(
        "{step}: the load completed {} writes and {} reads during the cut",
        w - ops_before.0,
        r - ops_before.1
    );

    tokio::time::sleep((cut + LONG_CUT).saturating_duration_since(Instant::now())).await;
    procs.check_running();

    // The link comes back. The victim still holds D1 at the old version.
    let prober = Prober::start(victim.clone(), req.clone(), known.clone());
    let healed = Instant::now();
    net.set_link(n, true);
    println!("{step}: link up {:.0} ms after the cut", ms(healed, cut));
    // At once, while the victim may not yet have heard from the metadata
    // server: the stale client tries its old row first. In a task, so the
    // raw reads and the rejoin are watched (and reported) whatever it gets.
    let stale_read = {
        let b = stale_blob.clone();
        tokio::spawn(async move { b.read_tract(0).await })
    };
    let probes = watch_rejoin(&client, &mut procs, step, &victim, healed, prober).await;
    let got =
        stale_read.await.unwrap().unwrap_or_else(|e| panic!("{step}: the stale client's read failed: {e}"));
    let got_name = if got == d1 {
        "D1 (old)"
    } else if got == d2 {
        "D2"
    } else {
        "neither D1 nor D2"
    };
    println!(
        "{step}: the client holding the table from before the cut (version {stale_client_version}) read \
         {got_name}, now at table version {} after {} stale rejections",
        stale_client.tlt().version,
        stale_client.stats().stale_rejections.load(Ordering::Relaxed)
    );
    assert_all_refused(step, "after the link came back", &probes, healed);
    assert!(
        got == d2,
        "{step}: a client with the table from before the cut read {got_name} from T (STALE READ)"
    );
    assert!(
        probes.iter().any(|p| p.answer.is_refusal()),
        "{step}: {victim} never answered a raw read after the link came back, so nothing was checked"
    );
    assert!(probe_blob.read_tract(0).await.unwrap() == d2, "{step}: T does not read as D2");
    assert!(stale_blob.read_tract(0).await.unwrap() == d2, "{step}: the stale client no longer reads D2");
    common::wait_progress(&shared, step).await;
    common::verify(&shared, &format!("after {step}")).await;

    // 2. A member of T's row can no longer reach the metadata server, but
    // clients still reach it.
    let step = "step 2 (cut from the metadata server only)";
    match nft.as_deref() {
        None => println!("{step}: SKIPPED: no `nft` (Debian: nftables)"),
        Some(nft) => {
            let stale_tlt = client.tlt();
            let (row, old_version) = probe_row(&stale_tlt, &probe_blob);
            let victim = row[rng.random_range(0..row.len())].clone();
            let n = member_number(&procs, &victim);
            let stale_client = Client::connect(Env::real(), client_config(&meta)).await.unwrap();
            let stale_blob = stale_client.open_blob(probe_blob.id()).await.unwrap();
            let d3 = random_tract(&mut rng);
            let known: Known = vec![
                ("D2, T before the cut", d2.slice(..PROBE_LEN as usize)),
                ("D3, T after its row moved", d3.slice(..PROBE_LEN as usize)),
            ];
            let req = raw_read(&probe_blob, old_version);
            let ops_before = shared.ops();
            // Probing from before the cut, so the answers show the moment
            // the victim stops serving.
            let prober = Prober::start(victim.clone(), req.clone(), known.clone());
            tokio::time::sleep(Duration::from_millis(200)).await;
            net.cut_from_meta(nft, n, meta_port);
            // Counted from when the command returned (it takes tens of
            // milliseconds): every heartbeat sent after this is dropped, so
            // the victim's lease ends at most `LEASE` after it.
            let cut = Instant::now();
            println!(
                "{step}: ts{n} ({victim}) cut from the metadata server; T's row {row:?} at version {old_version}"
            );
            // Wait for the first refusal (the lease ran out) while the
            // status shows the victim still alive.
            let mut dead_seen = None;
            let refused = loop {
                let probes = prober.snapshot();
                // A slow answer (a busy machine) says nothing either way.
                let answered = |p: &&Probe| !p.answer.is_data() && !p.answer.is_connection_failure();
                if let Some(p) = probes.iter().filter(|p| p.sent >= cut).find(answered) {
                    break p.clone();
                }
                if dead_seen.is_none() {
                    if let Ok(s) = client.cluster_status().await {
                        if s.members.iter().any(|m| m.addr == victim && m.dead) {
                            dead_seen = Some(Instant::now());
                        }
                    }
                }
                assert!(
                    cut.elapsed() < Duration::from_secs(10),
                    "{step}: {victim} still serves 10 s after the cut"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            assert!(
                refused.answer.is_refusal(),
                "{step}: the first raw read after the cut not answered with data got {:?}",
                refused.answer
            );
            assert!(
                dead_seen.is_none(),
                "{step}: {victim} was declared dead before it stopped serving (it refused first at {:.0} ms)",
                ms(refused.sent, cut)
            );
            // Now the victim has stopped and T is rewritten: acknowledged
            // once its row has moved.
            let write_d3 = write_probe_tract(&shared, d3.clone());
            while dead_seen.is_none() {
                if let Ok(s) = client.cluster_status().await {
                    if s.members.iter().any(|m| m.addr == victim && m.dead) {
                        dead_seen = Some(Instant::now());
                    }
                }
                assert!(
                    cut.elapsed() < Duration::from_secs(20),
                    "{step}: {victim} not declared dead in 20 s"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            common::wait_recovered(&client, &mut procs, &shared, step, cut, std::slice::from_ref(&victim))
                .await;
            let acked =
                write_d3.await.unwrap().unwrap_or_else(|e| panic!("{step}: writing D3 to T failed: {e}"));
            let (new_row, new_version) = probe_row(&client.tlt(), &probe_blob);
            assert!(!new_row.contains(&victim) && new_version > old_version, "{step}: T's row did not move");
            // Still cut off and reachable, holding D2 at the old version: a
            // client with the old table must get D3.
            let got = stale_blob
                .read_tract(0)
                .await
                .unwrap_or_else(|e| panic!("{step}: the stale client failed: {e}"));
            assert!(got == d3, "{step}: a client with the old table read old data of T (STALE READ)");
            let before_heal = prober.snapshot();
            let last_data =
                before_heal.iter().filter(|p| p.sent >= cut && p.answer.is_data()).map(|p| p.sent).max();
            println!(
                "{step}: ts{n} answered raw reads with data until {:?} ms after the cut, refused first at {:.0} \
                 ms ({}), was seen dead at {:.0} ms (lease {LEASE:?}, dead after {} ms); D3 acknowledged at \
                 {:.0} ms, T's row now {new_row:?} at version {new_version}; the stale client read D3",
                last_data.map(|t| ms(t, cut).round()),
                ms(refused.sent, cut),
                refused.answer.label(),
                ms(dead_seen.unwrap(), cut),
                common::DEAD_AFTER_MS,
                ms(acked, cut)
            );
            println!(
                "{step}: raw reads during the cut: {:?}",
                counts(before_heal.iter().filter(|p| p.sent >= cut))
            );
            // A read sent after the lease has run out may not be served
            // (the last answered heartbeat was sent before the cut).
            assert_all_refused(
                step,
                "sent after the lease ran out",
                &before_heal.iter().filter(|p| p.sent >= cut + LEASE).cloned().collect::<Vec<_>>(),
                cut,
            );
            assert_all_refused(
                step,
                "sent after the first refusal",
                &before_heal.iter().filter(|p| p.sent >= refused.sent).cloned().collect::<Vec<_>>(),
                cut,
            );

            let healed = Instant::now();
            net.heal_from_meta(nft, n);
            println!("{step}: rule removed {:.0} ms after the cut", ms(healed, cut));
            let probes = watch_rejoin(&client, &mut procs, step, &victim, healed, prober).await;
            assert_all_refused(step, "after the rule was removed", &probes, healed);
            assert!(probe_blob.read_tract(0).await.unwrap() == d3, "{step}: T does not read as D3");
            shared.assert_no_failures(step);
            let (w, r) = shared.ops();
            println!(
                "{step}: the load completed {} writes and {} reads during the step",
                w - ops_before.0,
                r - ops_before.1
            );
            common::wait_progress(&shared, step).await;
            common::verify(&shared, &format!("after {step}")).await;
        }
    }

    common::stop_load(&shared, load).await;
    let (w, r) = shared.ops();
    println!("done in {:.1?}: {w} writes and {r} reads verified in all", test_start.elapsed());
    drop(procs);
    drop(net);
}
