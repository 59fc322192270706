//! Who may ask what of a runtime member (design 0010, point 2), checked
//! on connections TLS authenticated (`blizzard_rpc::authz`).
//!
//! | request | a member (`meta`) | anyone else the CA certified |
//! |---|---|---|
//! | `Append`, `Vote`, `Snapshot` (Raft between members) | yes | **no** |
//! | `Status` | yes | yes |
//! | `Submit`, `Read`, on a group serving its own clients (`blizzard kv serve`) | yes | yes |
//! | `Submit`, `Read`, on a group hosted by a server (the metadata service) | yes | **no**: its clients speak the host's protocol, whose own table applies |
//!
//! A member's certificate has the role `meta`: the metadata service's
//! replicas, and the members of any runtime group.

use blizzard_proto::authz::META;

use crate::proto::Request;

/// A group serving its own clients: Raft only between members.
pub fn allows_own(role: &str, req: &Request) -> bool {
    match req {
        Request::Append { .. } | Request::Vote { .. } | Request::Snapshot { .. } => role == META,
        Request::Submit { .. } | Request::Read | Request::Status => true,
    }
}

/// A group hosted by a server: everything but `Status` between members.
pub fn allows_hosted(role: &str, req: &Request) -> bool {
    matches!(req, Request::Status) || role == META
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Vote;

    fn vote() -> Request {
        Request::Vote { cluster: 1, vote: Vote::new(1, 1), last: None, transfer: false, pre: true }
    }

    #[test]
    fn only_members_speak_raft_and_hosted_groups_take_no_client_ops() {
        let submit = Request::Submit { heads: Vec::new() };
        for role in ["client", "nbd", "tractserver", ""] {
            assert!(!allows_own(role, &vote()), "{role} voted");
            assert!(!allows_hosted(role, &vote()), "{role} voted");
            assert!(allows_own(role, &submit), "a client of a kv group");
            assert!(!allows_hosted(role, &submit), "{role} submitted to the metadata group");
            assert!(!allows_hosted(role, &Request::Read));
            assert!(allows_hosted(role, &Request::Status) && allows_own(role, &Request::Status));
        }
        assert!(allows_own(META, &vote()) && allows_hosted(META, &vote()) && allows_hosted(META, &submit));
    }
}
