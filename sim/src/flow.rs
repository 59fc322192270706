//! The flow-control experiment (issue 24, point 7; FDS §4): many senders
//! of whole tracts into one tractserver while a client sends it small
//! requests, over bandwidth-limited links (`link`), with and without
//! receiver-driven flow control (`blizzard_rpc`'s `flow`).
//!
//! Hosts: a metadata server, one tractserver (the receiver: every tract of
//! a 1-way cluster with one member lands on it), `senders` blob clients
//! each writing `tracts_per_sender` whole tracts one after another, and a
//! client writing `small_bytes` at a time, one request after another with
//! `small_gap` between them. Everyone starts at the same simulated time,
//! after setup. Every host's link runs at `link_bytes_per_sec` both ways.
//!
//! Reported: the small writes' latencies (those issued before the last
//! tract was acknowledged: the ones that met the large transfers), and the
//! receiver's goodput: tract bytes acknowledged ÷ the time from the start
//! to the last acknowledgment.
//!
//! Three modes ([`FlowMode`]): senders that never ask (the path before
//! flow control), senders that ask a receiver that grants everything at
//! once (the round trip's cost alone), and the scheduled receiver (a
//! window of `window_bytes`). Everything is simulated time, so a seed
//! gives the same figures on every machine.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use blizzard_client::{Client, ClientConfig};
use blizzard_metaserver::server::{self as meta, MetaConfig};
use blizzard_rpc::{FlowLimits, ServerLimits};
use blizzard_tractserver::{self as ts, TractServerConfig};

use crate::env::lock;
use crate::link::{LinkConfig, Links};
use crate::{derive_seed, sim_env, SimDisks, SimNet};

/// How large transfers into the receiver are scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowMode {
    /// Senders send at once, as before flow control.
    Off,
    /// Senders ask; the receiver clears every ask at once.
    GrantAll,
    /// Senders ask; the receiver clears `window_bytes` at a time.
    Scheduled,
}

impl FlowMode {
    pub const ALL: [FlowMode; 3] = [FlowMode::Off, FlowMode::GrantAll, FlowMode::Scheduled];

    pub fn name(self) -> &'static str {
        match self {
            FlowMode::Off => "off (no RTS)",
            FlowMode::GrantAll => "RTS, all granted",
            FlowMode::Scheduled => "RTS/CTS scheduled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct FlowSimConfig {
    pub mode: FlowMode,
    pub senders: usize,
    pub tracts_per_sender: u64,
    pub tract_size: u32,
    pub small_bytes: usize,
    /// Pause between one small write's reply and the next.
    pub small_gap: Duration,
    /// Every host's link, both ways.
    pub link_bytes_per_sec: u64,
    /// One-way latency of every link.
    pub latency: Duration,
    /// A connection's send window on the links (`LinkConfig::window_bytes`).
    pub conn_window_bytes: usize,
    /// The receiver's grant window (`FlowLimits::window_bytes`).
    pub grant_window_bytes: u64,
    /// When every host starts its workload; setup (the cluster forming,
    /// blobs created) must be done by then, or the run fails.
    pub start: Duration,
}

impl Default for FlowSimConfig {
    /// The experiment: 16 senders of 8 MiB tracts and 4 KiB
    /// requests, over 1 Gbit/s links with 1 ms one way: FDS's 10 Gbit/s
    /// and 100 µs round trips slowed ten times, since the simulation
    /// steps in whole milliseconds (`TICK`), which would round a 10 Gbit/s
    /// run's sub-millisecond latencies away.
    fn default() -> Self {
        FlowSimConfig {
            mode: FlowMode::Scheduled,
            senders: 16,
            tracts_per_sender: 4,
            tract_size: 8 << 20,
            small_bytes: 4096,
            small_gap: Duration::from_millis(1),
            link_bytes_per_sec: 125_000_000,
            latency: Duration::from_millis(1),
            conn_window_bytes: 1 << 20,
            grant_window_bytes: blizzard_rpc::GRANT_WINDOW_DEFAULT,
            start: Duration::from_secs(2),
        }
    }
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct FlowReport {
    pub mode: FlowMode,
    /// Small writes issued before the last tract was acknowledged.
    pub small: Vec<Duration>,
    /// Tract bytes acknowledged.
    pub large_bytes: u64,
    /// From the start to the last tract's acknowledgment.
    pub elapsed: Duration,
    /// Bytes sent into the receiver over the links (requests, tracts,
    /// flow control, replies to it: everything).
    pub received_bytes: u64,
}

impl FlowReport {
    /// The `q`-quantile (0..=1) of the small writes' latencies, nearest
    /// rank; zero if there were none.
    pub fn small_quantile(&self, q: f64) -> Duration {
        let mut v = self.small.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }

