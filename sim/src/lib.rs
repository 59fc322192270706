//! Deterministic simulation of blizzard: the same [`blizzard_env::Env`]
//! traits the servers use in production, implemented so that **a seed
//! replays a run exactly** (TigerBeetle's VOPR, FoundationDB's simulation).
//!
//! Hosts and links are simulated by turmoil: every host (a tractserver, the
//! metadata server, a client) runs on its own paused current-thread tokio
//! runtime inside one OS thread, messages cross simulated links with seeded
//! latency, and the harness can partition, crash and restart hosts. Disks
//! are simulated in memory with a written-down fault model (lost, kept or
//! torn unsynced writes on crash, bit rot, injected latency and EIO), and
//! their state outlives the host software so a restarted tractserver finds
//! what a real one would find on its disk.
//!
//! Modules:
//! - [`env`](mod@env): [`SimClock`], [`SimRng`], [`sim_env`] and
//!   [`sim_env_incarnation`] (one host's `Env`), [`derive_seed`], and
//!   [`Trace`], the event log two runs of a seed are compared by.
//! - [`disk`]: [`SimDisks`] and [`SimDisk`], the in-memory disk and its fault
//!   model ([`FaultConfig`], [`CrashReport`]).
//! - [`net`]: [`SimNet`], turmoil TCP behind the `Net` trait, addressed by
//!   host name (`"ts1:7000"`).
//! - [`link`]: [`Links`], bandwidth-limited links (a FIFO timeline per
//!   host and direction) and their performance model.
//! - [`ghost`]: late duplicates of dropped connections' requests (blob
//!   protocol) or of any request frame (the runtime's), and late requests
//!   of crashed clients ([`Ghosts`]).
//! - [`volume_client`]: hosts running a replicated volume that the harness
//!   crashes mid-write; replica agreement and the crash checker's contract
//!   after every recovery.
//! - [`cluster`]: the whole cluster under chaos ([`run_blob_sim`]).
//! - [`flow`]: the flow-control experiment: many senders of tracts into
//!   one tractserver over limited links, with and without receiver-driven
//!   flow control ([`flow::run_flow_sim`]).
//! - [`linearizable`]: a linearizability checker for key-value histories ([`linearizable::check`]).
//! - [`runtime`]: the replicated runtime's members under chaos, with
//!   linearizability, exactly-once and replica-agreement checks
//!   ([`run_runtime_sim`]).
//! - [`seeds`]: many seeds in child processes, a pool of `--jobs` at a time.
//!
//! Determinism rules for code under simulation: reach time, randomness,
//! sockets and disks only through `Env`; never use `spawn_blocking` (a
//! simulated host has no blocking pool); prefer `tokio::select! { biased; .. }`
//! because unbiased `select!` draws from tokio's own unseeded generator; and
//! never let `HashMap` iteration order decide an outcome.

pub mod cluster;
pub mod disk;
pub mod env;
pub mod flow;
pub mod ghost;
pub mod linearizable;
pub mod link;
pub mod net;
pub mod runtime;
pub mod seeds;
pub mod volume_client;

use std::io;
use std::path::PathBuf;

pub use cluster::{run_blob_sim, BlobSimConfig, BlobSimReport};
pub use disk::{CrashReport, FaultConfig, SimDisk, SimDisks, SECTOR_SIZE};
pub use env::{
    derive_seed, sim_env, sim_env_incarnation, sim_env_with_ghosts, SimClock, SimRng, Trace, SIM_EPOCH,
};
pub use ghost::Ghosts;
pub use link::{LinkConfig, Links};
pub use net::SimNet;
pub use runtime::{run_runtime_sim, RuntimePlant, RuntimeSimConfig, RuntimeSimReport};

/// What the simulated world refuses, precisely. The `Env` traits speak
/// `io::Error`, so each variant converts to one with the matching
/// [`io::ErrorKind`]; callers that hold a [`SimDisk`] directly (the harness,
/// fault-injection tests) get the precise variant.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A disk access reached past the end of the disk.
    #[error("disk access [{offset}, +{len}) is past the disk's end ({disk_len})")]
    OutOfRange { offset: u64, len: u64, disk_len: u64 },
    /// A bit index outside `0..8`.
    #[error("bit index {0} is not in 0..8")]
    BadBit(u8),
    /// `open` without a size for a disk that was never created.
    #[error("disk {0} does not exist; give a size to create it")]
    NoSuchDisk(PathBuf),
    /// An injected I/O error (`SimDisk::fail_writes`, `SimDisk::fail_syncs`).
    #[error("simulated EIO on {op}")]
    InjectedEio { op: &'static str },
    /// A write to a disk that ran out of space (`SimDisk::set_full`).
    #[error("simulated ENOSPC: the disk is full")]
    NoSpace,
    /// An address the simulated network cannot serve (`unix:` paths, or a
    /// bind on another host's name).
    #[error("address {0:?} is not simulated: {1}")]
    Unsupported(String, &'static str),
    /// An address that does not parse as `host:port`.
    #[error("address {0:?} is not host:port")]
    BadAddr(String),
    /// Network calls made outside a turmoil host.
    #[error("simulated network used outside a turmoil simulation")]
    NotInSimulation,
}

impl From<SimError> for io::Error {
    fn from(e: SimError) -> io::Error {
        let kind = match &e {
            SimError::OutOfRange { .. } | SimError::BadBit(_) | SimError::BadAddr(_) => {
                io::ErrorKind::InvalidInput
            }
            SimError::NoSuchDisk(_) => io::ErrorKind::NotFound,
            // Kind `Other`, like the EIO a real disk reports.
            SimError::InjectedEio { .. } | SimError::NotInSimulation => io::ErrorKind::Other,
            SimError::NoSpace => io::ErrorKind::StorageFull,
            SimError::Unsupported(..) => io::ErrorKind::Unsupported,
        };
        io::Error::new(kind, e)
    }
}
