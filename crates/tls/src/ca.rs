//! Certificates: a CA (`blizzard ca init`), certificates it issues for a
//! role (`blizzard ca issue`), and the set `blizzard up` makes for itself.
//!
//! A certificate states its holder's name (subject common name) and role
//! (organizational unit `blizzard-role:ROLE`, see `identity`). Keys are
//! ECDSA P-256, written mode 0600. Lifetimes: the CA ten years, the
//! certificates it issues two years (`up` reissues its own server
//! certificate when less than 30 days are left).

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::identity::ROLE_PREFIX;
use crate::{TlsError, CA_CERT, CA_KEY, CLIENT_CERT, CLIENT_KEY, SERVER_CERT, SERVER_KEY};

const DAY: Duration = Duration::from_secs(86_400);
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 86_400);
const LEAF_LIFETIME: Duration = Duration::from_secs(2 * 365 * 86_400);
/// `up` reissues its server certificate when less than this is left.
const RENEW_BEFORE: Duration = Duration::from_secs(30 * 86_400);

/// What a certificate's holder may do in a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// An NBD server (`blizzard nbd`, `blizzard up`): a server certificate.
    Nbd,
    Tractserver,
    Meta,
    /// A client: NBD clients, and the blob store's clients, each limited
    /// to the volumes whose access lists name it.
    Client,
    /// An operator: creates, deletes and resizes volumes, changes access
    /// lists, revokes certificates. A client certificate (it only dials).
    Admin,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Nbd, Role::Tractserver, Role::Meta, Role::Client, Role::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Role::Nbd => "nbd",
            Role::Tractserver => "tractserver",
            Role::Meta => "meta",
            Role::Client => "client",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == s)
    }

    /// Servers get `server-cert.pem`/`server-key.pem` and both extended
    /// key usages (cluster servers also dial each other); clients get
    /// `client-*.pem` and client authentication only.
    pub fn is_server(self) -> bool {
        !matches!(self, Role::Client | Role::Admin)
    }
}

/// A certificate to issue.
#[derive(Clone, Debug)]
pub struct Issue {
    /// The holder's name (subject common name): what access lists name.
    pub name: String,
    pub role: Role,
    /// Host names and addresses a server is reached at (subject alternative
    /// names; clients check them). Ignored for clients.
    pub hosts: Vec<String>,
}

fn time(t: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(t)
}

fn err(what: &str, e: impl std::fmt::Display) -> TlsError {
    TlsError::new(format!("{what}: {e}"))
}

/// Writes `bytes` to `path`, which must not exist; mode 0600 for keys.
#[allow(clippy::disallowed_methods)] // certificate files are configuration, not disks: the simulator never makes them
fn write_new(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mode = if secret { 0o600 } else { 0o644 };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| err(&format!("cannot create {}", path.display()), e))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| err(&format!("writing {}", path.display()), e))
}

/// Replaces `path` with `bytes` (through a temporary file and a rename).
fn replace(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    let tmp = path.with_extension("pem.new");
    let _ = std::fs::remove_file(&tmp);
    write_new(&tmp, bytes, secret)?;
    std::fs::rename(&tmp, path).map_err(|e| err(&format!("cannot replace {}", path.display()), e))
}

fn refuse_existing(paths: &[PathBuf]) -> Result<(), TlsError> {
    if let Some(p) = paths.iter().find(|p| p.exists()) {
        return Err(TlsError::new(format!(
            "{} exists already: nothing was written (remove it first to replace it)",
            p.display()
        )));
    }
    Ok(())
}

fn ca_params(name: &str, now: SystemTime) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(|e| err("CA parameters", e))?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, name);
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p.not_before = time(now - DAY);
    p.not_after = time(now + CA_LIFETIME);
    Ok(p)
}

