//! The backup journal with a store: writes acknowledged by the journal
//! alone, and what a power loss of the data disk leaves after replay.

use std::sync::Mutex as StdMutex;

use blizzard_core::crc::piece_crcs;
use blizzard_env::Env;
use futures::future::BoxFuture;
use futures::FutureExt;

use super::*;
use crate::server::JournalConfig;

const TRACT: u32 = 64 << 10;
const TRACTS: i64 = 4;

/// A data disk whose writes stay in "the page cache" (memory) until a
/// sync, and a power loss that keeps any subset of them, in order: what
/// the kernel may have written back before the lights went out.
struct PowerLossDisk {
    inner: Arc<dyn Disk>,
    unsynced: StdMutex<Vec<(u64, Bytes)>>,
    /// Out of space: a write stores a prefix of its pieces (cut at a
    /// 4 KiB boundary of the disk) and fails with ENOSPC.
    full: std::sync::atomic::AtomicU64,
}

impl PowerLossDisk {
    /// Keeps the unsynced writes `keep` says yes to, durably, and forgets
    /// the rest.
    async fn lose_power(&self, mut keep: impl FnMut() -> bool) -> std::io::Result<()> {
        let pending = std::mem::take(&mut *self.unsynced.lock().unwrap_or_else(|p| p.into_inner()));
        let kept: Vec<(u64, Bytes)> = pending.into_iter().filter(|_| keep()).collect();
        if !kept.is_empty() {
            self.inner.write_at(kept).await?;
        }
        self.inner.sync().await
    }
}

impl Disk for PowerLossDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, std::io::Result<Bytes>> {
        let overlay = self.unsynced.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let inner = self.inner.read_at(offset, len);
        async move {
            let mut b = inner.await?.to_vec();
            for (at, w) in overlay {
                let (s, e) = (at.max(offset), (at + w.len() as u64).min(offset + len as u64));
                if s < e {
                    b[(s - offset) as usize..(e - offset) as usize]
                        .copy_from_slice(&w[(s - at) as usize..(e - at) as usize]);
                }
            }
            Ok(Bytes::from(b))
        }
        .boxed()
    }
    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, std::io::Result<()>> {
        // `full`: 0 has room; otherwise a seed choosing where the space ends.
        let full = self.full.load(std::sync::atomic::Ordering::SeqCst);
        let mut u = self.unsynced.lock().unwrap_or_else(|p| p.into_inner());
        if full == 0 {
            u.extend(writes);
            return async { Ok(()) }.boxed();
        }
        let piece = (full as usize) % writes.len().max(1);
        for (i, (off, data)) in writes.into_iter().enumerate() {
            if i < piece {
                u.push((off, data));
            } else if i == piece {
                let cuts: Vec<usize> =
                    (0..data.len()).filter(|&k| k == 0 || (off + k as u64).is_multiple_of(4096)).collect();
                let keep = cuts[(full as usize / 7) % cuts.len()];
                if keep > 0 {
                    u.push((off, data.slice(..keep)));
                }
            }
        }
        async { Err(std::io::Error::from_raw_os_error(28)) }.boxed()
    }
    fn sync(&self) -> BoxFuture<'static, std::io::Result<()>> {
        let pending = std::mem::take(&mut *self.unsynced.lock().unwrap_or_else(|p| p.into_inner()));
        let inner = self.inner.clone();
        async move {
            if !pending.is_empty() {
                inner.write_at(pending).await?;
            }
            inner.sync().await
        }
        .boxed()
    }
}

struct Rig {
    dir: tempfile::TempDir,
    data: Arc<PowerLossDisk>,
    store: Store,
    /// The journal's files, as a tractserver is given them.
    jc: JournalConfig,
}

async fn rig(bypass: u32) -> Result<Rig, StoreError> {
    rig_with(bypass, 4 << 20, None).await
}

