//! NBD server: exports blizzard volumes by name so QEMU, libnbd tools
//! (nbdinfo, nbdcopy, nbdfuse), fio and the kernel use them unmodified.
//!
//! - `proto`: the wire format, pure encoders and bounded decoders (fuzzed).
//! - `handshake`: fixed newstyle option haggling up to NBD_OPT_GO or
//!   NBD_OPT_EXPORT_NAME.
//! - `transmission`: one reader decoding requests, a task per request
//!   (bounded per connection and by a server-wide byte budget), one writer
//!   serialising replies, possibly out of order.
//! - `exports`: which volumes exist, and the registry that keeps exactly one
//!   open [`blizzard_volume::Volume`] per export for all connections.
//! - `server`: the accept loop, [`Server::start`] and [`Server::shutdown`].
//! - `metrics`: what `GET /metrics` shows of the open exports (pure).
//! - `tls`: STARTTLS, and what a client may ask before it (pure gate).
//! - `upgrade`: online upgrade, handing the listener and every live
//!   connection to a successor process ([`Server::upgrade_from`],
//!   [`Server::listen_for_upgrades`]); `upgrade::wire` its messages (pure).
//!
//! What is implemented (NBD `doc/proto.md`): fixed newstyle only (oldstyle
//! and non-fixed newstyle clients are refused), `NBD_FLAG_C_NO_ZEROES`,
//! options EXPORT_NAME, ABORT, LIST, INFO, GO (INFO_EXPORT, INFO_NAME,
//! INFO_DESCRIPTION, INFO_BLOCK_SIZE), STRUCTURED_REPLY,
//! LIST/SET_META_CONTEXT (`base:allocation`); commands READ, WRITE, FLUSH,
//! TRIM, CACHE (a no-op hint), WRITE_ZEROES (NO_HOLE, FAST_ZERO),
//! BLOCK_STATUS (REQ_ONE), DISC; flags FUA and DF; CAN_MULTI_CONN; TLS
//! (STARTTLS, offered or required, client certificates). Not implemented:
//! the experimental EXTENDED_HEADERS and RESIZE extensions.

pub mod exports;
#[doc(hidden)]
pub mod fuzzing;
mod handshake;
mod metrics;
pub mod proto;
mod server;
mod tls;
mod transmission;
pub mod upgrade;

use std::time::Duration;

pub use exports::{ClientExports, Exports, Listed, OpenMode};
pub use server::Server;
pub use tls::NbdTls;

/// Server settings. Every bound is named here; [`NbdConfig::default`] is
/// what the CLI uses unless told otherwise.
#[derive(Clone, Debug)]
pub struct NbdConfig {
    /// The export a client gets when it asks for the default export (the
    /// empty name); `None` makes the empty name unknown.
    pub default_export: Option<String>,
    /// How long a client may take to send each handshake message before it
    /// is disconnected (slow or silent peers, oldstyle clients waiting for
    /// a greeting this server never sends).
    pub handshake_timeout: Duration,
    /// How long a whole negotiation may take, from the connection's
    /// arrival to the export being served (TLS included). Negotiating
    /// connections wait for no place: when too many are pending, the
    /// oldest silent one is dropped (`blizzard_env::admission`).
    pub negotiation_timeout: Duration,
    /// Requests one connection may have in flight; the reader stops reading
    /// the socket until one completes.
    pub requests_in_flight_max: usize,
    /// Write payloads and read data buffered across all connections; at
    /// least [`proto::PAYLOAD_MAX`] so the largest request can run.
    pub buffered_bytes_max: usize,
    /// The share of that one connection may hold, so a client that stops
    /// reading its replies cannot starve the others; at least
    /// [`proto::PAYLOAD_MAX`].
    pub connection_buffered_bytes_max: usize,
    /// Connections in the transmission phase at once; more are accepted
    /// and closed. (Negotiating ones are bounded apart, and never hold
    /// one of these places.)
    pub connections_max: usize,
    /// How long [`Server::shutdown`] waits for connections to finish their
    /// in-flight requests before dropping them.
    pub shutdown_grace: Duration,
    /// Serve Prometheus metrics of the open exports at
    /// `http://ADDR/metrics` (`host:port`); `None` serves none.
    pub metrics_listen: Option<String>,
    /// TLS offered or required (STARTTLS); `None`: plain connections only,
    /// STARTTLS refused.
    pub tls: Option<NbdTls>,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            default_export: None,
            handshake_timeout: Duration::from_secs(10),
            negotiation_timeout: Duration::from_secs(30),
            requests_in_flight_max: 128,
            buffered_bytes_max: 512 << 20,
            connection_buffered_bytes_max: 64 << 20,
            connections_max: 256,
            shutdown_grace: Duration::from_secs(30),
            metrics_listen: None,
            tls: None,
        }
    }
}

/// Errors of the server as a whole (per-connection errors are logged and
/// end only that connection).
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("invalid NBD server configuration: {0}")]
    Config(String),
    /// `error`, not `source`: the message holds it, so an error chain
    /// (`{:#}`) prints it once.
    /// Boxed: a volume error is large, and the other variants small.
    #[error("flushing volume {name:?} at shutdown: {error}")]
    Flush { name: String, error: Box<blizzard_volume::VolumeError> },
    #[error(transparent)]
    Upgrade(#[from] upgrade::UpgradeError),
}
