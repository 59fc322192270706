//! The hand-over messages between an old NBD server and its successor:
//! pure encoders and bounded decoders (no I/O).
//!
//! The bytes come from another process, possibly another build of the
//! binary, so they are decoded as untrusted input: magic, version and
//! CRC32C are checked first, every length is bounded before anything is
//! allocated, trailing bytes are refused, and nothing panics on any input
//! (a property test feeds it garbage and every truncation).
//!
//! A message (little-endian):
//!
//! ```text
//! magic u32 "BLZH" | version u16 | kind u16 | body length u32 | body | crc32c u32 (of all before it)
//! ```
//!
//! | kind | body | descriptors |
//! |---|---|---|
//! | 1 Hello (new → old) | pid u32 | 0 |
//! | 2 Refused (old → new) | reason: text | 0 |
//! | 3 Listener (old → new) | connections u32, address: text | 1, the listening socket |
//! | 4 Connection (old → new) | export: name, peer: text, size u64, flags u16, structured u8, base_allocation: u8 present + u32, leftover: u32 length + bytes | 1, the connection's socket |
//! | 5 Ready (new → old) | empty | 0 |
//! | 6 Failed (new → old) | reason: text | 0 |
//! | 7 Commit (old → new) | empty | 0 |
//!
//! `text` and `name` are a u16 length and UTF-8 bytes (at most
//! [`TEXT_MAX`] and [`NAME_MAX`]). Compatibility: a binary refuses a
//! version it does not speak with a clear error, and the old process keeps
//! serving; a later version adds kinds or fields under a new number.

use crate::proto::{nbd_string, STRING_LEN_MAX};
use crate::transmission::READ_BUF_LEN;
use blizzard_core::crc::crc32c;

/// Reads "BLZH" on the wire.
pub(crate) const MAGIC: u32 = u32::from_le_bytes(*b"BLZH");
pub(crate) const VERSION: u16 = 1;
const HEADER_LEN: usize = 12;
const CRC_LEN: usize = 4;
/// An export name: NBD's own limit.
pub(crate) const NAME_MAX: usize = STRING_LEN_MAX;
/// Reasons, addresses and peers (longer ones are cut at encoding).
pub(crate) const TEXT_MAX: usize = 1024;
/// Bytes of a connection the old process had read but not used: at most
/// its read buffer (the reader stops at a request boundary, so these are
/// the first bytes of requests it never started).
pub(crate) const LEFTOVER_MAX: usize = READ_BUF_LEN;
/// Connections one hand-over may carry (more than any server serves:
/// `NbdConfig::connections_max` is checked against it).
pub(crate) const CONNECTIONS_MAX: u32 = 1 << 16;
/// The largest body: a Connection with every field at its maximum.
const BODY_MAX: usize = (2 + NAME_MAX) + (2 + TEXT_MAX) + 8 + 2 + 1 + (1 + 4) + (4 + LEFTOVER_MAX);
/// The largest message; a receiver's buffer.
pub(crate) const MESSAGE_MAX: usize = HEADER_LEN + BODY_MAX + CRC_LEN;

const _: () = assert!(BODY_MAX <= u32::MAX as usize);
const _: () = assert!(TEXT_MAX <= u16::MAX as usize);
const _: () = assert!(NAME_MAX <= u16::MAX as usize);
const _: () = assert!(LEFTOVER_MAX <= u32::MAX as usize);

