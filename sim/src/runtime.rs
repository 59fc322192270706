//! The replicated runtime under chaos (`blizzard-replicated`, design
//! 0006): 3 or 5 members serving the data-structures service, clients
//! running a recorded workload, and a harness that crashes members (their
//! disks losing, keeping or tearing unsynced writes), sometimes all of them
//! at once, cuts links both ways and one way, and holds them (messages
//! delayed, then delivered together), while the network duplicates
//! requests of members and clients alike and delivers the copies late
//! (`ghost`, [`RuntimeSimConfig::duplicates`]): appends, votes and
//! snapshot chunks from old terms, submits already answered.
//!
//! Checks, once the workload is done and every member is back:
//!
//! - **Linearizability** of the map's history (`Put`, `Get`, `Delete`,
//!   `Cas` on a few keys, with invocation and response times and pending
//!   operations for requests that never got an answer), by the
//!   Wing–Gong search in [`crate::linearizable`].
//! - **Exactly once**: every client pushes unique values onto its own
//!   queue; each acknowledged push is in it exactly once, an
//!   unacknowledged one at most once. Clients also send some operations
//!   twice on purpose (the same session and sequence number, as a retry
//!   after a lost reply would): both must get the first reply.
//! - **Replica agreement**: once every member has applied the same log
//!   index, every member's state is the same, byte for byte.
//!
//! Planted bugs (`RuntimePlant`) show each check catches what it is for.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::ds::ops::{Query, QueryReply, Update, UpdateReply};
use blizzard_replicated::ds::Structures;
use blizzard_replicated::machine::Planted;
use blizzard_replicated::node::{Node, NodeConfig, Timing};
use blizzard_replicated::service::Service;

use crate::disk::SimDisks;
use crate::env::{derive_seed, lock, sim_env, sim_env_incarnation, sim_env_with_ghosts, Trace};
use crate::ghost::Ghosts;
use crate::linearizable::{self, History, KvOp, KvRet, Outcome};
use crate::net::SimNet;

/// A bug planted in every member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimePlant {
    None,
    /// The log reports appends durable before their `fdatasync`: entries
    /// are committed, and acknowledged, before a majority holds them
    /// durably.
    AckBeforeCommit,
    /// Retries are applied again instead of answered from the sessions.
    SkipSessionDedup,
    /// Operations of a run are applied in an order of their own on each
    /// member, conflicts or not.
    ParallelConflicts,
    /// An update whose reply the session forgot (the client acknowledged
    /// it) is applied again: only the network's late duplicates reach it.
    ApplyForgotten,
}

