//! The store's side of the backup journal (the hybrid tier, Ursa §3.2;
//! the journal itself: `crate::backup`). A store with a journal attached
//! acknowledges a small write once it is applied here and durable in the
//! journal, on fast storage; the slow data disk gets it at the next
//! destage, one `fdatasync` for everything applied since the last one,
//! which the kernel writes back in disk order, overwritten pages once.
//!
//! Invariants, each kept where it says:
//! - A data record's `seq` is taken under its tract's slot lock, after
//!   its bytes were written to the data disk's page cache
//!   ([`Store::journal_change`], called by every change of a tract). So
//!   for one tract `seq` order is the order the store applied changes in,
//!   and every record below a `seq` taken later has its bytes applied.
//! - A change that does not go through the journal (a write too large for
//!   it, a trim, a delete, a write that starts a new life of the tract)
//!   appends a supersede record in the same place of that order, durable
//!   before the change is acknowledged: older records' bytes for its range
//!   are never replayed over it.
//! - [`Store::destage_backup`] syncs the data disk and only then releases
//!   the records reserved before the sync started, in both areas of the
//!   journal: it lets go of nothing the data disk might not hold.
//! - A change goes to the journal's first area if it has room, else to its
//!   second area (if it has one: `backup::journal`, "Areas"), else to the
//!   data disk directly with a supersede record. Both areas draw from one
//!   `seq` counter, so the order above holds across them, and replay
//!   merges their records by `seq`.
//! - A data record holds whole chunks, as the write left them (a partial
//!   piece merged with the chunk's other bytes): replaying it never reads
//!   the data disk's copy of those chunks, which the power loss that made
//!   replay necessary may have torn.
//! - Replay at attach applies, for every byte range, only the newest
//!   record's bytes (`backup::index::JournalIndex`), then syncs the data
//!   disk before releasing anything. A range cut out of a record by a
//!   later supersede may leave a partial chunk to merge: that chunk was
//!   made durable by the change the supersede stands for.
//!
//! What attach does with what the journal's scan found:
//!
//! | found in the journal                        | done                                        |
//! |---------------------------------------------|---------------------------------------------|
//! | data records, newest for some of their bytes | those bytes written again (the data disk may have lost them with the page cache); a partial chunk torn by the same power loss is made whole by it (`write_with`) |
//! | bytes a newer record or supersede covers    | not written                                 |
//! | a record of another life of its tract, older than one that started a new life | not written |
//! | a damaged record (header whole, data not)    | logged: never acknowledged if it was the tail of a crash; rot otherwise, and the data disk then holds the range's previous contents (the scrubber's digests and the other replicas' are what tell) |
//! | a write the disk refuses (full, an I/O error) | attach fails, having released nothing; the server tries it all again (`server::attach_journal`) and serves nothing until it succeeds |
//! | a write that fails otherwise (a partial chunk that cannot be merged) | logged and counted; the chunk reads `Corrupt` and is healed from another replica |

use std::sync::Arc;

use blizzard_core::crc::piece_crcs;
use blizzard_core::{BlobId, Incarnation, Placement, TractNo};

use crate::backup::format::{Kind, Target};
use crate::backup::index::{JournalIndex, Piece};
use crate::backup::journal::{BackupJournal, JournalError, Pending, Scan};

use super::*;

/// A journal attached to a store, and which writes go to it.
pub(super) struct Backup {
    pub journal: Arc<BackupJournal>,
    /// The journal's second area, taking records while the first is full.
    pub second: Option<Arc<BackupJournal>>,
    /// Writes of at most this many bytes are journaled; larger ones go to
    /// the data disk directly (they are sequential enough for it).
    pub threshold: u32,
}

/// What attaching a journal replayed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Records found live.
    pub records: usize,
    /// Bytes written again to the data disk.
    pub bytes: u64,
    /// Damaged records found (logged).
    pub damaged: usize,
    /// Record pieces that could not be written (logged).
    pub failed: usize,
}

