//! The group commit: appends and meta writes queue a [`Flush`] (the
//! segments they wrote, and whom to tell); one task, the flusher, takes
//! every flush queued so far, syncs each segment they wrote once, and
//! completes them in the order they were queued (the module's invariant
//! *durable means synced*).

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use openraft::storage::IOFlushed;
use tokio::sync::{mpsc, oneshot};

use super::{Health, Segment, FLUSH_QUEUE_MAX};
use crate::types::Raft;

/// Work for the flusher: segments to sync, then what to tell.
pub(super) struct Flush {
    pub(super) segs: Vec<Arc<Segment>>,
    pub(super) done: Done,
}

/// Whom a flush tells once its segments are durable, or why they are not.
pub(super) enum Done {
    Io(IOFlushed<Raft>),
    Signal(oneshot::Sender<Result<(), String>>),
}

impl Done {
    pub(super) fn complete(self, res: &Result<(), String>) {
        match self {
            Done::Io(cb) => cb.io_completed(res.clone().map_err(io::Error::other)),
            Done::Signal(tx) => {
                let _ = tx.send(res.clone());
            }
        }
    }
}

const FAILED: &str = "an earlier write or fdatasync of the log failed";

/// The group commit: takes every flush queued so far, syncs each segment
/// they wrote once, then completes them in order.
pub(super) async fn flusher(mut rx: mpsc::Receiver<Flush>, health: Arc<Health>, ack_before_sync: bool) {
    while let Some(first) = rx.recv().await {
        // Appends ready to run reach the page cache and queue first, so
        // that this sync covers them too (costs nothing when alone).
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < FLUSH_QUEUE_MAX {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        let mut segs: Vec<Arc<Segment>> = Vec::new();
        for f in &batch {
            for s in &f.segs {
                // By identity: a number is reused after its segment was
                // removed by a truncation, and both may be in one batch.
                if !segs.iter().any(|x| Arc::ptr_eq(x, s)) {
                    segs.push(s.clone());
                }
            }
        }
        if ack_before_sync {
            // The planted bug: durable before it is (no sync at all: the
            // bytes reach the disk whenever something else syncs it).
            for f in batch {
                f.done.complete(&Ok(()));
            }
            continue;
        }
        let res = sync_all(&segs, &health).await;
        for f in batch {
            f.done.complete(&res);
        }
    }
}

async fn sync_all(segs: &[Arc<Segment>], health: &Health) -> Result<(), String> {
    for s in segs {
        if health.failed.load(Ordering::Acquire) {
            return Err(FAILED.to_string());
        }
        let res = s.commit.sync().await;
        health.syncs.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = res {
            health.failed.store(true, Ordering::Release);
            return Err(format!("fdatasync of {} failed: {e}", s.path.display()));
        }
    }
    if health.failed.load(Ordering::Acquire) {
        return Err(FAILED.to_string());
    }
    Ok(())
}
