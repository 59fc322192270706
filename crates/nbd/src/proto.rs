//! The NBD wire format (NetworkBlockDevice/nbd `doc/proto.md`): constants
//! under the spec's names, and pure encoders and decoders over byte slices.
//!
//! Nothing here does I/O, so every decoder can be fed arbitrary bytes by the
//! fuzz targets (`crates/nbd/fuzz`) and the stable replay and property tests
//! (`crates/nbd/tests/integration/decoders.rs`). Invariants:
//! - every length read from the peer is checked against the bytes actually
//!   present (and against a named maximum) before anything is allocated;
//! - decoding never panics; a malformed message is an error value;
//! - strings follow the spec's rules: UTF-8, no NUL, at most 4096 bytes.

use bytes::{BufMut, Bytes, BytesMut};

// ---------------------------------------------------------------------------
// Magic numbers.

/// `NBDMAGIC`, the first 8 bytes the server sends (`INIT_PASSWD`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle greeting magic and the magic of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply.
pub const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Requests of the experimental EXTENDED_HEADERS extension, which this
/// server does not negotiate (named only to log a precise violation).
pub const NBD_EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------
// Handshake flags (server, 16 bits) and client flags (32 bits).

pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;
/// What this server advertises in the greeting.
pub const HANDSHAKE_FLAGS: u16 = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;
/// Client flags the server understands; any other bit is a hard disconnect.
pub const CLIENT_FLAGS_KNOWN: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

// ---------------------------------------------------------------------------
// Transmission flags (16 bits).

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Options.

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types.
pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

/// Whether an option reply type is an error (bit 31).
pub fn is_rep_error(reply_type: u32) -> bool {
    reply_type & NBD_REP_FLAG_ERROR != 0
}

// Information types of NBD_OPT_INFO / NBD_OPT_GO.
pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Transmission: commands, command flags, reply chunks, errors.

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
pub const NBD_CMD_RESIZE: u16 = 8;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;

pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// The one metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
pub const NBD_STATE_HOLE: u32 = 1 << 0;
pub const NBD_STATE_ZERO: u32 = 1 << 1;

// ---------------------------------------------------------------------------
// Limits.

/// Longest string (export name, query, message) the spec allows.
pub const STRING_LEN_MAX: usize = 4096;
/// Longest option payload accepted. The largest legitimate one is a
/// SET/LIST_META_CONTEXT with a few 4096-byte strings; anything beyond is
/// answered with `NBD_REP_ERR_TOO_BIG` and a hard disconnect.
pub const OPTION_LEN_MAX: u32 = 64 << 10;
/// Largest READ or WRITE payload advertised (`NBD_INFO_BLOCK_SIZE`'s
/// maximum): the spec's 2^25, which a client may use without asking.
pub const PAYLOAD_ADVERTISED: u32 = 32 << 20;
/// Largest READ or WRITE payload served: twice the advertised maximum, as
/// nbdkit does, because some clients ignore block-size constraints (reads
/// of 40 MiB were seen). A larger WRITE is treated as a denial of service.
pub const PAYLOAD_MAX: u32 = 64 << 20;
/// Advertised size constraints (`NBD_INFO_BLOCK_SIZE`): byte-granular I/O
/// works (the volume read-modify-writes partial blocks).
pub const BLOCK_SIZE_MIN: u32 = 1;
/// Most block-status descriptors in one reply chunk (the spec asks for at
/// most 2^20; fewer keeps a reply under 512 KiB, and clients ask again).
pub const EXTENTS_MAX: usize = 1 << 16;

pub const GREETING_LEN: usize = 18;
pub const OPTION_HEADER_LEN: usize = 16;
pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const CHUNK_HEADER_LEN: usize = 20;
/// Reply to NBD_OPT_EXPORT_NAME: size, flags, then 124 zero bytes unless
/// `NBD_FLAG_C_NO_ZEROES`.
pub const EXPORT_NAME_REPLY_ZEROES: usize = 124;

const _: () = assert!(OPTION_LEN_MAX as usize >= 4 * STRING_LEN_MAX);
const _: () = assert!(PAYLOAD_ADVERTISED >= 1 << 25, "the spec says 2^25 must never be deemed a DoS");
const _: () = assert!(PAYLOAD_MAX >= PAYLOAD_ADVERTISED);

// ---------------------------------------------------------------------------
// Errors.

/// A message that cannot be parsed at all: the stream cannot be trusted
/// past it, so the connection ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("bad magic {got:#x} (expected {expected:#x})")]
    BadMagic { expected: u64, got: u64 },
    #[error("message truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
}

/// An option whose data is malformed: answered with `NBD_REP_ERR_INVALID`
/// (or, for NBD_OPT_EXPORT_NAME, which cannot fail politely, a disconnect).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionError(pub String);

