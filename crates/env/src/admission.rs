//! Connections a server has accepted but does not trust yet: a TLS
//! handshake not finished, an NBD negotiation not done, an HTTP request
//! not read (issue 56). Peers that connect and then stall, trickle bytes
//! or vanish must never delay anyone else, so such a connection costs a
//! little memory and holds no place in a queue: nothing waits for a slot.
//! Instead, when the table is full, a pending connection is dropped to
//! make room: the oldest **silent** one (it has sent nothing yet), and
//! only when none is silent, the oldest that has been **heard**. Every
//! legitimate client speaks at once (a TLS ClientHello, NBD's flags, an
//! HTTP request line), so idle peers, however many, only ever push out
//! each other; a peer that trickles bytes competes only with the few
//! that speak, within the bound.
//!
//! | event | the table | what happens |
//! |---|---|---|
//! | a connection from source S arrives; S has fewer than `per_source_max` pending, the table fewer than `pending_max` | S's entry added, silent | it runs its handshake |
//! | ... S already has `per_source_max` pending | added; S's oldest silent one evicted, else S's oldest | that connection is closed |
//! | ... the table holds `pending_max` | added; the oldest silent one of all evicted, else the oldest | as above |
//! | the peer's first bytes arrive | the entry marked heard | evicted only after every silent one |
//! | the handshake finishes, fails or its task ends | the entry removed | nothing: the connection is trusted, or closed by its task |
//! | it takes longer than `deadline` | removed | the connection is closed (`NotAdmitted::TimedOut`) |
//! | `accept` fails for want of descriptors | the oldest silent one evicted, else the oldest | its descriptor comes free for the next accept |
//!
//! A source is the peer's address without its port (one unix socket's
//! peers share one source). Bounding each source keeps one host from
//! pushing out every other host's handshakes; on loopback, where attacker
//! and legitimate client share an address, the eviction of the oldest is
//! what lets the legitimate client through.
//!
//! The table is pure ([`Table`]); [`Admission`] is its shell: a lock, the
//! signals that close evicted connections, and counts for `/metrics`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sync::{lock, Flag};
use crate::Clock;

/// Bounds on connections not yet trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Pending connections at once, from every source.
    pub pending_max: usize,
    /// Pending connections at once from one source address.
    pub per_source_max: usize,
    /// How long one may stay pending.
    pub deadline: Duration,
}

impl AdmissionLimits {
    /// Bounds for a handshake that needs `deadline` at most: 4,096
    /// pending (a task and a socket each until they speak, under 1 KiB of
    /// memory), 1,024 per source.
    pub const fn with_deadline(deadline: Duration) -> AdmissionLimits {
        AdmissionLimits { pending_max: 4096, per_source_max: 1024, deadline }
    }
}

/// Why a pending connection was given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAdmitted {
    /// Newer connections needed its place (module header).
    Evicted,
    /// It did not finish within the deadline.
    TimedOut(Duration),
}

impl std::fmt::Display for NotAdmitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotAdmitted::Evicted => {
                write!(f, "dropped unfinished to make room for newer connections (too many pending)")
            }
            NotAdmitted::TimedOut(d) => write!(f, "not finished within {d:?}"),
        }
    }
}

/// The source of a peer address: `host:port` without the port (IPv6
/// brackets kept off), anything else (a unix socket's peer) as one
/// source.
pub fn source_of(peer: &str) -> &str {
    if let Some(rest) = peer.strip_prefix('[') {
        if let Some((host, _)) = rest.split_once(']') {
            return host;
        }
    }
    match peer.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ if peer.is_empty() || peer.starts_with("unix") => "unix",
        _ => peer,
    }
}

/// The pending connections (pure: the module header's table). `T` is what
/// the shell keeps per entry.
#[derive(Debug)]
pub struct Table<T> {
    next_id: u64,
    /// By id; ids only grow, so the smallest is the oldest.
    entries: BTreeMap<u64, Entry<T>>,
    /// Per source, its silent and its heard entries.
    by_source: HashMap<String, [BTreeSet<u64>; 2]>,
    /// Every silent entry.
    silent: BTreeSet<u64>,
}

