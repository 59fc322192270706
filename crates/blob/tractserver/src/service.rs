//! Request handling. Every tract request names its blob, tract and TLT row
//! version; the tractserver recomputes the row from its stored assignment
//! and serves only rows it holds at exactly that version (FDS §3.1), so a
//! client with a stale table is told to refresh instead of being trusted.
//!
//! Blob metadata (tract −1) changes are serialized per blob by the row's
//! primary and committed on every replica of the row two-phase (FDS §3.1):
//! prepare on all, then commit locally, then commit on the others. A
//! prepare carries the full new metadata, so a replica that missed an
//! earlier change is brought up to date by the next one.
//!
//! Tract changes are fenced twice, under the tract's slot lock: by the
//! client's session (`blizzard_rpc::Caller`: a request the client gave up
//! on and retried) and by the blob's writer epoch (`fence`: a request of a
//! writer another process has replaced, refused as `Fenced`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_core::{BlobId, TractNo, TsId};
use blizzard_env::Env;
use blizzard_proto::codec::encode;
use blizzard_proto::{
    Assignment, BatchFailure, BatchedWrite, BlobMeta, ErrorCode, ErrorReply, OnBehalf, Onward, Reply,
    Request, TractAddr, FORWARD_TO_MAX, WRITE_BATCH_MAX,
};
use blizzard_rpc::{Caller, RpcError, Service};

use crate::blob_meta::{self, decode_meta, encode_meta, BlobMetas, MetaOp, Planned};
use crate::fill::Filler;
use crate::heal::Healer;
use crate::parts::Parts;
use crate::peers::Peers;
use crate::rows::{check_data_tract, SharedRows, Standing, Turn};
pub use crate::rows::{RowIndex, BLOB_TRACTS_MAX};
use crate::scrub::Scrubber;
use crate::store::{store_err, Durability, Store, StoreError, TractWrite};

pub struct TractService {
    pub env: Env,
    pub store: Arc<Store>,
    /// The rows this server holds (`rows::SharedRows`), replaced by each
    /// stored assignment.
    rows: Arc<SharedRows>,
    /// Other tractservers and the metadata service (`peers`).
    pub peers: Arc<Peers>,
    /// Blob metadata records, prepared changes, serialization
    /// (`blob_meta`).
    metas: Arc<BlobMetas>,
    pub inflight: AtomicU32,
    /// Lease and fence (`rows::Standing`): whether anything is served.
    standing: Mutex<Standing>,
    /// Rows being copied here as a newcomer, and copies served to others
    /// (FDS §3.2; `fill`).
    pub fill: Arc<Filler>,
    /// Re-reads and repairs chunks, frees orphans (`scrub`).
    pub scrub: Arc<Scrubber>,
    /// Chunks fetched from the row's other members (`heal`).
    healer: Arc<Healer>,
    /// Random, new at every start: a client holding cached (unsynced)
    /// writes learns from a changed boot id that they may be gone.
    pub boot: u64,
    /// The newest writer epoch seen per blob (`crate::fence`).
    pub(crate) fences: crate::fence::Fences,
    /// Who may touch which volume, as the metadata service last said
    /// (`crate::scope`).
    pub scope: Arc<crate::scope::ScopeCache>,
}

use blizzard_env::lock;

impl TractService {
    /// `fill_bandwidth`: bytes per second copied while filling rows;
    /// `scrub_bandwidth`: bytes per second the scrubber re-reads (0: off).
    pub fn new(
        env: Env,
        store: Arc<Store>,
        meta: Arc<blizzard_rpc::MetaService>,
        rows: RowIndex,
        request_timeout: Duration,
        fill_bandwidth: u64,
        scrub_bandwidth: u64,
    ) -> TractService {
        let scope = Arc::new(crate::scope::ScopeCache::new(meta.clone()));
        let peers = Arc::new(Peers::new(env.clone(), meta, request_timeout));
        let rows = Arc::new(SharedRows::new(rows));
        let metas = Arc::new(BlobMetas::default());
        let healer = Arc::new(Healer::new(store.clone(), peers.clone(), rows.clone()));
        let parts = Parts {
            env: env.clone(),
            store: store.clone(),
            peers: peers.clone(),
            rows: rows.clone(),
            metas: metas.clone(),
            healer: healer.clone(),
        };
        let fill = Arc::new(Filler::new(parts.clone(), fill_bandwidth));
        let scrub = Arc::new(Scrubber::new(parts, fill.clone(), scrub_bandwidth));
        TractService {
            boot: env.random_u64(),
            peers,
            env,
            store,
            rows,
            metas,
            inflight: AtomicU32::new(0),
            standing: Mutex::new(Standing::unleased()),
            fill,
            scrub,
            healer,
            fences: crate::fence::Fences::default(),
            scope,
        }
    }

