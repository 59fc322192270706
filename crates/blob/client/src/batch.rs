//! Small writes to one tractserver that are ready together travel in one
//! request (issue 24, point 1).
//!
//! A volume at queue depth 32 and 3-way replication hands each tractserver
//! dozens of 4 KiB writes at once. Sent one by one, each costs a frame, a
//! trip through both ends' reader and writer tasks and a task on the
//! server. Here they wait in a queue per server (and per kind: durable or
//! cached). The first write into an empty queue starts a sender task; by
//! the time it runs, every write that became ready in the meantime (the
//! other requests the NBD server read in the same pass) has joined the
//! queue, and the sender takes them all, up to [`BATCH_WRITES_MAX`] writes
//! and [`BATCH_BYTES_MAX`] bytes (the rest go to the next sender, started
//! at once), and sends them as one `WriteTracts`, or as the plain request
//! when one is alone (a write at queue depth 1 goes out as it always did).
//! Nothing waits for a batch to fill or for an earlier one to finish: a
//! batch is what was ready together, so batches grow with the load and
//! vanish without it.
//!
//! The server applies each write of a batch as its own request, at once,
//! so the durable ones share its group commits; each gets its own answer.
//! What a caller sees is what the single request would have returned: the
//! same reply, or the same error (a failure of the whole batch, such as a
//! lost connection, is every write's failure). Every write of a batch goes
//! on one connection, so the session fencing of `rpc::session` holds for
//! each as it would alone.
//!
//! Writes to a server in the same process (`blizzard up`, `rpc::local`)
//! are not batched: they travel as values, with no frame to save, and a
//! batch's data would have to be joined into one buffer, a copy.
//!
//! A server too old to know `WriteTracts` answers `UnknownOpcode`; that
//! batch is then sent write by write, and the server is not sent batches
//! again (a rolling upgrade).
//!
//! This module is the pure part: the queue, the shape of a batch and what
//! its reply means for each write. `pool` runs the senders.

use std::collections::VecDeque;

use bytes::Bytes;
use tokio::sync::oneshot;

use blizzard_proto::{BatchedWrite, ErrorCode, Reply, Request, TractAddr, WRITE_BATCH_MAX};
use blizzard_rpc::RpcError;

/// Writes at most this large are batched; larger ones go alone (on the
/// bulk connection, `pool::BULK_THRESHOLD`).
pub(crate) const BATCH_WRITE_MAX: usize = crate::pool::BULK_THRESHOLD;

/// Bytes of data one batch carries at most (a single write larger than
/// this is never batched): batches travel on the small-message
/// connection, where a read waits behind them.
pub(crate) const BATCH_BYTES_MAX: usize = 256 << 10;

/// Writes one batch carries at most.
pub(crate) const BATCH_WRITES_MAX: usize = 32;
const _: () = assert!(BATCH_WRITES_MAX <= WRITE_BATCH_MAX);

/// What a batched write's caller gets back.
pub(crate) type Outcome = Result<(Reply, Bytes), RpcError>;

/// One write waiting to be sent.
pub(crate) struct Pending {
    pub(crate) addr: TractAddr,
    pub(crate) offset: u32,
    pub(crate) crcs: Vec<u32>,
    pub(crate) data: Bytes,
    pub(crate) done: oneshot::Sender<Outcome>,
}

/// The writes waiting for one server (of one kind), and whether a sender
/// is on its way to take them.
#[derive(Default)]
pub(crate) struct Queue {
    waiting: VecDeque<Pending>,
    scheduled: bool,
}

impl Queue {
    /// Queues `p`. Returns true when the caller must start a sender: none
    /// is on its way (from now on one is).
    pub(crate) fn push(&mut self, p: Pending) -> bool {
        self.waiting.push_back(p);
        !std::mem::replace(&mut self.scheduled, true)
    }

    /// The batch a sender takes: the oldest writes, as many as fit the
    /// limits (at least one if any wait), and whether the sender must
    /// start another for writes left over (then one is on its way again).
    pub(crate) fn take(&mut self) -> (Vec<Pending>, bool) {
        let mut batch: Vec<Pending> = Vec::new();
        let mut bytes = 0usize;
        while let Some(p) = self.waiting.front() {
            let fits = batch.len() < BATCH_WRITES_MAX && bytes + p.data.len() <= BATCH_BYTES_MAX;
            if !batch.is_empty() && !fits {
                break;
            }
            bytes += p.data.len();
            batch.extend(self.waiting.pop_front());
        }
        self.scheduled = !self.waiting.is_empty();
        (batch, self.scheduled)
    }

