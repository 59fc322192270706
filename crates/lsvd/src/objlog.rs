//! The object log (design 0008): the volume's data as numbered objects,
//! the object map that serves reads from them, checkpoints of that map,
//! and recovery (newest valid checkpoint, then roll forward, stopping at
//! the first missing object).
//!
//! [`LogState`] is the pure core: objects applied in seq order to the map
//! and to the table of live bytes per object. [`ObjectLog`] is the shell
//! that reads and writes objects; [`recover`] and [`claim`] open a log.
//!
//! Invariants: the state only ever applies object `head + 1`
//! (`LogState::apply` refuses anything else), so the map is exactly the
//! result of objects `1..=head` in order; an object is never trusted
//! without its header CRC, nor its data without the CRC of each 4 KiB
//! block read.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::{Arc, Mutex};

use blizzard_core::crc::crc32c;
use bytes::{Bytes, BytesMut};

use crate::error::LsvdError;
use crate::extent_map::{ExtentMap, Loc};
use crate::format::{
    Checkpoint, CkptExtent, Descriptor, ObjStat, ObjectHeader, ObjectKind, CRC_BLOCK, OBJECT_PREFIX_LEN,
};
use crate::read_cache::{ReadCache, LINE};
use crate::store::{checkpoint_name, object_name, parse_seq, Created, Store, DESCRIPTOR};

/// Where bytes live in the object log: object `seq`, from `off` in its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjLoc {
    pub seq: u64,
    pub off: u64,
}

impl Loc for ObjLoc {
    fn advance(self, by: u64) -> Self {
        ObjLoc { seq: self.seq, off: self.off + by }
    }
}

/// The applied log: the object map, the live bytes of each object, and
/// where the log ends.
#[derive(Clone, Debug, Default)]
pub struct LogState {
    pub map: ExtentMap<ObjLoc>,
    pub objects: BTreeMap<u64, ObjStat>,
    /// Seq of the newest applied object (0: none).
    pub head: u64,
    /// Epoch of the newest applied object: no later object may carry less.
    pub epoch: u64,
    /// Newest journal record folded into the log.
    pub journal_seq: u64,
}

impl LogState {
    pub fn from_checkpoint(c: &Checkpoint) -> LogState {
        let mut map = ExtentMap::new();
        for e in &c.extents {
            map.insert(e.start, e.len, Some(ObjLoc { seq: e.seq, off: e.offset }));
        }
        let objects = c.objects.iter().map(|o| (o.seq, *o)).collect();
        LogState { map, objects, head: c.seq, epoch: c.epoch, journal_seq: c.journal_seq }
    }

    pub fn to_checkpoint(&self, uuid: u128, size: u64) -> Checkpoint {
        Checkpoint {
            uuid,
            seq: self.head,
            epoch: self.epoch,
            journal_seq: self.journal_seq,
            size,
            extents: self
                .map
                .iter()
                .map(|e| CkptExtent { start: e.start, len: e.len, seq: e.loc.seq, offset: e.loc.off })
                .collect(),
            objects: self.objects.values().copied().collect(),
        }
    }

    /// Whether `h` may follow the applied log (the recovery case table:
    /// the next seq, an epoch not below the running one and not above its
    /// own seq, a journal seq that does not go back).
    pub fn admits(&self, h: &ObjectHeader) -> Result<(), String> {
        if h.seq != self.head + 1 {
            return Err(format!("object {} does not follow object {}", h.seq, self.head));
        }
        if h.epoch < self.epoch || h.epoch > h.seq {
            return Err(format!(
                "object {} has writer epoch {} (the log is at epoch {}): written by a writer that was fenced",
                h.seq, h.epoch, self.epoch
            ));
        }
        if h.journal_seq < self.journal_seq {
            return Err(format!(
                "object {} folds journal records up to {}, below the {} already folded",
                h.seq, h.journal_seq, self.journal_seq
            ));
        }
        Ok(())
    }

