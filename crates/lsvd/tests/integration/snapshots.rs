//! Snapshots and clones of LSVD volumes over the in-memory object store
//! (design 0008, "Snapshots and clones"): a snapshot keeps reading the
//! past while its volume is overwritten and cleaned; deleting it lets the
//! cleaner free what only it needed; a clone starts as its base's
//! snapshot and diverges without changing it; what depends on a snapshot
//! keeps it and its volume from being deleted.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use object_store::memory::InMemory;
use object_store::ObjectStore;

use blizzard_env::Env;
use blizzard_lsvd::snapshot::{self, LsvdSnapshot};
use blizzard_lsvd::volume::{self, Config};
use blizzard_lsvd::{LsvdError, LsvdVolume, Planted, Store};

const SIZE: u64 = 4 << 20;

fn cfg() -> Config {
    Config {
        cache_bytes: 4 << 20,
        destage_delay: Duration::from_secs(3600),
        checkpoint_every: 2,
        retry_pause: Duration::from_millis(10),
        // Cleaning as soon as there is anything to clean.
        gc_min_bytes: 256 << 10,
        ..Config::default()
    }
}

/// 64 KiB blocks that say which write made them.
fn block(id: u64) -> Bytes {
    Bytes::from((0..65536u64).map(|i| (id.wrapping_mul(31) ^ (i / 8)) as u8).collect::<Vec<u8>>())
}

/// Writes all 64 blocks of the volume's first 4 MiB, `round` telling the
/// writes apart, and returns what the volume then reads as.
async fn overwrite_all(v: &LsvdVolume, image: &mut [u8], round: u64) {
    for i in 0..64u64 {
        let b = block(round * 1000 + i);
        v.write(i * 65536, b.clone(), false).await.unwrap();
        image[(i * 65536) as usize..((i + 1) * 65536) as usize].copy_from_slice(&b);
    }
    v.drain().await.unwrap();
}

async fn objects_under(mem: &Arc<dyn ObjectStore>, dir: &str) -> usize {
    mem.list(Some(&object_store::path::Path::from(dir))).collect::<Vec<_>>().await.len()
}

async fn new_volume(mem: &Arc<dyn ObjectStore>, prefix: &str, name: &str) -> Store {
    let store = Store::new(mem.clone(), prefix);
    volume::create(&Env::real(), &store, name, SIZE, 256 << 10).await.unwrap();
    store
}

/// Waits until cleaning has nothing left to do (live data at or above 70 %
/// of what it may clean), or fails.
async fn settle(v: &LsvdVolume) {
    let env = Env::real();
    let mut last = (u64::MAX, 0);
    let mut same = 0;
    while same < 20 {
        let i = v.info();
        let now = (i.stored_bytes, i.head);
        same = if now == last { same + 1 } else { 0 };
        last = now;
        env.sleep(Duration::from_millis(10)).await;
    }
}

// A snapshot reads the volume as it was, while the volume is overwritten
// three times over and cleaned; after a reopen that lost the cache the
// snapshots are still there and still read the past. Names are checked,
// and a name is taken once.
#[tokio::test]
async fn a_snapshot_reads_the_past_while_the_volume_moves_on() {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let store = new_volume(&mem, "vols/a", "a").await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), store.clone(), Some("a"), &common::cache_path(&dir), cfg())
        .await
        .unwrap();
    let mut image = vec![0u8; SIZE as usize];
    overwrite_all(&v, &mut image, 1).await;
    // A write still in the journal is in the snapshot too.
    v.write(0, block(77), false).await.unwrap();
    image[..65536].copy_from_slice(&block(77));
    v.snapshot("one").await.unwrap();
    let one = image.clone();
    assert!(matches!(v.snapshot("one").await, Err(LsvdError::InUse(_))), "a name is taken once");
    assert!(matches!(v.snapshot("a/b").await, Err(LsvdError::Invalid(_))));
    overwrite_all(&v, &mut image, 2).await;
    v.snapshot("two").await.unwrap();
    let two = image.clone();
    for round in 3..6 {
        overwrite_all(&v, &mut image, round).await;
    }
    settle(&v).await;
    let deleted_before = v.counts().now().deletes;
    assert!(deleted_before > 0, "cleaning ran and deleted objects");
    for (name, want) in [("one", &one), ("two", &two)] {
        let s = LsvdSnapshot::open(store.clone(), Some("a"), name).await.unwrap();
        assert!(s.read(0, SIZE).await.unwrap()[..] == want[..], "snapshot {name} reads the past");
    }
    assert!(v.read(0, SIZE).await.unwrap()[..] == image[..]);
    assert_eq!(v.snapshots().iter().map(|s| s.0.as_str()).collect::<Vec<_>>(), ["one", "two"]);
    v.close().await.unwrap();
    drop(v);
    std::fs::remove_dir_all(dir.path().join("cache")).unwrap();
    let v = LsvdVolume::open(Env::real(), store.clone(), Some("a"), &common::cache_path(&dir), cfg())
        .await
        .unwrap();
    overwrite_all(&v, &mut image, 9).await;
    settle(&v).await;
    let listed = snapshot::list(&store).await.unwrap();
    assert_eq!(listed.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["one", "two"]);
    for (name, want) in [("one", &one), ("two", &two)] {
        let s = LsvdSnapshot::open(store.clone(), Some("a"), name).await.unwrap();
        assert!(s.read(0, SIZE).await.unwrap()[..] == want[..], "snapshot {name} after a reopen");
    }
    assert!(v.read(0, SIZE).await.unwrap()[..] == image[..]);
    assert!(matches!(
        LsvdSnapshot::open(store.clone(), Some("a"), "three").await,
        Err(LsvdError::NotFound(_))
    ));
}

