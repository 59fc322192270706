use super::*;
use blizzard_core::tlt::{Pending, TltMember, TltRow};
use blizzard_core::TsId;
use proptest::prelude::*;

fn addr() -> TractAddr {
    TractAddr { blob: BlobId(0x11), incarnation: 2, tract: TractNo(3), row_version: 4, writer: 5 }
}

/// A write request's meta bytes are pinned: changing them is a protocol change.
#[test]
fn write_tract_golden_bytes() {
    let req = Request::WriteTract { addr: addr(), offset: 4096, crcs: vec![0xaabbccdd] };
    let b = req.encode();
    let mut want = vec![0x11];
    want.extend_from_slice(&[0; 15]);
    want.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[4, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[5, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0, 0x10, 0, 0]);
    want.extend_from_slice(&[1, 0, 0, 0, 0xdd, 0xcc, 0xbb, 0xaa]);
    assert_eq!(&b[..], &want[..]);
    assert_eq!(Request::decode(Opcode::WriteTract, &b), Ok(req));
}

pub(crate) fn samples() -> Vec<Request> {
    let meta = BlobMeta { blob: BlobId(9), incarnation: 1, replication: 3, size_tracts: 10, version: 2 };
    let assignment = Assignment {
        cluster_id: 5,
        tract_size: 8 << 20,
        replication: 3,
        tlt_len: 28,
        tlt_version: 7,
        rows: vec![AssignedRow {
            row: 3,
            version: 2,
            members: vec![TsId(1), TsId(2), TsId(3)],
            filling: vec![TsId(3), TsId(4)],
            pending: vec![PendingMember { column: 1, id: TsId(4) }],
        }],
        sections: Vec::new(),
    };
    vec![
        Request::Ping,
        Request::Hello { session: 0x1234_5678, epoch: 3 },
        Request::WriteTract { addr: addr(), offset: 1, crcs: vec![1, 2] },
        Request::ReadTract { addr: addr(), offset: 7, len: 100 },
        Request::DeleteTract { addr: addr() },
        Request::TrimTract { addr: addr(), offset: 4096, len: 8192 },
        Request::MappedTract { addr: addr() },
        Request::DigestTract { addr: TractAddr { writer: u64::MAX, ..addr() } },
        Request::WriteTractCached { addr: addr(), offset: 8192, crcs: vec![1, 2] },
        Request::WriteTractForward {
            addr: addr(),
            offset: 4096,
            crcs: vec![3],
            to: vec![Onward { addr: "b:1".into(), epoch: 4 }, Onward { addr: "c:1".into(), epoch: 1 }],
            on_behalf: None,
        },
        Request::WriteTractForward {
            addr: addr(),
            offset: 0,
            crcs: vec![],
            to: vec![],
            on_behalf: Some(OnBehalf { session: 7, epoch: 2 }),
        },
        Request::WriteTracts {
            cached: false,
            writes: vec![
                BatchedWrite { addr: addr(), offset: 0, len: 4096, crcs: vec![9] },
                BatchedWrite {
                    addr: TractAddr { tract: TractNo(3), ..addr() },
                    offset: 8192,
                    len: 10,
                    crcs: vec![1],
                },
            ],
        },
        Request::WriteTracts { cached: true, writes: vec![] },
        Request::SyncDisk,
        Request::ListRowTracts { row: 4, row_version: 5, after: None },
        Request::ListRowTracts {
            row: 4,
            row_version: 5,
            after: Some(RowTract { blob: BlobId(6), tract: TractNo::META }),
        },
        Request::CopyTract { row: 4, row_version: 5, tract: RowTract { blob: BlobId(6), tract: TractNo(7) } },
        Request::CopyTractChanges {
            row: 4,
            row_version: 5,
            tract: RowTract { blob: BlobId(6), tract: TractNo(7) },
            incarnation: 8,
            have: vec![ChunkState::Hole, ChunkState::Data(9), ChunkState::Unreadable],
        },
        Request::ListBlobs,
        Request::CreateBlob { blob: BlobId(1), row_version: 2, incarnation: 3, replication: 1 },
        Request::ExtendBlob { blob: BlobId(1), row_version: 2, mode: ExtendMode::To, tracts: 5 },
        Request::DeleteBlob { blob: BlobId(1), row_version: 2 },
        Request::GetBlob { blob: BlobId(1), row_version: 2 },
        Request::MetaPrepare {
            blob: BlobId(1),
            row_version: 2,
            txn: 3,
            expected_version: 4,
            new: Some(meta),
        },
        Request::MetaPrepare { blob: BlobId(1), row_version: 2, txn: 3, expected_version: 4, new: None },
        Request::MetaCommit { blob: BlobId(1), row_version: 2, txn: 3 },
        Request::MetaAbort { blob: BlobId(1), row_version: 2, txn: 3 },
        Request::AssignRows { assignment: assignment.clone() },
        Request::Heartbeat(Heartbeat {
            ts_id: TsId(77),
            addr: "127.0.0.1:1".into(),
            domain: "rack1".into(),
            tract_size: 4096,
            slots_total: 10,
            slots_used: 3,
            load: 1,
            disk_mbps: 100,
            assignment: Some(assignment),
            filled: vec![RowRef { row: 3, version: 2 }],
            fill: FillProgress { rows: 1, tracts_total: 2, tracts_done: 1, bytes_done: 4096 },
            class: blizzard_core::DiskClass::Hdd,
            journal_used: 4608,
            journal_bytes: 1 << 30,
        }),
        Request::GetTlt { have_version: 3 },
        Request::ClusterStatus,
        Request::ClusterParams,
        Request::AcquireVolume { blob: BlobId(9), holder: "h:1/2".into(), ttl_ms: 10_000, take_over: true },
        Request::RenewVolume { blob: BlobId(9), holder: "h:1/2".into(), token: 4, ttl_ms: 10_000 },
        Request::ReleaseVolume { blob: BlobId(9), token: 4 },
        Request::SetVolumeAccess {
            blob: BlobId(9),
            name: "db".into(),
            entries: vec![
                crate::scope::ScopeEntry { identity: "vm1".into(), read_only: false },
                crate::scope::ScopeEntry { identity: "vm2".into(), read_only: true },
            ],
        },
        Request::DropVolume { blob: BlobId(9) },
        Request::Revoke { serial: "01ab".into(), name: "vm2".into() },
        Request::GetScope { have_version: 5 },
        Request::AttachReader { blob: BlobId(9) },
    ]
}