#[derive(Debug)]
struct Entry<T> {
    source: String,
    heard: bool,
    value: T,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table { next_id: 1, entries: BTreeMap::new(), by_source: HashMap::new(), silent: BTreeSet::new() }
    }
}

impl<T> Table<T> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Pending connections from `source`.
    pub fn of_source(&self, source: &str) -> usize {
        self.by_source.get(source).map_or(0, |[s, h]| s.len() + h.len())
    }

    /// Adds a silent connection from `source`; returns its id and the
    /// entries evicted to make room.
    pub fn admit(&mut self, source: &str, value: T, limits: &AdmissionLimits) -> (u64, Vec<(u64, T)>) {
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(id, Entry { source: source.to_string(), heard: false, value });
        self.by_source.entry(source.to_string()).or_default()[0].insert(id);
        self.silent.insert(id);
        let mut evicted = Vec::new();
        // The newcomer itself is never the one to go: it has had no time
        // to speak yet.
        let not_new = |ids: &BTreeSet<u64>| ids.iter().copied().find(|v| *v != id);
        while self.of_source(source) > limits.per_source_max.max(1) {
            let Some(victim) =
                self.by_source.get(source).and_then(|[s, h]| not_new(s).or_else(|| not_new(h)))
            else {
                break;
            };
            evicted.extend(self.remove(victim).map(|v| (victim, v)));
        }
        while self.entries.len() > limits.pending_max.max(1) {
            let oldest = self.entries.keys().copied().find(|v| *v != id);
            let Some(victim) = not_new(&self.silent).or(oldest) else { break };
            evicted.extend(self.remove(victim).map(|v| (victim, v)));
        }
        (id, evicted)
    }

    /// The entry to evict first: the oldest silent one, else the oldest.
    pub fn victim(&self) -> Option<u64> {
        self.silent.first().or(self.entries.keys().next()).copied()
    }

    /// Entry `id`'s peer has sent its first bytes.
    pub fn hear(&mut self, id: u64) {
        let Some(e) = self.entries.get_mut(&id) else { return };
        if e.heard {
            return;
        }
        e.heard = true;
        self.silent.remove(&id);
        if let Some([s, h]) = self.by_source.get_mut(&e.source) {
            s.remove(&id);
            h.insert(id);
        }
    }

    /// Takes entry `id` out (it finished, failed or was evicted).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let e = self.entries.remove(&id)?;
        self.silent.remove(&id);
        if let Some(sets) = self.by_source.get_mut(&e.source) {
            sets[e.heard as usize].remove(&id);
            if sets.iter().all(|s| s.is_empty()) {
                self.by_source.remove(&e.source);
            }
        }
        Some(e.value)
    }
}

/// Counts since the listener started, for `/metrics` and the log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmissionCounts {
    pub admitted: u64,
    pub evicted: u64,
    pub timed_out: u64,
    /// Pending now.
    pub pending: u64,
}

/// One listener's pending connections (module header).
pub struct Admission {
    limits: AdmissionLimits,
    table: Mutex<Table<Arc<Flag>>>,
    admitted: AtomicU64,
    evicted: AtomicU64,
    timed_out: AtomicU64,
}

/// A connection's place in the table; dropping it takes it out.
pub struct Pending {
    id: u64,
    admission: Arc<Admission>,
    evict: Arc<Flag>,
}

impl Pending {
    /// Resolves once newer connections pushed this one out.
    pub async fn evicted(&self) {
        self.evict.wait().await
    }

    /// The peer has sent its first bytes: it is evicted only after every
    /// silent connection.
    pub fn heard(&self) {
        lock(&self.admission.table).hear(self.id);
    }

