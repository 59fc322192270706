//! Exactly-once execution: client sessions (Raft dissertation §6.3).
//!
//! A client opens a session (an operation in the log, so every replica
//! agrees on its id), numbers its operations 1, 2, 3, … and sends a retry
//! with the same number. The table remembers, per session, the reply of
//! every operation the client has not yet said it received
//! (`acked_below`): an operation already applied is not applied again and
//! gets its first reply, across client retries, leader changes and
//! replica restarts (the table is part of every snapshot, and the log
//! replays into it).
//!
//! Decisions are made in log order by one caller ([`Sessions::admit`]),
//! so they are the same on every replica whatever order the operations
//! then apply in.
//!
//! Bounded: at most [`SESSIONS_MAX`] sessions (the one used longest ago
//! goes first; its client then gets `SessionExpired` rather than a second
//! application) and [`REPLIES_MAX`] remembered replies per session (a
//! client keeps fewer operations outstanding; beyond it the oldest reply
//! is forgotten and its retry gets `ReplyForgotten`).

use std::collections::BTreeMap;

use bytes::Bytes;

use crate::types::OpReply;

/// Sessions a group remembers.
pub const SESSIONS_MAX: usize = 1 << 16;
/// Replies remembered per session: a client's window of outstanding
/// operations must stay below it.
pub const REPLIES_MAX: usize = 4096;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Session {
    /// The client has every reply below this sequence number.
    pub acked_below: u64,
    /// Log index of the entry that used the session last (for eviction).
    pub last_used: u64,
    /// Replies the client may still ask for again, by sequence number.
    pub replies: BTreeMap<u64, OpReply>,
}

