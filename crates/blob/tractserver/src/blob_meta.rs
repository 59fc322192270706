//! Blob metadata on a tractserver (FDS §3.1): every blob whose metadata
//! tract (−1) maps to a row this server holds has its record here, in
//! memory and in that tract. The row's primary serializes each blob's
//! changes and commits them two-phase on every holder of the row
//! (`TractService::replicate_meta`); this module holds the state of both
//! sides and decides, without I/O, what a change makes of a record.
//!
//! | state | kept in | what it means |
//! |---|---|---|
//! | record | `records` and tract −1 | the blob exists at this incarnation and size |
//! | prepared | `prepared` (memory) | a replica accepted phase one of `txn`; the commit applies it, an abort or a newer prepare drops it |
//! | unconfirmed | `unconfirmed` (memory) | the primary committed a change some holder may lack (its commit failed): the next change first brings every holder to the primary's copy |
//! | serialized | `locks` (memory) | a change of the blob is under way at the primary; the next waits |
//!
//! Memory is lost at a restart: a prepared change then never commits (the
//! primary's commit fails and the client retries), and an unconfirmed
//! mark is forgotten (a restarted primary answers the retry from its own
//! copy; the gap is in design 0007).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use blizzard_core::{BlobId, Incarnation};
use blizzard_proto::codec::{decode, encode};
use blizzard_proto::{BlobMeta, ErrorCode, ErrorReply, ExtendMode};

use crate::rows::BLOB_TRACTS_MAX;

/// A change a client asks of a blob's metadata primary.
#[derive(Clone, Copy, Debug)]
pub(crate) enum MetaOp {
    Create { incarnation: Incarnation, replication: u8 },
    Extend { mode: ExtendMode, tracts: u64 },
    Delete,
}

/// What a change makes of a blob's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Planned {
    /// Nothing to change (an extend to a size the blob has): answer with
    /// the record as it is.
    Unchanged(BlobMeta),
    /// Replace the record (`None`: delete the blob).
    Change(Option<BlobMeta>),
}

/// Decides a change from the current record, or refuses it. Pure.
pub(crate) fn plan(
    blob: BlobId,
    op: MetaOp,
    cur: Option<BlobMeta>,
    max_replication: u8,
) -> Result<Planned, ErrorReply> {
    match (op, cur) {
        (MetaOp::Create { .. }, Some(_)) => {
            Err(ErrorReply::new(ErrorCode::BlobExists, format!("blob {blob} already exists")))
        }
        (MetaOp::Create { incarnation, replication }, None) => {
            if replication == 0 || replication > max_replication {
                return Err(ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!(
                        "replication {replication} is outside 1..={max_replication} (the cluster's maximum)"
                    ),
                ));
            }
            Ok(Planned::Change(Some(BlobMeta { blob, incarnation, replication, size_tracts: 0, version: 1 })))
        }
        (_, None) => Err(ErrorReply::new(ErrorCode::NoSuchBlob, format!("blob {blob} does not exist"))),
        (MetaOp::Extend { mode, tracts }, Some(c)) => {
            let size = match mode {
                ExtendMode::By => c.size_tracts.checked_add(tracts),
                ExtendMode::To => Some(c.size_tracts.max(tracts)),
            };
            let size = size.filter(|s| *s <= BLOB_TRACTS_MAX).ok_or_else(|| {
                ErrorReply::new(
                    ErrorCode::OutOfRange,
                    format!("blob size would exceed {BLOB_TRACTS_MAX} tracts"),
                )
            })?;
            if size == c.size_tracts {
                return Ok(Planned::Unchanged(c));
            }
            Ok(Planned::Change(Some(BlobMeta { size_tracts: size, version: c.version + 1, ..c })))
        }
        (MetaOp::Delete, Some(_)) => Ok(Planned::Change(None)),
    }
}

/// A prepared, not yet committed, change on a replica.
struct Prepared {
    txn: u64,
    new: Option<BlobMeta>,
}

