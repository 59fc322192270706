//! Reading and writing whole frames on a stream.

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;

use blizzard_proto::{FrameError, FrameHeader, HEADER_LEN};

/// Read buffer per connection. Reads at least this large bypass it (tokio's
/// `BufReader` hands them to the stream directly), so tract-sized data
/// still lands in its aligned buffer without a copy.
pub(crate) const READ_BUFFER: usize = 64 << 10;

/// A frame as read off the wire: header checked, meta CRC checked.
#[derive(Debug)]
pub struct Frame {
    pub header: FrameHeader,
    pub meta: Bytes,
    pub data: Bytes,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadFrameError {
    #[error("connection closed")]
    Closed,
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The header is unusable: the stream can no longer be framed.
    #[error("{0}")]
    BadHeader(FrameError),
    /// The header was fine but the meta part failed its CRC; the stream is
    /// still framed, so only this request fails.
    #[error("request {request_id}: {error}")]
    BadMeta { request_id: u64, opcode: u16, error: FrameError },
}

/// Reads the header of the next frame. `Closed` on a clean end of stream.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<FrameHeader, ReadFrameError> {
    let mut hdr = [0u8; HEADER_LEN];
    match r.read_exact(&mut hdr).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadFrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    FrameHeader::decode(&hdr).map_err(ReadFrameError::BadHeader)
}

/// Reads the meta and data parts announced by `header` (lengths already
/// bounded by `FrameHeader::decode`).
pub async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    header: FrameHeader,
) -> Result<Frame, ReadFrameError> {
    let meta = read_exact_bytes(r, header.meta_len as usize).await?;
    let data = read_exact_bytes(r, header.data_len as usize).await?;
    if let Err(error) = header.check_meta(&meta) {
        return Err(ReadFrameError::BadMeta { request_id: header.request_id, opcode: header.opcode, error });
    }
    Ok(Frame { header, meta, data })
}

/// Reads one whole frame.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Frame, ReadFrameError> {
    let header = read_header(r).await?;
    read_body(r, header).await
}

async fn read_exact_bytes<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<Bytes, ReadFrameError> {
    if n == 0 {
        return Ok(Bytes::new());
    }
    // Read into spare capacity (no zeroing of up to a whole tract first) of
    // a buffer aligned for direct I/O, so tract data can go to the disk
    // without another copy.
    let mut buf = blizzard_env::aligned_buffer(n);
    while buf.len() < n {
        let want = n - buf.len();
        let mut limited = (&mut *r).take(want as u64);
        if limited.read_buf(&mut buf).await? == 0 {
            return Err(ReadFrameError::Closed);
        }
    }
    Ok(buf.freeze())
}

/// Writes one frame (without flushing: callers batch small frames).
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    header: &FrameHeader,
    meta: &[u8],
    data: &[u8],
) -> std::io::Result<()> {
    w.write_all(&header.encode()).await?;
    w.write_all(meta).await?;
    if !data.is_empty() {
        w.write_all(data).await?;
    }
    Ok(())
}

/// A frame queued for a connection's writer task. Its data part is `data`
/// followed by each of `more` (pieces that live in separate buffers, sent
/// as they are rather than joined first).
pub(crate) struct Outgoing {
    pub header: FrameHeader,
    pub meta: Bytes,
    pub data: Bytes,
    pub more: Vec<Bytes>,
}

/// Writes queued frames until the queue closes or the stream fails.
/// Flushes only when the queue is empty, so bursts of small frames share
/// one system call while a lone frame goes out at once.
pub(crate) async fn write_queued<W: AsyncWrite + Unpin>(wr: W, mut rx: mpsc::Receiver<Outgoing>) {
    let mut w = BufWriter::with_capacity(64 << 10, wr);
    while let Some(out) = rx.recv().await {
        if write_frame(&mut w, &out.header, &out.meta, &out.data).await.is_err() {
            return;
        }
        for piece in &out.more {
            if w.write_all(piece).await.is_err() {
                return;
            }
        }
        if rx.is_empty() && w.flush().await.is_err() {
            return;
        }
    }
    let _ = w.flush().await;
    let _ = w.shutdown().await;
}
