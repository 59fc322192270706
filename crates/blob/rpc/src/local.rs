//! Calls to a server in the same process, without a stream.
//!
//! `blizzard up` runs the NBD server, the blob client, the metadata server
//! and every tractserver in one process. Over the in-memory pipes of
//! `blizzard_env::LocalNet` each request was still framed, copied into the
//! pipe and out of it, read by the server's reader task and dispatched,
//! and its reply came back the same way: for a 4 KiB write at 3-way
//! replication, three copies of the payload per replica and a dozen task
//! hand-offs. Here [`serve`](crate::serve) attaches a [`LocalEndpoint`]
//! (its service, its sessions and its shutdown) to its listener's address,
//! and [`Conn::connect`](crate::Conn::connect) on that address hands each
//! request to the service as a value: the payload's `Bytes` reach the
//! store as they left the caller, and the reply's come back the same way.
//!
//! What stays as on a stream, so the servers cannot tell the difference:
//! - Each request runs as its own task, as `serve_conn` runs it: a caller
//!   that gives up (a timeout) does not cancel a change half-way.
//! - A `Hello` opens a session on the link, in order with the requests
//!   around it; every later request carries it ([`Caller`]), so a change
//!   from a link its client has since replaced is refused (`session`).
//! - Once the server shuts down, its links refuse new requests
//!   (`ConnectionLost`) and its address no longer resolves to it; requests
//!   already running finish, as they do on a stream.
//!
//! What a stream does that this does not: decode and bound the request
//! (it was built in this process, by code that also sends it over sockets,
//! so it is well-formed), and charge the connection's memory budget (the
//! caller's own limits bound what it has in flight).

use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};

use blizzard_env::Env;

use crate::conn::RpcError;
use crate::protocol::Protocol;
use crate::server::{Service, Shutdown};
use crate::session::{Caller, Sessions};

/// What a server attaches to its address for callers in its process.
pub(crate) struct LocalEndpoint<P: Protocol> {
    pub(crate) service: Arc<dyn Service<P>>,
    pub(crate) sessions: Arc<Sessions>,
    pub(crate) shutdown: Shutdown,
}

impl<P: Protocol> LocalEndpoint<P> {
    /// The endpoint of protocol `P` attached to `addr` in `env`'s net, if
    /// the server there is in this process and still running.
    pub(crate) fn find(env: &Env, addr: &str) -> Option<Arc<LocalEndpoint<P>>> {
        let ep = env.net.endpoint(addr)?.downcast::<LocalEndpoint<P>>().ok()?;
        (!ep.shutdown.is_triggered()).then_some(ep)
    }
}

/// One caller's link to a [`LocalEndpoint`]: what a connection is on a
/// stream.
pub(crate) struct LocalLink<P: Protocol> {
    endpoint: Arc<LocalEndpoint<P>>,
    /// Set by the link's `Hello`, as `serve_conn` sets a connection's.
    session: Mutex<Option<(u64, u64)>>,
}

impl<P: Protocol> LocalLink<P> {
    pub(crate) fn new(endpoint: Arc<LocalEndpoint<P>>) -> LocalLink<P> {
        LocalLink { endpoint, session: Mutex::new(None) }
    }

    /// Whether the server behind the link has shut down.
    pub(crate) fn is_closed(&self) -> bool {
        self.endpoint.shutdown.is_triggered()
    }

    /// Whether the service verified the data of its replies (its
    /// `Service::verifies_replies`), which reach the caller untouched.
    pub(crate) fn verifies_replies(&self) -> bool {
        self.endpoint.service.verifies_replies()
    }

