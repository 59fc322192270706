//! LSVD volumes over the in-memory object store with the journal on a
//! real temporary file: the paths between journal, objects and recovery.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::memory::InMemory;
use object_store::{ObjectStore, ObjectStoreExt};

use blizzard_env::Env;
use blizzard_lsvd::objlog;
use blizzard_lsvd::volume::{self, Config};
use blizzard_lsvd::{LsvdError, LsvdVolume, Store};

const SIZE: u64 = 16 << 20;

fn cfg() -> Config {
    Config {
        cache_bytes: 4 << 20,
        destage_delay: Duration::from_secs(3600),
        checkpoint_every: 3,
        retry_pause: Duration::from_millis(10),
        ..Config::default()
    }
}

/// Bytes that say where they belong and which write made them.
fn pattern(id: u64, offset: u64, len: u64) -> Bytes {
    let mut v = vec![0u8; len as usize];
    for (i, c) in v.chunks_mut(8).enumerate() {
        let x = (id << 40) ^ (offset + 8 * i as u64);
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
    Bytes::from(v)
}

struct Model(Vec<u8>);

impl Model {
    fn new() -> Model {
        Model(vec![0; SIZE as usize])
    }
    fn write(&mut self, off: u64, b: &[u8]) {
        self.0[off as usize..off as usize + b.len()].copy_from_slice(b);
    }
    fn trim(&mut self, off: u64, len: u64) {
        self.0[off as usize..(off + len) as usize].fill(0);
    }
}

async fn check_all(v: &LsvdVolume, m: &Model) {
    let got = v.read(0, SIZE).await.unwrap();
    assert!(got[..] == m.0[..], "volume differs from the model");
}

async fn setup() -> (Arc<dyn ObjectStore>, Store) {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let store = Store::new(mem.clone(), "vols/a");
    volume::create(&Env::real(), &store, "a", SIZE, 256 << 10).await.unwrap();
    (mem, store)
}

/// A mixed workload: overlapping writes of 4 KiB to 1 MiB and trims.
async fn workload(v: &LsvdVolume, m: &mut Model, first_id: u64, n: u64) {
    for i in 0..n {
        let id = first_id + i;
        let off = (id * 7919 % 1000) * 8192;
        let len = [4096u64, 16384, 65536, 1 << 20][(id % 4) as usize].min(SIZE - off);
        if id.is_multiple_of(9) {
            v.trim(off, len).await.unwrap();
            m.trim(off, len);
        } else {
            let b = pattern(id, off, len);
            v.write(off, b.clone(), false).await.unwrap();
            m.write(off, &b);
        }
    }
}

// Data reads back from the journal, then from objects after destaging,
// and after a reopen whose cache was deleted it still reads back, all of
// it from the object store.
#[tokio::test]
async fn writes_read_back_from_the_journal_and_from_objects() {
    let (_, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), store.clone(), Some("a"), &common::cache_path(&dir), cfg())
        .await
        .unwrap();
    let mut m = Model::new();
    workload(&v, &mut m, 1, 60).await;
    check_all(&v, &m).await;
    v.drain().await.unwrap();
    let info = v.info();
    assert_eq!(info.dirty_bytes, 0);
    assert!(info.objects > 3, "several objects of 256 KiB: {info:?}");
    check_all(&v, &m).await;
    v.close().await.unwrap();
    drop(v);
    std::fs::remove_dir_all(dir.path().join("cache")).unwrap();
    let v = LsvdVolume::open(Env::real(), store, Some("a"), &common::cache_path(&dir), cfg()).await.unwrap();
    assert!(v.info().recovered_checkpoint > 0, "checkpoints every 3 objects: {:?}", v.info());
    check_all(&v, &m).await;
}

// A restart replays the journal: writes never destaged are there after a
// clean close and after the process drops the volume without one.
#[tokio::test]
async fn restart_replays_the_journal() {
    let (_, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let path = common::cache_path(&dir);
    let mut m = Model::new();
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &path, cfg()).await.unwrap();
    workload(&v, &mut m, 1, 20).await;
    v.close().await.unwrap();
    drop(v);
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &path, cfg()).await.unwrap();
    // The 4 MiB cache filled up and destaged some; the rest is replayed.
    assert!(v.info().replayed > 0, "{:?}", v.info());
    check_all(&v, &m).await;
    workload(&v, &mut m, 100, 20).await;
    drop(v); // no close: the journal file holds what was written
    let v = LsvdVolume::open(Env::real(), store, None, &path, cfg()).await.unwrap();
    check_all(&v, &m).await;
}

