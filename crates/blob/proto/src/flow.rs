//! The meta part of a request-to-send frame (receiver-driven flow control,
//! FDS §4; frame kinds in `frame`).
//!
//! ```text
//!  0 data_len u32  bytes of data the announced request will carry
//! ```
//!
//! A clear-to-send has an empty meta part: its header's request id names
//! the request it clears. Both are bounded by `frame::FLOW_META_MAX`
//! before they are read; the length announced here is bounded by
//! `FRAME_DATA_MAX`, as the request's own header will be.

use bytes::Bytes;

use blizzard_core::limits::FRAME_DATA_MAX;

use crate::codec::{DecodeError, Reader, Wire, Writer};

/// The meta part of a request-to-send for a request carrying `data_len`
/// bytes.
pub fn encode_rts(data_len: u32) -> Bytes {
    let mut w = Writer::new();
    data_len.put(&mut w);
    w.buf.freeze()
}

/// The data length a request-to-send announces.
pub fn decode_rts(meta: &[u8]) -> Result<u32, DecodeError> {
    let mut r = Reader::new(meta);
    let data_len = u32::get(&mut r)?;
    r.finish()?;
    if data_len > FRAME_DATA_MAX {
        return Err(DecodeError::BadValue { field: "announced data length", value: data_len as u64 });
    }
    Ok(data_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request-to-send's meta bytes are pinned: changing them is a
    /// protocol change.
    #[test]
    fn rts_golden_bytes() {
        let b = encode_rts(8 << 20);
        assert_eq!(&b[..], &[0, 0, 0x80, 0]);
        assert_eq!(decode_rts(&b), Ok(8 << 20));
    }

    /// Truncated, trailing or oversized announcements are refused.
    #[test]
    fn bad_rts_is_refused() {
        assert!(matches!(decode_rts(&[1, 2, 3]), Err(DecodeError::Truncated { .. })));
        assert_eq!(decode_rts(&[0, 0, 0, 0, 9]), Err(DecodeError::Trailing(1)));
        let over = encode_rts(FRAME_DATA_MAX + 1);
        assert!(matches!(decode_rts(&over), Err(DecodeError::BadValue { .. })));
        assert_eq!(decode_rts(&encode_rts(FRAME_DATA_MAX)), Ok(FRAME_DATA_MAX));
    }
}
