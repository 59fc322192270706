//! Issue 22's acceptance test: the metadata service replicated on Raft
//! (design 0007) under a real block workload, and one writer per volume.
//!
//! Three `blizzard meta` replicas, eight `blizzard tractserver`s, a 64 MiB
//! 3-way write-through volume served by `blizzard nbd`, and fio (its nbd
//! engine, libnbd) writing 16 KiB blocks at random offsets, each with a
//! crc32c header, reading every write back and checking it a few dozen
//! writes later (`verify_backlog`). No block of the volume is written
//! twice in the whole test, so a lost write reads as zeros and fails fio's
//! verify whenever it is checked.
//!
//! 1. Leaders: fio writes the volume's first region while the metadata
//!    leader is SIGKILLed, a new leader awaited, the killed replica started
//!    again and awaited until it has caught up; again until every replica
//!    was killed as leader (at most `LEADER_KILLS_MAX` kills).
//! 2. Outage: fio writes the second region while two replicas (the leader
//!    and another) are SIGKILLed at once and kept down for `OUTAGE`, four
//!    times the tractservers' lease (two thirds of `DEAD_AFTER_MS`): every
//!    tractserver stops serving and the I/O waits; then both start again.
//!    (The wait has a bound: the blob client gives a write up after 12
//!    attempts, 5.3–10.5 s of back-off, and the NBD client gets EIO; with
//!    two replicas down for 10 s, fio did. `OUTAGE` stays well inside.)
//!
//!    Each phase's fio is stopped (SIGINT) once its schedule is done and
//!    must exit with no error. Then fio `--verify_only`, the same job
//!    limited to the bytes it wrote (`--io_size`: the same offsets in the
//!    same order), checks every block it wrote. (Not `--time_based`: fio
//!    skips the verify of the pass the runtime cuts short, and
//!    `--verify_only` cannot replay a time-based job.)
//! 3. One writer per volume: a second `blizzard nbd` on the volume is
//!    refused naming the holder. `blizzard nbd --take-over` on a second
//!    socket then takes the volume while fio writes through the first
//!    server (into a third region): that fio gets EIO. Once the first
//!    server has logged that its lease is lost, a fio trying to overwrite
//!    every block of both checked regions through it has every write
//!    refused, and both regions pass `--verify_only` through the new
//!    server.
//!
//! Printed: every event with its time since the start (a new leader N ms
//! after the kill, a restarted replica caught up in N ms); per phase, the
//! longest I/O (fio's largest completion latency, writes and the verify
//! reads) and the longest time in which no I/O completed (from fio's
//! per-I/O latency log), with the event each followed, and both again
//! before the first kill and from each kill to the next; then `longest I/O
//! stall: N ms` for each phase, next to the goal (no stall longer than one
//! election timeout while a majority is up). Nothing about time is
//! asserted.

#![allow(clippy::unwrap_used)]
// Real processes, sockets and time.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use blizzard_env::Env;
use blizzard_replicated::node::Timing;

use common::{blizzard, free_port, nbd, spawn_meta, wait_caught_up, wait_leader, Proc};