// Losing the cache loses only what was not destaged: the volume comes back
// as the destaged prefix.
#[tokio::test]
async fn a_lost_cache_leaves_the_destaged_prefix() {
    let (_, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let v =
        LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), cfg()).await.unwrap();
    let mut m = Model::new();
    workload(&v, &mut m, 1, 30).await;
    v.drain().await.unwrap();
    let destaged = Model(m.0.clone());
    workload(&v, &mut m, 200, 10).await;
    assert!(v.info().dirty_bytes > 0);
    drop(v);
    std::fs::remove_dir_all(dir.path().join("cache")).unwrap();
    let v = LsvdVolume::open(Env::real(), store, None, &common::cache_path(&dir), cfg()).await.unwrap();
    check_all(&v, &destaged).await;
}

// A second writer takes the log over: the first one's next object is
// refused by the store and it stops with a clear error; the second reads
// what the first destaged.
#[tokio::test]
async fn a_second_writer_fences_the_first() {
    let (_, store) = setup().await;
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a =
        LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&d1), cfg()).await.unwrap();
    let mut m = Model::new();
    workload(&a, &mut m, 1, 10).await;
    a.drain().await.unwrap();
    let b = LsvdVolume::open(Env::real(), store, None, &common::cache_path(&d2), cfg()).await.unwrap();
    check_all(&b, &m).await;
    a.write(0, pattern(999, 0, 4096), false).await.unwrap();
    let e = a.drain().await.unwrap_err();
    assert!(e.to_string().contains("took over"), "{e}");
    assert!(a.write(4096, pattern(1000, 4096, 4096), false).await.is_err(), "a fenced volume stays failed");
    check_all(&b, &m).await;
}

// Two openers that recovered the same log race for the claim: one wins,
// the other is refused with `Held`.
#[tokio::test]
async fn the_claim_race_has_one_winner() {
    let (_, store) = setup().await;
    let mut r1 = objlog::recover(store.clone(), None, None).await.unwrap();
    let mut r2 = objlog::recover(store, None, None).await.unwrap();
    assert_eq!(objlog::claim(&r1.log, &mut r1.state, 1).await.unwrap(), 1);
    match objlog::claim(&r2.log, &mut r2.state, 2).await {
        Err(LsvdError::Held { seq: 1, .. }) => {}
        other => panic!("expected Held at 1, got {:?}", other.map(|_| ())),
    }
}

// A damaged newest checkpoint is skipped: recovery starts from the one
// before and rolls forward over the objects, losing nothing.
#[tokio::test]
async fn a_damaged_checkpoint_falls_back() {
    let (mem, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let v =
        LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), cfg()).await.unwrap();
    let mut m = Model::new();
    workload(&v, &mut m, 1, 60).await;
    v.drain().await.unwrap();
    let head = v.info().head;
    v.close().await.unwrap();
    drop(v);
    // Garbage where the newest checkpoint would be.
    let path = object_store::path::Path::from(format!("vols/a/c/{head:016x}"));
    mem.put(&path, Bytes::from_static(b"not a checkpoint").into()).await.unwrap();
    std::fs::remove_dir_all(dir.path().join("cache")).unwrap();
    let v = LsvdVolume::open(Env::real(), store, None, &common::cache_path(&dir), cfg()).await.unwrap();
    assert!(v.info().recovered_checkpoint < head);
    check_all(&v, &m).await;
}

// A prefix that holds a volume refuses a second create, and an open under
// another name is refused naming both.
#[tokio::test]
async fn a_prefix_holds_one_volume() {
    let (_, store) = setup().await;
    let e = volume::create(&Env::real(), &store, "b", SIZE, 1 << 20).await.unwrap_err();
    assert!(matches!(e, LsvdError::Exists(_)), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let e = LsvdVolume::open(Env::real(), store, Some("b"), &common::cache_path(&dir), cfg())
        .await
        .err()
        .unwrap();
    assert!(matches!(e, LsvdError::OtherVolume { .. }), "{e}");
}

// Cleaning: after the same range is overwritten many times, live data is
// brought back above the threshold by rewriting and deleting objects, and
// the data reads back, also from the object store alone.
#[tokio::test]
async fn cleaning_frees_objects_and_keeps_data() {
    let (mem, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let c = Config { gc_min_bytes: 512 << 10, ..cfg() };
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), c.clone())
        .await
        .unwrap();
    let mut m = Model::new();
    for round in 0..12u64 {
        for i in 0..16u64 {
            let (off, id) = (i * 65536, round * 100 + i);
            let b = pattern(id, off, 65536);
            v.write(off, b.clone(), false).await.unwrap();
            m.write(off, &b);
        }
        v.drain().await.unwrap();
    }
    let env = Env::real();
    let mut waited = 0;
    loop {
        let i = v.info();
        if (i.live_bytes as f64) >= 0.7 * i.stored_bytes as f64 {
            break;
        }
        waited += 1;
        assert!(waited < 3000, "cleaning never brought live data above 70%: {i:?}");
        env.sleep(Duration::from_millis(10)).await;
    }
    check_all(&v, &m).await;
    let stored =
        mem.list(Some(&object_store::path::Path::from("vols/a/d"))).collect::<Vec<_>>().await.len() as u64;
    assert!(stored < v.info().head, "cleaned objects deleted: {stored} of {} left", v.info().head);
    v.close().await.unwrap();
    drop(v);
    let d2 = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), store, None, &common::cache_path(&d2), c).await.unwrap();
    check_all(&v, &m).await;
}

