//! The crash-consistency checker for volumes (`blizzard crashcheck`).
//!
//! - `mem`: a deterministic in-memory blob whose fault model is written at
//!   its top: in-flight writes land or not, replica by replica.
//! - `tag`: sectors that say which write they came from.
//! - `checker`: the prefix-consistency and durability checks, apart from
//!   any workload.
//! - `run`: seeded trials (random crash points, or every outcome of one
//!   crash point) tying the three together.
//! - `lsvd`: crash trials of LSVD volumes (design 0008): an in-memory cache
//!   disk and a slow in-memory object store, each with its fault model.
//! - `real`: the same check across real processes: an event log written by
//!   a client that gets SIGKILLed, and the verification after recovery.

pub mod checker;
pub mod lsvd;
pub mod mem;
pub mod real;
pub mod run;
pub mod tag;

pub use checker::{check, check_snapshot, expected_snapshot, Contract, LoggedOp, OpKind, Violation};
pub use run::{exhaustive, trial, CheckConfig, Trial};
