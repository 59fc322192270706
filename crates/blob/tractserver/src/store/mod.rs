//! The tract store: tracts in fixed slots on one disk, all metadata in
//! memory, rebuilt from the disk at start (FDS §2.1).
//!
//! Invariants:
//! - A write is acknowledged only after its data, its chunk entries (as
//!   journal records, `journal.rs`) and (if new) its slot entry are
//!   durable: written, then covered by a group commit.
//! - Stored bytes are returned only after their chunk CRC verified; a chunk
//!   that fails is reported `Corrupt`, never returned.
//! - A chunk entry counts only if its generation equals its slot's; a slot's
//!   next generation exceeds every generation found anywhere in its chunk
//!   entries, so leftovers from a torn or lost write can never come back to
//!   life in a later tenant.
//! - In memory, a slot's `(data, chunk entries)` change together under the
//!   slot's write lock, so readers never see a CRC that does not belong to
//!   the bytes beside it.
//! - Memory describes the disk: what a restart would read (after a failed
//!   disk write too), or, where it cannot know, it does not answer (an
//!   unsettled chunk is read by the next digest; a disk whose failed write
//!   could not be read back answers no digest at all).
//!
//! Recovery at open, case by case: `open.rs` (and the journal's cases,
//! `journal.rs`). Reads, digests, repairs and heals of chunks: `chunks.rs`.
//! Chunk entries reach the disk through the journal, never in place but
//! by its checkpoints (`journal.rs`).
//!
//! A process killed in the middle of a write leaves every chunk old or new:
//! first writes put data before the chunk entry, overwrites put the entry
//! (with the previous CRC) before the data (see `write`). Power loss can
//! reorder the page cache's writes; a chunk torn that way reads as
//! `Corrupt` and the client uses another replica (design 0002).
//!
//! A write or trim the disk fails part-way (EIO, ENOSPC: any prefix of its
//! pieces stored) while the server lives on: memory takes what the disk
//! holds, read back (`undo_failed_write`), so that it still says what a
//! restart would read; a digest answers from memory, and replicas are
//! reconciled on it. If it cannot be read back, the disk is distrusted
//! (writes, syncs and digests refused) until a restart.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::RwLock;

use blizzard_core::crc::{crc32c, first_bad_piece, piece_count, pieces, zeros_crc};
use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::reconcile::ChunkState;
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};
use blizzard_env::{Clock, Disk};
use blizzard_proto::{ErrorCode, ErrorReply};

use crate::layout::{
    decode_positions, encode_positions, ChunkEntry, Layout, LayoutError, SlotEntry, SlotRecord,
    CHUNK_ENTRY_LEN, POSITIONS_SLOT_LEN, SLOT_ENTRY_LEN, SUPERBLOCK_LEN,
};
use blizzard_env::GroupCommit;

mod backup;
mod chunks;
mod journal;
mod open;

pub use backup::Replayed;

use chunks::take_from_disk;
use journal::{Appended, Journal};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Layout(#[from] LayoutError),
    #[error("disk i/o error: {0}")]
    Io(#[from] io::Error),
    #[error("range [{offset}, +{len}) is outside the {tract_size}-byte tract")]
    OutOfRange { offset: u32, len: u32, tract_size: u32 },
    #[error("request data does not match its CRC in piece {0}: damaged in flight")]
    BadCrc(usize),
    #[error("stored chunk {chunk} of slot {slot} failed its CRC: read another replica")]
    Corrupt { slot: u32, chunk: u32 },
    #[error("no free tract slot: the disk is full ({0} slots); add tractservers or delete blobs")]
    DiskFull(u32),
    #[error("the disk failed an earlier fdatasync and is no longer trusted; replace it")]
    Failed,
    #[error(
        "not applied: the client has reconnected since sending this request; retry on the new connection"
    )]
    Superseded,
    #[error("{0}")]
    Journal(#[from] crate::backup::journal::JournalError),
}

/// Asked under a tract's slot lock, just before a change is applied:
/// whether the request is still its client's newest (`blizzard_rpc::Caller`).
/// Asking there orders the answer against every later change to the tract.
pub type Current<'a> = &'a (dyn Fn() -> bool + Send + Sync);

/// For changes made by the server itself.
pub const ALWAYS: Current<'static> = &|| true;

/// Counters for status and tests.
#[derive(Default)]
pub struct StoreStats {
    pub writes: AtomicU64,
    pub reads: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    pub corrupt_reads: AtomicU64,
    /// Damaged chunks rewritten from another replica by the scrubber.
    pub repaired_chunks: AtomicU64,
    /// Tract digests taken (`Store::digest`).
    pub digests: AtomicU64,
    /// Chunks digests had to read from the disk (unsettled ones); the rest
    /// were answered from memory.
    pub digest_chunks_read: AtomicU64,
    /// Writes acknowledged by the backup journal (`backup.rs`), and records
    /// it replayed onto the data disk when attached.
    pub journaled_writes: AtomicU64,
    pub journal_replayed: AtomicU64,
}

