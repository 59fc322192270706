//! Which layer holds each chunk (pure; design 0011).
//!
//! A volume with snapshots is a stack of **layers** in its one blob, each
//! a range of tracts laid out as the volume's own (tract `t` of the volume
//! is tract `base + t - 1` of the blob in a layer at `base`). Layer 0 is
//! the volume's original data, at base 1, so a volume that never had a
//! snapshot is layer 0 alone, byte for byte the format before snapshots.
//! Only the newest layer, the **head**, is written. A **view** is a prefix
//! of the stack: a snapshot reads the layers up to its own, the volume
//! reads them all. In a view, a chunk reads from the newest layer that
//! holds it, and as zeros if none does.
//!
//! - [`Presence`]: the chunks one layer holds, per tract: all, or a bitmap
//!   in the tractservers' own format (`BlobIo::mapped`). A frozen layer's
//!   is written once, when it is frozen; the head's is asked of the
//!   tractservers at open and kept in memory after.
//! - [`View`]: for each chunk of a prefix of layers, the newest holding
//!   it: built once per open (the frozen layers), then looked up per I/O.

use std::collections::BTreeMap;

use blizzard_core::crc::crc32c;

/// The chunks of one tract a layer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TractBits {
    /// Every chunk.
    Full,
    /// Bit `i` (LSB first) for chunk `i`: `BlobIo::mapped`'s format.
    Bits(Box<[u8]>),
}

impl TractBits {
    pub fn has(&self, chunk: u32) -> bool {
        match self {
            TractBits::Full => true,
            TractBits::Bits(b) => b.get(chunk as usize / 8).is_some_and(|x| x >> (chunk % 8) & 1 == 1),
        }
    }

    /// From a `mapped` answer for a tract of `chunks` chunks: `None` when
    /// the tract holds nothing.
    pub fn from_mapped(bits: &[u8], chunks: u32) -> Option<TractBits> {
        let set =
            (0..chunks).filter(|&c| bits.get(c as usize / 8).is_some_and(|x| x >> (c % 8) & 1 == 1)).count();
        match set as u32 {
            0 => None,
            n if n == chunks => Some(TractBits::Full),
            _ => {
                let mut b = vec![0u8; (chunks as usize).div_ceil(8)];
                for c in 0..chunks {
                    if bits.get(c as usize / 8).is_some_and(|x| x >> (c % 8) & 1 == 1) {
                        b[c as usize / 8] |= 1 << (c % 8);
                    }
                }
                Some(TractBits::Bits(b.into_boxed_slice()))
            }
        }
    }
}

/// The chunks one layer holds: volume tract → its chunks (tracts holding
/// none are absent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Presence {
    pub tracts: BTreeMap<u64, TractBits>,
}

