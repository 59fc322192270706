//! `blizzard`: one binary, one subcommand per role. This file only parses
//! flags and hands them to the libraries; every server is a library entry
//! point taking an env and a config.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Parser, Subcommand};

use blizzard_client::{Client, ClientConfig};
use blizzard_core::units::{format_size, parse_size};
use blizzard_env::Env;
use blizzard_metaserver::replica::GroupConfig;
use blizzard_metaserver::server::MetaConfig;
use blizzard_proto::ClusterStatus;
use blizzard_volume::{manage, CommitMode, FlushPolicy, PlantedBug};

mod kv;
mod nbd_cmd;
mod tls_cmd;
mod tractserver_cmd;
mod up_backing;
mod up_cmd;
mod volume_cmd;

use nbd_cmd::{nbd_cmd, NbdArgs};
use tls_cmd::{ca_cmd, CaCmd, ClusterAuth, TlsHint};
use tractserver_cmd::{tractserver_cmd, TractserverArgs};
use up_cmd::{up_cmd, UpArgs};
use volume_cmd::{volume_cmd, VolumeCmd};

// Tract-sized buffers come and go constantly; mimalloc keeps freed ones for
// reuse instead of handing them back to the kernel to be faulted in again.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "blizzard", version, about = "blizzard: a cloud-scale virtual block store")]
struct Cli {
    /// Threads running the async work; 0 means one per core. Defaults to 1
    /// for `up` (everything on one thread, no hand-offs between threads:
    /// the cheapest per small request when client, NBD server and
    /// tractservers share a machine) and to one per core otherwise.
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// This process's certificates (the directory qemu and nbdkit read:
    /// ca-cert.pem, and server-cert.pem/server-key.pem for a server role
    /// or client-cert.pem/client-key.pem for a client; `blizzard ca
    /// issue` writes one). Every connection to and from the cluster's
    /// servers is then mutual TLS with that CA, and each server checks
    /// its peers' roles. `nbd` and `up` also serve NBD over TLS with it.
    /// Checked at start.
    #[arg(long, global = true, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Run the cluster's connections without TLS or authentication, on a
    /// network you trust: a metadata server, tractserver or runtime member
    /// refuses to start without certificates otherwise (and `up` on a
    /// --meta-listen address other hosts reach). With --tls-certificates,
    /// `nbd` and `up` then use them for NBD only.
    #[arg(long, global = true)]
    insecure: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

#[derive(Subcommand)]
enum Cmd {
    /// Run everything in this process: a metadata server, N tractservers
    /// (data under --data) and an NBD server exporting a default volume,
    /// created on first start. Survives restarts; Ctrl-C or SIGTERM stops
    /// it cleanly.
    Up(UpArgs),
    /// Serve the volumes of a cluster over NBD (QEMU, nbdinfo, nbdcopy,
    /// nbdfuse, fio's nbd engine), each as an export of its own name.
    Nbd(NbdArgs),
    /// Certificates: a CA for a cluster, and certificates it issues for
    /// NBD servers, cluster servers and clients (the layout qemu, nbdkit
    /// and libnbd read).
    Ca {
        #[command(subcommand)]
        cmd: CaCmd,
    },
    /// Run a metadata server, or one replica of the metadata service
    /// (`--id`, `--peers`, `--data`: three replicas survive the loss of
    /// any one; every other command then takes `--meta` with all three).
    Meta {
        /// Where to listen (default: this replica's ADDR in --peers, or
        /// 127.0.0.1:7700 for a single server).
        #[arg(long)]
        listen: Option<String>,
        /// This replica's id: one of the ids in --peers.
        #[arg(long, requires = "peers")]
        id: Option<u64>,
        /// Every replica: ID=ADDR,ID=ADDR,... (the same on every replica;
        /// each ADDR serves that replica's peers and clients alike).
        /// Without it, a single server keeps its state in memory and
        /// rebuilds the table from the tractservers after a restart.
        #[arg(long, requires_all = ["id", "data"])]
        peers: Option<String>,
        /// Where this replica keeps its log and snapshots. A single server
        /// (no --peers) keeps only the volumes' access lists and the
        /// revoked certificates there, which nothing could rebuild;
        /// without --data it refuses to keep any.
        #[arg(long)]
        data: Option<PathBuf>,
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
        /// Declare a tractserver dead after this long without a heartbeat
        /// and give its TLT rows to live ones.
        #[arg(long, default_value_t = 5000)]
        dead_after_ms: u64,
        /// Keep tractservers that hold no TLT entries (new ones, or ones
        /// back from the dead) as spares for replacing failed ones, instead
        /// of giving them their share of the table (FDS §3.4).
        #[arg(long)]
        no_rebalance: bool,
        /// Serve Prometheus metrics at http://ADDR/metrics.
        #[arg(long)]
        metrics: Option<String>,
    },
    /// Run a tractserver on one disk (a block device or a file).
    Tractserver(TractserverArgs),
    /// Show the cluster: members, failure domains, TLT, disk usage.
    Status {
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
        /// Follow the cluster until it is settled (every silent tractserver
        /// back or declared dead, every row whole again), with a progress
        /// bar over re-replication (tracts copied, rate, ETA); then show
        /// the status.
        #[arg(long)]
        watch: bool,
    },
    /// Manage volumes: virtual disks, each one blob.
    Volume {
        #[command(subcommand)]
        cmd: VolumeCmd,
    },
    /// Crash a volume thousands of times on a deterministic in-memory blob
    /// store and check every recovery is consistent with the commit mode.
    Crashcheck {
        #[arg(long, value_parser = mode)]
        mode: CommitMode,
        #[arg(long, default_value_t = 1000)]
        crashes: u64,
        /// First seed (trial i uses seed+i); random if not given.
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, default_value = "durable", value_parser = policy)]
        flush: FlushPolicy,
        #[arg(long, default_value_t = 2)]
        replication: u8,
        /// Plant a bug on purpose, to see the checker catch it.
        #[arg(long, default_value = "none", value_parser = planted)]
        plant: PlantedBug,
    },
    /// Crash an LSVD volume (design 0008) thousands of times over the
    /// in-memory object store and an in-memory cache disk: cache writes
    /// lost, kept or torn, object puts lost in flight, the cache lost, and
    /// recovery crashed; checks prefix consistency and flushed writes.
    CrashcheckLsvd {
        #[arg(long, default_value_t = 1000)]
        crashes: u64,
        /// First seed (trial i uses seed+i); random if not given.
        #[arg(long)]
        seed: Option<u64>,
        /// Plant a bug on purpose, to see the checker catch it
        /// (destage-before-sync, reclaim-before-put).
        #[arg(long, default_value = "none", value_parser = lsvd_planted)]
        plant: blizzard_crashcheck::lsvd::Planted,
    },
    /// The client half of the real-process crash check: drive a tagged
    /// random workload against a volume, logging each operation before it
    /// is issued and each acknowledgment after it arrives. Kill it with
    /// SIGKILL at any moment, then run `crashcheck-verify`.
    CrashcheckClient {
        #[arg(long, default_value = "127.0.0.1:7600")]
        meta: String,
        #[arg(long)]
        volume: String,
        /// Event log to append to (created).
        #[arg(long)]
        log: PathBuf,
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, default_value_t = 100_000)]
        ops: usize,
        /// Operations in flight.
        #[arg(long, default_value_t = 8)]
        depth: usize,
    },
    /// Recover a volume after `crashcheck-client` was killed and check it
    /// against the event log under the volume's commit mode and flush policy.
    CrashcheckVerify {
        #[arg(long, default_value = "127.0.0.1:7600")]
        meta: String,
        #[arg(long)]
        volume: String,
        #[arg(long)]
        log: PathBuf,
        /// Take the volume from the killed client without waiting for its
        /// lease to end.
        #[arg(long)]
        take_over: bool,
    },
    /// A replica group of the replicated runtime (Raft) serving an ordered
    /// map, priority queues and a graph, and its client commands.
    Kv {
        #[command(subcommand)]
        cmd: kv::KvCmd,
    },
}

