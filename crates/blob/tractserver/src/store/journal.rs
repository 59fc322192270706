//! The chunk-entry journal at run time (its format, and why it exists:
//! `layout::journal`). Every change of chunk entries (a write, a trim, a
//! heal) appends records to a ring instead of writing the chunk table in
//! place; checkpoints copy memory's entries into the chunk table and move
//! the head past the records they cover, giving their space back.
//!
//! Invariants, each kept where it says:
//! - A change appends its records under its slot's write lock
//!   ([`Journal::append`]), in the same `write_at` as its data and in the
//!   order the in-place entry had: after the data of chunks written for the
//!   first time, before the data of overwritten ones (`Store::write_with`
//!   says why). So a process killed part-way leaves every chunk old or new.
//! - A record's `seq` and ring position are taken together, under one
//!   lock: both only grow, and the records of one chunk are in the order
//!   of its changes.
//! - Ring space is credit. A change holds credit for the most its records
//!   can take ([`layout::journal::write_credit`]) before it takes its slot
//!   lock, and credit exists only for ring space behind the durable head:
//!   a record is never written over a live one, and a change waiting for
//!   room holds no lock a checkpoint needs (so it cannot deadlock one).
//! - A checkpoint (`Store::checkpoint`) reads each slot that has records
//!   since the last one under its read lock, so the entries it writes are
//!   those of changes whose data and records are on disk (memory changes
//!   only after that, under the write lock); it syncs them before it writes
//!   the head past those records, and gives their space back only once the
//!   head is durable. A crash anywhere in between replays from the old
//!   head: records apply in `seq` order over whatever part of the table was
//!   written, which is idempotent.
//!
//! Recovery cases at open, added to `open.rs`'s table:
//!
//! | in the ring                                   | treated as                               |
//! |-----------------------------------------------|------------------------------------------|
//! | both head slots invalid                       | nothing journaled yet (a fresh disk)     |
//! | one head valid, or both                       | the valid one with the higher `seq`      |
//! | a valid record with `seq` below the head's    | dead: already in the chunk table         |
//! | a valid record with `seq` at or after the head | replayed onto the table, in `seq` order |
//! | an invalid record (torn, never written: a hole) | skipped; the change it belonged to stored nothing after it |
//! | live records out of order with their places   | refuse to open: not a ring this code wrote |

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use tokio::sync::{Notify, Semaphore};

use crate::layout::journal::{
    encode_record, record_len, write_credit, Head, Record, RECORD_ALIGN, RECORD_ENTRIES_MAX,
};

use super::*;

/// A record appended to the ring, to be written with its change.
pub(super) struct Appended {
    /// Where it goes on the disk.
    pub at: u64,
    pub bytes: Bytes,
    pub seq: u64,
    /// The chunks it sets.
    pub first_chunk: u32,
    pub count: u32,
}

/// Ring space a change may take, held from before its slot lock until its
/// records are appended; what it did not take goes back on drop.
pub(super) struct Credit<'a> {
    journal: &'a Journal,
    units: u32,
}

impl Drop for Credit<'_> {
    fn drop(&mut self) {
        if self.units > 0 {
            self.journal.room.add_permits(self.units as usize);
            self.journal.room_changed.notify_waiters();
        }
    }
}

struct State {
    /// The `seq` of the next record.
    next_seq: u64,
    /// The logical position of the next record.
    cursor: u64,
    /// The durable head: what a restart replays from.
    head: Head,
    /// The head slot holding `head` (the next head goes to the other).
    head_slot: u8,
    /// Slots with records since the last checkpoint began, and the chunk
    /// range `[lo, hi)` those records set.
    dirty: BTreeMap<u32, (u32, u32)>,
}

pub(super) struct Journal {
    ring_offset: u64,
    ring_len: u64,
    state: Mutex<State>,
    /// Free ring space, in [`RECORD_ALIGN`] units: the ring minus what lies
    /// between the durable head and the cursor, minus credit held.
    room: Semaphore,
    /// Wakes the background checkpoint once half the ring is in use.
    half_full: Notify,
    /// Wakes changes waiting for credit: some came back, or a checkpoint
    /// freed ring space.
    room_changed: Notify,
    /// One checkpoint at a time.
    checkpointing: tokio::sync::Mutex<()>,
    pub(super) checkpoints: AtomicU64,
}

