//! The tract locator table (FDS §2.2, §3.3): rows of tractservers, each row
//! with a version. A client finds tract `i` of blob `g` in row
//! `start + (hash(g) + i) mod len` by arithmetic alone; the metadata server
//! is never on the data path. Building the table is the metadata server's
//! business (`blizzard-metaserver::tlt_builder`); this module only reads it.
//!
//! **Sections and placements** (Ursa §3.1, design 0009). A table built over
//! disks of both classes is a concatenation of sections, one per
//! [`Placement`]: `any` (every disk, as FDS builds it; always first, from
//! row 0), `ssd`, `hdd` and `hybrid` (an ssd primary, hdd backups). A blob's
//! placement is written in its id ([`Placement::of`]), so every party —
//! client, tractserver, metadata server — finds a tract's row from the id
//! and the table alone, as before. A table without sections (every table
//! of a single-class cluster, and every table built before sections
//! existed) is one `any` section: placement arithmetic there is unchanged.
//! Sections are fixed when the table is first built; rows change members,
//! never sections, so a blob never moves.

use crate::ids::{BlobId, TractNo, TsId};
use crate::limits::{NAME_LEN_MAX, REPLICATION_MAX, TLT_MEMBERS_MAX, TLT_ROWS_MAX};

/// What kind of disk a tractserver owns, as it declares it (`--class`).
/// The hybrid tier (Ursa §3) places a row's primary on a fast disk and its
/// backups on slow ones behind journals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DiskClass {
    /// Flash: random access costs about what sequential does.
    #[default]
    Ssd,
    /// A spinning disk: every random access pays a seek.
    Hdd,
}

impl DiskClass {
    pub fn name(self) -> &'static str {
        match self {
            DiskClass::Ssd => "ssd",
            DiskClass::Hdd => "hdd",
        }
    }
}

impl std::fmt::Display for DiskClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DiskClass {
    type Err = String;
    fn from_str(s: &str) -> Result<DiskClass, String> {
        match s {
            "ssd" => Ok(DiskClass::Ssd),
            "hdd" => Ok(DiskClass::Hdd),
            _ => Err(format!("unknown disk class {s:?}: give ssd or hdd")),
        }
    }
}

/// Where a blob's replicas live: which section of the table its tracts map
/// to, and so which class of disk each column of its rows must be.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Placement {
    /// Every disk, whatever its class (the table FDS builds).
    #[default]
    Any = 0,
    /// Every replica on a fast disk.
    Ssd = 1,
    /// Every replica on a slow disk, and no backup journal: the cheapest,
    /// slowest tier.
    Hdd = 2,
    /// The primary (column 0) on a fast disk, the backups on slow disks
    /// behind their journals (Ursa §3.1); reads go to the primary.
    Hybrid = 3,
}

/// The top 16 bits of a placed blob id: `PLACEMENT_MARK | placement`.
/// Part of the placement contract, like [`blob_hash`]. An id whose top
/// bits are anything else is placed `any`, which is every id made before
/// placements existed (a random id carries a mark by chance once in 16,384
/// and is then simply placed there, consistently for every party).
const PLACEMENT_MARK: u16 = 0x5ec0;
const PLACEMENT_SHIFT: u32 = 112;

impl Placement {
    pub const ALL: [Placement; 4] = [Placement::Any, Placement::Ssd, Placement::Hdd, Placement::Hybrid];

