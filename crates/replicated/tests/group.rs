//! Replica groups in one process, on real unix sockets and files: a group
//! elects a leader and applies updates; updates survive the leader's loss
//! and a restart of every member; a retried update applies once; a member
//! far behind catches up from a snapshot; reads are linearizable through
//! leader changes.

// Real time: the groups run on real sockets and files.
#![allow(clippy::disallowed_methods)]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_proto::DecodeError;
use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::node::{Node, NodeConfig};
use blizzard_replicated::service::{Footprint, Position, Service};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A test service: named counters. `add NAME N` adds N (replies with the
/// new value); reads `NAME` give the value. Adds to one counter conflict;
/// adds to different ones commute.
#[derive(Default)]
struct Counters {
    values: Mutex<BTreeMap<String, i64>>,
    applied: AtomicU64,
}

struct Add {
    name: String,
    n: i64,
}

fn add(name: &str, n: i64) -> Bytes {
    Bytes::from(format!("{name} {n}"))
}

impl Service for Counters {
    type Op = Add;
    type Snapshot = BTreeMap<String, i64>;

    fn decode(&self, bytes: &Bytes) -> Result<Add, DecodeError> {
        let s = std::str::from_utf8(bytes).map_err(|_| DecodeError::BadString)?;
        let (name, n) = s.split_once(' ').ok_or(DecodeError::BadString)?;
        let n = n.parse().map_err(|_| DecodeError::BadString)?;
        Ok(Add { name: name.to_string(), n })
    }
    fn footprint(&self, op: &Add) -> Footprint {
        Footprint::exclusive(blizzard_core::crc::crc32c(op.name.as_bytes()) as u64)
    }
    fn apply(&self, op: &Add, _at: Position) -> Bytes {
        self.applied.fetch_add(1, Ordering::Relaxed);
        let mut g = self.values.lock().unwrap();
        let v = g.entry(op.name.clone()).or_default();
        *v += op.n;
        Bytes::from(v.to_string())
    }
    fn read(&self, query: &Bytes) -> Result<Bytes, String> {
        let name = std::str::from_utf8(query).map_err(|e| e.to_string())?;
        Ok(Bytes::from(self.values.lock().unwrap().get(name).copied().unwrap_or(0).to_string()))
    }
    fn snapshot(&self) -> BTreeMap<String, i64> {
        self.values.lock().unwrap().clone()
    }
    fn write_snapshot(&self, snap: &BTreeMap<String, i64>, out: &mut dyn FnMut(Bytes)) {
        for (k, v) in snap {
            out(Bytes::from(format!("{k} {v}\n")));
        }
    }
    fn restore(&self, bytes: &Bytes) -> Result<(), DecodeError> {
        let s = std::str::from_utf8(bytes).map_err(|_| DecodeError::BadString)?;
        let mut m = BTreeMap::new();
        for line in s.lines() {
            let (k, v) = line.split_once(' ').ok_or(DecodeError::BadString)?;
            m.insert(k.to_string(), v.parse().map_err(|_| DecodeError::BadString)?);
        }
        *self.values.lock().unwrap() = m;
        Ok(())
    }
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

struct Group {
    dir: tempfile::TempDir,
    members: BTreeMap<u64, String>,
    nodes: BTreeMap<u64, (Node<Counters>, Arc<Counters>)>,
    snapshot_every: u64,
}

impl Group {
    async fn start(n: u64, snapshot_every: u64) -> Result<Group, Box<dyn std::error::Error + Send + Sync>> {
        init_tracing();
        let dir = tempfile::tempdir()?;
        let members: BTreeMap<u64, String> =
            (1..=n).map(|i| (i, format!("unix:{}/m{i}.sock", dir.path().display()))).collect();
        let mut g = Group { dir, members, nodes: BTreeMap::new(), snapshot_every };
        for i in 1..=n {
            g.start_member(i).await?;
        }
        Ok(g)
    }

    async fn start_member(&mut self, id: u64) -> R {
        let mut cfg = NodeConfig::new(id, self.members.clone(), self.dir.path().join(format!("m{id}")));
        cfg.snapshot_every = self.snapshot_every;
        cfg.machine.apply_threads = 2;
        cfg.metrics_listen = Some(self.metrics_addr(id));
        let svc = Arc::new(Counters::default());
        let node = Node::start(Env::real(), cfg, svc.clone()).await?;
        self.nodes.insert(id, (node, svc));
        Ok(())
    }

    async fn stop_member(&mut self, id: u64) {
        if let Some((n, _)) = self.nodes.remove(&id) {
            n.stop().await;
        }
    }

    fn metrics_addr(&self, id: u64) -> String {
        format!("unix:{}/m{id}.metrics", self.dir.path().display())
    }

    /// A member's `GET /metrics` answer.
    async fn metrics(&self, id: u64) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = Env::real().connect(&self.metrics_addr(id)).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        Ok(out)
    }

    fn client(&self) -> Client {
        let cfg = ClientConfig { attempt_timeout: Duration::from_millis(500), ..ClientConfig::default() };
        Client::new(&Env::real(), self.members.values().cloned().collect(), cfg)
    }

    async fn leader(&self) -> u64 {
        for _ in 0..200 {
            for (id, (n, _)) in &self.nodes {
                if n.raft().is_leader() {
                    return *id;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no leader within 4 s");
    }

    async fn stop(mut self) {
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        for id in ids {
            self.stop_member(id).await;
        }
    }
}

/// Three members elect a leader; updates apply once each, in every
/// member's state, and reads see them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_apply_updates_everywhere() -> R {
    let g = Group::start(3, 10_000).await?;
    let c = g.client();
    for i in 1..=20 {
        let r = c.update(add("a", i)).await?;
        assert_eq!(r, Bytes::from((1..=i).sum::<i64>().to_string()));
    }
    c.update(add("b", 5)).await?;
    assert_eq!(c.read(Bytes::from("a")).await?, Bytes::from("210"));
    // Every member applies every update exactly once.
    let want = 21;
    for _ in 0..100 {
        if g.nodes.values().all(|(_, s)| s.applied.load(Ordering::Relaxed) == want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for (id, (_, s)) in &g.nodes {
        assert_eq!(s.applied.load(Ordering::Relaxed), want, "member {id}");
        assert_eq!(s.values.lock().unwrap().get("a"), Some(&210), "member {id}");
    }
    // Operators see it too: every member's metrics, the leader's with its
    // followers' progress.
    let leader = g.leader().await;
    for id in 1..=3 {
        let m = g.metrics(id).await?;
        assert!(m.starts_with("HTTP/1.1 200 OK"), "{m}");
        assert!(m.contains("blizzard_runtime_ops_applied_total 21\n"), "member {id}: {m}");
        let leads = if id == leader { "blizzard_raft_leader 1\n" } else { "blizzard_raft_leader 0\n" };
        assert!(m.contains(leads), "member {id}: {m}");
    }
    assert!(g.metrics(leader).await?.contains("blizzard_raft_member_matched_index{member=\"3\"}"));
    g.stop().await;
    Ok(())
}

/// A retried update (same session and number) is applied once and gets
/// the first reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_applied_once() -> R {
    let g = Group::start(3, 10_000).await?;
    let c = g.client();
    c.open_session().await?;
    let first = c.update_as(1, add("x", 7)).await?;
    let again = c.update_as(1, add("x", 7)).await?;
    assert_eq!(first, Bytes::from("7"));
    assert_eq!(again, first, "the first reply, not a second application");
    assert_eq!(c.read(Bytes::from("x")).await?, Bytes::from("7"));
    g.stop().await;
    Ok(())
}

/// The leader stops; a new one is elected; acknowledged updates are kept,
/// writes go on, and an update in doubt retried after the change applies
/// once. The old leader returns and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_survive_the_leaders_loss() -> R {
    let mut g = Group::start(3, 10_000).await?;
    let c = g.client();
    for _ in 0..10 {
        c.update(add("n", 1)).await?;
    }
    let old = g.leader().await;
    g.stop_member(old).await;
    // Retried across the change until a new leader applies it.
    for _ in 0..10 {
        c.update(add("n", 1)).await?;
    }
    assert_eq!(c.read(Bytes::from("n")).await?, Bytes::from("20"));
    let new = g.leader().await;
    assert_ne!(new, old);
    g.start_member(old).await?;
    for _ in 0..200 {
        if g.nodes[&old].1.values.lock().unwrap().get("n") == Some(&20) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(g.nodes[&old].1.values.lock().unwrap().get("n"), Some(&20), "the old leader caught up");
    g.stop().await;
    Ok(())
}

/// Every member stops and starts again: the state comes back from the log
/// (and snapshots), and the sessions with it (a retry after the restart is
/// still answered, not applied again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_group_restart_keeps_state_and_sessions() -> R {
    let mut g = Group::start(3, 25).await?;
    let c = g.client();
    c.open_session().await?;
    for seq in 1..=60 {
        c.update_as(seq, add("k", 2)).await?;
    }
    for id in 1..=3 {
        g.stop_member(id).await;
    }
    for id in 1..=3 {
        g.start_member(id).await?;
    }
    assert_eq!(c.read(Bytes::from("k")).await?, Bytes::from("120"));
    // The last update again: answered from the session table.
    assert_eq!(c.update_as(60, add("k", 2)).await?, Bytes::from("120"));
    assert_eq!(c.read(Bytes::from("k")).await?, Bytes::from("120"));
    g.stop().await;
    Ok(())
}

/// A member stopped while the group took many entries (and snapshotted
/// and purged its log) comes back through a snapshot sent by the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_far_behind_catches_up_from_a_snapshot() -> R {
    let mut g = Group::start(3, 20).await?;
    let c = g.client();
    c.update(add("s", 1)).await?;
    let leader = g.leader().await;
    let lagger = (1..=3).find(|i| *i != leader).unwrap();
    g.stop_member(lagger).await;
    for _ in 0..200 {
        c.update(add("s", 1)).await?;
    }
    // The leader purges only when no replication stream is reading the
    // logs, and a stream to a stopped member holds them until its next
    // failed attempt: wait for the purge, so the lagger's entries are gone.
    let mut purged = None;
    for _ in 0..500 {
        purged = g.nodes[&leader].0.status().purged;
        if purged.is_some_and(|p| p > 100) {
            break;
        }
        c.update(add("s", 0)).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(purged.is_some_and(|p| p > 100), "the leader purged its log (purged through {purged:?})");
    g.start_member(lagger).await?;
    for _ in 0..300 {
        if g.nodes[&lagger].1.values.lock().unwrap().get("s") == Some(&201) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(g.nodes[&lagger].1.values.lock().unwrap().get("s"), Some(&201));
    let installed = g.nodes[&lagger].0.machine().stats().snapshots_installed.load(Ordering::Relaxed);
    assert!(installed >= 1, "caught up from a snapshot, not by replaying the purged log");
    g.stop().await;
    Ok(())
}

/// A member started with another member list is refused by its peers,
/// and a member's data directory refuses another cluster's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_member_list_is_refused() -> R {
    let mut g = Group::start(3, 10_000).await?;
    let c = g.client();
    c.update(add("z", 1)).await?;
    let leader = g.leader().await;
    let dir = g.dir.path().join(format!("m{leader}"));
    let g_members = g.members.clone();
    for id in 1..=3 {
        g.stop_member(id).await;
    }
    // Same directory, another list: refused at start, naming the problem.
    let mut other = g_members.clone();
    other.insert(4, "unix:/nonexistent/m4.sock".into());
    let r =
        Node::start(Env::real(), NodeConfig::new(leader, other, dir), Arc::new(Counters::default())).await;
    let e = r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("cluster"), "{e}");
    Ok(())
}
