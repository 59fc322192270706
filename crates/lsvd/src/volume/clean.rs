//! Cleaning (garbage collection, design 0008 and the LSVD paper's §3.5)
//! and the checkpoints it depends on, in the destager's task.
//!
//! | step | what | why in this order |
//! |---|---|---|
//! | plan | victims: the least-live objects that are this volume's own (not a clone's base) and that no snapshot needs | a snapshot reads its objects for as long as it exists; a base's objects are its own volume's to clean |
//! | copy | their live pieces, found from each victim's header in the map, into one object at the head | the map cannot change meanwhile: only this task applies objects |
//! | checkpoint | the map at a head at or after the new object, durable: once the victims awaiting deletion are worth it ([`CHECKPOINT_PAYBACK`]), or at the destager's cadence | recovery from it never needs a victim |
//! | delete | the victims, and checkpoints older than the one before (a snapshot's checkpoint is kept) | only objects dead in a durable checkpoint and needed by no snapshot |

use bytes::{Bytes, BytesMut};

use super::destage::push_extent;
use super::{landed, Inner};
use crate::error::LsvdError;
use crate::format::ObjExtent;
use crate::Planted;

/// Writes a checkpoint of the map, then deletes what it made deletable:
/// cleaned objects whose data moved before it, and checkpoints older than
/// the one before it.
pub(super) async fn write_checkpoint(inner: &Inner, c: crate::format::Checkpoint) -> Result<(), LsvdError> {
    landed(inner, "writing a checkpoint", || inner.log.put_checkpoint(&c)).await?;
    let (dead, old_ckpts) = {
        let mut s = inner.lock();
        s.objects_since_checkpoint = 0;
        s.checkpoint = s.checkpoint.max(c.seq);
        s.checkpoints.push_back(c.seq);
        let upto = s.checkpoint;
        let mut dead = Vec::new();
        s.doomed.retain(|&(v, moved_at)| {
            if moved_at <= upto {
                dead.push(v);
                false
            } else {
                true
            }
        });
        let mut old = Vec::new();
        while s.checkpoints.len() > 2 {
            // A snapshot's checkpoint stays: it is the snapshot's map
            // (deleted with the snapshot).
            old.extend(s.checkpoints.pop_front().filter(|&c| !s.snapshot_checkpoint(c)));
        }
        if inner.cfg.planted != Planted::GcIgnoresSnapshots {
            let protected = s.protected();
            for v in &dead {
                // Invariant 5: no snapshot reads a deleted object.
                assert!(!protected.contains(v), "invariant 5: deleting object {v}, which a snapshot reads");
            }
        }
        (dead, old)
    };
    for v in dead {
        // Invariant 4: nothing in the durable checkpoint (nor anything
        // after it) points into v: its live data moved to an object at or
        // before the checkpoint, and it is dead in the map.
        assert!(
            inner.lock().log.objects.get(&v).is_none_or(|o| o.live == 0),
            "invariant 4: deleting object {v}, which the map still reads"
        );
        landed(inner, "deleting a cleaned object", || {
            let name = crate::store::object_name(v);
            async move { inner.log.store().delete(&name).await }
        })
        .await?;
        inner.lock().log.objects.remove(&v);
    }
    for c in old_ckpts {
        landed(inner, "deleting an old checkpoint", || {
            let name = crate::store::checkpoint_name(c);
            async move { inner.log.store().delete(&name).await }
        })
        .await?;
    }
    Ok(())
}

