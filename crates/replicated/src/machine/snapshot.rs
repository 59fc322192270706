//! Snapshots: the whole state at one log index, so a restart (or a
//! follower far behind) does not replay the log from its beginning.
//!
//! A snapshot is one image, the same on disk and on the wire:
//!
//! | bytes | what |
//! |---|---|
//! | 0..8 | magic `BLZRSNAP` |
//! | 8..12 | format version (1) |
//! | 12..16 | meta length M |
//! | 16..24 | service state length S |
//! | 24..24+M | meta: last applied log id, membership, the session table |
//! | ..+S | the service's state, as its `write_snapshot` wrote it |
//! | last 4 | CRC32C of everything before |
//!
//! On disk each image is its own file, `snap-<index>-<term>` (zero-padded,
//! so names sort by index). Written whole, then synced; only then are
//! older ones removed. Recovery cases, each handled by [`SnapshotStore::latest`]:
//!
//! | found at open | what it means | what happens |
//! |---|---|---|
//! | no `snap-*` file | never snapshotted | start from an empty state; the log replays from its start |
//! | newest file whole (magic, lengths, CRC) | the current snapshot | loaded; older files removed |
//! | newest file fails its checks | a crash while writing it (the older one was not removed yet) | it is removed, and the next newest is tried |
//! | every file fails | disk damage | error: refuse to start with an empty state while the log may be purged past it |

use std::path::{Path, PathBuf};

use bytes::Bytes;

use blizzard_core::crc::crc32c;
use blizzard_env::Env;
use blizzard_proto::{DecodeError, Reader, Wire, Writer};

use super::session::{get_reply, put_reply, Session, Sessions};
use crate::codec::{get_opt_log_id, get_stored_membership, put_opt_log_id, put_stored_membership};
use crate::types::{LogId, StoredMembership};

const MAGIC: &[u8; 8] = b"BLZRSNAP";
const VERSION: u32 = 1;
const HEAD_LEN: usize = 24;
/// Largest snapshot image accepted (bounded before anything is read).
pub const SNAPSHOT_LEN_MAX: u64 = 4 << 30;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {what}: {why}")]
    Damaged { what: String, why: String },
    #[error("snapshot store {dir}: {error}")]
    Io { dir: String, error: std::io::Error },
}

/// What an image holds besides the service's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub last: Option<LogId>,
    pub membership: StoredMembership,
    pub sessions: Sessions,
}

/// Builds an image from its header and the service's pieces.
pub fn encode(h: &Header, service: &[Bytes]) -> Bytes {
    let mut meta = Writer::new();
    put_opt_log_id(&mut meta, &h.last);
    put_stored_membership(&mut meta, &h.membership);
    (h.sessions.len() as u32).put(&mut meta);
    for (id, s) in h.sessions.iter() {
        id.put(&mut meta);
        s.acked_below.put(&mut meta);
        s.last_used.put(&mut meta);
        (s.replies.len() as u32).put(&mut meta);
        for (seq, r) in &s.replies {
            seq.put(&mut meta);
            put_reply(&mut meta, r);
        }
    }
    let s_len: usize = service.iter().map(Bytes::len).sum();
    let mut out = Vec::with_capacity(HEAD_LEN + meta.buf.len() + s_len + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(meta.buf.len() as u32).to_le_bytes());
    out.extend_from_slice(&(s_len as u64).to_le_bytes());
    out.extend_from_slice(&meta.buf);
    for p in service {
        out.extend_from_slice(p);
    }
    let crc = crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Bytes::from(out)
}

