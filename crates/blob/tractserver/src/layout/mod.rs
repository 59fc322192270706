//! The on-disk format of a tractserver's disk (design:
//! `docs/design/0002-tractserver-disk-format.md`). Pure encoding and
//! decoding; the store does the I/O.
//!
//! ```text
//! offset 0            superblock (4 KiB): magic, format version, disk id,
//!                     tract size, slot count, region offsets, CRC
//! positions           two 1 MiB slots, written alternately, each holding
//!                     the TLT assignment with a sequence number and CRC
//! journal             two 4 KiB head slots, then a ring of chunk-entry
//!                     records (`journal`): every change of a chunk entry
//!                     is appended here; the chunk table below is brought
//!                     up to date by checkpoints
//! slot table          one 64-byte entry per tract slot: which tract lives
//!                     there, its generation, allocation sequence, CRC
//! chunk table         one 16-byte entry per 4 KiB chunk of every slot:
//!                     the chunk's CRC32C and the slot generation it was
//!                     written under, and the CRC before the latest write
//!                     (as of the last checkpoint; the journal has the rest)
//! data                the tract slots, `tract_size` bytes each
//! ```
//!
//! A chunk entry counts only if its generation equals its slot's current
//! generation. Freeing and reusing a slot bumps the generation, so a reused
//! slot reads as zeros without clearing anything on disk.

use blizzard_core::crc::crc32c;
use blizzard_core::limits::{tract_size_valid, CHUNK_SIZE};
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};

pub mod journal;

use journal::{JOURNAL_HEAD_LEN, RECORD_ALIGN};

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"BLZTRACT";
/// 2: chunk entries keep the previous CRC (16 bytes each).
/// 3: the positions record names each row's filling members.
/// 4: and its pending members (cluster growth, FDS §3.4).
/// 5: chunk entries are journaled (a ring of records before the slot
///    table) and checkpointed into the chunk table.
pub const FORMAT_VERSION: u32 = 5;
pub const SUPERBLOCK_LEN: u64 = 4096;
pub const POSITIONS_SLOT_LEN: u64 = 1 << 20;
pub const SLOT_ENTRY_LEN: u64 = 64;
pub const CHUNK_ENTRY_LEN: u64 = 16;
const SLOT_MAGIC: u32 = u32::from_le_bytes(*b"SLOT");
const POSITIONS_MAGIC: u32 = u32::from_le_bytes(*b"BLZP");
/// Regions start on this boundary so data I/O stays page-aligned.
const REGION_ALIGN: u64 = 4096;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("disk is not formatted (no blizzard superblock)")]
    Unformatted,
    #[error("superblock CRC mismatch: the disk's first block is damaged; restore the disk or reformat it (losing its tracts)")]
    SuperblockCrc,
    #[error("disk format version {0} is not supported by this build (supports {FORMAT_VERSION}); run a matching blizzard release")]
    UnsupportedVersion(u32),
    #[error("superblock describes an impossible layout: {0}")]
    BadGeometry(String),
    #[error("disk of {disk_len} bytes is too small for even one {tract_size}-byte tract")]
    TooSmall { disk_len: u64, tract_size: u32 },
    #[error("assignment of {0} bytes does not fit in a positions slot")]
    PositionsTooLarge(usize),
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Where everything lives on one disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub disk_id: TsId,
    pub tract_size: u32,
    pub slot_count: u32,
    pub positions_offset: u64,
    /// The journal's two head slots; its ring follows them.
    pub journal_offset: u64,
    /// Bytes of the journal's ring ([`journal_len_for`]).
    pub journal_len: u64,
    pub slot_table_offset: u64,
    pub chunk_table_offset: u64,
    pub data_offset: u64,
    pub disk_len: u64,
    /// Sequential write speed measured when the disk was formatted (MB/s;
    /// 0 = not measured), for weighting the 1-way TLT (FDS §2.2).
    pub disk_mbps: u32,
}

impl Layout {
    /// The largest layout that fits a disk of `disk_len` bytes.
    pub fn plan(disk_id: TsId, tract_size: u32, disk_len: u64) -> Result<Layout, LayoutError> {
        Self::plan_with(disk_id, tract_size, disk_len, None)
    }

