//! Integration tests of the blob store on real TCP sockets and real files:
//! a metadata server and 8 tractservers in this process, several clients.

#![allow(clippy::unwrap_used)]
// These tests drive real sockets and damage real files on purpose, from
// outside the servers' env.
#![allow(clippy::disallowed_methods)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use blizzard_client::{Client, ClientError};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::{BlobId, TractNo};
use blizzard_env::Env;
use blizzard_proto::{ErrorCode, FrameHeader, FrameKind, Opcode, Reply, Request, HEADER_LEN};

const TRACT: u32 = 64 << 10;

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

async fn cluster(dir: &tempfile::TempDir, n: usize, replication: u8, disk_size: u64) -> Cluster {
    init_tracing();
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = n;
    cfg.replication = replication;
    cfg.tract_size = TRACT;
    cfg.disk_size = disk_size;
    cfg.heartbeat_interval = Duration::from_millis(50);
    Cluster::start(Env::real(), cfg).await.unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut r = rand::rngs::SmallRng::seed_from_u64(seed);
    (0..len).map(|_| r.random()).collect()
}

/// One client's workload: blobs with random range writes, a model of every
/// byte, then a full byte-exact read-back.
async fn workload(client: Client, seed: u64, blobs: usize, tracts: u64, writes: usize, replication: u8) -> R {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut model: HashMap<(usize, u64), Vec<u8>> = HashMap::new();
    let mut handles = Vec::new();
    for _ in 0..blobs {
        let b = client.create_blob(None, replication).await?;
        assert_eq!(b.extend_by(tracts).await?, tracts);
        handles.push(b);
    }
    // Writes run concurrently, but never two to the same tract at once, so
    // the model knows the final content.
    let mut batch = Vec::new();
    let mut busy = std::collections::HashSet::new();
    for w in 0..writes {
        let bi = rng.random_range(0..blobs);
        let t = rng.random_range(0..tracts);
        if !busy.insert((bi, t)) {
            for h in batch.drain(..) {
                h.await??;
            }
            busy.clear();
            busy.insert((bi, t));
        }
        let off = if rng.random_bool(0.3) { 0 } else { rng.random_range(0..TRACT - 1) };
        let len = if off == 0 && rng.random_bool(0.3) {
            TRACT
        } else {
            rng.random_range(1..=(TRACT - off).min(20000))
        };
        let data = pattern(seed * 1_000_000 + w as u64, len as usize);
        let m = model.entry((bi, t)).or_insert_with(|| vec![0u8; TRACT as usize]);
        m[off as usize..(off + len) as usize].copy_from_slice(&data);
        let b = handles[bi].clone();
        batch.push(tokio::spawn(async move { b.write(t, off, Bytes::from(data)).await }));
        if batch.len() == 16 || w + 1 == writes {
            for h in batch.drain(..) {
                h.await??;
            }
            busy.clear();
        }
    }
    for ((bi, t), m) in &model {
        let got = handles[*bi].read(*t, 0, TRACT).await?;
        assert!(got[..] == m[..], "blob {bi} tract {t} differs");
        let part = handles[*bi].read(*t, 1000, 5000).await?;
        assert!(part[..] == m[1000..6000]);
    }
    // Tracts never written read as zeros.
    for (bi, b) in handles.iter().enumerate() {
        for t in 0..tracts {
            if !model.contains_key(&(bi, t)) {
                assert!(b.read(t, 0, TRACT).await?.iter().all(|&x| x == 0));
            }
        }
    }
    Ok(())
}

async fn concurrent_clients(replication: u8) -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 8, replication, 48 << 20).await;
    let mut tasks = Vec::new();
    for i in 0..4u64 {
        let client = c.client().await?;
        tasks.push(tokio::spawn(workload(client, i + 1, 6, 8, 120, replication)));
    }
    for t in tasks {
        t.await??;
    }
    c.stop().await;
    Ok(())
}

/// Four clients write and read many blobs concurrently over 8 tractservers,
/// 1-way, and every byte reads back exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_1way() -> R {
    concurrent_clients(1).await
}

