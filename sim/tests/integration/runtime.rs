//! The replicated runtime under deterministic simulation
//! (`blizzard_sim::runtime`): 3 and 5 members through crashes (single
//! members and power failures of all, with unsynced writes lost, kept or
//! torn), cut, one-way and held links, and requests duplicated and
//! delivered late; the map's history linearizable,
//! every push applied exactly once, retries answered with the first reply,
//! every member's state the same at the end. One seed replays exactly, and
//! each planted bug is caught. Each seed runs in a process of its own.
//!
//! `SIM_SEEDS=N` runs more seeds (a soak); `scripts/test` runs hundreds in
//! an optimized build.

use std::process::Command;

/// The simulator binary: `RUNTIME_SIM_BIN` when set (`scripts/test` points it at
/// the optimized build with debug assertions, `target/sim/runtime-sim`, about ten
/// times faster per seed than a debug build), else this test build's.
fn bin() -> String {
    std::env::var("RUNTIME_SIM_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_runtime-sim").to_string())
}

fn seeds() -> u64 {
    std::env::var("SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3)
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin()).args(args).output().expect("run runtime-sim");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

fn field(out: &str, k: &str) -> u64 {
    out.split_whitespace()
        .filter_map(|f| f.strip_prefix(k))
        .filter_map(|v| v.parse().ok())
        .next()
        .unwrap_or(0)
}

/// Three members: linearizable, exactly once, in agreement, through every
/// kind of fault (each of which must have happened).
#[test]
fn three_members_stay_linearizable_and_exactly_once() {
    let n = seeds().to_string();
    let (ok, out) = run(&["--seeds", &n]);
    println!("{out}");
    assert!(ok && out.contains("violations=0"), "{out}");
    for k in [
        "acknowledged=",
        "member_crashes=",
        "power_failures=",
        "link_faults=",
        "retries_sent=",
        "duplicates_sent=",
    ] {
        assert!(field(&out, k) > 0, "no {k} in the run: that part went untested\n{out}");
    }
}

/// Five members, the same checks.
#[test]
fn five_members_stay_linearizable_and_exactly_once() {
    let n = (seeds() / 2).max(1).to_string();
    let (ok, out) = run(&["--seeds", &n, "--first", "1001", "--members", "5"]);
    println!("{out}");
    assert!(ok && out.contains("violations=0"), "{out}");
}

fn digest(out: &str) -> String {
    out.split_whitespace().find_map(|f| f.strip_prefix("trace_digest=")).unwrap_or("none").to_string()
}

/// One seed run twice (in two processes) produces the same event trace;
/// another seed produces a different one.
#[test]
fn a_seed_replays_exactly() {
    let (ok1, a) = run(&["--seed", "7", "--trace"]);
    let (ok2, b) = run(&["--seed", "7", "--trace"]);
    assert!(ok1 && ok2, "{a}\n{b}");
    assert!(a.lines().count() > 100, "{a}");
    assert_eq!(a, b);
    let (_, c) = run(&["--seed", "8"]);
    assert_ne!(digest(&a), digest(&c));
}

/// Each planted bug is caught, with the command that replays it.
fn caught(plant: &str, symptom: &str) {
    let (ok, out) = run(&["--seeds", "2", "--first", "3001", "--plant", plant]);
    assert!(!ok, "planted {plant} went unnoticed:\n{out}");
    assert!(out.contains(symptom), "planted {plant}: expected {symptom:?} in\n{out}");
    assert!(out.contains("replay: runtime-sim --seed"), "{out}");
    assert_eq!(field(&out, "violations="), 2, "planted {plant} slipped through some seeds:\n{out}");
}

/// A log that acknowledges appends it never synced: power failures lose
/// entries a majority acknowledged, which recovery refuses to hide.
#[test]
fn planted_ack_before_commit_is_caught() {
    caught("ack-before-commit", "synced records were lost");
}

/// Retries applied again instead of answered from the session table.
#[test]
fn planted_skip_session_dedup_is_caught() {
    caught("skip-session-dedup", "applied twice");
}

/// Conflicting operations applied in an order of each member's own.
#[test]
fn planted_parallel_conflicts_is_caught() {
    caught("parallel-conflicts", "VIOLATION");
}

/// An update whose reply the session forgot applied again. Only a late
/// copy reaches that path (the client has acknowledged the reply and
/// moved on), so it is caught with the network's duplicates and not
/// without them: the duplicates are what tests it.
#[test]
fn planted_apply_forgotten_is_caught_by_late_duplicates() {
    let (ok, out) = run(&["--seeds", "1", "--first", "3001", "--plant", "apply-forgotten"]);
    assert!(!ok && out.contains("VIOLATION") && out.contains("replay: runtime-sim --seed"), "{out}");
    let (ok, out) =
        run(&["--seeds", "1", "--first", "3001", "--plant", "apply-forgotten", "--duplicates", "0"]);
    assert!(
        ok && out.contains("violations=0"),
        "without duplicates nothing reaches the planted path:\n{out}"
    );
}
