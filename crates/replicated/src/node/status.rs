//! A member's state for tools: its `Status` (what `blizzard kv status`
//! and `blizzard status` print) and its Prometheus metrics.

use openraft::async_runtime::watch::WatchReceiver;
use openraft::ServerState;

use super::Inner;
use crate::proto::Status;
use crate::service::Service;

fn state_name(s: ServerState) -> &'static str {
    match s {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    }
}

pub(super) fn status_of<S: Service>(inner: &Inner<S>) -> Status {
    let m = inner.raft.metrics().borrow_watched().clone();
    let membership = m.membership_config.membership().clone();
    let leader = m.current_leader.map(|id| {
        let addr = membership.get_node(&id).map(|n| n.addr.clone()).unwrap_or_default();
        (id, addr)
    });
    let matched = m.replication.clone().unwrap_or_default();
    let members = membership
        .nodes()
        .map(|(id, n)| {
            let matched = if Some(*id) == m.current_leader && m.state == ServerState::Leader {
                m.last_log_index
            } else {
                matched.get(id).and_then(|l| l.as_ref().map(|l| l.index))
            };
            (*id, n.addr.clone(), matched)
        })
        .collect();
    let stats = inner.machine.stats();
    Status {
        id: inner.cfg.id,
        cluster: inner.cluster,
        state: state_name(m.state).to_string(),
        term: m.current_term,
        leader,
        last_log: m.last_log_index,
        committed: m.local_committed.map(|l| l.index),
        applied: m.last_applied.map(|l| l.index),
        snapshot: m.snapshot.map(|l| l.index),
        purged: m.purged.map(|l| l.index),
        members,
        ops_applied: stats.ops_applied.load(std::sync::atomic::Ordering::Relaxed),
        sessions_answered: stats.ops_answered_from_sessions.load(std::sync::atomic::Ordering::Relaxed),
    }
}

/// This member's state as Prometheus metrics (`--metrics`).
pub(super) fn metrics_text<S: Service>(inner: &Inner<S>) -> String {
    let st = status_of(inner);
    let log = inner.log.stats();
    let m = inner.machine.stats();
    let n = |v: Option<u64>| v.map_or(-1.0, |v| v as f64);
    let relaxed = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let ids: Vec<String> = st.members.iter().map(|(id, _, _)| id.to_string()).collect();
    let mut text = blizzard_metrics::Text::new();
    text.gauge("blizzard_raft_term", "This member's current Raft term.", st.term as f64)
        .gauge(
            "blizzard_raft_leader",
            "1 if this member leads its group, else 0.",
            (st.state == "leader") as u8 as f64,
        )
        .gauge(
            "blizzard_raft_last_log_index",
            "Index of the last entry in this member's log (-1: none).",
            n(st.last_log),
        )
        .gauge(
            "blizzard_raft_committed_index",
            "Index of the last entry known committed (-1: none).",
            n(st.committed),
        )
        .gauge("blizzard_raft_applied_index", "Index of the last entry applied (-1: none).", n(st.applied))
        .gauge("blizzard_raft_snapshot_index", "Index the newest snapshot covers (-1: none).", n(st.snapshot))
        .gauge("blizzard_raft_purged_index", "Index the log is purged through (-1: none).", n(st.purged));
    let per_member: Vec<(Vec<(&str, &str)>, f64)> = st
        .members
        .iter()
        .zip(&ids)
        .filter_map(|((_, _, m), id)| m.map(|m| (vec![("member", id.as_str())], m as f64)))
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = per_member.iter().map(|(l, v)| (l.as_slice(), *v)).collect();
    text.gauges(
        "blizzard_raft_member_matched_index",
        "On the leader: the last index each member has durably (replication progress).",
        &samples,
    )
    .counter("blizzard_runtime_ops_applied_total", "Client operations applied.", relaxed(&m.ops_applied))
    .counter(
        "blizzard_runtime_ops_answered_from_sessions_total",
        "Retried operations answered from the session table instead of applied again.",
        relaxed(&m.ops_answered_from_sessions),
    )
    .counter("blizzard_runtime_apply_runs_total", "Runs of committed entries applied.", relaxed(&m.runs))
    .counter("blizzard_runtime_entries_applied_total", "Log entries applied.", relaxed(&m.entries))
    .counter("blizzard_runtime_snapshots_built_total", "Snapshots built here.", relaxed(&m.snapshots_built))
    .counter(
        "blizzard_runtime_snapshots_installed_total",
        "Snapshots received from the leader and installed.",
        relaxed(&m.snapshots_installed),
    )
    .counter("blizzard_log_appends_total", "Appends to the Raft log.", log.appends as f64)
    .counter("blizzard_log_entries_total", "Entries appended to the Raft log.", log.entries as f64)
    .counter("blizzard_log_syncs_total", "fdatasyncs of the log's files.", log.syncs as f64)
    .counter(
        "blizzard_log_bytes_written_total",
        "Bytes written to the log's files.",
        log.bytes_written as f64,
    )
    .gauge("blizzard_log_segments", "Live log segment files.", log.segments as f64);
    text.finish()
}
