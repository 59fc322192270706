//! Out-of-order log commit with fast acknowledgment (Blizzard §2.5.3).
//!
//! The volume's physical blocks form a log. Every write is acknowledged at
//! once and issued at once, whatever its flush epoch, to the next free
//! physical block in the order of a deterministic permutation, as an
//! *expanded block* carrying the virtual block id, epoch, a log sequence
//! number (LSN) and a CRC. The block map and the allocation bitmap advance
//! only in LSN order, as writes become durable, so a checkpoint of them is
//! always a prefix of the log. Recovery loads the newest valid checkpoint
//! and rolls forward in permutation order, accepting each next block only
//! if it is intact on every replica and carries the next LSN and the
//! checkpoint's sequence number; it stops at the first block that does not.
//!
//! What makes roll-forward unambiguous (the paper leaves this open):
//! - **LSN**: when the permutation wraps, a physical block may hold a stale
//!   expanded block from an earlier cycle, intact and plausible; it carries
//!   an older LSN than the one expected.
//! - **Checkpoint seq**: writes a crashed writer issued beyond the point its
//!   recovery stopped at stay on disk with LSNs the next writer reuses; they
//!   carry the old checkpoint's seq, and recovery writes a new checkpoint
//!   before accepting writes, so the new ones carry the new seq.
//! - **Freed blocks are reused only after a checkpoint**: a block superseded
//!   since the last checkpoint is still referenced by it; reusing it could
//!   destroy data that recovery from that checkpoint needs. Superseded
//!   blocks stay allocated until the next checkpoint is durable.
//! - **Checkpoints are taken at quiet points**: new writes wait while the
//!   log drains, so the checkpoint's allocation state is exactly what the
//!   writer allocates from afterwards, and recovery makes the same
//!   skip-or-visit decision at every position as the writer did.
//! - **Damage ends the log**: a block that cannot be read intact (torn by
//!   the crash, or reported `Corrupt` by the store) is treated like any
//!   block that is not the next record. Nothing a flush covered can be
//!   torn, since a record is applied only once it and all before it are
//!   durable on every replica.
//!
//! Growing a log volume appends physical blocks and switches to a new
//! permutation through a checkpoint written in the new geometry, then the
//! superblock (`LogEngine::grow`; design 0003, "Resizing a log volume").

pub mod engine;
pub mod perm;
pub mod record;

pub use engine::{LogEngine, LogGeom};
