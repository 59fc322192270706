//! TLS on the command line: the cluster's own connections (the global
//! `--tls-certificates` and `--insecure`, [`ClusterAuth`]), the flags
//! `blizzard nbd` and `blizzard up` share for NBD (`--tls`,
//! `--tls-verify-peer`), the rules that pick the modes when no flag says,
//! and `blizzard ca`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};

use blizzard_env::Env;
use blizzard_nbd::NbdTls;
use blizzard_tls::{Issue, Role};

/// Whether NBD clients use TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TlsMode {
    /// Plain connections only; STARTTLS is refused.
    Off,
    /// TLS offered: clients that upgrade get it, plain clients are still
    /// served.
    On,
    /// Every client must upgrade first; one that does not learns nothing
    /// (no export names or sizes).
    Require,
}

#[derive(Args, Clone, Debug)]
pub(crate) struct TlsArgs {
    /// off, on (offered; plain clients still served) or require. Default:
    /// with certificates (--tls-certificates), on for a loopback address
    /// or a unix socket and require for any other; without, off on
    /// loopback or a unix socket, and any other address is refused unless
    /// --tls off is given.
    #[arg(long, value_enum)]
    pub(crate) tls: Option<TlsMode>,
    /// Every TLS client must present a certificate signed by the CA in
    /// ca-cert.pem (without this flag a certificate is optional, and one
    /// presented is still checked).
    #[arg(long)]
    pub(crate) tls_verify_peer: bool,
}

/// How this process's connections to and from the cluster's servers are
/// made (design 0010, point 2): the global `--tls-certificates` and
/// `--insecure`.
#[derive(Clone, Debug, Default)]
pub(crate) struct ClusterAuth {
    pub(crate) certs: Option<PathBuf>,
    pub(crate) insecure: bool,
}

impl ClusterAuth {
    /// The env this process reaches the cluster through: every
    /// connection mutual TLS with the cluster's CA when it has
    /// certificates (and not `--insecure`), else `env` as it is. The
    /// directory is checked here, before anything starts.
    pub(crate) fn env(&self, env: &Env) -> Result<Env> {
        let Some(dir) = self.certs.as_deref().filter(|_| !self.insecure) else {
            return Ok(env.clone());
        };
        let tls =
            blizzard_tls::ClusterTls::load(dir, env.clock.system_time()).context("--tls-certificates")?;
        tracing::info!(identity = %tls.identity, "cluster connections: mutual TLS");
        let net = blizzard_tls::TlsNet::new(env.net.clone(), tls, env.clock.clone());
        Ok(Env { net: std::sync::Arc::new(net), ..env.clone() })
    }

    /// A server of a multi-process cluster (a metadata replica, a
    /// tractserver, a runtime member) starts only with certificates, or
    /// with `--insecure` said out loud; not with both.
    pub(crate) fn require_certs(&self, what: &str) -> Result<()> {
        server_auth(self.certs.is_some(), self.insecure, false).map_err(|e| anyhow::anyhow!("{what}: {e}"))
    }

    /// `blizzard up` (one process: its servers talk over in-memory pipes)
    /// serves other processes at `listen`: plain only on loopback or a
    /// unix socket, unless `--insecure`.
    pub(crate) fn check_reachable(&self, listen: &str, what: &str) -> Result<()> {
        server_auth(self.certs.is_some(), self.insecure, is_loopback(listen))
            .map_err(|e| anyhow::anyhow!("{what} on {listen}: {e}"))
    }
}

/// Whether a cluster server may start (pure): with certificates, or with
/// `--insecure` (not both: it would ignore them), or where only this host
/// reaches it (`local`: `blizzard up` on loopback).
pub(crate) fn server_auth(have_certs: bool, insecure: bool, local: bool) -> Result<(), String> {
    match (have_certs, insecure) {
        (true, true) if !local => Err(
            "--insecure runs the cluster's connections without TLS, so --tls-certificates would go unused: give one or the other".into(),
        ),
        (true, _) | (false, true) => Ok(()),
        (false, false) if local => Ok(()),
        (false, false) => Err("a cluster server needs certificates, or anyone who reaches it could join the cluster or read and write every volume: give --tls-certificates DIR (`blizzard ca init`, then `blizzard ca issue NAME --role tractserver|meta`), or --insecure to run without authentication on a network you trust".into()),
    }
}

