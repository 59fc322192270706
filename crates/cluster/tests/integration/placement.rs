//! Placements (design 0009, Ursa §3.1) on an embedded cluster of both disk
//! classes: the table gets a section per placement, a volume of each
//! placement lives only on the disks its placement names, a hybrid
//! volume's reads go to its fast primary and its backups' small writes to
//! their journals, an `hdd` volume never uses a journal, and when a disk
//! dies its rows are taken over by a disk of the same class.

#![allow(clippy::unwrap_used)]
// Real time: the cluster runs on real sockets and files.
#![allow(clippy::disallowed_methods)]

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};

use blizzard_cluster::{Cluster, ClusterConfig};
use blizzard_core::{DiskClass, Placement, TractNo, TsId};
use blizzard_env::Env;
use blizzard_volume::{manage, VolumeSpec};

type R = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const SSD: usize = 4;
const HDD: usize = 4;

async fn cluster(dir: &tempfile::TempDir) -> Cluster {
    let mut cfg = ClusterConfig::new(dir.path());
    cfg.tractservers = SSD + HDD;
    cfg.hdd_tractservers = HDD;
    cfg.journal_size = Some(8 << 20);
    cfg.replication = 3;
    cfg.tract_size = 64 << 10;
    cfg.disk_size = 64 << 20;
    cfg.heartbeat_interval = Duration::from_millis(50);
    Cluster::start(Env::real(), cfg).await.unwrap()
}

/// Each tractserver's class, by id: the first `SSD` are fast.
fn classes(c: &Cluster) -> BTreeMap<TsId, DiskClass> {
    (0..c.tractserver_count())
        .filter_map(|i| {
            c.tractserver(i).map(|t| (t.id, if i >= SSD { DiskClass::Hdd } else { DiskClass::Ssd }))
        })
        .collect()
}

/// Per tractserver index: (reads, journaled writes).
fn counters(c: &Cluster) -> Vec<(u64, u64)> {
    (0..c.tractserver_count())
        .map(|i| match c.tractserver(i) {
            Some(t) => {
                let s = &t.service.store.stats;
                (s.reads.load(Ordering::Relaxed), s.journaled_writes.load(Ordering::Relaxed))
            }
            None => (0, 0),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_live_on_the_disks_their_placement_names() -> R {
    let dir = tempfile::tempdir()?;
    let mut c = cluster(&dir).await;
    let client = c.client().await?;
    let env = Env::real();
    let class = classes(&c);
    let class_of = |_: &Cluster, id: TsId| class[&id];
    let status = client.cluster_status().await?;
    let placements: Vec<Placement> = status.sections.iter().map(|s| s.placement).collect();
    assert_eq!(placements, Placement::ALL.to_vec(), "{:?}", status.sections);

    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut data: BTreeMap<Placement, Vec<u8>> = BTreeMap::new();
    for p in Placement::ALL {
        let mut spec = VolumeSpec::new(format!("v-{p}"), 2 << 20);
        spec.replication = 3;
        spec.block_size = Some(4096);
        spec.segment_tracts = 4;
        spec.placement = p;
        let before = counters(&c);
        let v = manage::create(env.clone(), &client, &spec).await?;
        let mut bytes = vec![0u8; 2 << 20];
        rng.fill(&mut bytes[..]);
        for at in (0..bytes.len()).step_by(16 << 10) {
            v.write(at as u64, Bytes::copy_from_slice(&bytes[at..at + (16 << 10)]), false).await?;
        }
        v.flush_durable().await?;
        let mid = counters(&c);
        // Every tract of its blob sits in rows of its section, on disks
        // of the classes the section's columns name.
        let blob = manage::find_blob(&client, &spec.name).await?;
        assert_eq!(Placement::of(blob.id()), p);
        let tlt = client.tlt();
        for t in -1..blob.size_tracts() as i64 {
            let row = tlt.locate(blob.id(), TractNo(t));
            assert_eq!(tlt.row_placement(row), p, "tract {t}");
            for (col, m) in tlt.row_members(row).enumerate() {
                if let Some(want) = p.column_class(col) {
                    assert_eq!(class_of(&c, m.id), want, "{p}: tract {t} column {col}");
                }
            }
        }
        // Reads: a hybrid volume's from its fast primaries only.
        let got = v.read(0, bytes.len() as u64).await?;
        assert!(got[..] == bytes[..], "{p}: reads back");
        let after = counters(&c);
        let hdd_reads: u64 = (SSD..SSD + HDD).map(|i| after[i].0 - mid[i].0).sum();
        let ssd_reads: u64 = (0..SSD).map(|i| after[i].0 - mid[i].0).sum();
        let journaled: u64 = (SSD..SSD + HDD).map(|i| mid[i].1 - before[i].1).sum();
        match p {
            Placement::Hybrid => {
                assert_eq!(hdd_reads, 0, "hybrid reads go to the ssd primary");
                assert!(ssd_reads > 0);
                assert!(journaled > 0, "the hdd backups journal small writes");
            }
            Placement::Ssd => assert_eq!((hdd_reads, journaled), (0, 0)),
            Placement::Hdd => {
                assert_eq!(ssd_reads, 0);
                assert_eq!(journaled, 0, "an hdd volume keeps off the journals");
            }
            Placement::Any => {}
        }
        v.close().await?;
        data.insert(p, bytes);
    }
    // One name, one volume, whatever the placement.
    let mut dup = VolumeSpec::new("v-hybrid", 1 << 20);
    dup.replication = 3;
    dup.placement = Placement::Ssd;
    assert!(manage::create(env.clone(), &client, &dup).await.is_err());
    let names: Vec<String> = manage::list(&client).await?.into_iter().map(|s| s.name).collect();
    assert_eq!(names.len(), 4, "{names:?}");

    // An ssd dies: its rows, hybrid ones included, are taken over by
    // the other ssd (the hybrid backups stay); every volume still reads
    // back.
    let dead = c.tractserver(0).unwrap().id;
    c.stop_tractserver(0).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (client, tlt) = loop {
        let client = c.client().await?;
        let tlt = client.tlt();
        let gone = !tlt.rows.iter().any(|r| {
            r.members
                .iter()
                .chain(r.pending.iter().map(|p| &p.member))
                .any(|&m| tlt.members[m as usize].id == dead)
        });
        if gone && client.cluster_status().await?.fully_replicated() {
            break (client, tlt);
        }
        assert!(std::time::Instant::now() < deadline, "re-replication did not finish");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for row in 0..tlt.rows.len() {
        for (col, m) in tlt.row_members(row).enumerate() {
            if let Some(want) = tlt.column_class(row, col) {
                assert_eq!(class_of(&c, m.id), want, "row {row} column {col} after the failure");
            }
        }
    }
    for (p, bytes) in &data {
        let v = manage::open_read_only(&client, &format!("v-{p}")).await?;
        let got = v.read(0, bytes.len() as u64).await?;
        assert!(got[..] == bytes[..], "{p}: reads back after re-replication");
    }
    c.stop().await;
    Ok(())
}
