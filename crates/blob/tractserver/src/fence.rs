//! Writer fences: the newest writer epoch seen per blob incarnation
//! (`TractAddr::writer`). Keyed by incarnation too, so a blob deleted and
//! created again under the same id starts unfenced, as its new intent
//! header (epoch 0) expects.
//!
//! A replicated blob's client writes every replica itself (FDS §3.5), so a
//! write cut off by its writer's crash may have reached some replicas and
//! not others, and the next writer makes the replicas agree before it
//! writes (`DigestTract`, then copies). Requests of the old writer may
//! still be in the network, or queued in a slow tractserver, and must
//! never apply after that: the new writer opens the blob under a higher
//! epoch, its `DigestTract` raises the blob's fence here before reading
//! anything, and every change carrying an older epoch is refused with
//! `ErrorCode::Fenced` from then on. The service checks a change's epoch
//! under the tract's slot lock, the lock the digest takes too, so a change
//! admitted before the fence rose has finished when the digest reads the
//! slot, and one checked after is refused.
//!
//! In memory only: a restarted tractserver has dropped every connection,
//! so nothing an old writer sent before the restart can reach it any more.
//! (A replaced writer that is still alive and sends something new after
//! the restart is refused by the replicas that stayed up, and must stop at
//! its first `Fenced`; the restarted one would admit it.) Bounded like
//! `blizzard_rpc::session::Sessions`: beyond [`FENCES_MAX`] blobs the one
//! seen first is forgotten.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use blizzard_core::{BlobId, Incarnation};

/// What a fence guards: one life of one blob.
type Key = (BlobId, Incarnation);

/// Blobs whose newest writer is remembered; the oldest entry is forgotten
/// beyond this. A forgotten blob admits any epoch again, so this is far
/// above the number of blobs written within the time a request can linger.
pub const FENCES_MAX: usize = 1 << 16;

/// The newest writer epoch seen per blob.
#[derive(Default)]
pub struct Fences {
    inner: Mutex<FenceTable>,
}

#[derive(Default)]
struct FenceTable {
    newest: HashMap<Key, u64>,
    /// Blobs in the order first fenced, for forgetting the oldest.
    order: VecDeque<Key>,
}

impl Fences {
    fn table(&self) -> std::sync::MutexGuard<'_, FenceTable> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Admits a request of `writer` on `blob`: refuses it with the newest
    /// epoch seen if `writer` is older, otherwise makes `writer` the newest.
    /// Epoch 0 (no writer) on a blob never fenced leaves no entry behind.
    pub fn admit(&self, blob: BlobId, incarnation: Incarnation, writer: u64) -> Result<(), u64> {
        let key = (blob, incarnation);
        let mut t = self.table();
        match t.newest.get_mut(&key) {
            Some(n) if writer < *n => Err(*n),
            Some(n) => {
                *n = writer;
                Ok(())
            }
            None if writer == 0 => Ok(()),
            None => {
                if t.order.len() >= FENCES_MAX {
                    if let Some(old) = t.order.pop_front() {
                        t.newest.remove(&old);
                    }
                }
                t.newest.insert(key, writer);
                t.order.push_back(key);
                Ok(())
            }
        }
    }

    /// The newest writer epoch seen for `blob` (0: none remembered).
    pub fn newest(&self, blob: BlobId, incarnation: Incarnation) -> u64 {
        self.table().newest.get(&(blob, incarnation)).copied().unwrap_or(0)
    }

    /// Blobs with a fence.
    pub fn len(&self) -> usize {
        self.table().newest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const INC: Incarnation = 1;

    /// An epoch older than the newest seen is refused with the newest; the
    /// newest and newer ones are admitted and raise it; blobs are apart.
    #[test]
    fn older_writers_are_refused_per_blob() {
        let f = Fences::default();
        let (a, b) = (BlobId(1), BlobId(2));
        assert_eq!(f.admit(a, INC, 5), Ok(()));
        assert_eq!(f.admit(a, INC, 4), Err(5));
        assert_eq!(f.admit(a, INC, 0), Err(5));
        assert_eq!(f.admit(a, INC, 5), Ok(()), "the newest writer itself goes on");
        assert_eq!(f.admit(a, INC, 7), Ok(()));
        assert_eq!(f.admit(a, INC, 5), Err(7), "a writer replaced by a newer one is refused");
        assert_eq!(f.newest(a, INC), 7);
        // Another blob is not fenced by a's writers.
        assert_eq!(f.admit(b, INC, 1), Ok(()));
        assert_eq!(f.admit(b, INC, 0), Err(1));
        // A new life of blob a (deleted and created again) starts unfenced.
        assert_eq!(f.admit(a, INC + 1, 1), Ok(()));
    }

    /// Writer 0 on a blob nobody fenced is admitted and remembers nothing,
    /// so blobs written without epochs cost no memory.
    #[test]
    fn writer_zero_creates_no_entry() {
        let f = Fences::default();
        assert_eq!(f.admit(BlobId(9), INC, 0), Ok(()));
        assert!(f.is_empty());
        assert_eq!(f.newest(BlobId(9), INC), 0);
    }

    /// Beyond the bound, the blob fenced first is forgotten (and then
    /// admits any epoch), the newest are kept.
    #[test]
    fn the_table_is_bounded() {
        let f = Fences::default();
        for i in 0..(FENCES_MAX as u128 + 10) {
            assert_eq!(f.admit(BlobId(i), INC, 3), Ok(()));
        }
        assert_eq!(f.len(), FENCES_MAX);
        assert_eq!(f.admit(BlobId(0), INC, 1), Ok(()), "forgotten: admitted again");
        assert_eq!(f.admit(BlobId(FENCES_MAX as u128 + 9), INC, 1), Err(3), "recent: still fenced");
    }
}
