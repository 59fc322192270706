//! The operations' tests (`ops.rs`).

use super::arb::*;
use super::*;
use proptest::prelude::*;

/// Checks that `decode` gives back `v` from its encoding, that every
/// proper prefix and the encoding plus a stray byte are refused, and
/// that decoded `bytes` fields are slices of the buffer (no copy).
fn round_trip<T: PartialEq + std::fmt::Debug>(
    v: &T,
    encoded: Bytes,
    decode: impl Fn(&Bytes) -> Result<T, DecodeError>,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(&decode(&encoded)?, v);
    for cut in 0..encoded.len() {
        prop_assert!(decode(&encoded.slice(..cut)).is_err(), "prefix of {} bytes decoded", cut);
    }
    for stray in [0u8, 1, 0xff] {
        let mut longer = encoded.to_vec();
        longer.push(stray);
        prop_assert_eq!(decode(&Bytes::from(longer)), Err(DecodeError::Trailing(1)));
    }
    Ok(())
}

proptest! {
    /// Every update survives encode/decode; truncations and stray bytes are refused.
    #[test]
    fn updates_round_trip(op in update()) {
        prop_assert_eq!(op.check(), Ok(()));
        round_trip(&op, op.encode(), Update::decode)?;
    }

    /// Every query survives encode/decode; truncations and stray bytes are refused.
    #[test]
    fn queries_round_trip(q in query()) {
        prop_assert_eq!(q.check(), Ok(()));
        round_trip(&q, q.encode(), Query::decode)?;
    }

    /// Every update reply survives encode/decode; truncations and stray bytes are refused.
    #[test]
    fn update_replies_round_trip(r in update_reply()) {
        round_trip(&r, r.encode(), UpdateReply::decode)?;
    }

    /// Every query reply survives encode/decode; truncations and stray bytes are refused.
    #[test]
    fn query_replies_round_trip(r in query_reply()) {
        round_trip(&r, r.encode(), QueryReply::decode)?;
    }

    /// Arbitrary bytes never make a decoder panic, and whatever decodes re-encodes to the same bytes.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64), tag in any::<u8>()) {
        let mut b = vec![tag];
        b.extend_from_slice(&bytes);
        let b = Bytes::from(b);
        if let Ok(op) = Update::decode(&b) { prop_assert_eq!(op.encode(), b.clone()); }
        if let Ok(q) = Query::decode(&b) { prop_assert_eq!(q.encode(), b.clone()); }
        if let Ok(r) = UpdateReply::decode(&b) { prop_assert_eq!(r.encode(), b.clone()); }
        if let Ok(r) = QueryReply::decode(&b) { prop_assert_eq!(r.encode(), b.clone()); }
    }

    /// A flipped byte in a valid encoding never makes a decoder panic.
    #[test]
    fn damaged_updates_never_panic(op in update(), at in any::<prop::sample::Index>(), x in 1u8..=255) {
        let mut b = op.encode().to_vec();
        let i = at.index(b.len());
        b[i] ^= x;
        let b = Bytes::from(b);
        if let Ok(op) = Update::decode(&b) { prop_assert_eq!(op.check(), Ok(())); }
    }
}

