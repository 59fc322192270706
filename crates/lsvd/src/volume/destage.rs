//! The destager: the background task that moves journal records into
//! objects one at a time (design 0008, invariants 1-3), releases journal
//! space behind them, takes the snapshots asked for, and runs a cleaning
//! step after each object (`clean`).
//!
//! | step | what | why in this order |
//! |---|---|---|
//! | snapshots asked for | a checkpoint at the head, the record, its objects protected | here, where nothing else applies or deletes objects |
//! | destage | sync the journal, coalesce the next synced records into one object, create it, apply it | invariant 1: an object holds only records a sync covered |
//! | reclaim | the journal header's tail past the folded records no read pins, durably; then their space is free | invariant 2 |
//! | clean | one pass when live data is below the threshold | interleaved: under writes that never pause, idle moments never come |

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use blizzard_env::Instant;

use super::clean::{gc_step, write_checkpoint};
use super::{needed_by, Config, Inner, State};
use crate::error::LsvdError;
use crate::extent_map::{ExtentMap, Loc};
use crate::format::{ObjExtent, RecordKind, SnapshotRecord};
use crate::journal::RecMeta;
use crate::store::{snapshot_name, Created};
use crate::Planted;

/// Adds `len` bytes of volume offset `vol`, at `at` in the object's data,
/// to `extents`: merged into the last extent when they continue it both
/// in the volume and in the data.
pub(super) fn push_extent(extents: &mut Vec<ObjExtent>, vol: u64, len: u64, at: u64) {
    match extents.last_mut() {
        Some(p) if p.vol_offset + p.len == vol && p.obj_offset.is_some_and(|o| o + p.len == at) => {
            p.len += len
        }
        _ => extents.push(ObjExtent { vol_offset: vol, len, obj_offset: Some(at) }),
    }
}

/// Whether the destager has an object to make now.
fn due(s: &State, now: Instant, cfg: &Config, object_bytes: u64) -> bool {
    s.dirty_records > 0
        && (s.dirty_bytes >= object_bytes
            || s.space_wanted > 0
            || s.drain_wanted > 0
            || s.dirty_since.is_some_and(|t| now.saturating_duration_since(t) >= cfg.destage_delay))
}

/// The background task: one object at a time, then the journal's tail.
pub(super) async fn destager(inner: Arc<Inner>) {
    loop {
        let (go, stop) = {
            let s = inner.lock();
            (
                s.failed.is_none() && due(&s, inner.env.now(), &inner.cfg, inner.log.desc().object_bytes),
                s.stopping,
            )
        };
        if stop {
            return;
        }
        let asked = std::mem::take(&mut inner.lock().snap_requests);
        for (name, reply) in asked {
            let _ = reply.send(take_snapshot(&inner, &name).await);
        }
        if go {
            if let Err(e) = destage_step(&inner).await {
                inner.fail(e);
                continue;
            }
        }
        if let Err(e) = reclaim(&inner).await {
            inner.fail(e);
        }
        // Cleaning interleaves with destaging, a step after each object:
        // under writes that never pause, waiting for an idle moment let
        // the stored bytes grow without bound (bench/lsvd.sh: 3.3 GiB
        // stored for 819 MiB live after three overwrites).
        let mut cleaned = false;
        if inner.lock().failed.is_none() {
            match gc_step(&inner).await {
                Ok(c) => cleaned = c,
                Err(e) => {
                    inner.fail(e);
                }
            }
        }
        if !go && !cleaned {
            let w = inner.work.notified();
            let sleep = inner.env.sleep(inner.cfg.destage_delay / 2);
            tokio::select! {
                biased;
                _ = w => {}
                _ = sleep => {}
            }
        }
    }
}

