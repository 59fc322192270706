//! The failure-atomic data structures of the paper's evaluation (§8.2–8.4)
//! as one replicated service, [`Structures`]: an ordered map (the
//! key-value store), named priority queues (the Lobsters top-K) and an
//! undirected graph (the adjacency list). Clients speak [`ops`].
//!
//! Failure atomicity is the runtime's: an update is applied in memory,
//! whole, and reaches the disk only through the log and snapshots
//! (`crate::service`). So every `apply` here checks what it needs before
//! it changes anything, cannot fail once it starts (the decoder refused
//! every malformed or oversized input), and is deterministic: the same
//! update on the same state gives the same state and reply on every
//! replica.
//!
//! Concurrency: each structure is split into shards, each a
//! `Mutex<imbl::OrdMap>` (persistent, so a snapshot is an O(1) clone per
//! shard). Footprints (below) declare which updates commute; updates the
//! runtime runs together lock only the shards they touch, and a graph
//! edge update that touches two shards locks them in index order, as does
//! every reader of several shards, so no two lockers wait on each other.
//!
//! | update                      | footprint                                  | note |
//! |-----------------------------|--------------------------------------------|------|
//! | Put, Delete, CompareAndSwap | Exclusive on hash(map, key)                | 1    |
//! | Push                        | Shared on hash(queue)                      | 2    |
//! | Pop, PopMany                | Exclusive on hash(queue)                   | 3    |
//! | AddVertex                   | Exclusive on hash(graph, v)                |      |
//! | AddEdge, RemoveEdge         | Exclusive on hash(graph, u), hash(graph, v) | 4   |
//! | RemoveVertex                | Barrier                                    | 5    |
//!
//! 1. Updates of different keys commute (§6.4).
//! 2. Pushes onto one queue commute: an element's rank is (priority, log
//!    position), the same whatever order they apply in, and a push
//!    replies nothing.
//! 3. What a pop takes depends on every push and pop before it.
//! 4. Edge updates commute iff their vertex sets are disjoint (§6.4).
//! 5. Its neighbors are not known from the update: see
//!    [`Structures::footprint_of`].
//!
//! A stored value is a slice of the log entry it arrived in when it is
//! longer than [`OWN_COPY_LEN_MAX`], a copy otherwise (see [`own`]).
//!
//! Snapshot format (version 1; the runtime wraps it in its own CRC'd
//! file), all little-endian, `bytes` = u32 length + bytes:
//!
//! ```text
//! magic u64 = SNAPSHOT_MAGIC, version u32 = 1
//! 0x01 map:    count u64, count × (key bytes, value bytes)      keys strictly ascending
//! 0x02 queues: count u64, count × (name bytes, n u64 ≥ 1,       names strictly ascending
//!                 n × (priority i64, index u64, op u32, value bytes))  in pop order, strictly
//! 0x03 graph:  vertices u64, vertices × (id u64, attrs bytes)   ids strictly ascending
//!              edges u64, edges × (u u64, v u64, attrs bytes)   u < v, (u, v) strictly ascending
//! 0xff end, then nothing
//! ```
//!
//! The format is canonical (one state, one byte string), so equal states
//! give equal snapshots; tests compare states that way.
//!
//! What [`Service::restore`] meets, and does (it replaces the state only
//! once all of it decoded; otherwise the state stays as it was):
//!
//! | input                                        | outcome                              |
//! |----------------------------------------------|--------------------------------------|
//! | wrong magic                                  | refused: not our snapshot            |
//! | another version                              | refused: no other version exists yet |
//! | a section missing, out of order, or unknown  | refused                              |
//! | truncated anywhere, or bytes after the end   | refused                              |
//! | a length or count over its bound or over the bytes left | refused before allocating |
//! | keys, names, ranks, ids or edges not strictly ascending (duplicates too) | refused |
//! | an empty queue, a self-loop, an edge to a missing vertex | refused (memory never holds them) |

mod graph;
mod map;
pub mod ops;
mod pqueue;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use bytes::{BufMut, Bytes};
use smallvec::SmallVec;

use blizzard_proto::{DecodeError, Wire, Writer};

use crate::service::{Access, Footprint, Position, Service};
use ops::Dec;
pub use ops::{Query, QueryReply, Update, UpdateReply};

/// "BLZDSNAP", little-endian.
pub const SNAPSHOT_MAGIC: u64 = u64::from_le_bytes(*b"BLZDSNAP");
pub const SNAPSHOT_VERSION: u32 = 1;
const SECTION_MAP: u8 = 0x01;
const SECTION_QUEUES: u8 = 0x02;
const SECTION_GRAPH: u8 = 0x03;
const SECTION_END: u8 = 0xff;

