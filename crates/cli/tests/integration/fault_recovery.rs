//! Failure recovery across real processes: a metadata server and ten
//! tractservers run as `blizzard` processes on loopback TCP and disk files,
//! three 3-way blobs take a continuous verified load from this process, and
//! tractservers are SIGKILLed one step at a time (one; two in quick
//! succession; one, then one of the newcomers while it is still copying;
//! the metadata server; one more under the restarted metadata server), and
//! then two new tractservers join, taking their share of the table.
//! After each step the metadata server must declare every killed server
//! dead and bring every row back to three complete replicas, and then every
//! replica of every tract must hold exactly the bytes acknowledged to the
//! load. Six of the ten tractservers die in all; four remain for 3-way
//! rows until the two newcomers join.
//!
//! The load never sees an error: the client is meant to ride through a
//! failure by retrying against the refreshed TLT, so a failed read or write
//! fails the test. It keeps a model of every acknowledged byte and takes a
//! per-tract lock around each operation, so a read never races a write of
//! the same tract (whose outcome, old or new, would be ambiguous).
//!
//! The random choices (data, offsets, victims) come from a seed printed at
//! the start; set `FAULT_RECOVERY_SEED` to reuse one. Process timing still
//! varies between runs, so a seed narrows a failure down but need not
//! replay it.

// The test drives real processes and sockets in real time, outside the env
// seam, and a failure must stop it with its context.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_client::{Client, ClientConfig};
use blizzard_env::Env;

use common::{free_port, meta_args, Proc, Procs, Shared};

const TRACTSERVERS: usize = 10;
const REPLICATION: u8 = 3;
const TRACT_SIZE: usize = 1 << 20;
const BLOBS: usize = 3;
const TRACTS_PER_BLOB: u64 = 32;
const WRITERS: u64 = 4;
const READERS: u64 = 2;
const MAX_IO: usize = 64 << 10;

/// Starts the cluster; the metadata server's metrics listen on `metrics`.
fn start_cluster(dir: &Path, metrics: &str) -> Procs {
    let meta_addr = format!("127.0.0.1:{}", free_port());
    let meta = Proc::spawn(
        "meta",
        &meta_args(&meta_addr, REPLICATION, TRACTSERVERS, Some(metrics)),
        dir.join("meta.log"),
        meta_addr.clone(),
    );
    let mut procs = Procs { meta, ts: Vec::new() };
    for i in 0..TRACTSERVERS {
        spawn_tractserver(&mut procs, dir, i);
    }
    procs.wait_listening(Duration::from_secs(30));
    procs
}

/// Starts tractserver `i` on a new disk (the caller waits for it to listen).
fn spawn_tractserver(procs: &mut Procs, dir: &Path, i: usize) {
    let meta = procs.meta.addr.clone();
    procs.ts.push(common::spawn_tractserver(dir, &meta, i, "256MiB"));
}

/// A tractserver still running, chosen at random.
fn random_live(procs: &Procs, rng: &mut SmallRng) -> String {
    let live: Vec<&Proc> = procs.ts.iter().filter(|p| !p.killed()).collect();
    live[rng.random_range(0..live.len())].addr.clone()
}

fn kill(procs: &mut Procs, addr: &str, step: &str) {
    let p = procs.by_addr(addr).unwrap();
    println!("{step}: SIGKILL {} ({addr})", p.name);
    p.kill();
}

