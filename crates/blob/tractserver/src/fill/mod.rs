//! Re-replication at a newcomer (FDS §3.2). When the metadata server puts
//! this server into a row in place of a dead member, the row's assignment
//! names it as *filling*: it copies every tract of the row from the row's
//! complete members, while taking part in the row as usual otherwise.
//!
//! Invariants, and how they are kept:
//! - A read is served only for a tract this server has (copied, or copied
//!   then written): until then it answers `NotReady` and the client reads
//!   another replica.
//! - A client write never lands on a tract before its copy: any request
//!   that changes a tract copies it first (on demand, under the tract's copy
//!   lock), then applies itself. The background copier takes the same lock
//!   and skips tracts already copied. So a write either finds the copy done
//!   (and lands on top of it), or triggers it; a copy never overwrites a
//!   newer write. The source holds every acknowledged write (clients write
//!   every member of the row and complete only when all acknowledged), so
//!   a copy taken at any moment has every write acknowledged before it.
//! - Only complete members are copied from: they were in the row when every
//!   acknowledged write reached it.
//! - A copy is good for the row version it was made under, and no longer.
//!   While this server stays a writer of the row, a newer version changes
//!   nothing it holds; but it cannot tell that it stayed one: cut off from
//!   the metadata server, it may miss an assignment that took the row away
//!   and a later one that gave it back, and every write acknowledged in
//!   between went to the others. So a new version of a row starts its copy
//!   over (`Fills::update`), and a copy made under an older version counts
//!   for nothing (`ensure_copied`). A version change also fences the
//!   source: it refuses writes of the older version once it moved, so the
//!   new copy has every write acknowledged under the older one.
//! - Which tracts are copied lives in memory. After a restart the stored
//!   assignment still names this server as filling and every tract of the
//!   row is copied again: always safe, since the sources have everything.
//! - A row counts as filled (reported in heartbeats) once every tract the
//!   source listed is copied; tracts created since were copied on their
//!   first write. The metadata server then clears the filling mark.
//!
//! Incremental repair (Ursa §4.2.1, design 0009). A server declared dead
//! that comes back while its replacement in a row is still copying gets
//! its column back, filling (`metaserver::plan::readmit`). It still holds
//! the row's tracts as they were when it left, so a tract held here is not
//! copied whole: its digest (`Store::digest`: a hash of each chunk's bytes,
//! never their CRC) goes to the source in `CopyTractChanges`, and only the
//! chunks that differ come back, with the chunks to unmap. The same rules
//! hold as for a copy, since a repair is a copy that leaves equal chunks
//! in place:
//! - It runs under the tract's copy lock, so nothing changes the tract
//!   here between the digest it sends and the chunks it writes (`patch`
//!   checks the tract is still the one it digested).
//! - The source compared its chunks at some moment after every write
//!   acknowledged before the repair began; a write landing there since is
//!   on its way here too and waits for the lock, as for a copy.
//! - A tract held here at another incarnation, or not held at the source,
//!   comes whole (or goes), as `CopyTract` would have it; blob metadata is
//!   always copied whole.
//! - Chunks this server wrote while cut off and the others never got
//!   (never acknowledged) differ, so they are replaced or unmapped: the
//!   repaired tract holds exactly the source's bytes.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::Notify;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::reconcile::ChunkState;
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};
use blizzard_proto::{
    Assignment, ErrorCode, ErrorReply, FillProgress, Reply, Request, RowRef, RowTract, ROW_TRACTS_PAGE,
};
use blizzard_rpc::Shutdown;

use crate::blob_meta::decode_meta;
use crate::parts::Parts;
use crate::store::{store_err, Durability, StoreError, TractWrite};

mod source;

/// Tracts one newcomer copies at once, over all the rows it fills. Each
/// holds up to a tract in memory; recovery's parallelism comes mostly from
/// every newcomer copying at once.
const COPY_PARALLEL: usize = 4;

