//! An embedded cluster: the metadata service (one server, or a group of
//! replicas) and N tractservers in this process, each tractserver on its
//! own disk file under a data directory, all on loopback. It is what
//! `blizzard up` runs and what integration tests stand on. Data survives
//! a restart: the disks keep the tracts and the TLT positions; a single
//! metadata server rebuilds the table from them, a group keeps it in its
//! replicas' logs (`DATA/meta-N/`).

use std::path::PathBuf;
use std::time::Duration;

use blizzard_client::{Client, ClientConfig, ClientError};
use blizzard_core::limits::TRACT_SIZE_DEFAULT;
use blizzard_env::{DiskModel, Env};
use blizzard_metaserver::replica::{GroupConfig, Timing};
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
    /// Where the metadata server listens (port 0 picks a free one). With
    /// several replicas, replica i listens on the port after replica
    /// i-1's, or, for port 0, on unix sockets in the data directory.
    pub meta_listen: String,
    /// Metadata replicas (1: a single server, no group).
    pub meta_replicas: usize,
    /// Host the tractservers listen on (each on a free port).
    pub host: String,
    /// Tractservers listen on unix sockets in the data directory instead
    /// (`ts-N.sock`): everything is on this machine, and a unix socket
    /// costs less per message than TCP loopback.
    pub unix_sockets: bool,
    pub heartbeat_interval: Duration,
    /// Each tractserver's disk, modelled slower than the real one
    /// (`blizzard_env::DiskModel`; benchmarks). The transfer rate is shared:
    /// `DiskModel::set_bandwidth` on this changes every tractserver's.
    pub disk_model: Option<DiskModel>,
    /// Per tractserver, bytes per second copied while re-replicating.
    pub fill_bandwidth: u64,
    /// Per tractserver, bytes per second the scrubber checks (0: off).
    pub scrub_bandwidth: u64,
    /// How many tractservers (the last ones) are of class hdd, with
    /// `hdd_model` as their disk and a backup journal of `journal_size`
    /// each (design 0009); the others are ssd. A cluster of both classes
    /// gets sections for placements ssd, hdd and hybrid. Zero, with a
    /// `journal_size`, makes every tractserver hdd with a journal.
    pub hdd_tractservers: usize,
    /// The hdd tractservers' disk model (`None`: the real disk).
    pub hdd_model: Option<DiskModel>,
    /// Hdd tractservers each get a backup journal of this many bytes
    /// beside their disk (`ts-N.journal`).
    pub journal_size: Option<u64>,
    /// And a second journal area of this many bytes beside it
    /// (`ts-N.journal2`), taking records while the journal is full (0:
    /// none).
    pub journal_second_size: u64,
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
            meta_replicas: 1,
            host: "127.0.0.1".into(),
            unix_sockets: false,
            heartbeat_interval: Duration::from_millis(200),
            disk_model: None,
            fill_bandwidth: 0,
            scrub_bandwidth: 0,
            hdd_tractservers: 0,
            hdd_model: None,
            journal_size: None,
            journal_second_size: 0,
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
    /// One per replica; `None` while stopped.
    metas: Vec<Option<MetaHandle>>,
    /// Each replica's address, stable across restarts.
    meta_addrs: Vec<String>,
    /// The metadata service as `--meta` takes it: every replica's address.
    pub meta_addr: String,
    tractservers: Vec<Option<TractServerHandle>>,
}

impl Cluster {
    /// Starts the metadata service and every tractserver, then waits until
    /// the TLT is built (or rebuilt from the disks) and served.
    pub async fn start(env: Env, cfg: ClusterConfig) -> Result<Cluster, ClusterError> {
        let meta_addrs = Self::meta_addrs(&cfg)?;
        let n = meta_addrs.len();
        let mut c = Cluster {
            env,
            cfg,
            metas: (0..n).map(|_| None).collect(),
            meta_addr: meta_addrs.join(","),
            meta_addrs,
            tractservers: Vec::new(),
        };
        for i in 0..n {
            c.start_meta_replica(i).await?;
        }
        if n == 1 {
            // The address actually bound (port 0 picks one).
            let addr = c.metas[0].as_ref().map(|m| m.addr.clone()).unwrap_or_default();
            c.meta_addrs = vec![addr.clone()];
            c.meta_addr = addr;
        }
        for i in 0..c.cfg.tractservers {
            c.tractservers.push(None);
            c.start_tractserver(i).await?;
        }
        c.wait_ready(Duration::from_secs(60)).await?;
        Ok(c)
    }

