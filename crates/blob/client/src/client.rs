//! The client: the cached TLT, the connection pool, the simultaneous-request
//! limit, and blob-level metadata calls to a row's primary.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use blizzard_core::tlt::Tlt;
use blizzard_core::{BlobId, Placement, TractNo};
use blizzard_env::Env;
use blizzard_proto::{BlobMeta, ClusterStatus, ErrorCode, ErrorReply, Reply, Request};
use blizzard_rpc::{MetaService, RpcError};

use crate::blob::Blob;
use crate::pool::Pool;

#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The metadata service: `ADDR[,ADDR...]`, every replica.
    pub meta: String,
    /// Deadline for one request to one server.
    pub request_timeout: Duration,
    /// Tract operations in flight at once (FDS's GetSimultaneousLimit).
    pub simultaneous_limit: usize,
    /// Attempts per operation across TLT refreshes and transient errors.
    pub attempts: u32,
    /// First pause between attempts; doubles up to `backoff_max`.
    pub backoff: Duration,
    pub backoff_max: Duration,
    /// How long `connect` waits for the cluster to have a TLT.
    pub connect_timeout: Duration,
    /// Requests carrying at least this many bytes ask the tractserver
    /// before they send (receiver-driven flow control, `blizzard_rpc`'s
    /// `flow`); `None` sends them at once (comparisons only).
    pub large_transfer_min: Option<u32>,
    /// Size-aware replication (Ursa §3.4): a durable write of more than
    /// this many bytes to a replicated blob goes once, to the row's
    /// primary, which forwards it to the backups (`WriteTractForward`), so
    /// the client's link carries it once; smaller ones go to every replica
    /// at once. `None` (the default): every write goes to every replica
    /// from here. On one machine there is no link to save, and a forwarded
    /// write pays a hop more (docs/benchmarks.md).
    pub forward_above: Option<u32>,
    /// Small writes to one tractserver that are ready together travel in
    /// one request (`WriteTracts`, issue 24 point 1); `false` sends each
    /// alone (comparisons only).
    pub batch_writes: bool,
}

impl ClientConfig {
    pub fn new(meta: impl Into<String>) -> Self {
        ClientConfig {
            meta: meta.into(),
            request_timeout: Duration::from_secs(10),
            simultaneous_limit: 64,
            attempts: 12,
            backoff: Duration::from_millis(20),
            backoff_max: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(30),
            large_transfer_min: Some(blizzard_rpc::LARGE_TRANSFER_MIN),
            forward_above: None,
            batch_writes: true,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error("blob {0} does not exist")]
    NoSuchBlob(BlobId),
    #[error("blob {0} already exists")]
    BlobExists(BlobId),
    #[error("tract {tract} is past the end of blob {blob} ({size} tracts): extend the blob first")]
    PastEnd { blob: BlobId, tract: u64, size: u64 },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("tractserver {addr} is full: {message}")]
    DiskFull { addr: String, message: String },
    #[error("tractserver {addr} refused the request: {reply}")]
    Rejected { addr: String, reply: ErrorReply },
    #[error("no replica could return tract {tract} of blob {blob} intact: {last}")]
    NoIntactReplica { blob: BlobId, tract: u64, last: String },
    #[error("gave up after {attempts} attempts: {last}")]
    Unavailable { attempts: u32, last: String },
    #[error("metadata server {addr}: {message}")]
    Meta { addr: String, message: String },
    /// The metadata service refused the request for this process's
    /// certificate (its role, or the volumes it may touch: design 0010).
    #[error("{0}")]
    Forbidden(String),
    #[error("tractserver {addr} restarted while holding cached writes, which may be lost: write them again")]
    Restarted { addr: String },
    #[error(
        "tractserver {addr} refused a change: another process opened this blob for writing with epoch \
         {newest}, so this handle may no longer change it; stop writing (reopen the blob if this process \
         should be its writer)"
    )]
    Fenced { addr: String, newest: u64 },
    #[error("the replicas of tract {tract} of blob {blob} still differ after {rounds} rounds of repairs: {differs}")]
    NotReconciled { blob: BlobId, tract: u64, rounds: u32, differs: String },
}

