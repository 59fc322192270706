//! kvload: one load generator for `blizzard kv serve` and etcd 3.4, so the
//! two replicated stores meet the same closed loop (bench/runtime.sh).
//!
//! - `prefill`: puts every key once (`k00000000` .. `k{keys-1}`), many at a
//!   time, so the measured gets always find their key.
//! - `run`: `--clients` tasks share `--conns` connections (blizzard: one
//!   `Client`, hence one session, per connection; etcd: one
//!   `etcd_client::Client` per connection). Each task loops: a random key,
//!   a put of `--value-size` bytes with probability `--put-percent`, else a
//!   get. Both sides read linearizably (blizzard's `Client::read` confirms
//!   leadership with a heartbeat quorum; etcd's default range is
//!   linearizable). After `--warmup` seconds it counts the operations
//!   completed in the next `--duration` seconds, their latencies, and the
//!   CPU time (utime+stime from /proc) of the `--cpu-pids` server processes
//!   and of itself over exactly that window. Prints one line.
//! - `failover`: a put-only load; finds the leader, SIGKILLs its process,
//!   and reports the time from the kill (t0) to the completion of the first
//!   put that was invoked after t0 and succeeded: the old leader is dead,
//!   so that put was committed by a new one. Besides the load's tasks
//!   (which may all be stuck in puts sent before the kill), a fresh put is
//!   invoked every 5 ms after t0, so a new leader's first commit is seen
//!   as soon as it can be.
//!
//! Errors are counted and printed, never hidden; a get that finds no value
//! after the prefill is a `missing` (it would be a lost write).
//!
//! Real time, real processes: this is a benchmark tool, outside the env
//! seam on purpose (it talks to the servers from outside, as any client).

// Real time, real processes and real sockets (see above).
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use clap::{Args, Parser, Subcommand, ValueEnum};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use blizzard_env::Env;
use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::ds::ops::{Query, QueryReply, Update};
use blizzard_replicated::node::status_of_member;

/// How long a status probe of one member may take.
const STATUS_TIMEOUT: Duration = Duration::from_millis(500);
/// How long `failover` waits for a put committed by a new leader.
const FAILOVER_WAIT_MAX: Duration = Duration::from_secs(60);
/// How often `failover` invokes a fresh put after the kill.
const PROBE_EVERY: Duration = Duration::from_millis(5);
/// Error messages printed in full (the rest are only counted).
const ERRORS_SHOWN_MAX: u64 = 5;

#[derive(Parser)]
#[command(about = "Key-value load against blizzard kv serve or etcd (bench/runtime.sh)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Put every key once.
    Prefill(Common),
    /// The measured mixed load; prints one line.
    Run(RunArgs),
    /// Kill the leader under a put load; prints the failover time.
    Failover(FailoverArgs),
    /// Each member's view; exits 0 only if the group is whole: every
    /// member answers, one leads, and all have applied the same index.
    Status(Common),
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum Target {
    Blizzard,
    Etcd,
}

