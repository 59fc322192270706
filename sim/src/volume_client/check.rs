//! The check after each recovery: what the volume holds against the
//! operations since the last verified recovery, and how a violation is
//! explained.

use super::*;

/// Checks a volume image against the operations since the last verified
/// recovery (`ops`, in issue order, epochs from 1), given what that
/// recovery read: `base[s]`, the write id sector `s` held (0: zeros).
///
/// The base becomes acknowledged writes of epoch 0 — one per run of
/// sectors holding the same write, with ids from [`SETTLED`] — followed by
/// an acknowledged flush, and every sector of `image` that still holds its
/// base write is relabelled as that run's write. Then
/// `blizzard_crashcheck::checker::check` decides: a sector holding an
/// older write than its base is a stranger; one that lost its base write
/// without a later write or trim breaks the flush (fast-ack) or the
/// acknowledged write (write-through).
pub fn check_since(
    base: &[u64],
    ops: &[LoggedOp],
    image: &[u8],
    contract: Contract,
) -> Result<(), Violation> {
    let sectors = image.len() / SECTOR;
    if base.len() != sectors {
        return Err(Violation::TrialFailed(format!(
            "the base has {} sectors, the image {sectors}",
            base.len()
        )));
    }
    if let Some(op) = ops.iter().find(|o| o.epoch == 0 || o.id >= SETTLED) {
        return Err(Violation::TrialFailed(format!("op {op:?} collides with the base's epoch or ids")));
    }
    let runs = settled_runs(base);
    let mut log = Vec::with_capacity(ops.len() + runs.len() + 1);
    let mut run_of = vec![0u64; sectors];
    for (i, &(start, end, _)) in runs.iter().enumerate() {
        let id = SETTLED + i as u64;
        run_of[start..end].iter_mut().for_each(|r| *r = id);
        log.push(LoggedOp {
            id,
            kind: OpKind::Write,
            offset: (start * SECTOR) as u64,
            len: ((end - start) * SECTOR) as u64,
            epoch: 0,
            acked: true,
        });
    }
    let flush = SETTLED + runs.len() as u64;
    log.push(LoggedOp { id: flush, kind: OpKind::Flush, offset: 0, len: 0, epoch: 0, acked: true });
    log.extend(ops.iter().cloned());
    let mut img = image.to_vec();
    for (s, sector) in img.chunks_mut(SECTOR).enumerate() {
        let at = (s * SECTOR) as u64;
        if base[s] != 0 && matches!(parse(sector, at), Sector::Written { id, .. } if id == base[s]) {
            fill(sector, at, run_of[s], 0);
        }
    }
    check(&log, &img, contract)
}

/// Runs of consecutive sectors the base says hold one write: (first
/// sector, end sector, write id). Run `i` is write `SETTLED + i`.
fn settled_runs(base: &[u64]) -> Vec<(usize, usize, u64)> {
    let mut runs = Vec::new();
    let mut s = 0;
    while s < base.len() {
        let start = s;
        while s < base.len() && base[s] == base[start] {
            s += 1;
        }
        if base[start] != 0 {
            runs.push((start, s, base[start]));
        }
    }
    runs
}

/// A violation in words, the base's stand-in ids told as the writes they
/// stand for.
pub(super) fn explain(v: &Violation, base: &[u64]) -> String {
    let runs = settled_runs(base);
    let words: Vec<String> = v
        .to_string()
        .split(' ')
        .map(|w| {
            let digits = w.find(|c: char| !c.is_ascii_digit()).unwrap_or(w.len());
            match w[..digits].parse::<u64>() {
                Ok(id) if id >= SETTLED => match runs.get((id - SETTLED) as usize) {
                    Some((_, _, real)) => {
                        format!("{real} (as the last verified recovery read it){}", &w[digits..])
                    }
                    None => format!("(the flush after the last verified recovery){}", &w[digits..]),
                },
                _ => w.to_string(),
            }
        })
        .collect();
    let mut s = words.join(" ");
    let at = match v {
        Violation::Garbage { at }
        | Violation::Stranger { at, .. }
        | Violation::NotPrefix { at, .. }
        | Violation::LostAcknowledged { at, .. }
        | Violation::ReplicasDisagree { at, .. } => Some(*at),
        _ => None,
    };
    if let Some(at) = at {
        let was = base.get(at as usize / SECTOR).copied().unwrap_or(0);
        s.push_str(&format!(
            "; the last verified recovery read {} at that sector",
            if was == 0 { "zeros".to_string() } else { format!("write {was}") }
        ));
    }
    s
}

