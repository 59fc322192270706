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
    ///
    /// Reads come first and in order (superblock, positions, the journal,
    /// the slot table, the chunk table); each recovery case of the table
    /// above is decided by a pure function below (`slot_state`,
    /// `free_duplicates`, `newest_positions`, `apply_records`).
    pub async fn open(disk: Arc<dyn Disk>) -> Result<Store, StoreError> {
        let sb = disk.read_at(0, SUPERBLOCK_LEN as usize).await?;
        let layout = Layout::decode_superblock(&sb, disk.len())?;

        let mut found = Vec::with_capacity(2);
        for which in 0..2u8 {
            found.push(disk.read_at(layout.positions_slot_offset(which), POSITIONS_SLOT_LEN as usize).await?);
        }
        let positions = newest_positions(found.iter().map(|b| decode_positions(b)));

        // The journal: the records the chunk table may lack, by slot.
        let (head, head_slot) = Head::newest(
            &disk.read_at(layout.journal_head_offset(0), JOURNAL_HEAD_LEN as usize).await?,
            &disk.read_at(layout.journal_head_offset(1), JOURNAL_HEAD_LEN as usize).await?,
        );
        let ring = disk.read_at(layout.journal_ring_offset(), layout.journal_len as usize).await?;
        let scanned = jformat::scan(&ring, layout.slot_count, layout.chunks_per_tract());
        drop(ring);
        let replay = jformat::replay(scanned, head, layout.journal_len)
            .map_err(|e| StoreError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        let replayed = replay.records.len();
        let (mut journaled, dirty) = records_by_slot(replay.records);
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
        let table_len = (cpt as u64 * CHUNK_ENTRY_LEN) as usize;
        let mut states: Vec<SlotState> = Vec::with_capacity(n as usize);
        let mut index = Index { map: HashMap::new(), free: Vec::new(), next_alloc_seq: 1, quarantined: 0 };
        let per_read = ((RECOVERY_READ_BYTES / table_len as u64).max(1)) as u32;
        let mut s = 0u32;
        while s < n {
            let k = per_read.min(n - s);
            let b = disk.read_at(layout.chunk_entry_offset(s, 0), k as usize * table_len).await?;
            for (i, table) in b.chunks_exact(table_len).enumerate() {
                let slot = s + i as u32;
                let mut chunks: Vec<ChunkEntry> =
                    table.chunks_exact(CHUNK_ENTRY_LEN as usize).map(ChunkEntry::decode).collect();
                apply_records(&mut chunks, journaled.remove(&slot).unwrap_or_default());
                states.push(slot_state(slot, records[slot as usize], chunks, &mut index));
            }
            s += k;
        }
        free_duplicates(&mut states, &mut index);
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

/// The assignment to use of the two positions slots' records (`None`
/// where invalid): the valid one with the higher sequence number.
fn newest_positions<'a>(found: impl Iterator<Item = Option<(u64, &'a [u8])>>) -> (u64, Option<Vec<u8>>) {
    let mut positions = (0u64, None);
    for (seq, payload) in found.flatten() {
        if positions.1.is_none() || seq > positions.0 {
            positions = (seq, Some(payload.to_vec()));
        }
    }
    positions
}

/// Chunks `lo..hi` of each slot that journal records touch: the
/// journal's dirty set until its next checkpoint.
type DirtyRanges = BTreeMap<u32, (u32, u32)>;

/// The journal's replayed records grouped by slot (in `seq` order within
/// each), and the range of chunks they touch in each slot.
fn records_by_slot(records: Vec<Record>) -> (BTreeMap<u32, Vec<Record>>, DirtyRanges) {
    let mut by_slot: BTreeMap<u32, Vec<Record>> = BTreeMap::new();
    let mut dirty = DirtyRanges::new();
    for r in records {
        let (lo, hi) = (r.first_chunk, r.first_chunk + r.entries.len() as u32);
        let range = dirty.entry(r.slot).or_insert((lo, hi));
        *range = (range.0.min(lo), range.1.max(hi));
        by_slot.entry(r.slot).or_default().push(r);
    }
    (by_slot, dirty)
}

