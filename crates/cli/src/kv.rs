//! `blizzard kv`: a replica group of the replicated runtime serving an
//! ordered map, priority queues and a graph (`blizzard_replicated::ds`),
//! and the client commands that use them. Flags only: the server is
//! `blizzard_replicated::node`, the client `blizzard_replicated::client`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::{Args, Subcommand};

use blizzard_env::Env;
use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::ds::ops::{Query, QueryReply, Update, UpdateReply};
use blizzard_replicated::ds::Structures;
use blizzard_replicated::node::{Node, NodeConfig, Timing};

#[derive(Subcommand)]
pub enum KvCmd {
    /// Run one member of a replica group (Raft on openraft; the log and
    /// snapshots under --data). Start every member with the same --peers.
    Serve {
        /// This member's id: one of the ids in --peers.
        #[arg(long)]
        id: u64,
        /// Every member as ID=ADDR, comma-separated (the same list on every
        /// member): where each listens, for its peers and its clients.
        #[arg(long)]
        peers: String,
        /// Where to listen (default: this member's ADDR in --peers).
        #[arg(long)]
        listen: Option<String>,
        /// Directory for the log and the snapshots.
        #[arg(long)]
        data: PathBuf,
        /// Workers applying commuting operations at once (1: in log order).
        /// The map's, queues' and graph's operations cost well under a
        /// microsecond each, less than handing them to another core
        /// (`apply-bench`: 0.71x serial for 256-byte puts, 1.41x at 1 µs
        /// of work per operation, 1.77x at 5 µs): serial by default.
        #[arg(long, default_value_t = 1)]
        apply_threads: usize,
        /// One operation per Raft entry (for comparison).
        #[arg(long)]
        no_batching: bool,
        /// Batches handed to Raft and not yet committed, at most (more
        /// pipelining, smaller batches).
        #[arg(long, default_value_t = 2)]
        max_inflight_batches: usize,
        /// Copy operations' bytes at every step (for comparison).
        #[arg(long)]
        copy_payloads: bool,
        #[arg(long, default_value_t = 50)]
        heartbeat_ms: u64,
        /// Election timeout range, MIN..MAX milliseconds.
        #[arg(long, default_value = "150..300")]
        election_timeout_ms: String,
        /// Take a snapshot every this many log entries.
        #[arg(long, default_value_t = 10_000)]
        snapshot_every: u64,
        /// Serve Prometheus metrics at `GET /metrics` on this address.
        #[arg(long)]
        metrics: Option<String>,
    },
    /// Each member's state: leader, term, log and apply positions, and
    /// (from the leader) how far each follower lags.
    Status {
        #[command(flatten)]
        to: Peers,
    },
    /// Set KEY to VALUE in the map (prints the previous value). A VALUE of
    /// `-` is read from standard input.
    Put {
        key: String,
        value: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Print KEY's value.
    Get {
        key: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Remove KEY.
    Delete {
        key: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Print keys from START (inclusive) to END (exclusive), in order.
    Range {
        #[arg(default_value = "")]
        start: String,
        end: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        to: Peers,
    },
    /// Add VALUE to QUEUE with PRIORITY (higher pops first); `-` reads
    /// VALUE from standard input.
    Push {
        queue: String,
        #[arg(allow_hyphen_values = true)]
        priority: i64,
        value: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Remove and print QUEUE's highest-priority element.
    Pop {
        queue: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Print QUEUE's top N elements without removing them.
    Peek {
        queue: String,
        #[arg(default_value_t = 10)]
        n: u32,
        #[command(flatten)]
        to: Peers,
    },
    /// Add (or change) vertex V with attributes ATTRS.
    AddVertex {
        v: u64,
        #[arg(default_value = "")]
        attrs: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Add (or change) the edge between U and V (missing vertices are created).
    AddEdge {
        u: u64,
        v: u64,
        #[arg(default_value = "")]
        attrs: String,
        #[command(flatten)]
        to: Peers,
    },
    /// Remove the edge between U and V.
    RemoveEdge {
        u: u64,
        v: u64,
        #[command(flatten)]
        to: Peers,
    },
    /// Print V's neighbors and the edges' attributes.
    Neighbors {
        v: u64,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        to: Peers,
    },
}

#[derive(Args)]
pub struct Peers {
    /// The group's members: ADDR,ADDR,... or ID=ADDR,... (any member finds
    /// the leader).
    #[arg(long)]
    peers: String,
}

/// Parses `1=ADDR,2=ADDR,...` into ids and addresses, refusing repeats.
pub fn parse_members(s: &str) -> Result<BTreeMap<u64, String>> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((id, addr)) = part.split_once('=') else {
            bail!("--peers: {part:?} is not ID=ADDR (e.g. 1=127.0.0.1:7401)");
        };
        let id: u64 = id.trim().parse().with_context(|| format!("--peers: {id:?} is not a member id"))?;
        if id == 0 {
            bail!("--peers: member ids start at 1");
        }
        let addr = addr.trim().to_string();
        if out.values().any(|a| *a == addr) {
            bail!("--peers: {addr} is given twice");
        }
        if out.insert(id, addr).is_some() {
            bail!("--peers: member {id} is given twice");
        }
    }
    if out.is_empty() {
        bail!("--peers: no members given");
    }
    Ok(out)
}

/// Client side: addresses, with or without ids.
fn parse_addrs(s: &str) -> Result<Vec<String>> {
    let addrs: Vec<String> = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').map_or(p, |(_, a)| a).to_string())
        .collect();
    if addrs.is_empty() {
        bail!("--peers: no members given");
    }
    Ok(addrs)
}

fn parse_range(s: &str) -> Result<(u64, u64)> {
    let (a, b) = s.split_once("..").with_context(|| format!("{s:?}: use MIN..MAX, e.g. 150..300"))?;
    Ok((a.trim().parse()?, b.trim().parse()?))
}

/// A value argument: itself, or standard input for `-`.
fn value_arg(v: String) -> Result<Bytes> {
    if v != "-" {
        return Ok(v.into());
    }
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf)
        .context("reading the value from standard input")?;
    Ok(buf.into())
}

fn show(b: &Bytes) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) async fn run(env: Env, cmd: KvCmd, auth: &crate::tls_cmd::ClusterAuth) -> Result<()> {
    match cmd {
        KvCmd::Serve {
            id,
            peers,
            listen,
            data,
            apply_threads,
            no_batching,
            max_inflight_batches,
            copy_payloads,
            heartbeat_ms,
            election_timeout_ms,
            snapshot_every,
            metrics,
        } => {
            let members = parse_members(&peers)?;
            let (lo, hi) = parse_range(&election_timeout_ms)?;
            let mut cfg = NodeConfig::new(id, members, data.clone());
            if let Some(l) = listen {
                cfg.listen = l;
            }
            auth.require_certs("a runtime member")?;
            cfg.timing = Timing { heartbeat_ms, election_min_ms: lo, election_max_ms: hi };
            cfg.machine.apply_threads = apply_threads.max(1);
            cfg.batching = !no_batching;
            cfg.max_inflight_batches = max_inflight_batches.max(1);
            cfg.copy_payloads = copy_payloads;
            cfg.snapshot_every = snapshot_every;
            cfg.metrics_listen = metrics;
            let node = Node::start(env, cfg, Arc::new(Structures::new())).await?;
            tracing::info!(id, addr = %node.addr, data = %data.display(), cluster = %format!("{:032x}", node.cluster()), "kv member serving; Ctrl-C or SIGTERM stops it");
            crate::wait_for_stop_signal().await?;
            tracing::info!("stopping");
            node.stop().await;
            Ok(())
        }
        KvCmd::Status { to } => status(env, &to).await,
        KvCmd::Put { key, value, to } => {
            let r = update(&env, &to, Update::Put { key: key.into(), value: value_arg(value)? }).await?;
            match r {
                UpdateReply::Put(Some(old)) => println!("OK (was {})", show(&old)),
                _ => println!("OK"),
            }
            Ok(())
        }
        KvCmd::Get { key, to } => match query(&env, &to, Query::Get { key: key.clone().into() }).await? {
            QueryReply::Get(Some(v)) => {
                println!("{}", show(&v));
                Ok(())
            }
            _ => bail!("no key {key:?}"),
        },
        KvCmd::Delete { key, to } => {
            match update(&env, &to, Update::Delete { key: key.clone().into() }).await? {
                UpdateReply::Delete(true) => {
                    println!("deleted");
                    Ok(())
                }
                _ => bail!("no key {key:?}"),
            }
        }
        KvCmd::Range { start, end, limit, to } => {
            let q = Query::Range { start: start.into(), end: end.map(Bytes::from), limit };
            if let QueryReply::Range(r) = query(&env, &to, q).await? {
                for (k, v) in &r.pairs {
                    println!("{}\t{}", show(k), show(v));
                }
                if r.more {
                    eprintln!("(more: raise --limit or start after the last key)");
                }
            }
            Ok(())
        }
        KvCmd::Push { queue, priority, value, to } => {
            update(&env, &to, Update::Push { queue: queue.into(), priority, value: value_arg(value)? })
                .await?;
            println!("OK");
            Ok(())
        }
        KvCmd::Pop { queue, to } => {
            match update(&env, &to, Update::Pop { queue: queue.clone().into() }).await? {
                UpdateReply::Pop(Some(item)) => {
                    println!("{}\t{}", item.priority, show(&item.value));
                    Ok(())
                }
                _ => bail!("queue {queue:?} is empty"),
            }
        }
        KvCmd::Peek { queue, n, to } => {
            if let QueryReply::Peek(items) = query(&env, &to, Query::Peek { queue: queue.into(), n }).await? {
                for i in &items.items {
                    println!("{}\t{}", i.priority, show(&i.value));
                }
            }
            Ok(())
        }
        KvCmd::AddVertex { v, attrs, to } => {
            update(&env, &to, Update::AddVertex { v, attrs: attrs.into() }).await?;
            println!("OK");
            Ok(())
        }
        KvCmd::AddEdge { u, v, attrs, to } => {
            update(&env, &to, Update::AddEdge { u, v, attrs: attrs.into() }).await?;
            println!("OK");
            Ok(())
        }
        KvCmd::RemoveEdge { u, v, to } => match update(&env, &to, Update::RemoveEdge { u, v }).await? {
            UpdateReply::RemoveEdge(true) => {
                println!("removed");
                Ok(())
            }
            _ => bail!("no edge between {u} and {v}"),
        },
        KvCmd::Neighbors { v, limit, to } => {
            if let QueryReply::Neighbors(n) =
                query(&env, &to, Query::Neighbors { v, start: 0, limit }).await?
            {
                for (id, attrs) in &n.neighbors {
                    println!("{id}\t{}", show(attrs));
                }
                if n.more {
                    eprintln!("(more: raise --limit)");
                }
            }
            Ok(())
        }
    }
}

/// What a request may hold, for error messages.
const LIMITS: &str = "keys are at most 4 KiB, values 1 MiB, queue names 256 bytes, attributes 64 KiB";

fn client(env: &Env, to: &Peers) -> Result<Client> {
    let cfg = ClientConfig { request_timeout: Duration::from_secs(10), ..ClientConfig::default() };
    Ok(Client::new(env, parse_addrs(&to.peers)?, cfg))
}

async fn update(env: &Env, to: &Peers, u: Update) -> Result<UpdateReply> {
    u.check().map_err(|e| anyhow::anyhow!("invalid input ({e}): {LIMITS}"))?;
    let c = client(env, to)?;
    let reply = c.update(u.encode()).await?;
    let r = u.decode_reply(&reply).context("undecodable reply")?;
    // The session's replies are no longer needed.
    let _ = c.close_session().await;
    Ok(r)
}

async fn query(env: &Env, to: &Peers, q: Query) -> Result<QueryReply> {
    q.check().map_err(|e| anyhow::anyhow!("invalid input ({e}): {LIMITS}"))?;
    let c = client(env, to)?;
    let reply = c.read(q.encode()).await?;
    q.decode_reply(&reply).context("undecodable reply")
}

async fn status(env: Env, to: &Peers) -> Result<()> {
    let c = client(&env, to)?;
    let all = c.statuses().await;
    let reachable = all.iter().filter(|(_, r)| r.is_ok()).count();
    if !print_members(&all) {
        bail!(
            "no member is the leader ({reachable} of {} reachable): a majority must be up to elect one",
            all.len()
        );
    }
    Ok(())
}

/// A group's members as a table (state, term, leader, log positions and
/// each one's lag behind the leader); whether one of them leads. Shared
/// by `blizzard kv status` and `blizzard status` (metadata replicas).
pub fn print_members(all: &[(String, Result<blizzard_replicated::proto::Status, String>)]) -> bool {
    println!(
        "{:<4} {:<24} {:<10} {:>6} {:>8} {:>10} {:>10} {:>10} {:>8}",
        "id", "address", "state", "term", "leader", "last log", "committed", "applied", "lag"
    );
    // The leader's view of each follower's progress.
    let leader_view = all.iter().filter_map(|(_, r)| r.as_ref().ok()).find(|s| s.state == "leader").cloned();
    for (addr, r) in all {
        match r {
            Ok(s) => {
                let lag = leader_view.as_ref().and_then(|l| {
                    let m = l.members.iter().find(|(id, _, _)| *id == s.id)?.2;
                    Some(l.last_log.unwrap_or(0).saturating_sub(m.unwrap_or(0)))
                });
                let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                println!(
                    "{:<4} {:<24} {:<10} {:>6} {:>8} {:>10} {:>10} {:>10} {:>8}",
                    s.id,
                    addr,
                    s.state,
                    s.term,
                    s.leader.as_ref().map_or("-".to_string(), |(id, _)| id.to_string()),
                    opt(s.last_log),
                    opt(s.committed),
                    opt(s.applied),
                    lag.map_or("-".to_string(), |l| l.to_string())
                );
            }
            Err(e) => println!("{:<4} {:<24} unreachable: {e}", "?", addr),
        }
    }
    leader_view.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_lists_are_checked() {
        assert_eq!(parse_members("1=a:1, 2=b:2").unwrap_or_default().len(), 2);
        for bad in ["", "a:1", "x=a:1", "0=a:1", "1=a:1,1=b:2", "1=a:1,2=a:1"] {
            assert!(parse_members(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(parse_addrs("1=a:1,b:2").unwrap_or_default(), vec!["a:1".to_string(), "b:2".to_string()]);
    }
}
