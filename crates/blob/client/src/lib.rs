//! The blob store client library (FDS §2.1–§2.3, §3.1). Applications and
//! the volume layer link it; tractservers and their protocol stay hidden
//! behind a narrow asynchronous API:
//!
//! - [`Client::connect`] fetches the TLT once and caches it;
//! - [`Client::create_blob`], [`Client::open_blob`], [`Client::delete_blob`];
//! - [`Blob::size_tracts`], [`Blob::extend_by`], [`Blob::extend_to`];
//! - [`Blob::write`] / [`Blob::read`] of a whole tract or a range of one;
//! - [`Client::acquire_volume`], [`Client::renew_volume`],
//!   [`Client::release_volume`]: one writer per volume (design 0007);
//! - [`Blob::set_writer`]: the writer epoch every request carries, which
//!   fences out older writers of the blob;
//! - [`Blob::reconcile`]: make a tract's replicas agree after a writer
//!   crashed mid-write.
//!
//! A tract is found by arithmetic: row = (hash(blob) + tract) mod TLT
//! length. Writes go to the first *r* members of the row (r = the blob's
//! replication) and complete when all acknowledge; reads go to one member
//! chosen at random and fall back to the others on error or CRC mismatch.
//! Every request carries the row's version; a tractserver that disagrees
//! makes the client fetch the table again and retry.

mod batch;
mod blob;
mod client;
mod lease;
mod pool;

/// Error codes a tractserver can answer with (inside [`ClientError::Rejected`]).
pub use blizzard_proto::ErrorCode;
pub use blizzard_proto::{LeaseStatus, VolumeLease};
pub use blob::{Blob, CacheReceipt, RECONCILE_ROUNDS};
pub use client::{Client, ClientConfig, ClientError};
