//! Online upgrade of `blizzard up` (Ursa §5.2): the NBD listener and live
//! connections, and the embedded cluster's data directory, handed to a new
//! process under a client that never reconnects (fio's nbd engine).
//!
//! `blizzard up`, 3-way (as deployed), serves its volume on a unix socket.
//! fio (two jobs, two NBD connections) writes 4 KiB blocks at random
//! offsets, each with a crc32c header, reads each back within 16 writes
//! and, once its region is written, every block again. While it writes:
//!
//! 0. a second `blizzard up` on the same data directory, without
//!    `--upgrade-from`, is refused (the directory's lock): two processes
//!    never run one cluster's disks;
//! 1. a successor that cannot start the cluster (its metadata address is
//!    taken) fails after the old process stopped its own: the old one must
//!    start its cluster again, reopen its volume and serve on;
//! 2. `--upgrade-from PID` takes over; the old process exits 0;
//! 3. SIGUSR2 to that one: it starts its own successor, which takes over.
//!
//! fio must end with no error and no verify failure: every write
//! acknowledged before, during and after the hand-overs reads back intact.
//! Then the last process serves a new client and stops on SIGTERM.

#![allow(clippy::unwrap_used)]
// Real processes, sockets and time.
#![allow(clippy::disallowed_methods)]

use crate::common;
use crate::nbd_upgrade::{failed_pid, sigusr2_then_finish, start_fio, REGION};

use std::path::Path;
use std::time::{Duration, Instant};

use common::{free_port, Proc};

const START_TIMEOUT: Duration = Duration::from_secs(90);
const READY: &str = "stops it cleanly";

fn up(dir: &Path, name: &str, meta: u16, extra: &[&str]) -> Proc {
    let data = dir.join("data").display().to_string();
    let socket = dir.join("nbd.sock").display().to_string();
    let mut args: Vec<String> = [
        "up",
        "--data",
        &data,
        "--listen",
        &format!("unix:{socket}"),
        "--meta-listen",
        &format!("127.0.0.1:{meta}"),
        "--tractservers",
        "4",
        "--replication",
        "3",
        "--size",
        &(2 * REGION).to_string(),
        "--disk-size",
        "256MiB",
        "--tract-size",
        "1MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn(name, &args, dir.join(format!("{name}.log")), socket)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fio_verify_survives_online_upgrades_of_blizzard_up() {
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let _logs = common::DumpLogsOnPanic(dir.to_path_buf());
    let say = |what: &str| println!("[{:>6} ms] {what}", started.elapsed().as_millis());
    let meta = free_port();
    let mut first = up(dir, "up1", meta, &[]);
    first.wait_log(READY, START_TIMEOUT);
    let uri = format!("nbd+unix:///disk?socket={}", first.addr);
    say("blizzard up serving volume disk, 3-way");
    let mut fio = start_fio(dir, &uri);
    say("fio writes through two connections");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 0. A second process on the same directory is refused.
    let mut second = up(dir, "up-again", free_port(), &[]);
    let status = second.wait_exit(START_TIMEOUT);
    let log = common::strip_ansi(&second.log_text());
    assert!(!status.success() && log.contains("another blizzard process serves"), "({status}):\n{log}");
    first.check_running();
    say("a second blizzard up on the same data directory was refused");

    // 1. A successor that cannot start the cluster: the old one starts
    // its own again and serves on.
    let old = first.pid().unwrap();
    let from = old.to_string();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    assert!(fio.running(), "fio ended before the failed hand-over:\n{}", fio.tail());
    let mut failed = up(dir, "up-fails", taken_port, &["--upgrade-from", &from]);
    let status = failed.wait_exit(START_TIMEOUT);
    let log = common::strip_ansi(&failed.log_text());
    assert!(
        !status.success() && log.contains("starting the embedded cluster"),
        "a successor whose metadata address is taken ({status}):\n{log}"
    );
    let log = first.wait_log("resuming the connections the hand-over gave back", START_TIMEOUT);
    let log = common::strip_ansi(&log);
    assert!(log.contains("the storage is back after the failed hand-over"), "{log}");
    assert!(log.contains(&format!("hand-over to process {} failed", failed_pid(&log))), "{log}");
    first.check_running();
    drop(taken);
    say("a successor that could not start the cluster failed; the old process restarted its own and serves on");
    tokio::time::sleep(Duration::from_secs(2)).await;

    // 2. --upgrade-from PID.
    assert!(fio.running(), "fio ended before the first hand-over:\n{}", fio.tail());
    let mut next = up(dir, "up2", meta, &["--upgrade-from", &from]);
    next.wait_log(READY, START_TIMEOUT);
    let status = first.wait_exit(START_TIMEOUT);
    assert!(
        status.success(),
        "the old process should exit 0 after the hand-over ({status}):\n{}",
        first.tail()
    );
    let log = common::strip_ansi(&first.log_text());
    assert!(log.contains("serves the listener and 2 connections"), "the old process's log:\n{log}");
    say(&format!("process {} took over from {old} (--upgrade-from), which exited 0", next.pid().unwrap()));
    tokio::time::sleep(Duration::from_secs(3)).await;

    // 3. SIGUSR2: it starts its successor itself; then fio ends, and the
    // last process serves a new client and stops.
    sigusr2_then_finish(&mut next, &mut fio, &uri, START_TIMEOUT, &say);
}
