//! The calling side of a connection: many requests in flight, each waiting
//! for the reply with its id.
//!
//! Invariant: every request registered in `pending` is completed exactly
//! once: by its reply, by the connection failing (all pending fail with
//! `ConnectionLost`), or by its caller giving up (the entry is removed).
//!
//! A request whose data part is at least the connection's `rts_min` bytes
//! (`flow::LARGE_TRANSFER_MIN` unless changed) is announced first with a
//! request-to-send and sent only once the server's clear-to-send for its id
//! arrives (`flow`); a caller whose grant does not come in time gets
//! `RpcError::NoGrant`. Entries in `grants` follow the same rule as
//! `pending`: completed by the clear-to-send, failed with the connection,
//! or removed when their caller gives up.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use blizzard_env::{BoxStream, Env};
use blizzard_proto::{encode_rts, DecodeError, ErrorReply, FrameHeader, FrameKind};

use crate::frame_io::{read_frame, write_queued, Outgoing, ReadFrameError};
use crate::local::{LocalEndpoint, LocalLink};
use crate::protocol::{Blob, Protocol};

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum RpcError {
    #[error("cannot connect to {addr}: {message}")]
    Connect { addr: String, message: String },
    #[error("connection to {0} lost")]
    ConnectionLost(String),
    #[error("no reply from {0} in time")]
    Timeout(String),
    /// A large request's clear-to-send did not come in time: the server
    /// is busy receiving other large transfers (or unreachable).
    #[error(
        "no clear-to-send from {0} in time for a large request: it is busy receiving other large transfers"
    )]
    NoGrant(String),
    #[error("peer {addr} sent an undecodable reply: {error}")]
    Decode { addr: String, error: DecodeError },
    #[error("peer {addr} replied: {reply}")]
    Remote { addr: String, reply: ErrorReply },
}

impl RpcError {
    /// The server's error reply, if the request got that far.
    pub fn remote(&self) -> Option<&ErrorReply> {
        match self {
            RpcError::Remote { reply, .. } => Some(reply),
            _ => None,
        }
    }
}

type ReplySlot<P> = oneshot::Sender<Result<(<P as Protocol>::Reply, Bytes), RpcError>>;

struct Shared<P: Protocol> {
    addr: String,
    /// Ordered, so failing them all wakes callers in the same order on
    /// every run (the simulator replays runs exactly).
    pending: Mutex<BTreeMap<u64, ReplySlot<P>>>,
    /// Large requests waiting for their clear-to-send, by request id.
    grants: Mutex<BTreeMap<u64, oneshot::Sender<()>>>,
    /// Requests with at least this much data ask first (`u32::MAX`: never).
    rts_min: AtomicU32,
    closed: AtomicBool,
    next_id: AtomicU64,
    /// The reader task, stopped when the connection is given up on (its
    /// stream may never error by itself).
    reader: Mutex<Option<tokio::task::AbortHandle>>,
}

