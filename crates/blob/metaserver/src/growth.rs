//! Cluster growth (FDS §3.4): which TLT entries a new tractserver takes.
//!
//! A tractserver that holds no position (new, or back from the dead with
//! nothing) takes entries from the most loaded members until it holds its
//! share: `rows × replication / members` positions, of which `rows /
//! members` are primaries (column 0, which also serves blob metadata). Each
//! entry it takes becomes *pending* (`TltRow::pending`): clients write to
//! both the column's member and the newcomer, the newcomer copies the row,
//! and the metadata server then commits it in the column's place
//! (`MetaServer::recover`).
//!
//! Among equally loaded donors it prefers rows whose other members it
//! shares fewest rows with, so that when it fails, as many disks as
//! possible hold its replicas and re-replicate it in parallel (§3.3).
//! No row gets two members of one failure domain, and a row has at most
//! one pending entry at a time.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use rand::seq::IndexedRandom;
use rand::Rng;

use std::ops::Range;

use blizzard_core::tlt::Tlt;
use blizzard_core::{DiskClass, Placement, TsId};

/// One entry to move: `newcomer` becomes pending for `column` of `row`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub row: usize,
    pub column: u8,
    pub newcomer: TsId,
}

/// Plans the entries `newcomers` take from the members of `t`. A row that
/// already has a pending entry is left alone; entries already pending count
/// as belonging to their newcomer. `domain` names each server's failure
/// domain, `class` its disk's class (`None`: unknown, which fits only
/// columns that take any class).
///
/// Each section of the table (`blizzard_core::tlt`, one per placement)
/// grows on its own: a newcomer takes only columns its class may hold
/// there, and its share is counted among the members that may hold the
/// same columns (in a `hybrid` section a fast disk takes primaries from
/// the other fast disks, a slow one backups from the other slow ones).
pub fn plan(
    t: &Tlt,
    newcomers: &[TsId],
    domain: &dyn Fn(TsId) -> String,
    class: &dyn Fn(TsId) -> Option<DiskClass>,
    rng: &mut impl Rng,
) -> Vec<Move> {
    let mut moves = Vec::new();
    let total = t.rows.len();
    let sections: Vec<(Placement, Range<usize>)> = if t.sections.is_empty() {
        vec![(Placement::Any, 0..total)]
    } else {
        t.sections.iter().map(|s| (s.placement, s.rows())).collect()
    };
    for (placement, rows) in sections {
        let fits = |id: TsId, c: usize| placement.column_class(c).is_none_or(|want| class(id) == Some(want));
        plan_section(t, rows, newcomers, domain, &fits, rng, &mut moves);
    }
    moves
}

