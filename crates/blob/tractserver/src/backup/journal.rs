//! The backup journal at run time: appends made durable by a group commit,
//! reads of records not yet replayed, and the head that gives space back
//! once the data disk holds them. Its format, and what the scan at open
//! makes of each state of the ring, are in `format.rs`.
//!
//! Invariants, each kept where it says:
//! - A record's `seq` and ring position are taken together, under one lock
//!   ([`BackupJournal::reserve`]): both only grow, so `seq` order is write
//!   order and the scan can check one against the other.
//! - An append returns only after a group commit that started after its
//!   bytes were written ([`GroupCommit`]'s invariant): what the caller
//!   acknowledges is durable here.
//! - Ring space is reused only behind the durable head. The head moves
//!   ([`BackupJournal::release`]) only past records the caller has made
//!   durable on the data disk, is synced before the space behind it is
//!   given back, and a reservation never reaches past
//!   `head + ring length`: a live record is never overwritten.
//! - A record is never written across the ring's end (`format::place`).
//!
//! The ring does not wait for room: a full journal says so
//! ([`JournalError::Full`]) and the caller writes to the data disk
//! directly, which is what Ursa does with writes too large to journal.

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use blizzard_core::crc::piece_count;
use blizzard_env::{Disk, GroupCommit};
use bytes::Bytes;
use tokio::sync::Notify;

use super::format::{
    decode_record, encode_record, place, record_len_max, Found, Head, Kind, Record, RecordHeader, Target,
    HEAD_LEN, RECORD_ALIGN, RECORD_DATA_MAX, RING_MIN, RING_START, SCAN_WINDOW, SUPERSEDE_RECORD_LEN,
};

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("backup journal: {0}")]
    Io(#[from] io::Error),
    #[error("the backup journal is full; write to the data disk directly")]
    Full,
    #[error("the backup journal could not be synced and can no longer be trusted; restart the tractserver")]
    Failed,
    #[error(
        "the backup journal holds no valid head; format it (a new journal) or give the right --journal path"
    )]
    NotFormatted,
    #[error("the backup journal belongs to disk {found:032x}, not to this one ({expected:032x}); give the journal made for this disk")]
    WrongDisk { expected: u128, found: u128 },
    #[error("the backup journal's records are out of order at position {0}: it was not written by this code; do not use it")]
    Disordered(u64),
    #[error("the backup journal device has {0} bytes; it needs at least {min}", min = RING_MIN + RING_START)]
    TooSmall(u64),
    #[error("a write of {0} bytes is larger than a journal record holds ({max}); write it directly", max = RECORD_DATA_MAX)]
    TooLarge(usize),
    #[error("a journal write must lie inside its tract and carry one CRC per piece")]
    BadWrite,
    #[error("record {0} is not in the journal (replayed already, or never written)")]
    NoRecord(u64),
}

/// Ring bytes data records leave free, so supersede records (one per
/// change made to the data disk directly) always find room: 128 of them.
pub const MARKER_RESERVE: u64 = 128 * SUPERSEDE_RECORD_LEN;

/// A record with its place taken and its bytes not yet written. Dropped
/// without [`Pending::commit`], it is forgotten: the scan at open finds a
/// hole where it would have been.
pub struct Pending<'a> {
    journal: &'a BackupJournal,
    pub seq: u64,
    at: u64,
    bytes: Option<Vec<u8>>,
}

impl Pending<'_> {
    /// Writes the record and returns once it is durable.
    pub async fn commit(mut self) -> Result<u64, JournalError> {
        let bytes = self.bytes.take().unwrap_or_default();
        self.journal.write_and_sync(self.seq, self.at, bytes).await
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.bytes.is_some() {
            self.journal.forget(self.seq);
        }
    }
}

/// What the scan at open found, in `seq` order.
#[derive(Debug, Default)]
pub struct Scan {
    /// Records not yet released: the caller replays them (and indexes them
    /// until it has).
    pub records: Vec<Record>,
    /// Records whose header was written but whose data does not match its
    /// CRCs: torn by a crash before their sync returned (so never
    /// acknowledged), or rotted since (so the tract needs repair from
    /// another replica).
    pub damaged: Vec<(u64, Target)>,
}

