//! The stored formats of an LSVD volume (design 0008, "Formats"): the
//! descriptor, data objects' headers and map checkpoints in the object
//! store, and the journal's header and records on the cache disk.
//!
//! Encoders are total. Decoders take untrusted bytes: every count and
//! length is bounded by a named maximum and by the bytes present before
//! anything is allocated; magic, version and CRC32C are checked; every
//! failure is a [`FormatError`] naming the structure, never a panic.
//! Little-endian throughout. The golden tests pin the bytes.

use blizzard_core::crc::{crc32c, crc32c_append};
use bytes::{BufMut, Bytes, BytesMut};

/// Sector: every volume offset and length is a multiple of it.
pub const SECTOR: u64 = 512;
/// Data of an object is checksummed per block of this many bytes.
pub const CRC_BLOCK: u64 = 4096;
/// Most data one object carries.
pub const OBJECT_DATA_MAX: u64 = 64 << 20;
/// Most extents one object's header lists (each at least one sector of
/// data or a trim; a trim-only object of many small trims stays far below).
pub const OBJECT_EXTENTS_MAX: u64 = 1 << 20;
/// Most bytes of a name (volume or snapshot).
pub const NAME_LEN_MAX: usize = 200;
/// Largest volume: 2^50 bytes (1 PiB).
pub const VOLUME_SIZE_MAX: u64 = 1 << 50;
/// Most extents (and objects) a checkpoint lists.
pub const CHECKPOINT_ENTRIES_MAX: u64 = 1 << 28;

const OBJECT_MAGIC: &[u8; 8] = b"BLZLSVOB";
const CHECKPOINT_MAGIC: &[u8; 8] = b"BLZLSVCK";
const DESCRIPTOR_MAGIC: &[u8; 8] = b"BLZLSVVD";
const JOURNAL_HEADER_MAGIC: &[u8; 8] = b"BLZLSVJH";
const RECORD_MAGIC: &[u8; 8] = b"BLZLSVJR";
const VERSION: u16 = 1;

/// Fixed part of an object header, before the extents.
const OBJECT_FIXED: usize = 80;
const OBJECT_EXTENT_LEN: usize = 24;
/// Marks an extent that holds zeros (a trim): no data in the object.
const ZERO_OFFSET: u64 = u64::MAX;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {why}")]
pub struct FormatError {
    pub what: &'static str,
    pub why: String,
}

fn err(what: &'static str, why: impl Into<String>) -> FormatError {
    FormatError { what, why: why.into() }
}

/// A bounds-checked little-endian reader over untrusted bytes.
struct Reader<'a> {
    what: &'static str,
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(what: &'static str, buf: &'a [u8]) -> Self {
        Reader { what, buf, at: 0 }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        if self.buf.len() - self.at < n {
            return Err(err(self.what, format!("truncated at byte {} (needs {n} more)", self.at)));
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| err(self.what, "short"))?))
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| err(self.what, "short"))?))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| err(self.what, "short"))?))
    }
    fn u128(&mut self) -> Result<u128, FormatError> {
        Ok(u128::from_le_bytes(self.take(16)?.try_into().map_err(|_| err(self.what, "short"))?))
    }
    fn left(&self) -> usize {
        self.buf.len() - self.at
    }
}

/// Checks magic and version at the start of `r`.
fn magic_version(r: &mut Reader<'_>, magic: &[u8; 8]) -> Result<(), FormatError> {
    if r.take(8)? != magic {
        return Err(err(r.what, "bad magic (not this structure)"));
    }
    let v = r.u16()?;
    if v != VERSION {
        return Err(err(r.what, format!("format version {v}, this build reads {VERSION}")));
    }
    Ok(())
}

