//! A disk that charges a modelled device's costs on top of another disk:
//! the benchmarks' stand-in for a remote or slower disk than the one this
//! machine has, chosen by configuration (`TractServerConfig::disk_model`)
//! and never by code on the request path.
//!
//! The model, per [`Disk::read_at`] and [`Disk::write_at`] call:
//!
//! | model            | what one call costs                                              |
//! |------------------|------------------------------------------------------------------|
//! | `arms == 0`      | `latency` (overlapping with other calls'), then its bytes at `bandwidth` through one pipe all calls share, in arrival order |
//! | `arms == n`      | one of `n` arms, the first free, for `latency` + bytes at `bandwidth`; calls beyond `n` queue as they do at a disk |
//!
//! `bandwidth == 0` transfers instantly. Syncs are free: the modelled disk
//! stores a write when the write completes (a network disk that
//! acknowledges stored writes), so its cost is in the write's latency.
//!
//! Each call books its interval on a timeline and sleeps once until the
//! interval's end, so timer granularity does not add up across queued
//! calls. Then the wrapped disk does the real work.
//!
//! The transfer rate is shared by every disk wrapped from one model (and
//! its clones) and may change while they run ([`DiskModel::set_bandwidth`]):
//! a benchmark fills a cluster at full speed and then caps every disk.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use crate::{Disk, Env, Instant};

/// What a modelled disk charges (module docs).
#[derive(Clone, Debug, Default)]
pub struct DiskModel {
    /// Fixed cost of every read and write (seek, rotation, network).
    pub latency: Duration,
    /// Calls served at once; 0: any number (latencies overlap, transfers
    /// share one pipe).
    pub arms: u32,
    /// Bytes per second (0: unlimited), shared with every clone.
    bandwidth: Arc<AtomicU64>,
}

impl DiskModel {
    pub fn new(latency: Duration, arms: u32, bandwidth: u64) -> DiskModel {
        DiskModel { latency, arms, bandwidth: Arc::new(AtomicU64::new(bandwidth)) }
    }

    /// Changes the transfer rate of every disk wrapped from this model (or
    /// a clone of it), from their next call on; calls already booked keep
    /// their intervals.
    pub fn set_bandwidth(&self, bytes_per_sec: u64) {
        self.bandwidth.store(bytes_per_sec, Ordering::Relaxed);
    }

    pub fn bandwidth(&self) -> u64 {
        self.bandwidth.load(Ordering::Relaxed)
    }

    /// `disk`, charging this model's costs, on `env`'s clock.
    pub fn wrap(&self, env: &Env, disk: Arc<dyn Disk>) -> Arc<dyn Disk> {
        Arc::new(ModelledDisk {
            inner: disk,
            env: env.clone(),
            timeline: Arc::new(Timeline {
                model: self.clone(),
                booked: Mutex::new(Booked {
                    arms_free_at: vec![None; self.arms as usize],
                    pipe_free_at: None,
                }),
            }),
        })
    }
}

struct Booked {
    /// When each arm is next free; empty: unlimited arms.
    arms_free_at: Vec<Option<Instant>>,
    /// When the shared pipe is next free (unlimited arms).
    pipe_free_at: Option<Instant>,
}

struct Timeline {
    model: DiskModel,
    booked: Mutex<Booked>,
}

impl Timeline {
    /// Books a call of `len` bytes arriving at `now`; returns when it ends.
    fn book(&self, now: Instant, len: u64) -> Instant {
        let latency = self.model.latency;
        let transfer = match self.model.bandwidth() {
            0 => Duration::ZERO,
            bw => Duration::from_secs_f64(len as f64 / bw as f64),
        };
        let mut b = self.booked.lock().unwrap_or_else(|p| p.into_inner());
        if b.arms_free_at.is_empty() {
            let start = b.pipe_free_at.map_or(now + latency, |t| t.max(now + latency));
            b.pipe_free_at = Some(start + transfer);
            start + transfer
        } else {
            let arm = (0..b.arms_free_at.len()).min_by_key(|&i| b.arms_free_at[i]).unwrap_or(0);
            let start = b.arms_free_at[arm].map_or(now, |t| t.max(now));
            let end = start + latency + transfer;
            b.arms_free_at[arm] = Some(end);
            end
        }
    }