    /// Refuses everything while fenced or without a lease.
    fn check_serving(&self) -> Result<(), ErrorReply> {
        lock(&self.standing).check(self.env.now())
    }

    /// Moves this server's standing (the heartbeat loop, the start).
    pub fn update_standing<T>(&self, f: impl FnOnce(&mut Standing) -> T) -> T {
        f(&mut lock(&self.standing))
    }

    /// Whether requests are served right now (lease held, not fenced).
    pub fn check_serving_now(&self) -> bool {
        self.check_serving().is_ok()
    }

    /// Checks that this server may be copied from for `row`: it holds the
    /// row at `version` and is a complete member of it.
    pub(crate) fn check_source(&self, row: u32, version: u64) -> Result<(), ErrorReply> {
        self.check_serving()?;
        let me = self.store.disk_id();
        let filling_here = self.rows.with(|g| g.check_row(row, version).map(|f| f.contains(&me)))?;
        if filling_here && !self.fill.row_complete(row) {
            return Err(ErrorReply::new(
                ErrorCode::NotReady,
                format!("row {row} is still being copied here"),
            ));
        }
        Ok(())
    }

    /// Loads every blob's metadata tract into memory (done once at start).
    pub async fn load_metas(&self) -> Result<usize, StoreError> {
        let mut loaded = HashMap::new();
        for (blob, tract) in self.store.tracts() {
            if !tract.is_meta() {
                continue;
            }
            let Some(inc) = self.store.incarnation_of(blob, tract).await else { continue };
            match self.store.read(blob, inc, tract, 0, blizzard_core::limits::CHUNK_SIZE).await {
                Ok((b, _)) => match decode_meta(&b) {
                    Some(m) if m.blob == blob && m.incarnation == inc => {
                        loaded.insert(blob, m);
                    }
                    _ => tracing::warn!(%blob, "metadata tract holds no valid record; ignoring it"),
                },
                Err(e) => tracing::error!(%blob, error = %e, "cannot read metadata tract"),
            }
        }
        let n = loaded.len();
        self.metas.replace_all(loaded);
        Ok(n)
    }

    pub fn row_index(&self) -> RowIndex {
        self.rows.snapshot()
    }

    fn check(&self, blob: BlobId, tract: TractNo, version: u64) -> Result<(bool, Vec<TsId>), ErrorReply> {
        self.check_serving()?;
        self.rows.with(|g| g.check(blob, tract, version).map(|(c, m)| (c, m.to_vec())))
    }

    fn data_check(&self, a: &TractAddr) -> Result<(), ErrorReply> {
        check_data_tract(a.tract)?;
        self.check(a.blob, a.tract, a.row_version).map(|_| ())
    }

    /// Admits `a`'s writer on its blob, raising the blob's fence to it, or
    /// refuses it as `Fenced` (a newer writer was seen).
    fn admit_writer(&self, a: &TractAddr) -> Result<(), ErrorReply> {
        self.fence(a).map_err(|newest| fenced(a, newest))
    }

    /// `Fences::admit`, unless the planted `NoWriterFence` admits everything.
    fn fence(&self, a: &TractAddr) -> Result<(), u64> {
        if self.store.planted(crate::store::PlantedBug::NoWriterFence) {
            return Ok(());
        }
        self.fences.admit(a.blob, a.incarnation, a.writer)
    }

    /// Whether a change may apply now: asked under the tract's slot lock
    /// (the `current` closure of `Store::write_with`, `trim`, `delete_if`),
    /// which orders the answer against a digest of the tract. Refused if
    /// the caller's connection was replaced, or if `a`'s writer is older
    /// than the blob's newest (then `refused_by` holds that newest, so the
    /// reply can say `Fenced` rather than `Aborted`, which clients retry).
    fn may_change(&self, caller: &Caller, a: &TractAddr, refused_by: &AtomicU64) -> bool {
        if !caller.is_current() {
            return false;
        }
        match self.fence(a) {
            Ok(()) => true,
            Err(newest) => {
                refused_by.store(newest, Ordering::Relaxed);
                false
            }
        }
    }

