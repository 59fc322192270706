//! The scope table as the metadata service keeps it (design 0010, issue
//! 56; the table itself and how servers judge a request by it are
//! `blizzard_proto::scope`). Pure: each change is a function of the table
//! and the update, applied the same on every replica.
//!
//! | update | the table | version |
//! |---|---|---|
//! | `SetAccess` (an admin: `volume create`, `volume access`) | the volume's name and list replaced; the certificate serving it kept | raised |
//! | `DropVolume` (an admin: `volume delete`) | the volume forgotten | raised if it was known |
//! | `Revoke` (an admin: `ca revoke`) | the serial added | raised if new |
//! | a lease granted to a holder whose certificate is P | the volume's server becomes P (a volume known only by this) | raised if it changed |
//! | a lease released | the volume's server cleared; a volume known only by its server forgotten | raised if it changed |
//! | a lease renewed, or expiring | nothing: the server stays until another takes the lease | — |
//! | `AttachReader` (an NBD server serving the volume read-only) | its certificate added to the volume's readers (at most `READERS_MAX`; kept until the volume is dropped) | raised if new |
//!
//! Every update that can change the table is a barrier in the log
//! (`machine`), so every replica passes through the same versions: a
//! version names one table everywhere, and a server that has version v
//! asks only for a newer one.

use blizzard_core::BlobId;
use blizzard_proto::scope::{volume_key, Scope, ScopeEntry, VolumeScope, READERS_MAX};

/// Replaces volume `blob`'s name and access list.
pub fn set_access(s: &mut Scope, blob: BlobId, name: &str, entries: &[ScopeEntry]) {
    let v = s.volumes.entry(volume_key(blob)).or_default();
    v.name = name.to_string();
    v.entries = entries.to_vec();
    s.version += 1;
}

/// Forgets volume `blob`.
pub fn drop_volume(s: &mut Scope, blob: BlobId) {
    if s.volumes.remove(&volume_key(blob)).is_some() {
        s.version += 1;
    }
}

/// Refuses the certificate `serial` (issued to `name`) from now on.
pub fn revoke(s: &mut Scope, serial: &str, name: &str) {
    if s.revoked.insert(serial.to_string(), name.to_string()).is_none() {
        s.version += 1;
    }
}

/// Volume `blob`'s lease went to a holder whose certificate is `peer`
/// ("" for a holder without one: in-process, or a cluster without TLS).
pub fn served_by(s: &mut Scope, blob: BlobId, peer: &str) {
    let key = volume_key(blob);
    let now = s.volumes.get(&key).map_or("", |v| v.server.as_str());
    if now == peer {
        return;
    }
    if peer.is_empty() {
        return released(s, blob);
    }
    s.volumes.entry(key).or_default().server = peer.to_string();
    s.version += 1;
}

/// An NBD server whose certificate is `peer` serves volume `blob`
/// read-only. `Err` when the volume has as many readers as it may.
pub fn reader(s: &mut Scope, blob: BlobId, peer: &str) -> Result<(), String> {
    if peer.is_empty() {
        return Ok(());
    }
    let v = s.volumes.entry(volume_key(blob)).or_default();
    if v.readers.iter().any(|r| r == peer) {
        return Ok(());
    }
    if v.readers.len() >= READERS_MAX {
        return Err(format!(
            "volume {blob} already has {READERS_MAX} NBD servers serving it read-only: none more is registered"
        ));
    }
    v.readers.push(peer.to_string());
    s.version += 1;
    Ok(())
}

/// Volume `blob`'s lease was released.
pub fn released(s: &mut Scope, blob: BlobId) {
    let key = volume_key(blob);
    let Some(v) = s.volumes.get_mut(&key) else { return };
    if v.server.is_empty() {
        return;
    }
    v.server.clear();
    if v.name.is_empty() && v.entries.is_empty() && v.readers.is_empty() {
        s.volumes.remove(&key);
    }
    s.version += 1;
}

/// The part of the table that outlives the process for a single metadata
/// server (`store`): names, lists, readers and revocations. Servers come
/// from leases, which such a server keeps in memory.
pub fn durable_part(s: &Scope) -> Scope {
    let mut out = s.clone();
    out.volumes.retain(|_, v| !v.name.is_empty() || !v.entries.is_empty() || !v.readers.is_empty());
    out.volumes.values_mut().for_each(|v| v.server.clear());
    out
}

