//! Handing sockets to another process: what an NBD server's online upgrade
//! needs from the operating system (`blizzard_nbd::upgrade` holds the
//! protocol). Real OS only: a descriptor cannot cross a simulated link, so
//! none of this goes through [`crate::Net`]; the simulator never calls it.
//!
//! - [`HandoverListener`] / [`HandoverConn`]: a unix socket of type
//!   `SOCK_SEQPACKET` whose messages carry descriptors (`SCM_RIGHTS`). A
//!   seqpacket socket, not a stream: each message arrives whole, with
//!   exactly the descriptors sent with it, so no framing has to guess
//!   which bytes the kernel attached them to. A message longer than the
//!   receiver allows, or with more descriptors than
//!   [`HANDOVER_FDS_MAX`], is refused (and its descriptors closed).
//! - Who may connect: whoever connects can take every client's disk, so
//!   the socket file is made mode 0600 and both ends refuse a peer running
//!   as another user (`SO_PEERCRED`).
//! - [`stream_fd`] and [`Listener::fd`](crate::Listener::fd) find the
//!   socket under a stream or a listener the real net made;
//!   [`adopt_stream`] and [`adopt_listener`] turn a received descriptor
//!   back into one, TCP or unix as the socket itself says.

// This module is the real side of the seam, like `real.rs`.
#![allow(clippy::disallowed_methods)]

use std::any::Any;
use std::fs::Permissions;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::real::{RealTcpListener, RealUnixListener};
use crate::{BoxStream, Listener, Stream};

/// Descriptors one hand-over message carries at most.
pub const HANDOVER_FDS_MAX: usize = 4;

/// Connections the kernel queues on a hand-over socket before refusing.
const BACKLOG: i32 = 4;

fn other(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Refuses a peer that runs as another user than this process.
fn check_peer(fd: &OwnedFd) -> io::Result<u32> {
    let cred = rustix::net::sockopt::socket_peercred(fd)?;
    let mine = rustix::process::getuid();
    if cred.uid != mine {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "hand-over peer (pid {}) runs as uid {}, not this process's uid {}",
                cred.pid.as_raw_nonzero(),
                cred.uid.as_raw(),
                mine.as_raw()
            ),
        ));
    }
    Ok(cred.pid.as_raw_nonzero().get() as u32)
}

/// `fd` under the tokio reactor. `AsyncFd::new` is deprecated because a
/// type could report a different raw descriptor later; an `OwnedFd`
/// cannot, so it is sound here, and its replacement (`register`) is
/// `unsafe`, which this workspace forbids.
#[allow(deprecated)]
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::new(fd)
}

/// The socket file's identity, to remove only our own file.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// A hand-over socket a server listens on for its successor. Dropping it
/// removes its socket file, unless another socket has replaced the file
/// since (a successor bound the same path).
pub struct HandoverListener {
    fd: AsyncFd<OwnedFd>,
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl HandoverListener {
    /// Binds a seqpacket socket at `path` (replacing a stale file there),
    /// mode 0600. Must run inside a tokio runtime.
    pub fn bind(path: &Path) -> io::Result<HandoverListener> {
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
            None,
        )?;
        let addr = SocketAddrUnix::new(path)?;
        // A file left by a process that died: bind would fail on it.
        let _ = std::fs::remove_file(path);
        rustix::net::bind(&fd, &addr)?;
        std::fs::set_permissions(path, Permissions::from_mode(0o600))?;
        rustix::net::listen(&fd, BACKLOG)?;
        Ok(HandoverListener { fd: register(fd)?, id: file_id(path), path: path.to_path_buf() })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next peer, with its process id. A peer of another user is
    /// refused with `PermissionDenied` (it is disconnected; call again).
    pub async fn accept(&self) -> io::Result<(HandoverConn, u32)> {
        let fd = self
            .fd
            .async_io(Interest::READABLE, |l| {
                Ok(rustix::net::accept_with(l, SocketFlags::CLOEXEC | SocketFlags::NONBLOCK)?)
            })
            .await?;
        let pid = check_peer(&fd)?;
        Ok((HandoverConn { fd: register(fd)? }, pid))
    }
}

impl Drop for HandoverListener {
    fn drop(&mut self) {
        if self.id.is_some() && file_id(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// One end of a hand-over connection: whole messages, each with up to
/// [`HANDOVER_FDS_MAX`] descriptors.
pub struct HandoverConn {
    fd: AsyncFd<OwnedFd>,
}

impl HandoverConn {
    /// Connects to the hand-over socket at `path`; refuses a listener
    /// running as another user. Returns the peer's process id too.
    pub fn connect(path: &Path) -> io::Result<(HandoverConn, u32)> {
        let fd =
            rustix::net::socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
        // Blocking connect: a unix socket connects at once or fails (a full
        // backlog would wait, and the backlog is a handful of successors).
        rustix::net::connect(&fd, &SocketAddrUnix::new(path)?)?;
        rustix::io::ioctl_fionbio(&fd, true)?;
        let pid = check_peer(&fd)?;
        Ok((HandoverConn { fd: register(fd)? }, pid))
    }

    /// Sends `msg` with `fds` as one message. The peer gets its own copies
    /// of the descriptors; ours stay open.
    pub async fn send(&self, msg: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if fds.len() > HANDOVER_FDS_MAX {
            return Err(other(format!(
                "{} descriptors in one message; at most {HANDOVER_FDS_MAX}",
                fds.len()
            )));
        }
        let sent = self
            .fd
            .async_io(Interest::WRITABLE, |s| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HANDOVER_FDS_MAX))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                    return Err(other("descriptors do not fit the control buffer".into()));
                }
                Ok(rustix::net::sendmsg(s, &[IoSlice::new(msg)], &mut control, SendFlags::NOSIGNAL)?)
            })
            .await?;
        if sent != msg.len() {
            // A seqpacket send is all or nothing; this would be a kernel
            // surprise, and the peer would refuse the piece anyway.
            return Err(other(format!("sent {sent} of a {}-byte hand-over message", msg.len())));
        }
        Ok(())
    }

