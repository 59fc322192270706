//! The write-intent log of a replicated volume (design 0005).
//!
//! The blob client writes every replica of a tract itself, so a write cut
//! off by a crash may land on some replicas and not others, and reads pick
//! a replica at random: without repair, a block could read as the new data
//! once and the old data the next time, with no write in between. The
//! intent log names, durably and before any of their writes go out, the
//! tracts whose replicas may differ; opening the volume after a crash
//! makes exactly those tracts agree (`BlobIo::reconcile`), so the cost of
//! recovery follows what was being written, not the size of the volume.
//!
//! Where it lives, in tract 0 after the two superblock copies:
//!
//! | bytes of tract 0 | what                                                        |
//! |------------------|-------------------------------------------------------------|
//! | 8 KiB .. 12 KiB  | header: magic, format, the current writer's epoch, CRC32C   |
//! | 12 KiB .. end    | bitmap, 4 KiB pages: bit t set = tract t may need reconciling |
//!
//! Rules, and where each is kept:
//! 1. A tract's bit is set on every replica of tract 0 before any write or
//!    trim of the tract is issued ([`IntentLog::enter`], checked at run
//!    time by [`IntentMap::enter_durable`]).
//! 2. A bit is cleared only for a tract with no write in flight, none that
//!    failed since it was last reconciled, and none issued for
//!    [`CLEAR_AFTER`] ([`IntentMap::take_idle`]). While a page write that
//!    clears a bit is in flight the bit does not count as set
//!    ([`IntentMap::durable`]): a write arriving meanwhile waits for the
//!    next page write, which sets it again.
//! 3. Opening the volume first claims it: a writer epoch above every
//!    earlier one, durable in the header before anything else changes
//!    ([`claim`]); tractservers refuse changes carrying an older epoch, so
//!    requests of a crashed writer still in the network can never land
//!    after the new writer has reconciled. Then every replica's bitmap is
//!    read, every tract set on any replica is reconciled, and the bitmap is
//!    cleared ([`IntentLog::recover`]). A crash anywhere in that leaves the
//!    bits set: the next open does it again.
//! 4. A write that failed or was abandoned may have reached some replicas:
//!    its tracts become suspect, keep their bits, and are reconciled before
//!    the next read of them, with no write of them in flight
//!    ([`IntentLog::settle`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt};
use tokio::sync::Notify;

use blizzard_core::crc::crc32c;
use blizzard_core::reconcile::Reconciled;
use blizzard_env::{Env, Instant};

use crate::io::BlobIo;
use crate::superblock::SUPERBLOCK_COPY_LEN;
use crate::{PlantedBug, VolumeError};

/// Where the header is in tract 0.
pub const HEADER_OFFSET: u32 = 2 * SUPERBLOCK_COPY_LEN;
/// Bitmap pages, and the header, are one 4 KiB chunk each: a page write
/// never rewrites its neighbours and is never a read-modify-write.
pub const PAGE: u32 = 4096;
/// Where the bitmap starts in tract 0.
pub const BITMAP_OFFSET: u32 = HEADER_OFFSET + PAGE;
/// Tracts one bitmap page covers.
pub const TRACTS_PER_PAGE: u64 = PAGE as u64 * 8;
/// How long a tract stays marked after its last write. Longer keeps the
/// bitmap still under a workload that returns to the same tracts (no page
/// writes); shorter leaves less to compare after a crash. Recovery compares
/// per-chunk digests the tractservers keep in memory, so a few seconds of
/// writing costs little to reconcile.
pub const CLEAR_AFTER: Duration = Duration::from_secs(5);
/// How often idle bits are looked for.
const CLEAR_TICK: Duration = Duration::from_secs(1);
/// Tracts reconciled at once during recovery.
const RECONCILE_PARALLEL: usize = 16;
/// Pages read at once during recovery (256 KiB per replica).
const PAGES_PER_READ: u64 = 64;
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

const HEADER_MAGIC: [u8; 8] = *b"BLZINTNT";
const HEADER_FORMAT: u32 = 1;

/// How many tracts a bitmap in a tract of `tract_size` bytes can cover.
pub fn capacity(tract_size: u32) -> u64 {
    (tract_size.saturating_sub(BITMAP_OFFSET) / PAGE) as u64 * TRACTS_PER_PAGE
}

