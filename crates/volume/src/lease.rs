//! One writer per volume (design 0007; Ursa's single-client lease, seed
//! 003 §4). Opening a volume for writing takes a lease on it from the
//! metadata service: a holder, an expiry, and a fencing token above every
//! token handed out before. The lease keeps well-behaved writers apart;
//! the token keeps the volume safe from one that is not (paused, cut off,
//! slow to notice): the writer epoch this process claims is at least its
//! token (`intent::claim` via [`BlobIo::writer_floor`]), so two holders
//! never claim the same epoch, and the tractservers refuse the older
//! one's changes once the newer one has claimed.
//!
//! | event | what this process does |
//! |---|---|
//! | open for writing | acquire; another's live lease is [`VolumeError::Held`], naming it and when its lease ends |
//! | open with take-over | acquire even from a live holder (the operator says it is dead) |
//! | every third of the ttl | renew; the lease is good until the renewal's *send* time plus the time left the leader reported (never longer than the ttl), so this process always believes it has less than the leader gives it |
//! | renewal unanswered (metadata service unreachable) | retried every [`RETRY`]; when the lease lapses, changes wait (like I/O on a path that is down) until a renewal is granted |
//! | renewal refused: taken over | lost: every change from then on fails ([`IoError::LeaseLost`], reported as fenced) |
//! | renewal refused: nobody holds it (the service forgot it: a single metadata server restarted) | acquired again; lost if another holder got it first |
//! | close | quiesce, then release: the next opener need not wait |
//! | crash | nothing: the lease ends after its ttl (or is taken over), and the next holder's token fences anything still in flight |

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::Notify;

use blizzard_client::{CacheReceipt, Client, LeaseStatus, VolumeLease};
use blizzard_core::reconcile::Reconciled;
use blizzard_core::BlobId;
use blizzard_env::{Env, Instant};

use crate::io::{BlobIo, IoError};
use crate::VolumeError;

/// How long a lease lasts unless renewed, by default.
pub const TTL: Duration = Duration::from_secs(10);
/// Pause between renewals that got no answer.
pub const RETRY: Duration = Duration::from_millis(250);

/// Who writes, and how it asks for the volume.
#[derive(Clone, Debug)]
pub struct Writer {
    /// `host:pid/nonce`: unique per open, so two opens in one process are
    /// two holders.
    pub holder: String,
    pub ttl: Duration,
    /// Take the volume even from a live holder.
    pub take_over: bool,
}

impl Writer {
    /// This process, with a fresh nonce, the default ttl, no take-over.
    pub fn new(env: &Env) -> Writer {
        Writer {
            holder: format!("{}:{}/{:08x}", host_name(), std::process::id(), env.random_u64() as u32),
            ttl: TTL,
            take_over: false,
        }
    }

    pub fn take_over(mut self, yes: bool) -> Writer {
        self.take_over = yes;
        self
    }
}

/// The host's name, for lease holders (a label only: never compared).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty() && s.len() <= 64)
        .unwrap_or_else(|| "localhost".into())
}

#[derive(Debug)]
struct State {
    token: u64,
    /// Changes may go out until then.
    valid_until: Instant,
    /// Why changes may never go out again.
    lost: Option<String>,
    lapsed_logged: bool,
}

/// This process's lease on one volume, kept alive by a renewal task.
pub struct Lease {
    env: Env,
    client: Client,
    blob: BlobId,
    name: String,
    writer: Writer,
    state: Mutex<State>,
    changed: Notify,
}