    /// The next message, at most `max` bytes, and the descriptors that came
    /// with it (close-on-exec). A longer message, or one with more than
    /// [`HANDOVER_FDS_MAX`] descriptors, is an error (its descriptors are
    /// closed); the peer hanging up is `UnexpectedEof`.
    pub async fn recv(&self, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
        let mut buf = vec![0u8; max];
        let (n, fds) = self
            .fd
            .async_io(Interest::READABLE, |s| {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(HANDOVER_FDS_MAX))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let r = rustix::net::recvmsg(
                    s,
                    &mut [IoSliceMut::new(&mut buf)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )?;
                // Taken before any check, so an error below closes them.
                let mut fds: Vec<OwnedFd> = Vec::new();
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = m {
                        fds.extend(received);
                    }
                }
                if r.flags.contains(ReturnFlags::TRUNC) {
                    return Err(other(format!("a hand-over message longer than {max} bytes")));
                }
                if r.flags.contains(ReturnFlags::CTRUNC) {
                    return Err(other(format!(
                        "a hand-over message with more than {HANDOVER_FDS_MAX} descriptors"
                    )));
                }
                Ok((r.bytes, fds))
            })
            .await?;
        if n == 0 && fds.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the other process closed the hand-over socket",
            ));
        }
        buf.truncate(n);
        Ok((buf, fds))
    }
}

/// The OS socket under a stream the real net made (TCP or unix); `None`
/// for anything else (an in-process pipe, a simulated link).
pub fn stream_fd(s: &dyn Stream) -> Option<BorrowedFd<'_>> {
    let any: &dyn Any = s;
    if let Some(t) = any.downcast_ref::<TcpStream>() {
        return Some(t.as_fd());
    }
    any.downcast_ref::<UnixStream>().map(|u| u.as_fd())
}

/// A connected stream socket received from another process, as the real
/// net's stream, with its peer's address. Must run inside a tokio runtime.
pub fn adopt_stream(fd: OwnedFd) -> io::Result<(BoxStream, String)> {
    if rustix::net::sockopt::socket_type(&fd)? != SocketType::STREAM {
        return Err(other("an adopted connection is not a stream socket".into()));
    }
    match rustix::net::sockopt::socket_domain(&fd)? {
        AddressFamily::INET | AddressFamily::INET6 => {
            let s = std::net::TcpStream::from(fd);
            s.set_nonblocking(true)?;
            let peer = s.peer_addr()?.to_string();
            let s = TcpStream::from_std(s)?;
            s.set_nodelay(true)?;
            Ok((Box::new(s) as BoxStream, peer))
        }
        AddressFamily::UNIX => {
            let s = std::os::unix::net::UnixStream::from(fd);
            s.set_nonblocking(true)?;
            let local = s.local_addr()?;
            // As the real unix listener names its peers: by its own path.
            let peer = match local.as_pathname() {
                Some(p) => format!("unix:{}", p.display()),
                None => "unix:(unnamed)".to_string(),
            };
            Ok((Box::new(UnixStream::from_std(s)?) as BoxStream, peer))
        }
        f => Err(other(format!("an adopted connection of address family {}", f.as_raw()))),
    }
}

