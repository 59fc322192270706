//! The volume's superblock: everything needed to open a volume, stored in
//! tract 0 of its blob, twice (at 0 and at 4 KiB, written alternately with
//! a generation number) so a torn update leaves the previous copy.

use blizzard_core::crc::crc32c;

use crate::access::{check_identity, AccessEntry, ACCESS_ENTRIES_MAX, IDENTITY_LEN_MAX};

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"BLZVOLUM";
/// The newest format this build reads. Format 1 is a volume in its blob
/// whose log (if any) is in one extent; format 2 a log whose resizes moved
/// its checkpoints (several log extents); format 3 a volume whose data is
/// elsewhere (an LSVD volume in an object store: [`Backend::S3`]), the blob
/// holding only this record; format 4 a volume with an access list
/// (`crate::access`); format 5 a volume with snapshots, whose data is a
/// stack of layers in its blob (`layers`, design 0011). Each is written
/// with the lowest format that
/// holds it, so older builds refuse what they cannot serve by version
/// instead of misreading it, and read everything else as before.
pub const SUPERBLOCK_FORMAT: u32 = 5;
/// Most extents a log's physical blocks may span (each resize that moves
/// the checkpoints adds one); bounds what decoding allocates.
pub const LOG_EXTENTS_MAX: usize = 64;
/// Each copy occupies one whole 4 KiB chunk of tract 0, so updating one
/// never rewrites bytes of the other.
pub const SUPERBLOCK_COPY_LEN: u32 = 4096;
/// Longest volume name.
pub const NAME_LEN_MAX: usize = 200;
/// Longest object store URL and cache directory an S3 volume's record
/// holds (together with everything else they fit one copy with room).
pub const S3_URL_LEN_MAX: usize = 1024;
pub const CACHE_DIR_LEN_MAX: usize = 1024;

/// When a write is acknowledged and how ordering is kept (Blizzard §2.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitMode {
    /// Acknowledged once durable on every replica.
    WriteThrough = 1,
    /// Acknowledged at once; written in flush-epoch order.
    FastAck = 2,
    /// Acknowledged and issued at once into a log; applied in log order.
    Log = 3,
}

impl CommitMode {
    pub fn name(self) -> &'static str {
        match self {
            CommitMode::WriteThrough => "write-through",
            CommitMode::FastAck => "fast-ack",
            CommitMode::Log => "log",
        }
    }

    pub fn parse(s: &str) -> Option<CommitMode> {
        match s {
            "write-through" => Some(CommitMode::WriteThrough),
            "fast-ack" => Some(CommitMode::FastAck),
            "log" => Some(CommitMode::Log),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Option<CommitMode> {
        [CommitMode::WriteThrough, CommitMode::FastAck, CommitMode::Log].into_iter().find(|m| *m as u8 == v)
    }
}

/// What a flush promises, independent of the commit mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushPolicy {
    /// A flush returns once everything acknowledged before it is durable on
    /// every replica: NBD's contract, a disk with a write cache.
    Durable = 1,
    /// Blizzard's fast flush: acknowledged at once, it only orders; after a
    /// crash the volume holds a prefix of the flush epochs. Weaker than NBD.
    Ordered = 2,
}

impl FlushPolicy {
    pub fn name(self) -> &'static str {
        match self {
            FlushPolicy::Durable => "durable",
            FlushPolicy::Ordered => "ordered",
        }
    }

    pub fn parse(s: &str) -> Option<FlushPolicy> {
        match s {
            "durable" => Some(FlushPolicy::Durable),
            "ordered" => Some(FlushPolicy::Ordered),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Option<FlushPolicy> {
        [FlushPolicy::Durable, FlushPolicy::Ordered].into_iter().find(|m| *m as u8 == v)
    }
}

/// Caps on acknowledged-but-not-durable data; beyond any of them new writes
/// wait (bounded exposure).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExposureLimits {
    pub bytes_max: u64,
    pub writes_max: u32,
    /// The oldest undurable write may be at most this old.
    pub age_ms_max: u32,
}

