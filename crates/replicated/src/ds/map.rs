//! The ordered map (the paper's key-value store, §8.2, ordered so it can
//! also answer ranges): byte-string keys (at most `KEY_LEN_MAX`) to
//! byte-string values (at most `VALUE_LEN_MAX`).
//!
//! Sharded by key hash into [`MAP_SHARDS`] `imbl::OrdMap`s, so updates of
//! different keys (which commute: Exclusive on hash(map, key)) apply
//! concurrently, each holding its key's shard lock. A range read clones
//! every shard at one instant (all locked together: O(1) each) and merges
//! the shards' ranges in key order outside the locks.
//!
//! Invariant: a key lives in the shard its hash names, and nowhere else.

use std::ops::Bound;

use bytes::Bytes;
use imbl::OrdMap;

use blizzard_proto::DecodeError;

use super::ops::{pair_cost, CasReply, Dec, RangeReply, KEY_LEN_MAX, VALUE_LEN_MAX};
use super::{map_key, merge_sorted, own, take_bounded, Sharded, SnapOut};

/// Shards of the map: updates of keys in different shards never wait for
/// each other.
pub(crate) const MAP_SHARDS: usize = 16;

pub(crate) type Shard = OrdMap<Bytes, Bytes>;

pub(crate) struct Map {
    pub(crate) shards: Sharded<Shard>,
}

impl Map {
    pub(crate) fn new() -> Self {
        Map { shards: Sharded::new(MAP_SHARDS) }
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        self.shards.index(map_key(key))
    }

    /// Sets `key`; returns the previous value.
    pub(crate) fn put(&self, key: &Bytes, value: &Bytes) -> Option<Bytes> {
        let mut s = self.shards.lock(self.shard_of(key));
        s.insert(own(key), own(value))
    }

    /// Removes `key`; returns whether it was there.
    pub(crate) fn delete(&self, key: &Bytes) -> bool {
        let mut s = self.shards.lock(self.shard_of(key));
        // Looked up first: removing an absent key from a shared map would
        // still copy the path to it.
        s.contains_key(&key[..]) && s.remove(&key[..]).is_some()
    }

    /// Sets `key` to `new` (None: removes it) if its value is `expected`
    /// (None: absent).
    pub(crate) fn compare_and_swap(
        &self,
        key: &Bytes,
        expected: Option<&Bytes>,
        new: Option<&Bytes>,
    ) -> CasReply {
        let mut s = self.shards.lock(self.shard_of(key));
        let current = s.get(&key[..]);
        if current != expected {
            return CasReply { swapped: false, current: current.cloned() };
        }
        let current = match new {
            Some(v) => {
                let v = own(v);
                s.insert(own(key), v.clone());
                Some(v)
            }
            None => {
                s.remove(&key[..]);
                None
            }
        };
        CasReply { swapped: true, current }
    }

    pub(crate) fn get(&self, key: &Bytes) -> Option<Bytes> {
        self.shards.lock(self.shard_of(key)).get(&key[..]).cloned()
    }

    /// Pairs with `start <= key < end`, in key order, at most `limit` and
    /// within the reply budget.
    pub(crate) fn range(&self, start: &Bytes, end: Option<&Bytes>, limit: usize) -> RangeReply {
        if end.is_some_and(|e| e <= start) {
            return RangeReply::default();
        }
        let shards = self.shards.clone_all();
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) =
            (Bound::Included(start), end.map_or(Bound::Unbounded, |e| Bound::Excluded(&e[..])));
        let merged = merge_sorted(shards.iter().map(|s| s.range::<_, [u8]>(bounds)));
        let (pairs, more) = take_bounded(merged.map(|(k, v)| (k.clone(), v.clone())), limit, |(k, v)| {
            pair_cost(k.len(), v.len())
        });
        RangeReply { pairs, more }
    }
}

/// Writes the map's snapshot section (after its tag): every pair, in key
/// order.
pub(crate) fn write_section(shards: &[Shard], o: &mut SnapOut<'_>) {
    let count: usize = shards.iter().map(Shard::len).sum();
    o.put(count as u64);
    for (k, v) in merge_sorted(shards.iter().map(|s| s.iter())) {
        o.bytes(k);
        o.bytes(v);
    }
}

