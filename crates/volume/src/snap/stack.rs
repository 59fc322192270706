//! Taking, listing and opening snapshots of a volume in the blob store
//! (design 0011): the catalog and presence records on the blob, and the
//! [`LayeredIo`] stack built from them.
//!
//! Taking a snapshot, in order (the engine has made every acknowledged
//! write durable and no write runs):
//!
//! 1. the head's chunk map: kept in memory once the volume has a frozen
//!    layer; for its first snapshot, asked of the tractservers;
//! 2. the blob extended at its end: the catalog's two slots (first
//!    snapshot only), a tract for the head's presence record unless it
//!    fits after the last record (they share tracts: a tract slot holds
//!    thousands of them), the new head's tracts;
//! 3. the presence record written;
//! 4. the catalog written to the slot its generation names: from here the
//!    head is frozen and the new head is the one written. For the first
//!    snapshot, the superblock naming the slots is written after it and is
//!    the switch instead (before it, nothing names the catalog);
//! 5. the stack switched in memory.
//!
//! A crash before the switch leaves the volume as it was, and tracts past
//! its end that nothing names: they are trimmed before the head ever
//! grows over them (`Layered::extend_to`). Nothing of a frozen layer is
//! ever written again, so a crash cannot change a snapshot.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;

use blizzard_core::limits::CHUNK_SIZE;

use super::catalog::{Catalog, Layer, SnapInfo, SLOT_BYTES};
use super::layered::{LayeredIo, Stack};
use super::map::{Presence, TractBits, View};
use crate::io::BlobIo;
use crate::superblock::{LayersRef, Superblock};
use crate::VolumeError;

/// Tractservers asked at once for chunk maps.
const PARALLEL: usize = 64;

fn bad(what: &str, e: impl std::fmt::Display) -> VolumeError {
    VolumeError::Invalid(format!("{what}: {e}; the volume's snapshots cannot be read (the volume itself may still open if its head is intact)"))
}

/// Writes `bytes` at byte `at` of the blob (a whole chunk at least: padded
/// with zeros), one write per tract it spans, all in parallel.
async fn write_record(blob: &Arc<dyn BlobIo>, at: u64, bytes: &[u8]) -> Result<(), VolumeError> {
    let ts = blob.tract_size() as u64;
    let mut padded = bytes.to_vec();
    padded.resize(bytes.len().div_ceil(CHUNK_SIZE as usize) * CHUNK_SIZE as usize, 0);
    let mut writes = Vec::new();
    let mut done = 0u64;
    while done < padded.len() as u64 {
        let x = at + done;
        let n = (ts - x % ts).min(padded.len() as u64 - done);
        let part = Bytes::copy_from_slice(&padded[done as usize..(done + n) as usize]);
        writes.push(blob.write(x / ts, (x % ts) as u32, part));
        done += n;
    }
    for r in futures::future::join_all(writes).await {
        r?;
    }
    Ok(())
}

/// Reads `len` bytes at byte `at` of the blob.
async fn read_record(blob: &Arc<dyn BlobIo>, at: u64, len: u64) -> Result<Vec<u8>, VolumeError> {
    let ts = blob.tract_size() as u64;
    let mut reads = Vec::new();
    let mut done = 0u64;
    while done < len {
        let x = at + done;
        let n = (ts - x % ts).min(len - done);
        reads.push(blob.read(x / ts, (x % ts) as u32, n as u32));
        done += n;
    }
    let mut out = Vec::with_capacity(len as usize);
    for r in futures::future::join_all(reads).await {
        out.extend_from_slice(&r?);
    }
    Ok(out)
}