/// The same with 3-way replication: every write reaches all three replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_3way() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 8, 3, 48 << 20).await;
    let mut tasks = Vec::new();
    for i in 0..4u64 {
        let client = c.client().await?;
        tasks.push(tokio::spawn(workload(client, 100 + i, 6, 8, 120, 3)));
    }
    for t in tasks {
        t.await??;
    }
    // Each replica holds the same bytes: read each tract from every member.
    let client = c.client().await?;
    let b = client.create_blob(None, 3).await?;
    b.extend_to(4).await?;
    for t in 0..4 {
        b.write(t, 0, Bytes::from(pattern(t, TRACT as usize))).await?;
    }
    let tlt = client.tlt();
    for t in 0..4u64 {
        let row = &tlt.rows[tlt.locate(b.id(), TractNo(t as i64))];
        assert_eq!(row.members.len(), 3);
        for &m in &row.members {
            let id = tlt.members[m as usize].id;
            let holder =
                (0..c.tractserver_count()).filter_map(|i| c.tractserver(i)).find(|h| h.id == id).unwrap();
            let (data, _) =
                holder.service.store.read(b.id(), b.incarnation(), TractNo(t as i64), 0, TRACT).await?;
            assert!(data[..] == pattern(t, TRACT as usize)[..], "replica {id} of tract {t} differs");
        }
    }
    c.stop().await;
    Ok(())
}

/// Blob metadata: create, open, atomic concurrent extends, delete, and a
/// recreated blob with the same id shows nothing of the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blob_lifecycle_and_concurrent_extend() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 8, 3, 32 << 20).await;
    let client = c.client().await?;
    let id = BlobId(0x1234);
    let b = client.create_blob(Some(id), 2).await?;
    assert!(matches!(client.create_blob(Some(id), 2).await, Err(ClientError::BlobExists(_))));
    assert!(matches!(client.create_blob(None, 4).await, Err(ClientError::Invalid(_))));
    assert!(matches!(b.write(0, 0, Bytes::from_static(b"x")).await, Err(ClientError::PastEnd { .. })));
    // 16 concurrent atomic appends of 1..=16 tracts: each caller gets a
    // distinct range, and the ranges tile the blob.
    let mut tasks = Vec::new();
    for n in 1..=16u64 {
        let b = b.clone();
        tasks.push(tokio::spawn(async move { b.extend_by(n).await.map(|end| (end - n, end)) }));
    }
    let mut ranges = Vec::new();
    for t in tasks {
        ranges.push(t.await??);
    }
    ranges.sort();
    let mut at = 0;
    for (s, e) in ranges {
        assert_eq!(s, at);
        at = e;
    }
    assert_eq!(at, 136);
    let other = c.client().await?;
    let ob = other.open_blob(id).await?;
    assert_eq!(ob.size_tracts(), 136);
    assert_eq!(ob.replication(), 2);
    ob.write(135, 7, Bytes::from_static(b"hello")).await?;
    assert_eq!(&b.read(135, 7, 5).await?[..], b"hello");
    client.delete_blob(id).await?;
    assert!(matches!(other.open_blob(id).await, Err(ClientError::NoSuchBlob(_))));
    let again = client.create_blob(Some(id), 1).await?;
    again.extend_to(136).await?;
    assert!(again.read(135, 0, 100).await?.iter().all(|&x| x == 0));
    c.stop().await;
    Ok(())
}

/// A request carrying an old TLT row version is rejected, and the client
/// fetches the new table and completes the operation by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_tlt_is_rejected_and_client_recovers() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 8, 3, 32 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 3).await?;
    b.extend_to(4).await?;
    b.write(0, 0, Bytes::from(pattern(1, 1000))).await?;
    let before = client.tlt();
    // Bump the versions of the rows holding tract 0 and the metadata tract.
    let meta = c.meta().unwrap().server.clone();
    let rows = [before.locate(b.id(), TractNo(0)), before.locate(b.id(), TractNo::META)];
    let changes: Vec<_> = rows
        .iter()
        .map(|&r| (r, before.rows[r].members.iter().map(|&m| before.members[m as usize].id).collect()))
        .collect();
    meta.reassign_rows(&changes).await?;
    let stale_before = client.stats().stale_rejections.load(std::sync::atomic::Ordering::Relaxed);
    // The client still holds the old table: its first attempt is refused.
    b.write(0, 0, Bytes::from(pattern(2, 1000))).await?;
    assert_eq!(&b.read(0, 0, 1000).await?[..], &pattern(2, 1000)[..]);
    assert_eq!(b.extend_by(1).await?, 5);
    let after = client.tlt();
    assert!(after.version > before.version);
    // Numbered above anything an earlier metadata server lifetime used.
    assert!(after.rows[rows[0]].version > before.rows[rows[0]].version);
    assert!(client.stats().stale_rejections.load(std::sync::atomic::Ordering::Relaxed) > stale_before);
    c.stop().await;
    Ok(())
}

