//! The two synchronization helpers every crate wrote for itself: a mutex
//! lock that outlives a panicked holder ([`lock`]), and a one-way signal
//! that wakes every current and future waiter ([`Flag`]).
//!
//! [`Flag`] is built on `Notify`, not a `watch` channel: a watch wakes its
//! receivers in an order drawn from an unseeded thread-local random
//! number, which would break the simulator's exact replay.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::Notify;

/// Locks `m`. A holder that panicked left the data as it was: every
/// critical section here keeps its invariant at each step, so the data is
/// taken as it is rather than passing the panic on to every later caller.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A one-way signal: once [`Flag::set`], every current and future
/// [`Flag::wait`] returns (until [`Flag::reset`]).
#[derive(Debug, Default)]
pub struct Flag {
    set: AtomicBool,
    notify: Notify,
}

impl Flag {
    pub fn new() -> Flag {
        Flag::default()
    }

    pub fn set(&self) {
        self.set.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    /// Clears the flag; waiters that already returned are not called back.
    pub fn reset(&self) {
        self.set.store(false, Ordering::Release);
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Resolves once the flag is set.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the flag is read, so a `set` in between
            // is not missed.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_flag_wakes_waiters_before_and_after_it_is_set() {
        let f = Arc::new(Flag::new());
        let early = tokio::spawn({
            let f = f.clone();
            async move { f.wait().await }
        });
        tokio::task::yield_now().await;
        assert!(!early.is_finished());
        f.set();
        early.await.unwrap();
        // Set: a later waiter returns at once.
        f.wait().await;
        f.reset();
        assert!(!f.is_set());
    }

    #[test]
    fn a_poisoned_mutex_still_locks() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _g = m2.lock().unwrap();
            panic!("poison it");
        })
        .join();
        assert!(m.lock().is_err(), "poisoned");
        *lock(&m) += 1;
        assert_eq!(*lock(&m), 2);
    }
}
