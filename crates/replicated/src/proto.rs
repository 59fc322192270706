//! The runtime's wire protocol: what members say to each other (Raft's
//! messages) and what clients say to members, on one port, over
//! blizzard frames (`blizzard_rpc`: magic, version, CRC'd header and
//! meta, bounded lengths).
//!
//! | opcode | request (meta; data part) | reply |
//! |---|---|---|
//! | `0x5001` Append | cluster, vote, prev log id, commit, entry heads; the entries' bodies | `Appended` |
//! | `0x5002` Vote | cluster, vote, last log id, transfer and pre-vote flags | `Voted` |
//! | `0x5003` Snapshot | cluster, vote, snapshot meta, offset, total; a chunk of the image | `SnapshotDone` or `SnapshotMore` |
//! | `0x5010` Submit | op heads (session, seq, acked_below, kind, length); the ops' bytes | `Submitted` or `NotLeader` |
//! | `0x5011` Read | (none); the query | `ReadDone` or `NotLeader` |
//! | `0x5012` Status | (none) | `Status` |
//!
//! Every member-to-member request names the cluster it belongs to (a hash
//! of the member list it was started with): a member started with another
//! peer list, or another cluster's member, is refused (`WrongCluster`).
//!
//! Zero-copy: an Append's entry bodies and a Submit's op bytes are the
//! frame's data part; decoding slices them ([`decode_entries`],
//! [`decode_ops`]) rather than copying.

use bytes::Bytes;

use blizzard_proto::{DecodeError, ErrorReply, Reader, Wire, Writer};
use blizzard_rpc::Protocol;

use crate::codec::{
    get_entry, get_opt_log_id, get_stored_membership, get_vote, put_entry, put_opt_log_id,
    put_stored_membership, put_vote,
};
use crate::machine::session::{get_reply, put_reply};
use crate::types::{Entry, LogId, NodeId, Op, OpKind, OpReply, SnapshotMeta, Vote, BATCH_OPS_MAX};

pub const OP_APPEND: u16 = 0x5001;
pub const OP_VOTE: u16 = 0x5002;
pub const OP_SNAPSHOT: u16 = 0x5003;
pub const OP_SUBMIT: u16 = 0x5010;
pub const OP_READ: u16 = 0x5011;
pub const OP_STATUS: u16 = 0x5012;

/// Entries one Append may carry (openraft's `max_payload_entries` stays
/// below it).
pub const APPEND_ENTRIES_MAX: usize = 1 << 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Raft's AppendEntries. The entries' heads stay encoded (they need the
    /// data part to decode: [`decode_entries`]).
    Append {
        cluster: u128,
        vote: Vote,
        prev: Option<LogId>,
        commit: Option<LogId>,
        count: u32,
        heads: Bytes,
    },
    /// A vote request; `pre`: a pre-vote (would you vote for me?), which
    /// changes nothing on the voter.
    Vote {
        cluster: u128,
        vote: Vote,
        last: Option<LogId>,
        transfer: bool,
        pre: bool,
    },
    /// One chunk of a snapshot image (`offset`..+data of `total` bytes).
    Snapshot {
        cluster: u128,
        vote: Vote,
        meta: SnapshotMeta,
        offset: u64,
        total: u64,
    },
    /// Client operations; their bytes are the data part ([`decode_ops`]).
    Submit {
        heads: Vec<OpHead>,
    },
    /// A linearizable read; the query is the data part.
    Read,
    Status,
}

/// An operation as a client sends it (its bytes follow in the data part).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpHead {
    pub session: u64,
    pub seq: u64,
    pub acked_below: u64,
    pub kind: u8,
    pub len: u32,
}

pub const KIND_OPEN: u8 = 0;
pub const KIND_CLOSE: u8 = 1;
pub const KIND_UPDATE: u8 = 2;

impl Wire for OpHead {
    const MIN_LEN: usize = 29;
    fn put(&self, w: &mut Writer) {
        self.session.put(w);
        self.seq.put(w);
        self.acked_below.put(w);
        self.kind.put(w);
        self.len.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(OpHead {
            session: u64::get(r)?,
            seq: u64::get(r)?,
            acked_below: u64::get(r)?,
            kind: u8::get(r)?,
            len: u32::get(r)?,
        })
    }
}

