//! The write cache: a log-structured journal on a local disk (design
//! 0008, "Journal"). [`Ring`] is the pure bookkeeping of which records
//! occupy which part of the circular area; [`Journal`] reads and writes
//! the file through the env seam's `Disk`; [`Journal::open`] replays it
//! after a restart, following the recovery case table in the design.
//!
//! Invariants: a record is written only into space the ring reserved for
//! it, and space is released only through [`Ring::release_through`], which
//! the volume calls only after the header's tail moved past the records
//! (durably) and their data is in durable objects; seqs grow by one per
//! record in area order, so the records from the tail are one chain.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use blizzard_env::{Disk, Env, GroupCommit};

use crate::error::LsvdError;
use crate::format::{
    JournalHeader, RecordHeader, RecordKind, JOURNAL_AREA_START, JOURNAL_HEADER_SLOT, RECORD_DATA_MAX,
    RECORD_HEADER_LEN, SECTOR,
};

/// Smallest cache file: room for a few records of the largest size the
/// volume makes for it.
pub const JOURNAL_LEN_MIN: u64 = JOURNAL_AREA_START + 64 * 1024;

/// One record's place in the area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecMeta {
    pub seq: u64,
    pub pos: u64,
    /// Bytes it occupies (a wrap record: up to the end of the area).
    pub total: u64,
    pub kind: RecordKind,
    pub vol_offset: u64,
    pub len: u64,
}

/// Where records are, from the tail to the head.
#[derive(Clone, Debug)]
pub struct Ring {
    area_len: u64,
    head: u64,
    next_seq: u64,
    records: VecDeque<RecMeta>,
    used: u64,
}

impl Ring {
    /// An empty ring whose first record is `seq` at `pos`.
    pub fn new(area_len: u64, pos: u64, seq: u64) -> Ring {
        assert!(area_len.is_multiple_of(SECTOR) && pos < area_len, "ring of {area_len} bytes, head at {pos}");
        Ring { area_len, head: pos, next_seq: seq, records: VecDeque::new(), used: 0 }
    }

    /// Largest data one record may carry in this area: any record must
    /// fit after the worst wrap waste while half the area is in use.
    pub fn record_data_max(&self) -> u64 {
        ((self.area_len / 4) / SECTOR * SECTOR).saturating_sub(RECORD_HEADER_LEN).min(RECORD_DATA_MAX)
    }

