//! The checker against the volume's commit modes: random crash trials find
//! no violations; planted bugs are caught; every crash outcome of small
//! crash points is tried.

use blizzard_crashcheck::{exhaustive, trial, CheckConfig};
use blizzard_volume::{CommitMode, FlushPolicy, PlantedBug};

fn trials() -> u64 {
    std::env::var("CRASH_TRIALS").ok().and_then(|s| s.parse().ok()).unwrap_or(50)
}

fn no_violations(cfg: &CheckConfig, first: u64) {
    let n = trials();
    let mut in_flight = 0;
    for seed in first..first + n {
        let t = trial(seed, cfg);
        assert!(t.violation.is_none(), "seed {seed}: {:?} ({t:?})", t.violation);
        in_flight += t.in_flight_at_crash;
    }
    assert!(in_flight > 0, "no trial crashed with writes in flight: the test proves nothing");
}

/// Write-through: every acknowledged write survives every crash.
#[test]
fn write_through_keeps_acknowledged_writes() {
    no_violations(&CheckConfig::new(CommitMode::WriteThrough, FlushPolicy::Durable), 1);
}

/// Fast-ack with durable flushes: prefix-consistent, and nothing before an
/// acknowledged flush is lost.
#[test]
fn fast_ack_durable_is_prefix_consistent() {
    no_violations(&CheckConfig::new(CommitMode::FastAck, FlushPolicy::Durable), 10_001);
}

/// Fast-ack with ordered (fast) flushes: prefix-consistent.
#[test]
fn fast_ack_ordered_is_prefix_consistent() {
    no_violations(&CheckConfig::new(CommitMode::FastAck, FlushPolicy::Ordered), 20_001);
}

/// Log commit with durable flushes: prefix-consistent, flushes durable.
#[test]
fn log_durable_is_prefix_consistent() {
    no_violations(&CheckConfig::new(CommitMode::Log, FlushPolicy::Durable), 30_001);
}

/// Log commit with ordered flushes: prefix-consistent.
#[test]
fn log_ordered_is_prefix_consistent() {
    no_violations(&CheckConfig::new(CommitMode::Log, FlushPolicy::Ordered), 40_001);
}

/// Three-way write-through and fast-ack: every replica reads alike after
/// recovery (the 2-way runs above check it too).
#[test]
fn three_way_replicas_agree_after_a_crash() {
    for (mode, seed) in [(CommitMode::WriteThrough, 50_001), (CommitMode::FastAck, 60_001)] {
        let mut cfg = CheckConfig::new(mode, FlushPolicy::Durable);
        cfg.replication = 3;
        no_violations(&cfg, seed);
    }
}

/// Opening after a crash without reconciling the marked tracts, or
/// writing before a tract's intent bit is durable, leaves blocks that read
/// differently from different replicas: caught, in both modes that keep
/// an intent log.
#[test]
fn planted_intent_bugs_are_caught() {
    for bug in [PlantedBug::SkipReconcile, PlantedBug::WriteBeforeIntent] {
        for mode in [CommitMode::WriteThrough, CommitMode::FastAck] {
            let mut cfg = CheckConfig::new(mode, FlushPolicy::Durable);
            cfg.planted = bug;
            let n = caught_within(&cfg, 1, 1000);
            println!("{bug:?} in {mode:?} caught after {n} crashes");
        }
    }
}

/// Snapshots in the workload (design 0011) are read back after the
/// crashes, in every mode, and deletions of them; a snapshot that skips
/// the durable flush, a write landing in the data a snapshot shares, and
/// a deletion giving back chunks later views read, are caught.
#[test]
fn snapshots_survive_crashes_and_planted_snapshot_bugs_are_caught() {
    for (mode, flush, replication, seed) in [
        (CommitMode::WriteThrough, FlushPolicy::Durable, 1, 70_001),
        (CommitMode::FastAck, FlushPolicy::Ordered, 3, 71_001),
        (CommitMode::Log, FlushPolicy::Durable, 3, 72_001),
    ] {
        let mut cfg = CheckConfig::new(mode, flush);
        cfg.replication = replication;
        let (mut read_back, mut deleted, mut rolled) = (0, 0, 0);
        for s in seed..seed + trials() {
            let t = trial(s, &cfg);
            assert!(t.violation.is_none(), "{mode:?} seed {s}: {:?}", t.violation);
            read_back += u64::from(t.snapshot_checked);
            deleted += u64::from(t.deleted);
            rolled += u64::from(t.rolled_back);
        }
        // (A served log volume refuses rollbacks: its trials take none.)
        assert!(
            rolled > 0 || mode == CommitMode::Log,
            "{mode:?}: no trial rolled back: the test proves nothing"
        );
        assert!(read_back > 0, "{mode:?}: no trial read a snapshot back: the test proves nothing");
        assert!(deleted > 0, "{mode:?}: no trial deleted a snapshot: the test proves nothing");
    }
    for (bug, mode) in [
        (PlantedBug::SnapshotSkipsFlush, CommitMode::FastAck),
        (PlantedBug::WriteIntoSnapshot, CommitMode::WriteThrough),
        (PlantedBug::WriteIntoSnapshot, CommitMode::Log),
        (PlantedBug::ReclaimReadChunks, CommitMode::WriteThrough),
        (PlantedBug::ReclaimReadChunks, CommitMode::FastAck),
        (PlantedBug::ReclaimReadChunks, CommitMode::Log),
        (PlantedBug::RollbackInPlace, CommitMode::WriteThrough),
        (PlantedBug::RollbackInPlace, CommitMode::FastAck),
    ] {
        let mut cfg = CheckConfig::new(mode, FlushPolicy::Durable);
        cfg.planted = bug;
        let n = caught_within(&cfg, 1, 1000);
        println!("{bug:?} in {mode:?} caught after {n} crashes");
    }
}