impl Default for ExposureLimits {
    fn default() -> Self {
        ExposureLimits { bytes_max: 64 << 20, writes_max: 4096, age_ms_max: 5000 }
    }
}

/// Consecutive physical blocks of the log starting at a tract boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogExtent {
    pub first_tract: u64,
    pub blocks: u64,
}

/// Where a log-mode volume keeps its checkpoints and log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogGeometry {
    /// Physical blocks in the log (more than virtual blocks: the slack
    /// lets writes go to free blocks while old versions are still live).
    pub physical_blocks: u64,
    /// First tract of each of the two checkpoint slots.
    pub checkpoint_tracts: [u64; 2],
    /// Tracts per checkpoint slot.
    pub checkpoint_slot_tracts: u64,
    /// Where physical blocks live, in order: block p is in the extent
    /// where the running sum of `blocks` passes p. One extent unless a
    /// resize moved the checkpoints (design 0003, "Resizing a log volume").
    /// The block counts sum to `physical_blocks`.
    pub extents: Vec<LogExtent>,
}

/// Where a volume's data lives.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// In the volume's own blob, after tract 0 (every format).
    #[default]
    Blob,
    /// An LSVD volume (design 0008): a log of objects under a prefix of an
    /// S3-compatible store, written through a journal on the serving
    /// host's disk. The blob holds only this record (format 3).
    S3(S3Backend),
}

