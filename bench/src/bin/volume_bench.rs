//! Virtual-disk benchmarks (the Blizzard paper's §4.4 and §4.7), each
//! against an embedded cluster in this process whose tractservers inject a
//! per-request delay standing in for a remote disk's seek and network:
//!
//! - `commit`: closed-loop random writes at a queue depth with a flush every
//!   N writes, IOPS of every commit mode and flush policy side by side;
//! - `loss`: open-loop writes at a target rate; at random instants, how
//!   much acknowledged data a crash would lose (Figures 13–14);
//! - `seqread`: sequential reads of a volume striped with different
//!   segment sizes over disks that serve one request at a time (§2.3).
//!
//! Run by `bench/volume.sh`, which records the results in
//! `docs/benchmarks.md`.

#![allow(clippy::disallowed_methods)] // a benchmark measures real time on real disks

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Parser, Subcommand};
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;

use blizzard_bench::{cpu_seconds, size_arg};
use blizzard_client::Client;
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::{DiskModel, Env};
use blizzard_volume::{manage, CommitMode, FlushPolicy, Volume, VolumeSpec};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Data directory for the embedded cluster's disk files (emptied first).
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value_t = 4)]
    tractservers: usize,
    /// Injected delays per request in milliseconds, one cluster each.
    #[arg(long, value_delimiter = ',', default_value = "1,5")]
    delay_ms: Vec<f64>,
    /// Requests each tractserver serves through the delay at once (0: all).
    #[arg(long, default_value_t = 0)]
    arms: u32,
    /// Transfer rate of each tractserver's injected disk (0: unlimited).
    #[arg(long, default_value = "0", value_parser = size_arg)]
    disk_bandwidth: u64,
    /// Tractservers on unix sockets instead of TCP loopback.
    #[arg(long)]
    unix_sockets: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// IOPS of each commit mode under random writes with periodic flushes.
    Commit {
        #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB", value_parser = size_arg)]
        sizes: Vec<u64>,
        #[arg(long, value_delimiter = ',', default_value = "4,20")]
        flush_every: Vec<u64>,
        #[arg(long, default_value_t = 16)]
        qd: usize,
        #[arg(long, default_value = "256MiB", value_parser = size_arg)]
        volume_size: u64,
        /// Seconds before measuring (fills the fast modes' buffers).
        #[arg(long, default_value_t = 1.0)]
        warmup: f64,
        #[arg(long, default_value_t = 4.0)]
        secs: f64,
        /// Modes to run (write-through, fast-ack, log), each with both flush policies where it matters.
        #[arg(long, value_delimiter = ',', default_value = "write-through,fast-ack,log")]
        modes: Vec<String>,
    },
    /// Acknowledged-but-not-durable data at random instants (what a crash would lose).
    Loss {
        #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB", value_parser = size_arg)]
        sizes: Vec<u64>,
        /// Writes per flush.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        wpf: Vec<u64>,
        /// Offered write rates (writes per second).
        #[arg(long, value_delimiter = ',', default_value = "50,100,200,300,1000,3000")]
        rates: Vec<f64>,
        #[arg(long, default_value = "256MiB", value_parser = size_arg)]
        volume_size: u64,
        #[arg(long, default_value_t = 5.0)]
        secs: f64,
        /// Simulated crash instants per point.
        #[arg(long, default_value_t = 100)]
        samples: usize,
    },
    /// Sequential read throughput by segment size.
    Seqread {
        #[arg(long, value_delimiter = ',', default_value = "1,128")]
        segments: Vec<u32>,
        #[arg(long, default_value = "1GiB", value_parser = size_arg)]
        fill: u64,
        #[arg(long, default_value = "1MiB", value_parser = size_arg)]
        request: u64,
        #[arg(long, default_value_t = 4)]
        qd: usize,
        #[arg(long, default_value = "64KiB", value_parser = size_arg)]
        block_size: u64,
    },
}

