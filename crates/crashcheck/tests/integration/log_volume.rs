//! Log-mode volumes on the in-memory blob with fault injection: recovery
//! from blocks a crash left damaged, and growing a log volume, including a
//! crash at every step of the resize.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_crashcheck::mem::{Landing, MemBlob};
// The crash trials' seeded env and paused-clock runtime.
use blizzard_crashcheck::run::{runtime, trial_env as env};
use blizzard_volume::io::{BlobIo, IoError};
use blizzard_volume::log::record::{decode_block, Kind, HEADER_LEN};
use blizzard_volume::{CommitMode, ExposureLimits, FlushPolicy, PlantedBug, Volume, VolumeError, VolumeSpec};

const TRACT: u32 = 16 << 10;
const BS: u64 = 4096;
const STRIDE: u32 = BS as u32 + HEADER_LEN;
const MIB: u64 = 1 << 20;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn spec(size: u64) -> VolumeSpec {
    VolumeSpec {
        name: "log".into(),
        size_bytes: size,
        mode: CommitMode::Log,
        flush: FlushPolicy::Durable,
        replication: 2,
        block_size: Some(BS as u32),
        segment_tracts: 4,
        exposure: ExposureLimits::default(),
        placement: Default::default(),
    }
}

fn mem(seed: u64) -> MemBlob {
    MemBlob::new(env(seed), seed, TRACT, 2, (50, 500))
}

fn io(m: &MemBlob) -> Arc<dyn BlobIo> {
    Arc::new(m.clone())
}

/// What the volume must hold: a flat image, grown as the volume grows.
#[derive(Clone)]
struct Model(Vec<u8>);

impl Model {
    fn block(id: u64) -> Vec<u8> {
        let mut b = vec![(id % 250) as u8 + 1; BS as usize];
        b[..8].copy_from_slice(&id.to_le_bytes());
        b
    }

    fn write(&mut self, v: u64, id: u64) -> Bytes {
        let b = Self::block(id);
        let at = (v * BS) as usize;
        if self.0.len() < at + BS as usize {
            self.0.resize(at + BS as usize, 0);
        }
        self.0[at..at + BS as usize].copy_from_slice(&b);
        Bytes::from(b)
    }

    fn trim(&mut self, v: u64) {
        let at = (v * BS) as usize;
        self.0[at..at + BS as usize].fill(0);
    }

    /// The image of a volume of `size` bytes.
    fn image(&self, size: u64) -> Vec<u8> {
        let mut img = self.0.clone();
        img.resize(size as usize, 0);
        img
    }
}

/// Reads the whole volume and compares it with the model, naming the
/// first block that differs.
async fn verify(vol: &Volume, model: &Model, what: &str) -> TestResult {
    let img = vol.read(0, vol.size()).await?;
    let want = model.image(vol.size());
    if img[..] != want[..] {
        let b = (0..want.len()).find(|&i| img[i] != want[i]).unwrap_or(0) as u64 / BS;
        return Err(format!("{what}: block {b} differs from the model").into());
    }
    Ok(())
}

/// An intact record found in the log.
#[derive(Clone, Copy, Debug)]
struct Found {
    lsn: u64,
    seq: u64,
    kind: Kind,
    tract: u64,
    offset: u32,
}

/// The records of the newest checkpoint seq, in LSN order, found by
/// scanning every expanded-block position of every tract.
fn newest_records(m: &MemBlob) -> Vec<Found> {
    let mut all = Vec::new();
    for tract in 1..m.size_tracts() {
        for k in 0..TRACT / STRIDE {
            let offset = k * STRIDE;
            if let Some(h) = decode_block(&m.peek(0, tract, offset, STRIDE), BS as usize, true) {
                all.push(Found { lsn: h.lsn, seq: h.ckpt_seq, kind: h.kind, tract, offset });
            }
        }
    }
    let newest = all.iter().map(|f| f.seq).max().unwrap_or(0);
    all.retain(|f| f.seq == newest);
    all.sort_by_key(|f| f.lsn);
    all
}

