//! Recovery of the durable Raft log (`LogStore::open`): the files as a
//! crash or a clean stop left them become the log's state in memory.
//!
//! Case by case:
//!
//! | on disk | treated as |
//! |---|---|
//! | no `raft.meta`, no segments | a fresh store: the meta is written (generation 1) |
//! | `raft.meta` short or with no valid slot, no segments | a fresh store (a crash while creating it) |
//! | no `raft.meta` (or a short one), segments exist | refuse to start ([`LogError::MetaMissing`], [`LogError::MetaLen`]) |
//! | both meta slots invalid, segments exist | refuse ([`LogError::MetaUnreadable`]): the vote and purge point are unknown |
//! | one slot valid (the other torn, damaged or never written) | that one |
//! | both valid | the higher generation |
//! | another cluster or node id in the meta | refuse ([`LogError::WrongMember`]) |
//! | segments numbered below the first live one | leftovers of a purge cut short: removed |
//! | a live segment missing before the last one present | refuse ([`LogError::MissingSegment`]) |
//! | first live segment starts after the purge point + 1 | refuse ([`LogError::SegmentGap`]) |
//! | records at or below the purge point | skipped (their chain is still checked) |
//! | a record with bad magic, lengths or CRC (chained) | the end of that segment's records |
//! | a CRC-valid record that does not decode or is out of sequence | refuse ([`LogError::Undecodable`], [`LogError::Corrupt`]) |
//! | after a segment's last record, a next segment with a valid header starting at the next index | the log goes on there (the writer rolled over) |
//! | otherwise | the end of the log (a torn tail) |
//! | segments after the end of the log | never acknowledged: removed (highest first) |
//! | the log ends before the saved committed id | refuse ([`LogError::CommittedLost`]): synced records were lost |
//!
//! Why a torn tail is safe to drop: flushes complete in order, so a
//! callback that fired covered every byte written before it. The first
//! record that is not whole was therefore never acknowledged, and neither
//! was anything written after it. The bytes a crash left unsynced but
//! kept are made durable (every live segment and the meta are synced)
//! before `open` returns, so what recovery reports is what the next crash
//! will find too.
//!
//! The steps, each a function below, in order: list the files
//! ([`list_files`]); open or create the meta ([`open_meta`]); check the
//! live segments are contiguous ([`live_segments`]); scan their records
//! ([`Scan::segment`]); check nothing committed was lost (pure:
//! [`check_committed`]); and only then change the disk ([`settle`]): sync
//! what was read, remove what is past the end or purged.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use blizzard_env::{Disk, Env, GroupCommit};

use super::meta::{self, Meta, SlotError, META_FILE, META_LEN, META_SLOT_LEN};
use super::segment::{
    align, decode_record, parse_segment_name, segment_name, Invalid, RecordError, RecordHeader,
    SegmentHeader, RECORD_HEADER_LEN, SEGMENT_HEADER_LEN, SEGMENT_PREFIX,
};
use super::{
    io_err, Loc, LogConfig, LogError, Segment, Shared, Tail, WriteState, READ_CHUNK_MAX, SEGMENT_LEN_MIN,
};
use crate::types::{LogId, NodeId};

/// Reads a segment front to back in chunks.
struct Window<'a> {
    disk: &'a Arc<dyn Disk>,
    limit: u64,
    start: u64,
    buf: Bytes,
}

impl Window<'_> {
    /// `[off, off + len)`, which the caller checked lies below `limit`.
    async fn get(&mut self, off: u64, len: usize) -> io::Result<Bytes> {
        let end = off + len as u64;
        let have = self.start + self.buf.len() as u64;
        if off < self.start || end > have {
            let want = (len.max(READ_CHUNK_MAX) as u64).min(self.limit - off);
            self.buf = self.disk.read_at(off, want as usize).await?;
            self.start = off;
        }
        let at = (off - self.start) as usize;
        Ok(self.buf.slice(at..at + len))
    }
}

/// What recovery found.
pub(super) struct Recovered {
    pub(super) shared: Shared,
    pub(super) write: WriteState,
    pub(super) syncs: u64,
}

