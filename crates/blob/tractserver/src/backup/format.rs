//! The backup journal's on-disk format: heads, records and the scan of the
//! ring at open. Pure encoding and decoding; `journal.rs` does the I/O.
//!
//! A backup journal lives on fast storage beside a slow data disk (Ursa
//! §3.2). A small write to a backup replica is appended here, made durable
//! and acknowledged; it reaches the data disk later, replayed in disk
//! order. The journal is a ring after two head slots:
//!
//! ```text
//! 0       head slot A (4 KiB)
//! 4096    head slot B (4 KiB)
//! 8192    ring: records at multiples of RECORD_ALIGN, never across its end
//! ```
//!
//! Head, written alternately to A and B (the valid one with the higher
//! `seq` counts, so a torn head leaves the other):
//!
//! ```text
//!  0 magic "BLZB"   4 version (2)   8 journal id (u128)   24 disk id (u128)
//! 40 ring length   48 seq   56 position   64 second area's journal id (u128, 0: none)
//! 80 CRC32C of 0..80
//! ```
//!
//! Version 1 heads (no second area; CRC at 64) are still read. A journal
//! that has a second area (`journal.rs`, "Areas") names it in its head
//! before that area takes a record, so the journal is never opened
//! without the area that may hold some of its acknowledged writes. `seq`
//! is shared by both areas: each area's records grow in `seq` along its
//! ring, with gaps where the other area took numbers.
//!
//! The journal id is random per format; the disk id names the data disk
//! the journal belongs to, so a journal is never replayed onto another
//! disk. `seq` is the first record that may not be on the data disk yet,
//! `position` where it lies: a logical offset that only grows (the ring
//! offset is it modulo the ring's length).
//!
//! Record, little endian:
//!
//! ```text
//!  0 magic "BLZR"   4 kind   5 (zero) x3   8 len: ring bytes, padding included
//! 12 data length   16 seq   24 position (logical, as in the head)
//! 32 blob (u128)   48 incarnation   56 tract   64 row version   72 offset in the tract
//! 76 piece count   80 CRC32C of 0..80, the journal id and the piece CRCs   84 (zero)
//! 88 piece CRCs (4 bytes each), then the data, then zeros up to len
//! ```
//!
//! Kinds: **data** (these bytes at this offset of the tract) and
//! **supersede** (no data: the range was written to the data disk directly,
//! so older records' bytes for it must never be replayed).
//!
//! A record's header CRC proves the header is whole and was written for
//! this journal at this position (the id and the position are in it, so a
//! record left from an earlier format, or from an earlier lap of the ring,
//! never passes for a new one). Its data is checked against the writer's
//! own piece CRCs (`blizzard_core::crc`), the ones the tractserver checked
//! when the write arrived: end to end, from the client to the replay.
//!
//! What the scan at open makes of each 512-byte step of the ring, from the
//! head's position for one lap:
//!
//! | found                                              | treated as                                  |
//! |----------------------------------------------------|---------------------------------------------|
//! | a valid record for this position and journal       | live: replayed (the scan moves past it)      |
//! | its header valid, its data not matching its CRCs   | torn (never acknowledged: its sync had not returned) or rotted; reported as damaged, not replayed |
//! | zeros, garbage, a record of another journal or lap | a hole: a record reserved but never written, or the end; the scan steps on |
//! | live records whose `seq` order disagrees with their positions | refuse to open: not a ring this code wrote |

use blizzard_core::crc::{crc32c, crc32c_append, first_bad_piece, piece_count};
use blizzard_core::{BlobId, Incarnation, TractNo};
use bytes::Bytes;

use crate::layout::journal::{u32_at, u64_at};

/// Records start on this boundary, so the scan finds them again after a
/// hole.
pub const RECORD_ALIGN: u64 = 512;
/// Bytes before a record's piece CRCs.
pub const RECORD_HEADER_LEN: u64 = 88;
/// Bytes of one head slot; the ring starts after two.
pub const HEAD_LEN: u64 = 4096;
/// Where the ring starts on the journal's disk.
pub const RING_START: u64 = 2 * HEAD_LEN;
/// The smallest ring worth having: a few of the largest records.
pub const RING_MIN: u64 = 1 << 20;
/// The largest write a record holds. Larger writes bypass the journal
/// (Ursa §3.2: they are sequential enough for the slow disk).
pub const RECORD_DATA_MAX: u32 = 1 << 20;

