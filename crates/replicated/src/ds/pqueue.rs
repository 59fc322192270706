//! Named priority queues (the paper's Lobsters top-K, §8.4): a pop takes
//! the element with the highest priority; among equal priorities, the one
//! whose push came first in the log.
//!
//! An element's rank is `(Reverse(priority), Position)`: its push's log
//! position, the same on every replica, rather than the order pushes
//! happened to apply in. So pushes onto one queue commute (Shared on
//! hash(queue)): in either order they leave the same ranks, and a push
//! replies nothing that could depend on the order (no length, no rank
//! among others). Pops (Exclusive on hash(queue)) wait for them. There is
//! no capacity check for the same reason: "full" would depend on the
//! order of commuting pushes. Memory is bounded upstream, by what the log
//! admits.
//!
//! Each queue is an `imbl::OrdMap` from rank to value, so the first
//! element is the next to pop, a peek of the top `n` is a walk from the
//! front, and a snapshot shares structure. Queues are sharded by name
//! hash into [`QUEUE_SHARDS`] maps from name to queue.
//!
//! Invariants: a queue lives in its name's shard; a queue present is
//! never empty (the pop that empties it removes it); ranks are unique (a
//! log position holds one update).

use std::cmp::Reverse;

use bytes::Bytes;
use imbl::OrdMap;

use blizzard_proto::DecodeError;

use super::ops::{pair_cost, Dec, Item, Items, QUEUE_NAME_LEN_MAX, VALUE_LEN_MAX};
use super::{merge_sorted, own, queue_key, take_bounded, Sharded, SnapOut};
use crate::service::Position;

/// Shards of the queue directory.
pub(crate) const QUEUE_SHARDS: usize = 16;

/// Pop order: highest priority first, then earliest in the log.
pub(crate) type Rank = (Reverse<i64>, Position);
pub(crate) type Queue = OrdMap<Rank, Bytes>;
pub(crate) type Shard = OrdMap<Bytes, Queue>;

/// What an item costs against the reply budget.
fn item_cost(value: &Bytes) -> usize {
    pair_cost(8, value.len())
}

pub(crate) struct Queues {
    pub(crate) shards: Sharded<Shard>,
}

impl Queues {
    pub(crate) fn new() -> Self {
        Queues { shards: Sharded::new(QUEUE_SHARDS) }
    }

    fn shard_of(&self, name: &[u8]) -> usize {
        self.shards.index(queue_key(name))
    }

    /// Adds `value` at `priority`, ranked by `at` among equals.
    pub(crate) fn push(&self, name: &Bytes, priority: i64, value: &Bytes, at: Position) {
        let rank = (Reverse(priority), at);
        let value = own(value);
        let mut s = self.shards.lock(self.shard_of(name));
        match s.get_mut(&name[..]) {
            Some(q) => {
                let before = q.insert(rank, value);
                // The runtime applies each log position once.
                debug_assert!(before.is_none(), "two pushes at one log position {at:?}");
            }
            None => {
                s.insert(own(name), OrdMap::unit(rank, value));
            }
        }
    }

    /// Removes and returns the first element.
    pub(crate) fn pop(&self, name: &Bytes) -> Option<Item> {
        let mut s = self.shards.lock(self.shard_of(name));
        let q = s.get_mut(&name[..])?;
        let (rank, value) = q.get_min().cloned()?;
        q.remove(&rank);
        if q.is_empty() {
            s.remove(&name[..]);
        }
        Some(Item { priority: rank.0 .0, value })
    }

    /// Removes and returns up to `n` first elements (fewer if the reply
    /// budget runs out).
    pub(crate) fn pop_many(&self, name: &Bytes, n: usize) -> Items {
        let mut s = self.shards.lock(self.shard_of(name));
        let Some(q) = s.get_mut(&name[..]) else { return Items::default() };
        let (taken, more) = take_bounded(q.iter().map(|(r, v)| (*r, v.clone())), n, |(_, v)| item_cost(v));
        for (rank, _) in &taken {
            q.remove(rank);
        }
        debug_assert_eq!(more, !q.is_empty());
        if q.is_empty() {
            s.remove(&name[..]);
        }
        Items {
            items: taken
                .into_iter()
                .map(|((Reverse(priority), _), value)| Item { priority, value })
                .collect(),
            more,
        }
    }

