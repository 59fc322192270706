//! The wire forms of the data-structure service ([`super::Structures`]):
//! updates (replicated through the log), queries (answered from the
//! leader's state) and their replies. A client builds an [`Update`] or a
//! [`Query`], sends its `encode()`, and reads the answer with a typed
//! decoder ([`decode_put_reply`], [`decode_range_reply`], ...) or the
//! generic [`UpdateReply::decode`] / [`QueryReply::decode`].
//!
//! Every message is one tag byte, then its fields in order, little-endian.
//! `bytes` is a u32 length then that many bytes (each field has a named
//! maximum, checked before anything is taken); `opt<T>` is a byte 0
//! (absent) or 1 then a `T`; `bool` is a byte 0 or 1; `list<T>` is a u32
//! count (bounded, and checked against the bytes left) then the items.
//! Nothing may follow the last field. A reply starts with its request's
//! tag, so a reply read as the wrong kind is an error, never a misreading.
//! A tag names one layout for good: a changed layout gets a new tag (the
//! tag is the version). Updates and queries use disjoint tags, so a query
//! sent as an update is rejected.
//!
//! | tag  | update         | fields after the tag                     | reply after the tag                 |
//! |------|----------------|------------------------------------------|-------------------------------------|
//! | 0x01 | Put            | key: bytes, value: bytes                 | previous value: opt<bytes>          |
//! | 0x02 | Delete         | key: bytes                               | existed: bool                       |
//! | 0x03 | CompareAndSwap | key: bytes, expected: opt<bytes>, new: opt<bytes> | swapped: bool, current: opt<bytes> |
//! | 0x10 | Push           | queue: bytes, priority: i64, value: bytes | (nothing)                          |
//! | 0x11 | Pop            | queue: bytes                             | opt<item>                           |
//! | 0x12 | PopMany        | queue: bytes, n: u32                     | list<item>, more: bool              |
//! | 0x20 | AddVertex      | v: u64, attrs: bytes                     | previous attrs: opt<bytes>          |
//! | 0x21 | RemoveVertex   | v: u64                                   | edges removed: opt<u64> (none: absent) |
//! | 0x22 | AddEdge        | u: u64, v: u64, attrs: bytes             | previous attrs: opt<bytes>          |
//! | 0x23 | RemoveEdge     | u: u64, v: u64                           | existed: bool                       |
//!
//! | tag  | query     | fields after the tag                          | reply after the tag                 |
//! |------|-----------|-----------------------------------------------|-------------------------------------|
//! | 0x81 | Get       | key: bytes                                    | value: opt<bytes>                   |
//! | 0x82 | Range     | start: bytes, end: opt<bytes>, limit: u32     | list<(key: bytes, value: bytes)>, more: bool |
//! | 0x90 | Peek      | queue: bytes, n: u32                          | list<item>, more: bool              |
//! | 0x91 | Len       | queue: bytes                                  | length: u64                         |
//! | 0xa0 | Vertex    | v: u64                                        | attrs: opt<bytes>                   |
//! | 0xa1 | Degree    | v: u64                                        | degree: opt<u64> (none: absent)     |
//! | 0xa2 | Neighbors | v: u64, start: u64, limit: u32                | list<(id: u64, attrs: bytes)>, more: bool |
//! | 0xa3 | Edge      | u: u64, v: u64                                | attrs: opt<bytes>                   |
//!
//! An `item` is `priority: i64, value: bytes`. Bounds: keys
//! [`KEY_LEN_MAX`], values [`VALUE_LEN_MAX`], queue names
//! [`QUEUE_NAME_LEN_MAX`], attributes [`ATTRS_LEN_MAX`]; `limit` and `n`
//! lie in `1..=` [`RANGE_LIMIT_MAX`], [`ITEMS_MAX`], [`NEIGHBORS_LIMIT_MAX`];
//! an edge's endpoints differ (no self-loops). A list reply also stops
//! before it would pass [`REPLY_BYTES_MAX`] (but always holds at least one
//! item), and `more` says whether anything was left out.
//!
//! Decoding slices `bytes` fields out of the buffer given (no copy): a
//! decoded value keeps that buffer alive (see `super::own` for what a
//! stored value keeps).

use bytes::{BufMut, Bytes};

use blizzard_proto::{DecodeError, Reader, Wire, Writer};