fn invalid(m: impl Into<String>) -> OptionError {
    OptionError(m.into())
}

// ---------------------------------------------------------------------------
// Bounded reading over a slice.

/// Reads big-endian fields from a slice; every read is checked.
struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], OptionError> {
        if n > self.b.len() {
            return Err(invalid(format!(
                "option data truncated: need {n} more bytes, have {}",
                self.b.len()
            )));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u16(&mut self) -> Result<u16, OptionError> {
        let s = self.take(2)?;
        Ok(u16::from_be_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, OptionError> {
        let s = self.take(4)?;
        Ok(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn string(&mut self, len: u32) -> Result<String, OptionError> {
        let s = self.take(len as usize)?;
        nbd_string(s)
    }
    fn remaining(&self) -> usize {
        self.b.len()
    }
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Checks a string from the peer against the spec's rules.
pub fn nbd_string(b: &[u8]) -> Result<String, OptionError> {
    if b.len() > STRING_LEN_MAX {
        return Err(invalid(format!("string of {} bytes exceeds {STRING_LEN_MAX}", b.len())));
    }
    if b.contains(&0) {
        return Err(invalid("string contains NUL"));
    }
    match std::str::from_utf8(b) {
        Ok(s) => Ok(s.to_string()),
        Err(_) => Err(invalid("string is not UTF-8")),
    }
}

// ---------------------------------------------------------------------------
// Handshake.

/// The server's first 18 bytes: NBDMAGIC, IHAVEOPT, handshake flags.
pub fn encode_greeting() -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..].copy_from_slice(&HANDSHAKE_FLAGS.to_be_bytes());
    b
}

/// What the client's 32-bit flags allow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    pub no_zeroes: bool,
}

/// Why the client's flags end the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ClientFlagsError {
    /// The spec says the server MUST drop a client with unknown flags.
    #[error("unknown client flags {0:#x}")]
    Unknown(u32),
    /// Old (non-fixed) newstyle: the client could only send
    /// NBD_OPT_EXPORT_NAME and would hang up on any option reply. This
    /// server speaks fixed newstyle only.
    #[error("client does not speak fixed newstyle negotiation")]
    NotFixedNewstyle,
}

pub fn decode_client_flags(flags: u32) -> Result<ClientFlags, ClientFlagsError> {
    if flags & !CLIENT_FLAGS_KNOWN != 0 {
        return Err(ClientFlagsError::Unknown(flags));
    }
    if flags & NBD_FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(ClientFlagsError::NotFixedNewstyle);
    }
    Ok(ClientFlags { no_zeroes: flags & NBD_FLAG_C_NO_ZEROES != 0 })
}

/// The 16 bytes before each option's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

pub fn decode_option_header(b: &[u8]) -> Result<OptionHeader, ProtoError> {
    if b.len() < OPTION_HEADER_LEN {
        return Err(ProtoError::Truncated { need: OPTION_HEADER_LEN, have: b.len() });
    }
    let magic = be_u64(b, 0);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic { expected: IHAVEOPT, got: magic });
    }
    Ok(OptionHeader { option: be_u32(b, 8), len: be_u32(b, 12) })
}

/// NBD_OPT_INFO / NBD_OPT_GO data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    /// Information types asked for (`NBD_INFO_*`), in the client's order.
    pub info: Vec<u16>,
}

/// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export: String,
    pub queries: Vec<String>,
}

/// A decoded option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info(InfoRequest),
    Go(InfoRequest),
    StructuredReply,
    ListMetaContext(MetaContextRequest),
    SetMetaContext(MetaContextRequest),
    /// Any option this server does not implement: `NBD_REP_ERR_UNSUP`.
    Unsupported(u32),
}

fn no_data(option: &str, data: &[u8]) -> Result<(), OptionError> {
    if data.is_empty() {
        Ok(())
    } else {
        Err(invalid(format!("{option} takes no data, got {} bytes", data.len())))
    }
}

fn decode_info(data: &[u8]) -> Result<InfoRequest, OptionError> {
    let mut c = Cursor { b: data };
    let name_len = c.u32()?;
    // "MUST be no larger than the option data length - 6".
    if name_len as usize > data.len().saturating_sub(6) {
        return Err(invalid(format!("export name length {name_len} exceeds the option data")));
    }
    let name = c.string(name_len)?;
    let n = c.u16()? as usize;
    if c.remaining() != 2 * n {
        return Err(invalid(format!(
            "{n} information requests need {} bytes, option has {}",
            2 * n,
            c.remaining()
        )));
    }
    let mut info = Vec::with_capacity(n);
    for _ in 0..n {
        info.push(c.u16()?);
    }
    Ok(InfoRequest { name, info })
}

