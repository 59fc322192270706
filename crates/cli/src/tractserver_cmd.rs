//! `blizzard tractserver`: one disk of tract slots, served, and what the
//! command line says about it (its class, a modelled slower device, a
//! backup journal in front of a slow disk: design 0009).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use blizzard_core::DiskClass;
use blizzard_env::{DiskModel, Env};
use blizzard_tractserver::{JournalConfig, TractServerConfig};

use crate::size;
use crate::tls_cmd::ClusterAuth;

#[derive(Args)]
pub(crate) struct TractserverArgs {
    #[arg(long)]
    disk: PathBuf,
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Address to give the metadata server (default: the bound address).
    #[arg(long)]
    advertise: Option<String>,
    #[arg(long)]
    meta: String,
    #[arg(long, default_value = "")]
    failure_domain: String,
    /// Create the disk file with this size if it does not exist.
    #[arg(long, value_parser = size)]
    create_size: Option<u64>,
    /// The kind of disk this is: `ssd` or `hdd`. The hybrid tier places
    /// a row's primary on ssd and its backups on hdd.
    #[arg(long, default_value = "ssd")]
    class: DiskClass,
    /// Model a slower disk: this delay added to each of the disk's reads
    /// and writes (benchmarks only; the same as `--disk-model delay=MS`).
    #[arg(long, default_value_t = 0.0)]
    io_delay_ms: f64,
    /// Charge a modelled device's costs on top of the real disk
    /// (benchmarks and trials only): `hdd` (a 7,200 rpm disk: 8 ms per
    /// seek, 150 MB/s, one arm) or `delay=MS`.
    #[arg(long, value_parser = DiskModel::parse, conflicts_with = "io_delay_ms")]
    disk_model: Option<DiskModel>,
    /// A backup journal on fast storage (a file or device) in front of
    /// this slow disk: small writes are durable once in it and reach
    /// the disk later, in disk order (the hybrid tier; needs --class hdd).
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Create the journal file with this size if it does not exist.
    #[arg(long, value_parser = size, default_value = "1GiB", requires = "journal")]
    journal_size: u64,
    /// Writes larger than this go to the disk directly, not the journal.
    #[arg(long, value_parser = size, default_value = "64KiB", requires = "journal")]
    journal_bypass: u64,
    /// Bring the disk up to date with the journal at least this often
    /// (milliseconds; also whenever the journal is a quarter full).
    #[arg(long, default_value_t = 2000, requires = "journal")]
    journal_destage_ms: u64,
    /// A second journal area (a file or device), taking small writes
    /// while the journal is full instead of sending them to this slow disk
    /// at random places: more fast storage, or a file on this disk itself,
    /// where they are appended in order. Once used, the journal is not
    /// opened without it.
    #[arg(long, requires = "journal")]
    journal_overflow: Option<PathBuf>,
    /// Create the second area's file with this size if it does not exist
    /// (default: --journal-size).
    #[arg(long, value_parser = size, requires = "journal_overflow")]
    journal_overflow_size: Option<u64>,
    /// Megabytes per second the scrubber re-reads to find and repair
    /// damaged chunks (0: no scrubbing).
    #[arg(long, default_value_t = 4)]
    scrub_mbps: u64,
    /// Megabytes per second this server copies while re-replicating the
    /// rows of a dead tractserver (0: as fast as it can).
    #[arg(long, default_value_t = 0)]
    fill_mbps: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    metrics: Option<String>,
}

pub(crate) async fn tractserver_cmd(env: Env, args: TractserverArgs, auth: &ClusterAuth) -> Result<()> {
    let TractserverArgs {
        disk,
        listen,
        advertise,
        meta,
        failure_domain,
        class,
        create_size,
        io_delay_ms,
        disk_model,
        journal,
        journal_size,
        journal_bypass,
        journal_destage_ms,
        journal_overflow,
        journal_overflow_size,
        scrub_mbps,
        fill_mbps,
        metrics,
    } = args;
    auth.require_certs("a tractserver")?;
    let mut cfg = TractServerConfig::new(disk, listen, meta);
    cfg.advertise = advertise;
    cfg.failure_domain = failure_domain;
    cfg.class = class;
    cfg.disk_size = create_size;
    if !(0.0..=10_000.0).contains(&io_delay_ms) {
        bail!("--io-delay-ms must be between 0 and 10000");
    }
    if io_delay_ms > 0.0 {
        let latency = Duration::from_secs_f64(io_delay_ms / 1000.0);
        cfg.disk_model = Some(DiskModel::new(latency, 0, 0));
    }
    if disk_model.is_some() {
        cfg.disk_model = disk_model;
    }
    if let Some(path) = journal {
        if class != DiskClass::Hdd {
            bail!("--journal is for a tractserver on a slow disk: give --class hdd too");
        }
        let mut jc = JournalConfig::new(path);
        jc.create_size = Some(journal_size);
        jc.bypass = u32::try_from(journal_bypass)
            .ok()
            .filter(|b| *b <= blizzard_tractserver::backup::format::RECORD_DATA_MAX)
            .context("--journal-bypass must be at most 1MiB (the largest journal record)")?;
        jc.destage_interval = Duration::from_millis(journal_destage_ms.max(1));
        jc.second_area = journal_overflow;
        jc.second_area_size = journal_overflow_size;
        cfg.journal = Some(jc);
    }
    cfg.scrub_bandwidth = scrub_mbps.saturating_mul(1_000_000);
    cfg.fill_bandwidth = fill_mbps.saturating_mul(1_000_000);
    cfg.metrics_listen = metrics;
    let mut h = blizzard_tractserver::start(env, cfg).await?;
    println!("tractserver {} listening on {}", h.id, h.addr);
    tokio::select! {
        _ = tokio::signal::ctrl_c() => h.stop().await,
        why = h.refused() => {
            h.stop().await;
            bail!("the metadata service refused this tractserver ({why}): start it with a certificate of role tractserver (`blizzard ca issue NAME --role tractserver`)");
        }
    }
    Ok(())
}