/// Checks the trailing CRC32C of `buf` (over everything before it).
fn check_trailing_crc(what: &'static str, buf: &[u8]) -> Result<(), FormatError> {
    if buf.len() < 4 {
        return Err(err(what, "too short for its CRC"));
    }
    let (body, crc) = buf.split_at(buf.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32c(body) != stored {
        return Err(err(what, "CRC32C mismatch (damaged)"));
    }
    Ok(())
}

fn put_crc(b: &mut BytesMut) {
    let c = crc32c(b);
    b.put_u32_le(c);
}

fn check_aligned(what: &'static str, name: &str, v: u64) -> Result<(), FormatError> {
    if !v.is_multiple_of(SECTOR) {
        return Err(err(what, format!("{name} {v} is not a multiple of {SECTOR}")));
    }
    Ok(())
}

fn check_name(what: &'static str, name: &[u8]) -> Result<String, FormatError> {
    if name.is_empty() || name.len() > NAME_LEN_MAX {
        return Err(err(what, format!("name of {} bytes (1..={NAME_LEN_MAX})", name.len())));
    }
    String::from_utf8(name.to_vec()).map_err(|_| err(what, "name is not UTF-8"))
}

// ---------------------------------------------------------------- descriptor

/// What `P/volume` says: which volume the prefix holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub uuid: u128,
    pub name: String,
    pub size: u64,
    /// Target data bytes per object.
    pub object_bytes: u64,
    /// Seconds since the Unix epoch (for humans).
    pub created_secs: u64,
    /// A clone's bases, oldest first: objects up to each one's `upto`
    /// (and above the previous one's) live under its prefix. Empty for a
    /// volume that is not a clone.
    pub base: Vec<BaseRef>,
    /// Cleaning starts once live data is below this percentage of the
    /// bytes stored in objects; `None`: the opener's default (the paper's
    /// 70 %). Lower trades stored bytes for fewer bytes (and requests)
    /// rewritten: see `docs/benchmarks.md`.
    pub gc_live_pct: Option<u8>,
}

/// The cleaning thresholds a volume may be given (percent live).
pub const GC_LIVE_PCT_RANGE: std::ops::RangeInclusive<u8> = 10..=95;

/// One link of a clone's chain: the volume under `prefix` (`uuid`), read
/// as of its snapshot `snapshot` at object `upto`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BaseRef {
    pub prefix: String,
    pub uuid: u128,
    pub upto: u64,
    pub snapshot: String,
}

/// Longest prefix a clone's chain names.
pub const PREFIX_LEN_MAX: usize = 1024;
/// Most links in a clone's chain (a clone of a clone of ...): bounded only
/// so that a damaged descriptor cannot ask for unbounded memory.
pub const CHAIN_MAX: usize = 4096;
/// Most bytes of a descriptor.
pub const DESCRIPTOR_LEN_MAX: usize = 8 << 20;
/// A descriptor with a chain (a clone) or a cleaning threshold is version
/// 2; one with neither keeps version 1's bytes, so volumes made before
/// clones read as they did.
const DESCRIPTOR_VERSION_CHAIN: u16 = 2;

