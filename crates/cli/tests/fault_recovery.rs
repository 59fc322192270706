//! Failure recovery across real processes: a metadata server and ten
//! tractservers run as `blizzard` processes on loopback TCP and disk files,
//! three 3-way blobs take a continuous verified load from this process, and
//! tractservers are SIGKILLed one step at a time (one; two in quick
//! succession; one, then one of the newcomers while it is still copying;
//! the metadata server; one more under the restarted metadata server).
//! After each step the metadata server must declare every killed server
//! dead and bring every row back to three complete replicas, and then every
//! replica of every tract must hold exactly the bytes acknowledged to the
//! load. Six of the ten tractservers die in all; four remain for 3-way rows.
//!
//! The load never sees an error: the client is meant to ride through a
//! failure by retrying against the refreshed TLT, so a failed read or write
//! fails the test. It keeps a model of every acknowledged byte and takes a
//! per-tract lock around each operation, so a read never races a write of
//! the same tract (whose outcome, old or new, would be ambiguous).
//!
//! The random choices (data, offsets, victims) come from a seed printed at
//! the start; set `FAULT_RECOVERY_SEED` to reuse one. Process timing still
//! varies between runs, so a seed narrows a failure down but need not
//! replay it.

// The test drives real processes and sockets in real time, outside the env
// seam, and a failure must stop it with its context.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::fmt::Write as _;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Mutex, RwLock};

use blizzard_client::{Blob, Client, ClientConfig};
use blizzard_env::Env;
use blizzard_proto::ClusterStatus;

const TRACTSERVERS: usize = 10;
const REPLICATION: u8 = 3;
const TRACT_SIZE: usize = 1 << 20;
const BLOBS: usize = 3;
const TRACTS_PER_BLOB: u64 = 32;
const WRITERS: u64 = 4;
const READERS: u64 = 2;
const MAX_IO: usize = 64 << 10;
const HEARTBEAT_MS: u64 = 100;
const DEAD_AFTER_MS: u64 = 1500;
/// Generous: recovery copies at most a few hundred MiB over loopback.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(200);
/// Writes and reads (each) the load must complete after a recovery, and
/// how long it may take.
const PROGRESS_OPS: u64 = 20;
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(20);
/// Lines of each child's log shown when the test fails.
const LOG_TAIL_LINES: usize = 40;

/// One `blizzard` child process with its stdout and stderr in a log file.
/// Dropping it SIGKILLs it and reaps it, so a failing test leaves nothing
/// running.
struct Proc {
    name: String,
    child: Option<Child>,
    log: PathBuf,
    /// Where it listens.
    addr: String,
}