/// The background copier's share of `COPY_PARALLEL`, taken per tract by
/// every row being filled. Rows are copied concurrently so that a newcomer
/// of several rows reads from all their sources at once: one row at a time,
/// the newcomers of a recovery tended to queue on the same source while
/// other sources idled (`bench/recovery.sh`).
struct CopySlots(tokio::sync::Semaphore);

impl Default for CopySlots {
    fn default() -> Self {
        CopySlots(tokio::sync::Semaphore::new(COPY_PARALLEL))
    }
}

/// Pause before trying a row again after its copy failed.
const RETRY_PAUSE: Duration = Duration::from_millis(500);

struct RowFill {
    version: u64,
    /// The row's complete members other than this server, primary first.
    /// Only the first is copied from: a member in a lower column holds a
    /// superset of the tracts of a higher one (a blob of replication r uses
    /// only the first r columns, FDS §3.4), so a later one may lack tracts
    /// the first has, and reading "no such tract" from it would install a
    /// hole. If the first is unreachable the copy waits: either it comes
    /// back, or the metadata server replaces it and the next complete
    /// member becomes the first.
    sources: Vec<TsId>,
    done: HashSet<(BlobId, TractNo)>,
    /// Tracts the source listed (0 until listed).
    listed: u64,
    complete: bool,
}

/// Held while a tract is copied, so a write waits for the copy it needs.
type CopyLock = Arc<tokio::sync::Mutex<()>>;

/// This server's rows being filled.
#[derive(Default)]
struct Fills {
    rows: Mutex<HashMap<u32, RowFill>>,
    /// Fast path: no row is being filled (almost always).
    any: AtomicBool,
    locks: Mutex<HashMap<(BlobId, TractNo), CopyLock>>,
    bytes_done: AtomicU64,
    /// Bytes of tracts already held here that a repair found unchanged
    /// and so did not copy (incremental repair, design 0009).
    bytes_unchanged: AtomicU64,
    /// Tracts brought up to date that way.
    tracts_repaired: AtomicU64,
    wake: Notify,
    /// When the copy budget is next free (see `Filler::bandwidth`).
    paced_until: Mutex<Option<blizzard_env::Instant>>,
    copy_slots: CopySlots,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Fills {
    /// Follows a new assignment: starts filling rows that name this server
    /// as filling, keeps what was copied of rows it still fills at the same
    /// version, starts over on a row whose version changed (module header:
    /// this server may have been out of the row in between), and forgets
    /// rows it no longer fills.
    pub fn update(&self, me: TsId, a: &Assignment) {
        let mut rows = lock(&self.rows);
        let mut keep = HashSet::new();
        for r in a.rows.iter().filter(|r| r.filling.contains(&me)) {
            keep.insert(r.row);
            let sources = r.members.iter().copied().filter(|m| *m != me && !r.filling.contains(m)).collect();
            match rows.get_mut(&r.row) {
                Some(f) if f.version == r.version => f.sources = sources,
                _ => {
                    let fresh = RowFill {
                        version: r.version,
                        sources,
                        done: HashSet::new(),
                        listed: 0,
                        complete: false,
                    };
                    rows.insert(r.row, fresh);
                }
            }
        }
        rows.retain(|r, _| keep.contains(r));
        self.any.store(!rows.is_empty(), Ordering::Release);
        drop(rows);
        self.wake.notify_one();
    }

    /// Whether this server may list the blobs of `row`'s metadata: it is
    /// filling the row and has copied all of it.
    pub fn row_complete(&self, row: u32) -> bool {
        lock(&self.rows).get(&row).is_some_and(|f| f.complete)
    }

    /// Rows copied completely (for the heartbeat) and progress.
    pub fn report(&self) -> (Vec<RowRef>, FillProgress) {
        let rows = lock(&self.rows);
        let mut p =
            FillProgress { bytes_done: self.bytes_done.load(Ordering::Relaxed), ..Default::default() };
        let mut filled = Vec::new();
        for (row, f) in rows.iter() {
            if f.complete {
                filled.push(RowRef { row: *row, version: f.version });
            } else {
                p.rows += 1;
                p.tracts_total += f.listed.max(f.done.len() as u64);
                p.tracts_done += f.done.len() as u64;
            }
        }
        filled.sort_by_key(|r| r.row);
        (filled, p)
    }

    fn tract_lock(&self, key: (BlobId, TractNo)) -> CopyLock {
        lock(&self.locks).entry(key).or_default().clone()
    }

    /// Forgets a tract's lock once nobody else holds or waits for it.
    fn release_lock(&self, key: (BlobId, TractNo), l: &CopyLock) {
        let mut locks = lock(&self.locks);
        if locks.get(&key).is_some_and(|x| Arc::ptr_eq(x, l) && Arc::strong_count(x) == 2) {
            locks.remove(&key);
        }
    }
}

/// A copy's chunks, checked against the tract size.
struct Copied {
    incarnation: Incarnation,
    /// (first chunk, chunk count) of each run of present chunks.
    runs: Vec<(u32, u32)>,
    crcs: Vec<u32>,
    data: Bytes,
}

fn parse_copy(
    tract_size: u32,
    incarnation: Incarnation,
    bitmap: &[u8],
    crcs: Vec<u32>,
    data: Bytes,
) -> Option<Copied> {
    let runs = parse_bitmap(tract_size, bitmap)?;
    let n: u32 = runs.iter().map(|(_, n)| n).sum();
    if crcs.len() != n as usize || data.len() != n as usize * CHUNK_SIZE as usize {
        return None;
    }
    Some(Copied { incarnation, runs, crcs, data })
}

/// The chunks of a bitmap (bit i, LSB first, of byte i / 8), as runs of
/// (first chunk, count); `None` if it names a chunk past the tract.
fn parse_bitmap(tract_size: u32, bitmap: &[u8]) -> Option<Vec<(u32, u32)>> {
    let chunks = tract_size / CHUNK_SIZE;
    if bitmap.len() > (chunks as usize).div_ceil(8) {
        return None;
    }
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for i in 0..(bitmap.len() as u32 * 8) {
        if bitmap[(i / 8) as usize] & (1 << (i % 8)) == 0 {
            continue;
        }
        if i >= chunks {
            return None;
        }
        match runs.last_mut() {
            Some((first, n)) if *first + *n == i => *n += 1,
            _ => runs.push((i, 1)),
        }
    }
    Some(runs)
}

/// The newcomer's side of re-replication and the source's: copies the
/// rows this server fills, and serves copies and listings to others.
pub struct Filler {
    parts: Parts,
    fills: Fills,
    /// Bytes per second copied when filling rows (0: no limit): keeps
    /// recovery from starving client I/O.
    bandwidth: u64,
}

impl Filler {
    pub(crate) fn new(parts: Parts, bandwidth: u64) -> Filler {
        Filler { parts, fills: Fills::default(), bandwidth }
    }

