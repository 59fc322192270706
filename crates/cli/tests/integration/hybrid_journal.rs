//! The hybrid tier's backup journal across real processes: two
//! tractservers of class hdd (their disks charged as spinning ones) with
//! journals on fast storage take random small writes to a 1-way blob (so
//! each byte lives on one server only), are SIGKILLed while their journals
//! hold writes the disks were never synced with, restart, replay, and
//! every acknowledged byte reads back exactly. Each journal has a second
//! area, which it must find again at the restart.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // a test of real processes in real time

use crate::common;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_client::{Client, ClientConfig};
use blizzard_env::Env;

use common::{free_port, meta_args, Proc, Procs};

const TRACTSERVERS: usize = 2;
const TRACTS: u64 = 8;
const TRACT_SIZE: usize = 1 << 20;
const WRITES: usize = 300;

fn spawn_hdd_tractserver(dir: &Path, meta: &str, i: usize, metrics: &str) -> Proc {
    let disk = dir.join(format!("ts{i}.disk")).display().to_string();
    let journal = dir.join(format!("ts{i}.journal")).display().to_string();
    let second = dir.join(format!("ts{i}.journal2")).display().to_string();
    let args: Vec<String> = [
        "tractserver",
        "--insecure",
        "--disk",
        &disk,
        "--create-size",
        "128MiB",
        "--meta",
        meta,
        "--listen",
        "127.0.0.1:0",
        "--class",
        "hdd",
        "--disk-model",
        "hdd",
        "--journal",
        &journal,
        "--journal-size",
        "32MiB",
        // A second area, named in the journal's head at the first start,
        // and opened with it after the kill.
        "--journal-overflow",
        &second,
        "--journal-overflow-size",
        "8MiB",
        // Only a quarter-full journal destages: the kill finds it full of
        // writes the disk has not been synced with.
        "--journal-destage-ms",
        "600000",
        "--metrics",
        metrics,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    Proc::spawn(&format!("ts{i}"), &args, dir.join(format!("ts{i}.log")), String::new())
}

/// The log without its terminal colour codes (`ESC [ ... m`).
fn strip_colours(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The `name` figure of a Prometheus text.
fn figure(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')).map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_hdd_tractservers_replay_their_journals() {
    let dir = tempfile::tempdir().unwrap();
    let meta_addr = format!("127.0.0.1:{}", free_port());
    let meta = Proc::spawn(
        "meta",
        &meta_args(&meta_addr, 1, TRACTSERVERS, None),
        dir.path().join("meta.log"),
        meta_addr.clone(),
    );
    let metrics: Vec<String> = (0..TRACTSERVERS).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let mut procs = Procs { meta, ts: Vec::new() };
    for (i, m) in metrics.iter().enumerate() {
        procs.ts.push(spawn_hdd_tractserver(dir.path(), &meta_addr, i, m));
    }
    procs.wait_listening(Duration::from_secs(30));

    let client = Client::connect(Env::real(), ClientConfig::new(meta_addr.clone())).await.unwrap();
    let blob = client.create_blob(None, 1).await.unwrap();
    blob.extend_to(TRACTS).await.unwrap();
    let seed: u64 = rand::rng().random();
    eprintln!("hybrid journal seed {seed}");
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut model = vec![vec![0u8; TRACT_SIZE]; TRACTS as usize];
    // Random small writes, 4 KiB aligned and not, eight at a time: one per
    // tract, so no two in flight together overlap (their order would be
    // the network's).
    let mut batch = Vec::new();
    for n in 0..WRITES {
        let tract = n as u64 % TRACTS;
        let len =
            if rng.random_bool(0.7) { 4096 * rng.random_range(1..5) } else { rng.random_range(1..20_000) };
        let mut off = rng.random_range(0..(TRACT_SIZE - len)) as u32;
        if rng.random_bool(0.7) {
            off &= !4095;
        }
        let mut data = vec![0u8; len];
        rng.fill(&mut data[..]);
        model[tract as usize][off as usize..off as usize + len].copy_from_slice(&data);
        batch.push(blob.write(tract, off, Bytes::from(data)));
        if batch.len() == TRACTS as usize || n + 1 == WRITES {
            for w in std::mem::take(&mut batch) {
                w.await.unwrap();
            }
        }
    }

    // The journals hold the writes; the disks were never synced for them.
    let mut held = 0.0;
    for m in &metrics {
        held += figure(&common::http_get(m, "/metrics").await, "blizzard_backup_journal_records");
    }
    assert!(held >= WRITES as f64, "journals hold {held} records, want at least {WRITES}");
    // The operator sees each server's class and journal use.
    let (ok, status) = common::blizzard(&["status", "--meta", &meta_addr]);
    assert!(ok, "{status}");
    assert_eq!(status.matches(" hdd+j ").count(), TRACTSERVERS, "{status}");

    for ts in procs.ts.iter_mut() {
        ts.kill();
    }
    procs.ts.clear();
    for (i, m) in metrics.iter().enumerate() {
        procs.ts.push(spawn_hdd_tractserver(dir.path(), &meta_addr, i, m));
    }
    procs.wait_listening(Duration::from_secs(30));
    let mut replayed = 0u64;
    for p in &procs.ts {
        let text = strip_colours(&p.log_text());
        let line = text.lines().rfind(|l| l.contains("backup journal attached")).unwrap().to_string();
        let n: u64 = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("replayed_records="))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no replayed_records in {line:?}"));
        replayed += n;
    }
    assert!(replayed >= WRITES as u64, "replayed {replayed} records");

    // Every acknowledged byte, from the restarted servers.
    let client = Client::connect(Env::real(), ClientConfig::new(meta_addr.clone())).await.unwrap();
    let blob = client.open_blob(blob.id()).await.unwrap();
    for t in 0..TRACTS {
        let got = blob.read(t, 0, TRACT_SIZE as u32).await.unwrap();
        if let Some(i) = common::first_difference(&got, &model[t as usize]) {
            panic!("tract {t} differs at byte {i} after the restart (seed {seed})");
        }
    }
    // Replayed, the journals are empty again.
    for m in &metrics {
        let text = common::http_get(m, "/metrics").await;
        assert_eq!(figure(&text, "blizzard_backup_journal_records"), 0.0);
    }
}