impl Descriptor {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_slice(DESCRIPTOR_MAGIC);
        let v2 = !self.base.is_empty() || self.gc_live_pct.is_some();
        b.put_u16_le(if v2 { DESCRIPTOR_VERSION_CHAIN } else { VERSION });
        b.put_u16_le(self.name.len() as u16);
        b.put_u32_le(0);
        b.put_u128_le(self.uuid);
        b.put_u64_le(self.size);
        b.put_u64_le(self.object_bytes);
        b.put_u64_le(self.created_secs);
        b.put_slice(self.name.as_bytes());
        if v2 {
            b.put_u8(self.gc_live_pct.unwrap_or(0));
            b.put_u32_le(self.base.len() as u32);
            for l in &self.base {
                b.put_u128_le(l.uuid);
                b.put_u64_le(l.upto);
                b.put_u16_le(l.prefix.len() as u16);
                b.put_slice(l.prefix.as_bytes());
                b.put_u16_le(l.snapshot.len() as u16);
                b.put_slice(l.snapshot.as_bytes());
            }
        }
        put_crc(&mut b);
        b.freeze()
    }

    pub fn decode(buf: &[u8]) -> Result<Descriptor, FormatError> {
        const W: &str = "volume descriptor";
        if buf.len() > DESCRIPTOR_LEN_MAX {
            return Err(err(W, format!("{} bytes, at most {DESCRIPTOR_LEN_MAX}", buf.len())));
        }
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, &buf[..buf.len() - 4]);
        if r.take(8)? != DESCRIPTOR_MAGIC {
            return Err(err(W, "bad magic (not this structure)"));
        }
        let version = r.u16()?;
        if version != VERSION && version != DESCRIPTOR_VERSION_CHAIN {
            return Err(err(W, format!("format version {version}, this build reads 1 and 2")));
        }
        let name_len = r.u16()? as usize;
        r.u32()?;
        let uuid = r.u128()?;
        let size = r.u64()?;
        let object_bytes = r.u64()?;
        let created_secs = r.u64()?;
        if version == VERSION && r.left() != name_len {
            return Err(err(W, format!("name of {name_len} bytes but {} left", r.left())));
        }
        let name = check_name(W, r.take(name_len)?)?;
        let mut base = Vec::new();
        let mut gc_live_pct = None;
        if version == DESCRIPTOR_VERSION_CHAIN {
            let pct = r.take(1)?[0];
            if pct != 0 {
                if !GC_LIVE_PCT_RANGE.contains(&pct) {
                    return Err(err(W, format!("cleaning threshold {pct} % (0, or {GC_LIVE_PCT_RANGE:?})")));
                }
                gc_live_pct = Some(pct);
            }
            let n = r.u32()? as usize;
            // Each link takes at least 30 bytes.
            if n > CHAIN_MAX || n.saturating_mul(30) > r.left() || (n == 0 && gc_live_pct.is_none()) {
                return Err(err(W, format!("a chain of {n} bases in {} bytes", r.left())));
            }
            let mut last = 0;
            for _ in 0..n {
                let uuid = r.u128()?;
                let upto = r.u64()?;
                let plen = r.u16()? as usize;
                if plen > PREFIX_LEN_MAX {
                    return Err(err(W, format!("a base prefix of {plen} bytes (at most {PREFIX_LEN_MAX})")));
                }
                let prefix =
                    String::from_utf8(r.take(plen)?.to_vec()).map_err(|_| err(W, "prefix is not UTF-8"))?;
                let slen = r.u16()? as usize;
                let snapshot = check_name(W, r.take(slen)?)?;
                if upto <= last {
                    return Err(err(W, format!("base seqs not increasing ({upto} after {last})")));
                }
                last = upto;
                base.push(BaseRef { prefix, uuid, upto, snapshot });
            }
            if r.left() != 0 {
                return Err(err(W, format!("{} bytes after the chain", r.left())));
            }
        }
        let d = Descriptor { uuid, name, size, object_bytes, created_secs, base, gc_live_pct };
        d.validate().map_err(|why| err(W, why))?;
        Ok(d)
    }

    /// Objects up to this seq belong to the chain's bases (0: none).
    pub fn base_upto(&self) -> u64 {
        self.base.last().map_or(0, |b| b.upto)
    }

    /// The parameters' own bounds (also checked before a create).
    pub fn validate(&self) -> Result<(), String> {
        if self.size == 0 || self.size > VOLUME_SIZE_MAX || !self.size.is_multiple_of(SECTOR) {
            return Err(format!(
                "size {} must be a positive multiple of {SECTOR} bytes up to {VOLUME_SIZE_MAX}",
                self.size
            ));
        }
        if !(CRC_BLOCK..=OBJECT_DATA_MAX).contains(&self.object_bytes) {
            return Err(format!(
                "object size {} must be between {CRC_BLOCK} and {OBJECT_DATA_MAX} bytes",
                self.object_bytes
            ));
        }
        if self.name.is_empty() || self.name.len() > NAME_LEN_MAX {
            return Err(format!("name must be 1..={NAME_LEN_MAX} bytes"));
        }
        if let Some(p) = self.gc_live_pct.filter(|p| !GC_LIVE_PCT_RANGE.contains(p)) {
            return Err(format!(
                "cleaning threshold {p} % must be between {} and {} %",
                GC_LIVE_PCT_RANGE.start(),
                GC_LIVE_PCT_RANGE.end()
            ));
        }
        Ok(())
    }
}

