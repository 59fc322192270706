//! The object store as a volume sees it: names under the volume's prefix
//! (design 0008, "Names"), creates that never overwrite
//! (`PutMode::Create`), and counts of every request sent, for the
//! benchmark's requests per write.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

use crate::error::LsvdError;

/// Requests sent to the object store, by type.
#[derive(Debug, Default)]
pub struct Counts {
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub deletes: AtomicU64,
    pub lists: AtomicU64,
    pub bytes_put: AtomicU64,
    pub bytes_got: AtomicU64,
    /// Of `bytes_put`: map checkpoints, and the cleaner's objects.
    pub checkpoint_bytes_put: AtomicU64,
    pub cleaning_bytes_put: AtomicU64,
}

/// A snapshot of [`Counts`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CountsNow {
    pub puts: u64,
    pub gets: u64,
    pub deletes: u64,
    pub lists: u64,
    pub bytes_put: u64,
    pub bytes_got: u64,
    pub checkpoint_bytes_put: u64,
    pub cleaning_bytes_put: u64,
}

impl Counts {
    pub fn now(&self) -> CountsNow {
        CountsNow {
            puts: self.puts.load(Ordering::Relaxed),
            gets: self.gets.load(Ordering::Relaxed),
            deletes: self.deletes.load(Ordering::Relaxed),
            lists: self.lists.load(Ordering::Relaxed),
            bytes_put: self.bytes_put.load(Ordering::Relaxed),
            bytes_got: self.bytes_got.load(Ordering::Relaxed),
            checkpoint_bytes_put: self.checkpoint_bytes_put.load(Ordering::Relaxed),
            cleaning_bytes_put: self.cleaning_bytes_put.load(Ordering::Relaxed),
        }
    }
}

/// What a create found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Created {
    /// The name was free and now holds these bytes.
    New,
    /// The name was taken (by another writer, or by an earlier try of this
    /// one whose reply was lost): nothing was written.
    Exists,
}

/// One volume's prefix in an object store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// Without leading or trailing '/'; may be empty.
    prefix: String,
    counts: Arc<Counts>,
}

/// The error's message, with its innermost cause when the message does
/// not already say it ("connection refused", "NoSuchBucket"): one line an
/// operator can act on.
fn message(e: &object_store::Error) -> String {
    let mut root: &dyn std::error::Error = e;
    while let Some(s) = root.source() {
        root = s;
    }
    let (outer, inner) = (e.to_string(), root.to_string());
    let line = if outer.contains(&inner) { outer } else { format!("{outer}: {inner}") };
    line.replace('\n', " ")
}

/// Maps a store error; `what` names the request.
fn map_err(what: &str, e: object_store::Error) -> LsvdError {
    use object_store::Error as E;
    let e_msg = message(&e);
    if e_msg.contains("NoSuchBucket") {
        return LsvdError::Invalid(format!("{what}: the bucket does not exist ({e_msg})"));
    }
    match e {
        E::NotFound { .. } => LsvdError::NotFound(what.to_string()),
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => {
            LsvdError::Denied(format!("{what}: {e_msg}"))
        }
        E::NotSupported { .. } | E::NotImplemented { .. } | E::InvalidPath { .. } => {
            LsvdError::Invalid(format!("{what}: {e_msg}"))
        }
        _ => LsvdError::Store(format!("{what}: {e_msg}")),
    }
}

impl Store {
    pub fn new(inner: Arc<dyn ObjectStore>, prefix: &str) -> Store {
        Store { inner, prefix: prefix.trim_matches('/').to_string(), counts: Arc::new(Counts::default()) }
    }

    /// The same prefix's requests counted in `counts` (shared with others).
    pub fn with_counts(mut self, counts: Arc<Counts>) -> Store {
        self.counts = counts;
        self
    }

    pub fn counts(&self) -> &Arc<Counts> {
        &self.counts
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The same store under another prefix (a clone's base).
    pub fn at(&self, prefix: &str) -> Store {
        Store {
            inner: self.inner.clone(),
            prefix: prefix.trim_matches('/').to_string(),
            counts: self.counts.clone(),
        }
    }

    fn path(&self, name: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(name)
        } else {
            Path::from(format!("{}/{name}", self.prefix))
        }
    }

    /// Creates `name` holding `parts` concatenated, unless it exists.
    pub async fn create(&self, name: &str, parts: Vec<Bytes>) -> Result<Created, LsvdError> {
        let payload: PutPayload = parts.into_iter().collect();
        let len = payload.content_length() as u64;
        let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
        self.counts.puts.fetch_add(1, Ordering::Relaxed);
        match self.inner.put_opts(&self.path(name), payload, opts).await {
            Ok(_) => {
                self.counts.bytes_put.fetch_add(len, Ordering::Relaxed);
                Ok(Created::New)
            }
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                Ok(Created::Exists)
            }
            // A create cannot miss its object: the bucket is missing.
            Err(e @ object_store::Error::NotFound { .. }) => Err(LsvdError::Invalid(format!(
                "creating {}: the bucket does not exist ({})",
                self.path(name),
                message(&e)
            ))),
            Err(e) => Err(map_err(&format!("creating {}", self.path(name)), e)),
        }
    }