fn mode(s: &str) -> Result<CommitMode, String> {
    CommitMode::parse(s).ok_or_else(|| format!("{s:?}: use write-through, fast-ack or log"))
}

fn policy(s: &str) -> Result<FlushPolicy, String> {
    FlushPolicy::parse(s).ok_or_else(|| format!("{s:?}: use durable or ordered"))
}

fn lsvd_planted(s: &str) -> Result<blizzard_crashcheck::lsvd::Planted, String> {
    blizzard_crashcheck::lsvd::Planted::parse(s).ok_or_else(|| {
        format!(
            "unknown planted bug {s:?} (none, destage-before-sync, reclaim-before-put, gc-ignores-snapshots)"
        )
    })
}

fn planted(s: &str) -> Result<PlantedBug, String> {
    PlantedBug::parse(s).ok_or_else(|| {
        format!(
            "{s:?}: use none, ack-durable-flush-early, issue-across-epochs, skip-read-crc, \
             map-out-of-order, roll-past-hole, reuse-without-seq, skip-cache-sync, skip-reconcile \
             or write-before-intent"
        )
    })
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // openraft warns on every failed heartbeat to a peer that is down
        // (twenty a second): its errors only, unless RUST_LOG asks.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=error"));
    tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_writer(std::io::stderr).init();
}