    /// Where each replica listens (`ClusterConfig::meta_listen`).
    fn meta_addrs(cfg: &ClusterConfig) -> Result<Vec<String>, ClusterError> {
        let n = cfg.meta_replicas.max(1);
        if n == 1 {
            return Ok(vec![cfg.meta_listen.clone()]);
        }
        let bad = |why: &str| {
            ClusterError::Meta(MetaError::Config(format!(
                "{} metadata replicas on {}: {why}",
                n, cfg.meta_listen
            )))
        };
        let (host, port) = cfg.meta_listen.rsplit_once(':').ok_or_else(|| bad("give HOST:PORT"))?;
        let port: u16 = port.parse().map_err(|_| bad("give HOST:PORT"))?;
        if port == 0 {
            let addrs: Vec<String> = (1..=n)
                .map(|i| format!("unix:{}", cfg.data_dir.join(format!("meta-{i}.sock")).display()))
                .collect();
            if addrs.iter().any(|a| a.len() >= 105) {
                return Err(bad("the data directory's path is too long for a unix socket; give a port"));
            }
            return Ok(addrs);
        }
        (0..n)
            .map(|i| {
                let p = port.checked_add(i as u16).ok_or_else(|| bad("ports past 65535"))?;
                Ok(format!("{host}:{p}"))
            })
            .collect()
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

    /// Starts (or restarts) metadata replica `i` (from 0).
    pub async fn start_meta_replica(&mut self, i: usize) -> Result<(), ClusterError> {
        let mut m = Self::meta_config(&self.cfg, &self.meta_addrs[i]);
        if self.meta_addrs.len() == 1 {
            // Access lists and revocations outlive a restart (design 0010).
            m.solo_data = Some(self.cfg.data_dir.join("meta"));
        } else {
            m.group = Some(GroupConfig {
                id: i as u64 + 1,
                peers: self.meta_addrs.iter().enumerate().map(|(j, a)| (j as u64 + 1, a.clone())).collect(),
                data_dir: self.cfg.data_dir.join(format!("meta-{}", i + 1)),
                timing: Timing::default(),
            });
        }
        self.metas[i] = Some(meta::start(self.env.clone(), m).await?);
        Ok(())
    }

    /// Stops metadata replica `i` (its log stays).
    pub async fn stop_meta_replica(&mut self, i: usize) {
        if let Some(m) = self.metas.get_mut(i).and_then(|m| m.take()) {
            m.stop().await;
        }
    }

    /// The replica that leads (a single server always does), if any.
    pub fn meta_leader(&self) -> Option<usize> {
        self.metas.iter().position(|m| m.as_ref().is_some_and(|m| m.server.is_leader()))
    }

    /// Metadata replica `i` (from 0), while it runs.
    pub fn meta_replica(&self, i: usize) -> Option<&MetaHandle> {
        self.metas.get(i).and_then(|m| m.as_ref())
    }

    pub fn meta_replicas(&self) -> usize {
        self.metas.len()
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

    /// The leading metadata replica (or the single server while it runs).
    pub fn meta(&self) -> Option<&MetaHandle> {
        match self.meta_leader() {
            Some(i) => self.metas[i].as_ref(),
            None => self.metas.iter().flatten().next(),
        }
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
        t.disk_model = self.cfg.disk_model.clone();
        t.fill_bandwidth = self.cfg.fill_bandwidth;
        t.scrub_bandwidth = self.cfg.scrub_bandwidth;
        let hdd = match self.cfg.hdd_tractservers {
            0 => self.cfg.journal_size.is_some(),
            n => i + n >= self.cfg.tractservers,
        };
        if hdd {
            t.class = blizzard_core::DiskClass::Hdd;
            if self.cfg.hdd_tractservers > 0 {
                t.disk_model = self.cfg.hdd_model.clone();
            }
            if let Some(size) = self.cfg.journal_size {
                let mut jc = ts::JournalConfig::new(self.cfg.data_dir.join(format!("ts-{i}.journal")));
                jc.create_size = Some(size);
                if self.cfg.journal_second_size > 0 {
                    jc.second_area = Some(self.cfg.data_dir.join(format!("ts-{i}.journal2")));
                    jc.second_area_size = Some(self.cfg.journal_second_size);
                }
                t.journal = Some(jc);
            }
        }
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

    /// Stops every metadata replica and starts them again on the same
    /// addresses: a single server rebuilds the TLT from the tractservers'
    /// reports, a group from its logs.
    pub async fn restart_meta(&mut self) -> Result<(), ClusterError> {
        for i in 0..self.metas.len() {
            self.stop_meta_replica(i).await;
        }
        for i in 0..self.metas.len() {
            self.start_meta_replica(i).await?;
        }
        Ok(())
    }

    /// Waits until the metadata server serves a TLT and every running
    /// tractserver has reported to it.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = self.env.now() + timeout;
        loop {
            let (ready, why) = match self.meta_leader().and_then(|i| self.metas[i].as_ref()) {
                None => (false, "no metadata replica leads".to_string()),
                Some(m) => {
                    let s = m.server.status();
                    let tlt = m.server.tlt();
                    // Alive, in the table, and at the address it listens on
                    // now (a restarted tractserver may have moved).
                    let not_ready: Vec<String> = self
                        .tractservers
                        .iter()
                        .flatten()
                        .filter_map(|t| {
                            let alive = s.members.iter().any(|mm| mm.id == t.id && mm.alive && mm.rows > 0);
                            let listed = tlt.as_ref().is_some_and(|tlt| {
                                tlt.member_index(t.id).is_some_and(|i| tlt.members[i as usize].addr == t.addr)
                            });
                            (!alive || !listed).then(|| {
                                format!(
                                    "{} at {}: {}",
                                    t.id,
                                    t.addr,
                                    if alive { "old address in the TLT" } else { "not alive with rows" }
                                )
                            })
                        })
                        .collect();
                    (
                        s.phase == "ready" && not_ready.is_empty(),
                        format!(
                            "phase {}, {} members; waiting for {}",
                            s.phase,
                            s.members.len(),
                            not_ready.join("; ")
                        ),
                    )
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
        self.client_with(|_| {}).await
    }

    /// A client of this cluster, configured by `tune` first.
    pub async fn client_with(&self, tune: impl FnOnce(&mut ClientConfig)) -> Result<Client, ClusterError> {
        let mut cfg = ClientConfig::new(self.meta_addr.clone());
        tune(&mut cfg);
        Ok(Client::connect(self.env.clone(), cfg).await?)
    }

    pub async fn stop(mut self) {
        for i in 0..self.tractservers.len() {
            self.stop_tractserver(i).await;
        }
        for i in 0..self.metas.len() {
            self.stop_meta_replica(i).await;
        }
    }
}
