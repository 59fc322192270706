//! S3 volumes (design 0008, issue 23): an LSVD volume, a log of objects in
//! an S3-compatible store behind a journal on the serving host's disk
//! (`blizzard_lsvd`), served through the same [`Volume`] handle as the
//! blob's commit modes, so NBD and every other caller need nothing new.
//!
//! The volume's blob holds only its record: the superblock, whose
//! [`Backend::S3`] names the URL, the uuid of the descriptor under it, the
//! cache directory and the journal's size. The blob also carries the
//! volume's lease (design 0007), so `list`, `info`, `delete` and one
//! writer per volume work as for every volume; the object store's
//! conditional puts keep one writer even past a lease (design 0008).
//!
//! | `Volume` call | here |
//! |---|---|
//! | read | LSVD read: journal, then objects, then zeros |
//! | write | one journal record; a write not in whole 512-byte sectors reads the sectors around it and writes them whole, one such write at a time |
//! | trim, write-zeroes | a trim record (reads as zeros); sector pieces at the ends are written as zeros |
//! | flush (either policy), FUA | one `fdatasync` of the journal |
//! | allocation | journal map, then object map |
//! | release (close) | flush, destage what the journal holds (at most [`CLOSE_DRAIN_MAX`]: what is left stays in the journal for the next open on this host), stop |
//!
//! Create, in order, each step undone on a later failure so that no
//! half-made volume is left: the blob (claims the name, in `manage`); the
//! object store checked (reachable, credentials, bucket, no volume or
//! remains of one under the prefix); the descriptor; the volume opened
//! (its claim object, the journal file); the record written last.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use blizzard_env::Env;
use blizzard_lsvd::{
    objlog, snapshot as snap, volume as lv, Kind, LsvdError, LsvdSnapshot, LsvdVolume, Store,
};

use crate::cache::Data;
use crate::engine::{AllocExtent, Commit, Engine};
use crate::io::BlobIo;
use crate::superblock::{
    Backend, CommitMode, ExposureLimits, FlushPolicy, S3Backend, Superblock, CACHE_DIR_LEN_MAX,
    S3_URL_LEN_MAX,
};
use crate::volume::VolumeSpec;
use crate::{ErrorKind, Volume, VolumeError};
use futures::future::BoxFuture;

/// The journal's file name in the cache directory.
pub const CACHE_FILE: &str = "journal";
/// Target data bytes per object when not given (the paper's 4-32 MiB).
pub const OBJECT_BYTES_DEFAULT: u64 = 8 << 20;
/// The journal's size when not given.
pub const CACHE_BYTES_DEFAULT: u64 = 1 << 30;
/// How long a clean close waits for the journal to reach the object store.
pub const CLOSE_DRAIN_MAX: Duration = Duration::from_secs(30);
/// LSVD writes whole sectors.
const SECTOR: u64 = 512;
/// The record's geometry fields, which an S3 volume does not use: set to
/// values every build's decoder accepts.
const RECORD_BLOCK_SIZE: u32 = 4096;

/// Where a new S3 volume goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Spec {
    /// `http://host:port/bucket/prefix`.
    pub url: String,
    /// The cache directory on the serving host (absolute).
    pub cache_dir: PathBuf,
    pub cache_bytes: u64,
    pub object_bytes: u64,
    /// Make the volume a clone of this snapshot (its size, object size
    /// and cleaning threshold are the base's) instead of an empty one.
    pub clone_of: Option<CloneOf>,
    /// Clean once live data is below this percentage of the bytes stored
    /// (`None`: 70 %, the LSVD paper's).
    pub gc_live_pct: Option<u8>,
}

/// A clone's base: the volume `name`, whose data is at `url`, as of its
/// snapshot `snapshot`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloneOf {
    pub name: String,
    pub url: String,
    pub snapshot: String,
}