/// Every request kind survives an encode/decode round trip.
#[test]
fn requests_round_trip() {
    for req in samples() {
        let b = req.encode();
        assert_eq!(Request::decode(req.opcode(), &b), Ok(req));
    }
}

/// Every proper prefix of every request is rejected without a panic.
#[test]
fn truncated_requests_are_rejected() {
    for req in samples() {
        let b = req.encode();
        for n in 0..b.len() {
            assert!(Request::decode(req.opcode(), &b[..n]).is_err(), "{req:?} prefix {n} accepted");
        }
    }
}

#[test]
fn responses_round_trip() {
    let tlt = Tlt {
        cluster_id: 1,
        tract_size: 4096,
        replication: 1,
        version: 2,
        members: vec![
            TltMember { id: TsId(1), addr: "a:1".into(), domain: "d".into() },
            TltMember { id: TsId(2), addr: "b:1".into(), domain: "e".into() },
        ],
        rows: vec![TltRow { version: 1, members: vec![0], pending: vec![Pending { column: 0, member: 1 }] }],
        sections: Vec::new(),
    };
    let cases = vec![
        (Opcode::Ping, Ok(Reply::Done)),
        (Opcode::ReadTract, Ok(Reply::Read { crcs: vec![1, 2, 3] })),
        (Opcode::MappedTract, Ok(Reply::Mapped { bitmap: vec![0b1010_0001, 0, 0xff] })),
        (Opcode::WriteTractCached, Ok(Reply::Boot { boot: 0x0123_4567_89ab_cdef })),
        (Opcode::WriteTracts, Ok(Reply::Batch { boot: 3, failed: vec![] })),
        (
            Opcode::WriteTracts,
            Ok(Reply::Batch {
                boot: 4,
                failed: vec![BatchFailure {
                    index: 2,
                    error: ErrorReply {
                        code: ErrorCode::StaleVersion,
                        current_version: 9,
                        message: "row".into(),
                    },
                }],
            }),
        ),
        (Opcode::DigestTract, Ok(Reply::Digest { chunks: vec![] })),
        (
            Opcode::DigestTract,
            Ok(Reply::Digest {
                chunks: vec![
                    ChunkState::Hole,
                    ChunkState::Data(0xdead_beef),
                    ChunkState::Unreadable,
                    ChunkState::Data(0),
                ],
            }),
        ),
        (Opcode::DigestTract, Ok(Reply::Digest { chunks: vec![ChunkState::Data(7); DIGEST_CHUNKS_MAX] })),
        (
            Opcode::WriteTract,
            Err(ErrorReply { code: ErrorCode::Fenced, current_version: 6, message: "fenced".into() }),
        ),
        (Opcode::SyncDisk, Ok(Reply::Boot { boot: 7 })),
        (
            Opcode::ListRowTracts,
            Ok(Reply::RowTracts {
                tracts: vec![RowTract { blob: BlobId(1), tract: TractNo(2) }],
                more: true,
            }),
        ),
        (Opcode::CopyTract, Ok(Reply::TractCopy { incarnation: 3, bitmap: vec![0b101], crcs: vec![8, 9] })),
        (
            Opcode::CopyTractChanges,
            Ok(Reply::TractChanges { incarnation: 3, bitmap: vec![0b100], crcs: vec![8], holes: vec![0b1] }),
        ),
        (Opcode::GetTlt, Ok(Reply::Tlt(Some(tlt)))),
        (Opcode::GetTlt, Ok(Reply::Tlt(None))),
        (
            Opcode::AcquireVolume,
            Ok(Reply::VolumeLease(VolumeLease {
                status: LeaseStatus::Held,
                blob: BlobId(9),
                holder: "host:12/ab".into(),
                token: 0,
                remaining_ms: 7_000,
            })),
        ),
        (Opcode::ReleaseVolume, Ok(Reply::Done)),
        (
            Opcode::WriteTract,
            Err(ErrorReply { code: ErrorCode::StaleVersion, current_version: 9, message: "stale".into() }),
        ),
    ];
    for (op, res) in cases {
        let b = encode_response(&res);
        assert_eq!(decode_response(op, &b), Ok(res));
    }
}