/// Rebuilds the log's state from `dir` (the module's table).
pub(super) async fn recover(
    env: &Env,
    dir: &Path,
    cluster: u128,
    node: NodeId,
    cfg: &LogConfig,
) -> Result<Recovered, LogError> {
    let meta_path = dir.join(META_FILE);
    let (files, meta_listed) = list_files(env, dir).await?;
    let fresh =
        Meta { generation: 1, cluster, node, vote: None, committed: None, purged: None, first_live: 0 };
    let (meta_disk, meta, meta_slot, mut syncs) =
        open_meta(env, dir, &meta_path, meta_listed, !files.is_empty(), fresh).await?;
    if meta.cluster != cluster || meta.node != node {
        return Err(LogError::WrongMember {
            dir: dir.to_path_buf(),
            found_cluster: meta.cluster,
            found_node: meta.node,
            cluster,
            node,
        });
    }
    let first_live = meta.first_live;
    let (below, live) = live_segments(dir, &files, first_live)?;

    let mut scan = Scan {
        shared: Shared {
            segments: BTreeMap::new(),
            locs: VecDeque::new(),
            cache: VecDeque::new(),
            cache_bytes: 0,
            vote: meta.vote,
            committed: meta.committed,
            purged: meta.purged,
            generation: 0,
        },
        tail: None,
        next: meta.purged.map(|p| p.index + 1),
        soft_stop: None,
        ended: None,
        garbage: Vec::new(),
    };
    for (i, (number, path)) in live.iter().enumerate() {
        scan.segment(env, i, *number, path, &meta, cfg).await?;
    }
    let Scan { shared, tail, ended, soft_stop, garbage, .. } = scan;
    let stop = ended.or(soft_stop);

    let last = shared.last_log_id();
    if let Some(c) = meta.committed {
        let at_committed = shared.loc(c.index).map(|loc| loc.log_id);
        check_committed(c, last, at_committed, stop.as_deref())?;
    }

    syncs += settle(env, dir, &shared, &meta_disk, &meta_path, &garbage, &below, stop.as_deref()).await?;
    tracing::info!(
        dir = %dir.display(),
        first = ?shared.first_index(),
        last = ?last.map(|l| l.index),
        purged = ?meta.purged.map(|p| p.index),
        segments = shared.segments.len(),
        "recovered the raft log"
    );
    let next_segment = tail.as_ref().map_or(first_live, |t| t.seg.number + 1);
    let write = WriteState {
        tail,
        next_segment,
        run: env.random_u64(),
        meta_disk,
        meta_path,
        meta,
        meta_slot,
        durable_slot: meta_slot,
    };
    Ok(Recovered { shared, write, syncs })
}

/// The segment files in `dir` by number (other files are warned about and
/// left alone), and whether the meta file is there.
async fn list_files(env: &Env, dir: &Path) -> Result<(BTreeMap<u64, PathBuf>, bool), LogError> {
    let mut files: BTreeMap<u64, PathBuf> = BTreeMap::new();
    for p in env.list_disks(dir, SEGMENT_PREFIX).await.map_err(io_err("listing segments in", dir))? {
        match p.file_name().and_then(|n| n.to_str()).and_then(parse_segment_name) {
            Some(n) => {
                files.insert(n, p);
            }
            None => tracing::warn!(path = %p.display(), "ignoring a file that is not a log segment"),
        }
    }
    let meta_listed = env
        .list_disks(dir, META_FILE)
        .await
        .map_err(io_err("listing", dir))?
        .iter()
        .any(|p| p.file_name().and_then(|n| n.to_str()) == Some(META_FILE));
    Ok((files, meta_listed))
}

