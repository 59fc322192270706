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
//! | `arms == n`, `seeks` | a spinning disk behind the page cache: `latency` is a positioning cost (seek and rotation), paid only by an access that does not start where the arm stopped. Reads pay at once. Writes cost nothing until a sync, which sends every range written since the last one down in offset order (the elevator), overlapping and adjacent ranges merged, and returns when the arm has written them all |
//!
//! [`DiskModel::hdd`] is a 7,200 rpm disk: one arm, 8 ms to position,
//! 150 MB/s. The hybrid tier's slow disks run on it (a machine here has no
//! spinning disk), so what a random small write costs there, and what
//! ordering writes saves, is charged as it would be.
//!
//! `bandwidth == 0` transfers instantly. Without `seeks`, syncs are free:
//! the modelled disk stores a write when the write completes (a network
//! disk that acknowledges stored writes), so its cost is in the write's
//! latency.
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
    /// `latency` is charged only when an access does not start where its
    /// arm's previous one ended (a spinning disk's seek and rotation).
    /// Needs `arms > 0`.
    pub seeks: bool,
    /// Bytes per second (0: unlimited), shared with every clone.
    bandwidth: Arc<AtomicU64>,
}

impl DiskModel {
    pub fn new(latency: Duration, arms: u32, bandwidth: u64) -> DiskModel {
        DiskModel { latency, arms, seeks: false, bandwidth: Arc::new(AtomicU64::new(bandwidth)) }
    }

    /// A 7,200 rpm spinning disk: one arm, 8 ms of seek and rotation for an
    /// access that does not continue the previous one, 150 MB/s.
    pub fn hdd() -> DiskModel {
        DiskModel { seeks: true, ..DiskModel::new(Duration::from_millis(8), 1, 150_000_000) }
    }

    /// The model a configuration names: `hdd`, or `delay=MS` (a fixed
    /// latency per call, unlimited arms). For command lines.
    pub fn parse(s: &str) -> Result<DiskModel, String> {
        if s == "hdd" {
            return Ok(DiskModel::hdd());
        }
        let ms = s
            .strip_prefix("delay=")
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| (0.0..=10_000.0).contains(v))
            .ok_or_else(|| {
                format!("unknown disk model {s:?}: give `hdd` or `delay=MS` (0 to 10000 milliseconds)")
            })?;
        Ok(DiskModel::new(Duration::from_secs_f64(ms / 1000.0), 0, 0))
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
            timeline: Arc::new(Timeline { model: self.clone(), booked: Mutex::new(Booked::new(self.arms)) }),
        })
    }
}

struct Booked {
    /// Ranges written since the last sync (`seeks` models), start → end,
    /// merged where they overlap or touch.
    dirty: std::collections::BTreeMap<u64, u64>,
    /// When each arm is next free; empty: unlimited arms.
    arms_free_at: Vec<Option<Instant>>,
    /// Where each arm stopped: the byte after its last access.
    arms_at: Vec<Option<u64>>,
    /// When the shared pipe is next free (unlimited arms).
    pipe_free_at: Option<Instant>,
}

impl Booked {
    fn new(arms: u32) -> Booked {
        Booked {
            dirty: std::collections::BTreeMap::new(),
            arms_free_at: vec![None; arms as usize],
            arms_at: vec![None; arms as usize],
            pipe_free_at: None,
        }
    }
}

struct Timeline {
    model: DiskModel,
    booked: Mutex<Booked>,
}

impl Timeline {
    /// Books a call of `accesses` (offset, bytes) arriving at `now`;
    /// returns when it ends.
    fn book(&self, now: Instant, accesses: &[(u64, u64)]) -> Instant {
        let latency = self.model.latency;
        let transfer = |len: u64| match self.model.bandwidth() {
            0 => Duration::ZERO,
            bw => Duration::from_secs_f64(len as f64 / bw as f64),
        };
        let total: u64 = accesses.iter().map(|&(_, len)| len).sum();
        let mut b = self.booked.lock().unwrap_or_else(|p| p.into_inner());
        if b.arms_free_at.is_empty() {
            let start = b.pipe_free_at.map_or(now + latency, |t| t.max(now + latency));
            b.pipe_free_at = Some(start + transfer(total));
            return start + transfer(total);
        }
        let arm = (0..b.arms_free_at.len()).min_by_key(|&i| b.arms_free_at[i]).unwrap_or(0);
        let mut end = b.arms_free_at[arm].map_or(now, |t| t.max(now));
        if !self.model.seeks {
            end += latency + transfer(total);
        } else {
            // In offset order, as an elevator sends a batch; a call of
            // no bytes (a probe) still positions the arm once.
            let mut sorted = accesses.to_vec();
            sorted.sort_unstable();
            if sorted.is_empty() {
                end += latency;
            }
            for (offset, len) in sorted {
                if b.arms_at[arm] != Some(offset) {
                    end += latency;
                }
                end += transfer(len);
                b.arms_at[arm] = Some(offset + len);
            }
        }
        b.arms_free_at[arm] = Some(end);
        end
    }

