//! Shared by the LSVD tests: a real SeaweedFS server started by the test
//! itself (`blizzard_testkit::weed`, shared with the CLI's tests), and
//! small helpers.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

pub use blizzard_testkit::weed::{Weed, KEY_ID, SECRET};

/// The store at `url` with the test credentials (passed, not through the
/// environment, which the test threads share).
pub fn store_at(url: &str) -> blizzard_lsvd::Store {
    let loc = blizzard_lsvd::s3::open_with_keys(url, Some((KEY_ID, SECRET))).expect("store");
    blizzard_lsvd::Store::new(loc.store, &loc.prefix)
}

pub fn cache_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("cache").join("journal")
}
