//! Failure handling as a pure function (FDS §3.2–§3.4): from a snapshot of
//! what the metadata server knows ([`View`]), what one recovery round must
//! change ([`Plan`]). No I/O, no clock, no locks: the server's async shell
//! (`server::MetaServer::recover`) takes the view, applies the plan's
//! member states, commits its row changes with one assignment round and
//! logs; tests drive every case below directly.
//!
//! | case | what the view shows | what the plan does |
//! |---|---|---|
//! | death | a member silent for `dead_after` | declares it dead ([`Plan::died`]); its rows are re-replicated below |
//! | return of a fenced server | a member declared dead heard from within `dead_after / 2` | no longer dead; settled ([`Plan::returned`]): its heartbeats keep it from serving until it stores its current assignment |
//! | stale assignment | a member reporting rows at older versions than the table's, rows it no longer holds, or lacking rows the table gives it | settled ([`Plan::stale`]) |
//! | assignment ahead | a member reporting a version above the table's (a round a predecessor never served) | version floors raised above it ([`Plan::row_floors`], [`Plan::tlt_floor`]); settled |
//! | filling done | a filling member reports the row's current version copied | the row's filling mark cleared, no new version |
//! | pending takeover | a pending member (growth) reports the row copied | it takes its column: a new row version |
//! | dead member, pending in its column | the column's pending member has been taking every write | it takes the column, still filling |
//! | dead member replaced | a row names a dead member and has a complete live one | a live member takes the column (least copying, then fewest rows, never two per failure domain, not one busy growing), filling: a new row version |
//! | stuck row | no complete member alive, or no live candidate outside the row's failure domains | left as is and counted ([`Plan::stuck`]): replacing it would lose data |
//! | recovery off | rows name dead members | left as is (like Ceph's `noout`) |
//! | growth | no row names a dead member and nothing else changes | live members holding no position join rows as pending members (`growth::plan`) |
//!
//! Settling happens in the same assignment round as the row changes: a
//! settled member is pushed its assignment under the new table, whose
//! version outranks any push of an older round still in flight.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use rand::seq::IndexedRandom;
use rand::Rng;

use blizzard_core::tlt::{Tlt, TltRow};
use blizzard_core::TsId;
use blizzard_env::Instant;
use blizzard_proto::{AssignedRow, Assignment, FillProgress, PendingMember, RowRef};

/// What the metadata server knows of a registered tractserver (from its
/// heartbeats).
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub addr: String,
    pub domain: String,
    pub last_heartbeat: Instant,
    pub slots_total: u64,
    pub slots_used: u64,
    pub load: u32,
    pub disk_mbps: u32,
    /// The assignment it stores, as it reported it or as it was last
    /// pushed to it.
    pub reported: Option<Assignment>,
    /// Rows the member says it has finished copying, and its progress.
    pub filled: Vec<RowRef>,
    pub fill: FillProgress,
}

/// Members still copying, per row.
pub(crate) type Filling = BTreeMap<usize, BTreeSet<TsId>>;

/// A row's new membership in one TLT change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowChange {
    pub row: usize,
    pub members: Vec<TsId>,
    pub filling: BTreeSet<TsId>,
    /// Pending entries (column, newcomer), cluster growth (FDS §3.4).
    pub pending: Vec<(u8, TsId)>,
    /// Membership changed: the row gets a new version. Only the filling
    /// set changing (a newcomer finished copying) needs none: clients
    /// write to every member alike either way.
    pub bump: bool,
}

/// Whether a member's stored assignment `a` lets it serve what the table
/// `t` no longer gives it: a row at an older version than the table's, or
/// a row the table no longer has it in. (A newer version is a change being
/// pushed, not yet served: fine.)
pub(crate) fn assignment_is_stale(t: &Tlt, id: TsId, a: &Assignment) -> bool {
    if a.cluster_id != t.cluster_id {
        return false;
    }
    let me = t.member_index(id);
    a.rows.iter().any(|r| match t.rows.get(r.row as usize) {
        Some(cur) => {
            r.version < cur.version || (r.version == cur.version && !me.is_some_and(|i| holds(cur, i)))
        }
        None => true,
    })
}