    /// Everything waiting, for a sender that cannot reach the server: it
    /// fails them all with its error.
    pub(crate) fn give_up(&mut self) -> Vec<Pending> {
        self.scheduled = false;
        self.waiting.drain(..).collect()
    }
}

/// The request for `batch` (not empty), its data, and more data pieces
/// to follow it: the plain request for a lone write, else `WriteTracts`.
pub(crate) fn request(cached: bool, batch: &[Pending]) -> (Request, Bytes, Vec<Bytes>) {
    if let [p] = batch {
        return (single(cached, p), p.data.clone(), Vec::new());
    }
    let writes = batch
        .iter()
        .map(|p| BatchedWrite {
            addr: p.addr,
            offset: p.offset,
            len: p.data.len() as u32,
            crcs: p.crcs.clone(),
        })
        .collect();
    let data = batch.first().map(|p| p.data.clone()).unwrap_or_default();
    let more = batch.iter().skip(1).map(|p| p.data.clone()).collect();
    (Request::WriteTracts { cached, writes }, data, more)
}

/// The request `p` would have been on its own.
pub(crate) fn single(cached: bool, p: &Pending) -> Request {
    single_request(cached, p.addr, p.offset, &p.crcs)
}

/// A lone write's request.
pub(crate) fn single_request(cached: bool, addr: TractAddr, offset: u32, crcs: &[u32]) -> Request {
    let crcs = crcs.to_vec();
    if cached {
        Request::WriteTractCached { addr, offset, crcs }
    } else {
        Request::WriteTract { addr, offset, crcs }
    }
}

/// Whether `res`, the answer to a batch of several, says the server does
/// not know batches (an older version): send the writes one by one.
pub(crate) fn unknown_to(res: &Outcome) -> bool {
    matches!(res, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::UnknownOpcode)
}

/// Each write's outcome from the answer to a batch of `n` (module docs):
/// a lone write's answer is its own; a batch's failure is every write's;
/// a `Reply::Batch` gives each write its own error or, for the rest, the
/// reply its single request would have had.
pub(crate) fn outcomes(addr: &str, cached: bool, n: usize, res: Outcome) -> Vec<Outcome> {
    if n == 1 {
        return vec![res];
    }
    match res {
        Err(e) => vec![Err(e); n],
        Ok((Reply::Batch { boot, failed }, _)) => {
            let ok = if cached { Reply::Boot { boot } } else { Reply::Done };
            let mut out: Vec<Outcome> = vec![Ok((ok, Bytes::new())); n];
            for f in failed {
                match out.get_mut(f.index as usize) {
                    Some(slot) => *slot = Err(RpcError::Remote { addr: addr.to_string(), reply: f.error }),
                    // A failure of a write the batch did not hold: the
                    // answer cannot be trusted for any of them.
                    None => return vec![Err(malformed(addr, "a failure index past the batch")); n],
                }
            }
            out
        }
        Ok((other, _)) => vec![Err(malformed(addr, &format!("{other:?} for a batch"))); n],
    }
}

