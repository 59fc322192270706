//! Misbehaving clients: each gets the reply or disconnect the spec asks
//! for, and a well-behaved client connected to the same server throughout
//! keeps working after every one of them.

#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use tokio::io::AsyncReadExt;

use blizzard_nbd::proto::*;
use blizzard_nbd::NbdConfig;
use blizzard_volume::{CommitMode, FlushPolicy};
use common::*;

const SIZE: u64 = 4 << 20;

/// The bystander still reads back what it writes.
async fn still_works(good: &mut Nbd, round: u64) {
    let data = pattern(round * 4096, 4096, round);
    good.write(round * 4096, &data).await;
    assert!(good.read(round * 4096, 4096).await == data, "bystander after case {round}");
}

async fn negotiated_raw(fx: &Fixture) -> blizzard_env::BoxStream {
    let mut s = fx.dial().await;
    greet(&mut s).await;
    send_raw(&mut s, &NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).await;
    s
}

/// Handshake violations: bad client flags, non-fixed newstyle, bad option
/// magic, oversized options, unknown and malformed options, unknown
/// exports (GO errors, EXPORT_NAME disconnects), meta contexts before
/// structured replies, ABORT, and a silent client timing out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_violations() -> R {
    let vols = [spec("disk", SIZE, CommitMode::FastAck, FlushPolicy::Durable)];
    let cfg = NbdConfig { handshake_timeout: Duration::from_millis(500), ..NbdConfig::default() };
    let fx = start(&vols, cfg).await;
    let mut good = Nbd::connect(&fx.addr, "disk", FULL).await;
    let mut round = 0;

    // Unknown client flag bits, and no fixed newstyle: dropped.
    for flags in [NBD_FLAG_C_FIXED_NEWSTYLE | 0x80, 0] {
        let mut s = fx.dial().await;
        greet(&mut s).await;
        send_raw(&mut s, &u32::to_be_bytes(flags)).await;
        assert!(closed_by_server(&mut s).await, "client flags {flags:#x}");
        round += 1;
        still_works(&mut good, round).await;
    }

    // Bad option magic: dropped.
    let mut s = negotiated_raw(&fx).await;
    send_raw(&mut s, b"NOTMAGIC\0\0\0\x03\0\0\0\0").await;
    assert!(closed_by_server(&mut s).await);
    round += 1;
    still_works(&mut good, round).await;

    // Option too long: NBD_REP_ERR_TOO_BIG, then dropped.
    let mut s = negotiated_raw(&fx).await;
    let mut h = IHAVEOPT.to_be_bytes().to_vec();
    h.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
    h.extend_from_slice(&(1u32 << 30).to_be_bytes());
    send_raw(&mut s, &h).await;
    let (rh, msg) = read_option_reply(&mut s).await;
    assert_eq!((rh.option, rh.reply_type), (NBD_OPT_GO, NBD_REP_ERR_TOO_BIG));
    assert!(!msg.is_empty());
    assert!(closed_by_server(&mut s).await);
    round += 1;
    still_works(&mut good, round).await;

    // Unknown options and malformed ones are answered, and the session
    // goes on: after them a GO succeeds.
    let mut s = negotiated_raw(&fx).await;
    send_raw_option(&mut s, 4242, b"whatever").await;
    let (rh, _) = read_option_reply(&mut s).await;
    assert_eq!((rh.option, rh.reply_type), (4242, NBD_REP_ERR_UNSUP));
    send_raw_option(&mut s, NBD_OPT_STARTTLS, &[]).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_UNSUP);
    send_raw_option(&mut s, NBD_OPT_EXTENDED_HEADERS, &[]).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_UNSUP);
    // GO whose name length runs past the data.
    send_raw_option(&mut s, NBD_OPT_GO, &[0, 0, 1, 0, b'd', 0, 0]).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_INVALID);
    // LIST with data.
    send_raw_option(&mut s, NBD_OPT_LIST, b"x").await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_INVALID);
    // Export name that is not UTF-8.
    send_raw_option(&mut s, NBD_OPT_INFO, &[0, 0, 0, 2, 0xff, 0xfe, 0, 0]).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ERR_INVALID);
    // SET_META_CONTEXT before STRUCTURED_REPLY.
    let m = MetaContextRequest { export: "disk".into(), queries: vec![BASE_ALLOCATION.into()] };
    send_option(&mut s, &ClientOption::SetMetaContext(m)).await;
    assert_eq!(read_option_replies(&mut s).await.last().unwrap().0.reply_type, NBD_REP_ERR_INVALID);
    // Unknown export: NBD_REP_ERR_UNKNOWN with a message, for INFO, GO and
    // LIST_META_CONTEXT.
    for o in [
        ClientOption::Info(InfoRequest { name: "nope".into(), info: vec![] }),
        ClientOption::Go(InfoRequest { name: "nope".into(), info: vec![] }),
        ClientOption::ListMetaContext(MetaContextRequest { export: "nope".into(), queries: vec![] }),
    ] {
        send_option(&mut s, &o).await;
        let r = read_option_replies(&mut s).await;
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].0.reply_type, NBD_REP_ERR_UNKNOWN);
        assert!(String::from_utf8_lossy(&r[0].1).contains("nope"));
    }
    send_option(&mut s, &ClientOption::Go(InfoRequest { name: "disk".into(), info: vec![] })).await;
    let r = read_option_replies(&mut s).await;
    assert_eq!(r.last().unwrap().0.reply_type, NBD_REP_ACK);
    drop(s);
    round += 1;
    still_works(&mut good, round).await;

    // EXPORT_NAME of an unknown export cannot be answered: dropped.
    let mut s = negotiated_raw(&fx).await;
    send_option(&mut s, &ClientOption::ExportName("nope".into())).await;
    assert!(closed_by_server(&mut s).await);
    round += 1;
    still_works(&mut good, round).await;

    // ABORT: acknowledged, then closed.
    let mut s = negotiated_raw(&fx).await;
    send_option(&mut s, &ClientOption::Abort).await;
    assert_eq!(read_option_reply(&mut s).await.0.reply_type, NBD_REP_ACK);
    assert!(closed_by_server(&mut s).await);

    // A client that never sends its flags (an oldstyle client waiting for
    // a greeting that never comes) is dropped after the handshake timeout.
    let mut s = fx.dial().await;
    greet(&mut s).await;
    let t = fx.env.now();
    assert!(closed_by_server(&mut s).await);
    assert!(fx.env.now() - t >= Duration::from_millis(400));
    // The same for one that stops mid-option.
    let mut s = negotiated_raw(&fx).await;
    send_raw(&mut s, &IHAVEOPT.to_be_bytes()).await;
    assert!(closed_by_server(&mut s).await);
    round += 1;
    still_works(&mut good, round).await;

    good.disconnect().await;
    fx.stop().await;
    Ok(())
}

