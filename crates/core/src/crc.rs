//! End-to-end integrity. A range of a tract travels and rests as *pieces*:
//! the range cut at every `CHUNK_SIZE` boundary of the tract, each piece with
//! its own CRC32C. A writer computes the pieces' CRCs; the tractserver
//! verifies them before storing and keeps one CRC per chunk; a reader gets
//! per-piece CRCs back and verifies them after the bytes have crossed the
//! network. An aligned chunk's CRC is the writer's own, untouched on the way.

use crate::limits::CHUNK_SIZE;

/// CRC32C (Castagnoli, CRC-32/ISCSI) of `data`: the one checksum of
/// pieces, frames and records everywhere in blizzard. Every crate computes
/// it through this module, so the implementation (crc-fast, `Cargo.toml`
/// says why) is chosen once.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The CRC32C of `a ++ data`, given `crc == crc32c(a)`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The digest's state is the register before the final inversion.
    let mut d = crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    // A CRC-32 digest's value fits in 32 bits.
    d.finalize() as u32
}

/// The pieces of the byte range `[offset, offset + len)` of a tract, as
/// `(start, end)` offsets relative to `offset`.
pub fn pieces(offset: u32, len: u32) -> impl Iterator<Item = (usize, usize)> {
    let chunk = CHUNK_SIZE as u64;
    let start = offset as u64;
    let end = start + len as u64;
    let mut at = start;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let next = ((at / chunk + 1) * chunk).min(end);
        let piece = ((at - start) as usize, (next - start) as usize);
        at = next;
        Some(piece)
    })
}

/// Number of pieces `pieces(offset, len)` yields.
pub fn piece_count(offset: u32, len: u32) -> usize {
    if len == 0 {
        return 0;
    }
    let chunk = CHUNK_SIZE as u64;
    let first = offset as u64 / chunk;
    let last = (offset as u64 + len as u64 - 1) / chunk;
    (last - first + 1) as usize
}

/// CRC32C of each piece of `data`, which sits at `offset` in its tract.
pub fn piece_crcs(offset: u32, data: &[u8]) -> Vec<u32> {
    pieces(offset, data.len() as u32).map(|(s, e)| crc32c(&data[s..e])).collect()
}

/// The first piece whose CRC does not match, if any. `crcs` must have one
/// entry per piece; a count mismatch is reported as piece 0.
pub fn first_bad_piece(offset: u32, data: &[u8], crcs: &[u32]) -> Option<usize> {
    if crcs.len() != piece_count(offset, data.len() as u32) {
        return Some(0);
    }
    pieces(offset, data.len() as u32).zip(crcs).position(|((s, e), &c)| crc32c(&data[s..e]) != c)
}

/// CRC32C of `len` zero bytes, without touching memory for them.
pub fn zeros_crc(len: usize) -> u32 {
    static ZEROS: [u8; CHUNK_SIZE as usize] = [0; CHUNK_SIZE as usize];
    let mut crc = 0;
    let mut left = len;
    while left > 0 {
        let n = left.min(ZEROS.len());
        crc = crc32c_append(crc, &ZEROS[..n]);
        left -= n;
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pieces cut exactly at chunk boundaries of the tract, not of the range.
    #[test]
    fn pieces_cut_at_tract_chunk_boundaries() {
        let v: Vec<_> = pieces(4000, 10000).collect();
        assert_eq!(v, vec![(0, 96), (96, 4192), (4192, 8288), (8288, 10000)]);
        assert_eq!(piece_count(4000, 10000), 4);
        assert_eq!(pieces(8192, 4096).collect::<Vec<_>>(), vec![(0, 4096)]);
        assert_eq!(piece_count(0, 0), 0);
    }

    proptest! {
        /// Pieces tile the range, none crosses a chunk boundary, and the
        /// count matches piece_count.
        #[test]
        fn pieces_tile_the_range(offset in 0u32..1<<20, len in 0u32..1<<20) {
            let v: Vec<_> = pieces(offset, len).collect();
            prop_assert_eq!(v.len(), piece_count(offset, len));
            let mut at = 0;
            for (s, e) in v {
                prop_assert_eq!(s, at);
                prop_assert!(e > s);
                let abs_s = offset as usize + s;
                let abs_e = offset as usize + e - 1;
                prop_assert_eq!(abs_s / CHUNK_SIZE as usize, abs_e / CHUNK_SIZE as usize);
                at = e;
            }
            prop_assert_eq!(at, len as usize);
        }

        /// A flipped bit anywhere is found in the piece that holds it.
        #[test]
        fn flipped_bit_is_found(offset in 0u32..20000, len in 1usize..20000, pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let mut data: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let crcs = piece_crcs(offset, &data);
            prop_assert_eq!(first_bad_piece(offset, &data, &crcs), None);
            let p = pos.index(len);
            data[p] ^= 1 << bit;
            let bad = first_bad_piece(offset, &data, &crcs);
            let expect = pieces(offset, len as u32).position(|(s, e)| (s..e).contains(&p));
            prop_assert_eq!(bad, expect);
        }
    }

    /// The catalogue's check value and RFC 3720's vectors.
    #[test]
    fn crc32c_is_castagnoli() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        // RFC 3720, B.4: 32 bytes of zeros, and of 0xff.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    }

    proptest! {
        /// Appending agrees with the one-shot CRC at every split.
        #[test]
        fn append_matches_one_pass(data in prop::collection::vec(any::<u8>(), 0..3000), cut in any::<prop::sample::Index>()) {
            let at = cut.index(data.len() + 1);
            let (a, b) = data.split_at(at);
            let whole = crc32c(&data);
            prop_assert_eq!(crc32c_append(crc32c(a), b), whole);
            prop_assert_eq!(crc32c_append(0, &data), whole);
        }
    }

    #[test]
    fn zeros_crc_matches_memory() {
        for len in [0, 1, 4095, 4096, 4097, 100_000] {
            assert_eq!(zeros_crc(len), crc32c(&vec![0u8; len]));
        }
    }
}
