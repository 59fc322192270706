//! Bandwidth-limited links: each simulated host's NIC sends and receives
//! at a rate, and bytes from every connection into (or out of) a host
//! share one first-in, first-out timeline, as packets share a switch port
//! and a NIC. turmoil delivers a write after a latency, whatever its
//! size; with [`Links`] attached to a host's [`SimNet`](crate::SimNet), a
//! write also waits for its turn on the sender's egress and the
//! receiver's ingress, so 16 senders of 8 MiB tracts into one host take
//! 128 MiB ÷ its rate, and a 4 KiB request sent meanwhile queues behind
//! whatever was sent into that host before it.
//!
//! # Performance model
//!
//! | What | How it is modelled | What it shows |
//! |---|---|---|
//! | Link rate | [`LinkConfig::ingress_bytes_per_sec`] and `egress_bytes_per_sec` per host (`None`: unlimited); a piece of `n` bytes holds a link `n ÷ rate` seconds (nanosecond resolution, rounded up) | Goodput is bounded by the receiver's link; a receiver of many flows is the bottleneck, as in FDS §4. |
//! | Queueing | One [`Timeline`] per host and direction: a piece starts when the link is free of every piece reserved before it (FIFO by the time of the write), then on the receiver's ingress once it has left the sender's egress (store and forward) | A small message waits for every byte queued ahead of it at the receiver: the latency that receiver-driven flow control bounds. |
//! | Segments | A write is cut into pieces of at most [`LinkConfig::segment_bytes`] (64 KiB: a TSO burst), each reserved on its own, so concurrent flows interleave piece by piece | Flows share a link fairly at piece granularity, as TCP flows roughly do. |
//! | Send window | A connection may have at most [`LinkConfig::window_bytes`] reserved and not yet delivered; further writes wait (as a full socket buffer does) | How deep each flow fills the receiver's queue: many flows queue many windows. |
//! | Latency | turmoil's per-link latency, added after the link time | A round trip (a clear-to-send's cost) is the configured latency twice. |
//!
//! Not modelled: packet loss and retransmission timeouts when a switch
//! buffer overflows (the incast collapse FDS also avoids): the queue here
//! is unbounded and lossless, so without flow control goodput stays at
//! the link rate and only latency suffers. Congestion windows that grow
//! and shrink: a flow's window is fixed. Cut-through forwarding: a piece
//! reaches the receiver's link only once it left the sender's. A piece's
//! time is reserved when it is written even if the receiver is not
//! reading (turmoil's own receive buffer then holds it back). Links to the
//! same host (loopback) are not limited.
//!
//! Resolution: the timelines are exact to the nanosecond, but tasks wake
//! on tokio's 1 ms timer wheel and turmoil's steps (which must be whole
//! milliseconds for hosts' clocks to keep with the simulation's), so a
//! piece reaches turmoil up to a step after its time, and a lone flow
//! whose window drains within a step leaves its link idle until the next.
//!
//! Determinism: time is turmoil's simulated elapsed time, timelines are
//! ordered maps keyed by host name, and pieces are reserved in the order
//! tasks write them, which the simulation fixes per seed.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use blizzard_env::BoxStream;
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{mpsc, Notify};

use crate::env::lock;

/// How fast hosts' links are, and how deep a connection fills them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// Every host's receive rate, unless [`LinkConfig::hosts`] says
    /// otherwise (`None`: unlimited).
    pub ingress_bytes_per_sec: Option<u64>,
    /// Every host's send rate, likewise.
    pub egress_bytes_per_sec: Option<u64>,
    /// Per host name: (ingress, egress) rates replacing the defaults.
    pub hosts: BTreeMap<String, (Option<u64>, Option<u64>)>,
    /// Largest piece reserved at once.
    pub segment_bytes: usize,
    /// Bytes one connection may have reserved and not yet delivered.
    pub window_bytes: usize,
}

impl LinkConfig {
    /// Every host at `bytes_per_sec` both ways, 64 KiB pieces, a 1 MiB
    /// window per connection (a socket buffer's order of size).
    pub fn uniform(bytes_per_sec: u64) -> LinkConfig {
        LinkConfig {
            ingress_bytes_per_sec: Some(bytes_per_sec),
            egress_bytes_per_sec: Some(bytes_per_sec),
            hosts: BTreeMap::new(),
            segment_bytes: 64 << 10,
            window_bytes: 1 << 20,
        }
    }

    fn rates(&self, host: &str) -> (Option<u64>, Option<u64>) {
        self.hosts.get(host).copied().unwrap_or((self.ingress_bytes_per_sec, self.egress_bytes_per_sec))
    }
}

/// One direction of one host's link: when it is next free.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    busy_until: Duration,
}