/// Whether a member's stored assignment `a` lacks a row the table `t`
/// gives it. A metadata server rebuilt after a restart takes each row from
/// its newest report, which can be a change whose round failed part-way:
/// a member it names may never have stored it (and then holds an
/// assignment without the row), so it must be given its assignment.
pub(crate) fn assignment_lacks_rows(t: &Tlt, id: TsId, a: &Assignment) -> bool {
    let Some(me) = t.member_index(id) else { return false };
    a.cluster_id == t.cluster_id
        && t.rows.iter().enumerate().any(|(i, r)| holds(r, me) && !a.rows.iter().any(|x| x.row as usize == i))
}

/// What tractserver `id` stores under table `tlt`: its rows, with their
/// members, filling and pending members.
pub(crate) fn assignment_for(tlt: &Tlt, filling: &Filling, id: TsId) -> Assignment {
    let me = tlt.member_index(id);
    Assignment {
        cluster_id: tlt.cluster_id,
        tract_size: tlt.tract_size,
        replication: tlt.replication,
        tlt_len: tlt.rows.len() as u32,
        tlt_version: tlt.version,
        rows: tlt
            .rows
            .iter()
            .enumerate()
            .filter(|(_, r)| me.is_some_and(|m| holds(r, m)))
            .map(|(i, r)| AssignedRow {
                row: i as u32,
                version: r.version,
                members: r.members.iter().map(|&m| tlt.members[m as usize].id).collect(),
                filling: filling.get(&i).map(|f| f.iter().copied().collect()).unwrap_or_default(),
                pending: r
                    .pending
                    .iter()
                    .map(|p| PendingMember { column: p.column, id: tlt.members[p.member as usize].id })
                    .collect(),
            })
            .collect(),
    }
}

/// Whether member `i` holds row `r`, as a member or a pending member.
pub(crate) fn holds(r: &TltRow, i: u32) -> bool {
    r.members.contains(&i) || r.pending.iter().any(|p| p.member == i)
}

/// The rules a round follows (from `MetaConfig`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    pub dead_after: Duration,
    /// Replace dead members.
    pub recovery: bool,
    /// Give members holding no position their share (FDS §3.4).
    pub grow: bool,
}

/// A snapshot of the server's state, taken at the start of a round.
pub(crate) struct View<'a> {
    pub tlt: &'a Tlt,
    pub members: &'a BTreeMap<TsId, Member>,
    pub filling: &'a Filling,
    pub dead: &'a BTreeSet<TsId>,
    /// How long each member has been silent (counted from no earlier than
    /// when the table was first served, or the server last woke from a
    /// stall). A member the table names that never heartbeated is absent
    /// here: `silence` says how long the server has been ready.
    pub silent: &'a BTreeMap<TsId, Duration>,
    pub silence: Duration,
}

impl View<'_> {
    fn age(&self, id: &TsId) -> Duration {
        self.silent.get(id).copied().unwrap_or(self.silence)
    }

    fn id(&self, member: u32) -> TsId {
        self.tlt.members[member as usize].id
    }

    fn domain_of(&self, id: &TsId) -> String {
        self.members
            .get(id)
            .map(|m| m.domain.clone())
            .or_else(|| self.tlt.member_index(*id).map(|i| self.tlt.members[i as usize].domain.clone()))
            .unwrap_or_else(|| id.to_string())
    }
}

/// What one round changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Newly declared dead, with how long each was silent.
    pub died: Vec<(TsId, Duration)>,
    /// Declared dead before, heard from again: no longer dead, settled.
    pub returned: Vec<TsId>,
    /// Alive, holding an assignment out of step with the table: settled.
    pub stale: Vec<TsId>,
    /// The members declared dead after this round.
    pub dead: BTreeSet<TsId>,
    /// Versions seen ahead of the table: the next change numbers above.
    pub row_floors: BTreeMap<usize, u64>,
    pub tlt_floor: u64,
    pub changes: Vec<RowChange>,
    /// Rows naming a dead member that could not be re-replicated.
    pub stuck: usize,
}

impl Plan {
    /// Members to be given their current assignment in this round.
    pub fn settle(&self) -> impl Iterator<Item = &TsId> {
        self.returned.iter().chain(&self.stale)
    }

    /// Whether the round needs an assignment round at all.
    pub fn commits(&self) -> bool {
        !self.changes.is_empty() || !self.returned.is_empty() || !self.stale.is_empty()
    }