/// Longest map key.
pub const KEY_LEN_MAX: usize = 4 << 10;
/// Longest map value or queue element.
pub const VALUE_LEN_MAX: usize = 1 << 20;
/// Longest queue name.
pub const QUEUE_NAME_LEN_MAX: usize = 256;
/// Longest vertex or edge attributes.
pub const ATTRS_LEN_MAX: usize = 64 << 10;
/// Most pairs one `Range` returns.
pub const RANGE_LIMIT_MAX: u32 = 1024;
/// Most items one `Peek` returns or one `PopMany` removes.
pub const ITEMS_MAX: u32 = 1024;
/// Most neighbors one `Neighbors` returns.
pub const NEIGHBORS_LIMIT_MAX: u32 = 4096;
/// Byte budget of a list reply (counted by [`pair_cost`]): a list stops
/// before it would pass it, but always holds its first item.
pub const REPLY_BYTES_MAX: usize = 4 << 20;

// The budget admits the largest single item of every list, so the "at
// least one item" rule never makes a reply much larger than the budget.
const _: () = assert!(REPLY_BYTES_MAX >= pair_cost(KEY_LEN_MAX, VALUE_LEN_MAX));
const _: () = assert!(REPLY_BYTES_MAX >= pair_cost(8, VALUE_LEN_MAX));
const _: () = assert!(REPLY_BYTES_MAX >= pair_cost(8, ATTRS_LEN_MAX));
// Counts and lengths travel as u32 (every field is shorter than a reply,
// by the assertions above).
const _: () = assert!(REPLY_BYTES_MAX <= u32::MAX as usize);

/// What one list item costs against [`REPLY_BYTES_MAX`]: its two fields'
/// bytes plus their lengths' (a fixed-size field counts as 8 bytes).
pub const fn pair_cost(a_len: usize, b_len: usize) -> usize {
    a_len + b_len + 8
}

// Update tags.
const PUT: u8 = 0x01;
const DELETE: u8 = 0x02;
const CAS: u8 = 0x03;
const PUSH: u8 = 0x10;
const POP: u8 = 0x11;
const POP_MANY: u8 = 0x12;
const ADD_VERTEX: u8 = 0x20;
const REMOVE_VERTEX: u8 = 0x21;
const ADD_EDGE: u8 = 0x22;
const REMOVE_EDGE: u8 = 0x23;
// Query tags.
const GET: u8 = 0x81;
const RANGE: u8 = 0x82;
const PEEK: u8 = 0x90;
const LEN: u8 = 0x91;
const VERTEX: u8 = 0xa0;
const DEGREE: u8 = 0xa1;
const NEIGHBORS: u8 = 0xa2;
const EDGE: u8 = 0xa3;

/// A replicated update of one of the structures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Update {
    /// Sets `key` to `value`.
    Put { key: Bytes, value: Bytes },
    /// Removes `key`.
    Delete { key: Bytes },
    /// Sets `key` to `new` (`None`: removes it) if its value is `expected`
    /// (`None`: absent).
    CompareAndSwap { key: Bytes, expected: Option<Bytes>, new: Option<Bytes> },
    /// Adds `value` to `queue` (created if absent).
    Push { queue: Bytes, priority: i64, value: Bytes },
    /// Removes the element of `queue` with the highest priority (the
    /// earliest pushed, in log order, among equals).
    Pop { queue: Bytes },
    /// Removes up to `n` elements as `n` `Pop`s would (fewer if the reply
    /// budget runs out).
    PopMany { queue: Bytes, n: u32 },
    /// Creates vertex `v` or replaces its attributes (its edges stay).
    AddVertex { v: u64, attrs: Bytes },
    /// Removes vertex `v` and every edge touching it.
    RemoveVertex { v: u64 },
    /// Creates the undirected edge `{u, v}` or replaces its attributes;
    /// creates either endpoint that is absent (with empty attributes).
    AddEdge { u: u64, v: u64, attrs: Bytes },
    /// Removes the edge `{u, v}` (its endpoints stay).
    RemoveEdge { u: u64, v: u64 },
}

/// A read of the structures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Query {
    Get {
        key: Bytes,
    },
    /// Pairs with `start <= key < end` (no end: to the last key), in key
    /// order, at most `limit`. To read on, ask again from the last key
    /// returned with a 0 byte appended.
    Range {
        start: Bytes,
        end: Option<Bytes>,
        limit: u32,
    },
    /// The first `n` elements `Pop` would return, left in place (the
    /// paper's top-K read).
    Peek {
        queue: Bytes,
        n: u32,
    },
    Len {
        queue: Bytes,
    },
    Vertex {
        v: u64,
    },
    Degree {
        v: u64,
    },
    /// `v`'s neighbors with ids `>= start`, in id order, at most `limit`.
    Neighbors {
        v: u64,
        start: u64,
        limit: u32,
    },
    /// The edge `{u, v}`'s attributes (the same read from either end).
    Edge {
        u: u64,
        v: u64,
    },
}