impl Lease {
    /// Asks for the volume; a live lease of another holder is
    /// [`VolumeError::Held`]. Starts renewing.
    pub async fn acquire(
        env: Env,
        client: Client,
        blob: BlobId,
        name: &str,
        writer: &Writer,
    ) -> Result<Arc<Lease>, VolumeError> {
        let sent = env.now();
        let l = client.acquire_volume(blob, &writer.holder, writer.ttl, writer.take_over).await?;
        let token = granted(&l, name)?;
        let lease = Arc::new(Lease {
            env: env.clone(),
            client,
            blob,
            name: name.to_string(),
            writer: writer.clone(),
            state: Mutex::new(State {
                token,
                valid_until: sent + good_for(&l, writer.ttl),
                lost: None,
                lapsed_logged: false,
            }),
            changed: Notify::new(),
        });
        tracing::info!(volume = name, holder = %writer.holder, token, "volume lease acquired");
        let weak = Arc::downgrade(&lease);
        tokio::spawn(renew_loop(env, weak, writer.ttl));
        Ok(lease)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Each critical section is a few field writes: a panic cannot
        // leave the state half-changed.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fencing token the lease was granted under.
    pub fn token(&self) -> u64 {
        self.lock().token
    }

    pub fn holder(&self) -> &str {
        &self.writer.holder
    }

    /// Returns once a change may go out: at once while the lease is good,
    /// after the next granted renewal if it lapsed, never if it is lost
    /// (the error says why).
    pub async fn wait_valid(&self) -> Result<(), IoError> {
        loop {
            let wake = self.changed.notified();
            {
                let mut st = self.lock();
                if let Some(why) = &st.lost {
                    return Err(IoError::LeaseLost(why.clone()));
                }
                if self.env.now() < st.valid_until {
                    return Ok(());
                }
                if !st.lapsed_logged {
                    st.lapsed_logged = true;
                    tracing::warn!(volume = %self.name, "the volume's lease lapsed (the metadata service did not answer its renewals): writes wait until it is renewed");
                }
            }
            wake.await;
        }
    }

    fn lose(&self, why: String) {
        tracing::error!(volume = %self.name, "{why}");
        self.lock().lost.get_or_insert(why);
        self.changed.notify_waiters();
    }

    /// Gives the lease up: no change goes out from this process after.
    pub async fn release(&self) -> Result<(), VolumeError> {
        let token = {
            let mut st = self.lock();
            st.lost.get_or_insert_with(|| "this process closed the volume".into());
            st.token
        };
        self.changed.notify_waiters();
        self.client.release_volume(self.blob, token).await?;
        tracing::info!(volume = %self.name, token, "volume lease released");
        Ok(())
    }

    /// One renewal: what it did to the state. `Err` if unanswered.
    async fn renew_once(&self) -> Result<(), VolumeError> {
        let token = self.token();
        let ttl = self.writer.ttl;
        let sent = self.env.now();
        let l = self.client.renew_volume(self.blob, &self.writer.holder, token, ttl, ttl / 3).await?;
        match l.status {
            LeaseStatus::Granted => self.extend(sent, &l, l.token),
            LeaseStatus::Lost if l.holder.is_empty() => {
                // Forgotten, not taken: ask again, as any opener would.
                let sent = self.env.now();
                let again = self.client.acquire_volume(self.blob, &self.writer.holder, ttl, false).await?;
                match granted(&again, &self.name) {
                    Ok(t) => self.extend(sent, &again, t),
                    Err(e) => self.lose(format!("lost the lease on volume {:?}: {e}", self.name)),
                }
            }
            _ => self.lose(format!(
                "lost the lease on volume {:?}: {} took it over; this process's writes are refused from now on: stop using the volume here",
                self.name,
                if l.holder.is_empty() { "another process" } else { l.holder.as_str() }
            )),
        }
        Ok(())
    }

    fn extend(&self, sent: Instant, l: &VolumeLease, token: u64) {
        let mut st = self.lock();
        if st.lost.is_some() {
            return;
        }
        st.token = token;
        st.valid_until = st.valid_until.max(sent + good_for(l, self.writer.ttl));
        if st.lapsed_logged {
            st.lapsed_logged = false;
            tracing::info!(volume = %self.name, "the volume's lease is renewed: writes resume");
        }
        drop(st);
        self.changed.notify_waiters();
    }
}

/// The token of a grant, or why it was not one.
fn granted(l: &VolumeLease, name: &str) -> Result<u64, VolumeError> {
    match l.status {
        LeaseStatus::Granted => Ok(l.token),
        LeaseStatus::Held | LeaseStatus::Lost => Err(VolumeError::Held {
            name: name.to_string(),
            holder: l.holder.clone(),
            remaining: Duration::from_millis(l.remaining_ms),
        }),
        LeaseStatus::Full => Err(VolumeError::Invalid(
            "the metadata service holds as many volume leases as it may; close volumes that are not in use"
                .into(),
        )),
    }
}

/// How long a grant is good for, counted from when its request was sent.
fn good_for(l: &VolumeLease, ttl: Duration) -> Duration {
    Duration::from_millis(l.remaining_ms).min(ttl)
}

async fn renew_loop(env: Env, lease: Weak<Lease>, ttl: Duration) {
    let mut wait = ttl / 3;
    loop {
        env.sleep(wait).await;
        let Some(l) = lease.upgrade() else { return };
        if l.lock().lost.is_some() {
            return;
        }
        wait = match l.renew_once().await {
            Ok(()) => ttl / 3,
            Err(e) => {
                tracing::warn!(volume = %l.name, error = %e, "could not renew the volume's lease; retrying");
                RETRY
            }
        };
    }
}

/// A blob whose changes go out only while this process holds the
/// volume's lease ([`Lease::wait_valid`]). Reads need no lease.
pub struct Leased {
    inner: Arc<dyn BlobIo>,
    lease: Arc<Lease>,
}

impl Leased {
    pub fn new(inner: Arc<dyn BlobIo>, lease: Arc<Lease>) -> Arc<Leased> {
        Arc::new(Leased { inner, lease })
    }

    /// Runs `f` once the lease allows a change.
    fn guarded<T: Send + 'static>(
        &self,
        f: BoxFuture<'static, Result<T, IoError>>,
    ) -> BoxFuture<'static, Result<T, IoError>> {
        let lease = self.lease.clone();
        async move {
            lease.wait_valid().await?;
            f.await
        }
        .boxed()
    }
}

impl BlobIo for Leased {
    fn tract_size(&self) -> u32 {
        self.inner.tract_size()
    }
    fn replication(&self) -> u8 {
        self.inner.replication()
    }
    fn size_tracts(&self) -> u64 {
        self.inner.size_tracts()
    }
    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        self.guarded(self.inner.extend_to(tracts))
    }
    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        self.guarded(self.inner.write(tract, offset, data))
    }
    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        self.inner.read(tract, offset, len)
    }
    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        self.inner.read_replicas(tract, offset, len)
    }
    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        self.guarded(self.inner.trim(tract, offset, len))
    }
    fn mapped(&self, tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        self.inner.mapped(tract)
    }
    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        self.guarded(self.inner.write_cached(tract, offset, data))
    }
    fn sync(&self, receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        self.guarded(self.inner.sync(receipt))
    }
    fn set_writer(&self, epoch: u64) {
        self.inner.set_writer(epoch)
    }
    fn writer_floor(&self) -> u64 {
        self.lease.token()
    }
    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        self.guarded(self.inner.reconcile(tract))
    }
    fn release(&self) -> BoxFuture<'static, Result<(), IoError>> {
        let lease = self.lease.clone();
        async move { lease.release().await.map_err(|e| IoError::Other(e.to_string())) }.boxed()
    }
}