impl S3Spec {
    pub fn new(url: impl Into<String>, cache_dir: impl Into<PathBuf>) -> S3Spec {
        S3Spec {
            url: url.into(),
            cache_dir: cache_dir.into(),
            cache_bytes: CACHE_BYTES_DEFAULT,
            object_bytes: OBJECT_BYTES_DEFAULT,
            clone_of: None,
            gc_live_pct: None,
        }
    }
}

/// The journal file of a volume whose cache directory is `dir`.
pub fn cache_file(dir: &str) -> PathBuf {
    Path::new(dir).join(CACHE_FILE)
}

/// The read cache file of a volume whose cache directory is `dir`.
pub fn read_cache_file(dir: &str) -> PathBuf {
    Path::new(dir).join(lv::READ_CACHE_FILE)
}

/// How an S3 volume is opened: a journal of `cache_bytes`, and a read
/// cache of the same size beside it.
fn open_config(cache_bytes: u64) -> lv::Config {
    lv::Config { cache_bytes, read_cache_bytes: cache_bytes, ..lv::Config::default() }
}

/// What an operator can do about a failure the object store reported.
fn hint(e: &LsvdError) -> &'static str {
    let text = e.to_string();
    let refused = ["SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "403 Forbidden"];
    if refused.iter().any(|r| text.contains(r)) {
        return "; check the credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_REGION)";
    }
    match e {
        LsvdError::Denied(_) => {
            "; check the credentials in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_REGION)"
        }
        LsvdError::Invalid(m) if m.contains("bucket does not exist") => {
            "; create the bucket first, or fix the URL"
        }
        e if e.kind() == Kind::Unavailable => {
            "; is the object store running, and are the URL's host and port right?"
        }
        LsvdError::Cache(_) | LsvdError::CacheFull(_) => "",
        LsvdError::Failed(inner) => hint(inner),
        _ => "",
    }
}

/// An error of the object store at `url`, with what to do about it.
fn at(url: &str, e: LsvdError) -> VolumeError {
    let hint = hint(&e);
    VolumeError::S3 { url: url.to_string(), error: e, hint }
}

/// The store a volume's URL names, credentials from the environment.
pub fn store_for(url: &str) -> Result<Store, VolumeError> {
    let loc = blizzard_lsvd::s3::open(url).map_err(|e| at(url, e))?;
    Ok(Store::new(loc.store, &loc.prefix))
}

fn s3_of(sb: &Superblock) -> Result<&S3Backend, VolumeError> {
    sb.backend.s3().ok_or_else(|| VolumeError::Invalid(format!("volume {:?} is not an S3 volume", sb.name)))
}

/// The record of a new S3 volume.
fn record(spec: &VolumeSpec, s3: &S3Spec, uuid: u128, replication: u8, created_unix_s: u64) -> Superblock {
    Superblock {
        name: spec.name.clone(),
        generation: 1,
        size_bytes: spec.size_bytes,
        block_size: RECORD_BLOCK_SIZE,
        segment_tracts: 1,
        replication,
        // Not used by an S3 volume: every flush is durable (the journal's
        // fdatasync), every write journaled before it is acknowledged.
        mode: CommitMode::WriteThrough,
        flush: FlushPolicy::Durable,
        exposure: ExposureLimits::default(),
        created_unix_s,
        log: None,
        backend: Backend::S3(S3Backend {
            url: s3.url.clone(),
            uuid,
            cache_dir: s3.cache_dir.to_string_lossy().into_owned(),
            cache_bytes: s3.cache_bytes,
        }),
        // A clone starts open to all, as a new volume does.
        access: Vec::new(),
        layers: None,
    }
}