/// A tractserver stopped and started again on its intact disk (on a new
/// port) serves all its tracts again; clients find it by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_tractserver_serves_its_tracts() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir, 8, 1, 32 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 1).await?;
    b.extend_to(32).await?;
    for t in 0..32 {
        b.write(t, 0, Bytes::from(pattern(t, TRACT as usize))).await?;
    }
    for i in [2, 5] {
        let old = c.tractserver(i).unwrap().addr.clone();
        c.stop_tractserver(i).await;
        c.start_tractserver(i).await?;
        assert_ne!(c.tractserver(i).unwrap().addr, old);
    }
    c.wait_ready(Duration::from_secs(10)).await?;
    for t in 0..32 {
        assert!(b.read(t, 0, TRACT).await?[..] == pattern(t, TRACT as usize)[..], "tract {t}");
    }
    // And a restart of the metadata server: clients keep going on their
    // cached table, and new clients get the rebuilt one.
    c.restart_meta().await?;
    for t in 0..32 {
        assert!(b.read(t, 0, 100).await?[..] == pattern(t, 100)[..]);
    }
    c.wait_ready(Duration::from_secs(10)).await?;
    let fresh = c.client().await?;
    assert_eq!(fresh.tlt().rows, client.tlt().rows);
    let fb = fresh.open_blob(b.id()).await?;
    assert!(fb.read(31, 0, TRACT).await?[..] == pattern(31, TRACT as usize)[..]);
    c.stop().await;
    Ok(())
}

/// Cached writes: readable at once, durable after a sync of their
/// receipts; a sync fails (so the caller writes again) when a tractserver
/// named in the receipt restarted or reported another boot id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_writes_sync_and_a_restart_fails_the_sync() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir, 4, 2, 32 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 2).await?;
    b.extend_to(8).await?;
    let mut receipt = Vec::new();
    for t in 0..8 {
        let r = b.write_cached(t, 4096, Bytes::from(pattern(t, 8192))).await?;
        assert_eq!(r.len(), 2, "one entry per replica");
        receipt.extend(r);
    }
    for t in 0..8 {
        assert!(b.read(t, 4096, 8192).await?[..] == pattern(t, 8192)[..], "tract {t} before the sync");
    }
    let syncs_before: u64 = (0..4).map(|i| c.tractserver(i).map_or(0, |t| t.service.store.syncs())).sum();
    b.sync(receipt.clone()).await?;
    let syncs_after: u64 = (0..4).map(|i| c.tractserver(i).map_or(0, |t| t.service.store.syncs())).sum();
    assert!(syncs_after > syncs_before, "the sync reached the disks");

    // Another boot id for a server in the receipt: it restarted in between.
    let mut forged = receipt.clone();
    forged[0].1 ^= 1;
    let err = b.sync(forged).await.expect_err("a changed boot id must fail the sync");
    assert!(matches!(err, blizzard_client::ClientError::Restarted { .. }), "{err}");

    // A real restart (on a new port): the old receipt can no longer sync.
    let victim = receipt[0].0.clone();
    let i = (0..4).find(|&i| c.tractserver(i).is_some_and(|t| t.addr == victim)).ok_or("victim not found")?;
    c.stop_tractserver(i).await;
    c.start_tractserver(i).await?;
    c.wait_ready(Duration::from_secs(10)).await?;
    assert!(b.sync(receipt).await.is_err(), "a restarted server cannot vouch for cached writes");
    // Written again, durably this time, everything reads back.
    for t in 0..8 {
        b.write(t, 4096, Bytes::from(pattern(t, 8192))).await?;
        assert!(b.read(t, 4096, 8192).await?[..] == pattern(t, 8192)[..], "tract {t} after the restart");
    }
    c.stop().await;
    Ok(())
}