/// A change about to be made to a tract, as the journal records it.
pub(super) struct Change<'a> {
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub tract: TractNo,
    pub version: u64,
    pub offset: u32,
    pub len: u32,
    /// The bytes, for a write the journal may take.
    pub write: Option<(&'a [u32], &'a [u8])>,
    /// Whether it replaces everything the tract held (a new life, a
    /// delete): its supersede covers the whole tract.
    pub whole_tract: bool,
}

impl Store {
    /// Attaches a backup journal, and its second area if it has one (the
    /// caller has [`BackupJournal::join`]ed and named it): replays what the
    /// scans found (module docs), makes the data disk durable, releases the
    /// replayed records, and from then on journals every write of at most
    /// `threshold` bytes. Call once, before serving.
    pub async fn attach_backup(
        &self,
        journal: BackupJournal,
        scan: Scan,
        second: Option<(BackupJournal, Scan)>,
        threshold: u32,
    ) -> Result<Replayed, StoreError> {
        let (second, scan) = match second {
            Some((j, s)) => (Some(Arc::new(j)), merge_scans(scan, s)),
            None => (None, scan),
        };
        let journal = Arc::new(journal);
        if self.planted(PlantedBug::JournalAckBeforeSync) {
            for j in std::iter::once(&journal).chain(&second) {
                j.plant_ack_before_sync();
            }
        }
        let replayed = self.replay_backup(scan).await?;
        self.stats.journal_replayed.store(replayed.records as u64, Ordering::Relaxed);
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        let upto = journal.next_seq();
        for j in std::iter::once(&journal).chain(&second) {
            j.release(upto).await?;
        }
        let threshold = threshold.min(crate::backup::format::RECORD_DATA_MAX);
        if self.backup.set(Backup { journal, second, threshold }).is_err() {
            return Err(StoreError::Io(io::Error::other("a backup journal is attached already")));
        }
        Ok(replayed)
    }

    async fn replay_backup(&self, scan: Scan) -> Result<Replayed, StoreError> {
        let mut out =
            Replayed { records: scan.records.len(), damaged: scan.damaged.len(), ..Replayed::default() };
        for (seq, t) in &scan.damaged {
            tracing::warn!(
                seq,
                blob = %t.blob,
                tract = t.tract.0,
                offset = t.offset,
                "backup journal record damaged: not replayed (a write cut off by a crash was never acknowledged; \
                 otherwise the other replicas hold it and the scrubber's digests show the difference)"
            );
        }
        // Which record holds the newest bytes of each range, and each
        // tract's life as its newest record knows it.
        let mut index: JournalIndex<(BlobId, TractNo)> = JournalIndex::new();
        let mut life: HashMap<(BlobId, TractNo), Incarnation> = HashMap::new();
        for r in &scan.records {
            let key = (r.target.blob, r.target.tract);
            let (start, end) = (r.target.offset, r.target.offset + r.len);
            if life.insert(key, r.target.incarnation).is_some_and(|inc| inc != r.target.incarnation) {
                // A new life of the tract: nothing of the old one counts.
                index.remove_tract(key);
            }
            match r.kind {
                Kind::Data => index.insert(key, start, end, r.seq, 0),
                Kind::Supersede => index.remove_range(key, start, end),
            }
        }
        let mut pieces = Vec::new();
        for r in scan.records.iter().filter(|r| r.kind == Kind::Data) {
            let key = (r.target.blob, r.target.tract);
            let (start, end) = (r.target.offset, r.target.offset + r.len);
            pieces.clear();
            index.lookup_into(key, start, end, &mut pieces);
            for p in &pieces {
                let Piece::Journal { start: ps, end: pe, loc } = *p else { continue };
                if loc.record != r.seq {
                    continue;
                }
                let data = r.data.slice((ps - start) as usize..(pe - start) as usize);
                let crcs = piece_crcs(ps, &data);
                let w = TractWrite {
                    blob: r.target.blob,
                    incarnation: r.target.incarnation,
                    tract: r.target.tract,
                    version: r.target.version,
                    offset: ps,
                    data,
                    crcs: &crcs,
                    durability: Durability::Cached,
                };
                match self.write_with(w, ALWAYS).await {
                    Ok(()) => out.bytes += (pe - ps) as u64,
                    // The disk cannot take it now (full, failing): nothing
                    // is released, and the caller tries the whole replay
                    // again later. Skipping it would lose an acknowledged
                    // write.
                    Err(e @ (StoreError::Failed | StoreError::Io(_) | StoreError::DiskFull(_))) => {
                        return Err(e)
                    }
                    Err(e) => {
                        out.failed += 1;
                        tracing::error!(
                            seq = r.seq,
                            blob = %r.target.blob,
                            tract = r.target.tract.0,
                            offset = ps,
                            error = %e,
                            "backup journal record could not be replayed; the chunk is healed from another replica"
                        );
                    }
                }
            }
        }
        Ok(out)
    }

