//! The durable Raft log's recovery tests: power loss at any moment, the
//! meta file's two slots, and the directories recovery must refuse
//! (`recover.rs`). The helpers and the in-memory disks are in `tests.rs`.

use super::*;

/// Power loss at any moment leaves exactly a prefix of the log that
/// holds every acknowledged entry, and nothing else (200 seeded mixes
/// of appends, truncations, purges, votes and commits, then appends
/// while syncs stall, then lost, kept and torn writes); appending after
/// the recovered tail and losing power again loses nothing synced.
#[tokio::test]
async fn power_loss_keeps_exactly_an_acknowledged_prefix() -> R {
    for seed in 0..200 {
        crash_round(seed).await.map_err(|e| format!("seed {seed}: {e}"))?;
    }
    Ok(())
}

async fn crash_round(seed: u64) -> R {
    let disks = MemDisks::default();
    let env = disks.env();
    let dir = Path::new("/mem/raft");
    let cfg = LogConfig { segment_len: SEGMENT_LEN_MIN, cache_entries_max: 3, ..tiny() };
    let mut rng = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) + 1;
    let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg.clone()).await?;
    let mut model: Vec<Entry> = Vec::new(); // entry i at index i
    let (mut purged, mut committed, mut vote): (Option<LogId>, Option<LogId>, Option<Vote>) =
        (None, None, None);
    let mut term = 1;
    // Committed ids saved since the last synced meta write (a vote, a
    // purge): power loss may bring back any of them.
    let mut saved_committed: Vec<Option<LogId>> = vec![None];
    let batch = |rng: &mut u64, model: &mut Vec<Entry>, term: u64| {
        let n = 1 + splitmix(rng) % 5;
        let start = model.len() as u64;
        let b: Vec<Entry> = (start..start + n)
            .map(|i| {
                let len = match splitmix(rng) % 10 {
                    0 => 0,
                    1 => 20_000, // longer than a segment
                    _ => (splitmix(rng) % 2500) as usize,
                };
                entry(term, i, len)
            })
            .collect();
        model.extend(b.iter().cloned());
        b
    };

    // Phase 1: syncs flow.
    let mut waits = Vec::new();
    for _ in 0..splitmix(&mut rng) % 14 {
        let floor = committed.map_or(0, |c| c.index + 1).max(purged.map_or(0, |p| p.index + 1));
        match splitmix(&mut rng) % 10 {
            0 if (model.len() as u64) > floor => {
                let keep = floor + splitmix(&mut rng) % (model.len() as u64 - floor);
                let last = keep.checked_sub(1).map(|k| model[k as usize].log_id);
                store.truncate_after(last).await?;
                model.truncate(keep as usize);
                term += 1;
            }
            1 if committed.is_some_and(|c| purged.is_none_or(|p| p.index < c.index)) => {
                let (lo, hi) = (purged.map_or(0, |p| p.index + 1), committed.map_or(0, |c| c.index));
                let p = lo + splitmix(&mut rng) % (hi - lo + 1);
                store.purge(model[p as usize].log_id).await?;
                purged = Some(model[p as usize].log_id);
                saved_committed = vec![committed];
            }
            2 if !model.is_empty() => {
                committed = model.last().map(|e| e.log_id);
                store.save_committed(committed).await?;
                saved_committed.push(committed);
            }
            3 => {
                vote = Some(Vote {
                    leader_id: LeaderId { term, node_id: 2 },
                    committed: seed.is_multiple_of(2),
                });
                store.save_vote(vote.as_ref().ok_or("vote")?).await?;
                saved_committed = vec![committed];
            }
            _ => {
                let b = batch(&mut rng, &mut model, term);
                waits.push(append(&mut store, b).await?);
            }
        }
    }
    for w in waits {
        flushed(w).await?;
    }
    let durable = model.len();

    // Phase 2: appends; at some point syncs stop finishing.
    let n = 1 + splitmix(&mut rng) % 6;
    let hold_at = splitmix(&mut rng) % (n + 1);
    let mut pending = Vec::new();
    for i in 0..n {
        if i == hold_at {
            disks.hold_syncs();
        }
        let b = batch(&mut rng, &mut model, term);
        pending.push((append(&mut store, b).await?, model.len()));
        for _ in 0..splitmix(&mut rng) % 3 {
            tokio::task::yield_now().await;
        }
    }
    // Sometimes a commit races the stalled syncs: its meta write must
    // not become durable ahead of the entries it names.
    let committing = model.last().map(|e| Some(e.log_id)).filter(|_| seed.is_multiple_of(2)).map(|c| {
        let mut s = store.clone();
        (c, tokio::spawn(async move { s.save_committed(c).await }))
    });
    disks.hold_syncs();
    for _ in 0..3 {
        tokio::task::yield_now().await;
    }
    // Mostly power loss; sometimes only the process dies, and what
    // recovery then reads unsynced must be made durable by it (the
    // power loss of round 2 would take it otherwise).
    if seed % 4 == 3 {
        disks.kill();
    } else {
        disks.crash(seed);
    }
    drop(store);
    let mut acked = durable;
    for (rx, len) in pending {
        if let Ok(Ok(())) = rx.await {
            acked = acked.max(len);
        }
    }

    // A committed id is written without a sync of its own: power loss
    // may take it back to any value saved since the last synced meta
    // write (never past the durable log).
    let mut may_commit = saved_committed.clone();
    if let Some((c, saving)) = committing {
        match saving.await? {
            Ok(()) => committed = c,
            Err(_) => may_commit.push(c),
        }
    }

    let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg.clone()).await?;
    let start = purged.map_or(0, |p| p.index as usize + 1);
    let got = everything(&mut store).await?;
    let end = start + got.len();
    assert!(
        end <= model.len(),
        "recovered {} entries from {start}, only {} appended",
        got.len(),
        model.len()
    );
    assert!(got[..] == model[start..end], "not a prefix of what was appended");
    assert!(end >= acked, "lost acknowledged entries: recovered up to {end}, {acked} acknowledged");
    assert_eq!(store.get_log_state().await?.last_purged_log_id, purged);
    let c = store.read_committed().await?;
    assert!(c == committed || may_commit.contains(&c), "committed {c:?}");
    assert!(c.is_none_or(|c| (c.index as usize) < end), "committed {c:?} ahead of the log's end {end}");
    committed = c;
    assert_eq!(store.read_vote().await?, vote);

    // Round 2: go on from the recovered tail, durably, as a leader
    // would: first some of the lost entries again, byte for byte (the
    // stale copies the crash kept behind them must not come back),
    // then new ones; then lose power.
    let lost = model.split_off(end);
    let again = (splitmix(&mut rng) % (lost.len() as u64 + 1)) as usize;
    if again > 0 {
        append_durably(&mut store, lost[..again].to_vec()).await?;
        model.extend_from_slice(&lost[..again]);
    }
    term += 1;
    for _ in 0..splitmix(&mut rng) % 3 {
        let b = batch(&mut rng, &mut model, term);
        append_durably(&mut store, b).await?;
    }
    disks.crash(seed + 1);
    drop(store);
    let mut store = LogStore::open(&env, dir, CLUSTER, NODE, cfg).await?;
    assert!(everything(&mut store).await?[..] == model[start..], "lost synced entries after a second crash");
    assert_eq!(store.read_committed().await?, committed);
    Ok(())
}

