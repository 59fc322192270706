//! `blizzard up`: a whole cluster in this process (a metadata service,
//! tractservers over in-memory pipes) and an NBD server exporting a
//! default volume, created on first start. It hands its NBD listener and
//! connections, and its data directory, to a successor for an online
//! upgrade (`up_backing`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use blizzard_cluster::ClusterConfig;
use blizzard_env::Env;
use blizzard_nbd::upgrade::Backing;
use blizzard_volume::{manage, CommitMode, FlushPolicy, PlantedBug, S3Spec, VolumeSpec};

use crate::nbd_cmd::{default_upgrade_socket, serve_until_stopped, upgrade_socket_of};
use crate::tls_cmd::{nbd_tls, up_credentials, ClusterAuth, TlsArgs, TlsHint};
use crate::up_backing::UpBacking;
use crate::volume_cmd::{cache_dir, print_volume, remove_empty_dir};
use crate::{
    mode, open_waiting, planted, policy, print_connect, print_status, report_zero_fill, self_check, size,
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
    /// Comparisons only: send every small write to a tractserver alone
    /// instead of batching those ready together (`WriteTracts`).
    #[arg(long, hide = true)]
    no_write_batching: bool,
    /// Online upgrade: take over from the `blizzard up` running as
    /// process PID (or listening for successors on the hand-over socket
    /// PATH) on the same data directory. It answers what is in flight,
    /// flushes and releases its volumes, stops its servers and hands over
    /// the NBD listener and every live connection; this process starts
    /// the servers again and serves them, so clients keep their disks. If
    /// anything fails the old process starts its servers again and serves
    /// on. Takes the old process's settings from the data directory: the
    /// other flags must match the ones it was started with.
    #[arg(long, value_name = "PID|PATH")]
    upgrade_from: Option<String>,
    /// Where this process waits for a successor (`--upgrade-from`);
    /// default `$XDG_RUNTIME_DIR/blizzard-nbd-PID.upgrade`. SIGUSR2 starts
    /// the successor itself: this binary as it is on disk now, with the
    /// same arguments.
    #[arg(long, value_name = "PATH")]
    upgrade_socket: Option<PathBuf>,
    /// NBD over TLS. Without --tls-certificates, `up` makes its own CA, a
    /// server certificate and a client certificate under DATA/tls on
    /// first start (the client's in DATA/tls/client, the layout libnbd
    /// and qemu read) and offers TLS; --tls off makes none. With
    /// --tls-certificates, other processes reach up's cluster over mutual
    /// TLS too (its own servers talk over in-memory pipes).
    #[command(flatten)]
    tls: TlsArgs,
}

