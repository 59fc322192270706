//! The virtual disk (Blizzard §2): a volume is one blob; this crate turns
//! block reads, writes, flushes, trims and write-zeroes into tract
//! operations.
//!
//! - `superblock`: the volume's parameters in tract 0, two copies.
//! - `striping`: nested striping, volume bytes → (tract, offset).
//! - `io`: the blob as the volume sees it ([`BlobIo`]); the real blob store
//!   or, for the crash checker, a deterministic in-memory one.
//! - `cache`: acknowledged data not yet durable, overlaid on reads.
//! - `fast_ack`: flush-epoch commits with fast acknowledgment.
//! - `intent`: the write-intent log of a replicated volume: which tracts a
//!   crash may have left different on different replicas, and making them
//!   agree when the volume is opened again.
//! - `log`: out-of-order log commit: permutation, records, checkpoints,
//!   roll-forward recovery.
//! - `volume`: the [`Volume`] handle: range checks, read-only handling,
//!   the superblock; its engine does the rest.
//! - `engine`: the [`engine`] trait every commit mode and backend
//!   implements, and the types they share (a leaf: it imports no engine).
//! - `write_through`: the write-through engine, and what writing in place
//!   shares with fast-ack.
//! - `manage`: create, open, list, resize, delete volumes by name.
//! - `retry`: retrying a write an engine already acknowledged, until it
//!   lands or fails for good.
//! - `snap`: snapshots of volumes in the blob store (design 0011): a
//!   stack of layers in the volume's blob, and the catalog naming them.
//! - `control`: the control socket through which commands reach the
//!   process serving a volume (snapshots).
//! - `lsvd`: S3 volumes (design 0008): an LSVD volume behind the same
//!   [`Volume`] handle, its blob holding only the record.

pub mod access;
pub mod cache;
pub mod control;
pub(crate) mod engine;
mod extent_io;
pub mod fast_ack;
pub mod intent;
pub mod io;
pub mod lease;
pub mod log;
pub mod lsvd;
pub mod manage;
pub(crate) mod retry;
pub mod snap;
pub mod striping;
pub mod superblock;
pub mod volume;
pub(crate) mod write_through;

pub use io::{BlobIo, ClientBlobIo, IoError};
pub use lsvd::S3Spec;
pub use superblock::{
    Backend, CommitMode, ExposureLimits, FlushPolicy, S3Backend, Superblock, SuperblockError,
};
pub use volume::{AllocExtent, Allocation, Volume, VolumeSpec};

/// Bugs planted on purpose so tests can show the crash checker catches
/// them. Only tests and `blizzard crashcheck --plant` set one.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlantedBug {
    #[default]
    None,
    /// A durable flush returns before the writes it covers are durable.
    AckDurableFlushEarly,
    /// Fast-ack issues writes of later epochs before earlier ones retire.
    IssueAcrossEpochs,
    /// Log recovery accepts blocks without checking their CRC.
    SkipReadCrc,
    /// The log's block map takes writes as they become durable, not in LSN
    /// order, and checkpoints do not wait for the log to drain.
    AdvanceMapOutOfOrder,
    /// Log recovery steps over a hole and keeps rolling forward.
    RollForwardPastHole,
    /// Log recovery accepts an intact block without checking its LSN and
    /// checkpoint sequence number.
    ReuseWithoutSeq,
    /// Fast-ack takes a write through the tractservers' write caches as
    /// durable without syncing it.
    SkipCacheSync,
    /// Opening a replicated volume after an unclean close clears its
    /// write-intent bitmap without reconciling the tracts it names.
    SkipReconcile,
    /// Writes go out without waiting for their tracts' intent bits to be
    /// durable.
    WriteBeforeIntent,
    /// A snapshot freezes the head without making acknowledged writes
    /// durable first (fast-ack's still in its cache land in the new head).
    SnapshotSkipsFlush,
    /// A write to a chunk an older layer holds lands there, in the data a
    /// snapshot shares, instead of in the head.
    WriteIntoSnapshot,
    /// A grow does not zero what it gains, so data a shrink left past its
    /// end (its trims cut off by a crash) comes back.
    GrowKeepsOldData,
    /// Deleting a snapshot gives back its whole layer, though later views
    /// (the volume's own among them) read the chunks no later layer
    /// rewrote.
    ReclaimReadChunks,
    /// A rollback copies the snapshot's chunks over the head in place
    /// rather than into a new head: a crash leaves a mix.
    RollbackInPlace,
}