    /// Notes ranges written (a `seeks` model charges them at the sync).
    fn dirty(&self, accesses: &[(u64, u64)]) {
        let mut b = self.booked.lock().unwrap_or_else(|p| p.into_inner());
        for &(offset, len) in accesses.iter().filter(|a| a.1 > 0) {
            let (mut start, mut end) = (offset, offset + len);
            // Merge every range overlapping or touching [start, end).
            let touching: Vec<(u64, u64)> = b
                .dirty
                .range(..=end)
                .rev()
                .take_while(|&(_, &e)| e >= start)
                .map(|(&s, &e)| (s, e))
                .collect();
            for (s, e) in touching {
                b.dirty.remove(&s);
                start = start.min(s);
                end = end.max(e);
            }
            b.dirty.insert(start, end);
        }
    }

    /// Takes the ranges written since the last sync, as accesses.
    fn take_dirty(&self) -> Vec<(u64, u64)> {
        let mut b = self.booked.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut b.dirty).into_iter().map(|(s, e)| (s, e - s)).collect()
    }

    async fn charge(&self, env: &Env, accesses: &[(u64, u64)]) {
        if self.model.latency.is_zero() && self.model.bandwidth() == 0 {
            return;
        }
        let now = env.now();
        let end = self.book(now, accesses);
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

impl ModelledDisk {
    /// A `seeks` model's sync: the ranges written since the last one go
    /// down first, in offset order. Ranges written while it runs wait for
    /// the next sync, as pages dirtied during an `fdatasync` may.
    fn charged_sync(&self, inner: BoxFuture<'static, io::Result<()>>) -> BoxFuture<'static, io::Result<()>> {
        if !self.timeline.model.seeks {
            return inner;
        }
        let (env, timeline) = (self.env.clone(), self.timeline.clone());
        async move {
            let dirty = timeline.take_dirty();
            if !dirty.is_empty() {
                timeline.charge(&env, &dirty).await;
            }
            inner.await
        }
        .boxed()
    }
}

impl Disk for ModelledDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, io::Result<Bytes>> {
        let (inner, env, timeline) = (self.inner.clone(), self.env.clone(), self.timeline.clone());
        async move {
            timeline.charge(&env, &[(offset, len as u64)]).await;
            inner.read_at(offset, len).await
        }
        .boxed()
    }

    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, io::Result<()>> {
        let (inner, env, timeline) = (self.inner.clone(), self.env.clone(), self.timeline.clone());
        async move {
            let accesses: Vec<(u64, u64)> = writes.iter().map(|(o, b)| (*o, b.len() as u64)).collect();
            if timeline.model.seeks {
                timeline.dirty(&accesses);
            } else {
                timeline.charge(&env, &accesses).await;
            }
            inner.write_at(writes).await
        }
        .boxed()
    }

    fn sync(&self) -> BoxFuture<'static, io::Result<()>> {
        self.charged_sync(self.inner.sync())
    }

    fn sync_alone(&self) -> BoxFuture<'static, io::Result<()>> {
        self.charged_sync(self.inner.sync_alone())
    }

    fn preparing_left(&self) -> u64 {
        self.inner.preparing_left()
    }

    /// Not charged: readahead of a range the disk reads sequentially, in
    /// the background.
    fn prefetch(&self, offset: u64, len: u64) {
        self.inner.prefetch(offset, len)
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
            booked: Mutex::new(Booked::new(1)),
        };
        let now = Env::real().now();
        // 8 ms + 1 ms for 1000 bytes at 1 MB/s, then the next one after it.
        assert_eq!(t.book(now, &[(0, 1000)]), at(now, 9));
        assert_eq!(t.book(now, &[(0, 1000)]), at(now, 18));
        // Arriving after the arm is free: starts at once.
        assert_eq!(t.book(at(now, 100), &[]), at(now, 108));
    }

    /// A spinning disk pays to position only when an access jumps; a
    /// batch of writes is charged in offset order.
    #[test]
    fn hdd_seeks_only_when_the_arm_moves() {
        let t = Timeline { model: DiskModel::hdd(), booked: Mutex::new(Booked::new(1)) };
        let now = Env::real().now();
        let mb = 150_000; // 1 ms of transfer at 150 MB/s
                          // First access positions: 8 ms + 1 ms.
        assert_eq!(t.book(now, &[(0, mb)]), at(now, 9));
        // Continuing where it stopped: transfer only.
        assert_eq!(t.book(now, &[(mb, mb)]), at(now, 10));
        // A jump: positions again.
        assert_eq!(t.book(now, &[(10 * mb, mb)]), at(now, 19));
        // Two writes given out of order but adjacent: one seek (to 100 mb),
        // then the second continues it.
        assert_eq!(t.book(now, &[(101 * mb, mb), (100 * mb, mb)]), at(now, 29));
        // Scattered writes: a seek each.
        assert_eq!(t.book(now, &[(500 * mb, mb), (300 * mb, mb)]), at(now, 47));
    }

    /// A spinning disk behind the page cache: writes are free until the
    /// sync, which pays for the merged ranges in offset order.
    #[tokio::test(start_paused = true)]
    async fn hdd_writes_pay_at_the_sync_in_disk_order() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let env = Env::real();
        let raw = env.open_disk(&dir.path().join("d"), Some(64 << 20)).await?;
        let d = DiskModel::hdd().wrap(&env, raw);
        let block = |seed: u8| Bytes::from(vec![seed; 150_000]); // 1 ms at 150 MB/s
        let start = env.now();
        // Three scattered writes, one of them written twice, and two
        // adjacent: free now.
        d.write_at(vec![(30_000_000, block(1))]).await?;
        d.write_at(vec![(10_000_000, block(2))]).await?;
        d.write_at(vec![(10_000_000, block(3))]).await?;
        d.write_at(vec![(10_150_000, block(4))]).await?;
        d.write_at(vec![(50_000_000, block(5))]).await?;
        assert_eq!(env.now(), start);
        // The sync: three seeks (10 M with its neighbour, 30 M, 50 M) and
        // four blocks' transfer: 3 × 8 + 4 × 1 ms.
        d.sync().await?;
        assert_eq!(env.now() - start, Duration::from_millis(28));
        // Nothing dirty: the next sync is free.
        d.sync().await?;
        assert_eq!(env.now() - start, Duration::from_millis(28));
        // Reads pay at once: from where the arm stopped (50.15 M), no seek;
        // elsewhere, a seek.
        assert_eq!(d.read_at(50_150_000, 4).await?.len(), 4);
        assert!(env.now() - start <= Duration::from_millis(29), "timer granularity: 1 ms");
        assert_eq!(d.read_at(0, 4).await?.len(), 4);
        assert!(env.now() - start >= Duration::from_millis(36));
        Ok(())
    }

    #[test]
    fn models_parse_from_their_names() {
        assert!(DiskModel::parse("hdd").is_ok_and(|m| m.seeks && m.arms == 1));
        let d = DiskModel::parse("delay=2.5").unwrap_or_default();
        assert_eq!((d.latency, d.arms, d.seeks), (Duration::from_micros(2500), 0, false));
        for bad in ["ssd", "delay=", "delay=-1", "delay=99999", ""] {
            let e = DiskModel::parse(bad).err().unwrap_or_default();
            assert!(e.contains("give `hdd` or `delay=MS`"), "{bad:?}: {e}");
        }
    }

    /// Unlimited arms: latencies overlap, transfers share the pipe.
    #[test]
    fn unlimited_arms_share_one_pipe() {
        let t = Timeline {
            model: DiskModel::new(Duration::from_millis(5), 0, 1_000_000),
            booked: Mutex::new(Booked::new(0)),
        };
        let now = Env::real().now();
        assert_eq!(t.book(now, &[(0, 2000)]), at(now, 7));
        assert_eq!(t.book(now, &[(0, 2000)]), at(now, 9));
        // A bandwidth change applies to later calls only.
        t.model.set_bandwidth(0);
        assert_eq!(t.book(now, &[(0, 1 << 30)]), at(now, 9));
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
