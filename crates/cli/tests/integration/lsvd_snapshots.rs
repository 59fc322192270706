//! Snapshots and clones of S3 volumes (design 0008, issue 23) as a user
//! runs them: real `blizzard` processes, a real SeaweedFS and real NBD
//! clients (nbdsh, nbdcopy).
//!
//! `lsvd_snapshot_and_clone_through_nbd`: a volume (its cleaning
//! threshold set at create) served by `blizzard nbd` is written, snapshotted while served (the command asks the
//! serving process), overwritten; the export `v@monday` still reads the
//! old bytes and refuses writes; a clone of it, served by the same
//! server, diverges without changing its base or the snapshot; `volume
//! list` and `info` show them (the clone with its base's threshold); the snapshot a clone reads and its volume
//! cannot be deleted (one line naming the clone) until the clone is;
//! then everything is deleted, down to the last object.

// Real processes, sockets and time.
#![allow(clippy::disallowed_methods, clippy::unwrap_used)]

use crate::common;
use crate::lsvd_s3::{
    blizzard, block, image, meta_and_tractserver, nbdsh, ok, one_line_error, s3_credentials, uri, Clock,
    BLOCK,
};

use std::time::{Duration, Instant};

use blizzard_testkit::weed::Weed;

use common::DumpLogsOnPanic;

const SIZE: usize = 8 << 20;

/// nbdsh lines writing blocks `range` of series `tag`, then a flush.
fn series(tag: char, range: std::ops::Range<usize>) -> String {
    let mut s: String =
        range.map(|i| format!("h.pwrite(b'{tag}{i:07}' * {}, {})\n", BLOCK / 8, i * BLOCK)).collect();
    s.push_str("h.flush()\n");
    s
}

fn paint(img: &mut [u8], tag: char, range: std::ops::Range<usize>) {
    for i in range {
        img[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&block(tag, i));
    }
}

#[test]
fn lsvd_snapshot_and_clone_through_nbd() {
    let clock = Clock(Instant::now(), "snapshots");
    s3_credentials();
    let weed = Weed::start();
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let _logs = DumpLogsOnPanic(w.to_path_buf());
    let (meta, _procs) = meta_and_tractserver(w);
    let cache = w.join("cache").join("v");
    ok(&[
        "volume",
        "create",
        "v",
        "--size",
        "8MiB",
        "--backend",
        "s3",
        "--s3",
        &weed.url("vols/v"),
        "--cache",
        &cache.display().to_string(),
        "--cache-size",
        "16MiB",
        "--object-size",
        "1MiB",
        "--gc-threshold",
        "50",
        "--meta",
        &meta,
    ]);
    let mut srv = common::nbd(w, &meta, "nbd", "v", &[]);
    srv.wait_log("NBD export", Duration::from_secs(60));
    let sock = w.join("nbd.sock");
    let mut v_img = vec![0u8; SIZE];
    nbdsh(&uri(&sock, "v"), &series('A', 0..32));
    paint(&mut v_img, 'A', 0..32);

    // A snapshot while served: through the serving process.
    let text = ok(&["volume", "snapshot", "v", "monday", "--meta", &meta]);
    assert!(text.contains("through the process serving it"), "{text}");
    let monday = v_img.clone();
    let (good, text) = blizzard(&["volume", "snapshot", "v", "monday", "--meta", &meta]);
    assert!(!good);
    let e = one_line_error(&text, "a snapshot name taken twice");
    assert!(e.contains("already has a snapshot \"monday\""), "{e}");
    nbdsh(&uri(&sock, "v"), &series('B', 0..16));
    paint(&mut v_img, 'B', 0..16);
    assert!(image(&uri(&sock, "v"), &w.join("v1.img")) == v_img, "the volume moved on");
    assert!(image(&uri(&sock, "v@monday"), &w.join("m1.img")) == monday, "the snapshot reads the past");
    nbdsh(
        &uri(&sock, "v@monday"),
        "assert h.is_read_only()\ntry:\n    h.pwrite(b'x' * 512, 0)\n    raise SystemExit('a snapshot took a write')\nexcept nbd.Error:\n    pass\n",
    );
    clock.say("snapshot taken while served; overwritten; v@monday reads the old bytes and refuses writes");

    // A clone of it, served by the same server, diverges.
    let text = ok(&["volume", "clone", "v@monday", "c", "--meta", &meta]);
    assert!(text.contains("clone of    v@monday"), "{text}");
    let mut c_img = monday.clone();
    nbdsh(&uri(&sock, "c"), &series('C', 8..24));
    paint(&mut c_img, 'C', 8..24);
    assert!(image(&uri(&sock, "c"), &w.join("c1.img")) == c_img, "the clone took its writes");
    assert!(image(&uri(&sock, "v@monday"), &w.join("m2.img")) == monday, "the snapshot did not");
    assert!(image(&uri(&sock, "v"), &w.join("v2.img")) == v_img, "nor did the base");
    let list = ok(&["volume", "list", "--meta", &meta]);
    let line =
        |p: &str| list.lines().find(|l| l.starts_with(p)).unwrap_or_else(|| panic!("no {p} in:\n{list}"));
    assert!(line("v@monday ").contains("snapshot") && line("v@monday ").contains("clones: c"), "{list}");
    assert!(line("c ").contains("clone of v@monday"), "{list}");
    let info = ok(&["volume", "info", "c", "--meta", &meta]);
    assert!(info.contains("clone of     v@monday"), "{info}");
    assert!(info.contains("cleaned below 50% live, set at create"), "the clone cleans as its base: {info}");
    clock.say("clone c served beside its base: each reads only its own writes; list and info show both");

    // What a clone reads stays.
    let (good, text) = blizzard(&["volume", "delete", "v@monday", "--meta", &meta]);
    assert!(!good);
    let e = one_line_error(&text, "deleting a snapshot a clone reads");
    assert!(e.contains("clone(s) c"), "{e}");
    assert!(srv.interrupt());
    assert!(srv.wait_exit(Duration::from_secs(60)).success(), "{}", srv.tail());
    let (good, text) = blizzard(&["volume", "delete", "v", "--meta", &meta]);
    assert!(!good);
    let e = one_line_error(&text, "deleting a volume a clone reads");
    assert!(e.contains("clone(s) c"), "{e}");
    clock.say("the snapshot and its volume are kept while the clone exists");

    // Then, in turn, everything goes (the snapshot with nobody serving v:
    // the command opens it itself).
    ok(&["volume", "delete", "c", "--meta", &meta]);
    let text = ok(&["volume", "delete", "v@monday", "--meta", &meta]);
    assert!(text.contains("opened here"), "{text}");
    let (good, _) = blizzard(&["volume", "delete", "v@monday", "--meta", &meta]);
    assert!(!good, "a deleted snapshot is gone");
    ok(&["volume", "delete", "v", "--meta", &meta]);
    assert!(weed.names("vols").unwrap().is_empty(), "objects left: {:?}", weed.names("vols"));
    clock.say("clone, snapshot and volume deleted: no object left");
}
