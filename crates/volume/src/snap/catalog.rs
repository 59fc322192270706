//! The catalog of a volume's layers and snapshots (pure; design 0011).
//!
//! Two slots of [`Catalog::slot_bytes`] each, written alternately with a
//! generation number (as the superblock's two copies are): a write torn
//! by a crash leaves the other slot, the previous catalog. The superblock
//! names the slots once the volume's first snapshot is taken
//! (`Superblock::layers`); after that, every change of the stack (a
//! snapshot taken, deleted) is one catalog write, which is its switch.

use blizzard_core::crc::crc32c;

use super::map::RecordError;
use crate::superblock::NAME_LEN_MAX;

const MAGIC: [u8; 8] = *b"BLZSNAPC";
const FORMAT: u32 = 1;
/// magic, format, generation, body length.
const HEADER: usize = 8 + 4 + 8 + 8;
const W: &str = "snapshot catalog";

/// Bytes a catalog slot holds: room for [`LAYERS_MAX`] layers with the
/// longest names.
pub const SLOT_BYTES: u64 = 4 << 20;
/// Most layers a volume's stack holds (snapshots, the head, and layers a
/// deleted snapshot left because a later view reads some of their
/// chunks): what the metadata can hold.
pub const LAYERS_MAX: usize = 16_000;

/// A snapshot: the view of the stack up to its layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapInfo {
    pub name: String,
    pub created_unix_s: u64,
    /// The volume's size when it was taken.
    pub size_bytes: u64,
}

/// One layer of the stack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layer {
    pub id: u32,
    /// Blob tract of the layer's volume tract 1.
    pub base: u64,
    /// Volume tracts the layer spans (its volume's data tracts, tract 0
    /// excluded, when it was made).
    pub tracts: u64,
    /// Where its presence record is (byte address in the blob, bytes):
    /// `None` for the head, which the tractservers' chunk maps describe.
    pub presence: Option<(u64, u64)>,
    /// The snapshot it is, if one names it.
    pub snapshot: Option<SnapInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Catalog {
    pub generation: u64,
    /// Oldest first; the last is the head.
    pub layers: Vec<Layer>,
    /// The tract presence records are being appended to, and the bytes of
    /// it used (`None`: the next record starts a tract).
    pub records: Option<(u64, u64)>,
}

impl Catalog {
    /// The catalog of a volume taking its first snapshot: layer 0 (its
    /// data, at base 1) alone, as head.
    pub fn first(data_tracts: u64) -> Catalog {
        Catalog {
            generation: 0,
            layers: vec![Layer { id: 0, base: 1, tracts: data_tracts, presence: None, snapshot: None }],
            records: None,
        }
    }

    pub fn head(&self) -> &Layer {
        // `validate` (and `first`) keep at least one layer.
        &self.layers[self.layers.len() - 1]
    }

    pub fn snapshot(&self, name: &str) -> Option<&Layer> {
        self.layers.iter().find(|l| l.snapshot.as_ref().is_some_and(|s| s.name == name))
    }