    /// Tract bytes acknowledged per second of the run.
    pub fn goodput_bytes_per_sec(&self) -> f64 {
        self.large_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

const META_PORT: u16 = 7700;

/// turmoil's step. Whole milliseconds: tokio's timers have a resolution of
/// 1 ms, so a shorter step lets a host's clock run ahead of the
/// simulation's (a 100 µs step advanced hosts' clocks 1 ms per step). The
/// links' timelines stay exact to the nanosecond; only wake-ups and
/// deliveries fall on steps.
const TICK: Duration = Duration::from_millis(1);

fn now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

type BoxError = Box<dyn std::error::Error>;

/// Runs the experiment once; `Err` if a host failed.
pub fn run_flow_sim(seed: u64, cfg: &FlowSimConfig) -> Result<FlowReport, String> {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .simulation_duration(Duration::from_secs(600))
        .tick_duration(TICK)
        .min_message_latency(cfg.latency)
        .max_message_latency(cfg.latency)
        .build();
    let links = Links::new(LinkConfig {
        window_bytes: cfg.conn_window_bytes,
        ..LinkConfig::uniform(cfg.link_bytes_per_sec)
    });
    let env_of = {
        let links = links.clone();
        move |host: &str, disks: SimDisks| {
            let mut env = sim_env(seed, host, disks);
            env.net = Arc::new(SimNet::new(host).with_links(links.clone()));
            env
        }
    };
    let meta_addr = format!("meta:{META_PORT}");
    let tract_size = cfg.tract_size;
    {
        let env_of = env_of.clone();
        sim.host("meta", move || {
            let env = env_of("meta", SimDisks::new(0));
            async move {
                let mut c = MetaConfig::new(format!("0.0.0.0:{META_PORT}"));
                c.tract_size = tract_size;
                c.replication = 1;
                c.init_tractservers = 1;
                c.heartbeat_interval = Duration::from_millis(100);
                c.request_timeout = Duration::from_secs(5);
                let h = meta::start(env, c).await?;
                h.wait().await;
                Ok(())
            }
        });
    }
    let disk_bytes = (cfg.senders as u64 * cfg.tracts_per_sender + 8) * tract_size as u64 * 2;
    let flow = FlowLimits {
        window_bytes: (cfg.mode == FlowMode::Scheduled).then_some(cfg.grant_window_bytes),
        ..FlowLimits::default()
    };
    {
        let (env_of, meta_addr) = (env_of.clone(), meta_addr.clone());
        let disks = SimDisks::new(derive_seed(seed, "disks"));
        sim.host("ts0", move || {
            let env = env_of("ts0", disks.clone());
            let (meta, flow) = (meta_addr.clone(), flow.clone());
            async move {
                let mut c = TractServerConfig::new("/disk0", "0.0.0.0:7000", meta);
                c.disk_size = Some(disk_bytes);
                c.heartbeat_interval = Duration::from_millis(100);
                c.limits = ServerLimits { flow, ..ServerLimits::default() };
                let h = ts::start(env, c).await?;
                h.wait().await;
                Ok(())
            }
        });
    }

    let client_config = |mode: FlowMode| {
        let mut cc = ClientConfig::new(meta_addr.clone());
        cc.request_timeout = Duration::from_secs(30);
        cc.connect_timeout = Duration::from_secs(60);
        if mode == FlowMode::Off {
            cc.large_transfer_min = None;
        }
        cc
    };
    let done = Arc::new(AtomicUsize::new(0));
    let acks: Arc<Mutex<Vec<Duration>>> = Arc::default();
    for s in 0..cfg.senders {
        let host = format!("sender{s}");
        let env = env_of(&host, SimDisks::new(0));
        let (cc, done, acks) = (client_config(cfg.mode), done.clone(), acks.clone());
        let (tracts, start) = (cfg.tracts_per_sender, cfg.start);
        sim.client(host, async move {
            let client = Client::connect(env.clone(), cc).await?;
            let blob = client.create_blob(None, 1).await?;
            blob.extend_to(tracts).await?;
            let data = Bytes::from(vec![s as u8 + 1; tract_size as usize]);
            wait_until(&env, start).await?;
            for t in 0..tracts {
                blob.write(t, 0, data.clone()).await?;
                lock(&acks).push(now());
            }
            done.fetch_add(1, Ordering::AcqRel);
            Ok::<(), BoxError>(())
        });
    }
    let small: Arc<Mutex<Vec<Duration>>> = Arc::default();
    {
        let env = env_of("small", SimDisks::new(0));
        let (cc, done, small) = (client_config(FlowMode::Scheduled), done.clone(), small.clone());
        let (senders, bytes, gap, start) = (cfg.senders, cfg.small_bytes, cfg.small_gap, cfg.start);
        sim.client("small", async move {
            let client = Client::connect(env.clone(), cc).await?;
            let blob = client.create_blob(None, 1).await?;
            blob.extend_to(1).await?;
            let chunks = (tract_size as usize / bytes.max(1)).max(1) as u64;
            wait_until(&env, start).await?;
            let mut i = 0u64;
            while done.load(Ordering::Acquire) < senders {
                let off = ((i * 7919) % chunks) as u32 * bytes as u32;
                let data = Bytes::from(vec![(i % 251) as u8; bytes]);
                let t0 = env.now();
                blob.write(0, off, data).await?;
                let took = env.now().duration_since(t0);
                // Only those that met the large transfers count.
                if done.load(Ordering::Acquire) < senders {
                    lock(&small).push(took);
                }
                env.sleep(gap).await;
                i += 1;
            }
            Ok::<(), BoxError>(())
        });
    }
    sim.run().map_err(|e| e.to_string())?;
    let acks = lock(&acks).clone();
    let last = acks.iter().copied().max().unwrap_or(cfg.start);
    let small = lock(&small).clone();
    Ok(FlowReport {
        mode: cfg.mode,
        small,
        large_bytes: acks.len() as u64 * tract_size as u64,
        elapsed: last.saturating_sub(cfg.start),
        received_bytes: links.received("ts0"),
    })
}

/// Sleeps until the simulation's clock reads `at`; fails if it is past
/// (setup took longer: the hosts would not start together).
async fn wait_until(env: &blizzard_env::Env, at: Duration) -> Result<(), BoxError> {
    let t = now();
    if t > at {
        return Err(format!("setup took until {t:?}, past the start at {at:?}").into());
    }
    env.sleep(at - t).await;
    Ok(())
}
