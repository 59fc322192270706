//! Retrying what an engine already acknowledged.
//!
//! Fast-ack and log commit acknowledge a write before it is durable, so a
//! failed write of theirs cannot be handed back to the application: it is
//! tried again until it lands. How an engine behaves meanwhile depends on
//! the failure's [`ErrorKind`] (the engine's [`Refusal`]):
//!
//! | failure | the write | new writes and flushes |
//! |---|---|---|
//! | `Unavailable` (a server down, a failover) | retried | go on as usual |
//! | `NoSpace` (a full disk) | retried | fail with it until the write lands ("stuck") |
//! | `Fenced`, `Invalid`, `Corrupt`, `OutOfRange` | given up | fail with it until the volume is reopened ("failed") |
//!
//! Retrying a full disk silently hung every durable flush (and the
//! shutdown flush of `blizzard up`, so SIGTERM could not stop it); now the
//! flush fails with ENOSPC, and once space is freed (or servers added) the
//! stuck writes land and the volume works again without a reopen.

use std::future::Future;
use std::time::Duration;

use blizzard_env::Env;

use crate::{ErrorKind, IoError, VolumeError};

/// Pause between attempts (the blob store retries through TLT changes
/// and restarts itself first, so an attempt that fails already waited).
pub(crate) const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Logged when an engine fails for good.
pub(crate) const FAILED: &str =
    "an acknowledged write cannot land: every later write and flush of this volume fails until it is reopened";

/// Logged when an engine gets stuck on a full disk.
pub(crate) const STUCK: &str = "an acknowledged write cannot land until space is freed: later writes and \
    flushes fail with ENOSPC meanwhile; free space (delete or trim volumes) or add tractservers";

/// An error that says whether retrying can help.
pub(crate) trait Kind: std::fmt::Display + Clone + Into<VolumeError> {
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

/// An engine's side of [`until_landed`]: told when a write gets stuck on
/// a refusal that may mend, and when it lands after all.
pub(crate) trait Stuck {
    fn stuck(&self, e: VolumeError);
    fn unstuck(&self);
}

/// Runs `op` until it succeeds, or fails with an error retrying cannot
/// mend, which is returned (the engine then fails for good). While it
/// fails with `NoSpace` the engine is stuck (`engine.stuck`), until it
/// lands. `what` names the operation in the warning logged per retry.
pub(crate) async fn until_landed<T, E: Kind, Fut>(
    env: &Env,
    what: &str,
    engine: &(dyn Stuck + Sync),
    mut op: impl FnMut() -> Fut,
) -> Result<T, E>
where
    Fut: Future<Output = Result<T, E>>,
{
    let mut stuck = false;
    let result = loop {
        match op().await {
            Ok(v) => break Ok(v),
            Err(e) => match e.kind() {
                ErrorKind::Unavailable => {
                    tracing::warn!(error = %e, "{what} failed; retrying");
                }
                ErrorKind::NoSpace => {
                    if !stuck {
                        stuck = true;
                        engine.stuck(e.clone().into());
                    }
                }
                _ => break Err(e),
            },
        }
        env.sleep(RETRY_PAUSE).await;
    };
    if stuck {
        engine.unstuck();
    }
    result
}

/// Why an engine refuses new writes and flushes (the table above).
#[derive(Default, Debug)]
pub(crate) struct Refusal {
    /// For good: the first permanent failure.
    failed: Option<VolumeError>,
    /// Writes stuck on a refusal that may mend, and the latest such.
    stuck: u32,
    stuck_on: Option<VolumeError>,
}

impl Refusal {
    /// `Err` while writes and flushes must be refused.
    pub(crate) fn check(&self) -> Result<(), VolumeError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        match (&self.stuck_on, self.stuck) {
            (Some(e), n) if n > 0 => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// A permanent failure; returns whether it is the first. Another
    /// process claiming the volume reads as `Fenced` with its epoch.
    pub(crate) fn fail(&mut self, e: VolumeError) -> bool {
        let e = match e.fenced_by() {
            Some(newest) => VolumeError::Fenced { newest },
            None => e,
        };
        let first = self.failed.is_none();
        self.failed.get_or_insert(e);
        first
    }

    /// A write is stuck; returns whether the engine just got stuck.
    pub(crate) fn stuck(&mut self, e: VolumeError) -> bool {
        self.stuck += 1;
        self.stuck_on = Some(e);
        self.stuck == 1
    }

    /// A stuck write landed; returns whether none is stuck any more.
    pub(crate) fn unstuck(&mut self) -> bool {
        self.stuck = self.stuck.saturating_sub(1);
        if self.stuck == 0 {
            self.stuck_on = None;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_client::ClientError;

    fn full() -> VolumeError {
        VolumeError::Io(IoError::Client(ClientError::DiskFull { addr: "ts".into(), message: "full".into() }))
    }

    #[test]
    fn stuck_refuses_until_every_stuck_write_lands() {
        let mut r = Refusal::default();
        assert!(r.check().is_ok());
        assert!(r.stuck(full()));
        assert!(!r.stuck(full()));
        assert_eq!(r.check().map_err(|e| e.kind()), Err(ErrorKind::NoSpace));
        assert!(!r.unstuck());
        assert!(r.check().is_err());
        assert!(r.unstuck());
        assert!(r.check().is_ok());
    }

    #[test]
    fn failed_is_for_good_and_keeps_the_first() {
        let mut r = Refusal::default();
        assert!(r.fail(VolumeError::Fenced { newest: 4 }));
        assert!(!r.fail(VolumeError::Invalid("later".into())));
        r.stuck(full());
        r.unstuck();
        assert!(matches!(r.check(), Err(VolumeError::Fenced { newest: 4 })));
    }

    /// Counts (stuck, unstuck).
    #[derive(Default)]
    struct Count(std::sync::Mutex<(u32, u32)>);
    impl Count {
        fn get(&self) -> (u32, u32) {
            *self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
    }
    impl Stuck for Count {
        fn stuck(&self, _: VolumeError) {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
        }
        fn unstuck(&self) {
            self.0.lock().unwrap_or_else(|p| p.into_inner()).1 += 1;
        }
    }

    /// Full twice, then it lands: stuck once, unstuck once. An
    /// unavailable store is retried without getting stuck; a fence ends
    /// the retries.
    #[tokio::test]
    async fn until_landed_gets_stuck_on_a_full_disk_and_unstuck_when_it_lands() {
        let env = Env::real();
        let c = Count::default();
        let tries = std::cell::Cell::new(0);
        let r: Result<u32, VolumeError> = until_landed(&env, "test write", &c, || {
            tries.set(tries.get() + 1);
            let n = tries.get();
            async move {
                if n < 3 {
                    Err(full())
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.ok(), Some(3));
        assert_eq!(c.get(), (1, 1));

        let tries = std::cell::Cell::new(0);
        let r: Result<u32, VolumeError> = until_landed(&env, "test write", &c, || {
            tries.set(tries.get() + 1);
            let n = tries.get();
            let down = VolumeError::Io(IoError::Other("down".into()));
            async move {
                match n {
                    1 => Err(down),
                    _ => Err(VolumeError::Fenced { newest: 9 }),
                }
            }
        })
        .await;
        assert!(matches!(r, Err(VolumeError::Fenced { newest: 9 })));
        assert_eq!(c.get(), (1, 1), "neither a retry nor a fence gets it stuck");
    }
}