/// A member's view, for `blizzard kv status` and clients finding the
/// leader.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Status {
    pub id: NodeId,
    pub cluster: u128,
    /// "leader", "follower", "candidate", "learner", "shutdown".
    pub state: String,
    pub term: u64,
    pub leader: Option<(NodeId, String)>,
    pub last_log: Option<u64>,
    pub committed: Option<u64>,
    pub applied: Option<u64>,
    pub snapshot: Option<u64>,
    pub purged: Option<u64>,
    /// (id, address, matched log index) per member; the match only on the
    /// leader (it tracks followers' progress).
    pub members: Vec<(NodeId, String, Option<u64>)>,
    pub ops_applied: u64,
    pub sessions_answered: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Appended(AppendResult),
    Voted {
        vote: Vote,
        granted: bool,
        last: Option<LogId>,
    },
    SnapshotDone {
        vote: Vote,
    },
    SnapshotMore,
    Submitted(Vec<OpReply>),
    ReadDone(Result<Bytes, String>),
    /// Not the leader: who is, if known (id, address).
    NotLeader {
        leader: Option<(NodeId, String)>,
    },
    Status(Status),
}

/// openraft's `AppendEntriesResponse`, on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AppendResult {
    Success,
    PartialSuccess(Option<LogId>),
    Conflict,
    HigherVote(Vote),
}

fn put_opt_leader(w: &mut Writer, l: &Option<(NodeId, String)>) {
    match l {
        None => 0u8.put(w),
        Some((id, addr)) => {
            1u8.put(w);
            id.put(w);
            addr.put(w);
        }
    }
}

fn get_opt_leader(r: &mut Reader<'_>) -> Result<Option<(NodeId, String)>, DecodeError> {
    match u8::get(r)? {
        0 => Ok(None),
        1 => Ok(Some((u64::get(r)?, String::get(r)?))),
        v => Err(DecodeError::BadValue { field: "leader tag", value: v as u64 }),
    }
}

fn put_opt_u64(w: &mut Writer, v: &Option<u64>) {
    v.put(w);
}

