//! Volumes on a real cluster (loopback TCP, disk files): management by
//! name, every commit mode reading back what it wrote across stripes and
//! segments, persistence across close and reopen, and TRIM freeing space.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, RngCore, SeedableRng};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_volume::lease::Writer;
use blizzard_volume::{manage, CommitMode, ErrorKind, FlushPolicy, PlantedBug, VolumeError, VolumeSpec};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

async fn cluster(dir: &tempfile::TempDir) -> Cluster {
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 4;
    cfg.replication = 2;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    Cluster::start(Env::real(), cfg).await.unwrap()
}

fn spec(name: &str, mode: CommitMode, flush: FlushPolicy) -> VolumeSpec {
    let mut s = VolumeSpec::new(name, 8 << 20);
    s.mode = mode;
    s.flush = flush;
    s.replication = 2;
    s.block_size = Some(4096);
    s.segment_tracts = 8;
    s
}

/// Create, list, info, resize, delete; duplicate and missing names are
/// clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_by_name() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    let v =
        manage::create(env.clone(), &client, &spec("b", CommitMode::FastAck, FlushPolicy::Ordered)).await?;
    v.close().await?;
    let a = manage::create(env.clone(), &client, &spec("a", CommitMode::WriteThrough, FlushPolicy::Durable))
        .await?;
    a.write(0, Bytes::from(vec![3u8; 8192]), false).await?;
    a.release().await?;
    drop(a);
    assert!(matches!(
        manage::create(env.clone(), &client, &spec("a", CommitMode::WriteThrough, FlushPolicy::Durable))
            .await,
        Err(VolumeError::Exists(_))
    ));
    let names: Vec<String> = manage::list(&client).await?.into_iter().map(|s| s.name).collect();
    assert_eq!(names, vec!["a", "b"]);
    let (sb, via) = manage::resize(env.clone(), &client, "b", 24 << 20, false).await?;
    assert_eq!((sb.size_bytes, via), (24 << 20, manage::Via::Opened));
    let v = manage::open(env.clone(), &client, "b").await?;
    assert_eq!(v.size(), 24 << 20);
    assert_eq!(v.superblock().flush, FlushPolicy::Ordered);
    // The grown part is usable.
    v.write((24 << 20) - 4096, Bytes::from(vec![7u8; 4096]), false).await?;
    v.flush_durable().await?;
    assert!(matches!(
        v.write(24 << 20, Bytes::from(vec![1u8; 512]), false).await,
        Err(VolumeError::OutOfRange { .. })
    ));
    // Held (open here): neither deleted nor resized from elsewhere.
    let held = manage::delete(env.clone(), &client, "b").await;
    assert!(matches!(&held, Err(VolumeError::Held { name, .. }) if name == "b"), "{held:?}");
    // (A holder without a control socket: the refusal says where to go.)
    let held = manage::resize(env.clone(), &client, "b", 32 << 20, false).await;
    assert!(matches!(&held, Err(VolumeError::Refused(m)) if m.contains("no control socket")), "{held:?}");
    v.close().await?;
    manage::delete(env.clone(), &client, "b").await?;
    assert!(matches!(manage::open(env.clone(), &client, "b").await, Err(VolumeError::NotFound(_))));
    assert!(matches!(manage::delete(env.clone(), &client, "b").await, Err(VolumeError::NotFound(_))));
    let names: Vec<String> = manage::list(&client).await?.into_iter().map(|s| s.name).collect();
    assert_eq!(names, vec!["a"]);
    // Deleting frees every tract, though each volume's writers raised its
    // writer fence on the tractservers (a delete once carried no epoch and
    // was refused by them: the tracts stayed, unreachable).
    manage::delete(env.clone(), &client, "a").await?;
    let used: u64 =
        (0..c.tractserver_count()).filter_map(|i| c.tractserver(i)).map(|t| t.service.store.usage().1).sum();
    assert_eq!(used, 0, "tracts of deleted volumes are left");
    c.stop().await;
    Ok(())
}