    /// The slot generation `g` is written to (its first byte offset in the
    /// catalog area: slot 0, then slot 1).
    pub fn slot_of(generation: u64) -> u64 {
        generation % 2
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        let (rt, used) = self.records.unwrap_or((0, 0));
        body.extend_from_slice(&rt.to_le_bytes());
        body.extend_from_slice(&used.to_le_bytes());
        body.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        for l in &self.layers {
            body.extend_from_slice(&l.id.to_le_bytes());
            body.extend_from_slice(&l.base.to_le_bytes());
            body.extend_from_slice(&l.tracts.to_le_bytes());
            let (at, len) = l.presence.unwrap_or((0, 0));
            body.extend_from_slice(&at.to_le_bytes());
            body.extend_from_slice(&len.to_le_bytes());
            match &l.snapshot {
                None => body.push(0),
                Some(s) => {
                    body.push(1);
                    let n = &s.name.as_bytes()[..s.name.len().min(NAME_LEN_MAX)];
                    body.extend_from_slice(&(n.len() as u16).to_le_bytes());
                    body.extend_from_slice(n);
                    body.extend_from_slice(&s.created_unix_s.to_le_bytes());
                    body.extend_from_slice(&s.size_bytes.to_le_bytes());
                }
            }
        }
        let mut out = Vec::with_capacity(HEADER + body.len() + 4);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let crc = crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    pub const fn header_len() -> usize {
        HEADER
    }

    /// The record's whole length, from its first [`Catalog::header_len`]
    /// bytes; `None` for a slot never written (zeros).
    pub fn record_len(header: &[u8]) -> Result<Option<u64>, RecordError> {
        if header.len() < HEADER {
            return Err(RecordError::Field(W, "length"));
        }
        if header.iter().all(|&b| b == 0) {
            return Ok(None);
        }
        if header[..8] != MAGIC {
            return Err(RecordError::Magic(W));
        }
        let body =
            u64::from_le_bytes(header[20..28].try_into().map_err(|_| RecordError::Field(W, "length"))?);
        match body.checked_add(HEADER as u64 + 4) {
            Some(l) if l <= SLOT_BYTES => Ok(Some(l)),
            _ => Err(RecordError::Field(W, "length")),
        }
    }

    /// Decodes one slot's record, checking everything: CRC first, then
    /// every length before it is used, then the stack's own rules
    /// ([`Catalog::validate`]).
    pub fn decode(b: &[u8]) -> Result<Catalog, RecordError> {
        let Some(len) = Self::record_len(b)? else { return Err(RecordError::Magic(W)) };
        let len = len as usize;
        if b.len() < len {
            return Err(RecordError::Field(W, "length"));
        }
        let b = &b[..len];
        let crc = u32::from_le_bytes(b[len - 4..].try_into().map_err(|_| RecordError::Crc(W))?);
        if crc32c(&b[..len - 4]) != crc {
            return Err(RecordError::Crc(W));
        }
        let format = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if format != FORMAT {
            return Err(RecordError::Format(W, format));
        }
        let generation =
            u64::from_le_bytes(b[12..20].try_into().map_err(|_| RecordError::Field(W, "generation"))?);
        let mut d = Dec(&b[HEADER..len - 4]);
        let (rt, used) = (d.u64()?, d.u64()?);
        let records = (rt != 0).then_some((rt, used));
        let n = d.u32()? as usize;
        if n == 0 || n > LAYERS_MAX {
            return Err(RecordError::Field(W, "layers"));
        }
        let mut layers = Vec::with_capacity(n);
        for _ in 0..n {
            let id = d.u32()?;
            let base = d.u64()?;
            let tracts = d.u64()?;
            let (at, plen) = (d.u64()?, d.u64()?);
            let presence = (at != 0).then_some((at, plen));
            let snapshot = match d.u8()? {
                0 => None,
                1 => {
                    let nl = d.u16()? as usize;
                    if nl > NAME_LEN_MAX {
                        return Err(RecordError::Field(W, "name"));
                    }
                    let name =
                        String::from_utf8(d.take(nl)?.to_vec()).map_err(|_| RecordError::Field(W, "name"))?;
                    Some(SnapInfo { name, created_unix_s: d.u64()?, size_bytes: d.u64()? })
                }
                _ => return Err(RecordError::Field(W, "snapshot")),
            };
            layers.push(Layer { id, base, tracts, presence, snapshot });
        }
        if !d.0.is_empty() {
            return Err(RecordError::Field(W, "length"));
        }
        let c = Catalog { generation, layers, records };
        c.validate().map_err(|f| RecordError::Field(W, f))?;
        Ok(c)
    }

    /// The stack's rules: at least one layer; ids increasing; layers at
    /// bases past tract 0, not overlapping; every layer but the head has
    /// its presence record, the head none; snapshot names valid and
    /// unique; the head is no snapshot.
    pub fn validate(&self) -> Result<(), &'static str> {
        let Some(head) = self.layers.last() else { return Err("layers") };
        if self.layers.len() > LAYERS_MAX {
            return Err("layers");
        }
        if head.presence.is_some() || head.snapshot.is_some() {
            return Err("head");
        }
        if self.records.is_some_and(|(t, _)| t == 0) {
            return Err("records");
        }
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if i > 0 && l.id <= self.layers[i - 1].id {
                return Err("layer order");
            }
            if l.base == 0 {
                return Err("base");
            }
            let end = l.base.checked_add(l.tracts).ok_or("tracts")?;
            ranges.push((l.base, end));
            if i + 1 < self.layers.len() && l.presence.is_none() {
                return Err("presence");
            }
            if let Some(s) = &l.snapshot {
                if blizzard_lsvd::format::check_snapshot_name(&s.name).is_err() {
                    return Err("name");
                }
                if self.layers[..i].iter().any(|o| o.snapshot.as_ref().is_some_and(|x| x.name == s.name)) {
                    return Err("duplicate name");
                }
            }
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("overlapping layers");
        }
        Ok(())
    }

    /// Of two slots' records (either may be torn or blank), the newest
    /// intact one.
    pub fn pick(a: Option<Catalog>, b: Option<Catalog>) -> Option<Catalog> {
        match (a, b) {
            (Some(a), Some(b)) => Some(if b.generation > a.generation { b } else { a }),
            (x, None) | (None, x) => x,
        }
    }
}