/// The vote and the committed id survive a restart.
#[tokio::test]
async fn vote_and_committed_survive_restart() -> R {
    let tmp = tempfile::tempdir()?;
    let env = Env::real();
    let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
    assert_eq!((store.read_vote().await?, store.read_committed().await?), (None, None));
    let vote = Vote { leader_id: LeaderId { term: 5, node_id: 3 }, committed: true };
    store.save_vote(&vote).await?;
    append_durably(&mut store, (0..5).map(|i| entry(5, i, 100)).collect()).await?;
    store.save_committed(Some(log_id(5, 1, 3))).await?;
    let mut reader = store.get_log_reader().await;
    assert_eq!(reader.read_vote().await?, Some(vote), "readers see the saved vote");
    drop((store, reader));
    let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
    assert_eq!(store.read_vote().await?, Some(vote));
    assert_eq!(store.read_committed().await?, Some(log_id(5, 1, 3)));
    Ok(())
}

/// A damaged newest meta slot fails its CRC and the other slot counts.
#[tokio::test]
async fn a_damaged_meta_slot_falls_back_to_the_other() -> R {
    let tmp = tempfile::tempdir()?;
    let env = Env::real();
    let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
    let v1 = Vote { leader_id: LeaderId { term: 1, node_id: 2 }, committed: false };
    let v2 = Vote { leader_id: LeaderId { term: 2, node_id: 3 }, committed: false };
    store.save_vote(&v1).await?; // generation 2, slot B
    store.save_vote(&v2).await?; // generation 3, slot A
    drop(store);
    let meta = env.open_disk(&tmp.path().join(META_FILE), None).await?;
    meta.write_at(vec![(30, Bytes::from_static(b"torn!"))]).await?;
    meta.sync().await?;
    let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
    assert_eq!(store.read_vote().await?, Some(v1));
    // The next write goes over the damaged slot, and wins.
    store.save_vote(&v2).await?;
    drop(store);
    let mut store = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?;
    assert_eq!(store.read_vote().await?, Some(v2));
    Ok(())
}