fn main() -> std::process::ExitCode {
    init_logging();
    let cli = Cli::parse();
    // Servers hold a descriptor per connection, pending ones included.
    if let Some((before, after)) = blizzard_env::raise_fd_limit() {
        tracing::debug!(before, after, "open descriptor limit");
    }
    let threads = cli.threads.unwrap_or(match cli.cmd {
        Cmd::Up { .. } => 1,
        _ => 0,
    });
    let runtime = match threads {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if n > 1 {
                b.worker_threads(n);
            }
            b.enable_all().build()
        }
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The chain of causes, without a backtrace: it is for operators.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let auth = ClusterAuth { certs: cli.tls_certificates, insecure: cli.insecure };
    // Certificates are checked before anything else starts.
    let env = match &cli.cmd {
        Cmd::Ca { cmd: tls_cmd::CaCmd::Revoke { .. } } => auth.env(&Env::real())?,
        Cmd::Ca { .. } => Env::real(),
        _ => auth.env(&Env::real())?,
    };
    match cli.cmd {
        Cmd::Up(args) => up_cmd(env, args, &auth).await?,
        Cmd::Nbd(args) => nbd_cmd(env, args, &auth).await?,
        Cmd::Ca { cmd: tls_cmd::CaCmd::Revoke { name, dir, cert, meta } } => {
            let id = tls_cmd::revoked_identity(&name, dir.as_deref(), cert.as_deref())?;
            let client = connect(&env, &meta).await?;
            client.revoke(&id.serial, &id.name).await.with_context(|| {
                format!("cannot revoke {id} (an admin certificate revokes: --tls-certificates)")
            })?;
            println!(
                "revoked {id}, serial {}: every server refuses it within seconds and closes its connections",
                id.serial
            );
        }
        Cmd::Ca { cmd } => ca_cmd(&env, cmd)?,
        Cmd::Meta {
            listen,
            id,
            peers,
            data,
            tract_size,
            replication,
            init_tractservers,
            permutations,
            weighted,
            heartbeat_ms,
            dead_after_ms,
            no_rebalance,
            metrics,
        } => {
            let mut solo_data = None;
            let group = match (id, peers, data) {
                (Some(id), Some(peers), Some(data)) => {
                    let peers = kv::parse_members(&peers)?;
                    if !peers.contains_key(&id) {
                        bail!(
                            "--id {id} is not one of the ids in --peers ({:?})",
                            peers.keys().collect::<Vec<_>>()
                        );
                    }
                    Some(GroupConfig { id, peers, data_dir: data, timing: Default::default() })
                }
                (None, None, data) => {
                    solo_data = data;
                    None
                }
                _ => bail!("a replica needs --id, --peers and --data together"),
            };
            let listen = match (listen, &group) {
                (Some(l), _) => l,
                (None, Some(g)) => g.peers[&g.id].clone(),
                (None, None) => "127.0.0.1:7700".to_string(),
            };
            auth.require_certs("a metadata server")?;
            let mut cfg = MetaConfig::new(listen);
            cfg.group = group;
            cfg.solo_data = solo_data;
            cfg.grow = !no_rebalance;
            cfg.tract_size = u32::try_from(tract_size).context("tract size too large")?;
            cfg.replication = replication;
            cfg.init_tractservers = init_tractservers;
            cfg.permutations = permutations;
            cfg.weighted = weighted;
            cfg.heartbeat_interval = Duration::from_millis(heartbeat_ms);
            cfg.dead_after = Duration::from_millis(dead_after_ms);
            cfg.metrics_listen = metrics;
            cfg.rebuild_grace = cfg.heartbeat_interval * 20;
            let h = blizzard_metaserver::server::start(env, cfg).await?;
            wait_for_stop_signal().await?;
            h.stop().await;
        }
        Cmd::Tractserver(args) => tractserver_cmd(env, args, &auth).await?,
        Cmd::Volume { cmd } => volume_cmd(env, cmd).await?,
        Cmd::Crashcheck { mode, crashes, seed, flush, replication, plant } => {
            let first = seed.unwrap_or_else(|| env.random_u64() >> 16);
            let mut cfg = blizzard_crashcheck::CheckConfig::new(mode, flush);
            cfg.replication = replication;
            cfg.planted = plant;
            // Trials run their own paused-clock runtimes: on a plain thread,
            // outside this one.
            let (violations, in_flight, snapshots, resized, deleted, rolled) =
                std::thread::spawn(move || run_crashcheck(&cfg, first, crashes, mode, flush, replication))
                    .join()
                    .map_err(|_| anyhow::anyhow!("the crash checker panicked"))?;
            println!(
                "mode={} flush={} replication={replication} in_flight_writes_at_crash={in_flight} crashes_with_snapshots_read_back={snapshots} crashes_with_resizes={resized} crashes_with_snapshot_deletions={deleted} crashes_with_rollbacks={rolled}",
                mode.name(),
                flush.name()
            );
            println!("crashes={crashes} violations={violations} seed={first}");
            if violations > 0 {
                std::process::exit(1);
            }
        }
        Cmd::CrashcheckLsvd { crashes, seed, plant } => {
            let first = seed.unwrap_or_else(|| env.random_u64() >> 16);
            let c = blizzard_crashcheck::lsvd::LsvdCheck { planted: plant, ..Default::default() };
            // Trials run their own paused-clock runtimes: on a plain thread.
            let found =
                std::thread::spawn(move || blizzard_crashcheck::lsvd::lsvd_trials(first, crashes, &c))
                    .join()
                    .map_err(|_| anyhow::anyhow!("the crash checker panicked"))?;
            for (s, v) in found.iter().take(5) {
                println!(
                    "violation at seed {s}: {v}\n  replay: blizzard crashcheck-lsvd --crashes 1 --seed {s}"
                );
            }
            println!("backend=lsvd crashes={crashes} violations={} seed={first}", found.len());
            if !found.is_empty() {
                std::process::exit(1);
            }
        }
        Cmd::CrashcheckClient { meta, volume, log, seed, ops, depth } => {
            use std::io::Write;
            let client = connect(&env, &meta).await?;
            let vol =
                std::sync::Arc::new(blizzard_volume::manage::open(env.clone(), &client, &volume).await?);
            // A harness file at the binary's edge, not a disk the simulator models.
            #[allow(clippy::disallowed_methods)]
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .with_context(|| format!("cannot open the event log {}", log.display()))?;
            let seed = seed.unwrap_or_else(|| env.random_u64() >> 16);
            eprintln!("crashcheck-client: volume {volume} seed {seed}");
            let mut failed = None;
            // One write(2) per event: the kernel keeps it if we are killed.
            blizzard_crashcheck::real::drive_logged(vol, seed, ops, depth, |e| {
                if let Err(err) = file.write_all(e.encode().as_bytes()) {
                    failed.get_or_insert(err);
                }
            })
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
            if let Some(e) = failed {
                bail!("writing the event log {}: {e}", log.display());
            }
        }
        Cmd::Kv { cmd } => kv::run(env, cmd, &auth).await?,
        Cmd::CrashcheckVerify { meta, volume, log, take_over } => {
            let text = std::fs::read_to_string(&log)
                .with_context(|| format!("cannot read the event log {}", log.display()))?;
            let ops = blizzard_crashcheck::real::parse_log(&text).map_err(|e| anyhow::anyhow!(e))?;
            let client = connect(&env, &meta).await?;
            let writer = blizzard_volume::lease::Writer::new(&env).take_over(take_over);
            let vol = manage::open_as(env.clone(), &client, &volume, &writer, PlantedBug::None).await?;
            let acked = ops.iter().filter(|o| o.acked).count();
            let r = blizzard_crashcheck::real::verify(&vol, &ops).await;
            println!("ops={} acked={acked} violations={}", ops.len(), u8::from(r.is_err()));
            if let Err(v) = r {
                bail!("volume {volume} is not in a state its mode allows: {v}");
            }
        }
        Cmd::Status { meta, watch } => {
            let addrs = blizzard_rpc::parse_meta_list(&meta).map_err(anyhow::Error::msg)?;
            if addrs.len() > 1 {
                // The replicas' own view (design 0007): who leads, their lag.
                let cfg = blizzard_replicated::client::ClientConfig {
                    attempt_timeout: Duration::from_secs(2),
                    ..Default::default()
                };
                let group = blizzard_replicated::client::Client::new(&env, addrs, cfg);
                println!("metadata replicas:");
                kv::print_members(&group.statuses().await);
                println!();
            }
            let mut cfg = ClientConfig::new(meta.clone());
            cfg.connect_timeout = Duration::from_secs(5);
            let pool_client = Client::connect(env.clone(), cfg)
                .await
                .with_context(|| format!("cannot reach the metadata service at {meta}; is it running, and are a majority of its replicas up? {NEEDS_CERTS}"))?;
            let s = pool_client.cluster_status().await?;
            if watch && !settled(&s) {
                watch_recovery(&env, &pool_client).await?;
                print_status(&pool_client.cluster_status().await?);
            } else {
                print_status(&s);
            }
        }
    }
    Ok(())
}