#[derive(Args, Clone)]
struct Common {
    #[arg(long, value_enum)]
    target: Target,
    /// The members' client addresses, comma-separated (blizzard: HOST:PORT,
    /// optionally ID=HOST:PORT; etcd: http://HOST:PORT or HOST:PORT).
    #[arg(long)]
    endpoints: String,
    /// Concurrent client tasks.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Connections (blizzard: `Client`s, each with its own session) the
    /// tasks share, task i using connection i % conns.
    #[arg(long, default_value_t = 8)]
    conns: usize,
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    #[arg(long, default_value_t = 256)]
    value_size: usize,
    /// blizzard: one attempt at one member (then the client tries another).
    #[arg(long, default_value_t = 500)]
    attempt_timeout_ms: u64,
    /// etcd: `all` gives every connection every endpoint (etcd-client
    /// balances requests over them; followers forward puts and run reads
    /// through the leader); `leader` connects only to the current leader
    /// (as blizzard's client ends up doing).
    #[arg(long, value_enum, default_value_t = EtcdBalance::All)]
    etcd_balance: EtcdBalance,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum EtcdBalance {
    All,
    Leader,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: Common,
    /// Percent of operations that are puts (the rest are gets).
    #[arg(long, default_value_t = 50)]
    put_percent: u32,
    /// Measured seconds.
    #[arg(long, default_value_t = 15)]
    duration: u64,
    /// Seconds of load before the measured window.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// The server processes whose CPU time is counted, comma-separated.
    #[arg(long, default_value = "")]
    cpu_pids: String,
}

#[derive(Args)]
struct FailoverArgs {
    #[command(flatten)]
    common: Common,
    /// Each member's process: ID=PID,... (blizzard: its member id; etcd: the
    /// 1-based position of its endpoint in --endpoints).
    #[arg(long)]
    pids: String,
    /// Seconds of load before the kill.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
}

/// One task's handle on its connection.
#[derive(Clone)]
enum Handle {
    Blizzard(Arc<Client>),
    Etcd(Box<etcd_client::KvClient>),
}

fn key_of(k: u64) -> String {
    format!("k{k:08}")
}

impl Handle {
    async fn put(&mut self, key: u64, value: &Bytes) -> Result<()> {
        match self {
            Handle::Blizzard(c) => {
                let u = Update::Put { key: key_of(key).into(), value: value.clone() };
                let reply = c.update(u.encode()).await?;
                u.decode_reply(&reply).map_err(|e| anyhow!("undecodable put reply: {e:?}"))?;
                Ok(())
            }
            Handle::Etcd(c) => {
                c.put(key_of(key), value.to_vec(), None).await?;
                Ok(())
            }
        }
    }

    /// Whether the key had a value.
    async fn get(&mut self, key: u64) -> Result<bool> {
        match self {
            Handle::Blizzard(c) => {
                let q = Query::Get { key: key_of(key).into() };
                let reply = c.read(q.encode()).await?;
                match q.decode_reply(&reply).map_err(|e| anyhow!("undecodable get reply: {e:?}"))? {
                    QueryReply::Get(v) => Ok(v.is_some()),
                    other => bail!("a get answered {other:?}"),
                }
            }
            // No options: a linearizable (not serializable) range.
            Handle::Etcd(c) => Ok(!c.get(key_of(key), None).await?.kvs().is_empty()),
        }
    }
}

fn target_name(t: Target) -> &'static str {
    match t {
        Target::Blizzard => "blizzard",
        Target::Etcd => "etcd",
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect()
}

/// Client addresses, without blizzard's optional `ID=`.
fn addrs(common: &Common) -> Result<Vec<String>> {
    let a: Vec<String> = split_list(&common.endpoints)
        .into_iter()
        .map(|p| p.split_once('=').map_or(p.clone(), |(_, a)| a.to_string()))
        .collect();
    if a.is_empty() {
        bail!("--endpoints: none given");
    }
    Ok(a)
}

async fn etcd_connect(endpoints: &[String]) -> Result<etcd_client::Client> {
    let opts = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_secs(10));
    etcd_client::Client::connect(endpoints, Some(opts))
        .await
        .with_context(|| format!("connecting to etcd at {endpoints:?}"))
}

