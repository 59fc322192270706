//! Read-only exports: a volume opened without claiming it
//! (`manage::open_read_only`) is served with NBD_FLAG_READ_ONLY and none of
//! the flags for changing data; its data reads back; WRITE, TRIM and
//! WRITE_ZEROES get EPERM without reaching the volume (a WRITE's payload is
//! skipped, so the stream stays in step); FLUSH succeeds.
//!
//! Checked with the spec client of `common` (every reply style and both
//! ways of choosing the export) and with third-party clients: nbdinfo,
//! qemu-io and nbdsh (libnbd with strict mode off, so its writes reach the
//! server). Like tools.rs, a missing tool fails the test and names the
//! Debian package rather than skipping.

#![allow(clippy::unwrap_used)]
// The third-party test drives real processes outside the env seam.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_client::Client;
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::Env;
use blizzard_nbd::proto::*;
use blizzard_nbd::{Exports, NbdConfig, Server};
use blizzard_volume::{manage, CommitMode, FlushPolicy, Volume, VolumeError};
use common::*;

const NAME: &str = "ro";
const SIZE: u64 = 8 << 20;
/// Written before the volume is exported: 0xab bytes at an unaligned
/// offset (qemu-io checks single-byte patterns) ...
const AB_AT: u64 = 1000;
const AB_LEN: usize = 70_001;
/// ... and a pattern at 1 MiB.
const PAT_AT: u64 = 1 << 20;
const PAT_LEN: usize = 65_536;
/// Never written: reads as zeros before and after the refused changes.
const HOLE_AT: u64 = 4 << 20;

/// Every export is opened read-only: the server never claims a volume.
struct ReadOnlyExports {
    client: Client,
}

impl Exports for ReadOnlyExports {
    fn list(&self) -> BoxFuture<'_, Result<Vec<blizzard_nbd::Listed>, VolumeError>> {
        async move {
            let all = manage::list(&self.client).await?;
            Ok(all.into_iter().map(|sb| blizzard_nbd::Listed { name: sb.name, access: sb.access }).collect())
        }
        .boxed()
    }

    fn open<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Volume, VolumeError>> {
        manage::open_read_only(&self.client, name).boxed()
    }
}

struct RoFixture {
    cluster: Cluster,
    client: Client,
    server: Server,
    addr: String,
    _dir: tempfile::TempDir,
}

/// A cluster with one write-through volume holding the data above
/// (written and closed by its writer), exported read-only as the default
/// export.
async fn start_read_only() -> RoFixture {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut cc = ClusterConfig::new(dir.path());
    cc.tractservers = 3;
    cc.replication = 2;
    cc.tract_size = 64 << 10;
    cc.disk_size = 64 << 20;
    cc.heartbeat_interval = Duration::from_millis(50);
    let env = Env::real();
    let cluster = Cluster::start(env.clone(), cc).await.unwrap();
    let client = cluster.client().await.unwrap();
    let v = manage::create(
        env.clone(),
        &client,
        &spec(NAME, SIZE, CommitMode::WriteThrough, FlushPolicy::Durable),
    )
    .await
    .unwrap();
    v.write(AB_AT, Bytes::from(vec![0xab; AB_LEN]), true).await.unwrap();
    v.write(PAT_AT, Bytes::from(pattern(PAT_AT, PAT_LEN, 1)), true).await.unwrap();
    v.close().await.unwrap();
    let cfg = NbdConfig { default_export: Some(NAME.into()), ..NbdConfig::default() };
    let exports = Arc::new(ReadOnlyExports { client: client.clone() });
    let server = Server::start(env, exports, "127.0.0.1:0", cfg).await.unwrap();
    let addr = server.local_addr().to_string();
    RoFixture { cluster, client, server, addr, _dir: dir }
}

impl RoFixture {
    /// Stops the server, then checks the volume holds exactly what was
    /// written before it was exported.
    async fn stop_and_check_unchanged(self) {
        self.server.shutdown().await.unwrap();
        let v = manage::open_read_only(&self.client, NAME).await.unwrap();
        assert!(v.read(AB_AT, AB_LEN as u64).await.unwrap().iter().all(|&b| b == 0xab));
        assert!(v.read(PAT_AT, PAT_LEN as u64).await.unwrap()[..] == pattern(PAT_AT, PAT_LEN, 1)[..]);
        assert!(v.read(0, AB_AT).await.unwrap().iter().all(|&b| b == 0));
        assert!(v.read(HOLE_AT, 1 << 20).await.unwrap().iter().all(|&b| b == 0));
        drop(v);
        self.cluster.stop().await;
    }
}

