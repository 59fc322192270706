//! The prefix-consistency checker, apart from any workload: given the log
//! of operations a client issued (in program order, with their flush
//! epochs and whether each was acknowledged) and the recovered volume, it
//! decides in one pass whether the volume is a state the commit mode
//! allows:
//!
//! - **prefix** (all modes): there is an epoch R such that every write of
//!   an epoch before R is present, some writes of R may be, and none after
//!   R is. Sector by sector: the sector's content comes from position p of
//!   its own history; then R ≥ epoch(p), and every later write to the
//!   sector (missing) has epoch ≥ R.
//! - **write-through**: every acknowledged write is present.
//! - **durable flush**: every write before the last acknowledged durable
//!   flush is present. An acknowledged snapshot is a durable flush in every
//!   mode and policy (taking one makes what was acknowledged durable).
//! - **snapshots** ([`expected_snapshot`]): a snapshot reads exactly the
//!   writes before it, which had all completed when it was taken.
//! - **resizes**: a shrink to `offset` and a grow back by `len` is a trim
//!   of `[offset, offset + len)` that also closes the epoch durably (the
//!   volume flushes before it switches sizes).
//! - **rollbacks**: a rollback is in every sector's history, and writes
//!   there what the snapshot holds: a sector holding that is explained by
//!   the rollback's position as well as by the write it copies. It closes
//!   the epoch durably.
//!
//! A zero sector may be the initial state or any trim in its history; it
//! allows each of those positions.

use std::collections::HashMap;

use crate::tag::{parse, Sector, SECTOR};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Write,
    Trim,
    Flush,
    /// A snapshot named `s{id}`; it closes the epoch, as a flush does.
    Snapshot,
    /// A shrink to `offset` bytes, then a grow back by `len`: the bytes
    /// past `offset` read as zeros after. It closes the epoch durably.
    Resize,
    /// Deletes the snapshot that op `offset` took. The volume and every
    /// other snapshot read as before.
    DeleteSnapshot,
    /// Rolls the volume back to the snapshot op `offset` took: every
    /// sector then holds what the snapshot holds there. It closes the
    /// epoch durably.
    Rollback,
}

#[derive(Clone, Debug)]
pub struct LoggedOp {
    pub id: u64,
    pub kind: OpKind,
    pub offset: u64,
    pub len: u64,
    /// Flushes issued before this op (program order).
    pub epoch: u64,
    /// The client saw this op complete before the crash.
    pub acked: bool,
}

/// What the checker must enforce beyond prefix consistency.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Contract {
    /// Acknowledged writes are durable (write-through).
    pub acked_writes_durable: bool,
    /// Acknowledged flushes make earlier writes durable (durable policy).
    pub acked_flushes_durable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("sector at {at} is damaged or misplaced")]
    Garbage { at: u64 },
    #[error("sector at {at} holds write {id}, which never wrote there")]
    Stranger { at: u64, id: u64 },
    #[error("not prefix-consistent: sector at {at} needs epoch R in [{lo}, {hi}] but the rest of the volume needs R in [{glo}, {ghi}]")]
    NotPrefix { at: u64, lo: u64, hi: u64, glo: u64, ghi: u64 },
    #[error("acknowledged write {id} is missing at sector {at} (it holds {found})")]
    LostAcknowledged { at: u64, id: u64, found: String },
    #[error("in the snapshot: {0}")]
    InSnapshot(Box<Violation>),
    #[error("snapshot {name} was deleted (acknowledged) but opens after the crash")]
    DeletedSnapshotRemains { name: String },
    #[error("snapshot {name} was acknowledged but is gone after the crash ({why})")]
    LostSnapshot { name: String, why: String },
    #[error("snapshot {name}: sector at {at} holds {found} where it must hold {want}")]
    SnapshotDiffers { name: String, at: u64, found: String, want: String },
    #[error("the volume came back {size} bytes long (a resize cut off), and grown back it reads {found} at {at}: past its size it must read zeros")]
    OldDataPastSize { size: u64, at: u64, found: String },
    #[error("the volume could not be recovered: {0}")]
    Unrecoverable(String),
    #[error("the trial could not run: {0}")]
    TrialFailed(String),
    #[error("an acknowledged durable flush closed epoch {epoch}, so every write up to it must survive, but a write of epoch {missing} is missing (sector at {at} holds {found})")]
    LostFlushed { epoch: u64, missing: u64, at: u64, found: String },
    #[error("sector at {at} reads as {first} from replica {a} but as {second} from replica {b}: it would change with no write between two reads")]
    ReplicasDisagree { at: u64, a: usize, first: String, b: usize, second: String },
}