/// One live connection, as its successor needs it to resume the
/// transmission phase.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConnState {
    /// The export it negotiated (resolved: never the empty default name).
    pub(crate) export: String,
    /// For logs only.
    pub(crate) peer: String,
    /// The size the client was told.
    pub(crate) size: u64,
    /// The transmission flags the client was told: the successor checks
    /// it would advertise the same (a read-only successor must not adopt
    /// a client that believes it can write).
    pub(crate) flags: u16,
    pub(crate) structured: bool,
    pub(crate) base_allocation: Option<u32>,
    /// Bytes read from the socket but not yet used, to be read first.
    pub(crate) leftover: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Message {
    Hello { pid: u32 },
    Refused { reason: String },
    Listener { connections: u32, addr: String },
    Connection(ConnState),
    Ready,
    Failed { reason: String },
    Commit,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("a hand-over message of {0} bytes is shorter than its header and CRC")]
    Short(usize),
    #[error("not a blizzard hand-over message (magic {0:#010x})")]
    Magic(u32),
    #[error(
        "hand-over message version {0}; this binary speaks version {VERSION} (both binaries must speak one version)"
    )]
    Version(u16),
    #[error("a hand-over message declares {declared} body bytes but carries {actual}")]
    Length { declared: usize, actual: usize },
    #[error("a hand-over message body of {0} bytes exceeds the maximum {BODY_MAX}")]
    TooLong(usize),
    #[error("hand-over message CRC mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Crc { stored: u32, computed: u32 },
    #[error("unknown hand-over message kind {0}")]
    Kind(u16),
    #[error("malformed hand-over {kind} message: {what}")]
    Body { kind: &'static str, what: String },
    #[error("cannot encode a hand-over {kind} message: {what}")]
    Encode { kind: &'static str, what: String },
}

impl Message {
    fn kind(&self) -> u16 {
        match self {
            Message::Hello { .. } => 1,
            Message::Refused { .. } => 2,
            Message::Listener { .. } => 3,
            Message::Connection(_) => 4,
            Message::Ready => 5,
            Message::Failed { .. } => 6,
            Message::Commit => 7,
        }
    }

    pub(crate) fn name(&self) -> &'static str {
        kind_name(self.kind())
    }

    /// Descriptors that travel with it.
    pub(crate) fn fds(&self) -> usize {
        match self {
            Message::Listener { .. } | Message::Connection(_) => 1,
            _ => 0,
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut body = Vec::new();
        match self {
            Message::Hello { pid } => body.extend_from_slice(&pid.to_le_bytes()),
            Message::Refused { reason } | Message::Failed { reason } => put_text(&mut body, reason),
            Message::Listener { connections, addr } => {
                if *connections > CONNECTIONS_MAX {
                    return Err(WireError::Encode {
                        kind: self.name(),
                        what: format!("{connections} connections; at most {CONNECTIONS_MAX}"),
                    });
                }
                body.extend_from_slice(&connections.to_le_bytes());
                put_text(&mut body, addr);
            }
            Message::Connection(c) => {
                let bad = |what: String| WireError::Encode { kind: "Connection", what };
                if c.export.is_empty() || c.export.len() > NAME_MAX {
                    return Err(bad(format!("an export name of {} bytes", c.export.len())));
                }
                if c.leftover.len() > LEFTOVER_MAX {
                    return Err(bad(format!("{} leftover bytes; at most {LEFTOVER_MAX}", c.leftover.len())));
                }
                body.extend_from_slice(&(c.export.len() as u16).to_le_bytes());
                body.extend_from_slice(c.export.as_bytes());
                put_text(&mut body, &c.peer);
                body.extend_from_slice(&c.size.to_le_bytes());
                body.extend_from_slice(&c.flags.to_le_bytes());
                body.push(c.structured as u8);
                body.push(c.base_allocation.is_some() as u8);
                body.extend_from_slice(&c.base_allocation.unwrap_or(0).to_le_bytes());
                body.extend_from_slice(&(c.leftover.len() as u32).to_le_bytes());
                body.extend_from_slice(&c.leftover);
            }
            Message::Ready | Message::Commit => {}
        }
        debug_assert!(body.len() <= BODY_MAX);
        let mut out = Vec::with_capacity(HEADER_LEN + body.len() + CRC_LEN);
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&self.kind().to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Message, WireError> {
        if b.len() < HEADER_LEN + CRC_LEN {
            return Err(WireError::Short(b.len()));
        }
        let mut h = Reader { b: &b[..HEADER_LEN], kind: "header" };
        let (magic, version, kind, len) = (h.u32()?, h.u16()?, h.u16()?, h.u32()? as usize);
        if magic != MAGIC {
            return Err(WireError::Magic(magic));
        }
        if version != VERSION {
            return Err(WireError::Version(version));
        }
        if len > BODY_MAX {
            return Err(WireError::TooLong(len));
        }
        let actual = b.len() - HEADER_LEN - CRC_LEN;
        if len != actual {
            return Err(WireError::Length { declared: len, actual });
        }
        let (covered, tail) = b.split_at(b.len() - CRC_LEN);
        let stored = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
        let computed = crc32c(covered);
        if stored != computed {
            return Err(WireError::Crc { stored, computed });
        }
        let mut r = Reader { b: &covered[HEADER_LEN..], kind: kind_name(kind) };
        let m = match kind {
            1 => Message::Hello { pid: r.u32()? },
            2 => Message::Refused { reason: r.text()? },
            3 => {
                let connections = r.u32()?;
                if connections > CONNECTIONS_MAX {
                    return Err(r.bad(format!("{connections} connections; at most {CONNECTIONS_MAX}")));
                }
                Message::Listener { connections, addr: r.text()? }
            }
            4 => {
                let n = r.u16()? as usize;
                let export = nbd_string(r.take(n)?).map_err(|e| r.bad(format!("export name: {}", e.0)))?;
                if export.is_empty() {
                    return Err(r.bad("an empty export name".into()));
                }
                let peer = r.text()?;
                let size = r.u64()?;
                let flags = r.u16()?;
                let structured = r.bool()?;
                let present = r.bool()?;
                let id = r.u32()?;
                let n = r.u32()? as usize;
                if n > LEFTOVER_MAX {
                    return Err(r.bad(format!("{n} leftover bytes; at most {LEFTOVER_MAX}")));
                }
                let leftover = r.take(n)?.to_vec();
                Message::Connection(ConnState {
                    export,
                    peer,
                    size,
                    flags,
                    structured,
                    base_allocation: present.then_some(id),
                    leftover,
                })
            }
            5 => Message::Ready,
            6 => Message::Failed { reason: r.text()? },
            7 => Message::Commit,
            k => return Err(WireError::Kind(k)),
        };
        if !r.b.is_empty() {
            return Err(r.bad(format!("{} trailing bytes", r.b.len())));
        }
        Ok(m)
    }
}

fn kind_name(kind: u16) -> &'static str {
    match kind {
        1 => "Hello",
        2 => "Refused",
        3 => "Listener",
        4 => "Connection",
        5 => "Ready",
        6 => "Failed",
        7 => "Commit",
        _ => "unknown",
    }
}

/// Free text, cut to [`TEXT_MAX`] bytes at a character boundary.
fn put_text(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(TEXT_MAX);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..end]);
}