    /// Follows a new assignment (`Fills::update`).
    pub fn update(&self, me: TsId, a: &Assignment) {
        self.fills.update(me, a)
    }

    /// Whether this server may list the blobs of `row`'s metadata: it is
    /// filling the row and has copied all of it.
    pub fn row_complete(&self, row: u32) -> bool {
        self.fills.row_complete(row)
    }

    /// Rows copied completely (for the heartbeat) and progress.
    pub fn report(&self) -> (Vec<RowRef>, FillProgress) {
        self.fills.report()
    }

    /// Bytes a repair found unchanged and did not copy (design 0009).
    pub fn unchanged_bytes(&self) -> u64 {
        self.fills.bytes_unchanged.load(Ordering::Relaxed)
    }

    /// Tracts brought up to date by a repair rather than copied whole.
    pub fn tracts_repaired(&self) -> u64 {
        self.fills.tracts_repaired.load(Ordering::Relaxed)
    }

    /// If `tract` of `blob` is in a row this server is filling and not yet
    /// copied: the row, its version and where to copy from.
    pub fn copy_pending(&self, blob: BlobId, tract: TractNo) -> Option<(u32, u64, Vec<TsId>)> {
        if !self.fills.any.load(Ordering::Acquire) {
            return None;
        }
        let row = self.parts.rows.locate(blob, tract)?;
        let rows = lock(&self.fills.rows);
        let f = rows.get(&row)?;
        (!f.complete && !f.done.contains(&(blob, tract))).then(|| (row, f.version, f.sources.clone()))
    }

