//! One simulated host's [`Env`]: simulated time, seeded randomness, turmoil
//! sockets and the host's [`SimDisks`], plus the [`Trace`] a run is judged
//! by.
//!
//! Invariants that make a seed replay a run:
//! - Time is tokio's paused clock inside a turmoil host, advanced only by the
//!   simulation; wall-clock time is a fixed epoch ([`SIM_EPOCH`]) plus the
//!   simulated time elapsed, never the machine's clock.
//! - Every random stream is a [`SimRng`] whose seed is derived from the run's
//!   seed and a label (host name and incarnation, disk path) by a fixed
//!   function ([`derive_seed`]), never `RandomState` or OS entropy, so adding
//!   a host does not shift any other host's stream.
//! - A restarted host gets a fresh stream (see [`sim_env_incarnation`]): a
//!   restarted tractserver must not draw the same "random" incarnation or
//!   request ids as its previous life, which would hide exactly the stale-
//!   epoch bugs the simulator is there to find.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use blizzard_env::{Clock, Env, Instant, Rng};
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use crate::disk::SimDisks;
use crate::net::SimNet;

/// Wall-clock time at the start of every simulation: 2026-01-01T00:00:00Z.
/// Fixed, so timestamps a server writes (superblocks, logs) are the same on
/// every replay of a seed.
pub const SIM_EPOCH: Duration = Duration::from_secs(1_767_225_600);

/// The seed of the random stream named `label` within run `seed`: FNV-1a of
/// the label mixed into the seed with SplitMix64's finalizer. A fixed
/// function (not std's randomly keyed hasher), so it is the same on every
/// run and every machine.
pub fn derive_seed(seed: u64, label: &str) -> u64 {
    splitmix64(seed ^ splitmix64(fnv1a64(label.as_bytes())))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a64_append(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_append(FNV_OFFSET, bytes)
}

/// Locks `m`, recovering the data if a panicking thread poisoned it: the
/// simulator's state stays meaningful after a failed assertion elsewhere,
/// and the failure is reported by that assertion, not by a second panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// Simulated time. Inside a turmoil host tokio's clock is paused and moved
/// only by the simulation, so `now` and `sleep` are simulated time.
pub struct SimClock {
    /// Used for `system_time` when not inside a turmoil host (plain tokio
    /// tests with paused time).
    start: Instant,
}

impl SimClock {
    pub fn new() -> SimClock {
        SimClock { start: tokio_now() }
    }
}

impl Default for SimClock {
    fn default() -> Self {
        Self::new()
    }
}

#[allow(clippy::disallowed_methods, reason = "the simulator is where Env::now comes from")]
fn tokio_now() -> Instant {
    Instant::now()
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        tokio_now()
    }

    fn system_time(&self) -> SystemTime {
        // The simulation-wide elapsed time, not this host's: every host
        // agrees on the wall clock, and it keeps counting across restarts.
        let elapsed = turmoil::sim_elapsed().unwrap_or_else(|| tokio_now().duration_since(self.start));
        UNIX_EPOCH + SIM_EPOCH + elapsed
    }

    #[allow(clippy::disallowed_methods, reason = "the simulator is where Env::sleep comes from")]
    fn sleep(&self, d: Duration) -> BoxFuture<'static, ()> {
        tokio::time::sleep(d).boxed()
    }
}

/// Seeded randomness: a small fast generator behind a mutex (the `Rng`
/// trait takes `&self` and is shared by a host's tasks).
pub struct SimRng(Mutex<SmallRng>);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(Mutex::new(SmallRng::seed_from_u64(seed)))
    }
}

impl Rng for SimRng {
    fn next_u64(&self) -> u64 {
        lock(&self.0).next_u64()
    }
}

/// The `Env` of host `host` in run `seed`, first incarnation. See
/// [`sim_env_incarnation`].
pub fn sim_env(seed: u64, host: &str, disks: SimDisks) -> Env {
    sim_env_incarnation(seed, host, 0, disks)
}

/// The `Env` of the `incarnation`th start of host `host` (0 for the first;
/// the harness counts restarts). Randomness is derived from the seed, the
/// host name and the incarnation, so each restart draws a new but replayable
/// stream; `disks` is the host's registry, kept by the harness across
/// restarts so the disks survive them. Must be called (and the `Env` used)
/// on the turmoil host named `host`: the network binds there.
pub fn sim_env_incarnation(seed: u64, host: &str, incarnation: u64, disks: SimDisks) -> Env {
    let label = format!("{host}/{incarnation}");
    Env {
        clock: Arc::new(SimClock::new()),
        rng: Arc::new(SimRng::new(derive_seed(seed, &label))),
        net: Arc::new(SimNet::new(host)),
        disks: Arc::new(disks),
    }
}