    /// The whole object, or `None` if there is none.
    pub async fn get(&self, name: &str) -> Result<Option<Bytes>, LsvdError> {
        self.counts.gets.fetch_add(1, Ordering::Relaxed);
        let what = format!("reading {}", self.path(name));
        let r = match self.inner.get(&self.path(name)).await {
            Ok(r) => r,
            Err(e @ object_store::Error::NotFound { .. }) if !message(&e).contains("NoSuchBucket") => {
                return Ok(None)
            }
            Err(e) => return Err(map_err(&what, e)),
        };
        let b = r.bytes().await.map_err(|e| map_err(&what, e))?;
        self.counts.bytes_got.fetch_add(b.len() as u64, Ordering::Relaxed);
        Ok(Some(b))
    }

    /// Bytes `range` of `name` (`NotFound` if it does not exist).
    pub async fn get_range(&self, name: &str, range: Range<u64>) -> Result<Bytes, LsvdError> {
        self.counts.gets.fetch_add(1, Ordering::Relaxed);
        let want = range.end - range.start;
        let b = self
            .inner
            .get_range(&self.path(name), range)
            .await
            .map_err(|e| map_err(&format!("reading {}", self.path(name)), e))?;
        if b.len() as u64 != want {
            return Err(LsvdError::Corrupt(format!(
                "{}: asked for {want} bytes, got {}",
                self.path(name),
                b.len()
            )));
        }
        self.counts.bytes_got.fetch_add(want, Ordering::Relaxed);
        Ok(b)
    }

    /// The names under `dir/` (their last segment) and sizes, unsorted.
    pub async fn list(&self, dir: &str) -> Result<Vec<(String, u64)>, LsvdError> {
        self.counts.lists.fetch_add(1, Ordering::Relaxed);
        let base = self.path(dir);
        let mut s = self.inner.list(Some(&base));
        let mut out = Vec::new();
        while let Some(m) = s.next().await {
            let m = m.map_err(|e| map_err(&format!("listing {base}"), e))?;
            if let Some(last) = m.location.filename() {
                out.push((last.to_string(), m.size));
            }
        }
        Ok(out)
    }

    /// The names under `dir/`, relative to the prefix (all their
    /// segments, so they can be read and deleted), unsorted.
    pub async fn list_paths(&self, dir: &str) -> Result<Vec<String>, LsvdError> {
        self.counts.lists.fetch_add(1, Ordering::Relaxed);
        let base = self.path(dir);
        let strip = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        let mut s = self.inner.list(Some(&base));
        let mut out = Vec::new();
        while let Some(m) = s.next().await {
            let m = m.map_err(|e| map_err(&format!("listing {base}"), e))?;
            let full = m.location.to_string();
            if let Some(rel) = full.strip_prefix(&strip) {
                out.push(rel.to_string());
            }
        }
        Ok(out)
    }

    /// The newest object under `dir/` by modification time: its name (last
    /// segment) and seconds since the Unix epoch, as the store reports it.
    pub async fn newest(&self, dir: &str) -> Result<Option<(String, i64)>, LsvdError> {
        self.counts.lists.fetch_add(1, Ordering::Relaxed);
        let base = self.path(dir);
        let mut s = self.inner.list(Some(&base));
        let mut newest: Option<(String, i64)> = None;
        while let Some(m) = s.next().await {
            let m = m.map_err(|e| map_err(&format!("listing {base}"), e))?;
            let at = m.last_modified.timestamp();
            if let Some(last) = m.location.filename() {
                if newest.as_ref().is_none_or(|(_, t)| at >= *t) {
                    newest = Some((last.to_string(), at));
                }
            }
        }
        Ok(newest)
    }

    /// Deletes `name` (no error if it is already gone).
    pub async fn delete(&self, name: &str) -> Result<(), LsvdError> {
        self.counts.deletes.fetch_add(1, Ordering::Relaxed);
        match self.inner.delete(&self.path(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(map_err(&format!("deleting {}", self.path(name)), e)),
        }
    }
}

/// The name of data object `seq`.
pub fn object_name(seq: u64) -> String {
    format!("d/{seq:016x}")
}

/// The name of the checkpoint at `seq`.
pub fn checkpoint_name(seq: u64) -> String {
    format!("c/{seq:016x}")
}

/// The name of snapshot `name`'s record.
pub fn snapshot_name(name: &str) -> String {
    format!("s/{name}")
}

/// The name of the reference a clone (`uuid`) keeps on its base's snapshot.
pub fn clone_ref_name(snapshot: &str, uuid: u128) -> String {
    format!("k/{snapshot}/{uuid:032x}")
}

/// The descriptor's name.
pub const DESCRIPTOR: &str = "volume";

/// The seq a listed object or checkpoint name carries (its last segment).
pub fn parse_seq(leaf: &str) -> Option<u64> {
    (leaf.len() == 16).then(|| u64::from_str_radix(leaf, 16).ok()).flatten()
}
