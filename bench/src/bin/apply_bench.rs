//! The replicated runtime's apply step, serial against commutativity-aware
//! parallel apply (the paper's §6.4 and Figure 8: about 2× serial), in one
//! invocation, on the same committed entries.
//!
//!     cargo run --release -p blizzard-bench --bin apply-bench -- [--ops N] [--commuting PCT] [--rounds R]
//!
//! The workload: map `Put`s of 256-byte values, `--commuting` percent of
//! them on keys no other operation of the run touches (they commute with
//! everything), the rest on one hot key (they conflict with each other and
//! keep their log order). Entries of 256 operations, handed to the state
//! machine 64 entries at a time, as openraft hands it committed runs.
//! Prints ops/s and CPU per operation of each mode and the gain; the last
//! line is `apply: serial=X parallel=Y ops_per_s gain=G commuting=P%`.
//!
//! `--work-ns N` makes every operation also spend N ns of CPU in its
//! apply (the paper's operations are persistent-memory transactions, far
//! costlier than an in-memory map update): how the gain grows with the
//! cost of an operation.

// A benchmark: real time, outside any simulation.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Parser;
use futures::stream;
use openraft::storage::RaftStateMachine;
use openraft::EntryPayload;

use blizzard_env::Env;
use blizzard_replicated::ds::ops::Update;
use blizzard_replicated::ds::Structures;
use blizzard_replicated::machine::{Machine, MachineConfig};
use blizzard_replicated::service::{Footprint, Position, Service};
use blizzard_replicated::types::{session_id, Batch, Entry, LeaderId, LogId, Op, OpKind};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
struct Args {
    /// Operations per round.
    #[arg(long, default_value_t = 400_000)]
    ops: usize,
    /// Percent of operations that commute with everything in their run.
    #[arg(long, default_value_t = 50)]
    commuting: u32,
    /// Rounds per mode, alternating; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Workers of the parallel mode.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// CPU each operation spends in its apply on top of the map update.
    #[arg(long, default_value_t = 0)]
    work_ns: u64,
}

/// The data structures, with `work_ns` of CPU added to every apply.
struct Costly {
    inner: Structures,
    work_ns: u64,
}

impl Service for Costly {
    type Op = <Structures as Service>::Op;
    type Snapshot = <Structures as Service>::Snapshot;
    fn decode(&self, b: &Bytes) -> Result<Self::Op, blizzard_proto::DecodeError> {
        self.inner.decode(b)
    }
    fn footprint(&self, op: &Self::Op) -> Footprint {
        self.inner.footprint(op)
    }
    fn apply(&self, op: &Self::Op, at: Position) -> Bytes {
        let r = self.inner.apply(op, at);
        if self.work_ns > 0 {
            let until = Instant::now() + Duration::from_nanos(self.work_ns);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        r
    }
    fn read(&self, q: &Bytes) -> Result<Bytes, String> {
        self.inner.read(q)
    }
    fn snapshot(&self) -> Self::Snapshot {
        self.inner.snapshot()
    }
    fn write_snapshot(&self, s: &Self::Snapshot, out: &mut dyn FnMut(Bytes)) {
        self.inner.write_snapshot(s, out)
    }
    fn restore(&self, b: &Bytes) -> Result<(), blizzard_proto::DecodeError> {
        self.inner.restore(b)
    }
}

const OPS_PER_ENTRY: usize = 256;
const ENTRIES_PER_RUN: usize = 64;

fn log_id(index: u64) -> LogId {
    LogId { leader_id: LeaderId { term: 1, node_id: 1 }, index }
}

/// The committed runs: a session opens in the first entry, then entries
/// of updates.
fn workload(a: &Args) -> Vec<Vec<Entry>> {
    let session = session_id(1, 0);
    let open = Entry {
        log_id: log_id(1),
        payload: EntryPayload::Normal(Batch {
            ops: vec![Op { session: 0, seq: 0, acked_below: 0, kind: OpKind::OpenSession }],
        }),
    };
    let value = Bytes::from(vec![7u8; 256]);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut entries = vec![open];
    let mut index = 2u64;
    let mut ops = Vec::with_capacity(OPS_PER_ENTRY);
    for (seq, i) in (1u64..).zip(0..a.ops) {
        let key = if next() % 100 < a.commuting as u64 {
            // Distinct: no other operation touches it.
            Bytes::from(format!("k{i:09}"))
        } else {
            Bytes::from_static(b"hot")
        };
        let u = Update::Put { key, value: value.clone() };
        ops.push(Op { session, seq, acked_below: seq, kind: OpKind::Update(u.encode()) });
        if ops.len() == OPS_PER_ENTRY {
            entries.push(Entry {
                log_id: log_id(index),
                payload: EntryPayload::Normal(Batch { ops: std::mem::take(&mut ops) }),
            });
            index += 1;
        }
    }
    if !ops.is_empty() {
        entries.push(Entry { log_id: log_id(index), payload: EntryPayload::Normal(Batch { ops }) });
    }
    entries.chunks(ENTRIES_PER_RUN).map(|c| c.to_vec()).collect()
}

/// CPU time this process has used (user + system).
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after ")".
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

async fn round(runs: &[Vec<Entry>], threads: usize, work_ns: u64) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let cfg = MachineConfig { apply_threads: threads, plant: None };
    let svc = Arc::new(Costly { inner: Structures::new(), work_ns });
    let mut m = Machine::open(&Env::real(), dir.path(), svc, cfg).await?;
    let ops: usize = runs
        .iter()
        .flatten()
        .map(|e| match &e.payload {
            EntryPayload::Normal(b) => b.ops.len(),
            _ => 0,
        })
        .sum();
    let (t0, c0) = (Instant::now(), cpu_time());
    for run in runs {
        let s = stream::iter(run.iter().cloned().map(|e| Ok((e, None))));
        m.apply(s).await.context("apply")?;
    }
    let (secs, cpu) = (t0.elapsed().as_secs_f64(), (cpu_time() - c0).as_secs_f64());
    Ok((ops as f64 / secs, cpu * 1e6 / ops as f64))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let a = Args::parse();
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(a.workers.max(2)).enable_all().build()?;
    let runs = workload(&a);
    println!(
        "apply-bench: {} ops of 256-byte puts (+{} ns of work each), {}% commuting, entries of {OPS_PER_ENTRY}, runs of {ENTRIES_PER_RUN} entries, {} rounds",
        a.ops, a.work_ns, a.commuting, a.rounds
    );
    let (mut serial, mut parallel, mut serial_cpu, mut parallel_cpu) = (vec![], vec![], vec![], vec![]);
    for r in 0..a.rounds {
        let (s, sc) = rt.block_on(round(&runs, 1, a.work_ns))?;
        let (p, pc) = rt.block_on(round(&runs, a.workers, a.work_ns))?;
        println!("  round {r}: serial {s:.0} ops/s ({sc:.2} µs CPU/op), parallel ({} workers) {p:.0} ops/s ({pc:.2} µs CPU/op)", a.workers);
        serial.push(s);
        parallel.push(p);
        serial_cpu.push(sc);
        parallel_cpu.push(pc);
    }
    let (s, p) = (median(serial), median(parallel));
    println!(
        "serial {s:.0} ops/s at {:.2} µs CPU/op; parallel {p:.0} ops/s at {:.2} µs CPU/op",
        median(serial_cpu),
        median(parallel_cpu)
    );
    println!(
        "apply: serial={s:.0} parallel={p:.0} ops_per_s gain={:.2} commuting={}% work_ns={}",
        p / s,
        a.commuting,
        a.work_ns
    );
    Ok(())
}