fn describe(s: &[u8], at: u64) -> String {
    match parse(s, at) {
        Sector::Zero => "zeros".into(),
        Sector::Written { id, epoch } => format!("write {id} (epoch {epoch})"),
        Sector::Garbage => "garbage".into(),
    }
}

/// Checks that reading the recovered volume through each replica in turn
/// (`images[r]`: every read served by replica `r` where it could be) gives
/// the same bytes: a sector that differs would read one way now and
/// another way later, with no write in between.
pub fn check_replicas_agree<I: AsRef<[u8]>>(images: &[I]) -> Result<(), Violation> {
    let Some((first, rest)) = images.split_first() else { return Ok(()) };
    let first = first.as_ref();
    for (i, other) in rest.iter().enumerate() {
        let other = other.as_ref();
        if other == first {
            continue;
        }
        if other.len() != first.len() {
            return Err(Violation::Unrecoverable(format!(
                "the volume read {} bytes through replica 0 but {} through replica {}",
                first.len(),
                other.len(),
                i + 1
            )));
        }
        if let Some(s) = first.chunks(SECTOR).zip(other.chunks(SECTOR)).position(|(x, y)| x != y) {
            let at = (s * SECTOR) as u64;
            let r = s * SECTOR..(s + 1) * SECTOR;
            return Err(Violation::ReplicasDisagree {
                at,
                a: 0,
                first: describe(&first[r.clone()], at),
                b: i + 1,
                second: describe(&other[r], at),
            });
        }
    }
    Ok(())
}

