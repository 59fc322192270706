//! The recovery case tables of design 0008, one test per row that is not
//! covered elsewhere: each reaches its branch and checks what it does.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use blizzard_env::Env;
use blizzard_lsvd::volume::{self, Config};
use blizzard_lsvd::{LsvdError, LsvdVolume, Store};

const SIZE: u64 = 8 << 20;

fn cfg() -> Config {
    Config {
        cache_bytes: 2 << 20,
        destage_delay: Duration::from_secs(3600),
        // No checkpoints: recovery rolls forward over every object.
        checkpoint_every: u64::MAX,
        ..Config::default()
    }
}

async fn new_volume(name: &str) -> (Arc<dyn ObjectStore>, Store) {
    let mem: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let store = Store::new(mem.clone(), name);
    volume::create(&Env::real(), &store, name, SIZE, 64 << 10).await.unwrap();
    (mem, store)
}

async fn write_some(v: &LsvdVolume, id: u8, n: u64) {
    for i in 0..n {
        v.write(i * 65536, Bytes::from(vec![id; 65536]), false).await.unwrap();
    }
    v.flush().await.unwrap();
}

// A cache file of another volume is refused, naming it.
#[tokio::test]
async fn a_cache_of_another_volume_is_refused() {
    let (_, a) = new_volume("a").await;
    let (_, b) = new_volume("b").await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), a, None, &common::cache_path(&dir), cfg()).await.unwrap();
    v.close().await.unwrap();
    drop(v);
    let e = LsvdVolume::open(Env::real(), b, None, &common::cache_path(&dir), cfg()).await.err().unwrap();
    assert!(e.to_string().contains("belongs to another volume"), "{e}");
}

// A cache older than the object log (a restored copy) is refused, and
// the volume comes back whole once the cache directory is deleted.
#[tokio::test]
async fn a_cache_older_than_the_log_is_refused() {
    let (_, s) = new_volume("a").await;
    let dir = tempfile::tempdir().unwrap();
    let path = common::cache_path(&dir);
    let v = LsvdVolume::open(Env::real(), s.clone(), None, &path, cfg()).await.unwrap();
    write_some(&v, 1, 4).await;
    v.drain().await.unwrap();
    v.close().await.unwrap();
    drop(v);
    let old = dir.path().join("old");
    std::fs::copy(&path, &old).unwrap();
    let v = LsvdVolume::open(Env::real(), s.clone(), None, &path, cfg()).await.unwrap();
    write_some(&v, 2, 8).await;
    v.drain().await.unwrap();
    v.close().await.unwrap();
    drop(v);
    std::fs::copy(&old, &path).unwrap();
    let e = LsvdVolume::open(Env::real(), s.clone(), None, &path, cfg()).await.err().unwrap();
    assert!(e.to_string().contains("older than the volume"), "{e}");
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    let v = LsvdVolume::open(Env::real(), s, None, &path, cfg()).await.unwrap();
    assert_eq!(v.read(0, 8 * 65536).await.unwrap(), Bytes::from(vec![2u8; 8 * 65536]));
}

// A cache file whose header slots were never written (its creation cut
// off) is a new cache, not an error.
#[tokio::test]
async fn a_cache_file_without_headers_is_new() {
    let (_, s) = new_volume("a").await;
    let dir = tempfile::tempdir().unwrap();
    let path = common::cache_path(&dir);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, vec![0u8; 2 << 20]).unwrap();
    let v = LsvdVolume::open(Env::real(), s, None, &path, cfg()).await.unwrap();
    write_some(&v, 3, 2).await;
    assert_eq!(v.read(0, 65536).await.unwrap(), Bytes::from(vec![3u8; 65536]));
}

// A hole in the log followed by later objects is damage, refused (never
// an early end of the log that would drop flushed data silently).
#[tokio::test]
async fn a_hole_in_the_log_is_refused() {
    let (mem, s) = new_volume("a").await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), s.clone(), None, &common::cache_path(&dir), cfg()).await.unwrap();
    for i in 0..4 {
        write_some(&v, i, 2).await;
        v.drain().await.unwrap();
    }
    let head = v.info().head;
    assert!(head >= 4, "{:?}", v.info());
    v.close().await.unwrap();
    drop(v);
    mem.delete(&Path::from(format!("a/d/{:016x}", 2))).await.unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let e = LsvdVolume::open(Env::real(), s, None, &common::cache_path(&d2), cfg()).await.err().unwrap();
    assert!(matches!(e, LsvdError::Corrupt(_)) && e.to_string().contains("hole"), "{e}");
}

// A damaged object (one flipped bit in its header) is refused as damage,
// naming the object.
#[tokio::test]
async fn a_damaged_object_is_refused() {
    let (mem, s) = new_volume("a").await;
    let dir = tempfile::tempdir().unwrap();
    let v = LsvdVolume::open(Env::real(), s.clone(), None, &common::cache_path(&dir), cfg()).await.unwrap();
    write_some(&v, 9, 2).await;
    v.drain().await.unwrap();
    v.close().await.unwrap();
    drop(v);
    let p = Path::from(format!("a/d/{:016x}", 2));
    let mut b = mem.get(&p).await.unwrap().bytes().await.unwrap().to_vec();
    b[100] ^= 4;
    mem.delete(&p).await.unwrap();
    mem.put(&p, Bytes::from(b).into()).await.unwrap();
    let d2 = tempfile::tempdir().unwrap();
    let e = LsvdVolume::open(Env::real(), s, None, &common::cache_path(&d2), cfg()).await.err().unwrap();
    assert!(matches!(e, LsvdError::Corrupt(_)) && e.to_string().contains("object 2"), "{e}");
}
