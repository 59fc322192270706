//! The backup journal's in-memory index (Ursa §3.3): for each tract, which
//! byte ranges the journal holds newer bytes for than the data disk, and
//! where in the journal they are. Reads ask it which pieces of a range come
//! from the journal and which from the disk; the replayer asks it which
//! records are wholly overwritten (dead: skip them) and tells it when a
//! record's bytes reached the disk. Pure: no I/O, no time, no randomness.
//!
//! Structure: one `BTreeMap` per tract from a segment's first byte to its
//! end and [`Loc`] (the paper's composite keys `{offset, length} ->
//! j_offset`), and one map from journal record to its live bytes. A
//! segment maps `start..end` of its tract to the bytes of one record's
//! payload starting at `loc.offset`. The paper keeps a red-black tree in
//! front of a sorted array merged in the background; a B-tree already packs
//! several entries per node, so one level does without the merge worker.
//!
//! Writes: the newest write wins. An insert first carves its range out of
//! the tract (an older segment it cuts keeps its parts outside the range,
//! the right-hand part's `offset` advanced by how far it was cut), then
//! adds one segment. Segments are never merged, not even two adjacent ones
//! of the same record: a segment always names one record, so retiring a
//! record removes whole segments and never splits a merged one.
//!
//! Invariants (checked by [`JournalIndex::check_invariants`]):
//! - within a tract, segments are non-empty and disjoint (each ends at or
//!   before the next one's start); no tract is held with no segments;
//! - a segment's payload bytes are addressable: `offset + len - 1` fits in
//!   a `u32` (an insert that would break this is refused, so advancing an
//!   offset while cutting never overflows);
//! - each record's live count is the sum of the lengths of the segments
//!   naming it, over all tracts; a record with no live bytes has no entry;
//! - the segment and byte totals are the sums over all tracts.
//!
//! Ranges are half-open, `start..end`, in bytes within a tract. An empty
//! range (`start == end`) changes nothing and reads as no pieces; a
//! reversed one (`start > end`) is a caller's bug and is treated the same,
//! so no input panics.
//!
//! Costs below use n for the segments of the tract concerned, k for the
//! segments a range touches, t for the tracts held and r for the records
//! with live bytes.

use std::cmp::{max, min};
use std::collections::btree_map::Entry;
use std::collections::BTreeMap;

/// Where a segment's bytes are in the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    /// The journal record's sequence number.
    pub record: u64,
    /// Offset of the segment's first byte in that record's payload.
    pub offset: u32,
}

impl Loc {
    /// The location `by` bytes further into the same record. Saturates
    /// instead of overflowing, though it never has to: every segment's
    /// bytes are addressable (module invariant), and callers advance only
    /// to a byte inside the segment.
    fn advance(self, by: u32) -> Loc {
        Loc { record: self.record, offset: self.offset.saturating_add(by) }
    }
}

/// One piece of a looked-up range: where its bytes are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// `start..end` of the tract is in the journal, from `loc` on.
    Journal { start: u32, end: u32, loc: Loc },
    /// A hole: `start..end` of the tract is read from the data disk.
    Disk { start: u32, end: u32 },
}

impl Piece {
    pub fn start(&self) -> u32 {
        match *self {
            Piece::Journal { start, .. } | Piece::Disk { start, .. } => start,
        }
    }

    pub fn end(&self) -> u32 {
        match *self {
            Piece::Journal { end, .. } | Piece::Disk { end, .. } => end,
        }
    }
}

/// A segment, stored under its start.
#[derive(Clone, Copy, Debug)]
struct Seg {
    end: u32,
    loc: Loc,
}

/// A tract's segments, by start.
type Segs = BTreeMap<u32, Seg>;

/// The counts kept across tracts, apart from the tracts themselves so a
/// tract's segments and the counts can be borrowed together.
#[derive(Default, Debug)]
struct Counts {
    /// Live bytes per record; no zero entries.
    live: BTreeMap<u64, u64>,
    segments: usize,
    bytes: u64,
}

impl Counts {
    fn add(&mut self, loc: Loc, len: u32) {
        *self.live.entry(loc.record).or_insert(0) += u64::from(len);
        self.segments += 1;
        self.bytes += u64::from(len);
    }

