//! What tests need of the world beyond this repository, started for real
//! by the test itself and stopped when it ends: an S3 server (`weed`:
//! SeaweedFS). Only integration tests depend on this crate (as a
//! dev-dependency), so it may use processes, sockets and time directly.
#![allow(clippy::disallowed_methods)] // real processes, sockets and time

pub mod weed;
