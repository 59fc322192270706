//! Trims and deletes: unmapping a range of a tract (whole chunks marked
//! unwritten, partial ones zeroed in place), freeing a tract's slot, and
//! memory put back as the disk holds it when a trim fails part-way.

use super::*;

impl Store {
    /// Unmaps `[offset, offset + len)` of a tract: whole chunks are marked
    /// unwritten (they read as zeros), partial chunks are zeroed in place,
    /// and a tract left with nothing written gives its slot back. Durable
    /// on return.
    pub async fn trim(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
        current: Current<'_>,
    ) -> Result<(), StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        self.check_range(offset, len)?;
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else {
            return Ok(());
        };
        let Some(cell) = self.slots.get(slot as usize) else {
            return Ok(());
        };
        let mut credit = self.journal_credit(piece_count(offset, len) as u32).await?;
        let mut g = cell.write().await;
        if !current() {
            return Err(StoreError::Superseded);
        }
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(());
        }
        let generation = g.entry.generation;
        let first_chunk = offset / CHUNK_SIZE;
        let mut writes: Vec<(u64, Bytes)> = Vec::new();
        let mut new_entries = Vec::new();
        for (s, e) in pieces(offset, len) {
            let abs = offset + s as u32;
            let chunk = abs / CHUNK_SIZE;
            let written =
                g.chunks.get(chunk as usize).is_some_and(|c| c.generation == generation && generation != 0);
            if e - s == CHUNK_SIZE as usize || !written {
                // Unwritten: reads as zeros, whatever the bytes on disk say.
                new_entries.push(ChunkEntry::default());
            } else {
                let (old, old_crc) = self.read_chunk_verified(slot, &g, chunk).await?;
                let at = (abs % CHUNK_SIZE) as usize;
                let mut merged = blizzard_env::aligned_buffer(CHUNK_SIZE as usize);
                merged.extend_from_slice(&old[..at]);
                merged.resize(at + (e - s), 0);
                merged.extend_from_slice(&old[at + (e - s)..]);
                // An overwrite: entry (with the previous CRC) before data.
                new_entries.push(ChunkEntry {
                    crc: crc32c(&merged),
                    generation,
                    prev_crc: old_crc,
                    prev_generation: generation,
                });
                writes.push((self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), merged.freeze()));
            }
        }
        // Entries (the journal's records) before the partial chunks' data,
        // as for any overwrite.
        let appended = self.journal.append(&mut credit, slot, first_chunk, &new_entries);
        drop(credit);
        writes.splice(0..0, appended.iter().map(|a| (a.at, a.bytes.clone())));
        let range = first_chunk as usize..first_chunk as usize + new_entries.len();
        let empty = g.chunks.iter().enumerate().all(|(i, c)| {
            let c = if range.contains(&i) { &new_entries[i - range.start] } else { c };
            c.generation != generation || generation == 0
        });
        if empty {
            let freed = SlotEntry { used: false, ..g.entry };
            writes.push((self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&freed.encode())));
        }
        // Memory changes only once the disk has it all. A failed write may
        // have stored any prefix of it (entries, then partial chunks' data,
        // then the freed slot entry): memory then takes what the disk holds,
        // as after a failed write (`undo_failed_write` says why keeping the
        // old view is not enough).
        let written = {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(writes).await
        };
        if let Err(e) = written {
            tracing::error!(slot, error = %e, "tract trim failed");
            self.undo_failed_trim(
                slot,
                &mut g,
                (blob, tract),
                empty,
                Changed { first_chunk, chunks: new_entries.len() as u32, appended: &appended },
            )
            .await;
            return Err(e.into());
        }
        let version = g.entry.written_version;
        if empty {
            g.entry.used = false;
            g.reset_chunks(Vec::new());
            let mut ix = self.index();
            ix.map.remove(&(blob, tract));
            ix.free.push(slot);
        } else {
            g.settle_chunks(first_chunk, new_entries);
        }
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version,
            offset,
            len,
            write: None,
            whole_tract: empty,
        };
        let marked = self.journal_change(&change).await;
        drop(g);
        self.make_durable(marked?, true).await?;
        Ok(())
    }

    /// Frees a tract's slot if it holds `incarnation`. Returns whether
    /// something was freed; durable on return.
    pub async fn delete(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
    ) -> Result<bool, StoreError> {
        self.delete_if(blob, incarnation, tract, ALWAYS).await
    }

    /// [`Store::delete`], applied only if `current` says so under the lock.
    pub async fn delete_if(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        current: Current<'_>,
    ) -> Result<bool, StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else {
            return Ok(false);
        };
        let Some(cell) = self.slots.get(slot as usize) else {
            return Ok(false);
        };
        let mut g = cell.write().await;
        if !current() {
            return Err(StoreError::Superseded);
        }
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(false);
        }
        // Memory frees the slot only once the disk says so: a slot marked
        // free in memory but still in the index would send every later
        // write to this tract round `lock_slot_for_write`'s loop forever.
        let freed = SlotEntry { used: false, ..g.entry };
        self.disk
            .write_at(vec![(self.layout.slot_entry_offset(slot), Bytes::copy_from_slice(&freed.encode()))])
            .await?;
        g.entry.used = false;
        g.reset_chunks(Vec::new());
        {
            let mut ix = self.index();
            ix.map.remove(&(blob, tract));
            ix.free.push(slot);
        }
        let change = backup::Change {
            blob,
            incarnation,
            tract,
            version: g.entry.written_version,
            offset: 0,
            len: self.layout.tract_size,
            write: None,
            whole_tract: true,
        };
        let marked = self.journal_change(&change).await;
        drop(g);
        self.make_durable(marked?, true).await?;
        Ok(true)
    }

    /// [`Store::undo_failed_write`] for a trim: its chunk entries, the data
    /// of its partial chunks, then (if it left the tract empty) the slot
    /// entry marked free. A freed slot entry on disk frees the slot in
    /// memory too; otherwise memory takes the chunk entries and bytes there.
    async fn undo_failed_trim(
        &self,
        slot: u32,
        g: &mut SlotState,
        (blob, tract): (BlobId, TractNo),
        freeing: bool,
        changed: Changed<'_>,
    ) {
        let Changed { first_chunk, chunks, appended } = changed;
        let before = entry_range(&g.chunks, first_chunk, chunks);
        let read = async {
            let record = if freeing {
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
        match read {
            Ok((Some(SlotRecord::Valid(e)), _)) if e == SlotEntry { used: false, ..g.entry } => {
                g.entry.used = false;
                g.reset_chunks(Vec::new());
                let mut ix = self.index();
                ix.map.remove(&(blob, tract));
                ix.free.push(slot);
            }
            Ok((Some(SlotRecord::Valid(e)), (entries, data))) if e == g.entry => {
                take_from_disk(g, first_chunk, &entries, &data)
            }
            Ok((None, (entries, data))) => take_from_disk(g, first_chunk, &entries, &data),
            Ok(_) => self.distrust(slot, "its slot entry is neither the old nor the freed one on disk"),
            Err(e) => self.distrust(slot, &format!("reading it back failed: {e}")),
        }
    }
}