/// `write_snapshot` hands out pieces of about this size (and values
/// longer than [`OWN_COPY_LEN_MAX`] as pieces of their own, uncopied).
const SNAPSHOT_PIECE_LEN: usize = 64 << 10;

/// Stored values at most this long are copied out of the buffer they
/// arrived in; longer ones are kept as slices of it (see [`own`]).
pub const OWN_COPY_LEN_MAX: usize = 4 << 10;

/// What a structure keeps of a value from an update or a snapshot.
///
/// Decoded values are slices of their log entry (or snapshot) buffer, and
/// a stored slice keeps that whole buffer alive for as long as the value
/// lives. Small values are copied (a page-sized copy costs about what
/// inserting it does), so the many small values of a batch never pin it;
/// a larger value is kept as a slice, which pins at most its entry: a
/// memory overhead of at most entry size / 4 KiB per value, and no copy
/// of the large values that matter. Keys and queue names (at most 4 KiB)
/// are therefore always copied.
pub(crate) fn own(b: &Bytes) -> Bytes {
    if b.len() <= OWN_COPY_LEN_MAX {
        Bytes::copy_from_slice(b)
    } else {
        b.clone()
    }
}

// Footprint-key domains: a map key, a queue name and a vertex with the
// same bytes get unrelated keys (a collision only costs concurrency).
const DOMAIN_MAP: u64 = 0x6d61_7000_0000_0001;
const DOMAIN_QUEUE: u64 = 0x7175_6575_0000_0002;
const DOMAIN_GRAPH: u64 = 0x6772_6170_0000_0003;

/// splitmix64's finalizer: a bijection on u64 that spreads every input
/// bit over the output.
const fn mix64(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a over `b` in `domain`, then mixed: the same on every replica and
/// every build (footprints and shards must not depend on a random seed).
fn hash_bytes(domain: u64, b: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325 ^ domain;
    for &c in b {
        h ^= c as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(h ^ b.len() as u64)
}

/// A map key's footprint key (also picks its shard).
pub(crate) fn map_key(key: &[u8]) -> u64 {
    hash_bytes(DOMAIN_MAP, key)
}

/// A queue's footprint key (also picks its shard).
pub(crate) fn queue_key(name: &[u8]) -> u64 {
    hash_bytes(DOMAIN_QUEUE, name)
}

/// A vertex's footprint key (also picks its shard). A bijection: two
/// vertices never share one.
pub(crate) const fn vertex_key(v: u64) -> u64 {
    mix64(v ^ DOMAIN_GRAPH)
}

/// Locks a mutex, taking the state even if a panicking holder poisoned it:
/// an `apply` changes nothing before its checks pass and cannot fail
/// after, so a panic (a broken invariant) leaves no half-made change the
/// lock would need to guard against.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `N` shards of `T` behind their own locks. Several are always locked in
/// ascending index order.
pub(crate) struct Sharded<T> {
    shards: Box<[Mutex<T>]>,
}

impl<T: Clone + Default> Sharded<T> {
    pub(crate) fn new(n: usize) -> Self {
        Sharded { shards: (0..n).map(|_| Mutex::new(T::default())).collect() }
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.len()
    }

    /// The shard a key hash belongs to.
    pub(crate) fn index(&self, hash: u64) -> usize {
        (hash % self.shards.len() as u64) as usize
    }

    pub(crate) fn lock(&self, i: usize) -> MutexGuard<'_, T> {
        lock(&self.shards[i])
    }

    /// Every shard, locked in index order.
    pub(crate) fn lock_all(&self) -> Vec<MutexGuard<'_, T>> {
        self.shards.iter().map(lock).collect()
    }

    /// A copy of every shard taken at one instant (all locked together,
    /// so no update is half in it). O(1) per shard for imbl maps.
    pub(crate) fn clone_all(&self) -> Vec<T> {
        self.lock_all().iter().map(|g| T::clone(g)).collect()
    }
}

/// Merges iterators, each ascending by key, into one ascending stream
/// (the shards of a structure hold disjoint keys).
pub(crate) struct MergeSorted<K, V, I> {
    iters: Vec<I>,
    heads: Vec<Option<(K, V)>>,
}

pub(crate) fn merge_sorted<K: Ord, V, I: Iterator<Item = (K, V)>>(
    iters: impl IntoIterator<Item = I>,
) -> MergeSorted<K, V, I> {
    let mut iters: Vec<I> = iters.into_iter().collect();
    let heads = iters.iter_mut().map(Iterator::next).collect();
    MergeSorted { iters, heads }
}

impl<K: Ord, V, I: Iterator<Item = (K, V)>> Iterator for MergeSorted<K, V, I> {
    type Item = (K, V);