/// Checks an image and splits it into its header and the service's state
/// (a slice of the image).
pub fn decode(image: &Bytes) -> Result<(Header, Bytes), DecodeError> {
    if image.len() < HEAD_LEN + 4 || &image[0..8] != MAGIC {
        return Err(DecodeError::BadValue { field: "snapshot magic", value: image.len() as u64 });
    }
    let body = &image[..image.len() - 4];
    let crc = u32::from_le_bytes([
        image[image.len() - 4],
        image[image.len() - 3],
        image[image.len() - 2],
        image[image.len() - 1],
    ]);
    if crc32c(body) != crc {
        return Err(DecodeError::BadValue { field: "snapshot crc", value: crc as u64 });
    }
    let mut r = Reader::new(&body[8..HEAD_LEN]);
    let version = u32::get(&mut r)?;
    if version != VERSION {
        return Err(DecodeError::BadValue { field: "snapshot version", value: version as u64 });
    }
    let m_len = u32::get(&mut r)? as usize;
    let s_len = u64::get(&mut r)?;
    if (HEAD_LEN as u64).saturating_add(m_len as u64).saturating_add(s_len) != body.len() as u64 {
        return Err(DecodeError::BadValue { field: "snapshot lengths", value: s_len });
    }
    let mut r = Reader::new(&body[HEAD_LEN..HEAD_LEN + m_len]);
    let last = get_opt_log_id(&mut r)?;
    let membership = get_stored_membership(&mut r)?;
    let n = u32::get(&mut r)? as usize;
    if n.saturating_mul(28) > r.left() {
        return Err(DecodeError::ListTooLong { count: n, left: r.left() });
    }
    let mut sessions = Vec::with_capacity(n);
    for _ in 0..n {
        let id = u64::get(&mut r)?;
        let mut s =
            Session { acked_below: u64::get(&mut r)?, last_used: u64::get(&mut r)?, ..Session::default() };
        let k = u32::get(&mut r)? as usize;
        if k.saturating_mul(9) > r.left() {
            return Err(DecodeError::ListTooLong { count: k, left: r.left() });
        }
        for _ in 0..k {
            let seq = u64::get(&mut r)?;
            s.replies.insert(seq, get_reply(&mut r)?);
        }
        sessions.push((id, s));
    }
    r.finish()?;
    let service = image.slice(HEAD_LEN + m_len..body.len());
    Ok((Header { last, membership, sessions: Sessions::from_sessions(sessions) }, service))
}

/// The snapshot files of one member.
#[derive(Clone)]
pub struct SnapshotStore {
    env: Env,
    dir: PathBuf,
}

fn file_name(last: &Option<LogId>) -> String {
    let (index, term) = last.as_ref().map_or((0, 0), |l| (l.index, l.leader_id.term));
    format!("snap-{index:020}-{term:020}")
}

impl SnapshotStore {
    pub fn new(env: &Env, dir: &Path) -> SnapshotStore {
        SnapshotStore { env: env.clone(), dir: dir.to_path_buf() }
    }

    fn io(&self, error: std::io::Error) -> SnapshotError {
        SnapshotError::Io { dir: self.dir.display().to_string(), error }
    }

    /// Writes `image` (whose header names `last`) durably, then removes
    /// every older snapshot file.
    pub async fn save(&self, last: &Option<LogId>, image: &Bytes) -> Result<PathBuf, SnapshotError> {
        let path = self.dir.join(file_name(last));
        // A file left by an earlier attempt at the same index (a crash
        // mid-write) is replaced, not trusted.
        self.env.remove_disk(&path).await.map_err(|e| self.io(e))?;
        let disk = self.env.open_disk(&path, Some(image.len() as u64)).await.map_err(|e| self.io(e))?;
        disk.write_at(vec![(0, image.clone())]).await.map_err(|e| self.io(e))?;
        disk.sync().await.map_err(|e| self.io(e))?;
        for old in self.env.list_disks(&self.dir, "snap-").await.map_err(|e| self.io(e))? {
            if old < path {
                self.env.remove_disk(&old).await.map_err(|e| self.io(e))?;
            }
        }
        Ok(path)
    }

