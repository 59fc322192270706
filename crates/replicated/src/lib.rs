//! The replicated runtime (after the Blizzard PMEM runtime, seed paper
//! 004): a service declares its state as data structures and its requests
//! as operations ([`service::Service`]); the runtime gives it replication
//! (a Raft-replicated operations log, on `openraft`), persistence (the log
//! and snapshots on the env seam's disks, CRC'd, group-committed),
//! failure atomicity (an operation's effect is whole or absent after any
//! crash), exactly-once execution (client sessions) and concurrency
//! (operations that commute apply in parallel, on every replica).
//!
//! Design: `docs/design/0006-replicated-runtime.md`.
//!
//! Layout, bottom up:
//!
//! - [`types`]: what a log entry holds (a batch of client operations) and
//!   openraft's type configuration; [`codec`]: their binary forms.
//! - [`rt`]: the async runtime openraft runs on (seeded, FIFO watches: the
//!   simulator replays it).
//! - [`log`]: the durable Raft log (segments, meta, group commit, recovery).
//! - [`service`]: the contract a service implements.
//! - [`ds`]: a service of failure-atomic data structures (ordered map,
//!   priority queues, graph) and its client wire forms.
//! - [`machine`]: the state machine openraft applies committed entries to:
//!   sessions (exactly-once), the commutativity scheduler, parallel apply,
//!   snapshots.
//! - [`proto`]: the wire protocol members and clients speak (one port);
//!   [`net`]: Raft's messages over it (openraft's network).

pub mod authz;
pub mod client;
pub mod codec;
pub mod ds;
pub mod log;
pub mod machine;
pub mod net;
pub mod node;
pub mod proto;
pub mod rt;
pub mod service;
pub mod types;
