//! The backup journal's tests (`journal.rs`).

use super::*;
use blizzard_core::crc::piece_crcs;
use blizzard_core::{BlobId, TractNo};
use blizzard_env::Env;

const TRACT: u32 = 8 << 20;
const DISK: u128 = 0xd15c;

fn target(tract: i64, offset: u32) -> Target {
    Target { blob: BlobId(1), incarnation: 2, tract: TractNo(tract), version: 3, offset }
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i / 512) as u8)).collect()
}

async fn disk(dir: &tempfile::TempDir, len: u64) -> Arc<dyn Disk> {
    Env::real().open_disk(&dir.path().join("journal"), Some(len)).await.expect("journal disk")
}

async fn append(j: &BackupJournal, tract: i64, offset: u32, data: &[u8]) -> u64 {
    j.append(&target(tract, offset), &piece_crcs(offset, data), data).await.expect("append")
}

/// What was appended comes back at open, in order, and reads back
/// while live.
#[tokio::test]
async fn appended_records_come_back_at_open() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let d = disk(&dir, 4 << 20).await;
    let j = BackupJournal::format(d.clone(), DISK, 77, TRACT).await?;
    let a = append(&j, 0, 0, &bytes(1, 4096)).await;
    let b = append(&j, 1, 1000, &bytes(2, 10_000)).await;
    let s = j.supersede(&target(0, 0), 2048).await?;
    assert_eq!((a, b, s), (0, 1, 2));
    assert_eq!(&j.read(b, 100, 50).await?[..], &bytes(2, 10_000)[100..150]);
    drop(j);
    let (j, scan) = BackupJournal::open(d, DISK, TRACT).await?;
    let seqs: Vec<u64> = scan.records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![0, 1, 2]);
    assert_eq!(&scan.records[1].data[..], &bytes(2, 10_000)[..]);
    assert_eq!(scan.records[1].target, target(1, 1000));
    assert_eq!((scan.records[2].kind, scan.records[2].len), (Kind::Supersede, 2048));
    assert!(scan.damaged.is_empty());
    // Appends go on after them, and reads of reopened records work.
    assert_eq!(append(&j, 0, 0, &bytes(3, 512)).await, 3);
    assert_eq!(&j.read(1, 0, 10).await?[..], &bytes(2, 10)[..]);
    Ok(())
}

/// Released records are gone at open; the head survives a reopen and
/// a torn head slot.
#[tokio::test]
async fn released_records_stay_released() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let d = disk(&dir, 4 << 20).await;
    let j = BackupJournal::format(d.clone(), DISK, 77, TRACT).await?;
    for i in 0..5u8 {
        append(&j, 0, 0, &bytes(i, 4096)).await;
    }
    j.release(3).await?;
    assert_eq!((j.head_seq(), j.live_records()), (3, 2));
    assert!(matches!(j.read(1, 0, 1).await, Err(JournalError::NoRecord(1))));
    drop(j);
    let (j, scan) = BackupJournal::open(d.clone(), DISK, TRACT).await?;
    assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![3, 4]);
    // The newest head is in slot B (written second); tear it: slot A's
    // older head counts, and replaying from it again is harmless.
    j.release(5).await?;
    drop(j);
    let mut torn = d.read_at(0, HEAD_LEN as usize).await?.to_vec();
    let newest_slot = if Head::decode(&torn).is_some_and(|h| h.seq == 5) { 0 } else { HEAD_LEN };
    torn = d.read_at(newest_slot, HEAD_LEN as usize).await?.to_vec();
    torn[20] ^= 0xff;
    d.write_at(vec![(newest_slot, Bytes::from(torn))]).await?;
    let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
    assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![3, 4]);
    Ok(())
}

/// A full ring says so instead of overwriting live records; releasing
/// gives room back, and the ring wraps (many laps) without losing a
/// record.
#[tokio::test]
async fn the_ring_fills_wraps_and_never_overwrites_live_records() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let d = disk(&dir, RING_START + RING_MIN).await;
    let j = BackupJournal::format(d.clone(), DISK, 9, TRACT).await?;
    let mut appended = Vec::new();
    loop {
        match j.append(&target(0, 0), &piece_crcs(0, &bytes(7, 65536)), &bytes(7, 65536)).await {
            Ok(seq) => appended.push(seq),
            Err(JournalError::Full) => break,
            Err(e) => return Err(e),
        }
    }
    // 64 KiB + a header takes 66,048 bytes: 14 fit in 1 MiB less the
    // room kept for supersede records.
    assert_eq!(appended.len(), 14);
    assert!(j.used() <= j.ring_len());
    // Many laps, releasing all but the newest few each time.
    let mut next = appended.len() as u64;
    for lap in 0..40u64 {
        j.release(next - 3).await?;
        for k in 0..5u8 {
            let data = bytes(lap as u8 ^ k, 4096 * (1 + k as usize));
            let seq = j
                .append(&target(lap as i64, 4096 * k as u32), &piece_crcs(4096 * k as u32, &data), &data)
                .await?;
            assert_eq!(seq, next);
            next += 1;
        }
    }
    let live: Vec<u64> = (next - 8..next).collect();
    drop(j);
    let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
    assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), live);
    let last = &scan.records[7];
    assert_eq!(&last.data[..], &bytes(39 ^ 4, 4096 * 5)[..]);
    Ok(())
}