const TRACTSERVERS: usize = 8;
const REPLICATION: u8 = 3;
const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 64 * MIB;
/// Every fio write and verify read.
const BLOCK: u64 = 16 << 10;
/// (offset, bytes) of the volume each phase's fio writes: disjoint, so no
/// block is written twice.
const LEADERS_REGION: (u64, u64) = (0, 36 * MIB);
const OUTAGE_REGION: (u64, u64) = (36 * MIB, 20 * MIB);
const OLD_WRITER_REGION: (u64, u64) = (56 * MIB, 8 * MIB);
/// fio's write rate in bytes a second (96 writes a second; about an eighth
/// of what write-through 3-way sustains in a debug build on 2 cores, so
/// the replicas' elections do not wait for CPU): a phase ends (SIGINT)
/// before its region is full, at 24 s for the leaders' and 13 s for the
/// outage's.
const RATE: u64 = 1536 << 10;
/// Queue depth of the writing jobs.
const IODEPTH: u32 = 8;
/// Leader kills at most: each kill picks among two replicas for the next
/// leader, so killing until all three were killed takes 4 on average.
const LEADER_KILLS_MAX: usize = 6;
/// How long two replicas stay down: four tractserver leases. Writes are
/// refused from about a lease after the kill until a few hundred ms after
/// the restart (3–3.5 s), and resume at the blob client's next attempt (its
/// back-off grows to 2 s); a write fails only if its 12th attempt comes
/// first, at least 5.3 s after its first.
const OUTAGE: Duration = Duration::from_secs(4);
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// fio's line once the NBD handshake is done.
const FIO_CONNECTED: &str = "fio: connected to NBD server";
/// `blizzard nbd`'s line once it serves.
const NBD_READY: &str = "NBD export ";
/// What NBD reports for a refused write, as fio's error.
const EIO: u32 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_through_nbd_while_metadata_replicas_die_and_one_writer_per_volume() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    std::fs::create_dir(dir.join("latency")).unwrap();
    let mut tl = Timeline::new();
    let seed = Env::real().random_u64() >> 16;
    let lease = Duration::from_millis(common::DEAD_AFTER_MS * 2 / 3);
    let election = Timing::default();
    println!(
        "tractservers' lease {} ms; metadata election timeout {}-{} ms; fio seeds from {seed}",
        lease.as_millis(),
        election.election_min_ms,
        election.election_max_ms
    );

    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let meta = addrs.join(",");
    let mut metas: Vec<Proc> =
        (0..3).map(|i| spawn_meta(dir, &addrs, i, REPLICATION, TRACTSERVERS)).collect();
    let mut ts = common::spawn_tractservers(dir, &meta, TRACTSERVERS, "256MiB");
    let _logs = common::DumpLogsOnPanic(dir.to_path_buf());
    let (size, replication) = (VOLUME_BYTES.to_string(), REPLICATION.to_string());
    let create = ["volume", "create", "v", "--size", &size, "--replication", &replication, "--meta", &meta];
    let (ok, out) = blizzard(&create);
    assert!(ok, "volume create: {out}");
    let mut first = nbd(dir, &meta, "nbd1", "v", &[]);
    first.wait_log(NBD_READY, START_TIMEOUT);
    let uri = nbd_uri(&first);
    tl.mark(format!("{TRACTSERVERS} tractservers, 3 metadata replicas, blizzard nbd serving volume v"));

    // 1. Every replica killed as leader, one at a time.
    let leaders = Job::new("leaders", LEADERS_REGION, seed);
    let mut fio = leaders.start(dir, &uri);
    tl.mark("fio writes (phase 1)".into());
    let mut killed = BTreeSet::new();
    let mut kills = 0;
    while killed.len() < 3 && kills < LEADER_KILLS_MAX {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let l = wait_leader(&addrs, None).await;
        tl.mark(format!("SIGKILL the metadata leader meta{}", l + 1));
        let t = Instant::now();
        metas[l].kill();
        let next = wait_leader(&addrs, Some(l)).await;
        tl.mark(format!("meta{} leads, {} ms after the kill", next + 1, t.elapsed().as_millis()));
        metas[l] = spawn_meta(dir, &addrs, l, REPLICATION, TRACTSERVERS);
        let t = Instant::now();
        wait_caught_up(&addrs, l, next).await;
        tl.mark(format!("meta{} restarted and caught up in {} ms", l + 1, t.elapsed().as_millis()));
        killed.insert(l);
        kills += 1;
        note_if_done(&mut fio);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let phase1 = leaders.finish(fio, dir, &uri, &tl);
    println!(
        "phase 1: {kills} leader kills, every replica killed: {}",
        if killed.len() == 3 { "yes" } else { "no (LEADER_KILLS_MAX reached)" }
    );

    // 2. Two replicas down for longer than the tractservers' lease.
    let outage = Job::new("outage", OUTAGE_REGION, seed + 1);
    let mut fio = outage.start(dir, &uri);
    tl.mark("fio writes (phase 2)".into());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let l = wait_leader(&addrs, None).await;
    let other = (l + 1) % 3;
    metas[l].kill();
    metas[other].kill();
    tl.mark(format!("SIGKILL meta{} (the leader) and meta{}: no majority", l + 1, other + 1));
    tokio::time::sleep(OUTAGE).await;
    metas[l] = spawn_meta(dir, &addrs, l, REPLICATION, TRACTSERVERS);
    metas[other] = spawn_meta(dir, &addrs, other, REPLICATION, TRACTSERVERS);
    tl.mark(format!("meta{} and meta{} restarted after {} ms down", l + 1, other + 1, OUTAGE.as_millis()));
    let t = Instant::now();
    let next = wait_leader(&addrs, None).await;
    tl.mark(format!("meta{} leads, {} ms after the restart", next + 1, t.elapsed().as_millis()));
    for i in [l, other].into_iter().filter(|i| *i != next) {
        wait_caught_up(&addrs, i, next).await;
    }
    tl.mark(format!("both caught up, {} ms after the restart", t.elapsed().as_millis()));
    note_if_done(&mut fio);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let phase2 = outage.finish(fio, dir, &uri, &tl);
    for p in ts.iter_mut().chain(metas.iter_mut()) {
        p.check_running();
    }

    // 3. One writer per volume.
    let holder = format!(":{}/", first.pid().unwrap());
    let mut second = nbd(dir, &meta, "nbd2", "v", &[]);
    let status = second.wait_exit(START_TIMEOUT);
    let refused = second.log_text();
    assert!(
        !status.success() && refused.contains("is open for writing by") && refused.contains(&holder),
        "a second blizzard nbd on the volume ({status}):\n{refused}"
    );
    tl.mark(format!(
        "a second blizzard nbd is refused: {}",
        common::strip_ansi(refused.lines().last().unwrap_or(""))
    ));

    let mut old_writes = start_old_writer(dir, &uri, seed + 2);
    tokio::time::sleep(Duration::from_secs(1)).await;
    tl.mark("blizzard nbd --take-over on a second socket, while fio writes through the first".into());
    let t = Instant::now();
    let mut next = nbd(dir, &meta, "nbd3", "v", &["--take-over"]);
    next.wait_log(NBD_READY, START_TIMEOUT);
    tl.mark(format!("the new server serves, {} ms after it started", t.elapsed().as_millis()));
    let status = old_writes.wait_exit(START_TIMEOUT);
    let log = old_writes.log_text();
    let r = Fio::parse(&log);
    assert!(
        !status.success() && r.error == EIO,
        "fio writing through the old server across the take-over should fail with EIO ({status}):\n{log}"
    );
    let acked: Vec<u64> = read_latency_log(&dir.join("latency").join("old-writer"))
        .iter()
        .filter(|io| io.write)
        .map(|io| io.done_ms)
        .collect();
    tl.mark(format!(
        "fio through the old server failed: {}",
        common::strip_ansi(log.lines().find(|l| l.contains("error")).unwrap_or(""))
    ));
    if let Some(last) = acked.iter().max() {
        println!("    its last acknowledged write (of {}) completed at {}", acked.len(), tl.at(*last));
    }
    // Refused by the tractservers' fence (the new holder's claim) or by
    // its own lease check (after a renewal found the lease taken): when
    // the old server logged which.
    let text = first.wait_log("lost the lease", Duration::from_secs(30));
    for line in text.lines().filter(|l| l.contains("ERROR")) {
        let at = log_time_ms(line).map(|t| tl.at(t)).unwrap_or_default();
        println!("    old server, at {at}: {}", common::strip_ansi(line));
    }
    // Every block both phases wrote, overwritten through the old server
    // with a pattern no fio verify accepts.
    let checked = LEADERS_REGION.1 + OUTAGE_REGION.1;
    let (status, log) = run_fio(
        dir,
        "old-overwrite",
        &[
            "--name=old-overwrite".into(),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            "--rw=randwrite".into(),
            format!("--bs={BLOCK}"),
            "--iodepth=8".into(),
            "--offset=0".into(),
            format!("--size={checked}"),
            "--continue_on_error=write".into(),
            "--buffer_pattern=0x5a".into(),
            "--clocksource=clock_gettime".into(),
            "--output-format=terse".into(),
            "--terse-version=3".into(),
            "--eta=never".into(),
        ],
    );
    let r = Fio::parse(&log);
    let (total_err, first_error) = r.continue_on_error();
    // (With `--continue_on_error`, fio exits 0 whatever failed.)
    assert!(
        status.success()
            && r.error == EIO
            && r.write_kib == 0
            && total_err == checked / BLOCK
            && first_error == EIO,
        "every write through the old server should be refused ({status}):\n{log}"
    );
    tl.mark(format!("all {total_err} writes over both checked regions through the old server refused (EIO)"));

    let next_uri = nbd_uri(&next);
    for (job, written) in [(&leaders, phase1.written), (&outage, phase2.written)] {
        let r = job.verify_only(dir, &next_uri, written, "through the new server");
        tl.mark(format!("{}: {} MiB verified through the new server", job.name, mib(r.read_kib << 10)));
    }
    for p in ts.iter_mut().chain(metas.iter_mut()).chain([&mut first, &mut next]) {
        p.check_running();
    }

    let goal = Duration::from_millis(election.election_max_ms);
    println!(
        "longest I/O stall: {} ms with a majority up (each leader killed; goal: at most one election \
         timeout, {} ms: {}), {} ms with two of three replicas down for {} ms (tractservers' lease {} ms)",
        phase1.stall.as_millis(),
        goal.as_millis(),
        if phase1.stall <= goal { "met" } else { "NOT met" },
        phase2.stall.as_millis(),
        OUTAGE.as_millis(),
        lease.as_millis()
    );
    println!("test took {:.1} s", started.elapsed().as_secs_f64());
}

