//! Reconciling a tract's replicas and fencing older writers, on real
//! sockets and files: a metadata server and 4 tractservers, 3-way
//! replication.

#![allow(clippy::unwrap_used)]
// These tests talk to single tractservers directly, from outside the
// servers' env, to make replicas differ on purpose.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;

use blizzard_client::{Blob, Client, ClientError};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::crc::piece_crcs;
use blizzard_core::TractNo;
use blizzard_env::{Disk, DiskModel, Disks, Env};
use blizzard_proto::{Reply, Request, TractAddr};

const TRACT: u32 = 64 << 10;
const CHUNK: u32 = 4096;

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

async fn cluster(dir: &tempfile::TempDir, io_delay: Duration) -> Cluster {
    cluster_on(dir, io_delay, Env::real(), false).await
}

/// A cluster whose servers reach their disks through `env`; with
/// `unix_sockets`, a tractserver keeps its address across a restart.
async fn cluster_on(dir: &tempfile::TempDir, io_delay: Duration, env: Env, unix_sockets: bool) -> Cluster {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 4;
    cfg.replication = 3;
    cfg.tract_size = TRACT;
    cfg.disk_size = 32 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    cfg.disk_model = (!io_delay.is_zero()).then(|| DiskModel::new(io_delay, 0, 0));
    cfg.unix_sockets = unix_sockets;
    Cluster::start(env, cfg).await.unwrap()
}

/// Disks that can lose power: every write not yet covered by a sync is
/// remembered (with the bytes it replaced), and a disk marked with
/// [`LossyDisks::lose_power`] is opened next with all of them undone, as
/// a power loss that kept none of them would leave it.
#[derive(Clone, Default)]
struct LossyDisks {
    logs: Arc<Mutex<BTreeMap<PathBuf, Arc<Mutex<PowerLog>>>>>,
}

#[derive(Default)]
struct PowerLog {
    /// (offset, bytes before) of each write not yet synced, oldest first.
    unsynced: Vec<(u64, Bytes)>,
    lost_power: bool,
}

impl LossyDisks {
    fn log(&self, path: &Path) -> Arc<Mutex<PowerLog>> {
        self.logs.lock().unwrap().entry(path.to_path_buf()).or_default().clone()
    }

    /// Writes to the disk at `path` not yet made durable.
    fn unsynced(&self, path: &Path) -> usize {
        self.log(path).lock().unwrap().unsynced.len()
    }

    /// The disk at `path` (its server stopped) loses every write not yet
    /// synced.
    fn lose_power(&self, path: &Path) {
        self.log(path).lock().unwrap().lost_power = true;
    }
}

impl Disks for LossyDisks {
    fn open(
        &self,
        path: &Path,
        create_len: Option<u64>,
    ) -> BoxFuture<'static, std::io::Result<Arc<dyn Disk>>> {
        let log = self.log(path);
        let open = Env::real().disks.open(path, create_len);
        Box::pin(async move {
            let inner = open.await?;
            let undo = {
                let mut l = log.lock().unwrap();
                if std::mem::take(&mut l.lost_power) {
                    std::mem::take(&mut l.unsynced)
                } else {
                    Vec::new()
                }
            };
            for (at, before) in undo.into_iter().rev() {
                inner.write_at(vec![(at, before)]).await?;
            }
            inner.sync().await?;
            Ok(Arc::new(LossyDisk { inner, log }) as Arc<dyn Disk>)
        })
    }
}

struct LossyDisk {
    inner: Arc<dyn Disk>,
    log: Arc<Mutex<PowerLog>>,
}

impl Disk for LossyDisk {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read_at(&self, offset: u64, len: usize) -> BoxFuture<'static, std::io::Result<Bytes>> {
        self.inner.read_at(offset, len)
    }
    fn write_at(&self, writes: Vec<(u64, Bytes)>) -> BoxFuture<'static, std::io::Result<()>> {
        let (inner, log) = (self.inner.clone(), self.log.clone());
        Box::pin(async move {
            for (at, data) in &writes {
                let before = inner.read_at(*at, data.len()).await?;
                log.lock().unwrap().unsynced.push((*at, before));
            }
            inner.write_at(writes).await
        })
    }
    fn sync(&self) -> BoxFuture<'static, std::io::Result<()>> {
        let (inner, log) = (self.inner.clone(), self.log.clone());
        Box::pin(async move {
            let covered = log.lock().unwrap().unsynced.len();
            inner.sync().await?;
            log.lock().unwrap().unsynced.drain(..covered);
            Ok(())
        })
    }
}

