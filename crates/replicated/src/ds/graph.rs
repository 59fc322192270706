//! An undirected graph with attributes on vertices and edges (the paper's
//! adjacency list, §6.4 and §8.3): vertices are u64 ids; an edge `{u, v}`
//! joins two different vertices (no self-loops) and is stored at both
//! ends, with the same attributes, so reading it from `u` or from `v`
//! gives the same answer (§6.4's consistency rule).
//!
//! `AddEdge` creates an absent endpoint with empty attributes (a stream
//! of edges, as in the paper's Twitter workload, needs no vertex
//! bookkeeping); `RemoveEdge` leaves the endpoints; `RemoveVertex` takes
//! every edge touching the vertex with it.
//!
//! Sharded by vertex id into [`GRAPH_SHARDS`] `imbl::OrdMap`s of vertices,
//! each holding its adjacency as an `imbl::OrdMap` from neighbor to edge
//! attributes. An edge update locks its two endpoints' shards (one if they
//! share it), lower index first; a reader of two shards does the same, and
//! `RemoveVertex` (a barrier: see `Structures::footprint_of`) locks them
//! all in order, so lockers never wait on each other in a cycle.
//!
//! Invariants: a vertex lives in its id's shard; `v` is in `u`'s
//! adjacency iff `u` is in `v`'s, with equal attributes; no vertex is its
//! own neighbor. An update changes both ends under both locks, so no
//! reader sees one end without the other.

use std::ops::Bound;

use bytes::Bytes;
use imbl::OrdMap;

use blizzard_proto::DecodeError;

use super::ops::{pair_cost, Dec, NeighborsReply, ATTRS_LEN_MAX};
use super::{merge_sorted, own, take_bounded, vertex_key, Sharded, SnapOut};
use std::sync::MutexGuard;

/// Shards of the graph: edge updates whose four endpoints' shards differ
/// never wait for each other.
pub(crate) const GRAPH_SHARDS: usize = 16;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Vertex {
    pub(crate) attrs: Bytes,
    /// Neighbor id to the edge's attributes.
    pub(crate) adj: OrdMap<u64, Bytes>,
}

pub(crate) type Shard = OrdMap<u64, Vertex>;

pub(crate) struct Graph {
    pub(crate) shards: Sharded<Shard>,
}

/// The shards of an edge's two endpoints, locked (lower index first).
enum Pair<'a> {
    One(MutexGuard<'a, Shard>),
    Two { lo: usize, a: MutexGuard<'a, Shard>, b: MutexGuard<'a, Shard> },
}

impl Graph {
    pub(crate) fn new() -> Self {
        Graph { shards: Sharded::new(GRAPH_SHARDS) }
    }

    fn shard_of(&self, v: u64) -> usize {
        self.shards.index(vertex_key(v))
    }

