//! Connections to tractservers and the metadata server. Each peer gets two
//! connections: one for small messages and one for bulk data, so a control
//! message or a 4 KiB write never waits behind an 8 MiB tract (FDS §4:
//! small and large messages travel on separate flows).
//!
//! The pool is also the receiving end of the reads it asks for: a large
//! reply (a read of at least the flow-control threshold,
//! `blizzard_rpc::LARGE_TRANSFER_MIN` unless configured) is asked for only
//! while fewer than [`PULL_WINDOW_BYTES`] of such replies are outstanding,
//! so a client reading widely does not have every tractserver send it a
//! tract at once and swamp its own link (FDS §4, the receiver limiting
//! what comes its way). Small reads never wait for that window.
//!
//! Every connection opens with `Hello` (this pool's session and the peer's
//! current epoch). Dialing a peer again after a connection to it failed or
//! timed out raises the peer's epoch, so the peer refuses whatever the old
//! connections still deliver (`blizzard_rpc::Caller`): a write given up on
//! and retried cannot land after a newer one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use blizzard_env::Env;
use blizzard_proto::{Reply, Request, TractAddr};
use blizzard_rpc::{RpcConn, RpcError};

use crate::batch::{self, Pending, Queue, BATCH_WRITE_MAX};

/// Messages carrying more data than this use the bulk connection.
pub const BULK_THRESHOLD: usize = 64 << 10;

/// Bytes of large read replies one pool has asked for and not received,
/// at most (one read larger than this still goes, alone): the same
/// window a tractserver grants large requests into itself.
pub const PULL_WINDOW_BYTES: u64 = blizzard_rpc::GRANT_WINDOW_DEFAULT;
const _: () = assert!(PULL_WINDOW_BYTES <= tokio::sync::Semaphore::MAX_PERMITS as u64);

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
enum Lane {
    Control,
    Bulk,
}

/// What the pool keeps for one peer.
struct Peer {
    /// The epoch its connections open with.
    epoch: AtomicU64,
    /// Per lane, its connection and the epoch it said hello with.
    lanes: [tokio::sync::Mutex<Option<(RpcConn, u64)>>; 2],
}

impl Peer {
    fn new() -> Peer {
        Peer { epoch: AtomicU64::new(1), lanes: Default::default() }
    }
}

/// A reply and its data, and how they came ([`Pool::ask`]).
pub(crate) struct Answer {
    pub(crate) reply: Reply,
    pub(crate) data: Bytes,
    /// They came as values from a server in this process that verified
    /// the data against the CRCs in the reply before handing it over
    /// (`blizzard_rpc::Service::verifies_replies`); no stream carried
    /// them since, so checking again would only repeat that check.
    pub(crate) verified: bool,
}

pub struct Pool {
    inner: Arc<PoolInner>,
}

/// Small writes waiting for a server (`batch`), by server, then durable
/// (0) or cached (1).
type Queues = BTreeMap<String, [Arc<Mutex<Queue>>; 2]>;

