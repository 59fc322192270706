//! The source's side of re-replication and repair: the listings, copies
//! and changes a complete member of a row serves to the row's newcomers
//! and returning members (module `fill` above).

use super::*;

/// A bitmap of `chunks` chunks with `set` marked.
pub(super) fn to_bitmap(chunks: usize, set: &[u32]) -> Vec<u8> {
    let mut b = vec![0u8; chunks.div_ceil(8)];
    for &i in set {
        b[(i / 8) as usize] |= 1 << (i % 8);
    }
    b
}

/// What a source sends a copier whose tract (same incarnation) reads
/// `have` while its own reads `mine`, chunk by chunk: the chunks to send
/// (data here and not the same CRC there, or unreadable here, to be
/// healed before it is sent) and the chunks to unmap there (a hole here,
/// anything there). Chunks equal on both sides are left alone.
pub(super) fn changed_chunks(mine: &[ChunkState], have: &[ChunkState]) -> (Vec<u32>, Vec<u32>) {
    let (mut send, mut holes) = (Vec::new(), Vec::new());
    for (i, (m, h)) in mine.iter().zip(have).enumerate() {
        match (m, h) {
            (ChunkState::Hole, ChunkState::Hole) => {}
            (ChunkState::Hole, _) => holes.push(i as u32),
            (ChunkState::Data(a), ChunkState::Data(b)) if a == b => {}
            _ => send.push(i as u32),
        }
    }
    (send, holes)
}

impl Filler {
    /// Serves `CopyTract`: the tract's present chunks with their CRCs.
    /// The caller has checked that this server is a complete member of
    /// `row` at the version asked (`TractService::check_source`).
    pub async fn serve_copy(&self, row: u32, t: RowTract) -> Result<(Reply, Bytes), ErrorReply> {
        if self.parts.rows.locate(t.blob, t.tract) != Some(row) {
            return Err(ErrorReply::new(
                ErrorCode::BadRequest,
                format!("tract {} is not in row {row}", t.tract),
            ));
        }
        let Some(inc) = self.parts.store.incarnation_of(t.blob, t.tract).await else {
            return Ok((Reply::TractCopy { incarnation: 0, bitmap: vec![], crcs: vec![] }, Bytes::new()));
        };
        let bitmap = self.parts.store.mapped(t.blob, inc, t.tract).await;
        let present: Vec<u32> = (0..bitmap.len() as u32 * 8)
            .filter(|i| bitmap[(*i / 8) as usize] & (1 << (i % 8)) != 0)
            .collect();
        let (data, crcs) = self.read_chunks(t, inc, &present).await?;
        Ok((Reply::TractCopy { incarnation: inc, bitmap, crcs }, data))
    }

    /// Serves `CopyTractChanges` (checked by the caller as for
    /// [`Filler::serve_copy`]): the chunks of the tract whose state here
    /// differs from the copier's digest `have`, and the chunks to unmap
    /// there; the whole tract if it is held here at another incarnation.
    pub async fn serve_changes(
        &self,
        row: u32,
        t: RowTract,
        incarnation: Incarnation,
        have: &[ChunkState],
    ) -> Result<(Reply, Bytes), ErrorReply> {
        let chunks = (self.parts.store.tract_size() / CHUNK_SIZE) as usize;
        let held = self.parts.store.incarnation_of(t.blob, t.tract).await;
        let mine = match held {
            Some(inc)
                if inc == incarnation
                    && have.len() == chunks
                    && self.parts.rows.locate(t.blob, t.tract) == Some(row) =>
            {
                self.parts.store.digest(t.blob, inc, t.tract).await.map_err(store_err)?
            }
            _ => Vec::new(),
        };
        if mine.len() != chunks {
            // Not held here at the copier's incarnation: the whole tract.
            return match self.serve_copy(row, t).await? {
                (Reply::TractCopy { incarnation, bitmap, crcs }, data) => {
                    Ok((Reply::TractChanges { incarnation, bitmap, crcs, holes: Vec::new() }, data))
                }
                (other, _) => {
                    Err(ErrorReply::new(ErrorCode::Internal, format!("a copy came out as {other:?}")))
                }
            };
        }
        let (send, holes) = if self.parts.store.planted(crate::store::PlantedBug::RepairKeepsStale) {
            // Planted: nothing differs.
            (Vec::new(), Vec::new())
        } else {
            changed_chunks(&mine, have)
        };
        let (data, crcs) = self.read_chunks(t, incarnation, &send).await?;
        let bitmap = to_bitmap(chunks, &send);
        Ok((Reply::TractChanges { incarnation, bitmap, crcs, holes: to_bitmap(chunks, &holes) }, data))
    }