/// Growth inside the rows `range` of `t`, where `fits(server, column)`
/// says whether a server may hold a column.
fn plan_section(
    t: &Tlt,
    range: Range<usize>,
    newcomers: &[TsId],
    domain: &dyn Fn(TsId) -> String,
    fits: &dyn Fn(TsId, usize) -> bool,
    rng: &mut impl Rng,
    moves: &mut Vec<Move>,
) {
    let k = t.replication as usize;
    let rows = range.len();
    // The owner of every position once pending entries commit.
    let mut owner: Vec<Vec<TsId>> = t.rows[range.clone()]
        .iter()
        .map(|r| {
            (0..k)
                .map(|c| {
                    let m =
                        r.pending.iter().find(|p| p.column as usize == c).map_or(r.members[c], |p| p.member);
                    t.members[m as usize].id
                })
                .collect()
        })
        .collect();
    let mut busy: Vec<bool> = t.rows[range.clone()].iter().map(|r| !r.pending.is_empty()).collect();
    let mut load: BTreeMap<TsId, usize> = BTreeMap::new();
    let mut prim: BTreeMap<TsId, usize> = BTreeMap::new();
    for o in &owner {
        for (c, id) in o.iter().enumerate() {
            *load.entry(*id).or_default() += 1;
            if c == 0 {
                *prim.entry(*id).or_default() += 1;
            }
        }
    }
    let newcomers: Vec<TsId> = newcomers
        .iter()
        .copied()
        .filter(|id| !load.contains_key(id) && (0..k).any(|c| fits(*id, c)))
        .collect();
    if rows == 0 || newcomers.is_empty() {
        return;
    }
    let held: Vec<TsId> = load.keys().copied().collect();
    for &me in &newcomers {
        // The members that may hold the same columns as `me`, itself and
        // the newcomers after it included: its share is theirs divided.
        let same = |id: &TsId| (0..k).all(|c| fits(*id, c) == fits(me, c));
        let group =
            held.iter().filter(|id| same(id)).count() + newcomers.iter().filter(|id| same(id)).count();
        let columns: Vec<usize> = (0..k).filter(|c| fits(me, *c)).collect();
        let want_total = rows * columns.len() / group.max(1);
        let want_prim = if fits(me, 0) { rows / group.max(1) } else { 0 };
        let mine = domain(me);
        // Rows shared with each other server so far.
        let mut partners: HashMap<TsId, usize> = HashMap::new();
        load.insert(me, 0);
        prim.insert(me, 0);
        for primaries in [true, false] {
            loop {
                let (have, want) = if primaries { (prim[&me], want_prim) } else { (load[&me], want_total) };
                if have >= want {
                    break;
                }
                // Every (row, column) it could take, scored: the donor's
                // load first (most loaded gives), then how few rows it
                // already shares with the row's other members.
                let mut best: Option<(usize, usize, usize)> = None;
                let mut cands: Vec<(usize, usize)> = Vec::new();
                for (r, o) in owner.iter().enumerate() {
                    if busy[r] || o.contains(&me) {
                        continue;
                    }
                    let cols = if primaries { 0..1 } else { 1.min(k)..k };
                    for c in cols.filter(|c| fits(me, *c)) {
                        let others = || o.iter().enumerate().filter(move |(j, _)| *j != c).map(|(_, id)| *id);
                        if others().any(|id| domain(id) == mine) {
                            continue;
                        }
                        let donor = o[c];
                        let donor_load = if primaries { prim[&donor] } else { load[&donor] };
                        // Taking from a server no more loaded than the
                        // newcomer would only move the imbalance.
                        if donor_load <= have + 1 {
                            continue;
                        }
                        // Nor from one already at its share: a donor with
                        // many primaries but few positions would otherwise
                        // give primaries and then positions, ending below
                        // its share (two newcomers joining 8: 6 of 8).
                        if load[&donor] <= want_total {
                            continue;
                        }
                        let shared: usize = others().map(|id| partners.get(&id).copied().unwrap_or(0)).sum();
                        let score = (donor_load, usize::MAX - shared, load[&donor]);
                        match best {
                            Some(b) if score < b => {}
                            Some(b) if score == b => cands.push((r, c)),
                            _ => {
                                best = Some(score);
                                cands = vec![(r, c)];
                            }
                        }
                    }
                }
                let Some(&(r, c)) = cands.choose(rng) else { break };
                let donor = owner[r][c];
                for id in owner[r].iter().filter(|id| **id != donor) {
                    *partners.entry(*id).or_default() += 1;
                }
                owner[r][c] = me;
                busy[r] = true;
                let counts: &mut [&mut BTreeMap<TsId, usize>] =
                    if c == 0 { &mut [&mut load, &mut prim] } else { &mut [&mut load] };
                for m in counts.iter_mut() {
                    *m.entry(donor).or_default() -= 1;
                    *m.entry(me).or_default() += 1;
                }
                moves.push(Move { row: range.start + r, column: c as u8, newcomer: me });
            }
        }
    }
}