/// One cleaning pass (§3.5): when live data is below `gc_live_ratio` of
/// the stored bytes, the least-live objects' live extents are copied into
/// one new object at the head, a checkpoint is written, and the cleaned
/// objects deleted. Runs in the destager's task, so no other object is
/// applied while it plans: the pieces it copies are current when its
/// object is applied. Returns whether it cleaned anything.
pub(super) async fn gc_step(inner: &Inner) -> Result<bool, LsvdError> {
    let object_bytes = inner.log.desc().object_bytes;
    let victims: Vec<u64> = {
        let s = inner.lock();
        // Only objects cleaning may take count: this volume's own (a
        // clone's bases clean theirs), and none a snapshot reads (they
        // stay while it does, whatever their live bytes).
        let protected = match inner.cfg.planted {
            Planted::GcIgnoresSnapshots => Default::default(),
            _ => s.protected(),
        };
        let floor = inner.log.desc().base_upto();
        // Cleaned objects awaiting their delete (the next checkpoint) are
        // as good as gone: counting them would make cleaning run ahead.
        let doomed: std::collections::BTreeSet<u64> = s.doomed.iter().map(|d| d.0).collect();
        let mine = || {
            s.log
                .objects
                .range(floor + 1..)
                .map(|(_, o)| o)
                .filter(|o| !protected.contains(&o.seq) && !doomed.contains(&o.seq))
        };
        let (live, stored) = mine().fold((0, 0), |(l, t), o| (l + o.live, t + o.data_len));
        if stored < inner.cfg.gc_min_bytes || live as f64 >= inner.gc_live_ratio * stored as f64 {
            return Ok(false);
        }
        let mut cands: Vec<&crate::format::ObjStat> = mine().filter(|o| o.seq != s.log.head).collect();
        // Least live first (greedy); dead objects cost nothing to clean.
        cands.sort_by(|a, b| {
            (a.live * b.data_len.max(1)).cmp(&(b.live * a.data_len.max(1))).then(a.seq.cmp(&b.seq))
        });
        let mut out = Vec::new();
        let mut taking = 0;
        for o in cands {
            if (o.live as f64) >= inner.gc_live_ratio * o.data_len as f64 && o.data_len > 0 {
                break;
            }
            if taking > 0 && taking + o.live > object_bytes {
                break;
            }
            taking += o.live;
            out.push(o.seq);
        }
        out
    };
    if victims.is_empty() {
        return Ok(false);
    }
    // The live pieces: the map's extents that still point into a victim,
    // found from each victim's own extents.
    let mut pieces: Vec<(u64, u64, u64, u64)> = Vec::new(); // (vol, len, victim, off)
    for &v in &victims {
        if inner.lock().log.objects.get(&v).is_some_and(|o| o.live == 0) {
            continue;
        }
        let h = inner.log.read_header(v, None).await?;
        let s = inner.lock();
        for e in h.extents.iter().filter(|e| e.obj_offset.is_some()) {
            for p in s.log.map.lookup(e.vol_offset, e.len) {
                if let Some(l) = p.loc.filter(|l| l.seq == v) {
                    pieces.push((p.start, p.len, v, l.off));
                }
            }
        }
    }
    // The live pieces' bytes, one victim at a time: one ranged GET of the
    // span its pieces cover (a GET per piece cost hundreds of requests per
    // pass under small random writes, whose live pieces are scattered),
    // keeping only the pieces, so memory stays the live bytes (at most an
    // object's worth) plus one span.
    let mut by_victim: std::collections::BTreeMap<u64, Vec<(u64, u64, u64)>> =
        std::collections::BTreeMap::new();
    for &(vol, len, v, off) in &pieces {
        by_victim.entry(v).or_default().push((vol, len, off));
    }
    let mut copied: Vec<(u64, Bytes)> = Vec::with_capacity(pieces.len());
    for (v, ps) in by_victim {
        let lo = ps.iter().map(|p| p.2).min().unwrap_or(0);
        let hi = ps.iter().map(|p| p.2 + p.1).max().unwrap_or(lo);
        // Past the read cache: the victim is about to go.
        let span = inner.log.read_direct(v, lo, hi - lo).await?;
        for (vol, len, off) in ps {
            let at = (off - lo) as usize;
            copied.push((vol, Bytes::copy_from_slice(&span[at..at + len as usize])));
        }
    }
    // Each volume offset is in one piece only (the map holds one location
    // per byte).
    copied.sort_unstable_by_key(|(vol, _)| *vol);
    let plugs = plug_holes(inner, &copied).await?;
    copied.extend(plugs);
    copied.sort_unstable_by_key(|(vol, _)| *vol);
    let mut data = BytesMut::new();
    let mut extents: Vec<ObjExtent> = Vec::new();
    for (vol, b) in &copied {
        let (vol, len) = (*vol, b.len() as u64);
        push_extent(&mut extents, vol, len, data.len() as u64);
        data.extend_from_slice(b);
    }
    let data = data.freeze();
    let (seq, journal_seq) = {
        let s = inner.lock();
        (s.log.head + 1, s.log.journal_seq)
    };
    let h = inner.data_header(seq, journal_seq, &data, extents);
    if !h.extents.is_empty() {
        landed(inner, "creating a cleaning object", || inner.log.put_object(&h, vec![data.clone()])).await?;
        let put = (h.encoded_len() + data.len()) as u64;
        inner.log.store().counts().cleaning_bytes_put.fetch_add(put, std::sync::atomic::Ordering::Relaxed);
    }
    let c = {
        let mut s = inner.lock();
        if !h.extents.is_empty() {
            s.log.apply(&h).map_err(LsvdError::Corrupt)?;
            s.objects_since_checkpoint += 1;
        }
        for &v in &victims {
            // Every live byte moved: the victims are dead in the map.
            assert_eq!(s.log.objects.get(&v).map_or(0, |o| o.live), 0, "cleaned object {v} still live");
            let head = s.log.head;
            s.doomed.push((v, head));
        }
        // The victims are deleted at the next checkpoint. One after every
        // pass cost a whole map per object's worth of cleaning (a fifth of
        // the bytes put under 16 KiB random writes, `bench/lsvd.sh`): wait
        // until the bytes it frees pay for it many times over, or the
        // destager's cadence comes round.
        let doomed_bytes: u64 =
            s.doomed.iter().filter_map(|(v, _)| s.log.objects.get(v)).map(|o| o.data_len).sum();
        let map_bytes = 32 * s.log.map.extents() as u64 + 24 * s.log.objects.len() as u64 + 84;
        (doomed_bytes >= CHECKPOINT_PAYBACK * map_bytes
            || s.objects_since_checkpoint >= inner.cfg.checkpoint_every)
            .then(|| s.log.to_checkpoint(inner.log.desc().uuid, inner.log.desc().size))
    };
    inner.changed.notify_waiters();
    tracing::debug!(victims = ?victims, moved = data.len(), "cleaned");
    if let Some(c) = c {
        write_checkpoint(inner, c).await?;
    }
    Ok(true)
}

