//! The volume handle: range checks, the superblock, and the commit mode.
//!
//! | mode          | write acknowledged when          | flush (durable policy)   | flush (ordered policy) |
//! |---------------|----------------------------------|--------------------------|------------------------|
//! | write-through | durable on every replica         | nothing to wait for      | nothing to wait for    |
//! | fast-ack      | at once (under exposure limits)  | waits for earlier writes | closes the epoch only  |
//! | log           | at once (under exposure limits)  | waits for earlier writes | closes the epoch only  |
//!
//! A write with FUA is durable when acknowledged in every mode.

use std::sync::Arc;

use bytes::Bytes;

use blizzard_core::Placement;
use blizzard_env::Env;

use crate::cache::Data;
use crate::engine::Engine;
pub use crate::engine::{AllocExtent, Allocation, ALLOCATION_SPAN_MAX};
use crate::fast_ack::FastAck;
use crate::intent::{self, IntentLog, Recovery};
use crate::io::BlobIo;
use crate::log::{LogEngine, LogGeom};
use crate::snap::layered::{Layered, LayeredIo};
use crate::striping::Striping;
use crate::superblock::{
    CommitMode, ExposureLimits, FlushPolicy, Superblock, SuperblockError, NAME_LEN_MAX, SUPERBLOCK_COPY_LEN,
};
use crate::write_through::{self, WriteThrough};
use crate::{PlantedBug, VolumeError};

mod reshape;
pub use reshape::Attached;

/// What to create.
#[derive(Clone, Debug)]
pub struct VolumeSpec {
    pub name: String,
    pub size_bytes: u64,
    pub mode: CommitMode,
    pub flush: FlushPolicy,
    pub replication: u8,
    /// Striping unit; `None` picks 64 KiB.
    pub block_size: Option<u32>,
    pub segment_tracts: u32,
    pub exposure: ExposureLimits,
    /// Where its replicas live (design 0009): `any` unless asked.
    pub placement: Placement,
}

impl VolumeSpec {
    pub fn new(name: impl Into<String>, size_bytes: u64) -> Self {
        VolumeSpec {
            name: name.into(),
            size_bytes,
            mode: CommitMode::WriteThrough,
            flush: FlushPolicy::Durable,
            replication: 1,
            block_size: None,
            segment_tracts: 128,
            exposure: ExposureLimits::default(),
            placement: Placement::Any,
        }
    }
}

/// Default striping unit: large enough that a sequential 1 MiB request is
/// 16 blob operations, small enough that 4 KiB random I/O stays in one.
pub const BLOCK_SIZE_DEFAULT: u32 = 64 << 10;

/// Smallest volume block: one sector.
pub const BLOCK_SIZE_MIN: u32 = 512;

/// A volume: range checks, read-only handling and the superblock here;
/// everything else is its engine's (`engine`: write-through, fast-ack,
/// log, an S3 volume or an S3 snapshot).
pub struct Volume {
    /// The env it was opened with (a read-only handle opened without one
    /// has none, and takes no snapshot).
    env: Option<Env>,
    io: Arc<dyn BlobIo>,
    sb: Superblock,
    /// The size in force: `sb`'s until an online resize (`resize`).
    size: std::sync::atomic::AtomicU64,
    /// The superblock as last written: `sb`, or newer once a first
    /// snapshot named its catalog (which a shared handle cannot put in
    /// `sb`). Every superblock write starts from it.
    written: std::sync::Mutex<Superblock>,
    engine: Box<dyn Engine>,
    /// A volume in the blob store: its stack of layers (`snap`), which
    /// its engine writes through.
    layers: Option<Arc<LayeredIo>>,
    /// Writes hold it shared; taking a snapshot holds it alone, so no
    /// write runs while the head is frozen.
    gate: tokio::sync::RwLock<()>,
    /// The control socket's task, while this process serves the volume
    /// (`serve_control`); stopped at release.
    control: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    recovery: Recovery,
    /// Opened without claiming it (`open_read_only`, a snapshot): changes
    /// refused.
    read_only: bool,
    planted: PlantedBug,
    /// Who uses the volume now (NBD clients, by peer and identity): a
    /// rollback is refused while any does, naming them.
    users: std::sync::Mutex<Vec<(u64, String)>>,
}