/// `common.conns` connections, ready (blizzard: sessions open).
async fn connect(env: &Env, common: &Common) -> Result<Vec<Handle>> {
    let addrs = addrs(common)?;
    let mut out = Vec::new();
    match common.target {
        Target::Blizzard => {
            let cfg = ClientConfig {
                attempt_timeout: Duration::from_millis(common.attempt_timeout_ms),
                request_timeout: Duration::from_secs(30),
                // Retry quickly while an election is under way: the client
                // should not be what makes a failover look slow.
                election_pause: Duration::from_millis(2),
            };
            for _ in 0..common.conns.max(1) {
                let c = Client::new(env, addrs.clone(), cfg.clone());
                c.open_session().await.context("opening a session")?;
                out.push(Handle::Blizzard(Arc::new(c)));
            }
        }
        Target::Etcd => {
            let eps = match common.etcd_balance {
                EtcdBalance::All => addrs.clone(),
                EtcdBalance::Leader => {
                    let st = statuses(env, common).await;
                    let l = st
                        .iter()
                        .find(|m| m.leader)
                        .ok_or_else(|| anyhow!("--etcd-balance leader: no member is the leader"))?;
                    vec![addrs[l.index].clone()]
                }
            };
            for _ in 0..common.conns.max(1) {
                out.push(Handle::Etcd(Box::new(etcd_connect(&eps).await?.kv_client())));
            }
        }
    }
    Ok(out)
}

/// What one member says of itself.
#[derive(Debug, Clone)]
struct MemberStatus {
    /// Its position in --endpoints.
    index: usize,
    /// blizzard: the member id; etcd: index + 1 (etcd's ids are hashes).
    id: u64,
    leader: bool,
    term: u64,
    /// The last log index applied to its state machine.
    applied: u64,
}

async fn statuses(env: &Env, common: &Common) -> Vec<MemberStatus> {
    let Ok(addrs) = addrs(common) else { return Vec::new() };
    let mut out = Vec::new();
    for (index, a) in addrs.iter().enumerate() {
        match common.target {
            Target::Blizzard => {
                if let Ok(s) = status_of_member(env, a, STATUS_TIMEOUT).await {
                    out.push(MemberStatus {
                        index,
                        id: s.id,
                        leader: s.state == "leader",
                        term: s.term,
                        applied: s.applied.unwrap_or(0),
                    });
                }
            }
            Target::Etcd => {
                let probe = async {
                    let mut c = etcd_connect(std::slice::from_ref(a)).await?;
                    let s = c.status().await?;
                    let me = s.header().map(|h| h.member_id()).unwrap_or(0);
                    anyhow::Ok(MemberStatus {
                        index,
                        id: index as u64 + 1,
                        leader: me != 0 && me == s.leader(),
                        term: s.raft_term(),
                        applied: s.raft_applied_index(),
                    })
                };
                if let Ok(Ok(m)) = tokio::time::timeout(STATUS_TIMEOUT * 4, probe).await {
                    out.push(m);
                }
            }
        }
    }
    out
}

/// `term=T leader=ID` as the group sees it (`-` if none or several).
fn describe(st: &[MemberStatus]) -> (u64, String) {
    let term = st.iter().map(|m| m.term).max().unwrap_or(0);
    let leaders: Vec<u64> = st.iter().filter(|m| m.leader).map(|m| m.id).collect();
    let leader = match leaders.as_slice() {
        [one] => one.to_string(),
        _ => "-".to_string(),
    };
    (term, leader)
}

/// utime+stime of a process, in clock ticks.
fn cpu_ticks(pid: &str) -> Result<u64> {
    let stat =
        std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("process {pid}"))?;
    // The command name may hold spaces and parentheses: fields start after the last ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or_else(|| anyhow!("/proc/{pid}/stat: no ')'"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat(5); `rest` starts at field 3.
    let ticks = |i: usize| -> Result<u64> {
        f.get(i).ok_or_else(|| anyhow!("/proc/{pid}/stat: short"))?.parse().context("a tick count")
    };
    Ok(ticks(11)? + ticks(12)?)
}

fn clk_tck() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// Counts errors and shows the first few.
struct Errors {
    n: AtomicU64,
    shown_max: u64,
}

