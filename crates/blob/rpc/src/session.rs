//! Client sessions and their epochs (`Request::Hello`).
//!
//! A client that gives up on a request (a timeout) closes the connection
//! and retries on a new one. The request it gave up on may still be
//! applied later: its bytes can sit in the network or in the server's
//! receive buffer, or the server may be slow to run it. Applied after the
//! client's next write to the same bytes, it would replace acknowledged
//! data with older data. So each client connection opens with a `Hello`
//! naming the client's session (random per client) and an epoch the client
//! raises whenever it reconnects after a failure; a server applies a change
//! only while the connection it came on is at the newest epoch it has seen
//! for that session ([`Caller::is_current`], checked under the lock that
//! orders the change against later ones). The client's retry, and every
//! later request, travel on a connection whose `Hello` came first, so by
//! the time they are applied the old connection's requests are refused.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use blizzard_env::Peer;

/// Sessions remembered per server; the oldest are forgotten beyond this.
/// A forgotten session's stale requests are no longer refused, so this is
/// far above the number of clients a server talks to within the time a
/// stale request can linger.
pub const SESSIONS_MAX: usize = 1 << 16;

/// The newest epoch seen per session, shared by every connection a server
/// accepted.
#[derive(Default)]
pub struct Sessions {
    inner: Mutex<SessionTable>,
}

#[derive(Default)]
struct SessionTable {
    newest: HashMap<u64, u64>,
    /// Sessions in the order first seen, for forgetting the oldest.
    order: VecDeque<u64>,
}

impl Sessions {
    fn table(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Records that a connection of `session` opened at `epoch`.
    pub fn hello(&self, session: u64, epoch: u64) {
        let mut t = self.table();
        match t.newest.get_mut(&session) {
            Some(e) => *e = (*e).max(epoch),
            None => {
                if t.order.len() >= SESSIONS_MAX {
                    if let Some(old) = t.order.pop_front() {
                        t.newest.remove(&old);
                    }
                }
                t.newest.insert(session, epoch);
                t.order.push_back(session);
            }
        }
    }

    fn newest(&self, session: u64) -> Option<u64> {
        self.table().newest.get(&session).copied()
    }
}

/// Who sent a request, as far as fencing goes.
#[derive(Clone)]
pub struct Caller {
    /// (session, epoch) from the connection's `Hello`; none for peers that
    /// do not open with one (other servers, old tools).
    session: Option<(u64, u64)>,
    sessions: Arc<Sessions>,
    /// The peer its connection's TLS authenticated (`blizzard_tls::TlsNet`);
    /// none on a plain or in-process connection.
    peer: Option<Arc<Peer>>,
}

impl Caller {
    pub fn new(session: Option<(u64, u64)>, sessions: Arc<Sessions>) -> Caller {
        Caller { session, sessions, peer: None }
    }

    /// This caller, as the authenticated `peer` (`authz` checks its role).
    pub fn with_peer(mut self, peer: Option<Arc<Peer>>) -> Caller {
        self.peer = peer;
        self
    }

    /// The peer the connection authenticated, if it did.
    pub fn peer(&self) -> Option<&Peer> {
        self.peer.as_deref()
    }

    /// A caller that is always current (requests made inside a server).
    pub fn internal() -> Caller {
        Caller { session: None, sessions: Arc::new(Sessions::default()), peer: None }
    }

    /// The (session, epoch) of the connection the request came on.
    pub fn session(&self) -> Option<(u64, u64)> {
        self.session
    }

    /// The caller a forwarded request acts for (`WriteTractForward`): the
    /// client connection's session and epoch at the server that forwarded
    /// it, recorded here as a `Hello` would be. A forwarded copy the
    /// client gave up on is then refused once the client's retry, direct
    /// or forwarded, was seen at a newer epoch, exactly as a direct one.
    pub fn on_behalf(&self, session: u64, epoch: u64) -> Caller {
        self.sessions.hello(session, epoch);
        Caller { session: Some((session, epoch)), sessions: self.sessions.clone(), peer: self.peer.clone() }
    }

    /// Whether no newer connection of this caller's session has been seen:
    /// a change from it may be applied.
    pub fn is_current(&self) -> bool {
        match self.session {
            None => true,
            Some((s, e)) => self.sessions.newest(s).is_none_or(|n| n <= e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_epoch_fences_older_connections_of_its_session_only() {
        let s = Arc::new(Sessions::default());
        s.hello(1, 1);
        s.hello(2, 5);
        let old = Caller::new(Some((1, 1)), s.clone());
        let other = Caller::new(Some((2, 5)), s.clone());
        assert!(old.is_current() && other.is_current());
        s.hello(1, 2);
        assert!(!old.is_current(), "epoch 1 must be fenced once epoch 2 said hello");
        assert!(Caller::new(Some((1, 2)), s.clone()).is_current());
        assert!(other.is_current());
        // A late hello from the old epoch does not undo the fence.
        s.hello(1, 1);
        assert!(!old.is_current());
        assert!(Caller::internal().is_current());
    }

    /// A forwarded copy acts for the client's session: it is fenced by a
    /// newer epoch of that session seen directly, and it fences older ones.
    #[test]
    fn a_forwarded_request_is_fenced_by_its_clients_session() {
        let s = Arc::new(Sessions::default());
        let peer = Caller::new(Some((99, 1)), s.clone()); // the forwarding server's connection
        let fwd = peer.on_behalf(7, 3);
        assert!(fwd.is_current());
        assert!(!Caller::new(Some((7, 2)), s.clone()).is_current(), "the forwarded epoch fences older ones");
        s.hello(7, 4);
        assert!(!fwd.is_current(), "a newer direct connection fences the forwarded copy");
        assert!(peer.is_current(), "the forwarding server's own session is not touched");
        assert_eq!(fwd.session(), Some((7, 3)));
    }

    #[test]
    fn the_table_is_bounded() {
        let s = Sessions::default();
        for i in 0..(SESSIONS_MAX as u64 + 10) {
            s.hello(i, 1);
        }
        assert_eq!(s.table().newest.len(), SESSIONS_MAX);
        assert!(s.newest(0).is_none() && s.newest(SESSIONS_MAX as u64 + 9).is_some());
    }
}
