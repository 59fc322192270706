//! Snapshots of volumes in the blob store (design 0011, issue 57) on a
//! real cluster, in every commit mode at 1- and 2-way replication: each
//! snapshot reads exactly what the volume held when it was taken, while
//! the volume goes on being written (unaligned writes, trims and zeroes
//! over chunks an older layer holds), across a close and reopen; and the
//! space each holds alone is what its layer's overwritten chunks take.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, RngCore, SeedableRng};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_volume::{manage, CommitMode, FlushPolicy, Volume, VolumeError, VolumeSpec};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const SIZE: u64 = 8 << 20;

async fn cluster(dir: &tempfile::TempDir) -> Cluster {
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 4;
    cfg.replication = 2;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 96 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    Cluster::start(Env::real(), cfg).await.unwrap()
}

fn spec(name: &str, mode: CommitMode, replication: u8) -> VolumeSpec {
    let mut s = VolumeSpec::new(name, SIZE);
    s.mode = mode;
    s.flush = FlushPolicy::Durable;
    s.replication = replication;
    s.block_size = Some(4096);
    s.segment_tracts = 8;
    s
}

/// A few random changes to `v` and to `model`: writes at any byte offset
/// (whole chunks, sectors, single bytes), trims and zeroes.
async fn churn(v: &Volume, model: &mut [u8], rng: &mut rand::rngs::StdRng, ops: usize) -> R {
    for _ in 0..ops {
        let kind = rng.random_range(0..10);
        let (off, len) = match rng.random_range(0..3) {
            0 => {
                let c = rng.random_range(0..SIZE / 4096 - 16);
                (c * 4096, rng.random_range(1..16u64) * 4096)
            }
            1 => {
                let s = rng.random_range(0..SIZE / 512 - 64);
                (s * 512, rng.random_range(1..64u64) * 512)
            }
            _ => (rng.random_range(0..SIZE - 20_000), rng.random_range(1..20_000u64)),
        };
        let range = off as usize..(off + len) as usize;
        match kind {
            0 => {
                v.trim(off, len).await?;
                model[range].fill(0);
            }
            1 => {
                v.write_zeroes(off, len, false).await?;
                model[range].fill(0);
            }
            _ => {
                let mut b = vec![0u8; len as usize];
                rng.fill_bytes(&mut b);
                v.write(off, Bytes::from(b.clone()), false).await?;
                model[range].copy_from_slice(&b);
            }
        }
    }
    Ok(())
}

async fn same(v: &Volume, model: &[u8], what: &str) -> R {
    let got = v.read(0, SIZE).await?;
    if let Some(i) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} reads {} where {} was written", got[i], model[i]);
    }
    Ok(())
}