/// The whole embedded cluster stopped and started again on its data
/// directory: the TLT is rebuilt from the disks and every blob is intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_cluster_survives_a_full_restart() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 4, 2, 32 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 2).await?;
    b.extend_to(12).await?;
    for t in 0..12 {
        b.write(t, 100, Bytes::from(pattern(t + 50, 30000))).await?;
    }
    let (id, rows) = (b.id(), client.tlt().rows.clone());
    drop((b, client));
    c.stop().await;

    let c = cluster(&dir, 4, 2, 32 << 20).await;
    let client = c.client().await?;
    assert_eq!(client.tlt().rows, rows, "the rebuilt TLT differs from the one stored on the disks");
    let b = client.open_blob(id).await?;
    assert_eq!(b.size_tracts(), 12);
    for t in 0..12 {
        assert!(b.read(t, 100, 30000).await?[..] == pattern(t + 50, 30000)[..]);
        assert!(b.read(t, 0, 100).await?.iter().all(|&x| x == 0));
    }
    c.stop().await;
    Ok(())
}

fn flip_byte(path: &std::path::Path, at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at)?;
    f.write_all_at(&[b[0] ^ 0x20], at)?;
    f.sync_all()
}

/// A byte flipped on disk under a running tractserver is caught by its CRC
/// and the read is served from another replica, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_byte_is_caught_and_served_from_another_replica() -> R {
    let dir = tempfile::tempdir()?;
    // Slow heartbeats: the test reads the damaged replicas' own disks at the
    // end, so no tractserver may be declared dead (and its rows handed to
    // others) when a loaded CI machine stalls one for half a second.
    init_tracing();
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 8;
    cfg.replication = 3;
    cfg.tract_size = TRACT;
    cfg.disk_size = 32 << 20;
    cfg.heartbeat_interval = Duration::from_secs(1);
    let c = Cluster::start(Env::real(), cfg).await?;
    let client = c.client().await?;
    let b = client.create_blob(None, 3).await?;
    b.extend_to(1).await?;
    let data = pattern(77, TRACT as usize);
    b.write(0, 0, Bytes::from(data.clone())).await?;
    let tlt = client.tlt();
    let row = &tlt.rows[tlt.locate(b.id(), TractNo(0))];
    // Damage two of the three replicas, in different chunks.
    let mut damaged = Vec::new();
    for (k, &m) in row.members.iter().take(2).enumerate() {
        let id = tlt.members[m as usize].id;
        let i = (0..c.tractserver_count()).find(|&i| c.tractserver(i).unwrap().id == id).unwrap();
        let h = c.tractserver(i).unwrap();
        let at = h.service.store.data_location(b.id(), TractNo(0)).unwrap() + 5000 + 9000 * k as u64;
        flip_byte(&c.disk_path(i), at)?;
        damaged.push(i);
    }
    for _ in 0..20 {
        assert!(b.read(0, 0, TRACT).await?[..] == data[..]);
    }
    let caught: u64 = damaged
        .iter()
        .map(|&i| {
            c.tractserver(i)
                .unwrap()
                .service
                .store
                .stats
                .corrupt_reads
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert!(caught > 0, "no damaged replica was ever asked");
    assert!(client.stats().read_fallbacks.load(std::sync::atomic::Ordering::Relaxed) > 0);
    // A partial write into each damaged chunk: it must merge with bytes
    // the damaged replica cannot read, so that replica heals the chunk from
    // another one first (without that the write failed with `Corrupt`, and
    // once the others held it no replica had the bytes the damaged chunk's
    // entry expects: the scrubber could not repair it either).
    let mut want = data.clone();
    for (k, at) in [(0usize, 5000usize), (1, 14000)] {
        let piece = pattern(90 + k as u64, 300);
        let retries = client.stats().retries.load(std::sync::atomic::Ordering::Relaxed);
        b.write(0, at as u32 - 100, Bytes::from(piece.clone())).await?;
        // On the first try: the two damaged replicas each heal from the
        // other without asking each other in a loop (`heal::Heals`;
        // without it each write took two 10 s request timeouts).
        assert_eq!(client.stats().retries.load(std::sync::atomic::Ordering::Relaxed), retries);
        want[at - 100..at + 200].copy_from_slice(&piece);
    }
    for i in damaged {
        let h = c.tractserver(i).unwrap();
        let (got, _) = h.service.store.read(b.id(), b.incarnation(), TractNo(0), 0, TRACT).await?;
        assert!(got[..] == want[..], "tractserver {i} does not hold the writes into its damaged chunks");
    }
    c.stop().await;
    Ok(())
}

/// A full disk gives a clear DiskFull error, and every write acknowledged
/// before it reads back intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_disk_is_a_clear_error_and_loses_nothing() -> R {
    let dir = tempfile::tempdir()?;
    // 4 MiB disks hold only a few dozen 64 KiB tracts each.
    let c = cluster(&dir, 8, 1, 4 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 1).await?;
    b.extend_to(10_000).await?;
    let mut acked = Vec::new();
    let mut full = None;
    for t in 0..10_000u64 {
        match b.write(t, 0, Bytes::from(pattern(t, 4096))).await {
            Ok(()) => acked.push(t),
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    let e = full.expect("the disks never filled");
    assert!(matches!(e, ClientError::DiskFull { .. }), "{e}");
    assert!(e.to_string().contains("full"), "{e}");
    assert!(acked.len() > 8);
    for t in &acked {
        assert!(b.read(*t, 0, 4096).await?[..] == pattern(*t, 4096)[..]);
    }
    // Overwriting an existing tract needs no new space and still works.
    b.write(acked[0], 0, Bytes::from_static(b"still writable")).await?;
    c.stop().await;
    Ok(())
}

async fn raw_request(
    s: &mut tokio::net::TcpStream,
    id: u64,
    opcode: u16,
    meta: &[u8],
    data: &[u8],
) -> std::io::Result<()> {
    let h = FrameHeader {
        kind: FrameKind::Request,
        opcode,
        request_id: id,
        meta_len: meta.len() as u32,
        data_len: data.len() as u32,
        meta_crc: blizzard_core::crc::crc32c(meta),
    };
    s.write_all(&h.encode()).await?;
    s.write_all(meta).await?;
    s.write_all(data).await
}

/// Reads one reply frame: (request id, status error code if any).
async fn raw_reply(s: &mut tokio::net::TcpStream) -> std::io::Result<Option<(u64, Option<ErrorCode>)>> {
    let mut h = [0u8; HEADER_LEN];
    match tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut h)).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return Ok(None),
        Err(_) => return Err(std::io::Error::other("no reply")),
    }
    let h = FrameHeader::decode(&h).map_err(std::io::Error::other)?;
    let mut meta = vec![0u8; h.meta_len as usize];
    s.read_exact(&mut meta).await?;
    let mut data = vec![0u8; h.data_len as usize];
    s.read_exact(&mut data).await?;
    let op = Opcode::from_u16(h.opcode).unwrap_or(Opcode::Ping);
    let code = match blizzard_proto::decode_response(op, &meta).map_err(std::io::Error::other)? {
        Ok(_) => None,
        Err(e) => Some(e.code),
    };
    Ok(Some((h.request_id, code)))
}

