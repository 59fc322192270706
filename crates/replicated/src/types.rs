//! What the log holds and what openraft is instantiated with.
//!
//! One Raft entry carries a [`Batch`] of client operations (the paper's
//! batching, §5: the consensus cost of an entry is paid once for many
//! operations). Each operation names its client's session and sequence
//! number (exactly-once, `machine::session`), and a service operation's
//! bytes travel as a `Bytes` slice of the frame they arrived in, from the
//! socket to the log and to the apply step.

use std::fmt;

use bytes::Bytes;

/// A member of a replica group: its Raft node id is its `--id`.
pub type NodeId = u64;

/// Where a member listens, for its peers and its clients alike.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    pub addr: String,
}

impl fmt::Display for Member {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.addr)
    }
}

openraft::declare_raft_types!(
    /// openraft's types for the replicated runtime.
    pub Raft:
        D = Batch,
        R = BatchReply,
        NodeId = NodeId,
        Node = Member,
        AsyncRuntime = crate::rt::Runtime,
);

pub type LogId = openraft::type_config::alias::LogIdOf<Raft>;
pub type Vote = openraft::type_config::alias::VoteOf<Raft>;
pub type Entry = openraft::type_config::alias::EntryOf<Raft>;
pub type LeaderId = openraft::type_config::alias::LeaderIdOf<Raft>;
pub type Membership = openraft::Membership<NodeId, Member>;
pub type StoredMembership = openraft::type_config::alias::StoredMembershipOf<Raft>;
pub type SnapshotMeta = openraft::type_config::alias::SnapshotMetaOf<Raft>;

/// Client operations carried by one log entry, applied in this order
/// except where they commute (`machine::schedule`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub ops: Vec<Op>,
}

impl fmt::Display for Batch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "batch of {} ops", self.ops.len())
    }
}

/// One client operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    /// The session it belongs to (0 for `OpenSession`).
    pub session: u64,
    /// Its number in the session, from 1; a retry carries the same one.
    pub seq: u64,
    /// The client has every reply below this number: the session may
    /// forget them.
    pub acked_below: u64,
    pub kind: OpKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Opens a session: its id is [`session_id`] of where this op sits.
    OpenSession,
    /// Ends a session (its cached replies are dropped).
    CloseSession,
    /// An operation of the service, encoded as the service reads it.
    Update(Bytes),
}

/// Operations one entry may carry: a session id packs the entry's index
/// and the op's position, so this bounds the position.
pub const BATCH_OPS_MAX: usize = 1 << 16;

/// The id of a session opened by the op at `position` of the entry at
/// `index`: unique, and the same on every replica.
pub fn session_id(index: u64, position: usize) -> u64 {
    (index << 16) | position as u64
}

/// The replies to one entry's operations, in the batch's order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchReply {
    pub replies: Vec<OpReply>,
}

/// What one operation came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpReply {
    /// Applied (now, or the first time a retry of it was): the service's
    /// reply.
    Applied(Bytes),
    /// The session opened: its id.
    SessionOpened(u64),
    /// The session ended.
    SessionClosed,
    /// The session is unknown: never opened, closed, or forgotten to make
    /// room. Whether earlier operations of it applied cannot be known.
    SessionExpired,
    /// A retry of an operation whose reply the client said it had
    /// (`acked_below`): it was applied once; the reply is gone.
    ReplyForgotten,
    /// The service could not decode the operation: nothing changed.
    Rejected(String),
}
