//! Formatting a disk, and opening one: every tract's metadata rebuilt
//! from the disk.
//!
//! Recovery cases at open (each logged):
//!
//! | on disk                                   | treated as                        |
//! |-------------------------------------------|-----------------------------------|
//! | superblock missing                        | unformatted (caller may format)   |
//! | superblock CRC/version/geometry bad       | refuse to start, say why          |
//! | both positions slots invalid              | no assignment yet                 |
//! | one positions slot valid                  | that one                          |
//! | both valid                                | the higher sequence number        |
//! | slot entry all zeros                      | free, generation 0                |
//! | slot entry valid, free                    | free, keeps its generation        |
//! | slot entry valid, used                    | the tract lives here              |
//! | slot entry damaged (CRC)                  | quarantined: never reused; logged |
//! | two used entries for one tract            | higher `alloc_seq` wins, other freed |
//! | chunk entry generation != slot generation | chunk unwritten (reads as zeros)  |
//! | chunk bytes match the entry's previous CRC | the write was cut off before its data: old contents |
//! | chunk bytes match neither CRC             | `Corrupt` (client reads another replica) |
//! | overwrite entry (previous CRC kept)       | unsettled: the first digest reads the bytes; memory takes the CRC they match |
//! | journal records after the head            | applied onto the chunk table first, in `seq` order (`journal.rs` has the journal's own cases); every case above then reads the result |
//! | a partial overwrite torn by power loss (entry new, bytes mixed in its range) | `Corrupt`; the same write again merges into the raw bytes to the entry's CRC and makes it whole (`write_with`); any other partial write is refused |

use std::collections::BTreeMap;

use crate::layout::journal::{self as jformat, Head, Record, JOURNAL_HEAD_LEN};

use super::*;

impl Store {
    /// Formats `disk` for tracts of `tract_size` bytes, erasing it.
    pub async fn format(
        disk: Arc<dyn Disk>,
        disk_id: TsId,
        tract_size: u32,
        clock: &dyn Clock,
    ) -> Result<Store, StoreError> {
        Self::format_with(disk, disk_id, tract_size, clock, None).await
    }

    /// [`Store::format`] with a journal ring of `journal_len` bytes instead
    /// of the default (`Layout::plan_with`): the simulator gives its small
    /// disks a tiny ring so that checkpoints, and crashes inside them,
    /// happen all the time.
    pub async fn format_with(
        disk: Arc<dyn Disk>,
        disk_id: TsId,
        tract_size: u32,
        clock: &dyn Clock,
        journal_len: Option<u64>,
    ) -> Result<Store, StoreError> {
        let mut layout = Layout::plan_with(disk_id, tract_size, disk.len(), journal_len)?;
        layout.disk_mbps = measure_write_speed(&disk, &layout, clock).await?;
        // Zero the positions, slot table and chunk table: a device reused
        // from an earlier format must not leak its old tenants. The
        // superblock goes last, so a crash mid-format leaves an unformatted
        // disk rather than a half-formatted one.
        let mut at = layout.positions_offset;
        while at < layout.data_offset {
            let n = (layout.data_offset - at).min(RECOVERY_READ_BYTES);
            disk.write_at(vec![(at, Bytes::from(vec![0u8; n as usize]))]).await?;
            at += n;
        }
        disk.sync().await?;
        disk.write_at(vec![(0, Bytes::from(layout.encode_superblock()))]).await?;
        disk.sync().await?;
        tracing::info!(disk = %disk_id, tract_size, slots = layout.slot_count, "formatted disk");
        Self::open(disk).await
    }

