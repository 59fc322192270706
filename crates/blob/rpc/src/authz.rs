//! A service behind a role check (design 0010, point 2).
//!
//! [`Authorized`] wraps a server's [`Service`]: a request that came on a
//! connection TLS authenticated runs only if the peer's role may send it
//! (`allows`, a pure table of the server's protocol:
//! `blizzard_proto::authz::allows` for the blob store). Refused requests
//! get `Forbidden` naming the peer, the request and the role it needs, and
//! are logged; nothing of them runs. A connection no TLS authenticated
//! carries no peer and is not checked: those are in-process calls, the
//! simulator, or a cluster its operator runs without certificates.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_proto::{ErrorCode, ErrorReply};

use crate::{Caller, Protocol, Service};

/// Whether a peer of a role may send a request.
pub type Allows<P> = fn(role: &str, req: &<P as Protocol>::Request) -> bool;

/// `inner`, refusing what `allows` does not allow its authenticated peers.
pub struct Authorized<P: Protocol> {
    pub inner: Arc<dyn Service<P>>,
    pub allows: Allows<P>,
    /// What this server is, for the refusal's message ("tractserver").
    pub server: &'static str,
}

impl<P: Protocol> Authorized<P> {
    pub fn wrap(inner: Arc<dyn Service<P>>, allows: Allows<P>, server: &'static str) -> Arc<dyn Service<P>> {
        Arc::new(Authorized { inner, allows, server })
    }
}

/// The refusal of `req` from `peer`, or none if it may go on.
pub fn check<P: Protocol>(
    allows: Allows<P>,
    server: &str,
    caller: &Caller,
    req: &P::Request,
) -> Option<ErrorReply> {
    let peer = caller.peer()?;
    if allows(&peer.role, req) {
        return None;
    }
    let opcode = P::opcode(req);
    tracing::warn!(%peer, opcode = format!("{opcode:#06x}"), server, "request refused: the peer's certificate role does not allow it");
    Some(ErrorReply::new(
        ErrorCode::Forbidden,
        format!(
            "the {server} refuses request {opcode:#06x} from {peer}: a certificate of that role may not send it (design 0010 lists which role may; issue one with `blizzard ca issue NAME --role ROLE`)"
        ),
    ))
}

impl<P: Protocol> Service<P> for Authorized<P> {
    fn call(
        self: Arc<Self>,
        req: P::Request,
        data: Bytes,
        caller: Caller,
    ) -> BoxFuture<'static, (Result<P::Reply, ErrorReply>, Bytes)> {
        match check::<P>(self.allows, self.server, &caller, &req) {
            Some(refused) => futures::future::ready((Err(refused), Bytes::new())).boxed(),
            None => self.inner.clone().call(req, data, caller),
        }
    }

    fn verifies_replies(&self) -> bool {
        self.inner.verifies_replies()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Blob, Sessions};
    use blizzard_env::Peer;
    use blizzard_proto::{Reply, Request};

    struct Pong;
    impl Service<Blob> for Pong {
        fn call(
            self: Arc<Self>,
            _req: Request,
            _data: Bytes,
            _caller: Caller,
        ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
            futures::future::ready((Ok(Reply::Done), Bytes::new())).boxed()
        }
    }

    fn only_ping(_role: &str, req: &Request) -> bool {
        matches!(req, Request::Ping)
    }

    fn caller(role: Option<&str>) -> Caller {
        let peer = role.map(|r| Arc::new(Peer { name: "x".into(), role: r.into() }));
        Caller::new(None, Arc::new(Sessions::default())).with_peer(peer)
    }

    #[tokio::test]
    async fn authenticated_peers_are_checked_and_unauthenticated_ones_are_not() {
        let s = Authorized::<Blob>::wrap(Arc::new(Pong), only_ping, "test server");
        let (r, _) = s.clone().call(Request::Ping, Bytes::new(), caller(Some("client"))).await;
        assert!(r.is_ok());
        let (r, _) = s.clone().call(Request::SyncDisk, Bytes::new(), caller(Some("client"))).await;
        let e = r.expect_err("a client may only ping here");
        assert_eq!(e.code, ErrorCode::Forbidden);
        assert!(e.message.contains("\"x\" (client)"), "{}", e.message);
        // No peer: an in-process or plain connection, not checked here.
        let (r, _) = s.call(Request::SyncDisk, Bytes::new(), caller(None)).await;
        assert!(r.is_ok());
    }
}
