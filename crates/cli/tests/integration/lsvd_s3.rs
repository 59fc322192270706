//! S3 volumes (design 0008, issue 23) as a user runs them: real `blizzard`
//! processes, a real S3 server (SeaweedFS, started by each test through
//! `blizzard_testkit::weed`) and real NBD clients (fio's nbd engine,
//! nbdsh, nbdcopy).
//!
//! - `lsvd_up_s3_fio_sigkill_and_lost_cache`: `blizzard up --s3` makes its
//!   default volume an S3 one; fio writes it with crc32c-verified blocks
//!   through NBD; the server is SIGKILLed, restarted and fio verifies every
//!   block (the journal replayed); a clean stop destages everything, the
//!   cache directory is deleted, and fio verifies again (every block from
//!   the object store).
//! - `lsvd_volume_commands_and_lost_cache_prefix`: separate `meta`,
//!   `tractserver` and `nbd` processes; `volume create --backend s3`
//!   refuses an unreachable endpoint, a missing bucket, wrong credentials
//!   and a prefix holding another volume with one line each, leaving no
//!   record, objects or cache behind; a created volume is served by
//!   `blizzard nbd`, written by nbdsh (writes, FUA, TRIM, unaligned WRITE
//!   and WRITE_ZEROES, FLUSH) and read back by nbdcopy, shown by
//!   `volume info`; after a SIGKILL with its cache directory deleted it
//!   comes back as a consistent prefix (everything destaged before, then
//!   a prefix of the sequential writes after); `volume delete` removes the
//!   objects, the cache and the record.
//!
//! The tools must be installed (`scripts/test` installs them); a missing
//! one fails the test naming its package, never skips it.

#![allow(clippy::unwrap_used)]
// Real processes, sockets and time.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use blizzard_testkit::weed::Weed;

use common::{free_port, meta_args, tool, DumpLogsOnPanic, Proc};

/// Every child of these tests reaches SeaweedFS with its credentials.
pub(crate) fn s3_credentials() {
    for (k, v) in Weed::credentials() {
        std::env::set_var(k, v);
    }
}

/// `blizzard ARGS` with extra environment: (success, stdout + stderr).
pub(crate) fn blizzard_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(common::blizzard_bin()).args(args).envs(env.iter().copied()).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

pub(crate) fn blizzard(args: &[&str]) -> (bool, String) {
    blizzard_env(args, &[])
}

pub(crate) fn ok(args: &[&str]) -> String {
    let (ok, text) = blizzard(args);
    assert!(ok, "blizzard {} failed:\n{text}", args.join(" "));
    text
}