    /// Runs `handshake` (which may call [`Pending::heard`] on this) until
    /// it ends, this connection is evicted, or the deadline passes.
    pub async fn run<F: Future>(&self, clock: &dyn Clock, handshake: F) -> Result<F::Output, NotAdmitted> {
        let deadline = clock.sleep(self.admission.limits.deadline);
        tokio::select! {
            biased;
            _ = self.evicted() => Err(NotAdmitted::Evicted),
            out = handshake => Ok(out),
            _ = deadline => {
                self.admission.timed_out.fetch_add(1, Ordering::Relaxed);
                Err(NotAdmitted::TimedOut(self.admission.limits.deadline))
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        lock(&self.admission.table).remove(self.id);
    }
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            table: Mutex::new(Table::default()),
            admitted: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
        })
    }

    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// Enters a connection from `peer` (an address as `accept` gave it).
    pub fn admit(self: &Arc<Self>, peer: &str) -> Pending {
        let evict = Arc::new(Flag::new());
        let (id, evicted) = lock(&self.table).admit(source_of(peer), evict.clone(), &self.limits);
        self.admitted.fetch_add(1, Ordering::Relaxed);
        self.push_out(evicted);
        Pending { id, admission: self.clone(), evict }
    }

    fn push_out(&self, evicted: Vec<(u64, Arc<Flag>)>) {
        if evicted.is_empty() {
            return;
        }
        self.evicted.fetch_add(evicted.len() as u64, Ordering::Relaxed);
        for (_, flag) in evicted {
            flag.set();
        }
    }

    /// Evicts one pending connection, the oldest silent one if any (an
    /// `accept` failed for want of descriptors); false if none is pending.
    pub fn evict_one(&self) -> bool {
        let evicted = {
            let mut t = lock(&self.table);
            t.victim().and_then(|id| t.remove(id).map(|f| (id, f)))
        };
        let any = evicted.is_some();
        self.push_out(evicted.into_iter().collect());
        any
    }

    pub fn counts(&self) -> AdmissionCounts {
        AdmissionCounts {
            admitted: self.admitted.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
            pending: lock(&self.table).len() as u64,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn limits(pending_max: usize, per_source_max: usize) -> AdmissionLimits {
        AdmissionLimits { pending_max, per_source_max, deadline: Duration::from_secs(1) }
    }

    fn ids(evicted: Vec<(u64, ())>) -> Vec<u64> {
        evicted.into_iter().map(|(id, ())| id).collect()
    }

    #[test]
    fn sources_are_addresses_without_ports() {
        assert_eq!(source_of("10.0.0.1:5555"), "10.0.0.1");
        assert_eq!(source_of("[::1]:7000"), "::1");
        assert_eq!(source_of("[fe80::1%eth0]:1"), "fe80::1%eth0");
        assert_eq!(source_of(""), "unix");
        assert_eq!(source_of("unix:/run/x.sock"), "unix");
        assert_eq!(source_of("somehost"), "somehost");
    }

    /// Row 1: under both bounds, nothing is evicted.
    #[test]
    fn under_the_bounds_nothing_is_evicted() {
        let mut t = Table::default();
        let l = limits(4, 2);
        for s in ["a", "a", "b", "c"] {
            let (_, ev) = t.admit(s, (), &l);
            assert!(ev.is_empty());
        }
        assert_eq!(t.len(), 4);
        assert_eq!(t.of_source("a"), 2);
    }

    /// Row 2: a source over its bound loses its own oldest silent entry,
    /// never another source's, and a heard one only when none is silent.
    #[test]
    fn a_source_over_its_bound_loses_its_own_oldest_silent_entry() {
        let mut t = Table::default();
        let l = limits(100, 2);
        let (b1, _) = t.admit("b", (), &l);
        let (a1, _) = t.admit("a", (), &l);
        t.hear(a1);
        let (a2, _) = t.admit("a", (), &l);
        let (a3, ev) = t.admit("a", (), &l);
        assert_eq!(ids(ev), vec![a2], "the silent one goes, not the older heard one");
        assert_eq!(t.of_source("a"), 2);
        assert_eq!(t.of_source("b"), 1, "the other source keeps {b1}");
        t.hear(a3);
        let (_, ev) = t.admit("a", (), &l);
        assert_eq!(ids(ev), vec![a1], "all heard: the oldest goes");
    }

    /// Row 3: a full table loses its oldest silent entry, whichever
    /// source; with none silent, its oldest.
    #[test]
    fn a_full_table_loses_its_oldest_silent_entry() {
        let mut t = Table::default();
        let l = limits(3, 3);
        let (x, _) = t.admit("x", (), &l);
        let (y, _) = t.admit("y", (), &l);
        t.admit("z", (), &l);
        t.hear(x);
        let (newest, ev) = t.admit("w", (), &l);
        assert_eq!(ids(ev), vec![y]);
        assert_eq!(t.len(), 3);
        assert_eq!(t.of_source("y"), 0);
        assert!(t.remove(newest).is_some(), "the newest is never the one evicted");
        let mut t = Table::default();
        let (x, _) = t.admit("x", (), &l);
        for _ in 0..2 {
            let (id, _) = t.admit("y", (), &l);
            t.hear(id);
        }
        t.hear(x);
        let (_, ev) = t.admit("w", (), &l);
        assert_eq!(ids(ev), vec![x], "no silent entry: the oldest heard one goes");
    }

    /// Row 4 (first bytes) is in rows 2 and 3; row 5: finishing takes the
    /// entry out, once.
    #[test]
    fn finishing_frees_the_place() {
        let mut t = Table::default();
        let l = limits(1, 1);
        let (a, _) = t.admit("a", (), &l);
        t.hear(a);
        assert!(t.remove(a).is_some());
        assert!(t.remove(a).is_none());
        t.hear(a);
        let (_, ev) = t.admit("a", (), &l);
        assert!(ev.is_empty(), "the finished one left room");
        assert_eq!(t.victim(), Some(a + 1));
    }

    /// The attack of issue 56, on loopback where every peer shares one
    /// address: thousands of idle connections, a few hundred that trickle
    /// bytes, and legitimate clients among them. No legitimate client is
    /// ever evicted, and the table stays within its bounds.
    #[test]
    fn idle_and_trickling_peers_never_push_out_a_client_that_spoke() {
        let mut t = Table::default();
        let l = AdmissionLimits::with_deadline(Duration::from_secs(3));
        let mut clients = Vec::new();
        for i in 0..20_000u64 {
            let (id, ev) = t.admit("127.0.0.1", (), &l);
            for (e, ()) in &ev {
                assert!(!clients.contains(e), "client {e} evicted at step {i}");
            }
            // Every 50th trickles a byte (heard), every 500th is a client
            // that finishes 20 steps later.
            if i % 50 == 0 {
                t.hear(id);
            }
            if i % 500 == 0 {
                clients.push(id);
            }
            if i % 500 == 20 {
                let done = clients.remove(0);
                assert!(t.remove(done).is_some(), "client {done} was still pending");
            }
            assert!(t.len() <= l.per_source_max);
        }
    }

    /// Rows 6 and 7 through the shell: an evicted handshake ends at once,
    /// a stalled one at its deadline, a finished one frees its place, and
    /// a failed accept evicts a silent one.
    #[tokio::test(start_paused = true)]
    async fn the_shell_evicts_times_out_and_frees() {
        let clock = crate::RealClock;
        let adm = Admission::new(limits(2, 2));
        let never = std::future::pending::<()>;
        // Two stalled handshakes fill the table; a third evicts the first.
        let first = tokio::spawn({
            let adm = adm.clone();
            async move { adm.admit("1.1.1.1:1").run(&crate::RealClock, never()).await }
        });
        tokio::task::yield_now().await;
        let second = adm.admit("1.1.1.1:2");
        second.heard();
        let third = adm.admit("1.1.1.1:3");
        assert_eq!(third.run(&clock, async { 7 }).await, Ok(7));
        drop(third);
        assert_eq!(first.await.unwrap(), Err(NotAdmitted::Evicted));
        let timed = adm.admit("2.2.2.2:1").run(&clock, never()).await;
        assert_eq!(timed, Err(NotAdmitted::TimedOut(Duration::from_secs(1))));
        let c = adm.counts();
        assert_eq!((c.admitted, c.evicted, c.timed_out, c.pending), (4, 1, 1, 1));
        assert!(adm.evict_one(), "the second is still pending");
        assert!(!adm.evict_one());
    }
}
