//! One test per case of the module header's table.

use super::*;
use blizzard_core::tlt::{Pending, TltMember};
use rand::SeedableRng;

const DEAD_AFTER: Duration = Duration::from_secs(5);

fn rules() -> Rules {
    Rules { dead_after: DEAD_AFTER, recovery: true, grow: true }
}

fn ts(id: u128) -> TsId {
    TsId(id)
}

/// Members 1..=n, each in a failure domain of its own; rows (member
/// ids, primary first) at version 5; table version 10.
fn table(n: u128, rows: &[&[u128]]) -> Tlt {
    Tlt {
        cluster_id: 7,
        tract_size: 1 << 20,
        replication: rows[0].len() as u8,
        version: 10,
        members: (1..=n)
            .map(|id| TltMember { id: ts(id), addr: format!("ts{id}"), domain: format!("d{id}") })
            .collect(),
        rows: rows.iter().map(|r| TltRow::new(5, r.iter().map(|id| (*id - 1) as u32).collect())).collect(),
        sections: Vec::new(),
    }
}

/// A test's world: the table, what each member reported, who is
/// filling what, who was declared dead, and silences.
struct World {
    tlt: Tlt,
    members: BTreeMap<TsId, Member>,
    filling: Filling,
    dead: BTreeSet<TsId>,
    silent: BTreeMap<TsId, Duration>,
}

impl World {
    /// Every member of the table registered, heard from just now,
    /// holding its current assignment.
    fn new(tlt: Tlt) -> World {
        let mut w = World {
            tlt,
            members: BTreeMap::new(),
            filling: Filling::new(),
            dead: BTreeSet::new(),
            silent: BTreeMap::new(),
        };
        let ids: Vec<TsId> = w.tlt.members.iter().map(|m| m.id).collect();
        for id in ids {
            w.register(id);
        }
        w
    }

    #[allow(clippy::disallowed_methods, reason = "the plan reads silences, never this instant")]
    fn register(&mut self, id: TsId) {
        let a = assignment_for(&self.tlt, &self.filling, id);
        self.members.insert(
            id,
            Member {
                addr: format!("ts{}", id.0),
                domain: format!("d{}", id.0),
                class: blizzard_core::DiskClass::Ssd,
                journal: (0, 0),
                last_heartbeat: Instant::now(),
                slots_total: 100,
                slots_used: 0,
                load: 0,
                disk_mbps: 100,
                reported: Some(a),
                stores_nothing: false,
                filled: Vec::new(),
                fill: FillProgress::default(),
            },
        );
        self.silent.insert(id, Duration::ZERO);
    }

    fn member(&mut self, id: u128) -> &mut Member {
        self.members.get_mut(&ts(id)).expect("registered")
    }

    fn plan_with(&self, rules: &Rules) -> Plan {
        let view = View {
            tlt: &self.tlt,
            members: &self.members,
            filling: &self.filling,
            dead: &self.dead,
            silent: &self.silent,
            silence: Duration::from_secs(60),
        };
        plan(&view, rules, &mut rand::rngs::SmallRng::seed_from_u64(1))
    }

    fn plan(&self) -> Plan {
        self.plan_with(&rules())
    }
}

fn ids(v: &[u128]) -> Vec<TsId> {
    v.iter().map(|i| ts(*i)).collect()
}

fn set(v: &[u128]) -> BTreeSet<TsId> {
    v.iter().map(|i| ts(*i)).collect()
}

#[test]
fn check_change_refuses_what_would_name_two_memberships() {
    let cur = table(4, &[&[1, 2, 3], &[2, 3, 4]]);
    let floors = HashMap::from([(0, 8)]);
    let mut next = cur.clone();
    next.version = 11;
    next.rows[0].members = vec![3, 1, 2]; // member 4 replaces 1
    next.rows[0].version = 9;
    assert_eq!(check_change(&cur, &next, &floors, 10), Ok(()));
    let mut t = next.clone();
    t.rows[0].version = 8;
    assert!(check_change(&cur, &t, &floors, 10).is_err(), "a version handed out before");
    t.rows[0].version = 5;
    assert!(check_change(&cur, &t, &HashMap::new(), 10).is_err(), "new members, same version");
    let mut t = next.clone();
    t.rows[1].version = 4;
    assert!(check_change(&cur, &t, &floors, 10).is_err(), "a version going back");
    let mut t = next.clone();
    t.version = 10;
    assert!(check_change(&cur, &t, &floors, 10).is_err(), "the table's version not moving");
    assert!(check_change(&cur, &next, &floors, 11).is_err(), "a table version handed out before");
    let mut t = next.clone();
    t.cluster_id = 8;
    assert!(check_change(&cur, &t, &floors, 10).is_err(), "another cluster");
    // Same members, new version (a settling round, or only the table
    // version moving): fine.
    let mut t = cur.clone();
    t.version = 11;
    assert_eq!(check_change(&cur, &t, &HashMap::new(), 0), Ok(()));
}