// ----------------------------------------------------------------- snapshots

const SNAPSHOT_MAGIC: &[u8; 8] = b"BLZLSVSN";
const CLONE_REF_MAGIC: &[u8; 8] = b"BLZLSVCR";

/// Whether `name` may name a snapshot: it becomes part of object names
/// (`s/<name>`) and of export names (`VOLUME@name`).
pub fn check_snapshot_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "snapshot name {name:?}: use 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'"
        ))
    }
}

/// `P/s/<name>`: the volume as of object `seq` (a checkpoint at `seq`,
/// `P/c/<seq>`, holds its map; it is kept while the snapshot exists).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub uuid: u128,
    pub name: String,
    pub seq: u64,
    pub created_secs: u64,
}

impl SnapshotRecord {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_slice(SNAPSHOT_MAGIC);
        b.put_u16_le(VERSION);
        b.put_u16_le(self.name.len() as u16);
        b.put_u32_le(0);
        b.put_u128_le(self.uuid);
        b.put_u64_le(self.seq);
        b.put_u64_le(self.created_secs);
        b.put_slice(self.name.as_bytes());
        put_crc(&mut b);
        b.freeze()
    }

    pub fn decode(buf: &[u8]) -> Result<SnapshotRecord, FormatError> {
        const W: &str = "snapshot";
        if buf.len() > 4096 {
            return Err(err(W, format!("{} bytes, at most 4096", buf.len())));
        }
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, &buf[..buf.len() - 4]);
        magic_version(&mut r, SNAPSHOT_MAGIC)?;
        let name_len = r.u16()? as usize;
        r.u32()?;
        let uuid = r.u128()?;
        let seq = r.u64()?;
        let created_secs = r.u64()?;
        if r.left() != name_len {
            return Err(err(W, format!("name of {name_len} bytes but {} left", r.left())));
        }
        let name = check_name(W, r.take(name_len)?)?;
        check_snapshot_name(&name).map_err(|why| err(W, why))?;
        Ok(SnapshotRecord { uuid, name, seq, created_secs })
    }
}

/// `P/k/<snapshot>/<clone uuid>`: a clone reads this volume's snapshot, so
/// the snapshot (and the volume) cannot be deleted while it exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloneRef {
    pub uuid: u128,
    pub prefix: String,
    pub name: String,
}

impl CloneRef {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        b.put_slice(CLONE_REF_MAGIC);
        b.put_u16_le(VERSION);
        b.put_u16_le(self.name.len() as u16);
        b.put_u16_le(self.prefix.len() as u16);
        b.put_u16_le(0);
        b.put_u128_le(self.uuid);
        b.put_slice(self.name.as_bytes());
        b.put_slice(self.prefix.as_bytes());
        put_crc(&mut b);
        b.freeze()
    }

    pub fn decode(buf: &[u8]) -> Result<CloneRef, FormatError> {
        const W: &str = "clone reference";
        if buf.len() > 4096 {
            return Err(err(W, format!("{} bytes, at most 4096", buf.len())));
        }
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, &buf[..buf.len() - 4]);
        magic_version(&mut r, CLONE_REF_MAGIC)?;
        let name_len = r.u16()? as usize;
        let prefix_len = r.u16()? as usize;
        r.u16()?;
        let uuid = r.u128()?;
        if r.left() != name_len + prefix_len || prefix_len > PREFIX_LEN_MAX {
            return Err(err(
                W,
                format!("name {name_len} and prefix {prefix_len} bytes but {} left", r.left()),
            ));
        }
        let name = check_name(W, r.take(name_len)?)?;
        let prefix =
            String::from_utf8(r.take(prefix_len)?.to_vec()).map_err(|_| err(W, "prefix is not UTF-8"))?;
        Ok(CloneRef { uuid, prefix, name })
    }
}

// ------------------------------------------------------------- data objects

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// Writes (and trims) destaged from the journal, or live data a
    /// cleaning pass rewrote.
    Data = 1,
    /// A writer opening the log; no extents (design 0008, "One writer").
    Claim = 2,
}