/// [`common::finish_step`] for the servers killed so far.
async fn finish_step(
    client: &Client,
    procs: &mut Procs,
    shared: &Shared,
    step: &str,
    since: Instant,
    ops_before: (u64, u64),
) {
    let killed = procs.killed_addrs();
    common::finish_step(client, procs, shared, step, since, ops_before, &killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_recovers_from_tractserver_kills_under_load() {
    let seed = match std::env::var("FAULT_RECOVERY_SEED") {
        Ok(s) => s.parse().expect("FAULT_RECOVERY_SEED must be a u64"),
        Err(_) => Env::real().random_u64(),
    };
    println!("seed {seed} (set FAULT_RECOVERY_SEED={seed} to reuse it)");
    let mut rng = SmallRng::seed_from_u64(seed);

    let dir = tempfile::tempdir().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut procs = start_cluster(dir.path(), &metrics);
    let client = Client::connect(Env::real(), ClientConfig::new(procs.meta.addr.clone())).await.unwrap();
    assert_eq!(client.tract_size() as usize, TRACT_SIZE);

    // Blobs, filled with random data so every replica of every tract holds
    // something to compare.
    let start = Instant::now();
    let (blobs, model) = common::fill_blobs(&client, &mut rng, BLOBS, TRACTS_PER_BLOB, REPLICATION).await;
    println!("filled {BLOBS} blobs of {TRACTS_PER_BLOB} tracts in {:.1?}", start.elapsed());
    let shared = Arc::new(Shared::new(blobs, model, BLOBS, TRACT_SIZE, MAX_IO));
    let load = common::start_load(&shared, seed, WRITERS, READERS);

    // Steady state: the load runs on a healthy cluster, and the verifier
    // sees every replica agree before anything fails.
    let ops_before = shared.ops();
    tokio::time::sleep(Duration::from_secs(2)).await;
    procs.check_running();
    shared.assert_no_failures("on a healthy cluster");
    let (w, r) = shared.ops();
    println!("steady state: {} writes and {} reads in 2 s", w - ops_before.0, r - ops_before.1);
    assert!(w > ops_before.0 && r > ops_before.1, "the load made no progress on a healthy cluster");
    common::verify(&shared, "before any kill").await;

    // a. One tractserver.
    let step = "step a (one kill)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // b. Two more, the second while the first may still be undetected.
    let step = "step b (two kills 300 ms apart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // c. One, then a server that is copying rows for that failure: a
    // failure during recovery. A newcomer shows `fill.rows > 0` once the
    // first is declared dead; if none is seen within 3 s (copying was too
    // quick to catch), any live server goes instead.
    let step = "step c (a kill during recovery)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    let killed = procs.killed_addrs();
    let mut filling = None;
    while filling.is_none() && since.elapsed() < Duration::from_secs(3) {
        if let Ok(s) = client.cluster_status().await {
            let fillers: Vec<&str> = s
                .members
                .iter()
                .filter(|m| m.fill.rows > 0 && !killed.contains(&m.addr))
                .map(|m| m.addr.as_str())
                .collect();
            if !fillers.is_empty() {
                filling = Some(fillers[rng.random_range(0..fillers.len())].to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = match filling {
        Some(a) => {
            println!("{step}: {a} is filling {:.1?} after the first kill", since.elapsed());
            a
        }
        None => {
            println!("{step}: no member seen filling within 3 s; killing a random live one");
            random_live(&procs, &mut rng)
        }
    };
    kill(&mut procs, &second, step);
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // d. The metadata server, SIGKILLed mid-load and started again on the
    // same address: it rebuilds the TLT from the tractservers' stored
    // assignments while clients keep going on the table they cached.
    let step = "step d (metadata server restart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    println!("{step}: SIGKILL meta ({})", procs.meta.addr);
    procs.meta.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let addr = procs.meta.addr.clone();
    procs.meta = Proc::spawn(
        "meta",
        &meta_args(&addr, REPLICATION, TRACTSERVERS, Some(&metrics)),
        dir.path().join("meta-2.log"),
        addr,
    );
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;

    // e. One more tractserver, under the rebuilt metadata server (which
    // never saw the earlier deaths): four remain.
    let step = "step e (a kill after the metadata server restart)";
    let ops_before = shared.ops();
    let since = Instant::now();
    let victim = random_live(&procs, &mut rng);
    kill(&mut procs, &victim, step);
    // An operator following it: once the status shows the server down,
    // `blizzard status --watch` returns when the rows are whole again and
    // shows the dead server.
    loop {
        if let Ok(s) = client.cluster_status().await {
            if s.members.iter().any(|m| m.addr == victim && !m.alive) {
                break;
            }
        }
        assert!(since.elapsed() < common::RECOVERY_TIMEOUT, "{step}: the killed server never showed as down");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let watch = Command::new(common::blizzard_bin())
        .args(["status", "--watch", "--meta", &procs.meta.addr])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;
    let out = tokio::task::spawn_blocking(move || watch.wait_with_output()).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "blizzard status --watch failed:\n{text}");
    assert!(text.contains("every row has all 3 members alive and complete"), "{text}");
    assert!(text.lines().any(|l| l.contains(&victim) && l.contains(" dead ")), "{text}");
    println!("{step}: blizzard status --watch ended with:\n{text}");

    // f. Two new tractservers join mid-load (FDS §3.4): each takes its
    // share of TLT entries as pending, copies them while the load writes
    // to old and new members alike, and is committed in their place.
    let step = "step f (two tractservers join)";
    let ops_before = shared.ops();
    let since = Instant::now();
    for i in TRACTSERVERS..TRACTSERVERS + 2 {
        spawn_tractserver(&mut procs, dir.path(), i);
        println!("{step}: started ts{i}");
    }
    procs.wait_listening(Duration::from_secs(30));
    let joined: Vec<String> = procs.ts[TRACTSERVERS..].iter().map(|p| p.addr.clone()).collect();
    let s = common::wait_status(&client, &mut procs, &shared, step, "both new servers hold rows", &[], |s| {
        joined.iter().all(|a| s.members.iter().any(|m| &m.addr == a && m.alive && m.rows > 0))
    })
    .await;
    println!("{step}: both joined {:.1?} after starting", since.elapsed());
    println!("{}", common::describe(&s, &[]));
    finish_step(&client, &mut procs, &shared, step, since, ops_before).await;
    // Every live server now holds its share of the table's positions.
    let s = client.cluster_status().await.unwrap();
    let live: Vec<_> = s.members.iter().filter(|m| m.alive).collect();
    let positions: u32 = live.iter().map(|m| m.rows).sum();
    let fair = positions as f64 / live.len() as f64;
    for m in &live {
        assert!(
            (m.rows as f64) >= fair * 0.8 - 1.0 && (m.rows as f64) <= fair * 1.2 + 1.0,
            "{step}: {} holds {} positions, fair share {fair:.1}:\n{}",
            m.addr,
            m.rows,
            common::describe(&s, &[])
        );
    }

    common::stop_load(&shared, load).await;
    let (w, r) = shared.ops();
    println!("done: {w} writes and {r} reads verified in all");

    // The operator's view agrees: the metadata server's metrics show the
    // cluster whole again, with the server killed in step e dead.
    let text = common::http_get(&metrics, "/metrics").await;
    for want in [
        "blizzard_rows_filling 0\n",
        "blizzard_rows_degraded 0\n",
        "blizzard_tractservers{state=\"dead\"} 1\n",
    ] {
        assert!(text.contains(want), "metrics lack {want:?}:\n{text}");
    }
    let copied = text
        .lines()
        .find_map(|l| l.strip_prefix("blizzard_recovery_bytes_total "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(copied > 0.0, "no recovery bytes in the metrics:\n{text}");
}
