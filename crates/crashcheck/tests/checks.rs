//! The checker against the volume's commit modes: random crash trials find
//! no violations; planted bugs are caught; every crash outcome of small
//! crash points is tried.

use blizzard_crashcheck::{exhaustive, trial, CheckConfig};
use blizzard_volume::{CommitMode, FlushPolicy, PlantedBug};

fn trials() -> u64 {
    std::env::var("CRASH_TRIALS").ok().and_then(|s| s.parse().ok()).unwrap_or(100)
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

/// Every subset of up to 10 in-flight writes landing, for many crash points.
#[test]
fn every_outcome_of_small_crash_points() {
    let mut total = 0;
    for (mode, flush) in [
        (CommitMode::WriteThrough, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Durable),
        (CommitMode::FastAck, FlushPolicy::Ordered),
    ] {
        let cfg = CheckConfig::new(mode, flush);
        for seed in 0..40 {
            match exhaustive(seed, &cfg, 10) {
                Ok(n) => total += n,
                Err((mask, v)) => panic!("{mode:?}/{flush:?} seed {seed} outcome {mask:#b}: {v}"),
            }
        }
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
