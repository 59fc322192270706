//! Who may ask what of the blob store's servers (design 0010, point 2).
//!
//! On an authenticated cluster every connection between blizzard processes
//! is mutual TLS, and the peer's certificate names its role
//! (`blizzard-role:ROLE`). A server checks the role against these tables
//! before it runs a request (`blizzard_rpc::authz`); a connection no TLS
//! authenticated (in-process, the simulator, a cluster run `--insecure`)
//! is not checked here.
//!
//! | request | `client`, `nbd` | `tractserver` | `meta` |
//! |---|---|---|---|
//! | `Ping`, `Hello` | yes | yes | yes |
//! | tract reads and writes, digests, syncs, forwarded writes | yes | yes (forwarding, repair) | yes |
//! | blob create, extend, delete, get, list | yes | yes | yes |
//! | row copies (`ListRowTracts`, `CopyTract`, `CopyTractChanges`) | **no** | yes | yes |
//! | blob metadata two-phase commit (`MetaPrepare`/`Commit`/`Abort`) | **no** | yes | yes |
//! | `AssignRows` (changes a tractserver's rows) | **no** | **no** | yes |
//! | `Heartbeat` (registers and reports a tractserver) | **no** | yes | yes |
//! | `GetTlt`, `ClusterStatus`, `ClusterParams` | yes | yes | yes |
//! | volume leases (`Acquire`/`Renew`/`ReleaseVolume`) | yes | **no** | yes |
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

/// Whether a peer of `role` may send `req` to a tractserver or the
/// metadata service.
pub fn allows(role: &str, req: &Request) -> bool {
    use Request::*;
    let client = role == CLIENT || role == NBD;
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
        | CreateBlob { .. }
        | ExtendBlob { .. }
        | DeleteBlob { .. }
        | GetBlob { .. }
        | ListBlobs
        | GetTlt { .. }
        | ClusterStatus
        | ClusterParams => client || ts,
        ListRowTracts { .. }
        | CopyTract { .. }
        | CopyTractChanges { .. }
        | MetaPrepare { .. }
        | MetaCommit { .. }
        | MetaAbort { .. }
        | Heartbeat(_) => ts,
        AssignRows { .. } => false,
        AcquireVolume { .. } | RenewVolume { .. } | ReleaseVolume { .. } => client,
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
        match role {
            CLIENT | NBD => [&copies[..], &[Heartbeat, AssignRows]].concat(),
            TRACTSERVER => vec![AssignRows, AcquireVolume, RenewVolume, ReleaseVolume],
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
        assert!(kinds.len() >= 31, "samples cover {} kinds", kinds.len());
        for role in [CLIENT, NBD, TRACTSERVER, META, "", "admin"] {
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
                assert!(!allows(CLIENT, &r) && !allows(NBD, &r));
            }
        }
    }
}