fn page_of(tract: u64) -> u64 {
    tract / TRACTS_PER_PAGE
}

fn page_offset(page: u64) -> u32 {
    BITMAP_OFFSET + page as u32 * PAGE
}

/// The intent log's header: who writes the volume now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The writer epoch of the process that last claimed the volume.
    pub writer: u64,
}

impl Header {
    pub fn encode(&self) -> Bytes {
        let mut b = vec![0u8; PAGE as usize];
        b[0..8].copy_from_slice(&HEADER_MAGIC);
        b[8..12].copy_from_slice(&HEADER_FORMAT.to_le_bytes());
        b[12..20].copy_from_slice(&self.writer.to_le_bytes());
        let crc = crc32c(&b[..20]);
        b[20..24].copy_from_slice(&crc.to_le_bytes());
        Bytes::from(b)
    }

    /// `None` for anything but an intact header of this format (a volume
    /// written before the intent log existed holds zeros here).
    pub fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < 24 || b[0..8] != HEADER_MAGIC {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(8) != HEADER_FORMAT || u32_at(20) != crc32c(&b[..20]) {
            return None;
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[12..20]);
        Some(Header { writer: u64::from_le_bytes(w) })
    }
}

/// The tracts set in one bitmap page.
fn decode_page(page: u64, b: &[u8]) -> impl Iterator<Item = u64> + '_ {
    b.iter().enumerate().flat_map(move |(i, byte)| {
        (0..8)
            .filter(move |bit| byte >> bit & 1 == 1)
            .map(move |bit| page * TRACTS_PER_PAGE + i as u64 * 8 + bit)
    })
}

fn encode_page(page: u64, tracts: &BTreeSet<u64>) -> Bytes {
    let mut b = vec![0u8; PAGE as usize];
    for t in tracts {
        let rel = t - page * TRACTS_PER_PAGE;
        b[(rel / 8) as usize] |= 1 << (rel % 8);
    }
    Bytes::from(b)
}

/// One tract that must stay marked.
#[derive(Clone, Copy, Debug)]
struct Marked {
    /// Writes of the tract between `enter` and `leave`.
    active: u32,
    last_used: Instant,
    /// A write of it failed or was abandoned: replicas may differ now.
    suspect: bool,
    /// Being reconciled: no write of it may start.
    reconciling: bool,
}

/// One bitmap page: what its last completed write holds on every replica,
/// and what the write in flight (one at a time) will hold.
#[derive(Clone, Debug, Default)]
struct Page {
    on_disk: BTreeSet<u64>,
    inflight: Option<BTreeSet<u64>>,
}

/// The pure state of the intent log: which tracts must be marked, and what
/// the bitmap pages hold. No I/O; [`IntentLog`] drives it.
#[derive(Debug, Default)]
pub struct IntentMap {
    marked: BTreeMap<u64, Marked>,
    pages: BTreeMap<u64, Page>,
    suspects: u64,
}

impl IntentMap {
    /// Whether writes of `tract` may go out: its bit is set on every
    /// replica, and no page write in flight clears it.
    pub fn durable(&self, tract: u64) -> bool {
        self.pages.get(&page_of(tract)).is_some_and(|p| {
            p.on_disk.contains(&tract) && p.inflight.as_ref().is_none_or(|s| s.contains(&tract))
        })
    }

    /// Whether a write of `tract` must wait (it is being reconciled).
    pub fn blocked(&self, tract: u64) -> bool {
        self.marked.get(&tract).is_some_and(|m| m.reconciling)
    }

    /// A write of `tract` starts: it stays marked at least until it leaves.
    pub fn enter(&mut self, tract: u64, now: Instant) {
        assert!(!self.blocked(tract), "a write of tract {tract} started while it is reconciled");
        let m = self.marked.entry(tract).or_insert(Marked {
            active: 0,
            last_used: now,
            suspect: false,
            reconciling: false,
        });
        m.active += 1;
        m.last_used = now;
    }

    /// The write of `tract` is issued now: rule 1, checked.
    pub fn enter_durable(&self, tract: u64) {
        assert!(
            self.durable(tract),
            "a write of tract {tract} would go out before its intent bit is durable"
        );
    }