fn nbd_uri(server: &Proc) -> String {
    format!("nbd+unix:///v?socket={}", server.addr)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / MIB as f64)
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// The time (Unix ms) at the start of a `blizzard` log line:
/// tracing's UTC `2026-11-26T17:05:08.005581Z`.
fn log_time_ms(line: &str) -> Option<u64> {
    let line = common::strip_ansi(line);
    let t = line.split_whitespace().next()?.as_bytes();
    if t.len() < 24 || t[10] != b'T' || t[19] != b'.' {
        return None;
    }
    let num =
        |from: usize, to: usize| -> Option<i64> { std::str::from_utf8(&t[from..to]).ok()?.parse().ok() };
    let (y, m, d) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    // Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
    // days_from_civil).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    let secs = days * 86_400 + num(11, 13)? * 3600 + num(14, 16)? * 60 + num(17, 19)?;
    u64::try_from(secs * 1000 + num(20, 23)?).ok()
}

/// Says so if fio's pass ended before the schedule did (the region is
/// sized so it should not): the events after it ran without I/O.
fn note_if_done(fio: &mut Proc) {
    if !fio.running() {
        println!("NOTE: fio's pass over its region ended before the schedule: later events ran without I/O");
    }
}

/// What the test did and when (Unix milliseconds, as fio's latency log).
struct Timeline {
    start: Instant,
    start_ms: u64,
    events: Vec<(u64, String)>,
}