fn decode_meta(data: &[u8]) -> Result<MetaContextRequest, OptionError> {
    let mut c = Cursor { b: data };
    let name_len = c.u32()?;
    let export = c.string(name_len)?;
    let n = c.u32()?;
    // Each query takes at least its 4-byte length: a count the data cannot
    // hold is malformed (and must not size an allocation).
    if n as usize > c.remaining() / 4 {
        return Err(invalid(format!("{n} queries cannot fit in {} bytes", c.remaining())));
    }
    let mut queries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let len = c.u32()?;
        queries.push(c.string(len)?);
    }
    if c.remaining() != 0 {
        return Err(invalid(format!("{} trailing bytes after the queries", c.remaining())));
    }
    Ok(MetaContextRequest { export, queries })
}

/// Decodes option `option`'s data. Never panics; malformed data is an
/// [`OptionError`] (`NBD_REP_ERR_INVALID`).
pub fn decode_option(option: u32, data: &[u8]) -> Result<ClientOption, OptionError> {
    match option {
        NBD_OPT_EXPORT_NAME => Ok(ClientOption::ExportName(nbd_string(data)?)),
        // "a server SHOULD ignore any data sent by the client".
        NBD_OPT_ABORT => Ok(ClientOption::Abort),
        NBD_OPT_LIST => no_data("NBD_OPT_LIST", data).map(|_| ClientOption::List),
        NBD_OPT_STARTTLS => no_data("NBD_OPT_STARTTLS", data).map(|_| ClientOption::StartTls),
        NBD_OPT_INFO => decode_info(data).map(ClientOption::Info),
        NBD_OPT_GO => decode_info(data).map(ClientOption::Go),
        NBD_OPT_STRUCTURED_REPLY => {
            no_data("NBD_OPT_STRUCTURED_REPLY", data).map(|_| ClientOption::StructuredReply)
        }
        NBD_OPT_LIST_META_CONTEXT => decode_meta(data).map(ClientOption::ListMetaContext),
        NBD_OPT_SET_META_CONTEXT => decode_meta(data).map(ClientOption::SetMetaContext),
        other => Ok(ClientOption::Unsupported(other)),
    }
}

impl ClientOption {
    /// The option's number.
    pub fn code(&self) -> u32 {
        match self {
            ClientOption::ExportName(_) => NBD_OPT_EXPORT_NAME,
            ClientOption::Abort => NBD_OPT_ABORT,
            ClientOption::List => NBD_OPT_LIST,
            ClientOption::StartTls => NBD_OPT_STARTTLS,
            ClientOption::Info(_) => NBD_OPT_INFO,
            ClientOption::Go(_) => NBD_OPT_GO,
            ClientOption::StructuredReply => NBD_OPT_STRUCTURED_REPLY,
            ClientOption::ListMetaContext(_) => NBD_OPT_LIST_META_CONTEXT,
            ClientOption::SetMetaContext(_) => NBD_OPT_SET_META_CONTEXT,
            ClientOption::Unsupported(o) => *o,
        }
    }

    /// The client's encoding (header and data): the inverse of
    /// [`decode_option_header`] + [`decode_option`], used by tests and
    /// clients.
    pub fn encode(&self) -> Vec<u8> {
        let mut d = Vec::new();
        match self {
            ClientOption::ExportName(n) => d.extend_from_slice(n.as_bytes()),
            ClientOption::Info(r) | ClientOption::Go(r) => {
                d.put_u32(r.name.len() as u32);
                d.extend_from_slice(r.name.as_bytes());
                d.put_u16(r.info.len() as u16);
                for i in &r.info {
                    d.put_u16(*i);
                }
            }
            ClientOption::ListMetaContext(m) | ClientOption::SetMetaContext(m) => {
                d.put_u32(m.export.len() as u32);
                d.extend_from_slice(m.export.as_bytes());
                d.put_u32(m.queries.len() as u32);
                for q in &m.queries {
                    d.put_u32(q.len() as u32);
                    d.extend_from_slice(q.as_bytes());
                }
            }
            ClientOption::Abort
            | ClientOption::List
            | ClientOption::StartTls
            | ClientOption::StructuredReply
            | ClientOption::Unsupported(_) => {}
        }
        let mut b = Vec::with_capacity(OPTION_HEADER_LEN + d.len());
        b.put_u64(IHAVEOPT);
        b.put_u32(self.code());
        b.put_u32(d.len() as u32);
        b.extend_from_slice(&d);
        b
    }
}

/// One fixed-newstyle option reply: magic, option, type, length, data.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.put_u64(NBD_REP_MAGIC);
    b.put_u32(option);
    b.put_u32(reply_type);
    b.put_u32(data.len() as u32);
    b.extend_from_slice(data);
    b
}

/// An option reply header as the client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub len: u32,
}