    fn next(&mut self) -> Option<(K, V)> {
        // Shards are few (16): a linear scan beats a heap.
        let mut best: Option<usize> = None;
        for (i, h) in self.heads.iter().enumerate() {
            if let Some((k, _)) = h {
                if best.is_none_or(|b| matches!(&self.heads[b], Some((bk, _)) if k < bk)) {
                    best = Some(i);
                }
            }
        }
        let i = best?;
        let refill = self.iters[i].next();
        std::mem::replace(&mut self.heads[i], refill)
    }
}

/// Takes items while fewer than `limit` are taken and the byte budget
/// ([`ops::REPLY_BYTES_MAX`]) holds, but always the first; and says
/// whether any were left.
pub(crate) fn take_bounded<T>(
    mut items: impl Iterator<Item = T>,
    limit: usize,
    cost: impl Fn(&T) -> usize,
) -> (Vec<T>, bool) {
    let mut out = Vec::new();
    let mut used = 0usize;
    for it in items.by_ref() {
        let c = cost(&it);
        if out.len() >= limit || (!out.is_empty() && used + c > ops::REPLY_BYTES_MAX) {
            return (out, true);
        }
        used += c;
        out.push(it);
    }
    (out, false)
}

/// Writes a snapshot out in pieces (see the format in the module header).
pub(crate) struct SnapOut<'a> {
    w: Writer,
    out: &'a mut dyn FnMut(Bytes),
}

impl<'a> SnapOut<'a> {
    fn new(out: &'a mut dyn FnMut(Bytes)) -> Self {
        SnapOut { w: Writer::new(), out }
    }

    pub(crate) fn put<T: Wire>(&mut self, v: T) {
        v.put(&mut self.w);
        if self.w.buf.len() >= SNAPSHOT_PIECE_LEN {
            self.flush();
        }
    }

    /// Length-prefixed bytes; a long value goes out as its own piece,
    /// uncopied.
    pub(crate) fn bytes(&mut self, b: &Bytes) {
        self.put(b.len() as u32);
        if b.len() > OWN_COPY_LEN_MAX {
            self.flush();
            (self.out)(b.clone());
        } else {
            self.w.buf.put_slice(b);
            if self.w.buf.len() >= SNAPSHOT_PIECE_LEN {
                self.flush();
            }
        }
    }

    fn flush(&mut self) {
        if !self.w.buf.is_empty() {
            (self.out)(self.w.buf.split().freeze());
        }
    }
}

/// Reads a section tag, refusing any other.
fn expect_section(d: &mut Dec<'_>, section: u8) -> Result<(), DecodeError> {
    let tag = d.get::<u8>()?;
    if tag != section {
        return Err(DecodeError::BadValue { field: "snapshot section", value: tag as u64 });
    }
    Ok(())
}

/// A consistent copy of every structure (O(1) to take).
#[derive(Clone)]
pub struct Snapshot {
    map: Vec<map::Shard>,
    queues: Vec<pqueue::Shard>,
    graph: Vec<graph::Shard>,
}

/// The map, the priority queues and the graph, as one replicated service.
pub struct Structures {
    map: map::Map,
    queues: pqueue::Queues,
    graph: graph::Graph,
    /// The planted bug (see [`Structures::plant_wrong_footprints`]).
    wrong_footprints: AtomicBool,
}

impl Default for Structures {
    fn default() -> Self {
        Self::new()
    }
}

impl Structures {
    /// Empty structures.
    pub fn new() -> Self {
        Structures {
            map: map::Map::new(),
            queues: pqueue::Queues::new(),
            graph: graph::Graph::new(),
            wrong_footprints: AtomicBool::new(false),
        }
    }

    /// For tests and the simulator only: a planted bug. While on,
    /// `footprint` declares every update commuting with everything (no
    /// keys), so the runtime runs conflicting updates (two puts of one
    /// key, two pops of one queue) in any order, and replicas drift
    /// apart. The runtime's checkers must catch it.
    pub fn plant_wrong_footprints(&self, on: bool) {
        self.wrong_footprints.store(on, Ordering::Relaxed);
    }

