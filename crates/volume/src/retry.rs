//! Retrying what an engine already acknowledged.
//!
//! Fast-ack and log commit acknowledge a write before it is durable, so a
//! failed write of theirs cannot be handed back to the application: it is
//! tried again until it lands. Only while retrying can help, though: a
//! failure whose [`ErrorKind`] is permanent (a full disk, another process
//! claimed the volume) is returned, and the engine goes into its failed
//! state, failing every later write and flush with it. Retrying a full
//! disk forever hung every durable flush, and the shutdown flush with it.

use std::future::Future;
use std::time::Duration;

use blizzard_env::Env;

use crate::{ErrorKind, IoError, VolumeError};

/// An error that says whether retrying can help.
pub(crate) trait Kind: std::fmt::Display {
    fn kind(&self) -> ErrorKind;
}

impl Kind for IoError {
    fn kind(&self) -> ErrorKind {
        IoError::kind(self)
    }
}

impl Kind for VolumeError {
    fn kind(&self) -> ErrorKind {
        VolumeError::kind(self)
    }
}

/// Pause between attempts (the blob store retries through TLT changes
/// and restarts itself first, so an attempt that fails already waited).
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Logged when an engine fails.
pub(crate) const FAILED: &str = "an acknowledged write cannot land: every later write and flush of this \
    volume fails until it is reopened; if the cluster is full, free space (delete or trim volumes) or add \
    tractservers, then reopen it";

/// Runs `op` until it succeeds or fails with a permanent error, which is
/// returned. `what` names the operation in the warning logged per retry.
pub(crate) async fn until_landed<T, E: Kind, Fut>(
    env: &Env,
    what: &str,
    mut op: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(e) if e.kind().is_permanent() => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "{what} failed; retrying");
                env.sleep(RETRY_PAUSE).await;
            }
        }
    }
}