const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"BLZR");
const HEAD_MAGIC: u32 = u32::from_le_bytes(*b"BLZB");
const HEAD_VERSION: u32 = 2;
const HEAD_BODY: usize = 80;
/// Heads before the second area: no field for it, CRC at 64.
const HEAD_BODY_V1: usize = 64;

const _: () = assert!(RING_START.is_multiple_of(RECORD_ALIGN));
const _: () = assert!(RECORD_HEADER_LEN <= RECORD_ALIGN);

/// What a record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Bytes to put at `offset` of the tract.
    Data = 1,
    /// `offset..offset + len` of the tract was written to the data disk
    /// directly: older records' bytes there are dead.
    Supersede = 2,
}

/// Which bytes of which tract a record is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub tract: TractNo,
    /// The TLT row version the writer used (stored with the tract).
    pub version: u64,
    pub offset: u32,
}

/// One record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub kind: Kind,
    pub seq: u64,
    /// Logical position in the ring.
    pub position: u64,
    pub target: Target,
    /// Bytes of the range (for a supersede record, its length).
    pub len: u32,
    /// The writer's piece CRCs (data records).
    pub crcs: Vec<u32>,
    /// The bytes (data records).
    pub data: Bytes,
    /// Ring bytes it takes, padding included.
    pub ring_len: u64,
}

impl Record {
    /// Where the data starts, from the record's start.
    pub fn data_offset(&self) -> u64 {
        RECORD_HEADER_LEN + 4 * self.crcs.len() as u64
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Ring bytes of a data record of `len` bytes at `offset` of its tract.
pub fn data_record_len(offset: u32, len: u32) -> u64 {
    align_up(RECORD_HEADER_LEN + 4 * piece_count(offset, len) as u64 + len as u64, RECORD_ALIGN)
}

/// Ring bytes of a supersede record.
pub const SUPERSEDE_RECORD_LEN: u64 = RECORD_ALIGN;

fn u128_at(b: &[u8], i: usize) -> u128 {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[i..i + 16]);
    u128::from_le_bytes(a)
}

fn header_crc(header: &[u8], journal_id: u128, crcs: &[u8]) -> u32 {
    let c = crc32c(&header[..80]);
    let c = crc32c_append(c, &journal_id.to_le_bytes());
    crc32c_append(c, crcs)
}

/// What a record's header says, as [`encode_record`] takes it.
#[derive(Clone, Copy, Debug)]
pub struct RecordHeader<'a> {
    pub kind: Kind,
    pub seq: u64,
    /// Logical position in the ring.
    pub position: u64,
    pub target: &'a Target,
    /// Bytes of the range.
    pub len: u32,
}

/// Encodes a record for journal `journal_id`. `data` is empty for a
/// supersede record, whose range is `target.offset..target.offset + len`;
/// for a data record `len` is `data.len()` and `crcs` its piece CRCs
/// (checked by the caller).
pub fn encode_record(h: &RecordHeader<'_>, journal_id: u128, crcs: &[u32], data: &[u8]) -> Vec<u8> {
    let RecordHeader { kind, seq, position, target, len } = *h;
    debug_assert!(kind == Kind::Data || (crcs.is_empty() && data.is_empty()));
    debug_assert!(kind == Kind::Supersede || data.len() == len as usize);
    let ring_len = align_up(RECORD_HEADER_LEN + 4 * crcs.len() as u64 + data.len() as u64, RECORD_ALIGN);
    let mut b = Vec::with_capacity(ring_len as usize);
    b.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    b.extend_from_slice(&[kind as u8, 0, 0, 0]);
    b.extend_from_slice(&(ring_len as u32).to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&position.to_le_bytes());
    b.extend_from_slice(&target.blob.0.to_le_bytes());
    b.extend_from_slice(&target.incarnation.to_le_bytes());
    b.extend_from_slice(&target.tract.0.to_le_bytes());
    b.extend_from_slice(&target.version.to_le_bytes());
    b.extend_from_slice(&target.offset.to_le_bytes());
    b.extend_from_slice(&(crcs.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 8]);
    for c in crcs {
        b.extend_from_slice(&c.to_le_bytes());
    }
    let crc = header_crc(&b, journal_id, &b[RECORD_HEADER_LEN as usize..]);
    b[80..84].copy_from_slice(&crc.to_le_bytes());
    b.extend_from_slice(data);
    b.resize(ring_len as usize, 0);
    b
}

