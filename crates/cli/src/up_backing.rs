//! `blizzard up`'s embedded cluster as the storage its NBD server's
//! volumes live on, so an online upgrade (`blizzard_nbd::upgrade`, "A
//! server that owns its storage") can hand it to a successor: stopped by
//! the old process after every volume is released, started by the new one
//! before it opens them.
//!
//! Invariant: at most one process runs a data directory's cluster. Its
//! disks are plain files that nothing else guards, so [`UpBacking::start`]
//! takes an exclusive lock on `DATA/up.lock` before it opens any, and
//! [`UpBacking::stop`] lets go of it only after every server stopped. A
//! second `blizzard up` on the same directory is refused with that reason;
//! a successor waits for the lock while its predecessor shuts down.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_client::Client;
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_nbd::{ClientExports, Exports, OpenMode};
use blizzard_volume::{Volume, VolumeError};

/// How long a start waits for another process to let go of the data
/// directory (a predecessor stopping its servers for a hand-over).
const LOCK_WAIT: Duration = Duration::from_secs(60);

/// The lock on a data directory (module docs), held while its cluster runs.
struct DirLock {
    // Held open: the lock lasts as long as the file description.
    _file: std::fs::File,
}

impl DirLock {
    /// Takes the lock on `dir`, waiting up to `wait` while another
    /// process holds it.
    async fn take(env: &Env, dir: &Path, wait: Duration) -> Result<DirLock> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join("up.lock");
        // The real process's own state, never simulated.
        #[allow(clippy::disallowed_methods)]
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let start = env.now();
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(DirLock { _file: file }),
                Err(std::fs::TryLockError::WouldBlock) if env.now().duration_since(start) < wait => {
                    env.sleep(Duration::from_millis(50)).await;
                }
                Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
                    "another blizzard process serves {} (it holds {}); stop it, or hand over to this one with --upgrade-from PID",
                    dir.display(),
                    path.display()
                ),
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", path.display()))
                }
            }
        }
    }
}

struct Running {
    cluster: Cluster,
    client: Client,
    _lock: DirLock,
}

/// The embedded cluster, started and stopped as a whole (module docs).
pub(crate) struct UpBacking {
    env: Env,
    cfg: ClusterConfig,
    open_mode: OpenMode,
    /// `ClientConfig::batch_writes` of the volumes' client.
    batch_writes: bool,
    running: tokio::sync::Mutex<Option<Running>>,
    /// What the NBD server opens volumes through: this cluster's while it
    /// runs, nothing while it is stopped.
    exports: Arc<SwapExports>,
}

impl UpBacking {
    pub(crate) fn new(
        env: Env,
        cfg: ClusterConfig,
        open_mode: OpenMode,
        batch_writes: bool,
    ) -> Arc<UpBacking> {
        Arc::new(UpBacking {
            env,
            cfg,
            open_mode,
            batch_writes,
            running: tokio::sync::Mutex::new(None),
            exports: Arc::new(SwapExports { inner: RwLock::new(None) }),
        })
    }

    pub(crate) fn data_dir(&self) -> &PathBuf {
        &self.cfg.data_dir
    }

    /// Starts the cluster under the directory's lock, waiting up to `wait`
    /// for it; a running cluster is left as it is.
    pub(crate) async fn start_waiting(&self, wait: Duration) -> Result<()> {
        let mut running = self.running.lock().await;
        if running.is_some() {
            return Ok(());
        }
        let lock = DirLock::take(&self.env, &self.cfg.data_dir, wait).await?;
        let cluster = Cluster::start(self.env.clone(), self.cfg.clone())
            .await
            .with_context(|| format!("starting the embedded cluster in {}", self.cfg.data_dir.display()))?;
        let client = match cluster.client_with(|c| c.batch_writes = self.batch_writes).await {
            Ok(c) => c,
            Err(e) => {
                cluster.stop().await;
                return Err(e).context("connecting to the embedded cluster");
            }
        };
        let exports = ClientExports::with_mode(self.env.clone(), client.clone(), self.open_mode.clone());
        self.exports.set(Some(exports as Arc<dyn Exports>));
        *running = Some(Running { cluster, client, _lock: lock });
        Ok(())
    }

    /// Stops every server of the cluster and lets go of the directory.
    pub(crate) async fn stop_cluster(&self) {
        let taken = self.running.lock().await.take();
        self.exports.set(None);
        if let Some(r) = taken {
            r.cluster.stop().await;
            // The lock goes with `r`, after the servers stopped.
        }
    }

    /// A client of the running cluster.
    pub(crate) async fn client(&self) -> Result<Client> {
        match &*self.running.lock().await {
            Some(r) => Ok(r.client.clone()),
            None => anyhow::bail!("the embedded cluster is not running"),
        }
    }

    /// The metadata service's address, as `--meta` takes it.
    pub(crate) async fn meta_addr(&self) -> String {
        self.running.lock().await.as_ref().map(|r| r.cluster.meta_addr.clone()).unwrap_or_default()
    }

    /// Bytes of new disk files still being zero-filled (`None`: the
    /// cluster is stopped).
    pub(crate) async fn disks_preparing_left(&self) -> Option<u64> {
        self.running.lock().await.as_ref().map(|r| r.cluster.disks_preparing_left())
    }

    pub(crate) fn exports(&self) -> Arc<dyn Exports> {
        self.exports.clone()
    }
}

impl blizzard_nbd::upgrade::Backing for UpBacking {
    fn start(&self) -> BoxFuture<'_, Result<(), String>> {
        async move { self.start_waiting(LOCK_WAIT).await.map_err(|e| format!("{e:#}")) }.boxed()
    }

    fn stop(&self) -> BoxFuture<'_, ()> {
        self.stop_cluster().boxed()
    }
}

/// The running cluster's exports, or none while it is stopped (a hand-over
/// under way): opens then fail with a message saying so.
pub(crate) struct SwapExports {
    inner: RwLock<Option<Arc<dyn Exports>>>,
}

impl SwapExports {
    fn set(&self, e: Option<Arc<dyn Exports>>) {
        *self.inner.write().unwrap_or_else(|p| p.into_inner()) = e;
    }

    fn current(&self) -> Result<Arc<dyn Exports>, VolumeError> {
        self.inner.read().unwrap_or_else(|p| p.into_inner()).clone().ok_or_else(|| {
            VolumeError::Refused(
                "the embedded blob store is stopped (an online upgrade is under way); try again in a moment"
                    .into(),
            )
        })
    }
}

impl Exports for SwapExports {
    fn list(&self) -> BoxFuture<'_, Result<Vec<blizzard_nbd::Listed>, VolumeError>> {
        async move { self.current()?.list().await }.boxed()
    }

    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Volume, VolumeError>> {
        async move { self.current()?.open(name).await }.boxed()
    }

    fn access<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<blizzard_volume::access::AccessEntry>, VolumeError>> {
        async move { self.current()?.access(name).await }.boxed()
    }

    fn revoked(&self) -> BoxFuture<'_, Result<Vec<String>, VolumeError>> {
        async move { self.current()?.revoked().await }.boxed()
    }

    fn gone<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, VolumeError>> {
        async move { self.current()?.gone(name).await }.boxed()
    }
}
