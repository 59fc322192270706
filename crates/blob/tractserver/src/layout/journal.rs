//! The chunk-entry journal's on-disk format: records, heads and the scan
//! of the ring at open. Pure encoding and decoding; the store does the
//! I/O and keeps the ring (`store::journal`).
//!
//! Why a journal: every tract write changes the chunk entries (16 bytes
//! each) of the chunks it covers. Written in place, they dirtied a second
//! page per write, so every group commit sent the device two random writes
//! per tract write: one for the data, one for the chunk table's page.
//! Appended to a ring instead, the records of all the writes of a group
//! share a page or two, and the device sees about one random write per
//! tract write. Checkpoints copy the entries into the chunk table now and
//! then (one page for hundreds of records) and free the ring behind them.
//!
//! Record, little endian, at a multiple of [`RECORD_ALIGN`] in the ring and
//! never across its end:
//!
//! ```text
//!  0  magic "BLZJ"          4  len: bytes, padding included (a multiple of 64)
//!  8  seq                  16  slot       20  first chunk      24  count
//! 28  CRC32C of bytes 0..28 and of the entries
//! 32  count chunk entries of 16 bytes (layout::ChunkEntry), zeros up to len
//! ```
//!
//! A record sets entries `first..first + count` of `slot` to the values it
//! holds, as an in-place write of them did before format version 5.
//!
//! Head, in one of two 4 KiB slots written alternately (the newer valid
//! one counts, so a torn head leaves the other):
//!
//! ```text
//!  0  magic "BLZH"   4  version (1)   8  seq   16  position   24  CRC32C of 0..24
//! ```
//!
//! `seq` is the first record the chunk table may lack, `position` where it
//! lies: a logical offset, which only grows; the ring offset is it modulo
//! the ring's length. Every record before `position` has a lower `seq` and
//! is in the chunk table (`store::journal` keeps that true: a checkpoint
//! writes the table and syncs it before the head moves, and the ring
//! behind the durable head is the only space reused).

use blizzard_core::crc::{crc32c, crc32c_append};

use super::{ChunkEntry, CHUNK_ENTRY_LEN};

/// Records start on this boundary, so a scan can find them again after a
/// hole (a record reserved but never written, or torn).
pub const RECORD_ALIGN: u64 = 64;
/// Bytes before a record's entries.
pub const RECORD_HEADER_LEN: u64 = 32;
/// Entries per record at most (a whole 8 MiB tract); a larger change is
/// several records, appended in order.
pub const RECORD_ENTRIES_MAX: u32 = 2048;
/// Bytes of one head slot.
pub const JOURNAL_HEAD_LEN: u64 = 4096;

const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"BLZJ");
const HEAD_MAGIC: u32 = u32::from_le_bytes(*b"BLZH");
const HEAD_VERSION: u32 = 1;
const HEAD_BODY: usize = 24;

const _: () = assert!(RECORD_HEADER_LEN + RECORD_ENTRIES_MAX as u64 * CHUNK_ENTRY_LEN <= u32::MAX as u64);
const _: () = assert!(RECORD_HEADER_LEN.is_multiple_of(CHUNK_ENTRY_LEN));
const _: () = assert!(JOURNAL_HEAD_LEN.is_multiple_of(RECORD_ALIGN));

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

/// Bytes of one record of `count` entries, padding included.
pub fn record_len(count: u32) -> u64 {
    align_up(RECORD_HEADER_LEN + count as u64 * CHUNK_ENTRY_LEN, RECORD_ALIGN)
}

/// Bytes of the records a change of `chunks` entries appends (split at
/// [`RECORD_ENTRIES_MAX`]).
pub fn records_len(chunks: u32) -> u64 {
    let full = chunks / RECORD_ENTRIES_MAX;
    let rest = chunks % RECORD_ENTRIES_MAX;
    full as u64 * record_len(RECORD_ENTRIES_MAX) + if rest > 0 { record_len(rest) } else { 0 }
}

/// Ring bytes a change of `chunks` entries may take: its records, and the
/// padding before one of them if it would cross the ring's end (less than
/// the largest record). The credit a change holds before it takes its slot
/// lock (`store::journal`).
pub fn write_credit(chunks: u32) -> u64 {
    records_len(chunks) + record_len(chunks.clamp(1, RECORD_ENTRIES_MAX))
}

/// One record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub slot: u32,
    pub first_chunk: u32,
    pub entries: Vec<ChunkEntry>,
    /// Bytes it takes in the ring.
    pub len: u64,
}

