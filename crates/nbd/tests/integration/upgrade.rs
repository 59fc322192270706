//! Online upgrade between two servers in one process: the successor takes
//! over a connection whose client has pipelined requests past the point
//! where the old server parked it.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use blizzard_nbd::proto::*;
use blizzard_nbd::{ClientExports, NbdConfig, Server};
use blizzard_volume::{CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 8 << 20;
const WRITES: u64 = 100;
const LEN: u32 = 4096;

/// The client sends 100 writes in one burst to a server that runs one
/// request at a time, so when the hand-over starts the old server's read
/// buffer holds requests it has not begun (some cut mid-payload) and the
/// rest wait in the socket. Every write is answered exactly once, without
/// error, across the hand-over; the old server releases everything; the
/// successor reads every block back on the same connection and serves a
/// new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_cross_the_hand_over() -> R {
    let vols = [spec("v", SIZE, CommitMode::WriteThrough, FlushPolicy::Durable)];
    let cfg = NbdConfig { requests_in_flight_max: 1, ..NbdConfig::default() };
    let mut fx = start(&vols, cfg).await;
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("old.upgrade");
    fx.server.listen_for_upgrades(&socket)?;

    let mut c = Nbd::connect(&fx.addr, "v", FULL).await;
    let mut cookies = BTreeSet::new();
    for i in 0..WRITES {
        let off = i * LEN as u64;
        cookies.insert(c.send(NBD_CMD_WRITE, 0, off, LEN, &pattern(off, LEN as usize, 1)).await);
    }
    c.flush_socket().await;
    // The first reply: the old server is busy with the burst.
    let (first, r) = c.recv().await;
    assert_eq!(r.errno, 0, "{}", r.message);
    assert!(cookies.remove(&first));

    let exports = ClientExports::new(fx.env.clone(), fx.client.clone());
    let succ = tokio::spawn({
        let (env, socket) = (fx.env.clone(), socket.clone());
        async move { Server::upgrade_from(env, exports, &socket, NbdConfig::default()).await }
    });
    while !cookies.is_empty() {
        let (got, r) = c.recv().await;
        assert_eq!(r.errno, 0, "write {got}: {}", r.message);
        assert!(cookies.remove(&got), "reply {got} twice or unasked");
    }
    let handed = fx.env.timeout(Duration::from_secs(60), fx.server.handed_over()).await;
    assert!(handed.is_ok(), "the old server never handed over");
    let next = succ.await??;
    assert_eq!(next.local_addr(), fx.addr);
    assert!(!socket.exists(), "the old server's hand-over socket is gone with it");

    for i in 0..WRITES {
        let off = i * LEN as u64;
        assert!(c.read(off, LEN).await == pattern(off, LEN as usize, 1), "block at {off}");
    }
    let mut again = Nbd::connect(&fx.addr, "v", SIMPLE).await;
    assert!(again.read(0, LEN).await == pattern(0, LEN as usize, 1));
    again.disconnect().await;
    c.disconnect().await;
    next.shutdown().await?;
    fx.stop().await;
    Ok(())
}
