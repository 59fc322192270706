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
