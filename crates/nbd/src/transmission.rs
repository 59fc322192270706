//! The transmission phase: many requests in flight, replies out of order.
//!
//! Shape: one reader decodes requests (header, then a WRITE's payload read
//! straight into one buffer of exactly its length) and spawns a task per
//! request; one writer serialises the replies those tasks send it, header
//! then data, coalescing small replies into one socket write.
//!
//! Bounds: a connection has at most `requests_in_flight_max` requests
//! between header and reply (the reader stops reading the socket until one
//! completes), and payload bytes buffered for writes and reads come out of
//! a server-wide budget; permits travel with the reply and are returned
//! once it is handed to the socket.
//!
//! Ending: on NBD_CMD_DISC, end of stream, a protocol violation or server
//! shutdown the reader stops; the writer still sends every in-flight reply
//! (each task holds a sender, so the reply queue closes only when the last
//! task is done), then closes the socket. A client that vanishes makes the
//! writer fail, which stops the reader; tasks still complete their volume
//! operation and their replies are dropped.
//!
//! Parking (a hand-over, `Shared::pause`): the reader stops only at a
//! request boundary — waiting for a request slot, or for the first byte
//! of the next header, before consuming anything of it — never in the
//! middle of a request. The writer sends every in-flight reply as above
//! but leaves the socket open, and [`serve`] returns the socket with the
//! bytes read from it but not used (what the read buffer holds), so the
//! next reader, here or in a successor, starts exactly where this one
//! stopped. Bytes the client sent that were never read stay in the
//! kernel's socket buffer.

use std::sync::{Arc, OnceLock};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use blizzard_env::BoxStream;
use blizzard_volume::{AllocExtent, Allocation, ErrorKind, Volume, VolumeError};

use crate::handshake::Negotiated;
use crate::proto::*;
use crate::server::{ConnError, Shared};
use blizzard_env::Flag;

/// Read buffer: many small request headers per system call.
pub(crate) const READ_BUF_LEN: usize = 64 << 10;
/// Write buffer: many small replies per system call; larger read data goes
/// to the socket directly.
const WRITE_BUF_LEN: usize = 64 << 10;
/// NO_HOLE write-zeroes writes real zeros in pieces of this size, all
/// slices of one shared zero buffer.
const ZERO_PIECE_LEN: usize = 1 << 20;

const _: () = assert!(ZERO_PIECE_LEN <= PAYLOAD_MAX as usize);

/// A reply ready to send: a header (up to a structured chunk header plus a
/// data offset) and an optional body, with the permits it releases.
pub(crate) struct Reply {
    head: [u8; CHUNK_HEADER_LEN + 8],
    head_len: usize,
    body: Bytes,
    _permits: Permits,
}

struct Permits {
    _request: OwnedSemaphorePermit,
    /// This connection's share, then the server-wide budget.
    _bytes: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

impl Reply {
    fn new(head: &[u8], body: Bytes, permits: Permits) -> Reply {
        let mut h = [0u8; CHUNK_HEADER_LEN + 8];
        h[..head.len()].copy_from_slice(head);
        Reply { head: h, head_len: head.len(), body, _permits: permits }
    }
}

/// What a request produced.
#[derive(Debug)]
enum Outcome {
    Done,
    Data(Bytes),
    Extents { context: u32, extents: Vec<(u32, u32)> },
}

/// A failed request: the errno for the client and a message for humans.
#[derive(Debug)]
struct Failure {
    errno: u32,
    message: String,
}

/// Builds the reply for `cookie` under the negotiated reply style.
fn encode_reply(
    structured: bool,
    cookie: u64,
    offset: u64,
    r: Result<Outcome, Failure>,
    p: Permits,
) -> Reply {
    match r {
        // A simple reply is allowed for any payload-less success, even with
        // structured replies, and is the shortest.
        Ok(Outcome::Done) => Reply::new(&encode_simple_reply(0, cookie), Bytes::new(), p),
        Ok(Outcome::Data(data)) if structured => {
            if data.is_empty() {
                let h = encode_chunk_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_NONE, cookie, 0);
                return Reply::new(&h, Bytes::new(), p);
            }
            // One chunk covering the whole read, marked final: all the data
            // is in hand, so no error can follow (and DF is satisfied).
            let len = 8 + data.len() as u32;
            let mut h = [0u8; CHUNK_HEADER_LEN + 8];
            h[..CHUNK_HEADER_LEN].copy_from_slice(&encode_chunk_header(
                NBD_REPLY_FLAG_DONE,
                NBD_REPLY_TYPE_OFFSET_DATA,
                cookie,
                len,
            ));
            h[CHUNK_HEADER_LEN..].copy_from_slice(&offset.to_be_bytes());
            Reply::new(&h, data, p)
        }
        Ok(Outcome::Data(data)) => Reply::new(&encode_simple_reply(0, cookie), data, p),
        Ok(Outcome::Extents { context, extents }) => {
            let body = encode_block_status(context, &extents);
            let h = encode_chunk_header(
                NBD_REPLY_FLAG_DONE,
                NBD_REPLY_TYPE_BLOCK_STATUS,
                cookie,
                body.len() as u32,
            );
            Reply::new(&h, body, p)
        }
        Err(f) if structured => {
            let body = encode_error_payload(f.errno, &f.message);
            let h = encode_chunk_header(NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_ERROR, cookie, body.len() as u32);
            Reply::new(&h, body, p)
        }
        Err(f) => Reply::new(&encode_simple_reply(f.errno, cookie), Bytes::new(), p),
    }
}

