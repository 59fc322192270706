//! Which volumes a certificate may touch (design 0010, issue 56). The
//! role table (`authz`) says what kind of request a role may send; this
//! says on which volumes' blobs, for the two roles that are scoped:
//!
//! | role | may touch | how the servers know |
//! |---|---|---|
//! | `meta`, `tractserver` | every blob (row copies, repair, forwarding) | the role |
//! | `admin` | every blob: create, delete, resize, access lists, revocation | the role |
//! | `client` | the blobs of volumes whose access list names it: reads with any entry, changes (writes, trims, digests, leases) with a read-write one | the volume's entry in the [`Scope`] |
//! | `nbd` | the volumes it serves: every tract of a volume whose lease it holds, and reads of one it registered to serve read-only (`AttachReader`); of any other volume only its record (tract 0: superblock, access list) and its metadata, to list exports and check access lists before it takes a lease | the lease holder's certificate name and the readers', in the [`Scope`] |
//!
//! A certificate whose serial number the scope lists as revoked may do
//! nothing at all, whatever its role.
//!
//! The metadata service keeps the scope (access lists, the certificate
//! each lease was taken with, revocations) in its replicated state and
//! numbers its versions; tractservers learn a new version from each
//! heartbeat's reply and fetch the table then (or at once, when a request
//! is refused under the one they have: a lease taken a moment ago), so a
//! check costs no round trip. Pure: [`check`] and [`visible`] judge one
//! request against one table.
//!
//! A volume is known by its key ([`volume_key`]): its blob id without the
//! placement bits, the same for the id its name hashes to (leases) and
//! the id its blob has (tracts).

use std::collections::BTreeMap;

use blizzard_core::limits::NAME_LEN_MAX;
use blizzard_core::{BlobId, TractNo};

use crate::authz::{ADMIN, CLIENT, META, NBD, TRACTSERVER};
use crate::codec::{DecodeError, Reader, Wire, Writer};
use crate::msg::Request;

/// Most entries one volume's access list holds.
pub const ENTRIES_MAX: usize = 16;
/// Longest identity (a certificate's common name is at most 64 bytes).
pub const IDENTITY_LEN_MAX: usize = 64;
/// Longest certificate serial number, in hex (RFC 5280: 20 bytes).
pub const SERIAL_LEN_MAX: usize = 40;
/// Most NBD servers registered to read one volume.
pub const READERS_MAX: usize = 64;
/// Most volumes and revocations one table holds.
pub const VOLUMES_MAX: usize = 1 << 20;
pub const REVOKED_MAX: usize = 1 << 16;

/// The bits of a blob id that name the volume (all but the placement's).
const KEY_BITS: u32 = 112;

/// The key of the volume whose blob (or lease) is `blob`.
pub fn volume_key(blob: BlobId) -> u128 {
    blob.0 & ((1u128 << KEY_BITS) - 1)
}

/// One entry of a volume's access list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeEntry {
    pub identity: String,
    pub read_only: bool,
}
crate::wire_struct!(ScopeEntry { identity: String, read_only: bool });

/// One volume, as the servers enforce it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VolumeScope {
    /// Its name ("" for a volume only its lease made known).
    pub name: String,
    /// Who may use it (empty: only `admin`, and `nbd` while it serves it).
    pub entries: Vec<ScopeEntry>,
    /// The certificate name its lease was taken with ("" while nobody
    /// holds it, or when the holder had no certificate).
    pub server: String,
    /// NBD servers' certificate names registered to serve it read-only
    /// (`AttachReader`): they read it without its lease.
    pub readers: Vec<String>,
}

impl VolumeScope {
    /// What the list grants `identity`: `None` nothing, `Some(read_only)`.
    pub fn grant(&self, identity: &str) -> Option<bool> {
        self.entries.iter().find(|e| e.identity == identity).map(|e| e.read_only)
    }
}

/// The whole table, at one version.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    /// Raised by every change; 0 is the empty table nobody changed.
    pub version: u64,
    /// By [`volume_key`].
    pub volumes: BTreeMap<u128, VolumeScope>,
    /// Revoked certificates: serial number (lower-case hex) → name.
    pub revoked: BTreeMap<String, String>,
}

