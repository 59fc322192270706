//! Making the replicas of one tract agree (design 0005): given what each
//! replica holds, chunk by chunk, which chunks to copy from which replica
//! to which others. Pure: the blob client and the crash checker's
//! in-memory blob both run their reconciliation through [`plan`].
//!
//! A write cut off by a crash may have reached some replicas of its tract
//! and not others. Any one replica's contents are a valid outcome for
//! that write (it was never acknowledged, or it is on every replica
//! already), so agreement is restored by choosing, per chunk, one replica
//! as the source and making every other replica hold what it holds. The
//! source is the first replica, in the order given (the row's order),
//! that can read the chunk: the same rule the row's newcomers follow when
//! they copy a tract from its first complete member, so a newcomer that
//! copies later holds the same thing.

/// What one replica holds in one 4 KiB chunk of a tract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChunkState {
    /// Never written (or trimmed): reads as zeros.
    Hole,
    /// Written; [`chunk_digest`] of the chunk's current bytes.
    Data(u64),
    /// Stored bytes that fail their CRC (torn by power loss, or decayed):
    /// a read of this chunk here fails and goes to another replica.
    Unreadable,
}

/// What replicas compare to tell whether two chunks hold the same bytes:
/// a 64-bit XXH3 of the bytes. Not the chunk's CRC32C, which the store
/// keeps anyway: a CRC is linear, so every chunk made of a record followed
/// by the record's own CRC32C (and the same padding) has the same CRC32C,
/// whatever the record says. Volumes write such records (intent headers),
/// and so do databases and file systems; blob-sim seed 1 found a replica
/// kept an old intent header because the CRCs matched.
pub fn chunk_digest(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// How a run of chunks is made equal on its targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepairAction {
    /// Read the chunks from the source and write them to the targets.
    Copy,
    /// The source holds nothing there: trim the chunks on the targets.
    Trim,
}

/// One run of consecutive chunks with the same source, targets and action.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Repair {
    pub first_chunk: u32,
    pub chunks: u32,
    /// Index of the replica to copy from.
    pub source: usize,
    /// Indexes of the replicas to change, ascending.
    pub targets: Vec<usize>,
    pub action: RepairAction,
}

/// What [`plan`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub repairs: Vec<Repair>,
    /// Chunks no replica can read: nothing to copy from. Every replica
    /// fails reads of them alike, so they do not flip between reads.
    pub unreadable: Vec<u32>,
}

impl Plan {
    /// Whether the replicas already agree (nothing to repair).
    pub fn is_empty(&self) -> bool {
        self.repairs.is_empty()
    }

    /// (chunk, replica) pairs the repairs change.
    pub fn chunk_repairs(&self) -> u64 {
        self.repairs.iter().map(|r| r.chunks as u64 * r.targets.len() as u64).sum()
    }
}

/// What reconciling one tract did (summed over tracts for reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reconciled {
    /// Tracts looked at.
    pub tracts: u64,
    /// Chunks compared across replicas.
    pub chunks_compared: u64,
    /// (chunk, replica) pairs changed to match their source.
    pub chunk_repairs: u64,
    /// Bytes copied from sources to targets.
    pub bytes_copied: u64,
    /// Chunks no replica could read (left as they are: every read fails).
    pub unreadable_chunks: u64,
}

impl std::ops::AddAssign for Reconciled {
    fn add_assign(&mut self, o: Reconciled) {
        self.tracts += o.tracts;
        self.chunks_compared += o.chunks_compared;
        self.chunk_repairs += o.chunk_repairs;
        self.bytes_copied += o.bytes_copied;
        self.unreadable_chunks += o.unreadable_chunks;
    }
}

/// The state of `chunk` in one replica's digest; a digest shorter than the
/// tract (a tract the replica does not hold at all) holds holes past its
/// end.
fn state(digest: &[ChunkState], chunk: usize) -> ChunkState {
    digest.get(chunk).copied().unwrap_or(ChunkState::Hole)
}

/// Plans the repairs that make every replica's digest equal, for a tract
/// of `chunks` chunks. Runs are at most `run_max` chunks long, so a caller
/// copying a run holds a bounded buffer.
pub fn plan(digests: &[Vec<ChunkState>], chunks: u32, run_max: u32) -> Plan {
    let run_max = run_max.max(1);
    let mut out = Plan::default();
    let mut current: Option<Repair> = None;
    for c in 0..chunks {
        let states: Vec<ChunkState> = digests.iter().map(|d| state(d, c as usize)).collect();
        let next = match states.iter().position(|s| *s != ChunkState::Unreadable) {
            None => {
                if !states.is_empty() {
                    out.unreadable.push(c);
                }
                None
            }
            Some(source) => {
                let want = states[source];
                let targets: Vec<usize> =
                    states.iter().enumerate().filter(|(_, s)| **s != want).map(|(i, _)| i).collect();
                let action = if want == ChunkState::Hole { RepairAction::Trim } else { RepairAction::Copy };
                (!targets.is_empty()).then_some((source, targets, action))
            }
        };
        match (&mut current, next) {
            (Some(run), Some((source, targets, action)))
                if run.first_chunk + run.chunks == c
                    && run.chunks < run_max
                    && run.source == source
                    && run.targets == targets
                    && run.action == action =>
            {
                run.chunks += 1;
            }
            (_, next) => {
                out.repairs.extend(current.take());
                current = next.map(|(source, targets, action)| Repair {
                    first_chunk: c,
                    chunks: 1,
                    source,
                    targets,
                    action,
                });
            }
        }
    }
    out.repairs.extend(current);
    out
}