    /// A write of `tract` is over; `ok` says it reached every replica.
    pub fn leave(&mut self, tract: u64, now: Instant, ok: bool) {
        let Some(m) = self.marked.get_mut(&tract) else {
            panic!("tract {tract} left the intent log without entering it");
        };
        m.active = m
            .active
            .checked_sub(1)
            .unwrap_or_else(|| panic!("tract {tract} left more often than it entered"));
        m.last_used = now;
        if !ok && !m.suspect {
            m.suspect = true;
            self.suspects += 1;
        }
    }

    pub fn suspect(&self, tract: u64) -> bool {
        self.marked.get(&tract).is_some_and(|m| m.suspect)
    }

    pub fn suspects(&self) -> u64 {
        self.suspects
    }

    pub fn suspect_tracts(&self) -> Vec<u64> {
        self.marked.iter().filter(|(_, m)| m.suspect).map(|(t, _)| *t).collect()
    }

    pub fn active(&self, tract: u64) -> u32 {
        self.marked.get(&tract).map_or(0, |m| m.active)
    }

    /// Marks a reconciliation of `tract` started (false: one already is,
    /// or it is not suspect).
    pub fn start_reconcile(&mut self, tract: u64) -> bool {
        match self.marked.get_mut(&tract) {
            Some(m) if m.suspect && !m.reconciling => {
                m.reconciling = true;
                true
            }
            _ => false,
        }
    }

    /// The reconciliation of `tract` ended; `ok`: the replicas agree.
    pub fn end_reconcile(&mut self, tract: u64, ok: bool) {
        if let Some(m) = self.marked.get_mut(&tract) {
            m.reconciling = false;
            if ok && m.suspect {
                m.suspect = false;
                self.suspects -= 1;
            }
        }
    }

    /// Starts the write of bitmap page `page` (one at a time per page):
    /// its bytes hold every tract that must be marked now.
    pub fn begin_write(&mut self, page: u64) -> Bytes {
        let set: BTreeSet<u64> = self
            .marked
            .range(page * TRACTS_PER_PAGE..(page + 1) * TRACTS_PER_PAGE)
            .map(|(t, _)| *t)
            .collect();
        let bytes = encode_page(page, &set);
        let p = self.pages.entry(page).or_default();
        assert!(p.inflight.is_none(), "two writes of intent page {page} at once");
        p.inflight = Some(set);
        bytes
    }

    /// The page write ended. A failed one may have reached any of the
    /// replicas: only bits both the old and the new contents set are sure
    /// to be set everywhere.
    pub fn end_write(&mut self, page: u64, ok: bool) {
        let p = self.pages.entry(page).or_default();
        let Some(written) = p.inflight.take() else { return };
        p.on_disk = if ok { written } else { p.on_disk.intersection(&written).copied().collect() };
    }

    /// Whether page `page` on disk differs from what must be marked.
    pub fn needs_write(&self, page: u64) -> bool {
        let want = self.marked.range(page * TRACTS_PER_PAGE..(page + 1) * TRACTS_PER_PAGE).map(|(t, _)| t);
        let have = self.pages.get(&page).map(|p| &p.on_disk);
        !want.eq(have.into_iter().flatten())
    }

    /// Forgets tracts idle since `before` (nothing in flight, not suspect)
    /// and returns the pages whose bits should now be cleared.
    pub fn take_idle(&mut self, before: Instant) -> BTreeSet<u64> {
        let idle: Vec<u64> = self
            .marked
            .iter()
            .filter(|(_, m)| m.active == 0 && !m.suspect && !m.reconciling && m.last_used <= before)
            .map(|(t, _)| *t)
            .collect();
        for t in &idle {
            self.marked.remove(t);
        }
        idle.into_iter().map(page_of).collect()
    }

    /// Pages with a bit set on disk.
    pub fn pages_set(&self) -> Vec<u64> {
        self.pages.iter().filter(|(_, p)| !p.on_disk.is_empty()).map(|(n, _)| *n).collect()
    }
}

