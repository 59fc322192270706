//! Runs the replicated runtime's simulation (`blizzard_sim::runtime`): one
//! seed in this process, or many seeds each in a child process of its own
//! (for the same reason as `blob-sim`: tokio numbers tasks per process, so
//! a fresh process per seed replays exactly).
//!
//!     runtime-sim --seed 7 [--trace]          one seed; exit 1 on a violation
//!     runtime-sim --seeds 200 [--first 1]     seeds 1..=200, two at a time
//!
//! Options: `--members N` (3), `--clients N` (4), `--ops N` per client
//! (120), `--no-crashes`, `--no-partitions`, `--duplicates N` (one
//! request in N delivered twice, late; 40; 0: none), `--plant
//! ack-before-commit|skip-session-dedup|parallel-conflicts|apply-forgotten`.

use std::process::ExitCode;

use blizzard_sim::seeds::{field, run_seeds};
use blizzard_sim::{run_runtime_sim, RuntimePlant, RuntimeSimConfig};

struct Args {
    seed: Option<u64>,
    seeds: u64,
    first: u64,
    jobs: usize,
    trace: bool,
    cfg: RuntimeSimConfig,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: runtime-sim (--seed S [--trace] | --seeds N [--first F] [--jobs J]) [--members N] [--clients N] [--ops N] [--no-crashes] [--no-partitions] [--duplicates N] [--plant ack-before-commit|skip-session-dedup|parallel-conflicts|apply-forgotten]"
    );
    ExitCode::from(2)
}

fn parse() -> Option<Args> {
    let mut a =
        Args { seed: None, seeds: 0, first: 1, jobs: 2, trace: false, cfg: RuntimeSimConfig::default() };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = || it.next().and_then(|v| v.parse::<u64>().ok());
        match flag.as_str() {
            "--seed" => a.seed = Some(num()?),
            "--seeds" => a.seeds = num()?,
            "--first" => a.first = num()?,
            "--jobs" => a.jobs = num()?.max(1) as usize,
            "--members" => a.cfg.members = num()?.clamp(1, 9),
            "--clients" => a.cfg.clients = num()? as usize,
            "--ops" => a.cfg.ops_per_client = num()? as usize,
            "--trace" => a.trace = true,
            "--no-crashes" => a.cfg.crashes = false,
            "--no-partitions" => a.cfg.partitions = false,
            "--duplicates" => a.cfg.duplicates = num()? as u32,
            "--plant" => a.cfg.plant = RuntimePlant::parse(&it.next()?)?,
            _ => return None,
        }
    }
    Some(a)
}

fn config_flags(a: &Args) -> Vec<String> {
    let mut v = vec![
        "--members".to_string(),
        a.cfg.members.to_string(),
        "--clients".to_string(),
        a.cfg.clients.to_string(),
        "--ops".to_string(),
        a.cfg.ops_per_client.to_string(),
    ];
    if !a.cfg.crashes {
        v.push("--no-crashes".into());
    }
    if !a.cfg.partitions {
        v.push("--no-partitions".into());
    }
    v.extend(["--duplicates".into(), a.cfg.duplicates.to_string()]);
    if a.cfg.plant != RuntimePlant::None {
        v.extend(["--plant".into(), a.cfg.plant.name().into()]);
    }
    v
}

/// Fields of a seed's summary line added up over the seeds.
const FIELDS: [&str; 7] = [
    "acknowledged=",
    "pending=",
    "member_crashes=",
    "power_failures=",
    "link_faults=",
    "retries_sent=",
    "duplicates_sent=",
];

fn main() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let Some(a) = parse() else { return usage() };
    if let Some(seed) = a.seed {
        return match run_runtime_sim(seed, &a.cfg) {
            Ok(r) => {
                if a.trace {
                    println!("{}", r.trace);
                }
                println!(
                    "seed={} ok acknowledged={} pending={} member_crashes={} power_failures={} link_faults={} retries_sent={} duplicates_sent={} simulated_ms={} trace_digest={:016x}",
                    r.seed,
                    r.acknowledged,
                    r.pending,
                    r.member_crashes,
                    r.power_failures,
                    r.link_faults,
                    r.retries_sent,
                    r.duplicates_sent,
                    r.simulated.as_millis(),
                    r.trace.digest()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                println!("seed={seed} VIOLATION\n{e}");
                ExitCode::FAILURE
            }
        };
    }
    if a.seeds == 0 {
        return usage();
    }
    let Ok(exe) = std::env::current_exe() else {
        eprintln!("cannot find this program's path to run seeds in child processes");
        return ExitCode::FAILURE;
    };
    let seeds: Vec<u64> = (a.first..a.first + a.seeds).collect();
    let mut failed = Vec::new();
    let mut sums = [0u64; FIELDS.len()];
    run_seeds(&exe, &seeds, a.jobs, &config_flags(&a), |seed, out| match out {
        Ok(o) if o.status.success() => {
            let line = String::from_utf8_lossy(&o.stdout);
            for (sum, k) in sums.iter_mut().zip(FIELDS) {
                *sum += field(&line, k);
            }
        }
        Ok(o) => {
            println!("{}", String::from_utf8_lossy(&o.stdout));
            eprintln!("{}", String::from_utf8_lossy(&o.stderr));
            failed.push(seed);
        }
        Err(e) => {
            println!("seed={seed} VIOLATION\n{e}");
            failed.push(seed);
        }
    });
    failed.sort_unstable();
    let summary: Vec<String> = FIELDS.iter().zip(sums).map(|(k, n)| format!("{k}{n}")).collect();
    println!("seeds={} violations={} {}", seeds.len(), failed.len(), summary.join(" "));
    for s in &failed {
        println!("replay: runtime-sim --seed {s} --trace {}", config_flags(&a).join(" "));
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