/// Power lost while a vote is being saved leaves the old vote or the
/// new one, never an unreadable meta (both outcomes occur).
#[tokio::test]
async fn power_loss_while_saving_a_vote_keeps_old_or_new() -> R {
    let (mut old, mut new) = (0, 0);
    for seed in 0..24 {
        let disks = MemDisks::default();
        let env = disks.env();
        let dir = Path::new("/mem/raft");
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
        append_durably(&mut store, vec![entry(1, 0, 10)]).await?;
        let v1 = Vote { leader_id: LeaderId { term: 1, node_id: 2 }, committed: true };
        let v2 = Vote { leader_id: LeaderId { term: 2, node_id: 3 }, committed: false };
        store.save_vote(&v1).await?;
        disks.hold_syncs();
        let mut s = store.clone();
        let saving = tokio::spawn(async move { s.save_vote(&v2).await });
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        disks.crash(seed);
        assert!(saving.await?.is_err(), "a vote not synced is not reported saved");
        drop(store);
        let mut store = LogStore::open(&env, dir, CLUSTER, NODE, tiny()).await?;
        match store.read_vote().await? {
            Some(v) if v == v1 => old += 1,
            Some(v) if v == v2 => new += 1,
            other => return Err(format!("seed {seed}: vote {other:?}").into()),
        }
    }
    assert!(old > 0 && new > 0, "old {old} times, new {new} times");
    Ok(())
}

/// Reopening a directory as another cluster or another member fails
/// with an error that says whose it is.
#[tokio::test]
async fn another_members_directory_is_refused() -> R {
    let tmp = tempfile::tempdir()?;
    let env = Env::real();
    drop(LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await?);
    for (cluster, node) in [(CLUSTER + 1, NODE), (CLUSTER, NODE + 1)] {
        match LogStore::open(&env, tmp.path(), cluster, node, tiny()).await {
            Err(e @ LogError::WrongMember { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("belongs to cluster") && !msg.contains('\n'), "{msg}");
            }
            Err(e) => return Err(format!("wrong error: {e}").into()),
            Ok(_) => return Err("opened another member's log".into()),
        }
    }
    assert!(LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.is_ok());
    Ok(())
}

/// Recovery refuses, naming the file, what it cannot trust: a meta with
/// no valid slot or missing beside segments, a segment missing from the
/// middle, a log that ends before its committed id.
#[tokio::test]
async fn recovery_refuses_what_it_cannot_trust() -> R {
    async fn setup(env: &Env, dir: &Path) -> R<Vec<PathBuf>> {
        let mut store = LogStore::open(env, dir, CLUSTER, NODE, tiny()).await?;
        append_durably(&mut store, (0..80).map(|i| entry(1, i, 3000)).collect()).await?;
        store.save_committed(Some(log_id(1, 1, 79))).await?;
        Ok(env.list_disks(dir, SEGMENT_PREFIX).await?)
    }
    let env = Env::real();

    let tmp = tempfile::tempdir()?;
    setup(&env, tmp.path()).await?;
    let meta = env.open_disk(&tmp.path().join(META_FILE), None).await?;
    meta.write_at(vec![
        (20, Bytes::from_static(b"x")),
        (META_SLOT_LEN as u64 + 20, Bytes::from_static(b"x")),
    ])
    .await?;
    let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
    assert!(matches!(e, LogError::MetaUnreadable { .. }) && e.to_string().contains("raft.meta"), "{e}");
    env.remove_disk(&tmp.path().join(META_FILE)).await?;
    let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
    assert!(matches!(e, LogError::MetaMissing { .. }), "{e}");

    let tmp = tempfile::tempdir()?;
    let segs = setup(&env, tmp.path()).await?;
    assert!(segs.len() >= 3);
    env.remove_disk(&segs[1]).await?;
    let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
    assert!(matches!(e, LogError::MissingSegment { ref path, .. } if *path == segs[1]), "{e}");

    let tmp = tempfile::tempdir()?;
    let segs = setup(&env, tmp.path()).await?;
    let last = segs.last().ok_or("no segments")?;
    env.remove_disk(last).await?;
    let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
    assert!(matches!(e, LogError::CommittedLost { .. }), "{e}");

    // A flipped bit in a synced record before the committed id too.
    let tmp = tempfile::tempdir()?;
    let segs = setup(&env, tmp.path()).await?;
    let d = env.open_disk(&segs[1], None).await?;
    d.write_at(vec![(SEGMENT_HEADER_LEN + 60, Bytes::from_static(&[0xff]))]).await?;
    let e = LogStore::open(&env, tmp.path(), CLUSTER, NODE, tiny()).await.err().ok_or("opened")?;
    assert!(matches!(e, LogError::CommittedLost { ref stop, .. } if stop.contains("CRC")), "{e}");
    Ok(())
}