/// What opening did: the claim, and what recovery found and repaired.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// The writer epoch this process claimed.
    pub writer: u64,
    /// Tracts the bitmap named (or every data tract, `full`).
    pub dirty_tracts: u64,
    /// The volume had no intent header (written by a build without one):
    /// every data tract was reconciled, once.
    pub full: bool,
    pub reconciled: Reconciled,
    pub took: Duration,
}

/// Counters for status and tests.
#[derive(Debug, Default)]
pub struct IntentStats {
    pub page_writes: AtomicU64,
    pub suspects_reconciled: AtomicU64,
}

/// The intent log of one open volume.
pub struct IntentLog {
    env: Env,
    io: Arc<dyn BlobIo>,
    planted: PlantedBug,
    map: Mutex<IntentMap>,
    /// One write per page at a time; writers needing a page queue here and
    /// the next write covers all of them.
    page_locks: Mutex<BTreeMap<u64, Arc<tokio::sync::Mutex<()>>>>,
    /// A write left, or a reconciliation ended.
    changed: Notify,
    /// Mirrors `IntentMap::suspects` so reads skip the lock when zero.
    suspects: AtomicU64,
    pub stats: IntentStats,
}

/// A write's hold on its tracts' bits: from before it is issued until it
/// ended. Dropped without [`IntentGuard::finish`] (the write abandoned
/// part-way), its tracts become suspect.
pub struct IntentGuard {
    log: Arc<IntentLog>,
    tracts: Vec<u64>,
    finished: bool,
}

impl IntentGuard {
    /// The write ended: `ok` if it reached every replica.
    pub fn finish(mut self, ok: bool) {
        self.finished = true;
        self.log.leave(&self.tracts, ok);
    }
}

impl Drop for IntentGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.log.leave(&self.tracts, false);
        }
    }
}

/// A bitmap page write in flight; if the future writing it is dropped,
/// the page counts as failed, so the next write can start.
struct PageWrite<'a> {
    log: &'a IntentLog,
    page: u64,
    done: bool,
}

impl Drop for PageWrite<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.log.lock().end_write(self.page, false);
        }
    }
}

/// A reconciliation of a suspect tract under way; ends (unsuccessful) if
/// dropped, so writes of the tract are not blocked forever.
struct Reconciling<'a> {
    log: &'a IntentLog,
    tract: u64,
    done: bool,
}

impl Drop for Reconciling<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.log.lock().end_reconcile(self.tract, false);
            self.log.changed.notify_waiters();
        }
    }
}

/// What claiming found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    pub writer: u64,
    /// Some replica held an intent header (else the volume predates them).
    pub header_found: bool,
}

/// Writes the header of a new volume (writer epoch 0: the first open
/// claims 1).
pub async fn format(io: &Arc<dyn BlobIo>) -> Result<(), VolumeError> {
    io.write(0, HEADER_OFFSET, Header { writer: 0 }.encode()).await?;
    Ok(())
}

/// Reads `[offset, +len)` of tract 0 from every replica; a replica whose
/// copy is damaged is left out (`None` if none could be read intact).
async fn read_every_replica(
    io: &Arc<dyn BlobIo>,
    offset: u32,
    len: u32,
) -> Result<Option<Vec<Bytes>>, VolumeError> {
    match io.read_replicas(0, offset, len).await {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.is_corrupt() => match io.read(0, offset, len).await {
            // Some replica is damaged there: what the others hold is all
            // that can be known, and callers must assume the worst.
            Ok(_) | Err(_) => Ok(None),
        },
        Err(e) => Err(e.into()),
    }
}