    pub fn name(self) -> &'static str {
        match self {
            Placement::Any => "any",
            Placement::Ssd => "ssd",
            Placement::Hdd => "hdd",
            Placement::Hybrid => "hybrid",
        }
    }

    pub fn from_u8(v: u8) -> Option<Placement> {
        Placement::ALL.get(v as usize).copied()
    }

    /// The class of disk column `col` of this placement's rows must be
    /// (`None`: any).
    pub fn column_class(self, col: usize) -> Option<DiskClass> {
        match self {
            Placement::Any => None,
            Placement::Ssd => Some(DiskClass::Ssd),
            Placement::Hdd => Some(DiskClass::Hdd),
            Placement::Hybrid if col == 0 => Some(DiskClass::Ssd),
            Placement::Hybrid => Some(DiskClass::Hdd),
        }
    }

    /// The placement written in a blob's id.
    pub fn of(blob: BlobId) -> Placement {
        let top = (blob.0 >> PLACEMENT_SHIFT) as u16;
        if top & !3 == PLACEMENT_MARK {
            Placement::ALL[(top & 3) as usize]
        } else {
            Placement::Any
        }
    }

    /// `blob` with this placement written in its top 16 bits. An `any`
    /// id is returned unchanged unless it carries another placement's mark.
    pub fn place(self, blob: BlobId) -> BlobId {
        if self == Placement::Any && Placement::of(blob) == Placement::Any {
            return blob;
        }
        let low = blob.0 & ((1u128 << PLACEMENT_SHIFT) - 1);
        BlobId(low | (u128::from(PLACEMENT_MARK | self as u16) << PLACEMENT_SHIFT))
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Placement, String> {
        Placement::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown placement {s:?}: give any, ssd, hdd or hybrid"))
    }
}

/// A run of rows serving one placement: rows `start .. start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TltSection {
    pub placement: Placement,
    pub start: u32,
    pub len: u32,
}

impl TltSection {
    pub fn rows(&self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// The rows of `placement` in a table of `total` rows laid out as
/// `sections` (empty: one `any` section). A placement the table has no
/// section for falls back to `any`, so an id that carries a mark by chance
/// is still found; creating a placed blob checks the section exists first.
pub fn section_rows(sections: &[TltSection], total: usize, placement: Placement) -> std::ops::Range<usize> {
    sections
        .iter()
        .find(|s| s.placement == placement)
        .or_else(|| sections.iter().find(|s| s.placement == Placement::Any))
        .map_or(0..total, |s| s.rows())
}

/// The row of `tract` of `blob` in a table of `total` rows laid out as
/// `sections`: the locator inside the section of the blob's placement.
/// Tractservers use this with the layout of their assignment, clients with
/// their table's.
pub fn locate_in(sections: &[TltSection], total: usize, blob: BlobId, tract: TractNo) -> usize {
    let rows = section_rows(sections, total, Placement::of(blob));
    rows.start + locator(blob, tract, rows.len())
}

/// A table's shape as a tractserver knows it from its assignment: how many
/// rows, laid out how. Enough to find any tract's row.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowLayout {
    pub total: usize,
    pub sections: Vec<TltSection>,
}

impl RowLayout {
    /// The row of `tract` of `blob`; `None` before any table is known.
    pub fn locate(&self, blob: BlobId, tract: TractNo) -> Option<u32> {
        (self.total > 0).then(|| locate_in(&self.sections, self.total, blob, tract) as u32)
    }
}

/// Checks a layout: empty, or sections in row order covering `0..total`
/// exactly, the first `any`, each placement at most once, none empty.
pub fn validate_sections(sections: &[TltSection], total: usize) -> Result<(), TltError> {
    if sections.is_empty() {
        return Ok(());
    }
    if sections[0].placement != Placement::Any {
        return Err(TltError::BadSections("the first section must be placement any".into()));
    }
    let mut next = 0u64;
    for (i, s) in sections.iter().enumerate() {
        if s.len == 0 || u64::from(s.start) != next {
            return Err(TltError::BadSections(format!(
                "section {i} ({}) is empty or not contiguous",
                s.placement
            )));
        }
        if sections[..i].iter().any(|t| t.placement == s.placement) {
            return Err(TltError::BadSections(format!("placement {} has two sections", s.placement)));
        }
        next += u64::from(s.len);
    }
    if next != total as u64 {
        return Err(TltError::BadSections(format!("sections cover {next} rows of {total}")));
    }
    Ok(())
}

/// One tractserver named by the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TltMember {
    pub id: TsId,
    /// Where the tractserver listens (`host:port`).
    pub addr: String,
    /// Failure domain: no two members of a row share one (FDS §3.3.1).
    pub domain: String,
}

