//! Re-replication (FDS §3.2) in one process on real sockets and files: a
//! tractserver stops, the metadata server declares it dead, newcomers copy
//! its rows from the survivors while clients keep writing, and every
//! replica ends up with every acknowledged byte. The same with real
//! processes and SIGKILL is `crates/cli/tests/integration/fault_recovery.rs`.

#![allow(clippy::unwrap_used)]
// Real time: the cluster runs on real sockets and files.
#![allow(clippy::disallowed_methods)]

use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, RngCore, SeedableRng};

use blizzard_client::{Blob, Client};
use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::TsId;
use blizzard_env::Env;
use blizzard_proto::ClusterStatus;

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

async fn cluster(dir: &tempfile::TempDir, n: usize, replication: u8) -> Cluster {
    init_tracing();
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = n;
    cfg.replication = replication;
    cfg.tract_size = TRACT;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    // Copying is held to 128 KiB/s per newcomer, so client reads and writes
    // meet tracts not copied yet.
    cfg.fill_bandwidth = 128 << 10;
    cfg.scrub_bandwidth = 32 << 20;
    Cluster::start(Env::real(), cfg).await.unwrap()
}

/// Every acknowledged byte of each blob, tract by tract.
struct Model {
    blobs: Vec<(Blob, Vec<Vec<u8>>)>,
    rng: rand::rngs::SmallRng,
}