pub fn decode_option_reply_header(b: &[u8]) -> Result<OptionReplyHeader, ProtoError> {
    if b.len() < 20 {
        return Err(ProtoError::Truncated { need: 20, have: b.len() });
    }
    let magic = be_u64(b, 0);
    if magic != NBD_REP_MAGIC {
        return Err(ProtoError::BadMagic { expected: NBD_REP_MAGIC, got: magic });
    }
    Ok(OptionReplyHeader { option: be_u32(b, 8), reply_type: be_u32(b, 12), len: be_u32(b, 16) })
}

/// An error message as reply data: cut to the spec's string limit on a
/// character boundary.
pub fn message_bytes(msg: &str) -> &[u8] {
    let mut end = msg.len().min(STRING_LEN_MAX);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    &msg.as_bytes()[..end]
}

/// `NBD_REP_SERVER` data: name length, name, then a human description.
pub fn encode_rep_server(name: &str, description: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len() + description.len());
    d.put_u32(name.len() as u32);
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(message_bytes(description));
    d
}

/// `NBD_INFO_EXPORT` data: type, size, transmission flags (length 12).
pub fn encode_info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut d = Vec::with_capacity(12);
    d.put_u16(NBD_INFO_EXPORT);
    d.put_u64(size);
    d.put_u16(flags);
    d
}

/// `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION` data.
pub fn encode_info_string(info: u16, s: &str) -> Vec<u8> {
    let s = message_bytes(s);
    let mut d = Vec::with_capacity(2 + s.len());
    d.put_u16(info);
    d.extend_from_slice(s);
    d
}

/// `NBD_INFO_BLOCK_SIZE` data (length 14).
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut d = Vec::with_capacity(14);
    d.put_u16(NBD_INFO_BLOCK_SIZE);
    d.put_u32(min);
    d.put_u32(preferred);
    d.put_u32(max);
    d
}

/// `NBD_REP_META_CONTEXT` data: context id and name.
pub fn encode_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut d = Vec::with_capacity(4 + name.len());
    d.put_u32(id);
    d.extend_from_slice(name.as_bytes());
    d
}

/// Reply to NBD_OPT_EXPORT_NAME: size, flags, and the 124 zero bytes
/// unless the client negotiated `NBD_FLAG_C_NO_ZEROES`.
pub fn encode_export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut d = Vec::with_capacity(10 + EXPORT_NAME_REPLY_ZEROES);
    d.put_u64(size);
    d.put_u16(flags);
    if !no_zeroes {
        d.put_bytes(0, EXPORT_NAME_REPLY_ZEROES);
    }
    d
}

// ---------------------------------------------------------------------------
// Transmission: requests.

/// A request header as sent (28 bytes; a WRITE's payload follows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.command.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }
}

/// Decodes a request header. A bad magic means the stream is out of step
/// (or speaks another dialect) and cannot be resynchronised.
pub fn decode_request(b: &[u8]) -> Result<Request, ProtoError> {
    if b.len() < REQUEST_LEN {
        return Err(ProtoError::Truncated { need: REQUEST_LEN, have: b.len() });
    }
    let magic = be_u32(b, 0);
    if magic != NBD_REQUEST_MAGIC {
        return Err(ProtoError::BadMagic { expected: NBD_REQUEST_MAGIC as u64, got: magic as u64 });
    }
    Ok(Request {
        flags: be_u16(b, 4),
        command: be_u16(b, 6),
        cookie: be_u64(b, 8),
        offset: be_u64(b, 16),
        len: be_u32(b, 24),
    })
}

/// What was negotiated for a connection, as far as validating requests
/// needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    pub size: u64,
    pub structured: bool,
    /// The `base:allocation` context id, if the client selected it for
    /// this export.
    pub base_allocation: Option<u32>,
}

/// A request that passed validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Disc,
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    /// A prefetch hint: range-checked and answered, nothing else.
    Cache {
        offset: u64,
        len: u32,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        fua: bool,
        no_hole: bool,
    },
    BlockStatus {
        offset: u64,
        len: u32,
        req_one: bool,
        context: u32,
    },
}

/// A request refused before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    pub errno: u32,
    /// Payload bytes that follow the header and must be read and dropped
    /// to reach the next request.
    pub drain: u32,
    /// The stream cannot (or should not) go on: reply, then hard
    /// disconnect.
    pub disconnect: bool,
    pub reason: String,
}

fn reject(errno: u32, reason: String) -> Reject {
    Reject { errno, drain: 0, disconnect: false, reason }
}

/// Command flags a request may carry, given what was negotiated. FUA is
/// accepted on every command (the spec: "the server MUST accept all
/// commands with this bit set").
fn allowed_flags(command: u16, s: &Session) -> u16 {
    NBD_CMD_FLAG_FUA
        | match command {
            NBD_CMD_READ if s.structured => NBD_CMD_FLAG_DF,
            NBD_CMD_WRITE_ZEROES => NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
            NBD_CMD_BLOCK_STATUS => NBD_CMD_FLAG_REQ_ONE,
            _ => 0,
        }
}