    /// [`Layout::plan`] with a journal ring of `journal_len` bytes instead
    /// of the default ([`journal_len_for`]): a smaller one makes
    /// checkpoints (and crashes inside them) frequent, for the simulator
    /// and tests. It must be valid ([`journal_len_valid`]).
    pub fn plan_with(
        disk_id: TsId,
        tract_size: u32,
        disk_len: u64,
        journal_len: Option<u64>,
    ) -> Result<Layout, LayoutError> {
        if !tract_size_valid(tract_size) {
            return Err(LayoutError::BadGeometry(format!("tract size {tract_size}")));
        }
        let journal_len = journal_len.unwrap_or_else(|| journal_len_for(tract_size, disk_len));
        if !journal_len_valid(tract_size, disk_len, journal_len) {
            return Err(LayoutError::BadGeometry(format!(
                "a journal of {journal_len} bytes (needs a multiple of 4 KiB, at least {}, at most half the disk)",
                journal_len_min(tract_size)
            )));
        }
        let chunks = (tract_size / CHUNK_SIZE) as u64;
        let positions_offset = SUPERBLOCK_LEN;
        let slot_table_offset =
            positions_offset + 2 * POSITIONS_SLOT_LEN + 2 * JOURNAL_HEAD_LEN + journal_len;
        let per_slot = tract_size as u64 + SLOT_ENTRY_LEN + chunks * CHUNK_ENTRY_LEN;
        let data_align = (tract_size as u64).min(1 << 20);
        let mut n = disk_len.saturating_sub(slot_table_offset) / per_slot;
        n = n.min(u32::MAX as u64);
        // The estimate ignores alignment padding; step down until it fits.
        while n > 0 {
            let l = Self::with_slots(disk_id, tract_size, n as u32, disk_len, data_align, journal_len);
            if l.data_offset + n * tract_size as u64 <= disk_len {
                return Ok(l);
            }
            n -= 1;
        }
        Err(LayoutError::TooSmall { disk_len, tract_size })
    }

    fn with_slots(
        disk_id: TsId,
        tract_size: u32,
        slot_count: u32,
        disk_len: u64,
        data_align: u64,
        journal_len: u64,
    ) -> Layout {
        let chunks = (tract_size / CHUNK_SIZE) as u64;
        let positions_offset = SUPERBLOCK_LEN;
        let journal_offset = positions_offset + 2 * POSITIONS_SLOT_LEN;
        let slot_table_offset = journal_offset + 2 * JOURNAL_HEAD_LEN + journal_len;
        let chunk_table_offset =
            align_up(slot_table_offset + slot_count as u64 * SLOT_ENTRY_LEN, REGION_ALIGN);
        let data_offset = align_up(
            chunk_table_offset + slot_count as u64 * chunks * CHUNK_ENTRY_LEN,
            data_align.max(REGION_ALIGN),
        );
        Layout {
            disk_id,
            tract_size,
            slot_count,
            positions_offset,
            journal_offset,
            journal_len,
            slot_table_offset,
            chunk_table_offset,
            data_offset,
            disk_len,
            disk_mbps: 0,
        }
    }

    pub fn chunks_per_tract(&self) -> u32 {
        self.tract_size / CHUNK_SIZE
    }

    pub fn slot_entry_offset(&self, slot: u32) -> u64 {
        self.slot_table_offset + slot as u64 * SLOT_ENTRY_LEN
    }

    pub fn chunk_entry_offset(&self, slot: u32, chunk: u32) -> u64 {
        self.chunk_table_offset
            + (slot as u64 * self.chunks_per_tract() as u64 + chunk as u64) * CHUNK_ENTRY_LEN
    }

    pub fn data_offset_of(&self, slot: u32, offset_in_tract: u32) -> u64 {
        self.data_offset + slot as u64 * self.tract_size as u64 + offset_in_tract as u64
    }

    pub fn positions_slot_offset(&self, which: u8) -> u64 {
        self.positions_offset + (which as u64 & 1) * POSITIONS_SLOT_LEN
    }

