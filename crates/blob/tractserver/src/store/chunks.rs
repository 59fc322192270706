//! Reading a tract's chunks and vouching for them: reads verified against
//! each chunk's entry, the digests replicas compare (design 0005), and the
//! two ways a damaged chunk is rewritten (`repair_chunk` for the
//! scrubber, `heal_chunk` for a partial write that must merge with it).
//! Memory's view of a chunk the disk may not match (a write cut off by a
//! crash, a failed write) is "unsettled" until its bytes are read and
//! judged ([`settle`]); the invariants are in `mod.rs`'s header.

use super::*;

impl Store {
    /// Chunk entries `first..first + n` of a slot and the data of those
    /// chunks, as a restart would find them after a change that failed
    /// part-way: `before`, the entries memory had, except where one of the
    /// change's `appended` journal records reads back whole.
    pub(super) async fn read_back(
        &self,
        slot: u32,
        first: u32,
        n: u32,
        before: Vec<ChunkEntry>,
        appended: &[Appended],
    ) -> io::Result<(Vec<ChunkEntry>, Bytes)> {
        let entries = self.entries_after(first, before, appended).await?;
        let data = self
            .disk
            .read_at(self.layout.data_offset_of(slot, first * CHUNK_SIZE), (n * CHUNK_SIZE) as usize)
            .await?;
        Ok((entries, data))
    }

    /// Reads an unsettled chunk's bytes and settles memory to them
    /// ([`settle`]): returns their CRC, or `None` if its entry accepts no
    /// CRC they have (the chunk stays unsettled).
    pub(super) async fn settle_from_disk(
        &self,
        slot: u32,
        g: &mut SlotState,
        chunk: u32,
    ) -> Result<Option<u32>, StoreError> {
        let at = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
        let b = self.disk.read_at(at, CHUNK_SIZE as usize).await?;
        let crc = crc32c(&b);
        Ok(settle(g, chunk, crc))
    }

