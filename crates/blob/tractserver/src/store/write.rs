//! Tract writes: checking them, building the chunks they leave (partial
//! pieces merged with the verified old chunk), the crash-safe order of
//! data, chunk entries and slot entry, their place in the backup journal
//! (`backup.rs`), and memory put back as the disk holds it when a write
//! fails part-way.

use super::*;

impl Store {
    /// Writes `data` at `offset` in a tract. `crcs` are the writer's CRC32C
    /// of each piece; they are verified before anything is stored, and full
    /// chunks are stored under the writer's own CRC. Returns once durable.
    #[allow(clippy::too_many_arguments)]
    pub async fn write(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        version: u64,
        offset: u32,
        data: Bytes,
        crcs: &[u32],
    ) -> Result<(), StoreError> {
        let w = TractWrite {
            blob,
            incarnation,
            tract,
            version,
            offset,
            data,
            crcs,
            durability: Durability::Synced,
        };
        self.write_with(w, ALWAYS).await
    }

    /// Makes every write applied so far durable (one group commit).
    pub async fn sync(&self) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        self.commit.sync().await.map_err(|_| StoreError::Failed)
    }

    /// [`Store::write`], returning once durable (`Synced`) or once applied
    /// (`Cached`: durable after the next [`Store::sync`], and it survives
    /// a kill of this process, since the kernel holds it). `current` is
    /// asked under the slot lock whether the write may still apply.
    ///
    /// In four steps, each its own function: the slot's entry changes in
    /// memory (`Before::begin`), the pieces are built with nothing yet on
    /// the disk (`build_pieces`), everything goes to the disk in the
    /// crash-safe order (`crash_safe_order`), and memory then takes the
    /// new chunks and the write waits until durable (`finish_write`). A
    /// failure before the disk write puts memory back as it was; one
    /// during it takes what the disk holds (`undo_failed_write`).
    pub async fn write_with(&self, w: TractWrite<'_>, current: Current<'_>) -> Result<(), StoreError> {
        self.check_write(&w)?;
        let TractWrite { blob, incarnation, tract, version, offset, ref data, crcs, durability } = w;
        let len = data.len() as u32;
        // Room in the journal for this write's records, before the slot
        // lock (`journal.rs`: a change waiting for room holds no lock).
        let mut credit = self.journal_credit(piece_count(offset, len) as u32).await?;
        let (slot, mut g, fresh) = self.lock_slot_for_write(blob, tract, incarnation, version).await?;
        if !current() {
            if fresh {
                self.give_back(slot, &mut g, blob, tract);
            }
            return Err(StoreError::Superseded);
        }
        let before = Before::begin(&mut g, fresh, incarnation, version, self.layout.chunks_per_tract());
        // Nothing is on the disk yet: a refusal here (a chunk that cannot
        // be merged, a failed read) puts memory back as it was.
        let pieces = match self.build_pieces(slot, &mut g, offset, data, crcs).await {
            Ok(p) => p,
            Err(e) => {
                self.put_back(slot, &mut g, (blob, tract), before);
                return Err(e);
            }
        };
        let first_chunk = offset / CHUNK_SIZE;
        let chunks = pieces.entries.len() as u32;
        debug_assert_eq!(pieces.entries.len(), piece_count(offset, len));
        let chunks_written =
            self.whole_chunks(slot, first_chunk, pieces.entries.len(), &pieces.first, &pieces.over);
        let appended = self.journal.append(&mut credit, slot, first_chunk, &pieces.entries);
        drop(credit);
        let slot_entry = before
            .entry_dirty
            .then(|| (self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&g.entry.encode())));
        let Pieces { first, over, entries } = pieces;
        let writes = crash_safe_order(first, &appended, over, slot_entry);
        let written = {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(writes).await
        };
        if let Err(e) = written {
            tracing::error!(slot, error = %e, "tract write failed");
            self.undo_failed_write(
                slot,
                &mut g,
                (blob, tract),
                before,
                Changed { first_chunk, chunks, appended: &appended },
            )
            .await;
            drop(g);
            // What part of it landed is made durable now rather than at the
            // next group commit (with a backup journal, the next destage):
            // left in the page cache, a power loss could tear an
            // overwritten chunk between its old and new bytes, and with no
            // other replica to heal from the retried write could never
            // merge into it (`blob-sim --seed 200724 --replication 1
            // --tractservers 4 --joining 2`). A sync that fails here fails
            // the disk, as the next one would have.
            let _ = self.commit.sync().await;
            return Err(e.into());
        }
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version,
            offset: first_chunk * CHUNK_SIZE,
            len: chunks * CHUNK_SIZE,
            write: None,
            whole_tract: before.chunks.is_some(),
        };
        self.finish_write(g, first_chunk, entries, change, chunks_written, durability).await?;
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// What is checked before a write takes any lock: a working disk, a
    /// range inside the tract, and the writer's CRC of every piece.
    fn check_write(&self, w: &TractWrite<'_>) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        if w.data.len() > self.layout.tract_size as usize {
            return Err(StoreError::OutOfRange {
                offset: w.offset,
                len: u32::MAX,
                tract_size: self.layout.tract_size,
            });
        }
        self.check_range(w.offset, w.data.len() as u32)?;
        if let Some(p) = first_bad_piece(w.offset, &w.data, w.crcs) {
            return Err(StoreError::BadCrc(p));
        }
        Ok(())
    }

    /// After a write's bytes are on the disk: memory takes the new chunk
    /// entries (`first_chunk..`), the write takes its place in the backup
    /// journal's order (under the slot lock, `backup.rs`), and, once the
    /// lock is released, waits until durable as `durability` asks.
    async fn finish_write(
        &self,
        mut g: tokio::sync::RwLockWriteGuard<'_, SlotState>,
        first_chunk: u32,
        entries: Vec<ChunkEntry>,
        mut change: backup::Change<'_>,
        chunks_written: Option<Vec<u8>>,
        durability: Durability,
    ) -> Result<(), StoreError> {
        // The record's CRCs (one per whole chunk), only for a write the
        // journal takes: no allocation on the path of the others.
        let chunk_crcs: Vec<u32> = match chunks_written {
            Some(_) => entries.iter().map(|e| e.crc).collect(),
            None => Vec::new(),
        };
        // Memory now knows every written chunk's bytes: the new ones.
        g.settle_chunks(first_chunk, entries);
        change.write = chunks_written.as_deref().map(|w| (&chunk_crcs[..], w));
        let journaled = self.journal_change(&change).await;
        drop(g);
        // Durable before acknowledged: in the backup journal, or by a group
        // commit of the data disk that started after our writes completed.
        let disk_sync = durability == Durability::Synced && !self.planted(PlantedBug::AckBeforeSync);
        self.make_durable(journaled?, disk_sync).await
    }

    /// The pieces a write of `data` at `offset` leaves in `slot`, built
    /// with nothing written yet: each piece is a whole chunk (stored as
    /// is, under the writer's CRC) or part of one (merged with the
    /// verified old chunk first, [`Store::merge_partial`]), with the new
    /// chunk entry of each.
    async fn build_pieces(
        &self,
        slot: u32,
        g: &mut SlotState,
        offset: u32,
        data: &Bytes,
        crcs: &[u32],
    ) -> Result<Pieces, StoreError> {
        let len = data.len() as u32;
        let generation = g.entry.generation;
        let mut out = Pieces {
            first: Vec::new(),
            over: Vec::new(),
            entries: Vec::with_capacity(piece_count(offset, len)),
        };
        // Consecutive whole chunks of the same kind are contiguous in
        // `data` and on disk: they go down as one write (one device I/O
        // for a whole tract).
        let mut run = Run::default();
        let data_at = |s: usize| self.layout.data_offset_of(slot, offset + s as u32);
        for ((s, e), &crc) in pieces(offset, len).zip(crcs) {
            let chunk = (offset + s as u32) / CHUNK_SIZE;
            let old = g.chunks.get(chunk as usize).copied().unwrap_or_default();
            let overwrite = old.generation == generation && generation != 0;
            if e - s == CHUNK_SIZE as usize {
                if let Some(done) = run.extend(overwrite, s, e) {
                    out.push(done.overwrite, (data_at(done.start), data.slice(done.start..done.end)));
                }
                // The previous CRC must be the bytes' own: for an
                // unsettled chunk only the disk knows it.
                let prev = if overwrite && g.unsettled.contains(chunk) {
                    self.settle_from_disk(slot, g, chunk).await?.unwrap_or(old.crc)
                } else {
                    old.crc
                };
                out.entries.push(new_entry(crc, generation, overwrite.then_some(prev)));
                continue;
            }
            let at = ((offset + s as u32) % CHUNK_SIZE) as usize;
            let (merged, entry) = self.merge_partial(slot, g, chunk, at, &data[s..e], old, overwrite).await?;
            out.push(overwrite, (self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), merged));
            out.entries.push(entry);
        }
        if let Some(done) = run.take() {
            out.push(done.overwrite, (data_at(done.start), data.slice(done.start..done.end)));
        }
        Ok(out)
    }

    /// A partial piece (`new` at byte `at` of `chunk`) merged into the
    /// chunk's verified old bytes, in a buffer aligned for direct I/O, and
    /// the chunk's new entry. `old` is the chunk's entry in memory.
    #[allow(clippy::too_many_arguments)]
    async fn merge_partial(
        &self,
        slot: u32,
        g: &mut SlotState,
        chunk: u32,
        at: usize,
        new: &[u8],
        old: ChunkEntry,
        overwrite: bool,
    ) -> Result<(Bytes, ChunkEntry), StoreError> {
        let generation = g.entry.generation;
        let merge = |old_bytes: &[u8]| {
            let mut merged = blizzard_env::aligned_buffer(CHUNK_SIZE as usize);
            merged.extend_from_slice(&old_bytes[..at]);
            merged.extend_from_slice(new);
            merged.extend_from_slice(&old_bytes[at + new.len()..]);
            merged
        };
        match self.read_chunk_verified(slot, g, chunk).await {
            Ok((old_bytes, old_crc)) => {
                let merged = merge(&old_bytes);
                let crc = crc32c(&merged);
                Ok((merged.freeze(), new_entry(crc, generation, overwrite.then_some(old_crc))))
            }
            // A torn chunk: the bytes match neither CRC its entry
            // accepts. Power loss cut off a partial write into it
            // (cached, or waiting for its group commit) whose entry
            // reached the disk and whose data reached it only in
            // part, sector by sector. That write stored the whole
            // merged chunk: outside its range the very bytes that
            // were there before (which both CRCs of the entry
            // agree on there), inside it a mix of old and new. Its
            // writer, whose sync failed, now writes the same range
            // again: merged into the raw bytes, the request
            // replaces the whole mixed part, so the result is
            // exactly the chunk the cut-off write meant to leave,
            // which is what the entry's current CRC describes. The
            // CRC is then the test: a match proves the bytes
            // outside the range right too (as far as any stored
            // chunk is proved by its CRC), and makes the chunk
            // whole again; anything else (another write, bytes
            // rotted outside the range) still cannot be merged.
            // With one replica nothing else could ever repair it
            // (`heal_chunk` has no complete replica to copy from),
            // and the retried write, acknowledged to a fast-ack
            // volume's user, could never complete. The entry stays
            // as it is (it already names these bytes), written
            // again before them like any overwrite's: cut off once
            // more, the chunk is as torn as it was.
            Err(StoreError::Corrupt { .. }) if overwrite => {
                let at_disk = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
                // A cut-off first write (its entry names no previous
                // contents) meant zeros around its range, whatever an
                // earlier tenant of the slot left on the disk there.
                let raw = if old.prev_generation == old.generation {
                    self.disk.read_at(at_disk, CHUNK_SIZE as usize).await?
                } else {
                    Bytes::from(vec![0u8; CHUNK_SIZE as usize])
                };
                let merged = merge(&raw);
                if crc32c(&merged) != old.crc {
                    // Memory no longer vouches for these bytes: the
                    // next digest reads them (`Unreadable`).
                    g.unsettled.insert(chunk);
                    return Err(StoreError::Corrupt { slot, chunk });
                }
                tracing::info!(slot, chunk, "a torn chunk is made whole by the write it was cut off in");
                Ok((merged.freeze(), old))
            }
            Err(e) => Err(e),
        }
    }

    /// Memory as it was before a write that stored nothing: a slot taken
    /// for it is given back, else the entry (and a previous incarnation's
    /// chunks) return.
    fn put_back(&self, slot: u32, g: &mut SlotState, (blob, tract): (BlobId, TractNo), before: Before) {
        if before.fresh {
            self.give_back(slot, g, blob, tract);
        } else {
            before.restore(g);
        }
    }

    /// Makes memory describe the disk again after a failed `write_at` (EIO,
    /// ENOSPC on a device that filled up), which may have stored any prefix
    /// of the write's pieces: data of first-written chunks, then the chunk
    /// entries (themselves perhaps only in part), then data of overwritten
    /// chunks, then the slot entry (if it changed).
    ///
    /// Memory must say what a restart would read (and a digest reports
    /// memory): keeping the old view because the write was not
    /// acknowledged is not enough. Replicas are reconciled on what digests
    /// report, and a later restart of this server would read the disk and
    /// bring the unacknowledged write back on this replica alone. So what
    /// the write may have stored is read back and taken as open would take
    /// it:
    ///
    /// - The slot entry (only if the write changed it), last of the write:
    ///   if it is not there, memory takes back the entry it had (a fresh
    ///   slot is given back, a new incarnation's generation is dropped with
    ///   the chunks it had); if it is, memory keeps the new one (a fresh
    ///   slot stays this tract's). `max_generation` stays raised either
    ///   way: entries of that generation may be on disk and must never
    ///   count for a later one.
    /// - The entries of every chunk the write covered, from the disk, each
    ///   settled against the bytes beside it ([`settle`]): a first write's
    ///   entry on disk means its data is there too (the data went first);
    ///   an overwrite's entry went before its data, so the bytes say
    ///   whether they are new or old; an entry the write did not reach is
    ///   the one memory had. Bytes matching nothing the entry accepts (a
    ///   short write; a new incarnation's data over an entry of the old
    ///   one) leave the chunk unsettled: a digest reads it (`Unreadable`),
    ///   and the scrubber or a repair replaces it.
    ///
    /// If that cannot be read (a disk failing reads too), memory cannot
    /// know what a restart would find, and no digest may answer for it: the
    /// disk is distrusted as after a failed `fdatasync` (every write, trim,
    /// sync and digest refused, [`Store::distrust`]); a restart rebuilds
    /// memory from whatever the disk then holds.
    async fn undo_failed_write(
        &self,
        slot: u32,
        g: &mut SlotState,
        key: (BlobId, TractNo),
        before: Before,
        changed: Changed<'_>,
    ) {
        let Changed { first_chunk, chunks, appended } = changed;
        let (fresh, entry_dirty) = (before.fresh, before.entry_dirty);
        let meant = g.entry;
        // Where the write's records did not reach the disk, the entries a
        // restart reads are those from before it: a new incarnation's
        // write had reset memory's, so they are the old ones.
        let old_entries =
            entry_range(before.chunks.as_ref().map_or(&g.chunks, |(c, _)| c), first_chunk, chunks);
        let read = async {
            let record = if entry_dirty {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks, old_entries, appended).await?;
            Ok::<_, io::Error>((record, back))
        }
        .await;
        let stored = match &read {
            // Unchanged by the write: on disk as in memory.
            Ok((None, _)) => Some(true),
            Ok((Some(SlotRecord::Valid(e)), _)) => Some(*e == meant),
            // Not the new entry (a fresh slot's previous state).
            Ok((Some(SlotRecord::Blank), _)) => Some(false),
            // Half-written: a restart would quarantine the slot.
            Ok((Some(SlotRecord::Damaged), _)) | Err(_) => None,
        };
        if stored != Some(true) {
            self.put_back(slot, g, key, before);
        }
        match (stored, read) {
            (Some(_), Ok((_, (entries, data)))) => {
                if g.entry.used && !(fresh && stored == Some(false)) {
                    take_from_disk(g, first_chunk, &entries, &data);
                }
            }
            (_, read) => {
                let why = match read {
                    Err(e) => format!("reading it back failed: {e}"),
                    Ok(_) => "its slot entry is damaged on disk".to_string(),
                };
                self.distrust(slot, &why);
            }
        }
    }
}

