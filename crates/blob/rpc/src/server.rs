//! The serving side: accept connections, read frames under a memory budget,
//! run each request as its own task, send replies as they complete.
//!
//! Malformed input never panics and never allocates beyond the limits: a
//! frame whose header fails its checks gets one `BadFrame` reply and the
//! connection is closed (it can no longer be framed); a well-framed request
//! with a bad meta CRC, an unknown opcode or an undecodable body gets an
//! error reply and the connection carries on.
//!
//! Large requests ask first (`flow`): a request-to-send is queued with the
//! server's [`Grants`]; a task per ask sends the clear-to-send once granted
//! and holds the grant until the request's frame has been read whole.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot, Semaphore};

use blizzard_core::crc::crc32c;
use blizzard_core::limits::{FRAME_DATA_MAX, FRAME_META_MAX};
use blizzard_env::{BoxStream, Env, Flag, Listener};
use blizzard_proto::{decode_rts, ErrorCode, ErrorReply, FrameHeader, FrameKind};

use crate::flow::{Ask, FlowLimits, Grants, Held};
use crate::frame_io::{read_body, read_header, write_queued, Outgoing, ReadFrameError, READ_BUFFER};
use crate::local::LocalEndpoint;
use crate::protocol::{Blob, Protocol};
use crate::session::{Caller, Sessions};

/// A request handler for protocol `P` (the blob protocol unless named).
/// Each call runs as its own task.
pub trait Service<P: Protocol = Blob>: Send + Sync + 'static {
    /// Handles one request; returns the reply and its data part. `caller`
    /// says whether the connection it came on is still its client's newest
    /// (see `session`): a change must not be applied otherwise.
    fn call(
        self: Arc<Self>,
        req: P::Request,
        data: Bytes,
        caller: Caller,
    ) -> BoxFuture<'static, (Result<P::Reply, ErrorReply>, Bytes)>;

    /// Whether every reply carrying stored data holds only bytes this
    /// service verified against the CRCs it sends with them (a
    /// tractserver's store returns nothing else). A caller in the same
    /// process gets those bytes as they left, untouched (`local`), so it
    /// may take that check for its own; over a stream it checks again.
    fn verifies_replies(&self) -> bool {
        false
    }

    /// Certificates this service refuses: a connection whose peer they
    /// come to name is closed (`authz::Scoped`).
    fn revocations(&self) -> Option<Arc<crate::authz::Revocations>> {
        None
    }
}

#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Bytes of requests (and of read replies) one connection may hold in
    /// memory at once; reading stops until some are released.
    pub inflight_bytes_max: usize,
    /// Requests one connection may have running at once.
    pub inflight_requests_max: usize,
    /// Once a header has arrived, the rest of its frame must follow within
    /// this time, so a stalled peer cannot pin a budget forever.
    pub frame_body_timeout: Duration,
    /// Receiver-driven flow control of large requests (`flow`).
    pub flow: FlowLimits,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            inflight_bytes_max: 256 << 20,
            inflight_requests_max: 1024,
            frame_body_timeout: Duration::from_secs(30),
            flow: FlowLimits::default(),
        }
    }
}

// One maximal frame plus one maximal read reply must always fit, or a
// connection could wait forever for permits it can never get.
const FRAME_BYTES_MAX: usize = FRAME_META_MAX as usize + FRAME_DATA_MAX as usize;
const _: () = assert!(FRAME_BYTES_MAX < u32::MAX as usize / 2);

/// Tells servers to stop. Dropping the handle also stops them.
pub struct ShutdownHandle(Arc<Flag>);

#[derive(Clone)]
pub struct Shutdown(Arc<Flag>);

impl ShutdownHandle {
    pub fn new() -> (ShutdownHandle, Shutdown) {
        let s = Arc::new(Flag::new());
        (ShutdownHandle(s.clone()), Shutdown(s))
    }

    pub fn trigger(&self) {
        self.0.set();
    }
}

impl Drop for ShutdownHandle {
    fn drop(&mut self) {
        self.trigger();
    }
}

