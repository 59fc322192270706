//! The shared pieces a tractserver's background parts work with, handed
//! to each as one value: the service builds it once and clones it into
//! the filler and the scrubber (each `Arc`, so a clone shares, never
//! copies). Owning their own state (`fill::Fills`, scrub statistics)
//! stays with each part; only what they all read and call is here.

use std::sync::Arc;

use blizzard_env::Env;

use crate::blob_meta::BlobMetas;
use crate::heal::Healer;
use crate::peers::Peers;
use crate::rows::SharedRows;
use crate::store::Store;

#[derive(Clone)]
pub(crate) struct Parts {
    pub env: Env,
    /// This server's disk of tract slots.
    pub store: Arc<Store>,
    /// Other tractservers and the metadata service.
    pub peers: Arc<Peers>,
    /// The rows this server holds, replaced by each stored assignment.
    pub rows: Arc<SharedRows>,
    /// Blob metadata records (tract −1) held here.
    pub metas: Arc<BlobMetas>,
    /// Chunks fetched from the row's other members.
    pub healer: Arc<Healer>,
}