/// What is at one place of the ring.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    /// A whole, valid record.
    Record(Record),
    /// A header written for this place, whose data does not match its
    /// CRCs (torn, or rotted since). It takes `ring_len` bytes.
    Damaged { seq: u64, target: Target, ring_len: u64 },
    /// Nothing of this journal's written for this place.
    Hole,
}

/// Decodes what lies at logical `position` of the ring, `b` being the ring
/// bytes from there (they may run on past the record). `tract_size` bounds
/// the range a record may name. Nothing read from the disk is trusted
/// before it is checked.
pub fn decode_record(b: &[u8], journal_id: u128, position: u64, tract_size: u32) -> Found {
    let header = RECORD_HEADER_LEN as usize;
    // The reserved bytes are zero in every record this code writes.
    if b.len() < header || u32_at(b, 0) != RECORD_MAGIC || b[5..8] != [0; 3] || b[84..88] != [0; 4] {
        return Found::Hole;
    }
    let kind = match b[4] {
        1 => Kind::Data,
        2 => Kind::Supersede,
        _ => return Found::Hole,
    };
    let ring_len = u32_at(b, 8) as u64;
    let len = u32_at(b, 12);
    let count = u32_at(b, 76) as u64;
    let crcs_end = header as u64 + 4 * count;
    // Bounds before anything is sliced: a count or length from a damaged
    // header must not make us read past the buffer.
    if count > piece_count(0, RECORD_DATA_MAX) as u64 + 1 || crcs_end > b.len() as u64 {
        return Found::Hole;
    }
    let crc_bytes = &b[header..crcs_end as usize];
    if u32_at(b, 80) != header_crc(&b[..header], journal_id, crc_bytes) || u64_at(b, 24) != position {
        return Found::Hole;
    }
    let target = Target {
        blob: BlobId(u128_at(b, 32)),
        incarnation: u64_at(b, 48),
        tract: TractNo(u64_at(b, 56) as i64),
        version: u64_at(b, 64),
        offset: u32_at(b, 72),
    };
    let seq = u64_at(b, 16);
    let data_len = if kind == Kind::Data { len as u64 } else { 0 };
    let in_tract = target.offset as u64 + len as u64 <= tract_size as u64 && len > 0;
    let sized = ring_len == align_up(crcs_end + data_len, RECORD_ALIGN) && ring_len <= b.len() as u64;
    let counted = match kind {
        Kind::Data => count == piece_count(target.offset, len) as u64 && len <= RECORD_DATA_MAX,
        Kind::Supersede => count == 0,
    };
    if !(in_tract && sized && counted) {
        // A header that checks but describes nothing this code writes.
        return Found::Hole;
    }
    let crcs: Vec<u32> = crc_bytes.chunks_exact(4).map(|c| u32_at(c, 0)).collect();
    let data = Bytes::copy_from_slice(&b[crcs_end as usize..(crcs_end + data_len) as usize]);
    if kind == Kind::Data && first_bad_piece(target.offset, &data, &crcs).is_some() {
        return Found::Damaged { seq, target, ring_len };
    }
    Found::Record(Record { kind, seq, position, target, len, crcs, data, ring_len })
}

/// The journal's head: where its live records start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    pub journal_id: u128,
    pub disk_id: u128,
    pub ring_len: u64,
    /// The first record that may not be on the data disk yet.
    pub seq: u64,
    /// Its logical position.
    pub position: u64,
    /// The journal id of this journal's second area (0: it has none).
    pub overflow_id: u128,
}

