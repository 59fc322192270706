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
//! - Zeros are laid only on free ring space: at or after every reservation
//!   made so far and before the durable head's lap ([`plan_zeros`]), and a
//!   record placed there later waits until they have landed
//!   (`write_and_sync`). The scan reads zeros as a hole, as it reads the
//!   free space they replace.
//!
//! Why zeros ahead of the records: a record is rarely a whole number of
//! pages (a 4 KiB write takes 4,608 bytes), so most appends begin or end
//! inside a page. A buffered write into part of a page the page cache does
//! not hold makes the kernel read that page from the device first,
//! synchronously, on the thread that writes, which here is a runtime
//! thread. Free space is cold unless the previous lap left its pages in
//! the page cache: all through a new journal's first lap (the zero-filler
//! writes new files around the page cache), for a lap after a restart, and
//! under memory pressure. Measured on new journals: 0.9 device reads per
//! append, and journaled 3-way writes at a third of the unjournaled rate.
//! So the appends lay whole pages of zeros a window ahead of themselves,
//! off the runtime threads, and then land on cached pages.
//!
//! The ring does not wait for room: a full journal says so
//! ([`JournalError::Full`]) and the caller tries the journal's second
//! area, if it has one, and then the data disk directly, which is what
//! Ursa does with writes too large to journal.
//!
//! ## Areas
//!
//! A journal may have a second area: another `BackupJournal` on another
//! file or device, which takes records while the first is full
//! (`store::backup`). The two are one journal:
//! - They draw `seq`s from one counter ([`BackupJournal::join`]), each
//!   under its own lock, so each area's records grow in `seq` along its
//!   ring (the scan's order check holds, with gaps), and merging the two
//!   scans by `seq` gives the order the store applied the changes in.
//! - The first area's head names the second ([`BackupJournal::name_second_area`])
//!   before the second takes a record, so the journal is never opened
//!   without the area that may hold some of its acknowledged writes.
//! - A destage releases both areas up to the same `seq`.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// A zero write claimed in the ring ([`BackupJournal::start_zeros`]).
/// Dropped, done or not, it gives the claim back and wakes the appends
/// waiting for it.
struct Zeroing<'a> {
    journal: &'a BackupJournal,
    from: u64,
    to: u64,
    /// Where `from` is on the journal's device.
    offset: u64,
}

impl Zeroing<'_> {
    /// The zeros landed: the appends may count on them.
    fn done(self) {
        let mut r = self.journal.lock();
        r.prepared = r.prepared.max(self.to);
    }
}

impl Drop for Zeroing<'_> {
    fn drop(&mut self) {
        self.journal.lock().zeroing = None;
        self.journal.zeroed.notify_waiters();
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
    /// Positions below this were laid with zeros this run, or are below
    /// where the run started appending ([`plan_zeros`]).
    prepared: u64,
    /// Positions a zero write is landing on right now: records placed
    /// there wait for it.
    zeroing: Option<(u64, u64)>,
}

/// Bytes of zeros laid ahead of the appends at a time.
const PREPARE_WINDOW: u64 = 1 << 20;

/// Zeros are laid in whole pages of this size.
const PAGE: u64 = 4096;

static ZEROS: [u8; PREPARE_WINDOW as usize] = [0; PREPARE_WINDOW as usize];

/// The free ring positions to lay with zeros next, if it is time: when the
/// appends (`next`: every position below is reserved, maybe not yet
/// written) have come within half a window of what is `prepared`. Never
/// below `next`, nor at or past the lap of the durable head at
/// `head_position` (the previous lap's records there may still be live);
/// whole pages of the journal's device (the ring starts on one), and never
/// across the ring's end.
fn plan_zeros(prepared: u64, next: u64, head_position: u64, ring: u64) -> Option<(u64, u64)> {
    if prepared >= next + PREPARE_WINDOW / 2 {
        return None;
    }
    let mut from = prepared.max(next);
    let mut lap_end = (from / ring + 1) * ring;
    from += (PAGE - (RING_START + from % ring) % PAGE) % PAGE;
    if from >= lap_end {
        from = lap_end;
        lap_end += ring;
    }
    let limit = (from + PREPARE_WINDOW).min(lap_end).min(head_position + ring);
    // Whole pages only, but for the ring's last piece.
    let to = if limit == lap_end { limit } else { limit - (RING_START + limit % ring) % PAGE };
    (to > from).then_some((from, to))
}