    /// The dispatcher: one function per opcode below.
    ///
    /// [`Service::call`] boxes this future whole for every request, so its
    /// size is what the largest branch awaited inline makes it, and that
    /// many bytes are copied per request. Branches whose futures are large
    /// and rare (blob-meta changes, 11 KiB; forwarded writes; copies served
    /// to newcomers; row assignment) are boxed on their own, as are the
    /// rare paths inside the common ones (a copy on demand, a chunk healed
    /// from a peer): a request's future is then 3 KiB, most of it a
    /// write's, not 12.5 KiB, whose copy was 4% of the CPU of 3-way random
    /// reads. [`tests::a_request_future_stays_small`] keeps it so.
    async fn handle(
        self: Arc<Self>,
        req: Request,
        data: Bytes,
        caller: Caller,
    ) -> (Result<Reply, ErrorReply>, Bytes) {
        let none = |r: Result<Reply, ErrorReply>| (r, Bytes::new());
        match req {
            // The connection handles its own `Hello`; one reaching here is
            // harmless.
            Request::Ping | Request::Hello { .. } => none(Ok(Reply::Done)),
            Request::WriteTract { addr, offset, crcs } => {
                none(self.write_tract(&addr, offset, &crcs, data, Durability::Synced, &caller).await)
            }
            Request::WriteTractCached { addr, offset, crcs } => {
                none(self.write_tract(&addr, offset, &crcs, data, Durability::Cached, &caller).await)
            }
            Request::WriteTractForward { addr, offset, crcs, to, on_behalf } => {
                none(Box::pin(self.write_forward(&addr, offset, &crcs, &to, on_behalf, data, &caller)).await)
            }
            Request::WriteTracts { cached, writes } => {
                none(self.write_batch(cached, &writes, data, &caller).await)
            }
            Request::SyncDisk => none(self.sync_disk().await),
            Request::ReadTract { addr, offset, len } => match self.read_tract(&addr, offset, len).await {
                Ok((reply, data)) => (Ok(reply), data),
                Err(e) => (Err(e), Bytes::new()),
            },
            Request::DeleteTract { addr } => none(self.delete_tract(&addr, &caller).await),
            Request::MappedTract { addr } => none(self.mapped_tract(&addr).await),
            Request::TrimTract { addr, offset, len } => {
                none(self.trim_tract(&addr, offset, len, &caller).await)
            }
            Request::DigestTract { addr } => none(self.digest_tract(&addr).await),
            Request::ListBlobs => none(Ok(self.list_blobs(&caller))),
            Request::GetBlob { blob, row_version } => none(self.get_blob(blob, row_version).await),
            Request::CreateBlob { blob, row_version, incarnation, replication } => none(
                Box::pin(self.meta_change(
                    blob,
                    row_version,
                    MetaOp::Create { incarnation, replication },
                    &caller,
                ))
                .await,
            ),
            Request::ExtendBlob { blob, row_version, mode, tracts } => none(
                Box::pin(self.meta_change(blob, row_version, MetaOp::Extend { mode, tracts }, &caller)).await,
            ),
            Request::DeleteBlob { blob, row_version } => {
                none(Box::pin(self.meta_change(blob, row_version, MetaOp::Delete, &caller)).await)
            }
            Request::MetaPrepare { blob, row_version, txn, expected_version, new } => {
                none(self.meta_prepare(blob, row_version, txn, expected_version, new))
            }
            Request::MetaCommit { blob, row_version, txn } => {
                none(Box::pin(self.meta_commit(blob, row_version, txn)).await)
            }
            Request::MetaAbort { blob, row_version: _, txn } => none(Ok(self.meta_abort(blob, txn))),
            Request::AssignRows { assignment } => none(Box::pin(self.assign(assignment)).await),
            Request::ListRowTracts { row, row_version, after } => {
                none(self.check_source(row, row_version).map(|()| self.fill.serve_list(row, after)))
            }
            Request::CopyTract { row, row_version, tract } => {
                let copy = match self.check_source(row, row_version) {
                    Ok(()) => Box::pin(self.fill.serve_copy(row, tract)).await,
                    Err(e) => Err(e),
                };
                match copy {
                    Ok((reply, data)) => (Ok(reply), data),
                    Err(e) => (Err(e), Bytes::new()),
                }
            }
            Request::CopyTractChanges { row, row_version, tract, incarnation, have } => {
                let copy = match self.check_source(row, row_version) {
                    Ok(()) => Box::pin(self.fill.serve_changes(row, tract, incarnation, &have)).await,
                    Err(e) => Err(e),
                };
                match copy {
                    Ok((reply, data)) => (Ok(reply), data),
                    Err(e) => (Err(e), Bytes::new()),
                }
            }
            Request::Heartbeat(_)
            | Request::GetTlt { .. }
            | Request::ClusterStatus
            | Request::ClusterParams
            | Request::AcquireVolume { .. }
            | Request::RenewVolume { .. }
            | Request::ReleaseVolume { .. }
            | Request::SetVolumeAccess { .. }
            | Request::DropVolume { .. }
            | Request::Revoke { .. }
            | Request::GetScope { .. }
            | Request::AttachReader { .. } => {
                none(Err(ErrorReply::new(ErrorCode::BadRequest, "that request is for the metadata server")))
            }
        }
    }

