//! Recovery speed (FDS §3.2, §5.3): fill a 3-way cluster of N tractservers,
//! stop one, and time until every row is fully replicated again, for
//! several N. Prints a markdown table (and, with `--detail`, where the time
//! went per surviving tractserver).
//!
//! Every tractserver runs in this process on files of one physical disk, so
//! each is given a modelled disk of `--cap-mbps` (`blizzard_env::DiskModel`:
//! every disk read and write, so both ends of every copy, books its bytes
//! on that server's own transfer timeline) standing in for
//! a disk of its own. The data is written uncapped, the caps are set, and
//! only then is the victim stopped. `--cap-mbps 0` runs uncapped: what this
//! machine can do, which must be well above N × cap for the capped figures
//! to measure the recovery algorithm rather than the machine.
//!
//! Run by `bench/recovery.sh`.

#![allow(clippy::disallowed_methods)] // a benchmark measures real time on real disks

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;

use blizzard_bench::{cpu_seconds, size_arg};
use blizzard_client::{Blob, Client};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::tlt::locator;
use blizzard_core::TsId;
use blizzard_env::{DiskModel, Env};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TRACT: u64 = 8 << 20;
const REPLICATION: u8 = 3;

/// Watches how late a 10 ms timer fires, on the runtime and on a plain
/// thread: a late runtime timer means the tractservers' own timers
/// (heartbeats, the injected disks) were late too, i.e. the machine, not
/// the recovery algorithm, set the pace. `take` returns and resets the
/// worst lateness seen by each since the last call, in milliseconds.
#[derive(Clone, Default)]
struct Lateness {
    runtime_us: Arc<AtomicU64>,
    thread_us: Arc<AtomicU64>,
}

impl Lateness {
    fn start() -> Lateness {
        let l = Lateness::default();
        let tick = Duration::from_millis(10);
        let r = l.runtime_us.clone();
        tokio::spawn(async move {
            loop {
                let t = Instant::now();
                tokio::time::sleep(tick).await;
                r.fetch_max(t.elapsed().saturating_sub(tick).as_micros() as u64, Ordering::Relaxed);
            }
        });
        let th = l.thread_us.clone();
        std::thread::spawn(move || loop {
            let t = Instant::now();
            std::thread::sleep(tick);
            th.fetch_max(t.elapsed().saturating_sub(tick).as_micros() as u64, Ordering::Relaxed);
        });
        l
    }

    fn take(&self) -> (f64, f64) {
        (
            self.runtime_us.swap(0, Ordering::Relaxed) as f64 / 1e3,
            self.thread_us.swap(0, Ordering::Relaxed) as f64 / 1e3,
        )
    }
}

#[derive(Parser)]
struct Args {
    /// Directory for the clusters' disk files (a subdirectory per cluster,
    /// removed when it is done).
    #[arg(long)]
    dir: PathBuf,
    /// Cluster sizes, one cluster each.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16")]
    tractservers: Vec<usize>,
    /// Logical bytes of 3-way blobs written before the kill (the same total
    /// for every cluster size, so a larger cluster loses less per server).
    #[arg(long, default_value = "2GiB", value_parser = size_arg)]
    data: u64,
    /// Tract writes in flight while filling. Kept low: at 64 the runtime
    /// here stalled for seconds at a time and the metadata server declared
    /// live tractservers dead in the middle of the fill.
    #[arg(long, default_value_t = 16)]
    fill_inflight: usize,
    /// Bytes per blob (a blob's tracts walk the TLT row by row).
    #[arg(long, default_value = "256MiB", value_parser = size_arg)]
    blob_size: u64,
    /// Each tractserver's injected disk bandwidth during recovery, in MB/s
    /// (10^6 bytes); 0 leaves the disks uncapped.
    #[arg(long, default_value_t = 30.0)]
    cap_mbps: f64,
    #[arg(long, default_value_t = 100)]
    heartbeat_ms: u64,
    /// How often the cluster status is polled while recovering.
    #[arg(long, default_value_t = 50)]
    poll_ms: u64,
    /// Index of the tractserver to stop.
    #[arg(long, default_value_t = 0)]
    victim: usize,
    /// Read every replica of every tract afterwards and check its contents.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    verify: bool,
    /// Per surviving tractserver: rows, bytes read and written, finish time.
    #[arg(long)]
    detail: bool,
    /// Give up on a recovery after this many seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_s: u64,
}