/// Reads the map's snapshot section into fresh shards (keys strictly
/// ascending, every length bounded).
pub(crate) fn read_section(d: &mut Dec<'_>) -> Result<Vec<Shard>, DecodeError> {
    // A pair is at least its two lengths.
    let count = d.count::<u64>(u64::MAX, 8, "snapshot map pair count")?;
    let map = Map::new();
    let mut shards = vec![Shard::new(); map.shards.len()];
    let mut prev: Option<Bytes> = None;
    for i in 0..count {
        let key = d.bytes(KEY_LEN_MAX, "snapshot map key length")?;
        let value = d.bytes(VALUE_LEN_MAX, "snapshot map value length")?;
        if prev.as_ref().is_some_and(|p| *p >= key) {
            return Err(DecodeError::BadValue {
                field: "snapshot map keys not ascending at pair",
                value: i as u64,
            });
        }
        shards[map.shard_of(&key)].insert(own(&key), own(&value));
        prev = Some(key);
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::ops::{arb, pair_cost, Query, QueryReply, Update, UpdateReply, REPLY_BYTES_MAX};
    use super::super::testing::{ask, at, run};
    use super::super::Structures;
    use super::*;

    /// The reference: a BTreeMap and the obvious semantics.
    fn model_apply(m: &mut BTreeMap<Bytes, Bytes>, op: &Update) -> UpdateReply {
        match op {
            Update::Put { key, value } => UpdateReply::Put(m.insert(key.clone(), value.clone())),
            Update::Delete { key } => UpdateReply::Delete(m.remove(key).is_some()),
            Update::CompareAndSwap { key, expected, new } => {
                if m.get(key) == expected.as_ref() {
                    match new {
                        Some(v) => m.insert(key.clone(), v.clone()),
                        None => m.remove(key),
                    };
                    UpdateReply::CompareAndSwap(CasReply { swapped: true, current: new.clone() })
                } else {
                    UpdateReply::CompareAndSwap(CasReply { swapped: false, current: m.get(key).cloned() })
                }
            }
            _ => unreachable!("map updates only"),
        }
    }

    fn model_query(m: &BTreeMap<Bytes, Bytes>, q: &Query) -> Option<QueryReply> {
        Some(match q {
            Query::Get { key } => QueryReply::Get(m.get(key).cloned()),
            Query::Range { start, end, limit } => {
                let all: Vec<(Bytes, Bytes)> = m
                    .iter()
                    .filter(|(k, _)| *k >= start && end.as_ref().is_none_or(|e| *k < e))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let n = all.len().min(*limit as usize);
                QueryReply::Range(RangeReply { more: all.len() > n, pairs: all[..n].to_vec() })
            }
            _ => return None,
        })
    }

    proptest! {
        /// Random map updates give the replies and state of a BTreeMap, read back through Get and Range.
        #[test]
        fn map_matches_model(
            ops in proptest::collection::vec(arb::map_update(), 0..64),
            queries in proptest::collection::vec(arb::query(), 0..64),
        ) {
            let s = Structures::new();
            let mut m = BTreeMap::new();
            for (i, op) in ops.iter().enumerate() {
                prop_assert_eq!(run(&s, op, at(i as u64)), model_apply(&mut m, op), "update {}", i);
                if let Some(q) = queries.get(i) {
                    if let Some(want) = model_query(&m, q) {
                        prop_assert_eq!(ask(&s, q), want, "query {:?}", q);
                    }
                }
            }
            let all = Query::Range { start: Bytes::new(), end: None, limit: 1024 };
            prop_assert_eq!(ask(&s, &all), model_query(&m, &all).expect("a map query"));
        }
    }

    /// A range stops at the byte budget, returns at least one pair, says there is more, and resumes where it stopped.
    #[test]
    fn range_respects_the_byte_budget() {
        let s = Structures::new();
        let value = Bytes::from(vec![1u8; VALUE_LEN_MAX]);
        for i in 0..6u8 {
            run(&s, &Update::Put { key: Bytes::from(vec![i]), value: value.clone() }, at(i as u64));
        }
        let per = REPLY_BYTES_MAX / pair_cost(1, VALUE_LEN_MAX);
        assert!((1..6).contains(&per));
        let mut start = Bytes::new();
        let mut seen = 0;
        loop {
            let q = Query::Range { start: start.clone(), end: None, limit: 1024 };
            let QueryReply::Range(r) = ask(&s, &q) else { panic!("a range reply") };
            assert!(!r.pairs.is_empty() && r.pairs.len() <= per);
            seen += r.pairs.len();
            if !r.more {
                break;
            }
            let mut next = r.pairs[r.pairs.len() - 1].0.to_vec();
            next.push(0);
            start = Bytes::from(next);
        }
        assert_eq!(seen, 6);
    }

    /// An empty or inverted range answers nothing (and does not panic).
    #[test]
    fn inverted_ranges_are_empty() {
        let s = Structures::new();
        run(&s, &Update::Put { key: Bytes::from_static(b"b"), value: Bytes::new() }, at(1));
        for (a, b) in [("b", "b"), ("c", "a")] {
            let q = Query::Range { start: Bytes::from(a), end: Some(Bytes::from(b)), limit: 10 };
            assert_eq!(ask(&s, &q), QueryReply::Range(RangeReply::default()));
        }
    }
}