/// One extent of an object: `len` volume bytes from `vol_offset` are the
/// object's data from `obj_offset`, or zeros (`obj_offset` `None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ObjExtent {
    pub vol_offset: u64,
    pub len: u64,
    pub obj_offset: Option<u64>,
}

/// A data object's header (the data follows it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectHeader {
    pub kind: ObjectKind,
    pub uuid: u128,
    pub seq: u64,
    pub epoch: u64,
    /// Random per open: tells two writers' otherwise identical objects
    /// apart (two claims of the same seq are byte for byte alike without it).
    pub writer: u64,
    pub journal_seq: u64,
    pub data_len: u64,
    pub extents: Vec<ObjExtent>,
    /// CRC32C of each `CRC_BLOCK` of the data.
    pub crcs: Vec<u32>,
}

/// CRC32C per `CRC_BLOCK` of `data` (the last block may be short).
pub fn block_crcs(data: &[u8]) -> Vec<u32> {
    data.chunks(CRC_BLOCK as usize).map(crc32c).collect()
}

impl ObjectHeader {
    /// The encoded header's length.
    pub fn encoded_len(&self) -> usize {
        OBJECT_FIXED + OBJECT_EXTENT_LEN * self.extents.len() + 4 * self.crcs.len() + 4
    }

    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(self.encoded_len());
        b.put_slice(OBJECT_MAGIC);
        b.put_u16_le(VERSION);
        b.put_u16_le(self.kind as u16);
        b.put_u32_le(self.encoded_len() as u32);
        b.put_u128_le(self.uuid);
        b.put_u64_le(self.seq);
        b.put_u64_le(self.epoch);
        b.put_u64_le(self.writer);
        b.put_u64_le(self.journal_seq);
        b.put_u64_le(self.data_len);
        b.put_u32_le(self.extents.len() as u32);
        b.put_u32_le(self.crcs.len() as u32);
        for e in &self.extents {
            b.put_u64_le(e.vol_offset);
            b.put_u64_le(e.len);
            b.put_u64_le(e.obj_offset.unwrap_or(ZERO_OFFSET));
        }
        for c in &self.crcs {
            b.put_u32_le(*c);
        }
        put_crc(&mut b);
        debug_assert_eq!(b.len(), self.encoded_len());
        b.freeze()
    }

    /// The header length an object's first bytes announce, checked
    /// against the bounds, so a reader knows how much more to fetch.
    /// `prefix` needs at least [`OBJECT_PREFIX_LEN`] bytes.
    pub fn announced_len(prefix: &[u8]) -> Result<usize, FormatError> {
        const W: &str = "object header";
        let mut r = Reader::new(W, prefix);
        magic_version(&mut r, OBJECT_MAGIC)?;
        r.u16()?;
        let len = r.u32()? as u64;
        let max = (OBJECT_FIXED as u64)
            + OBJECT_EXTENT_LEN as u64 * OBJECT_EXTENTS_MAX
            + 4 * OBJECT_DATA_MAX.div_ceil(CRC_BLOCK)
            + 4;
        if len < OBJECT_FIXED as u64 + 4 || len > max {
            return Err(err(W, format!("header length {len} outside {}..={max}", OBJECT_FIXED + 4)));
        }
        Ok(len as usize)
    }

    /// Decodes a header for a volume of `volume_size` bytes. `buf` is
    /// exactly the header (its announced length).
    pub fn decode(buf: &[u8], volume_size: u64) -> Result<ObjectHeader, FormatError> {
        const W: &str = "object header";
        let len = Self::announced_len(buf)?;
        if buf.len() != len {
            return Err(err(W, format!("{} bytes given, header says {len}", buf.len())));
        }
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, &buf[..len - 4]);
        magic_version(&mut r, OBJECT_MAGIC)?;
        let kind = match r.u16()? {
            1 => ObjectKind::Data,
            2 => ObjectKind::Claim,
            k => return Err(err(W, format!("unknown object kind {k}"))),
        };
        r.u32()?;
        let uuid = r.u128()?;
        let seq = r.u64()?;
        let epoch = r.u64()?;
        let writer = r.u64()?;
        let journal_seq = r.u64()?;
        let data_len = r.u64()?;
        let n = r.u32()? as u64;
        let c = r.u32()? as u64;
        if data_len > OBJECT_DATA_MAX {
            return Err(err(W, format!("data length {data_len} above {OBJECT_DATA_MAX}")));
        }
        if n > OBJECT_EXTENTS_MAX || c != data_len.div_ceil(CRC_BLOCK) {
            return Err(err(W, format!("{n} extents, {c} CRCs for {data_len} data bytes")));
        }
        if r.left() as u64 != n * OBJECT_EXTENT_LEN as u64 + 4 * c {
            return Err(err(W, "extent and CRC tables do not fill the header"));
        }
        let mut extents = Vec::with_capacity(n as usize);
        let mut last_end = 0u64;
        for _ in 0..n {
            let (vol_offset, len, off) = (r.u64()?, r.u64()?, r.u64()?);
            check_aligned(W, "extent offset", vol_offset)?;
            check_aligned(W, "extent length", len)?;
            let end = vol_offset.checked_add(len).filter(|&e| e <= volume_size && len > 0);
            let Some(end) = end else {
                return Err(err(W, format!("extent [{vol_offset}, +{len}) outside the volume")));
            };
            if vol_offset < last_end {
                return Err(err(W, "extents not sorted or overlapping"));
            }
            last_end = end;
            let obj_offset = if off == ZERO_OFFSET {
                None
            } else {
                if off.checked_add(len).is_none_or(|e| e > data_len) {
                    return Err(err(W, format!("extent data [{off}, +{len}) past the {data_len}-byte data")));
                }
                Some(off)
            };
            extents.push(ObjExtent { vol_offset, len, obj_offset });
        }
        let mut crcs = Vec::with_capacity(c as usize);
        for _ in 0..c {
            crcs.push(r.u32()?);
        }
        if kind == ObjectKind::Claim && (!extents.is_empty() || data_len != 0) {
            return Err(err(W, "a claim object carries data"));
        }
        Ok(ObjectHeader { kind, uuid, seq, epoch, writer, journal_seq, data_len, extents, crcs })
    }
}

