//! Messages. A request's opcode names its message; the response carries the
//! same opcode, and its meta part starts with a status: 0 for success
//! followed by the opcode's reply, or an [`ErrorReply`].

use blizzard_core::limits::{CHUNK_SIZE, TRACT_SIZE_MAX};
use blizzard_core::reconcile::ChunkState;
use blizzard_core::tlt::{Pending, Tlt, TltMember, TltRow};
use blizzard_core::{BlobId, Incarnation, TractNo, TsId};

use crate::codec::{DecodeError, Reader, Wire, Writer};
use crate::wire_struct;

/// Operation codes. The high byte groups them by who serves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u16)]
pub enum Opcode {
    Ping = 0x0001,
    // First message on a client's connection: which session and epoch it
    // belongs to (see `Request::Hello`).
    Hello = 0x0002,
    // Tract data, served by every tractserver of a row.
    WriteTract = 0x0101,
    ReadTract = 0x0102,
    DeleteTract = 0x0103,
    TrimTract = 0x0104,
    MappedTract = 0x0105,
    // A tractserver's write cache: writes acknowledged before they are
    // durable, made durable together by a sync (fast-ack destaging).
    WriteTractCached = 0x0106,
    SyncDisk = 0x0107,
    // Re-replication (FDS §3.2): a row's newcomer lists and copies tracts
    // from the row's complete members.
    ListRowTracts = 0x0108,
    CopyTract = 0x0109,
    // Reconciliation after a writer's crash: what each replica holds,
    // chunk by chunk (it also fences the blob's older writers).
    DigestTract = 0x010A,
    // Blob metadata, served by a row's primary (FDS §2.3, §3.1).
    CreateBlob = 0x0201,
    ExtendBlob = 0x0202,
    DeleteBlob = 0x0203,
    GetBlob = 0x0204,
    ListBlobs = 0x0205,
    // Two-phase commit of blob metadata, primary to the other replicas.
    MetaPrepare = 0x0211,
    MetaCommit = 0x0212,
    MetaAbort = 0x0213,
    // Metadata server to tractserver.
    AssignRows = 0x0301,
    // Served by the metadata server.
    Heartbeat = 0x0401,
    GetTlt = 0x0402,
    ClusterStatus = 0x0403,
    ClusterParams = 0x0404,
}

impl Opcode {
    pub const ALL: [Opcode; 25] = [
        Opcode::Ping,
        Opcode::Hello,
        Opcode::WriteTract,
        Opcode::ReadTract,
        Opcode::DeleteTract,
        Opcode::TrimTract,
        Opcode::MappedTract,
        Opcode::WriteTractCached,
        Opcode::SyncDisk,
        Opcode::ListRowTracts,
        Opcode::CopyTract,
        Opcode::DigestTract,
        Opcode::CreateBlob,
        Opcode::ExtendBlob,
        Opcode::DeleteBlob,
        Opcode::GetBlob,
        Opcode::ListBlobs,
        Opcode::MetaPrepare,
        Opcode::MetaCommit,
        Opcode::MetaAbort,
        Opcode::AssignRows,
        Opcode::Heartbeat,
        Opcode::GetTlt,
        Opcode::ClusterStatus,
        Opcode::ClusterParams,
    ];

    pub fn from_u16(v: u16) -> Option<Opcode> {
        Self::ALL.iter().copied().find(|o| *o as u16 == v)
    }
}

/// Where a tract request is aimed. The tractserver recomputes the row from
/// `blob` and `tract` and refuses the request unless it serves that row at
/// exactly `row_version` (FDS §3.1: stale clients are caught, not trusted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TractAddr {
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub tract: TractNo,
    pub row_version: u64,
    /// The writer epoch of the process changing the blob (0: none). A
    /// tractserver refuses a change (and a `DigestTract`) whose epoch is
    /// older than the newest it has seen for the blob (`ErrorCode::Fenced`),
    /// so requests of a crashed or replaced writer cannot land after its
    /// successor reconciled the tract.
    pub writer: u64,
}
wire_struct!(TractAddr { blob: BlobId, incarnation: u64, tract: TractNo, row_version: u64, writer: u64 });

/// Most entries a `Reply::Digest` may hold: one per chunk of the largest
/// tract.
pub const DIGEST_CHUNKS_MAX: usize = (TRACT_SIZE_MAX / CHUNK_SIZE) as usize;

/// A chunk's state on the wire: a tag byte (0 hole, 1 data followed by its
/// CRC32C, 2 unreadable).
impl Wire for ChunkState {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        match self {
            ChunkState::Hole => 0u8.put(w),
            ChunkState::Data(crc) => {
                1u8.put(w);
                crc.put(w);
            }
            ChunkState::Unreadable => 2u8.put(w),
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(ChunkState::Hole),
            1 => Ok(ChunkState::Data(u32::get(r)?)),
            2 => Ok(ChunkState::Unreadable),
            v => Err(DecodeError::BadValue { field: "chunk state", value: v as u64 }),
        }
    }
}