/// Claims the volume for this process: a writer epoch above every one
/// stored or seen by a tractserver and at least [`BlobIo::writer_floor`]
/// (the volume lease's token), durable in the header on every replica
/// before it returns. From then on the blob store refuses changes from
/// earlier writers.
pub async fn claim(io: &Arc<dyn BlobIo>) -> Result<Claim, VolumeError> {
    let (newest, header_found) = match read_every_replica(io, HEADER_OFFSET, PAGE).await? {
        Some(copies) => {
            let hs: Vec<Header> = copies.iter().filter_map(|b| Header::decode(b)).collect();
            (hs.iter().map(|h| h.writer).max().unwrap_or(0), !hs.is_empty())
        }
        // A damaged header: the intact replicas' newest, if any, or the
        // tractservers correct it below.
        None => {
            let h = match io.read(0, HEADER_OFFSET, PAGE).await {
                Ok(b) => Header::decode(&b),
                Err(_) => None,
            };
            (h.map_or(0, |h| h.writer), true)
        }
    };
    // Above every earlier claim, and at least this process's lease token:
    // two holders that read the same header still claim different epochs.
    let mut writer = (newest + 1).max(io.writer_floor());
    for _ in 0..8 {
        io.set_writer(writer);
        match io.write(0, HEADER_OFFSET, Header { writer }.encode()).await {
            Ok(()) => return Ok(Claim { writer, header_found }),
            // A tractserver has seen a newer writer than the header says
            // (its claim was cut off): go past it.
            Err(e) => match e.fenced_by() {
                Some(n) if n >= writer => writer = n + 1,
                _ => return Err(e.into()),
            },
        }
    }
    Err(VolumeError::Invalid(
        "could not claim the volume: other writers keep claiming it; stop them first".into(),
    ))
}

impl IntentLog {
    /// After [`claim`], makes every tract the bitmap names (on any replica)
    /// agree on every replica, then clears the bitmap, and returns the log
    /// ready for writes. `size_tracts` bounds the tracts looked at.
    pub async fn recover(
        env: Env,
        io: Arc<dyn BlobIo>,
        claim: Claim,
        size_tracts: u64,
        planted: PlantedBug,
    ) -> Result<(Arc<IntentLog>, Recovery), VolumeError> {
        let started = env.now();
        let mut rec = Recovery { writer: claim.writer, ..Recovery::default() };
        let pages = size_tracts.div_ceil(TRACTS_PER_PAGE);
        let mut dirty: BTreeSet<u64> = BTreeSet::new();
        let mut pages_set: BTreeSet<u64> = BTreeSet::new();
        let mut full = !claim.header_found;
        let mut p = 0;
        while p < pages && !full {
            let n = PAGES_PER_READ.min(pages - p);
            match read_every_replica(&io, page_offset(p), (n * PAGE as u64) as u32).await? {
                Some(copies) => {
                    for c in &copies {
                        for (i, pb) in c.chunks(PAGE as usize).enumerate() {
                            let page = p + i as u64;
                            let before = dirty.len();
                            dirty.extend(decode_page(page, pb).filter(|t| *t >= 1 && *t < size_tracts));
                            if dirty.len() > before || pb.iter().any(|b| *b != 0) {
                                pages_set.insert(page);
                            }
                        }
                    }
                }
                None => {
                    tracing::warn!(
                        "the volume's intent bitmap is damaged on a replica; reconciling every tract"
                    );
                    full = true;
                }
            }
            p += n;
        }
        if full {
            dirty = (1..size_tracts).collect();
            pages_set = (0..pages).collect();
        }
        rec.full = full;
        rec.dirty_tracts = dirty.len() as u64;
        if !dirty.is_empty() && planted != PlantedBug::SkipReconcile {
            rec.reconciled = reconcile_all(&env, &io, &dirty).await?;
        }
        // Every tract agrees: clear what any replica had set.
        for page in &pages_set {
            io.write(0, page_offset(*page), Bytes::from(vec![0u8; PAGE as usize])).await?;
        }
        rec.took = env.now().duration_since(started);
        if rec.dirty_tracts > 0 {
            tracing::info!(
                writer = rec.writer,
                tracts = rec.dirty_tracts,
                full = rec.full,
                chunks_compared = rec.reconciled.chunks_compared,
                chunk_repairs = rec.reconciled.chunk_repairs,
                bytes_copied = rec.reconciled.bytes_copied,
                took_ms = rec.took.as_millis() as u64,
                "replicas reconciled after an unclean close"
            );
        }
        let log = Arc::new(IntentLog {
            env,
            io,
            planted,
            map: Mutex::new(IntentMap::default()),
            page_locks: Mutex::new(BTreeMap::new()),
            changed: Notify::new(),
            suspects: AtomicU64::new(0),
            stats: IntentStats::default(),
        });
        log.start_clearer();
        Ok((log, rec))
    }