/// Makes a new CA in `dir` (created if missing): `ca-cert.pem` and
/// `ca-key.pem`. Refuses to overwrite an existing one.
pub fn init_ca(dir: &Path, name: &str, now: SystemTime) -> Result<(), TlsError> {
    std::fs::create_dir_all(dir).map_err(|e| err(&format!("cannot create {}", dir.display()), e))?;
    refuse_existing(&[dir.join(CA_CERT), dir.join(CA_KEY)])?;
    let key = KeyPair::generate().map_err(|e| err("generating the CA key", e))?;
    let cert = ca_params(name, now)?.self_signed(&key).map_err(|e| err("signing the CA certificate", e))?;
    write_new(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), true)?;
    write_new(&dir.join(CA_CERT), cert.pem().as_bytes(), false)
}

/// The CA in `ca_dir`, ready to sign.
fn load_issuer(ca_dir: &Path) -> Result<(Issuer<'static, KeyPair>, String), TlsError> {
    let read = |f: &str| {
        let p = ca_dir.join(f);
        std::fs::read_to_string(&p).map_err(|e| {
            err(&format!("cannot read {} (a CA directory made by `blizzard ca init`)", p.display()), e)
        })
    };
    let (cert_pem, key_pem) = (read(CA_CERT)?, read(CA_KEY)?);
    let key =
        KeyPair::from_pem(&key_pem).map_err(|e| err(&format!("{}", ca_dir.join(CA_KEY).display()), e))?;
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
        .map_err(|e| err(&format!("{}", ca_dir.join(CA_CERT).display()), e))?;
    Ok((issuer, cert_pem))
}

fn leaf_params(req: &Issue, now: SystemTime) -> Result<CertificateParams, TlsError> {
    if req.name.is_empty() || req.name.len() > 64 {
        return Err(TlsError::new("a certificate's name must be 1 to 64 characters"));
    }
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(|e| err("certificate parameters", e))?;
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, req.name.as_str());
    p.distinguished_name.push(DnType::OrganizationalUnitName, format!("{ROLE_PREFIX}{}", req.role.name()));
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    if req.role.is_server() {
        p.extended_key_usages.push(ExtendedKeyUsagePurpose::ServerAuth);
        for h in &req.hosts {
            let san = match h.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => {
                    SanType::DnsName(h.clone().try_into().map_err(|e| err(&format!("host name {h:?}"), e))?)
                }
            };
            p.subject_alt_names.push(san);
        }
    }
    p.not_before = time(now - DAY);
    p.not_after = time(now + LEAF_LIFETIME);
    p.use_authority_key_identifier_extension = true;
    Ok(p)
}

/// The certificate and key files of a role.
fn leaf_files(role: Role) -> (&'static str, &'static str) {
    if role.is_server() {
        (SERVER_CERT, SERVER_KEY)
    } else {
        (CLIENT_CERT, CLIENT_KEY)
    }
}

/// Issues a certificate from the CA in `ca_dir` into `out` (created if
/// missing): the CA's certificate as `ca-cert.pem`, and
/// `server-cert.pem`/`server-key.pem` for a server role or
/// `client-cert.pem`/`client-key.pem` for a client: a directory qemu,
/// nbdkit, libnbd and blizzard read as it is. Refuses to overwrite.
pub fn issue(ca_dir: &Path, req: &Issue, out: &Path, now: SystemTime) -> Result<(), TlsError> {
    let (issuer, ca_pem) = load_issuer(ca_dir)?;
    let (cert_file, key_file) = leaf_files(req.role);
    std::fs::create_dir_all(out).map_err(|e| err(&format!("cannot create {}", out.display()), e))?;
    let same_dir = out.canonicalize().ok() == ca_dir.canonicalize().ok();
    let mut files = vec![out.join(cert_file), out.join(key_file)];
    if !same_dir {
        files.push(out.join(CA_CERT));
    }
    refuse_existing(&files)?;
    let key = KeyPair::generate().map_err(|e| err("generating a key", e))?;
    let cert =
        leaf_params(req, now)?.signed_by(&key, &issuer).map_err(|e| err("signing the certificate", e))?;
    write_new(&out.join(key_file), key.serialize_pem().as_bytes(), true)?;
    write_new(&out.join(cert_file), cert.pem().as_bytes(), false)?;
    if !same_dir {
        write_new(&out.join(CA_CERT), ca_pem.as_bytes(), false)?;
    }
    Ok(())
}

