//! The volume's blob as its engines see it once it can have snapshots: a
//! [`BlobIo`] whose tracts are the volume's (tract 0, then its data
//! tracts), each chunk read from the newest layer holding it and every
//! change written to the head (design 0011).
//!
//! | call | here |
//! |---|---|
//! | tract 0 (superblock, intent log) | the blob's tract 0, as it is |
//! | read, `read_replicas` | per run of chunks from one layer: that layer's tract; zeros where no layer holds a chunk |
//! | write, `write_cached` | the head's tract. A chunk the head lacks is locked while it is first written; a partial one that an older layer holds is read from there and written whole (copy-on-write of one 4 KiB chunk, never more) |
//! | trim | the head's tract where no older layer holds the chunk; zeros written where one does, so the older data stays hidden |
//! | `mapped` | the view's: the head's chunks, or an older layer's |
//! | `reconcile` | the head's tract (only the head is written), then its chunk map asked again |
//! | everything else | the blob |
//!
//! Invariant (what makes reads right): a chunk's bit in `head` is set only
//! once the head holds it on every replica it was written to, and a read
//! takes the head's copy exactly when the bit is set; every other chunk is
//! read from the newest frozen layer holding it, which never changes while
//! a view can read it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_core::limits::CHUNK_SIZE;
use blizzard_core::reconcile::Reconciled;
use blizzard_env::lock;

use super::map::{TractBits, View};
use crate::io::{BlobIo, CacheReceipt, IoError};
use crate::PlantedBug;

const CHUNK: u64 = CHUNK_SIZE as u64;

/// Held while a chunk is first written to the head.
type ChunkLock = Arc<tokio::sync::Mutex<()>>;

/// The head and the frozen layers under it.
#[derive(Clone)]
pub(crate) struct Stack {
    /// The head's id and base (`None` for a snapshot's read-only view).
    pub head: Option<(u32, u64)>,
    /// The frozen layers' view.
    pub frozen: Arc<View>,
    /// Every layer's base, by id.
    pub bases: HashMap<u32, u64>,
    /// Volume tracts (tract 0 included).
    pub tracts: u64,
}

impl Stack {
    /// A volume that never had a snapshot: layer 0 at base 1, alone.
    pub fn plain(tracts: u64, chunks_per_tract: u32) -> Stack {
        Stack {
            head: Some((0, 1)),
            frozen: Arc::new(View::empty(chunks_per_tract)),
            bases: HashMap::from([(0, 1)]),
            tracts,
        }
    }

    fn phys(&self, layer: u32, tract: u64) -> u64 {
        self.bases.get(&layer).map_or(tract, |b| b + tract - 1)
    }
}

/// Where one run of chunks is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Layer(u32),
    Zeros,
}

pub struct LayeredIo {
    blob: Arc<dyn BlobIo>,
    stack: RwLock<Stack>,
    /// The head's chunks, per volume tract (absent: none). Kept only while
    /// frozen layers exist: with none, every chunk is the head's or zeros
    /// either way, and nothing needs it.
    head: Mutex<HashMap<u64, TractBits>>,
    /// Chunks being written to the head for the first time, each locked
    /// by its writer (two first writes to one chunk must not both copy).
    first: Mutex<HashMap<(u64, u32), ChunkLock>>,
    chunks_per_tract: u32,
    planted: PlantedBug,
}

impl LayeredIo {
    pub(crate) fn new(blob: Arc<dyn BlobIo>, stack: Stack, planted: PlantedBug) -> Arc<LayeredIo> {
        let chunks_per_tract = blob.tract_size() / CHUNK_SIZE;
        Arc::new(LayeredIo {
            blob,
            stack: RwLock::new(stack),
            head: Mutex::new(HashMap::new()),
            first: Mutex::new(HashMap::new()),
            chunks_per_tract,
            planted,
        })
    }

    /// The blob under the layers.
    pub fn blob(&self) -> &Arc<dyn BlobIo> {
        &self.blob
    }

