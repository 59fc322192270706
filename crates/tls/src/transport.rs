//! What a TLS session reads its socket through.
//!
//! rustls asks its transport for at most 4 KiB at a time (its deframer's
//! read size), so with the socket right below it a 1 MiB transfer costs
//! 256 `read` system calls; a [`TRANSPORT_READ_BUFFER`] below it makes
//! that 8, for one more copy of each byte within user space.
//!
//! That buffer is only worth having once the session carries data: during
//! the handshake it would be 128 KiB held for every peer that connects and
//! sends nothing (issue 56: a connection that has not finished its
//! handshake must cost a little memory). So a [`Transport`] starts
//! unbuffered, and [`Transport::buffer`] gives it the buffer once the
//! handshake is done. It may also start with bytes already read from the
//! socket (`with_prefix`: the first byte a listener waited for before it
//! spent anything on the connection).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes a TLS session's transport reads from the socket at once, once
/// the session is up (module header).
pub const TRANSPORT_READ_BUFFER: usize = 128 << 10;

/// A stream below a TLS session: reads buffered once [`Transport::buffer`]
/// was called, writes passed straight through (rustls hands over whole
/// records).
pub struct Transport<S> {
    inner: S,
    /// Read but not yet handed on: `buf[pos..filled]`.
    buf: Box<[u8]>,
    pos: usize,
    filled: usize,
}

impl<S> Transport<S> {
    /// Unbuffered, with nothing read ahead.
    pub fn new(inner: S) -> Transport<S> {
        Transport::with_prefix(inner, &[])
    }

    /// Unbuffered, handing on `prefix` (already read from `inner`) first.
    pub fn with_prefix(inner: S, prefix: &[u8]) -> Transport<S> {
        Transport { inner, buf: prefix.into(), pos: 0, filled: prefix.len() }
    }

    /// Reads `cap` bytes of the socket at a time from now on.
    pub fn buffer(&mut self, cap: usize) {
        if self.buf.len() >= cap {
            return;
        }
        let mut buf = vec![0u8; cap].into_boxed_slice();
        let left = self.filled - self.pos;
        buf[..left].copy_from_slice(&self.buf[self.pos..self.filled]);
        self.buf = buf;
        self.pos = 0;
        self.filled = left;
    }

    /// Bytes read ahead and not yet handed on.
    pub fn buffered(&self) -> usize {
        self.filled - self.pos
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Transport<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        dst: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos == this.filled {
            // Nothing ahead: a read as large as the buffer (or with no
            // buffer) goes straight to the caller.
            if dst.remaining() >= this.buf.len() {
                return Pin::new(&mut this.inner).poll_read(cx, dst);
            }
            let mut rb = ReadBuf::new(&mut this.buf);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            this.pos = 0;
            this.filled = rb.filled().len();
        }
        let n = (this.filled - this.pos).min(dst.remaining());
        dst.put_slice(&this.buf[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Transport<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Every byte arrives once and in order, whatever the read sizes, the
    /// prefix, and when the buffer is added.
    #[tokio::test]
    async fn bytes_pass_in_order_buffered_or_not() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for (prefix_len, buffer_after, read_size) in
            [(0, 0, 4096), (1, 10, 4096), (3, 5000, 100), (0, 150_000, 1 << 20), (1, 0, 1)]
        {
            let (a, mut b) = tokio::io::duplex(1 << 16);
            let d = data.clone();
            let writer = tokio::spawn(async move {
                b.write_all(&d[prefix_len..]).await.unwrap();
            });
            let mut t = Transport::with_prefix(a, &data[..prefix_len]);
            let mut got = Vec::new();
            let mut chunk = vec![0u8; read_size];
            while got.len() < data.len() {
                if got.len() >= buffer_after {
                    t.buffer(TRANSPORT_READ_BUFFER);
                }
                let n = t.read(&mut chunk).await.unwrap();
                assert!(n > 0);
                got.extend_from_slice(&chunk[..n]);
            }
            writer.await.unwrap();
            assert!(got == data, "prefix {prefix_len}, buffered after {buffer_after}, reads of {read_size}");
            assert_eq!(t.buffered(), 0);
        }
    }
}
