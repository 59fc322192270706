//! The crash checker against every commit mode and LSVD: the crate's
//! integration tests as one binary, each file a module, so the code they share
//! is compiled and linked once rather than once per file (see ARCHITECTURE,
//! "Where the tests are").

mod checks;
mod intent;
mod log_volume;
mod lsvd;
mod rollback;
