//! The metadata service's messages (FDS §2.2, §3.1; design 0007): the
//! assignments it pushes to tractservers, their heartbeats, the table it
//! serves, the cluster's status, and volume leases.

use blizzard_core::tlt::{locate_in, Pending, Placement, RowLayout, Tlt, TltMember, TltRow, TltSection};
use blizzard_core::{BlobId, DiskClass, TractNo, TsId};

use crate::codec::{DecodeError, Reader, Wire, Writer};
use crate::wire_struct;

/// One TLT row as a tractserver stores it: enough for a new metadata server
/// to rebuild the table from the tractservers alone (FDS §2.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssignedRow {
    pub row: u32,
    pub version: u64,
    /// All members of the row, primary first.
    pub members: Vec<TsId>,
    /// Members that joined the row to replace a failed one, or are pending,
    /// and are still copying its tracts from the others (FDS §3.2): they
    /// take writes but serve a read only of a tract they have copied.
    pub filling: Vec<TsId>,
    /// Tractservers about to take over a column as the cluster grows (FDS
    /// §3.4): they take writes (and are always filling) and replace the
    /// column's member once they have copied the row.
    pub pending: Vec<PendingMember>,
}
wire_struct!(AssignedRow {
    row: u32,
    version: u64,
    members: Vec<TsId>,
    filling: Vec<TsId>,
    pending: Vec<PendingMember>,
});

/// A pending TLT entry as a tractserver stores it: `id` will replace the
/// row's member in `column`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingMember {
    pub column: u8,
    pub id: TsId,
}
wire_struct!(PendingMember { column: u8, id: TsId });

/// A TLT row at a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRef {
    pub row: u32,
    pub version: u64,
}
wire_struct!(RowRef { row: u32, version: u64 });

/// How far a tractserver is with copying the rows it is filling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FillProgress {
    /// Rows still being copied here.
    pub rows: u32,
    /// Tracts found on the sources so far, and how many are copied.
    pub tracts_total: u64,
    pub tracts_done: u64,
    /// Bytes copied since this server started.
    pub bytes_done: u64,
}
wire_struct!(FillProgress { rows: u32, tracts_total: u64, tracts_done: u64, bytes_done: u64 });

/// Most tracts in one `ListRowTracts` reply (32 bytes each on the wire).
pub const ROW_TRACTS_PAGE: usize = 16 << 10;

/// One tract a row's member holds, as listed for a copier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowTract {
    pub blob: BlobId,
    pub tract: TractNo,
}
wire_struct!(RowTract { blob: BlobId, tract: TractNo });

/// A tractserver's place in the cluster: the cluster's parameters and every
/// row it belongs to. Replaces the previous assignment as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Assignment {
    pub cluster_id: u128,
    pub tract_size: u32,
    pub replication: u8,
    pub tlt_len: u32,
    pub tlt_version: u64,
    pub rows: Vec<AssignedRow>,
    /// The table's layout by placement (`Tlt::sections`): a tractserver
    /// finds a tract's row with it, as clients do.
    pub sections: Vec<TltSection>,
}
impl Assignment {
    /// The table's shape as this assignment gives it.
    pub fn layout(&self) -> RowLayout {
        RowLayout { total: self.tlt_len as usize, sections: self.sections.clone() }
    }

    /// The row of `tract` of `blob`; `None` without a table.
    pub fn locate(&self, blob: BlobId, tract: TractNo) -> Option<u32> {
        (self.tlt_len > 0).then(|| locate_in(&self.sections, self.tlt_len as usize, blob, tract) as u32)
    }
}

