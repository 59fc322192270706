//! `blizzard up`: a whole cluster in this process (a metadata service,
//! tractservers over in-memory pipes) and an NBD server exporting a
//! default volume, created on first start.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_volume::{manage, CommitMode, FlushPolicy, PlantedBug, S3Spec, VolumeSpec};

use crate::volume_cmd::{cache_dir, print_volume, remove_empty_dir};
use crate::{
    mode, open_waiting, planted, policy, print_connect, print_status, report_zero_fill, self_check, size,
    wait_for_stop_signal,
};

/// Striping unit of `blizzard up`'s default write-through or fast-ack
/// volume. Its tractservers share one machine's disk, so spreading a
/// sequential stream over them in 64 KiB blocks buys no parallelism and
/// costs each of them a write and a sync per block: 1 MiB blocks turn a
/// 1 MiB NBD write into one direct write to one tract instead of sixteen.
/// Measured with `bench/row.sh` (`UP_ARGS="--block-size ..."`), 64 KiB →
/// 1 MiB: 1 MiB writes at QD 8 385–534 → 643–689 MB/s at 0.9 instead of
/// 1.4–2.1 ms of CPU each, 1 MiB reads 875 → 1,488 MB/s, 64 KiB writes
/// 264 → 361 MB/s, 4 KiB random writes unchanged (no read-before-write in
/// these modes). A cluster of many disks (`volume create`) keeps 64 KiB,
/// as the paper (§2.3) advises for small sequential I/O.
const UP_BLOCK_SIZE: u32 = 1 << 20;

#[derive(Args)]
pub(crate) struct UpArgs {
    /// Directory for the tractservers' disk files.
    #[arg(long, default_value = "./blizzard-data")]
    data: PathBuf,
    /// Where the NBD server listens (`host:port` or `unix:/path`).
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: String,
    #[arg(long, default_value_t = 4)]
    tractservers: usize,
    /// Of those, how many (the last) are slow disks (class hdd, design
    /// 0009): modelled by --hdd-model, each with a backup journal of
    /// --journal-size beside its disk file. A cluster first built with
    /// both classes can place volumes ssd, hdd or hybrid.
    #[arg(long, default_value_t = 0)]
    hdd_tractservers: usize,
    /// How the hdd tractservers' disks behave: hdd (8 ms per seek, 150
    /// MB/s, one arm), delay=MS, or real (this machine's disk as is).
    #[arg(long, default_value = "hdd")]
    hdd_model: String,
    /// Backup journal of each hdd tractserver (0: none).
    #[arg(long, default_value = "256MiB", value_parser = size)]
    journal_size: u64,
    /// A second journal area of each hdd tractserver, beside its disk
    /// file, taking small writes while the journal is full (default:
    /// --journal-size; 0: none, a full journal sends them to the disk).
    #[arg(long, value_parser = size)]
    journal_overflow_size: Option<u64>,
    /// Where the default volume's replicas live when it is created: any,
    /// ssd, hdd or hybrid (see `blizzard volume create --placement`).
    #[arg(long, default_value = "any")]
    placement: blizzard_core::Placement,
    /// Replication of the cluster and of the default volume.
    #[arg(long, default_value_t = 1)]
    replication: u8,
    /// Name of the default volume (also the default NBD export).
    #[arg(long, default_value = "disk")]
    volume: String,
    /// Size of the default volume when it is created (thin: space is
    /// used only where written).
    #[arg(long, default_value = "4GiB", value_parser = size)]
    size: u64,
    /// Commit mode of the default volume when it is created.
    #[arg(long, default_value = "write-through", value_parser = mode)]
    mode: CommitMode,
    /// Flush policy of the default volume when it is created: durable
    /// (NBD's contract) or ordered (faster, weaker than NBD: a flush only
    /// orders writes).
    #[arg(long, default_value = "durable", value_parser = policy)]
    flush: FlushPolicy,
    /// Striping unit of the default volume when it is created (default
    /// 1MiB, 64KiB for a log volume; see `UP_BLOCK_SIZE`).
    #[arg(long, value_parser = size)]
    block_size: Option<u64>,
    #[arg(long, default_value = "8MiB", value_parser = size)]
    tract_size: u64,
    /// Size of each tractserver's disk file, allocated on first start.
    #[arg(long, default_value = "2GiB", value_parser = size)]
    disk_size: u64,
    /// Where the metadata server listens (with several replicas, the
    /// first; the others take the next ports).
    #[arg(long, default_value = "127.0.0.1:7700")]
    meta_listen: String,
    /// Metadata replicas (1 or 3 or 5; more than one keeps the table
    /// and the volume leases in their logs under DATA/meta-N/, and
    /// survives the loss of a minority of them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=7))]
    meta_replicas: u8,
    /// Start everything, check the blob store and the volume, print the
    /// status, and exit.
    #[arg(long)]
    check: bool,
    /// Make the default volume, when it is created, an S3 volume
    /// (design 0008) under this URL (`http://host:port/bucket/prefix`;
    /// credentials from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY),
    /// with its cache under DATA/lsvd-cache/VOLUME.
    #[arg(long)]
    s3: Option<String>,
    /// Size of that S3 volume's journal file (its read cache beside it
    /// is as large).
    #[arg(long, default_value = "1GiB", value_parser = size)]
    cache_size: u64,
    /// Serve Prometheus metrics of the NBD server's open volumes at
    /// http://ADDR/metrics (an S3 volume's bytes not yet in the object
    /// store, its cache, its objects and its requests).
    #[arg(long)]
    metrics: Option<String>,
    /// Test hook: open volumes with this bug planted (see `crashcheck
    /// --plant`), so a real-process test can show its check fails.
    #[arg(long, hide = true, default_value = "none", value_parser = planted)]
    plant: PlantedBug,
}

