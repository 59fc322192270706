//! What this tractserver may serve, decided without I/O: the rows it
//! holds and at exactly which version (FDS §3.1: a client with a stale
//! table is told to refresh, never trusted), whether a tract number names
//! a data tract, and its standing with the metadata service (a lease that
//! lapses without answered heartbeats, and a fence while its rows may have
//! been given away). The service asks these on every request; the
//! heartbeat loop moves the standing.
//!
//! | standing | serves | how it gets there | how it leaves |
//! |---|---|---|---|
//! | awaiting | nothing | start (it may have been declared dead while down) | an answered heartbeat |
//! | leased | its rows | a heartbeat answered "continue" | the lease's end without another answer |
//! | lapsed | nothing | no answered heartbeat before the lease's end | an answered heartbeat |
//! | fenced | nothing | a heartbeat answered "stop serving" | an assignment, or a "continue" that asks for none |
//! | unleased | its rows | a service run without a metadata server | never |

use std::collections::HashMap;
use std::sync::RwLock;

use blizzard_core::tlt::RowLayout;
use blizzard_core::{BlobId, TractNo, TsId};
use blizzard_env::Instant;
use blizzard_proto::{Assignment, ErrorCode, ErrorReply};

/// Largest blob size in tracts (keeps tract numbers far from overflow).
pub const BLOB_TRACTS_MAX: u64 = 1 << 40;

/// Refuses a tract number that names no data tract (the metadata tract is
/// −1; data tracts lie below [`BLOB_TRACTS_MAX`]).
pub fn check_data_tract(tract: TractNo) -> Result<(), ErrorReply> {
    if tract.0 < 0 || tract.0 as u64 >= BLOB_TRACTS_MAX {
        return Err(ErrorReply::new(ErrorCode::BadRequest, format!("tract {tract} is not a data tract")));
    }
    Ok(())
}

/// The current [`RowIndex`], shared by the parts of a tractserver that ask
/// it (the request handlers, the copier, the scrubber, healing); replaced
/// whole when a new assignment is stored.
#[derive(Default)]
pub struct SharedRows(RwLock<RowIndex>);

impl SharedRows {
    pub fn new(rows: RowIndex) -> SharedRows {
        SharedRows(RwLock::new(rows))
    }

    /// Looks at the current rows without cloning them (asked per request).
    pub fn with<T>(&self, f: impl FnOnce(&RowIndex) -> T) -> T {
        match self.0.read() {
            Ok(g) => f(&g),
            Err(p) => f(&p.into_inner()),
        }
    }

    pub fn snapshot(&self) -> RowIndex {
        self.with(RowIndex::clone)
    }

    /// The row of `tract` of `blob` under the current assignment (`None`
    /// before the first).
    pub fn locate(&self, blob: BlobId, tract: TractNo) -> Option<u32> {
        self.with(|r| r.assignment.locate(blob, tract))
    }

    /// The table's shape, to locate many tracts under one lock.
    pub fn layout(&self) -> RowLayout {
        self.with(|r| r.assignment.layout())
    }

    pub fn replace(&self, rows: RowIndex) {
        *match self.0.write() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        } = rows;
    }
}

/// The rows this tractserver holds, indexed for the per-request check.
#[derive(Clone, Debug, Default)]
pub struct RowIndex {
    pub assignment: Assignment,
    rows: HashMap<u32, HeldRow>,
}

/// One row this server holds, as a member or as a pending member.
#[derive(Clone, Debug)]
struct HeldRow {
    version: u64,
    /// This server is the row's primary (column 0; never a pending member).
    primary: bool,
    members: Vec<TsId>,
    filling: Vec<TsId>,
    /// Every server holding the row: its members, then its pending
    /// members. Blob metadata changes reach all of them.
    holders: Vec<TsId>,
}