fn mode_label(mode: CommitMode, flush: FlushPolicy) -> String {
    match mode {
        CommitMode::WriteThrough => "write-through".into(),
        _ => format!("{}/{}", mode.name(), flush.name()),
    }
}

fn mode_configs(names: &[String]) -> Result<Vec<(CommitMode, FlushPolicy)>> {
    let mut v = Vec::new();
    for n in names {
        let Some(m) = CommitMode::parse(n) else {
            bail!("unknown mode {n:?}: use write-through, fast-ack or log");
        };
        if m == CommitMode::WriteThrough {
            v.push((m, FlushPolicy::Durable));
        } else {
            v.push((m, FlushPolicy::Durable));
            v.push((m, FlushPolicy::Ordered));
        }
    }
    Ok(v)
}

struct Bench {
    cluster: Cluster,
    client: Client,
    env: Env,
    seq: u64,
}

impl Bench {
    async fn start(a: &Args, delay: Duration, dir: PathBuf) -> Result<Bench> {
        let _ = std::fs::remove_dir_all(&dir);
        let mut cfg = ClusterConfig::new(&dir);
        cfg.tractservers = a.tractservers;
        cfg.replication = 1;
        cfg.disk_size = 4 << 30;
        cfg.disk_model = Some(DiskModel::new(delay, a.arms, a.disk_bandwidth));
        cfg.unix_sockets = a.unix_sockets;
        let env = Env::real();
        let cluster = Cluster::start(env.clone(), cfg).await.context("starting the embedded cluster")?;
        // New disk files are zero-filled in the background first; measuring
        // alongside that would charge its writes to the benchmark.
        cluster.wait_disks_prepared(Duration::from_secs(600)).await?;
        let client = cluster.client().await?;
        Ok(Bench { cluster, client, env, seq: 0 })
    }

    async fn volume(&mut self, spec: VolumeSpec) -> Result<(String, Volume)> {
        self.seq += 1;
        let name = format!("bench-{}", self.seq);
        let spec = VolumeSpec { name: name.clone(), ..spec };
        let v = manage::create(self.env.clone(), &self.client, &spec).await.context("creating a volume")?;
        Ok((name, v))
    }

    /// Deletes a finished volume so the disks do not fill up.
    async fn drop_volume(&self, name: &str, v: Arc<Volume>) -> Result<()> {
        // Durable, and its lease given up: the delete takes the lease.
        v.release().await?;
        drop(v);
        manage::delete(self.env.clone(), &self.client, name).await?;
        Ok(())
    }
}

fn payload(len: u64, seed: u64) -> Bytes {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut b = vec![0u8; len as usize];
    rng.fill(&mut b[..]);
    Bytes::from(b)
}

/// Closed loop: up to `qd` writes in flight; after every `flush_every`
/// writes, wait for those in flight to be acknowledged and flush (as an
/// application calling fsync does). Returns (IOPS, CPU µs per write).
async fn commit_run(
    v: Arc<Volume>,
    size: u64,
    flush_every: u64,
    qd: usize,
    warmup: Duration,
    secs: Duration,
) -> Result<(f64, f64)> {
    let blocks = v.size() / size;
    let data = payload(size, 7);
    let sem = Arc::new(Semaphore::new(qd));
    let done = Arc::new(AtomicU64::new(0));
    let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
    let start = Instant::now();
    let measure_at = start + warmup;
    let end = measure_at + secs;
    let (mut done_at_measure, mut cpu_at_measure) = (None, 0.0);
    let mut issued = 0u64;
    while Instant::now() < end {
        if done_at_measure.is_none() && Instant::now() >= measure_at {
            done_at_measure = Some(done.load(Ordering::Relaxed));
            cpu_at_measure = cpu_seconds();
        }
        let permit = sem.clone().acquire_owned().await?;
        let off = rng.random_range(0..blocks) * size;
        let (v2, d2, data) = (v.clone(), done.clone(), data.clone());
        tokio::spawn(async move {
            if let Err(e) = v2.write(off, data, false).await {
                eprintln!("write failed: {e}");
            }
            d2.fetch_add(1, Ordering::Relaxed);
            drop(permit);
        });
        issued += 1;
        if issued.is_multiple_of(flush_every) {
            let all = sem.acquire_many(qd as u32).await?;
            v.flush().await?;
            drop(all);
        }
    }
    let n = done.load(Ordering::Relaxed) - done_at_measure.unwrap_or(0);
    let cpu = cpu_seconds() - cpu_at_measure;
    let _ = sem.acquire_many(qd as u32).await?;
    v.flush_durable().await?;
    Ok((n as f64 / secs.as_secs_f64(), cpu * 1e6 / n.max(1) as f64))
}