#[test]
fn a_healthy_cluster_changes_nothing() {
    let w = World::new(table(4, &[&[1, 2, 3], &[2, 3, 4], &[3, 4, 1]]));
    let p = w.plan();
    assert!(!p.commits(), "{p:?}");
    assert_eq!(p.stuck, 0);
}

#[test]
fn death_declares_the_member_and_replaces_it_in_its_rows() {
    let mut w = World::new(table(5, &[&[1, 2, 3], &[2, 3, 4], &[3, 4, 5]]));
    w.silent.insert(ts(1), DEAD_AFTER);
    let p = w.plan();
    assert_eq!(p.died, vec![(ts(1), DEAD_AFTER)]);
    assert_eq!(p.dead, set(&[1]));
    assert_eq!(p.changes.len(), 1, "{p:?}");
    let c = &p.changes[0];
    assert_eq!(c.row, 0);
    assert!(c.bump);
    assert_eq!(&c.members[1..], &ids(&[2, 3])[..]);
    let pick = c.members[0];
    assert!(pick == ts(4) || pick == ts(5), "{c:?}");
    assert_eq!(c.filling, BTreeSet::from([pick]), "the newcomer copies the row");
    // Just short of `dead_after`: alive.
    w.silent.insert(ts(1), DEAD_AFTER - Duration::from_millis(1));
    assert!(!w.plan().commits());
}

#[test]
fn a_member_that_never_heartbeated_dies_after_the_servers_own_silence() {
    let mut w = World::new(table(5, &[&[1, 2, 3], &[2, 3, 4], &[3, 4, 5]]));
    w.members.remove(&ts(1));
    w.silent.remove(&ts(1));
    let p = w.plan();
    assert_eq!(p.dead, set(&[1]), "silent since the table was served (60 s)");
}

#[test]
fn a_fenced_server_that_returns_is_settled() {
    // Member 1 was declared dead and replaced by 4 in row 0; it is
    // heard from again, still reporting row 0 at the old version.
    let mut w = World::new(table(4, &[&[4, 2, 3], &[2, 3, 4]]));
    back_from_row_0(&mut w, DEAD_AFTER / 2 - Duration::from_millis(1));
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert_eq!(p.returned, ids(&[1]));
    assert!(p.stale.is_empty(), "returned, not also stale: {p:?}");
    assert!(p.dead.is_empty());
    assert!(p.changes.is_empty());
    assert!(p.commits(), "it is given its assignment in a new round");
    // Heard from, but not recently enough: still dead.
    w.silent.insert(ts(1), DEAD_AFTER / 2);
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert!(p.returned.is_empty() && p.dead.contains(&ts(1)));
}

/// The world of `a_fenced_server_that_returns_is_settled`, with member 4
/// still copying row 0 when member 1 comes back.
fn returned_while_its_replacement_copies() -> World {
    let mut w = World::new(table(5, &[&[4, 2, 3], &[2, 3, 4], &[5, 2, 3]]));
    w.filling.insert(0, set(&[4]));
    w.register(ts(4));
    back_from_row_0(&mut w, Duration::ZERO);
    w
}

/// Member 1, declared dead, is heard from again (silent for `silent`),
/// still reporting row 0 at version 4 with members 1, 2, 3.
fn back_from_row_0(w: &mut World, silent: Duration) {
    w.register(ts(1));
    let old = Assignment {
        rows: vec![AssignedRow {
            row: 0,
            version: 4,
            members: ids(&[1, 2, 3]),
            filling: vec![],
            pending: vec![],
        }],
        ..assignment_for(&w.tlt, &w.filling, ts(1))
    };
    w.member(1).reported = Some(old);
    w.dead.insert(ts(1));
    w.silent.insert(ts(1), silent);
}

