//! CAN_MULTI_CONN: every connection to an export shares one volume, so a
//! FLUSH on one connection covers writes completed on another, and
//! shutdown makes everything acknowledged durable.

#![allow(clippy::unwrap_used)]

use crate::common;

use blizzard_nbd::proto::*;
use blizzard_nbd::NbdConfig;
use blizzard_volume::{manage, CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 8 << 20;

/// Writes on A (acknowledged from memory in fast-ack mode), FLUSH on B:
/// B reads A's data at once, and after the flush a separate volume
/// instance reading the blob directly sees it too (it is durable).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_on_one_connection_covers_another() -> R {
    let vols = [spec("shared", SIZE, CommitMode::FastAck, FlushPolicy::Durable)];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut a = Nbd::connect(&fx.addr, "shared", FULL).await;
    let mut b = Nbd::connect(&fx.addr, "shared", SIMPLE).await;
    assert_ne!(a.flags & NBD_FLAG_CAN_MULTI_CONN, 0);
    let n = 64u64;
    for i in 0..n {
        let off = i * 65536 + 100;
        a.send(NBD_CMD_WRITE, 0, off, 5000, &pattern(off, 5000, 1)).await;
    }
    a.flush_socket().await;
    for _ in 0..n {
        assert_eq!(a.recv().await.1.errno, 0);
    }
    b.flush().await;
    for i in 0..n {
        let off = i * 65536 + 100;
        assert_eq!(b.read(off, 5000).await, pattern(off, 5000, 1), "B reads A's write at {off}");
    }
    // Read-only: a second writer would claim the volume and fence the
    // server's instance (one writer per volume).
    let other = manage::open_read_only(&fx.client, "shared").await?;
    for i in 0..n {
        let off = i * 65536 + 100;
        assert!(other.read(off, 5000).await?[..] == pattern(off, 5000, 1)[..], "durable at {off}");
    }
    drop(other);
    a.disconnect().await;
    b.disconnect().await;
    fx.stop().await;
    Ok(())
}

/// Writes acknowledged but never flushed are durable after
/// `Server::shutdown`, for every commit mode that acknowledges early.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_flushes_every_open_volume() -> R {
    let vols = [
        spec("fa", SIZE, CommitMode::FastAck, FlushPolicy::Ordered),
        spec("log", SIZE, CommitMode::Log, FlushPolicy::Ordered),
    ];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut conns = Vec::new();
    for v in &vols {
        let mut c = Nbd::connect(&fx.addr, &v.name, FULL).await;
        for i in 0..32u64 {
            let off = i * 70_000;
            c.write(off, &pattern(off, 6000, 2)).await;
        }
        conns.push(c);
    }
    // Shut down with the clients still connected: they are closed after
    // their (no) in-flight requests, then the volumes are flushed.
    let Fixture { server, cluster, client, env, .. } = fx;
    server.shutdown().await?;
    for c in &mut conns {
        assert!(c.closed().await);
    }
    for v in &vols {
        let vol = manage::open(env.clone(), &client, &v.name).await?;
        for i in 0..32u64 {
            let off = i * 70_000;
            assert!(vol.read(off, 6000).await?[..] == pattern(off, 6000, 2)[..], "{} at {off}", v.name);
        }
        vol.close().await?;
    }
    cluster.stop().await;
    Ok(())
}