    /// Takes `len` bytes of `loc.record` off the counts; `whole` says
    /// whether a segment went with them (a cut segment stays, shorter).
    fn sub(&mut self, loc: Loc, len: u32, whole: bool) {
        let len = u64::from(len);
        if let Entry::Occupied(mut e) = self.live.entry(loc.record) {
            debug_assert!(*e.get() >= len, "record {} has {} live bytes, not {len}", loc.record, e.get());
            *e.get_mut() = e.get().saturating_sub(len);
            if *e.get() == 0 {
                e.remove();
            }
        } else {
            debug_assert!(false, "record {} has no live bytes to take {len} from", loc.record);
        }
        if whole {
            self.segments -= 1;
        }
        self.bytes -= len;
    }
}

/// The index: journaled byte ranges per tract `K`, and live bytes per
/// journal record.
#[derive(Debug)]
pub struct JournalIndex<K: Ord + Copy> {
    tracts: BTreeMap<K, Segs>,
    counts: Counts,
}

impl<K: Ord + Copy> Default for JournalIndex<K> {
    fn default() -> Self {
        JournalIndex { tracts: BTreeMap::new(), counts: Counts::default() }
    }
}

impl<K: Ord + Copy> JournalIndex<K> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `start..end` of tract `key` now reads from `record`'s
    /// payload, from `payload_offset` on: the newest write wins, replacing
    /// whatever older segments held there. An empty or reversed range, or
    /// one whose last payload byte's offset would not fit in a `u32`,
    /// changes nothing. Cost O((k + 1) (log n + log r) + log t).
    pub fn insert(&mut self, key: K, start: u32, end: u32, record: u64, payload_offset: u32) {
        if start >= end || payload_offset.checked_add(end - start - 1).is_none() {
            return;
        }
        let loc = Loc { record, offset: payload_offset };
        let segs = self.tracts.entry(key).or_default();
        carve(segs, &mut self.counts, start, end);
        segs.insert(start, Seg { end, loc });
        self.counts.add(loc, end - start);
        debug_assert!(segs.range(..start).next_back().is_none_or(|(_, s)| s.end <= start));
        debug_assert!(segs.range(start + 1..).next().is_none_or(|(&s, _)| s >= end));
    }

    /// The pieces `start..end` of tract `key` reads from, in order, covering
    /// it exactly: journal pieces where segments lie, disk pieces between
    /// them. Fills `out` (cleared first) so a reader can reuse one
    /// vector. Two disk pieces are never adjacent; two journal pieces may be
    /// (segments are not merged). Cost O(log t + log n + k).
    pub fn lookup_into(&self, key: K, start: u32, end: u32, out: &mut Vec<Piece>) {
        out.clear();
        if start >= end {
            return;
        }
        // Everything before `at` is covered.
        let mut at = start;
        if let Some(segs) = self.tracts.get(&key) {
            while let Some((s, seg)) = next_overlap(segs, at, end) {
                let (a, b) = (max(s, at), min(seg.end, end));
                if at < a {
                    out.push(Piece::Disk { start: at, end: a });
                }
                out.push(Piece::Journal { start: a, end: b, loc: seg.loc.advance(a - s) });
                at = b;
            }
        }
        if at < end {
            out.push(Piece::Disk { start: at, end });
        }
    }

    /// [`JournalIndex::lookup_into`] into a new vector.
    pub fn lookup(&self, key: K, start: u32, end: u32) -> Vec<Piece> {
        let mut out = Vec::new();
        self.lookup_into(key, start, end, &mut out);
        out
    }

    /// After the replayer wrote `record`'s bytes for `start..end` of tract
    /// `key` to the data disk: drops the parts of that range still read
    /// from `record`, leaving parts a newer write (another record) holds.
    /// The replayer knows the record's tract and range, so this touches only
    /// the segments inside it. Cost O((k + 1) (log n + log r) + log t).
    pub fn retire(&mut self, key: K, start: u32, end: u32, record: u64) {
        self.carve_where(key, start, end, |loc| loc.record == record);
    }

    /// A write that bypassed the journal (straight to the data disk)
    /// supersedes whatever the journal holds for `start..end` of tract
    /// `key`. Cost O((k + 1) (log n + log r) + log t).
    pub fn remove_range(&mut self, key: K, start: u32, end: u32) {
        self.carve_where(key, start, end, |_| true);
    }

    /// Forgets tract `key` (deleted or reset): its segments go, and their
    /// bytes stop counting as live. Cost O(log t + n log r).
    pub fn remove_tract(&mut self, key: K) {
        if let Some(segs) = self.tracts.remove(&key) {
            for (s, seg) in segs {
                self.counts.sub(seg.loc, seg.end - s, true);
            }
        }
    }

    /// Bytes of `record` still read from the journal, over all tracts; 0
    /// once every byte was overwritten, superseded or retired (the replayer
    /// skips such a record). Cost O(log r).
    pub fn live_bytes(&self, record: u64) -> u64 {
        self.counts.live.get(&record).copied().unwrap_or(0)
    }

    /// Records with live bytes. O(1).
    pub fn live_records(&self) -> usize {
        self.counts.live.len()
    }

    /// Segments held, over all tracts. O(1).
    pub fn len(&self) -> usize {
        self.counts.segments
    }

    pub fn is_empty(&self) -> bool {
        self.counts.segments == 0
    }

    /// Bytes indexed (read from the journal), over all tracts. O(1).
    pub fn bytes(&self) -> u64 {
        self.counts.bytes
    }

    /// Tracts with at least one segment. O(1).
    pub fn tracts(&self) -> usize {
        self.tracts.len()
    }

    /// Checks every invariant of the module header with `debug_assert!`s,
    /// for tests. Cost O(total segments · log r).
    pub fn check_invariants(&self) {
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        let (mut segments, mut bytes) = (0usize, 0u64);
        for segs in self.tracts.values() {
            debug_assert!(!segs.is_empty(), "a tract is held with no segments");
            let mut prev_end = 0u32;
            for (&s, seg) in segs {
                debug_assert!(s < seg.end, "empty segment {s}..{}", seg.end);
                debug_assert!(prev_end <= s, "segment at {s} overlaps one ending at {prev_end}");
                let len = seg.end.saturating_sub(s);
                debug_assert!(
                    seg.loc.offset.checked_add(len.saturating_sub(1)).is_some(),
                    "{seg:?} overflows"
                );
                prev_end = seg.end;
                *live.entry(seg.loc.record).or_insert(0) += u64::from(len);
                segments += 1;
                bytes += u64::from(len);
            }
        }
        debug_assert_eq!(live, self.counts.live, "live bytes per record");
        debug_assert_eq!(segments, self.counts.segments, "segments");
        debug_assert_eq!(bytes, self.counts.bytes, "bytes");
    }

    /// Removes the bytes of `start..end` of tract `key` held by segments
    /// whose location `drop` picks, one overlapping segment at a time.
    fn carve_where(&mut self, key: K, start: u32, end: u32, drop: impl Fn(Loc) -> bool) {
        if start >= end {
            return;
        }
        let Some(segs) = self.tracts.get_mut(&key) else { return };
        let mut from = start;
        while let Some((s, seg)) = next_overlap(segs, from, end) {
            let (a, b) = (max(s, from), min(seg.end, end));
            if drop(seg.loc) {
                carve(segs, &mut self.counts, a, b);
            }
            from = b;
        }
        if segs.is_empty() {
            self.tracts.remove(&key);
        }
    }
}