/// The index of the tractserver at `addr`.
fn index_of(c: &Cluster, addr: &str) -> usize {
    (0..c.tractserver_count()).find(|i| c.tractserver(*i).is_some_and(|t| t.addr == addr)).unwrap()
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect()
}

/// The addresses of the replicas of `tract`, in row order, and the row's
/// version.
fn replicas(client: &Client, blob: &Blob, tract: u64) -> (Vec<String>, u64) {
    let tlt = client.tlt();
    let row = &tlt.rows[tlt.locate(blob.id(), TractNo(tract as i64))];
    let addrs = row.members.iter().take(3).map(|m| tlt.members[*m as usize].addr.clone()).collect();
    (addrs, row.version)
}

/// Sends one request to one tractserver alone, as a client whose write
/// reached only that replica would have.
async fn send_to(server: &str, req: Request, data: Bytes) -> Result<Reply, blizzard_rpc::RpcError> {
    let conn = blizzard_rpc::RpcConn::connect(&Env::real(), server).await?;
    conn.call(&req, data).await.map(|(r, _)| r)
}

fn addr(blob: &Blob, tract: u64, row_version: u64) -> TractAddr {
    TractAddr {
        blob: blob.id(),
        incarnation: blob.incarnation(),
        tract: TractNo(tract as i64),
        row_version,
        writer: blob.writer(),
    }
}

async fn write_to(server: &str, blob: &Blob, row_version: u64, offset: u32, data: &[u8]) -> R {
    let req =
        Request::WriteTract { addr: addr(blob, 0, row_version), offset, crcs: piece_crcs(offset, data) };
    send_to(server, req, Bytes::copy_from_slice(data)).await?;
    Ok(())
}

/// Replicas made to differ the ways a writer's crash leaves them (a
/// partial and a whole-chunk overwrite that reached one replica, a chunk
/// only one replica holds, a chunk one replica lost to a trim) are made
/// equal by `reconcile`, to the contents of the row's first member, with
/// exactly the repairs needed; a second reconcile finds nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_makes_diverged_replicas_agree() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, Duration::ZERO).await;
    let client = c.client().await?;
    let blob = client.create_blob(None, 3).await?;
    blob.extend_to(2).await?;
    // Chunks 0..8 on every replica.
    let base = pattern(1, 8 * CHUNK as usize);
    blob.write(0, 0, Bytes::from(base.clone())).await?;
    let (servers, version) = replicas(&client, &blob, 0);

    // The first member: a partial overwrite of chunk 4 only it took.
    let p0 = pattern(2, 100);
    write_to(&servers[0], &blob, version, 4 * CHUNK + 300, &p0).await?;
    // The second: a partial overwrite across chunks 1 and 2, a whole chunk
    // 3, and chunk 10, which nobody else holds.
    write_to(&servers[1], &blob, version, 5000, &pattern(3, 6000)).await?;
    write_to(&servers[1], &blob, version, 3 * CHUNK, &pattern(4, CHUNK as usize)).await?;
    write_to(&servers[1], &blob, version, 10 * CHUNK, &pattern(5, CHUNK as usize)).await?;
    // The third lost chunk 6 (a trim only it took).
    let trim = Request::TrimTract { addr: addr(&blob, 0, version), offset: 6 * CHUNK, len: CHUNK };
    send_to(&servers[2], trim, Bytes::new()).await?;

    let mut want = vec![0u8; TRACT as usize];
    want[..base.len()].copy_from_slice(&base);
    want[4 * CHUNK as usize + 300..4 * CHUNK as usize + 400].copy_from_slice(&p0);
    let before = blob.read_replicas(0, 0, TRACT).await?;
    assert_eq!(before.len(), 3);
    assert!(before[0][..] == want[..], "the first member holds what it was sent");
    assert!(before[1] != before[0] && before[2] != before[0], "the replicas differ");

    let rec = blob.reconcile(0).await?;
    // Chunks 1, 2, 3 and 10 at the second member, 4 at the second and
    // third, 6 at the third: copies but for chunk 10, which is trimmed.
    assert_eq!(rec.tracts, 1);
    assert_eq!(rec.chunks_compared, (TRACT / CHUNK) as u64);
    assert_eq!(rec.chunk_repairs, 7, "{rec:?}");
    assert_eq!(rec.bytes_copied, 6 * CHUNK as u64, "{rec:?}");
    assert_eq!(rec.unreadable_chunks, 0);
    let after = blob.read_replicas(0, 0, TRACT).await?;
    for (i, r) in after.iter().enumerate() {
        assert!(r[..] == want[..], "replica {i} ({}) differs from the first member", servers[i]);
    }
    assert!(blob.read(0, 0, TRACT).await?[..] == want[..]);

    let again = blob.reconcile(0).await?;
    assert_eq!((again.chunk_repairs, again.bytes_copied), (0, 0), "{again:?}");
    // A tract nobody wrote agrees already.
    assert_eq!(blob.reconcile(1).await?.chunk_repairs, 0);
    let digests: u64 = (0..c.tractserver_count())
        .filter_map(|i| c.tractserver(i))
        .map(|t| t.service.store.stats.digests.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert!(digests >= 3 * 3, "every replica digested each round: {digests}");
    c.stop().await;
    Ok(())
}