impl Journal {
    /// The journal of `layout`'s disk, after open replayed it: `head` is in
    /// force (in `head_slot`), records lie up to `cursor`, the next gets
    /// `next_seq`, and `dirty` names what the replayed records set (the
    /// table does not have it yet).
    pub(super) fn new(
        layout: &Layout,
        (head, head_slot): (Head, u8),
        cursor: u64,
        next_seq: u64,
        dirty: BTreeMap<u32, (u32, u32)>,
    ) -> Journal {
        let ring_len = layout.journal_len;
        let used = cursor - head.position;
        assert!(used <= ring_len, "replayed records exceed the ring");
        Journal {
            ring_offset: layout.journal_ring_offset(),
            ring_len,
            state: Mutex::new(State { next_seq, cursor, head, head_slot, dirty }),
            room: Semaphore::new(((ring_len - used) / RECORD_ALIGN) as usize),
            half_full: Notify::new(),
            room_changed: Notify::new(),
            checkpointing: tokio::sync::Mutex::new(()),
            checkpoints: AtomicU64::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// (bytes of the ring in use, the ring's length).
    pub(super) fn usage(&self) -> (u64, u64) {
        let st = self.state();
        (st.cursor - st.head.position, self.ring_len)
    }

    /// Credit for a change of `chunks` entries, if the ring has room now.
    fn try_credit(&self, chunks: u32) -> Option<Credit<'_>> {
        let units = (write_credit(chunks) / RECORD_ALIGN) as u32;
        let permit = self.room.try_acquire_many(units).ok()?;
        permit.forget();
        Some(Credit { journal: self, units })
    }

    /// Appends the records setting entries `first_chunk..` of `slot` to
    /// `entries`, taking their space from `credit`. Called under the slot's
    /// write lock; the caller writes the returned records with its change,
    /// in order.
    pub(super) fn append(
        &self,
        credit: &mut Credit<'_>,
        slot: u32,
        first_chunk: u32,
        entries: &[ChunkEntry],
    ) -> Vec<Appended> {
        let mut st = self.state();
        let mut out = Vec::with_capacity(entries.len().div_ceil(RECORD_ENTRIES_MAX as usize));
        for (i, part) in entries.chunks(RECORD_ENTRIES_MAX as usize).enumerate() {
            let first = first_chunk + (i * RECORD_ENTRIES_MAX as usize) as u32;
            let len = record_len(part.len() as u32);
            // A record never crosses the ring's end: pad to it instead.
            let at_ring = st.cursor % self.ring_len;
            let pad = if at_ring + len > self.ring_len { self.ring_len - at_ring } else { 0 };
            let units = ((pad + len) / RECORD_ALIGN) as u32;
            assert!(units <= credit.units, "a change appended more than its journal credit covers");
            credit.units -= units;
            st.cursor += pad;
            let seq = st.next_seq;
            st.next_seq += 1;
            let at = self.ring_offset + st.cursor % self.ring_len;
            st.cursor += len;
            let range = st.dirty.entry(slot).or_insert((first, first));
            *range = (range.0.min(first), range.1.max(first + part.len() as u32));
            out.push(Appended {
                at,
                bytes: Bytes::from(encode_record(seq, slot, first, part)),
                seq,
                first_chunk: first,
                count: part.len() as u32,
            });
        }
        // Credit exists only for room behind the durable head.
        assert!(st.cursor - st.head.position <= self.ring_len, "the journal overran its head");
        if st.cursor - st.head.position >= self.ring_len / 2 {
            self.half_full.notify_one();
        }
        out
    }

    /// Starts a checkpoint: every record before the returned `(seq,
    /// position)` is covered by it, and the slots they set are handed over.
    fn begin(&self) -> (Head, u8, BTreeMap<u32, (u32, u32)>) {
        let mut st = self.state();
        let next = Head { seq: st.next_seq, position: st.cursor };
        (next, 1 - st.head_slot, std::mem::take(&mut st.dirty))
    }

    /// A checkpoint that could not finish: its slots are dirty again.
    fn abandon(&self, dirty: BTreeMap<u32, (u32, u32)>) {
        let mut st = self.state();
        for (slot, (lo, hi)) in dirty {
            let range = st.dirty.entry(slot).or_insert((lo, hi));
            *range = (range.0.min(lo), range.1.max(hi));
        }
    }

    /// The head `head` is durable in slot `which`: the ring behind it is
    /// free again.
    fn finish(&self, head: Head, which: u8) {
        let mut st = self.state();
        let freed = head.position - st.head.position;
        st.head = head;
        st.head_slot = which;
        self.room.add_permits((freed / RECORD_ALIGN) as usize);
        self.room_changed.notify_waiters();
    }
}

impl Store {
    /// Credit in the journal for a change of `chunks` entries, taken before
    /// the change's slot lock (the module's invariants). When the ring is
    /// full, this caller runs a checkpoint itself (or waits for the one
    /// running): the background loop usually starts one at half, but need
    /// not be running at all.
    pub(super) async fn journal_credit(&self, chunks: u32) -> Result<Credit<'_>, StoreError> {
        loop {
            if let Some(c) = self.journal.try_credit(chunks) {
                return Ok(c);
            }
            if self.commit.failed() {
                return Err(StoreError::Failed);
            }
            // Registered before looking again, so room that comes back in
            // between still wakes this change.
            let changed = self.journal.room_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(c) = self.journal.try_credit(chunks) {
                return Ok(c);
            }
            if self.journal.usage().0 > 0 {
                // Records hold the room: a checkpoint frees all of them.
                let g = self.journal.checkpointing.lock().await;
                if let Some(c) = self.journal.try_credit(chunks) {
                    return Ok(c);
                }
                self.checkpoint_holding(g).await?;
                continue;
            }
            // All of it is credit held by changes under way: it comes back
            // as they append (part of it) and end.
            changed.await;
        }
    }