/// Bytes of an object to fetch first to learn its header length.
pub const OBJECT_PREFIX_LEN: usize = 16;

// ---------------------------------------------------------------- checkpoints

/// An object map entry in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CkptExtent {
    pub start: u64,
    pub len: u64,
    pub seq: u64,
    pub offset: u64,
}

/// An object's sizes, for cleaning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ObjStat {
    pub seq: u64,
    pub data_len: u64,
    pub live: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub uuid: u128,
    pub seq: u64,
    pub epoch: u64,
    pub journal_seq: u64,
    pub size: u64,
    pub extents: Vec<CkptExtent>,
    pub objects: Vec<ObjStat>,
}

const CKPT_FIXED: usize = 64;

impl Checkpoint {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(
            CKPT_FIXED + 8 + 32 * self.extents.len() + 8 + 24 * self.objects.len() + 4,
        );
        b.put_slice(CHECKPOINT_MAGIC);
        b.put_u16_le(VERSION);
        b.put_bytes(0, 6);
        b.put_u128_le(self.uuid);
        b.put_u64_le(self.seq);
        b.put_u64_le(self.epoch);
        b.put_u64_le(self.journal_seq);
        b.put_u64_le(self.size);
        b.put_u64_le(self.extents.len() as u64);
        for e in &self.extents {
            b.put_u64_le(e.start);
            b.put_u64_le(e.len);
            b.put_u64_le(e.seq);
            b.put_u64_le(e.offset);
        }
        b.put_u64_le(self.objects.len() as u64);
        for o in &self.objects {
            b.put_u64_le(o.seq);
            b.put_u64_le(o.data_len);
            b.put_u64_le(o.live);
        }
        put_crc(&mut b);
        b.freeze()
    }

    pub fn decode(buf: &[u8]) -> Result<Checkpoint, FormatError> {
        const W: &str = "checkpoint";
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, &buf[..buf.len() - 4]);
        magic_version(&mut r, CHECKPOINT_MAGIC)?;
        r.take(6)?;
        let uuid = r.u128()?;
        let (seq, epoch, journal_seq, size) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        if size == 0 || size > VOLUME_SIZE_MAX {
            return Err(err(W, format!("volume size {size}")));
        }
        let n = r.u64()?;
        if n > CHECKPOINT_ENTRIES_MAX || n.saturating_mul(32) > r.left() as u64 {
            return Err(err(W, format!("{n} extents in {} bytes", r.left())));
        }
        let mut extents = Vec::with_capacity(n as usize);
        let mut last_end = 0;
        for _ in 0..n {
            let e = CkptExtent { start: r.u64()?, len: r.u64()?, seq: r.u64()?, offset: r.u64()? };
            let end = e.start.checked_add(e.len).filter(|&x| x <= size && e.len > 0 && e.start >= last_end);
            let Some(end) = end else {
                return Err(err(
                    W,
                    format!("extent [{}, +{}) out of order or outside the volume", e.start, e.len),
                ));
            };
            if e.offset.checked_add(e.len).is_none_or(|x| x > OBJECT_DATA_MAX) || e.seq > seq {
                return Err(err(
                    W,
                    format!("extent [{}, +{}) points outside object {}", e.start, e.len, e.seq),
                ));
            }
            last_end = end;
            extents.push(e);
        }
        let m = r.u64()?;
        if m > CHECKPOINT_ENTRIES_MAX || m.saturating_mul(24) != r.left() as u64 {
            return Err(err(W, format!("{m} objects in {} bytes", r.left())));
        }
        let mut objects = Vec::with_capacity(m as usize);
        for _ in 0..m {
            let o = ObjStat { seq: r.u64()?, data_len: r.u64()?, live: r.u64()? };
            if o.live > o.data_len || o.data_len > OBJECT_DATA_MAX || o.seq > seq {
                return Err(err(W, format!("object {} with {} live of {} bytes", o.seq, o.live, o.data_len)));
            }
            objects.push(o);
        }
        Ok(Checkpoint { uuid, seq, epoch, journal_seq, size, extents, objects })
    }
}

