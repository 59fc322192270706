//! Child processes of the real-process tests: one `blizzard` (or
//! third-party) process with its output in a log file ([`Proc`]), and a
//! cluster's metadata server and tractservers ([`Procs`]). Dropping either
//! kills and reaps what it holds, so a failing test leaves nothing running.

#![allow(clippy::unwrap_used, clippy::disallowed_methods)] // real processes in real time

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::blizzard_bin;

/// Lines of each child's log shown when the test fails.
pub(crate) const LOG_TAIL_LINES: usize = 40;

/// One child process with its stdout and stderr in a log file. Dropping it
/// SIGKILLs it and reaps it, so a failing test leaves nothing running.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
    /// Where it listens.
    pub addr: String,
}

impl Proc {
    /// Runs `blizzard ARGS`.
    pub fn spawn(name: &str, args: &[String], log: PathBuf, addr: String) -> Proc {
        Proc::spawn_program(name, &blizzard_bin(), args, log, addr)
    }

    /// Runs `PROGRAM ARGS`: a wrapper that execs `blizzard` in the end (as
    /// `ip netns exec` does) keeps the pid, so the kill still reaches it.
    pub fn spawn_program(name: &str, program: &str, args: &[String], log: PathBuf, addr: String) -> Proc {
        let out = File::create(&log).unwrap();
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        Proc { name: name.to_string(), child: Some(child), log, addr }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }

    /// Whether it is still running (reaps it if it exited).
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn killed(&self) -> bool {
        self.child.is_none()
    }

    /// SIGKILL (std's `Child::kill`), then reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits until it exits (reaping it) and returns how; fails the test
    /// (with the log's tail) after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        let child = self.child.as_mut().unwrap_or_else(|| panic!("{} was killed by the test", self.name));
        loop {
            // `Child` keeps the status once reaped: asking again answers the same.
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() >= timeout {
                panic!("{} still runs after {timeout:?}; its log:\n{}", self.name, self.tail());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGINT (the shell's `kill`: no crate here sends signals), unless it
    /// has exited already (a process not yet reaped keeps its pid, so the
    /// signal cannot reach another); whether it was sent.
    pub fn interrupt(&mut self) -> bool {
        if !self.running() {
            return false;
        }
        let pid = self.pid().unwrap();
        let ok = Command::new("sh").args(["-c", &format!("kill -INT {pid}")]).status().unwrap().success();
        assert!(ok || !self.running(), "kill -INT {pid} ({}) failed", self.name);
        ok
    }

    /// Waits until the log holds `needle` and returns the log; fails the
    /// test (with the log's tail) if the process exits first or `timeout`
    /// passes.
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            let text = self.log_text();
            if text.contains(needle) {
                return text;
            }
            self.check_running();
            assert!(
                start.elapsed() < timeout,
                "{}: no {needle:?} in its log after {timeout:?}; its log:\n{}",
                self.name,
                self.tail()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Fails the test if a process that should be running has exited: a
    /// crash of a survivor must not pass for a recovery problem.
    pub fn check_running(&mut self) {
        if let Some(c) = self.child.as_mut() {
            if let Some(status) = c.try_wait().unwrap() {
                panic!(
                    "{} ({}) exited unexpectedly ({status}); its log:\n{}",
                    self.name,
                    self.addr,
                    self.tail()
                );
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The metadata server and the tractservers. On a failing test it prints
/// the tail of every child's log before its fields kill the children.
pub struct Procs {
    pub meta: Proc,
    pub ts: Vec<Proc>,
}

impl Procs {
    pub fn all_mut(&mut self) -> impl Iterator<Item = &mut Proc> {
        std::iter::once(&mut self.meta).chain(self.ts.iter_mut())
    }

    pub fn check_running(&mut self) {
        self.all_mut().for_each(Proc::check_running);
    }

    pub fn killed_addrs(&self) -> Vec<String> {
        self.ts.iter().filter(|p| p.killed()).map(|p| p.addr.clone()).collect()
    }

    pub fn by_addr(&mut self, addr: &str) -> Option<&mut Proc> {
        self.ts.iter_mut().find(|p| p.addr == addr)
    }

    /// Waits until every tractserver prints `tractserver ID listening on
    /// ADDR` (once it serves, after formatting its disk with the metadata
    /// server's parameters) and takes ADDR from it: the status lists
    /// members by that address.
    pub fn wait_listening(&mut self, timeout: Duration) {
        let start = Instant::now();
        for i in 0..self.ts.len() {
            loop {
                let text = self.ts[i].log_text();
                let line =
                    text.lines().find(|l| l.starts_with("tractserver ") && l.contains(" listening on "));
                if let Some(line) = line {
                    let (_, addr) = line.rsplit_once(" listening on ").unwrap();
                    self.ts[i].addr = addr.trim().to_string();
                    break;
                }
                self.check_running();
                assert!(start.elapsed() < timeout, "{} is not serving after {timeout:?}", self.ts[i].name);
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for p in std::iter::once(&self.meta).chain(&self.ts) {
                let state = if p.killed() { "killed by the test" } else { "running" };
                eprintln!("===== {} ({}, {state}): last lines of {} =====", p.name, p.addr, p.log.display());
                eprintln!("{}", p.tail());
            }
        }
    }
}
