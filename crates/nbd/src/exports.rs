//! Which volumes the server exports, and the registry that keeps exactly
//! one open [`Volume`] per export.
//!
//! One instance per export is a correctness requirement, not an
//! optimisation: fast-ack and log volumes keep acknowledged writes in
//! memory, so two instances on one blob would not see each other's writes,
//! and a FLUSH on one connection must cover writes completed on every
//! connection (what `NBD_FLAG_CAN_MULTI_CONN` promises). Volumes are opened
//! on first use and stay open until shutdown releases them (or a hand-over
//! does, and [`Registry::clear`] forgets them).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::OnceCell;

use blizzard_client::Client;
use blizzard_env::Env;
use blizzard_proto::scope::Scope;
use blizzard_volume::access::AccessEntry;
use blizzard_volume::lease::Writer;
use blizzard_volume::{manage, PlantedBug, Volume, VolumeError};

/// An export as NBD_OPT_LIST sees it: its name, and who may use it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub name: String,
    /// Its volume's access list (`blizzard_volume::access`); empty: open
    /// to every client.
    pub access: Vec<AccessEntry>,
}

/// The set of exports: names, and how to open one.
pub trait Exports: Send + Sync + 'static {
    /// Every export (for NBD_OPT_LIST).
    fn list(&self) -> BoxFuture<'_, Result<Vec<Listed>, VolumeError>>;
    /// Opens the export called `name` (`VolumeError::NotFound` if there is
    /// none). The registry calls it at most once per name at a time.
    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Volume, VolumeError>>;
    /// The access list of export `name`, read without opening it (a
    /// client that may not use a volume must not make the server take its
    /// lease). Default: open to all.
    fn access<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Vec<AccessEntry>, VolumeError>> {
        let _ = name;
        futures::future::ready(Ok(Vec::new())).boxed()
    }
    /// The serial numbers of the certificates the cluster revoked (design
    /// 0010): their clients are refused and their connections closed.
    /// Default: none.
    fn revoked(&self) -> BoxFuture<'_, Result<Vec<String>, VolumeError>> {
        futures::future::ready(Ok(Vec::new())).boxed()
    }
    /// Whether export `name`, open here, has since been deleted (a
    /// snapshot): the registry then forgets it rather than serve what
    /// the deletion gave back. Default: never.
    fn gone<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, VolumeError>> {
        let _ = name;
        futures::future::ready(Ok(false)).boxed()
    }
}

/// How long NBD_OPT_LIST waits for an S3 volume's store to list its
/// snapshots before leaving them out.
const LIST_SNAPSHOTS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How a server opens the volumes it exports.
#[derive(Clone, Debug, Default)]
pub struct OpenMode {
    /// Without claiming them or taking their leases: a process writing a
    /// volume carries on, and clients see the export read-only.
    pub read_only: bool,
    /// Take each volume's lease even from a live holder (the operator
    /// says it is dead); its late writes are refused from then on.
    pub take_over: bool,
    /// A test hook, like `blizzard crashcheck --plant`: every volume is
    /// opened with this bug planted (`manage::open_as`), so a real-process
    /// test can show its checker catches it (`blizzard up --plant`,
    /// `blizzard nbd --plant`, hidden flags). Never for serving data.
    #[doc(hidden)]
    pub planted: PlantedBug,
}

/// Every volume of a cluster, by name. A volume is opened for writing
/// under its lease (`blizzard_volume::lease`): one another process holds
/// is refused to clients with a message naming the holder, unless the
/// server exports read-only.
pub struct ClientExports {
    env: Env,
    client: Client,
    mode: OpenMode,
    /// The cluster's scope table as last fetched (access lists,
    /// revocations); each use asks for a newer one first.
    scope: Mutex<Option<Arc<Scope>>>,
}

impl ClientExports {
    pub fn new(env: Env, client: Client) -> Arc<ClientExports> {
        Self::with_mode(env, client, OpenMode::default())
    }

    pub fn with_mode(env: Env, client: Client, mode: OpenMode) -> Arc<ClientExports> {
        Arc::new(ClientExports { env, client, mode, scope: Mutex::new(None) })
    }