/// A slot's chunk table as if each journal record had been written in
/// place, in order. Entries past the table's end are ignored.
fn apply_records(chunks: &mut [ChunkEntry], records: Vec<Record>) {
    for r in records {
        for (k, e) in r.entries.into_iter().enumerate() {
            if let Some(c) = chunks.get_mut(r.first_chunk as usize + k) {
                *c = e;
            }
        }
    }
}

/// The recovery cases of one slot (module docs): what memory holds for
/// `slot`, given its slot-table record and its chunk table (journal
/// applied). Free and quarantined slots are counted in `index`, and
/// `next_alloc_seq` rises past every allocation found; the map of tracts
/// to slots is filled afterwards ([`free_duplicates`]).
fn slot_state(slot: u32, record: SlotRecord, chunks: Vec<ChunkEntry>, index: &mut Index) -> SlotState {
    let max_chunk_gen = chunks.iter().map(|c| c.generation).max().unwrap_or(0);
    let empty = |entry, max_generation| SlotState {
        entry,
        chunks: Vec::new(),
        unsettled: ChunkSet::default(),
        max_generation,
    };
    match record {
        SlotRecord::Blank => {
            index.free.push(slot);
            empty(blank_entry(), max_chunk_gen)
        }
        SlotRecord::Damaged => {
            // Unknown tenant: never hand this slot out again.
            tracing::error!(slot, "slot table entry is damaged; quarantining the slot");
            index.quarantined += 1;
            empty(blank_entry(), u32::MAX)
        }
        SlotRecord::Valid(e) => {
            index.next_alloc_seq = index.next_alloc_seq.max(e.alloc_seq + 1);
            let max_generation = e.generation.max(max_chunk_gen);
            if !e.used {
                index.free.push(slot);
                return empty(e, max_generation);
            }
            // An overwrite entry keeps the previous CRC because the write
            // puts it before its data: cut off in between, the bytes are
            // the old ones. Which of the two they are, only the bytes tell
            // (a digest reads them).
            let mut unsettled = ChunkSet::default();
            for (c, ce) in chunks.iter().enumerate() {
                if ce.generation == e.generation && e.generation != 0 && ce.prev_generation == ce.generation {
                    unsettled.insert(c as u32);
                }
            }
            SlotState { entry: e, chunks, unsettled, max_generation }
        }
    }
}