/// Decodes a digest: a count bounded by [`DIGEST_CHUNKS_MAX`] (and by the
/// bytes left), then the chunk states.
fn get_digest(r: &mut Reader<'_>) -> Result<Vec<ChunkState>, DecodeError> {
    let n = u32::get(r)? as usize;
    if n > DIGEST_CHUNKS_MAX {
        return Err(DecodeError::BadValue { field: "digest chunks", value: n as u64 });
    }
    if n > r.left() {
        return Err(DecodeError::ListTooLong { count: n, left: r.left() });
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(ChunkState::get(r)?);
    }
    Ok(v)
}

/// A blob's metadata, the content of its tract −1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobMeta {
    pub blob: BlobId,
    pub incarnation: Incarnation,
    pub replication: u8,
    /// Size in tracts; tracts `0..size_tracts` may be written.
    pub size_tracts: u64,
    /// Bumped by every committed change; the two-phase commit compares it.
    pub version: u64,
}
wire_struct!(BlobMeta { blob: BlobId, incarnation: u64, replication: u8, size_tracts: u64, version: u64 });

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExtendMode {
    /// Grow by `n` tracts (atomic append: the caller owns the new range).
    By = 0,
    /// Grow to at least `n` tracts.
    To = 1,
}

impl Wire for ExtendMode {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        (*self as u8).put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(ExtendMode::By),
            1 => Ok(ExtendMode::To),
            v => Err(DecodeError::BadValue { field: "extend mode", value: v as u64 }),
        }
    }
}

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
}
wire_struct!(Assignment {
    cluster_id: u128,
    tract_size: u32,
    replication: u8,
    tlt_len: u32,
    tlt_version: u64,
    rows: Vec<AssignedRow>,
});

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
}
wire_struct!(HeartbeatReply {
    action: HeartbeatAction,
    interval_ms: u32,
    send_assignment: bool,
    lease_ms: u32,
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
wire_struct!(Tlt {
    cluster_id: u128,
    tract_size: u32,
    replication: u8,
    version: u64,
    members: Vec<TltMember>,
    rows: Vec<TltRow>,
});

/// A request's meta part. Data (for `WriteTract`) travels beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Ping,
    /// Opens a connection of client session `session` (random per client)
    /// at `epoch`, which the client raises whenever it reconnects to this
    /// server after a failure. Once a server has seen an epoch, it applies
    /// no further change arriving on an older connection of that session:
    /// a request the client gave up on (and retried on a new connection)
    /// that is delivered or resumed late cannot overwrite newer writes.
    Hello {
        session: u64,
        epoch: u64,
    },
    /// Write the frame's data at `offset` in the tract; `crcs` has one CRC32C
    /// per piece (see `blizzard_core::crc::pieces`).
    WriteTract {
        addr: TractAddr,
        offset: u32,
        crcs: Vec<u32>,
    },
    ReadTract {
        addr: TractAddr,
        offset: u32,
        len: u32,
    },
    DeleteTract {
        addr: TractAddr,
    },
    /// Unmap `[offset, offset + len)`: it reads as zeros afterwards and its
    /// space is reusable (a tract left with nothing mapped is freed).
    TrimTract {
        addr: TractAddr,
        offset: u32,
        len: u32,
    },
    /// Which chunks of the tract hold written data (the rest read as
    /// zeros): lets readers and copiers skip holes.
    MappedTract {
        addr: TractAddr,
    },
    /// What this replica holds in each chunk of the tract
    /// (`Reply::Digest`), for reconciling replicas after a writer crashed.
    /// It fences first: `addr.writer` becomes the newest writer of the
    /// blob here (or the request is refused as `Fenced`), so no change of
    /// an older writer applies after the digest was taken.
    DigestTract {
        addr: TractAddr,
    },
    /// `WriteTract`, acknowledged once the server has applied it, before
    /// it is durable (like a disk with a volatile write cache). The reply
    /// carries the server's boot id; the write is durable after a
    /// `SyncDisk` to the same server that reports the same boot id.
    WriteTractCached {
        addr: TractAddr,
        offset: u32,
        crcs: Vec<u32>,
    },
    /// Make every write this server has acknowledged durable; the reply
    /// carries the boot id (a different one than a cached write's reply
    /// means the server restarted in between and the write may be lost).
    SyncDisk,
    /// The tracts this server holds that map to `row`, in (blob, tract)
    /// order, starting after `after` (a cursor: at most
    /// `ROW_TRACTS_PAGE` per reply). The server must hold the row at
    /// `row_version` as a complete member.
    ListRowTracts {
        row: u32,
        row_version: u64,
        after: Option<RowTract>,
    },
    /// One whole tract for a copier: the reply names its incarnation and
    /// which chunks hold data, with one CRC32C per such chunk; the data
    /// part is those chunks, in order.
    CopyTract {
        row: u32,
        row_version: u64,
        tract: RowTract,
    },
    CreateBlob {
        blob: BlobId,
        row_version: u64,
        incarnation: Incarnation,
        replication: u8,
    },
    ExtendBlob {
        blob: BlobId,
        row_version: u64,
        mode: ExtendMode,
        tracts: u64,
    },
    DeleteBlob {
        blob: BlobId,
        row_version: u64,
    },
    GetBlob {
        blob: BlobId,
        row_version: u64,
    },
    /// The metadata of every blob whose metadata row this server is primary of.
    ListBlobs,
    /// Phase one: lock `blob`'s metadata at `txn` and stage `new` (`None`
    /// deletes). `expected_version` is the primary's current version.
    MetaPrepare {
        blob: BlobId,
        row_version: u64,
        txn: u64,
        expected_version: u64,
        new: Option<BlobMeta>,
    },
    MetaCommit {
        blob: BlobId,
        row_version: u64,
        txn: u64,
    },
    MetaAbort {
        blob: BlobId,
        row_version: u64,
        txn: u64,
    },
    AssignRows {
        assignment: Assignment,
    },
    Heartbeat(Heartbeat),
    /// The current TLT, unless the caller's `have_version` is current.
    GetTlt {
        have_version: u64,
    },
    ClusterStatus,
    ClusterParams,
}

impl Request {
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Ping => Opcode::Ping,
            Request::Hello { .. } => Opcode::Hello,
            Request::WriteTract { .. } => Opcode::WriteTract,
            Request::ReadTract { .. } => Opcode::ReadTract,
            Request::DeleteTract { .. } => Opcode::DeleteTract,
            Request::TrimTract { .. } => Opcode::TrimTract,
            Request::MappedTract { .. } => Opcode::MappedTract,
            Request::DigestTract { .. } => Opcode::DigestTract,
            Request::WriteTractCached { .. } => Opcode::WriteTractCached,
            Request::SyncDisk => Opcode::SyncDisk,
            Request::ListRowTracts { .. } => Opcode::ListRowTracts,
            Request::CopyTract { .. } => Opcode::CopyTract,
            Request::CreateBlob { .. } => Opcode::CreateBlob,
            Request::ExtendBlob { .. } => Opcode::ExtendBlob,
            Request::DeleteBlob { .. } => Opcode::DeleteBlob,
            Request::GetBlob { .. } => Opcode::GetBlob,
            Request::ListBlobs => Opcode::ListBlobs,
            Request::MetaPrepare { .. } => Opcode::MetaPrepare,
            Request::MetaCommit { .. } => Opcode::MetaCommit,
            Request::MetaAbort { .. } => Opcode::MetaAbort,
            Request::AssignRows { .. } => Opcode::AssignRows,
            Request::Heartbeat(_) => Opcode::Heartbeat,
            Request::GetTlt { .. } => Opcode::GetTlt,
            Request::ClusterStatus => Opcode::ClusterStatus,
            Request::ClusterParams => Opcode::ClusterParams,
        }
    }

    pub fn encode(&self) -> bytes::Bytes {
        let mut w = Writer::new();
        match self {
            Request::Ping
            | Request::ClusterStatus
            | Request::ClusterParams
            | Request::ListBlobs
            | Request::SyncDisk => {}
            Request::Hello { session, epoch } => {
                session.put(&mut w);
                epoch.put(&mut w);
            }
            Request::WriteTract { addr, offset, crcs } | Request::WriteTractCached { addr, offset, crcs } => {
                addr.put(&mut w);
                offset.put(&mut w);
                crcs.put(&mut w);
            }
            Request::ReadTract { addr, offset, len } => {
                addr.put(&mut w);
                offset.put(&mut w);
                len.put(&mut w);
            }
            Request::DeleteTract { addr } | Request::MappedTract { addr } | Request::DigestTract { addr } => {
                addr.put(&mut w)
            }
            Request::TrimTract { addr, offset, len } => {
                addr.put(&mut w);
                offset.put(&mut w);
                len.put(&mut w);
            }
            Request::ListRowTracts { row, row_version, after } => {
                row.put(&mut w);
                row_version.put(&mut w);
                after.put(&mut w);
            }
            Request::CopyTract { row, row_version, tract } => {
                row.put(&mut w);
                row_version.put(&mut w);
                tract.put(&mut w);
            }
            Request::CreateBlob { blob, row_version, incarnation, replication } => {
                blob.put(&mut w);
                row_version.put(&mut w);
                incarnation.put(&mut w);
                replication.put(&mut w);
            }
            Request::ExtendBlob { blob, row_version, mode, tracts } => {
                blob.put(&mut w);
                row_version.put(&mut w);
                mode.put(&mut w);
                tracts.put(&mut w);
            }
            Request::DeleteBlob { blob, row_version } | Request::GetBlob { blob, row_version } => {
                blob.put(&mut w);
                row_version.put(&mut w);
            }
            Request::MetaPrepare { blob, row_version, txn, expected_version, new } => {
                blob.put(&mut w);
                row_version.put(&mut w);
                txn.put(&mut w);
                expected_version.put(&mut w);
                new.put(&mut w);
            }
            Request::MetaCommit { blob, row_version, txn }
            | Request::MetaAbort { blob, row_version, txn } => {
                blob.put(&mut w);
                row_version.put(&mut w);
                txn.put(&mut w);
            }
            Request::AssignRows { assignment } => assignment.put(&mut w),
            Request::Heartbeat(h) => h.put(&mut w),
            Request::GetTlt { have_version } => have_version.put(&mut w),
        }
        w.buf.freeze()
    }

    pub fn decode(op: Opcode, meta: &[u8]) -> Result<Request, DecodeError> {
        let mut r = Reader::new(meta);
        let r = &mut r;
        let req = match op {
            Opcode::Ping => Request::Ping,
            Opcode::Hello => Request::Hello { session: Wire::get(r)?, epoch: Wire::get(r)? },
            Opcode::ClusterStatus => Request::ClusterStatus,
            Opcode::ClusterParams => Request::ClusterParams,
            Opcode::ListBlobs => Request::ListBlobs,
            Opcode::SyncDisk => Request::SyncDisk,
            Opcode::WriteTract => {
                Request::WriteTract { addr: Wire::get(r)?, offset: Wire::get(r)?, crcs: Wire::get(r)? }
            }
            Opcode::WriteTractCached => {
                Request::WriteTractCached { addr: Wire::get(r)?, offset: Wire::get(r)?, crcs: Wire::get(r)? }
            }
            Opcode::ReadTract => {
                Request::ReadTract { addr: Wire::get(r)?, offset: Wire::get(r)?, len: Wire::get(r)? }
            }
            Opcode::DeleteTract => Request::DeleteTract { addr: Wire::get(r)? },
            Opcode::MappedTract => Request::MappedTract { addr: Wire::get(r)? },
            Opcode::DigestTract => Request::DigestTract { addr: Wire::get(r)? },
            Opcode::TrimTract => {
                Request::TrimTract { addr: Wire::get(r)?, offset: Wire::get(r)?, len: Wire::get(r)? }
            }
            Opcode::ListRowTracts => Request::ListRowTracts {
                row: Wire::get(r)?,
                row_version: Wire::get(r)?,
                after: Wire::get(r)?,
            },
            Opcode::CopyTract => {
                Request::CopyTract { row: Wire::get(r)?, row_version: Wire::get(r)?, tract: Wire::get(r)? }
            }
            Opcode::CreateBlob => Request::CreateBlob {
                blob: Wire::get(r)?,
                row_version: Wire::get(r)?,
                incarnation: Wire::get(r)?,
                replication: Wire::get(r)?,
            },
            Opcode::ExtendBlob => Request::ExtendBlob {
                blob: Wire::get(r)?,
                row_version: Wire::get(r)?,
                mode: Wire::get(r)?,
                tracts: Wire::get(r)?,
            },
            Opcode::DeleteBlob => Request::DeleteBlob { blob: Wire::get(r)?, row_version: Wire::get(r)? },
            Opcode::GetBlob => Request::GetBlob { blob: Wire::get(r)?, row_version: Wire::get(r)? },
            Opcode::MetaPrepare => Request::MetaPrepare {
                blob: Wire::get(r)?,
                row_version: Wire::get(r)?,
                txn: Wire::get(r)?,
                expected_version: Wire::get(r)?,
                new: Wire::get(r)?,
            },
            Opcode::MetaCommit => {
                Request::MetaCommit { blob: Wire::get(r)?, row_version: Wire::get(r)?, txn: Wire::get(r)? }
            }
            Opcode::MetaAbort => {
                Request::MetaAbort { blob: Wire::get(r)?, row_version: Wire::get(r)?, txn: Wire::get(r)? }
            }
            Opcode::AssignRows => Request::AssignRows { assignment: Wire::get(r)? },
            Opcode::Heartbeat => Request::Heartbeat(Wire::get(r)?),
            Opcode::GetTlt => Request::GetTlt { have_version: Wire::get(r)? },
        };
        r.finish()?;
        Ok(req)
    }
}

