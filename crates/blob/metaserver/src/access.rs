//! The metadata service's side of access control (design 0010, issue 56):
//! the requests that change the scope table and hand it out, and the
//! table it enforces on the requests it serves itself (leases).
//!
//! | request | who (`authz`) | answered by | does |
//! |---|---|---|---|
//! | `SetVolumeAccess`, `DropVolume`, `Revoke` | `admin` | the leader, once it has taken over | proposes the change (`scope`); a single server saves it first (`scope_store`) or, without `--data`, refuses a list or a revocation |
//! | `GetScope` | `nbd`, `admin`, `tractserver` | any replica, from its applied state | the table, if newer than the caller's |
//! | `AttachReader` | `nbd`, `admin` | the leader | the caller's certificate reads the volume from then on (an NBD server serving it read-only) |
//! | a lease | `client` (read-write on the volume), `nbd`, `admin` | the leader (`volumes`) | the certificate it came with serves the volume while the lease lasts |
//!
//! The table a replica enforces is its applied state's, kept as one
//! shared copy per version ([`MetaServer::scope_table`]); its
//! revocations also close the connections of the certificates they name
//! (`blizzard_rpc::authz::Revocations`, brought up to date by every tick).

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;

use blizzard_proto::scope::Scope;
use blizzard_proto::{ErrorCode, ErrorReply, Reply, Request};
use blizzard_rpc::authz::{Revocations, ScopeSource};

use crate::machine::{MetaOp, MetaReply};
use crate::replica::ReplicaError;
use crate::server::{lock, MetaServer};

/// The shared copy of one version of the table.
#[derive(Default)]
pub(crate) struct ScopeCache {
    pub(crate) table: std::sync::Mutex<Arc<Scope>>,
    pub(crate) revocations: Arc<Revocations>,
}

impl MetaServer {
    /// The scope table this replica has applied.
    pub fn scope_table(&self) -> Arc<Scope> {
        let version = self.replica.read(|s| s.scope.version);
        let mut cur = lock(&self.scope.table);
        if cur.version != version {
            let table = Arc::new(self.replica.read(|s| s.scope.clone()));
            self.scope.revocations.adopt(table.revoked.keys());
            *cur = table;
        }
        cur.clone()
    }

    /// `SetVolumeAccess`, `DropVolume`, `Revoke`, `AttachReader` from
    /// `peer` (the name on its certificate, "" for none) (module header).
    pub(crate) async fn change_scope(&self, req: Request, peer: &str) -> Result<Reply, ErrorReply> {
        self.ready_to_propose()?;
        let op = match req {
            // Without a certificate there is nobody to register.
            Request::AttachReader { .. } if peer.is_empty() => return Ok(Reply::Done),
            Request::AttachReader { blob } => MetaOp::AttachReader { blob, peer: peer.to_string() },
            Request::SetVolumeAccess { blob, name, entries } => MetaOp::SetAccess { blob, name, entries },
            Request::DropVolume { blob } => MetaOp::DropVolume { blob },
            Request::Revoke { serial, name } => {
                tracing::warn!(%serial, %name, "certificate revoked: it is refused everywhere from now on");
                MetaOp::Revoke { serial, name }
            }
            other => {
                return Err(ErrorReply::new(
                    ErrorCode::BadRequest,
                    format!("{:?} changes no scope", other.opcode()),
                ))
            }
        };
        match self.replica.propose(&op).await {
            Ok(MetaReply::Done) => Ok(Reply::Done),
            Ok(MetaReply::Refused(why)) => Err(ErrorReply::new(ErrorCode::BadRequest, why)),
            Ok(other) => Err(ErrorReply::new(ErrorCode::Internal, format!("unexpected outcome {other:?}"))),
            Err(ReplicaError::NotLeader(_)) => Err(self.not_leader()),
            Err(ReplicaError::Refused(why)) => Err(ErrorReply::new(ErrorCode::BadRequest, why)),
        }
    }

    /// `GetScope`: the table, if the caller's is older.
    pub(crate) fn get_scope(&self, have_version: u64) -> Reply {
        let t = self.scope_table();
        Reply::Scope((t.version > have_version).then(|| (*t).clone()))
    }
}

impl ScopeSource for MetaServer {
    fn current(&self) -> Arc<Scope> {
        self.scope_table()
    }

    fn refresh(self: Arc<Self>) -> BoxFuture<'static, ()> {
        // The table here is the applied state itself: nothing to fetch.
        futures::future::ready(()).boxed()
    }

    fn revocations(&self) -> Arc<Revocations> {
        self.scope.revocations.clone()
    }
}
