//! The NBD server against clients written from the spec and third-party tools:
//! the crate's integration tests as one binary, each file a module, so the code
//! they share is compiled and linked once rather than once per file (see
//! ARCHITECTURE, "Where the tests are").

mod common;
mod decoders;
mod multi_conn;
mod read_only;
mod robustness;
mod tls;
mod tools;
mod transmission;
mod upgrade;