/// What to do with an update (`Sessions::admit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admit {
    /// New: apply it, then [`Sessions::record`] its reply.
    Apply,
    /// Seen before: answer with this, apply nothing.
    Answer(OpReply),
    /// A retry of an operation admitted earlier in the same run, whose
    /// reply is not known yet: answer with that one's reply once it is.
    SameAs { seq: u64 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sessions {
    map: BTreeMap<u64, Session>,
    /// (last_used, id) of every session: the first is evicted first.
    by_use: BTreeMap<(u64, u64), ()>,
    /// Admitted in the current run and not yet recorded: (session, seq).
    pending: BTreeMap<(u64, u64), ()>,
}

impl Sessions {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn get(&self, id: u64) -> Option<&Session> {
        self.map.get(&id)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &Session)> {
        self.map.iter()
    }

    /// Opens session `id` (from `types::session_id`) at log index `index`,
    /// forgetting the least recently used one if the table is full.
    pub fn open(&mut self, id: u64, index: u64) -> OpReply {
        if self.map.len() >= SESSIONS_MAX && !self.map.contains_key(&id) {
            if let Some((&(_, old), _)) = self.by_use.iter().next() {
                self.remove(old);
            }
        }
        self.touch(id, index);
        OpReply::SessionOpened(id)
    }

    pub fn close(&mut self, id: u64) -> OpReply {
        if self.remove(id) {
            OpReply::SessionClosed
        } else {
            OpReply::SessionExpired
        }
    }

    fn remove(&mut self, id: u64) -> bool {
        match self.map.remove(&id) {
            Some(s) => {
                self.by_use.remove(&(s.last_used, id));
                true
            }
            None => false,
        }
    }

    fn touch(&mut self, id: u64, index: u64) {
        let s = self.map.entry(id).or_default();
        self.by_use.remove(&(s.last_used, id));
        s.last_used = s.last_used.max(index);
        self.by_use.insert((s.last_used, id), ());
    }

    /// Decides what an update numbered `seq` of `session`, at log index
    /// `index`, comes to (in log order).
    pub fn admit(&mut self, session: u64, seq: u64, acked_below: u64, index: u64) -> Admit {
        let Some(s) = self.map.get_mut(&session) else {
            return Admit::Answer(OpReply::SessionExpired);
        };
        // The client's acknowledgment only ever moves forward.
        if acked_below > s.acked_below {
            s.acked_below = acked_below;
            while s.replies.first_key_value().is_some_and(|(k, _)| *k < acked_below) {
                s.replies.pop_first();
            }
        }
        let verdict = if let Some(r) = s.replies.get(&seq) {
            Admit::Answer(r.clone())
        } else if seq < s.acked_below {
            Admit::Answer(OpReply::ReplyForgotten)
        } else if self.pending.insert((session, seq), ()).is_some() {
            Admit::SameAs { seq }
        } else {
            Admit::Apply
        };
        self.touch(session, index);
        verdict
    }

    /// Records the reply of an update admitted with `Admit::Apply`.
    pub fn record(&mut self, session: u64, seq: u64, reply: OpReply) {
        self.pending.remove(&(session, seq));
        let Some(s) = self.map.get_mut(&session) else { return };
        if seq < s.acked_below {
            return;
        }
        s.replies.insert(seq, reply);
        while s.replies.len() > REPLIES_MAX {
            // Forgotten, and never applied again: its retry is told so.
            if let Some((old, _)) = s.replies.pop_first() {
                s.acked_below = s.acked_below.max(old + 1);
            }
        }
    }

    /// Whether every admitted update's reply was recorded (between runs).
    pub fn settled(&self) -> bool {
        self.pending.is_empty()
    }

    /// Rebuilds a table from sessions read back from a snapshot.
    pub fn from_sessions(sessions: impl IntoIterator<Item = (u64, Session)>) -> Sessions {
        let mut t = Sessions::default();
        for (id, s) in sessions {
            t.by_use.insert((s.last_used, id), ());
            t.map.insert(id, s);
        }
        t
    }
}

/// A reply's binary form inside a snapshot (and on the wire: `proto`).
pub fn put_reply(w: &mut blizzard_proto::Writer, r: &OpReply) {
    use blizzard_proto::Wire;
    match r {
        OpReply::Applied(b) => {
            0u8.put(w);
            (b.len() as u32).put(w);
            w.buf.extend_from_slice(b);
        }
        OpReply::SessionOpened(id) => {
            1u8.put(w);
            id.put(w);
        }
        OpReply::SessionClosed => 2u8.put(w),
        OpReply::SessionExpired => 3u8.put(w),
        OpReply::ReplyForgotten => 4u8.put(w),
        OpReply::Rejected(why) => {
            5u8.put(w);
            why.put(w);
        }
    }
}

/// Largest reply a service may give (bounded before allocating).
pub const REPLY_LEN_MAX: usize = 64 << 20;

pub fn get_reply(r: &mut blizzard_proto::Reader<'_>) -> Result<OpReply, blizzard_proto::DecodeError> {
    use blizzard_proto::{DecodeError, Wire};
    Ok(match u8::get(r)? {
        0 => {
            let n = u32::get(r)? as usize;
            if n > REPLY_LEN_MAX {
                return Err(DecodeError::BadValue { field: "reply length", value: n as u64 });
            }
            OpReply::Applied(Bytes::copy_from_slice(r.take(n)?))
        }
        1 => OpReply::SessionOpened(u64::get(r)?),
        2 => OpReply::SessionClosed,
        3 => OpReply::SessionExpired,
        4 => OpReply::ReplyForgotten,
        5 => OpReply::Rejected(String::get(r)?),
        t => return Err(DecodeError::BadValue { field: "reply kind", value: t as u64 }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(s: &str) -> OpReply {
        OpReply::Applied(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn a_retry_gets_the_first_reply_and_is_not_applied_again() {
        let mut t = Sessions::default();
        assert_eq!(t.open(7, 1), OpReply::SessionOpened(7));
        assert_eq!(t.admit(7, 1, 0, 2), Admit::Apply);
        // The same op again in the same run: it waits for the first.
        assert_eq!(t.admit(7, 1, 0, 2), Admit::SameAs { seq: 1 });
        t.record(7, 1, applied("one"));
        assert!(t.settled());
        assert_eq!(t.admit(7, 1, 0, 3), Admit::Answer(applied("one")));
        // The client received it: the reply may go; a late retry is told so.
        assert_eq!(t.admit(7, 2, 2, 4), Admit::Apply);
        t.record(7, 2, applied("two"));
        assert_eq!(t.admit(7, 1, 2, 5), Admit::Answer(OpReply::ReplyForgotten));
        assert_eq!(t.get(7).map(|s| s.replies.len()), Some(1));
    }

    #[test]
    fn unknown_and_closed_sessions_are_expired() {
        let mut t = Sessions::default();
        assert_eq!(t.admit(9, 1, 0, 1), Admit::Answer(OpReply::SessionExpired));
        t.open(9, 1);
        assert_eq!(t.close(9), OpReply::SessionClosed);
        assert_eq!(t.close(9), OpReply::SessionExpired);
        assert_eq!(t.admit(9, 1, 0, 2), Admit::Answer(OpReply::SessionExpired));
    }

    #[test]
    fn the_least_recently_used_session_goes_first() {
        let mut t = Sessions::default();
        for id in 0..SESSIONS_MAX as u64 {
            t.open(id, id + 1);
        }
        // Session 0 is used again: 1 is now the oldest.
        t.admit(0, 1, 0, SESSIONS_MAX as u64 + 1);
        t.open(u64::MAX, SESSIONS_MAX as u64 + 2);
        assert_eq!(t.len(), SESSIONS_MAX);
        assert!(t.get(0).is_some() && t.get(1).is_none() && t.get(u64::MAX).is_some());
    }

    #[test]
    fn replies_are_bounded_per_session() {
        let mut t = Sessions::default();
        t.open(1, 1);
        for seq in 1..=(REPLIES_MAX as u64 + 5) {
            assert_eq!(t.admit(1, seq, 0, 2), Admit::Apply);
            t.record(1, seq, applied("x"));
        }
        assert_eq!(t.get(1).map(|s| s.replies.len()), Some(REPLIES_MAX));
        // The oldest replies are gone, and their retries are not applied
        // again (a client keeps its window below the bound to avoid this).
        assert_eq!(t.admit(1, 1, 0, 3), Admit::Answer(OpReply::ReplyForgotten));
        assert_eq!(t.admit(1, REPLIES_MAX as u64 + 5, 0, 3), Admit::Answer(applied("x")));
    }
}
