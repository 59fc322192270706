//! Group commit: many writers, one `fdatasync` (a tractserver's tract
//! writes, the replicated runtime's log appends).
//!
//! A writer calls [`GroupCommit::sync`] after its `pwrite`s completed. The
//! first caller to find no sync running starts one that covers every ticket
//! issued so far; later callers wait for the next one. So under load each
//! `fdatasync` makes a whole batch of writes durable, and a lone write pays
//! for exactly one.
//!
//! Invariant: `durable >= t` only after a sync that *started* after ticket
//! `t` was issued has returned successfully, and ticket `t` is issued only
//! after its writer's data reached the disk's cache.
//!
//! A failed `fdatasync` may have dropped dirty pages (Linux marks them
//! clean), so nothing written before it can be trusted to be durable: the
//! disk is marked failed and every later sync fails too.

use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::Disk;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct State {
    issued: u64,
    durable: u64,
    syncing: bool,
    failed: bool,
    syncs: u64,
}

/// Waiters are woken with `Notify` (FIFO) rather than a `watch` channel,
/// whose wake order depends on an unseeded thread-local random number and
/// would break the simulator's exact replay.
pub struct GroupCommit {
    disk: Arc<dyn Disk>,
    state: Mutex<State>,
    changed: Notify,
}

impl GroupCommit {
    pub fn new(disk: Arc<dyn Disk>) -> Self {
        GroupCommit { disk, state: Mutex::new(State::default()), changed: Notify::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Number of `fdatasync` calls made so far (for stats and tests).
    pub fn syncs(&self) -> u64 {
        self.lock().syncs
    }

    pub fn failed(&self) -> bool {
        self.lock().failed
    }

    /// Marks the disk untrusted, as a failed `fdatasync` does: every later
    /// sync fails. For a store that can no longer tell what its disk holds.
    pub fn poison(&self) {
        self.lock().failed = true;
        self.changed.notify_waiters();
    }

    /// Returns once every write completed before this call is durable.
    pub async fn sync(&self) -> io::Result<()> {
        let ticket = {
            let mut s = self.lock();
            s.issued += 1;
            s.issued
        };
        loop {
            // Registered before looking at the state, so a change made
            // after the look still wakes us.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let start = {
                let mut s = self.lock();
                if s.failed {
                    return Err(io::Error::other(
                        "an earlier fdatasync failed; the disk is no longer trusted",
                    ));
                }
                if s.durable >= ticket {
                    return Ok(());
                }
                if s.syncing {
                    None
                } else {
                    s.syncing = true;
                    Some(())
                }
            };
            if start.is_some() {
                // Let every task that is ready to run go first: writes that
                // already arrived reach the page cache and take tickets, so
                // this sync covers them instead of leaving them for the
                // next one. Costs nothing when nothing else is ready (a
                // lone write), and under load it is what batches writes.
                tokio::task::yield_now().await;
                // The target is fixed only now, just before the sync starts:
                // every ticket issued so far was issued before it.
                let (target, alone) = {
                    let s = self.lock();
                    (s.issued, s.issued == s.durable + 1)
                };
                // A lone writer has nothing to overlap with the sync, so the
                // disk may run it on this thread (see `Disk::sync_alone`).
                let res = if alone { self.disk.sync_alone().await } else { self.disk.sync().await };
                {
                    let mut s = self.lock();
                    s.syncing = false;
                    s.syncs += 1;
                    match &res {
                        Ok(()) => s.durable = s.durable.max(target),
                        Err(_) => s.failed = true,
                    }
                }
                self.changed.notify_waiters();
                res?;
                continue;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Clock;
    use bytes::Bytes;
    use futures::future::BoxFuture;
    use futures::FutureExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// A disk whose fdatasync takes 10 ms of (paused, virtual) time.
    struct SlowSync {
        syncs: AtomicU64,
        fail: bool,
    }

    impl Disk for SlowSync {
        fn len(&self) -> u64 {
            0
        }
        fn read_at(&self, _: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
            async move { Ok(Bytes::from(vec![0; len])) }.boxed()
        }
        fn write_at(&self, _: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
            async { Ok(()) }.boxed()
        }
        fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
            self.syncs.fetch_add(1, Ordering::SeqCst);
            let fail = self.fail;
            async move {
                // The real clock on tokio's paused test time: virtual 10 ms.
                crate::RealClock.sleep(Duration::from_millis(10)).await;
                if fail {
                    Err(io::Error::other("injected EIO"))
                } else {
                    Ok(())
                }
            }
            .boxed()
        }
    }

    /// 64 concurrent writers are made durable by two fdatasyncs: the one
    /// already running when they arrive cannot cover them, the next covers all.
    #[tokio::test(start_paused = true)]
    async fn concurrent_writers_share_syncs() -> io::Result<()> {
        let disk = Arc::new(SlowSync { syncs: AtomicU64::new(0), fail: false });
        let gc = Arc::new(GroupCommit::new(disk.clone()));
        let first = tokio::spawn({
            let gc = gc.clone();
            async move { gc.sync().await }
        });
        tokio::task::yield_now().await;
        let mut tasks = vec![];
        for _ in 0..63 {
            let gc = gc.clone();
            tasks.push(tokio::spawn(async move { gc.sync().await }));
        }
        first.await.map_err(io::Error::other)??;
        for t in tasks {
            t.await.map_err(io::Error::other)??;
        }
        assert_eq!(disk.syncs.load(Ordering::SeqCst), 2);
        assert_eq!(gc.syncs(), 2);
        Ok(())
    }

    /// After a failed fdatasync nothing is reported durable again.
    #[tokio::test(start_paused = true)]
    async fn failed_sync_poisons_the_disk() {
        let disk = Arc::new(SlowSync { syncs: AtomicU64::new(0), fail: true });
        let gc = GroupCommit::new(disk);
        assert!(gc.sync().await.is_err());
        assert!(gc.failed());
        assert!(gc.sync().await.is_err());
    }
}
