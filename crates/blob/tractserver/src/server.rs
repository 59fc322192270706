//! Start-up and the tractserver's life: open (or format) the disk, rebuild
//! tract metadata, listen, and heartbeat to the metadata server with
//! capacity, load and the stored TLT assignment (from which a restarted
//! metadata server rebuilds the table, FDS §2.2).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blizzard_core::{DiskClass, TsId};
use blizzard_env::{DiskModel, Env};
use blizzard_proto::codec::decode;
use blizzard_proto::{Assignment, ClusterParams, ErrorCode, Heartbeat, HeartbeatAction, Reply, Request};
use blizzard_rpc::{serve, MetaService, ServerLimits, ServerTasks, Shutdown, ShutdownHandle};

use crate::layout::LayoutError;
use crate::rows::{Standing, Turn};
use crate::service::{RowIndex, TractService};
use crate::store::{Store, StoreError};

#[derive(Clone, Debug)]
pub struct TractServerConfig {
    /// The disk: a block device or a file.
    pub disk: PathBuf,
    /// Create the disk file with this many bytes if it does not exist.
    pub disk_size: Option<u64>,
    /// Address to listen on (`host:port`; port 0 picks one).
    pub listen: String,
    /// Address to tell the metadata server (defaults to the bound address).
    pub advertise: Option<String>,
    /// The metadata service: `ADDR[,ADDR...]`, every replica.
    pub meta: String,
    pub failure_domain: String,
    /// The kind of disk this is, as the operator declares it (`--class`):
    /// the hybrid tier places primaries on ssd and backups on hdd.
    pub class: DiskClass,
    pub heartbeat_interval: Duration,
    pub request_timeout: Duration,
    /// A slower disk than the real one, modelled on top of it (latency,
    /// arms, bandwidth; `blizzard_env::DiskModel`): benchmarks only.
    pub disk_model: Option<DiskModel>,
    /// Bytes per second copied when re-replicating rows (0: no limit).
    pub fill_bandwidth: u64,
    /// Bytes per second the scrubber re-reads and checks (0: off).
    pub scrub_bandwidth: u64,
    /// Where to serve Prometheus metrics over HTTP (`GET /metrics`), if anywhere.
    pub metrics_listen: Option<String>,
    pub limits: ServerLimits,
    /// Bytes of the chunk-entry journal's ring when the disk is formatted
    /// (`None`: the default for its size, `layout::journal_len_for`). The
    /// simulator gives its small disks a tiny ring, so checkpoints and
    /// crashes inside them happen all the time.
    pub journal_len: Option<u64>,
    /// A backup journal on fast storage in front of this disk (the hybrid
    /// tier: `crate::backup`): small writes are durable once in it.
    pub journal: Option<JournalConfig>,
    /// A bug planted on purpose (simulator and tests only).
    #[doc(hidden)]
    pub planted_bug: crate::store::PlantedBug,
}

/// Where a tractserver's backup journal lives and what it takes.
#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// A file or block device on fast storage.
    pub path: PathBuf,
    /// Create the file with this many bytes if it does not exist.
    pub create_size: Option<u64>,
    /// Writes of at most this many bytes are journaled; larger ones go to
    /// the disk directly (Ursa's bypass threshold).
    pub bypass: u32,
    /// The data disk is brought up to date at least this often while the
    /// journal holds anything (and whenever it is a quarter full).
    pub destage_interval: Duration,
    /// A second area (a file or device) that takes journal records while
    /// the first is full, instead of sending small writes to the slow
    /// disk at random places: more fast storage, or a file on the data
    /// disk itself, where appends are sequential (`backup::attach`).
    pub second_area: Option<PathBuf>,
    /// Create the second area's file with this many bytes if it does not
    /// exist (`None`: as `create_size`).
    pub second_area_size: Option<u64>,
}

impl JournalConfig {
    pub fn new(path: impl Into<PathBuf>) -> JournalConfig {
        JournalConfig {
            path: path.into(),
            create_size: Some(1 << 30),
            bypass: 64 << 10,
            destage_interval: Duration::from_secs(2),
            second_area: None,
            second_area_size: None,
        }
    }
}

