//! On-blob formats of the log: the expanded block and the checkpoint.
//!
//! Expanded block = the virtual block's data followed by one 4 KiB header
//! chunk (its own chunk, so writing a block never rewrites bytes of a
//! neighbour):
//!
//! ```text
//!  0 magic "BLOG"  4 kind u8 (1 data, 2 trim)  8 virtual block u64
//! 16 epoch u64    24 lsn u64    32 checkpoint seq u64    40 crc u32
//! ```
//! The CRC32C covers header bytes 0..40 and, for data, the block's data.
//! A trim record is written as its header chunk alone (its data part keeps
//! whatever the physical block held, possibly bytes a crash left torn), so
//! its header chunk is all there is to check: recovery reads the header
//! first and reads the data part only for a data record.
//! Roll-forward accepts a block only if its CRC holds, its LSN is the next
//! expected one and its checkpoint seq is the current checkpoint's: the LSN
//! tells this cycle's write from a stale one left by an earlier cycle of
//! the permutation, and the checkpoint seq tells it from a write a crashed
//! incarnation made after the point its recovery stopped at.
//!
//! Checkpoint = header + block map (u32 per virtual block, `u32::MAX` =
//! unmapped), CRC32C over all of it, written to one of two slots
//! alternately.

use blizzard_core::crc::{crc32c, crc32c_append};

use super::perm::Permutation;

pub const HEADER_LEN: u32 = 4096;
const BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"BLOG");
const CKPT_MAGIC: [u8; 8] = *b"BLZCKPT1";
pub const UNMAPPED: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Data = 1,
    Trim = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub kind: Kind,
    pub vblock: u64,
    pub epoch: u64,
    pub lsn: u64,
    pub ckpt_seq: u64,
}

fn header_fields(h: &BlockHeader) -> [u8; 40] {
    let mut b = [0u8; 40];
    b[0..4].copy_from_slice(&BLOCK_MAGIC.to_le_bytes());
    b[4] = h.kind as u8;
    b[8..16].copy_from_slice(&h.vblock.to_le_bytes());
    b[16..24].copy_from_slice(&h.epoch.to_le_bytes());
    b[24..32].copy_from_slice(&h.lsn.to_le_bytes());
    b[32..40].copy_from_slice(&h.ckpt_seq.to_le_bytes());
    b
}

fn block_crc(fields: &[u8; 40], kind: Kind, data: &[u8]) -> u32 {
    let c = crc32c(fields);
    match kind {
        Kind::Data => crc32c_append(c, data),
        Kind::Trim => c,
    }
}

/// The header chunk for a block with `data` (ignored for trims).
pub fn encode_header(h: &BlockHeader, data: &[u8]) -> Vec<u8> {
    let f = header_fields(h);
    let crc = block_crc(&f, h.kind, data);
    let mut b = Vec::with_capacity(HEADER_LEN as usize);
    b.extend_from_slice(&f);
    b.extend_from_slice(&crc.to_le_bytes());
    b.resize(HEADER_LEN as usize, 0);
    b
}

/// A header chunk's fields and its stored CRC, not yet checked: the CRC of
/// a data record also covers the data part, read separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawHeader {
    pub header: BlockHeader,
    fields: [u8; 40],
    crc: u32,
}

impl RawHeader {
    /// Whether the stored CRC holds over the header and, for a data record,
    /// `data` (ignored for a trim, whose CRC covers its header only).
    pub fn crc_holds(&self, data: &[u8]) -> bool {
        block_crc(&self.fields, self.header.kind, data) == self.crc
    }
}

/// Decodes a header chunk (at least its first 44 bytes); `None` unless it
/// has the magic and a known kind.
pub fn decode_header(hdr: &[u8]) -> Option<RawHeader> {
    if hdr.len() < 44 {
        return None;
    }
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&hdr[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) != BLOCK_MAGIC {
        return None;
    }
    let kind = match hdr[4] {
        1 => Kind::Data,
        2 => Kind::Trim,
        _ => return None,
    };
    let header =
        BlockHeader { kind, vblock: u64_at(8), epoch: u64_at(16), lsn: u64_at(24), ckpt_seq: u64_at(32) };
    let mut fields = [0u8; 40];
    fields.copy_from_slice(&hdr[..40]);
    let crc = u32::from_le_bytes([hdr[40], hdr[41], hdr[42], hdr[43]]);
    Some(RawHeader { header, fields, crc })
}

/// Decodes an expanded block (`data ++ header chunk`); `None` if it is not
/// an intact expanded block. With `check_crc` false the CRC is ignored
/// (only for the planted bug that shows the checker catches it).
pub fn decode_block(expanded: &[u8], block_size: usize, check_crc: bool) -> Option<BlockHeader> {
    if expanded.len() != block_size + HEADER_LEN as usize {
        return None;
    }
    let (data, hdr) = expanded.split_at(block_size);
    let raw = decode_header(hdr)?;
    if check_crc && !raw.crc_holds(data) {
        return None;
    }
    Some(raw.header)
}