/// The servers of `t` that hold no position at all (neither member nor
/// pending), among `live`.
pub fn spares(t: &Tlt, live: &[TsId]) -> Vec<TsId> {
    let held: BTreeSet<TsId> = t
        .rows
        .iter()
        .flat_map(|r| r.members.iter().copied().chain(r.pending.iter().map(|p| p.member)))
        .map(|m| t.members[m as usize].id)
        .collect();
    live.iter().copied().filter(|id| !held.contains(id)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tlt_builder::{build_rows, BuildParams, BuilderMember};
    use blizzard_core::tlt::{Pending, TltMember, TltRow};
    use blizzard_core::DiskClass;
    use rand::SeedableRng;

    fn table(n: usize, k: u8, seed: u64) -> Tlt {
        let members: Vec<BuilderMember> = (1..=n as u128)
            .map(|i| BuilderMember {
                id: TsId(i),
                domain: format!("d{i}"),
                weight: 100,
                class: DiskClass::Ssd,
            })
            .collect();
        let params = BuildParams { replication: k, permutations: 20, weighted: false };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let rows = build_rows(&members, &params, &mut rng).expect("table");
        Tlt {
            cluster_id: 1,
            tract_size: 4096,
            replication: k,
            version: 1,
            members: members
                .iter()
                .map(|m| TltMember { id: m.id, addr: String::new(), domain: m.domain.clone() })
                .collect(),
            rows: rows.into_iter().map(|m| TltRow::new(1, m)).collect(),
            sections: Vec::new(),
        }
    }

    /// Applies moves as committed entries (the newcomers join the table).
    fn commit(t: &mut Tlt, moves: &[Move]) {
        for mv in moves {
            let i = match t.member_index(mv.newcomer) {
                Some(i) => i,
                None => {
                    t.members.push(TltMember {
                        id: mv.newcomer,
                        addr: String::new(),
                        domain: format!("d{}", mv.newcomer.0),
                    });
                    (t.members.len() - 1) as u32
                }
            };
            t.rows[mv.row].members[mv.column as usize] = i;
        }
    }

    fn loads(t: &Tlt) -> (BTreeMap<TsId, usize>, BTreeMap<TsId, usize>) {
        let (mut load, mut prim) = (BTreeMap::new(), BTreeMap::new());
        for r in &t.rows {
            for (c, &m) in r.members.iter().enumerate() {
                *load.entry(t.members[m as usize].id).or_default() += 1;
                if c == 0 {
                    *prim.entry(t.members[m as usize].id).or_default() += 1;
                }
            }
        }
        (load, prim)
    }

    fn dom(id: TsId) -> String {
        format!("d{}", id.0)
    }

    /// A table over 3 ssd and 6 hdd, with its sections (design 0009).
    fn mixed_table(seed: u64) -> (Tlt, BTreeMap<TsId, DiskClass>) {
        let members: Vec<BuilderMember> = (1..=9u128)
            .map(|i| BuilderMember {
                id: TsId(i),
                domain: format!("d{i}"),
                weight: 100,
                class: if i <= 3 { DiskClass::Ssd } else { DiskClass::Hdd },
            })
            .collect();
        let params = BuildParams { replication: 3, permutations: 20, weighted: false };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let layout = crate::tlt_builder::build_layout(&members, &params, &mut rng).expect("table");
        assert!(layout.skipped.is_empty(), "{:?}", layout.skipped);
        let t = Tlt {
            cluster_id: 1,
            tract_size: 4096,
            replication: 3,
            version: 1,
            members: members
                .iter()
                .map(|m| TltMember { id: m.id, addr: String::new(), domain: m.domain.clone() })
                .collect(),
            rows: layout.rows.into_iter().map(|m| TltRow::new(1, m)).collect(),
            sections: layout.sections,
        };
        (t, members.iter().map(|m| (m.id, m.class)).collect())
    }

    /// Newcomers of each class grow each section only in the columns their
    /// class may hold: the ssd one leads hybrid rows, the hdd one backs
    /// them, both join the `any` rows.
    #[test]
    fn newcomers_grow_each_section_with_their_class() {
        for seed in 0..5 {
            let (mut t, mut classes) = mixed_table(seed);
            classes.insert(TsId(100), DiskClass::Ssd);
            classes.insert(TsId(101), DiskClass::Hdd);
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let class = |id: TsId| classes.get(&id).copied();
            let moves = plan(&t, &[TsId(100), TsId(101)], &dom, &class, &mut rng);
            commit(&mut t, &moves);
            t.validate().expect("valid");
            let mut took: BTreeMap<(TsId, Placement), usize> = BTreeMap::new();
            for (r, row) in t.rows.iter().enumerate() {
                for (c, &m) in row.members.iter().enumerate() {
                    let id = t.members[m as usize].id;
                    if let Some(want) = t.column_class(r, c) {
                        assert_eq!(classes[&id], want, "seed {seed}: row {r} column {c}");
                    }
                    if id.0 >= 100 {
                        *took.entry((id, t.row_placement(r))).or_default() += 1;
                    }
                }
            }
            for p in [Placement::Any, Placement::Hybrid] {
                assert!(took.get(&(TsId(100), p)).is_some_and(|n| *n > 0), "seed {seed}: {took:?}");
                assert!(took.get(&(TsId(101), p)).is_some_and(|n| *n > 0), "seed {seed}: {took:?}");
            }
            assert!(took.get(&(TsId(100), Placement::Ssd)).is_some_and(|n| *n > 0), "seed {seed}: {took:?}");
            assert!(!took.contains_key(&(TsId(100), Placement::Hdd)), "seed {seed}: {took:?}");
            assert!(!took.contains_key(&(TsId(101), Placement::Ssd)), "seed {seed}: {took:?}");
            // In hybrid rows the ssd newcomer leads: its share of the
            // primaries of the four fast disks.
            let hybrid = t.sections.iter().find(|s| s.placement == Placement::Hybrid).expect("hybrid").rows();
            let led =
                hybrid.clone().filter(|r| t.members[t.rows[*r].members[0] as usize].id == TsId(100)).count();
            assert_eq!(led, hybrid.len() / 4, "seed {seed}");
        }
    }

    /// Two newcomers joining 8 (3-way) and 4 (1-way) members end with their
    /// share of positions and primaries, and nobody is left far above it.
    #[test]
    fn newcomers_take_their_share() {
        for (n, k) in [(8usize, 3u8), (8, 2), (4, 1), (16, 3)] {
            for seed in 0..5 {
                let mut t = table(n, k, seed);
                let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
                let new = [TsId(100), TsId(101)];
                let moves = plan(&t, &new, &dom, &|_| None, &mut rng);
                commit(&mut t, &moves);
                t.validate().expect("valid");
                let (load, prim) = loads(&t);
                let total = t.rows.len() * k as usize;
                let fair = total as f64 / (n + 2) as f64;
                for id in new {
                    assert_eq!(load[&id], total / (n + 2), "n={n} k={k} seed={seed}: {load:?}");
                    assert_eq!(prim[&id], t.rows.len() / (n + 2));
                }
                let max = *load.values().max().unwrap_or(&0) as f64;
                assert!(max <= fair * 1.15 + 1.0, "n={n} k={k} seed={seed}: max {max}, fair {fair:.1}");
                // Failure domains hold: every row's members are distinct domains.
                for r in &t.rows {
                    let d: BTreeSet<String> =
                        r.members.iter().map(|&m| t.members[m as usize].domain.clone()).collect();
                    assert_eq!(d.len(), k as usize);
                }
            }
        }
    }

    /// A 3-way newcomer shares rows with nearly every other member, so its
    /// own failure is re-replicated from many disks at once.
    #[test]
    fn newcomer_pairs_widely() {
        let mut t = table(8, 3, 7);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let moves = plan(&t, &[TsId(100)], &dom, &|_| None, &mut rng);
        commit(&mut t, &moves);
        let me = t.member_index(TsId(100)).expect("joined");
        let partners: BTreeSet<u32> = t
            .rows
            .iter()
            .filter(|r| r.members.contains(&me))
            .flat_map(|r| r.members.iter().copied())
            .filter(|m| *m != me)
            .collect();
        assert!(partners.len() >= 7, "pairs with {} of 8", partners.len());
    }

    /// Rows with a pending entry are not touched again, pending entries
    /// count for their newcomer, and a member sharing a domain with the row
    /// is never chosen.
    #[test]
    fn respects_pending_and_domains() {
        let mut t = table(6, 3, 3);
        t.members.push(TltMember { id: TsId(100), addr: String::new(), domain: "d1".into() });
        t.rows[0].pending = vec![Pending { column: 1, member: 6 }];
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        // TsId(100) already holds a pending entry: it is no spare.
        assert!(plan(
            &t,
            &[TsId(100)],
            &|id| if id == TsId(100) { "d1".into() } else { dom(id) },
            &|_| None,
            &mut rng
        )
        .is_empty());
        let same_domain = |id: TsId| if id == TsId(200) { "d1".to_string() } else { dom(id) };
        let moves = plan(&t, &[TsId(200)], &same_domain, &|_| None, &mut rng);
        assert!(!moves.is_empty());
        for mv in &moves {
            assert_ne!(mv.row, 0, "row 0 already has a pending entry");
            let row = &t.rows[mv.row];
            let others: Vec<String> = row
                .members
                .iter()
                .enumerate()
                .filter(|(c, _)| *c != mv.column as usize)
                .map(|(_, &m)| t.members[m as usize].domain.clone())
                .collect();
            assert!(!others.contains(&"d1".to_string()), "row {} already has domain d1", mv.row);
        }
        assert_eq!(spares(&t, &[TsId(1), TsId(100), TsId(200)]), vec![TsId(200)]);
    }

    /// Newcomers planned one after another, the first one's entries still
    /// pending, never take a member below its share (or below what it had,
    /// if the table gave it less): the planner once drained a member rich
    /// in primaries to 6 positions of a fair 8.
    #[test]
    fn donors_keep_their_share() {
        for seed in 0..200 {
            let mut t = table(8, 3, seed);
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
            let (before, _) = loads(&t);
            for nc in [TsId(100), TsId(101)] {
                let moves = plan(&t, &[nc], &dom, &|_| None, &mut rng);
                assert!(!moves.is_empty(), "seed {seed}: {nc} got nothing");
                t.members.push(TltMember { id: nc, addr: String::new(), domain: dom(nc) });
                let i = (t.members.len() - 1) as u32;
                for mv in moves {
                    t.rows[mv.row].pending.push(Pending { column: mv.column, member: i });
                }
            }
            let fair = t.rows.len() * 3 / 10;
            let mut after: BTreeMap<TsId, usize> = BTreeMap::new();
            for r in &t.rows {
                for c in 0..3 {
                    let m =
                        r.pending.iter().find(|p| p.column as usize == c).map_or(r.members[c], |p| p.member);
                    *after.entry(t.members[m as usize].id).or_default() += 1;
                }
            }
            for (id, n) in &before {
                assert!(
                    after[id] >= fair.min(*n),
                    "seed {seed}: {id} went {n} -> {}, fair {fair}",
                    after[id]
                );
            }
        }
    }
}
