use super::*;
use blizzard_core::crc::piece_crcs;
use blizzard_env::Env;

mod digest;

const TRACT: u32 = 64 << 10;

async fn fresh(dir: &tempfile::TempDir, disk_len: u64) -> Result<Store, StoreError> {
    let disk = Env::real().open_disk(&dir.path().join("disk"), Some(disk_len)).await?;
    Store::format(disk, TsId(7), TRACT, &blizzard_env::RealClock).await
}

async fn reopen(dir: &tempfile::TempDir) -> Result<Store, StoreError> {
    let disk = Env::real().open_disk(&dir.path().join("disk"), None).await?;
    Store::open(disk).await
}

/// A disk whose owner is killed part-way through a write batch: after
/// `armed` is set, the next `write_at` applies only its first `keep`
/// pieces (in order, as the kernel would) and the rest never happen.
struct DyingDisk {
    inner: Arc<dyn Disk>,
    armed: std::sync::atomic::AtomicBool,
    keep: usize,
}

impl Disk for DyingDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(
        &self,
        offset: u64,
        len: usize,
    ) -> futures::future::BoxFuture<'static, std::io::Result<Bytes>> {
        self.inner.read_at(offset, len)
    }
    fn write_at(
        &self,
        writes: Vec<(u64, Bytes)>,
    ) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
        if self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let kept: Vec<_> = writes.into_iter().take(self.keep).collect();
            let inner = self.inner.clone();
            return Box::pin(async move {
                inner.write_at(kept).await?;
                inner.sync().await?;
                Err(std::io::Error::other("killed"))
            });
        }
        self.inner.write_at(writes)
    }
    fn sync(&self) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
        self.inner.sync()
    }
}

/// A process killed between the pieces of a write leaves every chunk
/// readable as its old or its new contents, never `Corrupt`: for
/// overwrites (whole and partial chunks) and for first writes, at every
/// cut point.
#[tokio::test]
async fn write_cut_off_part_way_reads_old_or_new() -> Result<(), StoreError> {
    let old = pattern(1, TRACT as usize);
    let new = pattern(2, TRACT as usize);
    // (offset, len) of the interrupted write: whole chunks, a partial
    // chunk, and a range that also covers never-written chunks.
    for (off, len) in [(0u32, 16384u32), (4100, 100), (12288, 8192 + 40000)] {
        for keep in 0..4 {
            let dir = tempfile::tempdir()?;
            let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
            let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
            let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
            // The old contents: the first 32 KiB written and durable.
            put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
            disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
            let piece = new.slice(off as usize..(off + len) as usize);
            assert!(put(&s, 1, 1, 3, off, &piece).await.is_err(), "the write was cut off");
            drop(s);
            drop(disk);
            let s = reopen(&dir).await?;
            let got = get(&s, 1, 1, 3, 0, TRACT).await?;
            let mut before = vec![0u8; TRACT as usize];
            before[..32768].copy_from_slice(&old[..32768]);
            let mut after = before.clone();
            after[off as usize..(off + len) as usize].copy_from_slice(&piece);
            for c in 0..(TRACT / CHUNK_SIZE) as usize {
                let r = c * CHUNK_SIZE as usize..(c + 1) * CHUNK_SIZE as usize;
                assert!(
                    got[r.clone()] == before[r.clone()] || got[r.clone()] == after[r.clone()],
                    "write [{off}, +{len}) cut after {keep} pieces: chunk {c} is neither old nor new"
                );
            }
        }
    }
    Ok(())
}