/// A store with a journal of `journal_len` bytes (ring and heads), and a
/// second area of `second_len` bytes if given, attached as a tractserver
/// attaches them (`backup::attach`).
async fn rig_with(bypass: u32, journal_len: u64, second_len: Option<u64>) -> Result<Rig, StoreError> {
    let dir = tempfile::tempdir()?;
    let inner = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    let data = Arc::new(PowerLossDisk { inner, unsynced: StdMutex::new(Vec::new()), full: 0.into() });
    let store = Store::format(data.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
    store.sync().await?;
    let mut jc = JournalConfig::new(dir.path().join("journal"));
    jc.create_size = Some(journal_len);
    jc.bypass = bypass;
    jc.second_area = second_len.map(|_| dir.path().join("second"));
    jc.second_area_size = second_len;
    attach(&store, &jc).await?;
    Ok(Rig { dir, data, store, jc })
}

async fn attach(store: &Store, jc: &JournalConfig) -> Result<Replayed, StoreError> {
    crate::backup::attach::attach_journal(&Env::real(), store, jc)
        .await
        .map_err(|e| StoreError::Io(std::io::Error::other(e.to_string())))
}

/// After a power loss: the data disk as it was left, and the journal.
async fn restart(r: Rig, keep: impl FnMut() -> bool) -> Result<(Rig, Replayed), StoreError> {
    let Rig { dir, data, store, jc } = r;
    drop(store);
    data.lose_power(keep).await?;
    let inner = data.inner.clone();
    let data = Arc::new(PowerLossDisk { inner, unsynced: StdMutex::new(Vec::new()), full: 0.into() });
    let store = Store::open(data.clone()).await?;
    let replayed = attach(&store, &jc).await?;
    Ok((Rig { dir, data, store, jc }, replayed))
}

fn pattern(seed: u64, len: usize) -> Bytes {
    Bytes::from(
        (0..len).map(|i| (seed as u8).wrapping_mul(7).wrapping_add((i / 512) as u8)).collect::<Vec<_>>(),
    )
}

async fn put(s: &Store, tract: i64, off: u32, data: &Bytes) -> Result<(), StoreError> {
    s.write(BlobId(1), 1, TractNo(tract), 1, off, data.clone(), &piece_crcs(off, data)).await
}

async fn get(s: &Store, tract: i64) -> Result<Vec<u8>, StoreError> {
    Ok(s.read(BlobId(1), 1, TractNo(tract), 0, TRACT).await?.0.to_vec())
}

/// Runs `op` until it succeeds; a failure (the disk was full) makes room.
async fn retry<F, Fut>(r: &Rig, mut op: F) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), StoreError>>,
{
    for _ in 0..3 {
        match op().await {
            Ok(()) => return Ok(()),
            Err(StoreError::Io(e)) if e.raw_os_error() == Some(28) => {
                r.data.full.store(0, std::sync::atomic::Ordering::SeqCst);
            }
            Err(e) => return Err(e),
        }
    }
    op().await
}

/// A small write is acknowledged once in the journal: the data disk is
/// not synced for it, and it reads back at once.
#[tokio::test]
async fn small_writes_are_acknowledged_by_the_journal_alone() -> Result<(), StoreError> {
    let r = rig(16 << 10).await?;
    let (disk_syncs, journal_syncs) = (r.store.syncs(), r.store.backup_journal().map_or(0, |j| j.syncs()));
    for i in 0..10u32 {
        put(&r.store, 0, i * 4096, &pattern(i as u64, 4096)).await?;
    }
    assert_eq!(r.store.syncs(), disk_syncs, "no data-disk sync for journaled writes");
    let j = r.store.backup_journal().cloned().ok_or(StoreError::Failed)?;
    assert_eq!(j.syncs() - journal_syncs, 10);
    assert_eq!(j.live_records(), 10);
    assert_eq!(&get(&r.store, 0).await?[4096..8192], &pattern(1, 4096)[..]);
    // A large write goes to the data disk (synced) and marks the journal.
    put(&r.store, 1, 0, &pattern(50, 32 << 10)).await?;
    assert_eq!(r.store.syncs(), disk_syncs + 1);
    assert_eq!(j.live_records(), 11);
    // Destaging syncs the data disk once and releases everything.
    assert_eq!(r.store.destage_backup().await?, 11);
    assert_eq!((j.live_records(), j.used()), (0, 0));
    Ok(())
}

/// The journal a power-loss case runs with, and how it is driven.
#[derive(Clone, Copy)]
struct Shape {
    journal_len: u64,
    second_len: Option<u64>,
    /// Operations: `ops.0 + rand % ops.1`.
    ops: (u64, u64),
    /// One in this many destage turns destages (the others do nothing).
    destage_one_in: u64,
}