/// Shrinks and grows back among the writes (half the trials), crashes
/// inside them included, in every mode at 1- and 3-way: no violation, and
/// a grow that does not zero what it gains (so a cut-off shrink's data
/// comes back) is caught.
#[test]
fn resizes_survive_crashes_and_a_planted_grow_bug_is_caught() {
    for (mode, flush, replication, seed) in [
        (CommitMode::WriteThrough, FlushPolicy::Durable, 3, 73_001),
        (CommitMode::FastAck, FlushPolicy::Ordered, 1, 74_001),
        (CommitMode::Log, FlushPolicy::Durable, 3, 75_001),
    ] {
        let mut cfg = CheckConfig::new(mode, flush);
        cfg.replication = replication;
        let mut resized = 0;
        for s in seed..seed + trials() {
            let t = trial(s, &cfg);
            assert!(t.violation.is_none(), "{mode:?} seed {s}: {:?}", t.violation);
            resized += u64::from(t.resized);
        }
        assert!(resized > 0, "{mode:?}: no trial resized the volume: the test proves nothing");
    }
    for mode in [CommitMode::WriteThrough, CommitMode::FastAck, CommitMode::Log] {
        let mut cfg = CheckConfig::new(mode, FlushPolicy::Durable);
        cfg.planted = PlantedBug::GrowKeepsOldData;
        let n = caught_within(&cfg, 1, 1000);
        println!("grow-keeps-old-data in {mode:?} caught after {n} crashes");
    }
}

fn caught_within(cfg: &CheckConfig, first: u64, limit: u64) -> u64 {
    for seed in first..first + limit {
        if trial(seed, cfg).violation.is_some() {
            return seed - first + 1;
        }
    }
    panic!("planted bug {:?} not caught in {limit} crashes", cfg.planted);
}

/// A durable flush acknowledged before its writes are durable is caught.
#[test]
fn planted_early_durable_flush_is_caught() {
    let mut cfg = CheckConfig::new(CommitMode::FastAck, FlushPolicy::Durable);
    cfg.planted = PlantedBug::AckDurableFlushEarly;
    let n = caught_within(&cfg, 1, 1000);
    println!("ack-durable-flush-early caught after {n} crashes");
}

/// Issuing writes of a later epoch before earlier epochs retire is caught.
#[test]
fn planted_issue_across_epochs_is_caught() {
    let mut cfg = CheckConfig::new(CommitMode::FastAck, FlushPolicy::Ordered);
    cfg.planted = PlantedBug::IssueAcrossEpochs;
    let n = caught_within(&cfg, 1, 1000);
    println!("issue-across-epochs caught after {n} crashes");
}

/// Fast-ack taking cached (unsynced) writes as durable is caught: a crash
/// may drop them from an epoch that later epochs already followed.
#[test]
fn planted_skip_cache_sync_is_caught() {
    let mut cfg = CheckConfig::new(CommitMode::FastAck, FlushPolicy::Ordered);
    cfg.planted = PlantedBug::SkipCacheSync;
    let n = caught_within(&cfg, 1, 1000);
    println!("skip-cache-sync caught after {n} crashes");
}

/// Each planted log-mode bug is caught within 1,000 crashes.
#[test]
fn planted_log_bugs_are_caught() {
    for bug in [
        PlantedBug::SkipReadCrc,
        PlantedBug::AdvanceMapOutOfOrder,
        PlantedBug::RollForwardPastHole,
        PlantedBug::ReuseWithoutSeq,
        PlantedBug::AckDurableFlushEarly,
    ] {
        // Ordering bugs show with many epochs in flight (ordered flushes);
        // an early durable flush needs durable ones.
        let flush =
            if bug == PlantedBug::AckDurableFlushEarly { FlushPolicy::Durable } else { FlushPolicy::Ordered };
        let mut cfg = CheckConfig::new(CommitMode::Log, flush);
        cfg.planted = bug;
        // One replica: a torn block is then readable as such (with two,
        // replicas torn differently disagree and recovery stops anyway).
        cfg.replication = 1;
        let n = caught_within(&cfg, 1, 1000);
        println!("log {bug:?} caught after {n} crashes");
    }
}

/// Every subset of up to 10 in-flight writes landing, for many crash points.
#[test]
fn every_outcome_of_small_crash_points() {
    let mut total = 0;
    for (mode, flush) in [
        (CommitMode::WriteThrough, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Ordered),
        (CommitMode::Log, FlushPolicy::Durable),
    ] {
        let cfg = CheckConfig::new(mode, flush);
        let before = total;
        for seed in 0..40 {
            match exhaustive(seed, &cfg, 10) {
                Ok(n) => total += n,
                Err((mask, v)) => panic!("{mode:?}/{flush:?} seed {seed} outcome {mask:#b}: {v}"),
            }
        }
        println!("{mode:?}/{flush:?}: {} recoveries", total - before);
    }
    println!("exhaustive: {total} recoveries checked");
    assert!(total > 100);
}

/// A seed replays a trial exactly.
#[test]
fn trials_are_deterministic() {
    let cfg = CheckConfig::new(CommitMode::FastAck, FlushPolicy::Ordered);
    for seed in [3, 77, 1234] {
        let (a, b) = (trial(seed, &cfg), trial(seed, &cfg));
        assert_eq!((a.ops, a.acked, a.in_flight_at_crash), (b.ops, b.acked, b.in_flight_at_crash));
    }
}