impl Scope {
    pub fn volume(&self, blob: BlobId) -> Option<&VolumeScope> {
        self.volumes.get(&volume_key(blob))
    }

    pub fn is_revoked(&self, serial: &str) -> bool {
        !serial.is_empty() && self.revoked.contains_key(serial)
    }
}

/// An identity a list can hold: 1 to 64 bytes, no control characters or
/// surrounding spaces.
pub fn check_identity(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > IDENTITY_LEN_MAX {
        return Err(format!("an identity is 1 to {IDENTITY_LEN_MAX} bytes (a certificate's common name)"));
    }
    if id.trim() != id || id.chars().any(char::is_control) {
        return Err(format!("identity {id:?} has control characters or surrounding spaces"));
    }
    Ok(())
}

/// A list the servers accept: at most [`ENTRIES_MAX`] valid identities,
/// none twice.
pub fn check_entries(entries: &[ScopeEntry]) -> Result<(), String> {
    if entries.len() > ENTRIES_MAX {
        return Err(format!("an access list holds at most {ENTRIES_MAX} identities, not {}", entries.len()));
    }
    for (i, e) in entries.iter().enumerate() {
        check_identity(&e.identity)?;
        if entries[..i].iter().any(|x| x.identity == e.identity) {
            return Err(format!("identity {:?} is in the list twice", e.identity));
        }
    }
    Ok(())
}

fn bad(field: &'static str, value: usize) -> DecodeError {
    DecodeError::BadValue { field, value: value as u64 }
}

impl Wire for VolumeScope {
    const MIN_LEN: usize = 16;
    fn put(&self, w: &mut Writer) {
        self.name.put(w);
        self.entries.put(w);
        self.server.put(w);
        self.readers.put(w);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let name = String::get(r)?;
        if name.len() > NAME_LEN_MAX {
            return Err(bad("volume name length", name.len()));
        }
        let entries: Vec<ScopeEntry> = Wire::get(r)?;
        if check_entries(&entries).is_err() {
            return Err(bad("access list", entries.len()));
        }
        let server = String::get(r)?;
        if server.len() > IDENTITY_LEN_MAX {
            return Err(bad("lease holder's certificate name length", server.len()));
        }
        let readers: Vec<String> = Wire::get(r)?;
        if readers.len() > READERS_MAX || readers.iter().any(|n| n.is_empty() || n.len() > IDENTITY_LEN_MAX) {
            return Err(bad("readers", readers.len()));
        }
        Ok(VolumeScope { name, entries, server, readers })
    }
}

impl Wire for Scope {
    const MIN_LEN: usize = 16;
    fn put(&self, w: &mut Writer) {
        self.version.put(w);
        (self.volumes.len() as u32).put(w);
        for (k, v) in &self.volumes {
            k.put(w);
            v.put(w);
        }
        (self.revoked.len() as u32).put(w);
        for (serial, name) in &self.revoked {
            serial.put(w);
            name.put(w);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let version = u64::get(r)?;
        let n = u32::get(r)? as usize;
        if n > VOLUMES_MAX || n.saturating_mul(16 + VolumeScope::MIN_LEN) > r.left() {
            return Err(bad("scope volumes", n));
        }
        let mut volumes = BTreeMap::new();
        for _ in 0..n {
            let k = u128::get(r)?;
            if k >> KEY_BITS != 0 {
                return Err(bad("volume key", (k >> KEY_BITS) as usize));
            }
            if volumes.insert(k, VolumeScope::get(r)?).is_some() {
                return Err(bad("volume key repeated", 0));
            }
        }
        let n = u32::get(r)? as usize;
        if n > REVOKED_MAX || n.saturating_mul(8) > r.left() {
            return Err(bad("revocations", n));
        }
        let mut revoked = BTreeMap::new();
        for _ in 0..n {
            let serial = String::get(r)?;
            if serial.is_empty() || serial.len() > SERIAL_LEN_MAX {
                return Err(bad("serial number length", serial.len()));
            }
            let name = String::get(r)?;
            if name.len() > IDENTITY_LEN_MAX {
                return Err(bad("revoked name length", name.len()));
            }
            revoked.insert(serial, name);
        }
        Ok(Scope { version, volumes, revoked })
    }
}

/// Who sends a request, as its certificate says.
#[derive(Clone, Copy, Debug)]
pub struct Who<'a> {
    pub name: &'a str,
    pub role: &'a str,
    /// The certificate's serial number (lower-case hex).
    pub serial: &'a str,
}

