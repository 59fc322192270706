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
    /// The certificate's serial number, lower-case hex without leading
    /// zero bytes (what `blizzard ca revoke` names).
    pub serial: String,
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
        Some(PeerIdentity { name, role, serial: serial_hex(cert.raw_serial()) })
    }
}

/// The identity of the (first) certificate in the PEM file `path`: what
/// `blizzard ca revoke` revokes.
pub fn identity_of_file(path: &std::path::Path) -> Result<PeerIdentity, crate::TlsError> {
    let chain = crate::load::certs(path)?;
    PeerIdentity::of(chain[0].as_ref())
        .ok_or_else(|| crate::TlsError::new(format!("{} does not parse as X.509", path.display())))
}

/// A certificate serial number as revocations name it: lower-case hex,
/// leading zero bytes dropped (DER adds one to keep a number positive).
pub fn serial_hex(raw: &[u8]) -> String {
    let start = raw.iter().position(|b| *b != 0).unwrap_or(raw.len().saturating_sub(1));
    raw[start..].iter().map(|b| format!("{b:02x}")).collect()
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.role {
            Some(r) => write!(f, "{} ({})", self.name, r.name()),
            None => write!(f, "{}", self.name),
        }
    }
}