    /// The row changes by kind, for the log: (re-replicated, filled,
    /// grown, pending members committed).
    pub fn summary(&self, cur: &Tlt) -> [(usize, &'static str); 4] {
        let before = |c: &RowChange| &cur.rows[c.row];
        let grown = self.changes.iter().filter(|c| c.pending.len() > before(c).pending.len()).count();
        let committed = self
            .changes
            .iter()
            .filter(|c| {
                let old: Vec<TsId> = before(c).members.iter().map(|&m| cur.members[m as usize].id).collect();
                c.members != old && !old.iter().any(|id| self.dead.contains(id))
            })
            .count();
        let bumped = self.changes.iter().filter(|c| c.bump).count();
        [
            (bumped - grown - committed, "re-replicating rows of dead tractservers"),
            (self.changes.iter().filter(|c| !c.bump).count(), "rows fully replicated again"),
            (grown, "rows given pending members (cluster growth)"),
            (committed, "pending members committed: they replace their column's member"),
        ]
    }
}

/// The invariants of a TLT change (FDS §3.1), checked before a round
/// pushes it: the table stays the same cluster and shape; its version
/// moves above the old one and above every version handed out before
/// (`tlt_floor`); no row's version goes back, and a row whose members or
/// pending members change gets a version above its old one and above any
/// handed out for it before (`row_floors`), so one (row, version) never
/// names two memberships.
pub(crate) fn check_change(
    cur: &Tlt,
    next: &Tlt,
    row_floors: &HashMap<usize, u64>,
    tlt_floor: u64,
) -> Result<(), String> {
    if (next.cluster_id, next.tract_size, next.replication, next.rows.len())
        != (cur.cluster_id, cur.tract_size, cur.replication, cur.rows.len())
    {
        return Err("the cluster id, tract size, replication or row count changed".into());
    }
    if next.version <= cur.version.max(tlt_floor) {
        return Err(format!(
            "table version {} is not above {} (current) and {tlt_floor} (handed out)",
            next.version, cur.version
        ));
    }
    let ids = |t: &Tlt, r: &TltRow| -> (Vec<TsId>, Vec<(u8, TsId)>) {
        (
            r.members.iter().map(|&m| t.members[m as usize].id).collect(),
            r.pending.iter().map(|p| (p.column, t.members[p.member as usize].id)).collect(),
        )
    };
    for (i, (old, new)) in cur.rows.iter().zip(&next.rows).enumerate() {
        if new.version < old.version {
            return Err(format!("row {i}'s version went back from {} to {}", old.version, new.version));
        }
        let floor = row_floors.get(&i).copied().unwrap_or(0);
        if ids(cur, old) != ids(next, new) && new.version <= old.version.max(floor) {
            return Err(format!(
                "row {i} changed members but its version {} is not above {} (current) and {floor} (handed out)",
                new.version, old.version
            ));
        }
    }
    Ok(())
}

/// One recovery round (module header), the same for a single, concurrent
/// or cascading failure.
pub(crate) fn plan(v: &View<'_>, rules: &Rules, rng: &mut impl Rng) -> Plan {
    let cur = v.tlt;
    let mut p = Plan { tlt_floor: 0, ..Plan::default() };

    // Deaths and returns.
    let mut dead = v.dead.clone();
    let known: BTreeSet<TsId> = cur.members.iter().map(|m| m.id).chain(v.members.keys().copied()).collect();
    for id in &known {
        if v.age(id) >= rules.dead_after && dead.insert(*id) {
            p.died.push((*id, v.age(id)));
        }
    }
    p.returned = dead.iter().copied().filter(|id| v.age(id) < rules.dead_after / 2).collect();

    // Members out of step with the table (see the header).
    for (id, m) in v.members {
        let none = Assignment { cluster_id: cur.cluster_id, ..Assignment::default() };
        let ahead = |a: &Assignment| {
            a.tlt_version > cur.version
                || a.rows.iter().any(|r| cur.rows.get(r.row as usize).is_some_and(|c| r.version > c.version))
        };
        let out_of_step = match &m.reported {
            Some(a) if a.cluster_id == cur.cluster_id && ahead(a) => {
                p.tlt_floor = p.tlt_floor.max(a.tlt_version);
                for r in &a.rows {
                    let f = p.row_floors.entry(r.row as usize).or_default();
                    *f = (*f).max(r.version);
                }
                true
            }
            Some(a) => assignment_is_stale(cur, *id, a) || assignment_lacks_rows(cur, *id, a),
            // Never stored an assignment: one only if the table names it.
            None => assignment_lacks_rows(cur, *id, &none),
        };
        if out_of_step && !dead.contains(id) {
            p.stale.push(*id);
        }
    }
    for id in &p.returned {
        dead.remove(id);
    }

    let live: Vec<TsId> = v
        .members
        .keys()
        .copied()
        .filter(|id| !dead.contains(id) && v.age(id) < rules.dead_after / 2)
        .collect();
    p.changes = row_changes(v, rules, &dead, &live, rng, &mut p.stuck);
    p.dead = dead;
    p
}

/// The rows' changes: filled and taken-over rows, dead members replaced,
/// and growth when nothing else changes.
fn row_changes(
    v: &View<'_>,
    rules: &Rules,
    dead: &BTreeSet<TsId>,
    live: &[TsId],
    rng: &mut impl Rng,
    stuck: &mut usize,
) -> Vec<RowChange> {
    let cur = v.tlt;
    let mut rows_held: HashMap<TsId, usize> = HashMap::new();
    for r in &cur.rows {
        for &m in &r.members {
            *rows_held.entry(v.id(m)).or_default() += 1;
        }
    }
    // Each replaced row is copied from its first complete member (see the
    // tractserver's `fill`), whose disk reads every byte the newcomer
    // writes. Counting those rows as load too spreads the copy traffic
    // over every disk: a disk that is already the source of several rows
    // is not also made a newcomer while others idle.
    let mut sourcing: HashMap<TsId, usize> = HashMap::new();
    for (i, row) in cur.rows.iter().enumerate() {
        let ids: Vec<TsId> = row.members.iter().map(|&m| v.id(m)).collect();
        if !ids.iter().any(|id| dead.contains(id)) {
            continue;
        }
        let fill = v.filling.get(&i);
        if let Some(src) = ids.iter().find(|id| !dead.contains(id) && fill.is_none_or(|f| !f.contains(id))) {
            *sourcing.entry(*src).or_default() += 1;
        }
    }
    // Members copying rows they are pending in are busy: they do not also
    // take over for failed servers (FDS §3.4).
    let growing: BTreeSet<TsId> =
        cur.rows.iter().flat_map(|r| r.pending.iter().map(|p| v.id(p.member))).collect();
    let mut given: HashMap<TsId, usize> = HashMap::new();
    let mut changes = Vec::new();
    for (i, row) in cur.rows.iter().enumerate() {
        let ids: Vec<TsId> = row.members.iter().map(|&m| v.id(m)).collect();
        let pend: Vec<(u8, TsId)> = row.pending.iter().map(|p| (p.column, v.id(p.member))).collect();
        let fill = v.filling.get(&i).cloned().unwrap_or_default();
        if !ids.iter().chain(pend.iter().map(|(_, id)| id)).any(|id| dead.contains(id)) {
            if let Some(c) = filled(v, i, row, &ids, &pend, &fill) {
                changes.push(c);
            }
            continue;
        }
        if !rules.recovery {
            continue;
        }
        // Copies come from complete members only; with none alive the row
        // waits for one to return (replacing it would lose data).
        if !ids.iter().any(|id| !dead.contains(id) && !fill.contains(id)) {
            *stuck += 1;
            continue;
        }
        let mut new_ids = ids.clone();
        let mut new_fill: BTreeSet<TsId> = fill.iter().copied().filter(|id| !dead.contains(id)).collect();
        // A dead pending member is dropped from the row (FDS §3.4).
        let mut new_pend: Vec<(u8, TsId)> =
            pend.iter().copied().filter(|(_, id)| !dead.contains(id)).collect();
        for col in 0..new_ids.len() {
            if !dead.contains(&new_ids[col]) {
                continue;
            }
            // The column's pending member has been taking every write and
            // copying the row: it takes the column now, still filling,
            // instead of a newcomer starting from nothing.
            if let Some(at) = new_pend.iter().position(|(c, _)| *c as usize == col) {
                new_ids[col] = new_pend.remove(at).1;
                continue;
            }
            let taken: BTreeSet<String> = new_ids
                .iter()
                .enumerate()
                .filter(|(c, _)| *c != col)
                .map(|(_, id)| v.domain_of(id))
                .collect();
            let cands: Vec<TsId> = live
                .iter()
                .copied()
                .filter(|id| {
                    !new_ids.contains(id)
                        && !new_pend.iter().any(|(_, p)| p == id)
                        && !growing.contains(id)
                        && !taken.contains(&v.domain_of(id))
                })
                .collect();
            let load = |id: &TsId| {
                let copying = given.get(id).copied().unwrap_or(0) + sourcing.get(id).copied().unwrap_or(0);
                (copying, rows_held.get(id).copied().unwrap_or(0))
            };
            let Some(best) = cands.iter().map(load).min() else { continue };
            let least: Vec<TsId> = cands.into_iter().filter(|id| load(id) == best).collect();
            let Some(&pick) = least.choose(rng) else { continue };
            new_ids[col] = pick;
            new_fill.insert(pick);
            *given.entry(pick).or_default() += 1;
        }
        if new_ids != ids || new_pend != pend {
            changes.push(RowChange {
                row: i,
                members: new_ids,
                filling: new_fill,
                pending: new_pend,
                bump: true,
            });
        } else {
            *stuck += 1;
        }
    }
    // Growth (FDS §3.4), once no row names a dead member: live servers
    // holding no position take their share of entries, pending first.
    let degraded = cur.rows.iter().any(|r| r.members.iter().any(|&m| dead.contains(&v.id(m))));
    if changes.is_empty() && !degraded && rules.grow {
        let spares = crate::growth::spares(cur, live);
        let moves = crate::growth::plan(cur, &spares, &|id| v.domain_of(&id), rng);
        let mut by_row: BTreeMap<usize, Vec<crate::growth::Move>> = BTreeMap::new();
        for mv in &moves {
            by_row.entry(mv.row).or_default().push(*mv);
        }
        for (i, mvs) in by_row {
            let row = &cur.rows[i];
            let ids: Vec<TsId> = row.members.iter().map(|&m| v.id(m)).collect();
            let mut pending: Vec<(u8, TsId)> =
                row.pending.iter().map(|p| (p.column, v.id(p.member))).collect();
            let mut fill = v.filling.get(&i).cloned().unwrap_or_default();
            for mv in mvs {
                pending.push((mv.column, mv.newcomer));
                fill.insert(mv.newcomer);
            }
            changes.push(RowChange { row: i, members: ids, filling: fill, pending, bump: true });
        }
    }
    changes
}

/// A whole row (no dead member) whose filling members finished copying
/// its current version: they say so, or they already hold an assignment
/// that no longer has them filling it (a clearing round that reached them
/// but failed elsewhere; they stop reporting the row). A pending member
/// that finished takes its column (the second phase of FDS §3.4): a new
/// row version, so clients stop writing to the member it replaces, which
/// may then free the row's tracts.
fn filled(
    v: &View<'_>,
    i: usize,
    row: &TltRow,
    ids: &[TsId],
    pend: &[(u8, TsId)],
    fill: &BTreeSet<TsId>,
) -> Option<RowChange> {
    let done: BTreeSet<TsId> = fill
        .iter()
        .copied()
        .filter(|id| {
            v.members.get(id).is_some_and(|m| {
                m.filled.iter().any(|f| f.row as usize == i && f.version == row.version)
                    || m.reported.as_ref().is_some_and(|a| {
                        a.cluster_id == v.tlt.cluster_id
                            && a.rows.iter().any(|r| {
                                r.row as usize == i && r.version == row.version && !r.filling.contains(id)
                            })
                    })
            })
        })
        .collect();
    if done.is_empty() {
        return None;
    }
    let mut new_ids = ids.to_vec();
    for (col, id) in pend.iter().filter(|(_, id)| done.contains(id)) {
        new_ids[*col as usize] = *id;
    }
    let rest: BTreeSet<TsId> = fill.difference(&done).copied().collect();
    let bump = new_ids != ids;
    let pending = pend.iter().copied().filter(|(_, id)| !done.contains(id)).collect();
    Some(RowChange { row: i, members: new_ids, filling: rest, pending, bump })
}

#[cfg(test)]
mod tests {
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
            rows: rows
                .iter()
                .map(|r| TltRow::new(5, r.iter().map(|id| (*id - 1) as u32).collect()))
                .collect(),
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
                    last_heartbeat: Instant::now(),
                    slots_total: 100,
                    slots_used: 0,
                    load: 0,
                    disk_mbps: 100,
                    reported: Some(a),
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
        w.silent.insert(ts(1), DEAD_AFTER / 2 - Duration::from_millis(1));
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
            vec![RowChange {
                row: 0,
                members: ids(&[4, 2, 3]),
                filling: set(&[]),
                pending: vec![],
                bump: false
            }]
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
            vec![RowChange {
                row: 0,
                members: ids(&[5, 2, 3]),
                filling: set(&[]),
                pending: vec![],
                bump: true
            }]
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
            vec![RowChange {
                row: 0,
                members: ids(&[5, 2, 3]),
                filling: set(&[5]),
                pending: vec![],
                bump: true
            }],
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
}
