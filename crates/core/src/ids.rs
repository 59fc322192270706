//! Identifiers. Blobs and tractservers are named by 128-bit ids (FDS §2.1
//! uses GUIDs); tracts by their signed number inside a blob, where tract −1
//! holds the blob's metadata (FDS §2.3).

use std::fmt;
use std::str::FromStr;

/// A blob's 128-bit name, chosen by the caller or at random.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct BlobId(pub u128);

/// Identity of a tractserver's disk, written into the disk's superblock when
/// it is formatted; it survives restarts and address changes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct TsId(pub u128);

/// Distinguishes successive lives of a blob id: chosen at random when a blob
/// is created and carried by every tract request, so tracts left behind by
/// a deleted blob never show through in a new blob with the same id.
pub type Incarnation = u64;

/// A tract's number inside its blob. Data tracts count from 0; the
/// metadata tract is −1.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct TractNo(pub i64);

impl TractNo {
    /// The tract holding the blob's metadata (size, replication level).
    pub const META: TractNo = TractNo(-1);

    pub fn is_meta(self) -> bool {
        self == Self::META
    }
}

impl fmt::Display for TractNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid id {0:?}: expected 32 hexadecimal digits (128 bits)")]
pub struct ParseIdError(String);

fn parse_u128_hex(s: &str) -> Result<u128, ParseIdError> {
    let t = s.trim().trim_start_matches("0x").replace('-', "");
    if t.is_empty() || t.len() > 32 {
        return Err(ParseIdError(s.to_string()));
    }
    u128::from_str_radix(&t, 16).map_err(|_| ParseIdError(s.to_string()))
}

macro_rules! hex_id {
    ($t:ident) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:032x}", self.0)
            }
        }
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                // Short form keeps logs readable; Display has all 128 bits.
                write!(f, "{}({:08x})", stringify!($t), (self.0 >> 96) as u32)
            }
        }
        impl FromStr for $t {
            type Err = ParseIdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                parse_u128_hex(s).map($t)
            }
        }
    };
}
hex_id!(BlobId);
hex_id!(TsId);

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids print as 32 hex digits and parse back, with or without dashes.
    #[test]
    fn id_round_trip() {
        let id = BlobId(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        let s = id.to_string();
        assert_eq!(s, "0123456789abcdef0011223344556677");
        assert_eq!(s.parse::<BlobId>(), Ok(id));
        assert_eq!("01234567-89ab-cdef-0011-223344556677".parse::<BlobId>(), Ok(id));
        assert!("xyz".parse::<BlobId>().is_err());
        assert!("".parse::<BlobId>().is_err());
        assert!("1".repeat(33).parse::<BlobId>().is_err());
    }
}