#[derive(Clone, Copy, Debug)]
enum Damage {
    /// The data part holds other bytes on both replicas: the CRC fails.
    GarbagePayload,
    /// The data part is torn inside a chunk on one replica: the store
    /// reports `Corrupt`.
    CorruptPayload,
    /// The header chunk reports `Corrupt` on one replica.
    CorruptHeader,
}

fn damage(m: &MemBlob, f: &Found, d: Damage) {
    match d {
        Damage::GarbagePayload => {
            for r in 0..2 {
                m.poke(r, f.tract, f.offset, &[0x5a; BS as usize]);
            }
        }
        Damage::CorruptPayload => m.corrupt(1, f.tract, f.offset, BS as u32),
        Damage::CorruptHeader => m.corrupt(0, f.tract, f.offset + BS as u32, HEADER_LEN),
    }
}

/// Formats a 1 MiB log volume and writes `blocks` (one record each, in
/// order), then makes them durable. Returns the model after each write.
fn write_records(m: &MemBlob, blocks: &[u64]) -> Result<Vec<Model>, Box<dyn std::error::Error>> {
    let rt = runtime();
    rt.block_on(async {
        let vol = Volume::format(env(1), io(m), &spec(MIB)).await?;
        let mut model = Model(vec![0; MIB as usize]);
        let mut after = vec![model.clone()];
        for (i, &v) in blocks.iter().enumerate() {
            vol.write(v * BS, model.write(v, i as u64 + 1), false).await?;
            after.push(model.clone());
        }
        vol.flush_durable().await?;
        Ok(after)
    })
}

/// Reopens (recovery runs), checks the image, then writes on and checks
/// that the log continues past the damage across another reopen.
fn recover_and_continue(m: &MemBlob, want: &Model, what: &str) -> TestResult {
    let rt = runtime();
    rt.block_on(async {
        let vol = Volume::open(env(2), io(m), PlantedBug::None).await?;
        verify(&vol, want, what).await?;
        let mut model = want.clone();
        for (i, v) in [5u64, 9, 200, 5].into_iter().enumerate() {
            vol.write(v * BS, model.write(v, 1000 + i as u64), false).await?;
        }
        vol.flush_durable().await?;
        drop(vol);
        let vol = Volume::open(env(3), io(m), PlantedBug::None).await?;
        verify(&vol, &model, &format!("{what}, after writing on")).await
    })
}

/// (a) The last record of the log is torn (a garbage payload, a payload or
/// a header the store reports corrupt): the volume opens and holds every
/// record before it.
#[test]
fn torn_last_block_ends_the_log() -> TestResult {
    for d in [Damage::GarbagePayload, Damage::CorruptPayload, Damage::CorruptHeader] {
        let m = mem(11);
        let after = write_records(&m, &[3, 9, 3, 100, 42, 7])?;
        let recs = newest_records(&m);
        assert_eq!(recs.len(), 6, "{d:?}: every record is in the log");
        damage(&m, &recs[5], d);
        assert_ne!(after[5].0, after[6].0);
        recover_and_continue(&m, &after[5], &format!("{d:?} on the last record"))?;
    }
    Ok(())
}

/// (b) A damaged record in the middle is the end of the log: it and every
/// record after it are gone, which is a prefix of what was written.
#[test]
fn damaged_middle_block_ends_the_log() -> TestResult {
    for d in [Damage::GarbagePayload, Damage::CorruptPayload, Damage::CorruptHeader] {
        let m = mem(12);
        let after = write_records(&m, &[3, 9, 3, 100, 42, 7])?;
        let recs = newest_records(&m);
        damage(&m, &recs[2], d);
        assert_ne!(after[2].0, after[6].0);
        recover_and_continue(&m, &after[2], &format!("{d:?} on the third record"))?;
    }
    Ok(())
}

