//! Connections between servers that share one process.
//!
//! `blizzard up` runs the metadata server, every tractserver, the blob
//! client and the NBD server in one process. Through sockets, each request
//! from the client to a tractserver and each reply cost a send, a receive
//! and a trip through epoll on both sides: at queue depth 1 that measured
//! ≈ 40 µs of a 4 KiB write's ≈ 340 µs (and 3 of its 13 system calls per
//! write were `epoll_wait`).
//!
//! [`LocalNet`] wraps another [`Net`]. A listener it binds is bound on the
//! inner net as usual (other processes still reach it at its address) and
//! is also entered in this `LocalNet`'s table under its address; a connect
//! to an address in the table gets an in-memory pipe (`tokio::io::duplex`)
//! to that listener instead of a socket. The bytes on the pipe are the same
//! frames as on a socket: only the carrier changes, so every check of the
//! protocol (framing, bounds, CRCs, session fences) still runs.
//!
//! What a pipe cannot do that a socket can: outlive the process (nothing
//! here needs to), and fail on its own (a peer that goes away closes it,
//! as a socket's peer would).
//!
//! A server may also attach an [`Endpoint`] to its listener's entry
//! (`Net::attach_endpoint`): `blizzard_rpc` attaches its service there, and
//! a caller of the same process then hands it requests as values, with no
//! frames and no copies (`blizzard_rpc::local`). The entry, endpoint and
//! all, goes when the listener is dropped.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::io::DuplexStream;
use tokio::sync::mpsc;

use crate::{BoxStream, Endpoint, Listener, Net};

/// Bytes a pipe buffers each way before the writer waits: room for a few
/// large writes, as a socket's buffer has.
const PIPE_BUFFER: usize = 1 << 20;

/// A listener's entry: where its pipes go, and what its server attached.
struct Entry {
    pipes: mpsc::UnboundedSender<DuplexStream>,
    endpoint: Option<Endpoint>,
}

type Table = Arc<Mutex<HashMap<String, Entry>>>;

fn lock(t: &Table) -> MutexGuard<'_, HashMap<String, Entry>> {
    match t.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A [`Net`] whose connections between its own listeners and dialers are
/// in-memory pipes; everything else goes to the wrapped net.
pub struct LocalNet {
    inner: Arc<dyn Net>,
    listeners: Table,
}

impl LocalNet {
    pub fn new(inner: Arc<dyn Net>) -> LocalNet {
        LocalNet { inner, listeners: Arc::new(Mutex::new(HashMap::new())) }
    }
}

impl Net for LocalNet {
    fn connect(&self, addr: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let local = lock(&self.listeners).get(addr).map(|e| e.pipes.clone());
        if let Some(tx) = local {
            let (mine, theirs) = tokio::io::duplex(PIPE_BUFFER);
            // A listener dropped since the lookup: dial the inner net, which
            // reports what a socket would (refused, or someone else there).
            if tx.send(theirs).is_ok() {
                return futures::future::ready(Ok(Box::new(mine) as BoxStream)).boxed();
            }
        }
        self.inner.connect(addr)
    }

    fn bind(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        let bound = self.inner.bind(addr);
        let table = self.listeners.clone();
        async move {
            let inner = bound.await?;
            let addr = inner.local_addr();
            let (tx, rx) = mpsc::unbounded_channel();
            lock(&table).insert(addr.clone(), Entry { pipes: tx.clone(), endpoint: None });
            Ok(Box::new(LocalListener { inner, pipes: tokio::sync::Mutex::new(rx), tx, addr, table })
                as Box<dyn Listener>)
        }
        .boxed()
    }

    fn bind_plain(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        self.inner.bind_plain(addr)
    }

    fn attach_endpoint(&self, addr: &str, endpoint: Endpoint) -> bool {
        match lock(&self.listeners).get_mut(addr) {
            Some(e) => {
                e.endpoint = Some(endpoint);
                true
            }
            None => false,
        }
    }

    fn endpoint(&self, addr: &str) -> Option<Endpoint> {
        lock(&self.listeners).get(addr).and_then(|e| e.endpoint.clone())
    }
}

struct LocalListener {
    inner: Box<dyn Listener>,
    pipes: tokio::sync::Mutex<mpsc::UnboundedReceiver<DuplexStream>>,
    /// Our entry in the table, to tell it from a later listener's.
    tx: mpsc::UnboundedSender<DuplexStream>,
    addr: String,
    table: Table,
}

impl Listener for LocalListener {
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        async move {
            let mut pipes = self.pipes.lock().await;
            // Both are cancel-safe: the one that loses the race keeps its
            // connection queued for the next accept.
            tokio::select! {
                biased;
                Some(p) = pipes.recv() => Ok((Box::new(p) as BoxStream, "in-process".to_string())),
                r = self.inner.accept() => r,
            }
        }
        .boxed()
    }

    fn local_addr(&self) -> String {
        self.addr.clone()
    }

    /// The socket other processes dial; a pipe of this process cannot be
    /// handed to another, and [`crate::stream_fd`] finds no socket under one.
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.inner.fd()
    }
}

impl Drop for LocalListener {
    fn drop(&mut self) {
        // Only our own entry: a later listener may have taken the address.
        let mut t = lock(&self.table);
        if t.get(&self.addr).is_some_and(|e| e.pipes.same_channel(&self.tx)) {
            t.remove(&self.addr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RealNet;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_once(l: &dyn Listener) -> io::Result<String> {
        let (mut s, peer) = l.accept().await?;
        let mut b = [0u8; 5];
        s.read_exact(&mut b).await?;
        s.write_all(&b).await?;
        Ok(peer)
    }

    async fn ping(mut s: BoxStream) -> io::Result<[u8; 5]> {
        s.write_all(b"hello").await?;
        let mut b = [0u8; 5];
        s.read_exact(&mut b).await?;
        Ok(b)
    }

    /// A dialer of the same `LocalNet` gets a pipe, another process (here: a
    /// plain `RealNet`) still gets the socket, and once the listener is gone
    /// a connect is refused as it would be without the pipe.
    #[tokio::test]
    async fn own_listeners_are_reached_by_pipe_others_by_socket() -> io::Result<()> {
        let net = LocalNet::new(Arc::new(RealNet));
        let l = net.bind("127.0.0.1:0").await?;
        let addr = l.local_addr();

        let (peer, got) = tokio::join!(echo_once(&*l), async { ping(net.connect(&addr).await?).await });
        assert_eq!((peer?.as_str(), &got?), ("in-process", b"hello"));

        let (peer, got) = tokio::join!(echo_once(&*l), async { ping(RealNet.connect(&addr).await?).await });
        assert_ne!(peer?, "in-process", "a socket connection");
        assert_eq!(&got?, b"hello");

        // An endpoint lives as long as its listener.
        assert!(net.endpoint(&addr).is_none());
        assert!(net.attach_endpoint(&addr, Arc::new(7u32)));
        assert_eq!(net.endpoint(&addr).and_then(|e| e.downcast::<u32>().ok()).as_deref(), Some(&7));
        assert!(!net.attach_endpoint("127.0.0.1:1", Arc::new(7u32)), "no listener there");

        drop(l);
        assert!(net.connect(&addr).await.is_err(), "nobody listens there any more");
        assert!(net.endpoint(&addr).is_none(), "the endpoint went with its listener");
        Ok(())
    }
}