/// The pool's state, shared with the batch senders it starts.
struct PoolInner {
    env: Env,
    timeout: Duration,
    /// Requests with at least this much data ask before they send.
    rts_min: Option<u32>,
    /// Random per pool: the peers' `Hello` session.
    session: u64,
    /// Ordered: dropping the pool closes connections in the same order on
    /// every run, which the simulator's exact replay depends on.
    peers: Mutex<BTreeMap<String, Arc<Peer>>>,
    /// Bytes of large replies that may be outstanding (`PULL_WINDOW_BYTES`).
    pulls: tokio::sync::Semaphore,
    /// Whether small writes are batched (`batch`).
    batching: bool,
    queues: Mutex<Queues>,
    /// Servers that answered a batch with `UnknownOpcode` (an older
    /// version): they get each write alone.
    unbatched: Mutex<BTreeSet<String>>,
    /// Requests that carried more than one write, and those writes.
    batches: AtomicU64,
    batched_writes: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Pool {
    /// `batching`: whether small writes to one server that are ready
    /// together go in one request (`batch`).
    pub fn new(env: Env, timeout: Duration, rts_min: Option<u32>, batching: bool) -> Pool {
        let session = env.random_u64();
        let inner = PoolInner {
            env,
            timeout,
            rts_min,
            session,
            peers: Mutex::new(BTreeMap::new()),
            pulls: tokio::sync::Semaphore::new(PULL_WINDOW_BYTES as usize),
            batching,
            queues: Mutex::new(BTreeMap::new()),
            unbatched: Mutex::new(BTreeSet::new()),
            batches: AtomicU64::new(0),
            batched_writes: AtomicU64::new(0),
        };
        Pool { inner: Arc::new(inner) }
    }

    /// Requests that carried more than one write (`batch`), and the
    /// writes they carried.
    pub fn batch_counts(&self) -> (u64, u64) {
        (self.inner.batches.load(Ordering::Relaxed), self.inner.batched_writes.load(Ordering::Relaxed))
    }

    /// The epoch this pool's requests to `addr` travel at now: a write
    /// forwarded there acts for it (`Request::WriteTractForward`).
    pub fn epoch(&self, addr: &str) -> u64 {
        self.inner.peer(addr).epoch.load(Ordering::Acquire)
    }

    /// Raises `addr`'s epoch, as a failed connection to it does: a
    /// forwarded copy sent for the old epoch may still land there, so
    /// everything sent afterwards, directly (the next request dials
    /// again) or forwarded, travels at a newer one, which refuses it.
    pub fn fence(&self, addr: &str) {
        self.inner.peer(addr).epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Sends `req` to `addr` as [`Pool::call`] does a request that is not
    /// a small write, and says how the reply came ([`Answer`]).
    pub(crate) async fn ask(&self, addr: &str, req: &Request) -> Result<Answer, RpcError> {
        self.inner.ask(addr, req, Bytes::new()).await
    }

    /// Sends `req` to `addr` on the lane its size calls for; a small write
    /// may travel in a batch with others to the same server (`batch`).
    pub async fn call(&self, addr: &str, req: &Request, data: Bytes) -> Result<(Reply, Bytes), RpcError> {
        // A server in this process takes each request as a value, with no
        // frame to save, and joining a batch's data would copy it. Looked
        // up for small writes only: the lookup hashes the address under a
        // lock, and every read would pay it.
        let batchable = || {
            self.inner.batching
                && !addr.is_empty()
                && data.len() <= BATCH_WRITE_MAX
                && self.inner.env.net.endpoint(addr).is_none()
        };
        match req {
            Request::WriteTract { addr: a, offset, crcs } if batchable() => {
                self.batched(addr, false, *a, *offset, crcs, data).await
            }
            Request::WriteTractCached { addr: a, offset, crcs } if batchable() => {
                self.batched(addr, true, *a, *offset, crcs, data).await
            }
            _ => self.inner.call(addr, req, data).await,
        }
    }

    /// Queues a small write for `server` and waits for its answer; starts
    /// a sender if none is on its way. The sender is a task of its own, so
    /// a caller that gives up (a timeout) never strands the writes queued
    /// with its own.
    async fn batched(
        &self,
        server: &str,
        cached: bool,
        addr: TractAddr,
        offset: u32,
        crcs: &[u32],
        data: Bytes,
    ) -> Result<(Reply, Bytes), RpcError> {
        if lock(&self.inner.unbatched).contains(server) {
            return self.inner.call(server, &batch::single_request(cached, addr, offset, crcs), data).await;
        }
        let queue = {
            // Looked up by `&str`: no allocation per write once the server
            // has queues.
            let mut queues = lock(&self.inner.queues);
            if !queues.contains_key(server) {
                queues.insert(server.to_string(), Default::default());
            }
            queues.get(server).map(|q| q[usize::from(cached)].clone()).unwrap_or_default()
        };
        let (done, answer) = tokio::sync::oneshot::channel();
        let start = lock(&queue).push(Pending { addr, offset, crcs: crcs.to_vec(), data, done });
        if start {
            tokio::spawn(send_batch(self.inner.clone(), server.to_string(), cached, queue));
        }
        answer.await.unwrap_or_else(|_| Err(RpcError::ConnectionLost(server.to_string())))
    }
}

/// A batch sender (`batch`): takes what waits for `server` and sends it,
/// starting another sender first for what does not fit. Takes the
/// server's current connection, so one that failed is dialled again (at a
/// new epoch) as a single request's retry would.
fn send_batch(
    inner: Arc<PoolInner>,
    server: String,
    cached: bool,
    queue: Arc<Mutex<Queue>>,
) -> futures::future::BoxFuture<'static, ()> {
    Box::pin(send_batch_now(inner, server, cached, queue))
}

async fn send_batch_now(inner: Arc<PoolInner>, server: String, cached: bool, queue: Arc<Mutex<Queue>>) {
    let conn = match inner.conn(&server, Lane::Control).await {
        Ok(c) => c,
        Err(e) => {
            for p in lock(&queue).give_up() {
                let _ = p.done.send(Err(e.clone()));
            }
            return;
        }
    };
    let (batch, more) = lock(&queue).take();
    if more {
        tokio::spawn(send_batch(inner.clone(), server.clone(), cached, queue));
    }
    if batch.is_empty() {
        return;
    }
    if batch.len() > 1 {
        inner.batches.fetch_add(1, Ordering::Relaxed);
        inner.batched_writes.fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
    let (req, data, rest) = batch::request(cached, &batch);
    let res = conn.call_timeout_pieces(&inner.env, inner.timeout, &req, data, rest).await;
    if batch.len() > 1 && batch::unknown_to(&res) {
        tracing::info!(%server, "tractserver does not take batched writes (an older version); sending them one by one");
        lock(&inner.unbatched).insert(server.clone());
        let (inner, server) = (&inner, &server);
        let alone = batch
            .iter()
            .map(|p| async move { inner.call(server, &batch::single(cached, p), p.data.clone()).await });
        let answers = futures::future::join_all(alone).await;
        for (p, a) in batch.into_iter().zip(answers) {
            let _ = p.done.send(a);
        }
        return;
    }
    let n = batch.len();
    for (p, a) in batch.into_iter().zip(batch::outcomes(&server, cached, n, res)) {
        let _ = p.done.send(a);
    }
}

impl PoolInner {
    async fn conn(&self, addr: &str, lane: Lane) -> Result<RpcConn, RpcError> {
        let peer = self.peer(addr);
        // One dial per peer and lane at a time; others wait and share it.
        let mut g = peer.lanes[lane as usize].lock().await;
        let current = peer.epoch.load(Ordering::Acquire);
        let failed = match g.take() {
            Some((c, e)) if !c.is_closed() && e == current => {
                *g = Some((c.clone(), e));
                return Ok(c);
            }
            // Superseded by the other lane's reconnect: the peer refuses
            // changes from it now.
            Some((c, _)) if !c.is_closed() => {
                c.close();
                false
            }
            // Failed (or timed out) at the current epoch.
            Some((_, e)) => e == current,
            None => false,
        };
        // Invariant: after a connection to this peer failed, the next ones
        // open at a higher epoch than any before, so nothing still in
        // flight on the old ones can be applied after what follows.
        let e = if failed { peer.epoch.fetch_add(1, Ordering::AcqRel) + 1 } else { current };
        // Boxed: dialling (connect, TLS, hello) is a future of kilobytes,
        // and every request awaits this function; inline, each request's
        // future would carry it, to be copied wherever it moves.
        let c = Box::pin(self.dial(addr, e)).await?;
        *g = Some((c.clone(), e));
        Ok(c)
    }

    /// A new connection to `addr`, said hello to at `epoch`.
    async fn dial(&self, addr: &str, epoch: u64) -> Result<RpcConn, RpcError> {
        let hello = Request::Hello { session: self.session, epoch };
        let dial = async {
            let c = RpcConn::connect(&self.env, addr).await?;
            c.set_rts_min(self.rts_min);
            c.call(&hello, Bytes::new()).await?;
            Ok::<RpcConn, RpcError>(c)
        };
        match self.env.timeout(self.timeout, dial).await {
            Ok(r) => r,
            Err(_) => Err(RpcError::Timeout(addr.to_string())),
        }
    }

    /// `addr`'s entry, made on first use; looked up by `&str`, so a
    /// request to a known peer allocates nothing here.
    fn peer(&self, addr: &str) -> Arc<Peer> {
        let mut peers = lock(&self.peers);
        if let Some(p) = peers.get(addr) {
            return p.clone();
        }
        let p = Arc::new(Peer::new());
        peers.insert(addr.to_string(), p.clone());
        p
    }

    /// Sends `req` to `addr` on the lane its size calls for.
    async fn call(&self, addr: &str, req: &Request, data: Bytes) -> Result<(Reply, Bytes), RpcError> {
        self.ask(addr, req, data).await.map(|a| (a.reply, a.data))
    }

    /// [`PoolInner::call`], saying how the reply came.
    async fn ask(&self, addr: &str, req: &Request, data: Bytes) -> Result<Answer, RpcError> {
        if addr.is_empty() {
            return Err(RpcError::Connect {
                addr: "?".into(),
                message: "tractserver has no known address".into(),
            });
        }
        let big = data.len() > BULK_THRESHOLD
            || matches!(req, Request::ReadTract { len, .. } if *len as usize > BULK_THRESHOLD);
        let lane = if big { Lane::Bulk } else { Lane::Control };
        // A large reply is asked for only within the pull window (module
        // docs); one larger than the window takes all of it.
        let pull = match (req, self.rts_min) {
            (Request::ReadTract { len, .. }, Some(min)) if *len >= min => {
                (*len as u64).min(PULL_WINDOW_BYTES)
            }
            _ => 0,
        };
        let _pulling = match pull {
            0 => None,
            n => Some(
                self.pulls
                    .acquire_many(n as u32)
                    .await
                    .map_err(|_| RpcError::ConnectionLost(addr.to_string()))?,
            ),
        };
        let c = self.conn(addr, lane).await?;
        let verified = c.replies_verified();
        let (reply, data) = c.call_timeout(&self.env, self.timeout, req, data).await?;
        Ok(Answer { reply, data, verified })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    use blizzard_proto::{ErrorCode, ErrorReply, TractAddr};
    use blizzard_rpc::{serve, Caller, Service, ShutdownHandle};
    use futures::future::BoxFuture;
    use futures::FutureExt;
    use tokio::sync::Semaphore;

    /// Holds each read until the test opens the gate; counts how many it
    /// holds.
    struct HeldReads {
        gate: Semaphore,
        now: AtomicUsize,
    }

    impl Service for HeldReads {
        fn call(
            self: Arc<Self>,
            req: Request,
            _data: Bytes,
            _caller: Caller,
        ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
            async move {
                self.now.fetch_add(1, Ordering::AcqRel);
                if let Ok(p) = self.gate.acquire().await {
                    p.forget();
                }
                self.now.fetch_sub(1, Ordering::AcqRel);
                match req {
                    // The pool hands replies back undecoded: no real CRCs needed.
                    Request::ReadTract { len, .. } => {
                        (Ok(Reply::Read { crcs: Vec::new() }), Bytes::from(vec![0u8; len as usize]))
                    }
                    _ => (Ok(Reply::Done), Bytes::new()),
                }
            }
            .boxed()
        }
    }

    /// A tractserver from before `WriteTracts`: answers a batch as an
    /// unknown opcode (as its decoder would) and takes single writes,
    /// counting each write's first byte, so a write lost or sent twice
    /// in the fallback shows.
    struct OldServer {
        env: Env,
        batches: AtomicUsize,
        writes: Mutex<Vec<u8>>,
    }

    impl Service for OldServer {
        fn call(
            self: Arc<Self>,
            req: Request,
            data: Bytes,
            _caller: Caller,
        ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
            async move {
                match req {
                    Request::WriteTracts { .. } => {
                        self.batches.fetch_add(1, Ordering::AcqRel);
                        let e = ErrorReply::new(ErrorCode::UnknownOpcode, "unknown opcode 0x010d");
                        (Err(e), Bytes::new())
                    }
                    Request::WriteTract { .. } => {
                        lock(&self.writes).push(data.first().copied().unwrap_or(0));
                        // Slow enough that the writes after the first
                        // gather in the queue and go as a batch.
                        self.env.sleep(Duration::from_millis(20)).await;
                        (Ok(Reply::Done), Bytes::new())
                    }
                    _ => (Ok(Reply::Done), Bytes::new()),
                }
            }
            .boxed()
        }
    }

    /// Against a server that does not know batches (a rolling upgrade),
    /// every write still lands exactly once: the refused batch's writes
    /// are sent alone, and the pool sends that server no batch again.
    #[tokio::test]
    async fn a_server_without_batches_gets_every_write_alone_once() -> Result<(), Box<dyn std::error::Error>>
    {
        let env = Env::real();
        let listener = env.bind("127.0.0.1:0").await?;
        let addr = listener.local_addr();
        let server = Arc::new(OldServer { env: env.clone(), batches: 0.into(), writes: Mutex::default() });
        let (_stop, shutdown) = ShutdownHandle::new();
        tokio::spawn(serve(env.clone(), listener, server.clone(), Default::default(), shutdown));
        let pool = Arc::new(Pool::new(env.clone(), Duration::from_secs(30), None, true));
        let write = |pool: &Arc<Pool>, i: u8| {
            let (pool, addr) = (pool.clone(), addr.clone());
            let req = Request::WriteTract { addr: tract_addr(), offset: 0, crcs: vec![0] };
            tokio::spawn(async move { pool.call(&addr, &req, Bytes::from(vec![i; 4096])).await })
        };
        let first: Vec<_> = (0..16).map(|i| write(&pool, i)).collect();
        for w in first {
            w.await??;
        }
        assert!(server.batches.load(Ordering::Acquire) >= 1, "no batch was sent");
        assert!(lock(&pool.inner.unbatched).contains(&addr));
        let later: Vec<_> = (16..32).map(|i| write(&pool, i)).collect();
        for w in later {
            w.await??;
        }
        assert_eq!(server.batches.load(Ordering::Acquire), 1, "a batch sent after the refusal");
        let mut got = lock(&server.writes).clone();
        got.sort_unstable();
        assert_eq!(got, (0..32).collect::<Vec<u8>>(), "each write exactly once");
        Ok(())
    }

    /// Answers every read with bytes and CRCs it says it verified, or not.
    struct Reads {
        verifies: bool,
    }

    impl Service for Reads {
        fn call(
            self: Arc<Self>,
            _req: Request,
            _data: Bytes,
            _caller: Caller,
        ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
            futures::future::ready((Ok(Reply::Read { crcs: vec![0] }), Bytes::from(vec![1u8; 4096]))).boxed()
        }
        fn verifies_replies(&self) -> bool {
            self.verifies
        }
    }

    /// A reply counts as verified only if it came as a value from a server
    /// in this process that verifies its replies: over a socket, or from a
    /// service that does not say so, the caller checks the CRCs itself.
    #[tokio::test]
    async fn only_in_process_replies_of_a_verifying_server_count_as_verified(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let env = Env::real().with_local_net();
        let mut stops = vec![];
        let mut serve_one = async |verifies: bool| -> Result<String, Box<dyn std::error::Error>> {
            let listener = env.bind("127.0.0.1:0").await?;
            let addr = listener.local_addr();
            let (stop, shutdown) = ShutdownHandle::new();
            stops.push(stop);
            tokio::spawn(serve(
                env.clone(),
                listener,
                Arc::new(Reads { verifies }),
                Default::default(),
                shutdown,
            ));
            while env.net.endpoint(&addr).is_none() {
                tokio::task::yield_now().await;
            }
            Ok(addr)
        };
        let verifying = serve_one(true).await?;
        let not_verifying = serve_one(false).await?;
        let here = Pool::new(env.clone(), Duration::from_secs(30), None, true);
        let socket = Pool::new(Env::real(), Duration::from_secs(30), None, true);
        assert!(here.ask(&verifying, &read(4096)).await?.verified);
        assert!(!here.ask(&not_verifying, &read(4096)).await?.verified);
        assert!(!socket.ask(&verifying, &read(4096)).await?.verified, "came over a socket");
        Ok(())
    }

    fn tract_addr() -> TractAddr {
        TractAddr {
            blob: blizzard_core::BlobId(1),
            incarnation: 1,
            tract: blizzard_core::TractNo(0),
            row_version: 1,
            writer: 0,
        }
    }

    fn read(len: u32) -> Request {
        Request::ReadTract { addr: tract_addr(), offset: 0, len }
    }

    /// Waits until the server holds `n` reads (fails after 20 s).
    async fn until_held(env: &Env, s: &HeldReads, n: usize) -> Result<(), String> {
        for _ in 0..2000 {
            if s.now.load(Ordering::Acquire) == n {
                return Ok(());
            }
            env.sleep(Duration::from_millis(10)).await;
        }
        Err(format!("the server never held {n} reads (holds {})", s.now.load(Ordering::Acquire)))
    }

    // Large reads are asked for only within the pull window (two 8 MiB
    // reads of eight at once), small ones are not held by it, and without
    // flow control the window is not applied.
    #[tokio::test]
    async fn large_reads_stay_within_the_pull_window() -> Result<(), Box<dyn std::error::Error>> {
        let env = Env::real();
        let listener = env.bind("127.0.0.1:0").await?;
        let addr = listener.local_addr();
        let server = Arc::new(HeldReads { gate: Semaphore::new(0), now: 0.into() });
        let (_stop, shutdown) = ShutdownHandle::new();
        tokio::spawn(serve(env.clone(), listener, server.clone(), Default::default(), shutdown));
        let tract = 8u32 << 20;
        let window = (PULL_WINDOW_BYTES / tract as u64) as usize;
        assert_eq!(window, 2);

        let pool = Arc::new(Pool::new(
            env.clone(),
            Duration::from_secs(30),
            Some(blizzard_rpc::LARGE_TRANSFER_MIN),
            true,
        ));
        let spawn_reads = |pool: &Arc<Pool>, n: usize, len: u32| {
            (0..n)
                .map(|_| {
                    let (pool, addr) = (pool.clone(), addr.clone());
                    tokio::spawn(async move { pool.call(&addr, &read(len), Bytes::new()).await })
                })
                .collect::<Vec<_>>()
        };
        let large = spawn_reads(&pool, 8, tract);
        until_held(&env, &server, window).await?;
        // The other six wait in the pool: none reaches the server.
        env.sleep(Duration::from_millis(200)).await;
        assert_eq!(server.now.load(Ordering::Acquire), window);
        // Small reads pass them.
        let small = spawn_reads(&pool, 8, 4096);
        until_held(&env, &server, window + 8).await?;
        server.gate.add_permits(16);
        for r in large.into_iter().chain(small) {
            r.await??;
        }

        let unlimited = Arc::new(Pool::new(env.clone(), Duration::from_secs(30), None, true));
        let reads = spawn_reads(&unlimited, 4, tract);
        until_held(&env, &server, 4).await?;
        server.gate.add_permits(4);
        for r in reads {
            r.await??;
        }
        Ok(())
    }
}
