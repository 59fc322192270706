//! The binary forms of openraft's values and of log entries, shared by the
//! log store (on disk) and the network (in frames). Ours, not serde's:
//! openraft's serde form is not stable across its versions, and ours keeps
//! a service operation's bytes out of the encoded header, so they travel
//! and land as slices of the buffer they arrived in.
//!
//! An entry encodes as a *head* (log id, kind, and for a batch each op's
//! session, sequence numbers and length) and a *body*: the ops' bytes one
//! after another. Decoding takes the head and the body's `Bytes` and
//! slices each op out of the body, without copying. Every count and
//! length is checked against what is present before anything is
//! allocated (`blizzard_proto::codec`).

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;

use blizzard_proto::{DecodeError, Reader, Wire, Writer};

use crate::types::{
    Batch, Entry, LeaderId, LogId, Member, Membership, NodeId, Op, OpKind, StoredMembership, Vote,
    BATCH_OPS_MAX,
};
use openraft::EntryPayload;

pub fn put_leader_id(w: &mut Writer, l: &LeaderId) {
    l.term.put(w);
    l.node_id.put(w);
}

pub fn get_leader_id(r: &mut Reader<'_>) -> Result<LeaderId, DecodeError> {
    Ok(LeaderId { term: u64::get(r)?, node_id: u64::get(r)? })
}

pub fn put_log_id(w: &mut Writer, id: &LogId) {
    put_leader_id(w, &id.leader_id);
    id.index.put(w);
}

pub fn get_log_id(r: &mut Reader<'_>) -> Result<LogId, DecodeError> {
    Ok(LogId { leader_id: get_leader_id(r)?, index: u64::get(r)? })
}

pub const LOG_ID_LEN: usize = 24;

pub fn put_opt_log_id(w: &mut Writer, id: &Option<LogId>) {
    match id {
        None => 0u8.put(w),
        Some(id) => {
            1u8.put(w);
            put_log_id(w, id);
        }
    }
}

pub fn get_opt_log_id(r: &mut Reader<'_>) -> Result<Option<LogId>, DecodeError> {
    match u8::get(r)? {
        0 => Ok(None),
        1 => Ok(Some(get_log_id(r)?)),
        v => Err(DecodeError::BadValue { field: "log id tag", value: v as u64 }),
    }
}

pub fn put_vote(w: &mut Writer, v: &Vote) {
    put_leader_id(w, &v.leader_id);
    v.committed.put(w);
}

pub fn get_vote(r: &mut Reader<'_>) -> Result<Vote, DecodeError> {
    Ok(Vote { leader_id: get_leader_id(r)?, committed: bool::get(r)? })
}

/// Members of a group (and voters per configuration) a membership may name.
pub const MEMBERS_MAX: usize = 64;

pub fn put_membership(w: &mut Writer, m: &Membership) {
    let configs: Vec<Vec<u64>> = m.get_joint_config().iter().map(|c| c.iter().copied().collect()).collect();
    configs.put(w);
    let nodes: Vec<(u64, String)> = m.nodes().map(|(id, n)| (*id, n.addr.clone())).collect();
    (nodes.len() as u32).put(w);
    for (id, addr) in nodes {
        id.put(w);
        addr.put(w);
    }
}

pub fn get_membership(r: &mut Reader<'_>) -> Result<Membership, DecodeError> {
    let configs = Vec::<Vec<u64>>::get(r)?;
    if configs.len() > MEMBERS_MAX || configs.iter().any(|c| c.len() > MEMBERS_MAX) {
        return Err(DecodeError::BadValue { field: "membership configs", value: configs.len() as u64 });
    }
    let n = u32::get(r)? as usize;
    if n > MEMBERS_MAX {
        return Err(DecodeError::BadValue { field: "membership nodes", value: n as u64 });
    }
    let mut nodes = BTreeMap::new();
    for _ in 0..n {
        let id = u64::get(r)?;
        nodes.insert(id, Member { addr: String::get(r)? });
    }
    let configs: Vec<BTreeSet<NodeId>> = configs.into_iter().map(|c| c.into_iter().collect()).collect();
    Membership::new(configs, nodes)
        .map_err(|_| DecodeError::BadValue { field: "membership (voters not among nodes)", value: n as u64 })
}

