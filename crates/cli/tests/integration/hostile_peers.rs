//! Issue 56, point 1: hostile or broken peers delay nobody. A cluster of
//! real processes with certificates (three metadata replicas, three
//! tractservers, `blizzard nbd`) carries fio through NBD while, on every
//! cluster port, the NBD port and the metadata leader's `/metrics`, this
//! test holds idle connections open (opening again each one a server
//! closes), trickles one byte a second on others, and opens and closes
//! connections at a steady rate, none of them with a certificate:
//!
//! | per port | CI | `HOSTILE_SOAK=1` (the figures) |
//! |---|---|---|
//! | idle connections held | 300 | 1,000 |
//! | one byte a second | 60 | 200 |
//! | opened and closed a second | 100 | 500 |
//! | attack | 15 s | 60 s |
//!
//! Meanwhile, each second, a legitimate `blizzard status` and `blizzard
//! volume info` (new processes: new TLS connections to the metadata
//! replicas and the tractservers), a new NBD connection (`nbdinfo`) and
//! a scrape of `/metrics` must succeed. No tractserver may be declared dead or go silent, the
//! metadata leader and its term must not change, and fio must see no
//! error. Printed: the longest of each probe (`hostile: longest status N
//! ms, volume info N ms, NBD connection N ms, /metrics N ms`) and what
//! the attack did;
//! nothing about time is asserted. (Before the fix, 200 idle connections
//! made `status` fail after 12–14 s: a fixed cap of 64 handshakes that
//! idle peers filled.)

// Real processes, sockets and time.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{
    blizzard, blizzard_bin, free_port, meta_args, ok, replica_args, s, spawn_tractserver_with, tool,
    DumpLogsOnPanic, Proc, Procs,
};

/// The attack's size (module header).
#[derive(Clone, Copy, Debug)]
struct Scale {
    idle: usize,
    trickle: usize,
    churn_per_sec: usize,
    attack: Duration,
}

impl Scale {
    fn from_env() -> Scale {
        if std::env::var("HOSTILE_SOAK").is_ok_and(|v| v == "1") {
            Scale { idle: 1000, trickle: 200, churn_per_sec: 500, attack: Duration::from_secs(60) }
        } else {
            Scale { idle: 300, trickle: 60, churn_per_sec: 100, attack: Duration::from_secs(15) }
        }
    }
}

/// What the attackers did, in all.
#[derive(Default)]
struct Counts {
    /// Connections made (every kind, reconnections included).
    connected: AtomicU64,
    /// Held or trickling connections a server closed.
    closed_by_server: AtomicU64,
    /// Connections refused or failed to open.
    failed: AtomicU64,
}

