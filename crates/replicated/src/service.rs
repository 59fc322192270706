//! What a service declares: its state, its operations, and which
//! operations commute (the paper's `HandleRPC` and `Commutes`, §4).
//!
//! The runtime decodes each committed operation, asks the service for its
//! [`Footprint`], and applies operations whose footprints do not conflict
//! concurrently, and conflicting ones in log order, on every replica
//! (`machine::schedule`). A service's state must therefore tolerate
//! concurrent [`Service::apply`] calls for operations it declared
//! commuting (its own locks keep memory safe; the scheduler keeps the
//! result the same as some serial order every replica agrees on).
//!
//! Failure atomicity: an operation is applied in memory only, whole, and
//! its effect reaches the disk only through the log it came from and the
//! snapshots taken between apply batches. So after any crash the state is
//! the snapshot plus a replay of the committed log after it: the state
//! after some prefix of the committed operations, never a torn one. An
//! `apply` must therefore be deterministic (the same op on the same state
//! gives the same state and reply on every replica) and must not fail
//! half-way: it checks its input before it changes anything.

use bytes::Bytes;
use smallvec::SmallVec;

use blizzard_proto::DecodeError;

/// How an operation touches a key: operations that only share keys they
/// both touch `Shared` commute (pushes onto one queue); `Exclusive`
/// conflicts with any other access to the key (a pop).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Access {
    Shared,
    Exclusive,
}

/// Which operations an operation commutes with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Footprint {
    /// Commutes with every operation whose keys it does not conflict on
    /// (a key both touch, one of them `Exclusive`). Keys are the
    /// service's own 64-bit names (a hash of structure and key: a
    /// collision only costs concurrency).
    Keys(SmallVec<[(u64, Access); 2]>),
    /// Ask [`Service::commutes`] about each operation it might overlap.
    Callback,
    /// Commutes with nothing: applied alone, after everything before it
    /// in the log and before everything after.
    Barrier,
}

impl Footprint {
    pub fn exclusive(key: u64) -> Footprint {
        Footprint::Keys(smallvec::smallvec![(key, Access::Exclusive)])
    }

    pub fn shared(key: u64) -> Footprint {
        Footprint::Keys(smallvec::smallvec![(key, Access::Shared)])
    }
}

/// Where an operation sits in the log: the same on every replica, so a
/// service may use it to order things deterministically (ties in a
/// priority queue) whatever order commuting operations apply in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    pub index: u64,
    pub op: u32,
}

/// A replicated service's state and operations.
pub trait Service: Send + Sync + 'static {
    /// A decoded update.
    type Op: Send + Sync + 'static;
    /// A consistent copy of the whole state, written out while applying
    /// goes on.
    type Snapshot: Send + 'static;

    /// Decodes an update from its bytes (a slice of the entry it came in:
    /// keep slices of it rather than copying). An error rejects the
    /// operation on every replica alike, changing nothing.
    fn decode(&self, bytes: &Bytes) -> Result<Self::Op, DecodeError>;

    /// Which operations `op` commutes with.
    fn footprint(&self, op: &Self::Op) -> Footprint;

    /// For `Footprint::Callback`: whether `a` and `b` commute (either
    /// order of applying them gives the same state and the same replies).
    fn commutes(&self, _a: &Self::Op, _b: &Self::Op) -> bool {
        false
    }

    /// Applies `op`, returning its reply. Called concurrently for
    /// operations that commute; never concurrently with one that does not.
    fn apply(&self, op: &Self::Op, at: Position) -> Bytes;

    /// Answers a read from the current state (the runtime calls it on the
    /// leader once every operation committed before the read arrived is
    /// applied: linearizable). An error is the service's answer to a
    /// malformed query.
    fn read(&self, query: &Bytes) -> Result<Bytes, String>;

    /// A consistent copy of the state. Called with no `apply` running.
    fn snapshot(&self) -> Self::Snapshot;

    /// Writes a snapshot out as a sequence of pieces (any size), in order.
    fn write_snapshot(&self, snap: &Self::Snapshot, out: &mut dyn FnMut(Bytes));

    /// Replaces the whole state with one [`Service::write_snapshot`]
    /// wrote (its pieces joined). Called with no `apply` running. An
    /// error leaves the state as it was.
    fn restore(&self, bytes: &Bytes) -> Result<(), DecodeError>;
}
