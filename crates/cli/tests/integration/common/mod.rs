//! The harness shared by the real-process fault tests (`fault_recovery`,
//! `partition`, `replica_agreement`, `meta_failover`, ...): `blizzard`
//! child processes (and third-party tools) with log files, a continuous
//! verified load with a model of every acknowledged byte, the checks run
//! after a fault (recovery in the status, progress, every replica of every
//! tract equal to the model), and the replicated metadata service's
//! processes (replicas, their leader, tractservers and `blizzard nbd` on
//! them).
//!
//! Each test includes it with `mod common;` and uses part of it.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // real processes in real time

pub mod bin;
pub use bin::blizzard_bin;

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Mutex, RwLock};
use tokio::task::JoinHandle;

use blizzard_client::{Blob, Client};
use blizzard_proto::ClusterStatus;

pub const HEARTBEAT_MS: u64 = 100;
pub const DEAD_AFTER_MS: u64 = 1500;
/// Generous: recovery copies at most a few hundred MiB over loopback.
pub const RECOVERY_TIMEOUT: Duration = Duration::from_secs(90);
pub const POLL: Duration = Duration::from_millis(200);
/// Writes and reads (each) the load must complete after a recovery, and
/// how long it may take.
pub const PROGRESS_OPS: u64 = 20;
pub const PROGRESS_TIMEOUT: Duration = Duration::from_secs(20);
pub mod proc;
pub mod up;
use proc::LOG_TAIL_LINES;
pub use proc::{Proc, Procs};

/// Where the third-party program `tool` is installed; fails the test,
/// naming its Debian `package`, if it is not (`scripts/test` installs it):
/// a missing tool must not pass for a skipped test.
pub fn tool(tool: &str, package: &str) -> String {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.extend(["/usr/local/bin", "/usr/bin", "/bin"].map(PathBuf::from));
    match dirs.into_iter().map(|d| d.join(tool)).find(|p| p.is_file()) {
        Some(p) => p.display().to_string(),
        None => panic!("`{tool}` is missing: install the Debian package {package} (scripts/test does)"),
    }
}