    /// The first `n` elements (fewer if the reply budget runs out), left
    /// in place.
    pub(crate) fn peek(&self, name: &Bytes, n: usize) -> Items {
        // O(1) copy under the lock; the walk happens outside it.
        let Some(q) = self.shards.lock(self.shard_of(name)).get(&name[..]).cloned() else {
            return Items::default();
        };
        let (items, more) = take_bounded(
            q.iter()
                .map(|((Reverse(priority), _), value)| Item { priority: *priority, value: value.clone() }),
            n,
            |it| item_cost(&it.value),
        );
        Items { items, more }
    }

    pub(crate) fn len(&self, name: &Bytes) -> u64 {
        self.shards.lock(self.shard_of(name)).get(&name[..]).map_or(0, |q| q.len() as u64)
    }
}

/// Writes the queues' snapshot section (after its tag): queues in name
/// order, each's elements in pop order.
pub(crate) fn write_section(shards: &[Shard], o: &mut SnapOut<'_>) {
    let count: usize = shards.iter().map(Shard::len).sum();
    o.put(count as u64);
    for (name, q) in merge_sorted(shards.iter().map(|s| s.iter())) {
        assert!(!q.is_empty(), "an empty queue is never stored");
        o.bytes(name);
        o.put(q.len() as u64);
        for ((Reverse(priority), at), value) in q.iter() {
            o.put(*priority);
            o.put(at.index);
            o.put(at.op);
            o.bytes(value);
        }
    }
}

