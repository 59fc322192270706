//! An embedded cluster: one metadata server and N tractservers in this
//! process, each tractserver on its own disk file under a data directory,
//! all on loopback. It is what `blizzard up` runs and what integration
//! tests stand on. Data survives a restart: the disks keep the tracts and
//! the TLT positions, and the metadata server rebuilds the table from them.

use std::path::PathBuf;
use std::time::Duration;

use blizzard_client::{Client, ClientConfig, ClientError};
use blizzard_core::limits::TRACT_SIZE_DEFAULT;
use blizzard_env::Env;
use blizzard_metaserver::server::{self as meta, MetaConfig, MetaError, MetaHandle};
use blizzard_tractserver::{self as ts, TractServerConfig, TractServerError, TractServerHandle};

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub data_dir: PathBuf,
    pub tractservers: usize,
    /// The cluster's maximum replication level (members per TLT row).
    pub replication: u8,
    pub tract_size: u32,
    /// Size of each tractserver's disk file, allocated when first created.
    pub disk_size: u64,
    /// Where the metadata server listens (port 0 picks a free one).
    pub meta_listen: String,
    /// Host the tractservers listen on (each on a free port).
    pub host: String,
    /// Tractservers listen on unix sockets in the data directory instead
    /// (`ts-N.sock`): everything is on this machine, and a unix socket
    /// costs less per message than TCP loopback.
    pub unix_sockets: bool,
    pub heartbeat_interval: Duration,
    /// Delay injected into each tract read and write (benchmarks).
    pub io_delay: Duration,
    /// Requests each tractserver serves through the delay at once (0: no limit).
    pub io_arms: u32,
    /// Bytes per second each tractserver's injected disk transfers (0: no limit).
    pub io_bandwidth: u64,
    /// Per tractserver, bytes per second copied while re-replicating.
    pub fill_bandwidth: u64,
    /// Per tractserver, bytes per second the scrubber checks (0: off).
    pub scrub_bandwidth: u64,
}