/// Smallest tract a volume fits in: two superblock copies, the intent
/// header and one bitmap page (`intent`).
pub const VOLUME_TRACT_MIN: u32 = intent::BITMAP_OFFSET + intent::PAGE;

/// Whether a volume keeps a write-intent log: it writes its blocks in
/// place (a log volume's recovery already ignores what it did not finish).
/// Every replication level: even a 1-way tract has two copies while a
/// joining tractserver takes it over (a pending member, FDS §3.4), and a
/// write cut off by a crash may reach one and not the other.
fn keeps_intent(mode: CommitMode) -> bool {
    mode != CommitMode::Log
}

fn striping_for(sb: &Superblock, tract_size: u32) -> Striping {
    Striping {
        tract_size: tract_size as u64,
        block_size: sb.block_size as u64,
        segment_tracts: sb.segment_tracts as u64,
        first_tract: 1,
    }
}

impl Volume {
    /// Checks a spec against the blob it would live in.
    pub fn validate(spec: &VolumeSpec, tract_size: u32) -> Result<(), VolumeError> {
        let bs = spec.block_size.unwrap_or(BLOCK_SIZE_DEFAULT);
        let bad = |m: String| Err(VolumeError::Invalid(m));
        Self::validate_name(&spec.name)?;
        if !bs.is_power_of_two() || bs < BLOCK_SIZE_MIN || bs > tract_size {
            return bad(format!("block size {bs} must be a power of two between {BLOCK_SIZE_MIN} and the tract size ({tract_size})"));
        }
        if spec.size_bytes == 0 || !spec.size_bytes.is_multiple_of(512) {
            return bad(format!("size {} must be a positive multiple of 512 bytes", spec.size_bytes));
        }
        if spec.segment_tracts == 0 || spec.segment_tracts > 65536 {
            return bad("segment tracts must be 1..=65536".into());
        }
        if tract_size < VOLUME_TRACT_MIN {
            return bad(format!(
                "a volume needs tracts of at least {VOLUME_TRACT_MIN} bytes (this cluster's are {tract_size}): create the cluster with a larger --tract-size"
            ));
        }
        if keeps_intent(spec.mode) {
            let st = Striping {
                tract_size: tract_size as u64,
                block_size: bs as u64,
                segment_tracts: spec.segment_tracts as u64,
                first_tract: 1,
            };
            write_through::check_intent_capacity(&st, spec.size_bytes)?;
        }
        if spec.mode == CommitMode::Log {
            LogGeom::plan(spec.size_bytes, bs as u64, tract_size as u64)?;
        }
        Ok(())
    }

    /// A new volume's name: 1..=NAME_LEN_MAX bytes, no '/', NUL or '@'
    /// (`NAME@SNAP` names a snapshot, as an NBD export and in `volume
    /// clone`). Checked at create only: a volume named before this rule
    /// still opens.
    pub fn validate_name(name: &str) -> Result<(), VolumeError> {
        if name.is_empty() || name.len() > NAME_LEN_MAX || name.contains(['/', '\0', '@']) {
            return Err(VolumeError::Invalid(format!(
                "name must be 1..={NAME_LEN_MAX} bytes without '/' or '@' ('@' is kept for snapshots: NAME@SNAP)"
            )));
        }
        Ok(())
    }