impl Request {
    pub fn opcode(&self) -> u16 {
        match self {
            Request::Append { .. } => OP_APPEND,
            Request::Vote { .. } => OP_VOTE,
            Request::Snapshot { .. } => OP_SNAPSHOT,
            Request::Submit { .. } => OP_SUBMIT,
            Request::Read => OP_READ,
            Request::Status => OP_STATUS,
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        match self {
            Request::Append { cluster, vote, prev, commit, count, heads } => {
                cluster.put(&mut w);
                put_vote(&mut w, vote);
                put_opt_log_id(&mut w, prev);
                put_opt_log_id(&mut w, commit);
                count.put(&mut w);
                w.buf.extend_from_slice(heads);
            }
            Request::Vote { cluster, vote, last, transfer, pre } => {
                cluster.put(&mut w);
                put_vote(&mut w, vote);
                put_opt_log_id(&mut w, last);
                transfer.put(&mut w);
                pre.put(&mut w);
            }
            Request::Snapshot { cluster, vote, meta, offset, total } => {
                cluster.put(&mut w);
                put_vote(&mut w, vote);
                put_opt_log_id(&mut w, &meta.last_log_id);
                put_stored_membership(&mut w, &meta.last_membership);
                offset.put(&mut w);
                total.put(&mut w);
            }
            Request::Submit { heads } => heads.put(&mut w),
            Request::Read | Request::Status => {}
        }
        w.buf.freeze()
    }

    pub fn decode(opcode: u16, meta: &[u8]) -> Option<Result<Request, DecodeError>> {
        let mut r = Reader::new(meta);
        let r = &mut r;
        let req = match opcode {
            OP_APPEND => (|| {
                let cluster = u128::get(r)?;
                let vote = get_vote(r)?;
                let prev = get_opt_log_id(r)?;
                let commit = get_opt_log_id(r)?;
                let count = u32::get(r)?;
                if count as usize > APPEND_ENTRIES_MAX {
                    return Err(DecodeError::BadValue { field: "append entries", value: count as u64 });
                }
                let heads = Bytes::copy_from_slice(r.take(r.left())?);
                Ok(Request::Append { cluster, vote, prev, commit, count, heads })
            })(),
            OP_VOTE => (|| {
                Ok(Request::Vote {
                    cluster: u128::get(r)?,
                    vote: get_vote(r)?,
                    last: get_opt_log_id(r)?,
                    transfer: bool::get(r)?,
                    pre: bool::get(r)?,
                })
            })(),
            OP_SNAPSHOT => (|| {
                let cluster = u128::get(r)?;
                let vote = get_vote(r)?;
                let last_log_id = get_opt_log_id(r)?;
                let last_membership = get_stored_membership(r)?;
                Ok(Request::Snapshot {
                    cluster,
                    vote,
                    meta: SnapshotMeta { last_log_id, last_membership },
                    offset: u64::get(r)?,
                    total: u64::get(r)?,
                })
            })(),
            OP_SUBMIT => (|| {
                let heads = Vec::<OpHead>::get(r)?;
                if heads.len() > BATCH_OPS_MAX {
                    return Err(DecodeError::BadValue { field: "submitted ops", value: heads.len() as u64 });
                }
                Ok(Request::Submit { heads })
            })(),
            OP_READ => Ok(Request::Read),
            OP_STATUS => Ok(Request::Status),
            _ => return None,
        };
        Some(req.and_then(|q| r.finish().map(|_| q)))
    }
}

/// Decodes an Append's entries: heads from the request, bodies sliced
/// from the frame's data part, which they must use up exactly.
pub fn decode_entries(count: u32, heads: &[u8], body: &Bytes) -> Result<Vec<Entry>, DecodeError> {
    let mut r = Reader::new(heads);
    let mut at = 0;
    let mut out = Vec::with_capacity((count as usize).min(heads.len() / 25 + 1));
    for _ in 0..count {
        out.push(get_entry(&mut r, body, &mut at)?);
    }
    r.finish()?;
    if at != body.len() {
        return Err(DecodeError::Trailing(body.len() - at));
    }
    Ok(out)
}

/// Encodes entries for an Append: (count, heads, body pieces).
pub fn encode_entries(entries: &[Entry]) -> (u32, Bytes, Vec<Bytes>) {
    let mut w = Writer::new();
    let mut body = Vec::new();
    for e in entries {
        put_entry(&mut w, &mut body, e);
    }
    (entries.len() as u32, w.buf.freeze(), body)
}

/// Decodes a Submit's ops: each op's bytes sliced from the data part,
/// which they must use up exactly.
pub fn decode_ops(heads: &[OpHead], data: &Bytes) -> Result<Vec<Op>, DecodeError> {
    let mut at = 0usize;
    let mut ops = Vec::with_capacity(heads.len());
    for h in heads {
        let len = h.len as usize;
        let kind = match h.kind {
            KIND_OPEN if len == 0 => OpKind::OpenSession,
            KIND_CLOSE if len == 0 => OpKind::CloseSession,
            KIND_UPDATE => {
                let end = at
                    .checked_add(len)
                    .filter(|e| *e <= data.len())
                    .ok_or(DecodeError::Truncated { needed: len, left: data.len().saturating_sub(at) })?;
                let b = data.slice(at..end);
                at = end;
                OpKind::Update(b)
            }
            k => return Err(DecodeError::BadValue { field: "op kind", value: k as u64 }),
        };
        ops.push(Op { session: h.session, seq: h.seq, acked_below: h.acked_below, kind });
    }
    if at != data.len() {
        return Err(DecodeError::Trailing(data.len() - at));
    }
    Ok(ops)
}

/// A Submit for `ops`: (request, data pieces).
pub fn encode_ops(ops: &[Op]) -> (Request, Vec<Bytes>) {
    let mut data = Vec::new();
    let heads = ops
        .iter()
        .map(|op| {
            let (kind, len) = match &op.kind {
                OpKind::OpenSession => (KIND_OPEN, 0),
                OpKind::CloseSession => (KIND_CLOSE, 0),
                OpKind::Update(b) => {
                    data.push(b.clone());
                    (KIND_UPDATE, b.len() as u32)
                }
            };
            OpHead { session: op.session, seq: op.seq, acked_below: op.acked_below, kind, len }
        })
        .collect();
    (Request::Submit { heads }, data)
}

pub fn encode_response(res: &Result<Reply, ErrorReply>) -> Bytes {
    let mut w = Writer::new();
    match res {
        Err(e) => {
            1u8.put(&mut w);
            e.put(&mut w);
        }
        Ok(reply) => {
            0u8.put(&mut w);
            match reply {
                Reply::Appended(a) => {
                    0u8.put(&mut w);
                    match a {
                        AppendResult::Success => 0u8.put(&mut w),
                        AppendResult::PartialSuccess(id) => {
                            1u8.put(&mut w);
                            put_opt_log_id(&mut w, id);
                        }
                        AppendResult::Conflict => 2u8.put(&mut w),
                        AppendResult::HigherVote(v) => {
                            3u8.put(&mut w);
                            put_vote(&mut w, v);
                        }
                    }
                }
                Reply::Voted { vote, granted, last } => {
                    1u8.put(&mut w);
                    put_vote(&mut w, vote);
                    granted.put(&mut w);
                    put_opt_log_id(&mut w, last);
                }
                Reply::SnapshotDone { vote } => {
                    2u8.put(&mut w);
                    put_vote(&mut w, vote);
                }
                Reply::SnapshotMore => 3u8.put(&mut w),
                Reply::Submitted(replies) => {
                    4u8.put(&mut w);
                    (replies.len() as u32).put(&mut w);
                    for r in replies {
                        put_reply(&mut w, r);
                    }
                }
                Reply::ReadDone(res) => {
                    5u8.put(&mut w);
                    match res {
                        Ok(b) => {
                            0u8.put(&mut w);
                            (b.len() as u32).put(&mut w);
                            w.buf.extend_from_slice(b);
                        }
                        Err(e) => {
                            1u8.put(&mut w);
                            e.put(&mut w);
                        }
                    }
                }
                Reply::NotLeader { leader } => {
                    6u8.put(&mut w);
                    put_opt_leader(&mut w, leader);
                }
                Reply::Status(s) => {
                    7u8.put(&mut w);
                    s.id.put(&mut w);
                    s.cluster.put(&mut w);
                    s.state.put(&mut w);
                    s.term.put(&mut w);
                    put_opt_leader(&mut w, &s.leader);
                    put_opt_u64(&mut w, &s.last_log);
                    put_opt_u64(&mut w, &s.committed);
                    put_opt_u64(&mut w, &s.applied);
                    put_opt_u64(&mut w, &s.snapshot);
                    put_opt_u64(&mut w, &s.purged);
                    (s.members.len() as u32).put(&mut w);
                    for (id, addr, matched) in &s.members {
                        id.put(&mut w);
                        addr.put(&mut w);
                        matched.put(&mut w);
                    }
                    s.ops_applied.put(&mut w);
                    s.sessions_answered.put(&mut w);
                }
            }
        }
    }
    w.buf.freeze()
}

/// Largest read result (a range query's) a reply may carry.
pub const READ_REPLY_MAX: usize = 16 << 20;

pub fn decode_response(meta: &[u8]) -> Result<Result<Reply, ErrorReply>, DecodeError> {
    let mut r = Reader::new(meta);
    let r = &mut r;
    let res = match u8::get(r)? {
        1 => Err(ErrorReply::get(r)?),
        0 => Ok(match u8::get(r)? {
            0 => Reply::Appended(match u8::get(r)? {
                0 => AppendResult::Success,
                1 => AppendResult::PartialSuccess(get_opt_log_id(r)?),
                2 => AppendResult::Conflict,
                3 => AppendResult::HigherVote(get_vote(r)?),
                v => return Err(DecodeError::BadValue { field: "append result", value: v as u64 }),
            }),
            1 => Reply::Voted { vote: get_vote(r)?, granted: bool::get(r)?, last: get_opt_log_id(r)? },
            2 => Reply::SnapshotDone { vote: get_vote(r)? },
            3 => Reply::SnapshotMore,
            4 => {
                let n = u32::get(r)? as usize;
                if n > BATCH_OPS_MAX || n > r.left() {
                    return Err(DecodeError::ListTooLong { count: n, left: r.left() });
                }
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(get_reply(r)?);
                }
                Reply::Submitted(v)
            }
            5 => Reply::ReadDone(match u8::get(r)? {
                0 => {
                    let n = u32::get(r)? as usize;
                    if n > READ_REPLY_MAX {
                        return Err(DecodeError::BadValue { field: "read reply length", value: n as u64 });
                    }
                    Ok(Bytes::copy_from_slice(r.take(n)?))
                }
                1 => Err(String::get(r)?),
                v => return Err(DecodeError::BadValue { field: "read result", value: v as u64 }),
            }),
            6 => Reply::NotLeader { leader: get_opt_leader(r)? },
            7 => {
                let mut s = Status {
                    id: u64::get(r)?,
                    cluster: u128::get(r)?,
                    state: String::get(r)?,
                    term: u64::get(r)?,
                    leader: get_opt_leader(r)?,
                    last_log: Option::get(r)?,
                    committed: Option::get(r)?,
                    applied: Option::get(r)?,
                    snapshot: Option::get(r)?,
                    purged: Option::get(r)?,
                    ..Status::default()
                };
                let n = u32::get(r)? as usize;
                if n > crate::codec::MEMBERS_MAX {
                    return Err(DecodeError::BadValue { field: "status members", value: n as u64 });
                }
                for _ in 0..n {
                    s.members.push((u64::get(r)?, String::get(r)?, Option::get(r)?));
                }
                s.ops_applied = u64::get(r)?;
                s.sessions_answered = u64::get(r)?;
                Reply::Status(s)
            }
            v => return Err(DecodeError::BadValue { field: "reply kind", value: v as u64 }),
        }),
        v => return Err(DecodeError::BadValue { field: "response status", value: v as u64 }),
    };
    r.finish()?;
    Ok(res)
}

