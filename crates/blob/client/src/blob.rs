//! An open blob: tract reads and writes, size and extension.
//!
//! Durability contract: `write` returns `Ok` only after every replica of
//! the tract's row (the first *r*, r = the blob's replication) has made the
//! data durable. A failed `write` may have reached some replicas (FDS §3.5:
//! the tract's content is then either old or new, possibly differing
//! between replicas until it is written again).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use blizzard_core::crc::{first_bad_piece, piece_crcs};
use blizzard_core::{BlobId, Incarnation, TractNo};
use blizzard_proto::{BlobMeta, ErrorCode, ExtendMode, Reply, Request, TractAddr};

use crate::client::{classify, Client, ClientError, Next};

/// A handle on one blob. Cheap to clone; clones share the cached size.
#[derive(Clone)]
pub struct Blob {
    client: Client,
    meta: Arc<Mutex<BlobMeta>>,
}

/// Where a cached write was applied: each tractserver's address and the
/// boot id it reported. [`Blob::sync`] of these makes the write durable.
pub type CacheReceipt = Vec<(String, u64)>;

impl Blob {
    pub(crate) fn new(client: Client, meta: BlobMeta) -> Blob {
        Blob { client, meta: Arc::new(Mutex::new(meta)) }
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
        TractAddr { blob: m.blob, incarnation: m.incarnation, tract: TractNo(tract as i64), row_version }
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
        let mut servers: HashMap<String, Option<u64>> = HashMap::new();
        for (addr, boot) in receipt {
            let e = servers.entry(addr).or_insert(Some(boot));
            if *e != Some(boot) {
                // Two boot ids for one server: it restarted in between.
                *e = None;
            }
        }
        let c = &self.client;
        let calls = servers.into_iter().map(|(addr, boot)| async move {
            // One attempt: a failed sync leaves the writes' fate unknown,
            // and only the caller can write them again.
            let (reply, _) = c
                .inner
                .pool
                .call(&addr, &Request::SyncDisk, Bytes::new())
                .await
                .map_err(|e| ClientError::Unavailable { attempts: 1, last: e.to_string() })?;
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
        let attempts = c.inner.cfg.attempts.max(1);
        let mut last = String::new();
        for attempt in 0..attempts {
            let tlt = c.tlt();
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let (addr, crcs) = (self.addr(tract, row.version), crcs.clone());
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
            let mut next: Option<Next> = None;
            let mut receipt = CacheReceipt::new();
            for (res, addr) in results {
                let e = match res {
                    Ok((Reply::Boot { boot }, _)) => {
                        receipt.push((addr, boot));
                        continue;
                    }
                    Ok(_) => continue,
                    Err(e) => e,
                };
                last = e.to_string();
                // The most decisive outcome wins: fail > refresh > back off.
                next = Some(match (next, classify(&e)) {
                    (Some(Next::Fail(f)), _) | (_, Next::Fail(f)) => Next::Fail(f),
                    (Some(Next::Refresh), _) | (_, Next::Refresh) => Next::Refresh,
                    _ => Next::Backoff,
                });
            }
            match next {
                None => return Ok(receipt),
                Some(Next::Fail(e)) => return Err(e),
                Some(Next::Refresh) => {
                    c.inner.stats.stale_rejections.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = c.refresh_tlt(tlt.version).await {
                        last = e.to_string();
                    }
                    if attempt > 0 {
                        c.backoff(attempt).await;
                    }
                }
                Some(Next::Backoff) => c.backoff(attempt).await,
            }
        }
        Err(ClientError::Unavailable { attempts, last })
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
        let attempts = c.inner.cfg.attempts.max(1);
        let mut last = String::new();
        for attempt in 0..attempts {
            let tlt = c.tlt();
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = Request::ReadTract { addr: self.addr(tract, row.version), offset, len };
            let members: Vec<u32> = row.members.iter().take(r).copied().collect();
            // Start at a random replica so reads spread over the row.
            let start = c.env().random_below(members.len().max(1) as u64) as usize;
            let mut stale = false;
            let mut transient = false;
            for i in 0..members.len() {
                let m = members[(start + i) % members.len()];
                let addr = &tlt.members[m as usize].addr;
                if i > 0 {
                    c.inner.stats.read_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                match c.inner.pool.call(addr, &req, Bytes::new()).await {
                    Ok((Reply::Read { crcs }, data)) => {
                        // End to end: verify what crossed the network
                        // against the CRCs the writer computed.
                        if data.len() == len as usize && first_bad_piece(offset, &data, &crcs).is_none() {
                            return Ok(data);
                        }
                        last = format!("replica {addr} returned data that fails its CRC");
                        tracing::warn!(blob = %self.id(), tract, %addr, "CRC mismatch on read; trying another replica");
                    }
                    Ok((other, _)) => last = format!("unexpected reply {other:?} from {addr}"),
                    Err(e) => {
                        last = e.to_string();
                        match e.remote().map(|r| r.code) {
                            Some(ErrorCode::StaleVersion) | Some(ErrorCode::NotOwner) => stale = true,
                            Some(ErrorCode::Corrupt) | Some(ErrorCode::Io) | Some(ErrorCode::OutOfRange) => {}
                            Some(ErrorCode::BadRequest) => {
                                return Err(ClientError::Invalid(last));
                            }
                            _ => transient = true,
                        }
                    }
                }
            }
            if stale {
                c.inner.stats.stale_rejections.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = c.refresh_tlt(tlt.version).await {
                    last = e.to_string();
                }
                if attempt > 0 {
                    c.backoff(attempt).await;
                }
            } else if transient {
                if let Err(e) = c.refresh_tlt(tlt.version).await {
                    last = e.to_string();
                }
                c.backoff(attempt).await;
            } else {
                // Every replica answered and none had it intact.
                return Err(ClientError::NoIntactReplica { blob: self.id(), tract, last });
            }
        }
        Err(ClientError::Unavailable { attempts, last })
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
        let attempts = c.inner.cfg.attempts.max(1);
        let mut last = String::new();
        for attempt in 0..attempts {
            let tlt = c.tlt();
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = make(self.addr(tract, row.version));
            let calls = row.members.iter().take(r).map(|&m| {
                let addr = tlt.members[m as usize].addr.clone();
                let req = &req;
                async move { (addr.clone(), c.inner.pool.call(&addr, req, Bytes::new()).await) }
            });
            let mut out = Vec::with_capacity(r);
            let mut retry = false;
            for (addr, res) in futures::future::join_all(calls).await {
                match res {
                    Ok((reply, data)) => out.push((addr, reply, data)),
                    Err(e) => {
                        last = e.to_string();
                        match classify(&e) {
                            Next::Fail(err) => return Err(err),
                            _ => retry = true,
                        }
                    }
                }
            }
            if !retry {
                return Ok(out);
            }
            let _ = c.refresh_tlt(tlt.version).await;
            c.backoff(attempt).await;
        }
        Err(ClientError::Unavailable { attempts, last })
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

    /// Frees a tract on every replica (used when deleting the blob).
    pub(crate) async fn delete_tract(&self, tract: u64) -> Result<(), ClientError> {
        self.on_all_replicas(tract, |addr| Request::DeleteTract { addr }).await
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
        let attempts = c.inner.cfg.attempts.max(1);
        let mut last = String::new();
        for attempt in 0..attempts {
            let tlt = c.tlt();
            let row = &tlt.rows[tlt.locate(self.id(), TractNo(tract as i64))];
            let req = make(self.addr(tract, row.version));
            let calls = row.writers(r).map(|m| {
                let addr = tlt.members[m as usize].addr.clone();
                let req = &req;
                async move { c.inner.pool.call(&addr, req, Bytes::new()).await }
            });
            let errs: Vec<_> =
                futures::future::join_all(calls).await.into_iter().filter_map(|r| r.err()).collect();
            if errs.is_empty() {
                return Ok(());
            }
            last = errs[0].to_string();
            if errs.iter().any(|e| matches!(classify(e), Next::Fail(_))) {
                break;
            }
            let _ = c.refresh_tlt(tlt.version).await;
            c.backoff(attempt).await;
        }
        Err(ClientError::Unavailable { attempts, last })
    }
}