impl Model {
    async fn new(
        client: &Client,
        replications: &[u8],
        tracts: u64,
        seed: u64,
    ) -> Result<Model, Box<dyn std::error::Error + Send + Sync>> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut blobs = Vec::new();
        for &r in replications {
            let b = client.create_blob(None, r).await?;
            b.extend_to(tracts).await?;
            let mut content = Vec::new();
            for t in 0..tracts {
                // Leave some tracts unwritten and some partly written.
                let len = match t % 4 {
                    0 => 0,
                    1 => 5000,
                    _ => TRACT as usize,
                };
                let mut data = vec![0u8; len];
                rng.fill_bytes(&mut data);
                if len > 0 {
                    b.write(t, 0, Bytes::from(data.clone())).await?;
                }
                let mut full = data;
                full.resize(TRACT as usize, 0);
                content.push(full);
            }
            blobs.push((b, content));
        }
        Ok(Model { blobs, rng })
    }

    /// A random write, recorded once acknowledged.
    async fn write(&mut self) -> R {
        let i = self.rng.random_range(0..self.blobs.len());
        let (b, content) = &mut self.blobs[i];
        let t = self.rng.random_range(0..content.len());
        let off = self.rng.random_range(0..TRACT - 1);
        let len = self.rng.random_range(1..=(TRACT - off).min(20_000));
        let data: Vec<u8> = (0..len).map(|_| self.rng.random()).collect();
        b.write(t as u64, off, Bytes::from(data.clone())).await?;
        content[t][off as usize..(off + len) as usize].copy_from_slice(&data);
        Ok(())
    }

    /// A random read (from whichever replica the client picks) matches.
    async fn read(&mut self) -> R {
        let i = self.rng.random_range(0..self.blobs.len());
        let (b, content) = &self.blobs[i];
        let t = self.rng.random_range(0..content.len());
        let off = self.rng.random_range(0..TRACT - 1);
        let len = self.rng.random_range(1..=(TRACT - off).min(20_000));
        let got = b.read(t as u64, off, len).await?;
        assert!(
            got[..] == content[t][off as usize..(off + len) as usize],
            "blob {} tract {t} read [{off}, +{len}) differs",
            b.id()
        );
        Ok(())
    }

    /// Every replica of every tract holds exactly the model.
    async fn verify_replicas(&self) -> R {
        for (b, content) in &self.blobs {
            for (t, want) in content.iter().enumerate() {
                let got = b.read_replicas(t as u64, 0, TRACT).await?;
                assert_eq!(got.len(), b.replication() as usize, "blob {} tract {t}", b.id());
                for (r, g) in got.iter().enumerate() {
                    if g[..] != want[..] {
                        let at = g.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
                        panic!(
                            "blob {} (replication {}) tract {t} replica {r} differs at byte {at}",
                            b.id(),
                            b.replication()
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

/// Writes and reads (each checked against the model) until the cluster is
/// fully replicated and `done` holds of its status (`what` says what that
/// is, for the failure message). The load must have met a row being
/// copied, or it tested nothing.
async fn load_until(
    client: &Client,
    model: &mut Model,
    what: &str,
    done: impl Fn(&ClusterStatus) -> bool,
) -> R {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut filling_rounds = 0;
    loop {
        model.write().await?;
        for _ in 0..6 {
            model.read().await?;
        }
        let s = client.cluster_status().await?;
        if s.rows_filling > 0 {
            // Once, mid-copy: every replica of every tract, newcomers
            // included (a newcomer answers "not ready" until it has copied
            // a tract, and the client retries).
            if filling_rounds == 0 {
                model.verify_replicas().await?;
            }
            filling_rounds += 1;
        }
        if s.fully_replicated() && done(&s) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not fully replicated with {what} within 90 s: {s:#?}");
    }
    assert!(filling_rounds > 0, "the load never met a row being copied");
    Ok(())
}

/// [`load_until`] every server of `dead` is declared dead.
async fn load_until_fully_replicated(client: &Client, model: &mut Model, dead: &[String]) -> R {
    load_until(client, model, "the stopped servers dead", |s| {
        dead.iter().all(|a| s.members.iter().any(|m| &m.addr == a && m.dead))
    })
    .await
}

/// One tractserver stops; its rows are re-replicated by the others while a
/// client keeps writing (including tracts not yet copied, which the
/// newcomer copies before applying the write), and blobs of every
/// replication level keep every byte on every replica. The stopped server
/// then returns: it is fenced, given its current (empty) assignment, and
/// the cluster stays fully replicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_tractserver_is_re_replicated_under_writes() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir, 8, 3).await;
    let client = c.client().await?;
    let mut model = Model::new(&client, &[3, 2, 3], 48, 7).await?;
    model.verify_replicas().await?;

    let victim = c.tractserver(0).unwrap().addr.clone();
    let victim_id = c.tractserver(0).unwrap().id;
    let rows_before = client
        .tlt()
        .rows
        .iter()
        .filter(|r| r.members.iter().any(|&m| client.tlt().members[m as usize].id == victim_id))
        .count();
    assert!(rows_before > 0);
    c.stop_tractserver(0).await;
    // Writes go on through the failure: retried until the new rows are
    // served, then applied on every member, newcomers included; reads
    // never see a newcomer's tract before it is copied.
    load_until_fully_replicated(&client, &mut model, std::slice::from_ref(&victim)).await?;
    for _ in 0..50 {
        model.write().await?;
    }
    model.verify_replicas().await?;
    let tlt = client.tlt();
    assert!(
        !tlt.rows.iter().any(|r| r.members.iter().any(|&m| tlt.members[m as usize].id == victim_id)),
        "the dead server still holds rows"
    );

    // It comes back (same disk, new port): it must not take its old rows
    // back as they were. It is fenced, given its current (empty)
    // assignment, and then rejoins as a new server would (FDS §3.4):
    // pending entries, copied under load, committed.
    c.start_tractserver(0).await?;
    let back_id = c.tractserver(0).unwrap().id;
    load_until_settled(&client, &mut model, &[back_id]).await?;
    model.verify_replicas().await?;
    // Its scrubber frees what it held of rows it no longer has; rows it
    // took back hold only what it copied (`fill::purge_uncopied`).
    wait_only_held_tracts(&c, 0).await?;
    model.verify_replicas().await?;
    c.stop().await;
    Ok(())
}

/// Size-aware replication (Ursa §3.4) through a failure: a client that
/// sends writes above 4 KiB once, to the row's primary, which forwards
/// them to the backups, keeps every byte on every replica while a
/// tractserver dies and its rows are re-replicated (forwarded copies go to
/// newcomers too, and ones cut off by the failure are retried at a newer
/// epoch of the client's session).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_writes_keep_every_replica_through_a_failure() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir, 6, 3).await;
    let client = c.client_with(|cfg| cfg.forward_above = Some(4096)).await?;
    let mut model = Model::new(&client, &[3, 2], 32, 11).await?;
    model.verify_replicas().await?;
    let forwarded = client.stats().forwarded_writes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(forwarded > 0, "writes above 4 KiB were forwarded");
    let victim = c.tractserver(1).unwrap().addr.clone();
    c.stop_tractserver(1).await;
    load_until_fully_replicated(&client, &mut model, std::slice::from_ref(&victim)).await?;
    for _ in 0..50 {
        model.write().await?;
    }
    model.verify_replicas().await?;
    assert!(client.stats().forwarded_writes.load(std::sync::atomic::Ordering::Relaxed) > forwarded);
    c.stop().await;
    Ok(())
}

/// Two tractservers join a loaded 8-server cluster (FDS §3.4): each takes
/// its share of TLT entries as pending, copies them while clients write to
/// both the old and the new member, and is committed; the servers it
/// replaced free those rows' tracts. Every replica matches throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_tractservers_take_their_share_under_writes() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir, 8, 3).await;
    let client = c.client().await?;
    let mut model = Model::new(&client, &[3, 2, 1], 48, 11).await?;
    model.verify_replicas().await?;
    c.start_tractserver(8).await?;
    c.start_tractserver(9).await?;
    let new = [c.tractserver(8).unwrap().id, c.tractserver(9).unwrap().id];
    load_until_settled(&client, &mut model, &new).await?;
    for _ in 0..50 {
        model.write().await?;
    }
    model.verify_replicas().await?;
    // Spread: every member holds its share of positions within one or two.
    let s = client.cluster_status().await?;
    let tlt = client.tlt();
    let fair = tlt.rows.len() * tlt.replication as usize / 10;
    for m in &s.members {
        assert!(
            (m.rows as usize) >= fair.saturating_sub(1) && (m.rows as usize) <= fair + 2,
            "{} holds {} positions, fair share {fair}: {s:#?}",
            m.id,
            m.rows
        );
    }
    for i in 0..10 {
        wait_only_held_tracts(&c, i).await?;
    }
    model.verify_replicas().await?;
    c.stop().await;
    Ok(())
}

/// Incremental repair (Ursa §4.2.1, design 0009): a tractserver out for
/// two seconds under writes is declared dead and replaced, but it comes
/// back while its replacements are still copying. It takes its columns
/// back, filling, and fetches only the chunks that changed while it was
/// away (`CopyTractChanges`) instead of having newcomers copy whole rows;
/// every replica ends with every acknowledged byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_back_from_a_short_outage_repairs_only_what_it_missed() -> R {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 8;
    cfg.replication = 3;
    cfg.tract_size = TRACT;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    // Slow enough that no replacement has finished when the server returns.
    cfg.fill_bandwidth = 48 << 10;
    cfg.scrub_bandwidth = 32 << 20;
    let mut c = Cluster::start(Env::real(), cfg).await?;
    let client = c.client().await?;
    // Four writers, each with its own blobs.
    let mut models = Vec::new();
    for k in 0..4 {
        models.push(Model::new(&client, &[3, 3, 2], 16, 21 + k).await?);
    }

    let victim = c.tractserver(0).unwrap().id;
    let rows_of = |tlt: &blizzard_core::tlt::Tlt| -> Vec<usize> {
        let me = tlt.member_index(victim);
        (0..tlt.rows.len()).filter(|&i| me.is_some_and(|m| tlt.rows[i].members.contains(&m))).collect()
    };
    let rows_before = rows_of(&c.meta().unwrap().server.tlt().unwrap());
    assert!(!rows_before.is_empty());
    c.stop_tractserver(0).await;
    // Writes go on through the outage (in their own task, so the server
    // returns after two seconds even while a write waits for a new row).
    let down = std::time::Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let loads: Vec<_> = models
        .into_iter()
        .map(|mut model| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut writes = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    model.write().await.unwrap();
                    writes += 1;
                }
                (model, writes)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let s = client.cluster_status().await?;
    assert!(s.members.iter().any(|m| m.id == victim && m.dead), "declared dead within 2 s: {s:#?}");
    let outage = down.elapsed();
    c.start_tractserver(0).await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut models = Vec::new();
    let mut outage_writes = 0;
    for l in loads {
        let (model, n) = l.await?;
        models.push(model);
        outage_writes += n;
    }
    let mut writes = 0;
    assert_eq!(c.tractserver(0).unwrap().id, victim, "same disk, same server");

    // Back in its rows, repaired, under load.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let model = &mut models[writes % 4];
        model.write().await?;
        writes += 1;
        for _ in 0..4 {
            model.read().await?;
        }
        let s = client.cluster_status().await?;
        let tlt = c.meta().unwrap().server.tlt().unwrap();
        // Rows whose replacement finished copying first stay with it.
        let back_in = rows_of(&tlt);
        if s.fully_replicated() && !back_in.is_empty() {
            assert!(
                back_in.iter().all(|r| rows_before.contains(r)),
                "back in rows it never held: {back_in:?}, held {rows_before:?}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the returned server is not back in any of its rows {rows_before:?} within 90 s: {s:#?}"
        );
    }
    for model in &models {
        model.verify_replicas().await?;
    }

    // What the repair moved against what whole copies of its rows would.
    let back = c.tractserver(0).unwrap();
    let repaired = back.service.fill.report().1.bytes_done;
    let unchanged = back.service.fill.unchanged_bytes();
    let newcomers: u64 = (1..8).map(|i| c.tractserver(i).unwrap().service.fill.report().1.bytes_done).sum();
    println!(
        "repair: outage_s={:.1} outage_writes={outage_writes} later_writes={writes} rows={} of {} repaired_bytes={repaired} full_copy_bytes={} newcomer_bytes={newcomers}",
        outage.as_secs_f64(),
        rows_of(&c.meta().unwrap().server.tlt().unwrap()).len(),
        rows_before.len(),
        repaired + unchanged
    );
    assert!(unchanged > 0, "nothing was kept: the repair copied whole tracts");
    assert!(
        repaired * 2 < repaired + unchanged,
        "the repair moved {repaired} of {} bytes: not incremental",
        repaired + unchanged
    );
    // The replacements' partial copies are freed by their scrubbers.
    for i in 0..8 {
        wait_only_held_tracts(&c, i).await?;
    }
    for model in &models {
        model.verify_replicas().await?;
    }
    c.stop().await;
    Ok(())
}

/// [`load_until`] each of `joining` is alive and holds TLT positions.
async fn load_until_settled(client: &Client, model: &mut Model, joining: &[TsId]) -> R {
    load_until(client, model, "the joining servers holding rows", |s| {
        joining.iter().all(|id| s.members.iter().any(|m| m.id == *id && m.alive && m.rows > 0))
    })
    .await
}

/// Waits until tractserver `i` holds only tracts of rows the TLT gives it.
async fn wait_only_held_tracts(c: &Cluster, i: usize) -> R {
    let h = c.tractserver(i).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let tlt = c.meta().unwrap().server.tlt().unwrap();
        let me = tlt.member_index(h.id);
        let strays: Vec<_> = h
            .service
            .store
            .tracts()
            .into_iter()
            .filter(|(b, t)| {
                let row = &tlt.rows[tlt.locate(*b, *t)];
                !me.is_some_and(|m| row.members.contains(&m))
            })
            .collect();
        if strays.is_empty() {
            return Ok(());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tractserver {i} still holds {} tracts of rows it left, e.g. {:?}",
            strays.len(),
            strays[0]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn flip_byte(path: &std::path::Path, at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at)?;
    f.write_all_at(&[b[0] ^ 0x5a], at)?;
    f.sync_all()
}

/// Bit rot: bytes flipped in tract files under running tractservers are
/// found by the scrubber and rewritten from another replica, while client
/// reads (checked against the model) never see the damage; afterwards
/// every replica of every tract is intact again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrubber_repairs_bit_rot_from_other_replicas() -> R {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 6;
    cfg.replication = 3;
    cfg.tract_size = TRACT;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    cfg.scrub_bandwidth = 32 << 20;
    let c = Cluster::start(Env::real(), cfg).await?;
    let client = c.client().await?;
    let mut model = Model::new(&client, &[3, 2], 24, 11).await?;
    let tlt = client.tlt();
    let mut damaged = 0;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
    for (bi, (b, content)) in model.blobs.iter().enumerate() {
        for t in (0..content.len()).filter(|t| t % 4 != 0) {
            // One replica per tract, a random chunk of the written part.
            let row = &tlt.rows[tlt.locate(b.id(), blizzard_core::TractNo(t as i64))];
            let col = (t + bi) % b.replication() as usize;
            let id = tlt.members[row.members[col] as usize].id;
            let i = (0..c.tractserver_count()).find(|&i| c.tractserver(i).unwrap().id == id).unwrap();
            let store = &c.tractserver(i).unwrap().service.store;
            let Some(base) = store.data_location(b.id(), blizzard_core::TractNo(t as i64)) else { continue };
            let written = if t % 4 == 1 { 5000 } else { TRACT as u64 };
            let at = base + rng.random_range(0..written);
            flip_byte(&c.disk_path(i), at)?;
            damaged += 1;
        }
    }
    assert!(damaged > 10);
    // Orphans: tracts of a blob that does not exist (as a delete that never
    // reached this server leaves behind), and of an older incarnation of a
    // blob that does.
    let ghost = blizzard_core::BlobId(rng.random());
    let store = &c.tractserver(0).unwrap().service.store;
    let page = Bytes::from(vec![7u8; 4096]);
    let crcs = blizzard_core::crc::piece_crcs(0, &page);
    for t in 0..3 {
        store.write(ghost, 1, blizzard_core::TractNo(t), 1, 0, page.clone(), &crcs).await?;
    }
    let old_life = model.blobs[0].0.incarnation().wrapping_add(1);
    store
        .write(model.blobs[0].0.id(), old_life, blizzard_core::TractNo(1000), 1, 0, page.clone(), &crcs)
        .await?;
    // Reads meanwhile never return damaged bytes (the CRC check and a
    // fallback to another replica), and the scrubber repairs every chunk.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        for _ in 0..10 {
            model.read().await?;
        }
        let repaired: u64 = (0..c.tractserver_count())
            .map(|i| {
                c.tractserver(i)
                    .unwrap()
                    .service
                    .scrub
                    .stats()
                    .repaired
                    .load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum();
        if repaired >= damaged {
            assert_eq!(repaired, damaged, "more repairs than damaged chunks");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "only {repaired} of {damaged} damaged chunks repaired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    model.verify_replicas().await?;
    // The orphans go (after two passes agree), and nothing else does.
    let scrub = c.tractserver(0).unwrap().service.scrub.stats();
    while scrub.orphans_freed.load(std::sync::atomic::Ordering::Relaxed) < 4 {
        assert!(std::time::Instant::now() < deadline + Duration::from_secs(30), "orphans not freed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let freed: u64 = (0..c.tractserver_count())
        .map(|i| {
            c.tractserver(i)
                .unwrap()
                .service
                .scrub
                .stats()
                .orphans_freed
                .load(std::sync::atomic::Ordering::Relaxed)
        })
        .sum();
    assert_eq!(freed, 4, "the scrubber freed tracts of live blobs");
    assert!(!store.tracts().iter().any(|(b, _)| *b == ghost));
    model.verify_replicas().await?;
    c.stop().await;
    Ok(())
}

/// A newcomer copies a row only from its first complete member. A chunk
/// that member cannot read (rot, or a chunk torn by a power loss that no
/// replica holds the way its entry expects, which the scrubber cannot
/// repair) is healed there from another complete member before it is
/// sent. Once, the copy of that tract failed for good: the newcomer
/// answered `NotReady` forever, the row never finished filling, and a
/// volume reconciling the tract could not open. The scrubber is off here,
/// so only the copy can mend the damage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newcomer_copies_past_a_chunk_its_source_cannot_read() -> R {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = 5;
    cfg.replication = 3;
    cfg.tract_size = TRACT;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    let mut c = Cluster::start(Env::real(), cfg).await?;
    let client = c.client().await?;
    let model = Model::new(&client, &[3], 16, 3).await?;
    let (b, content) = &model.blobs[0];
    let victim = 4;
    let victim_id = c.tractserver(victim).unwrap().id;
    let victim_addr = c.tractserver(victim).unwrap().addr.clone();
    // Damage chunk 2 of every fully written tract on the first member of
    // its row, where that member is not the server about to stop (so it
    // stays the source of the copy).
    let tlt = client.tlt();
    let mut damaged = 0;
    for t in (0..content.len()).filter(|t| t % 4 >= 2) {
        let row = &tlt.rows[tlt.locate(b.id(), blizzard_core::TractNo(t as i64))];
        let ids: Vec<TsId> = row.members.iter().map(|&m| tlt.members[m as usize].id).collect();
        if !ids.contains(&victim_id) || ids[0] == victim_id {
            continue;
        }
        let i = (0..c.tractserver_count()).find(|&i| c.tractserver(i).unwrap().id == ids[0]).unwrap();
        let store = &c.tractserver(i).unwrap().service.store;
        let base = store.data_location(b.id(), blizzard_core::TractNo(t as i64)).unwrap();
        flip_byte(&c.disk_path(i), base + 2 * 4096 + 100)?;
        damaged += 1;
    }
    assert!(damaged > 0, "no tract to damage in a row of the stopped server");
    c.stop_tractserver(victim).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let s = client.cluster_status().await?;
        if s.fully_replicated() && s.members.iter().any(|m| m.addr == victim_addr && m.dead) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "rows not refilled within 60 s: {s:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every replica, the newcomers' and the healed sources' included,
    // holds every acknowledged byte.
    model.verify_replicas().await?;
    c.stop().await;
    Ok(())
}