/// One tract's contents: a fill pattern stamped with the blob and tract, so
/// a copy that landed in the wrong place is caught by `--verify`.
fn tract_payload(base: &Bytes, blob: usize, tract: u64) -> Bytes {
    let mut v = base.to_vec();
    v[..8].copy_from_slice(&(blob as u64).to_le_bytes());
    v[8..16].copy_from_slice(&tract.to_le_bytes());
    Bytes::from(v)
}

struct Survivor {
    id: TsId,
    index: usize,
    /// Bytes this server will read as a copy source and write as newcomer,
    /// from the rows' membership before and after and the victim's tracts.
    read: u64,
    written: u64,
    rows_new: usize,
    /// `fill.bytes_done` before the stop and after recovery.
    done_before: u64,
    done_after: u64,
    /// Seconds after the victim was declared dead of this server's first
    /// and last copy progress seen.
    first_progress: Option<f64>,
    last_progress: Option<f64>,
}

struct Outcome {
    n: usize,
    lost: u64,
    copied: u64,
    detect_s: f64,
    copy_s: f64,
    cpu_frac: f64,
    /// Worst lateness of a 10 ms runtime timer from the kill to the end.
    late_ms: f64,
    /// Time the busiest survivor's disk needs for its share of the copy
    /// traffic at the cap: no schedule can finish sooner.
    bound_s: f64,
    survivors: Vec<Survivor>,
    /// (seconds since detection, bytes copied so far), per poll.
    timeline: Vec<(f64, u64)>,
    /// The victim's rows: (row, members before as server indexes, the
    /// victim's column, bytes lost, newcomer index, source index).
    rows: Vec<(u32, Vec<usize>, usize, u64, usize, usize)>,
}

async fn fill(client: &Client, a: &Args) -> Result<Vec<Blob>> {
    let tracts = a.data.div_ceil(TRACT);
    let per_blob = (a.blob_size / TRACT).max(1);
    let mut blobs = Vec::new();
    let mut left = tracts;
    while left > 0 {
        let n = left.min(per_blob);
        let b = client.create_blob(None, REPLICATION).await?;
        b.extend_to(n).await?;
        blobs.push(b);
        left -= n;
    }
    let work: Arc<Vec<(usize, u64)>> = Arc::new(
        blobs.iter().enumerate().flat_map(|(i, b)| (0..b.size_tracts()).map(move |t| (i, t))).collect(),
    );
    let base = Bytes::from((0..TRACT).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let next = Arc::new(AtomicU64::new(0));
    let blobs = Arc::new(blobs);
    let mut workers = Vec::new();
    for _ in 0..a.fill_inflight.max(1) {
        let (work, next, blobs, base) = (work.clone(), next.clone(), blobs.clone(), base.clone());
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&(b, t)) = work.get(i) else { return Ok::<_, anyhow::Error>(()) };
                blobs[b].write_tract(t, tract_payload(&base, b, t)).await?;
            }
        }));
    }
    for w in workers {
        w.await??;
    }
    Ok(Arc::try_unwrap(blobs).unwrap_or_else(|b| (*b).clone()))
}

