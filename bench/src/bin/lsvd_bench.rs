//! LSVD volumes on S3 (the LSVD paper's §4.5): what the object store is
//! asked for per client write, in one run.
//!
//! 1. An S3 volume is filled over `--util` of its size (1 MiB sequential
//!    writes), then written with 16 KiB random writes at queue depth
//!    `--qd` over that range until it has been overwritten `--overwrites`
//!    times. Over that phase, and its drain into objects: every request the
//!    back end sent (PUT, GET, DELETE, LIST) per client write, and the write
//!    amplification (bytes put / bytes the client wrote), the cleaner's
//!    rewrites and the map checkpoints included.
//! 2. 4 KiB random writes at the same depth for `--secs`.
//! 3. The same two loads for `--secs` each on a write-through volume in the
//!    blob store (an embedded cluster of `--replication` tractservers in
//!    this process, replication `--replication`), for the IOPS comparison.
//!
//! The S3 server is SeaweedFS started here (`weed`, as the tests start it),
//! or `--s3 URL` (credentials from the AWS environment variables). The CPU
//! column is this process's CPU time per write (the S3 server's is not
//! counted). Run by `bench/lsvd.sh`; its last line is the summary.

#![allow(clippy::disallowed_methods)] // a benchmark measures real time on real disks

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use rand::{Rng, SeedableRng};
use tokio::sync::Semaphore;

use blizzard_bench::{cpu_seconds, size_arg};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_lsvd::store::CountsNow;
use blizzard_lsvd::{volume as lsvd, Config, LsvdVolume, Store};
use blizzard_testkit::weed::{Weed, KEY_ID, SECRET};
use blizzard_volume::{manage, CommitMode, FlushPolicy, VolumeSpec};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Directory for the S3 volume's cache and the cluster's disk files.
    #[arg(long)]
    data: PathBuf,
    /// Size of each volume.
    #[arg(long, default_value = "1GiB", value_parser = size_arg)]
    size: u64,
    /// Share of the S3 volume the 16 KiB writes cover (the paper: 80 %).
    #[arg(long, default_value_t = 0.8)]
    util: f64,
    /// Times the 16 KiB writes overwrite that range.
    #[arg(long, default_value_t = 3)]
    overwrites: u64,
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// Target size of the S3 volume's objects.
    #[arg(long, default_value = "8MiB", value_parser = size_arg)]
    object_size: u64,
    /// The S3 volume's cache (journal) size.
    #[arg(long, default_value = "256MiB", value_parser = size_arg)]
    cache_size: u64,
    /// Seconds of each time-bounded run (4 KiB on S3, both blob-store runs).
    #[arg(long, default_value_t = 20)]
    secs: u64,
    /// Replication of the blob-store volume (and its tractservers).
    #[arg(long, default_value_t = 3)]
    replication: u8,
    /// An S3 URL (`http://host:port/bucket/prefix`) instead of a SeaweedFS
    /// started here; the prefix must be free, and is emptied at the end.
    #[arg(long)]
    s3: Option<String>,
    /// The cleaner's threshold: clean once live data is below this share
    /// of the bytes stored in objects (the paper's 70 %).
    #[arg(long, default_value_t = 0.7)]
    gc_live_ratio: f64,
    /// Only the S3 volume (no blob-store comparison).
    #[arg(long)]
    s3_only: bool,
}

/// How long a closed loop runs.
#[derive(Clone, Copy)]
enum Until {
    Writes(u64),
    Time(Duration),
}

/// What a closed loop did.
struct Run {
    writes: u64,
    secs: f64,
    cpu_us: f64,
}

impl Run {
    fn iops(&self) -> f64 {
        self.writes as f64 / self.secs
    }
}

/// Closed loop: `len`-byte writes at random `len`-aligned offsets below
/// `range`, `qd` in flight, until `until`. Any failed write fails the run.
async fn random_writes<F, Fut>(write: F, range: u64, len: u64, qd: usize, until: Until) -> Result<Run>
where
    F: Fn(u64, Bytes) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let blocks = range / len;
    if blocks == 0 {
        bail!("a range of {range} bytes holds no {len}-byte block");
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(len);
    let mut buf = vec![0u8; len as usize];
    rng.fill(&mut buf[..]);
    let data = Bytes::from(buf);
    let sem = Arc::new(Semaphore::new(qd));
    let failed = Arc::new(AtomicU64::new(0));
    let (start, cpu0) = (Instant::now(), cpu_seconds());
    let mut issued = 0u64;
    loop {
        let more = match until {
            Until::Writes(n) => issued < n,
            Until::Time(d) => start.elapsed() < d,
        };
        if !more || failed.load(Ordering::Relaxed) > 0 {
            break;
        }
        let permit = sem.clone().acquire_owned().await?;
        let off = rng.random_range(0..blocks) * len;
        let (w, f, d) = (write.clone(), failed.clone(), data.clone());
        tokio::spawn(async move {
            if let Err(e) = w(off, d).await {
                if f.fetch_add(1, Ordering::Relaxed) == 0 {
                    eprintln!("write at {off} failed: {e:#}");
                }
            }
            drop(permit);
        });
        issued += 1;
    }
    let _all = sem.acquire_many(qd as u32).await?;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    if failed.load(Ordering::Relaxed) > 0 {
        bail!("{} writes failed", failed.load(Ordering::Relaxed));
    }
    Ok(Run { writes: issued, secs, cpu_us: cpu * 1e6 / issued.max(1) as f64 })
}