impl RowIndex {
    pub fn new(me: TsId, assignment: Assignment) -> RowIndex {
        let rows = assignment
            .rows
            .iter()
            .filter_map(|r| {
                let col = r.members.iter().position(|m| *m == me);
                if col.is_none() && !r.pending.iter().any(|p| p.id == me) {
                    return None;
                }
                let holders = r.members.iter().copied().chain(r.pending.iter().map(|p| p.id)).collect();
                Some((
                    r.row,
                    HeldRow {
                        version: r.version,
                        primary: col == Some(0),
                        members: r.members.clone(),
                        filling: r.filling.clone(),
                        holders,
                    },
                ))
            })
            .collect();
        RowIndex { assignment, rows }
    }

    /// Whether this server lists the blobs whose metadata maps to `row`:
    /// it is the row's first complete member (a filling member counts once
    /// it has copied the whole row, `self_complete`), so every blob is
    /// listed by at least one server while a newcomer copies the row.
    pub(crate) fn lists_row(&self, me: TsId, row: u32, self_complete: bool) -> bool {
        let Some(h) = self.rows.get(&row) else { return false };
        let first = h.members.iter().find(|m| !h.filling.contains(m) || (**m == me && self_complete));
        first == Some(&me)
    }

    /// Checks that this server holds `row` at `version`; returns the row's
    /// members still copying it.
    pub(crate) fn check_row(&self, row: u32, version: u64) -> Result<&[TsId], ErrorReply> {
        match self.rows.get(&row) {
            Some(h) if h.version == version => Ok(&h.filling),
            Some(h) => Err(ErrorReply {
                code: ErrorCode::StaleVersion,
                current_version: h.version,
                message: format!("row {row} is at version {}, request used {version}", h.version),
            }),
            None => Err(ErrorReply::new(ErrorCode::NotOwner, format!("row {row} is not served here"))),
        }
    }

    /// Checks that `tract` of `blob` maps to a row this server holds at
    /// `version`; returns whether this server is the row's primary, and
    /// every server holding the row.
    pub(crate) fn check(
        &self,
        blob: BlobId,
        tract: TractNo,
        version: u64,
    ) -> Result<(bool, &[TsId]), ErrorReply> {
        let Some(row) = self.assignment.locate(blob, tract) else {
            return Err(ErrorReply::new(ErrorCode::NotReady, "this tractserver has no TLT assignment yet"));
        };
        let Some(h) = self.rows.get(&row) else {
            return Err(ErrorReply {
                code: ErrorCode::NotOwner,
                current_version: 0,
                message: format!("row {row} is not served here; refresh the TLT"),
            });
        };
        if h.version != version {
            return Err(ErrorReply {
                code: ErrorCode::StaleVersion,
                current_version: h.version,
                message: format!(
                    "row {row} is at version {}, request used {version}; refresh the TLT",
                    h.version
                ),
            });
        }
        Ok((h.primary, &h.holders))
    }
}

/// This server's standing with the metadata service (the table above).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    /// The metadata service said this server's rows are stale or given
    /// away: nothing is served until it says otherwise.
    fenced: bool,
    /// Serve only until then without another answered heartbeat (`None`:
    /// no lease, for a service run without a metadata server).
    lease_until: Option<Instant>,
}

/// What a heartbeat reply changed, for the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    Unchanged,
    /// The fence went up.
    Fenced,
    /// The fence came down.
    Unfenced,
}

impl Standing {
    /// Serving with no lease at all: a service run without a metadata
    /// server.
    pub fn unleased() -> Standing {
        Standing { fenced: false, lease_until: None }
    }

    /// Serving nothing until a heartbeat is answered: at start, a server
    /// may have been declared dead while it was down.
    pub fn awaiting(now: Instant) -> Standing {
        Standing { fenced: false, lease_until: Some(now) }
    }

    /// Whether requests may be served at `now`, or why not.
    pub fn check(&self, now: Instant) -> Result<(), ErrorReply> {
        if self.fenced {
            return Err(ErrorReply::new(
                ErrorCode::NotOwner,
                "this tractserver was removed from the cluster",
            ));
        }
        if self.lease_until.is_some_and(|t| now > t) {
            return Err(ErrorReply::new(
                ErrorCode::NotOwner,
                "this tractserver has lost contact with the metadata server and stopped serving until it is back",
            ));
        }
        Ok(())
    }