    /// Which updates `op` commutes with (see the table in the module
    /// header).
    ///
    /// `RemoveVertex` is a barrier: it changes the vertex and every
    /// neighbor's adjacency, but which vertices those are depends on the
    /// state when it applies (edges added or removed by the updates
    /// before it), not on the update itself, and a footprint is computed
    /// from the update alone, before earlier updates have applied. A
    /// conflict-free alternative would be a graph-wide key every graph
    /// update takes `Shared` and `RemoveVertex` takes `Exclusive` (it would
    /// then wait for graph updates only); we keep the barrier, as
    /// removals are rare and every other graph update then carries at most
    /// two keys (inline).
    pub fn footprint_of(&self, op: &Update) -> Footprint {
        if self.wrong_footprints.load(Ordering::Relaxed) {
            return Footprint::Keys(SmallVec::new());
        }
        match op {
            Update::Put { key, .. } | Update::Delete { key } | Update::CompareAndSwap { key, .. } => {
                Footprint::exclusive(map_key(key))
            }
            Update::Push { queue, .. } => Footprint::shared(queue_key(queue)),
            Update::Pop { queue } | Update::PopMany { queue, .. } => Footprint::exclusive(queue_key(queue)),
            Update::AddVertex { v, .. } => Footprint::exclusive(vertex_key(*v)),
            Update::AddEdge { u, v, .. } | Update::RemoveEdge { u, v } => {
                let (a, b) = (vertex_key(*u), vertex_key(*v));
                // A key twice would make the scheduler order an update
                // after itself; the decoder refuses u == v, and
                // `vertex_key` is a bijection, so this is defence only.
                if a == b {
                    Footprint::exclusive(a)
                } else {
                    Footprint::Keys(smallvec::smallvec![(a, Access::Exclusive), (b, Access::Exclusive)])
                }
            }
            Update::RemoveVertex { .. } => Footprint::Barrier,
        }
    }

    /// Applies a decoded update (what [`Service::apply`] does, typed).
    pub fn apply_update(&self, op: &Update, at: Position) -> UpdateReply {
        match op {
            Update::Put { key, value } => UpdateReply::Put(self.map.put(key, value)),
            Update::Delete { key } => UpdateReply::Delete(self.map.delete(key)),
            Update::CompareAndSwap { key, expected, new } => {
                UpdateReply::CompareAndSwap(self.map.compare_and_swap(key, expected.as_ref(), new.as_ref()))
            }
            Update::Push { queue, priority, value } => {
                self.queues.push(queue, *priority, value, at);
                UpdateReply::Push
            }
            Update::Pop { queue } => UpdateReply::Pop(self.queues.pop(queue)),
            Update::PopMany { queue, n } => UpdateReply::PopMany(self.queues.pop_many(queue, *n as usize)),
            Update::AddVertex { v, attrs } => UpdateReply::AddVertex(self.graph.add_vertex(*v, attrs)),
            Update::RemoveVertex { v } => UpdateReply::RemoveVertex(self.graph.remove_vertex(*v)),
            Update::AddEdge { u, v, attrs } => UpdateReply::AddEdge(self.graph.add_edge(*u, *v, attrs)),
            Update::RemoveEdge { u, v } => UpdateReply::RemoveEdge(self.graph.remove_edge(*u, *v)),
        }
    }

    /// Answers a decoded query (what [`Service::read`] does, typed).
    pub fn query(&self, q: &Query) -> QueryReply {
        match q {
            Query::Get { key } => QueryReply::Get(self.map.get(key)),
            Query::Range { start, end, limit } => {
                QueryReply::Range(self.map.range(start, end.as_ref(), *limit as usize))
            }
            Query::Peek { queue, n } => QueryReply::Peek(self.queues.peek(queue, *n as usize)),
            Query::Len { queue } => QueryReply::Len(self.queues.len(queue)),
            Query::Vertex { v } => QueryReply::Vertex(self.graph.vertex(*v)),
            Query::Degree { v } => QueryReply::Degree(self.graph.degree(*v)),
            Query::Neighbors { v, start, limit } => {
                QueryReply::Neighbors(self.graph.neighbors(*v, *start, *limit as usize))
            }
            Query::Edge { u, v } => QueryReply::Edge(self.graph.edge(*u, *v)),
        }
    }

    /// Replaces every structure with `snap`'s, all shards locked together
    /// (a reader sees the old state or the new, never a mix).
    fn install(&self, snap: Snapshot) {
        let mut m = self.map.shards.lock_all();
        let mut q = self.queues.shards.lock_all();
        let mut g = self.graph.shards.lock_all();
        for (guard, shard) in m.iter_mut().zip(snap.map) {
            **guard = shard;
        }
        for (guard, shard) in q.iter_mut().zip(snap.queues) {
            **guard = shard;
        }
        for (guard, shard) in g.iter_mut().zip(snap.graph) {
            **guard = shard;
        }
    }

