//! The simulators (blob-sim, runtime-sim, the flow simulation) and the
//! simulated env: the crate's integration tests as one binary, each file a
//! module, so the code they share is compiled and linked once rather than once
//! per file (see ARCHITECTURE, "Where the tests are").

mod blob_cluster;
mod determinism;
mod flow;
mod net;
mod restart;
mod runtime;
