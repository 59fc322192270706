//! Snapshots and clones of LSVD volumes (design 0008, the LSVD paper's
//! §3.6).
//!
//! A snapshot is a name for a point in the object log: `P/s/<name>` holds
//! the seq of the head when it was taken, and the checkpoint at that seq
//! (`P/c/<seq>`) holds the map as of then. Taking one costs a checkpoint
//! and a small object, never a copy of data ([`LsvdVolume::snapshot`],
//! through the writer, which drains its journal first). The writer's
//! cleaner never picks an object a snapshot's map reads, so the snapshot
//! can be opened read-only ([`LsvdSnapshot`]) for as long as it exists.
//!
//! A clone is a new volume under its own prefix whose descriptor names its
//! base chain: the base's prefix, uuid and snapshot seq (plus the base's
//! own chain). Its first checkpoint is the base's map at the snapshot;
//! its own objects continue from seq + 1, so a map entry's seq says which
//! prefix holds the object. The base keeps `P/k/<snapshot>/<clone uuid>`
//! while the clone exists: such a snapshot, and its volume, cannot be
//! deleted. A clone cleans only its own objects.
//!
//! | state at open of the writer | what happens |
//! |---|---|
//! | `s/<name>` and its checkpoint present | the objects its map reads are protected from cleaning |
//! | `s/<name>` present, its checkpoint missing | refused (`Corrupt`): a snapshot is written after its checkpoint and deleted before it, so this is damage |
//! | a checkpoint neither among the newest two nor a snapshot's | deleted (left by a crash, or by a deleted snapshot) |
//! | an object dead in the map and no longer protected (its snapshot deleted) | cleaned like any dead object: deleted after the next checkpoint |
//! | `k/<snap>/<uuid>` whose clone has no descriptor | stale (a clone deleted, or its creation cut off): removed when found |
//!
//! [`LsvdVolume::snapshot`]: crate::LsvdVolume::snapshot

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use bytes::{Bytes, BytesMut};

use blizzard_env::Env;

use crate::error::LsvdError;
use crate::extent_map::ExtentMap;
use crate::format::{check_snapshot_name, BaseRef, Checkpoint, CloneRef, Descriptor, SnapshotRecord};
use crate::objlog::{self, LogState, ObjLoc, ObjectLog};
use crate::store::{checkpoint_name, clone_ref_name, parse_seq, snapshot_name, Created, Store};

/// A snapshot as `volume list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub seq: u64,
    pub created_secs: u64,
    /// The clones that read it (their names).
    pub clones: Vec<String>,
}

/// Reads snapshot `name`'s record (`NotFound` if there is none).
pub async fn read_record(log: &ObjectLog, name: &str) -> Result<SnapshotRecord, LsvdError> {
    check_snapshot_name(name).map_err(LsvdError::Invalid)?;
    let what = format!("snapshot {:?} of volume {:?}", name, log.desc().name);
    let Some(b) = log.store().get(&snapshot_name(name)).await? else {
        return Err(LsvdError::NotFound(what));
    };
    let r = SnapshotRecord::decode(&b).map_err(|e| LsvdError::Corrupt(format!("{what}: {e}")))?;
    if r.uuid != log.desc().uuid || r.name != name {
        return Err(LsvdError::Corrupt(format!(
            "{what}: the record names {:?} of volume {:032x}",
            r.name, r.uuid
        )));
    }
    Ok(r)
}

/// The checkpoint at a snapshot's seq, which its map is.
async fn read_checkpoint(log: &ObjectLog, r: &SnapshotRecord) -> Result<Checkpoint, LsvdError> {
    let what = format!("snapshot {:?} of volume {:?}", r.name, log.desc().name);
    let Some(b) = log.store().get(&checkpoint_name(r.seq)).await? else {
        return Err(LsvdError::Corrupt(format!("{what}: its checkpoint {} is missing", r.seq)));
    };
    let c = Checkpoint::decode(&b).map_err(|e| LsvdError::Corrupt(format!("{what}: {e}")))?;
    if c.seq != r.seq || c.uuid != log.desc().uuid || c.size != log.desc().size {
        return Err(LsvdError::Corrupt(format!("{what}: checkpoint {} is not its volume's", r.seq)));
    }
    Ok(c)
}

/// Every snapshot of the volume, with its checkpoint (the writer's open).
pub async fn load_all(log: &ObjectLog) -> Result<Vec<(SnapshotRecord, Checkpoint)>, LsvdError> {
    let mut out = Vec::new();
    for (name, _) in log.store().list("s").await? {
        let r = read_record(log, &name).await?;
        let c = read_checkpoint(log, &r).await?;
        out.push((r, c));
    }
    Ok(out)
}