    /// Formats `io` (an empty blob) as a new volume and opens it.
    pub async fn format(env: Env, io: Arc<dyn BlobIo>, spec: &VolumeSpec) -> Result<Volume, VolumeError> {
        Self::validate(spec, io.tract_size())?;
        let mut sb = Superblock {
            name: spec.name.clone(),
            generation: 1,
            size_bytes: spec.size_bytes,
            block_size: spec.block_size.unwrap_or(BLOCK_SIZE_DEFAULT),
            segment_tracts: spec.segment_tracts,
            replication: io.replication(),
            mode: spec.mode,
            flush: spec.flush,
            exposure: spec.exposure,
            created_unix_s: env
                .clock
                .system_time()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            log: None,
            backend: crate::Backend::Blob,
            access: Vec::new(),
            layers: None,
        };
        if sb.mode == CommitMode::Log {
            let geom = LogGeom::plan(sb.size_bytes, sb.block_size as u64, io.tract_size() as u64)?;
            sb.log = Some(geom.superblock_part());
            io.extend_to(geom.total_tracts()).await?;
            LogEngine::format(&io, &geom, env.random_u64()).await?;
        } else {
            let st = striping_for(&sb, io.tract_size());
            io.extend_to(st.tracts_for(sb.size_bytes)).await?;
        }
        intent::format(&io).await?;
        // Last: a volume without a superblock is not a volume yet.
        Self::write_superblock(&io, &sb).await?;
        Self::open(env, io, PlantedBug::None).await
    }

    pub(crate) async fn write_superblock(io: &Arc<dyn BlobIo>, sb: &Superblock) -> Result<(), VolumeError> {
        io.write(0, Superblock::copy_offset(sb.generation), Bytes::from(sb.encode())).await?;
        Ok(())
    }

