//! Running many seeds, each in its own child process, `jobs` at a time
//! (`blob-sim --seeds N`, `runtime-sim --seeds N`).
//!
//! A pool, not batches: a new seed starts as soon as any running one ends,
//! so one long seed does not leave the other cores idle (batches of two
//! waited for the slower seed of each pair).

use std::io;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// Real time a seed may take. A seed takes well under 10 s in the
/// optimized build; one that runs longer is stuck in a loop that never
/// yields to the simulator (simulated time stops, so turmoil's own limit
/// never fires): a liveness bug to report with its seed, not a CI run that
/// never ends.
pub const SEED_WALL_LIMIT: Duration = Duration::from_secs(300);

/// How often the pool looks at its children.
const POLL: Duration = Duration::from_millis(20);

/// Runs `exe --seed S args..` for every seed, at most `jobs` at once, and
/// hands each finished seed to `done` (in the order they finish): its
/// output, or an error (`TimedOut` for a seed past [`SEED_WALL_LIMIT`],
/// which is killed). A seed's output is one line or, on a failure, a trace
/// tail: small enough for the pipes' buffers, so reading it after the exit
/// cannot block the child.
#[allow(clippy::disallowed_methods, reason = "the harness's own real time, outside any simulation")]
pub fn run_seeds(
    exe: &std::path::Path,
    seeds: &[u64],
    jobs: usize,
    args: &[String],
    mut done: impl FnMut(u64, io::Result<Output>),
) {
    let mut queue = seeds.iter().copied();
    let mut running: Vec<(u64, std::time::Instant, Child)> = Vec::new();
    loop {
        while running.len() < jobs.max(1) {
            let Some(seed) = queue.next() else { break };
            let child = Command::new(exe)
                .arg("--seed")
                .arg(seed.to_string())
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn();
            match child {
                Ok(c) => running.push((seed, std::time::Instant::now(), c)),
                Err(e) => done(seed, Err(e)),
            }
        }
        if running.is_empty() {
            return;
        }
        let mut i = 0;
        while i < running.len() {
            let (seed, started, child) = &mut running[i];
            let finished = match child.try_wait() {
                Ok(Some(_)) => true,
                Ok(None) if started.elapsed() > SEED_WALL_LIMIT => true,
                Ok(None) => false,
                Err(_) => true,
            };
            if !finished {
                i += 1;
                continue;
            }
            let (seed, started) = (*seed, *started);
            let (_, _, mut child) = running.swap_remove(i);
            let out = match child.try_wait() {
                Ok(Some(_)) => child.wait_with_output(),
                Ok(None) if started.elapsed() > SEED_WALL_LIMIT => {
                    let _ = child.kill();
                    let _ = child.wait();
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "the seed ran {} s of real time without finishing: something loops without yielding (a hang)",
                            SEED_WALL_LIMIT.as_secs()
                        ),
                    ))
                }
                Ok(None) => child.wait_with_output(),
                Err(e) => Err(e),
            };
            done(seed, out);
        }
        std::thread::sleep(POLL);
    }
}

/// The number after `key` in a seed's summary line (`key=N`), or 0.
pub fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace().find_map(|f| f.strip_prefix(key)).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_a_summary_line() {
        let line = "seed=3 ok acknowledged_writes=41 rows_refilled=8";
        assert_eq!(field(line, "acknowledged_writes="), 41);
        assert_eq!(field(line, "rows_refilled="), 8);
        assert_eq!(field(line, "missing="), 0);
    }

    /// Every seed is run once and reported, whatever the pool size.
    #[test]
    fn every_seed_is_reported_once() {
        let sh = std::path::Path::new("/bin/sh");
        // `sh --seed S` refuses the option and exits 2: a failed seed,
        // reported like any other.
        let seeds: Vec<u64> = (1..=5).collect();
        let mut got = Vec::new();
        run_seeds(sh, &seeds, 2, &[], |s, out| {
            assert!(out.is_ok());
            got.push(s);
        });
        got.sort_unstable();
        assert_eq!(got, seeds);
    }
}