/// What a request does to one blob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Touch {
    /// Reads the blob's metadata or tract `tract`.
    Read(BlobId, Option<TractNo>),
    /// Changes tract `tract` (or the blob, `None`), or fences its writers.
    Change(BlobId, Option<TractNo>),
    /// Takes, keeps or frees the volume's lease.
    Lease(BlobId),
}

/// The blobs `req` touches, and how (none: a request about no blob).
pub fn touches(req: &Request) -> Vec<Touch> {
    use Request::*;
    match req {
        ReadTract { addr, .. } | MappedTract { addr } => vec![Touch::Read(addr.blob, Some(addr.tract))],
        WriteTract { addr, .. }
        | WriteTractCached { addr, .. }
        | WriteTractForward { addr, .. }
        | TrimTract { addr, .. }
        | DeleteTract { addr }
        | DigestTract { addr } => vec![Touch::Change(addr.blob, Some(addr.tract))],
        WriteTracts { writes, .. } => {
            writes.iter().map(|w| Touch::Change(w.addr.blob, Some(w.addr.tract))).collect()
        }
        GetBlob { blob, .. } => vec![Touch::Read(*blob, None)],
        CreateBlob { blob, .. } | ExtendBlob { blob, .. } | DeleteBlob { blob, .. } => {
            vec![Touch::Change(*blob, None)]
        }
        AcquireVolume { blob, .. }
        | RenewVolume { blob, .. }
        | ReleaseVolume { blob, .. }
        | AttachReader { blob } => vec![Touch::Lease(*blob)],
        _ => Vec::new(),
    }
}

/// Whether `who` may send `req` under `scope`, beyond what its role
/// allows (`authz::allows`, checked first by the caller): `Err` says why
/// not, for the refusal's message.
pub fn check(who: Who<'_>, req: &Request, scope: &Scope) -> Result<(), String> {
    if scope.is_revoked(who.serial) {
        return Err(format!("the certificate of {:?} (serial {}) is revoked", who.name, who.serial));
    }
    match who.role {
        META | TRACTSERVER | ADMIN => return Ok(()),
        CLIENT | NBD => {}
        // Any other role sends nothing touching a blob (the role table).
        _ => return Ok(()),
    }
    for t in touches(req) {
        judge(who, t, scope)?;
    }
    Ok(())
}

fn judge(who: Who<'_>, t: Touch, scope: &Scope) -> Result<(), String> {
    let (Touch::Read(blob, _) | Touch::Change(blob, _) | Touch::Lease(blob)) = t;
    let vol = scope.volume(blob);
    let named = || match vol.map(|v| v.name.as_str()).filter(|n| !n.is_empty()) {
        Some(n) => format!("volume {n:?}"),
        None => format!("blob {blob}"),
    };
    if who.role == NBD {
        let serves = vol.is_some_and(|v| !v.server.is_empty() && v.server == who.name);
        let reads = vol.is_some_and(|v| v.readers.iter().any(|r| r == who.name));
        return match t {
            _ if serves => Ok(()),
            Touch::Read(..) if reads => Ok(()),
            // Leases: the NBD server takes the volumes it serves.
            Touch::Lease(_) => Ok(()),
            // A volume's record and metadata, to list and check access.
            Touch::Read(_, None) | Touch::Read(_, Some(TractNo(0))) => Ok(()),
            _ => Err(format!(
                "the NBD server's certificate {:?} touches only the volumes it serves, and does not hold the lease of {}",
                who.name,
                named()
            )),
        };
    }
    // A client: what the volume's access list names it for.
    match (vol.and_then(|v| v.grant(who.name)), t) {
        (Some(_), Touch::Read(..)) | (Some(false), Touch::Change(_, Some(_)) | Touch::Lease(_)) => Ok(()),
        (Some(true), _) => {
            Err(format!("the access list of {} gives {:?} read-only access", named(), who.name))
        }
        (Some(false), Touch::Change(_, None)) => {
            Err(format!("creating, resizing or deleting {} takes an admin certificate", named()))
        }
        (None, _) => Err(format!("the access list of {} does not name {:?}", named(), who.name)),
    }
}

