//! The log's segment format, pure (no I/O): a segment's header and the
//! records that follow it, encoded and checked. `log/mod.rs` places them
//! on disks and scans them at recovery; the table of on-disk states and
//! what recovery does with each is there.
//!
//! A segment (`log-<16 hex digits>`, preallocated) is:
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `BLZRLSEG` |
//! | 8..12 | format version (1) |
//! | 12..16 | header length (64) |
//! | 16..24 | segment number (the file name's) |
//! | 24..32 | salt: a random number drawn when the segment was created |
//! | 32..40 | index of the segment's first record |
//! | 40..48 | the file's length when created |
//! | 48..60 | zero |
//! | 60..64 | CRC32C of bytes 0..60 |
//!
//! then records back to back, each starting 8-byte aligned (the padding is
//! never written and never read):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `BLZr` |
//! | 4..8 | CRC32C, chained (below) |
//! | 8..12 | head length |
//! | 12..16 | body length |
//! | 16..24 | log index |
//! | 24..32 | term |
//! | 32..40 | leader node of the term |
//! | 40..48 | run: a random number drawn at each open and each truncation |
//! | 48.. | the entry's head (`codec::put_entry`), then its body |
//!
//! The CRC covers, in order: the segment's salt, the previous record's CRC
//! (for the first record, the segment header's CRC), header bytes 8..48,
//! the head and the body. So a record counts only in the place it was
//! written, after the record it was written after: a stale record left
//! behind a truncation or a torn tail fails, because the record now before
//! it is a different one (and carries a different run number, even when
//! the same entry was written again); bytes inside an entry's body cannot
//! pose as a record without the salt, which never leaves the disk.

use bytes::{BufMut, Bytes};

use blizzard_core::crc::{crc32c, crc32c_append};
use blizzard_proto::{DecodeError, Reader, Writer};

use crate::codec;
use crate::types::{Entry, LeaderId, LogId};

pub const SEGMENT_MAGIC: [u8; 8] = *b"BLZRLSEG";
pub const SEGMENT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_LEN: u64 = 64;

pub const RECORD_MAGIC: [u8; 4] = *b"BLZr";
pub const RECORD_HEADER_LEN: usize = 48;
/// Records start at multiples of this.
pub const RECORD_ALIGN: u64 = 8;

/// Largest entry (head + body) the log stores: an append of a bigger one
/// is refused. A record that does not fit a standard segment gets a
/// segment of its own, as long as it needs (`LogStore::append`).
pub const ENTRY_LEN_MAX: usize = 64 << 20;

/// Largest record, header included.
pub const RECORD_LEN_MAX: u64 = RECORD_HEADER_LEN as u64 + ENTRY_LEN_MAX as u64;

const _: () = assert!((RECORD_HEADER_LEN as u64).is_multiple_of(RECORD_ALIGN));
const _: () = assert!(SEGMENT_HEADER_LEN.is_multiple_of(RECORD_ALIGN));
const _: () = assert!(RECORD_LEN_MAX <= u32::MAX as u64, "a record's length fits the index's u32");

/// `n` rounded up to the record alignment.
pub fn align(n: u64) -> u64 {
    n.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// The file name of segment `number`.
pub fn segment_name(number: u64) -> String {
    format!("{SEGMENT_PREFIX}{number:016x}")
}

pub const SEGMENT_PREFIX: &str = "log-";

/// The number in a segment's file name, if it is one of ours.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix(SEGMENT_PREFIX)?;
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Why bytes are not a valid segment header or record. All of them mean
/// "not written here, or not completely": the end of the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("{0} bytes, too short")]
    Short(usize),
    #[error("bad magic")]
    Magic,
    #[error("unknown format version {0}")]
    Version(u32),
    #[error("CRC mismatch")]
    Crc,
    #[error("length {0} out of bounds")]
    Length(u64),
}