    /// Opens a formatted disk and rebuilds all tract metadata from it.
    pub async fn open(disk: Arc<dyn Disk>) -> Result<Store, StoreError> {
        let sb = disk.read_at(0, SUPERBLOCK_LEN as usize).await?;
        let layout = Layout::decode_superblock(&sb, disk.len())?;

        // Positions: the valid record with the higher sequence number.
        let mut positions = (0u64, None);
        for which in 0..2u8 {
            let b = disk.read_at(layout.positions_slot_offset(which), POSITIONS_SLOT_LEN as usize).await?;
            if let Some((seq, payload)) = decode_positions(&b) {
                if positions.1.is_none() || seq > positions.0 {
                    positions = (seq, Some(payload.to_vec()));
                }
            }
        }

        // The journal: the records the chunk table may lack, by slot.
        let (head, head_slot) = Head::newest(
            &disk.read_at(layout.journal_head_offset(0), JOURNAL_HEAD_LEN as usize).await?,
            &disk.read_at(layout.journal_head_offset(1), JOURNAL_HEAD_LEN as usize).await?,
        );
        let ring = disk.read_at(layout.journal_ring_offset(), layout.journal_len as usize).await?;
        let found = jformat::scan(&ring, layout.slot_count, layout.chunks_per_tract());
        drop(ring);
        let replay = jformat::replay(found, head, layout.journal_len)
            .map_err(|e| StoreError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        let replayed = replay.records.len();
        let mut journaled: BTreeMap<u32, Vec<Record>> = BTreeMap::new();
        let mut dirty: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        for r in replay.records {
            let (lo, hi) = (r.first_chunk, r.first_chunk + r.entries.len() as u32);
            let range = dirty.entry(r.slot).or_insert((lo, hi));
            *range = (range.0.min(lo), range.1.max(hi));
            journaled.entry(r.slot).or_default().push(r);
        }
        if replayed > 0 {
            tracing::info!(
                records = replayed,
                slots = dirty.len(),
                from_seq = head.seq,
                "replaying the chunk-entry journal"
            );
        }

        let n = layout.slot_count;
        let mut records = Vec::with_capacity(n as usize);
        let per_read = (RECOVERY_READ_BYTES / SLOT_ENTRY_LEN) as u32;
        let mut s = 0u32;
        while s < n {
            let k = per_read.min(n - s);
            let b = disk.read_at(layout.slot_entry_offset(s), (k as u64 * SLOT_ENTRY_LEN) as usize).await?;
            records.extend(b.chunks_exact(SLOT_ENTRY_LEN as usize).map(SlotEntry::decode));
            s += k;
        }

        let cpt = layout.chunks_per_tract();
        let mut states: Vec<SlotState> = Vec::with_capacity(n as usize);
        let mut index = Index { map: HashMap::new(), free: Vec::new(), next_alloc_seq: 1, quarantined: 0 };
        let per_read = ((RECOVERY_READ_BYTES / (cpt as u64 * CHUNK_ENTRY_LEN)).max(1)) as u32;
        let mut s = 0u32;
        while s < n {
            let k = per_read.min(n - s);
            let b = disk
                .read_at(layout.chunk_entry_offset(s, 0), (k as u64 * cpt as u64 * CHUNK_ENTRY_LEN) as usize)
                .await?;
            for (i, table) in b.chunks_exact((cpt as u64 * CHUNK_ENTRY_LEN) as usize).enumerate() {
                let slot = s + i as u32;
                let mut chunks: Vec<ChunkEntry> =
                    table.chunks_exact(CHUNK_ENTRY_LEN as usize).map(ChunkEntry::decode).collect();
                // As if each record had been written in place, in order.
                for r in journaled.remove(&slot).into_iter().flatten() {
                    for (k, e) in r.entries.into_iter().enumerate() {
                        if let Some(c) = chunks.get_mut(r.first_chunk as usize + k) {
                            *c = e;
                        }
                    }
                }
                let max_chunk_gen = chunks.iter().map(|c| c.generation).max().unwrap_or(0);
                let state = match records[slot as usize] {
                    SlotRecord::Blank => {
                        index.free.push(slot);
                        SlotState {
                            entry: blank_entry(),
                            chunks: Vec::new(),
                            unsettled: ChunkSet::default(),
                            max_generation: max_chunk_gen,
                        }
                    }
                    SlotRecord::Damaged => {
                        // Unknown tenant: never hand this slot out again.
                        tracing::error!(slot, "slot table entry is damaged; quarantining the slot");
                        index.quarantined += 1;
                        SlotState {
                            entry: blank_entry(),
                            chunks: Vec::new(),
                            unsettled: ChunkSet::default(),
                            max_generation: u32::MAX,
                        }
                    }
                    SlotRecord::Valid(e) => {
                        index.next_alloc_seq = index.next_alloc_seq.max(e.alloc_seq + 1);
                        let max_generation = e.generation.max(max_chunk_gen);
                        if e.used {
                            // An overwrite entry keeps the previous CRC
                            // because the write puts it before its data:
                            // cut off in between, the bytes are the old
                            // ones. Which of the two they are, only the
                            // bytes tell (a digest reads them).
                            let mut unsettled = ChunkSet::default();
                            for (c, ce) in chunks.iter().enumerate() {
                                if ce.generation == e.generation
                                    && e.generation != 0
                                    && ce.prev_generation == ce.generation
                                {
                                    unsettled.insert(c as u32);
                                }
                            }
                            SlotState { entry: e, chunks, unsettled, max_generation }
                        } else {
                            index.free.push(slot);
                            SlotState {
                                entry: e,
                                chunks: Vec::new(),
                                unsettled: ChunkSet::default(),
                                max_generation,
                            }
                        }
                    }
                };
                states.push(state);
            }
            s += k;
        }
        // Map tracts to slots; two used entries for one tract means a crash
        // between freeing one and reallocating the tract elsewhere: the
        // later allocation is the live one.
        for slot in 0..states.len() {
            let e = states[slot].entry;
            if !e.used {
                continue;
            }
            let key = (e.blob, e.tract);
            let loser = match index.map.get(&key).copied() {
                None => None,
                Some(other) if states[other as usize].entry.alloc_seq > e.alloc_seq => Some(slot as u32),
                Some(other) => Some(other),
            };
            if let Some(l) = loser {
                tracing::warn!(blob = %e.blob, tract = %e.tract, slot = l, "two slots hold one tract; freeing the older");
                let st = &mut states[l as usize];
                st.entry.used = false;
                st.reset_chunks(Vec::new());
                index.free.push(l);
            }
            if loser != Some(slot as u32) {
                index.map.insert(key, slot as u32);
            }
        }
        let slots: Vec<RwLock<SlotState>> = states.into_iter().map(RwLock::new).collect();
        index.free.sort_unstable_by(|a, b| b.cmp(a));
        tracing::info!(
            disk = %layout.disk_id,
            slots = n,
            used = index.map.len(),
            quarantined = index.quarantined,
            "opened tract store"
        );
        let journal = Journal::new(&layout, (head, head_slot), replay.cursor, replay.next_seq, dirty);
        Ok(Store {
            journal,
            writers: tokio::sync::Semaphore::new(DISK_WRITERS_MAX),
            planted: std::sync::atomic::AtomicU8::new(0),
            commit: GroupCommit::new(disk.clone()),
            disk,
            layout,
            index: Mutex::new(index),
            slots,
            positions: tokio::sync::Mutex::new(positions),
            backup: std::sync::OnceLock::new(),
            stats: StoreStats::default(),
        })
    }
}

/// Times a synced sequential write over the (still empty) data region, for
/// weighting the 1-way TLT by disk speed (FDS §2.2).
async fn measure_write_speed(
    disk: &Arc<dyn Disk>,
    layout: &Layout,
    clock: &dyn Clock,
) -> Result<u32, StoreError> {
    let room = layout.slot_count as u64 * layout.tract_size as u64;
    let total = room.min(64 << 20);
    let piece = total.min(8 << 20);
    if piece == 0 {
        return Ok(0);
    }
    let buf = Bytes::from(vec![0u8; piece as usize]);
    let start = clock.now();
    let mut at = 0;
    while at + piece <= total {
        disk.write_at(vec![(layout.data_offset + at, buf.clone())]).await?;
        at += piece;
    }
    disk.sync().await?;
    let secs = clock.now().duration_since(start).as_secs_f64();
    Ok(if secs > 0.0 { ((at as f64 / 1e6) / secs).min(u32::MAX as f64) as u32 } else { 0 })
}

fn blank_entry() -> SlotEntry {
    SlotEntry {
        used: false,
        generation: 0,
        blob: BlobId(0),
        incarnation: 0,
        tract: TractNo(0),
        written_version: 0,
        alloc_seq: 0,
    }
}