    /// Refuses a read of a tract not copied here yet.
    pub fn check_copied(&self, blob: BlobId, tract: TractNo) -> Result<(), ErrorReply> {
        match self.copy_pending(blob, tract) {
            None => Ok(()),
            Some((row, _, _)) => Err(ErrorReply::new(
                ErrorCode::NotReady,
                format!("row {row} is still being copied to this server; read another replica"),
            )),
        }
    }

    /// Copies a tract of a row being filled here, unless done: called by
    /// every request that changes a tract, before it does. A copy made
    /// while the row's version changed counts for nothing (module header)
    /// and is made again.
    pub async fn ensure_copied(&self, blob: BlobId, tract: TractNo) -> Result<(), ErrorReply> {
        if self.copy_pending(blob, tract).is_none() {
            return Ok(());
        }
        // Boxed: a copy's future takes over 5 KiB, and every request
        // that changes a tract awaits this one. Inline, each such
        // request's future carried it, and was copied whole into its box
        // on every call, though all but a newcomer's first few take the
        // branch above.
        Box::pin(self.copy_on_demand(blob, tract)).await
    }

    async fn copy_on_demand(&self, blob: BlobId, tract: TractNo) -> Result<(), ErrorReply> {
        let key = (blob, tract);
        let l = self.fills.tract_lock(key);
        let r = {
            let _g = l.lock().await;
            loop {
                let Some((row, version, sources)) = self.copy_pending(blob, tract) else { break Ok(()) };
                if self.parts.store.planted(crate::store::PlantedBug::SkipCopy) {
                    // Planted: the copy is skipped, the tract counted as copied.
                } else if let Err(e) = self.copy_tract(row, version, &sources, blob, tract).await {
                    break Err(e);
                }
                if let Some(f) = lock(&self.fills.rows).get_mut(&row).filter(|f| f.version == version) {
                    f.done.insert(key);
                }
            }
        };
        self.fills.release_lock(key, &l);
        r
    }

    async fn copy_tract(
        &self,
        row: u32,
        version: u64,
        sources: &[TsId],
        blob: BlobId,
        tract: TractNo,
    ) -> Result<(), ErrorReply> {
        let Some(src) = sources.first() else {
            return Err(self.not_copied(blob, tract, "the row has no complete member"));
        };
        // Incremental repair (Ursa §4.2.1): a tract this server still
        // holds, from when it was in the row before, is compared chunk by
        // chunk with the source's, and only what differs comes over. Blob
        // metadata (one chunk) is always copied whole: its record must be
        // reloaded anyway.
        let held = if tract.is_meta() { None } else { self.held(blob, tract).await };
        let mut had = Vec::new();
        let (req, inc) = match held {
            Some((incarnation, have)) => {
                had = have.iter().map(|c| matches!(c, ChunkState::Data(_))).collect();
                let t = RowTract { blob, tract };
                (
                    Request::CopyTractChanges { row, row_version: version, tract: t, incarnation, have },
                    Some(incarnation),
                )
            }
            None => (Request::CopyTract { row, row_version: version, tract: RowTract { blob, tract } }, None),
        };
        let size = self.parts.store.tract_size();
        let last = match self.parts.peers.call_data(*src, &req).await {
            Ok((Reply::TractCopy { incarnation, bitmap, crcs }, data)) if inc.is_none() => {
                match parse_copy(size, incarnation, &bitmap, crcs, data) {
                    Some(c) => return self.install(version, blob, tract, c).await,
                    None => format!("{src} sent a malformed copy"),
                }
            }
            Ok((Reply::TractChanges { incarnation, bitmap, crcs, holes }, data)) if inc.is_some() => {
                let holes = parse_bitmap(size, &holes);
                match (parse_copy(size, incarnation, &bitmap, crcs, data), holes) {
                    (Some(c), Some(holes)) if Some(incarnation) == inc => {
                        return self.patch(version, blob, tract, c, &holes, &had).await
                    }
                    (Some(c), Some(holes)) if holes.is_empty() => {
                        return self.install(version, blob, tract, c).await
                    }
                    _ => format!("{src} sent malformed changes"),
                }
            }
            Ok((other, _)) => format!("{src} answered a copy with {other:?}"),
            Err(e) => e.to_string(),
        };
        Err(self.not_copied(blob, tract, &last))
    }