/// Where a live record lies.
#[derive(Clone, Copy, Debug)]
struct Live {
    position: u64,
    /// Bytes from the record's start to its data.
    data_offset: u64,
    data_len: u32,
}

struct Ring {
    /// The durable head: nothing before `head.position` is live.
    head: Head,
    /// Which head slot the next head goes to.
    next_slot: u64,
    next_seq: u64,
    next_position: u64,
    /// Records reserved and not yet released, by `seq`.
    live: BTreeMap<u64, Live>,
    /// Records reserved whose bytes are not written yet: the head never
    /// passes one (its space could be handed out again under it).
    unwritten: std::collections::BTreeSet<u64>,
}

/// A backup journal on a disk of its own (module docs).
pub struct BackupJournal {
    disk: Arc<dyn Disk>,
    commit: GroupCommit,
    ring: Mutex<Ring>,
    /// One head write at a time.
    releasing: tokio::sync::Mutex<()>,
    room: Notify,
    /// Woken when the ring is a quarter full or more (the destager).
    filling: Notify,
    tract_size: u32,
    /// A planted bug (tests and the simulator): appends skip their sync.
    ack_before_sync: std::sync::atomic::AtomicBool,
}

impl BackupJournal {
    /// Makes `disk` an empty journal for the data disk `disk_id`. Records
    /// left on it from before never count: they name another journal id.
    pub async fn format(
        disk: Arc<dyn Disk>,
        disk_id: u128,
        journal_id: u128,
        tract_size: u32,
    ) -> Result<BackupJournal, JournalError> {
        let ring_len = (disk.len().saturating_sub(RING_START) / RECORD_ALIGN) * RECORD_ALIGN;
        if ring_len < RING_MIN {
            return Err(JournalError::TooSmall(disk.len()));
        }
        let head = Head { journal_id, disk_id, ring_len, seq: 0, position: 0 };
        // Both slots: a head of an earlier journal in the other slot must
        // not win against this one.
        disk.write_at(vec![(0, Bytes::from(head.encode())), (HEAD_LEN, Bytes::from(head.encode()))]).await?;
        disk.sync().await?;
        Ok(BackupJournal::new(disk, head, 0, tract_size))
    }

    /// Opens the journal on `disk`, which must belong to the data disk
    /// `disk_id`, and scans it for the records not yet released.
    pub async fn open(
        disk: Arc<dyn Disk>,
        disk_id: u128,
        tract_size: u32,
    ) -> Result<(BackupJournal, Scan), JournalError> {
        if disk.len() < RING_START + RING_MIN {
            return Err(JournalError::TooSmall(disk.len()));
        }
        let heads = disk.read_at(0, RING_START as usize).await?;
        let a = Head::decode(&heads[..HEAD_LEN as usize]);
        let b = Head::decode(&heads[HEAD_LEN as usize..]);
        let head = Head::newest(a, b).ok_or(JournalError::NotFormatted)?;
        if head.disk_id != disk_id {
            return Err(JournalError::WrongDisk { expected: disk_id, found: head.disk_id });
        }
        if RING_START + head.ring_len > disk.len() {
            return Err(JournalError::TooSmall(disk.len()));
        }
        // The slot not holding the newest head is written next.
        let next_slot = if b == Some(head) { 0 } else { 1 };
        let (scan, end) = scan(&*disk, &head, tract_size).await?;
        let j = BackupJournal::new(disk, head, next_slot, tract_size);
        {
            let mut r = j.lock();
            let mut last_end = head.position;
            for rec in &scan.records {
                r.live.insert(
                    rec.seq,
                    Live {
                        position: rec.position,
                        data_offset: rec.data_offset(),
                        data_len: rec.data.len() as u32,
                    },
                );
                last_end = last_end.max(rec.position + rec.ring_len);
                r.next_seq = r.next_seq.max(rec.seq + 1);
            }
            // Damaged records keep their places: the next record goes
            // after them, with a higher seq.
            for &(seq, _) in &scan.damaged {
                r.next_seq = r.next_seq.max(seq + 1);
            }
            r.next_position = last_end.max(end);
        }
        Ok((j, scan))
    }