impl Errors {
    fn new(shown_max: u64) -> Errors {
        Errors { n: AtomicU64::new(0), shown_max }
    }
    fn note(&self, what: &str, e: &anyhow::Error) {
        let n = self.n.fetch_add(1, Ordering::Relaxed);
        if n < self.shown_max {
            eprintln!("kvload: {what} failed: {e:#}");
        }
    }
    fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

fn value(rng: &mut SmallRng, size: usize) -> Bytes {
    let mut v = vec![0u8; size];
    rng.fill_bytes(&mut v);
    Bytes::from(v)
}

async fn prefill(env: &Env, common: &Common) -> Result<()> {
    let handles = connect(env, common).await?;
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Errors::new(ERRORS_SHOWN_MAX));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..common.clients.max(1) {
        let mut h = handles[i % handles.len()].clone();
        let (next, errors, keys, size) = (next.clone(), errors.clone(), common.keys, common.value_size);
        tasks.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(i as u64);
            let v = value(&mut rng, size);
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= keys {
                    break;
                }
                if let Err(e) = h.put(k, &v).await {
                    errors.note("a prefill put", &e);
                }
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "prefill: target={} keys={} secs={secs:.1} puts_per_s={:.0} errors={}",
        target_name(common.target),
        common.keys,
        common.keys as f64 / secs,
        errors.get()
    );
    if errors.get() > 0 {
        bail!("{} prefill puts failed", errors.get());
    }
    Ok(())
}

/// One task's count over the measured window.
#[derive(Default)]
struct Tally {
    puts: u64,
    gets: u64,
    missing: u64,
    lat_us: Vec<u32>,
}

