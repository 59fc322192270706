//! SIGTERM to a running `blizzard up` finishes every write durably.
//!
//! For each commit mode (fast-ack, log, write-through) the test starts the
//! real binary on a fresh data directory, connects a raw NBD client (fixed
//! newstyle, NBD_OPT_GO, simple replies; written here from the protocol's
//! `doc/proto.md`, since the nbd crate's spec client is not exported) and
//! pipelines a few hundred writes of known, position-dependent patterns
//! with no FLUSH. Once some are acknowledged, and while others are still in
//! flight, it sends SIGTERM and requires exit status 0. Then it restarts
//! `blizzard up` on the same data directory (the volume must open) and
//! reads back every write whose reply arrived: each must hold its bytes
//! exactly. In fast-ack and log mode an acknowledged write may live only in
//! memory; only the flush at shutdown (`nbd::Server::shutdown`) makes it
//! durable, and that is what this test holds to account.
//!
//! Writes whose reply never arrived are not checked: the server stops
//! reading requests at SIGTERM, so they may or may not have been applied.

// The test drives real processes and sockets in real time, outside the env
// seam, and a failure must stop it with its context.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use crate::common::bin;

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Writes per mode, each `WRITE_LEN` bytes at its own offset: 48 MiB, under
/// the default fast-ack exposure limit (64 MiB), so the server may
/// acknowledge all of them before any is durable.
const WRITES: u64 = 384;
const WRITE_LEN: usize = 128 << 10;
/// SIGTERM is sent once this many replies arrived.
const ACKS_BEFORE_SIGTERM: usize = 64;

const READY: &str = "Ctrl-C (or SIGTERM) stops it cleanly.";

// Protocol constants (NBD `doc/proto.md`).
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1;
const NBD_FLAG_C_NO_ZEROES: u32 = 2;
const NBD_OPT_GO: u32 = 7;
const NBD_REP_ACK: u32 = 1;
const NBD_REP_INFO: u32 = 3;
const NBD_INFO_EXPORT: u16 = 0;
const NBD_CMD_READ: u16 = 0;
const NBD_CMD_WRITE: u16 = 1;
const NBD_CMD_DISC: u16 = 2;

/// A `blizzard up` process whose output goes to a log file. Dropping it
/// SIGKILLs it, so a failing test leaves nothing running.
struct Up {
    child: Option<Child>,
    log: PathBuf,
    /// Where its NBD server listens, as it printed it.
    addr: String,
}

impl Up {
    /// Starts `blizzard up` on `data` and waits for its ready line. Both
    /// servers listen on port 0 (parallel tests cannot collide); the NBD
    /// address is read from the `NBD export ... at ADDR:` line.
    fn start(data: &Path, mode: &str, log: PathBuf) -> Up {
        let out = File::create(&log).unwrap();
        let child = Command::new(bin::blizzard_bin())
            .arg("up")
            .arg("--data")
            .arg(data)
            .args(["--listen", "127.0.0.1:0", "--meta-listen", "127.0.0.1:0", "--mode", mode])
            .args(["--size", "256MiB", "--disk-size", "512MiB"])
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("spawning blizzard up");
        let mut up = Up { child: Some(child), log, addr: String::new() };
        let start = Instant::now();
        loop {
            let text = up.log_text();
            if text.contains(READY) {
                let line = text.lines().find(|l| l.starts_with("NBD export ")).unwrap_or_else(|| {
                    panic!("blizzard up is ready but printed no `NBD export ... at ADDR:` line:\n{text}")
                });
                let (_, addr) = line.rsplit_once(" at ").unwrap();
                up.addr = addr.trim_end_matches(':').to_string();
                return up;
            }
            if let Some(status) = up.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("blizzard up ({mode}) exited ({status}) before it was ready:\n{text}");
            }
            assert!(start.elapsed() < Duration::from_secs(30), "blizzard up not ready after 30 s:\n{text}");
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits for the process to exit after a signal; fails the test if it
    /// has not within 20 s.
    fn wait_exit(&mut self) -> ExitStatus {
        let mut c = self.child.take().unwrap();
        let start = Instant::now();
        loop {
            if let Some(s) = c.try_wait().unwrap() {
                return s;
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = c.kill();
                let _ = c.wait();
                panic!("blizzard up did not exit within 20 s of SIGTERM:\n{}", self.log_text());
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then the exit status must be 0 (every volume flushed).
    fn stop(&mut self) {
        sigterm(self.pid());
        let status = self.wait_exit();
        assert!(status.success(), "blizzard up exited with {status} after SIGTERM:\n{}", self.log_text());
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sigterm(pid: u32) {
    // The shell's `kill`: the test crate has no libc binding.
    let ok = Command::new("sh")
        .args(["-c", "kill -TERM \"$1\"", "sh", &pid.to_string()])
        .status()
        .expect("running sh -c kill")
        .success();
    assert!(ok, "kill -TERM {pid} failed");
}

/// The bytes of write `id`: every 8-byte word names the mode, the write
/// and its own position, mixed so that no two words of the volume agree
/// and a write landing at the wrong offset, a stale block or zeros all
/// differ from it.
fn pattern(mode_tag: u64, id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(WRITE_LEN);
    for w in 0..(WRITE_LEN / 8) as u64 {
        let mut x = mode_tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (id << 32) ^ w ^ 0x5bd1_e995;
        // splitmix64's finalizer.
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn offset_of(id: u64) -> u64 {
    id * WRITE_LEN as u64
}

/// Fixed newstyle handshake with NBD_OPT_GO for the default export; returns
/// the connected socket and the export's size.
fn connect(addr: &str) -> (TcpStream, u64) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_nodelay(true).unwrap();
    // A hung server must fail the test, not hang it.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("reading the NBD greeting");
    assert_eq!(u64::from_be_bytes(greeting[..8].try_into().unwrap()), NBDMAGIC);
    assert_eq!(u64::from_be_bytes(greeting[8..16].try_into().unwrap()), IHAVEOPT);
    s.write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes()).unwrap();
    // NBD_OPT_GO: empty name (the default export), no information requests.
    let mut opt = Vec::new();
    opt.extend_from_slice(&IHAVEOPT.to_be_bytes());
    opt.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
    opt.extend_from_slice(&6u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes()); // name length
    opt.extend_from_slice(&0u16.to_be_bytes()); // information requests
    s.write_all(&opt).unwrap();
    let mut size = None;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("reading an option reply");
        assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), NBD_REP_MAGIC);
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), NBD_OPT_GO);
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        assert!(len <= 4096, "option reply of {len} bytes");
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).unwrap();
        match kind {
            NBD_REP_ACK => break,
            NBD_REP_INFO if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == NBD_INFO_EXPORT => {
                size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()));
            }
            NBD_REP_INFO => {}
            _ => panic!("NBD_OPT_GO refused: reply type {kind:#x}, {:?}", String::from_utf8_lossy(&data)),
        }
    }
    (s, size.expect("NBD_OPT_GO sent no NBD_INFO_EXPORT"))
}

