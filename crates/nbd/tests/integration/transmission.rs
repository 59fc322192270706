//! End to end over a real socket and a real cluster: a client written from
//! the spec negotiates (GO, structured replies, base:allocation, or the
//! older EXPORT_NAME and simple replies) and drives reads, writes, FUA,
//! flushes, trims, write-zeroes and block status with many requests in
//! flight, checking every byte against a model.

#![allow(clippy::unwrap_used)]

use crate::common;

use rand::{Rng, RngCore, SeedableRng};

use blizzard_nbd::proto::*;
use blizzard_nbd::NbdConfig;
use blizzard_volume::{CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 8 << 20;
/// Requests in a batch touch disjoint slots, so their order does not
/// matter and the model is exact.
const SLOT: u64 = 128 << 10;
const IN_FLIGHT: usize = 48;

/// Random pipelined operations, each batch up to 48 requests in flight on
/// disjoint ranges, against a byte model; then a full read-back, on one
/// volume per commit mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_io_matches_model() -> R {
    let vols = [
        spec("wt", SIZE, CommitMode::WriteThrough, FlushPolicy::Durable),
        spec("fa", SIZE, CommitMode::FastAck, FlushPolicy::Durable),
        spec("log", SIZE, CommitMode::Log, FlushPolicy::Durable),
    ];
    let fx = start(&vols, NbdConfig::default()).await;
    for (i, v) in vols.iter().enumerate() {
        let mut c = Nbd::connect(&fx.addr, &v.name, FULL).await;
        assert_eq!(c.size, SIZE);
        let want = NBD_FLAG_HAS_FLAGS
            | NBD_FLAG_SEND_FLUSH
            | NBD_FLAG_SEND_FUA
            | NBD_FLAG_SEND_TRIM
            | NBD_FLAG_SEND_WRITE_ZEROES
            | NBD_FLAG_SEND_DF
            | NBD_FLAG_CAN_MULTI_CONN
            | NBD_FLAG_SEND_FAST_ZERO;
        assert_eq!(c.flags, want);
        let (min, pref, max) = c.block_size.unwrap();
        assert_eq!((min, pref, max), (1, 4096, PAYLOAD_ADVERTISED));
        workload(&mut c, i as u64, 12).await;
        c.disconnect().await;
    }
    fx.stop().await;
    Ok(())
}

async fn workload(c: &mut Nbd, seed: u64, batches: usize) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut model = vec![0u8; SIZE as usize];
    let slots = (SIZE / SLOT) as usize;
    for round in 0..batches as u64 {
        let mut order: Vec<usize> = (0..slots).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        let mut expect = std::collections::HashMap::new();
        let mut updates: Vec<(usize, Vec<u8>)> = Vec::new();
        for &slot in order.iter().take(IN_FLIGHT) {
            let base = slot as u64 * SLOT;
            let len = rng.random_range(1..=SLOT as u32 / 2);
            let off = base + rng.random_range(0..SLOT - len as u64);
            let (o, l) = (off as usize, len as usize);
            let cookie = match rng.random_range(0..10) {
                0..=2 => {
                    let data = pattern(off, l, round);
                    let fua = if rng.random_ratio(1, 4) { NBD_CMD_FLAG_FUA } else { 0 };
                    let ck = c.send(NBD_CMD_WRITE, fua, off, len, &data).await;
                    updates.push((o, data));
                    ck
                }
                3..=5 => {
                    let df = if rng.random_ratio(1, 3) { NBD_CMD_FLAG_DF } else { 0 };
                    let ck = c.send(NBD_CMD_READ, df, off, len, &[]).await;
                    expect.insert(ck, (NBD_CMD_READ, o, l, df));
                    ck
                }
                6 => {
                    let ck = c.send(NBD_CMD_TRIM, 0, off, len, &[]).await;
                    updates.push((o, vec![0; l]));
                    ck
                }
                7 => {
                    let f = match rng.random_range(0..3) {
                        0 => NBD_CMD_FLAG_NO_HOLE,
                        1 => NBD_CMD_FLAG_FUA,
                        _ => NBD_CMD_FLAG_FAST_ZERO,
                    };
                    let ck = c.send(NBD_CMD_WRITE_ZEROES, f, off, len, &[]).await;
                    updates.push((o, vec![0; l]));
                    ck
                }
                8 => {
                    let one = if rng.random_ratio(1, 2) { NBD_CMD_FLAG_REQ_ONE } else { 0 };
                    let ck = c.send(NBD_CMD_BLOCK_STATUS, one, off, len, &[]).await;
                    expect.insert(ck, (NBD_CMD_BLOCK_STATUS, o, l, one));
                    ck
                }
                _ => c.send(NBD_CMD_FLUSH, 0, 0, 0, &[]).await,
            };
            let _ = cookie;
        }
        c.flush_socket().await;
        assert!(c.in_flight() > 1);
        while c.in_flight() > 0 {
            let (cookie, r) = c.recv().await;
            assert_eq!(r.errno, 0, "round {round}: {}", r.message);
            match expect.get(&cookie) {
                Some(&(NBD_CMD_READ, o, l, df)) => {
                    assert!(r.data == model[o..o + l], "round {round}: read [{o}, +{l}) differs");
                    if df != 0 {
                        assert_eq!(r.chunks, 1);
                    }
                }
                Some(&(NBD_CMD_BLOCK_STATUS, o, l, one)) => {
                    assert!(!r.extents.is_empty());
                    if one != 0 {
                        assert_eq!(r.extents.len(), 1);
                        assert!(r.extents[0].0 as usize <= l);
                    }
                    // Whatever the precision, ZERO must be true.
                    let mut at = o;
                    for (i, (len, flags)) in r.extents.iter().enumerate() {
                        let end = (at + *len as usize).min(o + l);
                        if i + 1 < r.extents.len() {
                            assert!(at + (*len as usize) < o + l, "extents past the request before the last");
                        }
                        if flags & NBD_STATE_ZERO != 0 {
                            assert!(model[at..end].iter().all(|&b| b == 0), "ZERO extent with data");
                        }
                        at = end;
                    }
                }
                _ => {}
            }
        }
        for (o, d) in updates {
            model[o..o + d.len()].copy_from_slice(&d);
        }
    }
    // Everything, in 1 MiB reads, all in flight at once.
    let mut cookies = Vec::new();
    for off in (0..SIZE).step_by(1 << 20) {
        cookies.push((c.send(NBD_CMD_READ, 0, off, 1 << 20, &[]).await, off as usize));
    }
    c.flush_socket().await;
    let mut got = std::collections::HashMap::new();
    for _ in 0..cookies.len() {
        let (ck, r) = c.recv().await;
        assert_eq!(r.errno, 0);
        got.insert(ck, r.data);
    }
    for (ck, off) in cookies {
        assert!(got[&ck] == model[off..off + (1 << 20)], "final read at {off} differs");
    }
}

