//! Named maximums. Every buffer sized from untrusted input is bounded by one
//! of these; the const assertions keep them consistent with each other.

/// Integrity granularity: every stored byte belongs to one CRC32C chunk of
/// this size, aligned to the start of its tract.
pub const CHUNK_SIZE: u32 = 4096;

/// Smallest tract size a cluster may be created with (tests use tiny tracts
/// so that tract boundaries are crossed constantly).
pub const TRACT_SIZE_MIN: u32 = CHUNK_SIZE;

/// Largest tract size a cluster may be created with.
pub const TRACT_SIZE_MAX: u32 = 64 << 20;

/// Default tract size (FDS §2.1: random and sequential access about equal).
pub const TRACT_SIZE_DEFAULT: u32 = 8 << 20;

/// Largest data payload of one frame: one whole tract.
pub const FRAME_DATA_MAX: u32 = TRACT_SIZE_MAX;

/// Largest non-data part of a frame (a TLT of about 1,000 tractservers with
/// all pairs fits; see `tlt::ROWS_MAX`).
pub const FRAME_META_MAX: u32 = 16 << 20;

/// Most members one TLT may name.
pub const TLT_MEMBERS_MAX: usize = 4096;

/// Most rows one TLT may hold.
pub const TLT_ROWS_MAX: usize = 1 << 20;

/// Highest replication level a cluster may be created with.
pub const REPLICATION_MAX: u8 = 8;

/// Longest address or failure-domain string accepted from a peer.
pub const NAME_LEN_MAX: usize = 256;

const _: () = assert!(TRACT_SIZE_MIN.is_multiple_of(CHUNK_SIZE));
const _: () = assert!(TRACT_SIZE_MAX.is_multiple_of(CHUNK_SIZE));
const _: () = assert!(TRACT_SIZE_DEFAULT.is_multiple_of(CHUNK_SIZE));
const _: () = assert!(TRACT_SIZE_DEFAULT <= TRACT_SIZE_MAX && TRACT_SIZE_DEFAULT >= TRACT_SIZE_MIN);
const _: () = assert!(FRAME_DATA_MAX >= TRACT_SIZE_MAX);

/// Whether `size` is a valid tract size: a power of two between the bounds
/// (powers of two keep offset arithmetic exact and chunk-aligned).
pub fn tract_size_valid(size: u32) -> bool {
    size.is_power_of_two() && (TRACT_SIZE_MIN..=TRACT_SIZE_MAX).contains(&size)
}
