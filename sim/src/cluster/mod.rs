//! A whole blob-store cluster in one seeded process: a metadata server (or
//! a replicated group of them, `meta_replicas`), N tractservers on
//! simulated disks, blob clients running a verified
//! workload, and volume clients running a replicated volume
//! (`volume_client`), with tractserver crashes (losing, keeping or tearing
//! unsynced writes), metadata-server restarts and volume-client crashes
//! drawn from the seed.
//!
//! Two checkers. The blob clients' is the acknowledged-write oracle: each
//! keeps a model of every byte it was told is durable, and every read —
//! during the run and after it — must match it exactly (a write that fails
//! is retried until acknowledged, so the model is always exact). The
//! volume clients' runs after every recovery: every replica of every tract
//! of the volume's blob holds the same bytes, and the volume holds what its
//! commit mode allows given the operations logged and acknowledged before
//! the crash (`blizzard_crashcheck::checker`).
//!
//! Two phases: a safety phase (faults on; every read checked), then a
//! liveness phase once a blob client has finished its workload: faults
//! stop, every host is restarted, and each blob client waits until the
//! cluster reports every row fully replicated (dead tractservers' rows
//! copied to others, FDS §3.2), then checks every replica of every tract it
//! wrote; each volume client opens its volume once more (recovery), checks
//! it, closes it cleanly and checks that the next open has nothing to
//! reconcile. The simulation ends when both kinds are done.
//!
//! Fault model exercised here (turmoil's TCP delivers a stream's bytes once
//! and in order, as TCP does; duplicates come from `ghost`):
//! - tractserver crash: the host's software stops at once, open
//!   connections break, and its disk crashes (`SimDisk::crash`); after a
//!   pause the host restarts on the same disk;
//! - metadata server crash and restart: all its state is gone; it rebuilds
//!   the TLT from the tractservers' heartbeats;
//! - with a replicated metadata service (`meta_replicas` 3 or 5, design
//!   0007): a replica's crash (its runtime's files losing, keeping or
//!   tearing unsynced writes) and restart, a leader among them; one time
//!   in three a majority at once, down 1–4 s, longer than the
//!   tractservers' lease, so every tractserver stops serving until a
//!   leader is back; replicas are partitioned like any host. Volume
//!   clients then take their volume's lease on every open, taking it over
//!   from the life before (the fencing token floors the writer epoch the
//!   tractservers fence with);
//! - partitions: a link cut both ways or one way (messages dropped), or a
//!   tractserver cut off from every other host link by link, its links
//!   restored one by one in random order; 0.2–3 s each;
//! - held links: messages between two hosts held back, then delivered at
//!   once (delay and reordering against other links);
//! - cluster growth: `joining` tractservers start mid-run and take their
//!   share of TLT entries (pending, copied, committed, FDS §3.4), under
//!   the same faults;
//! - full disks: a tractserver's disk runs out of space for 0.2–3 s
//!   (`SimDisk::set_full`: each write stores a prefix and fails with
//!   ENOSPC), then has space again;
//! - a bit flip in stored tract data once the writes are done and every
//!   row is whole (3-way runs): reads must never return it and the
//!   scrubber must repair it before the replica checks pass;
//! - late duplicates (`ghost`): a request on a client connection that was
//!   dropped (after a timeout, a partition or a crash) is delivered again
//!   50 ms–3 s later on a new connection, with its old `Hello`, as TCP can
//!   deliver a dead connection's bytes late;
//! - flow control with tiny bounds: blob clients' writes of 8 KiB or more
//!   ask first and tractservers clear two tracts at a time
//!   (`FLOW_ASK_MIN`), so requests-to-send and grants meet every fault
//!   here (a grant's holder crashing, its request cut off or delivered
//!   late);
//! - volume-client crash (`crash_volume_clients`): the host's software
//!   stops at once, mostly while writes are cut off by it (issued and not
//!   completed, or acknowledged by a fast-ack volume and not durable),
//!   sometimes in an open, a recovery or a check; after 50 ms–1 s it
//!   restarts, and its next open must make the replicas agree (the
//!   write-intent log, design 0005). Its event log (`volume_client`) lives
//!   in harness memory, as a real client's would in a file;
//! - a crashed writer's late requests (`ghost::deliver_late`): the last
//!   change of some of the crashed volume client's connections reaches its
//!   server 50 ms–3 s after the crash, from another host with the old
//!   `Hello` (as bytes left in the network, a receive buffer or behind a
//!   slow disk would), unless that server restarted meanwhile. The session
//!   fence admits them (the dead client never reconnected); the writer
//!   fence must refuse any that arrive after the next writer claimed the
//!   volume (`PlantedBug::NoWriterFence` shows the checks catch it).

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_client::{Client, ClientConfig};
use blizzard_core::Placement;
use blizzard_metaserver::replica::{GroupConfig, Timing};
use blizzard_metaserver::server::{self as meta, MetaConfig, MetaPlant};
use blizzard_rpc::FlowLimits;
use blizzard_tractserver::{self as ts, TractServerConfig};

