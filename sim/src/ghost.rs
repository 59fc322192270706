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
//!
//! A crashed writer's late requests. A process killed with requests in the
//! network, in a server's receive buffer or queued behind a slow disk has
//! them applied after it died, possibly after its successor reconciled the
//! tract. Its tasks are gone, so nothing of it can send them: while the
//! harness crashes a host ([`Ghosts::crash_begin`] .. [`Ghosts::crash_end`])
//! each of its connections that carried a change leaves an [`Orphan`] (its
//! `Hello` and last change) instead, and the harness has another host
//! deliver some of them late ([`deliver_late`]); the tractserver looks at
//! the `Hello` and the request, not at the peer's address. The session
//! fence admits them (the dead client never reconnected, so its last
//! connection is its newest): only the writer fence (`tractserver::fence`)
//! keeps them out once the successor has claimed the blob.
//!
//! Any request, any protocol ([`Ghosts::any_requests`]). The replicated
//! runtime's members and clients keep their connections open, so a copy
//! is made while the connection lives: any request frame (an append, a
//! vote, a snapshot chunk, a client's submit or read) may be sent once
//! more, 1 ms to 2 s later, on a connection of its own, as a network that
//! duplicates and delays messages would deliver it. Its reply is dropped.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use turmoil::net::TcpStream;

use blizzard_proto::{ErrorCode, FrameHeader, FrameKind, Opcode, HEADER_LEN};

/// Frames bigger than this are not kept for replay (keeps memory small).
const FRAME_KEEP_MAX: usize = 1 << 20;

/// Which requests come back (module header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copies {
    /// The blob protocol: a dropped connection's `Hello` and last change.
    BlobChanges,
    /// Any request frame of any protocol, while the connection lives.
    AnyRequest,
}

/// How a host's connections are duplicated, shared by its connections.
#[derive(Clone)]
pub struct Ghosts {
    rng: Arc<Mutex<SmallRng>>,
    copies: Copies,
    /// One in this many dropped client connections comes back as a ghost
    /// (0: none do; a crashed host's connections are still kept, see
    /// [`Ghosts::crash_begin`]).
    one_in: u32,
    /// Ghosts delivered so far (for the report).
    pub sent: Arc<AtomicU64>,
    /// Crashes per host, kept by the harness (`crashed`).
    lives: Arc<Mutex<BTreeMap<String, u64>>>,
    /// Hosts the harness is crashing right now.
    crashing: Arc<Mutex<BTreeSet<String>>>,
    /// What their connections left behind.
    orphans: Arc<Mutex<Vec<Orphan>>>,
    /// Numbers connections in the order they were made, so orphans come
    /// out in an order that does not depend on the order tasks are dropped.
    next_conn: Arc<AtomicU64>,
    /// Late requests of crashed hosts: delivered, and refused as `Fenced`.
    pub late_sent: Arc<AtomicU64>,
    pub late_fenced: Arc<AtomicU64>,
}

/// A crashed host's connection that carried a change: what it had sent
/// last, which may still be in the network or the server.
#[derive(Clone, Debug)]
pub struct Orphan {
    /// Connection number (creation order).
    pub seq: u64,
    /// The server (`host:port`).
    pub addr: String,
    /// The server's incarnation when the connection was made.
    pub life: u64,
    pub hello: Vec<u8>,
    /// The last change request (a whole frame).
    pub last: Vec<u8>,
}

impl Orphan {
    /// The last change's opcode and tract, for the trace.
    pub fn describe(&self) -> String {
        let mut h = [0u8; HEADER_LEN];
        h.copy_from_slice(&self.last[..HEADER_LEN]);
        match FrameHeader::decode(&h) {
            Ok(f) => format!(
                "{:?} #{} ({} bytes) to {}",
                Opcode::from_u16(f.opcode).map_or("?".into(), |o| format!("{o:?}")),
                f.request_id,
                self.last.len(),
                self.addr
            ),
            Err(_) => format!("a change to {}", self.addr),
        }
    }
}

