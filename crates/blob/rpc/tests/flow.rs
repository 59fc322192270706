//! Receiver-driven flow control on a real socket: the frames a server
//! sends in answer to requests-to-send, in the order the protocol
//! promises, and what a caller sees when its grant never comes.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::{AsyncWriteExt, BufReader};

use blizzard_env::{BoxStream, Env};
use blizzard_proto::{encode_rts, ErrorCode, ErrorReply, FrameHeader, FrameKind, Opcode, Reply, Request};
use blizzard_rpc::{
    read_frame, serve, write_frame, Blob, Caller, Conn, FlowLimits, Frame, RpcError, ServerLimits, Service,
    ShutdownHandle, LARGE_TRANSFER_MIN,
};

type Error = Box<dyn std::error::Error>;

/// Answers every request with its own data.
struct Echo;

impl Service<Blob> for Echo {
    fn call(
        self: Arc<Self>,
        _req: Request,
        data: Bytes,
        _caller: Caller,
    ) -> BoxFuture<'static, (Result<Reply, ErrorReply>, Bytes)> {
        async move { (Ok(Reply::Done), data) }.boxed()
    }
}

const MIB: u32 = 1 << 20;

async fn start(flow: FlowLimits) -> Result<(String, ShutdownHandle), Error> {
    let env = Env::real();
    let listener = env.bind("127.0.0.1:0").await?;
    let addr = listener.local_addr();
    let (stop, shutdown) = ShutdownHandle::new();
    let limits = ServerLimits { flow, ..ServerLimits::default() };
    tokio::spawn(serve::<Blob>(env, listener, Arc::new(Echo), limits, shutdown));
    Ok((addr, stop))
}

fn header(kind: FrameKind, id: u64, meta: &[u8], data_len: u32) -> FrameHeader {
    FrameHeader {
        kind,
        opcode: Opcode::Ping as u16,
        request_id: id,
        meta_len: meta.len() as u32,
        data_len,
        meta_crc: blizzard_core::crc::crc32c(meta),
    }
}

/// A raw connection: frames written and read by hand.
struct Raw {
    rd: BufReader<tokio::io::ReadHalf<BoxStream>>,
    wr: tokio::io::WriteHalf<BoxStream>,
}

impl Raw {
    async fn connect(addr: &str) -> Result<Raw, Error> {
        let (rd, wr) = tokio::io::split(Env::real().connect(addr).await?);
        Ok(Raw { rd: BufReader::new(rd), wr })
    }

    async fn rts(&mut self, id: u64, len: u32) -> Result<(), Error> {
        let meta = encode_rts(len);
        write_frame(&mut self.wr, &header(FrameKind::Rts, id, &meta, 0), &meta, &[]).await?;
        Ok(self.wr.flush().await?)
    }

    async fn request(&mut self, id: u64, data: &[u8]) -> Result<(), Error> {
        let meta = Request::Ping.encode();
        write_frame(&mut self.wr, &header(FrameKind::Request, id, &meta, data.len() as u32), &meta, data)
            .await?;
        Ok(self.wr.flush().await?)
    }

    async fn next(&mut self) -> Result<Frame, Error> {
        Ok(read_frame(&mut self.rd).await?)
    }

    /// The next frame's kind, request id and (for a reply) error code.
    async fn next_kind(&mut self) -> Result<(FrameKind, u64, Option<ErrorCode>), Error> {
        let f = self.next().await?;
        let code = match f.header.kind {
            FrameKind::Response => match blizzard_proto::decode_response(Opcode::Ping, &f.meta)? {
                Ok(_) => None,
                Err(e) => Some(e.code),
            },
            _ => None,
        };
        Ok((f.header.kind, f.header.request_id, code))
    }
}

// With a window of one request, the second ask is cleared only after the
// first request's bytes arrived; small requests pass meanwhile; asks past
// the connection's bound are refused as Busy; a bad ask is refused and
// the connection carries on.
#[tokio::test]
async fn grants_come_in_turn_and_asks_are_bounded() -> Result<(), Error> {
    let flow = FlowLimits { window_bytes: Some(MIB as u64), queued_per_conn_max: 2, ..FlowLimits::default() };
    let (addr, _stop) = start(flow).await?;
    let mut c = Raw::connect(&addr).await?;
    c.rts(1, MIB).await?;
    c.rts(2, MIB).await?;
    assert_eq!(c.next_kind().await?, (FrameKind::Cts, 1, None));
    // A small request is never held: its reply comes next, before any
    // clear-to-send for 2 (which the window does not allow yet).
    c.request(3, b"small").await?;
    assert_eq!(c.next_kind().await?, (FrameKind::Response, 3, None));
    c.rts(4, MIB).await?;
    assert_eq!(c.next_kind().await?, (FrameKind::Response, 4, Some(ErrorCode::Busy)));
    let meta = [1u8, 2, 3];
    write_frame(&mut c.wr, &header(FrameKind::Rts, 5, &meta, 0), &meta, &[]).await?;
    c.wr.flush().await?;
    assert_eq!(c.next_kind().await?, (FrameKind::Response, 5, Some(ErrorCode::BadRequest)));
    // Request 1 arrives: its grant goes back and 2 is cleared.
    c.request(1, &vec![7u8; MIB as usize]).await?;
    let mut got = vec![c.next_kind().await?, c.next_kind().await?];
    got.sort_by_key(|k| k.1);
    assert_eq!(got, [(FrameKind::Response, 1, None), (FrameKind::Cts, 2, None)]);
    Ok(())
}

