//! Receiver-driven flow control for large transfers (FDS §4, RTS/CTS).
//!
//! When many peers send large requests to one server at once (clients
//! writing whole tracts, newcomers and writers during recovery), their
//! bytes meet at the server's link. Sent all at once they queue there
//! together, every flow's window deep, and a 4 KiB request that arrives
//! behind them waits for all of it. So a caller does not send a request
//! whose data part is at least [`LARGE_TRANSFER_MIN`] bytes: it sends a
//! *request-to-send* (a frame of kind `Rts` with the request's id, opcode
//! and data length), and sends the request itself when the server answers
//! with a *clear-to-send* (kind `Cts`, the same id). The server clears a
//! bounded number of bytes at a time ([`FlowLimits::window_bytes`]), so
//! at most that much large data is on its way in at once, and small
//! requests (which never ask) queue behind at most a window's worth.
//!
//! The server's side is [`GrantQueue`], a pure state machine (asks and
//! releases in, grants out) behind [`Grants`], one per listener. Grants go
//! round robin over connections, first come first served within one, and
//! a grant is never skipped for a smaller one behind it (no starvation of
//! large requests). A grant is held from its clear-to-send until the
//! request's whole frame has been read (its bytes crossed the link), the
//! connection ends, or [`FlowLimits::grant_timeout`] passes unused.
//!
//! Invariants:
//! - Bytes granted and not yet released never exceed the window, except
//!   that one request is always admitted when nothing is granted (a
//!   request larger than the window still goes, alone).
//! - Queued asks are bounded server-wide and per connection; an ask past
//!   either bound is refused with `Busy` (the caller retries after a
//!   pause), so a flood of requests-to-send cannot grow memory.
//! - Every grant is released exactly once (`Held` drops it), whether the
//!   request came, its connection ended or the grant timed out.
//!
//! The flow control is advice between well-behaved peers: a request that
//! arrives without a grant is served as before (its bytes are already
//! here). In-process calls (`local`) have no link to protect and skip it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

/// Requests whose data part is at least this large ask before they send.
/// A request-to-send costs a round trip (about 100 µs in a datacenter):
/// 6% of a 2 MiB transfer at 10 Gbit/s, 1.5% of a default 8 MiB tract,
/// and it overlaps other transfers when a caller keeps several requests in
/// flight. Below it stay every volume block (1 MiB at most) and the 1 MiB
/// requests NBD clients and fio favour, which would pay 12%, and every
/// metadata and control message: they never wait for a grant. Still well
/// under the smallest tract sizes clusters use (4 MiB and up), so whole
/// tracts and copies ask. FDS's messages are bimodal (tracts, or a few
/// KiB); this is the line between the two.
pub const LARGE_TRANSFER_MIN: u32 = 2 << 20;

/// Default bytes cleared to send into one server at once: two default
/// tracts. Two, so the link stays busy while the next grant's
/// clear-to-send travels (one would idle the link for a round trip per
/// tract); no more, so a small request queues behind at most this much
/// (16 MiB is 13 ms at 10 Gbit/s, against 16 senders' whole windows).
pub const GRANT_WINDOW_DEFAULT: u64 = 16 << 20;

/// Requests-to-send one server queues at most, over all its connections.
pub const RTS_QUEUED_MAX: usize = 4096;

/// Requests-to-send one connection may have queued or granted at once
/// (its caller's own send queue is 256 frames deep).
pub const RTS_PER_CONN_MAX: usize = 256;

const _: () = assert!(RTS_PER_CONN_MAX <= RTS_QUEUED_MAX);
const _: () = assert!(GRANT_WINDOW_DEFAULT >= LARGE_TRANSFER_MIN as u64);

/// A server's flow-control settings (part of `ServerLimits`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowLimits {
    /// Bytes of large requests cleared to send and not yet received, at
    /// most. `None` clears every request-to-send at once: no scheduling
    /// (only for comparison; the simulator's experiment runs both).
    pub window_bytes: Option<u64>,
    /// Asks queued at once, server-wide and per connection.
    pub queued_max: usize,
    pub queued_per_conn_max: usize,
    /// A grant whose request has not arrived by then is taken back (a
    /// caller that gave up, a stalled peer), so it cannot pin the window.
    pub grant_timeout: Duration,
}

impl Default for FlowLimits {
    fn default() -> Self {
        FlowLimits {
            window_bytes: Some(GRANT_WINDOW_DEFAULT),
            queued_max: RTS_QUEUED_MAX,
            queued_per_conn_max: RTS_PER_CONN_MAX,
            grant_timeout: Duration::from_secs(10),
        }
    }
}