    /// Decodes a whole snapshot, changing nothing.
    fn decode_snapshot(bytes: &Bytes) -> Result<Snapshot, DecodeError> {
        let mut d = Dec::new(bytes);
        let magic = d.get::<u64>()?;
        if magic != SNAPSHOT_MAGIC {
            return Err(DecodeError::BadValue { field: "snapshot magic", value: magic });
        }
        let version = d.get::<u32>()?;
        if version != SNAPSHOT_VERSION {
            return Err(DecodeError::BadValue { field: "snapshot version", value: version as u64 });
        }
        expect_section(&mut d, SECTION_MAP)?;
        let map = map::read_section(&mut d)?;
        expect_section(&mut d, SECTION_QUEUES)?;
        let queues = pqueue::read_section(&mut d)?;
        expect_section(&mut d, SECTION_GRAPH)?;
        let graph = graph::read_section(&mut d)?;
        expect_section(&mut d, SECTION_END)?;
        d.finish()?;
        Ok(Snapshot { map, queues, graph })
    }
}

impl Service for Structures {
    type Op = Update;
    type Snapshot = Snapshot;

    fn decode(&self, bytes: &Bytes) -> Result<Update, DecodeError> {
        Update::decode(bytes)
    }

    fn footprint(&self, op: &Update) -> Footprint {
        self.footprint_of(op)
    }

    fn apply(&self, op: &Update, at: Position) -> Bytes {
        self.apply_update(op, at).encode()
    }

    fn read(&self, query: &Bytes) -> Result<Bytes, String> {
        let q = Query::decode(query).map_err(|e| format!("malformed data-structure query: {e}"))?;
        Ok(self.query(&q).encode())
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            map: self.map.shards.clone_all(),
            queues: self.queues.shards.clone_all(),
            graph: self.graph.shards.clone_all(),
        }
    }

    fn write_snapshot(&self, snap: &Snapshot, out: &mut dyn FnMut(Bytes)) {
        let mut o = SnapOut::new(out);
        o.put(SNAPSHOT_MAGIC);
        o.put(SNAPSHOT_VERSION);
        o.put(SECTION_MAP);
        map::write_section(&snap.map, &mut o);
        o.put(SECTION_QUEUES);
        pqueue::write_section(&snap.queues, &mut o);
        o.put(SECTION_GRAPH);
        graph::write_section(&snap.graph, &mut o);
        o.put(SECTION_END);
        o.flush();
    }

    fn restore(&self, bytes: &Bytes) -> Result<(), DecodeError> {
        let snap = Self::decode_snapshot(bytes)?;
        self.install(snap);
        Ok(())
    }
}