    fn new(disk: Arc<dyn Disk>, head: Head, next_slot: u64, tract_size: u32) -> BackupJournal {
        BackupJournal {
            commit: GroupCommit::new(disk.clone()),
            disk,
            ring: Mutex::new(Ring {
                head,
                next_slot,
                next_seq: head.seq,
                next_position: head.position,
                live: BTreeMap::new(),
                unwritten: std::collections::BTreeSet::new(),
            }),
            releasing: tokio::sync::Mutex::new(()),
            room: Notify::new(),
            filling: Notify::new(),
            tract_size,
            ack_before_sync: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the next `seq` and ring space for a record of `len` bytes
    /// (module docs: both together, never past the durable head's lap).
    /// Data records leave [`MARKER_RESERVE`] bytes free for supersede
    /// records, so a change that must be marked finds room.
    fn reserve(
        &self,
        len: u64,
        kind: Kind,
        live: impl FnOnce(u64) -> Live,
    ) -> Result<(u64, u64), JournalError> {
        let mut r = self.lock();
        let at = place(r.next_position, len, r.head.ring_len);
        let keep = if kind == Kind::Data { MARKER_RESERVE } else { 0 };
        if at + len + keep > r.head.position + r.head.ring_len {
            return Err(JournalError::Full);
        }
        // Invariants (module docs): positions only grow, a record never
        // crosses the ring's end, and never reaches past the durable head's
        // lap (checked above).
        debug_assert!(at >= r.next_position && at % r.head.ring_len + len <= r.head.ring_len);
        let seq = r.next_seq;
        r.next_seq += 1;
        r.next_position = at + len;
        r.live.insert(seq, live(at));
        r.unwritten.insert(seq);
        if r.next_position - r.head.position >= r.head.ring_len / 4 {
            self.filling.notify_one();
        }
        Ok((seq, at))
    }

    /// Reserves a data record for `data` at `target` (its writer's piece
    /// CRCs `crcs`, already checked). Its place in `seq` order is taken
    /// now; [`Pending::commit`] writes it and makes it durable.
    pub fn reserve_data(
        &self,
        target: &Target,
        crcs: &[u32],
        data: &[u8],
    ) -> Result<Pending<'_>, JournalError> {
        if data.len() > RECORD_DATA_MAX as usize || data.is_empty() {
            return Err(JournalError::TooLarge(data.len()));
        }
        if crcs.len() != piece_count(target.offset, data.len() as u32)
            || target.offset as u64 + data.len() as u64 > self.tract_size as u64
        {
            return Err(JournalError::BadWrite);
        }
        let len = super::format::data_record_len(target.offset, data.len() as u32);
        let data_offset = super::format::RECORD_HEADER_LEN + 4 * crcs.len() as u64;
        let (seq, at) = self.reserve(len, Kind::Data, |position| Live {
            position,
            data_offset,
            data_len: data.len() as u32,
        })?;
        let id = self.lock().head.journal_id;
        let h = RecordHeader { kind: Kind::Data, seq, position: at, target, len: data.len() as u32 };
        let bytes = encode_record(&h, id, crcs, data);
        debug_assert_eq!(bytes.len() as u64, len);
        Ok(Pending { journal: self, seq, at, bytes: Some(bytes) })
    }

    /// Reserves a supersede record: `target.offset..+len` is being changed
    /// on the data disk directly, so older records' bytes there are dead.
    pub fn reserve_supersede(&self, target: &Target, len: u32) -> Result<Pending<'_>, JournalError> {
        let (seq, at) = self.reserve(SUPERSEDE_RECORD_LEN, Kind::Supersede, |position| Live {
            position,
            data_offset: 0,
            data_len: 0,
        })?;
        let id = self.lock().head.journal_id;
        let h = RecordHeader { kind: Kind::Supersede, seq, position: at, target, len };
        let bytes = encode_record(&h, id, &[], &[]);
        Ok(Pending { journal: self, seq, at, bytes: Some(bytes) })
    }

