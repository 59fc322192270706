//! Which `blizzard` binary the real-process tests run.

/// `BLIZZARD_BIN` when set, else this test build's own binary.
/// `scripts/test` points it at the optimized build with debug assertions
/// (`target/sim/blizzard`, the `sim` profile): the same code, checked the
/// same way, several times faster than a debug build. Also handy for
/// running the tests against another revision when bisecting.
pub fn blizzard_bin() -> String {
    std::env::var("BLIZZARD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_blizzard").to_string())
}
