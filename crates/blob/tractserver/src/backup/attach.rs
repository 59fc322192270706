//! Attaching a tractserver's backup journal at start: open (or format) its
//! areas, decide what to do with the second one ([`plan_second_area`],
//! pure), and hand both to the store, which replays what they hold.
//!
//! What start does with the second area (`journal.rs`, "Areas"), by what
//! the first area's head names and what was given:
//!
//! | head names   | `--journal-overflow` given, holding | done |
//! |--------------|--------------------------------------|------|
//! | none         | not given                            | no second area |
//! | none         | nothing, or a journal for this disk  | formatted (a new id; a journal the head does not name holds no acknowledged write of this one) and named in the head |
//! | area X       | not given                            | refuse: X may hold acknowledged writes |
//! | area X       | area X                               | opened, scanned and replayed with the first |
//! | area X       | nothing, or another journal          | refuse: the wrong file |
//! | either       | something that is not a journal, or a journal of another disk | refuse |

use std::time::Duration;

use blizzard_env::{Disk, Env};
use std::sync::Arc;

use super::format::RING_START;
use super::journal::{BackupJournal, JournalError, Scan};
use crate::server::{JournalConfig, TractServerError};
use crate::store::{Replayed, Store, StoreError};

/// What to do with the second area ([`plan_second_area`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum SecondArea {
    None,
    /// Use the area found: it is the one the head names.
    Open,
    /// Format the file given and name it in the head.
    Format,
    Refuse(String),
}

/// The module's table. `named`: the second area the first area's head
/// names (0: none). `given`: `None` if no second area was given, else the
/// id of the journal found on it (`None`: it holds none yet).
pub(crate) fn plan_second_area(named: u128, given: Option<Option<u128>>) -> SecondArea {
    match (named, given) {
        (0, None) => SecondArea::None,
        (0, Some(_)) => SecondArea::Format,
        (x, None) => SecondArea::Refuse(format!(
            "the journal has a second area (id {x:032x}) that may hold acknowledged writes; give its path with --journal-overflow (blizzard up: leave --journal-overflow-size above 0)"
        )),
        (x, Some(Some(id))) if id == x => SecondArea::Open,
        (x, Some(found)) => SecondArea::Refuse(format!(
            "the file given as the journal's second area holds {}, not the area the journal names (id {x:032x}); give the right --journal-overflow path",
            found.map_or("no journal".to_string(), |f| format!("journal {f:032x}"))
        )),
    }
}

/// One area, opened: `None` if it holds no journal yet (all-zero heads).
async fn open_area(
    disk: &Arc<dyn Disk>,
    disk_id: u128,
    tract_size: u32,
) -> Result<Option<(BackupJournal, Scan)>, String> {
    match BackupJournal::open(disk.clone(), disk_id, tract_size).await {
        Ok(j) => Ok(Some(j)),
        Err(JournalError::NotFormatted) => {
            // Only a device that holds nothing yet is made a journal: a
            // wrong path must not cost another file its first 8 KiB.
            let heads = disk.read_at(0, RING_START as usize).await.map_err(|e| e.to_string())?;
            if heads.iter().any(|&b| b != 0) {
                return Err(
                    "it holds something that is not a blizzard backup journal; give a new file or an empty device"
                        .into(),
                );
            }
            Ok(None)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Opens this disk's backup journal and its second area (formatting what
/// is new, module docs) and attaches them to the store, replaying what
/// they hold. A replay the data disk refuses (full, failing) released
/// nothing: it is tried again every second until it succeeds, and nothing
/// is served meanwhile, since the disk lacks acknowledged writes.
pub(crate) async fn attach_journal(
    env: &Env,
    store: &Store,
    jc: &JournalConfig,
) -> Result<Replayed, TractServerError> {
    let path = jc.path.display().to_string();
    let err = |path: &str, error: String| TractServerError::Journal { path: path.to_string(), error };
    let disk = env.open_disk(&jc.path, jc.create_size).await.map_err(|e| err(&path, e.to_string()))?;
    let second_disk = match &jc.second_area {
        Some(p) => Some((
            p.display().to_string(),
            env.open_disk(p, jc.second_area_size.or(jc.create_size))
                .await
                .map_err(|e| err(&p.display().to_string(), e.to_string()))?,
        )),
        None => None,
    };
    let (id, tract_size) = (store.disk_id().0, store.tract_size());
    loop {
        let (journal, scan) = match open_area(&disk, id, tract_size).await.map_err(|e| err(&path, e))? {
            Some(j) => j,
            None => {
                tracing::info!(journal = %path, "formatting new backup journal");
                let j = BackupJournal::format(disk.clone(), id, env.random_u128(), tract_size)
                    .await
                    .map_err(|e| err(&path, e.to_string()))?;
                (j, Scan::default())
            }
        };
        let second = match &second_disk {
            None => None,
            Some((p, d)) => Some((p, d, open_area(d, id, tract_size).await.map_err(|e| err(p, e))?)),
        };
        let given = second.as_ref().map(|(_, _, found)| found.as_ref().map(|(j, _)| j.id()));
        let second = match (plan_second_area(journal.second_area(), given), second) {
            (SecondArea::None, _) => None,
            (SecondArea::Refuse(why), s) => {
                return Err(err(s.map_or(&path, |(p, _, _)| p), why));
            }
            (SecondArea::Open, Some((_, _, Some((j, s))))) => Some((j.join(&journal), s)),
            (SecondArea::Format, Some((p, d, _))) => {
                tracing::info!(journal = %path, second_area = %p, "formatting the backup journal's second area");
                let j = BackupJournal::format(d.clone(), id, env.random_u128(), tract_size)
                    .await
                    .map_err(|e| err(p, e.to_string()))?;
                // Named before it takes a record (module docs).
                journal.name_second_area(j.id()).await.map_err(|e| err(&path, e.to_string()))?;
                Some((j.join(&journal), Scan::default()))
            }
            // Open and Format come only with the area they name (the
            // table); kept an error rather than a panic all the same.
            (plan, _) => return Err(err(&path, format!("the second area's plan {plan:?} lacks its file"))),
        };
        let (ring, second_ring) = (journal.ring_len(), second.as_ref().map_or(0, |(j, _)| j.ring_len()));
        match store.attach_backup(journal, scan, second, jc.bypass).await {
            Ok(r) => {
                tracing::info!(
                    journal = %path,
                    ring_bytes = ring,
                    second_area_bytes = second_ring,
                    bypass = jc.bypass,
                    replayed_records = r.records,
                    replayed_bytes = r.bytes,
                    damaged = r.damaged,
                    failed = r.failed,
                    "backup journal attached"
                );
                return Ok(r);
            }
            Err(StoreError::Layout(e)) => return Err(err(&path, e.to_string())),
            Err(e) => {
                tracing::warn!(journal = %path, error = %e, "cannot replay the backup journal onto the disk yet; trying again in 1 s");
                env.sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_second_area_follows_the_table() {
        assert_eq!(plan_second_area(0, None), SecondArea::None);
        assert_eq!(plan_second_area(0, Some(None)), SecondArea::Format);
        // An area the head does not name holds nothing of this journal.
        assert_eq!(plan_second_area(0, Some(Some(7))), SecondArea::Format);
        assert_eq!(plan_second_area(7, Some(Some(7))), SecondArea::Open);
        for given in [None, Some(None), Some(Some(8))] {
            match plan_second_area(7, given) {
                SecondArea::Refuse(why) => assert!(why.contains("--journal-overflow"), "{why}"),
                other => panic!("{given:?}: {other:?}"),
            }
        }
    }
}