/// A write the disk fails part-way (ENOSPC on a full device, EIO) while
/// the server lives on: memory must still describe the disk. Every chunk
/// reads old or new at once (never `Corrupt`), the retried write
/// succeeds, and after a restart its tract is there: a fresh slot whose
/// first write failed was once kept in memory as if its slot entry were
/// stored, so the retry skipped the entry and the tract vanished on
/// restart. A trim or delete failing the same way leaves the tract
/// writable (a slot freed in memory before the disk once sent every
/// later write round a loop forever).
#[tokio::test]
async fn a_failed_write_leaves_memory_true_to_the_disk() -> Result<(), StoreError> {
    let old = pattern(1, TRACT as usize);
    let new = pattern(2, TRACT as usize);
    for (off, len) in [(0u32, 16384u32), (4100, 100), (12288, 8192 + 40000)] {
        for keep in 0..4 {
            let what = format!("write [{off}, +{len}) failing after {keep} pieces");
            let dir = tempfile::tempdir()?;
            let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
            let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
            let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
            put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
            let piece = new.slice(off as usize..(off + len) as usize);
            // An overwrite and a first write into a fresh slot, both failing.
            for tract in [3, 4] {
                disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
                assert!(put(&s, 1, 1, tract, off, &piece).await.is_err(), "{what}: not failed");
            }
            let mut before = vec![0u8; TRACT as usize];
            before[..32768].copy_from_slice(&old[..32768]);
            let mut after = before.clone();
            after[off as usize..(off + len) as usize].copy_from_slice(&piece);
            let got = get(&s, 1, 1, 3, 0, TRACT).await.map_err(|e| {
                StoreError::Io(std::io::Error::other(format!("{what}: read after the failure: {e}")))
            })?;
            for c in 0..(TRACT / CHUNK_SIZE) as usize {
                let r = c * CHUNK_SIZE as usize..(c + 1) * CHUNK_SIZE as usize;
                assert!(
                    got[r.clone()] == before[r.clone()] || got[r.clone()] == after[r.clone()],
                    "{what}: chunk {c} is neither old nor new"
                );
            }
            // The retries succeed, and a restart finds both tracts whole.
            for tract in [3, 4] {
                put(&s, 1, 1, tract, off, &piece).await?;
            }
            drop(s);
            drop(disk);
            let s = reopen(&dir).await?;
            assert!(get(&s, 1, 1, 3, 0, TRACT).await? == after, "{what}: tract 3 is not the retried write");
            let mut fresh = vec![0u8; TRACT as usize];
            fresh[off as usize..(off + len) as usize].copy_from_slice(&piece);
            assert!(get(&s, 1, 1, 4, 0, TRACT).await? == fresh, "{what}: tract 4 lost");
        }
    }
    // A failed trim of a whole tract and a failed delete: the tract
    // stays, still writable.
    let dir = tempfile::tempdir()?;
    let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 0 });
    let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
    put(&s, 1, 1, 0, 0, &old).await?;
    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(s.trim(BlobId(1), 1, TractNo(0), 0, TRACT, ALWAYS).await.is_err());
    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(s.delete(BlobId(1), 1, TractNo(0)).await.is_err());
    assert!(get(&s, 1, 1, 0, 0, TRACT).await? == old, "the failed trim or delete changed the tract");
    let written = Env::real().timeout(std::time::Duration::from_secs(10), put(&s, 1, 1, 0, 0, &new)).await;
    assert!(matches!(written, Ok(Ok(()))), "a write after the failed trim and delete: {written:?}");
    assert!(get(&s, 1, 1, 0, 0, TRACT).await? == new, "the write after the failed trim and delete");
    Ok(())
}

/// A disk that runs out of space: once armed, the next `write_at`
/// stores its first `keep` pieces whole and the first `cut` bytes of
/// the next one, then fails with ENOSPC (the server lives on). A piece
/// below `whole_below` (a slot entry: one sector) is never cut. While
/// `reads_fail`, every read fails.
struct FullDisk {
    inner: Arc<dyn Disk>,
    armed: std::sync::atomic::AtomicBool,
    keep: usize,
    cut: usize,
    whole_below: AtomicU64,
    reads_fail: std::sync::atomic::AtomicBool,
}