    pub(super) async fn read_chunk_verified(
        &self,
        slot: u32,
        st: &SlotState,
        chunk: u32,
    ) -> Result<(Bytes, u32), StoreError> {
        let e = st.chunks.get(chunk as usize).copied().unwrap_or_default();
        if e.generation != st.entry.generation || e.generation == 0 {
            return Ok((Bytes::from(vec![0u8; CHUNK_SIZE as usize]), zeros_crc(CHUNK_SIZE as usize)));
        }
        let b = self
            .disk
            .read_at(self.layout.data_offset_of(slot, chunk * CHUNK_SIZE), CHUNK_SIZE as usize)
            .await?;
        let crc = crc32c(&b);
        if !e.accepts(crc) {
            self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Corrupt { slot, chunk });
        }
        Ok((b, crc))
    }

    /// Reads `[offset, offset + len)` of a tract: the bytes and one CRC32C
    /// per piece. Never-written ranges (and tracts of another incarnation)
    /// read as zeros. A chunk found `Corrupt` becomes unsettled: memory no
    /// longer vouches for its bytes, so the next digest reads them.
    pub async fn read(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
    ) -> Result<(Bytes, Vec<u32>), StoreError> {
        let r = self.read_verified(blob, incarnation, tract, offset, len).await;
        if let Err(StoreError::Corrupt { slot, chunk }) = &r {
            if let Some(cell) = self.slots.get(*slot as usize) {
                let mut g = cell.write().await;
                let gen = g.entry.generation;
                if g.entry.used
                    && g.entry.blob == blob
                    && g.entry.tract == tract
                    && g.entry.incarnation == incarnation
                    && g.chunks.get(*chunk as usize).is_some_and(|e| e.generation == gen && gen != 0)
                {
                    g.unsettled.insert(*chunk);
                }
            }
        }
        r
    }

    pub(super) async fn read_verified(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        offset: u32,
        len: u32,
    ) -> Result<(Bytes, Vec<u32>), StoreError> {
        self.check_range(offset, len)?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_read.fetch_add(len as u64, Ordering::Relaxed);
        let slot = self.index().map.get(&(blob, tract)).copied();
        let first_chunk = offset / CHUNK_SIZE;
        let last_chunk = (offset + len - 1) / CHUNK_SIZE;
        let span_start = first_chunk * CHUNK_SIZE;
        let span_len = (last_chunk - first_chunk + 1) * CHUNK_SIZE;

        let mut buf: Option<Bytes> = None;
        let mut chunk_crcs: Vec<Option<u32>> = vec![None; (last_chunk - first_chunk + 1) as usize];
        if let Some(slot) = slot {
            if let Some(cell) = self.slots.get(slot as usize) {
                let g = cell.read().await;
                if g.entry.used
                    && g.entry.blob == blob
                    && g.entry.tract == tract
                    && g.entry.incarnation == incarnation
                {
                    let gen = g.entry.generation;
                    let valid: Vec<Option<ChunkEntry>> = (first_chunk..=last_chunk)
                        .map(|c| {
                            g.chunks.get(c as usize).filter(|e| e.generation == gen && gen != 0).copied()
                        })
                        .collect();
                    if valid.iter().any(Option::is_some) {
                        // The checksums are computed where the read ran
                        // (off the runtime thread for a large one).
                        let (raw, raw_crcs) = self
                            .disk
                            .read_at_crcs(
                                self.layout.data_offset_of(slot, span_start),
                                span_len as usize,
                                CHUNK_SIZE as usize,
                            )
                            .await?;
                        // Each written chunk must hold what its entry allows:
                        // the latest write, or the one before it if that
                        // write was cut off before its data.
                        let mut actual: Vec<Option<u32>> = Vec::with_capacity(valid.len());
                        for (i, e) in valid.iter().enumerate() {
                            actual.push(match e {
                                Some(e) => {
                                    let c = raw_crcs.get(i).copied().unwrap_or_default();
                                    if !e.accepts(c) {
                                        self.stats.corrupt_reads.fetch_add(1, Ordering::Relaxed);
                                        return Err(StoreError::Corrupt {
                                            slot,
                                            chunk: first_chunk + i as u32,
                                        });
                                    }
                                    Some(c)
                                }
                                None => None,
                            });
                        }
                        // Chunks never written hold whatever the slot's last
                        // tenant left: they read as zeros.
                        let b = if valid.iter().all(Option::is_some) {
                            raw
                        } else {
                            let mut m = bytes::BytesMut::from(&raw[..]);
                            for (i, crc) in valid.iter().enumerate() {
                                if crc.is_none() {
                                    m[i * CHUNK_SIZE as usize..(i + 1) * CHUNK_SIZE as usize].fill(0);
                                }
                            }
                            m.freeze()
                        };
                        chunk_crcs = actual;
                        buf = Some(b);
                    }
                }
            }
        }
        let rel = (offset - span_start) as usize;
        let data = match buf {
            Some(b) => b.slice(rel..rel + len as usize),
            None => Bytes::from(vec![0u8; len as usize]),
        };
        // A whole chunk goes back under the CRC its writer computed; a part
        // of one gets a CRC of just that part, computed from verified bytes.
        let crcs = pieces(offset, len)
            .map(|(s, e)| {
                let chunk = ((offset + s as u32) / CHUNK_SIZE - first_chunk) as usize;
                match chunk_crcs.get(chunk).copied().flatten() {
                    Some(c) if e - s == CHUNK_SIZE as usize => c,
                    Some(_) => crc32c(&data[s..e]),
                    None => zeros_crc(e - s),
                }
            })
            .collect();
        Ok((data, crcs))
    }

    /// What this replica holds in each chunk of a tract, for making the
    /// tract's replicas agree (`blizzard_core::reconcile`) and for a
    /// member back in a row to repair what it missed (`fill`): `Hole` for a
    /// chunk not written (or trimmed), `Data` with the digest of the bytes
    /// it holds now (`reconcile::chunk_digest`; not their CRC32C, which
    /// cannot tell apart records that carry their own CRC), `Unreadable`
    /// for bytes matching no CRC its entry accepts. Empty if the tract is
    /// not held here at `incarnation`.
    ///
    /// Under the slot's write lock, so every change admitted before it has
    /// finished, and none runs meanwhile. Every written chunk is read (in
    /// runs of at most `DIGEST_READ_CHUNKS`, one disk read each) and its
    /// CRC checked against its entry; an unsettled chunk (an overwrite
    /// found at open, which a crash may have cut off before its data)
    /// settles to what it holds.
    pub async fn digest(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
    ) -> Result<Vec<ChunkState>, StoreError> {
        self.stats.digests.fetch_add(1, Ordering::Relaxed);
        // A failed disk's memory may say what no restart would read (writes
        // a failed `fdatasync` dropped, a failed write not read back).
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else { return Ok(Vec::new()) };
        let Some(cell) = self.slots.get(slot as usize) else { return Ok(Vec::new()) };
        let mut g = cell.write().await;
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(Vec::new());
        }
        let gen = g.entry.generation;
        let written: Vec<bool> = g.chunks.iter().map(|e| e.generation == gen && gen != 0).collect();
        let mut out = vec![ChunkState::Hole; written.len()];
        let chunks = written.len() as u32;
        let mut c = 0u32;
        while c < chunks {
            if !written[c as usize] {
                // An unwritten chunk has no bytes to settle.
                g.unsettled.remove(c);
                c += 1;
                continue;
            }
            let start = c;
            while c < chunks && c - start < DIGEST_READ_CHUNKS && written[c as usize] {
                c += 1;
            }
            let n = c - start;
            let b = self
                .disk
                .read_at(self.layout.data_offset_of(slot, start * CHUNK_SIZE), (n * CHUNK_SIZE) as usize)
                .await?;
            self.stats.digest_chunks_read.fetch_add(n as u64, Ordering::Relaxed);
            for (i, bytes) in b.chunks_exact(CHUNK_SIZE as usize).enumerate() {
                let chunk = start + i as u32;
                let crc = crc32c(bytes);
                let readable = if g.unsettled.contains(chunk) {
                    settle(&mut g, chunk, crc).is_some()
                } else {
                    g.chunks.get(chunk as usize).is_some_and(|e| e.crc == crc)
                };
                out[chunk as usize] =
                    if readable { ChunkState::Data(chunk_digest(bytes)) } else { ChunkState::Unreadable };
            }
        }
        Ok(out)
    }

    /// For [`Store::repair_chunk`] and [`Store::heal_chunk`]: the slot of a
    /// tract stored here at `incarnation`, write-locked (no client write to
    /// the tract runs meanwhile), with chunk `chunk`'s entry, where its data
    /// lies and what it holds now. `None` if the tract is not stored here at
    /// that incarnation, the chunk was never written, or `len` is not one
    /// chunk.
    pub(super) async fn lock_written_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        len: usize,
    ) -> Result<Option<LockedChunk<'_>>, StoreError> {
        if self.commit.failed() {
            return Err(StoreError::Failed);
        }
        if len != CHUNK_SIZE as usize || chunk >= self.layout.chunks_per_tract() {
            return Ok(None);
        }
        let Some(slot) = self.index().map.get(&(blob, tract)).copied() else { return Ok(None) };
        let Some(cell) = self.slots.get(slot as usize) else { return Ok(None) };
        let g = cell.write().await;
        if !(g.entry.used
            && g.entry.blob == blob
            && g.entry.tract == tract
            && g.entry.incarnation == incarnation)
        {
            return Ok(None);
        }
        let gen = g.entry.generation;
        let Some(entry) = g.chunks.get(chunk as usize).copied().filter(|e| e.generation == gen && gen != 0)
        else {
            return Ok(None);
        };
        let at = self.layout.data_offset_of(slot, chunk * CHUNK_SIZE);
        let now = self.disk.read_at(at, CHUNK_SIZE as usize).await?;
        Ok(Some(LockedChunk { slot, g, entry, at, now }))
    }

    /// Rewrites chunk `chunk` of a tract whose stored bytes fail their CRC
    /// (bit rot) with `data` from another replica. Only bytes this chunk's
    /// entry expects are accepted: a replica holding other contents (a
    /// write that reached it and not yet this server) must not replace
    /// ours, and a chunk rewritten since it was found damaged is left
    /// alone. Returns whether the chunk was repaired; durable on return.
    pub async fn repair_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        data: Bytes,
        allow_prev: bool,
    ) -> Result<bool, StoreError> {
        let Some(LockedChunk { mut g, entry: e, at, now, .. }) =
            self.lock_written_chunk(blob, incarnation, tract, chunk, data.len()).await?
        else {
            return Ok(false);
        };
        // The chunk's current contents; the previous ones (which the entry
        // also accepts, for a write cut off by a crash) only if the caller
        // says so: a replica holding those may just not have applied the
        // latest write yet, and installing them would take that write back.
        let crc = crc32c(&data);
        if e.accepts(crc32c(&now)) || !(crc == e.crc || (allow_prev && e.accepts(crc))) {
            return Ok(false);
        }
        {
            let _slot = self.writers.acquire().await;
            self.disk.write_at(vec![(at, data)]).await?;
        }
        // Memory knows the bytes now (the previous contents, if those).
        settle(&mut g, chunk, crc);
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        self.stats.repaired_chunks.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Gives a chunk this server cannot read (its bytes match no CRC its
    /// entry accepts) the contents `data`, taken from a complete replica,
    /// so that partial writes can merge into it again (`TractService::
    /// heal_chunk` says why that is safe). Under the slot lock; does nothing
    /// and returns false if the chunk reads fine by now (healed, rewritten)
    /// or the tract is not stored here at `incarnation`. Durable on return.
    pub async fn heal_chunk(
        &self,
        blob: BlobId,
        incarnation: Incarnation,
        tract: TractNo,
        chunk: u32,
        data: Bytes,
    ) -> Result<bool, StoreError> {
        let mut credit = self.journal_credit(1).await?;
        // An unwritten chunk reads as zeros: nothing to heal.
        let Some(LockedChunk { slot, mut g, entry: e, at, now }) =
            self.lock_written_chunk(blob, incarnation, tract, chunk, data.len()).await?
        else {
            return Ok(false);
        };
        if e.accepts(crc32c(&now)) {
            return Ok(false);
        }
        let healed =
            ChunkEntry { crc: crc32c(&data), generation: e.generation, prev_crc: 0, prev_generation: 0 };
        let record = self.journal.append(&mut credit, slot, chunk, &[healed]);
        drop(credit);
        // Data, then entry: cut off in between, the chunk is as unreadable
        // as before. Memory changes only once both are on disk.
        {
            let _slot = self.writers.acquire().await;
            let mut writes = vec![(at, data)];
            writes.extend(record.iter().map(|a| (a.at, a.bytes.clone())));
            self.disk.write_at(writes).await?;
        }
        if let Some(c) = g.chunks.get_mut(chunk as usize) {
            *c = healed;
        }
        g.unsettled.remove(chunk);
        drop(g);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        self.stats.repaired_chunks.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

/// Makes memory hold the chunk entries `entries` of chunks `first..`, read
/// from the disk with the chunks' bytes `data`, as open and a first digest
/// would take them: an entry that counts (the slot's generation) is
/// settled against its bytes ([`settle`]), one that does not is a hole.
pub(super) fn take_from_disk(g: &mut SlotState, first: u32, entries: &[ChunkEntry], data: &[u8]) {
    let gen = g.entry.generation;
    for (i, (d, bytes)) in entries.iter().zip(data.chunks_exact(CHUNK_SIZE as usize)).enumerate() {
        let chunk = first + i as u32;
        let Some(c) = g.chunks.get_mut(chunk as usize) else { continue };
        *c = *d;
        if d.generation == gen && gen != 0 {
            settle(g, chunk, crc32c(bytes));
        } else {
            g.unsettled.remove(chunk);
        }
    }
}

/// What a written chunk whose bytes have CRC `crc` holds, making memory
/// say so: an entry accepting `crc` as its previous contents becomes
/// `settled_to(crc)` (a write cut off before its data), and the chunk
/// leaves the unsettled set (`Some(crc)`); bytes the entry does not accept
/// leave the chunk unreadable and unsettled (`None`).
pub(super) fn settle(g: &mut SlotState, chunk: u32, crc: u32) -> Option<u32> {
    let e = g.chunks.get_mut(chunk as usize)?;
    if crc != e.crc {
        if !e.accepts(crc) {
            g.unsettled.insert(chunk);
            return None;
        }
        *e = e.settled_to(crc);
    }
    g.unsettled.remove(chunk);
    Some(crc)
}
