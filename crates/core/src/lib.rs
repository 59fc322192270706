//! Shared vocabulary of blizzard, with no I/O: the ids and units every layer
//! speaks (blob, tract, tractserver, TLT row version), the tract locator
//! table with its placement arithmetic (FDS §2.2), CRC32C helpers for
//! end-to-end integrity, the named limits that bound every buffer, and the
//! plan that makes a tract's replicas agree after a crash (`reconcile`).

pub mod crc;
pub mod ids;
pub mod limits;
pub mod reconcile;
pub mod tlt;
pub mod units;

pub use ids::{BlobId, Incarnation, TractNo, TsId};
pub use tlt::{DiskClass, Pending, Placement, Tlt, TltMember, TltRow, TltSection};
