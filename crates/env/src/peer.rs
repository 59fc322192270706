//! Who is at the other end of a stream, when a net proved it.
//!
//! A net that authenticates its connections (`blizzard_tls::TlsNet`: mutual
//! TLS with the cluster's CA) hands out [`Authenticated`] streams carrying
//! the peer's verified [`Peer`]; servers find it with [`peer_of`] (by
//! downcast, as [`crate::stream_fd`] finds a socket) and check the role
//! before a request changes anything. Every other stream has no peer: an
//! in-process pipe, a simulated link, or a plain socket of a cluster run
//! without certificates (which the operator chose with `--insecure`, or
//! runs on loopback only).

use std::any::Any;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::{BoxStream, Stream};

/// A peer as its certificate names it: the holder's name (subject common
/// name), its role in the cluster (`tractserver`, `meta`, `nbd`, `admin`,
/// `client`; empty if the certificate names none) and the certificate's
/// serial number (lower-case hex: what a revocation names).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Peer {
    pub name: String,
    pub role: String,
    pub serial: String,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let role = if self.role.is_empty() { "no role" } else { &self.role };
        write!(f, "{:?} ({role})", self.name)
    }
}

/// A stream whose peer a net authenticated.
pub struct Authenticated {
    stream: BoxStream,
    peer: Arc<Peer>,
}

impl Authenticated {
    pub fn new(stream: BoxStream, peer: Peer) -> Authenticated {
        Authenticated { stream, peer: Arc::new(peer) }
    }
}

/// The verified peer of `s`, if a net authenticated it.
pub fn peer_of(s: &dyn Stream) -> Option<Arc<Peer>> {
    let any: &dyn Any = s;
    any.downcast_ref::<Authenticated>().map(|a| a.peer.clone())
}

impl AsyncRead for Authenticated {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Authenticated {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Certificates a server refuses, by serial number (they only grow), and
/// a signal when the set grows: every connection whose peer it names
/// ends (the blob store's `serve_conn`, the NBD server's transmission).
#[derive(Default)]
pub struct Revocations {
    serials: std::sync::Mutex<Arc<std::collections::BTreeSet<String>>>,
    changed: tokio::sync::Notify,
}

impl Revocations {
    pub fn is_revoked(&self, serial: &str) -> bool {
        !serial.is_empty() && crate::lock(&self.serials).contains(serial)
    }

    /// Adds `serials` to the set.
    pub fn adopt<'a>(&self, serials: impl IntoIterator<Item = &'a String>) {
        let mut cur = crate::lock(&self.serials);
        let new: Vec<&String> = serials.into_iter().filter(|s| !cur.contains(*s)).collect();
        if new.is_empty() {
            return;
        }
        let mut next = (**cur).clone();
        next.extend(new.into_iter().cloned());
        *cur = Arc::new(next);
        drop(cur);
        self.changed.notify_waiters();
    }

    /// Resolves once the certificate `serial` is revoked.
    pub async fn until_revoked(&self, serial: &str) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.is_revoked(serial) {
                return;
            }
            changed.await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_wrapped_stream_carries_its_peer_and_its_bytes() {
        let (a, mut b) = tokio::io::duplex(64);
        let peer = Peer { name: "ts1".into(), role: "tractserver".into(), serial: "01".into() };
        let mut s: BoxStream = Box::new(Authenticated::new(Box::new(a), peer.clone()));
        assert_eq!(peer_of(&*s).as_deref(), Some(&peer));
        s.write_all(b"hi").await.unwrap();
        let mut got = [0u8; 2];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hi");
        let (plain, _) = tokio::io::duplex(64);
        let plain: BoxStream = Box::new(plain);
        assert_eq!(peer_of(&*plain), None, "a stream no net authenticated has no peer");
    }

    #[tokio::test]
    async fn a_revocation_wakes_the_connections_of_its_certificate_only() {
        let r = Arc::new(Revocations::default());
        let watch = |serial: &'static str| {
            let r = r.clone();
            tokio::spawn(async move { r.until_revoked(serial).await })
        };
        let (a, b) = (watch("0a"), watch("0b"));
        tokio::task::yield_now().await;
        r.adopt(&["0a".to_string()]);
        a.await.unwrap();
        tokio::task::yield_now().await;
        assert!(!b.is_finished());
        assert!(r.is_revoked("0a") && !r.is_revoked("0b") && !r.is_revoked(""));
        b.abort();
    }
}