/// Validates a request against the session: the command is known, its
/// flags are allowed, the range lies within the export, a payload is not
/// oversized. Pure, so it is fuzzed with the header decoder.
pub fn check_request(r: &Request, s: &Session) -> Result<Command, Reject> {
    // A WRITE's payload follows the header whatever we think of it: skip it
    // when it is small enough, otherwise the stream is lost.
    let payload = if r.command == NBD_CMD_WRITE { r.len } else { 0 };
    let refuse = |errno: u32, reason: String| {
        let mut j = reject(errno, reason);
        if payload > PAYLOAD_MAX {
            j.disconnect = true;
        } else {
            j.drain = payload;
        }
        j
    };
    if r.command == NBD_CMD_DISC {
        // The client is leaving; its fields do not matter.
        return Ok(Command::Disc);
    }
    if r.command > NBD_CMD_BLOCK_STATUS {
        return Err(reject(NBD_EINVAL, format!("unknown command {}", r.command)));
    }
    if r.command == NBD_CMD_WRITE && r.len > PAYLOAD_MAX {
        // The spec lets a server treat a payload over its maximum as a
        // denial of service; skipping up to 4 GiB is not worth it.
        return Err(refuse(
            NBD_EINVAL,
            format!("write of {} bytes exceeds the {PAYLOAD_MAX}-byte maximum", r.len),
        ));
    }
    let bad_flags = r.flags & !allowed_flags(r.command, s);
    if bad_flags != 0 {
        return Err(refuse(
            NBD_EINVAL,
            format!("flags {bad_flags:#x} are not valid on command {}", r.command),
        ));
    }
    let fua = r.flags & NBD_CMD_FLAG_FUA != 0;
    if r.command == NBD_CMD_FLUSH {
        // Offset and length are reserved (zero); a client that fills them
        // still wants its flush.
        return Ok(Command::Flush);
    }
    let (offset, len) = (r.offset, r.len);
    let in_range = offset.checked_add(len as u64).is_some_and(|end| end <= s.size);
    if !in_range {
        // ENOSPC for writes, EINVAL for the rest (the spec's "Error values").
        let errno = match r.command {
            NBD_CMD_WRITE | NBD_CMD_WRITE_ZEROES => NBD_ENOSPC,
            _ => NBD_EINVAL,
        };
        return Err(refuse(
            errno,
            format!("range [{offset}, +{len}) is past the end of the {}-byte export", s.size),
        ));
    }
    match r.command {
        NBD_CMD_READ => {
            if len > PAYLOAD_MAX {
                // Structured replies could split it, but one buffer per
                // request is the memory bound; EOVERFLOW tells a structured
                // client to retry smaller.
                let errno = if s.structured { NBD_EOVERFLOW } else { NBD_EINVAL };
                return Err(reject(
                    errno,
                    format!("read of {len} bytes exceeds the {PAYLOAD_MAX}-byte maximum"),
                ));
            }
            Ok(Command::Read { offset, len })
        }
        NBD_CMD_WRITE => Ok(Command::Write { offset, len, fua }),
        NBD_CMD_TRIM => Ok(Command::Trim { offset, len, fua }),
        NBD_CMD_CACHE => Ok(Command::Cache { offset, len }),
        NBD_CMD_WRITE_ZEROES => {
            let no_hole = r.flags & NBD_CMD_FLAG_NO_HOLE != 0;
            if r.flags & NBD_CMD_FLAG_FAST_ZERO != 0 && no_hole {
                // Provisioning real zeros costs as much as a WRITE: a fast
                // zero request must fail at once, changing nothing.
                return Err(reject(NBD_ENOTSUP, "fast zero with NO_HOLE is not faster than a write".into()));
            }
            Ok(Command::WriteZeroes { offset, len, fua, no_hole })
        }
        NBD_CMD_BLOCK_STATUS => {
            let Some(context) = s.base_allocation else {
                return Err(reject(NBD_EINVAL, "block status without a negotiated metadata context".into()));
            };
            if len == 0 {
                // A reply needs at least one non-empty descriptor.
                return Err(reject(NBD_EINVAL, "block status of length 0".into()));
            }
            Ok(Command::BlockStatus { offset, len, req_one: r.flags & NBD_CMD_FLAG_REQ_ONE != 0, context })
        }
        _ => Err(reject(NBD_EINVAL, format!("unknown command {}", r.command))),
    }
}