/// What a lost connection to the metadata service may mean.
const NEEDS_CERTS: &str = "(A cluster started with --tls-certificates drops clients without a certificate from its CA: give --tls-certificates DIR.)";

async fn connect(env: &Env, meta: &str) -> Result<Client> {
    connect_with(env, meta, |_| {}).await
}

/// [`connect`] with the client's configuration changed by `tune` first.
async fn connect_with(env: &Env, meta: &str, tune: impl FnOnce(&mut ClientConfig)) -> Result<Client> {
    let mut cfg = ClientConfig::new(meta.to_string());
    cfg.connect_timeout = Duration::from_secs(5);
    tune(&mut cfg);
    Client::connect(env.clone(), cfg).await.with_context(|| {
        format!(
            "cannot reach the metadata server at {meta}; is the cluster running (blizzard up)? {NEEDS_CERTS}"
        )
    })
}

/// Opens `blizzard up`'s volume. With replicated metadata (`--meta-replicas`)
/// a volume lease outlives the process: after an unclean stop, the last
/// run's lease holds the volume for up to its ttl (10 s). Wait that out
/// rather than take the volume from what may be a live process.
async fn open_waiting(
    env: &Env,
    client: &Client,
    name: &str,
    plant: PlantedBug,
) -> Result<blizzard_volume::Volume, blizzard_volume::VolumeError> {
    let give_up = env.now() + Duration::from_secs(30);
    let mut told = false;
    loop {
        match manage::open_with(env.clone(), client, name, plant).await {
            Err(blizzard_volume::VolumeError::Held { holder, remaining, .. }) if env.now() < give_up => {
                if !told {
                    eprintln!(
                        "volume {name:?} is held by {holder} (an earlier run that did not stop cleanly, or another client); waiting up to {:.0} s for its lease to end",
                        remaining.as_secs_f64().ceil()
                    );
                    told = true;
                }
                env.sleep(Duration::from_millis(250)).await;
            }
            r => return r,
        }
    }
}

