//! What a connection carries. Framing, multiplexing, memory budgets and
//! error frames are the same for every blizzard protocol; a [`Protocol`]
//! says how its messages map to an opcode and a meta part. The blob
//! store's is [`Blob`]; the replicated runtime brings its own.
//!
//! Errors the framework itself sends (an unframed stream, an unknown
//! opcode, a request that does not decode) are `ErrorReply`s of the blob
//! protocol's error codes, for every protocol: their meaning does not
//! depend on what the connection carries.

use bytes::Bytes;

use blizzard_proto::{decode_response, encode_response, DecodeError, ErrorReply, Opcode, Reply, Request};

/// A request/response protocol over blizzard frames.
pub trait Protocol: Send + Sync + 'static {
    type Request: Clone + Send + Sync + 'static;
    type Reply: Send + 'static;

    /// The opcode a request travels under (its reply carries it back).
    fn opcode(req: &Self::Request) -> u16;
    /// A request's meta part.
    fn encode_request(req: &Self::Request) -> Bytes;
    /// `None` for an opcode this protocol does not have.
    fn decode_request(opcode: u16, meta: &[u8]) -> Option<Result<Self::Request, DecodeError>>;
    /// A response's meta part: a reply or an error.
    fn encode_response(res: &Result<Self::Reply, ErrorReply>) -> Bytes;
    /// `None` for an opcode this protocol does not have.
    fn decode_response(
        opcode: u16,
        meta: &[u8],
    ) -> Option<Result<Result<Self::Reply, ErrorReply>, DecodeError>>;

    /// For a request that opens a client session (see `session`): the
    /// session, its epoch and the reply to send. Handled by the connection
    /// itself, in order with the requests around it.
    fn session_hello(_req: &Self::Request) -> Option<(u64, u64, Self::Reply)> {
        None
    }

    /// Bytes the reply to `req` will carry in its data part, reserved from
    /// the connection's budget before the request runs.
    fn reply_bytes(_req: &Self::Request) -> u32 {
        0
    }
}

/// The blob store's protocol (`blizzard_proto`): tractservers and the
/// metadata server speak it.
pub struct Blob;

impl Protocol for Blob {
    type Request = Request;
    type Reply = Reply;

    fn opcode(req: &Request) -> u16 {
        req.opcode() as u16
    }
    fn encode_request(req: &Request) -> Bytes {
        req.encode()
    }
    fn decode_request(opcode: u16, meta: &[u8]) -> Option<Result<Request, DecodeError>> {
        Opcode::from_u16(opcode).map(|op| Request::decode(op, meta))
    }
    fn encode_response(res: &Result<Reply, ErrorReply>) -> Bytes {
        encode_response(res)
    }
    fn decode_response(opcode: u16, meta: &[u8]) -> Option<Result<Result<Reply, ErrorReply>, DecodeError>> {
        Opcode::from_u16(opcode).map(|op| decode_response(op, meta))
    }
    fn session_hello(req: &Request) -> Option<(u64, u64, Reply)> {
        match req {
            Request::Hello { session, epoch } => Some((*session, *epoch, Reply::Done)),
            _ => None,
        }
    }
    fn reply_bytes(req: &Request) -> u32 {
        match req {
            Request::ReadTract { len, .. } => (*len).min(blizzard_core::limits::FRAME_DATA_MAX),
            _ => 0,
        }
    }
}
