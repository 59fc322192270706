//! Receiver-driven flow control in the simulator (a small version of
//! `flow-sim`): the latency bound it promises for small requests, and that
//! the same check fails when the receiver does not schedule.

use std::time::Duration;

use blizzard_sim::flow::{run_flow_sim, FlowMode, FlowReport, FlowSimConfig};

/// 16 senders of two 2 MiB tracts (the smallest that ask) into one
/// tractserver over 1 Gbit/s links, each connection filling up to 1 MiB
/// of the receiver's queue, and a grant window of two tracts.
fn small(mode: FlowMode) -> FlowSimConfig {
    FlowSimConfig {
        mode,
        senders: 16,
        tracts_per_sender: 2,
        tract_size: blizzard_rpc::LARGE_TRANSFER_MIN,
        link_bytes_per_sec: 125_000_000,
        conn_window_bytes: 1 << 20,
        grant_window_bytes: 2 * blizzard_rpc::LARGE_TRANSFER_MIN as u64,
        ..FlowSimConfig::default()
    }
}

/// What scheduling promises a small request: it queues behind at most a
/// grant window of large bytes at the receiver's link, plus 10 ms for its
/// own round trip (2 ms with 1 ms links), the replies' and the simulator's
/// 1 ms steps.
fn bound(cfg: &FlowSimConfig) -> Duration {
    blizzard_sim::link::transfer_time(cfg.grant_window_bytes, cfg.link_bytes_per_sec)
        + Duration::from_millis(2)
}

fn run(mode: FlowMode) -> Result<(FlowReport, Duration), String> {
    let cfg = small(mode);
    let r = run_flow_sim(3, &cfg)?;
    eprintln!(
        "{mode:?}: {} small writes, p99 {:?}, goodput {:.1} MB/s",
        r.small.len(),
        r.small_quantile(0.99),
        r.goodput_bytes_per_sec() / 1e6
    );
    assert!(r.small.len() >= 3, "{mode:?}: only {} small writes met the transfers", r.small.len());
    assert_eq!(r.large_bytes, 16 * 2 * (2 << 20), "{mode:?}: every tract is acknowledged");
    Ok((r, bound(&cfg)))
}

// With the receiver scheduling, small writes' p99 stays within a grant
// window's transfer time and the receiver's link stays busy; a receiver
// that clears every request-to-send at once (the planted bug), and senders
// that never ask, both break that bound several times over.
#[test]
fn scheduling_bounds_small_request_latency() -> Result<(), String> {
    let (on, limit) = run(FlowMode::Scheduled)?;
    let p99 = on.small_quantile(0.99);
    assert!(p99 <= limit, "scheduled p99 {p99:?} above the bound {limit:?}");
    let link = small(FlowMode::Scheduled).link_bytes_per_sec as f64;
    assert!(
        on.goodput_bytes_per_sec() >= 0.8 * link,
        "scheduled goodput {:.0} B/s is under 80% of the link",
        on.goodput_bytes_per_sec()
    );
    for mode in [FlowMode::GrantAll, FlowMode::Off] {
        let (r, limit) = run(mode)?;
        let p99 = r.small_quantile(0.99);
        assert!(
            p99 > 2 * limit,
            "{mode:?}: p99 {p99:?} is not far above the bound {limit:?}: the check cannot tell"
        );
    }
    Ok(())
}

// The experiment is a function of its seed: two runs measure the same.
#[test]
fn a_flow_run_replays() -> Result<(), String> {
    let cfg = FlowSimConfig { senders: 3, tracts_per_sender: 1, ..small(FlowMode::Scheduled) };
    let (a, b) = (run_flow_sim(5, &cfg)?, run_flow_sim(5, &cfg)?);
    assert_eq!((a.small, a.elapsed, a.received_bytes), (b.small, b.elapsed, b.received_bytes));
    Ok(())
}