/// Maps each used slot's tract to it. Two used entries for one tract mean
/// a crash between freeing one and allocating the tract elsewhere: the
/// later allocation (higher `alloc_seq`) is the live one, the other is
/// freed.
fn free_duplicates(states: &mut [SlotState], index: &mut Index) {
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

#[cfg(test)]
mod open_tests {
    use super::*;

    fn index() -> Index {
        Index { map: HashMap::new(), free: Vec::new(), next_alloc_seq: 1, quarantined: 0 }
    }

    fn used(blob: u128, generation: u32, alloc_seq: u64) -> SlotEntry {
        SlotEntry {
            used: true,
            generation,
            blob: BlobId(blob),
            incarnation: 1,
            tract: TractNo(0),
            written_version: 1,
            alloc_seq,
        }
    }

    fn chunk(crc: u32, generation: u32, prev: bool) -> ChunkEntry {
        ChunkEntry {
            crc,
            generation,
            prev_crc: if prev { crc ^ 1 } else { 0 },
            prev_generation: if prev { generation } else { 0 },
        }
    }

    /// A blank slot is free, and its next tenant's generation must pass
    /// every generation its chunk table still holds.
    #[test]
    fn a_blank_slot_is_free_above_its_leftover_generations() {
        let mut ix = index();
        let st = slot_state(3, SlotRecord::Blank, vec![chunk(1, 7, false), chunk(2, 2, false)], &mut ix);
        assert_eq!(ix.free, vec![3]);
        assert!(!st.entry.used && st.chunks.is_empty());
        assert_eq!(st.max_generation, 7);
    }

    /// A damaged slot entry is quarantined: not free, and no generation
    /// could ever be new there.
    #[test]
    fn a_damaged_slot_is_quarantined() {
        let mut ix = index();
        let st = slot_state(4, SlotRecord::Damaged, vec![chunk(1, 7, false)], &mut ix);
        assert!(ix.free.is_empty());
        assert_eq!(ix.quarantined, 1);
        assert_eq!(st.max_generation, u32::MAX);
    }

    /// A used slot keeps its chunks; the overwrite entries of its
    /// generation are unsettled (only the bytes tell old from new), and
    /// allocation continues after its `alloc_seq`.
    #[test]
    fn a_used_slot_keeps_its_chunks_and_unsettles_its_overwrites() {
        let mut ix = index();
        let chunks = vec![chunk(1, 5, false), chunk(2, 5, true), chunk(3, 4, true), ChunkEntry::default()];
        let st = slot_state(0, SlotRecord::Valid(used(9, 5, 41)), chunks.clone(), &mut ix);
        assert!(ix.free.is_empty());
        assert_eq!(ix.next_alloc_seq, 42);
        assert_eq!(st.chunks, chunks);
        assert!(st.unsettled.contains(1), "an overwrite of this generation");
        assert!(!st.unsettled.contains(0) && !st.unsettled.contains(2), "a first write; an older generation");
        assert_eq!(st.max_generation, 5);
    }

    /// A freed slot keeps its generation (and any higher one its chunks
    /// hold) for its next tenant.
    #[test]
    fn a_freed_slot_keeps_its_generation() {
        let mut ix = index();
        let mut e = used(9, 5, 3);
        e.used = false;
        let st = slot_state(2, SlotRecord::Valid(e), vec![chunk(1, 6, false)], &mut ix);
        assert_eq!(ix.free, vec![2]);
        assert!(st.chunks.is_empty());
        assert_eq!(st.max_generation, 6);
        assert_eq!(ix.next_alloc_seq, 4);
    }

    /// Two used slots for one tract: the later allocation wins, whichever
    /// slot it is in, and the other is freed.
    #[test]
    fn of_two_slots_holding_one_tract_the_later_allocation_wins() {
        for (first_seq, second_seq, winner, loser) in [(1, 2, 1u32, 0u32), (2, 1, 0, 1)] {
            let mut ix = index();
            let mut states: Vec<SlotState> = [first_seq, second_seq]
                .into_iter()
                .enumerate()
                .map(|(s, seq)| {
                    slot_state(
                        s as u32,
                        SlotRecord::Valid(used(9, 1, seq)),
                        vec![chunk(1, 1, false)],
                        &mut ix,
                    )
                })
                .collect();
            free_duplicates(&mut states, &mut ix);
            assert_eq!(ix.map.get(&(BlobId(9), TractNo(0))), Some(&winner));
            assert_eq!(ix.free, vec![loser]);
            assert!(!states[loser as usize].entry.used && states[loser as usize].chunks.is_empty());
            assert!(states[winner as usize].entry.used);
        }
    }

    /// Of the two positions records, the valid one with the higher
    /// sequence number.
    #[test]
    fn the_newest_valid_positions_record_is_used() {
        let (a, b) = (&b"one"[..], &b"two"[..]);
        assert_eq!(newest_positions([None, None].into_iter()), (0, None));
        assert_eq!(newest_positions([Some((4, a)), None].into_iter()), (4, Some(a.to_vec())));
        assert_eq!(newest_positions([Some((4, a)), Some((5, b))].into_iter()), (5, Some(b.to_vec())));
        assert_eq!(newest_positions([Some((6, a)), Some((5, b))].into_iter()), (6, Some(a.to_vec())));
    }

    /// Journal records apply in order over the chunk table; the dirty
    /// range per slot covers every record of it.
    #[test]
    fn journal_records_apply_in_order() {
        let rec = |seq, slot, first_chunk, entries: Vec<ChunkEntry>| Record {
            seq,
            slot,
            first_chunk,
            entries,
            len: 0,
        };
        let (mut by_slot, dirty) = records_by_slot(vec![
            rec(1, 0, 1, vec![chunk(10, 1, false), chunk(11, 1, false)]),
            rec(2, 5, 0, vec![chunk(50, 1, false)]),
            rec(3, 0, 2, vec![chunk(12, 1, true), chunk(13, 1, false)]),
        ]);
        assert_eq!(dirty.get(&0), Some(&(1, 4)));
        assert_eq!(dirty.get(&5), Some(&(0, 1)));
        let mut chunks = vec![ChunkEntry::default(); 3];
        apply_records(&mut chunks, by_slot.remove(&0).unwrap_or_default());
        // Chunk 3 is past this table's end: ignored.
        assert_eq!(chunks, vec![ChunkEntry::default(), chunk(10, 1, false), chunk(12, 1, true)]);
    }
}