/// Whether a listing (`ListBlobs`) shows `blob` to `who`: a client sees
/// the blobs of the volumes its name is on; every other role, all.
pub fn visible(who: Who<'_>, blob: BlobId, scope: &Scope) -> bool {
    if scope.is_revoked(who.serial) {
        return false;
    }
    who.role != CLIENT || scope.volume(blob).is_some_and(|v| v.grant(who.name).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::tests::samples;
    use crate::{Opcode, TractAddr};

    const V: BlobId = BlobId(0x77);

    fn scope() -> Scope {
        let mut s = Scope { version: 3, ..Scope::default() };
        s.volumes.insert(
            volume_key(V),
            VolumeScope {
                name: "victim".into(),
                entries: vec![
                    ScopeEntry { identity: "vm1".into(), read_only: false },
                    ScopeEntry { identity: "reader".into(), read_only: true },
                ],
                server: "nbd1".into(),
                readers: vec!["nbd3".into()],
            },
        );
        s.revoked.insert("0abc".into(), "stolen".into());
        s
    }

    fn who<'a>(name: &'a str, role: &'a str) -> Who<'a> {
        Who { name, role, serial: "01" }
    }

    /// Every sample request, aimed at volume V (tract 5 where it has one).
    fn at_v() -> Vec<Request> {
        samples()
            .into_iter()
            .map(|mut r| {
                let a = TractAddr { blob: V, incarnation: 1, tract: TractNo(5), row_version: 1, writer: 0 };
                match &mut r {
                    Request::ReadTract { addr, .. }
                    | Request::MappedTract { addr }
                    | Request::WriteTract { addr, .. }
                    | Request::WriteTractCached { addr, .. }
                    | Request::WriteTractForward { addr, .. }
                    | Request::TrimTract { addr, .. }
                    | Request::DeleteTract { addr }
                    | Request::DigestTract { addr } => *addr = a,
                    Request::WriteTracts { writes, .. } => writes.iter_mut().for_each(|w| w.addr = a),
                    Request::GetBlob { blob, .. }
                    | Request::CreateBlob { blob, .. }
                    | Request::ExtendBlob { blob, .. }
                    | Request::DeleteBlob { blob, .. }
                    | Request::AcquireVolume { blob, .. }
                    | Request::RenewVolume { blob, .. }
                    | Request::ReleaseVolume { blob, .. }
                    | Request::AttachReader { blob } => *blob = V,
                    _ => {}
                }
                r
            })
            .collect()
    }

    fn reads(r: &Request) -> bool {
        matches!(r.opcode(), Opcode::ReadTract | Opcode::MappedTract | Opcode::GetBlob)
    }

    fn blob_changes(r: &Request) -> bool {
        matches!(r.opcode(), Opcode::CreateBlob | Opcode::ExtendBlob | Opcode::DeleteBlob)
    }

    /// The table in the module header, over every request kind: what each
    /// role and scope may send to volume V.
    #[test]
    fn every_request_of_every_scope_is_as_the_table_says() {
        let s = scope();
        for r in at_v() {
            let about_v = !touches(&r).is_empty()
                && !matches!(r, Request::WriteTracts { ref writes, .. } if writes.is_empty());
            let lease = matches!(
                r.opcode(),
                Opcode::AcquireVolume | Opcode::RenewVolume | Opcode::ReleaseVolume | Opcode::AttachReader
            );
            let cases: [(Who<'_>, bool); 9] = [
                (who("m", META), true),
                (who("t", TRACTSERVER), true),
                (who("root", ADMIN), true),
                // On the list, read-write: everything but create, resize, delete.
                (who("vm1", CLIENT), !about_v || !blob_changes(&r)),
                // Read-only: reads only.
                (who("reader", CLIENT), !about_v || reads(&r)),
                // Not on the list: nothing of V.
                (who("vm2", CLIENT), !about_v),
                // Serving V: everything.
                (who("nbd1", NBD), true),
                // Another NBD server: its leases, and V's metadata only.
                (who("nbd2", NBD), !about_v || lease || r.opcode() == Opcode::GetBlob),
                // Serving V read-only: reads too.
                (who("nbd3", NBD), !about_v || lease || reads(&r)),
            ];
            for (w, want) in cases {
                assert_eq!(
                    check(w, &r, &s).is_ok(),
                    want,
                    "{} ({}) sending {:?}",
                    w.name,
                    w.role,
                    r.opcode()
                );
            }
        }
    }

    /// An NBD server that does not serve a volume reads its record (tract
    /// 0) but no other tract of it, and changes nothing of it.
    #[test]
    fn an_nbd_server_reads_only_the_record_of_a_volume_it_does_not_serve() {
        let s = scope();
        let read = |tract| Request::ReadTract {
            addr: TractAddr { blob: V, incarnation: 1, tract: TractNo(tract), row_version: 1, writer: 0 },
            offset: 0,
            len: 4096,
        };
        assert!(check(who("nbd2", NBD), &read(0), &s).is_ok());
        assert!(check(who("nbd2", NBD), &read(1), &s).is_err());
        let write = Request::WriteTract {
            addr: TractAddr { blob: V, incarnation: 1, tract: TractNo(0), row_version: 1, writer: 0 },
            offset: 0,
            crcs: vec![],
        };
        assert!(check(who("nbd2", NBD), &write, &s).is_err());
        // An unknown volume: nobody serves it.
        let other = Request::ReadTract {
            addr: TractAddr { blob: BlobId(1), incarnation: 1, tract: TractNo(1), row_version: 1, writer: 0 },
            offset: 0,
            len: 1,
        };
        assert!(check(who("nbd1", NBD), &other, &s).is_err());
        assert!(check(who("vm1", CLIENT), &other, &s).is_err());
    }

    /// The same volume whatever its placement: the key drops those bits.
    #[test]
    fn placement_does_not_change_the_volume() {
        let placed = blizzard_core::tlt::Placement::Hybrid.place(V);
        assert_ne!(placed, V);
        assert_eq!(volume_key(placed), volume_key(V));
        let r = Request::GetBlob { blob: placed, row_version: 1 };
        assert!(check(who("vm1", CLIENT), &r, &scope()).is_ok());
    }

    #[test]
    fn a_revoked_certificate_may_do_nothing() {
        let s = scope();
        for role in [META, TRACTSERVER, ADMIN, CLIENT, NBD] {
            let w = Who { name: "stolen", role, serial: "0abc" };
            assert!(check(w, &Request::Ping, &s).is_err(), "{role}");
            assert!(!visible(w, V, &s));
        }
    }

    #[test]
    fn listings_show_a_client_only_its_volumes() {
        let s = scope();
        assert!(visible(who("vm1", CLIENT), V, &s));
        assert!(visible(who("reader", CLIENT), V, &s));
        assert!(!visible(who("vm2", CLIENT), V, &s));
        assert!(visible(who("nbd2", NBD), V, &s));
        assert!(visible(who("root", ADMIN), BlobId(5), &s));
    }

    #[test]
    fn tables_round_trip_and_bad_ones_are_refused() {
        let s = scope();
        let mut w = Writer::new();
        s.put(&mut w);
        let b = w.buf.freeze();
        let mut r = Reader::new(&b);
        assert_eq!(Scope::get(&mut r), Ok(s.clone()));
        // Every truncation fails cleanly.
        for n in 0..b.len() {
            let mut r = Reader::new(&b[..n]);
            assert!(Scope::get(&mut r).is_err(), "{n} bytes decoded");
        }
        // A list with an identity twice is refused.
        let mut bad = s.clone();
        if let Some(v) = bad.volumes.values_mut().next() {
            v.entries.push(ScopeEntry { identity: "vm1".into(), read_only: true });
        }
        let mut w = Writer::new();
        bad.put(&mut w);
        let b = w.buf.freeze();
        assert!(Scope::get(&mut Reader::new(&b)).is_err());
        assert!(check_entries(&[ScopeEntry { identity: " x".into(), read_only: false }]).is_err());
    }
}
