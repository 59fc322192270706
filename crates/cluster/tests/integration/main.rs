//! The blob store and volumes on an embedded cluster (in process, real
//! sockets): the crate's integration tests as one binary, each file a module,
//! so the code they share is compiled and linked once rather than once per file
//! (see ARCHITECTURE, "Where the tests are").

mod blob_store;
mod common;
mod meta_replicas;
mod placement;
mod reconcile;
mod recovery;
mod resize;
mod snapshots;
mod volume_leases;
mod volumes;
