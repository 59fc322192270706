//! Reads (openraft's [`RaftLogReader`]): the newest entries come from
//! the in-memory cache, older ones from their segments, each record
//! checked against the CRC the index remembers before it is decoded.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::PathBuf;
use std::sync::Arc;

use openraft::storage::RaftLogReader;
use openraft::OptionalSend;

use super::segment::{align, decode_record, segment_name};
use super::{io_err, Loc, LogError, LogStore, Segment, READ_CHUNK_MAX, READ_RETRIES};
use crate::types::{Entry, Raft, Vote};

impl LogStore {
    /// Entries in `[start, end)` that the log holds, at most `bytes_max`
    /// encoded bytes of them (one at least).
    async fn read(&self, start: u64, end: u64, bytes_max: usize) -> Result<Vec<Entry>, LogError> {
        let mut attempt = 0;
        loop {
            let (plan, cached, generation) = {
                let s = self.inner.lock();
                let (Some(first), Some(last)) = (s.first_index(), s.locs.back().map(|l| l.log_id.index))
                else {
                    return Ok(Vec::new());
                };
                let (start, end) = (start.max(first), end.min(last + 1));
                if start >= end {
                    return Ok(Vec::new());
                }
                let mut stop = start;
                let mut bytes = 0usize;
                while stop < end {
                    let n = s.locs[(stop - first) as usize].len as usize;
                    if stop > start && bytes.saturating_add(n) > bytes_max {
                        break;
                    }
                    bytes = bytes.saturating_add(n);
                    stop += 1;
                }
                let cache_first = s.cache.front().map_or(last + 1, |(e, _)| e.log_id.index);
                let mut plan = Vec::new();
                for i in start..stop.min(cache_first) {
                    let l = s.locs[(i - first) as usize];
                    match s.segments.get(&l.seg) {
                        Some(seg) => plan.push((seg.clone(), l)),
                        None => {
                            return Err(LogError::Corrupt {
                                path: PathBuf::from(segment_name(l.seg)),
                                offset: l.offset,
                                index: i,
                                why: "its segment is not open (a bug)".into(),
                            });
                        }
                    }
                }
                let cached: Vec<Entry> = (start.max(cache_first)..stop)
                    .map(|i| s.cache[(i - cache_first) as usize].0.clone())
                    .collect();
                (plan, cached, s.generation)
            };
            match read_records(&plan).await {
                Ok(mut v) => {
                    v.extend(cached);
                    return Ok(v);
                }
                Err(e) => {
                    if attempt < READ_RETRIES && self.inner.lock().generation != generation {
                        attempt += 1;
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }
}

/// Reads and checks the records at `plan`, in order.
async fn read_records(plan: &[(Arc<Segment>, Loc)]) -> Result<Vec<Entry>, LogError> {
    let mut out = Vec::with_capacity(plan.len());
    let mut i = 0;
    while i < plan.len() {
        // A run of records back to back in one segment, one read.
        let (seg, first) = &plan[i];
        let mut j = i + 1;
        let mut end = first.offset + first.len as u64;
        while j < plan.len() {
            let (s, l) = &plan[j];
            if !Arc::ptr_eq(s, seg)
                || l.offset != align(end)
                || l.offset + l.len as u64 - first.offset > READ_CHUNK_MAX as u64
            {
                break;
            }
            end = l.offset + l.len as u64;
            j += 1;
        }
        let buf = seg
            .disk
            .read_at(first.offset, (end - first.offset) as usize)
            .await
            .map_err(io_err("reading", &seg.path))?;
        for (_, l) in &plan[i..j] {
            let at = (l.offset - first.offset) as usize;
            let rec = buf.slice(at..at + l.len as usize);
            let corrupt = |why: String| LogError::Corrupt {
                path: seg.path.clone(),
                offset: l.offset,
                index: l.log_id.index,
                why,
            };
            match decode_record(seg.salt, l.prev, &rec) {
                Ok((h, e)) if h.crc == l.crc && e.log_id == l.log_id => out.push(e),
                Ok((h, e)) => {
                    return Err(corrupt(format!(
                        "CRC {:08x} and log id {} where {:08x} and {} were written",
                        h.crc, e.log_id, l.crc, l.log_id
                    )));
                }
                Err(why) => return Err(corrupt(why.to_string())),
            }
        }
        i = j;
    }
    Ok(out)
}

/// `r` as a half-open `[start, end)`.
fn bounds(r: &impl RangeBounds<u64>) -> (u64, u64) {
    let start = match r.start_bound() {
        Bound::Included(s) => *s,
        Bound::Excluded(s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(e) => e.saturating_add(1),
        Bound::Excluded(e) => *e,
        Bound::Unbounded => u64::MAX,
    };
    (start, end)
}

impl RaftLogReader<Raft> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let (start, end) = bounds(&range);
        Ok(self.read(start, end, usize::MAX).await?)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        Ok(self.inner.lock().vote)
    }

    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry>, io::Error> {
        Ok(self.read(start, end, self.inner.cfg.read_bytes_max).await?)
    }
}
