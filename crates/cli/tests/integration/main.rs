//! Real-process tests of the `blizzard` binary: the crate's integration tests
//! as one binary, each file a module, so the code they share is compiled and
//! linked once rather than once per file (see ARCHITECTURE, "Where the tests
//! are").

mod authz;
mod blob_snapshots;
mod cluster_tls;
mod common;
mod crash_sigkill;
mod fault_recovery;
mod hostile_peers;
mod hybrid_journal;
mod incremental_repair;
mod kv_failover;
mod lsvd_s3;
mod lsvd_snapshots;
mod meta_failover;
mod meta_failover_nbd;
mod nbd_apps;
mod nbd_upgrade;
mod partition;
mod replica_agreement;
mod resize_served;
mod tls_cli;
mod up_shutdown;
mod up_upgrade;