use crate::ghost::deliver_late;
use crate::volume_client::{self as vc, VolumeConfig, VolumeShared};
mod config;
mod workload;

pub use config::{BlobSimConfig, BlobSimReport};
use workload::{client_workload, Probe};

use crate::{
    derive_seed, sim_env, sim_env_incarnation, sim_env_with_ghosts, Ghosts, SimDisks, SimNet, Trace,
};

const META_PORT: u16 = 7700;
/// How long faults last at most when there are no blob clients.
const FAULTS_WITHOUT_CLIENTS_MAX: Duration = Duration::from_secs(600);
const TS_DISK: u64 = 16 << 20;
/// The tractservers' journal rings: the smallest their 16 KiB tracts
/// allow (`layout::journal_len_min`), so checkpoints run every few dozen
/// writes and crashes land inside them.
const TS_JOURNAL: u64 = 4096;

/// Per tractserver and life: chunk-entry journal checkpoints, writes its
/// backup journal acknowledged, records it replayed at start, tracts it
/// repaired and the bytes those repairs kept.
type LifeFigures = std::collections::BTreeMap<(usize, u64), [u64; 6]>;

/// Blob clients' writes of at least this many bytes ask before they send
/// (flow control with tiny bounds, as the rest of this configuration has:
/// with 16 KiB tracts the production threshold would never be reached),
/// into tractservers that clear two tracts at a time, so requests-to-send,
/// grants and their timeouts meet crashes, partitions and late duplicates.
const FLOW_ASK_MIN: u32 = 8 << 10;

fn ts_host(i: usize) -> String {
    format!("ts{i}")
}

fn disk_path(i: usize) -> String {
    format!("/sim/ts{i}.disk")
}

/// Where an hdd tractserver keeps its backup journal (`journals`).
fn journal_path(i: usize) -> String {
    format!("/sim/ts{i}.journal")
}

/// And that journal's second area, as small, so both fill.
fn second_area_path(i: usize) -> String {
    format!("/sim/ts{i}.journal2")
}

/// A tractserver's power loss: its disks (data, and journal and its second area if any) lose,
/// keep or tear their unsynced writes.
fn crash_ts_disks(disks: &SimDisks, i: usize) -> crate::CrashReport {
    let mut report = crate::CrashReport::default();
    for path in [disk_path(i), journal_path(i), second_area_path(i)] {
        if let Some(d) = disks.get(path.as_ref()) {
            report.add(d.crash());
        }
    }
    report
}

/// The backup journal's size in the simulator: the smallest ring there
/// is, so it fills, wraps and destages all the time.
const TS_BACKUP_JOURNAL: u64 =
    blizzard_tractserver::backup::format::RING_START + blizzard_tractserver::backup::format::RING_MIN;

/// The metadata hosts: "meta" for a single server, "meta1".."metaN" for a
/// group.
fn meta_hosts(replicas: usize) -> Vec<String> {
    if replicas <= 1 {
        vec!["meta".to_string()]
    } else {
        (1..=replicas).map(|i| format!("meta{i}")).collect()
    }
}

/// Every metadata host's address, as `--meta` takes them.
fn meta_addrs(replicas: usize) -> String {
    meta_hosts(replicas).iter().map(|h| format!("{h}:{META_PORT}")).collect::<Vec<_>>().join(",")
}

/// A group's peers: id to address, the same on every replica.
fn meta_hosts_peers(replicas: usize) -> std::collections::BTreeMap<u64, String> {
    meta_hosts(replicas).iter().enumerate().map(|(i, h)| (i as u64 + 1, format!("{h}:{META_PORT}"))).collect()
}

/// Where a group replica keeps its runtime log and snapshots.
fn meta_dir(host: &str) -> String {
    format!("/sim/{host}")
}

