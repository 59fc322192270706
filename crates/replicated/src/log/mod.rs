//! The durable Raft log: openraft's [`RaftLogStorage`] and
//! [`RaftLogReader`] over the env seam's disks, in a directory of its own.
//!
//! Files (formats byte by byte in `segment.rs` and `meta.rs`):
//!
//! - `raft.meta`, 8 KiB: two 4 KiB slots written alternately, each with
//!   magic, version, a generation (the newer valid slot wins), the
//!   cluster and node this directory belongs to, the vote, the committed
//!   log id, the last purged log id and the first live segment number,
//!   CRC32C'd. A vote or purge point is one write and one sync; a
//!   committed id alone is written without a sync of its own (openraft
//!   saves one after every commit), always into the slot that is not the
//!   newest durable one, so losing it loses only that id.
//! - `log-<16 hex digits>`, [`LogConfig::segment_len`] bytes each
//!   (preallocated): a 64-byte header (magic, version, number, a random
//!   salt, the index of its first record, CRC) and records back to back,
//!   8-byte aligned. A record is a 48-byte header (magic, CRC, lengths,
//!   log id, run number), the entry's head and its body; its CRC covers
//!   the segment's salt, the previous record's CRC (a chain), the header
//!   and every byte. A record never spans segments; one longer than a
//!   segment gets a segment of its own sized to it, and an entry over
//!   [`ENTRY_LEN_MAX`] is refused ([`LogError::EntryTooLarge`]).
//!
//! Invariants:
//! - *Durable means synced.* An append's `IOFlushed` fires only after an
//!   fdatasync of every segment it wrote returned, and the flusher
//!   completes flushes in the order they were queued. So a record whose
//!   callback fired has every record written before it durable too: the
//!   acknowledged entries are always a prefix of the log.
//! - *The meta never runs ahead of the log.* Every meta write (vote,
//!   committed, purge point) first waits until every earlier append is
//!   durable (a flush barrier): all write I/O is serialized, as openraft
//!   requires, and a saved committed id always names a durable entry.
//! - *Dropped records never come back.* `truncate_after` zeroes the first
//!   dropped record's header and syncs it before returning (or removes
//!   its whole segment, durably); later records cannot chain past it.
//!   Records written after a truncation or a restart carry a fresh run
//!   number, so even the same entry written again is a different record
//!   and a stale one behind it fails the chain.
//! - *Readers see an append when it returns*, before it is durable: the
//!   index (and the cache of recent entries) is updated once the bytes
//!   are in the page cache; a read snapshots the index under one lock.
//! - *Memory says what a restart would find, or the store stops.* A
//!   failed write or sync marks the store failed: every later write,
//!   sync and callback reports an error (openraft stops the node), and
//!   a restart recovers what the disk holds.
//!
//! Recovery (`LogStore::open`), case by case:
//!
//! | on disk | treated as |
//! |---|---|
//! | no `raft.meta`, no segments | a fresh store: the meta is written (generation 1) |
//! | `raft.meta` short or with no valid slot, no segments | a fresh store (a crash while creating it) |
//! | no `raft.meta` (or a short one), segments exist | refuse to start ([`LogError::MetaMissing`], [`LogError::MetaLen`]) |
//! | both meta slots invalid, segments exist | refuse ([`LogError::MetaUnreadable`]): the vote and purge point are unknown |
//! | one slot valid (the other torn, damaged or never written) | that one |
//! | both valid | the higher generation |
//! | another cluster or node id in the meta | refuse ([`LogError::WrongMember`]) |
//! | segments numbered below the first live one | leftovers of a purge cut short: removed |
//! | a live segment missing before the last one present | refuse ([`LogError::MissingSegment`]) |
//! | first live segment starts after the purge point + 1 | refuse ([`LogError::SegmentGap`]) |
//! | records at or below the purge point | skipped (their chain is still checked) |
//! | a record with bad magic, lengths or CRC (chained) | the end of that segment's records |
//! | a CRC-valid record that does not decode or is out of sequence | refuse ([`LogError::Undecodable`], [`LogError::Corrupt`]) |
//! | after a segment's last record, a next segment with a valid header starting at the next index | the log goes on there (the writer rolled over) |
//! | otherwise | the end of the log (a torn tail) |
//! | segments after the end of the log | never acknowledged: removed (highest first) |
//! | the log ends before the saved committed id | refuse ([`LogError::CommittedLost`]): synced records were lost |
//!
//! Why a torn tail is safe to drop: flushes complete in order, so a
//! callback that fired covered every byte written before it. The first
//! record that is not whole was therefore never acknowledged, and neither
//! was anything written after it. The bytes a crash left unsynced but
//! kept are made durable (every live segment and the meta are synced)
//! before `open` returns, so what recovery reports is what the next crash
//! will find too.
//!
//! Reads: the newest entries (at most [`LogConfig::cache_entries_max`]
//! and [`LogConfig::cache_bytes_max`]) are kept decoded in memory; older
//! ones are read from their segment (the page cache, mostly) and checked
//! against the CRC the index remembers before they are decoded.

mod meta;
mod segment;

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use openraft::storage::{IOFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::OptionalSend;
use tokio::sync::{mpsc, oneshot};

use blizzard_env::{Disk, Env, GroupCommit};

use crate::types::{Entry, LogId, NodeId, Raft, Vote};
use meta::{Meta, SlotError, META_FILE, META_LEN, META_SLOT_LEN};
use segment::{
    align, decode_record, parse_segment_name, segment_name, Invalid, Record, RecordError, RecordHeader,
    SegmentHeader, RECORD_HEADER_LEN, SEGMENT_HEADER_LEN, SEGMENT_PREFIX,
};
pub use segment::{Undecodable, ENTRY_LEN_MAX};

/// Default segment length.
pub const SEGMENT_LEN_DEFAULT: u64 = 64 << 20;
/// Smallest segment length accepted (tests use tiny segments, so that
/// rollover happens all the time).
pub const SEGMENT_LEN_MIN: u64 = 16 << 10;
/// Segment files are allocated in multiples of this.
pub const SEGMENT_LEN_ALIGN: u64 = 4096;
/// Default bound on the entries kept decoded in memory.
pub const CACHE_ENTRIES_MAX: usize = 8192;
/// Default bound on the encoded bytes of the entries kept in memory.
pub const CACHE_BYTES_MAX: usize = 64 << 20;
/// Default bound on the bytes one `limited_get_log_entries` returns
/// (replication's reads; at least one entry is always returned).
pub const READ_BYTES_MAX: usize = 4 << 20;
/// Reads from a segment are done in pieces of at most this (one longer
/// record is read whole): small enough to be served from the page cache.
const READ_CHUNK_MAX: usize = 256 << 10;
/// Flushes queued for the flusher: an append waits for room beyond this.
const FLUSH_QUEUE_MAX: usize = 1024;
/// How often a read retries when the log changed under it (a truncation
/// or purge rewrote or removed what it was reading).
const READ_RETRIES: usize = 4;

const _: () = assert!(SEGMENT_LEN_MIN >= SEGMENT_HEADER_LEN + 2 * RECORD_HEADER_LEN as u64);
const _: () = assert!(
    SEGMENT_LEN_MIN.is_multiple_of(SEGMENT_LEN_ALIGN)
        && SEGMENT_LEN_DEFAULT.is_multiple_of(SEGMENT_LEN_ALIGN)
);
const _: () = assert!(SEGMENT_LEN_DEFAULT >= SEGMENT_LEN_MIN);

/// How the log lays itself out and how much it keeps in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// Bytes per segment file, preallocated (a multiple of 4096, at least
    /// [`SEGMENT_LEN_MIN`]). A record longer than fits gets a segment of
    /// its own, as long as it needs.
    pub segment_len: u64,
    /// Most entries kept decoded in memory (the newest ones).
    pub cache_entries_max: usize,
    /// Most encoded bytes of the entries kept in memory.
    pub cache_bytes_max: usize,
    /// Most bytes one `limited_get_log_entries` returns (one entry at
    /// least).
    pub read_bytes_max: usize,
    /// Join each record into one buffer before writing it (a copy of every
    /// entry's body), instead of writing the body's buffers as they are:
    /// the zero-copy path turned off, for the benchmark's comparison.
    pub copy_payloads: bool,
    /// For the simulator's checkers only: report appends durable without
    /// an `fdatasync` (so Raft commits, and the runtime acknowledges,
    /// entries a majority may still lose to a power failure).
    pub planted_ack_before_sync: bool,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            segment_len: SEGMENT_LEN_DEFAULT,
            cache_entries_max: CACHE_ENTRIES_MAX,
            cache_bytes_max: CACHE_BYTES_MAX,
            read_bytes_max: READ_BYTES_MAX,
            copy_payloads: false,
            planted_ack_before_sync: false,
        }
    }
}

impl LogConfig {
    fn check(&self) -> Result<(), LogError> {
        if self.segment_len < SEGMENT_LEN_MIN || !self.segment_len.is_multiple_of(SEGMENT_LEN_ALIGN) {
            return Err(LogError::SegmentLen { len: self.segment_len });
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error(
        "log segment length {len} is invalid: it must be a multiple of {SEGMENT_LEN_ALIGN} and at least {SEGMENT_LEN_MIN}"
    )]
    SegmentLen { len: u64 },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{} belongs to cluster {found_cluster:032x} member {found_node}, not to cluster {cluster:032x} member {node}: it was created with another --id or member list (--peers); start it with the ones it was created with, or give this member a new data directory",
        dir.display()
    )]
    WrongMember { dir: PathBuf, found_cluster: u128, found_node: NodeId, cluster: u128, node: NodeId },
    #[error(
        "{} is {len} bytes, not {META_LEN}, and log segments exist beside it: it is not this log's meta file; restore the directory from a backup, or remove it and add this member again as a new one",
        path.display()
    )]
    MetaLen { path: PathBuf, len: u64 },
    #[error(
        "{} is missing but log segments exist in its directory: refusing to guess the vote and the purge point; restore the directory from a backup, or remove it and add this member again as a new one",
        path.display()
    )]
    MetaMissing { path: PathBuf },
    #[error(
        "neither slot of {} is valid (A: {a}; B: {b}) but log segments exist: refusing to guess the vote and the purge point; restore the directory from a backup, or remove it and add this member again as a new one",
        path.display()
    )]
    MetaUnreadable { path: PathBuf, a: SlotError, b: SlotError },
    #[error(
        "{} is missing from the middle of the log (its live segments run from number {first} to {last}): refusing to start with a hole; restore it from a backup",
        path.display()
    )]
    MissingSegment { path: PathBuf, first: u64, last: u64 },
    #[error(
        "{} starts at index {first_index} but the log resumes at index {expected} after its purge point: entries are missing; restore the directory from a backup",
        path.display()
    )]
    SegmentGap { path: PathBuf, first_index: u64, expected: u64 },
    #[error(
        "the log ends at {last} but raft.meta says {committed} was committed: synced records were lost or damaged ({stop}); restore the directory from a backup, or remove it and add this member again as a new one"
    )]
    CommittedLost { committed: LogId, last: String, stop: String },
    #[error(
        "the record at {} offset {offset} passed its CRC but cannot be read ({source}): this build cannot read this log (a newer format, or a bug)",
        path.display()
    )]
    Undecodable { path: PathBuf, offset: u64, source: Undecodable },
    #[error("log record {index} in {} at offset {offset} is damaged ({why}): the disk returned bytes that were not written there", path.display())]
    Corrupt { path: PathBuf, offset: u64, index: u64, why: String },
    #[error(
        "entry {index} is {len} bytes encoded, more than the log's maximum of {ENTRY_LEN_MAX}: split the batch"
    )]
    EntryTooLarge { index: u64, len: u64 },
    #[error(
        "append of entry {index}, but the log expects entry {expected} next: entries must follow the last one without a hole"
    )]
    NotConsecutive { index: u64, expected: u64 },
    #[error(
        "{0}; the log store no longer trusts its disk: restart the member (recovery keeps every acknowledged entry)"
    )]
    SyncFailed(String),
    #[error(
        "the log store failed an earlier write or sync and no longer trusts its disk: restart the member (recovery keeps every acknowledged entry)"
    )]
    Failed,
    #[error("the log store's flusher has stopped (the runtime is shutting down)")]
    Stopped,
}