/// The flags that only matter for changing data.
const CHANGES: u16 =
    NBD_FLAG_SEND_FUA | NBD_FLAG_SEND_TRIM | NBD_FLAG_SEND_WRITE_ZEROES | NBD_FLAG_SEND_FAST_ZERO;

/// Through GO (structured and simple replies) and EXPORT_NAME (with and
/// without NO_ZEROES): the flags say read-only, reads return the data,
/// changes get EPERM (a write's payload is skipped: a read pipelined behind
/// it still gets its own reply), FLUSH succeeds. The volume is unchanged
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_export_refuses_changes() -> R {
    let fx = start_read_only().await;
    let wants = [
        FULL,
        SIMPLE,
        Want { structured: false, base_allocation: false, export_name: Some(true) },
        Want { structured: false, base_allocation: false, export_name: Some(false) },
    ];
    for want in wants {
        let mut c = Nbd::connect(&fx.addr, NAME, want).await;
        assert_eq!(c.size, SIZE);
        assert_ne!(c.flags & NBD_FLAG_READ_ONLY, 0, "{want:?}: flags {:#x}", c.flags);
        assert_eq!(c.flags & CHANGES, 0, "{want:?}: flags {:#x}", c.flags);
        assert_ne!(c.flags & NBD_FLAG_SEND_FLUSH, 0, "{want:?}");
        assert_ne!(c.flags & NBD_FLAG_CAN_MULTI_CONN, 0, "{want:?}");

        assert!(c.read(AB_AT, AB_LEN as u32).await.iter().all(|&b| b == 0xab), "{want:?}");
        assert!(c.read(PAT_AT, PAT_LEN as u32).await == pattern(PAT_AT, PAT_LEN, 1), "{want:?}");

        // A write, then a read sent before the write's reply arrives.
        let data = pattern(HOLE_AT, 8192, 2);
        let w = c.send(NBD_CMD_WRITE, 0, HOLE_AT, 8192, &data).await;
        let r = c.send(NBD_CMD_READ, 0, PAT_AT, 4096, &[]).await;
        c.flush_socket().await;
        for _ in 0..2 {
            let (cookie, resp) = c.recv().await;
            if cookie == w {
                assert_eq!(resp.errno, NBD_EPERM, "{want:?}: write");
                if want.structured {
                    assert!(resp.message.contains("read-only"), "{}", resp.message);
                }
            } else {
                assert_eq!(cookie, r);
                assert_eq!(resp.errno, 0, "{want:?}: read behind a refused write");
                assert!(resp.data == pattern(PAT_AT, 4096, 1), "{want:?}");
            }
        }
        // FUA on a write changes nothing about the refusal.
        let resp = c.call(NBD_CMD_WRITE, NBD_CMD_FLAG_FUA, AB_AT, 512, &[0x11; 512]).await;
        assert_eq!(resp.errno, NBD_EPERM, "{want:?}: FUA write");
        let resp = c.call(NBD_CMD_TRIM, 0, AB_AT, 65536, &[]).await;
        assert_eq!(resp.errno, NBD_EPERM, "{want:?}: trim");
        let resp = c.call(NBD_CMD_WRITE_ZEROES, 0, PAT_AT, 4096, &[]).await;
        assert_eq!(resp.errno, NBD_EPERM, "{want:?}: write zeroes");
        let resp = c.call(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_NO_HOLE, PAT_AT, 4096, &[]).await;
        assert_eq!(resp.errno, NBD_EPERM, "{want:?}: write zeroes, no hole");
        c.flush().await;

        // Nothing changed.
        assert!(c.read(HOLE_AT, 8192).await.iter().all(|&b| b == 0), "{want:?}");
        assert!(c.read(AB_AT, 65536).await.iter().all(|&b| b == 0xab), "{want:?}");
        assert!(c.read(PAT_AT, 4096).await == pattern(PAT_AT, 4096, 1), "{want:?}");
        if want.base_allocation {
            let resp = c.call(NBD_CMD_BLOCK_STATUS, 0, 0, SIZE as u32, &[]).await;
            assert_eq!(resp.errno, 0, "block status: {}", resp.message);
            assert_eq!(resp.extents.iter().map(|e| e.0 as u64).sum::<u64>(), SIZE);
        }
        c.disconnect().await;
    }
    fx.stop_and_check_unchanged().await;
    Ok(())
}

/// The directory on PATH holding `tool`; fails the test, naming the
/// Debian package, if there is none.
fn need(tool: &str, package: &str) -> PathBuf {
    let found =
        std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).find(|d| d.join(tool).is_file()));
    found.unwrap_or_else(|| {
        panic!("`{tool}` is missing: install the Debian package {package} (apt-get install -y {package})")
    })
}

/// Runs a command; returns whether it exited 0 and its output.
fn run_status(cmd: &str, args: &[&str]) -> (bool, String) {
    output(Command::new(cmd).args(args))
}