/// Open loop at `rate` writes per second with a flush after every `wpf`
/// writes; `samples` random instants record what is acknowledged but not
/// durable. Returns (achieved writes/s, mean writes lost, mean KiB lost).
async fn loss_run(
    v: Arc<Volume>,
    size: u64,
    wpf: u64,
    rate: f64,
    secs: Duration,
    samples: usize,
) -> Result<(f64, f64, f64)> {
    let blocks = v.size() / size;
    let data = payload(size, 9);
    let start = Instant::now();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(2);
    let mut instants: Vec<Duration> =
        (0..samples).map(|_| secs.mul_f64(rng.random_range(0.2..1.0))).collect();
    instants.sort();
    let sampler = {
        let v = v.clone();
        tokio::spawn(async move {
            let mut got = Vec::new();
            for at in instants {
                tokio::time::sleep_until((start + at).into()).await;
                got.push(v.outstanding());
            }
            got
        })
    };
    let mut issued = 0u64;
    while start.elapsed() < secs {
        let due = start + Duration::from_secs_f64(issued as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        let off = rng.random_range(0..blocks) * size;
        // Acknowledged at once unless the volume throttles the writer at
        // its exposure limit; a throttled writer falls behind the offered rate.
        v.write(off, data.clone(), false).await?;
        issued += 1;
        if issued.is_multiple_of(wpf) {
            v.flush().await?;
        }
    }
    let achieved = issued as f64 / start.elapsed().as_secs_f64();
    let got = sampler.await?;
    v.flush_durable().await?;
    let n = got.len().max(1) as f64;
    let writes = got.iter().map(|g| g.0 as f64).sum::<f64>() / n;
    let kib = got.iter().map(|g| g.1 as f64).sum::<f64>() / n / 1024.0;
    Ok((achieved, writes, kib))
}

/// Fills `fill` bytes sequentially, then reads them back sequentially
/// with `qd` requests in flight. Returns read MB/s.
async fn seqread_run(v: Arc<Volume>, fill: u64, request: u64, qd: usize) -> Result<f64> {
    let data = payload(request, 11);
    let n = fill / request;
    let sem = Arc::new(Semaphore::new(qd * 4));
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let (v2, data) = (v.clone(), data.clone());
        tokio::spawn(async move {
            if let Err(e) = v2.write(i * request, data, false).await {
                eprintln!("fill write failed: {e}");
            }
            drop(permit);
        });
    }
    let _ = sem.acquire_many((qd * 4) as u32).await?;
    let sem = Arc::new(Semaphore::new(qd));
    let bad = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await?;
        let (v2, data, bad) = (v.clone(), data.clone(), bad.clone());
        tokio::spawn(async move {
            match v2.read(i * request, request).await {
                Ok(b) if b == data => {}
                _ => {
                    bad.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(permit);
        });
    }
    let _ = sem.acquire_many(qd as u32).await?;
    let secs = start.elapsed().as_secs_f64();
    if bad.load(Ordering::Relaxed) > 0 {
        bail!("{} reads returned the wrong data", bad.load(Ordering::Relaxed));
    }
    Ok(fill as f64 / secs / 1e6)
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter("warn").with_writer(std::io::stderr).init();
    let a = Args::parse();
    for (di, &delay_ms) in a.delay_ms.iter().enumerate() {
        let delay = Duration::from_secs_f64(delay_ms / 1e3);
        let mut b = Bench::start(&a, delay, a.data.join(format!("delay-{di}"))).await?;
        match &a.cmd {
            Cmd::Commit { sizes, flush_every, qd, volume_size, warmup, secs, modes } => {
                println!("# commit: delay {delay_ms} ms, {} tractservers, QD {qd}", a.tractservers);
                println!("| delay | write | flush every | mode/policy | IOPS | CPU µs/write |");
                println!("|---|---|---|---|---|---|");
                for &size in sizes {
                    for &fe in flush_every {
                        for &(mode, flush) in &mode_configs(modes)? {
                            let mut spec = VolumeSpec::new("", *volume_size);
                            spec.mode = mode;
                            spec.flush = flush;
                            spec.block_size = Some(size as u32);
                            let (name, v) = b.volume(spec).await?;
                            let v = Arc::new(v);
                            let (iops, cpu) = commit_run(
                                v.clone(),
                                size,
                                fe,
                                *qd,
                                Duration::from_secs_f64(*warmup),
                                Duration::from_secs_f64(*secs),
                            )
                            .await?;
                            println!(
                                "| {delay_ms} ms | {} KiB | {fe} | {} | {iops:.0} | {cpu:.1} |",
                                size >> 10,
                                mode_label(mode, flush)
                            );
                            b.drop_volume(&name, v).await?;
                        }
                    }
                }
            }
            Cmd::Loss { sizes, wpf, rates, volume_size, secs, samples } => {
                println!("# loss: delay {delay_ms} ms, {} tractservers, ordered flushes", a.tractservers);
                println!("| delay | write | wpf | mode | offered/s | achieved/s | writes lost | KiB lost |");
                println!("|---|---|---|---|---|---|---|---|");
                for &size in sizes {
                    for &w in wpf {
                        for mode in [CommitMode::FastAck, CommitMode::Log] {
                            for &rate in rates {
                                let mut spec = VolumeSpec::new("", *volume_size);
                                spec.mode = mode;
                                spec.flush = FlushPolicy::Ordered;
                                spec.block_size = Some(size as u32);
                                let (name, v) = b.volume(spec).await?;
                                let v = Arc::new(v);
                                let (achieved, writes, kib) = loss_run(
                                    v.clone(),
                                    size,
                                    w,
                                    rate,
                                    Duration::from_secs_f64(*secs),
                                    *samples,
                                )
                                .await?;
                                println!(
                                    "| {delay_ms} ms | {} KiB | {w} | {} | {rate:.0} | {achieved:.0} | {writes:.1} | {kib:.1} |",
                                    size >> 10,
                                    mode.name()
                                );
                                b.drop_volume(&name, v).await?;
                            }
                        }
                    }
                }
            }
            Cmd::Seqread { segments, fill, request, qd, block_size } => {
                println!(
                    "# seqread: delay {delay_ms} ms, {} arms, {} MiB/s per disk, {} tractservers, {} KiB requests at QD {qd}",
                    a.arms,
                    a.disk_bandwidth >> 20,
                    a.tractservers,
                    request >> 10
                );
                println!("| delay | segment tracts | read MB/s |");
                println!("|---|---|---|");
                for &seg in segments {
                    let mut spec = VolumeSpec::new("", *fill);
                    spec.segment_tracts = seg;
                    spec.block_size = Some(*block_size as u32);
                    let (name, v) = b.volume(spec).await?;
                    let v = Arc::new(v);
                    let mbs = seqread_run(v.clone(), *fill, *request, *qd).await?;
                    println!("| {delay_ms} ms | {seg} | {mbs:.0} |");
                    b.drop_volume(&name, v).await?;
                }
            }
        }
        b.cluster.stop().await;
        let _ = std::fs::remove_dir_all(a.data.join(format!("delay-{di}")));
    }
    Ok(())
}
