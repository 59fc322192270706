//! Determinism: a seed replays a simulated run exactly, judged by its trace.

use std::time::Duration;

use blizzard_sim::{sim_env, SimDisks, Trace};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Two clients send numbered messages after random pauses drawn from their
/// own `SimRng`; the server records arrivals, the clients the acks. Returns
/// the trace.
fn run(seed: u64) -> Result<Trace> {
    let trace = Trace::new();
    let mut sim = turmoil::Builder::new().rng_seed(seed).simulation_duration(Duration::from_secs(60)).build();
    let t = trace.clone();
    sim.host("server", move || {
        let t = t.clone();
        async move {
            let env = sim_env(seed, "server", SimDisks::new(seed));
            let l = env.bind("0.0.0.0:9000").await?;
            loop {
                let (mut s, peer) = l.accept().await?;
                t.event("server", format!("accept {peer}"));
                let t = t.clone();
                tokio::spawn(async move {
                    while let Ok(msg) = s.read_u64().await {
                        t.event("server", format!("got {msg}"));
                        if s.write_u64(msg).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
    for (k, name) in ["c1", "c2"].into_iter().enumerate() {
        let t = trace.clone();
        sim.client(name, async move {
            let env = sim_env(seed, name, SimDisks::new(seed));
            let mut s = env.connect("server:9000").await?;
            for i in 0..10u64 {
                env.sleep(Duration::from_millis(env.random_below(30))).await;
                let msg = (k as u64 + 1) * 100 + i;
                s.write_u64(msg).await?;
                let ack = s.read_u64().await?;
                assert_eq!(ack, msg);
                t.event(name, format!("ack {ack}"));
            }
            Ok(())
        });
    }
    sim.run()?;
    Ok(trace)
}

// The same seed gives the same trace (digest and lines); another seed a
// different one.
#[test]
fn same_seed_same_trace() -> Result {
    let a = run(42)?;
    let b = run(42)?;
    // 2 accepts + 20 arrivals + 20 acks.
    assert_eq!(a.len(), 42, "{a}");
    assert_eq!(a.lines(), b.lines());
    assert_eq!(a.digest(), b.digest());
    let c = run(43)?;
    assert_ne!(a.digest(), c.digest(), "seeds 42 and 43 ran identically:\n{a}");
    Ok(())
}
