//! What every commit mode and backend does behind [`Volume`](crate::Volume):
//! the [`Engine`] trait, and the types engines share.
//!
//! `Volume` keeps what is the same for every volume (range checks,
//! read-only handling, the superblock and its writes); an engine owns the
//! rest of its state (its blob I/O, striping, intent log, caches).
//!
//! | engine | module | read | write | flush | resize |
//! |---|---|---|---|---|---|
//! | write-through | `write_through` | the blob | the blob, durable on every replica | nothing to wait for | blob extended, then the superblock |
//! | fast-ack | `fast_ack` | the blob, the write cache over it | the write cache, destaged in epoch order | closes the epoch (durable: waits) | as write-through, once destaged |
//! | log | `log` | the block map, the write cache over it | the next free blocks of the log | closes the epoch (durable: waits) | a bigger log, its checkpoint, then the superblock |
//! | S3 | `lsvd` | journal, objects, zeros | one journal record | the journal's `fdatasync` | refused (not yet) |
//! | S3 snapshot | `lsvd` | the snapshot's map | refused | nothing | refused |

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::cache::Data;
use crate::intent::IntentLog;
use crate::superblock::Superblock;
use crate::VolumeError;

/// What a range of the volume holds (see [`Engine::allocation`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allocation {
    /// May hold written data.
    Data,
    /// Unallocated: reads as zeros and uses no space.
    Zero,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocExtent {
    pub len: u64,
    pub state: Allocation,
}

impl AllocExtent {
    pub fn new(len: u64, data: bool) -> AllocExtent {
        AllocExtent { len, state: if data { Allocation::Data } else { Allocation::Zero } }
    }
}

/// Most bytes one `Volume::allocation` call describes.
pub const ALLOCATION_SPAN_MAX: u64 = 1 << 30;

/// Consecutive `[start, end)` runs, each data or not, in volume order.
#[derive(Default)]
pub(crate) struct Runs(Vec<(u64, u64, bool)>);

impl Runs {
    /// Appends a run after the last one, merging equal neighbours.
    pub(crate) fn push(&mut self, start: u64, end: u64, data: bool) {
        if start >= end {
            return;
        }
        match self.0.last_mut() {
            Some(last) if last.1 == start && last.2 == data => last.1 = end,
            _ => self.0.push((start, end, data)),
        }
    }

    /// Sets `[start, end)` (inside the runs) to `data`.
    pub(crate) fn paint(&mut self, start: u64, end: u64, data: bool) {
        let mut out = Runs::default();
        for &(a, b, d) in &self.0 {
            out.push(a, b.min(start).max(a), d);
            if a < end && start < b {
                out.push(a.max(start), b.min(end), data);
            }
            out.push(a.max(end).min(b), b, d);
        }
        *self = out;
    }

    /// Lays acknowledged writes not yet durable over the runs: bytes are
    /// data, zeros (trims) are not.
    pub(crate) fn overlay(&mut self, cached: &[(u64, Data)]) {
        for (at, d) in cached {
            self.paint(*at, *at + d.len(), matches!(d, Data::Bytes(_)));
        }
    }

    pub(crate) fn into_extents(self) -> Vec<AllocExtent> {
        self.0.into_iter().map(|(a, b, d)| AllocExtent::new(b - a, d)).collect()
    }
}

/// Writes the superblock that makes a change take effect (a resize): an
/// engine prepares everything the new superblock needs, fills in its own
/// part, then calls this and awaits it.
pub(crate) type Commit<'a> =
    Box<dyn FnOnce(Superblock) -> BoxFuture<'a, Result<(), VolumeError>> + Send + 'a>;

/// What [`Engine::freeze`] holds until it is dropped.
pub(crate) type Hold<'a> = Box<dyn Send + 'a>;

/// One volume's data path. Ranges are checked by `Volume` before any
/// call, and changes are refused there for a read-only volume.
pub(crate) trait Engine: Send + Sync {
    /// `len > 0` bytes at `offset`: never older than an acknowledged write.
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, VolumeError>>;

    /// Writes `data` (bytes, or zeros for write-zeroes and trim; never
    /// empty) at `offset`. With `fua`, durable on every replica when it
    /// returns; without, as durable as the mode promises.
    fn write(&self, offset: u64, data: Data, fua: bool) -> BoxFuture<'_, Result<(), VolumeError>>;