impl FullDisk {
    fn new(inner: Arc<dyn Disk>, keep: usize, cut: usize) -> Arc<FullDisk> {
        Arc::new(FullDisk {
            inner,
            armed: false.into(),
            keep,
            cut,
            whole_below: AtomicU64::new(0),
            reads_fail: false.into(),
        })
    }
    fn arm(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Disk for FullDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(
        &self,
        offset: u64,
        len: usize,
    ) -> futures::future::BoxFuture<'static, std::io::Result<Bytes>> {
        if self.reads_fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Box::pin(async { Err(std::io::Error::other("injected read error")) });
        }
        self.inner.read_at(offset, len)
    }
    fn write_at(
        &self,
        writes: Vec<(u64, Bytes)>,
    ) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
        if !self.armed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return self.inner.write_at(writes);
        }
        let mut kept: Vec<(u64, Bytes)> = writes.iter().take(self.keep).cloned().collect();
        if let Some((at, d)) = writes.get(self.keep) {
            if self.cut > 0 && *at >= self.whole_below.load(Ordering::SeqCst) {
                kept.push((*at, d.slice(..self.cut.min(d.len()))));
            }
        }
        let inner = self.inner.clone();
        Box::pin(async move {
            inner.write_at(kept).await?;
            Err(std::io::Error::from_raw_os_error(28))
        })
    }
    fn sync(&self) -> futures::future::BoxFuture<'static, std::io::Result<()>> {
        self.inner.sync()
    }
}

/// What the store says about tracts 3 and 4 of blob 1 at incarnations
/// 1 and 2: the tracts held, and the digests once every chunk was read
/// (a restart trusts a first write's entry without reading its bytes
/// until a read finds them corrupt; memory after a failed write may
/// know better).
async fn view(s: &Store) -> Result<Vec<String>, StoreError> {
    let mut v = vec![format!("tracts {:?}", s.tracts())];
    for tract in [3, 4] {
        for inc in [1, 2] {
            for c in 0..TRACT / CHUNK_SIZE {
                let _ = s.read(BlobId(1), inc, TractNo(tract), c * CHUNK_SIZE, CHUNK_SIZE).await;
            }
            v.push(format!("tract {tract} inc {inc}: {:?}", s.digest(BlobId(1), inc, TractNo(tract)).await?));
        }
    }
    Ok(v)
}

/// A write or trim the disk fails part-way (ENOSPC after any prefix of
/// its pieces, the last one perhaps cut short) while the server lives
/// on leaves memory saying what a restart reads: the digests before and
/// after a reopen are the same, at every cut. Once, a first-written
/// chunk whose data and entry were both stored stayed unwritten in
/// memory: the replicas were reconciled on that view, and a restart
/// brought the unacknowledged write back on this replica alone.
#[tokio::test]
async fn a_failed_change_leaves_memory_as_a_restart_reads_it() -> Result<(), StoreError> {
    let old = pattern(1, TRACT as usize);
    let new = pattern(2, TRACT as usize);
    enum Change {
        /// (tract, incarnation, row version, offset, len)
        Write(i64, u64, u64, u32, u32),
        /// (offset, len) of tract 3
        Trim(u32, u32),
    }
    let changes = [
        // Overwrites: whole chunks, part of one, and overwritten and
        // first-written chunks at once.
        Change::Write(3, 1, 1, 0, 16384),
        Change::Write(3, 1, 1, 4100, 100),
        Change::Write(3, 1, 1, 12288, 8192 + 40000),
        // First writes into the tract's slot: whole chunks, part of one.
        Change::Write(3, 1, 1, 40960, 8192),
        Change::Write(3, 1, 1, 40960 + 100, 50),
        // A first write that changes the slot entry (a newer row version).
        Change::Write(3, 1, 2, 40960, 4096),
        // A fresh slot, and a new incarnation of the blob.
        Change::Write(4, 1, 1, 0, 8192),
        Change::Write(3, 2, 1, 0, 8192),
        // Trims: whole chunks, partial ones, and the whole tract (the
        // slot entry freed last).
        Change::Trim(4096, 8192),
        Change::Trim(100, 5000),
        Change::Trim(0, TRACT),
    ];
    for (n, change) in changes.iter().enumerate() {
        for keep in 0..5 {
            for cut in [0, 16, 4096 + 512] {
                let what = format!("change {n} failing after {keep} pieces and {cut} bytes");
                let dir = tempfile::tempdir()?;
                let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
                let disk = FullDisk::new(real, keep, cut);
                let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
                disk.whole_below.store(s.layout().chunk_table_offset, Ordering::SeqCst);
                put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
                disk.arm();
                let r = match *change {
                    Change::Write(tract, inc, version, off, len) => {
                        let d = new.slice(off as usize..(off + len) as usize);
                        let crcs = piece_crcs(off, &d);
                        s.write(BlobId(1), inc, TractNo(tract), version, off, d, &crcs).await
                    }
                    Change::Trim(off, len) => s.trim(BlobId(1), 1, TractNo(3), off, len, ALWAYS).await,
                };
                assert!(r.is_err(), "{what}: not failed");
                let live = view(&s).await?;
                drop(s);
                drop(disk);
                let s = reopen(&dir).await?;
                assert_eq!(live, view(&s).await?, "{what}: memory before the restart, the disk after");
            }
        }
    }
    Ok(())
}