#[test]
fn a_member_back_in_time_takes_its_column_back_to_repair_it() {
    let w = returned_while_its_replacement_copies();
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert_eq!(p.returned, ids(&[1]));
    assert_eq!(p.readmitted, vec![(0, ts(1))]);
    assert_eq!(
        p.changes,
        vec![RowChange { row: 0, members: ids(&[1, 2, 3]), filling: set(&[1]), pending: vec![], bump: true }],
        "its old column, filling, under a new version; the newcomer leaves"
    );
    assert_eq!(p.summary(&w.tlt)[4].0, 1, "{:?}", p.summary(&w.tlt));
    assert_eq!(p.summary(&w.tlt)[0].0, 0, "not counted as re-replication");

    // The newcomer finished: the row stays with it.
    let mut w = returned_while_its_replacement_copies();
    w.filling.clear();
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert!(p.readmitted.is_empty() && p.changes.is_empty(), "{p:?}");

    // Another member of the row now shares its failure domain.
    let mut w = returned_while_its_replacement_copies();
    w.member(1).domain = "d2".into();
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert!(p.readmitted.is_empty() && p.changes.is_empty(), "{p:?}");

    // It held the row at the current version: nothing it missed.
    let mut w = returned_while_its_replacement_copies();
    if let Some(a) = w.member(1).reported.as_mut() {
        a.rows[0].version = 5;
    }
    assert!(w.plan_with(&Rules { grow: false, ..rules() }).readmitted.is_empty());
}

#[test]
fn a_member_back_in_time_returns_to_a_row_that_lost_another() {
    // Row 0 took 4 for 1, then lost 3: 1 comes back to its column, and
    // 3's goes to a newcomer, both in one change.
    let mut w = returned_while_its_replacement_copies();
    w.silent.insert(ts(3), DEAD_AFTER);
    let p = w.plan_with(&Rules { grow: false, ..rules() });
    assert_eq!(p.readmitted, vec![(0, ts(1))]);
    let c = p.changes.iter().find(|c| c.row == 0).expect("row 0 changes");
    assert_eq!(&c.members[..2], &ids(&[1, 2])[..]);
    assert!(c.members[2] == ts(4) || c.members[2] == ts(5), "{c:?}");
    assert!(c.filling.contains(&ts(1)) && c.filling.contains(&c.members[2]));
    assert!(c.bump);
}

/// blob-sim seed 60175: a member came back to a row whose other members
/// were dead or still copying. Nobody is left to repair it from, so the
/// row stays stuck as it was and nobody is counted as readmitted (the
/// round's summary once subtracted readmissions that made no change).
#[test]
fn a_member_back_in_time_does_not_return_to_a_stuck_row() {
    let mut w = returned_while_its_replacement_copies();
    w.silent.insert(ts(2), DEAD_AFTER);
    w.silent.insert(ts(3), DEAD_AFTER);
    for rules in [Rules { grow: false, ..rules() }, Rules { grow: false, recovery: false, ..rules() }] {
        let p = w.plan_with(&rules);
        assert!(p.readmitted.is_empty(), "{p:?}");
        assert!(!p.changes.iter().any(|c| c.row == 0), "{p:?}");
        let _ = p.summary(&w.tlt);
    }
}

#[test]
fn a_stale_assignment_is_settled() {
    let mut w = World::new(table(4, &[&[1, 2, 3], &[2, 3, 4]]));
    if let Some(a) = w.member(2).reported.as_mut() {
        a.rows[0].version = 4;
    }
    assert_eq!(w.plan().stale, ids(&[2]), "a row at an older version");
    // A row the table no longer gives it, at the current version.
    let mut w = World::new(table(4, &[&[1, 2, 3], &[2, 3, 4]]));
    if let Some(a) = w.member(1).reported.as_mut() {
        a.rows.push(AssignedRow {
            row: 1,
            version: 5,
            members: ids(&[2, 3, 4]),
            filling: vec![],
            pending: vec![],
        });
    }
    assert_eq!(w.plan().stale, ids(&[1]), "a row it no longer holds");
}

#[test]
fn an_assignment_lacking_rows_is_settled() {
    let mut w = World::new(table(4, &[&[1, 2, 3], &[2, 3, 4]]));
    if let Some(a) = w.member(3).reported.as_mut() {
        a.rows.clear();
    }
    w.member(4).reported = None;
    assert_eq!(w.plan().stale, ids(&[3, 4]), "a row missing, or no assignment stored at all");
}

#[test]
fn an_assignment_ahead_of_the_table_raises_the_floors() {
    let mut w = World::new(table(4, &[&[1, 2, 3], &[2, 3, 4]]));
    if let Some(a) = w.member(2).reported.as_mut() {
        a.tlt_version = 20;
        a.rows[0].version = 9;
    }
    let p = w.plan();
    assert_eq!(p.stale, ids(&[2]));
    assert_eq!(p.tlt_floor, 20);
    assert_eq!(p.row_floors.get(&0), Some(&9), "no new version of row 0 may be 9 or below");
}