impl Ghosts {
    pub fn new(rng: SmallRng, one_in: u32) -> Ghosts {
        Ghosts {
            rng: Arc::new(Mutex::new(rng)),
            copies: Copies::BlobChanges,
            one_in: one_in.max(1),
            sent: Arc::default(),
            lives: Arc::default(),
            crashing: Arc::default(),
            orphans: Arc::default(),
            next_conn: Arc::default(),
            late_sent: Arc::default(),
            late_fenced: Arc::default(),
        }
    }

    /// Ghosts of any protocol: one request frame in `one_in` (0: none) is
    /// sent again, 1 ms to 2 s later, on a connection of its own (module
    /// header). [`Ghosts::crashed`] still drops copies bound for a server
    /// that restarted since.
    pub fn any_requests(rng: SmallRng, one_in: u32) -> Ghosts {
        Ghosts { copies: Copies::AnyRequest, one_in, ..Ghosts::new(rng, one_in) }
    }

    /// The same ghosts (shared counters, lives and random stream), with
    /// dropped connections coming back one in `one_in` (0: never).
    pub fn with_one_in(&self, one_in: u32) -> Ghosts {
        Ghosts { one_in, ..self.clone() }
    }

    /// The harness crashed (or restarted) `host`: connections to it are gone.
    pub fn crashed(&self, host: &str) {
        *lock(&self.lives).entry(host.to_string()).or_default() += 1;
    }

    /// The harness is about to crash client host `host`: its connections,
    /// dropped with its tasks, leave [`Orphan`]s rather than ghosts of
    /// their own (their tasks could not send them).
    pub fn crash_begin(&self, host: &str) {
        lock(&self.crashing).insert(host.to_string());
    }

    /// The crash of `host` is over: the orphans its connections left, in
    /// the order the connections were made.
    pub fn crash_end(&self, host: &str) -> Vec<Orphan> {
        lock(&self.crashing).remove(host);
        let mut v = std::mem::take(&mut *lock(&self.orphans));
        v.sort_by_key(|o| o.seq);
        v
    }

    fn crashing(&self, host: &str) -> bool {
        lock(&self.crashing).contains(host)
    }

    /// The incarnation of the host serving `addr` (`host:port`): how many
    /// times the harness crashed or restarted it.
    pub fn life(&self, addr: &str) -> u64 {
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
    /// The client host this connection belongs to, and its number.
    host: Arc<str>,
    seq: u64,
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
    pub fn new(inner: TcpStream, addr: String, ghosts: Ghosts, host: Arc<str>) -> GhostStream {
        let life = ghosts.life(&addr);
        let seq = ghosts.next_conn.fetch_add(1, Ordering::Relaxed);
        GhostStream {
            inner,
            addr,
            ghosts,
            host,
            seq,
            life,
            pending: Vec::new(),
            hello: None,
            last: None,
            off: false,
        }
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
            if self.ghosts.copies == Copies::AnyRequest {
                if header.kind == FrameKind::Request {
                    self.maybe_copy(frame);
                }
                continue;
            }
            if self.hello.is_none() {
                if Opcode::from_u16(header.opcode) != Some(Opcode::Hello) {
                    self.off = true;
                    return;
                }
                self.hello = Some(frame);
            } else if header.kind == FrameKind::Request
                && matches!(
                    Opcode::from_u16(header.opcode),
                    Some(
                        Opcode::WriteTract
                            | Opcode::WriteTractCached
                            | Opcode::WriteTracts
                            | Opcode::TrimTract
                            | Opcode::DeleteTract
                    )
                )
            {
                // The duplicates that can do harm: changes.
                self.last = Some(frame);
            }
        }
    }
}

impl GhostStream {
    /// [`Copies::AnyRequest`]: sends `frame` again, later, now and then.
    #[allow(clippy::disallowed_methods, reason = "the simulated network's delays are simulated time")]
    fn maybe_copy(&self, frame: Vec<u8>) {
        let one_in = self.ghosts.one_in;
        if one_in == 0 || !self.ghosts.draw(|r| r.random_ratio(1, one_in)) {
            return;
        }
        let delay = Duration::from_millis(self.ghosts.draw(|r| r.random_range(1..2000)));
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (addr, ghosts, life) = (self.addr.clone(), self.ghosts.clone(), self.life);
        rt.spawn(async move {
            tokio::time::sleep(delay).await;
            if ghosts.life(&addr) != life {
                return;
            }
            let Ok(mut s) = TcpStream::connect(addr.as_str()).await else { return };
            if s.write_all(&frame).await.is_err() {
                return;
            }
            ghosts.sent.fetch_add(1, Ordering::Relaxed);
            drain_replies(&mut s).await;
        });
    }
}

