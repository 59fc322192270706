//! The partition test's network: a network namespace per tractserver,
//! joined to the root namespace by a veth pair and routed there, with the
//! cuts the test makes (a link down, an nftables rule dropping packets to
//! the metadata server); everything undone on drop (`TestNet`), and what
//! a killed run left removed by the next (`remove_leftovers`). See the
//! module comment of `partition` for the addresses and the rules.

// Real commands (`ip`, `nft`) and files in /proc, outside the env seam.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

/// The test network's first two octets (see the module comment).
const NET: &str = "10.231";
const IP_FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// `name` on PATH or in an sbin directory (missing from PATH in non-root
/// shells).
pub(super) fn tool(name: &str) -> Option<String> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found.map(|p| p.display().to_string())
}

/// Runs a command to completion; its stdout, or why it failed.
pub(super) fn run(program: &str, args: &[&str]) -> Result<String, String> {
    run_with_input(program, args, None)
}

pub(super) fn run_with_input(program: &str, args: &[&str], input: Option<&str>) -> Result<String, String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("`{program}`: {e}"))?;
    if let Some(text) = input {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .map_err(|e| format!("`{program}` stdin: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("`{program}`: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The pid in `PREFIX<n>-<pid>`, the names this test gives.
pub(super) fn leftover_pid<'a>(name: &'a str, prefix: &str) -> Option<&'a str> {
    let (n, pid) = name.strip_prefix(prefix)?.split_once('-')?;
    (n.parse::<u32>().is_ok() && pid.parse::<u32>().is_ok()).then_some(pid)
}

/// Removes what a run that was killed (so its drop never ran) left: its
/// namespaces, veths and route, recognised by the pid in their names (the
/// route by its metric) and the pid being gone.
pub(super) fn remove_leftovers(ip: &str) {
    let gone = |pid: &str| !Path::new("/proc").join(pid).exists();
    if let Ok(list) = run(ip, &["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if leftover_pid(name, "bz").is_some_and(gone) {
                eprintln!("removing namespace {name} left by a killed run");
                let _ = run(ip, &["netns", "del", name]);
            }
        }
    }
    if let Ok(list) = run(ip, &["-o", "link", "show"]) {
        for line in list.lines() {
            let Some(name) = line.split(": ").nth(1).and_then(|n| n.split('@').next()) else { continue };
            if leftover_pid(name, "bzr").is_some_and(gone) {
                eprintln!("removing link {name} left by a killed run");
                let _ = run(ip, &["link", "del", name]);
            }
        }
    }
    let net = format!("{NET}.0.0/16");
    if let Ok(list) = run(ip, &["route", "show", "type", "unreachable"]) {
        for line in list.lines().filter(|l| l.contains(&net)) {
            let metric = line.split_whitespace().skip_while(|w| *w != "metric").nth(1);
            if let Some(pid) = metric.filter(|p| gone(p)) {
                eprintln!("removing route `{line}` left by a killed run");
                let _ = run(ip, &["route", "del", "unreachable", &net, "metric", pid]);
            }
        }
    }
}

/// The namespaces, veths, guard route and forwarding this test sets up,
/// undone on drop.
pub(super) struct TestNet {
    /// The `ip` program (the tractservers start under `ip netns exec`).
    pub(super) ip: String,
    pid: u32,
    namespaces: Vec<String>,
    veths: Vec<String>,
    guard_route: bool,
    old_ip_forward: Option<String>,
}

impl TestNet {
    /// Namespace of tractserver `n` (1-based).
    pub(super) fn ns(&self, n: usize) -> String {
        format!("bz{n}-{}", self.pid)
    }

    /// Root side of its veth (at most 15 characters: `bzr8-4194304`).
    pub(super) fn veth(&self, n: usize) -> String {
        format!("bzr{n}-{}", self.pid)
    }

    /// The root namespace's address on it: the member's gateway, and where
    /// it reaches the metadata server.
    pub(super) fn gateway(n: usize) -> String {
        format!("{NET}.{n}.1")
    }

    pub(super) fn member_ip(n: usize) -> String {
        format!("{NET}.{n}.2")
    }

    pub(super) fn ip(&self, args: &[&str]) -> Result<String, String> {
        run(&self.ip, args)
    }