    /// Runs `f` under the copy lock of a tract: the lock a copy or repair
    /// holds from the digest it sends to the last chunk it writes. What
    /// `f` does to the tract then happens wholly before or wholly after
    /// any copy of it. The scrubber frees orphans this way (`scrub.rs`):
    /// a delete landing between a repair's digest and its patch would
    /// leave the tract holding only the chunks that differed.
    pub(crate) async fn under_copy_lock<T>(
        &self,
        blob: BlobId,
        tract: TractNo,
        f: impl std::future::Future<Output = T>,
    ) -> T {
        let key = (blob, tract);
        let l = self.fills.tract_lock(key);
        let r = {
            let _g = l.lock().await;
            f.await
        };
        self.fills.release_lock(key, &l);
        r
    }

    fn not_copied(&self, blob: BlobId, tract: TractNo, why: &str) -> ErrorReply {
        ErrorReply::new(
            ErrorCode::NotReady,
            format!("tract {tract} of {blob} is being copied to this server and no complete replica gave it ({why}); retry"),
        )
    }

    /// The incarnation and digest of a tract held here, if any.
    async fn held(&self, blob: BlobId, tract: TractNo) -> Option<(Incarnation, Vec<ChunkState>)> {
        let inc = self.parts.store.incarnation_of(blob, tract).await?;
        match self.parts.store.digest(blob, inc, tract).await {
            Ok(have) if !have.is_empty() => Some((inc, have)),
            _ => None,
        }
    }

