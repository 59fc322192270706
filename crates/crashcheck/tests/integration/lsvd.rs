//! LSVD volumes (design 0008) under random crashes: cache writes lost,
//! kept or torn, object puts lost in flight or landed unanswered, the
//! cache sometimes lost, recovery itself sometimes crashed. No violation
//! of prefix consistency or of a flush; planted bugs are caught.

use blizzard_crashcheck::lsvd::{lsvd_trial, LsvdCheck};
use blizzard_lsvd::Planted;

fn trials() -> u64 {
    std::env::var("CRASH_TRIALS").ok().and_then(|s| s.parse().ok()).unwrap_or(200)
}

// Random crashes never leave a state the contract forbids, and the trials
// did acknowledge writes and flushes (so the test could have failed).
#[test]
fn lsvd_survives_random_crashes() {
    let (mut acked, mut ops, mut cleaning, mut snapshots) = (0, 0, 0, 0);
    for seed in 1..=trials() {
        let t = lsvd_trial(seed, &LsvdCheck::default());
        assert!(t.violation.is_none(), "seed {seed}: {:?} ({t:?})", t.violation);
        acked += t.acked;
        ops += t.ops;
        cleaning += (t.objects_deleted > 0) as u64;
        snapshots += t.snapshot_checked as u64;
    }
    assert!(acked > ops / 4, "too few acknowledged operations ({acked} of {ops}): the test proves little");
    assert!(cleaning > trials() / 10, "cleaning deleted objects in only {cleaning} trials");
    assert!(snapshots > trials() / 3, "a snapshot was read back in only {snapshots} trials");
    eprintln!(
        "{} trials, cleaning deleted objects in {cleaning}, snapshots checked in {snapshots}",
        trials()
    );
}

fn caught(planted: Planted, within: u64) -> Option<u64> {
    let c = LsvdCheck { planted, ..LsvdCheck::default() };
    (1..=within).find(|&seed| lsvd_trial(seed, &c).violation.is_some())
}

// Moving the journal's tail past records before their object is durable
// loses flushed writes when the put is cut off: caught.
#[test]
fn planted_reclaim_before_put_is_caught() {
    assert!(
        caught(Planted::ReclaimBeforePut, 1000).is_some(),
        "planted ReclaimBeforePut not caught in 1000 trials"
    );
}

// Destaging journal records no sync covered lets a host crash leave the
// object log ahead of the journal, a state recovery refuses (the cache is
// older than the log): caught.
#[test]
fn planted_destage_before_sync_is_caught() {
    assert!(
        caught(Planted::DestageBeforeSync, 1000).is_some(),
        "planted DestageBeforeSync not caught in 1000 trials"
    );
}

// A cleaner that ignores snapshots deletes objects a snapshot reads (or
// rewrites what it reads): the snapshot no longer reads as it was. Caught.
#[test]
fn planted_gc_ignores_snapshots_is_caught() {
    assert!(
        caught(Planted::GcIgnoresSnapshots, 1000).is_some(),
        "planted GcIgnoresSnapshots not caught in 1000 trials"
    );
}
