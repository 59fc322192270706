//! The flow-control experiment (issue 24, point 7): 16 senders of 8 MiB
//! tracts into one tractserver while a client sends it 4 KiB writes, over
//! 10 Gbit/s simulated links, without flow control, with requests-to-send
//! all granted at once, and with the receiver scheduling its grants.
//!
//!     flow-sim [--seed S] [--senders N] [--tracts N] [--tract-mib N]
//!              [--small-bytes N] [--gbps G] [--window-mib N]
//!              [--conn-window-kib N]
//!
//! Prints a table (one row per mode) and one summary line. Each mode runs
//! in a child process of its own (`--mode M` runs one and prints its row),
//! as `blob-sim` runs each seed: tokio numbers tasks process-wide, so a
//! run's schedule could otherwise depend on the runs before it. Every
//! figure is simulated time, the same for a seed on every machine.

use std::process::{Command, ExitCode};
use std::time::Duration;

use blizzard_sim::flow::{run_flow_sim, FlowMode, FlowReport, FlowSimConfig};

struct Args {
    seed: u64,
    mode: Option<FlowMode>,
    cfg: FlowSimConfig,
}

fn usage() -> ExitCode {
    eprintln!(
        "usage: flow-sim [--seed S] [--senders N] [--tracts N] [--tract-mib N] [--small-bytes N] [--gbps G] [--window-mib N] [--conn-window-kib N] [--mode off|grant-all|scheduled]"
    );
    ExitCode::from(2)
}

fn mode_flag(m: FlowMode) -> &'static str {
    match m {
        FlowMode::Off => "off",
        FlowMode::GrantAll => "grant-all",
        FlowMode::Scheduled => "scheduled",
    }
}

fn parse() -> Option<(Args, Vec<String>)> {
    let mut a = Args { seed: 1, mode: None, cfg: FlowSimConfig::default() };
    // Passed on to the children, all but --mode.
    let mut passed = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next()?;
        let num = || value.parse::<u64>().ok();
        match flag.as_str() {
            "--seed" => a.seed = num()?,
            "--senders" => a.cfg.senders = num()? as usize,
            "--tracts" => a.cfg.tracts_per_sender = num()?,
            "--tract-mib" => a.cfg.tract_size = u32::try_from(num()? << 20).ok()?,
            "--small-bytes" => a.cfg.small_bytes = num()? as usize,
            "--gbps" => a.cfg.link_bytes_per_sec = num()? * 125_000_000,
            "--window-mib" => a.cfg.grant_window_bytes = num()? << 20,
            "--conn-window-kib" => a.cfg.conn_window_bytes = (num()? << 10) as usize,
            "--mode" => {
                a.mode = Some(FlowMode::ALL.into_iter().find(|m| mode_flag(*m) == value)?);
                continue;
            }
            _ => return None,
        }
        passed.push(flag);
        passed.push(value);
    }
    Some((a, passed))
}

/// One row: the figures a child prints and the parent reads back.
struct Row {
    mode: FlowMode,
    n: usize,
    p50_us: u64,
    p99_us: u64,
    max_us: u64,
    goodput_mbps: f64,
    link_pct: f64,
}

impl Row {
    fn of(r: &FlowReport, link: u64) -> Row {
        let us = |d: Duration| d.as_micros() as u64;
        let goodput = r.goodput_bytes_per_sec();
        Row {
            mode: r.mode,
            n: r.small.len(),
            p50_us: us(r.small_quantile(0.5)),
            p99_us: us(r.small_quantile(0.99)),
            max_us: us(r.small_quantile(1.0)),
            goodput_mbps: goodput / 1e6,
            link_pct: 100.0 * goodput / link as f64,
        }
    }

    fn line(&self) -> String {
        format!(
            "row mode={} n={} p50_us={} p99_us={} max_us={} goodput_mbps={:.1} link_pct={:.1}",
            mode_flag(self.mode),
            self.n,
            self.p50_us,
            self.p99_us,
            self.max_us,
            self.goodput_mbps,
            self.link_pct
        )
    }

    fn parse(line: &str) -> Option<Row> {
        let mut f = std::collections::BTreeMap::new();
        for kv in line.strip_prefix("row ")?.split(' ') {
            let (k, v) = kv.split_once('=')?;
            f.insert(k, v);
        }
        let mode = *f.get("mode")?;
        Some(Row {
            mode: FlowMode::ALL.into_iter().find(|m| mode_flag(*m) == mode)?,
            n: f.get("n")?.parse().ok()?,
            p50_us: f.get("p50_us")?.parse().ok()?,
            p99_us: f.get("p99_us")?.parse().ok()?,
            max_us: f.get("max_us")?.parse().ok()?,
            goodput_mbps: f.get("goodput_mbps")?.parse().ok()?,
            link_pct: f.get("link_pct")?.parse().ok()?,
        })
    }
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn main() -> ExitCode {
    let Some((args, passed)) = parse() else { return usage() };
    let link = args.cfg.link_bytes_per_sec;
    if let Some(mode) = args.mode {
        let cfg = FlowSimConfig { mode, ..args.cfg };
        return match run_flow_sim(args.seed, &cfg) {
            Ok(r) => {
                println!("{}", Row::of(&r, link).line());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("flow-sim: {} failed: {e}", mode_flag(mode));
                ExitCode::FAILURE
            }
        };
    }
    let Ok(me) = std::env::current_exe() else {
        eprintln!("flow-sim: cannot find my own executable");
        return ExitCode::FAILURE;
    };
    let mut rows = Vec::new();
    for mode in FlowMode::ALL {
        let out = Command::new(&me).args(&passed).args(["--mode", mode_flag(mode)]).output();
        let row = out.ok().and_then(|o| {
            if !o.status.success() {
                eprint!("{}", String::from_utf8_lossy(&o.stderr));
            }
            String::from_utf8_lossy(&o.stdout).lines().find_map(Row::parse)
        });
        match row {
            Some(r) => rows.push(r),
            None => {
                eprintln!("flow-sim: mode {} produced no result", mode_flag(mode));
                return ExitCode::FAILURE;
            }
        }
    }
    let c = &args.cfg;
    println!(
        "flow-sim: seed {} | {} senders x {} tracts of {} MiB into one tractserver | {} B writes from one client | links {} Gbit/s, {} us one way, {} KiB send window per connection | grant window {} MiB",
        args.seed,
        c.senders,
        c.tracts_per_sender,
        c.tract_size >> 20,
        c.small_bytes,
        link / 125_000_000,
        c.latency.as_micros(),
        c.conn_window_bytes >> 10,
        c.grant_window_bytes >> 20
    );
    println!();
    println!("| mode | small writes | p50 ms | p99 ms | max ms | receiver goodput MB/s | % of link |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {:.0} | {:.1} |",
            r.mode.name(),
            r.n,
            ms(r.p50_us),
            ms(r.p99_us),
            ms(r.max_us),
            r.goodput_mbps,
            r.link_pct
        );
    }
    println!();
    let (off, on) = (&rows[0], &rows[2]);
    println!(
        "flow-sim: p99_off={}ms p99_on={}ms ({:.1}x lower) goodput_off={:.0}MB/s goodput_on={:.0}MB/s ({:.1}% vs {:.1}% of the link)",
        ms(off.p99_us),
        ms(on.p99_us),
        off.p99_us as f64 / on.p99_us.max(1) as f64,
        off.goodput_mbps,
        on.goodput_mbps,
        off.link_pct,
        on.link_pct
    );
    ExitCode::SUCCESS
}
