//! Online resize as a user does it (issue 57): `blizzard up
//! --replication 3`, fio writing with `--verify=crc32c` over NBD, and
//! `blizzard volume resize` while it runs (through the serving process's
//! control socket). A new NBD connection sees each new size and
//! `qemu-img info` agrees; a shrink needs `--allow-shrink`; writes past
//! the end are refused; what a grow gains reads as zeros, also where a
//! shrink's data was; fio's own check of what it wrote passes after.
//! In the write-through and log modes (fast-ack shares write-through's
//! path: `crates/cluster` tests all three in process).

// Real processes, sockets and time.
#![allow(clippy::disallowed_methods, clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use crate::common::up::Up;
use crate::common::{self, Proc};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
/// fio's region: below every size the test sets.
const BUSY: u64 = 32 * MIB;

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// The export's size as `qemu-img info` sees it on a new connection.
fn qemu_size(up: &Up) -> u64 {
    let qemu_img = common::tool("qemu-img", "qemu-utils");
    let out = std::process::Command::new(qemu_img)
        .args(["info", "--output=json", &up.uri(&up.volume)])
        .output()
        .unwrap();
    assert!(out.status.success(), "qemu-img info: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("\"virtual-size\":").unwrap_or_else(|| panic!("no virtual-size in {text}"));
    text[at + 15..].trim_start().split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

/// Runs `script` in nbdsh (libnbd's Python shell) on a new connection.
fn nbdsh(up: &Up, script: &str) {
    let nbdsh = common::tool("nbdsh", "python3-libnbd");
    let out = std::process::Command::new(nbdsh)
        .env("PATH", format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default()))
        .args(["-u", &up.uri(&up.volume), "-c", script])
        .output()
        .unwrap();
    assert!(out.status.success(), "nbdsh: {}", String::from_utf8_lossy(&out.stderr));
}

fn resize(up: &Up, size: &str, shrink: bool) -> (bool, String) {
    let mut args = vec!["volume", "resize", up.volume.as_str(), "--size", size, "--meta", up.meta.as_str()];
    if shrink {
        args.push("--allow-shrink");
    }
    common::blizzard(&args)
}

/// fio over `[0, BUSY)`: random writes of 4–64 KiB for `secs`, each
/// checked (crc32c in its header) while the job runs and at its end.
fn fio_verify(up: &Up, secs: u32, log: &Path) -> Proc {
    let fio = common::tool("fio", "fio");
    let args = strings(&[
        "--name=busy",
        "--ioengine=nbd",
        &format!("--uri={}", up.uri(&up.volume)),
        "--rw=randwrite",
        "--bs=16k",
        "--iodepth=16",
        &format!("--size={BUSY}"),
        "--verify=crc32c",
        "--verify_backlog=64",
        "--verify_state_save=0",
        "--time_based",
        &format!("--runtime={secs}"),
        "--eta=never",
        "--clocksource=clock_gettime",
    ]);
    let mut p = Proc::spawn_program("fio", &fio, &args, log.to_path_buf(), String::new());
    p.wait_log("fio: connected to NBD server", Duration::from_secs(60));
    p
}

fn resize_through_up(volume: &str, mode: &str) {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let up = Up::start(w, volume, mode, SIZE);
    assert_eq!(qemu_size(&up), SIZE);
    // Something past fio's region, for the shrink to drop.
    nbdsh(&up, &format!("h.pwrite(b'\\x5a' * {MIB}, {})\nh.flush()\n", 40 * MIB));
    let mut fio = fio_verify(&up, 12, &w.join("fio.log"));

    let text = common::ok(resize(&up, "128MiB", false));
    assert!(text.contains("through the process serving it"), "{text}");
    assert_eq!(qemu_size(&up), 128 * MIB, "a new connection sees the grown size");
    nbdsh(
        &up,
        &format!(
            "assert h.pread({MIB}, {}) == bytes({MIB})\nh.pwrite(b'\\x77' * 4096, {})\n",
            100 * MIB,
            128 * MIB - 4096
        ),
    );

    let (ok, text) = resize(&up, "36MiB", false);
    assert!(!ok && text.contains("--allow-shrink"), "a shrink without --allow-shrink: {text}");
    common::ok(resize(&up, "36MiB", true));
    assert_eq!(qemu_size(&up), 36 * MIB, "a new connection sees the shrunk size");
    nbdsh(
        &up,
        &format!(
            "try:\n    h.pwrite(b'x' * 4096, {})\n    raise SystemExit('a write past the end was taken')\nexcept nbd.Error:\n    pass\n",
            36 * MIB
        ),
    );
    fio.check_running();
    common::ok(resize(&up, "64MiB", false));
    assert_eq!(qemu_size(&up), SIZE);
    // The shrink's data does not come back with the grow.
    nbdsh(&up, &format!("assert h.pread({}, {}) == bytes({})\n", 28 * MIB, 36 * MIB, 28 * MIB));

    let status = fio.wait_exit(Duration::from_secs(120));
    assert!(status.success(), "fio's verification failed:\n{}", fio.tail());
    let log = fio.log_text();
    assert!(log.contains("write: IOPS="), "fio wrote nothing:\n{log}");
    let info = common::ok(common::blizzard(&["volume", "info", volume, "--meta", &up.meta]));
    assert!(info.contains(&SIZE.to_string()) || info.contains("64 MiB"), "{info}");
}

#[test]
fn resize_write_through_while_served_under_fio() {
    resize_through_up("grow-wt", "write-through");
}

#[test]
fn resize_log_while_served_under_fio() {
    resize_through_up("grow-log", "log");
}