/// A failed write whose pieces cannot be read back leaves memory unable
/// to say what the disk holds: the store refuses digests (and changes)
/// from then on rather than answer from a view a restart could
/// contradict.
#[tokio::test]
async fn a_failed_write_that_cannot_be_read_back_distrusts_the_disk() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    // The first write's data and its entry are stored, then it fails.
    let disk = FullDisk::new(real, 2, 0);
    let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
    put(&s, 1, 1, 3, 0, &pattern(1, 8192)).await?;
    disk.arm();
    disk.reads_fail.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(put(&s, 1, 1, 3, 40960, &pattern(2, 8192)).await.is_err());
    disk.reads_fail.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(matches!(s.digest(BlobId(1), 1, TractNo(3)).await, Err(StoreError::Failed)));
    assert!(matches!(put(&s, 1, 1, 3, 0, &pattern(3, 4096)).await, Err(StoreError::Failed)));
    assert!(matches!(s.sync().await, Err(StoreError::Failed)));
    // A restart reads the disk afresh: the first write's data and entry
    // are both there.
    drop(s);
    drop(disk);
    let s = reopen(&dir).await?;
    assert_eq!(get(&s, 1, 1, 3, 40960, 8192).await?, pattern(2, 8192));
    Ok(())
}

/// A partial overwrite torn by power loss (its entry stored, its merged
/// chunk only in part: the range holds a mix of old and new bytes) leaves
/// the chunk `Corrupt`. The writer, whose sync failed, writes the same
/// range again: merged into the torn bytes it gives exactly the chunk
/// the entry names, so it is accepted and the chunk reads whole again.
/// Once, it was refused for good (nothing to merge with), and with one
/// replica nothing could heal the chunk: a fast-ack volume retried an
/// acknowledged write forever. Another write into the torn chunk is
/// still refused.
#[tokio::test]
async fn a_torn_partial_write_is_completed_by_the_same_write_again() -> Result<(), StoreError> {
    let old = pattern(1, 4 * CHUNK_SIZE as usize);
    // Bytes 400..700 of chunk 1: across its first two sectors.
    let off = CHUNK_SIZE + 400;
    let w = pattern(2, 300);
    let dir = tempfile::tempdir()?;
    let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    // The overwrite's pieces: its chunk entry, then the merged chunk, of
    // which only the first sector lands.
    let disk = FullDisk::new(real, 1, 512);
    let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
    put(&s, 1, 1, 3, 0, &old).await?;
    disk.arm();
    assert!(put(&s, 1, 1, 3, off, &w).await.is_err(), "the write was cut off");
    drop(s);
    drop(disk);
    let s = reopen(&dir).await?;
    assert!(
        matches!(get(&s, 1, 1, 3, CHUNK_SIZE, CHUNK_SIZE).await, Err(StoreError::Corrupt { chunk: 1, .. })),
        "the torn chunk reads as corrupt"
    );
    // Other writes into the torn chunk cannot be merged.
    for (o, d) in [(off, pattern(3, 300)), (off, pattern(2, 299)), (CHUNK_SIZE + 1000, pattern(4, 10))] {
        let r = put(&s, 1, 1, 3, o, &d).await;
        assert!(matches!(r, Err(StoreError::Corrupt { chunk: 1, .. })), "{o} +{}: {r:?}", d.len());
    }
    // The cut-off write again completes it.
    put(&s, 1, 1, 3, off, &w).await?;
    let mut want = old.to_vec();
    want[off as usize..off as usize + w.len()].copy_from_slice(&w);
    assert_eq!(get(&s, 1, 1, 3, 0, 4 * CHUNK_SIZE).await?, want);
    let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
    assert_eq!(d[1], ChunkState::Data(chunk_dig(&want, 1)));
    // And the chunk takes other writes again, and all of it survives a
    // restart.
    put(&s, 1, 1, 3, CHUNK_SIZE + 1000, &pattern(4, 10)).await?;
    want[CHUNK_SIZE as usize + 1000..CHUNK_SIZE as usize + 1010].copy_from_slice(&pattern(4, 10));
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(get(&s, 1, 1, 3, 0, 4 * CHUNK_SIZE).await?, want);
    Ok(())
}

