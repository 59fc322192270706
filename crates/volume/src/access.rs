//! Who may use a volume (issue 26, point 3; design 0010): a list of client
//! identities, each read-write or read-only, kept in the volume's
//! superblock. The identity is the common name of a client certificate the
//! cluster's CA signed, as the NBD server verified it over TLS.
//!
//! | list | client | may |
//! |---|---|---|
//! | empty | anyone, TLS or not | read and write (the default: as before lists existed) |
//! | not empty | a verified identity in it | what its entry says |
//! | not empty | a verified identity not in it, or no identity (plain, or TLS without a certificate) | nothing: the export is not listed, opening it is refused |
//!
//! Pure: the NBD server asks [`check`], the `volume access` command
//! [`apply`].

/// Most entries one volume's list holds (they live in the superblock copy
/// with everything else).
pub const ACCESS_ENTRIES_MAX: usize = 16;
/// Longest identity (a certificate common name is at most 64).
pub const IDENTITY_LEN_MAX: usize = 64;

/// One entry of a volume's access list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessEntry {
    pub identity: String,
    pub read_only: bool,
}

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

/// An identity a list can hold: 1 to 64 bytes, printable, no spaces
/// around it.
pub fn check_identity(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > IDENTITY_LEN_MAX {
        return Err(format!("an identity is 1 to {IDENTITY_LEN_MAX} bytes (a certificate's common name)"));
    }
    if id.trim() != id || id.chars().any(char::is_control) {
        return Err(format!("identity {id:?} has control characters or surrounding spaces"));
    }
    Ok(())
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
