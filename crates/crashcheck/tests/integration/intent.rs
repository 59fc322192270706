//! The write-intent log of replicated volumes (design 0005) on the
//! in-memory blob: what it marks, when it clears, what an open after a
//! crash reconciles, and a failed write made good before it is read.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_core::reconcile::Reconciled;
use blizzard_crashcheck::mem::MemBlob;
use blizzard_crashcheck::run::{runtime, trial_env as env};
use blizzard_volume::intent::{BITMAP_OFFSET, CLEAR_AFTER, PAGE};
use blizzard_volume::io::{BlobIo, IoError};
use blizzard_volume::{CommitMode, ExposureLimits, FlushPolicy, PlantedBug, Volume, VolumeSpec};

const TRACT: u32 = 16 << 10;
const BS: u64 = 4096;
/// Segment of 4 tracts: blocks 0..3 go to tracts 1..4, block 4 to tract 1
/// again, and so on.
const SEGMENT: u32 = 4;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn spec(mode: CommitMode) -> VolumeSpec {
    VolumeSpec {
        name: "intent".into(),
        size_bytes: 1 << 20,
        mode,
        flush: FlushPolicy::Durable,
        replication: 3,
        block_size: Some(BS as u32),
        segment_tracts: SEGMENT,
        exposure: ExposureLimits::default(),
        placement: Default::default(),
    }
}

fn mem(seed: u64) -> MemBlob {
    MemBlob::new(env(seed), seed, TRACT, 3, (50, 500))
}

fn io(m: &MemBlob) -> Arc<dyn BlobIo> {
    Arc::new(m.clone())
}

/// The tracts set in replica `r`'s first bitmap page.
fn bits(m: &MemBlob, r: usize) -> Vec<u64> {
    let page = m.peek(r, 0, BITMAP_OFFSET, PAGE);
    (0..PAGE as u64 * 8).filter(|t| page[(t / 8) as usize] >> (t % 8) & 1 == 1).collect()
}

fn block(id: u8) -> Bytes {
    Bytes::from(vec![id; BS as usize])
}

/// A write marks its tract on every replica before it lands; the mark
/// goes once the tract has been idle for `CLEAR_AFTER`; a clean close
/// leaves nothing for the next open to reconcile.
#[test]
fn tracts_are_marked_while_written_and_cleared_when_idle() -> TestResult {
    for mode in [CommitMode::WriteThrough, CommitMode::FastAck] {
        let m = mem(1);
        runtime().block_on(async {
            let vol = Volume::format(env(2), io(&m), &spec(mode)).await?;
            // Blocks 0 and 5: tracts 1 and 2.
            vol.write(0, block(1), false).await?;
            vol.write(5 * BS, block(2), false).await?;
            vol.flush_durable().await?;
            for r in 0..3 {
                assert_eq!(bits(&m, r), vec![1, 2], "{mode:?}: replica {r} marks the written tracts");
            }
            env(0).sleep(CLEAR_AFTER + Duration::from_secs(2)).await;
            for r in 0..3 {
                assert_eq!(bits(&m, r), Vec::<u64>::new(), "{mode:?}: idle tracts are unmarked");
            }
            assert_eq!(vol.intent().map(|i| i.marked()), Some(0));
            vol.write(2 * BS, block(3), false).await?;
            vol.close().await?;
            assert_eq!(bits(&m, 0), Vec::<u64>::new(), "{mode:?}: a clean close clears every bit");
            let again = Volume::open(env(3), io(&m), PlantedBug::None).await?;
            assert_eq!(
                again.recovery().dirty_tracts,
                0,
                "{mode:?}: nothing to reconcile after a clean close"
            );
            assert_eq!(again.recovery().writer, 2, "format's open claimed 1");
            Ok::<_, Box<dyn std::error::Error>>(())
        })?;
    }
    Ok(())
}

/// After a crash only the tracts written in the last `CLEAR_AFTER` are
/// looked at, however many were written before.
#[test]
fn recovery_looks_only_at_recently_written_tracts() -> TestResult {
    let m = mem(4);
    runtime().block_on(async {
        let vol = Volume::format(env(5), io(&m), &spec(CommitMode::WriteThrough)).await?;
        // Every tract of the volume, then a pause: all unmarked.
        for b in 0..256u64 {
            vol.write(b * BS, block(b as u8), false).await?;
        }
        env(0).sleep(CLEAR_AFTER + Duration::from_secs(2)).await;
        // Then one tract, and the process dies.
        vol.write(3 * BS, block(9), false).await?;
        drop(vol);
        let vol = Volume::open(env(6), io(&m), PlantedBug::None).await?;
        let r = vol.recovery();
        assert_eq!((r.dirty_tracts, r.full), (1, false), "{r:?}");
        assert_eq!(r.reconciled, Reconciled { tracts: 1, chunks_compared: 4, ..Reconciled::default() });
        Ok(())
    })
}