#[test]
fn a_filled_row_is_cleared_without_a_new_version() {
    // (Member 1 holds no position: growth would give it one.)
    let no_growth = Rules { grow: false, ..rules() };
    let mut w = World::new(table(4, &[&[4, 2, 3], &[2, 3, 4]]));
    w.filling.insert(0, set(&[4]));
    w.register(ts(4)); // its assignment has it filling row 0
    w.member(4).filled = vec![RowRef { row: 0, version: 5 }];
    let p = w.plan_with(&no_growth);
    assert_eq!(
        p.changes,
        vec![RowChange { row: 0, members: ids(&[4, 2, 3]), filling: set(&[]), pending: vec![], bump: false }]
    );
    // Finished an older version of the row: not done.
    w.member(4).filled = vec![RowRef { row: 0, version: 4 }];
    assert!(w.plan_with(&no_growth).changes.is_empty());
    // Its stored assignment no longer has it filling (a clearing
    // round that reached it but failed elsewhere): done.
    w.member(4).filled.clear();
    if let Some(a) = w.member(4).reported.as_mut() {
        a.rows[0].filling.clear();
    }
    assert_eq!(w.plan_with(&no_growth).changes.len(), 1);
}

#[test]
fn a_pending_member_that_copied_the_row_takes_its_column() {
    let mut t = table(5, &[&[1, 2, 3], &[2, 3, 4]]);
    t.rows[0].pending = vec![Pending { column: 0, member: 4 }];
    let mut w = World::new(t);
    w.filling.insert(0, set(&[5]));
    w.register(ts(5));
    w.member(5).filled = vec![RowRef { row: 0, version: 5 }];
    let p = w.plan();
    assert_eq!(
        p.changes,
        vec![RowChange { row: 0, members: ids(&[5, 2, 3]), filling: set(&[]), pending: vec![], bump: true }]
    );
    assert_eq!(p.summary(&w.tlt)[3].0, 1, "counted as a pending member committed");
}

#[test]
fn a_dead_members_column_goes_to_its_pending_member() {
    let mut t = table(5, &[&[1, 2, 3], &[2, 3, 4]]);
    t.rows[0].pending = vec![Pending { column: 0, member: 4 }];
    let mut w = World::new(t);
    w.filling.insert(0, set(&[5]));
    w.silent.insert(ts(1), DEAD_AFTER * 2);
    let p = w.plan();
    assert_eq!(
        p.changes,
        vec![RowChange { row: 0, members: ids(&[5, 2, 3]), filling: set(&[5]), pending: vec![], bump: true }],
        "it takes the column still filling, rather than a newcomer starting from nothing"
    );
}

#[test]
fn a_newcomer_comes_from_another_failure_domain_and_is_least_loaded() {
    // Member 4 shares member 2's failure domain: never in row 0.
    let mut w = World::new(table(6, &[&[1, 2, 3], &[2, 3, 5], &[3, 5, 6], &[5, 6, 2]]));
    w.member(4).domain = "d2".into();
    w.silent.insert(ts(1), DEAD_AFTER);
    for seed in 0..20 {
        let view = View {
            tlt: &w.tlt,
            members: &w.members,
            filling: &w.filling,
            dead: &w.dead,
            silent: &w.silent,
            silence: Duration::ZERO,
        };
        let p = plan(&view, &rules(), &mut rand::rngs::SmallRng::seed_from_u64(seed));
        // 5 and 6 are outside the row's domains; 6 holds fewer rows
        // and sources no copy (5 neither, but holds 3 rows).
        assert_eq!(p.changes[0].members, ids(&[6, 2, 3]), "seed {seed}: {p:?}");
    }
}

#[test]
fn a_row_with_no_complete_live_member_is_stuck() {
    let mut w = World::new(table(5, &[&[1, 2, 3], &[2, 3, 4]]));
    w.filling.insert(0, set(&[3]));
    w.silent.insert(ts(1), DEAD_AFTER);
    w.silent.insert(ts(2), DEAD_AFTER);
    let p = w.plan();
    assert_eq!(p.stuck, 1, "row 0's only live member is still copying: {p:?}");
    assert!(p.changes.iter().all(|c| c.row != 0));
    // Row 1 (2 dead, 3 and 4 complete) is re-replicated from them.
    assert!(p.changes.iter().any(|c| c.row == 1));
}

#[test]
fn a_row_with_no_candidate_is_stuck() {
    let mut w = World::new(table(3, &[&[1, 2, 3]]));
    w.silent.insert(ts(3), DEAD_AFTER);
    let p = w.plan();
    assert_eq!((p.stuck, p.changes.len()), (1, 0), "{p:?}");
}

