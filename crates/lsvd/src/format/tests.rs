//! Golden bytes, round trips, and every truncation or bit flip of each
//! encoded structure refused without a panic.

use super::*;

fn header() -> ObjectHeader {
    let data = vec![7u8; 5000];
    ObjectHeader {
        kind: ObjectKind::Data,
        uuid: 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10,
        seq: 9,
        epoch: 3,
        writer: 0xfeed,
        journal_seq: 44,
        data_len: 5000,
        extents: vec![
            ObjExtent { vol_offset: 0, len: 4096, obj_offset: Some(0) },
            ObjExtent { vol_offset: 8192, len: 1024, obj_offset: None },
            ObjExtent { vol_offset: 1 << 20, len: 512, obj_offset: Some(4096) },
        ],
        crcs: block_crcs(&data),
    }
}

// The object header's bytes are pinned: a change of layout must be a
// new version, not a silent one.
#[test]
fn object_header_golden_and_round_trip() {
    let h = header();
    let b = h.encode();
    assert_eq!(b.len(), h.encoded_len());
    assert_eq!(&b[..8], b"BLZLSVOB");
    assert_eq!(ObjectHeader::announced_len(&b[..OBJECT_PREFIX_LEN]), Ok(b.len()));
    assert_eq!(ObjectHeader::decode(&b, 1 << 30), Ok(h));
    // The stored CRC digests every other byte.
    let stored = u32::from_le_bytes(b[b.len() - 4..].try_into().expect("4 bytes"));
    assert_eq!(stored, 0x8c0b_dd91, "object header bytes changed");
}

// Every truncation and every single bit flip of an encoded header is
// refused with an error (never a panic, never a wrong header).
#[test]
fn object_header_damage_is_refused() {
    let b = header().encode();
    for n in 0..b.len() {
        assert!(ObjectHeader::decode(&b[..n], 1 << 30).is_err(), "truncated to {n}");
    }
    for i in 0..b.len() * 8 {
        let mut d = b.to_vec();
        d[i / 8] ^= 1 << (i % 8);
        assert!(ObjectHeader::decode(&d, 1 << 30).is_err(), "bit {i} flipped");
    }
    // An extent past the volume's end is refused even with a good CRC.
    assert!(ObjectHeader::decode(&b, 1 << 19).is_err());
}

// Checkpoints round-trip, and damage or lying counts are refused.
#[test]
fn checkpoint_round_trip_and_damage() {
    let c = Checkpoint {
        uuid: 5,
        seq: 12,
        epoch: 2,
        journal_seq: 100,
        size: 1 << 30,
        extents: vec![
            CkptExtent { start: 0, len: 4096, seq: 3, offset: 0 },
            CkptExtent { start: 65536, len: 8192, seq: 12, offset: 512 },
        ],
        objects: vec![
            ObjStat { seq: 3, data_len: 8192, live: 4096 },
            ObjStat { seq: 12, data_len: 9000, live: 8192 },
        ],
    };
    let b = c.encode();
    assert_eq!(Checkpoint::decode(&b), Ok(c.clone()));
    let stored = u32::from_le_bytes(b[b.len() - 4..].try_into().expect("4 bytes"));
    assert_eq!(stored, 0x8d58_54c4, "checkpoint bytes changed");
    for n in 0..b.len() {
        assert!(Checkpoint::decode(&b[..n]).is_err());
    }
    for i in 0..b.len() * 8 {
        let mut d = b.to_vec();
        d[i / 8] ^= 1 << (i % 8);
        assert!(Checkpoint::decode(&d).is_err(), "bit {i}");
    }
}

/// The CRC of the version-1 descriptor above (pinned: volumes created
/// before clones existed must decode unchanged).
const DESCRIPTOR_V1_CRC: u32 = 0x3e4c_b7b1;