    fn lock(&self) -> MutexGuard<'_, IntentMap> {
        match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn page_lock(&self, page: u64) -> Arc<tokio::sync::Mutex<()>> {
        let mut g = match self.page_locks.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        g.entry(page).or_default().clone()
    }

    /// Whether a failed write left a tract to reconcile before it is read.
    pub fn has_suspects(&self) -> bool {
        self.suspects.load(Ordering::Acquire) > 0
    }

    /// Tracts marked with a write in flight or recent, suspect included.
    pub fn marked(&self) -> usize {
        self.lock().marked.len()
    }

    /// Holds the bits of `tracts` for a write: returns once each is set on
    /// every replica (rule 1). Waits while one of them is reconciled.
    pub async fn enter(self: &Arc<Self>, tracts: &[u64]) -> Result<IntentGuard, VolumeError> {
        // Counts the write in unless one of its tracts is being reconciled;
        // `Some(true)` when every bit is durable already (the usual case:
        // one lock, no waiter registered, no page write).
        let try_enter = || {
            let mut m = self.lock();
            if tracts.iter().any(|t| m.blocked(*t)) {
                return None;
            }
            let now = self.env.now();
            for t in tracts {
                m.enter(*t, now);
            }
            Some(tracts.iter().all(|t| m.durable(*t)))
        };
        let durable = match try_enter() {
            Some(d) => d,
            None => loop {
                let notified = self.changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if let Some(d) = try_enter() {
                    break d;
                }
                notified.await;
            },
        };
        let guard = IntentGuard { log: self.clone(), tracts: tracts.to_vec(), finished: false };
        if durable {
            return Ok(guard);
        }
        if self.planted == PlantedBug::WriteBeforeIntent {
            // Planted: the bits are set in the background, the write goes out now.
            let me = self.clone();
            let ts = tracts.to_vec();
            tokio::spawn(async move { me.make_durable(&ts).await });
            return Ok(guard);
        }
        match self.make_durable(tracts).await {
            Ok(()) => {
                let m = self.lock();
                for t in tracts {
                    m.enter_durable(*t);
                }
                Ok(guard)
            }
            Err(e) => {
                // Nothing of the write went out.
                guard.finish(true);
                Err(e)
            }
        }
    }

    /// Writes bitmap pages until every one of `tracts` is durable.
    async fn make_durable(&self, tracts: &[u64]) -> Result<(), VolumeError> {
        let pages: BTreeSet<u64> = tracts.iter().map(|t| page_of(*t)).collect();
        for page in pages {
            let all_set =
                |m: &IntentMap| tracts.iter().filter(|t| page_of(**t) == page).all(|t| m.durable(*t));
            if all_set(&self.lock()) {
                continue;
            }
            let lock = self.page_lock(page);
            let _one = lock.lock().await;
            if all_set(&self.lock()) {
                continue;
            }
            self.write_page(page).await?;
        }
        Ok(())
    }

    /// Writes bitmap page `page` as the map wants it now. The caller holds
    /// the page's lock.
    async fn write_page(&self, page: u64) -> Result<(), VolumeError> {
        let bytes = self.lock().begin_write(page);
        let mut pw = PageWrite { log: self, page, done: false };
        self.stats.page_writes.fetch_add(1, Ordering::Relaxed);
        let r = self.io.write(0, page_offset(page), bytes).await;
        pw.done = true;
        self.lock().end_write(page, r.is_ok());
        Ok(r?)
    }

    fn leave(&self, tracts: &[u64], ok: bool) {
        let suspects = {
            let mut m = self.lock();
            let now = self.env.now();
            for t in tracts {
                m.leave(*t, now, ok);
            }
            m.suspects()
        };
        self.suspects.store(suspects, Ordering::Release);
        // Only a reconciliation waits for writes to leave (and only of a
        // suspect tract): without suspects nobody is waiting.
        if suspects > 0 {
            self.changed.notify_waiters();
        }
    }

    /// Before a read of `tracts`: reconciles those a failed write left
    /// suspect (rule 4). Nothing to do, and no lock taken, when no write
    /// has failed.
    pub async fn settle(&self, tracts: &[u64]) -> Result<(), VolumeError> {
        if self.suspects.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        for &t in tracts {
            self.reconcile_suspect(t).await?;
        }
        Ok(())
    }