/// The NBD errno for a volume error, by its kind alone.
fn errno_for(cmd: &Command, e: &VolumeError) -> u32 {
    let write = matches!(cmd, Command::Write { .. } | Command::WriteZeroes { .. });
    match e.kind() {
        ErrorKind::NoSpace => NBD_ENOSPC,
        // Past the end: ENOSPC for writes, EINVAL for the rest (the spec's
        // "Error values").
        ErrorKind::OutOfRange if write => NBD_ENOSPC,
        ErrorKind::OutOfRange => NBD_EINVAL,
        ErrorKind::Invalid => NBD_EINVAL,
        ErrorKind::Fenced | ErrorKind::Corrupt | ErrorKind::Unavailable => NBD_EIO,
    }
}

/// Block-status descriptors for `base:allocation` from the volume's
/// allocation of `[offset, offset + len)`: merged runs of equal state,
/// clipped to `len` (to the first run with REQ_ONE), at most `EXTENTS_MAX`.
/// Never empty: with no information, one extent of state 0 ("allocated or
/// unknown") is always truthful.
fn block_status_extents(alloc: &[AllocExtent], len: u32, req_one: bool) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    let mut left = len;
    for e in alloc {
        if left == 0 {
            break;
        }
        let n = e.len.min(left as u64) as u32;
        if n == 0 {
            continue;
        }
        let flags = flags_of(e.state);
        let full = req_one || out.len() == EXTENTS_MAX;
        match out.last_mut() {
            Some((l, f)) if *f == flags => *l += n,
            Some(_) if full => break,
            _ => out.push((n, flags)),
        }
        left -= n;
    }
    if out.is_empty() {
        out.push((len, 0));
    }
    out
}

fn flags_of(a: Allocation) -> u32 {
    match a {
        Allocation::Zero => NBD_STATE_HOLE | NBD_STATE_ZERO,
        Allocation::Data => 0,
    }
}

fn zeros() -> &'static Bytes {
    static ZEROS: OnceLock<Bytes> = OnceLock::new();
    ZEROS.get_or_init(|| Bytes::from(vec![0u8; ZERO_PIECE_LEN]))
}

/// Runs one validated command on the volume.
async fn execute(v: &Volume, cmd: Command, payload: Bytes) -> Result<Outcome, VolumeError> {
    match cmd {
        Command::Read { offset, len } => Ok(Outcome::Data(v.read(offset, len as u64).await?)),
        Command::Write { offset, fua, .. } => {
            v.write(offset, payload, fua).await?;
            Ok(Outcome::Done)
        }
        Command::Flush => {
            v.flush().await?;
            Ok(Outcome::Done)
        }
        Command::Trim { offset, len, fua } => {
            v.trim(offset, len as u64).await?;
            if fua {
                v.flush_durable().await?;
            }
            Ok(Outcome::Done)
        }
        Command::WriteZeroes { offset, len, fua, no_hole: false } => {
            v.write_zeroes(offset, len as u64, fua).await?;
            Ok(Outcome::Done)
        }
        Command::WriteZeroes { offset, len, fua, no_hole: true } => {
            // NO_HOLE: the range must stay provisioned, so write real zero
            // bytes. Pieces go in order and only the last carries FUA: a
            // FUA write makes every write acknowledged before it durable
            // too, in every commit mode.
            let end = offset + len as u64;
            let mut at = offset;
            while at < end {
                let n = (end - at).min(ZERO_PIECE_LEN as u64);
                v.write(at, zeros().slice(..n as usize), fua && at + n == end).await?;
                at += n;
            }
            Ok(Outcome::Done)
        }
        Command::Cache { .. } | Command::Disc => Ok(Outcome::Done),
        Command::BlockStatus { offset, len, req_one, context } => {
            let alloc = v.allocation(offset, len as u64).await?;
            Ok(Outcome::Extents { context, extents: block_status_extents(&alloc, len, req_one) })
        }
    }
}