/// What byte `at` of a replica of tract `t` belongs to, in words: tract 0
/// by its layout (superblock copies, intent header, bitmap), data tracts
/// by the tag of the sector.
pub(super) fn describe_at(t: u64, replica: &[u8], at: usize) -> String {
    use blizzard_volume::intent::{Header, BITMAP_OFFSET, HEADER_OFFSET, PAGE};
    let (header, bitmap, page_len) = (HEADER_OFFSET as usize, BITMAP_OFFSET as usize, PAGE as usize);
    if t != 0 {
        let sector = at - at % SECTOR;
        return describe_sector(&replica[sector..sector + SECTOR]);
    }
    if at < header {
        return format!("superblock copy {}", at / (header / 2));
    }
    if at < bitmap {
        return match Header::decode(&replica[header..bitmap]) {
            Some(h) => format!("the intent header of writer {}", h.writer),
            None => "a damaged intent header".into(),
        };
    }
    let page = (at - bitmap) / page_len;
    let from = bitmap + page * page_len;
    let bits: Vec<usize> = replica[from..(from + page_len).min(replica.len())]
        .iter()
        .enumerate()
        .flat_map(|(i, b)| (0..8).filter(move |k| b >> k & 1 == 1).map(move |k| i * 8 + k))
        .collect();
    format!("intent bitmap page {page} marking tracts {bits:?}")
}

/// What a 512-byte sector of a data tract holds, by its own tag.
fn describe_sector(s: &[u8]) -> String {
    let mut at = [0u8; 8];
    at.copy_from_slice(&s[..8]);
    match parse(s, u64::from_le_bytes(at)) {
        Sector::Zero => "zeros".into(),
        Sector::Written { id, epoch } => {
            format!("write {id} (epoch {epoch}) of volume byte {}", u64::from_le_bytes(at))
        }
        Sector::Garbage => "bytes that are no sector of a write (damage)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WT: Contract = Contract { acked_writes_durable: true, acked_flushes_durable: true };
    const FA: Contract = Contract { acked_writes_durable: false, acked_flushes_durable: true };

    fn op(id: u64, kind: OpKind, offset: u64, len: u64, epoch: u64, acked: bool) -> LoggedOp {
        LoggedOp { id, kind, offset, len, epoch, acked }
    }

    fn image(writes: &[(u64, u64, u64, u64)], size: usize) -> Vec<u8> {
        let mut img = vec![0u8; size];
        for &(id, off, len, epoch) in writes {
            fill(&mut img[off as usize..(off + len) as usize], off, id, epoch);
        }
        img
    }

    fn base_of(img: &[u8]) -> Vec<u64> {
        img.chunks(SECTOR)
            .enumerate()
            .map(|(i, s)| match parse(s, (i * SECTOR) as u64) {
                Sector::Written { id, .. } => id,
                _ => 0,
            })
            .collect()
    }

    /// What the last recovery read stays unless written or trimmed since;
    /// an older write coming back, or the base vanishing, is caught, and
    /// the ops since are checked as the checker checks one run.
    #[test]
    fn checks_since_the_last_recovery() {
        // The last recovery read write 3 at [0, 1024) and write 5 at [2048, 2560).
        let before = image(&[(3, 0, 1024, 4), (5, 2048, 512, 6)], 4096);
        let base = base_of(&before);
        for c in [WT, FA] {
            assert_eq!(check_since(&base, &[], &before, c), Ok(()));
            // Zeros where the base had write 5: lost with no trim since.
            let lost = image(&[(3, 0, 1024, 4)], 4096);
            assert!(check_since(&base, &[], &lost, c).is_err());
            // Write 2, older than write 3, reappears at sector 0.
            let old = image(&[(3, 0, 1024, 4), (2, 0, 512, 3), (5, 2048, 512, 6)], 4096);
            assert!(matches!(check_since(&base, &[], &old, c), Err(Violation::Stranger { id: 2, .. })));
        }
        // Since then: write 9 (acknowledged) over part of write 3, then a
        // trim of write 5 in flight at the crash.
        let ops = [op(9, OpKind::Write, 512, 1024, 8, true), op(10, OpKind::Trim, 2048, 512, 8, false)];
        let after = image(&[(3, 0, 512, 4), (9, 512, 1024, 8), (5, 2048, 512, 6)], 4096);
        assert_eq!(check_since(&base, &ops, &after, WT), Ok(()));
        let trimmed = image(&[(3, 0, 512, 4), (9, 512, 1024, 8)], 4096);
        assert_eq!(check_since(&base, &ops, &trimmed, WT), Ok(()));
        // Write 9 lost: allowed only where it was not acknowledged (fast-ack, no flush since).
        assert!(matches!(check_since(&base, &ops, &before, WT), Err(Violation::LostAcknowledged { .. })));
        assert_eq!(check_since(&base, &ops, &before, FA), Ok(()));
        // With an acknowledged flush after it, fast-ack must keep it too.
        let flushed = [ops[0].clone(), op(10, OpKind::Flush, 0, 0, 8, true)];
        assert!(check_since(&base, &flushed, &before, FA).is_err());
    }
}