/// One row: `replication` members (indexes into `Tlt::members`), the first
/// of which is the primary for metadata operations (FDS §3.1).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TltRow {
    /// Bumped by the metadata server whenever the row's membership changes;
    /// every tract request carries it so stale clients are caught.
    pub version: u64,
    pub members: Vec<u32>,
    /// Tractservers about to take over a column (cluster growth, FDS §3.4):
    /// clients write to them as well as to the column's member, read only
    /// from the members; once a pending member has copied the row, the
    /// metadata server commits it in the column's place.
    pub pending: Vec<Pending>,
}

/// A pending TLT entry: `member` will replace `members[column]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    pub column: u8,
    pub member: u32,
}

impl TltRow {
    pub fn new(version: u64, members: Vec<u32>) -> TltRow {
        TltRow { version, members, pending: Vec::new() }
    }

    /// Where a write of a blob with replication `r` goes: the first `r`
    /// members and the pending members of those columns.
    pub fn writers(&self, r: usize) -> impl Iterator<Item = u32> + '_ {
        let pending = self.pending.iter().filter(move |p| (p.column as usize) < r).map(|p| p.member);
        self.members.iter().take(r).copied().chain(pending)
    }
}

/// The whole table as a client caches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tlt {
    /// Random id chosen when the cluster was created; tractservers of
    /// another cluster are refused.
    pub cluster_id: u128,
    pub tract_size: u32,
    /// Members per row: the cluster's maximum replication level.
    pub replication: u8,
    /// Bumped on every change of any row; lets a client tell at a glance
    /// whether a fetched table is newer than its own.
    pub version: u64,
    pub members: Vec<TltMember>,
    pub rows: Vec<TltRow>,
    /// The table's layout by placement; empty: all rows are `any`.
    pub sections: Vec<TltSection>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TltError {
    #[error("TLT has no rows")]
    Empty,
    #[error("TLT has {0} rows, more than the limit")]
    TooManyRows(usize),
    #[error("TLT names {0} members, more than the limit")]
    TooManyMembers(usize),
    #[error("TLT replication {0} is outside 1..={REPLICATION_MAX}")]
    BadReplication(u8),
    #[error("TLT row {row} has {got} members, expected {want}")]
    RowWidth { row: usize, got: usize, want: usize },
    #[error("TLT row {row} names member {member}, which does not exist")]
    BadMember { row: usize, member: u32 },
    #[error("TLT row {row} names one tractserver twice")]
    DuplicateInRow { row: usize },
    #[error("TLT row {row} has a pending entry for column {column}, which is out of range or taken twice")]
    BadPending { row: usize, column: u8 },
    #[error("TLT member name or address is too long")]
    NameTooLong,
    #[error("TLT sections are malformed: {0}")]
    BadSections(String),
}

