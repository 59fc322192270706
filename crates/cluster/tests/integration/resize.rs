//! Online resize (issue 57): a volume served by this process (its control
//! socket up, as an NBD server's) grows and shrinks through
//! `manage::resize` while a writer keeps writing, in every commit mode.
//! Nothing below the smallest size changes, what a grow gains reads as
//! zeros (also where a shrink's data was), writes past the end are
//! refused, and all of it holds across a close and reopen.

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, RngCore, SeedableRng};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_volume::{manage, CommitMode, FlushPolicy, Volume, VolumeError, VolumeSpec};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const MIB: u64 = 1 << 20;
/// The writer's region: below every size the test sets.
const BUSY: u64 = 4 * MIB;

async fn cluster(dir: &tempfile::TempDir) -> Cluster {
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 4;
    cfg.replication = 2;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 96 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    Cluster::start(Env::real(), cfg).await.unwrap()
}

/// Random writes into `[0, BUSY)` until `stop`, each into `model` too
/// (each write finishes: a dropped one could land unrecorded).
async fn writer(v: Arc<Volume>, mut model: Vec<u8>, stop: Arc<AtomicBool>, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    while !stop.load(Ordering::Acquire) {
        let off = rng.random_range(0..BUSY - 20_000);
        let len = rng.random_range(1..20_000u64);
        let mut b = vec![0u8; len as usize];
        rng.fill_bytes(&mut b);
        v.write(off, Bytes::from(b.clone()), false).await.unwrap();
        model[off as usize..(off + len) as usize].copy_from_slice(&b);
    }
    model
}

async fn same(v: &Volume, model: &[u8], what: &str) -> R {
    assert_eq!(v.size(), model.len() as u64, "{what}: size");
    let got = v.read(0, v.size()).await?;
    if let Some(i) = got.iter().zip(model).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} reads {} where {} was written", got[i], model[i]);
    }
    Ok(())
}

async fn resize_served(mode: CommitMode, with_snapshot: bool) -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    // Unique on this host: the control socket is named by the blob id.
    let name = format!("resize-{}-{}-{}", mode.name(), with_snapshot, std::process::id());
    let mut s = VolumeSpec::new(&name, 8 * MIB);
    s.mode = mode;
    s.flush = FlushPolicy::Durable;
    s.replication = 2;
    s.block_size = Some(4096);
    s.segment_tracts = 8;
    let v = Arc::new(manage::create(env.clone(), &client, &s).await?);
    v.serve_control();
    let socket = blizzard_volume::control::blob_socket_path(manage::blob_id(&name));
    for _ in 0..500 {
        if socket.exists() {
            break;
        }
        env.sleep(Duration::from_millis(10)).await;
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(57 + mode as u64);
    let mut model = vec![0u8; 8 * MIB as usize];
    rng.fill_bytes(&mut model);
    v.write(0, Bytes::from(model.clone()), false).await?;
    if with_snapshot {
        v.snapshot("before").await?;
    }
    let at_snapshot = model.clone();

    let stop = Arc::new(AtomicBool::new(false));
    let busy = tokio::spawn(writer(v.clone(), model[..BUSY as usize].to_vec(), stop.clone(), 7));
    let resize = |size: u64, shrink: bool| manage::resize(env.clone(), &client, &name, size, shrink);

    // Grow: through the serving process; the gain reads as zeros.
    let (sb, via) = resize(16 * MIB, false).await?;
    assert_eq!((sb.size_bytes, via, v.size()), (16 * MIB, manage::Via::Server, 16 * MIB));
    model.resize(16 * MIB as usize, 0);
    assert!(v.read(8 * MIB, 8 * MIB).await?.iter().all(|&b| b == 0), "a grow's gain reads as zeros");
    v.write(15 * MIB, Bytes::from(vec![0x5a; MIB as usize]), false).await?;
    model[15 * MIB as usize..].fill(0x5a);

    // Shrinking asks for --allow-shrink, then drops the end.
    let refused = resize(6 * MIB, false).await;
    assert!(matches!(&refused, Err(VolumeError::Refused(m)) if m.contains("--allow-shrink")), "{refused:?}");
    let used = || -> u64 {
        (0..c.tractserver_count()).filter_map(|i| c.tractserver(i)).map(|t| t.service.store.usage().1).sum()
    };
    let before = used();
    let (sb, _) = resize(6 * MIB, true).await?;
    if mode != CommitMode::Log && !with_snapshot {
        // What was written past 6 MiB ([6, 8) and [15, 16)), on both
        // replicas, is given back (a log keeps its ring; a snapshot
        // keeps what it holds).
        // (Usage is in tract slots, 64 KiB here.)
        let freed = before.saturating_sub(used());
        assert!(freed >= 2 * 3 * MIB / (64 << 10), "a shrink freed {freed} of {before} tract slots");
    }
    assert_eq!((sb.size_bytes, v.size()), (6 * MIB, 6 * MIB));
    model.truncate(6 * MIB as usize);
    let past = v.write(6 * MIB, Bytes::from_static(b"past the end"), false).await;
    assert!(matches!(past, Err(VolumeError::OutOfRange { .. })), "{past:?}");

    // Grown again over the shrink's old data: zeros, not what was there.
    let (sb, _) = resize(12 * MIB, false).await?;
    assert_eq!(sb.size_bytes, 12 * MIB);
    model.resize(12 * MIB as usize, 0);
    stop.store(true, Ordering::Release);
    let busy_model = busy.await?;
    model[..BUSY as usize].copy_from_slice(&busy_model);
    same(&v, &model, "served, after grow, shrink, grow").await?;

    if with_snapshot {
        let snap = manage::open_snapshot(&client, &name, "before").await?;
        same(&snap, &at_snapshot, "the snapshot taken before the resizes").await?;
    }
    let bad = resize(12 * MIB + 100, false).await;
    assert!(matches!(&bad, Err(VolumeError::Refused(m)) if m.contains("512")), "{bad:?}");

    v.release().await?;
    drop(v);
    assert!(!socket.exists(), "the control socket is removed at release");
    // Not served: opened here.
    let (sb, via) = resize(14 * MIB, false).await?;
    assert_eq!((sb.size_bytes, via), (14 * MIB, manage::Via::Opened));
    model.resize(14 * MIB as usize, 0);
    let v = manage::open(env.clone(), &client, &name).await?;
    same(&v, &model, "reopened").await?;
    v.close().await?;
    c.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_resizes_while_served() -> R {
    resize_served(CommitMode::WriteThrough, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_through_with_a_snapshot_resizes_while_served() -> R {
    resize_served(CommitMode::WriteThrough, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_ack_resizes_while_served() -> R {
    resize_served(CommitMode::FastAck, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_resizes_while_served() -> R {
    resize_served(CommitMode::Log, false).await
}
