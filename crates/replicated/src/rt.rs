//! The async runtime openraft runs on: tokio (whose clock the simulator
//! drives), with two things replaced so that a seeded simulation replays
//! exactly:
//!
//! - **Randomness.** openraft draws its election timeouts from
//!   `AsyncRuntime::thread_rng`. Ours is a per-thread generator derived
//!   from a seed the node takes from its `Env` ([`seed_thread_rng`]), so
//!   the simulator's seed decides every timeout. (tokio's stock runtime
//!   uses the OS entropy source.)
//! - **Watch channels.** tokio's `watch` wakes its waiters in an order
//!   drawn from an unseeded thread-local random number (the reason
//!   `clippy.toml` bans it); openraft creates every watch through the
//!   runtime, so ours is [`FifoWatch`]: a version counter and a `Notify`,
//!   which wakes waiters first come, first served.
//!
//! Everything else (tasks, timers, mpsc, oneshot, mutex) is tokio's.

use std::cell::Cell;
use std::fmt::Debug;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use openraft_rt::watch::{RecvError, SendError};
use openraft_rt::{AsyncRuntime, OptionalSend, OptionalSync, Watch, WatchReceiver, WatchSender};
use openraft_rt_tokio::TokioRuntime;
use rand010::rngs::SmallRng;
use rand010::SeedableRng;
use tokio::sync::Notify;

/// openraft's runtime: tokio, a seeded generator, FIFO watches.
pub struct Runtime(TokioRuntime);

impl Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("blizzard_replicated::rt::Runtime")
    }
}

/// The process-wide seed every thread's generator derives from (set by
/// [`seed_thread_rng`]; 0 until a node starts).
static SEED: AtomicU64 = AtomicU64::new(0);
/// Threads that have derived a generator, to give each its own stream.
static THREADS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's generator state (`None`: derive one from [`SEED`]).
    static STATE: Cell<Option<u64>> = const { Cell::new(None) };
}

fn splitmix64(x: u64) -> u64 {
    let z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seeds the generators openraft draws from: this thread's at once, other
/// threads' when they first draw. A node calls it with a number from its
/// `Env` (OS entropy for real; the seed's stream in the simulator, which
/// runs every host on one thread, so a seed decides every draw).
pub fn seed_thread_rng(seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    STATE.with(|s| s.set(Some(splitmix64(seed))));
}

fn next_seed() -> u64 {
    STATE.with(|s| {
        let cur = s.get().unwrap_or_else(|| {
            let n = THREADS.fetch_add(1, Ordering::Relaxed);
            splitmix64(SEED.load(Ordering::Relaxed) ^ n.wrapping_mul(0xd1b5_4a32_d192_ed03))
        });
        let next = splitmix64(cur);
        s.set(Some(next));
        next
    })
}

impl AsyncRuntime for Runtime {
    type JoinError = <TokioRuntime as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <TokioRuntime as AsyncRuntime>::Sleep;
    type Instant = <TokioRuntime as AsyncRuntime>::Instant;
    type TimeoutError = <TokioRuntime as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <TokioRuntime as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = SmallRng;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        TokioRuntime::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        TokioRuntime::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        TokioRuntime::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        TokioRuntime::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        TokioRuntime::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        SmallRng::seed_from_u64(next_seed())
    }

    type Mpsc = <TokioRuntime as AsyncRuntime>::Mpsc;
    type Watch = FifoWatch;
    type Oneshot = <TokioRuntime as AsyncRuntime>::Oneshot;
    type Mutex<T: OptionalSend + 'static> = <TokioRuntime as AsyncRuntime>::Mutex<T>;

    fn new(threads: usize) -> Self {
        Runtime(TokioRuntime::new(threads))
    }

    fn block_on<F, T>(&mut self, future: F) -> T
    where
        F: Future<Output = T>,
    {
        self.0.block_on(future)
    }
}

/// A watch channel whose waiters wake in the order they started waiting.
pub struct FifoWatch;

struct Shared<T> {
    value: RwLock<T>,
    /// Bumped by every send that changed the value.
    version: AtomicU64,
    senders: AtomicUsize,
    receivers: AtomicUsize,
    changed: Notify,
}

impl<T> Shared<T> {
    fn read(&self) -> RwLockReadGuard<'_, T> {
        match self.value.read() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

pub struct FifoSender<T> {
    shared: Arc<Shared<T>>,
}

pub struct FifoReceiver<T> {
    shared: Arc<Shared<T>>,
    seen: u64,
}

impl Watch for FifoWatch {
    type Sender<T: OptionalSend + OptionalSync> = FifoSender<T>;
    type Receiver<T: OptionalSend + OptionalSync> = FifoReceiver<T>;
    type Ref<'a, T: OptionalSend + 'a> = RwLockReadGuard<'a, T>;

