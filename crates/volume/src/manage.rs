//! Volumes by name on a real cluster. A volume's blob id is derived from
//! its name (a fixed 128-bit FNV-1a hash), so opening needs no registry;
//! listing asks every tractserver for its blobs and keeps those whose tract
//! 0 holds a volume superblock.
//!
//! Whatever changes a volume (create, open for writing, resize, delete)
//! first takes its lease from the metadata service (`lease`, design 0007):
//! a volume another process holds is refused with
//! [`VolumeError::Held`], naming the holder. Reading (`info`,
//! `open_read_only`, `list`) needs no lease.
//!
//! Who may use a volume is the metadata service's to keep (design 0010,
//! issue 56): `create` registers the volume there with an empty access
//! list, `set_access` changes the list there (no lease: the servers
//! enforce the new list at once), `delete` forgets it. [`access_of`]
//! reads the list in force: the metadata service's, or, for a volume made
//! before it kept them and never given one since, its superblock's.

use std::sync::Arc;

use blizzard_client::{Blob, Client, ClientError};
use blizzard_core::{BlobId, Placement};
use blizzard_env::Env;

use crate::io::{BlobIo, ClientBlobIo};
use crate::lease::{Lease, Leased, Writer};
use crate::lsvd::S3Spec;
use crate::superblock::{Superblock, SUPERBLOCK_COPY_LEN};
use crate::volume::{Volume, VolumeSpec};
use crate::{PlantedBug, VolumeError};

/// The blob id of the volume called `name`. Part of the on-cluster format:
/// changing it loses every volume.
pub fn blob_id(name: &str) -> BlobId {
    const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
    let mut h = OFFSET;
    for b in b"blizzard-volume/".iter().chain(name.as_bytes()) {
        h ^= *b as u128;
        h = h.wrapping_mul(PRIME);
    }
    BlobId(h)
}