    /// The journal, if one is attached.
    pub fn backup_journal(&self) -> Option<&Arc<BackupJournal>> {
        self.backup.get().map(|b| &b.journal)
    }

    /// The journal's second area, if it has one.
    pub fn backup_second_area(&self) -> Option<&Arc<BackupJournal>> {
        self.backup.get().and_then(|b| b.second.as_ref())
    }

    /// For a write the journal takes: the whole chunks it leaves, as
    /// written (`first` and `over`: its data-disk writes of chunks
    /// `first_chunk..+n` of `slot`, partial pieces merged), so a record
    /// replays without reading what the data disk holds, which a power
    /// loss may have torn (module docs).
    pub(super) fn whole_chunks(
        &self,
        slot: u32,
        first_chunk: u32,
        n: usize,
        first: &[(u64, Bytes)],
        over: &[(u64, Bytes)],
    ) -> Option<Vec<u8>> {
        let journals = self.backup.get().is_some_and(|b| n as u64 * CHUNK_SIZE as u64 <= b.threshold as u64);
        journals.then(|| {
            let base = self.layout.data_offset_of(slot, first_chunk * CHUNK_SIZE);
            let mut whole = vec![0u8; n * CHUNK_SIZE as usize];
            for (at, b) in first.iter().chain(over) {
                let from = (at - base) as usize;
                whole[from..from + b.len()].copy_from_slice(b);
            }
            whole
        })
    }