struct SlotState {
    entry: SlotEntry,
    /// One entry per chunk while the slot is used; empty while free.
    chunks: Vec<ChunkEntry>,
    /// Written chunks whose current bytes memory cannot vouch for: an
    /// overwrite entry found at open (a crash may have left the bytes
    /// under the previous CRC), or bytes found matching no CRC their entry
    /// accepts. Every other written chunk holds bytes whose CRC is its
    /// entry's `crc`, so a digest answers it from memory.
    unsettled: ChunkSet,
    /// Highest generation seen for this slot anywhere on disk.
    max_generation: u32,
}

impl SlotState {
    /// Makes the slot hold `chunks` (a new tenant, a new incarnation, or
    /// none): every chunk's bytes are then as memory says.
    fn reset_chunks(&mut self, chunks: Vec<ChunkEntry>) {
        self.chunks = chunks;
        self.unsettled = ChunkSet::default();
    }
}

/// A set of chunk numbers of one slot: a bitmap, empty (no allocation)
/// while no chunk is in it, as is usual.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ChunkSet {
    bits: Vec<u64>,
}

impl ChunkSet {
    fn insert(&mut self, chunk: u32) {
        let (w, b) = ((chunk / 64) as usize, chunk % 64);
        if self.bits.len() <= w {
            self.bits.resize(w + 1, 0);
        }
        self.bits[w] |= 1 << b;
    }

    fn remove(&mut self, chunk: u32) {
        let (w, b) = ((chunk / 64) as usize, chunk % 64);
        if let Some(word) = self.bits.get_mut(w) {
            *word &= !(1 << b);
        }
        if self.bits.iter().all(|w| *w == 0) {
            self.bits = Vec::new();
        }
    }

    fn contains(&self, chunk: u32) -> bool {
        self.bits.get((chunk / 64) as usize).is_some_and(|w| w & (1 << (chunk % 64)) != 0)
    }

    fn is_empty(&self) -> bool {
        self.bits.is_empty()
    }
}

/// A written chunk of a tract, its slot write-locked
/// (`Store::lock_written_chunk`).
struct LockedChunk<'a> {
    slot: u32,
    g: tokio::sync::RwLockWriteGuard<'a, SlotState>,
    entry: ChunkEntry,
    /// Where the chunk's data lies on the disk.
    at: u64,
    /// What the disk holds there now.
    now: Bytes,
}

struct Index {
    map: HashMap<(BlobId, TractNo), u32>,
    /// Free slots, lowest last so allocation fills the disk from the front.
    free: Vec<u32>,
    next_alloc_seq: u64,
    quarantined: u32,
}

/// One write of bytes into a tract, as [`Store::write_with`] takes it.
pub struct TractWrite<'a> {
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub tract: TractNo,
    /// The TLT row version the writer used (stored with the tract).
    pub version: u64,
    /// Where in the tract, in bytes.
    pub offset: u32,
    pub data: Bytes,
    /// The writer's CRC32C of each piece (`blizzard_core::crc::piece_crcs`).
    pub crcs: &'a [u32],
    pub durability: Durability,
}

/// When a write is acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Once durable (a group commit after it completed).
    Synced,
    /// Once applied; durable after a later sync.
    Cached,
}

/// Bugs planted on purpose, so tests can show that the checkers catch
/// them. Only the simulator and tests set one; nothing else can.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlantedBug {
    #[default]
    None,
    /// Acknowledge writes before they are durable (skip the group commit).
    AckBeforeSync,
    /// A newcomer counts a tract as copied without copying it.
    SkipCopy,
    /// Apply changes from connections their client has replaced (no
    /// session fencing, `blizzard_rpc::Caller`).
    NoFence,
    /// Admit changes of every writer epoch (no writer fencing,
    /// `crate::fence`): a crashed writer's late requests land after its
    /// successor reconciled.
    NoWriterFence,
    /// A journal checkpoint moves the head past its records without
    /// writing their entries into the chunk table (`journal.rs`): after
    /// a restart, what they recorded is gone.
    CheckpointSkipsTable,
    /// The backup journal acknowledges a record before it is durable
    /// (`crate::backup::journal`): a crash loses journaled writes that the
    /// data disk never got.
    JournalAckBeforeSync,
}

/// Tract writes handed to the disk at once. Buffered writes to one file
/// serialize on its inode lock anyway; dozens of writers at once only burn
/// CPU spinning on it. Group commit still batches everything behind them.
pub const DISK_WRITERS_MAX: usize = 16;

pub struct Store {
    disk: Arc<dyn Disk>,
    writers: tokio::sync::Semaphore,
    planted: std::sync::atomic::AtomicU8,
    layout: Layout,
    index: Mutex<Index>,
    slots: Vec<RwLock<SlotState>>,
    commit: GroupCommit,
    /// Where chunk entries go (`journal.rs`).
    journal: Journal,
    positions: tokio::sync::Mutex<(u64, Option<Vec<u8>>)>,
    /// The hybrid tier's backup journal, once attached (`backup.rs`).
    backup: std::sync::OnceLock<backup::Backup>,
    pub stats: StoreStats,
}

/// Disk reads during recovery are done in pieces of about this size.
const RECOVERY_READ_BYTES: u64 = 16 << 20;

/// Most unsettled chunks a digest reads from the disk at once (1 MiB).
const DIGEST_READ_CHUNKS: u32 = 256;

impl Store {
    #[doc(hidden)]
    pub fn plant_bug(&self, bug: PlantedBug) {
        self.planted.store(bug as u8, Ordering::Relaxed);
    }

