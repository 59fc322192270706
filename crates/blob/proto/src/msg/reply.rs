//! The response side: error codes and replies, and the response's meta
//! part (a status, then the opcode's reply or an [`ErrorReply`]).

use super::*;

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
    /// A server this request was to be forwarded to could not be reached
    /// (`WriteTractForward`): the table may name its replacement.
    Unreachable = 21,
    /// The peer's certificate (its role) does not allow this request
    /// (design 0010): not transient; use a certificate of the right role.
    Forbidden = 22,
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
            Unreachable,
            Forbidden,
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
                | ErrorCode::Unreachable
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
    /// `WriteTracts`: the writes that failed (by their place in the
    /// request), each with its own error; every other one was applied as
    /// its own request would have been. `boot` is the server's boot id
    /// (for cached writes, as `Boot`).
    Batch {
        boot: u64,
        failed: Vec<BatchFailure>,
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
    /// `CopyTractChanges`: the chunks marked in `bitmap` follow in the data
    /// part, one CRC32C each; the chunks marked in `holes` are unmapped
    /// here. At the copier's incarnation, every other chunk is the same on
    /// both sides; at another incarnation (0: not held here) this is the
    /// whole tract and `holes` is empty.
    TractChanges {
        incarnation: Incarnation,
        bitmap: Vec<u8>,
        crcs: Vec<u32>,
        holes: Vec<u8>,
    },
    Blob(BlobMeta),
    Blobs(Vec<BlobMeta>),
    Heartbeat(HeartbeatReply),
    /// `None` when the caller's TLT is current.
    Tlt(Option<Tlt>),
    ClusterStatus(ClusterStatus),
    ClusterParams(ClusterParams),
    /// `AcquireVolume`, `RenewVolume`.
    VolumeLease(VolumeLease),
    /// `GetScope`: `None` when the caller's table is current.
    Scope(Option<crate::scope::Scope>),
}

/// One write of a `WriteTracts` that failed: its place in the request and
/// its error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchFailure {
    pub index: u32,
    pub error: ErrorReply,
}
crate::wire_struct!(BatchFailure { index: u32, error: ErrorReply });

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
                Reply::Batch { boot, failed } => {
                    boot.put(&mut w);
                    failed.put(&mut w);
                }
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
                Reply::TractChanges { incarnation, bitmap, crcs, holes } => {
                    incarnation.put(&mut w);
                    bitmap.put(&mut w);
                    crcs.put(&mut w);
                    holes.put(&mut w);
                }
                Reply::Blob(m) => m.put(&mut w),
                Reply::Blobs(v) => v.put(&mut w),
                Reply::Heartbeat(h) => h.put(&mut w),
                Reply::Tlt(t) => t.put(&mut w),
                Reply::ClusterStatus(s) => s.put(&mut w),
                Reply::ClusterParams(p) => p.put(&mut w),
                Reply::VolumeLease(l) => l.put(&mut w),
                Reply::Scope(s) => s.put(&mut w),
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
            | Opcode::WriteTractForward
            | Opcode::DeleteTract
            | Opcode::TrimTract
            | Opcode::MetaPrepare
            | Opcode::MetaCommit
            | Opcode::MetaAbort
            | Opcode::AssignRows
            | Opcode::ReleaseVolume
            | Opcode::SetVolumeAccess
            | Opcode::DropVolume
            | Opcode::Revoke
            | Opcode::AttachReader => Reply::Done,
            Opcode::ReadTract => Reply::Read { crcs: Wire::get(r)? },
            Opcode::MappedTract => Reply::Mapped { bitmap: Wire::get(r)? },
            Opcode::DigestTract => Reply::Digest { chunks: get_digest(r)? },
            Opcode::WriteTractCached | Opcode::SyncDisk => Reply::Boot { boot: Wire::get(r)? },
            Opcode::WriteTracts => {
                let boot = Wire::get(r)?;
                let failed: Vec<BatchFailure> = Wire::get(r)?;
                if failed.len() > WRITE_BATCH_MAX {
                    return Err(DecodeError::BadValue { field: "failed writes", value: failed.len() as u64 });
                }
                Reply::Batch { boot, failed }
            }
            Opcode::ListBlobs => Reply::Blobs(Wire::get(r)?),
            Opcode::ListRowTracts => Reply::RowTracts { tracts: Wire::get(r)?, more: Wire::get(r)? },
            Opcode::CopyTract => {
                Reply::TractCopy { incarnation: Wire::get(r)?, bitmap: Wire::get(r)?, crcs: Wire::get(r)? }
            }
            Opcode::CopyTractChanges => Reply::TractChanges {
                incarnation: Wire::get(r)?,
                bitmap: Wire::get(r)?,
                crcs: Wire::get(r)?,
                holes: Wire::get(r)?,
            },
            Opcode::CreateBlob | Opcode::ExtendBlob | Opcode::DeleteBlob | Opcode::GetBlob => {
                Reply::Blob(Wire::get(r)?)
            }
            Opcode::Heartbeat => Reply::Heartbeat(Wire::get(r)?),
            Opcode::GetTlt => Reply::Tlt(Wire::get(r)?),
            Opcode::ClusterStatus => Reply::ClusterStatus(Wire::get(r)?),
            Opcode::ClusterParams => Reply::ClusterParams(Wire::get(r)?),
            Opcode::AcquireVolume | Opcode::RenewVolume => Reply::VolumeLease(Wire::get(r)?),
            Opcode::GetScope => Reply::Scope(Wire::get(r)?),
        }),
        v => return Err(DecodeError::BadValue { field: "status", value: v as u64 }),
    };
    r.finish()?;
    Ok(res)
}