/// Checks a recovered volume image against the op log.
pub fn check(ops: &[LoggedOp], image: &[u8], contract: Contract) -> Result<(), Violation> {
    // A rollback cut off by the crash (the last op: nothing is issued
    // after one until it returns) is all or nothing: the volume without
    // it, or exactly its snapshot.
    if let Some((last, before)) = ops.split_last().filter(|(l, _)| l.kind == OpKind::Rollback && !l.acked) {
        let without = check(before, image, contract);
        let at = before.iter().position(|s| s.kind == OpKind::Snapshot && s.id == last.offset);
        let restored = at.and_then(|at| expected_snapshot(ops, at, image.len()));
        return match (without, restored) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(img)) if img[..] == image[..] => Ok(()),
            (Err(e), _) => Err(e),
        };
    }
    let sectors = image.len() / SECTOR;
    // What each rollback writes: the snapshot's image (`None`: unknown,
    // any content is allowed at its position).
    let restored: HashMap<usize, Option<Vec<u8>>> = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| o.kind == OpKind::Rollback)
        .map(|(i, o)| {
            let at = ops[..i].iter().position(|s| s.kind == OpKind::Snapshot && s.id == o.offset);
            (i, at.and_then(|at| expected_snapshot(ops, at, image.len())))
        })
        .collect();
    // History per sector: indexes into `ops` of writes, trims and
    // rollbacks, in order.
    let mut history: Vec<Vec<u32>> = vec![Vec::new(); sectors];
    for (i, op) in ops.iter().enumerate() {
        if matches!(op.kind, OpKind::Flush | OpKind::Snapshot | OpKind::DeleteSnapshot) {
            continue;
        }
        if op.kind == OpKind::Rollback {
            for h in history.iter_mut() {
                h.push(i as u32);
            }
            continue;
        }
        let first = (op.offset / SECTOR as u64) as usize;
        let last = ((op.offset + op.len).div_ceil(SECTOR as u64) as usize).min(sectors);
        for h in history.iter_mut().take(last).skip(first) {
            h.push(i as u32);
        }
    }
    let by_id: HashMap<u64, usize> = ops.iter().enumerate().map(|(i, o)| (o.id, i)).collect();
    const INF: u64 = u64::MAX;
    let (mut glo, mut ghi) = (0u64, INF);
    // The sector that set `ghi`, and what it holds (for the violation).
    let mut ghi_by: Option<(u64, String)> = None;
    // Zero sectors with several possible origins are checked after the
    // single-origin sectors have narrowed R.
    let mut ambiguous: Vec<(u64, Vec<(u64, u64)>)> = Vec::new();
    for (s, hist) in history.iter().enumerate() {
        let at = (s * SECTOR) as u64;
        let bytes = &image[s * SECTOR..(s + 1) * SECTOR];
        let content = parse(bytes, at);
        // Rollbacks in this sector's history that wrote exactly `bytes`.
        let rolled = hist.iter().enumerate().filter(|(_, h)| {
            restored.get(&(**h as usize)).is_some_and(|img| {
                img.as_ref().is_none_or(|img| img.get(s * SECTOR..(s + 1) * SECTOR) == Some(bytes))
            })
        });
        // Positions p in the history (None = initial state) the content can be.
        let positions: Vec<Option<usize>> = match content {
            Sector::Garbage => return Err(Violation::Garbage { at }),
            Sector::Written { id, .. } => {
                let own = by_id.get(&id).and_then(|i| hist.iter().position(|h| *h as usize == *i));
                let p: Vec<Option<usize>> = own.into_iter().chain(rolled.map(|(p, _)| p)).map(Some).collect();
                if p.is_empty() {
                    return Err(Violation::Stranger { at, id });
                }
                p
            }
            Sector::Zero => std::iter::once(None)
                .chain(
                    hist.iter()
                        .enumerate()
                        .filter(|(_, h)| matches!(ops[**h as usize].kind, OpKind::Trim | OpKind::Resize))
                        .map(|(p, _)| Some(p)),
                )
                .chain(rolled.map(|(p, _)| p).map(Some))
                .collect(),
        };
        // The latest acknowledged op must be at or before the content's position.
        let must = if contract.acked_writes_durable {
            hist.iter().rposition(|h| ops[*h as usize].acked)
        } else {
            None
        };
        let intervals: Vec<(u64, u64)> = positions
            .iter()
            .filter(|p| must.is_none_or(|m| p.is_some_and(|p| p >= m)))
            .map(|p| {
                let lo = p.map(|p| ops[hist[p] as usize].epoch).unwrap_or(0);
                let next = p.map(|p| p + 1).unwrap_or(0);
                let hi = hist.get(next).map(|h| ops[*h as usize].epoch).unwrap_or(INF);
                (lo, hi)
            })
            .collect();
        if intervals.is_empty() {
            let m = must.map(|m| ops[hist[m] as usize].id).unwrap_or(0);
            let found = match content {
                Sector::Written { id, .. } => format!("write {id}"),
                _ => "zeros".into(),
            };
            return Err(Violation::LostAcknowledged { at, id: m, found });
        }
        if let [(lo, hi)] = intervals[..] {
            if lo > ghi || hi < glo || lo > hi {
                return Err(Violation::NotPrefix { at, lo, hi, glo, ghi });
            }
            glo = glo.max(lo);
            if hi < ghi {
                ghi = hi;
                ghi_by = Some((at, describe(&image[s * SECTOR..(s + 1) * SECTOR], at)));
            }
        } else {
            ambiguous.push((at, intervals));
        }
    }
    {
        // Epochs before the last acknowledged durable flush (or snapshot)
        // must be complete: R must reach past it.
        let flushed = ops
            .iter()
            .filter(|o| o.acked)
            .filter(|o| match o.kind {
                OpKind::Flush => contract.acked_flushes_durable,
                OpKind::Snapshot | OpKind::Resize | OpKind::Rollback => true,
                _ => false,
            })
            .map(|o| o.epoch + 1)
            .max();
        if let Some(f) = flushed {
            if f > ghi {
                let (at, found) = ghi_by.unwrap_or((0, String::from("nothing")));
                return Err(Violation::LostFlushed { epoch: f - 1, missing: ghi, at, found });
            }
            glo = glo.max(f);
        }
    }
    // Find an R in [glo, ghi] that every ambiguous (zero) sector allows.
    let mut candidates: Vec<u64> = vec![glo];
    for (_, ivs) in &ambiguous {
        candidates.extend(ivs.iter().map(|(lo, _)| *lo).filter(|lo| *lo >= glo && *lo <= ghi));
    }
    candidates.sort_unstable();
    candidates.dedup();
    let found = candidates
        .into_iter()
        .any(|c| ambiguous.iter().all(|(_, ivs)| ivs.iter().any(|(lo, hi)| *lo <= c && c <= *hi)));
    if !found {
        let (at, ivs) = &ambiguous[0];
        let (lo, hi) = ivs[0];
        return Err(Violation::NotPrefix { at: *at, lo, hi, glo, ghi });
    }
    Ok(())
}