async fn expect_closed(s: &mut tokio::net::TcpStream) {
    let mut b = [0u8; 1];
    let r = tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "connection was not closed: {r:?}");
}

/// Malformed frames (bad magic, huge lengths, truncated payloads, unknown
/// opcodes, garbage bodies) get an error or a closed connection, while the
/// server keeps serving a well-behaved client throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_are_rejected_and_others_keep_working() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 8, 1, 32 << 20).await;
    let client = c.client().await?;
    let b = client.create_blob(None, 1).await?;
    b.extend_to(8).await?;
    let good = Arc::new(b);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let bg = {
        let (b, stop) = (good.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = n % 8;
                b.write(t, 0, Bytes::from(pattern(n, 8192))).await?;
                assert!(b.read(t, 0, 8192).await?[..] == pattern(n, 8192)[..]);
                n += 1;
            }
            Ok::<u64, ClientError>(n)
        })
    };
    let addr = c.tractserver(0).unwrap().addr.clone();
    let connect = || tokio::net::TcpStream::connect(addr.clone());

    // Bad magic: one BadFrame reply, then the connection closes.
    let mut s = connect().await?;
    s.write_all(&[0xde; HEADER_LEN]).await?;
    assert_eq!(raw_reply(&mut s).await?.map(|r| r.1), Some(Some(ErrorCode::BadFrame)));
    expect_closed(&mut s).await;

    // A header claiming a 4 GiB payload: refused before any allocation.
    let mut s = connect().await?;
    let mut h = FrameHeader {
        kind: FrameKind::Request,
        opcode: Opcode::WriteTract as u16,
        request_id: 1,
        meta_len: 10,
        data_len: u32::MAX,
        meta_crc: 0,
    }
    .encode();
    s.write_all(&h).await?;
    assert_eq!(raw_reply(&mut s).await?.map(|r| r.1), Some(Some(ErrorCode::BadFrame)));
    expect_closed(&mut s).await;

    // A corrupted header CRC.
    let mut s = connect().await?;
    h[9] ^= 1;
    s.write_all(&h).await?;
    assert_eq!(raw_reply(&mut s).await?.map(|r| r.1), Some(Some(ErrorCode::BadFrame)));
    expect_closed(&mut s).await;

    // Truncated payload: the header promises 1000 bytes, 10 arrive, then EOF.
    let mut s = connect().await?;
    let h = FrameHeader {
        kind: FrameKind::Request,
        opcode: Opcode::Ping as u16,
        request_id: 2,
        meta_len: 1000,
        data_len: 0,
        meta_crc: 0,
    };
    s.write_all(&h.encode()).await?;
    s.write_all(&[0u8; 10]).await?;
    s.shutdown().await?;
    expect_closed(&mut s).await;

    // On one connection: unknown opcode, garbage body, bad meta CRC, a
    // write whose data fails its CRC; each gets its error and the
    // connection stays usable.
    let mut s = connect().await?;
    raw_request(&mut s, 10, 0x7777, b"", b"").await?;
    assert_eq!(raw_reply(&mut s).await?, Some((10, Some(ErrorCode::UnknownOpcode))));
    raw_request(&mut s, 11, Opcode::ReadTract as u16, b"garbage", b"").await?;
    assert_eq!(raw_reply(&mut s).await?, Some((11, Some(ErrorCode::BadRequest))));
    let meta = Request::Ping.encode();
    let bad = FrameHeader {
        kind: FrameKind::Request,
        opcode: Opcode::GetBlob as u16,
        request_id: 12,
        meta_len: 4,
        data_len: 0,
        meta_crc: 1,
    };
    s.write_all(&bad.encode()).await?;
    s.write_all(&[1, 2, 3, 4]).await?;
    assert_eq!(raw_reply(&mut s).await?, Some((12, Some(ErrorCode::BadFrame))));
    let tlt = client.tlt();
    let row = &tlt.rows[tlt.locate(good.id(), TractNo(0))];
    let w = Request::WriteTract {
        addr: blizzard_proto::TractAddr {
            blob: good.id(),
            incarnation: good.incarnation(),
            tract: TractNo(0),
            row_version: row.version,
            writer: 0,
        },
        offset: 0,
        crcs: vec![12345],
    };
    raw_request(&mut s, 13, Opcode::WriteTract as u16, &w.encode(), b"data that does not match").await?;
    let r = raw_reply(&mut s).await?;
    assert!(matches!(r, Some((13, Some(ErrorCode::BadCrc | ErrorCode::NotOwner)))), "{r:?}");
    raw_request(&mut s, 14, Opcode::Ping as u16, &meta, b"").await?;
    assert_eq!(raw_reply(&mut s).await?, Some((14, None)));

    // A client that vanishes mid-request.
    let mut s = connect().await?;
    let h = FrameHeader {
        kind: FrameKind::Request,
        opcode: Opcode::WriteTract as u16,
        request_id: 3,
        meta_len: 50,
        data_len: 60000,
        meta_crc: 0,
    };
    s.write_all(&h.encode()).await?;
    s.write_all(&[0u8; 30000]).await?;
    drop(s);

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = bg.await??;
    assert!(n > 0);
    // The server is still healthy.
    let pinged = blizzard_rpc::RpcConn::connect(&Env::real(), &addr).await?;
    let (r, _) = pinged.call(&Request::Ping, Bytes::new()).await?;
    assert_eq!(r, Reply::Done);
    c.stop().await;
    Ok(())
}