    /// The checks every change of a data tract passes first: the row at
    /// its version, the writer's fence raised to it (so a refused writer
    /// costs no copy; the check that counts runs again under the slot
    /// lock), and a newcomer's copy of the tract done.
    async fn admit_change(&self, addr: &TractAddr) -> Result<(), ErrorReply> {
        self.data_check(addr).and_then(|_| self.admit_writer(addr))?;
        self.fill.ensure_copied(addr.blob, addr.tract).await
    }

    /// `WriteTract` (`Synced`: durable before the reply) and
    /// `WriteTractCached` (`Cached`: applied, durable at the next
    /// `SyncDisk`; the reply names this boot, so the client can tell a
    /// restart lost it).
    async fn write_tract(
        &self,
        addr: &TractAddr,
        offset: u32,
        crcs: &[u32],
        data: Bytes,
        durable: Durability,
        caller: &Caller,
    ) -> Result<Reply, ErrorReply> {
        self.admit_change(addr).await?;
        let reply = match durable {
            Durability::Synced => Reply::Done,
            Durability::Cached => Reply::Boot { boot: self.boot },
        };
        let refused_by = AtomicU64::new(0);
        let current = || self.may_change(caller, addr, &refused_by);
        let write = |data: Bytes| {
            let w = TractWrite {
                blob: addr.blob,
                incarnation: addr.incarnation,
                tract: addr.tract,
                version: addr.row_version,
                offset,
                data,
                crcs,
                durability: durable,
            };
            self.store.write_with(w, &current)
        };
        let mut r = write(data.clone()).await;
        // A partial write into a chunk this replica cannot read (it must
        // merge with the chunk's bytes): heal the chunk from a complete
        // replica, then try once more.
        if let Err(StoreError::Corrupt { chunk, .. }) = r {
            if self.healer.heal_chunk(addr.blob, addr.incarnation, addr.tract, chunk).await {
                r = write(data).await;
            }
        }
        r.map(|_| reply).map_err(|e| change_err(e, addr, &refused_by))
    }

