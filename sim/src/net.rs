//! The simulated network: turmoil TCP behind the `Net` trait.
//!
//! Addresses are `host:port` with turmoil host names (`"ts1:7000"`), so the
//! addresses servers register with the metadata server and put in the TLT
//! are the names the harness gave the hosts, stable across restarts and
//! replays. Links have seeded latency; the harness partitions, holds and
//! releases them through turmoil, and crashing a host breaks its
//! connections.
//!
//! A [`SimNet`] belongs to one host: turmoil binds listeners to the host the
//! calling task runs on, and [`Listener::local_addr`] answers with this
//! host's name so that other hosts can dial it.
//!
//! With [`Links`] attached ([`SimNet::with_links`]) every stream this host
//! opens or accepts is bandwidth-limited: its writes take their turn on
//! this host's egress and the peer's ingress (`link`).
//!
//! Not simulated: unix sockets (`unix:` addresses are refused with
//! `Unsupported`; the NBD front end is tested against the real env).

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use blizzard_env::{BoxStream, Listener, Net};
use futures::future::BoxFuture;
use futures::FutureExt;
use turmoil::net::{TcpListener, TcpStream};

use crate::ghost::{GhostStream, Ghosts};
use crate::link::Links;
use crate::SimError;

/// The simulated network as seen from host `host`.
#[derive(Clone)]
pub struct SimNet {
    host: Arc<str>,
    /// Late duplicates of this host's client connections, if injected.
    ghosts: Option<Ghosts>,
    /// Bandwidth-limited links, if modelled.
    links: Option<Links>,
}

impl SimNet {
    /// The network of the turmoil host named `host`; its listeners must be
    /// bound from tasks running on that host.
    pub fn new(host: &str) -> SimNet {
        SimNet { host: host.into(), ghosts: None, links: None }
    }

    /// The same, with late duplicates of its client connections' requests
    /// (see `ghost`).
    pub fn with_ghosts(host: &str, ghosts: Ghosts) -> SimNet {
        SimNet { host: host.into(), ghosts: Some(ghosts), links: None }
    }

    /// This network with its streams limited by `links` (`link`).
    pub fn with_links(mut self, links: Links) -> SimNet {
        self.links = Some(links);
        self
    }

    pub fn host(&self) -> &str {
        &self.host
    }
}

fn check_simulated(addr: &str) -> Result<(), SimError> {
    if addr.starts_with("unix:") {
        return Err(SimError::Unsupported(addr.to_string(), "unix sockets are not simulated"));
    }
    if !turmoil::in_simulation() {
        return Err(SimError::NotInSimulation);
    }
    Ok(())
}

/// Splits `host:port` (IPv6 hosts in brackets) into its parts.
fn split_host_port(addr: &str) -> Result<(&str, u16), SimError> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| SimError::BadAddr(addr.to_string()))?;
    let port = port.parse().map_err(|_| SimError::BadAddr(addr.to_string()))?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    Ok((host, port))
}

/// What a bind address asks for, given this host's name.
enum BindTo {
    /// Reachable from every host; peers dial `<host name>:<port>`.
    Host,
    /// Reachable only from this host.
    Loopback,
}

fn bind_target(addr: &str, me: &str) -> Result<(BindTo, u16), SimError> {
    let (host, port) = split_host_port(addr)?;
    if host.is_empty() || host == me {
        return Ok((BindTo::Host, port));
    }
    if host == "localhost" {
        return Ok((BindTo::Loopback, port));
    }
    match host.parse::<IpAddr>() {
        Ok(ip) if ip.is_unspecified() => Ok((BindTo::Host, port)),
        Ok(ip) if ip.is_loopback() => Ok((BindTo::Loopback, port)),
        // This host's own IP is the same as its name.
        Ok(ip) if ip == turmoil::lookup(me) => Ok((BindTo::Host, port)),
        _ => Err(SimError::Unsupported(addr.to_string(), "a host can bind only its own address")),
    }
}