/// Runs one seed. `Err` carries what went wrong and the trace's last lines
/// (`blob-sim` adds the command that replays the seed).
pub fn run_blob_sim(seed: u64, cfg: &BlobSimConfig) -> Result<BlobSimReport, String> {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(3600))
        .tick_duration(Duration::from_millis(1))
        .build();
    let disks = SimDisks::new(derive_seed(seed, "disks"));
    let trace = Trace::new();
    let acked = Arc::new(AtomicU64::new(0));
    let verified = Arc::new(AtomicU64::new(0));
    let probe = Probe::default();

    let meta_hosts = meta_hosts(cfg.meta_replicas);
    let meta_addr = meta_addrs(cfg.meta_replicas);
    for (i, host) in meta_hosts.iter().enumerate() {
        let (disks, lives, host) = (disks.clone(), Rc::new(RefCell::new(0u64)), host.clone());
        let (tsn, repl, tract, replicas, plant) =
            (cfg.tractservers, cfg.replication, cfg.tract_size, cfg.meta_replicas, cfg.meta_plant);
        sim.host(host.clone(), move || {
            let life = {
                let mut l = lives.borrow_mut();
                *l += 1;
                *l
            };
            let env = sim_env_incarnation(seed, &host, life, disks.clone());
            let group = (replicas > 1).then(|| GroupConfig {
                id: i as u64 + 1,
                peers: meta_hosts_peers(replicas),
                data_dir: meta_dir(&host).into(),
                timing: Timing { heartbeat_ms: 50, election_min_ms: 150, election_max_ms: 300 },
            });
            async move {
                let mut c = MetaConfig::new(format!("0.0.0.0:{META_PORT}"));
                c.tract_size = tract;
                c.replication = repl;
                c.init_tractservers = tsn;
                c.heartbeat_interval = Duration::from_millis(100);
                c.dead_after = Duration::from_secs(1);
                c.rebuild_grace = Duration::from_secs(2);
                c.request_timeout = Duration::from_secs(2);
                c.group = group;
                c.plant = plant;
                let h = meta::start(env, c).await?;
                h.wait().await;
                Ok(())
            }
        });
    }
    let total = cfg.tractservers + cfg.joining;
    let checkpoints: Rc<RefCell<LifeFigures>> = Rc::default();
    for i in 0..total {
        let (disks, lives, planted) = (disks.clone(), Rc::new(RefCell::new(0u64)), cfg.planted_bug);
        let journal = cfg.journals && i % 2 == 1;
        let checkpoints = checkpoints.clone();
        let (meta_addr, tract) = (meta_addr.clone(), cfg.tract_size);
        // A joining server's first start waits until the cluster has run a
        // while (and is under load); restarts after a crash do not.
        let join_after = (i >= cfg.tractservers).then(|| {
            let mut r = SmallRng::seed_from_u64(derive_seed(seed, &format!("join{i}")));
            Duration::from_millis(r.random_range(3_000..12_000))
        });
        sim.host(ts_host(i), move || {
            let life = {
                let mut l = lives.borrow_mut();
                *l += 1;
                *l
            };
            let env = sim_env_incarnation(seed, &ts_host(i), life, disks.clone());
            let wait = join_after.filter(|_| life == 1);
            let meta = meta_addr.clone();
            let checkpoints = checkpoints.clone();
            async move {
                if let Some(w) = wait {
                    env.sleep(w).await;
                }
                let mut c = TractServerConfig::new(disk_path(i), "0.0.0.0:7000", meta);
                c.disk_size = Some(TS_DISK);
                c.failure_domain = format!("rack{}", i % 4);
                c.heartbeat_interval = Duration::from_millis(100);
                c.request_timeout = Duration::from_secs(2);
                c.planted_bug = planted;
                c.limits.flow = FlowLimits {
                    window_bytes: Some(2 * tract as u64),
                    grant_timeout: Duration::from_secs(2),
                    ..FlowLimits::default()
                };
                c.journal_len = Some(TS_JOURNAL);
                if journal {
                    // Writes of up to half a tract are journaled; larger
                    // ones go to the disk with a supersede record.
                    c.class = blizzard_core::DiskClass::Hdd;
                    c.journal = Some(ts::JournalConfig {
                        path: journal_path(i).into(),
                        create_size: Some(TS_BACKUP_JOURNAL),
                        bypass: tract / 2,
                        destage_interval: Duration::from_millis(300),
                        second_area: Some(second_area_path(i).into()),
                        second_area_size: Some(TS_BACKUP_JOURNAL),
                    });
                }
                // Repairs the flipped bits (reads go to another replica
                // meanwhile).
                c.scrub_bandwidth = 4 << 20;
                let h = ts::start(env.clone(), c).await?;
                // This life's checkpoints, kept up to date for the report
                // (a crash ends the life without a word).
                let store = h.service.store.clone();
                let fill = h.service.fill.clone();
                let count = async {
                    loop {
                        let st = &store.stats;
                        let figures = [
                            store.journal_checkpoints(),
                            st.journaled_writes.load(Ordering::Relaxed),
                            st.journal_replayed.load(Ordering::Relaxed),
                            fill.tracts_repaired(),
                            fill.unchanged_bytes(),
                            st.second_area_records.load(Ordering::Relaxed),
                        ];
                        checkpoints.borrow_mut().insert((i, life), figures);
                        env.sleep(Duration::from_millis(100)).await;
                    }
                };
                tokio::select! {
                    biased;
                    _ = h.wait() => {}
                    _ = count => {}
                }
                Ok(())
            }
        });
    }
    let ghosts = Ghosts::new(SmallRng::seed_from_u64(derive_seed(seed, "ghosts")), cfg.duplicates);
    for c in 0..cfg.clients {
        let host = format!("client{c}");
        let env = if cfg.duplicates > 0 {
            sim_env_with_ghosts(seed, &host, SimDisks::new(0), ghosts.clone())
        } else {
            sim_env(seed, &host, SimDisks::new(0))
        };
        let (trace, acked, verified, cfg) = (trace.clone(), acked.clone(), verified.clone(), cfg.clone());
        let probe = probe.clone();
        sim.client(host.clone(), async move {
            client_workload(env, host, cfg, trace, acked, verified, probe)
                .await
                .map_err(|e| -> Box<dyn std::error::Error> { e.to_string().into() })
        });
    }

    // Volume clients, the host that delivers their late requests, and a
    // client that waits for their final checks (the simulation ends when
    // every client is done; hosts do not count).
    let volumes: Vec<VolumeShared> = (0..cfg.volume_clients)
        .map(|c| {
            let mut r = SmallRng::seed_from_u64(derive_seed(seed, &format!("vol{c}/workload")));
            let mode = if r.random_bool(0.5) {
                blizzard_volume::CommitMode::WriteThrough
            } else {
                blizzard_volume::CommitMode::FastAck
            };
            let vcfg = VolumeConfig {
                name: format!("vol{c}"),
                meta: meta_addr.clone(),
                replication: cfg.replication,
                mode,
                depth: r.random_range(2..=6),
                ops_max: cfg.volume_ops,
                ends_faults: cfg.clients == 0,
                // With a replicated metadata service (single-server seeds
                // run as they did before leases).
                lease: cfg.meta_replicas > 1,
                // Half the volumes hybrid (design 0009), drawn apart from
                // the workload's stream so that stream stays as it was.
                placement: match derive_seed(seed, &format!("vol{c}/placement")) % 2 {
                    1 if cfg.replication > 1 => Placement::Hybrid,
                    _ => Placement::Any,
                },
            };
            VolumeShared::new(vcfg, r)
        })
        .collect();
    for (c, shared) in volumes.iter().enumerate() {
        let host = format!("vol{c}");
        let ghosts = ghosts.with_one_in(if cfg.duplicates > 0 { cfg.duplicates } else { 0 });
        let (shared, trace, faults_over) = (shared.clone(), trace.clone(), probe.faults_over.clone());
        sim.host(host.clone(), move || {
            let life = shared.stats().lives;
            let mut env = sim_env_incarnation(seed, &host, life, SimDisks::new(0));
            env.net = Arc::new(SimNet::with_ghosts(&host, ghosts.clone()));
            let l = vc::Life {
                env,
                host: host.clone(),
                shared: shared.clone(),
                faults_over: faults_over.clone(),
                trace: trace.clone(),
            };
            async move { l.run().await.map_err(|e| -> Box<dyn std::error::Error> { e.to_string().into() }) }
        });
    }
    // One more client, "late": it delivers crashed volume clients' late
    // requests (`ghost::deliver_late`; a crashed host's own tasks are
    // gone), and ends once every volume client finished its final checks
    // (the simulation ends when every client has; hosts do not count).
    let late = (cfg.volume_clients > 0).then(|| {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(crate::ghost::Orphan, Duration)>();
        let env = sim_env(seed, "late", SimDisks::new(0));
        let (ghosts, trace) = (ghosts.clone(), trace.clone());
        let (volumes, faults_over) = (volumes.clone(), probe.faults_over.clone());
        sim.client("late", async move {
            let mut since: Option<blizzard_env::Instant> = None;
            let mut open = true;
            loop {
                let job = tokio::select! {
                    biased;
                    job = rx.recv(), if open => {
                        open = job.is_some();
                        job
                    }
                    _ = env.sleep(Duration::from_millis(100)) => None,
                };
                if let Some((o, delay)) = job {
                    let (env, ghosts, trace) = (env.clone(), ghosts.clone(), trace.clone());
                    tokio::task::spawn_local(async move {
                        let what = o.describe();
                        let r = deliver_late(env, ghosts, o, delay).await;
                        trace.event("late", format!("{what}: {r:?}"));
                    });
                    continue;
                }
                if volumes.iter().all(|v| v.done()) {
                    return Ok(());
                }
                if faults_over.load(Ordering::Relaxed) {
                    let t = *since.get_or_insert(env.now());
                    if env.now().duration_since(t) > Duration::from_secs(900) {
                        let states: Vec<&str> = volumes.iter().map(|v| v.phase()).collect();
                        return Err(format!(
                            "liveness: volume clients not done 900 s after faults stopped: {states:?}"
                        )
                        .into());
                    }
                }
            }
        });
        tx
    });

    // The chaos schedule, drawn from its own stream of the seed.
    let mut chaos = SmallRng::seed_from_u64(derive_seed(seed, "chaos"));
    // Volume clients' crashes, their late requests and the power losses
    // after their recoveries, from another stream: with no volume clients
    // a seed runs exactly as it did before they existed.
    let mut vchaos = SmallRng::seed_from_u64(derive_seed(seed, "volume-chaos"));
    let mut vol_down: Vec<Option<u64>> = vec![None; cfg.volume_clients];
    let mut vol_reconciled: Vec<u64> = vec![0; cfg.volume_clients];
    let (mut vol_crashes, mut vol_crashes_in_flight) = (0u32, 0u32);
    let mut ts_down: Option<(usize, u64)> = None;
    // Metadata hosts down, and the step each restarts at.
    let mut meta_down: Vec<(String, u64)> = Vec::new();
    let mut full: Option<(usize, u64)> = None;
    let mut full_disks = 0u32;
    let (mut ts_crashes, mut meta_restarts, mut link_faults, mut bit_flips) = (0u32, 0u32, 0u32, 0u32);
    let mut meta_outages = 0u32;
    // Where tract data lives on a disk: the first slots, which hold what
    // the clients wrote (slots are taken lowest first).
    let data = blizzard_tractserver::layout::Layout::plan(blizzard_core::TsId(0), cfg.tract_size, TS_DISK)
        .map(|l| l.data_offset..l.data_offset_of(6.min(l.slot_count), 0))
        .map_err(|e| format!("seed {seed}: disk layout: {e}"))?;
    let mut flips_due = cfg.bit_flips && cfg.replication >= 3;
    let hosts: Vec<String> = meta_hosts.iter().cloned().chain((0..total).map(ts_host)).collect();
    // A metadata host's crash: its software stops and, for a group
    // replica, its runtime's files lose, keep or tear unsynced writes.
    let crash_meta = |sim: &mut turmoil::Sim<'_>, host: &str, now: Duration, why: &str| {
        sim.crash(host);
        ghosts.crashed(host);
        let mut report = crate::CrashReport::default();
        let dir = format!("{}/", meta_dir(host));
        for (path, d) in disks.disks() {
            if path.starts_with(&dir) {
                report.add(d.crash());
            }
        }
        trace.event_at(now, "chaos", format!("crash {host}{why} {report:?}"));
    };
    let clients: Vec<String> = (0..cfg.clients)
        .map(|c| format!("client{c}"))
        .chain((0..cfg.volume_clients).map(|c| format!("vol{c}")))
        .collect();
    let mut cuts: Vec<Cut> = Vec::new();
    let mut step: u64 = 0;
    loop {
        match sim.step() {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                return Err(format!("seed {seed}: {e}\ntrace tail:\n{}", tail(&trace, trace_tail_len())))
            }
        }
        step += 1;
        let now = sim.elapsed();
        // Let the cluster form before the first fault.
        if now < Duration::from_secs(2) {
            continue;
        }
        // Without blob clients the volume clients end the faults when their
        // workload is done; one stuck in a check must not keep them on
        // until turmoil's limit: the liveness phase then reports it.
        if cfg.clients == 0 && now > FAULTS_WITHOUT_CLIENTS_MAX && !probe.faults_over.load(Ordering::Relaxed)
        {
            probe.faults_over.store(true, Ordering::Relaxed);
            trace.event_at(now, "chaos", "faults over (time limit)");
        }
        // Links whose time is up come back, each on its own schedule.
        let (due, rest): (Vec<Cut>, Vec<Cut>) =
            cuts.drain(..).partition(|c| step >= c.until || probe.faults_over.load(Ordering::Relaxed));
        cuts = rest;
        for c in due {
            c.undo(&sim);
            trace.event_at(now, "chaos", format!("restore {c:?}"));
        }
        // Bit rot, once every client has written its last byte and seen
        // the cluster whole: one flipped bit in stored tract data, which
        // the replica checks wait on. Only with three replicas: a row can
        // still be copying to a member (a server joins late, or rejoins),
        // and rot on its only complete replica would be a second fault
        // (lost data, correctly reported as unreadable), not a bug. Reads must never return it; the scrubber must
        // repair it. (Not during the writes, for the same reason: while
        // servers crash and rows copy, the rotted replica may be a row's
        // only complete one. A partial write into a rotted chunk heals it
        // from another replica first, `Healer::heal_chunk`.)
        if flips_due && probe.replicated.load(Ordering::Relaxed) == cfg.clients as u64 {
            flips_due = false;
            let mut hosts: Vec<usize> = (0..total).collect();
            {
                let i = hosts.remove(chaos.random_range(0..hosts.len()));
                if let Some(d) = disks.get(disk_path(i).as_ref()) {
                    if let Ok((at, bit)) = d.corrupt_random(data.clone()) {
                        trace.event_at(now, "chaos", format!("flip bit {bit} at {at} of {}", ts_host(i)));
                        bit_flips += 1;
                    }
                }
            }
        }
        if !flips_due {
            probe.flipped.store(true, Ordering::Relaxed);
        }
        // Liveness phase: no new faults; whatever is down comes back now.
        if probe.faults_over.load(Ordering::Relaxed) {
            if let Some((i, _)) = ts_down.take() {
                sim.bounce(ts_host(i));
                ghosts.crashed(&ts_host(i));
                trace.event_at(now, "chaos", format!("restart {} (faults over)", ts_host(i)));
            }
            for (host, _) in meta_down.drain(..) {
                sim.bounce(host.as_str());
                ghosts.crashed(&host);
                trace.event_at(now, "chaos", format!("restart {host} (faults over)"));
            }
            if let Some((i, _)) = full.take() {
                disks.get(disk_path(i).as_ref()).inspect(|d| d.set_full(false));
                trace.event_at(now, "chaos", format!("disk of {} has space again (faults over)", ts_host(i)));
            }
            for (c, down) in vol_down.iter_mut().enumerate() {
                if down.take().is_some() {
                    sim.bounce(format!("vol{c}"));
                    trace.event_at(now, "chaos", format!("restart vol{c} (faults over)"));
                }
            }
            continue;
        }
        // A tractserver's power fails right after a volume's recovery
        // reconciled tracts (one time in three): what recovery compared
        // must survive it.
        for (c, v) in volumes.iter().enumerate() {
            let reconciled = v.stats().tracts_reconciled;
            if reconciled == vol_reconciled[c] {
                continue;
            }
            vol_reconciled[c] = reconciled;
            if cfg.crash_tractservers && ts_down.is_none() && vchaos.random_ratio(1, 3) {
                let i = vchaos.random_range(0..total);
                sim.crash(ts_host(i));
                ghosts.crashed(&ts_host(i));
                let report = crash_ts_disks(&disks, i);
                trace.event_at(
                    now,
                    "chaos",
                    format!("crash {} after vol{c}'s recovery {report:?}", ts_host(i)),
                );
                ts_down = Some((i, step + vchaos.random_range(100..1500)));
                ts_crashes += 1;
            }
        }
        if cfg.crash_volume_clients {
            for (c, v) in volumes.iter().enumerate() {
                let host = format!("vol{c}");
                match vol_down[c] {
                    None if !v.done() => {
                        // Mostly while writes are cut off by it; sometimes
                        // in an open, a recovery or a check.
                        let (waiting, undurable) = v.in_flight();
                        let busy = waiting > 0 || undurable > 0;
                        if !vchaos.random_ratio(1, if busy { 700 } else { 8000 }) {
                            continue;
                        }
                        let phase = v.phase();
                        ghosts.crash_begin(&host);
                        sim.crash(host.as_str());
                        let orphans = ghosts.crash_end(&host);
                        ghosts.crashed(&host);
                        trace.event_at(
                            now,
                            "chaos",
                            format!(
                                "crash {host} while {phase}: {waiting} writes issued, {undurable} undurable, {} connections with a change",
                                orphans.len()
                            ),
                        );
                        vol_crashes += 1;
                        vol_crashes_in_flight += busy as u32;
                        for o in orphans {
                            if cfg.late_requests == 0 || !vchaos.random_ratio(1, cfg.late_requests) {
                                continue;
                            }
                            let delay = Duration::from_millis(vchaos.random_range(50..3000));
                            trace.event_at(
                                now,
                                "chaos",
                                format!("{host}'s {} arrives in {} ms", o.describe(), delay.as_millis()),
                            );
                            if let Some(tx) = &late {
                                let _ = tx.send((o, delay));
                            }
                        }
                        vol_down[c] = Some(step + vchaos.random_range(50..1000));
                    }
                    Some(at) if step >= at => {
                        sim.bounce(host.as_str());
                        trace.event_at(now, "chaos", format!("restart {host}"));
                        vol_down[c] = None;
                    }
                    _ => {}
                }
            }
        }
        if cfg.full_disks {
            match full {
                None if chaos.random_ratio(1, 2500) => {
                    let i = chaos.random_range(0..total);
                    // Only a formatted disk (its superblock is written
                    // last): a tractserver that cannot format its disk
                    // exits, an operator's matter, not the cluster's.
                    let formatted =
                        |d: &crate::SimDisk| d.peek(0, 8) == blizzard_tractserver::layout::SUPERBLOCK_MAGIC;
                    if let Some(d) = disks.get(disk_path(i).as_ref()).filter(formatted) {
                        d.set_full(true);
                        trace.event_at(now, "chaos", format!("disk of {} full", ts_host(i)));
                        full = Some((i, step + chaos.random_range(200..3000)));
                        full_disks += 1;
                    }
                }
                Some((i, at)) if step >= at => {
                    disks.get(disk_path(i).as_ref()).inspect(|d| d.set_full(false));
                    trace.event_at(now, "chaos", format!("disk of {} has space again", ts_host(i)));
                    full = None;
                }
                _ => {}
            }
        }
        if cfg.crash_tractservers {
            match ts_down {
                None if chaos.random_ratio(1, 1500) => {
                    let i = chaos.random_range(0..total);
                    sim.crash(ts_host(i));
                    ghosts.crashed(&ts_host(i));
                    let report = crash_ts_disks(&disks, i);
                    trace.event_at(now, "chaos", format!("crash {} {report:?}", ts_host(i)));
                    ts_down = Some((i, step + chaos.random_range(100..1500)));
                    ts_crashes += 1;
                }
                Some((i, at)) if step >= at => {
                    sim.bounce(ts_host(i));
                    ghosts.crashed(&ts_host(i));
                    trace.event_at(now, "chaos", format!("restart {}", ts_host(i)));
                    ts_down = None;
                }
                _ => {}
            }
        }
        if cfg.partitions && cuts.len() < 4 && chaos.random_ratio(1, 1200) {
            let pick = |r: &mut SmallRng, v: &[String]| v[r.random_range(0..v.len())].clone();
            let a = pick(&mut chaos, &hosts);
            let mut b = pick(&mut chaos, &hosts);
            if chaos.random_ratio(1, 3) {
                b = pick(&mut chaos, &clients);
            }
            let busy = |x: &str, y: &str| cuts.iter().any(|c| c.involves(x, y));
            let kind = chaos.random_range(0..4);
            let mut new = Vec::new();
            if a != b && !busy(&a, &b) {
                let until = step + chaos.random_range(200..3000);
                match kind {
                    0 => new.push(Cut { a: a.clone(), b: b.clone(), how: How::Both, until }),
                    1 => new.push(Cut { a: a.clone(), b: b.clone(), how: How::OneWay, until }),
                    2 => new.push(Cut {
                        a: a.clone(),
                        b: b.clone(),
                        how: How::Hold,
                        until: step + chaos.random_range(20..400),
                    }),
                    _ => {
                        // Cut `a` off from every host, link by link.
                        for other in hosts.iter().chain(&clients).filter(|h| **h != a && !busy(&a, h)) {
                            let until = step + chaos.random_range(200..3000);
                            new.push(Cut { a: a.clone(), b: other.clone(), how: How::Both, until });
                        }
                    }
                }
            }
            for c in new {
                c.apply(&sim);
                trace.event_at(now, "chaos", format!("{c:?}"));
                link_faults += 1;
                cuts.push(c);
            }
        }
        if cfg.restart_meta {
            if meta_down.is_empty() && chaos.random_ratio(1, 4000) {
                // (No draw for a single server: its seeds replay as before.)
                let pick = if meta_hosts.len() > 1 { chaos.random_range(0..meta_hosts.len()) } else { 0 };
                crash_meta(&mut sim, &meta_hosts[pick], now, "");
                meta_down.push((meta_hosts[pick].clone(), step + chaos.random_range(50..1000)));
                meta_restarts += 1;
                // A majority of a group at once, one time in three, for
                // longer than the tractservers' lease (two thirds of
                // `dead_after`): every tractserver stops serving until a
                // leader is back.
                if meta_hosts.len() > 1 && chaos.random_ratio(1, 3) {
                    let more = meta_hosts.len() / 2;
                    let until = step + chaos.random_range(1000..4000);
                    meta_down[0].1 = until;
                    meta_outages += 1;
                    let mut others: Vec<usize> = (0..meta_hosts.len()).filter(|i| *i != pick).collect();
                    for _ in 0..more {
                        let j = others.remove(chaos.random_range(0..others.len()));
                        crash_meta(&mut sim, &meta_hosts[j], now, " (a majority down)");
                        meta_down.push((meta_hosts[j].clone(), step + chaos.random_range(1000..4000)));
                        meta_restarts += 1;
                    }
                }
            }
            let (due, rest): (Vec<_>, Vec<_>) = meta_down.drain(..).partition(|(_, at)| step >= *at);
            meta_down = rest;
            for (host, _) in due {
                sim.bounce(host.as_str());
                ghosts.crashed(&host);
                trace.event_at(now, "chaos", format!("restart {host}"));
            }
        }
    }
    let vstats: Vec<vc::VolumeStats> = volumes.iter().map(|v| v.stats()).collect();
    let sum = |k: usize| -> u64 { checkpoints.borrow().values().map(|f| f[k]).sum() };
    let (journal_checkpoints, journaled_writes, journal_replayed) = (sum(0), sum(1), sum(2));
    let (tracts_repaired, repair_kept_bytes, second_area_records) = (sum(3), sum(4), sum(5));
    Ok(BlobSimReport {
        seed,
        trace,
        acknowledged_writes: acked.load(Ordering::Relaxed),
        verified_reads: verified.load(Ordering::Relaxed),
        tractserver_crashes: ts_crashes,
        meta_restarts,
        meta_outages,
        link_faults,
        rows_refilled: probe.rows_refilled.load(Ordering::Relaxed),
        rows_grown: probe.rows_grown.load(Ordering::Relaxed),
        duplicates: ghosts.sent.load(Ordering::Relaxed),
        bit_flips,
        full_disks,
        full_disk_writes: disks.disks().iter().map(|(_, d)| d.writes_refused()).sum(),
        volume_crashes: vol_crashes,
        volume_crashes_in_flight: vol_crashes_in_flight,
        late_deliveries: ghosts.late_sent.load(Ordering::Relaxed),
        late_fenced: ghosts.late_fenced.load(Ordering::Relaxed),
        tracts_reconciled: vstats.iter().map(|s| s.tracts_reconciled).sum(),
        chunk_repairs: vstats.iter().map(|s| s.chunk_repairs).sum(),
        replica_checks: vstats.iter().map(|s| s.replica_checks).sum(),
        volume_ops: vstats.iter().map(|s| s.acked_ops).sum(),
        journal_checkpoints,
        journaled_writes,
        journal_replayed,
        second_area_records,
        hybrid_blobs: probe.hybrid_blobs.load(Ordering::Relaxed)
            + vstats.iter().map(|s| s.hybrid).sum::<u64>(),
        tracts_repaired,
        repair_kept_bytes,
        simulated: sim.elapsed(),
    })
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum How {
    /// Messages both ways dropped.
    Both,
    /// Messages from `a` to `b` dropped; `b` to `a` delivered.
    OneWay,
    /// Messages both ways held, then delivered together.
    Hold,
}

