//! Errors of LSVD volumes, and the coarse kind a frontend acts on (the
//! same kinds as `blizzard_volume::ErrorKind`, which maps them).

use crate::format::FormatError;

/// What a failure means to whoever serves the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The cache disk is full (a write that cannot be journaled).
    NoSpace,
    /// The request lies past the end of the volume.
    OutOfRange,
    /// A request no retry mends (bad parameters, wrong credentials, a
    /// missing bucket, a prefix holding another volume).
    Invalid,
    /// Another process writes this volume.
    Fenced,
    /// Stored bytes failed their checks.
    Corrupt,
    /// The object store could not be reached or did not answer: retrying
    /// later may work.
    Unavailable,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum LsvdError {
    #[error("no LSVD volume at {0}")]
    NotFound(String),
    #[error("{0} already holds a volume; pick another prefix or delete that volume first")]
    Exists(String),
    #[error("{at} holds volume {found:?}, not {expected:?}")]
    OtherVolume { at: String, found: String, expected: String },
    #[error("range [{offset}, +{len}) is past the end of the {size}-byte volume")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("invalid: {0}")]
    Invalid(String),
    /// Something else needs it (a snapshot a clone reads), or the name is
    /// taken (a snapshot of that name exists): the message says which.
    #[error("{0}")]
    InUse(String),
    /// Lost the race for the claim object at open.
    #[error("another process opened volume {name:?} for writing (it created object {seq} while this one was opening); stop it first")]
    Held { name: String, seq: u64 },
    /// A later writer claimed the log: this one must stop.
    #[error("another process took over volume {name:?} (object {seq} was created by writer epoch {epoch}, this process writes as {mine}); writes acknowledged here but not yet in the object store are lost to it: stop using the volume here")]
    Fenced { name: String, seq: u64, epoch: u64, mine: u64 },
    #[error("damaged: {0}")]
    Corrupt(String),
    #[error("{0}")]
    Format(#[from] FormatError),
    /// The object store refused the credentials or the request for good.
    #[error("object store refused the request: {0}")]
    Denied(String),
    /// The object store could not be reached or failed the request.
    #[error("object store: {0}")]
    Store(String),
    #[error("cache: {0}")]
    Cache(String),
    #[error("cache disk is full: {0}")]
    CacheFull(String),
    /// The volume failed earlier and must be reopened (the first failure).
    #[error("{0}")]
    Failed(Box<LsvdError>),
}

impl LsvdError {
    pub fn kind(&self) -> Kind {
        match self {
            LsvdError::OutOfRange { .. } => Kind::OutOfRange,
            LsvdError::NotFound(_)
            | LsvdError::Exists(_)
            | LsvdError::OtherVolume { .. }
            | LsvdError::Invalid(_)
            | LsvdError::InUse(_)
            | LsvdError::Denied(_) => Kind::Invalid,
            LsvdError::Held { .. } | LsvdError::Fenced { .. } => Kind::Fenced,
            LsvdError::Corrupt(_) | LsvdError::Format(_) => Kind::Corrupt,
            LsvdError::Store(_) => Kind::Unavailable,
            LsvdError::Cache(_) => Kind::Invalid,
            LsvdError::CacheFull(_) => Kind::NoSpace,
            LsvdError::Failed(e) => e.kind(),
        }
    }
}