/// Counters, mostly for tests and status output.
#[derive(Default, Debug)]
pub struct ClientStats {
    pub tlt_fetches: AtomicU64,
    pub stale_rejections: AtomicU64,
    pub retries: AtomicU64,
    pub read_fallbacks: AtomicU64,
    /// Writes sent once, to a row's primary, which forwarded them.
    pub forwarded_writes: AtomicU64,
}

pub(crate) struct Inner {
    pub env: Env,
    pub cfg: ClientConfig,
    pub pool: Pool,
    /// The metadata service (the one loop that finds its leader).
    pub meta: MetaService,
    tlt: RwLock<Arc<Tlt>>,
    refresh: tokio::sync::Mutex<()>,
    limit: Arc<Semaphore>,
    /// The boot id each tractserver (by address) last reported to a
    /// `SyncDisk` of this client: [`Blob::reconcile`] compares the one a
    /// server reports after its digest with one seen before it.
    boots: Mutex<BTreeMap<String, u64>>,
    pub stats: ClientStats,
}

/// A handle on the blob store. Cheap to clone; clones share the TLT cache
/// and connections.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

/// What to do after a failed attempt.
pub(crate) enum Next {
    /// The table is stale: refresh it, then try again (pausing from the
    /// second attempt on).
    Refresh,
    /// Something transient: pause, then try again.
    Backoff,
    /// Some server failed in a way a newer table or a pause may mend:
    /// refresh the table and pause.
    RefreshBackoff,
    /// Trying again will not help.
    Fail(ClientError),
}

impl Next {
    /// How decisive an outcome is: failing beats refreshing beats pausing.
    fn rank(&self) -> u8 {
        match self {
            Next::Backoff => 0,
            Next::RefreshBackoff => 1,
            Next::Refresh => 2,
            Next::Fail(_) => 3,
        }
    }
}

/// A failed attempt: what to do about it, and what went wrong (the error
/// reported once the attempts run out).
pub(crate) struct Failed {
    pub next: Next,
    pub last: String,
}

impl Failed {
    pub(crate) fn new(next: Next, last: impl Into<String>) -> Failed {
        Failed { next, last: last.into() }
    }

    /// An RPC failure, classified.
    pub(crate) fn of(e: &RpcError) -> Failed {
        Failed { next: classify(e), last: e.to_string() }
    }

    /// Combines the outcomes of requests of one attempt sent in parallel:
    /// the most decisive `next` wins (the earlier one of a tie); `last` is
    /// this (the later) one's.
    pub(crate) fn or(self, earlier: Option<Failed>) -> Failed {
        match earlier {
            Some(e) if e.next.rank() >= self.next.rank() => Failed { next: e.next, last: self.last },
            _ => self,
        }
    }
}

/// Classifies an RPC failure for the retry loops.
pub(crate) fn classify(e: &RpcError) -> Next {
    match e {
        RpcError::Remote { addr, reply } => match reply.code {
            ErrorCode::StaleVersion | ErrorCode::NotOwner => Next::Refresh,
            // A backup a forwarded write could not reach may have died:
            // the table may name its replacement.
            ErrorCode::Unreachable => Next::RefreshBackoff,
            ErrorCode::Conflict
            | ErrorCode::NotReady
            | ErrorCode::Busy
            | ErrorCode::Aborted
            | ErrorCode::BadCrc => Next::Backoff,
            ErrorCode::DiskFull => {
                Next::Fail(ClientError::DiskFull { addr: addr.clone(), message: reply.message.clone() })
            }
            ErrorCode::Fenced => {
                Next::Fail(ClientError::Fenced { addr: addr.clone(), newest: reply.current_version })
            }
            _ => Next::Fail(ClientError::Rejected { addr: addr.clone(), reply: reply.clone() }),
        },
        // The server may have died or moved: the table may name its
        // replacement or new address.
        RpcError::Connect { .. } | RpcError::ConnectionLost(_) | RpcError::Timeout(_) => Next::Refresh,
        RpcError::Decode { .. } => Next::Backoff,
        // Busy receiving other large transfers: the same server, later.
        RpcError::NoGrant(_) => Next::Backoff,
    }
}