/// Reads the queues' snapshot section into fresh shards (names and ranks
/// strictly ascending, no empty queue, every length bounded).
pub(crate) fn read_section(d: &mut Dec<'_>) -> Result<Vec<Shard>, DecodeError> {
    // A queue is at least its name's length and its element count; an
    // element its priority, position and value length.
    let count = d.count::<u64>(u64::MAX, 12, "snapshot queue count")?;
    let queues = Queues::new();
    let mut shards = vec![Shard::new(); queues.shards.len()];
    let mut prev: Option<Bytes> = None;
    for i in 0..count {
        let name = d.bytes(QUEUE_NAME_LEN_MAX, "snapshot queue name length")?;
        if prev.as_ref().is_some_and(|p| *p >= name) {
            return Err(DecodeError::BadValue {
                field: "snapshot queue names not ascending at queue",
                value: i as u64,
            });
        }
        let n = d.count::<u64>(u64::MAX, 24, "snapshot queue length")?;
        if n == 0 {
            return Err(DecodeError::BadValue { field: "snapshot queue empty at queue", value: i as u64 });
        }
        let mut q = Queue::new();
        let mut last: Option<Rank> = None;
        for j in 0..n {
            let priority = d.get::<i64>()?;
            let at = Position { index: d.get()?, op: d.get()? };
            let value = d.bytes(VALUE_LEN_MAX, "snapshot queue value length")?;
            let rank = (Reverse(priority), at);
            if last.is_some_and(|l| l >= rank) {
                return Err(DecodeError::BadValue {
                    field: "snapshot queue elements not in pop order at",
                    value: j as u64,
                });
            }
            q.insert(rank, own(&value));
            last = Some(rank);
        }
        shards[queues.shard_of(&name)].insert(own(&name), q);
        prev = Some(name);
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::ops::{arb, Query, QueryReply, Update, UpdateReply, ITEMS_MAX, REPLY_BYTES_MAX};
    use super::super::testing::{ask, run};
    use super::super::Structures;
    use super::*;

    /// The reference: per queue, a Vec sorted by (priority descending,
    /// position ascending).
    type Model = BTreeMap<Bytes, Vec<(i64, Position, Bytes)>>;

    fn model_pop(m: &mut Model, queue: &Bytes) -> Option<Item> {
        let q = m.get_mut(queue)?;
        let (priority, _, value) = q.remove(0);
        if q.is_empty() {
            m.remove(queue);
        }
        Some(Item { priority, value })
    }

    fn model_apply(m: &mut Model, op: &Update, at: Position) -> UpdateReply {
        match op {
            Update::Push { queue, priority, value } => {
                let q = m.entry(queue.clone()).or_default();
                let i = q.partition_point(|(p, a, _)| (Reverse(*p), *a) < (Reverse(*priority), at));
                q.insert(i, (*priority, at, value.clone()));
                UpdateReply::Push
            }
            Update::Pop { queue } => UpdateReply::Pop(model_pop(m, queue)),
            Update::PopMany { queue, n } => {
                let items: Vec<Item> = (0..*n).map_while(|_| model_pop(m, queue)).collect();
                UpdateReply::PopMany(Items { items, more: m.contains_key(queue) })
            }
            _ => unreachable!("queue updates only"),
        }
    }

    fn model_query(m: &Model, q: &Query) -> Option<QueryReply> {
        Some(match q {
            Query::Peek { queue, n } => {
                let all = m.get(queue).cloned().unwrap_or_default();
                let k = all.len().min(*n as usize);
                let items = all[..k]
                    .iter()
                    .map(|(priority, _, value)| Item { priority: *priority, value: value.clone() });
                QueryReply::Peek(Items { items: items.collect(), more: all.len() > k })
            }
            Query::Len { queue } => QueryReply::Len(m.get(queue).map_or(0, |q| q.len() as u64)),
            _ => return None,
        })
    }

    proptest! {
        /// Random pushes and pops give the replies and order of a sorted Vec (ties by log position), read back through Peek and Len.
        #[test]
        fn queues_match_model(
            ops in proptest::collection::vec((arb::queue_update(), 0u32..3), 0..64),
            queries in proptest::collection::vec(arb::query(), 0..64),
        ) {
            let s = Structures::new();
            let mut m = Model::new();
            for (i, (op, slot)) in ops.iter().enumerate() {
                // Several updates per log entry, as batches give them.
                let at = Position { index: i as u64 / 3, op: *slot + 3 * (i as u32 % 3) };
                prop_assert_eq!(run(&s, op, at), model_apply(&mut m, op, at), "update {}", i);
                if let Some(q) = queries.get(i) {
                    if let Some(want) = model_query(&m, q) {
                        prop_assert_eq!(ask(&s, q), want, "query {:?}", q);
                    }
                }
            }
            for name in ["q", "r", ""] {
                let q = Query::Peek { queue: Bytes::from(name), n: ITEMS_MAX };
                prop_assert_eq!(ask(&s, &q), model_query(&m, &q).expect("a queue query"));
            }
        }
    }

    /// Pushes of equal priority pop in log order whatever order they were applied in.
    #[test]
    fn ties_pop_in_log_order() {
        let s = Structures::new();
        let q = Bytes::from_static(b"q");
        for (index, v) in [(3u64, "c"), (1, "a"), (2, "b")] {
            let push = Update::Push { queue: q.clone(), priority: 7, value: Bytes::from(v) };
            run(&s, &push, Position { index, op: 0 });
        }
        for want in ["a", "b", "c"] {
            let got = run(&s, &Update::Pop { queue: q.clone() }, Position { index: 9, op: 0 });
            assert_eq!(got, UpdateReply::Pop(Some(Item { priority: 7, value: Bytes::from(want) })));
        }
        assert_eq!(
            run(&s, &Update::Pop { queue: q.clone() }, Position { index: 9, op: 1 }),
            UpdateReply::Pop(None)
        );
    }

    /// PopMany stops at the reply budget (taking at least one) and leaves the rest in the queue.
    #[test]
    fn pop_many_respects_the_byte_budget() {
        let s = Structures::new();
        let q = Bytes::from_static(b"big");
        for i in 0..6 {
            let push =
                Update::Push { queue: q.clone(), priority: 0, value: Bytes::from(vec![0u8; VALUE_LEN_MAX]) };
            run(&s, &push, Position { index: i, op: 0 });
        }
        let per = REPLY_BYTES_MAX / item_cost(&Bytes::from(vec![0u8; VALUE_LEN_MAX]));
        let UpdateReply::PopMany(got) =
            run(&s, &Update::PopMany { queue: q.clone(), n: 100 }, Position { index: 10, op: 0 })
        else {
            panic!("a pop-many reply")
        };
        assert_eq!((got.items.len(), got.more), (per, true));
        assert_eq!(ask(&s, &Query::Len { queue: q }), QueryReply::Len(6 - per as u64));
    }
}
