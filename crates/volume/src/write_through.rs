//! The write-through engine (Blizzard §2.5): a write goes to the blob at
//! once, through the striping map, and is acknowledged when it is durable
//! on every replica; a flush has nothing to wait for.
//!
//! It owns its blob I/O, its striping and its write-intent log (`intent`):
//! a write's tracts are marked on every replica before the write goes out,
//! so a crash leaves a record of every tract whose replicas may differ.
//! A read-only handle (`Volume::open_read_only`) has no intent log.
//!
//! What writes in place shares with fast-ack is here too:
//! [`blob_allocation`] (the tractservers' chunk bitmaps) and
//! [`grow_in_place`] (a resize of a volume in place).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::cache::Data;
use crate::engine::{AllocExtent, Commit, Engine, Runs};
use crate::extent_io;
use crate::intent::{self, IntentLog};
use crate::io::BlobIo;
use crate::striping::Striping;
use crate::superblock::Superblock;
use crate::VolumeError;

pub(crate) struct WriteThrough {
    io: Arc<dyn BlobIo>,
    striping: Striping,
    intent: Option<Arc<IntentLog>>,
}

impl WriteThrough {
    pub(crate) fn new(
        io: Arc<dyn BlobIo>,
        striping: Striping,
        intent: Option<Arc<IntentLog>>,
    ) -> WriteThrough {
        WriteThrough { io, striping, intent }
    }
}

/// Before a read of an engine that writes in place: a failed write may
/// have left these tracts different on different replicas, so they are
/// made to agree first.
pub(crate) async fn settle_suspects(
    intent: Option<&Arc<IntentLog>>,
    striping: &Striping,
    offset: u64,
    len: u64,
) -> Result<(), VolumeError> {
    match intent.filter(|i| i.has_suspects()) {
        Some(i) => i.settle(&striping.tracts(offset, len)).await,
        None => Ok(()),
    }
}

/// What `[offset, offset + len)` of a volume written in place holds: the
/// chunk bitmaps of the tracts it touches (one request per tract, in
/// parallel), with `cached` (acknowledged writes not yet on the blob,
/// taken by the caller *before* this call) laid over them. Taking the
/// cache first is what makes it safe: an entry leaves the cache only once
/// its write is on the blob, so every acknowledged write is in the cache
/// taken or in the bitmaps read after it.
pub(crate) async fn blob_allocation(
    io: &Arc<dyn BlobIo>,
    striping: &Striping,
    offset: u64,
    len: u64,
    cached: &[(u64, Data)],
) -> Result<Vec<AllocExtent>, VolumeError> {
    let pieces = striping.pieces(offset, len);
    let tracts: BTreeSet<u64> = pieces.iter().map(|p| p.tract).collect();
    let maps = futures::future::join_all(tracts.iter().map(|&t| io.mapped(t))).await;
    let mut bitmaps = HashMap::new();
    for (t, m) in tracts.into_iter().zip(maps) {
        bitmaps.insert(t, m?);
    }
    let chunk = blizzard_core::limits::CHUNK_SIZE as u64;
    let mut runs = Runs::default();
    for p in &pieces {
        let bm = bitmaps.get(&p.tract).map(Vec::as_slice).unwrap_or(&[]);
        let (mut at, end) = (p.offset as u64, p.offset as u64 + p.len as u64);
        while at < end {
            let c = at / chunk;
            let next = ((c + 1) * chunk).min(end);
            let data = bm.get((c / 8) as usize).is_some_and(|b| b >> (c % 8) & 1 == 1);
            let vol_at = offset + p.buf_at as u64 + (at - p.offset as u64);
            runs.push(vol_at, vol_at + (next - at), data);
            at = next;
        }
    }
    runs.overlay(cached);
    Ok(runs.into_extents())
}

/// A volume's intent bitmap (in tract 0) must have a bit for every tract
/// the volume uses.
pub(crate) fn check_intent_capacity(st: &Striping, size_bytes: u64) -> Result<(), VolumeError> {
    let cap = intent::capacity(st.tract_size as u32);
    let need = st.tracts_for(size_bytes);
    if need > cap {
        return Err(VolumeError::Invalid(format!(
            "a volume of {size_bytes} bytes uses {need} tracts of {} bytes, more than its write-intent bitmap covers ({cap}); use a cluster with larger tracts, or the log commit mode",
            st.tract_size
        )));
    }
    Ok(())
}

/// Grows a volume written in place to `next.size_bytes`: the blob is
/// extended first (its new tracts read as zeros), then `commit` writes
/// the superblock, which is the switch.
pub(crate) async fn grow_in_place(
    io: &Arc<dyn BlobIo>,
    striping: &Striping,
    intent: Option<&Arc<IntentLog>>,
    next: Superblock,
    commit: Commit<'_>,
) -> Result<Superblock, VolumeError> {
    if intent.is_some() {
        check_intent_capacity(striping, next.size_bytes)?;
    }
    io.extend_to(striping.tracts_for(next.size_bytes)).await?;
    commit(next.clone()).await?;
    Ok(next)
}

impl Engine for WriteThrough {
    fn read(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Bytes, VolumeError>> {
        Box::pin(async move {
            settle_suspects(self.intent.as_ref(), &self.striping, offset, len).await?;
            Ok(extent_io::read(&self.io, &self.striping, offset, len).await?)
        })
    }

    fn write(&self, offset: u64, data: Data, _fua: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            let Some(i) = &self.intent else {
                return Ok(extent_io::write(&self.io, &self.striping, offset, &data).await?);
            };
            // The tracts' intent bits are durable on every replica before
            // the write goes out (`intent`).
            let guard = i.enter(&self.striping.tracts(offset, data.len())).await?;
            let r = extent_io::write(&self.io, &self.striping, offset, &data).await;
            guard.finish(r.is_ok());
            Ok(r?)
        })
    }

    /// Every acknowledged write is already durable on every replica.
    fn flush(&self, _durable: bool) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async { Ok(()) })
    }

    fn allocation(&self, offset: u64, len: u64) -> BoxFuture<'_, Result<Vec<AllocExtent>, VolumeError>> {
        Box::pin(blob_allocation(&self.io, &self.striping, offset, len, &[]))
    }

    fn resize<'a>(
        &'a self,
        next: Superblock,
        commit: Commit<'a>,
    ) -> BoxFuture<'a, Result<Superblock, VolumeError>> {
        Box::pin(grow_in_place(&self.io, &self.striping, self.intent.as_ref(), next, commit))
    }

    fn reach(&self) -> u64 {
        self.striping.bytes_in(self.io.reach_tracts())
    }

    fn quiesce(&self) -> BoxFuture<'_, Result<(), VolumeError>> {
        Box::pin(async move {
            match &self.intent {
                Some(i) => i.close().await,
                None => Ok(()),
            }
        })
    }

    fn intent(&self) -> Option<&Arc<IntentLog>> {
        self.intent.as_ref()
    }
}