/// A chunk's entry after a write that leaves bytes with CRC `crc` under
/// `generation`; `prev` is the CRC of the bytes it overwrites, if it
/// overwrites any of this generation (stored, so that a crash between
/// entry and data leaves the old bytes readable).
fn new_entry(crc: u32, generation: u32, prev: Option<u32>) -> ChunkEntry {
    ChunkEntry {
        crc,
        generation,
        prev_crc: prev.unwrap_or(0),
        prev_generation: if prev.is_some() { generation } else { 0 },
    }
}

/// What a write changed of its slot in memory before building its pieces
/// (the slot entry, and the chunks of a previous incarnation), to put
/// back if none of it reaches the disk.
struct Before {
    /// The slot was taken for this write (it held nothing before).
    fresh: bool,
    entry: SlotEntry,
    /// The previous incarnation's chunks, if the write begins a new one.
    chunks: Option<(Vec<ChunkEntry>, ChunkSet)>,
    /// The slot entry changed: it is written (last) with the data.
    entry_dirty: bool,
}

impl Before {
    /// Makes `g` describe the slot as a write of `incarnation` at TLT row
    /// `version` leaves it, and returns what it was. A new incarnation of
    /// the blob voids everything stored before: a new generation, above
    /// every one seen in the slot, and no chunks written. A newer row
    /// version is recorded.
    fn begin(
        g: &mut SlotState,
        fresh: bool,
        incarnation: Incarnation,
        version: u64,
        chunks_per_tract: u32,
    ) -> Self {
        let mut before = Before { fresh, entry: g.entry, chunks: None, entry_dirty: fresh };
        if g.entry.incarnation != incarnation {
            before.chunks = Some((std::mem::take(&mut g.chunks), std::mem::take(&mut g.unsettled)));
            let generation = g.max_generation.wrapping_add(1).max(1);
            g.entry.incarnation = incarnation;
            g.entry.generation = generation;
            g.max_generation = generation;
            g.reset_chunks(vec![ChunkEntry::default(); chunks_per_tract as usize]);
            before.entry_dirty = true;
        }
        if version > g.entry.written_version {
            g.entry.written_version = version;
            before.entry_dirty = true;
        }
        before
    }