    pub fn area_len(&self) -> u64 {
        self.area_len
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn head(&self) -> u64 {
        self.head
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    /// The oldest record's place, or the head when there is none.
    pub fn tail(&self) -> (u64, u64) {
        match self.records.front() {
            Some(r) => (r.pos, r.seq),
            None => (self.head, self.next_seq),
        }
    }

    pub fn records(&self) -> impl Iterator<Item = &RecMeta> {
        self.records.iter()
    }

    pub fn get(&self, seq: u64) -> Option<&RecMeta> {
        let first = self.records.front()?.seq;
        self.records.get(seq.checked_sub(first)? as usize)
    }

    fn push(&mut self, r: RecMeta) {
        debug_assert_eq!(r.seq, self.next_seq);
        debug_assert_eq!(r.pos, self.head);
        self.used += r.total;
        assert!(self.used <= self.area_len, "journal ring overfilled");
        self.head = r.pos + r.total;
        if self.head == self.area_len {
            self.head = 0;
        }
        self.next_seq += 1;
        self.records.push_back(r);
    }

    /// Reserves space for a record, preceded by a wrap record if it would
    /// cross the end of the area. Returns the records to write, in order
    /// (the last is the one asked for), or `None` when there is no room yet.
    pub fn reserve(&mut self, kind: RecordKind, vol_offset: u64, len: u64) -> Option<Vec<RecMeta>> {
        assert!(kind != RecordKind::Wrap);
        let total = RECORD_HEADER_LEN + if kind == RecordKind::Write { len } else { 0 };
        assert!(total <= self.record_data_max() + RECORD_HEADER_LEN, "record of {total} bytes too large");
        let waste = if self.head + total > self.area_len { self.area_len - self.head } else { 0 };
        if self.used + waste + total > self.area_len {
            return None;
        }
        let mut out = Vec::with_capacity(2);
        if waste > 0 {
            let w = RecMeta {
                seq: self.next_seq,
                pos: self.head,
                total: waste,
                kind: RecordKind::Wrap,
                vol_offset: 0,
                len: 0,
            };
            self.push(w);
            out.push(w);
        }
        let r = RecMeta { seq: self.next_seq, pos: self.head, total, kind, vol_offset, len };
        self.push(r);
        out.push(r);
        Some(out)
    }

    /// Releases every record up to and including `seq`; returns them.
    pub fn release_through(&mut self, seq: u64) -> Vec<RecMeta> {
        let mut out = Vec::new();
        while let Some(r) = self.records.front().copied().filter(|r| r.seq <= seq) {
            self.records.pop_front();
            self.used -= r.total;
            out.push(r);
        }
        out
    }

    /// Takes a record found by replay (it must continue the chain).
    fn replayed(&mut self, r: RecMeta) {
        self.push(r);
    }
}

/// What opening the journal found.
pub struct Replay {
    /// Records newer than the object log's journal seq, in order: the
    /// writes the objects do not hold yet.
    pub records: Vec<RecMeta>,
    /// Records found older than that (already in objects) and skipped.
    pub skipped: u64,
    /// Whether there was no journal file (the cache was lost).
    pub created: bool,
}

/// The journal file.
pub struct Journal {
    disk: Arc<dyn Disk>,
    commit: GroupCommit,
    area_len: u64,
    uuid: u128,
    /// The header last written (its generation picks the next copy).
    header: std::sync::Mutex<JournalHeader>,
}

fn io_err(what: &str, e: std::io::Error) -> LsvdError {
    LsvdError::Cache(format!("{what}: {e}"))
}

impl Journal {
    pub fn area_len(&self) -> u64 {
        self.area_len
    }

    /// Opens the journal at `path` for volume `uuid` whose object log has
    /// folded journal records up to `folded`, creating a file of `len`
    /// bytes if there is none, and replays it (the case table in design
    /// 0008). Returns the journal, its ring (records newer than `folded`
    /// still in it) and what replay found.
    pub async fn open(
        env: &Env,
        path: &Path,
        len: u64,
        uuid: u128,
        folded: u64,
    ) -> Result<(Journal, Ring, Replay), LsvdError> {
        let (dir, name) = match (path.parent(), path.file_name().and_then(|n| n.to_str())) {
            (Some(d), Some(n)) => (d, n),
            _ => return Err(LsvdError::Invalid(format!("{} is not a file path", path.display()))),
        };
        let exists = env
            .list_disks(dir, name)
            .await
            .map_err(|e| io_err("looking for the cache file", e))?
            .iter()
            .any(|p| p.file_name() == path.file_name());
        if !exists && len < JOURNAL_LEN_MIN {
            return Err(LsvdError::Invalid(format!("a cache of {len} bytes; at least {JOURNAL_LEN_MIN}")));
        }
        let disk = env.open_disk(path, Some(len)).await.map_err(|e| io_err("opening the cache file", e))?;
        if disk.len() < JOURNAL_LEN_MIN {
            return Err(LsvdError::Cache(format!(
                "{} is {} bytes: not a cache file",
                path.display(),
                disk.len()
            )));
        }
        let raw = disk
            .read_at(0, 2 * JOURNAL_HEADER_SLOT as usize)
            .await
            .map_err(|e| io_err("reading the cache header", e))?;
        // Both header slots never written: a new file, or one whose creation
        // the process did not finish (created, headers not yet durable). No
        // record is written before a header is durable, so it holds nothing.
        if raw.iter().all(|&b| b == 0) {
            let area_len = (disk.len() - JOURNAL_AREA_START) / SECTOR * SECTOR;
            let h =
                JournalHeader { generation: 0, uuid, area_len, tail_pos: 0, tail_seq: folded + 1, epoch: 1 };
            let j = Journal::with(disk, area_len, uuid, h);
            // Both copies, so a torn later write always leaves one valid.
            j.write_header_copy(h, 1).await?;
            j.write_header_copy(h, 0).await?;
            j.sync().await?;
            let ring = Ring::new(area_len, 0, folded + 1);
            return Ok((j, ring, Replay { records: Vec::new(), skipped: 0, created: !exists }));
        }
        let copies = [
            JournalHeader::decode(&raw[..JOURNAL_HEADER_SLOT as usize]),
            JournalHeader::decode(&raw[JOURNAL_HEADER_SLOT as usize..]),
        ];
        let Some(h) = copies.iter().filter_map(|c| c.as_ref().ok()).max_by_key(|h| h.generation).copied()
        else {
            let why: Vec<String> =
                copies.iter().filter_map(|c| c.as_ref().err().map(|e| e.to_string())).collect();
            return Err(LsvdError::Cache(format!(
                "{}: neither header copy is valid ({}); delete the cache directory to bring the volume back from the object store",
                path.display(),
                why.join("; ")
            )));
        };
        if h.uuid != uuid {
            return Err(LsvdError::Cache(format!(
                "{} belongs to another volume ({:032x}); give this volume its own cache directory",
                path.display(),
                h.uuid
            )));
        }
        if h.area_len + JOURNAL_AREA_START > disk.len() {
            return Err(LsvdError::Cache(format!("{}: header describes a larger file", path.display())));
        }
        if h.tail_seq > folded + 1 {
            return Err(LsvdError::Cache(format!(
                "{}: the cache starts at record {} but the object store holds records only up to {folded}: records in between are in neither (was the object store rolled back, or this cache copied from elsewhere?)",
                path.display(),
                h.tail_seq
            )));
        }
        tracing::debug!(
            generation = h.generation,
            tail_pos = h.tail_pos,
            tail_seq = h.tail_seq,
            epoch = h.epoch,
            folded,
            "journal header"
        );
        let j = Journal::with(disk, h.area_len, uuid, h);
        let mut ring = Ring::new(h.area_len, h.tail_pos, h.tail_seq);
        j.walk(&mut ring, h.epoch).await?;
        let skipped = ring.records().filter(|r| r.seq <= folded).count() as u64;
        // Records the objects hold are not needed: the new tail starts
        // after them (written below, before any append).
        ring.release_through(folded);
        if ring.next_seq() <= folded {
            // The journal ends before the log. Invariant 1 (objects hold
            // only synced records, and synced records survive any crash)
            // makes this impossible for this volume's own cache: it is an
            // older copy, or the invariant was broken. Refused, not papered
            // over; everything the cache held is in the objects, so the
            // operator loses nothing by deleting it.
            return Err(LsvdError::Cache(format!(
                "{}: the cache ends at record {} but the object store already holds records up to {folded}: it is older than the volume (a restored or copied cache?); delete the cache directory to bring the volume back from the object store, which holds everything this cache did",
                path.display(),
                ring.next_seq().saturating_sub(1)
            )));
        }
        let records: Vec<RecMeta> = ring.records().copied().collect();
        let (tail_pos, tail_seq) = ring.tail();
        let next =
            JournalHeader { generation: h.generation + 1, tail_pos, tail_seq, epoch: h.epoch + 1, ..h };
        // The new epoch is durable before any record carries it, so every
        // record of this run outranks what the crashed run left in the area.
        j.write_header(next).await?;
        Ok((j, ring, Replay { records, skipped, created: false }))
    }

    fn with(disk: Arc<dyn Disk>, area_len: u64, uuid: u128, h: JournalHeader) -> Journal {
        Journal {
            commit: GroupCommit::new(disk.clone()),
            disk,
            area_len,
            uuid,
            header: std::sync::Mutex::new(h),
        }
    }

    /// Walks the records from the ring's tail: each must decode, carry the
    /// next seq and an epoch neither below the previous one's nor above
    /// the header's, and pass its CRC; the first that does not ends the
    /// journal. Bounded by the area's length.
    async fn walk(&self, ring: &mut Ring, epoch_max: u64) -> Result<(), LsvdError> {
        let mut prev_epoch = 0;
        let mut walked = 0u64;
        loop {
            let pos = ring.head();
            let raw = self
                .disk
                .read_at(JOURNAL_AREA_START + pos, RECORD_HEADER_LEN as usize)
                .await
                .map_err(|e| io_err("reading the cache", e))?;
            let h = match RecordHeader::decode(&raw, self.area_len) {
                Ok(h) => h,
                Err(e) => {
                    tracing::debug!(pos, seq = ring.next_seq(), error = %e, "journal ends");
                    break;
                }
            };
            if h.seq != ring.next_seq() || h.epoch < prev_epoch || h.epoch > epoch_max {
                tracing::debug!(
                    pos,
                    seq = ring.next_seq(),
                    found = h.seq,
                    epoch = h.epoch,
                    prev_epoch,
                    epoch_max,
                    "journal ends"
                );
                break;
            }
            let total = match h.kind {
                RecordKind::Wrap => self.area_len - pos,
                _ => h.total_len(),
            };
            // A trim's length is the range it zeroes, not bytes in the area.
            let too_long = h.kind == RecordKind::Write && h.len > ring.record_data_max();
            if total > self.area_len - pos || walked + total > self.area_len || too_long {
                tracing::debug!(pos, seq = h.seq, total, "journal ends: record does not fit");
                break;
            }
            let data = if h.kind == RecordKind::Write {
                self.disk
                    .read_at(JOURNAL_AREA_START + pos + RECORD_HEADER_LEN, h.len as usize)
                    .await
                    .map_err(|e| io_err("reading the cache", e))?
            } else {
                Bytes::new()
            };
            if h.check_data(&data).is_err() {
                tracing::debug!(pos, seq = h.seq, "journal ends: record fails its CRC");
                break;
            }
            ring.replayed(RecMeta {
                seq: h.seq,
                pos,
                total,
                kind: h.kind,
                vol_offset: h.vol_offset,
                len: h.len,
            });
            prev_epoch = h.epoch;
            walked += total;
        }
        Ok(())
    }

    /// The epoch this run's records carry.
    pub fn epoch(&self) -> u64 {
        self.header.lock().unwrap_or_else(|p| p.into_inner()).epoch
    }

    async fn write_header_copy(&self, h: JournalHeader, copy: u64) -> Result<(), LsvdError> {
        self.disk
            .write_at(vec![(copy * JOURNAL_HEADER_SLOT, h.encode())])
            .await
            .map_err(|e| io_err("writing the cache header", e))
    }

    /// Writes a new header (the copy its generation picks) and syncs it:
    /// the tail it names is durable when this returns.
    pub async fn write_header(&self, h: JournalHeader) -> Result<(), LsvdError> {
        tracing::debug!(
            generation = h.generation,
            tail_seq = h.tail_seq,
            epoch = h.epoch,
            "journal header write"
        );
        self.write_header_copy(h, h.generation % 2).await?;
        self.sync().await?;
        *self.header.lock().unwrap_or_else(|p| p.into_inner()) = h;
        Ok(())
    }

    /// Moves the header's tail to `(pos, seq)`, durably.
    pub async fn set_tail(&self, pos: u64, seq: u64) -> Result<(), LsvdError> {
        let h = *self.header.lock().unwrap_or_else(|p| p.into_inner());
        debug_assert_eq!(h.uuid, self.uuid);
        if (h.tail_pos, h.tail_seq) == (pos, seq) {
            return Ok(());
        }
        self.write_header(JournalHeader { generation: h.generation + 1, tail_pos: pos, tail_seq: seq, ..h })
            .await
    }

    /// Writes the records `recs` reserved (the last one carrying `data`).
    pub async fn append(&self, recs: &[RecMeta], data: Option<Bytes>) -> Result<(), LsvdError> {
        let epoch = self.epoch();
        let mut writes = Vec::with_capacity(recs.len() + 1);
        for r in recs {
            let payload: &[u8] = match (&data, r.kind) {
                (Some(d), RecordKind::Write) => d,
                _ => &[],
            };
            debug_assert!(r.kind != RecordKind::Write || payload.len() as u64 == r.len);
            let h = RecordHeader::encode(r.kind, r.seq, epoch, r.vol_offset, r.len, payload);
            writes.push((JOURNAL_AREA_START + r.pos, h));
            if r.kind == RecordKind::Write {
                if let Some(d) = &data {
                    writes.push((JOURNAL_AREA_START + r.pos + RECORD_HEADER_LEN, d.clone()));
                }
            }
        }
        self.disk.write_at(writes).await.map_err(|e| io_err("writing the cache", e))
    }

    /// `len` bytes of record data from `at` bytes into the record at `pos`.
    pub async fn read(&self, pos: u64, at: u64, len: u64) -> Result<Bytes, LsvdError> {
        self.disk
            .read_at(JOURNAL_AREA_START + pos + RECORD_HEADER_LEN + at, len as usize)
            .await
            .map_err(|e| io_err("reading the cache", e))
    }

    /// Makes every completed append durable (one `fdatasync` for many).
    pub async fn sync(&self) -> Result<(), LsvdError> {
        self.commit.sync().await.map_err(|e| io_err("syncing the cache", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Records fill the ring, a record that would cross the end is preceded
    // by a wrap record, released space is reused, and a full ring refuses.
    #[test]
    fn ring_wraps_and_refuses_when_full() {
        let mut r = Ring::new(8192, 0, 10);
        assert_eq!(r.record_data_max(), 2048 - 512);
        let a = r.reserve(RecordKind::Write, 0, 1024).expect("room");
        assert_eq!(
            a,
            vec![RecMeta { seq: 10, pos: 0, total: 1536, kind: RecordKind::Write, vol_offset: 0, len: 1024 }]
        );
        for _ in 0..4 {
            r.reserve(RecordKind::Write, 0, 1024).expect("room");
        }
        assert_eq!((r.head(), r.used()), (7680, 7680));
        assert!(r.reserve(RecordKind::Write, 0, 1024).is_none(), "full");
        assert_eq!(r.release_through(11).len(), 2);
        // 512 bytes left at the end: a wrap record, then the record at 0.
        let b = r.reserve(RecordKind::Write, 512, 1024).expect("room after release");
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].kind, b[0].pos, b[0].total), (RecordKind::Wrap, 7680, 512));
        assert_eq!((b[1].seq, b[1].pos), (16, 0));
        assert_eq!(r.tail(), (3072, 12));
        let t = r.reserve(RecordKind::Trim, 0, 1 << 30).expect("a trim is a header");
        assert_eq!(t[0].total, 512);
    }
}