/// On a read-only export, refuses a validated command that would change
/// it: WRITE, TRIM and WRITE_ZEROES get EPERM (the spec: the server SHOULD
/// return EPERM for a write to a read-only export), and a WRITE's payload
/// is skipped (`check_request` has bounded it). Everything else passes,
/// FLUSH included: there is nothing to flush, so it succeeds. Pure, like
/// `check_request`, which it follows (malformed requests keep their errno).
pub fn check_read_only(cmd: Command, read_only: bool) -> Result<Command, Reject> {
    if !read_only {
        return Ok(cmd);
    }
    let (name, drain) = match cmd {
        Command::Write { len, .. } => ("write", len),
        Command::Trim { .. } => ("trim", 0),
        Command::WriteZeroes { .. } => ("write zeroes", 0),
        Command::Read { .. }
        | Command::Disc
        | Command::Flush
        | Command::Cache { .. }
        | Command::BlockStatus { .. } => return Ok(cmd),
    };
    Err(Reject {
        errno: NBD_EPERM,
        drain,
        disconnect: false,
        reason: format!("{name} on a read-only export"),
    })
}

// ---------------------------------------------------------------------------
// Transmission: replies.

/// A simple reply header (a READ's data follows on success).
pub fn encode_simple_reply(errno: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[..4].copy_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&errno.to_be_bytes());
    b[8..].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header; `len` payload bytes follow.
pub fn encode_chunk_header(flags: u16, reply_type: u16, cookie: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[..4].copy_from_slice(&NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&reply_type.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..].copy_from_slice(&len.to_be_bytes());
    b
}

/// `NBD_REPLY_TYPE_ERROR` payload: errno, message length, message.
pub fn encode_error_payload(errno: u32, msg: &str) -> Bytes {
    let m = message_bytes(msg);
    let mut b = BytesMut::with_capacity(6 + m.len());
    b.put_u32(errno);
    b.put_u16(m.len() as u16);
    b.extend_from_slice(m);
    b.freeze()
}

/// `NBD_REPLY_TYPE_BLOCK_STATUS` payload: context id, then (length, flags)
/// descriptors.
pub fn encode_block_status(context: u32, extents: &[(u32, u32)]) -> Bytes {
    let mut b = BytesMut::with_capacity(4 + 8 * extents.len());
    b.put_u32(context);
    for (len, flags) in extents {
        b.put_u32(*len);
        b.put_u32(*flags);
    }
    b.freeze()
}

/// A reply header as the client sees it: simple or a structured chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple { errno: u32, cookie: u64 },
    Chunk { flags: u16, reply_type: u16, cookie: u64, len: u32 },
}

