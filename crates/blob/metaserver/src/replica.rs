//! Where the metadata server's replicated state lives (design 0007): in a
//! member of a runtime group (`blizzard meta --peers`), or, for a single
//! metadata server started without `--peers`, in memory as before the
//! runtime (it then rebuilds the table from the tractservers' reports
//! after a restart). The server's shell sees one interface either way.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use blizzard_env::Env;
pub use blizzard_replicated::node::Timing;
use blizzard_replicated::node::{Node, NodeConfig, NodeError, ProposeError};
use blizzard_replicated::proto::{Replicated, Status};

use crate::machine::{MetaMachine, MetaOp, MetaReply, MetaState};
use crate::server::MetaPlant;

/// One replica of a metadata group.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    pub id: u64,
    /// Every replica's id and address (this one's included), the same on
    /// every replica: each serves its peers and its clients there.
    pub peers: BTreeMap<u64, String>,
    /// The runtime's log and snapshots.
    pub data_dir: PathBuf,
    pub timing: Timing,
}

/// Why a replicated change did not happen.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("{0}")]
    NotLeader(String),
    #[error("the replicated state refused the change: {0}")]
    Refused(String),
}

pub enum Replica {
    Solo(Arc<MetaMachine>),
    Group { node: Node<MetaMachine>, machine: Arc<MetaMachine> },
}

impl Replica {
    pub fn solo(plant: MetaPlant) -> Replica {
        Replica::Solo(Arc::new(MetaMachine::new(plant)))
    }

    /// Starts this replica's runtime member; the returned service answers
    /// its peers' frames, for the server's listener to host.
    pub async fn group(
        env: &Env,
        g: &GroupConfig,
        plant: MetaPlant,
    ) -> Result<(Replica, Arc<dyn blizzard_rpc::Service<Replicated>>), NodeError> {
        let machine = Arc::new(MetaMachine::new(plant));
        let mut cfg = NodeConfig::new(g.id, g.peers.clone(), g.data_dir.clone());
        cfg.timing = g.timing.clone();
        // Entries are rare (a round, a lease) but a `Serve` carries the
        // whole table: snapshot well before the log grows large.
        cfg.snapshot_every = 1000;
        let (node, front) = Node::start_hosted(env.clone(), cfg, machine.clone()).await?;
        Ok((Replica::Group { node, machine }, front))
    }

    pub fn machine(&self) -> &MetaMachine {
        match self {
            Replica::Solo(m) => m,
            Replica::Group { machine, .. } => machine,
        }
    }

    pub fn read<R>(&self, f: impl FnOnce(&MetaState) -> R) -> R {
        self.machine().read_state(f)
    }

    /// The term this replica leads in (a single server always leads, in
    /// term 0).
    pub fn leading_term(&self) -> Option<u64> {
        match self {
            Replica::Solo(_) => Some(0),
            Replica::Group { node, .. } => node.leading_term(),
        }
    }

    /// Who leads, as far as this replica knows: (id, address).
    pub fn leader_hint(&self) -> Option<(u64, String)> {
        match self {
            Replica::Solo(_) => None,
            Replica::Group { node, .. } => node.leader_hint(),
        }
    }

    /// Confirms leadership with a quorum and waits until everything
    /// committed before is applied here.
    pub async fn confirm(&self) -> Result<(), ReplicaError> {
        match self {
            Replica::Solo(_) => Ok(()),
            Replica::Group { node, .. } => {
                node.confirm_leadership().await.map_err(|e| ReplicaError::NotLeader(e.to_string()))
            }
        }
    }

    /// Applies a change through the log (or here, for a single server).
    pub async fn propose(&self, op: &MetaOp) -> Result<MetaReply, ReplicaError> {
        let bytes = match self {
            Replica::Solo(m) => return Ok(m.apply_here(op)),
            Replica::Group { node, .. } => node.propose(op.encode()).await.map_err(|e| match e {
                ProposeError::NotLeader { .. } | ProposeError::Stopping => {
                    ReplicaError::NotLeader(e.to_string())
                }
                ProposeError::Rejected(why) => ReplicaError::Refused(why),
            })?,
        };
        MetaReply::decode(&bytes).map_err(|e| ReplicaError::Refused(format!("undecodable reply: {e}")))
    }

    /// This replica's view of its group (none for a single server).
    pub fn group_status(&self) -> Option<Status> {
        match self {
            Replica::Solo(_) => None,
            Replica::Group { node, .. } => Some(node.status()),
        }
    }

    pub async fn shutdown(&self) {
        if let Replica::Group { node, .. } = self {
            node.shutdown().await;
        }
    }
}

/// How long a confirmation of leadership may answer heartbeats for: a
/// heartbeat answered on it extends a tractserver's lease (two thirds of
/// `dead_after`) from when the tractserver sent it, and a new leader
/// declares a member dead no sooner than `dead_after` after it took
/// over, which is after the confirmation's quorum round started. So a
/// confirmation younger than a sixth of `dead_after` (and half a
/// heartbeat interval) can never keep a member serving past the moment a
/// new leader gives its rows away.
pub fn confirmation_window(dead_after: Duration, heartbeat_interval: Duration) -> Duration {
    (dead_after / 6).min(heartbeat_interval / 2)
}

/// Discards a reply's bytes (a proposal whose answer is `Done`).
pub fn done(r: &MetaReply) -> Result<(), ReplicaError> {
    match r {
        MetaReply::Done => Ok(()),
        MetaReply::Refused(why) => Err(ReplicaError::Refused(why.clone())),
        other => Err(ReplicaError::Refused(format!("unexpected reply {other:?}"))),
    }
}