/// Each commit mode: random unaligned writes and trims against a model,
/// reads during the workload (served from the write cache in fast-ack
/// mode), then a close, a reopen and a full comparison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mode_reads_back_what_it_wrote() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    for (i, (mode, flush)) in [
        (CommitMode::WriteThrough, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Ordered),
        (CommitMode::Log, FlushPolicy::Durable),
        (CommitMode::Log, FlushPolicy::Ordered),
    ]
    .into_iter()
    .enumerate()
    {
        let name = format!("v{i}");
        let v = manage::create(env.clone(), &client, &spec(&name, mode, flush)).await?;
        let size = v.size() as usize;
        let mut model = vec![0u8; size];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(i as u64);
        for n in 0..300 {
            let len = rng.random_range(1..200_000usize);
            let off = rng.random_range(0..size - len);
            if rng.random_ratio(1, 10) {
                v.trim(off as u64, len as u64).await?;
                model[off..off + len].fill(0);
            } else {
                let mut data = vec![0u8; len];
                rng.fill_bytes(&mut data);
                v.write(off as u64, Bytes::from(data.clone()), false).await?;
                model[off..off + len].copy_from_slice(&data);
            }
            if n % 7 == 0 {
                let (o, l) = (rng.random_range(0..size - 70_000), 70_000);
                assert!(v.read(o as u64, l as u64).await?[..] == model[o..o + l], "{mode:?} read {n}");
            }
            if n % 25 == 0 {
                v.flush().await?;
            }
        }
        v.close().await?;
        let v = manage::open(env.clone(), &client, &name).await?;
        let back = v.read(0, size as u64).await?;
        assert!(back[..] == model[..], "{mode:?}/{flush:?}: reopened volume differs");
    }
    c.stop().await;
    Ok(())
}

/// TRIM of a whole volume gives the tractservers their slots back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_frees_space() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let used = |c: &Cluster| -> u64 {
        (0..c.tractserver_count()).filter_map(|i| c.tractserver(i)).map(|t| t.service.store.usage().1).sum()
    };
    let before = used(&c);
    let v = manage::create(Env::real(), &client, &spec("t", CommitMode::WriteThrough, FlushPolicy::Durable))
        .await?;
    v.write(0, Bytes::from(vec![9u8; 8 << 20]), false).await?;
    let full = used(&c);
    assert!(full >= before + 2 * 128, "8 MiB of 64 KiB tracts, 2 replicas: {before} -> {full}");
    v.trim(0, 8 << 20).await?;
    assert!(v.read(0, 8 << 20).await?.iter().all(|&b| b == 0));
    let after = used(&c);
    assert!(after < before + 8, "trim left {after} slots in use (was {before} before the volume)");
    c.stop().await;
    Ok(())
}

/// `allocation` tells written ranges from holes in every mode, covers the
/// range exactly, and a trimmed range becomes a hole again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocation_reports_holes() -> R {
    use blizzard_volume::Allocation;
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    for (i, mode) in [CommitMode::WriteThrough, CommitMode::FastAck, CommitMode::Log].into_iter().enumerate()
    {
        let v =
            manage::create(env.clone(), &client, &spec(&format!("alloc-{i}"), mode, FlushPolicy::Durable))
                .await?;
        let size = v.size();
        // State of the byte at `x` according to one allocation call over
        // the whole volume (which must cover it exactly).
        let state_at = |ext: &[blizzard_volume::AllocExtent], x: u64| {
            let mut at = 0;
            for e in ext {
                if x < at + e.len {
                    return e.state;
                }
                at += e.len;
            }
            panic!("byte {x} not covered");
        };
        let ext = v.allocation(0, size).await?;
        assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), size, "{mode:?}: covers the range");
        assert!(ext.iter().all(|e| e.state == Allocation::Zero), "{mode:?}: a new volume is all hole");

        v.write(64 << 10, Bytes::from(vec![7u8; 8192]), false).await?;
        v.write((1 << 20) + 512, Bytes::from(vec![9u8; 1024]), false).await?;
        let ext = v.allocation(0, size).await?;
        assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), size);
        for x in [64 << 10, (64 << 10) + 8191, (1 << 20) + 512, (1 << 20) + 1535] {
            assert_eq!(state_at(&ext, x), Allocation::Data, "{mode:?}: byte {x} was written");
        }
        for x in [0, 32 << 10, 4 << 20, size - 1] {
            assert_eq!(state_at(&ext, x), Allocation::Zero, "{mode:?}: byte {x} was never written");
        }
        // After the data is durable, the answer holds too.
        v.flush_durable().await?;
        let ext = v.allocation(60 << 10, 16 << 10).await?;
        assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), 16 << 10);
        assert_eq!(state_at(&ext, 4 << 10), Allocation::Data);
        assert_eq!(state_at(&ext, 0), Allocation::Zero);

        v.trim(64 << 10, 8192).await?;
        v.flush_durable().await?;
        let ext = v.allocation(64 << 10, 8192).await?;
        assert!(
            ext.iter().all(|e| e.state == Allocation::Zero),
            "{mode:?}: trimmed range is a hole: {ext:?}"
        );
        v.close().await?;
    }
    c.stop().await;
    Ok(())
}