impl Head {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEAD_LEN as usize);
        b.extend_from_slice(&HEAD_MAGIC.to_le_bytes());
        b.extend_from_slice(&HEAD_VERSION.to_le_bytes());
        b.extend_from_slice(&self.journal_id.to_le_bytes());
        b.extend_from_slice(&self.disk_id.to_le_bytes());
        b.extend_from_slice(&self.ring_len.to_le_bytes());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.position.to_le_bytes());
        b.extend_from_slice(&self.overflow_id.to_le_bytes());
        let crc = crc32c(&b[..HEAD_BODY]);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(HEAD_LEN as usize, 0);
        b
    }

    /// The head in one slot, if it is whole and of a version we read.
    pub fn decode(b: &[u8]) -> Option<Head> {
        if b.len() < HEAD_BODY + 4 || u32_at(b, 0) != HEAD_MAGIC {
            return None;
        }
        let body = match u32_at(b, 4) {
            1 => HEAD_BODY_V1,
            HEAD_VERSION => HEAD_BODY,
            _ => return None,
        };
        if u32_at(b, body) != crc32c(&b[..body]) {
            return None;
        }
        let h = Head {
            journal_id: u128_at(b, 8),
            disk_id: u128_at(b, 24),
            ring_len: u64_at(b, 40),
            seq: u64_at(b, 48),
            position: u64_at(b, 56),
            overflow_id: if body == HEAD_BODY { u128_at(b, 64) } else { 0 },
        };
        (h.ring_len >= RING_MIN
            && h.ring_len.is_multiple_of(RECORD_ALIGN)
            && h.position.is_multiple_of(RECORD_ALIGN))
        .then_some(h)
    }

    /// The head that counts of two slots: the valid one with the higher
    /// `seq` (they must name the same journal).
    pub fn newest(a: Option<Head>, b: Option<Head>) -> Option<Head> {
        match (a, b) {
            (Some(a), Some(b)) if a.journal_id == b.journal_id => Some(if b.seq > a.seq { b } else { a }),
            // Two journals' heads: the slot written last is unknown, and
            // neither can be trusted to be the live one.
            (Some(_), Some(_)) => None,
            (a, b) => a.or(b),
        }
    }

    /// The ring offset of logical `position`.
    pub fn ring_offset(&self, position: u64) -> u64 {
        position % self.ring_len
    }
}

/// Where a record of `len` ring bytes goes if the next free logical
/// position is `next`: there, or at the start of the next lap if it would
/// cross the ring's end (records never wrap).
pub fn place(next: u64, len: u64, ring_len: u64) -> u64 {
    let off = next % ring_len;
    if off + len <= ring_len {
        next
    } else {
        next - off + ring_len
    }
}

/// Ring bytes the scan at open steps through per read; each read takes a
/// record's largest length more, so a record is never cut.
pub const SCAN_WINDOW: u64 = 4 << 20;