fn validate(spec: &VolumeSpec, s3: &S3Spec) -> Result<(), VolumeError> {
    let bad = |m: String| Err(VolumeError::Invalid(m));
    if s3.url.is_empty() || s3.url.len() > S3_URL_LEN_MAX {
        return bad(format!("the S3 URL must be 1..={S3_URL_LEN_MAX} bytes"));
    }
    blizzard_lsvd::s3::parse(&s3.url).map_err(|e| VolumeError::Refused(e.to_string()))?;
    let dir = s3.cache_dir.to_string_lossy();
    if !s3.cache_dir.is_absolute() || s3.cache_dir.to_str().is_none() || dir.len() > CACHE_DIR_LEN_MAX {
        return bad(format!(
            "the cache directory {dir:?} must be an absolute UTF-8 path of at most {CACHE_DIR_LEN_MAX} bytes"
        ));
    }
    if !spec.size_bytes.is_multiple_of(SECTOR) || spec.size_bytes == 0 {
        return bad(format!("size {} must be a positive multiple of {SECTOR} bytes", spec.size_bytes));
    }
    Ok(())
}

/// Creates an S3 volume recorded in `io` (an empty blob that claims the
/// name, under the volume's lease) and opens it. On failure every step
/// already taken is undone (the caller deletes the blob).
pub(crate) async fn create(
    env: Env,
    io: Arc<dyn BlobIo>,
    spec: &VolumeSpec,
    s3: &S3Spec,
) -> Result<Volume, VolumeError> {
    validate(spec, s3)?;
    let url = s3.url.as_str();
    let store = store_for(url)?;
    // One GET and a few listings: the endpoint answers, the credentials
    // and the bucket are good, and the prefix holds nothing.
    match objlog::read_descriptor(&store, None).await {
        Ok(d) => {
            return Err(VolumeError::Refused(format!(
                "{url} already holds volume {:?} ({:032x}): pick another prefix, or delete that volume first",
                d.name, d.uuid
            )))
        }
        Err(LsvdError::NotFound(_)) => {}
        Err(e) => return Err(at(url, e)),
    }
    if lv::holds_objects(&store).await.map_err(|e| at(url, e))? {
        return Err(VolumeError::Refused(format!(
            "{url} holds objects of a volume whose descriptor is gone (a deleted or cut-off one): delete them (under d/, c/ and s/), or pick another prefix"
        )));
    }
    let made = match &s3.clone_of {
        None => {
            lv::create_with(&env, &store, &spec.name, spec.size_bytes, s3.object_bytes, s3.gc_live_pct).await
        }
        Some(base) => {
            let base_store = same_bucket(url, &base.url, &store)?;
            snap::clone_volume(&env, &base_store, &base.name, &base.snapshot, &store, &spec.name)
                .await
                .map_err(|e| match e {
                    LsvdError::NotFound(_) => LsvdError::Invalid(format!(
                        "volume {:?} has no snapshot {:?} (blizzard volume list shows them)",
                        base.name, base.snapshot
                    )),
                    e => e,
                })
        }
    };
    let desc = match made {
        Ok(d) => d,
        // Another create won the prefix since the check above.
        Err(LsvdError::Exists(_)) => {
            return Err(VolumeError::Refused(format!(
                "{url} was just taken by another volume: pick another prefix"
            )))
        }
        Err(e) => return Err(at(url, e)),
    };
    let created = desc.created_secs;
    let sb = record(spec, s3, desc.uuid, io.replication(), created);
    let cache = cache_file(&s3.cache_dir.to_string_lossy());
    let cfg = open_config(s3.cache_bytes);
    let opened = match LsvdVolume::open(env.clone(), store.clone(), Some(&spec.name), &cache, cfg).await {
        Ok(v) => Ok(v),
        Err(e) => Err(open_err(url, &cache, e)),
    };
    let r = match opened {
        Ok(v) => {
            let written = async {
                io.extend_to(1).await?;
                Volume::write_superblock(&io, &sb).await
            }
            .await;
            match written {
                Ok(()) => return Ok(wrap(env, io, sb, v)),
                Err(e) => {
                    let _ = v.close().await;
                    Err(e)
                }
            }
        }
        Err(e) => Err(e),
    };
    // Undo: the objects (descriptor and claim), then the journal file.
    if let Err(e) = lv::destroy(&store, desc.uuid).await {
        tracing::warn!(url, error = %e, "could not delete the objects of a volume whose create failed");
    }
    for file in [cache, read_cache_file(&s3.cache_dir.to_string_lossy())] {
        if let Err(e) = env.remove_disk(&file).await {
            tracing::warn!(cache = %file.display(), error = %e, "could not remove the cache of a volume whose create failed");
        }
    }
    r
}