/// Stable 64-bit hash of a blob id, which randomizes each blob's starting
/// row (FDS uses SHA-1; any well-mixed, fixed function will do). It is part
/// of the placement contract: changing it moves every tract.
pub fn blob_hash(blob: BlobId) -> u64 {
    let hi = (blob.0 >> 64) as u64;
    let lo = blob.0 as u64;
    splitmix64(lo ^ splitmix64(hi))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Tract locator = (hash(blob) + tract) mod len. The tract number is added
/// outside the hash so a large blob walks the table row by row and loads
/// every tractserver evenly (FDS §2.2 explains why `hash(blob + tract)` does
/// not). Tract −1 (metadata) lands just before tract 0.
pub fn locator(blob: BlobId, tract: TractNo, len: usize) -> usize {
    debug_assert!(len > 0);
    let h = blob_hash(blob) as i128;
    (h + tract.0 as i128).rem_euclid(len.max(1) as i128) as usize
}

impl Tlt {
    /// Checks the table's shape; everything a client or tractserver indexes
    /// with is in bounds afterwards.
    pub fn validate(&self) -> Result<(), TltError> {
        if self.rows.is_empty() {
            return Err(TltError::Empty);
        }
        if self.rows.len() > TLT_ROWS_MAX {
            return Err(TltError::TooManyRows(self.rows.len()));
        }
        if self.members.len() > TLT_MEMBERS_MAX {
            return Err(TltError::TooManyMembers(self.members.len()));
        }
        if self.replication == 0 || self.replication > REPLICATION_MAX {
            return Err(TltError::BadReplication(self.replication));
        }
        if self.members.iter().any(|m| m.addr.len() > NAME_LEN_MAX || m.domain.len() > NAME_LEN_MAX) {
            return Err(TltError::NameTooLong);
        }
        validate_sections(&self.sections, self.rows.len())?;
        let want = self.replication as usize;
        for (i, row) in self.rows.iter().enumerate() {
            if row.members.len() != want {
                return Err(TltError::RowWidth { row: i, got: row.members.len(), want });
            }
            for (j, &m) in row.members.iter().enumerate() {
                if m as usize >= self.members.len() {
                    return Err(TltError::BadMember { row: i, member: m });
                }
                if row.members[..j].contains(&m) {
                    return Err(TltError::DuplicateInRow { row: i });
                }
            }
            for (j, p) in row.pending.iter().enumerate() {
                if p.member as usize >= self.members.len() {
                    return Err(TltError::BadMember { row: i, member: p.member });
                }
                if row.members.contains(&p.member) || row.pending[..j].iter().any(|q| q.member == p.member) {
                    return Err(TltError::DuplicateInRow { row: i });
                }
                if p.column as usize >= want || row.pending[..j].iter().any(|q| q.column == p.column) {
                    return Err(TltError::BadPending { row: i, column: p.column });
                }
            }
        }
        Ok(())
    }

    /// The row index holding `tract` of `blob`.
    pub fn locate(&self, blob: BlobId, tract: TractNo) -> usize {
        locate_in(&self.sections, self.rows.len(), blob, tract)
    }

    /// Whether blobs can be placed so: `any` always, the others only in a
    /// table built with their section.
    pub fn has_placement(&self, placement: Placement) -> bool {
        placement == Placement::Any || self.sections.iter().any(|s| s.placement == placement)
    }

    /// The placement whose section holds `row`.
    pub fn row_placement(&self, row: usize) -> Placement {
        self.sections.iter().find(|s| s.rows().contains(&row)).map_or(Placement::Any, |s| s.placement)
    }

    /// The class of disk column `col` of `row` must be (`None`: any).
    pub fn column_class(&self, row: usize, col: usize) -> Option<DiskClass> {
        self.row_placement(row).column_class(col)
    }

    /// Tractservers of row `row`, primary first.
    pub fn row_members(&self, row: usize) -> impl Iterator<Item = &TltMember> + '_ {
        self.rows[row].members.iter().map(move |&m| &self.members[m as usize])
    }

    /// Index of a tractserver in `members`.
    pub fn member_index(&self, id: TsId) -> Option<u32> {
        self.members.iter().position(|m| m.id == id).map(|i| i as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tract numbers advance the locator by one row, wrapping at the end;
    /// tract −1 sits just before tract 0.
    #[test]
    fn locator_walks_rows() {
        let blob = BlobId(42);
        let len = 7;
        let l0 = locator(blob, TractNo(0), len);
        for i in 0..20 {
            assert_eq!(locator(blob, TractNo(i), len), (l0 + i as usize) % len);
        }
        assert_eq!(locator(blob, TractNo::META, len), (l0 + len - 1) % len);
    }

    /// The hash is pinned: placement must not move between releases.
    #[test]
    fn blob_hash_is_pinned() {
        assert_eq!(blob_hash(BlobId(0)), 0xa706_dd2f_4d19_7e6f);
        assert_eq!(blob_hash(BlobId(1 << 64 | 1)), blob_hash(BlobId(1 << 64 | 1)));
        assert_ne!(blob_hash(BlobId(1)), blob_hash(BlobId(1 << 64)));
    }

    #[test]
    fn validate_catches_bad_shapes() {
        let m = |i: u128| TltMember { id: TsId(i), addr: format!("h{i}:1"), domain: format!("d{i}") };
        let mut t = Tlt {
            cluster_id: 1,
            tract_size: 4096,
            replication: 2,
            version: 1,
            members: vec![m(1), m(2)],
            rows: vec![TltRow::new(1, vec![0, 1])],
            sections: Vec::new(),
        };
        assert_eq!(t.validate(), Ok(()));
        t.members.push(m(3));
        t.rows[0].pending = vec![Pending { column: 1, member: 2 }];
        assert_eq!(t.validate(), Ok(()));
        assert_eq!(t.rows[0].writers(1).collect::<Vec<_>>(), vec![0]);
        assert_eq!(t.rows[0].writers(2).collect::<Vec<_>>(), vec![0, 1, 2]);
        t.rows[0].pending = vec![Pending { column: 2, member: 2 }];
        assert_eq!(t.validate(), Err(TltError::BadPending { row: 0, column: 2 }));
        t.rows[0].pending = vec![Pending { column: 0, member: 1 }];
        assert_eq!(t.validate(), Err(TltError::DuplicateInRow { row: 0 }));
        t.rows[0].pending.clear();
        t.rows[0].members = vec![0, 0];
        assert_eq!(t.validate(), Err(TltError::DuplicateInRow { row: 0 }));
        t.rows[0].members = vec![0, 5];
        assert_eq!(t.validate(), Err(TltError::BadMember { row: 0, member: 5 }));
        t.rows[0].members = vec![0];
        assert!(matches!(t.validate(), Err(TltError::RowWidth { .. })));
        t.rows.clear();
        assert_eq!(t.validate(), Err(TltError::Empty));
    }

    /// A placement survives in the id, every other bit of the id is kept,
    /// and ids without a mark (all ids made before placements) are `any`.
    #[test]
    fn placement_is_written_in_the_id() {
        for raw in [0u128, 42, u128::MAX, 0x1234_5678_9abc_def0_1122_3344_5566_7788] {
            let id = BlobId(raw);
            for p in Placement::ALL {
                let placed = p.place(id);
                assert_eq!(Placement::of(placed), p);
                assert_eq!(placed.0 & ((1 << 112) - 1), raw & ((1 << 112) - 1));
                assert_eq!(p.place(placed), placed, "placing twice changes nothing");
            }
        }
        assert_eq!(Placement::Any.place(BlobId(42)), BlobId(42));
        assert_eq!(Placement::of(BlobId(0x5ec1 << 112)), Placement::Ssd);
        assert_eq!(Placement::of(BlobId(0x5ec4 << 112)), Placement::Any);
        for p in Placement::ALL {
            assert_eq!(p.name().parse::<Placement>(), Ok(p));
        }
    }

    /// Each placement's blobs walk only their own section; an id placed
    /// where the table has no section falls back to `any`.
    #[test]
    fn sections_confine_their_blobs() {
        let sections = [
            TltSection { placement: Placement::Any, start: 0, len: 10 },
            TltSection { placement: Placement::Hybrid, start: 10, len: 6 },
        ];
        assert_eq!(validate_sections(&sections, 16), Ok(()));
        for raw in 0..200u128 {
            let any = BlobId(raw * 7919);
            let hybrid = Placement::Hybrid.place(any);
            let ssd = Placement::Ssd.place(any);
            for t in -1..20 {
                assert!(locate_in(&sections, 16, any, TractNo(t)) < 10);
                assert!((10..16).contains(&locate_in(&sections, 16, hybrid, TractNo(t))));
                assert!(locate_in(&sections, 16, ssd, TractNo(t)) < 10);
                // No sections: the FDS locator over the whole table.
                assert_eq!(locate_in(&[], 16, hybrid, TractNo(t)), locator(hybrid, TractNo(t), 16));
            }
        }
        assert!(validate_sections(&sections, 17).is_err());
        assert!(validate_sections(&sections[1..], 6).is_err(), "any must come first");
        let twice = [sections[0], TltSection { placement: Placement::Any, start: 10, len: 6 }];
        assert!(validate_sections(&twice, 16).is_err());
        let gap = [sections[0], TltSection { placement: Placement::Hdd, start: 11, len: 5 }];
        assert!(validate_sections(&gap, 16).is_err());
    }
}
