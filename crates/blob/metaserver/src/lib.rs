//! Metadata server: tracks live tractservers, builds the tract locator
//! table (FDS §2.2, §3.3), hands it to clients, and changes rows with the
//! assignment protocol (FDS §3.1). Its decisions are a replicated state
//! (design 0007) kept by a group of replicas on the replicated runtime,
//! or in memory by a single server that rebuilds the table from the
//! tractservers' reports after a restart.
//!
//! Modules: `tlt_builder` (pure: the table's rows from members and a random
//! source), `growth` (pure: which entries a new tractserver takes, FDS
//! §3.4), `lease` (pure: one writer per volume, fencing tokens), `plan`
//! (pure: what a recovery round changes, from a snapshot of the server's
//! view; its header is the table of cases), `machine` (the replicated
//! state, a service of `blizzard-replicated`), `replica` (where that state
//! lives: a runtime member or memory), `rounds` (the leader's rounds:
//! take over, build, rebuild, recovery: `Reserve`, push, `Serve`),
//! `volumes` (pure: volume lease and scope requests to updates and back),
//! `scope` (pure: access lists, the certificates serving volumes and
//! revocations, as updates change them; design 0010), `scope_store` (a
//! single server's copy of them on disk), `server` (heartbeats, who
//! answers what, status, the entry point).

mod access;
pub mod growth;
pub mod lease;
pub mod machine;
mod plan;
pub mod replica;
mod rounds;
pub mod scope;
pub mod scope_store;
pub mod server;
pub mod tlt_builder;
mod volumes;