/// A CRC-valid record whose contents do not make sense: our own bytes we
/// cannot read, which recovery refuses rather than skips.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Undecodable {
    #[error("entry head does not decode: {0}")]
    Decode(#[from] DecodeError),
    #[error("the header says log id {header}, the entry says {entry}")]
    LogId { header: LogId, entry: LogId },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("{0}")]
    Invalid(#[from] Invalid),
    #[error("{0}")]
    Undecodable(#[from] Undecodable),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    pub number: u64,
    pub salt: u64,
    pub first_index: u64,
    pub len: u64,
}

impl SegmentHeader {
    /// The header's bytes and CRC (the first record's chain starts from it).
    pub fn encode(&self) -> (Bytes, u32) {
        let mut b = Vec::with_capacity(SEGMENT_HEADER_LEN as usize);
        b.put_slice(&SEGMENT_MAGIC);
        b.put_u32_le(SEGMENT_VERSION);
        b.put_u32_le(SEGMENT_HEADER_LEN as u32);
        b.put_u64_le(self.number);
        b.put_u64_le(self.salt);
        b.put_u64_le(self.first_index);
        b.put_u64_le(self.len);
        b.put_bytes(0, 12);
        let crc = crc32c(&b);
        b.put_u32_le(crc);
        debug_assert_eq!(b.len() as u64, SEGMENT_HEADER_LEN);
        (Bytes::from(b), crc)
    }

    pub fn decode(b: &[u8]) -> Result<(SegmentHeader, u32), Invalid> {
        if (b.len() as u64) < SEGMENT_HEADER_LEN {
            return Err(Invalid::Short(b.len()));
        }
        if b[0..8] != SEGMENT_MAGIC {
            return Err(Invalid::Magic);
        }
        let crc = le32(b, 60);
        if crc32c(&b[..60]) != crc {
            return Err(Invalid::Crc);
        }
        let version = le32(b, 8);
        if version != SEGMENT_VERSION {
            return Err(Invalid::Version(version));
        }
        if le32(b, 12) as u64 != SEGMENT_HEADER_LEN {
            return Err(Invalid::Length(le32(b, 12) as u64));
        }
        let h = SegmentHeader {
            number: le64(b, 16),
            salt: le64(b, 24),
            first_index: le64(b, 32),
            len: le64(b, 40),
        };
        Ok((h, crc))
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// A record's fixed header, as read from a disk before its CRC is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub crc: u32,
    pub head_len: u32,
    pub body_len: u32,
    pub log_id: LogId,
    pub run: u64,
}

impl RecordHeader {
    /// Checks the magic and bounds the lengths, so the caller knows how
    /// many bytes to read before it allocates anything.
    pub fn parse(b: &[u8]) -> Result<RecordHeader, Invalid> {
        if b.len() < RECORD_HEADER_LEN {
            return Err(Invalid::Short(b.len()));
        }
        if b[0..4] != RECORD_MAGIC {
            return Err(Invalid::Magic);
        }
        let (head_len, body_len) = (le32(b, 8), le32(b, 12));
        let entry_len = head_len as u64 + body_len as u64;
        if entry_len > ENTRY_LEN_MAX as u64 || head_len == 0 {
            return Err(Invalid::Length(entry_len));
        }
        let log_id =
            LogId { leader_id: LeaderId { term: le64(b, 24), node_id: le64(b, 32) }, index: le64(b, 16) };
        Ok(RecordHeader { crc: le32(b, 4), head_len, body_len, log_id, run: le64(b, 40) })
    }

    /// The record's length, header included, padding excluded.
    pub fn len(&self) -> u64 {
        RECORD_HEADER_LEN as u64 + self.head_len as u64 + self.body_len as u64
    }
}

/// An entry encoded as a record, not yet placed: its CRC depends on the
/// segment (salt) and the record before it, known once it is placed.
pub struct Record {
    /// Header (CRC and chain unset until [`Record::seal`]) and head.
    first: Vec<u8>,
    /// The body's pieces: the entry's own `Bytes`, not copies.
    pub body: Vec<Bytes>,
    body_len: usize,
}

impl Record {
    pub fn encode(e: &Entry, run: u64) -> Result<Record, u64> {
        let mut w = Writer::new();
        w.buf.put_bytes(0, RECORD_HEADER_LEN);
        let mut body = Vec::new();
        let body_len = codec::put_entry(&mut w, &mut body, e);
        let head_len = w.buf.len() - RECORD_HEADER_LEN;
        let entry_len = head_len as u64 + body_len as u64;
        if entry_len > ENTRY_LEN_MAX as u64 {
            return Err(entry_len);
        }
        let mut first = w.buf.to_vec();
        let h = &mut first[..RECORD_HEADER_LEN];
        h[0..4].copy_from_slice(&RECORD_MAGIC);
        h[8..12].copy_from_slice(&(head_len as u32).to_le_bytes());
        h[12..16].copy_from_slice(&(body_len as u32).to_le_bytes());
        h[16..24].copy_from_slice(&e.log_id.index.to_le_bytes());
        h[24..32].copy_from_slice(&e.log_id.leader_id.term.to_le_bytes());
        h[32..40].copy_from_slice(&e.log_id.leader_id.node_id.to_le_bytes());
        h[40..48].copy_from_slice(&run.to_le_bytes());
        Ok(Record { first, body, body_len })
    }

    /// Length on disk, header included, padding excluded.
    pub fn len(&self) -> u64 {
        self.first.len() as u64 + self.body_len as u64
    }

    /// Places the record after the one whose CRC is `prev` in the segment
    /// salted `salt`: fills in its CRC and returns it with the header+head
    /// piece (the body pieces follow it on the disk).
    pub fn seal(&mut self, salt: u64, prev: u32) -> (u32, Bytes) {
        let mut crc = chain_start(salt, prev);
        crc = crc32c_append(crc, &self.first[8..]);
        for p in &self.body {
            crc = crc32c_append(crc, p);
        }
        self.first[4..8].copy_from_slice(&crc.to_le_bytes());
        (crc, Bytes::from(std::mem::take(&mut self.first)))
    }
}

fn chain_start(salt: u64, prev: u32) -> u32 {
    let mut seed = [0u8; 12];
    seed[..8].copy_from_slice(&salt.to_le_bytes());
    seed[8..].copy_from_slice(&prev.to_le_bytes());
    crc32c(&seed)
}

/// Checks and decodes the record at the start of `b` (which may run on
/// past it), written in the segment salted `salt` after the record whose
/// CRC is `prev`. The entry's operations are slices of `b`, not copies.
pub fn decode_record(salt: u64, prev: u32, b: &Bytes) -> Result<(RecordHeader, Entry), RecordError> {
    let h = RecordHeader::parse(b)?;
    let len = h.len();
    if (b.len() as u64) < len {
        return Err(Invalid::Short(b.len()).into());
    }
    let len = len as usize;
    let crc = crc32c_append(chain_start(salt, prev), &b[8..len]);
    if crc != h.crc {
        return Err(Invalid::Crc.into());
    }
    let head_end = RECORD_HEADER_LEN + h.head_len as usize;
    let body = b.slice(head_end..len);
    let mut r = Reader::new(&b[RECORD_HEADER_LEN..head_end]);
    let mut at = 0;
    let e = codec::get_entry(&mut r, &body, &mut at).map_err(Undecodable::from)?;
    r.finish().map_err(Undecodable::from)?;
    if at != body.len() {
        return Err(Undecodable::from(DecodeError::Trailing(body.len() - at)).into());
    }
    if e.log_id != h.log_id {
        return Err(Undecodable::LogId { header: h.log_id, entry: e.log_id }.into());
    }
    Ok((h, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::any_entry;
    use proptest::prelude::*;

    /// A record as one buffer, the way a read finds it on the disk.
    fn bytes_of(e: &Entry, salt: u64, prev: u32) -> (Vec<u8>, u32) {
        let mut r = Record::encode(e, 7).expect("small entry");
        let (crc, first) = r.seal(salt, prev);
        let mut all = first.to_vec();
        for p in &r.body {
            all.extend_from_slice(p);
        }
        (all, crc)
    }

    proptest! {
        /// A record decodes to the entry it was made from, with its CRC.
        #[test]
        fn records_round_trip(e in any_entry(), salt in any::<u64>(), prev in any::<u32>()) {
            let (all, crc) = bytes_of(&e, salt, prev);
            let (h, back) = decode_record(salt, prev, &Bytes::from(all.clone())).expect("decodes");
            prop_assert_eq!(back, e);
            prop_assert_eq!(h.crc, crc);
            prop_assert_eq!(h.len(), all.len() as u64);
        }

        /// Any flipped bit, any truncation, another salt or another
        /// predecessor makes a record invalid, never a different entry.
        #[test]
        fn damaged_records_are_refused(
            e in any_entry(), salt in any::<u64>(), prev in any::<u32>(),
            bit in any::<prop::sample::Index>(), cut in any::<prop::sample::Index>(),
        ) {
            let (all, _) = bytes_of(&e, salt, prev);
            let mut flipped = all.clone();
            let bit = bit.index(all.len() * 8);
            flipped[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(matches!(decode_record(salt, prev, &Bytes::from(flipped)), Err(RecordError::Invalid(_))));
            let cut = cut.index(all.len());
            let short = Bytes::from(all[..cut].to_vec());
            prop_assert!(matches!(decode_record(salt, prev, &short), Err(RecordError::Invalid(_))));
            let all = Bytes::from(all);
            prop_assert!(decode_record(salt ^ 1, prev, &all).is_err());
            prop_assert!(decode_record(salt, prev ^ 1, &all).is_err());
        }

        /// Segment headers round trip; any flipped bit is refused.
        #[test]
        fn segment_headers_round_trip(number in any::<u64>(), salt in any::<u64>(), first in any::<u64>(), bit in 0usize..512) {
            let h = SegmentHeader { number, salt, first_index: first, len: 1 << 20 };
            let (b, crc) = h.encode();
            prop_assert_eq!(SegmentHeader::decode(&b), Ok((h, crc)));
            let mut bad = b.to_vec();
            bad[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(SegmentHeader::decode(&bad).is_err());
        }
    }

    /// The body's pieces are the entry's own buffers (zero-copy writes),
    /// and decoding slices them out of the read buffer (zero-copy reads).
    #[test]
    fn records_do_not_copy_bodies() {
        use crate::types::{Batch, Op, OpKind};
        let payload = Bytes::from(vec![7u8; 1000]);
        let e = Entry {
            log_id: crate::codec::tests::log_id(3, 1, 9),
            payload: openraft::EntryPayload::Normal(Batch {
                ops: vec![Op { session: 1, seq: 1, acked_below: 0, kind: OpKind::Update(payload.clone()) }],
            }),
        };
        let mut r = Record::encode(&e, 1).expect("small");
        assert_eq!(r.body.len(), 1);
        assert_eq!(r.body[0].as_ptr(), payload.as_ptr(), "the body goes to the disk as it is");
        let (_, first) = r.seal(5, 6);
        let mut all = first.to_vec();
        all.extend_from_slice(&r.body[0]);
        let all = Bytes::from(all);
        let (_, back) = decode_record(5, 6, &all).expect("decodes");
        let openraft::EntryPayload::Normal(b) = back.payload else { panic!("a batch") };
        let OpKind::Update(op) = &b.ops[0].kind else { panic!("an update") };
        assert_eq!(op.as_ptr(), all[all.len() - 1000..].as_ptr());
    }

    /// Segment names round trip and nothing else parses as one.
    #[test]
    fn segment_names() {
        assert_eq!(segment_name(0x1f), "log-000000000000001f");
        assert_eq!(parse_segment_name(&segment_name(u64::MAX)), Some(u64::MAX));
        for bad in ["log-1f", "log-000000000000001g", "log-000000000000001f.tmp", "raft.meta"] {
            assert_eq!(parse_segment_name(bad), None, "{bad}");
        }
    }
}