fn output(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Runs a command; fails the test with its output unless it exits 0.
fn run(cmd: &str, args: &[&str]) -> String {
    let (ok, text) = run_status(cmd, args);
    assert!(ok, "{cmd} {args:?} failed:\n{text}");
    text
}

/// nbdsh: with strict mode off libnbd sends what the flags say not to, so
/// the refusals come from the server. Each refused command prints a line
/// `refused <command> <errno name>: <libnbd's message>`.
const NBDSH_SCRIPT: &str = r#"
import errno, os
uri = os.environ["READ_ONLY_URI"]
for structured in (True, False):
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    h.set_strict_mode(0)
    h.connect_uri(uri)
    assert h.is_read_only(), "not read-only"
    assert not h.can_trim() and not h.can_zero() and not h.can_fua(), "write flags advertised"
    assert h.pread(4, 1000) == b"\xab" * 4, "read"
    for name, call in (
        ("pwrite", lambda: h.pwrite(b"\x11" * 4096, 4 << 20)),
        ("trim", lambda: h.trim(65536, 0)),
        ("zero", lambda: h.zero(4096, 1 << 20)),
    ):
        try:
            call()
        except nbd.Error as e:
            print("refused", name, errno.errorcode.get(e.errnum, e.errnum) + ":", e.string)
        else:
            raise SystemExit(name + " succeeded on a read-only export")
    h.flush()
    assert h.pread(4096, 4 << 20) == bytes(4096), "write reached the volume"
    h.shutdown()
print("done")
"#;

/// nbdinfo reports the export read-only (and nothing for changing data);
/// qemu-io reads the data, and refuses to open the export read-write;
/// nbdsh's writes, trims and write-zeroes get EPERM ("Operation not
/// permitted") from the server, its flush succeeds.
#[test]
fn third_party_clients_on_read_only_export() {
    need("nbdinfo", "libnbd-bin");
    need("qemu-io", "qemu-utils");
    let nbdsh_dir = need("nbdsh", "python3-libnbd");

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let fx = rt.block_on(start_read_only());
    let uri = format!("nbd://{}/{NAME}", fx.addr);

    // nbdinfo: the flags as a client library sees them.
    let info = run("nbdinfo", &[&uri]);
    assert!(info.contains(&format!("export-size: {SIZE}")), "{info}");
    assert!(info.contains("is_read_only: true"), "{info}");
    for no in ["can_trim: false", "can_zero: false", "can_fast_zero: false", "can_fua: false"] {
        assert!(info.contains(no), "{no}:\n{info}");
    }
    assert!(info.contains("can_flush: true") && info.contains("can_multi_conn: true"), "{info}");
    run("nbdinfo", &["--is", "read-only", &uri]);
    // The default export is the read-only volume too.
    let info = run("nbdinfo", &[&format!("nbd://{}/", fx.addr)]);
    assert!(info.contains("is_read_only: true"), "{info}");

    // qemu-io: the data, read-only; a read-write open fails on the flag.
    let io = run(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            &uri,
            "-c",
            "read -P 0xab 1000 70001",
            "-c",
            "read -P 0 0 1000",
            "-c",
            "read -P 0 71001 4096",
            "-c",
            "read -P 0 4194304 1048576",
        ],
    );
    for bad in ["failed", "error", "Error", "verification"] {
        assert!(!io.contains(bad), "qemu-io reported {bad:?}:\n{io}");
    }
    let (ok, text) = run_status("qemu-io", &["-f", "raw", &uri, "-c", "write -P 0x11 0 4096"]);
    // (qemu-io 10.0 says "Could not open image: Permission denied".)
    let refused = text.contains("read-only") || text.contains("Permission denied");
    assert!(!ok && refused, "qemu-io opened a read-only export read-write:\n{text}");

    // nbdsh: the server refuses the changes itself.
    // nbdsh runs `python3 -m nbd`: the python3 installed beside it is the
    // one its module belongs to (another on PATH first may lack it).
    let mut path = vec![nbdsh_dir];
    path.extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()));
    let (ok, out) = output(
        Command::new("nbdsh")
            .args(["-n", "-c", NBDSH_SCRIPT])
            .env("PATH", std::env::join_paths(path).unwrap())
            .env("READ_ONLY_URI", &uri),
    );
    assert!(ok && out.contains("done"), "nbdsh failed:\n{out}");
    let refused: Vec<&str> = out.lines().filter(|l| l.starts_with("refused ")).collect();
    assert_eq!(refused.len(), 6, "{out}");
    for l in refused {
        assert!(l.contains("EPERM") && l.contains("Operation not permitted"), "{l}");
    }

    rt.block_on(fx.stop_and_check_unchanged());
}