/// A record never written (a hole: its writer crashed before writing)
/// is skipped and the records after it are found; a torn record is
/// reported as damaged, never replayed.
#[tokio::test]
async fn holes_are_skipped_and_torn_records_reported() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let d = disk(&dir, 4 << 20).await;
    let j = BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
    append(&j, 0, 0, &bytes(1, 4096)).await;
    append(&j, 0, 0, &bytes(2, 4096)).await;
    append(&j, 0, 0, &bytes(3, 8192)).await;
    append(&j, 0, 0, &bytes(4, 4096)).await;
    drop(j);
    let rec = super::super::format::data_record_len(0, 4096);
    // Record 1 never written: zeros over it.
    d.write_at(vec![(RING_START + rec, Bytes::from(vec![0u8; rec as usize]))]).await?;
    // Record 2 torn: its last data sector lost.
    let rec2 = super::super::format::data_record_len(0, 8192);
    let torn_at = RING_START + 2 * rec + rec2 - 512;
    d.write_at(vec![(torn_at, Bytes::from(vec![0u8; 512]))]).await?;
    let (j, scan) = BackupJournal::open(d, DISK, TRACT).await?;
    assert_eq!(scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![0, 3]);
    assert_eq!(scan.damaged.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![2]);
    // New records go after everything found, with higher seqs.
    assert_eq!(append(&j, 0, 0, &bytes(5, 512)).await, 4);
    Ok(())
}

#[tokio::test]
async fn a_journal_opens_only_for_its_own_formatted_disk() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let d = disk(&dir, 4 << 20).await;
    assert!(matches!(BackupJournal::open(d.clone(), DISK, TRACT).await, Err(JournalError::NotFormatted)));
    BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
    match BackupJournal::open(d.clone(), DISK + 1, TRACT).await {
        Err(e @ JournalError::WrongDisk { .. }) => {
            assert!(e.to_string().contains("give the journal made for this disk"))
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    let small = Env::real().open_disk(&dir.path().join("small"), Some(64 << 10)).await?;
    assert!(matches!(BackupJournal::format(small, DISK, 5, TRACT).await, Err(JournalError::TooSmall(_))));
    // A reformat forgets the old records even where their bytes remain.
    let j = BackupJournal::format(d.clone(), DISK, 5, TRACT).await?;
    append(&j, 0, 0, &bytes(1, 4096)).await;
    drop(j);
    BackupJournal::format(d.clone(), DISK, 6, TRACT).await?;
    let (_, scan) = BackupJournal::open(d, DISK, TRACT).await?;
    assert!(scan.records.is_empty());
    Ok(())
}

#[tokio::test]
async fn bad_writes_are_refused() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let j = BackupJournal::format(disk(&dir, 4 << 20).await, DISK, 5, TRACT).await?;
    let big = vec![0u8; RECORD_DATA_MAX as usize + 1];
    assert!(matches!(
        j.append(&target(0, 0), &piece_crcs(0, &big), &big).await,
        Err(JournalError::TooLarge(_))
    ));
    assert!(matches!(j.append(&target(0, 0), &[1, 2], &[0u8; 4096]).await, Err(JournalError::BadWrite)));
    let past = target(0, TRACT - 100);
    assert!(matches!(
        j.append(&past, &piece_crcs(past.offset, &[0u8; 200]), &[0u8; 200]).await,
        Err(JournalError::BadWrite)
    ));
    Ok(())
}

