//! Frame header: 32 bytes, little-endian.
//!
//! ```text
//!  0 magic      u32  "BLZD"
//!  4 version    u8   5
//!  5 kind       u8   0 request, 1 response, 2 request-to-send, 3 clear-to-send
//!  6 opcode     u16
//!  8 request_id u64  echoed in the response
//! 16 meta_len   u32  <= FRAME_META_MAX
//! 20 data_len   u32  <= FRAME_DATA_MAX
//! 24 meta_crc   u32  CRC32C of the meta part
//! 28 header_crc u32  CRC32C of bytes 0..28
//! ```
//!
//! A header that fails any check leaves the stream unframed: the receiver
//! answers once with an error and closes the connection.
//!
//! Kinds 2 and 3 carry receiver-driven flow control (FDS §4, `flow`): a
//! request-to-send announces a large request by its id and opcode, and
//! the receiver answers with a clear-to-send when the request may follow.
//! Neither has a data part, and their meta part is at most
//! [`FLOW_META_MAX`] bytes, checked here before anything is read.
//!
//! Version 5 added kinds 2 and 3: a version 4 peer would take them for a
//! corrupt stream, so the version byte refuses the mix up front. Version 6
//! added a tractserver's disk class to heartbeats and the cluster status.
//! Version 7 added a table's sections by placement (design 0009) to
//! tables and assignments. Version 8 added `CopyTractChanges`, the
//! incremental repair of a member back in a row (design 0009).

use blizzard_core::crc::crc32c;
use blizzard_core::limits::{FRAME_DATA_MAX, FRAME_META_MAX};

pub const MAGIC: u32 = u32::from_le_bytes(*b"BLZD");
pub const VERSION: u8 = 8;
pub const HEADER_LEN: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    Request = 0,
    Response = 1,
    /// Request-to-send: a large request (its id and opcode in the header,
    /// its data length in the meta part) waits for the receiver's grant.
    Rts = 2,
    /// Clear-to-send: the request with this id may be sent now.
    Cts = 3,
}

impl FrameKind {
    /// Whether frames of this kind are flow control (no data part, a tiny
    /// meta part) rather than a request or its reply.
    pub fn is_flow(self) -> bool {
        matches!(self, FrameKind::Rts | FrameKind::Cts)
    }
}

/// Largest meta part of a flow-control frame (a request-to-send's is 4
/// bytes; the rest is room to grow without a new version).
pub const FLOW_META_MAX: u32 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: FrameKind,
    pub opcode: u16,
    pub request_id: u64,
    pub meta_len: u32,
    pub data_len: u32,
    pub meta_crc: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    #[error("bad magic {0:#010x}: the peer does not speak the blizzard blob protocol")]
    BadMagic(u32),
    #[error("unsupported protocol version {0} (this build speaks {VERSION}): upgrade the older side")]
    BadVersion(u8),
    #[error("bad frame kind {0}")]
    BadKind(u8),
    #[error("frame header CRC mismatch: the connection is corrupt")]
    HeaderCrc,
    #[error("frame meta part of {0} bytes exceeds the limit")]
    MetaTooLong(u32),
    #[error("frame data part of {0} bytes exceeds the limit")]
    DataTooLong(u32),
    #[error("frame meta CRC mismatch")]
    MetaCrc,
    #[error("flow-control frame with a meta part of {meta_len} bytes and a data part of {data_len}")]
    FlowTooLong { meta_len: u32, data_len: u32 },
}

