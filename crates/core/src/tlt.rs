//! The tract locator table (FDS §2.2, §3.3): rows of tractservers, each row
//! with a version. A client finds tract `i` of blob `g` in row
//! `(hash(g) + i) mod len` by arithmetic alone; the metadata server is never
//! on the data path. Building the table is the metadata server's business
//! (`blizzard-metaserver::tlt_builder`); this module only reads it.

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
        locator(blob, tract, self.rows.len())
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
}
