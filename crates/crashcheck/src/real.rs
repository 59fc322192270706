//! The crash check with real processes. A client process drives a tagged
//! random workload against a volume on real tractservers and records, in an
//! append-only event log, every operation *before* issuing it and every
//! acknowledgment *after* receiving it. Another process SIGKILLs it at a
//! random moment, reopens the volume (which runs recovery), reads it in one
//! pass and checks it against the log.
//!
//! Why the log is trustworthy after a SIGKILL: each event is one `write(2)`
//! to a file, which the kernel keeps when the process dies. An issue
//! record always precedes the operation, so every write that can have
//! landed is known. An acknowledgment the client received but had not yet
//! recorded is treated as unacknowledged, which only relaxes the check for
//! that operation; it can never produce a false violation.
//!
//! Log lines: `I <id> <W|T|F> <offset> <len> <epoch>` and `A <id>`.

use std::sync::Arc;

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use blizzard_volume::{CommitMode, FlushPolicy, Volume};

use crate::checker::{check, Contract, LoggedOp, OpKind, Violation};
use crate::run::plan_ops;
use crate::tag::fill;

/// One line of the event log.
#[derive(Clone, Debug)]
pub enum Event {
    /// About to issue this operation.
    Issue(LoggedOp),
    /// The operation with this id completed successfully.
    Ack(u64),
}

impl Event {
    pub fn encode(&self) -> String {
        match self {
            Event::Issue(op) => {
                let k = match op.kind {
                    OpKind::Write => 'W',
                    OpKind::Trim => 'T',
                    OpKind::Flush => 'F',
                    OpKind::Snapshot => 'S',
                    OpKind::Resize => 'R',
                    OpKind::DeleteSnapshot => 'D',
                    OpKind::Rollback => 'B',
                };
                format!("I {} {k} {} {} {}\n", op.id, op.offset, op.len, op.epoch)
            }
            Event::Ack(id) => format!("A {id}\n"),
        }
    }
}

/// Rebuilds the op log from the event log. A torn last line (the process
/// died inside a write) is ignored; anything else malformed is an error.
pub fn parse_log(text: &str) -> Result<Vec<LoggedOp>, String> {
    let mut ops: Vec<LoggedOp> = Vec::new();
    let lines: Vec<&str> = text.split('\n').collect();
    let complete = if text.ends_with('\n') { lines.len() - 1 } else { lines.len().saturating_sub(1) };
    for (n, line) in lines[..complete].iter().enumerate() {
        let f: Vec<&str> = line.split(' ').collect();
        let num = |i: usize| -> Result<u64, String> {
            f.get(i)
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("event log line {}: bad field {i} in {line:?}", n + 1))
        };
        match f.first() {
            Some(&"I") => {
                let kind = match f.get(2) {
                    Some(&"W") => OpKind::Write,
                    Some(&"T") => OpKind::Trim,
                    Some(&"F") => OpKind::Flush,
                    Some(&"S") => OpKind::Snapshot,
                    Some(&"R") => OpKind::Resize,
                    Some(&"D") => OpKind::DeleteSnapshot,
                    Some(&"B") => OpKind::Rollback,
                    _ => return Err(format!("event log line {}: bad kind in {line:?}", n + 1)),
                };
                let op = LoggedOp {
                    id: num(1)?,
                    kind,
                    offset: num(3)?,
                    len: num(4)?,
                    epoch: num(5)?,
                    acked: false,
                };
                if ops.last().is_some_and(|l| l.id >= op.id) {
                    return Err(format!("event log line {}: ids must increase", n + 1));
                }
                ops.push(op);
            }
            Some(&"A") => {
                let id = num(1)?;
                match ops.binary_search_by_key(&id, |o| o.id) {
                    Ok(i) => ops[i].acked = true,
                    Err(_) => return Err(format!("event log line {}: ack of unknown op {id}", n + 1)),
                }
            }
            _ => return Err(format!("event log line {}: unknown event {line:?}", n + 1)),
        }
    }
    Ok(ops)
}