impl FrameHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6..8].copy_from_slice(&self.opcode.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..20].copy_from_slice(&self.meta_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.data_len.to_le_bytes());
        b[24..28].copy_from_slice(&self.meta_crc.to_le_bytes());
        let crc = crc32c(&b[0..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Checks magic, version, header CRC and length bounds. After this the
    /// lengths are safe to allocate.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<FrameHeader, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::BadVersion(b[4]));
        }
        if crc32c(&b[0..28]) != u32_at(28) {
            return Err(FrameError::HeaderCrc);
        }
        let kind = match b[5] {
            0 => FrameKind::Request,
            1 => FrameKind::Response,
            2 => FrameKind::Rts,
            3 => FrameKind::Cts,
            k => return Err(FrameError::BadKind(k)),
        };
        let meta_len = u32_at(16);
        let data_len = u32_at(20);
        if meta_len > FRAME_META_MAX {
            return Err(FrameError::MetaTooLong(meta_len));
        }
        if data_len > FRAME_DATA_MAX {
            return Err(FrameError::DataTooLong(data_len));
        }
        if kind.is_flow() && (meta_len > FLOW_META_MAX || data_len != 0) {
            return Err(FrameError::FlowTooLong { meta_len, data_len });
        }
        Ok(FrameHeader {
            kind,
            opcode: u16::from_le_bytes([b[6], b[7]]),
            request_id: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
            meta_len,
            data_len,
            meta_crc: u32_at(24),
        })
    }

    pub fn check_meta(&self, meta: &[u8]) -> Result<(), FrameError> {
        if crc32c(meta) == self.meta_crc {
            Ok(())
        } else {
            Err(FrameError::MetaCrc)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> FrameHeader {
        FrameHeader {
            kind: FrameKind::Request,
            opcode: 0x0101,
            request_id: 7,
            meta_len: 10,
            data_len: 4096,
            meta_crc: 0xdead_beef,
        }
    }

    /// The header's bytes are pinned: changing them is a protocol change.
    #[test]
    fn header_golden_bytes() {
        let b = sample().encode();
        assert_eq!(&b[0..4], b"BLZD");
        assert_eq!(
            b[..28],
            [
                0x42, 0x4c, 0x5a, 0x44, 8, 0, 0x01, 0x01, 7, 0, 0, 0, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x10, 0, 0,
                0xef, 0xbe, 0xad, 0xde
            ]
        );
        assert_eq!(FrameHeader::decode(&b), Ok(sample()));
    }

    /// Every single-bit corruption of a header is rejected.
    #[test]
    fn any_flipped_bit_is_rejected() {
        let good = sample().encode();
        for i in 0..HEADER_LEN * 8 {
            let mut b = good;
            b[i / 8] ^= 1 << (i % 8);
            assert!(FrameHeader::decode(&b).is_err(), "bit {i} flip accepted");
        }
    }

    /// Request-to-send and clear-to-send headers are pinned too.
    #[test]
    fn flow_header_golden_bytes() {
        let rts = FrameHeader {
            kind: FrameKind::Rts,
            opcode: 0x0101,
            request_id: 9,
            meta_len: 4,
            data_len: 0,
            meta_crc: 0x0102_0304,
        };
        let b = rts.encode();
        assert_eq!(
            b[..28],
            [
                0x42, 0x4c, 0x5a, 0x44, 8, 2, 0x01, 0x01, 9, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 4,
                3, 2, 1
            ]
        );
        assert_eq!(FrameHeader::decode(&b), Ok(rts));
        let cts = FrameHeader { kind: FrameKind::Cts, meta_len: 0, meta_crc: crc32c(&[]), ..rts };
        assert_eq!(cts.encode()[5], 3);
        assert_eq!(FrameHeader::decode(&cts.encode()), Ok(cts));
    }

    /// A flow-control header announcing data, or a meta part over its
    /// bound, is refused before anything is read.
    #[test]
    fn flow_frames_are_bounded() {
        let rts = FrameHeader {
            kind: FrameKind::Rts,
            opcode: 0x0101,
            request_id: 9,
            meta_len: 4,
            data_len: 0,
            meta_crc: 0,
        };
        let with_data = FrameHeader { data_len: 1, ..rts };
        assert_eq!(
            FrameHeader::decode(&with_data.encode()),
            Err(FrameError::FlowTooLong { meta_len: 4, data_len: 1 })
        );
        let long = FrameHeader { kind: FrameKind::Cts, meta_len: FLOW_META_MAX + 1, ..rts };
        assert_eq!(
            FrameHeader::decode(&long.encode()),
            Err(FrameError::FlowTooLong { meta_len: FLOW_META_MAX + 1, data_len: 0 })
        );
        let mut b = rts.encode();
        b[5] = 4;
        let crc = crc32c(&b[0..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::BadKind(4)));
    }

    #[test]
    fn oversized_lengths_are_rejected() {
        let mut h = sample();
        h.data_len = FRAME_DATA_MAX + 1;
        assert_eq!(FrameHeader::decode(&h.encode()), Err(FrameError::DataTooLong(FRAME_DATA_MAX + 1)));
        let mut h = sample();
        h.meta_len = u32::MAX;
        assert_eq!(FrameHeader::decode(&h.encode()), Err(FrameError::MetaTooLong(u32::MAX)));
    }
}
