//! Entry points shared by the cargo-fuzz targets (`crates/nbd/fuzz`) and the
//! stable tests that replay their corpus and feed random bytes
//! (`tests/integration/decoders.rs`): each decodes arbitrary bytes and checks the
//! decoder's invariants, panicking only if one is broken.

use crate::proto::*;

/// Input: 4 bytes of option number, then the option's data. Decoding never
/// panics; whatever decodes re-encodes to the same option.
pub fn option(data: &[u8]) {
    let _ = decode_option_header(data);
    let _ = decode_option_reply_header(data);
    let Some((code, body)) = data.split_first_chunk::<4>() else {
        return;
    };
    let code = u32::from_be_bytes(*code);
    let Ok(opt) = decode_option(code, body) else {
        return;
    };
    assert_eq!(opt.code(), code);
    let enc = opt.encode();
    let hdr = decode_option_header(&enc);
    assert_eq!(hdr, Ok(OptionHeader { option: code, len: (enc.len() - OPTION_HEADER_LEN) as u32 }));
    assert_eq!(decode_option(code, &enc[OPTION_HEADER_LEN..]).as_ref(), Ok(&opt));
}

/// Input: a 28-byte request header, then 8 bytes of export size and a byte
/// of negotiated features. Validation never panics, accepts only requests
/// inside the export and within the payload bound, and skips a payload
/// only for writes small enough to skip.
pub fn request(data: &[u8]) {
    let _ = decode_reply_header(data);
    let Ok(r) = decode_request(data) else {
        return;
    };
    assert_eq!(&r.encode()[..], &data[..REQUEST_LEN]);
    let rest = &data[REQUEST_LEN..];
    let size = rest.first_chunk::<8>().map_or(1 << 30, |b| u64::from_be_bytes(*b));
    let features = rest.get(8).copied().unwrap_or(0);
    let structured = features & 1 != 0;
    let s = Session { size, structured, base_allocation: (structured && features & 2 != 0).then_some(1) };
    let within = |offset: u64, len: u32| offset.checked_add(len as u64).is_some_and(|e| e <= size);
    match check_request(&r, &s) {
        Ok(Command::Read { offset, len }) => assert!(within(offset, len) && len <= PAYLOAD_MAX),
        Ok(Command::Write { offset, len, .. }) => assert!(within(offset, len) && len <= PAYLOAD_MAX),
        Ok(Command::Trim { offset, len, .. })
        | Ok(Command::Cache { offset, len })
        | Ok(Command::WriteZeroes { offset, len, .. }) => assert!(within(offset, len)),
        Ok(Command::BlockStatus { offset, len, .. }) => {
            assert!(within(offset, len) && len > 0 && s.base_allocation.is_some())
        }
        Ok(Command::Flush) => assert_eq!(r.command, NBD_CMD_FLUSH),
        Ok(Command::Disc) => assert_eq!(r.command, NBD_CMD_DISC),
        Err(j) => {
            assert_ne!(j.errno, 0);
            if j.drain > 0 {
                assert!(r.command == NBD_CMD_WRITE && j.drain == r.len && r.len <= PAYLOAD_MAX);
            }
            if j.disconnect {
                assert!(r.command == NBD_CMD_WRITE && r.len > PAYLOAD_MAX);
            }
            if r.command == NBD_CMD_WRITE {
                // The stream stays in step: skipped or abandoned.
                assert!(j.disconnect || j.drain == r.len);
            }
        }
    }
}