fn malformed(addr: &str, what: &str) -> RpcError {
    RpcError::Remote {
        addr: addr.to_string(),
        reply: blizzard_proto::ErrorReply::new(
            ErrorCode::BadFrame,
            format!("the tractserver answered a batch of writes with {what}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::{BlobId, TractNo};
    use blizzard_proto::{BatchFailure, ErrorReply};

    fn pending(tract: i64, len: usize) -> (Pending, oneshot::Receiver<Outcome>) {
        let (done, rx) = oneshot::channel();
        let addr =
            TractAddr { blob: BlobId(1), incarnation: 1, tract: TractNo(tract), row_version: 1, writer: 0 };
        (
            Pending {
                addr,
                offset: 0,
                crcs: vec![tract as u32],
                data: Bytes::from(vec![tract as u8; len]),
                done,
            },
            rx,
        )
    }

    #[test]
    fn one_sender_is_on_its_way_while_writes_wait() {
        let mut q = Queue::default();
        let starts: Vec<bool> = (0..4).map(|i| q.push(pending(i, 4096).0)).collect();
        assert_eq!(starts, [true, false, false, false]);
        let (batch, more) = q.take();
        assert_eq!((batch.len(), more), (4, false), "one batch takes all that waits");
        assert!(q.push(pending(9, 1).0), "once taken, the next write starts a sender");
        assert!(!q.push(pending(10, 1).0));
        assert_eq!(q.give_up().len(), 2);
        assert!(q.push(pending(11, 1).0), "a sender that gave up is not on its way");
    }

    #[test]
    fn a_batch_keeps_the_limits_and_the_order() {
        let mut q = Queue::default();
        for i in 0..(BATCH_WRITES_MAX as i64 + 3) {
            q.push(pending(i, 64).0);
        }
        let (first, more) = q.take();
        let first: Vec<i64> = first.iter().map(|p| p.addr.tract.0).collect();
        assert_eq!(first, (0..BATCH_WRITES_MAX as i64).collect::<Vec<_>>());
        assert!(more, "the sender must start another for the rest");
        assert_eq!(q.take().0.len(), 3);

        // By bytes: four 64 KiB writes fill one; a larger write goes alone.
        for i in 0..5 {
            q.push(pending(i, 64 << 10).0);
        }
        q.push(pending(5, BATCH_BYTES_MAX + 1).0);
        assert_eq!(q.take().0.len(), 4);
        assert_eq!(q.take().0.len(), 1);
        let (last, more) = q.take();
        assert_eq!(last.iter().map(|p| p.data.len()).collect::<Vec<_>>(), [BATCH_BYTES_MAX + 1]);
        assert!(!more);
    }

    #[test]
    fn a_lone_write_is_the_plain_request_and_a_batch_lists_every_write() {
        let (a, _) = pending(1, 10);
        let (b, _) = pending(2, 20);
        let (req, data, more) = request(true, std::slice::from_ref(&a));
        assert!(matches!(req, Request::WriteTractCached { offset: 0, .. }));
        assert_eq!((data.len(), more.len()), (10, 0));
        let (req, data, more) = request(false, &[a, b]);
        let Request::WriteTracts { cached: false, writes } = req else { panic!("{req:?}") };
        assert_eq!(
            writes.iter().map(|w| (w.addr.tract.0, w.len, w.crcs.clone())).collect::<Vec<_>>(),
            [(1, 10, vec![1]), (2, 20, vec![2])]
        );
        assert_eq!((data.len(), more.iter().map(Bytes::len).collect::<Vec<_>>()), (10, vec![20]));
    }

    #[test]
    fn each_write_gets_its_own_answer() {
        let fenced = ErrorReply::new(ErrorCode::Fenced, "newer writer");
        let reply = Reply::Batch { boot: 7, failed: vec![BatchFailure { index: 1, error: fenced.clone() }] };
        let out = outcomes("ts:1", true, 3, Ok((reply.clone(), Bytes::new())));
        assert!(matches!(out[0], Ok((Reply::Boot { boot: 7 }, _))));
        assert!(matches!(&out[1], Err(RpcError::Remote { reply, .. }) if *reply == fenced));
        assert!(matches!(out[2], Ok((Reply::Boot { boot: 7 }, _))));
        let durable = outcomes("ts:1", false, 3, Ok((reply, Bytes::new())));
        assert!(matches!(durable[0], Ok((Reply::Done, _))));

        // The batch's failure is each write's; a lone write's answer is its own.
        let lost = RpcError::ConnectionLost("ts:1".into());
        assert_eq!(outcomes("ts:1", false, 2, Err(lost.clone())), vec![Err(lost.clone()), Err(lost)]);
        assert!(matches!(
            outcomes("ts:1", false, 1, Ok((Reply::Done, Bytes::new())))[..],
            [Ok((Reply::Done, _))]
        ));

        // An answer that cannot be the server's to this batch fails all.
        let stray = Reply::Batch {
            boot: 1,
            failed: vec![BatchFailure { index: 5, error: ErrorReply::new(ErrorCode::Io, "") }],
        };
        for bad in [stray, Reply::Done] {
            let out = outcomes("ts:1", false, 2, Ok((bad, Bytes::new())));
            assert!(out.iter().all(
                |o| matches!(o, Err(RpcError::Remote { reply, .. }) if reply.code == ErrorCode::BadFrame)
            ));
        }
        let old = Err(RpcError::Remote {
            addr: "ts:1".into(),
            reply: ErrorReply::new(ErrorCode::UnknownOpcode, ""),
        });
        assert!(unknown_to(&old));
    }
}