impl Timeline {
    /// Reserves the link for `bytes` at `rate` bytes per second, starting
    /// no earlier than `at` and after everything reserved before; returns
    /// (start, finish).
    pub fn reserve(&mut self, at: Duration, bytes: u64, rate: u64) -> (Duration, Duration) {
        let start = at.max(self.busy_until);
        let finish = start + transfer_time(bytes, rate);
        self.busy_until = finish;
        (start, finish)
    }

    pub fn busy_until(&self) -> Duration {
        self.busy_until
    }
}

/// How long `bytes` hold a link of `rate` bytes per second, rounded up to
/// the nanosecond (a zero rate is treated as one byte per second).
pub fn transfer_time(bytes: u64, rate: u64) -> Duration {
    let ns = (bytes as u128 * 1_000_000_000).div_ceil(rate.max(1) as u128);
    Duration::from_nanos(u64::try_from(ns).unwrap_or(u64::MAX))
}

/// The links of one simulation, shared by every host's [`SimNet`](crate::SimNet).
#[derive(Clone)]
pub struct Links {
    config: Arc<LinkConfig>,
    state: Arc<Mutex<LinkState>>,
}

#[derive(Default)]
struct LinkState {
    ingress: BTreeMap<String, Timeline>,
    egress: BTreeMap<String, Timeline>,
    /// Bytes reserved into each host so far.
    received: BTreeMap<String, u64>,
}

impl Links {
    pub fn new(config: LinkConfig) -> Links {
        Links { config: Arc::new(config), state: Arc::default() }
    }

    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// Reserves a piece of `bytes` from `src` to `dst` written at `now`;
    /// returns when it has crossed both links (before turmoil's latency).
    pub fn reserve(&self, src: &str, dst: &str, now: Duration, bytes: u64) -> Duration {
        if src == dst {
            return now;
        }
        let (_, egress) = self.config.rates(src);
        let (ingress, _) = self.config.rates(dst);
        let mut s = lock(&self.state);
        let mut t = now;
        if let Some(rate) = egress {
            t = s.egress.entry(src.to_string()).or_default().reserve(t, bytes, rate).1;
        }
        if let Some(rate) = ingress {
            t = s.ingress.entry(dst.to_string()).or_default().reserve(t, bytes, rate).1;
        }
        *s.received.entry(dst.to_string()).or_default() += bytes;
        t
    }

    /// Bytes sent into `host` so far, over every connection.
    pub fn received(&self, host: &str) -> u64 {
        lock(&self.state).received.get(host).copied().unwrap_or(0)
    }

    /// Wraps a stream from host `src` to host `dst`: its writes take their
    /// turn on the links (module docs). Must be called on a turmoil host
    /// (it starts the task that delivers the pieces there).
    pub(crate) fn shape(&self, stream: BoxStream, src: &str, dst: &str) -> BoxStream {
        if src == dst {
            return stream;
        }
        let (rd, wr) = tokio::io::split(stream);
        let (tx, rx) = mpsc::unbounded_channel();
        let window = Arc::new(Window::default());
        tokio::spawn(deliver(wr, rx, window.clone()));
        Box::new(Shaped { rd, tx, window, wait: None, links: self.clone(), src: src.into(), dst: dst.into() })
    }
}

/// What a connection has reserved and not yet delivered.
#[derive(Default)]
struct Window {
    queued: AtomicUsize,
    /// The delivery task ended (the stream broke or was shut down).
    broken: AtomicBool,
    /// Signalled after each delivered piece (a stored permit, so a wake-up
    /// is never lost between a check and the wait).
    drained: Notify,
}

enum Piece {
    Data { at: Duration, bytes: Bytes },
    Shutdown,
}

/// The simulation's elapsed time, the clock every timeline runs on.
fn sim_now() -> Duration {
    turmoil::sim_elapsed().unwrap_or_default()
}

/// Hands each piece to turmoil once it has crossed the links.
#[allow(clippy::disallowed_methods, reason = "the simulated links' delays are simulated time")]
async fn deliver(
    mut wr: tokio::io::WriteHalf<BoxStream>,
    mut rx: mpsc::UnboundedReceiver<Piece>,
    window: Arc<Window>,
) {
    while let Some(piece) = rx.recv().await {
        match piece {
            Piece::Data { at, bytes } => {
                let now = sim_now();
                if at > now {
                    tokio::time::sleep(at - now).await;
                }
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
                window.queued.fetch_sub(bytes.len(), Ordering::AcqRel);
                window.drained.notify_one();
            }
            Piece::Shutdown => {
                let _ = wr.shutdown().await;
            }
        }
    }
    window.broken.store(true, Ordering::Release);
    window.drained.notify_one();
}

