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
//! `journal.rs`). Writes: `write.rs`. Trims and deletes: `unmap.rs`. Reads,
//! digests, repairs and heals of chunks: `chunks.rs`. The backup journal in
//! front of a slow disk: `backup.rs`.
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
use blizzard_core::reconcile::{chunk_digest, ChunkState};
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
mod unmap;
mod write;

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
    /// Records the backup journal's second area took, the first being full.
    pub second_area_records: AtomicU64,
    /// Small writes that went to the data disk directly because every area
    /// of the backup journal was full.
    pub journal_full_writes: AtomicU64,
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

    /// Records `entries` as chunks `first..` once their bytes are on the
    /// disk: memory then knows those chunks' bytes (a write, an unmap).
    fn settle_chunks(&mut self, first: u32, entries: Vec<ChunkEntry>) {
        for (i, e) in entries.into_iter().enumerate() {
            if let Some(c) = self.chunks.get_mut(first as usize + i) {
                *c = e;
            }
            self.unsettled.remove(first + i as u32);
        }
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
    /// A source answers a repair (`CopyTractChanges`) with no changes, so
    /// a member back in a row keeps what it held when it left (`fill`).
    RepairKeepsStale,
    /// Requests are checked against their certificate's role only, not
    /// against the volumes its scope allows (`crate::scope`, design
    /// 0010): any client certificate reads any volume.
    NoScopeCheck,
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
        let journal = [self.backup_journal(), self.backup_second_area()].into_iter().flatten();
        self.disk.preparing_left() + journal.map(|j| j.preparing_left()).sum::<u64>()
    }

    /// Brings the chunk-entry ring into the page cache in the background
    /// ([`Disk::prefetch`]): every change appends a record of at most 512
    /// bytes there, inside a page, and a page not in the cache would be
    /// read from the device first, on a runtime thread. Measured on a new
    /// `blizzard up` (`BLOCKREQ=1 bench/row.sh`, 3-way 4 KiB random writes):
    /// 0.05 synchronous device reads per write before. Call once the
    /// disk's zero-fill is done: its direct writes would drop the pages.
    pub fn prefetch_journal(&self) {
        self.disk.prefetch(self.layout.journal_offset, self.layout.journal_len);
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
