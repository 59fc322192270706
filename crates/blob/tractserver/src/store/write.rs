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
    pub async fn write_with(&self, w: TractWrite<'_>, current: Current<'_>) -> Result<(), StoreError> {
        let TractWrite { blob, incarnation, tract, version, offset, data, crcs, durability } = w;
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let len = data.len() as u32;
        if data.len() > self.layout.tract_size as usize {
            return Err(StoreError::OutOfRange { offset, len: u32::MAX, tract_size: self.layout.tract_size });
        }
        self.check_range(offset, len)?;
        if let Some(p) = first_bad_piece(offset, &data, crcs) {
            return Err(StoreError::BadCrc(p));
        }

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
        // What memory said before this write, to put back if it fails.
        let entry_before = g.entry;
        let mut chunks_before: Option<(Vec<ChunkEntry>, ChunkSet)> = None;
        let mut entry_dirty = fresh;
        if g.entry.incarnation != incarnation {
            chunks_before = Some((std::mem::take(&mut g.chunks), std::mem::take(&mut g.unsettled)));
            // A new life of this blob id: everything stored before is void.
            let generation = g.max_generation.wrapping_add(1).max(1);
            g.entry.incarnation = incarnation;
            g.entry.generation = generation;
            g.max_generation = generation;
            g.reset_chunks(vec![ChunkEntry::default(); self.layout.chunks_per_tract() as usize]);
            entry_dirty = true;
        }
        if version > g.entry.written_version {
            g.entry.written_version = version;
            entry_dirty = true;
        }

        let first_chunk = offset / CHUNK_SIZE;
        let last_chunk = (offset + len - 1) / CHUNK_SIZE;
        let mut new_entries: Vec<ChunkEntry> = Vec::with_capacity((last_chunk - first_chunk + 1) as usize);
        let generation = g.entry.generation;
        let entry = |crc: u32, prev: Option<u32>| ChunkEntry {
            crc,
            generation,
            prev_crc: prev.unwrap_or(0),
            prev_generation: if prev.is_some() { generation } else { 0 },
        };

        // Crash safety comes from the order of the writes (the kernel keeps
        // the order of system calls when the process dies):
        // - a chunk written for the first time gets its data before its
        //   entry: cut off in between, the chunk is still unwritten;
        // - an overwritten chunk gets its entry (new CRC and the previous
        //   one) before its data: cut off in between, the old bytes still
        //   read under the previous CRC.
        let mut first: Vec<(u64, Bytes)> = Vec::new();
        let mut over: Vec<(u64, Bytes)> = Vec::new();
        // Each piece is a whole chunk (stored as is, under the writer's CRC)
        // or part of one (merged with the verified old chunk first).
        // Consecutive whole chunks of the same kind are contiguous in `data`
        // and on disk: they go down as one write (one device I/O for a
        // whole tract).
        let mut run: Option<(bool, usize, usize)> = None;
        let flush_run = |run: Option<(bool, usize, usize)>,
                         first: &mut Vec<(u64, Bytes)>,
                         over: &mut Vec<(u64, Bytes)>| {
            if let Some((overwrite, rs, re)) = run {
                let w = (self.layout.data_offset_of(slot, offset + rs as u32), data.slice(rs..re));
                if overwrite {
                    over.push(w);
                } else {
                    first.push(w);
                }
            }
        };
        // Nothing is on the disk yet: a refusal here (a chunk that cannot
        // be merged, a failed read) puts memory back as it was.
        let built = async {
            for ((s, e), &crc) in pieces(offset, len).zip(crcs) {
                let abs = offset + s as u32;
                let chunk = abs / CHUNK_SIZE;
                let old = g.chunks.get(chunk as usize).copied().unwrap_or_default();
                let overwrite = old.generation == generation && generation != 0;
                if e - s == CHUNK_SIZE as usize {
                    run = match run {
                        Some((ow, rs, re)) if re == s && ow == overwrite => Some((ow, rs, e)),
                        r => {
                            flush_run(r, &mut first, &mut over);
                            Some((overwrite, s, e))
                        }
                    };
                    // The previous CRC must be the bytes' own: for an
                    // unsettled chunk only the disk knows it.
                    let prev = if overwrite && g.unsettled.contains(chunk) {
                        self.settle_from_disk(slot, &mut g, chunk).await?.unwrap_or(old.crc)
                    } else {
                        old.crc
                    };
                    new_entries.push(entry(crc, overwrite.then_some(prev)));
                    continue;
                }
                let at = (abs % CHUNK_SIZE) as usize;
                // Merged into a buffer aligned for direct I/O.
                let merge = |old_bytes: &[u8]| {
                    let mut merged = blizzard_env::aligned_buffer(CHUNK_SIZE as usize);
                    merged.extend_from_slice(&old_bytes[..at]);
                    merged.extend_from_slice(&data[s..e]);
                    merged.extend_from_slice(&old_bytes[at + (e - s)..]);
                    merged
                };
                let (merged, new_entry) = match self.read_chunk_verified(slot, &g, chunk).await {
                    Ok((old_bytes, old_crc)) => {
                        let merged = merge(&old_bytes);
                        let crc = crc32c(&merged);
                        (merged, entry(crc, overwrite.then_some(old_crc)))
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
                        tracing::info!(
                            slot,
                            chunk,
                            "a torn chunk is made whole by the write it was cut off in"
                        );
                        (merged, old)
                    }
                    Err(e) => return Err(e),
                };
                let w = (self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), merged.freeze());
                if overwrite {
                    over.push(w);
                } else {
                    first.push(w);
                }
                new_entries.push(new_entry);
            }
            Ok(())
        }
        .await;
        if let Err(e) = built {
            if fresh {
                self.give_back(slot, &mut g, blob, tract);
            } else {
                g.entry = entry_before;
                if let Some((chunks, unsettled)) = chunks_before {
                    g.chunks = chunks;
                    g.unsettled = unsettled;
                }
            }
            return Err(e);
        }
        flush_run(run, &mut first, &mut over);
        debug_assert_eq!(new_entries.len(), piece_count(offset, len));
        let chunks_written = self.whole_chunks(slot, first_chunk, new_entries.len(), &first, &over);
        // The entries go to the journal where the chunk table's piece went:
        // after first-written data, before overwritten data.
        let appended = self.journal.append(&mut credit, slot, first_chunk, &new_entries);
        drop(credit);
        let mut writes = first;
        writes.extend(appended.iter().map(|a| (a.at, a.bytes.clone())));
        writes.extend(over);
        if entry_dirty {
            writes.push((self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&g.entry.encode())));
        }
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
                fresh,
                entry_dirty,
                entry_before,
                chunks_before,
                Changed { first_chunk, chunks: new_entries.len() as u32, appended: &appended },
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
        let chunks = new_entries.len() as u32;
        // The record's CRCs (one per whole chunk), only for a write the
        // journal takes: no allocation on the path of the others.
        let chunk_crcs: Vec<u32> = match chunks_written {
            Some(_) => new_entries.iter().map(|e| e.crc).collect(),
            None => Vec::new(),
        };
        // Memory now knows every written chunk's bytes: the new ones.
        g.settle_chunks(first_chunk, new_entries);
        // Its place in the backup journal's order, if there is one, taken
        // under the lock and after the bytes are applied (`backup.rs`).
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version,
            offset: first_chunk * CHUNK_SIZE,
            len: chunks * CHUNK_SIZE,
            write: chunks_written.as_deref().map(|w| (&chunk_crcs[..], w)),
            whole_tract: chunks_before.is_some(),
        };
        let journaled = self.journal_change(&change).await;
        drop(g);
        // Durable before acknowledged: in the backup journal, or by a group
        // commit of the data disk that started after our writes completed.
        let disk_sync = durability == Durability::Synced && !self.planted(PlantedBug::AckBeforeSync);
        self.make_durable(journaled?, disk_sync).await?;
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
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
    #[allow(clippy::too_many_arguments)]
    async fn undo_failed_write(
        &self,
        slot: u32,
        g: &mut SlotState,
        (blob, tract): (BlobId, TractNo),
        fresh: bool,
        entry_dirty: bool,
        entry_before: SlotEntry,
        chunks_before: Option<(Vec<ChunkEntry>, ChunkSet)>,
        changed: Changed<'_>,
    ) {
        let Changed { first_chunk, chunks, appended } = changed;
        let meant = g.entry;
        // Where the write's records did not reach the disk, the entries a
        // restart reads are those from before it: a new incarnation's
        // write had reset memory's, so they are the old ones.
        let before = entry_range(chunks_before.as_ref().map_or(&g.chunks, |(c, _)| c), first_chunk, chunks);
        let read = async {
            let record = if entry_dirty {
                let b =
                    self.disk.read_at(self.layout.slot_entry_offset(slot), SLOT_ENTRY_LEN as usize).await?;
                Some(SlotEntry::decode(&b))
            } else {
                None
            };
            let back = self.read_back(slot, first_chunk, chunks, before, appended).await?;
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
            if fresh {
                self.give_back(slot, g, blob, tract);
            } else {
                g.entry = entry_before;
                if let Some((chunks, unsettled)) = chunks_before {
                    g.chunks = chunks;
                    g.unsettled = unsettled;
                }
            }
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
