//! Who may use a volume (issue 26, point 3; design 0010): a list of client
//! identities, each read-write or read-only, kept by the metadata service
//! (`blizzard_proto::scope`, which every server enforces; issue 56). A
//! volume made before that, never given a list since, has its list in
//! its superblock (format 4), which stands until an admin sets one. The
//! identity is the common name of a client certificate the cluster's CA
//! signed, as the NBD server (or a cluster server) verified it over TLS.
//!
//! | list | client | may |
//! |---|---|---|
//! | empty | anyone, TLS or not | read and write (the default: as before lists existed) |
//! | not empty | a verified identity in it | what its entry says |
//! | not empty | a verified identity not in it, or no identity (plain, or TLS without a certificate) | nothing: the export is not listed, opening it is refused |
//!
//! Pure: the NBD server asks [`check`], the `volume access` command
//! [`apply`].

pub use blizzard_proto::scope::{check_identity, ENTRIES_MAX as ACCESS_ENTRIES_MAX, IDENTITY_LEN_MAX};

/// One entry of a volume's access list.
pub use blizzard_proto::scope::ScopeEntry as AccessEntry;

/// What a client may do with a volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Denied,
    ReadOnly,
    ReadWrite,
}

/// What the list grants `identity` (`None`: a client without a verified
/// certificate).
pub fn check(list: &[AccessEntry], identity: Option<&str>) -> Access {
    if list.is_empty() {
        return Access::ReadWrite;
    }
    match identity.and_then(|id| list.iter().find(|e| e.identity == id)) {
        None => Access::Denied,
        Some(e) if e.read_only => Access::ReadOnly,
        Some(_) => Access::ReadWrite,
    }
}

/// A change to a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessChange {
    /// Adds the identity, or changes its entry.
    Allow { identity: String, read_only: bool },
    /// Removes the identity's entry (an error if it has none).
    Deny { identity: String },
}

/// The list after `change`, or why it cannot be made.
pub fn apply(list: &[AccessEntry], change: &AccessChange) -> Result<Vec<AccessEntry>, String> {
    let mut out = list.to_vec();
    match change {
        AccessChange::Allow { identity, read_only } => {
            check_identity(identity)?;
            let full = out.len() >= ACCESS_ENTRIES_MAX;
            match out.iter_mut().find(|e| &e.identity == identity) {
                Some(e) => e.read_only = *read_only,
                None if full => {
                    return Err(format!(
                    "a volume's access list holds at most {ACCESS_ENTRIES_MAX} identities: --deny one first"
                ))
                }
                None => out.push(AccessEntry { identity: identity.clone(), read_only: *read_only }),
            }
        }
        AccessChange::Deny { identity } => {
            let before = out.len();
            out.retain(|e| &e.identity != identity);
            if out.len() == before {
                return Err(format!("{identity:?} is not in the volume's access list"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(id: &str, ro: bool) -> AccessEntry {
        AccessEntry { identity: id.into(), read_only: ro }
    }

    #[test]
    fn the_table() {
        for id in [None, Some("alice"), Some("")] {
            assert_eq!(check(&[], id), Access::ReadWrite);
        }
        let list = [e("alice", false), e("bob", true)];
        assert_eq!(check(&list, Some("alice")), Access::ReadWrite);
        assert_eq!(check(&list, Some("bob")), Access::ReadOnly);
        assert_eq!(check(&list, Some("carol")), Access::Denied);
        assert_eq!(check(&list, Some("Alice")), Access::Denied);
        assert_eq!(check(&list, None), Access::Denied);
    }

    #[test]
    fn changes() {
        let allow = |id: &str, ro| AccessChange::Allow { identity: id.into(), read_only: ro };
        let l = apply(&[], &allow("alice", false)).unwrap_or_default();
        assert_eq!(l, vec![e("alice", false)]);
        let l = apply(&l, &allow("alice", true)).unwrap_or_default();
        assert_eq!(l, vec![e("alice", true)]);
        let l = apply(&l, &allow("bob", false)).unwrap_or_default();
        assert_eq!(l.len(), 2);
        let l = apply(&l, &AccessChange::Deny { identity: "alice".into() }).unwrap_or_default();
        assert_eq!(l, vec![e("bob", false)]);
        assert!(apply(&l, &AccessChange::Deny { identity: "alice".into() }).is_err());
        for bad in ["", " x", "x ", "a\nb", &"x".repeat(65)] {
            assert!(apply(&l, &allow(bad, false)).is_err(), "{bad:?}");
        }
        let mut full = Vec::new();
        for i in 0..ACCESS_ENTRIES_MAX {
            full = apply(&full, &allow(&format!("c{i}"), false)).unwrap_or_default();
        }
        assert_eq!(full.len(), ACCESS_ENTRIES_MAX);
        assert!(apply(&full, &allow("one-more", false)).is_err());
        assert!(apply(&full, &allow("c3", true)).is_ok());
    }
}