    /// Copies the entries of every slot journaled since the last
    /// checkpoint into the chunk table, syncs, and moves the head past
    /// those records (the module's invariants). Durable on return.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        let g = self.journal.checkpointing.lock().await;
        self.checkpoint_holding(g).await
    }

    async fn checkpoint_holding(&self, _one: tokio::sync::MutexGuard<'_, ()>) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let (head, which, dirty) = self.journal.begin();
        if dirty.is_empty() && self.journal.usage().0 == 0 {
            return Ok(());
        }
        match self.write_table(&dirty, head, which).await {
            Ok(()) => {
                self.journal.finish(head, which);
                self.journal.checkpoints.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                tracing::error!(error = %e, "journal checkpoint failed; its records stay in the ring");
                self.journal.abandon(dirty);
                Err(e)
            }
        }
    }

    /// The checkpoint's writes: each dirty slot's entries from memory, a
    /// sync, the new head in slot `which`, a sync.
    async fn write_table(
        &self,
        dirty: &BTreeMap<u32, (u32, u32)>,
        head: Head,
        which: u8,
    ) -> Result<(), StoreError> {
        /// Bytes of table pieces written per `write_at`.
        const BATCH: usize = 4 << 20;
        let mut pieces: Vec<(u64, Bytes)> = Vec::new();
        let mut batched = 0usize;
        let skip = self.planted(PlantedBug::CheckpointSkipsTable);
        for (&slot, &(lo, hi)) in dirty.iter().filter(|_| !skip) {
            let Some(cell) = self.slots.get(slot as usize) else { continue };
            let table = {
                let g = cell.read().await;
                // A free slot's entries count for nothing (its slot entry,
                // durable, keeps its generation): leave them as they are.
                if !g.entry.used {
                    continue;
                }
                let hi = (hi as usize).min(g.chunks.len());
                let lo = (lo as usize).min(hi);
                let mut table = Vec::with_capacity((hi - lo) * CHUNK_ENTRY_LEN as usize);
                for e in &g.chunks[lo..hi] {
                    e.encode_into(&mut table);
                }
                (self.layout.chunk_entry_offset(slot, lo as u32), table)
            };
            batched += table.1.len();
            pieces.push((table.0, Bytes::from(table.1)));
            if batched >= BATCH {
                self.disk.write_at(std::mem::take(&mut pieces)).await?;
                batched = 0;
            }
        }
        if !pieces.is_empty() {
            self.disk.write_at(pieces).await?;
        }
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        self.disk
            .write_at(vec![(self.layout.journal_head_offset(which), Bytes::from(head.encode()))])
            .await?;
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        Ok(())
    }

    /// Runs checkpoints whenever half the ring is in use, so changes rarely
    /// wait for room. Runs until dropped (the server selects it against
    /// its shutdown).
    pub async fn checkpoint_loop(&self) {
        loop {
            self.journal.half_full.notified().await;
            let (used, len) = self.journal.usage();
            if used < len / 2 {
                continue;
            }
            if let Err(e) = self.checkpoint().await {
                tracing::warn!(error = %e, "background journal checkpoint failed");
            }
        }
    }

    /// (bytes of the journal's ring in use, its length).
    pub fn journal_usage(&self) -> (u64, u64) {
        self.journal.usage()
    }

    /// Journal checkpoints done since open.
    pub fn journal_checkpoints(&self) -> u64 {
        self.journal.checkpoints.load(Ordering::Relaxed)
    }

    /// The entries a restart would find for chunks `first..first + n` of a
    /// slot, after a change whose `appended` records may or may not have
    /// reached the disk (a failed `write_at`): a record that reads back
    /// whole counts; any other leaves what memory had (`before`).
    pub(super) async fn entries_after(
        &self,
        first: u32,
        before: Vec<ChunkEntry>,
        appended: &[Appended],
    ) -> io::Result<Vec<ChunkEntry>> {
        let mut entries = before;
        for a in appended {
            let b = self.disk.read_at(a.at, record_len(a.count) as usize).await?;
            let stored = crate::layout::journal::decode_record(
                &b,
                self.layout.slot_count,
                self.layout.chunks_per_tract(),
            );
            if let Some(Record { seq, entries: got, .. }) = stored.filter(|r| r.seq == a.seq) {
                debug_assert_eq!(seq, a.seq);
                for (i, e) in got.into_iter().enumerate() {
                    if let Some(slot) = entries.get_mut((a.first_chunk - first) as usize + i) {
                        *slot = e;
                    }
                }
            }
        }
        Ok(entries)
    }
}