    /// Acknowledges a change: once its data record is durable in the
    /// journal (`journaled` says `true`); otherwise once the data disk's
    /// group commit (if `disk_sync`) and its supersede record (if any) are
    /// both durable, side by side.
    pub(super) async fn make_durable(
        &self,
        journaled: Option<(Pending<'_>, bool)>,
        disk_sync: bool,
    ) -> Result<(), StoreError> {
        let in_journal = journaled.as_ref().is_some_and(|(_, data)| *data);
        let synced = async {
            if disk_sync && !in_journal {
                self.commit.sync().await.map_err(|_| StoreError::Failed)
            } else {
                Ok(())
            }
        };
        let recorded = async {
            match journaled {
                Some((pending, _)) => pending.commit().await.map(|_| ()).map_err(StoreError::from),
                None => Ok(()),
            }
        };
        let (synced, recorded) = futures::join!(synced, recorded);
        synced.and(recorded)?;
        if in_journal {
            self.stats.journaled_writes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Records `change` in the journal's order, under the tract's slot
    /// lock (module docs): a data record if it is a write the journal
    /// takes (returned with `true`: acknowledged once that record is
    /// durable), else a supersede record (`false`). `None` without a
    /// journal. A journal too full even for a supersede record is
    /// destaged first, here: that needs no slot lock.
    pub(super) async fn journal_change(
        &self,
        change: &Change<'_>,
    ) -> Result<Option<(Pending<'_>, bool)>, StoreError> {
        let Some(b) = self.backup.get() else { return Ok(None) };
        let target = |offset| Target {
            blob: change.blob,
            incarnation: change.incarnation,
            tract: change.tract,
            version: change.version,
            offset,
        };
        // A blob placed `hdd` is the cheap tier: it keeps off fast storage,
        // so its writes take the data disk's own sync like large ones.
        let takes =
            change.len <= b.threshold && !change.whole_tract && Placement::of(change.blob) != Placement::Hdd;
        let areas = || b.areas();
        if let Some((crcs, data)) = change.write.filter(|_| takes) {
            for (i, area) in areas().enumerate() {
                match area.reserve_data(&target(change.offset), crcs, data) {
                    Ok(p) => {
                        if i > 0 {
                            self.stats.second_area_records.fetch_add(1, Ordering::Relaxed);
                        }
                        return Ok(Some((p, true)));
                    }
                    // Full: the next area, else the data disk, marked below.
                    Err(JournalError::Full) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            self.stats.journal_full_writes.fetch_add(1, Ordering::Relaxed);
        }
        let (offset, len) =
            if change.whole_tract { (0, self.layout.tract_size) } else { (change.offset, change.len) };
        for attempt in 0..2 {
            for area in areas() {
                match area.reserve_supersede(&target(offset), len) {
                    Ok(p) => return Ok(Some((p, false))),
                    Err(JournalError::Full) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            if attempt == 0 {
                self.destage_backup().await?;
            }
        }
        Err(JournalError::Full.into())
    }

    /// Destages the backup journal for as long as the store lives: when it
    /// is a quarter full, and every `interval` while it holds anything, so
    /// the data disk never lags far behind and the journal rarely fills.
    pub async fn destage_loop(&self, env: &blizzard_env::Env, interval: std::time::Duration) {
        let Some(b) = self.backup.get() else { return std::future::pending().await };
        loop {
            tokio::select! {
                _ = b.filling() => {}
                _ = env.sleep(interval) => {}
            }
            if let Err(e) = self.destage_backup().await {
                tracing::error!(error = %e, "destaging the backup journal failed; journaled writes stay in the journal");
                env.sleep(interval).await;
            }
        }
    }

    /// Makes the data disk hold every journaled write applied so far and
    /// gives their journal space back. Returns the records released.
    pub async fn destage_backup(&self) -> Result<u64, StoreError> {
        let Some(b) = self.backup.get() else { return Ok(0) };
        if b.areas().all(|a| a.live_records() == 0) {
            return Ok(0);
        }
        // Every record below `upto`, in either area, has its bytes applied
        // already (their seqs were taken after that, under the slot lock).
        let upto = b.journal.next_seq();
        self.commit.sync().await.map_err(|_| StoreError::Failed)?;
        let mut released = 0;
        for a in b.areas() {
            released += a.release(upto).await?;
        }
        Ok(released)
    }
}

impl Backup {
    fn areas(&self) -> impl Iterator<Item = &Arc<BackupJournal>> {
        std::iter::once(&self.journal).chain(&self.second)
    }

    /// Returns once either area is a quarter full (`BackupJournal::filling`).
    async fn filling(&self) {
        match &self.second {
            Some(s) => tokio::select! {
                _ = self.journal.filling() => {}
                _ = s.filling() => {}
            },
            None => self.journal.filling().await,
        }
    }
}

/// The records of a journal's two areas as one scan, in `seq` order (each
/// area's scan is in `seq` order already; `backup::journal`, "Areas").
fn merge_scans(a: Scan, b: Scan) -> Scan {
    let mut records = a.records;
    records.extend(b.records);
    records.sort_by_key(|r| r.seq);
    let mut damaged = a.damaged;
    damaged.extend(b.damaged);
    damaged.sort_by_key(|d| d.0);
    Scan { records, damaged }
}

#[cfg(test)]
#[path = "backup_tests.rs"]
mod tests;