// Defragmentation while cleaning (§4.6): a range written sequentially,
// then every other 4 KiB of it again, is in 256 map extents; cleaning
// (here until live data is 95 % of what is stored) plugs the 4 KiB holes
// between the pieces it copies, and the map ends at most half as large as
// the same run's without plugging. The data is exact either way, also
// from the object store alone.
#[tokio::test]
async fn cleaning_plugs_small_holes() {
    let mut extents = Vec::new();
    for hole_max in [8u64 << 10, 0] {
        let (_, store) = setup().await;
        let dir = tempfile::tempdir().unwrap();
        let c = Config {
            gc_min_bytes: 256 << 10,
            gc_live_ratio: 0.95,
            checkpoint_every: 1,
            defrag_hole_max: hole_max,
            ..cfg()
        };
        let v =
            LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), c).await.unwrap();
        let mut m = Model::new();
        let b = pattern(1, 0, 1 << 20);
        v.write(0, b.clone(), false).await.unwrap();
        m.write(0, &b);
        v.drain().await.unwrap();
        for i in 0..128u64 {
            let b = pattern(2 + i, i * 8192, 4096);
            v.write(i * 8192, b.clone(), false).await.unwrap();
            m.write(i * 8192, &b);
        }
        v.drain().await.unwrap();
        let env = Env::real();
        let mut waited = 0;
        let mut last = (0, 0);
        let mut same = 0;
        // Until cleaning has stopped for a while.
        while same < 30 {
            let i = v.info();
            same = if (i.head, i.stored_bytes) == last { same + 1 } else { 0 };
            last = (i.head, i.stored_bytes);
            waited += 1;
            assert!(waited < 3000, "cleaning never settled: {i:?}");
            env.sleep(Duration::from_millis(10)).await;
        }
        check_all(&v, &m).await;
        extents.push(v.info().map_extents);
        v.close().await.unwrap();
        drop(v);
        let d2 = tempfile::tempdir().unwrap();
        let v = LsvdVolume::open(Env::real(), store, None, &common::cache_path(&d2), cfg()).await.unwrap();
        check_all(&v, &m).await;
    }
    let (plugged, not) = (extents[0], extents[1]);
    assert!(not >= 200, "without plugging the range stays in pieces: {not}");
    eprintln!("map extents after cleaning: {plugged} with plugging, {not} without");
    assert!(plugged * 2 <= not, "plugging halves the map at least: {plugged} extents against {not}");
}