/// A digest's bytes are pinned (tag byte, CRC after a data tag), and
/// every proper prefix of one is refused.
#[test]
fn digest_golden_bytes() {
    let res = Ok(Reply::Digest {
        chunks: vec![ChunkState::Hole, ChunkState::Data(0x0807_0605_0403_0201), ChunkState::Unreadable],
    });
    let b = encode_response(&res);
    assert_eq!(&b[..], &[0, 0, 3, 0, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 2][..]);
    assert_eq!(decode_response(Opcode::DigestTract, &b), Ok(res));
    for n in 0..b.len() {
        assert!(decode_response(Opcode::DigestTract, &b[..n]).is_err(), "prefix {n} accepted");
    }
}

/// A digest longer than the largest tract has chunks, or with an
/// unknown tag, is refused (before allocating for the count).
#[test]
fn bad_digests_are_refused() {
    let mut too_long = vec![0u8, 0];
    too_long.extend_from_slice(&(DIGEST_CHUNKS_MAX as u32 + 1).to_le_bytes());
    too_long.resize(too_long.len() + DIGEST_CHUNKS_MAX + 1, 0);
    assert_eq!(
        decode_response(Opcode::DigestTract, &too_long),
        Err(DecodeError::BadValue { field: "digest chunks", value: DIGEST_CHUNKS_MAX as u64 + 1 })
    );
    let mut huge = vec![0u8, 0];
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(decode_response(Opcode::DigestTract, &huge).is_err());
    let lying = [0u8, 0, 5, 0, 0, 0, 0, 0];
    assert!(matches!(
        decode_response(Opcode::DigestTract, &lying),
        Err(DecodeError::ListTooLong { count: 5, left: 2 })
    ));
    let unknown_tag = [0u8, 0, 2, 0, 0, 0, 0, 3];
    assert_eq!(
        decode_response(Opcode::DigestTract, &unknown_tag),
        Err(DecodeError::BadValue { field: "chunk state", value: 3 })
    );
}

/// `Fenced` decodes from its number and is not retried as transient.
#[test]
fn fenced_is_known_and_not_transient() {
    assert_eq!(ErrorCode::from_u16(19), Some(ErrorCode::Fenced));
    assert!(!ErrorCode::Fenced.is_transient());
}

fn any_chunk_state() -> impl Strategy<Value = ChunkState> {
    prop_oneof![Just(ChunkState::Hole), any::<u64>().prop_map(ChunkState::Data), Just(ChunkState::Unreadable)]
}