    /// The scope table, brought up to date (one small request when
    /// nothing changed). When the metadata service does not answer within
    /// [`SCOPE_WAIT`] (an election, an outage) the table last fetched
    /// stands, as a tractserver's does; with none fetched yet, the error.
    async fn scope(&self) -> Result<Option<Arc<Scope>>, VolumeError> {
        let held = self.scope.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let have = held.as_ref().map_or(0, |s| s.version);
        let wait = if held.is_some() { SCOPE_WAIT } else { self.client.request_timeout() };
        match self.client.scope(have, wait).await {
            Ok(Some(t)) => {
                let t = Arc::new(t);
                let mut cur = self.scope.lock().unwrap_or_else(|p| p.into_inner());
                if cur.as_ref().is_none_or(|c| c.version < t.version) {
                    *cur = Some(t);
                }
                Ok(cur.clone())
            }
            Ok(None) => Ok(held),
            Err(e) if held.is_some() => {
                tracing::debug!(error = %e, "the scope table could not be brought up to date; the one held stands");
                Ok(held)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// How long a negotiation waits for a newer scope table when it has one.
const SCOPE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl Exports for ClientExports {
    /// Every volume, and every snapshot as `NAME@SNAP` (with its volume's
    /// access list).
    fn list(&self) -> BoxFuture<'_, Result<Vec<Listed>, VolumeError>> {
        async move {
            let scope = self.scope().await?;
            let mut out = Vec::new();
            for mut sb in manage::list(&self.client).await? {
                if let Some(list) = manage::registered(scope.as_deref(), &sb.name) {
                    sb.access = list;
                }
                if sb.backend.s3().is_some() {
                    // A store that cannot be reached now, or is slow to
                    // answer, still lists the volume (without snapshots).
                    let snaps =
                        self.env.timeout(LIST_SNAPSHOTS_WAIT, blizzard_volume::lsvd::snapshots(&sb)).await;
                    if let Ok(Ok((snaps, _))) = snaps {
                        out.extend(snaps.into_iter().map(|s| Listed {
                            name: format!("{}@{}", sb.name, s.name),
                            access: sb.access.clone(),
                        }));
                    }
                } else if sb.layers.is_some() {
                    match manage::snapshot_names(&self.client, &sb).await {
                        Ok(names) => out.extend(names.into_iter().map(|s| Listed {
                            name: format!("{}@{s}", sb.name),
                            access: sb.access.clone(),
                        })),
                        Err(e) => tracing::warn!(volume = %sb.name, error = %e, "its snapshots are left out of the list"),
                    }
                }
                out.push(Listed { name: sb.name, access: sb.access });
            }
            Ok(out)
        }
        .boxed()
    }

    /// The volume's list, as the cluster keeps it, or its superblock's
    /// (`manage::access_of`; a snapshot's is its volume's).
    fn access<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Vec<AccessEntry>, VolumeError>> {
        async move {
            let volume = name.split_once('@').map_or(name, |(v, _)| v);
            let scope = self.scope().await?;
            match manage::registered(scope.as_deref(), volume) {
                Some(list) => Ok(list),
                None => Ok(manage::info(&self.client, volume).await?.access),
            }
        }
        .boxed()
    }

    fn revoked(&self) -> BoxFuture<'_, Result<Vec<String>, VolumeError>> {
        async move { Ok(self.scope().await?.map(|s| s.revoked.keys().cloned().collect()).unwrap_or_default()) }
            .boxed()
    }

    /// A snapshot of a volume in the blob store no longer in its catalog.
    fn gone<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<bool, VolumeError>> {
        async move {
            let Some((volume, snapshot)) = name.split_once('@') else { return Ok(false) };
            let sb = manage::info(&self.client, volume).await?;
            if sb.backend.s3().is_some() {
                return Ok(false);
            }
            Ok(!manage::snapshot_names(&self.client, &sb).await?.iter().any(|s| s == snapshot))
        }
        .boxed()
    }

    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Volume, VolumeError>> {
        async move {
            // `NAME@SNAP`: a snapshot, always read-only (volume names
            // cannot hold '@').
            if let Some((volume, snapshot)) = name.split_once('@') {
                return manage::open_snapshot(&self.client, volume, snapshot).await;
            }
            if self.mode.read_only {
                return manage::open_read_only(&self.client, name).await;
            }
            let writer = Writer::new(&self.env).take_over(self.mode.take_over);
            manage::open_as(self.env.clone(), &self.client, name, &writer, self.mode.planted).await
        }
        .boxed()
    }
}

type Slot = Arc<OnceCell<Arc<Volume>>>;

/// Open volumes by name, shared by every connection of a server.
pub(crate) struct Registry {
    exports: Arc<dyn Exports>,
    // BTreeMap: shutdown flushes in a deterministic order.
    open: Mutex<BTreeMap<String, Slot>>,
}

impl Registry {
    pub(crate) fn new(exports: Arc<dyn Exports>) -> Registry {
        Registry { exports, open: Mutex::new(BTreeMap::new()) }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Slot>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (each critical section is one insert or remove), so poisoning
        // carries no information.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) async fn list(&self) -> Result<Vec<Listed>, VolumeError> {
        self.exports.list().await
    }

    /// The access list of export `name`, read from the cluster without
    /// opening it (the list in force now, whether the volume is open or
    /// not: an admin changes it while it is served).
    pub(crate) async fn access(&self, name: &str) -> Result<Vec<AccessEntry>, VolumeError> {
        self.exports.access(name).await
    }

    /// The certificates the cluster revoked (`Exports::revoked`).
    pub(crate) async fn revoked(&self) -> Result<Vec<String>, VolumeError> {
        self.exports.revoked().await
    }

    /// The open volume called `name`, opening it on first use. Concurrent
    /// first uses wait for one open.
    pub(crate) async fn get(&self, name: &str) -> Result<Arc<Volume>, VolumeError> {
        let slot = self.lock().entry(name.to_string()).or_default().clone();
        // A snapshot open here may have been deleted since: its chunks may
        // be given back already, so a new connection must not see it.
        if slot.initialized() && name.contains('@') && self.exports.gone(name).await? {
            let mut m = self.lock();
            if m.get(name).is_some_and(|s| Arc::ptr_eq(s, &slot)) {
                m.remove(name);
            }
            return Err(VolumeError::NotFound(name.to_string()));
        }
        let r = slot
            .get_or_try_init(|| async {
                let v = Arc::new(self.exports.open(name).await?);
                // `blizzard volume snapshot` on this host reaches it here.
                v.serve_control();
                Ok(v)
            })
            .await
            .cloned();
        if r.is_err() {
            // Forget a failed name so probing unknown names cannot grow the
            // map; a later attempt opens afresh.
            let mut m = self.lock();
            if m.get(name).is_some_and(|s| Arc::ptr_eq(s, &slot) && !s.initialized()) {
                m.remove(name);
            }
        }
        r
    }

    /// Forgets every open volume (a hand-over released them all): the next
    /// use of a name opens it afresh.
    pub(crate) fn clear(&self) {
        self.lock().clear();
    }

    /// Every open volume, by name.
    pub(crate) fn opened(&self) -> Vec<(String, Arc<Volume>)> {
        self.lock().iter().filter_map(|(n, s)| s.get().map(|v| (n.clone(), v.clone()))).collect()
    }
}