impl Client {
    /// Connects to the metadata server and fetches the TLT, waiting up to
    /// `connect_timeout` for the cluster to have one.
    pub async fn connect(env: Env, cfg: ClientConfig) -> Result<Client, ClientError> {
        let pool = Pool::new(env.clone(), cfg.request_timeout, cfg.large_transfer_min, cfg.batch_writes);
        let meta = MetaService::parse(&env, &cfg.meta)
            .map_err(|message| ClientError::Meta { addr: cfg.meta.clone(), message })?;
        let deadline = env.now() + cfg.connect_timeout;
        let tlt = loop {
            match fetch_tlt(&meta, cfg.request_timeout, 0).await {
                Ok(Some(t)) => break t,
                Ok(None) => {}
                Err(e) if env.now() >= deadline => {
                    return Err(ClientError::Meta { addr: cfg.meta.clone(), message: e.to_string() })
                }
                Err(_) => {}
            }
            env.sleep(Duration::from_millis(100)).await;
        };
        let limit = Arc::new(Semaphore::new(cfg.simultaneous_limit.max(1)));
        let stats = ClientStats::default();
        stats.tlt_fetches.fetch_add(1, Ordering::Relaxed);
        Ok(Client {
            inner: Arc::new(Inner {
                env,
                cfg,
                pool,
                meta,
                tlt: RwLock::new(Arc::new(tlt)),
                refresh: tokio::sync::Mutex::new(()),
                limit,
                boots: Mutex::new(BTreeMap::new()),
                stats,
            }),
        })
    }

    pub fn env(&self) -> &Env {
        &self.inner.env
    }

    /// The cached TLT.
    /// How long one request to the cluster may take (the configuration's).
    pub fn request_timeout(&self) -> std::time::Duration {
        self.inner.cfg.request_timeout
    }

    pub fn tlt(&self) -> Arc<Tlt> {
        match self.inner.tlt.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    pub fn tract_size(&self) -> u32 {
        self.tlt().tract_size
    }

    /// The cluster's maximum replication level.
    pub fn max_replication(&self) -> u8 {
        self.tlt().replication
    }

    /// How many tract operations to keep in flight for full speed.
    pub fn simultaneous_limit(&self) -> usize {
        self.inner.cfg.simultaneous_limit
    }

    pub fn stats(&self) -> &ClientStats {
        &self.inner.stats
    }

    /// Requests to tractservers that carried more than one write (small
    /// writes ready together, `WriteTracts`), and the writes they carried.
    pub fn batch_counts(&self) -> (u64, u64) {
        self.inner.pool.batch_counts()
    }

    /// The boot id `addr` last reported to this client, if any.
    pub(crate) fn boot_of(&self, addr: &str) -> Option<u64> {
        match self.inner.boots.lock() {
            Ok(g) => g.get(addr).copied(),
            Err(p) => p.into_inner().get(addr).copied(),
        }
    }

    /// Notes the boot id `addr` reported.
    pub(crate) fn saw_boot(&self, addr: &str, boot: u64) {
        let mut g = match self.inner.boots.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.insert(addr.to_string(), boot);
    }

    /// One `SyncDisk` to `addr` (every write it applied before is durable
    /// on return): the boot id it reports, noted ([`Client::saw_boot`]).
    pub(crate) async fn sync_disk(&self, addr: &str) -> Result<u64, Failed> {
        match self.inner.pool.call(addr, &Request::SyncDisk, Bytes::new()).await {
            Ok((Reply::Boot { boot }, _)) => {
                self.saw_boot(addr, boot);
                Ok(boot)
            }
            Ok((other, _)) => {
                let e = format!("{addr} answered a sync with {other:?}");
                Err(Failed::new(Next::Fail(ClientError::Invalid(e.clone())), e))
            }
            Err(e) => Err(Failed::of(&e)),
        }
    }

    pub(crate) async fn permit(&self) -> Result<OwnedSemaphorePermit, ClientError> {
        self.inner
            .limit
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ClientError::Invalid("client closed".into()))
    }