/// A checkpoint: enough to resume the log without reading it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub seq: u64,
    /// LSN the next write gets.
    pub next_lsn: u64,
    pub epoch: u64,
    pub perm: Permutation,
    /// Physical block of each virtual block, or `UNMAPPED`.
    pub map: Vec<u32>,
}

const CKPT_HEADER: usize = 8 + 8 * 9 + 4;

impl Checkpoint {
    pub fn encoded_len(vblocks: u64) -> u64 {
        CKPT_HEADER as u64 + vblocks * 4 + 4
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::encoded_len(self.map.len() as u64) as usize);
        b.extend_from_slice(&CKPT_MAGIC);
        for v in [
            self.seq,
            self.next_lsn,
            self.epoch,
            self.perm.n,
            self.perm.m,
            self.perm.a,
            self.perm.c,
            self.perm.x,
            self.map.len() as u64,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&[0u8; 4]);
        for m in &self.map {
            b.extend_from_slice(&m.to_le_bytes());
        }
        let crc = crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a slot's bytes; `None` unless intact and for `vblocks` blocks.
    pub fn decode(b: &[u8], vblocks: u64) -> Option<Checkpoint> {
        let len = Self::encoded_len(vblocks) as usize;
        if b.len() < len || b[..8] != CKPT_MAGIC {
            return None;
        }
        let crc = u32::from_le_bytes([b[len - 4], b[len - 3], b[len - 2], b[len - 1]]);
        if crc32c(&b[..len - 4]) != crc {
            return None;
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[8 + i * 8..16 + i * 8]);
            u64::from_le_bytes(a)
        };
        if u64_at(8) != vblocks {
            return None;
        }
        let perm = Permutation { n: u64_at(3), m: u64_at(4), a: u64_at(5), c: u64_at(6), x: u64_at(7) };
        if perm.m == 0 || !perm.m.is_power_of_two() || perm.n > perm.m || perm.x >= perm.m {
            return None;
        }
        let map = b[CKPT_HEADER..len - 4]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some(Checkpoint { seq: u64_at(0), next_lsn: u64_at(1), epoch: u64_at(2), perm, map })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks and checkpoints round-trip; damage, a wrong size or a torn
    /// data part are refused.
    #[test]
    fn records_round_trip_and_refuse_damage() {
        let h = BlockHeader { kind: Kind::Data, vblock: 7, epoch: 3, lsn: 99, ckpt_seq: 2 };
        let data = vec![5u8; 4096];
        let mut exp = data.clone();
        exp.extend_from_slice(&encode_header(&h, &data));
        assert_eq!(decode_block(&exp, 4096, true), Some(h));
        exp[100] ^= 1;
        assert_eq!(decode_block(&exp, 4096, true), None);
        assert_eq!(decode_block(&exp, 4096, false), Some(h), "without the CRC, torn data passes");
        assert_eq!(decode_block(&exp[..8000], 4096, true), None);

        // A trim's CRC covers its header only: any data part passes, and
        // the header chunk alone decides.
        let t = BlockHeader { kind: Kind::Trim, vblock: 7, epoch: 3, lsn: 100, ckpt_seq: 2 };
        let hdr = encode_header(&t, &[]);
        let raw = decode_header(&hdr).expect("a trim header decodes");
        assert_eq!(raw.header, t);
        assert!(raw.crc_holds(&[0xee; 4096]));
        let mut garbage = vec![0xeeu8; 4096];
        garbage.extend_from_slice(&hdr);
        assert_eq!(decode_block(&garbage, 4096, true), Some(t));
        // A data header's CRC needs its data; a damaged header fails.
        let raw = decode_header(&exp[4096..]).expect("a data header decodes");
        assert!(raw.crc_holds(&data) && !raw.crc_holds(&exp[..4096]));
        let mut bad = hdr.clone();
        bad[30] ^= 1;
        assert!(decode_header(&bad).is_some_and(|r| !r.crc_holds(&[])));
        assert_eq!(decode_header(&hdr[..43]), None);

        let c = Checkpoint {
            seq: 4,
            next_lsn: 10,
            epoch: 2,
            perm: Permutation::new(50, 9),
            map: vec![1, UNMAPPED, 3],
        };
        let mut b = c.encode();
        assert_eq!(Checkpoint::decode(&b, 3), Some(c.clone()));
        assert_eq!(Checkpoint::decode(&b, 4), None);
        b.resize(b.len() + 100, 0xaa);
        assert_eq!(Checkpoint::decode(&b, 3), Some(c));
        b[20] ^= 1;
        assert_eq!(Checkpoint::decode(&b, 3), None);
    }
}