// -------------------------------------------------------------------- journal

/// Each journal header copy occupies this much; the record area follows
/// both copies.
pub const JOURNAL_HEADER_SLOT: u64 = 4096;
/// Where the journal's record area starts.
pub const JOURNAL_AREA_START: u64 = 2 * JOURNAL_HEADER_SLOT;
/// A record's header; its data follows.
pub const RECORD_HEADER_LEN: u64 = 512;
/// Most data one record carries (larger writes are split).
pub const RECORD_DATA_MAX: u64 = 8 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalHeader {
    pub generation: u64,
    pub uuid: u128,
    pub area_len: u64,
    /// Offset in the area of the oldest record recovery walks from.
    pub tail_pos: u64,
    pub tail_seq: u64,
    /// Raised at every open: records of this run carry it.
    pub epoch: u64,
}

const JH_LEN: usize = 8 + 2 + 6 + 8 + 16 + 8 * 4 + 4;

impl JournalHeader {
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(JH_LEN);
        b.put_slice(JOURNAL_HEADER_MAGIC);
        b.put_u16_le(VERSION);
        b.put_bytes(0, 6);
        b.put_u64_le(self.generation);
        b.put_u128_le(self.uuid);
        b.put_u64_le(self.area_len);
        b.put_u64_le(self.tail_pos);
        b.put_u64_le(self.tail_seq);
        b.put_u64_le(self.epoch);
        put_crc(&mut b);
        b.freeze()
    }

    /// Decodes one header copy (`buf` at least the encoded length; the
    /// rest of the slot is ignored).
    pub fn decode(buf: &[u8]) -> Result<JournalHeader, FormatError> {
        const W: &str = "journal header";
        if buf.len() < JH_LEN {
            return Err(err(W, "truncated"));
        }
        let buf = &buf[..JH_LEN];
        check_trailing_crc(W, buf)?;
        let mut r = Reader::new(W, buf);
        magic_version(&mut r, JOURNAL_HEADER_MAGIC)?;
        r.take(6)?;
        let h = JournalHeader {
            generation: r.u64()?,
            uuid: r.u128()?,
            area_len: r.u64()?,
            tail_pos: r.u64()?,
            tail_seq: r.u64()?,
            epoch: r.u64()?,
        };
        if !h.area_len.is_multiple_of(SECTOR)
            || !h.tail_pos.is_multiple_of(SECTOR)
            || h.tail_pos >= h.area_len.max(1)
        {
            return Err(err(W, format!("tail {} in an area of {}", h.tail_pos, h.area_len)));
        }
        Ok(h)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    Write = 1,
    Trim = 2,
    /// The rest of the area is unused: the next record is at its start.
    Wrap = 3,
}