fn request(command: u16, handle: u64, offset: u64, len: u32) -> [u8; 28] {
    let mut r = [0u8; 28];
    r[..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
    // r[4..6]: command flags, none (no FUA: durability is the shutdown's job).
    r[6..8].copy_from_slice(&command.to_be_bytes());
    r[8..16].copy_from_slice(&handle.to_be_bytes());
    r[16..24].copy_from_slice(&offset.to_be_bytes());
    r[24..28].copy_from_slice(&len.to_be_bytes());
    r
}

/// Reads one simple reply header: (handle, error).
fn read_reply(s: &mut TcpStream) -> std::io::Result<(u64, u32)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    let magic = u32::from_be_bytes(h[..4].try_into().unwrap());
    assert_eq!(magic, NBD_SIMPLE_REPLY_MAGIC, "not a simple reply: {h:02x?}");
    Ok((u64::from_be_bytes(h[8..16].try_into().unwrap()), u32::from_be_bytes(h[4..8].try_into().unwrap())))
}

/// What the write phase saw.
struct Written {
    /// Writes whose successful reply arrived, in arrival order.
    acked: Vec<u64>,
    /// Replies received when SIGTERM was sent.
    acked_at_signal: usize,
    /// Requests fully sent when SIGTERM was sent.
    sent_at_signal: usize,
}

/// Pipelines `WRITES` writes on one connection and SIGTERMs `pid` once
/// `ACKS_BEFORE_SIGTERM` replies arrived; collects replies until the
/// server closes the connection.
fn write_then_sigterm(addr: &str, mode_tag: u64, pid: u32) -> Written {
    let (s, size) = connect(addr);
    assert!(offset_of(WRITES) <= size, "export of {size} bytes is too small");
    let sent = Arc::new(AtomicUsize::new(0));
    let mut tx = s.try_clone().unwrap();
    let sent_w = sent.clone();
    // The sender stops at the first error: after SIGTERM the server stops
    // reading and closes the socket, which is expected.
    let sender = thread::spawn(move || {
        for id in 0..WRITES {
            let mut msg = request(NBD_CMD_WRITE, id, offset_of(id), WRITE_LEN as u32).to_vec();
            msg.extend_from_slice(&pattern(mode_tag, id));
            if tx.write_all(&msg).is_err() {
                return;
            }
            sent_w.fetch_add(1, Ordering::SeqCst);
        }
    });
    let acked = Arc::new(Mutex::new(Vec::new()));
    let acked_r = acked.clone();
    let mut rx = s;
    let receiver = thread::spawn(move || loop {
        match read_reply(&mut rx) {
            Ok((handle, 0)) => {
                assert!(handle < WRITES, "reply for unknown handle {handle}");
                acked_r.lock().unwrap().push(handle);
            }
            Ok((handle, err)) => panic!("write {handle} failed with NBD error {err}"),
            // End of stream (or a reset) once the server shut down.
            Err(_) => return,
        }
    });
    let start = Instant::now();
    while acked.lock().unwrap().len() < ACKS_BEFORE_SIGTERM {
        assert!(!receiver.is_finished(), "the connection ended before {ACKS_BEFORE_SIGTERM} replies");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no progress: {} replies",
            acked.lock().unwrap().len()
        );
        thread::sleep(Duration::from_micros(200));
    }
    let acked_at_signal = acked.lock().unwrap().len();
    let sent_at_signal = sent.load(Ordering::SeqCst);
    sigterm(pid);
    receiver.join().expect("the reply reader failed");
    sender.join().expect("the request sender failed");
    let acked = Arc::try_unwrap(acked).unwrap().into_inner().unwrap();
    Written { acked, acked_at_signal, sent_at_signal }
}