pub(crate) async fn up_cmd(env: Env, args: UpArgs) -> Result<()> {
    let UpArgs {
        data,
        listen,
        tractservers,
        hdd_tractservers,
        hdd_model,
        journal_size,
        journal_overflow_size,
        placement,
        replication,
        volume,
        size,
        mode,
        flush,
        block_size,
        tract_size,
        disk_size,
        meta_listen,
        meta_replicas,
        check,
        s3,
        cache_size,
        metrics,
        plant,
    } = args;
    let mut cfg = ClusterConfig::new(&data);
    cfg.tractservers = tractservers;
    cfg.replication = replication;
    cfg.tract_size = u32::try_from(tract_size).context("tract size too large")?;
    cfg.disk_size = disk_size;
    cfg.meta_listen = meta_listen;
    cfg.meta_replicas = meta_replicas as usize;
    if hdd_tractservers > tractservers {
        bail!("--hdd-tractservers {hdd_tractservers} is more than --tractservers {tractservers}");
    }
    cfg.hdd_tractservers = hdd_tractservers;
    if hdd_tractservers > 0 {
        cfg.hdd_model = match hdd_model.as_str() {
            "real" => None,
            m => Some(blizzard_env::DiskModel::parse(m).map_err(|e| anyhow::anyhow!("--hdd-model: {e}"))?),
        };
        cfg.journal_size = (journal_size > 0).then_some(journal_size);
        cfg.journal_second_size = journal_overflow_size.unwrap_or(journal_size);
    }
    // Everything is in this process: its servers reach each other
    // over in-memory pipes, and other processes over unix sockets
    // in the data directory (cheaper than TCP loopback).
    cfg.unix_sockets = true;
    let env = env.with_local_net();
    let cluster = Cluster::start(env.clone(), cfg)
        .await
        .with_context(|| format!("starting the embedded cluster in {}", data.display()))?;
    let client = cluster.client().await?;
    self_check(&client).await.context("self-check of the blob store failed")?;
    let vol = match open_waiting(&env, &client, &volume, plant).await {
        Ok(v) => v,
        Err(blizzard_volume::VolumeError::NotFound(_)) => {
            let mut spec = VolumeSpec::new(volume.clone(), size);
            spec.mode = mode;
            spec.flush = flush;
            spec.replication = replication;
            spec.placement = placement;
            spec.block_size = match (block_size, mode) {
                (Some(b), _) => Some(u32::try_from(b).unwrap_or(u32::MAX)),
                // A log volume rewrites whole blocks under small
                // writes (read-before-write, §2.5.3): keep its
                // usual unit.
                (None, CommitMode::Log) => None,
                (None, _) if tract_size >= u64::from(UP_BLOCK_SIZE) => Some(UP_BLOCK_SIZE),
                (None, _) => None,
            };
            let mut made_dir = None;
            let made = match &s3 {
                Some(url) => {
                    let (dir, made) = cache_dir(&data.join("lsvd-cache").join(&volume))?;
                    made_dir = made.then_some(dir.clone());
                    let mut s = S3Spec::new(url.clone(), dir);
                    s.cache_bytes = cache_size;
                    manage::create_s3(env.clone(), &client, &spec, &s).await
                }
                None => manage::create(env.clone(), &client, &spec).await,
            };
            match made {
                Ok(v) => v,
                Err(e) => {
                    remove_empty_dir(made_dir.as_deref());
                    return Err(e).with_context(|| format!("creating the default volume {volume:?}"));
                }
            }
        }
        Err(e) => return Err(e).with_context(|| format!("opening the default volume {volume:?}")),
    };
    let sb = vol.superblock().clone();
    // The NBD server opens it again, once, for all its connections.
    vol.close().await?;
    let asked_s3 = s3.is_some();
    let open_mode = blizzard_nbd::OpenMode { planted: plant, ..Default::default() };
    let exports = blizzard_nbd::ClientExports::with_mode(env.clone(), client.clone(), open_mode);
    let nbd_cfg = blizzard_nbd::NbdConfig {
        default_export: Some(volume.clone()),
        metrics_listen: metrics,
        ..Default::default()
    };
    let server = blizzard_nbd::Server::start(env.clone(), exports, &listen, nbd_cfg)
        .await
        .with_context(|| format!("starting the NBD server on {listen}; is another server using it?"))?;
    print_status(&client.cluster_status().await?);
    println!();
    print_volume(&sb);
    if sb.mode != mode || sb.flush != flush || sb.size_bytes != size || sb.backend.s3().is_some() != asked_s3
    {
        println!(
            "(the volume already existed: it keeps its own settings; `blizzard volume` changes or replaces it)"
        );
    }
    println!();
    print_connect(server.local_addr(), &volume);
    println!("  status:       blizzard status --meta {}", cluster.meta_addr);
    println!("  data in:      {}", data.display());
    if !check {
        println!("Ctrl-C (or SIGTERM) stops it cleanly.");
        let stop = wait_for_stop_signal();
        tokio::pin!(stop);
        tokio::select! {
            r = &mut stop => r?,
            () = report_zero_fill(&env, &cluster) => stop.await?,
        }
        println!("stopping: finishing in-flight requests and flushing volumes");
    }
    let flushed = server.shutdown().await;
    cluster.stop().await;
    flushed.context("flushing volumes at shutdown")?;
    Ok(())
}