/// The record the table holds for `blob` (a copy).
pub fn of(s: &Scope, blob: BlobId) -> Option<VolumeScope> {
    s.volumes.get(&volume_key(blob)).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(id: &str, ro: bool) -> ScopeEntry {
        ScopeEntry { identity: id.into(), read_only: ro }
    }

    const V: BlobId = BlobId(42);

    /// Rows 1 and 2: a list set, replaced, dropped; each a new version.
    #[test]
    fn access_lists_are_set_replaced_and_dropped() {
        let mut s = Scope::default();
        set_access(&mut s, V, "db", &[e("vm1", false)]);
        assert_eq!(s.version, 1);
        set_access(&mut s, V, "db", &[e("vm1", true), e("vm2", false)]);
        assert_eq!((s.version, of(&s, V).map(|v| v.entries.len())), (2, Some(2)));
        drop_volume(&mut s, V);
        drop_volume(&mut s, V);
        assert_eq!((s.version, of(&s, V)), (3, None), "dropping twice changes nothing the second time");
    }

    /// Row 3: a revocation is kept once.
    #[test]
    fn revocations_accumulate_once() {
        let mut s = Scope::default();
        revoke(&mut s, "0a", "vm2");
        revoke(&mut s, "0a", "vm2");
        assert_eq!((s.version, s.revoked.len()), (1, 1));
        assert!(s.is_revoked("0a") && !s.is_revoked("") && !s.is_revoked("0b"));
    }

    /// Rows 4 to 6: the lease's certificate serves the volume until the
    /// lease is released or taken; a list set meanwhile keeps it.
    #[test]
    fn the_lease_holder_serves_until_released() {
        let mut s = Scope::default();
        served_by(&mut s, V, "nbd1");
        assert_eq!((s.version, of(&s, V).map(|v| v.server)), (1, Some("nbd1".into())));
        served_by(&mut s, V, "nbd1");
        assert_eq!(s.version, 1, "a retried acquire changes nothing");
        set_access(&mut s, V, "db", &[e("vm1", false)]);
        assert_eq!(of(&s, V).map(|v| v.server), Some("nbd1".into()), "kept across a list change");
        served_by(&mut s, V, "nbd2");
        assert_eq!((s.version, of(&s, V).map(|v| v.server)), (3, Some("nbd2".into())), "taken over");
        released(&mut s, V);
        assert_eq!(of(&s, V).map(|v| (v.name, v.server)), Some(("db".into(), String::new())));
        // A volume known only by its lease is forgotten with it.
        let w = BlobId(43);
        served_by(&mut s, w, "nbd1");
        released(&mut s, w);
        assert_eq!(of(&s, w), None);
        let v = s.version;
        released(&mut s, w);
        served_by(&mut s, w, "");
        assert_eq!(s.version, v, "nothing to release, nothing to change");
    }

    /// Row 7: readers registered once, bounded, dropped with the volume.
    #[test]
    fn readers_are_registered_once_and_bounded() {
        let mut s = Scope::default();
        assert_eq!(reader(&mut s, V, "nbd3"), Ok(()));
        assert_eq!(reader(&mut s, V, "nbd3"), Ok(()));
        assert_eq!(s.version, 1);
        assert_eq!(reader(&mut s, V, ""), Ok(()));
        assert_eq!(s.version, 1, "no certificate, nothing to register");
        served_by(&mut s, V, "nbd1");
        released(&mut s, V);
        assert_eq!(of(&s, V).map(|v| v.readers), Some(vec!["nbd3".to_string()]), "kept past the lease");
        for i in 1..READERS_MAX {
            assert!(reader(&mut s, V, &format!("r{i}")).is_ok());
        }
        assert!(reader(&mut s, V, "one-more").is_err());
        drop_volume(&mut s, V);
        assert_eq!(of(&s, V), None);
    }

    #[test]
    fn the_durable_part_leaves_out_servers() {
        let mut s = Scope::default();
        set_access(&mut s, V, "db", &[e("vm1", false)]);
        served_by(&mut s, V, "nbd1");
        served_by(&mut s, BlobId(43), "nbd1");
        revoke(&mut s, "0a", "vm2");
        let d = durable_part(&s);
        assert_eq!(d.volumes.len(), 1);
        assert_eq!(of(&d, V).map(|v| v.server), Some(String::new()));
        assert_eq!((d.version, d.revoked.len()), (s.version, 1));
    }
}