    /// Fetches the TLT unless someone already replaced the version `seen`.
    pub(crate) async fn refresh_tlt(&self, seen: u64) -> Result<(), ClientError> {
        let _one = self.inner.refresh.lock().await;
        if self.tlt().version != seen {
            return Ok(());
        }
        self.inner.stats.tlt_fetches.fetch_add(1, Ordering::Relaxed);
        match fetch_tlt(&self.inner.meta, self.inner.cfg.request_timeout, seen).await {
            Ok(Some(t)) => {
                tracing::debug!(from = seen, to = t.version, "TLT refreshed");
                *match self.inner.tlt.write() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                } = Arc::new(t);
                Ok(())
            }
            // Unchanged: a tractserver is ahead of the published table for
            // a moment (it stores new rows before they are published).
            Ok(None) => Ok(()),
            Err(e) => Err(ClientError::Meta { addr: self.inner.cfg.meta.clone(), message: e.to_string() }),
        }
    }

    /// The retry loop of every operation: runs `op` with the cached TLT and
    /// the attempt's number until it succeeds, fails for good, or
    /// `ClientConfig::attempts` are used up (`ClientError::Unavailable`
    /// with the last failure), doing between attempts what the failure
    /// asks ([`Client::after_failure`]).
    pub(crate) async fn retry<T, F, Fut>(&self, mut op: F) -> Result<T, ClientError>
    where
        F: FnMut(Arc<Tlt>, u32) -> Fut,
        Fut: Future<Output = Result<T, Failed>>,
    {
        let attempts = self.inner.cfg.attempts.max(1);
        let mut last = String::new();
        for attempt in 0..attempts {
            let tlt = self.tlt();
            let seen = tlt.version;
            match op(tlt, attempt).await {
                Ok(v) => return Ok(v),
                Err(f) => {
                    last = f.last;
                    self.after_failure(attempt, seen, f.next, &mut last).await?;
                }
            }
        }
        Err(ClientError::Unavailable { attempts, last })
    }

    /// Does what a failed attempt `attempt`, made with TLT version `seen`,
    /// asks before the next one: refresh the table, pause, or give up
    /// (`Err`). A failed refresh becomes `last`.
    pub(crate) async fn after_failure(
        &self,
        attempt: u32,
        seen: u64,
        next: Next,
        last: &mut String,
    ) -> Result<(), ClientError> {
        match next {
            Next::Fail(e) => return Err(e),
            Next::Refresh => {
                self.inner.stats.stale_rejections.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.refresh_tlt(seen).await {
                    *last = e.to_string();
                }
                if attempt > 0 {
                    self.backoff(attempt).await;
                }
            }
            Next::RefreshBackoff => {
                if let Err(e) = self.refresh_tlt(seen).await {
                    *last = e.to_string();
                }
                self.backoff(attempt).await;
            }
            Next::Backoff => self.backoff(attempt).await,
        }
        Ok(())
    }

    /// Pause before attempt `attempt` (exponential with jitter).
    pub(crate) async fn backoff(&self, attempt: u32) {
        let c = &self.inner.cfg;
        let base = c.backoff.saturating_mul(1 << attempt.min(8)).min(c.backoff_max);
        let jitter = self.inner.env.random_below(base.as_micros().max(1) as u64);
        self.inner.stats.retries.fetch_add(1, Ordering::Relaxed);
        self.inner.env.sleep(base / 2 + Duration::from_micros(jitter / 2)).await;
    }

    /// Sends a metadata request to the primary of the blob's metadata row,
    /// retrying through TLT changes and transient refusals. Returns with
    /// the error the attempt it happened at (0 for the first): an answer
    /// to a retry may be the first attempt's doing.
    pub(crate) async fn meta_call(
        &self,
        blob: BlobId,
        make: impl Fn(u64) -> Request,
    ) -> Result<BlobMeta, (ClientError, u32)> {
        // Atomic, not a Cell, so that the future stays `Send`.
        let tried = AtomicU32::new(0);
        let (make, tried_ref) = (&make, &tried);
        let r = self
            .retry(|tlt, attempt| async move {
                tried_ref.store(attempt, Ordering::Relaxed);
                let row = &tlt.rows[tlt.locate(blob, TractNo::META)];
                let addr = &tlt.members[row.members[0] as usize].addr;
                match self.inner.pool.call(addr, &make(row.version), Bytes::new()).await {
                    Ok((Reply::Blob(m), _)) => Ok(m),
                    Ok((other, _)) => Err(Failed::new(Next::Backoff, format!("unexpected reply {other:?}"))),
                    Err(e) => {
                        let fail = |err| Err(Failed::new(Next::Fail(err), e.to_string()));
                        match e.remote().map(|reply| (reply.code, &reply.message)) {
                            Some((ErrorCode::NoSuchBlob, _)) => fail(ClientError::NoSuchBlob(blob)),
                            Some((ErrorCode::BlobExists, _)) => fail(ClientError::BlobExists(blob)),
                            Some((ErrorCode::OutOfRange | ErrorCode::BadRequest, message)) => {
                                fail(ClientError::Invalid(message.clone()))
                            }
                            _ => Err(Failed::of(&e)),
                        }
                    }
                }
            })
            .await;
        r.map_err(|e| (e, tried.load(Ordering::Relaxed)))
    }

    /// Creates a blob with the given id (or a random one) and replication
    /// level; it starts with 0 tracts.
    pub async fn create_blob(&self, id: Option<BlobId>, replication: u8) -> Result<Blob, ClientError> {
        self.create_placed_blob(id, replication, Placement::Any).await
    }

    /// [`Client::create_blob`] with its replicas placed so (design 0009):
    /// the placement is written into the id (`Placement::place`; the
    /// returned blob's id is the one to open it by). Fails unless the
    /// cluster's table has a section for the placement.
    pub async fn create_placed_blob(
        &self,
        id: Option<BlobId>,
        replication: u8,
        placement: Placement,
    ) -> Result<Blob, ClientError> {
        let max = self.max_replication();
        if replication == 0 || replication > max {
            return Err(ClientError::Invalid(format!(
                "replication {replication} is outside 1..={max} (this cluster's maximum)"
            )));
        }
        let tlt = self.tlt();
        if !tlt.has_placement(placement) {
            let have: Vec<&str> = tlt.sections.iter().map(|s| s.placement.name()).collect();
            return Err(ClientError::Invalid(format!(
                "this cluster cannot place blobs {placement}: its table has {} (a table gets ssd, hdd and \
                 hybrid sections when it is first built over tractservers of both --class ssd and --class hdd); \
                 use --placement any or one of those",
                if have.is_empty() { "no placements but any".to_string() } else { have.join(", ") }
            )));
        }
        let blob = placement.place(id.unwrap_or_else(|| BlobId(self.inner.env.random_u128())));
        let incarnation = self.inner.env.random_u64().max(1);
        let res = self
            .meta_call(blob, |row_version| Request::CreateBlob {
                blob,
                row_version,
                incarnation,
                replication,
            })
            .await;
        match res {
            Ok(m) => Ok(Blob::new(self.clone(), m)),
            // A retry after a lost reply finds our own creation: success.
            Err((ClientError::BlobExists(_), attempt)) if attempt > 0 => {
                let b = self.open_blob(blob).await?;
                if b.incarnation() == incarnation {
                    Ok(b)
                } else {
                    Err(ClientError::BlobExists(blob))
                }
            }
            Err((e, _)) => Err(e),
        }
    }

    /// Opens an existing blob, reading its size and replication level.
    pub async fn open_blob(&self, blob: BlobId) -> Result<Blob, ClientError> {
        let m = self.get_meta(blob).await?;
        Ok(Blob::new(self.clone(), m))
    }

    pub(crate) async fn get_meta(&self, blob: BlobId) -> Result<BlobMeta, ClientError> {
        self.meta_call(blob, |row_version| Request::GetBlob { blob, row_version }).await.map_err(|(e, _)| e)
    }

    /// Deletes a blob: its metadata first (so nobody can open it), then its
    /// data tracts. Tracts a crash leaves behind are invisible to any later
    /// blob with the same id (incarnations differ).
    pub async fn delete_blob(&self, blob: BlobId) -> Result<(), ClientError> {
        let old = match self.meta_call(blob, |row_version| Request::DeleteBlob { blob, row_version }).await {
            Ok(m) => m,
            // A retry after a lost reply finds it gone: that was us.
            Err((ClientError::NoSuchBlob(_), attempt)) if attempt > 0 => return Ok(()),
            Err((e, _)) => return Err(e),
        };
        let b = Blob::new(self.clone(), old);
        // The tracts' deletes pass every writer fence of this incarnation
        // (its writers raised one on each replica they wrote: a delete with
        // no epoch was refused, and the tracts stayed, unreachable) and
        // fence out any request of those writers still on its way. Safe:
        // the metadata delete above has committed, so this incarnation has
        // no writer any more, and fences are per incarnation, so a blob
        // created again under this id starts unfenced.
        b.set_writer(u64::MAX);
        let sem = Arc::new(Semaphore::new(self.simultaneous_limit().max(1)));
        let mut tasks = Vec::new();
        for t in 0..old.size_tracts {
            let b = b.clone();
            let Ok(p) = sem.clone().acquire_owned().await else { break };
            tasks.push(tokio::spawn(async move {
                let r = b.delete_tract(t).await;
                drop(p);
                r
            }));
        }
        for t in tasks {
            if let Ok(Err(e)) = t.await {
                tracing::warn!(%blob, error = %e, "could not free a tract of a deleted blob; it stays unreachable");
            }
        }
        Ok(())
    }

    /// Every blob in the cluster: each tractserver lists the blobs whose
    /// metadata row it is primary of, and the answers are merged.
    pub async fn list_blobs(&self) -> Result<Vec<BlobMeta>, ClientError> {
        self.retry(|tlt, _| async move {
            let calls =
                tlt.members.iter().map(|m| self.inner.pool.call(&m.addr, &Request::ListBlobs, Bytes::new()));
            let mut all = std::collections::BTreeMap::new();
            let mut failed: Option<String> = None;
            for (m, r) in tlt.members.iter().zip(futures::future::join_all(calls).await) {
                match r {
                    Ok((Reply::Blobs(v), _)) => all.extend(v.into_iter().map(|m| (m.blob, m))),
                    Ok((other, _)) => failed = Some(format!("{} answered ListBlobs with {other:?}", m.addr)),
                    Err(e) => failed = Some(e.to_string()),
                }
            }
            match failed {
                None => Ok(all.into_values().collect()),
                Some(last) => Err(Failed::new(Next::RefreshBackoff, last)),
            }
        })
        .await
    }

    /// The metadata server's view of the cluster.
    pub async fn cluster_status(&self) -> Result<ClusterStatus, ClientError> {
        let meta = &self.inner.cfg.meta;
        match self.inner.meta.call(&Request::ClusterStatus, self.inner.cfg.request_timeout).await {
            Ok((Reply::ClusterStatus(s), _, _)) => Ok(s),
            Ok(_) => Err(ClientError::Meta { addr: meta.clone(), message: "unexpected reply".into() }),
            Err(e) => Err(ClientError::Meta { addr: meta.clone(), message: e.to_string() }),
        }
    }
}

/// Fetches the TLT if newer than `have` (`None` if unchanged).
async fn fetch_tlt(meta: &MetaService, timeout: Duration, have: u64) -> Result<Option<Tlt>, RpcError> {
    let (reply, _, meta) = meta.call(&Request::GetTlt { have_version: have }, timeout).await?;
    match reply {
        Reply::Tlt(Some(t)) => match t.validate() {
            Ok(()) => Ok(Some(t)),
            Err(e) => Err(RpcError::Decode {
                addr: meta.to_string(),
                error: blizzard_proto::DecodeError::BadValue { field: "tlt", value: 0 },
            })
            .inspect_err(|_| tracing::error!(error = %e, "metadata server sent an invalid TLT")),
        },
        Reply::Tlt(None) => Ok(None),
        _ => Err(RpcError::Decode {
            addr: meta.to_string(),
            error: blizzard_proto::DecodeError::BadValue { field: "reply", value: 0 },
        }),
    }
}
