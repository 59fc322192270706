//! Snapshots of volumes in the blob store (design 0011, issue 57) as a
//! user takes them: `blizzard up --replication 3`, fio over NBD with
//! `--verify=crc32c`, `blizzard volume snapshot` while fio writes (the
//! command reaches the serving process through its control socket), a
//! SIGKILL and a restart, and every snapshot export read back by fio's
//! own verification of what it had written at that point.
//!
//! The volume is cut in two halves. fio writes half A whole (pattern 1)
//! and checks it; then, while a second fio keeps writing half B at random,
//! `s1` is taken; fio overwrites half A (pattern 2) and `s2` is taken, B
//! still being written. After the SIGKILL and restart, fio verifies half A
//! of `disk@s1` against pattern 1, of `disk@s2` and of the volume against
//! pattern 2; `volume list` names both snapshots and what each holds alone;
//! a snapshot export refuses writes. `volume rollback NAME@s1` through
//! the server makes half A read pattern 1 again (a served log volume
//! refuses, saying to stop the server). Deleting `s1` gives its space back
//! (`blizzard status`), `s2` and the volume reading as before. In the
//! write-through and log modes
//! (each its own volume name: the control socket is per volume, in the
//! host's run directory).

// Real processes, sockets and time.
#![allow(clippy::disallowed_methods, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::up::Up;
use crate::common::{self, Proc};