fn seeds(default: u64) -> u64 {
    std::env::var("BACKUP_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Random small and large writes, trims and deletes over a few tracts,
/// destaged now and then; then a power loss that keeps a random part of
/// what the data disk had not synced. After replay every tract reads
/// exactly as acknowledged. Many seeds, each a different crash.
#[tokio::test]
async fn a_power_loss_of_the_data_disk_loses_no_acknowledged_write() -> Result<(), StoreError> {
    let shape = Shape { journal_len: 4 << 20, second_len: None, ops: (30, 40), destage_one_in: 1 };
    for seed in 0..seeds(40) {
        power_loss_case(seed, shape).await?;
    }
    Ok(())
}

/// The same with a small journal and a second area, destaged rarely: the
/// first area fills, the second takes records (overwriting ranges the
/// first holds), both fill and writes go to the data disk directly. Replay
/// merges both areas by `seq`, and every tract reads as acknowledged.
#[tokio::test]
async fn a_power_loss_with_a_second_area_loses_no_acknowledged_write() -> Result<(), StoreError> {
    use crate::backup::format::{RING_MIN, RING_START};
    let shape = Shape {
        journal_len: RING_START + RING_MIN,
        second_len: Some(RING_START + RING_MIN),
        ops: (600, 200),
        destage_one_in: 40,
    };
    let (mut second, mut full) = (0, 0);
    for seed in 0..seeds(12) {
        let st = power_loss_case(1000 + seed, shape).await?;
        second += st.0;
        full += st.1;
    }
    // The case did what it is for.
    assert!(second > 100 && full > 10, "second-area records {second}, writes with both areas full {full}");
    Ok(())
}

/// One seed of the power-loss cases. Returns the records the second area
/// took and the small writes that found every area full.
async fn power_loss_case(seed: u64, shape: Shape) -> Result<(u64, u64), StoreError> {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let r = rig_with(16 << 10, shape.journal_len, shape.second_len).await?;
    let mut model = vec![vec![0u8; TRACT as usize]; TRACTS as usize];
    let ops = shape.ops.0 + next() % shape.ops.1;
    for op in 0..ops {
        // Now and then the data disk is out of space for this change:
        // it fails (storing a prefix), then is tried again with room,
        // as a client retries until acknowledged.
        if next() % 4 == 0 {
            r.data.full.store(1 + next() % 1000, std::sync::atomic::Ordering::SeqCst);
        }
        let tract = (next() % TRACTS as u64) as i64;
        let m = &mut model[tract as usize];
        match next() % 10 {
            // Small writes, 4 KiB aligned or not.
            0..=5 => {
                let len = if next() % 3 == 0 { 1 + next() % 8000 } else { 4096 * (1 + next() % 4) } as u32;
                let off = (next() % (TRACT - len) as u64) as u32;
                let off = if next() % 3 == 0 { off } else { off / 4096 * 4096 };
                let d = pattern(seed * 1000 + op, len as usize);
                retry(&r, || put(&r.store, tract, off, &d)).await?;
                m[off as usize..(off + len) as usize].copy_from_slice(&d);
            }
            // A large write: straight to the data disk.
            6 => {
                let len = (16 << 10) + 4096 * (next() % 8) as u32;
                let off = (next() % (TRACT - len) as u64) as u32 / 4096 * 4096;
                let d = pattern(seed * 1000 + op, len as usize);
                retry(&r, || put(&r.store, tract, off, &d)).await?;
                m[off as usize..(off + len) as usize].copy_from_slice(&d);
            }
            7 => {
                let off = (next() % TRACT as u64) as u32;
                let len = (next() % (TRACT - off) as u64) as u32;
                retry(&r, || r.store.trim(BlobId(1), 1, TractNo(tract), off, len, ALWAYS)).await?;
                m[off as usize..(off + len) as usize].fill(0);
            }
            8 => {
                retry(&r, || async { r.store.delete(BlobId(1), 1, TractNo(tract)).await.map(|_| ()) })
                    .await?;
                m.fill(0);
            }
            _ => {
                if next() % shape.destage_one_in == 0 {
                    retry(&r, || async { r.store.destage_backup().await.map(|_| ()) }).await?;
                }
            }
        }
        r.data.full.store(0, std::sync::atomic::Ordering::SeqCst);
    }
    let st = &r.store.stats;
    let took =
        (st.second_area_records.load(Ordering::Relaxed), st.journal_full_writes.load(Ordering::Relaxed));
    let (r, replayed) = restart(r, || next() % 2 == 0).await?;
    for t in 0..TRACTS {
        let got = get(&r.store, t).await?;
        assert!(got == model[t as usize], "seed {seed}: tract {t} differs after replay ({replayed:?})");
    }
    assert_eq!(replayed.failed, 0, "seed {seed}");
    // Replayed, synced and released: a second restart finds nothing.
    let (r, again) = restart(r, || false).await?;
    assert_eq!(again.records, 0, "seed {seed}");
    for t in 0..TRACTS {
        assert!(
            get(&r.store, t).await? == model[t as usize],
            "seed {seed}: tract {t} after a second restart"
        );
    }
    Ok(took)
}

/// A journal whose second area holds acknowledged writes is never opened
/// without it, nor with another file in its place: start refuses, saying
/// which path to give. With the right one, both areas are replayed after
/// a power loss that kept nothing of what the data disk had not synced.
#[tokio::test]
async fn a_journal_is_never_opened_without_its_second_area() -> Result<(), StoreError> {
    use crate::backup::format::{RING_MIN, RING_START};
    let r = rig_with(16 << 10, RING_START + RING_MIN, Some(RING_START + RING_MIN)).await?;
    let mut model = vec![0u8; TRACT as usize];
    let mut i = 0u64;
    while r.store.stats.second_area_records.load(Ordering::Relaxed) < 20 {
        let off = (i % 16) as u32 * 4096;
        let d = pattern(i, 4096);
        put(&r.store, 0, off, &d).await?;
        model[off as usize..off as usize + 4096].copy_from_slice(&d);
        i += 1;
        assert!(i < 1000, "the second area never took a record");
    }
    let Rig { dir, data, store, jc } = r;
    drop(store);
    data.lose_power(|| false).await?;
    let data = Arc::new(PowerLossDisk {
        inner: data.inner.clone(),
        unsynced: StdMutex::new(Vec::new()),
        full: 0.into(),
    });
    let store = Store::open(data.clone()).await?;
    for (second, why) in [(None, "no second area"), (Some(dir.path().join("other")), "a new file")] {
        let wrong = JournalConfig { second_area: second, ..jc.clone() };
        match attach(&store, &wrong).await {
            Err(e) => assert!(e.to_string().contains("--journal-overflow"), "{why}: {e}"),
            Ok(r) => panic!("{why}: attached ({r:?})"),
        }
    }
    let replayed = attach(&store, &jc).await?;
    assert!(replayed.records >= 20, "{replayed:?}");
    assert!(get(&store, 0).await? == model, "tract 0 differs after replaying both areas");
    Ok(())
}

/// A full journal does not stall writes: they go to the data disk directly
/// (each with a supersede record, from the room kept for them), and a
/// power loss afterwards loses none of the writes acknowledged either way.
#[tokio::test]
async fn a_full_journal_sends_writes_to_the_disk_and_loses_nothing() -> Result<(), StoreError> {
    use crate::backup::format::{RING_MIN, RING_START};
    let r = rig_with(16 << 10, RING_START + RING_MIN, None).await?;
    let mut model = vec![vec![0u8; TRACT as usize]; TRACTS as usize];
    // 512 writes of 4 KiB, 8 at a time (never two on the same bytes at
    // once), with no destage: about 2.4 MiB of records for a 1 MiB ring.
    const ROUNDS: usize = 64;
    let store = &r.store;
    for round in 0..ROUNDS {
        let mut writes = Vec::new();
        for k in 0..8usize {
            let tract = (k % TRACTS as usize) as i64;
            let off = (((k / TRACTS as usize) + 2 * round) % 16) as u32 * 4096;
            let d = pattern((round * 8 + k) as u64, 4096);
            model[tract as usize][off as usize..off as usize + 4096].copy_from_slice(&d);
            writes.push(async move { put(store, tract, off, &d).await });
        }
        for w in futures::future::join_all(writes).await {
            w?;
        }
    }
    let j = r.store.backup_journal().cloned().ok_or(StoreError::Failed)?;
    let journaled = r.store.stats.journaled_writes.load(Ordering::Relaxed);
    assert!(
        journaled > 100 && journaled < (ROUNDS * 8) as u64,
        "{journaled} of {} writes journaled",
        ROUNDS * 8
    );
    assert!(j.used() <= j.ring_len());
    let mut coin = 0x2545_f491_4f6c_dd1du64;
    let (r, replayed) = restart(r, move || {
        coin ^= coin << 13;
        coin ^= coin >> 7;
        coin ^= coin << 17;
        coin.is_multiple_of(2)
    })
    .await?;
    assert!(replayed.records > 100, "{replayed:?}");
    for t in 0..TRACTS {
        assert!(get(&r.store, t).await? == model[t as usize], "tract {t} differs after the power loss");
    }
    Ok(())
}

/// Without replay (what a journal that is never read back amounts to),
/// the same crashes lose acknowledged writes: the test above can fail.
#[tokio::test]
async fn without_replay_a_power_loss_loses_journaled_writes() -> Result<(), StoreError> {
    let r = rig(16 << 10).await?;
    put(&r.store, 0, 0, &pattern(1, 4096)).await?;
    let Rig { dir: _dir, data, store, .. } = r;
    drop(store);
    data.lose_power(|| false).await?;
    let s = Store::open(data.inner.clone()).await?;
    assert_ne!(&s.read(BlobId(1), 1, TractNo(0), 0, 4096).await?.0[..], &pattern(1, 4096)[..]);
    Ok(())
}
