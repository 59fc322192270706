//! A service behind a role check (design 0010, point 2) and, for the blob
//! store, a scope check (issue 56).
//!
//! [`Authorized`] wraps a server's [`Service`]: a request that came on a
//! connection TLS authenticated runs only if the peer's role may send it
//! (`allows`, a pure table of the server's protocol:
//! `blizzard_proto::authz::allows` for the blob store). Refused requests
//! get `Forbidden` naming the peer, the request and the role it needs, and
//! are logged; nothing of them runs. A connection no TLS authenticated
//! carries no peer and is not checked: those are in-process calls, the
//! simulator, or a cluster its operator runs without certificates.
//!
//! [`Scoped`] does the same for the blob store's servers and then checks
//! the volume the request touches against the scope table the server
//! enforces ([`ScopeSource`]; `blizzard_proto::scope`): a client only on
//! the volumes whose access lists name it, an NBD server only on the ones
//! it serves, a revoked certificate on nothing. A request refused under
//! the table the server has makes it fetch a newer one first, once (a
//! lease taken a moment ago), so the check costs no round trip otherwise.
//! Its [`Revocations`] close every connection a revoked certificate holds
//! (`serve_conn` watches them).

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_env::Peer;
pub use blizzard_env::Revocations;
use blizzard_proto::scope::{self, Scope, Who};
use blizzard_proto::{ErrorCode, ErrorReply, Request};

use crate::{Blob, Caller, Protocol, Service};

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

/// Where a blob store server finds the scope table it enforces.
pub trait ScopeSource: Send + Sync + 'static {
    /// The table as this server has it now.
    fn current(&self) -> Arc<Scope>;
    /// Fetches a newer table, if there may be one (a request was just
    /// refused under the current one). Returns at once where the server
    /// itself keeps the table (the metadata service).
    fn refresh(self: Arc<Self>) -> BoxFuture<'static, ()>;
    /// The revocations of the tables adopted so far.
    fn revocations(&self) -> Arc<Revocations>;
}

/// The peer as `blizzard_proto::scope` names it.
pub fn who(peer: &Peer) -> Who<'_> {
    Who { name: &peer.name, role: &peer.role, serial: &peer.serial }
}

/// A blob store server's service behind the role table and the scope
/// table (module header).
pub struct Scoped {
    pub inner: Arc<dyn Service<Blob>>,
    pub scope: Arc<dyn ScopeSource>,
    /// What this server is, for the refusal's message ("tractserver").
    pub server: &'static str,
}

impl Scoped {
    pub fn wrap(
        inner: Arc<dyn Service<Blob>>,
        scope: Arc<dyn ScopeSource>,
        server: &'static str,
    ) -> Arc<dyn Service<Blob>> {
        Arc::new(Scoped { inner, scope, server })
    }
}

fn out_of_scope(server: &str, peer: &Peer, req: &Request, why: &str) -> ErrorReply {
    let opcode = req.opcode() as u16;
    tracing::warn!(%peer, opcode = format!("{opcode:#06x}"), server, why, "request refused: out of the certificate's scope");
    ErrorReply::new(
        ErrorCode::Forbidden,
        format!(
            "the {server} refuses request {opcode:#06x} from {peer}: {why} (an admin changes who may use a volume with `blizzard volume access`; design 0010)"
        ),
    )
}

impl Service<Blob> for Scoped {
    fn call(
        self: Arc<Self>,
        req: Request,
        data: Bytes,
        caller: Caller,
    ) -> BoxFuture<'static, (Result<blizzard_proto::Reply, ErrorReply>, Bytes)> {
        let Some(peer) = caller.peer().cloned() else {
            return self.inner.clone().call(req, data, caller);
        };
        if let Some(refused) = check::<Blob>(blizzard_proto::authz::allows, self.server, &caller, &req) {
            return futures::future::ready((Err(refused), Bytes::new())).boxed();
        }
        match scope::check(who(&peer), &req, &self.scope.current()) {
            Ok(()) => self.inner.clone().call(req, data, caller),
            Err(_) if self.scope.current().is_revoked(&peer.serial) => {
                let why = format!("the certificate (serial {}) is revoked", peer.serial);
                let e = out_of_scope(self.server, &peer, &req, &why);
                futures::future::ready((Err(e), Bytes::new())).boxed()
            }
            Err(_) => async move {
                // Perhaps a change the table here has not caught up with
                // (a lease taken a moment ago): once more, with a newer one.
                self.scope.clone().refresh().await;
                match scope::check(who(&peer), &req, &self.scope.current()) {
                    Ok(()) => self.inner.clone().call(req, data, caller).await,
                    Err(why) => (Err(out_of_scope(self.server, &peer, &req, &why)), Bytes::new()),
                }
            }
            .boxed(),
        }
    }

    fn verifies_replies(&self) -> bool {
        self.inner.verifies_replies()
    }

    fn revocations(&self) -> Option<Arc<Revocations>> {
        Some(self.scope.revocations())
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
        let peer = role.map(|r| Arc::new(Peer { name: "x".into(), role: r.into(), serial: "01".into() }));
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
