//! TLS from the command line: `blizzard ca` makes a CA and certificates;
//! `blizzard nbd` refuses bad certificate directories at start with one
//! line; `blizzard up` makes its own certificates and, with `--tls
//! require`, serves libnbd over TLS only.

// Real processes and files in real time, outside the env seam.
#![allow(clippy::unwrap_used, clippy::disallowed_methods)]

use crate::common::bin::blizzard_bin;
use crate::common::{free_port, http_get, tool, Proc};

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Runs `blizzard ARGS`; (success, stdout + stderr).
fn blizzard(args: &[&str]) -> (bool, String) {
    let out = Command::new(blizzard_bin()).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `blizzard nbd` with these TLS arguments must stop at start, before it
/// dials the metadata server (none runs), with one error line saying
/// `want`.
fn refused(args: &[&str], want: &str) {
    refused_on("127.0.0.1", args, want)
}

/// [`refused`], listening on `host`.
fn refused_on(host: &str, args: &[&str], want: &str) {
    let meta = format!("127.0.0.1:{}", free_port());
    let listen = format!("{host}:{}", free_port());
    let mut all = vec!["nbd", "--meta", &meta, "--listen", &listen];
    all.extend_from_slice(args);
    let (ok, text) = blizzard(&all);
    assert!(!ok, "blizzard {all:?} started:\n{text}");
    let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "{text}");
    assert!(errors[0].contains(want), "{:?} lacks {want:?}", errors[0]);
    assert!(!text.contains("panicked"), "{text}");
}

#[test]
fn ca_certificates_and_start_up_checks() {
    let d = tempfile::tempdir().unwrap();
    let ca = d.path().join("ca");
    let (ok, text) = blizzard(&["ca", "init", s(&ca)]);
    assert!(ok, "{text}");
    let (ok, text) = blizzard(&["ca", "init", s(&ca)]);
    assert!(!ok && text.contains("exists already"), "{text}");
    let server = d.path().join("server");
    let (ok, text) = blizzard(&["ca", "issue", "nbd-1", "--role", "nbd", s(&ca), "--out", s(&server)]);
    assert!(ok, "{text}");
    for f in ["ca-cert.pem", "server-cert.pem", "server-key.pem"] {
        assert!(server.join(f).is_file(), "{f}");
    }
    let (ok, text) = blizzard(&["ca", "issue", "alice", "--role", "client", s(&ca)]);
    assert!(ok, "{text}");
    assert!(ca.join("alice/client-cert.pem").is_file() && ca.join("alice/client-key.pem").is_file());
    let (ok, text) = blizzard(&["ca", "issue", "root", "--role", "admin", s(&ca)]);
    assert!(ok && ca.join("root/client-cert.pem").is_file(), "an admin has a client's files: {text}");
    let (ok, text) = blizzard(&["ca", "issue", "x", "--role", "superuser", s(&ca)]);
    assert!(!ok && text.contains("unknown role"), "{text}");

    // Bad directories and contradictory flags: one line each, at start.
    refused(&["--tls-certificates", s(&d.path().join("none"))], "does not exist");
    let swapped = d.path().join("swapped");
    std::fs::create_dir(&swapped).unwrap();
    std::fs::copy(server.join("ca-cert.pem"), swapped.join("ca-cert.pem")).unwrap();
    std::fs::copy(server.join("server-cert.pem"), swapped.join("server-cert.pem")).unwrap();
    std::fs::copy(ca.join("alice/client-key.pem"), swapped.join("server-key.pem")).unwrap();
    refused(&["--tls-certificates", s(&swapped)], "does not belong to");
    let misuse = d.path().join("misuse");
    std::fs::create_dir(&misuse).unwrap();
    std::fs::copy(ca.join("alice/ca-cert.pem"), misuse.join("ca-cert.pem")).unwrap();
    std::fs::copy(ca.join("alice/client-cert.pem"), misuse.join("server-cert.pem")).unwrap();
    std::fs::copy(ca.join("alice/client-key.pem"), misuse.join("server-key.pem")).unwrap();
    refused(&["--tls-certificates", s(&misuse)], "is not a server certificate");
    refused(&["--tls", "require"], "needs certificates");
    // Reachable from other hosts: TLS, or --tls off said out loud.
    refused_on("0.0.0.0", &[], "--tls off");
    refused(&["--tls", "off", "--tls-verify-peer"], "--tls-verify-peer needs TLS");
}