/// Retries `op` while the object store is unreachable; any other failure
/// is returned (the volume then fails).
pub(super) async fn landed<T, F: std::future::Future<Output = Result<T, LsvdError>>>(
    inner: &Inner,
    what: &str,
    mut op: impl FnMut() -> F,
) -> Result<T, LsvdError> {
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.kind() == crate::Kind::Unavailable => {
                tracing::warn!(error = %e, "{what} failed; retrying");
                if inner.lock().stopping {
                    return Err(e);
                }
                inner.env.sleep(inner.cfg.retry_pause).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Where a batch's bytes come from: record `idx` of the batch, `at` bytes
/// into its data; or zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BLoc {
    idx: usize,
    at: u64,
    zero: bool,
}

impl Loc for BLoc {
    fn advance(self, by: u64) -> Self {
        if self.zero {
            self
        } else {
            BLoc { at: self.at + by, ..self }
        }
    }
}

/// Destages the next records into one object.
async fn destage_step(inner: &Inner) -> Result<(), LsvdError> {
    let object_bytes = inner.log.desc().object_bytes;
    // Invariant 1: sync first, and take only records the sync covered.
    let written = inner.lock().applied - 1;
    if inner.cfg.planted != Planted::DestageBeforeSync {
        inner.journal.sync().await?;
    }
    let (recs, seq) = {
        let s = inner.lock();
        let mut recs: Vec<RecMeta> = Vec::new();
        let mut bytes = 0;
        let mut seq = s.folded + 1;
        while seq <= written && (bytes < object_bytes || recs.is_empty()) {
            let Some(r) = s.ring.get(seq) else { break };
            if r.kind == RecordKind::Write && bytes > 0 && bytes + r.len > object_bytes {
                break;
            }
            if r.kind == RecordKind::Write {
                bytes += r.len;
            }
            recs.push(*r);
            seq += 1;
        }
        (recs, s.log.head + 1)
    };
    let Some(last) = recs.last().map(|r| r.seq) else { return Ok(()) };
    assert!(last <= written, "invariant 1: object would hold record {last}, past the sync at {written}");
    // The records' data, from the journal (not released: not folded yet).
    let mut datas = Vec::with_capacity(recs.len());
    for r in &recs {
        datas.push(match r.kind {
            RecordKind::Write => inner.journal.read(r.pos, 0, r.len).await?,
            _ => Bytes::new(),
        });
    }
    // Coalesce: later records in the batch win, as the object is atomic.
    let mut batch: ExtentMap<BLoc> = ExtentMap::new();
    for (idx, r) in recs.iter().enumerate() {
        match r.kind {
            RecordKind::Write => {
                batch.insert(r.vol_offset, r.len, Some(BLoc { idx, at: 0, zero: false }));
            }
            RecordKind::Trim => {
                batch.insert(r.vol_offset, r.len, Some(BLoc { idx, at: 0, zero: true }));
            }
            RecordKind::Wrap => {}
        }
    }
    let mut data = BytesMut::new();
    let mut extents: Vec<ObjExtent> = Vec::new();
    for e in batch.iter() {
        if e.loc.zero {
            extents.push(ObjExtent { vol_offset: e.start, len: e.len, obj_offset: None });
            continue;
        }
        push_extent(&mut extents, e.start, e.len, data.len() as u64);
        data.extend_from_slice(&datas[e.loc.idx][e.loc.at as usize..(e.loc.at + e.len) as usize]);
    }
    let data = data.freeze();
    let h = inner.data_header(seq, last, &data, extents);
    if inner.cfg.planted == Planted::ReclaimBeforePut {
        let (pos, next) = {
            let s = inner.lock();
            s.ring.get(last + 1).map_or((s.ring.head(), s.ring.next_seq()), |r| (r.pos, r.seq))
        };
        inner.journal.set_tail(pos, next).await?;
        let mut s = inner.lock();
        for r in s.ring.release_through(last) {
            if r.kind != RecordKind::Wrap {
                s.jmap.remove_where(r.vol_offset, r.len, |l| l.seq == r.seq);
            }
        }
    }
    landed(inner, "creating an object", || inner.log.put_object(&h, vec![data.clone()])).await?;
    let checkpoint = {
        let mut s = inner.lock();
        s.log.apply(&h).map_err(LsvdError::Corrupt)?;
        s.folded = last;
        for r in &recs {
            if r.kind != RecordKind::Wrap {
                s.dirty_records -= 1;
            }
            if r.kind == RecordKind::Write {
                s.dirty_bytes -= r.len;
            }
        }
        s.dirty_since = (s.dirty_records > 0).then(|| inner.env.now());
        s.objects_since_checkpoint += 1;
        (s.objects_since_checkpoint >= inner.cfg.checkpoint_every)
            .then(|| s.log.to_checkpoint(inner.log.desc().uuid, inner.log.desc().size))
    };
    inner.changed.notify_waiters();
    if let Some(c) = checkpoint {
        write_checkpoint(inner, c).await?;
    }
    Ok(())
}

/// Takes a snapshot at the head, in the destager's task (so no object is
/// applied or deleted meanwhile): a checkpoint at the head unless one is
/// durable there, then the record, then its objects are protected. A
/// crash between the steps leaves a checkpoint and no record: tidied at
/// the next open.
async fn take_snapshot(inner: &Inner, name: &str) -> Result<u64, LsvdError> {
    let desc = inner.log.desc();
    let (head, c) = {
        let s = inner.lock();
        if s.snapshots.contains_key(name) {
            return Err(LsvdError::InUse(format!("volume {:?} already has a snapshot {name:?}", desc.name)));
        }
        (s.log.head, (s.checkpoint < s.log.head).then(|| s.log.to_checkpoint(desc.uuid, desc.size)))
    };
    if let Some(c) = c {
        write_checkpoint(inner, c).await?;
    }
    let created_secs =
        inner.env.clock.system_time().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let rec = SnapshotRecord { uuid: desc.uuid, name: name.to_string(), seq: head, created_secs };
    let b = rec.encode();
    let store = inner.log.store();
    let key = snapshot_name(name);
    match landed(inner, "creating a snapshot", || store.create(&key, vec![b.clone()])).await? {
        Created::New => {}
        Created::Exists => {
            // This writer's own create whose reply was lost, or a snapshot
            // of that name taken by an earlier writer and not yet known.
            if store.get(&key).await?.as_ref() != Some(&b) {
                return Err(LsvdError::InUse(format!(
                    "volume {:?} already has a snapshot {name:?}: pick another name, or delete it first",
                    desc.name
                )));
            }
        }
    }
    let mut s = inner.lock();
    // The map has not changed since the checkpoint: nothing else applies
    // objects. What it reads now is what the snapshot reads.
    assert_eq!(s.log.head, head, "an object was applied while a snapshot was taken");
    let needed = needed_by(s.log.objects.values().copied(), desc.base_upto());
    s.snapshots.insert(name.to_string(), (head, needed));
    tracing::info!(volume = %desc.name, snapshot = name, seq = head, "snapshot taken");
    Ok(head)
}

/// Moves the journal's tail past the folded records no read is using, and
/// releases their space (invariant 2: the header first, durably).
async fn reclaim(inner: &Inner) -> Result<(), LsvdError> {
    let (pos, seq, through) = {
        let s = inner.lock();
        let lowest_pin = s.pins.keys().next().copied().unwrap_or(u64::MAX);
        let through = s.folded.min(lowest_pin.saturating_sub(1));
        let (tail_pos, tail_seq) = s.ring.tail();
        if through < tail_seq {
            return Ok(());
        }
        let (pos, seq) = match s.ring.get(through + 1) {
            Some(r) => (r.pos, r.seq),
            None => (s.ring.head(), s.ring.next_seq()),
        };
        let _ = tail_pos;
        (pos, seq, through)
    };
    tracing::debug!(pos, seq, through, "journal tail");
    inner.journal.set_tail(pos, seq).await?;
    {
        let mut s = inner.lock();
        assert!(through <= s.folded, "invariant 2: releasing record {through} not in an object");
        for r in s.ring.release_through(through) {
            if r.kind != RecordKind::Wrap {
                s.jmap.remove_where(r.vol_offset, r.len, |l| l.seq == r.seq);
            }
        }
    }
    inner.changed.notify_waiters();
    Ok(())
}