impl Wire for Assignment {
    const MIN_LEN: usize = 16 + 4 + 1 + 4 + 8 + 4;
    fn put(&self, w: &mut Writer) {
        self.cluster_id.put(w);
        self.tract_size.put(w);
        put_replication(self.replication, &self.sections, w);
        self.tlt_len.put(w);
        self.tlt_version.put(w);
        self.rows.put(w);
        put_sections(&self.sections, w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let cluster_id = u128::get(r)?;
        let tract_size = u32::get(r)?;
        let (replication, layout) = get_replication(r)?;
        let tlt_len = u32::get(r)?;
        let tlt_version = u64::get(r)?;
        let rows = Vec::get(r)?;
        let sections = if layout { Vec::get(r)? } else { Vec::new() };
        Ok(Assignment { cluster_id, tract_size, replication, tlt_len, tlt_version, rows, sections })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    pub ts_id: TsId,
    pub addr: String,
    pub domain: String,
    pub tract_size: u32,
    pub slots_total: u64,
    pub slots_used: u64,
    /// Requests in flight when the heartbeat was sent.
    pub load: u32,
    /// Measured sequential write speed of the disk (MB/s; 0 if unknown),
    /// for weighting the 1-way TLT (FDS §2.2).
    pub disk_mbps: u32,
    /// What the tractserver has stored, if it was ever assigned rows and
    /// this is the first heartbeat on a connection or the metadata server
    /// asked for it.
    pub assignment: Option<Assignment>,
    /// Rows this server has finished copying (at those versions).
    pub filled: Vec<RowRef>,
    pub fill: FillProgress,
    /// The kind of disk it declared (`--class`).
    pub class: DiskClass,
    /// Its backup journal (design 0009): bytes held by writes the disk
    /// may not have yet, and the ring's size (0: no journal).
    pub journal_used: u64,
    pub journal_bytes: u64,
}
wire_struct!(Heartbeat {
    ts_id: TsId,
    addr: String,
    domain: String,
    tract_size: u32,
    slots_total: u64,
    slots_used: u64,
    load: u32,
    disk_mbps: u32,
    assignment: Option<Assignment>,
    filled: Vec<RowRef>,
    fill: FillProgress,
    class: DiskClass,
    journal_used: u64,
    journal_bytes: u64,
});

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeartbeatAction {
    Continue = 0,
    /// The metadata server no longer counts this tractserver as a member of
    /// the cluster it serves (FDS §3.1: a returning dead server is told to
    /// stop).
    StopServing = 1,
}

impl Wire for HeartbeatAction {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(HeartbeatAction::Continue),
            1 => Ok(HeartbeatAction::StopServing),
            v => Err(DecodeError::BadValue { field: "heartbeat action", value: v as u64 }),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeartbeatReply {
    pub action: HeartbeatAction,
    pub interval_ms: u32,
    /// Include the stored assignment in the next heartbeat: the metadata
    /// server is (re)building the TLT. Otherwise heartbeats stay small.
    pub send_assignment: bool,
    /// How long this reply lets the tractserver serve without another
    /// successful heartbeat (counted from when it sent this one). Shorter
    /// than the time after which the metadata server declares it dead, so
    /// a cut-off server stops serving before its rows are given to others.
    pub lease_ms: u32,
    /// The version of the scope table (`scope`): a tractserver whose table
    /// is older fetches it (`GetScope`).
    pub scope_version: u64,
}
wire_struct!(HeartbeatReply {
    action: HeartbeatAction,
    interval_ms: u32,
    send_assignment: bool,
    lease_ms: u32,
    scope_version: u64,
});

/// The cluster's creation parameters, asked for by a tractserver before it
/// formats a new disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterParams {
    pub tract_size: u32,
    pub replication: u8,
    /// 0 until the first TLT has been built.
    pub cluster_id: u128,
}
wire_struct!(ClusterParams { tract_size: u32, replication: u8, cluster_id: u128 });

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberStatus {
    pub id: TsId,
    pub addr: String,
    pub domain: String,
    pub alive: bool,
    pub last_heartbeat_ms: u64,
    pub slots_total: u64,
    pub slots_used: u64,
    pub load: u32,
    /// TLT rows this tractserver appears in, and how many as primary.
    pub rows: u32,
    pub primaries: u32,
    /// Declared dead: its rows were given to others.
    pub dead: bool,
    pub fill: FillProgress,
    pub class: DiskClass,
    /// Its backup journal's use and size, as last reported (0: none).
    pub journal_used: u64,
    pub journal_bytes: u64,
}
wire_struct!(MemberStatus {
    id: TsId,
    addr: String,
    domain: String,
    alive: bool,
    last_heartbeat_ms: u64,
    slots_total: u64,
    slots_used: u64,
    load: u32,
    rows: u32,
    primaries: u32,
    dead: bool,
    fill: FillProgress,
    class: DiskClass,
    journal_used: u64,
    journal_bytes: u64,
});

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterStatus {
    /// `waiting`, `recovering` or `ready`: see the metadata server's phases.
    pub phase: String,
    pub cluster_id: u128,
    pub tract_size: u32,
    pub replication: u8,
    pub tlt_version: u64,
    pub tlt_rows: u32,
    pub members: Vec<MemberStatus>,
    /// Rows with a member still copying (not yet fully replicated).
    pub rows_filling: u32,
    /// Rows naming a dead member that could not be replaced yet.
    pub rows_degraded: u32,
    /// Volumes held for writing (design 0007).
    pub leases: Vec<VolumeLease>,
    /// The table's sections by placement (empty: every row is `any`).
    pub sections: Vec<TltSection>,
}
wire_struct!(ClusterStatus {
    phase: String,
    cluster_id: u128,
    tract_size: u32,
    replication: u8,
    tlt_version: u64,
    tlt_rows: u32,
    members: Vec<MemberStatus>,
    rows_filling: u32,
    rows_degraded: u32,
    leases: Vec<VolumeLease>,
    sections: Vec<TltSection>,
});

impl ClusterStatus {
    /// Every row has all its members alive and complete.
    pub fn fully_replicated(&self) -> bool {
        self.phase == "ready" && self.rows_filling == 0 && self.rows_degraded == 0
    }
}

wire_struct!(TltMember { id: TsId, addr: String, domain: String });
wire_struct!(Pending { column: u8, member: u32 });
wire_struct!(TltRow { version: u64, members: Vec<u32>, pending: Vec<Pending> });
impl Wire for Tlt {
    const MIN_LEN: usize = 16 + 4 + 1 + 8 + 4 + 4;
    fn put(&self, w: &mut Writer) {
        self.cluster_id.put(w);
        self.tract_size.put(w);
        put_replication(self.replication, &self.sections, w);
        self.version.put(w);
        self.members.put(w);
        self.rows.put(w);
        put_sections(&self.sections, w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let cluster_id = u128::get(r)?;
        let tract_size = u32::get(r)?;
        let (replication, layout) = get_replication(r)?;
        let version = u64::get(r)?;
        let members = Vec::get(r)?;
        let rows = Vec::get(r)?;
        let sections = if layout { Vec::get(r)? } else { Vec::new() };
        Ok(Tlt { cluster_id, tract_size, replication, version, members, rows, sections })
    }
}

/// A table or assignment with sections sets this bit in its replication
/// byte and carries the sections after its rows. One without sections is
/// encoded exactly as before sections existed, so the tables and
/// assignments tractservers and metadata replicas stored then still decode
/// (replication is at most 16, so the bit was always clear).
const LAYOUT_FLAG: u8 = 0x80;

fn put_replication(replication: u8, sections: &[TltSection], w: &mut Writer) {
    let flag = if sections.is_empty() { 0 } else { LAYOUT_FLAG };
    (replication | flag).put(w)
}

fn get_replication(r: &mut Reader<'_>) -> Result<(u8, bool), DecodeError> {
    let v = u8::get(r)?;
    Ok((v & !LAYOUT_FLAG, v & LAYOUT_FLAG != 0))
}

fn put_sections(sections: &[TltSection], w: &mut Writer) {
    if !sections.is_empty() {
        (sections.len() as u32).put(w);
        for s in sections {
            s.put(w);
        }
    }
}

impl Wire for TltSection {
    const MIN_LEN: usize = 1 + 4 + 4;
    fn put(&self, w: &mut Writer) {
        (self.placement as u8).put(w);
        self.start.put(w);
        self.len.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let v = u8::get(r)?;
        let placement =
            Placement::from_u8(v).ok_or(DecodeError::BadValue { field: "placement", value: u64::from(v) })?;
        Ok(TltSection { placement, start: u32::get(r)?, len: u32::get(r)? })
    }
}

/// What the metadata service answered a volume lease request (design
/// 0007, `metaserver::lease`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseStatus {
    /// The caller holds the volume under `token` for `remaining_ms`.
    Granted = 0,
    /// `holder` holds it for another `remaining_ms`.
    Held = 1,
    /// (Renew) the caller's lease is gone: released, or taken over by
    /// `holder` (empty when nobody holds the volume now).
    Lost = 2,
    /// The service holds as many leases as it may.
    Full = 3,
}

impl Wire for LeaseStatus {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(LeaseStatus::Granted),
            1 => Ok(LeaseStatus::Held),
            2 => Ok(LeaseStatus::Lost),
            3 => Ok(LeaseStatus::Full),
            v => Err(DecodeError::BadValue { field: "lease status", value: v as u64 }),
        }
    }
}

/// A volume's lease as the metadata service holds it. Time is relative:
/// `remaining_ms` from when the leader applied the request (clocks of
/// different hosts are not compared; a holder counts from when it sent
/// the request, which is earlier, so it always believes less).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeLease {
    pub status: LeaseStatus,
    pub blob: BlobId,
    pub holder: String,
    /// The fencing token: above every token handed out before, for any
    /// volume (0 when the caller was not granted the lease).
    pub token: u64,
    pub remaining_ms: u64,
}
wire_struct!(VolumeLease {
    status: LeaseStatus,
    blob: BlobId,
    holder: String,
    token: u64,
    remaining_ms: u64
});
