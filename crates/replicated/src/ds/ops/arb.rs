use super::*;
use proptest::prelude::*;

pub fn small_bytes(max: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..=max).prop_map(Bytes::from)
}

/// One of a few short keys (some are prefixes of others).
pub fn key() -> impl Strategy<Value = Bytes> {
    prop::sample::select(vec!["", "a", "ab", "b", "ba", "c", "zz"])
        .prop_map(|s: &'static str| Bytes::from_static(s.as_bytes()))
}

pub fn value() -> impl Strategy<Value = Bytes> {
    prop_oneof![small_bytes(3), small_bytes(40)]
}

pub fn queue() -> impl Strategy<Value = Bytes> {
    prop::sample::select(vec!["q", "r", ""]).prop_map(|s: &'static str| Bytes::from_static(s.as_bytes()))
}

/// A vertex id among a few (ids spread over the shards).
pub fn vertex() -> impl Strategy<Value = u64> {
    prop::sample::select(vec![0u64, 1, 2, 3, 17, u64::MAX])
}

pub fn edge() -> impl Strategy<Value = (u64, u64)> {
    (vertex(), vertex()).prop_filter("no self-loops", |(u, v)| u != v)
}

pub fn map_update() -> impl Strategy<Value = Update> {
    prop_oneof![
        3 => (key(), value()).prop_map(|(key, value)| Update::Put { key, value }),
        1 => key().prop_map(|key| Update::Delete { key }),
        2 => (key(), prop::option::of(value()), prop::option::of(value()))
            .prop_map(|(key, expected, new)| Update::CompareAndSwap { key, expected, new }),
    ]
}

pub fn queue_update() -> impl Strategy<Value = Update> {
    prop_oneof![
        4 => (queue(), -3i64..3, value())
            .prop_map(|(queue, priority, value)| Update::Push { queue, priority, value }),
        2 => queue().prop_map(|queue| Update::Pop { queue }),
        1 => (queue(), 1u32..4).prop_map(|(queue, n)| Update::PopMany { queue, n }),
    ]
}

pub fn graph_update() -> impl Strategy<Value = Update> {
    prop_oneof![
        2 => (vertex(), value()).prop_map(|(v, attrs)| Update::AddVertex { v, attrs }),
        1 => vertex().prop_map(|v| Update::RemoveVertex { v }),
        3 => (edge(), value()).prop_map(|((u, v), attrs)| Update::AddEdge { u, v, attrs }),
        2 => edge().prop_map(|(u, v)| Update::RemoveEdge { u, v }),
    ]
}

/// Graph updates among four vertices, removals frequent: dense
/// enough that two updates often meet at a vertex or an edge.
pub fn dense_graph_update() -> impl Strategy<Value = Update> {
    let v = || 0u64..4;
    let e = || (v(), v()).prop_filter("no self-loops", |(u, v)| u != v);
    prop_oneof![
        1 => (v(), value()).prop_map(|(v, attrs)| Update::AddVertex { v, attrs }),
        3 => v().prop_map(|v| Update::RemoveVertex { v }),
        4 => (e(), value()).prop_map(|((u, v), attrs)| Update::AddEdge { u, v, attrs }),
        2 => e().prop_map(|(u, v)| Update::RemoveEdge { u, v }),
    ]
}

pub fn update() -> impl Strategy<Value = Update> {
    prop_oneof![map_update(), queue_update(), graph_update()]
}

pub fn query() -> impl Strategy<Value = Query> {
    prop_oneof![
        key().prop_map(|key| Query::Get { key }),
        (key(), prop::option::of(key()), 1u32..5).prop_map(|(start, end, limit)| Query::Range {
            start,
            end,
            limit
        }),
        (queue(), 1u32..5).prop_map(|(queue, n)| Query::Peek { queue, n }),
        queue().prop_map(|queue| Query::Len { queue }),
        vertex().prop_map(|v| Query::Vertex { v }),
        vertex().prop_map(|v| Query::Degree { v }),
        (vertex(), vertex(), 1u32..4).prop_map(|(v, start, limit)| Query::Neighbors { v, start, limit }),
        (vertex(), vertex()).prop_map(|(u, v)| Query::Edge { u, v }),
    ]
}

pub fn item() -> impl Strategy<Value = Item> {
    (any::<i64>(), value()).prop_map(|(priority, value)| Item { priority, value })
}

pub fn items() -> impl Strategy<Value = Items> {
    (proptest::collection::vec(item(), 0..5), any::<bool>()).prop_map(|(items, more)| Items { items, more })
}

pub fn update_reply() -> impl Strategy<Value = UpdateReply> {
    let ob = || prop::option::of(value());
    prop_oneof![
        ob().prop_map(UpdateReply::Put),
        any::<bool>().prop_map(UpdateReply::Delete),
        (any::<bool>(), ob())
            .prop_map(|(swapped, current)| UpdateReply::CompareAndSwap(CasReply { swapped, current })),
        Just(UpdateReply::Push),
        prop::option::of(item()).prop_map(UpdateReply::Pop),
        items().prop_map(UpdateReply::PopMany),
        ob().prop_map(UpdateReply::AddVertex),
        prop::option::of(any::<u64>()).prop_map(UpdateReply::RemoveVertex),
        ob().prop_map(UpdateReply::AddEdge),
        any::<bool>().prop_map(UpdateReply::RemoveEdge),
    ]
}

pub fn query_reply() -> impl Strategy<Value = QueryReply> {
    let ob = || prop::option::of(value());
    prop_oneof![
        ob().prop_map(QueryReply::Get),
        (proptest::collection::vec((key(), value()), 0..5), any::<bool>())
            .prop_map(|(pairs, more)| QueryReply::Range(RangeReply { pairs, more })),
        items().prop_map(QueryReply::Peek),
        any::<u64>().prop_map(QueryReply::Len),
        ob().prop_map(QueryReply::Vertex),
        prop::option::of(any::<u64>()).prop_map(QueryReply::Degree),
        (proptest::collection::vec((any::<u64>(), value()), 0..5), any::<bool>())
            .prop_map(|(neighbors, more)| QueryReply::Neighbors(NeighborsReply { neighbors, more })),
        ob().prop_map(QueryReply::Edge),
    ]
}