/// A priority-queue element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub priority: i64,
    pub value: Bytes,
}

/// Elements in pop order; `more`: the queue holds others after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Items {
    pub items: Vec<Item>,
    pub more: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CasReply {
    /// Whether the value was `expected` (and is now `new`).
    pub swapped: bool,
    /// The value after the operation.
    pub current: Option<Bytes>,
}

/// Pairs in key order; `more`: the range holds others after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeReply {
    pub pairs: Vec<(Bytes, Bytes)>,
    pub more: bool,
}

/// Neighbors in id order with their edges' attributes; `more`: there are
/// others after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NeighborsReply {
    pub neighbors: Vec<(u64, Bytes)>,
    pub more: bool,
}

/// What an update returns (one variant per [`Update`] variant).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateReply {
    /// The previous value.
    Put(Option<Bytes>),
    /// Whether the key existed.
    Delete(bool),
    CompareAndSwap(CasReply),
    /// Nothing: a push's reply must not depend on the order of pushes it
    /// commutes with (a length or a rank would).
    Push,
    Pop(Option<Item>),
    PopMany(Items),
    /// The previous attributes (none: the vertex is new).
    AddVertex(Option<Bytes>),
    /// How many edges went with the vertex (none: it was absent).
    RemoveVertex(Option<u64>),
    /// The edge's previous attributes (none: the edge is new).
    AddEdge(Option<Bytes>),
    /// Whether the edge existed.
    RemoveEdge(bool),
}

/// What a query returns (one variant per [`Query`] variant).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QueryReply {
    Get(Option<Bytes>),
    Range(RangeReply),
    Peek(Items),
    Len(u64),
    Vertex(Option<Bytes>),
    /// None: no such vertex.
    Degree(Option<u64>),
    /// Empty for an absent vertex.
    Neighbors(NeighborsReply),
    Edge(Option<Bytes>),
}

/// A decoder that slices `bytes` fields out of the buffer (no copy) and
/// checks every bound before taking anything.
pub(crate) struct Dec<'a> {
    buf: &'a Bytes,
    r: Reader<'a>,
}

impl<'a> Dec<'a> {
    pub(crate) fn new(buf: &'a Bytes) -> Self {
        Dec { buf, r: Reader::new(buf) }
    }

    pub(crate) fn get<T: Wire>(&mut self) -> Result<T, DecodeError> {
        T::get(&mut self.r)
    }

    /// Length-prefixed bytes of at most `max`, sliced from the buffer.
    pub(crate) fn bytes(&mut self, max: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        let n = u32::get(&mut self.r)? as usize;
        if n > max {
            return Err(DecodeError::BadValue { field, value: n as u64 });
        }
        let at = self.buf.len() - self.r.left();
        self.r.take(n)?;
        Ok(self.buf.slice(at..at + n))
    }

    pub(crate) fn opt_bytes(
        &mut self,
        max: usize,
        field: &'static str,
    ) -> Result<Option<Bytes>, DecodeError> {
        Ok(if self.present(field)? { Some(self.bytes(max, field)?) } else { None })
    }

    /// An option's tag.
    pub(crate) fn present(&mut self, field: &'static str) -> Result<bool, DecodeError> {
        match u8::get(&mut self.r)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue { field, value: v as u64 }),
        }
    }

    /// A list's count: at most `max`, and no more items of at least
    /// `item_len_min` bytes than the bytes left can hold (refused before
    /// anything is allocated for them).
    pub(crate) fn count<N: Wire + Into<u64>>(
        &mut self,
        max: u64,
        item_len_min: usize,
        field: &'static str,
    ) -> Result<usize, DecodeError> {
        let n: u64 = N::get(&mut self.r)?.into();
        if n > max {
            return Err(DecodeError::BadValue { field, value: n });
        }
        let n = usize::try_from(n).map_err(|_| DecodeError::BadValue { field, value: n })?;
        if n.saturating_mul(item_len_min) > self.r.left() {
            return Err(DecodeError::ListTooLong { count: n, left: self.r.left() });
        }
        Ok(n)
    }

    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        self.r.finish()
    }
}

pub(crate) fn put_bytes(w: &mut Writer, b: &[u8]) {
    (b.len() as u32).put(w);
    w.buf.put_slice(b);
}

fn put_opt_bytes(w: &mut Writer, b: Option<&Bytes>) {
    match b {
        None => 0u8.put(w),
        Some(b) => {
            1u8.put(w);
            put_bytes(w, b);
        }
    }
}