impl RuntimePlant {
    pub fn parse(s: &str) -> Option<RuntimePlant> {
        Some(match s {
            "none" => RuntimePlant::None,
            "ack-before-commit" => RuntimePlant::AckBeforeCommit,
            "skip-session-dedup" => RuntimePlant::SkipSessionDedup,
            "parallel-conflicts" => RuntimePlant::ParallelConflicts,
            "apply-forgotten" => RuntimePlant::ApplyForgotten,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            RuntimePlant::None => "none",
            RuntimePlant::AckBeforeCommit => "ack-before-commit",
            RuntimePlant::SkipSessionDedup => "skip-session-dedup",
            RuntimePlant::ParallelConflicts => "parallel-conflicts",
            RuntimePlant::ApplyForgotten => "apply-forgotten",
        }
    }
}

#[derive(Clone, Debug)]
pub struct RuntimeSimConfig {
    pub members: u64,
    pub clients: usize,
    /// Operations each client runs.
    pub ops_per_client: usize,
    /// Keys of the map the linearizability check covers.
    pub keys: usize,
    pub crashes: bool,
    pub partitions: bool,
    pub plant: RuntimePlant,
    /// One request frame in this many is delivered again, 1 ms to 2 s
    /// later (`ghost::Ghosts::any_requests`; 0: none).
    pub duplicates: u32,
}

impl Default for RuntimeSimConfig {
    fn default() -> Self {
        RuntimeSimConfig {
            members: 3,
            clients: 4,
            ops_per_client: 120,
            keys: 4,
            crashes: true,
            partitions: true,
            plant: RuntimePlant::None,
            duplicates: 40,
        }
    }
}

#[derive(Debug)]
pub struct RuntimeSimReport {
    pub seed: u64,
    pub trace: Trace,
    pub acknowledged: u64,
    pub pending: u64,
    pub member_crashes: u32,
    pub power_failures: u32,
    pub link_faults: u32,
    pub retries_sent: u64,
    /// Request frames the network delivered twice.
    pub duplicates_sent: u64,
    pub simulated: Duration,
}

const PORT: u16 = 7400;

fn member_host(id: u64) -> String {
    format!("r{id}")
}

/// One client's pushes: acknowledged, and sent with no answer.
#[derive(Clone, Default)]
struct Pushes {
    acked: Vec<String>,
    unknown: Vec<String>,
}

/// What the clients saw, for the checks.
#[derive(Default)]
struct Seen {
    history: History,
    pushed: BTreeMap<usize, Pushes>,
    acknowledged: u64,
    pending: u64,
    retries: u64,
}

/// Now, in simulated nanoseconds (the same clock on every host).
fn now_ns() -> u64 {
    turmoil::sim_elapsed().map_or(0, |d| d.as_nanos() as u64)
}

fn to_kv(u: &Update) -> Option<KvOp> {
    Some(match u {
        Update::Put { key, value } => KvOp::Put { key: key.to_vec(), value: value.to_vec() },
        Update::Delete { key } => KvOp::Delete { key: key.to_vec() },
        Update::CompareAndSwap { key, expected, new } => KvOp::Cas {
            key: key.to_vec(),
            expected: expected.as_ref().map(|b| b.to_vec()),
            new: new.as_ref().map(|b| b.to_vec()),
        },
        _ => return None,
    })
}

fn to_ret(r: &UpdateReply) -> Option<KvRet> {
    Some(match r {
        UpdateReply::Put(prev) => KvRet::Put(prev.as_ref().map(|b| b.to_vec())),
        UpdateReply::Delete(existed) => KvRet::Delete(*existed),
        UpdateReply::CompareAndSwap(c) => {
            KvRet::Cas { swapped: c.swapped, current: c.current.as_ref().map(|b| b.to_vec()) }
        }
        _ => return None,
    })
}

/// One client's workload (module header).
async fn client_workload(
    env: blizzard_env::Env,
    me: usize,
    cfg: RuntimeSimConfig,
    addrs: Vec<String>,
    seen: Arc<Mutex<Seen>>,
    trace: Trace,
) -> Result<(), String> {
    let ccfg = ClientConfig {
        attempt_timeout: Duration::from_millis(800),
        request_timeout: Duration::from_secs(60),
        election_pause: Duration::from_millis(50),
    };
    let client = Client::new(&env, addrs, ccfg);
    let mut rng = SmallRng::seed_from_u64(env.random_u64());
    let host = format!("c{me}");
    let mut pushes = 0u64;
    // History ids are per logical client: one whose request got no answer
    // continues as a new one (its operation stays pending for ever).
    let mut logical = me as u64 * 1_000_000;
    for n in 0..cfg.ops_per_client {
        let key = Bytes::from(format!("k{}", rng.random_range(0..cfg.keys)));
        let value = Bytes::from(format!("c{me}-v{n}"));
        let kind = rng.random_range(0..10);
        if kind == 9 {
            // A push: not idempotent, counted at the end.
            pushes += 1;
            let v = format!("c{me}-p{pushes}");
            let op = Update::Push { queue: format!("q{me}").into(), priority: 0, value: v.clone().into() };
            let r = client.update(op.encode()).await;
            let mut s = lock(&seen);
            let entry = s.pushed.entry(me).or_default();
            match r {
                Ok(_) => entry.acked.push(v),
                Err(e) => {
                    trace.event(&host, format!("push {v} failed: {e}"));
                    entry.unknown.push(v);
                }
            }
            continue;
        }
        if kind >= 6 {
            let at = now_ns();
            let id = lock(&seen).history.invoke(logical, KvOp::Get { key: key.to_vec() }, at);
            let q = Query::Get { key: key.clone() };
            match client.read(q.encode()).await.map(|b| q.decode_reply(&b)) {
                Ok(Ok(QueryReply::Get(v))) => {
                    trace.event(
                        &host,
                        format!("get {} = {:?} from {:?}", String::from_utf8_lossy(&key), v, client.leader()),
                    );
                    lock(&seen).history.complete(id, KvRet::Get(v.map(|b| b.to_vec())), now_ns());
                }
                Ok(other) => return Err(format!("c{me}: a get answered {other:?}")),
                Err(e) => {
                    // A read that got no answer changed nothing: it may
                    // stay pending.
                    trace.event(&host, format!("get failed: {e}"));
                    logical += 1;
                }
            }
            continue;
        }
        let op = match kind {
            0..=3 => Update::Put { key: key.clone(), value },
            4 => Update::Delete { key: key.clone() },
            _ => {
                let expected = if rng.random_bool(0.5) {
                    None
                } else {
                    Some(Bytes::from(format!("c{me}-v{}", n.saturating_sub(1))))
                };
                Update::CompareAndSwap { key: key.clone(), expected, new: Some(value) }
            }
        };
        let kv = to_kv(&op).ok_or("map op")?;
        let at = now_ns();
        let id = lock(&seen).history.invoke(logical, kv, at);
        // One op in eight is sent twice with the same number, as a client
        // retries after a lost reply: both must get the first reply.
        let twice = rng.random_ratio(1, 8);
        let r = if twice {
            let (first, again) = client.update_twice(op.encode()).await;
            lock(&seen).retries += 1;
            match (&first, &again) {
                (Ok(a), Ok(b)) if a != b => {
                    return Err(format!(
                        "c{me}: a retried {op:?} got {:?}, the first attempt {:?}: applied twice",
                        op.decode_reply(b),
                        op.decode_reply(a)
                    ))
                }
                _ => {}
            }
            first.or(again)
        } else {
            client.update(op.encode()).await
        };
        match r {
            Ok(b) => {
                let reply = op.decode_reply(&b).map_err(|e| format!("c{me}: undecodable reply: {e}"))?;
                trace.event(&host, format!("{op:?} = {reply:?} from {:?}", client.leader()));
                let ret = to_ret(&reply).ok_or("map reply")?;
                let mut s = lock(&seen);
                s.history.complete(id, ret, now_ns());
                s.acknowledged += 1;
            }
            Err(e) => {
                trace.event(&host, format!("{op:?} got no answer: {e}"));
                let mut s = lock(&seen);
                s.pending += 1;
                logical += 1;
            }
        }
    }
    trace.event(&host, "workload done");
    Ok(())
}

/// Runs one seed. `Err` says what went wrong.
pub fn run_runtime_sim(seed: u64, cfg: &RuntimeSimConfig) -> Result<RuntimeSimReport, String> {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(1800))
        .tick_duration(Duration::from_millis(1))
        .build();
    let disks = SimDisks::new(derive_seed(seed, "disks"));
    let trace = Trace::new();
    let members: BTreeMap<u64, String> =
        (1..=cfg.members).map(|id| (id, format!("{}:{PORT}", member_host(id)))).collect();
    let addrs: Vec<String> = members.values().cloned().collect();
    let ghosts = Ghosts::any_requests(SmallRng::seed_from_u64(derive_seed(seed, "ghosts")), cfg.duplicates);
    // Each member's service, by life: the replica check reads them.
    let services: Rc<RefCell<BTreeMap<u64, Arc<Structures>>>> = Rc::new(RefCell::new(BTreeMap::new()));
    for id in 1..=cfg.members {
        let (disks, members, lives, services, plant, ghosts) = (
            disks.clone(),
            members.clone(),
            Rc::new(RefCell::new(0u64)),
            services.clone(),
            cfg.plant,
            ghosts.clone(),
        );
        sim.host(member_host(id), move || {
            let life = {
                let mut l = lives.borrow_mut();
                *l += 1;
                *l
            };
            let mut env = sim_env_incarnation(seed, &member_host(id), life, disks.clone());
            env.net = Arc::new(SimNet::with_ghosts(&member_host(id), ghosts.clone()));
            let svc = Arc::new(Structures::new());
            services.borrow_mut().insert(id, svc.clone());
            let members = members.clone();
            async move {
                let mut nc = NodeConfig::new(id, members, format!("/sim/r{id}").into());
                nc.listen = format!("0.0.0.0:{PORT}");
                nc.timing = Timing { heartbeat_ms: 50, election_min_ms: 150, election_max_ms: 300 };
                nc.snapshot_every = 40;
                nc.max_batch_ops = 64;
                nc.machine.apply_threads = 2;
                nc.log.segment_len = blizzard_replicated::log::SEGMENT_LEN_MIN;
                nc.init_grace = Duration::from_secs(2);
                match plant {
                    RuntimePlant::None => {}
                    RuntimePlant::AckBeforeCommit => nc.log.planted_ack_before_sync = true,
                    RuntimePlant::SkipSessionDedup => nc.machine.plant = Some(Planted::SkipSessionDedup),
                    RuntimePlant::ParallelConflicts => nc.machine.plant = Some(Planted::ParallelConflicts),
                    RuntimePlant::ApplyForgotten => nc.machine.plant = Some(Planted::ApplyForgotten),
                }
                let node = Node::start(env, nc, svc).await.map_err(|e| e.to_string())?;
                std::future::pending::<()>().await;
                drop(node);
                Ok(())
            }
        });
    }
    let seen = Arc::new(Mutex::new(Seen::default()));
    let done = Arc::new(AtomicU64::new(0));
    for c in 0..cfg.clients {
        let host = format!("c{c}");
        let env = sim_env_with_ghosts(seed, &host, SimDisks::new(0), ghosts.clone());
        let (cfg2, addrs, seen, trace, done) =
            (cfg.clone(), addrs.clone(), seen.clone(), trace.clone(), done.clone());
        sim.client(host, async move {
            // Let the group form first.
            env.sleep(Duration::from_secs(1)).await;
            let r = client_workload(env, c, cfg2, addrs, seen, trace).await;
            done.fetch_add(1, Ordering::Relaxed);
            r.map_err(|e| -> Box<dyn std::error::Error> { e.into() })
        });
    }
    // The final checks run on a client of their own, once the workload is
    // done and faults have stopped.
    let checked = Arc::new(AtomicBool::new(false));
    {
        let env = sim_env(seed, "checker", SimDisks::new(0));
        let (addrs, seen, done, checked, clients) =
            (addrs.clone(), seen.clone(), done.clone(), checked.clone(), cfg.clients as u64);
        sim.client("checker", async move {
            while done.load(Ordering::Relaxed) < clients {
                env.sleep(Duration::from_millis(100)).await;
            }
            // Faults stop now; give the group a moment to come together.
            env.sleep(Duration::from_secs(3)).await;
            let r = final_reads(&env, addrs, &seen).await;
            checked.store(true, Ordering::Relaxed);
            r.map_err(|e| -> Box<dyn std::error::Error> { e.into() })
        });
    }