/// Encodes a record setting entries `first_chunk..` of `slot`.
pub fn encode_record(seq: u64, slot: u32, first_chunk: u32, entries: &[ChunkEntry]) -> Vec<u8> {
    debug_assert!(!entries.is_empty() && entries.len() <= RECORD_ENTRIES_MAX as usize);
    let len = record_len(entries.len() as u32);
    let mut b = Vec::with_capacity(len as usize);
    b.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
    b.extend_from_slice(&(len as u32).to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&slot.to_le_bytes());
    b.extend_from_slice(&first_chunk.to_le_bytes());
    b.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    for e in entries {
        e.encode_into(&mut b);
    }
    let crc = crc32c_parts(&b[..28], &b[RECORD_HEADER_LEN as usize..]);
    b[28..32].copy_from_slice(&crc.to_le_bytes());
    b.resize(len as usize, 0);
    b
}

fn crc32c_parts(a: &[u8], b: &[u8]) -> u32 {
    crc32c_append(crc32c(a), b)
}

/// Little-endian readers of checked-length buffers (the backup journal's
/// format uses them too).
pub(crate) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

pub(crate) fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

/// Decodes the record at the start of `b` (which may run on past it), if
/// there is a whole, valid one there naming a chunk range that exists on
/// this disk (`slot_count` slots of `chunks_per_tract` chunks). Anything
/// else (zeros, a torn or half-overwritten record, bit rot) is `None`:
/// bytes read from the disk are checked before they are trusted.
pub fn decode_record(b: &[u8], slot_count: u32, chunks_per_tract: u32) -> Option<Record> {
    if b.len() < RECORD_HEADER_LEN as usize || u32_at(b, 0) != RECORD_MAGIC {
        return None;
    }
    let len = u32_at(b, 4) as u64;
    let count = u32_at(b, 24);
    if count == 0 || count > RECORD_ENTRIES_MAX || len != record_len(count) || len > b.len() as u64 {
        return None;
    }
    let slot = u32_at(b, 16);
    let first_chunk = u32_at(b, 20);
    if slot >= slot_count || first_chunk as u64 + count as u64 > chunks_per_tract as u64 {
        return None;
    }
    let end = (RECORD_HEADER_LEN + count as u64 * CHUNK_ENTRY_LEN) as usize;
    let body = &b[RECORD_HEADER_LEN as usize..end];
    if crc32c_parts(&b[..28], body) != u32_at(b, 28) {
        return None;
    }
    Some(Record {
        seq: u64_at(b, 8),
        slot,
        first_chunk,
        entries: body.chunks_exact(CHUNK_ENTRY_LEN as usize).map(ChunkEntry::decode).collect(),
        len,
    })
}

/// Every valid record in the ring, with its ring offset, in ring order.
/// Live and dead ones alike: which are live is the head's to say (a
/// record's `seq` against the head's).
pub fn scan(ring: &[u8], slot_count: u32, chunks_per_tract: u32) -> Vec<(u64, Record)> {
    let mut found = Vec::new();
    let mut at = 0usize;
    while at + RECORD_HEADER_LEN as usize <= ring.len() {
        match decode_record(&ring[at..], slot_count, chunks_per_tract) {
            Some(r) => {
                let len = r.len as usize;
                found.push((at as u64, r));
                at += len;
            }
            None => at += RECORD_ALIGN as usize,
        }
    }
    found
}

/// Where replay starts: the first record the chunk table may lack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Head {
    /// Records with a lower `seq` are in the chunk table.
    pub seq: u64,
    /// Logical ring position of record `seq` (or of the next one written).
    pub position: u64,
}

impl Head {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(JOURNAL_HEAD_LEN as usize);
        b.extend_from_slice(&HEAD_MAGIC.to_le_bytes());
        b.extend_from_slice(&HEAD_VERSION.to_le_bytes());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.position.to_le_bytes());
        let crc = crc32c(&b[..HEAD_BODY]);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(JOURNAL_HEAD_LEN as usize, 0);
        b
    }

    /// A valid head, or `None` (a slot never written, torn or rotted).
    pub fn decode(b: &[u8]) -> Option<Head> {
        if b.len() < HEAD_BODY + 4 || u32_at(b, 0) != HEAD_MAGIC || u32_at(b, 4) != HEAD_VERSION {
            return None;
        }
        if crc32c(&b[..HEAD_BODY]) != u32_at(b, HEAD_BODY) {
            return None;
        }
        Some(Head { seq: u64_at(b, 8), position: u64_at(b, 16) })
    }

    /// The head in force given both slots' bytes, and which slot holds it:
    /// the valid one with the higher `seq`; none valid (a fresh disk) is
    /// the start of the ring, kept in slot 0 so the next goes to slot 1.
    pub fn newest(a: &[u8], b: &[u8]) -> (Head, u8) {
        match (Head::decode(a), Head::decode(b)) {
            (Some(x), Some(y)) if y.seq > x.seq => (y, 1),
            (Some(x), _) => (x, 0),
            (None, Some(y)) => (y, 1),
            (None, None) => (Head::default(), 0),
        }
    }
}