    pub(crate) fn stack(&self) -> Stack {
        self.stack.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The head's chunks now (for freezing it).
    pub(crate) fn head_bits(&self) -> HashMap<u64, TractBits> {
        lock(&self.head).clone()
    }

    /// Switches to a new stack (a snapshot taken: the head frozen, a new
    /// empty head). The caller has stopped every write first.
    pub(crate) fn switch(&self, stack: Stack) {
        *self.stack.write().unwrap_or_else(|p| p.into_inner()) = stack;
        lock(&self.head).clear();
    }

    /// Switches to a new stack whose head already holds `head`'s chunks
    /// (a rollback's restored ones). The caller has stopped every write.
    pub(crate) fn switch_to_head(&self, stack: Stack, head: HashMap<u64, TractBits>) {
        *self.stack.write().unwrap_or_else(|p| p.into_inner()) = stack;
        *lock(&self.head) = head;
    }

    fn layered(s: &Stack) -> bool {
        !s.frozen.layers().is_empty()
    }

    fn head_has(&self, tract: u64, chunk: u32) -> bool {
        lock(&self.head).get(&tract).is_some_and(|b| b.has(chunk))
    }

    fn set_head(&self, tract: u64, chunks: std::ops::Range<u32>) {
        let cpt = self.chunks_per_tract;
        let mut h = lock(&self.head);
        if chunks.start == 0 && chunks.end >= cpt {
            h.insert(tract, TractBits::Full);
            return;
        }
        let e =
            h.entry(tract).or_insert_with(|| TractBits::Bits(vec![0u8; (cpt as usize).div_ceil(8)].into()));
        if let TractBits::Bits(b) = e {
            for c in chunks {
                b[c as usize / 8] |= 1 << (c % 8);
            }
            if (0..cpt).all(|c| b[c as usize / 8] >> (c % 8) & 1 == 1) {
                *e = TractBits::Full;
            }
        }
    }

    fn clear_head(&self, tract: u64, chunks: std::ops::Range<u32>) {
        let cpt = self.chunks_per_tract;
        let mut h = lock(&self.head);
        let Some(e) = h.get_mut(&tract) else { return };
        if let TractBits::Full = e {
            *e = TractBits::Bits(vec![0xffu8; (cpt as usize).div_ceil(8)].into());
        }
        if let TractBits::Bits(b) = e {
            for c in chunks {
                b[c as usize / 8] &= !(1 << (c % 8));
            }
            if b.iter().all(|&x| x == 0) {
                h.remove(&tract);
            }
        }
    }

    /// Where each chunk of `[offset, offset + len)` of volume tract
    /// `tract` reads from, as runs: (byte offset, byte length, source).
    fn runs(&self, s: &Stack, tract: u64, offset: u32, len: u32) -> Vec<(u32, u32, Source)> {
        let (start, end) = (offset as u64, offset as u64 + len as u64);
        let head_id = s.head.map(|h| h.0);
        let heads = lock(&self.head);
        let held = heads.get(&tract);
        let mut out: Vec<(u32, u32, Source)> = Vec::new();
        let mut at = start;
        while at < end {
            let c = (at / CHUNK) as u32;
            let next = ((c as u64 + 1) * CHUNK).min(end);
            let src = match head_id {
                Some(h) if !Self::layered(s) || held.is_some_and(|b| b.has(c)) => Source::Layer(h),
                _ => s.frozen.layer_of(tract, c).map_or(Source::Zeros, Source::Layer),
            };
            match out.last_mut() {
                Some(last) if last.2 == src => last.1 += (next - at) as u32,
                _ => out.push((at as u32, (next - at) as u32, src)),
            }
            at = next;
        }
        out
    }

    /// Reads `[offset, offset + len)` of volume tract `tract` through the
    /// stack `s`.
    fn read_through(
        &self,
        s: &Stack,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Bytes, IoError>> {
        if let (Some((head, _)), false) = (s.head, Self::layered(s)) {
            return self.blob.read(s.phys(head, tract), offset, len);
        }
        let runs = self.runs(s, tract, offset, len);
        let reads: Vec<_> = runs
            .iter()
            .map(|&(at, n, src)| match src {
                Source::Layer(l) => self.blob.read(s.phys(l, tract), at, n),
                Source::Zeros => async move { Ok(Bytes::from(vec![0u8; n as usize])) }.boxed(),
            })
            .collect();
        async move {
            if reads.len() == 1 {
                return reads.into_iter().next().expect("one read").await;
            }
            let mut buf = BytesMut::with_capacity(len as usize);
            for r in futures::future::join_all(reads).await {
                buf.extend_from_slice(&r?);
            }
            Ok(buf.freeze())
        }
        .boxed()
    }

    /// A change to chunks `[first, last]` of volume tract `tract`: locks the
    /// chunks the head lacks, copies the partial ones an older layer holds,
    /// writes through `put` (the head's tract, the widened offset and
    /// data), marks them the head's. `data` is `None` for zeros.
    async fn change<T, F>(
        self: Arc<Self>,
        tract: u64,
        offset: u32,
        data: Option<Bytes>,
        len: u32,
        put: F,
    ) -> Result<T, IoError>
    where
        F: FnOnce(u64, u32, Bytes) -> BoxFuture<'static, Result<T, IoError>>,
    {
        let s = self.stack();
        let Some((head, _)) = s.head else {
            return Err(IoError::Other("a snapshot is read-only".into()));
        };
        let (start, end) = (offset as u64, offset as u64 + len as u64);
        let (c0, c1) = ((start / CHUNK) as u32, (end.div_ceil(CHUNK)) as u32);
        let bytes = |d: &Option<Bytes>| d.clone().unwrap_or_else(|| Bytes::from(vec![0u8; len as usize]));
        if !Self::layered(&s) {
            return put(s.phys(head, tract), offset, bytes(&data)).await;
        }
        // Lock the chunks the head lacks, in order (no two writers wait
        // on each other's), then look again: one may have been written
        // while this waited.
        let lacking: Vec<u32> = {
            let h = lock(&self.head);
            let held = h.get(&tract);
            (c0..c1).filter(|&c| !held.is_some_and(|b| b.has(c))).collect()
        };
        let mut guards = Vec::with_capacity(lacking.len());
        for &c in &lacking {
            let m = lock(&self.first).entry((tract, c)).or_default().clone();
            guards.push((c, m.clone(), m.lock_owned().await));
        }
        if self.planted == PlantedBug::WriteIntoSnapshot {
            // The bug: a chunk an older layer holds is written where it is.
            if let Some(l) =
                (c0..c1).find_map(|c| s.frozen.layer_of(tract, c)).filter(|_| !lacking.is_empty())
            {
                return put(s.phys(l, tract), offset, bytes(&data)).await;
            }
        }
        let r = async {
            let mut w_start = start;
            let mut w_end = end;
            let mut head_part: Option<Bytes> = None;
            let mut tail_part: Option<Bytes> = None;
            // The partial chunks at either end that an older layer holds
            // and the head lacks: read whole from that layer.
            let first_partial = !start.is_multiple_of(CHUNK);
            let last_partial = !end.is_multiple_of(CHUNK);
            for (c, partial) in [(c0, first_partial), (c1 - 1, last_partial)] {
                if !partial || self.head_has(tract, c) {
                    continue;
                }
                let Some(l) = s.frozen.layer_of(tract, c) else { continue };
                let at = c as u64 * CHUNK;
                let old = self.blob.read(s.phys(l, tract), at as u32, CHUNK_SIZE).await?;
                if c == c0 && first_partial {
                    w_start = at;
                    head_part = Some(old.clone());
                }
                if c == c1 - 1 && last_partial {
                    w_end = at + CHUNK;
                    tail_part = Some(old);
                }
            }
            let payload = if w_start == start && w_end == end {
                bytes(&data)
            } else {
                let mut b = BytesMut::zeroed((w_end - w_start) as usize);
                if let Some(h) = &head_part {
                    b[..CHUNK as usize].copy_from_slice(h);
                }
                if let Some(t) = &tail_part {
                    let n = b.len();
                    b[n - CHUNK as usize..].copy_from_slice(t);
                }
                let at = (start - w_start) as usize;
                match &data {
                    Some(d) => b[at..at + len as usize].copy_from_slice(d),
                    None => b[at..at + len as usize].fill(0),
                }
                b.freeze()
            };
            let v = put(s.phys(head, tract), w_start as u32, payload).await?;
            self.set_head(tract, c0..c1);
            Ok(v)
        }
        .await;
        for (c, m, g) in guards {
            drop(g);
            let mut f = lock(&self.first);
            if f.get(&(tract, c)).is_some_and(|x| Arc::ptr_eq(x, &m) && Arc::strong_count(x) == 2) {
                f.remove(&(tract, c));
            }
        }
        r
    }

    /// Makes volume tract `tract`'s head bits what the tractservers hold.
    async fn refresh(&self, tract: u64) -> Result<(), IoError> {
        let s = self.stack();
        let (Some((head, _)), true) = (s.head, Self::layered(&s)) else { return Ok(()) };
        let bits = self.blob.mapped(s.phys(head, tract)).await?;
        let mut h = lock(&self.head);
        match TractBits::from_mapped(&bits, self.chunks_per_tract) {
            Some(b) => h.insert(tract, b),
            None => h.remove(&tract),
        };
        Ok(())
    }

    /// Loads the head's bits for volume tracts `1..tracts` (an open of a
    /// volume with frozen layers), `parallel` requests at a time.
    pub(crate) async fn load_head(&self, parallel: usize) -> Result<(), IoError> {
        use futures::StreamExt;
        let s = self.stack();
        if !Self::layered(&s) {
            return Ok(());
        }
        let mut results = futures::stream::iter(1..s.tracts)
            .map(|t| async move { (t, self.refresh(t).await) })
            .buffer_unordered(parallel.max(1));
        while let Some((_, r)) = results.next().await {
            r?;
        }
        Ok(())
    }
}

/// `BlobIo` wants `&self`; the writes need an owned handle for their
/// futures. `LayeredIo` is always behind an `Arc`; this gets it back.
pub struct Layered(pub Arc<LayeredIo>);

impl Layered {
    pub fn io(&self) -> &Arc<LayeredIo> {
        &self.0
    }
}

impl BlobIo for Layered {
    fn tract_size(&self) -> u32 {
        self.0.blob.tract_size()
    }

    fn replication(&self) -> u8 {
        self.0.blob.replication()
    }

    fn size_tracts(&self) -> u64 {
        self.0.stack().tracts
    }

    /// Past the volume's tracts, a frozen layer made while the volume was
    /// larger may still hold data (a grow must hide it).
    fn reach_tracts(&self) -> u64 {
        let s = self.0.stack();
        s.tracts.max(s.frozen.end_tract())
    }

    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        let me = self.0.clone();
        async move {
            let s = me.stack();
            let Some((head, _)) = s.head else { return Ok(s.tracts) };
            if tracts > s.tracts {
                // The head is the last layer, at the blob's end: it grows
                // in place. Tracts past its end that a snapshot cut off by
                // a crash wrote (nothing names them) are trimmed first, so
                // the bytes gained read as zeros.
                let (from, to) = (s.phys(head, s.tracts), s.phys(head, tracts));
                let written_end = me.blob.size_tracts().min(to);
                for t in from..written_end {
                    me.blob.trim(t, 0, me.blob.tract_size()).await?;
                }
                me.blob.extend_to(to).await?;
                let mut st = me.stack.write().unwrap_or_else(|p| p.into_inner());
                st.tracts = st.tracts.max(tracts);
            }
            Ok(me.stack().tracts)
        }
        .boxed()
    }

    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        if tract == 0 {
            return self.0.blob.write(0, offset, data);
        }
        let (me, blob) = (self.0.clone(), self.0.blob.clone());
        let len = data.len() as u32;
        me.change(tract, offset, Some(data), len, move |t, o, d| blob.write(t, o, d)).boxed()
    }

    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        if tract == 0 {
            return self.0.blob.write_cached(0, offset, data);
        }
        let (me, blob) = (self.0.clone(), self.0.blob.clone());
        let len = data.len() as u32;
        let exact = (offset, len);
        me.change(tract, offset, Some(data), len, move |t, o, d| {
            if (o, d.len() as u32) == exact {
                blob.write_cached(t, o, d)
            } else {
                // A chunk copied from an older layer is written durably: a
                // tractserver that lost it from its write cache would read
                // the copied bytes as zeros, and the volume's own cache
                // holds only the bytes the write brought.
                let w = blob.write(t, o, d);
                async move { w.await.map(|_| CacheReceipt::new()) }.boxed()
            }
        })
        .boxed()
    }

    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        if tract == 0 {
            return self.0.blob.read(0, offset, len);
        }
        let s = self.0.stack();
        self.0.read_through(&s, tract, offset, len)
    }

    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        if tract == 0 {
            return self.0.blob.read_replicas(0, offset, len);
        }
        let s = self.0.stack();
        let runs = self.0.runs(&s, tract, offset, len);
        let replication = self.0.blob.replication().max(1) as usize;
        let reads: Vec<_> = runs
            .iter()
            .map(|&(at, n, src)| match src {
                Source::Layer(l) => self.0.blob.read_replicas(s.phys(l, tract), at, n),
                Source::Zeros => {
                    async move { Ok(vec![Bytes::from(vec![0u8; n as usize]); replication]) }.boxed()
                }
            })
            .collect();
        async move {
            let mut parts = Vec::with_capacity(reads.len());
            for r in futures::future::join_all(reads).await {
                parts.push(r?);
            }
            if parts.len() == 1 {
                return Ok(parts.pop().unwrap_or_default());
            }
            let n = parts.iter().map(Vec::len).min().unwrap_or(0);
            Ok((0..n)
                .map(|i| {
                    let mut b = BytesMut::with_capacity(len as usize);
                    for p in &parts {
                        b.extend_from_slice(&p[i]);
                    }
                    b.freeze()
                })
                .collect())
        }
        .boxed()
    }

    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        if tract == 0 {
            return self.0.blob.trim(0, offset, len);
        }
        let me = self.0.clone();
        async move {
            let s = me.stack();
            let Some((head, _)) = s.head else {
                return Err(IoError::Other("a snapshot is read-only".into()));
            };
            if !LayeredIo::layered(&s) {
                return me.blob.trim(s.phys(head, tract), offset, len).await;
            }
            // Runs of chunks an older layer holds (zeros written over them)
            // and runs it does not (trimmed in the head).
            let (start, end) = (offset as u64, offset as u64 + len as u64);
            let mut at = start;
            let mut pieces: Vec<(u64, u64, bool)> = Vec::new();
            while at < end {
                let c = (at / CHUNK) as u32;
                let next = ((c as u64 + 1) * CHUNK).min(end);
                let shadow = s.frozen.layer_of(tract, c).is_some();
                match pieces.last_mut() {
                    Some(p) if p.2 == shadow => p.1 = next,
                    _ => pieces.push((at, next, shadow)),
                }
                at = next;
            }
            for (a, b, shadow) in pieces {
                let (o, n) = (a as u32, (b - a) as u32);
                if shadow {
                    let blob = me.blob.clone();
                    me.clone().change(tract, o, None, n, move |t, o, d| blob.write(t, o, d)).await?;
                } else {
                    me.blob.trim(s.phys(head, tract), o, n).await?;
                    // Whole chunks trimmed are no longer the head's.
                    let (c0, c1) = (a.div_ceil(CHUNK) as u32, (b / CHUNK) as u32);
                    if c0 < c1 {
                        me.clear_head(tract, c0..c1);
                    }
                }
            }
            Ok(())
        }
        .boxed()
    }

    fn mapped(&self, tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        let s = self.0.stack();
        let Some((head, _)) = s.head.filter(|_| tract == 0 || !LayeredIo::layered(&s)) else {
            let cpt = self.0.chunks_per_tract;
            let me = self.0.clone();
            return async move {
                let mut b = vec![0u8; (cpt as usize).div_ceil(8)];
                for c in 0..cpt {
                    let held =
                        s.head.is_some() && me.head_has(tract, c) || s.frozen.layer_of(tract, c).is_some();
                    if held {
                        b[c as usize / 8] |= 1 << (c % 8);
                    }
                }
                Ok(b)
            }
            .boxed();
        };
        self.0.blob.mapped(if tract == 0 { 0 } else { s.phys(head, tract) })
    }

    fn sync(&self, receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        self.0.blob.sync(receipt)
    }

    fn set_writer(&self, epoch: u64) {
        self.0.blob.set_writer(epoch)
    }

    fn writer_floor(&self) -> u64 {
        self.0.blob.writer_floor()
    }

    fn release(&self) -> BoxFuture<'static, Result<(), IoError>> {
        self.0.blob.release()
    }

    /// Only the head is written, so only its tracts can differ between
    /// replicas; its chunk map is asked again after.
    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        let s = self.0.stack();
        let Some((head, _)) = s.head else {
            return async { Ok(Reconciled { tracts: 1, ..Reconciled::default() }) }.boxed();
        };
        if tract == 0 {
            return self.0.blob.reconcile(0);
        }
        let me = self.0.clone();
        let r = self.0.blob.reconcile(s.phys(head, tract));
        async move {
            let done = r.await?;
            me.refresh(tract).await?;
            Ok(done)
        }
        .boxed()
    }
}