/// The runtime's protocol for `blizzard_rpc`.
pub struct Replicated;

impl Protocol for Replicated {
    type Request = Request;
    type Reply = Reply;

    fn opcode(req: &Request) -> u16 {
        req.opcode()
    }
    fn encode_request(req: &Request) -> Bytes {
        req.encode()
    }
    fn decode_request(opcode: u16, meta: &[u8]) -> Option<Result<Request, DecodeError>> {
        Request::decode(opcode, meta)
    }
    fn encode_response(res: &Result<Reply, ErrorReply>) -> Bytes {
        encode_response(res)
    }
    fn decode_response(opcode: u16, meta: &[u8]) -> Option<Result<Result<Reply, ErrorReply>, DecodeError>> {
        matches!(opcode, OP_APPEND | OP_VOTE | OP_SNAPSHOT | OP_SUBMIT | OP_READ | OP_STATUS)
            .then(|| decode_response(meta))
    }
}

/// The log id a vote's `last` or a snapshot names, for messages.
pub fn index_of(id: &Option<LogId>) -> Option<u64> {
    id.as_ref().map(|l| l.index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::{any_entry, log_id};
    use proptest::prelude::*;

    fn vote() -> Vote {
        Vote::new(3, 2)
    }

    #[test]
    fn requests_round_trip() {
        let reqs = [
            Request::Vote {
                cluster: 7,
                vote: vote(),
                last: Some(log_id(2, 1, 9)),
                transfer: true,
                pre: false,
            },
            Request::Submit {
                heads: vec![OpHead { session: 1, seq: 2, acked_below: 1, kind: KIND_UPDATE, len: 3 }],
            },
            Request::Read,
            Request::Status,
        ];
        for q in reqs {
            assert_eq!(Request::decode(q.opcode(), &q.encode()), Some(Ok(q.clone())));
        }
        assert_eq!(Request::decode(0x0101, &[]), None, "a blob-store opcode is not ours");
    }

    #[test]
    fn replies_round_trip() {
        let replies = [
            Reply::Appended(AppendResult::PartialSuccess(Some(log_id(1, 1, 4)))),
            Reply::Appended(AppendResult::HigherVote(vote())),
            Reply::Voted { vote: vote(), granted: false, last: None },
            Reply::Submitted(vec![
                OpReply::Applied(Bytes::from_static(b"v")),
                OpReply::SessionOpened(65536),
                OpReply::Rejected("bad".into()),
            ]),
            Reply::ReadDone(Ok(Bytes::from_static(b"abc"))),
            Reply::ReadDone(Err("no such".into())),
            Reply::NotLeader { leader: Some((2, "h2:1".into())) },
            Reply::Status(Status {
                id: 1,
                cluster: 9,
                state: "leader".into(),
                term: 4,
                leader: Some((1, "h1:1".into())),
                last_log: Some(10),
                members: vec![(1, "h1:1".into(), Some(10)), (2, "h2:1".into(), None)],
                ..Status::default()
            }),
        ];
        for rep in replies {
            assert_eq!(decode_response(&encode_response(&Ok(rep.clone()))), Ok(Ok(rep)));
        }
    }

    proptest! {
        /// An Append's entries come back from heads + data, and any
        /// truncated head list or stray data byte is refused.
        #[test]
        fn appended_entries_round_trip(es in proptest::collection::vec(any_entry(), 0..5), extra in any::<u8>()) {
            let (count, heads, body) = encode_entries(&es);
            let body = crate::codec::join(&body);
            prop_assert_eq!(decode_entries(count, &heads, &body).ok(), Some(es.clone()));
            let mut more = body.to_vec();
            more.push(extra);
            prop_assert!(decode_entries(count, &heads, &Bytes::from(more)).is_err());
            if !heads.is_empty() {
                prop_assert!(decode_entries(count, &heads[..heads.len() - 1], &body).is_err());
            }
        }

        /// Random bytes as a response never panic the decoder.
        #[test]
        fn garbage_responses_are_errors_not_panics(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_response(&b);
            for op in [OP_APPEND, OP_VOTE, OP_SNAPSHOT, OP_SUBMIT, OP_READ, OP_STATUS] {
                let _ = Request::decode(op, &b);
            }
        }
    }
}
