//! Metadata server: tracks live tractservers, builds the tract locator
//! table (FDS §2.2, §3.3), hands it to clients, and changes rows with the
//! assignment protocol (FDS §3.1). It keeps no durable state of its own:
//! tractservers store their TLT positions and a restarted metadata server
//! rebuilds the table from their heartbeats.
//!
//! Modules: `tlt_builder` (pure: the table's rows from members and a random
//! source), `growth` (pure: which entries a new tractserver takes, FDS
//! §3.4), `lease` (pure: one writer per volume, fencing tokens), `machine`
//! (the replicated state, a service of `blizzard-replicated`: design 0007),
//! `plan` (pure: what a recovery round changes, from a snapshot of
//! the server's view; its header is the table of cases), `server`
//! (membership, phases, assignment rounds, the async shell that runs the
//! plan, the entry point).

pub mod growth;
pub mod lease;
pub mod machine;
mod plan;
pub mod server;
pub mod tlt_builder;
