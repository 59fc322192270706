//! Simulated disks outlive the software of a crashed host: the harness keeps
//! the host's `SimDisks`, crashes them with the host, and the next
//! incarnation finds exactly the synced state.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use blizzard_sim::{sim_env_incarnation, FaultConfig, SimDisks, Trace};
use bytes::Bytes;

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

// Each incarnation of a host reads a synced boot counter, and never sees the
// unsynced write that every crash loses.
#[test]
fn synced_state_survives_host_restart() -> Result {
    let seed = 5;
    // Every pending write is lost on crash, so the outcome is exact.
    let lose_all = FaultConfig {
        crash_lost_weight: 1,
        crash_kept_weight: 0,
        crash_torn_weight: 0,
        ..Default::default()
    };
    let disks = SimDisks::with_faults(seed, lose_all);
    let trace = Trace::new();
    let incarnation = Arc::new(AtomicU64::new(0));
    let mut sim = turmoil::Builder::new().rng_seed(seed).build();
    {
        let (disks, trace, incarnation) = (disks.clone(), trace.clone(), incarnation.clone());
        sim.host("ts1", move || {
            let (disks, trace) = (disks.clone(), trace.clone());
            let inc = incarnation.fetch_add(1, Ordering::SeqCst);
            async move {
                let env = sim_env_incarnation(seed, "ts1", inc, disks);
                let d = env.open_disk(Path::new("/dev/sim0"), Some(1 << 20)).await?;
                let boots =
                    u64::from_le_bytes(d.read_at(0, 8).await?[..].try_into().map_err(|_| "short read")?);
                let dirty = d.read_at(4096, 5).await?.to_vec();
                trace.event("ts1", format!("boot {boots} dirty {dirty:?} rng {}", env.random_u64() % 1000));
                d.write_at(vec![(0, Bytes::copy_from_slice(&(boots + 1).to_le_bytes()))]).await?;
                d.sync().await?;
                d.write_at(vec![(4096, Bytes::from_static(b"dirty"))]).await?;
                futures::future::pending::<()>().await;
                Ok(())
            }
        });
    }
    for _ in 0..3 {
        for _ in 0..10 {
            sim.step()?;
        }
        let report = disks.crash();
        sim.crash("ts1");
        trace.event_at(sim.elapsed(), "ts1", format!("crash lost {}", report.lost));
        sim.bounce("ts1");
    }
    for _ in 0..10 {
        sim.step()?;
    }
    let lines = trace.lines();
    let boots: Vec<&String> = lines.iter().filter(|l| l.contains("boot")).collect();
    assert_eq!(boots.len(), 4, "{trace}");
    for (i, l) in boots.iter().enumerate() {
        assert!(l.contains(&format!("boot {i} dirty [0, 0, 0, 0, 0]")), "{l}");
    }
    assert!(lines.iter().filter(|l| l.contains("crash lost 1")).count() == 3, "{trace}");
    // Each incarnation draws a different random stream.
    let rngs: std::collections::BTreeSet<&str> = boots.iter().filter_map(|l| l.rsplit(' ').next()).collect();
    assert!(rngs.len() > 1, "{trace}");
    Ok(())
}