/// The meta in force: its disk, its content, the slot it came from, and
/// the syncs this made. A missing or unusable meta is a fresh store only
/// while no segment exists (`fresh` is then written, synced, and
/// returned); with segments it is refused (the module's table).
async fn open_meta(
    env: &Env,
    dir: &Path,
    meta_path: &Path,
    meta_listed: bool,
    segments_exist: bool,
    fresh: Meta,
) -> Result<(Arc<dyn Disk>, Meta, usize, u64), LogError> {
    let existing = if meta_listed {
        let disk = env.open_disk(meta_path, None).await.map_err(io_err("opening", meta_path))?;
        if disk.len() < META_LEN {
            if segments_exist {
                return Err(LogError::MetaLen { path: meta_path.to_path_buf(), len: disk.len() });
            }
            // Cut short while being created: start again.
            env.remove_disk(meta_path).await.map_err(io_err("removing", meta_path))?;
            None
        } else {
            let b = disk.read_at(0, META_LEN as usize).await.map_err(io_err("reading", meta_path))?;
            let slots = [Meta::decode(&b[..META_SLOT_LEN]), Meta::decode(&b[META_SLOT_LEN..])];
            match meta::newest(&slots) {
                Some((slot, m)) => Some((disk, m, slot)),
                None if !segments_exist => None,
                None => {
                    let [a, b] = slots;
                    return Err(LogError::MetaUnreadable {
                        path: meta_path.to_path_buf(),
                        a: a.err().unwrap_or(SlotError::Empty),
                        b: b.err().unwrap_or(SlotError::Empty),
                    });
                }
            }
        }
    } else if segments_exist {
        return Err(LogError::MetaMissing { path: meta_path.to_path_buf() });
    } else {
        None
    };
    match existing {
        Some((disk, m, slot)) => Ok((disk, m, slot, 0)),
        None => {
            let disk =
                env.open_disk(meta_path, Some(META_LEN)).await.map_err(io_err("creating", meta_path))?;
            disk.write_at(vec![(0, fresh.encode())]).await.map_err(io_err("writing", meta_path))?;
            disk.sync().await.map_err(io_err("syncing", meta_path))?;
            tracing::info!(dir = %dir.display(), "created a new raft log");
            Ok((disk, fresh, 0, 1))
        }
    }
}

/// Splits the segment files at `first_live`: those below (leftovers of a
/// purge cut short) and the live ones, which must be numbered without a
/// gap.
fn live_segments(
    dir: &Path,
    files: &BTreeMap<u64, PathBuf>,
    first_live: u64,
) -> Result<(Vec<PathBuf>, LiveSegments), LogError> {
    let below: Vec<PathBuf> = files.range(..first_live).map(|(_, p)| p.clone()).collect();
    let live: LiveSegments = files.range(first_live..).map(|(n, p)| (*n, p.clone())).collect();
    if let Some((last, _)) = live.last() {
        for (want, (n, _)) in (first_live..).zip(live.iter()) {
            if *n != want {
                return Err(LogError::MissingSegment {
                    path: dir.join(segment_name(want)),
                    first: first_live,
                    last: *last,
                });
            }
        }
    }
    Ok((below, live))
}

/// The live segment files, by number, in order.
type LiveSegments = Vec<(u64, PathBuf)>;

/// What the scan of the live segments has found so far.
struct Scan {
    shared: Shared,
    /// Where the last segment scanned ends.
    tail: Option<Tail>,
    /// The index the next record must have.
    next: Option<u64>,
    /// Why the last segment's records stopped before its end, until a next
    /// segment shows the writer rolled over there.
    soft_stop: Option<String>,
    /// Set once the log has ended: every later segment is garbage.
    ended: Option<String>,
    garbage: Vec<PathBuf>,
}

