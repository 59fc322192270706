//! An open blob: tract reads and writes, size and extension, and
//! reconciliation of a tract's replicas.
//!
//! Durability contract: `write` returns `Ok` only after every replica of
//! the tract's row (the first *r*, r = the blob's replication) has made the
//! data durable. A failed `write` may have reached some replicas (FDS §3.5:
//! the tract's content is then either old or new, possibly differing
//! between replicas until it is written again, or until [`Blob::reconcile`]
//! makes them agree).
//!
//! Writer fencing: a handle carries a writer epoch ([`Blob::set_writer`])
//! in every request. Tractservers refuse changes from an epoch older than
//! the newest they have seen for the blob (`ClientError::Fenced`), so once
//! a new writer has reconciled a tract, nothing of the writer it replaced
//! lands there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use blizzard_core::crc::{first_bad_piece, piece_crcs};
use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::reconcile::{plan, ChunkState, Plan, Reconciled, RepairAction};
use blizzard_core::{BlobId, Incarnation, Placement, TractNo};
use blizzard_proto::{BlobMeta, ErrorCode, ExtendMode, Onward, Reply, Request, TractAddr};

use crate::client::{classify, Client, ClientError, Failed, Next};
use crate::pool::Answer;

/// Rounds of repairs [`Blob::reconcile`] makes before it gives up; each is
/// followed by a round of digests that checks it took.
pub const RECONCILE_ROUNDS: u32 = 8;

/// Longest run of chunks one repair copies (1 MiB): bounds its buffer.
const REPAIR_RUN_CHUNKS: u32 = 256;

/// A handle on one blob. Cheap to clone; clones share the cached size and
/// the writer epoch.
#[derive(Clone)]
pub struct Blob {
    client: Client,
    meta: Arc<Mutex<BlobMeta>>,
    writer: Arc<AtomicU64>,
}

/// Where a cached write was applied: each tractserver's address and the
/// boot id it reported. [`Blob::sync`] of these makes the write durable.
pub type CacheReceipt = Vec<(String, u64)>;

impl Blob {
    pub(crate) fn new(client: Client, meta: BlobMeta) -> Blob {
        Blob { client, meta: Arc::new(Mutex::new(meta)), writer: Arc::new(AtomicU64::new(0)) }
    }

    /// Makes this handle (and its clones) write as writer `epoch`: every
    /// request it sends carries it. Tractservers refuse changes of a blob
    /// from an epoch older than the newest they have seen for it
    /// (`ClientError::Fenced`); the process opening a blob for writing
    /// takes an epoch above every earlier writer's. 0 (the default): none.
    pub fn set_writer(&self, epoch: u64) {
        self.writer.store(epoch, Ordering::Release);
    }

    /// The writer epoch this handle sends.
    pub fn writer(&self) -> u64 {
        self.writer.load(Ordering::Acquire)
    }

    fn meta(&self) -> BlobMeta {
        match self.meta.lock() {
            Ok(g) => *g,
            Err(p) => *p.into_inner(),
        }
    }

    fn set_meta(&self, m: BlobMeta) {
        let mut g = match self.meta.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        // Sizes only grow; never let a late reply shrink the cached size.
        if m.version >= g.version {
            *g = m;
        }
    }

    pub fn id(&self) -> BlobId {
        self.meta().blob
    }

    pub fn incarnation(&self) -> Incarnation {
        self.meta().incarnation
    }