/// The metadata state of this server (the table above).
#[derive(Default)]
pub(crate) struct BlobMetas {
    records: Mutex<HashMap<BlobId, BlobMeta>>,
    prepared: Mutex<HashMap<BlobId, Prepared>>,
    unconfirmed: Mutex<HashSet<BlobId>>,
    locks: Mutex<HashMap<BlobId, Arc<tokio::sync::Mutex<()>>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl BlobMetas {
    pub(crate) fn get(&self, blob: BlobId) -> Option<BlobMeta> {
        lock(&self.records).get(&blob).copied()
    }

    /// Sets the record in memory (`None`: forgets the blob); the caller
    /// wrote or deleted tract −1 first.
    pub(crate) fn set(&self, blob: BlobId, m: Option<BlobMeta>) {
        match m {
            Some(m) => lock(&self.records).insert(blob, m),
            None => lock(&self.records).remove(&blob),
        };
    }

    /// Replaces every record (loaded at start).
    pub(crate) fn replace_all(&self, records: HashMap<BlobId, BlobMeta>) {
        *lock(&self.records) = records;
    }

    /// The records `keep` selects.
    pub(crate) fn filtered(&self, keep: impl Fn(&BlobMeta) -> bool) -> Vec<BlobMeta> {
        lock(&self.records).values().filter(|m| keep(m)).copied().collect()
    }

    /// Phase one on a replica. The primary serializes changes per blob, so
    /// a newer prepare always supersedes an older one left behind.
    pub(crate) fn prepare(&self, blob: BlobId, txn: u64, new: Option<BlobMeta>) {
        lock(&self.prepared).insert(blob, Prepared { txn, new });
    }

    /// Takes the change `txn` prepared for `blob`, if it is the one
    /// prepared (`Some(None)`: a prepared delete).
    pub(crate) fn take_prepared(&self, blob: BlobId, txn: u64) -> Option<Option<BlobMeta>> {
        let mut prepared = lock(&self.prepared);
        match prepared.get(&blob) {
            Some(p) if p.txn == txn => prepared.remove(&blob).map(|p| p.new),
            _ => None,
        }
    }

    /// Drops the change `txn` prepared for `blob`, if it is the one
    /// prepared.
    pub(crate) fn abort(&self, blob: BlobId, txn: u64) {
        let _ = self.take_prepared(blob, txn);
    }

    pub(crate) fn is_unconfirmed(&self, blob: BlobId) -> bool {
        lock(&self.unconfirmed).contains(&blob)
    }

    /// Marks whether every holder committed the blob's last change.
    pub(crate) fn set_confirmed(&self, blob: BlobId, confirmed: bool) {
        let mut u = lock(&self.unconfirmed);
        if confirmed {
            u.remove(&blob);
        } else {
            u.insert(blob);
        }
    }

    /// Runs `change` with the blob's changes serialized at this primary,
    /// then forgets the blob's lock once nobody holds or waits for it, so
    /// the map does not grow with every blob ever touched.
    pub(crate) async fn serialized<T>(
        &self,
        blob: BlobId,
        change: impl std::future::Future<Output = T>,
    ) -> T {
        let blob_lock = lock(&self.locks).entry(blob).or_default().clone();
        let result = {
            let _serial = blob_lock.lock().await;
            change.await
        };
        let mut locks = lock(&self.locks);
        if locks.get(&blob).is_some_and(|l| Arc::ptr_eq(l, &blob_lock) && Arc::strong_count(l) == 2) {
            locks.remove(&blob);
        }
        result
    }
}

/// Magic of the record stored in chunk 0 of tract −1.
const META_MAGIC: u32 = u32::from_le_bytes(*b"BLOB");

/// The record as stored: magic, length, body, padded to a whole chunk (so
/// its write never needs a read-modify-write).
pub(crate) fn encode_meta(m: &BlobMeta) -> Bytes {
    let body = encode(m);
    let mut b = Vec::with_capacity(4096);
    b.extend_from_slice(&META_MAGIC.to_le_bytes());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(&body);
    b.resize(blizzard_core::limits::CHUNK_SIZE as usize, 0);
    Bytes::from(b)
}

/// A stored record, or `None` if the bytes hold none (untrusted: bounded,
/// checked magic).
pub(crate) fn decode_meta(b: &[u8]) -> Option<BlobMeta> {
    if b.len() < 8 || u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != META_MAGIC {
        return None;
    }
    let n = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    decode(b.get(8..8usize.checked_add(n)?)?).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const B: BlobId = BlobId(7);

    fn meta(size: u64, version: u64) -> BlobMeta {
        BlobMeta { blob: B, incarnation: 3, replication: 2, size_tracts: size, version }
    }

    fn code(r: Result<Planned, ErrorReply>) -> ErrorCode {
        r.unwrap_err().code
    }

    #[test]
    fn create_needs_a_free_id_and_a_replication_the_cluster_has() {
        let create = |r| MetaOp::Create { incarnation: 3, replication: r };
        assert_eq!(plan(B, create(2), None, 3).unwrap(), Planned::Change(Some(meta(0, 1))));
        assert_eq!(code(plan(B, create(2), Some(meta(0, 1)), 3)), ErrorCode::BlobExists);
        assert_eq!(code(plan(B, create(0), None, 3)), ErrorCode::BadRequest);
        assert_eq!(code(plan(B, create(4), None, 3)), ErrorCode::BadRequest);
    }

    #[test]
    fn extend_grows_bumps_the_version_and_never_shrinks() {
        let by = |n| MetaOp::Extend { mode: ExtendMode::By, tracts: n };
        let to = |n| MetaOp::Extend { mode: ExtendMode::To, tracts: n };
        assert_eq!(plan(B, by(5), Some(meta(10, 4)), 3).unwrap(), Planned::Change(Some(meta(15, 5))));
        assert_eq!(plan(B, to(12), Some(meta(10, 4)), 3).unwrap(), Planned::Change(Some(meta(12, 5))));
        // Nothing to do: answered as it is, no version bump.
        assert_eq!(plan(B, to(8), Some(meta(10, 4)), 3).unwrap(), Planned::Unchanged(meta(10, 4)));
        assert_eq!(plan(B, by(0), Some(meta(10, 4)), 3).unwrap(), Planned::Unchanged(meta(10, 4)));
        assert_eq!(code(plan(B, by(u64::MAX), Some(meta(10, 4)), 3)), ErrorCode::OutOfRange);
        assert_eq!(code(plan(B, to(BLOB_TRACTS_MAX + 1), Some(meta(10, 4)), 3)), ErrorCode::OutOfRange);
        assert_eq!(code(plan(B, by(1), None, 3)), ErrorCode::NoSuchBlob);
    }

    #[test]
    fn delete_needs_the_blob() {
        assert_eq!(plan(B, MetaOp::Delete, Some(meta(1, 2)), 3).unwrap(), Planned::Change(None));
        assert_eq!(code(plan(B, MetaOp::Delete, None, 3)), ErrorCode::NoSuchBlob);
    }

    #[test]
    fn only_the_prepared_transaction_commits() {
        let m = BlobMetas::default();
        m.prepare(B, 1, Some(meta(0, 1)));
        // A newer prepare supersedes it.
        m.prepare(B, 2, None);
        assert_eq!(m.take_prepared(B, 1), None);
        m.abort(B, 1);
        assert_eq!(m.take_prepared(B, 2), Some(None));
        assert_eq!(m.take_prepared(B, 2), None, "taken once");
    }

    #[test]
    fn records_round_trip_and_damage_is_no_record() {
        let rec = encode_meta(&meta(9, 4));
        assert_eq!(rec.len(), blizzard_core::limits::CHUNK_SIZE as usize);
        assert_eq!(decode_meta(&rec), Some(meta(9, 4)));
        let mut bad = rec.to_vec();
        bad[0] ^= 1;
        assert_eq!(decode_meta(&bad), None);
        let mut long = rec.to_vec();
        long[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode_meta(&long), None);
        assert_eq!(decode_meta(&rec[..5]), None);
    }

    #[tokio::test]
    async fn serialized_changes_forget_their_lock() {
        let m = BlobMetas::default();
        assert_eq!(m.serialized(B, async { 5 }).await, 5);
        assert!(lock(&m.locks).is_empty());
        m.set_confirmed(B, false);
        assert!(m.is_unconfirmed(B));
        m.set_confirmed(B, true);
        assert!(!m.is_unconfirmed(B));
    }
}
