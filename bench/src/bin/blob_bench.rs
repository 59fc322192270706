//! Blob store throughput: one client writes, then reads, a blob of SIZE
//! bytes sequentially or in random order, in tract-sized or smaller
//! requests, against an embedded cluster in this process. Prints one
//! result line per phase (MB/s, CPU seconds per GB for the whole process:
//! client and tractservers together).
//!
//! Run by `bench/blob.sh`, which puts fio on a raw file beside it.

#![allow(clippy::disallowed_methods)] // a benchmark measures real time on real disks

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Parser;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use blizzard_bench::{cpu_seconds, size_arg};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::units::parse_size;
use blizzard_env::Env;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Data directory for the embedded cluster's disk files.
    #[arg(long)]
    data: PathBuf,
    #[arg(long, default_value_t = 4)]
    tractservers: usize,
    #[arg(long, default_value_t = 1)]
    replication: u8,
    /// Bytes to write and read.
    #[arg(long, default_value = "4GiB", value_parser = size_arg)]
    size: u64,
    /// Request size: `tract` or a byte size such as 128KiB.
    #[arg(long, default_value = "tract")]
    request: String,
    /// `seq` or `rand`.
    #[arg(long, default_value = "seq")]
    pattern: String,
    /// Requests in flight (defaults to the client's simultaneous limit).
    #[arg(long)]
    inflight: Option<usize>,
    /// Drop the page cache between the write and the read phase (root).
    #[arg(long)]
    drop_caches: bool,
    /// Label printed in the result lines.
    #[arg(long, default_value = "")]
    label: String,
    /// Charge a modelled device's costs on every tractserver's disk: `hdd`
    /// or `delay=MS` (`blizzard_env::DiskModel`).
    #[arg(long, value_parser = blizzard_env::DiskModel::parse)]
    disk_model: Option<blizzard_env::DiskModel>,
    /// Give every tractserver a backup journal of this size on the data
    /// directory's storage (class hdd; design 0009).
    #[arg(long, value_parser = size_arg)]
    journal_size: Option<u64>,
    /// Size-aware replication (Ursa §3.4): writes larger than this go once,
    /// to the row's primary, which forwards them to the backups
    /// (`ClientConfig::forward_above`); smaller ones, and all without the
    /// flag, go from the client to every replica.
    #[arg(long, value_parser = size_arg)]
    forward_above: Option<u64>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter("warn").with_writer(std::io::stderr).init();
    let a = Args::parse();
    let tract: u64 = 8 << 20;
    let req = if a.request == "tract" { tract } else { parse_size(&a.request)? };
    if req == 0 || req > tract || !tract.is_multiple_of(req) {
        bail!("request size must divide the 8 MiB tract");
    }
    let n_req = a.size / req;
    let tracts = a.size.div_ceil(tract);
    let per_ts = tracts * a.replication as u64 / a.tractservers as u64;
    let mut cfg = ClusterConfig::new(&a.data);
    cfg.tractservers = a.tractservers;
    cfg.replication = a.replication;
    cfg.tract_size = tract as u32;
    // Room for this tractserver's share with generous slack for uneven placement.
    cfg.disk_size = (per_ts * 2 + 8) * tract + (64 << 20);
    cfg.disk_model = a.disk_model.clone();
    cfg.journal_size = a.journal_size;
    let cluster = Cluster::start(Env::real(), cfg).await.context("starting the cluster")?;
    // New disk files are zero-filled in the background first; measuring
    // alongside that would charge its writes to the benchmark.
    cluster.wait_disks_prepared(Duration::from_secs(600)).await?;
    let forward_above = a.forward_above.map(|v| u32::try_from(v).unwrap_or(u32::MAX));
    let client = cluster.client_with(|c| c.forward_above = forward_above).await?;
    let blob = client.create_blob(None, a.replication).await?;
    blob.extend_to(tracts).await?;
    let inflight = a.inflight.unwrap_or(client.simultaneous_limit());

    let mut order: Vec<u64> = (0..n_req).collect();
    if a.pattern == "rand" {
        order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(42));
    } else if a.pattern != "seq" {
        bail!("--pattern is seq or rand");
    }
    let order = Arc::new(order);
    let payload = Bytes::from((0..req).map(|i| (i % 251) as u8).collect::<Vec<u8>>());

    for phase in ["write", "read"] {
        if phase == "read" && a.drop_caches {
            std::fs::write("/proc/sys/vm/drop_caches", "3").context("dropping caches needs root")?;
        }
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut workers = Vec::new();
        for _ in 0..inflight {
            let (blob, order, next, payload) = (blob.clone(), order.clone(), next.clone(), payload.clone());
            workers.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&r) = order.get(i as usize) else { return Ok::<_, anyhow::Error>(()) };
                    let off = r * req;
                    let (t, o) = (off / tract, (off % tract) as u32);
                    if phase == "write" {
                        blob.write(t, o, payload.clone()).await?;
                    } else {
                        let b = blob.read(t, o, req as u32).await?;
                        if b.len() as u64 != req || b[..16] != payload[..16] {
                            bail!("read back wrong data at tract {t} offset {o}");
                        }
                    }
                }
            }));
        }
        for w in workers {
            w.await??;
        }
        let secs = t0.elapsed().as_secs_f64().max(1e-9);
        let cpu = cpu_seconds() - cpu0;
        let bytes = n_req * req;
        println!(
            "result label={} replication={} tractservers={} pattern={} request={} phase={} bytes={} seconds={:.3} mbps={:.1} iops={:.0} mean_latency_us={:.0} cpu_s_per_gb={:.3}",
            a.label,
            a.replication,
            a.tractservers,
            a.pattern,
            req,
            phase,
            bytes,
            secs,
            bytes as f64 / 1e6 / secs,
            n_req as f64 / secs,
            secs * 1e6 * inflight.min(n_req as usize) as f64 / n_req.max(1) as f64,
            cpu / (bytes as f64 / 1e9),
        );
    }
    client.delete_blob(blob.id()).await?;
    cluster.stop().await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    Ok(())
}
