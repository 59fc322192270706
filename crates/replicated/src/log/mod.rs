//! The durable Raft log: openraft's [`RaftLogStorage`] and
//! [`RaftLogReader`](openraft::storage::RaftLogReader) over the env
//! seam's disks, in a directory of its own.
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
//! Recovery (`LogStore::open`), case by case, and why a torn tail is safe
//! to drop: `recover.rs`.
//!
//! Reads: the newest entries (at most [`LogConfig::cache_entries_max`]
//! and [`LogConfig::cache_bytes_max`]) are kept decoded in memory; older
//! ones are read from their segment (the page cache, mostly) and checked
//! against the CRC the index remembers before they are decoded
//! (`read.rs`).
//!
//! Where things are: this file has the configuration, the errors, the
//! state in memory, the write path (append, truncate, purge, the meta
//! writes) and openraft's [`RaftLogStorage`]; `flush.rs` the group
//! commit (the flusher); `read.rs` the read path and `RaftLogReader`;
//! `recover.rs` recovery; `segment.rs` and `meta.rs` the formats;
//! `tests.rs` (with `tests_recovery.rs`) the store's tests.

mod flush;
mod meta;
mod read;
mod recover;
mod segment;

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::OptionalSend;
use tokio::sync::{mpsc, oneshot};

use blizzard_env::{Disk, Env, GroupCommit};

use crate::types::{Entry, LogId, NodeId, Raft, Vote};
use flush::{flusher, Done, Flush};
use meta::{Meta, SlotError, META_LEN, META_SLOT_LEN};
use segment::{align, segment_name, Record, SegmentHeader, RECORD_HEADER_LEN, SEGMENT_HEADER_LEN};
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

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LogError + 'a {
    move |source| LogError::Io { what, path: path.to_path_buf(), source }
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
        let rec = recover::recover(env, dir, cluster, node, &cfg).await?;
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
mod tests;