fn put_opt_u64(w: &mut Writer, v: Option<u64>) {
    match v {
        None => 0u8.put(w),
        Some(v) => {
            1u8.put(w);
            v.put(w);
        }
    }
}

fn get_opt_u64(d: &mut Dec<'_>, field: &'static str) -> Result<Option<u64>, DecodeError> {
    Ok(if d.present(field)? { Some(d.get::<u64>()?) } else { None })
}

fn check_len(b: &[u8], max: usize, field: &'static str) -> Result<(), DecodeError> {
    if b.len() > max {
        return Err(DecodeError::BadValue { field, value: b.len() as u64 });
    }
    Ok(())
}

fn check_limit(n: u32, max: u32, field: &'static str) -> Result<u32, DecodeError> {
    if n == 0 || n > max {
        return Err(DecodeError::BadValue { field, value: n as u64 });
    }
    Ok(n)
}

fn check_edge(u: u64, v: u64) -> Result<(), DecodeError> {
    if u == v {
        return Err(DecodeError::BadValue { field: "edge endpoints (a self-loop)", value: u });
    }
    Ok(())
}

const F_KEY: &str = "map key length";
const F_VALUE: &str = "value length";
const F_EXPECTED: &str = "expected value";
const F_NEW: &str = "new value";
const F_QUEUE: &str = "queue name length";
const F_ATTRS: &str = "attributes length";
const F_N: &str = "item count";
const F_LIMIT: &str = "range limit";
const F_NEIGHBORS: &str = "neighbors limit";

impl Update {
    pub fn tag(&self) -> u8 {
        match self {
            Update::Put { .. } => PUT,
            Update::Delete { .. } => DELETE,
            Update::CompareAndSwap { .. } => CAS,
            Update::Push { .. } => PUSH,
            Update::Pop { .. } => POP,
            Update::PopMany { .. } => POP_MANY,
            Update::AddVertex { .. } => ADD_VERTEX,
            Update::RemoveVertex { .. } => REMOVE_VERTEX,
            Update::AddEdge { .. } => ADD_EDGE,
            Update::RemoveEdge { .. } => REMOVE_EDGE,
        }
    }

