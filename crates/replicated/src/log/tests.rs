//! The durable Raft log's tests (`mod.rs`, `recover.rs`).

use super::meta::META_FILE;
use super::segment::SEGMENT_PREFIX;
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
        let op = Op { session: index, seq: term, acked_below: 0, kind: OpKind::Update(Bytes::from(bytes)) };
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
    fn open(&self, path: &Path, create_len: Option<u64>) -> BoxFuture<'static, io::Result<Arc<dyn Disk>>> {
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
            let (visible, durable, pending) = (img.visible.clone(), img.durable.clone(), img.pending.clone());
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
    assert_eq!((st.last_purged_log_id, st.last_log_id), (Some(log_id(2, 1, 150)), Some(log_id(2, 1, 150))));
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
    assert!(everything(&mut store).await?[..] == model[start..], "lost synced entries after a second crash");
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
    let e =
        store.append(vec![entry(1, 1, ENTRY_LEN_MAX)], IOFlushed::noop()).await.err().ok_or("accepted")?;
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
        Ok(locked(&self.0).snapshot.clone().map(|meta| openraft::storage::Snapshot { meta, snapshot: () }))
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