/// Why a request failed. The kind tells the caller what to do: retry after
/// refreshing the TLT, retry elsewhere, fix the request, or give up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The frame could not be parsed; the connection will be closed.
    BadFrame = 1,
    UnknownOpcode = 2,
    /// The message was well-framed but its content is invalid.
    BadRequest = 3,
    /// The request's TLT row version is not this server's; fetch the TLT.
    StaleVersion = 4,
    /// This server is not (or not primary) in the row the request maps to.
    NotOwner = 5,
    NoSuchBlob = 6,
    BlobExists = 7,
    /// Offset or length outside the tract or blob.
    OutOfRange = 8,
    /// No free tract slot on this disk.
    DiskFull = 9,
    /// Stored data failed its CRC: read another replica.
    Corrupt = 10,
    /// The request's data did not match its CRCs (damaged in flight).
    BadCrc = 11,
    /// A concurrent metadata operation holds the blob; retry.
    Conflict = 12,
    /// The server is starting or rebuilding; retry shortly.
    NotReady = 13,
    Busy = 14,
    Internal = 15,
    /// The peer belongs to another cluster.
    WrongCluster = 16,
    /// The disk returned an I/O error.
    Io = 17,
    /// A replica refused the two-phase commit; the change was not made.
    Aborted = 18,
    /// The request's writer epoch (`TractAddr::writer`) is older than the
    /// newest this server has seen for the blob: another process opened it
    /// for writing since. `ErrorReply::current_version` is that newest
    /// epoch. Not transient: the old writer must stop.
    Fenced = 19,
    /// A metadata replica that does not lead (design 0007): ask another.
    /// `ErrorReply::current_version` is the leader's replica id if this
    /// one knows it (0 if not), and the message names its address.
    NotLeader = 20,
}