/// A backup journal on a disk of its own (module docs).
pub struct BackupJournal {
    disk: Arc<dyn Disk>,
    commit: GroupCommit,
    ring: Mutex<Ring>,
    /// The next `seq`, shared with the journal's other area if it has one
    /// (module docs, "Areas"). Drawn only under `ring`'s lock.
    seqs: Arc<AtomicU64>,
    /// One head write at a time.
    releasing: tokio::sync::Mutex<()>,
    room: Notify,
    /// Woken when a zero write ends ([`plan_zeros`]).
    zeroed: Notify,
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
        let head = Head { journal_id, disk_id, ring_len, seq: 0, position: 0, overflow_id: 0 };
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
            r.prepared = r.next_position;
            j.seqs.store(r.next_seq, Ordering::SeqCst);
        }
        Ok((j, scan))
    }

    fn new(disk: Arc<dyn Disk>, head: Head, next_slot: u64, tract_size: u32) -> BackupJournal {
        BackupJournal {
            commit: GroupCommit::new(disk.clone()),
            disk,
            seqs: Arc::new(AtomicU64::new(head.seq)),
            ring: Mutex::new(Ring {
                head,
                next_slot,
                next_seq: head.seq,
                next_position: head.position,
                live: BTreeMap::new(),
                unwritten: std::collections::BTreeSet::new(),
                prepared: head.position,
                zeroing: None,
            }),
            zeroed: Notify::new(),
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
        let seq = self.seqs.fetch_add(1, Ordering::SeqCst);
        // Invariant: `seq` grows along this area's ring. The areas share
        // the counter, and each draws from it only under its own lock.
        assert!(seq >= r.next_seq, "backup journal seq {seq} drawn below {}", r.next_seq);
        r.next_seq = seq + 1;
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
        let len = bytes.len() as u64;
        let zeros = self.start_zeros();
        self.until_not_zeroing(at, at + len).await;
        let offset = RING_START + at % self.lock().head.ring_len;
        let record = self.disk.write_at(vec![(offset, Bytes::from(bytes))]);
        let (written, ()) = futures::join!(record, self.lay_zeros(zeros));
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

    /// Claims the next window of zeros if it is time ([`plan_zeros`]); the
    /// caller lays them with [`BackupJournal::lay_zeros`].
    fn start_zeros(&self) -> Option<Zeroing<'_>> {
        let mut r = self.lock();
        if r.zeroing.is_some() {
            return None;
        }
        let (from, to) = plan_zeros(r.prepared, r.next_position, r.head.position, r.head.ring_len)?;
        // Invariant (module docs): free space only.
        assert!(from >= r.next_position && to <= r.head.position + r.head.ring_len);
        r.zeroing = Some((from, to));
        Some(Zeroing { journal: self, from, to, offset: RING_START + from % r.head.ring_len })
    }

    async fn lay_zeros(&self, zeros: Option<Zeroing<'_>>) {
        let Some(z) = zeros else { return };
        let len = (z.to - z.from) as usize;
        match self.disk.write_at(vec![(z.offset, Bytes::from_static(&ZEROS[..len]))]).await {
            Ok(()) => z.done(),
            // Only a cost: appends there may wait for the device's reads.
            Err(e) => tracing::warn!(error = %e, "backup journal: laying zeros ahead of the appends failed"),
        }
    }

    /// Returns once no zero write overlaps `from..to`.
    async fn until_not_zeroing(&self, from: u64, to: u64) {
        loop {
            let zeroed = self.zeroed.notified();
            tokio::pin!(zeroed);
            zeroed.as_mut().enable();
            if !self.lock().zeroing.is_some_and(|(f, t)| from < t && f < to) {
                return;
            }
            zeroed.await;
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
    /// past them, durably, and give their space back. Returns how many
    /// records it let go of.
    pub async fn release(&self, upto: u64) -> Result<u64, JournalError> {
        let _one = self.releasing.lock().await;
        let (head, slot) = {
            let r = self.lock();
            if upto <= r.head.seq {
                return Ok(0);
            }
            // Never past a record whose bytes are still on their way: its
            // space must not be handed out again under it.
            let upto = upto.min(r.next_seq).min(r.unwritten.first().copied().unwrap_or(u64::MAX));
            if upto <= r.head.seq {
                return Ok(0);
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
        let released = {
            let mut r = self.lock();
            r.head = head;
            r.next_slot = 1 - slot;
            let before = r.live.len();
            r.live = r.live.split_off(&head.seq);
            (before - r.live.len()) as u64
        };
        self.room.notify_waiters();
        Ok(released)
    }

    /// Makes this journal a second area of `first` (module docs, "Areas"):
    /// from now on both draw `seq`s from one counter, which starts above
    /// every record either holds.
    pub fn join(mut self, first: &BackupJournal) -> BackupJournal {
        first.seqs.fetch_max(self.seqs.load(Ordering::SeqCst), Ordering::SeqCst);
        self.seqs = first.seqs.clone();
        self
    }

    /// Names `id` as this journal's second area in its head, durably, in
    /// both head slots (a torn write leaves a head naming none, before the
    /// area took any record). Call before the area takes records.
    pub async fn name_second_area(&self, id: u128) -> Result<(), JournalError> {
        let _one = self.releasing.lock().await;
        let (head, slot) = {
            let r = self.lock();
            (Head { overflow_id: id, ..r.head }, r.next_slot)
        };
        for s in [slot, 1 - slot] {
            self.disk.write_at(vec![(s * HEAD_LEN, Bytes::from(head.encode()))]).await?;
            if let Err(e) = self.commit.sync().await {
                return Err(if self.commit.failed() { JournalError::Failed } else { e.into() });
            }
        }
        self.lock().head = head;
        Ok(())
    }

    /// This journal's id (in its head and every record).
    pub fn id(&self) -> u128 {
        self.lock().head.journal_id
    }

    /// The id of the second area its head names (0: none).
    pub fn second_area(&self) -> u128 {
        self.lock().head.overflow_id
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

    /// The `seq` the next record will get, in this area or the journal's
    /// other one: every record below it is reserved already, or being
    /// reserved under its area's lock.
    pub fn next_seq(&self) -> u64 {
        self.seqs.load(Ordering::SeqCst)
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
#[path = "journal_tests.rs"]
mod tests;
