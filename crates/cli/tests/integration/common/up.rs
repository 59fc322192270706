//! `blizzard up --replication 3` on four tractservers with one volume
//! (`--mode`, `--size`), as the snapshot and resize tests start it: its
//! NBD socket in the test's directory, its metadata address read from
//! its status line, and a SIGKILL and restart on the same data.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Proc;

const START_TIMEOUT: Duration = Duration::from_secs(120);
const UP_READY: &str = "NBD export";

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

pub struct Up {
    pub dir: PathBuf,
    pub volume: String,
    pub mode: String,
    pub proc: Proc,
    pub meta: String,
    pub starts: usize,
    pub size: u64,
}

impl Up {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("nbd.sock")
    }

    fn launch(dir: &Path, volume: &str, mode: &str, size: u64, n: usize) -> (Proc, String) {
        let data = dir.join("data").display().to_string();
        let listen = format!("unix:{}", dir.join("nbd.sock").display());
        let mut args = strings(&["up", "--data", &data, "--listen", &listen, "--meta-listen", "127.0.0.1:0"]);
        args.extend(strings(&[
            "--replication",
            "3",
            "--tractservers",
            "4",
            "--mode",
            mode,
            "--volume",
            volume,
        ]));
        args.extend(strings(&["--size", &size.to_string(), "--tract-size", "1MiB", "--disk-size", "1GiB"]));
        let mut up = Proc::spawn("blizzard up", &args, dir.join(format!("up-{n}.log")), listen);
        let text = up.wait_log(UP_READY, START_TIMEOUT);
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("status:"))
            .unwrap_or_else(|| panic!("blizzard up printed no status line:\n{text}"));
        let meta = line.rsplit_once("--meta ").unwrap().1.trim().to_string();
        (up, meta)
    }

    pub fn start(dir: &Path, volume: &str, mode: &str, size: u64) -> Up {
        let (proc, meta) = Up::launch(dir, volume, mode, size, 1);
        Up { dir: dir.to_path_buf(), volume: volume.into(), mode: mode.into(), proc, meta, starts: 1, size }
    }

    pub fn kill_and_restart(&mut self) {
        self.proc.kill();
        self.starts += 1;
        let (proc, meta) = Up::launch(&self.dir, &self.volume, &self.mode, self.size, self.starts);
        (self.proc, self.meta) = (proc, meta);
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.socket().display())
    }
}