/// A trim record is its header chunk alone: a data part a crash left
/// corrupt on one replica and different on the other must not hide it, nor
/// the records after it.
#[test]
fn trim_with_damaged_data_part_is_accepted() -> TestResult {
    let m = mem(13);
    let rt = runtime();
    let model = rt.block_on(async {
        let vol = Volume::format(env(1), io(&m), &spec(MIB)).await?;
        let mut model = Model(vec![0; MIB as usize]);
        vol.write(0, model.write(0, 1), false).await?;
        vol.write(BS, model.write(1, 2), false).await?;
        vol.trim(0, BS).await?;
        model.trim(0);
        vol.write(2 * BS, model.write(2, 4), false).await?;
        vol.flush_durable().await?;
        Ok::<_, VolumeError>(model)
    })?;
    drop(rt);
    let recs = newest_records(&m);
    let trim = recs.iter().find(|f| f.kind == Kind::Trim).ok_or("no trim record in the log")?;
    assert_eq!(recs.len(), 4);
    m.corrupt(0, trim.tract, trim.offset, BS as u32);
    m.poke(1, trim.tract, trim.offset, &[0xa5; BS as usize]);
    recover_and_continue(&m, &model, "trim with a damaged data part")
}

/// A checkpoint write torn by power loss on every replica (the store
/// reports it corrupt) is skipped for the previous checkpoint.
#[test]
fn torn_checkpoint_falls_back_to_the_other_slot() -> TestResult {
    let m = mem(14);
    let after = write_records(&m, &[1, 2, 3])?;
    // The open writes a checkpoint before anything else: hold it.
    m.hold_after(Some(0));
    let rt = runtime();
    let opened = rt.block_on(async {
        env(5).timeout(Duration::from_secs(60), Volume::open(env(5), io(&m), PlantedBug::None)).await
    });
    assert!(opened.is_err(), "the open's checkpoint should have been held");
    drop(rt);
    let out = m.crash_each(|_, _| Landing::Corrupt);
    assert_eq!(out.in_flight, 1);
    m.hold_after(None);
    recover_and_continue(&m, &after[3], "torn checkpoint")
}

/// Grows a log volume in place (the checkpoint still fits), then past its
/// checkpoint slots twice (they move, the log gains extents), writing the
/// new tail, overwriting old blocks and wrapping the log each time; every
/// reopen reads back exactly what was written.
#[test]
fn grown_log_volume_keeps_data_and_uses_new_blocks() -> TestResult {
    let m = mem(21);
    let rt = runtime();
    rt.block_on(async {
        let mut vol = Volume::format(env(1), io(&m), &spec(MIB)).await?;
        let mut model = Model(vec![0; MIB as usize]);
        let mut id = 0;
        let mut rng = SmallRng::seed_from_u64(5);
        for v in 0..MIB / BS {
            id += 1;
            vol.write(v * BS, model.write(v, id), false).await?;
        }
        vol.flush_durable().await?;
        for (size, extents) in [(3 * MIB, 1), (32 * MIB, 2), (40 * MIB, 2), (100 * MIB, 3)] {
            vol.resize(size, false).await?;
            assert_eq!(vol.size(), size);
            let log = vol.superblock().log.clone().ok_or("log geometry")?;
            assert_eq!(log.extents.len(), extents, "resize to {size}");
            verify(&vol, &model, &format!("right after growing to {size}")).await?;
            // The new tail, then enough writes to wrap the log: the
            // permutation now visits the new physical blocks.
            let blocks = size / BS;
            for v in [blocks - 1, blocks / 2, blocks - 2] {
                id += 1;
                vol.write(v * BS, model.write(v, id), false).await?;
            }
            for _ in 0..2 * log.physical_blocks.min(3000) {
                let v =
                    if rng.random_bool(0.5) { rng.random_range(0..256) } else { rng.random_range(0..blocks) };
                id += 1;
                vol.write(v * BS, model.write(v, id), false).await?;
            }
            vol.flush_durable().await?;
            verify(&vol, &model, &format!("after writing at {size}")).await?;
            drop(vol);
            vol = Volume::open(env(id), io(&m), PlantedBug::None).await?;
            assert_eq!(vol.size(), size);
            verify(&vol, &model, &format!("reopened at {size}")).await?;
        }
        Ok(())
    })
}

/// How the writes a crash caught in flight land.
#[derive(Clone, Copy, Debug)]
enum Fate {
    Nowhere,
    Everywhere,
    FirstReplicaOnly,
    /// Corrupt on the first replica (power loss mid-chunk), whole on the other.
    TornFirstReplica,
}

