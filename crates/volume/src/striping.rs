//! Nested striping (Blizzard §2.3): the volume's bytes are cut into
//! segments of N tracts; inside a segment, consecutive blocks go round-robin
//! to the segment's N tracts, and the blob store scatters the tracts over
//! disks. A sequential convoy therefore fans out over N disks instead of
//! queueing on one, while any one block stays contiguous in one tract.
//!
//! ```text
//! byte x:  segment = x / (N·T)      rel = x mod (N·T)
//!          block   = rel / B        within = rel mod B
//!          tract   = first + segment·N + block mod N
//!          offset  = (block / N)·B + within
//! ```

/// Where one piece of a request lives in the blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tract: u64,
    pub offset: u32,
    pub len: u32,
    /// Where the piece starts in the request's buffer.
    pub buf_at: usize,
}

/// Pieces of one tract that are contiguous in the tract (not necessarily
/// in the request buffer): one blob-store operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extent {
    pub tract: u64,
    pub offset: u32,
    pub len: u32,
    pub pieces: Vec<Piece>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Striping {
    pub tract_size: u64,
    /// Striping unit B.
    pub block_size: u64,
    /// Tracts per segment N.
    pub segment_tracts: u64,
    /// First tract holding volume data.
    pub first_tract: u64,
}

impl Striping {
    pub fn segment_bytes(&self) -> u64 {
        self.segment_tracts * self.tract_size
    }

    /// Blob tracts needed for `size` bytes of volume (whole segments).
    pub fn tracts_for(&self, size: u64) -> u64 {
        self.first_tract + size.div_ceil(self.segment_bytes()) * self.segment_tracts
    }

    /// The volume bytes whose blocks the first `tracts` blob tracts hold
    /// some of (whole segments, a partial one counted whole: the inverse
    /// of [`Striping::tracts_for`]).
    pub fn bytes_in(&self, tracts: u64) -> u64 {
        tracts.saturating_sub(self.first_tract).div_ceil(self.segment_tracts) * self.segment_bytes()
    }

    /// Where byte `x` of the volume lives: (tract, offset in tract).
    pub fn locate(&self, x: u64) -> (u64, u64) {
        let seg = x / self.segment_bytes();
        let rel = x % self.segment_bytes();
        let block = rel / self.block_size;
        let within = rel % self.block_size;
        let tract = self.first_tract + seg * self.segment_tracts + block % self.segment_tracts;
        (tract, (block / self.segment_tracts) * self.block_size + within)
    }

    /// The pieces of `[offset, offset + len)`, in volume order, each inside
    /// one block.
    pub fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        let mut v = Vec::new();
        let mut at = offset;
        let end = offset + len;
        while at < end {
            let next = ((at / self.block_size + 1) * self.block_size).min(end);
            let (tract, toff) = self.locate(at);
            v.push(Piece {
                tract,
                offset: toff as u32,
                len: (next - at) as u32,
                buf_at: (at - offset) as usize,
            });
            at = next;
        }
        v
    }

    /// The tracts `[offset, offset + len)` touches, ascending, each once.
    pub fn tracts(&self, offset: u64, len: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self.pieces(offset, len).iter().map(|p| p.tract).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The pieces grouped into one extent per run that is contiguous in a
    /// tract, ordered by (tract, offset).
    pub fn extents(&self, offset: u64, len: u64) -> Vec<Extent> {
        let mut ps = self.pieces(offset, len);
        ps.sort_by_key(|p| (p.tract, p.offset));
        let mut out: Vec<Extent> = Vec::new();
        for p in ps {
            match out.last_mut() {
                Some(e) if e.tract == p.tract && e.offset as u64 + e.len as u64 == p.offset as u64 => {
                    e.len += p.len;
                    e.pieces.push(p);
                }
                _ => out.push(Extent { tract: p.tract, offset: p.offset, len: p.len, pieces: vec![p] }),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn s(tract: u64, block: u64, n: u64) -> Striping {
        Striping { tract_size: tract, block_size: block, segment_tracts: n, first_tract: 1 }
    }

    /// Figure 1 of the paper: segment of 2 tracts, blocks alternate.
    #[test]
    fn blocks_alternate_within_a_segment() {
        let st = s(16, 4, 2);
        let got: Vec<_> = (0..12).step_by(4).map(|x| st.locate(x)).collect();
        assert_eq!(got, vec![(1, 0), (2, 0), (1, 4)]);
        // The next segment starts on the next pair of tracts.
        assert_eq!(st.locate(32), (3, 0));
        assert_eq!(st.tracts_for(33), 1 + 4);
    }

    proptest! {
        /// The map is a bijection from volume bytes to blob bytes inside the
        /// data tracts, and extents cover a request exactly once.
        #[test]
        fn map_is_a_bijection(tract_pow in 12u32..16, block_pow in 9u32..13, n in 1u64..6, off in 0u64..200_000, len in 1u64..100_000) {
            let tract = 1u64 << tract_pow;
            let block = (1u64 << block_pow).min(tract);
            let st = s(tract, block, n);
            let mut seen = HashSet::new();
            for x in (off..off + len).step_by(97) {
                let (t, o) = st.locate(x);
                prop_assert!(t >= 1 && t < st.tracts_for(off + len));
                prop_assert!(o < tract);
                prop_assert!(seen.insert((t, o)));
            }
            let ex = st.extents(off, len);
            let total: u64 = ex.iter().map(|e| e.len as u64).sum();
            prop_assert_eq!(total, len);
            let mut bufs: Vec<(usize, u32)> = ex.iter().flat_map(|e| e.pieces.iter().map(|p| (p.buf_at, p.len))).collect();
            bufs.sort();
            let mut at = 0usize;
            for (b, l) in bufs {
                prop_assert_eq!(b, at);
                at += l as usize;
            }
            prop_assert_eq!(at as u64, len);
            for e in &ex {
                prop_assert!(e.offset as u64 + e.len as u64 <= tract);
                let (t, o) = st.locate(off + e.pieces[0].buf_at as u64);
                prop_assert_eq!((t, o as u32), (e.tract, e.offset));
            }
        }
    }

    /// A sequential sweep touches every tract of a segment before reusing one.
    #[test]
    fn sequential_fans_out() {
        let st = s(1 << 20, 4096, 128);
        let tracts: HashSet<u64> = (0..128u64).map(|i| st.locate(i * 4096).0).collect();
        assert_eq!(tracts.len(), 128);
    }
}
