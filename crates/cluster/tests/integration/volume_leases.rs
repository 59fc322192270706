//! One writer per volume (design 0007) on a cluster whose metadata service
//! is three replicas, in one process on real sockets and files: a volume
//! held by one opener is refused to others (naming the holder) through a
//! change of metadata leader; a holder that dies without closing keeps
//! the volume only until its lease ends, and its late writes are refused
//! once the next holder has claimed the volume; a holder cut off from the
//! metadata service waits (no error) and carries on once it is back; a
//! holder taken over stops.

#![allow(clippy::unwrap_used)]
// Real time: the cluster runs on real sockets and files.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use blizzard_client::ClientError;
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_volume::lease::Writer;
use blizzard_volume::{manage, CommitMode, FlushPolicy, PlantedBug, Volume, VolumeError, VolumeSpec};
use common::{checked_load, init_tracing, wait_for, Load};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const TTL: Duration = Duration::from_millis(1500);

async fn cluster(dir: &tempfile::TempDir) -> Result<Cluster, Box<dyn std::error::Error + Send + Sync>> {
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.meta_replicas = 3;
    cfg.tractservers = 4;
    cfg.replication = 3;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(250);
    Ok(Cluster::start(Env::real(), cfg).await?)
}

fn spec(name: &str) -> VolumeSpec {
    let mut s = VolumeSpec::new(name, 4 << 20);
    s.mode = CommitMode::WriteThrough;
    s.flush = FlushPolicy::Durable;
    s.replication = 3;
    s.block_size = Some(4096);
    s
}

fn writer(env: &Env) -> Writer {
    let mut w = Writer::new(env);
    w.ttl = TTL;
    w
}

fn holder_of(r: &Result<Volume, VolumeError>) -> Option<String> {
    match r {
        Err(VolumeError::Held { holder, .. }) => Some(holder.clone()),
        _ => None,
    }
}

/// The lease is held across a change of metadata leader (renewed by the
/// new one, still refusing others); the holder dies without closing: the
/// volume is refused until its lease ends, then granted, and a write
/// carrying the dead holder's writer epoch is refused by the tractservers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_outlives_a_metadata_leader_but_not_its_holder() -> R {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir).await?;
    let env = Env::real();
    let client = c.client().await?;
    let a = manage::create_as(env.clone(), &client, &spec("v"), &writer(&env)).await?;
    let a_holder =
        holder_of(&manage::open(env.clone(), &client, "v").await).ok_or("a second opener was not refused")?;
    let status = client.cluster_status().await?;
    let listed = status
        .leases
        .iter()
        .find(|l| l.blob == manage::blob_id("v"))
        .ok_or("the lease is not in the status")?;
    assert_eq!(listed.holder, a_holder);

    // The metadata leader goes; the holder keeps writing for several ttls
    // (its renewals reach the new leader) and others are still refused.
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let Load { task, longest_ms: longest, done } = checked_load(a.clone(), 512, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = c.meta_leader().ok_or("no leader")?;
    c.stop_meta_replica(first).await;
    wait_for(&c, "a new metadata leader", |c| c.meta_leader().is_some_and(|l| l != first)).await;
    tokio::time::sleep(TTL * 3).await;
    let refused = manage::open(env.clone(), &client, "v").await;
    assert_eq!(holder_of(&refused).as_deref(), Some(a_holder.as_str()), "{:?}", refused.err());
    stop.store(true, Ordering::Relaxed);
    task.await??;
    eprintln!(
        "across the leader change: {} writes, longest write+read {} ms",
        done.load(Ordering::Relaxed),
        longest.load(Ordering::Relaxed)
    );
    c.start_meta_replica(first).await?;

    // The holder dies: no close, no release; its renewals stop.
    let a_writer = a.recovery().writer;
    drop(a);
    let died = Instant::now();
    let b = loop {
        match manage::open_as(env.clone(), &client, "v", &writer(&env), PlantedBug::None).await {
            Ok(v) => break v,
            Err(VolumeError::Held { holder, .. }) if holder == a_holder => {
                assert!(died.elapsed() < Duration::from_secs(30), "the dead holder's lease never ended");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let waited = died.elapsed();
    eprintln!(
        "the dead holder's volume was granted again after {} ms (ttl {} ms)",
        waited.as_millis(),
        TTL.as_millis()
    );
    assert!(b.recovery().writer > a_writer);
    // A write the dead holder had in flight, arriving now: refused.
    let late = client.open_blob(manage::blob_id("v")).await?;
    late.set_writer(a_writer);
    match late.write(1, 0, Bytes::from(vec![9u8; 4096])).await {
        Err(ClientError::Fenced { newest, .. }) => assert_eq!(newest, b.recovery().writer),
        other => panic!("a late write of the dead holder was not refused: {other:?}"),
    }
    b.write(0, Bytes::from(vec![5u8; 4096]), true).await?;
    b.close().await?;
    // Closed: the next opener need not wait.
    manage::open(env.clone(), &client, "v").await?.close().await?;
    c.stop().await;
    Ok(())
}

/// With two of three metadata replicas down for longer than the lease,
/// the holder's writes wait (its lease lapses, and the tractservers'
/// leases end too) and carry on, without an error, once a majority is
/// back. Then another opener takes the volume over: the first holder's
/// next renewal finds it lost, and its writes fail as fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_holder_waits_and_a_taken_over_one_stops() -> R {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir).await?;
    let env = Env::real();
    let client = c.client().await?;
    let a = Arc::new(manage::create_as(env.clone(), &client, &spec("w"), &writer(&env)).await?);
    let stop = Arc::new(AtomicBool::new(false));
    let Load { task, longest_ms: longest, done } = checked_load(a.clone(), 512, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;

    let leader = c.meta_leader().ok_or("no leader")?;
    let others: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    c.stop_meta_replica(leader).await;
    c.stop_meta_replica(others[0]).await;
    tokio::time::sleep(TTL * 2).await;
    let during = done.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        done.load(Ordering::Relaxed),
        during,
        "writes went on with no metadata service past the lease"
    );
    c.start_meta_replica(leader).await?;
    c.start_meta_replica(others[0]).await?;
    wait_for(&c, "a metadata leader", |c| c.meta_leader().is_some()).await;
    let back = Instant::now();
    while done.load(Ordering::Relaxed) < during + 20 {
        assert!(back.elapsed() < Duration::from_secs(30), "writes did not resume");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    task.await??;
    eprintln!(
        "two of three metadata replicas down for {} ms: longest write+read {} ms, no error",
        (TTL * 2).as_millis() + 500,
        longest.load(Ordering::Relaxed)
    );

    // Taken over: once the first holder's renewal finds the lease lost,
    // its writes are refused before they leave the process.
    let b =
        manage::open_as(env.clone(), &client, "w", &writer(&env).take_over(true), PlantedBug::None).await?;
    tokio::time::sleep(TTL).await;
    let refused = a.write(0, Bytes::from(vec![1u8; 4096]), true).await;
    assert!(refused.as_ref().is_err_and(VolumeError::is_fenced), "{refused:?}");
    eprintln!("the taken-over holder's write: {}", refused.err().unwrap());
    b.write(0, Bytes::from(vec![2u8; 4096]), true).await?;
    assert_eq!(&b.read(0, 4096).await?[..], &[2u8; 4096][..]);
    b.close().await?;
    c.stop().await;
    Ok(())
}
