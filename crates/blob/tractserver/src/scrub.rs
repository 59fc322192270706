//! The scrubber (FDS §3.2's "disks fail silently too"): re-reads every
//! written chunk this server holds at a configured byte rate, checks it
//! against its CRC, and rewrites a damaged chunk with the same bytes from
//! another replica of its row.
//!
//! Client reads never return damaged bytes anyway (the store checks each
//! chunk's CRC and the client reads another replica), so what the
//! scrubber protects is redundancy: without it, rot accumulates unseen
//! until the last good copy goes too.
//!
//! It also reclaims orphans (FDS §2.3): tracts of blobs that no longer
//! exist (a delete that did not reach this replica, or an older
//! incarnation of a blob id), asked of the blob's metadata primary; and
//! tracts of rows this server no longer holds (a server declared dead that
//! came back keeps what it had). A tract is freed only after two passes in
//! a row found it orphaned the same way, never on an unclear answer, and a
//! row counts as left only when neither this server's assignment nor the
//! served TLT gives it the row (a change round that failed part-way can
//! take a row out of the assignment of a live server, a replaced member of
//! a pending entry, that the served table still has it in).
//!
//! A repair is safe against concurrent writes because `Store::repair_chunk`
//! takes the tract's slot lock and installs only bytes whose CRC the
//! chunk's entry expects: a replica that already holds a newer write (not
//! yet here) is not used, and a chunk rewritten since the damage was found
//! is left alone. It takes the chunk's current contents; only a chunk that
//! no replica could repair on an earlier pass may take the contents from
//! before its latest write (which the entry also accepts, for a write cut
//! off by a crash): that write then reached no other replica in a whole
//! pass, so it was never acknowledged.
//!
//! A write is less picky (`TractService::heal_chunk`): a partial write into
//! a chunk this server cannot read takes the chunk from a complete
//! replica, whatever it holds, before it merges.

use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::tlt::locator;
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};
use blizzard_proto::{Reply, Request, RowTract};
use blizzard_rpc::Shutdown;

use crate::service::TractService;
use crate::store::StoreError;

/// Bytes read per scrub step: small enough to pace smoothly.
const STEP: u32 = 256 << 10;

/// What the scrubber has done since this server started.
#[derive(Default, Debug)]
pub struct ScrubStats {
    pub bytes: AtomicU64,
    /// Full passes over every tract.
    pub passes: AtomicU64,
    pub damaged: AtomicU64,
    pub repaired: AtomicU64,
    /// Damaged chunks no replica could supply yet (retried next pass).
    pub unrepaired: AtomicU64,
    /// Tracts freed because their blob (at that incarnation) is gone.
    pub orphans_freed: AtomicU64,
    /// Tracts found orphaned on the last pass: freed if found so again.
    suspects: std::sync::Mutex<std::collections::HashMap<(BlobId, TractNo), Incarnation>>,
    /// Damaged chunks no replica could repair on an earlier pass.
    unrepairable: std::sync::Mutex<std::collections::HashSet<(BlobId, TractNo, u32)>>,
}

/// The tracts this server is healing a chunk of right now, each with how
/// many heals of it are under way.
///
/// Invariant: a server never heals a tract for a peer's copy request
/// while it heals that tract itself. Two replicas damaged in different
/// chunks of one tract, both taking a partial write, would otherwise ask
/// each other for the tract, each copy heal first asking the other
/// again, until the requests time out (10 s each, seen as a 20 s write).
/// With the guard a chain of heals visits each server once: a server
/// already in the chain answers `Corrupt` and the asker tries the row's
/// next member.
#[derive(Default)]
pub(crate) struct Heals(std::sync::Mutex<std::collections::HashMap<(BlobId, TractNo), u32>>);

/// Holds one heal of a tract in [`Heals`] until dropped.
pub(crate) struct HealGuard<'a> {
    heals: &'a Heals,
    key: (BlobId, TractNo),
}