impl Timeline {
    fn new() -> Timeline {
        Timeline { start: Instant::now(), start_ms: unix_ms(), events: Vec::new() }
    }

    fn mark(&mut self, what: String) {
        println!("[{:>6} ms] {what}", self.start.elapsed().as_millis());
        self.events.push((unix_ms(), what));
    }

    /// `t` as "+N ms (M ms after EVENT)".
    fn at(&self, t: u64) -> String {
        let rel = t as i64 - self.start_ms as i64;
        match self.events.iter().rev().find(|(e, _)| *e <= t) {
            Some((e, what)) => format!("+{rel} ms, {} ms after: {what}", t - e),
            None => format!("+{rel} ms"),
        }
    }
}

/// One fio job over a region of the volume: its name, region and seed
/// determine the offsets it writes, in order.
struct Job {
    name: &'static str,
    offset: u64,
    size: u64,
    seed: u64,
}

/// A phase's figures.
struct Phase {
    /// Bytes fio wrote (and verified).
    written: u64,
    /// Its longest I/O.
    stall: Duration,
}

impl Job {
    fn new(name: &'static str, (offset, size): (u64, u64), seed: u64) -> Job {
        Job { name, offset, size, seed }
    }

    fn args(&self, uri: &str) -> Vec<String> {
        vec![
            format!("--name={}", self.name),
            "--ioengine=nbd".into(),
            format!("--uri={uri}"),
            // The random map (fio's default): each block of the region once.
            "--rw=randwrite".into(),
            format!("--bs={BLOCK}"),
            format!("--iodepth={IODEPTH}"),
            format!("--offset={}", self.offset),
            format!("--size={}", self.size),
            // fio 3.33 draws offsets from its fixed default seed unless
            // randrepeat is off too.
            "--randrepeat=0".into(),
            format!("--randseed={}", self.seed),
            "--verify=crc32c".into(),
            "--verify_fatal=1".into(),
            "--verify_state_save=0".into(),
            // fio's default clock (the TSC) costs ~60 ms of calibration.
            "--clocksource=clock_gettime".into(),
            "--output-format=terse".into(),
            "--terse-version=3".into(),
            "--eta=never".into(),
        ]
    }