    async fn write_and_sync(&self, seq: u64, at: u64, bytes: Vec<u8>) -> Result<u64, JournalError> {
        if self.commit.failed() {
            self.forget(seq);
            return Err(JournalError::Failed);
        }
        let offset = RING_START + at % self.lock().head.ring_len;
        let written = self.disk.write_at(vec![(offset, Bytes::from(bytes))]).await;
        self.lock().unwritten.remove(&seq);
        let synced = match written {
            Ok(()) if self.ack_before_sync.load(std::sync::atomic::Ordering::Relaxed) => Ok(()),
            Ok(()) => self.commit.sync().await,
            Err(e) => Err(e),
        };
        match synced {
            Ok(()) => Ok(seq),
            Err(e) => {
                // Not acknowledged, and not to be read: its bytes may be
                // anything. The scan at open finds it torn or whole; either
                // is allowed for a write never acknowledged.
                self.forget(seq);
                if self.commit.failed() {
                    Err(JournalError::Failed)
                } else {
                    Err(e.into())
                }
            }
        }
    }

    fn forget(&self, seq: u64) {
        let mut r = self.lock();
        r.live.remove(&seq);
        r.unwritten.remove(&seq);
    }

    /// Appends `data` for `target` (its writer's piece CRCs `crcs`,
    /// already checked) and returns its `seq` once it is durable.
    pub async fn append(&self, target: &Target, crcs: &[u32], data: &[u8]) -> Result<u64, JournalError> {
        self.reserve_data(target, crcs, data)?.commit().await
    }

    /// Appends a supersede record and returns its `seq` once durable.
    pub async fn supersede(&self, target: &Target, len: u32) -> Result<u64, JournalError> {
        self.reserve_supersede(target, len)?.commit().await
    }

    /// `len` bytes of record `seq`'s data, from byte `from` of it.
    pub async fn read(&self, seq: u64, from: u32, len: u32) -> Result<Bytes, JournalError> {
        let (live, ring_len) = {
            let r = self.lock();
            (r.live.get(&seq).copied(), r.head.ring_len)
        };
        let live = live.ok_or(JournalError::NoRecord(seq))?;
        if from as u64 + len as u64 > live.data_len as u64 {
            return Err(JournalError::NoRecord(seq));
        }
        let at = RING_START + live.position % ring_len + live.data_offset + from as u64;
        Ok(self.disk.read_at(at, len as usize).await?)
    }

    /// Every record below `upto` is durable on the data disk: move the head
    /// past them, durably, and give their space back.
    pub async fn release(&self, upto: u64) -> Result<(), JournalError> {
        let _one = self.releasing.lock().await;
        let (head, slot) = {
            let r = self.lock();
            if upto <= r.head.seq {
                return Ok(());
            }
            // Never past a record whose bytes are still on their way: its
            // space must not be handed out again under it.
            let upto = upto.min(r.next_seq).min(r.unwritten.first().copied().unwrap_or(u64::MAX));
            if upto <= r.head.seq {
                return Ok(());
            }
            // The first record still live at or after `upto` is where the
            // head goes; with none, the next free position.
            let position = r.live.range(upto..).next().map_or(r.next_position, |(_, l)| l.position);
            // The head only moves forward, and never past what is reserved.
            debug_assert!(position >= r.head.position && position <= r.next_position);
            (Head { seq: upto, position, ..r.head }, r.next_slot)
        };
        self.disk.write_at(vec![(slot * HEAD_LEN, Bytes::from(head.encode()))]).await?;
        if let Err(e) = self.commit.sync().await {
            return Err(if self.commit.failed() { JournalError::Failed } else { e.into() });
        }
        {
            let mut r = self.lock();
            r.head = head;
            r.next_slot = 1 - slot;
            r.live = r.live.split_off(&head.seq);
        }
        self.room.notify_waiters();
        Ok(())
    }

