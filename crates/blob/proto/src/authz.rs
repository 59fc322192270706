//! Who may ask what of the blob store's servers (design 0010, point 2).
//!
//! On an authenticated cluster every connection between blizzard processes
//! is mutual TLS, and the peer's certificate names its role
//! (`blizzard-role:ROLE`). A server checks the role against these tables
//! before it runs a request (`blizzard_rpc::authz`); a connection no TLS
//! authenticated (in-process, the simulator, a cluster run `--insecure`)
//! is not checked here.
//!
//! | request | `client` | `nbd` | `admin` | `tractserver` | `meta` |
//! |---|---|---|---|---|---|
//! | `Ping`, `Hello` | yes | yes | yes | yes | yes |
//! | tract reads and writes, digests, syncs, forwarded writes | yes¹ | yes¹ | yes | yes (forwarding, repair) | yes |
//! | blob get, list | yes¹ | yes¹ | yes | yes | yes |
//! | blob create, delete | **no** | **no** | yes | yes | yes |
//! | blob extend (a resize) | **no** | yes¹ | yes | yes | yes |
//! | row copies (`ListRowTracts`, `CopyTract`, `CopyTractChanges`) | **no** | **no** | **no** | yes | yes |
//! | blob metadata two-phase commit (`MetaPrepare`/`Commit`/`Abort`) | **no** | **no** | **no** | yes | yes |
//! | `AssignRows` (changes a tractserver's rows) | **no** | **no** | **no** | **no** | yes |
//! | `Heartbeat` (registers and reports a tractserver) | **no** | **no** | **no** | yes | yes |
//! | `GetTlt`, `ClusterStatus`, `ClusterParams` | yes | yes | yes | yes | yes |
//! | volume leases (`Acquire`/`Renew`/`ReleaseVolume`) | yes¹ | yes¹ | yes | **no** | yes |
//! | `AttachReader` (serving a volume read-only) | **no** | yes | yes | **no** | yes |
//! | access lists, revocations (`SetVolumeAccess`, `DropVolume`, `Revoke`) | **no** | **no** | yes | **no** | yes |
//! | the scope table (`GetScope`) | **no** | yes | yes | yes | yes |
//!
//! ¹ Only on the volumes the certificate's scope allows (`scope::check`).
//!
//! Any role not in the table (a certificate from the CA naming none) may
//! only ping and say hello. `meta` may ask anything: the metadata service directs the
//! cluster, and its replicas forward clients' requests to their leader.

use crate::Request;

/// Roles, as certificates name them (`blizzard_tls::Role`).
pub const CLIENT: &str = "client";
pub const NBD: &str = "nbd";
pub const TRACTSERVER: &str = "tractserver";
pub const META: &str = "meta";
/// An operator: creates, deletes and resizes volumes, changes access
/// lists, revokes certificates (a client certificate: it only dials).
pub const ADMIN: &str = "admin";

/// Whether a peer of `role` may send `req` to a tractserver or the
/// metadata service.
pub fn allows(role: &str, req: &Request) -> bool {
    use Request::*;
    let admin = role == ADMIN;
    let client = role == CLIENT;
    let nbd = role == NBD;
    let ts = role == TRACTSERVER;
    if role == META {
        return true;
    }
    match req {
        Ping | Hello { .. } => true,
        WriteTract { .. }
        | ReadTract { .. }
        | DeleteTract { .. }
        | TrimTract { .. }
        | MappedTract { .. }
        | DigestTract { .. }
        | WriteTractCached { .. }
        | WriteTractForward { .. }
        | WriteTracts { .. }
        | SyncDisk
        | GetBlob { .. }
        | ListBlobs
        | GetTlt { .. }
        | ClusterStatus
        | ClusterParams => client || nbd || admin || ts,
        CreateBlob { .. } | DeleteBlob { .. } => admin || ts,
        ExtendBlob { .. } => nbd || admin || ts,
        ListRowTracts { .. }
        | CopyTract { .. }
        | CopyTractChanges { .. }
        | MetaPrepare { .. }
        | MetaCommit { .. }
        | MetaAbort { .. }
        | Heartbeat(_) => ts,
        AssignRows { .. } => false,
        AcquireVolume { .. } | RenewVolume { .. } | ReleaseVolume { .. } => client || nbd || admin,
        SetVolumeAccess { .. } | DropVolume { .. } | Revoke { .. } => admin,
        GetScope { .. } => nbd || admin || ts,
        AttachReader { .. } => nbd || admin,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::tests::samples;
    use crate::Opcode::{self, *};

    /// What each role may not send, by opcode: the table in the header.
    fn refused(role: &str) -> Vec<Opcode> {
        let copies = [ListRowTracts, CopyTract, CopyTractChanges, MetaPrepare, MetaCommit, MetaAbort];
        let admin_only = [SetVolumeAccess, DropVolume, Revoke];
        match role {
            CLIENT => [
                &copies[..],
                &admin_only,
                &[Heartbeat, AssignRows, CreateBlob, DeleteBlob, ExtendBlob, GetScope, AttachReader],
            ]
            .concat(),
            NBD => [&copies[..], &admin_only, &[Heartbeat, AssignRows, CreateBlob, DeleteBlob]].concat(),
            ADMIN => [&copies[..], &[Heartbeat, AssignRows]].concat(),
            TRACTSERVER => {
                [&admin_only[..], &[AssignRows, AcquireVolume, RenewVolume, ReleaseVolume, AttachReader]]
                    .concat()
            }
            META => vec![],
            _ => samples().iter().map(|r| r.opcode()).filter(|o| !matches!(o, Ping | Hello)).collect(),
        }
    }

    #[test]
    fn every_request_of_every_role_is_as_the_table_says() {
        let all = samples();
        // The samples hold every request kind, so a new one cannot slip
        // past this table unjudged.
        let kinds: std::collections::BTreeSet<u16> = all.iter().map(|r| r.opcode() as u16).collect();
        assert_eq!(kinds.len(), Opcode::ALL.len(), "samples cover {} kinds", kinds.len());
        for role in [CLIENT, NBD, ADMIN, TRACTSERVER, META, "", "other"] {
            let no = refused(role);
            for r in &all {
                let want = !no.contains(&r.opcode());
                assert_eq!(allows(role, r), want, "{role:?} sending {:?}", r.opcode());
            }
        }
    }

    #[test]
    fn a_client_cannot_register_as_a_tractserver_or_change_rows() {
        for r in samples() {
            if matches!(r.opcode(), Heartbeat | AssignRows) {
                assert!(!allows(CLIENT, &r) && !allows(NBD, &r) && !allows(ADMIN, &r));
            }
        }
    }
}