impl ErrorCode {
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        use ErrorCode::*;
        [
            BadFrame,
            UnknownOpcode,
            BadRequest,
            StaleVersion,
            NotOwner,
            NoSuchBlob,
            BlobExists,
            OutOfRange,
            DiskFull,
            Corrupt,
            BadCrc,
            Conflict,
            NotReady,
            Busy,
            Internal,
            WrongCluster,
            Io,
            Aborted,
            Fenced,
            NotLeader,
        ]
        .into_iter()
        .find(|c| *c as u16 == v)
    }

    /// Whether trying again (after a TLT refresh, or a pause) may succeed.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            ErrorCode::StaleVersion
                | ErrorCode::NotOwner
                | ErrorCode::Conflict
                | ErrorCode::NotReady
                | ErrorCode::Busy
                | ErrorCode::NotLeader
        )
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ErrorReply {
    pub code: ErrorCode,
    /// For `StaleVersion`: the server's version of the row; for `Fenced`:
    /// the newest writer epoch the server has seen for the blob.
    pub current_version: u64,
    pub message: String,
}

impl ErrorReply {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorReply { code, current_version: 0, message: message.into() }
    }
}

impl Wire for ErrorReply {
    const MIN_LEN: usize = 2 + 8 + 4;
    fn put(&self, w: &mut Writer) {
        (self.code as u16).put(w);
        self.current_version.put(w);
        self.message.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let code = u16::get(r)?;
        let code = ErrorCode::from_u16(code)
            .ok_or(DecodeError::BadValue { field: "error code", value: code as u64 })?;
        Ok(ErrorReply { code, current_version: Wire::get(r)?, message: Wire::get(r)? })
    }
}