fn pattern(seed: u8, len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>())
}

async fn put(s: &Store, blob: u128, inc: u64, tract: i64, off: u32, data: &Bytes) -> Result<(), StoreError> {
    s.write(BlobId(blob), inc, TractNo(tract), 1, off, data.clone(), &piece_crcs(off, data)).await
}

async fn get(s: &Store, blob: u128, inc: u64, tract: i64, off: u32, len: u32) -> Result<Bytes, StoreError> {
    let (b, crcs) = s.read(BlobId(blob), inc, TractNo(tract), off, len).await?;
    // What the store returns must verify end to end.
    assert_eq!(blizzard_core::crc::first_bad_piece(off, &b, &crcs), None);
    Ok(b)
}

/// Aligned, unaligned and overlapping writes read back byte-exact, with
/// unwritten ranges as zeros, and all of it survives a reopen.
#[tokio::test]
async fn writes_read_back_and_survive_reopen() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    let mut model = vec![0u8; TRACT as usize];
    for (i, (off, len)) in
        [(0u32, 4096usize), (5000, 10000), (4095, 2), (60000, 5536), (100, 1)].iter().enumerate()
    {
        let d = pattern(i as u8, *len);
        put(&s, 1, 1, 0, *off, &d).await?;
        model[*off as usize..*off as usize + len].copy_from_slice(&d);
    }
    assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
    assert_eq!(&get(&s, 1, 1, 0, 4000, 3000).await?[..], &model[4000..7000]);
    assert_eq!(&get(&s, 1, 1, 5, 0, 100).await?[..], &[0u8; 100][..]);
    assert!(s.syncs() >= 5);
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
    assert_eq!(s.usage().1, 1);
    Ok(())
}

/// A write refused by its fence (the client has reconnected since)
/// stores nothing and takes no slot, and the next write of the tract is
/// stored whole: it survives a reopen.
#[tokio::test]
async fn a_superseded_write_stores_nothing() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    let d = pattern(7, 4096);
    let crcs = blizzard_core::crc::piece_crcs(0, &d);
    let never: Current<'_> = &|| false;
    let w = TractWrite {
        blob: BlobId(1),
        incarnation: 1,
        tract: TractNo(0),
        version: 1,
        offset: 0,
        data: d.clone(),
        crcs: &crcs,
        durability: Durability::Synced,
    };
    let r = s.write_with(w, never).await;
    assert!(matches!(r, Err(StoreError::Superseded)), "{r:?}");
    assert_eq!(s.usage().1, 0, "a refused write must not keep a slot");
    assert!(s.tracts().is_empty());
    put(&s, 1, 1, 0, 0, &d).await?;
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(&get(&s, 1, 1, 0, 0, 4096).await?[..], &d[..]);
    Ok(())
}