impl Heals {
    pub(crate) fn begin(&self, blob: BlobId, tract: TractNo) -> HealGuard<'_> {
        *self.lock().entry((blob, tract)).or_default() += 1;
        HealGuard { heals: self, key: (blob, tract) }
    }

    /// Whether a heal of the tract is under way here.
    pub(crate) fn healing(&self, blob: BlobId, tract: TractNo) -> bool {
        self.lock().contains_key(&(blob, tract))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<(BlobId, TractNo), u32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for HealGuard<'_> {
    fn drop(&mut self) {
        let mut m = self.heals.lock();
        if let Some(n) = m.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

impl TractService {
    /// Scrubs forever at `scrub_bandwidth` bytes per second (0: off).
    pub async fn scrub_loop(self: Arc<Self>, mut shutdown: Shutdown) {
        if self.scrub_bandwidth == 0 {
            return;
        }
        loop {
            // The table for this pass, to find each blob's metadata primary.
            let tlt = self.peers.fetch_tlt().await.ok();
            let mut suspects = std::collections::HashMap::new();
            for (blob, tract) in self.store.tracts() {
                tokio::select! {
                    biased;
                    _ = shutdown.wait() => return,
                    _ = self.scrub_tract(blob, tract, tlt.as_ref(), &mut suspects) => {}
                }
            }
            *self.scrub.suspects.lock().unwrap_or_else(|p| p.into_inner()) = suspects;
            self.scrub.passes.fetch_add(1, Ordering::Relaxed);
            // An empty disk must not spin.
            tokio::select! {
                biased;
                _ = shutdown.wait() => return,
                _ = self.env.sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    async fn scrub_tract(
        &self,
        blob: BlobId,
        tract: TractNo,
        tlt: Option<&blizzard_core::tlt::Tlt>,
        suspects: &mut std::collections::HashMap<(BlobId, TractNo), Incarnation>,
    ) {
        // A tract still being copied here is not ours to judge yet.
        if self.copy_pending(blob, tract).is_some() {
            return;
        }
        let Some(inc) = self.store.incarnation_of(blob, tract).await else { return };
        let me = self.store.disk_id();
        let len = self.with_rows(|r| r.assignment.tlt_len as usize);
        let row = locator(blob, tract, len.max(1)) as u32;
        let held = |svc: &Self| svc.with_rows(|r| r.assignment.rows.iter().any(|r| r.row == row));
        // Not ours: neither this server's assignment nor the table clients
        // are served gives it the row. The assignment alone is not enough:
        // a change round that failed part-way (a pending member's commit,
        // say) can leave it without a row the served table still has it in,
        // and the next round gives the row back.
        let not_mine = len > 0
            && !held(self)
            && tlt.is_some_and(|t| {
                t.rows.len() == len
                    && !t.member_index(me).is_some_and(|i| {
                        let r = &t.rows[row as usize];
                        r.members.contains(&i) || r.pending.iter().any(|p| p.member == i)
                    })
            });
        if let Some(tlt) = tlt {
            if not_mine || self.blob_exists(tlt, blob, inc).await == Some(false) {
                let before = self
                    .scrub
                    .suspects
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&(blob, tract))
                    .copied();
                // Asked again just before: the row may have come back (as
                // a pending entry, say) since the pass began.
                let still = !not_mine || (!held(self) && self.copy_pending(blob, tract).is_none());
                if before == Some(inc) && still {
                    if let Ok(true) = self.store.delete(blob, inc, tract).await {
                        if tract.is_meta() {
                            self.forget_meta(blob);
                        }
                        self.scrub.orphans_freed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%blob, %tract, not_mine, "freed a tract of a blob that no longer exists or of a row this server left");
                    }
                } else {
                    suspects.insert((blob, tract), inc);
                }
                return;
            }
        }
        let bitmap = self.store.mapped(blob, inc, tract).await;
        let chunks = bitmap.len() as u32 * 8;
        let mut c = 0;
        while c < chunks {
            if bitmap[(c / 8) as usize] & (1 << (c % 8)) == 0 {
                c += 1;
                continue;
            }
            let len = STEP.min((chunks - c) * CHUNK_SIZE).min(self.store.tract_size() - c * CHUNK_SIZE);
            match self.store.read(blob, inc, tract, c * CHUNK_SIZE, len).await {
                Ok(_) => c += len / CHUNK_SIZE,
                Err(StoreError::Corrupt { chunk, .. }) => {
                    self.scrub.damaged.fetch_add(1, Ordering::Relaxed);
                    let key = (blob, tract, chunk);
                    let lock = || self.scrub.unrepairable.lock().unwrap_or_else(|p| p.into_inner());
                    let again = lock().contains(&key);
                    if self.repair(blob, inc, tract, chunk, again).await {
                        self.scrub.repaired.fetch_add(1, Ordering::Relaxed);
                        lock().remove(&key);
                    } else {
                        self.scrub.unrepaired.fetch_add(1, Ordering::Relaxed);
                        lock().insert(key);
                    }
                    // Past the damaged chunk either way: a repair is re-read
                    // on the next pass, a failure retried then.
                    c = chunk + 1;
                }
                Err(e) => {
                    tracing::warn!(%blob, %tract, error = %e, "scrubber cannot read a tract; skipping it this pass");
                    return;
                }
            }
            self.scrub.bytes.fetch_add(len as u64, Ordering::Relaxed);
            self.env.sleep(Duration::from_secs_f64(len as f64 / self.scrub_bandwidth as f64)).await;
        }
    }

    /// Whether `blob` exists at incarnation `inc`, asked of its metadata
    /// row's primary; `None` when the answer is unclear (unreachable, a
    /// stale table, the primary still copying).
    async fn blob_exists(
        &self,
        tlt: &blizzard_core::tlt::Tlt,
        blob: BlobId,
        inc: Incarnation,
    ) -> Option<bool> {
        let row = &tlt.rows[tlt.locate(blob, TractNo::META)];
        let primary = tlt.members.get(*row.members.first()? as usize)?;
        match self.peers.call_addr(&primary.addr, &Request::GetBlob { blob, row_version: row.version }).await
        {
            Ok(Reply::Blob(m)) => Some(m.incarnation == inc),
            Err(e) if e.remote().is_some_and(|r| r.code == blizzard_proto::ErrorCode::NoSuchBlob) => {
                Some(false)
            }
            _ => None,
        }
    }

    /// The row's complete members other than this server, in column order
    /// (a lower column holds a superset), and the request that copies the
    /// tract from them.
    fn copy_sources(&self, blob: BlobId, tract: TractNo) -> Option<(Vec<TsId>, Request)> {
        let me = self.store.disk_id();
        let rows = self.row_index();
        let len = rows.assignment.tlt_len as usize;
        if len == 0 {
            return None;
        }
        let row = locator(blob, tract, len) as u32;
        let r = rows.assignment.rows.iter().find(|r| r.row == row)?;
        let peers = r.members.iter().copied().filter(|m| *m != me && !r.filling.contains(m)).collect();
        Some((peers, Request::CopyTract { row, row_version: r.version, tract: RowTract { blob, tract } }))
    }

    /// Chunk `chunk` of the tract as `peer` holds it at incarnation `inc`:
    /// `None` if it cannot say (unreachable, another incarnation),
    /// `Some(None)` if it never stored the chunk.
    async fn peer_chunk(
        &self,
        peer: TsId,
        req: &Request,
        inc: Incarnation,
        chunk: u32,
    ) -> Option<Option<Bytes>> {
        let Ok((Reply::TractCopy { incarnation, bitmap, .. }, data)) = self.peers.call_data(peer, req).await
        else {
            return None;
        };
        if incarnation != inc {
            return None;
        }
        if bitmap.get((chunk / 8) as usize).is_none_or(|b| b & (1 << (chunk % 8)) == 0) {
            return Some(None);
        }
        // The chunk's place among the present chunks sent.
        let before: u32 =
            (0..chunk).filter(|i| bitmap[(*i / 8) as usize] & (1 << (i % 8)) != 0).count() as u32;
        let (s, e) = ((before * CHUNK_SIZE) as usize, ((before + 1) * CHUNK_SIZE) as usize);
        (e <= data.len()).then(|| Some(data.slice(s..e)))
    }

    /// Makes a chunk this server cannot read readable again before a
    /// partial write merges into it (the write failed with `Corrupt`).
    /// Such a chunk (a crash kept an unacknowledged overwrite's data but
    /// lost its entry, or rot) would otherwise refuse every partial write,
    /// and the scrubber cannot repair it once the other replicas took a
    /// newer write: none holds the bytes its entry expects. Its bytes here
    /// are lost anyway, and every complete member of the row holds every
    /// acknowledged write, so the first that answers gives the chunk
    /// (zeros if it never stored it). Bytes of writes not yet acknowledged
    /// may come along, which a write that was not acknowledged allows.
    /// Returns whether the chunk is readable now.
    pub(crate) async fn heal_chunk(
        &self,
        blob: BlobId,
        inc: Incarnation,
        tract: TractNo,
        chunk: u32,
    ) -> bool {
        let Some((peers, req)) = self.copy_sources(blob, tract) else { return false };
        let _healing = self.heals.begin(blob, tract);
        for peer in peers {
            let Some(got) = self.peer_chunk(peer, &req, inc, chunk).await else { continue };
            let data = got.unwrap_or_else(|| Bytes::from(vec![0u8; CHUNK_SIZE as usize]));
            return match self.store.heal_chunk(blob, inc, tract, chunk, data).await {
                Ok(healed) => {
                    if healed {
                        tracing::warn!(%blob, %tract, chunk, from = %peer, "healed an unreadable chunk a write needed");
                    }
                    true
                }
                Err(e) => {
                    tracing::error!(%blob, %tract, chunk, error = %e, "cannot heal an unreadable chunk");
                    false
                }
            };
        }
        false
    }

    /// Fetches the tract from the row's other members, in column order (a
    /// lower column holds a superset), and installs the damaged chunk from
    /// the first that has the bytes this server's entry expects.
    async fn repair(
        &self,
        blob: BlobId,
        inc: Incarnation,
        tract: TractNo,
        chunk: u32,
        allow_prev: bool,
    ) -> bool {
        let Some((peers, req)) = self.copy_sources(blob, tract) else { return false };
        for peer in peers {
            let Some(Some(data)) = self.peer_chunk(peer, &req, inc, chunk).await else { continue };
            match self.store.repair_chunk(blob, inc, tract, chunk, data, allow_prev).await {
                Ok(true) => {
                    tracing::warn!(%blob, %tract, chunk, from = %peer, "repaired a damaged chunk from another replica");
                    return true;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(%blob, %tract, chunk, error = %e, "cannot rewrite a damaged chunk");
                    return false;
                }
            }
        }
        tracing::error!(%blob, %tract, chunk, "damaged chunk: no replica had its bytes; retrying next pass");
        false
    }
}
