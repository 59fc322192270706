//! LSVD volumes (design 0008; the LSVD paper, EuroSys '22, §3): a
//! volume's data is a log of immutable objects in an S3-compatible object
//! store, written through a log-structured journal on a local disk.
//!
//! - `format`: the stored formats (descriptor, object headers,
//!   checkpoints, journal header and records), bounded decoders.
//! - `extent_map`: the pure map from volume ranges to locations.
//! - `store`: names under the volume's prefix, creates that never
//!   overwrite, request counts.
//! - `objlog`: the object log: applying objects, reading them back with
//!   their CRCs, checkpoints, recovery and the claim of one writer.
//! - `s3`: the object store a URL names (S3 and compatible servers).
//! - `journal`: the write cache on a local disk, and its replay.
//! - `read_cache`: object data read before, kept in a file beside the
//!   journal (keyed by object and line, checked by the objects' CRCs).
//! - `volume`: [`LsvdVolume`]: the journal in front, the log behind, the
//!   destager between them (`volume::destage`); `volume::clean`: cleaning
//!   and checkpoints.
//! - `snapshot`: snapshots (a name for a point of the log, opened
//!   read-only as [`LsvdSnapshot`]) and clones (volumes whose log starts
//!   from another's snapshot).

pub mod error;
pub mod extent_map;
pub mod format;
pub mod journal;
pub mod objlog;
pub mod read_cache;
pub mod s3;
pub mod snapshot;
pub mod store;
pub mod volume;

pub use error::{Kind, LsvdError};
pub use read_cache::CacheStats;
pub use snapshot::{LsvdSnapshot, SnapshotInfo};
pub use store::Store;
pub use volume::{Config, Info, LsvdVolume, READ_CACHE_FILE};

/// Bugs planted on purpose so tests can show the crash checker catches
/// them. Only tests and `blizzard crashcheck --plant` set one.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Planted {
    #[default]
    None,
    /// The destager makes objects of journal records no sync covered
    /// (design 0008, invariant 1).
    DestageBeforeSync,
    /// The journal's tail moves past a batch's records (their space free
    /// for reuse) before the object holding them is durable (invariant 2).
    ReclaimBeforePut,
    /// Cleaning ignores snapshots: it cleans and deletes objects a
    /// snapshot's map reads (invariant 5).
    GcIgnoresSnapshots,
}

impl Planted {
    pub fn parse(s: &str) -> Option<Planted> {
        match s {
            "none" => Some(Planted::None),
            "destage-before-sync" => Some(Planted::DestageBeforeSync),
            "reclaim-before-put" => Some(Planted::ReclaimBeforePut),
            "gc-ignores-snapshots" => Some(Planted::GcIgnoresSnapshots),
            _ => None,
        }
    }
}