/// What `blizzard up` made or found under its data directory.
#[derive(Clone, Debug)]
pub struct UpCredentials {
    /// The server's directory (`DATA/tls`): the CA (certificate and key)
    /// and the NBD server's certificate.
    pub server_dir: PathBuf,
    /// The client's directory (`DATA/tls/client`): what libnbd and qemu
    /// read (`ca-cert.pem`, `client-cert.pem`, `client-key.pem`).
    pub client_dir: PathBuf,
    /// True if anything was made on this start.
    pub made: bool,
}

/// `blizzard up`'s certificates under `dir` (`DATA/tls`): on first start a
/// CA, a server certificate for `hosts` and a client certificate; later
/// starts reuse them, reissuing the server certificate when it has less
/// than 30 days left or does not name every host in `hosts`.
pub fn ensure_up_credentials(
    dir: &Path,
    hosts: &[String],
    now: SystemTime,
) -> Result<UpCredentials, TlsError> {
    let client_dir = dir.join("client");
    let mut made = false;
    if !dir.join(CA_KEY).exists() {
        init_ca(dir, "blizzard up CA", now)?;
        made = true;
    }
    let server = Issue { name: "blizzard-up".into(), role: Role::Nbd, hosts: hosts.to_vec() };
    let cert_path = dir.join(SERVER_CERT);
    if !cert_path.exists() || server_cert_stale(&cert_path, hosts, now) {
        let (issuer, _) = load_issuer(dir)?;
        let key = KeyPair::generate().map_err(|e| err("generating a key", e))?;
        let cert = leaf_params(&server, now)?
            .signed_by(&key, &issuer)
            .map_err(|e| err("signing the certificate", e))?;
        replace(&dir.join(SERVER_KEY), key.serialize_pem().as_bytes(), true)?;
        replace(&cert_path, cert.pem().as_bytes(), false)?;
        made = true;
    }
    if !client_dir.join(CLIENT_CERT).exists() {
        let _ = std::fs::remove_dir_all(&client_dir);
        // The operator's own: an NBD client and the volume commands' admin.
        let client = Issue { name: "blizzard-up-client".into(), role: Role::Admin, hosts: Vec::new() };
        issue(dir, &client, &client_dir, now)?;
        made = true;
    }
    Ok(UpCredentials { server_dir: dir.to_path_buf(), client_dir, made })
}

/// True if the certificate at `path` runs out within `RENEW_BEFORE` of
/// `now`, does not parse, or leaves out one of `hosts`.
fn server_cert_stale(path: &Path, hosts: &[String], now: SystemTime) -> bool {
    use x509_parser::prelude::*;
    let Ok(pem) = std::fs::read(path) else { return true };
    let Ok((_, pem)) = x509_parser::pem::parse_x509_pem(&pem) else { return true };
    let Ok(x) = pem.parse_x509() else { return true };
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    if x.validity().not_after.timestamp() - secs < RENEW_BEFORE.as_secs() as i64 {
        return true;
    }
    let Ok(Some(san)) = x.subject_alternative_name() else { return !hosts.is_empty() };
    let names: Vec<String> = san
        .value
        .general_names
        .iter()
        .filter_map(|g| match g {
            GeneralName::DNSName(d) => Some(d.to_string()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => Some(IpAddr::from(<[u8; 4]>::try_from(*b).ok()?).to_string()),
                16 => Some(IpAddr::from(<[u8; 16]>::try_from(*b).ok()?).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect();
    hosts.iter().any(|h| {
        !names.iter().any(|n| {
            n == h || h.parse::<IpAddr>().ok() == n.parse::<IpAddr>().ok() && h.parse::<IpAddr>().is_ok()
        })
    })
}