    /// The newest whole snapshot (see the module's recovery table).
    pub async fn latest(&self) -> Result<Option<(Header, Bytes)>, SnapshotError> {
        let mut files = self.env.list_disks(&self.dir, "snap-").await.map_err(|e| self.io(e))?;
        let any = !files.is_empty();
        while let Some(path) = files.pop() {
            let read = async {
                let disk = self.env.open_disk(&path, None).await?;
                if disk.len() > SNAPSHOT_LEN_MAX {
                    return Err(std::io::Error::other(format!("{} bytes is over the limit", disk.len())));
                }
                disk.read_at(0, disk.len() as usize).await
            };
            let why = match read.await {
                Ok(image) => match decode(&image) {
                    Ok((h, _)) => {
                        for older in files {
                            self.env.remove_disk(&older).await.map_err(|e| self.io(e))?;
                        }
                        return Ok(Some((h, image)));
                    }
                    Err(e) => e.to_string(),
                },
                Err(e) => e.to_string(),
            };
            tracing::warn!(path = %path.display(), why, "snapshot file is not whole (a crash while writing it?); removing it and trying the one before");
            self.env.remove_disk(&path).await.map_err(|e| self.io(e))?;
        }
        if any {
            return Err(SnapshotError::Damaged {
                what: self.dir.display().to_string(),
                why: "no snapshot file is whole: the disk is damaged; restore this member from another (remove its data directory and let it rejoin)".into(),
            });
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::tests::log_id;
    use crate::types::{Member, Membership, OpReply};
    use std::collections::BTreeMap;

    fn header() -> Header {
        let nodes: BTreeMap<u64, Member> = (1..=3).map(|i| (i, Member { addr: format!("h{i}:1") })).collect();
        let m = Membership::new(vec![(1..=3).collect()], nodes).expect("voters are nodes");
        let mut sessions = Sessions::default();
        sessions.open(65536, 1);
        sessions.admit(65536, 1, 0, 2);
        sessions.record(65536, 1, OpReply::Applied(Bytes::from_static(b"r")));
        Header {
            last: Some(log_id(2, 1, 9)),
            membership: StoredMembership::new(Some(log_id(1, 1, 1)), m),
            sessions,
        }
    }

    #[test]
    fn an_image_round_trips_and_any_damage_is_caught() {
        let h = header();
        let image = encode(&h, &[Bytes::from_static(b"state "), Bytes::from_static(b"bytes")]);
        let (back, service) = decode(&image).expect("whole");
        assert_eq!(back, h);
        assert_eq!(&service[..], b"state bytes");
        for i in 0..image.len() {
            let mut bad = image.to_vec();
            bad[i] ^= 0x10;
            assert!(decode(&Bytes::from(bad)).is_err(), "flip at {i} accepted");
        }
        for n in 0..image.len() {
            assert!(decode(&image.slice(..n)).is_err(), "truncation to {n} accepted");
        }
    }

    #[tokio::test]
    async fn the_newest_whole_file_wins_and_a_torn_one_is_skipped() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let env = Env::real();
        let store = SnapshotStore::new(&env, dir.path());
        assert!(store.latest().await?.is_none());
        let mut h = header();
        let first = encode(&h, &[Bytes::from_static(b"one")]);
        store.save(&h.last, &first).await?;
        h.last = Some(log_id(2, 1, 20));
        let second = encode(&h, &[Bytes::from_static(b"two")]);
        store.save(&h.last, &second).await?;
        assert_eq!(env.list_disks(dir.path(), "snap-").await?.len(), 1, "older removed");
        // A newer file cut short, as a crash mid-write leaves it.
        let torn = dir.path().join(file_name(&Some(log_id(3, 1, 30))));
        let d = env.open_disk(&torn, Some(second.len() as u64)).await?;
        d.write_at(vec![(0, second.slice(..10))]).await?;
        let (got, image) = store.latest().await?.ok_or("a snapshot")?;
        assert_eq!(got.last, Some(log_id(2, 1, 20)));
        assert_eq!(image, second);
        assert_eq!(env.list_disks(dir.path(), "snap-").await?.len(), 1, "torn file removed");
        Ok(())
    }
}