// Deleting a snapshot deletes its record and checkpoint, and the cleaner
// then frees the objects only it needed.
#[tokio::test]
async fn deleting_a_snapshot_frees_what_only_it_needed() {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let store = new_volume(&mem, "vols/a", "a").await;
    let dir = tempfile::tempdir().unwrap();
    let v =
        LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), cfg()).await.unwrap();
    let mut image = vec![0u8; SIZE as usize];
    overwrite_all(&v, &mut image, 1).await;
    v.snapshot("old").await.unwrap();
    for round in 2..5 {
        overwrite_all(&v, &mut image, round).await;
    }
    settle(&v).await;
    let with = v.info().stored_bytes;
    let objects_with = objects_under(&mem, "vols/a/d").await;
    assert!(with >= 2 * SIZE, "the snapshot's 4 MiB and the volume's: {with}");
    v.delete_snapshot("old").await.unwrap();
    assert!(matches!(v.delete_snapshot("old").await, Err(LsvdError::NotFound(_))));
    assert!(matches!(LsvdSnapshot::open(store.clone(), None, "old").await, Err(LsvdError::NotFound(_))));
    // Cleaning runs after each destaged object.
    overwrite_all(&v, &mut image, 5).await;
    settle(&v).await;
    let without = v.info().stored_bytes;
    assert!(without < with - SIZE / 2, "freed: {with} stored with the snapshot, {without} without");
    assert!(objects_under(&mem, "vols/a/d").await < objects_with);
    assert!(objects_under(&mem, "vols/a/c").await <= 2, "only the newest two checkpoints are left");
    assert!(v.read(0, SIZE).await.unwrap()[..] == image[..]);
}

// The planted bug: a cleaner that ignores snapshots deletes objects a
// snapshot reads, and reading the snapshot then fails (or the writer's
// own assertion would have stopped it: the plant skips that too).
#[tokio::test]
async fn planted_a_cleaner_that_ignores_snapshots_loses_one() {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let store = new_volume(&mem, "vols/a", "a").await;
    let dir = tempfile::tempdir().unwrap();
    let c = Config { planted: Planted::GcIgnoresSnapshots, ..cfg() };
    let v = LsvdVolume::open(Env::real(), store.clone(), None, &common::cache_path(&dir), c).await.unwrap();
    let mut image = vec![0u8; SIZE as usize];
    overwrite_all(&v, &mut image, 1).await;
    v.snapshot("old").await.unwrap();
    for round in 2..5 {
        overwrite_all(&v, &mut image, round).await;
    }
    settle(&v).await;
    let s = LsvdSnapshot::open(store.clone(), None, "old").await.unwrap();
    let e = s.read(0, SIZE).await.unwrap_err();
    assert!(e.to_string().contains("which is gone"), "{e}");
}

