//! The extent map: volume byte ranges → where their newest bytes live.
//! Pure (no I/O), used twice: the object map (range → object seq and
//! offset) and the journal map (range → journal record and position).
//!
//! Invariants, checked by [`ExtentMap::check`] in the tests after every
//! operation: extents are sorted, never overlap, never empty, and two
//! neighbours that continue each other (the second's location is the
//! first's advanced by its length) are one extent, so a range written
//! sequentially stays one entry however it was cut (less memory, fewer
//! reads: the paper's §3.1 map-size argument).

use std::collections::BTreeMap;
use std::fmt::Debug;

/// A location a run of bytes can start at.
pub trait Loc: Copy + Eq + Debug {
    /// The location `by` bytes further into the same run.
    fn advance(self, by: u64) -> Self;
}

/// `len` bytes of the volume from `start`, stored from `loc` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent<L> {
    pub start: u64,
    pub len: u64,
    pub loc: L,
}

/// A piece of a looked-up range: where it is stored, or `None` for a
/// range the map does not hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece<L> {
    pub start: u64,
    pub len: u64,
    pub loc: Option<L>,
}

#[derive(Clone, Debug)]
pub struct ExtentMap<L> {
    /// start → (len, loc)
    map: BTreeMap<u64, (u64, L)>,
}

impl<L> Default for ExtentMap<L> {
    fn default() -> Self {
        ExtentMap { map: BTreeMap::new() }
    }
}

impl<L: Loc> ExtentMap<L> {
    pub fn new() -> Self {
        ExtentMap { map: BTreeMap::new() }
    }

    /// Number of extents (the map's memory is proportional to it).
    pub fn extents(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Every extent, in volume order.
    pub fn iter(&self) -> impl Iterator<Item = Extent<L>> + '_ {
        self.map.iter().map(|(&start, &(len, loc))| Extent { start, len, loc })
    }

    /// The extents overlapping `[start, end)`, whole, in order.
    fn overlapping(&self, start: u64, end: u64) -> Vec<Extent<L>> {
        let mut out = Vec::new();
        if let Some((&a, &(len, loc))) = self.map.range(..start).next_back() {
            if a + len > start {
                out.push(Extent { start: a, len, loc });
            }
        }
        for (&a, &(len, loc)) in self.map.range(start..end) {
            out.push(Extent { start: a, len, loc });
        }
        out
    }

    /// Makes `[start, start + len)` map to `loc` (or to nothing, for
    /// `None`). Returns the pieces it displaced, clipped to the range, so
    /// the caller can account for the bytes no longer live where they were.
    pub fn insert(&mut self, start: u64, len: u64, loc: Option<L>) -> Vec<Extent<L>> {
        if len == 0 {
            return Vec::new();
        }
        let end = start.checked_add(len).expect("extent end overflows u64");
        let mut displaced = Vec::new();
        for e in self.overlapping(start, end) {
            self.map.remove(&e.start);
            let (a, b) = (e.start.max(start), (e.start + e.len).min(end));
            displaced.push(Extent { start: a, len: b - a, loc: e.loc.advance(a - e.start) });
            if e.start < start {
                self.map.insert(e.start, (start - e.start, e.loc));
            }
            if e.start + e.len > end {
                self.map.insert(end, (e.start + e.len - end, e.loc.advance(end - e.start)));
            }
        }
        if let Some(loc) = loc {
            let (mut s, mut l, mut lc) = (start, len, loc);
            // Merge with the extent before, if this continues it.
            if let Some((&a, &(al, aloc))) = self.map.range(..s).next_back() {
                if a + al == s && aloc.advance(al) == lc {
                    self.map.remove(&a);
                    (s, l, lc) = (a, al + l, aloc);
                }
            }
            // And with the one after.
            if let Some(&(bl, bloc)) = self.map.get(&(s + l)) {
                if lc.advance(l) == bloc {
                    self.map.remove(&(s + l));
                    l += bl;
                }
            }
            self.map.insert(s, (l, lc));
        }
        displaced
    }

    /// `[start, start + len)` as consecutive pieces, mapped or not.
    pub fn lookup(&self, start: u64, len: u64) -> Vec<Piece<L>> {
        let end = start.saturating_add(len);
        let mut out = Vec::new();
        let mut at = start;
        for e in self.overlapping(start, end) {
            let (a, b) = (e.start.max(start), (e.start + e.len).min(end));
            if a > at {
                out.push(Piece { start: at, len: a - at, loc: None });
            }
            out.push(Piece { start: a, len: b - a, loc: Some(e.loc.advance(a - e.start)) });
            at = b;
        }
        if at < end {
            out.push(Piece { start: at, len: end - at, loc: None });
        }
        out
    }

