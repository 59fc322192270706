//! A crash at every step of a rollback (design 0011): the rollback's first
//! `held` blob writes complete and the rest are caught in flight, landing
//! on each replica as the fate says. The volume then opens as it was or
//! as the snapshot, never a mix, every replica reading alike, and stays
//! so across a second open; the snapshot reads as it did throughout.
//! Write-through through the serving handle, and a log volume the way it
//! is rolled back, with nothing serving it (`Volume::rollback_closed`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use blizzard_crashcheck::mem::{Landing, MemBlob};
use blizzard_crashcheck::run::{runtime, trial_env as env};
use blizzard_volume::io::BlobIo;
use blizzard_volume::{CommitMode, ExposureLimits, FlushPolicy, PlantedBug, Volume, VolumeSpec};

const SIZE: u64 = 1 << 20;
const TRACT: u32 = 16 << 10;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn spec(mode: CommitMode) -> VolumeSpec {
    VolumeSpec {
        name: "rb".into(),
        size_bytes: SIZE,
        mode,
        flush: FlushPolicy::Durable,
        replication: 2,
        block_size: Some(4096),
        segment_tracts: 4,
        exposure: ExposureLimits::default(),
        placement: Default::default(),
    }
}

/// Bytes `seed` writes at `offset`: distinct per seed and place.
fn pattern(seed: u8, offset: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_mul(31).wrapping_add(((offset as usize + i) / 512) as u8)).collect()
}

#[derive(Clone, Copy, Debug)]
enum Fate {
    Nowhere,
    Everywhere,
    FirstReplicaOnly,
}

impl Fate {
    fn landing(self, replica: usize) -> Landing {
        match (self, replica == 0) {
            (Fate::Nowhere, _) | (Fate::FirstReplicaOnly, false) => Landing::Nothing,
            (Fate::Everywhere, _) | (Fate::FirstReplicaOnly, true) => Landing::Whole,
        }
    }
}

/// Returns whether the rollback finished before the crash.
fn crash_during_rollback(
    mode: CommitMode,
    held: u64,
    fate: Fate,
) -> Result<bool, Box<dyn std::error::Error>> {
    let what = format!("{mode:?}, crash after {held} blob ops, {fate:?}");
    let m = MemBlob::new(env(7 + held), 7 + held, TRACT, 2, (50, 500));
    let io = || -> Arc<dyn BlobIo> { Arc::new(m.clone()) };
    let rt = runtime();
    let (before, at_snapshot, finished) = rt.block_on(async {
        let v = Volume::format(env(1), io(), &spec(mode)).await?;
        drop(v);
        let v = Volume::open(env(2), io(), PlantedBug::None).await?;
        let mut img = pattern(1, 0, SIZE as usize);
        v.write(0, Bytes::from(img.clone()), false).await?;
        v.snapshot("s").await?;
        let at_snapshot = img.clone();
        for (i, off) in [0u64, 200 << 10, 700 << 10].into_iter().enumerate() {
            let b = pattern(2 + i as u8, off, 96 << 10);
            v.write(off, Bytes::from(b.clone()), false).await?;
            img[off as usize..off as usize + b.len()].copy_from_slice(&b);
        }
        v.trim(500 << 10, 64 << 10).await?;
        img[500 << 10..564 << 10].fill(0);
        v.flush_durable().await?;
        m.hold_after(Some(held));
        let r = if mode == CommitMode::Log {
            drop(v);
            env(3).timeout(Duration::from_secs(60), Volume::rollback_closed(io(), "s")).await
        } else {
            env(3).timeout(Duration::from_secs(60), v.rollback("s")).await
        };
        let finished = match r {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => return Err(format!("{what}: rollback failed: {e}").into()),
            Err(_) => false,
        };
        Ok::<_, Box<dyn std::error::Error>>((img, at_snapshot, finished))
    })?;
    drop(rt);
    m.crash_each(|_, r| fate.landing(r));
    m.hold_after(None);
    let mut seen: Option<bool> = None;
    for round in 0..2u64 {
        let rt = runtime();
        rt.block_on(async {
            let v = Volume::open(env(100 + round), io(), PlantedBug::None).await?;
            let mut images = vec![v.read(0, SIZE).await?];
            for r in 0..2 {
                m.pin_reads(Some(r));
                images.push(v.read(0, SIZE).await?);
            }
            m.pin_reads(None);
            assert!(images.windows(2).all(|w| w[0] == w[1]), "{what}: replicas read differently");
            let rolled = if images[0][..] == at_snapshot[..] {
                true
            } else if images[0][..] == before[..] {
                false
            } else {
                let i =
                    images[0].iter().zip(&before).zip(&at_snapshot).position(|((g, b), s)| g != b && g != s);
                panic!("{what}: the volume is neither as it was nor the snapshot (byte {i:?})");
            };
            if finished {
                assert!(rolled, "{what}: a finished rollback is undone");
            }
            if let Some(s) = seen {
                assert_eq!(s, rolled, "{what}: open {round} found the other state");
            }
            seen = Some(rolled);
            let snap = Volume::open_snapshot(env(200), io(), "s").await?;
            assert!(snap.read(0, SIZE).await?[..] == at_snapshot[..], "{what}: the snapshot changed");
            v.close().await?;
            Ok::<_, Box<dyn std::error::Error>>(())
        })?;
    }
    Ok(finished)
}

fn every_step(mode: CommitMode) -> TestResult {
    let mut held = 0;
    loop {
        let mut finished = false;
        for fate in [Fate::Nowhere, Fate::Everywhere, Fate::FirstReplicaOnly] {
            finished |= crash_during_rollback(mode, held, fate)?;
        }
        if finished {
            println!("{mode:?}: {held} crash points");
            return Ok(());
        }
        held += 1;
        assert!(held < 400, "{mode:?}: the rollback never finished");
    }
}

#[test]
fn write_through_rollback_is_the_old_volume_or_the_snapshot_after_any_crash() -> TestResult {
    every_step(CommitMode::WriteThrough)
}

#[test]
fn log_rollback_is_the_old_volume_or_the_snapshot_after_any_crash() -> TestResult {
    every_step(CommitMode::Log)
}