    /// Applies object `head + 1`.
    pub fn apply(&mut self, h: &ObjectHeader) -> Result<(), String> {
        self.admits(h)?;
        let mut live = 0;
        for e in &h.extents {
            let loc = e.obj_offset.map(|off| ObjLoc { seq: h.seq, off });
            for d in self.map.insert(e.vol_offset, e.len, loc) {
                if let Some(o) = self.objects.get_mut(&d.loc.seq) {
                    // Invariant: live counts exactly the object's bytes the
                    // map points at, so it never goes below zero.
                    debug_assert!(o.live >= d.len, "live bytes of object {} underflow", o.seq);
                    o.live = o.live.saturating_sub(d.len);
                }
            }
            if loc.is_some() {
                live += e.len;
            }
        }
        self.objects.insert(h.seq, ObjStat { seq: h.seq, data_len: h.data_len, live });
        self.head = h.seq;
        self.epoch = h.epoch;
        self.journal_seq = h.journal_seq;
        Ok(())
    }

    /// Live and total data bytes over the objects above `floor` (a
    /// clone's own objects: those up to its bases' seq are theirs).
    pub fn utilization(&self, floor: u64) -> (u64, u64) {
        self.objects.range(floor + 1..).fold((0, 0), |(l, t), (_, o)| (l + o.live, t + o.data_len))
    }
}

/// What a reader needs of an object besides the map: where its data
/// starts and the CRC of each block.
#[derive(Debug)]
struct ObjMeta {
    header_len: u64,
    data_len: u64,
    crcs: Vec<u32>,
}

/// Checks `b`, object data from `start` (4 KiB-aligned), against the
/// object's block CRCs; the first failing block's index if any.
fn check_blocks(m: &ObjMeta, start: u64, b: &[u8]) -> Result<(), usize> {
    debug_assert!(start.is_multiple_of(CRC_BLOCK));
    let first = (start / CRC_BLOCK) as usize;
    for (i, block) in b.chunks(CRC_BLOCK as usize).enumerate() {
        if m.crcs.get(first + i) != Some(&crc32c(block)) {
            return Err(first + i);
        }
    }
    Ok(())
}

/// Most CRC-table bytes kept for reads; beyond it the oldest objects'
/// tables are dropped and fetched again when read.
const META_CACHE_BYTES_MAX: usize = 64 << 20;

/// Reads and writes a volume's objects.
pub struct ObjectLog {
    store: Store,
    desc: Descriptor,
    /// A clone's bases, oldest first: (last seq, the base's prefix, its
    /// uuid). An object at or below a base's seq (and above the previous
    /// one's) is that base's, read from its prefix; seqs never repeat
    /// along a chain (a clone's log continues from its base's snapshot).
    bases: Vec<(u64, Store, u128)>,
    meta: Mutex<(BTreeMap<u64, Arc<ObjMeta>>, usize)>,
    read_cache: Option<ReadCache>,
}

impl ObjectLog {
    pub fn new(store: Store, desc: Descriptor) -> ObjectLog {
        let bases = desc.base.iter().map(|b| (b.upto, store.at(&b.prefix), b.uuid)).collect();
        ObjectLog { store, desc, bases, meta: Mutex::new((BTreeMap::new(), 0)), read_cache: None }
    }

    /// Where object `seq` lives: the store under its volume's prefix, and
    /// that volume's uuid (a clone's base, or this volume).
    fn layer(&self, seq: u64) -> (&Store, u128) {
        match self.bases.iter().find(|(upto, _, _)| seq <= *upto) {
            Some((_, store, uuid)) => (store, *uuid),
            None => (&self.store, self.desc.uuid),
        }
    }

    /// Reads go through `cache` from now on.
    pub fn set_read_cache(&mut self, cache: ReadCache) {
        self.read_cache = Some(cache);
    }

    pub fn read_cache(&self) -> Option<&ReadCache> {
        self.read_cache.as_ref()
    }

