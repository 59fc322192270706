//! What the benchmark binaries share.

/// User + system CPU time of this process (client and tractservers
/// together), from /proc/self/stat in clock ticks of 1/100 s (CLK_TCK on
/// Linux). Zero if it cannot be read.
pub fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesized command name; utime and stime are the
    // 14th and 15th fields of the whole line.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// A size on the command line (`4KiB`, `1GiB`, `512`), for clap's
/// `value_parser`.
pub fn size_arg(s: &str) -> Result<u64, String> {
    blizzard_core::units::parse_size(s).map_err(|e| e.to_string())
}