    /// One superblock copy; `None` if the store reports it damaged (a
    /// write torn by power loss), which makes it as invalid as a copy
    /// whose CRC fails, so the other copy is used.
    async fn read_copy(io: &Arc<dyn BlobIo>, copy: u32) -> Result<Option<Bytes>, VolumeError> {
        match io.read(0, copy * SUPERBLOCK_COPY_LEN, SUPERBLOCK_COPY_LEN).await {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.is_corrupt() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn read_superblock(io: &Arc<dyn BlobIo>) -> Result<Superblock, VolumeError> {
        match (Self::read_copy(io, 0).await?, Self::read_copy(io, 1).await?) {
            (Some(a), Some(b)) => Ok(Superblock::pick(&a, &b)?),
            (Some(x), None) | (None, Some(x)) => Ok(Superblock::decode(&x)?.ok_or(SuperblockError::Damaged)?),
            (None, None) => Err(SuperblockError::Damaged.into()),
        }
    }

    /// Log volumes, before the log runs: makes the superblock the same on
    /// every replica and returns it.
    ///
    /// Why: a superblock write cut off by a crash may have reached some
    /// replicas and not others, and a read picks one replica. A log
    /// volume's superblock names the log's geometry, which a resize
    /// changes; if one incarnation ran on the old geometry and a later one
    /// read the new, the later one would recover from a checkpoint the
    /// first's writes had overtaken. Superblock writes are issued one at a
    /// time, each durable on every replica before the next, so at most one
    /// copy is unsettled (the target of the write that was cut off) and the
    /// other holds the last completed superblock. Either is a safe choice:
    /// an update was prepared in full before it was issued (a resize makes
    /// its checkpoint durable first) and nothing has run on it since. This
    /// picks the newest copy intact on any replica seen and makes it the
    /// newest on every replica — in place, or one generation up over the
    /// unsettled copy — so every later open picks the same one.
    async fn settle_superblock(io: &Arc<dyn BlobIo>) -> Result<Superblock, VolumeError> {
        let n = SUPERBLOCK_COPY_LEN;
        let mut settled = [true; 2];
        let mut best: Option<(usize, Superblock)> = None;
        for (c, settled) in settled.iter_mut().enumerate() {
            let at = c as u32 * n;
            let copies = match io.read_replicas(0, at, n).await {
                Ok(v) => {
                    *settled = v.windows(2).all(|w| w[0] == w[1]);
                    v
                }
                Err(e) if e.is_corrupt() => {
                    *settled = false;
                    // A plain read skips the damaged replicas.
                    match io.read(0, at, n).await {
                        Ok(b) => vec![b],
                        Err(e) if e.is_corrupt() => Vec::new(),
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
            };
            for b in &copies {
                if let Some(sb) = Superblock::decode(b)? {
                    if best.as_ref().is_none_or(|(_, x)| sb.generation > x.generation) {
                        best = Some((c, sb));
                    }
                }
            }
        }
        let Some((from, mut sb)) = best else {
            return Err(SuperblockError::Damaged.into());
        };
        if !settled[from] {
            Self::write_superblock(io, &sb).await?;
        }
        if !settled[1 - from] {
            sb.generation += 1;
            Self::write_superblock(io, &sb).await?;
        }
        Ok(sb)
    }

    /// The superblock of the volume in `io`, without opening it (nothing
    /// is written, the volume's writer is not disturbed).
    pub async fn inspect(io: &Arc<dyn BlobIo>) -> Result<Superblock, VolumeError> {
        Self::read_superblock(io).await
    }

    /// Opens the volume in `io` for writing. Recovery first:
    ///
    /// 1. claim the volume (`intent::claim`): from then on the blob store
    ///    refuses changes from any earlier writer, such as requests of a
    ///    crashed one still in the network;
    /// 2. a replicated volume makes its superblock the same on every
    ///    replica (a resize cut off by a crash may have reached only some);
    /// 3. a write-through or fast-ack volume makes every tract
    ///    its intent bitmap names the same on every replica
    ///    (`IntentLog::recover`), before the first read;
    /// 4. a log volume rolls its log forward.
    ///
    /// An S3 volume's record leads to its object log instead (`lsvd`).
    pub async fn open(env: Env, io: Arc<dyn BlobIo>, planted: PlantedBug) -> Result<Volume, VolumeError> {
        let mut sb = Self::read_superblock(&io).await?;
        if sb.backend.s3().is_some() {
            return crate::lsvd::open(env, io, sb).await;
        }
        let claim = intent::claim(&io).await?;
        if sb.mode == CommitMode::Log || io.replication() > 1 {
            sb = Self::settle_superblock(&io).await?;
        }
        let striping = striping_for(&sb, io.tract_size());
        let layers = crate::snap::stack::open(
            io.clone(),
            &sb,
            Self::data_tracts(&sb, &striping, io.tract_size()),
            true,
            planted,
        )
        .await?;
        let raw = io;
        let io: Arc<dyn BlobIo> = Arc::new(Layered(layers.clone()));
        let env_kept = env.clone();
        let (intent, recovery) = if keeps_intent(sb.mode) {
            let size = io.size_tracts().max(striping.tracts_for(sb.size_bytes));
            let (log, rec) = IntentLog::recover(env.clone(), io.clone(), claim, size, planted).await?;
            (Some(log), rec)
        } else {
            (None, Recovery { writer: claim.writer, ..Recovery::default() })
        };
        let engine: Box<dyn Engine> = match sb.mode {
            CommitMode::WriteThrough => Box::new(WriteThrough::new(io.clone(), striping, intent)),
            CommitMode::FastAck => {
                Box::new(FastAck::new(env, io.clone(), striping, sb.exposure, intent, planted))
            }
            CommitMode::Log => {
                let geom = Self::log_geom(&sb, io.tract_size())?;
                Box::new(LogEngine::open(env, io.clone(), geom, sb.exposure, planted).await?)
            }
        };
        let mut v = Self::assemble(Some(env_kept), raw, sb, engine, Some(layers), recovery, false);
        v.planted = planted;
        Ok(v)
    }

    fn assemble(
        env: Option<Env>,
        io: Arc<dyn BlobIo>,
        sb: Superblock,
        engine: Box<dyn Engine>,
        layers: Option<Arc<LayeredIo>>,
        recovery: Recovery,
        read_only: bool,
    ) -> Volume {
        let written = std::sync::Mutex::new(sb.clone());
        Volume {
            env,
            io,
            size: std::sync::atomic::AtomicU64::new(sb.size_bytes),
            sb,
            written,
            engine,
            layers,
            gate: tokio::sync::RwLock::new(()),
            control: std::sync::Mutex::new(None),
            recovery,
            read_only,
            planted: PlantedBug::None,
            users: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn log_geom(sb: &Superblock, tract_size: u32) -> Result<LogGeom, VolumeError> {
        let Some(l) = &sb.log else {
            return Err(VolumeError::Unsupported("log volume without log geometry".into()));
        };
        Ok(LogGeom::from_superblock(l, sb.size_bytes, sb.block_size as u64, tract_size as u64))
    }

    /// The tracts a volume in its blob spans (tract 0 included): its
    /// striped data, or its log.
    fn data_tracts(sb: &Superblock, striping: &Striping, tract_size: u32) -> u64 {
        match sb.mode {
            CommitMode::Log => Self::log_geom(sb, tract_size).map_or(1, |g| g.total_tracts()),
            _ => striping.tracts_for(sb.size_bytes),
        }
    }

    /// Opens snapshot `name` of this blob-store volume read-only (the
    /// export `NAME@SNAP`): no lease, nothing written; it reads the volume
    /// as it was when the snapshot was taken, whatever the volume's writer
    /// does since.
    pub async fn open_snapshot(env: Env, io: Arc<dyn BlobIo>, name: &str) -> Result<Volume, VolumeError> {
        let sb = Self::read_superblock(&io).await?;
        if sb.backend.s3().is_some() {
            return crate::lsvd::open_snapshot(io, sb, name).await;
        }
        let (layers, info) = crate::snap::stack::open_snapshot(&io, &sb, name).await?;
        let view: Arc<dyn BlobIo> = Arc::new(Layered(layers.clone()));
        let mut snap_sb = sb.clone();
        snap_sb.name = format!("{}@{name}", sb.name);
        snap_sb.size_bytes = info.size_bytes;
        let striping = striping_for(&snap_sb, io.tract_size());
        let engine: Box<dyn Engine> = match sb.mode {
            CommitMode::Log => Box::new(
                LogEngine::open_read_only(env.clone(), view, Self::log_geom(&snap_sb, io.tract_size())?)
                    .await?,
            ),
            _ => Box::new(WriteThrough::new(view, striping, None)),
        };
        Ok(Self::assemble(Some(env), io, snap_sb, engine, Some(layers), Recovery::default(), true))
    }

    /// The snapshots of this blob-store volume, oldest first, with the
    /// space each alone holds.
    pub async fn snapshots(
        io: &Arc<dyn BlobIo>,
    ) -> Result<Vec<crate::snap::stack::SnapshotInfo>, VolumeError> {
        let sb = Self::read_superblock(io).await?;
        crate::snap::stack::list(io, &sb).await
    }

    /// Opens a write-through or fast-ack volume to read its blob as it is,
    /// without claiming it: the process writing it is not disturbed, and
    /// nothing is recovered (after an unclean close, replicas may still
    /// differ until the writer opens it). Writes are refused.
    pub async fn open_read_only(io: Arc<dyn BlobIo>) -> Result<Volume, VolumeError> {
        let sb = Self::read_superblock(&io).await?;
        if sb.backend.s3().is_some() {
            return Err(VolumeError::Unsupported(
                "an S3 volume can only be read through its writer (what it has not destaged is in its cache)"
                    .into(),
            ));
        }
        if sb.mode == CommitMode::Log {
            return Err(VolumeError::Unsupported(
                "a log volume can only be read through its writer (its block map is in the writer's memory)"
                    .into(),
            ));
        }
        let striping = striping_for(&sb, io.tract_size());
        let layers = crate::snap::stack::open(
            io.clone(),
            &sb,
            Self::data_tracts(&sb, &striping, io.tract_size()),
            false,
            PlantedBug::None,
        )
        .await?;
        let view: Arc<dyn BlobIo> = Arc::new(Layered(layers.clone()));
        let engine = Box::new(WriteThrough::new(view, striping, None));
        Ok(Self::assemble(None, io, sb, engine, Some(layers), Recovery::default(), true))
    }

    /// An S3 volume's handle: its record in `io`, its engine.
    pub(crate) fn with_lsvd(
        env: Env,
        io: Arc<dyn BlobIo>,
        sb: Superblock,
        engine: Box<dyn Engine>,
        epoch: u64,
    ) -> Volume {
        let recovery = Recovery { writer: epoch, ..Recovery::default() };
        Self::assemble(Some(env), io, sb, engine, None, recovery, false)
    }

    /// A snapshot of an S3 volume's handle: read-only, no lease.
    pub(crate) fn with_lsvd_snapshot(io: Arc<dyn BlobIo>, sb: Superblock, engine: Box<dyn Engine>) -> Volume {
        Self::assemble(None, io, sb, engine, None, Recovery::default(), true)
    }

    /// Takes snapshot `name` of the volume: every write acknowledged before
    /// the call is in it, none that starts after it returns. A volume in
    /// the blob store freezes its head layer (design 0011) and returns the
    /// new head's layer id; an S3 volume (design 0008) returns the object
    /// seq the snapshot names.
    pub async fn snapshot(&self, name: &str) -> Result<u64, VolumeError> {
        self.writable("take snapshots")?;
        let Some(layers) = &self.layers else {
            return self.engine.snapshot(name).await;
        };
        // No write runs from here to the switch; every write acknowledged
        // before is made durable first (fast-ack and log: a durable flush),
        // and the intent bits are cleared (the new head starts clean).
        let _alone = self.gate.write().await;
        let _held = match self.planted {
            PlantedBug::SnapshotSkipsFlush => None,
            _ => Some(self.engine.freeze().await?),
        };
        let now = self
            .env
            .as_ref()
            .map(|e| e.clock.system_time())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let current = blizzard_env::lock(&self.written).clone();
        let next = crate::snap::stack::take(layers, &current, name, now).await?;
        let head = layers.stack().head.map_or(0, |h| h.0 as u64);
        *blizzard_env::lock(&self.written) = next;
        Ok(head)
    }

    /// Refuses a change to a volume opened read-only.
    fn writable(&self, what: &str) -> Result<(), VolumeError> {
        if self.read_only {
            return Err(VolumeError::Unsupported(format!(
                "volume {:?} was opened read-only: it cannot {what}",
                self.sb.name
            )));
        }
        Ok(())
    }

    /// Deletes snapshot `name` of this volume (an S3 volume's is refused
    /// while a clone reads it). A volume in the blob store gives back the
    /// chunks only that snapshot read (`snap::stack::delete`); returns
    /// nothing of them (see [`Volume::delete_snapshot_freeing`]).
    pub async fn delete_snapshot(&self, name: &str) -> Result<(), VolumeError> {
        self.delete_snapshot_freeing(name).await.map(|_| ())
    }

    /// [`Volume::delete_snapshot`], returning the bytes given back (0 for
    /// an S3 volume, whose cleaner gives them back later).
    pub async fn delete_snapshot_freeing(&self, name: &str) -> Result<u64, VolumeError> {
        self.writable("delete snapshots")?;
        if let Some(layers) = &self.layers {
            // As for taking one: every acknowledged write durable, none
            // running, so the head's chunks in memory are on every replica.
            let _alone = self.gate.write().await;
            let _held = self.engine.freeze().await?;
            let current = blizzard_env::lock(&self.written).clone();
            return crate::snap::stack::delete(layers, &current, name, self.planted).await;
        }
        self.engine.delete_snapshot(name).await.map(|()| 0).map_err(|e| match e {
            VolumeError::Unsupported(_) => VolumeError::Unsupported(format!(
                "volume {:?}: only S3 volumes opened for writing have snapshots to delete",
                self.sb.name
            )),
            e => e,
        })
    }

    /// An S3 volume's own figures (what is not yet in the object store,
    /// the cache's use), or `None` for a volume in its blob.
    pub fn lsvd_info(&self) -> Option<blizzard_lsvd::Info> {
        self.engine.s3_info()
    }

    /// An S3 volume's requests to its object store so far, or `None` for a
    /// volume in its blob.
    pub fn lsvd_counts(&self) -> Option<blizzard_lsvd::store::CountsNow> {
        self.engine.s3_counts()
    }

    /// What opening found and did: the writer epoch claimed, and the
    /// replicas reconciled after an unclean close.
    pub fn recovery(&self) -> &Recovery {
        &self.recovery
    }

    /// Whether this volume was opened read-only (`open_read_only`): changes are refused.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// The intent log, for write-through and fast-ack volumes.
    pub fn intent(&self) -> Option<&Arc<IntentLog>> {
        self.engine.intent()
    }

    /// Changes who may use the volume (`crate::access`). The superblock
    /// write is the switch, as for a resize; returns the list now in force.
    pub async fn set_access(
        &mut self,
        change: &crate::access::AccessChange,
    ) -> Result<Vec<crate::access::AccessEntry>, VolumeError> {
        self.writable("change its access list")?;
        let mut sb = blizzard_env::lock(&self.written).clone();
        sb.access = crate::access::apply(&sb.access, change).map_err(VolumeError::Invalid)?;
        sb.generation += 1;
        Self::write_superblock(&self.io, &sb).await?;
        *blizzard_env::lock(&self.written) = sb.clone();
        self.sb = sb;
        Ok(self.sb.access.clone())
    }

    /// The superblock as last written (the size in force, the catalog
    /// of a first snapshot).
    pub fn superblock(&self) -> Superblock {
        blizzard_env::lock(&self.written).clone()
    }

    /// The size in force (an online resize changes it).
    pub fn size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The commit mode.
    pub fn mode(&self) -> CommitMode {
        self.sb.mode
    }

    pub fn block_size(&self) -> u32 {
        self.sb.block_size
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(VolumeError::OutOfRange { offset, len, size }),
        }
    }

    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        self.engine.read(offset, len).await
    }

    async fn put(&self, offset: u64, data: Data, fua: bool) -> Result<(), VolumeError> {
        self.check(offset, data.len())?;
        self.writable("be written")?;
        if data.is_empty() {
            return Ok(());
        }
        let _shared = self.gate.read().await;
        // Again under the gate: a shrink may have ended while this waited.
        self.check(offset, data.len())?;
        self.engine.write(offset, data, fua).await
    }

    /// Writes `data` at `offset`. With `fua`, durable when it returns.
    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), VolumeError> {
        self.put(offset, Data::Bytes(data), fua).await
    }

    /// Makes `[offset, offset + len)` read as zeros; its space is released.
    pub async fn write_zeroes(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolumeError> {
        self.put(offset, Data::Zero(len), fua).await
    }

    /// Discards `[offset, offset + len)`: it reads as zeros afterwards.
    pub async fn trim(&self, offset: u64, len: u64) -> Result<(), VolumeError> {
        self.put(offset, Data::Zero(len), false).await
    }

    /// A flush under the volume's policy.
    pub async fn flush(&self) -> Result<(), VolumeError> {
        self.flush_with(self.sb.flush == FlushPolicy::Durable).await
    }

    /// A flush that always waits for durability (FUA, shutdown).
    pub async fn flush_durable(&self) -> Result<(), VolumeError> {
        self.flush_with(true).await
    }

    async fn flush_with(&self, durable: bool) -> Result<(), VolumeError> {
        if self.read_only {
            return Ok(());
        }
        self.engine.flush(durable).await
    }

    /// What `[offset, offset + len)` holds, as consecutive extents from
    /// `offset`: `Data` where something may have been written, `Zero`
    /// where the range is unallocated and reads as zeros (NBD's
    /// `base:allocation`, so copies can skip holes). Covers the whole range
    /// up to `ALLOCATION_SPAN_MAX` bytes; callers ask again for the rest.
    /// Reporting data for a hole is allowed, the reverse never: acknowledged
    /// writes not yet durable count as data (zeros for trims).
    pub async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<AllocExtent>, VolumeError> {
        self.check(offset, len)?;
        let len = len.min(ALLOCATION_SPAN_MAX);
        if len == 0 {
            return Ok(Vec::new());
        }
        self.engine.allocation(offset, len).await
    }

    /// Undurable writes and bytes (0 in write-through mode).
    pub fn outstanding(&self) -> (u64, u64) {
        self.engine.outstanding()
    }

    /// Makes everything durable and closes the volume: a clean close,
    /// after which the next open has nothing to reconcile.
    pub async fn close(self) -> Result<(), VolumeError> {
        self.release().await
    }

    /// [`Volume::close`] for a volume shared behind an `Arc` (an NBD
    /// server at shutdown): quiesces, then gives up the volume's lease so
    /// the next opener need not wait for it to end. No change goes out
    /// from this handle after. If quiescing fails the lease is kept: what
    /// is not durable yet must not be handed to another writer.
    pub async fn release(&self) -> Result<(), VolumeError> {
        self.stop_control().await;
        self.quiesce().await?;
        self.engine.close().await?;
        if !self.read_only {
            self.io.release().await?;
        }
        Ok(())
    }

    /// Answers `blizzard volume snapshot` for this volume on its control
    /// socket (`control`) while this handle serves it: a writable volume
    /// in the blob store (an S3 volume serves its own). Stopped at release.
    pub fn serve_control(self: &Arc<Self>) {
        let Some(env) = self.env.clone() else { return };
        if self.read_only || self.layers.is_none() {
            return;
        }
        let path = crate::control::blob_socket_path(crate::manage::blob_id(&self.sb.name));
        let weak: std::sync::Weak<dyn crate::control::Controlled> = Arc::downgrade(self) as _;
        let task = crate::control::spawn(env, path, weak);
        if let Some(old) = blizzard_env::lock(&self.control).replace(task) {
            old.abort();
        }
    }

    async fn stop_control(&self) {
        let task = blizzard_env::lock(&self.control).take();
        if let Some(t) = task {
            t.abort();
            let path = crate::control::blob_socket_path(crate::manage::blob_id(&self.sb.name));
            if let Some(env) = &self.env {
                let _ = env.remove_disk(&path).await;
            }
        }
    }

    /// For a shutdown with the volume shared: makes everything durable and
    /// clears the intent bits of every tract no write is in flight on, so
    /// the next open has nothing to reconcile. The volume stays usable.
    pub async fn quiesce(&self) -> Result<(), VolumeError> {
        if self.read_only {
            return Ok(());
        }
        self.engine.quiesce().await
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        if let Some(t) = blizzard_env::lock(&self.control).take() {
            t.abort();
        }
    }
}

/// The control socket's target (`control`): snapshots taken by the
/// process serving the volume.
impl crate::control::Controlled for Volume {
    fn snapshot<'a>(&'a self, name: &'a str) -> futures::future::BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(Volume::snapshot(self, name))
    }

    fn delete_snapshot<'a>(
        &'a self,
        name: &'a str,
    ) -> futures::future::BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(Volume::delete_snapshot_freeing(self, name))
    }

    fn rollback<'a>(&'a self, name: &'a str) -> futures::future::BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(Volume::rollback(self, name))
    }

    fn resize(
        &self,
        size: u64,
        allow_shrink: bool,
    ) -> futures::future::BoxFuture<'_, Result<u64, VolumeError>> {
        Box::pin(async move {
            Volume::resize(self, size, allow_shrink).await?;
            Ok(self.size())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_names_are_checked() {
        for ok in ["disk", "vm-01.root_fs", &"x".repeat(NAME_LEN_MAX)] {
            assert!(Volume::validate_name(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", "a/b", "a\0b", "db@monday", "@", &"x".repeat(NAME_LEN_MAX + 1)] {
            let e = Volume::validate_name(bad).expect_err(bad);
            assert_eq!(e.kind(), crate::ErrorKind::Invalid, "{bad:?}: {e}");
        }
    }
}