    /// Waits until a release gives space back (a caller that found the
    /// journal full and would rather wait than write directly).
    pub async fn room_given_back(&self) {
        self.room.notified().await
    }

    /// Plants a bug for the checkers to catch: appends return before
    /// their record is durable.
    #[doc(hidden)]
    pub fn plant_ack_before_sync(&self) {
        self.ack_before_sync.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Returns once the ring is a quarter full (or was, since the last
    /// call): time to destage.
    pub async fn filling(&self) {
        self.filling.notified().await
    }

    /// Ring bytes between the durable head and the next free position.
    pub fn used(&self) -> u64 {
        let r = self.lock();
        r.next_position - r.head.position
    }

    /// Bytes of its device still being prepared in the background (a new
    /// file being zero-filled: `Disk::preparing_left`).
    pub fn preparing_left(&self) -> u64 {
        self.disk.preparing_left()
    }

    pub fn ring_len(&self) -> u64 {
        self.lock().head.ring_len
    }

    /// Records reserved and not yet released.
    pub fn live_records(&self) -> usize {
        self.lock().live.len()
    }

    /// The `seq` the next record will get: every record below it is
    /// reserved already.
    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// The first `seq` not yet released.
    pub fn head_seq(&self) -> u64 {
        self.lock().head.seq
    }

    /// `fdatasync`s made (for tests and metrics).
    pub fn syncs(&self) -> u64 {
        self.commit.syncs()
    }

    pub fn tract_size(&self) -> u32 {
        self.tract_size
    }
}

/// Scans one lap of the ring from the head (`format.rs`'s case table).
/// Returns what it found and the position after the last thing written
/// in this lap (where the next record may go).
async fn scan(disk: &dyn Disk, head: &Head, tract_size: u32) -> Result<(Scan, u64), JournalError> {
    let ring = head.ring_len;
    let lap_end = head.position + ring;
    let mut found = Scan::default();
    let mut end = head.position;
    let mut p = head.position;
    while p < lap_end {
        let off = p % ring;
        let avail = (ring - off).min(SCAN_WINDOW + record_len_max());
        let buf = disk.read_at(RING_START + off, avail as usize).await?;
        // Positions decided from this read: a window's worth, or all of it
        // at the ring's end (records never cross it).
        let limit = if off + avail == ring { avail } else { SCAN_WINDOW };
        let mut i = 0u64;
        while i < limit && p + i < lap_end {
            match decode_record(&buf[i as usize..], head.journal_id, p + i, tract_size) {
                Found::Record(r) => {
                    i += r.ring_len;
                    end = p + i;
                    found.records.push(r);
                }
                Found::Damaged { seq, target, ring_len } => {
                    i += ring_len;
                    end = p + i;
                    found.damaged.push((seq, target));
                }
                Found::Hole => i += RECORD_ALIGN,
            }
        }
        p += i;
        if off + avail == ring {
            // On to the next lap's start.
            p = p.div_ceil(ring) * ring;
        }
    }
    // Positions only grow with seq: anything else is not our ring.
    let mut last: Option<u64> = None;
    for r in &found.records {
        if r.seq < head.seq || last.is_some_and(|l| r.seq <= l) {
            return Err(JournalError::Disordered(r.position));
        }
        last = Some(r.seq);
    }
    Ok((found, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::crc::piece_crcs;
    use blizzard_core::{BlobId, TractNo};
    use blizzard_env::Env;

    const TRACT: u32 = 8 << 20;
    const DISK: u128 = 0xd15c;

    fn target(tract: i64, offset: u32) -> Target {
        Target { blob: BlobId(1), incarnation: 2, tract: TractNo(tract), version: 3, offset }
    }

    fn bytes(seed: u8, len: usize) -> Vec<u8> {
        (0..len).map(|i| seed.wrapping_add((i / 512) as u8)).collect()
    }

    async fn disk(dir: &tempfile::TempDir, len: u64) -> Arc<dyn Disk> {
        Env::real().open_disk(&dir.path().join("journal"), Some(len)).await.expect("journal disk")
    }

    async fn append(j: &BackupJournal, tract: i64, offset: u32, data: &[u8]) -> u64 {
        j.append(&target(tract, offset), &piece_crcs(offset, data), data).await.expect("append")
    }

    /// What was appended comes back at open, in order, and reads back
    /// while live.
    #[tokio::test]
    async fn appended_records_come_back_at_open() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let d = disk(&dir, 4 << 20).await;
        let j = BackupJournal::format(d.clone(), DISK, 77, TRACT).await?;
        let a = append(&j, 0, 0, &bytes(1, 4096)).await;
        let b = append(&j, 1, 1000, &bytes(2, 10_000)).await;
        let s = j.supersede(&target(0, 0), 2048).await?;
        assert_eq!((a, b, s), (0, 1, 2));
        assert_eq!(&j.read(b, 100, 50).await?[..], &bytes(2, 10_000)[100..150]);
        drop(j);
        let (j, scan) = BackupJournal::open(d, DISK, TRACT).await?;
        let seqs: Vec<u64> = scan.records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![0, 1, 2]);
        assert_eq!(&scan.records[1].data[..], &bytes(2, 10_000)[..]);
        assert_eq!(scan.records[1].target, target(1, 1000));
        assert_eq!((scan.records[2].kind, scan.records[2].len), (Kind::Supersede, 2048));
        assert!(scan.damaged.is_empty());
        // Appends go on after them, and reads of reopened records work.
        assert_eq!(append(&j, 0, 0, &bytes(3, 512)).await, 3);
        assert_eq!(&j.read(1, 0, 10).await?[..], &bytes(2, 10)[..]);
        Ok(())
    }

    /// Released records are gone at open; the head survives a reopen and
    /// a torn head slot.
    #[tokio::test]
    async fn released_records_stay_released() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let d = disk(&dir, 4 << 20).await;
        let j = BackupJournal::format(d.clone(), DISK, 77, TRACT).await?;
        for i in 0..5u8 {
            append(&j, 0, 0, &bytes(i, 4096)).await;
        }
        j.release(3).await?;
        assert_eq!((j.head_seq(), j.live_records()), (3, 2));
        assert!(matches!(j.read(1, 0, 1).await, Err(JournalError::NoRecord(1))));
        drop(j);
        let (j, scan) = BackupJournal::open(d.clone(), DISK, TRACT).await?;
        assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![3, 4]);
        // The newest head is in slot B (written second); tear it: slot A's
        // older head counts, and replaying from it again is harmless.
        j.release(5).await?;
        drop(j);
        let mut torn = d.read_at(0, HEAD_LEN as usize).await?.to_vec();
        let newest_slot = if Head::decode(&torn).is_some_and(|h| h.seq == 5) { 0 } else { HEAD_LEN };
        torn = d.read_at(newest_slot, HEAD_LEN as usize).await?.to_vec();
        torn[20] ^= 0xff;
        d.write_at(vec![(newest_slot, Bytes::from(torn))]).await?;
        let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
        assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![3, 4]);
        Ok(())
    }

    /// A full ring says so instead of overwriting live records; releasing
    /// gives room back, and the ring wraps (many laps) without losing a
    /// record.
    #[tokio::test]
    async fn the_ring_fills_wraps_and_never_overwrites_live_records() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let d = disk(&dir, RING_START + RING_MIN).await;
        let j = BackupJournal::format(d.clone(), DISK, 9, TRACT).await?;
        let mut appended = Vec::new();
        loop {
            match j.append(&target(0, 0), &piece_crcs(0, &bytes(7, 65536)), &bytes(7, 65536)).await {
                Ok(seq) => appended.push(seq),
                Err(JournalError::Full) => break,
                Err(e) => return Err(e),
            }
        }
        // 64 KiB + a header takes 66,048 bytes: 14 fit in 1 MiB less the
        // room kept for supersede records.
        assert_eq!(appended.len(), 14);
        assert!(j.used() <= j.ring_len());
        // Many laps, releasing all but the newest few each time.
        let mut next = appended.len() as u64;
        for lap in 0..40u64 {
            j.release(next - 3).await?;
            for k in 0..5u8 {
                let data = bytes(lap as u8 ^ k, 4096 * (1 + k as usize));
                let seq = j
                    .append(&target(lap as i64, 4096 * k as u32), &piece_crcs(4096 * k as u32, &data), &data)
                    .await?;
                assert_eq!(seq, next);
                next += 1;
            }
        }
        let live: Vec<u64> = (next - 8..next).collect();
        drop(j);
        let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
        assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), live);
        let last = &scan.records[7];
        assert_eq!(&last.data[..], &bytes(39 ^ 4, 4096 * 5)[..]);
        Ok(())
    }

    /// A record never written (a hole: its writer crashed before writing)
    /// is skipped and the records after it are found; a torn record is
    /// reported as damaged, never replayed.
    #[tokio::test]
    async fn holes_are_skipped_and_torn_records_reported() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let d = disk(&dir, 4 << 20).await;
        let j = BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
        append(&j, 0, 0, &bytes(1, 4096)).await;
        append(&j, 0, 0, &bytes(2, 4096)).await;
        append(&j, 0, 0, &bytes(3, 8192)).await;
        append(&j, 0, 0, &bytes(4, 4096)).await;
        drop(j);
        let rec = super::super::format::data_record_len(0, 4096);
        // Record 1 never written: zeros over it.
        d.write_at(vec![(RING_START + rec, Bytes::from(vec![0u8; rec as usize]))]).await?;
        // Record 2 torn: its last data sector lost.
        let rec2 = super::super::format::data_record_len(0, 8192);
        let torn_at = RING_START + 2 * rec + rec2 - 512;
        d.write_at(vec![(torn_at, Bytes::from(vec![0u8; 512]))]).await?;
        let (j, scan) = BackupJournal::open(d, DISK, TRACT).await?;
        assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![0, 3]);
        assert_eq!(scan.damaged.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2]);
        // New records go after everything found, with higher seqs.
        assert_eq!(append(&j, 0, 0, &bytes(5, 512)).await, 4);
        Ok(())
    }

    #[tokio::test]
    async fn a_journal_opens_only_for_its_own_formatted_disk() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let d = disk(&dir, 4 << 20).await;
        assert!(matches!(BackupJournal::open(d.clone(), DISK, TRACT).await, Err(JournalError::NotFormatted)));
        BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
        match BackupJournal::open(d.clone(), DISK + 1, TRACT).await {
            Err(e @ JournalError::WrongDisk { .. }) => {
                assert!(e.to_string().contains("give the journal made for this disk"))
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        let small = Env::real().open_disk(&dir.path().join("small"), Some(64 << 10)).await?;
        assert!(matches!(BackupJournal::format(small, DISK, 5, TRACT).await, Err(JournalError::TooSmall(_))));
        // A reformat forgets the old records even where their bytes remain.
        let j = BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
        append(&j, 0, 0, &bytes(1, 4096)).await;
        drop(j);
        BackupJournal::format(d.clone(), DISK, 6, TRACT).await?;
        let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
        assert!(scan.records.is_empty());
        Ok(())
    }

    #[tokio::test]
    async fn bad_writes_are_refused() -> Result<(), JournalError> {
        let dir = tempfile::tempdir()?;
        let j = BackupJournal::format(disk(&dir, 4 << 20).await, DISK, 5, TRACT).await?;
        let big = vec![0u8; RECORD_DATA_MAX as usize + 1];
        assert!(matches!(
            j.append(&target(0, 0), &piece_crcs(0, &big), &big).await,
            Err(JournalError::TooLarge(_))
        ));
        assert!(matches!(j.append(&target(0, 0), &[1, 2], &[0u8; 4096]).await, Err(JournalError::BadWrite)));
        let past = target(0, TRACT - 100);
        assert!(matches!(
            j.append(&past, &piece_crcs(past.offset, &[0u8; 200]), &[0u8; 200]).await,
            Err(JournalError::BadWrite)
        ));
        Ok(())
    }
}