    fn lock_pair(&self, u: u64, v: u64) -> Pair<'_> {
        let (i, j) = (self.shard_of(u), self.shard_of(v));
        if i == j {
            return Pair::One(self.shards.lock(i));
        }
        let (lo, hi) = (i.min(j), i.max(j));
        let a = self.shards.lock(lo);
        let b = self.shards.lock(hi);
        Pair::Two { lo, a, b }
    }

    /// Creates `v` or replaces its attributes; returns the previous ones.
    pub(crate) fn add_vertex(&self, v: u64, attrs: &Bytes) -> Option<Bytes> {
        let attrs = own(attrs);
        let mut s = self.shards.lock(self.shard_of(v));
        match s.get_mut(&v) {
            Some(x) => Some(std::mem::replace(&mut x.attrs, attrs)),
            None => {
                s.insert(v, Vertex { attrs, adj: OrdMap::new() });
                None
            }
        }
    }

    /// Removes `v` and its edges; returns how many edges went (None: `v`
    /// was absent). A barrier: nothing else applies meanwhile.
    pub(crate) fn remove_vertex(&self, v: u64) -> Option<u64> {
        let mut all = self.shards.lock_all();
        let gone = all[self.shard_of(v)].remove(&v)?;
        for n in gone.adj.keys() {
            let back = all[self.shard_of(*n)].get_mut(n).and_then(|x| x.adj.remove(&v));
            assert!(back.is_some(), "edge {v}-{n} is missing at {n}");
        }
        Some(gone.adj.len() as u64)
    }

    /// Creates the edge `{u, v}` (and absent endpoints) or replaces its
    /// attributes; returns the previous ones. `u != v` (the decoder says so).
    pub(crate) fn add_edge(&self, u: u64, v: u64, attrs: &Bytes) -> Option<Bytes> {
        debug_assert_ne!(u, v);
        let attrs = own(attrs);
        let mut p = self.lock_pair(u, v);
        let at_u = p.shard(self, u).entry(u).or_default().adj.insert(v, attrs.clone());
        let at_v = p.shard(self, v).entry(v).or_default().adj.insert(u, attrs);
        assert_eq!(at_u.is_some(), at_v.is_some(), "edge {u}-{v} was stored at one end only");
        debug_assert_eq!(at_u, at_v);
        at_u
    }

    /// Removes the edge `{u, v}`; returns whether it was there.
    pub(crate) fn remove_edge(&self, u: u64, v: u64) -> bool {
        let mut p = self.lock_pair(u, v);
        if !p.shard(self, u).get(&u).is_some_and(|x| x.adj.contains_key(&v)) {
            return false;
        }
        let at_u = p.shard(self, u).get_mut(&u).and_then(|x| x.adj.remove(&v));
        let at_v = p.shard(self, v).get_mut(&v).and_then(|x| x.adj.remove(&u));
        assert!(at_u.is_some() && at_v.is_some(), "edge {u}-{v} was stored at one end only");
        true
    }

    pub(crate) fn vertex(&self, v: u64) -> Option<Bytes> {
        self.shards.lock(self.shard_of(v)).get(&v).map(|x| x.attrs.clone())
    }

    pub(crate) fn degree(&self, v: u64) -> Option<u64> {
        self.shards.lock(self.shard_of(v)).get(&v).map(|x| x.adj.len() as u64)
    }

    /// `v`'s neighbors from `start` on, in id order, at most `limit` and
    /// within the reply budget.
    pub(crate) fn neighbors(&self, v: u64, start: u64, limit: usize) -> NeighborsReply {
        // O(1) copy under the lock; the walk happens outside it.
        let Some(adj) = self.shards.lock(self.shard_of(v)).get(&v).map(|x| x.adj.clone()) else {
            return NeighborsReply::default();
        };
        let (neighbors, more) = take_bounded(
            adj.range((Bound::Included(start), Bound::Unbounded)).map(|(n, a)| (*n, a.clone())),
            limit,
            |(_, a)| pair_cost(8, a.len()),
        );
        NeighborsReply { neighbors, more }
    }

    /// The edge `{u, v}`'s attributes, read at both ends (which must agree).
    pub(crate) fn edge(&self, u: u64, v: u64) -> Option<Bytes> {
        let mut p = self.lock_pair(u, v);
        let at_u = p.shard(self, u).get(&u).and_then(|x| x.adj.get(&v)).cloned();
        let at_v = p.shard(self, v).get(&v).and_then(|x| x.adj.get(&u)).cloned();
        assert_eq!(at_u.is_some(), at_v.is_some(), "edge {u}-{v} is stored at one end only");
        debug_assert_eq!(at_u, at_v);
        at_u
    }
}

impl Pair<'_> {
    /// The locked shard holding `v` (one of the pair's two vertices).
    fn shard(&mut self, g: &Graph, v: u64) -> &mut Shard {
        match self {
            Pair::One(s) => s,
            Pair::Two { lo, a, b } => {
                if g.shard_of(v) == *lo {
                    a
                } else {
                    b
                }
            }
        }
    }
}

/// Writes the graph's snapshot section (after its tag): vertices in id
/// order, then each edge once, as `(u, v)` with `u < v`, in order.
pub(crate) fn write_section(shards: &[Shard], o: &mut SnapOut<'_>) {
    let vertices: usize = shards.iter().map(Shard::len).sum();
    let ends: usize = shards.iter().flat_map(|s| s.values()).map(|x| x.adj.len()).sum();
    assert!(ends.is_multiple_of(2), "an edge is stored at both ends");
    o.put(vertices as u64);
    for (id, x) in merge_sorted(shards.iter().map(|s| s.iter())) {
        o.put(*id);
        o.bytes(&x.attrs);
    }
    o.put((ends / 2) as u64);
    for (u, x) in merge_sorted(shards.iter().map(|s| s.iter())) {
        for (v, attrs) in x.adj.range((Bound::Excluded(*u), Bound::Unbounded)) {
            o.put(*u);
            o.put(*v);
            o.bytes(attrs);
        }
    }
}