/// The base's prefix in the store of the clone at `url`: a clone shares
/// its base's objects, so both must be in one bucket of one endpoint.
fn same_bucket(url: &str, base_url: &str, store: &Store) -> Result<Store, VolumeError> {
    let parse = |u: &str| blizzard_lsvd::s3::parse(u).map_err(|e| VolumeError::Refused(e.to_string()));
    let ((e1, b1, _), (e2, b2, base_prefix)) = (parse(url)?, parse(base_url)?);
    if (e1, b1) != (e2, b2) {
        return Err(VolumeError::Refused(format!(
            "a clone shares its base's objects, so it must be in the same bucket: {url} is not beside {base_url}"
        )));
    }
    Ok(store.at(&base_prefix))
}

fn open_err(url: &str, cache: &Path, e: LsvdError) -> VolumeError {
    match e {
        LsvdError::Cache(_) | LsvdError::CacheFull(_) => {
            VolumeError::Refused(format!("cache {}: {e}", cache.parent().unwrap_or(cache).display()))
        }
        e => at(url, e),
    }
}

fn wrap(env: Env, io: Arc<dyn BlobIo>, sb: Superblock, v: LsvdVolume) -> Volume {
    let env_for_volume = env.clone();
    let epoch = v.info().epoch;
    let cache_dir = sb.backend.s3().map(|s| s.cache_dir.clone()).unwrap_or_default();
    let engine = Arc::new(LsvdEngine {
        env: env.clone(),
        vol: v,
        rmw: tokio::sync::Mutex::new(()),
        cache_dir: cache_dir.clone(),
        control: Mutex::new(None),
    });
    let weak: std::sync::Weak<dyn crate::control::Controlled> = Arc::downgrade(&engine) as _;
    let task = crate::control::spawn(env, crate::control::socket_path(&cache_dir), weak);
    *engine.control.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    Volume::with_lsvd(env_for_volume, io, sb, Box::new(engine), epoch)
}

/// Opens snapshot `snapshot` of the S3 volume recorded in `sb`, read-only
/// (no lease: a snapshot never changes, and its writer keeps what it reads).
pub(crate) async fn open_snapshot(
    io: Arc<dyn BlobIo>,
    sb: Superblock,
    snapshot: &str,
) -> Result<Volume, VolumeError> {
    let s3 = s3_of(&sb)?.clone();
    let store = store_for(&s3.url)?;
    let s = LsvdSnapshot::open(store, Some(&sb.name), snapshot).await.map_err(|e| match e {
        LsvdError::NotFound(_) => VolumeError::NotFound(format!("{}@{snapshot}", sb.name)),
        e => at(&s3.url, e),
    })?;
    let mut sb = sb;
    sb.name = format!("{}@{snapshot}", sb.name);
    Ok(Volume::with_lsvd_snapshot(io, sb, Box::new(SnapshotEngine(s))))
}

/// The snapshots of the S3 volume recorded in `sb`, oldest first, with the
/// clones of each; and, for a clone, its base (`NAME@SNAP`).
pub async fn snapshots(sb: &Superblock) -> Result<(Vec<snap::SnapshotInfo>, Option<String>), VolumeError> {
    let s3 = s3_of(sb)?;
    let store = store_for(&s3.url)?;
    let d = objlog::read_descriptor(&store, None).await.map_err(|e| at(&s3.url, e))?;
    let base = match d.base.last() {
        Some(b) => {
            // The base's name, from its descriptor (the chain keeps prefixes).
            let name = objlog::read_descriptor(&store.at(&b.prefix), None)
                .await
                .map(|d| d.name)
                .unwrap_or_else(|_| format!("(gone: {})", b.prefix));
            Some(format!("{name}@{}", b.snapshot))
        }
        None => None,
    };
    Ok((snap::list(&store).await.map_err(|e| at(&s3.url, e))?, base))
}