/// A stream whose writes take their turn on the links.
struct Shaped {
    rd: tokio::io::ReadHalf<BoxStream>,
    tx: mpsc::UnboundedSender<Piece>,
    window: Arc<Window>,
    /// Waiting for room in the window.
    wait: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    links: Links,
    src: Arc<str>,
    dst: Arc<str>,
}

impl AsyncRead for Shaped {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.rd).poll_read(cx, buf)
    }
}

impl AsyncWrite for Shaped {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let this = &mut *self;
        loop {
            if this.window.broken.load(Ordering::Acquire) {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
            if let Some(w) = this.wait.as_mut() {
                ready!(w.as_mut().poll(cx));
                this.wait = None;
            }
            let config = this.links.config();
            // A piece never exceeds the window, so the window bounds what
            // a connection has queued even when it is smaller than a segment.
            let n = buf.len().min(config.segment_bytes.min(config.window_bytes).max(1));
            let queued = this.window.queued.load(Ordering::Acquire);
            if queued > 0 && queued + n > config.window_bytes {
                let window = this.window.clone();
                this.wait = Some(Box::pin(async move { window.drained.notified().await }));
                continue;
            }
            let at = this.links.reserve(&this.src, &this.dst, sim_now(), n as u64);
            this.window.queued.fetch_add(n, Ordering::AcqRel);
            let piece = Piece::Data { at, bytes: Bytes::copy_from_slice(&buf[..n]) };
            if this.tx.send(piece).is_err() {
                return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
            }
            return Poll::Ready(Ok(n));
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // As a socket's: written bytes are on their way; none wait here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // After the pieces already queued, as a FIN follows the data.
        let _ = self.tx.send(Piece::Shutdown);
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    // A timeline serves reservations first come, first served: a later
    // one starts when the link frees, an idle link starts at once.
    #[test]
    fn timeline_is_fifo() {
        let mut t = Timeline::default();
        // 1,000 bytes at 1 MB/s: 1 ms each.
        assert_eq!(t.reserve(Duration::ZERO, 1000, 1_000_000), (Duration::ZERO, MS));
        assert_eq!(t.reserve(Duration::ZERO, 1000, 1_000_000), (MS, 2 * MS));
        assert_eq!(t.reserve(MS, 500, 1_000_000), (2 * MS, Duration::from_micros(2500)));
        // Idle from 2.5 ms to 10 ms: the next starts when written.
        assert_eq!(t.reserve(10 * MS, 1000, 1_000_000), (10 * MS, 11 * MS));
        assert_eq!(t.busy_until(), 11 * MS);
    }

    // Transfer times round up to the nanosecond and do not overflow.
    #[test]
    fn transfer_time_rounds_up() {
        assert_eq!(transfer_time(1, 3), Duration::from_nanos(333_333_334));
        assert_eq!(transfer_time(8 << 20, 1 << 30), Duration::from_micros(7812) + Duration::from_nanos(500));
        assert_eq!(transfer_time(u64::MAX, 1), Duration::from_nanos(u64::MAX));
        assert_eq!(transfer_time(10, 0), Duration::from_secs(10));
    }

    // Every sender into one host shares its ingress timeline; a host's
    // egress is shared by what it sends anywhere; loopback is free.
    #[test]
    fn links_share_a_receivers_ingress() {
        let mut cfg = LinkConfig::uniform(1_000_000);
        cfg.egress_bytes_per_sec = None;
        cfg.hosts.insert("slow".into(), (Some(500_000), None));
        let l = Links::new(cfg);
        assert_eq!(l.reserve("a", "r", Duration::ZERO, 1000), MS);
        assert_eq!(l.reserve("b", "r", Duration::ZERO, 1000), 2 * MS, "queued behind a's piece");
        assert_eq!(l.reserve("c", "other", Duration::ZERO, 1000), MS, "another receiver is free");
        assert_eq!(l.reserve("a", "slow", Duration::ZERO, 1000), 2 * MS, "a slower host's own rate");
        assert_eq!(l.reserve("r", "r", 5 * MS, 1000), 5 * MS);
        assert_eq!(l.received("r"), 2000);

        // With egress limits a piece leaves the sender first, then takes
        // its turn at the receiver (store and forward).
        let l = Links::new(LinkConfig::uniform(1_000_000));
        assert_eq!(l.reserve("a", "r", Duration::ZERO, 1000), 2 * MS);
        assert_eq!(l.reserve("a", "s", Duration::ZERO, 1000), 3 * MS, "a's egress was busy until 1 ms");
        assert_eq!(l.reserve("b", "r", Duration::ZERO, 1000), 3 * MS, "r's ingress was busy until 2 ms");
    }
}