    /// Runs `req` on the service (module docs); `more` follows `data`.
    pub(crate) async fn call(
        &self,
        addr: &str,
        req: &P::Request,
        data: Bytes,
        more: Vec<Bytes>,
    ) -> Result<(P::Reply, Bytes), RpcError> {
        let session = {
            let mut s = self.session.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((id, epoch, reply)) = P::session_hello(req) {
                self.endpoint.sessions.hello(id, epoch);
                *s = Some((id, epoch));
                return Ok((reply, Bytes::new()));
            }
            *s
        };
        let data = if more.is_empty() {
            data
        } else {
            // The stream sends the pieces from their own buffers; a service
            // takes one: joined here, the one copy this path makes.
            let mut joined = BytesMut::with_capacity(data.len() + more.iter().map(Bytes::len).sum::<usize>());
            joined.extend_from_slice(&data);
            for m in &more {
                joined.extend_from_slice(m);
            }
            joined.freeze()
        };
        let caller = Caller::new(session, self.endpoint.sessions.clone());
        let service = self.endpoint.service.clone();
        let running = tokio::spawn(service.call(req.clone(), data, caller));
        match running.await {
            Ok((Ok(reply), data)) => Ok((reply, data)),
            Ok((Err(reply), _)) => Err(RpcError::Remote { addr: addr.to_string(), reply }),
            // The handler panicked or its runtime is going away: as a
            // stream whose server died.
            Err(_) => Err(RpcError::ConnectionLost(addr.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Blob;
    use crate::server::{serve, ShutdownHandle};
    use crate::Conn;
    use blizzard_proto::{ErrorCode, ErrorReply, Reply, Request};
    use futures::future::BoxFuture;
    use futures::FutureExt;

    /// Echoes a `Ping`'s data back, refusing it when its caller is no
    /// longer current (as a change would be refused).
    struct Echo;

    impl Service<Blob> for Echo {
        fn call(
            self: Arc<Self>,
            _req: Request,
            data: Bytes,
            caller: Caller,
        ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
            async move {
                if caller.is_current() {
                    (Ok(Reply::Done), data)
                } else {
                    (
                        Err(ErrorReply::new(ErrorCode::Aborted, "a newer connection of this session")),
                        Bytes::new(),
                    )
                }
            }
            .boxed()
        }
    }

    /// On a `LocalNet`, a call reaches the service without a copy, a
    /// session's newer link fences the older one, and once the server
    /// shuts down its links refuse calls and its address stops resolving
    /// to it. Without a `LocalNet` the same calls go over the socket.
    #[tokio::test]
    async fn in_process_calls_skip_the_stream_and_keep_its_rules() -> Result<(), Box<dyn std::error::Error>> {
        let env = Env::real().with_local_net();
        let listener = env.bind("127.0.0.1:0").await?;
        let addr = listener.local_addr();
        let (stop, shutdown) = ShutdownHandle::new();
        let server =
            tokio::spawn(serve::<Blob>(env.clone(), listener, Arc::new(Echo), Default::default(), shutdown));
        // serve() attaches the endpoint once it runs.
        while env.net.endpoint(&addr).is_none() {
            tokio::task::yield_now().await;
        }

        let old = Conn::<Blob>::connect(&env, &addr).await?;
        old.call(&Request::Hello { session: 9, epoch: 1 }, Bytes::new()).await?;
        let data = Bytes::from(vec![5u8; 4096]);
        let (_, back) = old.call(&Request::Ping, data.clone()).await?;
        assert_eq!(back.as_ptr(), data.as_ptr(), "the payload was copied");

        let new = Conn::<Blob>::connect(&env, &addr).await?;
        new.call(&Request::Hello { session: 9, epoch: 2 }, Bytes::new()).await?;
        assert!(new.call(&Request::Ping, Bytes::new()).await.is_ok());
        let fenced = old.call(&Request::Ping, Bytes::new()).await;
        assert!(
            matches!(&fenced, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::Aborted),
            "{fenced:?}"
        );

        // Another process (a plain socket) still reaches the server.
        let socket = Conn::<Blob>::connect(&Env::real(), &addr).await?;
        let (_, back) = socket.call(&Request::Ping, data.clone()).await?;
        assert_eq!(back, data);
        assert_ne!(back.as_ptr(), data.as_ptr());

        stop.trigger();
        server.await?;
        assert!(matches!(new.call(&Request::Ping, Bytes::new()).await, Err(RpcError::ConnectionLost(_))));
        assert!(env.net.endpoint(&addr).is_none());
        assert!(Conn::<Blob>::connect(&env, &addr).await.is_err(), "nobody listens there any more");
        Ok(())
    }
}