/// A port free at the moment: bound, read and released. The metadata
/// server needs its address before the tractservers start.
///
/// Drawn at random below the kernel's ephemeral range (32768 and up here,
/// `ip_local_port_range`), which the kernel hands out by itself for
/// port-0 listeners and for the source ports of outgoing connections:
/// a port taken from that range can be given to another test's socket
/// between this release and the server's bind (a CI run lost a
/// tractserver's `--metrics` port that way). Below it, only another
/// test's own draw can collide.
pub fn free_port() -> u16 {
    const LOW: u64 = 10_000;
    const HIGH: u64 = 32_768;
    let env = blizzard_env::Env::real();
    for _ in 0..1000 {
        let port = (LOW + env.random_u64() % (HIGH - LOW)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {LOW} and {HIGH} after 1000 tries");
}

/// `blizzard meta` arguments: 1 MiB tracts, `HEARTBEAT_MS`, `DEAD_AFTER_MS`,
/// and Prometheus metrics at `metrics` if given.
pub fn meta_args(listen: &str, replication: u8, tractservers: usize, metrics: Option<&str>) -> Vec<String> {
    // No certificates: `--insecure` says so (issue 26; `cluster_tls`
    // runs a cluster with them).
    let mut v: Vec<String> = [
        "meta",
        "--insecure",
        "--listen",
        listen,
        "--replication",
        &replication.to_string(),
        "--init-tractservers",
        &tractservers.to_string(),
        "--tract-size",
        "1MiB",
        "--heartbeat-ms",
        &HEARTBEAT_MS.to_string(),
        "--dead-after-ms",
        &DEAD_AFTER_MS.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(m) = metrics {
        v.extend(["--metrics".to_string(), m.to_string()]);
    }
    v
}

/// A plain HTTP/1.1 GET; the body of a 200 answer.
pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

/// State shared by the load tasks, the verifier and the test body.
pub struct Shared {
    pub blobs: Vec<Blob>,
    /// `model[blob][tract]`: every acknowledged byte. Its lock is held
    /// across each operation on the tract, so operations on one tract never
    /// overlap.
    pub model: Vec<Vec<Mutex<Vec<u8>>>>,
    /// The load touches only the first `load_blobs` blobs; the test body
    /// may keep others of its own in the model (verified alike).
    pub load_blobs: usize,
    pub tract_size: usize,
    /// Largest write or read of the load.
    pub max_io: usize,
    /// Each load operation holds it shared; the verifier exclusively, so it
    /// sees no operation in flight.
    pub gate: RwLock<()>,
    pub stop: AtomicBool,
    pub writes: AtomicU64,
    pub reads: AtomicU64,
    /// Every failed or wrong operation, as a message.
    failures: std::sync::Mutex<Vec<String>>,
}

impl Shared {
    pub fn new(
        blobs: Vec<Blob>,
        model: Vec<Vec<Mutex<Vec<u8>>>>,
        load_blobs: usize,
        tract_size: usize,
        max_io: usize,
    ) -> Shared {
        Shared {
            blobs,
            model,
            load_blobs,
            tract_size,
            max_io,
            gate: RwLock::new(()),
            stop: AtomicBool::new(false),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            failures: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub fn fail(&self, msg: String) {
        eprintln!("LOAD FAILURE: {msg}");
        self.failures.lock().unwrap().push(msg);
        // After a failed write the tract's content is old or new or mixed
        // across replicas, so the model no longer tells what to expect.
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn failures(&self) -> Vec<String> {
        self.failures.lock().unwrap().clone()
    }

    pub fn ops(&self) -> (u64, u64) {
        (self.writes.load(Ordering::SeqCst), self.reads.load(Ordering::SeqCst))
    }

    /// Fails the test if the load has failed.
    pub fn assert_no_failures(&self, when: &str) {
        let failures = self.failures();
        assert!(failures.is_empty(), "{when}: the load failed:\n{}", failures.join("\n"));
    }

    /// A random range of one tract of a load blob: (blob, tract, offset, len).
    fn pick(&self, rng: &mut SmallRng) -> (usize, u64, usize, usize) {
        let blob = rng.random_range(0..self.load_blobs);
        let tract = rng.random_range(0..self.model[blob].len() as u64);
        let len = rng.random_range(1..=self.max_io);
        let offset = rng.random_range(0..=self.tract_size - len);
        (blob, tract, offset, len)
    }
}

/// Creates `n` blobs of `tracts` tracts each, every tract filled with
/// random data so every replica of every tract holds something to compare;
/// returns them with their model.
pub async fn fill_blobs(
    client: &Client,
    rng: &mut SmallRng,
    n: usize,
    tracts: u64,
    replication: u8,
) -> (Vec<Blob>, Vec<Vec<Mutex<Vec<u8>>>>) {
    let tract_size = client.tract_size() as usize;
    let mut blobs = Vec::new();
    let mut model = Vec::new();
    for _ in 0..n {
        let blob = client.create_blob(None, replication).await.unwrap();
        blob.extend_to(tracts).await.unwrap();
        let mut model_tracts = Vec::new();
        for t in 0..tracts {
            let mut data = vec![0u8; tract_size];
            rng.fill(&mut data[..]);
            blob.write_tract(t, Bytes::from(data.clone())).await.unwrap();
            model_tracts.push(Mutex::new(data));
        }
        blobs.push(blob);
        model.push(model_tracts);
    }
    (blobs, model)
}

/// Starts `writers` writer and `readers` reader tasks, each with its own
/// random stream derived from `seed`.
pub fn start_load(shared: &Arc<Shared>, seed: u64, writers: u64, readers: u64) -> Vec<JoinHandle<()>> {
    let mut load = Vec::new();
    for i in 0..writers + readers {
        let task_rng = SmallRng::seed_from_u64(seed ^ (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let s = shared.clone();
        load.push(if i < writers {
            tokio::spawn(writer(s, task_rng))
        } else {
            tokio::spawn(reader(s, task_rng))
        });
    }
    load
}

/// Stops the load, waits for its tasks and fails the test on any failure.
pub async fn stop_load(shared: &Shared, load: Vec<JoinHandle<()>>) {
    shared.stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    shared.assert_no_failures("at the end");
}

async fn writer(shared: Arc<Shared>, mut rng: SmallRng) {
    while !shared.stop.load(Ordering::SeqCst) {
        let (b, t, off, len) = shared.pick(&mut rng);
        let mut data = vec![0u8; len];
        rng.fill(&mut data[..]);
        let data = Bytes::from(data);
        let _pause = shared.gate.read().await;
        let mut model = shared.model[b][t as usize].lock().await;
        if shared.stop.load(Ordering::SeqCst) {
            return; // the model may be stale (see `Shared::fail`)
        }
        match shared.blobs[b].write(t, off as u32, data.clone()).await {
            Ok(()) => {
                model[off..off + len].copy_from_slice(&data);
                shared.writes.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                shared.fail(format!("write of blob {b} tract {t} [{off}, +{len}) failed: {e}"));
                return;
            }
        }
    }
}

async fn reader(shared: Arc<Shared>, mut rng: SmallRng) {
    while !shared.stop.load(Ordering::SeqCst) {
        let (b, t, off, len) = shared.pick(&mut rng);
        let _pause = shared.gate.read().await;
        let model = shared.model[b][t as usize].lock().await;
        if shared.stop.load(Ordering::SeqCst) {
            return; // the model may be stale (see `Shared::fail`)
        }
        match shared.blobs[b].read(t, off as u32, len as u32).await {
            Ok(got) => {
                if let Some(at) = first_difference(&got, &model[off..off + len]) {
                    shared.fail(format!(
                        "read of blob {b} tract {t} [{off}, +{len}) returned {} bytes that differ from the \
                         acknowledged writes first at tract offset {}",
                        got.len(),
                        off + at
                    ));
                    return;
                }
                shared.reads.fetch_add(1, Ordering::SeqCst);
            }
            Err(e) => {
                shared.fail(format!("read of blob {b} tract {t} [{off}, +{len}) failed: {e}"));
                return;
            }
        }
    }
}

/// Where `got` first differs from `want` (a length difference counts).
pub fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
    // Slice equality is a memcmp; the byte-wise search below is ~500 times
    // slower in a debug build, and only needed once something differs.
    if got == want {
        return None;
    }
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(at) => Some(at),
        None if got.len() != want.len() => Some(got.len().min(want.len())),
        None => None,
    }
}

/// Reads every replica of every tract (of every blob in the model, the
/// load's and the test body's) with the load paused and compares each with
/// the model; fails the test listing what differs.
pub async fn verify(shared: &Shared, when: &str) {
    let start = Instant::now();
    let _paused = shared.gate.write().await;
    let mut problems = Vec::new();
    let mut tracts = 0;
    for (b, blob) in shared.blobs.iter().enumerate() {
        let replication = blob.replication() as usize;
        for t in 0..shared.model[b].len() as u64 {
            tracts += 1;
            let model = shared.model[b][t as usize].lock().await;
            let replicas = match blob.read_replicas(t, 0, shared.tract_size as u32).await {
                Ok(r) => r,
                Err(e) => {
                    problems.push(format!("blob {b} tract {t}: reading the replicas failed: {e}"));
                    continue;
                }
            };
            if replicas.len() != replication {
                problems.push(format!("blob {b} tract {t}: {} replicas, not {replication}", replicas.len()));
            }
            for (i, r) in replicas.iter().enumerate() {
                if let Some(at) = first_difference(r, &model) {
                    problems.push(format!(
                        "blob {b} tract {t} replica {i}: differs from the acknowledged writes first at \
                         offset {at} (replica has {:?}, model {:?}; replica length {})",
                        r.get(at),
                        model.get(at),
                        r.len()
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        let shown = problems.len().min(20);
        panic!(
            "verification {when} found {} problems (first {shown}):\n{}",
            problems.len(),
            problems[..shown].join("\n")
        );
    }
    println!("verified {when}: every replica of {tracts} tracts matches in {:.1?}", start.elapsed());
}

/// The status, one line per member; members in `failed` (killed or cut
/// off by the test) are tagged.
pub fn describe(s: &ClusterStatus, failed: &[String]) -> String {
    let mut out = format!(
        "phase={} tlt_version={} rows={} rows_filling={} rows_degraded={} fully_replicated={}\n",
        s.phase,
        s.tlt_version,
        s.tlt_rows,
        s.rows_filling,
        s.rows_degraded,
        s.fully_replicated()
    );
    for m in &s.members {
        let tag = if failed.contains(&m.addr) { " (failed by the test)" } else { "" };
        writeln!(
            out,
            "  {}{tag}: alive={} dead={} rows={} primaries={} fill={{rows={} tracts={}/{} bytes={}}}",
            m.addr,
            m.alive,
            m.dead,
            m.rows,
            m.primaries,
            m.fill.rows,
            m.fill.tracts_done,
            m.fill.tracts_total,
            m.fill.bytes_done
        )
        .unwrap();
    }
    for a in failed {
        if !s.members.iter().any(|m| &m.addr == a) {
            writeln!(out, "  {a} (failed by the test): missing from the status").unwrap();
        }
    }
    out
}

/// Whether the cluster has recovered from every failure so far: every row
/// complete, every failed server declared dead (or, after a metadata server
/// restart, forgotten: the new one rebuilds the table from live servers and
/// never hears of one that died before it and holds no rows), and nobody
/// still copying.
pub fn recovered(s: &ClusterStatus, failed: &[String]) -> bool {
    let all_dead = failed.iter().all(|a| s.members.iter().all(|m| &m.addr != a || (m.dead && m.rows == 0)));
    s.fully_replicated() && all_dead && !copying(s)
}

/// Whether a live member is still copying rows.
pub fn copying(s: &ClusterStatus) -> bool {
    s.members.iter().any(|m| m.alive && m.fill.rows > 0)
}

/// Polls the status until `done` holds and returns that status; fails the
/// test after `RECOVERY_TIMEOUT` (`what` says what was awaited) or if a
/// process exits.
pub async fn wait_status(
    client: &Client,
    procs: &mut Procs,
    shared: &Shared,
    step: &str,
    what: &str,
    failed: &[String],
    mut done: impl FnMut(&ClusterStatus) -> bool,
) -> ClusterStatus {
    let start = Instant::now();
    let mut last: Option<ClusterStatus> = None;
    let mut last_err = None;
    loop {
        procs.check_running();
        match client.cluster_status().await {
            Ok(s) => {
                let ok = done(&s);
                last = Some(s);
                if ok {
                    return last.unwrap();
                }
            }
            Err(e) => last_err = Some(e.to_string()),
        }
        if start.elapsed() >= RECOVERY_TIMEOUT {
            let status = match &last {
                Some(s) => describe(s, failed),
                None => "no status received".to_string(),
            };
            panic!(
                "{step}: not done after {RECOVERY_TIMEOUT:?} (waiting for {what}).\nFailed by the test: \
                 {failed:?}\nLast status:\n{status}\nLast status error: {last_err:?}\nLoad failures: {:?}",
                shared.failures()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls the status until [`recovered`] from the failures in `failed`,
/// printing how long it took and the copying seen on the way.
pub async fn wait_recovered(
    client: &Client,
    procs: &mut Procs,
    shared: &Shared,
    step: &str,
    since: Instant,
    failed: &[String],
) -> ClusterStatus {
    let start = Instant::now();
    let mut max_rows_filling = 0;
    let mut fillers: Vec<String> = Vec::new();
    let mut bytes_copied = 0u64;
    let what = "fully_replicated, every failed server dead, nobody filling";
    let last = wait_status(client, procs, shared, step, what, failed, |s| {
        max_rows_filling = max_rows_filling.max(s.rows_filling);
        for m in s.members.iter().filter(|m| m.fill.rows > 0) {
            if !fillers.contains(&m.addr) {
                fillers.push(m.addr.clone());
            }
        }
        // bytes_done counts since each server started; all started with
        // the test, so the sum is the copying so far.
        bytes_copied = bytes_copied.max(s.members.iter().map(|m| m.fill.bytes_done).sum());
        recovered(s, failed)
    })
    .await;
    println!(
        "{step}: recovered {:.1?} after the first failure of the step ({:.1?} of waiting); rows_filling \
         peaked at {max_rows_filling}, members seen filling: {fillers:?}, bytes copied in all so far: \
         {bytes_copied}",
        since.elapsed(),
        start.elapsed()
    );
    println!("{}", describe(&last, failed));
    last
}

/// Waits until the load has completed `PROGRESS_OPS` more writes and
/// reads, failing the test if it fails or stalls.
pub async fn wait_progress(shared: &Shared, step: &str) {
    let (w, r) = shared.ops();
    let start = Instant::now();
    loop {
        let (w2, r2) = shared.ops();
        if w2 >= w + PROGRESS_OPS && r2 >= r + PROGRESS_OPS {
            return;
        }
        shared.assert_no_failures(step);
        assert!(
            start.elapsed() < PROGRESS_TIMEOUT,
            "{step}: the load stalled: {} writes and {} reads in {PROGRESS_TIMEOUT:?}",
            w2 - w,
            r2 - r
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// After a step: recovery, then no load failure, then the load still
/// makes progress, then every replica matches the model.
pub async fn finish_step(
    client: &Client,
    procs: &mut Procs,
    shared: &Shared,
    step: &str,
    since: Instant,
    ops_before: (u64, u64),
    failed: &[String],
) {
    wait_recovered(client, procs, shared, step, since, failed).await;
    shared.assert_no_failures(step);
    let (w, r) = shared.ops();
    println!(
        "{step}: the load completed {} writes and {} reads from the first failure to recovery",
        w - ops_before.0,
        r - ops_before.1
    );
    // Progress is required after recovery rather than during the step: a
    // quick recovery may leave too little time to count on any operation
    // finishing in between, and after it every row must serve again.
    wait_progress(shared, &format!("{step}, after recovery")).await;
    verify(shared, &format!("after {step}")).await;
}

/// The member of a replica group (runtime members or metadata replicas)
/// that leads, by its own account: its index in `addrs`.
#[allow(dead_code)]
pub async fn group_leader(addrs: &[String]) -> Option<usize> {
    for (i, a) in addrs.iter().enumerate() {
        if let Ok(s) = blizzard_replicated::node::status_of_member(
            &blizzard_env::Env::real(),
            a,
            Duration::from_millis(300),
        )
        .await
        {
            if s.state == "leader" {
                return Some(i);
            }
        }
    }
    None
}

/// Polls [`group_leader`] until a member other than `not` leads and
/// returns its index; fails the test after 30 s.
pub async fn wait_leader(addrs: &[String], not: Option<usize>) -> usize {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(l) = group_leader(addrs).await.filter(|l| Some(*l) != not) {
            return l;
        }
        assert!(Instant::now() < deadline, "no leader other than {not:?} within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until member `i` has applied what the leader `leader` has
/// committed (less two entries: the leader goes on committing); fails the
/// test after 30 s.
pub async fn wait_caught_up(addrs: &[String], i: usize, leader: usize) {
    let env = blizzard_env::Env::real();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let timeout = Duration::from_millis(500);
        let s = blizzard_replicated::node::status_of_member(&env, &addrs[i], timeout).await;
        let lead = blizzard_replicated::node::status_of_member(&env, &addrs[leader], timeout).await;
        if let (Ok(s), Ok(lead)) = (s, lead) {
            if s.applied.is_some() && s.applied >= lead.committed.map(|c| c.saturating_sub(2)) {
                return;
            }
        }
        assert!(Instant::now() < deadline, "member {} ({}) did not catch up within 30 s", i + 1, addrs[i]);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `args` (a `blizzard meta` command line, [`meta_args`]) made replica
/// `i` (id `i + 1`) of the group at `addrs`, its data in `dir/meta-ID`.
pub fn replica_args(dir: &Path, addrs: &[String], i: usize, mut args: Vec<String>) -> Vec<String> {
    let peers: Vec<String> = addrs.iter().enumerate().map(|(j, a)| format!("{}={a}", j + 1)).collect();
    args.extend([
        "--id".to_string(),
        (i + 1).to_string(),
        "--peers".to_string(),
        peers.join(","),
        "--data".to_string(),
        dir.join(format!("meta-{}", i + 1)).display().to_string(),
    ]);
    args
}

/// Replica `i` (id `i + 1`) of the metadata service at `addrs`, on
/// [`meta_args`], its data in `dir/meta-ID` (so a restart finds its log).
pub fn spawn_meta(dir: &Path, addrs: &[String], i: usize, replication: u8, tractservers: usize) -> Proc {
    let args = replica_args(dir, addrs, i, meta_args(&addrs[i], replication, tractservers, None));
    let name = format!("meta{}", i + 1);
    // A log per start: a restarted replica's does not overwrite the first.
    Proc::spawn(&name, &args, dir.join(format!("{name}-{}.log", free_port())), addrs[i].clone())
}

/// `n` tractservers of the metadata service `meta`, each on a disk file
/// of `disk_size` in `dir`, listening on ports of their choosing.
pub fn spawn_tractservers(dir: &Path, meta: &str, n: usize, disk_size: &str) -> Vec<Proc> {
    (0..n).map(|i| spawn_tractserver(dir, meta, i, disk_size)).collect()
}

/// Tractserver `i` of the metadata service `meta`, on disk file `ts{i}.disk`
/// of `disk_size` in `dir` (created if new). Port 0: the kernel picks, so
/// nothing can take the port between choosing and binding it; the address
/// comes from the log (the caller waits for it to listen).
pub fn spawn_tractserver(dir: &Path, meta: &str, i: usize, disk_size: &str) -> Proc {
    spawn_tractserver_with(dir, meta, i, disk_size, &[])
}

/// [`spawn_tractserver`] with more `blizzard tractserver` arguments.
pub fn spawn_tractserver_with(dir: &Path, meta: &str, i: usize, disk_size: &str, extra: &[&str]) -> Proc {
    let disk = dir.join(format!("ts{i}.disk")).display().to_string();
    let args: Vec<String> = [
        "tractserver",
        "--disk",
        &disk,
        "--create-size",
        disk_size,
        "--meta",
        meta,
        "--listen",
        "127.0.0.1:0",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let mut args = args;
    if !extra.contains(&"--tls-certificates") {
        args.push("--insecure".to_string());
    }
    Proc::spawn(&format!("ts{i}"), &args, dir.join(format!("ts{i}.log")), String::new())
}

/// A path as a command-line argument.
pub fn s(p: &Path) -> String {
    p.display().to_string()
}

/// The output of a command that must have succeeded (else the test fails
/// showing it).
pub fn ok((ok, text): (bool, String)) -> String {
    assert!(ok, "{text}");
    text
}

/// Runs `blizzard ARGS` to completion: (success, stdout + stderr).
pub fn blizzard(args: &[&str]) -> (bool, String) {
    let out = Command::new(blizzard_bin()).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// `blizzard nbd` serving `volume` as the default export on the unix
/// socket `dir/NAME.sock` (its `addr`), with `extra` arguments; its log is
/// `dir/NAME.log`. It opens the volume at start: a volume another process
/// holds stops it at once.
pub fn nbd(dir: &Path, meta: &str, name: &str, volume: &str, extra: &[&str]) -> Proc {
    let socket = dir.join(format!("{name}.sock")).display().to_string();
    let mut args: Vec<String> = ["nbd", "--meta", meta, "--socket", &socket, "--default-export", volume]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn(name, &args, dir.join(format!("{name}.log")), socket)
}

/// On a failing test, prints the last lines of every `*.log` in a
/// directory (the children's logs) when dropped.
pub struct DumpLogsOnPanic(pub PathBuf);

impl Drop for DumpLogsOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut logs: Vec<PathBuf> = fs::read_dir(&self.0)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!("===== last lines of {} =====", log.display());
            eprintln!("{}", lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n"));
        }
    }
}

/// The text without ANSI colour sequences (the servers' logs colour their
/// fields even in a file).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
