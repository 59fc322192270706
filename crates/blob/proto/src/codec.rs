//! Little-endian encoding of message fields, with decoding that checks every
//! length against the bytes actually present before allocating.

use bytes::{BufMut, BytesMut};

use blizzard_core::{BlobId, TractNo, TsId};

/// Longest string a message may carry (error texts, addresses, names).
pub const STRING_LEN_MAX: usize = 64 << 10;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message truncated: needed {needed} more bytes, {left} left")]
    Truncated { needed: usize, left: usize },
    #[error("message has {0} bytes left over after its last field")]
    Trailing(usize),
    #[error("field {field} has invalid value {value}")]
    BadValue { field: &'static str, value: u64 },
    #[error("list of {count} items cannot fit in the {left} bytes left")]
    ListTooLong { count: usize, left: usize },
    #[error("string is not UTF-8 or longer than {STRING_LEN_MAX} bytes")]
    BadString,
}

pub struct Writer {
    pub buf: BytesMut,
}

impl Writer {
    pub fn new() -> Self {
        Writer { buf: BytesMut::with_capacity(64) }
    }
}

impl Default for Writer {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub fn left(&self) -> usize {
        self.buf.len()
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(DecodeError::Truncated { needed: n, left: self.buf.len() });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    /// Fails unless every byte was consumed: trailing garbage is an error,
    /// not something to ignore.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.buf.len()))
        }
    }
}

/// A value with a wire form.
pub trait Wire: Sized {
    /// Fewest bytes one value occupies; bounds list lengths before allocating.
    const MIN_LEN: usize;
    fn put(&self, w: &mut Writer);
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError>;
}

/// Encodes one value into fresh bytes.
pub fn encode<T: Wire>(v: &T) -> bytes::Bytes {
    let mut w = Writer::new();
    v.put(&mut w);
    w.buf.freeze()
}

/// Decodes exactly one value from `buf`.
pub fn decode<T: Wire>(buf: &[u8]) -> Result<T, DecodeError> {
    let mut r = Reader::new(buf);
    let v = T::get(&mut r)?;
    r.finish()?;
    Ok(v)
}

macro_rules! wire_int {
    ($t:ty, $put:ident, $n:expr) => {
        impl Wire for $t {
            const MIN_LEN: usize = $n;
            fn put(&self, w: &mut Writer) {
                w.buf.$put(*self);
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
                Ok(<$t>::from_le_bytes(r.array::<$n>()?))
            }
        }
    };
}
wire_int!(u8, put_u8, 1);
wire_int!(u16, put_u16_le, 2);
wire_int!(u32, put_u32_le, 4);
wire_int!(u64, put_u64_le, 8);
wire_int!(u128, put_u128_le, 16);
wire_int!(i64, put_i64_le, 8);

impl Wire for bool {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        w.buf.put_u8(*self as u8);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue { field: "bool", value: v as u64 }),
        }
    }
}

impl Wire for String {
    const MIN_LEN: usize = 4;
    fn put(&self, w: &mut Writer) {
        let s = &self.as_bytes()[..self.len().min(STRING_LEN_MAX)];
        w.buf.put_u32_le(s.len() as u32);
        w.buf.put_slice(s);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = u32::get(r)? as usize;
        if n > STRING_LEN_MAX {
            return Err(DecodeError::BadString);
        }
        let b = r.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| DecodeError::BadString)
    }
}

impl<T: Wire> Wire for Vec<T> {
    const MIN_LEN: usize = 4;
    fn put(&self, w: &mut Writer) {
        w.buf.put_u32_le(self.len() as u32);
        for v in self {
            v.put(w);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let n = u32::get(r)? as usize;
        // Each item takes at least MIN_LEN bytes, so a count the remaining
        // bytes cannot hold is rejected before anything is allocated.
        if n.saturating_mul(T::MIN_LEN.max(1)) > r.left() {
            return Err(DecodeError::ListTooLong { count: n, left: r.left() });
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(T::get(r)?);
        }
        Ok(v)
    }
}

impl<T: Wire> Wire for Option<T> {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        match self {
            None => w.buf.put_u8(0),
            Some(v) => {
                w.buf.put_u8(1);
                v.put(w);
            }
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(None),
            1 => Ok(Some(T::get(r)?)),
            v => Err(DecodeError::BadValue { field: "option tag", value: v as u64 }),
        }
    }
}

impl Wire for BlobId {
    const MIN_LEN: usize = 16;
    fn put(&self, w: &mut Writer) {
        self.0.put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(BlobId(u128::get(r)?))
    }
}

impl Wire for blizzard_core::DiskClass {
    const MIN_LEN: usize = 1;
    fn put(&self, w: &mut Writer) {
        let v: u8 = match self {
            blizzard_core::DiskClass::Ssd => 0,
            blizzard_core::DiskClass::Hdd => 1,
        };
        v.put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::get(r)? {
            0 => Ok(blizzard_core::DiskClass::Ssd),
            1 => Ok(blizzard_core::DiskClass::Hdd),
            v => Err(DecodeError::BadValue { field: "disk class", value: v as u64 }),
        }
    }
}

impl Wire for TsId {
    const MIN_LEN: usize = 16;
    fn put(&self, w: &mut Writer) {
        self.0.put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(TsId(u128::get(r)?))
    }
}

impl Wire for TractNo {
    const MIN_LEN: usize = 8;
    fn put(&self, w: &mut Writer) {
        self.0.put(w)
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(TractNo(i64::get(r)?))
    }
}

/// Implements [`Wire`] for a struct by encoding its fields in order.
#[macro_export]
macro_rules! wire_struct {
    ($name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        impl $crate::codec::Wire for $name {
            const MIN_LEN: usize = 0 $(+ <$ty as $crate::codec::Wire>::MIN_LEN)*;
            fn put(&self, w: &mut $crate::codec::Writer) {
                $( <$ty as $crate::codec::Wire>::put(&self.$field, w); )*
            }
            fn get(r: &mut $crate::codec::Reader<'_>) -> Result<Self, $crate::codec::DecodeError> {
                Ok($name { $( $field: <$ty as $crate::codec::Wire>::get(r)?, )* })
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list count larger than the bytes present is refused before allocating.
    #[test]
    fn huge_list_count_is_refused() {
        let mut buf = vec![];
        buf.extend_from_slice(&u32::MAX.to_le_bytes());
        buf.extend_from_slice(&[0; 16]);
        assert!(matches!(decode::<Vec<u64>>(&buf), Err(DecodeError::ListTooLong { .. })));
        assert!(matches!(decode::<String>(&buf), Err(DecodeError::BadString)));
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        assert_eq!(decode::<u32>(&[1, 0, 0, 0, 9]), Err(DecodeError::Trailing(1)));
        assert!(matches!(decode::<u32>(&[1, 0]), Err(DecodeError::Truncated { .. })));
    }
}
