//! The replicated runtime in real processes: three `blizzard kv serve`
//! members, a verified load from four clients, and the leader SIGKILLed
//! (and started again on its data) ten times. No acknowledged operation is
//! lost, and none is applied twice: every acknowledged `put` reads back,
//! and every push (not idempotent: applied twice, it would leave two
//! elements) is in its queue exactly once, an unacknowledged one at most
//! once.

#![allow(clippy::unwrap_used)]
// Real processes and real time.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::ds::ops::{Query, QueryReply, Update, UpdateReply};

use common::Proc;

const MEMBERS: u64 = 3;
const KILLS: usize = 10;
const CLIENTS: usize = 4;
/// Pushes per queue: below a `Peek`'s bound, so one read sees a queue whole.
const PER_QUEUE: u64 = 500;

fn serve_args(id: u64, peers: &str, dir: &std::path::Path) -> Vec<String> {
    [
        "kv",
        "serve",
        "--insecure",
        "--id",
        &id.to_string(),
        "--peers",
        peers,
        "--data",
        &dir.join(format!("m{id}")).display().to_string(),
        "--heartbeat-ms",
        "50",
        "--election-timeout-ms",
        "150..300",
        // Small: snapshots (and log purges) happen during the test.
        "--snapshot-every",
        "200",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// What the clients had acknowledged, and what they sent without an answer.
#[derive(Default)]
struct Seen {
    puts: BTreeMap<String, String>,
    pushes_acked: BTreeSet<String>,
    pushes_unknown: BTreeSet<String>,
}

async fn load(client: Client, id: usize, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        if n.is_multiple_of(2) {
            let (key, value) = (format!("c{id}-k{}", n % 50), format!("v{n}"));
            let op = Update::Put { key: key.clone().into(), value: value.clone().into() };
            match client.update(op.encode()).await {
                Ok(_) => {
                    seen.lock().unwrap().puts.insert(key, value);
                }
                // A put in doubt leaves the key at this value or the last
                // acknowledged one: stop checking that key exactly.
                Err(e) => panic!("client {id}: put failed through the failovers: {e}"),
            }
        } else {
            let value = format!("c{id}-p{n}");
            let queue = format!("q{id}-{}", n / (2 * PER_QUEUE));
            let op = Update::Push { queue: queue.into(), priority: n as i64, value: value.clone().into() };
            match client.update(op.encode()).await {
                Ok(_) => {
                    seen.lock().unwrap().pushes_acked.insert(value);
                }
                Err(e) => {
                    seen.lock().unwrap().pushes_unknown.insert(value);
                    panic!("client {id}: push failed through the failovers: {e}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_killed_ten_times_loses_nothing_and_applies_nothing_twice() {
    let dir = tempfile::tempdir().unwrap();
    let addrs: Vec<String> =
        (1..=MEMBERS).map(|i| format!("unix:{}/m{i}.sock", dir.path().display())).collect();
    let peers = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect::<Vec<_>>().join(",");
    let mut procs: Vec<Proc> = (1..=MEMBERS)
        .map(|id| {
            let log = dir.path().join(format!("m{id}.log"));
            Proc::spawn(
                &format!("member {id}"),
                &serve_args(id, &peers, dir.path()),
                log,
                addrs[id as usize - 1].clone(),
            )
        })
        .collect();
    for p in &mut procs {
        p.wait_log("kv member serving", Duration::from_secs(20));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let cfg = ClientConfig { attempt_timeout: Duration::from_millis(500), ..ClientConfig::default() };
    let loads: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let c = Client::new(&Env::real(), addrs.clone(), cfg.clone());
            tokio::spawn(load(c, id, stop.clone(), seen.clone()))
        })
        .collect();

    let start = Instant::now();
    for kill in 0..KILLS {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        let victim = loop {
            if let Some(l) = common::group_leader(&addrs).await {
                break l;
            }
            assert!(Instant::now() < deadline, "no leader before kill {kill}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let acked_before = seen.lock().unwrap().pushes_acked.len();
        procs[victim].kill();
        // The load goes on: a new leader takes over.
        let deadline = Instant::now() + Duration::from_secs(20);
        while seen.lock().unwrap().pushes_acked.len() < acked_before + 20 {
            assert!(
                Instant::now() < deadline,
                "no progress after killing member {} (kill {kill})",
                victim + 1
            );
            for p in procs.iter_mut().filter(|p| !p.killed()) {
                p.check_running();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let id = victim as u64 + 1;
        let log = dir.path().join(format!("m{id}-{kill}.log"));
        procs[victim] = Proc::spawn(
            &format!("member {id}"),
            &serve_args(id, &peers, dir.path()),
            log,
            addrs[victim].clone(),
        );
        procs[victim].wait_log("kv member serving", Duration::from_secs(20));
    }
    stop.store(true, Ordering::Relaxed);
    for l in loads {
        l.await.unwrap();
    }
    eprintln!("{KILLS} leader kills in {:?}", start.elapsed());

    // Every acknowledged put reads back; every push is in its queue
    // exactly once (or, unacknowledged, at most once).
    let c = Client::new(&Env::real(), addrs.clone(), ClientConfig::default());
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    for (key, value) in &seen.puts {
        let q = Query::Get { key: key.clone().into() };
        let got = q.decode_reply(&c.read(q.encode()).await.unwrap()).unwrap();
        assert_eq!(got, QueryReply::Get(Some(Bytes::from(value.clone()))), "key {key}");
    }
    let mut found: BTreeMap<String, u32> = BTreeMap::new();
    for id in 0..CLIENTS {
        for k in 0.. {
            let q = Query::Peek { queue: format!("q{id}-{k}").into(), n: 1024 };
            let QueryReply::Peek(items) = q.decode_reply(&c.read(q.encode()).await.unwrap()).unwrap() else {
                panic!("peek")
            };
            assert!(!items.more, "queue q{id}-{k} holds more than one read shows");
            if items.items.is_empty() {
                break;
            }
            for i in items.items {
                *found.entry(String::from_utf8_lossy(&i.value).into_owned()).or_default() += 1;
            }
        }
    }
    for v in &seen.pushes_acked {
        assert_eq!(found.get(v), Some(&1), "acknowledged push {v}");
    }
    for (v, n) in &found {
        assert!(*n == 1, "push {v} applied {n} times");
        assert!(seen.pushes_acked.contains(v) || seen.pushes_unknown.contains(v), "push {v} was never sent");
    }
    assert!(seen.pushes_acked.len() > 200, "too little load: {}", seen.pushes_acked.len());
    eprintln!("verified {} puts and {} pushes", seen.puts.len(), seen.pushes_acked.len());
    // The pop side too: an update that does not commute with pushes.
    let pop = Update::Pop { queue: "q0-0".into() };
    let r = pop.decode_reply(&c.update(pop.encode()).await.unwrap()).unwrap();
    assert!(matches!(r, UpdateReply::Pop(Some(_))), "{r:?}");
}