/// Simple replies (no structured negotiation) and the older
/// NBD_OPT_EXPORT_NAME entry, with and without the 124 zero bytes, through
/// the default export; data written on one is read on the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_replies_and_export_name() -> R {
    let vols = [spec("disk", SIZE, CommitMode::FastAck, FlushPolicy::Durable)];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut a = Nbd::connect(&fx.addr, "", SIMPLE).await;
    assert_eq!(a.size, SIZE);
    assert_eq!(a.flags & NBD_FLAG_SEND_DF, 0, "DF without structured replies");
    let data = pattern(12345, 100_000, 1);
    a.write(12345, &data).await;
    assert_eq!(a.read(12345, 100_000).await, data);
    // Pipelined simple reads come back with their data.
    let c1 = a.send(NBD_CMD_READ, 0, 12345, 10, &[]).await;
    let c2 = a.send(NBD_CMD_READ, 0, 12355, 20, &[]).await;
    a.flush_socket().await;
    for _ in 0..2 {
        let (ck, r) = a.recv().await;
        let at = if ck == c1 {
            0
        } else {
            assert_eq!(ck, c2);
            10
        };
        assert_eq!(r.data, data[at..at + r.data.len()]);
    }
    // A zero-length read succeeds with no data.
    assert!(a.read(0, 0).await.is_empty());
    for no_zeroes in [false, true] {
        let want = Want { structured: false, base_allocation: false, export_name: Some(no_zeroes) };
        let mut b = Nbd::connect(&fx.addr, "disk", want).await;
        assert_eq!(b.size, SIZE);
        assert_eq!(b.read(12345, 100_000).await, data);
        b.disconnect().await;
    }
    // Structured replies via EXPORT_NAME: the meta context carries over.
    let want = Want { structured: true, base_allocation: true, export_name: Some(true) };
    let mut s = Nbd::connect(&fx.addr, "disk", want).await;
    let r = s.call(NBD_CMD_BLOCK_STATUS, 0, 0, 4096, &[]).await;
    assert_eq!(r.errno, 0);
    assert_eq!(s.read(12345, 7).await, data[..7]);
    let r = s.call(NBD_CMD_READ, 0, 0, 0, &[]).await;
    assert_eq!((r.errno, r.chunks), (0, 1));
    s.disconnect().await;
    a.disconnect().await;
    fx.stop().await;
    Ok(())
}