    /// Where journal head slot `which` (0 or 1) lives.
    pub fn journal_head_offset(&self, which: u8) -> u64 {
        self.journal_offset + (which as u64 & 1) * JOURNAL_HEAD_LEN
    }

    /// Where the journal's ring starts.
    pub fn journal_ring_offset(&self) -> u64 {
        self.journal_offset + 2 * JOURNAL_HEAD_LEN
    }

    pub fn encode_superblock(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SUPERBLOCK_LEN as usize);
        b.extend_from_slice(&SUPERBLOCK_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.disk_id.0.to_le_bytes());
        b.extend_from_slice(&self.tract_size.to_le_bytes());
        b.extend_from_slice(&CHUNK_SIZE.to_le_bytes());
        b.extend_from_slice(&self.slot_count.to_le_bytes());
        for v in [
            self.positions_offset,
            self.journal_offset,
            self.journal_len,
            self.slot_table_offset,
            self.chunk_table_offset,
            self.data_offset,
            self.disk_len,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.disk_mbps.to_le_bytes());
        let crc = crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(SUPERBLOCK_LEN as usize, 0);
        b
    }

    /// Decodes and checks a superblock against the disk it was read from.
    pub fn decode_superblock(b: &[u8], disk_len: u64) -> Result<Layout, LayoutError> {
        const BODY: usize = 8 + 4 + 16 + 4 + 4 + 4 + 7 * 8 + 4;
        if b.len() < BODY + 4 || b[0..8] != SUPERBLOCK_MAGIC {
            return Err(LayoutError::Unformatted);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if crc32c(&b[..BODY]) != u32_at(BODY) {
            return Err(LayoutError::SuperblockCrc);
        }
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(LayoutError::UnsupportedVersion(version));
        }
        let mut id = [0u8; 16];
        id.copy_from_slice(&b[12..28]);
        let disk_id = TsId(u128::from_le_bytes(id));
        let tract_size = u32_at(28);
        let chunk_size = u32_at(32);
        let slot_count = u32_at(36);
        let l = Layout {
            disk_id,
            tract_size,
            slot_count,
            positions_offset: u64_at(40),
            journal_offset: u64_at(48),
            journal_len: u64_at(56),
            slot_table_offset: u64_at(64),
            chunk_table_offset: u64_at(72),
            data_offset: u64_at(80),
            disk_len: u64_at(88),
            disk_mbps: u32_at(96),
        };
        if chunk_size != CHUNK_SIZE || !tract_size_valid(tract_size) {
            return Err(LayoutError::BadGeometry(format!(
                "tract size {tract_size}, chunk size {chunk_size}"
            )));
        }
        // Recompute the layout from its parameters: a superblock that does
        // not describe exactly what this build would lay out is refused.
        let data_align = (tract_size as u64).min(1 << 20);
        if !journal_len_valid(tract_size, l.disk_len, l.journal_len) {
            return Err(LayoutError::BadGeometry(format!("a journal of {} bytes", l.journal_len)));
        }
        let mut expect =
            Self::with_slots(disk_id, tract_size, slot_count, l.disk_len, data_align, l.journal_len);
        expect.disk_mbps = l.disk_mbps;
        if expect != l {
            return Err(LayoutError::BadGeometry("region offsets do not match the slot count".into()));
        }
        if l.disk_len > disk_len || l.data_offset + slot_count as u64 * tract_size as u64 > disk_len {
            return Err(LayoutError::BadGeometry(format!(
                "layout needs {} bytes but the disk has {disk_len}",
                l.data_offset + slot_count as u64 * tract_size as u64
            )));
        }
        Ok(l)
    }
}

/// The smallest journal ring for tracts of `tract_size`: eight times the
/// credit one write of a whole tract holds ([`journal::write_credit`]), so
/// a change always fits beside others, however the ring is laid out.
pub fn journal_len_min(tract_size: u32) -> u64 {
    align_up(8 * journal::write_credit(tract_size / CHUNK_SIZE), REGION_ALIGN)
}