    /// Whether the service will accept this update: the checks
    /// [`Update::decode`] makes, with the error it would give. `encode`
    /// does not check (a client may ask first).
    pub fn check(&self) -> Result<(), DecodeError> {
        match self {
            Update::Put { key, value } => {
                check_len(key, KEY_LEN_MAX, F_KEY)?;
                check_len(value, VALUE_LEN_MAX, F_VALUE)
            }
            Update::Delete { key } => check_len(key, KEY_LEN_MAX, F_KEY),
            Update::CompareAndSwap { key, expected, new } => {
                check_len(key, KEY_LEN_MAX, F_KEY)?;
                check_len(expected.as_deref().unwrap_or_default(), VALUE_LEN_MAX, F_EXPECTED)?;
                check_len(new.as_deref().unwrap_or_default(), VALUE_LEN_MAX, F_NEW)
            }
            Update::Push { queue, value, .. } => {
                check_len(queue, QUEUE_NAME_LEN_MAX, F_QUEUE)?;
                check_len(value, VALUE_LEN_MAX, F_VALUE)
            }
            Update::Pop { queue } => check_len(queue, QUEUE_NAME_LEN_MAX, F_QUEUE),
            Update::PopMany { queue, n } => {
                check_len(queue, QUEUE_NAME_LEN_MAX, F_QUEUE)?;
                check_limit(*n, ITEMS_MAX, F_N).map(drop)
            }
            Update::AddVertex { attrs, .. } => check_len(attrs, ATTRS_LEN_MAX, F_ATTRS),
            Update::RemoveVertex { .. } => Ok(()),
            Update::AddEdge { u, v, attrs } => {
                check_edge(*u, *v)?;
                check_len(attrs, ATTRS_LEN_MAX, F_ATTRS)
            }
            Update::RemoveEdge { u, v } => check_edge(*u, *v),
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        self.tag().put(&mut w);
        match self {
            Update::Put { key, value } => {
                put_bytes(&mut w, key);
                put_bytes(&mut w, value);
            }
            Update::Delete { key } => put_bytes(&mut w, key),
            Update::CompareAndSwap { key, expected, new } => {
                put_bytes(&mut w, key);
                put_opt_bytes(&mut w, expected.as_ref());
                put_opt_bytes(&mut w, new.as_ref());
            }
            Update::Push { queue, priority, value } => {
                put_bytes(&mut w, queue);
                priority.put(&mut w);
                put_bytes(&mut w, value);
            }
            Update::Pop { queue } => put_bytes(&mut w, queue),
            Update::PopMany { queue, n } => {
                put_bytes(&mut w, queue);
                n.put(&mut w);
            }
            Update::AddVertex { v, attrs } => {
                v.put(&mut w);
                put_bytes(&mut w, attrs);
            }
            Update::RemoveVertex { v } => v.put(&mut w),
            Update::AddEdge { u, v, attrs } => {
                u.put(&mut w);
                v.put(&mut w);
                put_bytes(&mut w, attrs);
            }
            Update::RemoveEdge { u, v } => {
                u.put(&mut w);
                v.put(&mut w);
            }
        }
        w.buf.freeze()
    }

    /// Decodes and checks an update; its `bytes` fields are slices of
    /// `bytes`.
    pub fn decode(bytes: &Bytes) -> Result<Update, DecodeError> {
        let mut d = Dec::new(bytes);
        let op = match d.get::<u8>()? {
            PUT => Update::Put { key: d.bytes(KEY_LEN_MAX, F_KEY)?, value: d.bytes(VALUE_LEN_MAX, F_VALUE)? },
            DELETE => Update::Delete { key: d.bytes(KEY_LEN_MAX, F_KEY)? },
            CAS => Update::CompareAndSwap {
                key: d.bytes(KEY_LEN_MAX, F_KEY)?,
                expected: d.opt_bytes(VALUE_LEN_MAX, F_EXPECTED)?,
                new: d.opt_bytes(VALUE_LEN_MAX, F_NEW)?,
            },
            PUSH => Update::Push {
                queue: d.bytes(QUEUE_NAME_LEN_MAX, F_QUEUE)?,
                priority: d.get()?,
                value: d.bytes(VALUE_LEN_MAX, F_VALUE)?,
            },
            POP => Update::Pop { queue: d.bytes(QUEUE_NAME_LEN_MAX, F_QUEUE)? },
            POP_MANY => Update::PopMany {
                queue: d.bytes(QUEUE_NAME_LEN_MAX, F_QUEUE)?,
                n: check_limit(d.get()?, ITEMS_MAX, F_N)?,
            },
            ADD_VERTEX => Update::AddVertex { v: d.get()?, attrs: d.bytes(ATTRS_LEN_MAX, F_ATTRS)? },
            REMOVE_VERTEX => Update::RemoveVertex { v: d.get()? },
            ADD_EDGE => {
                let (u, v) = (d.get()?, d.get()?);
                check_edge(u, v)?;
                Update::AddEdge { u, v, attrs: d.bytes(ATTRS_LEN_MAX, F_ATTRS)? }
            }
            REMOVE_EDGE => {
                let (u, v) = (d.get()?, d.get()?);
                check_edge(u, v)?;
                Update::RemoveEdge { u, v }
            }
            t => return Err(DecodeError::BadValue { field: "update tag", value: t as u64 }),
        };
        d.finish()?;
        Ok(op)
    }

    /// Decodes this update's reply, refusing a reply to another kind.
    pub fn decode_reply(&self, bytes: &Bytes) -> Result<UpdateReply, DecodeError> {
        let reply = UpdateReply::decode(bytes)?;
        if reply.tag() != self.tag() {
            return Err(DecodeError::BadValue { field: "reply tag", value: reply.tag() as u64 });
        }
        Ok(reply)
    }
}

impl Query {
    pub fn tag(&self) -> u8 {
        match self {
            Query::Get { .. } => GET,
            Query::Range { .. } => RANGE,
            Query::Peek { .. } => PEEK,
            Query::Len { .. } => LEN,
            Query::Vertex { .. } => VERTEX,
            Query::Degree { .. } => DEGREE,
            Query::Neighbors { .. } => NEIGHBORS,
            Query::Edge { .. } => EDGE,
        }
    }