/// The zeros planned ahead of the appends lie only on free space, in whole
/// pages, never across the ring's end, and only when the appends come
/// near what is prepared. Random rings and positions.
#[test]
fn zeros_are_planned_on_free_whole_pages_only() {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_random = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut planned = 0;
    for _ in 0..100_000 {
        let ring = RING_MIN + (next_random() % 64) * RECORD_ALIGN + (next_random() % 3) * PREPARE_WINDOW;
        let head = next_random() % (4 * ring);
        let next = head + next_random() % ring;
        // Zeros never pass the durable head's lap, and the head only moves on.
        let prepared =
            (next.saturating_sub(PREPARE_WINDOW) + next_random() % (2 * PREPARE_WINDOW)).min(head + ring);
        let Some((from, to)) = plan_zeros(prepared, next, head, ring) else {
            assert!(
                prepared >= next + PREPARE_WINDOW / 2 || prepared.max(next) + 2 * PAGE > head + ring,
                "nothing planned: prepared {prepared} next {next} head {head} ring {ring}"
            );
            continue;
        };
        planned += 1;
        assert!(prepared < next + PREPARE_WINDOW / 2);
        assert!(from >= next && from >= prepared, "zeros over reserved space");
        assert!(to > from && to <= head + ring, "zeros into the durable head's lap");
        assert!(to - from <= PREPARE_WINDOW);
        assert_eq!(from / ring, (to - 1) / ring, "across the ring's end");
        assert_eq!((RING_START + from % ring) % PAGE, 0, "starts inside a page");
        let end_in_ring = (to - 1) % ring + 1;
        assert!(end_in_ring == ring || (RING_START + end_in_ring).is_multiple_of(PAGE), "ends inside a page");
    }
    assert!(planned > 10_000, "{planned}");
}

/// Appends lay zeros ahead of themselves over free space (old bytes there
/// become a hole), and many appends in flight at once, over many laps with
/// releases, lose no record to them: every record still live reads back
/// exactly at open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeros_laid_ahead_never_land_on_a_record() -> Result<(), JournalError> {
    let dir = tempfile::tempdir()?;
    let ring = RING_MIN + 3 * PREPARE_WINDOW;
    let d = disk(&dir, RING_START + ring).await;
    let j = BackupJournal::format(d.clone(), DISK, 11, TRACT).await?;
    // Old bytes in the free space ahead.
    d.write_at(vec![(RING_START, Bytes::from(vec![0xabu8; 2 << 20]))]).await?;
    append(&j, 0, 0, &bytes(1, 4096)).await;
    let (prepared, next) = {
        let r = j.lock();
        (r.prepared, r.next_position)
    };
    assert!(prepared >= next + PREPARE_WINDOW / 2, "no zeros laid: prepared {prepared}, next {next}");
    let ahead = d
        .read_at(RING_START + next.next_multiple_of(PAGE), (prepared - next.next_multiple_of(PAGE)) as usize)
        .await?;
    assert!(ahead.iter().all(|b| *b == 0), "the free space ahead still holds old bytes");

    let j = Arc::new(j);
    let mut next_seq = 1u64;
    // About 7 KiB a record: 120 rounds go round the 4 MiB ring five times.
    const ROUNDS: u64 = 120;
    for round in 0..ROUNDS {
        let appends = (0..24u64).map(|k| {
            let j = j.clone();
            let len = 512 * (1 + ((round * 7 + k * 13) % 24) as usize);
            let data = bytes((round * 24 + k) as u8, len);
            async move {
                let seq = j.append(&target(k as i64, 0), &piece_crcs(0, &data), &data).await?;
                Ok::<_, JournalError>((seq, data))
            }
        });
        let done = futures::future::join_all(appends).await;
        let mut written = Vec::new();
        for r in done {
            written.push(r?);
        }
        written.sort_by_key(|(seq, _)| *seq);
        assert_eq!(written.first().map(|w| w.0), Some(next_seq));
        next_seq += written.len() as u64;
        if round == ROUNDS - 1 {
            let laps = j.lock().next_position / ring;
            assert!(laps >= 3, "the appends went round the ring only {laps} times");
            let t = Arc::try_unwrap(j).map_err(|_| JournalError::Failed)?;
            drop(t);
            let (_, scan) = BackupJournal::open(d.clone(), DISK, TRACT).await?;
            assert!(scan.damaged.is_empty());
            let live: Vec<&(u64, Vec<u8>)> = written.iter().collect();
            let found: Vec<u64> = scan.records.iter().map(|r| r.seq).filter(|s| *s >= live[0].0).collect();
            assert_eq!(found, live.iter().map(|w| w.0).collect::<Vec<_>>());
            for r in scan.records.iter().filter(|r| r.seq >= live[0].0) {
                let want = &live[(r.seq - live[0].0) as usize].1;
                assert_eq!(&r.data[..], &want[..], "record {} changed", r.seq);
            }
            return Ok(());
        }
        // Keep this round's records live across the next round's appends.
        j.release(written[0].0).await?;
    }
    unreachable!("the last round returns")
}