    /// `WriteTractForward` (Ursa §3.4, size-aware replication): applies
    /// the write here, durably, and sends it on to every server in `to` at
    /// once, each copy acting for the client's session at the epoch the
    /// client gave for that server (a copy that arrived here already acts
    /// for it: `on_behalf`); replies once all are durable, or with the
    /// first failure, naming the server. A forwarded copy names no servers:
    /// one hop at most.
    #[allow(clippy::too_many_arguments, reason = "the request's fields, one function per opcode")]
    async fn write_forward(
        &self,
        addr: &TractAddr,
        offset: u32,
        crcs: &[u32],
        to: &[Onward],
        on_behalf: Option<OnBehalf>,
        data: Bytes,
        caller: &Caller,
    ) -> Result<Reply, ErrorReply> {
        if to.len() > FORWARD_TO_MAX || (on_behalf.is_some() && !to.is_empty()) {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                "a write is forwarded once, to at most 32 servers",
            ));
        }
        let me = match on_behalf {
            Some(o) => caller.on_behalf(o.session, o.epoch),
            None => caller.clone(),
        };
        let session = caller.session().map(|(s, _)| s);
        let onward = |epoch: u64| Request::WriteTractForward {
            addr: *addr,
            offset,
            crcs: crcs.to_vec(),
            to: Vec::new(),
            on_behalf: session.map(|session| OnBehalf { session, epoch }),
        };
        let local = self.write_tract(addr, offset, crcs, data.clone(), Durability::Synced, &me);
        let copies = futures::future::join_all(to.iter().map(|o| {
            let (req, data) = (onward(o.epoch), data.clone());
            async move { (&o.addr, self.peers.call_addr_data(&o.addr, &req, data).await) }
        }));
        let (local, copies) = futures::join!(local, copies);
        local?;
        for (a, copy) in copies {
            match copy {
                Ok(_) => {}
                // The backup's own answer (a stale row version, a fence, a
                // full disk) goes back to the client as it is.
                Err(RpcError::Remote { reply, .. }) => {
                    return Err(ErrorReply { message: format!("{a}: {}", reply.message), ..reply })
                }
                Err(e) => {
                    return Err(ErrorReply::new(ErrorCode::Unreachable, format!("forwarding to {a}: {e}")))
                }
            }
        }
        Ok(Reply::Done)
    }

    /// `WriteTracts`: each write as its own `WriteTract` (or
    /// `WriteTractCached`), all at once, so the durable ones share group
    /// commits. A batch malformed as a whole is refused before any write
    /// runs; otherwise each write's failure is its own.
    async fn write_batch(
        &self,
        cached: bool,
        writes: &[BatchedWrite],
        data: Bytes,
        caller: &Caller,
    ) -> Result<Reply, ErrorReply> {
        let parts = split_batch(writes, &data)?;
        let durable = if cached { Durability::Cached } else { Durability::Synced };
        let results = futures::future::join_all(
            writes
                .iter()
                .zip(parts)
                .map(|(w, d)| self.write_tract(&w.addr, w.offset, &w.crcs, d, durable, caller)),
        )
        .await;
        let failed = results
            .into_iter()
            .enumerate()
            .filter_map(|(i, r)| r.err().map(|error| BatchFailure { index: i as u32, error }))
            .collect();
        Ok(Reply::Batch { boot: self.boot, failed })
    }

    /// `SyncDisk`: makes every cached write durable.
    async fn sync_disk(&self) -> Result<Reply, ErrorReply> {
        self.store.sync().await.map_err(store_err)?;
        Ok(Reply::Boot { boot: self.boot })
    }

    async fn read_tract(
        &self,
        addr: &TractAddr,
        offset: u32,
        len: u32,
    ) -> Result<(Reply, Bytes), ErrorReply> {
        self.data_check(addr).and_then(|_| self.fill.check_copied(addr.blob, addr.tract))?;
        let (data, crcs) =
            self.store.read(addr.blob, addr.incarnation, addr.tract, offset, len).await.map_err(store_err)?;
        Ok((Reply::Read { crcs }, data))
    }

    async fn delete_tract(&self, addr: &TractAddr, caller: &Caller) -> Result<Reply, ErrorReply> {
        self.admit_change(addr).await?;
        let refused_by = AtomicU64::new(0);
        let current = || self.may_change(caller, addr, &refused_by);
        let r = self.store.delete_if(addr.blob, addr.incarnation, addr.tract, &current).await;
        r.map(|_| Reply::Done).map_err(|e| change_err(e, addr, &refused_by))
    }

    async fn mapped_tract(&self, addr: &TractAddr) -> Result<Reply, ErrorReply> {
        self.data_check(addr)?;
        self.fill.ensure_copied(addr.blob, addr.tract).await?;
        Ok(Reply::Mapped { bitmap: self.store.mapped(addr.blob, addr.incarnation, addr.tract).await })
    }

    async fn trim_tract(
        &self,
        addr: &TractAddr,
        offset: u32,
        len: u32,
        caller: &Caller,
    ) -> Result<Reply, ErrorReply> {
        self.admit_change(addr).await?;
        let refused_by = AtomicU64::new(0);
        let current = || self.may_change(caller, addr, &refused_by);
        let r = self.store.trim(addr.blob, addr.incarnation, addr.tract, offset, len, &current).await;
        r.map(|_| Reply::Done).map_err(|e| change_err(e, addr, &refused_by))
    }

    /// `DigestTract`: the fence rises before the store is touched, so from
    /// here on no change of an older writer is admitted, and the digest
    /// waits, under the slot lock, for those admitted before. A newcomer
    /// copies the tract first, as for a change.
    async fn digest_tract(&self, addr: &TractAddr) -> Result<Reply, ErrorReply> {
        self.admit_change(addr).await?;
        let chunks = self.store.digest(addr.blob, addr.incarnation, addr.tract).await.map_err(store_err)?;
        Ok(Reply::Digest { chunks })
    }

    /// `ListBlobs`: only blobs whose metadata row this server leads, so a
    /// union over all tractservers lists each blob once.
    /// The metadata of the blobs this server lists (the primary of their
    /// metadata row), those `caller` may see (`blizzard_proto::scope::
    /// visible`: a client, the volumes whose lists name it).
    fn list_blobs(&self, caller: &Caller) -> Reply {
        let rows = self.row_index();
        let me = self.store.disk_id();
        let layout = rows.assignment.layout();
        let mut v: Vec<BlobMeta> = if layout.total == 0 || self.check_serving().is_err() {
            Vec::new()
        } else {
            self.metas.filtered(|m| {
                layout
                    .locate(m.blob, TractNo::META)
                    .is_some_and(|row| rows.lists_row(me, row, self.fill.row_complete(row)))
            })
        };
        if let Some(peer) = caller.peer() {
            let scope = blizzard_rpc::authz::ScopeSource::current(&*self.scope);
            v.retain(|m| blizzard_proto::scope::visible(blizzard_rpc::authz::who(peer), m.blob, &scope));
        }
        v.sort_by_key(|m| m.blob);
        Reply::Blobs(v)
    }

    /// `GetBlob`, asked of the blob's metadata primary.
    async fn get_blob(&self, blob: BlobId, row_version: u64) -> Result<Reply, ErrorReply> {
        self.fill.ensure_copied(blob, TractNo::META).await?;
        let r = self.check(blob, TractNo::META, row_version).and_then(|(primary, _)| {
            if !primary {
                return Err(not_primary(blob));
            }
            self.metas
                .get(blob)
                .map(Reply::Blob)
                .ok_or_else(|| ErrorReply::new(ErrorCode::NoSuchBlob, format!("blob {blob} does not exist")))
        });
        // "No such blob" frees tracts (the scrubber's orphans): never say
        // it of a blob whose metadata tract is here but unreadable.
        match r {
            Err(e)
                if e.code == ErrorCode::NoSuchBlob
                    && self.store.incarnation_of(blob, TractNo::META).await.is_some() =>
            {
                Err(ErrorReply::new(
                    ErrorCode::Corrupt,
                    format!("blob {blob}'s metadata tract is unreadable here"),
                ))
            }
            r => r,
        }
    }

    /// `MetaPrepare` on a replica: remembers the change until its commit.
    fn meta_prepare(
        &self,
        blob: BlobId,
        row_version: u64,
        txn: u64,
        expected_version: u64,
        new: Option<BlobMeta>,
    ) -> Result<Reply, ErrorReply> {
        self.check(blob, TractNo::META, row_version)?;
        let cur = self.metas.get(blob).map(|m| m.version).unwrap_or(0);
        if cur != expected_version {
            tracing::info!(%blob, cur, expected_version, "replica metadata differs from the primary's; the commit will bring it up to date");
        }
        self.metas.prepare(blob, txn, new);
        Ok(Reply::Done)
    }

    /// `MetaCommit` on a replica: applies the prepared change durably.
    async fn meta_commit(&self, blob: BlobId, row_version: u64, txn: u64) -> Result<Reply, ErrorReply> {
        self.check(blob, TractNo::META, row_version)?;
        self.fill.ensure_copied(blob, TractNo::META).await?;
        let new = self.metas.take_prepared(blob, txn).ok_or_else(|| {
            ErrorReply::new(ErrorCode::Aborted, format!("no prepared transaction {txn} for {blob}"))
        })?;
        self.apply_meta(blob, new, row_version).await?;
        Ok(Reply::Done)
    }

    /// `MetaAbort` on a replica: forgets the prepared change.
    fn meta_abort(&self, blob: BlobId, txn: u64) -> Reply {
        self.metas.abort(blob, txn);
        Reply::Done
    }

    /// Installs a new assignment from the metadata server, durably.
    async fn assign(&self, a: Assignment) -> Result<Reply, ErrorReply> {
        let me = self.store.disk_id();
        let cur = self.row_index().assignment;
        if cur.cluster_id != 0 && a.cluster_id != cur.cluster_id {
            return Err(ErrorReply::new(
                ErrorCode::WrongCluster,
                format!("this disk belongs to cluster {:032x}", cur.cluster_id),
            ));
        }
        if a.tract_size != self.store.tract_size() {
            return Err(ErrorReply::new(
                ErrorCode::WrongCluster,
                format!(
                    "this disk has {}-byte tracts, the cluster {}",
                    self.store.tract_size(),
                    a.tract_size
                ),
            ));
        }
        if a.tlt_version < cur.tlt_version {
            return Err(ErrorReply {
                code: ErrorCode::StaleVersion,
                current_version: cur.tlt_version,
                message: "assignment is older than the one stored".into(),
            });
        }
        self.store.save_assignment(&encode(&a)).await.map_err(store_err)?;
        let rows = a.rows.len();
        let version = a.tlt_version;
        let filling = a.rows.iter().filter(|r| r.filling.contains(&me)).count();
        self.fill.update(me, &a);
        self.rows.replace(RowIndex::new(me, a));
        // An assignment from the metadata server makes this server a
        // member again (a fenced server gets one once it is safe).
        if self.update_standing(Standing::assigned) == Turn::Unfenced {
            tracing::info!("the metadata server gave this tractserver its current assignment; serving again");
        }
        tracing::info!(rows, filling, tlt_version = version, "stored new TLT assignment");
        Ok(Reply::Done)
    }

    /// Writes or deletes a blob's metadata tract here and updates memory.
    async fn apply_meta(&self, blob: BlobId, new: Option<BlobMeta>, version: u64) -> Result<(), ErrorReply> {
        let old = self.metas.get(blob);
        match new {
            Some(m) => {
                if let Some(o) = old.filter(|o| o.incarnation != m.incarnation) {
                    self.store.delete(blob, o.incarnation, TractNo::META).await.map_err(store_err)?;
                }
                let rec = encode_meta(&m);
                let crcs = blizzard_core::crc::piece_crcs(0, &rec);
                self.store
                    .write(blob, m.incarnation, TractNo::META, version, 0, rec, &crcs)
                    .await
                    .map_err(store_err)?;
                self.metas.set(blob, Some(m));
            }
            None => {
                if let Some(o) = old {
                    self.store.delete(blob, o.incarnation, TractNo::META).await.map_err(store_err)?;
                }
                self.metas.set(blob, None);
            }
        }
        Ok(())
    }

    /// A metadata change at the primary: serialize, prepare everywhere,
    /// commit here, commit everywhere.
    async fn meta_change(
        &self,
        blob: BlobId,
        row_version: u64,
        op: MetaOp,
        caller: &Caller,
    ) -> Result<Reply, ErrorReply> {
        self.metas
            .serialized(blob, async {
                // Under the blob's lock, which orders every change to it: a
                // create or delete the client has retried elsewhere since
                // is not applied after what followed it.
                if caller.is_current() {
                    self.meta_change_serialized(blob, row_version, op).await
                } else {
                    Err(store_err(StoreError::Superseded))
                }
            })
            .await
    }

    async fn meta_change_serialized(
        &self,
        blob: BlobId,
        row_version: u64,
        op: MetaOp,
    ) -> Result<Reply, ErrorReply> {
        // Checked under the blob's lock: the row may have moved while we waited.
        let (primary, holders) = self.check(blob, TractNo::META, row_version)?;
        if !primary {
            return Err(not_primary(blob));
        }
        self.fill.ensure_copied(blob, TractNo::META).await?;
        let me = self.store.disk_id();
        // Pending members (cluster growth) too: they must hold the blob's
        // metadata when they take over their column.
        let others: Vec<TsId> = holders.into_iter().filter(|m| *m != me).collect();
        if self.metas.is_unconfirmed(blob) {
            // A replica may lack the change this copy holds: a client's
            // retry (or the next change) first brings them all to it, so
            // what a client was told is on every replica.
            let cur = self.metas.get(blob);
            self.replicate_meta(blob, row_version, cur, cur, &others).await?;
        }
        let cur = self.metas.get(blob);
        let max = self.row_index().assignment.replication;
        let new = match blob_meta::plan(blob, op, cur, max)? {
            Planned::Unchanged(c) => return Ok(Reply::Blob(c)),
            Planned::Change(new) => new,
        };
        self.replicate_meta(blob, row_version, cur, new, &others).await?;
        // A delete answers with the metadata the blob had.
        new.or(cur)
            .map(Reply::Blob)
            .ok_or_else(|| ErrorReply::new(ErrorCode::Internal, "metadata change with no before or after"))
    }

    /// Two-phase commit of a blob's metadata over its row: every other
    /// holder prepares, then this copy commits, then the others. `Ok` only
    /// when every holder committed.
    async fn replicate_meta(
        &self,
        blob: BlobId,
        row_version: u64,
        cur: Option<BlobMeta>,
        new: Option<BlobMeta>,
        others: &[TsId],
    ) -> Result<(), ErrorReply> {
        let expected_version = cur.map(|c| c.version).unwrap_or(0);
        let txn = self.env.random_u64();
        // Phase one: every other replica must accept before anything changes.
        let prepare = Request::MetaPrepare { blob, row_version, txn, expected_version, new };
        let results = futures::future::join_all(others.iter().map(|m| self.peers.call(*m, &prepare))).await;
        if let Some((who, e)) =
            others.iter().zip(&results).find_map(|(m, r)| r.as_ref().err().map(|e| (m, e)))
        {
            let abort = Request::MetaAbort { blob, row_version, txn };
            let _ = futures::future::join_all(others.iter().map(|m| self.peers.call(*m, &abort))).await;
            let code = match e.remote().map(|r| r.code) {
                Some(ErrorCode::StaleVersion) | Some(ErrorCode::NotOwner) => ErrorCode::StaleVersion,
                _ => ErrorCode::Aborted,
            };
            return Err(ErrorReply::new(code, format!("replica {who} refused to prepare: {e}")));
        }
        // Phase two: commit here first (this copy is authoritative for the
        // row), then on the others.
        self.apply_meta(blob, new, row_version).await?;
        let commit = Request::MetaCommit { blob, row_version, txn };
        let results = futures::future::join_all(others.iter().map(|m| self.peers.call(*m, &commit))).await;
        // Acknowledged only once every replica committed: a replica that
        // missed it (its lease lapsed, say) would lose the change if it
        // became the primary. The client retries; the retry brings every
        // replica to this copy first (`meta_unconfirmed`).
        let missed = others.iter().zip(results).find_map(|(m, r)| r.err().map(|e| (m, e)));
        if let Some((m, e)) = missed {
            tracing::warn!(%blob, replica = %m, error = %e, "replica failed to commit metadata; the client's retry will bring it up to date");
            self.metas.set_confirmed(blob, false);
            return Err(ErrorReply::new(
                ErrorCode::Aborted,
                format!("metadata of {blob} committed here but not on replica {m} ({e}); retry"),
            ));
        }
        self.metas.set_confirmed(blob, true);
        Ok(())
    }
}