/// Transmission violations: reads and writes past the end (EINVAL and
/// ENOSPC, the write's payload skipped so the stream stays in step), an
/// unknown command, flags not valid for a command, block status without a
/// context, an oversized write (error, then disconnect), garbage instead
/// of a request, and a client vanishing mid-payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transmission_violations() -> R {
    let vols = [spec("disk", SIZE, CommitMode::FastAck, FlushPolicy::Durable)];
    let fx = start(&vols, NbdConfig::default()).await;
    let mut good = Nbd::connect(&fx.addr, "disk", FULL).await;
    still_works(&mut good, 0).await;

    for want in [FULL, SIMPLE] {
        let mut c = Nbd::connect(&fx.addr, "disk", want).await;
        let r = c.call(NBD_CMD_READ, 0, SIZE - 10, 11, &[]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        assert!(r.data.is_empty());
        if want.structured {
            assert!(r.message.contains("past the end"), "{}", r.message);
        }
        let r = c.call(NBD_CMD_WRITE, 0, SIZE - 10, 4096, &[7u8; 4096]).await;
        assert_eq!(r.errno, NBD_ENOSPC);
        let r = c.call(NBD_CMD_WRITE, 0, u64::MAX - 1, 4096, &[7u8; 4096]).await;
        assert_eq!(r.errno, NBD_ENOSPC);
        let r = c.call(NBD_CMD_TRIM, 0, SIZE, 1, &[]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        let r = c.call(NBD_CMD_WRITE_ZEROES, 0, SIZE, 1, &[]).await;
        assert_eq!(r.errno, NBD_ENOSPC);
        let r = c.call(99, 0, 0, 0, &[]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        let r = c.call(NBD_CMD_RESIZE, 0, 0, 0, &[]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        // A WRITE with a flag only BLOCK_STATUS may carry: refused, payload
        // skipped.
        let r = c.call(NBD_CMD_WRITE, NBD_CMD_FLAG_REQ_ONE, 0, 512, &[1u8; 512]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        let r = c.call(NBD_CMD_READ, 1 << 12, 0, 1, &[]).await;
        assert_eq!(r.errno, NBD_EINVAL);
        let r =
            c.call(NBD_CMD_WRITE_ZEROES, NBD_CMD_FLAG_FAST_ZERO | NBD_CMD_FLAG_NO_HOLE, 0, 512, &[]).await;
        assert_eq!(r.errno, NBD_ENOTSUP);
        if !want.structured {
            // No context: block status is invalid; DF is not valid either.
            let r = c.call(NBD_CMD_BLOCK_STATUS, 0, 0, 512, &[]).await;
            assert_eq!(r.errno, NBD_EINVAL);
            let r = c.call(NBD_CMD_READ, NBD_CMD_FLAG_DF, 0, 512, &[]).await;
            assert_eq!(r.errno, NBD_EINVAL);
        }
        // A CACHE hint is harmless.
        assert_eq!(c.call(NBD_CMD_CACHE, 0, 0, 4096, &[]).await.errno, 0);
        // After all that the stream is in step: data intact.
        let d = pattern(100, 1000, 9);
        c.write(100, &d).await;
        assert_eq!(c.read(100, 1000).await, d);
        c.disconnect().await;
        still_works(&mut good, 1).await;
    }

    // Oversized WRITE: an error, then the server hangs up (it will not
    // read 64 MiB it would throw away).
    let mut c = Nbd::connect(&fx.addr, "disk", FULL).await;
    c.send(NBD_CMD_WRITE, 0, 0, PAYLOAD_MAX + 1, &[]).await;
    c.flush_socket().await;
    let (_, r) = c.recv().await;
    assert_eq!(r.errno, NBD_EINVAL);
    assert!(c.closed().await);
    still_works(&mut good, 2).await;

    // Garbage instead of a request: dropped.
    let mut c = Nbd::connect(&fx.addr, "disk", FULL).await;
    c.send_bytes(&[0xab; 28]).await;
    assert!(c.closed().await);
    still_works(&mut good, 3).await;

    // A client that vanishes mid-payload, and one mid-header.
    let mut c = Nbd::connect(&fx.addr, "disk", FULL).await;
    c.send(NBD_CMD_WRITE, 0, 0, 1 << 20, &[5u8; 1000]).await;
    c.flush_socket().await;
    drop(c);
    let mut c = Nbd::connect(&fx.addr, "disk", SIMPLE).await;
    c.send_bytes(&NBD_REQUEST_MAGIC.to_be_bytes()).await;
    drop(c);
    still_works(&mut good, 4).await;
    // The half-sent write (of 5s at 0) changed nothing.
    assert!(good.read(100, 1000).await == pattern(100, 1000, 9));

    // DISC with requests in flight: every reply arrives, then the close.
    let mut c = Nbd::connect(&fx.addr, "disk", FULL).await;
    for i in 0..32u64 {
        c.send(NBD_CMD_WRITE, 0, (64 + i) * 4096, 4096, &pattern((64 + i) * 4096, 4096, 5)).await;
    }
    c.send(NBD_CMD_DISC, 0, 0, 0, &[]).await;
    c.flush_socket().await;
    for _ in 0..32 {
        let (_, r) = c.recv().await;
        assert_eq!(r.errno, 0);
    }
    assert!(c.closed().await);
    for i in 0..32u64 {
        assert_eq!(good.read((64 + i) * 4096, 4096).await, pattern((64 + i) * 4096, 4096, 5));
    }

    good.disconnect().await;
    fx.stop().await;
    Ok(())
}

/// A client that stops reading replies while sending reads holds at most
/// its in-flight bound; shutdown still completes within the grace period,
/// and other clients are unaffected meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_reader_is_bounded() -> R {
    let vols = [spec("disk", SIZE, CommitMode::WriteThrough, FlushPolicy::Durable)];
    let cfg = NbdConfig {
        requests_in_flight_max: 8,
        shutdown_grace: Duration::from_secs(2),
        ..NbdConfig::default()
    };
    let fx = start(&vols, cfg).await;
    let mut good = Nbd::connect(&fx.addr, "disk", FULL).await;
    let mut s = fx.dial().await;
    greet(&mut s).await;
    send_raw(&mut s, &NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).await;
    send_option(&mut s, &ClientOption::Go(InfoRequest { name: "disk".into(), info: vec![] })).await;
    read_option_replies(&mut s).await;
    // 200 reads of 1 MiB = 200 MiB of replies the client never reads: the
    // server must stop reading requests once the socket buffers and its
    // 8-request bound fill up, instead of buffering them all.
    let mut reqs = Vec::new();
    for i in 0..200u64 {
        reqs.extend_from_slice(
            &Request { flags: 0, command: NBD_CMD_READ, cookie: i, offset: 0, len: 1 << 20 }.encode(),
        );
    }
    let env = fx.env.clone();
    let sent = env.timeout(Duration::from_secs(3), async {
        tokio::io::AsyncWriteExt::write_all(&mut s, &reqs).await.unwrap();
    });
    // Requests are small, so they may all fit in socket buffers; either way
    // the bystander must be served meanwhile.
    let _ = sent.await;
    still_works(&mut good, 1).await;
    let t = fx.env.now();
    let Fixture { server, cluster, .. } = fx;
    server.shutdown().await.unwrap();
    assert!(env.now() - t < Duration::from_secs(10));
    let mut b = [0u8; 16];
    let _ = s.read(&mut b).await;
    cluster.stop().await;
    Ok(())
}