async fn verify(blobs: &[Blob]) -> Result<()> {
    let base = Bytes::from((0..TRACT).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    for (i, b) in blobs.iter().enumerate() {
        for t in 0..b.size_tracts() {
            let want = tract_payload(&base, i, t);
            let got = b.read_replicas(t, 0, TRACT as u32).await?;
            if got.len() != REPLICATION as usize {
                bail!("blob {} tract {t}: {} replicas, expected {REPLICATION}", b.id(), got.len());
            }
            if let Some(j) = got.iter().position(|g| *g != want) {
                bail!("blob {} tract {t}: replica {j} differs from what was written", b.id());
            }
        }
    }
    Ok(())
}

/// Row → members, from the assignments the given tractservers hold (the
/// highest version of each row wins).
fn rows_of(cluster: &Cluster, servers: &[usize]) -> BTreeMap<u32, Vec<TsId>> {
    let mut rows: BTreeMap<u32, (u64, Vec<TsId>)> = BTreeMap::new();
    for &i in servers {
        let Some(h) = cluster.tractserver(i) else { continue };
        for r in h.service.row_index().assignment.rows {
            let e = rows.entry(r.row).or_insert((0, Vec::new()));
            if r.version >= e.0 {
                *e = (r.version, r.members);
            }
        }
    }
    rows.into_iter().map(|(r, (_, m))| (r, m)).collect()
}

/// Bytes the tractserver holds per TLT row (present chunks of every tract).
async fn bytes_per_row(cluster: &Cluster, i: usize) -> Result<HashMap<u32, u64>> {
    let h = cluster.tractserver(i).context("victim is not running")?;
    let len = h.service.row_index().assignment.tlt_len as usize;
    if len == 0 {
        bail!("victim has no TLT assignment");
    }
    let store = &h.service.store;
    let mut out: HashMap<u32, u64> = HashMap::new();
    for (blob, tract) in store.tracts() {
        let Some(inc) = store.incarnation_of(blob, tract).await else { continue };
        let chunks: u32 = store.mapped(blob, inc, tract).await.iter().map(|b| b.count_ones()).sum();
        *out.entry(locator(blob, tract, len) as u32).or_default() += chunks as u64 * CHUNK_SIZE as u64;
    }
    Ok(out)
}

async fn run(a: &Args, n: usize, dir: &Path, late: &Lateness) -> Result<Option<Outcome>> {
    if a.victim >= n {
        bail!("--victim {} is not one of {n} tractservers", a.victim);
    }
    let _ = std::fs::remove_dir_all(dir);
    let tracts = a.data.div_ceil(TRACT);
    // Room for a survivor's share after recovery, with slack for uneven
    // placement (rows hold different numbers of tracts), but never more
    // than a replica of every tract (and every blob's metadata tract).
    let per_ts = tracts * REPLICATION as u64 / (n as u64 - 1);
    let per_ts_max = tracts + tracts.div_ceil((a.blob_size / TRACT).max(1)) + 8;
    let mut cfg = ClusterConfig::new(dir);
    cfg.tractservers = n;
    cfg.replication = REPLICATION;
    cfg.tract_size = TRACT as u32;
    cfg.disk_size = (per_ts * 3 / 2 + 16).min(per_ts_max) * TRACT + (64 << 20);
    cfg.heartbeat_interval = Duration::from_millis(a.heartbeat_ms);
    cfg.unix_sockets = true;
    // Uncapped while the data is written; capped before the victim stops.
    let model = DiskModel::new(Duration::ZERO, 0, 0);
    cfg.disk_model = Some(model.clone());
    let env = Env::real();
    let mut cluster = Cluster::start(env, cfg).await.context("starting the cluster")?;
    // New disk files are zero-filled in the background first; measuring
    // alongside that would charge its writes to the benchmark.
    cluster.wait_disks_prepared(Duration::from_secs(600)).await?;
    let client = cluster.client().await?;
    let tlt_version = client.cluster_status().await?.tlt_version;
    let t = Instant::now();
    late.take();
    let filled = fill(&client, a).await;
    let (rt, th) = late.take();
    let blobs = match filled {
        Ok(b) => b,
        // See below: the same false deaths can make writes fail outright
        // (a fenced server refuses them until it is given its rows back).
        Err(e) => {
            eprintln!("n={n}: the fill failed ({e:#}); timers were up to {rt:.0} ms late; starting this cluster again");
            drop(client);
            cluster.stop().await;
            let _ = std::fs::remove_dir_all(dir);
            return Ok(None);
        }
    };
    eprintln!(
        "n={n}: wrote {} MiB of 3-way blobs in {:.1}s (uncapped; a 10 ms timer fired up to {rt:.0} ms late on the runtime, {th:.0} ms on a thread)",
        (tracts * TRACT) >> 20,
        t.elapsed().as_secs_f64()
    );
    // A tractserver whose heartbeats were held up past `dead_after` while
    // the machine was saturated by the fill is declared dead and its rows
    // move: the table would no longer be the one built for N servers, and
    // the run would measure a different layout. Start again instead.
    let s = client.cluster_status().await?;
    let dead = s.members.iter().filter(|m| m.dead).count();
    if s.tlt_version != tlt_version || dead > 0 || !s.fully_replicated() {
        eprintln!(
            "n={n}: the TLT changed during the fill (version {tlt_version} -> {}, {dead} dead, fully replicated: {}): \
             a heartbeat was late; starting this cluster again",
            s.tlt_version,
            s.fully_replicated()
        );
        drop(blobs);
        drop(client);
        cluster.stop().await;
        let _ = std::fs::remove_dir_all(dir);
        return Ok(None);
    }

    let cap = (a.cap_mbps * 1e6) as u64;
    model.set_bandwidth(cap);
    let victim_id = cluster.tractserver(a.victim).context("victim is not running")?.id;
    let lost_per_row = bytes_per_row(&cluster, a.victim).await?;
    let lost: u64 = lost_per_row.values().sum();
    let survivors_idx: Vec<usize> = (0..n).filter(|i| *i != a.victim).collect();
    let rows_before = rows_of(&cluster, &[a.victim]);

    let status = client.cluster_status().await?;
    let done_of = |s: &blizzard_proto::ClusterStatus, id: TsId| {
        s.members.iter().find(|m| m.id == id).map(|m| m.fill.bytes_done).unwrap_or(0)
    };
    let mut survivors: Vec<Survivor> = survivors_idx
        .iter()
        .filter_map(|&i| cluster.tractserver(i).map(|h| (i, h.id)))
        .map(|(index, id)| Survivor {
            id,
            index,
            read: 0,
            written: 0,
            rows_new: 0,
            done_before: done_of(&status, id),
            done_after: 0,
            first_progress: None,
            last_progress: None,
        })
        .collect();

    let cpu0 = cpu_seconds();
    late.take();
    let t0 = Instant::now();
    cluster.stop_tractserver(a.victim).await;
    let poll = Duration::from_millis(a.poll_ms);
    let deadline = t0 + Duration::from_secs(a.timeout_s);
    let mut detected: Option<Instant> = None;
    let mut cpu_detect = cpu0;
    let mut timeline = Vec::new();
    let mut last_done: HashMap<TsId, u64> = survivors.iter().map(|s| (s.id, s.done_before)).collect();
    let (done_at, cpu1) = loop {
        if Instant::now() > deadline {
            bail!("recovery did not finish within {}s", a.timeout_s);
        }
        // A status call can fail while the metadata server is busy
        // reassigning rows; the next poll tries again.
        if let Ok(s) = client.cluster_status().await {
            let now = Instant::now();
            let victim_dead = s.members.iter().any(|m| m.id == victim_id && m.dead);
            if victim_dead && detected.is_none() {
                detected = Some(now);
                cpu_detect = cpu_seconds();
            }
            if let Some(d) = detected {
                let since = now.duration_since(d).as_secs_f64();
                let mut copied = 0;
                for sv in survivors.iter_mut() {
                    let done = done_of(&s, sv.id);
                    copied += done.saturating_sub(sv.done_before);
                    if done != last_done[&sv.id] {
                        sv.first_progress.get_or_insert(since);
                        sv.last_progress = Some(since);
                        last_done.insert(sv.id, done);
                    }
                }
                timeline.push((since, copied));
                if s.fully_replicated() {
                    for sv in survivors.iter_mut() {
                        sv.done_after = done_of(&s, sv.id);
                    }
                    break (now, cpu_seconds());
                }
            }
        }
        tokio::time::sleep(poll).await;
    };
    let detected = detected.context("recovery finished without the victim declared dead")?;
    let (late_ms, _) = late.take();

    // Who copied what: each row the victim was in got a newcomer in the
    // victim's place, which copied the row from its first other member.
    let rows_after = rows_of(&cluster, &survivors_idx);
    let index_of: HashMap<TsId, usize> = (0..n)
        .filter_map(|i| cluster.tractserver(i).map(|h| (h.id, i)))
        .chain([(victim_id, a.victim)])
        .collect();
    let ix = |id: &TsId| index_of.get(id).copied().unwrap_or(usize::MAX);
    let mut load: HashMap<TsId, (u64, u64, usize)> = HashMap::new();
    let mut rows = Vec::new();
    for (row, before) in &rows_before {
        let Some(after) = rows_after.get(row) else { continue };
        let Some(newcomer) = after.iter().find(|m| !before.contains(m)) else { continue };
        let bytes = lost_per_row.get(row).copied().unwrap_or(0);
        let e = load.entry(*newcomer).or_default();
        e.1 += bytes;
        e.2 += 1;
        let src = after.iter().find(|m| *m != newcomer);
        if let Some(src) = src {
            load.entry(*src).or_default().0 += bytes;
        }
        let col = before.iter().position(|m| *m == victim_id).unwrap_or(usize::MAX);
        rows.push((
            *row,
            before.iter().map(ix).collect(),
            col,
            bytes,
            ix(newcomer),
            src.map_or(usize::MAX, ix),
        ));
    }
    for sv in survivors.iter_mut() {
        let (r, w, rows) = load.get(&sv.id).copied().unwrap_or_default();
        (sv.read, sv.written, sv.rows_new) = (r, w, rows);
    }
    let busiest = survivors.iter().map(|s| s.read + s.written).max().unwrap_or(0);
    let bound_s = if cap == 0 { 0.0 } else { busiest as f64 / cap as f64 };

    let copied: u64 = survivors.iter().map(|s| s.done_after - s.done_before).sum();
    let copy_s = done_at.duration_since(detected).as_secs_f64();
    let cpu_frac =
        (cpu1 - cpu_detect) / copy_s.max(1e-9) / std::thread::available_parallelism()?.get() as f64;
    let out = Outcome {
        n,
        lost,
        copied,
        detect_s: detected.duration_since(t0).as_secs_f64(),
        copy_s,
        cpu_frac,
        late_ms,
        bound_s,
        survivors,
        timeline,
        rows,
    };

    if a.verify {
        model.set_bandwidth(0);
        let t = Instant::now();
        verify(&blobs).await.context("verifying replicas after recovery")?;
        eprintln!(
            "n={n}: every replica of all {tracts} tracts verified in {:.1}s",
            t.elapsed().as_secs_f64()
        );
    }
    drop(blobs);
    drop(client);
    cluster.stop().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(Some(out))
}

fn mb(bytes: f64) -> f64 {
    bytes / 1e6
}

fn print_detail(o: &Outcome, cap: f64) {
    println!(
        "### {} tractservers: per survivor (cap {:.0} MB/s, busiest disk bound {:.2}s, copy took {:.2}s)",
        o.n,
        mb(cap),
        o.bound_s,
        o.copy_s
    );
    println!();
    println!("| ts | rows filled | MB read as source | MB written as newcomer | disk busy at cap s | MB copied (reported) | first / last progress s |");
    println!("|---|---|---|---|---|---|---|");
    for s in &o.survivors {
        let busy = if cap > 0.0 { (s.read + s.written) as f64 / cap } else { 0.0 };
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.2} | {:.0} | {} / {} |",
            s.index,
            s.rows_new,
            mb(s.read as f64),
            mb(s.written as f64),
            busy,
            mb((s.done_after - s.done_before) as f64),
            f(s.first_progress),
            f(s.last_progress)
        );
    }
    println!();
    // Aggregate copy rate per second of the copy phase: shows a slow start
    // or a long tail.
    let mut line = String::from("copy MB/s per second since detection:");
    let mut prev = (0.0, 0u64);
    let mut next = 1.0;
    for &(t, b) in &o.timeline {
        if t >= next {
            line.push_str(&format!(" {:.0}", mb((b - prev.1) as f64) / (t - prev.0)));
            prev = (t, b);
            next = t.floor() + 1.0;
        }
    }
    if let Some(&(t, b)) = o.timeline.last() {
        if t > prev.0 {
            line.push_str(&format!(
                " {:.0}(last {:.2}s)",
                mb((b - prev.1) as f64) / (t - prev.0),
                t - prev.0
            ));
        }
    }
    println!("{line}");
    println!();
    let total: u64 = o.survivors.iter().map(|s| s.read + s.written).sum();
    if cap > 0.0 {
        println!(
            "balanced bound (all copy traffic spread evenly over the survivors): {:.2}s",
            total as f64 / cap / o.survivors.len() as f64
        );
        println!();
    }
    println!("| row | members before | victim's column | MB lost | newcomer | source |");
    println!("|---|---|---|---|---|---|");
    for (row, members, col, bytes, newcomer, src) in &o.rows {
        println!("| {row} | {members:?} | {col} | {:.0} | {newcomer} | {src} |", mb(*bytes as f64));
    }
    println!();
}