    async fn charge(&self, env: &Env, len: u64) {
        if self.model.latency.is_zero() && self.model.bandwidth() == 0 {
            return;
        }
        let now = env.now();
        let end = self.book(now, len);
        if end > now {
            env.sleep(end - now).await;
        }
    }
}

struct ModelledDisk {
    inner: Arc<dyn Disk>,
    env: Env,
    timeline: Arc<Timeline>,
}

impl Disk for ModelledDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
        let (inner, env, timeline) = (self.inner.clone(), self.env.clone(), self.timeline.clone());
        async move {
            timeline.charge(&env, len as u64).await;
            inner.read_at(offset, len).await
        }
        .boxed()
    }

    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
        let (inner, env, timeline) = (self.inner.clone(), self.env.clone(), self.timeline.clone());
        async move {
            let len = writes.iter().map(|(_, b)| b.len() as u64).sum();
            timeline.charge(&env, len).await;
            inner.write_at(writes).await
        }
        .boxed()
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        self.inner.sync()
    }

    fn sync_alone(&self) -> BoxFuture<'static, io::Result<()>> {
        self.inner.sync_alone()
    }

    fn preparing_left(&self) -> u64 {
        self.inner.preparing_left()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(base: Instant, ms: u64) -> Instant {
        base + Duration::from_millis(ms)
    }

    /// One arm: calls queue, each paying latency and transfer in turn.
    #[test]
    fn one_arm_queues_calls() {
        let t = Timeline {
            model: DiskModel::new(Duration::from_millis(8), 1, 1_000_000),
            booked: Mutex::new(Booked { arms_free_at: vec![None], pipe_free_at: None }),
        };
        let now = Env::real().now();
        // 8 ms + 1 ms for 1000 bytes at 1 MB/s, then the next one after it.
        assert_eq!(t.book(now, 1000), at(now, 9));
        assert_eq!(t.book(now, 1000), at(now, 18));
        // Arriving after the arm is free: starts at once.
        assert_eq!(t.book(at(now, 100), 0), at(now, 108));
    }

    /// Unlimited arms: latencies overlap, transfers share the pipe.
    #[test]
    fn unlimited_arms_share_one_pipe() {
        let t = Timeline {
            model: DiskModel::new(Duration::from_millis(5), 0, 1_000_000),
            booked: Mutex::new(Booked { arms_free_at: Vec::new(), pipe_free_at: None }),
        };
        let now = Env::real().now();
        assert_eq!(t.book(now, 2000), at(now, 7));
        assert_eq!(t.book(now, 2000), at(now, 9));
        // A bandwidth change applies to later calls only.
        t.model.set_bandwidth(0);
        assert_eq!(t.book(now, 1 << 30), at(now, 9));
    }

    /// The wrapper charges reads and writes, not syncs, and passes the data
    /// through unchanged.
    #[tokio::test(start_paused = true)]
    async fn wrapped_disk_charges_reads_and_writes() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let env = Env::real();
        let raw = env.open_disk(&dir.path().join("d"), Some(1 << 20)).await?;
        let model = DiskModel::new(Duration::from_millis(10), 1, 0);
        let d = model.wrap(&env, raw);
        let start = env.now();
        d.write_at(vec![(4096, Bytes::from_static(b"model"))]).await?;
        d.sync().await?;
        assert_eq!(&d.read_at(4096, 5).await?[..], b"model");
        assert_eq!(env.now() - start, Duration::from_millis(20));
        assert_eq!(d.len(), 1 << 20);
        Ok(())
    }
}