impl Shutdown {
    /// Resolves once shutdown is triggered (or its handle dropped).
    pub async fn wait(&mut self) {
        self.0.wait().await
    }

    pub fn is_triggered(&self) -> bool {
        self.0.is_set()
    }
}

/// A running server's tasks and the handle that stops them (what the
/// metadata server's and a tractserver's handles share).
pub struct ServerTasks {
    shutdown: ShutdownHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl ServerTasks {
    pub fn new(shutdown: ShutdownHandle, tasks: Vec<tokio::task::JoinHandle<()>>) -> ServerTasks {
        ServerTasks { shutdown, tasks }
    }

    /// Stops accepting, closes connections and stops the background
    /// loops, then waits for every task to end. Requests already running
    /// finish on their own.
    pub async fn stop(self) {
        self.shutdown.trigger();
        self.wait().await;
    }

    /// Runs until the tasks end (they do not, short of shutdown).
    pub async fn wait(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Accepts connections on `listener` until shutdown.
pub async fn serve<P: Protocol>(
    env: Env,
    listener: Box<dyn Listener>,
    service: Arc<dyn Service<P>>,
    limits: ServerLimits,
    mut shutdown: Shutdown,
) {
    let sessions = Arc::new(Sessions::default());
    // One schedule for every connection: they share the server's link.
    let grants = Arc::new(Grants::new(limits.flow.clone()));
    // Callers in this process call the service directly (`local`); the
    // entry goes with the listener when this returns.
    let endpoint =
        LocalEndpoint { service: service.clone(), sessions: sessions.clone(), shutdown: shutdown.clone() };
    env.net.attach_endpoint(&listener.local_addr(), Arc::new(endpoint));
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.wait() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                tokio::spawn(serve_conn(
                    env.clone(),
                    stream,
                    peer,
                    service.clone(),
                    limits.clone(),
                    shutdown.clone(),
                    sessions.clone(),
                    grants.clone(),
                ));
            }
            Err(e) => {
                // Out of file descriptors and the like: pause instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                env.sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn reply_frame<P: Protocol>(
    request_id: u64,
    opcode: u16,
    res: &Result<P::Reply, ErrorReply>,
    data: Bytes,
) -> Outgoing {
    let meta = P::encode_response(res);
    Outgoing {
        header: FrameHeader {
            kind: FrameKind::Response,
            opcode,
            request_id,
            meta_len: meta.len() as u32,
            data_len: data.len() as u32,
            meta_crc: crc32c(&meta),
        },
        meta,
        data,
        more: Vec::new(),
    }
}

fn error_frame<P: Protocol>(request_id: u64, opcode: u16, code: ErrorCode, message: String) -> Outgoing {
    reply_frame::<P>(request_id, opcode, &Err(ErrorReply::new(code, message)), Bytes::new())
}

fn cts_frame(request_id: u64, opcode: u16) -> Outgoing {
    Outgoing {
        header: FrameHeader {
            kind: FrameKind::Cts,
            opcode,
            request_id,
            meta_len: 0,
            data_len: 0,
            meta_crc: crc32c(&[]),
        },
        meta: Bytes::new(),
        data: Bytes::new(),
        more: Vec::new(),
    }
}

/// One request-to-send, from its ask to the end of its grant: waits for
/// the grant (or for the request to arrive anyway, or the connection to
/// end: `arrived` resolves either way), sends the clear-to-send, and holds
/// the grant until the request's frame has been read, the connection
/// ends, or the grant times out.
async fn hold_grant(
    env: Env,
    grants: Arc<Grants>,
    ask: Ask,
    opcode: u16,
    mut granted: oneshot::Receiver<()>,
    mut arrived: oneshot::Receiver<()>,
    tx: mpsc::Sender<Outgoing>,
) {
    let got = tokio::select! {
        biased;
        _ = &mut arrived => None,
        g = &mut granted => Some(g.is_ok()),
    };
    match got {
        Some(true) => {}
        // The schedule went away with the server.
        Some(false) => return,
        None => {
            // Not waiting any more: withdraw the ask, or give back the
            // grant that raced the arrival.
            granted.close();
            if granted.try_recv().is_ok() {
                grants.release(ask);
            } else {
                grants.cancel(ask.conn, ask.id);
            }
            return;
        }
    }
    let _held = Held { grants: grants.clone(), ask };
    if tx.send(cts_frame(ask.id, opcode)).await.is_err() {
        return;
    }
    let timeout = grants.limits().grant_timeout;
    tokio::select! {
        biased;
        _ = &mut arrived => {}
        _ = env.sleep(timeout) => {
            tracing::debug!(request = ask.id, "clear-to-send unused in time; grant taken back");
        }
    }
}

/// Serves one connection until the peer leaves, the stream breaks, the
/// stream becomes unframed, or shutdown. `grants` is the server's flow
/// control schedule, shared by its connections.
#[allow(clippy::too_many_arguments, reason = "the parts of one server a connection shares")]
pub async fn serve_conn<P: Protocol>(
    env: Env,
    stream: BoxStream,
    peer: String,
    service: Arc<dyn Service<P>>,
    limits: ServerLimits,
    mut shutdown: Shutdown,
    sessions: Arc<Sessions>,
    grants: Arc<Grants>,
) {
    // Who the connection's TLS proved the peer to be (none when plain):
    // every request on it carries that to the service (`authz`).
    let authenticated = blizzard_env::peer_of(&*stream);
    // A revoked certificate's connection ends (issue 56); other
    // connections never wait on this.
    let revoked = {
        let watch = authenticated.clone().zip(service.revocations());
        async move {
            match watch {
                Some((peer, r)) => r.until_revoked(&peer.serial).await,
                None => std::future::pending().await,
            }
        }
    };
    tokio::pin!(revoked);
    let (mut rd, wr) = tokio::io::split(stream);
    // Nothing is spent on the connection before its first byte: a peer
    // that connects and sends nothing holds a task and a socket, not
    // buffers and a writer (issue 56).
    let mut first = [0u8; 1];
    let got = tokio::select! {
        biased;
        _ = shutdown.wait() => return,
        _ = &mut revoked => {
            tracing::warn!(%peer, "closing a connection: its certificate was revoked");
            return;
        }
        r = tokio::io::AsyncReadExt::read(&mut rd, &mut first) => r,
    };
    if !matches!(got, Ok(1)) {
        return;
    }
    // Set by the connection's `Hello`, if it sends one.
    let mut session: Option<(u64, u64)> = None;
    // Buffered: a small request's header, meta and data arrive in one
    // read system call instead of three.
    let mut rd = tokio::io::BufReader::with_capacity(
        READ_BUFFER,
        tokio::io::AsyncReadExt::chain(std::io::Cursor::new(first), rd),
    );
    let (tx, rx) = mpsc::channel::<Outgoing>(limits.inflight_requests_max.max(1));
    let writer = tokio::spawn(write_queued(wr, rx));
    let replies = Replies::<P> { tx, protocol: std::marker::PhantomData };
    let mut asks = ConnAsks::new(env.clone(), grants, limits.flow.queued_per_conn_max);
    let budget_bytes = limits.inflight_bytes_max.max(2 * FRAME_BYTES_MAX);
    let bytes = Arc::new(Semaphore::new(budget_bytes));
    let requests = Arc::new(Semaphore::new(limits.inflight_requests_max.max(1)));

    loop {
        let header = tokio::select! {
            biased;
            _ = shutdown.wait() => break,
            _ = &mut revoked => {
                tracing::warn!(%peer, "closing a connection: its certificate was revoked");
                break;
            }
            h = read_header(&mut rd) => h,
        };
        let header = match header {
            Ok(h) if h.kind == FrameKind::Request => h,
            Ok(h) if h.kind == FrameKind::Rts => {
                // Bounded to FLOW_META_MAX by FrameHeader::decode.
                match env.timeout(limits.frame_body_timeout, read_body(&mut rd, h)).await {
                    Ok(Ok(f)) => asks.ask(&h, &f.meta, &replies).await,
                    Ok(Err(ReadFrameError::BadMeta { request_id, opcode, error })) => {
                        replies.error(request_id, opcode, ErrorCode::BadFrame, error.to_string()).await;
                    }
                    _ => break,
                }
                continue;
            }
            Ok(h) => {
                replies
                    .error(h.request_id, h.opcode, ErrorCode::BadFrame, "expected a request frame".into())
                    .await;
                break;
            }
            Err(ReadFrameError::BadHeader(e)) => {
                tracing::debug!(%peer, error = %e, "unframed input; closing");
                replies.error(0, 0, ErrorCode::BadFrame, e.to_string()).await;
                break;
            }
            Err(_) => break,
        };
        // Bounded by FrameHeader::decode, so the cast and the permit count are safe.
        let frame_bytes = header.meta_len as usize + header.data_len as usize;
        let (Ok(req_permit), Ok(frame_permit)) = (
            requests.clone().acquire_owned().await,
            bytes.clone().acquire_many_owned(frame_bytes as u32).await,
        ) else {
            break;
        };
        let body = env.timeout(limits.frame_body_timeout, read_body(&mut rd, header)).await;
        // Its bytes have crossed the link (or never will): a grant it held
        // goes back to the window.
        asks.arrived(header.request_id);
        let frame = match body {
            Ok(Ok(f)) => f,
            Ok(Err(ReadFrameError::BadMeta { request_id, opcode, error })) => {
                replies.error(request_id, opcode, ErrorCode::BadFrame, error.to_string()).await;
                continue;
            }
            Ok(Err(_)) => break,
            Err(_) => {
                tracing::debug!(%peer, "frame body did not arrive in time; closing");
                break;
            }
        };
        let (id, opcode) = (header.request_id, header.opcode);
        let req = match decode_request::<P>(opcode, &frame.meta) {
            Ok(r) => r,
            Err((code, message)) => {
                replies.error(id, opcode, code, message).await;
                continue;
            }
        };
        // Handled here, in order: every later request on this connection
        // runs under the epoch it names.
        if let Some((s, epoch, reply)) = P::session_hello(&req) {
            sessions.hello(s, epoch);
            session = Some((s, epoch));
            let _ = replies.tx.send(reply_frame::<P>(id, opcode, &Ok(reply), Bytes::new())).await;
            continue;
        }
        // A read's reply will hold its bytes; reserve them before running it.
        let reply_bytes = P::reply_bytes(&req).min(FRAME_DATA_MAX);
        let Ok(reply_permit) = bytes.clone().acquire_many_owned(reply_bytes).await else {
            break;
        };
        let tx = replies.tx.clone();
        let service = service.clone();
        let caller = Caller::new(session, sessions.clone()).with_peer(authenticated.clone());
        tokio::spawn(async move {
            let (res, data) = service.call(req, frame.data, caller).await;
            let _ = tx.send(reply_frame::<P>(id, opcode, &res, data)).await;
            drop((req_permit, frame_permit, reply_permit));
        });
    }
    drop(replies);
    // Queued replies still go out; the writer ends when the last running
    // request drops its sender.
    let _ = writer.await;
    // Then every grant this connection still held ends with its asks.
    drop(asks);
}

/// A request's meta part decoded, or the error to answer it with: an
/// opcode this protocol does not have, or a body that does not decode.
fn decode_request<P: Protocol>(opcode: u16, meta: &[u8]) -> Result<P::Request, (ErrorCode, String)> {
    match P::decode_request(opcode, meta) {
        Some(Ok(r)) => Ok(r),
        None => Err((
            ErrorCode::UnknownOpcode,
            format!("unknown opcode {opcode:#06x}: the peer speaks another blizzard protocol (is the address right?)"),
        )),
        Some(Err(e)) => Err((ErrorCode::BadRequest, format!("opcode {opcode:#06x}: {e}"))),
    }
}

/// The sending side of one connection, as its reading loop uses it.
struct Replies<P: Protocol> {
    tx: mpsc::Sender<Outgoing>,
    protocol: std::marker::PhantomData<fn() -> P>,
}

impl<P: Protocol> Replies<P> {
    /// Answers request `id` with an error. A connection whose writer has
    /// gone is ending anyway: the reading loop finds out on its next read.
    async fn error(&self, id: u64, opcode: u16, code: ErrorCode, message: String) {
        let _ = self.tx.send(error_frame::<P>(id, opcode, code, message)).await;
    }
}

/// One connection's requests-to-send (`flow`): each is queued with the
/// server's schedule, and its grant is held (by a task of its own,
/// [`hold_grant`]) until its request has been read whole. Dropped with the
/// connection, which ends every grant it held.
struct ConnAsks {
    env: Env,
    grants: Arc<Grants>,
    conn: u64,
    /// Asks one connection may have waiting or granted at once.
    queued_max: usize,
    /// Per ask, the signal that its request has been read whole.
    arrivals: std::collections::BTreeMap<u64, oneshot::Sender<()>>,
}

impl ConnAsks {
    fn new(env: Env, grants: Arc<Grants>, queued_max: usize) -> ConnAsks {
        let conn = grants.conn_id();
        ConnAsks { env, grants, conn, queued_max, arrivals: Default::default() }
    }

    /// A request-to-send (header `h`, meta `meta`): queued, or refused with
    /// an error reply to the request it announces (`BadRequest` for a meta
    /// that does not decode, `Busy` for a full queue: retry after a pause).
    async fn ask<P: Protocol>(&mut self, h: &FrameHeader, meta: &[u8], replies: &Replies<P>) {
        let (id, opcode) = (h.request_id, h.opcode);
        let bytes = match decode_rts(meta) {
            Ok(b) => b as u64,
            Err(e) => {
                replies.error(id, opcode, ErrorCode::BadRequest, format!("request-to-send: {e}")).await;
                return;
            }
        };
        let ask = Ask { conn: self.conn, id, bytes };
        if self.arrivals.len() >= self.queued_max {
            // Forget the asks whose grant ended unused (timed out): their
            // requests may never come.
            self.arrivals.retain(|_, done| !done.is_closed());
        }
        let granted = if self.arrivals.contains_key(&id) {
            Err(crate::flow::Refusal::Duplicate)
        } else if self.arrivals.len() >= self.queued_max {
            Err(crate::flow::Refusal::ConnQueueFull)
        } else {
            self.grants.ask(ask)
        };
        match granted {
            Ok(granted) => {
                let (done, arrived) = oneshot::channel();
                self.arrivals.insert(id, done);
                tokio::spawn(hold_grant(
                    self.env.clone(),
                    self.grants.clone(),
                    ask,
                    opcode,
                    granted,
                    arrived,
                    replies.tx.clone(),
                ));
            }
            Err(r) => replies.error(id, opcode, ErrorCode::Busy, r.message().to_string()).await,
        }
    }

    /// Request `id` has been read whole, or never will be: the grant it
    /// held, if any, goes back to the window.
    fn arrived(&mut self, id: u64) {
        if let Some(done) = self.arrivals.remove(&id) {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An opcode the protocol lacks and a body that does not decode get
    /// different errors, each naming the opcode.
    #[test]
    fn undecodable_requests_get_the_error_that_says_why() {
        let Err((code, message)) = decode_request::<Blob>(0xfffe, b"") else {
            panic!("decoded opcode 0xfffe")
        };
        assert_eq!(code, ErrorCode::UnknownOpcode);
        assert!(message.contains("0xfffe"), "{message}");
        let op = blizzard_proto::Opcode::ReadTract as u16;
        let Err((code, message)) = decode_request::<Blob>(op, b"\x01") else {
            panic!("decoded a 1-byte read")
        };
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(message.contains(&format!("{op:#06x}")), "{message}");
    }
}