/// A journal record's header (512 bytes on disk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub seq: u64,
    pub epoch: u64,
    pub vol_offset: u64,
    pub len: u64,
    /// CRC32C of the header's bytes before this field and of the data.
    pub crc: u32,
}

const RH_FIXED: usize = 8 + 2 + 2 + 4 + 8 * 4;

impl RecordHeader {
    /// Bytes the record takes in the area (header and data).
    pub fn total_len(&self) -> u64 {
        RECORD_HEADER_LEN + if self.kind == RecordKind::Write { self.len } else { 0 }
    }

    fn fixed(&self) -> BytesMut {
        let mut b = BytesMut::with_capacity(RECORD_HEADER_LEN as usize);
        b.put_slice(RECORD_MAGIC);
        b.put_u16_le(VERSION);
        b.put_u16_le(self.kind as u16);
        b.put_u32_le(0);
        b.put_u64_le(self.seq);
        b.put_u64_le(self.epoch);
        b.put_u64_le(self.vol_offset);
        b.put_u64_le(self.len);
        b
    }

    /// The 512-byte header of a record carrying `data` (empty unless a write).
    pub fn encode(kind: RecordKind, seq: u64, epoch: u64, vol_offset: u64, len: u64, data: &[u8]) -> Bytes {
        let h = RecordHeader { kind, seq, epoch, vol_offset, len, crc: 0 };
        let mut b = h.fixed();
        let crc = crc32c_append(crc32c(&b), data);
        b.put_u32_le(crc);
        b.resize(RECORD_HEADER_LEN as usize, 0);
        b.freeze()
    }

    /// Decodes a record header; its CRC is checked later, with the data
    /// ([`RecordHeader::check_data`]). `area_len` bounds the data.
    pub fn decode(buf: &[u8], area_len: u64) -> Result<RecordHeader, FormatError> {
        const W: &str = "journal record";
        if buf.len() < RH_FIXED + 4 {
            return Err(err(W, "truncated"));
        }
        let mut r = Reader::new(W, buf);
        magic_version(&mut r, RECORD_MAGIC)?;
        let kind = match r.u16()? {
            1 => RecordKind::Write,
            2 => RecordKind::Trim,
            3 => RecordKind::Wrap,
            k => return Err(err(W, format!("unknown record kind {k}"))),
        };
        r.u32()?;
        let (seq, epoch, vol_offset, len) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
        let crc = r.u32()?;
        let h = RecordHeader { kind, seq, epoch, vol_offset, len, crc };
        check_aligned(W, "offset", vol_offset)?;
        check_aligned(W, "length", len)?;
        if kind == RecordKind::Write && (len > RECORD_DATA_MAX || h.total_len() > area_len) {
            return Err(err(W, format!("write record of {len} bytes")));
        }
        Ok(h)
    }

    /// Checks the record's CRC over its header and `data`.
    pub fn check_data(&self, data: &[u8]) -> Result<(), FormatError> {
        let crc = crc32c_append(crc32c(&self.fixed()), data);
        if crc != self.crc {
            return Err(err("journal record", format!("seq {}: CRC32C mismatch (torn or stale)", self.seq)));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
