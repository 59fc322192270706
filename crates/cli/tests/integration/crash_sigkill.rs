//! The crash check across real processes: a `blizzard crashcheck-client`
//! process drives a tagged workload against a volume on real tractservers
//! (loopback TCP, disk files with fdatasync) and is SIGKILLed mid-flight;
//! the volume is then reopened here (running its recovery) and checked
//! against the client's event log, for every commit mode and flush policy.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // a test of real processes in real time

use crate::common::bin;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_crashcheck::real::{parse_log, verify};
use blizzard_env::Env;
use blizzard_volume::lease::Writer;
use blizzard_volume::{manage, CommitMode, FlushPolicy, PlantedBug, VolumeSpec};

const KILLS_PER_CONFIG: usize = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_client_leaves_a_volume_its_mode_allows() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ClusterConfig::new(dir.path().join("cluster"));
    cfg.tractservers = 4;
    cfg.replication = 2;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 256 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    let env = Env::real();
    let cluster = Cluster::start(env.clone(), cfg).await.unwrap();
    let client = cluster.client().await.unwrap();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(std::process::id() as u64);
    let configs = [
        (CommitMode::WriteThrough, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Ordered),
        (CommitMode::Log, FlushPolicy::Durable),
        (CommitMode::Log, FlushPolicy::Ordered),
    ];
    let mut kills = 0;
    for (mode, flush) in configs {
        for k in 0..KILLS_PER_CONFIG {
            let name = format!("{}-{}-{k}", mode.name(), flush.name());
            let mut spec = VolumeSpec::new(&name, 16 << 20);
            spec.mode = mode;
            spec.flush = flush;
            spec.replication = 2;
            spec.block_size = Some(4096);
            spec.segment_tracts = 8;
            manage::create(env.clone(), &client, &spec).await.unwrap().close().await.unwrap();

            let log = dir.path().join(format!("{name}.log"));
            let seed: u64 = rng.random();
            let mut child = Command::new(bin::blizzard_bin())
                .args(["crashcheck-client", "--meta", &cluster.meta_addr, "--volume", &name])
                .arg("--log")
                .arg(&log)
                .args(["--seed", &seed.to_string(), "--depth", "8"])
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap();
            // Kill once the workload is well under way, at a random moment.
            let want_acks = rng.random_range(20..400);
            let started = Instant::now();
            loop {
                let acks = std::fs::read_to_string(&log).unwrap_or_default().matches("\nA ").count();
                if acks >= want_acks {
                    break;
                }
                if let Some(status) = child.try_wait().unwrap() {
                    panic!("{name}: the client exited early ({status}) before {want_acks} acknowledgments");
                }
                assert!(started.elapsed() < Duration::from_secs(60), "{name}: the client makes no progress");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..50))).await;
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
            kills += 1;

            let ops = parse_log(&std::fs::read_to_string(&log).unwrap()).unwrap();
            let acked = ops.iter().filter(|o| o.acked).count();
            // The killed client still holds the volume's lease: take it
            // over (its late writes are fenced), as an operator would.
            let writer = Writer::new(&env).take_over(true);
            let vol = Arc::new(
                manage::open_as(env.clone(), &client, &name, &writer, PlantedBug::None).await.unwrap(),
            );
            if let Err(v) = verify(&vol, &ops).await {
                panic!("{name} (seed {seed}): {} ops, {acked} acknowledged: {v}", ops.len());
            }
            eprintln!("{name}: killed after {} ops ({acked} acknowledged): consistent", ops.len());
        }
    }
    assert_eq!(kills, 5 * KILLS_PER_CONFIG);
    cluster.stop().await;
}