/// Reads the graph's snapshot section into fresh shards (ids and edges
/// strictly ascending, edges between existing distinct vertices, every
/// length bounded).
pub(crate) fn read_section(d: &mut Dec<'_>) -> Result<Vec<Shard>, DecodeError> {
    let g = Graph::new();
    let mut shards = vec![Shard::new(); g.shards.len()];
    // A vertex is at least its id and attributes length.
    let vertices = d.count::<u64>(u64::MAX, 12, "snapshot vertex count")?;
    let mut prev: Option<u64> = None;
    for _ in 0..vertices {
        let id = d.get::<u64>()?;
        let attrs = d.bytes(ATTRS_LEN_MAX, "snapshot vertex attributes length")?;
        if prev.is_some_and(|p| p >= id) {
            return Err(DecodeError::BadValue { field: "snapshot vertex ids not ascending at", value: id });
        }
        shards[g.shard_of(id)].insert(id, Vertex { attrs: own(&attrs), adj: OrdMap::new() });
        prev = Some(id);
    }
    // An edge is at least its ends and attributes length.
    let edges = d.count::<u64>(u64::MAX, 20, "snapshot edge count")?;
    let mut prev: Option<(u64, u64)> = None;
    for _ in 0..edges {
        let (u, v) = (d.get::<u64>()?, d.get::<u64>()?);
        let attrs = own(&d.bytes(ATTRS_LEN_MAX, "snapshot edge attributes length")?);
        if u >= v || prev.is_some_and(|p| p >= (u, v)) {
            return Err(DecodeError::BadValue {
                field: "snapshot edges not ascending (u < v) at u",
                value: u,
            });
        }
        for (a, b) in [(u, v), (v, u)] {
            let Some(x) = shards[g.shard_of(a)].get_mut(&a) else {
                return Err(DecodeError::BadValue { field: "snapshot edge end is no vertex", value: a });
            };
            x.adj.insert(b, attrs.clone());
        }
        prev = Some((u, v));
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::ops::{arb, Query, QueryReply, Update, UpdateReply, NEIGHBORS_LIMIT_MAX};
    use super::super::testing::{ask, at, run};
    use super::super::Structures;
    use super::*;

    /// The reference: vertex id to (attributes, neighbor to edge
    /// attributes), both ends kept by hand.
    type Model = BTreeMap<u64, (Bytes, BTreeMap<u64, Bytes>)>;

    fn model_apply(m: &mut Model, op: &Update) -> UpdateReply {
        match op {
            Update::AddVertex { v, attrs } => match m.get_mut(v) {
                Some(x) => UpdateReply::AddVertex(Some(std::mem::replace(&mut x.0, attrs.clone()))),
                None => {
                    m.insert(*v, (attrs.clone(), BTreeMap::new()));
                    UpdateReply::AddVertex(None)
                }
            },
            Update::RemoveVertex { v } => UpdateReply::RemoveVertex(m.remove(v).map(|(_, adj)| {
                for n in adj.keys() {
                    m.get_mut(n).expect("neighbor exists").1.remove(v);
                }
                adj.len() as u64
            })),
            Update::AddEdge { u, v, attrs } => {
                m.entry(*v).or_default().1.insert(*u, attrs.clone());
                UpdateReply::AddEdge(m.entry(*u).or_default().1.insert(*v, attrs.clone()))
            }
            Update::RemoveEdge { u, v } => {
                let had = m.get_mut(u).and_then(|x| x.1.remove(v)).is_some();
                m.get_mut(v).and_then(|x| x.1.remove(u));
                UpdateReply::RemoveEdge(had)
            }
            _ => unreachable!("graph updates only"),
        }
    }

    fn model_query(m: &Model, q: &Query) -> Option<QueryReply> {
        Some(match q {
            Query::Vertex { v } => QueryReply::Vertex(m.get(v).map(|x| x.0.clone())),
            Query::Degree { v } => QueryReply::Degree(m.get(v).map(|x| x.1.len() as u64)),
            Query::Neighbors { v, start, limit } => {
                let all: Vec<(u64, Bytes)> = m
                    .get(v)
                    .map(|x| x.1.range(start..).map(|(n, a)| (*n, a.clone())).collect())
                    .unwrap_or_default();
                let k = all.len().min(*limit as usize);
                QueryReply::Neighbors(NeighborsReply { more: all.len() > k, neighbors: all[..k].to_vec() })
            }
            Query::Edge { u, v } => QueryReply::Edge(m.get(u).and_then(|x| x.1.get(v)).cloned()),
            _ => return None,
        })
    }

    /// Checks the graph's invariants: shards, symmetry, no self-loops.
    fn check_invariants(s: &Structures) {
        let shards = s.graph.shards.clone_all();
        let find = |v: u64| shards[s.graph.shard_of(v)].get(&v);
        for (i, shard) in shards.iter().enumerate() {
            for (u, x) in shard.iter() {
                assert_eq!(s.graph.shard_of(*u), i, "vertex {u} in its shard");
                for (v, a) in x.adj.iter() {
                    assert_ne!(u, v, "no self-loop");
                    assert_eq!(find(*v).and_then(|y| y.adj.get(u)), Some(a), "edge {u}-{v} at both ends");
                }
            }
        }
    }

    proptest! {
        /// Random graph updates give the replies and state of a pair of adjacency BTreeMaps, read back through every query.
        #[test]
        fn graph_matches_model(
            ops in proptest::collection::vec(arb::graph_update(), 0..64),
            queries in proptest::collection::vec(arb::query(), 0..64),
        ) {
            let s = Structures::new();
            let mut m = Model::new();
            for (i, op) in ops.iter().enumerate() {
                prop_assert_eq!(run(&s, op, at(i as u64)), model_apply(&mut m, op), "update {}", i);
                if let Some(q) = queries.get(i) {
                    if let Some(want) = model_query(&m, q) {
                        prop_assert_eq!(ask(&s, q), want, "query {:?}", q);
                    }
                }
                check_invariants(&s);
            }
            for v in [0u64, 1, 2, 3, 17, u64::MAX] {
                let q = Query::Neighbors { v, start: 0, limit: NEIGHBORS_LIMIT_MAX };
                prop_assert_eq!(ask(&s, &q), model_query(&m, &q).expect("a graph query"));
                for u in [0u64, 1, 17, u64::MAX] {
                    let (uv, vu) = (Query::Edge { u, v }, Query::Edge { u: v, v: u });
                    prop_assert_eq!(ask(&s, &uv), ask(&s, &vu), "edge read from either end");
                }
            }
        }
    }

    /// Neighbors pages through a large adjacency in id order with `start` and `more`.
    #[test]
    fn neighbors_page_in_order() {
        let s = Structures::new();
        for n in (1..=50u64).rev() {
            run(&s, &Update::AddEdge { u: 0, v: n * 3, attrs: Bytes::from(n.to_string()) }, at(n));
        }
        let mut start = 0;
        let mut seen = Vec::new();
        loop {
            let QueryReply::Neighbors(r) = ask(&s, &Query::Neighbors { v: 0, start, limit: 7 }) else {
                panic!("a neighbors reply")
            };
            seen.extend(r.neighbors.iter().map(|(n, _)| *n));
            match r.neighbors.last() {
                Some((last, _)) if r.more => start = last + 1,
                _ => break,
            }
        }
        assert_eq!(seen, (1..=50u64).map(|n| n * 3).collect::<Vec<_>>());
        assert_eq!(ask(&s, &Query::Degree { v: 0 }), QueryReply::Degree(Some(50)));
        assert_eq!(ask(&s, &Query::Degree { v: 3 }), QueryReply::Degree(Some(1)));
        assert_eq!(run(&s, &Update::RemoveVertex { v: 0 }, at(99)), UpdateReply::RemoveVertex(Some(50)));
        assert_eq!(ask(&s, &Query::Degree { v: 3 }), QueryReply::Degree(Some(0)));
        check_invariants(&s);
    }
}