impl ClusterConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        ClusterConfig {
            data_dir: data_dir.into(),
            tractservers: 4,
            replication: 1,
            tract_size: TRACT_SIZE_DEFAULT,
            disk_size: 2 << 30,
            meta_listen: "127.0.0.1:0".into(),
            host: "127.0.0.1".into(),
            unix_sockets: false,
            heartbeat_interval: Duration::from_millis(200),
            io_delay: Duration::ZERO,
            io_arms: 0,
            io_bandwidth: 0,
            fill_bandwidth: 0,
            scrub_bandwidth: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("metadata server: {0}")]
    Meta(#[from] MetaError),
    #[error("tractserver {index}: {error}")]
    TractServer { index: usize, error: TractServerError },
    #[error("the cluster did not become ready within {0:?}: {1}")]
    NotReady(Duration, String),
    #[error("client: {0}")]
    Client(#[from] ClientError),
}

pub struct Cluster {
    env: Env,
    pub cfg: ClusterConfig,
    meta: Option<MetaHandle>,
    /// The metadata server's address (stable across `restart_meta`).
    pub meta_addr: String,
    tractservers: Vec<Option<TractServerHandle>>,
}

impl Cluster {
    /// Starts the metadata server and every tractserver, then waits until
    /// the TLT is built (or rebuilt from the disks) and served.
    pub async fn start(env: Env, cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let meta = meta::start(env.clone(), Self::meta_config(&cfg, &cfg.meta_listen)).await?;
        let meta_addr = meta.addr.clone();
        let mut c = Cluster { env, cfg, meta: Some(meta), meta_addr, tractservers: Vec::new() };
        for i in 0..c.cfg.tractservers {
            c.tractservers.push(None);
            c.start_tractserver(i).await?;
        }
        c.wait_ready(Duration::from_secs(60)).await?;
        Ok(c)
    }

    fn meta_config(cfg: &ClusterConfig, listen: &str) -> MetaConfig {
        let mut m = MetaConfig::new(listen);
        m.tract_size = cfg.tract_size;
        m.replication = cfg.replication;
        m.init_tractservers = cfg.tractservers;
        m.heartbeat_interval = cfg.heartbeat_interval;
        m.dead_after = cfg.heartbeat_interval * 10;
        m.rebuild_grace = cfg.heartbeat_interval * 20;
        m
    }

    pub fn disk_path(&self, i: usize) -> PathBuf {
        self.cfg.data_dir.join(format!("ts-{i}.disk"))
    }

    /// Where tractserver `i` listens when `unix_sockets` is set; `None` also
    /// when the path would be too long for a socket address (108 bytes).
    fn socket_path(&self, i: usize) -> Option<PathBuf> {
        let p = self.cfg.data_dir.join(format!("ts-{i}.sock"));
        (self.cfg.unix_sockets && p.as_os_str().len() < 100).then_some(p)
    }

    pub fn tractserver(&self, i: usize) -> Option<&TractServerHandle> {
        self.tractservers.get(i).and_then(|t| t.as_ref())
    }

    pub fn tractserver_count(&self) -> usize {
        self.tractservers.len()
    }

    pub fn meta(&self) -> Option<&MetaHandle> {
        self.meta.as_ref()
    }

    /// Starts (or restarts) tractserver `i` on its disk.
    pub async fn start_tractserver(&mut self, i: usize) -> Result<(), ClusterError> {
        let listen = match self.socket_path(i) {
            Some(p) => format!("unix:{}", p.display()),
            None => format!("{}:0", self.cfg.host),
        };
        let mut t = TractServerConfig::new(self.disk_path(i), listen, self.meta_addr.clone());
        t.disk_size = Some(self.cfg.disk_size);
        t.failure_domain = format!("ts-{i}");
        t.heartbeat_interval = self.cfg.heartbeat_interval;
        t.io_delay = self.cfg.io_delay;
        t.io_arms = self.cfg.io_arms;
        t.io_bandwidth = self.cfg.io_bandwidth;
        t.fill_bandwidth = self.cfg.fill_bandwidth;
        t.scrub_bandwidth = self.cfg.scrub_bandwidth;
        let h = ts::start(self.env.clone(), t)
            .await
            .map_err(|error| ClusterError::TractServer { index: i, error })?;
        if self.tractservers.len() <= i {
            self.tractservers.resize_with(i + 1, || None);
        }
        self.tractservers[i] = Some(h);
        Ok(())
    }

    /// Stops tractserver `i` (its disk stays).
    pub async fn stop_tractserver(&mut self, i: usize) {
        if let Some(h) = self.tractservers.get_mut(i).and_then(|t| t.take()) {
            h.stop().await;
        }
    }

    /// Stops the metadata server and starts a fresh one on the same address;
    /// it rebuilds the TLT from the tractservers' reports.
    pub async fn restart_meta(&mut self) -> Result<(), ClusterError> {
        if let Some(m) = self.meta.take() {
            m.stop().await;
        }
        let listen = self.meta_addr.clone();
        self.meta = Some(meta::start(self.env.clone(), Self::meta_config(&self.cfg, &listen)).await?);
        Ok(())
    }

    /// Waits until the metadata server serves a TLT and every running
    /// tractserver has reported to it.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = self.env.now() + timeout;
        loop {
            let (ready, why) = match &self.meta {
                None => (false, "metadata server is stopped".to_string()),
                Some(m) => {
                    let s = m.server.status();
                    let running: Vec<_> = self.tractservers.iter().flatten().map(|t| t.id).collect();
                    let alive = running
                        .iter()
                        .all(|id| s.members.iter().any(|mm| mm.id == *id && mm.alive && mm.rows > 0));
                    (s.phase == "ready" && alive, format!("phase {}, {} members", s.phase, s.members.len()))
                }
            };
            if ready {
                return Ok(());
            }
            if self.env.now() >= deadline {
                return Err(ClusterError::NotReady(timeout, why));
            }
            self.env.sleep(Duration::from_millis(20)).await;
        }
    }

    /// Bytes of background work the running tractservers' disks still have
    /// ahead of them (new disk files are zero-filled once; see
    /// `Disk::preparing_left`).
    pub fn disks_preparing_left(&self) -> u64 {
        self.tractservers.iter().flatten().map(|t| t.service.store.disk_preparing_left()).sum()
    }

    /// Waits until no running tractserver's disk is busy with background
    /// work of its own: for benchmarks, which should not measure alongside
    /// it.
    pub async fn wait_disks_prepared(&self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = self.env.now() + timeout;
        while self.disks_preparing_left() > 0 {
            if self.env.now() >= deadline {
                return Err(ClusterError::NotReady(timeout, "disks still being zero-filled".into()));
            }
            self.env.sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// A client of this cluster.
    pub async fn client(&self) -> Result<Client, ClusterError> {
        Ok(Client::connect(self.env.clone(), ClientConfig::new(self.meta_addr.clone())).await?)
    }

    pub async fn stop(mut self) {
        for i in 0..self.tractservers.len() {
            self.stop_tractserver(i).await;
        }
        if let Some(m) = self.meta.take() {
            m.stop().await;
        }
    }
}