/// One writer per volume: a second opener is refused while the first holds
/// the volume's lease; one that takes it over claims it, and the
/// tractservers refuse the earlier opener's writes from then on (its
/// errors say it was fenced); the new writer carries on, and a volume
/// deleted and created again under the same name starts unfenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_opener_fences_the_first() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir).await;
    let env = Env::real();
    let client = c.client().await?;
    for mode in [CommitMode::WriteThrough, CommitMode::FastAck, CommitMode::Log] {
        let name = format!("fenced-{}", mode.name());
        let first = manage::create(env.clone(), &client, &spec(&name, mode, FlushPolicy::Durable)).await?;
        first.write(0, Bytes::from(vec![1u8; 4096]), true).await?;
        // The first holds the volume's lease: a plain open is refused,
        // naming it; a take-over is not.
        let refused = manage::open(env.clone(), &client, &name).await;
        assert!(
            matches!(&refused, Err(VolumeError::Held { holder, .. }) if !holder.is_empty()),
            "{:?}",
            refused.err()
        );
        let writer = Writer::new(&env).take_over(true);
        let second = manage::open_as(env.clone(), &client, &name, &writer, PlantedBug::None).await?;
        assert!(second.recovery().writer > first.recovery().writer);
        // FUA: durable before it returns, so it must reach the blob store.
        let refused = first.write(8192, Bytes::from(vec![2u8; 4096]), true).await;
        assert!(refused.as_ref().is_err_and(VolumeError::is_fenced), "{mode:?}: {refused:?}");
        let flushed = first.flush().await;
        if mode != CommitMode::WriteThrough {
            assert!(flushed.as_ref().is_err_and(VolumeError::is_fenced), "{mode:?}: {flushed:?}");
        }
        second.write(8192, Bytes::from(vec![3u8; 4096]), true).await?;
        assert_eq!(&second.read(0, 4096).await?[..], &[1u8; 4096][..]);
        assert_eq!(&second.read(8192, 4096).await?[..], &[3u8; 4096][..]);
        drop(first);
        second.close().await?;
        manage::delete(env.clone(), &client, &name).await?;
        let again = manage::create(env.clone(), &client, &spec(&name, mode, FlushPolicy::Durable)).await?;
        again.write(8192, Bytes::from(vec![4u8; 4096]), true).await?;
        again.close().await?;
    }
    c.stop().await;
    Ok(())
}

/// A tractserver that was down comes back holding a replica the others
/// moved past: a write it missed failed (the client gave up), so the
/// volume left the tract suspect, and the next read makes the replicas
/// agree first. Done once with the stale server as the row's first member
/// (the source: the failed write is undone everywhere) and once as another
/// member (the write is copied to it); either way every replica then holds
/// the same bytes, and reads stay the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_tractserver_is_reconciled_before_a_read() -> R {
    use blizzard_client::{Client, ClientConfig};
    for column in [0usize, 1] {
        let dir = tempfile::tempdir()?;
        let mut cfg = ClusterConfig::new(dir.path());
        cfg.tractservers = 4;
        cfg.replication = 3;
        cfg.tract_size = 64 << 10;
        cfg.disk_size = 64 << 20;
        // Long enough (10 heartbeats) that the stopped server is not
        // replaced before it is back.
        cfg.heartbeat_interval = Duration::from_millis(500);
        let env = Env::real();
        let mut c = Cluster::start(env.clone(), cfg).await?;
        // A client that gives up after a few quick attempts.
        let mut cc = ClientConfig::new(c.meta_addr.clone());
        cc.attempts = 3;
        cc.request_timeout = Duration::from_secs(1);
        let client = Client::connect(env.clone(), cc).await?;
        let mut s = spec(&format!("back-{column}"), CommitMode::WriteThrough, FlushPolicy::Durable);
        s.replication = 3;
        let vol = manage::create(env.clone(), &client, &s).await?;
        vol.write(0, Bytes::from(vec![1u8; 4096]), false).await?;
        // Byte 0 is in tract 1; stop the member of its row in `column`.
        let blob = client.open_blob(manage::blob_id(&s.name)).await?;
        let tlt = client.tlt();
        let row = &tlt.rows[tlt.locate(blob.id(), blizzard_core::TractNo(1))];
        let addr = tlt.members[row.members[column] as usize].addr.clone();
        let i = (0..c.tractserver_count())
            .find(|&i| c.tractserver(i).is_some_and(|t| t.addr == addr))
            .ok_or("the row's member is not one of the cluster's tractservers")?;
        c.stop_tractserver(i).await;
        let failed = vol.write(0, Bytes::from(vec![2u8; 4096]), false).await;
        assert!(failed.is_err(), "column {column}: a write with a replica down must fail here");
        assert!(vol.intent().is_some_and(|i| i.has_suspects()));
        c.start_tractserver(i).await?;
        c.wait_ready(Duration::from_secs(30)).await?;
        let first = vol.read(0, 4096).await?;
        assert!(first[..] == [1u8; 4096][..] || first[..] == [2u8; 4096][..]);
        let replicas = blob.read_replicas(1, 0, 4096).await?;
        assert_eq!(replicas.len(), 3);
        assert!(replicas.iter().all(|r| *r == first), "column {column}: replicas differ after the read");
        for _ in 0..8 {
            assert_eq!(vol.read(0, 4096).await?, first, "column {column}: a read changed with no write");
        }
        let want = if column == 0 { 1u8 } else { 2u8 };
        assert_eq!(first[0], want, "column {column}: the row's first member is the source");
        drop(vol);
        c.stop().await;
    }
    Ok(())
}