    /// Brings a tract held here at `c.incarnation` to the source's state:
    /// writes the chunks that differed, unmaps those the source does not
    /// hold, then makes it durable. Every other chunk was the same on both
    /// sides when the source compared them; a write landing on one since
    /// is on its way here too, and waits for this repair (the copy lock).
    async fn patch(
        &self,
        version: u64,
        blob: BlobId,
        tract: TractNo,
        c: Copied,
        holes: &[(u32, u32)],
        had: &[bool],
    ) -> Result<(), ErrorReply> {
        // Chunks that held data here and were neither sent nor unmapped:
        // what a whole copy would have moved again for nothing.
        let mut kept = had.to_vec();
        for (first, n) in c.runs.iter().chain(holes) {
            for i in *first..first + n {
                if let Some(k) = kept.get_mut(i as usize) {
                    *k = false;
                }
            }
        }
        let same = kept.iter().filter(|k| **k).count() as u64 * CHUNK_SIZE as u64;
        // The chunks not sent are kept from what is here: it must still be
        // the tract that was compared (the copy lock keeps writes, trims
        // and deletes of it waiting, the scrubber's orphan frees included:
        // `under_copy_lock`).
        if self.parts.store.incarnation_of(blob, tract).await != Some(c.incarnation) {
            return Err(self.not_copied(blob, tract, "the tract changed here while it was compared"));
        }
        self.pace(c.data.len() as u64).await;
        self.write_runs(version, blob, tract, &c).await?;
        for (first, n) in holes {
            self.parts
                .store
                .trim(blob, c.incarnation, tract, first * CHUNK_SIZE, n * CHUNK_SIZE, crate::store::ALWAYS)
                .await
                .map_err(store_err)?;
        }
        self.parts.store.sync().await.map_err(store_err)?;
        self.fills.bytes_done.fetch_add(c.data.len() as u64, Ordering::Relaxed);
        self.fills.bytes_unchanged.fetch_add(same, Ordering::Relaxed);
        self.fills.tracts_repaired.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes a copy's runs of chunks (not yet durable).
    async fn write_runs(
        &self,
        version: u64,
        blob: BlobId,
        tract: TractNo,
        c: &Copied,
    ) -> Result<(), ErrorReply> {
        let mut at = 0usize;
        for (first, n) in &c.runs {
            let (n, chunk) = (*n as usize, CHUNK_SIZE as usize);
            let data = c.data.slice(at * chunk..(at + n) * chunk);
            let crcs = &c.crcs[at..at + n];
            let w = TractWrite {
                blob,
                incarnation: c.incarnation,
                tract,
                version,
                offset: first * CHUNK_SIZE,
                data,
                crcs,
                durability: Durability::Cached,
            };
            self.parts.store.write_with(w, crate::store::ALWAYS).await.map_err(store_err)?;
            at += n;
        }
        Ok(())
    }

    /// Replaces this server's copy of a tract with `c`, durably.
    async fn install(&self, version: u64, blob: BlobId, tract: TractNo, c: Copied) -> Result<(), ErrorReply> {
        // Whatever was here is stale: this server may have held the row
        // long ago, or a copy was cut off by a restart.
        if let Some(old) = self.parts.store.incarnation_of(blob, tract).await {
            self.parts.store.delete(blob, old, tract).await.map_err(store_err)?;
        }
        if c.incarnation == 0 || c.runs.is_empty() {
            if tract.is_meta() {
                self.parts.metas.set(blob, None);
            }
            return Ok(());
        }
        self.pace(c.data.len() as u64).await;
        self.write_runs(version, blob, tract, &c).await?;
        self.parts.store.sync().await.map_err(store_err)?;
        if tract.is_meta() {
            match decode_meta(&c.data) {
                Some(m) if m.blob == blob && m.incarnation == c.incarnation => {
                    self.parts.metas.set(m.blob, Some(m))
                }
                _ => tracing::warn!(%blob, "copied metadata tract holds no valid record"),
            }
        }
        self.fills.bytes_done.fetch_add(c.data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Holds copying to `fill_bandwidth`: each copy books its bytes on one
    /// timeline and waits until its turn ends, so parallel copies share it.
    async fn pace(&self, len: u64) {
        if self.bandwidth == 0 {
            return;
        }
        let now = self.parts.env.now();
        let end = {
            let mut p = lock(&self.fills.paced_until);
            let start = p.map_or(now, |t| t.max(now));
            let end = start + Duration::from_secs_f64(len as f64 / self.bandwidth as f64);
            *p = Some(end);
            end
        };
        if end > now {
            self.parts.env.sleep(end - now).await;
        }
    }

    /// Copies every row being filled here, all rows at once sharing
    /// `COPY_PARALLEL`, until the server stops. Woken by new assignments;
    /// rows that fail (a source down, a version change under way) are tried
    /// again shortly.
    pub async fn fill_loop(self: Arc<Self>, mut shutdown: Shutdown) {
        loop {
            let todo: Vec<u32> = {
                let rows = lock(&self.fills.rows);
                let mut v: Vec<u32> = rows.iter().filter(|(_, f)| !f.complete).map(|(r, _)| *r).collect();
                v.sort_unstable();
                v
            };
            let results = tokio::select! {
                biased;
                _ = shutdown.wait() => return,
                r = futures::future::join_all(todo.iter().map(|row| self.fill_row(*row))) => r,
            };
            let mut failed = false;
            for (row, r) in todo.iter().zip(results) {
                if let Err(e) = r {
                    tracing::warn!(row, error = %e, "copying a row failed; retrying");
                    failed = true;
                }
            }
            let pause = if failed { RETRY_PAUSE } else { Duration::from_secs(5) };
            tokio::select! {
                biased;
                _ = shutdown.wait() => return,
                _ = self.fills.wake.notified() => {}
                _ = self.parts.env.sleep(pause) => {}
            }
        }
    }

    async fn fill_row(&self, row: u32) -> Result<(), ErrorReply> {
        let Some((version, sources)) =
            lock(&self.fills.rows).get(&row).filter(|f| !f.complete).map(|f| (f.version, f.sources.clone()))
        else {
            return Ok(());
        };
        let started = self.parts.env.now();
        let tracts = self.list_row(row, version, &sources).await?;
        if let Some(f) = lock(&self.fills.rows).get_mut(&row) {
            f.listed = tracts.len() as u64;
        }
        let bytes_before = self.fills.bytes_done.load(Ordering::Relaxed);
        let keys: Vec<(BlobId, TractNo)> = tracts.iter().map(|t| (t.blob, t.tract)).collect();
        let copy = |(blob, tract): (BlobId, TractNo)| async move {
            // Never closed, so this waits for a slot and never fails.
            let _slot = self
                .fills
                .copy_slots
                .0
                .acquire()
                .await
                .map_err(|_| ErrorReply::new(ErrorCode::Internal, "the copy slots were closed"))?;
            self.ensure_copied(blob, tract).await
        };
        let results: Vec<Result<(), ErrorReply>> =
            futures::stream::iter(keys).map(copy).buffer_unordered(COPY_PARALLEL).collect().await;
        if let Some(e) = results.into_iter().find_map(|r| r.err()) {
            return Err(e);
        }
        self.purge_uncopied(row).await?;
        let mut rows = lock(&self.fills.rows);
        let Some(f) = rows.get_mut(&row) else { return Ok(()) };
        // Listed under another version: the row changed meanwhile (a source
        // may have been replaced); list again to be sure nothing is missed.
        if f.version != version {
            return Err(ErrorReply::new(ErrorCode::StaleVersion, "row changed while copying"));
        }
        f.complete = true;
        // Rows are copied concurrently: this counts every row's bytes.
        let bytes_all_rows = self.fills.bytes_done.load(Ordering::Relaxed) - bytes_before;
        let secs = self.parts.env.now().duration_since(started).as_secs_f64();
        tracing::info!(row, version, tracts = tracts.len(), bytes_all_rows, secs, "row copied");
        Ok(())
    }

    /// Frees every tract of `row` held here that was neither copied nor
    /// written since this server joined the row: the source did not list
    /// it, so it is left from long ago (this server held the row before it
    /// was declared dead, or before its copy of the row was cut off) and
    /// may hold bytes since trimmed or deleted. Once the row is complete,
    /// reads are served without asking whether a tract was copied, so such
    /// a tract must not outlive the fill.
    async fn purge_uncopied(&self, row: u32) -> Result<(), ErrorReply> {
        let layout = self.parts.rows.layout();
        let stale: Vec<(BlobId, TractNo)> = self
            .parts
            .store
            .tracts()
            .into_iter()
            .filter(|(b, t)| layout.locate(*b, *t) == Some(row))
            .filter(|k| self.copy_pending(k.0, k.1).is_some())
            .collect();
        for key in stale {
            let l = self.fills.tract_lock(key);
            let r = {
                let _g = l.lock().await;
                // A write may have copied it meanwhile (under this lock).
                match self.copy_pending(key.0, key.1) {
                    None => Ok(()),
                    Some(_) => match self.parts.store.incarnation_of(key.0, key.1).await {
                        Some(inc) => {
                            tracing::info!(blob = %key.0, tract = %key.1, row, "freeing a stale tract the source does not hold");
                            if key.1.is_meta() {
                                self.parts.metas.set(key.0, None);
                            }
                            self.parts.store.delete(key.0, inc, key.1).await.map(|_| ()).map_err(store_err)
                        }
                        None => Ok(()),
                    },
                }
            };
            self.fills.release_lock(key, &l);
            r?;
        }
        Ok(())
    }

    async fn list_row(&self, row: u32, version: u64, sources: &[TsId]) -> Result<Vec<RowTract>, ErrorReply> {
        // The first complete member only (see `RowFill::sources`).
        let Some(src) = sources.first() else {
            return Err(ErrorReply::new(
                ErrorCode::NotReady,
                format!("row {row} has no complete member to copy from"),
            ));
        };
        let mut out = Vec::new();
        let mut after = None;
        loop {
            let req = Request::ListRowTracts { row, row_version: version, after };
            let last = match self.parts.peers.call_data(*src, &req).await {
                Ok((Reply::RowTracts { tracts, more }, _)) => {
                    after = tracts.last().copied();
                    out.extend(tracts);
                    if !more || after.is_none() {
                        return Ok(out);
                    }
                    continue;
                }
                Ok((other, _)) => format!("{src} answered a listing with {other:?}"),
                Err(e) => e.to_string(),
            };
            return Err(ErrorReply::new(
                ErrorCode::NotReady,
                format!("cannot list row {row} on {src}: {last}"),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_proto::AssignedRow;

    const ME: TsId = TsId(9);

    fn assignment(rows: &[(u32, u64)]) -> Assignment {
        Assignment {
            cluster_id: 1,
            tract_size: 16 << 10,
            replication: 3,
            tlt_len: 8,
            tlt_version: rows.iter().map(|r| r.1).max().unwrap_or(1),
            rows: rows
                .iter()
                .map(|&(row, version)| AssignedRow {
                    row,
                    version,
                    members: vec![TsId(1), TsId(2), ME],
                    filling: vec![ME],
                    pending: Vec::new(),
                })
                .collect(),
            sections: Vec::new(),
        }
    }

    /// Marks `row` completely copied, as `fill_row` does.
    fn copy_all(f: &Fills, row: u32) {
        let mut rows = lock(&f.rows);
        let r = rows.get_mut(&row).expect("row being filled");
        r.done.insert((BlobId(7), TractNo(row as i64)));
        r.complete = true;
    }

    #[test]
    fn a_copy_survives_an_assignment_of_the_same_version() {
        let f = Fills::default();
        f.update(ME, &assignment(&[(3, 10)]));
        copy_all(&f, 3);
        f.update(ME, &assignment(&[(3, 10), (4, 11)]));
        let (filled, progress) = f.report();
        assert_eq!(filled, vec![RowRef { row: 3, version: 10 }]);
        assert_eq!(progress.rows, 1, "row 4 is still being copied");
    }

    /// Seed 150 of blob-sim (3-way, 8+2 tractservers, with flow control):
    /// a server filling a row copied all of it, was cut off while the
    /// metadata server gave the row to another and writes went on without
    /// it, then was given the row back under a newer version. Keeping the
    /// old copy reported the row filled at once, and the stale server
    /// became its first member: a reconciliation copied its old chunk over
    /// an acknowledged write.
    #[test]
    fn a_new_version_of_a_row_starts_its_copy_over() {
        let f = Fills::default();
        f.update(ME, &assignment(&[(3, 10)]));
        copy_all(&f, 3);
        assert_eq!(f.report().0, vec![RowRef { row: 3, version: 10 }]);
        f.update(ME, &assignment(&[(3, 14)]));
        let (filled, progress) = f.report();
        assert!(filled.is_empty(), "a copy made under version 10 is not one of version 14: {filled:?}");
        assert_eq!((progress.rows, progress.tracts_done), (1, 0));
        assert!(lock(&f.rows)[&3].done.is_empty());
    }

    #[test]
    fn a_row_no_longer_filled_is_forgotten() {
        let f = Fills::default();
        f.update(ME, &assignment(&[(3, 10), (4, 10)]));
        copy_all(&f, 3);
        f.update(ME, &assignment(&[(4, 10)]));
        assert!(!lock(&f.rows).contains_key(&3));
        assert!(f.any.load(Ordering::Acquire));
        f.update(ME, &assignment(&[]));
        assert!(!f.any.load(Ordering::Acquire));
    }

    #[test]
    fn bitmaps_round_trip_as_runs() {
        let size = 64 * CHUNK_SIZE;
        let set = [0u32, 1, 2, 9, 33, 34, 63];
        let b = source::to_bitmap(64, &set);
        assert_eq!(parse_bitmap(size, &b), Some(vec![(0, 3), (9, 1), (33, 2), (63, 1)]));
        assert_eq!(parse_bitmap(size, &[]), Some(vec![]));
        // A chunk past the tract, or a bitmap longer than the tract's.
        assert_eq!(parse_bitmap(8 * CHUNK_SIZE - CHUNK_SIZE, &[0x80]), None);
        assert_eq!(parse_bitmap(size, &[0; 9]), None);
    }
}
