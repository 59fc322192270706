//! Third-party clients against the server: libnbd's nbdinfo and nbdcopy,
//! QEMU's qemu-io and qemu-img. They must be installed (CI installs them;
//! `scripts/test` does too); a missing tool fails the test and names the
//! Debian package rather than skipping.

#![allow(clippy::unwrap_used)]
// The test drives real processes and files outside the env seam.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::process::Command;

use blizzard_nbd::NbdConfig;
use blizzard_volume::{CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 8 << 20;

pub(crate) fn need(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`{tool}` is missing: install the Debian package {package} (apt-get install -y {package})"
    );
}

/// Runs a command; fails the test with its output unless it exits 0.
pub(crate) fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd} {args:?} failed ({}):\n{text}", out.status);
    text
}

/// Runs a command that must fail; its output.
pub(crate) fn fails(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{cmd} {args:?} succeeded:\n{text}");
    text
}

/// nbdinfo (list, details, map, can flush), qemu-io (unaligned pattern
/// writes and reads, discard, write -z, flush), qemu-img convert in and
/// out plus compare, and nbdcopy (multi-connection) in and out.
#[test]
fn third_party_clients() {
    need("nbdinfo", "libnbd-bin");
    need("nbdcopy", "libnbd-bin");
    need("qemu-io", "qemu-utils");
    need("qemu-img", "qemu-utils");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let vols = [
        spec("disk", SIZE, CommitMode::FastAck, FlushPolicy::Durable),
        spec("copy", SIZE, CommitMode::Log, FlushPolicy::Durable),
        spec("wt", SIZE, CommitMode::WriteThrough, FlushPolicy::Durable),
    ];
    let fx = rt.block_on(start(&vols, NbdConfig::default()));
    let base = format!("nbd://{}", fx.addr);
    let uri = |name: &str| format!("{base}/{name}");

    // nbdinfo.
    let list = run("nbdinfo", &["--list", &base]);
    for v in &vols {
        assert!(list.contains(&format!("export=\"{}\"", v.name)) || list.contains(&v.name), "{list}");
    }
    let info = run("nbdinfo", &[&uri("disk")]);
    assert!(info.contains("export-size: 8388608"), "{info}");
    assert!(info.contains("can_multi_conn: true"), "{info}");
    assert!(info.contains("can_fua: true") && info.contains("can_trim: true"), "{info}");
    assert!(info.contains("base:allocation"), "{info}");
    run("nbdinfo", &["--can", "flush", &uri("disk")]);
    run("nbdinfo", &["--can", "zero", &uri("disk")]);
    run("nbdinfo", &["--can", "multi-conn", &uri("disk")]);
    let map = run("nbdinfo", &["--map", &uri("disk")]);
    assert!(map.lines().count() >= 1 && (map.contains("data") || map.contains("hole")), "{map}");
    // The default export is the first volume.
    let info = run("nbdinfo", &[&format!("{base}/")]);
    assert!(info.contains("export-size: 8388608"), "{info}");

    // qemu-io: unaligned offsets and lengths, discard, write -z, flush.
    let io = run(
        "qemu-io",
        &[
            "-f",
            "raw",
            &uri("disk"),
            "-c",
            "write -P 0xab 1000 70001",
            "-c",
            "read -P 0xab 1000 70001",
            "-c",
            "write -P 0x5c 4095 3",
            "-c",
            "read -P 0x5c 4095 3",
            "-c",
            "read -P 0xab 1000 3095",
            "-c",
            "write -P 0x11 1048576 131072",
            "-c",
            "discard 1048576 65536",
            "-c",
            "read -P 0 1048576 65536",
            "-c",
            "read -P 0x11 1114112 65536",
            "-c",
            "write -z 200000 5000",
            "-c",
            "read -P 0 200000 5000",
            "-c",
            "write -z -u 2097152 1048576",
            "-c",
            "read -P 0 2097152 1048576",
            "-c",
            "flush",
            "-c",
            "aio_write -P 0x77 3145728 65536",
            "-c",
            "aio_flush",
            "-c",
            "read -P 0x77 3145728 65536",
        ],
    );
    for bad in ["failed", "error", "Error", "verification"] {
        assert!(!io.contains(bad), "qemu-io reported {bad:?}:\n{io}");
    }

    // qemu-img: a local image in, back out, compared.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let mut img = vec![0u8; SIZE as usize];
    for (i, chunk) in img.chunks_mut(65536).enumerate() {
        // Data with holes, so block status and sparse copying have work.
        if i % 3 != 1 {
            chunk.copy_from_slice(&pattern(i as u64 * 65536, 65536, 3));
        }
    }
    std::fs::write(&src, &img).unwrap();
    let p = |x: &Path| x.to_str().unwrap().to_string();
    run("qemu-img", &["convert", "-n", "-f", "raw", "-O", "raw", &p(&src), &uri("wt")]);
    run("qemu-img", &["compare", "-f", "raw", "-F", "raw", &p(&src), &uri("wt")]);
    let out = dir.path().join("out.img");
    run("qemu-img", &["convert", "-f", "raw", "-O", "raw", &uri("wt"), &p(&out)]);
    assert!(std::fs::read(&out).unwrap() == img, "qemu-img round trip differs");

    // nbdcopy with its default 4 connections (multi-conn), in and out.
    run("nbdcopy", &[&p(&src), &uri("copy")]);
    let out2 = dir.path().join("out2.img");
    run("nbdcopy", &[&uri("copy"), &p(&out2)]);
    assert!(std::fs::read(&out2).unwrap() == img, "nbdcopy round trip differs");
    run("qemu-img", &["compare", "-f", "raw", "-F", "raw", &uri("copy"), &uri("wt")]);

    rt.block_on(fx.stop());
}