/// A successful reply's meta part. Data (for `ReadTract`) travels beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// Success with nothing to report.
    Done,
    /// Tract bytes follow in the data part; one CRC32C per piece.
    Read {
        crcs: Vec<u32>,
    },
    /// Bit i (LSB first) set: chunk i of the tract holds written data.
    /// Empty when the tract holds none.
    Mapped {
        bitmap: Vec<u8>,
    },
    /// The server's boot id: random, new each time it starts. Cached writes
    /// survive (until synced) only while it stays the same.
    Boot {
        boot: u64,
    },
    /// A page of `ListRowTracts`; `more` when another page follows.
    RowTracts {
        tracts: Vec<RowTract>,
        more: bool,
    },
    /// `DigestTract`: one state per chunk of the tract, in order; empty
    /// when the server holds nothing of the tract (at that incarnation).
    Digest {
        chunks: Vec<ChunkState>,
    },
    /// `CopyTract`: the chunks follow in the data part. An incarnation of
    /// 0 means the source does not hold the tract.
    TractCopy {
        incarnation: Incarnation,
        bitmap: Vec<u8>,
        crcs: Vec<u32>,
    },
    Blob(BlobMeta),
    Blobs(Vec<BlobMeta>),
    Heartbeat(HeartbeatReply),
    /// `None` when the caller's TLT is current.
    Tlt(Option<Tlt>),
    ClusterStatus(ClusterStatus),
    ClusterParams(ClusterParams),
}