/// A write whose data does not match its CRCs is refused and stores nothing.
#[tokio::test]
async fn bad_crc_is_refused() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    let d = pattern(1, 8192);
    let mut crcs = piece_crcs(0, &d);
    crcs[1] ^= 1;
    let r = s.write(BlobId(1), 1, TractNo(0), 1, 0, d, &crcs).await;
    assert!(matches!(r, Err(StoreError::BadCrc(1))));
    assert_eq!(s.usage().1, 0);
    assert!(matches!(
        s.write(BlobId(1), 1, TractNo(0), 1, TRACT - 10, pattern(0, 20), &[0, 0]).await,
        Err(StoreError::OutOfRange { .. })
    ));
    Ok(())
}

/// A byte flipped on disk is reported as Corrupt, never returned.
#[tokio::test]
async fn flipped_byte_is_detected() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    put(&s, 1, 1, 3, 0, &pattern(9, TRACT as usize)).await?;
    let at = s.data_location(BlobId(1), TractNo(3)).ok_or(StoreError::Failed)? + 12345;
    drop(s);
    // Damage the byte behind the store's back, through a second handle.
    let raw = Env::real().open_disk(&dir.path().join("disk"), None).await?;
    let b = raw.read_at(at, 1).await?;
    raw.write_at(vec![(at, Bytes::from(vec![b[0] ^ 0x04]))]).await?;
    raw.sync().await?;
    drop(raw); // one owner per disk (flock)
    let s = reopen(&dir).await?;
    assert!(matches!(get(&s, 1, 1, 3, 0, TRACT).await, Err(StoreError::Corrupt { chunk: 3, .. })));
    // Chunks not touched by the flip still read.
    assert_eq!(get(&s, 1, 1, 3, 0, 4096).await?, pattern(9, TRACT as usize).slice(0..4096));
    // A partial write into the damaged chunk cannot merge with it.
    assert!(matches!(put(&s, 1, 1, 3, 12300, &pattern(1, 10)).await, Err(StoreError::Corrupt { .. })));
    // A whole-chunk overwrite repairs it.
    put(&s, 1, 1, 3, 12288, &pattern(2, 4096)).await?;
    assert_eq!(get(&s, 1, 1, 3, 12288, 4096).await?, pattern(2, 4096));
    Ok(())
}

