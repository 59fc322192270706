//! `blizzard nbd`: the volumes of a cluster served over NBD, and the online
//! upgrade that hands a running server's listener and live connections to
//! a new binary without disconnecting its clients (Ursa §5.2;
//! `blizzard_nbd::upgrade`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use blizzard_env::Env;
use blizzard_volume::PlantedBug;

use crate::tls_cmd::{nbd_tls, ClusterAuth, TlsArgs, TlsHint};
use crate::{connect_with, planted, print_connect, wait_for_stop_signal};

#[derive(Args)]
pub(crate) struct NbdArgs {
    #[arg(long, default_value = "127.0.0.1:7700")]
    meta: String,
    /// `host:port` to listen on.
    #[arg(long, default_value = "127.0.0.1:10809")]
    listen: String,
    /// Listen on a unix socket instead.
    #[arg(long)]
    socket: Option<PathBuf>,
    /// The export a client gets when it asks for the default (empty)
    /// name. Opened at start: a volume another process holds stops the
    /// server at once, naming the holder.
    #[arg(long)]
    default_export: Option<String>,
    /// Export every volume read-only, without taking its lease: a
    /// process writing it carries on (a write-through or fast-ack
    /// volume's blob is read as it is).
    #[arg(long, conflicts_with = "take_over")]
    read_only: bool,
    /// Take each volume even from a process that holds it (only when
    /// that process is dead: its late writes are refused from then on).
    #[arg(long)]
    take_over: bool,
    /// Serve Prometheus metrics of the open volumes at
    /// http://ADDR/metrics (an S3 volume's bytes not yet in the object
    /// store, its cache, its objects and its requests).
    #[arg(long)]
    metrics: Option<String>,
    /// Test hook: open volumes with this bug planted (see `crashcheck
    /// --plant`), so a real-process test can show its check fails.
    #[arg(long, hide = true, default_value = "none", value_parser = planted)]
    plant: PlantedBug,
    /// Comparisons only: send every small write to a tractserver alone
    /// instead of batching those ready together (`WriteTracts`).
    #[arg(long, hide = true)]
    no_write_batching: bool,
    /// Online upgrade: take over the listener and every live
    /// connection of the `blizzard nbd` running as process PID (or
    /// listening for successors on the hand-over socket PATH), so its
    /// clients keep their disks across a restart of the binary. It
    /// answers what is in flight, flushes and releases its volumes,
    /// hands everything over and exits 0. If anything fails it keeps
    /// serving and this process exits with the reason. --listen and
    /// --socket are not used: the listener is the old server's.
    #[arg(long, value_name = "PID|PATH")]
    upgrade_from: Option<String>,
    /// Where this server waits for a successor (`--upgrade-from`);
    /// default `$XDG_RUNTIME_DIR/blizzard-nbd-PID.upgrade`, or in the
    /// temporary directory without XDG_RUNTIME_DIR. SIGUSR2 starts the
    /// successor itself: this binary as it is on disk now, with the
    /// same arguments and `--upgrade-from` this socket.
    #[arg(long, value_name = "PATH")]
    upgrade_socket: Option<PathBuf>,
    #[command(flatten)]
    tls: TlsArgs,
}

pub(crate) async fn nbd_cmd(env: Env, args: NbdArgs, auth: &ClusterAuth) -> Result<()> {
    let NbdArgs {
        meta,
        listen,
        socket,
        default_export,
        read_only,
        take_over,
        metrics,
        plant,
        no_write_batching,
        upgrade_from,
        upgrade_socket,
        tls,
    } = args;
    // The binary's path as started: after an upgrade replaced the
    // file, it names the new binary, which SIGUSR2 starts.
    let exe = std::env::current_exe().context("finding this binary's path")?;
    let listen = match socket {
        Some(p) => format!("unix:{}", p.display()),
        None => listen,
    };
    // Certificates are checked before anything else starts.
    let tls = nbd_tls(&env, &tls, auth.certs.as_deref(), &listen)?;
    let hint = TlsHint::of(tls.as_ref(), None);
    let client = connect_with(&env, &meta, |c| c.batch_writes = !no_write_batching).await?;
    let mode = blizzard_nbd::OpenMode { read_only, take_over, planted: plant };
    let exports = blizzard_nbd::ClientExports::with_mode(env.clone(), client, mode);
    let cfg = blizzard_nbd::NbdConfig {
        default_export: default_export.clone(),
        metrics_listen: metrics,
        tls,
        ..Default::default()
    };
    let mut server = match &upgrade_from {
        Some(old) => {
            let path = upgrade_socket_of(old)?;
            let server = blizzard_nbd::Server::upgrade_from(env, exports, &path, cfg)
                .await
                .with_context(|| format!("taking over from the NBD server at {}", path.display()))?;
            if server.local_addr() != listen {
                tracing::warn!(
                    addr = server.local_addr(),
                    "serving the listener handed over, not --listen/--socket {listen}"
                );
            }
            server
        }
        None => {
            let server = blizzard_nbd::Server::start(env, exports, &listen, cfg)
                .await
                .with_context(|| format!("starting the NBD server on {listen}"))?;
            if let Some(name) = &default_export {
                // Fail now, not at the first client, if it cannot be served
                // (missing, or another process holds it).
                if let Err(e) = server.open_export(name).await {
                    let _ = server.shutdown().await;
                    return Err(e).with_context(|| format!("cannot serve volume {name:?}"));
                }
            }
            server
        }
    };
    let own = upgrade_socket.unwrap_or_else(|| default_upgrade_socket(std::process::id()));
    if let Err(e) = server.listen_for_upgrades(&own) {
        let _ = server.shutdown().await;
        return Err(e).context("listening for a successor (online upgrade); choose --upgrade-socket");
    }
    print_connect(server.local_addr(), default_export.as_deref().unwrap_or("VOLUME"), hint.as_ref());
    println!(
        "  upgrade:      kill -USR2 {}   (or start the new binary with --upgrade-from {})",
        std::process::id(),
        std::process::id()
    );
    serve_until_stopped(&server, &exe, &own, std::future::ready(())).await?;
    // After a hand-over nothing is left to flush: the volumes went
    // with the connections.
    server.shutdown().await.context("flushing volumes at shutdown")?;
    Ok(())
}