impl Proc {
    fn spawn(name: &str, args: &[String], log: PathBuf, addr: String) -> Proc {
        let out = File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_blizzard"))
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        Proc { name: name.to_string(), child: Some(child), log, addr }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    fn killed(&self) -> bool {
        self.child.is_none()
    }

    /// SIGKILL (std's `Child::kill`), then reap.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Fails the test if a process that should be running has exited: a
    /// crash of a survivor must not pass for a recovery problem.
    fn check_running(&mut self) {
        if let Some(c) = self.child.as_mut() {
            if let Some(status) = c.try_wait().unwrap() {
                panic!(
                    "{} ({}) exited unexpectedly ({status}); its log:\n{}",
                    self.name,
                    self.addr,
                    self.tail()
                );
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The metadata server and the tractservers. On a failing test it prints
/// the tail of every child's log before its fields kill the children.
struct Procs {
    meta: Proc,
    ts: Vec<Proc>,
    /// The metadata server's metrics endpoint.
    metrics: String,
}

impl Procs {
    fn all_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        std::iter::once(&mut self.meta).chain(self.ts.iter_mut())
    }

    fn check_running(&mut self) {
        self.all_mut().for_each(Proc::check_running);
    }

    fn killed_addrs(&self) -> Vec<String> {
        self.ts.iter().filter(|p| p.killed()).map(|p| p.addr.clone()).collect()
    }

    fn by_addr(&mut self, addr: &str) -> Option<&mut Proc> {
        self.ts.iter_mut().find(|p| p.addr == addr)
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in std::iter::once(&self.meta).chain(&self.ts) {
                let state = if p.killed() { "killed by the test" } else { "running" };
                eprintln!("===== {} ({}, {state}): last lines of {} =====", p.name, p.addr, p.log.display());
                eprintln!("{}", p.tail());
            }
        }
    }
}

/// A port free at the moment: bound, read and released. The metadata
/// server needs its address before the tractservers start.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The metadata server's arguments; `metrics` is its metrics endpoint,
/// kept across its restart.
fn meta_args(meta_addr: &str, metrics: &str) -> Vec<String> {
    [
        "meta",
        "--listen",
        meta_addr,
        "--replication",
        &REPLICATION.to_string(),
        "--init-tractservers",
        &TRACTSERVERS.to_string(),
        "--tract-size",
        "1MiB",
        "--heartbeat-ms",
        &HEARTBEAT_MS.to_string(),
        "--dead-after-ms",
        &DEAD_AFTER_MS.to_string(),
        "--metrics",
        metrics,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn start_cluster(dir: &Path) -> Procs {
    let meta_addr = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let meta = Proc::spawn("meta", &meta_args(&meta_addr, &metrics), dir.join("meta.log"), meta_addr.clone());
    let mut procs = Procs { meta, ts: Vec::new(), metrics };
    for i in 0..TRACTSERVERS {
        let disk = dir.join(format!("ts{i}.disk")).display().to_string();
        let args: Vec<String> = [
            "tractserver",
            "--disk",
            &disk,
            "--create-size",
            "256MiB",
            "--meta",
            &meta_addr,
            // Port 0: the kernel picks, so nothing can take the port between
            // choosing and binding it; the address comes from the log.
            "--listen",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let name = format!("ts{i}");
        let log = dir.join(format!("{name}.log"));
        procs.ts.push(Proc::spawn(&name, &args, log, String::new()));
    }
    // Each tractserver prints `tractserver ID listening on ADDR` once it
    // serves (after formatting its disk with the metadata server's
    // parameters); the status lists members by that address.
    let start = Instant::now();
    for i in 0..TRACTSERVERS {
        loop {
            let text = procs.ts[i].log_text();
            let line = text.lines().find(|l| l.starts_with("tractserver ") && l.contains(" listening on "));
            if let Some(line) = line {
                let (_, addr) = line.rsplit_once(" listening on ").unwrap();
                procs.ts[i].addr = addr.trim().to_string();
                break;
            }
            procs.check_running();
            assert!(start.elapsed() < Duration::from_secs(30), "ts{i} is not serving after 30 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    procs
}

/// State shared by the load tasks, the verifier and the test body.
struct Shared {
    blobs: Vec<Blob>,
    /// `model[blob][tract]`: every acknowledged byte. Its lock is held
    /// across each operation on the tract, so operations on one tract never
    /// overlap.
    model: Vec<Vec<Mutex<Vec<u8>>>>,
    /// Each load operation holds it shared; the verifier exclusively, so it
    /// sees no operation in flight.
    gate: RwLock<()>,
    stop: AtomicBool,
    writes: AtomicU64,
    reads: AtomicU64,
    /// Every failed or wrong operation, as a message.
    failures: std::sync::Mutex<Vec<String>>,
}

impl Shared {
    fn fail(&self, msg: String) {
        eprintln!("LOAD FAILURE: {msg}");
        self.failures.lock().unwrap().push(msg);
        // After a failed write the tract's content is old or new or mixed
        // across replicas, so the model no longer tells what to expect.
        self.stop.store(true, Ordering::SeqCst);
    }

    fn failures(&self) -> Vec<String> {
        self.failures.lock().unwrap().clone()
    }

    fn ops(&self) -> (u64, u64) {
        (self.writes.load(Ordering::SeqCst), self.reads.load(Ordering::SeqCst))
    }
}

/// A random range of one tract: (blob, tract, offset, len).
fn pick(rng: &mut SmallRng) -> (usize, u64, usize, usize) {
    let blob = rng.random_range(0..BLOBS);
    let tract = rng.random_range(0..TRACTS_PER_BLOB);
    let len = rng.random_range(1..=MAX_IO);
    let offset = rng.random_range(0..=TRACT_SIZE - len);
    (blob, tract, offset, len)
}

async fn writer(shared: Arc<Shared>, mut rng: SmallRng) {
    while !shared.stop.load(Ordering::SeqCst) {
        let (b, t, off, len) = pick(&mut rng);
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
        let (b, t, off, len) = pick(&mut rng);
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
fn first_difference(got: &[u8], want: &[u8]) -> Option<usize> {
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

/// Reads every replica of every tract with the load paused and compares
/// each with the model; fails the test listing what differs.
async fn verify(shared: &Shared, when: &str) {
    let start = Instant::now();
    let _paused = shared.gate.write().await;
    let mut problems = Vec::new();
    for (b, blob) in shared.blobs.iter().enumerate() {
        for t in 0..TRACTS_PER_BLOB {
            let model = shared.model[b][t as usize].lock().await;
            let replicas = match blob.read_replicas(t, 0, TRACT_SIZE as u32).await {
                Ok(r) => r,
                Err(e) => {
                    problems.push(format!("blob {b} tract {t}: reading the replicas failed: {e}"));
                    continue;
                }
            };
            if replicas.len() != REPLICATION as usize {
                problems.push(format!("blob {b} tract {t}: {} replicas, not {REPLICATION}", replicas.len()));
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
    println!(
        "verified {when}: {} tracts x {REPLICATION} replicas match in {:.1?}",
        BLOBS as u64 * TRACTS_PER_BLOB,
        start.elapsed()
    );
}

fn describe(s: &ClusterStatus, killed: &[String]) -> String {
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
        let tag = if killed.contains(&m.addr) { " (killed)" } else { "" };
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
    for a in killed {
        if !s.members.iter().any(|m| &m.addr == a) {
            writeln!(out, "  {a} (killed): missing from the status").unwrap();
        }
    }
    out
}

/// Whether the cluster has recovered from every kill so far: every row
/// complete, every killed server declared dead (or, after a metadata server
/// restart, forgotten: the new one rebuilds the table from live servers and
/// never hears of one that died before it and holds no rows), and nobody
/// still copying.
fn recovered(s: &ClusterStatus, killed: &[String]) -> bool {
    let all_dead = killed.iter().all(|a| s.members.iter().all(|m| &m.addr != a || (m.dead && m.rows == 0)));
    let copying = s.members.iter().any(|m| m.alive && m.fill.rows > 0);
    s.fully_replicated() && all_dead && !copying
}

/// Polls the status until [`recovered`], printing how long it took and the
/// copying seen on the way; fails the test after `RECOVERY_TIMEOUT`.
async fn wait_recovered(client: &Client, procs: &mut Procs, shared: &Shared, step: &str, since: Instant) {
    let killed = procs.killed_addrs();
    let start = Instant::now();
    let mut last: Option<ClusterStatus> = None;
    let mut last_err = None;
    let mut max_rows_filling = 0;
    let mut fillers: Vec<String> = Vec::new();
    let mut bytes_copied = 0u64;
    loop {
        procs.check_running();
        match client.cluster_status().await {
            Ok(s) => {
                max_rows_filling = max_rows_filling.max(s.rows_filling);
                for m in s.members.iter().filter(|m| m.fill.rows > 0) {
                    if !fillers.contains(&m.addr) {
                        fillers.push(m.addr.clone());
                    }
                }
                // bytes_done counts since each server started; all started
                // with the test, so the sum is the copying so far.
                bytes_copied = bytes_copied.max(s.members.iter().map(|m| m.fill.bytes_done).sum());
                let done = recovered(&s, &killed);
                last = Some(s);
                if done {
                    break;
                }
            }
            Err(e) => last_err = Some(e.to_string()),
        }
        if start.elapsed() >= RECOVERY_TIMEOUT {
            let status = match &last {
                Some(s) => describe(s, &killed),
                None => "no status received".to_string(),
            };
            panic!(
                "{step}: no recovery after {RECOVERY_TIMEOUT:?} (waiting for fully_replicated, every killed \
                 server dead, nobody filling).\nKilled: {killed:?}\nLast status:\n{status}\nLast status \
                 error: {last_err:?}\nLoad failures: {:?}",
                shared.failures()
            );
        }
        tokio::time::sleep(POLL).await;
    }
    println!(
        "{step}: recovered {:.1?} after the first kill of the step ({:.1?} of waiting); rows_filling peaked \
         at {max_rows_filling}, members seen filling: {fillers:?}, bytes copied in all so far: {bytes_copied}",
        since.elapsed(),
        start.elapsed()
    );
    println!("{}", describe(last.as_ref().unwrap(), &killed));
}

/// A tractserver still running, chosen at random.
fn random_live(procs: &Procs, rng: &mut SmallRng) -> String {
    let live: Vec<&Proc> = procs.ts.iter().filter(|p| !p.killed()).collect();
    live[rng.random_range(0..live.len())].addr.clone()
}

fn kill(procs: &mut Procs, addr: &str, step: &str) {
    let p = procs.by_addr(addr).unwrap();
    println!("{step}: SIGKILL {} ({addr})", p.name);
    p.kill();
}

/// After a step: recovery, then no load failure, then the load still
/// makes progress, then every replica matches the model.
async fn finish_step(
    client: &Client,
    procs: &mut Procs,
    shared: &Shared,
    step: &str,
    since: Instant,
    ops_before: (u64, u64),
) {
    wait_recovered(client, procs, shared, step, since).await;
    let failures = shared.failures();
    assert!(failures.is_empty(), "{step}: the load failed:\n{}", failures.join("\n"));
    let (w, r) = shared.ops();
    println!(
        "{step}: the load completed {} writes and {} reads from the first kill to recovery",
        w - ops_before.0,
        r - ops_before.1
    );
    // Progress is required after recovery rather than during the step: a
    // quick recovery may leave too little time to count on any operation
    // finishing in between, and after it every row must serve again.
    let start = Instant::now();
    loop {
        let (w2, r2) = shared.ops();
        if w2 >= w + PROGRESS_OPS && r2 >= r + PROGRESS_OPS {
            break;
        }
        let failures = shared.failures();
        assert!(failures.is_empty(), "{step}: the load failed after recovery:\n{}", failures.join("\n"));
        assert!(
            start.elapsed() < PROGRESS_TIMEOUT,
            "{step}: the load stalled after recovery: {} writes and {} reads in {PROGRESS_TIMEOUT:?}",
            w2 - w,
            r2 - r
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    verify(shared, &format!("after {step}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_recovers_from_tractserver_kills_under_load() {
    let seed = match std::env::var("FAULT_RECOVERY_SEED") {
        Ok(s) => s.parse().expect("FAULT_RECOVERY_SEED must be a u64"),
        Err(_) => Env::real().random_u64(),
    };
    println!("seed {seed} (set FAULT_RECOVERY_SEED={seed} to reuse it)");
    let mut rng = SmallRng::seed_from_u64(seed);

    let dir = tempfile::tempdir().unwrap();
    let mut procs = start_cluster(dir.path());
    let client = Client::connect(Env::real(), ClientConfig::new(procs.meta.addr.clone())).await.unwrap();
    assert_eq!(client.tract_size() as usize, TRACT_SIZE);

    // Blobs, filled with random data so every replica of every tract holds
    // something to compare.
    let start = Instant::now();
    let mut blobs = Vec::new();
    let mut model = Vec::new();
    for _ in 0..BLOBS {
        let blob = client.create_blob(None, REPLICATION).await.unwrap();
        blob.extend_to(TRACTS_PER_BLOB).await.unwrap();
        let mut tracts = Vec::new();
        for t in 0..TRACTS_PER_BLOB {
            let mut data = vec![0u8; TRACT_SIZE];
            rng.fill(&mut data[..]);
            blob.write_tract(t, Bytes::from(data.clone())).await.unwrap();
            tracts.push(Mutex::new(data));
        }
        blobs.push(blob);
        model.push(tracts);
    }
    println!("filled {BLOBS} blobs of {TRACTS_PER_BLOB} tracts in {:.1?}", start.elapsed());
    let shared = Arc::new(Shared {
        blobs,
        model,
        gate: RwLock::new(()),
        stop: AtomicBool::new(false),
        writes: AtomicU64::new(0),
        reads: AtomicU64::new(0),
        failures: std::sync::Mutex::new(Vec::new()),
    });

    let mut load = Vec::new();
    for i in 0..WRITERS + READERS {
        // Each task its own stream, derived from the seed.
        let task_rng = SmallRng::seed_from_u64(seed ^ (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let s = shared.clone();
        load.push(if i < WRITERS {
            tokio::spawn(writer(s, task_rng))
        } else {
            tokio::spawn(reader(s, task_rng))
        });
    }

    // Steady state: the load runs on a healthy cluster, and the verifier
    // sees every replica agree before anything fails.
    let ops_before = shared.ops();
    tokio::time::sleep(Duration::from_secs(2)).await;
    procs.check_running();
    let failures = shared.failures();
    assert!(failures.is_empty(), "the load failed on a healthy cluster:\n{}", failures.join("\n"));
    let (w, r) = shared.ops();
    println!("steady state: {} writes and {} reads in 2 s", w - ops_before.0, r - ops_before.1);
    assert!(w > ops_before.0 && r > ops_before.1, "the load made no progress on a healthy cluster");
    verify(&shared, "before any kill").await;

    // a. One tractserver.
    let step = "step a (one kill)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // b. Two more, the second while the first may still be undetected.
    let step = "step b (two kills 300 ms apart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // c. One, then a server that is copying rows for that failure: a
    // failure during recovery. A newcomer shows `fill.rows > 0` once the
    // first is declared dead; if none is seen within 3 s (copying was too
    // quick to catch), any live server goes instead.
    let step = "step c (a kill during recovery)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    let killed = procs.killed_addrs();
    let mut filling = None;
    while filling.is_none() && since.elapsed() < Duration::from_secs(3) {
        if let Ok(s) = client.cluster_status().await {
            let fillers: Vec<&str> = s
                .members
                .iter()
                .filter(|m| m.fill.rows > 0 && !killed.contains(&m.addr))
                .map(|m| m.addr.as_str())
                .collect();
            if !fillers.is_empty() {
                filling = Some(fillers[rng.random_range(0..fillers.len())].to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = match filling {
        Some(a) => {
            println!("{step}: {a} is filling {:.1?} after the first kill", since.elapsed());
            a
        }
        None => {
            println!("{step}: no member seen filling within 3 s; killing a random live one");
            random_live(&procs, &mut rng)
        }
    };
    kill(&mut procs, &second, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // d. The metadata server, SIGKILLed mid-load and started again on the
    // same address: it rebuilds the TLT from the tractservers' stored
    // assignments while clients keep going on the table they cached.
    let step = "step d (metadata server restart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    println!("{step}: SIGKILL meta ({})", procs.meta.addr);
    procs.meta.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let addr = procs.meta.addr.clone();
    procs.meta = Proc::spawn("meta", &meta_args(&addr, &procs.metrics), dir.path().join("meta-2.log"), addr);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // e. One more tractserver, under the rebuilt metadata server (which
    // never saw the earlier deaths): four remain.
    let step = "step e (a kill after the metadata server restart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    // An operator following it: once the status shows the server down,
    // `blizzard status --watch` returns when the rows are whole again and
    // shows the dead server.
    loop {
        if let Ok(s) = client.cluster_status().await {
            if s.members.iter().any(|m| m.addr == victim && !m.alive) {
                break;
            }
        }
        assert!(since.elapsed() < RECOVERY_TIMEOUT, "{step}: the killed server never showed as down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let watch = Command::new(env!("CARGO_BIN_EXE_blizzard"))
        .args(["status", "--watch", "--meta", &procs.meta.addr])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;
    let out = tokio::task::spawn_blocking(move || watch.wait_with_output()).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "blizzard status --watch failed:\n{text}");
    assert!(text.contains("every row has all 3 members alive and complete"), "{text}");
    assert!(text.lines().any(|l| l.contains(&victim) && l.contains(" dead ")), "{text}");
    println!("{step}: blizzard status --watch ended with:\n{text}");

    shared.stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    let failures = shared.failures();
    assert!(failures.is_empty(), "the load failed:\n{}", failures.join("\n"));
    let (w, r) = shared.ops();
    println!("done: {w} writes and {r} reads verified in all");

    // The operator's view agrees: the metadata server's metrics show the
    // cluster whole again, with the server killed in step e dead.
    let text = http_get(&procs.metrics, "/metrics").await;
    for want in [
        "blizzard_rows_filling 0\n",
        "blizzard_rows_degraded 0\n",
        "blizzard_tractservers{state=\"dead\"} 1\n",
    ] {
        assert!(text.contains(want), "metrics lack {want:?}:\n{text}");
    }
    let copied = text
        .lines()
        .find_map(|l| l.strip_prefix("blizzard_recovery_bytes_total "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(copied > 0.0, "no recovery bytes in the metrics:\n{text}");
}

/// A plain HTTP/1.1 GET, the body returned.
async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}