/// A request-to-send: connection, request id, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub conn: u64,
    pub id: u64,
    pub bytes: u64,
}

/// Why an ask was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The server's queue is full.
    ServerQueueFull,
    /// This connection has as many asks queued or granted as it may.
    ConnQueueFull,
    /// The connection already asked with this id.
    Duplicate,
}

impl Refusal {
    pub(crate) fn message(self) -> &'static str {
        match self {
            Refusal::ServerQueueFull => "too many requests waiting for clear-to-send on this server",
            Refusal::ConnQueueFull => "too many requests waiting for clear-to-send on this connection",
            Refusal::Duplicate => "a request-to-send with this id is already waiting",
        }
    }
}

/// The grant schedule: pure, no I/O, no time.
#[derive(Debug)]
pub(crate) struct GrantQueue {
    limits: FlowLimits,
    /// Bytes granted and not released.
    granted: u64,
    /// Per connection, its asks in arrival order.
    queues: BTreeMap<u64, VecDeque<Ask>>,
    queued: usize,
    /// Per connection, asks queued or granted (bounded by
    /// `queued_per_conn_max`).
    open: BTreeMap<u64, usize>,
    /// The connection granted last: the round robin goes on after it.
    last: Option<u64>,
}

impl GrantQueue {
    pub(crate) fn new(limits: FlowLimits) -> GrantQueue {
        GrantQueue {
            limits,
            granted: 0,
            queues: BTreeMap::new(),
            queued: 0,
            open: BTreeMap::new(),
            last: None,
        }
    }

    #[cfg(test)]
    pub(crate) fn granted_bytes(&self) -> u64 {
        self.granted
    }

    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        self.queued
    }

    fn fits(&self, bytes: u64) -> bool {
        match self.limits.window_bytes {
            None => true,
            Some(w) => self.granted == 0 || self.granted.saturating_add(bytes) <= w,
        }
    }

    /// Queues `ask`, then grants what the window allows; returns the
    /// grants made (possibly `ask` itself).
    pub(crate) fn ask(&mut self, ask: Ask) -> Result<Vec<Ask>, Refusal> {
        if self.queues.get(&ask.conn).is_some_and(|q| q.iter().any(|a| a.id == ask.id)) {
            return Err(Refusal::Duplicate);
        }
        if self.queued >= self.limits.queued_max {
            return Err(Refusal::ServerQueueFull);
        }
        let open = self.open.entry(ask.conn).or_default();
        if *open >= self.limits.queued_per_conn_max {
            return Err(Refusal::ConnQueueFull);
        }
        *open += 1;
        self.queues.entry(ask.conn).or_default().push_back(ask);
        self.queued += 1;
        Ok(self.pump())
    }

    /// A grant ended (its request arrived, its connection closed, it
    /// timed out): its bytes return to the window. Returns the grants
    /// that makes.
    pub(crate) fn release(&mut self, ask: Ask) -> Vec<Ask> {
        debug_assert!(self.granted >= ask.bytes, "released more than granted");
        self.granted = self.granted.saturating_sub(ask.bytes);
        self.close(ask.conn);
        self.pump()
    }

    /// Removes a queued ask that will not be needed (its request came
    /// anyway, its connection ended). Returns whether it was queued, and
    /// the grants its removal makes.
    pub(crate) fn cancel(&mut self, conn: u64, id: u64) -> (bool, Vec<Ask>) {
        let Some(q) = self.queues.get_mut(&conn) else { return (false, Vec::new()) };
        let Some(i) = q.iter().position(|a| a.id == id) else { return (false, Vec::new()) };
        q.remove(i);
        if q.is_empty() {
            self.queues.remove(&conn);
        }
        self.queued -= 1;
        self.close(conn);
        (true, self.pump())
    }

    fn close(&mut self, conn: u64) {
        if let Some(n) = self.open.get_mut(&conn) {
            *n -= 1;
            if *n == 0 {
                self.open.remove(&conn);
            }
        }
    }

    /// The connection whose turn it is: the first with an ask after the
    /// one granted last, wrapping around.
    fn next_conn(&self) -> Option<u64> {
        let after = self.last.map_or(0, |c| c.saturating_add(1));
        self.queues.range(after..).next().or_else(|| self.queues.iter().next()).map(|(c, _)| *c)
    }

    fn pump(&mut self) -> Vec<Ask> {
        let mut out = Vec::new();
        while let Some(conn) = self.next_conn() {
            let Some(head) = self.queues.get(&conn).and_then(|q| q.front().copied()) else { break };
            // Strict turns: a later, smaller ask never passes one that
            // does not fit yet, so a large request cannot starve.
            if !self.fits(head.bytes) {
                break;
            }
            if let Some(q) = self.queues.get_mut(&conn) {
                q.pop_front();
                if q.is_empty() {
                    self.queues.remove(&conn);
                }
            }
            self.queued -= 1;
            self.granted = self.granted.saturating_add(head.bytes);
            self.last = Some(conn);
            out.push(head);
        }
        out
    }
}