    fn channel<T: OptionalSend + OptionalSync>(init: T) -> (FifoSender<T>, FifoReceiver<T>) {
        let shared = Arc::new(Shared {
            value: RwLock::new(init),
            version: AtomicU64::new(0),
            senders: AtomicUsize::new(1),
            receivers: AtomicUsize::new(1),
            changed: Notify::new(),
        });
        (FifoSender { shared: shared.clone() }, FifoReceiver { shared, seen: 0 })
    }
}

impl<T> Clone for FifoSender<T> {
    fn clone(&self) -> Self {
        self.shared.senders.fetch_add(1, Ordering::AcqRel);
        FifoSender { shared: self.shared.clone() }
    }
}

impl<T> Drop for FifoSender<T> {
    fn drop(&mut self) {
        if self.shared.senders.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last sender: waiters learn the channel closed.
            self.shared.changed.notify_waiters();
        }
    }
}

impl<T> Clone for FifoReceiver<T> {
    fn clone(&self) -> Self {
        self.shared.receivers.fetch_add(1, Ordering::AcqRel);
        FifoReceiver { shared: self.shared.clone(), seen: self.seen }
    }
}

impl<T> Drop for FifoReceiver<T> {
    fn drop(&mut self) {
        self.shared.receivers.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<T: OptionalSend + OptionalSync> WatchSender<FifoWatch, T> for FifoSender<T> {
    fn send(&self, value: T) -> Result<(), SendError<T>> {
        if self.shared.receivers.load(Ordering::Acquire) == 0 {
            return Err(SendError(value));
        }
        self.send_if_modified(|v| {
            *v = value;
            true
        });
        Ok(())
    }

    fn send_if_modified<F>(&self, modify: F) -> bool
    where
        F: FnOnce(&mut T) -> bool,
    {
        let modified = {
            let mut g = match self.shared.value.write() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            let m = modify(&mut g);
            if m {
                // Under the lock: a reader that sees the new version sees
                // the new value.
                self.shared.version.fetch_add(1, Ordering::AcqRel);
            }
            m
        };
        if modified {
            self.shared.changed.notify_waiters();
        }
        modified
    }

    fn borrow_watched(&self) -> RwLockReadGuard<'_, T> {
        self.shared.read()
    }

    fn subscribe(&self) -> FifoReceiver<T> {
        self.shared.receivers.fetch_add(1, Ordering::AcqRel);
        FifoReceiver { shared: self.shared.clone(), seen: self.shared.version.load(Ordering::Acquire) }
    }
}

impl<T: OptionalSend + OptionalSync> WatchReceiver<FifoWatch, T> for FifoReceiver<T> {
    async fn changed(&mut self) -> Result<(), RecvError> {
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            // Registered before the checks below: a send between them
            // still wakes this waiter.
            notified.as_mut().enable();
            let now = self.shared.version.load(Ordering::Acquire);
            if now != self.seen {
                self.seen = now;
                return Ok(());
            }
            if self.shared.senders.load(Ordering::Acquire) == 0 {
                return Err(RecvError(()));
            }
            notified.await;
        }
    }

    fn borrow_watched(&self) -> RwLockReadGuard<'_, T> {
        self.shared.read()
    }

    fn borrow_and_update(&mut self) -> RwLockReadGuard<'_, T> {
        let g = self.shared.read();
        self.seen = self.shared.version.load(Ordering::Acquire);
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_on_a_change_and_on_close() {
        let (tx, mut rx) = FifoWatch::channel(1u32);
        let mut rx2 = rx.clone();
        let w = tokio::spawn(async move { rx2.changed().await.map(|_| *rx2.borrow_watched()) });
        tokio::task::yield_now().await;
        assert!(!tx.send_if_modified(|_| false), "nothing changed");
        tx.send(5).map_err(|_| ()).expect("a receiver lives");
        assert_eq!(w.await.ok(), Some(Ok(5)));
        // Already seen by `subscribe`: no change until the next send.
        let mut late = tx.subscribe();
        assert_eq!(*late.borrow_and_update(), 5);
        rx.changed().await.expect("the send above is news to rx");
        drop(tx);
        assert!(late.changed().await.is_err(), "closed once the last sender is gone");
    }

    #[test]
    fn a_seed_decides_the_draws() {
        use rand010::RngExt;
        let draws = || {
            seed_thread_rng(42);
            (0..4).map(|_| Runtime::thread_rng().random_range(150..300u64)).collect::<Vec<_>>()
        };
        assert_eq!(draws(), draws());
        seed_thread_rng(43);
        let other: Vec<u64> = (0..4).map(|_| Runtime::thread_rng().random_range(150..300u64)).collect();
        assert_ne!(draws(), other);
    }
}