/// How a connection's transmission phase ended.
pub(crate) enum Served {
    Closed,
    /// Stopped at a request boundary for a hand-over, every reply sent:
    /// the socket, and the bytes read from it but not used.
    Parked {
        stream: BoxStream,
        leftover: Vec<u8>,
    },
}

/// How the reader stopped without an error.
enum Ended {
    Closed,
    Parked,
}

/// Serves a negotiated connection until the client leaves, breaks the
/// protocol, or the server stops or parks it. `leftover`: bytes already
/// read from `stream` (after the handshake, or by an earlier server) that
/// come before anything still in the socket.
pub(crate) async fn serve(
    stream: BoxStream,
    leftover: Vec<u8>,
    n: &Negotiated,
    shared: Arc<Shared>,
    peer: &str,
) -> Result<Served, ConnError> {
    let (rd, wr) = tokio::io::split(stream);
    let mut rd = BufReader::with_capacity(READ_BUF_LEN, std::io::Cursor::new(leftover).chain(rd));
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    // Tells the reader that the writer can no longer reach the client.
    let writer_failed = Flag::new();
    let reader = read_requests(&mut rd, tx, n, &shared, &writer_failed, peer);
    let writer = async {
        let r = write_replies(BufWriter::with_capacity(WRITE_BUF_LEN, wr), rx).await;
        if r.is_err() {
            writer_failed.set();
        }
        r
    };
    let (r, w) = tokio::join!(reader, writer);
    // The reader's reason comes first: a client that hung up mid-request
    // also breaks the writer.
    let ended = r?;
    let w = w?;
    match ended {
        Ended::Closed => {
            w.into_inner().shutdown().await?;
            Ok(Served::Closed)
        }
        Ended::Parked => {
            // The read buffer's bytes come before what is left of the
            // leftover it was filled from.
            let mut leftover = rd.buffer().to_vec();
            let (rest, rd) = rd.into_inner().into_inner();
            let at = (rest.position() as usize).min(rest.get_ref().len());
            leftover.extend_from_slice(&rest.get_ref()[at..]);
            Ok(Served::Parked { stream: rd.unsplit(w.into_inner()), leftover })
        }
    }
}

/// Sends replies until every sender is gone, and returns the writer with
/// everything flushed (the caller closes or keeps the socket).
async fn write_replies<W: AsyncWrite + Unpin>(
    mut w: BufWriter<W>,
    mut rx: mpsc::UnboundedReceiver<Reply>,
) -> std::io::Result<BufWriter<W>> {
    while let Some(first) = rx.recv().await {
        put(&mut w, first).await?;
        // Coalesce whatever else is ready into the same flush.
        while let Ok(next) = rx.try_recv() {
            put(&mut w, next).await?;
        }
        w.flush().await?;
    }
    Ok(w)
}

/// Header and data as one write: into the buffer if they fit, else in one
/// vectored write past it. Written one after the other, a large read's
/// header went out in a segment of its own ahead of its data, and the
/// client woke once for each.
async fn put<W: AsyncWrite + Unpin>(w: &mut BufWriter<W>, r: Reply) -> std::io::Result<()> {
    let mut both = bytes::Buf::chain(&r.head[..r.head_len], &r.body[..]);
    w.write_all_buf(&mut both).await
}