/// One server's grants: the [`GrantQueue`] and the callers waiting on it.
pub struct Grants {
    limits: FlowLimits,
    inner: Mutex<GrantState>,
}

struct GrantState {
    queue: GrantQueue,
    /// Per queued ask, where its grant is delivered.
    waiting: BTreeMap<(u64, u64), oneshot::Sender<()>>,
    next_conn: u64,
}

impl Grants {
    pub fn new(limits: FlowLimits) -> Grants {
        Grants {
            inner: Mutex::new(GrantState {
                queue: GrantQueue::new(limits.clone()),
                waiting: BTreeMap::new(),
                next_conn: 0,
            }),
            limits,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, GrantState> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub(crate) fn limits(&self) -> &FlowLimits {
        &self.limits
    }

    /// A number for a new connection.
    pub(crate) fn conn_id(&self) -> u64 {
        let mut s = self.lock();
        s.next_conn += 1;
        s.next_conn
    }

    /// Queues an ask; the receiver resolves once it is granted.
    pub(crate) fn ask(&self, ask: Ask) -> Result<oneshot::Receiver<()>, Refusal> {
        let (tx, rx) = oneshot::channel();
        let mut s = self.lock();
        if s.waiting.contains_key(&(ask.conn, ask.id)) {
            return Err(Refusal::Duplicate);
        }
        let granted = s.queue.ask(ask)?;
        s.waiting.insert((ask.conn, ask.id), tx);
        Self::deliver(&mut s, granted);
        Ok(rx)
    }

    /// Returns a held grant's bytes to the window.
    pub(crate) fn release(&self, ask: Ask) {
        let mut s = self.lock();
        let granted = s.queue.release(ask);
        Self::deliver(&mut s, granted);
    }

    /// Withdraws a queued ask (see `GrantQueue::cancel`); false if it was
    /// not queued (already granted, or never asked).
    pub(crate) fn cancel(&self, conn: u64, id: u64) -> bool {
        let mut s = self.lock();
        s.waiting.remove(&(conn, id));
        let (was, granted) = s.queue.cancel(conn, id);
        Self::deliver(&mut s, granted);
        was
    }

    /// Hands grants to their waiters. A waiter that is gone (its task
    /// ended) gives its grant straight back, which may grant others.
    fn deliver(s: &mut GrantState, mut granted: Vec<Ask>) {
        while let Some(g) = granted.pop() {
            let delivered = s.waiting.remove(&(g.conn, g.id)).is_some_and(|tx| tx.send(()).is_ok());
            if !delivered {
                granted.extend(s.queue.release(g));
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn granted_bytes(&self) -> u64 {
        self.lock().queue.granted_bytes()
    }
}

/// A grant held by a connection's task; dropping it releases the bytes.
pub(crate) struct Held {
    pub grants: Arc<Grants>,
    pub ask: Ask,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.grants.release(self.ask);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(window: Option<u64>) -> FlowLimits {
        FlowLimits { window_bytes: window, queued_max: 8, queued_per_conn_max: 3, ..FlowLimits::default() }
    }

    fn ask(conn: u64, id: u64, bytes: u64) -> Ask {
        Ask { conn, id, bytes }
    }

    fn ids(v: &[Ask]) -> Vec<(u64, u64)> {
        v.iter().map(|a| (a.conn, a.id)).collect()
    }

    // The window bounds granted bytes; releases grant the next in turn.
    #[test]
    fn the_window_bounds_what_is_granted() -> Result<(), Refusal> {
        let mut q = GrantQueue::new(limits(Some(16)));
        assert_eq!(ids(&q.ask(ask(1, 1, 8))?), [(1, 1)]);
        assert_eq!(ids(&q.ask(ask(2, 1, 8))?), [(2, 1)]);
        assert!(q.ask(ask(3, 1, 8))?.is_empty(), "a third would exceed the window");
        assert_eq!(q.granted_bytes(), 16);
        assert_eq!(ids(&q.release(ask(1, 1, 8))), [(3, 1)]);
        assert_eq!(q.granted_bytes(), 16);
        assert!(q.release(ask(2, 1, 8)).is_empty());
        assert!(q.release(ask(3, 1, 8)).is_empty());
        assert_eq!((q.granted_bytes(), q.queued()), (0, 0));
        Ok(())
    }

    // One request larger than the window still goes, alone.
    #[test]
    fn an_oversized_request_goes_alone() -> Result<(), Refusal> {
        let mut q = GrantQueue::new(limits(Some(4)));
        assert_eq!(ids(&q.ask(ask(1, 1, 10))?), [(1, 1)]);
        assert!(q.ask(ask(1, 2, 1))?.is_empty());
        assert_eq!(ids(&q.release(ask(1, 1, 10))), [(1, 2)]);
        Ok(())
    }

    // Turns go round robin over connections, not in arrival order, and a
    // small ask never passes a large one that waits for room.
    #[test]
    fn turns_are_round_robin_and_strict() -> Result<(), Refusal> {
        let mut q = GrantQueue::new(limits(Some(8)));
        assert_eq!(ids(&q.ask(ask(1, 1, 8))?), [(1, 1)]);
        for id in 2..=3 {
            assert!(q.ask(ask(1, id, 8))?.is_empty());
        }
        assert!(q.ask(ask(2, 1, 8))?.is_empty());
        assert!(q.ask(ask(3, 1, 1))?.is_empty(), "the small ask waits its turn");
        // After conn 1's grant, conn 2 then conn 3 go before conn 1 again.
        assert_eq!(ids(&q.release(ask(1, 1, 8))), [(2, 1)]);
        assert_eq!(ids(&q.release(ask(2, 1, 8))), [(3, 1)]);
        // Conn 3's 1 byte leaves 7: conn 1's 8 waits, and holds its turn.
        assert!(q.ask(ask(3, 2, 1))?.is_empty());
        assert_eq!(ids(&q.release(ask(3, 1, 1))), [(1, 2)]);
        Ok(())
    }

    // Queues are bounded per connection and server-wide; duplicates are
    // refused; cancelling frees the slot and may grant others.
    #[test]
    fn asks_are_bounded() -> Result<(), Refusal> {
        let mut q = GrantQueue::new(limits(Some(1)));
        assert_eq!(q.ask(ask(1, 1, 1))?.len(), 1);
        q.ask(ask(1, 2, 1))?;
        assert_eq!(q.ask(ask(1, 2, 1)), Err(Refusal::Duplicate));
        q.ask(ask(1, 3, 1))?;
        assert_eq!(q.ask(ask(1, 4, 1)), Err(Refusal::ConnQueueFull), "granted ones count too");
        for c in 2..=7 {
            q.ask(ask(c, 1, 1))?;
        }
        assert_eq!(q.queued(), 8);
        assert_eq!(q.ask(ask(9, 1, 1)), Err(Refusal::ServerQueueFull));
        assert_eq!(q.cancel(5, 1), (true, Vec::new()));
        assert_eq!(q.cancel(5, 1), (false, Vec::new()));
        q.ask(ask(9, 1, 1))?;
        // A release lets conn 1 ask again.
        assert_eq!(ids(&q.release(ask(1, 1, 1))), [(2, 1)]);
        q.ask(ask(1, 4, 1))?;
        Ok(())
    }

    // Without a window every ask is granted at once.
    #[test]
    fn no_window_grants_everything() -> Result<(), Refusal> {
        let mut q = GrantQueue::new(limits(None));
        for c in 1..=5 {
            assert_eq!(q.ask(ask(c, 1, 1 << 30))?.len(), 1);
        }
        Ok(())
    }

    // A grant whose waiter is gone comes straight back and goes to the
    // next ask; a held grant is released when dropped.
    #[test]
    fn grants_to_departed_waiters_are_returned() -> Result<(), Refusal> {
        let g = Arc::new(Grants::new(limits(Some(8))));
        let mut first = g.ask(ask(1, 1, 8))?;
        assert!(first.try_recv().is_ok());
        let gone = g.ask(ask(2, 1, 8))?;
        let mut third = g.ask(ask(3, 1, 8))?;
        drop(gone);
        drop(Held { grants: g.clone(), ask: ask(1, 1, 8) });
        assert!(third.try_recv().is_ok(), "the grant went past the departed waiter");
        assert_eq!(g.granted_bytes(), 8);
        assert!(!g.cancel(3, 1), "already granted");
        drop(Held { grants: g.clone(), ask: ask(3, 1, 8) });
        assert_eq!(g.granted_bytes(), 0);
        Ok(())
    }
}