/// Whether a ring of `len` bytes can serve tracts of `tract_size` on a disk
/// of `disk_len` bytes: a multiple of 4 KiB (so also of the record
/// alignment), at least [`journal_len_min`], at most half the disk.
pub fn journal_len_valid(tract_size: u32, disk_len: u64, len: u64) -> bool {
    len.is_multiple_of(REGION_ALIGN) && len >= journal_len_min(tract_size) && len <= disk_len / 2
}

/// The default journal ring for a disk of `disk_len` bytes holding tracts
/// of `tract_size`: about 1/256 of the disk, at least 64 KiB (and
/// [`journal_len_min`]), at most 16 MiB (a bigger ring only delays
/// checkpoints, which then write the same table pages). A multiple of 4 KiB.
pub fn journal_len_for(tract_size: u32, disk_len: u64) -> u64 {
    let least = journal_len_min(tract_size).max(64 << 10);
    let most = least.max(16 << 20);
    let len = align_up((disk_len / 256).clamp(least, most), REGION_ALIGN);
    const _: () = assert!(REGION_ALIGN.is_multiple_of(RECORD_ALIGN));
    len
}

/// The ring for a slow disk behind a backup journal of `backup_len` bytes
/// (design 0009): big enough for the chunk entries of everything that
/// journal can hold (a record of a 4 KiB write is about 4.5 KiB there and
/// at most 512 bytes here), so that a small write waits for neither: a
/// checkpoint frees this ring only once the slow disk has synced, which
/// takes seconds, while the backup journal is destaged in the background.
/// Never less than [`journal_len_for`], never more than a quarter of the
/// disk (the rest holds tracts).
pub fn journal_len_behind_backup(tract_size: u32, disk_len: u64, backup_len: u64) -> u64 {
    let default = journal_len_for(tract_size, disk_len);
    let want = align_up(backup_len / 8, REGION_ALIGN);
    let most = (disk_len / 4) / REGION_ALIGN * REGION_ALIGN;
    want.min(most).max(default)
}

/// What a slot holds. `Free` slots keep their generation so the next
/// tenant's generation is higher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotEntry {
    pub used: bool,
    pub generation: u32,
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub tract: TractNo,
    /// TLT row version the tract was last written under (FDS §3.2.1: lets a
    /// returning tractserver find the writes it missed).
    pub written_version: u64,
    /// Store-wide allocation counter: if a crash leaves two used entries
    /// for one tract, the higher one is the live one.
    pub alloc_seq: u64,
}

/// How a slot entry read back from disk should be treated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotRecord {
    /// All zeros: never written since format.
    Blank,
    Valid(SlotEntry),
    /// Neither blank nor valid: bit rot or a torn entry write.
    Damaged,
}