    pub fn desc(&self) -> &Descriptor {
        &self.desc
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    fn remember(&self, seq: u64, h: &ObjectHeader) -> Arc<ObjMeta> {
        let m = Arc::new(ObjMeta {
            header_len: h.encoded_len() as u64,
            data_len: h.data_len,
            crcs: h.crcs.clone(),
        });
        let mut g = self.meta.lock().unwrap_or_else(|p| p.into_inner());
        let (cache, bytes) = &mut *g;
        *bytes += 4 * m.crcs.len();
        if let Some(old) = cache.insert(seq, m.clone()) {
            *bytes -= 4 * old.crcs.len();
        }
        while *bytes > META_CACHE_BYTES_MAX {
            match cache.pop_first() {
                Some((_, old)) => *bytes -= 4 * old.crcs.len(),
                None => break,
            }
        }
        m
    }

    /// Reads and checks the header of object `seq` (`size`: the object's
    /// length if known, to fetch the header in one request).
    pub async fn read_header(&self, seq: u64, size: Option<u64>) -> Result<ObjectHeader, LsvdError> {
        let name = object_name(seq);
        let (store, uuid) = self.layer(seq);
        // A guess that holds most headers (an 8 MiB object of 16 KiB
        // writes: 512 extents and 2048 CRCs, about 20 KiB).
        let first = size.unwrap_or(64 << 10).clamp(OBJECT_PREFIX_LEN as u64, 64 << 10);
        let mut head = match store.get_range(&name, 0..first).await {
            Ok(b) => b,
            // An object shorter than the guess (a claim): take it whole.
            Err(LsvdError::Corrupt(_)) if size.is_none() => match store.get(&name).await? {
                Some(b) => b,
                None => return Err(LsvdError::NotFound(name)),
            },
            Err(e) => return Err(e),
        };
        let len = ObjectHeader::announced_len(&head)
            .map_err(|e| LsvdError::Corrupt(format!("object {seq}: {e}")))? as u64;
        if (head.len() as u64) < len {
            let rest = store.get_range(&name, head.len() as u64..len).await?;
            let mut all = head.to_vec();
            all.extend_from_slice(&rest);
            head = Bytes::from(all);
        }
        let h = ObjectHeader::decode(&head[..len as usize], self.desc.size)
            .map_err(|e| LsvdError::Corrupt(format!("object {seq}: {e}")))?;
        if h.seq != seq || h.uuid != uuid {
            return Err(LsvdError::Corrupt(format!(
                "object {seq} says it is object {} of volume {:032x}",
                h.seq, h.uuid
            )));
        }
        if let Some(size) = size {
            if size != len + h.data_len {
                return Err(LsvdError::Corrupt(format!(
                    "object {seq} is {size} bytes, its header says {}",
                    len + h.data_len
                )));
            }
        }
        self.remember(seq, &h);
        Ok(h)
    }

    /// What a read of `[off, +len)` of object `seq`'s data needs: its meta,
    /// once the range is checked to lie inside the data.
    async fn meta_for(&self, seq: u64, off: u64, len: u64) -> Result<Arc<ObjMeta>, LsvdError> {
        let m = self.meta(seq).await?;
        if off.checked_add(len).is_none_or(|e| e > m.data_len) {
            return Err(LsvdError::Corrupt(format!(
                "the map points at [{off}, +{len}) of object {seq}, which holds {} bytes",
                m.data_len
            )));
        }
        Ok(m)
    }

    async fn meta(&self, seq: u64) -> Result<Arc<ObjMeta>, LsvdError> {
        if let Some(m) = self.meta.lock().unwrap_or_else(|p| p.into_inner()).0.get(&seq) {
            return Ok(m.clone());
        }
        let h = self.read_header(seq, None).await?;
        Ok(self.remember(seq, &h))
    }

    /// `len` bytes of object `seq`'s data from `off`: the covering 4 KiB
    /// blocks are fetched and each one's CRC checked. With a read cache,
    /// the covering lines instead: those cached are checked the same way,
    /// the others fetched (one request per run of missing lines) and kept.
    pub async fn read(&self, seq: u64, off: u64, len: u64) -> Result<Bytes, LsvdError> {
        let m = self.meta_for(seq, off, len).await?;
        let Some(cache) = &self.read_cache else {
            return self.read_direct(seq, off, len).await;
        };
        if len == 0 {
            return Ok(Bytes::new());
        }
        let m: &ObjMeta = &m;
        let lines = off / LINE..(off + len - 1) / LINE + 1;
        let line_range = |l: u64| l * LINE..((l + 1) * LINE).min(m.data_len);
        let lookups = lines.clone().map(|l| async move {
            let r = line_range(l);
            match cache.get((seq, l), r.end - r.start).await {
                Some((_, b)) if check_blocks(m, r.start, &b).is_ok() => Some(b),
                Some((slot, _)) => {
                    cache.bad((seq, l), slot);
                    None
                }
                None => None,
            }
        });
        let mut got: Vec<Option<Bytes>> = futures::future::join_all(lookups).await;
        // Each run of missing lines: one ranged GET, kept line by line.
        let mut i = 0;
        while i < got.len() {
            if got[i].is_some() {
                i += 1;
                continue;
            }
            let mut j = i;
            while j < got.len() && got[j].is_none() {
                j += 1;
            }
            let (a, z) = (lines.start + i as u64, lines.start + j as u64);
            let run = line_range(a).start..line_range(z - 1).end;
            let b = self.fetch(seq, m, run.clone()).await?;
            let mut keeps = Vec::with_capacity(j - i);
            for (k, l) in (a..z).enumerate() {
                let r = line_range(l);
                let part = b.slice((r.start - run.start) as usize..(r.end - run.start) as usize);
                keeps.push(cache.put((seq, l), part.clone()));
                got[i + k] = Some(part);
            }
            futures::future::join_all(keeps).await;
            i = j;
        }
        let mut out = BytesMut::with_capacity(((lines.end - lines.start) * LINE) as usize);
        for b in got.into_iter().flatten() {
            out.extend_from_slice(&b);
        }
        let at = (off - lines.start * LINE) as usize;
        Ok(out.freeze().slice(at..at + len as usize))
    }

    /// [`ObjectLog::read`] past the read cache: one ranged GET of the
    /// covering blocks, nothing kept (the cleaner, reading objects it is
    /// about to delete, in one request each).
    pub async fn read_direct(&self, seq: u64, off: u64, len: u64) -> Result<Bytes, LsvdError> {
        let m = self.meta_for(seq, off, len).await?;
        let first = off / CRC_BLOCK;
        let end = ((off + len).div_ceil(CRC_BLOCK) * CRC_BLOCK).min(m.data_len);
        let b = self.fetch(seq, &m, first * CRC_BLOCK..end).await?;
        let at = (off - first * CRC_BLOCK) as usize;
        Ok(b.slice(at..at + len as usize))
    }

    /// Object `seq`'s data `range` (4 KiB-aligned, or ending at the end of
    /// the data), fetched and checked block by block.
    async fn fetch(&self, seq: u64, m: &ObjMeta, range: Range<u64>) -> Result<Bytes, LsvdError> {
        let b = self
            .layer(seq)
            .0
            .get_range(&object_name(seq), m.header_len + range.start..m.header_len + range.end)
            .await?;
        check_blocks(m, range.start, &b)
            .map_err(|n| LsvdError::Corrupt(format!("object {seq}: block {n} fails its CRC32C")))?;
        Ok(b)
    }

    /// Creates object `h.seq`. A name already taken is this writer's own
    /// object if its header is byte for byte the one sent (an earlier try
    /// whose reply was lost), otherwise another writer's: `Fenced`.
    pub async fn put_object(&self, h: &ObjectHeader, data: Vec<Bytes>) -> Result<(), LsvdError> {
        let head = h.encode();
        let mut parts = Vec::with_capacity(1 + data.len());
        parts.push(head);
        parts.extend(data);
        match self.store.create(&object_name(h.seq), parts).await? {
            Created::New => {
                self.remember(h.seq, h);
                Ok(())
            }
            Created::Exists => {
                let found = self.read_header(h.seq, None).await?;
                if &found == h {
                    return Ok(());
                }
                Err(LsvdError::Fenced {
                    name: self.desc.name.clone(),
                    seq: h.seq,
                    epoch: found.epoch,
                    mine: h.epoch,
                })
            }
        }
    }

    /// Writes checkpoint `c` (its seq's name). A name already taken must
    /// hold the same checkpoint.
    pub async fn put_checkpoint(&self, c: &Checkpoint) -> Result<(), LsvdError> {
        let b = c.encode();
        match self.store.create(&checkpoint_name(c.seq), vec![b.clone()]).await? {
            Created::New => {
                self.store
                    .counts()
                    .checkpoint_bytes_put
                    .fetch_add(b.len() as u64, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            Created::Exists => match self.store.get(&checkpoint_name(c.seq)).await? {
                Some(found) if found == b => Ok(()),
                _ => Err(LsvdError::Fenced {
                    name: self.desc.name.clone(),
                    seq: c.seq,
                    epoch: 0,
                    mine: c.epoch,
                }),
            },
        }
    }
}

/// Writes the descriptor of a new volume. A prefix already holding one is
/// refused (`Exists`), whoever wrote it.
pub async fn create(store: &Store, desc: &Descriptor) -> Result<(), LsvdError> {
    desc.validate().map_err(LsvdError::Invalid)?;
    match store.create(DESCRIPTOR, vec![desc.encode()]).await? {
        Created::New => Ok(()),
        Created::Exists => Err(LsvdError::Exists(format!("prefix {:?}", store.prefix()))),
    }
}

/// Reads the descriptor; `expected` is the name the caller opens.
pub async fn read_descriptor(store: &Store, expected: Option<&str>) -> Result<Descriptor, LsvdError> {
    let at = format!("prefix {:?}", store.prefix());
    let Some(b) = store.get(DESCRIPTOR).await? else {
        return Err(LsvdError::NotFound(at));
    };
    let desc = Descriptor::decode(&b).map_err(|e| LsvdError::Corrupt(format!("{at}: {e}")))?;
    if let Some(name) = expected {
        if desc.name != name {
            return Err(LsvdError::OtherVolume { at, found: desc.name, expected: name.to_string() });
        }
    }
    Ok(desc)
}

/// What recovery found.
pub struct Recovered {
    pub log: ObjectLog,
    pub state: LogState,
    /// Seq of the checkpoint recovery started from (0: none).
    pub checkpoint: u64,
    /// Objects rolled forward over.
    pub rolled: u64,
}

/// Recovers the log under `store`: descriptor, newest valid checkpoint
/// (at or before `upto`), then every following object in seq order up to
/// the first missing one (or `upto`). See the case table in design 0008.
pub async fn recover(
    store: Store,
    expected: Option<&str>,
    upto: Option<u64>,
) -> Result<Recovered, LsvdError> {
    let desc = read_descriptor(&store, expected).await?;
    let log = ObjectLog::new(store, desc);
    // A writer may check-point and delete objects while this one lists
    // (open racing a live writer): a hole below a checkpoint that appeared
    // meanwhile is that, not damage. Start again, a few times.
    let mut tries = 0;
    loop {
        tries += 1;
        match recover_once(&log, upto).await? {
            Attempt::Done(state, checkpoint, rolled) => {
                return Ok(Recovered { log, state, checkpoint, rolled })
            }
            Attempt::Moved(why) if tries >= 3 => return Err(LsvdError::Corrupt(why)),
            Attempt::Moved(_) => continue,
        }
    }
}

enum Attempt {
    Done(LogState, u64, u64),
    Moved(String),
}

async fn recover_once(log: &ObjectLog, upto: Option<u64>) -> Result<Attempt, LsvdError> {
    let desc = log.desc.clone();
    let limit = upto.unwrap_or(u64::MAX);
    let mut ckpts: Vec<u64> =
        log.store.list("c").await?.iter().filter_map(|(n, _)| parse_seq(n)).filter(|&s| s <= limit).collect();
    ckpts.sort_unstable_by(|a, b| b.cmp(a));
    let newest_listed = ckpts.first().copied().unwrap_or(0);
    let mut state = LogState::default();
    let mut from = 0;
    for &s in &ckpts {
        let Some(b) = log.store.get(&checkpoint_name(s)).await? else { continue };
        match Checkpoint::decode(&b) {
            Ok(c) if c.seq == s && c.uuid == desc.uuid && c.size == desc.size => {
                state = LogState::from_checkpoint(&c);
                from = s;
                break;
            }
            Ok(_) => tracing::warn!(seq = s, "checkpoint of another volume or seq; trying an older one"),
            Err(e) => tracing::warn!(seq = s, error = %e, "damaged checkpoint; trying an older one"),
        }
    }
    let objects: BTreeMap<u64, u64> = log
        .store
        .list("d")
        .await?
        .into_iter()
        .filter_map(|(n, size)| parse_seq(&n).map(|s| (s, size)))
        .collect();
    let mut rolled = 0;
    while state.head < limit {
        let next = state.head + 1;
        let Some(&size) = objects.get(&next) else { break };
        let h = log.read_header(next, Some(size)).await?;
        state.apply(&h).map_err(|e| LsvdError::Corrupt(format!("prefix {:?}: {e}", log.store.prefix())))?;
        rolled += 1;
    }
    if state.head < newest_listed {
        // Recovery had to fall back past a damaged checkpoint and could not
        // roll forward to it: objects it needs were deleted after it.
        return Ok(Attempt::Moved(format!(
            "checkpoint {newest_listed} is damaged and the log from an older one ends at {}: data would be lost",
            state.head
        )));
    }
    if upto.is_none() {
        let beyond: BTreeSet<u64> = objects.keys().copied().filter(|&s| s > state.head + 1).collect();
        if let Some(&s) = beyond.first() {
            // Puts are sequential: nothing exists past a missing object,
            // unless a writer deleted objects below a newer checkpoint
            // while this one listed.
            let newer = log.store.list("c").await?.iter().filter_map(|(n, _)| parse_seq(n)).any(|c| c > from);
            let why = format!(
                "prefix {:?}: object {} is missing but object {s} exists (a hole in the log)",
                log.store.prefix(),
                state.head + 1
            );
            if newer {
                return Ok(Attempt::Moved(why));
            }
            return Err(LsvdError::Corrupt(why));
        }
    }
    Ok(Attempt::Done(state, from, rolled))
}

/// Claims the log for writing: creates object `head + 1` as a claim; its
/// seq is this writer's epoch. Losing the create means another process
/// opened the volume meanwhile (`Held`).
/// `writer` is this opener's random nonce, carried by all its objects.
pub async fn claim(log: &ObjectLog, state: &mut LogState, writer: u64) -> Result<u64, LsvdError> {
    let seq = state.head + 1;
    let h = ObjectHeader {
        kind: ObjectKind::Claim,
        uuid: log.desc.uuid,
        seq,
        epoch: seq,
        writer,
        journal_seq: state.journal_seq,
        data_len: 0,
        extents: Vec::new(),
        crcs: Vec::new(),
    };
    match log.put_object(&h, Vec::new()).await {
        Ok(()) => {}
        Err(LsvdError::Fenced { .. }) => return Err(LsvdError::Held { name: log.desc.name.clone(), seq }),
        Err(e) => return Err(e),
    }
    state.apply(&h).map_err(LsvdError::Corrupt)?;
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::ObjExtent;

    fn data_header(seq: u64, epoch: u64, extents: Vec<ObjExtent>, data_len: u64) -> ObjectHeader {
        ObjectHeader {
            kind: ObjectKind::Data,
            uuid: 1,
            seq,
            epoch,
            writer: 1,
            journal_seq: seq,
            data_len,
            extents,
            crcs: vec![0; data_len.div_ceil(CRC_BLOCK) as usize],
        }
    }

    // Applying objects tracks live bytes: an overwrite moves liveness from
    // the old object to the new; a trim removes it; the checkpoint round
    // trip gives the same state.
    #[test]
    fn live_bytes_follow_overwrites_and_trims() {
        let mut s = LogState::default();
        s.apply(&data_header(1, 1, vec![ObjExtent { vol_offset: 0, len: 8192, obj_offset: Some(0) }], 8192))
            .expect("first");
        s.apply(&data_header(
            2,
            1,
            vec![
                ObjExtent { vol_offset: 4096, len: 1024, obj_offset: Some(0) },
                ObjExtent { vol_offset: 6144, len: 1024, obj_offset: None },
            ],
            1024,
        ))
        .expect("second");
        assert_eq!(s.objects[&1].live, 8192 - 2048);
        assert_eq!(s.objects[&2].live, 1024);
        assert_eq!(s.utilization(0), (8192 - 2048 + 1024, 8192 + 1024));
        let c = s.to_checkpoint(1, 1 << 20);
        let back = LogState::from_checkpoint(&c);
        assert_eq!(back.map.iter().collect::<Vec<_>>(), s.map.iter().collect::<Vec<_>>());
        assert_eq!(back.objects, s.objects);
        assert_eq!((back.head, back.epoch, back.journal_seq), (2, 1, 2));
    }

    // The log only takes the next seq, and never an epoch that goes back
    // (a fenced writer's object) or one above its own seq.
    #[test]
    fn admits_only_the_next_object_of_a_current_writer() {
        let mut s = LogState::default();
        assert!(s.apply(&data_header(2, 1, vec![], 0)).is_err(), "a gap");
        s.apply(&data_header(1, 1, vec![], 0)).expect("first");
        s.apply(&data_header(2, 2, vec![], 0)).expect("a claim raised the epoch");
        assert!(s.admits(&data_header(3, 1, vec![], 0)).is_err(), "epoch went back");
        assert!(s.admits(&data_header(3, 4, vec![], 0)).is_err(), "epoch above its seq");
        assert!(s.admits(&data_header(3, 3, vec![], 0)).is_ok());
    }
}
