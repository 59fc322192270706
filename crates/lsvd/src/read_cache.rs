//! The read cache (LSVD §3.1): object data fetched from the store, kept in
//! a file beside the journal so that data read again costs no request.
//!
//! Entries are keyed by where the bytes live in the object log, (object
//! seq, line), never by volume offset. Objects are immutable, so an entry
//! can never be stale: a newer write lives in another object and the map
//! points there; the lines of an object the cleaner deleted are no longer
//! asked for and age out.
//!
//! Nothing here is durable or trusted. The file is never synced, and every
//! hit is checked against the CRC of each 4 KiB block that the object's
//! own header carries (the same check as a fetch), so a line that was torn,
//! lost, overwritten by a racing fill or damaged on disk is a miss, never
//! wrong data. Losing the file loses nothing; it starts empty on each open.
//!
//! [`Slots`] is the pure core: which slot holds which line, and CLOCK
//! eviction (a line read since the hand last passed gets a second chance).
//! [`ReadCache`] is the shell that reads and writes the slots.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;

use blizzard_env::{Disk, Env};

use crate::error::LsvdError;
use crate::format::CRC_BLOCK;

/// Bytes per cached line: a whole number of CRC blocks, so a line is
/// checked block by block against the object's header.
pub const LINE: u64 = 64 << 10;
const _: () = assert!(LINE.is_multiple_of(CRC_BLOCK));

/// A line of an object's data: (object seq, line index).
pub type LineKey = (u64, u64);

/// Which slot holds which line, and which slot to reuse next.
#[derive(Debug)]
pub struct Slots {
    map: HashMap<LineKey, usize>,
    owner: Vec<Option<LineKey>>,
    referenced: Vec<bool>,
    hand: usize,
}

impl Slots {
    pub fn new(n: usize) -> Slots {
        Slots { map: HashMap::new(), owner: vec![None; n], referenced: vec![false; n], hand: 0 }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The slot holding `key`, marked recently used.
    pub fn lookup(&mut self, key: LineKey) -> Option<usize> {
        let s = *self.map.get(&key)?;
        self.referenced[s] = true;
        Some(s)
    }

    /// A slot for `key`: its own if it has one, else a free one or the
    /// first unreferenced one the hand reaches (its line is evicted).
    pub fn insert(&mut self, key: LineKey) -> usize {
        if let Some(&s) = self.map.get(&key) {
            return s;
        }
        let n = self.owner.len();
        // Two turns at most: the first clears every reference bit it passes.
        let mut s = self.hand;
        for _ in 0..2 * n {
            s = self.hand;
            self.hand = (self.hand + 1) % n;
            if self.owner[s].is_none() || !self.referenced[s] {
                break;
            }
            self.referenced[s] = false;
        }
        if let Some(old) = self.owner[s].take() {
            self.map.remove(&old);
        }
        self.owner[s] = Some(key);
        self.referenced[s] = false;
        self.map.insert(key, s);
        // Invariant: map and owner describe the same pairs.
        debug_assert_eq!(self.map.get(&key), Some(&s));
        s
    }

    /// Drops `key` if slot `slot` still holds it (its bytes failed their
    /// check: they were torn, damaged, or a racing fill overwrote them).
    pub fn forget(&mut self, key: LineKey, slot: usize) {
        if self.owner.get(slot).copied().flatten() == Some(key) {
            self.owner[slot] = None;
            self.referenced[slot] = false;
            self.map.remove(&key);
        }
    }
}

/// Hits and misses, for `/metrics` and the tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Hits whose bytes failed their CRC (fetched again instead).
    pub bad: u64,
    pub lines: u64,
    pub capacity_lines: u64,
}

/// The read cache of one open volume.
pub struct ReadCache {
    disk: Arc<dyn Disk>,
    slots: Mutex<Slots>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    bad: AtomicU64,
}

