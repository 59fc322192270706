//! The simulated network under turmoil: an echo server bound through a
//! host's `Env` and a client dialing it by host name.

use std::time::Duration;

use blizzard_sim::{sim_env, SimDisks};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

type Result<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

// A client on one simulated host reaches a server bound on 0.0.0.0 of
// another by "server:9000", data round-trips, and the listener reports the
// address other hosts dial.
#[test]
fn echo_over_simulated_tcp() -> Result {
    let mut sim = turmoil::Builder::new().rng_seed(1).build();
    sim.host("server", || async {
        let env = sim_env(1, "server", SimDisks::new(1));
        let l = env.bind("0.0.0.0:9000").await?;
        assert_eq!(l.local_addr(), "server:9000");
        loop {
            let (mut s, peer) = l.accept().await?;
            assert!(peer.starts_with("client:"), "peer {peer}");
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    sim.client("client", async {
        let env = sim_env(1, "client", SimDisks::new(2));
        // Binding another host's name is refused; port 0 gets a real port.
        assert!(env.bind("server:1").await.is_err());
        let l = env.bind("client:0").await?;
        assert!(l.local_addr().starts_with("client:") && !l.local_addr().ends_with(":0"));
        assert!(env.connect("unix:/tmp/x").await.is_err());
        assert!(env.connect("nosuchhost:9000").await.is_err());

        let mut s = env.connect("server:9000").await?;
        for i in 0..5u8 {
            let msg = vec![i; 100 + i as usize];
            s.write_all(&msg).await?;
            let mut back = vec![0u8; msg.len()];
            env.timeout(Duration::from_secs(5), s.read_exact(&mut back)).await.map_err(|_| "timed out")??;
            assert_eq!(back, msg);
        }
        Ok(())
    });
    sim.run()
}

/// When host "probe"'s one byte reaches "recv", sent 15 ms after "a" and
/// "b" each started writing 100 kB to "recv", whose link takes 1 MB/s,
/// with `window` bytes per connection allowed in the receiver's queue.
fn probe_arrival(window: usize) -> Result<Duration> {
    use blizzard_sim::{LinkConfig, Links, SimNet};
    use std::sync::{Arc, Mutex};
    let mut sim = turmoil::Builder::new()
        .rng_seed(1)
        .tick_duration(Duration::from_millis(1))
        .min_message_latency(Duration::ZERO)
        .max_message_latency(Duration::ZERO)
        .build();
    let mut cfg = LinkConfig::uniform(1_000_000);
    cfg.egress_bytes_per_sec = None;
    cfg.window_bytes = window;
    let links = Links::new(cfg);
    let env = move |host: &str| {
        let mut env = sim_env(1, host, SimDisks::new(1));
        env.net = Arc::new(SimNet::new(host).with_links(links.clone()));
        env
    };
    let arrived = Arc::new(Mutex::new(None));
    let (e, got) = (env.clone(), arrived.clone());
    sim.host("recv", move || {
        let (env, got) = (e("recv"), got.clone());
        async move {
            let l = env.bind("0.0.0.0:9000").await?;
            loop {
                let (mut s, peer) = l.accept().await?;
                let got = got.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 100_000];
                    let n = if peer.starts_with("probe") { 1 } else { buf.len() };
                    if s.read_exact(&mut buf[..n]).await.is_ok() && n == 1 {
                        *got.lock().unwrap_or_else(|p| p.into_inner()) = turmoil::sim_elapsed();
                    }
                });
            }
        }
    });
    for name in ["a", "b"] {
        let env = env(name);
        sim.client(name, async move {
            let mut s = env.connect("recv:9000").await?;
            s.write_all(&vec![1u8; 100_000]).await?;
            // Stay connected until the probe is done.
            env.sleep(Duration::from_secs(1)).await;
            Ok(())
        });
    }
    let probe = env("probe");
    sim.client("probe", async move {
        probe.sleep(Duration::from_millis(15)).await;
        let mut s = probe.connect("recv:9000").await?;
        s.write_all(&[7]).await?;
        probe.sleep(Duration::from_secs(1)).await;
        Ok(())
    });
    sim.run()?;
    let at = *arrived.lock().unwrap_or_else(|p| p.into_inner());
    at.ok_or_else(|| "the probe never arrived".into())
}

// A receiver's link is one FIFO queue for every connection into it: a
// byte sent behind two 100 kB writes arrives after both (200 ms at 1 MB/s);
// with 10 kB windows each connection keeps at most one 10 kB piece queued
// ahead of it, and the byte arrives about 30 ms in (b's piece till 20 ms,
// then a's, reserved at 10 ms), before the rest of either write. (Bounds
// allow for the 1 ms steps the writes start and wake on.)
#[test]
fn a_receivers_link_is_shared_and_windows_bound_its_queue() -> Result {
    let deep = probe_arrival(1 << 20)?;
    assert!(deep >= Duration::from_millis(200) && deep <= Duration::from_millis(204), "{deep:?}");
    let shallow = probe_arrival(10_000)?;
    assert!(shallow >= Duration::from_millis(30) && shallow <= Duration::from_millis(34), "{shallow:?}");
    Ok(())
}
