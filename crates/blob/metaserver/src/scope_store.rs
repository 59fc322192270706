//! A single metadata server's access lists and revocations on disk
//! (design 0010). A group of replicas keeps them in its replicated log;
//! a single server (`blizzard meta` without `--peers`, `blizzard up`)
//! keeps everything else in memory and rebuilds it from the tractservers
//! after a restart, but who may use which volume, and which certificates
//! are revoked, cannot be rebuilt from anywhere: they live here, under
//! the server's `--data` directory. A single server without one refuses
//! to keep them (`access`).
//!
//! Two files, `scope-a` and `scope-b`, each one record: magic
//! `BLZSCOPE` (u64), format 1 (u32), sequence (u64), body length (u32),
//! CRC32C of the body (u32), then the body: the table
//! (`blizzard_proto::scope::Scope`, its durable part: `scope`). A save
//! replaces the file that does not hold the newest record (removed, then
//! written whole and synced: `Disks::open` syncs its directory when it
//! creates one), so a crash at any point leaves the newest complete
//! record, or the one before, never a mix.
//!
//! | at start | loads |
//! |---|---|
//! | neither file | the empty table |
//! | one valid record | it |
//! | two valid records | the one with the higher sequence |
//! | a file that is torn, short, of another format or fails its CRC | the other file's record (and the log says which file was bad) |
//! | both files bad | nothing: the server refuses to start, naming them (an operator decides) |

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use blizzard_core::crc::crc32c;
use blizzard_env::Env;
use blizzard_proto::scope::Scope;
use blizzard_proto::{Reader, Wire, Writer};

const MAGIC: u64 = 0x424c_5a53_434f_5045; // "BLZSCOPE"
const FORMAT: u32 = 1;
const HEADER_LEN: usize = 8 + 4 + 8 + 4 + 4;
/// Largest body read back (the table's own bounds keep it far below).
const BODY_MAX: usize = 256 << 20;
const FILES: [&str; 2] = ["scope-a", "scope-b"];

/// Where a single server keeps its scope table.
pub struct ScopeStore {
    env: Env,
    dir: PathBuf,
    /// The sequence of the newest record on disk.
    seq: tokio::sync::Mutex<u64>,
}

/// One record: (sequence, table), or why it cannot be read.
fn decode(bytes: &[u8]) -> Result<(u64, Scope), String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!("{} bytes, shorter than a record's header", bytes.len()));
    }
    let mut r = Reader::new(&bytes[..HEADER_LEN]);
    let (magic, format) = (u64::get(&mut r), u32::get(&mut r));
    if magic != Ok(MAGIC) {
        return Err("not a scope record (bad magic)".into());
    }
    if format != Ok(FORMAT) {
        return Err(format!("format {format:?}, not {FORMAT}"));
    }
    let seq = u64::get(&mut r).map_err(|e| e.to_string())?;
    let len = u32::get(&mut r).map_err(|e| e.to_string())? as usize;
    let crc = u32::get(&mut r).map_err(|e| e.to_string())?;
    let body =
        bytes.get(HEADER_LEN..HEADER_LEN + len).ok_or_else(|| format!("body of {len} bytes cut short"))?;
    if crc32c(body) != crc {
        return Err("CRC32C mismatch (a torn or damaged record)".into());
    }
    let mut r = Reader::new(body);
    let scope = Scope::get(&mut r).map_err(|e| format!("table does not decode: {e}"))?;
    r.finish().map_err(|e| format!("table does not decode: {e}"))?;
    Ok((seq, scope))
}

fn encode(seq: u64, scope: &Scope) -> Bytes {
    let mut body = Writer::new();
    scope.put(&mut body);
    let body = body.buf.freeze();
    let mut w = Writer::new();
    MAGIC.put(&mut w);
    FORMAT.put(&mut w);
    seq.put(&mut w);
    (body.len() as u32).put(&mut w);
    crc32c(&body).put(&mut w);
    w.buf.extend_from_slice(&body);
    w.buf.freeze()
}

/// Which record to load (the module header's table; pure).
fn pick(
    a: Option<Result<(u64, Scope), String>>,
    b: Option<Result<(u64, Scope), String>>,
) -> Result<(u64, Scope), String> {
    match (a, b) {
        (None, None) => Ok((0, Scope::default())),
        (Some(Ok(x)), Some(Ok(y))) => Ok(if y.0 > x.0 { y } else { x }),
        (Some(Ok(x)), _) | (_, Some(Ok(x))) => Ok(x),
        (a, b) => {
            let why = |f: &str, r: Option<Result<(u64, Scope), String>>| match r {
                Some(Err(e)) => format!("{f}: {e}"),
                _ => format!("{f}: missing"),
            };
            Err(format!("{}; {}", why(FILES[0], a), why(FILES[1], b)))
        }
    }
}

