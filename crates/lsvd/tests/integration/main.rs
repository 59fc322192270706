//! LSVD volumes on an in-memory store and a real SeaweedFS: the crate's
//! integration tests as one binary, each file a module, so the code they share
//! is compiled and linked once rather than once per file (see ARCHITECTURE,
//! "Where the tests are").

mod common;
mod recovery;
mod seaweedfs;
mod snapshots;
mod volume;
