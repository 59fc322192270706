//! What the cluster tests share: logging, waiting on the cluster, and a
//! checked volume load.

#![allow(clippy::disallowed_methods)] // Real time: tests on real sockets.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use blizzard_cluster::Cluster;
use blizzard_volume::Volume;

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,openraft=error".into()),
        )
        .with_test_writer()
        .try_init();
}

/// Waits until `f` holds, failing the test after 30 s.
pub async fn wait_for<F: FnMut(&Cluster) -> bool>(c: &Cluster, what: &str, mut f: F) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f(c) {
        assert!(Instant::now() < deadline, "not within 30 s: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A load on a volume until `stop`: each 4 KiB write read back and
/// checked; `longest_ms` is the longest write plus read, `done` how many.
pub struct Load {
    pub task: tokio::task::JoinHandle<Result<(), String>>,
    pub longest_ms: Arc<AtomicU64>,
    pub done: Arc<AtomicU64>,
}

pub fn checked_load(vol: Arc<Volume>, blocks: u64, stop: Arc<AtomicBool>) -> Load {
    let longest_ms = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let (l, d) = (longest_ms.clone(), done.clone());
    let task = tokio::spawn(async move {
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let at = (i % blocks) * 4096;
            let byte = (i % 251) as u8;
            let t = Instant::now();
            vol.write(at, Bytes::from(vec![byte; 4096]), false)
                .await
                .map_err(|e| format!("write {i}: {e}"))?;
            let got = vol.read(at, 4096).await.map_err(|e| format!("read {i}: {e}"))?;
            l.fetch_max(t.elapsed().as_millis() as u64, Ordering::Relaxed);
            if got.iter().any(|b| *b != byte) {
                return Err(format!("block {at} does not hold write {i}"));
            }
            d.fetch_add(1, Ordering::Relaxed);
            i += 1;
        }
        Ok(())
    });
    Load { task, longest_ms, done }
}