impl From<LogError> for io::Error {
    fn from(e: LogError) -> io::Error {
        let kind = match &e {
            LogError::Io { source, .. } => source.kind(),
            LogError::EntryTooLarge { .. } | LogError::NotConsecutive { .. } => io::ErrorKind::InvalidInput,
            LogError::Corrupt { .. } | LogError::Undecodable { .. } => io::ErrorKind::InvalidData,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

/// Counters and the current shape of the log, for `/metrics` and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogStats {
    /// `append` calls.
    pub appends: u64,
    /// Entries appended.
    pub entries: u64,
    /// fdatasyncs of segments and of the meta file (recovery's included).
    pub syncs: u64,
    /// Bytes handed to the disks (records, segment headers, meta slots).
    pub bytes_written: u64,
    /// Live segment files.
    pub segments: usize,
    pub first_index: Option<u64>,
    pub last_index: Option<u64>,
    pub cached_entries: usize,
}

/// The durable Raft log of one member. Cheap to clone (an `Arc` inside);
/// every clone is a reader handle too (openraft's `LogReader`).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<Inner>,
}

struct Inner {
    env: Env,
    dir: PathBuf,
    cfg: LogConfig,
    /// What readers see; never held across an await.
    shared: Mutex<Shared>,
    /// Serializes the write path (appends, truncations, purges, meta
    /// writes), in the order openraft issues them.
    writer: tokio::sync::Mutex<WriteState>,
    flush_tx: mpsc::Sender<Flush>,
    health: Arc<Health>,
}

/// Shared with the flusher.
#[derive(Default)]
struct Health {
    failed: AtomicBool,
    appends: AtomicU64,
    entries: AtomicU64,
    syncs: AtomicU64,
    bytes_written: AtomicU64,
}

struct Segment {
    number: u64,
    path: PathBuf,
    disk: Arc<dyn Disk>,
    commit: GroupCommit,
    salt: u64,
    /// Its length as its header says: no record reaches past it.
    len: u64,
}

/// Where one live entry's record is.
#[derive(Clone, Copy, Debug)]
struct Loc {
    log_id: LogId,
    seg: u64,
    offset: u64,
    /// Header included, padding excluded.
    len: u32,
    crc: u32,
    /// The CRC its chain starts from (the record before it).
    prev: u32,
}

struct Shared {
    /// Live segments by number: contiguous numbers.
    segments: BTreeMap<u64, Arc<Segment>>,
    /// One per live entry, consecutive indexes.
    locs: VecDeque<Loc>,
    /// The newest entries, decoded, with their encoded sizes: the last
    /// `cache.len()` of `locs`.
    cache: VecDeque<(Entry, usize)>,
    cache_bytes: usize,
    vote: Option<Vote>,
    committed: Option<LogId>,
    purged: Option<LogId>,
    /// Bumped by every truncation and purge: a read that failed while it
    /// changed tries again.
    generation: u64,
}

impl Shared {
    fn first_index(&self) -> Option<u64> {
        self.locs.front().map(|l| l.log_id.index)
    }

    fn last_log_id(&self) -> Option<LogId> {
        self.locs.back().map(|l| l.log_id).or(self.purged)
    }

    /// The index the next append must have (`None`: anything, the log has
    /// never held an entry since it was created or wiped).
    fn next_index(&self) -> Option<u64> {
        self.last_log_id().map(|l| l.index + 1)
    }

    fn loc(&self, index: u64) -> Option<&Loc> {
        let first = self.first_index()?;
        self.locs.get(usize::try_from(index.checked_sub(first)?).ok()?)
    }

    fn push(&mut self, e: Entry, loc: Loc, cfg: &LogConfig) {
        debug_assert!(self.next_index().is_none_or(|n| n == loc.log_id.index));
        self.locs.push_back(loc);
        self.cache.push_back((e, loc.len as usize));
        self.cache_bytes += loc.len as usize;
        while self.cache.len() > cfg.cache_entries_max || self.cache_bytes > cfg.cache_bytes_max {
            match self.cache.pop_front() {
                Some((_, n)) => self.cache_bytes -= n,
                None => break,
            }
        }
    }

    /// Forgets the entries from `from` on.
    fn truncate_from(&mut self, from: u64) {
        while self.locs.back().is_some_and(|l| l.log_id.index >= from) {
            self.locs.pop_back();
        }
        while self.cache.back().is_some_and(|(e, _)| e.log_id.index >= from) {
            if let Some((_, n)) = self.cache.pop_back() {
                self.cache_bytes -= n;
            }
        }
        self.generation += 1;
    }

    /// Forgets the entries up to `id`, inclusive.
    fn purge_to(&mut self, id: LogId) {
        while self.locs.front().is_some_and(|l| l.log_id.index <= id.index) {
            self.locs.pop_front();
        }
        while self.cache.front().is_some_and(|(e, _)| e.log_id.index <= id.index) {
            if let Some((_, n)) = self.cache.pop_front() {
                self.cache_bytes -= n;
            }
        }
        self.purged = Some(id);
        self.generation += 1;
    }
}

/// One `write_at` of an append: a segment and its pieces.
type SegmentWrite = (Arc<Segment>, Vec<(u64, Bytes)>);

/// Where the next record goes.
#[derive(Clone)]
struct Tail {
    seg: Arc<Segment>,
    offset: u64,
    prev: u32,
}

struct WriteState {
    /// `None`: the next append starts segment `next_segment`.
    tail: Option<Tail>,
    next_segment: u64,
    /// Written into every record; drawn anew at open and at each
    /// truncation (see the invariants).
    run: u64,
    meta_disk: Arc<dyn Disk>,
    meta_path: PathBuf,
    meta: Meta,
    /// The slot of the newest meta written.
    meta_slot: usize,
    /// The slot of the newest meta made durable: never written again
    /// until another slot is durable, so a torn or lost unsynced meta
    /// write always leaves it (see `save_committed_lazily`).
    durable_slot: usize,
}

/// Work for the flusher: segments to sync, then what to tell.
struct Flush {
    segs: Vec<Arc<Segment>>,
    done: Done,
}

enum Done {
    Io(IOFlushed<Raft>),
    Signal(oneshot::Sender<Result<(), String>>),
}

impl Done {
    fn complete(self, res: &Result<(), String>) {
        match self {
            Done::Io(cb) => cb.io_completed(res.clone().map_err(io::Error::other)),
            Done::Signal(tx) => {
                let _ = tx.send(res.clone());
            }
        }
    }
}

const FAILED: &str = "an earlier write or fdatasync of the log failed";

/// The group commit: takes every flush queued so far, syncs each segment
/// they wrote once, then completes them in order.
async fn flusher(mut rx: mpsc::Receiver<Flush>, health: Arc<Health>, ack_before_sync: bool) {
    while let Some(first) = rx.recv().await {
        // Appends ready to run reach the page cache and queue first, so
        // that this sync covers them too (costs nothing when alone).
        tokio::task::yield_now().await;
        let mut batch = vec![first];
        while batch.len() < FLUSH_QUEUE_MAX {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        let mut segs: Vec<Arc<Segment>> = Vec::new();
        for f in &batch {
            for s in &f.segs {
                // By identity: a number is reused after its segment was
                // removed by a truncation, and both may be in one batch.
                if !segs.iter().any(|x| Arc::ptr_eq(x, s)) {
                    segs.push(s.clone());
                }
            }
        }
        if ack_before_sync {
            // The planted bug: durable before it is (no sync at all: the
            // bytes reach the disk whenever something else syncs it).
            for f in batch {
                f.done.complete(&Ok(()));
            }
            continue;
        }
        let res = sync_all(&segs, &health).await;
        for f in batch {
            f.done.complete(&res);
        }
    }
}

async fn sync_all(segs: &[Arc<Segment>], health: &Health) -> Result<(), String> {
    for s in segs {
        if health.failed.load(Ordering::Acquire) {
            return Err(FAILED.to_string());
        }
        let res = s.commit.sync().await;
        health.syncs.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = res {
            health.failed.store(true, Ordering::Release);
            return Err(format!("fdatasync of {} failed: {e}", s.path.display()));
        }
    }
    if health.failed.load(Ordering::Acquire) {
        return Err(FAILED.to_string());
    }
    Ok(())
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LogError + 'a {
    move |source| LogError::Io { what, path: path.to_path_buf(), source }
}

/// Reads a segment front to back in chunks.
struct Window<'a> {
    disk: &'a Arc<dyn Disk>,
    limit: u64,
    start: u64,
    buf: Bytes,
}

impl Window<'_> {
    /// `[off, off + len)`, which the caller checked lies below `limit`.
    async fn get(&mut self, off: u64, len: usize) -> io::Result<Bytes> {
        let end = off + len as u64;
        let have = self.start + self.buf.len() as u64;
        if off < self.start || end > have {
            let want = (len.max(READ_CHUNK_MAX) as u64).min(self.limit - off);
            self.buf = self.disk.read_at(off, want as usize).await?;
            self.start = off;
        }
        let at = (off - self.start) as usize;
        Ok(self.buf.slice(at..at + len))
    }
}

/// What recovery found.
struct Recovered {
    shared: Shared,
    write: WriteState,
    syncs: u64,
}

impl LogStore {
    /// Opens the log in `dir` (creating it if new) for member `node` of
    /// `cluster`, recovering what a crash left (see the module's table).
    pub async fn open(
        env: &Env,
        dir: &Path,
        cluster: u128,
        node: NodeId,
        cfg: LogConfig,
    ) -> Result<LogStore, LogError> {
        cfg.check()?;
        let rec = recover(env, dir, cluster, node, &cfg).await?;
        let health = Arc::new(Health::default());
        health.syncs.store(rec.syncs, Ordering::Relaxed);
        let (flush_tx, rx) = mpsc::channel(FLUSH_QUEUE_MAX);
        tokio::spawn(flusher(rx, health.clone(), cfg.planted_ack_before_sync));
        let inner = Inner {
            env: env.clone(),
            dir: dir.to_path_buf(),
            cfg,
            shared: Mutex::new(rec.shared),
            writer: tokio::sync::Mutex::new(rec.write),
            flush_tx,
            health,
        };
        Ok(LogStore { inner: Arc::new(inner) })
    }