    pub fn replication(&self) -> u8 {
        self.meta().replication
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The size in tracts as last seen by this handle.
    pub fn size_tracts(&self) -> u64 {
        self.meta().size_tracts
    }

    /// Asks the blob's metadata primary for the current size.
    pub async fn refresh_size(&self) -> Result<u64, ClientError> {
        let m = self.client.get_meta(self.id()).await?;
        self.set_meta(m);
        Ok(self.size_tracts())
    }

    /// Grows the blob by `n` tracts atomically and returns the new size; the
    /// caller owns tracts `new - n .. new` (FDS's atomic append).
    pub async fn extend_by(&self, n: u64) -> Result<u64, ClientError> {
        self.extend(ExtendMode::By, n).await
    }

    /// Grows the blob to at least `n` tracts; returns the new size.
    pub async fn extend_to(&self, n: u64) -> Result<u64, ClientError> {
        self.extend(ExtendMode::To, n).await
    }

    async fn extend(&self, mode: ExtendMode, tracts: u64) -> Result<u64, ClientError> {
        let blob = self.id();
        let m = self
            .client
            .meta_call(blob, |row_version| Request::ExtendBlob { blob, row_version, mode, tracts })
            .await
            .map_err(|(e, _)| e)?;
        self.set_meta(m);
        Ok(m.size_tracts)
    }

    fn addr(&self, tract: u64, row_version: u64) -> TractAddr {
        let m = self.meta();
        TractAddr {
            blob: m.blob,
            incarnation: m.incarnation,
            tract: TractNo(tract as i64),
            row_version,
            writer: self.writer(),
        }
    }

    fn check(&self, offset: u32, len: usize) -> Result<(), ClientError> {
        let ts = self.client.tract_size() as u64;
        if len == 0 || offset as u64 + len as u64 > ts {
            return Err(ClientError::Invalid(format!(
                "range [{offset}, +{len}) is outside a {ts}-byte tract"
            )));
        }
        Ok(())
    }

    async fn check_size(&self, tract: u64) -> Result<(), ClientError> {
        if tract < self.size_tracts() {
            return Ok(());
        }
        // Another client may have extended it.
        let size = self.refresh_size().await?;
        if tract < size {
            Ok(())
        } else {
            Err(ClientError::PastEnd { blob: self.id(), tract, size })
        }
    }

    /// Writes `data` at `offset` inside tract `tract`. Returns once durable
    /// on every replica.
    pub async fn write(&self, tract: u64, offset: u32, data: Bytes) -> Result<(), ClientError> {
        self.write_to_replicas(tract, offset, data, false).await.map(|_| ())
    }

    /// Like [`Blob::write`], but returns once every replica has applied
    /// the write, before it is durable there (a disk's volatile write
    /// cache): it survives a tractserver process kill but not a power
    /// loss. It is durable once [`Blob::sync`] of the returned receipt
    /// succeeds.
    pub async fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> Result<CacheReceipt, ClientError> {
        self.write_to_replicas(tract, offset, data, true).await
    }

    /// Makes the cached writes behind `receipt` (receipts may be merged)
    /// durable: one `SyncDisk` to each tractserver named. Fails if a
    /// tractserver cannot sync or restarted since it took the write (its
    /// boot id changed): the caller must then write that data again.
    pub async fn sync(&self, receipt: CacheReceipt) -> Result<(), ClientError> {
        let c = &self.client;
        let calls = sync_targets(receipt).into_iter().map(|(addr, boot)| async move {
            // One attempt: a failed sync leaves the writes' fate unknown,
            // and only the caller can write them again.
            let (reply, _) = c
                .inner
                .pool
                .call(&addr, &Request::SyncDisk, Bytes::new())
                .await
                .map_err(|e| ClientError::Unavailable { attempts: 1, last: e.to_string() })?;
            if let Reply::Boot { boot: now } = reply {
                c.saw_boot(&addr, now);
            }
            match (reply, boot) {
                (Reply::Boot { boot: now }, Some(then)) if now == then => Ok(()),
                (Reply::Boot { .. }, _) => Err(ClientError::Restarted { addr }),
                (other, _) => Err(ClientError::Invalid(format!("{addr} answered a sync with {other:?}"))),
            }
        });
        for r in futures::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    /// Writes every replica of the tract's row; for a cached write, returns
    /// the receipt of the attempt that succeeded.
    async fn write_to_replicas(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
        cached: bool,
    ) -> Result<CacheReceipt, ClientError> {
        self.check(offset, data.len())?;
        self.check_size(tract).await?;
        let crcs = piece_crcs(offset, &data);
        let r = self.replication() as usize;
        let _permit = self.client.permit().await?;
        let c = &self.client;
        let (data, crcs) = (&data, &crcs);
        // Size-aware replication (`ClientConfig::forward_above`).
        let forward =
            !cached && r > 1 && c.inner.cfg.forward_above.is_some_and(|min| data.len() > min as usize);
        c.retry(|tlt, _| async move {
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let (addr, crcs) = (self.addr(tract, row.version), crcs.clone());
            if forward {
                let primary = row.members[0];
                let pool = &c.inner.pool;
                let to: Vec<Onward> = row
                    .writers(r)
                    .filter(|m| *m != primary)
                    .map(|m| {
                        let addr = tlt.members[m as usize].addr.clone();
                        Onward { epoch: pool.epoch(&addr), addr }
                    })
                    .collect();
                let req = Request::WriteTractForward { addr, offset, crcs, to: to.clone(), on_behalf: None };
                return match pool.call(&tlt.members[primary as usize].addr, &req, data.clone()).await {
                    Ok(_) => {
                        c.inner.stats.forwarded_writes.fetch_add(1, Ordering::Relaxed);
                        Ok(CacheReceipt::new())
                    }
                    Err(e) => {
                        // Invariant: a copy this attempt forwarded may
                        // still land on a backup; the retry, and anything
                        // after, reach it at a newer epoch, which refuses
                        // that copy (`Pool::fence`).
                        for o in &to {
                            pool.fence(&o.addr);
                        }
                        Err(Failed::of(&e))
                    }
                };
            }
            let req = if cached {
                Request::WriteTractCached { addr, offset, crcs }
            } else {
                Request::WriteTract { addr, offset, crcs }
            };
            // Pending members (cluster growth) take every write too, so
            // they hold it when they replace their column's member.
            let calls = row.writers(r).map(|m| {
                let addr = tlt.members[m as usize].addr.clone();
                let req = &req;
                let data = data.clone();
                async move { (c.inner.pool.call(&addr, req, data).await, addr) }
            });
            let results = futures::future::join_all(calls).await;
            let mut failed: Option<Failed> = None;
            let mut receipt = CacheReceipt::new();
            for (res, addr) in results {
                match res {
                    Ok((Reply::Boot { boot }, _)) => receipt.push((addr, boot)),
                    Ok(_) => {}
                    // The most decisive outcome wins: fail > refresh > back off.
                    Err(e) => failed = Some(Failed::of(&e).or(failed)),
                }
            }
            failed.map_or(Ok(receipt), Err)
        })
        .await
    }

    /// Reads `len` bytes at `offset` of tract `tract` from one replica,
    /// falling back to the others on error or CRC mismatch. Never-written
    /// bytes read as zeros.
    pub async fn read(&self, tract: u64, offset: u32, len: u32) -> Result<Bytes, ClientError> {
        self.check(offset, len as usize)?;
        self.check_size(tract).await?;
        let r = self.replication() as usize;
        let _permit = self.client.permit().await?;
        let c = &self.client;
        c.retry(|tlt, _| async move {
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = Request::ReadTract { addr: self.addr(tract, row.version), offset, len };
            let members: Vec<u32> = row.members.iter().take(r).copied().collect();
            // Start at a random replica so reads spread over the row; a
            // hybrid blob's primary is the fast disk, so its reads start
            // there and fall back to the slow backups (Ursa §3.1).
            let start = if Placement::of(self.id()) == Placement::Hybrid {
                0
            } else {
                c.env().random_below(members.len().max(1) as u64) as usize
            };
            let mut stale = false;
            let mut transient = false;
            let mut last = String::new();
            for i in 0..members.len() {
                let m = members[(start + i) % members.len()];
                let addr = &tlt.members[m as usize].addr;
                if i > 0 {
                    c.inner.stats.read_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                match c.inner.pool.ask(addr, &req).await {
                    Ok(Answer { reply: Reply::Read { crcs }, data, verified }) => {
                        // End to end: verify what crossed the network
                        // against the CRCs the writer computed. A server in
                        // this process checked these very bytes against
                        // them, and nothing carried them since (`verified`).
                        if data.len() == len as usize
                            && (verified || first_bad_piece(offset, &data, &crcs).is_none())
                        {
                            return Ok(data);
                        }
                        last = format!("replica {addr} returned data that fails its CRC");
                        tracing::warn!(blob = %self.id(), tract, %addr, "CRC mismatch on read; trying another replica");
                    }
                    Ok(Answer { reply: other, .. }) => last = format!("unexpected reply {other:?} from {addr}"),
                    Err(e) => {
                        last = e.to_string();
                        match e.remote().map(|r| r.code) {
                            Some(ErrorCode::StaleVersion) | Some(ErrorCode::NotOwner) => stale = true,
                            Some(ErrorCode::Corrupt) | Some(ErrorCode::Io) | Some(ErrorCode::OutOfRange) => {}
                            Some(ErrorCode::BadRequest) => {
                                return Err(Failed::new(Next::Fail(ClientError::Invalid(last.clone())), last));
                            }
                            _ => transient = true,
                        }
                    }
                }
            }
            let next = if stale {
                Next::Refresh
            } else if transient {
                Next::RefreshBackoff
            } else {
                // Every replica answered and none had it intact.
                Next::Fail(ClientError::NoIntactReplica { blob: self.id(), tract, last: last.clone() })
            };
            Err(Failed::new(next, last))
        })
        .await
    }

    /// Sends a request to every replica of the tract's row at once (not to
    /// pending members, which may not have copied it yet) and returns each
    /// one's reply, in row order. Retries the whole round
    /// (after refreshing the TLT) while any replica fails in a way a retry
    /// can mend. The caller holds a simultaneous-request permit.
    async fn ask_every_replica(
        &self,
        tract: u64,
        make: impl Fn(TractAddr) -> Request,
    ) -> Result<Vec<(String, Reply, Bytes)>, ClientError> {
        let r = self.replication() as usize;
        let c = &self.client;
        let make = &make;
        c.retry(|tlt, _| async move {
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = make(self.addr(tract, row.version));
            let calls = row.members.iter().take(r).map(|&m| {
                let addr = tlt.members[m as usize].addr.clone();
                let req = &req;
                async move { (addr.clone(), c.inner.pool.call(&addr, req, Bytes::new()).await) }
            });
            let mut out = Vec::with_capacity(r);
            let mut retry: Option<String> = None;
            for (addr, res) in futures::future::join_all(calls).await {
                match res {
                    Ok((reply, data)) => out.push((addr, reply, data)),
                    Err(e) => match classify(&e) {
                        Next::Fail(err) => return Err(Failed::new(Next::Fail(err), e.to_string())),
                        _ => retry = Some(e.to_string()),
                    },
                }
            }
            match retry {
                None => Ok(out),
                Some(last) => Err(Failed::new(Next::RefreshBackoff, last)),
            }
        })
        .await
    }

    /// Reads the range from every replica of its row, each verified end to
    /// end: for recovery code that must know whether replicas agree (a
    /// write that reached only some of them). One entry per replica, in row
    /// order.
    pub async fn read_replicas(&self, tract: u64, offset: u32, len: u32) -> Result<Vec<Bytes>, ClientError> {
        self.check(offset, len as usize)?;
        self.check_size(tract).await?;
        let _permit = self.client.permit().await?;
        let replies = self.ask_every_replica(tract, |addr| Request::ReadTract { addr, offset, len }).await?;
        let mut out = Vec::with_capacity(replies.len());
        for (addr, reply, data) in replies {
            match reply {
                Reply::Read { crcs }
                    if data.len() == len as usize && first_bad_piece(offset, &data, &crcs).is_none() =>
                {
                    out.push(data)
                }
                _ => {
                    return Err(ClientError::NoIntactReplica {
                        blob: self.id(),
                        tract,
                        last: format!("replica {addr} returned data that fails its CRC"),
                    })
                }
            }
        }
        Ok(out)
    }

    /// Writes a whole tract.
    pub async fn write_tract(&self, tract: u64, data: Bytes) -> Result<(), ClientError> {
        if data.len() != self.client.tract_size() as usize {
            return Err(ClientError::Invalid(format!(
                "a whole tract is {} bytes, not {}",
                self.client.tract_size(),
                data.len()
            )));
        }
        self.write(tract, 0, data).await
    }

    /// Reads a whole tract.
    pub async fn read_tract(&self, tract: u64) -> Result<Bytes, ClientError> {
        self.read(tract, 0, self.client.tract_size()).await
    }

    /// Unmaps `[offset, offset + len)` of a tract on every replica: it reads
    /// as zeros afterwards and its space is reusable. Durable on return.
    pub async fn trim(&self, tract: u64, offset: u32, len: u32) -> Result<(), ClientError> {
        self.check(offset, len as usize)?;
        self.check_size(tract).await?;
        let _permit = self.client.permit().await?;
        self.on_all_replicas(tract, |addr| Request::TrimTract { addr, offset, len }).await
    }

    /// Which 4 KiB chunks of a tract hold written data (bit i, LSB first,
    /// is chunk i; an empty bitmap means none). The union over the row's
    /// replicas, so a chunk any replica holds counts as data: callers use
    /// it to skip holes, and over-reporting data is always safe.
    pub async fn mapped(&self, tract: u64) -> Result<Vec<u8>, ClientError> {
        self.check_size(tract).await?;
        let _permit = self.client.permit().await?;
        let replies = self.ask_every_replica(tract, |addr| Request::MappedTract { addr }).await?;
        let mut union: Vec<u8> = Vec::new();
        for (addr, reply, _) in replies {
            let Reply::Mapped { bitmap } = reply else {
                return Err(ClientError::Invalid(format!("unexpected reply {reply:?} from {addr}")));
            };
            if union.len() < bitmap.len() {
                union.resize(bitmap.len(), 0);
            }
            for (u, b) in union.iter_mut().zip(&bitmap) {
                *u |= b;
            }
        }
        Ok(union)
    }

    /// Makes the replicas of tract `tract` agree, chunk by chunk, after a
    /// write cut off by a crash may have reached some and not others (FDS
    /// §3.5): reads pick a random replica, so such a tract could flip
    /// between old and new with no write.
    ///
    /// A round asks every writer of the tract's row (its first r members,
    /// then its pending members, in row order) for a digest (`DigestTract`,
    /// which first fences the blob's older writers there, so nothing of a
    /// replaced writer lands after this), plans with
    /// `blizzard_core::reconcile::plan` (per chunk, the first replica that
    /// can read it is the source), and carries the repairs out server by
    /// server: a run read from its source alone and verified end to end,
    /// then written to each target alone; a hole at the source trims the
    /// targets. The next round checks the repairs took: a TLT change, a
    /// source that turned out unreadable, or a concurrent change only make
    /// it plan again. Gives up after [`RECONCILE_ROUNDS`] rounds of
    /// repairs (`ClientError::NotReconciled`).
    ///
    /// Durable on return: once a round's digests agree, every server that
    /// answered one is sent a `SyncDisk`, and the tract is reconciled only
    /// if every sync succeeded and came from the process that answered the
    /// digest (the boot id it reports is one the server reported before
    /// its digest: a server first met is asked for its boot id by a sync
    /// before its digest). A digest answers from the server's memory, which
    /// holds cached writes and writes still waiting for their group commit;
    /// a sync that fails, or a server that restarted in between (what it
    /// answered may be gone with it), starts the round again.
    ///
    /// Chunks no replica can read are left as they are (every read of
    /// them fails alike) and counted in `unreadable_chunks`.
    pub async fn reconcile(&self, tract: u64) -> Result<Reconciled, ClientError> {
        self.check_size(tract).await?;
        let _permit = self.client.permit().await?;
        let c = &self.client;
        let chunks = c.tract_size() / CHUNK_SIZE;
        let mut done = Reconciled { tracts: 1, chunks_compared: chunks as u64, ..Reconciled::default() };
        let mut last = String::new();
        for round in 0..=RECONCILE_ROUNDS {
            let Digests { seen, row_version, servers, boots, digests } =
                self.digest_replicas(tract, chunks).await?;
            let p = plan(&digests, chunks, REPAIR_RUN_CHUNKS);
            done.unreadable_chunks = p.unreadable.len() as u64;
            if p.is_empty() {
                // The replicas agree on what their digests say, which is
                // what their memory says: not yet what their disks would
                // keep through a power loss (a write cached or waiting for
                // its group commit, on one replica only). A volume clears a
                // tract's intent bit once this returns, and nothing
                // compares the replicas after that: whatever one of them
                // lost then would differ from the others for good. So the
                // digested state is made durable everywhere first (one
                // group commit per server, shared with every reconcile
                // running there), by the very processes that digested it.
                match self.make_durable(&servers, &boots).await {
                    Ok(()) => {
                        tracing::debug!(
                            blob = %self.id(),
                            tract,
                            rounds = round,
                            chunk_repairs = done.chunk_repairs,
                            bytes_copied = done.bytes_copied,
                            unreadable = done.unreadable_chunks,
                            "tract reconciled"
                        );
                        return Ok(done);
                    }
                    Err(f) => {
                        tracing::debug!(blob = %self.id(), tract, round, error = %f.last, "reconciled tract not made durable; again");
                        last = f.last;
                        if round == RECONCILE_ROUNDS {
                            break;
                        }
                        c.after_failure(round, seen, f.next, &mut last).await?;
                        continue;
                    }
                }
            }
            if round == RECONCILE_ROUNDS {
                let mut differs = describe(&p, &servers);
                if !last.is_empty() {
                    differs = format!("{differs}; last failure: {last}");
                }
                return Err(ClientError::NotReconciled { blob: self.id(), tract, rounds: round, differs });
            }
            tracing::debug!(blob = %self.id(), tract, round, plan = %describe(&p, &servers), "repairing tract");
            if let Err(f) = self.repair(tract, row_version, &servers, &p, &mut done).await {
                last = f.last;
                c.after_failure(round, seen, f.next, &mut last).await?;
            }
        }
        Err(ClientError::NotReconciled {
            blob: self.id(),
            tract,
            rounds: RECONCILE_ROUNDS,
            differs: format!("the replicas agree but could not all be made durable: {last}"),
        })
    }

    /// One digest of the tract from every writer of its row, in row order,
    /// with the boot id each server reported before its digest (asked by a
    /// `SyncDisk` first if this client has not seen one from it yet).
    async fn digest_replicas(&self, tract: u64, chunks: u32) -> Result<Digests, ClientError> {
        let r = self.replication() as usize;
        let c = &self.client;
        c.retry(|tlt, _| async move {
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = Request::DigestTract { addr: self.addr(tract, row.version) };
            let servers: Vec<String> = row.writers(r).map(|m| tlt.members[m as usize].addr.clone()).collect();
            let req = &req;
            let calls = servers.iter().map(|addr| async move {
                // Seen before this digest is sent: if the server reports it
                // again after the digest, one process answered both.
                let boot = match c.boot_of(addr) {
                    Some(b) => b,
                    None => c.sync_disk(addr).await?,
                };
                match c.inner.pool.call(addr, req, Bytes::new()).await {
                    Ok((Reply::Digest { chunks: d }, _)) if d.len() <= chunks as usize => Ok((boot, d)),
                    Ok((Reply::Digest { chunks: d }, _)) => {
                        let e = format!("{addr} sent a digest of {} chunks; a tract has {chunks}", d.len());
                        Err(Failed::new(Next::Fail(ClientError::Invalid(e.clone())), e))
                    }
                    Ok((other, _)) => {
                        let e = format!("{addr} answered a digest with {other:?}");
                        Err(Failed::new(Next::Fail(ClientError::Invalid(e.clone())), e))
                    }
                    Err(e) => Err(Failed::of(&e)),
                }
            });
            let mut boots = Vec::with_capacity(servers.len());
            let mut digests = Vec::with_capacity(servers.len());
            let mut failed: Option<Failed> = None;
            for res in futures::future::join_all(calls).await {
                match res {
                    Ok((boot, d)) => {
                        boots.push(boot);
                        digests.push(d);
                    }
                    Err(f) => failed = Some(f.or(failed)),
                }
            }
            match failed {
                None => Ok(Digests { seen: tlt.version, row_version: row.version, servers, boots, digests }),
                Some(f) => Err(f),
            }
        })
        .await
    }

    /// Makes what `servers` digested durable: a `SyncDisk` to each, which
    /// must come back from the process that reported `boots` (one per
    /// server) before its digest. Fails, classified for the caller, if a
    /// sync fails or a server restarted since.
    async fn make_durable(&self, servers: &[String], boots: &[u64]) -> Result<(), Failed> {
        let c = &self.client;
        let calls = servers.iter().map(|addr| c.sync_disk(addr));
        let mut failed: Option<Failed> = None;
        for ((addr, then), res) in servers.iter().zip(boots).zip(futures::future::join_all(calls).await) {
            match res {
                Ok(now) if now == *then => {}
                Ok(_) => {
                    let e = format!("{addr} restarted after its digest: what it answered may be lost");
                    failed = Some(Failed::new(Next::Backoff, e).or(failed));
                }
                Err(f) => failed = Some(f.or(failed)),
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Carries out `p`'s repairs on `servers` (indexed as the digests
    /// were), counting what took in `done`. Stops at the first failure,
    /// classified for the caller; the next round plans afresh.
    async fn repair(
        &self,
        tract: u64,
        row_version: u64,
        servers: &[String],
        p: &Plan,
        done: &mut Reconciled,
    ) -> Result<(), Failed> {
        let pool = &self.client.inner.pool;
        let addr = self.addr(tract, row_version);
        // A damaged disk at one replica: the next round's digest shows it.
        let damaged = |e: &blizzard_rpc::RpcError| {
            matches!(e.remote().map(|r| r.code), Some(ErrorCode::Corrupt) | Some(ErrorCode::Io))
        };
        let on_err = |e: blizzard_rpc::RpcError| {
            if damaged(&e) {
                Failed::new(Next::Backoff, e.to_string())
            } else {
                Failed::of(&e)
            }
        };
        for r in &p.repairs {
            let (offset, len) = (r.first_chunk * CHUNK_SIZE, r.chunks * CHUNK_SIZE);
            let (req, data) = match r.action {
                RepairAction::Copy => {
                    let source = servers.get(r.source).map(String::as_str).unwrap_or_default();
                    let read = Request::ReadTract { addr, offset, len };
                    let (crcs, data) = match pool.call(source, &read, Bytes::new()).await {
                        Ok((Reply::Read { crcs }, data))
                            if data.len() == len as usize
                                && first_bad_piece(offset, &data, &crcs).is_none() =>
                        {
                            (crcs, data)
                        }
                        Ok(_) => {
                            let e = format!("replica {source} returned data that fails its CRC");
                            return Err(Failed::new(Next::Backoff, e));
                        }
                        Err(e) => return Err(on_err(e)),
                    };
                    (Request::WriteTract { addr, offset, crcs }, data)
                }
                RepairAction::Trim => (Request::TrimTract { addr, offset, len }, Bytes::new()),
            };
            let targets: Vec<&String> = r.targets.iter().filter_map(|t| servers.get(*t)).collect();
            let calls = targets.iter().map(|t| pool.call(t, &req, data.clone()));
            let mut failed: Option<Failed> = None;
            for (target, res) in targets.iter().zip(futures::future::join_all(calls).await) {
                match res {
                    Ok(_) => {
                        done.chunk_repairs += r.chunks as u64;
                        if r.action == RepairAction::Copy {
                            done.bytes_copied += len as u64;
                        }
                    }
                    Err(e) => {
                        tracing::debug!(blob = %self.id(), tract, %target, error = %e, "repair failed");
                        failed = Some(on_err(e).or(failed));
                    }
                }
            }
            if let Some(f) = failed {
                return Err(f);
            }
        }
        Ok(())
    }

    /// Frees a tract on every replica (used when deleting the blob).
    pub(crate) async fn delete_tract(&self, tract: u64) -> Result<(), ClientError> {
        let delete = |addr| Request::DeleteTract { addr };
        match self.on_all_replicas(tract, delete).await {
            // The blob's metadata is gone already, so no writer of it can
            // be harmed any more: free its tracts as its newest writer.
            Err(ClientError::Fenced { newest, .. }) if newest > self.writer() => {
                self.writer.fetch_max(newest, Ordering::AcqRel);
                self.on_all_replicas(tract, delete).await
            }
            r => r,
        }
    }

    /// Sends a data-less request to every replica of a tract's row (and
    /// its pending members: a trim or delete changes what they must hold),
    /// retrying through TLT changes.
    async fn on_all_replicas(
        &self,
        tract: u64,
        make: impl Fn(TractAddr) -> Request,
    ) -> Result<(), ClientError> {
        let c = &self.client;
        let r = self.replication() as usize;
        let make = &make;
        c.retry(|tlt, _| async move {
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = make(self.addr(tract, row.version));
            let calls = row.writers(r).map(|m| {
                let addr = tlt.members[m as usize].addr.clone();
                let req = &req;
                async move { c.inner.pool.call(&addr, req, Bytes::new()).await }
            });
            let errs: Vec<_> =
                futures::future::join_all(calls).await.into_iter().filter_map(|r| r.err()).collect();
            let Some(first) = errs.first() else { return Ok(()) };
            let last = first.to_string();
            // A refusal no retry mends (a fenced writer, a full disk) ends
            // the operation with its own error.
            match errs.iter().map(classify).find(|n| matches!(n, Next::Fail(_))) {
                Some(fail) => Err(Failed::new(fail, last)),
                None => Err(Failed::new(Next::RefreshBackoff, last)),
            }
        })
        .await
    }
}

/// One round of digests ([`Blob::digest_replicas`]): the TLT version used,
/// the row's version, and per writer of the row in row order its address,
/// the boot id it reported before its digest, and the digest.
struct Digests {
    seen: u64,
    row_version: u64,
    servers: Vec<String>,
    boots: Vec<u64>,
    digests: Vec<Vec<ChunkState>>,
}

/// The servers a sync of `receipt` asks, each once, in address order, with
/// the boot id that took its writes (`None`: two boot ids, so it restarted
/// in between). Ordered, not hashed: the syncs go out in this order, and a
/// `HashMap`'s order differs from process to process, which made the
/// simulator's fast-ack runs diverge between replays of one seed (its
/// rule: maps whose order has effects are `BTreeMap`s).
fn sync_targets(receipt: CacheReceipt) -> BTreeMap<String, Option<u64>> {
    let mut servers: BTreeMap<String, Option<u64>> = BTreeMap::new();
    for (addr, boot) in receipt {
        let e = servers.entry(addr).or_insert(Some(boot));
        if *e != Some(boot) {
            // Two boot ids for one server: it restarted in between.
            *e = None;
        }
    }
    servers
}

/// What a plan would still change, briefly (for logs and errors).
fn describe(p: &Plan, servers: &[String]) -> String {
    let name = |i: usize| servers.get(i).map(String::as_str).unwrap_or("?");
    let mut out: Vec<String> = p
        .repairs
        .iter()
        .take(4)
        .map(|r| {
            let targets: Vec<&str> = r.targets.iter().map(|t| name(*t)).collect();
            let what = match r.action {
                RepairAction::Copy => format!("copy from {}", name(r.source)),
                RepairAction::Trim => format!("trim as at {}", name(r.source)),
            };
            format!(
                "chunks {}..{}: {what} to {}",
                r.first_chunk,
                r.first_chunk + r.chunks,
                targets.join(", ")
            )
        })
        .collect();
    if p.repairs.len() > 4 {
        out.push(format!("and {} more runs", p.repairs.len() - 4));
    }
    if !p.unreadable.is_empty() {
        out.push(format!("{} chunks unreadable everywhere", p.unreadable.len()));
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sync asks each server of a receipt once, in address order whatever
    /// the receipt's order, so a seeded simulation replays its syncs in the
    /// same order; a server named with two boot ids is marked restarted.
    /// (With a `HashMap` the order changed from process to process.)
    #[test]
    fn sync_asks_each_server_once_in_address_order() {
        let addrs: Vec<String> = (0..16).map(|i| format!("ts{i:02}:7000")).collect();
        let mut receipt = CacheReceipt::new();
        for round in 0..3u64 {
            // Every server three times, in a different order each round.
            for i in 0..addrs.len() {
                let a = &addrs[(i * 7 + round as usize * 5) % addrs.len()];
                receipt.push((a.clone(), 100));
            }
        }
        receipt.push((addrs[3].clone(), 101));
        let got: Vec<(String, Option<u64>)> = sync_targets(receipt).into_iter().collect();
        let want: Vec<(String, Option<u64>)> =
            addrs.iter().enumerate().map(|(i, a)| (a.clone(), (i != 3).then_some(100))).collect();
        assert_eq!(got, want);
    }
}