/// A cleaning pass writes a checkpoint (which deletes its victims) once
/// the cleaned objects awaiting deletion hold this many times the
/// checkpoint's bytes: checkpoints then cost at most about 1/32 of the
/// bytes cleaning frees, and the wait holds at most 32 maps' worth of dead
/// objects in the store.
const CHECKPOINT_PAYBACK: u64 = 32;

/// Defragmentation while cleaning (the LSVD paper's §4.6): a hole of at
/// most `defrag_hole_max` bytes between two pieces a pass copies (sorted
/// by volume offset), held wholly by other objects, is read and copied
/// too, so the new object holds one extent where the map had three. The
/// bytes are the map's current ones (nothing else applies objects while
/// the pass runs) and the plugged ranges' old objects lose the liveness
/// (`LogState::apply`). A hole with unwritten or trimmed sectors is left
/// alone (copying would turn a hole into zeros the map must carry).
///
/// Reads are what plugging costs: the holes are read one ranged request
/// per source object (the span its holes cover), from at most
/// [`PLUG_SOURCES_MAX`] objects per pass, those holding the most holes
/// (a span at most an object long), and at most half an object's worth
/// of holes. A range written sequentially and
/// then partly overwritten has its holes in a few recent objects, all
/// plugged; under random writes the holes are scattered, and a pass pays
/// a few requests, not one per hole (one per hole cost 18 times the
/// requests of 4 KiB random writes in `bench/lsvd.sh`).
async fn plug_holes(inner: &Inner, copied: &[(u64, Bytes)]) -> Result<Vec<(u64, Bytes)>, LsvdError> {
    let max = inner.cfg.defrag_hole_max;
    if max == 0 {
        return Ok(Vec::new());
    }
    // Holes by source object.
    let mut by_source: std::collections::BTreeMap<u64, Vec<Hole>> = Default::default();
    {
        let s = inner.lock();
        for w in copied.windows(2) {
            let end = w[0].0 + w[0].1.len() as u64;
            let gap = w[1].0.saturating_sub(end);
            if gap == 0 || gap > max {
                continue;
            }
            let parts = s.log.map.lookup(end, gap);
            if parts.iter().any(|p| p.loc.is_none()) {
                continue;
            }
            for p in &parts {
                if let Some(l) = p.loc {
                    by_source.entry(l.seq).or_default().push((p.start, p.len, l.off));
                }
            }
        }
    }
    let mut sources: Vec<(u64, Vec<Hole>)> = by_source.into_iter().collect();
    sources.sort_by_key(|(seq, holes)| (std::cmp::Reverse(holes.len()), *seq));
    let object_bytes = inner.log.desc().object_bytes;
    let mut budget = object_bytes / 2;
    let mut out = Vec::new();
    for (seq, mut holes) in sources.into_iter().take(PLUG_SOURCES_MAX) {
        // As many as the budget takes, in the source's order: one span.
        holes.sort_unstable_by_key(|h| h.2);
        let mut took = 0;
        let mut plugged = 0;
        while took < holes.len() && plugged + holes[took].1 <= budget {
            plugged += holes[took].1;
            took += 1;
        }
        holes.truncate(took);
        let lo = holes.iter().map(|h| h.2).min().unwrap_or(0);
        let hi = holes.iter().map(|h| h.2 + h.1).max().unwrap_or(lo);
        if holes.is_empty() || hi - lo > object_bytes {
            continue;
        }
        budget -= plugged;
        let span = inner.log.read(seq, lo, hi - lo).await?;
        for (vol, len, off) in holes {
            let at = (off - lo) as usize;
            out.push((vol, span.slice(at..at + len as usize)));
        }
    }
    Ok(out)
}

/// A hole to plug: (volume offset, length, offset in its source object).
type Hole = (u64, u64, u64);

/// Most source objects one cleaning pass reads holes from.
const PLUG_SOURCES_MAX: usize = 4;