/// A client that reconnects (a new `Hello` epoch) fences its older
/// connections: a write arriving late on one of them, as a request the
/// client gave up on and retried can, is refused and never replaces what
/// the client wrote since. Other sessions, and connections without a
/// `Hello`, are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_from_a_replaced_connection_is_not_applied() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 1, 1, 64 << 20).await;
    let client = c.client().await?;
    let blob = client.create_blob(None, 1).await?;
    blob.extend_to(1).await?;
    let tlt = client.tlt();
    let row = &tlt.rows[tlt.locate(blob.id(), TractNo(0))];
    let ts = tlt.members[row.members[0] as usize].addr.clone();
    let write = |fill: u8| {
        let data = Bytes::from(vec![fill; 4096]);
        let req = Request::WriteTract {
            addr: blizzard_proto::TractAddr {
                blob: blob.id(),
                incarnation: blob.incarnation(),
                tract: TractNo(0),
                row_version: row.version,
                writer: 0,
            },
            offset: 0,
            crcs: vec![blizzard_core::crc::crc32c(&data)],
        };
        (req, data)
    };
    let env = Env::real();
    let conn = |epoch: Option<u64>| {
        let (env, ts) = (env.clone(), ts.clone());
        async move {
            let c = blizzard_rpc::RpcConn::connect(&env, &ts).await?;
            if let Some(epoch) = epoch {
                c.call(&Request::Hello { session: 77, epoch }, Bytes::new()).await?;
            }
            Ok::<_, blizzard_rpc::RpcError>(c)
        }
    };
    let old = conn(Some(1)).await?;
    let (req, data) = write(1);
    old.call(&req, data).await?;
    // The client reconnects at epoch 2 and writes again.
    let new = conn(Some(2)).await?;
    let (req, data) = write(2);
    new.call(&req, data).await?;
    // The old connection's late write is refused ...
    let (req, data) = write(3);
    let e = old.call(&req, data).await.err().and_then(|e| e.remote().map(|r| r.code));
    assert_eq!(e, Some(ErrorCode::Aborted));
    // ... and so is one arriving on a fresh connection under the old epoch.
    let ghost = conn(Some(1)).await?;
    let (req, data) = write(4);
    let e = ghost.call(&req, data).await.err().and_then(|e| e.remote().map(|r| r.code));
    assert_eq!(e, Some(ErrorCode::Aborted));
    assert_eq!(&blob.read(0, 0, 4096).await?[..], &[2u8; 4096][..]);
    // Another session, and a connection without a session, still write.
    let other = blizzard_rpc::RpcConn::connect(&env, &ts).await?;
    other.call(&Request::Hello { session: 78, epoch: 1 }, Bytes::new()).await?;
    let (req, data) = write(5);
    other.call(&req, data).await?;
    let plain = conn(None).await?;
    let (req, data) = write(6);
    plain.call(&req, data).await?;
    assert_eq!(&blob.read(0, 0, 4096).await?[..], &[6u8; 4096][..]);
    c.stop().await;
    Ok(())
}

/// A new disk file is zero-filled in the background: its tractserver's
/// metrics show the bytes left, which reach 0, and writes made while the
/// fill runs read back afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_disks_zero_fill_shows_in_metrics() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, 2, 1, 256 << 20).await;
    let gauge = |i: usize| {
        c.tractserver(i).map(|t| t.service.metrics_text()).and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("blizzard_disk_zero_fill_bytes_left "))
                .and_then(|v| v.parse::<f64>().ok())
        })
    };
    assert!(gauge(0).is_some(), "the metrics name the zero-fill");
    let client = c.client().await?;
    let b = client.create_blob(None, 1).await?;
    b.extend_to(4).await?;
    for t in 0..4 {
        b.write(t, 0, Bytes::from(pattern(t, TRACT as usize))).await?;
    }
    c.wait_disks_prepared(Duration::from_secs(120)).await?;
    for i in 0..2 {
        assert_eq!(gauge(i), Some(0.0), "tractserver {i} still reports bytes left");
    }
    for t in 0..4 {
        assert!(b.read(t, 0, TRACT).await?[..] == pattern(t, TRACT as usize)[..], "tract {t}");
    }
    Ok(())
}