/// Helpers shared by the structures' tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// An update through the whole wire path: encode, decode, apply,
    /// decode the reply (which must be this update's kind).
    pub fn run(s: &Structures, op: &Update, at: Position) -> UpdateReply {
        let decoded = Service::decode(s, &op.encode()).expect("a generated update decodes");
        assert_eq!(&decoded, op);
        let reply = Service::apply(s, &decoded, at);
        op.decode_reply(&reply).expect("a reply decodes as its update's")
    }

    /// A query through the whole wire path.
    pub fn ask(s: &Structures, q: &Query) -> QueryReply {
        let reply = s.read(&q.encode()).expect("a generated query is answered");
        q.decode_reply(&reply).expect("a reply decodes as its query's")
    }

    /// The state as canonical bytes (equal states, equal bytes).
    pub fn state(s: &Structures) -> Bytes {
        serialize(s, &s.snapshot())
    }

    pub fn serialize(s: &Structures, snap: &Snapshot) -> Bytes {
        let mut all = Vec::new();
        s.write_snapshot(snap, &mut |piece| all.extend_from_slice(&piece));
        Bytes::from(all)
    }

    /// An independent copy of `s` (O(1): shares structure until changed).
    pub fn fork(s: &Structures) -> Structures {
        let copy = Structures::new();
        copy.install(s.snapshot());
        copy
    }

    /// Whether the runtime must keep `a` and `b` in log order
    /// (`machine::schedule::conflicts`, restated so these tests stand alone).
    pub fn conflicts(fa: &Footprint, fb: &Footprint) -> bool {
        match (fa, fb) {
            (Footprint::Keys(a), Footprint::Keys(b)) => a.iter().any(|(ka, xa)| {
                b.iter().any(|(kb, xb)| ka == kb && (*xa == Access::Exclusive || *xb == Access::Exclusive))
            }),
            _ => true,
        }
    }

    pub fn at(index: u64) -> Position {
        Position { index, op: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::ops::arb;
    use super::testing::*;
    use super::*;
    use proptest::prelude::*;

    /// Applies `a` then `b` and `b` then `a` to copies of `base` (at the
    /// positions the log gave them) and says how the results differ, if
    /// they do: the contract the scheduler relies on for updates whose
    /// footprints do not conflict.
    fn commute_check(base: &Structures, a: &Update, b: &Update) -> Result<(), String> {
        let (pa, pb) = (Position { index: 1000, op: 0 }, Position { index: 1000, op: 1 });
        let ab = fork(base);
        let (ra1, rb1) = (run(&ab, a, pa), run(&ab, b, pb));
        let ba = fork(base);
        let rb2 = run(&ba, b, pb);
        let ra2 = run(&ba, a, pa);
        if ra1 != ra2 || rb1 != rb2 {
            return Err(format!("replies differ: {ra1:?} {rb1:?} vs {ra2:?} {rb2:?}"));
        }
        if state(&ab) != state(&ba) {
            return Err("states differ".into());
        }
        Ok(())
    }

    fn apply_all(s: &Structures, ops: &[Update]) {
        for (i, op) in ops.iter().enumerate() {
            run(s, op, at(i as u64 + 1));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any two updates whose footprints do not conflict give the same state and replies in either order.
        #[test]
        fn commutativity_is_honest(
            prefix in proptest::collection::vec(arb::update(), 0..24),
            a in arb::update(),
            b in arb::update(),
        ) {
            let base = Structures::new();
            apply_all(&base, &prefix);
            if !conflicts(&base.footprint_of(&a), &base.footprint_of(&b)) {
                prop_assert_eq!(commute_check(&base, &a, &b), Ok(()));
            }
        }

        /// As above within one structure at a time, where pairs meet far more often (two removals of an edge's ends, a pop behind pushes).
        #[test]
        fn commutativity_is_honest_within_a_structure(
            (prefix, a, b) in prop_oneof![
                Just(0), Just(1), Just(2)
            ].prop_flat_map(|k| {
                let ops = move || match k {
                    0 => arb::map_update().boxed(),
                    1 => arb::queue_update().boxed(),
                    _ => arb::dense_graph_update().boxed(),
                };
                (proptest::collection::vec(ops(), 0..24), ops(), ops())
            }),
        ) {
            let base = Structures::new();
            apply_all(&base, &prefix);
            if !conflicts(&base.footprint_of(&a), &base.footprint_of(&b)) {
                prop_assert_eq!(commute_check(&base, &a, &b), Ok(()));
            }
        }

        /// A snapshot restores to an equal state and equal answers, into a service that held something else.
        #[test]
        fn snapshot_round_trips(
            ops in proptest::collection::vec(arb::update(), 0..48),
            other in proptest::collection::vec(arb::update(), 0..8),
            queries in proptest::collection::vec(arb::query(), 1..16),
        ) {
            let s = Structures::new();
            apply_all(&s, &ops);
            let snap = s.snapshot();
            // Updates after the snapshot do not reach it.
            run(&s, &Update::Put { key: Bytes::from_static(b"later"), value: Bytes::new() }, at(10_000));
            let bytes = serialize(&s, &snap);
            let t = Structures::new();
            apply_all(&t, &other);
            prop_assert_eq!(t.restore(&bytes), Ok(()));
            prop_assert_eq!(state(&t), bytes.clone());
            let original = Structures::new();
            apply_all(&original, &ops);
            for q in &queries {
                prop_assert_eq!(ask(&t, q), ask(&original, q));
            }
        }

        /// A damaged snapshot never panics; a truncated one or one with trailing bytes is refused and leaves the state as it was.
        #[test]
        fn damaged_snapshots_are_refused(
            ops in proptest::collection::vec(arb::update(), 1..32),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            x in 1u8..=255,
        ) {
            let s = Structures::new();
            apply_all(&s, &ops);
            let bytes = state(&s);
            let t = Structures::new();
            let keep = Update::Push { queue: Bytes::from_static(b"keep"), priority: 1, value: Bytes::new() };
            run(&t, &keep, at(1));
            let before = state(&t);

            let short = bytes.slice(..cut.index(bytes.len()));
            prop_assert!(t.restore(&short).is_err());
            prop_assert_eq!(state(&t), before.clone());

            let mut long = bytes.to_vec();
            long.push(0);
            prop_assert_eq!(t.restore(&Bytes::from(long)), Err(DecodeError::Trailing(1)));
            prop_assert_eq!(state(&t), before.clone());

            // A flipped byte may still spell a valid state (a changed
            // value); if it is refused, nothing changed.
            let mut flipped = bytes.to_vec();
            let i = flip.index(flipped.len());
            flipped[i] ^= x;
            let flipped = Bytes::from(flipped);
            match t.restore(&flipped) {
                Ok(()) => prop_assert_eq!(state(&t), flipped),
                Err(_) => prop_assert_eq!(state(&t), before),
            }
        }
    }

    /// The planted bug declares conflicting updates commuting, and the commutativity check catches it.
    #[test]
    fn planted_wrong_footprints_are_caught() {
        let s = Structures::new();
        let a = Update::Put { key: Bytes::from_static(b"k"), value: Bytes::from_static(b"1") };
        let b = Update::Put { key: Bytes::from_static(b"k"), value: Bytes::from_static(b"2") };
        assert!(conflicts(&s.footprint_of(&a), &s.footprint_of(&b)));
        s.plant_wrong_footprints(true);
        assert!(!conflicts(&s.footprint_of(&a), &s.footprint_of(&b)));
        assert!(commute_check(&s, &a, &b).is_err());
        let pop = Update::Pop { queue: Bytes::from_static(b"q") };
        assert_eq!(s.footprint_of(&pop), Footprint::Keys(SmallVec::new()));
        s.plant_wrong_footprints(false);
        assert!(conflicts(&s.footprint_of(&a), &s.footprint_of(&b)));
    }

    /// The footprints are as the module header's table says.
    #[test]
    fn footprints_follow_the_table() {
        let s = Structures::new();
        let q = || Bytes::from_static(b"q");
        let push = |p| Update::Push { queue: q(), priority: p, value: Bytes::new() };
        assert!(!conflicts(&s.footprint_of(&push(1)), &s.footprint_of(&push(2))), "pushes commute");
        assert!(conflicts(&s.footprint_of(&push(1)), &s.footprint_of(&Update::Pop { queue: q() })));
        let edge = |u, v| s.footprint_of(&Update::AddEdge { u, v, attrs: Bytes::new() });
        assert!(!conflicts(&edge(1, 2), &edge(3, 4)), "disjoint edges commute");
        assert!(conflicts(&edge(1, 2), &edge(2, 3)), "edges sharing a vertex conflict");
        assert!(conflicts(&edge(1, 2), &s.footprint_of(&Update::AddVertex { v: 1, attrs: Bytes::new() })));
        assert_eq!(s.footprint_of(&Update::RemoveVertex { v: 9 }), Footprint::Barrier);
        let Footprint::Keys(keys) = edge(5, 6) else { panic!("keys") };
        assert_eq!(keys.len(), 2);
    }

    /// Many threads applying updates with disjoint footprints (and commuting pushes onto one queue) end in the state of applying them serially.
    #[test]
    fn concurrent_apply_equals_serial() {
        const THREADS: u64 = 8;
        const OPS: u64 = 300;
        // Thread t owns map keys "t/…", queue "own-t", vertices t*1000+…
        // (spread over every shard, so edge updates of different threads
        // lock overlapping shard pairs in both orders); every thread also
        // pushes onto the shared queue.
        let ops_of = |t: u64| -> Vec<(Update, Position)> {
            let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            (0..OPS)
                .map(|i| {
                    let r = next();
                    let key = Bytes::from(format!("{t}/{}", r % 20));
                    let val = Bytes::from(format!("{t}:{i}"));
                    let own = Bytes::from(format!("own-{t}"));
                    let (u, v) = (t * 1000 + r % 16, t * 1000 + (r >> 8) % 16);
                    let op = match r % 9 {
                        0 => Update::Put { key, value: val },
                        1 => Update::Delete { key },
                        2 => Update::CompareAndSwap { key, expected: None, new: Some(val) },
                        3 => Update::Push {
                            queue: Bytes::from_static(b"shared"),
                            priority: (r % 5) as i64,
                            value: val,
                        },
                        4 => Update::Push { queue: own, priority: (r % 3) as i64, value: val },
                        5 => Update::Pop { queue: own },
                        6 => Update::AddVertex { v: u, attrs: val },
                        7 if u != v => Update::AddEdge { u, v, attrs: val },
                        _ if u != v => Update::RemoveEdge { u, v },
                        _ => Update::AddVertex { v: u, attrs: Bytes::new() },
                    };
                    // Positions as a log would give them: thread t's i-th op.
                    (op, Position { index: i + 1, op: t as u32 })
                })
                .collect()
        };
        let all: Vec<Vec<(Update, Position)>> = (0..THREADS).map(ops_of).collect();
        // The generated updates really have disjoint footprints across threads.
        let s = Structures::new();
        for (t, ops) in all.iter().enumerate() {
            for other in &all[t + 1..] {
                for (a, _) in ops.iter().step_by(7) {
                    for (b, _) in other.iter().step_by(7) {
                        assert!(!conflicts(&s.footprint_of(a), &s.footprint_of(b)), "{a:?} vs {b:?}");
                    }
                }
            }
        }

        let concurrent = Structures::new();
        let replies: Vec<Vec<Bytes>> = std::thread::scope(|sc| {
            let handles: Vec<_> = all
                .iter()
                .map(|ops| {
                    let c = &concurrent;
                    sc.spawn(move || ops.iter().map(|(op, p)| Service::apply(c, op, *p)).collect::<Vec<_>>())
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("no thread panics")).collect()
        });
        let serial = Structures::new();
        for (t, ops) in all.iter().enumerate() {
            let r: Vec<Bytes> = ops.iter().map(|(op, p)| Service::apply(&serial, op, *p)).collect();
            assert_eq!(r, replies[t], "thread {t}'s replies");
        }
        assert_eq!(state(&concurrent), state(&serial));
        let len = ask(&serial, &Query::Len { queue: Bytes::from_static(b"shared") });
        assert!(matches!(len, QueryReply::Len(n) if n > 0));
    }

    /// A snapshot's bytes are pinned for a tiny state: a format change must come with a new version.
    #[test]
    fn golden_snapshot() {
        let s = Structures::new();
        run(&s, &Update::Put { key: Bytes::from_static(b"k"), value: Bytes::from_static(b"v") }, at(1));
        run(&s, &Update::Push { queue: Bytes::from_static(b"q"), priority: -1, value: Bytes::new() }, at(2));
        run(&s, &Update::AddEdge { u: 2, v: 1, attrs: Bytes::from_static(b"e") }, at(3));
        let mut want: Vec<u8> = b"BLZDSNAP".to_vec();
        want.extend([1, 0, 0, 0]); // version
        want.extend([1, 1, 0, 0, 0, 0, 0, 0, 0]); // map: one pair
        want.extend([1, 0, 0, 0, b'k', 1, 0, 0, 0, b'v']);
        want.extend([2, 1, 0, 0, 0, 0, 0, 0, 0]); // queues: one
        want.extend([1, 0, 0, 0, b'q', 1, 0, 0, 0, 0, 0, 0, 0]); // "q", one element
        want.extend((-1i64).to_le_bytes());
        want.extend(2u64.to_le_bytes());
        want.extend(0u32.to_le_bytes());
        want.extend([0, 0, 0, 0]);
        want.extend([3, 2, 0, 0, 0, 0, 0, 0, 0]); // graph: two vertices
        want.extend([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        want.extend([2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        want.extend([1, 0, 0, 0, 0, 0, 0, 0]); // one edge
        want.extend([1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, b'e']);
        want.push(0xff);
        assert_eq!(&state(&s)[..], &want[..]);
    }

    /// Hand-made snapshots that break a rule are refused: wrong magic, version, section order, duplicates.
    #[test]
    fn invalid_snapshots_are_refused() {
        let s = Structures::new();
        let empty = state(&s);
        let mut bad_magic = empty.to_vec();
        bad_magic[0] ^= 1;
        let mut bad_version = empty.to_vec();
        bad_version[8] = 2;
        let mut dup_keys: Vec<u8> = empty[..12].to_vec();
        dup_keys.extend([1, 2, 0, 0, 0, 0, 0, 0, 0]);
        dup_keys.extend([1, 0, 0, 0, b'k', 0, 0, 0, 0, 1, 0, 0, 0, b'k', 0, 0, 0, 0]);
        dup_keys.extend_from_slice(&empty[21..]);
        let mut swapped: Vec<u8> = empty[..12].to_vec();
        swapped.extend([2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
        swapped.extend_from_slice(&empty[30..]);
        for (name, b) in
            [("magic", bad_magic), ("version", bad_version), ("dup", dup_keys), ("order", swapped)]
        {
            assert!(s.restore(&Bytes::from(b)).is_err(), "{name}");
        }
        assert_eq!(s.restore(&empty), Ok(()));
    }

    /// Large values travel through the snapshot as pieces of their own, uncopied; small ones are copied out of their entry.
    #[test]
    fn large_values_are_not_copied() {
        let s = Structures::new();
        let big = Update::Put {
            key: Bytes::from_static(b"big"),
            value: Bytes::from(vec![9u8; OWN_COPY_LEN_MAX + 1]),
        };
        let small = Update::Put { key: Bytes::from_static(b"small"), value: Bytes::from(vec![8u8; 16]) };
        let (eb, es) = (big.encode(), small.encode());
        for (e, i) in [(&eb, 1), (&es, 2)] {
            let op = Service::decode(&s, e).expect("decodes");
            Service::apply(&s, &op, at(i));
        }
        let mut pieces = Vec::new();
        s.write_snapshot(&s.snapshot(), &mut |p| pieces.push(p));
        let inside = |p: &Bytes, e: &Bytes| e.as_ptr_range().contains(&p.as_ptr());
        assert!(pieces.iter().any(|p| inside(p, &eb) && p.len() == OWN_COPY_LEN_MAX + 1));
        assert!(!pieces.iter().any(|p| inside(p, &es)));
    }
}