/// Opens the S3 volume recorded in `sb` for writing: recovery of its
/// object log, its claim, the journal's replay.
pub(crate) async fn open(env: Env, io: Arc<dyn BlobIo>, sb: Superblock) -> Result<Volume, VolumeError> {
    let s3 = s3_of(&sb)?.clone();
    let store = store_for(&s3.url)?;
    let desc = match objlog::read_descriptor(&store, None).await {
        Ok(d) => d,
        Err(LsvdError::NotFound(_)) => {
            return Err(VolumeError::Refused(format!(
                "volume {:?}: {} holds no volume (its objects were deleted?); `blizzard volume delete {}` removes the record",
                sb.name, s3.url, sb.name
            )))
        }
        Err(e) => return Err(at(&s3.url, e)),
    };
    if desc.uuid != s3.uuid || desc.name != sb.name {
        return Err(VolumeError::Refused(format!(
            "volume {:?}: {} holds another volume ({:?}, {:032x}, not {:032x}); refusing to serve it as this one",
            sb.name, s3.url, desc.name, desc.uuid, s3.uuid
        )));
    }
    let cache = cache_file(&s3.cache_dir);
    let cfg = open_config(s3.cache_bytes);
    let v = LsvdVolume::open(env.clone(), store, Some(&sb.name), &cache, cfg)
        .await
        .map_err(|e| open_err(&s3.url, &cache, e))?;
    Ok(wrap(env, io, sb, v))
}

/// What the object store holds of the S3 volume recorded in `sb`, read
/// without opening it (`blizzard volume info`).
pub async fn inspect(sb: &Superblock) -> Result<lv::Summary, VolumeError> {
    let s3 = s3_of(sb)?;
    let store = store_for(&s3.url)?;
    lv::inspect(&store, Some(&sb.name)).await.map_err(|e| at(&s3.url, e))
}

/// Deletes the S3 volume recorded in `sb`'s objects and its journal file
/// (the caller holds its lease, and deletes the record after). Objects
/// under the prefix that belong to another volume are left alone, with a
/// warning. Returns the number of objects deleted.
pub(crate) async fn delete(env: &Env, sb: &Superblock) -> Result<u64, VolumeError> {
    let s3 = s3_of(sb)?;
    let store = store_for(&s3.url)?;
    let n = match lv::destroy(&store, s3.uuid).await {
        Ok(n) => n,
        Err(e @ LsvdError::OtherVolume { .. }) => {
            tracing::warn!(url = %s3.url, error = %e, "the prefix holds another volume now: its objects are left alone");
            0
        }
        Err(e) => return Err(at(&s3.url, e)),
    };
    for file in [cache_file(&s3.cache_dir), read_cache_file(&s3.cache_dir)] {
        env.remove_disk(&file).await.map_err(|e| {
            VolumeError::Refused(format!(
                "the objects are deleted, but not the cache file {}: {e}; remove it by hand",
                file.display()
            ))
        })?;
    }
    Ok(n)
}

/// The engine of an S3 volume behind [`Volume`].
pub(crate) struct LsvdEngine {
    env: Env,
    vol: LsvdVolume,
    /// Writes not in whole sectors, one at a time: two of them in one
    /// sector would each write back the other's old bytes.
    rmw: tokio::sync::Mutex<()>,
    cache_dir: String,
    /// The control socket's task (`control`), stopped at close.
    control: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for LsvdEngine {
    fn drop(&mut self) {
        if let Some(t) = self.control.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
    }
}

impl LsvdEngine {
    /// Stops answering on the control socket and removes it.
    async fn stop_control(&self) {
        let task = self.control.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = task {
            t.abort();
            let _ = self.env.remove_disk(&crate::control::socket_path(&self.cache_dir)).await;
        }
    }

    pub(crate) async fn snapshot(&self, name: &str) -> Result<u64, VolumeError> {
        Ok(self.vol.snapshot(name).await?)
    }

