//! Shared test fixtures: an embedded cluster with volumes, an NBD server in
//! front of it, and a minimal NBD client written from the spec (raw
//! handshake helpers plus a pipelining transmission client).

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // real sockets in real time

use std::collections::HashMap;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_env::{BoxStream, Env};
use blizzard_nbd::proto::*;
use blizzard_nbd::{ClientExports, NbdConfig, Server};
use blizzard_volume::{manage, CommitMode, FlushPolicy, VolumeSpec};

pub type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub struct Fixture {
    pub env: Env,
    pub cluster: Cluster,
    pub client: blizzard_client::Client,
    pub server: Server,
    pub addr: String,
    _dir: tempfile::TempDir,
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

pub fn spec(name: &str, size: u64, mode: CommitMode, flush: FlushPolicy) -> VolumeSpec {
    let mut s = VolumeSpec::new(name, size);
    s.mode = mode;
    s.flush = flush;
    s.replication = 2;
    s.block_size = Some(4096);
    s.segment_tracts = 8;
    s
}

/// A cluster holding `volumes` and an NBD server exporting them, with the
/// first volume as the default export.
pub async fn start(volumes: &[VolumeSpec], cfg: NbdConfig) -> Fixture {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut cc = ClusterConfig::new(dir.path());
    cc.tractservers = 3;
    cc.replication = 2;
    cc.tract_size = 64 << 10;
    cc.disk_size = 64 << 20;
    cc.heartbeat_interval = Duration::from_millis(50);
    let env = Env::real();
    let cluster = Cluster::start(env.clone(), cc).await.unwrap();
    let client = cluster.client().await.unwrap();
    for s in volumes {
        manage::create(env.clone(), &client, s).await.unwrap().close().await.unwrap();
    }
    let mut cfg = cfg;
    if cfg.default_export.is_none() {
        cfg.default_export = volumes.first().map(|s| s.name.clone());
    }
    let exports = ClientExports::new(env.clone(), client.clone());
    let server = Server::start(env.clone(), exports, "127.0.0.1:0", cfg).await.unwrap();
    let addr = server.local_addr().to_string();
    Fixture { env, cluster, client, server, addr, _dir: dir }
}

impl Fixture {
    pub async fn stop(self) {
        self.server.shutdown().await.unwrap();
        self.cluster.stop().await;
    }

    pub async fn dial(&self) -> BoxStream {
        self.env.connect(&self.addr).await.unwrap()
    }
}

// ---------------------------------------------------------------------------
// Raw handshake helpers.

/// Reads the greeting and checks it; returns the handshake flags.
pub async fn greet<S: AsyncRead + Unpin>(s: &mut S) -> u16 {
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await.unwrap();
    assert_eq!(&g[..8], b"NBDMAGIC");
    assert_eq!(&g[8..16], b"IHAVEOPT");
    u16::from_be_bytes([g[16], g[17]])
}

pub async fn send_raw<S: AsyncWrite + Unpin>(s: &mut S, b: &[u8]) {
    s.write_all(b).await.unwrap();
    s.flush().await.unwrap();
}

pub async fn send_option<S: AsyncWrite + Unpin>(s: &mut S, o: &ClientOption) {
    send_raw(s, &o.encode()).await;
}

pub async fn send_raw_option<S: AsyncWrite + Unpin>(s: &mut S, option: u32, data: &[u8]) {
    let mut b = Vec::new();
    b.extend_from_slice(&IHAVEOPT.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    send_raw(s, &b).await;
}

pub async fn read_option_reply<S: AsyncRead + Unpin>(s: &mut S) -> (OptionReplyHeader, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).await.unwrap();
    let h = decode_option_reply_header(&h).unwrap();
    assert!(h.len <= 1 << 20, "option reply of {} bytes", h.len);
    let mut d = vec![0u8; h.len as usize];
    s.read_exact(&mut d).await.unwrap();
    (h, d)
}

/// Replies up to and including the final one (ACK or an error).
pub async fn read_option_replies<S: AsyncRead + Unpin>(s: &mut S) -> Vec<(OptionReplyHeader, Vec<u8>)> {
    let mut out = Vec::new();
    loop {
        let r = read_option_reply(s).await;
        let last = r.0.reply_type == NBD_REP_ACK || is_rep_error(r.0.reply_type);
        out.push(r);
        if last {
            return out;
        }
    }
}

/// True if the server closed the connection (reads hit end of stream or a
/// reset) within 10 seconds.
pub async fn closed_by_server<S: AsyncRead + Unpin>(s: &mut S) -> bool {
    let mut b = [0u8; 4096];
    let env = Env::real();
    let deadline = env.timeout(Duration::from_secs(10), async {
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    });
    deadline.await.unwrap_or(false)
}

// ---------------------------------------------------------------------------
// The transmission client.

/// What to negotiate.
#[derive(Clone, Copy, Debug)]
pub struct Want {
    pub structured: bool,
    pub base_allocation: bool,
    /// Use NBD_OPT_EXPORT_NAME (with or without NO_ZEROES) instead of GO.
    pub export_name: Option<bool>,
}

pub const FULL: Want = Want { structured: true, base_allocation: true, export_name: None };
pub const SIMPLE: Want = Want { structured: false, base_allocation: false, export_name: None };

/// A reply as the client assembled it.
#[derive(Debug, Default, Clone)]
pub struct Resp {
    pub errno: u32,
    pub message: String,
    pub data: Vec<u8>,
    pub extents: Vec<(u32, u32)>,
    pub chunks: usize,
}

struct Pending {
    command: u16,
    offset: u64,
    len: u32,
    resp: Resp,
}

pub struct Nbd {
    r: BufReader<ReadHalf<BoxStream>>,
    w: WriteHalf<BoxStream>,
    pub size: u64,
    pub flags: u16,
    pub structured: bool,
    pub context: Option<u32>,
    pub block_size: Option<(u32, u32, u32)>,
    pending: HashMap<u64, Pending>,
    next_cookie: u64,
}

impl Nbd {
    pub async fn connect(addr: &str, export: &str, want: Want) -> Nbd {
        let mut s = Env::real().connect(addr).await.unwrap();
        let hf = greet(&mut s).await;
        assert_eq!(hf, NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        let no_zeroes = want.export_name.unwrap_or(true);
        let cf = NBD_FLAG_C_FIXED_NEWSTYLE | if no_zeroes { NBD_FLAG_C_NO_ZEROES } else { 0 };
        send_raw(&mut s, &cf.to_be_bytes()).await;
        if want.structured {
            send_option(&mut s, &ClientOption::StructuredReply).await;
            let r = read_option_replies(&mut s).await;
            assert_eq!(r[0].0.reply_type, NBD_REP_ACK);
        }
        let mut context = None;
        if want.base_allocation {
            let m = MetaContextRequest { export: export.into(), queries: vec![BASE_ALLOCATION.into()] };
            send_option(&mut s, &ClientOption::SetMetaContext(m)).await;
            let r = read_option_replies(&mut s).await;
            assert_eq!(r.len(), 2, "{r:?}");
            assert_eq!(r[0].0.reply_type, NBD_REP_META_CONTEXT);
            assert_eq!(&r[0].1[4..], BASE_ALLOCATION.as_bytes());
            context = Some(u32::from_be_bytes([r[0].1[0], r[0].1[1], r[0].1[2], r[0].1[3]]));
            assert_eq!(r[1].0.reply_type, NBD_REP_ACK);
        }
        let (size, flags, block_size) = if want.export_name.is_some() {
            send_option(&mut s, &ClientOption::ExportName(export.into())).await;
            let mut b = vec![0u8; 10 + if no_zeroes { 0 } else { EXPORT_NAME_REPLY_ZEROES }];
            s.read_exact(&mut b).await.unwrap();
            assert!(b[10..].iter().all(|&z| z == 0));
            let size = u64::from_be_bytes(b[..8].try_into().unwrap());
            (size, u16::from_be_bytes([b[8], b[9]]), None)
        } else {
            let go = InfoRequest { name: export.into(), info: vec![NBD_INFO_BLOCK_SIZE] };
            send_option(&mut s, &ClientOption::Go(go)).await;
            let r = read_option_replies(&mut s).await;
            let last = r.last().unwrap();
            assert_eq!(last.0.reply_type, NBD_REP_ACK, "GO failed: {}", String::from_utf8_lossy(&last.1));
            let mut size_flags = None;
            let mut bs = None;
            for (h, d) in &r[..r.len() - 1] {
                assert_eq!(h.reply_type, NBD_REP_INFO);
                match u16::from_be_bytes([d[0], d[1]]) {
                    NBD_INFO_EXPORT => {
                        assert_eq!(d.len(), 12);
                        size_flags = Some((
                            u64::from_be_bytes(d[2..10].try_into().unwrap()),
                            u16::from_be_bytes([d[10], d[11]]),
                        ));
                    }
                    NBD_INFO_BLOCK_SIZE => {
                        assert_eq!(d.len(), 14);
                        let u = |i: usize| u32::from_be_bytes(d[i..i + 4].try_into().unwrap());
                        bs = Some((u(2), u(6), u(10)));
                    }
                    _ => {}
                }
            }
            let (size, flags) = size_flags.expect("GO succeeded without NBD_INFO_EXPORT");
            (size, flags, bs)
        };
        let (r, w) = tokio::io::split(s);
        Nbd {
            r: BufReader::new(r),
            w,
            size,
            flags,
            structured: want.structured,
            context,
            block_size,
            pending: HashMap::new(),
            next_cookie: 1,
        }
    }

    /// Sends a request; returns its cookie.
    pub async fn send(&mut self, command: u16, flags: u16, offset: u64, len: u32, payload: &[u8]) -> u64 {
        let cookie = self.next_cookie;
        self.next_cookie += 1;
        let req = Request { flags, command, cookie, offset, len };
        let mut b = req.encode().to_vec();
        b.extend_from_slice(payload);
        self.w.write_all(&b).await.unwrap();
        if command != NBD_CMD_DISC {
            self.pending.insert(cookie, Pending { command, offset, len, resp: Resp::default() });
        }
        cookie
    }

    pub async fn flush_socket(&mut self) {
        self.w.flush().await.unwrap();
    }

    /// Raw bytes straight to the socket.
    pub async fn send_bytes(&mut self, b: &[u8]) {
        self.w.write_all(b).await.unwrap();
        self.w.flush().await.unwrap();
    }

    /// The next complete reply.
    pub async fn recv(&mut self) -> (u64, Resp) {
        self.try_recv().await.unwrap()
    }

    pub async fn try_recv(&mut self) -> std::io::Result<(u64, Resp)> {
        loop {
            let mut magic = [0u8; 4];
            self.r.read_exact(&mut magic).await?;
            let m = u32::from_be_bytes(magic);
            if m == NBD_SIMPLE_REPLY_MAGIC {
                let mut rest = [0u8; 12];
                self.r.read_exact(&mut rest).await?;
                let mut h = magic.to_vec();
                h.extend_from_slice(&rest);
                let ReplyHeader::Simple { errno, cookie } = decode_reply_header(&h).unwrap() else {
                    unreachable!()
                };
                let mut p = self.pending.remove(&cookie).expect("reply to an unknown cookie");
                p.resp.errno = errno;
                if p.command == NBD_CMD_READ && errno == 0 {
                    assert!(!self.structured, "simple reply to a READ with structured replies");
                    p.resp.data = vec![0u8; p.len as usize];
                    self.r.read_exact(&mut p.resp.data).await?;
                }
                return Ok((cookie, p.resp));
            }
            assert_eq!(m, NBD_STRUCTURED_REPLY_MAGIC, "bad reply magic {m:#x}");
            assert!(self.structured, "structured reply without negotiation");
            let mut rest = [0u8; 16];
            self.r.read_exact(&mut rest).await?;
            let mut h = magic.to_vec();
            h.extend_from_slice(&rest);
            let ReplyHeader::Chunk { flags, reply_type, cookie, len } = decode_reply_header(&h).unwrap()
            else {
                unreachable!()
            };
            assert!(len <= PAYLOAD_MAX + 8 + 8 * 65536, "chunk of {len} bytes");
            let mut payload = vec![0u8; len as usize];
            self.r.read_exact(&mut payload).await?;
            let p = self.pending.get_mut(&cookie).expect("chunk for an unknown cookie");
            p.resp.chunks += 1;
            match reply_type {
                NBD_REPLY_TYPE_NONE => assert_eq!(len, 0),
                NBD_REPLY_TYPE_OFFSET_DATA => {
                    assert_eq!(p.command, NBD_CMD_READ);
                    let off = u64::from_be_bytes(payload[..8].try_into().unwrap());
                    let data = &payload[8..];
                    assert!(!data.is_empty());
                    assert!(off >= p.offset && off + data.len() as u64 <= p.offset + p.len as u64);
                    if p.resp.data.is_empty() {
                        p.resp.data = vec![0u8; p.len as usize];
                    }
                    let at = (off - p.offset) as usize;
                    p.resp.data[at..at + data.len()].copy_from_slice(data);
                }
                NBD_REPLY_TYPE_BLOCK_STATUS => {
                    assert_eq!(p.command, NBD_CMD_BLOCK_STATUS);
                    assert!(len >= 12 && (len - 4) % 8 == 0);
                    let id = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    assert_eq!(Some(id), self.context);
                    for c in payload[4..].chunks(8) {
                        let l = u32::from_be_bytes(c[..4].try_into().unwrap());
                        let f = u32::from_be_bytes(c[4..].try_into().unwrap());
                        assert!(l > 0, "zero-length extent");
                        p.resp.extents.push((l, f));
                    }
                }
                NBD_REPLY_TYPE_ERROR => {
                    let errno = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    let ml = u16::from_be_bytes([payload[4], payload[5]]) as usize;
                    assert_eq!(6 + ml, payload.len());
                    assert_ne!(errno, 0);
                    p.resp.errno = errno;
                    p.resp.message = String::from_utf8(payload[6..].to_vec()).unwrap();
                }
                t => panic!("unexpected chunk type {t}"),
            }
            if flags & NBD_REPLY_FLAG_DONE != 0 {
                let mut p = self.pending.remove(&cookie).unwrap();
                if p.command == NBD_CMD_READ && p.resp.errno == 0 && p.resp.data.is_empty() {
                    // A zero-length read, or holes only.
                    p.resp.data = vec![0u8; p.len as usize];
                }
                return Ok((cookie, p.resp));
            }
        }
    }

    /// One request, waiting for its reply.
    pub async fn call(&mut self, command: u16, flags: u16, offset: u64, len: u32, payload: &[u8]) -> Resp {
        let c = self.send(command, flags, offset, len, payload).await;
        self.flush_socket().await;
        let (got, r) = self.recv().await;
        assert_eq!(got, c);
        r
    }

    pub async fn write(&mut self, offset: u64, data: &[u8]) {
        let r = self.call(NBD_CMD_WRITE, 0, offset, data.len() as u32, data).await;
        assert_eq!(r.errno, 0, "write at {offset}: {}", r.message);
    }

    pub async fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let r = self.call(NBD_CMD_READ, 0, offset, len, &[]).await;
        assert_eq!(r.errno, 0, "read at {offset}: {}", r.message);
        r.data
    }

    pub async fn flush(&mut self) {
        let r = self.call(NBD_CMD_FLUSH, 0, 0, 0, &[]).await;
        assert_eq!(r.errno, 0, "flush: {}", r.message);
    }

    /// Sends NBD_CMD_DISC and waits for the server to close.
    pub async fn disconnect(mut self) {
        self.send(NBD_CMD_DISC, 0, 0, 0, &[]).await;
        self.flush_socket().await;
        assert!(closed_by_server(&mut self.r).await);
    }

    pub async fn closed(&mut self) -> bool {
        closed_by_server(&mut self.r).await
    }

    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// A deterministic pattern for `len` bytes at `offset` in round `round`.
pub fn pattern(offset: u64, len: usize, round: u64) -> Vec<u8> {
    (0..len as u64).map(|i| ((offset + i) * 31 + round * 7 + ((offset + i) >> 9)) as u8).collect()
}