/// The options a client uses to look around: LIST, INFO with name,
/// description and block size, LIST_META_CONTEXT with and without queries,
/// and GO on the default export.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_and_info() -> R {
    let vols = [
        spec("alpha", SIZE, CommitMode::Log, FlushPolicy::Ordered),
        spec("beta", 2 * SIZE, CommitMode::WriteThrough, FlushPolicy::Durable),
    ];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut s = fx.dial().await;
    greet(&mut s).await;
    send_raw(&mut s, &(NBD_FLAG_C_FIXED_NEWSTYLE).to_be_bytes()).await;
    send_option(&mut s, &ClientOption::List).await;
    let r = read_option_replies(&mut s).await;
    let names: Vec<String> = r[..r.len() - 1]
        .iter()
        .map(|(h, d)| {
            assert_eq!(h.reply_type, NBD_REP_SERVER);
            let n = u32::from_be_bytes(d[..4].try_into().unwrap()) as usize;
            String::from_utf8(d[4..4 + n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["alpha", "beta"]);
    assert_eq!(r.last().unwrap().0.reply_type, NBD_REP_ACK);

    let info =
        InfoRequest { name: "".into(), info: vec![NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE] };
    send_option(&mut s, &ClientOption::Info(info)).await;
    let r = read_option_replies(&mut s).await;
    assert_eq!(r.last().unwrap().0.reply_type, NBD_REP_ACK);
    let mut seen = Vec::new();
    for (h, d) in &r[..r.len() - 1] {
        assert_eq!(h.option, NBD_OPT_INFO);
        let t = u16::from_be_bytes([d[0], d[1]]);
        seen.push(t);
        match t {
            NBD_INFO_EXPORT => assert_eq!(u64::from_be_bytes(d[2..10].try_into().unwrap()), SIZE),
            NBD_INFO_NAME => assert_eq!(&d[2..], b"alpha"),
            NBD_INFO_DESCRIPTION => assert!(String::from_utf8_lossy(&d[2..]).contains("log commit")),
            NBD_INFO_BLOCK_SIZE => {
                // A log volume of 4 KiB blocks prefers 4 KiB.
                assert_eq!(&d[2..], &[0, 0, 0, 1, 0, 0, 16, 0, 2, 0, 0, 0]);
            }
            _ => panic!("unexpected info {t}"),
        }
    }
    seen.sort();
    assert_eq!(seen, [0, 1, 2, 3]);

    // LIST_META_CONTEXT: no queries lists all; `base:` is a wildcard;
    // unknown namespaces are ignored.
    for (queries, listed) in [
        (vec![], true),
        (vec!["base:"], true),
        (vec!["qemu:dirty-bitmap:x"], false),
        (vec!["base:allocation"], true),
    ] {
        let m = MetaContextRequest {
            export: "beta".into(),
            queries: queries.iter().map(|q| q.to_string()).collect(),
        };
        send_option(&mut s, &ClientOption::ListMetaContext(m)).await;
        let r = read_option_replies(&mut s).await;
        assert_eq!(r.len(), if listed { 2 } else { 1 }, "{queries:?}");
        if listed {
            assert_eq!(r[0].0.reply_type, NBD_REP_META_CONTEXT);
            assert_eq!(&r[0].1[4..], BASE_ALLOCATION.as_bytes());
        }
    }
    // STRUCTURED_REPLY, then a SET_META_CONTEXT for another export: the
    // context does not carry over to "beta" via GO.
    send_option(&mut s, &ClientOption::StructuredReply).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
    let m = MetaContextRequest { export: "alpha".into(), queries: vec![BASE_ALLOCATION.into()] };
    send_option(&mut s, &ClientOption::SetMetaContext(m)).await;
    assert_eq!(read_option_replies(&mut s).await.len(), 2);
    send_option(&mut s, &ClientOption::Go(InfoRequest { name: "beta".into(), info: vec![] })).await;
    let r = read_option_replies(&mut s).await;
    assert_eq!(r.last().unwrap().0.reply_type, NBD_REP_ACK);
    let mut req =
        Request { flags: 0, command: NBD_CMD_BLOCK_STATUS, cookie: 5, offset: 0, len: 512 }.encode().to_vec();
    req.extend_from_slice(
        &Request { flags: 0, command: NBD_CMD_DISC, cookie: 6, offset: 0, len: 0 }.encode(),
    );
    send_raw(&mut s, &req).await;
    let mut h = [0u8; 20];
    tokio::io::AsyncReadExt::read_exact(&mut s, &mut h).await.unwrap();
    let ReplyHeader::Chunk { reply_type, cookie, .. } = decode_reply_header(&h).unwrap() else { panic!() };
    assert_eq!((reply_type, cookie), (NBD_REPLY_TYPE_ERROR, 5));
    fx.stop().await;
    Ok(())
}

/// A request past the advertised 32 MiB maximum but within the served
/// 64 MiB one (some clients ignore block-size constraints: reads of 40 MiB
/// were seen) is served whole, write and read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_advertised_maximum_are_served() -> R {
    let vols = [spec("big", 48 << 20, CommitMode::WriteThrough, FlushPolicy::Durable)];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut c = Nbd::connect(&fx.addr, "big", FULL).await;
    let (_, _, max) = c.block_size.unwrap();
    assert_eq!(max, PAYLOAD_ADVERTISED);
    let len = 40u32 << 20;
    assert!(len > max && len <= PAYLOAD_MAX);
    let mut data = vec![0u8; len as usize];
    rand::rngs::SmallRng::seed_from_u64(40).fill_bytes(&mut data);
    c.write(4096, &data).await;
    c.flush().await;
    assert!(c.read(4096, len).await == data, "the 40 MiB read differs from the 40 MiB write");
    c.disconnect().await;
    fx.stop().await;
    Ok(())
}