struct Dec<'a>(&'a [u8]);

impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], RecordError> {
        if self.0.len() < n {
            return Err(RecordError::Field(W, "length"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, RecordError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, RecordError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, RecordError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(name: &str) -> Option<SnapInfo> {
        Some(SnapInfo { name: name.into(), created_unix_s: 1_700_000_000, size_bytes: 1 << 30 })
    }

    fn two_snapshots() -> Catalog {
        Catalog {
            records: Some((129, 8192)),
            generation: 7,
            layers: vec![
                Layer { id: 0, base: 1, tracts: 128, presence: Some((129, 4000)), snapshot: snap("monday") },
                Layer {
                    id: 1,
                    base: 130,
                    tracts: 128,
                    presence: Some((258, 100)),
                    snapshot: snap("tuesday"),
                },
                Layer { id: 2, base: 259, tracts: 128, presence: None, snapshot: None },
            ],
        }
    }

    #[test]
    fn a_catalog_round_trips_and_names_its_head() {
        let c = two_snapshots();
        let b = c.encode();
        assert_eq!(Catalog::record_len(&b[..Catalog::header_len()]), Ok(Some(b.len() as u64)));
        assert_eq!(Catalog::decode(&b), Ok(c.clone()));
        assert_eq!(c.head().id, 2);
        assert_eq!(c.snapshot("tuesday").map(|l| l.id), Some(1));
        assert_eq!(c.snapshot("wednesday"), None);
        let first = Catalog::first(64);
        assert_eq!(Catalog::decode(&first.encode()), Ok(first));
    }

    #[test]
    fn a_blank_slot_is_none_and_a_damaged_one_is_refused() {
        assert_eq!(Catalog::record_len(&[0u8; HEADER]), Ok(None));
        let b = two_snapshots().encode();
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(Catalog::decode(&bad).is_err(), "byte {i}");
        }
        for cut in 0..b.len() {
            assert!(Catalog::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn the_stack_rules_hold() {
        type Break = fn(&mut Catalog);
        let cases: [(&str, Break); 7] = [
            ("head", |c| c.layers[2].snapshot = snap("now")),
            ("head", |c| c.layers[2].presence = Some((9, 9))),
            ("presence", |c| c.layers[0].presence = None),
            ("layer order", |c| c.layers[1].id = 0),
            ("duplicate name", |c| c.layers[1].snapshot = snap("monday")),
            ("name", |c| c.layers[1].snapshot = snap("a@b")),
            ("overlapping layers", |c| c.layers[1].base = 100),
        ];
        for (want, break_it) in cases {
            let mut c = two_snapshots();
            break_it(&mut c);
            assert_eq!(c.validate(), Err(want));
            // And what fails the rules is refused when read.
            assert!(Catalog::decode(&c.encode()).is_err(), "{want}");
        }
        assert_eq!(Catalog { generation: 0, layers: vec![], records: None }.validate(), Err("layers"));
    }

    #[test]
    fn the_newest_intact_slot_wins() {
        let mut a = two_snapshots();
        let mut b = a.clone();
        a.generation = 4;
        b.generation = 5;
        assert_eq!(Catalog::pick(Some(a.clone()), Some(b.clone())).map(|c| c.generation), Some(5));
        assert_eq!(Catalog::pick(Some(a.clone()), None).map(|c| c.generation), Some(4));
        assert_eq!(Catalog::pick(None, Some(b)).map(|c| c.generation), Some(5));
        assert_eq!(Catalog::pick(None, None), None);
    }

    #[test]
    fn the_longest_stack_fits_a_slot() {
        let name = "x".repeat(NAME_LEN_MAX);
        let layers = (0..LAYERS_MAX as u32)
            .map(|i| Layer {
                id: i,
                base: 1 + i as u64 * 10,
                tracts: 10,
                presence: (i + 1 < LAYERS_MAX as u32).then_some((1, 1)),
                snapshot: (i + 1 < LAYERS_MAX as u32).then(|| SnapInfo {
                    name: format!("{i}{}", &name[..128 - 6]),
                    created_unix_s: 0,
                    size_bytes: 0,
                }),
            })
            .collect();
        let c = Catalog { generation: 1, layers, records: None };
        let b = c.encode();
        assert!(b.len() as u64 <= SLOT_BYTES, "{} bytes", b.len());
        assert_eq!(Catalog::decode(&b).map(|d| d.layers.len()), Ok(LAYERS_MAX));
    }
}