#[tokio::main]
async fn main() -> Result<()> {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let a = Args::parse();
    if a.tractservers.iter().any(|n| *n < REPLICATION as usize + 1) {
        bail!("each cluster needs at least {} tractservers (one more than the replication)", REPLICATION + 1);
    }
    let cap = a.cap_mbps * 1e6;
    let late = Lateness::start();
    let mut outcomes = Vec::new();
    for &n in &a.tractservers {
        let mut tries = 0;
        let o = loop {
            tries += 1;
            match run(&a, n, &a.dir.join(format!("n{n}")), &late).await.with_context(|| format!("{n} tractservers"))? {
                Some(o) => break o,
                None if tries < 3 => continue,
                None => bail!("{n} tractservers: disturbed by false deaths during the fill three times; try a lower --fill-inflight"),
            }
        };
        if a.detail {
            print_detail(&o, cap);
        }
        outcomes.push(o);
    }

    let capped = cap > 0.0;
    println!(
        "| tractservers | lost with the victim MiB | copied MiB | detection s | copy s | recovery s | copy MB/s (all) | copy MB/s per survivor | {} | disk traffic MB/s per survivor | {} | busiest-disk bound s | CPU (of {} cores) | timer late ms (max) |",
        if capped { "copy / cap" } else { "-" },
        if capped { "traffic / cap (target ≥ 50%)" } else { "-" },
        std::thread::available_parallelism()?.get(),
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for o in &outcomes {
        let survivors = (o.n - 1) as f64;
        let agg = o.copied as f64 / o.copy_s;
        let per = agg / survivors;
        let pct = |x: f64| if capped { format!("{:.0}%", 100.0 * x / cap) } else { "-".into() };
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.0} | {:.1} | {} | {:.1} | {} | {:.2} | {:.0}% | {:.0} |",
            o.n,
            o.lost >> 20,
            o.copied >> 20,
            o.detect_s,
            o.copy_s,
            o.detect_s + o.copy_s,
            mb(agg),
            mb(per),
            pct(per),
            mb(2.0 * per),
            pct(2.0 * per),
            o.bound_s,
            100.0 * o.cpu_frac,
            o.late_ms,
        );
    }
    Ok(())
}
