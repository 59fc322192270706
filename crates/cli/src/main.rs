//! `blizzard`: one binary, one subcommand per role. This file only parses
//! flags and hands them to the libraries; every server is a library entry
//! point taking an env and a config.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Parser, Subcommand};

use blizzard_client::{Client, ClientConfig};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::units::{format_size, parse_size};
use blizzard_env::Env;
use blizzard_metaserver::server::MetaConfig;
use blizzard_proto::ClusterStatus;
use blizzard_tractserver::TractServerConfig;

// Tract-sized buffers come and go constantly; mimalloc keeps freed ones for
// reuse instead of handing them back to the kernel to be faulted in again.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "blizzard", version, about = "blizzard: a cloud-scale virtual block store")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a whole cluster in this process: a metadata server and N
    /// tractservers on loopback, data under --data. Runs until Ctrl-C.
    Up {
        /// Directory for the tractservers' disk files.
        #[arg(long, default_value = "./blizzard-data")]
        data: PathBuf,
        #[arg(long, default_value_t = 4)]
        tractservers: usize,
        /// Maximum replication level (members per TLT row).
        #[arg(long, default_value_t = 1)]
        replication: u8,
        #[arg(long, default_value = "8MiB", value_parser = size)]
        tract_size: u64,
        /// Size of each tractserver's disk file, allocated on first start.
        #[arg(long, default_value = "2GiB", value_parser = size)]
        disk_size: u64,
        /// Where the metadata server listens.
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta_listen: String,
        /// Write and read back a test blob, print the status, and exit.
        #[arg(long)]
        check: bool,
    },
    /// Run a metadata server.
    Meta {
        #[arg(long, default_value = "127.0.0.1:7700")]
        listen: String,
        /// Tract size of a new cluster (fixed at creation).
        #[arg(long, default_value = "8MiB", value_parser = size)]
        tract_size: u64,
        /// Maximum replication level of a new cluster.
        #[arg(long, default_value_t = 1)]
        replication: u8,
        /// Build a new cluster's TLT once this many tractservers registered.
        #[arg(long, default_value_t = 1)]
        init_tractservers: usize,
        /// Permutations concatenated in a 1-way TLT (FDS uses 20).
        #[arg(long, default_value_t = 20)]
        permutations: u32,
        /// Weight a 1-way TLT by each disk's measured speed.
        #[arg(long)]
        weighted: bool,
        #[arg(long, default_value_t = 500)]
        heartbeat_ms: u64,
    },
    /// Run a tractserver on one disk (a block device or a file).
    Tractserver {
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
        /// Delay added to each tract read and write (benchmarks only).
        #[arg(long, default_value_t = 0.0)]
        io_delay_ms: f64,
    },
    /// Show the cluster: members, failure domains, TLT, disk usage.
    Status {
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_writer(std::io::stderr).init();
}

