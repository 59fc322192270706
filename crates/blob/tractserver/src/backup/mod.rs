//! The hybrid tier's backup journal (Ursa §3.2–§3.3): a tractserver whose
//! data disk is slow appends small backup writes to a journal on fast
//! storage, acknowledges them once durable there, and replays them to the
//! data disk later, in disk order.
//!
//! - `format`: the journal's heads and records, and what the scan at open
//!   makes of each state of the ring (pure).
//! - `index`: which record holds the newest bytes of any range of a tract
//!   (pure; replay applies only those).
//! - `journal`: the ring at run time: group-committed appends, reads of
//!   records not yet replayed, and the head that gives space back; a
//!   journal's second area, taking records while the first is full.
//! - `attach`: opening (or formatting) the areas at start, and what start
//!   does with each state of the second one.

pub(crate) mod attach;
pub mod format;
pub mod index;
pub mod journal;