impl SlotEntry {
    pub fn encode(&self) -> [u8; SLOT_ENTRY_LEN as usize] {
        let mut b = [0u8; SLOT_ENTRY_LEN as usize];
        b[0..4].copy_from_slice(&SLOT_MAGIC.to_le_bytes());
        b[4] = self.used as u8;
        b[8..12].copy_from_slice(&self.generation.to_le_bytes());
        b[12..28].copy_from_slice(&self.blob.0.to_le_bytes());
        b[28..36].copy_from_slice(&self.incarnation.to_le_bytes());
        b[36..44].copy_from_slice(&self.tract.0.to_le_bytes());
        b[44..52].copy_from_slice(&self.written_version.to_le_bytes());
        b[52..60].copy_from_slice(&self.alloc_seq.to_le_bytes());
        let crc = crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> SlotRecord {
        if b.len() != SLOT_ENTRY_LEN as usize {
            return SlotRecord::Damaged;
        }
        if b.iter().all(|&x| x == 0) {
            return SlotRecord::Blank;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        if u32_at(0) != SLOT_MAGIC || crc32c(&b[0..60]) != u32_at(60) || b[4] > 1 {
            return SlotRecord::Damaged;
        }
        let mut blob = [0u8; 16];
        blob.copy_from_slice(&b[12..28]);
        SlotRecord::Valid(SlotEntry {
            used: b[4] == 1,
            generation: u32_at(8),
            blob: BlobId(u128::from_le_bytes(blob)),
            incarnation: u64_at(28),
            tract: TractNo(u64_at(36) as i64),
            written_version: u64_at(44),
            alloc_seq: u64_at(52),
        })
    }
}

/// One chunk's integrity record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ChunkEntry {
    pub crc: u32,
    /// Slot generation the chunk was written under; 0 = never.
    pub generation: u32,
    /// CRC of the chunk's contents before the write that set `crc`, valid
    /// when `prev_generation == generation`. An overwrite stores this entry
    /// before its data, so a crash between the two leaves the old bytes
    /// readable under `prev_crc` instead of unreadable.
    pub prev_crc: u32,
    pub prev_generation: u32,
}

impl ChunkEntry {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.crc.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.prev_crc.to_le_bytes());
        out.extend_from_slice(&self.prev_generation.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> ChunkEntry {
        if b.len() < CHUNK_ENTRY_LEN as usize {
            return ChunkEntry::default();
        }
        let u = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        ChunkEntry { crc: u(0), generation: u(4), prev_crc: u(8), prev_generation: u(12) }
    }

    /// Whether `crc` is a CRC these bytes may legitimately have: the
    /// latest write's, or, if that write was cut off before its data, the
    /// one before it.
    pub fn accepts(&self, crc: u32) -> bool {
        crc == self.crc || (self.prev_generation == self.generation && crc == self.prev_crc)
    }

    /// The entry after a crash-interrupted write was found to have left
    /// the previous contents: they are the chunk's contents now.
    pub fn settled_to(&self, crc: u32) -> ChunkEntry {
        ChunkEntry { crc, generation: self.generation, prev_crc: 0, prev_generation: 0 }
    }
}

/// Encodes a positions record: the assignment bytes with a sequence number
/// and CRC, written alternately into the two positions slots so that a torn
/// write leaves the previous record intact.
pub fn encode_positions(seq: u64, payload: &[u8]) -> Result<Vec<u8>, LayoutError> {
    let total = 4 + 8 + 4 + payload.len() + 4;
    if total as u64 > POSITIONS_SLOT_LEN {
        return Err(LayoutError::PositionsTooLarge(payload.len()));
    }
    let mut b = Vec::with_capacity(total);
    b.extend_from_slice(&POSITIONS_MAGIC.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    b.extend_from_slice(payload);
    let crc = crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    Ok(b)
}

/// Decodes a positions slot: `(seq, payload)` if it holds a valid record.
pub fn decode_positions(b: &[u8]) -> Option<(u64, &[u8])> {
    if b.len() < 16 || u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != POSITIONS_MAGIC {
        return None;
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&b[4..12]);
    let seq = u64::from_le_bytes(s);
    let len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize;
    let end = 16usize.checked_add(len)?;
    if end + 4 > b.len() {
        return None;
    }
    let crc = u32::from_le_bytes([b[end], b[end + 1], b[end + 2], b[end + 3]]);
    if crc32c(&b[..end]) != crc {
        return None;
    }
    Some((seq, &b[16..end]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A slow disk's ring holds an eighth of its backup journal, within
    /// what a plan accepts.
    #[test]
    fn a_ring_behind_a_backup_journal_is_as_deep_as_it_needs() -> Result<(), LayoutError> {
        for (tract, disk, backup) in
            [(8u32 << 20, 2u64 << 30, 512u64 << 20), (8 << 20, 2 << 30, 1 << 20), (65536, 64 << 20, 1 << 30)]
        {
            let len = journal_len_behind_backup(tract, disk, backup);
            assert!(journal_len_valid(tract, disk, len), "{tract} {disk} {backup}: {len}");
            assert!(len >= journal_len_for(tract, disk));
            assert!(len >= (backup / 8).min(disk / 4 / 4096 * 4096));
            assert!(Layout::plan_with(TsId(1), tract, disk, Some(len))?.slot_count > 0);
        }
        assert_eq!(journal_len_behind_backup(8 << 20, 2 << 30, 512 << 20), 64 << 20);
        Ok(())
    }

    /// Regions do not overlap, are aligned, and the data fits on the disk.
    #[test]
    fn plan_fits_and_aligns() -> Result<(), LayoutError> {
        for (tract, disk) in
            [(4096u32, 3u64 << 20), (65536, 64 << 20), (8 << 20, 1 << 30), (8 << 20, 100 << 30)]
        {
            let l = Layout::plan(TsId(1), tract, disk)?;
            assert!(l.slot_count > 0);
            assert!(l.journal_offset >= l.positions_offset + 2 * POSITIONS_SLOT_LEN);
            assert!(l.slot_table_offset >= l.journal_ring_offset() + l.journal_len);
            assert_eq!(l.journal_len % 4096, 0);
            assert!(l.journal_len >= journal_len_min(tract));
            assert!(journal_len_valid(tract, disk, l.journal_len));
            assert!(l.chunk_table_offset >= l.slot_entry_offset(l.slot_count));
            assert!(l.data_offset >= l.chunk_entry_offset(l.slot_count, 0));
            assert_eq!(l.data_offset % 4096, 0);
            assert!(l.data_offset_of(l.slot_count, 0) <= disk);
            // Not wasteful: another slot would not have fit.
            let per_slot = tract as u64 + 64 + (tract / 4096) as u64 * 16;
            assert!(disk - l.data_offset_of(l.slot_count, 0) < per_slot + (1 << 20) + 8192);
        }
        assert!(matches!(Layout::plan(TsId(1), 8 << 20, 4 << 20), Err(LayoutError::TooSmall { .. })));
        // A chosen ring: used as given, and refused when too small.
        let small = Layout::plan_with(TsId(1), 16384, 16 << 20, Some(4096))?;
        assert_eq!(small.journal_len, 4096);
        assert!(Layout::plan_with(TsId(1), 8 << 20, 1 << 30, Some(4096)).is_err());
        assert!(Layout::plan(TsId(1), 1000, 1 << 30).is_err());
        Ok(())
    }

    #[test]
    fn superblock_round_trip_and_damage() -> Result<(), LayoutError> {
        let l = Layout::plan(TsId(0xabc), 65536, 64 << 20)?;
        let mut b = l.encode_superblock();
        assert_eq!(Layout::decode_superblock(&b, 64 << 20)?, l);
        // A chosen ring length is kept by the superblock.
        let small = Layout::plan_with(TsId(0xabc), 65536, 64 << 20, Some(8192))?;
        assert_eq!(Layout::decode_superblock(&small.encode_superblock(), 64 << 20)?, small);
        // On a smaller disk than it was formatted for: refused.
        assert!(matches!(Layout::decode_superblock(&b, 32 << 20), Err(LayoutError::BadGeometry(_))));
        b[30] ^= 1;
        assert_eq!(Layout::decode_superblock(&b, 64 << 20), Err(LayoutError::SuperblockCrc));
        assert_eq!(Layout::decode_superblock(&[0u8; 4096], 64 << 20), Err(LayoutError::Unformatted));
        Ok(())
    }

    #[test]
    fn slot_entry_states() {
        let e = SlotEntry {
            used: true,
            generation: 3,
            blob: BlobId(7),
            incarnation: 9,
            tract: TractNo(-1),
            written_version: 4,
            alloc_seq: 11,
        };
        let b = e.encode();
        assert_eq!(SlotEntry::decode(&b), SlotRecord::Valid(e));
        assert_eq!(SlotEntry::decode(&[0u8; 64]), SlotRecord::Blank);
        let mut bad = b;
        bad[20] ^= 0x10;
        assert_eq!(SlotEntry::decode(&bad), SlotRecord::Damaged);
    }

    proptest! {
        /// A positions record survives a round trip; any corruption or
        /// truncation of it is detected.
        #[test]
        fn positions_detects_damage(seq in any::<u64>(), payload in proptest::collection::vec(any::<u8>(), 0..2000), flip in any::<prop::sample::Index>()) {
            let rec = encode_positions(seq, &payload).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(decode_positions(&rec), Some((seq, &payload[..])));
            let mut bad = rec.clone();
            let i = flip.index(bad.len());
            bad[i] ^= 0x01;
            prop_assert!(decode_positions(&bad).map(|(s, p)| (s, p.to_vec())) != Some((seq, payload.clone())));
            prop_assert_eq!(decode_positions(&rec[..rec.len() - 1]), None);
        }
    }
}