/// The first segment holding a byte of `from..end`: the one starting before
/// `from` if it reaches past it, else the first starting inside; none once
/// the range is empty (the loops walking a range stop there). O(log n).
fn next_overlap(segs: &Segs, from: u32, end: u32) -> Option<(u32, Seg)> {
    if from >= end {
        return None;
    }
    if let Some((&s, seg)) = segs.range(..from).next_back() {
        if seg.end > from {
            return Some((s, *seg));
        }
    }
    segs.range(from..end).next().map(|(&s, seg)| (s, *seg))
}

/// Removes every byte of `start..end` (`start < end`) from a tract's
/// segments: segments inside go, a segment reaching in from the left keeps
/// its left part, one reaching out to the right keeps its right part with
/// its offset advanced by the bytes cut from its front (one covering the
/// whole range keeps both). O((k + 1) (log n + log r)).
fn carve(segs: &mut Segs, counts: &mut Counts, start: u32, end: u32) {
    if let Some((&s, seg)) = segs.range_mut(..start).next_back() {
        if seg.end > start {
            let old = *seg;
            seg.end = start;
            counts.sub(old.loc, min(old.end, end) - start, false);
            if old.end > end {
                let right = Seg { end: old.end, loc: old.loc.advance(end - s) };
                segs.insert(end, right);
                // The right-hand part is a new segment, its bytes still live.
                counts.segments += 1;
            }
        }
    }
    while let Some((&s, &seg)) = segs.range(start..end).next() {
        segs.remove(&s);
        if seg.end > end {
            counts.sub(seg.loc, end - s, false);
            segs.insert(end, Seg { end: seg.end, loc: seg.loc.advance(end - s) });
        } else {
            counts.sub(seg.loc, seg.end - s, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const K: u8 = 0;

    fn j(start: u32, end: u32, record: u64, offset: u32) -> Piece {
        Piece::Journal { start, end, loc: Loc { record, offset } }
    }

    fn d(start: u32, end: u32) -> Piece {
        Piece::Disk { start, end }
    }

    /// An index of tract `K` after the writes `(start, end, record, offset)`, in order.
    fn written(writes: &[(u32, u32, u64, u32)]) -> JournalIndex<u8> {
        let mut ix = JournalIndex::new();
        for &(start, end, record, offset) in writes {
            ix.insert(K, start, end, record, offset);
            ix.check_invariants();
        }
        ix
    }

    /// A write inside an older segment splits it in two; the right-hand
    /// part's offset advances by how far it was cut.
    #[test]
    fn insert_inside_splits_the_older_segment() {
        let ix = written(&[(0, 100, 1, 0), (40, 60, 2, 500)]);
        assert_eq!(ix.lookup(K, 0, 100), [j(0, 40, 1, 0), j(40, 60, 2, 500), j(60, 100, 1, 60)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2)), (80, 20));
        assert_eq!((ix.len(), ix.bytes(), ix.tracts()), (3, 100, 1));
    }

    /// A write covering older segments, or exactly the range of one,
    /// removes them whole.
    #[test]
    fn insert_covering_removes_older_segments() {
        let mut ix = written(&[(10, 20, 1, 0), (30, 40, 2, 0), (0, 50, 3, 0)]);
        assert_eq!(ix.lookup(K, 0, 50), [j(0, 50, 3, 0)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2), ix.live_bytes(3)), (0, 0, 50));
        ix.insert(K, 0, 50, 4, 7);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 0, 50), [j(0, 50, 4, 7)]);
        assert_eq!((ix.live_bytes(3), ix.live_bytes(4), ix.len(), ix.live_records()), (0, 50, 1, 1));
    }

    /// A write over an older segment's right end keeps its left part, at
    /// its old offset.
    #[test]
    fn insert_over_the_right_end_keeps_the_left_part() {
        let ix = written(&[(0, 50, 1, 10), (30, 80, 2, 0)]);
        assert_eq!(ix.lookup(K, 0, 80), [j(0, 30, 1, 10), j(30, 80, 2, 0)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2)), (30, 50));
    }

    /// A write over an older segment's left end keeps its right part, the
    /// offset advanced past the bytes cut.
    #[test]
    fn insert_over_the_left_end_keeps_the_right_part() {
        let ix = written(&[(30, 80, 1, 100), (0, 50, 2, 0)]);
        assert_eq!(ix.lookup(K, 0, 80), [j(0, 50, 2, 0), j(50, 80, 1, 120)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2)), (30, 50));
    }

    /// Touching writes cut nothing, and adjacent segments stay separate,
    /// even two of one record with continuous offsets; a write across them
    /// cuts both.
    #[test]
    fn touching_writes_stay_separate() {
        let mut ix = written(&[(0, 10, 1, 0), (10, 20, 1, 10), (20, 30, 2, 0)]);
        assert_eq!(ix.lookup(K, 0, 30), [j(0, 10, 1, 0), j(10, 20, 1, 10), j(20, 30, 2, 0)]);
        assert_eq!((ix.len(), ix.live_bytes(1)), (3, 20));
        ix.insert(K, 5, 25, 3, 0);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 0, 30), [j(0, 5, 1, 0), j(5, 25, 3, 0), j(25, 30, 2, 5)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2), ix.len()), (5, 5, 3));
    }

    /// A lookup clips segments to the range asked, reports the holes as
    /// disk pieces, and reads an unknown tract from the disk.
    #[test]
    fn lookup_clips_segments_and_fills_holes() {
        let ix = written(&[(10, 20, 1, 0), (30, 40, 2, 0)]);
        assert_eq!(ix.lookup(K, 0, 50), [d(0, 10), j(10, 20, 1, 0), d(20, 30), j(30, 40, 2, 0), d(40, 50)]);
        assert_eq!(ix.lookup(K, 15, 35), [j(15, 20, 1, 5), d(20, 30), j(30, 35, 2, 0)]);
        assert_eq!(ix.lookup(K, 20, 30), [d(20, 30)]);
        assert_eq!(ix.lookup(K, 12, 18), [j(12, 18, 1, 2)]);
        assert_eq!(ix.lookup(9, 0, 50), [d(0, 50)]);
        assert_eq!(ix.lookup(K, 5, 5), []);
        let mut out = vec![d(1, 2)];
        ix.lookup_into(K, 35, 45, &mut out);
        assert_eq!(out, [j(35, 40, 2, 5), d(40, 45)]);
    }

    /// Retiring a record drops only the parts still read from it: the
    /// parts a newer record overwrote stay until that one is retired.
    #[test]
    fn retire_keeps_newer_writes() {
        let mut ix = written(&[(0, 100, 1, 0), (40, 60, 2, 0)]);
        ix.retire(K, 0, 100, 1);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 0, 100), [d(0, 40), j(40, 60, 2, 0), d(60, 100)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2), ix.len()), (0, 20, 1));
        ix.retire(K, 0, 100, 1);
        ix.retire(3, 0, 100, 2);
        assert_eq!(ix.len(), 1);
        ix.retire(K, 40, 60, 2);
        ix.check_invariants();
        assert!(ix.is_empty());
        assert_eq!((ix.tracts(), ix.bytes(), ix.live_records()), (0, 0, 0));
    }

    /// Retiring part of a record's range cuts its segment at the edges.
    #[test]
    fn retire_of_a_subrange_cuts_the_segment() {
        let mut ix = written(&[(0, 100, 1, 0)]);
        ix.retire(K, 20, 30, 1);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 0, 100), [j(0, 20, 1, 0), d(20, 30), j(30, 100, 1, 30)]);
        assert_eq!((ix.live_bytes(1), ix.len()), (90, 2));
    }

    /// A record all of whose bytes were overwritten, piece by piece, has no
    /// live bytes: the replayer can skip it.
    #[test]
    fn a_wholly_overwritten_record_is_dead() {
        let mut ix = written(&[(10, 20, 1, 0), (0, 15, 2, 0)]);
        assert_eq!(ix.live_bytes(1), 5);
        ix.insert(K, 12, 30, 3, 0);
        ix.check_invariants();
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2), ix.live_bytes(3)), (0, 12, 18));
        assert_eq!(ix.live_records(), 2);
    }

    /// A bypassing write's range and a removed tract stop counting as live.
    #[test]
    fn removals_keep_live_counts() {
        let mut ix = written(&[(0, 100, 1, 0), (50, 70, 2, 0)]);
        ix.insert(1, 0, 50, 1, 0);
        assert_eq!(ix.live_bytes(1), 130);
        ix.remove_range(K, 60, 80);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 0, 100), [j(0, 50, 1, 0), j(50, 60, 2, 0), d(60, 80), j(80, 100, 1, 80)]);
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2)), (120, 10));
        ix.remove_tract(K);
        ix.check_invariants();
        assert_eq!((ix.live_bytes(1), ix.live_bytes(2)), (50, 0));
        assert_eq!((ix.tracts(), ix.len(), ix.bytes()), (1, 1, 50));
        ix.remove_tract(K);
        ix.remove_tract(7);
        ix.remove_range(1, 0, 50);
        ix.check_invariants();
        assert!(ix.is_empty());
        assert_eq!((ix.tracts(), ix.live_records()), (0, 0));
    }

    /// Empty and reversed ranges, payload offsets past a `u32`, and ranges
    /// at the ends of the offset space change nothing or work; none panics.
    #[test]
    fn degenerate_inputs_change_nothing() {
        let mut ix = written(&[(5, 5, 1, 0), (9, 3, 1, 0), (0, 10, 1, u32::MAX - 8)]);
        assert!(ix.is_empty());
        assert_eq!(ix.tracts(), 0);
        ix.insert(K, 0, 10, 1, u32::MAX - 9);
        ix.insert(K, 4, 6, 2, 0);
        ix.insert(K, u32::MAX - 1, u32::MAX, 3, u32::MAX);
        ix.check_invariants();
        assert_eq!(ix.lookup(K, 8, 10), [j(8, 10, 1, u32::MAX - 1)]);
        assert_eq!(ix.lookup(K, 5, 7), [j(5, 6, 2, 1), j(6, 7, 1, u32::MAX - 3)]);
        assert_eq!(
            ix.lookup(K, u32::MAX - 2, u32::MAX),
            [d(u32::MAX - 2, u32::MAX - 1), j(u32::MAX - 1, u32::MAX, 3, u32::MAX)]
        );
        let before = ix.lookup(K, 0, u32::MAX);
        ix.retire(K, 9, 3, 1);
        ix.remove_range(K, 9, 3);
        ix.remove_range(K, 4, 4);
        assert_eq!(ix.lookup(K, 9, 3), []);
        assert_eq!(ix.lookup(K, 0, u32::MAX), before);
        assert_eq!((ix.len(), ix.bytes()), (4, 11));
        ix.remove_range(K, 0, u32::MAX);
        ix.check_invariants();
        assert!(ix.is_empty());
    }

    /// The byte space of the model test's tracts.
    const SPACE: u32 = 64;
    const KEYS: u8 = 3;
    /// Few records, so one record's bytes land in several tracts and
    /// several inserts.
    const RECORDS: u64 = 6;

    #[derive(Clone, Debug)]
    enum Op {
        Insert { key: u8, start: u32, end: u32, record: u64, offset: u32 },
        Retire { key: u8, start: u32, end: u32, record: u64 },
        RemoveRange { key: u8, start: u32, end: u32 },
        RemoveTract { key: u8 },
        Lookup { key: u8, start: u32, end: u32 },
    }

    /// Mostly ranges of up to 24 bytes inside the space; some arbitrary
    /// (reversed or empty) ones.
    fn range() -> impl Strategy<Value = (u32, u32)> {
        prop_oneof![
            9 => (0..SPACE, 0..=24u32).prop_map(|(s, len)| (s, min(s + len, SPACE))),
            1 => (0..=SPACE, 0..=SPACE),
        ]
    }

    /// Mostly small payload offsets; some whose last byte may not fit.
    fn offset() -> impl Strategy<Value = u32> {
        prop_oneof![9 => 0..1000u32, 1 => (u32::MAX - 40)..=u32::MAX]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => (0..KEYS, range(), 0..RECORDS, offset())
                .prop_map(|(key, (start, end), record, offset)| Op::Insert { key, start, end, record, offset }),
            2 => (0..KEYS, range(), 0..RECORDS)
                .prop_map(|(key, (start, end), record)| Op::Retire { key, start, end, record }),
            1 => (0..KEYS, range()).prop_map(|(key, (start, end))| Op::RemoveRange { key, start, end }),
            1 => (0..KEYS).prop_map(|key| Op::RemoveTract { key }),
            2 => (0..KEYS, range()).prop_map(|(key, (start, end))| Op::Lookup { key, start, end }),
        ]
    }

    /// Per tract, per byte: the record and payload offset it reads from.
    type Model = Vec<Vec<Option<(u64, u32)>>>;

    /// The model's bytes of `start..end` of tract `key` (none if reversed).
    fn bytes(model: &mut Model, key: u8, start: u32, end: u32) -> &mut [Option<(u64, u32)>] {
        &mut model[key as usize][start as usize..max(start, end) as usize]
    }

    /// What `op` does to the model, byte by byte.
    fn apply(model: &mut Model, op: &Op) {
        match *op {
            Op::Insert { key, start, end, record, offset } => {
                if start < end && offset.checked_add(end - start - 1).is_some() {
                    for (i, b) in (0u32..).zip(bytes(model, key, start, end)) {
                        *b = Some((record, offset + i));
                    }
                }
            }
            Op::Retire { key, start, end, record } => {
                for b in bytes(model, key, start, end) {
                    if b.is_some_and(|(r, _)| r == record) {
                        *b = None;
                    }
                }
            }
            Op::RemoveRange { key, start, end } => bytes(model, key, start, end).fill(None),
            Op::RemoveTract { key } => model[key as usize].fill(None),
            Op::Lookup { .. } => {}
        }
    }

    /// The pieces cover `start..end` exactly, in order, none empty, no two
    /// disk pieces adjacent, and each byte reads where the model says.
    fn check_pieces(
        pieces: &[Piece],
        bytes: &[Option<(u64, u32)>],
        start: u32,
        end: u32,
    ) -> Result<(), TestCaseError> {
        if start >= end {
            prop_assert!(pieces.is_empty(), "{start}..{end}: {pieces:?}");
            return Ok(());
        }
        let mut at = start;
        let mut after_disk = false;
        for p in pieces {
            prop_assert_eq!(p.start(), at, "{:?}", pieces);
            prop_assert!(p.start() < p.end(), "{:?}", pieces);
            for i in p.start()..p.end() {
                let want = match *p {
                    Piece::Journal { start, loc, .. } => Some((loc.record, loc.offset + (i - start))),
                    Piece::Disk { .. } => None,
                };
                prop_assert_eq!(bytes[i as usize], want, "byte {} of {:?}", i, pieces);
            }
            let disk = matches!(p, Piece::Disk { .. });
            prop_assert!(!(disk && after_disk), "adjacent disk pieces: {:?}", pieces);
            after_disk = disk;
            at = p.end();
        }
        prop_assert_eq!(at, end);
        Ok(())
    }

    /// Every tract's lookups, the live counts and the totals agree with the model.
    fn check_all(ix: &JournalIndex<u8>, model: &Model, out: &mut Vec<Piece>) -> Result<(), TestCaseError> {
        ix.check_invariants();
        for key in 0..KEYS {
            ix.lookup_into(key, 0, SPACE, out);
            check_pieces(out, &model[key as usize], 0, SPACE)?;
        }
        let held = || model.iter().flatten().flatten();
        for record in 0..RECORDS {
            let live = held().filter(|(r, _)| *r == record).count() as u64;
            prop_assert_eq!(ix.live_bytes(record), live, "record {}", record);
        }
        prop_assert_eq!(ix.bytes(), held().count() as u64);
        prop_assert_eq!(ix.live_records(), (0..RECORDS).filter(|&r| ix.live_bytes(r) > 0).count());
        prop_assert_eq!(ix.tracts(), model.iter().filter(|t| t.iter().any(Option::is_some)).count());
        prop_assert_eq!(ix.is_empty(), ix.bytes() == 0);
        prop_assert!(ix.len() as u64 <= ix.bytes());
        Ok(())
    }

    proptest! {
        /// Random inserts, retires, removals and lookups over a few small
        /// tracts read back, byte for byte, as a byte-granular model says,
        /// with the live counts and totals it implies, and the invariants
        /// hold after every step.
        #[test]
        fn index_agrees_with_a_byte_model(ops in proptest::collection::vec(op(), 1..150)) {
            let mut ix = JournalIndex::new();
            let mut model: Model = vec![vec![None; SPACE as usize]; KEYS as usize];
            let mut out = Vec::new();
            for op in &ops {
                match *op {
                    Op::Insert { key, start, end, record, offset } => ix.insert(key, start, end, record, offset),
                    Op::Retire { key, start, end, record } => ix.retire(key, start, end, record),
                    Op::RemoveRange { key, start, end } => ix.remove_range(key, start, end),
                    Op::RemoveTract { key } => ix.remove_tract(key),
                    Op::Lookup { key, start, end } => {
                        ix.lookup_into(key, start, end, &mut out);
                        let bytes = &model[key as usize];
                        let clipped = (min(start, SPACE), min(end, SPACE));
                        check_pieces(&out, bytes, clipped.0, clipped.1)?;
                    }
                }
                apply(&mut model, op);
                check_all(&ix, &model, &mut out)?;
            }
        }
    }
}