const SIZE: u64 = 64 << 20;
const HALF: u64 = SIZE / 2;
const START_TIMEOUT: Duration = Duration::from_secs(120);

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// fio over NBD on `[offset, offset + HALF)` of `export`: with `write`, a
/// sequential write of pattern `seed` checked after (crc32c in every 64 KiB
/// block's header); without, a check of what an earlier write left.
fn fio_half(up: &Up, export: &str, offset: u64, seed: u64, write: bool, log: &Path) {
    let fio = common::tool("fio", "fio");
    let mut args = strings(&[
        "--name=half",
        "--ioengine=nbd",
        &format!("--uri={}", up.uri(export)),
        "--rw=write",
        "--bs=64k",
        "--iodepth=16",
        &format!("--offset={offset}"),
        &format!("--size={HALF}"),
        "--verify=crc32c",
        &format!("--randseed={seed}"),
        "--eta=never",
        "--clocksource=clock_gettime",
    ]);
    if !write {
        args.push("--verify_only".into());
    }
    let out = std::process::Command::new(&fio).args(&args).output().unwrap();
    std::fs::write(log, [&out.stdout[..], &out.stderr[..]].concat()).unwrap();
    assert!(
        out.status.success(),
        "fio {} of {export} at {offset} (pattern {seed}) failed:\n{}{}",
        if write { "write+verify" } else { "verify" },
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// fio writing half B at random until killed.
fn fio_background(up: &Up, log: PathBuf) -> Proc {
    let fio = common::tool("fio", "fio");
    let args = strings(&[
        "--name=background",
        "--ioengine=nbd",
        &format!("--uri={}", up.uri(&up.volume)),
        "--rw=randwrite",
        "--bsrange=4k-64k",
        "--iodepth=32",
        &format!("--offset={HALF}"),
        &format!("--size={HALF}"),
        "--time_based",
        "--runtime=300",
        "--randrepeat=0",
        "--eta=never",
        "--clocksource=clock_gettime",
    ]);
    let mut p = Proc::spawn_program("fio", &fio, &args, log, String::new());
    p.wait_log("fio: connected to NBD server", START_TIMEOUT);
    p
}

fn snapshots_through_up(volume: &str, mode: &str) {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let mut up = Up::start(w, volume, mode, SIZE);
    let meta = |up: &Up| up.meta.clone();
    fio_half(&up, volume, 0, 1, true, &w.join("fio-a1.log"));

    let mut background = fio_background(&up, w.join("fio-b.log"));
    std::thread::sleep(Duration::from_millis(500));
    let text = common::ok(common::blizzard(&["volume", "snapshot", volume, "s1", "--meta", &meta(&up)]));
    assert!(text.contains("through the process serving it"), "{text}");
    fio_half(&up, volume, 0, 2, true, &w.join("fio-a2.log"));
    background.check_running();
    let text = common::ok(common::blizzard(&["volume", "snapshot", volume, "s2", "--meta", &meta(&up)]));
    assert!(text.contains("frozen"), "{text}");
    std::thread::sleep(Duration::from_millis(300));
    background.kill();

    up.kill_and_restart();
    fio_half(&up, &format!("{volume}@s1"), 0, 1, false, &w.join("fio-s1.log"));
    fio_half(&up, &format!("{volume}@s2"), 0, 2, false, &w.join("fio-s2.log"));
    fio_half(&up, volume, 0, 2, false, &w.join("fio-v.log"));

    let list = common::ok(common::blizzard(&["volume", "list", "--meta", &meta(&up)]));
    let line = |s: &str| {
        list.lines()
            .find(|l| l.starts_with(&format!("{volume}@{s} ")))
            .unwrap_or_else(|| panic!("no {volume}@{s} in:\n{list}"))
            .to_string()
    };
    for s in ["s1", "s2"] {
        assert!(line(s).contains("snapshot") && line(s).contains("alone"), "{list}");
    }
    // s1 alone holds pattern 1 of half A (32 MiB: s2 and the volume read
    // pattern 2 there), and what fio rewrote of half B before s2. (A log
    // volume's layer holds its log's blocks, with their headers: more.)
    let held = line("s1");
    let mib: f64 = held
        .split("holds ")
        .nth(1)
        .and_then(|r| r.strip_suffix(" MiB alone"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no size in MiB in {held:?}"));
    let most = if mode == "log" { 2.0 * SIZE as f64 / (1 << 20) as f64 } else { 64.0 };
    assert!((32.0..=most).contains(&mib), "{list}");
    // Read-only, whatever the client asks.
    let nbdsh = common::tool("nbdsh", "python3-libnbd");
    let out = std::process::Command::new(nbdsh)
        .env("PATH", format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default()))
        .args([
            "-u",
            &up.uri(&format!("{volume}@s1")),
            "-c",
            "assert h.is_read_only()\ntry:\n    h.pwrite(b'x' * 512, 0)\n    raise SystemExit('a snapshot took a write')\nexcept nbd.Error:\n    pass\n",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Rolled back to s1 through the server (no client is connected now):
    // half A reads pattern 1 again. A served log volume refuses (its log
    // would have to be recovered again), saying what to do.
    let rollback = common::blizzard(&["volume", "rollback", &format!("{volume}@s1"), "--meta", &meta(&up)]);
    let now = if mode == "log" {
        assert!(!rollback.0 && rollback.1.contains("stop the server"), "{}", rollback.1);
        2
    } else {
        let text = common::ok(rollback);
        assert!(text.contains("rolled") && text.contains("through the process serving it"), "{text}");
        fio_half(&up, volume, 0, 1, false, &w.join("fio-rolled-back.log"));
        1
    };

    // Deleting s1 gives back what it alone held (pattern 1 of half A,
    // written whole: whole tracts), as `blizzard status` shows; s2 and
    // the volume read as before.
    let before = status_tracts(&up);
    let text =
        common::ok(common::blizzard(&["volume", "delete", &format!("{volume}@s1"), "--meta", &meta(&up)]));
    assert!(text.contains("deleted snapshot") && text.contains("gave back"), "{text}");
    let list = common::ok(common::blizzard(&["volume", "list", "--meta", &meta(&up)]));
    assert!(!list.contains(&format!("{volume}@s1 ")) && list.contains(&format!("{volume}@s2 ")), "{list}");
    // Served before (the server had it open): not any more.
    let nbdinfo = common::tool("nbdinfo", "libnbd-bin");
    let out = std::process::Command::new(nbdinfo).arg(up.uri(&format!("{volume}@s1"))).output().unwrap();
    assert!(!out.status.success(), "a deleted snapshot is still served");
    fio_half(&up, &format!("{volume}@s2"), 0, 2, false, &w.join("fio-s2-after.log"));
    fio_half(&up, volume, 0, now, false, &w.join("fio-v-after.log"));
    // 3 replicas of at least 24 of its 32 1-MiB tracts (a log volume's
    // blocks straddle tracts: some stay with s2's).
    let want = before.saturating_sub(3 * 24);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut now = status_tracts(&up);
    while now > want && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
        now = status_tracts(&up);
    }
    assert!(now <= want, "blizzard status shows {now} tracts used after deleting s1, {before} before");
    println!("{volume}: {text} (blizzard status: {before} tracts used before, {now} after)");
    common::ok(common::blizzard(&["volume", "delete", &format!("{volume}@s2"), "--meta", &meta(&up)]));
    fio_half(&up, volume, 0, now, false, &w.join("fio-v-last.log"));
}

/// The tracts every tractserver holds, as `blizzard status` shows them.
fn status_tracts(up: &Up) -> u64 {
    let text = common::ok(common::blizzard(&["status", "--meta", &up.meta]));
    let mut lines = text.lines().skip_while(|l| !l.starts_with("TRACTSERVER"));
    lines.next();
    lines
        .filter_map(|l| l.split_whitespace().nth(7))
        .map(|n| n.parse::<u64>().unwrap_or_else(|_| panic!("no tract count in blizzard status:\n{text}")))
        .sum()
}

#[test]
fn blob_snapshots_write_through_under_fio_and_sigkill() {
    snapshots_through_up("snap-wt", "write-through");
}

#[test]
fn blob_snapshots_log_under_fio_and_sigkill() {
    snapshots_through_up("snap-log", "log");
}