    let mut chaos = SmallRng::seed_from_u64(derive_seed(seed, "chaos"));
    let hosts: Vec<String> = (1..=cfg.members).map(member_host).collect();
    let clients: Vec<String> =
        (0..cfg.clients).map(|c| format!("c{c}")).chain(["checker".to_string()]).collect();
    let majority_down_max = ((cfg.members - 1) / 2) as usize;
    let mut down: Vec<(u64, u64)> = Vec::new(); // (member, restart at step)
    let mut cuts: Vec<(String, String, u8, u64)> = Vec::new(); // (a, b, kind, until)
    let (mut crashes, mut power, mut links) = (0u32, 0u32, 0u32);
    let mut step: u64 = 0;
    let crash_member = |sim: &mut turmoil::Sim<'_>, id: u64, trace: &Trace, now: Duration| {
        sim.crash(member_host(id));
        ghosts.crashed(&member_host(id));
        let mut report = crate::CrashReport::default();
        for (path, d) in disks.disks() {
            if path.starts_with(format!("/sim/r{id}/")) {
                report.add(d.crash());
            }
        }
        trace.event_at(now, "chaos", format!("crash r{id} {report:?}"));
    };
    loop {
        match sim.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => return Err(format!("seed {seed}: {e}\ntrace tail:\n{}", tail(&trace, 40))),
        }
        step += 1;
        let now = sim.elapsed();
        let faults_over = done.load(Ordering::Relaxed) >= cfg.clients as u64;
        let (due, rest): (Vec<_>, Vec<_>) = cuts.drain(..).partition(|c| step >= c.3 || faults_over);
        cuts = rest;
        for (a, b, kind, _) in due {
            match kind {
                0 => sim.repair(a.as_str(), b.as_str()),
                1 => sim.repair_oneway(a.as_str(), b.as_str()),
                _ => sim.release(a.as_str(), b.as_str()),
            }
            trace.event_at(now, "chaos", format!("restore {a}-{b}"));
        }
        let (back, still): (Vec<_>, Vec<_>) = down.drain(..).partition(|d| step >= d.1 || faults_over);
        down = still;
        for (id, _) in back {
            sim.bounce(member_host(id));
            ghosts.crashed(&member_host(id));
            trace.event_at(now, "chaos", format!("restart r{id}"));
        }
        if faults_over || now < Duration::from_secs(2) {
            continue;
        }
        if cfg.crashes {
            // One member at a time, mostly; now and then power fails
            // everywhere at once (what an unsynced acknowledgment loses).
            if chaos.random_ratio(1, 6000) && down.is_empty() {
                for id in 1..=cfg.members {
                    crash_member(&mut sim, id, &trace, now);
                    down.push((id, step + chaos.random_range(200..1500)));
                }
                power += 1;
            } else if down.len() < majority_down_max && chaos.random_ratio(1, 1500) {
                let id = chaos.random_range(1..=cfg.members);
                if !down.iter().any(|d| d.0 == id) {
                    crash_member(&mut sim, id, &trace, now);
                    down.push((id, step + chaos.random_range(100..2000)));
                    crashes += 1;
                }
            }
        }
        if cfg.partitions && cuts.len() < 3 && chaos.random_ratio(1, 1000) {
            let a = hosts[chaos.random_range(0..hosts.len())].clone();
            let b = if chaos.random_ratio(1, 3) {
                clients[chaos.random_range(0..clients.len())].clone()
            } else {
                hosts[chaos.random_range(0..hosts.len())].clone()
            };
            let busy = cuts.iter().any(|c| (c.0 == a && c.1 == b) || (c.0 == b && c.1 == a));
            if a != b && !busy {
                let kind = chaos.random_range(0..3u8);
                let until = step
                    + if kind == 2 { chaos.random_range(20..400) } else { chaos.random_range(200..3000) };
                match kind {
                    0 => sim.partition(a.as_str(), b.as_str()),
                    1 => sim.partition_oneway(a.as_str(), b.as_str()),
                    _ => sim.hold(a.as_str(), b.as_str()),
                }
                trace.event_at(now, "chaos", format!("cut {a}-{b} kind {kind}"));
                cuts.push((a, b, kind, until));
                links += 1;
            }
        }
    }
    if !checked.load(Ordering::Relaxed) {
        return Err(format!("seed {seed}: the final checks did not run\ntrace tail:\n{}", tail(&trace, 40)));
    }
    // Replica agreement: every member's state, once all applied the same
    // entries (the checker waited for that before it finished).
    let services = services.borrow();
    let images: Vec<(u64, Vec<u8>)> = services
        .iter()
        .map(|(id, s)| {
            let mut out = Vec::new();
            s.write_snapshot(&s.snapshot(), &mut |b| out.extend_from_slice(&b));
            (*id, out)
        })
        .collect();
    if let Some((first_id, first)) = images.first() {
        for (id, img) in &images[1..] {
            if img != first {
                return Err(format!(
                    "seed {seed}: member r{id}'s state differs from r{first_id}'s after every member applied the same entries\ntrace tail:\n{}",
                    tail(&trace, 40)
                ));
            }
        }
    }
    // Linearizability and exactly-once.
    let s = lock(&seen);
    match linearizable::check(&s.history, 20_000_000) {
        Outcome::Linearizable => {}
        Outcome::NotLinearizable { key, explanation } => {
            return Err(format!(
            "seed {seed}: the map's history is not linearizable (key {}):\n{explanation}\ntrace tail:\n{}",
            String::from_utf8_lossy(&key),
            tail(&trace, 30)
        ))
        }
        Outcome::Unknown { key, explored } => {
            trace.event_at(
                sim.elapsed(),
                "checker",
                format!(
                    "linearizability of key {} unknown after {explored} states",
                    String::from_utf8_lossy(&key)
                ),
            );
        }
    }
    let (acknowledged, pending, retries_sent) = (s.acknowledged, s.pending, s.retries);
    drop(s);
    Ok(RuntimeSimReport {
        seed,
        trace,
        acknowledged,
        pending,
        member_crashes: crashes,
        power_failures: power,
        link_faults: links,
        retries_sent,
        duplicates_sent: ghosts.sent.load(Ordering::Relaxed),
        simulated: sim.elapsed(),
    })
}