async fn snapshots_in(mode: CommitMode, replication: u8) -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    let name = format!("v-{}", mode.name());
    let mut rng = rand::rngs::StdRng::seed_from_u64(57 + mode as u64 * 10 + replication as u64);
    let v = manage::create(env.clone(), &client, &spec(&name, mode, replication)).await?;
    let mut model = vec![0u8; SIZE as usize];
    // A volume written all over, then three snapshots with changes between.
    let mut all = vec![0u8; SIZE as usize];
    rng.fill_bytes(&mut all);
    v.write(0, Bytes::from(all.clone()), false).await?;
    model.copy_from_slice(&all);
    let mut taken: Vec<(String, Vec<u8>)> = Vec::new();
    for s in ["one", "two", "three"] {
        churn(&v, &mut model, &mut rng, 40).await?;
        // Not flushed first: the snapshot makes what was acknowledged durable.
        v.snapshot(s).await?;
        taken.push((s.to_string(), model.clone()));
    }
    let dup = v.snapshot("two").await;
    assert!(matches!(dup, Err(VolumeError::Exists(_))), "{dup:?}");
    churn(&v, &mut model, &mut rng, 60).await?;
    same(&v, &model, "the volume").await?;
    for (s, at) in &taken {
        let snap = manage::open_snapshot(&client, &name, s).await?;
        assert_eq!(snap.size(), SIZE);
        assert!(snap.write(0, Bytes::from_static(b"x"), false).await.is_err(), "a snapshot is read-only");
        same(&snap, at, &format!("{name}@{s} while the volume is open")).await?;
    }
    // Closed and opened again: the head's chunks are asked of the
    // tractservers, the frozen layers read from their records.
    v.close().await?;
    let v = manage::open(env.clone(), &client, &name).await?;
    same(&v, &model, "the volume reopened").await?;
    churn(&v, &mut model, &mut rng, 40).await?;
    v.snapshot("four").await?;
    taken.push(("four".into(), model.clone()));
    churn(&v, &mut model, &mut rng, 20).await?;
    same(&v, &model, "the volume after a fourth snapshot").await?;
    for (s, at) in &taken {
        let snap = manage::open_snapshot(&client, &name, s).await?;
        same(&snap, at, &format!("{name}@{s} after a reopen")).await?;
    }
    assert!(matches!(manage::open_snapshot(&client, &name, "five").await, Err(VolumeError::NotFound(_))));
    // What each holds alone: never more than the volume, and the first
    // (whose layer the whole volume was written to, then overwritten in
    // part) holds some.
    let io: std::sync::Arc<dyn blizzard_volume::BlobIo> =
        blizzard_volume::ClientBlobIo::new(manage::find_blob(&client, &name).await?);
    let list = Volume::snapshots(&io).await?;
    let names: Vec<&str> = list.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["one", "two", "three", "four"]);
    assert!(list.iter().all(|s| s.held_bytes <= SIZE && s.size_bytes == SIZE), "{list:?}");
    assert!(list[0].held_bytes > 0, "{list:?}");

    // Deleting: what a snapshot alone held is given back, the others and
    // the volume read as before, and a deleted one is gone.
    let freed = v.delete_snapshot_freeing("one").await?;
    assert_eq!(freed, list[0].held_bytes, "what `one` alone held is what its deletion gives back");
    assert!(matches!(manage::open_snapshot(&client, &name, "one").await, Err(VolumeError::NotFound(_))));
    assert!(matches!(v.delete_snapshot("one").await, Err(VolumeError::NotFound(_))));
    taken.remove(0);
    for (s, at) in &taken {
        let snap = manage::open_snapshot(&client, &name, s).await?;
        same(&snap, at, &format!("{name}@{s} after `one` was deleted")).await?;
    }
    same(&v, &model, "the volume after `one` was deleted").await?;
    churn(&v, &mut model, &mut rng, 20).await?;
    let mut rest = 0;
    for s in ["three", "two", "four"] {
        rest += v.delete_snapshot_freeing(s).await?;
    }
    // (Tract slots are freed only once a tract holds no chunk: these
    // scattered writes free chunks, which the real-process test's
    // sequential ones free whole tracts of.)
    assert!(rest > 0, "deleting the other three gave nothing back");
    same(&v, &model, "the volume after every snapshot was deleted").await?;
    v.close().await?;
    let v = manage::open(env.clone(), &client, &name).await?;
    same(&v, &model, "the volume reopened after every snapshot was deleted").await?;
    assert!(Volume::snapshots(&io).await?.is_empty());
    v.close().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_snapshots_1_way() -> R {
    snapshots_in(CommitMode::WriteThrough, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_snapshots_2_way() -> R {
    snapshots_in(CommitMode::WriteThrough, 2).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_ack_snapshots_2_way() -> R {
    snapshots_in(CommitMode::FastAck, 2).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_snapshots_2_way() -> R {
    snapshots_in(CommitMode::Log, 2).await
}

/// Rollback (design 0011): through the process serving the volume (its
/// control socket), refused while a client uses it, naming the client;
/// after it the volume reads exactly as the snapshot did and every
/// snapshot still reads as it was, across a close and reopen; and with
/// nobody serving it, done without opening it (a log volume's way).
async fn rollback_in(mode: CommitMode) -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    let name = format!("rb-{}-{}", mode.name(), std::process::id());
    let mut rng = rand::rngs::StdRng::seed_from_u64(58 + mode as u64);
    let v = std::sync::Arc::new(manage::create(env.clone(), &client, &spec(&name, mode, 2)).await?);
    v.serve_control();
    let socket = blizzard_volume::control::blob_socket_path(manage::blob_id(&name));
    for _ in 0..500 {
        if socket.exists() {
            break;
        }
        env.sleep(Duration::from_millis(10)).await;
    }
    let mut model = vec![0u8; SIZE as usize];
    rng.fill_bytes(&mut model);
    v.write(0, Bytes::from(model.clone()), false).await?;
    churn(&v, &mut model, &mut rng, 30).await?;
    v.snapshot("a").await?;
    let at_a = model.clone();
    churn(&v, &mut model, &mut rng, 40).await?;
    v.snapshot("b").await?;
    let at_b = model.clone();
    churn(&v, &mut model, &mut rng, 40).await?;

    let user = v.attach("NBD client 10.0.0.7:40312 on export vm".into());
    let refused = manage::rollback(env.clone(), &client, &name, "a").await;
    let why = format!("{refused:?}");
    assert!(why.contains("10.0.0.7:40312") && why.contains("disconnect"), "{why}");
    drop(user);
    same(&v, &model, "the volume after a refused rollback").await?;

    if mode == CommitMode::Log {
        let refused = manage::rollback(env.clone(), &client, &name, "a").await;
        assert!(
            matches!(&refused, Err(VolumeError::Refused(m)) if m.contains("stop the server")),
            "{refused:?}"
        );
        v.release().await?;
        let (_, via) = manage::rollback(env.clone(), &client, &name, "a").await?;
        assert_eq!(via, manage::Via::Opened);
    } else {
        let (copied, via) = manage::rollback(env.clone(), &client, &name, "a").await?;
        assert_eq!(via, manage::Via::Server);
        assert!(copied > 0 && copied <= SIZE, "{copied}");
        same(&v, &at_a, "the served volume rolled back to a").await?;
        // Written after: the head is the volume's again.
        model.copy_from_slice(&at_a);
        churn(&v, &mut model, &mut rng, 20).await?;
        same(&v, &model, "the rolled-back volume written again").await?;
        v.release().await?;
    }
    drop(v);
    let expect = if mode == CommitMode::Log { at_a.clone() } else { model.clone() };
    let v = manage::open(env.clone(), &client, &name).await?;
    same(&v, &expect, "the rolled-back volume reopened").await?;
    for (s, at) in [("a", &at_a), ("b", &at_b)] {
        let snap = manage::open_snapshot(&client, &name, s).await?;
        same(&snap, at, &format!("{name}@{s} after the rollback")).await?;
    }
    v.close().await?;
    // Nobody serving it: rolled back to the newer snapshot without opening.
    let (_, via) = manage::rollback(env.clone(), &client, &name, "b").await?;
    assert_eq!(via, manage::Via::Opened);
    let v = manage::open(env.clone(), &client, &name).await?;
    same(&v, &at_b, "the volume rolled back to b").await?;
    let missing = manage::rollback(env.clone(), &client, &name, "zzz").await;
    assert!(missing.is_err(), "{missing:?}");
    v.close().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_rolls_back() -> R {
    rollback_in(CommitMode::WriteThrough).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_ack_rolls_back() -> R {
    rollback_in(CommitMode::FastAck).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_rolls_back() -> R {
    rollback_in(CommitMode::Log).await
}