    /// Reads chunks `present` (ascending) of a tract held here at `inc`,
    /// in runs of adjacent chunks (one read each), verified by the store,
    /// with one CRC32C per chunk.
    ///
    /// A chunk this server cannot read (torn by a power loss, or rot the
    /// scrubber has not repaired) is first healed from another complete
    /// member, as a partial write would heal it: otherwise a newcomer,
    /// which copies only from here, would wait for this tract forever (and
    /// a volume reconciling it with it), while the row's other members hold
    /// it readable.
    async fn read_chunks(
        &self,
        t: RowTract,
        inc: Incarnation,
        present: &[u32],
    ) -> Result<(Bytes, Vec<u32>), ErrorReply> {
        let mut data = Vec::new();
        let mut crcs = Vec::new();
        let mut heals = 0;
        let mut i = 0;
        while i < present.len() {
            let mut n = 1;
            while i + n < present.len() && present[i + n] == present[i] + n as u32 {
                n += 1;
            }
            let read = self
                .parts
                .store
                .read(t.blob, inc, t.tract, present[i] * CHUNK_SIZE, n as u32 * CHUNK_SIZE)
                .await;
            let (b, c) = match read {
                // Not while this server heals the tract itself: the asker
                // may be the peer it asked (`scrub::Heals`).
                Err(e @ StoreError::Corrupt { chunk, .. })
                    if heals < present.len() && !self.parts.healer.healing(t.blob, t.tract) =>
                {
                    heals += 1;
                    if self.parts.healer.heal_chunk(t.blob, inc, t.tract, chunk).await {
                        continue;
                    }
                    return Err(store_err(e));
                }
                r => r.map_err(store_err)?,
            };
            data.extend_from_slice(&b);
            crcs.extend(c);
            i += n;
        }
        Ok((Bytes::from(data), crcs))
    }

    /// Serves `ListRowTracts`: a page of the tracts this server holds in
    /// `row` (checked by the caller as for [`Filler::serve_copy`]).
    pub fn serve_list(&self, row: u32, after: Option<RowTract>) -> Reply {
        let layout = self.parts.rows.layout();
        let after = after.map(|a| (a.blob, a.tract));
        let mut tracts: Vec<RowTract> = self
            .parts
            .store
            .tracts()
            .into_iter()
            .filter(|k| after.is_none_or(|a| *k > a))
            .filter(|(b, t)| layout.locate(*b, *t) == Some(row))
            .take(ROW_TRACTS_PAGE + 1)
            .map(|(blob, tract)| RowTract { blob, tract })
            .collect();
        let more = tracts.len() > ROW_TRACTS_PAGE;
        tracts.truncate(ROW_TRACTS_PAGE);
        Reply::RowTracts { tracts, more }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repair_sends_only_chunks_that_differ() {
        use ChunkState::{Data, Hole, Unreadable};
        let mine = [Hole, Hole, Data(1), Data(2), Data(3), Unreadable, Hole, Data(7)];
        let have = [Hole, Data(5), Data(1), Data(9), Hole, Data(4), Unreadable, Unreadable];
        let (send, holes) = changed_chunks(&mine, &have);
        // 0 and 2 agree; 3 differs, 4 is missing there, 5 is healed here
        // first, 7 is unreadable there; 1 and 6 are holes here.
        assert_eq!(send, vec![3, 4, 5, 7]);
        assert_eq!(holes, vec![1, 6]);
        let same = [Data(1), Hole, Data(2)];
        assert_eq!(changed_chunks(&same, &same), (vec![], vec![]));
    }
}