const STATUS_OK: u16 = 0;
const STATUS_ERR: u16 = 1;

/// Encodes a response's meta part.
pub fn encode_response(res: &Result<Reply, ErrorReply>) -> bytes::Bytes {
    let mut w = Writer::new();
    match res {
        Err(e) => {
            STATUS_ERR.put(&mut w);
            e.put(&mut w);
        }
        Ok(reply) => {
            STATUS_OK.put(&mut w);
            match reply {
                Reply::Done => {}
                Reply::Read { crcs } => crcs.put(&mut w),
                Reply::Mapped { bitmap } => bitmap.put(&mut w),
                Reply::Boot { boot } => boot.put(&mut w),
                Reply::Digest { chunks } => chunks.put(&mut w),
                Reply::RowTracts { tracts, more } => {
                    tracts.put(&mut w);
                    more.put(&mut w);
                }
                Reply::TractCopy { incarnation, bitmap, crcs } => {
                    incarnation.put(&mut w);
                    bitmap.put(&mut w);
                    crcs.put(&mut w);
                }
                Reply::Blob(m) => m.put(&mut w),
                Reply::Blobs(v) => v.put(&mut w),
                Reply::Heartbeat(h) => h.put(&mut w),
                Reply::Tlt(t) => t.put(&mut w),
                Reply::ClusterStatus(s) => s.put(&mut w),
                Reply::ClusterParams(p) => p.put(&mut w),
            }
        }
    }
    w.buf.freeze()
}