impl PlantedBug {
    pub fn parse(s: &str) -> Option<PlantedBug> {
        match s {
            "none" => Some(PlantedBug::None),
            "ack-durable-flush-early" => Some(PlantedBug::AckDurableFlushEarly),
            "issue-across-epochs" => Some(PlantedBug::IssueAcrossEpochs),
            "skip-read-crc" => Some(PlantedBug::SkipReadCrc),
            "map-out-of-order" => Some(PlantedBug::AdvanceMapOutOfOrder),
            "roll-past-hole" => Some(PlantedBug::RollForwardPastHole),
            "reuse-without-seq" => Some(PlantedBug::ReuseWithoutSeq),
            "skip-cache-sync" => Some(PlantedBug::SkipCacheSync),
            "skip-reconcile" => Some(PlantedBug::SkipReconcile),
            "write-before-intent" => Some(PlantedBug::WriteBeforeIntent),
            "snapshot-skips-flush" => Some(PlantedBug::SnapshotSkipsFlush),
            "write-into-snapshot" => Some(PlantedBug::WriteIntoSnapshot),
            "grow-keeps-old-data" => Some(PlantedBug::GrowKeepsOldData),
            "reclaim-read-chunks" => Some(PlantedBug::ReclaimReadChunks),
            "rollback-in-place" => Some(PlantedBug::RollbackInPlace),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0:?} does not exist; `blizzard volume list` shows the volumes")]
    NotFound(String),
    #[error("volume {0:?} already exists; pick another name or delete it first")]
    Exists(String),
    #[error("range [{offset}, +{len}) is past the end of the {size}-byte volume")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("invalid volume parameters: {0}")]
    Invalid(String),
    #[error("{0}")]
    Superblock(#[from] SuperblockError),
    /// Not a `source`: the message holds the blob store's, so an error
    /// chain (`{:#}`) prints it once.
    #[error("blob store: {0}")]
    Io(IoError),
    #[error("{0}")]
    Unsupported(String),
    /// A request refused for the reason (and remedy) its message gives: an
    /// S3 volume's prefix holding another volume, a cache that is not its.
    #[error("{0}")]
    Refused(String),
    #[error("could not make the replicas of tract {tract} agree after an unclean close: {source}; every replica must be reachable (bring its tractserver back, or wait until it is replaced), then open the volume again")]
    Reconcile { tract: u64, source: IoError },
    /// An S3 volume's data path (design 0008).
    #[error("{0}")]
    Lsvd(blizzard_lsvd::LsvdError),
    /// The object store at `url` failed a create, open or delete; `hint`
    /// says what to do.
    #[error("{url}: {error}{hint}")]
    S3 { url: String, error: blizzard_lsvd::LsvdError, hint: &'static str },
    #[error("{}", fenced_message(*newest))]
    Fenced { newest: u64 },
    #[error("volume {name:?} is open for writing by {} (its lease ends in {:.1} s unless that process renews it): stop that process, or open the volume read-only (`--read-only`); if that process is dead, wait for its lease to end or pass `--take-over`", if holder.is_empty() { "another process" } else { holder.as_str() }, remaining.as_secs_f64())]
    Held { name: String, holder: String, remaining: std::time::Duration },
}

fn fenced_message(newest: u64) -> String {
    let who = if newest == 0 {
        "this process lost its lease on the volume (another process took it over, or it was closed)"
            .to_string()
    } else {
        format!("another process opened this volume for writing (writer epoch {newest}) and the blob store now refuses this one's writes")
    };
    format!("{who}; writes acknowledged here but not yet durable are lost to it: stop using the volume here")
}

/// What a failure means to whoever serves the volume, coarsely: the one
/// thing a frontend matches on (NBD turns it into an errno), and what an
/// engine asks before retrying a write it already acknowledged
/// ([`retry::until_landed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A tractserver's disk is full: nothing lands until space is freed
    /// or servers are added (an engine retries, refusing new writes and
    /// flushes meanwhile).
    NoSpace,
    /// The request lies past the end of the volume.
    OutOfRange,
    /// A request no retry mends (bad parameters, a blob that is gone).
    Invalid,
    /// Another process holds or claimed the volume: this one may not
    /// change it.
    Fenced,
    /// Stored bytes failed their checksum on every replica asked.
    Corrupt,
    /// The blob store could not be reached or did not answer in time:
    /// retrying later may work.
    Unavailable,
}

impl VolumeError {
    /// What the error means, coarsely (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            VolumeError::OutOfRange { .. } => ErrorKind::OutOfRange,
            VolumeError::Invalid(_)
            | VolumeError::Unsupported(_)
            | VolumeError::Refused(_)
            | VolumeError::Exists(_) => ErrorKind::Invalid,
            VolumeError::NotFound(_) | VolumeError::Superblock(_) => ErrorKind::Invalid,
            VolumeError::Fenced { .. } | VolumeError::Held { .. } => ErrorKind::Fenced,
            VolumeError::Io(e) | VolumeError::Reconcile { source: e, .. } => e.kind(),
            VolumeError::Lsvd(e) | VolumeError::S3 { error: e, .. } => lsvd::kind(e),
        }
    }

    /// Whether this is stored data failing its checksum (see
    /// [`IoError::is_corrupt`]).
    pub fn is_corrupt(&self) -> bool {
        match self {
            VolumeError::Io(e) => e.is_corrupt(),
            VolumeError::Lsvd(e) => e.kind() == blizzard_lsvd::Kind::Corrupt,
            _ => false,
        }
    }

    /// Whether another process has claimed the volume since this one
    /// opened it (the blob store refused a change from this writer).
    pub fn is_fenced(&self) -> bool {
        self.fenced_by().is_some()
    }

    /// The writer epoch of the process that fenced this one, if that is
    /// what this error is.
    pub fn fenced_by(&self) -> Option<u64> {
        match self {
            VolumeError::Fenced { newest } => Some(*newest),
            VolumeError::Io(e) | VolumeError::Reconcile { source: e, .. } => e.fenced_by(),
            // The newer writer's epoch is in the message; 0 says "another".
            VolumeError::Lsvd(e) if e.kind() == blizzard_lsvd::Kind::Fenced => Some(0),
            _ => None,
        }
    }
}

impl From<IoError> for VolumeError {
    fn from(e: IoError) -> Self {
        VolumeError::Io(e)
    }
}

impl From<blizzard_client::ClientError> for VolumeError {
    fn from(e: blizzard_client::ClientError) -> Self {
        VolumeError::Io(IoError::Client(e))
    }
}