/// The host part of a `host:port` listen address (brackets of an IPv6
/// address taken off); `None` for a unix socket.
fn host_of(listen: &str) -> Option<&str> {
    if listen.starts_with("unix:") {
        return None;
    }
    let host = listen.rsplit_once(':').map_or(listen, |(h, _)| h);
    Some(host.trim_start_matches('[').trim_end_matches(']'))
}

/// True for a unix socket or an address only this host can reach.
pub(crate) fn is_loopback(listen: &str) -> bool {
    host_of(listen).is_none_or(|host| {
        host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
    })
}

/// The mode to run in (pure): what `--tls` says, else the default for
/// where the server listens and whether it has certificates.
pub(crate) fn decide(asked: Option<TlsMode>, have_certs: bool, loopback: bool) -> Result<TlsMode, String> {
    match (asked, have_certs) {
        (Some(TlsMode::Off), _) => Ok(TlsMode::Off),
        (Some(m), true) => Ok(m),
        (Some(m), false) => Err(format!(
            "--tls {} needs certificates: give --tls-certificates DIR (`blizzard ca init` and `blizzard ca issue` make them)",
            if m == TlsMode::On { "on" } else { "require" }
        )),
        (None, true) if loopback => Ok(TlsMode::On),
        (None, true) => Ok(TlsMode::Require),
        (None, false) if loopback => Ok(TlsMode::Off),
        // Reachable from other hosts: plain NBD only when asked for.
        (None, false) => Err(
            "an address other hosts can reach needs TLS: give --tls-certificates DIR (`blizzard ca init` and `blizzard ca issue NAME --role nbd` make one), or --tls off to serve plain NBD there anyway".into(),
        ),
    }
}

/// The NBD server's TLS, loaded and checked from `certs` (if any) for a
/// server listening on `listen`.
pub(crate) fn nbd_tls(
    env: &Env,
    args: &TlsArgs,
    certs: Option<&Path>,
    listen: &str,
) -> Result<Option<NbdTls>> {
    let mode = decide(args.tls, certs.is_some(), is_loopback(listen))
        .map_err(|e| anyhow::anyhow!("listening on {listen}: {e}"))?;
    if args.tls_verify_peer && mode == TlsMode::Off {
        bail!("--tls-verify-peer needs TLS: give --tls-certificates DIR (and not --tls off)");
    }
    let (TlsMode::On | TlsMode::Require, Some(dir)) = (mode, certs) else {
        return Ok(None);
    };
    let config = blizzard_tls::server_config(dir, args.tls_verify_peer, env.clock.system_time())
        .context("--tls-certificates")?;
    Ok(Some(NbdTls { config, required: mode == TlsMode::Require }))
}

/// How a client reaches a TLS export, for the start-up banner.
pub(crate) struct TlsHint {
    /// A client certificate directory to name in the URI (`up`'s own).
    pub(crate) client_dir: Option<PathBuf>,
    pub(crate) required: bool,
}

impl TlsHint {
    pub(crate) fn of(tls: Option<&NbdTls>, client_dir: Option<PathBuf>) -> Option<TlsHint> {
        tls.map(|t| TlsHint { client_dir, required: t.required })
    }