proptest! {
    /// Any digest survives an encode/decode round trip.
    #[test]
    fn digests_round_trip(chunks in proptest::collection::vec(any_chunk_state(), 0..300)) {
        let res = Ok(Reply::Digest { chunks });
        let b = encode_response(&res);
        prop_assert_eq!(decode_response(Opcode::DigestTract, &b), Ok(res));
    }

    /// Arbitrary bytes never make any decoder panic.
    #[test]
    fn garbage_never_panics(op in 0usize..Opcode::ALL.len(), bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let op = Opcode::ALL[op];
        let _ = Request::decode(op, &bytes);
        let _ = decode_response(op, &bytes);
    }
}

/// A table or assignment without sections is encoded exactly as before
/// sections existed (what tractservers and metadata replicas stored then
/// still decodes); with sections it round trips, and a bad placement or a
/// cut-off section list is refused.
#[test]
fn sections_keep_the_old_encoding_when_absent() {
    use crate::codec::{decode, encode, Wire, Writer};
    use blizzard_core::{Placement, Tlt, TltSection};
    let mut tlt = Tlt {
        cluster_id: 9,
        tract_size: 4096,
        replication: 2,
        version: 3,
        members: vec![
            TltMember { id: TsId(1), addr: "a:1".into(), domain: "d".into() },
            TltMember { id: TsId(2), addr: "b:1".into(), domain: "e".into() },
        ],
        rows: vec![TltRow::new(1, vec![0, 1]), TltRow::new(1, vec![1, 0])],
        sections: Vec::new(),
    };
    // The old layout, field by field.
    let mut w = Writer::new();
    tlt.cluster_id.put(&mut w);
    tlt.tract_size.put(&mut w);
    tlt.replication.put(&mut w);
    tlt.version.put(&mut w);
    tlt.members.put(&mut w);
    tlt.rows.put(&mut w);
    let old = w.buf.freeze();
    assert_eq!(encode(&tlt), old);
    assert_eq!(decode::<Tlt>(&old), Ok(tlt.clone()));
    tlt.sections = vec![
        TltSection { placement: Placement::Any, start: 0, len: 1 },
        TltSection { placement: Placement::Hybrid, start: 1, len: 1 },
    ];
    let new = encode(&tlt);
    assert_eq!(decode::<Tlt>(&new), Ok(tlt.clone()));
    assert!(decode::<Tlt>(&new[..new.len() - 1]).is_err(), "a cut-off section list");
    let mut bad = new.to_vec();
    let at = bad.len() - 9; // the last section's placement byte
    bad[at] = 9;
    assert!(decode::<Tlt>(&bad).is_err(), "an unknown placement");

    let mut a = Assignment {
        cluster_id: 9,
        tract_size: 4096,
        replication: 2,
        tlt_len: 2,
        tlt_version: 3,
        rows: Vec::new(),
        sections: Vec::new(),
    };
    let plain = encode(&a);
    assert_eq!(plain.len(), 16 + 4 + 1 + 4 + 8 + 4, "the old layout");
    a.sections = tlt.sections.clone();
    assert_eq!(decode::<Assignment>(&encode(&a)), Ok(a.clone()));
    assert_eq!(a.locate(Placement::Hybrid.place(BlobId(5)), TractNo(0)), Some(1));
    assert_eq!(a.locate(BlobId(5), TractNo(0)), Some(0));
}

/// A forwarded write names at most `FORWARD_TO_MAX` servers.
#[test]
fn too_many_forward_addresses_are_refused() {
    let to = vec![Onward { addr: "a:1".into(), epoch: 1 }; FORWARD_TO_MAX + 1];
    let req = Request::WriteTractForward { addr: addr(), offset: 0, crcs: vec![], to, on_behalf: None };
    assert!(Request::decode(Opcode::WriteTractForward, &req.encode()).is_err());
}

/// A batch holds at most `WRITE_BATCH_MAX` writes, and its reply at most
/// as many failures; the largest of each decodes.
#[test]
fn batches_are_bounded() {
    let one = BatchedWrite { addr: addr(), offset: 0, len: 4096, crcs: vec![7] };
    for (n, ok) in [(WRITE_BATCH_MAX, true), (WRITE_BATCH_MAX + 1, false)] {
        let req = Request::WriteTracts { cached: false, writes: vec![one.clone(); n] };
        assert_eq!(Request::decode(Opcode::WriteTracts, &req.encode()).is_ok(), ok, "{n} writes");
        let failure = BatchFailure { index: 1, error: ErrorReply::new(ErrorCode::Fenced, "x") };
        let reply = Ok(Reply::Batch { boot: 1, failed: vec![failure; n] });
        assert_eq!(
            decode_response(Opcode::WriteTracts, &encode_response(&reply)).is_ok(),
            ok,
            "{n} failures"
        );
    }
}