    /// Puts back in `g` what [`Before::begin`] changed. `max_generation`
    /// stays raised: entries of that generation may be on the disk and
    /// must never count for a later one.
    fn restore(self, g: &mut SlotState) {
        g.entry = self.entry;
        if let Some((chunks, unsettled)) = self.chunks {
            g.chunks = chunks;
            g.unsettled = unsettled;
        }
    }
}

/// A write's data-disk writes and new chunk entries, built before any of
/// it is written ([`Store::build_pieces`]).
struct Pieces {
    /// Data of chunks written for the first time in their generation.
    first: Vec<(u64, Bytes)>,
    /// Data of chunks overwritten.
    over: Vec<(u64, Bytes)>,
    /// One per piece, in order.
    entries: Vec<ChunkEntry>,
}

impl Pieces {
    fn push(&mut self, overwrite: bool, write: (u64, Bytes)) {
        if overwrite {
            self.over.push(write);
        } else {
            self.first.push(write);
        }
    }
}

/// Whole chunks of one kind (first written or overwritten), contiguous in
/// the write's data: `data[start..end]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RunSpan {
    overwrite: bool,
    start: usize,
    end: usize,
}

/// Gathers consecutive whole chunks of the same kind into runs, so each
/// run goes to the disk as one write.
#[derive(Default)]
struct Run {
    open: Option<RunSpan>,
}

