//! Healing a damaged chunk from the row's other members, for the two
//! callers that find one: a partial write that must merge with a chunk it
//! cannot read ([`Healer::heal_chunk`], which takes whatever a complete
//! member holds), and the scrubber ([`Healer::repair`], which installs only
//! the bytes the chunk's entry expects; `scrub.rs` says why that is safe
//! against concurrent writes).
//!
//! Invariant: a server never heals a tract for a peer's copy request while
//! it heals that tract itself ([`Heals`]).

use std::sync::Arc;

use bytes::Bytes;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};
use blizzard_proto::{Reply, Request, RowTract};

use crate::peers::Peers;
use crate::rows::SharedRows;
use crate::store::Store;

/// Fetches chunks from the row's other members and installs them.
pub struct Healer {
    store: Arc<Store>,
    peers: Arc<Peers>,
    rows: Arc<SharedRows>,
    heals: Heals,
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
pub struct Heals(std::sync::Mutex<std::collections::HashMap<(BlobId, TractNo), u32>>);

/// Holds one heal of a tract in [`Heals`] until dropped.
pub struct HealGuard<'a> {
    heals: &'a Heals,
    key: (BlobId, TractNo),
}

impl Heals {
    pub fn begin(&self, blob: BlobId, tract: TractNo) -> HealGuard<'_> {
        *self.lock().entry((blob, tract)).or_default() += 1;
        HealGuard { heals: self, key: (blob, tract) }
    }

    /// Whether a heal of the tract is under way here.
    pub fn healing(&self, blob: BlobId, tract: TractNo) -> bool {
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

impl Healer {
    pub(crate) fn new(store: Arc<Store>, peers: Arc<Peers>, rows: Arc<SharedRows>) -> Healer {
        Healer { store, peers, rows, heals: Heals::default() }
    }

    /// Whether a heal of the tract is under way here (a copy request for
    /// it must not heal again: see [`Heals`]).
    pub fn healing(&self, blob: BlobId, tract: TractNo) -> bool {
        self.heals.healing(blob, tract)
    }

    /// The row's complete members other than this server, in column order
    /// (a lower column holds a superset), and the request that copies the
    /// tract from them.
    fn copy_sources(&self, blob: BlobId, tract: TractNo) -> Option<(Vec<TsId>, Request)> {
        let me = self.store.disk_id();
        let rows = self.rows.snapshot();
        let row = rows.assignment.locate(blob, tract)?;
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
    pub async fn heal_chunk(&self, blob: BlobId, inc: Incarnation, tract: TractNo, chunk: u32) -> bool {
        // Boxed: asking the row's members takes a future of kilobytes, and
        // every write awaits this call on its failure path; inline, each
        // write's future would carry it (`TractService::handle`'s doc).
        Box::pin(self.heal_chunk_from_peers(blob, inc, tract, chunk)).await
    }

    async fn heal_chunk_from_peers(
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
    pub async fn repair(
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