/// Decodes a reply header from the first 16 (simple) or 20 (structured)
/// bytes of `b`, telling which by the magic. For clients and tests.
pub fn decode_reply_header(b: &[u8]) -> Result<ReplyHeader, ProtoError> {
    if b.len() < 4 {
        return Err(ProtoError::Truncated { need: 4, have: b.len() });
    }
    match be_u32(b, 0) {
        NBD_SIMPLE_REPLY_MAGIC if b.len() >= SIMPLE_REPLY_LEN => {
            Ok(ReplyHeader::Simple { errno: be_u32(b, 4), cookie: be_u64(b, 8) })
        }
        NBD_STRUCTURED_REPLY_MAGIC if b.len() >= CHUNK_HEADER_LEN => Ok(ReplyHeader::Chunk {
            flags: be_u16(b, 4),
            reply_type: be_u16(b, 6),
            cookie: be_u64(b, 8),
            len: be_u32(b, 16),
        }),
        NBD_SIMPLE_REPLY_MAGIC => Err(ProtoError::Truncated { need: SIMPLE_REPLY_LEN, have: b.len() }),
        NBD_STRUCTURED_REPLY_MAGIC => Err(ProtoError::Truncated { need: CHUNK_HEADER_LEN, have: b.len() }),
        m => Err(ProtoError::BadMagic { expected: NBD_SIMPLE_REPLY_MAGIC as u64, got: m as u64 }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn session() -> Session {
        Session { size: 1 << 20, structured: true, base_allocation: Some(1) }
    }

    fn req(command: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request { flags, command, cookie: 7, offset, len }
    }

    /// The greeting's bytes are pinned: a change here breaks every client.
    #[test]
    fn greeting_bytes() {
        assert_eq!(
            encode_greeting(),
            [
                b'N', b'B', b'D', b'M', b'A', b'G', b'I', b'C', b'I', b'H', b'A', b'V', b'E', b'O', b'P',
                b'T', 0, 3
            ]
        );
    }

    /// GO round-trips, and its name length is checked against the data.
    #[test]
    fn go_round_trip_and_bounds() {
        let o = ClientOption::Go(InfoRequest { name: "vol".into(), info: vec![NBD_INFO_BLOCK_SIZE] });
        let b = o.encode();
        let h = decode_option_header(&b).unwrap();
        assert_eq!(h, OptionHeader { option: NBD_OPT_GO, len: (b.len() - 16) as u32 });
        assert_eq!(decode_option(h.option, &b[16..]).unwrap(), o);
        // Name length pointing past the data.
        let mut bad = b[16..].to_vec();
        bad[3] = 200;
        assert!(decode_option(NBD_OPT_GO, &bad).is_err());
        // Info count not matching the trailing bytes.
        let mut bad = b[16..].to_vec();
        bad.push(0);
        assert!(decode_option(NBD_OPT_GO, &bad).is_err());
        assert!(decode_option(NBD_OPT_GO, &[0, 0, 0]).is_err());
    }

    /// Meta context requests: a query count the data cannot hold is refused
    /// before anything is allocated.
    #[test]
    fn meta_context_counts_are_bounded() {
        let mut d = vec![0, 0, 0, 0];
        d.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_option(NBD_OPT_SET_META_CONTEXT, &d).is_err());
        let o = ClientOption::SetMetaContext(MetaContextRequest {
            export: "".into(),
            queries: vec!["base:allocation".into(), "qemu:dirty-bitmap:x".into()],
        });
        let b = o.encode();
        assert_eq!(decode_option(NBD_OPT_SET_META_CONTEXT, &b[16..]).unwrap(), o);
    }

    /// Options that take no data refuse data; ABORT ignores it.
    #[test]
    fn no_data_options() {
        assert!(decode_option(NBD_OPT_LIST, b"x").is_err());
        assert!(decode_option(NBD_OPT_STRUCTURED_REPLY, b"x").is_err());
        assert_eq!(decode_option(NBD_OPT_ABORT, b"x").unwrap(), ClientOption::Abort);
        assert_eq!(decode_option(99, b"x").unwrap(), ClientOption::Unsupported(99));
    }

    /// Strings: NUL, invalid UTF-8 and over-long names are refused.
    #[test]
    fn strings() {
        assert!(nbd_string(b"a\0b").is_err());
        assert!(nbd_string(&[0xff, 0xfe]).is_err());
        assert!(nbd_string(&vec![b'a'; STRING_LEN_MAX + 1]).is_err());
        assert_eq!(nbd_string(b"disk").unwrap(), "disk");
    }

    /// Client flags: fixed newstyle required, unknown bits refused.
    #[test]
    fn client_flags() {
        assert_eq!(decode_client_flags(3), Ok(ClientFlags { no_zeroes: true }));
        assert_eq!(decode_client_flags(1), Ok(ClientFlags { no_zeroes: false }));
        assert_eq!(decode_client_flags(0), Err(ClientFlagsError::NotFixedNewstyle));
        assert_eq!(decode_client_flags(4 | 1), Err(ClientFlagsError::Unknown(5)));
    }

    /// Requests: a header round-trips; a bad magic is refused.
    #[test]
    fn request_header() {
        let r = req(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 4096, 512);
        assert_eq!(decode_request(&r.encode()).unwrap(), r);
        let mut b = r.encode();
        b[0] ^= 1;
        assert!(matches!(decode_request(&b), Err(ProtoError::BadMagic { .. })));
        assert!(matches!(decode_request(&b[..27]), Err(ProtoError::Truncated { .. })));
    }

    /// Validation: each refusal has the spec's errno and keeps the stream
    /// in step (drains a write's payload) or ends it.
    #[test]
    fn request_validation() {
        let s = session();
        let ok = |r: Request| check_request(&r, &s).unwrap();
        let err = |r: Request| check_request(&r, &s).unwrap_err();
        assert_eq!(ok(req(NBD_CMD_READ, 0, 0, 4096)), Command::Read { offset: 0, len: 4096 });
        assert_eq!(ok(req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1)), Command::Read { offset: 0, len: 1 });
        assert_eq!(ok(req(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0)), Command::Flush);
        assert_eq!(ok(req(NBD_CMD_DISC, 0xffff, 5, 5)), Command::Disc);
        // Past the end: EINVAL for reads, ENOSPC for writes (payload drained).
        assert_eq!(err(req(NBD_CMD_READ, 0, 1 << 20, 1)).errno, NBD_EINVAL);
        let e = err(req(NBD_CMD_WRITE, 0, (1 << 20) - 1, 2));
        assert_eq!((e.errno, e.drain, e.disconnect), (NBD_ENOSPC, 2, false));
        assert_eq!(err(req(NBD_CMD_WRITE_ZEROES, 0, u64::MAX, 2)).errno, NBD_ENOSPC);
        assert_eq!(err(req(NBD_CMD_TRIM, 0, u64::MAX, 2)).errno, NBD_EINVAL);
        // Oversized write: error, then disconnect.
        let e = err(req(NBD_CMD_WRITE, 0, 0, PAYLOAD_MAX + 1));
        assert!(e.disconnect);
        // Bad flags on a write: drained.
        let e = err(req(NBD_CMD_WRITE, NBD_CMD_FLAG_REQ_ONE, 0, 100));
        assert_eq!((e.errno, e.drain), (NBD_EINVAL, 100));
        // Unknown command and unknown flags.
        assert_eq!(err(req(9, 0, 0, 0)).errno, NBD_EINVAL);
        assert_eq!(err(req(NBD_CMD_READ, 1 << 9, 0, 1)).errno, NBD_EINVAL);
        // DF only with structured replies.
        let simple = Session { structured: false, base_allocation: None, ..s };
        assert_eq!(
            check_request(&req(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 1), &simple).unwrap_err().errno,
            NBD_EINVAL
        );
        // Oversized reads.
        let big = Session { size: 1 << 40, ..s };
        // Past the advertised maximum but within the served one: served
        // (a 40 MiB read from a client that ignores block sizes).
        assert_eq!(
            check_request(&req(NBD_CMD_READ, 0, 0, 40 << 20), &big).unwrap(),
            Command::Read { offset: 0, len: 40 << 20 }
        );
        assert_eq!(
            check_request(&req(NBD_CMD_WRITE, 0, 0, 40 << 20), &big).unwrap(),
            Command::Write { offset: 0, len: 40 << 20, fua: false }
        );
        let e = check_request(&req(NBD_CMD_READ, 0, 0, PAYLOAD_MAX + 1), &big).unwrap_err();
        assert_eq!((e.errno, e.disconnect), (NBD_EOVERFLOW, false));
        let big_simple = Session { structured: false, ..big };
        assert_eq!(
            check_request(&req(NBD_CMD_READ, 0, 0, PAYLOAD_MAX + 1), &big_simple).unwrap_err().errno,
            NBD_EINVAL
        );
        // Block status needs a context.
        assert_eq!(
            check_request(&req(NBD_CMD_BLOCK_STATUS, 0, 0, 1), &simple).unwrap_err().errno,
            NBD_EINVAL
        );
        assert_eq!(
            ok(req(NBD_CMD_BLOCK_STATUS, NBD_CMD_FLAG_REQ_ONE, 0, 9)),
            Command::BlockStatus { offset: 0, len: 9, req_one: true, context: 1 }
        );
        // Fast zero cannot be fast with NO_HOLE.
        let fz = NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_NO_HOLE;
        assert_eq!(err(req(NBD_CMD_WRITE_ZEROES, fz, 0, 1)).errno, NBD_ENOTSUP);
    }

    /// Read-only exports: commands that change data get EPERM (a write's
    /// payload drained), everything else passes unchanged; a writable
    /// export passes everything.
    #[test]
    fn read_only_refusals() {
        let s = session();
        let ok = |r: Request| check_request(&r, &s).unwrap();
        let changing = [
            (req(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, 4096, 100), 100),
            (req(NBD_CMD_TRIM, 0, 0, 8192), 0),
            (req(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_NO_HOLE, 0, 512), 0),
            (req(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_FAST_ZERO, 0, 512), 0),
        ];
        for (r, drain) in changing {
            let cmd = ok(r);
            assert_eq!(check_read_only(cmd, false).unwrap(), cmd);
            let e = check_read_only(cmd, true).unwrap_err();
            assert_eq!((e.errno, e.drain, e.disconnect), (NBD_EPERM, drain, false), "{cmd:?}");
            assert!(e.reason.contains("read-only"), "{}", e.reason);
        }
        let harmless = [
            req(NBD_CMD_READ, 0, 0, 4096),
            req(NBD_CMD_FLUSH, 0, 0, 0),
            req(NBD_CMD_FLUSH, NBD_CMD_FLAG_FUA, 0, 0),
            req(NBD_CMD_CACHE, 0, 0, 4096),
            req(NBD_CMD_BLOCK_STATUS, 0, 0, 4096),
            req(NBD_CMD_DISC, 0, 0, 0),
        ];
        for r in harmless {
            let cmd = ok(r);
            assert_eq!(check_read_only(cmd, true).unwrap(), cmd);
        }
    }

    /// Reply headers decode as encoded.
    #[test]
    fn reply_headers() {
        assert_eq!(
            decode_reply_header(&encode_simple_reply(5, 9)).unwrap(),
            ReplyHeader::Simple { errno: 5, cookie: 9 }
        );
        assert_eq!(
            decode_reply_header(&encode_chunk_header(1, 5, 9, 12)).unwrap(),
            ReplyHeader::Chunk { flags: 1, reply_type: 5, cookie: 9, len: 12 }
        );
        let e = encode_error_payload(NBD_EIO, &"é".repeat(3000));
        assert!(e.len() <= 6 + STRING_LEN_MAX);
        assert!(std::str::from_utf8(&e[6..]).is_ok());
    }
}