impl<P: Protocol> Shared<P> {
    fn new(addr: String) -> Arc<Shared<P>> {
        Arc::new(Shared {
            addr,
            pending: Mutex::new(BTreeMap::new()),
            grants: Mutex::new(BTreeMap::new()),
            rts_min: AtomicU32::new(crate::flow::LARGE_TRANSFER_MIN),
            closed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
            reader: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, ReplySlot<P>>> {
        match self.pending.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn grants(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, oneshot::Sender<()>>> {
        match self.grants.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn fail_all(&self) {
        self.closed.store(true, Ordering::Release);
        // Callers waiting for a clear-to-send see their sender dropped.
        drop(std::mem::take(&mut *self.grants()));
        let drained = std::mem::take(&mut *self.lock());
        for (_, slot) in drained {
            let _ = slot.send(Err(RpcError::ConnectionLost(self.addr.clone())));
        }
    }
}

/// Most frames queued for the writer task before callers wait.
const SEND_QUEUE_MAX: usize = 256;

/// One multiplexed connection carrying protocol `P`. Cheap to clone.
pub struct Conn<P: Protocol> {
    shared: Arc<Shared<P>>,
    link: Link<P>,
}

/// How requests travel.
enum Link<P: Protocol> {
    /// Frames on a stream, through the writer task.
    Stream(mpsc::Sender<Outgoing>),
    /// As values, to a server in this process (`local`).
    Local(Arc<LocalLink<P>>),
}

impl<P: Protocol> Clone for Conn<P> {
    fn clone(&self) -> Self {
        let link = match &self.link {
            Link::Stream(tx) => Link::Stream(tx.clone()),
            Link::Local(l) => Link::Local(l.clone()),
        };
        Conn { shared: self.shared.clone(), link }
    }
}

/// A connection carrying the blob protocol.
pub type RpcConn = Conn<Blob>;

/// Removes a pending entry if its caller stops waiting (timeout, cancel).
struct PendingGuard<'a, P: Protocol> {
    shared: &'a Shared<P>,
    id: u64,
}

impl<P: Protocol> Drop for PendingGuard<'_, P> {
    fn drop(&mut self) {
        self.shared.lock().remove(&self.id);
        self.shared.grants().remove(&self.id);
    }
}

impl<P: Protocol> Conn<P> {
    /// Dials `addr` through the env and starts the connection's tasks; a
    /// server of this process listening there is called directly instead
    /// (`local`).
    pub async fn connect(env: &Env, addr: &str) -> Result<Conn<P>, RpcError> {
        if let Some(endpoint) = LocalEndpoint::<P>::find(env, addr) {
            return Ok(Conn {
                shared: Shared::new(addr.to_string()),
                link: Link::Local(Arc::new(LocalLink::new(endpoint))),
            });
        }
        let stream = env
            .connect(addr)
            .await
            .map_err(|e| RpcError::Connect { addr: addr.to_string(), message: e.to_string() })?;
        Ok(Conn::new(stream, addr.to_string()))
    }

    /// Wraps an established stream.
    pub fn new(stream: BoxStream, addr: String) -> Conn<P> {
        let shared = Shared::new(addr);
        let (rd, wr) = tokio::io::split(stream);
        let (tx, rx) = mpsc::channel(SEND_QUEUE_MAX);
        tokio::spawn(writer_task(wr, rx, shared.clone()));
        let reader = tokio::spawn(reader_task(rd, shared.clone()));
        *shared.reader.lock().unwrap_or_else(|p| p.into_inner()) = Some(reader.abort_handle());
        Conn { shared, link: Link::Stream(tx) }
    }

    /// Gives the connection up: every waiting call fails and later ones
    /// are refused, so callers dial again. The writer task ends once the
    /// last handle is dropped.
    pub fn close(&self) {
        self.shared.fail_all();
        if let Some(r) = self.shared.reader.lock().unwrap_or_else(|p| p.into_inner()).take() {
            r.abort();
        }
    }

    pub fn addr(&self) -> &str {
        &self.shared.addr
    }

    /// Requests whose data part has at least `min` bytes ask the server
    /// before they send (`flow`); `None`: never ask (the comparison runs
    /// of the simulator's flow experiment). Applies to every clone.
    pub fn set_rts_min(&self, min: Option<u32>) {
        self.shared.rts_min.store(min.unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
            || match &self.link {
                Link::Stream(tx) => tx.is_closed(),
                Link::Local(l) => l.is_closed(),
            }
    }

    /// Whether this connection's replies come as values from a server in
    /// this process that verified their data against its CRCs
    /// (`Service::verifies_replies`): no stream carries them, so checking
    /// them again would only repeat that check.
    pub fn replies_verified(&self) -> bool {
        match &self.link {
            Link::Local(l) => l.verifies_replies(),
            Link::Stream(_) => false,
        }
    }

    /// Sends `req` with `data` and waits for its reply. Remote errors come
    /// back as `RpcError::Remote`.
    pub async fn call(&self, req: &P::Request, data: Bytes) -> Result<(P::Reply, Bytes), RpcError> {
        self.call_pieces(req, data, Vec::new()).await
    }

    /// [`Conn::call`] whose data part is `data` then each of `more`, sent
    /// from their own buffers (no joining copy). Their total must fit a
    /// frame (`FRAME_DATA_MAX`).
    pub async fn call_pieces(
        &self,
        req: &P::Request,
        data: Bytes,
        more: Vec<Bytes>,
    ) -> Result<(P::Reply, Bytes), RpcError> {
        self.call_flow(req, data, more, &AtomicBool::new(false)).await
    }

    /// [`Conn::call_pieces`]; `granted` is set once a large request's
    /// clear-to-send came (or it needed none), so a deadline can tell
    /// which wait it cut short.
    async fn call_flow(
        &self,
        req: &P::Request,
        data: Bytes,
        more: Vec<Bytes>,
        granted: &AtomicBool,
    ) -> Result<(P::Reply, Bytes), RpcError> {
        if self.is_closed() {
            return Err(RpcError::ConnectionLost(self.shared.addr.clone()));
        }
        let tx = match &self.link {
            Link::Stream(tx) => tx,
            Link::Local(l) => return l.call(&self.shared.addr, req, data, more).await,
        };
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let meta = P::encode_request(req);
        let data_len = data.len() + more.iter().map(Bytes::len).sum::<usize>();
        if data_len > blizzard_core::limits::FRAME_DATA_MAX as usize {
            return Err(RpcError::Decode {
                addr: self.shared.addr.clone(),
                error: DecodeError::BadValue { field: "request data length", value: data_len as u64 },
            });
        }
        let header = FrameHeader {
            kind: FrameKind::Request,
            opcode: P::opcode(req),
            request_id: id,
            meta_len: meta.len() as u32,
            data_len: data_len as u32,
            meta_crc: blizzard_core::crc::crc32c(&meta),
        };
        let (slot, mut wait) = oneshot::channel();
        self.shared.lock().insert(id, slot);
        let _guard = PendingGuard { shared: &self.shared, id };
        let ask = data_len >= self.shared.rts_min.load(Ordering::Relaxed) as usize;
        let clear = ask.then(|| {
            let (tx, rx) = oneshot::channel();
            self.shared.grants().insert(id, tx);
            rx
        });
        // The reader may have failed everything between the check above and
        // the inserts; checking again closes that window.
        if self.is_closed() {
            return Err(RpcError::ConnectionLost(self.shared.addr.clone()));
        }
        if let Some(clear) = clear {
            let rts_meta = encode_rts(data_len as u32);
            let rts = Outgoing {
                header: FrameHeader {
                    kind: FrameKind::Rts,
                    meta_len: rts_meta.len() as u32,
                    data_len: 0,
                    meta_crc: blizzard_core::crc::crc32c(&rts_meta),
                    ..header
                },
                meta: rts_meta,
                data: Bytes::new(),
                more: Vec::new(),
            };
            if tx.send(rts).await.is_err() {
                return Err(RpcError::ConnectionLost(self.shared.addr.clone()));
            }
            // The server may refuse the ask (`Busy`) with a reply instead.
            tokio::select! {
                biased;
                c = clear => {
                    if c.is_err() {
                        return Err(RpcError::ConnectionLost(self.shared.addr.clone()));
                    }
                }
                res = &mut wait => {
                    return res.unwrap_or_else(|_| Err(RpcError::ConnectionLost(self.shared.addr.clone())));
                }
            }
        }
        granted.store(true, Ordering::Relaxed);
        if tx.send(Outgoing { header, meta, data, more }).await.is_err() {
            return Err(RpcError::ConnectionLost(self.shared.addr.clone()));
        }
        match wait.await {
            Ok(res) => res,
            Err(_) => Err(RpcError::ConnectionLost(self.shared.addr.clone())),
        }
    }

    /// `call` with a deadline.
    pub async fn call_timeout(
        &self,
        env: &Env,
        timeout: std::time::Duration,
        req: &P::Request,
        data: Bytes,
    ) -> Result<(P::Reply, Bytes), RpcError> {
        self.call_timeout_pieces(env, timeout, req, data, Vec::new()).await
    }

    /// [`Conn::call_pieces`] with a deadline.
    pub async fn call_timeout_pieces(
        &self,
        env: &Env,
        timeout: std::time::Duration,
        req: &P::Request,
        data: Bytes,
        more: Vec<Bytes>,
    ) -> Result<(P::Reply, Bytes), RpcError> {
        let granted = AtomicBool::new(false);
        match env.timeout(timeout, self.call_flow(req, data, more, &granted)).await {
            Ok(r) => r,
            // Still waiting for a clear-to-send: said apart from a lost
            // reply, though the connection is given up on all the same
            // (a grant that takes a whole request timeout means a stuck
            // path as likely as a busy server).
            Err(_) if !granted.load(Ordering::Relaxed) => {
                self.close();
                Err(RpcError::NoGrant(self.shared.addr.clone()))
            }
            // No reply in time: the stream may be stuck for good (a path
            // that lost packets, a peer that vanished without a reset), and
            // every later request on it would wait the same. Callers dial
            // a fresh connection instead.
            Err(_) => {
                self.close();
                Err(RpcError::Timeout(self.shared.addr.clone()))
            }
        }
    }
}

async fn writer_task<P: Protocol>(
    wr: tokio::io::WriteHalf<BoxStream>,
    rx: mpsc::Receiver<Outgoing>,
    shared: Arc<Shared<P>>,
) {
    write_queued(wr, rx).await;
    shared.fail_all();
}

async fn reader_task<P: Protocol>(rd: tokio::io::ReadHalf<BoxStream>, shared: Arc<Shared<P>>) {
    // Buffered: a small reply's parts arrive in one read system call.
    let mut rd = tokio::io::BufReader::with_capacity(crate::frame_io::READ_BUFFER, rd);
    loop {
        let frame = match read_frame(&mut rd).await {
            Ok(f) => f,
            Err(ReadFrameError::BadMeta { request_id, .. }) => {
                let slot = shared.lock().remove(&request_id);
                if let Some(slot) = slot {
                    let _ = slot.send(Err(RpcError::Decode {
                        addr: shared.addr.clone(),
                        error: DecodeError::BadValue { field: "reply meta crc", value: 0 },
                    }));
                }
                continue;
            }
            Err(e) => {
                tracing::debug!(addr = %shared.addr, error = %e, "connection closed");
                break;
            }
        };
        if frame.header.kind == FrameKind::Cts {
            // A caller that gave up has removed its entry: nothing to do.
            let clear = shared.grants().remove(&frame.header.request_id);
            if let Some(clear) = clear {
                let _ = clear.send(());
            }
            continue;
        }
        if frame.header.kind != FrameKind::Response {
            tracing::warn!(addr = %shared.addr, "peer sent a request on a client connection; closing");
            break;
        }
        let slot = shared.lock().remove(&frame.header.request_id);
        let Some(slot) = slot else {
            // The caller gave up (timeout); the reply is dropped.
            continue;
        };
        let res = match P::decode_response(frame.header.opcode, &frame.meta) {
            None => Err(RpcError::Decode {
                addr: shared.addr.clone(),
                error: DecodeError::BadValue { field: "opcode", value: frame.header.opcode as u64 },
            }),
            Some(Err(error)) => Err(RpcError::Decode { addr: shared.addr.clone(), error }),
            Some(Ok(Err(reply))) => Err(RpcError::Remote { addr: shared.addr.clone(), reply }),
            Some(Ok(Ok(reply))) => Ok((reply, frame.data)),
        };
        let _ = slot.send(res);
    }
    shared.fail_all();
}