/// A volume found `size` bytes long after a crash (a shrink's switch
/// happened, its grow back did not) and then grown back must read zeros
/// past `size`, whatever the shrink's own trims had done.
pub fn check_zero_past(image: &[u8], size: u64) -> Result<(), Violation> {
    let from = (size as usize).min(image.len());
    match image[from..].chunks(SECTOR).position(|s| s.iter().any(|&b| b != 0)) {
        None => Ok(()),
        Some(s) => {
            let at = from as u64 + (s * SECTOR) as u64;
            let r = from + s * SECTOR..(from + (s + 1) * SECTOR).min(image.len());
            Err(Violation::OldDataPastSize { size, at, found: describe(&image[r], at) })
        }
    }
}

/// What snapshot op `ops[at]` must read: every write and trim before it,
/// in order (the workload issues a snapshot only once everything before
/// it completed). `None` when one of them was not acknowledged (it failed:
/// what it left is unknown).
pub fn expected_snapshot(ops: &[LoggedOp], at: usize, size: usize) -> Option<Vec<u8>> {
    let mut img = vec![0u8; size];
    for op in &ops[..at] {
        let range = op.offset as usize..((op.offset + op.len) as usize).min(size);
        match op.kind {
            OpKind::Write if !op.acked => return None,
            OpKind::Trim | OpKind::Resize if !op.acked => return None,
            OpKind::Write => crate::tag::fill(&mut img[range], op.offset, op.id, op.epoch),
            OpKind::Trim | OpKind::Resize => img[range].fill(0),
            OpKind::Rollback if !op.acked => return None,
            OpKind::Rollback => {
                let at = ops[..at].iter().position(|s| s.kind == OpKind::Snapshot && s.id == op.offset)?;
                img = expected_snapshot(ops, at, size)?;
            }
            OpKind::Flush | OpKind::Snapshot | OpKind::DeleteSnapshot => {}
        }
    }
    Some(img)
}