/// An S3 volume's record: where its objects and its cache are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct S3Backend {
    /// `http://host:port/bucket/prefix` (or `https://`, `s3://`).
    pub url: String,
    /// The uuid in the prefix's descriptor: a prefix holding another
    /// volume is refused at open.
    pub uuid: u128,
    /// The cache directory on the serving host (absolute).
    pub cache_dir: String,
    /// Size of the journal file created there.
    pub cache_bytes: u64,
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Blob => "blob",
            Backend::S3(_) => "s3",
        }
    }

    pub fn s3(&self) -> Option<&S3Backend> {
        match self {
            Backend::Blob => None,
            Backend::S3(s) => Some(s),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub name: String,
    /// Bumped by every rewrite; the valid copy with the highest wins. The
    /// copy written is `generation mod 2`.
    pub generation: u64,
    pub size_bytes: u64,
    /// Striping unit (write-through, fast-ack) or log block (log mode).
    pub block_size: u32,
    pub segment_tracts: u32,
    pub replication: u8,
    pub mode: CommitMode,
    pub flush: FlushPolicy,
    pub exposure: ExposureLimits,
    pub created_unix_s: u64,
    pub log: Option<LogGeometry>,
    /// Where the data lives (format 3 for anything but the blob).
    pub backend: Backend,
    /// Who may use the volume (format 4 when not empty; `access`).
    pub access: Vec<AccessEntry>,
    /// Where the catalog of its layers and snapshots is, once it has had a
    /// snapshot (format 5; `snap`, design 0011).
    pub layers: Option<LayersRef>,
}

/// Where a volume's snapshot catalog is: two slots of `slot_tracts`
/// tracts each, the first at blob tract `catalog`, the second right after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayersRef {
    pub catalog: u64,
    pub slot_tracts: u64,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum SuperblockError {
    #[error("not a blizzard volume (no superblock)")]
    NotAVolume,
    #[error("both superblock copies are damaged; the volume cannot be opened")]
    Damaged,
    #[error("volume format {0} is not supported by this build (supports 1..={SUPERBLOCK_FORMAT})")]
    Format(u32),
    #[error("superblock field {0} is invalid")]
    Field(&'static str),
}

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A length-prefixed string, cut at `max` bytes (callers validate
    /// first; the cut only keeps the copy in bounds).
    fn str(&mut self, v: &str, max: usize) {
        let b = &v.as_bytes()[..v.len().min(max)];
        self.0.extend_from_slice(&(b.len() as u16).to_le_bytes());
        self.0.extend_from_slice(b);
    }
}

struct Dec<'a>(&'a [u8]);

impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], SuperblockError> {
        if self.0.len() < n {
            return Err(SuperblockError::Field("length"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, SuperblockError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, SuperblockError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, SuperblockError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn str(&mut self, max: usize, field: &'static str) -> Result<String, SuperblockError> {
        let b = self.take(2)?;
        let n = u16::from_le_bytes([b[0], b[1]]) as usize;
        if n > max {
            return Err(SuperblockError::Field(field));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| SuperblockError::Field(field))
    }
}

impl Superblock {
    /// One copy: `SUPERBLOCK_COPY_LEN` bytes ending in a CRC32C.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc(Vec::with_capacity(SUPERBLOCK_COPY_LEN as usize));
        e.0.extend_from_slice(&SUPERBLOCK_MAGIC);
        e.u32(self.format());
        e.u64(self.generation);
        let name = &self.name.as_bytes()[..self.name.len().min(NAME_LEN_MAX)];
        e.u32(name.len() as u32);
        e.0.extend_from_slice(name);
        e.u64(self.size_bytes);
        e.u32(self.block_size);
        e.u32(self.segment_tracts);
        e.u8(self.replication);
        e.u8(self.mode as u8);
        e.u8(self.flush as u8);
        e.u64(self.exposure.bytes_max);
        e.u32(self.exposure.writes_max);
        e.u32(self.exposure.age_ms_max);
        e.u64(self.created_unix_s);
        match &self.log {
            None => e.u8(0),
            // One extent: exactly the format-1 bytes, so a log volume that
            // never moved its checkpoints stays readable by older builds.
            Some(l) if l.extents.len() == 1 => {
                e.u8(1);
                e.u64(l.physical_blocks);
                e.u64(l.checkpoint_tracts[0]);
                e.u64(l.checkpoint_tracts[1]);
                e.u64(l.checkpoint_slot_tracts);
                e.u64(l.extents[0].first_tract);
            }
            Some(l) => {
                e.u8(2);
                e.u64(l.physical_blocks);
                e.u64(l.checkpoint_tracts[0]);
                e.u64(l.checkpoint_tracts[1]);
                e.u64(l.checkpoint_slot_tracts);
                e.u32(l.extents.len() as u32);
                for x in &l.extents {
                    e.u64(x.first_tract);
                    e.u64(x.blocks);
                }
            }
        }
        let format = self.format();
        match &self.backend {
            // Formats 3 and 4: older builds stop at the version.
            Backend::S3(b) => {
                e.u8(1);
                e.0.extend_from_slice(&b.uuid.to_le_bytes());
                e.u64(b.cache_bytes);
                e.str(&b.url, S3_URL_LEN_MAX);
                e.str(&b.cache_dir, CACHE_DIR_LEN_MAX);
            }
            Backend::Blob if format >= 4 => e.u8(0),
            Backend::Blob => {}
        }
        if format >= 4 {
            let n = self.access.len().min(ACCESS_ENTRIES_MAX);
            e.u8(n as u8);
            for a in &self.access[..n] {
                e.str(&a.identity, IDENTITY_LEN_MAX);
                e.u8(if a.read_only { 2 } else { 1 });
            }
        }
        if let Some(l) = &self.layers {
            e.u64(l.catalog);
            e.u64(l.slot_tracts);
        }
        let body_len = e.0.len();
        let mut b = e.0;
        b.resize(SUPERBLOCK_COPY_LEN as usize - 8, 0);
        b.extend_from_slice(&(body_len as u32).to_le_bytes());
        let crc = crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes one copy; `Ok(None)` if it is blank or damaged.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, SuperblockError> {
        let n = SUPERBLOCK_COPY_LEN as usize;
        if b.len() < n || b[..8] != SUPERBLOCK_MAGIC {
            return Ok(None);
        }
        let crc = u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
        if crc32c(&b[..n - 4]) != crc {
            return Ok(None);
        }
        let mut d = Dec(&b[8..n - 8]);
        let format = d.u32()?;
        if !(1..=SUPERBLOCK_FORMAT).contains(&format) {
            return Err(SuperblockError::Format(format));
        }
        let generation = d.u64()?;
        let name_len = d.u32()? as usize;
        if name_len > NAME_LEN_MAX {
            return Err(SuperblockError::Field("name"));
        }
        let name =
            String::from_utf8(d.take(name_len)?.to_vec()).map_err(|_| SuperblockError::Field("name"))?;
        let size_bytes = d.u64()?;
        let block_size = d.u32()?;
        let segment_tracts = d.u32()?;
        let replication = d.u8()?;
        let mode = CommitMode::from_u8(d.u8()?).ok_or(SuperblockError::Field("mode"))?;
        let flush = FlushPolicy::from_u8(d.u8()?).ok_or(SuperblockError::Field("flush"))?;
        let exposure = ExposureLimits { bytes_max: d.u64()?, writes_max: d.u32()?, age_ms_max: d.u32()? };
        let created_unix_s = d.u64()?;
        let log = match d.u8()? {
            0 => None,
            1 => {
                let physical_blocks = d.u64()?;
                Some(LogGeometry {
                    physical_blocks,
                    checkpoint_tracts: [d.u64()?, d.u64()?],
                    checkpoint_slot_tracts: d.u64()?,
                    extents: vec![LogExtent { first_tract: d.u64()?, blocks: physical_blocks }],
                })
            }
            2 if format >= 2 => {
                let physical_blocks = d.u64()?;
                let checkpoint_tracts = [d.u64()?, d.u64()?];
                let checkpoint_slot_tracts = d.u64()?;
                let n = d.u32()? as usize;
                // Bounded before allocating.
                if n == 0 || n > LOG_EXTENTS_MAX {
                    return Err(SuperblockError::Field("log extents"));
                }
                let mut extents = Vec::with_capacity(n);
                let mut sum = 0u64;
                for _ in 0..n {
                    let x = LogExtent { first_tract: d.u64()?, blocks: d.u64()? };
                    sum = sum.checked_add(x.blocks).ok_or(SuperblockError::Field("log extents"))?;
                    extents.push(x);
                }
                if sum != physical_blocks {
                    return Err(SuperblockError::Field("log extents"));
                }
                Some(LogGeometry { physical_blocks, checkpoint_tracts, checkpoint_slot_tracts, extents })
            }
            _ => return Err(SuperblockError::Field("log")),
        };
        let backend = if format >= 3 {
            match d.u8()? {
                0 if format >= 4 => Backend::Blob,
                1 => {
                    let uuid = u128::from_le_bytes(
                        d.take(16)?.try_into().map_err(|_| SuperblockError::Field("backend"))?,
                    );
                    let cache_bytes = d.u64()?;
                    let url = d.str(S3_URL_LEN_MAX, "s3 url")?;
                    let cache_dir = d.str(CACHE_DIR_LEN_MAX, "cache dir")?;
                    if url.is_empty() || cache_dir.is_empty() || log.is_some() {
                        return Err(SuperblockError::Field("backend"));
                    }
                    Backend::S3(S3Backend { url, uuid, cache_dir, cache_bytes })
                }
                _ => return Err(SuperblockError::Field("backend")),
            }
        } else {
            Backend::Blob
        };
        let mut access = Vec::new();
        if format >= 4 {
            let n = d.u8()? as usize;
            // Bounded before reading; an empty list is written as format 3
            // or lower, unless format 5 needs the bytes after it.
            if (n == 0 && format == 4) || n > ACCESS_ENTRIES_MAX {
                return Err(SuperblockError::Field("access"));
            }
            for _ in 0..n {
                let identity = d.str(IDENTITY_LEN_MAX, "access identity")?;
                let read_only = match d.u8()? {
                    1 => false,
                    2 => true,
                    _ => return Err(SuperblockError::Field("access mode")),
                };
                if check_identity(&identity).is_err()
                    || access.iter().any(|a: &AccessEntry| a.identity == identity)
                {
                    return Err(SuperblockError::Field("access identity"));
                }
                access.push(AccessEntry { identity, read_only });
            }
        }
        let layers = if format >= 5 {
            let l = LayersRef { catalog: d.u64()?, slot_tracts: d.u64()? };
            if l.catalog == 0 || l.slot_tracts == 0 || backend != Backend::Blob {
                return Err(SuperblockError::Field("layers"));
            }
            Some(l)
        } else {
            None
        };
        if block_size == 0 || !block_size.is_power_of_two() || segment_tracts == 0 || replication == 0 {
            return Err(SuperblockError::Field("geometry"));
        }
        Ok(Some(Superblock {
            name,
            generation,
            size_bytes,
            block_size,
            segment_tracts,
            replication,
            mode,
            flush,
            exposure,
            created_unix_s,
            log,
            backend,
            access,
            layers,
        }))
    }

    /// The format this superblock needs: 5 with snapshots, 4 with an
    /// access list, 3 for data outside the blob, 2 for a log in several
    /// extents, else 1.
    pub fn format(&self) -> u32 {
        if self.layers.is_some() {
            return 5;
        }
        if !self.access.is_empty() {
            return 4;
        }
        match (&self.backend, &self.log) {
            (Backend::S3(_), _) => 3,
            (Backend::Blob, Some(l)) if l.extents.len() > 1 => 2,
            _ => 1,
        }
    }

    /// Picks the newest valid of the two copies.
    pub fn pick(a: &[u8], b: &[u8]) -> Result<Superblock, SuperblockError> {
        let blank = |x: &[u8]| x.iter().all(|&v| v == 0);
        match (Self::decode(a)?, Self::decode(b)?) {
            (Some(x), Some(y)) => Ok(if y.generation > x.generation { y } else { x }),
            (Some(x), None) | (None, Some(x)) => Ok(x),
            (None, None) if blank(a) && blank(b) => Err(SuperblockError::NotAVolume),
            (None, None) if a.starts_with(&SUPERBLOCK_MAGIC) || b.starts_with(&SUPERBLOCK_MAGIC) => {
                Err(SuperblockError::Damaged)
            }
            (None, None) => Err(SuperblockError::NotAVolume),
        }
    }

    /// Byte offset in tract 0 of the copy this generation is written to.
    pub fn copy_offset(generation: u64) -> u32 {
        (generation % 2) as u32 * SUPERBLOCK_COPY_LEN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_with_snapshots_is_format_5_and_names_its_catalog() {
        let mut s = sample();
        s.log = None;
        s.layers = Some(LayersRef { catalog: 1000, slot_tracts: 1 });
        assert_eq!(s.format(), 5);
        assert_eq!(Superblock::decode(&s.encode()), Ok(Some(s.clone())));
        // With an access list too.
        s.access = vec![AccessEntry { identity: "vm1".into(), read_only: false }];
        assert_eq!(Superblock::decode(&s.encode()), Ok(Some(s.clone())));
        // A catalog at tract 0 (the superblock's own) is refused.
        s.layers = Some(LayersRef { catalog: 0, slot_tracts: 1 });
        assert_eq!(Superblock::decode(&s.encode()), Err(SuperblockError::Field("layers")));
    }

    fn sample() -> Superblock {
        Superblock {
            name: "db1".into(),
            generation: 3,
            size_bytes: 10 << 30,
            block_size: 65536,
            segment_tracts: 128,
            replication: 3,
            mode: CommitMode::Log,
            flush: FlushPolicy::Durable,
            exposure: ExposureLimits::default(),
            created_unix_s: 1_767_225_600,
            log: Some(LogGeometry {
                physical_blocks: 200_000,
                checkpoint_tracts: [1, 3],
                checkpoint_slot_tracts: 2,
                extents: vec![LogExtent { first_tract: 5, blocks: 200_000 }],
            }),
            backend: Backend::Blob,
            access: Vec::new(),
            layers: None,
        }
    }

    fn s3_sample() -> Superblock {
        Superblock {
            mode: CommitMode::WriteThrough,
            replication: 1,
            block_size: 4096,
            segment_tracts: 1,
            log: None,
            backend: Backend::S3(S3Backend {
                url: "http://127.0.0.1:8333/lsvd/vols/db1".into(),
                uuid: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
                cache_dir: "/var/lib/blizzard/cache/db1".into(),
                cache_bytes: 1 << 30,
            }),
            ..sample()
        }
    }

    /// Re-seals a copy after a test edited its body.
    fn reseal(b: &mut [u8]) {
        let n = b.len();
        let crc = crc32c(&b[..n - 4]);
        b[n - 4..].copy_from_slice(&crc.to_le_bytes());
    }

    /// Records written before backends existed still decode, as blob
    /// volumes: a blob volume's copy is byte for byte what format 1 was
    /// (pinned by its CRC), and says format 1.
    #[test]
    fn blob_volumes_keep_their_old_bytes() -> Result<(), SuperblockError> {
        let a = sample().encode();
        assert_eq!(&a[8..12], &1u32.to_le_bytes());
        let n = a.len();
        assert_eq!(
            u32::from_le_bytes([a[n - 4], a[n - 3], a[n - 2], a[n - 1]]),
            0x2f6f_add6,
            "golden CRC (recomputed by hand from the format-1 layout)"
        );
        assert_eq!(Superblock::decode(&a)?.map(|s| s.backend), Some(Backend::Blob));
        Ok(())
    }

    /// An S3 volume's record round-trips as format 3; any flipped bit is
    /// refused; lengths past their bounds, a record naming both a log and
    /// an object store, and an unknown backend are refused without a panic.
    #[test]
    fn s3_records_round_trip_and_bounds() -> Result<(), SuperblockError> {
        let s = s3_sample();
        assert_eq!(s.format(), 3);
        let a = s.encode();
        assert_eq!(&a[8..12], &3u32.to_le_bytes());
        assert_eq!(Superblock::decode(&a)?, Some(s.clone()));
        for bit in (0..(a.len() * 8)).step_by(97) {
            let mut bad = a.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(Superblock::decode(&bad).ok().flatten(), None, "bit {bit}");
        }
        // The URL's length field, raised past its bound.
        let url_at = a.windows(5).position(|w| w == b"http:").ok_or(SuperblockError::Field("test"))?;
        let mut long = a.clone();
        long[url_at - 2..url_at].copy_from_slice(&(S3_URL_LEN_MAX as u16 + 1).to_le_bytes());
        reseal(&mut long);
        assert_eq!(Superblock::decode(&long), Err(SuperblockError::Field("s3 url")));
        // ... and past the end of the body.
        let mut past = a.clone();
        past[url_at - 2..url_at].copy_from_slice(&1000u16.to_le_bytes());
        reseal(&mut past);
        assert!(Superblock::decode(&past).is_err());
        // An unknown backend tag.
        let tag_at = url_at - 2 - 8 - 16 - 1;
        let mut unknown = a.clone();
        unknown[tag_at] = 7;
        reseal(&mut unknown);
        assert_eq!(Superblock::decode(&unknown), Err(SuperblockError::Field("backend")));
        // A log and an object store at once.
        let both = Superblock { log: sample().log, ..s.clone() };
        assert_eq!(Superblock::decode(&both.encode()), Err(SuperblockError::Field("backend")));
        Ok(())
    }

    /// An access list makes format 4, for a blob volume (a backend tag of
    /// 0) and an S3 one alike; without one nothing changes (the golden
    /// bytes above). The list's bounds are checked before it is read.
    #[test]
    fn access_lists_round_trip_as_format_4_and_bounds() -> Result<(), SuperblockError> {
        let list = vec![
            AccessEntry { identity: "alice".into(), read_only: false },
            AccessEntry { identity: "bob".into(), read_only: true },
        ];
        for base in [sample(), s3_sample()] {
            let before = base.format();
            assert!(before <= 3);
            let s = Superblock { access: list.clone(), ..base };
            assert_eq!(s.format(), 4);
            let a = s.encode();
            assert_eq!(&a[8..12], &4u32.to_le_bytes());
            assert_eq!(Superblock::decode(&a)?, Some(s.clone()));
            // The most entries of the longest identities still fit a copy
            // next to the longest S3 record.
            let full: Vec<_> = (0..ACCESS_ENTRIES_MAX)
                .map(|i| AccessEntry { identity: format!("{i:0>64}"), read_only: i % 2 == 0 })
                .collect();
            let mut big = Superblock { access: full, ..s.clone() };
            if let Backend::S3(b) = &mut big.backend {
                b.url = "u".repeat(S3_URL_LEN_MAX);
                b.cache_dir = "d".repeat(CACHE_DIR_LEN_MAX);
            }
            big.name = "n".repeat(NAME_LEN_MAX);
            assert_eq!(Superblock::decode(&big.encode())?, Some(big.clone()));
            // The count past its bound, an unknown mode, a duplicate.
            let at = a.windows(5).position(|w| w == b"alice").ok_or(SuperblockError::Field("test"))? - 3;
            assert_eq!(a[at], 2);
            for (count, want) in [(0u8, "access"), (ACCESS_ENTRIES_MAX as u8 + 1, "access")] {
                let mut bad = a.clone();
                bad[at] = count;
                reseal(&mut bad);
                assert_eq!(Superblock::decode(&bad), Err(SuperblockError::Field(want)));
            }
            let mut bad = a.clone();
            bad[at + 3 + 5] = 9;
            reseal(&mut bad);
            assert_eq!(Superblock::decode(&bad), Err(SuperblockError::Field("access mode")));
            let dup = Superblock { access: vec![list[0].clone(), list[0].clone()], ..s.clone() };
            assert_eq!(Superblock::decode(&dup.encode()), Err(SuperblockError::Field("access identity")));
        }
        Ok(())
    }

    /// A copy survives a round trip; any flipped bit makes it invalid; the
    /// newer of two valid copies wins and a damaged one falls back.
    #[test]
    fn round_trip_damage_and_pick() -> Result<(), SuperblockError> {
        let s = sample();
        let a = s.encode();
        assert_eq!(a.len(), SUPERBLOCK_COPY_LEN as usize);
        assert_eq!(Superblock::decode(&a)?, Some(s.clone()));
        for bit in [0usize, 70, 800, 4090 * 8] {
            let mut bad = a.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert_eq!(Superblock::decode(&bad).ok().flatten(), None, "bit {bit}");
        }
        let mut newer = s.clone();
        newer.generation = 4;
        newer.size_bytes = 20 << 30;
        let b = newer.encode();
        assert_eq!(Superblock::pick(&a, &b)?, newer);
        let mut torn = b.clone();
        torn[100] ^= 0xff;
        assert_eq!(Superblock::pick(&a, &torn)?, s);
        assert_eq!(Superblock::pick(&[0; 4096], &[0; 4096]), Err(SuperblockError::NotAVolume));
        let mut torn_a = a.clone();
        torn_a[50] ^= 1;
        assert_eq!(Superblock::pick(&torn_a, &torn), Err(SuperblockError::Damaged));
        Ok(())
    }

    /// A one-extent log is written as format 1 (older builds read it); a
    /// log in several extents round-trips as format 2; inconsistent or
    /// unbounded extent lists are refused.
    #[test]
    fn log_extents_round_trip_and_bounds() -> Result<(), SuperblockError> {
        let s = sample();
        assert_eq!(s.format(), 1);
        assert_eq!(u32::from_le_bytes([s.encode()[8], s.encode()[9], s.encode()[10], s.encode()[11]]), 1);
        let mut m = s.clone();
        let l = m.log.as_mut().ok_or(SuperblockError::Field("log"))?;
        l.physical_blocks = 300_000;
        l.checkpoint_tracts = [60, 64];
        l.checkpoint_slot_tracts = 4;
        l.extents.push(LogExtent { first_tract: 68, blocks: 100_000 });
        assert_eq!(m.format(), 2);
        assert_eq!(Superblock::decode(&m.encode())?, Some(m.clone()));

        let mut bad = m.clone();
        if let Some(l) = bad.log.as_mut() {
            l.physical_blocks += 1;
        }
        assert_eq!(Superblock::decode(&bad.encode()), Err(SuperblockError::Field("log extents")));
        let mut many = m.clone();
        if let Some(l) = many.log.as_mut() {
            l.extents = vec![LogExtent { first_tract: 5, blocks: 1 }; LOG_EXTENTS_MAX + 1];
            l.physical_blocks = l.extents.len() as u64;
        }
        assert_eq!(Superblock::decode(&many.encode()), Err(SuperblockError::Field("log extents")));
        Ok(())
    }
}
