//! The volume clients' blob I/O: a volume over the simulated cluster's
//! blob client, and creating and opening it.

use super::*;

/// [`ClientBlobIo`], with cache syncs sent one tractserver at a time in
/// address order (see the module's header: `Blob::sync` iterates a
/// `HashMap`). Everything else is the client's own path.
pub struct SimBlobIo {
    inner: Arc<ClientBlobIo>,
}

impl SimBlobIo {
    /// The volume's view of `blob`.
    pub fn io(blob: Blob) -> Arc<dyn BlobIo> {
        Arc::new(SimBlobIo { inner: ClientBlobIo::new(blob) })
    }
}

impl BlobIo for SimBlobIo {
    fn tract_size(&self) -> u32 {
        self.inner.tract_size()
    }

    fn replication(&self) -> u8 {
        self.inner.replication()
    }

    fn size_tracts(&self) -> u64 {
        self.inner.size_tracts()
    }

    fn extend_to(&self, tracts: u64) -> BoxFuture<'static, Result<u64, IoError>> {
        self.inner.extend_to(tracts)
    }

    fn write(&self, tract: u64, offset: u32, data: Bytes) -> BoxFuture<'static, Result<(), IoError>> {
        self.inner.write(tract, offset, data)
    }

    fn read(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<Bytes, IoError>> {
        self.inner.read(tract, offset, len)
    }

    fn read_replicas(
        &self,
        tract: u64,
        offset: u32,
        len: u32,
    ) -> BoxFuture<'static, Result<Vec<Bytes>, IoError>> {
        self.inner.read_replicas(tract, offset, len)
    }

    fn trim(&self, tract: u64, offset: u32, len: u32) -> BoxFuture<'static, Result<(), IoError>> {
        self.inner.trim(tract, offset, len)
    }

    fn mapped(&self, tract: u64) -> BoxFuture<'static, Result<Vec<u8>, IoError>> {
        self.inner.mapped(tract)
    }

    fn write_cached(
        &self,
        tract: u64,
        offset: u32,
        data: Bytes,
    ) -> BoxFuture<'static, Result<CacheReceipt, IoError>> {
        self.inner.write_cached(tract, offset, data)
    }

    fn sync(&self, receipt: CacheReceipt) -> BoxFuture<'static, Result<(), IoError>> {
        let mut per_server: BTreeMap<String, CacheReceipt> = BTreeMap::new();
        for (addr, boot) in receipt {
            per_server.entry(addr.clone()).or_default().push((addr, boot));
        }
        let calls: Vec<_> = per_server.into_values().map(|r| self.inner.sync(r)).collect();
        async move {
            for r in futures::future::join_all(calls).await {
                r?;
            }
            Ok(())
        }
        .boxed()
    }

    fn set_writer(&self, epoch: u64) {
        self.inner.set_writer(epoch)
    }

    fn reconcile(&self, tract: u64) -> BoxFuture<'static, Result<Reconciled, IoError>> {
        self.inner.reconcile(tract)
    }
}

/// The blob under a volume: [`SimBlobIo`], behind the volume's lease if
/// `writer` is given (as `manage::open_as` does), taken over from any
/// holder (a restarted client takes its own volume back).
async fn volume_io(
    env: &Env,
    client: &Client,
    blob: Blob,
    name: &str,
    writer: Option<&Writer>,
) -> Result<Arc<dyn BlobIo>, VolumeError> {
    let io = SimBlobIo::io(blob);
    let Some(w) = writer else { return Ok(io) };
    let lease = Lease::acquire(env.clone(), client.clone(), manage::blob_id(name), name, w).await?;
    Ok(Leased::new(io, lease))
}

/// `manage::create` over [`SimBlobIo`]: creates the blob named after the
/// volume and formats it (deleting it again if formatting fails). Returns
/// the placement it got.
pub(super) async fn create_volume(
    env: Env,
    client: &Client,
    spec: &VolumeSpec,
    writer: Option<&Writer>,
) -> Result<(Volume, blizzard_core::Placement), VolumeError> {
    Volume::validate(spec, client.tract_size())?;
    let placement = match client.tlt().has_placement(spec.placement) {
        true => spec.placement,
        false => blizzard_core::Placement::Any,
    };
    let blob =
        match client.create_placed_blob(Some(manage::blob_id(&spec.name)), spec.replication, placement).await
        {
            Ok(b) => b,
            Err(ClientError::BlobExists(_)) => return Err(VolumeError::Exists(spec.name.clone())),
            Err(e) => return Err(e.into()),
        };
    let id = blob.id();
    let io = volume_io(&env, client, blob, &spec.name, writer).await?;
    match Volume::format(env, io, spec).await {
        Ok(v) => Ok((v, placement)),
        Err(e) => {
            let _ = client.delete_blob(id).await;
            Err(e)
        }
    }
}

/// `manage::open` over [`SimBlobIo`]: opens the volume, running its recovery.
pub(super) async fn open_volume(
    env: Env,
    client: &Client,
    name: &str,
    writer: Option<&Writer>,
) -> Result<Volume, VolumeError> {
    let blob = manage::find_blob(client, name).await?;
    let io = volume_io(&env, client, blob, name, writer).await?;
    Volume::open(env, io, PlantedBug::None).await
}
