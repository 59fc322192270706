//! The backup journal's index (`tractserver::backup::index`, Ursa §3.3)
//! beside a plain interval list, on one tract: what an insert and a lookup
//! cost, and how many entries each holds.
//!
//!     cargo run --release -p blizzard-bench --bin index-bench -- [--writes 1000,10000,100000] [--lookups N] [--list-budget-s S]
//!
//! The workload: one tract of 8 MiB, N writes of 4–64 KiB at random 4 KiB
//! aligned offsets (each its own journal record), then `--lookups` reads of
//! 4–64 KiB, aligned the same way, from a fixed-seed RNG. The list keeps
//! every write, in write order; a lookup scans it newest first, taking the
//! parts of the range no newer write covered, until the range is covered
//! or the list ends, then sorts what it found and fills the holes (the
//! index's answer, computed without an index). The list runs a size only
//! while its runs are predicted to stay within `--list-budget-s` in all.
//! Both answer the first `--check` lookups of every size they both run,
//! compared outside the timing. Each size runs `--rounds` times on a fresh
//! structure; the medians are reported.
//!
//! One line per structure and size:
//! `index-bench: structure=S writes=N insert_ns=X lookup_ns=Y segments=Z`.

// A benchmark: real time, outside any simulation.
#![allow(clippy::disallowed_methods)]

use std::cmp::{max, min};
use std::hint::black_box;
use std::time::Instant;

use anyhow::{ensure, Result};
use clap::Parser;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_tractserver::backup::index::{JournalIndex, Loc, Piece};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The tract's size.
const TRACT: u32 = 8 << 20;
/// Writes and lookups start and end on this alignment.
const PAGE: u32 = 4 << 10;
/// Writes and lookups are 1 to this many pages (4–64 KiB).
const PAGES_MAX: u32 = 16;
/// The one tract's key.
const KEY: u32 = 0;

#[derive(Parser)]
struct Args {
    /// Sizes of the workload: writes inserted before the lookups.
    #[arg(long, value_delimiter = ',', default_values_t = [1_000, 10_000, 100_000])]
    writes: Vec<usize>,
    /// Lookups per size.
    #[arg(long, default_value_t = 100_000)]
    lookups: usize,
    /// Seconds the list's runs may take in all; a size predicted to go
    /// past it is skipped.
    #[arg(long, default_value_t = 10.0)]
    list_budget_s: f64,
    /// Lookups whose answers the two structures must agree on.
    #[arg(long, default_value_t = 1_000)]
    check: usize,
    /// Runs per structure and size, each on a fresh structure; the median
    /// is reported (a first run also pays for faulting memory in).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
}

/// What the benchmark asks of a structure.
trait Structure {
    const NAME: &'static str;
    fn insert(&mut self, start: u32, end: u32, loc: Loc);
    /// The pieces of `start..end`, in order, into `out`.
    fn lookup(&mut self, start: u32, end: u32, out: &mut Vec<Piece>);
    /// Entries held.
    fn segments(&self) -> usize;
}

impl Structure for JournalIndex<u32> {
    const NAME: &'static str = "index";
    fn insert(&mut self, start: u32, end: u32, loc: Loc) {
        JournalIndex::insert(self, KEY, start, end, loc.record, loc.offset);
    }
    fn lookup(&mut self, start: u32, end: u32, out: &mut Vec<Piece>) {
        self.lookup_into(KEY, start, end, out);
    }
    fn segments(&self) -> usize {
        self.len()
    }
}

/// The baseline: every write kept, in write order.
#[derive(Default)]
struct IntervalList {
    writes: Vec<(u32, u32, Loc)>,
    /// Parts of the range looked up that no write scanned so far covers
    /// (kept across lookups to reuse the allocation).
    uncovered: Vec<(u32, u32)>,
}

impl Structure for IntervalList {
    const NAME: &'static str = "list";
    fn insert(&mut self, start: u32, end: u32, loc: Loc) {
        self.writes.push((start, end, loc));
    }

    fn lookup(&mut self, start: u32, end: u32, out: &mut Vec<Piece>) {
        out.clear();
        if start >= end {
            return;
        }
        self.uncovered.clear();
        self.uncovered.push((start, end));
        for &(s, e, loc) in self.writes.iter().rev() {
            if self.uncovered.is_empty() {
                break;
            }
            take_covered(&mut self.uncovered, s, e, loc, out);
        }
        out.sort_unstable_by_key(Piece::start);
        fill_holes(out, start, end);
    }

    fn segments(&self) -> usize {
        self.writes.len()
    }
}

/// Moves the parts of `uncovered` that write `s..e` at `loc` covers into
/// `out` as journal pieces; what it leaves of each part stays uncovered.
fn take_covered(uncovered: &mut Vec<(u32, u32)>, s: u32, e: u32, loc: Loc, out: &mut Vec<Piece>) {
    let mut i = 0;
    while i < uncovered.len() {
        let (us, ue) = uncovered[i];
        let (a, b) = (max(us, s), min(ue, e));
        if a >= b {
            i += 1;
            continue;
        }
        let at = Loc { record: loc.record, offset: loc.offset + (a - s) };
        out.push(Piece::Journal { start: a, end: b, loc: at });
        match (us < a, b < ue) {
            (false, false) => {
                // Order does not matter: the pieces are sorted at the end.
                uncovered.swap_remove(i);
                continue;
            }
            (true, false) => uncovered[i] = (us, a),
            (false, true) => uncovered[i] = (b, ue),
            (true, true) => {
                uncovered[i] = (us, a);
                uncovered.push((b, ue));
            }
        }
        i += 1;
    }
}