    fn latency_log(&self, dir: &Path) -> PathBuf {
        dir.join("latency").join(self.name)
    }

    /// Starts writing the region at `RATE`, each write read back and
    /// checked within 32 writes, every I/O's latency logged; returns once
    /// fio is connected.
    fn start(&self, dir: &Path, uri: &str) -> Proc {
        let mut args = self.args(uri);
        args.extend([
            "--verify_backlog=32".into(),
            format!("--rate=,{RATE}"),
            format!("--write_lat_log={}", self.latency_log(dir).display()),
            "--log_avg_msec=0".into(),
            "--log_unix_epoch=1".into(),
        ]);
        let fio = common::tool("fio", "fio");
        let log = dir.join(format!("fio-{}.log", self.name));
        let mut p = Proc::spawn_program(&format!("fio {}", self.name), &fio, &args, log, uri.to_string());
        p.wait_log(FIO_CONNECTED, START_TIMEOUT);
        p
    }

    /// Stops fio (SIGINT: it completes what is in flight, skips its own
    /// final verify and reports),
    /// requires no error, prints the phase's figures and verifies what it
    /// wrote through `uri`.
    fn finish(&self, mut fio: Proc, dir: &Path, uri: &str, tl: &Timeline) -> Phase {
        // fio exits 128 after a signal, more if a job failed.
        let expected = if fio.interrupt() { 128 } else { 0 };
        let status = fio.wait_exit(START_TIMEOUT);
        let log = fio.log_text();
        let r = Fio::parse(&log);
        assert!(
            status.code() == Some(expected) && r.error == 0,
            "fio {} saw an error ({status}):\n{log}",
            self.name
        );
        let written = r.write_kib << 10;
        assert!(
            written > 0 && written.is_multiple_of(BLOCK),
            "fio {} wrote {written} bytes:\n{log}",
            self.name
        );
        let ios = read_latency_log(&self.latency_log(dir));
        let writes = ios.iter().filter(|io| io.write).count() as u64;
        assert_eq!(writes * BLOCK, written, "fio {}'s latency log and its report disagree", self.name);
        println!(
            "{}: fio wrote {} MiB ({writes} writes of the region's {}), read back and checked {} MiB of it \
             as it went, no error",
            self.name,
            mib(written),
            self.size / BLOCK,
            mib(r.read_kib << 10)
        );
        println!(
            "{}: longest I/O (fio's completion latency): write {} ms, read {} ms",
            self.name,
            r.write_lat_max.as_millis(),
            r.read_lat_max.as_millis()
        );
        if let Some(io) = ios.iter().max_by_key(|io| io.lat) {
            let issued = io.done_ms.saturating_sub(io.lat.as_millis() as u64);
            println!("    it was issued at {}", tl.at(issued));
        }
        let mut done: Vec<u64> = ios.iter().map(|io| io.done_ms).collect();
        done.sort_unstable();
        if let Some((gap, from)) = done.windows(2).map(|w| (w[1] - w[0], w[0])).max() {
            println!("{}: longest time without a completed I/O: {gap} ms", self.name);
            println!("    from {}", tl.at(from));
            println!("    to {}", tl.at(from + gap));
        }
        // The same figures from each kill to the next (or the end), and
        // before the first: what the kills changed.
        let mut windows: Vec<(u64, String)> = vec![(0, "before the first kill".into())];
        windows.extend(
            tl.events
                .iter()
                .filter(|(t, what)| {
                    what.starts_with("SIGKILL") && (done[0]..done[done.len() - 1]).contains(t)
                })
                .map(|(t, what)| (*t, format!("from \"{what}\" on"))),
        );
        for (k, (from, what)) in windows.iter().enumerate() {
            let to = windows.get(k + 1).map_or(u64::MAX, |(t, _)| *t);
            let gap = done.windows(2).filter(|w| w[1] >= *from && w[0] < to).map(|w| w[1] - w[0]).max();
            let io = ios
                .iter()
                .filter(|io| (*from..to).contains(&io.done_ms.saturating_sub(io.lat.as_millis() as u64)))
                .map(|io| io.lat)
                .max()
                .unwrap_or_default();
            println!(
                "    {what}: longest I/O {} ms, longest time without a completion {} ms",
                io.as_millis(),
                gap.unwrap_or(0)
            );
        }
        self.verify_only(dir, uri, written, "right away");
        Phase { written, stall: r.write_lat_max.max(r.read_lat_max) }
    }