// A clone starts as its base's snapshot, diverges without changing it,
// and cleans only its own objects; a clone of a clone reads through both;
// a snapshot a clone reads, and its volume, cannot be deleted until the
// clone is; a deleted clone leaves nothing behind.
#[tokio::test]
async fn a_clone_diverges_from_its_base() {
    let env = Env::real();
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let base = new_volume(&mem, "vols/base", "base").await;
    let dir = tempfile::tempdir().unwrap();
    let cache = |n: &str| dir.path().join(n).join("journal");
    let b = LsvdVolume::open(env.clone(), base.clone(), None, &cache("base"), cfg()).await.unwrap();
    let mut base_img = vec![0u8; SIZE as usize];
    overwrite_all(&b, &mut base_img, 1).await;
    b.snapshot("golden").await.unwrap();
    let golden = base_img.clone();

    let c1 = Store::new(mem.clone(), "vols/c1");
    let d = snapshot::clone_volume(&env, &base, "base", "golden", &c1, "c1").await.unwrap();
    assert_eq!(d.base.len(), 1);
    let e = snapshot::clone_volume(&env, &base, "base", "golden", &c1, "c1").await.unwrap_err();
    assert!(matches!(e, LsvdError::Exists(_)), "a prefix holds one volume: {e}");
    let e = snapshot::clone_volume(&env, &base, "base", "nope", &Store::new(mem.clone(), "vols/x"), "x")
        .await
        .unwrap_err();
    assert!(matches!(e, LsvdError::NotFound(_)), "{e}");
    for nested in ["vols/base/inner", "vols"] {
        let e = snapshot::clone_volume(&env, &base, "base", "golden", &Store::new(mem.clone(), nested), "x")
            .await
            .unwrap_err();
        assert!(matches!(e, LsvdError::Invalid(_)), "{nested}: {e}");
    }
    let base_objects = objects_under(&mem, "vols/base/d").await;

    let v1 = LsvdVolume::open(env.clone(), c1.clone(), Some("c1"), &cache("c1"), cfg()).await.unwrap();
    assert!(v1.read(0, SIZE).await.unwrap()[..] == golden[..], "the clone starts as the snapshot");
    let mut img1 = golden.clone();
    // The clone's writes: half the volume, three times (cleaning runs).
    for round in 10..13 {
        for i in 0..32u64 {
            let blk = block(round * 1000 + i);
            v1.write(i * 65536, blk.clone(), false).await.unwrap();
            img1[(i * 65536) as usize..((i + 1) * 65536) as usize].copy_from_slice(&blk);
        }
        v1.drain().await.unwrap();
    }
    settle(&v1).await;
    assert!(v1.read(0, SIZE).await.unwrap()[..] == img1[..]);
    // The base moves on too; neither sees the other.
    overwrite_all(&b, &mut base_img, 2).await;
    assert!(b.read(0, SIZE).await.unwrap()[..] == base_img[..]);
    assert!(v1.read(0, SIZE).await.unwrap()[..] == img1[..]);
    assert!(objects_under(&mem, "vols/base/d").await >= base_objects, "the clone deleted none of its base's");
    let i1 = v1.info();
    assert!(i1.stored_bytes <= 4 * SIZE / 2, "the clone counts only its own objects: {i1:?}");

    // A clone of the clone.
    v1.snapshot("s").await.unwrap();
    let c2 = Store::new(mem.clone(), "vols/c2");
    let d2 = snapshot::clone_volume(&env, &c1, "c1", "s", &c2, "c2").await.unwrap();
    assert_eq!(d2.base.len(), 2);
    let v2 = LsvdVolume::open(env.clone(), c2.clone(), None, &cache("c2"), cfg()).await.unwrap();
    assert!(v2.read(0, SIZE).await.unwrap()[..] == img1[..]);
    v2.write(SIZE - 65536, block(5), true).await.unwrap();
    v2.drain().await.unwrap();
    let mut img2 = img1.clone();
    img2[(SIZE - 65536) as usize..].copy_from_slice(&block(5));
    assert!(v2.read(0, SIZE).await.unwrap()[..] == img2[..]);
    let listed = snapshot::list(&base).await.unwrap();
    assert_eq!(listed[0].clones, ["c1"]);

    // What a clone reads cannot go.
    let e = b.delete_snapshot("golden").await.unwrap_err();
    assert!(matches!(e, LsvdError::InUse(_)) && e.to_string().contains("c1"), "{e}");
    let e = v1.delete_snapshot("s").await.unwrap_err();
    assert!(e.to_string().contains("c2"), "{e}");
    let (bu, c1u, c2u) = (b.info().uuid, v1.info().uuid, v2.info().uuid);
    for v in [b, v1, v2] {
        v.close().await.unwrap();
    }
    let e = volume::destroy(&base, bu).await.unwrap_err();
    assert!(matches!(e, LsvdError::InUse(_)), "{e}");
    // Reopened from the objects alone, the clone of the clone still reads.
    std::fs::remove_dir_all(dir.path().join("c2")).unwrap();
    let v2 = LsvdVolume::open(env.clone(), c2.clone(), None, &cache("c2"), cfg()).await.unwrap();
    assert!(v2.read(0, SIZE).await.unwrap()[..] == img2[..]);
    v2.close().await.unwrap();
    drop(v2);

    // Deleted in turn, each frees its base's snapshot.
    volume::destroy(&c2, c2u).await.unwrap();
    volume::destroy(&c1, c1u).await.unwrap();
    assert!(snapshot::list(&base).await.unwrap()[0].clones.is_empty());
    let b = LsvdVolume::open(env.clone(), base.clone(), None, &cache("base"), cfg()).await.unwrap();
    b.delete_snapshot("golden").await.unwrap();
    b.close().await.unwrap();
    drop(b);
    volume::destroy(&base, bu).await.unwrap();
    let left = mem.list(None).collect::<Vec<_>>().await;
    assert!(left.is_empty(), "{left:?}");
}