    /// Unmaps the pieces of `[start, start + len)` whose location
    /// satisfies `pred` (a reclaimed journal record's own bytes), leaving
    /// the rest. Returns how many bytes it unmapped.
    pub fn remove_where(&mut self, start: u64, len: u64, pred: impl Fn(L) -> bool) -> u64 {
        let mut removed = 0;
        for p in self.lookup(start, len) {
            if let Some(loc) = p.loc {
                if pred(loc) {
                    self.insert(p.start, p.len, None);
                    removed += p.len;
                }
            }
        }
        removed
    }

    /// Checks the invariants in the module header; panics naming the
    /// first one broken (tests and debug assertions).
    pub fn check(&self) {
        let mut prev: Option<Extent<L>> = None;
        for e in self.iter() {
            assert!(e.len > 0, "empty extent at {}", e.start);
            if let Some(p) = prev {
                assert!(p.start + p.len <= e.start, "extents overlap: {p:?} and {e:?}");
                assert!(
                    !(p.start + p.len == e.start && p.loc.advance(p.len) == e.loc),
                    "neighbours that continue each other are not merged: {p:?} and {e:?}"
                );
            }
            prev = Some(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A test location: a run id and an offset inside it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct T(u32, u64);
    impl Loc for T {
        fn advance(self, by: u64) -> Self {
            T(self.0, self.1 + by)
        }
    }

    // Overwriting the middle of an extent splits it in three and reports
    // exactly the overwritten bytes as displaced.
    #[test]
    fn overwrite_splits_and_reports_displaced() {
        let mut m = ExtentMap::new();
        assert!(m.insert(0, 100, Some(T(1, 0))).is_empty());
        let d = m.insert(40, 20, Some(T(2, 0)));
        assert_eq!(d, vec![Extent { start: 40, len: 20, loc: T(1, 40) }]);
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            vec![
                Extent { start: 0, len: 40, loc: T(1, 0) },
                Extent { start: 40, len: 20, loc: T(2, 0) },
                Extent { start: 60, len: 40, loc: T(1, 60) },
            ]
        );
        m.check();
    }

    // A run written in pieces out of order ends as one extent; a trim in
    // its middle splits it again and lookups show the hole.
    #[test]
    fn contiguous_pieces_merge_and_trims_split() {
        let mut m = ExtentMap::new();
        m.insert(20, 10, Some(T(7, 20)));
        m.insert(0, 10, Some(T(7, 0)));
        m.insert(10, 10, Some(T(7, 10)));
        assert_eq!(m.extents(), 1);
        m.insert(5, 10, None);
        assert_eq!(
            m.lookup(0, 40),
            vec![
                Piece { start: 0, len: 5, loc: Some(T(7, 0)) },
                Piece { start: 5, len: 10, loc: None },
                Piece { start: 15, len: 15, loc: Some(T(7, 15)) },
                Piece { start: 30, len: 10, loc: None },
            ]
        );
        m.check();
    }

    // remove_where drops only the pieces whose location matches.
    #[test]
    fn remove_where_keeps_other_runs() {
        let mut m = ExtentMap::new();
        m.insert(0, 30, Some(T(1, 0)));
        m.insert(10, 10, Some(T(2, 0)));
        assert_eq!(m.remove_where(0, 30, |l| l.0 == 1), 20);
        assert_eq!(m.iter().collect::<Vec<_>>(), vec![Extent { start: 10, len: 10, loc: T(2, 0) }]);
    }

    proptest! {
        // Any sequence of inserts and trims leaves a map that agrees, byte
        // for byte, with a plain array model, and keeps its invariants.
        #[test]
        fn agrees_with_a_byte_model(ops in proptest::collection::vec((0u64..200, 1u64..60, 0u32..4), 1..80)) {
            const N: usize = 256;
            let mut model: Vec<Option<(u32, u64)>> = vec![None; N];
            let mut m = ExtentMap::new();
            for (i, (start, len, kind)) in ops.into_iter().enumerate() {
                let len = len.min(N as u64 - start);
                // kind 0 trims; others write run i (offset base 1000·i so
                // runs never continue each other by accident).
                let loc = (kind != 0).then_some(T(i as u32, 1000 * i as u64));
                let displaced = m.insert(start, len, loc);
                let mut shown = 0;
                for d in &displaced {
                    for b in d.start..d.start + d.len {
                        prop_assert_eq!(model[b as usize], Some((d.loc.0, d.loc.1 + b - d.start)));
                        shown += 1;
                    }
                }
                let live_before = model[start as usize..(start + len) as usize].iter().filter(|x| x.is_some()).count();
                prop_assert_eq!(shown, live_before as u64);
                for b in start..start + len {
                    model[b as usize] = loc.map(|l| (l.0, l.1 + b - start));
                }
                m.check();
                let mut at = 0u64;
                for p in m.lookup(0, N as u64) {
                    prop_assert_eq!(p.start, at);
                    for b in p.start..p.start + p.len {
                        prop_assert_eq!(model[b as usize], p.loc.map(|l| (l.0, l.1 + b - p.start)));
                    }
                    at += p.len;
                }
                prop_assert_eq!(at, N as u64);
            }
        }
    }
}