impl Net for SimNet {
    fn connect(&self, addr: &str) -> BoxFuture<'static, io::Result<BoxStream>> {
        let addr = addr.to_string();
        let ghosts = self.ghosts.clone();
        let links = self.links.clone();
        let host = self.host.clone();
        async move {
            check_simulated(&addr)?;
            let s = TcpStream::connect(addr.as_str()).await?;
            s.set_nodelay(true)?;
            let peer = split_host_port(&addr)?.0.to_string();
            let stream = match ghosts {
                Some(g) => Box::new(GhostStream::new(s, addr, g, host.clone())) as BoxStream,
                None => Box::new(s) as BoxStream,
            };
            Ok(match links {
                Some(l) => l.shape(stream, &host, &peer),
                None => stream,
            })
        }
        .boxed()
    }

    fn bind(&self, addr: &str) -> BoxFuture<'static, io::Result<Box<dyn Listener>>> {
        let addr = addr.to_string();
        let me = self.host.clone();
        let links = self.links.clone();
        async move {
            check_simulated(&addr)?;
            let (to, port) = bind_target(&addr, &me)?;
            // turmoil accepts only unspecified or loopback binds, of the
            // simulation's IP version (it panics on a mismatch).
            let v4 = turmoil::lookup(&*me).is_ipv4();
            let ip: IpAddr = match (to, v4) {
                (BindTo::Host, true) => Ipv4Addr::UNSPECIFIED.into(),
                (BindTo::Host, false) => Ipv6Addr::UNSPECIFIED.into(),
                (BindTo::Loopback, true) => Ipv4Addr::LOCALHOST.into(),
                (BindTo::Loopback, false) => Ipv6Addr::LOCALHOST.into(),
            };
            let l = TcpListener::bind(SocketAddr::new(ip, port)).await?;
            let bound = l.local_addr()?;
            let local = if ip.is_loopback() { bound.to_string() } else { format!("{me}:{}", bound.port()) };
            tracing::trace!(host = %me, %local, "sim bind");
            Ok(Box::new(SimListener { l, local, host: me, links }) as Box<dyn Listener>)
        }
        .boxed()
    }
}

struct SimListener {
    l: TcpListener,
    local: String,
    host: Arc<str>,
    links: Option<Links>,
}

impl Listener for SimListener {
    fn accept(&self) -> BoxFuture<'_, io::Result<(BoxStream, String)>> {
        async move {
            let (s, peer) = self.l.accept().await?;
            s.set_nodelay(true)?;
            // Name the peer as the harness named it, as a log would want.
            let name = turmoil::reverse_lookup(peer.ip());
            let stream = match &self.links {
                Some(l) => l.shape(Box::new(s), &self.host, name.as_deref().unwrap_or(&*self.host)),
                None => Box::new(s) as BoxStream,
            };
            let peer = match name {
                Some(name) => format!("{name}:{}", peer.port()),
                None => peer.to_string(),
            };
            Ok((stream, peer))
        }
        .boxed()
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Bind addresses map to this host, loopback, or a refusal.
    #[test]
    fn bind_targets() {
        let ok = |a: &str| bind_target(a, "ts1").map(|(t, p)| (matches!(t, BindTo::Host), p)).ok();
        assert_eq!(ok("0.0.0.0:7000"), Some((true, 7000)));
        assert_eq!(ok("[::]:7000"), Some((true, 7000)));
        assert_eq!(ok("ts1:0"), Some((true, 0)));
        assert_eq!(ok("127.0.0.1:1"), Some((false, 1)));
        assert_eq!(ok("localhost:1"), Some((false, 1)));
        assert_eq!(ok("ts1"), None);
        assert_eq!(ok("ts1:x"), None);
    }

    // Outside a simulation, and for unix sockets, the network refuses.
    #[test]
    fn refuses_outside_simulation_and_unix() {
        let net = SimNet::new("ts1");
        let e = futures::executor::block_on(net.connect("unix:/tmp/nbd")).err().map(|e| e.kind());
        assert_eq!(e, Some(io::ErrorKind::Unsupported));
        let e = futures::executor::block_on(net.connect("ts2:7000")).err().map(|e| e.kind());
        assert_eq!(e, Some(io::ErrorKind::Other));
        let e = futures::executor::block_on(net.bind("unix:/tmp/nbd")).err().map(|e| e.kind());
        assert_eq!(e, Some(io::ErrorKind::Unsupported));
    }
}