impl Fate {
    fn landing(self, replica: usize) -> Landing {
        match (self, replica == 0) {
            (Fate::Nowhere, _) | (Fate::FirstReplicaOnly, false) => Landing::Nothing,
            (Fate::Everywhere, _) | (Fate::FirstReplicaOnly, true) | (Fate::TornFirstReplica, false) => {
                Landing::Whole
            }
            (Fate::TornFirstReplica, true) => Landing::Corrupt,
        }
    }
}

/// A crash at every step of a resize: the resize's first `held` blob
/// writes complete and the rest are caught in flight, landing as `fate`
/// says. Then three incarnations in a row open the volume, check it and
/// write to it: the size is the old or the new one and stays so, the data
/// is intact, and a resize to the old size's target then succeeds.
/// Returns whether the resize finished before the crash.
fn crash_during_resize(
    from: u64,
    to: u64,
    held: u64,
    fate: Fate,
) -> Result<bool, Box<dyn std::error::Error>> {
    let what = format!("{from}->{to} after {held} writes, {fate:?}");
    let m = mem(30 + held);
    let rt = runtime();
    let (mut model, finished) = rt.block_on(async {
        let vol = Volume::format(env(1), io(&m), &spec(from)).await?;
        let mut model = Model(vec![0; from as usize]);
        for (i, v) in (0..from / BS).step_by(3).enumerate() {
            vol.write(v * BS, model.write(v, i as u64 + 1), false).await?;
        }
        vol.flush_durable().await?;
        m.hold_after(Some(held));
        let r = env(2).timeout(Duration::from_secs(60), vol.resize(to, to < from)).await;
        let finished = match r {
            Ok(Ok(())) => true,
            Ok(Err(e)) => return Err(format!("{what}: resize failed: {e}").into()),
            Err(_) => false,
        };
        Ok::<_, Box<dyn std::error::Error>>((model, finished))
    })?;
    // The client dies: its tasks go, held writes meet their fate.
    drop(rt);
    m.crash_each(|_, r| fate.landing(r));
    m.hold_after(None);
    let mut size_seen = None;
    for round in 0..3u64 {
        let rt = runtime();
        rt.block_on(async {
            let vol = Volume::open(env(100 + round), io(&m), PlantedBug::None)
                .await
                .map_err(|e| format!("{what}: open {round}: {e}"))?;
            let size = vol.size();
            assert!(size == from || size == to, "{what}: size {size}");
            if finished {
                assert_eq!(size, to, "{what}: a finished resize stays done");
            }
            if let Some(s) = size_seen {
                assert_eq!(size, s, "{what}: open {round} picked another size than before");
            }
            verify(&vol, &model, &format!("{what}, open {round}")).await?;
            if size == from && round == 1 {
                // Finish the job on top of whatever the failed try left.
                vol.resize(to, to < from).await?;
                verify(&vol, &model, &format!("{what}, resized again")).await?;
            }
            let blocks = vol.size() / BS;
            for (i, v) in [blocks - 1, 1, blocks / 2].into_iter().enumerate() {
                vol.write(v * BS, model.write(v, 10_000 * (round + 1) + i as u64), false).await?;
            }
            vol.flush_durable().await?;
            size_seen = Some(vol.size());
            Ok::<_, Box<dyn std::error::Error>>(())
        })?;
    }
    Ok(finished)
}

/// Every crash point of a resize that grows the log in place, of one
/// that moves the checkpoint slots, and of a shrink (its checkpoint with
/// the shorter map, then the superblock), with every way the writes in
/// flight can land.
#[test]
fn crash_at_every_step_of_a_resize() -> TestResult {
    let mut points = 0;
    for (from, to) in [(MIB, 3 * MIB), (MIB, 32 * MIB), (3 * MIB, MIB + 8 * BS)] {
        let mut finished = false;
        let mut held = 0;
        while !finished {
            for fate in [Fate::Nowhere, Fate::Everywhere, Fate::FirstReplicaOnly, Fate::TornFirstReplica] {
                finished = crash_during_resize(from, to, held, fate)?;
                points += 1;
            }
            held += 1;
            assert!(held < 64, "the resize never finished");
        }
        println!("{from}->{to}: {held} crash points");
    }
    assert!(points > 8);
    Ok(())
}