    /// A heartbeat sent at `sent` was answered. The fence goes up before
    /// the lease is renewed (one step here), so a server declared dead
    /// never serves its old rows in between. It comes down on a
    /// "continue" that asks for no assignment: a metadata server
    /// rebuilding its table asks for assignments and cannot judge this
    /// one yet. A lease of 0 ms means none.
    pub fn answered(
        &mut self,
        sent: Instant,
        lease_ms: u32,
        stop_serving: bool,
        send_assignment: bool,
    ) -> Turn {
        self.lease_until = (lease_ms > 0).then(|| sent + std::time::Duration::from_millis(lease_ms as u64));
        if stop_serving {
            return if std::mem::replace(&mut self.fenced, true) { Turn::Unchanged } else { Turn::Fenced };
        }
        if !send_assignment && std::mem::replace(&mut self.fenced, false) {
            return Turn::Unfenced;
        }
        Turn::Unchanged
    }

    /// The metadata service gave this server its current assignment: a
    /// member again (a fenced server gets one once it is safe).
    pub fn assigned(&mut self) -> Turn {
        if std::mem::replace(&mut self.fenced, false) {
            Turn::Unfenced
        } else {
            Turn::Unchanged
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use blizzard_proto::{AssignedRow, PendingMember};
    use std::time::Duration;

    fn ts(n: u8) -> TsId {
        TsId(n as u128)
    }

    /// A table of `len` rows, each held by `members` at version 7 + row.
    fn assignment(len: u32, members: &[TsId]) -> Assignment {
        Assignment {
            tlt_len: len,
            rows: (0..len)
                .map(|row| AssignedRow {
                    row,
                    version: 7 + row as u64,
                    members: members.to_vec(),
                    filling: vec![],
                    pending: vec![],
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_held_row_at_its_version_is_served() {
        let idx = RowIndex::new(ts(1), assignment(4, &[ts(1), ts(2), ts(3)]));
        let blob = BlobId(0x1234);
        let row = blizzard_core::tlt::locator(blob, TractNo(5), 4) as u32;
        let (primary, holders) = idx.check(blob, TractNo(5), 7 + row as u64).unwrap();
        assert!(primary, "column 0 is the primary");
        assert_eq!(holders, &[ts(1), ts(2), ts(3)]);
        let idx2 = RowIndex::new(ts(2), assignment(4, &[ts(1), ts(2), ts(3)]));
        assert!(!idx2.check(blob, TractNo(5), 7 + row as u64).unwrap().0);
    }

    #[test]
    fn a_stale_version_names_the_current_one() {
        let idx = RowIndex::new(ts(1), assignment(4, &[ts(1), ts(2)]));
        let blob = BlobId(99);
        let row = blizzard_core::tlt::locator(blob, TractNo(0), 4) as u32;
        let e = idx.check(blob, TractNo(0), 1).unwrap_err();
        assert_eq!(e.code, ErrorCode::StaleVersion);
        assert_eq!(e.current_version, 7 + row as u64);
        let e = idx.check_row(row, 1).unwrap_err();
        assert_eq!((e.code, e.current_version), (ErrorCode::StaleVersion, 7 + row as u64));
    }

    #[test]
    fn rows_of_others_and_no_table_are_refused() {
        let idx = RowIndex::new(ts(9), assignment(4, &[ts(1), ts(2)]));
        let e = idx.check(BlobId(5), TractNo(0), 7).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotOwner);
        assert_eq!(idx.check_row(0, 7).unwrap_err().code, ErrorCode::NotOwner);
        let empty = RowIndex::new(ts(1), Assignment::default());
        assert_eq!(empty.check(BlobId(5), TractNo(0), 0).unwrap_err().code, ErrorCode::NotReady);
    }

    /// A pending member holds the row (metadata changes reach it) but is
    /// never its primary; a filling member is listed by check_row.
    #[test]
    fn pending_and_filling_members() {
        let mut a = assignment(1, &[ts(1), ts(2)]);
        a.rows[0].pending = vec![PendingMember { column: 1, id: ts(3) }];
        a.rows[0].filling = vec![ts(2)];
        let idx = RowIndex::new(ts(3), a.clone());
        let (primary, holders) = idx.check(BlobId(1), TractNo(0), 7).unwrap();
        assert!(!primary);
        assert_eq!(holders, &[ts(1), ts(2), ts(3)]);
        let idx1 = RowIndex::new(ts(1), a);
        assert_eq!(idx1.check_row(0, 7).unwrap(), &[ts(2)]);
        // ts(1) is complete and first: it lists the row; ts(2) only once
        // it has copied the row whole.
        assert!(idx1.lists_row(ts(1), 0, true));
        assert!(!idx1.lists_row(ts(2), 0, true));
    }

    #[test]
    fn the_first_complete_member_lists_a_row() {
        let mut a = assignment(1, &[ts(1), ts(2)]);
        a.rows[0].filling = vec![ts(1)];
        let idx = RowIndex::new(ts(1), a);
        // ts(1) is copying: ts(2) lists the row until ts(1) is complete.
        assert!(!idx.lists_row(ts(1), 0, false));
        assert!(idx.lists_row(ts(2), 0, false));
        assert!(idx.lists_row(ts(1), 0, true));
    }

    #[test]
    fn only_data_tracts_pass() {
        assert!(check_data_tract(TractNo(0)).is_ok());
        assert!(check_data_tract(TractNo(BLOB_TRACTS_MAX as i64 - 1)).is_ok());
        assert_eq!(check_data_tract(TractNo::META).unwrap_err().code, ErrorCode::BadRequest);
        assert_eq!(
            check_data_tract(TractNo(BLOB_TRACTS_MAX as i64)).unwrap_err().code,
            ErrorCode::BadRequest
        );
    }

    /// The standing table, row by row.
    #[test]
    fn standing_moves_as_the_table_says() {
        let t0 = blizzard_env::Env::real().now();
        let ms = Duration::from_millis;
        // Awaiting: nothing until a heartbeat is answered.
        let mut s = Standing::awaiting(t0);
        assert!(s.check(t0 + ms(1)).is_err());
        // Leased: served until the lease's end, measured from the send.
        assert_eq!(s.answered(t0, 500, false, false), Turn::Unchanged);
        assert!(s.check(t0 + ms(499)).is_ok());
        // Lapsed.
        assert_eq!(s.check(t0 + ms(501)).unwrap_err().code, ErrorCode::NotOwner);
        // Fenced, even with a fresh lease in the same reply.
        assert_eq!(s.answered(t0 + ms(600), 500, true, false), Turn::Fenced);
        assert!(s.check(t0 + ms(601)).is_err());
        assert_eq!(s.answered(t0 + ms(700), 500, true, false), Turn::Unchanged);
        // A "continue" that asks for the assignment keeps the fence.
        assert_eq!(s.answered(t0 + ms(800), 500, false, true), Turn::Unchanged);
        assert!(s.check(t0 + ms(801)).is_err());
        // An assignment lowers it.
        assert_eq!(s.assigned(), Turn::Unfenced);
        assert!(s.check(t0 + ms(802)).is_ok());
        assert_eq!(s.assigned(), Turn::Unchanged);
        // So does a plain "continue".
        s.answered(t0 + ms(900), 500, true, false);
        assert_eq!(s.answered(t0 + ms(950), 500, false, false), Turn::Unfenced);
        assert!(s.check(t0 + ms(951)).is_ok());
        // Lease 0: no lease; unleased serves forever.
        s.answered(t0, 0, false, false);
        assert!(s.check(t0 + ms(1_000_000)).is_ok());
        assert!(Standing::unleased().check(t0 + ms(1_000_000)).is_ok());
    }
}