impl Scan {
    /// Scans live segment `number` (the `i`th) at `path`: its header, then
    /// its records, into `shared`; or marks it past the end of the log.
    async fn segment(
        &mut self,
        env: &Env,
        i: usize,
        number: u64,
        path: &Path,
        meta: &Meta,
        cfg: &LogConfig,
    ) -> Result<(), LogError> {
        if self.ended.is_some() {
            self.garbage.push(path.to_path_buf());
            return Ok(());
        }
        let disk = env.open_disk(path, None).await.map_err(io_err("opening", path))?;
        let header = if disk.len() < SEGMENT_HEADER_LEN {
            Err(Invalid::Short(disk.len() as usize))
        } else {
            let b = disk.read_at(0, SEGMENT_HEADER_LEN as usize).await.map_err(io_err("reading", path))?;
            SegmentHeader::decode(&b)
        };
        let (h, header_crc) = match header {
            Ok((h, _)) if h.number != number || h.len > disk.len() || h.len < SEGMENT_LEN_MIN => {
                self.ended = Some(self.soft_stop.take().unwrap_or(format!(
                    "{}: its header names segment {} of {} bytes",
                    path.display(),
                    h.number,
                    h.len
                )));
                self.garbage.push(path.to_path_buf());
                return Ok(());
            }
            Ok(x) => x,
            Err(why) => {
                self.ended = Some(
                    self.soft_stop.take().unwrap_or(format!("{}: segment header: {why}", path.display())),
                );
                self.garbage.push(path.to_path_buf());
                return Ok(());
            }
        };
        match self.next {
            Some(e) if i == 0 && h.first_index > e => {
                return Err(LogError::SegmentGap {
                    path: path.to_path_buf(),
                    first_index: h.first_index,
                    expected: e,
                });
            }
            Some(e) if i > 0 && h.first_index != e => {
                self.ended = Some(self.soft_stop.take().unwrap_or(format!(
                    "{}: starts at index {} where {e} was next",
                    path.display(),
                    h.first_index
                )));
                self.garbage.push(path.to_path_buf());
                return Ok(());
            }
            _ => {}
        }
        self.soft_stop = None;
        let seg = Arc::new(Segment {
            number,
            path: path.to_path_buf(),
            commit: GroupCommit::new(disk.clone()),
            disk: disk.clone(),
            salt: h.salt,
            len: h.len,
        });
        let mut index = h.first_index;
        let mut off = SEGMENT_HEADER_LEN;
        let mut prev = header_crc;
        let mut window = Window { disk: &disk, limit: h.len, start: 0, buf: Bytes::new() };
        while off + RECORD_HEADER_LEN as u64 <= h.len {
            let hb = window.get(off, RECORD_HEADER_LEN).await.map_err(io_err("reading", path))?;
            let rh = match RecordHeader::parse(&hb) {
                Ok(rh) if off + rh.len() <= h.len => rh,
                Ok(rh) => {
                    self.soft_stop = Some(format!(
                        "{} offset {off}: a record of {} bytes runs past the end",
                        path.display(),
                        rh.len()
                    ));
                    break;
                }
                Err(why) => {
                    self.soft_stop = Some(format!("{} offset {off}: record {why}", path.display()));
                    break;
                }
            };
            let rb = window.get(off, rh.len() as usize).await.map_err(io_err("reading", path))?;
            let (rh, entry) = match decode_record(h.salt, prev, &rb) {
                Ok(x) => x,
                Err(RecordError::Invalid(why)) => {
                    self.soft_stop = Some(format!("{} offset {off}: record {why}", path.display()));
                    break;
                }
                Err(RecordError::Undecodable(source)) => {
                    return Err(LogError::Undecodable { path: path.to_path_buf(), offset: off, source });
                }
            };
            if rh.log_id.index != index {
                return Err(LogError::Corrupt {
                    path: path.to_path_buf(),
                    offset: off,
                    index: rh.log_id.index,
                    why: format!(
                        "it follows its predecessor's chain but has index {}, not {index}",
                        rh.log_id.index
                    ),
                });
            }
            let len = rh.len();
            if meta.purged.is_none_or(|p| index > p.index) {
                let loc =
                    Loc { log_id: rh.log_id, seg: number, offset: off, len: len as u32, crc: rh.crc, prev };
                self.shared.push(entry, loc, cfg);
            }
            prev = rh.crc;
            off = align(off + len);
            index += 1;
        }
        self.next = Some(index);
        self.shared.segments.insert(number, seg.clone());
        self.tail = Some(Tail { seg, offset: off, prev });
        Ok(())
    }
}