#[test]
fn recovery_off_leaves_dead_members_rows_and_does_not_grow() {
    let mut w = World::new(table(4, &[&[1, 2, 3], &[1, 2, 3]]));
    w.silent.insert(ts(1), DEAD_AFTER);
    let p = w.plan_with(&Rules { recovery: false, ..rules() });
    assert_eq!(p.dead, set(&[1]));
    assert_eq!((p.stuck, p.changes.len()), (0, 0), "no replacement, and no growth while degraded: {p:?}");
}

#[test]
fn a_member_holding_no_position_grows_into_the_table() {
    let mut w = World::new(table(3, &[&[1, 2, 3], &[2, 3, 1], &[3, 1, 2], &[1, 3, 2]]));
    w.register(ts(4));
    let p = w.plan();
    assert!(!p.changes.is_empty(), "{p:?}");
    for c in &p.changes {
        assert!(c.bump);
        assert!(c.pending.iter().any(|(_, id)| *id == ts(4)), "{c:?}");
        assert!(c.filling.contains(&ts(4)), "a pending member copies the row");
    }
    assert_eq!(p.summary(&w.tlt)[2].0, p.changes.len(), "counted as growth");
    // Not with growth off.
    assert!(w.plan_with(&Rules { grow: false, ..rules() }).changes.is_empty());
}

/// A hybrid table (design 0009): members 1–2 ssd, 3–7 hdd; row 0 is the
/// `any` section, row 1 the `hybrid` one (ssd primary, hdd backups).
fn hybrid_world() -> World {
    use blizzard_core::{DiskClass, Placement, TltSection};
    let mut t = table(7, &[&[3, 4, 5], &[1, 3, 4]]);
    t.sections = vec![
        TltSection { placement: Placement::Any, start: 0, len: 1 },
        TltSection { placement: Placement::Hybrid, start: 1, len: 1 },
    ];
    let mut w = World::new(t);
    for id in 3..=7 {
        w.member(id).class = DiskClass::Hdd;
    }
    w
}

#[test]
fn a_dead_member_of_a_hybrid_row_is_replaced_by_a_disk_of_its_columns_class() {
    // The ssd primary dies: only the other ssd may lead the row, though
    // three hdd are idle and less loaded.
    let mut w = hybrid_world();
    w.silent.insert(ts(1), DEAD_AFTER);
    let p = w.plan();
    let c = p.changes.iter().find(|c| c.row == 1).expect("row 1 changes");
    assert_eq!(c.members, ids(&[2, 3, 4]), "{c:?}");
    // A backup dies: an hdd takes it, never the idle ssd 2.
    let mut w = hybrid_world();
    w.silent.insert(ts(4), DEAD_AFTER);
    for seed_run in 0..10 {
        let p = w.plan();
        let c = p.changes.iter().find(|c| c.row == 1).expect("row 1 changes");
        assert!([ts(5), ts(6), ts(7)].contains(&c.members[2]), "run {seed_run}: {c:?}");
    }
    // No ssd left alive to lead: the row is stuck, not given an hdd
    // primary.
    let mut w = hybrid_world();
    w.silent.insert(ts(1), DEAD_AFTER);
    w.silent.insert(ts(2), DEAD_AFTER);
    let p = w.plan();
    assert!(p.changes.iter().all(|c| c.row != 1), "{p:?}");
    assert!(p.stuck >= 1);
}

#[test]
fn check_classes_refuses_a_change_that_breaks_a_sections_classes() {
    let w = hybrid_world();
    let class = |id: TsId| w.members.get(&id).map(|m| m.class);
    let mut next = w.tlt.clone();
    next.rows[1].members = vec![1, 4, 3]; // ssd 2 leads, hdd 5 and 4 back
    assert_eq!(check_classes(&w.tlt, &next, &class), Ok(()));
    next.rows[1].members = vec![4, 2, 3]; // hdd 5 would lead
    assert!(check_classes(&w.tlt, &next, &class).is_err());
    next.rows[1].members = vec![0, 1, 3]; // ssd 2 as a backup
    assert!(check_classes(&w.tlt, &next, &class).is_err());
    // The any section takes every class.
    let mut next = w.tlt.clone();
    next.rows[0].members = vec![0, 3, 4];
    assert_eq!(check_classes(&w.tlt, &next, &class), Ok(()));
    // Sections never change.
    let mut next = w.tlt.clone();
    next.version += 1;
    next.sections.clear();
    assert!(check_change(&w.tlt, &next, &HashMap::new(), 0).is_err());
}
