//! Digests (`Store::digest`): what each chunk holds, as replicas compare
//! it, after writes, trims, cut-off overwrites and damage.

use super::*;

fn digest_reads(s: &Store) -> u64 {
    s.stats.digest_chunks_read.load(Ordering::Relaxed)
}

/// A digest says, per chunk, hole or the digest of the bytes there
/// (whole, partial and trimmed chunks), read from the disk; a tract not
/// held here, or held at another incarnation, digests as nothing.
#[tokio::test]
async fn digest_reports_holes_written_and_trimmed() -> Result<(), StoreError> {
    use ChunkState::{Data, Hole};
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    put(&s, 1, 1, 0, 0, &pattern(1, 8192)).await?;
    put(&s, 1, 1, 0, 5 * 4096 + 100, &pattern(2, 10)).await?;
    put(&s, 1, 1, 0, 0, &pattern(3, 4096)).await?;
    put(&s, 1, 1, 0, 7 * 4096, &pattern(4, 8192)).await?;
    s.trim(BlobId(1), 1, TractNo(0), 8 * 4096, 4096, ALWAYS).await?;
    let b = get(&s, 1, 1, 0, 0, TRACT).await?;
    let mut want = vec![Hole; (TRACT / CHUNK_SIZE) as usize];
    for c in [0, 1, 5, 7] {
        want[c] = Data(chunk_dig(&b, c));
    }
    assert_eq!(s.digest(BlobId(1), 1, TractNo(0)).await?, want);
    // The partial write's chunk: its bytes are zeros around the write.
    let mut c5 = vec![0u8; 4096];
    c5[100..110].copy_from_slice(&pattern(2, 10));
    assert_eq!(want[5], Data(chunk_digest(&c5)));
    assert!(s.digest(BlobId(1), 2, TractNo(0)).await?.is_empty(), "another incarnation");
    assert!(s.digest(BlobId(1), 1, TractNo(1)).await?.is_empty(), "a tract never written");
    assert_eq!(digest_reads(&s), 4, "every written chunk is read: a digest hashes the bytes");
    assert_eq!(s.stats.digests.load(Ordering::Relaxed), 3);
    Ok(())
}

/// An overwrite cut off by a crash (as in
/// `write_cut_off_part_way_reads_old_or_new`) is digested after a
/// reopen as the bytes actually there, old or new, and memory settles to
/// them: a second digest says the same, and a read agrees.
#[tokio::test]
async fn digest_after_a_cut_off_overwrite_reports_the_bytes_there() -> Result<(), StoreError> {
    let old = pattern(1, TRACT as usize);
    let new = pattern(2, TRACT as usize);
    // The overwrite of chunks 0..4 is one batch: its chunk entries,
    // then its data. Cut after the entries: old bytes; after both: new.
    for (keep, want) in [(1, &old), (2, &new)] {
        let dir = tempfile::tempdir()?;
        let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
        let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep });
        let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
        put(&s, 1, 1, 3, 0, &old.slice(0..32768)).await?;
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(put(&s, 1, 1, 3, 0, &new.slice(0..16384)).await.is_err(), "the write was cut off");
        drop(s);
        drop(disk);
        let s = reopen(&dir).await?;
        let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
        // Chunks 0..4 as the cut left them, 4..8 untouched, the rest holes.
        let expect: Vec<ChunkState> = (0..(TRACT / CHUNK_SIZE) as usize)
            .map(|c| match c {
                0..4 => ChunkState::Data(chunk_dig(want, c)),
                4..8 => ChunkState::Data(chunk_dig(&old, c)),
                _ => ChunkState::Hole,
            })
            .collect();
        assert_eq!(d, expect, "keep {keep}");
        assert_eq!(digest_reads(&s), 8, "keep {keep}: every written chunk is read");
        assert_eq!(s.digest(BlobId(1), 1, TractNo(3)).await?, d, "keep {keep}");
        let b = get(&s, 1, 1, 3, 0, TRACT).await?;
        assert_eq!(&b[..16384], &want[..16384], "keep {keep}: a read agrees");
    }
    Ok(())
}

