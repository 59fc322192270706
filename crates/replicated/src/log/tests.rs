//! The durable Raft log's tests (`mod.rs`, `flush.rs`, `read.rs`), with
//! the helpers and in-memory disks that the recovery tests
//! (`tests_recovery.rs`) share.

#[path = "tests_recovery.rs"]
mod recovery;

use super::meta::META_FILE;
use super::segment::SEGMENT_PREFIX;
use super::*;
use crate::codec::tests::log_id;
use crate::types::{Batch, BatchReply, LeaderId, Member, Op, OpKind, SnapshotMeta, StoredMembership};
use blizzard_env::Disks;
use futures::future::BoxFuture;
use futures::{FutureExt, TryStreamExt};
use openraft::storage::{EntryResponder, RaftLogReader, RaftSnapshotBuilder, RaftStateMachine};
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