/// Holds one idle connection to `addr` open until `stop`, opening it
/// again whenever the server closes it.
async fn hold_idle(addr: String, stop: Arc<AtomicBool>, counts: Arc<Counts>) {
    while !stop.load(Ordering::Relaxed) {
        match TcpStream::connect(&addr).await {
            Ok(mut c) => {
                counts.connected.fetch_add(1, Ordering::Relaxed);
                // An NBD server greets: take that, send nothing, and wait.
                let mut buf = [0u8; 256];
                loop {
                    let r = tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await;
                    match r {
                        Ok(Ok(0)) | Ok(Err(_)) => {
                            counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        Ok(Ok(_)) => {}
                        Err(_) if stop.load(Ordering::Relaxed) => return,
                        Err(_) => {}
                    }
                }
            }
            Err(_) => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Reopen soon, not in a tight loop.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends `bytes` to `addr` one a second, opening again when the server
/// closes the connection, until `stop`.
async fn trickle(addr: String, bytes: &'static [u8], stop: Arc<AtomicBool>, counts: Arc<Counts>) {
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut c) = TcpStream::connect(&addr).await else {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        counts.connected.fetch_add(1, Ordering::Relaxed);
        for b in bytes.iter().cycle() {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            if c.write_all(&[*b]).await.is_err() {
                counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
                break;
            }
            // Drain what the server says (an NBD greeting), and notice a close.
            let mut buf = [0u8; 256];
            match tokio::time::timeout(Duration::from_secs(1), c.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => {
                    counts.closed_by_server.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                _ => {}
            }
        }
    }
}

/// Opens and at once closes `per_sec` connections a second to `addr`.
async fn churn(addr: String, per_sec: usize, stop: Arc<AtomicBool>, counts: Arc<Counts>) {
    let tick = Duration::from_millis(20);
    let per_tick = (per_sec / 50).max(1);
    while !stop.load(Ordering::Relaxed) {
        let start = tokio::time::Instant::now();
        for _ in 0..per_tick {
            match TcpStream::connect(&addr).await {
                Ok(c) => {
                    counts.connected.fetch_add(1, Ordering::Relaxed);
                    drop(c);
                }
                Err(_) => {
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        tokio::time::sleep_until(start + tick).await;
    }
}

/// The start of a TLS record that announces 16 KiB: a TLS server waits
/// for the rest. An NBD client's flags (fixed newstyle, no zeroes) then
/// the start of an option. An HTTP request line.
const TLS_START: &[u8] = &[0x16, 0x03, 0x01, 0x40, 0x00, 0x01, 0x00, 0x3f, 0xfc, 0x03, 0x03];
const NBD_START: &[u8] = &[0, 0, 0, 3, 0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54];
const HTTP_START: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n";

/// One probe: runs `cmd args`, returns how long it took; fails the test
/// (with its output) if it did not succeed.
fn probe(what: &str, cmd: &str, args: &[&str]) -> (Duration, String) {
    let start = Instant::now();
    let out = Command::new(cmd).args(args).output().unwrap();
    let took = start.elapsed();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed under attack after {took:?}:\n{text}");
    (took, text)
}

/// A `GET /metrics` from `addr`, on a new connection: how long it took;
/// fails the test unless it is answered 200 with the metrics.
fn scrape(addr: &str) -> Duration {
    use std::io::{Read, Write};
    let start = Instant::now();
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200") && out.contains("blizzard_"), "/metrics under attack:\n{out}");
    start.elapsed()
}

/// From `blizzard status`: (the metadata leader's id, its term) and the
/// tractservers' states.
fn leader_and_members(status: &str) -> (Option<(String, String)>, Vec<String>) {
    let mut leader = None;
    let mut states = Vec::new();
    for l in status.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.len() >= 4 && f[2] == "leader" {
            leader = Some((f[0].to_string(), f[3].to_string()));
        }
        // TRACTSERVER ADDRESS DOMAIN DISK STATE ...
        if f.len() >= 6 && f[1].starts_with("127.0.0.1:") && ["up", "down", "dead"].contains(&f[4]) {
            states.push(f[4].to_string());
        }
    }
    (leader, states)
}

#[test]
fn idle_trickling_and_churning_peers_delay_nobody() {
    let scale = Scale::from_env();
    let fio = tool("fio", "fio");
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    // The attackers' sockets: thousands.
    blizzard_env::raise_fd_limit();
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let _logs = DumpLogsOnPanic(dir.to_path_buf());
    let ca = dir.join("ca");
    ok(blizzard(&["ca", "init", &s(&ca)]));
    for (name, role) in [
        ("meta1", "meta"),
        ("meta2", "meta"),
        ("meta3", "meta"),
        ("ts0", "tractserver"),
        ("ts1", "tractserver"),
        ("ts2", "tractserver"),
        ("nbd1", "nbd"),
        ("admin", "admin"),
    ] {
        ok(blizzard(&["ca", "issue", name, "--role", role, &s(&ca)]));
    }
    let certs = |name: &str| s(&ca.join(name));
    let admin = certs("admin");

    // The cluster, at the default heartbeat (500 ms) and death (5 s)
    // periods: a heartbeat that cannot get through for 5 s is a dead
    // tractserver, as it would be in production.
    let addrs: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let meta_addr = addrs.join(",");
    let metrics: Vec<String> = (0..3).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let mut metas: Vec<Proc> = (0..3)
        .map(|i| {
            let mut args = meta_args(&addrs[i], 3, 3, Some(&metrics[i]));
            args.retain(|a| a != "--insecure");
            for (flag, v) in [("--heartbeat-ms", "500"), ("--dead-after-ms", "5000")] {
                let at = args.iter().position(|a| a == flag).unwrap();
                args[at + 1] = v.to_string();
            }
            let mut args = replica_args(dir, &addrs, i, args);
            args.extend(["--tls-certificates".to_string(), certs(&format!("meta{}", i + 1))]);
            let name = format!("meta{}", i + 1);
            Proc::spawn(&name, &args, dir.join(format!("{name}.log")), addrs[i].clone())
        })
        .collect();
    let meta = metas.remove(0);
    let ts: Vec<Proc> = (0..3)
        .map(|i| {
            let c = certs(&format!("ts{i}"));
            spawn_tractserver_with(dir, &meta_addr, i, "256MiB", &["--tls-certificates", &c])
        })
        .collect();
    let mut procs = Procs { meta, ts };
    procs.wait_listening(Duration::from_secs(60));
    let status_args = ["status", "--meta", &meta_addr, "--tls-certificates", &admin];
    let start = Instant::now();
    loop {
        let (ok, text) = blizzard(&status_args);
        let (_, states) = leader_and_members(&text);
        if ok && states.iter().filter(|s| *s == "up").count() == 3 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "the cluster did not form:\n{text}");
        procs.check_running();
        std::thread::sleep(Duration::from_millis(200));
    }
    ok(blizzard(&[
        "volume",
        "create",
        "v",
        "--size",
        "64MiB",
        "--replication",
        "3",
        "--segment-tracts",
        "8",
        "--meta",
        &meta_addr,
        "--tls-certificates",
        &admin,
    ]));
    let nbd_addr = format!("127.0.0.1:{}", free_port());
    let nbd_args: Vec<String> =
        ["nbd", "--meta", &meta_addr, "--listen", &nbd_addr, "--tls-certificates", &certs("nbd1")]
            .iter()
            .map(|a| a.to_string())
            .collect();
    let mut server = Proc::spawn("nbd", &nbd_args, dir.join("nbd.log"), nbd_addr.clone());
    server.wait_log("upgrade:", Duration::from_secs(30));
    let uri = format!("nbd://{nbd_addr}/v");
    probe("nbdinfo before the attack", &nbdinfo, &[&uri]);
    let (_, before) = probe("status before the attack", &blizzard_bin(), &status_args);
    let (leader_before, _) = leader_and_members(&before);
    assert!(leader_before.is_some(), "no metadata leader:\n{before}");

    // fio through NBD for the whole attack: 4 KiB random writes and reads.
    let secs = (scale.attack.as_secs() + 5).to_string();
    let fio_job = Command::new(&fio)
        .args([
            "--name=hostile",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=8",
            "--size=64m",
            "--time_based",
            &format!("--runtime={secs}"),
            "--output-format=terse",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();

    // The attack, from a runtime of its own.
    let targets: Vec<(String, &'static [u8])> = addrs
        .iter()
        .map(|a| (a.clone(), TLS_START))
        .chain(procs.ts.iter().map(|t| (t.addr.clone(), TLS_START)))
        .chain([(nbd_addr.clone(), NBD_START), (metrics[0].clone(), HTTP_START)])
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    for (addr, bytes) in &targets {
        for _ in 0..scale.idle {
            rt.spawn(hold_idle(addr.clone(), stop.clone(), counts.clone()));
        }
        for _ in 0..scale.trickle {
            rt.spawn(trickle(addr.clone(), bytes, stop.clone(), counts.clone()));
        }
        rt.spawn(churn(addr.clone(), scale.churn_per_sec, stop.clone(), counts.clone()));
    }
    // Let the idle connections pile up before the first probe.
    std::thread::sleep(Duration::from_secs(2));

    let attack = Instant::now();
    let mut longest = [Duration::ZERO; 4];
    let mut probes = 0;
    let info_args = ["volume", "info", "v", "--meta", &meta_addr, "--tls-certificates", &admin];
    while attack.elapsed() < scale.attack {
        let round = Instant::now();
        let (t, text) = probe("blizzard status under attack", &blizzard_bin(), &status_args);
        longest[0] = longest[0].max(t);
        let (leader, states) = leader_and_members(&text);
        assert_eq!(leader, leader_before, "the metadata leader or its term changed under attack:\n{text}");
        assert_eq!(states, vec!["up"; 3], "a tractserver went silent or was declared dead:\n{text}");
        let (t, _) = probe("blizzard volume info under attack", &blizzard_bin(), &info_args);
        longest[1] = longest[1].max(t);
        let (t, _) = probe("a new NBD connection under attack", &nbdinfo, &[&uri]);
        longest[2] = longest[2].max(t);
        longest[3] = longest[3].max(scrape(&metrics[0]));
        probes += 1;
        procs.check_running();
        metas.iter_mut().for_each(Proc::check_running);
        server.check_running();
        std::thread::sleep(Duration::from_secs(1).saturating_sub(round.elapsed()));
    }
    stop.store(true, Ordering::Relaxed);
    rt.shutdown_timeout(Duration::from_secs(2));

    let out = fio_job.wait_with_output().unwrap();
    let fio_text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fio failed under attack:\n{fio_text}");
    // Terse format: field 5 is the job's error number.
    let err = fio_text.lines().find_map(|l| l.split(';').nth(4)).unwrap_or("?");
    assert_eq!(err, "0", "fio reported an error:\n{fio_text}");
    let (_, after) = probe("status after the attack", &blizzard_bin(), &status_args);
    assert_eq!(leader_and_members(&after).0, leader_before, "{after}");
    for m in std::iter::once(&procs.meta).chain(&metas) {
        let log = m.log_text();
        assert!(
            !log.contains("tractserver declared dead"),
            "{} declared a member dead:\n{}",
            m.name,
            m.tail()
        );
    }
    println!(
        "hostile: longest status {} ms, volume info {} ms, NBD connection {} ms, /metrics {} ms ({probes} rounds of probes over {:.0?})",
        longest[0].as_millis(),
        longest[1].as_millis(),
        longest[2].as_millis(),
        longest[3].as_millis(),
        attack.elapsed()
    );
    println!(
        "hostile: per port {} idle, {} trickling, {} opened and closed a second, on {} ports; {} connections made, {} closed by the servers, {} failed to open",
        scale.idle,
        scale.trickle,
        scale.churn_per_sec,
        targets.len(),
        counts.connected.load(Ordering::Relaxed),
        counts.closed_by_server.load(Ordering::Relaxed),
        counts.failed.load(Ordering::Relaxed)
    );
    drop(server);
}