/// Adds disk pieces for the gaps between the sorted journal pieces in `out`.
fn fill_holes(out: &mut Vec<Piece>, start: u32, end: u32) {
    let journal = std::mem::take(out);
    let mut at = start;
    for p in journal {
        if at < p.start() {
            out.push(Piece::Disk { start: at, end: p.start() });
        }
        at = p.end();
        out.push(p);
    }
    if at < end {
        out.push(Piece::Disk { start: at, end });
    }
}

/// `n` ranges of 1 to `PAGES_MAX` pages at page-aligned offsets in the tract.
fn ranges(n: usize, seed: u64) -> Vec<(u32, u32)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let len = rng.random_range(1..=PAGES_MAX) * PAGE;
            let start = rng.random_range(0..=(TRACT - len) / PAGE) * PAGE;
            (start, start + len)
        })
        .collect()
}

struct Timing {
    insert_ns: f64,
    lookup_ns: f64,
    segments: usize,
    /// The answers to the first lookups, for the agreement check.
    answers: Vec<Vec<Piece>>,
    total_s: f64,
}

/// `rounds` runs of `run` on fresh structures: the median times, with the
/// first run's answers and entries (every run holds the same).
fn median_run<S: Structure + Default>(
    rounds: usize,
    writes: &[(u32, u32)],
    lookups: &[(u32, u32)],
    check: usize,
) -> Timing {
    let mut runs: Vec<Timing> =
        (0..rounds.max(1)).map(|_| run(S::default(), writes, lookups, check)).collect();
    let total_s = runs.iter().map(|t| t.total_s).sum();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let insert_ns = median(&mut runs.iter().map(|t| t.insert_ns).collect());
    let lookup_ns = median(&mut runs.iter().map(|t| t.lookup_ns).collect());
    let first = runs.swap_remove(0);
    Timing { insert_ns, lookup_ns, total_s, ..first }
}

/// Inserts every write (write i is record i), then runs every lookup.
fn run<S: Structure>(mut s: S, writes: &[(u32, u32)], lookups: &[(u32, u32)], check: usize) -> Timing {
    let began = Instant::now();
    for (record, &(start, end)) in (0u64..).zip(writes) {
        s.insert(start, end, Loc { record, offset: 0 });
    }
    let inserted = began.elapsed();
    let mut out = Vec::new();
    let looking = Instant::now();
    for &(start, end) in lookups {
        s.lookup(start, end, &mut out);
        black_box(&out);
    }
    let looked = looking.elapsed();
    let answers = lookups
        .iter()
        .take(check)
        .map(|&(start, end)| {
            s.lookup(start, end, &mut out);
            coalesced(&out)
        })
        .collect();
    Timing {
        insert_ns: inserted.as_nanos() as f64 / writes.len().max(1) as f64,
        lookup_ns: looked.as_nanos() as f64 / lookups.len().max(1) as f64,
        segments: s.segments(),
        answers,
        total_s: began.elapsed().as_secs_f64(),
    }
}

/// `pieces` with journal pieces that continue one another (same record,
/// contiguous offsets) joined, so two structures' answers compare equal
/// however each splits its entries.
fn coalesced(pieces: &[Piece]) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for &p in pieces {
        if let (Some(Piece::Journal { start, end, loc }), Piece::Journal { end: e, loc: l, .. }) =
            (out.last_mut(), p)
        {
            if l.record == loc.record && l.offset == loc.offset + (*end - *start) {
                *end = e;
                continue;
            }
        }
        out.push(p);
    }
    out
}

fn report(name: &str, n: usize, t: &Timing) {
    println!(
        "index-bench: structure={name} writes={n} insert_ns={:.0} lookup_ns={:.0} segments={}",
        t.insert_ns, t.lookup_ns, t.segments
    );
}

fn main() -> Result<()> {
    let args = Args::parse();
    let lookups = ranges(args.lookups, 2);
    println!(
        "index-bench: one tract of {} MiB, writes and lookups of 4-64 KiB at 4 KiB alignment, {} lookups per size",
        TRACT >> 20,
        args.lookups
    );
    let mut list_spent_s = 0.0;
    // The list's last run (writes, seconds), to predict the next.
    let mut list_last: Option<(usize, f64)> = None;
    for &n in &args.writes {
        let writes = ranges(n, 1);
        let index = median_run::<JournalIndex<u32>>(args.rounds, &writes, &lookups, args.check);
        report(<JournalIndex<u32> as Structure>::NAME, n, &index);
        // A list lookup scans up to every write held: predict the worst
        // case, time linear in the writes (once the tract is covered, a
        // lookup mostly stops early, so the runs come in under this).
        let predicted_s = list_last.map_or(0.0, |(m, s)| s * n as f64 / m as f64);
        if list_spent_s + predicted_s > args.list_budget_s {
            println!(
                "index-bench: structure={} writes={n} skipped (predicted {predicted_s:.1} s, past the {} s budget)",
                IntervalList::NAME,
                args.list_budget_s
            );
            continue;
        }
        let list = median_run::<IntervalList>(args.rounds, &writes, &lookups, args.check);
        report(IntervalList::NAME, n, &list);
        list_spent_s += list.total_s;
        list_last = Some((n, list.total_s));
        ensure!(index.answers == list.answers, "the index and the list disagree at {n} writes");
    }
    Ok(())
}
