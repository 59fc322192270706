//! `raft.meta`: the log's small mutable state (who this directory belongs
//! to, the vote, the committed id, the purge point, where the live
//! segments start), in two 4 KiB slots written alternately. Pure: the
//! writing and the recovery cases are in `log/mod.rs`.
//!
//! A slot, little-endian:
//!
//! | field | encoding |
//! |---|---|
//! | magic `BLZRMETA` | 8 bytes |
//! | format version (1) | u32 |
//! | generation (the newer valid slot wins) | u64 |
//! | cluster id | u128 |
//! | node id | u64 |
//! | vote | u8 tag (0 none, 1 some) + `codec::put_vote` |
//! | committed | `codec::put_opt_log_id` |
//! | last purged | `codec::put_opt_log_id` |
//! | first live segment number | u64 |
//! | CRC32C of every byte above | u32 |
//! | zeros to the end of the slot | |
//!
//! A slot is written whole (one write, then a sync), always into the slot
//! that does not hold the newest generation: a torn write damages only the
//! slot being written, and the other one still holds the state before it.

use bytes::{BufMut, Bytes};

use blizzard_core::crc::crc32c;
use blizzard_proto::{DecodeError, Reader, Wire, Writer};

use crate::codec;
use crate::types::{LogId, NodeId, Vote};

pub const META_FILE: &str = "raft.meta";
pub const META_MAGIC: [u8; 8] = *b"BLZRMETA";
pub const META_VERSION: u32 = 1;
pub const META_SLOT_LEN: usize = 4096;
pub const META_SLOTS: usize = 2;
pub const META_LEN: u64 = (META_SLOT_LEN * META_SLOTS) as u64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    pub generation: u64,
    pub cluster: u128,
    pub node: NodeId,
    pub vote: Option<Vote>,
    pub committed: Option<LogId>,
    pub purged: Option<LogId>,
    /// The segment the scan at recovery starts from; those below it hold
    /// purged records only (left over if a purge was cut short).
    pub first_live: u64,
}

/// Why a slot is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    #[error("never written (all zeros)")]
    Empty,
    #[error("bad magic")]
    Magic,
    #[error("unknown format version {0}")]
    Version(u32),
    #[error("CRC mismatch (torn or damaged)")]
    Crc,
    #[error("{0}")]
    Decode(#[from] DecodeError),
}

impl Meta {
    /// The slot's bytes, exactly [`META_SLOT_LEN`] of them.
    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        w.buf.put_slice(&META_MAGIC);
        META_VERSION.put(&mut w);
        self.generation.put(&mut w);
        self.cluster.put(&mut w);
        self.node.put(&mut w);
        match &self.vote {
            None => 0u8.put(&mut w),
            Some(v) => {
                1u8.put(&mut w);
                codec::put_vote(&mut w, v);
            }
        }
        codec::put_opt_log_id(&mut w, &self.committed);
        codec::put_opt_log_id(&mut w, &self.purged);
        self.first_live.put(&mut w);
        let crc = crc32c(&w.buf);
        crc.put(&mut w);
        assert!(w.buf.len() <= META_SLOT_LEN, "a meta slot holds fixed-size fields only");
        w.buf.resize(META_SLOT_LEN, 0);
        w.buf.freeze()
    }

    pub fn decode(slot: &[u8]) -> Result<Meta, SlotError> {
        if slot.iter().all(|b| *b == 0) {
            return Err(SlotError::Empty);
        }
        let mut r = Reader::new(slot);
        if r.take(META_MAGIC.len())? != META_MAGIC {
            return Err(SlotError::Magic);
        }
        let version = u32::get(&mut r)?;
        // Checked after the CRC: a torn slot reports as torn, not as a
        // version from the future.
        let generation = u64::get(&mut r)?;
        let cluster = u128::get(&mut r)?;
        let node = u64::get(&mut r)?;
        let vote = match u8::get(&mut r)? {
            0 => None,
            1 => Some(codec::get_vote(&mut r)?),
            v => return Err(DecodeError::BadValue { field: "vote tag", value: v as u64 }.into()),
        };
        let committed = codec::get_opt_log_id(&mut r)?;
        let purged = codec::get_opt_log_id(&mut r)?;
        let first_live = u64::get(&mut r)?;
        let covered = slot.len() - r.left();
        let crc = u32::get(&mut r)?;
        if crc32c(&slot[..covered]) != crc {
            return Err(SlotError::Crc);
        }
        if version != META_VERSION {
            return Err(SlotError::Version(version));
        }
        Ok(Meta { generation, cluster, node, vote, committed, purged, first_live })
    }
}

/// The slot to trust among `slots` (each decoded): the valid one with the
/// highest generation, and its position.
pub fn newest(slots: &[Result<Meta, SlotError>]) -> Option<(usize, Meta)> {
    slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| s.as_ref().ok().map(|m| (i, m.clone())))
        .max_by_key(|(i, m)| (m.generation, std::cmp::Reverse(*i)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::log_id;
    use crate::types::LeaderId;
    use proptest::prelude::*;

    fn sample(generation: u64) -> Meta {
        Meta {
            generation,
            cluster: 0x1234_5678_9abc_def0_0fed_cba9_8765_4321,
            node: 3,
            vote: Some(Vote { leader_id: LeaderId { term: 7, node_id: 2 }, committed: true }),
            committed: Some(log_id(7, 2, 100)),
            purged: None,
            first_live: 4,
        }
    }

    /// A slot decodes to what was encoded, and fills exactly one slot.
    #[test]
    fn slots_round_trip() {
        let m = sample(9);
        let b = m.encode();
        assert_eq!(b.len(), META_SLOT_LEN);
        assert_eq!(Meta::decode(&b), Ok(m));
        assert_eq!(Meta::decode(&[0u8; META_SLOT_LEN]), Err(SlotError::Empty));
    }

    /// The newer valid slot wins; an invalid one never does.
    #[test]
    fn newest_valid_slot_wins() {
        let (a, b) = (Ok(sample(4)), Ok(sample(5)));
        assert_eq!(newest(&[a.clone(), b.clone()]).map(|(i, _)| i), Some(1));
        assert_eq!(newest(&[b, Err(SlotError::Crc)]).map(|(i, _)| i), Some(0));
        assert_eq!(newest(&[Err(SlotError::Empty), Err(SlotError::Crc)]), None);
    }

    proptest! {
        /// Any flipped bit is refused, and a write torn at any byte over an
        /// older slot decodes as the old state, the new one, or not at all:
        /// never a mix of the two.
        #[test]
        fn damaged_slots_are_refused(bit in 0usize..(100 * 8), cut in 0usize..128) {
            // `sample` encodes to 100 bytes: every bit of them is covered.
            let b = sample(2).encode().to_vec();
            let mut flipped = b.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(Meta::decode(&flipped).is_err());
            let mut older = sample(1);
            older.committed = Some(log_id(6, 1, 50));
            older.vote = None;
            let mut torn = older.encode().to_vec();
            torn[..cut].copy_from_slice(&b[..cut]);
            if let Ok(m) = Meta::decode(&torn) {
                prop_assert!(m == older || m == sample(2), "a mix: {:?}", m);
            }
        }
    }
}
