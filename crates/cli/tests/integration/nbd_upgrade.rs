//! Online upgrade of `blizzard nbd` (Ursa §5.2, `blizzard_nbd::upgrade`)
//! under a client that never reconnects: fio's nbd engine (libnbd).
//!
//! One `blizzard meta`, three tractservers, a 2-way write-through volume
//! served by `blizzard nbd` on a unix socket. fio (two jobs, so two NBD
//! connections) writes 4 KiB blocks at random offsets of a region each,
//! every block with a crc32c header, reads each back within 16 writes
//! (`verify_backlog`) and, once its region is written, every block again
//! (fio's verify phase). While it writes:
//!
//! 0. a successor that cannot take over (started `--read-only`: it would
//!    tell the clients other transmission flags) fails after the old
//!    server has quiesced, released its volume and sent the sockets; the
//!    old server must reopen its volume and serve on;
//! 1. a new process of the same binary started with `--upgrade-from PID`
//!    takes over the listener and both connections; the old one must
//!    exit 0;
//! 2. SIGUSR2 to that one: it starts its own successor (the same
//!    arguments, `--upgrade-from` its hand-over socket), which takes over;
//!    it must exit 0.
//!
//! fio must be writing when each hand-over starts (its rate makes its pass
//! last far longer), and must end with no error and no verify failure:
//! every write acknowledged before, during and after the hand-overs reads
//! back intact. Then the last process must serve a new client (nbdinfo)
//! and stop cleanly on SIGTERM. Nothing about time is asserted.

#![allow(clippy::unwrap_used)]
// Real processes, sockets and time.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{blizzard, free_port, meta_args, Proc, Procs};

const TRACTSERVERS: usize = 3;
const REPLICATION: u8 = 2;
pub(crate) const MIB: u64 = 1 << 20;
/// Each fio job's region; the volume holds both.
pub(crate) const REGION: u64 = 16 * MIB;
const BLOCK: u64 = 4096;
/// Each job's write rate: its pass over its region takes 32 s (and fio
/// then reads it all back), far longer than the schedule below.
const RATE: u64 = 512 << 10;
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// fio's line once the NBD handshake is done.
const FIO_CONNECTED: &str = "fio: connected to NBD server";
/// `blizzard nbd`'s line once it serves.
const NBD_READY: &str = "NBD export ";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_verify_survives_two_online_upgrades() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let _logs = common::DumpLogsOnPanic(dir.to_path_buf());
    let meta = format!("127.0.0.1:{}", free_port());
    let meta_proc = Proc::spawn(
        "meta",
        &meta_args(&meta, REPLICATION, TRACTSERVERS, None),
        dir.join("meta.log"),
        meta.clone(),
    );
    let mut procs =
        Procs { meta: meta_proc, ts: common::spawn_tractservers(dir, &meta, TRACTSERVERS, "256MiB") };
    procs.wait_listening(START_TIMEOUT);
    let (size, replication) = ((2 * REGION).to_string(), REPLICATION.to_string());
    let (ok, out) =
        blizzard(&["volume", "create", "v", "--size", &size, "--replication", &replication, "--meta", &meta]);
    assert!(ok, "volume create: {out}");

    let mut first = common::nbd(dir, &meta, "nbd1", "v", &[]);
    first.wait_log(NBD_READY, START_TIMEOUT);
    let socket = first.addr.clone();
    let uri = format!("nbd+unix:///v?socket={socket}");
    let say = |what: &str| println!("[{:>6} ms] {what}", started.elapsed().as_millis());
    say("cluster up, blizzard nbd serving volume v");

    let mut fio = start_fio(dir, &uri);
    say("fio writes through two connections");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 0. A successor that fails: the old server serves on.
    let old = first.pid().unwrap();
    let from = old.to_string();
    assert!(fio.running(), "fio ended before the failed hand-over:\n{}", fio.tail());
    let mut failed = common::nbd(dir, &meta, "nbd-ro", "v", &["--upgrade-from", &from, "--read-only"]);
    let status = failed.wait_exit(START_TIMEOUT);
    let log = failed.log_text();
    assert!(!status.success() && log.contains("--read-only"), "a read-only successor ({status}):\n{log}");
    let log = first.wait_log("resuming the connections the hand-over gave back", START_TIMEOUT);
    assert!(log.contains(&format!("hand-over to process {} failed", failed_pid(&log))), "{log}");
    first.check_running();
    say("a read-only successor failed to take over; the old server serves on");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 1. --upgrade-from PID.
    assert!(fio.running(), "fio ended before the first hand-over:\n{}", fio.tail());
    let mut second = common::nbd(dir, &meta, "nbd2", "v", &["--upgrade-from", &from]);
    second.wait_log(NBD_READY, START_TIMEOUT);
    let status = first.wait_exit(START_TIMEOUT);
    assert!(
        status.success(),
        "the old server should exit 0 after the hand-over ({status}):\n{}",
        first.tail()
    );
    let log = common::strip_ansi(&first.log_text());
    assert!(log.contains("serves the listener and 2 connections"), "the old server's log:\n{log}");
    let log = second.log_text();
    assert!(log.contains(&format!("hand-over from process {old} done")), "the new server's log:\n{log}");
    say(&format!("process {} took over from {old} (--upgrade-from), which exited 0", second.pid().unwrap()));
    tokio::time::sleep(Duration::from_secs(3)).await;

    // 2. SIGUSR2: the server starts its successor itself; then fio ends,
    // and the last process serves a new client and stops.
    sigusr2_then_finish(&mut second, &mut fio, &uri, START_TIMEOUT, &say);
    procs.check_running();
}

