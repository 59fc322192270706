//! Messages. A request's opcode names its message; the response carries the
//! same opcode, and its meta part starts with a status: 0 for success
//! followed by the opcode's reply, or an [`ErrorReply`].

use blizzard_core::limits::{CHUNK_SIZE, TRACT_SIZE_MAX};
use blizzard_core::reconcile::ChunkState;
use blizzard_core::tlt::Tlt;
use blizzard_core::{BlobId, Incarnation, TractNo};

use crate::cluster::*;
use crate::codec::{DecodeError, Reader, Wire, Writer};
use crate::scope::ScopeEntry;
use crate::wire_struct;

mod reply;
pub use reply::{decode_response, encode_response, BatchFailure, ErrorCode, ErrorReply, Reply};

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
    // Size-aware replication (Ursa §3.4): a large write sent once, to the
    // row's primary, which applies it and forwards it to the backups.
    WriteTractForward = 0x010B,
    // Incremental repair (Ursa §4.2.1): a member back in a row it held
    // fetches only the chunks of a tract that differ from what it holds.
    CopyTractChanges = 0x010C,
    // Several small writes to one server that were ready together, in one
    // frame (`WriteTract` or `WriteTractCached` each).
    WriteTracts = 0x010D,
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
    // Volume leases (design 0007): one writer per volume.
    AcquireVolume = 0x0405,
    RenewVolume = 0x0406,
    ReleaseVolume = 0x0407,
    // Who may touch which volume (design 0010, issue 56): access lists,
    // revocations, and the table tractservers and NBD servers enforce.
    SetVolumeAccess = 0x0408,
    DropVolume = 0x0409,
    Revoke = 0x040A,
    GetScope = 0x040B,
    AttachReader = 0x040C,
}

impl Opcode {
    pub const ALL: [Opcode; 36] = [
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
        Opcode::WriteTractForward,
        Opcode::CopyTractChanges,
        Opcode::WriteTracts,
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
        Opcode::AcquireVolume,
        Opcode::RenewVolume,
        Opcode::ReleaseVolume,
        Opcode::SetVolumeAccess,
        Opcode::DropVolume,
        Opcode::Revoke,
        Opcode::GetScope,
        Opcode::AttachReader,
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

/// The client connection a forwarded write acts for: its `Hello`'s session
/// and epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OnBehalf {
    pub session: u64,
    pub epoch: u64,
}
wire_struct!(OnBehalf { session: u64, epoch: u64 });

/// A server a write is forwarded to, and the epoch of the client's
/// session with it (the client's connections to it say hello with it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Onward {
    pub addr: String,
    pub epoch: u64,
}
wire_struct!(Onward { addr: String, epoch: u64 });

/// Most addresses one `WriteTractForward` names: a row's other members and
/// their pending members.
pub const FORWARD_TO_MAX: usize = 2 * blizzard_core::limits::REPLICATION_MAX as usize;

/// One write of a [`Request::WriteTracts`]: its `len` bytes are the next
/// ones of the frame's data part, in the order of the list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchedWrite {
    pub addr: TractAddr,
    pub offset: u32,
    pub len: u32,
    pub crcs: Vec<u32>,
}
wire_struct!(BatchedWrite { addr: TractAddr, offset: u32, len: u32, crcs: Vec<u32> });

/// Most writes one `WriteTracts` carries.
pub const WRITE_BATCH_MAX: usize = 64;

/// Most entries a `Reply::Digest` may hold: one per chunk of the largest
/// tract.
pub const DIGEST_CHUNKS_MAX: usize = (TRACT_SIZE_MAX / CHUNK_SIZE) as usize;