/// Checks snapshot `name`'s image against what it must read.
pub fn check_snapshot(name: &str, want: &[u8], got: &[u8]) -> Result<(), Violation> {
    if want.len() != got.len() {
        return Err(Violation::SnapshotDiffers {
            name: name.into(),
            at: 0,
            found: format!("{} bytes", got.len()),
            want: format!("{} bytes", want.len()),
        });
    }
    match want.chunks(SECTOR).zip(got.chunks(SECTOR)).position(|(w, g)| w != g) {
        None => Ok(()),
        Some(s) => {
            let at = (s * SECTOR) as u64;
            let r = s * SECTOR..(s + 1) * SECTOR;
            Err(Violation::SnapshotDiffers {
                name: name.into(),
                at,
                found: describe(&got[r.clone()], at),
                want: describe(&want[r], at),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tag::fill;

    fn op(id: u64, kind: OpKind, offset: u64, len: u64, epoch: u64, acked: bool) -> LoggedOp {
        LoggedOp { id, kind, offset, len, epoch, acked }
    }

    fn image_with(writes: &[(u64, u64, u64, u64)], size: usize) -> Vec<u8> {
        let mut img = vec![0u8; size];
        for &(id, off, len, epoch) in writes {
            fill(&mut img[off as usize..(off + len) as usize], off, id, epoch);
        }
        img
    }

    const FAST: Contract = Contract { acked_writes_durable: false, acked_flushes_durable: false };

    /// Prefixes pass; a later epoch present while an earlier one is
    /// missing fails; acknowledged writes and flushes are enforced.
    #[test]
    fn catches_what_it_must() {
        let ops = vec![
            op(1, OpKind::Write, 0, 1024, 0, true),
            op(2, OpKind::Flush, 0, 0, 0, true),
            op(3, OpKind::Write, 1024, 512, 1, true),
            op(4, OpKind::Flush, 0, 0, 1, false),
            op(5, OpKind::Write, 0, 512, 2, true),
        ];
        // All present, nothing present, epochs 0..1 only: prefixes.
        let all = image_with(&[(1, 0, 1024, 0), (3, 1024, 512, 1), (5, 0, 512, 2)], 4096);
        assert_eq!(check(&ops, &all, FAST), Ok(()));
        assert_eq!(check(&ops, &[0u8; 4096], FAST), Ok(()));
        let first_two = image_with(&[(1, 0, 1024, 0), (3, 1024, 512, 1)], 4096);
        assert_eq!(check(&ops, &first_two, FAST), Ok(()));
        // Epoch 2 present without epoch 1: not a prefix.
        let hole = image_with(&[(1, 0, 1024, 0), (5, 0, 512, 2)], 4096);
        assert!(matches!(check(&ops, &hole, FAST), Err(Violation::NotPrefix { .. })));
        // The acknowledged flush of epoch 0 makes write 1 durable.
        let durable = Contract { acked_writes_durable: false, acked_flushes_durable: true };
        assert!(matches!(check(&ops, &[0u8; 4096], durable), Err(Violation::LostFlushed { .. })));
        assert_eq!(check(&ops, &image_with(&[(1, 0, 1024, 0)], 4096), durable), Ok(()));
        // Write-through: every acknowledged write present.
        let wt = Contract { acked_writes_durable: true, acked_flushes_durable: true };
        assert!(matches!(check(&ops, &first_two, wt), Err(Violation::LostAcknowledged { .. })));
        assert_eq!(check(&ops, &all, wt), Ok(()));
        // Damage and strangers.
        let mut bad = all.clone();
        bad[700] ^= 1;
        assert!(matches!(check(&ops, &bad, FAST), Err(Violation::Garbage { .. })));
        let stranger = image_with(&[(3, 0, 512, 1)], 4096);
        assert!(matches!(check(&ops, &stranger, FAST), Err(Violation::Stranger { .. })));
    }

    /// Replicas that read alike pass; one sector differing is reported
    /// with what each replica holds there.
    #[test]
    fn replica_disagreement_is_reported() {
        let a = image_with(&[(1, 0, 1024, 0), (2, 1024, 512, 0)], 2048);
        assert_eq!(check_replicas_agree(&[a.clone(), a.clone(), a.clone()]), Ok(()));
        let b = image_with(&[(1, 0, 1024, 0)], 2048);
        match check_replicas_agree(&[a.clone(), a, b]) {
            Err(Violation::ReplicasDisagree { at: 1024, a: 0, b: 2, first, second }) => {
                assert_eq!((first.as_str(), second.as_str()), ("write 2 (epoch 0)", "zeros"));
            }
            other => panic!("expected a disagreement at 1024, got {other:?}"),
        }
    }

    /// A snapshot must read exactly the writes before it; an acknowledged
    /// one makes them durable in the volume, whatever the flush policy.
    #[test]
    fn snapshots_are_exact_and_durable() {
        let ops = vec![
            op(1, OpKind::Write, 0, 1024, 0, true),
            op(2, OpKind::Trim, 512, 512, 0, true),
            op(3, OpKind::Snapshot, 0, 0, 0, true),
            op(4, OpKind::Write, 0, 512, 1, true),
        ];
        let want = expected_snapshot(&ops, 2, 2048).expect("all acknowledged");
        assert_eq!(want, image_with(&[(1, 0, 512, 0)], 2048));
        assert_eq!(check_snapshot("s3", &want, &want), Ok(()));
        let with_4 = image_with(&[(4, 0, 512, 1)], 2048);
        assert!(matches!(
            check_snapshot("s3", &want, &with_4),
            Err(Violation::SnapshotDiffers { at: 0, .. })
        ));
        // The volume lost write 1, which the acknowledged snapshot made durable.
        assert!(matches!(check(&ops, &[0u8; 2048], FAST), Err(Violation::LostFlushed { .. })));
        assert_eq!(check(&ops, &want, FAST), Ok(()));
    }

    /// A rollback writes what its snapshot holds into every sector: once
    /// acknowledged, the volume must hold exactly that (and what came
    /// after); cut off, the old volume is allowed too, a mix is not.
    #[test]
    fn rollbacks_restore_the_snapshot() {
        let mut ops = vec![
            op(1, OpKind::Write, 0, 1024, 0, true),
            op(2, OpKind::Snapshot, 0, 0, 0, true),
            op(3, OpKind::Write, 0, 1024, 1, true),
            op(4, OpKind::Rollback, 2, 0, 1, true),
            op(5, OpKind::Write, 1024, 512, 2, true),
        ];
        let rolled = image_with(&[(1, 0, 1024, 0), (5, 1024, 512, 2)], 2048);
        assert_eq!(check(&ops, &rolled, FAST), Ok(()));
        assert_eq!(expected_snapshot(&ops, 5, 2048), Some(rolled.clone()));
        // Write 3 still there: the acknowledged rollback is lost.
        let kept = image_with(&[(3, 0, 1024, 1), (5, 1024, 512, 2)], 2048);
        assert!(check(&ops, &kept, FAST).is_err());
        // Cut off (and what came after never issued): old or snapshot,
        // not one sector of each where every acknowledged write is durable
        // (in fast-ack the mix is write 3 partly lost: allowed).
        ops[3].acked = false;
        ops.truncate(4);
        let wt = Contract { acked_writes_durable: true, acked_flushes_durable: true };
        assert_eq!(check(&ops, &image_with(&[(3, 0, 1024, 1)], 2048), wt), Ok(()));
        assert_eq!(check(&ops, &image_with(&[(1, 0, 1024, 0)], 2048), wt), Ok(()));
        let mix = image_with(&[(1, 0, 512, 0), (3, 512, 512, 1)], 2048);
        assert!(check(&ops, &mix, wt).is_err());
        assert_eq!(check(&ops, &mix, FAST), Ok(()));
    }

    /// A zero sector may be a trim: write, trim, write again.
    #[test]
    fn trims_explain_zeros() {
        let ops = vec![
            op(1, OpKind::Write, 0, 512, 0, true),
            op(2, OpKind::Flush, 0, 0, 0, true),
            op(3, OpKind::Trim, 0, 512, 1, true),
            op(4, OpKind::Flush, 0, 0, 1, true),
            op(5, OpKind::Write, 512, 512, 2, true),
        ];
        let durable = Contract { acked_writes_durable: false, acked_flushes_durable: true };
        let img = image_with(&[(5, 512, 512, 2)], 1024);
        assert_eq!(check(&ops, &img, durable), Ok(()));
        // Zeros at sector 0 with write 5 present can only be the trim.
        let img = image_with(&[(1, 0, 512, 0), (5, 512, 512, 2)], 1024);
        assert!(check(&ops, &img, durable).is_err());
    }
}