    async fn reconcile_suspect(&self, tract: u64) -> Result<(), VolumeError> {
        // Become the tract's reconciler (or wait for the one under way),
        // then wait for its writes in flight to end.
        let mut rc = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut m = self.lock();
                if !m.suspect(tract) {
                    return Ok(());
                }
                if m.start_reconcile(tract) {
                    break Reconciling { log: self, tract, done: false };
                }
            }
            notified.await;
        };
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.lock().active(tract) == 0 {
                break;
            }
            notified.await;
        }
        let r = self.io.reconcile(tract).await;
        rc.done = true;
        let suspects = {
            let mut m = self.lock();
            m.end_reconcile(tract, r.is_ok());
            m.suspects()
        };
        self.suspects.store(suspects, Ordering::Release);
        self.changed.notify_waiters();
        if r.is_ok() {
            self.stats.suspects_reconciled.fetch_add(1, Ordering::Relaxed);
            tracing::info!(tract, "tract reconciled after a failed write");
        }
        r.map(|_| ()).map_err(VolumeError::from)
    }

    /// Clears the bits of tracts idle for `CLEAR_AFTER`, and retries
    /// reconciling suspect tracts, every `CLEAR_TICK` while the log lives.
    fn start_clearer(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let env = self.env.clone();
        tokio::spawn(async move {
            loop {
                env.sleep(CLEAR_TICK).await;
                let Some(me) = weak.upgrade() else { return };
                let mut r = me.clear_idle().await;
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "could not clear idle intent bits; will retry");
                }
                let suspects = me.lock().suspect_tracts();
                for t in suspects {
                    if let Err(e) = me.reconcile_suspect(t).await {
                        tracing::warn!(tract = t, error = %e, "tract left suspect by a failed write is not reconciled yet; will retry");
                        r = Err(e);
                        break;
                    }
                }
                if r.as_ref().is_err_and(VolumeError::is_fenced) {
                    // Another process opened the volume: it reconciles
                    // what this one left marked. Nothing more to do here.
                    tracing::error!("the volume was opened by another process, which fenced this one: its writes are refused from now on; stop using the volume here");
                    return;
                }
            }
        });
    }

    async fn clear_idle(&self) -> Result<(), VolumeError> {
        let now = self.env.now();
        let Some(before) = now.checked_sub(CLEAR_AFTER) else { return Ok(()) };
        let pages = {
            let mut m = self.lock();
            let mut pages = m.take_idle(before);
            // And pages a failed clearing write left with bits to drop.
            pages.extend(m.pages_set().into_iter().filter(|p| m.needs_write(*p)));
            pages
        };
        for page in pages {
            self.rewrite(page).await?;
        }
        Ok(())
    }

    async fn rewrite(&self, page: u64) -> Result<(), VolumeError> {
        let lock = self.page_lock(page);
        let _one = lock.lock().await;
        if self.lock().needs_write(page) {
            self.write_page(page).await?;
        }
        Ok(())
    }

    /// A clean close: clears every bit but those of tracts with a write in
    /// flight or suspect (which the next open reconciles).
    pub async fn close(&self) -> Result<(), VolumeError> {
        let pages = {
            let mut m = self.lock();
            let far = self.env.now() + Duration::from_secs(3600);
            let mut pages = m.take_idle(far);
            pages.extend(m.pages_set());
            pages
        };
        for page in pages {
            self.rewrite(page).await?;
        }
        Ok(())
    }
}