/// Serves until SIGINT or SIGTERM, or until a successor has taken over;
/// on SIGUSR2 starts that successor (this binary `exe` as it is on disk
/// now, its hand-over socket `own`). `also` runs alongside until it ends
/// (`blizzard up`'s zero-fill progress).
pub(crate) async fn serve_until_stopped(
    server: &blizzard_nbd::Server,
    exe: &std::path::Path,
    own: &std::path::Path,
    also: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let mut usr2 = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined2())
        .context("installing the SIGUSR2 handler")?;
    let stop = wait_for_stop_signal();
    tokio::pin!(stop);
    tokio::pin!(also);
    let mut also_done = false;
    loop {
        tokio::select! {
            r = &mut stop => {
                r?;
                println!("stopping: finishing in-flight requests and flushing volumes");
                return Ok(());
            }
            () = &mut also, if !also_done => also_done = true,
            _ = usr2.recv() => match start_successor(exe, own) {
                Ok(pid) => tracing::info!(pid, "SIGUSR2: started process {pid} to take over"),
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "SIGUSR2: cannot start a successor; serving on"),
            },
            () = server.handed_over() => {
                // The volumes (and `blizzard up`'s cluster) went with it.
                println!("handed over to a new process: exiting");
                return Ok(());
            }
        }
    }
}

/// Where `blizzard nbd` in process `pid` waits for a successor by default.
pub(crate) fn default_upgrade_socket(pid: u32) -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    blizzard_nbd::upgrade::socket_path(&dir, pid)
}

/// `--upgrade-from`'s hand-over socket: a process id's default socket, or
/// a path.
pub(crate) fn upgrade_socket_of(old: &str) -> Result<PathBuf> {
    match old.parse::<u32>() {
        Ok(pid) => {
            let path = default_upgrade_socket(pid);
            if !path.exists() {
                bail!(
                    "no hand-over socket {} for process {pid}: is it a `blizzard nbd` or `blizzard up` of this binary's version, \
                     started with the same XDG_RUNTIME_DIR (else pass its --upgrade-socket PATH)?",
                    path.display()
                );
            }
            Ok(path)
        }
        Err(_) => Ok(PathBuf::from(old)),
    }
}

/// Starts the successor of this `blizzard nbd` (SIGUSR2): `exe` with this
/// process's arguments, any `--upgrade-from` replaced by this server's
/// hand-over socket `own`; its output goes where ours goes. Returns its
/// process id; a successor that exits on its own (it failed: this server
/// serves on) is reported.
pub(crate) fn start_successor(exe: &std::path::Path, own: &std::path::Path) -> Result<u32> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut skip = false;
    for a in std::env::args_os().skip(1) {
        if std::mem::take(&mut skip) {
            continue;
        }
        match a.to_str() {
            Some("--upgrade-from") => skip = true,
            Some(s) if s.starts_with("--upgrade-from=") => {}
            _ => args.push(a),
        }
    }
    args.push("--upgrade-from".into());
    args.push(own.as_os_str().to_owned());
    let mut child = std::process::Command::new(exe)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))?;
    let pid = child.id();
    std::thread::spawn(move || {
        if let Ok(status) = child.wait() {
            if !status.success() {
                tracing::warn!(pid, %status, "the successor exited without taking over; this server serves on");
            }
        }
    });
    Ok(pid)
}
