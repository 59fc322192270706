//! Incremental repair across real processes (Ursa §4.2.1, design 0009): a
//! tractserver SIGKILLed under a verified load is declared dead and
//! replaced, and starts again on the same disk while its replacements are
//! still copying (they copy at 1 MB/s). It takes its columns back and
//! fetches only the chunks that changed while it was away; afterwards the
//! cluster is whole and every replica of every tract holds exactly the
//! acknowledged bytes, and the returned server's metrics show it kept
//! more than it copied.

// The test drives real processes and sockets in real time, outside the env
// seam, and a failure must stop it with its context.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use blizzard_client::{Client, ClientConfig};
use blizzard_env::Env;

use common::{free_port, meta_args, Proc, Procs, Shared};

const TRACTSERVERS: usize = 8;
const TRACT_SIZE: usize = 1 << 20;

/// Tractserver `i` on disk `ts{i}.disk` in `dir`, copying at 1 MB/s, its
/// metrics on `metrics`.
fn tractserver(dir: &Path, meta: &str, i: usize, metrics: &str) -> Proc {
    common::spawn_tractserver_with(dir, meta, i, "256MiB", &["--fill-mbps", "1", "--metrics", metrics])
}

/// A counter's value in Prometheus text.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tractserver_killed_and_restarted_repairs_only_what_it_missed() {
    let seed = Env::real().random_u64();
    println!("seed {seed}");
    let mut rng = SmallRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let meta_addr = format!("127.0.0.1:{}", free_port());
    let meta = Proc::spawn(
        "meta",
        &meta_args(&meta_addr, 3, TRACTSERVERS, None),
        dir.path().join("meta.log"),
        meta_addr.clone(),
    );
    let mut procs = Procs { meta, ts: Vec::new() };
    for i in 0..TRACTSERVERS {
        let m = format!("127.0.0.1:{}", free_port());
        procs.ts.push(tractserver(dir.path(), &meta_addr, i, &m));
    }
    procs.wait_listening(Duration::from_secs(30));
    let client = Client::connect(Env::real(), ClientConfig::new(meta_addr.clone())).await.unwrap();
    assert_eq!(client.tract_size() as usize, TRACT_SIZE);
    let (blobs, model) = common::fill_blobs(&client, &mut rng, 3, 32, 3).await;
    let shared = Arc::new(Shared::new(blobs, model, 3, TRACT_SIZE, 64 << 10));
    let load = common::start_load(&shared, seed, 4, 2);
    tokio::time::sleep(Duration::from_secs(2)).await;
    procs.check_running();
    shared.assert_no_failures("on a healthy cluster");

    let step = "kill and restart";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = procs.ts[0].addr.clone();
    println!("{step}: SIGKILL ts0 ({victim})");
    procs.ts[0].kill();
    loop {
        if let Ok(s) = client.cluster_status().await {
            if s.members.iter().any(|m| m.addr == victim && m.dead) {
                break;
            }
        }
        assert!(since.elapsed() < common::RECOVERY_TIMEOUT, "{step}: ts0 was never declared dead");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let metrics = format!("127.0.0.1:{}", free_port());
    procs.ts[0] = tractserver(dir.path(), &meta_addr, 0, &metrics);
    procs.wait_listening(Duration::from_secs(30));
    let back = procs.ts[0].addr.clone();
    println!("{step}: ts0 back as {back} {:.1?} after the kill", since.elapsed());

    // Whole again, ts0 holding rows, every replica exact.
    common::finish_step(&client, &mut procs, &shared, step, since, ops_before, &[]).await;
    let s = client.cluster_status().await.unwrap();
    let rows = s.members.iter().find(|m| m.addr == back).map(|m| m.rows).unwrap_or(0);
    assert!(rows > 0, "ts0 took no row back:\n{}", common::describe(&s, &[]));
    let text = common::http_get(&metrics, "/metrics").await;
    let copied = counter(&text, "blizzard_fill_bytes_total");
    let kept = counter(&text, "blizzard_fill_unchanged_bytes_total");
    println!("{step}: ts0 back in {rows} rows; repaired {copied} bytes, kept {kept} bytes unchanged");
    assert!(kept > 0.0, "ts0 kept nothing: it copied whole tracts\n{text}");
    assert!(copied < kept, "ts0 copied {copied} bytes and kept only {kept}");
    common::stop_load(&shared, load).await;
    common::verify(&shared, "at the end").await;
}
