//! The control socket of a served volume: how `blizzard volume snapshot`
//! and `volume delete NAME@SNAP` reach the process that writes the volume
//! (designs 0008 and 0011). Only the writer can take a snapshot (an S3
//! volume drains its journal first and keeps the snapshot's objects from
//! its cleaner; a volume in the blob store makes what it acknowledged
//! durable and freezes its head), so a command run while the volume is
//! served asks it, and the process serving it answers.
//!
//! An S3 volume's socket is `control.sock` in its cache directory; a blob
//! volume's is `<blob id>.sock` in the host's run directory
//! ([`run_dir`]). Either is on the serving host: a command on that host
//! finds it; on another host there is no socket, the volume's lease is
//! held, and the command says where to run it.
//!
//! The protocol is one request line and one reply line, each at most
//! [`LINE_MAX`] bytes: `snapshot NAME`, `delete-snapshot NAME` or
//! `resize BYTES` (`resize-shrink BYTES` to allow shrinking) or
//! `rollback NAME`, answered
//! `ok DETAIL` or `error MESSAGE`. [`Request`] and [`Reply`] are pure and
//! refuse anything else; the shell around them is thin.

use std::path::{Path, PathBuf};
use std::sync::Weak;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use blizzard_env::Env;

use crate::VolumeError;

/// What a control socket reaches: the writer of one volume.
pub trait Controlled: Send + Sync + 'static {
    /// Takes snapshot `name`; the reply's detail (an S3 volume's object
    /// seq, a blob volume's new head layer).
    fn snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>>;
    /// Deletes snapshot `name`; the bytes given back now (an S3 volume's
    /// cleaner gives its back later: 0).
    fn delete_snapshot<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>>;
    /// Resizes the volume to `size` bytes (smaller only with
    /// `allow_shrink`); returns the size now in force.
    fn resize(&self, size: u64, allow_shrink: bool) -> BoxFuture<'_, Result<u64, VolumeError>>;
    /// Rolls the volume back to snapshot `name`; the bytes copied.
    fn rollback<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<u64, VolumeError>>;
}

/// Where blob volumes' control sockets are on this host:
/// `$BLIZZARD_RUN_DIR`, else `$XDG_RUNTIME_DIR/blizzard`, else
/// `/tmp/blizzard-run` (made owner-only when this process makes it).
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("BLIZZARD_RUN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => Path::new(&d).join("blizzard"),
        None => PathBuf::from("/tmp/blizzard-run"),
    }
}

/// The control socket of the blob volume whose blob id is `id`.
pub fn blob_socket_path(id: blizzard_core::BlobId) -> PathBuf {
    run_dir().join(format!("{:032x}.sock", id.0))
}

/// The socket's file name in the cache directory.
pub const SOCKET_FILE: &str = "control.sock";
/// Longest request or reply line, newline included.
pub const LINE_MAX: usize = 4096;
/// How long a connection may take to send its request.
const REQUEST_WAIT: Duration = Duration::from_secs(10);

/// What a command asks of the serving process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Snapshot(String),
    DeleteSnapshot(String),
    Resize { size: u64, allow_shrink: bool },
    Rollback(String),
}

impl Request {
    pub fn encode(&self) -> String {
        match self {
            Request::Snapshot(n) => format!("snapshot {n}\n"),
            Request::DeleteSnapshot(n) => format!("delete-snapshot {n}\n"),
            Request::Resize { size, allow_shrink: false } => format!("resize {size}\n"),
            Request::Resize { size, allow_shrink: true } => format!("resize-shrink {size}\n"),
            Request::Rollback(n) => format!("rollback {n}\n"),
        }
    }

    /// Parses one line (without its newline). Names are checked as
    /// snapshot names, so nothing else reaches the volume.
    pub fn parse(line: &str) -> Result<Request, String> {
        let (verb, name) = line.split_once(' ').ok_or_else(|| format!("no request in {line:?}"))?;
        if let Some(allow_shrink) = match verb {
            "resize" => Some(false),
            "resize-shrink" => Some(true),
            _ => None,
        } {
            let size = name
                .parse::<u64>()
                .ok()
                .filter(|s| s.to_string() == name)
                .ok_or_else(|| format!("not a size in bytes: {name:?}"))?;
            return Ok(Request::Resize { size, allow_shrink });
        }
        blizzard_lsvd::format::check_snapshot_name(name)?;
        match verb {
            "snapshot" => Ok(Request::Snapshot(name.to_string())),
            "delete-snapshot" => Ok(Request::DeleteSnapshot(name.to_string())),
            "rollback" => Ok(Request::Rollback(name.to_string())),
            _ => Err(format!("unknown request {verb:?}")),
        }
    }
}

/// The serving process's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Ok(String),
    Error(String),
}

impl Reply {
    pub fn encode(&self) -> String {
        // One line: a message's own newlines would end it early.
        let one = |s: &str| s.replace('\n', " ");
        match self {
            Reply::Ok(d) => format!("ok {}\n", one(d)),
            Reply::Error(m) => format!("error {}\n", one(m)),
        }
    }

    pub fn parse(line: &str) -> Result<Reply, String> {
        match line.split_once(' ') {
            Some(("ok", d)) => Ok(Reply::Ok(d.to_string())),
            Some(("error", m)) => Ok(Reply::Error(m.to_string())),
            _ => Err(format!("not a reply: {line:?}")),
        }
    }
}