/// Once a writer with epoch 5 has digested a tract, a handle on the blob
/// with epoch 4 can neither write nor trim it, nor digest it, and changes
/// nothing; epochs 5 and 6 write, after which 5 is fenced too. Deleting
/// the blob still frees its tracts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_writer_is_fenced_once_a_newer_one_digested() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, Duration::ZERO).await;
    let client = c.client().await?;
    let created = client.create_blob(None, 3).await?;
    created.extend_to(1).await?;
    let old = Bytes::from(pattern(1, TRACT as usize));
    created.write(0, 0, old.clone()).await?;

    let a = client.open_blob(created.id()).await?;
    a.set_writer(5);
    assert_eq!(a.writer(), 5);
    a.reconcile(0).await?;

    let b = client.open_blob(created.id()).await?;
    b.set_writer(4);
    let fenced = |r: Result<(), ClientError>, what: &str| match r {
        Err(ClientError::Fenced { newest: 5, .. }) => {}
        other => panic!("{what} by writer 4: {other:?}"),
    };
    fenced(b.write(0, 0, Bytes::from(pattern(2, 4096))).await, "write");
    fenced(b.write_cached(0, 100, Bytes::from(pattern(2, 10))).await.map(|_| ()), "cached write");
    fenced(b.trim(0, 0, 4096).await, "trim");
    fenced(b.reconcile(0).await.map(|_| ()), "digest");
    let e = b.trim(0, 0, 4096).await.unwrap_err();
    assert!(e.to_string().contains("epoch 5"), "the error says who holds the blob: {e}");
    for r in a.read_replicas(0, 0, TRACT).await? {
        assert!(r == old, "a fenced writer changed a replica");
    }

    // The fence holds writer 5 itself, and newer ones.
    b.set_writer(5);
    b.write(0, 0, Bytes::from(pattern(3, 4096))).await?;
    b.set_writer(6);
    b.write(0, 4096, Bytes::from(pattern(4, 4096))).await?;
    assert!(matches!(
        a.write(0, 0, Bytes::from(pattern(5, 10))).await,
        Err(ClientError::Fenced { newest: 6, .. })
    ));
    let mut want = old.to_vec();
    want[..4096].copy_from_slice(&pattern(3, 4096));
    want[4096..8192].copy_from_slice(&pattern(4, 4096));
    assert!(a.read(0, 0, TRACT).await?[..] == want[..]);

    // Deleting the blob (a handle without an epoch) frees its tracts.
    client.delete_blob(created.id()).await?;
    let used: u64 =
        (0..c.tractserver_count()).filter_map(|i| c.tractserver(i)).map(|t| t.service.store.usage().1).sum();
    assert_eq!(used, 0, "tracts of the deleted blob are left");
    c.stop().await;
    Ok(())
}

