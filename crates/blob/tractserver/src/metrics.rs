//! This server's state as Prometheus metrics (served at `GET /metrics`
//! when `TractServerConfig::metrics_listen` is set).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::service::TractService;

impl TractService {
    /// This server's state as Prometheus metrics.
    pub fn metrics_text(&self) -> String {
        let (slots, used) = self.store.usage();
        let st = &self.store.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let (filled, fill) = self.fill.report();
        let serving = if self.check_serving_now() { 1.0 } else { 0.0 };
        let mut text = blizzard_metrics::Text::new();
        text.gauge("blizzard_tract_slots", "Tract slots on this disk.", slots as f64)
            .gauge("blizzard_tract_slots_used", "Tract slots holding a tract.", used as f64)
            .gauge("blizzard_serving", "1 while this server holds a lease and is not fenced.", serving)
            .gauge(
                "blizzard_requests_in_flight",
                "Requests being served now.",
                self.inflight.load(Ordering::Relaxed) as f64,
            )
            .gauge(
                "blizzard_disk_zero_fill_bytes_left",
                "Bytes of the disk file the background zero-fill has not reached yet (0: done).",
                self.store.disk_preparing_left() as f64,
            )
            .counter("blizzard_tract_reads_total", "Tract reads served.", n(&st.reads))
            .counter("blizzard_tract_writes_total", "Tract writes applied.", n(&st.writes))
            .counter("blizzard_read_bytes_total", "Bytes read from tracts.", n(&st.bytes_read))
            .counter("blizzard_written_bytes_total", "Bytes written to tracts.", n(&st.bytes_written))
            .counter(
                "blizzard_fdatasync_total",
                "fdatasync calls (group commits).",
                self.store.syncs() as f64,
            )
            .gauge(
                "blizzard_journal_bytes_used",
                "Bytes of the chunk-entry journal's ring holding records not yet checkpointed.",
                self.store.journal_usage().0 as f64,
            )
            .gauge(
                "blizzard_journal_bytes",
                "Bytes of the chunk-entry journal's ring.",
                self.store.journal_usage().1 as f64,
            )
            .counter(
                "blizzard_journal_checkpoints_total",
                "Journal checkpoints (chunk entries copied into the chunk table).",
                self.store.journal_checkpoints() as f64,
            )
            .counter(
                "blizzard_corrupt_reads_total",
                "Chunk reads that failed their CRC.",
                n(&st.corrupt_reads),
            )
            .counter("blizzard_tract_digests_total", "Tract digests taken (reconciliation).", n(&st.digests))
            .counter(
                "blizzard_digest_chunks_read_total",
                "Chunks digests read from the disk (the rest were known in memory).",
                n(&st.digest_chunks_read),
            )
            .gauge("blizzard_writer_fences", "Blobs with a writer fence here.", self.fences.len() as f64)
            .gauge("blizzard_fill_rows", "Rows this server is still copying as a newcomer.", fill.rows as f64)
            .gauge(
                "blizzard_fill_rows_done",
                "Rows copied, not yet cleared by the metadata server.",
                filled.len() as f64,
            )
            .gauge(
                "blizzard_fill_tracts_total",
                "Tracts to copy in the rows being filled.",
                fill.tracts_total as f64,
            )
            .gauge(
                "blizzard_fill_tracts_done",
                "Tracts copied in the rows being filled.",
                fill.tracts_done as f64,
            )
            .counter(
                "blizzard_fill_bytes_total",
                "Bytes copied as a newcomer since start (whole tracts, and the chunks a repair found changed).",
                fill.bytes_done as f64,
            )
            .counter(
                "blizzard_fill_unchanged_bytes_total",
                "Bytes of tracts still held here from an earlier membership that a repair found unchanged, so did not copy.",
                self.fill.unchanged_bytes() as f64,
            )
            .counter(
                "blizzard_scrub_bytes_total",
                "Bytes the scrubber has checked.",
                n(&self.scrub.stats().bytes),
            )
            .counter(
                "blizzard_scrub_passes_total",
                "Full scrub passes over the disk.",
                n(&self.scrub.stats().passes),
            )
            .counter(
                "blizzard_scrub_damaged_total",
                "Damaged chunks the scrubber found.",
                n(&self.scrub.stats().damaged),
            )
            .counter(
                "blizzard_scrub_repaired_total",
                "Damaged chunks rewritten from another replica.",
                n(&self.scrub.stats().repaired),
            )
            .counter(
                "blizzard_scrub_unrepaired_total",
                "Damaged chunks no replica could supply when found (retried).",
                n(&self.scrub.stats().unrepaired),
            )
            .counter(
                "blizzard_orphans_freed_total",
                "Tracts freed because their blob is gone or their row left this server.",
                n(&self.scrub.stats().orphans_freed),
            );
        // The hybrid tier's backup journal, where there is one.
        if let Some(j) = self.store.backup_journal() {
            text.gauge(
                "blizzard_backup_journal_bytes",
                "Bytes of the backup journal's ring.",
                j.ring_len() as f64,
            )
            .gauge(
                "blizzard_backup_journal_used_bytes",
                "Ring bytes held by writes the data disk may not have yet.",
                j.used() as f64,
            )
            .gauge(
                "blizzard_backup_journal_records",
                "Journal records not yet destaged to the data disk.",
                j.live_records() as f64,
            )
            .counter(
                "blizzard_backup_journal_writes_total",
                "Writes acknowledged once durable in the backup journal.",
                n(&st.journaled_writes),
            )
            .gauge(
                "blizzard_backup_journal_replayed_records",
                "Records found in the journal at start and written again to the data disk.",
                n(&st.journal_replayed),
            )
            .counter(
                "blizzard_backup_journal_syncs_total",
                "fdatasync calls on the backup journal (each covers a group of writes).",
                j.syncs() as f64,
            )
            .counter(
                "blizzard_backup_journal_full_writes_total",
                "Small writes sent to the slow disk directly because every area of the journal was full.",
                n(&st.journal_full_writes),
            );
        }
        if let Some(j) = self.store.backup_second_area() {
            text.gauge(
                "blizzard_backup_journal_second_area_bytes",
                "Bytes of the ring of the journal's second area (taking records while the first is full).",
                j.ring_len() as f64,
            )
            .gauge(
                "blizzard_backup_journal_second_area_used_bytes",
                "Bytes of the second area held by writes the data disk may not have yet.",
                j.used() as f64,
            )
            .counter(
                "blizzard_backup_journal_second_area_records_total",
                "Records the journal's second area took because the first was full.",
                n(&st.second_area_records),
            );
        }
        text.finish()
    }
}
