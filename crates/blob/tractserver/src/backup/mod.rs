//! The hybrid tier's backup journal (Ursa §3.2–3.3): a tractserver holding
//! backup replicas on a slow disk appends small backup writes to a journal
//! on fast storage, acknowledges them once durable there, and replays them
//! to the data disk later; until then reads of those bytes come from the
//! journal.
//!
//! - `index`: where the newest journaled bytes of each tract range are, and each record's live bytes.

pub mod index;