/// A listening stream socket received from another process, as the real
/// net's listener. Must run inside a tokio runtime.
pub fn adopt_listener(fd: OwnedFd) -> io::Result<Box<dyn Listener>> {
    if rustix::net::sockopt::socket_type(&fd)? != SocketType::STREAM
        || !rustix::net::sockopt::socket_acceptconn(&fd)?
    {
        return Err(other("an adopted listener is not a listening stream socket".into()));
    }
    match rustix::net::sockopt::socket_domain(&fd)? {
        AddressFamily::INET | AddressFamily::INET6 => {
            let l = std::net::TcpListener::from(fd);
            l.set_nonblocking(true)?;
            let local = l.local_addr()?.to_string();
            Ok(Box::new(RealTcpListener { l: TcpListener::from_std(l)?, local }))
        }
        AddressFamily::UNIX => {
            let l = std::os::unix::net::UnixListener::from(fd);
            l.set_nonblocking(true)?;
            let path = l
                .local_addr()?
                .as_pathname()
                .map(|p| p.display().to_string())
                .ok_or_else(|| other("an adopted unix listener without a path".into()))?;
            Ok(Box::new(RealUnixListener { l: UnixListener::from_std(l)?, path }))
        }
        f => Err(other(format!("an adopted listener of address family {}", f.as_raw()))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A listener and a connection cross a hand-over socket and work on the
    /// other side: the adopted listener accepts, the adopted stream carries
    /// bytes the sender wrote before the hand-over.
    #[tokio::test]
    async fn sockets_cross_and_work() {
        let dir = tempfile::tempdir().unwrap();
        let hp = dir.path().join("h.sock");
        let h = HandoverListener::bind(&hp).unwrap();
        let mode = std::fs::metadata(&hp).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (client, pid) = HandoverConn::connect(&hp).unwrap();
        assert_eq!(pid, std::process::id());
        let (server, _) = h.accept().await.unwrap();

        let net = crate::RealNet;
        let l = crate::Net::bind(&net, "127.0.0.1:0").await.unwrap();
        let addr = l.local_addr();
        let mut peer = crate::Net::connect(&net, &addr).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        peer.write_all(b"early").await.unwrap();

        let fds = [l.fd().unwrap(), stream_fd(&*s).unwrap()];
        server.send(b"hello", &fds).await.unwrap();
        drop((s, l));
        let (msg, mut got) = client.recv(64).await.unwrap();
        assert_eq!((&msg[..], got.len()), (&b"hello"[..], 2));
        let (mut s, _) = adopt_stream(got.pop().unwrap()).unwrap();
        let l = adopt_listener(got.pop().unwrap()).unwrap();
        assert_eq!(l.local_addr(), addr);
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"early");
        let _again = crate::Net::connect(&net, &addr).await.unwrap();
        l.accept().await.unwrap();

        // Too long, too many, and the peer gone: errors, not panics.
        server.send(&[7u8; 100], &[]).await.unwrap();
        assert!(client.recv(10).await.is_err());
        assert!(server.send(b"x", &[s_fd(&s); HANDOVER_FDS_MAX + 1]).await.is_err());
        drop(server);
        assert_eq!(client.recv(10).await.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        drop(h);
        assert!(!hp.exists());
    }

    fn s_fd(s: &BoxStream) -> BorrowedFd<'_> {
        stream_fd(&**s).unwrap()
    }

    /// Only stream sockets of the real net are found or adopted.
    #[tokio::test]
    async fn wrong_descriptors_are_refused() {
        let (a, _b) = tokio::io::duplex(64);
        let pipe: BoxStream = Box::new(a);
        assert!(stream_fd(&*pipe).is_none());
        let dir = tempfile::tempdir().unwrap();
        let h = HandoverListener::bind(&dir.path().join("h.sock")).unwrap();
        let seqpacket = h.fd.get_ref().try_clone().unwrap();
        assert!(adopt_stream(seqpacket.try_clone().unwrap()).is_err());
        assert!(adopt_listener(seqpacket).is_err());
        let net = crate::RealNet;
        let l = crate::Net::bind(&net, "127.0.0.1:0").await.unwrap();
        let not_listening = crate::Net::connect(&net, &l.local_addr()).await.unwrap();
        assert!(adopt_listener(stream_fd(&*not_listening).unwrap().try_clone_to_owned().unwrap()).is_err());
    }
}
