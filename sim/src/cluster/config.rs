//! What a blob-simulator run is given and what it reports.

use super::*;

#[derive(Clone, Debug)]
pub struct BlobSimConfig {
    pub tractservers: usize,
    pub replication: u8,
    pub clients: usize,
    pub tracts_per_client: u64,
    pub writes_per_client: usize,
    pub tract_size: u32,
    /// Crash and restart tractservers during the run.
    pub crash_tractservers: bool,
    /// Crash and restart the metadata server (each replica) during the run.
    pub restart_meta: bool,
    /// Metadata replicas: 1 runs a single server keeping its state in
    /// memory; 3 or 5 run a replicated group (`blizzard meta --peers`,
    /// design 0007) on simulated disks, whose replicas crash (their disks
    /// losing, keeping or tearing unsynced writes), sometimes a majority
    /// of them at once for longer than the tractservers' lease.
    pub meta_replicas: usize,
    /// Cut, cut one way and hold network links during the run.
    pub partitions: bool,
    /// Tractservers that join the running cluster (FDS §3.4), each at a
    /// time drawn from the seed, on top of `tractservers`.
    pub joining: usize,
    /// Deliver the last request of one in this many of the clients'
    /// dropped connections again, late, on a new connection (`ghost`; 0:
    /// never).
    pub duplicates: u32,
    /// Flip a bit in stored tract data once the writes are done (3-way
    /// runs: see `run_blob_sim`).
    pub bit_flips: bool,
    /// Run tractservers' disks out of space for a while (`SimDisk::set_full`).
    pub full_disks: bool,
    /// A bug planted in every tractserver, to show the oracle catches it.
    pub planted_bug: blizzard_tractserver::PlantedBug,
    /// A bug planted in every metadata replica.
    pub meta_plant: MetaPlant,
    /// Hosts running a replicated volume (`volume_client`), crashed
    /// mid-write and restarted.
    pub volume_clients: usize,
    /// Operations each volume client issues at most, over all its lives.
    pub volume_ops: usize,
    /// Crash and restart volume clients while faults are on.
    pub crash_volume_clients: bool,
    /// When a volume client is crashed, the last change of one in this
    /// many of its connections that carried one arrives at its server
    /// late, 50 ms–3 s on (`ghost::deliver_late`; 0: never).
    pub late_requests: u32,
    /// Odd-numbered tractservers are of class hdd with a backup journal on
    /// a disk of their own (the hybrid tier, `blizzard_tractserver::
    /// backup`), which crashes with the data disk (losing, keeping or
    /// tearing unsynced writes on both).
    pub journals: bool,
}

impl Default for BlobSimConfig {
    fn default() -> Self {
        BlobSimConfig {
            tractservers: 6,
            replication: 3,
            clients: 2,
            tracts_per_client: 6,
            writes_per_client: 40,
            tract_size: 16 << 10,
            crash_tractservers: true,
            restart_meta: true,
            meta_replicas: 1,
            partitions: true,
            joining: 2,
            duplicates: 2,
            bit_flips: true,
            full_disks: true,
            planted_bug: blizzard_tractserver::PlantedBug::None,
            meta_plant: MetaPlant::None,
            volume_clients: 1,
            volume_ops: 400,
            crash_volume_clients: true,
            late_requests: 2,
            journals: true,
        }
    }
}

/// What a run did; the trace is what determinism is judged by.
#[derive(Debug)]
pub struct BlobSimReport {
    pub seed: u64,
    pub trace: Trace,
    pub acknowledged_writes: u64,
    pub verified_reads: u64,
    pub tractserver_crashes: u32,
    pub meta_restarts: u32,
    /// Times a majority of the metadata replicas was down at once.
    pub meta_outages: u32,
    pub link_faults: u32,
    /// Most rows seen being re-replicated at once (0: no recovery ran).
    pub rows_refilled: u64,
    /// Most rows seen with a pending member at once (0: nobody joined).
    pub rows_grown: u64,
    /// Requests delivered again, late (`ghost`).
    pub duplicates: u64,
    /// Bits flipped in stored tract data (the scrubber repairs them).
    pub bit_flips: u32,
    /// Times a tractserver's disk ran out of space, and the writes it
    /// refused meanwhile.
    pub full_disks: u32,
    pub full_disk_writes: u64,
    /// Volume clients crashed, and of those crashes the ones that cut off
    /// writes (issued and not completed, or acknowledged and not durable).
    pub volume_crashes: u32,
    pub volume_crashes_in_flight: u32,
    /// Late requests of crashed volume clients delivered to their servers,
    /// and of those the ones refused by the writer fence.
    pub late_deliveries: u64,
    pub late_fenced: u64,
    /// Tracts the volumes' recoveries reconciled, and the chunks they found
    /// different and repaired.
    pub tracts_reconciled: u64,
    pub chunk_repairs: u64,
    /// Volume-wide replica-agreement checks passed (one per recovery
    /// checked), and volume writes and trims acknowledged.
    pub replica_checks: u64,
    pub volume_ops: u64,
    /// Chunk-entry journal checkpoints the tractservers ran, all lives
    /// (their rings are tiny here: `TS_JOURNAL`).
    pub journal_checkpoints: u64,
    /// Writes the hdd tractservers' backup journals acknowledged, and
    /// records they replayed onto their data disks at restarts, all lives.
    pub journaled_writes: u64,
    pub journal_replayed: u64,
    /// Records the backup journals' second areas took, their first area
    /// being full, all lives.
    pub second_area_records: u64,
    /// Blobs and volumes created with placement hybrid: an ssd primary,
    /// hdd backups behind journals (design 0009).
    pub hybrid_blobs: u64,
    /// Tracts that tractservers back in rows they held before repaired
    /// rather than copied whole, and the bytes those repairs kept
    /// (incremental repair, design 0009), all lives.
    pub tracts_repaired: u64,
    pub repair_kept_bytes: u64,
    pub simulated: Duration,
}