/// Reads (and drops) a ghost connection's replies until the server is
/// done with it.
#[allow(clippy::disallowed_methods, reason = "the simulated network's delays are simulated time")]
async fn drain_replies(s: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await;
}

impl Drop for GhostStream {
    #[allow(clippy::disallowed_methods, reason = "the simulated network's delays are simulated time")]
    fn drop(&mut self) {
        let (Some(hello), Some(last)) = (self.hello.take(), self.last.take()) else { return };
        if self.ghosts.crashing(&self.host) {
            // The host is being crashed: the harness decides what of it
            // arrives late (`deliver_late`).
            lock(&self.ghosts.orphans).push(Orphan {
                seq: self.seq,
                addr: self.addr.clone(),
                life: self.life,
                hello,
                last,
            });
            return;
        }
        let one_in = self.ghosts.one_in;
        if one_in == 0 || !self.ghosts.draw(|r| r.random_ratio(1, one_in)) {
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
            ghosts.sent.fetch_add(1, Ordering::Relaxed);
            drain_replies(&mut s).await;
        });
    }
}

/// What became of a crashed host's late request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Late {
    /// Not sent: the server crashed or restarted since the connection was
    /// made (its connections were reset), or could not be reached.
    Dropped(&'static str),
    /// Sent; the server applied it.
    Applied,
    /// Sent; refused because a newer writer claimed the blob.
    Fenced,
    /// Sent; refused for another reason (a stale row version, ...).
    Refused(ErrorCode),
    /// Sent; no reply came (the server crashed, or took too long).
    NoReply,
}

/// Delivers orphan `o` (its `Hello`, then its last change) on a new
/// connection from the host this runs on, `delay` from now, unless the
/// server host crashed or restarted since the connection was made; then
/// reads the change's reply. Runs inside a turmoil host.
pub async fn deliver_late(env: blizzard_env::Env, ghosts: Ghosts, o: Orphan, delay: Duration) -> Late {
    env.sleep(delay).await;
    if ghosts.life(&o.addr) != o.life {
        return Late::Dropped("the server restarted since");
    }
    let Ok(mut s) = TcpStream::connect(o.addr.as_str()).await else { return Late::Dropped("unreachable") };
    if s.write_all(&o.hello).await.is_err() || s.write_all(&o.last).await.is_err() {
        return Late::Dropped("connection refused");
    }
    ghosts.late_sent.fetch_add(1, Ordering::Relaxed);
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&o.last[..HEADER_LEN]);
    let Ok(sent) = FrameHeader::decode(&h) else { return Late::NoReply };
    let reply = env.timeout(Duration::from_secs(10), async {
        loop {
            let mut h = [0u8; HEADER_LEN];
            s.read_exact(&mut h).await.ok()?;
            let f = FrameHeader::decode(&h).ok()?;
            let mut body = vec![0u8; f.meta_len as usize + f.data_len as usize];
            s.read_exact(&mut body).await.ok()?;
            if f.kind == FrameKind::Response && f.request_id == sent.request_id {
                let op = Opcode::from_u16(f.opcode)?;
                return blizzard_proto::decode_response(op, &body[..f.meta_len as usize]).ok();
            }
        }
    });
    match reply.await {
        Ok(Some(Ok(_))) => Late::Applied,
        Ok(Some(Err(e))) if e.code == ErrorCode::Fenced => {
            ghosts.late_fenced.fetch_add(1, Ordering::Relaxed);
            Late::Fenced
        }
        Ok(Some(Err(e))) => Late::Refused(e.code),
        Ok(None) | Err(_) => Late::NoReply,
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