// The descriptor and journal structures round-trip and refuse damage.
#[test]
fn descriptor_and_journal_structures() {
    let d = Descriptor {
        uuid: 77,
        name: "disk".into(),
        size: 1 << 30,
        object_bytes: 8 << 20,
        created_secs: 1,
        base: Vec::new(),
        gc_live_pct: None,
    };
    let b = d.encode();
    assert_eq!(Descriptor::decode(&b), Ok(d.clone()));
    let stored = u32::from_le_bytes(b[b.len() - 4..].try_into().expect("4 bytes"));
    assert_eq!(stored, DESCRIPTOR_V1_CRC, "a volume without a chain must keep version 1's bytes");
    for i in 0..b.len() * 8 {
        let mut x = b.to_vec();
        x[i / 8] ^= 1 << (i % 8);
        assert!(Descriptor::decode(&x).is_err());
    }
    // A clone's chain (version 2): round trip, truncation and damage.
    let c = Descriptor {
        base: vec![
            BaseRef { prefix: "vols/a".into(), uuid: 9, upto: 10, snapshot: "s1".into() },
            BaseRef { prefix: "vols/b".into(), uuid: 10, upto: 25, snapshot: "s-2".into() },
        ],
        ..d
    };
    let b = c.encode();
    assert_eq!(Descriptor::decode(&b), Ok(c.clone()));
    assert_eq!(c.base_upto(), 25);
    // A threshold alone is version 2 too; out of range is refused.
    let t = Descriptor { base: Vec::new(), gc_live_pct: Some(50), ..c.clone() };
    assert_eq!(Descriptor::decode(&t.encode()), Ok(t.clone()));
    assert!(Descriptor { gc_live_pct: Some(99), ..t.clone() }.validate().is_err());
    for n in 0..b.len() {
        assert!(Descriptor::decode(&b[..n]).is_err());
    }
    for i in 0..b.len() * 8 {
        let mut x = b.to_vec();
        x[i / 8] ^= 1 << (i % 8);
        assert!(Descriptor::decode(&x).is_err(), "bit {i}");
    }
    // Snapshots and clone references likewise.
    let s = SnapshotRecord { uuid: 77, name: "before-upgrade".into(), seq: 42, created_secs: 3 };
    let b = s.encode();
    assert_eq!(SnapshotRecord::decode(&b), Ok(s));
    for i in 0..b.len() * 8 {
        let mut x = b.to_vec();
        x[i / 8] ^= 1 << (i % 8);
        assert!(SnapshotRecord::decode(&x).is_err());
    }
    let k = CloneRef { uuid: 78, prefix: "vols/c".into(), name: "c".into() };
    let b = k.encode();
    assert_eq!(CloneRef::decode(&b), Ok(k));
    for i in 0..b.len() * 8 {
        let mut x = b.to_vec();
        x[i / 8] ^= 1 << (i % 8);
        assert!(CloneRef::decode(&x).is_err());
    }
    for bad in ["", ".x", "a/b", "a@b", "a b", &"x".repeat(129)] {
        assert!(check_snapshot_name(bad).is_err(), "{bad:?}");
    }
    assert!(check_snapshot_name("nightly-2026.11.28_a").is_ok());
    let h =
        JournalHeader { generation: 4, uuid: 77, area_len: 1 << 20, tail_pos: 4096, tail_seq: 10, epoch: 3 };
    let b = h.encode();
    assert_eq!(JournalHeader::decode(&b), Ok(h));
    for i in 0..b.len() * 8 {
        let mut x = b.to_vec();
        x[i / 8] ^= 1 << (i % 8);
        assert!(JournalHeader::decode(&x).is_err());
    }
    let data = vec![3u8; 1024];
    let r = RecordHeader::encode(RecordKind::Write, 11, 3, 4096, 1024, &data);
    assert_eq!(r.len(), RECORD_HEADER_LEN as usize);
    let got = RecordHeader::decode(&r, 1 << 20).expect("decodes");
    assert_eq!((got.seq, got.epoch, got.vol_offset, got.len, got.total_len()), (11, 3, 4096, 1024, 1536));
    assert!(got.check_data(&data).is_ok());
    let mut torn = data.clone();
    torn[1000] ^= 1;
    assert!(got.check_data(&torn).is_err());
}