/// A network fault on one link, undone at step `until`.
#[derive(Debug)]
struct Cut {
    a: String,
    b: String,
    how: How,
    until: u64,
}

impl Cut {
    fn involves(&self, x: &str, y: &str) -> bool {
        (self.a == x && self.b == y) || (self.a == y && self.b == x)
    }

    fn apply(&self, sim: &turmoil::Sim<'_>) {
        match self.how {
            How::Both => sim.partition(self.a.as_str(), self.b.as_str()),
            How::OneWay => sim.partition_oneway(self.a.as_str(), self.b.as_str()),
            How::Hold => sim.hold(self.a.as_str(), self.b.as_str()),
        }
    }

    fn undo(&self, sim: &turmoil::Sim<'_>) {
        match self.how {
            How::Both => sim.repair(self.a.as_str(), self.b.as_str()),
            How::OneWay => sim.repair_oneway(self.a.as_str(), self.b.as_str()),
            How::Hold => sim.release(self.a.as_str(), self.b.as_str()),
        }
    }
}

/// Trace lines shown with a violation: `BLOB_SIM_TRACE_TAIL` (default 30).
fn trace_tail_len() -> usize {
    std::env::var("BLOB_SIM_TRACE_TAIL").ok().and_then(|v| v.parse().ok()).unwrap_or(30)
}

fn tail(trace: &Trace, n: usize) -> String {
    let lines = trace.lines();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