/// Reconciles `tracts`, a bounded number at a time, logging progress.
async fn reconcile_all(
    env: &Env,
    io: &Arc<dyn BlobIo>,
    tracts: &BTreeSet<u64>,
) -> Result<Reconciled, VolumeError> {
    let total = tracts.len();
    let mut sum = Reconciled::default();
    let mut done = 0usize;
    let mut last_report = env.now();
    let mut s = stream::iter(tracts.iter().copied())
        .map(|t| {
            let io = io.clone();
            async move { (t, io.reconcile(t).await) }
        })
        .buffer_unordered(RECONCILE_PARALLEL);
    while let Some((t, r)) = s.next().await {
        let r = r.map_err(|source| VolumeError::Reconcile { tract: t, source })?;
        sum += r;
        done += 1;
        if env.now().duration_since(last_report) >= PROGRESS_EVERY {
            last_report = env.now();
            tracing::info!(
                done,
                total,
                chunk_repairs = sum.chunk_repairs,
                "reconciling replicas after an unclean close"
            );
        }
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> Instant {
        Env::real().now()
    }

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header { writer: 42 };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        assert_eq!(Header::decode(&[0u8; 4096]), None);
        let mut b = h.encode().to_vec();
        b[13] ^= 1;
        assert_eq!(Header::decode(&b), None);
    }

    #[test]
    fn pages_round_trip() {
        let set: BTreeSet<u64> =
            [TRACTS_PER_PAGE * 2 + 1, TRACTS_PER_PAGE * 2 + 9, TRACTS_PER_PAGE * 3 - 1].into();
        let b = encode_page(2, &set);
        assert_eq!(decode_page(2, &b).collect::<BTreeSet<_>>(), set);
        assert_eq!(capacity(16 << 10), TRACTS_PER_PAGE);
        assert_eq!(capacity(12 << 10), 0);
    }

    /// A bit counts as set only once a page write holding it completed,
    /// and not while a write clearing it is in flight.
    #[test]
    fn bits_are_durable_only_after_their_page_write() {
        let mut m = IntentMap::default();
        let now = t0();
        m.enter(5, now);
        assert!(!m.durable(5));
        let b = m.begin_write(0);
        assert_eq!(decode_page(0, &b).collect::<Vec<_>>(), vec![5]);
        assert!(!m.durable(5), "not before the write completes");
        m.end_write(0, true);
        assert!(m.durable(5));
        m.enter_durable(5);
        // Idle and cleared: a write arriving while the clearing page write
        // is in flight must not count the old bit.
        m.leave(5, now, true);
        let later = now + CLEAR_AFTER;
        assert_eq!(m.take_idle(later), [0].into());
        let b = m.begin_write(0);
        assert_eq!(decode_page(0, &b).count(), 0);
        m.enter(5, later);
        assert!(!m.durable(5), "a clearing write is in flight");
        m.end_write(0, true);
        assert!(!m.durable(5));
        assert!(m.needs_write(0));
        m.begin_write(0);
        m.end_write(0, true);
        assert!(m.durable(5));
    }

    /// A failed page write keeps only bits both contents had.
    #[test]
    fn a_failed_page_write_is_assumed_half_done() {
        let mut m = IntentMap::default();
        let now = t0();
        m.enter(1, now);
        m.begin_write(0);
        m.end_write(0, true);
        m.enter(2, now);
        m.begin_write(0);
        m.end_write(0, false);
        assert!(m.durable(1) && !m.durable(2));
    }

    /// Busy, suspect or recent tracts keep their bits; failed writes make
    /// their tracts suspect until a reconciliation succeeds.
    #[test]
    fn only_idle_clean_tracts_are_cleared() {
        let mut m = IntentMap::default();
        let now = t0();
        for t in [1, 2, 3] {
            m.enter(t, now);
        }
        m.leave(1, now, true);
        m.leave(2, now, false);
        let later = now + CLEAR_AFTER;
        assert_eq!(m.take_idle(now - Duration::from_millis(1)), BTreeSet::new());
        m.take_idle(later);
        assert_eq!(m.marked.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!((m.suspects(), m.suspect(2)), (1, true));
        assert!(m.start_reconcile(2));
        assert!(!m.start_reconcile(2), "one reconciliation at a time");
        assert!(m.blocked(2));
        m.end_reconcile(2, false);
        assert!(m.suspect(2) && !m.blocked(2));
        assert!(m.start_reconcile(2));
        m.end_reconcile(2, true);
        assert_eq!(m.suspects(), 0);
        m.take_idle(later);
        assert_eq!(m.marked.keys().copied().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    #[should_panic(expected = "before its intent bit is durable")]
    fn issuing_before_the_bit_is_durable_panics() {
        let mut m = IntentMap::default();
        m.enter(7, t0());
        m.enter_durable(7);
    }
}
