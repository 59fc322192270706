//! `blizzard volume ...`: create, list, inspect, resize and delete
//! volumes; snapshots and clones of S3 volumes (design 0008).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use blizzard_core::units::format_size;
use blizzard_core::Placement;
use blizzard_env::Env;
use blizzard_volume::access::AccessChange;
use blizzard_volume::{manage, CommitMode, FlushPolicy, S3Spec, VolumeSpec};

use crate::{connect, mode, policy, size};

#[derive(Subcommand)]
pub(crate) enum VolumeCmd {
    /// Create a volume: in the blob store, or (`--backend s3`) an LSVD
    /// volume whose data is a log of objects in an S3-compatible store,
    /// written through a journal in a local cache directory (design 0008).
    Create {
        name: String,
        #[arg(long, value_parser = size)]
        size: u64,
        /// Where the data lives: blob (the cluster's tractservers) or s3.
        #[arg(long, default_value = "blob", value_parser = ["blob", "s3"])]
        backend: String,
        /// The S3 volume's place: `http://host:port/bucket/prefix` (or
        /// https://, s3://bucket/prefix); credentials from
        /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_REGION).
        #[arg(long)]
        s3: Option<String>,
        /// The S3 volume's cache directory on the host that serves it (its
        /// journal: writes are acknowledged there, FLUSH is its fdatasync;
        /// and its read cache of object data).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Size of the S3 volume's journal file (its read cache beside it
        /// is as large).
        #[arg(long, default_value = "1GiB", value_parser = size)]
        cache_size: u64,
        /// Target size of the S3 volume's objects.
        #[arg(long, default_value = "8MiB", value_parser = size)]
        object_size: u64,
        /// The S3 volume's cleaning threshold, in percent: its objects are
        /// cleaned once live data is below this share of what they hold.
        /// Lower stores more and rewrites less (at 50 %: about twice the
        /// live data stored, a third of the rewriting of the default 70 %
        /// under random writes; docs/benchmarks.md). Clones inherit it.
        #[arg(long, value_parser = clap::value_parser!(u8).range(10..=95))]
        gc_threshold: Option<u8>,
        /// write-through (acknowledged when durable), fast-ack (acknowledged
        /// at once, written in flush order) or log.
        #[arg(long, default_value = "write-through", value_parser = mode)]
        mode: CommitMode,
        /// durable: a flush waits until earlier writes are durable (NBD's
        /// contract). ordered: a flush only orders (faster; after a crash the
        /// volume holds a prefix of the flushes) — weaker than NBD.
        #[arg(long, default_value = "durable", value_parser = policy)]
        flush: FlushPolicy,
        #[arg(long, default_value_t = 1)]
        replication: u8,
        /// Where the replicas live (design 0009): any (every disk), ssd,
        /// hdd (slow disks, no journals) or hybrid (the primary on ssd, the
        /// backups on hdd behind their journals; reads go to the primary).
        /// ssd, hdd and hybrid need a cluster first built over tractservers
        /// of both classes.
        #[arg(long, default_value = "any")]
        placement: Placement,
        /// Striping unit (default 64KiB).
        #[arg(long, value_parser = size)]
        block_size: Option<u64>,
        /// Tracts per striping segment.
        #[arg(long, default_value_t = 128)]
        segment_tracts: u32,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// List volumes.
    List {
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Show a volume's parameters.
    Info {
        name: String,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Grow (or, with --allow-shrink, shrink) a volume, served or not:
    /// the process serving it on this host does it (its control socket);
    /// NBD clients that connect after see the new size.
    Resize {
        name: String,
        #[arg(long, value_parser = size)]
        size: u64,
        /// Allow a smaller size: everything past it is discarded.
        #[arg(long)]
        allow_shrink: bool,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Who may use a volume over NBD: clients by the name in their
    /// certificate (from the cluster's CA, verified over TLS), each
    /// read-write or read-only. An empty list (the default) lets every
    /// client in; a list with names lets in only those (its snapshots
    /// too). Without --allow or --deny, shows the list. Like resize, stop
    /// the server that holds the volume first.
    Access {
        name: String,
        /// Let this identity use the volume (or change its entry).
        #[arg(long, value_name = "ID", conflicts_with = "deny")]
        allow: Option<String>,
        /// With --allow: reads only (NBD_FLAG_READ_ONLY, writes refused
        /// with EPERM).
        #[arg(long, requires = "allow")]
        read_only: bool,
        /// Take this identity off the list.
        #[arg(long, value_name = "ID")]
        deny: Option<String>,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Delete a volume and free its space; or, as NAME@SNAP, a snapshot of
    /// an S3 volume (the objects only it needed are freed). A snapshot a
    /// clone reads, and its volume, are kept until the clone is deleted.
    Delete {
        name: String,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Take a snapshot of a volume: the volume as it is now (every write
    /// acknowledged before the command), kept read-only while the volume
    /// moves on. No data is copied: a volume in the blob store freezes its
    /// layer and writes a new one (design 0011), an S3 volume names a
    /// point of its log (design 0008). Served as the export NAME@SNAP by
    /// `blizzard nbd`; works while the volume is served (on the host that
    /// serves it: the command asks that process).
    Snapshot {
        name: String,
        snapshot: String,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Roll a volume in the blob store back to its snapshot NAME@SNAP:
    /// it then reads as the snapshot did (its size unchanged), every
    /// snapshot kept. While a server holds the volume the command goes
    /// through it, and is refused while an NBD client is connected.
    Rollback {
        /// The snapshot: NAME@SNAP.
        snapshot: String,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
    /// Create a writable S3 volume NEW from a snapshot (NAME@SNAP): it
    /// starts as the snapshot and shares its objects; writes to either
    /// never show in the other.
    Clone {
        /// The snapshot: NAME@SNAP.
        source: String,
        new: String,
        /// Where the clone's objects go; in the base's bucket (default: the
        /// base's URL with its last segment replaced by NEW).
        #[arg(long)]
        s3: Option<String>,
        /// The clone's cache directory on the host that serves it
        /// (default: beside the base's, named NEW).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Size of the clone's journal file (its read cache beside it is as
        /// large).
        #[arg(long, default_value = "1GiB", value_parser = size)]
        cache_size: u64,
        #[arg(long, default_value_t = 1)]
        replication: u8,
        #[arg(long, default_value = "127.0.0.1:7700")]
        meta: String,
    },
}

/// `NAME@SNAP` split, or a one-line refusal saying what was expected.
fn snapshot_ref(s: &str) -> Result<(&str, &str)> {
    match s.split_once('@') {
        Some((v, snap)) if !v.is_empty() && !snap.is_empty() => Ok((v, snap)),
        _ => bail!("{s:?}: name a snapshot as VOLUME@SNAPSHOT (`blizzard volume list` shows them)"),
    }
}

/// `url` with its last path segment replaced by `name`: a sibling prefix
/// in the same bucket (`http://h:p/bucket/vols/a` → `.../vols/NAME`).
fn sibling_url(url: &str, name: &str) -> String {
    let base = url.trim_end_matches('/');
    // Segments before the prefix: host and bucket, or (s3://) the bucket.
    let (scheme, rest) = base.split_once("://").unwrap_or(("", base));
    let fixed = if scheme == "s3" { 1 } else { 2 };
    let mut segs: Vec<&str> = rest.split('/').collect();
    if segs.len() > fixed {
        segs.pop();
    }
    segs.push(name);
    format!("{scheme}://{}", segs.join("/"))
}

pub(crate) async fn volume_cmd(env: Env, cmd: VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            backend,
            s3,
            cache,
            cache_size,
            object_size,
            gc_threshold,
            mode,
            flush,
            replication,
            placement,
            block_size,
            segment_tracts,
            meta,
        } => {
            let s3 = match (backend.as_str(), s3, cache) {
                ("s3", Some(url), Some(dir)) => Some((url, dir)),
                ("s3", _, _) => {
                    bail!("--backend s3 needs --s3 URL (http://host:port/bucket/prefix) and --cache DIR")
                }
                (_, None, None) if gc_threshold.is_none() => None,
                _ => bail!("--s3, --cache and --gc-threshold are for S3 volumes: add --backend s3"),
            };
            let client = connect(&env, &meta).await?;
            let mut spec = VolumeSpec::new(name.clone(), size);
            spec.mode = mode;
            spec.flush = flush;
            spec.replication = replication;
            spec.placement = placement;
            spec.block_size = block_size.map(|b| u32::try_from(b).unwrap_or(u32::MAX));
            spec.segment_tracts = segment_tracts;
            let mut made_dir = None;
            let made = match s3 {
                Some((url, dir)) => {
                    let (dir, made) = cache_dir(&dir)?;
                    made_dir = made.then_some(dir.clone());
                    let mut s = S3Spec::new(url, dir);
                    s.cache_bytes = cache_size;
                    s.object_bytes = object_size;
                    s.gc_live_pct = gc_threshold;
                    manage::create_s3(env, &client, &spec, &s).await
                }
                None => manage::create(env, &client, &spec).await,
            };
            let v = match made {
                Ok(v) => v,
                Err(e) => {
                    remove_empty_dir(made_dir.as_deref());
                    return Err(e).with_context(|| format!("cannot create volume {name:?}"));
                }
            };
            print_volume(&v.superblock());
            v.close().await?;
        }
        VolumeCmd::List { meta } => {
            let client = connect(&env, &meta).await?;
            let vols = manage::list(&client).await?;
            println!(
                "{:<24} {:>12} {:<14} {:<8} {:>4} {:>10}",
                "NAME", "SIZE", "MODE", "FLUSH", "REPL", "BLOCK"
            );
            for sb in vols {
                // An S3 volume: its snapshots under it, and its base if a clone.
                let s3 = match sb.backend.s3() {
                    Some(_) => Some(blizzard_volume::lsvd::snapshots(&sb).await),
                    None => None,
                };
                let base = match &s3 {
                    Some(Ok((_, Some(b)))) => format!("  clone of {b}"),
                    Some(Err(e)) => format!("  (object store: {e})"),
                    _ => String::new(),
                };
                println!(
                    "{:<24} {:>12} {:<14} {:<8} {:>4} {:>10}{base}",
                    sb.name,
                    format_size(sb.size_bytes),
                    // An S3 volume has no commit mode of the blob's.
                    if s3.is_some() { "s3 (lsvd)" } else { sb.mode.name() },
                    sb.flush.name(),
                    sb.replication,
                    format_size(sb.block_size as u64)
                );
                if s3.is_none() && sb.layers.is_some() {
                    match manage::snapshots(&client, &sb.name).await {
                        Ok(snaps) => {
                            for snap in snaps {
                                println!(
                                    "{:<24} {:>12} {:<14} {:<8} {:>4} {:>10}  holds {} alone",
                                    format!("{}@{}", sb.name, snap.name),
                                    format_size(snap.size_bytes),
                                    "snapshot",
                                    "-",
                                    sb.replication,
                                    "-",
                                    format_size(snap.held_bytes)
                                );
                            }
                        }
                        Err(e) => println!("{:<24} snapshots cannot be read: {e}", format!("{}@", sb.name)),
                    }
                }
                if let Some(Ok((snaps, _))) = &s3 {
                    for snap in snaps {
                        let clones = if snap.clones.is_empty() {
                            String::new()
                        } else {
                            format!("  clones: {}", snap.clones.join(", "))
                        };
                        println!(
                            "{:<24} {:>12} {:<14} {:<8} {:>4} {:>10}{clones}",
                            format!("{}@{}", sb.name, snap.name),
                            format_size(sb.size_bytes),
                            "snapshot",
                            "-",
                            sb.replication,
                            "-"
                        );
                    }
                }
            }
        }
        VolumeCmd::Info { name, meta } => {
            let client = connect(&env, &meta).await?;
            let sb = manage::info(&client, &name).await?;
            print_volume(&sb);
            match manage::access_of(&client, &name).await {
                Ok(list) => print_access(&list),
                Err(e) => println!("access       cannot be read with this certificate ({e})"),
            }
            if let Ok(blob) = manage::find_blob(&client, &name).await {
                let placement = Placement::of(blob.id());
                let what = match placement {
                    Placement::Any => "every disk, whatever its class",
                    Placement::Ssd => "every replica on ssd",
                    Placement::Hdd => "every replica on hdd, no journals",
                    Placement::Hybrid => {
                        "the primary on ssd, reads there; the backups on hdd behind journals"
                    }
                };
                println!("placement    {placement}: {what}");
            }
            if sb.backend.s3().is_some() {
                print_s3_state(&env, &sb).await;
                match blizzard_volume::lsvd::snapshots(&sb).await {
                    Ok((snaps, base)) => {
                        if let Some(b) = base {
                            println!(
                                "clone of     {b} (its objects up to that snapshot are read from there)"
                            );
                        }
                        for s in &snaps {
                            let clones = if s.clones.is_empty() {
                                String::new()
                            } else {
                                format!(", the base of {}", s.clones.join(", "))
                            };
                            println!("snapshot     {}@{} (object {}{clones})", sb.name, s.name, s.seq);
                        }
                    }
                    Err(e) => println!("snapshots    cannot be read: {e}"),
                }
            }
            let blob = manage::blob_id(&name);
            let status = client.cluster_status().await?;
            match status.leases.iter().find(|l| l.blob == blob) {
                Some(l) => println!(
                    "held by      {} (fencing token {}, lease good for another {:.1} s unless renewed)",
                    l.holder,
                    l.token,
                    l.remaining_ms as f64 / 1000.0
                ),
                None => println!("held by      nobody (no process has it open for writing)"),
            }
        }
        VolumeCmd::Access { name, allow, read_only, deny, meta } => {
            let client = connect(&env, &meta).await?;
            let change = match (allow, deny) {
                (Some(identity), None) => Some(AccessChange::Allow { identity, read_only }),
                (None, Some(identity)) => Some(AccessChange::Deny { identity }),
                _ => None,
            };
            let list = match change {
                Some(c) => manage::set_access(&client, &name, &c)
                    .await
                    .with_context(|| format!("cannot change who may use volume {name:?}"))?,
                None => manage::access_of(&client, &name)
                    .await
                    .with_context(|| format!("cannot read who may use volume {name:?}"))?,
            };
            print_access(&list);
        }
        VolumeCmd::Resize { name, size, allow_shrink, meta } => {
            let client = connect(&env, &meta).await?;
            let (sb, via) = manage::resize(env, &client, &name, size, allow_shrink)
                .await
                .with_context(|| format!("cannot resize volume {name:?}"))?;
            println!("resized volume {name} to {} bytes{}", sb.size_bytes, via_note(via));
            print_volume(&sb);
        }
        VolumeCmd::Delete { name, meta } if name.contains('@') => {
            let (vol, snap) = snapshot_ref(&name)?;
            let client = connect(&env, &meta).await?;
            let (freed, via) = manage::delete_snapshot(env, &client, vol, snap)
                .await
                .with_context(|| format!("cannot delete snapshot {name}"))?;
            if freed > 0 {
                println!(
                    "deleted snapshot {name}{}: gave back {} on each replica",
                    via_note(via),
                    format_size(freed)
                );
            } else {
                println!("deleted snapshot {name}{}", via_note(via));
            }
        }
        VolumeCmd::Rollback { snapshot, meta } => {
            let (vol, snap) = snapshot_ref(&snapshot)?;
            let client = connect(&env, &meta).await?;
            let started = env.now();
            let (copied, via) = manage::rollback(env.clone(), &client, vol, snap)
                .await
                .with_context(|| format!("cannot roll volume {vol:?} back to {snapshot}"))?;
            let took = env.now().duration_since(started).as_secs_f64();
            println!(
                "rolled {vol} back to {snapshot}{}: {} copied back, in {took:.1} s",
                via_note(via),
                format_size(copied)
            );
        }
        VolumeCmd::Snapshot { name, snapshot, meta } => {
            let client = connect(&env, &meta).await?;
            let s3 = manage::info(&client, &name).await.map(|sb| sb.backend.s3().is_some()).unwrap_or(false);
            let started = env.now();
            let (seq, via) = manage::snapshot(env.clone(), &client, &name, &snapshot)
                .await
                .with_context(|| format!("cannot take snapshot {name}@{snapshot}"))?;
            let took = env.now().duration_since(started).as_secs_f64() * 1000.0;
            if s3 {
                println!("snapshot {name}@{snapshot}: the volume as of object {seq}{}", via_note(via));
            } else {
                println!(
                    "snapshot {name}@{snapshot}: the volume as it was, layer {} frozen, in {took:.1} ms{}",
                    seq.saturating_sub(1),
                    via_note(via)
                );
            }
            println!(
                "read it with: nbdinfo nbd://HOST:PORT/{name}@{snapshot} (served read-only by blizzard nbd)"
            );
        }
        VolumeCmd::Clone { source, new, s3, cache, cache_size, replication, meta } => {
            let (base, snap) = snapshot_ref(&source)?;
            let client = connect(&env, &meta).await?;
            let sb =
                manage::info(&client, base).await.with_context(|| format!("cannot read volume {base:?}"))?;
            let Some(b3) = sb.backend.s3() else {
                bail!("volume {base:?} is in the blob store: snapshots and clones are for S3 volumes (--backend s3)");
            };
            let url = s3.unwrap_or_else(|| sibling_url(&b3.url, &new));
            let dir = cache.unwrap_or_else(|| {
                std::path::Path::new(&b3.cache_dir).parent().unwrap_or(std::path::Path::new("/")).join(&new)
            });
            let (dir, made) = cache_dir(&dir)?;
            let mut spec = S3Spec::new(url, dir.clone());
            spec.cache_bytes = cache_size;
            let v = match manage::clone_s3(env, &client, base, snap, &new, &spec, replication).await {
                Ok(v) => v,
                Err(e) => {
                    remove_empty_dir(made.then_some(dir.as_path()));
                    return Err(e).with_context(|| format!("cannot clone {source} as {new:?}"));
                }
            };
            print_volume(&v.superblock());
            println!("clone of    {source} (shares its objects; neither sees the other's writes)");
            v.close().await?;
        }
        VolumeCmd::Delete { name, meta } => {
            let client = connect(&env, &meta).await?;
            let sb = manage::info(&client, &name).await.ok();
            manage::delete(env, &client, &name)
                .await
                .with_context(|| format!("cannot delete volume {name:?}"))?;
            if let Some(s3) = sb.as_ref().and_then(|sb| sb.backend.s3()) {
                println!("deleted the objects under {} and the cache {}", s3.url, s3.cache_dir);
                // The journal file is gone; its directory goes if nothing
                // else is in it.
                remove_empty_dir(Some(std::path::Path::new(&s3.cache_dir)));
            }
            println!("deleted volume {name}");
        }
    }
    Ok(())
}

/// An S3 volume's cache directory, made if missing, as an absolute path
/// (the record names it for whichever process serves the volume); and
/// whether this call made it.
pub(crate) fn cache_dir(dir: &std::path::Path) -> Result<(PathBuf, bool)> {
    let made = !dir.exists();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot make the cache directory {}", dir.display()))?;
    let abs = std::fs::canonicalize(dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
    Ok((abs, made))
}

/// Removes `dir` if it is empty (a cache directory this command made, or
/// whose journal it deleted); anything else stays.
pub(crate) fn remove_empty_dir(dir: Option<&std::path::Path>) {
    if let Some(d) = dir {
        let _ = std::fs::remove_dir(d);
    }
}

/// What the object store holds of an S3 volume, and what its cache risks.
async fn print_s3_state(env: &Env, sb: &blizzard_volume::Superblock) {
    match blizzard_volume::lsvd::inspect(sb).await {
        Ok(s) => {
            println!(
                "objects      {}, the newest ({}) holds the journal up to record {}",
                s.objects, s.head, s.journal_seq
            );
            println!(
                "live bytes   {} of {} stored in objects ({} of {}; cleaned below {}% live{})",
                s.live_bytes,
                s.stored_bytes,
                format_size(s.live_bytes),
                format_size(s.stored_bytes),
                s.desc.gc_live_pct.unwrap_or(70),
                if s.desc.gc_live_pct.is_some() { ", set at create" } else { "" }
            );
            let when = match s.newest_object_secs {
                Some(t) => {
                    let now = env
                        .clock
                        .system_time()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs() as i64)
                        .unwrap_or(t);
                    format!("the last destage ({}s ago, object {})", (now - t).max(0), s.head)
                }
                None => "the first destage (nothing is in the object store yet)".to_string(),
            };
            println!(
                "if the cache disk dies: the writes acknowledged since {when} are lost; the volume comes back from the object store as everything before them (a consistent prefix). The serving process destages within about a second of a write."
            );
        }
        Err(e) => println!("objects      cannot be read: {e}"),
    }
}

/// A volume's access list, one line per identity.
fn print_access(list: &[blizzard_volume::access::AccessEntry]) {
    if list.is_empty() {
        println!("access       every NBD client, no client certificate at the cluster (no list): `blizzard volume access NAME --allow ID` limits NBD clients to those it names and lets them use it directly");
        return;
    }
    for (i, e) in list.iter().enumerate() {
        let what = if e.read_only { "read-only" } else { "read-write" };
        println!("{:<13}{} {what}", if i == 0 { "access" } else { "" }, e.identity);
    }
    println!("             (anyone else, and clients without a certificate, are refused)");
}

pub(crate) fn print_volume(sb: &blizzard_volume::Superblock) {
    println!("volume       {}", sb.name);
    println!("size         {} ({} bytes)", format_size(sb.size_bytes), sb.size_bytes);
    if let Some(s3) = sb.backend.s3() {
        println!("backend      s3: an LSVD volume (design 0008), a log of objects under {}", s3.url);
        println!(
            "cache        {} on the host that serves it: a {} journal (writes are acknowledged there, a flush is its fdatasync) and a {} read cache",
            s3.cache_dir,
            format_size(s3.cache_bytes),
            format_size(s3.cache_bytes)
        );
        println!("uuid         {:032x}", s3.uuid);
        return;
    }
    println!("backend      blob (the cluster's tractservers)");
    println!("commit mode  {}", sb.mode.name());
    let flush_note = match sb.flush {
        FlushPolicy::Durable => "a flush returns once earlier writes are durable (NBD's contract)",
        FlushPolicy::Ordered => {
            "a flush only orders writes; after a crash the volume holds a prefix of flushes (WEAKER than NBD)"
        }
    };
    println!("flush        {}: {flush_note}", sb.flush.name());
    println!("replication  {}", sb.replication);
    println!("block size   {}", format_size(sb.block_size as u64));
    println!("segment      {} tracts", sb.segment_tracts);
    println!(
        "exposure     at most {} / {} writes / {} ms acknowledged but not durable",
        format_size(sb.exposure.bytes_max),
        sb.exposure.writes_max,
        sb.exposure.age_ms_max
    );
}

fn via_note(via: manage::Via) -> &'static str {
    match via {
        manage::Via::Server => " (through the process serving it)",
        manage::Via::Opened => " (nobody served it: opened here, then closed)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_default_to_a_sibling_prefix() {
        assert_eq!(sibling_url("http://h:1/bucket/vols/a", "b"), "http://h:1/bucket/vols/b");
        assert_eq!(sibling_url("http://h:1/bucket/a/", "b"), "http://h:1/bucket/b");
        assert_eq!(sibling_url("http://h:1/bucket", "b"), "http://h:1/bucket/b");
        assert_eq!(sibling_url("s3://bucket/x/y", "b"), "s3://bucket/x/b");
        assert_eq!(sibling_url("s3://bucket", "b"), "s3://bucket/b");
        assert!(snapshot_ref("a@b").is_ok());
        for bad in ["a", "@b", "a@", ""] {
            assert!(snapshot_ref(bad).is_err(), "{bad:?}");
        }
    }
}
