//! Changing a volume in place while it may be served: online resize
//! and rollback (design 0011), and who uses it ([`Volume::attach`], which
//! a rollback consults). The superblock and catalog writes are each one
//! switch; the crash cases are in design 0011's tables.

use std::sync::Arc;

use super::{striping_for, Volume};
use crate::cache::Data;
use crate::intent;
use crate::io::BlobIo;
use crate::superblock::{CommitMode, Superblock};
use crate::{PlantedBug, VolumeError};

/// One user of a volume, from [`Volume::attach`] until dropped.
pub struct Attached {
    volume: std::sync::Weak<Volume>,
    id: u64,
}

impl Drop for Attached {
    fn drop(&mut self) {
        if let Some(v) = self.volume.upgrade() {
            blizzard_env::lock(&v.users).retain(|(id, _)| *id != self.id);
        }
    }
}

impl Volume {
    /// Records `who` as using the volume until the guard is dropped (an
    /// NBD client while connected).
    pub fn attach(self: &Arc<Self>, who: String) -> Attached {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        blizzard_env::lock(&self.users).push((id, who));
        Attached { volume: Arc::downgrade(self), id }
    }

    /// Who uses the volume now ([`Volume::attach`]).
    pub fn users(&self) -> Vec<String> {
        blizzard_env::lock(&self.users).iter().map(|(_, w)| w.clone()).collect()
    }

    /// Rolls this served volume back to snapshot `name`
    /// (`snap::stack::rollback`): it then reads exactly as the snapshot,
    /// its size unchanged (zeros past the snapshot's), every snapshot
    /// kept. Refused while anyone uses the volume ([`Volume::attach`]),
    /// naming them. Returns the bytes copied (what changed since).
    pub async fn rollback(&self, name: &str) -> Result<u64, VolumeError> {
        self.writable("be rolled back")?;
        let Some(layers) = &self.layers else {
            return Err(VolumeError::Unsupported(format!(
                "volume {:?} is an S3 volume: roll back by cloning the snapshot (volume clone {}@{name} NEW)",
                self.sb.name, self.sb.name
            )));
        };
        self.unused()?;
        if self.sb.mode == CommitMode::Log {
            // Its engine's map is the log's state before: it would have to
            // be recovered again from the rolled-back layers.
            return Err(VolumeError::Refused(format!(
                "log volume {:?} is served here: stop the server, then roll it back (it is then done without opening the log)",
                self.sb.name
            )));
        }
        let _alone = self.gate.write().await;
        self.unused()?;
        let _held = self.engine.freeze().await?;
        let current = blizzard_env::lock(&self.written).clone();
        crate::snap::stack::rollback(layers, &current, name, self.planted).await
    }

    /// Refuses while anyone uses the volume, naming them.
    fn unused(&self) -> Result<(), VolumeError> {
        let users = self.users();
        if users.is_empty() {
            return Ok(());
        }
        Err(VolumeError::Refused(format!(
            "volume {:?} is in use by {}: disconnect {} first",
            self.sb.name,
            users.join(", "),
            if users.len() == 1 { "it" } else { "them" }
        )))
    }

    /// Rolls the volume in `io` back to snapshot `name` with nothing
    /// serving it: claimed and its superblock and catalog settled as an
    /// open does, but no engine started (a log's state is recovered from
    /// the rolled-back layers at the next open). The old head it freezes
    /// is shadowed whole by the new one, so what a crash left unreconciled
    /// there is read by no view. Releases `io` after.
    pub async fn rollback_closed(io: Arc<dyn BlobIo>, name: &str) -> Result<u64, VolumeError> {
        let r = async {
            let sb = Self::read_superblock(&io).await?;
            if sb.backend.s3().is_some() {
                return Err(VolumeError::Unsupported(format!(
                    "volume {:?} is an S3 volume: roll back by cloning the snapshot (volume clone {}@{name} NEW)",
                    sb.name, sb.name
                )));
            }
            let _claim = intent::claim(&io).await?;
            let sb = if io.replication() > 1 || sb.mode == CommitMode::Log {
                Self::settle_superblock(&io).await?
            } else {
                sb
            };
            let striping = striping_for(&sb, io.tract_size());
            let layers = crate::snap::stack::open(
                io.clone(),
                &sb,
                Self::data_tracts(&sb, &striping, io.tract_size()),
                true,
                PlantedBug::None,
            )
            .await?;
            crate::snap::stack::rollback(&layers, &sb, name, PlantedBug::None).await
        }
        .await;
        let released = io.release().await;
        let copied = r?;
        released?;
        Ok(copied)
    }