/// Reads back every acknowledged write (pipelined) and compares it.
fn verify(addr: &str, mode: &str, mode_tag: u64, acked: &[u64]) {
    let (mut s, _) = connect(addr);
    let mut tx = s.try_clone().unwrap();
    let ids = acked.to_vec();
    // Requests go out from their own thread so the socket buffers cannot
    // deadlock the two directions.
    let sender = thread::spawn(move || {
        for &id in &ids {
            tx.write_all(&request(NBD_CMD_READ, id, offset_of(id), WRITE_LEN as u32)).unwrap();
        }
    });
    let mut bad = Vec::new();
    let mut buf = vec![0u8; WRITE_LEN];
    for _ in acked {
        let (id, err) = read_reply(&mut s).expect("reading a read reply");
        assert_eq!(err, 0, "{mode}: reading write {id} failed with NBD error {err}");
        s.read_exact(&mut buf).expect("reading a read payload");
        let want = pattern(mode_tag, id);
        if buf != want {
            let first = buf.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            let zeros = buf.iter().all(|&b| b == 0);
            bad.push(format!(
                "write {id} (first differing byte {first}{})",
                if zeros { ", all zeros" } else { "" }
            ));
        }
    }
    sender.join().unwrap();
    s.write_all(&request(NBD_CMD_DISC, 0, 0, 0)).unwrap();
    assert!(
        bad.is_empty(),
        "{mode}: {} of {} acknowledged writes did not survive SIGTERM and restart: {}",
        bad.len(),
        acked.len(),
        bad.join(", ")
    );
}

#[test]
fn sigterm_makes_acknowledged_writes_durable() {
    let work = tempfile::Builder::new().prefix("up-shutdown-").tempdir().unwrap();
    let w = work.path();
    let started = Instant::now();
    for (tag, mode) in ["fast-ack", "log", "write-through"].into_iter().enumerate() {
        let tag = tag as u64 + 1;
        let data = w.join(format!("data-{mode}"));
        let mut up = Up::start(&data, mode, w.join(format!("{mode}-1.log")));
        // The default striping unit: 1 MiB on one machine, but a log volume
        // rewrites whole blocks under small writes and keeps 64 KiB.
        let block = if mode == "log" { "64.0 KiB" } else { "1.0 MiB" };
        assert!(
            up.log_text().lines().any(|l| l.starts_with("block size") && l.ends_with(block)),
            "{mode}: the new volume's block size is not {block}:\n{}",
            up.log_text()
        );
        let written = write_then_sigterm(&up.addr, tag, up.pid());
        let status = up.wait_exit();
        assert!(
            status.success(),
            "{mode}: blizzard up exited with {status} after SIGTERM:\n{}",
            up.log_text()
        );
        let n = written.acked.len();
        eprintln!(
            "{mode}: SIGTERM after {} replies with {} writes sent; {n} of {WRITES} acknowledged in all ({:.1}s)",
            written.acked_at_signal,
            written.sent_at_signal,
            started.elapsed().as_secs_f64()
        );
        // The signal must have caught writes in flight, or the test proves
        // nothing about them.
        assert!(
            written.acked_at_signal < WRITES as usize,
            "{mode}: every write was acknowledged before SIGTERM; raise WRITES"
        );
        let mut ids = written.acked.clone();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n, "{mode}: a write was acknowledged twice");

        let mut up = Up::start(&data, mode, w.join(format!("{mode}-2.log")));
        verify(&up.addr, mode, tag, &written.acked);
        up.stop();
        eprintln!(
            "{mode}: {n} acknowledged writes read back exactly ({:.1}s)",
            started.elapsed().as_secs_f64()
        );
    }
}