    /// Closes the flush epoch; with `durable`, returns once every write
    /// acknowledged before the call is durable.
    fn flush(&self, durable: bool) -> BoxFuture<'_, Result<(), VolumeError>>;

    /// What `[offset, offset + len)` holds (at most
    /// [`ALLOCATION_SPAN_MAX`] bytes), as consecutive extents from
    /// `offset`. Reporting data for a hole is allowed, the reverse never:
    /// acknowledged writes not yet durable count as data (zeros for trims).
    fn allocation(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>>;

    /// Acknowledged writes not yet durable, and their bytes.
    fn outstanding(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Resizes the volume to `next` (generation one up): prepares what a
    /// larger size needs, sets the engine's part of `next` (a log's
    /// geometry), then writes it with `commit` and returns it. A crash
    /// before `commit` leaves the old volume, after it the new. A smaller
    /// size changes nothing but the superblock: `Volume::resize` zeroes
    /// what is past the end (after a shrink, before a grow).
    fn resize<'a>(
        &'a self,
        next: Superblock,
        commit: Commit<'a>,
    ) -> BoxFuture<'a, Result<Superblock, VolumeError>>;

    /// How far into the volume's bytes anything may be stored: past it,
    /// every byte reads as zeros with nothing written (no tract or log
    /// block exists there yet). A grow zeroes the bytes it gains below it
    /// (`Volume::resize`: a shrink's data past its end may still be there).
    fn reach(&self) -> u64;

    /// Makes every acknowledged write durable and leaves nothing for the
    /// next open to recover (the intent bits of idle tracts cleared). The
    /// volume stays usable.
    fn quiesce(&self) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(self.flush(true))
    }

    /// For a snapshot: quiesces (as [`Engine::quiesce`]) and holds back
    /// every write the engine would issue on its own (a log's checkpoints)
    /// until the returned guard is dropped, so nothing lands in the head
    /// while it is frozen. The caller holds back the volume's writes.
    fn freeze(&self) -> BoxFuture<'_, Result<Hold<'_>, VolumeError>> {
        Box::pin(async move {
            self.quiesce().await?;
            Ok(Box::new(()) as Hold<'_>)
        })
    }

    /// After [`Engine::quiesce`], at a clean close: stops what runs in the
    /// background (an S3 volume destages its journal first).
    fn close(&self) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async { Ok(()) })
    }

    /// The write-intent log, for engines that write in place.
    fn intent(&self) -> Option<&std::sync::Arc<IntentLog>> {
        None
    }

    /// Takes snapshot `name` of the volume; returns what names its point
    /// (an S3 volume's object seq).
    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>> {
        let _ = name;
        Box::pin(async { Err(VolumeError::Unsupported("this volume takes no snapshots".into())) })
    }

    /// Deletes snapshot `name` (refused while a clone reads it).
    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), VolumeError>> {
        let _ = name;
        Box::pin(async { Err(VolumeError::Unsupported("this volume has no snapshots".into())) })
    }

    /// An S3 volume's figures (what is not yet in the object store), or
    /// `None` for a volume in its blob.
    fn s3_info(&self) -> Option<blizzard_lsvd::Info> {
        None
    }

    /// An S3 volume's (or snapshot's) requests to its object store so far.
    fn s3_counts(&self) -> Option<blizzard_lsvd::store::CountsNow> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(r: &Runs) -> Vec<(u64, u64, bool)> {
        r.0.clone()
    }

    #[test]
    fn runs_merge_equal_neighbours_and_skip_empty_ones() {
        let mut r = Runs::default();
        r.push(0, 10, true);
        r.push(10, 20, true);
        r.push(20, 20, false);
        r.push(20, 30, false);
        assert_eq!(runs(&r), vec![(0, 20, true), (20, 30, false)]);
    }

    #[test]
    fn paint_splits_and_merges() {
        let mut r = Runs::default();
        r.push(0, 100, false);
        r.paint(10, 20, true);
        assert_eq!(runs(&r), vec![(0, 10, false), (10, 20, true), (20, 100, false)]);
        r.paint(15, 30, true);
        assert_eq!(runs(&r), vec![(0, 10, false), (10, 30, true), (30, 100, false)]);
        r.overlay(&[(0, Data::Zero(100))]);
        assert_eq!(runs(&r), vec![(0, 100, false)]);
        assert_eq!(r.into_extents(), vec![AllocExtent::new(100, false)]);
    }
}