/// Why a record read from the disk was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("not a {0} record (bad magic)")]
    Magic(&'static str),
    #[error("{0} record format {1} is not supported by this build")]
    Format(&'static str, u32),
    #[error("{0} record fails its CRC32C (torn or damaged)")]
    Crc(&'static str),
    #[error("{0} record field {1} is invalid")]
    Field(&'static str, &'static str),
}

const PRESENCE_MAGIC: [u8; 8] = *b"BLZLAYER";
const PRESENCE_FORMAT: u32 = 1;
/// magic, format, layer, chunks per tract, tracts, body length; then the
/// body; then the CRC32C of everything before it.
const PRESENCE_HEADER: usize = 8 + 4 + 4 + 4 + 8 + 8;

impl Presence {
    pub fn has(&self, tract: u64, chunk: u32) -> bool {
        self.tracts.get(&tract).is_some_and(|b| b.has(chunk))
    }

    /// Chunks held, for space figures.
    pub fn chunks(&self, chunks_per_tract: u32) -> u64 {
        self.tracts
            .values()
            .map(|b| match b {
                TractBits::Full => chunks_per_tract as u64,
                TractBits::Bits(b) => b.iter().map(|x| x.count_ones() as u64).sum(),
            })
            .sum()
    }

    /// The record of layer `layer`'s presence, for tracts of
    /// `chunks_per_tract` chunks: per tract its number, 0 (all) or 1 (a
    /// bitmap of `chunks_per_tract` bits).
    pub fn encode(&self, layer: u32, chunks_per_tract: u32) -> Vec<u8> {
        let bitmap = (chunks_per_tract as usize).div_ceil(8);
        let mut body = Vec::new();
        for (t, b) in &self.tracts {
            body.extend_from_slice(&t.to_le_bytes());
            match b {
                TractBits::Full => body.push(0),
                TractBits::Bits(bits) => {
                    body.push(1);
                    let mut x = bits.to_vec();
                    x.resize(bitmap, 0);
                    body.extend_from_slice(&x);
                }
            }
        }
        let mut out = Vec::with_capacity(PRESENCE_HEADER + body.len() + 4);
        out.extend_from_slice(&PRESENCE_MAGIC);
        out.extend_from_slice(&PRESENCE_FORMAT.to_le_bytes());
        out.extend_from_slice(&layer.to_le_bytes());
        out.extend_from_slice(&chunks_per_tract.to_le_bytes());
        out.extend_from_slice(&(self.tracts.len() as u64).to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// The record's whole length, from its header (the first
    /// [`Presence::header_len`] bytes), bounded by `max`.
    pub fn record_len(header: &[u8], max: u64) -> Result<u64, RecordError> {
        const W: &str = "layer";
        if header.len() < PRESENCE_HEADER || header[..8] != PRESENCE_MAGIC {
            return Err(RecordError::Magic(W));
        }
        let body =
            u64::from_le_bytes(header[28..36].try_into().map_err(|_| RecordError::Field(W, "length"))?);
        let len = (PRESENCE_HEADER as u64).checked_add(body).and_then(|l| l.checked_add(4));
        match len {
            Some(l) if l <= max => Ok(l),
            _ => Err(RecordError::Field(W, "length")),
        }
    }

    pub const fn header_len() -> usize {
        PRESENCE_HEADER
    }

    /// Decodes layer `layer`'s record (every length bounded before it is
    /// used; the CRC checked first).
    pub fn decode(b: &[u8], layer: u32, chunks_per_tract: u32) -> Result<Presence, RecordError> {
        const W: &str = "layer";
        let len = Self::record_len(b, b.len() as u64)? as usize;
        let b = &b[..len];
        let crc = u32::from_le_bytes(b[len - 4..].try_into().map_err(|_| RecordError::Crc(W))?);
        if crc32c(&b[..len - 4]) != crc {
            return Err(RecordError::Crc(W));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        if u32_at(8) != PRESENCE_FORMAT {
            return Err(RecordError::Format(W, u32_at(8)));
        }
        if u32_at(12) != layer {
            return Err(RecordError::Field(W, "layer"));
        }
        if u32_at(16) != chunks_per_tract {
            return Err(RecordError::Field(W, "chunks per tract"));
        }
        let count = u64::from_le_bytes(b[20..28].try_into().map_err(|_| RecordError::Field(W, "tracts"))?);
        let bitmap = (chunks_per_tract as usize).div_ceil(8);
        let mut body = &b[PRESENCE_HEADER..len - 4];
        let mut tracts = BTreeMap::new();
        let mut last: Option<u64> = None;
        for _ in 0..count {
            if body.len() < 9 {
                return Err(RecordError::Field(W, "tracts"));
            }
            let t = u64::from_le_bytes(body[..8].try_into().map_err(|_| RecordError::Field(W, "tract"))?);
            if last.is_some_and(|l| t <= l) || t == 0 {
                return Err(RecordError::Field(W, "tract order"));
            }
            last = Some(t);
            let bits = match body[8] {
                0 => {
                    body = &body[9..];
                    TractBits::Full
                }
                1 if body.len() >= 9 + bitmap => {
                    let x = body[9..9 + bitmap].to_vec().into_boxed_slice();
                    body = &body[9 + bitmap..];
                    TractBits::Bits(x)
                }
                _ => return Err(RecordError::Field(W, "tract kind")),
            };
            tracts.insert(t, bits);
        }
        if !body.is_empty() {
            return Err(RecordError::Field(W, "length"));
        }
        Ok(Presence { tracts })
    }
}

/// No layer holds the chunk: it reads as zeros.
const HOLE: u16 = u16::MAX;

/// One tract of a view.
#[derive(Clone, Debug, PartialEq, Eq)]
enum TractView {
    /// Every chunk from one layer (an index into `View::layers`).
    Uniform(u16),
    /// Per chunk, an index into `View::layers` or `HOLE`.
    Chunks(Box<[u16]>),
}

/// For each chunk of a prefix of layers, the newest layer holding it.
#[derive(Clone, Debug)]
pub struct View {
    /// Layer ids, oldest first (at most `u16::MAX` of them).
    layers: Vec<u32>,
    tracts: BTreeMap<u64, TractView>,
    chunks_per_tract: u32,
}

/// Most layers one view holds (indices are 16 bits, one kept for holes).
pub const VIEW_LAYERS_MAX: usize = HOLE as usize;

impl View {
    /// One past the last volume tract any of its layers holds a chunk of.
    pub fn end_tract(&self) -> u64 {
        self.tracts.last_key_value().map_or(0, |(t, _)| t + 1)
    }

    /// The view of no layer.
    pub fn empty(chunks_per_tract: u32) -> View {
        View { layers: Vec::new(), tracts: BTreeMap::new(), chunks_per_tract }
    }

    /// The view of `layers` (oldest first: id and presence).
    pub fn build<'a>(chunks_per_tract: u32, layers: impl IntoIterator<Item = (u32, &'a Presence)>) -> View {
        let mut v = View::empty(chunks_per_tract);
        for (id, p) in layers {
            v.push(id, p);
        }
        v
    }

    /// Lays layer `id` (newer than every layer already in the view) over it.
    pub fn push(&mut self, id: u32, p: &Presence) {
        let i = self.layers.len().min(VIEW_LAYERS_MAX - 1) as u16;
        self.layers.push(id);
        for (&t, bits) in &p.tracts {
            self.overlay(t, i, bits);
        }
    }

    fn overlay(&mut self, t: u64, i: u16, bits: &TractBits) {
        let cpt = self.chunks_per_tract as usize;
        match bits {
            TractBits::Full => {
                self.tracts.insert(t, TractView::Uniform(i));
            }
            TractBits::Bits(_) => {
                let entry = self.tracts.entry(t).or_insert(TractView::Uniform(HOLE));
                let mut chunks = match entry {
                    TractView::Uniform(u) => vec![*u; cpt].into_boxed_slice(),
                    TractView::Chunks(c) => std::mem::take(c),
                };
                for (c, slot) in chunks.iter_mut().enumerate() {
                    if bits.has(c as u32) {
                        *slot = i;
                    }
                }
                *entry = TractView::Chunks(chunks);
            }
        }
    }

    /// The layer holding chunk `chunk` of tract `t`, or `None` (zeros).
    pub fn layer_of(&self, t: u64, chunk: u32) -> Option<u32> {
        let i = match self.tracts.get(&t)? {
            TractView::Uniform(i) => *i,
            TractView::Chunks(c) => *c.get(chunk as usize)?,
        };
        (i != HOLE).then(|| self.layers[i as usize])
    }

    /// Whether any layer of the view holds a chunk of tract `t`.
    pub fn touches(&self, t: u64) -> bool {
        self.tracts.contains_key(&t)
    }

    /// The layer ids of the view, oldest first.
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }

    /// Chunks the view reads from layer `id`.
    pub fn chunks_from(&self, id: u32) -> u64 {
        let Some(i) = self.layers.iter().position(|&l| l == id) else { return 0 };
        let i = i as u16;
        self.tracts
            .values()
            .map(|tv| match tv {
                TractView::Uniform(u) if *u == i => self.chunks_per_tract as u64,
                TractView::Uniform(_) => 0,
                TractView::Chunks(c) => c.iter().filter(|&&x| x == i).count() as u64,
            })
            .sum()
    }
}

/// For each view (`views`: layer ids, oldest first, each the last layer
/// of a view: the snapshots, then the head), the chunks only it reads:
/// what deleting it would give back. `layers` holds every layer's
/// presence, oldest first.
///
/// A layer's chunk is read by the first view at or after the layer, and
/// by the views after that one until a layer between holds the chunk
/// too. So view `k` alone reads a chunk exactly when a layer in
/// `(views[k-1], views[k]]` holds it and a layer in `(views[k],
/// views[k+1]]` does too: one pass over each chunk's holders.
pub fn held_alone(chunks_per_tract: u32, layers: &[(u32, Presence)], views: &[u32]) -> Vec<u64> {
    let mut held = vec![0u64; views.len()];
    let mut tracts: Vec<u64> = layers.iter().flat_map(|(_, p)| p.tracts.keys().copied()).collect();
    tracts.sort_unstable();
    tracts.dedup();
    for t in tracts {
        let here: Vec<(usize, &TractBits)> = layers
            .iter()
            .filter_map(|(id, p)| Some((views.partition_point(|&v| v < *id), p.tracts.get(&t)?)))
            .collect();
        let mut owners: Vec<usize> = Vec::with_capacity(here.len());
        for c in 0..chunks_per_tract {
            owners.clear();
            owners.extend(here.iter().filter(|(_, b)| b.has(c)).map(|(k, _)| *k));
            owners.dedup();
            for w in owners.windows(2) {
                if w[1] == w[0] + 1 && w[0] < held.len() {
                    held[w[0]] += 1;
                }
            }
        }
    }
    held
}

/// One run of chunks no view reads: layer `layer`'s volume tract
/// `tract`, chunks `chunks`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unread {
    pub layer: u32,
    pub tract: u64,
    pub chunks: std::ops::Range<u32>,
}

/// The chunks of `layers` (oldest first, the head last) that no view in
/// `views` (the layers snapshots name, and the head) reads: what deleting
/// snapshots gives back. A chunk is read by the first view at or after
/// its layer, and only the newest holder among the layers up to that view
/// is read there, so a holder is unread exactly when a newer layer before
/// the same first view holds the chunk too (the same pass as
/// [`held_alone`]). A layer a view names always has its chunks read.
pub fn unread(chunks_per_tract: u32, layers: &[(u32, Presence)], views: &[u32]) -> Vec<Unread> {
    let mut out: Vec<Unread> = Vec::new();
    let mut tracts: Vec<u64> = layers.iter().flat_map(|(_, p)| p.tracts.keys().copied()).collect();
    tracts.sort_unstable();
    tracts.dedup();
    for t in tracts {
        let here: Vec<(u32, usize, &TractBits)> = layers
            .iter()
            .filter_map(|(id, p)| Some((*id, views.partition_point(|&v| v < *id), p.tracts.get(&t)?)))
            .collect();
        for c in 0..chunks_per_tract {
            let holders: Vec<(u32, usize)> =
                here.iter().filter(|(_, _, b)| b.has(c)).map(|(id, k, _)| (*id, *k)).collect();
            for w in holders.windows(2) {
                // Past the last view nothing reads (no layer is there:
                // the head is a view).
                if w[0].1 == w[1].1 {
                    match out.last_mut() {
                        Some(u) if u.layer == w[0].0 && u.tract == t && u.chunks.end == c => {
                            u.chunks.end = c + 1
                        }
                        _ => out.push(Unread { layer: w[0].0, tract: t, chunks: c..c + 1 }),
                    }
                }
            }
        }
    }
    out.sort_by_key(|u| (u.layer, u.tract, u.chunks.start));
    // Runs of one (layer, tract) split by other layers' entries merge now.
    let mut merged: Vec<Unread> = Vec::with_capacity(out.len());
    for u in out {
        match merged.last_mut() {
            Some(m) if m.layer == u.layer && m.tract == u.tract && m.chunks.end == u.chunks.start => {
                m.chunks.end = u.chunks.end
            }
            _ => merged.push(u),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unread_chunks_are_the_older_holders_before_one_view() {
        let cpt = 8;
        // Layers 0, 1, 2 and the head 3. Chunks 0-3 of tract 1 are in 0
        // and 1; chunk 0 in 2 as well; chunk 1 in the head.
        let l0 = presence(&[(1, bits(cpt, &[0, 1, 2, 3]))]);
        let l1 = presence(&[(1, bits(cpt, &[0, 1, 2, 3]))]);
        let l2 = presence(&[(1, bits(cpt, &[0]))]);
        let l3 = presence(&[(1, bits(cpt, &[1]))]);
        let layers = [(0, l0), (1, l1), (2, l2), (3, l3)];
        // Every layer a view: nothing is unread.
        assert_eq!(unread(cpt, &layers, &[0, 1, 2, 3]), vec![]);
        // Snapshot 1 gone (views 0, 2, head): layer 1's chunk 0 is
        // shadowed by layer 2 before view 2; chunks 1-3 view 2 reads.
        assert_eq!(unread(cpt, &layers, &[0, 2, 3]), vec![Unread { layer: 1, tract: 1, chunks: 0..1 }]);
        // Snapshot 0 gone too: layer 0's chunks 0-3 are shadowed by 1
        // before view 2, and layer 1's chunk 0 by 2.
        assert_eq!(
            unread(cpt, &layers, &[2, 3]),
            vec![Unread { layer: 0, tract: 1, chunks: 0..4 }, Unread { layer: 1, tract: 1, chunks: 0..1 }]
        );
        // Only the head: every holder but the newest of each chunk.
        assert_eq!(
            unread(cpt, &layers, &[3]),
            vec![Unread { layer: 0, tract: 1, chunks: 0..4 }, Unread { layer: 1, tract: 1, chunks: 0..2 },]
        );
    }

    fn bits(cpt: u32, set: &[u32]) -> TractBits {
        let mut b = vec![0u8; (cpt as usize).div_ceil(8)];
        for &c in set {
            b[c as usize / 8] |= 1 << (c % 8);
        }
        TractBits::from_mapped(&b, cpt).expect("some set")
    }

    fn presence(entries: &[(u64, TractBits)]) -> Presence {
        Presence { tracts: entries.iter().cloned().collect() }
    }

    #[test]
    fn from_mapped_is_none_full_or_bits() {
        assert_eq!(TractBits::from_mapped(&[0, 0], 16), None);
        assert_eq!(TractBits::from_mapped(&[0xff, 0xff], 16), Some(TractBits::Full));
        // Bits past the tract's chunks are ignored.
        assert_eq!(TractBits::from_mapped(&[0xff, 0xff], 12), Some(TractBits::Full));
        let b = bits(16, &[3, 9]);
        assert!(b.has(3) && b.has(9) && !b.has(4));
    }

    #[test]
    fn the_newest_layer_holding_a_chunk_wins_and_holes_read_as_zeros() {
        let cpt = 8;
        let l0 = presence(&[(1, TractBits::Full), (2, bits(cpt, &[0, 1]))]);
        let l1 = presence(&[(1, bits(cpt, &[2])), (3, bits(cpt, &[7]))]);
        let l2 = presence(&[(2, bits(cpt, &[1, 5]))]);
        let v = View::build(cpt, [(0, &l0), (1, &l1), (4, &l2)]);
        assert_eq!(v.layer_of(1, 0), Some(0));
        assert_eq!(v.layer_of(1, 2), Some(1));
        assert_eq!(v.layer_of(2, 0), Some(0));
        assert_eq!(v.layer_of(2, 1), Some(4));
        assert_eq!(v.layer_of(2, 5), Some(4));
        assert_eq!(v.layer_of(2, 6), None);
        assert_eq!(v.layer_of(3, 7), Some(1));
        assert_eq!(v.layer_of(4, 0), None);
        // A prefix: the snapshot at layer 1 does not see layer 4.
        let s = View::build(cpt, [(0, &l0), (1, &l1)]);
        assert_eq!(s.layer_of(2, 1), Some(0));
        assert_eq!(s.layer_of(2, 5), None);
        assert_eq!(v.chunks_from(0), 7 + 1);
        assert_eq!(v.chunks_from(4), 2);
        // A full tract over a partial one replaces it.
        let l3 = presence(&[(2, TractBits::Full)]);
        let w = View::build(cpt, [(0, &l0), (4, &l2), (5, &l3)]);
        assert_eq!(w.layer_of(2, 1), Some(5));
        assert_eq!(w.chunks_from(4), 0);
    }

    #[test]
    fn what_each_view_holds_alone() {
        let cpt = 4;
        // Layers 0..=4; snapshots at 1 and 3, the head is 4 (layers 0 and
        // 2 belong to snapshots deleted since, kept for what later views read).
        let l = |set: &[u32]| presence(&[(1, bits(cpt, set))]);
        let layers =
            vec![(0, l(&[0, 1, 2, 3])), (1, l(&[0])), (2, l(&[1])), (3, l(&[1, 2])), (4, l(&[2, 3]))];
        let views = [1, 3, 4];
        // Chunk 0: read by every view from layer 1: no view alone.
        // Chunk 1: view 1 reads layer 0, view 3 layer 3, the head layer 3:
        //   view 1 alone reads its copy.
        // Chunk 2: view 1 reads layer 0, view 3 layer 3, the head layer 4:
        //   views 1 and 3 each alone.
        // Chunk 3: view 1 and view 3 read layer 0, the head layer 4: view 3
        //   does not read it alone (view 1 does too), view 1 does not (view 3).
        assert_eq!(held_alone(cpt, &layers, &views), vec![2, 1, 0]);
        // With no snapshot but the head, nothing is held alone.
        assert_eq!(held_alone(cpt, &layers[..1], &[0]), vec![0]);
    }

    #[test]
    fn a_presence_record_round_trips() {
        let cpt = 2048;
        let p = presence(&[(1, TractBits::Full), (7, bits(cpt, &[0, 2047])), (900, bits(cpt, &[5]))]);
        let rec = p.encode(3, cpt);
        assert_eq!(Presence::record_len(&rec[..Presence::header_len()], 1 << 30), Ok(rec.len() as u64));
        assert_eq!(Presence::decode(&rec, 3, cpt), Ok(p.clone()));
        assert_eq!(p.chunks(cpt), 2048 + 2 + 1);
        // Another layer's, or another geometry's, is refused.
        assert_eq!(Presence::decode(&rec, 4, cpt), Err(RecordError::Field("layer", "layer")));
        assert_eq!(Presence::decode(&rec, 3, 1024), Err(RecordError::Field("layer", "chunks per tract")));
    }

    #[test]
    fn a_damaged_presence_record_is_refused_never_misread() {
        let cpt = 64;
        let p = presence(&[(1, TractBits::Full), (2, bits(cpt, &[1]))]);
        let rec = p.encode(0, cpt);
        for i in 0..rec.len() {
            let mut bad = rec.clone();
            bad[i] ^= 0x40;
            assert!(Presence::decode(&bad, 0, cpt).is_err(), "byte {i}");
        }
        for cut in 0..rec.len() {
            assert!(Presence::decode(&rec[..cut], 0, cpt).is_err(), "cut at {cut}");
        }
        // A length that claims more than the bound is refused before use.
        let mut huge = rec.clone();
        huge[28..36].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(Presence::record_len(&huge, 1 << 20).is_err());
    }
}