// A grant is taken back when its request does not come in time, and when
// its connection ends, so neither a silent nor a departed sender pins the
// window.
#[tokio::test]
async fn unused_grants_are_taken_back() -> Result<(), Error> {
    let flow = FlowLimits {
        window_bytes: Some(MIB as u64),
        grant_timeout: Duration::from_millis(50),
        ..FlowLimits::default()
    };
    let (addr, _stop) = start(flow).await?;
    let mut a = Raw::connect(&addr).await?;
    let mut b = Raw::connect(&addr).await?;
    a.rts(1, MIB).await?;
    assert_eq!(a.next_kind().await?, (FrameKind::Cts, 1, None));
    // a never sends 1: b is cleared once the grant times out.
    b.rts(1, MIB).await?;
    assert_eq!(b.next_kind().await?, (FrameKind::Cts, 1, None));
    // Now a asks again and waits behind b's grant; b leaves.
    a.rts(2, MIB).await?;
    drop(b);
    assert_eq!(a.next_kind().await?, (FrameKind::Cts, 2, None));
    Ok(())
}

// Through `Conn`: large requests ask and are served, many at once on one
// connection with a window of one, and their data comes back whole.
#[tokio::test]
async fn conn_calls_ask_and_complete() -> Result<(), Error> {
    let flow = FlowLimits { window_bytes: Some(MIB as u64), ..FlowLimits::default() };
    let (addr, _stop) = start(flow).await?;
    let env = Env::real();
    let conn = Conn::<Blob>::connect(&env, &addr).await?;
    let calls = (0..4u8).map(|i| {
        let conn = conn.clone();
        async move {
            let data = Bytes::from(vec![i; LARGE_TRANSFER_MIN as usize + 5]);
            let (_, back) = conn.call(&Request::Ping, data.clone()).await?;
            Ok::<bool, RpcError>(back == data)
        }
    });
    for r in futures::future::join_all(calls).await {
        assert!(r?, "a large request's data came back changed");
    }
    Ok(())
}

// A server that never clears a request leaves its caller with a NoGrant
// error at the deadline, not a hang; without flow control (rts_min off)
// the same request goes straight out as a request frame.
#[tokio::test]
async fn a_grant_that_never_comes_times_out_clearly() -> Result<(), Error> {
    let env = Env::real();
    let listener = env.bind("127.0.0.1:0").await?;
    let addr = listener.local_addr();
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    let silent = tokio::spawn(async move {
        let (mut kinds, mut open) = (Vec::new(), Vec::new());
        for _ in 0..2 {
            let (s, _) = listener.accept().await?;
            let mut rd = BufReader::new(s);
            let f = read_frame(&mut rd).await.map_err(std::io::Error::other)?;
            kinds.push(f.header.kind);
            // Kept open and silent: the caller must give up on its own.
            open.push(rd);
        }
        let _ = finished.await;
        Ok::<_, std::io::Error>(kinds)
    });
    let conn = Conn::<Blob>::connect(&env, &addr).await?;
    let data = Bytes::from(vec![1u8; LARGE_TRANSFER_MIN as usize]);
    let res = conn.call_timeout(&env, Duration::from_millis(100), &Request::Ping, data.clone()).await;
    assert!(matches!(&res, Err(RpcError::NoGrant(a)) if *a == addr), "{res:?}");
    let plain = Conn::<Blob>::connect(&env, &addr).await?;
    plain.set_rts_min(None);
    let res = plain.call_timeout(&env, Duration::from_millis(100), &Request::Ping, data).await;
    assert!(matches!(res, Err(RpcError::Timeout(_))), "{res:?}");
    let _ = done.send(());
    let kinds = silent.await??;
    assert_eq!(kinds, [FrameKind::Rts, FrameKind::Request]);
    Ok(())
}
