//! The tractserver (FDS §2.1): owns one disk, laid out as fixed tract slots
//! with an on-disk tract table, and serves reads and writes of tracts and of
//! byte ranges inside them. Writes are acknowledged only once durable, and
//! concurrent writes share one `fdatasync`. Every stored chunk carries the
//! writer's CRC32C. The primary of a TLT row also serializes and commits,
//! two-phase, the metadata of the blobs whose tract −1 maps to its row.
//!
//! Modules, bottom up: `layout` (the disk format), `commit` (group commit),
//! `store` (tracts in slots, recovery, digests), `fence` (the newest writer
//! epoch per blob), `rows` (which rows it serves at which version, and its
//! lease and fence: pure checks), `service` (the request handlers), `fill`
//! (copying rows this server joined to replace a dead member), `scrub` (re-reading chunks and repairing rot from other
//! replicas), `scope` (who may touch which volume, as the metadata service
//! last said: design 0010), `metrics` (the Prometheus view), `server` (start-up,
//! heartbeats, the entry point), `backup` (the hybrid tier's journal of
//! backup writes on fast storage, in front of a slow data disk).

pub mod backup;
pub(crate) mod blob_meta;
pub mod fence;
pub mod fill;
pub mod heal;
pub mod layout;
pub mod metrics;
pub(crate) mod parts;
pub mod peers;
pub mod rows;
pub mod scope;
pub mod scrub;
pub mod server;
pub mod service;
pub mod store;

pub use server::{start, JournalConfig, TractServerConfig, TractServerError, TractServerHandle};
pub use store::{Durability, PlantedBug, Store, StoreError};