    pub(crate) async fn delete_snapshot(&self, name: &str) -> Result<(), VolumeError> {
        Ok(self.vol.delete_snapshot(name).await?)
    }

    pub(crate) async fn read(&self, offset: u64, len: u64) -> Result<Bytes, VolumeError> {
        Ok(self.vol.read(offset, len).await?)
    }

    /// Writes `data` at `offset`; with `fua`, durable on return.
    pub(crate) async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), VolumeError> {
        let end = offset + data.len() as u64;
        if offset.is_multiple_of(SECTOR) && end.is_multiple_of(SECTOR) {
            return Ok(self.vol.write(offset, data, fua).await?);
        }
        let _one = self.rmw.lock().await;
        // The volume's size is a multiple of the sector: both ends are in it.
        let (a, b) = (offset / SECTOR * SECTOR, end.div_ceil(SECTOR) * SECTOR);
        let mut buf = BytesMut::from(&self.vol.read(a, b - a).await?[..]);
        buf[(offset - a) as usize..(end - a) as usize].copy_from_slice(&data);
        Ok(self.vol.write(a, buf.freeze(), fua).await?)
    }

    /// Makes `[offset, offset + len)` read as zeros.
    pub(crate) async fn zero(&self, offset: u64, len: u64, fua: bool) -> Result<(), VolumeError> {
        let end = offset + len;
        let (a, b) = (offset.div_ceil(SECTOR) * SECTOR, end / SECTOR * SECTOR);
        if a < b {
            if offset < a {
                self.write(offset, Bytes::from(vec![0u8; (a - offset) as usize]), false).await?;
            }
            self.vol.trim(a, b - a).await?;
            if b < end {
                self.write(b, Bytes::from(vec![0u8; (end - b) as usize]), false).await?;
            }
        } else if len > 0 {
            self.write(offset, Bytes::from(vec![0u8; len as usize]), false).await?;
        }
        if fua {
            self.flush().await?;
        }
        Ok(())
    }

    pub(crate) async fn flush(&self) -> Result<(), VolumeError> {
        Ok(self.vol.flush().await?)
    }

    pub(crate) fn allocation(&self, offset: u64, len: u64) -> Result<Vec<AllocExtent>, VolumeError> {
        Ok(self
            .vol
            .allocation(offset, len)?
            .into_iter()
            .map(|(len, data)| AllocExtent::new(len, data))
            .collect())
    }

    /// A clean close: flush, destage (bounded), stop the destager. What
    /// the bound leaves is in the journal, durable, for the next open on
    /// this host; a volume that failed returns its failure.
    pub(crate) async fn shut(&self) -> Result<(), VolumeError> {
        self.stop_control().await;
        self.vol.flush().await?;
        match self.env.timeout(CLOSE_DRAIN_MAX, self.vol.drain()).await {
            Ok(r) => r?,
            Err(_) => tracing::warn!(
                volume = self.vol.name(),
                left = self.vol.info().dirty_bytes,
                "the object store did not take the journal within {} s; the rest stays in the cache for the next open on this host",
                CLOSE_DRAIN_MAX.as_secs()
            ),
        }
        Ok(self.vol.close().await?)
    }
}

/// An S3 volume behind `Volume`.
impl Engine for Arc<LsvdEngine> {
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, VolumeError>> {
        Box::pin(LsvdEngine::read(self, offset, len))
    }

