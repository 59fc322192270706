//! A blob client's verified workload: its own blob, random writes retried
//! until acknowledged, random reads checked against its model, and a
//! full check once the cluster is whole again.

use super::*;

/// Shared between the clients and the chaos loop.
#[derive(Clone, Default)]
pub(super) struct Probe {
    /// Set by the first client to finish its workload: faults stop.
    pub(super) faults_over: Arc<std::sync::atomic::AtomicBool>,
    pub(super) rows_refilled: Arc<AtomicU64>,
    pub(super) rows_grown: Arc<AtomicU64>,
    /// Blobs the clients created hybrid (design 0009).
    pub(super) hybrid_blobs: Arc<AtomicU64>,
    /// Clients that saw the cluster whole after their writes, and whether
    /// the bit flips that follow are in.
    pub(super) replicated: Arc<AtomicU64>,
    pub(super) flipped: Arc<std::sync::atomic::AtomicBool>,
}

/// One client: its own blob, random aligned and unaligned writes (retried
/// until acknowledged), random verified reads, and a full verified read at
/// the end.
pub(super) async fn client_workload(
    env: blizzard_env::Env,
    host: String,
    cfg: BlobSimConfig,
    trace: Trace,
    acked: Arc<AtomicU64>,
    verified: Arc<AtomicU64>,
    probe: Probe,
) -> Result<(), BoxError> {
    let mut cc = ClientConfig::new(meta_addrs(cfg.meta_replicas));
    cc.large_transfer_min = Some(FLOW_ASK_MIN);
    cc.request_timeout = Duration::from_secs(2);
    cc.attempts = 30;
    cc.backoff_max = Duration::from_millis(500);
    cc.connect_timeout = Duration::from_secs(120);
    // Odd-numbered clients also send every write once, to the row's
    // primary, which forwards it (size-aware replication, Ursa §3.4).
    let odd = host.trim_start_matches("client").parse::<usize>().is_ok_and(|c| c % 2 == 1);
    cc.forward_above = odd.then_some(0);
    let client = Client::connect(env.clone(), cc).await?;
    let mut rng = SmallRng::seed_from_u64(env.random_u64());
    let ts = cfg.tract_size;
    // Odd-numbered clients place their blob hybrid where the table has
    // that section (design 0009): an ssd primary, hdd backups behind
    // journals, reads from the primary.
    // (With 1-way replication a hybrid row is its ssd primary alone, so
    // the journals would see fewer writes: those runs keep `any`.)
    let placement = match odd && cfg.replication > 1 && client.tlt().has_placement(Placement::Hybrid) {
        true => Placement::Hybrid,
        false => Placement::Any,
    };
    let blob = loop {
        match client.create_placed_blob(None, cfg.replication, placement).await {
            Ok(b) => {
                if placement == Placement::Hybrid {
                    probe.hybrid_blobs.fetch_add(1, Ordering::Relaxed);
                }
                break b;
            }
            Err(e) => {
                trace.event(&host, format!("create failed, retrying: {e}"));
                env.sleep(Duration::from_millis(200)).await;
            }
        }
    };
    loop {
        match blob.extend_to(cfg.tracts_per_client).await {
            Ok(_) => break,
            Err(e) => {
                trace.event(&host, format!("extend failed, retrying: {e}"));
                env.sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let mut model = vec![vec![0u8; ts as usize]; cfg.tracts_per_client as usize];
    let read_verified = |model: &Vec<Vec<u8>>, t: u64, off: u32, got: &[u8]| -> Result<(), BoxError> {
        let want = &model[t as usize][off as usize..off as usize + got.len()];
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "{host}: acknowledged data lost or corrupted: tract {t} offset {}: read {:#04x}, expected {:#04x}",
                off as usize + at,
                got[at],
                want[at]
            )
            .into());
        }
        Ok(())
    };
    for w in 0..cfg.writes_per_client {
        let t = rng.random_range(0..cfg.tracts_per_client);
        let (off, len) = match rng.random_range(0..3) {
            0 => (0, ts),
            1 => {
                let chunk = rng.random_range(0..ts / 4096);
                (chunk * 4096, 4096 * rng.random_range(1..=(ts / 4096 - chunk)))
            }
            _ => {
                let off = rng.random_range(0..ts - 1);
                (off, rng.random_range(1..=(ts - off).min(6000)))
            }
        };
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let mut tries = 0;
        loop {
            match blob.write(t, off, Bytes::from(data.clone())).await {
                Ok(()) => break,
                Err(e) => {
                    tries += 1;
                    trace.event(&host, format!("write {w} failed (try {tries}), retrying: {e}"));
                    if tries > 50 {
                        return Err(format!("{host}: write {w} never succeeded: {e}").into());
                    }
                    env.sleep(Duration::from_millis(200)).await;
                }
            }
        }
        model[t as usize][off as usize..(off + len) as usize].copy_from_slice(&data);
        acked.fetch_add(1, Ordering::Relaxed);
        if w % 4 == 0 {
            if let Ok(s) = client.cluster_status().await {
                probe.rows_refilled.fetch_max(s.rows_filling as u64, Ordering::Relaxed);
            }
            let pending = client.tlt().rows.iter().filter(|r| !r.pending.is_empty()).count();
            probe.rows_grown.fetch_max(pending as u64, Ordering::Relaxed);
        }
        trace.event(&host, format!("ack write {w} tract {t} [{off}, +{len})"));
        if rng.random_ratio(1, 3) {
            let rt = rng.random_range(0..cfg.tracts_per_client);
            let roff = rng.random_range(0..ts);
            let rlen = rng.random_range(1..=ts - roff);
            let got = retry_read(&env, &blob, rt, roff, rlen, &trace, &host).await?;
            read_verified(&model, rt, roff, &got)?;
            verified.fetch_add(1, Ordering::Relaxed);
        }
    }
    for t in 0..cfg.tracts_per_client {
        let got = retry_read(&env, &blob, t, 0, ts, &trace, &host).await?;
        read_verified(&model, t, 0, &got)?;
        verified.fetch_add(1, Ordering::Relaxed);
    }
    trace.event(&host, "safety phase done: every acknowledged byte verified");

    // Liveness: faults stop; the cluster must return to full replication
    // by itself, and then every replica must hold every acknowledged byte.
    probe.faults_over.store(true, Ordering::Relaxed);
    let deadline = env.now() + Duration::from_secs(120);
    loop {
        match client.cluster_status().await {
            Ok(s) => {
                probe.rows_refilled.fetch_max(s.rows_filling as u64, Ordering::Relaxed);
                if s.fully_replicated() {
                    trace.event(&host, format!("fully replicated at TLT v{}", s.tlt_version));
                    break;
                }
                if env.now() > deadline {
                    return Err(format!(
                        "{host}: liveness: not fully replicated 120 s after faults stopped: phase {} rows_filling {} rows_degraded {}; members: {:?}",
                        s.phase,
                        s.rows_filling,
                        s.rows_degraded,
                        s.members.iter().map(|m| (m.addr.clone(), m.alive, m.dead, m.rows, m.fill)).collect::<Vec<_>>()
                    )
                    .into());
                }
            }
            Err(e) if env.now() > deadline => {
                return Err(format!("{host}: liveness: metadata server unreachable: {e}").into())
            }
            Err(_) => {}
        }
        env.sleep(Duration::from_millis(100)).await;
    }
    // The harness flips bits once every client got here (see `run_blob_sim`).
    probe.replicated.fetch_add(1, Ordering::Relaxed);
    while !probe.flipped.load(Ordering::Relaxed) {
        env.sleep(Duration::from_millis(50)).await;
    }
    for t in 0..cfg.tracts_per_client {
        let mut tries = 0;
        let replicas = loop {
            match blob.read_replicas(t, 0, ts).await {
                Ok(r) => break r,
                Err(e) => {
                    // A flipped bit makes a replica unreadable until the
                    // scrubber repairs it (a pass every few seconds).
                    tries += 1;
                    if tries > 150 {
                        return Err(format!("{host}: liveness: replicas of tract {t} unreadable: {e}").into());
                    }
                    env.sleep(Duration::from_millis(200)).await;
                }
            }
        };
        if replicas.len() != cfg.replication as usize {
            return Err(format!(
                "{host}: tract {t} has {} replicas, not {}",
                replicas.len(),
                cfg.replication
            )
            .into());
        }
        for (i, r) in replicas.iter().enumerate() {
            if r[..] != model[t as usize][..] {
                let at = r.iter().zip(&model[t as usize]).position(|(a, b)| a != b).unwrap_or(0);
                let tlt = client.tlt();
                let row = tlt.locate(blob.id(), blizzard_core::TractNo(t as i64));
                let who = tlt.rows[row].members.get(i).map(|&m| tlt.members[m as usize].addr.clone());
                return Err(format!(
                    "{host}: liveness: replica {i} ({}, row {row} v{}) of tract {t} differs from the acknowledged bytes at offset {at}",
                    who.unwrap_or_default(),
                    tlt.rows[row].version
                )
                .into());
            }
        }
        verified.fetch_add(1, Ordering::Relaxed);
    }
    trace.event(&host, "done: every replica of every tract verified");
    Ok(())
}

async fn retry_read(
    env: &blizzard_env::Env,
    blob: &blizzard_client::Blob,
    t: u64,
    off: u32,
    len: u32,
    trace: &Trace,
    host: &str,
) -> Result<Bytes, BoxError> {
    let mut tries = 0;
    loop {
        match blob.read(t, off, len).await {
            Ok(b) => return Ok(b),
            Err(e) => {
                tries += 1;
                trace.event(host, format!("read of tract {t} failed (try {tries}): {e}"));
                if tries > 50 {
                    return Err(format!("{host}: tract {t} unreadable: {e}").into());
                }
                env.sleep(Duration::from_millis(200)).await;
            }
        }
    }
}