impl Run {
    /// Adds the whole chunk at `data[start..end]`; returns the run it
    /// closes, if it starts a new one.
    fn extend(&mut self, overwrite: bool, start: usize, end: usize) -> Option<RunSpan> {
        match self.open {
            Some(r) if r.end == start && r.overwrite == overwrite => {
                self.open = Some(RunSpan { end, ..r });
                None
            }
            closed => {
                self.open = Some(RunSpan { overwrite, start, end });
                closed
            }
        }
    }

    /// The run still open, if any.
    fn take(&mut self) -> Option<RunSpan> {
        self.open.take()
    }
}

/// A write's disk writes in the order that keeps it crash-safe. The
/// kernel keeps the order of system calls when the process dies, so a
/// write cut off anywhere leaves every chunk old or new:
/// - a chunk written for the first time gets its data before its entry:
///   cut off in between, the chunk is still unwritten;
/// - an overwritten chunk gets its entry (new CRC and the previous one)
///   before its data: cut off in between, the old bytes still read under
///   the previous CRC;
/// - the slot entry, if it changed, goes last (`undo_failed_write` reads
///   the write back in this order).
///
/// The entries are journal records (`appended`), placed where the chunk
/// table's piece would go.
fn crash_safe_order(
    first: Vec<(u64, Bytes)>,
    appended: &[Appended],
    over: Vec<(u64, Bytes)>,
    slot_entry: Option<(u64, Bytes)>,
) -> Vec<(u64, Bytes)> {
    let mut writes = first;
    writes.reserve(appended.len() + over.len() + 1);
    writes.extend(appended.iter().map(|a| (a.at, a.bytes.clone())));
    writes.extend(over);
    writes.extend(slot_entry);
    writes
}