/// The refusal of a request whose writer epoch is older than `newest`.
/// Each write's data in a `WriteTracts` (slices of `data`, no copies), or
/// why the batch is malformed: too many writes, or lengths that do not add
/// up to the data part.
fn split_batch(writes: &[BatchedWrite], data: &Bytes) -> Result<Vec<Bytes>, ErrorReply> {
    if writes.len() > WRITE_BATCH_MAX {
        return Err(ErrorReply::new(
            ErrorCode::BadRequest,
            format!("{} writes in one batch; at most {WRITE_BATCH_MAX}", writes.len()),
        ));
    }
    let total: u64 = writes.iter().map(|w| u64::from(w.len)).sum();
    if total != data.len() as u64 {
        return Err(ErrorReply::new(
            ErrorCode::BadRequest,
            format!("the batch's writes add up to {total} bytes but {} came", data.len()),
        ));
    }
    let mut at = 0usize;
    Ok(writes
        .iter()
        .map(|w| {
            let part = data.slice(at..at + w.len as usize);
            at += w.len as usize;
            part
        })
        .collect())
}

fn fenced(a: &TractAddr, newest: u64) -> ErrorReply {
    ErrorReply {
        code: ErrorCode::Fenced,
        current_version: newest,
        message: format!(
            "blob {} was opened for writing with epoch {newest}; this request's epoch {} may no longer change it",
            a.blob, a.writer
        ),
    }
}