/// A write that reached one replica and failed leaves its tract suspect:
/// the next read makes every replica agree first, and the intent bit
/// stays until then.
#[test]
fn a_failed_write_is_reconciled_before_it_is_read() -> TestResult {
    let m = mem(7);
    runtime().block_on(async {
        let vol = Volume::format(env(8), io(&m), &spec(CommitMode::WriteThrough)).await?;
        vol.write(0, block(1), false).await?;
        drop(vol);
        // The volume's next data write reaches replica 0 only, then fails.
        let failing = Arc::new(FailingWrite { inner: m.clone(), armed: Mutex::new(true) });
        let vol = Volume::open(env(9), failing.clone(), PlantedBug::None).await?;
        assert!(vol.write(0, block(2), false).await.is_err(), "the write was made to fail");
        assert_ne!(m.peek(0, 1, 0, BS as u32), m.peek(1, 1, 0, BS as u32), "replicas differ now");
        assert_eq!(bits(&m, 1), vec![1], "the tract stays marked");
        assert!(vol.intent().is_some_and(|i| i.has_suspects()));
        let got = vol.read(0, BS).await?;
        assert_eq!(got, block(2), "replica 0 (the row's first) is the source");
        for r in 1..3 {
            assert_eq!(m.peek(r, 1, 0, BS as u32), m.peek(0, 1, 0, BS as u32), "replica {r} agrees");
        }
        assert!(vol.intent().is_some_and(|i| !i.has_suspects()));
        env(0).sleep(CLEAR_AFTER + Duration::from_secs(2)).await;
        assert_eq!(bits(&m, 0), Vec::<u64>::new(), "reconciled and idle: unmarked");
        Ok(())
    })
}

/// The planted bug that skips reconciliation leaves replicas that differ.
#[test]
fn skipping_reconciliation_leaves_replicas_apart() -> TestResult {
    let m = mem(10);
    runtime().block_on(async {
        let vol = Volume::format(env(11), io(&m), &spec(CommitMode::WriteThrough)).await?;
        vol.write(0, block(1), false).await?;
        drop(vol);
        // A write cut off by a crash: on replica 2 only.
        m.poke(2, 1, 0, &block(7));
        let vol = Volume::open(env(12), io(&m), PlantedBug::SkipReconcile).await?;
        assert_eq!(vol.recovery().dirty_tracts, 1);
        assert_ne!(m.peek(2, 1, 0, BS as u32), m.peek(0, 1, 0, BS as u32));
        drop(vol);
        let vol = Volume::open(env(13), io(&m), PlantedBug::None).await?;
        assert_eq!(vol.recovery().dirty_tracts, 0, "the bug also cleared the bitmap");
        // The same cut-off write without the bug: reconciled.
        vol.write(0, block(1), false).await?;
        drop(vol);
        m.poke(2, 1, 0, &block(7));
        let vol = Volume::open(env(14), io(&m), PlantedBug::None).await?;
        assert_eq!(vol.recovery().reconciled.chunk_repairs, 1);
        assert_eq!(m.peek(2, 1, 0, BS as u32), m.peek(0, 1, 0, BS as u32));
        Ok(())
    })
}

/// A store whose first data write (a write outside tract 0) reaches only
/// replica 0, then fails.
struct FailingWrite {
    inner: MemBlob,
    armed: Mutex<bool>,
}

impl BlobIo for FailingWrite {
    fn tract_size(&self) -> u32 {
        self.inner.tract_size()
    }
    fn replication(&self) -> u8 {
        self.inner.replication()
    }
    fn size_tracts(&self) -> u64 {
        self.inner.size_tracts()
    }
    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        self.inner.extend_to(tracts)
    }
    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        let fail =
            tract > 0 && self.armed.lock().map(|mut a| std::mem::replace(&mut *a, false)).unwrap_or(false);
        if fail {
            self.inner.poke(0, tract, offset, &data);
            return async { Err(IoError::Other("injected failure after one replica".into())) }.boxed();
        }
        self.inner.write(tract, offset, data)
    }
    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        self.inner.read(tract, offset, len)
    }
    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        self.inner.read_replicas(tract, offset, len)
    }
    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        self.inner.trim(tract, offset, len)
    }
    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        self.inner.reconcile(tract)
    }
}