    /// `--verify_only` of the first `written` bytes this job writes (the
    /// offsets it wrote, in the order it wrote them): every block must
    /// hold an intact fio block for its offset; one never written reads as
    /// zeros and fails.
    fn verify_only(&self, dir: &Path, uri: &str, written: u64, when: &str) -> Fio {
        let mut args = self.args(uri);
        args.extend(["--verify_only".into(), format!("--io_size={written}")]);
        let (status, log) = run_fio(dir, &format!("{}-verify", self.name), &args);
        let r = Fio::parse(&log);
        assert!(
            status.success() && r.error == 0 && r.read_kib << 10 == written,
            "fio --verify_only of {} ({when}) failed ({status}):\n{log}",
            self.name
        );
        r
    }
}

/// Runs fio to completion: how it exited and what it printed.
fn run_fio(dir: &Path, name: &str, args: &[String]) -> (ExitStatus, String) {
    let fio = common::tool("fio", "fio");
    let log = dir.join(format!("fio-{name}-{}.log", free_port()));
    let mut p = Proc::spawn_program(&format!("fio {name}"), &fio, args, log, String::new());
    let status = p.wait_exit(START_TIMEOUT);
    (status, p.log_text())
}

/// fio writing the third region through the old server, until it fails
/// (or 120 s pass), its acknowledged writes' times logged.
fn start_old_writer(dir: &Path, uri: &str, seed: u64) -> Proc {
    let args: Vec<String> = vec![
        "--name=old-writer".into(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        "--rw=randwrite".into(),
        format!("--bs={BLOCK}"),
        "--iodepth=4".into(),
        format!("--offset={}", OLD_WRITER_REGION.0),
        format!("--size={}", OLD_WRITER_REGION.1),
        "--randrepeat=0".into(),
        format!("--randseed={seed}"),
        format!("--rate=,{RATE}"),
        "--time_based".into(),
        "--runtime=120".into(),
        format!("--write_lat_log={}", dir.join("latency").join("old-writer").display()),
        "--log_avg_msec=0".into(),
        "--log_unix_epoch=1".into(),
        "--clocksource=clock_gettime".into(),
        "--output-format=terse".into(),
        "--terse-version=3".into(),
        "--eta=never".into(),
    ];
    let fio = common::tool("fio", "fio");
    let mut p =
        Proc::spawn_program("fio old-writer", &fio, &args, dir.join("fio-old-writer.log"), uri.into());
    p.wait_log(FIO_CONNECTED, START_TIMEOUT);
    p
}

/// What fio's terse (version 3) line reports.
#[derive(Debug)]
struct Fio {
    fields: Vec<String>,
    error: u32,
    read_kib: u64,
    write_kib: u64,
    read_lat_max: Duration,
    write_lat_max: Duration,
}

impl Fio {
    fn parse(log: &str) -> Fio {
        let line = log
            .lines()
            .find(|l| l.starts_with("3;"))
            .unwrap_or_else(|| panic!("no terse line in fio's output:\n{log}"));
        let fields: Vec<String> = line.trim().split(';').map(|s| s.to_string()).collect();
        assert!(fields.len() > 81, "a short terse line:\n{log}");
        let int = |i: usize| -> u64 {
            fields[i].parse::<f64>().unwrap_or_else(|_| panic!("terse field {i} of:\n{log}")) as u64
        };
        // Fields (from 0): 4 the error; the read status from 5, the write
        // status from 46, each KiB first and the total latency's maximum
        // (microseconds) 33 fields on.
        Fio {
            error: int(4) as u32,
            read_kib: int(5),
            write_kib: int(46),
            read_lat_max: Duration::from_micros(int(38)),
            write_lat_max: Duration::from_micros(int(79)),
            fields,
        }
    }

    /// With `--continue_on_error`: (errors, the first one).
    fn continue_on_error(&self) -> (u64, u32) {
        let n = self.fields.len();
        (self.fields[n - 2].parse().unwrap(), self.fields[n - 1].parse().unwrap())
    }
}

/// One completed I/O of fio's latency log.
struct Io {
    /// When it completed (Unix milliseconds).
    done_ms: u64,
    lat: Duration,
    write: bool,
}

/// fio's `--write_lat_log=PREFIX --log_avg_msec=0 --log_unix_epoch=1`:
/// one line per completed I/O, "time (ms), latency (ns), direction (0
/// read, 1 write), size, ...".
fn read_latency_log(prefix: &Path) -> Vec<Io> {
    let path = format!("{}_lat.1.log", prefix.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            Io {
                done_ms: f[0].parse().unwrap(),
                lat: Duration::from_nanos(f[1].parse().unwrap()),
                write: f[2] == "1",
            }
        })
        .collect()
}

#[test]
fn log_line_times_parse() {
    let line = "\x1b[2m2026-11-26T17:05:08.005581Z\x1b[0m \x1b[31mERROR\x1b[0m lost the lease";
    assert_eq!(log_time_ms(line), Some(1_795_712_708_005));
    assert_eq!(log_time_ms("2024-02-29T23:59:59.999999Z  INFO x"), Some(1_709_251_199_999));
    assert_eq!(log_time_ms("NBD export \"v\" at unix:/tmp/x.sock:"), None);
}