#[test]
fn up_makes_its_certificates_and_requires_tls_when_told() {
    let nbdinfo = tool("nbdinfo", "libnbd-bin");
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data");
    let addr = format!("127.0.0.1:{}", free_port());
    let meta = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let args: Vec<String> = [
        "up",
        "--data",
        s(&data),
        "--listen",
        &addr,
        "--meta-listen",
        &meta,
        "--size",
        "16MiB",
        "--disk-size",
        "64MiB",
        "--tract-size",
        "1MiB",
        "--tls",
        "require",
        "--metrics",
        &metrics,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let mut up = Proc::spawn("up", &args, d.path().join("up.log"), addr.clone());
    let banner = up.wait_log("Ctrl-C", Duration::from_secs(60));
    let client = data.canonicalize().unwrap().join("tls/client");
    let uri = format!("nbds://{addr}/disk?tls-certificates={}", client.display());
    assert!(banner.contains(&uri), "the banner does not show {uri}:\n{banner}");
    for f in ["ca-cert.pem", "client-cert.pem", "client-key.pem"] {
        assert!(client.join(f).is_file(), "{f}");
    }
    let out = Command::new(&nbdinfo).arg(&uri).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("with TLS"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(&nbdinfo).arg(format!("nbd://{addr}/disk")).output().unwrap();
    assert!(!out.status.success(), "a plain client was served under --tls require");
    // /metrics counts the TLS handshake and the refused plain client.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let text = rt.block_on(http_get(&metrics, "/metrics"));
    let count = |family: &str| -> f64 {
        let line =
            text.lines().find(|l| l.starts_with(family)).unwrap_or_else(|| panic!("no {family} in:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(count("blizzard_nbd_tls_handshakes_total{result=\"ok\"}") >= 1.0, "{text}");
    assert!(count("blizzard_nbd_refused_total{reason=\"tls_required\"}") >= 1.0, "{text}");

    // Access lists: a second volume limited to alice is hidden from up's
    // own client certificate ("blizzard-up-client") until it is allowed
    // too, read-only; a served volume's list changes under it.
    let ok = |args: &[&str]| {
        let (ok, text) = blizzard(args);
        assert!(ok, "blizzard {args:?}:\n{text}");
        text
    };
    ok(&["volume", "create", "v2", "--size", "8MiB", "--meta", &meta]);
    let text = ok(&["volume", "access", "v2", "--meta", &meta]);
    assert!(text.contains("every NBD client"), "{text}");
    ok(&["volume", "access", "v2", "--allow", "alice", "--meta", &meta]);
    let list = |uri: &str| {
        let out = Command::new(&nbdinfo).args(["--list", uri]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let all = format!("nbds://{addr}/?tls-certificates={}", client.display());
    let seen = list(&all);
    assert!(seen.contains("\"disk\"") && !seen.contains("\"v2\""), "{seen}");
    let text =
        ok(&["volume", "access", "v2", "--allow", "blizzard-up-client", "--read-only", "--meta", &meta]);
    assert!(text.contains("alice read-write") && text.contains("blizzard-up-client read-only"), "{text}");
    let info = ok(&["volume", "info", "v2", "--meta", &meta]);
    assert!(info.contains("blizzard-up-client read-only"), "{info}");
    let (succeeded, text) = blizzard(&["volume", "access", "v2", "--deny", "bob", "--meta", &meta]);
    assert!(!succeeded && text.contains("not in the volume's access list"), "{text}");
    let v2 = format!("nbds://{addr}/v2?tls-certificates={}", client.display());
    let out = Command::new(&nbdinfo).arg(&v2).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("is_read_only: true"), "{text}");
    // Served now (nbdinfo opened it), as the default volume is: the list
    // changes all the same, for the next connection (design 0010).
    for v in ["v2", "disk"] {
        let text = ok(&["volume", "access", v, "--allow", "bob", "--meta", &meta]);
        assert!(text.contains("bob read-write"), "{text}");
    }
    let (succeeded, text) =
        blizzard(&["volume", "access", "v2", "--deny", "blizzard-up-client", "--meta", &meta]);
    assert!(succeeded, "{text}");
    let out = Command::new(&nbdinfo).arg(&v2).output().unwrap();
    assert!(!out.status.success(), "denied while served, yet: {}", String::from_utf8_lossy(&out.stdout));
    assert!(up.interrupt());
    assert!(up.wait_exit(Duration::from_secs(60)).success(), "{}", up.tail());
}