    fn write(&self, offset: u64, data: Data, fua: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            match data {
                Data::Bytes(b) => LsvdEngine::write(self, offset, b, fua).await,
                Data::Zero(len) => self.zero(offset, len, fua).await,
            }
        })
    }

    /// Every flush is durable: one `fdatasync` of the journal.
    fn flush(&self, _durable: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(LsvdEngine::flush(self))
    }

    fn allocation(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>> {
        let r = LsvdEngine::allocation(self, offset, len);
        Box::pin(async move { r })
    }

    fn resize<'a>(
        &'a self,
        _next: crate::Superblock,
        _commit: Commit<'a>,
    ) -> BoxFuture<'a, Result<crate::Superblock, VolumeError>> {
        Box::pin(async { Err(s3_cannot_resize()) })
    }

    fn reach(&self) -> u64 {
        self.vol.size()
    }

    fn close(&self) -> BoxFuture<'_, Result<(), VolumeError>> {
        // Destage what the journal holds, so the next open need not be on
        // this host; then stop the destager.
        Box::pin(self.shut())
    }

    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(LsvdEngine::snapshot(self, name))
    }

    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), VolumeError>> {
        Box::pin(LsvdEngine::delete_snapshot(self, name))
    }

    fn s3_info(&self) -> Option<blizzard_lsvd::Info> {
        Some(self.vol.info())
    }

    fn s3_counts(&self) -> Option<blizzard_lsvd::store::CountsNow> {
        Some(self.vol.counts().now())
    }
}

/// The control socket's target (`control`).
impl crate::control::Controlled for LsvdEngine {
    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(LsvdEngine::snapshot(self, name))
    }

    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(async move { LsvdEngine::delete_snapshot(self, name).await.map(|()| 0) })
    }

    fn resize(&self, _size: u64, _allow_shrink: bool) -> BoxFuture<'_, Result<u64, VolumeError>> {
        Box::pin(async { Err(s3_cannot_resize()) })
    }

    fn rollback<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>> {
        Box::pin(async move {
            Err(VolumeError::Unsupported(format!(
                "S3 volumes are not rolled back in place yet: clone the snapshot instead (volume clone NAME@{name} NEW)"
            )))
        })
    }
}

/// S3 volumes keep their size in their descriptor, checkpoints and
/// object headers (design 0008): resizing them is not built yet.
fn s3_cannot_resize() -> VolumeError {
    VolumeError::Unsupported(
        "S3 volumes cannot be resized yet (issue 57): copy the data to a new volume of the size wanted"
            .into(),
    )
}

/// A snapshot of an S3 volume (`NAME@SNAP`), read-only, behind `Volume`.
pub(crate) struct SnapshotEngine(pub(crate) LsvdSnapshot);

impl Engine for SnapshotEngine {
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, VolumeError>> {
        Box::pin(async move { Ok(self.0.read(offset, len).await?) })
    }

    fn write(&self, _offset: u64, _data: Data, _fua: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async { Err(VolumeError::Unsupported("a snapshot is read-only".into())) })
    }

    fn reach(&self) -> u64 {
        self.0.size()
    }

    fn flush(&self, _durable: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async { Ok(()) })
    }

    fn allocation(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>> {
        let r = self
            .0
            .allocation(offset, len)
            .map(|v| v.into_iter().map(|(len, data)| AllocExtent::new(len, data)).collect());
        Box::pin(async move { Ok(r?) })
    }

    fn resize<'a>(
        &'a self,
        _next: crate::Superblock,
        _commit: Commit<'a>,
    ) -> BoxFuture<'a, Result<crate::Superblock, VolumeError>> {
        Box::pin(async { Err(VolumeError::Unsupported("a snapshot is read-only".into())) })
    }

    fn s3_counts(&self) -> Option<blizzard_lsvd::store::CountsNow> {
        Some(self.0.counts().now())
    }
}

impl From<LsvdError> for VolumeError {
    fn from(e: LsvdError) -> Self {
        VolumeError::Lsvd(e)
    }
}

/// LSVD's kinds are the same as the volume's.
pub(crate) fn kind(e: &LsvdError) -> ErrorKind {
    match e.kind() {
        Kind::NoSpace => ErrorKind::NoSpace,
        Kind::OutOfRange => ErrorKind::OutOfRange,
        Kind::Invalid => ErrorKind::Invalid,
        Kind::Fenced => ErrorKind::Fenced,
        Kind::Corrupt => ErrorKind::Corrupt,
        Kind::Unavailable => ErrorKind::Unavailable,
    }
}