/// A cluster that runs out of space: every commit mode reports it as
/// `NoSpace` and nothing hangs. Fast-ack and log commit acknowledge a
/// write before it lands, so the refusal arrives later: the engine goes
/// into its failed state and fails every later write, the durable flush
/// and the close with it (they retried a full disk forever, so a durable
/// flush, and the shutdown flush of `blizzard up`, never returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cluster_fails_writes_and_flushes_in_every_mode() -> R {
    let dir = tempfile::tempdir()?;
    let env = Env::real();
    for (i, mode) in [CommitMode::FastAck, CommitMode::Log, CommitMode::WriteThrough].into_iter().enumerate()
    {
        // A cluster per mode: a volume that failed keeps its lease until
        // its process ends (what it acknowledged must not pass to another
        // writer), so it cannot be deleted to make room for the next.
        let mut cfg = ClusterConfig::new(dir.path().join(i.to_string()));
        cfg.tractservers = 4;
        cfg.replication = 2;
        cfg.tract_size = 64 << 10;
        // A few dozen tracts each: far less than one volume.
        cfg.disk_size = 4 << 20;
        cfg.heartbeat_interval = Duration::from_millis(200);
        let c = Cluster::start(env.clone(), cfg).await?;
        let client = c.client().await?;
        let mut s = spec("full", mode, FlushPolicy::Durable);
        s.size_bytes = 64 << 20;
        let v = manage::create(env.clone(), &client, &s).await?;
        // A hang is the bug: bound every step.
        let bound = Duration::from_secs(60);
        let mut refused = None;
        for n in 0..(s.size_bytes / (64 << 10)) {
            let w = v.write(n * (64 << 10), Bytes::from(vec![n as u8 | 1; 64 << 10]), false);
            if let Err(e) = env.timeout(bound, w).await.map_err(|_| format!("{mode:?}: a write hung"))? {
                refused = Some(e);
                break;
            }
        }
        // Write-through refuses the write itself; the others may have
        // acknowledged every write before the first refusal came back.
        match &refused {
            Some(e) => assert_eq!(e.kind(), ErrorKind::NoSpace, "{mode:?}: {e}"),
            None => assert_ne!(mode, CommitMode::WriteThrough, "64 MiB fit on 16 MiB of disks"),
        }
        let flushed = env
            .timeout(bound, v.flush_durable())
            .await
            .map_err(|_| format!("{mode:?}: the durable flush hung"))?;
        if mode == CommitMode::WriteThrough {
            // Nothing acknowledged is outstanding: the flush succeeds.
            flushed?;
        } else {
            let e = flushed.expect_err("a durable flush succeeded with writes that cannot land");
            assert_eq!(e.kind(), ErrorKind::NoSpace, "{mode:?}: {e}");
            // Every later write fails the same way, at once.
            let again = env
                .timeout(bound, v.write(0, Bytes::from(vec![9u8; 4096]), false))
                .await
                .map_err(|_| format!("{mode:?}: a write after the failure hung"))?;
            assert_eq!(again.map_err(|e| e.kind()), Err(ErrorKind::NoSpace), "{mode:?}");
        }
        // Close returns (with the error, for the engines that failed).
        let closed = env.timeout(bound, v.close()).await.map_err(|_| format!("{mode:?}: close hung"))?;
        assert_eq!(closed.is_err(), mode != CommitMode::WriteThrough, "{mode:?}: {closed:?}");
        c.stop().await;
    }
    Ok(())
}