/// Requests and bytes put between two readings of the store's counters.
fn delta(a: CountsNow, b: CountsNow) -> (u64, u64) {
    let req = |c: CountsNow| c.puts + c.gets + c.deletes + c.lists;
    (req(b) - req(a), b.bytes_put - a.bytes_put)
}

/// Waits (at most two minutes) for the cleaner to finish what the writes
/// left it: live data back above its 70 % threshold, or nothing changing
/// for two seconds.
async fn settle(v: &LsvdVolume) {
    let start = Instant::now();
    let (mut last, mut same) = (u64::MAX, 0);
    while start.elapsed() < Duration::from_secs(120) && same < 4 {
        let i = v.info();
        if i.live_bytes as f64 >= 0.7 * i.stored_bytes as f64 {
            return;
        }
        same = if i.stored_bytes == last { same + 1 } else { 0 };
        last = i.stored_bytes;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

struct S3Result {
    r16: Run,
    drain_secs: f64,
    req16: f64,
    waf: f64,
    /// Bytes stored in objects / live bytes, once the cleaner settled.
    stored_ratio: f64,
    r4: Run,
    req4: f64,
}

async fn s3_runs(a: &Args, store: Store) -> Result<S3Result> {
    let env = Env::real();
    let name = "lsvd-bench";
    let desc =
        lsvd::create(&env, &store, name, a.size, a.object_size).await.context("creating the S3 volume")?;
    let cache = a.data.join("cache").join("journal");
    let cfg = Config { cache_bytes: a.cache_size, gc_live_ratio: a.gc_live_ratio, ..Config::default() };
    let v =
        Arc::new(LsvdVolume::open(env, store.clone(), Some(name), &cache, cfg).await.context("opening it")?);
    let range = ((a.size as f64 * a.util) as u64) / (16 << 10) * (16 << 10);

    // Fill the range once, sequentially, and let it all reach S3.
    let t = Instant::now();
    let chunk = 1u64 << 20;
    let mut off = 0;
    while off < range {
        let len = chunk.min(range - off);
        v.write(off, Bytes::from(vec![0x5a; len as usize]), false).await?;
        off += len;
    }
    v.flush().await?;
    v.drain().await?;
    eprintln!("filled {} MiB in {:.1} s", range >> 20, t.elapsed().as_secs_f64());

    let write = {
        let v = v.clone();
        move |off: u64, d: Bytes| {
            let v = v.clone();
            async move { Ok(v.write(off, d, false).await?) }
        }
    };
    let c0 = store.counts().now();
    let n16 = a.overwrites * range / (16 << 10);
    let r16 = random_writes(write.clone(), range, 16 << 10, a.qd, Until::Writes(n16)).await?;
    let t = Instant::now();
    v.flush().await?;
    v.drain().await?;
    settle(&v).await;
    let drain_secs = t.elapsed().as_secs_f64();
    let c1 = store.counts().now();
    let (req, put) = delta(c0, c1);
    let client_bytes = (r16.writes * (16 << 10)) as f64;
    let ckpt = (c1.checkpoint_bytes_put - c0.checkpoint_bytes_put) as f64 / client_bytes;
    let cleaning = (c1.cleaning_bytes_put - c0.cleaning_bytes_put) as f64 / client_bytes;
    eprintln!("WAF parts, per client byte: cleaning {cleaning:.3}, checkpoints {ckpt:.3}, the rest (destaged data and headers) {:.3}", put as f64 / client_bytes - cleaning - ckpt);
    let req16 = req as f64 / r16.writes as f64;
    let waf = put as f64 / (r16.writes * (16 << 10)) as f64;
    let info = v.info();
    let stored_ratio = info.stored_bytes as f64 / info.live_bytes.max(1) as f64;
    eprintln!(
        "16 KiB: {} writes in {:.1} s, drained in {drain_secs:.1} s; {req} requests, {} MiB put; \
         {} objects, live {} of {} MiB stored",
        r16.writes,
        r16.secs,
        put >> 20,
        info.objects,
        info.live_bytes >> 20,
        info.stored_bytes >> 20
    );

    let c0 = store.counts().now();
    let r4 = random_writes(write, range, 4 << 10, a.qd, Until::Time(Duration::from_secs(a.secs))).await?;
    v.flush().await?;
    v.drain().await?;
    let (req, _) = delta(c0, store.counts().now());
    let req4 = req as f64 / r4.writes as f64;
    v.close().await?;
    drop(v);
    let deleted = lsvd::destroy(&store, desc.uuid).await.context("deleting the S3 volume")?;
    eprintln!("deleted the volume ({deleted} objects)");
    Ok(S3Result { r16, drain_secs, req16, waf, stored_ratio, r4, req4 })
}

async fn blob_runs(a: &Args) -> Result<(Run, Run)> {
    let dir = a.data.join("cluster");
    let mut cfg = ClusterConfig::new(&dir);
    cfg.tractservers = a.replication as usize;
    cfg.replication = a.replication;
    cfg.disk_size = a.size + (1 << 30);
    let env = Env::real();
    let cluster = Cluster::start(env.clone(), cfg).await.context("starting the embedded cluster")?;
    // New disk files are zero-filled in the background first; measuring
    // alongside that would charge its writes to the benchmark.
    cluster.wait_disks_prepared(Duration::from_secs(600)).await?;
    let client = cluster.client().await?;
    let mut spec = VolumeSpec::new("blob-bench", a.size);
    spec.mode = CommitMode::WriteThrough;
    spec.flush = FlushPolicy::Durable;
    spec.replication = a.replication;
    let v = Arc::new(manage::create(env, &client, &spec).await.context("creating the blob-store volume")?);
    let write = {
        let v = v.clone();
        move |off: u64, d: Bytes| {
            let v = v.clone();
            async move { Ok(v.write(off, d, false).await?) }
        }
    };
    let secs = Until::Time(Duration::from_secs(a.secs));
    let r16 = random_writes(write.clone(), a.size, 16 << 10, a.qd, secs).await?;
    let r4 = random_writes(write, a.size, 4 << 10, a.qd, secs).await?;
    v.flush_durable().await?;
    drop(v);
    cluster.stop().await;
    Ok((r16, r4))
}

fn main() -> Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.data).with_context(|| format!("creating {}", a.data.display()))?;
    // Started before the runtime: it waits on a thread.
    let (weed, url) = match &a.s3 {
        Some(u) => (None, u.clone()),
        None => {
            let w = Weed::start();
            let u = w.url(&format!("bench-{}", std::process::id()));
            (Some(w), u)
        }
    };
    let loc = match weed {
        Some(_) => blizzard_lsvd::s3::open_with_keys(&url, Some((KEY_ID, SECRET))),
        None => blizzard_lsvd::s3::open(&url),
    }
    .with_context(|| format!("the S3 URL {url}"))?;
    let store = Store::new(loc.store, &loc.prefix);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let s3 = rt.block_on(s3_runs(&a, store))?;
    let blob = if a.s3_only { None } else { Some(rt.block_on(blob_runs(&a))?) };

    let what = if a.s3.is_some() { "S3 (--s3)" } else { "S3 (SeaweedFS 4.48, this host)" };
    println!(
        "Volumes of {} MiB; QD {}; the S3 volume's 16 KiB writes over {:.0} % of it, {} times over \
         (objects of {} MiB, cache of {} MiB); blob store: write-through, replication {}.",
        a.size >> 20,
        a.qd,
        a.util * 100.0,
        a.overwrites,
        a.object_size >> 20,
        a.cache_size >> 20,
        a.replication
    );
    println!();
    println!("| volume | load | writes | IOPS | CPU µs/write | S3 requests/write | WAF |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {what} | 16 KiB random | {} | {:.0} | {:.1} | {:.3} | {:.2} |",
        s3.r16.writes,
        s3.r16.iops(),
        s3.r16.cpu_us,
        s3.req16,
        s3.waf
    );
    println!(
        "| {what} | 4 KiB random | {} | {:.0} | {:.1} | {:.3} | |",
        s3.r4.writes,
        s3.r4.iops(),
        s3.r4.cpu_us,
        s3.req4
    );
    if let Some((b16, b4)) = &blob {
        println!(
            "| blob store | 16 KiB random | {} | {:.0} | {:.1} | | |",
            b16.writes,
            b16.iops(),
            b16.cpu_us
        );
        println!("| blob store | 4 KiB random | {} | {:.0} | {:.1} | | |", b4.writes, b4.iops(), b4.cpu_us);
        println!();
        println!(
            "S3 / blob store IOPS: 16 KiB {:.2}, 4 KiB {:.2}.",
            s3.r16.iops() / b16.iops(),
            s3.r4.iops() / b4.iops()
        );
    }
    println!();
    println!(
        "After the 16 KiB phase's last write, its drain into objects and the cleaner took {:.1} s (counted \
         in requests and WAF, not in IOPS); the objects then held {:.2} bytes for each live byte (cleaning \
         threshold {:.0} %).",
        s3.drain_secs,
        s3.stored_ratio,
        a.gc_live_ratio * 100.0
    );
    println!("lsvd: s3_requests_per_16k_write={:.3} waf={:.2} iops={:.0}", s3.req16, s3.waf, s3.r16.iops());
    Ok(())
}