/// Inputs one byte over a bound are refused by `check` and by the decoder alike; at the bound they pass.
#[test]
fn oversized_fields_are_refused() {
    let big = |n: usize| Bytes::from(vec![7u8; n]);
    let cases = [
        (Update::Put { key: big(KEY_LEN_MAX), value: big(VALUE_LEN_MAX) }, true),
        (Update::Put { key: big(KEY_LEN_MAX + 1), value: big(1) }, false),
        (Update::Put { key: big(1), value: big(VALUE_LEN_MAX + 1) }, false),
        (Update::CompareAndSwap { key: big(1), expected: Some(big(VALUE_LEN_MAX + 1)), new: None }, false),
        (Update::CompareAndSwap { key: big(1), expected: None, new: Some(big(VALUE_LEN_MAX + 1)) }, false),
        (Update::Push { queue: big(QUEUE_NAME_LEN_MAX), priority: 0, value: big(0) }, true),
        (Update::Push { queue: big(QUEUE_NAME_LEN_MAX + 1), priority: 0, value: big(0) }, false),
        (Update::PopMany { queue: big(1), n: 0 }, false),
        (Update::PopMany { queue: big(1), n: ITEMS_MAX }, true),
        (Update::PopMany { queue: big(1), n: ITEMS_MAX + 1 }, false),
        (Update::AddVertex { v: 1, attrs: big(ATTRS_LEN_MAX + 1) }, false),
        (Update::AddEdge { u: 1, v: 2, attrs: big(ATTRS_LEN_MAX) }, true),
        (Update::AddEdge { u: 1, v: 2, attrs: big(ATTRS_LEN_MAX + 1) }, false),
        (Update::AddEdge { u: 3, v: 3, attrs: big(0) }, false),
        (Update::RemoveEdge { u: 3, v: 3 }, false),
    ];
    for (op, ok) in cases {
        assert_eq!(op.check().is_ok(), ok, "{:?}", op.tag());
        assert_eq!(Update::decode(&op.encode()).is_ok(), ok, "{:?}", op.tag());
    }
    let queries = [
        (Query::Get { key: big(KEY_LEN_MAX + 1) }, false),
        (Query::Range { start: big(0), end: Some(big(KEY_LEN_MAX + 1)), limit: 1 }, false),
        (Query::Range { start: big(0), end: None, limit: 0 }, false),
        (Query::Range { start: big(0), end: None, limit: RANGE_LIMIT_MAX + 1 }, false),
        (Query::Peek { queue: big(1), n: ITEMS_MAX + 1 }, false),
        (Query::Neighbors { v: 1, start: 0, limit: NEIGHBORS_LIMIT_MAX + 1 }, false),
        (Query::Neighbors { v: 1, start: 0, limit: NEIGHBORS_LIMIT_MAX }, true),
    ];
    for (q, ok) in queries {
        assert_eq!(q.check().is_ok(), ok, "{:?}", q.tag());
        assert_eq!(Query::decode(&q.encode()).is_ok(), ok, "{:?}", q.tag());
    }
}

/// A huge list count in a reply is refused before anything is allocated for it.
#[test]
fn huge_reply_counts_are_refused() {
    let mut b = vec![RANGE];
    b.extend_from_slice(&RANGE_LIMIT_MAX.to_le_bytes());
    assert!(matches!(QueryReply::decode(&Bytes::from(b)), Err(DecodeError::ListTooLong { .. })));
    let mut b = vec![PEEK];
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(QueryReply::decode(&Bytes::from(b)), Err(DecodeError::BadValue { .. })));
}

/// Decoded values are slices of the message buffer, not copies.
#[test]
fn decoded_values_share_the_buffer() {
    let op = Update::Put { key: Bytes::from_static(b"k"), value: Bytes::from(vec![5u8; 100]) };
    let bytes = op.encode();
    let Ok(Update::Put { value, .. }) = Update::decode(&bytes) else { panic!("decodes") };
    let inside = bytes.as_ptr_range();
    assert!(inside.contains(&value.as_ptr()));
}

/// A reply of one kind is refused by another kind's typed decoder and by the wrong request.
#[test]
fn replies_are_typed() {
    let r = UpdateReply::Delete(true).encode();
    assert_eq!(decode_delete_reply(&r), Ok(true));
    assert!(decode_put_reply(&r).is_err());
    assert!(decode_push_reply(&r).is_err());
    assert!(Update::Pop { queue: Bytes::new() }.decode_reply(&r).is_err());
    assert!(QueryReply::decode(&r).is_err(), "update and query tags are disjoint");
    assert_eq!(decode_push_reply(&UpdateReply::Push.encode()), Ok(()));
}

/// The wire bytes of a few messages are pinned: a change to a layout must come with a new tag.
#[test]
fn golden_encodings() {
    let put = Update::Put { key: Bytes::from_static(b"k"), value: Bytes::from_static(b"vv") };
    assert_eq!(&put.encode()[..], &[0x01, 1, 0, 0, 0, b'k', 2, 0, 0, 0, b'v', b'v']);
    let push = Update::Push { queue: Bytes::from_static(b"q"), priority: -2, value: Bytes::new() };
    assert_eq!(
        &push.encode()[..],
        &[0x10, 1, 0, 0, 0, b'q', 0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]
    );
    let edge = Update::AddEdge { u: 1, v: 2, attrs: Bytes::new() };
    assert_eq!(&edge.encode()[..], &[0x22, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let range = Query::Range { start: Bytes::new(), end: None, limit: 3 };
    assert_eq!(&range.encode()[..], &[0x82, 0, 0, 0, 0, 0, 3, 0, 0, 0]);
    let cas = UpdateReply::CompareAndSwap(CasReply { swapped: true, current: None });
    assert_eq!(&cas.encode()[..], &[0x03, 1, 0]);
}