/// Deletes the checkpoints nothing needs: all but the newest two and the
/// snapshots' (a crash, or a snapshot deleted, can leave them). Returns
/// the kept ones that are not a snapshot's, oldest first: the writer's
/// rotation carries on from them.
pub async fn tidy_checkpoints(
    log: &ObjectLog,
    snapshots: &BTreeMap<String, (u64, BTreeSet<u64>)>,
) -> Result<VecDeque<u64>, LsvdError> {
    let snaps: BTreeSet<u64> = snapshots.values().map(|(s, _)| *s).collect();
    let mut plain: Vec<u64> = log
        .store()
        .list("c")
        .await?
        .iter()
        .filter_map(|(n, _)| parse_seq(n))
        .filter(|s| !snaps.contains(s))
        .collect();
    plain.sort_unstable();
    let keep_from = plain.len().saturating_sub(2);
    for &c in &plain[..keep_from] {
        log.store().delete(&checkpoint_name(c)).await?;
    }
    Ok(plain[keep_from..].iter().copied().collect())
}

/// The clones that read the volume's snapshot `snapshot` (every snapshot
/// if `None`): their references, each checked against the clone's
/// descriptor. A reference whose clone is gone is deleted.
pub async fn live_clones(store: &Store, snapshot: Option<&str>) -> Result<Vec<CloneRef>, LsvdError> {
    let dir = match snapshot {
        Some(s) => format!("k/{s}"),
        None => "k".to_string(),
    };
    let mut out = Vec::new();
    for path in store.list_paths(&dir).await? {
        let Some(b) = store.get(&path).await? else { continue };
        let r = CloneRef::decode(&b).map_err(|e| LsvdError::Corrupt(format!("{path}: {e}")))?;
        match objlog::read_descriptor(&store.at(&r.prefix), None).await {
            Ok(d) if d.uuid == r.uuid => out.push(r),
            Ok(_) | Err(LsvdError::NotFound(_)) => {
                tracing::info!(clone = %r.name, prefix = %r.prefix, "clone reference of a clone that is gone: removed");
                store.delete(&path).await?;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// The volume's snapshots, oldest first.
pub async fn list(store: &Store) -> Result<Vec<SnapshotInfo>, LsvdError> {
    let desc = objlog::read_descriptor(store, None).await?;
    let log = ObjectLog::new(store.clone(), desc);
    let mut clones: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for path in store.list_paths("k").await? {
        let Some(b) = store.get(&path).await? else { continue };
        if let (Ok(r), Some(snap)) = (CloneRef::decode(&b), path.split('/').nth(1)) {
            clones.entry(snap.to_string()).or_default().push(r.name);
        }
    }
    let mut out = Vec::new();
    for (name, _) in store.list("s").await? {
        let r = read_record(&log, &name).await?;
        out.push(SnapshotInfo {
            clones: clones.remove(&r.name).unwrap_or_default(),
            name: r.name,
            seq: r.seq,
            created_secs: r.created_secs,
        });
    }
    out.sort_by_key(|s| s.seq);
    Ok(out)
}

/// A snapshot opened read-only: its map, and the objects it reads.
pub struct LsvdSnapshot {
    log: ObjectLog,
    map: ExtentMap<ObjLoc>,
    record: SnapshotRecord,
}

impl LsvdSnapshot {
    /// Opens snapshot `snapshot` of the volume under `store` (`volume`, if
    /// given, must be its name). Needs no lease and changes nothing: the
    /// writer keeps every object it reads.
    pub async fn open(store: Store, volume: Option<&str>, snapshot: &str) -> Result<LsvdSnapshot, LsvdError> {
        let desc = objlog::read_descriptor(&store, volume).await?;
        let log = ObjectLog::new(store, desc);
        let record = read_record(&log, snapshot).await?;
        let c = read_checkpoint(&log, &record).await?;
        let state = LogState::from_checkpoint(&c);
        Ok(LsvdSnapshot { log, map: state.map, record })
    }

    pub fn size(&self) -> u64 {
        self.log.desc().size
    }

    pub fn volume(&self) -> &str {
        &self.log.desc().name
    }

    pub fn record(&self) -> &SnapshotRecord {
        &self.record
    }

    /// Requests sent to the object store so far.
    pub fn counts(&self) -> &std::sync::Arc<crate::store::Counts> {
        self.log.store().counts()
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), LsvdError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(LsvdError::OutOfRange { offset, len, size: self.size() }),
        }
    }

    /// Reads `[offset, offset + len)` as of the snapshot.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, LsvdError> {
        self.check(offset, len)?;
        let pieces = self.map.lookup(offset, len);
        let reads = pieces.iter().map(|p| async move {
            match p.loc {
                None => Ok(None),
                Some(o) => match self.log.read(o.seq, o.off, p.len).await {
                    Ok(b) => Ok(Some(b)),
                    // The map never changes: an object it names that is
                    // gone was deleted while the snapshot needed it.
                    Err(LsvdError::NotFound(what)) => Err(LsvdError::Corrupt(format!(
                        "snapshot {:?} of volume {:?} reads object {} ({what}), which is gone",
                        self.record.name,
                        self.volume(),
                        o.seq
                    ))),
                    Err(e) => Err(e),
                },
            }
        });
        let parts = futures::future::join_all(reads).await;
        let mut out = BytesMut::zeroed(len as usize);
        for (p, part) in pieces.iter().zip(parts) {
            if let Some(b) = part? {
                let at = (p.start - offset) as usize;
                out[at..at + p.len as usize].copy_from_slice(&b);
            }
        }
        Ok(out.freeze())
    }

    /// As [`crate::LsvdVolume::allocation`]: `(len, data)` runs from
    /// `offset`, `false` where the snapshot reads zeros.
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, LsvdError> {
        self.check(offset, len)?;
        let mut runs: Vec<(u64, bool)> = Vec::new();
        for q in self.map.lookup(offset, len) {
            let data = q.loc.is_some();
            match runs.last_mut() {
                Some(last) if last.1 == data => last.0 += q.len,
                _ if q.len > 0 => runs.push((q.len, data)),
                _ => {}
            }
        }
        Ok(runs)
    }
}

/// Creates volume `name` under `new` as a clone of snapshot `snapshot` of
/// the volume under `base` (same object store): a writable volume that
/// starts as the snapshot and shares its objects. In order: the
/// reference on the base (so the snapshot cannot go meanwhile), the
/// descriptor, the first checkpoint (the snapshot's map). A failure
/// undoes what it made.
pub async fn clone_volume(
    env: &Env,
    base: &Store,
    base_name: &str,
    snapshot: &str,
    new: &Store,
    name: &str,
) -> Result<Descriptor, LsvdError> {
    let bdesc = objlog::read_descriptor(base, Some(base_name)).await?;
    let blog = ObjectLog::new(base.clone(), bdesc.clone());
    let rec = read_record(&blog, snapshot).await?;
    let c = read_checkpoint(&blog, &rec).await?;
    let created_secs =
        env.clock.system_time().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut chain = bdesc.base.clone();
    chain.push(BaseRef {
        prefix: base.prefix().to_string(),
        uuid: bdesc.uuid,
        upto: rec.seq,
        snapshot: rec.name,
    });
    let desc = Descriptor {
        uuid: env.random_u128(),
        name: name.to_string(),
        size: bdesc.size,
        object_bytes: bdesc.object_bytes,
        created_secs,
        base: chain,
        // A clone cleans as its base does.
        gc_live_pct: bdesc.gc_live_pct,
    };
    desc.validate().map_err(LsvdError::Invalid)?;
    // Listings are by prefix: one volume's names inside the other's would
    // be read as its own objects.
    let inside = |a: &str, b: &str| a == b || b.is_empty() || a.starts_with(&format!("{b}/"));
    if inside(new.prefix(), base.prefix()) || inside(base.prefix(), new.prefix()) {
        return Err(LsvdError::Invalid(format!(
            "the clone's prefix {:?} and its base's {:?} must not hold one another: pick a sibling",
            new.prefix(),
            base.prefix()
        )));
    }
    let reference = clone_ref_name(snapshot, desc.uuid);
    let r = CloneRef { uuid: desc.uuid, prefix: new.prefix().to_string(), name: name.to_string() };
    base.create(&reference, vec![r.encode()]).await?;
    let made = async {
        objlog::create(new, &desc).await?;
        let first = Checkpoint { uuid: desc.uuid, ..c };
        match new.create(&checkpoint_name(first.seq), vec![first.encode()]).await? {
            Created::New => Ok(()),
            Created::Exists => Err(LsvdError::Exists(format!("prefix {:?}", new.prefix()))),
        }
    }
    .await;
    if let Err(e) = made {
        // Undo: the descriptor only if it is this clone's.
        if let Ok(d) = objlog::read_descriptor(new, None).await {
            if d.uuid == desc.uuid {
                let _ = new.delete(&checkpoint_name(rec.seq)).await;
                let _ = new.delete(crate::store::DESCRIPTOR).await;
            }
        }
        let _ = base.delete(&reference).await;
        return Err(e);
    }
    Ok(desc)
}