/// Reads one line of at most [`LINE_MAX`] bytes (without its newline).
async fn read_line(s: &mut blizzard_env::BoxStream) -> Result<String, String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match s.read(&mut byte).await {
            Ok(0) => return Err("the connection closed before a whole line".into()),
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if buf.len() + 1 >= LINE_MAX => return Err(format!("a line longer than {LINE_MAX} bytes")),
            Ok(_) => buf.push(byte[0]),
            Err(e) => return Err(e.to_string()),
        }
    }
    String::from_utf8(buf).map_err(|_| "a line that is not UTF-8".to_string())
}

pub fn socket_path(cache_dir: &str) -> PathBuf {
    Path::new(cache_dir).join(SOCKET_FILE)
}

/// Serves the control socket at `path` for `engine`'s volume until the
/// engine is gone or the task is aborted (at close). A socket that cannot
/// be bound (a path too long for a unix socket, a run directory that
/// cannot be made) leaves the volume without one: logged, and commands
/// then ask the operator to stop the server.
pub(crate) fn spawn(env: Env, path: PathBuf, engine: Weak<dyn Controlled>) -> tokio::task::JoinHandle<()> {
    let addr = format!("unix:{}", path.display());
    tokio::spawn(async move {
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                let made = std::fs::create_dir_all(dir).and_then(|()| {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                });
                if let Err(e) = made {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot make the run directory: this volume has no control socket (set BLIZZARD_RUN_DIR)");
                    return;
                }
            }
        }
        let listener = match env.bind(&addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(socket = %path.display(), error = %e, "no control socket: snapshots of this volume need it stopped first");
                return;
            }
        };
        loop {
            let mut conn = match listener.accept().await {
                Ok((c, _)) => c,
                Err(e) => {
                    tracing::debug!(error = %e, "control socket accept failed");
                    env.sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let engine = engine.clone();
            let env = env.clone();
            tokio::spawn(async move {
                let reply = match env.timeout(REQUEST_WAIT, read_line(&mut conn)).await {
                    Err(_) => Reply::Error("no request within 10 s".into()),
                    Ok(Err(e)) => Reply::Error(e),
                    Ok(Ok(line)) => match (Request::parse(&line), engine.upgrade()) {
                        (Err(e), _) => Reply::Error(e),
                        (Ok(_), None) => Reply::Error("the volume is closing".into()),
                        (Ok(r), Some(engine)) => handle(&*engine, r).await,
                    },
                };
                let _ = conn.write_all(reply.encode().as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    })
}

async fn handle(v: &dyn Controlled, r: Request) -> Reply {
    match r {
        Request::Snapshot(n) => match v.snapshot(&n).await {
            Ok(seq) => Reply::Ok(format!("{seq}")),
            Err(e) => Reply::Error(e.to_string()),
        },
        Request::DeleteSnapshot(n) => match v.delete_snapshot(&n).await {
            Ok(freed) => Reply::Ok(format!("{freed}")),
            Err(e) => Reply::Error(e.to_string()),
        },
        Request::Resize { size, allow_shrink } => match v.resize(size, allow_shrink).await {
            Ok(now) => Reply::Ok(format!("{now}")),
            Err(e) => Reply::Error(e.to_string()),
        },
        Request::Rollback(n) => match v.rollback(&n).await {
            Ok(copied) => Reply::Ok(format!("{copied}")),
            Err(e) => Reply::Error(e.to_string()),
        },
    }
}

/// Asks the process serving the volume whose control socket is `path`.
/// `None`: no process serves it on this host (no socket, or a stale one
/// nobody listens on).
pub async fn ask(env: &Env, path: &Path, r: &Request) -> Result<Option<Reply>, VolumeError> {
    let mut conn = match env.connect(&format!("unix:{}", path.display())).await {
        Ok(c) => c,
        Err(e)
            if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) =>
        {
            return Ok(None)
        }
        Err(e) => {
            return Err(VolumeError::Refused(format!("the volume's control socket {}: {e}", path.display())))
        }
    };
    let failed =
        |e: String| VolumeError::Refused(format!("the process serving the volume ({}): {e}", path.display()));
    conn.write_all(r.encode().as_bytes()).await.map_err(|e| failed(e.to_string()))?;
    let line = read_line(&mut conn).await.map_err(failed)?;
    Reply::parse(&line).map(Some).map_err(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip_and_nothing_else_parses() {
        for r in [
            Request::Snapshot("nightly.1".into()),
            Request::DeleteSnapshot("a-b_c".into()),
            Request::Resize { size: 4 << 30, allow_shrink: false },
            Request::Resize { size: 512, allow_shrink: true },
            Request::Rollback("before-upgrade".into()),
        ] {
            let line = r.encode();
            assert_eq!(Request::parse(line.trim_end_matches('\n')), Ok(r));
        }
        for bad in [
            "",
            "snapshot",
            "snapshot ",
            "snapshot a/b",
            "snapshot ../x",
            "rm -rf",
            "snapshot a b",
            "resize",
            "resize ",
            "resize -1",
            "resize 1e9",
            "resize 012",
            "resize 99999999999999999999999",
            "resize 4 extra",
        ] {
            assert!(Request::parse(bad).is_err(), "{bad:?}");
        }
        for r in
            [Reply::Ok("42".into()), Reply::Error("snapshot \"x\" exists".into()), Reply::Ok(String::new())]
        {
            let line = r.encode();
            assert_eq!(line.matches('\n').count(), 1);
            assert_eq!(Reply::parse(line.trim_end_matches('\n')), Ok(r));
        }
        assert_eq!(Reply::Error("two\nlines".into()).encode(), "error two lines\n");
        assert!(Reply::parse("okay").is_err());
    }
}
