//! The metadata service's replicated state (`metaserver::machine`, design
//! 0007) on three real `blizzard-replicated` members over unix sockets and
//! files: the served table, the version floors and the volume leases
//! survive the leader's loss; a new leader's `ExtendAll` keeps a lease
//! granted under its predecessor; a second holder is refused until it
//! takes the volume over under a newer token; a member that was down
//! restarts from its own snapshot and log and catches up to the same
//! state as the others.

// Real sockets, files and time: the test waits in real time.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use blizzard_core::tlt::{Tlt, TltMember, TltRow};
use blizzard_core::{BlobId, TsId};
use blizzard_env::Env;
use blizzard_metaserver::lease::Outcome;
use blizzard_metaserver::machine::{LeaseEntry, MetaMachine, MetaOp, MetaQuery, MetaReply};
use blizzard_proto::RowRef;
use blizzard_replicated::client::{Client, ClientConfig};
use blizzard_replicated::node::{Node, NodeConfig};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

struct Group {
    dir: tempfile::TempDir,
    members: BTreeMap<u64, String>,
    nodes: BTreeMap<u64, (Node<MetaMachine>, Arc<MetaMachine>)>,
}

impl Group {
    async fn start() -> Result<Group, Box<dyn std::error::Error + Send + Sync>> {
        let dir = tempfile::tempdir()?;
        let members: BTreeMap<u64, String> =
            (1..=3).map(|i| (i, format!("unix:{}/m{i}.sock", dir.path().display()))).collect();
        let mut g = Group { dir, members, nodes: BTreeMap::new() };
        for i in 1..=3 {
            g.start_member(i).await?;
        }
        Ok(g)
    }

    async fn start_member(&mut self, id: u64) -> R {
        let mut cfg = NodeConfig::new(id, self.members.clone(), self.dir.path().join(format!("m{id}")));
        cfg.snapshot_every = 10;
        let svc = Arc::new(MetaMachine::default());
        let node = Node::start(Env::real(), cfg, svc.clone()).await?;
        self.nodes.insert(id, (node, svc));
        Ok(())
    }

    async fn stop_member(&mut self, id: u64) {
        if let Some((n, _)) = self.nodes.remove(&id) {
            n.stop().await;
        }
    }

    fn client(&self) -> Client {
        let cfg = ClientConfig { attempt_timeout: Duration::from_millis(500), ..ClientConfig::default() };
        Client::new(&Env::real(), self.members.values().cloned().collect(), cfg)
    }

    async fn leader(&self) -> u64 {
        for _ in 0..250 {
            for (id, (n, _)) in &self.nodes {
                if n.raft().is_leader() {
                    return *id;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no leader within 5 s");
    }
}

fn table(version: u64, row_version: u64) -> Tlt {
    Tlt {
        cluster_id: 3,
        tract_size: 1 << 20,
        replication: 2,
        version,
        members: (1..=3)
            .map(|i| TltMember { id: TsId(i), addr: format!("ts{i}"), domain: format!("d{i}") })
            .collect(),
        rows: vec![TltRow::new(row_version, vec![0, 1]), TltRow::new(row_version, vec![1, 2])],
        sections: Vec::new(),
    }
}

async fn update(c: &Client, op: MetaOp) -> Result<MetaReply, Box<dyn std::error::Error + Send + Sync>> {
    Ok(MetaReply::decode(&c.update(op.encode()).await?)?)
}

fn acquire(holder: &str, now_ms: u64, take_over: bool) -> MetaOp {
    MetaOp::Acquire {
        blob: BlobId(5),
        holder: holder.into(),
        now_ms,
        ttl_ms: 10_000,
        take_over,
        peer: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_floors_and_leases_survive_the_leaders_loss() -> R {
    let mut g = Group::start().await?;
    let c = g.client();
    let serve = |tlt| MetaOp::Serve { tlt, filling: vec![], dead: vec![TsId(3)], unsettled: vec![] };
    assert_eq!(update(&c, serve(table(10, 5))).await?, MetaReply::Done);
    assert_eq!(
        update(
            &c,
            MetaOp::Reserve {
                tlt_version: 12,
                rows: vec![RowRef { row: 0, version: 7 }],
                dead: vec![TsId(3)],
                unsettled: vec![],
            }
        )
        .await?,
        MetaReply::Done
    );
    assert_eq!(
        update(&c, acquire("a", 1_000, false)).await?,
        MetaReply::Lease(Outcome::Granted { token: 1, expires_ms: 11_000 })
    );
    // Enough updates that every member snapshots (every 10 entries).
    for i in 0..25u64 {
        let op = MetaOp::Acquire {
            blob: BlobId(100 + i as u128),
            holder: "bulk".into(),
            now_ms: 1_000 + i,
            ttl_ms: 60_000,
            take_over: false,
            // Some leases taken with a certificate: every replica must
            // pass through the same scope versions (`scope`).
            peer: if i % 3 == 0 { format!("nbd{i}") } else { String::new() },
        };
        assert!(matches!(update(&c, op).await?, MetaReply::Lease(Outcome::Granted { .. })));
    }

    let old = g.leader().await;
    g.stop_member(old).await;
    // The new leader's first act (design 0007): its clock reads earlier
    // than its predecessor's (the table's clock stays at 1,024, the last
    // time an update carried), and every lease lasts a term from then.
    assert_eq!(update(&c, MetaOp::ExtendAll { now_ms: 500, ttl_ms: 10_000 }).await?, MetaReply::Done);
    assert_eq!(
        update(&c, acquire("b", 2_000, false)).await?,
        MetaReply::Lease(Outcome::Held { holder: "a".into(), expires_ms: 11_024 })
    );
    // A table that does not follow the served one is refused everywhere.
    assert!(matches!(update(&c, serve(table(10, 5))).await?, MetaReply::Refused(_)));
    let tlt: Option<Tlt> = blizzard_proto::codec::decode(&c.read(MetaQuery::Tlt.encode()).await?)?;
    assert_eq!(tlt.map(|t| t.version), Some(10));
    // Taken over: a newer token than every one handed out (26 so far).
    assert_eq!(
        update(&c, acquire("b", 2_500, true)).await?,
        MetaReply::Lease(Outcome::Granted { token: 27, expires_ms: 12_500 })
    );
    let lease: Option<LeaseEntry> = blizzard_proto::codec::decode(
        &c.read(MetaQuery::Lease { blob: BlobId(5), now_ms: 3_000 }.encode()).await?,
    )?;
    assert_eq!(lease.map(|l| (l.holder, l.token)), Some(("b".to_string(), 27)));
    assert_eq!(
        update(
            &c,
            MetaOp::Renew { blob: BlobId(5), holder: "a".into(), token: 1, now_ms: 3_000, ttl_ms: 10_000 }
        )
        .await?,
        MetaReply::Lease(Outcome::Lost { holder: Some("b".into()) })
    );

    // The old leader comes back and catches up: every member's state is
    // the same, floors included.
    g.start_member(old).await?;
    let want = {
        let l = g.leader().await;
        g.nodes[&l].1.view()
    };
    assert_eq!(want.tlt_floor, 12);
    assert_eq!(want.row_floors.get(&0), Some(&7));
    assert_eq!(want.dead.iter().copied().collect::<Vec<_>>(), vec![TsId(3)]);
    let mut same = false;
    for _ in 0..250 {
        same = g.nodes.values().all(|(_, m)| m.view() == want);
        if same {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(same, "every member holds the same metadata state");
    let ids: Vec<u64> = g.nodes.keys().copied().collect();
    for id in ids {
        g.stop_member(id).await;
    }
    Ok(())
}