/// Logs how far the background zero-fill of new disk files has got, every
/// few seconds until it is done (nothing when no disk is new, and nothing
/// more once the cluster has stopped for a hand-over).
async fn report_zero_fill(env: &Env, backing: &up_backing::UpBacking) {
    let Some(total) = backing.disks_preparing_left().await.filter(|t| *t > 0) else { return };
    loop {
        env.sleep(Duration::from_secs(5)).await;
        let Some(left) = backing.disks_preparing_left().await else { return };
        if left == 0 {
            tracing::info!("new disks zero-filled");
            return;
        }
        tracing::info!(
            "zero-filling new disks: {:.0}% done, {} to go",
            100.0 * (total.saturating_sub(left)) as f64 / total as f64,
            format_size(left)
        );
    }
}

/// Waits for Ctrl-C or SIGTERM.
async fn wait_for_stop_signal() -> Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
        _ = term.recv() => {}
    }
    Ok(())
}

/// How to reach an export, for people.
fn print_connect(addr: &str, export: &str, tls: Option<&TlsHint>) {
    let uri = match addr.strip_prefix("unix:") {
        Some(path) => format!("nbd+unix:///{export}?socket={path}"),
        None => format!("nbd://{addr}/{export}"),
    };
    println!("NBD export {export:?} at {addr}:");
    if let Some(t) = tls {
        println!("  over TLS:     nbdinfo {}", t.uri(addr, export));
        if t.required {
            println!("  (TLS required: plain clients are refused)");
            return;
        }
    }
    println!("  inspect:      nbdinfo {uri}");
    println!("  copy in/out:  qemu-img convert -n -O raw IMAGE {uri}   |   nbdcopy {uri} OUT.img");
    println!("  a VM's disk:  qemu-system-x86_64 -drive file={uri},format=raw,cache=none ...");
    println!("  kernel:       nbdfuse DIR {uri} &  then  losetup --find --show --direct-io=on DIR/nbd");
}

