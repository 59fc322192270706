//! Two protocols on one listener: a metadata replica serves the replicated
//! runtime's frames (its peers, design 0006) and the blob protocol's
//! (tractservers and clients) at the one address its peers know it by
//! (design 0007). A request's opcode says which protocol it belongs to:
//! the two protocols' opcodes are disjoint (the metadata server's tests
//! check it for the pair it serves), and `Either` decodes with the first, then the second.
//!
//! An error reply is encoded the same way by both (status, then the
//! `ErrorReply`): a caller decodes it with its own protocol whichever side
//! produced it. `Either` relies on that; the test below checks it too.

use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_proto::{DecodeError, ErrorReply};

use crate::protocol::Protocol;
use crate::server::Service;
use crate::session::Caller;

/// A value of protocol `A` or of protocol `B`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OneOf<L, R> {
    Left(L),
    Right(R),
}

/// Protocol `A` and protocol `B` on one connection (module header).
pub struct Either<A, B>(PhantomData<(A, B)>);

impl<A: Protocol, B: Protocol> Protocol for Either<A, B>
where
    A::Reply: Clone,
    B::Reply: Clone,
{
    type Request = OneOf<A::Request, B::Request>;
    type Reply = OneOf<Result<A::Reply, ErrorReply>, Result<B::Reply, ErrorReply>>;

    fn opcode(req: &Self::Request) -> u16 {
        match req {
            OneOf::Left(r) => A::opcode(r),
            OneOf::Right(r) => B::opcode(r),
        }
    }
    fn encode_request(req: &Self::Request) -> Bytes {
        match req {
            OneOf::Left(r) => A::encode_request(r),
            OneOf::Right(r) => B::encode_request(r),
        }
    }
    fn decode_request(opcode: u16, meta: &[u8]) -> Option<Result<Self::Request, DecodeError>> {
        if let Some(r) = A::decode_request(opcode, meta) {
            return Some(r.map(OneOf::Left));
        }
        B::decode_request(opcode, meta).map(|r| r.map(OneOf::Right))
    }
    fn encode_response(res: &Result<Self::Reply, ErrorReply>) -> Bytes {
        match res {
            Ok(OneOf::Left(r)) => A::encode_response(&r.clone()),
            Ok(OneOf::Right(r)) => B::encode_response(&r.clone()),
            Err(e) => B::encode_response(&Err(e.clone())),
        }
    }
    fn decode_response(
        opcode: u16,
        meta: &[u8],
    ) -> Option<Result<Result<Self::Reply, ErrorReply>, DecodeError>> {
        if let Some(r) = A::decode_response(opcode, meta) {
            return Some(r.map(|r| Ok(OneOf::Left(r))));
        }
        B::decode_response(opcode, meta).map(|r| r.map(|r| Ok(OneOf::Right(r))))
    }
    fn session_hello(req: &Self::Request) -> Option<(u64, u64, Self::Reply)> {
        match req {
            OneOf::Left(r) => A::session_hello(r).map(|(s, e, reply)| (s, e, OneOf::Left(Ok(reply)))),
            OneOf::Right(r) => B::session_hello(r).map(|(s, e, reply)| (s, e, OneOf::Right(Ok(reply)))),
        }
    }
    fn reply_bytes(req: &Self::Request) -> u32 {
        match req {
            OneOf::Left(r) => A::reply_bytes(r),
            OneOf::Right(r) => B::reply_bytes(r),
        }
    }
}

/// Serves protocol `A` with one service and `B` with another.
pub struct EitherService<A: Protocol, B: Protocol> {
    pub left: Arc<dyn Service<A>>,
    pub right: Arc<dyn Service<B>>,
}

impl<A: Protocol, B: Protocol> Service<Either<A, B>> for EitherService<A, B>
where
    A::Reply: Clone,
    B::Reply: Clone,
{
    fn call(
        self: Arc<Self>,
        req: OneOf<A::Request, B::Request>,
        data: Bytes,
        caller: Caller,
    ) -> BoxFuture<'static, (Result<<Either<A, B> as Protocol>::Reply, ErrorReply>, Bytes)> {
        match req {
            OneOf::Left(r) => {
                let f = self.left.clone().call(r, data, caller);
                async move {
                    let (res, data) = f.await;
                    (Ok(OneOf::Left(res)), data)
                }
                .boxed()
            }
            OneOf::Right(r) => {
                let f = self.right.clone().call(r, data, caller);
                async move {
                    let (res, data) = f.await;
                    (Ok(OneOf::Right(res)), data)
                }
                .boxed()
            }
        }
    }

    fn revocations(&self) -> Option<Arc<crate::authz::Revocations>> {
        self.right.revocations().or_else(|| self.left.revocations())
    }
}