#[cfg(test)]
mod tests {
    use super::ChunkState::{Data, Hole, Unreadable};
    use super::*;
    use proptest::prelude::*;

    /// Two chunks, each a record followed by its own CRC32C and zeros:
    /// their CRC32Cs are equal, their digests are not.
    #[test]
    fn digests_tell_apart_records_that_carry_their_own_crc() {
        let chunk = |writer: u8| {
            let mut b = vec![0u8; 4096];
            b[..12].copy_from_slice(b"intent hdr w");
            b[12] = writer;
            let crc = crate::crc::crc32c(&b[..13]);
            b[13..17].copy_from_slice(&crc.to_le_bytes());
            b
        };
        let (a, b) = (chunk(6), chunk(7));
        assert_ne!(a, b);
        assert_eq!(crate::crc::crc32c(&a), crate::crc::crc32c(&b), "the CRC cannot tell them apart");
        assert_ne!(chunk_digest(&a), chunk_digest(&b));
    }

    /// The digests after carrying out `plan`.
    fn apply(digests: &[Vec<ChunkState>], chunks: u32, p: &Plan) -> Vec<Vec<ChunkState>> {
        let mut out: Vec<Vec<ChunkState>> =
            digests.iter().map(|d| (0..chunks as usize).map(|c| state(d, c)).collect()).collect();
        for r in &p.repairs {
            for c in r.first_chunk..r.first_chunk + r.chunks {
                let v = out[r.source][c as usize];
                assert_ne!(v, Unreadable, "a repair copies from a replica that cannot read chunk {c}");
                for &t in &r.targets {
                    out[t][c as usize] = v;
                }
            }
        }
        out
    }

    #[test]
    fn agreeing_replicas_need_nothing() {
        let d = vec![vec![Data(1), Hole, Data(3)]; 3];
        assert_eq!(plan(&d, 3, 64), Plan::default());
        // A replica that holds nothing of the tract agrees with holes.
        assert!(plan(&[vec![Hole, Hole], vec![]], 2, 64).is_empty());
    }

    #[test]
    fn the_first_readable_replica_is_the_source() {
        // A write that reached replica 1 only: replica 0 (first) wins.
        let d = vec![vec![Data(1), Data(1)], vec![Data(9), Data(9)], vec![Data(1), Data(1)]];
        let p = plan(&d, 2, 64);
        assert_eq!(
            p.repairs,
            vec![Repair {
                first_chunk: 0,
                chunks: 2,
                source: 0,
                targets: vec![1],
                action: RepairAction::Copy
            }]
        );
        // Replica 0 torn in chunk 1: replica 1 is the source there.
        let d = vec![vec![Data(1), Unreadable], vec![Data(9), Data(9)]];
        let p = plan(&d, 2, 64);
        assert_eq!(
            p.repairs,
            vec![
                Repair { first_chunk: 0, chunks: 1, source: 0, targets: vec![1], action: RepairAction::Copy },
                Repair { first_chunk: 1, chunks: 1, source: 1, targets: vec![0], action: RepairAction::Copy },
            ]
        );
        // A hole at the source trims the others.
        let p = plan(&[vec![], vec![Data(4)]], 1, 64);
        assert_eq!(p.repairs[0].action, RepairAction::Trim);
        // Nobody can read it: reported, nothing planned.
        let p = plan(&[vec![Unreadable], vec![Unreadable]], 1, 64);
        assert_eq!((p.repairs.len(), p.unreadable), (0, vec![0]));
    }

    #[test]
    fn runs_are_bounded() {
        let d = vec![vec![Data(1); 10], vec![Hole; 10]];
        let p = plan(&d, 10, 4);
        assert_eq!(p.repairs.iter().map(|r| r.chunks).collect::<Vec<_>>(), vec![4, 4, 2]);
        assert_eq!(p.chunk_repairs(), 10);
    }

    fn any_state() -> impl Strategy<Value = ChunkState> {
        prop_oneof![Just(Hole), (0u64..3).prop_map(Data), Just(Unreadable)]
    }

    proptest! {
        /// After the repairs every chunk some replica can read holds the
        /// same thing everywhere, the source replicas are untouched, and
        /// planning again finds nothing to do.
        #[test]
        fn repairs_make_replicas_agree(
            digests in prop::collection::vec(prop::collection::vec(any_state(), 0..12), 1..4),
            run_max in 1u32..6,
        ) {
            let chunks = 12;
            let p = plan(&digests, chunks, run_max);
            let after = apply(&digests, chunks, &p);
            for c in 0..chunks as usize {
                let readable: Vec<ChunkState> =
                    after.iter().map(|d| d[c]).filter(|s| *s != Unreadable).collect();
                if p.unreadable.contains(&(c as u32)) {
                    prop_assert!(readable.is_empty());
                    continue;
                }
                prop_assert!(after.iter().all(|d| d[c] == after[0][c]), "chunk {c} still differs: {after:?}");
                let first = digests.iter().map(|d| state(d, c)).find(|s| *s != Unreadable);
                prop_assert_eq!(Some(after[0][c]), first);
            }
            prop_assert!(plan(&after, chunks, run_max).is_empty());
            for r in &p.repairs {
                prop_assert!(r.chunks <= run_max && !r.targets.contains(&r.source));
            }
        }
    }
}
