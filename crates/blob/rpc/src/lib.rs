//! Connections that carry blizzard's protocols (the blob store's, the
//! replicated runtime's: [`Protocol`]). A [`Conn`] multiplexes many
//! requests over one stream (request ids, replies in any order); [`serve`]
//! runs a [`Service`] behind a listener, one task per request, with bounded
//! memory per connection. Streams come from the env seam, so the same code
//! runs over TCP, unix sockets and the simulator's links. Large requests
//! ask the receiver before they send (`flow`: FDS §4's request-to-send and
//! clear-to-send), so many senders into one server never queue more than a
//! bounded window at its link.

pub mod authz;
mod conn;
mod conns;
pub mod either;
mod flow;
mod frame_io;
mod local;
mod meta;
mod protocol;
mod server;
mod session;

pub use conn::{Conn, RpcConn, RpcError};
pub use conns::ConnCache;
pub use flow::{
    FlowLimits, Grants, GRANT_WINDOW_DEFAULT, LARGE_TRANSFER_MIN, RTS_PER_CONN_MAX, RTS_QUEUED_MAX,
};
pub use frame_io::{read_frame, write_frame, Frame, ReadFrameError};
pub use meta::{parse_meta_list, MetaService};
pub use protocol::{Blob, Protocol};
pub use server::{serve, serve_conn, ServerLimits, ServerTasks, Service, Shutdown, ShutdownHandle};
pub use session::{Caller, Sessions, SESSIONS_MAX};
