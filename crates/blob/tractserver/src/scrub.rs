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
//! Fetching and installing a chunk is `heal.rs`'s ([`Healer::repair`]).
//! A write is less picky (`Healer::heal_chunk`): a partial write into a
//! chunk this server cannot read takes the chunk from a complete replica,
//! whatever it holds, before it merges.

use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;
use std::time::Duration;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::{BlobId, Incarnation, TractNo};
use blizzard_proto::{Reply, Request};
use blizzard_rpc::Shutdown;

use crate::fill::Filler;
use crate::parts::Parts;
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

/// Re-reads, checks and repairs this server's chunks; frees orphans.
pub struct Scrubber {
    parts: Parts,
    /// Asked whether a tract is still being copied here (not ours to judge).
    filler: Arc<Filler>,
    /// Bytes per second re-read (0: no scrubbing).
    bandwidth: u64,
    stats: ScrubStats,
}

impl Scrubber {
    pub(crate) fn new(parts: Parts, filler: Arc<Filler>, bandwidth: u64) -> Scrubber {
        Scrubber { parts, filler, bandwidth, stats: ScrubStats::default() }
    }

    /// What the scrubber has done since this server started.
    pub fn stats(&self) -> &ScrubStats {
        &self.stats
    }

    /// Scrubs forever at `bandwidth` bytes per second (0: off).
    pub async fn scrub_loop(self: Arc<Self>, mut shutdown: Shutdown) {
        if self.bandwidth == 0 {
            return;
        }
        loop {
            // The table for this pass, to find each blob's metadata primary.
            let tlt = self.parts.peers.fetch_tlt().await.ok();
            let mut suspects = std::collections::HashMap::new();
            for (blob, tract) in self.parts.store.tracts() {
                tokio::select! {
                    biased;
                    _ = shutdown.wait() => return,
                    _ = self.scrub_tract(blob, tract, tlt.as_ref(), &mut suspects) => {}
                }
            }
            *self.stats.suspects.lock().unwrap_or_else(|p| p.into_inner()) = suspects;
            self.stats.passes.fetch_add(1, Ordering::Relaxed);
            // An empty disk must not spin.
            tokio::select! {
                biased;
                _ = shutdown.wait() => return,
                _ = self.parts.env.sleep(Duration::from_secs(1)) => {}
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
        if self.filler.copy_pending(blob, tract).is_some() {
            return;
        }
        let Some(inc) = self.parts.store.incarnation_of(blob, tract).await else { return };
        let me = self.parts.store.disk_id();
        let layout = self.parts.rows.layout();
        let len = layout.total;
        let Some(row) = layout.locate(blob, tract) else { return };
        let held = |svc: &Self| svc.parts.rows.with(|r| r.assignment.rows.iter().any(|r| r.row == row));
        // Not ours: neither this server's assignment nor the table clients
        // are served gives it the row. The assignment alone is not enough:
        // a change round that failed part-way (a pending member's commit,
        // say) can leave it without a row the served table still has it in,
        // and the next round gives the row back.
        let not_mine = len > 0
            && !held(self)
            && tlt.is_some_and(|t| {
                t.rows.len() == len
                    && t.sections == layout.sections
                    && !t.member_index(me).is_some_and(|i| {
                        let r = &t.rows[row as usize];
                        r.members.contains(&i) || r.pending.iter().any(|p| p.member == i)
                    })
            });
        if let Some(tlt) = tlt {
            if not_mine || self.blob_exists(tlt, blob, inc).await == Some(false) {
                let before = self
                    .stats
                    .suspects
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&(blob, tract))
                    .copied();
                // Asked again, and freed, under the tract's copy lock: the
                // row may have come back (as a pending entry, or filling
                // for a repair) since the pass began, and a repair that
                // digested the tract must find it as it was until it has
                // patched it (`Filler::under_copy_lock`). A check made
                // before the lock and a delete after it lost the chunks a
                // repair kept (a CI run of `recovery::a_server_back_from_a_
                // short_outage_repairs_only_what_it_missed` saw a repaired
                // replica differ at byte 0).
                let freed = if before == Some(inc) {
                    self.filler
                        .under_copy_lock(blob, tract, async {
                            let still =
                                !not_mine || (!held(self) && self.filler.copy_pending(blob, tract).is_none());
                            if !still {
                                return None;
                            }
                            Some(matches!(self.parts.store.delete(blob, inc, tract).await, Ok(true)))
                        })
                        .await
                } else {
                    None
                };
                match freed {
                    Some(true) => {
                        if tract.is_meta() {
                            self.parts.metas.set(blob, None);
                        }
                        self.stats.orphans_freed.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(%blob, %tract, not_mine, "freed a tract of a blob that no longer exists or of a row this server left");
                    }
                    Some(false) => {}
                    None => {
                        suspects.insert((blob, tract), inc);
                    }
                }
                return;
            }
        }
        let bitmap = self.parts.store.mapped(blob, inc, tract).await;
        let chunks = bitmap.len() as u32 * 8;
        let mut c = 0;
        while c < chunks {
            if bitmap[(c / 8) as usize] & (1 << (c % 8)) == 0 {
                c += 1;
                continue;
            }
            let len = STEP.min((chunks - c) * CHUNK_SIZE).min(self.parts.store.tract_size() - c * CHUNK_SIZE);
            match self.parts.store.read(blob, inc, tract, c * CHUNK_SIZE, len).await {
                Ok(_) => c += len / CHUNK_SIZE,
                Err(StoreError::Corrupt { chunk, .. }) => {
                    self.stats.damaged.fetch_add(1, Ordering::Relaxed);
                    let key = (blob, tract, chunk);
                    let lock = || self.stats.unrepairable.lock().unwrap_or_else(|p| p.into_inner());
                    let again = lock().contains(&key);
                    if self.parts.healer.repair(blob, inc, tract, chunk, again).await {
                        self.stats.repaired.fetch_add(1, Ordering::Relaxed);
                        lock().remove(&key);
                    } else {
                        self.stats.unrepaired.fetch_add(1, Ordering::Relaxed);
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
            self.stats.bytes.fetch_add(len as u64, Ordering::Relaxed);
            self.parts.env.sleep(Duration::from_secs_f64(len as f64 / self.bandwidth as f64)).await;
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
        match self
            .parts
            .peers
            .call_addr(&primary.addr, &Request::GetBlob { blob, row_version: row.version })
            .await
        {
            Ok(Reply::Blob(m)) => Some(m.incarnation == inc),
            Err(e) if e.remote().is_some_and(|r| r.code == blizzard_proto::ErrorCode::NoSuchBlob) => {
                Some(false)
            }
            _ => None,
        }
    }
}