impl TractServerConfig {
    pub fn new(disk: impl Into<PathBuf>, listen: impl Into<String>, meta: impl Into<String>) -> Self {
        TractServerConfig {
            disk: disk.into(),
            disk_size: None,
            listen: listen.into(),
            advertise: None,
            meta: meta.into(),
            failure_domain: String::new(),
            class: DiskClass::Ssd,
            heartbeat_interval: Duration::from_millis(500),
            request_timeout: Duration::from_secs(10),
            disk_model: None,
            fill_bandwidth: 0,
            scrub_bandwidth: 0,
            metrics_listen: None,
            limits: ServerLimits::default(),
            journal_len: None,
            journal: None,
            planted_bug: crate::store::PlantedBug::None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TractServerError {
    #[error("cannot open disk {path}: {error}")]
    Disk { path: String, error: std::io::Error },
    #[error("disk {path}: {error}")]
    Store { path: String, error: StoreError },
    #[error("cannot listen on {addr}: {error}")]
    Bind { addr: String, error: std::io::Error },
    #[error("the stored TLT assignment on {0} is unreadable; the disk may be damaged")]
    BadAssignment(String),
    #[error("{0}")]
    Config(String),
    #[error("backup journal {path}: {error}")]
    Journal { path: String, error: String },
}

/// A running tractserver.
pub struct TractServerHandle {
    pub id: TsId,
    /// The address peers dial.
    pub addr: String,
    pub service: Arc<TractService>,
    tasks: ServerTasks,
    /// Why the metadata service refused this server for good, once it has
    /// (its certificate's role: `Forbidden`); heartbeats stop then.
    refused: tokio::sync::oneshot::Receiver<String>,
}

impl TractServerHandle {
    /// Stops accepting, closes connections and stops heartbeating. Requests
    /// already running finish on their own.
    pub async fn stop(self) {
        self.tasks.stop().await;
    }

    /// Runs until the server's tasks end (they do not, short of shutdown).
    pub async fn wait(self) {
        self.tasks.wait().await;
    }

    /// Resolves once the metadata service has refused this server for
    /// good (an authenticated cluster where its certificate's role may
    /// not register), with the refusal; never otherwise.
    pub async fn refused(&mut self) -> String {
        match (&mut self.refused).await {
            Ok(why) => why,
            Err(_) => std::future::pending().await,
        }
    }
}

/// Opens the disk, formats it if new (asking the metadata server for the
/// cluster's tract size), and starts serving and heartbeating.
pub async fn start(env: Env, cfg: TractServerConfig) -> Result<TractServerHandle, TractServerError> {
    let path = cfg.disk.display().to_string();
    let mut meta = MetaService::parse(&env, &cfg.meta).map_err(TractServerError::Config)?;
    // A replica that does not answer within a heartbeat interval or so is
    // passed over for the next: the heartbeat that renews the lease must
    // find the new leader well within the lease.
    meta.attempt_timeout =
        (cfg.heartbeat_interval * 2).clamp(Duration::from_millis(200), Duration::from_secs(2));
    let meta = Arc::new(meta);
    let disk = env
        .open_disk(&cfg.disk, cfg.disk_size)
        .await
        .map_err(|error| TractServerError::Disk { path: path.clone(), error })?;
    let disk = match &cfg.disk_model {
        Some(model) => model.wrap(&env, disk),
        None => disk,
    };
    let store = match Store::open(disk.clone()).await {
        Ok(s) => s,
        Err(StoreError::Layout(LayoutError::Unformatted)) => {
            let params = cluster_params(&env, &meta).await;
            tracing::info!(disk = %path, tract_size = params.tract_size, "formatting new disk");
            let id = TsId(env.random_u128());
            // A slow disk behind a backup journal gets a chunk-entry ring
            // as deep as that journal (`layout::journal_len_behind_backup`).
            let backup = cfg.journal.as_ref().and_then(|j| j.create_size);
            let journal_len = cfg.journal_len.or_else(|| {
                backup.map(|b| crate::layout::journal_len_behind_backup(params.tract_size, disk.len(), b))
            });
            Store::format_with(disk, id, params.tract_size, env.clock.as_ref(), journal_len)
                .await
                .map_err(|error| TractServerError::Store { path: path.clone(), error })?
        }
        Err(error) => return Err(TractServerError::Store { path, error }),
    };
    store.plant_bug(cfg.planted_bug);
    if let Some(jc) = &cfg.journal {
        crate::backup::attach::attach_journal(&env, &store, jc).await?;
    }
    let store = Arc::new(store);
    let me = store.disk_id();
    let assignment = match store.assignment().await {
        Some(b) => decode::<Assignment>(&b).map_err(|_| TractServerError::BadAssignment(path.clone()))?,
        None => Assignment::default(),
    };
    let service = TractService::new(
        env.clone(),
        store.clone(),
        meta,
        RowIndex::new(me, assignment.clone()),
        cfg.request_timeout,
        cfg.fill_bandwidth,
        cfg.scrub_bandwidth,
    );
    // Rows this server was still copying when it stopped: copied again.
    service.fill.update(me, &assignment);
    // Nothing is served before the metadata server has answered a
    // heartbeat: this server may have been declared dead while it was down.
    service.update_standing(|s| *s = Standing::awaiting(env.now()));
    let service = Arc::new(service);
    let metas =
        service.load_metas().await.map_err(|error| TractServerError::Store { path: path.clone(), error })?;

    let listener = env
        .bind(&cfg.listen)
        .await
        .map_err(|error| TractServerError::Bind { addr: cfg.listen.clone(), error })?;
    let addr = cfg.advertise.clone().unwrap_or_else(|| listener.local_addr());
    let (slots, used) = store.usage();
    tracing::info!(id = %me, %addr, slots, used, blobs = metas, "tractserver serving");

    let (shutdown, rx) = ShutdownHandle::new();
    let metrics = match &cfg.metrics_listen {
        Some(m) => {
            Some(env.bind_plain(m).await.map_err(|error| TractServerError::Bind { addr: m.clone(), error })?)
        }
        None => None,
    };
    let journal = cfg.journal.clone();
    let (refused_tx, refused) = tokio::sync::oneshot::channel();
    let mut tasks = vec![
        tokio::spawn(serve(
            env.clone(),
            listener,
            authorized(service.clone()),
            cfg.limits.clone(),
            rx.clone(),
        )),
        tokio::spawn(heartbeat_loop(env.clone(), service.clone(), cfg, addr.clone(), rx.clone(), refused_tx)),
        tokio::spawn(service.fill.clone().fill_loop(rx.clone())),
        tokio::spawn(service.scrub.clone().scrub_loop(rx.clone())),
        tokio::spawn({
            // Checkpoints of the chunk-entry journal, started at half full
            // so writes rarely wait for room (`store::journal`).
            let store = service.store.clone();
            let mut rx = rx.clone();
            async move {
                tokio::select! {
                    biased;
                    _ = rx.wait() => {}
                    _ = store.checkpoint_loop() => {}
                }
            }
        }),
    ];
    // The chunk-entry ring into the page cache, once the disk's zero-fill
    // is done (`Store::prefetch_journal`): now, or from a task waiting for
    // it (only a new real disk file has one; the simulator's never do).
    if service.store.disk_preparing_left() == 0 {
        service.store.prefetch_journal();
    } else {
        let (store, env) = (service.store.clone(), env.clone());
        let mut rx = rx.clone();
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                biased;
                _ = rx.wait() => {}
                _ = async {
                    while store.disk_preparing_left() > 0 {
                        env.sleep(Duration::from_millis(500)).await;
                    }
                    store.prefetch_journal();
                } => {}
            }
        }));
    }
    if let Some(jc) = &journal {
        // Journaled writes reach the data disk (`store::backup`).
        let (store, env, interval) = (service.store.clone(), env.clone(), jc.destage_interval);
        let mut rx = rx.clone();
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                biased;
                _ = rx.wait() => {}
                _ = store.destage_loop(&env, interval) => {}
            }
        }));
    }
    if let Some(l) = metrics {
        tracing::info!(addr = %l.local_addr(), "metrics at /metrics");
        let s = service.clone();
        let mut rx = rx;
        tasks.push(tokio::spawn(blizzard_metrics::serve(
            env.clone(),
            l,
            Arc::new(move || s.metrics_text()),
            async move { rx.wait().await },
        )));
    }
    Ok(TractServerHandle { id: me, addr, service, tasks: ServerTasks::new(shutdown, tasks), refused })
}