/// Reads a request header; `Ok(false)` on a clean end of stream between
/// requests.
async fn read_header<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8; REQUEST_LEN]) -> std::io::Result<bool> {
    let mut got = 0;
    while got < REQUEST_LEN {
        let n = rd.read(&mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Reads a WRITE payload into one buffer of exactly `len` bytes (no zero
/// fill, no copy afterwards).
async fn read_payload<R: AsyncRead + Unpin>(rd: &mut R, len: u32) -> std::io::Result<Bytes> {
    let len = len as usize;
    let mut buf = BytesMut::with_capacity(len);
    while buf.len() < len {
        let want = (len - buf.len()) as u64;
        if (&mut *rd).take(want).read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(buf.freeze())
}

/// Skips `len` payload bytes of a refused request.
async fn drain<R: AsyncRead + Unpin>(rd: &mut R, len: u32) -> std::io::Result<()> {
    let n = tokio::io::copy(&mut (&mut *rd).take(len as u64), &mut tokio::io::sink()).await?;
    if n < len as u64 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Why the reader stopped early.
enum Stop {
    Shutdown,
    WriterFailed,
    /// The client's certificate was revoked (issue 56).
    Revoked,
}

async fn read_requests<R: AsyncBufReadExt + Unpin>(
    rd: &mut R,
    tx: mpsc::UnboundedSender<Reply>,
    n: &Negotiated,
    shared: &Arc<Shared>,
    writer_failed: &Flag,
    peer: &str,
) -> Result<Ended, ConnError> {
    let in_flight = Arc::new(Semaphore::new(shared.cfg.requests_in_flight_max));
    let conn_bytes = Arc::new(Semaphore::new(shared.cfg.connection_buffered_bytes_max));
    let session = n.session;
    // Fixed when the volume was opened: a read-only export refuses changes
    // before they reach it.
    let read_only = n.read_only;
    // Everything the reader waits on is raced against these.
    let revoked = async {
        match n.serial.as_deref() {
            Some(serial) => shared.revocations.until_revoked(serial).await,
            None => std::future::pending().await,
        }
    };
    let stop = async {
        tokio::select! {
            biased;
            _ = shared.shutdown.wait() => Stop::Shutdown,
            _ = writer_failed.wait() => Stop::WriterFailed,
            _ = revoked => Stop::Revoked,
        }
    };
    tokio::pin!(stop);
    let stopped = |s: Stop| match s {
        Stop::Shutdown => Err(ConnError::Shutdown),
        Stop::Revoked => Err(ConnError::Tls("closed: the client's certificate was revoked".into())),
        // The writer's error is the one to report.
        Stop::WriterFailed => Ok(Ended::Closed),
    };
    loop {
        // A request boundary: nothing of the next request is consumed
        // until the first byte of its header is in the buffer, so these
        // two waits are where a hand-over parks the reader.
        let request_permit = tokio::select! {
            biased;
            s = &mut stop => return stopped(s),
            _ = shared.pause.wait() => return Ok(Ended::Parked),
            p = in_flight.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return Ok(Ended::Closed),
            },
        };
        let more = tokio::select! {
            biased;
            s = &mut stop => return stopped(s),
            _ = shared.pause.wait() => return Ok(Ended::Parked),
            r = rd.fill_buf() => !r?.is_empty(),
        };
        if !more {
            debug!(%peer, "NBD client closed the connection without NBD_CMD_DISC");
            return Ok(Ended::Closed);
        }
        let mut hdr = [0u8; REQUEST_LEN];
        let more = tokio::select! {
            biased;
            s = &mut stop => return stopped(s),
            r = read_header(&mut *rd, &mut hdr) => r?,
        };
        if !more {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        let req = decode_request(&hdr).map_err(|e| {
            let hint = if u32::from_be_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) == NBD_EXTENDED_REQUEST_MAGIC {
                " (extended headers were not negotiated)"
            } else {
                ""
            };
            ConnError::Protocol(format!("request header: {e}{hint}"))
        })?;
        let cmd = match check_request(&req, &session).and_then(|c| check_read_only(c, read_only)) {
            Ok(Command::Disc) => {
                debug!(%peer, "NBD_CMD_DISC");
                return Ok(Ended::Closed);
            }
            Ok(cmd) => cmd,
            Err(rej) => {
                // Refusals of well-formed requests (unsupported, or a change
                // to a read-only export) are the client's choice, not a bug.
                if rej.errno == NBD_ENOTSUP || rej.errno == NBD_EPERM {
                    debug!(%peer, cookie = req.cookie, reason = %rej.reason, "NBD request refused");
                } else {
                    warn!(%peer, cookie = req.cookie, command = req.command, reason = %rej.reason, "bad NBD request");
                }
                if rej.drain > 0 {
                    tokio::select! {
                        biased;
                        s = &mut stop => return stopped(s),
                        r = drain(&mut *rd, rej.drain) => r?,
                    }
                }
                let p = Permits { _request: request_permit, _bytes: None };
                let f = Failure { errno: rej.errno, message: rej.reason.clone() };
                // A send fails only when the writer is gone; the reader
                // hears about that next time round.
                let _ = tx.send(encode_reply(session.structured, req.cookie, req.offset, Err(f), p));
                if rej.disconnect {
                    return Err(ConnError::Protocol(rej.reason));
                }
                continue;
            }
        };
        // Bytes this request buffers: its payload or the data it returns.
        let bytes = match cmd {
            Command::Read { len, .. } | Command::Write { len, .. } => len,
            _ => 0,
        };
        // Always the connection's share first, then the server's: one
        // order, so no two requests wait on each other crosswise.
        let bytes_permit = if bytes > 0 {
            let both = async {
                let mine = conn_bytes.clone().acquire_many_owned(bytes).await?;
                let server = shared.budget.clone().acquire_many_owned(bytes).await?;
                Ok::<_, tokio::sync::AcquireError>((mine, server))
            };
            tokio::select! {
                biased;
                s = &mut stop => return stopped(s),
                p = both => match p {
                    Ok(p) => Some(p),
                    Err(_) => return Ok(Ended::Closed),
                },
            }
        } else {
            None
        };
        let payload = match cmd {
            Command::Write { len, .. } => tokio::select! {
                biased;
                s = &mut stop => return stopped(s),
                r = read_payload(&mut *rd, len) => r?,
            },
            _ => Bytes::new(),
        };
        let permits = Permits { _request: request_permit, _bytes: bytes_permit };
        let volume = n.volume.clone();
        let tx = tx.clone();
        let (cookie, offset) = (req.cookie, req.offset);
        tokio::spawn(async move {
            let r = execute(&volume, cmd, payload)
                .await
                .map_err(|e| Failure { errno: errno_for(&cmd, &e), message: e.to_string() });
            if let Err(f) = &r {
                debug!(cookie, ?cmd, errno = f.errno, error = %f.message, "NBD request failed");
            }
            let _ = tx.send(encode_reply(session.structured, cookie, offset, r, permits));
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ext(len: u64, state: Allocation) -> AllocExtent {
        AllocExtent { len, state }
    }

    const HZ: u32 = NBD_STATE_HOLE | NBD_STATE_ZERO;

    /// Runs of equal state merge; descriptors never exceed the request.
    #[test]
    fn extents_merge_and_clip() {
        use Allocation::*;
        let a = [ext(4096, Data), ext(4096, Data), ext(8192, Zero), ext(0, Data), ext(100, Data)];
        assert_eq!(block_status_extents(&a, 20000, false), vec![(8192, 0), (8192, HZ), (100, 0)]);
        assert_eq!(block_status_extents(&a, 10000, false), vec![(8192, 0), (1808, HZ)]);
    }

    /// REQ_ONE: exactly one descriptor, no longer than the request.
    #[test]
    fn extents_req_one() {
        use Allocation::*;
        let a = [ext(4096, Zero), ext(4096, Zero), ext(4096, Data)];
        assert_eq!(block_status_extents(&a, 12288, true), vec![(8192, HZ)]);
        assert_eq!(block_status_extents(&a, 5000, true), vec![(5000, HZ)]);
    }

    /// Errnos follow the error's kind: a full cluster is ENOSPC to a flush
    /// as to a write (fast-ack reports it at the flush), past the end is
    /// ENOSPC only for writes.
    #[test]
    fn errnos_follow_the_kind() {
        use blizzard_client::ClientError;
        use blizzard_volume::IoError;
        let full = VolumeError::Io(IoError::Client(ClientError::DiskFull {
            addr: "ts".into(),
            message: "no free tract slot".into(),
        }));
        let write = Command::Write { offset: 0, len: 4096, fua: false };
        let read = Command::Read { offset: 0, len: 4096 };
        assert_eq!(errno_for(&write, &full), NBD_ENOSPC);
        assert_eq!(errno_for(&Command::Flush, &full), NBD_ENOSPC);
        let past = VolumeError::OutOfRange { offset: 1 << 30, len: 4096, size: 1 << 20 };
        assert_eq!(errno_for(&write, &past), NBD_ENOSPC);
        assert_eq!(errno_for(&read, &past), NBD_EINVAL);
        assert_eq!(errno_for(&read, &VolumeError::Fenced { newest: 3 }), NBD_EIO);
        let down =
            VolumeError::Io(IoError::Client(ClientError::Unavailable { attempts: 12, last: "x".into() }));
        assert_eq!(errno_for(&read, &down), NBD_EIO);
    }

    /// No information still yields one truthful descriptor.
    #[test]
    fn extents_never_empty() {
        assert_eq!(block_status_extents(&[], 512, false), vec![(512, 0)]);
    }

    /// Reply encodings: a READ is one final OFFSET_DATA chunk with
    /// structured replies, a simple header plus data without; errors carry
    /// the errno either way.
    #[test]
    fn reply_shapes() {
        let permits =
            || Permits { _request: Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap(), _bytes: None };
        let r = encode_reply(true, 9, 4096, Ok(Outcome::Data(Bytes::from_static(b"abc"))), permits());
        assert_eq!(
            decode_reply_header(&r.head[..r.head_len]).unwrap(),
            ReplyHeader::Chunk {
                flags: NBD_REPLY_FLAG_DONE,
                reply_type: NBD_REPLY_TYPE_OFFSET_DATA,
                cookie: 9,
                len: 11
            }
        );
        assert_eq!(&r.head[CHUNK_HEADER_LEN..r.head_len], &4096u64.to_be_bytes());
        let r = encode_reply(false, 9, 0, Ok(Outcome::Data(Bytes::from_static(b"abc"))), permits());
        assert_eq!(r.head_len, SIMPLE_REPLY_LEN);
        assert_eq!(&r.body[..], b"abc");
        let f = Failure { errno: NBD_EIO, message: "boom".into() };
        let r = encode_reply(false, 9, 0, Err(f), permits());
        assert_eq!(
            decode_reply_header(&r.head[..r.head_len]).unwrap(),
            ReplyHeader::Simple { errno: NBD_EIO, cookie: 9 }
        );
        let f = Failure { errno: NBD_EIO, message: "boom".into() };
        let r = encode_reply(true, 9, 0, Err(f), permits());
        assert_eq!(&r.body[..], &[0, 0, 0, 5, 0, 4, b'b', b'o', b'o', b'm']);
    }

    /// A socket that records each write call it gets.
    struct Recorder {
        calls: Vec<usize>,
        vectored: bool,
    }

    impl AsyncWrite for Recorder {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.calls.push(buf.len());
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let n = bufs.iter().map(|b| b.len()).sum();
            self.calls.push(n);
            std::task::Poll::Ready(Ok(n))
        }
        fn is_write_vectored(&self) -> bool {
            self.vectored
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// A large read's reply leaves in one write, header and data together
    /// (a header alone in a segment wakes the client once more); small
    /// replies are buffered and leave together at the flush.
    #[tokio::test]
    async fn a_reply_leaves_in_one_write() {
        let permits =
            || Permits { _request: Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap(), _bytes: None };
        let big = Bytes::from(vec![7u8; 1 << 20]);
        let small = Bytes::from(vec![7u8; 4096]);
        let mut w = BufWriter::with_capacity(WRITE_BUF_LEN, Recorder { calls: vec![], vectored: true });
        put(&mut w, encode_reply(false, 1, 0, Ok(Outcome::Data(big.clone())), permits())).await.unwrap();
        assert_eq!(w.get_ref().calls, vec![SIMPLE_REPLY_LEN + (1 << 20)]);
        for cookie in 2..5 {
            put(&mut w, encode_reply(false, cookie, 0, Ok(Outcome::Data(small.clone())), permits()))
                .await
                .unwrap();
        }
        w.flush().await.unwrap();
        assert_eq!(w.get_ref().calls[1..], [3 * (SIMPLE_REPLY_LEN + 4096)]);
        // A stream without vectored writes still gets every byte, in order.
        let mut w = BufWriter::with_capacity(WRITE_BUF_LEN, Recorder { calls: vec![], vectored: false });
        put(&mut w, encode_reply(false, 1, 0, Ok(Outcome::Data(big)), permits())).await.unwrap();
        w.flush().await.unwrap();
        assert_eq!(w.get_ref().calls.iter().sum::<usize>(), SIMPLE_REPLY_LEN + (1 << 20));
    }
}