/// After a reopen, a whole-chunk overwrite of a chunk whose previous
/// overwrite was cut off before its data stores the CRC of the bytes
/// really there as its previous CRC: cut off again, the chunk reads old,
/// not `Corrupt` (memory's CRC there was the lost write's).
#[tokio::test]
async fn a_second_cut_off_overwrite_after_reopen_reads_old() -> Result<(), StoreError> {
    let old = pattern(1, 4096);
    let dir = tempfile::tempdir()?;
    let real = Env::real().open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 1 });
    let s = Store::format(disk.clone(), TsId(7), TRACT, &blizzard_env::RealClock).await?;
    put(&s, 1, 1, 3, 0, &old).await?;
    disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(put(&s, 1, 1, 3, 0, &pattern(2, 4096)).await.is_err());
    drop(s);
    drop(disk);
    for round in 0..2 {
        let real = Env::real().open_disk(&dir.path().join("disk"), None).await?;
        let disk = Arc::new(DyingDisk { inner: real, armed: false.into(), keep: 1 });
        let s = Store::open(disk.clone()).await?;
        disk.armed.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(put(&s, 1, 1, 3, 0, &pattern(3 + round, 4096)).await.is_err());
        drop(s);
        drop(disk);
        let s = reopen(&dir).await?;
        assert_eq!(get(&s, 1, 1, 3, 0, 4096).await?, old, "round {round}");
    }
    Ok(())
}

/// A chunk whose bytes match no CRC its entry accepts digests as
/// `Unreadable`: an overwritten chunk damaged while the server was
/// down, and a chunk written once and damaged since (every digest reads
/// the bytes it hashes, so memory never vouches for rot).
#[tokio::test]
async fn a_corrupt_chunk_digests_as_unreadable() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    put(&s, 1, 1, 3, 0, &pattern(9, 16384)).await?;
    put(&s, 1, 1, 3, 4096, &pattern(8, 4096)).await?;
    let at = s.data_location(BlobId(1), TractNo(3)).ok_or(StoreError::Failed)?;
    drop(s);
    let raw = Env::real().open_disk(&dir.path().join("disk"), None).await?;
    for off in [4096 + 7, 3 * 4096 + 7] {
        let b = raw.read_at(at + off, 1).await?;
        raw.write_at(vec![(at + off, Bytes::from(vec![b[0] ^ 0x10]))]).await?;
    }
    raw.sync().await?;
    drop(raw);
    let s = reopen(&dir).await?;
    let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
    assert_eq!(d[1], ChunkState::Unreadable, "the overwritten chunk was read");
    assert_eq!(d[0], ChunkState::Data(chunk_digest(&pattern(9, 16384)[..4096])));
    assert_eq!(d[3], ChunkState::Unreadable, "the chunk written once was read too");
    assert!(matches!(get(&s, 1, 1, 3, 3 * 4096, 4096).await, Err(StoreError::Corrupt { chunk: 3, .. })));
    let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
    assert_eq!((d[1], d[3]), (ChunkState::Unreadable, ChunkState::Unreadable));
    // A whole-chunk write makes it readable again.
    put(&s, 1, 1, 3, 3 * 4096, &pattern(5, 4096)).await?;
    let d = s.digest(BlobId(1), 1, TractNo(3)).await?;
    assert_eq!(d[3], ChunkState::Data(chunk_digest(&pattern(5, 4096))));
    assert_eq!(d[1], ChunkState::Unreadable);
    Ok(())
}

/// A chunk holding a record followed by its own CRC32C has the same CRC32C
/// whatever the record says; its digest tells the records apart, so
/// replicas holding different ones are found to differ (blob-sim seed 1:
/// a replica kept an old volume intent header).
#[tokio::test]
async fn digests_tell_apart_chunks_whose_crcs_agree() -> Result<(), StoreError> {
    let dir = tempfile::tempdir()?;
    let s = fresh(&dir, 16 << 20).await?;
    let record = |writer: u8| {
        let mut b = vec![0u8; 4096];
        b[..7].copy_from_slice(b"header ");
        b[7] = writer;
        let crc = crc32c(&b[..8]);
        b[8..12].copy_from_slice(&crc.to_le_bytes());
        Bytes::from(b)
    };
    let (a, b) = (record(6), record(7));
    assert_eq!(crc32c(&a), crc32c(&b));
    put(&s, 1, 1, 3, 0, &a).await?;
    let da = s.digest(BlobId(1), 1, TractNo(3)).await?;
    put(&s, 1, 1, 3, 0, &b).await?;
    let db = s.digest(BlobId(1), 1, TractNo(3)).await?;
    assert_ne!(da[0], db[0]);
    assert_eq!(db[0], ChunkState::Data(chunk_digest(&b)));
    Ok(())
}
