//! The blob store's wire protocol (design: `docs/design/0001-blob-wire-protocol.md`).
//!
//! A frame is a 32-byte header, a *meta* part (the encoded message, covered
//! by a CRC32C in the header) and an optional *data* part (tract bytes,
//! covered piece by piece by CRCs carried inside the meta part). Request ids
//! let many requests share a connection and complete out of order.
//!
//! Everything here is pure: decoding takes bytes that have already been
//! read under the limits in [`frame::FrameHeader::decode`], checks every
//! length against what is left, and returns an error, never panics.

pub mod authz;
pub mod cluster;
pub mod codec;
pub mod flow;
pub mod frame;
pub mod msg;
pub mod scope;

pub use cluster::*;
pub use codec::{DecodeError, Reader, Wire, Writer};
pub use flow::{decode_rts, encode_rts};
pub use frame::{FrameError, FrameHeader, FrameKind, FLOW_META_MAX, HEADER_LEN, MAGIC, VERSION};
pub use msg::*;