#[tokio::main]
async fn main() -> Result<()> {
    init_logging();
    let cli = Cli::parse();
    let env = Env::real();
    match cli.cmd {
        Cmd::Up { data, tractservers, replication, tract_size, disk_size, meta_listen, check } => {
            let mut cfg = ClusterConfig::new(&data);
            cfg.tractservers = tractservers;
            cfg.replication = replication;
            cfg.tract_size = u32::try_from(tract_size).context("tract size too large")?;
            cfg.disk_size = disk_size;
            cfg.meta_listen = meta_listen;
            let cluster = Cluster::start(env.clone(), cfg)
                .await
                .with_context(|| format!("starting the embedded cluster in {}", data.display()))?;
            let client = cluster.client().await?;
            self_check(&client).await.context("self-check of the blob store failed")?;
            let status = client.cluster_status().await?;
            print_status(&status);
            println!();
            println!("blob store up: metadata server at {}", cluster.meta_addr);
            println!("  status:   blizzard status --meta {}", cluster.meta_addr);
            println!("  data in:  {}", data.display());
            if check {
                cluster.stop().await;
                return Ok(());
            }
            println!("Ctrl-C to stop.");
            tokio::signal::ctrl_c().await?;
            cluster.stop().await;
        }
        Cmd::Meta {
            listen,
            tract_size,
            replication,
            init_tractservers,
            permutations,
            weighted,
            heartbeat_ms,
        } => {
            let mut cfg = MetaConfig::new(listen);
            cfg.tract_size = u32::try_from(tract_size).context("tract size too large")?;
            cfg.replication = replication;
            cfg.init_tractservers = init_tractservers;
            cfg.permutations = permutations;
            cfg.weighted = weighted;
            cfg.heartbeat_interval = Duration::from_millis(heartbeat_ms);
            cfg.dead_after = cfg.heartbeat_interval * 10;
            cfg.rebuild_grace = cfg.heartbeat_interval * 20;
            let h = blizzard_metaserver::server::start(env, cfg).await?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => h.stop().await,
            }
        }
        Cmd::Tractserver { disk, listen, advertise, meta, failure_domain, create_size, io_delay_ms } => {
            let mut cfg = TractServerConfig::new(disk, listen, meta);
            cfg.advertise = advertise;
            cfg.failure_domain = failure_domain;
            cfg.disk_size = create_size;
            if !(0.0..=10_000.0).contains(&io_delay_ms) {
                bail!("--io-delay-ms must be between 0 and 10000");
            }
            cfg.io_delay = Duration::from_secs_f64(io_delay_ms / 1000.0);
            let h = blizzard_tractserver::start(env, cfg).await?;
            println!("tractserver {} listening on {}", h.id, h.addr);
            tokio::select! {
                _ = tokio::signal::ctrl_c() => h.stop().await,
            }
        }
        Cmd::Status { meta } => {
            let mut cfg = ClientConfig::new(meta.clone());
            cfg.connect_timeout = Duration::from_secs(5);
            let pool_client = Client::connect(env, cfg)
                .await
                .with_context(|| format!("cannot reach the metadata server at {meta}; is it running?"))?;
            print_status(&pool_client.cluster_status().await?);
        }
    }
    Ok(())
}

/// Writes a blob, reads it back and deletes it: proves the data path works
/// end to end before telling the user the cluster is up.
async fn self_check(client: &Client) -> Result<()> {
    let blob = client.create_blob(None, 1).await?;
    blob.extend_to(1).await?;
    let data: Vec<u8> = (0..64 << 10).map(|i: u32| (i % 251) as u8).collect();
    blob.write(0, 0, Bytes::from(data.clone())).await?;
    let back = blob.read(0, 0, data.len() as u32).await?;
    if back[..] != data[..] {
        bail!("read back different bytes than written");
    }
    client.delete_blob(blob.id()).await?;
    Ok(())
}

fn print_status(s: &ClusterStatus) {
    println!(
        "cluster {:032x}  phase {}  tract size {}  replication {}  TLT v{} ({} rows)",
        s.cluster_id,
        s.phase,
        format_size(s.tract_size as u64),
        s.replication,
        s.tlt_version,
        s.tlt_rows
    );
    println!(
        "{:<34} {:<22} {:<10} {:<6} {:>7} {:>9} {:>12} {:>12}",
        "TRACTSERVER", "ADDRESS", "DOMAIN", "STATE", "ROWS", "PRIMARY", "USED", "CAPACITY"
    );
    for m in &s.members {
        let used = m.slots_used * s.tract_size as u64;
        let cap = m.slots_total * s.tract_size as u64;
        println!(
            "{:<34} {:<22} {:<10} {:<6} {:>7} {:>9} {:>12} {:>12}",
            m.id.to_string(),
            m.addr,
            m.domain,
            if m.alive { "up" } else { "down" },
            m.rows,
            m.primaries,
            format_size(used),
            format_size(cap)
        );
    }
}