    /// Resizes the volume to `size_bytes`, while it is served or not.
    /// Shrinking takes `allow_shrink` (what is past the new end is gone).
    /// The superblock write is the switch: a crash before it leaves the
    /// old size, after it the new. Writes wait from the start to the
    /// switch; reads go on.
    ///
    /// Invariant: every byte past the size reads as zeros once it is
    /// inside the size again. A grow zeroes what it gains below the
    /// engine's reach, durably, *before* its switch (a shrink's data may
    /// still be there: its trims come after its switch, and a crash can
    /// cut them off). A shrink zeroes past its end after its switch only
    /// to give the space back. A log volume grows its log first when the
    /// new size needs more blocks (`LogEngine::grow`; design 0003).
    pub async fn resize(&self, size_bytes: u64, allow_shrink: bool) -> Result<(), VolumeError> {
        use std::sync::atomic::Ordering;
        self.writable("be resized")?;
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            return Err(VolumeError::Invalid(format!(
                "size {size_bytes} is not a positive multiple of 512 bytes"
            )));
        }
        let _alone = self.gate.write().await;
        let old = self.size.load(Ordering::Acquire);
        if size_bytes < old && !allow_shrink {
            return Err(VolumeError::Invalid(format!(
                "volume {:?} is {old} bytes: shrinking it to {size_bytes} discards everything past that; pass --allow-shrink if that is meant",
                self.sb.name
            )));
        }
        if self.sb.mode == CommitMode::Log
            && size_bytes > old
            && blizzard_env::lock(&self.written).layers.is_some()
        {
            return Err(VolumeError::Unsupported(format!(
                "log volume {:?} has had snapshots: it cannot grow yet (a snapshot keeps the log's geometry it was taken with); shrinking works",
                self.sb.name
            )));
        }
        if size_bytes == old {
            return Ok(());
        }
        // Every acknowledged write durable before the switch: a size is
        // durable once written, and must not overtake them (fast-ack's
        // ordered epochs, the log's).
        if size_bytes > old && self.planted != PlantedBug::GrowKeepsOldData {
            // Before the switch: the bytes gained read as zeros.
            self.zero_between(old, size_bytes.min(self.engine.reach())).await?;
        }
        self.engine.flush(true).await?;
        let mut next = blizzard_env::lock(&self.written).clone();
        next.size_bytes = size_bytes;
        next.generation += 1;
        let io = self.io.clone();
        let commit: crate::engine::Commit<'_> =
            Box::new(move |sb: Superblock| Box::pin(async move { Self::write_superblock(&io, &sb).await }));
        let written = self.engine.resize(next, commit).await?;
        self.size.store(size_bytes, Ordering::Release);
        *blizzard_env::lock(&self.written) = written;
        if size_bytes < old {
            // After the switch: giving the space back. A crash here leaves
            // it in use; the next grow zeroes it before it is seen.
            let to = old.min(self.engine.reach());
            if let Err(e) = async {
                self.zero_between(size_bytes, to).await?;
                self.engine.flush(true).await
            }
            .await
            {
                tracing::warn!(volume = %self.sb.name, error = %e, "shrunk, but the space past the new end is not all given back yet (the next grow zeroes it)");
            }
        }
        Ok(())
    }

    /// Zeroes `[from, to)` through the engine, a bounded piece at a time
    /// (a trim: the space is released). Nothing when `to <= from`.
    async fn zero_between(&self, from: u64, to: u64) -> Result<(), VolumeError> {
        const STEP: u64 = 256 << 20;
        let mut at = from;
        while at < to {
            let end = (at / STEP + 1).saturating_mul(STEP).min(to);
            self.engine.write(at, Data::Zero(end - at), false).await?;
            at = end;
        }
        Ok(())
    }
}