/// Asks the metadata service for the cluster's parameters, waiting for it.
async fn cluster_params(env: &Env, meta: &MetaService) -> ClusterParams {
    let mut warned = false;
    loop {
        match meta.call(&Request::ClusterParams, Duration::from_secs(5)).await {
            Ok((Reply::ClusterParams(p), _, _)) => return p,
            Ok(_) => tracing::warn!("metadata server sent an unexpected reply to ClusterParams"),
            Err(e) if !warned => {
                tracing::warn!(meta = %meta.describe(), error = %e, "waiting for the metadata service before formatting the disk");
                warned = true;
            }
            Err(_) => {}
        }
        env.sleep(Duration::from_millis(500)).await;
    }
}

async fn heartbeat_loop(
    env: Env,
    service: Arc<TractService>,
    cfg: TractServerConfig,
    addr: String,
    mut shutdown: Shutdown,
    refused: tokio::sync::oneshot::Sender<String>,
) {
    let mut interval = cfg.heartbeat_interval;
    let mut failing = false;
    // The assignment rides on the first heartbeat to each metadata leader
    // (a new one judges it; a restarted single server rebuilds the TLT
    // from it) and whenever the metadata server asks; otherwise
    // heartbeats stay a few dozen bytes.
    let mut send_assignment = true;
    let mut leader: Option<String> = None;
    let meta = service.peers.meta.clone();
    loop {
        let (slots_total, slots_used) = service.store.usage();
        let rows = service.row_index();
        let (filled, fill) = service.fill.report();
        // Both areas of the backup journal, as one (`blizzard status`).
        let (journal_used, journal_bytes) =
            [service.store.backup_journal(), service.store.backup_second_area()]
                .into_iter()
                .flatten()
                .fold((0, 0), |(u, b), j| (u + j.used(), b + j.ring_len()));
        let stored = (rows.assignment.cluster_id != 0).then_some(rows.assignment);
        let heartbeat = |to: &str| {
            Request::Heartbeat(Heartbeat {
                ts_id: service.store.disk_id(),
                addr: addr.clone(),
                domain: cfg.failure_domain.clone(),
                tract_size: service.store.tract_size(),
                slots_total,
                slots_used,
                load: service.inflight.load(Ordering::Relaxed),
                disk_mbps: service.store.disk_mbps(),
                // To a replica other than the one that answered the last
                // heartbeat (a new leader, which judges it: not asked for,
                // since the request that asks went to the old one), and
                // whenever asked.
                assignment: stored.clone().filter(|_| send_assignment || leader.as_deref() != Some(to)),
                filled: filled.clone(),
                fill,
                class: cfg.class,
                journal_used,
                journal_bytes,
            })
        };
        // The lease counts from the sending: the metadata server's
        // silence clock started no earlier than that.
        let sent = env.now();
        // Bounded: the heartbeat is what restores the lease, and the next
        // one must go out on time.
        match meta.call_with(heartbeat, cfg.request_timeout.min(interval * 4)).await {
            Ok((Reply::Heartbeat(r), _, from)) => {
                if failing {
                    tracing::info!(meta = %from, "metadata service reachable again");
                    failing = false;
                }
                if leader.as_deref() != Some(from.as_str()) {
                    if leader.is_some() {
                        tracing::info!(meta = %from, "metadata leader moved");
                    }
                    leader = Some(from);
                }
                interval = Duration::from_millis(r.interval_ms.clamp(10, 60_000) as u64);
                send_assignment = r.send_assignment;
                service.scope.newer_exists(r.scope_version);
                // A metadata server that serves a table says continue only
                // once this server's stored assignment is current (one
                // rebuilding its table asks for assignments instead).
                let stop = r.action == HeartbeatAction::StopServing;
                match service.update_standing(|s| s.answered(sent, r.lease_ms, stop, r.send_assignment)) {
                    Turn::Fenced => tracing::error!("the metadata server says this tractserver's rows are stale or given away; refusing requests until it sends the current assignment"),
                    Turn::Unfenced => tracing::info!(
                        "the metadata server says this tractserver's assignment is current; serving again"
                    ),
                    Turn::Unchanged => {}
                }
            }
            Ok(_) => tracing::warn!("unexpected heartbeat reply"),
            // Not transient: this certificate's role may not register
            // (design 0010). Heartbeats stop; the lease lapses.
            Err(e) if e.remote().is_some_and(|r| r.code == ErrorCode::Forbidden) => {
                tracing::error!(meta = %meta.describe(), error = %e, "the metadata service refuses this tractserver");
                let _ = refused.send(e.to_string());
                return;
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(meta = %meta.describe(), error = %e, "heartbeat failed");
                    failing = true;
                }
                // Whoever answers next may be a new leader: tell it.
                send_assignment = true;
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.wait() => return,
            _ = env.sleep(interval) => {}
        }
    }
}

/// The service as peers reach it: on an authenticated cluster, each
/// request runs only if the peer's role may send it
/// (`blizzard_proto::authz`: copies and the blob two-phase commit only from
/// tractservers, row assignments only from the metadata service) and on
/// the volumes its certificate's scope allows (`blizzard_proto::scope`,
/// the table in `crate::scope`).
fn authorized(service: Arc<TractService>) -> Arc<dyn blizzard_rpc::Service> {
    if service.store.planted(crate::PlantedBug::NoScopeCheck) {
        return blizzard_rpc::authz::Authorized::wrap(service, blizzard_proto::authz::allows, "tractserver");
    }
    let scope = service.scope.clone();
    blizzard_rpc::authz::Scoped::wrap(service, scope, "tractserver")
}