/// The end both online-upgrade tests share: SIGUSR2 to `current`, which
/// starts its own successor, which must take over while `current` exits
/// 0; then fio must end with every block written and verified; then the
/// last process must serve a new client (nbdinfo) and stop on SIGTERM.
pub(crate) fn sigusr2_then_finish(
    current: &mut Proc,
    fio: &mut Proc,
    uri: &str,
    timeout: Duration,
    say: &dyn Fn(&str),
) {
    let old = current.pid().unwrap();
    assert!(fio.running(), "fio ended before the hand-over on SIGUSR2:\n{}", fio.tail());
    signal(old, "USR2");
    let status = current.wait_exit(timeout);
    // The successor writes to the same log (it inherited its output).
    let log = current.log_text();
    assert!(status.success(), "the old process should exit 0 after the hand-over ({status}):\n{log}");
    let third = successor_pid(&log);
    let _third = Orphan(third);
    let text = wait_text(current, &format!("hand-over from process {old} done"));
    assert!(text.contains("hand-over done"), "{text}");
    say(&format!("SIGUSR2: process {third} took over from {old}, which exited 0"));

    // fio ends: every block written, read back and checked.
    let status = fio.wait_exit(Duration::from_secs(300));
    let out = fio.log_text();
    let (error, read_kib, write_kib) = terse(&out);
    assert!(status.success() && error == 0, "fio failed ({status}):\n{out}");
    assert_eq!(write_kib << 10, 2 * REGION, "fio should write both regions whole:\n{out}");
    assert!(read_kib << 10 >= 2 * REGION, "fio should read back every block it wrote:\n{out}");
    say(&format!(
        "fio wrote {} MiB and verified {} MiB read back, no error",
        (write_kib << 10) / MIB,
        (read_kib << 10) / MIB
    ));

    // The last process serves a new client, and stops cleanly.
    let info = Command::new(common::tool("nbdinfo", "libnbd-bin")).arg(uri).output().unwrap();
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(info.status.success() && text.contains(&(2 * REGION).to_string()), "nbdinfo {uri}:\n{text}");
    assert!(alive(third), "process {third} should serve");
    signal(third, "TERM");
    let deadline = Instant::now() + timeout;
    while alive(third) {
        assert!(Instant::now() < deadline, "process {third} still runs {timeout:?} after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = current.log_text();
    assert!(!log.contains("flush at shutdown failed"), "{log}");
    say("a new client served by the last process, which stopped on SIGTERM");
}

/// fio's nbd engine: two jobs (two connections), each writing its own
/// region at `RATE` in 4 KiB blocks at random offsets (each block once),
/// checking every write within 16 more and all of them at the end.
pub(crate) fn start_fio(dir: &Path, uri: &str) -> Proc {
    let seed = blizzard_env::Env::real().random_u64() >> 16;
    println!("fio seeds from {seed}");
    let args: Vec<String> = vec![
        "--name=upgrade".into(),
        "--ioengine=nbd".into(),
        format!("--uri={uri}"),
        "--rw=randwrite".into(),
        format!("--bs={BLOCK}"),
        "--iodepth=16".into(),
        "--numjobs=2".into(),
        format!("--size={REGION}"),
        format!("--offset_increment={REGION}"),
        format!("--rate=,{RATE}"),
        "--randrepeat=0".into(),
        format!("--randseed={seed}"),
        "--verify=crc32c".into(),
        "--verify_backlog=16".into(),
        "--verify_fatal=1".into(),
        "--verify_state_save=0".into(),
        "--group_reporting".into(),
        // fio's default clock (the TSC) costs ~60 ms of calibration.
        "--clocksource=clock_gettime".into(),
        "--output-format=terse".into(),
        "--terse-version=3".into(),
        "--eta=never".into(),
    ];
    let fio = common::tool("fio", "fio");
    let mut p = Proc::spawn_program("fio", &fio, &args, dir.join("fio.log"), uri.to_string());
    p.wait_log(FIO_CONNECTED, START_TIMEOUT);
    p
}

/// fio's terse (version 3) line: (error, KiB read, KiB written).
pub(crate) fn terse(out: &str) -> (u64, u64, u64) {
    let line = out.lines().find(|l| l.starts_with("3;")).unwrap_or_else(|| panic!("no terse line:\n{out}"));
    let f: Vec<&str> = line.trim().split(';').collect();
    assert!(f.len() > 46, "a short terse line:\n{out}");
    let int = |i: usize| f[i].parse::<f64>().unwrap_or_else(|_| panic!("terse field {i}:\n{out}")) as u64;
    (int(4), int(5), int(46))
}

/// The process id of the successor whose hand-over failed, from the old
/// server's log.
pub(crate) fn failed_pid(log: &str) -> u32 {
    let log = common::strip_ansi(log);
    let rest =
        log.split("hand-over to process ").nth(1).unwrap_or_else(|| panic!("no failed hand-over:\n{log}"));
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// The process id a SIGUSR2'd server logged for its successor.
pub(crate) fn successor_pid(log: &str) -> u32 {
    let line = common::strip_ansi(
        log.lines()
            .find(|l| l.contains("SIGUSR2: started process"))
            .unwrap_or_else(|| panic!("no successor started in:\n{log}")),
    );
    let rest = line.split("SIGUSR2: started process ").nth(1).unwrap();
    rest.split_whitespace().next().unwrap().parse().unwrap()
}

/// Waits until `p`'s log (it may have exited: a successor writes there
/// too) holds `needle`, and returns the log.
pub(crate) fn wait_text(p: &Proc, needle: &str) -> String {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let text = p.log_text();
        if text.contains(needle) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} in {} after {START_TIMEOUT:?}:\n{}",
            p.name,
            p.tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kill -SIG pid` (no crate here sends signals).
pub(crate) fn signal(pid: u32, sig: &str) {
    let ok = Command::new("sh").args(["-c", &format!("kill -{sig} {pid}")]).status().unwrap().success();
    assert!(ok, "kill -{sig} {pid} failed");
}

/// Whether process `pid` runs (not a zombie: the successor is not our
/// child, so init reaps it).
pub(crate) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// A server this test did not start itself (a SIGUSR2 successor): killed
/// when dropped, so a failing test leaves nothing running.
pub(crate) struct Orphan(pub(crate) u32);

impl Drop for Orphan {
    fn drop(&mut self) {
        if alive(self.0) {
            let _ = Command::new("sh").args(["-c", &format!("kill -KILL {}", self.0)]).status();
        }
    }
}