/// The most ring bytes one record takes.
pub fn record_len_max() -> u64 {
    data_record_len(1, RECORD_DATA_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::crc::piece_crcs;

    fn target() -> Target {
        Target { blob: BlobId(7), incarnation: 3, tract: TractNo(5), version: 9, offset: 4000 }
    }

    fn data_record(seq: u64, position: u64, data: &[u8]) -> Vec<u8> {
        let t = target();
        let crcs = piece_crcs(t.offset, data);
        let h = RecordHeader { kind: Kind::Data, seq, position, target: &t, len: data.len() as u32 };
        encode_record(&h, 42, &crcs, data)
    }

    #[test]
    fn a_data_record_round_trips() {
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let b = data_record(11, 1024, &data);
        assert_eq!(b.len() as u64, data_record_len(4000, 10_000));
        assert!((b.len() as u64).is_multiple_of(RECORD_ALIGN));
        let Found::Record(r) = decode_record(&b, 42, 1024, 1 << 20) else { panic!("not decoded") };
        assert_eq!((r.kind, r.seq, r.position, r.target, r.len), (Kind::Data, 11, 1024, target(), 10_000));
        assert_eq!(&r.data[..], &data[..]);
        assert_eq!(r.crcs, piece_crcs(4000, &data));
        assert_eq!(r.ring_len, b.len() as u64);
        assert_eq!(&b[r.data_offset() as usize..][..data.len()], &data[..]);
    }

    #[test]
    fn a_supersede_record_round_trips() {
        let t = target();
        let h = RecordHeader { kind: Kind::Supersede, seq: 3, position: 0, target: &t, len: 65536 };
        let b = encode_record(&h, 42, &[], &[]);
        assert_eq!(b.len() as u64, SUPERSEDE_RECORD_LEN);
        let Found::Record(r) = decode_record(&b, 42, 0, 1 << 20) else { panic!("not decoded") };
        assert_eq!((r.kind, r.len, r.data.len()), (Kind::Supersede, 65536, 0));
    }

    /// A record is ours only at its own place, in its own journal, within
    /// the tract, and whole.
    #[test]
    fn records_of_another_place_journal_or_shape_are_holes() {
        let b = data_record(1, 512, &[1u8; 4096]);
        assert_eq!(decode_record(&b, 43, 512, 1 << 20), Found::Hole, "another journal");
        assert_eq!(decode_record(&b, 42, 512 + (1 << 20), 1 << 20), Found::Hole, "an earlier lap");
        assert_eq!(decode_record(&b, 42, 512, 4096), Found::Hole, "past the tract's end");
        assert_eq!(decode_record(&b[..100], 42, 512, 1 << 20), Found::Hole, "cut short");
        assert_eq!(decode_record(&[0u8; 1024], 42, 0, 1 << 20), Found::Hole, "zeros");
        // Every single-byte change of the header makes it a hole.
        for i in 0..RECORD_HEADER_LEN as usize + 8 {
            let mut bad = b.clone();
            bad[i] ^= 0x40;
            assert_eq!(decode_record(&bad, 42, 512, 1 << 20), Found::Hole, "byte {i}");
        }
    }

    /// Data that does not match the writer's CRCs is damaged, never
    /// returned as a record.
    #[test]
    fn torn_data_is_damaged() {
        let mut b = data_record(1, 0, &[9u8; 8192]);
        let last = b.len() - 600;
        b[last] ^= 1;
        match decode_record(&b, 42, 0, 1 << 20) {
            Found::Damaged { seq: 1, ring_len, .. } => assert_eq!(ring_len, b.len() as u64),
            other => panic!("{other:?}"),
        }
    }

    /// Garbage never panics the decoder, whatever its length.
    #[test]
    fn garbage_never_panics() {
        use proptest::prelude::*;
        proptest!(|(mut bytes in proptest::collection::vec(any::<u8>(), 0..2048), magic in any::<bool>())| {
            if magic && bytes.len() >= 8 {
                bytes[..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
                bytes[4] = 1;
            }
            let _ = decode_record(&bytes, 42, 0, 1 << 20);
            let _ = Head::decode(&bytes);
        });
    }

    #[test]
    fn heads_round_trip_and_the_newest_counts() {
        let h =
            Head { journal_id: 5, disk_id: 6, ring_len: RING_MIN, seq: 10, position: 4096, overflow_id: 0 };
        let b = h.encode();
        assert_eq!(Head::decode(&b), Some(h));
        let mut torn = b.clone();
        torn[50] ^= 1;
        assert_eq!(Head::decode(&torn), None);
        let newer = Head { seq: 11, ..h };
        assert_eq!(Head::newest(Some(h), Some(newer)), Some(newer));
        assert_eq!(Head::newest(None, Some(h)), Some(h));
        assert_eq!(Head::newest(Some(h), Some(Head { journal_id: 9, ..newer })), None);
    }

    /// A head naming a second area keeps it; a version 1 head (written
    /// before there were second areas) still reads, as naming none.
    #[test]
    fn heads_name_their_second_area_and_version_1_still_reads() {
        let h =
            Head { journal_id: 5, disk_id: 6, ring_len: RING_MIN, seq: 10, position: 4096, overflow_id: 77 };
        assert_eq!(Head::decode(&h.encode()), Some(h));
        let mut v1 = h.encode();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        let crc = crc32c(&v1[..HEAD_BODY_V1]);
        v1[HEAD_BODY_V1..HEAD_BODY_V1 + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Head::decode(&v1), Some(Head { overflow_id: 0, ..h }));
        // An unknown version is not read, whatever its CRC says.
        let mut v3 = h.encode();
        v3[4..8].copy_from_slice(&3u32.to_le_bytes());
        let crc = crc32c(&v3[..HEAD_BODY]);
        v3[HEAD_BODY..HEAD_BODY + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(Head::decode(&v3), None);
    }

    #[test]
    fn records_never_cross_the_rings_end() {
        assert_eq!(place(0, 4096, 8192), 0);
        assert_eq!(place(4096, 4096, 8192), 4096);
        assert_eq!(place(8192 + 6144, 4096, 8192), 16384);
        assert_eq!(place(6144, 2048, 8192), 6144);
    }
}