impl ScopeStore {
    /// Opens the store in `dir` and reads the table it holds.
    pub async fn open(env: &Env, dir: &Path) -> Result<(ScopeStore, Scope), String> {
        let mut found = Vec::new();
        for f in FILES {
            let path = dir.join(f);
            let rec = match env.disks.open(&path, None).await {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => Some(Err(format!("cannot open: {e}"))),
                Ok(d) => match d.read_at(0, (d.len() as usize).min(HEADER_LEN + BODY_MAX)).await {
                    Ok(b) => Some(decode(&b)),
                    Err(e) => Some(Err(format!("cannot read: {e}"))),
                },
            };
            if let Some(Err(e)) = &rec {
                tracing::warn!(file = %path.display(), error = %e, "a scope record cannot be used; the other one is");
            }
            found.push(rec);
        }
        let b = found.pop().flatten();
        let a = found.pop().flatten();
        let (seq, scope) = pick(a, b).map_err(|e| {
            format!(
                "the access lists and revocations in {} cannot be read ({e}): restore the directory from a backup, or move both files away to start with none",
                dir.display()
            )
        })?;
        let store =
            ScopeStore { env: env.clone(), dir: dir.to_path_buf(), seq: tokio::sync::Mutex::new(seq) };
        Ok((store, scope))
    }

    /// Saves `scope` durably (module header): when this returns, a crash
    /// loads it, or a later one.
    pub async fn save(&self, scope: &Scope) -> std::io::Result<()> {
        let mut seq = self.seq.lock().await;
        let next = *seq + 1;
        let path = self.dir.join(FILES[(next % 2) as usize]);
        let bytes = encode(next, scope);
        self.env.disks.remove(&path).await?;
        let disk: Arc<dyn blizzard_env::Disk> = self.env.disks.open(&path, Some(bytes.len() as u64)).await?;
        disk.write_at(vec![(0, bytes)]).await?;
        disk.sync().await?;
        *seq = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::BlobId;
    use blizzard_proto::scope::ScopeEntry;

    fn table(v: u64) -> Scope {
        let mut s = Scope { version: v, ..Scope::default() };
        crate::scope::set_access(
            &mut s,
            BlobId(7),
            "db",
            &[ScopeEntry { identity: "vm1".into(), read_only: false }],
        );
        crate::scope::revoke(&mut s, "0a", "vm2");
        s
    }

    #[test]
    fn records_round_trip_and_damage_is_found() {
        let b = encode(3, &table(1));
        assert_eq!(decode(&b), Ok((3, table(1))));
        for cut in [0, HEADER_LEN - 1, HEADER_LEN, b.len() - 1] {
            assert!(decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut flipped = b.to_vec();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(decode(&flipped).expect_err("a flipped bit").contains("CRC32C"));
    }

    /// One case per row of the module header's table.
    #[test]
    fn the_newest_valid_record_is_loaded() {
        let ok = |seq, v| Some(Ok((seq, table(v))));
        let bad = || Some(Err("torn".to_string()));
        assert_eq!(pick(None, None), Ok((0, Scope::default())));
        assert_eq!(pick(ok(1, 1), None), Ok((1, table(1))));
        assert_eq!(pick(None, ok(2, 2)), Ok((2, table(2))));
        assert_eq!(pick(ok(3, 3), ok(2, 2)), Ok((3, table(3))));
        assert_eq!(pick(ok(3, 3), ok(4, 4)), Ok((4, table(4))));
        assert_eq!(pick(bad(), ok(4, 4)), Ok((4, table(4))));
        assert_eq!(pick(ok(5, 5), bad()), Ok((5, table(5))));
        let both = pick(bad(), bad()).expect_err("both bad");
        assert!(both.contains("scope-a: torn") && both.contains("scope-b: torn"), "{both}");
    }

    #[tokio::test]
    async fn saves_survive_a_reopen_and_alternate_files() {
        let d = tempfile::tempdir().expect("tempdir");
        let env = Env::real();
        let (store, first) = ScopeStore::open(&env, d.path()).await.expect("opens");
        assert_eq!(first, Scope::default());
        for v in 1..=3 {
            store.save(&table(v)).await.expect("saves");
        }
        let (_, back) = ScopeStore::open(&env, d.path()).await.expect("reopens");
        assert_eq!(back, table(3));
        // The newest is torn: the one before it is loaded.
        let newest = d.path().join(FILES[1]);
        let disk = env.disks.open(&newest, None).await.expect("open");
        let bytes = disk.read_at(0, disk.len() as usize).await.expect("read");
        env.disks.remove(&newest).await.expect("remove");
        let torn = env.disks.open(&newest, Some(bytes.len() as u64 / 2)).await.expect("create");
        torn.write_at(vec![(0, bytes.slice(..bytes.len() / 2))]).await.expect("tear");
        torn.sync().await.expect("sync");
        let (_, back) = ScopeStore::open(&env, d.path()).await.expect("reopens");
        assert_eq!(back, table(2));
    }
}