/// Small writes ready together travel to each tractserver in batches
/// (`WriteTracts`, issue 24 point 1), and each write in a batch gets its
/// own answer: 48 writes of a current writer land on every replica while
/// 16 of a fenced one, sent in the same moment to the same servers, fail
/// as `Fenced` and change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_ready_together_are_batched_and_each_gets_its_own_answer() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, Duration::ZERO).await;
    let client = c.client().await?;
    let created = client.create_blob(None, 3).await?;
    created.extend_to(16).await?;
    let a = client.open_blob(created.id()).await?;
    a.set_writer(5);
    for t in 0..16 {
        a.write(t, 0, Bytes::from(pattern(t as u8, 4096))).await?;
    }
    let b = client.open_blob(created.id()).await?;
    b.set_writer(4);
    let before = client.batch_counts();

    let current = (0..48u64).map(|i| {
        let (t, at) = (i % 16, 4096 * (1 + i / 16) as u32);
        let a = &a;
        async move { (t, at, a.write(t, at, Bytes::from(pattern(100 + i as u8, 4096))).await) }
    });
    let stale = (0..16u64).map(|t| {
        let b = &b;
        async move { b.write(t, 0, Bytes::from(pattern(200, 4096))).await }
    });
    let (current, stale) =
        futures::join!(futures::future::join_all(current), futures::future::join_all(stale));
    for (t, at, r) in &current {
        assert!(r.is_ok(), "writer 5's write to tract {t} at {at}: {r:?}");
    }
    for r in stale {
        assert!(matches!(r, Err(ClientError::Fenced { newest: 5, .. })), "writer 4's write: {r:?}");
    }
    let (batches, writes) = client.batch_counts();
    assert!(
        batches > before.0 && writes - before.1 >= 2 * (batches - before.0),
        "({batches}, {writes}) after {before:?}"
    );

    for t in 0..16u64 {
        let mut want = pattern(t as u8, 4096);
        for i in (0..48u64).filter(|i| i % 16 == t) {
            want.extend_from_slice(&pattern(100 + i as u8, 4096));
        }
        for r in a.read_replicas(t, 0, want.len() as u32).await? {
            assert!(r[..] == want[..], "tract {t}: a replica differs");
        }
    }
    c.stop().await;
    Ok(())
}