/// When every slot is taken a new tract gets DiskFull, and everything
/// already written is intact; freeing a slot makes room again, and the
/// reused slot shows none of its previous tenant.
#[tokio::test]
async fn full_disk_and_slot_reuse() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 4 << 20).await?;
    let slots = s.usage().0 as i64;
    assert!(slots > 2);
    for t in 0..slots {
        put(&s, 1, 1, t, 0, &pattern(t as u8, 8192)).await?;
    }
    assert!(matches!(put(&s, 1, 1, slots, 0, &pattern(0, 10)).await, Err(StoreError::DiskFull(_))));
    for t in 0..slots {
        assert_eq!(get(&s, 1, 1, t, 0, 8192).await?, pattern(t as u8, 8192));
    }
    assert!(s.delete(BlobId(1), 1, TractNo(0)).await?);
    assert!(!s.delete(BlobId(1), 1, TractNo(0)).await?);
    put(&s, 2, 1, 0, 8192, &pattern(5, 100)).await?;
    // The new tenant's first chunks were the old tenant's: they must read as zeros.
    assert_eq!(&get(&s, 2, 1, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(&get(&s, 2, 1, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
    assert_eq!(get(&s, 2, 1, 0, 8192, 100).await?, pattern(5, 100));
    assert_eq!(get(&s, 1, 1, 1, 0, 8192).await?, pattern(1, 8192));
    Ok(())
}

/// Trimmed ranges read as zeros (whole chunks and partial ones), the
/// rest of the tract is untouched, and a fully trimmed tract gives its
/// slot back; all of it survives a reopen.
#[tokio::test]
async fn trim_unmaps_and_frees() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    let d = pattern(3, TRACT as usize);
    put(&s, 1, 1, 0, 0, &d).await?;
    s.trim(BlobId(1), 1, TractNo(0), 1000, 10000, ALWAYS).await?;
    let mut model = d.to_vec();
    model[1000..11000].fill(0);
    assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
    assert_eq!(s.usage().1, 1);
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(&get(&s, 1, 1, 0, 0, TRACT).await?[..], &model[..]);
    s.trim(BlobId(1), 1, TractNo(0), 0, TRACT, ALWAYS).await?;
    assert_eq!(s.usage().1, 0);
    assert!(get(&s, 1, 1, 0, 0, TRACT).await?.iter().all(|&b| b == 0));
    // Trimming what was never written is a no-op, not an error.
    s.trim(BlobId(9), 1, TractNo(4), 0, 100, ALWAYS).await?;
    Ok(())
}

/// A tract written by an older incarnation of a blob id is invisible to
/// a newer one, and a write by the newer one voids the old data.
#[tokio::test]
async fn incarnations_do_not_leak() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    put(&s, 1, 1, 0, 0, &pattern(1, 8192)).await?;
    assert_eq!(&get(&s, 1, 2, 0, 0, 8192).await?[..], &[0u8; 8192][..]);
    put(&s, 1, 2, 0, 4096, &pattern(2, 10)).await?;
    assert_eq!(&get(&s, 1, 2, 0, 0, 4096).await?[..], &[0u8; 4096][..]);
    assert_eq!(&get(&s, 1, 1, 0, 0, 4096).await?[..], &[0u8; 4096][..]);
    Ok(())
}

/// The positions record survives reopen and the newer of the two slots wins.
#[tokio::test]
async fn assignment_round_trip() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    assert_eq!(s.assignment().await, None);
    s.save_assignment(b"one").await?;
    s.save_assignment(b"two").await?;
    s.save_assignment(b"three").await?;
    drop(s);
    let s = reopen(&dir).await?;
    assert_eq!(s.assignment().await.as_deref(), Some(&b"three"[..]));
    Ok(())
}

/// A little deterministic generator for the journal tests' workloads.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Many more changes than the journal's ring holds (64 KiB here: about a
/// thousand 4 KiB writes): the ring wraps over and over, checkpoints copy
/// the entries into the chunk table, and after any number of reopens
/// every tract reads exactly as a model of the writes and trims says.
#[tokio::test]
async fn the_journal_wraps_and_every_entry_survives_reopen() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let mut s = fresh(&dir, 16 << 20).await?;
    let (_, ring) = s.journal_usage();
    assert_eq!(ring, 64 << 10, "the test disk's ring");
    let tracts = 6u32;
    let mut model = vec![vec![0u8; TRACT as usize]; tracts as usize];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut checkpoints = 0;
    for round in 0..5 {
        for i in 0..1500u32 {
            let t = (next(&mut x) % tracts as u64) as usize;
            let chunk = (next(&mut x) % (TRACT / CHUNK_SIZE) as u64) as u32;
            if next(&mut x).is_multiple_of(16) {
                // Trim a chunk and a bit, partial at the end.
                let (off, len) = (chunk * CHUNK_SIZE, (CHUNK_SIZE + 100).min(TRACT - chunk * CHUNK_SIZE));
                s.trim(BlobId(1), 1, TractNo(t as i64), off, len, ALWAYS).await?;
                model[t][off as usize..(off + len) as usize].fill(0);
            } else {
                let d = pattern((round * 7 + i) as u8, CHUNK_SIZE as usize);
                put(&s, 1, 1, t as i64, chunk * CHUNK_SIZE, &d).await?;
                model[t][(chunk * CHUNK_SIZE) as usize..((chunk + 1) * CHUNK_SIZE) as usize]
                    .copy_from_slice(&d);
            }
        }
        checkpoints += s.journal_checkpoints();
        let (used, _) = s.journal_usage();
        assert!(used < ring, "the ring never overruns its head");
        drop(s);
        s = reopen(&dir).await?;
        for (t, want) in model.iter().enumerate() {
            if want.iter().all(|b| *b == 0) {
                continue;
            }
            assert_eq!(
                &get(&s, 1, 1, t as i64, 0, TRACT).await?[..],
                &want[..],
                "tract {t} after round {round}"
            );
        }
    }
    assert!(checkpoints >= 5, "the ring wrapped: {checkpoints} checkpoints");
    Ok(())
}