/// [`sim_env`] for a client host whose dropped connections may come back
/// as late duplicates (`ghost`).
pub fn sim_env_with_ghosts(seed: u64, host: &str, disks: SimDisks, ghosts: crate::ghost::Ghosts) -> Env {
    let mut env = sim_env(seed, host, disks);
    env.net = Arc::new(SimNet::with_ghosts(host, ghosts));
    env
}

/// An append-only log of what happened in a run ("t=12.000ms ts3 crash"),
/// shared by the harness, the hosts and the checkers. Two runs of one seed
/// must produce the same trace; [`Trace::digest`] makes that a one-line
/// assertion and a short number to print beside a failing seed.
#[derive(Clone, Default)]
pub struct Trace(Arc<Mutex<Vec<String>>>);

impl Trace {
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Appends one line as given.
    pub fn record(&self, line: impl Into<String>) {
        let line = line.into();
        // For following a seed that never ends: `SIM_TRACE_LIVE=1` (read
        // once: a lookup per line took the environment's lock each time).
        static LIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *LIVE.get_or_init(|| std::env::var_os("SIM_TRACE_LIVE").is_some()) {
            eprintln!("{line}");
        }
        lock(&self.0).push(line);
    }

    /// Appends `t=<simulated time> <host> <what>`, the time read from the
    /// turmoil host this is called on (`t=?` outside one; the harness, which
    /// runs between steps, uses [`Trace::event_at`] with `Sim::elapsed`).
    pub fn event(&self, host: &str, what: impl fmt::Display) {
        match turmoil::sim_elapsed() {
            Some(t) => self.event_at(t, host, what),
            None => self.record(format!("t=? {host} {what}")),
        }
    }

    /// Appends `t=<at> <host> <what>`, with microsecond precision.
    pub fn event_at(&self, at: Duration, host: &str, what: impl fmt::Display) {
        let us = at.as_micros();
        self.record(format!("t={}.{:03}ms {host} {what}", us / 1000, us % 1000));
    }

    /// A copy of every line so far.
    pub fn lines(&self) -> Vec<String> {
        lock(&self.0).clone()
    }

    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    pub fn is_empty(&self) -> bool {
        lock(&self.0).is_empty()
    }

    /// FNV-1a (64-bit) over every line, each followed by a newline: a fixed
    /// function, so equal traces give equal digests on every machine.
    pub fn digest(&self) -> u64 {
        lock(&self.0)
            .iter()
            .fold(FNV_OFFSET, |h, line| fnv1a64_append(fnv1a64_append(h, line.as_bytes()), b"\n"))
    }
}

impl fmt::Display for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for line in lock(&self.0).iter() {
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Trace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trace").field("len", &self.len()).field("digest", &self.digest()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // derive_seed is a fixed function: pinned values, distinct labels differ.
    #[test]
    fn derive_seed_is_fixed_and_separates_labels() {
        assert_eq!(derive_seed(1, "ts1/0"), derive_seed(1, "ts1/0"));
        assert_ne!(derive_seed(1, "ts1/0"), derive_seed(1, "ts2/0"));
        assert_ne!(derive_seed(1, "ts1/0"), derive_seed(2, "ts1/0"));
        assert_ne!(derive_seed(1, "ts1/0"), derive_seed(1, "ts1/1"));
        // FNV-1a of the empty string is the offset basis (a known vector).
        assert_eq!(fnv1a64(b""), FNV_OFFSET);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    // A SimRng replays its stream from the seed.
    #[test]
    fn sim_rng_replays() {
        let (a, b, c) = (SimRng::new(7), SimRng::new(7), SimRng::new(8));
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        let zs: Vec<u64> = (0..8).map(|_| c.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs, zs);
    }

    // The trace digest depends on every line and on line boundaries.
    #[test]
    fn trace_digest_covers_lines() {
        let (a, b, c) = (Trace::new(), Trace::new(), Trace::new());
        a.event_at(Duration::from_micros(12_345), "ts1", "crash");
        b.record("t=12.345ms ts1 crash");
        c.record("t=12.345ms ts1");
        c.record("crash");
        assert_eq!(a.lines(), b.lines());
        assert_eq!(a.digest(), b.digest());
        assert_ne!(a.digest(), c.digest());
        assert_ne!(Trace::new().digest(), a.digest());
        assert_eq!(a.to_string(), "t=12.345ms ts1 crash\n");
    }

    // Outside turmoil, system_time is the fixed epoch plus paused tokio time.
    #[tokio::test(start_paused = true)]
    async fn clock_is_epoch_plus_simulated_time() {
        let clock = SimClock::new();
        let t0 = clock.system_time();
        assert_eq!(t0, UNIX_EPOCH + SIM_EPOCH);
        clock.sleep(Duration::from_secs(5)).await;
        assert_eq!(clock.system_time(), t0 + Duration::from_secs(5));
    }
}
