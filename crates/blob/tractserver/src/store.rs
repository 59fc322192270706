//! The tract store: tracts in fixed slots on one disk, all metadata in
//! memory, rebuilt from the disk at start (FDS §2.1).
//!
//! Invariants:
//! - A write is acknowledged only after its data, its chunk entries and (if
//!   new) its slot entry are durable: written, then covered by a group
//!   commit (`commit.rs`).
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
//! Recovery cases at open (each logged):
//!
//! | on disk                                   | treated as                        |
//! |-------------------------------------------|-----------------------------------|
//! | superblock missing                        | unformatted (caller may format)   |
//! | superblock CRC/version/geometry bad       | refuse to start, say why          |
//! | both positions slots invalid              | no assignment yet                 |
//! | one positions slot valid                  | that one                          |
//! | both valid                                | the higher sequence number        |
//! | slot entry all zeros                      | free, generation 0                |
//! | slot entry valid, free                    | free, keeps its generation        |
//! | slot entry valid, used                    | the tract lives here              |
//! | slot entry damaged (CRC)                  | quarantined: never reused; logged |
//! | two used entries for one tract            | higher `alloc_seq` wins, other freed |
//! | chunk entry generation != slot generation | chunk unwritten (reads as zeros)  |
//! | chunk bytes match the entry's previous CRC | the write was cut off before its data: old contents |
//! | chunk bytes match neither CRC             | `Corrupt` (client reads another replica) |
//! | overwrite entry (previous CRC kept)       | unsettled: the first digest reads the bytes; memory takes the CRC they match |
//! | a partial overwrite torn by power loss (entry new, bytes mixed in its range) | `Corrupt`; the same write again merges into the raw bytes to the entry's CRC and makes it whole (`write_with`); any other partial write is refused |
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

use crate::layout::{
    decode_positions, encode_positions, ChunkEntry, Layout, LayoutError, SlotEntry, SlotRecord,
    CHUNK_ENTRY_LEN, POSITIONS_SLOT_LEN, SLOT_ENTRY_LEN, SUPERBLOCK_LEN,
};
use blizzard_env::GroupCommit;

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
    positions: tokio::sync::Mutex<(u64, Option<Vec<u8>>)>,
    pub stats: StoreStats,
}

/// Disk reads during recovery are done in pieces of about this size.
const RECOVERY_READ_BYTES: u64 = 16 << 20;

/// Most unsettled chunks a digest reads from the disk at once (1 MiB).
const DIGEST_READ_CHUNKS: u32 = 256;

impl Store {
    /// Formats `disk` for tracts of `tract_size` bytes, erasing it.
    pub async fn format(
        disk: Arc<dyn Disk>,
        disk_id: TsId,
        tract_size: u32,
        clock: &dyn Clock,
    ) -> Result<Store, StoreError> {
        let mut layout = Layout::plan(disk_id, tract_size, disk.len())?;
        layout.disk_mbps = measure_write_speed(&disk, &layout, clock).await?;
        // Zero the positions, slot table and chunk table: a device reused
        // from an earlier format must not leak its old tenants. The
        // superblock goes last, so a crash mid-format leaves an unformatted
        // disk rather than a half-formatted one.
        let mut at = layout.positions_offset;
        while at < layout.data_offset {
            let n = (layout.data_offset - at).min(RECOVERY_READ_BYTES);
            disk.write_at(vec![(at, Bytes::from(vec![0u8; n as usize]))]).await?;
            at += n;
        }
        disk.sync().await?;
        disk.write_at(vec![(0, Bytes::from(layout.encode_superblock()))]).await?;
        disk.sync().await?;
        tracing::info!(disk = %disk_id, tract_size, slots = layout.slot_count, "formatted disk");
        Self::open(disk).await
    }