/// The blob of the volume called `name`, under whichever placement it was
/// created with (design 0009: the placement is written in the blob's id,
/// so a volume placed `hybrid` lives at `Placement::Hybrid.place(blob_id
/// (name))`). `any` is tried first, then the placements the cluster's table
/// has sections for: one request more per placement tried.
pub async fn find_blob(client: &Client, name: &str) -> Result<Blob, ClientError> {
    let id = blob_id(name);
    let tlt = client.tlt();
    let mut last = ClientError::NoSuchBlob(id);
    for p in Placement::ALL.into_iter().filter(|p| tlt.has_placement(*p)) {
        match client.open_blob(p.place(id)).await {
            Ok(b) => return Ok(b),
            Err(ClientError::NoSuchBlob(_)) => {}
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn not_found(name: &str) -> impl Fn(ClientError) -> VolumeError + '_ {
    move |e| match e {
        ClientError::NoSuchBlob(_) => VolumeError::NotFound(name.to_string()),
        ClientError::BlobExists(_) => VolumeError::Exists(name.to_string()),
        e => e.into(),
    }
}

/// Creates and formats a volume, held by this process.
pub async fn create(env: Env, client: &Client, spec: &VolumeSpec) -> Result<Volume, VolumeError> {
    create_as(env.clone(), client, spec, &Writer::new(&env)).await
}

/// [`create`] as `writer`.
pub async fn create_as(
    env: Env,
    client: &Client,
    spec: &VolumeSpec,
    writer: &Writer,
) -> Result<Volume, VolumeError> {
    create_with(env, client, spec, None, writer).await
}

/// Creates an S3 volume (design 0008; `lsvd`): its record in the blob the
/// name hashes to (replication `spec.replication`), its data under
/// `s3.url`, its journal in `s3.cache_dir`; held by this process. The
/// commit mode, flush policy and striping of `spec` do not apply. Nothing
/// is left behind on a failure.
pub async fn create_s3(
    env: Env,
    client: &Client,
    spec: &VolumeSpec,
    s3: &S3Spec,
) -> Result<Volume, VolumeError> {
    create_with(env.clone(), client, spec, Some(s3), &Writer::new(&env)).await
}

async fn create_with(
    env: Env,
    client: &Client,
    spec: &VolumeSpec,
    s3: Option<&S3Spec>,
    writer: &Writer,
) -> Result<Volume, VolumeError> {
    match s3 {
        None => Volume::validate(spec, client.tract_size())?,
        Some(_) => Volume::validate_name(&spec.name)?,
    }
    if spec.replication == 0 || spec.replication > client.max_replication() {
        return Err(VolumeError::Invalid(format!(
            "replication {} is outside 1..={} (the cluster's maximum)",
            spec.replication,
            client.max_replication()
        )));
    }
    let id = blob_id(&spec.name);
    let lease = match Lease::acquire(env.clone(), client.clone(), id, &spec.name, writer).await {
        Ok(l) => l,
        // Held because it exists and is open: say it exists.
        Err(e @ VolumeError::Held { .. }) => {
            return Err(match find_blob(client, &spec.name).await {
                Ok(_) => VolumeError::Exists(spec.name.clone()),
                Err(_) => e,
            })
        }
        Err(e) => return Err(e),
    };
    // One volume per name, whatever its placement: the lease (on the
    // name's `any` id) serializes creators, this finds an earlier one.
    let existing = match find_blob(client, &spec.name).await {
        Ok(_) => Err(VolumeError::Exists(spec.name.clone())),
        Err(ClientError::NoSuchBlob(_)) => Ok(()),
        Err(e) => Err(e.into()),
    };
    let created = match existing {
        Ok(()) => client
            .create_placed_blob(Some(id), spec.replication, spec.placement)
            .await
            .map_err(not_found(&spec.name)),
        Err(e) => Err(e),
    };
    let blob = match created {
        Ok(b) => b,
        Err(e) => {
            let _ = lease.release().await;
            return Err(e);
        }
    };
    let placed = blob.id();
    // Known to the cluster (design 0010) before it holds anything: with an
    // empty list, only admins and the NBD server that serves it touch it.
    if let Err(e) = client.set_volume_access(placed, &spec.name, Vec::new()).await {
        let _ = client.delete_blob(placed).await;
        let _ = lease.release().await;
        return Err(e.into());
    }
    let io: Arc<dyn BlobIo> = Leased::new(ClientBlobIo::new(blob), lease.clone());
    let made = match s3 {
        None => Volume::format(env, io, spec).await,
        Some(s3) => crate::lsvd::create(env, io, spec, s3).await,
    };
    match made {
        Ok(v) => Ok(v),
        Err(e) => {
            // Do not leave a half-made volume behind.
            let _ = client.delete_blob(placed).await;
            let _ = lease.release().await;
            Err(e)
        }
    }
}

/// Opens the volume called `name`, running its recovery.
pub async fn open(env: Env, client: &Client, name: &str) -> Result<Volume, VolumeError> {
    open_with(env, client, name, PlantedBug::None).await
}

#[doc(hidden)]
pub async fn open_with(
    env: Env,
    client: &Client,
    name: &str,
    planted: PlantedBug,
) -> Result<Volume, VolumeError> {
    open_as(env.clone(), client, name, &Writer::new(&env), planted).await
}

/// Opens the volume called `name` for writing as `writer` (its lease
/// first), running its recovery.
pub async fn open_as(
    env: Env,
    client: &Client,
    name: &str,
    writer: &Writer,
    planted: PlantedBug,
) -> Result<Volume, VolumeError> {
    let id = blob_id(name);
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let lease = Lease::acquire(env.clone(), client.clone(), id, name, writer).await?;
    let io: Arc<dyn BlobIo> = Leased::new(ClientBlobIo::new(blob), lease.clone());
    match Volume::open(env, io, planted).await {
        Ok(v) => Ok(v),
        Err(e) => {
            let _ = lease.release().await;
            Err(e)
        }
    }
}

/// The superblock of the volume called `name`, read without opening it:
/// nothing is written, and a process writing the volume is not disturbed.
pub async fn info(client: &Client, name: &str) -> Result<Superblock, VolumeError> {
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let io: Arc<dyn BlobIo> = ClientBlobIo::new(blob);
    Volume::inspect(&io).await
}

/// Opens the volume called `name` to read it as its blob holds it, without
/// claiming it (`Volume::open_read_only`): a process writing it carries on.
pub async fn open_read_only(client: &Client, name: &str) -> Result<Volume, VolumeError> {
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    // An NBD server's certificate reads a volume it does not hold only as
    // a registered reader (design 0010); any other's goes by its list.
    client.attach_reader(blob_id(name)).await?;
    Volume::open_read_only(ClientBlobIo::new(blob)).await
}

/// Every volume's superblock, by name.
pub async fn list(client: &Client) -> Result<Vec<Superblock>, VolumeError> {
    let mut out = Vec::new();
    for meta in client.list_blobs().await? {
        if meta.size_tracts == 0 {
            continue;
        }
        let blob = match client.open_blob(meta.blob).await {
            Ok(b) => b,
            Err(ClientError::NoSuchBlob(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        let head = blob.read(0, 0, 2 * SUPERBLOCK_COPY_LEN).await?;
        let n = SUPERBLOCK_COPY_LEN as usize;
        if let Ok(sb) = Superblock::pick(&head[..n], &head[n..]) {
            if Placement::of(meta.blob).place(blob_id(&sb.name)) == meta.blob {
                out.push(sb);
            }
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Resizes volume `name` to `size_bytes` (smaller only with
/// `allow_shrink`), whether or not a process serves it: through the
/// serving process's control socket, else opened here. Returns the record
/// as it now is.
pub async fn resize(
    env: Env,
    client: &Client,
    name: &str,
    size_bytes: u64,
    allow_shrink: bool,
) -> Result<(Superblock, Via), VolumeError> {
    use crate::control::Request;
    let ((), via) = through_writer(
        &env,
        client,
        name,
        Request::Resize { size: size_bytes, allow_shrink },
        |_| Ok(()),
        move |v| Box::pin(async move { v.resize(size_bytes, allow_shrink).await }),
    )
    .await?;
    Ok((info(client, name).await?, via))
}

/// The access list in force for volume `name` (module header): the
/// metadata service's, or the superblock's for a volume it has none for.
/// (Reading the metadata service's lists takes an `admin` or `nbd`
/// certificate on an authenticated cluster.)
pub async fn access_of(client: &Client, name: &str) -> Result<Vec<crate::access::AccessEntry>, VolumeError> {
    let scope = client.scope(0, client.request_timeout()).await?;
    match registered(scope.as_ref(), name) {
        Some(list) => Ok(list),
        None => Ok(info(client, name).await?.access),
    }
}

/// The list the scope table `scope` holds for volume `name`, if it holds
/// one (a volume it knows only as its lease holder's has none).
pub fn registered(
    scope: Option<&blizzard_proto::scope::Scope>,
    name: &str,
) -> Option<Vec<crate::access::AccessEntry>> {
    scope?.volume(blob_id(name)).filter(|v| !v.name.is_empty()).map(|v| v.entries.clone())
}

/// Changes who may use volume `name` (`crate::access`; design 0010) and
/// returns the list now in force. The metadata service keeps it, and
/// every server enforces it from its next request on; the volume need
/// not be closed (an NBD server's connected clients keep what they were
/// given when they connected). Takes an `admin` certificate.
pub async fn set_access(
    client: &Client,
    name: &str,
    change: &crate::access::AccessChange,
) -> Result<Vec<crate::access::AccessEntry>, VolumeError> {
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let current = access_of(client, name).await?;
    let next = crate::access::apply(&current, change).map_err(VolumeError::Invalid)?;
    client.set_volume_access(blob.id(), name, next.clone()).await?;
    Ok(next)
}

/// Deletes a volume and frees its space: an S3 volume's objects and
/// cache first, then its record. A volume another process holds is
/// refused, naming the holder.
pub async fn delete(env: Env, client: &Client, name: &str) -> Result<(), VolumeError> {
    let id = blob_id(name);
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let placed = blob.id();
    let lease = Lease::acquire(env.clone(), client.clone(), id, name, &Writer::new(&env)).await?;
    let r = async {
        let io: Arc<dyn BlobIo> = ClientBlobIo::new(blob);
        // A blob without a readable record is deleted as it is (a create
        // cut off before its record, or damage): nothing else to find.
        if let Ok(sb) = Volume::inspect(&io).await {
            if sb.backend.s3().is_some() {
                crate::lsvd::delete(&env, &sb).await?;
            }
        }
        client.delete_blob(placed).await.map_err(not_found(name))
    }
    .await;
    let _ = lease.release().await;
    if r.is_ok() {
        // Its list goes with it (a volume made later under the name
        // registers its own).
        if let Err(e) = client.drop_volume(placed).await {
            tracing::warn!(volume = name, error = %e, "the volume is deleted but its access list is still kept");
        }
    }
    r
}

/// How a snapshot command reached the volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// The process serving it, through its control socket.
    Server,
    /// Opened here (nobody served it), then closed.
    Opened,
}

/// The S3 volume `name`'s record, or a clear refusal for any other.
async fn s3_record(client: &Client, name: &str) -> Result<Superblock, VolumeError> {
    let sb = info(client, name).await?;
    if sb.backend.s3().is_none() {
        return Err(VolumeError::Unsupported(format!(
            "volume {name:?} is in the blob store: clones are for S3 volumes (--backend s3) so far"
        )));
    }
    Ok(sb)
}

/// Runs `req` on volume `name`: through the process that serves it on
/// this host (its control socket: an S3 volume's in its cache directory,
/// a blob volume's in the run directory), or, when no process serves it,
/// by opening it here under its lease. A volume served on another host is
/// refused, naming the holder.
async fn through_writer<T>(
    env: &Env,
    client: &Client,
    name: &str,
    req: crate::control::Request,
    parse: impl Fn(&str) -> Result<T, VolumeError>,
    here: impl for<'a> FnOnce(&'a Volume) -> futures::future::BoxFuture<'a, Result<T, VolumeError>>,
) -> Result<(T, Via), VolumeError> {
    use crate::control::{ask, Reply};
    let sb = info(client, name).await?;
    let socket = match sb.backend.s3() {
        Some(s3) => crate::control::socket_path(&s3.cache_dir),
        None => crate::control::blob_socket_path(blob_id(name)),
    };
    match ask(env, &socket, &req).await? {
        Some(Reply::Ok(detail)) => return Ok((parse(&detail)?, Via::Server)),
        Some(Reply::Error(m)) => return Err(VolumeError::Refused(m)),
        None => {}
    }
    let v = match open(env.clone(), client, name).await {
        Ok(v) => v,
        Err(VolumeError::Held { holder, .. }) => {
            return Err(VolumeError::Refused(format!(
                "volume {name:?} is served by {holder}, which has no control socket at {}: run this command on the host that serves it (with the same BLIZZARD_RUN_DIR), or stop that server first",
                socket.display()
            )))
        }
        Err(e) => return Err(e),
    };
    let r = here(&v).await;
    v.close().await?;
    Ok((r?, Via::Opened))
}

/// Takes snapshot `snapshot` of volume `name` (designs 0008 and 0011),
/// whether or not a process serves it. Returns what names its point: an
/// S3 volume's object seq, a blob volume's new head layer.
pub async fn snapshot(
    env: Env,
    client: &Client,
    name: &str,
    snapshot: &str,
) -> Result<(u64, Via), VolumeError> {
    use crate::control::Request;
    blizzard_lsvd::format::check_snapshot_name(snapshot).map_err(VolumeError::Invalid)?;
    let owned = snapshot.to_string();
    through_writer(
        &env,
        client,
        name,
        Request::Snapshot(owned.clone()),
        |d| d.parse().map_err(|_| VolumeError::Refused(format!("the serving process answered {d:?}"))),
        move |v| Box::pin(async move { v.snapshot(&owned).await }),
    )
    .await
}

/// Deletes snapshot `snapshot` of volume `name` (an S3 volume's is
/// refused while a clone reads it), whether or not a process serves the
/// volume. Returns the bytes given back now (per replica; an S3 volume's
/// cleaner gives its back later).
pub async fn delete_snapshot(
    env: Env,
    client: &Client,
    name: &str,
    snapshot: &str,
) -> Result<(u64, Via), VolumeError> {
    use crate::control::Request;
    let owned = snapshot.to_string();
    through_writer(
        &env,
        client,
        name,
        Request::DeleteSnapshot(owned.clone()),
        |d| {
            d.parse().or_else(|_| {
                // A server from before deletions freed blob-store space answers nothing.
                if d.is_empty() {
                    Ok(0)
                } else {
                    Err(VolumeError::Refused(format!("the serving process answered {d:?}")))
                }
            })
        },
        move |v| Box::pin(async move { v.delete_snapshot_freeing(&owned).await }),
    )
    .await
}

/// Rolls volume `name` back to its snapshot `snapshot` (design 0011):
/// through the process serving it (refused while an NBD client is
/// connected, naming it), else here under its lease without opening it.
/// Returns the bytes copied (what changed since the snapshot).
pub async fn rollback(
    env: Env,
    client: &Client,
    name: &str,
    snapshot: &str,
) -> Result<(u64, Via), VolumeError> {
    use crate::control::{ask, Reply, Request};
    blizzard_lsvd::format::check_snapshot_name(snapshot).map_err(VolumeError::Invalid)?;
    let sb = info(client, name).await?;
    let socket = match sb.backend.s3() {
        Some(s3) => crate::control::socket_path(&s3.cache_dir),
        None => crate::control::blob_socket_path(blob_id(name)),
    };
    match ask(&env, &socket, &Request::Rollback(snapshot.to_string())).await? {
        Some(Reply::Ok(d)) => {
            let copied =
                d.parse().map_err(|_| VolumeError::Refused(format!("the serving process answered {d:?}")))?;
            return Ok((copied, Via::Server));
        }
        Some(Reply::Error(m)) => return Err(VolumeError::Refused(m)),
        None => {}
    }
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let lease = match Lease::acquire(env.clone(), client.clone(), blob_id(name), name, &Writer::new(&env)).await {
        Ok(l) => l,
        Err(VolumeError::Held { holder, .. }) => {
            return Err(VolumeError::Refused(format!(
                "volume {name:?} is served by {holder}, which has no control socket at {}: run this command on the host that serves it (with the same BLIZZARD_RUN_DIR), or stop that server first",
                socket.display()
            )))
        }
        Err(e) => return Err(e),
    };
    let io: Arc<dyn BlobIo> = Leased::new(ClientBlobIo::new(blob), lease);
    Ok((Volume::rollback_closed(io, snapshot).await?, Via::Opened))
}

/// The names of blob-store volume `name`'s snapshots, oldest first (its
/// catalog only: cheaper than [`snapshots`]).
pub async fn snapshot_names(client: &Client, sb: &Superblock) -> Result<Vec<String>, VolumeError> {
    if sb.layers.is_none() {
        return Ok(Vec::new());
    }
    let blob = find_blob(client, &sb.name).await.map_err(not_found(&sb.name))?;
    let io: Arc<dyn BlobIo> = ClientBlobIo::new(blob);
    crate::snap::stack::names(&io, sb).await
}

/// The snapshots of blob-store volume `name`, oldest first, with the
/// space each alone holds (an S3 volume's are `lsvd::snapshots`).
pub async fn snapshots(
    client: &Client,
    name: &str,
) -> Result<Vec<crate::snap::stack::SnapshotInfo>, VolumeError> {
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let io: Arc<dyn BlobIo> = ClientBlobIo::new(blob);
    Volume::snapshots(&io).await
}

/// Opens snapshot `snapshot` of volume `name` read-only (the export
/// `NAME@SNAP`): no lease, nothing written.
pub async fn open_snapshot(client: &Client, name: &str, snapshot: &str) -> Result<Volume, VolumeError> {
    let blob = find_blob(client, name).await.map_err(not_found(name))?;
    let io: Arc<dyn BlobIo> = ClientBlobIo::new(blob);
    Volume::open_snapshot(client.env().clone(), io, snapshot).await
}

/// Creates S3 volume `new` as a clone of snapshot `snapshot` of S3 volume
/// `base`: writable, starting as the snapshot, sharing its objects. `s3`
/// says where the clone lives (the same bucket as its base) and its cache;
/// its size and object size are the base's. Held by this process.
pub async fn clone_s3(
    env: Env,
    client: &Client,
    base: &str,
    snapshot: &str,
    new: &str,
    s3: &S3Spec,
    replication: u8,
) -> Result<Volume, VolumeError> {
    let sb = s3_record(client, base).await?;
    let url = sb.backend.s3().map(|s| s.url.clone()).unwrap_or_default();
    let mut spec = VolumeSpec::new(new, sb.size_bytes);
    spec.replication = replication;
    let mut s3 = s3.clone();
    s3.clone_of = Some(crate::lsvd::CloneOf { name: base.to_string(), url, snapshot: snapshot.to_string() });
    create_s3(env, client, &spec, &s3).await
}