    pub(crate) fn planted(&self, bug: PlantedBug) -> bool {
        self.planted.load(Ordering::Relaxed) == bug as u8 && bug != PlantedBug::None
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn disk_id(&self) -> TsId {
        self.layout.disk_id
    }

    pub fn tract_size(&self) -> u32 {
        self.layout.tract_size
    }

    pub fn disk_mbps(&self) -> u32 {
        self.layout.disk_mbps
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        match self.index.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// (slots in total, slots holding a tract).
    pub fn usage(&self) -> (u64, u64) {
        let ix = self.index();
        (self.layout.slot_count as u64, ix.map.len() as u64)
    }

    /// Bytes of the disk's own background work still ahead
    /// ([`Disk::preparing_left`]).
    pub fn disk_preparing_left(&self) -> u64 {
        self.disk.preparing_left() + self.backup.get().map_or(0, |b| b.journal.preparing_left())
    }

    /// Number of `fdatasync` calls so far.
    pub fn syncs(&self) -> u64 {
        self.commit.syncs()
    }

    /// Every `(blob, tract)` stored, for metadata loading and scrubbing.
    pub fn tracts(&self) -> Vec<(BlobId, TractNo)> {
        let mut v: Vec<_> = self.index().map.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// The incarnation stored for a tract, if any.
    pub async fn incarnation_of(&self, blob: BlobId, tract: TractNo) -> Option<Incarnation> {
        let slot = *self.index().map.get(&(blob, tract))?;
        let g = self.slots.get(slot as usize)?.read().await;
        (g.entry.used && g.entry.blob == blob && g.entry.tract == tract).then_some(g.entry.incarnation)
    }

    /// Which chunks of a tract hold written data: bit i (LSB first) of the
    /// bitmap is chunk i. Empty when the tract holds nothing here.
    pub async fn mapped(&self, blob: BlobId, incarnation: Incarnation, tract: TractNo) -> Vec<u8> {
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else { return Vec::new() };
        let Some(cell) = self.slots.get(slot as usize) else { return Vec::new() };
        let g = cell.read().await;
        let gen = g.entry.generation;
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
            || gen == 0
        {
            return Vec::new();
        }
        let mut bitmap = vec![0u8; g.chunks.len().div_ceil(8)];
        let mut any = false;
        for (i, e) in g.chunks.iter().enumerate() {
            if e.generation == gen {
                bitmap[i / 8] |= 1 << (i % 8);
                any = true;
            }
        }
        if any {
            bitmap
        } else {
            Vec::new()
        }
    }

    fn check_range(&self, offset: u32, len: u32) -> Result<(), StoreError> {
        let ts = self.layout.tract_size;
        if len == 0 || offset as u64 + len as u64 > ts as u64 {
            return Err(StoreError::OutOfRange { offset, len, tract_size: ts });
        }
        Ok(())
    }

    /// Finds the slot of a tract, allocating one if `allocate`. Returns the
    /// slot with its write lock held, checked to still hold that tract.
    async fn lock_slot_for_write(
        &self,
        blob: BlobId,
        tract: TractNo,
        incarnation: Incarnation,
        version: u64,
    ) -> Result<(u32, tokio::sync::RwLockWriteGuard<'_, SlotState>, bool), StoreError> {
        loop {
            let (slot, fresh) = {
                let mut ix = self.index();
                match ix.map.get(&(blob, tract)) {
                    Some(&s) => (s, None),
                    None => {
                        let Some(s) = ix.free.pop() else {
                            return Err(StoreError::DiskFull(self.layout.slot_count));
                        };
                        let seq = ix.next_alloc_seq;
                        ix.next_alloc_seq += 1;
                        ix.map.insert((blob, tract), s);
                        (s, Some(seq))
                    }
                }
            };
            let Some(cell) = self.slots.get(slot as usize) else {
                return Err(StoreError::Io(io::Error::other("slot index out of range")));
            };
            let mut g = cell.write().await;
            if let Some(alloc_seq) = fresh {
                let generation = g.max_generation.wrapping_add(1).max(1);
                g.entry = SlotEntry {
                    used: true,
                    generation,
                    blob,
                    incarnation,
                    tract,
                    written_version: version,
                    alloc_seq,
                };
                g.max_generation = generation;
                g.reset_chunks(vec![ChunkEntry::default(); self.layout.chunks_per_tract() as usize]);
                return Ok((slot, g, true));
            }
            if g.entry.used && g.entry.blob == blob && g.entry.tract == tract {
                return Ok((slot, g, false));
            }
            // Freed and possibly reused between lookup and lock: look again.
        }
    }

    /// Reads chunk `chunk` of a slot, verified; zeros if never written.
    /// A chunk's current bytes, verified, with the CRC they have (the
    /// latest write's, or the one before if that write was cut off before
    /// its data). Unwritten chunks are zeros.
    /// Returns a slot taken for a write that stored nothing of it (its slot
    /// entry never reached the disk): left in the index, a later write
    /// would find it and not store its slot entry, and the tract would be
    /// gone after a restart.
    fn give_back(&self, slot: u32, g: &mut SlotState, blob: BlobId, tract: TractNo) {
        g.entry.used = false;
        g.reset_chunks(Vec::new());
        let mut ix = self.index();
        ix.map.remove(&(blob, tract));
        ix.free.push(slot);
    }

    /// Makes memory describe the disk again after a failed `write_at` (EIO,
    /// ENOSPC on a device that filled up), which may have stored any prefix
    /// of the write's pieces: data of first-written chunks, then the chunk
    /// entries (themselves perhaps only in part), then data of overwritten
    /// chunks, then the slot entry (if it changed).
    ///
    /// Memory must say what a restart would read (and a digest reports
    /// memory): keeping the old view because the write was not
    /// acknowledged is not enough. Replicas are reconciled on what digests
    /// report, and a later restart of this server would read the disk and
    /// bring the unacknowledged write back on this replica alone. So what
    /// the write may have stored is read back and taken as open would take
    /// it:
    ///
    /// - The slot entry (only if the write changed it), last of the write:
    ///   if it is not there, memory takes back the entry it had (a fresh
    ///   slot is given back, a new incarnation's generation is dropped with
    ///   the chunks it had); if it is, memory keeps the new one (a fresh
    ///   slot stays this tract's). `max_generation` stays raised either
    ///   way: entries of that generation may be on disk and must never
    ///   count for a later one.
    /// - The entries of every chunk the write covered, from the disk, each
    ///   settled against the bytes beside it ([`settle`]): a first write's
    ///   entry on disk means its data is there too (the data went first);
    ///   an overwrite's entry went before its data, so the bytes say
    ///   whether they are new or old; an entry the write did not reach is
    ///   the one memory had. Bytes matching nothing the entry accepts (a
    ///   short write; a new incarnation's data over an entry of the old
    ///   one) leave the chunk unsettled: a digest reads it (`Unreadable`),
    ///   and the scrubber or a repair replaces it.
    ///
    /// If that cannot be read (a disk failing reads too), memory cannot
    /// know what a restart would find, and no digest may answer for it: the
    /// disk is distrusted as after a failed `fdatasync` (every write, trim,
    /// sync and digest refused, [`Store::distrust`]); a restart rebuilds
    /// memory from whatever the disk then holds.
    #[allow(clippy::too_many_arguments)]
    async fn undo_failed_write(
        &self,
        slot: u32,
        g: &mut SlotState,
        (blob, tract): (BlobId, TractNo),
        fresh: bool,
        entry_dirty: bool,
        entry_before: SlotEntry,
        chunks_before: Option<(Vec<ChunkEntry>, ChunkSet)>,
        changed: Changed<'_>,
    ) {
        let Changed { first_chunk, chunks, appended } = changed;
        let meant = g.entry;
        // Where the write's records did not reach the disk, the entries a
        // restart reads are those from before it: a new incarnation's
        // write had reset memory's, so they are the old ones.
        let before = entry_range(chunks_before.as_ref().map_or(&g.chunks, |(c, _)| c), first_chunk, chunks);
        let read = async {
            let record = if entry_dirty {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks, before, appended).await?;
            Ok::<_, io::Error>((record, back))
        }
        .await;
        let stored = match &read {
            // Unchanged by the write: on disk as in memory.
            Ok((None, _)) => Some(true),
            Ok((Some(SlotRecord::Valid(e)), _)) => Some(*e == meant),
            // Not the new entry (a fresh slot's previous state).
            Ok((Some(SlotRecord::Blank), _)) => Some(false),
            // Half-written: a restart would quarantine the slot.
            Ok((Some(SlotRecord::Damaged), _)) | Err(_) => None,
        };
        if stored != Some(true) {
            if fresh {
                self.give_back(slot, g, blob, tract);
            } else {
                g.entry = entry_before;
                if let Some((chunks, unsettled)) = chunks_before {
                    g.chunks = chunks;
                    g.unsettled = unsettled;
                }
            }
        }
        match (stored, read) {
            (Some(_), Ok((_, (entries, data)))) => {
                if g.entry.used && !(fresh && stored == Some(false)) {
                    take_from_disk(g, first_chunk, &entries, &data);
                }
            }
            (_, read) => {
                let why = match read {
                    Err(e) => format!("reading it back failed: {e}"),
                    Ok(_) => "its slot entry is damaged on disk".to_string(),
                };
                self.distrust(slot, &why);
            }
        }
    }

    /// [`Store::undo_failed_write`] for a trim: its chunk entries, the data
    /// of its partial chunks, then (if it left the tract empty) the slot
    /// entry marked free. A freed slot entry on disk frees the slot in
    /// memory too; otherwise memory takes the chunk entries and bytes there.
    async fn undo_failed_trim(
        &self,
        slot: u32,
        g: &mut SlotState,
        (blob, tract): (BlobId, TractNo),
        freeing: bool,
        changed: Changed<'_>,
    ) {
        let Changed { first_chunk, chunks, appended } = changed;
        let before = entry_range(&g.chunks, first_chunk, chunks);
        let read = async {
            let record = if freeing {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks, before, appended).await?;
            Ok::<_, io::Error>((record, back))
        }
        .await;
        match read {
            Ok((Some(SlotRecord::Valid(e)), _)) if e == SlotEntry { used: false, ..g.entry } => {
                g.entry.used = false;
                g.reset_chunks(Vec::new());
                let mut ix = self.index();
                ix.map.remove(&(blob, tract));
                ix.free.push(slot);
            }
            Ok((Some(SlotRecord::Valid(e)), (entries, data))) if e == g.entry => {
                take_from_disk(g, first_chunk, &entries, &data)
            }
            Ok((None, (entries, data))) => take_from_disk(g, first_chunk, &entries, &data),
            Ok(_) => self.distrust(slot, "its slot entry is neither the old nor the freed one on disk"),
            Err(e) => self.distrust(slot, &format!("reading it back failed: {e}")),
        }
    }

    /// For a store that can no longer tell what its disk holds in `slot`:
    /// memory could disagree with what a restart reads, so nothing may be
    /// answered or changed from it any more. The disk is marked failed, as
    /// after a failed `fdatasync`: writes, trims, syncs and digests are
    /// refused until the server restarts and reads the disk afresh.
    fn distrust(&self, slot: u32, why: &str) {
        tracing::error!(
            slot,
            why,
            "after a failed disk write, memory may no longer describe the disk; refusing changes and digests until restarted"
        );
        self.commit.poison();
    }

    /// Writes `data` at `offset` in a tract. `crcs` are the writer's CRC32C
    /// of each piece; they are verified before anything is stored, and full
    /// chunks are stored under the writer's own CRC. Returns once durable.
    #[allow(clippy::too_many_arguments)]
    pub async fn write(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        version: u64,
        offset: u32,
        data: Bytes,
        crcs: &[u32],
    ) -> Result<(), StoreError> {
        let w = TractWrite {
            blob,
            incarnation,
            tract,
            version,
            offset,
            data,
            crcs,
            durability: Durability::Synced,
        };
        self.write_with(w, ALWAYS).await
    }

    /// Makes every write applied so far durable (one group commit).
    pub async fn sync(&self) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        self.commit.sync().await.map_err(|_| StoreError::Failed)
    }

    /// [`Store::write`], returning once durable (`Synced`) or once applied
    /// (`Cached`: durable after the next [`Store::sync`], and it survives
    /// a kill of this process, since the kernel holds it). `current` is
    /// asked under the slot lock whether the write may still apply.
    pub async fn write_with(&self, w: TractWrite<'_>, current: Current<'_>) -> Result<(), StoreError> {
        let TractWrite { blob, incarnation, tract, version, offset, data, crcs, durability } = w;
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let len = data.len() as u32;
        if data.len() > self.layout.tract_size as usize {
            return Err(StoreError::OutOfRange { offset, len: u32::MAX, tract_size: self.layout.tract_size });
        }
        self.check_range(offset, len)?;
        if let Some(p) = first_bad_piece(offset, &data, crcs) {
            return Err(StoreError::BadCrc(p));
        }

        // Room in the journal for this write's records, before the slot
        // lock (`journal.rs`: a change waiting for room holds no lock).
        let mut credit = self.journal_credit(piece_count(offset, len) as u32).await?;
        let (slot, mut g, fresh) = self.lock_slot_for_write(blob, tract, incarnation, version).await?;
        if !current() {
            if fresh {
                self.give_back(slot, &mut g, blob, tract);
            }
            return Err(StoreError::Superseded);
        }
        // What memory said before this write, to put back if it fails.
        let entry_before = g.entry;
        let mut chunks_before: Option<(Vec<ChunkEntry>, ChunkSet)> = None;
        let mut entry_dirty = fresh;
        if g.entry.incarnation != incarnation {
            chunks_before = Some((std::mem::take(&mut g.chunks), std::mem::take(&mut g.unsettled)));
            // A new life of this blob id: everything stored before is void.
            let generation = g.max_generation.wrapping_add(1).max(1);
            g.entry.incarnation = incarnation;
            g.entry.generation = generation;
            g.max_generation = generation;
            g.reset_chunks(vec![ChunkEntry::default(); self.layout.chunks_per_tract() as usize]);
            entry_dirty = true;
        }
        if version > g.entry.written_version {
            g.entry.written_version = version;
            entry_dirty = true;
        }

        let first_chunk = offset / CHUNK_SIZE;
        let last_chunk = (offset + len - 1) / CHUNK_SIZE;
        let mut new_entries: Vec<ChunkEntry> = Vec::with_capacity((last_chunk - first_chunk + 1) as usize);
        let generation = g.entry.generation;
        let entry = |crc: u32, prev: Option<u32>| ChunkEntry {
            crc,
            generation,
            prev_crc: prev.unwrap_or(0),
            prev_generation: if prev.is_some() { generation } else { 0 },
        };

        // Crash safety comes from the order of the writes (the kernel keeps
        // the order of system calls when the process dies):
        // - a chunk written for the first time gets its data before its
        //   entry: cut off in between, the chunk is still unwritten;
        // - an overwritten chunk gets its entry (new CRC and the previous
        //   one) before its data: cut off in between, the old bytes still
        //   read under the previous CRC.
        let mut first: Vec<(u64, Bytes)> = Vec::new();
        let mut over: Vec<(u64, Bytes)> = Vec::new();
        // Each piece is a whole chunk (stored as is, under the writer's CRC)
        // or part of one (merged with the verified old chunk first).
        // Consecutive whole chunks of the same kind are contiguous in `data`
        // and on disk: they go down as one write (one device I/O for a
        // whole tract).
        let mut run: Option<(bool, usize, usize)> = None;
        let flush_run = |run: Option<(bool, usize, usize)>,
                         first: &mut Vec<(u64, Bytes)>,
                         over: &mut Vec<(u64, Bytes)>| {
            if let Some((overwrite, rs, re)) = run {
                let w = (self.layout.data_offset_of(slot, offset + rs as u32), data.slice(rs..re));
                if overwrite {
                    over.push(w);
                } else {
                    first.push(w);
                }
            }
        };
        // Nothing is on the disk yet: a refusal here (a chunk that cannot
        // be merged, a failed read) puts memory back as it was.
        let built = async {
            for ((s, e), &crc) in pieces(offset, len).zip(crcs) {
                let abs = offset + s as u32;
                let chunk = abs / CHUNK_SIZE;
                let old = g.chunks.get(chunk as usize).copied().unwrap_or_default();
                let overwrite = old.generation == generation && generation != 0;
                if e - s == CHUNK_SIZE as usize {
                    run = match run {
                        Some((ow, rs, re)) if re == s && ow == overwrite => Some((ow, rs, e)),
                        r => {
                            flush_run(r, &mut first, &mut over);
                            Some((overwrite, s, e))
                        }
                    };
                    // The previous CRC must be the bytes' own: for an
                    // unsettled chunk only the disk knows it.
                    let prev = if overwrite && g.unsettled.contains(chunk) {
                        self.settle_from_disk(slot, &mut g, chunk).await?.unwrap_or(old.crc)
                    } else {
                        old.crc
                    };
                    new_entries.push(entry(crc, overwrite.then_some(prev)));
                    continue;
                }
                let at = (abs % CHUNK_SIZE) as usize;
                // Merged into a buffer aligned for direct I/O.
                let merge = |old_bytes: &[u8]| {
                    let mut merged = blizzard_env::aligned_buffer(CHUNK_SIZE as usize);
                    merged.extend_from_slice(&old_bytes[..at]);
                    merged.extend_from_slice(&data[s..e]);
                    merged.extend_from_slice(&old_bytes[at + (e - s)..]);
                    merged
                };
                let (merged, new_entry) = match self.read_chunk_verified(slot, &g, chunk).await {
                    Ok((old_bytes, old_crc)) => {
                        let merged = merge(&old_bytes);
                        let crc = crc32c(&merged);
                        (merged, entry(crc, overwrite.then_some(old_crc)))
                    }
                    // A torn chunk: the bytes match neither CRC its entry
                    // accepts. Power loss cut off a partial write into it
                    // (cached, or waiting for its group commit) whose entry
                    // reached the disk and whose data reached it only in
                    // part, sector by sector. That write stored the whole
                    // merged chunk: outside its range the very bytes that
                    // were there before (which both CRCs of the entry
                    // agree on there), inside it a mix of old and new. Its
                    // writer, whose sync failed, now writes the same range
                    // again: merged into the raw bytes, the request
                    // replaces the whole mixed part, so the result is
                    // exactly the chunk the cut-off write meant to leave,
                    // which is what the entry's current CRC describes. The
                    // CRC is then the test: a match proves the bytes
                    // outside the range right too (as far as any stored
                    // chunk is proved by its CRC), and makes the chunk
                    // whole again; anything else (another write, bytes
                    // rotted outside the range) still cannot be merged.
                    // With one replica nothing else could ever repair it
                    // (`heal_chunk` has no complete replica to copy from),
                    // and the retried write, acknowledged to a fast-ack
                    // volume's user, could never complete. The entry stays
                    // as it is (it already names these bytes), written
                    // again before them like any overwrite's: cut off once
                    // more, the chunk is as torn as it was.
                    Err(StoreError::Corrupt { .. }) if overwrite => {
                        let at_disk = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
                        // A cut-off first write (its entry names no previous
                        // contents) meant zeros around its range, whatever an
                        // earlier tenant of the slot left on the disk there.
                        let raw = if old.prev_generation == old.generation {
                            self.disk.read_at(at_disk, CHUNK_SIZE as usize).await?
                        } else {
                            Bytes::from(vec![0u8; CHUNK_SIZE as usize])
                        };
                        let merged = merge(&raw);
                        if crc32c(&merged) != old.crc {
                            // Memory no longer vouches for these bytes: the
                            // next digest reads them (`Unreadable`).
                            g.unsettled.insert(chunk);
                            return Err(StoreError::Corrupt { slot, chunk });
                        }
                        tracing::info!(
                            slot,
                            chunk,
                            "a torn chunk is made whole by the write it was cut off in"
                        );
                        (merged, old)
                    }
                    Err(e) => return Err(e),
                };
                let w = (self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), merged.freeze());
                if overwrite {
                    over.push(w);
                } else {
                    first.push(w);
                }
                new_entries.push(new_entry);
            }
            Ok(())
        }
        .await;
        if let Err(e) = built {
            if fresh {
                self.give_back(slot, &mut g, blob, tract);
            } else {
                g.entry = entry_before;
                if let Some((chunks, unsettled)) = chunks_before {
                    g.chunks = chunks;
                    g.unsettled = unsettled;
                }
            }
            return Err(e);
        }
        flush_run(run, &mut first, &mut over);
        debug_assert_eq!(new_entries.len(), piece_count(offset, len));
        let chunks_written = self.whole_chunks(slot, first_chunk, new_entries.len(), &first, &over);
        // The entries go to the journal where the chunk table's piece went:
        // after first-written data, before overwritten data.
        let appended = self.journal.append(&mut credit, slot, first_chunk, &new_entries);
        drop(credit);
        let mut writes = first;
        writes.extend(appended.iter().map(|a| (a.at, a.bytes.clone())));
        writes.extend(over);
        if entry_dirty {
            writes.push((self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&g.entry.encode())));
        }
        let written = {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(writes).await
        };
        if let Err(e) = written {
            tracing::error!(slot, error = %e, "tract write failed");
            self.undo_failed_write(
                slot,
                &mut g,
                (blob, tract),
                fresh,
                entry_dirty,
                entry_before,
                chunks_before,
                Changed { first_chunk, chunks: new_entries.len() as u32, appended: &appended },
            )
            .await;
            drop(g);
            // What part of it landed is made durable now rather than at the
            // next group commit (with a backup journal, the next destage):
            // left in the page cache, a power loss could tear an
            // overwritten chunk between its old and new bytes, and with no
            // other replica to heal from the retried write could never
            // merge into it (`blob-sim --seed 200724 --replication 1
            // --tractservers 4 --joining 2`). A sync that fails here fails
            // the disk, as the next one would have.
            let _ = self.commit.sync().await;
            return Err(e.into());
        }
        let chunk_crcs: Vec<u32> = new_entries.iter().map(|e| e.crc).collect();
        // Memory now knows every written chunk's bytes: the new ones.
        for (i, e) in new_entries.into_iter().enumerate() {
            if let Some(c) = g.chunks.get_mut(first_chunk as usize + i) {
                *c = e;
            }
            g.unsettled.remove(first_chunk + i as u32);
        }
        // Its place in the backup journal's order, if there is one, taken
        // under the lock and after the bytes are applied (`backup.rs`).
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version,
            offset: first_chunk * CHUNK_SIZE,
            len: chunk_crcs.len() as u32 * CHUNK_SIZE,
            write: chunks_written.as_deref().map(|w| (&chunk_crcs[..], w)),
            whole_tract: chunks_before.is_some(),
        };
        let journaled = self.journal_change(&change).await;
        drop(g);
        // Durable before acknowledged: in the backup journal, or by a group
        // commit of the data disk that started after our writes completed.
        let disk_sync = durability == Durability::Synced && !self.planted(PlantedBug::AckBeforeSync);
        self.make_durable(journaled?, disk_sync).await?;
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Unmaps `[offset, offset + len)` of a tract: whole chunks are marked
    /// unwritten (they read as zeros), partial chunks are zeroed in place,
    /// and a tract left with nothing written gives its slot back. Durable
    /// on return.
    pub async fn trim(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
        current: Current<'_>,
    ) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        self.check_range(offset, len)?;
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else {
            return Ok(());
        };
        let Some(cell) = self.slots.get(slot as usize) else {
            return Ok(());
        };
        let mut credit = self.journal_credit(piece_count(offset, len) as u32).await?;
        let mut g = cell.write().await;
        if !current() {
            return Err(StoreError::Superseded);
        }
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(());
        }
        let generation = g.entry.generation;
        let first_chunk = offset / CHUNK_SIZE;
        let mut writes: Vec<(u64, Bytes)> = Vec::new();
        let mut new_entries = Vec::new();
        for (s, e) in pieces(offset, len) {
            let abs = offset + s as u32;
            let chunk = abs / CHUNK_SIZE;
            let written =
                g.chunks.get(chunk as usize).is_some_and(|c| c.generation == generation && generation != 0);
            if e - s == CHUNK_SIZE as usize || !written {
                // Unwritten: reads as zeros, whatever the bytes on disk say.
                new_entries.push(ChunkEntry::default());
            } else {
                let (old, old_crc) = self.read_chunk_verified(slot, &g, chunk).await?;
                let at = (abs % CHUNK_SIZE) as usize;
                let mut merged = blizzard_env::aligned_buffer(CHUNK_SIZE as usize);
                merged.extend_from_slice(&old[..at]);
                merged.resize(at + (e - s), 0);
                merged.extend_from_slice(&old[at + (e - s)..]);
                // An overwrite: entry (with the previous CRC) before data.
                new_entries.push(ChunkEntry {
                    crc: crc32c(&merged),
                    generation,
                    prev_crc: old_crc,
                    prev_generation: generation,
                });
                writes.push((self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), merged.freeze()));
            }
        }
        // Entries (the journal's records) before the partial chunks' data,
        // as for any overwrite.
        let appended = self.journal.append(&mut credit, slot, first_chunk, &new_entries);
        drop(credit);
        writes.splice(0..0, appended.iter().map(|a| (a.at, a.bytes.clone())));
        let range = first_chunk as usize..first_chunk as usize + new_entries.len();
        let empty = g.chunks.iter().enumerate().all(|(i, c)| {
            let c = if range.contains(&i) { &new_entries[i - range.start] } else { c };
            c.generation != generation || generation == 0
        });
        if empty {
            let freed = SlotEntry { used: false, ..g.entry };
            writes.push((self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&freed.encode())));
        }
        // Memory changes only once the disk has it all. A failed write may
        // have stored any prefix of it (entries, then partial chunks' data,
        // then the freed slot entry): memory then takes what the disk holds,
        // as after a failed write (`undo_failed_write` says why keeping the
        // old view is not enough).
        let written = {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(writes).await
        };
        if let Err(e) = written {
            tracing::error!(slot, error = %e, "tract trim failed");
            self.undo_failed_trim(
                slot,
                &mut g,
                (blob, tract),
                empty,
                Changed { first_chunk, chunks: new_entries.len() as u32, appended: &appended },
            )
            .await;
            return Err(e.into());
        }
        let version = g.entry.written_version;
        if empty {
            g.entry.used = false;
            g.reset_chunks(Vec::new());
            let mut ix = self.index();
            ix.map.remove(&(blob, tract));
            ix.free.push(slot);
        } else {
            for (i, e) in new_entries.into_iter().enumerate() {
                if let Some(c) = g.chunks.get_mut(first_chunk as usize + i) {
                    *c = e;
                }
                g.unsettled.remove(first_chunk + i as u32);
            }
        }
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version,
            offset,
            len,
            write: None,
            whole_tract: empty,
        };
        let marked = self.journal_change(&change).await;
        drop(g);
        self.make_durable(marked?, true).await?;
        Ok(())
    }

    /// Frees a tract's slot if it holds `incarnation`. Returns whether
    /// something was freed; durable on return.
    pub async fn delete(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
    ) -> Result<bool, StoreError> {
        self.delete_if(blob, incarnation, tract, ALWAYS).await
    }

    /// [`Store::delete`], applied only if `current` says so under the lock.
    pub async fn delete_if(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        current: Current<'_>,
    ) -> Result<bool, StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else {
            return Ok(false);
        };
        let Some(cell) = self.slots.get(slot as usize) else {
            return Ok(false);
        };
        let mut g = cell.write().await;
        if !current() {
            return Err(StoreError::Superseded);
        }
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(false);
        }
        // Memory frees the slot only once the disk says so: a slot marked
        // free in memory but still in the index would send every later
        // write to this tract round `lock_slot_for_write`'s loop forever.
        let freed = SlotEntry { used: false, ..g.entry };
        self.disk
            .write_at(vec![(self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&freed.encode()))])
            .await?;
        g.entry.used = false;
        g.reset_chunks(Vec::new());
        {
            let mut ix = self.index();
            ix.map.remove(&(blob, tract));
            ix.free.push(slot);
        }
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version: g.entry.written_version,
            offset: 0,
            len: self.layout.tract_size,
            write: None,
            whole_tract: true,
        };
        let marked = self.journal_change(&change).await;
        drop(g);
        self.make_durable(marked?, true).await?;
        Ok(true)
    }

    /// The stored assignment bytes, if any.
    pub async fn assignment(&self) -> Option<Vec<u8>> {
        self.positions.lock().await.1.clone()
    }

    /// Stores assignment bytes durably, alternating positions slots so a
    /// torn write leaves the previous record readable.
    pub async fn save_assignment(&self, payload: &[u8]) -> Result<(), StoreError> {
        let mut p = self.positions.lock().await;
        let seq = p.0 + 1;
        let rec = encode_positions(seq, payload)?;
        self.disk
            .write_at(vec![(self.layout.positions_slot_offset((seq & 1) as u8), Bytes::from(rec))])
            .await?;
        self.disk.sync().await?;
        *p = (seq, Some(payload.to_vec()));
        Ok(())
    }

    /// Where a tract's data starts on the disk, if it is stored here: for
    /// operators inspecting a disk, and for tests that damage one on purpose.
    pub fn data_location(&self, blob: BlobId, tract: TractNo) -> Option<u64> {
        let slot = self.index().map.get(&(blob, tract)).copied()?;
        Some(self.layout.data_offset_of(slot, 0))
    }
}