    /// The libnbd URI of `export` at `addr` over TLS.
    pub(crate) fn uri(&self, addr: &str, export: &str) -> String {
        let dir = self.client_dir.as_ref().map_or("CLIENT_CERT_DIR".to_string(), |d| d.display().to_string());
        match addr.strip_prefix("unix:") {
            Some(path) => format!("'nbds+unix:///{export}?socket={path}&tls-certificates={dir}'"),
            None => format!("'nbds://{addr}/{export}?tls-certificates={dir}'"),
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum CaCmd {
    /// Make a certificate authority in DIR (ca-cert.pem, ca-key.pem): the
    /// root every blizzard process and client of one cluster trusts. Keep
    /// ca-key.pem on the machine that issues certificates only.
    Init {
        dir: PathBuf,
        /// The CA's name (its certificate's subject).
        #[arg(long, default_value = "blizzard CA")]
        name: String,
    },
    /// Issue a certificate from the CA in DIR, for a role: nbd, tractserver
    /// or meta (a server: server-cert.pem, server-key.pem), admin (an
    /// operator: creates, deletes and resizes volumes, changes access
    /// lists, revokes) or client (the volumes whose access lists name it)
    /// (client-cert.pem, client-key.pem); written with the CA's
    /// ca-cert.pem into --out (default DIR/NAME), the directory qemu,
    /// nbdkit, libnbd and blizzard read.
    Issue {
        /// The holder's name: what access lists and logs call it.
        name: String,
        #[arg(long, value_parser = role)]
        role: Role,
        /// The CA's directory (`blizzard ca init`).
        dir: PathBuf,
        /// Where to write the certificate (default DIR/NAME).
        #[arg(long)]
        out: Option<PathBuf>,
        /// For a server: a host name or address clients reach it at
        /// (repeat for more). Default: localhost, 127.0.0.1, ::1 and this
        /// host's name.
        #[arg(long = "host", value_name = "HOST")]
        hosts: Vec<String>,
    },
    /// Revoke a certificate the CA issued: every blizzard server refuses
    /// it within seconds, with no restart, and closes the connections it
    /// holds (design 0010). Takes an admin certificate
    /// (--tls-certificates) and the metadata service (--meta).
    Revoke {
        /// The holder's name, as issued.
        name: String,
        /// The CA's directory: the certificate is read from DIR/NAME, as
        /// `ca issue` wrote it.
        dir: Option<PathBuf>,
        /// The certificate file, if it is not in DIR/NAME.
        #[arg(long)]
        cert: Option<PathBuf>,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
}

fn role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| {
        let all: Vec<_> = Role::ALL.iter().map(|r| r.name()).collect();
        format!("unknown role {s:?}: one of {}", all.join(", "))
    })
}

/// localhost, the loopback addresses and this host's name.
pub(crate) fn default_hosts() -> Vec<String> {
    let mut hosts = vec!["localhost".to_string(), "127.0.0.1".to_string(), "::1".to_string()];
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let h = h.trim();
        if !h.is_empty() && !hosts.iter().any(|x| x == h) {
            hosts.push(h.to_string());
        }
    }
    hosts
}

/// The certificate `blizzard ca revoke NAME [DIR] [--cert FILE]` names:
/// its identity, read from the file.
pub(crate) fn revoked_identity(
    name: &str,
    dir: Option<&Path>,
    cert: Option<&Path>,
) -> Result<blizzard_tls::PeerIdentity> {
    let path = match (cert, dir) {
        (Some(c), _) => c.to_path_buf(),
        (None, Some(d)) => {
            let held = d.join(name);
            [blizzard_tls::CLIENT_CERT, blizzard_tls::SERVER_CERT]
                .iter()
                .map(|f| held.join(f))
                .find(|p| p.exists())
                .with_context(|| format!("{} holds no certificate: give the CA's directory `ca issue` wrote NAME's into, or --cert FILE", held.display()))?
        }
        (None, None) => {
            bail!("name the certificate: the CA's directory it was issued into (DIR/{name}), or --cert FILE")
        }
    };
    let id = blizzard_tls::identity_of_file(&path)?;
    if id.name != name {
        bail!("{} is {:?}'s certificate, not {name:?}'s: nothing revoked", path.display(), id.name);
    }
    Ok(id)
}

pub(crate) fn ca_cmd(env: &Env, cmd: CaCmd) -> Result<()> {
    let now = env.clock.system_time();
    match cmd {
        CaCmd::Revoke { .. } => bail!("`ca revoke` talks to the cluster: it runs from `run`"),
        CaCmd::Init { dir, name } => {
            blizzard_tls::init_ca(&dir, &name, now)?;
            println!("CA {name:?} made in {}", dir.display());
            println!(
                "  issue:  blizzard ca issue NAME --role nbd|tractserver|meta|admin|client {}",
                dir.display()
            );
        }
        CaCmd::Issue { name, role, dir, out, hosts } => {
            let out = out.unwrap_or_else(|| dir.join(&name));
            let hosts = if hosts.is_empty() { default_hosts() } else { hosts };
            let req = Issue { name: name.clone(), role, hosts: hosts.clone() };
            blizzard_tls::issue(&dir, &req, &out, now)?;
            println!("{} certificate for {name:?} in {}", role.name(), out.display());
            if role.is_server() {
                println!("  for hosts: {}", hosts.join(", "));
                if role == Role::Nbd {
                    println!("  serve:     blizzard nbd --tls-certificates {} ...", out.display());
                }
            } else {
                println!("  connect:   nbdinfo 'nbds://HOST/EXPORT?tls-certificates={}'", out.display());
            }
        }
    }
    Ok(())
}

/// `blizzard up`'s certificates: made under `DATA/tls` on first start
/// (or renewed), unless TLS is off or `--tls-certificates` names others.
/// Returns the server's directory and the client's (`None`: the
/// operator's own certificates, whose client directory is not known).
pub(crate) fn up_credentials(
    env: &Env,
    data: &Path,
    args: &TlsArgs,
    certs: Option<&Path>,
    listen: &str,
) -> Result<Option<(PathBuf, Option<PathBuf>)>> {
    if args.tls == Some(TlsMode::Off) {
        return Ok(None);
    }
    if let Some(dir) = certs {
        return Ok(Some((dir.to_path_buf(), None)));
    }
    let mut hosts = default_hosts();
    if let Some(host) = host_of(listen) {
        let wildcard = host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified());
        if !host.is_empty() && !wildcard && !hosts.iter().any(|h| h == host) {
            hosts.push(host.to_string());
        }
    }
    let c = blizzard_tls::ensure_up_credentials(&data.join("tls"), &hosts, env.clock.system_time())
        .context("making blizzard up's TLS certificates (give --tls off to run without)")?;
    if c.made {
        tracing::info!(dir = %c.server_dir.display(), "made TLS certificates for this cluster");
    }
    // Absolute, so the URI printed works from any directory.
    let client = std::fs::canonicalize(&c.client_dir).unwrap_or(c.client_dir);
    Ok(Some((c.server_dir, Some(client))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_mode_follows_the_address_and_the_certificates() {
        use TlsMode::*;
        assert_eq!(decide(None, false, true), Ok(Off));
        assert!(decide(None, false, false).is_err_and(|e| e.contains("--tls off")));
        for loopback in [false, true] {
            assert_eq!(decide(Some(Off), true, loopback), Ok(Off));
            assert_eq!(decide(Some(Off), false, loopback), Ok(Off));
            assert_eq!(decide(Some(On), true, loopback), Ok(On));
            assert_eq!(decide(Some(Require), true, loopback), Ok(Require));
            assert!(decide(Some(On), false, loopback).is_err_and(|e| e.contains("--tls-certificates")));
            assert!(decide(Some(Require), false, loopback).is_err());
        }
        assert_eq!(decide(None, true, true), Ok(On));
        assert_eq!(decide(None, true, false), Ok(Require));
    }

    #[test]
    fn a_cluster_server_needs_certificates_or_insecure() {
        assert_eq!(server_auth(true, false, false), Ok(()));
        assert_eq!(server_auth(false, true, false), Ok(()));
        let e = server_auth(false, false, false).expect_err("refused without certificates or --insecure");
        assert!(e.contains("--tls-certificates") && e.contains("--insecure"), "{e}");
        assert!(server_auth(true, true, false).is_err_and(|e| e.contains("one or the other")));
        // `up` on loopback: plain allowed, and certificates with --insecure
        // serve NBD only.
        assert_eq!(server_auth(false, false, true), Ok(()));
        assert_eq!(server_auth(true, true, true), Ok(()));
    }

    #[test]
    fn loopback_addresses() {
        for a in ["127.0.0.1:10809", "localhost:1", "[::1]:10809", "unix:/tmp/s", "127.1.2.3:5"] {
            assert!(is_loopback(a), "{a}");
        }
        for a in ["0.0.0.0:10809", "10.0.0.1:10809", "[::]:1", "example.com:10809"] {
            assert!(!is_loopback(a), "{a}");
        }
    }
}