async fn run(env: &Env, args: &RunArgs) -> Result<()> {
    let common = &args.common;
    let handles = connect(env, common).await?;
    let pids = split_list(&args.cpu_pids);
    for p in &pids {
        cpu_ticks(p)?;
    }
    let (term0, leader0) = describe(&statuses(env, common).await);
    let errors = Arc::new(Errors::new(ERRORS_SHOWN_MAX));
    let start = Instant::now();
    let window_start = start + Duration::from_secs(args.warmup);
    let window_end = window_start + Duration::from_secs(args.duration);
    let mut tasks = Vec::new();
    for i in 0..common.clients.max(1) {
        let mut h = handles[i % handles.len()].clone();
        let errors = errors.clone();
        let (keys, size, put_percent) = (common.keys, common.value_size, args.put_percent);
        tasks.push(tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(0x5eed_0000 + i as u64);
            let v = value(&mut rng, size);
            let mut t = Tally::default();
            loop {
                let invoked = Instant::now();
                if invoked >= window_end {
                    break;
                }
                let k = rng.random_range(0..keys);
                let is_put = rng.random_range(0..100) < put_percent;
                let r = if is_put { h.put(k, &v).await.map(|_| true) } else { h.get(k).await };
                let done = Instant::now();
                match r {
                    Ok(found) => {
                        if done >= window_start && done < window_end {
                            if is_put {
                                t.puts += 1;
                            } else {
                                t.gets += 1;
                                t.missing += u64::from(!found);
                            }
                            t.lat_us
                                .push(done.duration_since(invoked).as_micros().min(u32::MAX as u128) as u32);
                        }
                    }
                    Err(e) => {
                        errors.note(if is_put { "a put" } else { "a get" }, &e);
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            t
        }));
    }
    tokio::time::sleep_until(window_start.into()).await;
    let server0: u64 = pids.iter().map(|p| cpu_ticks(p)).sum::<Result<u64>>()?;
    let self0 = cpu_ticks("self")?;
    let errors0 = errors.get();
    tokio::time::sleep_until(window_end.into()).await;
    let server1: u64 = pids.iter().map(|p| cpu_ticks(p)).sum::<Result<u64>>()?;
    let self1 = cpu_ticks("self")?;
    let errors_in_window = errors.get() - errors0;
    let mut all = Tally::default();
    for t in tasks {
        let t = t.await?;
        all.puts += t.puts;
        all.gets += t.gets;
        all.missing += t.missing;
        all.lat_us.extend(t.lat_us);
    }
    let (term1, leader1) = describe(&statuses(env, common).await);
    all.lat_us.sort_unstable();
    let pct = |p: f64| -> u32 {
        if all.lat_us.is_empty() {
            return 0;
        }
        all.lat_us[((all.lat_us.len() - 1) as f64 * p).round() as usize]
    };
    let ops = all.puts + all.gets;
    let per_op_us = |ticks: u64| ticks as f64 / clk_tck() as f64 * 1e6 / ops.max(1) as f64;
    let target = target_name(common.target);
    println!(
        "target={target} ops={ops} ops_per_s={:.0} puts={} gets={} p50_us={} p99_us={} errors={} \
         missing={} server_cpu_us_per_op={:.1} client_cpu_us_per_op={:.1} term={term0}->{term1} \
         leader={leader0}->{leader1} errors_outside_window={}",
        ops as f64 / args.duration as f64,
        all.puts,
        all.gets,
        pct(0.50),
        pct(0.99),
        errors_in_window,
        all.missing,
        per_op_us(server1 - server0),
        per_op_us(self1 - self0),
        errors.get() - errors_in_window,
    );
    Ok(())
}

async fn status(env: &Env, common: &Common) -> Result<()> {
    let n = addrs(common)?.len();
    let st = statuses(env, common).await;
    for m in &st {
        println!(
            "member={} endpoint={} leader={} term={} applied={}",
            m.id,
            m.index + 1,
            m.leader,
            m.term,
            m.applied
        );
    }
    let leaders = st.iter().filter(|m| m.leader).count();
    let applied: std::collections::BTreeSet<u64> = st.iter().map(|m| m.applied).collect();
    if st.len() != n || leaders != 1 || applied.len() != 1 {
        bail!("not whole: {} of {n} members answer, {leaders} lead, applied indexes {applied:?}", st.len());
    }
    Ok(())
}

fn parse_pids(s: &str) -> Result<BTreeMap<u64, String>> {
    let mut out = BTreeMap::new();
    for part in split_list(s) {
        let (id, pid) = part.split_once('=').ok_or_else(|| anyhow!("--pids: {part:?} is not ID=PID"))?;
        out.insert(id.trim().parse().with_context(|| format!("--pids: {id:?}"))?, pid.trim().to_string());
    }
    Ok(out)
}

/// The earliest completion of a put invoked after the kill, and of any put.
#[derive(Default)]
struct AfterKill {
    first_new_put: Option<Duration>,
    first_any_put: Option<Duration>,
}

/// What `failover`'s tasks share: the kill's time and what completed since.
struct Failover {
    t0: OnceLock<Instant>,
    after: Mutex<AfterKill>,
    errors_before: Errors,
    /// Expected (etcd's clients see the dead member's connections drop):
    /// counted, and only the first one shown.
    errors_after: Errors,
    done: tokio::sync::Notify,
    stop: AtomicBool,
}

impl Failover {
    /// Notes one put's outcome.
    fn finished(&self, invoked: Instant, finished: Instant, r: Result<()>) {
        match (self.t0.get(), r) {
            (None, Ok(())) => {}
            (None, Err(e)) => self.errors_before.note("a put before the kill", &e),
            (Some(&t0), Ok(())) => {
                let since = finished.saturating_duration_since(t0);
                let mut a = self.after.lock().unwrap_or_else(|p| p.into_inner());
                a.first_any_put = Some(a.first_any_put.map_or(since, |d| d.min(since)));
                if invoked > t0 {
                    a.first_new_put = Some(a.first_new_put.map_or(since, |d| d.min(since)));
                    self.done.notify_one();
                }
            }
            (Some(_), Err(e)) => self.errors_after.note("a put after the kill", &e),
        }
    }

    fn new_put_done(&self) -> bool {
        self.after.lock().map(|a| a.first_new_put.is_some()).unwrap_or(false)
    }
}

async fn failover(env: &Env, args: &FailoverArgs) -> Result<()> {
    let common = &args.common;
    let pids = parse_pids(&args.pids)?;
    let handles = connect(env, common).await?;
    let f = Arc::new(Failover {
        t0: OnceLock::new(),
        after: Mutex::new(AfterKill::default()),
        errors_before: Errors::new(ERRORS_SHOWN_MAX),
        errors_after: Errors::new(1),
        done: tokio::sync::Notify::new(),
        stop: AtomicBool::new(false),
    });
    let (keys, size) = (common.keys, common.value_size);
    for i in 0..common.clients.max(1) {
        let mut h = handles[i % handles.len()].clone();
        let f = f.clone();
        tokio::spawn(async move {
            let mut rng = SmallRng::seed_from_u64(0xfa11_0000 + i as u64);
            let v = value(&mut rng, size);
            while !f.stop.load(Ordering::Relaxed) {
                let invoked = Instant::now();
                let r = h.put(rng.random_range(0..keys), &v).await;
                let failed = r.is_err();
                f.finished(invoked, Instant::now(), r);
                if failed {
                    // Try again at once, but do not spin on instant
                    // refusals (etcd's dead endpoint).
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(args.warmup)).await;
    let st = statuses(env, common).await;
    let leaders: Vec<&MemberStatus> = st.iter().filter(|m| m.leader).collect();
    if st.len() != addrs(common)?.len() || leaders.len() != 1 {
        bail!("the group is not whole with one leader before the kill: {st:?}");
    }
    let victim = leaders[0].clone();
    let pid =
        pids.get(&victim.id).ok_or_else(|| anyhow!("--pids names no process for member {}", victim.id))?;
    let status = std::process::Command::new("kill").args(["-9", pid]).status().context("running kill")?;
    let killed_at = Instant::now();
    if !status.success() {
        bail!("kill -9 {pid} failed");
    }
    let _ = f.t0.set(killed_at);
    // The closed loop's tasks may all be stuck in puts sent before the kill
    // (etcd holds a proposal made without a leader until its request
    // timeout, 7 s): probes invoke a fresh put every PROBE_EVERY meanwhile,
    // so the first put a new leader can commit is seen when it can be.
    let mut probes = 0u64;
    let mut tick = tokio::time::interval(PROBE_EVERY);
    let deadline = tokio::time::Instant::from(killed_at + FAILOVER_WAIT_MAX);
    while !f.new_put_done() {
        let notified = f.done.notified();
        tokio::select! {
            _ = tick.tick() => {
                let mut h = handles[probes as usize % handles.len()].clone();
                let f = f.clone();
                let k = probes % keys;
                probes += 1;
                tokio::spawn(async move {
                    let v = Bytes::from(vec![0x5a; size]);
                    let invoked = Instant::now();
                    let r = h.put(k, &v).await;
                    f.finished(invoked, Instant::now(), r);
                });
            }
            _ = notified => {}
            _ = tokio::time::sleep_until(deadline) => {
                bail!("no put invoked after the kill succeeded within {FAILOVER_WAIT_MAX:?}");
            }
        }
    }
    f.stop.store(true, Ordering::Relaxed);
    let a = f.after.lock().unwrap_or_else(|p| p.into_inner());
    let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    println!(
        "target={} failover_ms={:.1} killed={} first_any_put_ms={:.1} term_before={} probes={probes} \
         errors_before={} errors_after={}",
        target_name(common.target),
        ms(a.first_new_put),
        victim.id,
        ms(a.first_any_put),
        victim.term,
        f.errors_before.get(),
        f.errors_after.get(),
    );
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let env = Env::real();
    let r = match &cli.cmd {
        Cmd::Prefill(c) => prefill(&env, c).await,
        Cmd::Run(a) => run(&env, a).await,
        Cmd::Failover(a) => failover(&env, a).await,
        Cmd::Status(c) => status(&env, c).await,
    };
    // Tasks may still wait on a dead member: exit without joining them.
    let code = match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("kvload: {e:#}");
            1
        }
    };
    std::process::exit(code)
}