/// Decodes a response's meta part for a request of opcode `op`.
pub fn decode_response(op: Opcode, meta: &[u8]) -> Result<Result<Reply, ErrorReply>, DecodeError> {
    let mut r = Reader::new(meta);
    let r = &mut r;
    let status = u16::get(r)?;
    let res = match status {
        STATUS_ERR => Err(ErrorReply::get(r)?),
        STATUS_OK => Ok(match op {
            Opcode::Ping
            | Opcode::Hello
            | Opcode::WriteTract
            | Opcode::DeleteTract
            | Opcode::TrimTract
            | Opcode::MetaPrepare
            | Opcode::MetaCommit
            | Opcode::MetaAbort
            | Opcode::AssignRows => Reply::Done,
            Opcode::ReadTract => Reply::Read { crcs: Wire::get(r)? },
            Opcode::MappedTract => Reply::Mapped { bitmap: Wire::get(r)? },
            Opcode::DigestTract => Reply::Digest { chunks: get_digest(r)? },
            Opcode::WriteTractCached | Opcode::SyncDisk => Reply::Boot { boot: Wire::get(r)? },
            Opcode::ListBlobs => Reply::Blobs(Wire::get(r)?),
            Opcode::ListRowTracts => Reply::RowTracts { tracts: Wire::get(r)?, more: Wire::get(r)? },
            Opcode::CopyTract => {
                Reply::TractCopy { incarnation: Wire::get(r)?, bitmap: Wire::get(r)?, crcs: Wire::get(r)? }
            }
            Opcode::CreateBlob | Opcode::ExtendBlob | Opcode::DeleteBlob | Opcode::GetBlob => {
                Reply::Blob(Wire::get(r)?)
            }
            Opcode::Heartbeat => Reply::Heartbeat(Wire::get(r)?),
            Opcode::GetTlt => Reply::Tlt(Wire::get(r)?),
            Opcode::ClusterStatus => Reply::ClusterStatus(Wire::get(r)?),
            Opcode::ClusterParams => Reply::ClusterParams(Wire::get(r)?),
        }),
        v => return Err(DecodeError::BadValue { field: "status", value: v as u64 }),
    };
    r.finish()?;
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn addr() -> TractAddr {
        TractAddr { blob: BlobId(0x11), incarnation: 2, tract: TractNo(3), row_version: 4, writer: 5 }
    }

    /// A write request's meta bytes are pinned: changing them is a protocol change.
    #[test]
    fn write_tract_golden_bytes() {
        let req = Request::WriteTract { addr: addr(), offset: 4096, crcs: vec![0xaabbccdd] };
        let b = req.encode();
        let mut want = vec![0x11];
        want.extend_from_slice(&[0; 15]);
        want.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[4, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[5, 0, 0, 0, 0, 0, 0, 0]);
        want.extend_from_slice(&[0, 0x10, 0, 0]);
        want.extend_from_slice(&[1, 0, 0, 0, 0xdd, 0xcc, 0xbb, 0xaa]);
        assert_eq!(&b[..], &want[..]);
        assert_eq!(Request::decode(Opcode::WriteTract, &b), Ok(req));
    }

    fn samples() -> Vec<Request> {
        let meta = BlobMeta { blob: BlobId(9), incarnation: 1, replication: 3, size_tracts: 10, version: 2 };
        let assignment = Assignment {
            cluster_id: 5,
            tract_size: 8 << 20,
            replication: 3,
            tlt_len: 28,
            tlt_version: 7,
            rows: vec![AssignedRow {
                row: 3,
                version: 2,
                members: vec![TsId(1), TsId(2), TsId(3)],
                filling: vec![TsId(3), TsId(4)],
                pending: vec![PendingMember { column: 1, id: TsId(4) }],
            }],
        };
        vec![
            Request::Ping,
            Request::Hello { session: 0x1234_5678, epoch: 3 },
            Request::WriteTract { addr: addr(), offset: 1, crcs: vec![1, 2] },
            Request::ReadTract { addr: addr(), offset: 7, len: 100 },
            Request::DeleteTract { addr: addr() },
            Request::TrimTract { addr: addr(), offset: 4096, len: 8192 },
            Request::MappedTract { addr: addr() },
            Request::DigestTract { addr: TractAddr { writer: u64::MAX, ..addr() } },
            Request::WriteTractCached { addr: addr(), offset: 8192, crcs: vec![1, 2] },
            Request::SyncDisk,
            Request::ListRowTracts { row: 4, row_version: 5, after: None },
            Request::ListRowTracts {
                row: 4,
                row_version: 5,
                after: Some(RowTract { blob: BlobId(6), tract: TractNo::META }),
            },
            Request::CopyTract {
                row: 4,
                row_version: 5,
                tract: RowTract { blob: BlobId(6), tract: TractNo(7) },
            },
            Request::ListBlobs,
            Request::CreateBlob { blob: BlobId(1), row_version: 2, incarnation: 3, replication: 1 },
            Request::ExtendBlob { blob: BlobId(1), row_version: 2, mode: ExtendMode::To, tracts: 5 },
            Request::DeleteBlob { blob: BlobId(1), row_version: 2 },
            Request::GetBlob { blob: BlobId(1), row_version: 2 },
            Request::MetaPrepare {
                blob: BlobId(1),
                row_version: 2,
                txn: 3,
                expected_version: 4,
                new: Some(meta),
            },
            Request::MetaPrepare { blob: BlobId(1), row_version: 2, txn: 3, expected_version: 4, new: None },
            Request::MetaCommit { blob: BlobId(1), row_version: 2, txn: 3 },
            Request::MetaAbort { blob: BlobId(1), row_version: 2, txn: 3 },
            Request::AssignRows { assignment: assignment.clone() },
            Request::Heartbeat(Heartbeat {
                ts_id: TsId(77),
                addr: "127.0.0.1:1".into(),
                domain: "rack1".into(),
                tract_size: 4096,
                slots_total: 10,
                slots_used: 3,
                load: 1,
                disk_mbps: 100,
                assignment: Some(assignment),
                filled: vec![RowRef { row: 3, version: 2 }],
                fill: FillProgress { rows: 1, tracts_total: 2, tracts_done: 1, bytes_done: 4096 },
            }),
            Request::GetTlt { have_version: 3 },
            Request::ClusterStatus,
            Request::ClusterParams,
        ]
    }

    /// Every request kind survives an encode/decode round trip.
    #[test]
    fn requests_round_trip() {
        for req in samples() {
            let b = req.encode();
            assert_eq!(Request::decode(req.opcode(), &b), Ok(req));
        }
    }

    /// Every proper prefix of every request is rejected without a panic.
    #[test]
    fn truncated_requests_are_rejected() {
        for req in samples() {
            let b = req.encode();
            for n in 0..b.len() {
                assert!(Request::decode(req.opcode(), &b[..n]).is_err(), "{req:?} prefix {n} accepted");
            }
        }
    }

    #[test]
    fn responses_round_trip() {
        let tlt = Tlt {
            cluster_id: 1,
            tract_size: 4096,
            replication: 1,
            version: 2,
            members: vec![
                TltMember { id: TsId(1), addr: "a:1".into(), domain: "d".into() },
                TltMember { id: TsId(2), addr: "b:1".into(), domain: "e".into() },
            ],
            rows: vec![TltRow {
                version: 1,
                members: vec![0],
                pending: vec![Pending { column: 0, member: 1 }],
            }],
        };
        let cases = vec![
            (Opcode::Ping, Ok(Reply::Done)),
            (Opcode::ReadTract, Ok(Reply::Read { crcs: vec![1, 2, 3] })),
            (Opcode::MappedTract, Ok(Reply::Mapped { bitmap: vec![0b1010_0001, 0, 0xff] })),
            (Opcode::WriteTractCached, Ok(Reply::Boot { boot: 0x0123_4567_89ab_cdef })),
            (Opcode::DigestTract, Ok(Reply::Digest { chunks: vec![] })),
            (
                Opcode::DigestTract,
                Ok(Reply::Digest {
                    chunks: vec![
                        ChunkState::Hole,
                        ChunkState::Data(0xdead_beef),
                        ChunkState::Unreadable,
                        ChunkState::Data(0),
                    ],
                }),
            ),
            (Opcode::DigestTract, Ok(Reply::Digest { chunks: vec![ChunkState::Data(7); DIGEST_CHUNKS_MAX] })),
            (
                Opcode::WriteTract,
                Err(ErrorReply { code: ErrorCode::Fenced, current_version: 6, message: "fenced".into() }),
            ),
            (Opcode::SyncDisk, Ok(Reply::Boot { boot: 7 })),
            (
                Opcode::ListRowTracts,
                Ok(Reply::RowTracts {
                    tracts: vec![RowTract { blob: BlobId(1), tract: TractNo(2) }],
                    more: true,
                }),
            ),
            (
                Opcode::CopyTract,
                Ok(Reply::TractCopy { incarnation: 3, bitmap: vec![0b101], crcs: vec![8, 9] }),
            ),
            (Opcode::GetTlt, Ok(Reply::Tlt(Some(tlt)))),
            (Opcode::GetTlt, Ok(Reply::Tlt(None))),
            (
                Opcode::WriteTract,
                Err(ErrorReply {
                    code: ErrorCode::StaleVersion,
                    current_version: 9,
                    message: "stale".into(),
                }),
            ),
        ];
        for (op, res) in cases {
            let b = encode_response(&res);
            assert_eq!(decode_response(op, &b), Ok(res));
        }
    }

    /// A digest's bytes are pinned (tag byte, CRC after a data tag), and
    /// every proper prefix of one is refused.
    #[test]
    fn digest_golden_bytes() {
        let res = Ok(Reply::Digest {
            chunks: vec![ChunkState::Hole, ChunkState::Data(0x0403_0201), ChunkState::Unreadable],
        });
        let b = encode_response(&res);
        assert_eq!(&b[..], &[0, 0, 3, 0, 0, 0, 0, 1, 1, 2, 3, 4, 2][..]);
        assert_eq!(decode_response(Opcode::DigestTract, &b), Ok(res));
        for n in 0..b.len() {
            assert!(decode_response(Opcode::DigestTract, &b[..n]).is_err(), "prefix {n} accepted");
        }
    }

    /// A digest longer than the largest tract has chunks, or with an
    /// unknown tag, is refused (before allocating for the count).
    #[test]
    fn bad_digests_are_refused() {
        let mut too_long = vec![0u8, 0];
        too_long.extend_from_slice(&(DIGEST_CHUNKS_MAX as u32 + 1).to_le_bytes());
        too_long.resize(too_long.len() + DIGEST_CHUNKS_MAX + 1, 0);
        assert_eq!(
            decode_response(Opcode::DigestTract, &too_long),
            Err(DecodeError::BadValue { field: "digest chunks", value: DIGEST_CHUNKS_MAX as u64 + 1 })
        );
        let mut huge = vec![0u8, 0];
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_response(Opcode::DigestTract, &huge).is_err());
        let lying = [0u8, 0, 5, 0, 0, 0, 0, 0];
        assert!(matches!(
            decode_response(Opcode::DigestTract, &lying),
            Err(DecodeError::ListTooLong { count: 5, left: 2 })
        ));
        let unknown_tag = [0u8, 0, 2, 0, 0, 0, 0, 3];
        assert_eq!(
            decode_response(Opcode::DigestTract, &unknown_tag),
            Err(DecodeError::BadValue { field: "chunk state", value: 3 })
        );
    }

    /// `Fenced` decodes from its number and is not retried as transient.
    #[test]
    fn fenced_is_known_and_not_transient() {
        assert_eq!(ErrorCode::from_u16(19), Some(ErrorCode::Fenced));
        assert!(!ErrorCode::Fenced.is_transient());
    }

    fn any_chunk_state() -> impl Strategy<Value = ChunkState> {
        prop_oneof![
            Just(ChunkState::Hole),
            any::<u32>().prop_map(ChunkState::Data),
            Just(ChunkState::Unreadable)
        ]
    }

    proptest! {
        /// Any digest survives an encode/decode round trip.
        #[test]
        fn digests_round_trip(chunks in proptest::collection::vec(any_chunk_state(), 0..300)) {
            let res = Ok(Reply::Digest { chunks });
            let b = encode_response(&res);
            prop_assert_eq!(decode_response(Opcode::DigestTract, &b), Ok(res));
        }

        /// Arbitrary bytes never make any decoder panic.
        #[test]
        fn garbage_never_panics(op in 0usize..Opcode::ALL.len(), bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let op = Opcode::ALL[op];
            let _ = Request::decode(op, &bytes);
            let _ = decode_response(op, &bytes);
        }
    }
}