pub(crate) struct Clock(pub(crate) Instant, pub(crate) &'static str);

impl Clock {
    pub(crate) fn say(&self, msg: impl std::fmt::Display) {
        eprintln!("[{} {:>6.1}s] {msg}", self.1, self.0.elapsed().as_secs_f64());
    }
}

pub(crate) fn uri(socket: &Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// fio's nbd engine: 4 KiB random writes at QD 32 over `size`, each block
/// with a crc32c header, then every block read back and verified; or, with
/// `verify_only`, the same blocks (the same seeded offsets) only verified.
fn fio(work: &Path, uri: &str, size: &str, verify_only: bool) -> String {
    let fio = tool("fio", "fio");
    let mut c = Command::new(fio);
    c.current_dir(work)
        .args(["--name=lsvd", "--ioengine=nbd", &format!("--uri={uri}")])
        .args(["--rw=randwrite", "--bs=4k", "--iodepth=32", &format!("--size={size}"), "--randseed=2323"])
        .args(["--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0"])
        .args(["--end_fsync=1", "--output-format=terse", "--terse-version=3"]);
    if verify_only {
        c.arg("--verify_only=1");
    }
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fio failed ({}):\n{text}", out.status);
    let line =
        stdout.lines().find(|l| l.starts_with("3;")).unwrap_or_else(|| panic!("no terse line:\n{text}"));
    let f: Vec<&str> = line.split(';').collect();
    // Terse v3: field 5 is the error, 6 the KiB read (verified).
    assert_eq!(f[4], "0", "fio reported an error:\n{text}");
    assert!(f[5].parse::<u64>().unwrap() > 0, "fio verified nothing:\n{text}");
    line.to_string()
}

/// `blizzard up` with an S3 default volume, NBD on `dir/nbd.sock`, and its
/// metrics at `metrics` if given.
fn up(dir: &Path, url: &str, n: u32, metrics: Option<&str>) -> Proc {
    let sock = dir.join("nbd.sock");
    let mut args: Vec<String> = [
        "up",
        "--data",
        &dir.join("data").display().to_string(),
        "--listen",
        &format!("unix:{}", sock.display()),
        "--meta-listen",
        "127.0.0.1:0",
        "--tractservers",
        "1",
        "--tract-size",
        "1MiB",
        "--disk-size",
        "64MiB",
        "--size",
        "128MiB",
        "--s3",
        url,
        "--cache-size",
        "16MiB",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(m) = metrics {
        args.extend(["--metrics".to_string(), m.to_string()]);
    }
    let mut p =
        Proc::spawn(&format!("up{n}"), &args, dir.join(format!("up{n}.log")), sock.display().to_string());
    p.wait_log("Ctrl-C (or SIGTERM) stops it cleanly", Duration::from_secs(120));
    p
}

/// The body of `GET /metrics` at `addr` (plain HTTP/1.1, the server closes).
fn metrics_text(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

#[test]
fn lsvd_up_s3_fio_sigkill_and_lost_cache() {
    let clock = Clock(Instant::now(), "up --s3");
    s3_credentials();
    let weed = Weed::start();
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let _logs = DumpLogsOnPanic(w.to_path_buf());
    let url = weed.url("up/disk");
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut srv = up(w, &url, 1, Some(&metrics));
    let log = srv.log_text();
    assert!(log.contains("backend      s3") && log.contains(&url), "up shows the backend:\n{log}");
    let cache = w.join("data").join("lsvd-cache").join("disk");
    assert!(cache.join("journal").is_file(), "the cache is under the data directory");
    let u = uri(&w.join("nbd.sock"), "disk");
    clock.say("blizzard up --s3 ready");
    let line = fio(w, &u, "32m", false);
    clock.say(format!("fio wrote and verified 32 MiB (twice the cache): {}", &line[..line.len().min(60)]));
    // The served volume's figures: what is not yet in S3, and the puts
    // that carried the rest there.
    let text = metrics_text(&metrics);
    let sample = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
    };
    assert!(sample("blizzard_lsvd_not_in_object_store_bytes{export=\"disk\"}") <= (16 << 20) as f64);
    assert!(sample("blizzard_lsvd_object_store_requests_total{export=\"disk\",kind=\"put\"}") >= 1.0);
    assert_eq!(sample("blizzard_nbd_export_size_bytes{export=\"disk\"}"), (128 << 20) as f64);
    // fio's verify pass read back destaged blocks: through the read cache,
    // whose 64 KiB lines also held their neighbours.
    assert!(sample("blizzard_lsvd_read_cache_misses_total{export=\"disk\"}") >= 1.0, "{text}");
    assert!(sample("blizzard_lsvd_read_cache_hits_total{export=\"disk\"}") >= 1.0, "{text}");
    clock.say("/metrics shows the volume's bytes not yet in S3 and its puts");
    srv.kill();
    clock.say("SIGKILLed");
    let mut srv = up(w, &url, 2, None);
    fio(w, &u, "32m", true);
    clock.say("restarted: fio verified every block (journal replayed)");
    assert!(srv.interrupt());
    let status = srv.wait_exit(Duration::from_secs(120));
    assert!(status.success(), "a clean stop ({status}):\n{}", srv.tail());
    clock.say("stopped cleanly (destaged)");
    let objects = weed.names("up/disk/d").unwrap();
    assert!(objects.len() >= 2, "data objects in the store: {objects:?}");
    std::fs::remove_dir_all(&cache).unwrap();
    let mut srv = up(w, &url, 3, None);
    fio(w, &u, "32m", true);
    clock.say(format!("cache deleted: fio verified every block from {} objects", objects.len()));
    assert!(srv.interrupt());
    assert!(srv.wait_exit(Duration::from_secs(120)).success());
}

/// 64 KiB of block `i` of series `tag`: 8-byte "T0000042" repeated.
pub(crate) fn block(tag: char, i: usize) -> Vec<u8> {
    format!("{tag}{i:07}").into_bytes().repeat(BLOCK / 8)
}

pub(crate) const BLOCK: usize = 64 << 10;
const SIZE: usize = 32 << 20;
/// Series A: blocks 0..A_BLOCKS, destaged before the crash.
const A_BLOCKS: usize = 64;
/// Series B: blocks from B_FIRST on, written one at a time (each
/// acknowledged before the next is sent) right before the crash.
const B_FIRST: usize = 128;
const B_BLOCKS: usize = 200;

/// Runs a Python script in nbdsh against `uri` (`h` is the handle).
pub(crate) fn nbdsh(uri: &str, script: &str) {
    let nbdsh = tool("nbdsh", "python3-libnbd");
    // nbdsh runs the `python3` first on PATH; the distribution's, which
    // python3-libnbd installs the module for, goes first (not a pyenv's).
    let path = format!("/usr/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = Command::new(nbdsh).env("PATH", path).args(["-u", uri, "-c", script]).output().unwrap();
    assert!(
        out.status.success(),
        "nbdsh failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The volume's bytes, through nbdcopy.
pub(crate) fn image(uri: &str, out: &Path) -> Vec<u8> {
    let nbdcopy = tool("nbdcopy", "libnbd-bin");
    let st = Command::new(nbdcopy).args([uri, &out.display().to_string()]).status().unwrap();
    assert!(st.success(), "nbdcopy out of {uri}");
    std::fs::read(out).unwrap()
}

/// The one line of a failed command's error.
pub(crate) fn one_line_error(text: &str, what: &str) -> String {
    let errs: Vec<&str> = text.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errs.len(), 1, "{what}: one `error:` line expected:\n{text}");
    eprintln!("{what}: {}", errs[0]);
    errs[0].to_string()
}

/// A metadata server and one tractserver (which hold S3 volumes' records)
/// under `w`: the metadata address, and the processes (killed on drop).
pub(crate) fn meta_and_tractserver(w: &Path) -> (String, Vec<Proc>) {
    let meta = format!("127.0.0.1:{}", free_port());
    let m = Proc::spawn("meta", &meta_args(&meta, 1, 1, None), w.join("meta.log"), meta.clone());
    let mut ts = common::spawn_tractservers(w, &meta, 1, "64MiB");
    ts[0].wait_log("listening on", Duration::from_secs(60));
    ts.insert(0, m);
    (meta, ts)
}

#[test]
fn lsvd_volume_commands_and_lost_cache_prefix() {
    let clock = Clock(Instant::now(), "volume --backend s3");
    s3_credentials();
    let weed = Weed::start();
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let _logs = DumpLogsOnPanic(w.to_path_buf());
    let (meta, _procs) = meta_and_tractserver(w);
    let cache = |name: &str| w.join(format!("cache-{name}"));
    let create = |name: &str, url: &str, env: &[(&str, &str)]| {
        let c = cache(name).display().to_string();
        let args = [
            "volume",
            "create",
            name,
            "--size",
            "32MiB",
            "--backend",
            "s3",
            "--s3",
            url,
            "--cache",
            &c,
            "--cache-size",
            "16MiB",
            "--object-size",
            "1MiB",
            "--meta",
            &meta,
        ];
        blizzard_env(&args, env)
    };
    let listed = |name: &str| {
        ok(&["volume", "list", "--meta", &meta]).lines().any(|l| l.starts_with(&format!("{name} ")))
    };

    // Operator mistakes: one line each, nothing left behind.
    let (good, text) = create("bad1", "http://127.0.0.1:1/lsvd/bad1", &[]);
    assert!(!good);
    let e = one_line_error(&text, "unreachable endpoint");
    assert!(e.contains("127.0.0.1:1") && e.contains("is the object store running"), "{e}");
    let (good, text) = create("bad2", &format!("{}/no-such-bucket/bad2", weed.endpoint()), &[]);
    assert!(!good);
    let e = one_line_error(&text, "missing bucket");
    assert!(e.contains("bucket does not exist") && e.contains("create the bucket"), "{e}");
    let (good, text) = create("bad3", &weed.url("bad3"), &[("AWS_SECRET_ACCESS_KEY", "not-the-secret")]);
    assert!(!good);
    let e = one_line_error(&text, "wrong credentials");
    assert!(e.contains("AWS_SECRET_ACCESS_KEY"), "{e}");
    ok(&[
        "volume",
        "create",
        "first",
        "--size",
        "1MiB",
        "--backend",
        "s3",
        "--s3",
        &weed.url("taken"),
        "--cache",
        &cache("first").display().to_string(),
        "--cache-size",
        "1MiB",
        "--meta",
        &meta,
    ]);
    let (good, text) = create("bad4", &weed.url("taken"), &[]);
    assert!(!good);
    let e = one_line_error(&text, "prefix holding another volume");
    assert!(e.contains("already holds volume \"first\""), "{e}");
    for bad in ["bad1", "bad2", "bad3", "bad4"] {
        assert!(!listed(bad), "{bad} left a record");
        assert!(!cache(bad).exists(), "{bad} left its cache directory");
        let (found, _) = blizzard(&["volume", "info", bad, "--meta", &meta]);
        assert!(!found, "{bad} has a record");
    }
    for prefix in ["bad1", "bad3"] {
        assert!(weed.names(prefix).unwrap().is_empty(), "{prefix} left objects");
    }
    ok(&["volume", "delete", "first", "--meta", &meta]);
    assert!(weed.names("taken").unwrap().is_empty(), "delete removes the objects");
    clock.say("unreachable, missing bucket, wrong credentials, prefix taken: one line each, nothing left");

    // A volume served by `blizzard nbd`.
    let (good, text) = create("v", &weed.url("vols/v"), &[]);
    assert!(good, "{text}");
    assert!(listed("v"));
    let info = ok(&["volume", "info", "v", "--meta", &meta]);
    assert!(info.contains("backend      s3") && info.contains("if the cache disk dies"), "{info}");
    let mut srv = common::nbd(w, &meta, "nbd1", "v", &[]);
    srv.wait_log("NBD export", Duration::from_secs(60));
    let u = uri(&w.join("nbd1.sock"), "v");
    let a: String = (0..A_BLOCKS)
        .map(|i| {
            let flags = if i == 5 { ", nbd.CMD_FLAG_FUA" } else { "" };
            format!("h.pwrite(b'A{i:07}' * {}, {}{flags})\n", BLOCK / 8, i * BLOCK)
        })
        .collect();
    // A block trimmed; a write and a write-zeroes not in whole sectors
    // (the sectors inside the latter, [1024, 5632) of block 20, trimmed).
    let script = format!(
        "{a}h.trim({BLOCK}, {})\nh.pwrite(b'xyz', {})\nh.zero(5000, {})\nh.flush()\n",
        3 * BLOCK,
        10 * BLOCK + 100,
        20 * BLOCK + 1000
    );
    nbdsh(&u, &script);
    let mut want = vec![0u8; SIZE];
    for i in 0..A_BLOCKS {
        want[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&block('A', i));
    }
    want[3 * BLOCK..4 * BLOCK].fill(0);
    want[10 * BLOCK + 100..10 * BLOCK + 103].copy_from_slice(b"xyz");
    want[20 * BLOCK + 1000..20 * BLOCK + 6000].fill(0);
    let got = image(&u, &w.join("a.img"));
    assert!(got == want, "series A reads back");
    clock.say("series A written (FUA, TRIM, unaligned WRITE and WRITE_ZEROES, FLUSH) and read back");
    // Wait until all of it is in the object store (the destager seals an
    // object within about a second of a write).
    // Live bytes once all of it is in objects: every block but the
    // trimmed one and the trimmed sectors of block 20.
    let a_bytes = (A_BLOCKS - 1) * BLOCK - (5632 - 1024);
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let info = ok(&["volume", "info", "v", "--meta", &meta]);
        let live: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("live bytes   "))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no live bytes line:\n{info}"));
        if live >= a_bytes as u64 {
            break;
        }
        assert!(Instant::now() < give_up, "series A not destaged after 60 s:\n{info}");
        std::thread::sleep(Duration::from_millis(200));
    }
    clock.say("series A destaged");
    // Series B one block at a time, then SIGKILL and a lost cache.
    let script = format!(
        "import time\nfor i in range({B_BLOCKS}):\n    h.pwrite(b'B%07d' % i * {}, ({B_FIRST} + i) * {BLOCK})\n    time.sleep(0.01)\n",
        BLOCK / 8
    );
    nbdsh(&u, &script);
    srv.kill();
    std::fs::remove_dir_all(cache("v")).unwrap();
    clock.say("series B written, server SIGKILLed, cache directory deleted");
    let mut srv = common::nbd(w, &meta, "nbd2", "v", &["--take-over"]);
    srv.wait_log("NBD export", Duration::from_secs(60));
    let u = uri(&w.join("nbd2.sock"), "v");
    let got = image(&u, &w.join("b.img"));
    assert!(
        got[..B_FIRST * BLOCK] == want[..B_FIRST * BLOCK],
        "everything destaged before the crash is back"
    );
    let mut kept = 0;
    for i in 0..B_BLOCKS {
        let at = (B_FIRST + i) * BLOCK;
        let b = &got[at..at + BLOCK];
        if b == &block('B', i)[..] {
            assert_eq!(kept, i, "block {i} of series B is back but block {kept} is not: not a prefix");
            kept += 1;
        } else {
            assert!(b.iter().all(|&x| x == 0), "block {i} of series B holds neither its data nor zeros");
        }
    }
    assert!(got[(B_FIRST + B_BLOCKS) * BLOCK..].iter().all(|&x| x == 0));
    clock.say(format!(
        "back from the object store: series A whole, the first {kept} of {B_BLOCKS} of series B"
    ));
    let info = ok(&["volume", "info", "v", "--meta", &meta]);
    assert!(info.contains("held by") && !info.contains("held by      nobody"), "{info}");

    // Delete: objects, cache, record.
    assert!(srv.interrupt());
    assert!(srv.wait_exit(Duration::from_secs(60)).success(), "{}", srv.tail());
    assert!(!weed.names("vols/v").unwrap().is_empty());
    let text = ok(&["volume", "delete", "v", "--meta", &meta]);
    assert!(text.contains("deleted the objects"), "{text}");
    assert!(weed.names("vols/v").unwrap().is_empty(), "objects left after delete");
    assert!(!cache("v").exists(), "cache left after delete");
    assert!(!listed("v"));
    clock.say("deleted: objects, cache and record gone");
}