/// Drives `ops_max` random tagged operations (seeded) against `vol` with
/// up to `depth` in flight, calling `record` for every event in the order
/// the log needs. Returns when the workload is done (or never, when the
/// process is killed first, which is the point).
pub async fn drive_logged(
    vol: Arc<Volume>,
    seed: u64,
    ops_max: usize,
    depth: usize,
    mut record: impl FnMut(&Event),
) -> Result<(), String> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let planned = plan_ops(&mut rng, vol.size(), ops_max);
    type Done = (u64, Result<(), blizzard_volume::VolumeError>);
    let mut inflight: FuturesUnordered<futures::future::BoxFuture<'static, Done>> = FuturesUnordered::new();
    let mut ranges: Vec<(u64, u64, u64)> = Vec::new();
    for op in planned {
        // As in the simulated trials: no flush before earlier writes
        // complete, no overlapping writes at once.
        loop {
            let blocked = match op.kind {
                OpKind::Flush
                | OpKind::Snapshot
                | OpKind::Resize
                | OpKind::DeleteSnapshot
                | OpKind::Rollback => !ranges.is_empty(),
                _ => ranges.iter().any(|(_, a, b)| *a < op.offset + op.len && op.offset < *b),
            } || ranges.len() >= depth;
            if !blocked {
                break;
            }
            match inflight.next().await {
                Some((id, r)) => {
                    ranges.retain(|(j, _, _)| *j != id);
                    r.map_err(|e| format!("op {id} failed: {e}"))?;
                    record(&Event::Ack(id));
                }
                None => break,
            }
        }
        record(&Event::Issue(op.clone()));
        match op.kind {
            OpKind::Flush => {
                vol.flush().await.map_err(|e| format!("flush {} failed: {e}", op.id))?;
                record(&Event::Ack(op.id));
            }
            OpKind::Snapshot => {
                let name = crate::run::snapshot_name(op.id);
                vol.snapshot(&name).await.map_err(|e| format!("snapshot {name} failed: {e}"))?;
                record(&Event::Ack(op.id));
            }
            OpKind::Rollback => {
                let name = crate::run::snapshot_name(op.offset);
                vol.rollback(&name).await.map_err(|e| format!("rolling back to {name} failed: {e}"))?;
                record(&Event::Ack(op.id));
            }
            OpKind::DeleteSnapshot => {
                let name = crate::run::snapshot_name(op.offset);
                vol.delete_snapshot(&name)
                    .await
                    .map_err(|e| format!("deleting snapshot {name} failed: {e}"))?;
                record(&Event::Ack(op.id));
            }
            OpKind::Resize => {
                crate::run::shrink_and_grow(&*vol, op.offset, op.len)
                    .await
                    .map_err(|e| format!("resize {} failed: {e}", op.id))?;
                record(&Event::Ack(op.id));
            }
            OpKind::Write | OpKind::Trim => {
                ranges.push((op.id, op.offset, op.offset + op.len));
                let vol = vol.clone();
                inflight.push(Box::pin(async move {
                    let r = if op.kind == OpKind::Write {
                        let mut b = vec![0u8; op.len as usize];
                        fill(&mut b, op.offset, op.id, op.epoch);
                        vol.write(op.offset, Bytes::from(b), false).await
                    } else {
                        vol.trim(op.offset, op.len).await
                    };
                    (op.id, r)
                }));
            }
        }
    }
    while let Some((id, r)) = inflight.next().await {
        r.map_err(|e| format!("op {id} failed: {e}"))?;
        record(&Event::Ack(id));
    }
    Ok(())
}

/// What a volume's commit mode and flush policy promise.
pub fn contract_for(mode: CommitMode, flush: FlushPolicy) -> Contract {
    Contract {
        acked_writes_durable: mode == CommitMode::WriteThrough,
        acked_flushes_durable: mode == CommitMode::WriteThrough || flush == FlushPolicy::Durable,
    }
}

/// Reads the (just recovered) volume in one pass and checks it against the
/// op log under the volume's own contract.
pub async fn verify(vol: &Volume, ops: &[LoggedOp]) -> Result<(), Violation> {
    let sb = vol.superblock();
    let contract = contract_for(sb.mode, sb.flush);
    let img = vol.read(0, vol.size()).await.map_err(|e| Violation::Unrecoverable(e.to_string()))?;
    check(ops, &img, contract)
}

/// A seed for the next run, from a time-like number.
pub fn seed_from(x: u64) -> u64 {
    SmallRng::seed_from_u64(x).random()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_round_trips_and_tolerates_a_torn_tail() {
        let w = LoggedOp { id: 1, kind: OpKind::Write, offset: 4096, len: 512, epoch: 0, acked: false };
        let f = LoggedOp { id: 2, kind: OpKind::Flush, offset: 0, len: 0, epoch: 0, acked: false };
        let mut text = String::new();
        for e in [Event::Issue(w.clone()), Event::Issue(f.clone()), Event::Ack(1)] {
            text.push_str(&e.encode());
        }
        text.push_str("A 2"); // torn: no newline
        let ops = parse_log(&text).unwrap_or_default();
        assert_eq!(ops.len(), 2);
        assert!(ops[0].acked);
        assert!(!ops[1].acked, "the torn ack must not count");
        assert_eq!((ops[0].offset, ops[0].len, ops[1].kind), (4096, 512, OpKind::Flush));
        assert!(parse_log("A 7\n").is_err(), "an ack of an unknown op is an error");
        assert!(parse_log("X\n").is_err());
    }
}