struct Reader<'a> {
    b: &'a [u8],
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn bad(&self, what: String) -> WireError {
        WireError::Body { kind: self.kind, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.b.len() {
            return Err(self.bad(format!("{n} bytes wanted, {} left", self.b.len())));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn bool(&mut self) -> Result<bool, WireError> {
        match self.array::<1>()?[0] {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(self.bad(format!("a flag byte of {v}"))),
        }
    }

    fn text(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        if n > TEXT_MAX {
            return Err(self.bad(format!("text of {n} bytes; at most {TEXT_MAX}")));
        }
        let b = self.take(n)?;
        std::str::from_utf8(b).map(str::to_string).map_err(|_| self.bad("text is not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn conn() -> ConnState {
        ConnState {
            export: "disk".into(),
            peer: "127.0.0.1:40000".into(),
            size: 4 << 30,
            flags: 0x1ff,
            structured: true,
            base_allocation: Some(1),
            leftover: vec![0x25, 0x60, 0x95, 0x13],
        }
    }

    fn all() -> Vec<Message> {
        vec![
            Message::Hello { pid: 4242 },
            Message::Refused { reason: "flush failed: tractserver down".into() },
            Message::Listener { connections: 3, addr: "unix:/run/nbd.sock".into() },
            Message::Connection(conn()),
            Message::Connection(ConnState { base_allocation: None, leftover: vec![], ..conn() }),
            Message::Connection(ConnState { leftover: vec![7; LEFTOVER_MAX], ..conn() }),
            Message::Ready,
            Message::Failed { reason: "volume \"disk\" is held by host:1/2".into() },
            Message::Commit,
        ]
    }

    /// Every message decodes to itself.
    #[test]
    fn round_trip() {
        for m in all() {
            let b = m.encode().unwrap();
            assert!(b.len() <= MESSAGE_MAX);
            assert_eq!(Message::decode(&b).unwrap(), m);
        }
    }

    /// The bytes of a Connection are pinned: a change here is a new version.
    #[test]
    fn golden_connection() {
        let b = Message::Connection(conn()).encode().unwrap();
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        assert_eq!(hex, GOLDEN_CONNECTION);
    }

    /// "BLZH", version 1, kind 4, 47 body bytes: "disk", the peer, 4 GiB,
    /// flags 0x1ff, structured, base:allocation id 1, 4 leftover bytes;
    /// then the CRC32C.
    const GOLDEN_CONNECTION: &str = concat!(
        "424c5a48",
        "0100",
        "0400",
        "2f000000",
        "0400",
        "6469736b",
        "0f00",
        "3132372e302e302e313a3430303030",
        "0000000001000000",
        "ff01",
        "01",
        "01",
        "01000000",
        "04000000",
        "25609513",
        "4970359b",
    );

    /// Every truncation, and any extension, is refused.
    #[test]
    fn truncated_or_extended_refused() {
        for m in all() {
            let b = m.encode().unwrap();
            for n in 0..b.len() {
                assert!(Message::decode(&b[..n]).is_err(), "{} cut to {n}", m.name());
            }
            let mut longer = b.clone();
            longer.push(0);
            assert!(Message::decode(&longer).is_err());
        }
    }

    /// Wrong magic, version, kind, CRC or declared length: each its error.
    #[test]
    fn header_checks() {
        let good = Message::Ready.encode().unwrap();
        let fix_crc = |mut b: Vec<u8>| {
            let n = b.len() - 4;
            let c = crc32c(&b[..n]);
            b[n..].copy_from_slice(&c.to_le_bytes());
            b
        };
        let mut b = good.clone();
        b[0] ^= 1;
        assert!(matches!(Message::decode(&fix_crc(b)), Err(WireError::Magic(_))));
        let mut b = good.clone();
        b[4] = 2;
        assert_eq!(Message::decode(&fix_crc(b)), Err(WireError::Version(2)));
        let mut b = good.clone();
        b[6] = 99;
        assert_eq!(Message::decode(&fix_crc(b)), Err(WireError::Kind(99)));
        let mut b = good.clone();
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(Message::decode(&fix_crc(b)), Err(WireError::TooLong(_))));
        let mut b = good.clone();
        let n = b.len();
        b[n - 1] ^= 0x80;
        assert!(matches!(Message::decode(&b), Err(WireError::Crc { .. })));
    }

    /// Oversized fields are refused on both sides; long free text is cut.
    #[test]
    fn oversized_refused() {
        let big = ConnState { leftover: vec![0; LEFTOVER_MAX + 1], ..conn() };
        assert!(Message::Connection(big).encode().is_err());
        let long = ConnState { export: "v".repeat(NAME_MAX + 1), ..conn() };
        assert!(Message::Connection(long).encode().is_err());
        assert!(Message::Listener { connections: CONNECTIONS_MAX + 1, addr: String::new() }
            .encode()
            .is_err());
        let reason = "é".repeat(TEXT_MAX);
        let b = Message::Refused { reason }.encode().unwrap();
        match Message::decode(&b).unwrap() {
            Message::Refused { reason } => {
                assert!(reason.len() <= TEXT_MAX && reason.chars().all(|c| c == 'é'))
            }
            m => panic!("{m:?}"),
        }
        // A body declaring more leftover than allowed, with a valid CRC.
        let mut b = Message::Connection(ConnState { leftover: vec![], ..conn() }).encode().unwrap();
        let at = b.len() - 4 - 4;
        b[at..at + 4].copy_from_slice(&((LEFTOVER_MAX + 1) as u32).to_le_bytes());
        let n = b.len() - 4;
        let c = crc32c(&b[..n]);
        b[n..].copy_from_slice(&c.to_le_bytes());
        assert!(matches!(Message::decode(&b), Err(WireError::Body { .. })));
    }

    proptest! {
        /// Garbage never panics, with or without a valid header and CRC.
        #[test]
        fn garbage_never_panics(body in proptest::collection::vec(any::<u8>(), 0..200), kind in 0u16..10) {
            let _ = Message::decode(&body);
            let mut b = Vec::new();
            b.extend_from_slice(&MAGIC.to_le_bytes());
            b.extend_from_slice(&VERSION.to_le_bytes());
            b.extend_from_slice(&kind.to_le_bytes());
            b.extend_from_slice(&(body.len() as u32).to_le_bytes());
            b.extend_from_slice(&body);
            let c = crc32c(&b);
            b.extend_from_slice(&c.to_le_bytes());
            let _ = Message::decode(&b);
        }

        /// Any Connection round-trips.
        #[test]
        fn connections_round_trip(
            export in "[a-z0-9@._-]{1,64}",
            peer in ".{0,40}",
            size in any::<u64>(),
            flags in any::<u16>(),
            structured in any::<bool>(),
            base_allocation in proptest::option::of(any::<u32>()),
            leftover in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let m = Message::Connection(ConnState { export, peer, size, flags, structured, base_allocation, leftover });
            prop_assert_eq!(Message::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }
}
