//! The metadata service as three real `blizzard meta` processes (design
//! 0007): six tractservers at 3-way replication serve a blob load that
//! checks every byte it reads against what was acknowledged, while the
//! leading replica is SIGKILLed and restarted, once per replica. The load
//! sees no error (tractservers keep serving on their leases while a new
//! leader is elected); a killed replica restarts and catches up; the
//! longest time no load operation completed is reported. Then one writer
//! per volume across processes: a `blizzard nbd` serving a volume holds
//! its lease, so a second one, `volume resize` and `volume delete` are
//! refused naming it; `--read-only` is served; after the holder is
//! SIGKILLed, `--take-over` serves it at once.

#![allow(clippy::unwrap_used)]
// Real processes, sockets and time.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use blizzard_client::{Client, ClientConfig};
use blizzard_env::Env;

use common::{blizzard, free_port, nbd, spawn_meta, wait_leader, Proc, Shared};

const TRACTSERVERS: usize = 6;
const REPLICATION: u8 = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_continues_while_each_metadata_leader_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let meta = addrs.join(",");
    let mut metas: Vec<Proc> =
        (0..3).map(|i| spawn_meta(dir.path(), &addrs, i, REPLICATION, TRACTSERVERS)).collect();
    let mut ts = common::spawn_tractservers(dir.path(), &meta, TRACTSERVERS, "256MiB");
    let env = Env::real();
    let mut cfg = ClientConfig::new(meta.clone());
    cfg.connect_timeout = Duration::from_secs(60);
    let client = Client::connect(env.clone(), cfg).await.unwrap();
    let mut rng = SmallRng::seed_from_u64(env.random_u64());
    let (blobs, model) = common::fill_blobs(&client, &mut rng, 2, 16, REPLICATION).await;
    let shared = Arc::new(Shared::new(blobs, model, 2, client.tract_size() as usize, 64 << 10));
    let load = common::start_load(&shared, env.random_u64(), 3, 2);
    // The longest time in which no operation of the load completed.
    let stall = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let (mut last, mut since, mut longest) = ((0, 0), Instant::now(), Duration::ZERO);
            while !shared.stop.load(std::sync::atomic::Ordering::SeqCst) {
                let now = shared.ops();
                if now != last {
                    last = now;
                    since = Instant::now();
                }
                longest = longest.max(since.elapsed());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            longest
        })
    };

    let mut killed = std::collections::BTreeSet::new();
    while killed.len() < 3 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let l = wait_leader(&addrs, None).await;
        let before = shared.ops();
        let t = Instant::now();
        println!("SIGKILL metadata leader meta{} ({})", l + 1, addrs[l]);
        metas[l].kill();
        let next = wait_leader(&addrs, Some(l)).await;
        println!("meta{} leads after {} ms", next + 1, t.elapsed().as_millis());
        tokio::time::sleep(Duration::from_secs(2)).await;
        shared.assert_no_failures(&format!("after killing meta{}", l + 1));
        let after = shared.ops();
        assert!(after.0 > before.0 && after.1 > before.1, "the load went on: {before:?} -> {after:?}");
        metas[l] = spawn_meta(dir.path(), &addrs, l, REPLICATION, TRACTSERVERS);
        killed.insert(l);
        // It catches up (its own log, then the leader's).
        common::wait_caught_up(&addrs, l, next).await;
    }
    common::stop_load(&shared, load).await;
    let longest = stall.await.unwrap();
    common::verify(&shared, "after every replica was killed once").await;
    let (w, r) = shared.ops();
    println!(
        "load: {w} writes, {r} reads, no errors; longest time without a completed operation: {} ms",
        longest.as_millis()
    );
    for p in ts.iter_mut().chain(metas.iter_mut()) {
        p.check_running();
    }
    one_writer_per_volume(dir.path(), &meta);
}

fn one_writer_per_volume(dir: &Path, meta: &str) {
    let (ok, out) =
        blizzard(&["volume", "create", "v", "--size", "64MiB", "--replication", "3", "--meta", meta]);
    assert!(ok, "volume create: {out}");
    let mut first = nbd(dir, meta, "nbd1", "v", &[]);
    first.wait_log("NBD export ", Duration::from_secs(30));
    let holder = format!(":{}/", first.pid().unwrap());

    // A second server for the same volume stops at once, naming the holder.
    let mut second = nbd(dir, meta, "nbd2", "v", &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while second.running() {
        assert!(Instant::now() < deadline, "a second blizzard nbd kept running:\n{}", second.tail());
        std::thread::sleep(Duration::from_millis(20));
    }
    let refused = second.log_text();
    assert!(refused.contains("is open for writing by") && refused.contains(&holder), "{refused}");
    println!("second blizzard nbd: {}", refused.lines().last().unwrap_or(""));
    // Deleting it is refused, naming the holder; resizing goes through
    // the holder (its control socket on this host).
    let (ok, out) = blizzard(&["volume", "delete", "v", "--meta", meta]);
    assert!(!ok && out.contains("is open for writing by") && out.contains(&holder), "volume delete: {out}");
    let (ok, out) = blizzard(&["volume", "resize", "v", "--size", "128MiB", "--meta", meta]);
    assert!(ok && out.contains("through the process serving it"), "volume resize: {out}");
    let (ok, out) = blizzard(&["volume", "info", "v", "--meta", meta]);
    assert!(ok && out.contains("held by") && out.contains(&holder), "volume info: {out}");
    // Read-only needs no lease.
    let mut reader = nbd(dir, meta, "nbd3", "v", &["--read-only"]);
    reader.wait_log("NBD export ", Duration::from_secs(30));

    // The holder dies; an operator who knows it takes the volume over.
    first.kill();
    let mut next = nbd(dir, meta, "nbd4", "v", &["--take-over"]);
    next.wait_log("NBD export ", Duration::from_secs(30));
    let (ok, out) = blizzard(&["volume", "info", "v", "--meta", meta]);
    assert!(ok && out.contains(&format!(":{}/", next.pid().unwrap())), "volume info: {out}");
    reader.check_running();
}