/// A store whose n-th write fails after reaching only the first replica's
/// copy of the data: a superblock write that errs midway.
struct FailNth {
    inner: MemBlob,
    left: Mutex<u64>,
}

impl BlobIo for FailNth {
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
        let fail = match self.left.lock() {
            Ok(mut n) => {
                *n = n.saturating_sub(1);
                *n == 0
            }
            Err(_) => false,
        };
        if fail {
            self.inner.poke(0, tract, offset, &data);
            return async { Err(IoError::Other("injected failure".into())) }.boxed();
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
}

/// A resize whose superblock write fails (after reaching one replica)
/// fences the volume: writes fail until it is reopened, and the reopened
/// volume holds the data at one size or the other, for good.
#[test]
fn failed_superblock_write_fences_until_reopen() -> TestResult {
    let m = mem(40);
    let rt = runtime();
    rt.block_on(async {
        let mut model = Model(vec![0; MIB as usize]);
        {
            let vol = Volume::format(env(1), io(&m), &spec(MIB)).await?;
            vol.write(0, model.write(0, 1), false).await?;
            vol.flush_durable().await?;
        }
        // Open claims the volume (write 1: the intent header) and writes a
        // checkpoint (2); the resize then writes its checkpoint (3) and the
        // superblock (4), which fails.
        let failing: Arc<dyn BlobIo> = Arc::new(FailNth { inner: m.clone(), left: Mutex::new(4) });
        let vol = Volume::open(env(2), failing, PlantedBug::None).await?;
        assert!(vol.resize(3 * MIB, false).await.is_err(), "the superblock write was made to fail");
        assert_eq!(vol.size(), MIB);
        let refused = vol.write(BS, Bytes::from(vec![1u8; BS as usize]), false).await;
        assert!(refused.is_err(), "a fenced volume must refuse writes");
        verify(&vol, &model, "fenced, reading").await?;
        drop(vol);
        let mut size_seen = None;
        for round in 0..3 {
            let vol = Volume::open(env(10 + round), io(&m), PlantedBug::None).await?;
            verify(&vol, &model, &format!("reopened after the fence, open {round}")).await?;
            if let Some(s) = size_seen {
                assert_eq!(vol.size(), s);
            }
            size_seen = Some(vol.size());
            let v = vol.size() / BS - 1;
            vol.write(v * BS, model.write(v, 50 + round), false).await?;
            vol.flush_durable().await?;
        }
        Ok(())
    })
}

/// A trim of blocks that hold nothing (never written, or already trimmed)
/// writes no record: a whole-volume discard of a new volume (mkfs) costs
/// nothing, and only the blocks that held data get trim records. The
/// volume then reads as the model, also after a reopen.
#[test]
fn trimming_blocks_that_hold_nothing_writes_no_record() -> TestResult {
    let m = mem(21);
    let rt = runtime();
    rt.block_on(async {
        let vol = Volume::format(env(1), io(&m), &spec(MIB)).await?;
        let mut model = Model(vec![0; MIB as usize]);
        vol.trim(0, MIB).await?; // nothing written yet
        for (i, v) in [3u64, 9, 100].into_iter().enumerate() {
            vol.write(v * BS, model.write(v, i as u64 + 1), false).await?;
        }
        vol.flush_durable().await?;
        vol.trim(0, MIB).await?; // the three blocks, and nothing else
        model.trim(3);
        model.trim(9);
        model.trim(100);
        vol.trim(0, MIB).await?; // all of it holds nothing again
        vol.flush_durable().await?;
        verify(&vol, &model, "after the trims").await?;
        drop(vol);
        let vol = Volume::open(env(2), io(&m), PlantedBug::None).await?;
        verify(&vol, &model, "reopened").await
    })?;
    let recs = newest_records(&m);
    let trims = recs.iter().filter(|r| r.kind == Kind::Trim).count();
    let data = recs.iter().filter(|r| r.kind == Kind::Data).count();
    assert_eq!((data, trims), (3, 3), "records: {recs:?}");
    Ok(())
}
