//! Where the metadata server's replicated state lives (design 0007): in a
//! member of a runtime group (`blizzard meta --peers`), or, for a single
//! metadata server started without `--peers`, in memory as before the
//! runtime (it then rebuilds the table from the tractservers' reports
//! after a restart), but for its access lists and revocations, which
//! nothing could rebuild: those a single server keeps on disk under its
//! `--data` (`scope_store`), or refuses to keep. The server's shell sees
//! one interface either way.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use blizzard_env::Env;
pub use blizzard_replicated::node::Timing;
use blizzard_replicated::node::{Node, NodeConfig, NodeError, ProposeError};
use blizzard_replicated::proto::{Replicated, Status};

use blizzard_proto::scope::Scope;

use crate::machine::{MetaMachine, MetaOp, MetaReply, MetaState};
use crate::scope_store::ScopeStore;
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
    Solo {
        machine: Arc<MetaMachine>,
        /// Where its access lists and revocations are kept, if anywhere.
        store: Option<ScopeStore>,
        /// One change of them at a time (applied, then saved).
        changing: tokio::sync::Mutex<()>,
    },
    Group {
        node: Node<MetaMachine>,
        machine: Arc<MetaMachine>,
    },
}

impl Replica {
    /// A single server; with `store`, the scope table it held is loaded
    /// from there and every change of it saved there.
    pub fn solo(plant: MetaPlant, store: Option<(ScopeStore, Scope)>) -> Replica {
        let machine = Arc::new(MetaMachine::new(plant));
        let store = store.map(|(store, scope)| {
            machine.set_scope(scope);
            store
        });
        Replica::Solo { machine, store, changing: tokio::sync::Mutex::new(()) }
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
            Replica::Solo { machine, .. } => machine,
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
            Replica::Solo { .. } => Some(0),
            Replica::Group { node, .. } => node.leading_term(),
        }
    }

    /// Who leads, as far as this replica knows: (id, address).
    pub fn leader_hint(&self) -> Option<(u64, String)> {
        match self {
            Replica::Solo { .. } => None,
            Replica::Group { node, .. } => node.leader_hint(),
        }
    }

    /// Confirms leadership with a quorum and waits until everything
    /// committed before is applied here.
    pub async fn confirm(&self) -> Result<(), ReplicaError> {
        match self {
            Replica::Solo { .. } => Ok(()),
            Replica::Group { node, .. } => {
                node.confirm_leadership().await.map_err(|e| ReplicaError::NotLeader(e.to_string()))
            }
        }
    }

    /// Applies a change through the log (or here, for a single server:
    /// a change of the scope table is saved before this returns, and
    /// refused where there is nowhere to save it).
    pub async fn propose(&self, op: &MetaOp) -> Result<MetaReply, ReplicaError> {
        let bytes = match self {
            Replica::Solo { machine, store, changing } => {
                let durable = matches!(
                    op,
                    MetaOp::SetAccess { .. } | MetaOp::DropVolume { .. } | MetaOp::Revoke { .. }
                );
                if !durable {
                    return Ok(machine.apply_here(op));
                }
                let Some(store) = store else {
                    return match op {
                        // Nothing to lose: an empty list is what no record means.
                        MetaOp::SetAccess { entries, .. } if entries.is_empty() => Ok(machine.apply_here(op)),
                        // Lost with a restart as the leases are: the NBD
                        // server registers again when it opens the volume.
                        MetaOp::DropVolume { .. } | MetaOp::AttachReader { .. } => Ok(machine.apply_here(op)),
                        _ => Err(ReplicaError::Refused(NO_STORE.into())),
                    };
                };
                let _one = changing.lock().await;
                let reply = machine.apply_here(op);
                let table = machine.read_state(|s| crate::scope::durable_part(&s.scope));
                store.save(&table).await.map_err(|e| {
                    ReplicaError::Refused(format!(
                        "the change is made but could not be saved ({e}): it may be lost on a restart; fix the metadata server's --data directory and make it again"
                    ))
                })?;
                return Ok(reply);
            }
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
            Replica::Solo { .. } => None,
            Replica::Group { node, .. } => Some(node.status()),
        }
    }

    pub async fn shutdown(&self) {
        if let Replica::Group { node, .. } = self {
            node.shutdown().await;
        }
    }
}

/// Why a single server without `--data` refuses an access list or a
/// revocation.
pub const NO_STORE: &str = "this metadata server runs alone without --data, so it keeps access lists and revocations nowhere a restart would find them: start it with --data DIR (or run a group of replicas)";

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