fn run_crashcheck(
    cfg: &blizzard_crashcheck::CheckConfig,
    first: u64,
    crashes: u64,
    mode: CommitMode,
    flush: FlushPolicy,
    replication: u8,
) -> (u64, usize, u64, u64, u64, u64) {
    let mut violations = 0u64;
    let mut in_flight = 0usize;
    let mut snapshots = 0u64;
    let mut resized = 0u64;
    let mut deleted = 0u64;
    let mut rolled = 0u64;
    for i in 0..crashes {
        let s = first + i;
        let t = blizzard_crashcheck::trial(s, cfg);
        in_flight += t.in_flight_at_crash;
        snapshots += u64::from(t.snapshot_checked);
        resized += u64::from(t.resized);
        deleted += u64::from(t.deleted);
        rolled += u64::from(t.rolled_back);
        if let Some(v) = &t.violation {
            violations += 1;
            if violations <= 5 {
                println!(
                    "violation at seed {s}: {v}\n  replay: blizzard crashcheck --mode {} --flush {} --replication {replication} --crashes 1 --seed {s}",
                    mode.name(),
                    flush.name()
                );
            }
        }
        if (i + 1) % 1000 == 0 {
            eprintln!("{} crashes, {violations} violations", i + 1);
        }
    }
    (violations, in_flight, snapshots, resized, deleted, rolled)
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

/// Nothing left to happen by itself: every row whole, and no member silent
/// but not yet declared dead (it will come back or be replaced).
fn settled(s: &ClusterStatus) -> bool {
    s.fully_replicated() && s.members.iter().all(|m| m.alive || m.dead || m.rows == 0)
}

/// A progress bar over the tracts the copying members have to copy, with
/// the copy rate in bytes; returns once the cluster is settled.
async fn watch_recovery(env: &Env, client: &Client) -> Result<()> {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg}\n[{elapsed_precise}] [{wide_bar}] {pos}/{len} tracts, ETA {eta}",
        )
        .context("progress bar template")?
        .progress_chars("=> "),
    );
    let mut last: Option<(blizzard_env::Instant, u64)> = None;
    let mut rate = 0.0;
    loop {
        let s = client.cluster_status().await?;
        if settled(&s) {
            bar.finish_and_clear();
            return Ok(());
        }
        let live = s.members.iter().filter(|m| m.alive);
        let (done, total, bytes) = live.fold((0, 0, 0), |(d, t, b), m| {
            (d + m.fill.tracts_done, t + m.fill.tracts_total, b + m.fill.bytes_done)
        });
        let now = env.now();
        if let Some((t, b)) = last {
            let secs = now.duration_since(t).as_secs_f64();
            if secs > 0.0 && bytes >= b {
                // Smoothed: one slow poll should not swing the figure.
                rate = 0.7 * rate + 0.3 * (bytes - b) as f64 / secs;
            }
        }
        last = Some((now, bytes));
        bar.set_length(total.max(done));
        bar.set_position(done);
        let silent = s.members.iter().filter(|m| !m.alive && !m.dead && m.rows > 0).count();
        bar.set_message(if s.fully_replicated() {
            format!("{silent} tractservers silent; waiting for them to return or be declared dead")
        } else {
            format!(
                "re-replicating {} rows ({} waiting for a replacement) at {}/s",
                s.rows_filling,
                s.rows_degraded,
                format_size(rate as u64)
            )
        });
        env.sleep(Duration::from_millis(500)).await;
    }
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
    if !s.sections.is_empty() {
        let parts: Vec<String> =
            s.sections.iter().map(|x| format!("{} {} rows", x.placement, x.len)).collect();
        println!("placements: {}", parts.join(", "));
    }
    if s.fully_replicated() {
        println!("replication: every row has all {} members alive and complete", s.replication);
    } else {
        let copying: Vec<_> = s.members.iter().filter(|m| m.fill.rows > 0).collect();
        let (done, total) =
            copying.iter().fold((0, 0), |(d, t), m| (d + m.fill.tracts_done, t + m.fill.tracts_total));
        println!(
            "replication: {} rows being re-replicated ({done}/{total} tracts copied so far), {} rows waiting for a dead member to be replaced",
            s.rows_filling, s.rows_degraded
        );
    }
    println!(
        "{:<34} {:<22} {:<10} {:<10} {:<6} {:>7} {:>9} {:>9} {:>12} {:>12}  COPYING",
        "TRACTSERVER", "ADDRESS", "DOMAIN", "DISK", "STATE", "ROWS", "PRIMARY", "TRACTS", "USED", "CAPACITY"
    );
    for m in &s.members {
        let used = m.slots_used * s.tract_size as u64;
        let cap = m.slots_total * s.tract_size as u64;
        let state = if m.dead {
            "dead"
        } else if m.alive {
            "up"
        } else {
            "down"
        };
        // A backup journal's use, after the disk's class (design 0009).
        let disk = match m.journal_used.saturating_mul(100).checked_div(m.journal_bytes) {
            Some(pct) => format!("{}+j {pct}%", m.class.name()),
            None => m.class.name().to_string(),
        };
        let copying = if m.fill.rows > 0 {
            format!(
                "{} rows, {}/{} tracts, {} copied",
                m.fill.rows,
                m.fill.tracts_done,
                m.fill.tracts_total,
                format_size(m.fill.bytes_done)
            )
        } else {
            String::new()
        };
        println!(
            "{:<34} {:<22} {:<10} {:<10} {:<6} {:>7} {:>9} {:>9} {:>12} {:>12}  {}",
            m.id.to_string(),
            m.addr,
            // A server without a failure domain of its own is its own one.
            if m.domain == m.id.to_string() { "(own)" } else { m.domain.as_str() },
            disk,
            state,
            m.rows,
            m.primaries,
            m.slots_used,
            format_size(used),
            format_size(cap),
            copying
        );
    }
    if !s.leases.is_empty() {
        // Volumes held for writing (design 0007), by blob id: `blizzard
        // volume info NAME` shows one volume's holder by name.
        println!();
        println!("{:<34} {:<40} {:>8} {:>10}", "VOLUME BLOB HELD", "HOLDER", "TOKEN", "LEASE");
        for l in &s.leases {
            println!(
                "{:<34} {:<40} {:>8} {:>9.1}s",
                l.blob.to_string(),
                l.holder,
                l.token,
                l.remaining_ms as f64 / 1000.0
            );
        }
    }
}