    pub(super) fn create(ip: String, members: usize) -> Result<TestNet, String> {
        let mut net = TestNet {
            ip,
            pid: std::process::id(),
            namespaces: Vec::new(),
            veths: Vec::new(),
            guard_route: false,
            old_ip_forward: None,
        };
        // First, so no packet for the test network ever takes the default
        // route out of the machine (a down link removes its /24 route).
        let pid = net.pid.to_string();
        net.ip(&["route", "add", "unreachable", &format!("{NET}.0.0/16"), "metric", &pid])?;
        net.guard_route = true;
        let old = std::fs::read_to_string(IP_FORWARD).map_err(|e| format!("{IP_FORWARD}: {e}"))?;
        std::fs::write(IP_FORWARD, "1").map_err(|e| format!("{IP_FORWARD}: {e}"))?;
        net.old_ip_forward = Some(old);
        for n in 1..=members {
            let (ns, veth) = (net.ns(n), net.veth(n));
            net.ip(&["netns", "add", &ns])?;
            net.namespaces.push(ns.clone());
            net.ip(&["link", "add", &veth, "type", "veth", "peer", "name", "veth0", "netns", &ns])?;
            net.veths.push(veth.clone());
            net.ip(&["addr", "add", &format!("{}/24", Self::gateway(n)), "dev", &veth])?;
            net.ip(&["link", "set", &veth, "up"])?;
            net.ip(&["-n", &ns, "addr", "add", &format!("{}/24", Self::member_ip(n)), "dev", "veth0"])?;
            net.ip(&["-n", &ns, "link", "set", "veth0", "up"])?;
            net.ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // Only the test network, not a default route: the member can
            // reach the others and the metadata server, nothing else.
            net.ip(&["-n", &ns, "route", "add", &format!("{NET}.0.0/16"), "via", &Self::gateway(n)])?;
        }
        Ok(net)
    }

    pub(super) fn set_link(&self, n: usize, up: bool) {
        self.ip(&["link", "set", &self.veth(n), if up { "up" } else { "down" }]).unwrap();
    }

    /// Drops member `n`'s packets to the metadata server (and only those).
    pub(super) fn cut_from_meta(&self, nft: &str, n: usize, meta_port: u16) {
        let rules = format!(
            "table inet bzcut {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    \
             ip daddr {} tcp dport {meta_port} drop\n  }}\n}}\n",
            Self::gateway(n)
        );
        run_with_input(&self.ip, &["netns", "exec", &self.ns(n), nft, "-f", "-"], Some(&rules)).unwrap();
    }

    pub(super) fn heal_from_meta(&self, nft: &str, n: usize) {
        self.ip(&["netns", "exec", &self.ns(n), nft, "delete", "table", "inet", "bzcut"]).unwrap();
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        // Deleting a root-side veth deletes its peer too.
        for v in self.veths.iter().rev() {
            if let Err(e) = self.ip(&["link", "del", v]) {
                eprintln!("cleanup: {e}");
            }
        }
        for ns in self.namespaces.iter().rev() {
            if let Err(e) = self.ip(&["netns", "del", ns]) {
                eprintln!("cleanup: {e}");
            }
        }
        if self.guard_route {
            let net = format!("{NET}.0.0/16");
            if let Err(e) = self.ip(&["route", "del", "unreachable", &net, "metric", &self.pid.to_string()]) {
                eprintln!("cleanup: {e}");
            }
        }
        if let Some(old) = &self.old_ip_forward {
            if let Err(e) = std::fs::write(IP_FORWARD, old) {
                eprintln!("cleanup: restoring {IP_FORWARD}: {e}");
            }
        }
    }
}

/// Whether this process runs as root (effective uid 0).
pub(super) fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let euid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().nth(1));
    euid == Some("0")
}

/// The network, or why this machine cannot have it.
pub(super) fn setup_net(members: usize) -> Result<TestNet, String> {
    if !is_root() {
        return Err("not running as root (network namespaces need it)".into());
    }
    let ip = tool("ip").ok_or("no `ip` command (Debian: iproute2)")?;
    run(&ip, &["netns", "list"]).map_err(|e| format!("`ip netns` is unavailable: {e}"))?;
    remove_leftovers(&ip);
    let taken: Vec<String> = [&["-4", "addr", "show"][..], &["-4", "route", "show", "table", "all"][..]]
        .iter()
        .flat_map(|args| run(&ip, args).unwrap_or_default().lines().map(str::to_string).collect::<Vec<_>>())
        .filter(|l| l.contains(&format!("{NET}.")))
        .collect();
    if !taken.is_empty() {
        return Err(format!("{NET}.0.0/16 is already in use here:\n{}", taken.join("\n")));
    }
    TestNet::create(ip, members)
}