/// A change's error: `Fenced` if the writer fence refused it under the
/// slot lock (`TractService::may_change`), else the store's own.
fn change_err(e: StoreError, a: &TractAddr, refused_by: &AtomicU64) -> ErrorReply {
    match (e, refused_by.load(Ordering::Relaxed)) {
        (StoreError::Superseded, newest) if newest > 0 => fenced(a, newest),
        (e, _) => store_err(e),
    }
}

fn not_primary(blob: BlobId) -> ErrorReply {
    ErrorReply::new(
        ErrorCode::NotOwner,
        format!("not the primary for blob {blob}'s metadata; refresh the TLT"),
    )
}

impl Service for TractService {
    fn call(
        self: Arc<Self>,
        req: Request,
        data: Bytes,
        caller: Caller,
    ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
        async move {
            self.inflight.fetch_add(1, Ordering::Relaxed);
            let caller = if self.store.planted(crate::store::PlantedBug::NoFence) {
                Caller::internal()
            } else {
                caller
            };
            let r = self.clone().handle(req, data, caller).await;
            self.inflight.fetch_sub(1, Ordering::Relaxed);
            r
        }
        .boxed()
    }

    /// The store returns stored bytes only once their chunk CRCs verified
    /// (a chunk that fails is `Corrupt`), and the reply's CRCs are those.
    fn verifies_replies(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests;