/// A process killed in the middle of a checkpoint (after any number of
/// its table pieces, or between the table and the head) loses nothing:
/// the old head still points at every record the table may lack.
#[tokio::test]
async fn a_checkpoint_cut_off_anywhere_loses_nothing() -> Result<(), StoreError> {
    for keep in [0usize, 1, 2, 100] {
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        let mut want = Vec::new();
        for t in 0..4i64 {
            let d = pattern(t as u8 + 40, TRACT as usize);
            put(&s, 1, 1, t, 0, &d).await?;
            // An overwrite of a part, so the table holds previous CRCs too.
            let o = pattern(t as u8 + 80, 3 * CHUNK_SIZE as usize);
            put(&s, 1, 1, t, CHUNK_SIZE, &o).await?;
            let mut w = d.to_vec();
            w[CHUNK_SIZE as usize..4 * CHUNK_SIZE as usize].copy_from_slice(&o);
            want.push(w);
        }
        // The checkpoint's first write_at is its table pieces (`keep` of
        // them land); with all of them written, the next is the head.
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(s.checkpoint().await.is_err() || keep == 100, "cut after {keep} pieces");
        if keep == 100 {
            // The table went down whole: now cut the head's write.
            put(&s, 1, 1, 0, 0, &pattern(1, 100)).await?;
            want[0][..100].copy_from_slice(&pattern(1, 100));
            disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
            let _ = s.checkpoint().await;
        }
        drop(s);
        drop(disk);
        let s = reopen(&dir).await?;
        for (t, w) in want.iter().enumerate() {
            assert_eq!(&get(&s, 1, 1, t as i64, 0, TRACT).await?[..], &w[..], "tract {t}, cut after {keep}");
        }
    }
    Ok(())
}

/// Writers far more numerous than the ring has room for, all at once on
/// a few tracts: changes wait for credit, checkpoints run inline from
/// the writers that find the ring full, and nothing deadlocks (a
/// checkpoint needs slot locks; a writer waiting for room must hold
/// none). Every write lands.
#[tokio::test]
async fn concurrent_writers_on_a_full_ring_all_land() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = Arc::new(fresh(&dir, 16 << 20).await?);
    let mut tasks = Vec::new();
    for w in 0..64u32 {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..60u32 {
                let t = ((w + i) % 3) as i64;
                let chunk = (w * 7 + i) % (TRACT / CHUNK_SIZE);
                // Whole tracts now and then: records of 16 entries.
                if i % 10 == 0 {
                    put(&s, 2, 1, 10 + w as i64 % 4, 0, &pattern(w as u8, TRACT as usize)).await?;
                }
                put(&s, 2, 1, t, chunk * CHUNK_SIZE, &pattern((w ^ i) as u8, CHUNK_SIZE as usize)).await?;
            }
            Ok::<_, StoreError>(())
        }));
    }
    for t in tasks {
        t.await.map_err(|e| StoreError::Io(std::io::Error::other(e)))??;
    }
    assert!(s.journal_checkpoints() > 0, "the ring filled and was checkpointed");
    let before: Vec<Bytes> = {
        let mut v = Vec::new();
        for t in 0..3 {
            v.push(get(&s, 2, 1, t, 0, TRACT).await?);
        }
        v
    };
    drop(s);
    let s = reopen(&dir).await?;
    for (t, b) in before.iter().enumerate() {
        assert_eq!(&get(&s, 2, 1, t as i64, 0, TRACT).await?, b, "tract {t} after reopen");
    }
    Ok(())
}

/// What a digest says of chunk `chunk` of `b` (`reconcile::chunk_digest`).
fn chunk_dig(b: &[u8], chunk: usize) -> u64 {
    chunk_digest(&b[chunk * CHUNK_SIZE as usize..(chunk + 1) * CHUNK_SIZE as usize])
}