    pub fn stats(&self) -> LogStats {
        let h = &self.inner.health;
        let s = self.inner.lock();
        LogStats {
            appends: h.appends.load(Ordering::Relaxed),
            entries: h.entries.load(Ordering::Relaxed),
            syncs: h.syncs.load(Ordering::Relaxed),
            bytes_written: h.bytes_written.load(Ordering::Relaxed),
            segments: s.segments.len(),
            first_index: s.first_index(),
            last_index: s.locs.back().map(|l| l.log_id.index),
            cached_entries: s.cache.len(),
        }
    }

    /// Appends `entries` (readable when this returns); `done` is told once
    /// they are durable, or why they cannot be.
    async fn append_entries(&self, entries: Vec<Entry>, done: Done) -> Result<(), LogError> {
        let mut w = self.inner.writer.lock().await;
        match self.write_entries(&mut w, entries).await {
            Ok(segs) => {
                // Queued under the writer lock: flushes complete in the
                // order their writes were made.
                if let Err(mpsc::error::SendError(f)) = self.inner.flush_tx.send(Flush { segs, done }).await {
                    f.done.complete(&Err("the log's flusher has stopped".to_string()));
                    return Err(LogError::Stopped);
                }
                Ok(())
            }
            Err(e) => {
                done.complete(&Err(e.to_string()));
                Err(e)
            }
        }
    }

    /// Encodes, places and writes `entries`, then publishes them to
    /// readers; returns the segments written, for the flusher.
    async fn write_entries(
        &self,
        w: &mut WriteState,
        entries: Vec<Entry>,
    ) -> Result<Vec<Arc<Segment>>, LogError> {
        let inner = &*self.inner;
        inner.check_failed()?;
        inner.health.appends.fetch_add(1, Ordering::Relaxed);
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let mut expected = inner.lock().next_index();
        let mut writes: Vec<SegmentWrite> = Vec::new();
        let mut placed: Vec<(Entry, Loc)> = Vec::with_capacity(entries.len());
        let mut new_segments: Vec<Arc<Segment>> = Vec::new();
        let mut tail = w.tail.clone();
        let mut next_segment = w.next_segment;
        let mut bytes = 0u64;
        for e in entries {
            let index = e.log_id.index;
            if let Some(x) = expected.filter(|x| *x != index) {
                return Err(LogError::NotConsecutive { index, expected: x });
            }
            expected = Some(index + 1);
            let mut rec = Record::encode(&e, w.run).map_err(|len| LogError::EntryTooLarge { index, len })?;
            let need = rec.len();
            let t = match tail.take() {
                Some(t) if t.offset + need <= t.seg.len => t,
                _ => {
                    let len = inner
                        .cfg
                        .segment_len
                        .max((SEGMENT_HEADER_LEN + need).div_ceil(SEGMENT_LEN_ALIGN) * SEGMENT_LEN_ALIGN);
                    let (seg, header, crc) = inner.create_segment(next_segment, len, index).await?;
                    next_segment += 1;
                    bytes += header.len() as u64;
                    writes.push((seg.clone(), vec![(0, header)]));
                    new_segments.push(seg.clone());
                    Tail { seg, offset: SEGMENT_HEADER_LEN, prev: crc }
                }
            };
            let (crc, first) = rec.seal(t.seg.salt, t.prev);
            let loc = Loc {
                log_id: e.log_id,
                seg: t.seg.number,
                offset: t.offset,
                len: need as u32,
                crc,
                prev: t.prev,
            };
            let pieces = match writes.last_mut() {
                Some((s, p)) if Arc::ptr_eq(s, &t.seg) => p,
                _ => {
                    writes.push((t.seg.clone(), Vec::new()));
                    &mut writes.last_mut().expect("just pushed").1
                }
            };
            let mut at = t.offset + first.len() as u64;
            if inner.cfg.copy_payloads {
                let mut joined = Vec::with_capacity(need as usize);
                joined.extend_from_slice(&first);
                for p in rec.body.drain(..) {
                    joined.extend_from_slice(&p);
                    at += p.len() as u64;
                }
                pieces.push((t.offset, Bytes::from(joined)));
            } else {
                pieces.push((t.offset, first));
                for p in rec.body.drain(..) {
                    let n = p.len() as u64;
                    pieces.push((at, p));
                    at += n;
                }
            }
            debug_assert_eq!(at, t.offset + need);
            bytes += need;
            placed.push((e, loc));
            tail = Some(Tail { offset: align(t.offset + need), prev: crc, seg: t.seg });
        }
        for (seg, pieces) in writes {
            seg.disk.write_at(pieces).await.map_err(|source| {
                inner.fail();
                LogError::Io { what: "writing", path: seg.path.clone(), source }
            })?;
        }
        let touched: Vec<Arc<Segment>> = {
            let mut s = inner.lock();
            for seg in new_segments {
                s.segments.insert(seg.number, seg);
            }
            let mut touched: Vec<u64> = Vec::new();
            let n = placed.len() as u64;
            for (e, loc) in placed {
                if touched.last() != Some(&loc.seg) {
                    touched.push(loc.seg);
                }
                s.push(e, loc, &inner.cfg);
            }
            inner.health.entries.fetch_add(n, Ordering::Relaxed);
            touched.iter().filter_map(|n| s.segments.get(n).cloned()).collect()
        };
        inner.health.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        w.tail = tail;
        w.next_segment = next_segment;
        Ok(touched)
    }