/// Refuses a log that ends before the saved committed id `committed`, or
/// whose entry at that index is another (`at_committed`: the log id found
/// there, if any): synced records were lost. `last` is the last entry
/// found, `stop` why the log ended where it did.
fn check_committed(
    committed: LogId,
    last: Option<LogId>,
    at_committed: Option<LogId>,
    stop: Option<&str>,
) -> Result<(), LogError> {
    let stop = stop.map_or_else(|| "the last segment ends there".to_string(), str::to_string);
    match last {
        Some(l) if l.index >= committed.index => match at_committed.filter(|found| *found != committed) {
            Some(found) => Err(LogError::CommittedLost {
                committed,
                last: format!("{} (whose entry {} is {})", l, committed.index, found),
                stop,
            }),
            None => Ok(()),
        },
        _ => Err(LogError::CommittedLost {
            committed,
            last: last.map_or("the very beginning".into(), |l| l.to_string()),
            stop,
        }),
    }
}

/// The only step that changes the disk, once everything was checked: what
/// recovery read may have been unsynced (a process that died before its
/// fdatasync), so every live segment and the meta are synced before anyone
/// relies on them; then segments past the end of the log (highest first)
/// and purged ones are removed. Returns the syncs made.
#[allow(clippy::too_many_arguments)]
async fn settle(
    env: &Env,
    dir: &Path,
    shared: &Shared,
    meta_disk: &Arc<dyn Disk>,
    meta_path: &Path,
    garbage: &[PathBuf],
    below: &[PathBuf],
    stop: Option<&str>,
) -> Result<u64, LogError> {
    let mut syncs = 0;
    for seg in shared.segments.values() {
        seg.disk.sync().await.map_err(io_err("syncing", &seg.path))?;
        syncs += 1;
    }
    meta_disk.sync().await.map_err(io_err("syncing", meta_path))?;
    syncs += 1;
    for p in garbage.iter().rev() {
        tracing::warn!(path = %p.display(), "removing a segment past the end of the log (never acknowledged)");
        env.remove_disk(p).await.map_err(io_err("removing", p))?;
    }
    for p in below {
        tracing::info!(path = %p.display(), "removing a purged segment");
        env.remove_disk(p).await.map_err(io_err("removing", p))?;
    }
    if let Some(why) = stop {
        tracing::info!(dir = %dir.display(), "the raft log ends before its last segment's end: {why}");
    }
    Ok(syncs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(term: u64, index: u64) -> LogId {
        crate::codec::tests::log_id(term, 1, index)
    }

    /// A log that reaches the committed id with that very entry there is
    /// whole, whether it goes on past it or ends right there.
    #[test]
    fn a_log_that_holds_its_committed_entry_is_whole() {
        let c = id(3, 10);
        assert!(check_committed(c, Some(id(3, 12)), Some(c), None).is_ok());
        assert!(check_committed(c, Some(c), Some(c), Some("a torn tail")).is_ok());
    }

    /// A log that stops short of the committed id lost synced records and
    /// is refused, saying where and why it ended.
    #[test]
    fn a_log_that_ends_before_its_committed_entry_is_refused() {
        let c = id(3, 10);
        match check_committed(c, Some(id(3, 9)), None, Some("a torn tail")) {
            Err(LogError::CommittedLost { last, stop, .. }) => {
                assert_eq!(last, id(3, 9).to_string());
                assert_eq!(stop, "a torn tail");
            }
            other => panic!("{other:?}"),
        }
        match check_committed(c, None, None, None) {
            Err(LogError::CommittedLost { last, stop, .. }) => {
                assert_eq!(last, "the very beginning");
                assert_eq!(stop, "the last segment ends there");
            }
            other => panic!("{other:?}"),
        }
    }

    /// A log that reaches the committed index but holds another entry
    /// there lost the committed one and is refused, naming the one found.
    #[test]
    fn a_log_with_another_entry_at_the_committed_index_is_refused() {
        let c = id(3, 10);
        match check_committed(c, Some(id(4, 11)), Some(id(4, 10)), None) {
            Err(LogError::CommittedLost { committed, last, stop }) => {
                assert_eq!(committed, c);
                assert_eq!(last, format!("{} (whose entry 10 is {})", id(4, 11), id(4, 10)));
                assert_eq!(stop, "the last segment ends there");
            }
            other => panic!("{other:?}"),
        }
    }
}