/// The catalog in `r`'s slots: the newest intact one.
pub(crate) async fn read_catalog(blob: &Arc<dyn BlobIo>, r: LayersRef) -> Result<Catalog, VolumeError> {
    let mut found = [None, None];
    for (slot, f) in found.iter_mut().enumerate() {
        let first = r.catalog + slot as u64 * r.slot_tracts;
        let head = match blob.read(first, 0, CHUNK_SIZE).await {
            Ok(b) => b,
            Err(e) if e.is_corrupt() => continue,
            Err(e) => return Err(e.into()),
        };
        let len = match Catalog::record_len(&head[..Catalog::header_len()]) {
            Ok(Some(l)) => l,
            Ok(None) | Err(_) => continue,
        };
        let bytes = match read_record(blob, first * blob.tract_size() as u64, len).await {
            Ok(b) => b,
            Err(VolumeError::Io(e)) if e.is_corrupt() => continue,
            Err(e) => return Err(e),
        };
        *f = Catalog::decode(&bytes).ok();
    }
    let [a, b] = found;
    Catalog::pick(a, b)
        .ok_or_else(|| bad("neither slot of the snapshot catalog is intact", "torn or damaged"))
}

/// Reads `len` bytes from the start of blob tract `first` on every
/// replica; every copy `None` when a chunk fails its CRC (the read of
/// every replica fails then).
async fn read_record_replicas(
    blob: &Arc<dyn BlobIo>,
    first: u64,
    len: u64,
) -> Result<Vec<Option<Vec<u8>>>, VolumeError> {
    let ts = blob.tract_size() as u64;
    let n = blob.replication().max(1) as usize;
    let mut out: Vec<Option<Vec<u8>>> = vec![Some(Vec::with_capacity(len as usize)); n];
    for i in 0..len.div_ceil(ts) {
        let part = (len - i * ts).min(ts) as u32;
        match blob.read_replicas(first + i, 0, part).await {
            Ok(copies) => {
                for (k, o) in out.iter_mut().enumerate() {
                    match (o.as_mut(), copies.get(k)) {
                        (Some(o), Some(c)) => o.extend_from_slice(c),
                        _ => *o = None,
                    }
                }
            }
            Err(e) if e.is_corrupt() => return Ok(vec![None; n]),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

/// Makes the catalog the same on every replica before the volume is
/// written (as `Volume::settle_superblock` does for the superblock, and
/// for the same reason): a catalog write cut off by a crash may have
/// reached some replicas, and reads pick one, so two opens could find two
/// different heads. Catalog writes are issued one at a time, each durable
/// on every replica before the next, so at most one slot is unsettled.
/// The newest copy intact on any replica is made the newest on every
/// replica: rewritten in place, or one generation up over the unsettled
/// slot. Returns it.
async fn settle_catalog(blob: &Arc<dyn BlobIo>, r: LayersRef) -> Result<Catalog, VolumeError> {
    let mut settled = [true; 2];
    let mut best: Option<(usize, Catalog)> = None;
    for (slot, settled) in settled.iter_mut().enumerate() {
        let first = r.catalog + slot as u64 * r.slot_tracts;
        // The longest record any replica's header claims.
        let heads = read_record_replicas(blob, first, Catalog::header_len() as u64).await?;
        let len = heads
            .iter()
            .flatten()
            .filter_map(|h| Catalog::record_len(h).ok().flatten())
            .max()
            .unwrap_or(Catalog::header_len() as u64);
        let copies = read_record_replicas(blob, first, len).await?;
        *settled = copies.iter().all(Option::is_some) && copies.windows(2).all(|w| w[0] == w[1]);
        for c in copies.iter().flatten() {
            if let Ok(cat) = Catalog::decode(c) {
                if best.as_ref().is_none_or(|(_, b)| cat.generation > b.generation) {
                    best = Some((slot, cat));
                }
            }
        }
    }
    let Some((from, mut cat)) = best else {
        return Err(bad("neither slot of the snapshot catalog is intact", "torn or damaged"));
    };
    if !settled[from] {
        write_catalog(blob, r, &cat).await?;
    }
    if !settled[1 - from] {
        cat.generation += 1;
        write_catalog(blob, r, &cat).await?;
    }
    Ok(cat)
}

async fn write_catalog(blob: &Arc<dyn BlobIo>, r: LayersRef, c: &Catalog) -> Result<(), VolumeError> {
    let first = r.catalog + Catalog::slot_of(c.generation) * r.slot_tracts;
    write_record(blob, first * blob.tract_size() as u64, &c.encode()).await
}

/// Layer `l`'s presence record.
async fn read_presence(blob: &Arc<dyn BlobIo>, l: &Layer) -> Result<Presence, VolumeError> {
    let Some((at, len)) = l.presence else { return Ok(Presence::default()) };
    let bytes = read_record(blob, at, len).await?;
    let cpt = blob.tract_size() / CHUNK_SIZE;
    Presence::decode(&bytes, l.id, cpt).map_err(|e| bad(&format!("layer {}", l.id), e))
}

/// The chunks of blob tracts `base..base + tracts - 1` (volume tracts
/// `1..tracts`), asked of the tractservers.
async fn presence_of(blob: &Arc<dyn BlobIo>, base: u64, tracts: u64) -> Result<Presence, VolumeError> {
    let cpt = blob.tract_size() / CHUNK_SIZE;
    let mut asks = futures::stream::iter(1..tracts)
        .map(|t| {
            let m = blob.mapped(base + t - 1);
            async move { (t, m.await) }
        })
        .buffer_unordered(PARALLEL);
    let mut p = Presence::default();
    while let Some((t, m)) = asks.next().await {
        if let Some(b) = TractBits::from_mapped(&m?, cpt) {
            p.tracts.insert(t, b);
        }
    }
    Ok(p)
}

/// The blob of a volume opened for writing, as its engines see it: its
/// stack of layers when it has snapshots (the catalog, every frozen
/// layer's presence, the head's asked of the tractservers), else its
/// tracts as they are. `tracts` is the volume's (tract 0 included). Its
/// `writer` (the process that claimed it) settles the catalog first.
pub(crate) async fn open(
    blob: Arc<dyn BlobIo>,
    sb: &Superblock,
    tracts: u64,
    writer: bool,
    planted: crate::PlantedBug,
) -> Result<Arc<LayeredIo>, VolumeError> {
    let Some(r) = sb.layers else {
        let cpt = blob.tract_size() / CHUNK_SIZE;
        return Ok(LayeredIo::new(blob, Stack::plain(tracts, cpt), planted));
    };
    let cat = if writer && blob.replication() > 1 {
        settle_catalog(&blob, r).await?
    } else {
        read_catalog(&blob, r).await?
    };
    let stack = stack_of(&blob, &cat, cat.layers.len() - 1, tracts, true).await?;
    let io = LayeredIo::new(blob, stack, planted);
    io.load_head(PARALLEL).await?;
    Ok(io)
}

/// The stack of the view ending at `cat.layers[last]`: with `head`, that
/// layer is the head (written, its presence the tractservers'), else it
/// is frozen too (a snapshot's read-only view).
async fn stack_of(
    blob: &Arc<dyn BlobIo>,
    cat: &Catalog,
    last: usize,
    tracts: u64,
    head: bool,
) -> Result<Stack, VolumeError> {
    let frozen_end = if head { last } else { last + 1 };
    let cpt = blob.tract_size() / CHUNK_SIZE;
    let mut presences = Vec::with_capacity(frozen_end);
    for l in &cat.layers[..frozen_end] {
        presences.push((l.id, read_presence(blob, l).await?));
    }
    let frozen = View::build(cpt, presences.iter().map(|(id, p)| (*id, p)));
    let top = &cat.layers[last];
    Ok(Stack {
        head: head.then_some((top.id, top.base)),
        frozen: Arc::new(frozen),
        bases: cat.layers[..=last].iter().map(|l| (l.id, l.base)).collect(),
        tracts,
    })
}

/// The read-only stack of snapshot `name`, and what the catalog says of it.
pub(crate) async fn open_snapshot(
    blob: &Arc<dyn BlobIo>,
    sb: &Superblock,
    name: &str,
) -> Result<(Arc<LayeredIo>, SnapInfo), VolumeError> {
    let missing = || VolumeError::NotFound(format!("{}@{name}", sb.name));
    let r = sb.layers.ok_or_else(missing)?;
    let cat = read_catalog(blob, r).await?;
    let i = cat
        .layers
        .iter()
        .position(|l| l.snapshot.as_ref().is_some_and(|s| s.name == name))
        .ok_or_else(missing)?;
    let layer = &cat.layers[i];
    let info = layer.snapshot.clone().ok_or_else(missing)?;
    let stack = stack_of(blob, &cat, i, layer.tracts + 1, false).await?;
    Ok((LayeredIo::new(blob.clone(), stack, crate::PlantedBug::None), info))
}

/// What `volume list` shows of a snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub created_unix_s: u64,
    pub size_bytes: u64,
    /// Bytes only this snapshot reads: what deleting it gives back.
    pub held_bytes: u64,
}

/// The names of the snapshots of the volume whose superblock is `sb`,
/// oldest first: its catalog only.
pub async fn names(blob: &Arc<dyn BlobIo>, sb: &Superblock) -> Result<Vec<String>, VolumeError> {
    let Some(r) = sb.layers else { return Ok(Vec::new()) };
    let cat = read_catalog(blob, r).await?;
    Ok(cat.layers.iter().filter_map(|l| l.snapshot.as_ref().map(|s| s.name.clone())).collect())
}

/// The snapshots of the volume whose superblock is `sb`, oldest first.
pub async fn list(blob: &Arc<dyn BlobIo>, sb: &Superblock) -> Result<Vec<SnapshotInfo>, VolumeError> {
    let Some(r) = sb.layers else { return Ok(Vec::new()) };
    let cat = read_catalog(blob, r).await?;
    let cpt = blob.tract_size() / CHUNK_SIZE;
    let mut presences = Vec::with_capacity(cat.layers.len());
    for l in &cat.layers[..cat.layers.len() - 1] {
        presences.push((l.id, read_presence(blob, l).await?));
    }
    let head = cat.head();
    presences.push((head.id, presence_of(blob, head.base, head.tracts + 1).await?));
    let views: Vec<u32> =
        cat.layers.iter().filter(|l| l.snapshot.is_some() || l.id == head.id).map(|l| l.id).collect();
    let held = super::map::held_alone(cpt, &presences, &views);
    Ok(cat
        .layers
        .iter()
        .filter_map(|l| {
            let s = l.snapshot.as_ref()?;
            let i = views.iter().position(|&v| v == l.id)?;
            Some(SnapshotInfo {
                name: s.name.clone(),
                created_unix_s: s.created_unix_s,
                size_bytes: s.size_bytes,
                held_bytes: held[i] * CHUNK_SIZE as u64,
            })
        })
        .collect())
}

/// Deletes snapshot `name` of the volume behind `io` and gives back what
/// no view reads any more (design 0011, "Reference counting and
/// reclaim"). The caller has made every acknowledged write durable and
/// holds every new one back (the head's chunks in memory are then on
/// every replica). In order:
///
/// 1. the catalog written without the snapshot: **the switch** (its layer
///    stays, hidden, while later views read some of its chunks);
/// 2. every chunk of every layer that no view reads trimmed: the deleted
///    snapshot's alone, and any a crash kept an earlier deletion from
///    giving back (idempotent, so a crash here leaves space for the next
///    deletion to give back, never a view changed).
///
/// Returns the bytes given back.
pub(crate) async fn delete(
    io: &LayeredIo,
    sb: &Superblock,
    name: &str,
    planted: crate::PlantedBug,
) -> Result<u64, VolumeError> {
    let missing = || VolumeError::NotFound(format!("{}@{name}", sb.name));
    let r = sb.layers.ok_or_else(missing)?;
    let blob = io.blob().clone();
    let cpt = blob.tract_size() / CHUNK_SIZE;
    let s = io.stack();
    let Some((head_id, _)) = s.head else {
        return Err(VolumeError::Unsupported("a snapshot is read-only".into()));
    };
    let mut cat = read_catalog(&blob, r).await?;
    let i = cat
        .layers
        .iter()
        .position(|l| l.snapshot.as_ref().is_some_and(|s| s.name == name))
        .ok_or_else(missing)?;
    // 1. The switch.
    cat.layers[i].snapshot = None;
    cat.generation += 1;
    cat.validate()
        .map_err(|f| VolumeError::Invalid(format!("the new snapshot catalog breaks a rule ({f})")))?;
    write_catalog(&blob, r, &cat).await?;
    // 2. What no view reads.
    let mut layers = Vec::with_capacity(cat.layers.len());
    for l in &cat.layers[..cat.layers.len() - 1] {
        layers.push((l.id, read_presence(&blob, l).await?));
    }
    layers.push((head_id, Presence { tracts: io.head_bits().into_iter().collect() }));
    let mut views: Vec<u32> = cat.layers.iter().filter(|l| l.snapshot.is_some()).map(|l| l.id).collect();
    views.push(head_id);
    let mut unread = super::map::unread(cpt, &layers, &views);
    if planted == crate::PlantedBug::ReclaimReadChunks {
        // The bug: the deleted snapshot's whole layer taken as its own,
        // though later views read what no later layer rewrote.
        let gone = cat.layers[i].id;
        if let Some((_, p)) = layers.iter().find(|(id, _)| *id == gone) {
            unread.extend(p.tracts.keys().map(|&t| super::map::Unread {
                layer: gone,
                tract: t,
                chunks: 0..cpt,
            }));
        }
    }
    let mut given = 0u64;
    let mut trims = futures::stream::iter(unread.into_iter().filter(|u| u.layer != head_id))
        .map(|u| {
            let at = s.bases.get(&u.layer).map(|b| b + u.tract - 1);
            let (off, len) = (u.chunks.start * CHUNK_SIZE, (u.chunks.end - u.chunks.start) * CHUNK_SIZE);
            let blob = blob.clone();
            async move {
                match at {
                    Some(t) => blob.trim(t, off, len).await.map(|()| len as u64),
                    None => Ok(0),
                }
            }
        })
        .buffer_unordered(PARALLEL);
    while let Some(r) = trims.next().await {
        given += r?;
    }
    Ok(given)
}

/// Where a frozen head's presence record and the new head go (taking a
/// snapshot, rolling back): the record after the last one in the records
/// tract when it fits (a tract slot holds thousands of small records),
/// else at the blob's end; the new head after everything, at least at
/// `floor`. The blob is extended for them.
struct NewHead {
    record: Vec<u8>,
    record_at: u64,
    padded: u64,
    base: u64,
}

async fn make_room(
    blob: &Arc<dyn BlobIo>,
    cat: &Catalog,
    s: &Stack,
    head_base: u64,
    record: Vec<u8>,
    floor: u64,
) -> Result<NewHead, VolumeError> {
    let ts = blob.tract_size() as u64;
    let padded = (record.len() as u64).div_ceil(CHUNK_SIZE as u64) * CHUNK_SIZE as u64;
    let mut next = blob.size_tracts().max(head_base + s.tracts - 1).max(floor);
    let record_at = match cat.records {
        Some((t, used)) if used + padded <= ts => t * ts + used,
        _ => {
            let at = next * ts;
            next += padded.div_ceil(ts);
            at
        }
    };
    blob.extend_to(next + s.tracts - 1).await?;
    Ok(NewHead { record, record_at, padded, base: next })
}

/// The catalog with its head frozen (its record at `n.record_at`) and a
/// new empty head at `n.base` on top, one generation up; returns the new
/// head's id. Not written: the caller's write of it is the switch.
fn push_head(cat: &mut Catalog, s: &Stack, head_id: u32, n: &NewHead, ts: u64) -> Result<u32, VolumeError> {
    let end = n.record_at + n.padded;
    cat.records = (!end.is_multiple_of(ts)).then_some((end / ts, end % ts));
    let frozen = cat.layers.len() - 1;
    cat.layers[frozen].presence = Some((n.record_at, n.record.len() as u64));
    cat.layers[frozen].tracts = s.tracts - 1;
    let new_id = head_id + 1;
    cat.layers.push(Layer { id: new_id, base: n.base, tracts: s.tracts - 1, presence: None, snapshot: None });
    cat.generation += 1;
    cat.validate()
        .map_err(|f| VolumeError::Invalid(format!("the new snapshot catalog breaks a rule ({f})")))?;
    Ok(new_id)
}

/// The stack after the switch: the old head (holding `presence`) frozen
/// under the new one.
fn stack_after(s: &Stack, head_id: u32, presence: &Presence, new_id: u32, base: u64) -> Stack {
    let mut view = (*s.frozen).clone();
    view.push(head_id, presence);
    let mut bases = s.bases.clone();
    bases.insert(new_id, base);
    Stack { head: Some((new_id, base)), frozen: Arc::new(view), bases, tracts: s.tracts }
}

/// Rolls the volume behind `io` back to snapshot `name` (design 0011,
/// "Rollback"): the volume then reads exactly as the snapshot does, and
/// every snapshot stays. The caller has made every acknowledged write
/// durable and holds every new one back. In order:
///
/// 1. the blob extended at its end for the head's presence record and a
///    new head;
/// 2. into the new head, every chunk where the volume's view and the
///    snapshot's differ: the snapshot's copy, or zeros where it has none
///    (copied, so the cost is what changed since the snapshot, as for
///    `rbd snap rollback`; nothing else is written);
/// 3. the old head's presence record (it stays as a layer no snapshot
///    names: later snapshots read it);
/// 4. the catalog with the old head frozen and the new head on top:
///    **the switch**. Before it nothing names what 1–3 wrote (the tracts
///    past the stack's end are trimmed before anything grows over them),
///    so a crash leaves the volume as it was; after it, the snapshot.
///
/// Returns the bytes copied into the new head.
pub(crate) async fn rollback(
    io: &LayeredIo,
    sb: &Superblock,
    name: &str,
    planted: crate::PlantedBug,
) -> Result<u64, VolumeError> {
    let missing = || VolumeError::NotFound(format!("{}@{name}", sb.name));
    let r = sb.layers.ok_or_else(missing)?;
    let blob = io.blob().clone();
    let ts = blob.tract_size() as u64;
    let cpt = (ts / CHUNK_SIZE as u64) as u32;
    let s = io.stack();
    let Some((head_id, head_base)) = s.head else {
        return Err(VolumeError::Unsupported("a snapshot is read-only".into()));
    };
    let mut cat = read_catalog(&blob, r).await?;
    let k = cat
        .layers
        .iter()
        .position(|l| l.snapshot.as_ref().is_some_and(|s| s.name == name))
        .ok_or_else(missing)?;
    if cat.layers.len() >= super::catalog::LAYERS_MAX {
        return Err(VolumeError::Refused(format!(
            "volume {:?} has {} layers, the most its catalog holds: delete snapshots first",
            sb.name,
            cat.layers.len()
        )));
    }
    let snap_tracts = cat.layers[k].tracts + 1;
    let mut presences = Vec::with_capacity(k + 1);
    for l in &cat.layers[..=k] {
        presences.push((l.id, read_presence(&blob, l).await?));
    }
    let snap_view = View::build(cpt, presences.iter().map(|(id, p)| (*id, p)));
    let head = Presence { tracts: io.head_bits().into_iter().collect() };
    // 1. Room.
    let room = make_room(&blob, &cat, &s, head_base, head.encode(head_id, cpt), 0).await?;
    let new_base = room.base;
    // 2. The chunks that differ, tract by tract, a run of one source at a
    // time: read from the snapshot's layer (or zeros), written whole.
    let mut restored: std::collections::HashMap<u64, TractBits> = std::collections::HashMap::new();
    let mut copied = 0u64;
    for t in 1..s.tracts {
        let mut runs: Vec<(u32, u32, Option<u32>)> = Vec::new();
        for c in 0..cpt {
            let now = if head.has(t, c) { Some(head_id) } else { s.frozen.layer_of(t, c) };
            let then = if t < snap_tracts { snap_view.layer_of(t, c) } else { None };
            if now == then {
                continue;
            }
            match runs.last_mut() {
                Some(r) if r.1 == c && r.2 == then => r.1 = c + 1,
                _ => runs.push((c, c + 1, then)),
            }
        }
        if runs.is_empty() {
            continue;
        }
        let mut bits = vec![0u8; (cpt as usize).div_ceil(8)];
        for &(a, b, src) in &runs {
            let (off, len) = (a * CHUNK_SIZE, (b - a) * CHUNK_SIZE);
            let data = match src.and_then(|l| s.bases.get(&l).map(|base| base + t - 1)) {
                Some(at) => blob.read(at, off, len).await?,
                None => Bytes::from(vec![0u8; len as usize]),
            };
            let into = match planted {
                crate::PlantedBug::RollbackInPlace => head_base,
                _ => new_base,
            };
            blob.write(into + t - 1, off, data).await?;
            copied += len as u64;
            for c in a..b {
                bits[c as usize / 8] |= 1 << (c % 8);
            }
        }
        if let Some(b) = TractBits::from_mapped(&bits, cpt) {
            restored.insert(t, b);
        }
    }
    // 3. The old head's record.
    write_record(&blob, room.record_at, &room.record).await?;
    // 4. The switch.
    let new_id = push_head(&mut cat, &s, head_id, &room, ts)?;
    write_catalog(&blob, r, &cat).await?;
    // 5. In memory.
    io.switch_to_head(stack_after(&s, head_id, &head, new_id, new_base), restored);
    Ok(copied)
}

/// Takes snapshot `name` of the volume behind `io` (module docs: the
/// steps). The caller has made every acknowledged write durable and holds
/// every new one back. Returns the superblock now in force (the first
/// snapshot writes a new one).
pub(crate) async fn take(
    io: &LayeredIo,
    sb: &Superblock,
    name: &str,
    now_unix_s: u64,
) -> Result<Superblock, VolumeError> {
    blizzard_lsvd::format::check_snapshot_name(name).map_err(VolumeError::Invalid)?;
    let blob = io.blob().clone();
    let ts = blob.tract_size() as u64;
    let cpt = (ts / CHUNK_SIZE as u64) as u32;
    let s = io.stack();
    let Some((head_id, head_base)) = s.head else {
        return Err(VolumeError::Unsupported("a snapshot is read-only".into()));
    };
    let (mut cat, r, first) = match sb.layers {
        Some(r) => (read_catalog(&blob, r).await?, r, false),
        None => {
            let r =
                LayersRef { catalog: blob.size_tracts().max(s.tracts), slot_tracts: SLOT_BYTES.div_ceil(ts) };
            (Catalog::first(s.tracts - 1), r, true)
        }
    };
    if cat.snapshot(name).is_some() {
        return Err(VolumeError::Exists(format!("{}@{name}", sb.name)));
    }
    if cat.layers.len() >= super::catalog::LAYERS_MAX {
        return Err(VolumeError::Refused(format!(
            "volume {:?} has {} layers, the most its catalog holds: delete snapshots first",
            sb.name,
            cat.layers.len()
        )));
    }
    // 1. The head's chunks.
    let presence = if first {
        presence_of(&blob, head_base, s.tracts).await?
    } else {
        Presence { tracts: io.head_bits().into_iter().collect() }
    };
    // 2. Room (`make_room`; past the catalog's slots the first time).
    let floor = if first { r.catalog + 2 * r.slot_tracts } else { 0 };
    let room = make_room(&blob, &cat, &s, head_base, presence.encode(head_id, cpt), floor).await?;
    // 3. The record.
    write_record(&blob, room.record_at, &room.record).await?;
    // 4. The catalog (and, the first time, the superblock): the switch.
    let frozen = cat.layers.len() - 1;
    cat.layers[frozen].snapshot =
        Some(SnapInfo { name: name.to_string(), created_unix_s: now_unix_s, size_bytes: sb.size_bytes });
    let new_id = push_head(&mut cat, &s, head_id, &room, ts)?;
    write_catalog(&blob, r, &cat).await?;
    let mut next_sb = sb.clone();
    if first {
        next_sb.layers = Some(r);
        next_sb.generation += 1;
        crate::Volume::write_superblock(&blob, &next_sb).await?;
    }
    // 5. In memory.
    io.switch(stack_after(&s, head_id, &presence, new_id, room.base));
    Ok(next_sb)
}