impl ReadCache {
    /// Opens (creating if need be) the cache file at `path` with room for
    /// `bytes` of lines. Whatever the file held is ignored.
    pub async fn open(env: &Env, path: &Path, bytes: u64) -> Result<ReadCache, LsvdError> {
        let capacity = (bytes / LINE) as usize;
        if capacity == 0 {
            return Err(LsvdError::Invalid(format!(
                "a read cache of {bytes} bytes holds no line of {LINE}; give it at least {LINE} bytes or none"
            )));
        }
        let disk = env
            .open_disk(path, Some(capacity as u64 * LINE))
            .await
            .map_err(|e| LsvdError::Cache(format!("opening the read cache {}: {e}", path.display())))?;
        // An existing file of another size: use what fits.
        let capacity = capacity.min((disk.len() / LINE) as usize);
        if capacity == 0 {
            return Err(LsvdError::Cache(format!(
                "{} is {} bytes: too small for a read cache; delete it",
                path.display(),
                disk.len()
            )));
        }
        Ok(ReadCache {
            disk,
            slots: Mutex::new(Slots::new(capacity)),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            bad: AtomicU64::new(0),
        })
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached bytes of `key` (`len`: the line's length), unchecked:
    /// the caller checks them and calls [`ReadCache::bad`] if they fail.
    pub async fn get(&self, key: LineKey, len: u64) -> Option<(usize, Bytes)> {
        let slot = self.slots().lookup(key);
        let Some(slot) = slot else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        match self.disk.read_at(slot as u64 * LINE, len as usize).await {
            Ok(b) if b.len() == len as usize => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some((slot, b))
            }
            // A cache that cannot be read is a miss.
            _ => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// `key`'s bytes in `slot` failed their check: a miss after all.
    pub fn bad(&self, key: LineKey, slot: usize) {
        self.bad.fetch_add(1, Ordering::Relaxed);
        self.hits.fetch_sub(1, Ordering::Relaxed);
        self.misses.fetch_add(1, Ordering::Relaxed);
        self.slots().forget(key, slot);
    }

    /// Keeps `data` (checked bytes of line `key`). Best effort: a failed
    /// write only forgets the line.
    pub async fn put(&self, key: LineKey, data: Bytes) {
        debug_assert!(data.len() as u64 <= LINE);
        let slot = self.slots().insert(key);
        if self.disk.write_at(vec![(slot as u64 * LINE, data)]).await.is_err() {
            self.slots().forget(key, slot);
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bad: self.bad.load(Ordering::Relaxed),
            lines: self.slots().len() as u64,
            capacity_lines: self.capacity as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line read since the hand passed survives one sweep; the others
    /// are evicted in turn; the map and owners stay consistent.
    #[test]
    fn clock_gives_read_lines_a_second_chance() {
        let mut s = Slots::new(3);
        let a = s.insert((1, 0));
        let b = s.insert((1, 1));
        let c = s.insert((1, 2));
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(s.insert((1, 1)), 1, "a line already held keeps its slot");
        assert_eq!(s.lookup((1, 0)), Some(0));
        // Full: (1,0) was read, so (1,1) goes first, then (1,2).
        assert_eq!(s.insert((2, 0)), 1);
        assert_eq!(s.lookup((1, 1)), None);
        assert_eq!(s.insert((2, 1)), 2);
        assert_eq!(s.lookup((1, 2)), None);
        // (1,0) lost its second chance on the sweep: it goes next.
        assert_eq!(s.insert((2, 2)), 0);
        assert_eq!(s.lookup((1, 0)), None);
        assert_eq!(s.len(), 3);
    }

    /// Every slot read since the last sweep: the hand clears them all and
    /// takes the one it started at.
    #[test]
    fn all_referenced_still_finds_a_slot() {
        let mut s = Slots::new(2);
        s.insert((1, 0));
        s.insert((1, 1));
        s.lookup((1, 0));
        s.lookup((1, 1));
        let slot = s.insert((3, 3));
        assert!(slot < 2);
        assert_eq!(s.lookup((3, 3)), Some(slot));
        assert_eq!(s.len(), 2);
    }

    /// Forgetting only drops the key if its slot still holds it.
    #[test]
    fn forget_checks_the_owner() {
        let mut s = Slots::new(1);
        let slot = s.insert((1, 0));
        s.insert((2, 0)); // evicts (1, 0) from the only slot
        s.forget((1, 0), slot);
        assert_eq!(s.lookup((2, 0)), Some(slot), "another line's slot is left alone");
        s.forget((2, 0), slot);
        assert!(s.is_empty());
        assert_eq!(s.insert((4, 0)), slot);
    }

    /// Against a model of which keys are present: the map never holds
    /// more than the capacity and lookups agree with the owners.
    #[test]
    fn random_operations_keep_map_and_owners_consistent() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let mut s = Slots::new(8);
        for _ in 0..10_000 {
            let key = (rng.random_range(0..4u64), rng.random_range(0..8u64));
            match rng.random_range(0..3) {
                0 => {
                    let slot = s.insert(key);
                    assert_eq!(s.lookup(key), Some(slot));
                }
                1 => {
                    if let Some(slot) = s.lookup(key) {
                        s.forget(key, slot);
                        assert_eq!(s.lookup(key), None);
                    }
                }
                _ => {
                    let _ = s.lookup(key);
                }
            }
            assert!(s.len() <= 8);
            for (slot, owner) in s.owner.iter().enumerate() {
                if let Some(k) = owner {
                    assert_eq!(s.map.get(k), Some(&slot));
                }
            }
            assert_eq!(s.owner.iter().filter(|o| o.is_some()).count(), s.len());
        }
    }
}