/// After the faults: every member applies everything, then each client's
/// queue is read and its pushes counted (exactly once).
async fn final_reads(
    env: &blizzard_env::Env,
    addrs: Vec<String>,
    seen: &Arc<Mutex<Seen>>,
) -> Result<(), String> {
    let client = Client::new(env, addrs.clone(), ClientConfig::default());
    // A write through the log: everything before it is committed, and
    // every member applies it.
    let mark = Update::Put { key: "mark".into(), value: "done".into() };
    client.update(mark.encode()).await.map_err(|e| format!("the final write failed: {e}"))?;
    let deadline = env.now() + Duration::from_secs(120);
    loop {
        let mut applied = Vec::new();
        for a in &addrs {
            let s = blizzard_replicated::node::status_of_member(env, a, Duration::from_secs(2)).await;
            applied.push(s.ok().and_then(|s| s.applied));
        }
        let leader_last = applied.iter().flatten().max().copied();
        if applied.iter().all(|a| a.is_some() && *a == leader_last) {
            break;
        }
        if env.now() > deadline {
            return Err(format!("members did not all apply the same entries within 120 s: {applied:?}"));
        }
        env.sleep(Duration::from_millis(100)).await;
    }
    let pushed: Vec<(usize, Pushes)> = lock(seen).pushed.iter().map(|(k, v)| (*k, v.clone())).collect();
    for (c, Pushes { acked, unknown }) in pushed {
        let q = Query::Peek { queue: format!("q{c}").into(), n: 1024 };
        let r = client.read(q.encode()).await.map_err(|e| format!("reading q{c}: {e}"))?;
        let QueryReply::Peek(items) = q.decode_reply(&r).map_err(|e| e.to_string())? else {
            return Err("a peek answered something else".into());
        };
        let mut count: BTreeMap<String, u32> = BTreeMap::new();
        for i in items.items {
            *count.entry(String::from_utf8_lossy(&i.value).into_owned()).or_default() += 1;
        }
        for v in &acked {
            match count.get(v) {
                Some(1) => {}
                Some(n) => {
                    return Err(format!("acknowledged push {v} is in q{c} {n} times: applied more than once"))
                }
                None => return Err(format!("acknowledged push {v} is missing from q{c}: lost")),
            }
        }
        for (v, n) in &count {
            if *n > 1 {
                return Err(format!("push {v} is in q{c} {n} times: applied more than once"));
            }
            if !acked.contains(v) && !unknown.contains(v) {
                return Err(format!("q{c} holds {v}, which was never pushed"));
            }
        }
    }
    Ok(())
}

fn tail(trace: &Trace, n: usize) -> String {
    let lines = trace.lines();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