#[cfg(test)]
mod write_tests {
    use super::*;

    fn slot(incarnation: u64, generation: u32, written_version: u64, chunks: usize) -> SlotState {
        SlotState {
            entry: SlotEntry {
                used: true,
                generation,
                blob: BlobId(7),
                incarnation,
                tract: TractNo(0),
                written_version,
                alloc_seq: 1,
            },
            chunks: vec![new_entry(0xAB, generation, None); chunks],
            unsettled: ChunkSet::default(),
            max_generation: generation + 3,
        }
    }

    /// The same incarnation at an older or equal row version changes
    /// nothing; a newer version is recorded and makes the entry dirty.
    #[test]
    fn a_write_of_the_same_life_changes_the_entry_only_for_a_newer_version() {
        let mut g = slot(1, 5, 10, 4);
        let b = Before::begin(&mut g, false, 1, 9, 4);
        assert!(!b.entry_dirty && b.chunks.is_none());
        assert_eq!(g.entry.written_version, 10);
        let b = Before::begin(&mut g, false, 1, 11, 4);
        assert!(b.entry_dirty && b.chunks.is_none());
        assert_eq!((g.entry.written_version, g.entry.generation), (11, 5));
        b.restore(&mut g);
        assert_eq!(g.entry.written_version, 10);
    }