    /// Whether the service will accept this query (as [`Update::check`]).
    pub fn check(&self) -> Result<(), DecodeError> {
        match self {
            Query::Get { key } => check_len(key, KEY_LEN_MAX, F_KEY),
            Query::Range { start, end, limit } => {
                check_len(start, KEY_LEN_MAX, F_KEY)?;
                check_len(end.as_deref().unwrap_or_default(), KEY_LEN_MAX, F_KEY)?;
                check_limit(*limit, RANGE_LIMIT_MAX, F_LIMIT).map(drop)
            }
            Query::Peek { queue, n } => {
                check_len(queue, QUEUE_NAME_LEN_MAX, F_QUEUE)?;
                check_limit(*n, ITEMS_MAX, F_N).map(drop)
            }
            Query::Len { queue } => check_len(queue, QUEUE_NAME_LEN_MAX, F_QUEUE),
            Query::Vertex { .. } | Query::Degree { .. } | Query::Edge { .. } => Ok(()),
            Query::Neighbors { limit, .. } => check_limit(*limit, NEIGHBORS_LIMIT_MAX, F_NEIGHBORS).map(drop),
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        self.tag().put(&mut w);
        match self {
            Query::Get { key } => put_bytes(&mut w, key),
            Query::Range { start, end, limit } => {
                put_bytes(&mut w, start);
                put_opt_bytes(&mut w, end.as_ref());
                limit.put(&mut w);
            }
            Query::Peek { queue, n } => {
                put_bytes(&mut w, queue);
                n.put(&mut w);
            }
            Query::Len { queue } => put_bytes(&mut w, queue),
            Query::Vertex { v } | Query::Degree { v } => v.put(&mut w),
            Query::Neighbors { v, start, limit } => {
                v.put(&mut w);
                start.put(&mut w);
                limit.put(&mut w);
            }
            Query::Edge { u, v } => {
                u.put(&mut w);
                v.put(&mut w);
            }
        }
        w.buf.freeze()
    }

    pub fn decode(bytes: &Bytes) -> Result<Query, DecodeError> {
        let mut d = Dec::new(bytes);
        let q = match d.get::<u8>()? {
            GET => Query::Get { key: d.bytes(KEY_LEN_MAX, F_KEY)? },
            RANGE => Query::Range {
                start: d.bytes(KEY_LEN_MAX, F_KEY)?,
                end: d.opt_bytes(KEY_LEN_MAX, F_KEY)?,
                limit: check_limit(d.get()?, RANGE_LIMIT_MAX, F_LIMIT)?,
            },
            PEEK => Query::Peek {
                queue: d.bytes(QUEUE_NAME_LEN_MAX, F_QUEUE)?,
                n: check_limit(d.get()?, ITEMS_MAX, F_N)?,
            },
            LEN => Query::Len { queue: d.bytes(QUEUE_NAME_LEN_MAX, F_QUEUE)? },
            VERTEX => Query::Vertex { v: d.get()? },
            DEGREE => Query::Degree { v: d.get()? },
            NEIGHBORS => Query::Neighbors {
                v: d.get()?,
                start: d.get()?,
                limit: check_limit(d.get()?, NEIGHBORS_LIMIT_MAX, F_NEIGHBORS)?,
            },
            EDGE => Query::Edge { u: d.get()?, v: d.get()? },
            t => return Err(DecodeError::BadValue { field: "query tag", value: t as u64 }),
        };
        d.finish()?;
        Ok(q)
    }

    /// Decodes this query's reply, refusing a reply to another kind.
    pub fn decode_reply(&self, bytes: &Bytes) -> Result<QueryReply, DecodeError> {
        let reply = QueryReply::decode(bytes)?;
        if reply.tag() != self.tag() {
            return Err(DecodeError::BadValue { field: "reply tag", value: reply.tag() as u64 });
        }
        Ok(reply)
    }
}

fn put_item(w: &mut Writer, it: &Item) {
    it.priority.put(w);
    put_bytes(w, &it.value);
}

fn get_item(d: &mut Dec<'_>) -> Result<Item, DecodeError> {
    Ok(Item { priority: d.get()?, value: d.bytes(VALUE_LEN_MAX, F_VALUE)? })
}

/// An item's fewest bytes: priority and value length.
const ITEM_LEN_MIN: usize = 12;

fn put_items(w: &mut Writer, items: &Items) {
    (items.items.len() as u32).put(w);
    for it in &items.items {
        put_item(w, it);
    }
    items.more.put(w);
}

fn get_items(d: &mut Dec<'_>) -> Result<Items, DecodeError> {
    let n = d.count::<u32>(ITEMS_MAX as u64, ITEM_LEN_MIN, "item list count")?;
    let mut items = Vec::with_capacity(n);
    for _ in 0..n {
        items.push(get_item(d)?);
    }
    Ok(Items { items, more: d.get()? })
}

impl UpdateReply {
    /// The tag of the update this replies to.
    pub fn tag(&self) -> u8 {
        match self {
            UpdateReply::Put(_) => PUT,
            UpdateReply::Delete(_) => DELETE,
            UpdateReply::CompareAndSwap(_) => CAS,
            UpdateReply::Push => PUSH,
            UpdateReply::Pop(_) => POP,
            UpdateReply::PopMany(_) => POP_MANY,
            UpdateReply::AddVertex(_) => ADD_VERTEX,
            UpdateReply::RemoveVertex(_) => REMOVE_VERTEX,
            UpdateReply::AddEdge(_) => ADD_EDGE,
            UpdateReply::RemoveEdge(_) => REMOVE_EDGE,
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        self.tag().put(&mut w);
        match self {
            UpdateReply::Put(b) | UpdateReply::AddVertex(b) | UpdateReply::AddEdge(b) => {
                put_opt_bytes(&mut w, b.as_ref())
            }
            UpdateReply::Delete(x) | UpdateReply::RemoveEdge(x) => x.put(&mut w),
            UpdateReply::CompareAndSwap(c) => {
                c.swapped.put(&mut w);
                put_opt_bytes(&mut w, c.current.as_ref());
            }
            UpdateReply::Push => {}
            UpdateReply::Pop(it) => match it {
                None => 0u8.put(&mut w),
                Some(it) => {
                    1u8.put(&mut w);
                    put_item(&mut w, it);
                }
            },
            UpdateReply::PopMany(items) => put_items(&mut w, items),
            UpdateReply::RemoveVertex(n) => put_opt_u64(&mut w, *n),
        }
        w.buf.freeze()
    }

    /// Decodes any update's reply (its tag says which); `bytes` fields are
    /// slices of `bytes`.
    pub fn decode(bytes: &Bytes) -> Result<UpdateReply, DecodeError> {
        let mut d = Dec::new(bytes);
        let reply = match d.get::<u8>()? {
            PUT => UpdateReply::Put(d.opt_bytes(VALUE_LEN_MAX, F_VALUE)?),
            DELETE => UpdateReply::Delete(d.get()?),
            CAS => UpdateReply::CompareAndSwap(CasReply {
                swapped: d.get()?,
                current: d.opt_bytes(VALUE_LEN_MAX, F_VALUE)?,
            }),
            PUSH => UpdateReply::Push,
            POP => UpdateReply::Pop(if d.present("item tag")? { Some(get_item(&mut d)?) } else { None }),
            POP_MANY => UpdateReply::PopMany(get_items(&mut d)?),
            ADD_VERTEX => UpdateReply::AddVertex(d.opt_bytes(ATTRS_LEN_MAX, F_ATTRS)?),
            REMOVE_VERTEX => UpdateReply::RemoveVertex(get_opt_u64(&mut d, "edge count tag")?),
            ADD_EDGE => UpdateReply::AddEdge(d.opt_bytes(ATTRS_LEN_MAX, F_ATTRS)?),
            REMOVE_EDGE => UpdateReply::RemoveEdge(d.get()?),
            t => return Err(DecodeError::BadValue { field: "update reply tag", value: t as u64 }),
        };
        d.finish()?;
        Ok(reply)
    }
}

impl QueryReply {
    /// The tag of the query this replies to.
    pub fn tag(&self) -> u8 {
        match self {
            QueryReply::Get(_) => GET,
            QueryReply::Range(_) => RANGE,
            QueryReply::Peek(_) => PEEK,
            QueryReply::Len(_) => LEN,
            QueryReply::Vertex(_) => VERTEX,
            QueryReply::Degree(_) => DEGREE,
            QueryReply::Neighbors(_) => NEIGHBORS,
            QueryReply::Edge(_) => EDGE,
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        self.tag().put(&mut w);
        match self {
            QueryReply::Get(b) | QueryReply::Vertex(b) | QueryReply::Edge(b) => {
                put_opt_bytes(&mut w, b.as_ref())
            }
            QueryReply::Range(r) => {
                (r.pairs.len() as u32).put(&mut w);
                for (k, v) in &r.pairs {
                    put_bytes(&mut w, k);
                    put_bytes(&mut w, v);
                }
                r.more.put(&mut w);
            }
            QueryReply::Peek(items) => put_items(&mut w, items),
            QueryReply::Len(n) => n.put(&mut w),
            QueryReply::Degree(n) => put_opt_u64(&mut w, *n),
            QueryReply::Neighbors(r) => {
                (r.neighbors.len() as u32).put(&mut w);
                for (id, attrs) in &r.neighbors {
                    id.put(&mut w);
                    put_bytes(&mut w, attrs);
                }
                r.more.put(&mut w);
            }
        }
        w.buf.freeze()
    }

    /// Decodes any query's reply (its tag says which).
    pub fn decode(bytes: &Bytes) -> Result<QueryReply, DecodeError> {
        let mut d = Dec::new(bytes);
        let reply = match d.get::<u8>()? {
            GET => QueryReply::Get(d.opt_bytes(VALUE_LEN_MAX, F_VALUE)?),
            RANGE => {
                let n = d.count::<u32>(RANGE_LIMIT_MAX as u64, 8, "range pair count")?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((d.bytes(KEY_LEN_MAX, F_KEY)?, d.bytes(VALUE_LEN_MAX, F_VALUE)?));
                }
                QueryReply::Range(RangeReply { pairs, more: d.get()? })
            }
            PEEK => QueryReply::Peek(get_items(&mut d)?),
            LEN => QueryReply::Len(d.get()?),
            VERTEX => QueryReply::Vertex(d.opt_bytes(ATTRS_LEN_MAX, F_ATTRS)?),
            DEGREE => QueryReply::Degree(get_opt_u64(&mut d, "degree tag")?),
            NEIGHBORS => {
                let n = d.count::<u32>(NEIGHBORS_LIMIT_MAX as u64, 12, "neighbor count")?;
                let mut neighbors = Vec::with_capacity(n);
                for _ in 0..n {
                    neighbors.push((d.get()?, d.bytes(ATTRS_LEN_MAX, F_ATTRS)?));
                }
                QueryReply::Neighbors(NeighborsReply { neighbors, more: d.get()? })
            }
            EDGE => QueryReply::Edge(d.opt_bytes(ATTRS_LEN_MAX, F_ATTRS)?),
            t => return Err(DecodeError::BadValue { field: "query reply tag", value: t as u64 }),
        };
        d.finish()?;
        Ok(reply)
    }
}

/// Defines a typed reply decoder: decodes, then insists on one variant.
macro_rules! typed_decoder {
    ($(#[$doc:meta])* $name:ident, $enum:ident :: $variant:ident, $ty:ty) => {
        $(#[$doc])*
        pub fn $name(bytes: &Bytes) -> Result<$ty, DecodeError> {
            match $enum::decode(bytes)? {
                $enum::$variant(x) => Ok(x),
                other => Err(DecodeError::BadValue { field: "reply tag", value: other.tag() as u64 }),
            }
        }
    };
}

typed_decoder!(
    /// A `Put`'s reply: the previous value.
    decode_put_reply, UpdateReply::Put, Option<Bytes>);
typed_decoder!(
    /// A `Delete`'s reply: whether the key existed.
    decode_delete_reply, UpdateReply::Delete, bool);
typed_decoder!(decode_cas_reply, UpdateReply::CompareAndSwap, CasReply);
typed_decoder!(
    /// A `Pop`'s reply: the element removed (none: the queue was empty).
    decode_pop_reply, UpdateReply::Pop, Option<Item>);
typed_decoder!(decode_pop_many_reply, UpdateReply::PopMany, Items);
typed_decoder!(
    /// An `AddVertex`'s reply: the previous attributes.
    decode_add_vertex_reply, UpdateReply::AddVertex, Option<Bytes>);
typed_decoder!(
    /// A `RemoveVertex`'s reply: the edges removed with it (none: absent).
    decode_remove_vertex_reply, UpdateReply::RemoveVertex, Option<u64>);
typed_decoder!(
    /// An `AddEdge`'s reply: the edge's previous attributes.
    decode_add_edge_reply, UpdateReply::AddEdge, Option<Bytes>);
typed_decoder!(
    /// A `RemoveEdge`'s reply: whether the edge existed.
    decode_remove_edge_reply, UpdateReply::RemoveEdge, bool);
typed_decoder!(decode_get_reply, QueryReply::Get, Option<Bytes>);
typed_decoder!(decode_range_reply, QueryReply::Range, RangeReply);
typed_decoder!(decode_peek_reply, QueryReply::Peek, Items);
typed_decoder!(decode_len_reply, QueryReply::Len, u64);
typed_decoder!(decode_vertex_reply, QueryReply::Vertex, Option<Bytes>);
typed_decoder!(decode_degree_reply, QueryReply::Degree, Option<u64>);
typed_decoder!(decode_neighbors_reply, QueryReply::Neighbors, NeighborsReply);
typed_decoder!(decode_edge_reply, QueryReply::Edge, Option<Bytes>);

/// A `Push`'s reply (it carries nothing but its tag).
pub fn decode_push_reply(bytes: &Bytes) -> Result<(), DecodeError> {
    match UpdateReply::decode(bytes)? {
        UpdateReply::Push => Ok(()),
        other => Err(DecodeError::BadValue { field: "reply tag", value: other.tag() as u64 }),
    }
}

/// Proptest strategies over small key spaces (so that operations often
/// touch the same keys), shared by the structures' tests.
#[cfg(test)]
pub(crate) mod arb;

#[cfg(test)]
mod tests;
