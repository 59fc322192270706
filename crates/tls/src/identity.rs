//! What a peer's certificate says it is. Certificates blizzard issues carry
//! the holder's name as the subject's common name and its role as an
//! organizational unit `blizzard-role:ROLE` (`ca::Role`).

use x509_parser::prelude::*;

use crate::Role;

/// The organizational unit that names a certificate's role.
pub const ROLE_PREFIX: &str = "blizzard-role:";

/// A verified peer: the name and role its certificate states.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The subject's common name (empty if it has none).
    pub name: String,
    /// The role, if the certificate names one blizzard knows.
    pub role: Option<Role>,
}

impl PeerIdentity {
    /// Reads the identity from an end-entity certificate (DER). `None` if
    /// it does not parse.
    pub fn of(der: &[u8]) -> Option<PeerIdentity> {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let subject = cert.subject();
        let name = subject.iter_common_name().find_map(|a| a.as_str().ok()).unwrap_or("").to_string();
        let role = subject
            .iter_organizational_unit()
            .filter_map(|a| a.as_str().ok())
            .find_map(|ou| ou.strip_prefix(ROLE_PREFIX).and_then(Role::parse));
        Some(PeerIdentity { name, role })
    }
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.role {
            Some(r) => write!(f, "{} ({})", self.name, r.name()),
            None => write!(f, "{}", self.name),
        }
    }
}