    /// Opens a formatted disk and rebuilds all tract metadata from it.
    pub async fn open(disk: Arc<dyn Disk>) -> Result<Store, StoreError> {
        let sb = disk.read_at(0, SUPERBLOCK_LEN as usize).await?;
        let layout = Layout::decode_superblock(&sb, disk.len())?;

        // Positions: the valid record with the higher sequence number.
        let mut positions = (0u64, None);
        for which in 0..2u8 {
            let b = disk.read_at(layout.positions_slot_offset(which), POSITIONS_SLOT_LEN as usize).await?;
            if let Some((seq, payload)) = decode_positions(&b) {
                if positions.1.is_none() || seq > positions.0 {
                    positions = (seq, Some(payload.to_vec()));
                }
            }
        }

        let n = layout.slot_count;
        let mut records = Vec::with_capacity(n as usize);
        let per_read = (RECOVERY_READ_BYTES / SLOT_ENTRY_LEN) as u32;
        let mut s = 0u32;
        while s < n {
            let k = per_read.min(n - s);
            let b = disk.read_at(layout.slot_entry_offset(s), (k as u64 * SLOT_ENTRY_LEN) as usize).await?;
            records.extend(b.chunks_exact(SLOT_ENTRY_LEN as usize).map(SlotEntry::decode));
            s += k;
        }

        let cpt = layout.chunks_per_tract();
        let mut states: Vec<SlotState> = Vec::with_capacity(n as usize);
        let mut index = Index { map: HashMap::new(), free: Vec::new(), next_alloc_seq: 1, quarantined: 0 };
        let per_read = ((RECOVERY_READ_BYTES / (cpt as u64 * CHUNK_ENTRY_LEN)).max(1)) as u32;
        let mut s = 0u32;
        while s < n {
            let k = per_read.min(n - s);
            let b = disk
                .read_at(layout.chunk_entry_offset(s, 0), (k as u64 * cpt as u64 * CHUNK_ENTRY_LEN) as usize)
                .await?;
            for (i, table) in b.chunks_exact((cpt as u64 * CHUNK_ENTRY_LEN) as usize).enumerate() {
                let slot = s + i as u32;
                let chunks: Vec<ChunkEntry> =
                    table.chunks_exact(CHUNK_ENTRY_LEN as usize).map(ChunkEntry::decode).collect();
                let max_chunk_gen = chunks.iter().map(|c| c.generation).max().unwrap_or(0);
                let state = match records[slot as usize] {
                    SlotRecord::Blank => {
                        index.free.push(slot);
                        SlotState {
                            entry: blank_entry(),
                            chunks: Vec::new(),
                            unsettled: ChunkSet::default(),
                            max_generation: max_chunk_gen,
                        }
                    }
                    SlotRecord::Damaged => {
                        // Unknown tenant: never hand this slot out again.
                        tracing::error!(slot, "slot table entry is damaged; quarantining the slot");
                        index.quarantined += 1;
                        SlotState {
                            entry: blank_entry(),
                            chunks: Vec::new(),
                            unsettled: ChunkSet::default(),
                            max_generation: u32::MAX,
                        }
                    }
                    SlotRecord::Valid(e) => {
                        index.next_alloc_seq = index.next_alloc_seq.max(e.alloc_seq + 1);
                        let max_generation = e.generation.max(max_chunk_gen);
                        if e.used {
                            // An overwrite entry keeps the previous CRC
                            // because the write puts it before its data:
                            // cut off in between, the bytes are the old
                            // ones. Which of the two they are, only the
                            // bytes tell (a digest reads them).
                            let mut unsettled = ChunkSet::default();
                            for (c, ce) in chunks.iter().enumerate() {
                                if ce.generation == e.generation
                                    && e.generation != 0
                                    && ce.prev_generation == ce.generation
                                {
                                    unsettled.insert(c as u32);
                                }
                            }
                            SlotState { entry: e, chunks, unsettled, max_generation }
                        } else {
                            index.free.push(slot);
                            SlotState {
                                entry: e,
                                chunks: Vec::new(),
                                unsettled: ChunkSet::default(),
                                max_generation,
                            }
                        }
                    }
                };
                states.push(state);
            }
            s += k;
        }
        // Map tracts to slots; two used entries for one tract means a crash
        // between freeing one and reallocating the tract elsewhere: the
        // later allocation is the live one.
        for slot in 0..states.len() {
            let e = states[slot].entry;
            if !e.used {
                continue;
            }
            let key = (e.blob, e.tract);
            let loser = match index.map.get(&key).copied() {
                None => None,
                Some(other) if states[other as usize].entry.alloc_seq > e.alloc_seq => Some(slot as u32),
                Some(other) => Some(other),
            };
            if let Some(l) = loser {
                tracing::warn!(blob = %e.blob, tract = %e.tract, slot = l, "two slots hold one tract; freeing the older");
                let st = &mut states[l as usize];
                st.entry.used = false;
                st.reset_chunks(Vec::new());
                index.free.push(l);
            }
            if loser != Some(slot as u32) {
                index.map.insert(key, slot as u32);
            }
        }
        let slots: Vec<RwLock<SlotState>> = states.into_iter().map(RwLock::new).collect();
        index.free.sort_unstable_by(|a, b| b.cmp(a));
        tracing::info!(
            disk = %layout.disk_id,
            slots = n,
            used = index.map.len(),
            quarantined = index.quarantined,
            "opened tract store"
        );
        Ok(Store {
            writers: tokio::sync::Semaphore::new(DISK_WRITERS_MAX),
            planted: std::sync::atomic::AtomicU8::new(0),
            commit: GroupCommit::new(disk.clone()),
            disk,
            layout,
            index: Mutex::new(index),
            slots,
            positions: tokio::sync::Mutex::new(positions),
            stats: StoreStats::default(),
        })
    }

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
        self.disk.preparing_left()
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
        first_chunk: u32,
        chunks: u32,
    ) {
        let meant = g.entry;
        let read = async {
            let record = if entry_dirty {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks).await?;
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
        first_chunk: u32,
        chunks: u32,
    ) {
        let read = async {
            let record = if freeing {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks).await?;
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

    /// Chunk entries `first..first + n` of a slot and the data of those
    /// chunks, as the disk holds them now.
    async fn read_back(&self, slot: u32, first: u32, n: u32) -> io::Result<(Vec<ChunkEntry>, Bytes)> {
        let table = self
            .disk
            .read_at(self.layout.chunk_entry_offset(slot, first), (n as u64 * CHUNK_ENTRY_LEN) as usize)
            .await?;
        let entries = table.chunks_exact(CHUNK_ENTRY_LEN as usize).map(ChunkEntry::decode).collect();
        let data = self
            .disk
            .read_at(self.layout.data_offset_of(slot, first * CHUNK_SIZE), (n * CHUNK_SIZE) as usize)
            .await?;
        Ok((entries, data))
    }

    /// Reads an unsettled chunk's bytes and settles memory to them
    /// ([`settle`]): returns their CRC, or `None` if its entry accepts no
    /// CRC they have (the chunk stays unsettled).
    async fn settle_from_disk(
        &self,
        slot: u32,
        g: &mut SlotState,
        chunk: u32,
    ) -> Result<Option<u32>, StoreError> {
        let at = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
        let b = self.disk.read_at(at, CHUNK_SIZE as usize).await?;
        let crc = crc32c(&b);
        Ok(match settle(g, chunk, crc) {
            ChunkState::Data(c) => Some(c),
            ChunkState::Hole | ChunkState::Unreadable => None,
        })
    }

    async fn read_chunk_verified(
        &self,
        slot: u32,
        st: &SlotState,
        chunk: u32,
    ) -> Result<(Bytes, u32), StoreError> {
        let e = st.chunks.get(chunk as usize).copied().unwrap_or_default();
        if e.generation != st.entry.generation || e.generation == 0 {
            return Ok((Bytes::from(vec![0u8; CHUNK_SIZE as usize]), zeros_crc(CHUNK_SIZE as usize)));
        }
        let b = self
            .disk
            .read_at(self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), CHUNK_SIZE as usize)
            .await?;
        let crc = crc32c(&b);
        if !e.accepts(crc) {
            self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Corrupt { slot, chunk });
        }
        Ok((b, crc))
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
                        let raw = self.disk.read_at(at_disk, CHUNK_SIZE as usize).await?;
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
        let mut table = Vec::with_capacity(new_entries.len() * CHUNK_ENTRY_LEN as usize);
        for e in &new_entries {
            e.encode_into(&mut table);
        }
        let mut writes = first;
        writes.push((self.layout.chunk_entry_offset(slot, first_chunk), Bytes::from(table)));
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
                first_chunk,
                new_entries.len() as u32,
            )
            .await;
            return Err(e.into());
        }
        // Memory now knows every written chunk's bytes: the new ones.
        for (i, e) in new_entries.into_iter().enumerate() {
            if let Some(c) = g.chunks.get_mut(first_chunk as usize + i) {
                *c = e;
            }
            g.unsettled.remove(first_chunk + i as u32);
        }
        drop(g);
        // Durable before acknowledged: wait for a group commit that started
        // after our writes completed.
        if durability == Durability::Synced && !self.planted(PlantedBug::AckBeforeSync) {
            self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        }
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Reads `[offset, offset + len)` of a tract: the bytes and one CRC32C
    /// per piece. Never-written ranges (and tracts of another incarnation)
    /// read as zeros. A chunk found `Corrupt` becomes unsettled: memory no
    /// longer vouches for its bytes, so the next digest reads them.
    pub async fn read(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
    ) -> Result<(Bytes, Vec<u32>), StoreError> {
        let r = self.read_verified(blob, incarnation, tract, offset, len).await;
        if let Err(StoreError::Corrupt { slot, chunk }) = &r {
            if let Some(cell) = self.slots.get(*slot as usize) {
                let mut g = cell.write().await;
                let gen = g.entry.generation;
                if g.entry.used
                    && g.entry.blob == blob
                    && g.entry.tract == tract
                    && g.entry.incarnation == incarnation
                    && g.chunks.get(*chunk as usize).is_some_and(|e| e.generation == gen && gen != 0)
                {
                    g.unsettled.insert(*chunk);
                }
            }
        }
        r
    }

    async fn read_verified(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
    ) -> Result<(Bytes, Vec<u32>), StoreError> {
        self.check_range(offset, len)?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        let slot = self.index().map.get(&(blob, tract)).copied();
        let first_chunk = offset / CHUNK_SIZE;
        let last_chunk = (offset + len - 1) / CHUNK_SIZE;
        let span_start = first_chunk * CHUNK_SIZE;
        let span_len = (last_chunk - first_chunk + 1) * CHUNK_SIZE;

        let mut buf: Option<Bytes> = None;
        let mut chunk_crcs: Vec<Option<u32>> = vec![None; (last_chunk - first_chunk + 1) as usize];
        if let Some(slot) = slot {
            if let Some(cell) = self.slots.get(slot as usize) {
                let g = cell.read().await;
                if g.entry.used
                    && g.entry.blob == blob
                    && g.entry.tract == tract
                    && g.entry.incarnation == incarnation
                {
                    let gen = g.entry.generation;
                    let valid: Vec<Option<ChunkEntry>> = (first_chunk..=last_chunk)
                        .map(|c| {
                            g.chunks.get(c as usize).filter(|e| e.generation == gen && gen != 0).copied()
                        })
                        .collect();
                    if valid.iter().any(Option::is_some) {
                        let raw = self
                            .disk
                            .read_at(self.layout.data_offset_of(slot, span_start), span_len as usize)
                            .await?;
                        // Each written chunk must hold what its entry allows:
                        // the latest write, or the one before it if that
                        // write was cut off before its data.
                        let mut actual: Vec<Option<u32>> = Vec::with_capacity(valid.len());
                        for (i, e) in valid.iter().enumerate() {
                            let range = i * CHUNK_SIZE as usize..(i + 1) * CHUNK_SIZE as usize;
                            actual.push(match e {
                                Some(e) => {
                                    let c = crc32c(&raw[range]);
                                    if !e.accepts(c) {
                                        self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                                        return Err(StoreError::Corrupt {
                                            slot,
                                            chunk: first_chunk + i as u32,
                                        });
                                    }
                                    Some(c)
                                }
                                None => None,
                            });
                        }
                        // Chunks never written hold whatever the slot's last
                        // tenant left: they read as zeros.
                        let b = if valid.iter().all(Option::is_some) {
                            raw
                        } else {
                            let mut m = bytes::BytesMut::from(&raw[..]);
                            for (i, crc) in valid.iter().enumerate() {
                                if crc.is_none() {
                                    m[i * CHUNK_SIZE as usize..(i + 1) * CHUNK_SIZE as usize].fill(0);
                                }
                            }
                            m.freeze()
                        };
                        chunk_crcs = actual;
                        buf = Some(b);
                    }
                }
            }
        }
        let rel = (offset - span_start) as usize;
        let data = match buf {
            Some(b) => b.slice(rel..rel + len as usize),
            None => Bytes::from(vec![0u8; len as usize]),
        };
        // A whole chunk goes back under the CRC its writer computed; a part
        // of one gets a CRC of just that part, computed from verified bytes.
        let crcs = pieces(offset, len)
            .map(|(s, e)| {
                let chunk = ((offset + s as u32) / CHUNK_SIZE - first_chunk) as usize;
                match chunk_crcs.get(chunk).copied().flatten() {
                    Some(c) if e - s == CHUNK_SIZE as usize => c,
                    Some(_) => crc32c(&data[s..e]),
                    None => zeros_crc(e - s),
                }
            })
            .collect();
        Ok((data, crcs))
    }

    /// What this replica holds in each chunk of a tract, for making the
    /// tract's replicas agree (`blizzard_core::reconcile`): `Hole` for a
    /// chunk not written (or trimmed), `Data` with the CRC32C of the bytes
    /// it holds now, `Unreadable` for bytes matching no CRC its entry
    /// accepts. Empty if the tract is not held here at `incarnation`.
    ///
    /// Under the slot's write lock, so every change admitted before it has
    /// finished, and none runs meanwhile. Memory knows the bytes of every
    /// chunk this process wrote; only unsettled chunks (an overwrite found
    /// at open, which a crash may have cut off before its data) are read,
    /// once: memory then settles to what they hold.
    pub async fn digest(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
    ) -> Result<Vec<ChunkState>, StoreError> {
        self.stats.digests.fetch_add(1, Ordering::Relaxed);
        // A failed disk's memory may say what no restart would read (writes
        // a failed `fdatasync` dropped, a failed write not read back).
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else { return Ok(Vec::new()) };
        let Some(cell) = self.slots.get(slot as usize) else { return Ok(Vec::new()) };
        let mut g = cell.write().await;
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(Vec::new());
        }
        let gen = g.entry.generation;
        let written = |e: &ChunkEntry| e.generation == gen && gen != 0;
        let mut out: Vec<ChunkState> = g
            .chunks
            .iter()
            .map(|e| if written(e) { ChunkState::Data(e.crc) } else { ChunkState::Hole })
            .collect();
        if g.unsettled.is_empty() {
            return Ok(out);
        }
        // Runs of unsettled written chunks, one disk read per run (at most
        // DIGEST_READ_CHUNKS long).
        let chunks = out.len() as u32;
        let unsettled = |g: &SlotState, out: &[ChunkState], c: u32| {
            g.unsettled.contains(c) && out[c as usize] != ChunkState::Hole
        };
        let mut c = 0u32;
        while c < chunks {
            if !unsettled(&g, &out, c) {
                // An unwritten chunk has no bytes to settle.
                g.unsettled.remove(c);
                c += 1;
                continue;
            }
            let start = c;
            while c < chunks && c - start < DIGEST_READ_CHUNKS && unsettled(&g, &out, c) {
                c += 1;
            }
            let n = c - start;
            let b = self
                .disk
                .read_at(self.layout.data_offset_of(slot, start * CHUNK_SIZE), (n * CHUNK_SIZE) as usize)
                .await?;
            self.stats.digest_chunks_read.fetch_add(n as u64, Ordering::Relaxed);
            for (i, bytes) in b.chunks_exact(CHUNK_SIZE as usize).enumerate() {
                let chunk = start + i as u32;
                out[chunk as usize] = settle(&mut g, chunk, crc32c(bytes));
            }
        }
        Ok(out)
    }

    /// For [`Store::repair_chunk`] and [`Store::heal_chunk`]: the slot of a
    /// tract stored here at `incarnation`, write-locked (no client write to
    /// the tract runs meanwhile), with chunk `chunk`'s entry, where its data
    /// lies and what it holds now. `None` if the tract is not stored here at
    /// that incarnation, the chunk was never written, or `len` is not one
    /// chunk.
    async fn lock_written_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        len: usize,
    ) -> Result<Option<LockedChunk<'_>>, StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        if len != CHUNK_SIZE as usize || chunk >= self.layout.chunks_per_tract() {
            return Ok(None);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else { return Ok(None) };
        let Some(cell) = self.slots.get(slot as usize) else { return Ok(None) };
        let g = cell.write().await;
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(None);
        }
        let gen = g.entry.generation;
        let Some(entry) = g.chunks.get(chunk as usize).copied().filter(|e| e.generation == gen && gen != 0)
        else {
            return Ok(None);
        };
        let at = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
        let now = self.disk.read_at(at, CHUNK_SIZE as usize).await?;
        Ok(Some(LockedChunk { slot, g, entry, at, now }))
    }

    /// Rewrites chunk `chunk` of a tract whose stored bytes fail their CRC
    /// (bit rot) with `data` from another replica. Only bytes this chunk's
    /// entry expects are accepted: a replica holding other contents (a
    /// write that reached it and not yet this server) must not replace
    /// ours, and a chunk rewritten since it was found damaged is left
    /// alone. Returns whether the chunk was repaired; durable on return.
    pub async fn repair_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        data: Bytes,
        allow_prev: bool,
    ) -> Result<bool, StoreError> {
        let Some(LockedChunk { mut g, entry: e, at, now, .. }) =
            self.lock_written_chunk(blob, incarnation, tract, chunk, data.len()).await?
        else {
            return Ok(false);
        };
        // The chunk's current contents; the previous ones (which the entry
        // also accepts, for a write cut off by a crash) only if the caller
        // says so: a replica holding those may just not have applied the
        // latest write yet, and installing them would take that write back.
        let crc = crc32c(&data);
        if e.accepts(crc32c(&now)) || !(crc == e.crc || (allow_prev && e.accepts(crc))) {
            return Ok(false);
        }
        {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(vec![(at, data)]).await?;
        }
        // Memory knows the bytes now (the previous contents, if those).
        settle(&mut g, chunk, crc);
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        self.stats.repaired_chunks.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Gives a chunk this server cannot read (its bytes match no CRC its
    /// entry accepts) the contents `data`, taken from a complete replica,
    /// so that partial writes can merge into it again (`TractService::
    /// heal_chunk` says why that is safe). Under the slot lock; does nothing
    /// and returns false if the chunk reads fine by now (healed, rewritten)
    /// or the tract is not stored here at `incarnation`. Durable on return.
    pub async fn heal_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        data: Bytes,
    ) -> Result<bool, StoreError> {
        // An unwritten chunk reads as zeros: nothing to heal.
        let Some(LockedChunk { slot, mut g, entry: e, at, now }) =
            self.lock_written_chunk(blob, incarnation, tract, chunk, data.len()).await?
        else {
            return Ok(false);
        };
        if e.accepts(crc32c(&now)) {
            return Ok(false);
        }
        let healed =
            ChunkEntry { crc: crc32c(&data), generation: e.generation, prev_crc: 0, prev_generation: 0 };
        let mut entry = Vec::with_capacity(CHUNK_ENTRY_LEN as usize);
        healed.encode_into(&mut entry);
        // Data, then entry: cut off in between, the chunk is as unreadable
        // as before. Memory changes only once both are on disk.
        {
            let _slot = self.writers.acquire().await;
            self.disk
                .write_at(vec![(at, data), (self.layout.chunk_entry_offset(slot, chunk), Bytes::from(entry))])
                .await?;
        }
        if let Some(c) = g.chunks.get_mut(chunk as usize) {
            *c = healed;
        }
        g.unsettled.remove(chunk);
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        self.stats.repaired_chunks.fetch_add(1, Ordering::Relaxed);
        Ok(true)
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
        let mut table = Vec::with_capacity(new_entries.len() * CHUNK_ENTRY_LEN as usize);
        for e in &new_entries {
            e.encode_into(&mut table);
        }
        writes.insert(0, (self.layout.chunk_entry_offset(slot, first_chunk), Bytes::from(table)));
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
            self.undo_failed_trim(slot, &mut g, (blob, tract), empty, first_chunk, new_entries.len() as u32)
                .await;
            return Err(e.into());
        }
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
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
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
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
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

/// Times a synced sequential write over the (still empty) data region, for
/// weighting the 1-way TLT by disk speed (FDS §2.2).
async fn measure_write_speed(
    disk: &Arc<dyn Disk>,
    layout: &Layout,
    clock: &dyn Clock,
) -> Result<u32, StoreError> {
    let room = layout.slot_count as u64 * layout.tract_size as u64;
    let total = room.min(64 << 20);
    let piece = total.min(8 << 20);
    if piece == 0 {
        return Ok(0);
    }
    let buf = Bytes::from(vec![0u8; piece as usize]);
    let start = clock.now();
    let mut at = 0;
    while at + piece <= total {
        disk.write_at(vec![(layout.data_offset + at, buf.clone())]).await?;
        at += piece;
    }
    disk.sync().await?;
    let secs = clock.now().duration_since(start).as_secs_f64();
    Ok(if secs > 0.0 { ((at as f64 / 1e6) / secs).min(u32::MAX as f64) as u32 } else { 0 })
}

/// Makes memory hold the chunk entries `entries` of chunks `first..`, read
/// from the disk with the chunks' bytes `data`, as open and a first digest
/// would take them: an entry that counts (the slot's generation) is
/// settled against its bytes ([`settle`]), one that does not is a hole.
fn take_from_disk(g: &mut SlotState, first: u32, entries: &[ChunkEntry], data: &[u8]) {
    let gen = g.entry.generation;
    for (i, (d, bytes)) in entries.iter().zip(data.chunks_exact(CHUNK_SIZE as usize)).enumerate() {
        let chunk = first + i as u32;
        let Some(c) = g.chunks.get_mut(chunk as usize) else { continue };
        *c = *d;
        if d.generation == gen && gen != 0 {
            settle(g, chunk, crc32c(bytes));
        } else {
            g.unsettled.remove(chunk);
        }
    }
}

/// What a written chunk whose bytes have CRC `crc` holds, making memory
/// say so: an entry accepting `crc` as its previous contents becomes
/// `settled_to(crc)` (a write cut off before its data), and the chunk
/// leaves the unsettled set; bytes the entry does not accept leave the
/// chunk `Unreadable` and unsettled.
fn settle(g: &mut SlotState, chunk: u32, crc: u32) -> ChunkState {
    let Some(e) = g.chunks.get_mut(chunk as usize) else { return ChunkState::Hole };
    if crc != e.crc {
        if !e.accepts(crc) {
            g.unsettled.insert(chunk);
            return ChunkState::Unreadable;
        }
        *e = e.settled_to(crc);
    }
    g.unsettled.remove(chunk);
    ChunkState::Data(crc)
}

fn blank_entry() -> SlotEntry {
    SlotEntry {
        used: false,
        generation: 0,
        blob: BlobId(0),
        incarnation: 0,
        tract: TractNo(0),
        written_version: 0,
        alloc_seq: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::crc::piece_crcs;
    use blizzard_env::Env;

    const TRACT: u32 = 64 << 10;

    async fn fresh(dir: &tempfile::TempDir, disk_len: u64) -> Result<Store, StoreError> {
        let disk = Env::real().open_disk(&dir.path().join("disk"), Some(disk_len)).await?;
        Store::format(disk, TsId(7), TRACT, &blizzard_env::RealClock).await
    }

    async fn reopen(dir: &tempfile::TempDir) -> Result<Store, StoreError> {
        let disk = Env::real().open_disk(&dir.path().join("disk"), None).await?;
        Store::open(disk).await
    }

    /// A disk whose owner is killed part-way through a write batch: after
    /// `armed` is set, the next `write_at` applies only its first `keep`
    /// pieces (in order, as the kernel would) and the rest never happen.
    struct DyingDisk {
        inner: Arc<dyn Disk>,
        armed: std::sync::atomic::AtomicBool,
        keep: usize,
    }

    impl Disk for DyingDisk {
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn read_at(
            &self,
            offset: u64,
            len: usize,
        ) -> futures::future::BoxFuture<'static, std::io::Result<Bytes>> {
            self.inner.read_at(offset, len)
        }
        fn write_at(
            &self,
            writes: Vec<(u64, Bytes)>,
        ) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
            if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let kept: Vec<_> = writes.into_iter().take(self.keep).collect();
                let inner = self.inner.clone();
                return Box::pin(async move {
                    inner.write_at(kept).await?;
                    inner.sync().await?;
                    Err(std::io::Error::other("killed"))
                });
            }
            self.inner.write_at(writes)
        }
        fn sync(&self) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
            self.inner.sync()
        }
    }

    /// A process killed between the pieces of a write leaves every chunk
    /// readable as its old or its new contents, never `Corrupt`: for
    /// overwrites (whole and partial chunks) and for first writes, at every
    /// cut point.
    #[tokio::test]
    async fn write_cut_off_part_way_reads_old_or_new() -> Result<(), StoreError> {
        let old = pattern(1, TRACT as usize);
        let new = pattern(2, TRACT as usize);
        // (offset, len) of the interrupted write: whole chunks, a partial
        // chunk, and a range that also covers never-written chunks.
        for (off, len) in [(0u32, 16384u32), (4100, 100), (12288, 8192 + 40000)] {
            for keep in 0..4 {
                let dir = tempfile::tempdir()?;
                let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
                let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
                let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
                // The old contents: the first 32 KiB written and durable.
                put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
                disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
                let piece = new.slice(off as usize..(off + len) as usize);
                assert!(put(&s, 1, 1, 3, off, &piece).await.is_err(), "the write was cut off");
                drop(s);
                drop(disk);
                let s = reopen(&dir).await?;
                let got = get(&s, 1, 1, 3, 0, TRACT).await?;
                let mut before = vec![0u8; TRACT as usize];
                before[..32768].copy_from_slice(&old[..32768]);
                let mut after = before.clone();
                after[off as usize..(off + len) as usize].copy_from_slice(&piece);
                for c in 0..(TRACT / CHUNK_SIZE) as usize {
                    let r = c * CHUNK_SIZE as usize..(c + 1) * CHUNK_SIZE as usize;
                    assert!(
                        got[r.clone()] == before[r.clone()] || got[r.clone()] == after[r.clone()],
                        "write [{off}, +{len}) cut after {keep} pieces: chunk {c} is neither old nor new"
                    );
                }
            }
        }
        Ok(())
    }

    /// A write the disk fails part-way (ENOSPC on a full device, EIO) while
    /// the server lives on: memory must still describe the disk. Every chunk
    /// reads old or new at once (never `Corrupt`), the retried write
    /// succeeds, and after a restart its tract is there: a fresh slot whose
    /// first write failed was once kept in memory as if its slot entry were
    /// stored, so the retry skipped the entry and the tract vanished on
    /// restart. A trim or delete failing the same way leaves the tract
    /// writable (a slot freed in memory before the disk once sent every
    /// later write round a loop forever).
    #[tokio::test]
    async fn a_failed_write_leaves_memory_true_to_the_disk() -> Result<(), StoreError> {
        let old = pattern(1, TRACT as usize);
        let new = pattern(2, TRACT as usize);
        for (off, len) in [(0u32, 16384u32), (4100, 100), (12288, 8192 + 40000)] {
            for keep in 0..4 {
                let what = format!("write [{off}, +{len}) failing after {keep} pieces");
                let dir = tempfile::tempdir()?;
                let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
                let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
                let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
                put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
                let piece = new.slice(off as usize..(off + len) as usize);
                // An overwrite and a first write into a fresh slot, both failing.
                for tract in [3, 4] {
                    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
                    assert!(put(&s, 1, 1, tract, off, &piece).await.is_err(), "{what}: not failed");
                }
                let mut before = vec![0u8; TRACT as usize];
                before[..32768].copy_from_slice(&old[..32768]);
                let mut after = before.clone();
                after[off as usize..(off + len) as usize].copy_from_slice(&piece);
                let got = get(&s, 1, 1, 3, 0, TRACT).await.map_err(|e| {
                    StoreError::Io(std::io::Error::other(format!("{what}: read after the failure: {e}")))
                })?;
                for c in 0..(TRACT / CHUNK_SIZE) as usize {
                    let r = c * CHUNK_SIZE as usize..(c + 1) * CHUNK_SIZE as usize;
                    assert!(
                        got[r.clone()] == before[r.clone()] || got[r.clone()] == after[r.clone()],
                        "{what}: chunk {c} is neither old nor new"
                    );
                }
                // The retries succeed, and a restart finds both tracts whole.
                for tract in [3, 4] {
                    put(&s, 1, 1, tract, off, &piece).await?;
                }
                drop(s);
                drop(disk);
                let s = reopen(&dir).await?;
                assert!(
                    get(&s, 1, 1, 3, 0, TRACT).await? == after,
                    "{what}: tract 3 is not the retried write"
                );
                let mut fresh = vec![0u8; TRACT as usize];
                fresh[off as usize..(off + len) as usize].copy_from_slice(&piece);
                assert!(get(&s, 1, 1, 4, 0, TRACT).await? == fresh, "{what}: tract 4 lost");
            }
        }
        // A failed trim of a whole tract and a failed delete: the tract
        // stays, still writable.
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 0 });
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        put(&s, 1, 1, 0, 0, &old).await?;
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(s.trim(BlobId(1), 1, TractNo(0), 0, TRACT, ALWAYS).await.is_err());
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(s.delete(BlobId(1), 1, TractNo(0)).await.is_err());
        assert!(get(&s, 1, 1, 0, 0, TRACT).await? == old, "the failed trim or delete changed the tract");
        let written =
            Env::real().timeout(std::time::Duration::from_secs(10), put(&s, 1, 1, 0, 0, &new)).await;
        assert!(matches!(written, Ok(Ok(()))), "a write after the failed trim and delete: {written:?}");
        assert!(get(&s, 1, 1, 0, 0, TRACT).await? == new, "the write after the failed trim and delete");
        Ok(())
    }

    /// A disk that runs out of space: once armed, the next `write_at`
    /// stores its first `keep` pieces whole and the first `cut` bytes of
    /// the next one, then fails with ENOSPC (the server lives on). A piece
    /// below `whole_below` (a slot entry: one sector) is never cut. While
    /// `reads_fail`, every read fails.
    struct FullDisk {
        inner: Arc<dyn Disk>,
        armed: std::sync::atomic::AtomicBool,
        keep: usize,
        cut: usize,
        whole_below: AtomicU64,
        reads_fail: std::sync::atomic::AtomicBool,
    }

    impl FullDisk {
        fn new(inner: Arc<dyn Disk>, keep: usize, cut: usize) -> Arc<FullDisk> {
            Arc::new(FullDisk {
                inner,
                armed: false.into(),
                keep,
                cut,
                whole_below: AtomicU64::new(0),
                reads_fail: false.into(),
            })
        }
        fn arm(&self) {
            self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    impl Disk for FullDisk {
        fn len(&self) -> u64 {
            self.inner.len()
        }
        fn read_at(
            &self,
            offset: u64,
            len: usize,
        ) -> futures::future::BoxFuture<'static, std::io::Result<Bytes>> {
            if self.reads_fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Box::pin(async { Err(std::io::Error::other("injected read error")) });
            }
            self.inner.read_at(offset, len)
        }
        fn write_at(
            &self,
            writes: Vec<(u64, Bytes)>,
        ) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
            if !self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                return self.inner.write_at(writes);
            }
            let mut kept: Vec<(u64, Bytes)> = writes.iter().take(self.keep).cloned().collect();
            if let Some((at, d)) = writes.get(self.keep) {
                if self.cut > 0 && *at >= self.whole_below.load(Ordering::SeqCst) {
                    kept.push((*at, d.slice(..self.cut.min(d.len()))));
                }
            }
            let inner = self.inner.clone();
            Box::pin(async move {
                inner.write_at(kept).await?;
                Err(std::io::Error::from_raw_os_error(28))
            })
        }
        fn sync(&self) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
            self.inner.sync()
        }
    }

    /// What the store says about tracts 3 and 4 of blob 1 at incarnations
    /// 1 and 2: the tracts held, and the digests once every chunk was read
    /// (a restart trusts a first write's entry without reading its bytes
    /// until a read finds them corrupt; memory after a failed write may
    /// know better).
    async fn view(s: &Store) -> Result<Vec<String>, StoreError> {
        let mut v = vec![format!("tracts {:?}", s.tracts())];
        for tract in [3, 4] {
            for inc in [1, 2] {
                for c in 0..TRACT / CHUNK_SIZE {
                    let _ = s.read(BlobId(1), inc, TractNo(tract), c * CHUNK_SIZE, CHUNK_SIZE).await;
                }
                v.push(format!(
                    "tract {tract} inc {inc}: {:?}",
                    s.digest(BlobId(1), inc, TractNo(tract)).await?
                ));
            }
        }
        Ok(v)
    }

    /// A write or trim the disk fails part-way (ENOSPC after any prefix of
    /// its pieces, the last one perhaps cut short) while the server lives
    /// on leaves memory saying what a restart reads: the digests before and
    /// after a reopen are the same, at every cut. Once, a first-written
    /// chunk whose data and entry were both stored stayed unwritten in
    /// memory: the replicas were reconciled on that view, and a restart
    /// brought the unacknowledged write back on this replica alone.
    #[tokio::test]
    async fn a_failed_change_leaves_memory_as_a_restart_reads_it() -> Result<(), StoreError> {
        let old = pattern(1, TRACT as usize);
        let new = pattern(2, TRACT as usize);
        enum Change {
            /// (tract, incarnation, row version, offset, len)
            Write(i64, u64, u64, u32, u32),
            /// (offset, len) of tract 3
            Trim(u32, u32),
        }
        let changes = [
            // Overwrites: whole chunks, part of one, and overwritten and
            // first-written chunks at once.
            Change::Write(3, 1, 1, 0, 16384),
            Change::Write(3, 1, 1, 4100, 100),
            Change::Write(3, 1, 1, 12288, 8192 + 40000),
            // First writes into the tract's slot: whole chunks, part of one.
            Change::Write(3, 1, 1, 40960, 8192),
            Change::Write(3, 1, 1, 40960 + 100, 50),
            // A first write that changes the slot entry (a newer row version).
            Change::Write(3, 1, 2, 40960, 4096),
            // A fresh slot, and a new incarnation of the blob.
            Change::Write(4, 1, 1, 0, 8192),
            Change::Write(3, 2, 1, 0, 8192),
            // Trims: whole chunks, partial ones, and the whole tract (the
            // slot entry freed last).
            Change::Trim(4096, 8192),
            Change::Trim(100, 5000),
            Change::Trim(0, TRACT),
        ];
        for (n, change) in changes.iter().enumerate() {
            for keep in 0..5 {
                for cut in [0, 16, 4096 + 512] {
                    let what = format!("change {n} failing after {keep} pieces and {cut} bytes");
                    let dir = tempfile::tempdir()?;
                    let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
                    let disk = FullDisk::new(real, keep, cut);
                    let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
                    disk.whole_below.store(s.layout().chunk_table_offset, Ordering::SeqCst);
                    put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
                    disk.arm();
                    let r = match *change {
                        Change::Write(tract, inc, version, off, len) => {
                            let d = new.slice(off as usize..(off + len) as usize);
                            let crcs = piece_crcs(off, &d);
                            s.write(BlobId(1), inc, TractNo(tract), version, off, d, &crcs).await
                        }
                        Change::Trim(off, len) => s.trim(BlobId(1), 1, TractNo(3), off, len, ALWAYS).await,
                    };
                    assert!(r.is_err(), "{what}: not failed");
                    let live = view(&s).await?;
                    drop(s);
                    drop(disk);
                    let s = reopen(&dir).await?;
                    assert_eq!(live, view(&s).await?, "{what}: memory before the restart, the disk after");
                }
            }
        }
        Ok(())
    }

    /// A failed write whose pieces cannot be read back leaves memory unable
    /// to say what the disk holds: the store refuses digests (and changes)
    /// from then on rather than answer from a view a restart could
    /// contradict.
    #[tokio::test]
    async fn a_failed_write_that_cannot_be_read_back_distrusts_the_disk() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        // The first write's data and its entry are stored, then it fails.
        let disk = FullDisk::new(real, 2, 0);
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        put(&s, 1, 1, 3, 0, &pattern(1, 8192)).await?;
        disk.arm();
        disk.reads_fail.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(put(&s, 1, 1, 3, 40960, &pattern(2, 8192)).await.is_err());
        disk.reads_fail.store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(matches!(s.digest(BlobId(1), 1, TractNo(3)).await, Err(StoreError::Failed)));
        assert!(matches!(put(&s, 1, 1, 3, 0, &pattern(3, 4096)).await, Err(StoreError::Failed)));
        assert!(matches!(s.sync().await, Err(StoreError::Failed)));
        // A restart reads the disk afresh: the first write's data and entry
        // are both there.
        drop(s);
        drop(disk);
        let s = reopen(&dir).await?;
        assert_eq!(get(&s, 1, 1, 3, 40960, 8192).await?, pattern(2, 8192));
        Ok(())
    }

    /// A partial overwrite torn by power loss (its entry stored, its merged
    /// chunk only in part: the range holds a mix of old and new bytes) leaves
    /// the chunk `Corrupt`. The writer, whose sync failed, writes the same
    /// range again: merged into the torn bytes it gives exactly the chunk
    /// the entry names, so it is accepted and the chunk reads whole again.
    /// Once, it was refused for good (nothing to merge with), and with one
    /// replica nothing could heal the chunk: a fast-ack volume retried an
    /// acknowledged write forever. Another write into the torn chunk is
    /// still refused.
    #[tokio::test]
    async fn a_torn_partial_write_is_completed_by_the_same_write_again() -> Result<(), StoreError> {
        let old = pattern(1, 4 * CHUNK_SIZE as usize);
        // Bytes 400..700 of chunk 1: across its first two sectors.
        let off = CHUNK_SIZE + 400;
        let w = pattern(2, 300);
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        // The overwrite's pieces: its chunk entry, then the merged chunk, of
        // which only the first sector lands.
        let disk = FullDisk::new(real, 1, 512);
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        put(&s, 1, 1, 3, 0, &old).await?;
        disk.arm();
        assert!(put(&s, 1, 1, 3, off, &w).await.is_err(), "the write was cut off");
        drop(s);
        drop(disk);
        let s = reopen(&dir).await?;
        assert!(
            matches!(
                get(&s, 1, 1, 3, CHUNK_SIZE, CHUNK_SIZE).await,
                Err(StoreError::Corrupt { chunk: 1, .. })
            ),
            "the torn chunk reads as corrupt"
        );
        // Other writes into the torn chunk cannot be merged.
        for (o, d) in [(off, pattern(3, 300)), (off, pattern(2, 299)), (CHUNK_SIZE + 1000, pattern(4, 10))] {
            let r = put(&s, 1, 1, 3, o, &d).await;
            assert!(matches!(r, Err(StoreError::Corrupt { chunk: 1, .. })), "{o} +{}: {r:?}", d.len());
        }
        // The cut-off write again completes it.
        put(&s, 1, 1, 3, off, &w).await?;
        let mut want = old.to_vec();
        want[off as usize..off as usize + w.len()].copy_from_slice(&w);
        assert_eq!(get(&s, 1, 1, 3, 0, 4 * CHUNK_SIZE).await?, want);
        let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
        assert_eq!(d[1], ChunkState::Data(chunk_crc(&want, 1)));
        // And the chunk takes other writes again, and all of it survives a
        // restart.
        put(&s, 1, 1, 3, CHUNK_SIZE + 1000, &pattern(4, 10)).await?;
        want[CHUNK_SIZE as usize + 1000..CHUNK_SIZE as usize + 1010].copy_from_slice(&pattern(4, 10));
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(get(&s, 1, 1, 3, 0, 4 * CHUNK_SIZE).await?, want);
        Ok(())
    }

    fn pattern(seed: u8, len: usize) -> Bytes {
        Bytes::from((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>())
    }

    async fn put(
        s: &Store,
        blob: u128,
        inc: u64,
        tract: i64,
        off: u32,
        data: &Bytes,
    ) -> Result<(), StoreError> {
        s.write(BlobId(blob), inc, TractNo(tract), 1, off, data.clone(), &piece_crcs(off, data)).await
    }

    async fn get(
        s: &Store,
        blob: u128,
        inc: u64,
        tract: i64,
        off: u32,
        len: u32,
    ) -> Result<Bytes, StoreError> {
        let (b, crcs) = s.read(BlobId(blob), inc, TractNo(tract), off, len).await?;
        // What the store returns must verify end to end.
        assert_eq!(blizzard_core::crc::first_bad_piece(off, &b, &crcs), None);
        Ok(b)
    }

    /// Aligned, unaligned and overlapping writes read back byte-exact, with
    /// unwritten ranges as zeros, and all of it survives a reopen.
    #[tokio::test]
    async fn writes_read_back_and_survive_reopen() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        let mut model = vec![0u8; TRACT as usize];
        for (i, (off, len)) in
            [(0u32, 4096usize), (5000, 10000), (4095, 2), (60000, 5536), (100, 1)].iter().enumerate()
        {
            let d = pattern(i as u8, *len);
            put(&s, 1, 1, 0, *off, &d).await?;
            model[*off as usize..*off as usize + len].copy_from_slice(&d);
        }
        assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
        assert_eq!(&get(&s, 1, 1, 0, 4000, 3000).await?[..], &model[4000..7000]);
        assert_eq!(&get(&s, 1, 1, 5, 0, 100).await?[..], &[0u8; 100][..]);
        assert!(s.syncs() >= 5);
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
        assert_eq!(s.usage().1, 1);
        Ok(())
    }

    /// A write refused by its fence (the client has reconnected since)
    /// stores nothing and takes no slot, and the next write of the tract is
    /// stored whole: it survives a reopen.
    #[tokio::test]
    async fn a_superseded_write_stores_nothing() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        let d = pattern(7, 4096);
        let crcs = blizzard_core::crc::piece_crcs(0, &d);
        let never: Current<'_> = &|| false;
        let w = TractWrite {
            blob: BlobId(1),
            incarnation: 1,
            tract: TractNo(0),
            version: 1,
            offset: 0,
            data: d.clone(),
            crcs: &crcs,
            durability: Durability::Synced,
        };
        let r = s.write_with(w, never).await;
        assert!(matches!(r, Err(StoreError::Superseded)), "{r:?}");
        assert_eq!(s.usage().1, 0, "a refused write must not keep a slot");
        assert!(s.tracts().is_empty());
        put(&s, 1, 1, 0, 0, &d).await?;
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(&get(&s, 1, 1, 0, 0, 4096).await?[..], &d[..]);
        Ok(())
    }

    /// A write whose data does not match its CRCs is refused and stores nothing.
    #[tokio::test]
    async fn bad_crc_is_refused() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        let d = pattern(1, 8192);
        let mut crcs = piece_crcs(0, &d);
        crcs[1] ^= 1;
        let r = s.write(BlobId(1), 1, TractNo(0), 1, 0, d, &crcs).await;
        assert!(matches!(r, Err(StoreError::BadCrc(1))));
        assert_eq!(s.usage().1, 0);
        assert!(matches!(
            s.write(BlobId(1), 1, TractNo(0), 1, TRACT - 10, pattern(0, 20), &[0, 0]).await,
            Err(StoreError::OutOfRange { .. })
        ));
        Ok(())
    }

    /// A byte flipped on disk is reported as Corrupt, never returned.
    #[tokio::test]
    async fn flipped_byte_is_detected() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        put(&s, 1, 1, 3, 0, &pattern(9, TRACT as usize)).await?;
        let at = s.data_location(BlobId(1), TractNo(3)).ok_or(StoreError::Failed)? + 12345;
        drop(s);
        // Damage the byte behind the store's back, through a second handle.
        let raw = Env::real().open_disk(&dir.path().join("disk"), None).await?;
        let b = raw.read_at(at, 1).await?;
        raw.write_at(vec![(at, Bytes::from(vec![b[0] ^ 0x04]))]).await?;
        raw.sync().await?;
        drop(raw); // one owner per disk (flock)
        let s = reopen(&dir).await?;
        assert!(matches!(get(&s, 1, 1, 3, 0, TRACT).await, Err(StoreError::Corrupt { chunk: 3, .. })));
        // Chunks not touched by the flip still read.
        assert_eq!(get(&s, 1, 1, 3, 0, 4096).await?, pattern(9, TRACT as usize).slice(0..4096));
        // A partial write into the damaged chunk cannot merge with it.
        assert!(matches!(put(&s, 1, 1, 3, 12300, &pattern(1, 10)).await, Err(StoreError::Corrupt { .. })));
        // A whole-chunk overwrite repairs it.
        put(&s, 1, 1, 3, 12288, &pattern(2, 4096)).await?;
        assert_eq!(get(&s, 1, 1, 3, 12288, 4096).await?, pattern(2, 4096));
        Ok(())
    }

    /// When every slot is taken a new tract gets DiskFull, and everything
    /// already written is intact; freeing a slot makes room again, and the
    /// reused slot shows none of its previous tenant.
    #[tokio::test]
    async fn full_disk_and_slot_reuse() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 4 << 20).await?;
        let slots = s.usage().0 as i64;
        assert!(slots > 2);
        for t in 0..slots {
            put(&s, 1, 1, t, 0, &pattern(t as u8, 8192)).await?;
        }
        assert!(matches!(put(&s, 1, 1, slots, 0, &pattern(0, 10)).await, Err(StoreError::DiskFull(_))));
        for t in 0..slots {
            assert_eq!(get(&s, 1, 1, t, 0, 8192).await?, pattern(t as u8, 8192));
        }
        assert!(s.delete(BlobId(1), 1, TractNo(0)).await?);
        assert!(!s.delete(BlobId(1), 1, TractNo(0)).await?);
        put(&s, 2, 1, 0, 8192, &pattern(5, 100)).await?;
        // The new tenant's first chunks were the old tenant's: they must read as zeros.
        assert_eq!(&get(&s, 2, 1, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(&get(&s, 2, 1, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
        assert_eq!(get(&s, 2, 1, 0, 8192, 100).await?, pattern(5, 100));
        assert_eq!(get(&s, 1, 1, 1, 0, 8192).await?, pattern(1, 8192));
        Ok(())
    }

    /// Trimmed ranges read as zeros (whole chunks and partial ones), the
    /// rest of the tract is untouched, and a fully trimmed tract gives its
    /// slot back; all of it survives a reopen.
    #[tokio::test]
    async fn trim_unmaps_and_frees() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        let d = pattern(3, TRACT as usize);
        put(&s, 1, 1, 0, 0, &d).await?;
        s.trim(BlobId(1), 1, TractNo(0), 1000, 10000, ALWAYS).await?;
        let mut model = d.to_vec();
        model[1000..11000].fill(0);
        assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
        assert_eq!(s.usage().1, 1);
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
        s.trim(BlobId(1), 1, TractNo(0), 0, TRACT, ALWAYS).await?;
        assert_eq!(s.usage().1, 0);
        assert!(get(&s, 1, 1, 0, 0, TRACT).await?.iter().all(|&b| b == 0));
        // Trimming what was never written is a no-op, not an error.
        s.trim(BlobId(9), 1, TractNo(4), 0, 100, ALWAYS).await?;
        Ok(())
    }

    /// A tract written by an older incarnation of a blob id is invisible to
    /// a newer one, and a write by the newer one voids the old data.
    #[tokio::test]
    async fn incarnations_do_not_leak() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        put(&s, 1, 1, 0, 0, &pattern(1, 8192)).await?;
        assert_eq!(&get(&s, 1, 2, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
        put(&s, 1, 2, 0, 4096, &pattern(2, 10)).await?;
        assert_eq!(&get(&s, 1, 2, 0, 0, 4096).await?[..], &[0u8; 4096][..]);
        assert_eq!(&get(&s, 1, 1, 0, 0, 4096).await?[..], &[0u8; 4096][..]);
        Ok(())
    }

    fn chunk_crc(b: &[u8], chunk: usize) -> u32 {
        crc32c(&b[chunk * CHUNK_SIZE as usize..(chunk + 1) * CHUNK_SIZE as usize])
    }

    fn digest_reads(s: &Store) -> u64 {
        s.stats.digest_chunks_read.load(Ordering::Relaxed)
    }

    /// A digest says, per chunk, hole or the CRC of the bytes there
    /// (whole, partial and trimmed chunks), answered from memory for
    /// chunks this process wrote; a tract not held here, or held at
    /// another incarnation, digests as nothing.
    #[tokio::test]
    async fn digest_reports_holes_written_and_trimmed() -> Result<(), StoreError> {
        use ChunkState::{Data, Hole};
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        put(&s, 1, 1, 0, 0, &pattern(1, 8192)).await?;
        put(&s, 1, 1, 0, 5 * 4096 + 100, &pattern(2, 10)).await?;
        put(&s, 1, 1, 0, 0, &pattern(3, 4096)).await?;
        put(&s, 1, 1, 0, 7 * 4096, &pattern(4, 8192)).await?;
        s.trim(BlobId(1), 1, TractNo(0), 8 * 4096, 4096, ALWAYS).await?;
        let b = get(&s, 1, 1, 0, 0, TRACT).await?;
        let mut want = vec![Hole; (TRACT / CHUNK_SIZE) as usize];
        for c in [0, 1, 5, 7] {
            want[c] = Data(chunk_crc(&b, c));
        }
        assert_eq!(s.digest(BlobId(1), 1, TractNo(0)).await?, want);
        // The partial write's chunk: its bytes are zeros around the write.
        let mut c5 = vec![0u8; 4096];
        c5[100..110].copy_from_slice(&pattern(2, 10));
        assert_eq!(want[5], Data(crc32c(&c5)));
        assert!(s.digest(BlobId(1), 2, TractNo(0)).await?.is_empty(), "another incarnation");
        assert!(s.digest(BlobId(1), 1, TractNo(1)).await?.is_empty(), "a tract never written");
        assert_eq!(digest_reads(&s), 0, "written here: memory knows every chunk");
        assert_eq!(s.stats.digests.load(Ordering::Relaxed), 3);
        Ok(())
    }

    /// An overwrite cut off by a crash (as in
    /// `write_cut_off_part_way_reads_old_or_new`) is digested after a
    /// reopen with the CRC of the bytes actually there, old or new, read
    /// from the disk once: a second digest reads nothing, and a read agrees.
    #[tokio::test]
    async fn digest_after_a_cut_off_overwrite_reports_the_bytes_there() -> Result<(), StoreError> {
        let old = pattern(1, TRACT as usize);
        let new = pattern(2, TRACT as usize);
        // The overwrite of chunks 0..4 is one batch: its chunk entries,
        // then its data. Cut after the entries: old bytes; after both: new.
        for (keep, want) in [(1, &old), (2, &new)] {
            let dir = tempfile::tempdir()?;
            let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
            let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
            let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
            put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
            disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
            assert!(put(&s, 1, 1, 3, 0, &new.slice(0..16384)).await.is_err(), "the write was cut off");
            drop(s);
            drop(disk);
            let s = reopen(&dir).await?;
            let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
            // Chunks 0..4 as the cut left them, 4..8 untouched, the rest holes.
            let expect: Vec<ChunkState> = (0..(TRACT / CHUNK_SIZE) as usize)
                .map(|c| match c {
                    0..4 => ChunkState::Data(chunk_crc(want, c)),
                    4..8 => ChunkState::Data(chunk_crc(&old, c)),
                    _ => ChunkState::Hole,
                })
                .collect();
            assert_eq!(d, expect, "keep {keep}");
            assert_eq!(digest_reads(&s), 4, "keep {keep}: only the overwritten chunks are read");
            assert_eq!(s.digest(BlobId(1), 1, TractNo(3)).await?, d, "keep {keep}");
            assert_eq!(digest_reads(&s), 4, "keep {keep}: a second digest reads nothing");
            let b = get(&s, 1, 1, 3, 0, TRACT).await?;
            assert_eq!(&b[..16384], &want[..16384], "keep {keep}: a read agrees");
        }
        Ok(())
    }

    /// After a reopen, a whole-chunk overwrite of a chunk whose previous
    /// overwrite was cut off before its data stores the CRC of the bytes
    /// really there as its previous CRC: cut off again, the chunk reads old,
    /// not `Corrupt` (memory's CRC there was the lost write's).
    #[tokio::test]
    async fn a_second_cut_off_overwrite_after_reopen_reads_old() -> Result<(), StoreError> {
        let old = pattern(1, 4096);
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 1 });
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        put(&s, 1, 1, 3, 0, &old).await?;
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(put(&s, 1, 1, 3, 0, &pattern(2, 4096)).await.is_err());
        drop(s);
        drop(disk);
        for round in 0..2 {
            let real = Env::real().open_disk(&dir.path().join("disk"), None).await?;
            let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 1 });
            let s = Store::open(disk.clone()).await?;
            disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
            assert!(put(&s, 1, 1, 3, 0, &pattern(3 + round, 4096)).await.is_err());
            drop(s);
            drop(disk);
            let s = reopen(&dir).await?;
            assert_eq!(get(&s, 1, 1, 3, 0, 4096).await?, old, "round {round}");
        }
        Ok(())
    }

    /// A chunk whose bytes match no CRC its entry accepts digests as
    /// `Unreadable`: an overwritten chunk damaged while the server was
    /// down (read at the first digest), and a chunk a read found corrupt
    /// (memory stops vouching for it).
    #[tokio::test]
    async fn a_corrupt_chunk_digests_as_unreadable() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        put(&s, 1, 1, 3, 0, &pattern(9, 16384)).await?;
        put(&s, 1, 1, 3, 4096, &pattern(8, 4096)).await?;
        let at = s.data_location(BlobId(1), TractNo(3)).ok_or(StoreError::Failed)?;
        drop(s);
        let raw = Env::real().open_disk(&dir.path().join("disk"), None).await?;
        for off in [4096 + 7, 3 * 4096 + 7] {
            let b = raw.read_at(at + off, 1).await?;
            raw.write_at(vec![(at + off, Bytes::from(vec![b[0] ^ 0x10]))]).await?;
        }
        raw.sync().await?;
        drop(raw);
        let s = reopen(&dir).await?;
        let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
        assert_eq!(d[1], ChunkState::Unreadable, "the overwritten chunk was read");
        assert_eq!(d[0], ChunkState::Data(crc32c(&pattern(9, 16384)[..4096])));
        // Chunk 3 was written once: memory vouches for it until a read
        // finds it corrupt.
        assert!(matches!(d[3], ChunkState::Data(_)));
        assert!(matches!(get(&s, 1, 1, 3, 3 * 4096, 4096).await, Err(StoreError::Corrupt { chunk: 3, .. })));
        let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
        assert_eq!((d[1], d[3]), (ChunkState::Unreadable, ChunkState::Unreadable));
        // A whole-chunk write makes it known again, without a read.
        put(&s, 1, 1, 3, 3 * 4096, &pattern(5, 4096)).await?;
        let reads = digest_reads(&s);
        let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
        assert_eq!(d[3], ChunkState::Data(crc32c(&pattern(5, 4096))));
        assert_eq!(digest_reads(&s), reads + 1, "only the still unreadable chunk 1 is read");
        Ok(())
    }

    /// The positions record survives reopen and the newer of the two slots wins.
    #[tokio::test]
    async fn assignment_round_trip() -> Result<(), StoreError> {
        let dir = tempfile::tempdir()?;
        let s = fresh(&dir, 16 << 20).await?;
        assert_eq!(s.assignment().await, None);
        s.save_assignment(b"one").await?;
        s.save_assignment(b"two").await?;
        s.save_assignment(b"three").await?;
        drop(s);
        let s = reopen(&dir).await?;
        assert_eq!(s.assignment().await.as_deref(), Some(&b"three"[..]));
        Ok(())
    }
}