    /// A new incarnation takes a generation above every one seen, starts
    /// with no chunk written, and restore brings the old life back
    /// (keeping `max_generation` raised).
    #[test]
    fn a_new_incarnation_voids_the_chunks_and_restore_brings_them_back() {
        let mut g = slot(1, 5, 10, 4);
        g.unsettled.insert(2);
        let b = Before::begin(&mut g, false, 2, 3, 4);
        assert!(b.entry_dirty);
        assert_eq!(g.entry.incarnation, 2);
        assert_eq!(g.entry.generation, 9);
        assert_eq!(g.max_generation, 9);
        assert!(g.chunks.iter().all(|c| *c == ChunkEntry::default()));
        assert!(!g.unsettled.contains(2));
        b.restore(&mut g);
        assert_eq!((g.entry.incarnation, g.entry.generation), (1, 5));
        assert_eq!(g.chunks, vec![new_entry(0xAB, 5, None); 4]);
        assert!(g.unsettled.contains(2));
        assert_eq!(g.max_generation, 9, "entries of generation 9 may be on disk");
    }

    /// A fresh slot's entry is always written.
    #[test]
    fn a_fresh_slot_is_dirty() {
        let mut g = slot(1, 5, 10, 4);
        let b = Before::begin(&mut g, true, 1, 1, 4);
        assert!(b.fresh && b.entry_dirty);
    }

    /// Runs join contiguous whole chunks of one kind, and close on a gap
    /// or a change of kind.
    #[test]
    fn runs_join_contiguous_chunks_of_one_kind() {
        let c = CHUNK_SIZE as usize;
        let mut r = Run::default();
        assert_eq!(r.extend(false, 0, c), None);
        assert_eq!(r.extend(false, c, 2 * c), None);
        assert_eq!(r.extend(true, 2 * c, 3 * c), Some(RunSpan { overwrite: false, start: 0, end: 2 * c }));
        assert_eq!(r.extend(true, 4 * c, 5 * c), Some(RunSpan { overwrite: true, start: 2 * c, end: 3 * c }));
        assert_eq!(r.take(), Some(RunSpan { overwrite: true, start: 4 * c, end: 5 * c }));
        assert_eq!(r.take(), None);
    }

    /// First-written data, then the entries, then overwritten data, then
    /// the slot entry.
    #[test]
    fn writes_go_in_crash_safe_order() {
        let b = |n: u8| Bytes::from(vec![n]);
        let appended = vec![Appended { at: 900, bytes: b(2), seq: 1, first_chunk: 0, count: 2 }];
        let order = crash_safe_order(vec![(100, b(1))], &appended, vec![(200, b(3))], Some((50, b(4))));
        let at: Vec<u64> = order.iter().map(|(a, _)| *a).collect();
        assert_eq!(at, vec![100, 900, 200, 50]);
        let order = crash_safe_order(Vec::new(), &appended, Vec::new(), None);
        assert_eq!(order.len(), 1);
    }
}