/// A change of an older writer that was admitted on arrival, but reaches
/// the tract only after a newer writer's digest raised the fence (here it
/// waits for the tract's lock, held by an earlier write sitting in a slow
/// modelled disk), is refused when it gets there: the fence is checked
/// again under the tract's lock, the lock the digest takes, so the digest
/// saw everything that will ever land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_arrives_before_the_fence_but_lands_after_is_refused() -> R {
    let dir = tempfile::tempdir()?;
    let c = cluster(&dir, Duration::from_millis(500)).await;
    let client = c.client().await?;
    let created = client.create_blob(None, 3).await?;
    created.extend_to(1).await?;
    let old = Bytes::from(pattern(1, TRACT as usize));
    created.write(0, 0, old.clone()).await?;
    let inflight = || -> u32 {
        (0..c.tractserver_count())
            .filter_map(|i| c.tractserver(i))
            .map(|t| t.service.inflight.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    };
    assert_eq!(inflight(), 0);
    // The client learns the replicas' boot ids (a sync reports them), so
    // the reconcile below sends its digests at once, not after a sync that
    // asks for them (which would let the late write land first, seen by
    // the digest, and this test would not test the lock).
    let receipt = created.write_cached(0, 0, old.slice(0..4096)).await?;
    created.sync(receipt).await?;

    let wait_inflight = |n: u32| {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        async move {
            while inflight() < n {
                assert!(std::time::Instant::now() < deadline, "a write never reached its replicas");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    };
    // Writer 4's first write takes the tract's lock on every replica and
    // waits for the disk there; its second is admitted (it is counted in
    // flight from before its first check) and waits for the lock.
    let first = client.open_blob(created.id()).await?;
    first.set_writer(4);
    let landed = Bytes::from(pattern(2, 4096));
    let lands = landed.clone();
    let first = tokio::spawn(async move { first.write(0, 0, lands).await });
    wait_inflight(3).await;
    let b = client.open_blob(created.id()).await?;
    b.set_writer(4);
    let late = tokio::spawn(async move { b.write(0, 0, Bytes::from(pattern(3, 4096))).await });
    wait_inflight(6).await;
    let a = client.open_blob(created.id()).await?;
    a.set_writer(5);
    a.reconcile(0).await?;
    // The first write was checked before the fence rose and the digest
    // waited for it; the second was checked again under the lock.
    first.await??;
    match late.await? {
        Err(ClientError::Fenced { newest: 5, .. }) => {}
        other => panic!("a write of writer 4 landing after writer 5's digest: {other:?}"),
    }
    let mut want = old.to_vec();
    want[..4096].copy_from_slice(&landed);
    for r in a.read_replicas(0, 0, TRACT).await? {
        assert!(r[..] == want[..], "the fenced write changed a replica after the digest");
    }
    c.stop().await;
    Ok(())
}

/// What a reconcile settled is durable on every replica when it returns. A
/// cached write that reached only the row's first member (applied there,
/// not yet synced) is what the replicas agree on: it is copied to the
/// others; then the first member loses power. Once, the digests answered
/// from memory and nothing synced the first member: it came back without
/// the write while the others kept it, and nothing would compare them
/// again (a volume clears the tract's intent bit once reconciled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconciled_tract_survives_a_power_loss() -> R {
    let dir = tempfile::tempdir()?;
    let disks = LossyDisks::default();
    let env = Env { disks: Arc::new(disks.clone()), ..Env::real() };
    let mut c = cluster_on(&dir, Duration::ZERO, env, true).await;
    let client = c.client().await?;
    let blob = client.create_blob(None, 3).await?;
    blob.extend_to(1).await?;
    let old = pattern(1, TRACT as usize);
    blob.write(0, 0, Bytes::from(old.clone())).await?;
    let (servers, version) = replicas(&client, &blob, 0);
    let first = index_of(&c, &servers[0]);

    // A cached write of chunks 0 and 1 that reached the first member only.
    let new = pattern(2, 2 * CHUNK as usize);
    let cached =
        Request::WriteTractCached { addr: addr(&blob, 0, version), offset: 0, crcs: piece_crcs(0, &new) };
    send_to(&servers[0], cached, Bytes::from(new.clone())).await?;
    assert!(disks.unsynced(&c.disk_path(first)) > 0, "the cached write is not durable yet");

    blob.reconcile(0).await?;
    let mut want = old.clone();
    want[..new.len()].copy_from_slice(&new);
    for (i, r) in blob.read_replicas(0, 0, TRACT).await?.iter().enumerate() {
        assert!(r[..] == want[..], "replica {i} ({}) after reconciling", servers[i]);
    }

    // Power loss at the first member: what it had not synced is gone.
    c.stop_tractserver(first).await;
    disks.lose_power(&c.disk_path(first));
    c.start_tractserver(first).await?;
    c.wait_ready(Duration::from_secs(10)).await?;
    for (i, r) in blob.read_replicas(0, 0, TRACT).await?.iter().enumerate() {
        assert!(r[..] == want[..], "replica {i} ({}) after the first member lost power", servers[i]);
    }
    c.stop().await;
    Ok(())
}

/// A server that restarted between the last boot id this client heard
/// from it and the sync after its digest (here, between two reconciles:
/// its address stays, a unix socket) makes the round start again: what it
/// digested may have been answered by the process before, whose unsynced
/// state a restart may have lost. The second reconcile takes two rounds of
/// digests; the first round's syncs tell it the server restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_before_the_sync_starts_the_round_again() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster_on(&dir, Duration::ZERO, Env::real(), true).await;
    let client = c.client().await?;
    let blob = client.create_blob(None, 3).await?;
    blob.extend_to(1).await?;
    blob.write(0, 0, Bytes::from(pattern(1, TRACT as usize))).await?;
    let (servers, _) = replicas(&client, &blob, 0);
    // The client learns every replica's boot id.
    blob.reconcile(0).await?;

    let restarted = index_of(&c, &servers[1]);
    c.stop_tractserver(restarted).await;
    c.start_tractserver(restarted).await?;
    c.wait_ready(Duration::from_secs(10)).await?;
    assert_eq!(c.tractserver(restarted).unwrap().addr, servers[1], "the address stays");
    // Reconnect to it (a read retries past the closed connection).
    blob.read_replicas(0, 0, 4096).await?;

    let first = index_of(&c, &servers[0]);
    let digests = |c: &Cluster| {
        c.tractserver(first).unwrap().service.store.stats.digests.load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = digests(&c);
    let rec = blob.reconcile(0).await?;
    assert_eq!(rec.chunk_repairs, 0);
    assert_eq!(digests(&c) - before, 2, "one round for the restart, one that held");
    // Now it knows the new boot id: one round.
    let before = digests(&c);
    blob.reconcile(0).await?;
    assert_eq!(digests(&c) - before, 1);
    c.stop().await;
    Ok(())
}