pub(crate) async fn up_cmd(env: Env, args: UpArgs, auth: &ClusterAuth) -> Result<()> {
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
        no_write_batching,
        metrics,
        plant,
        upgrade_from,
        upgrade_socket,
        tls,
    } = args;
    let mut cfg = ClusterConfig::new(&data);
    cfg.tractservers = tractservers;
    cfg.replication = replication;
    cfg.tract_size = u32::try_from(tract_size).context("tract size too large")?;
    cfg.disk_size = disk_size;
    // Other processes reach this cluster at its metadata address.
    auth.check_reachable(&meta_listen, "up's metadata server (--meta-listen)")?;
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
    // The binary's path as started: after an upgrade replaced the file,
    // it names the new binary, which SIGUSR2 starts.
    let exe = std::env::current_exe().context("finding this binary's path")?;
    let open_mode = blizzard_nbd::OpenMode { planted: plant, ..Default::default() };
    let backing = UpBacking::new(env.clone(), cfg, open_mode, !no_write_batching);
    let creds = up_credentials(&env, &data, &tls, auth.certs.as_deref(), &listen)?;
    let nbd_tls = nbd_tls(&env, &tls, creds.as_ref().map(|c| c.0.as_path()), &listen)?;
    let hint = TlsHint::of(nbd_tls.as_ref(), creds.and_then(|c| c.1));
    let nbd_cfg = blizzard_nbd::NbdConfig {
        default_export: Some(volume.clone()),
        metrics_listen: metrics,
        tls: nbd_tls,
        ..Default::default()
    };
    let mut server = match &upgrade_from {
        // Online upgrade: the old process stops its cluster once its
        // volumes are released; this one starts it on the same directory
        // and takes the NBD listener and connections
        // (`blizzard_nbd::upgrade`, "A server that owns its storage").
        Some(old) => {
            let path = upgrade_socket_of(old)?;
            let b: Arc<dyn Backing> = backing.clone();
            let server = blizzard_nbd::Server::upgrade_from_backing(
                env.clone(),
                backing.exports(),
                &path,
                nbd_cfg,
                Some(b),
            )
            .await
            .with_context(|| format!("taking over from the blizzard up at {}", path.display()))?;
            let client = backing.client().await?;
            print_status(&client.cluster_status().await?);
            println!();
            println!("took over from process {old}: serving its connections");
            server
        }
        None => {
            backing.start_waiting(Duration::ZERO).await?;
            let client = backing.client().await?;
            let server = serve_default_volume(
                &env,
                &backing,
                &client,
                &listen,
                nbd_cfg,
                &volume,
                {
                    let mut spec = VolumeSpec::new(volume.clone(), size);
                    spec.mode = mode;
                    spec.flush = flush;
                    spec.replication = replication;
                    spec.placement = placement;
                    spec.block_size = match (block_size, mode) {
                        (Some(b), _) => Some(u32::try_from(b).unwrap_or(u32::MAX)),
                        // A log volume rewrites whole blocks under small
                        // writes (read-before-write, §2.5.3): keep its usual
                        // unit.
                        (None, CommitMode::Log) => None,
                        (None, _) if tract_size >= u64::from(UP_BLOCK_SIZE) => Some(UP_BLOCK_SIZE),
                        (None, _) => None,
                    };
                    spec
                },
                s3.map(|url| (url, cache_size)),
                plant,
                hint.as_ref(),
            )
            .await?;
            server
        }
    };
    println!("  status:       blizzard status --meta {}", backing.meta_addr().await);
    println!("  data in:      {}", backing.data_dir().display());
    let own = upgrade_socket.unwrap_or_else(|| default_upgrade_socket(std::process::id()));
    let b: Arc<dyn Backing> = backing.clone();
    if let Err(e) = server.listen_for_upgrades_backing(&own, Some(b)) {
        let _ = server.shutdown().await;
        backing.stop_cluster().await;
        return Err(e).context("listening for a successor (online upgrade); choose --upgrade-socket");
    }
    println!(
        "  upgrade:      kill -USR2 {}   (or start the new binary with --upgrade-from {})",
        std::process::id(),
        std::process::id()
    );
    if !check {
        println!("Ctrl-C (or SIGTERM) stops it cleanly.");
        serve_until_stopped(&server, &exe, &own, report_zero_fill(&env, &backing)).await?;
    }
    let flushed = server.shutdown().await;
    backing.stop_cluster().await;
    flushed.context("flushing volumes at shutdown")?;
    Ok(())
}

/// A first start's NBD server: checks the blob store, creates the default
/// volume if it does not exist (an S3 one if `s3` gives its URL and cache
/// size), and serves it.
#[allow(clippy::too_many_arguments)]
async fn serve_default_volume(
    env: &Env,
    backing: &UpBacking,
    client: &blizzard_client::Client,
    listen: &str,
    nbd_cfg: blizzard_nbd::NbdConfig,
    volume: &str,
    spec: VolumeSpec,
    s3: Option<(String, u64)>,
    plant: PlantedBug,
    tls: Option<&TlsHint>,
) -> Result<blizzard_nbd::Server> {
    self_check(client).await.context("self-check of the blob store failed")?;
    let (mode, flush, size) = (spec.mode, spec.flush, spec.size_bytes);
    let asked_s3 = s3.is_some();
    let vol = match open_waiting(env, client, volume, plant).await {
        Ok(v) => v,
        Err(blizzard_volume::VolumeError::NotFound(_)) => {
            let mut made_dir = None;
            let made = match &s3 {
                Some((url, cache_size)) => {
                    let (dir, made) = cache_dir(&backing.data_dir().join("lsvd-cache").join(volume))?;
                    made_dir = made.then_some(dir.clone());
                    let mut s = S3Spec::new(url.clone(), dir);
                    s.cache_bytes = *cache_size;
                    manage::create_s3(env.clone(), client, &spec, &s).await
                }
                None => manage::create(env.clone(), client, &spec).await,
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
    let server = blizzard_nbd::Server::start(env.clone(), backing.exports(), listen, nbd_cfg)
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
    print_connect(server.local_addr(), volume, tls);
    Ok(server)
}