pub fn put_stored_membership(w: &mut Writer, m: &StoredMembership) {
    put_opt_log_id(w, m.log_id());
    put_membership(w, m.membership());
}

pub fn get_stored_membership(r: &mut Reader<'_>) -> Result<StoredMembership, DecodeError> {
    let log_id = get_opt_log_id(r)?;
    Ok(StoredMembership::new(log_id, get_membership(r)?))
}

const KIND_BLANK: u8 = 0;
const KIND_BATCH: u8 = 1;
const KIND_MEMBERSHIP: u8 = 2;

const OP_OPEN: u8 = 0;
const OP_CLOSE: u8 = 1;
const OP_UPDATE: u8 = 2;

/// An op's fixed part in a head: session, seq, acked_below, kind, length.
const OP_HEAD_LEN: usize = 8 + 8 + 8 + 1 + 4;

/// Appends `e`'s head to `w` and its body's pieces to `body`; returns the
/// body's length.
pub fn put_entry(w: &mut Writer, body: &mut Vec<Bytes>, e: &Entry) -> usize {
    put_log_id(w, &e.log_id);
    let mut len = 0;
    match &e.payload {
        EntryPayload::Blank => KIND_BLANK.put(w),
        EntryPayload::Membership(m) => {
            KIND_MEMBERSHIP.put(w);
            put_membership(w, m);
        }
        EntryPayload::Normal(batch) => {
            KIND_BATCH.put(w);
            (batch.ops.len() as u32).put(w);
            for op in &batch.ops {
                op.session.put(w);
                op.seq.put(w);
                op.acked_below.put(w);
                match &op.kind {
                    OpKind::OpenSession => {
                        OP_OPEN.put(w);
                        0u32.put(w);
                    }
                    OpKind::CloseSession => {
                        OP_CLOSE.put(w);
                        0u32.put(w);
                    }
                    OpKind::Update(b) => {
                        OP_UPDATE.put(w);
                        (b.len() as u32).put(w);
                        len += b.len();
                        if !b.is_empty() {
                            body.push(b.clone());
                        }
                    }
                }
            }
        }
    }
    len
}

/// Decodes an entry's head from `r`, slicing its ops' bytes from `body`
/// starting at `*at` (advanced past them).
pub fn get_entry(r: &mut Reader<'_>, body: &Bytes, at: &mut usize) -> Result<Entry, DecodeError> {
    let log_id = get_log_id(r)?;
    let payload = match u8::get(r)? {
        KIND_BLANK => EntryPayload::Blank,
        KIND_MEMBERSHIP => EntryPayload::Membership(get_membership(r)?),
        KIND_BATCH => {
            let n = u32::get(r)? as usize;
            if n > BATCH_OPS_MAX || n.saturating_mul(OP_HEAD_LEN) > r.left() {
                return Err(DecodeError::ListTooLong { count: n, left: r.left() });
            }
            let mut ops = Vec::with_capacity(n);
            for _ in 0..n {
                let (session, seq, acked_below) = (u64::get(r)?, u64::get(r)?, u64::get(r)?);
                let kind = u8::get(r)?;
                let len = u32::get(r)? as usize;
                let kind = match kind {
                    OP_OPEN if len == 0 => OpKind::OpenSession,
                    OP_CLOSE if len == 0 => OpKind::CloseSession,
                    OP_UPDATE => {
                        let end = at.checked_add(len).filter(|e| *e <= body.len()).ok_or(
                            DecodeError::Truncated { needed: len, left: body.len().saturating_sub(*at) },
                        )?;
                        let b = body.slice(*at..end);
                        *at = end;
                        OpKind::Update(b)
                    }
                    k => return Err(DecodeError::BadValue { field: "op kind", value: k as u64 }),
                };
                ops.push(Op { session, seq, acked_below, kind });
            }
            EntryPayload::Normal(Batch { ops })
        }
        k => return Err(DecodeError::BadValue { field: "entry kind", value: k as u64 }),
    };
    Ok(Entry { log_id, payload })
}

/// One entry as one head and one body (for tests and small uses).
pub fn encode_entry(e: &Entry) -> (Bytes, Vec<Bytes>) {
    let mut w = Writer::new();
    let mut body = Vec::new();
    put_entry(&mut w, &mut body, e);
    (w.buf.freeze(), body)
}