/// The ring as open finds it: the records to replay (those at or after the
/// head, in `seq` order) and where appending goes on.
#[derive(Debug, PartialEq, Eq)]
pub struct Replay {
    pub records: Vec<Record>,
    /// The logical position after the last live record (the head's if none).
    pub cursor: u64,
    /// The `seq` the next record gets.
    pub next_seq: u64,
}

/// Why a ring cannot be replayed.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("the chunk-entry journal is inconsistent: {0}; the disk was changed by something other than this tractserver (restore it or reformat it)")]
pub struct ReplayError(pub String);

/// Picks the live records out of a scanned ring of `ring_len` bytes: those
/// with `seq >= head.seq`. They must lie in `seq` order from the head's
/// position on, each inside the ring's one lap after it: a writer never
/// appends a record before the previous one or over a live one, so
/// anything else means the ring is not what this code wrote.
pub fn replay(found: Vec<(u64, Record)>, head: Head, ring_len: u64) -> Result<Replay, ReplayError> {
    let start = head.position % ring_len;
    let mut live: Vec<(u64, Record)> = found
        .into_iter()
        .filter(|(_, r)| r.seq >= head.seq)
        .map(|(at, r)| (head.position + (at + ring_len - start) % ring_len, r))
        .collect();
    live.sort_by_key(|(_, r)| r.seq);
    let mut cursor = head.position;
    let mut next_seq = head.seq;
    for (logical, r) in &live {
        if *logical < cursor || logical + r.len > head.position + ring_len || r.seq < next_seq {
            return Err(ReplayError(format!(
                "record {} lies at ring position {logical}, before the end of the one before it ({cursor})",
                r.seq
            )));
        }
        cursor = logical + r.len;
        next_seq = r.seq + 1;
    }
    Ok(Replay { records: live.into_iter().map(|(_, r)| r).collect(), cursor, next_seq })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entries(n: u32, seed: u32) -> Vec<ChunkEntry> {
        (0..n)
            .map(|i| ChunkEntry { crc: seed ^ i, generation: 3, prev_crc: i, prev_generation: i % 2 * 3 })
            .collect()
    }

    /// Record sizes: header plus entries, aligned; a change is split at
    /// the largest record; a change's credit covers its records and one
    /// padding.
    #[test]
    fn sizes() {
        assert_eq!(record_len(1), 64);
        assert_eq!(record_len(2), 64);
        assert_eq!(record_len(3), 128);
        assert_eq!(record_len(RECORD_ENTRIES_MAX), 32 + 2048 * 16 + 32);
        assert_eq!(records_len(RECORD_ENTRIES_MAX + 1), record_len(RECORD_ENTRIES_MAX) + 64);
        assert_eq!(records_len(16384), 8 * record_len(RECORD_ENTRIES_MAX));
        assert_eq!(write_credit(1), 128);
        assert!(write_credit(16384) < 2 * records_len(16384));
    }

    /// The pinned bytes of a record and a head: a change here is a format
    /// change.
    #[test]
    fn golden_bytes() {
        let r = encode_record(
            5,
            7,
            9,
            &[ChunkEntry { crc: 0x11, generation: 2, prev_crc: 0x22, prev_generation: 2 }],
        );
        assert_eq!(r.len(), 64);
        assert_eq!(&r[0..4], b"BLZJ");
        assert_eq!(
            &r[4..32],
            &[
                64, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 0x4e, 0x0a, 0x91,
                0xd4
            ]
        );
        assert_eq!(&r[32..48], &[0x11, 0, 0, 0, 2, 0, 0, 0, 0x22, 0, 0, 0, 2, 0, 0, 0]);
        assert!(r[48..].iter().all(|b| *b == 0));
        let h = Head { seq: 3, position: 4096 }.encode();
        assert_eq!(
            &h[..24],
            &[b'B', b'L', b'Z', b'H', 1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0]
        );
    }

    /// A record names only chunks that exist: a slot past the disk's, or a
    /// range past the tract's end, is not a record.
    #[test]
    fn records_outside_the_disk_are_refused() {
        let r = encode_record(1, 4, 14, &entries(2, 1));
        assert!(decode_record(&r, 5, 16).is_some());
        assert!(decode_record(&r, 4, 16).is_none());
        assert!(decode_record(&r, 5, 15).is_none());
    }

    /// Two heads: the newer valid one counts; a torn one leaves the other.
    #[test]
    fn the_newer_valid_head_counts() {
        let a = Head { seq: 10, position: 640 }.encode();
        let b = Head { seq: 12, position: 768 }.encode();
        assert_eq!(Head::newest(&a, &b), (Head { seq: 12, position: 768 }, 1));
        let mut torn = b.clone();
        torn[17] ^= 1;
        assert_eq!(Head::newest(&a, &torn), (Head { seq: 10, position: 640 }, 0));
        assert_eq!(Head::newest(&[0; 4096], &[0; 4096]), (Head::default(), 0));
    }

    /// Replay of a ring that wrapped: records before the head are dead;
    /// a hole (reserved, never written) is skipped; the live ones come
    /// back in order with the cursor after the last.
    #[test]
    fn replay_picks_live_records_across_the_wrap() -> Result<(), ReplayError> {
        let ring_len = 1024u64;
        let mut ring = vec![0u8; ring_len as usize];
        let put =
            |ring: &mut Vec<u8>, at: usize, rec: Vec<u8>| ring[at..at + rec.len()].copy_from_slice(&rec);
        // The previous lap: seqs 1..4 at 0, 64, 128 (dead: the head is past them).
        for s in 1..4u64 {
            put(&mut ring, (s as usize - 1) * 64, encode_record(s, 0, 0, &entries(1, s as u32)));
        }
        // Live, from logical 1856 (ring offset 832): 10 at 832, 11 at 896
        // (128 bytes), a pad to the end, then 12 a hole at 0, 13 at 64.
        put(&mut ring, 832, encode_record(10, 1, 0, &entries(2, 10)));
        put(&mut ring, 896, encode_record(11, 1, 2, &entries(3, 11)));
        put(&mut ring, 64, encode_record(13, 2, 0, &entries(1, 13)));
        let found = scan(&ring, 4, 16);
        assert_eq!(found.iter().map(|(_, r)| r.seq).collect::<Vec<_>>(), vec![1, 13, 3, 10, 11]);
        let r = replay(found, Head { seq: 10, position: 1856 }, ring_len)?;
        assert_eq!(r.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![10, 11, 13]);
        assert_eq!(r.cursor, 2048 + 128);
        assert_eq!(r.next_seq, 14);
        assert_eq!(r.records[1].entries, entries(3, 11));
        Ok(())
    }

    /// A live record out of order with its position is not something this
    /// code writes: replay refuses it instead of guessing.
    #[test]
    fn replay_refuses_records_out_of_order() {
        let mut ring = vec![0u8; 1024];
        ring[0..64].copy_from_slice(&encode_record(6, 0, 0, &entries(1, 1)));
        ring[64..128].copy_from_slice(&encode_record(5, 0, 0, &entries(1, 2)));
        let found = scan(&ring, 1, 16);
        assert!(replay(found, Head { seq: 5, position: 0 }, 1024).is_err());
    }

    proptest! {
        /// A record survives a round trip; flipping any bit of its header
        /// or entries (or cutting it short) makes it no record at all.
        #[test]
        fn records_detect_damage(seq in any::<u64>(), slot in 0u32..100, n in 1u32..40, flip in any::<prop::sample::Index>(), bit in 0u8..8) {
            let es = entries(n, seq as u32);
            let rec = encode_record(seq, slot, 0, &es);
            let got = decode_record(&rec, 100, 64).ok_or_else(|| TestCaseError::fail("no record"))?;
            prop_assert_eq!(got, Record { seq, slot, first_chunk: 0, entries: es, len: rec.len() as u64 });
            let body = (RECORD_HEADER_LEN + n as u64 * CHUNK_ENTRY_LEN) as usize;
            let mut bad = rec.clone();
            bad[flip.index(body)] ^= 1 << bit;
            prop_assert!(decode_record(&bad, 100, 64).is_none());
            prop_assert!(decode_record(&rec[..rec.len() - 1], 100, 64).is_none());
        }

        /// Garbage never decodes as a record naming chunks outside the disk,
        /// and the scan of any bytes ends (it always moves on).
        #[test]
        fn scan_of_garbage_is_bounded(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            for (at, r) in scan(&bytes, 8, 16) {
                prop_assert!(r.slot < 8 && r.first_chunk as usize + r.entries.len() <= 16);
                prop_assert!(at % RECORD_ALIGN == 0);
            }
        }
    }
}