/// A chunk's state on the wire: a tag byte (0 hole, 1 data followed by its
/// 64-bit digest, `reconcile::chunk_digest`, 2 unreadable).
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
            1 => Ok(ChunkState::Data(u64::get(r)?)),
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
    /// `WriteTract` sent once (Ursa §3.4): the server applies it and sends
    /// it on to each server in `to` (the row's other writers, as the
    /// client's table names them), with `to` empty and `on_behalf` the
    /// client's session with the epoch the client gave for that server,
    /// so a forwarded copy the client gave up on is fenced by the session
    /// there like a direct one (`rpc::session`; epochs are per server).
    /// Replies once every copy is durable, or with the first failure
    /// (`ErrorCode::Unreachable` for a copy that could not be delivered).
    /// At most [`FORWARD_TO_MAX`] servers.
    WriteTractForward {
        addr: TractAddr,
        offset: u32,
        crcs: Vec<u32>,
        to: Vec<Onward>,
        on_behalf: Option<OnBehalf>,
    },
    /// Several writes to this server in one frame, each as its own
    /// `WriteTract` (or `WriteTractCached` when `cached`) would be: checked,
    /// fenced and applied on its own, concurrently, so the durable ones
    /// share the server's group commits. The data part is the writes' data,
    /// one after another. The reply (`Reply::Batch`) lists the writes that
    /// failed, each with its own error; a request that is malformed as a
    /// whole (more than [`WRITE_BATCH_MAX`] writes, lengths that do not add
    /// up to the data) fails as a whole and applies nothing.
    WriteTracts {
        cached: bool,
        writes: Vec<BatchedWrite>,
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
    /// What differs between the copier's tract and this server's
    /// (incremental repair, design 0009): `have` is the copier's digest of
    /// its tract at `incarnation`. The reply (`Reply::TractChanges`) holds
    /// only the chunks whose state differs, and the chunks to unmap; a
    /// tract held here at another incarnation (or not at all) comes whole,
    /// as `CopyTract` would send it.
    CopyTractChanges {
        row: u32,
        row_version: u64,
        tract: RowTract,
        incarnation: Incarnation,
        have: Vec<ChunkState>,
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
    /// Takes the volume `blob` for writing for `ttl_ms` on behalf of
    /// `holder` (a process: `host:pid/nonce`); with `take_over`, even from
    /// another live holder (the operator says it is dead).
    AcquireVolume {
        blob: BlobId,
        holder: String,
        ttl_ms: u64,
        take_over: bool,
    },
    /// Extends `holder`'s lease on `blob`, taken under `token`.
    RenewVolume {
        blob: BlobId,
        holder: String,
        token: u64,
        ttl_ms: u64,
    },
    /// Frees the lease on `blob` if `token` still holds it.
    ReleaseVolume {
        blob: BlobId,
        token: u64,
    },
    /// Registers volume `name` (its blob `blob`) with the access list
    /// `entries`, replacing the one it had (`admin` only).
    SetVolumeAccess {
        blob: BlobId,
        name: String,
        entries: Vec<ScopeEntry>,
    },
    /// Forgets volume `blob`'s access list (it was deleted; `admin` only).
    DropVolume {
        blob: BlobId,
    },
    /// Refuses the certificate with serial number `serial` (hex), issued
    /// to `name`, everywhere from now on (`admin` only).
    Revoke {
        serial: String,
        name: String,
    },
    /// The scope table (`scope`), unless the caller's `have_version` is
    /// current.
    GetScope {
        have_version: u64,
    },
    /// Registers the caller's certificate as a reader of volume `blob`: an
    /// NBD server that serves it read-only, without its lease (design
    /// 0010). Kept until the volume is deleted.
    AttachReader {
        blob: BlobId,
    },
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
            Request::WriteTractForward { .. } => Opcode::WriteTractForward,
            Request::WriteTracts { .. } => Opcode::WriteTracts,
            Request::SyncDisk => Opcode::SyncDisk,
            Request::ListRowTracts { .. } => Opcode::ListRowTracts,
            Request::CopyTract { .. } => Opcode::CopyTract,
            Request::CopyTractChanges { .. } => Opcode::CopyTractChanges,
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
            Request::AcquireVolume { .. } => Opcode::AcquireVolume,
            Request::RenewVolume { .. } => Opcode::RenewVolume,
            Request::ReleaseVolume { .. } => Opcode::ReleaseVolume,
            Request::SetVolumeAccess { .. } => Opcode::SetVolumeAccess,
            Request::DropVolume { .. } => Opcode::DropVolume,
            Request::Revoke { .. } => Opcode::Revoke,
            Request::GetScope { .. } => Opcode::GetScope,
            Request::AttachReader { .. } => Opcode::AttachReader,
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
            Request::WriteTractForward { addr, offset, crcs, to, on_behalf } => {
                addr.put(&mut w);
                offset.put(&mut w);
                crcs.put(&mut w);
                to.put(&mut w);
                on_behalf.put(&mut w);
            }
            Request::WriteTracts { cached, writes } => {
                cached.put(&mut w);
                writes.put(&mut w);
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
            Request::CopyTractChanges { row, row_version, tract, incarnation, have } => {
                row.put(&mut w);
                row_version.put(&mut w);
                tract.put(&mut w);
                incarnation.put(&mut w);
                have.put(&mut w);
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
            Request::AcquireVolume { blob, holder, ttl_ms, take_over } => {
                blob.put(&mut w);
                holder.put(&mut w);
                ttl_ms.put(&mut w);
                take_over.put(&mut w);
            }
            Request::RenewVolume { blob, holder, token, ttl_ms } => {
                blob.put(&mut w);
                holder.put(&mut w);
                token.put(&mut w);
                ttl_ms.put(&mut w);
            }
            Request::ReleaseVolume { blob, token } => {
                blob.put(&mut w);
                token.put(&mut w);
            }
            Request::SetVolumeAccess { blob, name, entries } => {
                blob.put(&mut w);
                name.put(&mut w);
                entries.put(&mut w);
            }
            Request::DropVolume { blob } | Request::AttachReader { blob } => blob.put(&mut w),
            Request::Revoke { serial, name } => {
                serial.put(&mut w);
                name.put(&mut w);
            }
            Request::GetScope { have_version } => have_version.put(&mut w),
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
            Opcode::WriteTractForward => {
                let (addr, offset, crcs) = (Wire::get(r)?, Wire::get(r)?, Wire::get(r)?);
                let to: Vec<Onward> = Wire::get(r)?;
                if to.len() > FORWARD_TO_MAX {
                    return Err(DecodeError::BadValue { field: "forward addresses", value: to.len() as u64 });
                }
                Request::WriteTractForward { addr, offset, crcs, to, on_behalf: Wire::get(r)? }
            }
            Opcode::WriteTracts => {
                let cached = Wire::get(r)?;
                let writes: Vec<BatchedWrite> = Wire::get(r)?;
                if writes.len() > WRITE_BATCH_MAX {
                    return Err(DecodeError::BadValue {
                        field: "batched writes",
                        value: writes.len() as u64,
                    });
                }
                Request::WriteTracts { cached, writes }
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
            Opcode::CopyTractChanges => Request::CopyTractChanges {
                row: Wire::get(r)?,
                row_version: Wire::get(r)?,
                tract: Wire::get(r)?,
                incarnation: Wire::get(r)?,
                have: get_digest(r)?,
            },
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
            Opcode::AcquireVolume => Request::AcquireVolume {
                blob: Wire::get(r)?,
                holder: Wire::get(r)?,
                ttl_ms: Wire::get(r)?,
                take_over: Wire::get(r)?,
            },
            Opcode::RenewVolume => Request::RenewVolume {
                blob: Wire::get(r)?,
                holder: Wire::get(r)?,
                token: Wire::get(r)?,
                ttl_ms: Wire::get(r)?,
            },
            Opcode::ReleaseVolume => Request::ReleaseVolume { blob: Wire::get(r)?, token: Wire::get(r)? },
            Opcode::SetVolumeAccess => {
                let blob = Wire::get(r)?;
                let name: String = Wire::get(r)?;
                if name.is_empty() || name.len() > blizzard_core::limits::NAME_LEN_MAX {
                    return Err(DecodeError::BadValue {
                        field: "volume name length",
                        value: name.len() as u64,
                    });
                }
                let entries: Vec<ScopeEntry> = Wire::get(r)?;
                if crate::scope::check_entries(&entries).is_err() {
                    return Err(DecodeError::BadValue { field: "access list", value: entries.len() as u64 });
                }
                Request::SetVolumeAccess { blob, name, entries }
            }
            Opcode::DropVolume => Request::DropVolume { blob: Wire::get(r)? },
            Opcode::Revoke => {
                let serial: String = Wire::get(r)?;
                let name: String = Wire::get(r)?;
                if serial.is_empty()
                    || serial.len() > crate::scope::SERIAL_LEN_MAX
                    || !serial.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
                {
                    return Err(DecodeError::BadValue { field: "serial number", value: serial.len() as u64 });
                }
                if name.len() > crate::scope::IDENTITY_LEN_MAX {
                    return Err(DecodeError::BadValue {
                        field: "revoked name length",
                        value: name.len() as u64,
                    });
                }
                Request::Revoke { serial, name }
            }
            Opcode::GetScope => Request::GetScope { have_version: Wire::get(r)? },
            Opcode::AttachReader => Request::AttachReader { blob: Wire::get(r)? },
        };
        r.finish()?;
        Ok(req)
    }
}

#[cfg(test)]
pub(crate) mod tests;
