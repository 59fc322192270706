use super::*;

/// The dispatcher's future, boxed for every request, stays small, and
/// so does a write's, the largest branch left inline: a large future
/// awaited inline would make every request copy its size (`handle`'s
/// doc).
#[tokio::test]
async fn a_request_future_stays_small() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let env = Env::real();
    let disk = env.open_disk(&dir.path().join("disk"), Some(16 << 20)).await?;
    let store = Arc::new(Store::format(disk, TsId(7), 64 << 10, &blizzard_env::RealClock).await?);
    let meta = Arc::new(blizzard_rpc::MetaService::new(&env, vec!["127.0.0.1:1".to_string()]));
    let rows = RowIndex::new(TsId(7), Assignment::default());
    let service = Arc::new(TractService::new(env, store, meta, rows, Duration::from_secs(1), 0, 0));
    let handle = service.clone().handle(Request::Ping, Bytes::new(), Caller::internal());
    let size = std::mem::size_of_val(&handle);
    assert!(size <= 4 << 10, "TractService::handle's future is {size} bytes: box the branch that grew it");
    let addr = TractAddr { blob: BlobId(1), incarnation: 1, tract: TractNo(0), row_version: 1, writer: 0 };
    let caller = Caller::internal();
    let write = service.write_tract(&addr, 0, &[], Bytes::new(), Durability::Synced, &caller);
    let size = std::mem::size_of_val(&write);
    assert!(size <= 3 << 10, "a write's future is {size} bytes: box the rare path that grew it");
    Ok(())
}

fn write(len: u32) -> BatchedWrite {
    let addr = TractAddr { blob: BlobId(1), incarnation: 1, tract: TractNo(0), row_version: 1, writer: 0 };
    BatchedWrite { addr, offset: 0, len, crcs: vec![] }
}

/// A batch's data is cut into its writes without copying; a batch
/// whose lengths do not add up, or with too many writes, is refused
/// whole.
#[test]
fn a_batch_splits_into_its_writes_or_is_refused_whole() {
    let data = Bytes::from((0..30u8).collect::<Vec<_>>());
    let parts = split_batch(&[write(10), write(0), write(20)], &data).expect("well-formed");
    assert_eq!(parts.iter().map(Bytes::len).collect::<Vec<_>>(), [10, 0, 20]);
    assert_eq!(parts[2][0], 10);
    assert_eq!(parts[2].as_ptr(), data[10..].as_ptr(), "copied");
    for bad in [vec![write(10), write(19)], vec![write(10), write(21)], vec![write(u32::MAX), write(31)]] {
        let e = split_batch(&bad, &data).expect_err("lengths do not add up");
        assert_eq!(e.code, ErrorCode::BadRequest);
    }
    let many = vec![write(0); WRITE_BATCH_MAX + 1];
    assert_eq!(split_batch(&many, &Bytes::new()).expect_err("too many").code, ErrorCode::BadRequest);
    assert!(split_batch(&[], &Bytes::new()).expect("empty").is_empty());
}