/// The inverse of [`encode_entry`]: the head must be consumed exactly,
/// and the body too.
pub fn decode_entry(head: &[u8], body: &Bytes) -> Result<Entry, DecodeError> {
    let mut r = Reader::new(head);
    let mut at = 0;
    let e = get_entry(&mut r, body, &mut at)?;
    r.finish()?;
    if at != body.len() {
        return Err(DecodeError::Trailing(body.len() - at));
    }
    Ok(e)
}

/// The pieces of a body joined (a copy: only where one buffer is needed).
pub fn join(pieces: &[Bytes]) -> Bytes {
    match pieces {
        [] => Bytes::new(),
        [one] => one.clone(),
        many => {
            let mut v = Vec::with_capacity(many.iter().map(Bytes::len).sum());
            for p in many {
                v.extend_from_slice(p);
            }
            Bytes::from(v)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub fn log_id(term: u64, node: u64, index: u64) -> LogId {
        LogId { leader_id: LeaderId { term, node_id: node }, index }
    }

    pub fn any_entry() -> impl Strategy<Value = Entry> {
        let op = (0u64..5, 0u64..100, 0u64..100, 0u8..3, proptest::collection::vec(any::<u8>(), 0..40))
            .prop_map(|(session, seq, acked_below, k, bytes)| Op {
                session,
                seq,
                acked_below,
                kind: match k {
                    0 => OpKind::OpenSession,
                    1 => OpKind::CloseSession,
                    _ => OpKind::Update(Bytes::from(bytes)),
                },
            });
        let payload = prop_oneof![
            Just(EntryPayload::Blank),
            proptest::collection::vec(op, 0..6).prop_map(|ops| EntryPayload::Normal(Batch { ops })),
            proptest::collection::btree_set(1u64..6, 1..4).prop_map(|ids| {
                let nodes: BTreeMap<u64, Member> =
                    ids.iter().map(|i| (*i, Member { addr: format!("10.0.0.{i}:7400") })).collect();
                EntryPayload::Membership(Membership::new(vec![ids], nodes).expect("voters are nodes"))
            }),
        ];
        (1u64..9, 1u64..4, 1u64..1000, payload)
            .prop_map(|(t, n, i, payload)| Entry { log_id: log_id(t, n, i), payload })
    }

    proptest! {
        #[test]
        fn entries_round_trip(e in any_entry()) {
            let (head, body) = encode_entry(&e);
            let body = join(&body);
            prop_assert_eq!(decode_entry(&head, &body).ok(), Some(e));
        }

        /// Any truncation or stray byte of a head is an error, not a panic
        /// or a different entry.
        #[test]
        fn damaged_heads_are_refused(e in any_entry(), cut in 0usize..200, extra in any::<u8>()) {
            let (head, body) = encode_entry(&e);
            let body = join(&body);
            let cut = cut.min(head.len().saturating_sub(1));
            prop_assert!(decode_entry(&head[..cut], &body).is_err());
            let mut longer = head.to_vec();
            longer.push(extra);
            prop_assert!(decode_entry(&longer, &body).is_err());
        }
    }

    #[test]
    fn ops_are_slices_of_the_body() {
        let e = Entry {
            log_id: log_id(1, 1, 7),
            payload: EntryPayload::Normal(Batch {
                ops: vec![
                    Op {
                        session: 1,
                        seq: 1,
                        acked_below: 1,
                        kind: OpKind::Update(Bytes::from_static(b"abc")),
                    },
                    Op {
                        session: 1,
                        seq: 2,
                        acked_below: 1,
                        kind: OpKind::Update(Bytes::from_static(b"defg")),
                    },
                ],
            }),
        };
        let (head, body) = encode_entry(&e);
        let body = join(&body);
        let back = decode_entry(&head, &body).expect("decodes");
        let EntryPayload::Normal(b) = back.payload else { panic!("a batch") };
        let OpKind::Update(second) = &b.ops[1].kind else { panic!("an update") };
        assert_eq!(second.as_ptr(), body[3..].as_ptr(), "no copy: the op points into the body");
    }
}