/// The chunks a change that failed part-way covered, and the journal
/// records it appended for them: what its undo reads back.
struct Changed<'a> {
    first_chunk: u32,
    chunks: u32,
    appended: &'a [Appended],
}

/// Entries `first..first + n` of a slot's chunk entries (unwritten ones
/// past its end, for a slot that holds none).
fn entry_range(chunks: &[ChunkEntry], first: u32, n: u32) -> Vec<ChunkEntry> {
    (first..first + n).map(|c| chunks.get(c as usize).copied().unwrap_or_default()).collect()
}

/// The wire error for a store error: what a request handler answers.
pub(crate) fn store_err(e: StoreError) -> ErrorReply {
    let code = match &e {
        StoreError::OutOfRange { .. } => ErrorCode::OutOfRange,
        StoreError::BadCrc(_) => ErrorCode::BadCrc,
        StoreError::Corrupt { .. } => ErrorCode::Corrupt,
        // A device out of space (ENOSPC) is a full disk too.
        StoreError::DiskFull(_) => ErrorCode::DiskFull,
        StoreError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull => ErrorCode::DiskFull,
        StoreError::Io(_) | StoreError::Failed | StoreError::Layout(_) => ErrorCode::Io,
        StoreError::Superseded => ErrorCode::Aborted,
        StoreError::Journal(_) => ErrorCode::Io,
    };
    ErrorReply::new(code, e.to_string())
}

#[cfg(test)]
mod tests;
