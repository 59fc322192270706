//! The log engine behind `Volume` (`crate::engine::Engine`): the trait's
//! calls, each onto the log's own.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use super::{LogEngine, Runs};
use crate::cache::Data;
use crate::engine::{AllocExtent, Commit, Engine, Hold};
use crate::superblock::Superblock;
use crate::VolumeError;

/// The log engine behind `Volume`.
impl Engine for Arc<LogEngine> {
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, VolumeError>> {
        Box::pin(LogEngine::read(self, offset, len))
    }

    fn write(&self, offset: u64, data: Data, fua: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            LogEngine::write(self, offset, data).await?;
            if fua {
                LogEngine::flush(self, true).await?;
            }
            Ok(())
        })
    }

    fn flush(&self, durable: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(LogEngine::flush(self, durable))
    }

    fn allocation(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>> {
        let bs = self.bs();
        let (mapped, cached) = LogEngine::allocation(self, offset, len);
        let mut runs = Runs::default();
        let first = offset / bs;
        for (i, m) in mapped.into_iter().enumerate() {
            let b = (first + i as u64) * bs;
            runs.push(b.max(offset), (b + bs).min(offset + len), m);
        }
        runs.overlay(&cached);
        Box::pin(async move { Ok(runs.into_extents()) })
    }

    fn outstanding(&self) -> (u64, u64) {
        LogEngine::outstanding(self)
    }

    /// The log's blocks: a shrink leaves the geometry as it was.
    fn reach(&self) -> u64 {
        let g = self.geom();
        g.vblocks * g.block_size
    }

    /// The log drained and durable, and no checkpoint until the guard goes:
    /// a checkpoint written while the head is frozen would land in the
    /// frozen layer, unseen by both views, and free blocks the log still
    /// needs.
    fn freeze(&self) -> BoxFuture<'_, Result<Hold<'_>, VolumeError>> {
        Box::pin(async move {
            let one = self.ckpt_lock.lock().await;
            LogEngine::flush(self, true).await?;
            Ok(Box::new(one) as Hold<'_>)
        })
    }

    /// A log volume grows its log first when the new size needs more
    /// blocks (`LogEngine::grow`; design 0003, "Resizing a log volume"),
    /// and drops the blocks past a smaller one the same way.
    fn resize<'a>(
        &'a self,
        mut next: Superblock,
        commit: Commit<'a>,
    ) -> BoxFuture<'a, Result<Superblock, VolumeError>> {
        Box::pin(async move {
            let geom = self.geom();
            let vblocks = next.size_bytes.div_ceil(geom.block_size);
            if vblocks == geom.vblocks {
                // The same blocks: the log is unchanged (`Volume::resize`
                // zeroes the bytes past the end of the last one).
                commit(next.clone()).await?;
                return Ok(next);
            }
            // A new checkpoint with the map at its new length, then the
            // superblock: under the old geometry that checkpoint's length
            // does not match and the older one is used, so a crash before
            // the switch leaves the old volume whole.
            let new = if vblocks < geom.vblocks {
                geom.shrink(next.size_bytes)?
            } else {
                geom.grow(next.size_bytes)?
            };
            next.log = Some(new.superblock_part());
            let moved = new.ckpt_tracts != geom.ckpt_tracts;
            self.grow(new, commit(next.clone())).await?;
            if moved {
                // The superblock is durable on every replica: no open can
                // pick the old geometry again, so its slots are free. Best
                // effort: a crash here only leaves their space in use.
                for &first in &geom.ckpt_tracts {
                    for t in first..first + geom.ckpt_slot_tracts {
                        if let Err(e) = self.io.trim(t, 0, geom.tract_size as u32).await {
                            tracing::warn!(tract = t, error = %e, "could not release an old checkpoint slot");
                        }
                    }
                }
            }
            Ok(next)
        })
    }
}