    /// Returns once everything written before it (and `segs`) is durable.
    async fn barrier(&self, segs: Vec<Arc<Segment>>) -> Result<(), LogError> {
        let (tx, rx) = oneshot::channel();
        if self.inner.flush_tx.send(Flush { segs, done: Done::Signal(tx) }).await.is_err() {
            return Err(LogError::Stopped);
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(why)) => Err(LogError::SyncFailed(why)),
            Err(_) => Err(LogError::Stopped),
        }
    }

    /// Writes the next meta slot with `change` applied, after every
    /// earlier log write is durable.
    async fn write_meta(&self, w: &mut WriteState, change: impl FnOnce(&mut Meta)) -> Result<(), LogError> {
        self.write_meta_with(w, change, true).await
    }

    /// Writes the meta (after every earlier append is durable, so it never
    /// names entries the log might lose) into the slot that is not the
    /// durable one; with `sync`, makes it the durable one.
    async fn write_meta_with(
        &self,
        w: &mut WriteState,
        change: impl FnOnce(&mut Meta),
        sync: bool,
    ) -> Result<(), LogError> {
        let inner = &*self.inner;
        self.barrier(Vec::new()).await?;
        let mut m = w.meta.clone();
        change(&mut m);
        m.generation += 1;
        let slot = 1 - w.durable_slot;
        let bytes = m.encode();
        let n = bytes.len() as u64;
        let fail = |source| {
            inner.fail();
            LogError::Io { what: "writing", path: w.meta_path.clone(), source }
        };
        w.meta_disk.write_at(vec![((slot * META_SLOT_LEN) as u64, bytes)]).await.map_err(fail)?;
        if sync {
            let synced = w.meta_disk.sync().await;
            inner.health.syncs.fetch_add(1, Ordering::Relaxed);
            synced.map_err(|source| {
                inner.fail();
                LogError::Io { what: "syncing", path: w.meta_path.clone(), source }
            })?;
            w.durable_slot = slot;
        }
        inner.health.bytes_written.fetch_add(n, Ordering::Relaxed);
        w.meta = m;
        w.meta_slot = slot;
        Ok(())
    }

    async fn save_vote_durably(&self, vote: Vote) -> Result<(), LogError> {
        let mut w = self.inner.writer.lock().await;
        self.inner.check_failed()?;
        self.write_meta(&mut w, move |m| m.vote = Some(vote)).await?;
        self.inner.lock().vote = Some(vote);
        Ok(())
    }

    /// Records the committed id without an `fdatasync` of its own: openraft
    /// saves it after every commit, and a sync each time would cost as much
    /// as the appends. It is written (after a barrier: never past the
    /// durable log) into the non-durable slot, and becomes durable with the
    /// next synced meta write (a vote, a purge) or the next sync of the
    /// file. Losing it only makes a restarted member re-learn the commit
    /// point from the leader before applying what follows it; its state
    /// machine is in memory, rebuilt from the snapshot and the log.
    async fn save_committed_lazily(&self, committed: Option<LogId>) -> Result<(), LogError> {
        let mut w = self.inner.writer.lock().await;
        self.inner.check_failed()?;
        if w.meta.committed == committed {
            return Ok(());
        }
        self.write_meta_with(&mut w, move |m| m.committed = committed, false).await?;
        self.inner.lock().committed = committed;
        Ok(())
    }

    async fn truncate(&self, last: Option<LogId>) -> Result<(), LogError> {
        let inner = &*self.inner;
        let mut w = inner.writer.lock().await;
        inner.check_failed()?;
        let (drop, removed, kept) = {
            let mut s = inner.lock();
            let (Some(first), Some(last_loc)) = (s.first_index(), s.locs.back()) else { return Ok(()) };
            let last_index = last_loc.log_id.index;
            let from = match last {
                None => first,
                Some(id) => id.index.saturating_add(1).max(first),
            };
            if from > last_index {
                return Ok(());
            }
            let Some(drop) = s.loc(from).copied() else { return Ok(()) };
            s.truncate_from(from);
            // A segment whose first record goes is removed whole; one that
            // keeps records gets the dropped one's header zeroed.
            let whole = drop.offset == SEGMENT_HEADER_LEN;
            let cut = if whole { drop.seg } else { drop.seg + 1 };
            let removed: Vec<Arc<Segment>> = s.segments.split_off(&cut).into_values().collect();
            let kept = if whole { None } else { s.segments.get(&drop.seg).cloned() };
            (drop, removed, kept)
        };
        w.run = inner.env.random_u64();
        // From the tail backward: a truncation cut short leaves a prefix.
        for seg in removed.iter().rev() {
            inner.env.remove_disk(&seg.path).await.map_err(|source| {
                inner.fail();
                LogError::Io { what: "removing", path: seg.path.clone(), source }
            })?;
        }
        match kept {
            None => {
                w.tail = None;
                w.next_segment = drop.seg;
            }
            Some(seg) => {
                static ZEROS: [u8; RECORD_HEADER_LEN] = [0; RECORD_HEADER_LEN];
                seg.disk.write_at(vec![(drop.offset, Bytes::from_static(&ZEROS))]).await.map_err(
                    |source| {
                        inner.fail();
                        LogError::Io { what: "writing", path: seg.path.clone(), source }
                    },
                )?;
                inner.health.bytes_written.fetch_add(RECORD_HEADER_LEN as u64, Ordering::Relaxed);
                self.barrier(vec![seg.clone()]).await?;
                w.tail = Some(Tail { seg, offset: drop.offset, prev: drop.prev });
                w.next_segment = drop.seg + 1;
            }
        }
        Ok(())
    }

    async fn purge_to(&self, id: LogId) -> Result<(), LogError> {
        let inner = &*self.inner;
        let mut w = inner.writer.lock().await;
        inner.check_failed()?;
        let first_live = {
            let s = inner.lock();
            if s.purged.is_some_and(|p| p.index >= id.index) {
                return Ok(());
            }
            match (s.first_index(), s.loc(id.index.saturating_add(1))) {
                // Nothing live at or below the purge point: no segment goes.
                (Some(first), _) if id.index < first => w.meta.first_live,
                (_, Some(l)) => l.seg,
                // Everything goes; the next append starts a new segment.
                _ => w.next_segment,
            }
        };
        self.write_meta(&mut w, move |m| {
            m.purged = Some(id);
            m.first_live = m.first_live.max(first_live);
        })
        .await?;
        let removed: Vec<Arc<Segment>> = {
            let mut s = inner.lock();
            s.purge_to(id);
            let kept = s.segments.split_off(&first_live);
            std::mem::replace(&mut s.segments, kept).into_values().collect()
        };
        if w.tail.as_ref().is_some_and(|t| t.seg.number < first_live) {
            w.tail = None;
            w.next_segment = w.next_segment.max(first_live);
        }
        for seg in &removed {
            inner.env.remove_disk(&seg.path).await.map_err(|source| {
                inner.fail();
                LogError::Io { what: "removing", path: seg.path.clone(), source }
            })?;
        }
        Ok(())
    }

    /// Entries in `[start, end)` that the log holds, at most `bytes_max`
    /// encoded bytes of them (one at least).
    async fn read(&self, start: u64, end: u64, bytes_max: usize) -> Result<Vec<Entry>, LogError> {
        let mut attempt = 0;
        loop {
            let (plan, cached, generation) = {
                let s = self.inner.lock();
                let (Some(first), Some(last)) = (s.first_index(), s.locs.back().map(|l| l.log_id.index))
                else {
                    return Ok(Vec::new());
                };
                let (start, end) = (start.max(first), end.min(last + 1));
                if start >= end {
                    return Ok(Vec::new());
                }
                let mut stop = start;
                let mut bytes = 0usize;
                while stop < end {
                    let n = s.locs[(stop - first) as usize].len as usize;
                    if stop > start && bytes.saturating_add(n) > bytes_max {
                        break;
                    }
                    bytes = bytes.saturating_add(n);
                    stop += 1;
                }
                let cache_first = s.cache.front().map_or(last + 1, |(e, _)| e.log_id.index);
                let mut plan = Vec::new();
                for i in start..stop.min(cache_first) {
                    let l = s.locs[(i - first) as usize];
                    match s.segments.get(&l.seg) {
                        Some(seg) => plan.push((seg.clone(), l)),
                        None => {
                            return Err(LogError::Corrupt {
                                path: PathBuf::from(segment_name(l.seg)),
                                offset: l.offset,
                                index: i,
                                why: "its segment is not open (a bug)".into(),
                            });
                        }
                    }
                }
                let cached: Vec<Entry> = (start.max(cache_first)..stop)
                    .map(|i| s.cache[(i - cache_first) as usize].0.clone())
                    .collect();
                (plan, cached, s.generation)
            };
            match read_records(&plan).await {
                Ok(mut v) => {
                    v.extend(cached);
                    return Ok(v);
                }
                Err(e) => {
                    if attempt < READ_RETRIES && self.inner.lock().generation != generation {
                        attempt += 1;
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Shared> {
        match self.shared.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn fail(&self) {
        self.health.failed.store(true, Ordering::Release);
    }

    fn check_failed(&self) -> Result<(), LogError> {
        if self.health.failed.load(Ordering::Acquire) {
            return Err(LogError::Failed);
        }
        Ok(())
    }

    /// Creates segment `number` (not yet written: its header is returned
    /// to go out with its first records).
    async fn create_segment(
        &self,
        number: u64,
        len: u64,
        first_index: u64,
    ) -> Result<(Arc<Segment>, Bytes, u32), LogError> {
        let path = self.dir.join(segment_name(number));
        let disk = self.env.open_disk(&path, Some(len)).await.map_err(|source| {
            self.fail();
            LogError::Io { what: "creating", path: path.clone(), source }
        })?;
        if disk.len() < len {
            self.fail();
            let source =
                io::Error::other(format!("it already exists with {} bytes, fewer than {len}", disk.len()));
            return Err(LogError::Io { what: "creating", path, source });
        }
        let header = SegmentHeader { number, salt: self.env.random_u64(), first_index, len };
        let (bytes, crc) = header.encode();
        let seg =
            Segment { number, path, commit: GroupCommit::new(disk.clone()), disk, salt: header.salt, len };
        Ok((Arc::new(seg), bytes, crc))
    }
}

/// Reads and checks the records at `plan`, in order.
async fn read_records(plan: &[(Arc<Segment>, Loc)]) -> Result<Vec<Entry>, LogError> {
    let mut out = Vec::with_capacity(plan.len());
    let mut i = 0;
    while i < plan.len() {
        // A run of records back to back in one segment, one read.
        let (seg, first) = &plan[i];
        let mut j = i + 1;
        let mut end = first.offset + first.len as u64;
        while j < plan.len() {
            let (s, l) = &plan[j];
            if !Arc::ptr_eq(s, seg)
                || l.offset != align(end)
                || l.offset + l.len as u64 - first.offset > READ_CHUNK_MAX as u64
            {
                break;
            }
            end = l.offset + l.len as u64;
            j += 1;
        }
        let buf = seg
            .disk
            .read_at(first.offset, (end - first.offset) as usize)
            .await
            .map_err(io_err("reading", &seg.path))?;
        for (_, l) in &plan[i..j] {
            let at = (l.offset - first.offset) as usize;
            let rec = buf.slice(at..at + l.len as usize);
            let corrupt = |why: String| LogError::Corrupt {
                path: seg.path.clone(),
                offset: l.offset,
                index: l.log_id.index,
                why,
            };
            match decode_record(seg.salt, l.prev, &rec) {
                Ok((h, e)) if h.crc == l.crc && e.log_id == l.log_id => out.push(e),
                Ok((h, e)) => {
                    return Err(corrupt(format!(
                        "CRC {:08x} and log id {} where {:08x} and {} were written",
                        h.crc, e.log_id, l.crc, l.log_id
                    )));
                }
                Err(why) => return Err(corrupt(why.to_string())),
            }
        }
        i = j;
    }
    Ok(out)
}

/// Rebuilds the log's state from `dir` (the module's recovery table).
async fn recover(
    env: &Env,
    dir: &Path,
    cluster: u128,
    node: NodeId,
    cfg: &LogConfig,
) -> Result<Recovered, LogError> {
    let meta_path = dir.join(META_FILE);
    let mut files: BTreeMap<u64, PathBuf> = BTreeMap::new();
    for p in env.list_disks(dir, SEGMENT_PREFIX).await.map_err(io_err("listing segments in", dir))? {
        match p.file_name().and_then(|n| n.to_str()).and_then(parse_segment_name) {
            Some(n) => {
                files.insert(n, p);
            }
            None => tracing::warn!(path = %p.display(), "ignoring a file that is not a log segment"),
        }
    }
    let meta_listed = env
        .list_disks(dir, META_FILE)
        .await
        .map_err(io_err("listing", dir))?
        .iter()
        .any(|p| p.file_name().and_then(|n| n.to_str()) == Some(META_FILE));
    let mut syncs = 0u64;
    let fresh =
        Meta { generation: 1, cluster, node, vote: None, committed: None, purged: None, first_live: 0 };
    let existing = if meta_listed {
        let disk = env.open_disk(&meta_path, None).await.map_err(io_err("opening", &meta_path))?;
        if disk.len() < META_LEN {
            if !files.is_empty() {
                return Err(LogError::MetaLen { path: meta_path, len: disk.len() });
            }
            // Cut short while being created: start again.
            env.remove_disk(&meta_path).await.map_err(io_err("removing", &meta_path))?;
            None
        } else {
            let b = disk.read_at(0, META_LEN as usize).await.map_err(io_err("reading", &meta_path))?;
            let slots = [Meta::decode(&b[..META_SLOT_LEN]), Meta::decode(&b[META_SLOT_LEN..])];
            match meta::newest(&slots) {
                Some((slot, m)) => Some((disk, m, slot)),
                None if files.is_empty() => None,
                None => {
                    let [a, b] = slots;
                    return Err(LogError::MetaUnreadable {
                        path: meta_path,
                        a: a.err().unwrap_or(SlotError::Empty),
                        b: b.err().unwrap_or(SlotError::Empty),
                    });
                }
            }
        }
    } else if !files.is_empty() {
        return Err(LogError::MetaMissing { path: meta_path });
    } else {
        None
    };
    let (meta_disk, meta, meta_slot) = match existing {
        Some(x) => x,
        None => {
            let disk =
                env.open_disk(&meta_path, Some(META_LEN)).await.map_err(io_err("creating", &meta_path))?;
            disk.write_at(vec![(0, fresh.encode())]).await.map_err(io_err("writing", &meta_path))?;
            disk.sync().await.map_err(io_err("syncing", &meta_path))?;
            syncs += 1;
            tracing::info!(dir = %dir.display(), "created a new raft log");
            (disk, fresh, 0)
        }
    };
    if meta.cluster != cluster || meta.node != node {
        return Err(LogError::WrongMember {
            dir: dir.to_path_buf(),
            found_cluster: meta.cluster,
            found_node: meta.node,
            cluster,
            node,
        });
    }

    let first_live = meta.first_live;
    let below: Vec<PathBuf> = files.range(..first_live).map(|(_, p)| p.clone()).collect();
    let live: Vec<(u64, PathBuf)> = files.range(first_live..).map(|(n, p)| (*n, p.clone())).collect();
    if let Some((last, _)) = live.last() {
        for (want, (n, _)) in (first_live..).zip(live.iter()) {
            if *n != want {
                return Err(LogError::MissingSegment {
                    path: dir.join(segment_name(want)),
                    first: first_live,
                    last: *last,
                });
            }
        }
    }

    let mut shared = Shared {
        segments: BTreeMap::new(),
        locs: VecDeque::new(),
        cache: VecDeque::new(),
        cache_bytes: 0,
        vote: meta.vote,
        committed: meta.committed,
        purged: meta.purged,
        generation: 0,
    };
    let mut tail: Option<Tail> = None;
    let mut next: Option<u64> = meta.purged.map(|p| p.index + 1);
    // Why the last segment's records stopped before its end, until a next
    // segment shows the writer rolled over there.
    let mut soft_stop: Option<String> = None;
    // Set once the log has ended: every later segment is garbage.
    let mut ended: Option<String> = None;
    let mut garbage: Vec<PathBuf> = Vec::new();
    for (i, (number, path)) in live.iter().enumerate() {
        if ended.is_some() {
            garbage.push(path.clone());
            continue;
        }
        let disk = env.open_disk(path, None).await.map_err(io_err("opening", path))?;
        let header = if disk.len() < SEGMENT_HEADER_LEN {
            Err(Invalid::Short(disk.len() as usize))
        } else {
            let b = disk.read_at(0, SEGMENT_HEADER_LEN as usize).await.map_err(io_err("reading", path))?;
            SegmentHeader::decode(&b)
        };
        let (h, header_crc) = match header {
            Ok((h, _)) if h.number != *number || h.len > disk.len() || h.len < SEGMENT_LEN_MIN => {
                ended = Some(soft_stop.take().unwrap_or(format!(
                    "{}: its header names segment {} of {} bytes",
                    path.display(),
                    h.number,
                    h.len
                )));
                garbage.push(path.clone());
                continue;
            }
            Ok(x) => x,
            Err(why) => {
                ended =
                    Some(soft_stop.take().unwrap_or(format!("{}: segment header: {why}", path.display())));
                garbage.push(path.clone());
                continue;
            }
        };
        match next {
            Some(e) if i == 0 && h.first_index > e => {
                return Err(LogError::SegmentGap {
                    path: path.clone(),
                    first_index: h.first_index,
                    expected: e,
                });
            }
            Some(e) if i > 0 && h.first_index != e => {
                ended = Some(soft_stop.take().unwrap_or(format!(
                    "{}: starts at index {} where {e} was next",
                    path.display(),
                    h.first_index
                )));
                garbage.push(path.clone());
                continue;
            }
            _ => {}
        }
        soft_stop = None;
        let seg = Arc::new(Segment {
            number: *number,
            path: path.clone(),
            commit: GroupCommit::new(disk.clone()),
            disk: disk.clone(),
            salt: h.salt,
            len: h.len,
        });
        let mut index = h.first_index;
        let mut off = SEGMENT_HEADER_LEN;
        let mut prev = header_crc;
        let mut window = Window { disk: &disk, limit: h.len, start: 0, buf: Bytes::new() };
        while off + RECORD_HEADER_LEN as u64 <= h.len {
            let hb = window.get(off, RECORD_HEADER_LEN).await.map_err(io_err("reading", path))?;
            let rh = match RecordHeader::parse(&hb) {
                Ok(rh) if off + rh.len() <= h.len => rh,
                Ok(rh) => {
                    soft_stop = Some(format!(
                        "{} offset {off}: a record of {} bytes runs past the end",
                        path.display(),
                        rh.len()
                    ));
                    break;
                }
                Err(why) => {
                    soft_stop = Some(format!("{} offset {off}: record {why}", path.display()));
                    break;
                }
            };
            let rb = window.get(off, rh.len() as usize).await.map_err(io_err("reading", path))?;
            let (rh, entry) = match decode_record(h.salt, prev, &rb) {
                Ok(x) => x,
                Err(RecordError::Invalid(why)) => {
                    soft_stop = Some(format!("{} offset {off}: record {why}", path.display()));
                    break;
                }
                Err(RecordError::Undecodable(source)) => {
                    return Err(LogError::Undecodable { path: path.clone(), offset: off, source });
                }
            };
            if rh.log_id.index != index {
                return Err(LogError::Corrupt {
                    path: path.clone(),
                    offset: off,
                    index: rh.log_id.index,
                    why: format!(
                        "it follows its predecessor's chain but has index {}, not {index}",
                        rh.log_id.index
                    ),
                });
            }
            let len = rh.len();
            if meta.purged.is_none_or(|p| index > p.index) {
                let loc =
                    Loc { log_id: rh.log_id, seg: *number, offset: off, len: len as u32, crc: rh.crc, prev };
                shared.push(entry, loc, cfg);
            }
            prev = rh.crc;
            off = align(off + len);
            index += 1;
        }
        next = Some(index);
        shared.segments.insert(*number, seg.clone());
        tail = Some(Tail { seg, offset: off, prev });
    }
    let stop = ended.or(soft_stop);

    let last = shared.last_log_id();
    if let Some(c) = meta.committed {
        let stop = stop.clone().unwrap_or_else(|| "the last segment ends there".into());
        match last {
            Some(l) if l.index >= c.index => {
                if let Some(loc) = shared.loc(c.index).filter(|loc| loc.log_id != c) {
                    return Err(LogError::CommittedLost {
                        committed: c,
                        last: format!("{} (whose entry {} is {})", l, c.index, loc.log_id),
                        stop,
                    });
                }
            }
            _ => {
                return Err(LogError::CommittedLost {
                    committed: c,
                    last: last.map_or("the very beginning".into(), |l| l.to_string()),
                    stop,
                });
            }
        }
    }

    // What recovery read may have been unsynced (a process that died
    // before its fdatasync): make it durable before anyone relies on it.
    for seg in shared.segments.values() {
        seg.disk.sync().await.map_err(io_err("syncing", &seg.path))?;
        syncs += 1;
    }
    meta_disk.sync().await.map_err(io_err("syncing", &meta_path))?;
    syncs += 1;
    for p in garbage.iter().rev() {
        tracing::warn!(path = %p.display(), "removing a segment past the end of the log (never acknowledged)");
        env.remove_disk(p).await.map_err(io_err("removing", p))?;
    }
    for p in &below {
        tracing::info!(path = %p.display(), "removing a purged segment");
        env.remove_disk(p).await.map_err(io_err("removing", p))?;
    }
    if let Some(why) = &stop {
        tracing::info!(dir = %dir.display(), "the raft log ends before its last segment's end: {why}");
    }
    tracing::info!(
        dir = %dir.display(),
        first = ?shared.first_index(),
        last = ?last.map(|l| l.index),
        purged = ?meta.purged.map(|p| p.index),
        segments = shared.segments.len(),
        "recovered the raft log"
    );
    let next_segment = tail.as_ref().map_or(first_live, |t| t.seg.number + 1);
    let write = WriteState {
        tail,
        next_segment,
        run: env.random_u64(),
        meta_disk,
        meta_path,
        meta,
        meta_slot,
        durable_slot: meta_slot,
    };
    Ok(Recovered { shared, write, syncs })
}

fn bounds(r: &impl RangeBounds<u64>) -> (u64, u64) {
    let start = match r.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(e) => e.saturating_add(1),
        Bound::Excluded(e) => *e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<Raft> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let (start, end) = bounds(&range);
        Ok(self.read(start, end, usize::MAX).await?)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.inner.lock().vote)
    }

    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry>, io::Error> {
        Ok(self.read(start, end, self.inner.cfg.read_bytes_max).await?)
    }
}

impl RaftLogStorage<Raft> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<Raft>, io::Error> {
        let s = self.inner.lock();
        Ok(LogState { last_purged_log_id: s.purged, last_log_id: s.last_log_id() })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        Ok(self.save_vote_durably(*vote).await?)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        Ok(self.save_committed_lazily(committed).await?)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        Ok(self.inner.lock().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<Raft>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        Ok(self.append_entries(entries, Done::Io(callback)).await?)
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        Ok(self.truncate(last_log_id).await?)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        Ok(self.purge_to(log_id).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::log_id;
    use crate::types::{Batch, BatchReply, LeaderId, Member, Op, OpKind, SnapshotMeta, StoredMembership};
    use blizzard_env::Disks;
    use futures::future::BoxFuture;
    use futures::{FutureExt, TryStreamExt};
    use openraft::storage::{EntryResponder, RaftSnapshotBuilder, RaftStateMachine};
    use openraft::testing::log::{StoreBuilder, Suite};
    use openraft::type_config::alias::{OneshotReceiverOf, SnapshotOf};
    use openraft::type_config::TypeConfigExt;
    use openraft::EntryPayload;
    use std::collections::BTreeSet;
    use tokio::sync::Notify;

    type R<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
    type Flushed = OneshotReceiverOf<Raft, Result<(), io::Error>>;

    const CLUSTER: u128 = 0x00b1_1223_4d00_0000_0000_0000_0000_0001;
    const NODE: NodeId = 1;

    /// Tiny segments and a tiny cache: rollover and reads from the disk
    /// happen all the time.
    fn tiny() -> LogConfig {
        LogConfig {
            segment_len: 64 << 10,
            cache_entries_max: 4,
            cache_bytes_max: 16 << 10,
            read_bytes_max: 8 << 10,
            copy_payloads: false,
            planted_ack_before_sync: false,
        }
    }

    fn splitmix(x: &mut u64) -> u64 {
        *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let z = (*x ^ (*x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// An entry with `len` bytes of payload (a blank one for 0) that depend
    /// on its term and index.
    fn entry(term: u64, index: u64, len: usize) -> Entry {
        let payload = if len == 0 {
            EntryPayload::Blank
        } else {
            let bytes: Vec<u8> =
                (0..len as u64).map(|i| (i ^ index.wrapping_mul(31) ^ term << 3) as u8).collect();
            let op =
                Op { session: index, seq: term, acked_below: 0, kind: OpKind::Update(Bytes::from(bytes)) };
            EntryPayload::Normal(Batch { ops: vec![op] })
        };
        Entry { log_id: log_id(term, 1, index), payload }
    }

    fn membership_entry(term: u64, index: u64) -> Entry {
        let nodes: BTreeMap<u64, Member> =
            (1..=3).map(|i| (i, Member { addr: format!("10.0.0.{i}:7400") })).collect();
        let m = openraft::Membership::new(vec![nodes.keys().copied().collect::<BTreeSet<_>>()], nodes)
            .expect("voters are nodes");
        Entry { log_id: log_id(term, 1, index), payload: EntryPayload::Membership(m) }
    }

    /// Appends; returns the receiver its flush callback reports to.
    async fn append(store: &mut LogStore, entries: Vec<Entry>) -> R<Flushed> {
        let (tx, rx) = Raft::oneshot();
        store.append(entries, IOFlushed::signal(tx)).await?;
        Ok(rx)
    }

    async fn flushed(rx: Flushed) -> R {
        rx.await.map_err(|e| format!("callback dropped: {e:?}"))??;
        Ok(())
    }

    /// Appends and waits until the entries are durable.
    async fn append_durably(store: &mut LogStore, entries: Vec<Entry>) -> R {
        let rx = append(store, entries).await?;
        flushed(rx).await
    }

    async fn everything(store: &mut LogStore) -> R<Vec<Entry>> {
        Ok(store.try_get_log_entries(..).await?)
    }

    async fn segment_files(env: &Env, dir: &Path) -> R<usize> {
        Ok(env.list_disks(dir, SEGMENT_PREFIX).await?.len())
    }

    /// Disks in memory with a power switch, for crash tests. Fault model:
    ///
    /// | fault | injected when |
    /// |---|---|
    /// | unsynced write lost, kept or torn | [`MemDisks::crash`]: each pending write independently, 1/3 each (seeded); a torn one keeps each 512-byte sector it touches by a coin |
    /// | reordered persistence | the same: fates are independent, so a later write may survive an earlier one |
    /// | syncs that never finish | [`MemDisks::hold_syncs`]: syncs wait until the crash, which fails them |
    /// | EIO on sync | [`Ctl::fail_syncs`]: the next n syncs fail; their writes stay pending |
    /// | EIO/ENOSPC on write after a prefix | [`Ctl::fail_writes`]: the next n `write_at`s store their first half of pieces, then fail |
    ///
    /// Creating and removing a file is durable at once (the real disks
    /// sync the directory). Handles opened before a crash fail every call.
    #[derive(Clone, Default)]
    struct MemDisks {
        files: Arc<Mutex<BTreeMap<PathBuf, Arc<MemDisk>>>>,
        ctl: Arc<Ctl>,
    }

    #[derive(Default)]
    struct Ctl {
        hold: AtomicBool,
        release: Notify,
        fail_syncs: AtomicU64,
        fail_writes: AtomicU64,
        syncs: AtomicU64,
    }

    impl Ctl {
        fn take(n: &AtomicU64) -> bool {
            n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1)).is_ok()
        }
    }

    struct MemDisk {
        len: u64,
        img: Arc<Mutex<Img>>,
        dead: Arc<AtomicBool>,
        ctl: Arc<Ctl>,
    }

    struct Img {
        visible: Vec<u8>,
        durable: Vec<u8>,
        pending: Vec<(u64, Bytes)>,
    }

    fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        match m.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    impl MemDisk {
        fn new(image: Vec<u8>, ctl: Arc<Ctl>) -> Arc<MemDisk> {
            let len = image.len() as u64;
            let img = Img { visible: image.clone(), durable: image, pending: Vec::new() };
            Arc::new(MemDisk { len, img: Arc::new(Mutex::new(img)), dead: Arc::default(), ctl })
        }

        fn check(&self, off: u64, len: usize) -> io::Result<()> {
            if self.dead.load(Ordering::SeqCst) {
                return Err(io::Error::other("power lost"));
            }
            if off.checked_add(len as u64).is_none_or(|e| e > self.len) {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "past the end of the disk"));
            }
            Ok(())
        }
    }

    impl Disk for MemDisk {
        fn len(&self) -> u64 {
            self.len
        }

        fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
            let r = self.check(offset, len).map(|()| {
                let img = locked(&self.img);
                Bytes::copy_from_slice(&img.visible[offset as usize..offset as usize + len])
            });
            async move { r }.boxed()
        }

        fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
            let r = (|| {
                for (off, b) in &writes {
                    self.check(*off, b.len())?;
                }
                let n = if Ctl::take(&self.ctl.fail_writes) { writes.len() / 2 } else { writes.len() };
                let mut img = locked(&self.img);
                for (off, b) in writes.iter().take(n) {
                    img.visible[*off as usize..*off as usize + b.len()].copy_from_slice(b);
                    img.pending.push((*off, b.clone()));
                }
                if n < writes.len() {
                    return Err(io::Error::other("injected ENOSPC after a prefix"));
                }
                Ok(())
            })();
            async move { r }.boxed()
        }

        fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
            let (img, dead, ctl) = (self.img.clone(), self.dead.clone(), self.ctl.clone());
            async move {
                loop {
                    let released = ctl.release.notified();
                    tokio::pin!(released);
                    released.as_mut().enable();
                    if !ctl.hold.load(Ordering::SeqCst) {
                        break;
                    }
                    released.await;
                }
                if dead.load(Ordering::SeqCst) {
                    return Err(io::Error::other("power lost"));
                }
                if Ctl::take(&ctl.fail_syncs) {
                    return Err(io::Error::other("injected EIO"));
                }
                let mut img = locked(&img);
                for (off, b) in std::mem::take(&mut img.pending) {
                    img.durable[off as usize..off as usize + b.len()].copy_from_slice(&b);
                }
                ctl.syncs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
            .boxed()
        }
    }

    impl Disks for MemDisks {
        fn open(
            &self,
            path: &Path,
            create_len: Option<u64>,
        ) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>> {
            let mut files = locked(&self.files);
            let r = match (files.get(path), create_len) {
                (Some(d), _) => Ok(d.clone() as Arc<dyn Disk>),
                (None, Some(len)) => {
                    let d = MemDisk::new(vec![0; len as usize], self.ctl.clone());
                    files.insert(path.to_path_buf(), d.clone());
                    Ok(d as Arc<dyn Disk>)
                }
                (None, None) => Err(io::Error::new(io::ErrorKind::NotFound, format!("{}", path.display()))),
            };
            async move { r }.boxed()
        }

        fn remove(&self, path: &Path) -> BoxFuture<'static, io::Result<()>> {
            locked(&self.files).remove(path);
            async { Ok(()) }.boxed()
        }

        fn list(&self, dir: &Path, prefix: &str) -> BoxFuture<'static, io::Result<Vec<PathBuf>>> {
            let out = locked(&self.files)
                .keys()
                .filter(|p| {
                    p.parent() == Some(dir)
                        && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix))
                })
                .cloned()
                .collect();
            async move { Ok(out) }.boxed()
        }
    }

    impl MemDisks {
        fn env(&self) -> Env {
            Env { disks: Arc::new(self.clone()), ..Env::real() }
        }

        fn hold_syncs(&self) {
            self.ctl.hold.store(true, Ordering::SeqCst);
        }

        /// The process dies, the machine does not: writes not yet synced
        /// stay readable (the page cache) and still not durable.
        fn kill(&self) {
            for d in locked(&self.files).values_mut() {
                d.dead.store(true, Ordering::SeqCst);
                let img = locked(&d.img);
                let (visible, durable, pending) =
                    (img.visible.clone(), img.durable.clone(), img.pending.clone());
                drop(img);
                let fresh = MemDisk::new(durable, self.ctl.clone());
                {
                    let mut img = locked(&fresh.img);
                    img.visible = visible;
                    img.pending = pending;
                }
                *d = fresh;
            }
            self.ctl.hold.store(false, Ordering::SeqCst);
            self.ctl.release.notify_waiters();
        }

        /// Power loss: each write not yet synced is lost, kept or torn.
        fn crash(&self, seed: u64) {
            let mut rng = seed ^ 0x5eed;
            for d in locked(&self.files).values_mut() {
                d.dead.store(true, Ordering::SeqCst);
                let img = locked(&d.img);
                let mut durable = img.durable.clone();
                for (off, b) in &img.pending {
                    let (off, end) = (*off as usize, *off as usize + b.len());
                    match splitmix(&mut rng) % 3 {
                        0 => {}
                        1 => durable[off..end].copy_from_slice(b),
                        _ => {
                            let mut sector = off / 512 * 512;
                            while sector < end {
                                let (from, to) = (sector.max(off), (sector + 512).min(end));
                                if splitmix(&mut rng).is_multiple_of(2) {
                                    durable[from..to].copy_from_slice(&b[from - off..to - off]);
                                }
                                sector += 512;
                            }
                        }
                    }
                }
                drop(img);
                *d = MemDisk::new(durable, self.ctl.clone());
            }
            self.ctl.hold.store(false, Ordering::SeqCst);
            self.ctl.release.notify_waiters();
        }
    }

    /// Entries written across many segments (one longer than a segment)
    /// read back identical from memory and from the disk, before and after
    /// a restart, on real files.
    #[tokio::test]
    async fn appends_read_back_across_segments_and_restarts() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        let mut want = vec![membership_entry(1, 0)];
        for i in 1..120u64 {
            want.push(entry(1, i, [0, 10, 700, 3000, 6000][i as usize % 5]));
        }
        want.push(entry(1, 120, 100 << 10)); // longer than a segment
        want.push(entry(1, 121, 5));
        for chunk in want.chunks(7) {
            append_durably(&mut store, chunk.to_vec()).await?;
        }
        let stats = store.stats();
        assert!(stats.segments >= 5, "rolled over: {stats:?}");
        assert_eq!((stats.first_index, stats.last_index), (Some(0), Some(121)));
        assert!((1..=4).contains(&stats.cached_entries), "the cache is bounded: {stats:?}");
        assert_eq!(segment_files(&env, tmp.path()).await?, stats.segments);
        assert_eq!(everything(&mut store).await?, want);
        assert_eq!(store.try_get_log_entries(50..=52).await?, want[50..=52].to_vec());
        let limited = store.limited_get_log_entries(3, 100).await?;
        assert!(!limited.is_empty() && limited.len() < 97, "bounded by bytes: {}", limited.len());
        assert_eq!(limited, want[3..3 + limited.len()].to_vec());
        assert_eq!(store.limited_get_log_entries(120, 122).await?.len(), 1, "one entry even over the bound");
        drop(store);

        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want);
        let st = store.get_log_state().await?;
        assert_eq!((st.last_purged_log_id, st.last_log_id), (None, Some(log_id(1, 1, 121))));
        assert_eq!(store.stats().segments, stats.segments);
        // And it goes on where it left off.
        append_durably(&mut store, vec![entry(2, 122, 50)]).await?;
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(store.try_get_log_entries(121..).await?, vec![entry(1, 121, 5), entry(2, 122, 50)]);
        Ok(())
    }

    /// Truncated entries never come back after a restart: not after a
    /// truncation inside a segment (new, shorter records written over the
    /// dropped ones), not at a segment's first record, not after wiping all.
    #[tokio::test]
    async fn truncated_entries_never_come_back() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        let mut want: Vec<Entry> = (0..60).map(|i| entry(1, i, 3000)).collect();
        append_durably(&mut store, want.clone()).await?;
        let segments = store.stats().segments;

        // Inside a segment: the next record is not a segment's first.
        let cut = (20..59)
            .find(|i| store.inner.lock().loc(i + 1).is_some_and(|l| l.offset != SEGMENT_HEADER_LEN))
            .ok_or("no record inside a segment")?;
        store.truncate_after(Some(log_id(1, 1, cut))).await?;
        want.truncate(cut as usize + 1);
        assert!(store.stats().segments < segments, "segments past the cut are removed");
        assert_eq!(everything(&mut store).await?, want);
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want, "dropped records stay dropped");
        let shorter: Vec<Entry> = (cut + 1..cut + 6).map(|i| entry(2, i, 100)).collect();
        append_durably(&mut store, shorter.clone()).await?;
        want.extend(shorter);
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want);

        // At a segment's first record: the whole segment goes.
        let first = (1..want.len() as u64)
            .find(|i| store.inner.lock().loc(*i).is_some_and(|l| l.offset == SEGMENT_HEADER_LEN))
            .ok_or("no segment start")?;
        store.truncate_after(Some(want[first as usize - 1].log_id)).await?;
        want.truncate(first as usize);
        assert_eq!(store.stats().segments, segment_files(&env, tmp.path()).await?);
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want);
        let more: Vec<Entry> = (first..first + 3).map(|i| entry(3, i, 2000)).collect();
        append_durably(&mut store, more.clone()).await?;
        want.extend(more);
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want);

        // Everything.
        store.truncate_after(None).await?;
        assert_eq!(everything(&mut store).await?, vec![]);
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, vec![]);
        assert_eq!(store.get_log_state().await?.last_log_id, None);
        assert_eq!(segment_files(&env, tmp.path()).await?, 0);
        append_durably(&mut store, vec![entry(4, 0, 10)]).await?;
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, vec![entry(4, 0, 10)]);
        Ok(())
    }

    /// A purge removes the segments it empties, survives a restart, and
    /// a purge past the last entry leaves an empty log that goes on after it.
    #[tokio::test]
    async fn purge_removes_segments_and_survives_restart() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        let want: Vec<Entry> = (0..100).map(|i| entry(1, i, 2500)).collect();
        append_durably(&mut store, want.clone()).await?;
        let before = store.stats().segments;
        store.purge(log_id(1, 1, 49)).await?;
        let after = store.stats().segments;
        assert!(after < before, "{before} segments, then {after}");
        assert_eq!(segment_files(&env, tmp.path()).await?, after);
        assert_eq!(everything(&mut store).await?, want[50..].to_vec());
        assert_eq!(store.try_get_log_entries(10..60).await?, want[50..60].to_vec());
        drop(store);

        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, want[50..].to_vec());
        assert_eq!(store.get_log_state().await?.last_purged_log_id, Some(log_id(1, 1, 49)));

        // Past the end.
        store.purge(log_id(2, 1, 150)).await?;
        assert_eq!(segment_files(&env, tmp.path()).await?, 0);
        let st = store.get_log_state().await?;
        assert_eq!(
            (st.last_purged_log_id, st.last_log_id),
            (Some(log_id(2, 1, 150)), Some(log_id(2, 1, 150)))
        );
        assert!(store.append(vec![entry(2, 152, 1)], IOFlushed::noop()).await.is_err(), "a hole is refused");
        append_durably(&mut store, vec![entry(2, 151, 10), entry(2, 152, 10)]).await?;
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(everything(&mut store).await?, vec![entry(2, 151, 10), entry(2, 152, 10)]);
        assert_eq!(store.get_log_state().await?.last_purged_log_id, Some(log_id(2, 1, 150)));
        Ok(())
    }

    /// Power loss at any moment leaves exactly a prefix of the log that
    /// holds every acknowledged entry, and nothing else (200 seeded mixes
    /// of appends, truncations, purges, votes and commits, then appends
    /// while syncs stall, then lost, kept and torn writes); appending after
    /// the recovered tail and losing power again loses nothing synced.
    #[tokio::test]
    async fn power_loss_keeps_exactly_an_acknowledged_prefix() -> R {
        for seed in 0..200 {
            crash_round(seed).await.map_err(|e| format!("seed {seed}: {e}"))?;
        }
        Ok(())
    }

    async fn crash_round(seed: u64) -> R {
        let disks = MemDisks::default();
        let env = disks.env();
        let dir = Path::new("/mem/raft");
        let cfg = LogConfig { segment_len: SEGMENT_LEN_MIN, cache_entries_max: 3, ..tiny() };
        let mut rng = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) + 1;
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg.clone()).await?;
        let mut model: Vec<Entry> = Vec::new(); // entry i at index i
        let (mut purged, mut committed, mut vote): (Option<LogId>, Option<LogId>, Option<Vote>) =
            (None, None, None);
        let mut term = 1;
        // Committed ids saved since the last synced meta write (a vote, a
        // purge): power loss may bring back any of them.
        let mut saved_committed: Vec<Option<LogId>> = vec![None];
        let batch = |rng: &mut u64, model: &mut Vec<Entry>, term: u64| {
            let n = 1 + splitmix(rng) % 5;
            let start = model.len() as u64;
            let b: Vec<Entry> = (start..start + n)
                .map(|i| {
                    let len = match splitmix(rng) % 10 {
                        0 => 0,
                        1 => 20_000, // longer than a segment
                        _ => (splitmix(rng) % 2500) as usize,
                    };
                    entry(term, i, len)
                })
                .collect();
            model.extend(b.iter().cloned());
            b
        };

        // Phase 1: syncs flow.
        let mut waits = Vec::new();
        for _ in 0..splitmix(&mut rng) % 14 {
            let floor = committed.map_or(0, |c| c.index + 1).max(purged.map_or(0, |p| p.index + 1));
            match splitmix(&mut rng) % 10 {
                0 if (model.len() as u64) > floor => {
                    let keep = floor + splitmix(&mut rng) % (model.len() as u64 - floor);
                    let last = keep.checked_sub(1).map(|k| model[k as usize].log_id);
                    store.truncate_after(last).await?;
                    model.truncate(keep as usize);
                    term += 1;
                }
                1 if committed.is_some_and(|c| purged.is_none_or(|p| p.index < c.index)) => {
                    let (lo, hi) = (purged.map_or(0, |p| p.index + 1), committed.map_or(0, |c| c.index));
                    let p = lo + splitmix(&mut rng) % (hi - lo + 1);
                    store.purge(model[p as usize].log_id).await?;
                    purged = Some(model[p as usize].log_id);
                    saved_committed = vec![committed];
                }
                2 if !model.is_empty() => {
                    committed = model.last().map(|e| e.log_id);
                    store.save_committed(committed).await?;
                    saved_committed.push(committed);
                }
                3 => {
                    vote = Some(Vote {
                        leader_id: LeaderId { term, node_id: 2 },
                        committed: seed.is_multiple_of(2),
                    });
                    store.save_vote(vote.as_ref().ok_or("vote")?).await?;
                    saved_committed = vec![committed];
                }
                _ => {
                    let b = batch(&mut rng, &mut model, term);
                    waits.push(append(&mut store, b).await?);
                }
            }
        }
        for w in waits {
            flushed(w).await?;
        }
        let durable = model.len();

        // Phase 2: appends; at some point syncs stop finishing.
        let n = 1 + splitmix(&mut rng) % 6;
        let hold_at = splitmix(&mut rng) % (n + 1);
        let mut pending = Vec::new();
        for i in 0..n {
            if i == hold_at {
                disks.hold_syncs();
            }
            let b = batch(&mut rng, &mut model, term);
            pending.push((append(&mut store, b).await?, model.len()));
            for _ in 0..splitmix(&mut rng) % 3 {
                tokio::task::yield_now().await;
            }
        }
        // Sometimes a commit races the stalled syncs: its meta write must
        // not become durable ahead of the entries it names.
        let committing = model.last().map(|e| Some(e.log_id)).filter(|_| seed.is_multiple_of(2)).map(|c| {
            let mut s = store.clone();
            (c, tokio::spawn(async move { s.save_committed(c).await }))
        });
        disks.hold_syncs();
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        // Mostly power loss; sometimes only the process dies, and what
        // recovery then reads unsynced must be made durable by it (the
        // power loss of round 2 would take it otherwise).
        if seed % 4 == 3 {
            disks.kill();
        } else {
            disks.crash(seed);
        }
        drop(store);
        let mut acked = durable;
        for (rx, len) in pending {
            if let Ok(Ok(())) = rx.await {
                acked = acked.max(len);
            }
        }

        // A committed id is written without a sync of its own: power loss
        // may take it back to any value saved since the last synced meta
        // write (never past the durable log).
        let mut may_commit = saved_committed.clone();
        if let Some((c, saving)) = committing {
            match saving.await? {
                Ok(()) => committed = c,
                Err(_) => may_commit.push(c),
            }
        }

        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg.clone()).await?;
        let start = purged.map_or(0, |p| p.index as usize + 1);
        let got = everything(&mut store).await?;
        let end = start + got.len();
        assert!(
            end <= model.len(),
            "recovered {} entries from {start}, only {} appended",
            got.len(),
            model.len()
        );
        assert!(got[..] == model[start..end], "not a prefix of what was appended");
        assert!(end >= acked, "lost acknowledged entries: recovered up to {end}, {acked} acknowledged");
        assert_eq!(store.get_log_state().await?.last_purged_log_id, purged);
        let c = store.read_committed().await?;
        assert!(c == committed || may_commit.contains(&c), "committed {c:?}");
        assert!(c.is_none_or(|c| (c.index as usize) < end), "committed {c:?} ahead of the log's end {end}");
        committed = c;
        assert_eq!(store.read_vote().await?, vote);

        // Round 2: go on from the recovered tail, durably, as a leader
        // would: first some of the lost entries again, byte for byte (the
        // stale copies the crash kept behind them must not come back),
        // then new ones; then lose power.
        let lost = model.split_off(end);
        let again = (splitmix(&mut rng) % (lost.len() as u64 + 1)) as usize;
        if again > 0 {
            append_durably(&mut store, lost[..again].to_vec()).await?;
            model.extend_from_slice(&lost[..again]);
        }
        term += 1;
        for _ in 0..splitmix(&mut rng) % 3 {
            let b = batch(&mut rng, &mut model, term);
            append_durably(&mut store, b).await?;
        }
        disks.crash(seed + 1);
        drop(store);
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg).await?;
        assert!(
            everything(&mut store).await?[..] == model[start..],
            "lost synced entries after a second crash"
        );
        assert_eq!(store.read_committed().await?, committed);
        Ok(())
    }

    /// The vote and the committed id survive a restart.
    #[tokio::test]
    async fn vote_and_committed_survive_restart() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!((store.read_vote().await?, store.read_committed().await?), (None, None));
        let vote = Vote { leader_id: LeaderId { term: 5, node_id: 3 }, committed: true };
        store.save_vote(&vote).await?;
        append_durably(&mut store, (0..5).map(|i| entry(5, i, 100)).collect()).await?;
        store.save_committed(Some(log_id(5, 1, 3))).await?;
        let mut reader = store.get_log_reader().await;
        assert_eq!(reader.read_vote().await?, Some(vote), "readers see the saved vote");
        drop((store, reader));
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(store.read_vote().await?, Some(vote));
        assert_eq!(store.read_committed().await?, Some(log_id(5, 1, 3)));
        Ok(())
    }

    /// A damaged newest meta slot fails its CRC and the other slot counts.
    #[tokio::test]
    async fn a_damaged_meta_slot_falls_back_to_the_other() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        let v1 = Vote { leader_id: LeaderId { term: 1, node_id: 2 }, committed: false };
        let v2 = Vote { leader_id: LeaderId { term: 2, node_id: 3 }, committed: false };
        store.save_vote(&v1).await?; // generation 2, slot B
        store.save_vote(&v2).await?; // generation 3, slot A
        drop(store);
        let meta = env.open_disk(&tmp.path().join(META_FILE), None).await?;
        meta.write_at(vec![(30, Bytes::from_static(b"torn!"))]).await?;
        meta.sync().await?;
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(store.read_vote().await?, Some(v1));
        // The next write goes over the damaged slot, and wins.
        store.save_vote(&v2).await?;
        drop(store);
        let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
        assert_eq!(store.read_vote().await?, Some(v2));
        Ok(())
    }

    /// Power lost while a vote is being saved leaves the old vote or the
    /// new one, never an unreadable meta (both outcomes occur).
    #[tokio::test]
    async fn power_loss_while_saving_a_vote_keeps_old_or_new() -> R {
        let (mut old, mut new) = (0, 0);
        for seed in 0..24 {
            let disks = MemDisks::default();
            let env = disks.env();
            let dir = Path::new("/mem/raft");
            let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
            append_durably(&mut store, vec![entry(1, 0, 10)]).await?;
            let v1 = Vote { leader_id: LeaderId { term: 1, node_id: 2 }, committed: true };
            let v2 = Vote { leader_id: LeaderId { term: 2, node_id: 3 }, committed: false };
            store.save_vote(&v1).await?;
            disks.hold_syncs();
            let mut s = store.clone();
            let saving = tokio::spawn(async move { s.save_vote(&v2).await });
            for _ in 0..5 {
                tokio::task::yield_now().await;
            }
            disks.crash(seed);
            assert!(saving.await?.is_err(), "a vote not synced is not reported saved");
            drop(store);
            let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
            match store.read_vote().await? {
                Some(v) if v == v1 => old += 1,
                Some(v) if v == v2 => new += 1,
                other => return Err(format!("seed {seed}: vote {other:?}").into()),
            }
        }
        assert!(old > 0 && new > 0, "old {old} times, new {new} times");
        Ok(())
    }

    /// Reopening a directory as another cluster or another member fails
    /// with an error that says whose it is.
    #[tokio::test]
    async fn another_members_directory_is_refused() -> R {
        let tmp = tempfile::tempdir()?;
        let env = Env::real();
        drop(LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?);
        for (cluster, node) in [(CLUSTER + 1, NODE), (CLUSTER, NODE + 1)] {
            match LogStore::open(&env, tmp.path(), cluster, node, tiny()).await {
                Err(e @ LogError::WrongMember { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("belongs to cluster") && !msg.contains('\n'), "{msg}");
                }
                Err(e) => return Err(format!("wrong error: {e}").into()),
                Ok(_) => return Err("opened another member's log".into()),
            }
        }
        assert!(LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.is_ok());
        Ok(())
    }

    /// Recovery refuses, naming the file, what it cannot trust: a meta with
    /// no valid slot or missing beside segments, a segment missing from the
    /// middle, a log that ends before its committed id.
    #[tokio::test]
    async fn recovery_refuses_what_it_cannot_trust() -> R {
        async fn setup(env: &Env, dir: &Path) -> R<Vec<PathBuf>> {
            let mut store = LogStore::open(env, dir, CLUSTER, NODE, tiny()).await?;
            append_durably(&mut store, (0..80).map(|i| entry(1, i, 3000)).collect()).await?;
            store.save_committed(Some(log_id(1, 1, 79))).await?;
            Ok(env.list_disks(dir, SEGMENT_PREFIX).await?)
        }
        let env = Env::real();

        let tmp = tempfile::tempdir()?;
        setup(&env, tmp.path()).await?;
        let meta = env.open_disk(&tmp.path().join(META_FILE), None).await?;
        meta.write_at(vec![
            (20, Bytes::from_static(b"x")),
            (META_SLOT_LEN as u64 + 20, Bytes::from_static(b"x")),
        ])
        .await?;
        let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
        assert!(matches!(e, LogError::MetaUnreadable { .. }) && e.to_string().contains("raft.meta"), "{e}");
        env.remove_disk(&tmp.path().join(META_FILE)).await?;
        let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
        assert!(matches!(e, LogError::MetaMissing { .. }), "{e}");

        let tmp = tempfile::tempdir()?;
        let segs = setup(&env, tmp.path()).await?;
        assert!(segs.len() >= 3);
        env.remove_disk(&segs[1]).await?;
        let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
        assert!(matches!(e, LogError::MissingSegment { ref path, .. } if *path == segs[1]), "{e}");

        let tmp = tempfile::tempdir()?;
        let segs = setup(&env, tmp.path()).await?;
        let last = segs.last().ok_or("no segments")?;
        env.remove_disk(last).await?;
        let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
        assert!(matches!(e, LogError::CommittedLost { .. }), "{e}");

        // A flipped bit in a synced record before the committed id too.
        let tmp = tempfile::tempdir()?;
        let segs = setup(&env, tmp.path()).await?;
        let d = env.open_disk(&segs[1], None).await?;
        d.write_at(vec![(SEGMENT_HEADER_LEN + 60, Bytes::from_static(&[0xff]))]).await?;
        let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
        assert!(matches!(e, LogError::CommittedLost { ref stop, .. } if stop.contains("CRC")), "{e}");
        Ok(())
    }

    /// Many appends queued before the flusher runs are made durable by one
    /// fdatasync, and their callbacks all fire.
    #[tokio::test]
    async fn many_appends_share_one_fdatasync() -> R {
        let disks = MemDisks::default();
        let mut store = LogStore::open(&disks.env(), Path::new("/mem/raft"), CLUSTER, NODE, tiny()).await?;
        append_durably(&mut store, vec![entry(1, 0, 10)]).await?;
        let before = store.stats();
        let mut s = store.clone();
        // Unconstrained: tokio's cooperative budget would yield to the
        // flusher half-way, which is not what this test is about.
        let waits = tokio::task::unconstrained(async move {
            let mut waits = Vec::new();
            for i in 1..=64 {
                waits.push(append(&mut s, vec![entry(1, i, 100)]).await?);
            }
            R::Ok(waits)
        })
        .await?;
        for w in waits {
            flushed(w).await?;
        }
        let after = store.stats();
        assert_eq!(after.appends - before.appends, 64);
        assert_eq!(after.syncs - before.syncs, 1, "{before:?} then {after:?}");
        assert_eq!(disks.ctl.syncs.load(Ordering::SeqCst) - before.syncs, 1);
        Ok(())
    }

    /// A failed fdatasync fails the callbacks it covered and every later
    /// write; a write that stores only a prefix (ENOSPC) fails its append;
    /// a restart recovers every acknowledged entry.
    #[tokio::test]
    async fn failed_writes_and_syncs_stop_the_store() -> R {
        let disks = MemDisks::default();
        let env = disks.env();
        let dir = Path::new("/mem/raft");
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
        let durable: Vec<Entry> = (0..10).map(|i| entry(1, i, 500)).collect();
        append_durably(&mut store, durable.clone()).await?;
        disks.ctl.fail_syncs.store(1, Ordering::SeqCst);
        let rx = append(&mut store, vec![entry(1, 10, 500)]).await?;
        assert!(flushed(rx).await.is_err(), "the callback reports the failed sync");
        assert!(store.append(vec![entry(1, 11, 5)], IOFlushed::noop()).await.is_err());
        assert!(store
            .save_vote(&Vote { leader_id: LeaderId { term: 1, node_id: 1 }, committed: false })
            .await
            .is_err());
        drop(store);
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
        let got = everything(&mut store).await?;
        assert!(got.len() >= 10 && got[..10] == durable[..], "{} entries", got.len());

        let next = got.len() as u64;
        disks.ctl.fail_writes.store(1, Ordering::SeqCst);
        let (tx, rx) = Raft::oneshot();
        let batch = (next..next + 3).map(|i| entry(2, i, 300)).collect::<Vec<_>>();
        assert!(store.append(batch, IOFlushed::signal(tx)).await.is_err());
        assert!(flushed(rx).await.is_err(), "the callback of a failed append fires too");
        assert!(matches!(store.truncate_after(None).await, Err(e) if e.to_string().contains("restart")));
        drop(store);
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
        assert!(everything(&mut store).await?[..10] == durable[..]);
        Ok(())
    }

    /// An entry over the maximum and one that would leave a hole are
    /// refused with a clear error, and the store goes on.
    #[tokio::test]
    async fn oversized_and_out_of_order_entries_are_refused() -> R {
        let disks = MemDisks::default();
        let mut store = LogStore::open(&disks.env(), Path::new("/mem/raft"), CLUSTER, NODE, tiny()).await?;
        append_durably(&mut store, vec![entry(1, 0, 1)]).await?;
        let e = store
            .append(vec![entry(1, 1, ENTRY_LEN_MAX)], IOFlushed::noop())
            .await
            .err()
            .ok_or("accepted")?;
        assert!(e.to_string().contains("split the batch"), "{e}");
        let e = store.append(vec![entry(1, 3, 1)], IOFlushed::noop()).await.err().ok_or("accepted")?;
        assert!(e.to_string().contains("expects entry 1"), "{e}");
        append_durably(&mut store, vec![entry(1, 1, 1)]).await?;
        assert_eq!(everything(&mut store).await?.len(), 2);
        Ok(())
    }

    /// A state machine that keeps only what openraft's storage suite looks
    /// at (the applied id, the membership, the snapshot's meta): the suite
    /// needs one beside the log store. Not the runtime's state machine.
    #[derive(Clone, Default)]
    struct AppliedOnly(Arc<Mutex<Applied>>);

    #[derive(Default)]
    struct Applied {
        last: Option<LogId>,
        membership: StoredMembership,
        snapshot: Option<SnapshotMeta>,
    }

    impl RaftSnapshotBuilder<Raft> for AppliedOnly {
        type SnapshotData = ();
        async fn build_snapshot(&mut self) -> Result<SnapshotOf<Raft, ()>, io::Error> {
            let mut a = locked(&self.0);
            let meta = SnapshotMeta { last_log_id: a.last, last_membership: a.membership.clone() };
            a.snapshot = Some(meta.clone());
            Ok(openraft::storage::Snapshot { meta, snapshot: () })
        }
    }

    impl RaftStateMachine<Raft> for AppliedOnly {
        type SnapshotData = ();
        type SnapshotBuilder = AppliedOnly;

        async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), io::Error> {
            let a = locked(&self.0);
            Ok((a.last, a.membership.clone()))
        }

        async fn apply<S>(&mut self, mut entries: S) -> Result<(), io::Error>
        where
            S: futures::Stream<Item = Result<EntryResponder<Raft>, io::Error>> + Unpin + OptionalSend,
        {
            while let Some((e, responder)) = entries.try_next().await? {
                {
                    let mut a = locked(&self.0);
                    a.last = Some(e.log_id);
                    if let EntryPayload::Membership(m) = &e.payload {
                        a.membership = StoredMembership::new(Some(e.log_id), m.clone());
                    }
                }
                if let Some(r) = responder {
                    r.send(BatchReply::default());
                }
            }
            Ok(())
        }

        async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
            self.clone()
        }

        async fn install_snapshot(&mut self, meta: &SnapshotMeta, _: ()) -> Result<(), io::Error> {
            let mut a = locked(&self.0);
            a.last = meta.last_log_id;
            a.membership = meta.last_membership.clone();
            a.snapshot = Some(meta.clone());
            Ok(())
        }

        async fn get_current_snapshot(&mut self) -> Result<Option<SnapshotOf<Raft, ()>>, io::Error> {
            Ok(locked(&self.0)
                .snapshot
                .clone()
                .map(|meta| openraft::storage::Snapshot { meta, snapshot: () }))
        }
    }

    struct OnTempDirs;

    impl StoreBuilder<Raft, LogStore, AppliedOnly, tempfile::TempDir> for OnTempDirs {
        async fn build(
            &self,
        ) -> Result<(tempfile::TempDir, LogStore, AppliedOnly), openraft::StorageError<Raft>> {
            let tmp = tempfile::tempdir().expect("a temporary directory");
            let store = LogStore::open(&Env::real(), tmp.path(), CLUSTER, NODE, tiny()).await.expect("opens");
            Ok((tmp, store, AppliedOnly::default()))
        }
    }

    /// openraft's own storage conformance suite passes on real files.
    #[tokio::test]
    async fn openraft_storage_suite() -> R {
        Suite::test_all(OnTempDirs).await?;
        Ok(())
    }
}
