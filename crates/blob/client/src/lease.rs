//! Volume leases (design 0007): one writer per volume; and access lists
//! and revocations (design 0010). The metadata service's leader grants,
//! renews and frees leases and changes the lists; these calls find it
//! (`MetaService`) and retry what is worth retrying until their deadline:
//! a leader still taking over answers `NotReady`, an election no answer.
//! Acquire and renew are idempotent for their holder, release for its
//! token, so a retried request whose first answer was lost does no harm.

use std::time::Duration;

use blizzard_core::BlobId;
use blizzard_proto::scope::{Scope, ScopeEntry};
use blizzard_proto::{ErrorCode, Reply, Request, VolumeLease};
use blizzard_rpc::RpcError;

use crate::client::{Client, ClientError};

const PAUSE_MIN: Duration = Duration::from_millis(20);
const PAUSE_MAX: Duration = Duration::from_millis(500);

impl Client {
    /// Asks for the volume `blob` for writing, for `ttl`, as `holder`;
    /// `take_over` even from another live holder. The answer says whether
    /// it was granted, and otherwise who holds it and for how long.
    pub async fn acquire_volume(
        &self,
        blob: BlobId,
        holder: &str,
        ttl: Duration,
        take_over: bool,
    ) -> Result<VolumeLease, ClientError> {
        let req = Request::AcquireVolume { blob, holder: holder.to_string(), ttl_ms: ms(ttl), take_over };
        self.lease_reply(self.lease_call(&req, self.inner.cfg.request_timeout).await?)
    }

    /// Extends `holder`'s lease on `blob` (taken under `token`) by `ttl`;
    /// gives up after `deadline`.
    pub async fn renew_volume(
        &self,
        blob: BlobId,
        holder: &str,
        token: u64,
        ttl: Duration,
        deadline: Duration,
    ) -> Result<VolumeLease, ClientError> {
        let req = Request::RenewVolume { blob, holder: holder.to_string(), token, ttl_ms: ms(ttl) };
        self.lease_reply(self.lease_call(&req, deadline).await?)
    }

    /// Frees the lease on `blob` if `token` still holds it.
    pub async fn release_volume(&self, blob: BlobId, token: u64) -> Result<(), ClientError> {
        match self.lease_call(&Request::ReleaseVolume { blob, token }, self.inner.cfg.request_timeout).await?
        {
            Reply::Done => Ok(()),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Replaces the access list of volume `name` (its blob `blob`): who
    /// may use it (design 0010; an `admin` certificate).
    pub async fn set_volume_access(
        &self,
        blob: BlobId,
        name: &str,
        entries: Vec<ScopeEntry>,
    ) -> Result<(), ClientError> {
        let req = Request::SetVolumeAccess { blob, name: name.to_string(), entries };
        self.done(self.lease_call(&req, self.inner.cfg.request_timeout).await?)
    }

    /// Forgets the access list of volume `blob` (it was deleted).
    pub async fn drop_volume(&self, blob: BlobId) -> Result<(), ClientError> {
        self.done(self.lease_call(&Request::DropVolume { blob }, self.inner.cfg.request_timeout).await?)
    }

    /// Revokes the certificate with serial number `serial` (lower-case
    /// hex), issued to `name`, across the cluster.
    pub async fn revoke(&self, serial: &str, name: &str) -> Result<(), ClientError> {
        let req = Request::Revoke { serial: serial.to_string(), name: name.to_string() };
        self.done(self.lease_call(&req, self.inner.cfg.request_timeout).await?)
    }

    /// Registers this process's certificate as a reader of volume `blob`
    /// (an NBD server serving it read-only, without its lease). `false`
    /// where the cluster has nothing to register: a certificate that is
    /// not an NBD server's or an admin's (its access list decides), or
    /// none.
    pub async fn attach_reader(&self, blob: BlobId) -> Result<bool, ClientError> {
        match self.lease_call(&Request::AttachReader { blob }, self.inner.cfg.request_timeout).await {
            Ok(Reply::Done) => Ok(true),
            Ok(other) => Err(self.unexpected(&other)),
            Err(ClientError::Forbidden(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The scope table the cluster enforces, if newer than `have_version`;
    /// gives up after `deadline`.
    pub async fn scope(&self, have_version: u64, deadline: Duration) -> Result<Option<Scope>, ClientError> {
        match self.lease_call(&Request::GetScope { have_version }, deadline).await? {
            Reply::Scope(s) => Ok(s),
            other => Err(self.unexpected(&other)),
        }
    }

    fn done(&self, reply: Reply) -> Result<(), ClientError> {
        match reply {
            Reply::Done => Ok(()),
            other => Err(self.unexpected(&other)),
        }
    }

    fn lease_reply(&self, reply: Reply) -> Result<VolumeLease, ClientError> {
        match reply {
            Reply::VolumeLease(l) => Ok(l),
            other => Err(self.unexpected(&other)),
        }
    }

    fn unexpected(&self, reply: &Reply) -> ClientError {
        ClientError::Meta {
            addr: self.inner.cfg.meta.clone(),
            message: format!("unexpected reply: {reply:?}"),
        }
    }

    /// One lease request, retried through elections and takeovers until
    /// `deadline`.
    async fn lease_call(&self, req: &Request, deadline: Duration) -> Result<Reply, ClientError> {
        let env = &self.inner.env;
        let end = env.now() + deadline;
        let mut pause = PAUSE_MIN;
        loop {
            let left = end.saturating_duration_since(env.now());
            let err = match self.inner.meta.call(req, left).await {
                Ok((reply, _, _)) => return Ok(reply),
                Err(e) => e,
            };
            let transient = match &err {
                RpcError::Remote { reply, .. } => {
                    reply.code.is_transient() && reply.code != ErrorCode::NotOwner
                }
                _ => true,
            };
            if let RpcError::Remote { reply, .. } = &err {
                if reply.code == ErrorCode::Forbidden {
                    return Err(ClientError::Forbidden(reply.message.clone()));
                }
            }
            if !transient || env.now() + pause >= end {
                return Err(ClientError::Meta {
                    addr: self.inner.cfg.meta.clone(),
                    message: err.to_string(),
                });
            }
            env.sleep(pause).await;
            pause = (pause * 2).min(PAUSE_MAX);
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