// What `volume info` and `volume delete` of an S3 volume rest on: the
// allocation runs follow the journal, then the objects (trims are holes);
// `inspect` reads the log without disturbing its writer; `destroy` deletes
// every object, descriptor last, and refuses a prefix holding another
// volume.
#[tokio::test]
async fn allocation_inspect_and_destroy() {
    let (mem, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), store.clone(), Some("a"), &common::cache_path(&dir), cfg())
        .await
        .unwrap();
    v.write(0, pattern(1, 0, 65536), false).await.unwrap();
    v.trim(4096, 8192).await.unwrap();
    v.drain().await.unwrap();
    v.write(1 << 20, pattern(2, 1 << 20, 4096), false).await.unwrap(); // journal only
    v.trim(0, 512).await.unwrap(); // journal trim over an object's data
    let want = vec![(512, false), (3584, true), (8192, false), (65536 - 12288, true)];
    assert_eq!(v.allocation(0, 65536).unwrap(), want);
    assert_eq!(
        v.allocation(65536, (1 << 20) - 65536 + 8192).unwrap(),
        vec![((1 << 20) - 65536, false), (4096, true), (4096, false)]
    );
    assert!(v.allocation(SIZE - 512, 1024).is_err(), "past the end");

    let s = volume::inspect(&store, Some("a")).await.unwrap();
    assert_eq!(s.head, v.info().head, "{s:?}");
    assert!(s.objects >= 1 && s.stored_bytes >= 65536 - 8192, "{s:?}");
    assert!(s.newest_object_secs.is_some());
    assert!(matches!(volume::inspect(&store, Some("b")).await, Err(LsvdError::OtherVolume { .. })));
    let uuid = v.info().uuid;
    v.close().await.unwrap();
    drop(v);

    let e = volume::destroy(&store, uuid ^ 1).await.unwrap_err();
    assert!(matches!(e, LsvdError::OtherVolume { .. }), "{e}");
    assert!(volume::destroy(&store, uuid).await.unwrap() >= 3, "claim, data object, descriptor");
    assert!(!volume::holds_objects(&store).await.unwrap());
    let left = mem.list(Some(&object_store::path::Path::from("vols/a"))).collect::<Vec<_>>().await;
    assert!(left.is_empty(), "{left:?}");
    assert!(matches!(volume::inspect(&store, None).await, Err(LsvdError::NotFound(_))));
    // A second delete finds nothing and is not an error.
    assert_eq!(volume::destroy(&store, uuid).await.unwrap(), 0);
}

// The read cache: data read from objects a second time costs no request;
// a cache smaller than the data evicts and still reads back exactly; a
// cache file overwritten with garbage is caught by the objects' CRCs and
// read from the store again; a deleted cache file starts empty.
#[tokio::test]
async fn the_read_cache_saves_requests_and_never_serves_bad_bytes() {
    let (_, store) = setup().await;
    let dir = tempfile::tempdir().unwrap();
    let path = common::cache_path(&dir);
    let cached = || Config { read_cache_bytes: 1 << 20, ..cfg() };
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &path, cached()).await.unwrap();
    let mut m = Model::new();
    workload(&v, &mut m, 1, 40).await;
    v.drain().await.unwrap();
    v.close().await.unwrap();
    drop(v);
    // Reopened: everything is in objects, nothing in the journal.
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &path, cached()).await.unwrap();
    let gets = || v.counts().now().gets;
    // Written by write 3 (1 MiB at 757 * 8 KiB) and trimmed by none.
    let (off, len) = (757 * 8192, 200 << 10);
    let before = gets();
    let a = v.read(off, len).await.unwrap();
    assert_eq!(a[..], m.0[off as usize..(off + len) as usize]);
    let fetched = gets() - before;
    assert!(fetched >= 1, "the first read fetches");
    let before = gets();
    let b = v.read(off + 4096, 8192).await.unwrap();
    assert_eq!(b[..], m.0[off as usize + 4096..off as usize + 4096 + 8192]);
    assert_eq!(gets(), before, "a read of cached lines sends no request");
    let stats = v.info().read_cache;
    assert!(stats.hits >= 1 && stats.misses >= 1 && stats.lines >= 1, "{stats:?}");
    assert_eq!(stats.capacity_lines, 16);
    // The whole volume through 16 lines of cache, twice: evictions.
    check_all(&v, &m).await;
    check_all(&v, &m).await;
    assert_eq!(v.info().read_cache.lines, 16);
    // Garbage over every cached line: caught, fetched again, still exact.
    let want = &m.0[off as usize..(off + len) as usize];
    assert_eq!(v.read(off, len).await.unwrap()[..], want[..]);
    let rc = dir.path().join("cache").join(volume::READ_CACHE_FILE);
    let n = std::fs::metadata(&rc).unwrap().len() as usize;
    std::fs::write(&rc, vec![0x5a; n]).unwrap();
    let before = gets();
    assert_eq!(v.read(off, len).await.unwrap()[..], want[..]);
    assert!(gets() > before, "bad lines are fetched again");
    assert!(v.info().read_cache.bad >= 1, "{:?}", v.info().read_cache);
    check_all(&v, &m).await;
    v.close().await.unwrap();
    drop(v);
    // A deleted cache file: the volume opens with an empty one.
    std::fs::remove_file(&rc).unwrap();
    let v = LsvdVolume::open(Env::real(), store, None, &path, cached()).await.unwrap();
    assert_eq!(v.info().read_cache.lines, 0);
    check_all(&v, &m).await;
}
