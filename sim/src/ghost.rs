//! Late duplicates (the simulator's "message duplication").
//!
//! TCP delivers a connection's bytes once and in order, so within one
//! connection nothing is duplicated. Across connections it can happen: a
//! client gives up on a request (a timeout), closes the connection and
//! sends the request again on a new one, while the first copy still sits
//! in the network or in the server's receive buffer, or in a slow server,
//! and is applied later, possibly after the client's next write to the same
//! bytes. [`GhostStream`] injects exactly that: when a client drops a
//! connection that opened with `Hello`, it may (drawn from the seed) open a
//! fresh one later, 50 ms to 3 s on, and deliver the old connection's
//! `Hello` and its last change (write, trim, delete) again, as the old
//! connection would have,
//! unless the server host crashed meanwhile: a crash resets its
//! connections, so nothing sent on them reaches the next incarnation.
//! The tractservers must refuse it (`blizzard_rpc::Caller`), or the
//! oracle sees acknowledged data replaced by older data.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use turmoil::net::TcpStream;

use blizzard_proto::{FrameHeader, Opcode, HEADER_LEN};

/// Frames bigger than this are not kept for replay (keeps memory small).
const FRAME_KEEP_MAX: usize = 1 << 20;

/// How a host's connections are duplicated, shared by its connections.
#[derive(Clone)]
pub struct Ghosts {
    rng: Arc<Mutex<SmallRng>>,
    /// One in this many dropped client connections comes back as a ghost.
    one_in: u32,
    /// Ghosts delivered so far (for the report).
    pub sent: Arc<std::sync::atomic::AtomicU64>,
    /// Crashes per host, kept by the harness (`crashed`).
    lives: Arc<Mutex<std::collections::BTreeMap<String, u64>>>,
}

impl Ghosts {
    pub fn new(rng: SmallRng, one_in: u32) -> Ghosts {
        Ghosts {
            rng: Arc::new(Mutex::new(rng)),
            one_in: one_in.max(1),
            sent: Arc::default(),
            lives: Arc::default(),
        }
    }

    /// The harness crashed (or restarted) `host`: connections to it are gone.
    pub fn crashed(&self, host: &str) {
        *lock(&self.lives).entry(host.to_string()).or_default() += 1;
    }

    fn life(&self, addr: &str) -> u64 {
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        lock(&self.lives).get(host).copied().unwrap_or(0)
    }

    fn draw<T>(&self, f: impl FnOnce(&mut SmallRng) -> T) -> T {
        f(&mut lock(&self.rng))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A client connection that remembers its `Hello` and last change request.
pub struct GhostStream {
    inner: TcpStream,
    addr: String,
    ghosts: Ghosts,
    /// The server host's incarnation when this connection was made.
    life: u64,
    /// Bytes written, not yet cut into frames.
    pending: Vec<u8>,
    hello: Option<Vec<u8>>,
    last: Option<Vec<u8>>,
    /// Stopped looking (no `Hello` first, or a frame too big to keep).
    off: bool,
}

impl GhostStream {
    pub fn new(inner: TcpStream, addr: String, ghosts: Ghosts) -> GhostStream {
        let life = ghosts.life(&addr);
        GhostStream { inner, addr, ghosts, life, pending: Vec::new(), hello: None, last: None, off: false }
    }

    fn tap(&mut self, b: &[u8]) {
        if self.off {
            return;
        }
        self.pending.extend_from_slice(b);
        loop {
            if self.pending.len() < HEADER_LEN {
                return;
            }
            let mut h = [0u8; HEADER_LEN];
            h.copy_from_slice(&self.pending[..HEADER_LEN]);
            let Ok(header) = FrameHeader::decode(&h) else {
                self.off = true;
                return;
            };
            let len = HEADER_LEN + header.meta_len as usize + header.data_len as usize;
            if len > FRAME_KEEP_MAX {
                self.off = true;
                return;
            }
            if self.pending.len() < len {
                return;
            }
            let frame: Vec<u8> = self.pending.drain(..len).collect();
            if self.hello.is_none() {
                if Opcode::from_u16(header.opcode) != Some(Opcode::Hello) {
                    self.off = true;
                    return;
                }
                self.hello = Some(frame);
            } else if matches!(
                Opcode::from_u16(header.opcode),
                Some(Opcode::WriteTract | Opcode::WriteTractCached | Opcode::TrimTract | Opcode::DeleteTract)
            ) {
                // The duplicates that can do harm: changes.
                self.last = Some(frame);
            }
        }
    }
}

impl Drop for GhostStream {
    #[allow(clippy::disallowed_methods, reason = "the simulated network's delays are simulated time")]
    fn drop(&mut self) {
        let (Some(hello), Some(last)) = (self.hello.take(), self.last.take()) else { return };
        let one_in = self.ghosts.one_in;
        if !self.ghosts.draw(|r| r.random_ratio(1, one_in)) {
            return;
        }
        let delay = Duration::from_millis(self.ghosts.draw(|r| r.random_range(50..3000)));
        // Only from inside the host's runtime (not while it is torn down).
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (addr, ghosts, life) = (self.addr.clone(), self.ghosts.clone(), self.life);
        rt.spawn(async move {
            tokio::time::sleep(delay).await;
            if ghosts.life(&addr) != life {
                return;
            }
            let Ok(mut s) = TcpStream::connect(addr.as_str()).await else { return };
            if s.write_all(&hello).await.is_err() || s.write_all(&last).await.is_err() {
                return;
            }
            ghosts.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            // Read (and drop) the replies until the server is done with it.
            let mut buf = [0u8; 4096];
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
        });
    }
}

impl AsyncRead for GhostStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for GhostStream {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, b);
        if let Poll::Ready(Ok(n)) = &r {
            let n = *n;
            self.tap(&b[..n]);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
