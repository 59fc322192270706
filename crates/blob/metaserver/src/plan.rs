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
//! | member back in time | a member declared dead returns while the member that took its column in a row is still copying | it takes its column back, filling (a new row version), and repairs only what changed while it was away (incremental repair, Ursa §4.2.1, design 0009): [`Plan::readmitted`] |
//! | dead member replaced | a row names a dead member and has a complete live one | a live member takes the column (least copying, then fewest rows, never two per failure domain, not one busy growing, of the class the row's section asks for in that column: design 0009), filling: a new row version |
//! | stuck row | no complete member alive, or no live candidate of the column's class outside the row's failure domains | left as is and counted ([`Plan::stuck`]): replacing it would lose data |
//! | recovery off | rows name dead members | left as is (like Ceph's `noout`) |
//! | growth | no row names a dead member and nothing else changes | live members holding no position join rows as pending members, each section's columns only by disks of their class (`growth::plan`) |
//!
//! Settling happens in the same assignment round as the row changes: a
//! settled member is pushed its assignment under the new table, whose
//! version outranks any push of an older round still in flight.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use rand::seq::IndexedRandom;
use rand::Rng;

use blizzard_core::tlt::{Tlt, TltRow};
use blizzard_core::{DiskClass, TsId};
use blizzard_env::Instant;
use blizzard_proto::{AssignedRow, Assignment, FillProgress, PendingMember, RowRef};

/// What the metadata server knows of a registered tractserver (from its
/// heartbeats).
#[derive(Clone, Debug)]
pub(crate) struct Member {
    pub addr: String,
    pub domain: String,
    pub class: DiskClass,
    /// Its backup journal's use and size (0: none).
    pub journal: (u64, u64),
    pub last_heartbeat: Instant,
    pub slots_total: u64,
    pub slots_used: u64,
    pub load: u32,
    pub disk_mbps: u32,
    /// The assignment it stores, as it reported it or as it was last
    /// pushed to it.
    pub reported: Option<Assignment>,
    /// Asked for what it stores, it answered nothing: a disk never given
    /// rows. Until every member has either reported or said this, a
    /// metadata server without a table must not build a new one (it would
    /// be a new cluster over disks that belong to the old one).
    pub stores_nothing: bool,
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
        sections: tlt.sections.clone(),
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

    /// The class of disk a member declared (`None`: never heard from).
    fn class_of(&self, id: &TsId) -> Option<DiskClass> {
        self.members.get(id).map(|m| m.class)
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
    /// (row, member) given back to a returned member (module header).
    pub readmitted: Vec<(usize, TsId)>,
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
    pub fn summary(&self, cur: &Tlt) -> [(usize, &'static str); 5] {
        let before = |c: &RowChange| &cur.rows[c.row];
        let grown = self.changes.iter().filter(|c| c.pending.len() > before(c).pending.len()).count();
        let committed = self
            .changes
            .iter()
            .filter(|c| {
                let old: Vec<TsId> = before(c).members.iter().map(|&m| cur.members[m as usize].id).collect();
                c.members != old
                    && !old.iter().any(|id| self.dead.contains(id))
                    && !self.readmitted.iter().any(|(r, _)| *r == c.row)
            })
            .count();
        let readmitted: BTreeSet<usize> = self.readmitted.iter().map(|(r, _)| *r).collect();
        let bumped = self.changes.iter().filter(|c| c.bump).count();
        [
            (
                bumped.saturating_sub(grown + committed + readmitted.len()),
                "re-replicating rows of dead tractservers",
            ),
            (self.changes.iter().filter(|c| !c.bump).count(), "rows fully replicated again"),
            (grown, "rows given pending members (cluster growth)"),
            (committed, "pending members committed: they replace their column's member"),
            (readmitted.len(), "rows given back to returned tractservers, to repair what they missed"),
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
    if next.sections != cur.sections {
        return Err("the table's sections (placements) changed; they are fixed when it is first built".into());
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

/// Checks that every member a change puts into a row (as member or pending
/// member) has the class of disk the row's section asks for in its column
/// (design 0009): a hybrid row's primary fast, its backups slow. Rows the
/// change leaves alone are not judged; members whose class is unknown
/// (`None`) neither.
pub(crate) fn check_classes(
    cur: &Tlt,
    next: &Tlt,
    class: &dyn Fn(TsId) -> Option<DiskClass>,
) -> Result<(), String> {
    for (i, new) in next.rows.iter().enumerate() {
        if cur.rows.get(i).is_some_and(|old| old.members == new.members && old.pending == new.pending) {
            continue;
        }
        let placed = new.members.iter().enumerate().map(|(c, &m)| (c, m));
        let pending = new.pending.iter().map(|p| (p.column as usize, p.member));
        for (col, m) in placed.chain(pending) {
            let id = next.members[m as usize].id;
            if let (Some(want), Some(has)) = (next.column_class(i, col), class(id)) {
                if want != has {
                    return Err(format!(
                        "row {i} ({}) puts {id}, an {has} disk, in column {col}, which needs {want}",
                        next.row_placement(i)
                    ));
                }
            }
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
    p.changes = row_changes(v, rules, &dead, &live, rng, &mut p);
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
    p: &mut Plan,
) -> Vec<RowChange> {
    let cur = v.tlt;
    // Reads `p.returned`; adds to `p.stuck` and `p.readmitted`.
    let returned = p.returned.clone();
    let (stuck, readmitted) = (&mut p.stuck, &mut p.readmitted);
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
        // Members back in time take their columns back first.
        let back = readmit(v, i, &ids, &pend, &fill, &returned);
        // Recorded only with the change that carries them.
        let who: Vec<(usize, TsId)> =
            back.as_ref().map(|b| b.2.iter().map(|id| (i, *id)).collect()).unwrap_or_default();
        let (ids_now, fill) = match &back {
            Some((ids_now, fill_now, _)) => (ids_now.clone(), fill_now.clone()),
            None => (ids.clone(), fill),
        };
        let degraded = ids_now.iter().chain(pend.iter().map(|(_, id)| id)).any(|id| dead.contains(id));
        if !degraded || !rules.recovery {
            // A returned member takes its column back. With recovery off
            // dead members stay (like Ceph's `noout`), and it does only if
            // a complete member is left to repair it from.
            let source = ids_now.iter().any(|id| !dead.contains(id) && !fill.contains(id));
            if back.is_some() && (!degraded || source) {
                readmitted.extend(who);
                changes.push(RowChange {
                    row: i,
                    members: ids_now,
                    filling: fill,
                    pending: pend,
                    bump: true,
                });
            } else if !degraded {
                if let Some(c) = filled(v, i, row, &ids, &pend, &fill) {
                    changes.push(c);
                }
            }
            continue;
        }
        // Copies come from complete members only; with none alive the row
        // waits for one to return (replacing it would lose data).
        if !ids_now.iter().any(|id| !dead.contains(id) && !fill.contains(id)) {
            *stuck += 1;
            continue;
        }
        let mut new_ids = ids_now;
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
            // The row's section may ask for a class of disk in this
            // column (a hybrid row: a fast primary, slow backups).
            let want = cur.column_class(i, col);
            let cands: Vec<TsId> = live
                .iter()
                .copied()
                .filter(|id| {
                    !new_ids.contains(id)
                        && !new_pend.iter().any(|(_, p)| p == id)
                        && !growing.contains(id)
                        && !taken.contains(&v.domain_of(id))
                        && want.is_none_or(|c| v.class_of(id) == Some(c))
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
            readmitted.extend(who);
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
        let moves = crate::growth::plan(cur, &spares, &|id| v.domain_of(&id), &|id| v.class_of(&id), rng);
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
/// Gives returned members back their columns of row `i` (ids `ids`,
/// pending `pend`, filling `fill`) where the member that took the column
/// is still copying: the returned member still holds the row as it was
/// when it left, so repairing what changed since costs less than the
/// newcomer's whole copy. Its stored assignment (`Member::reported`,
/// which nothing pushed to while it was dead) names the column it held,
/// at an older version of the row. It goes back only where the row's
/// other columns leave its failure domain free and its class fits the
/// column. It is filling, so it serves no read of a tract it has not
/// repaired, and the row gets a new version (`RowChange::bump`), which
/// fences writes of the version it missed. The returned
/// (ids, filling, members readmitted), or `None` when nobody comes back.
fn readmit(
    v: &View<'_>,
    i: usize,
    ids: &[TsId],
    pend: &[(u8, TsId)],
    fill: &BTreeSet<TsId>,
    returned: &[TsId],
) -> Option<(Vec<TsId>, BTreeSet<TsId>, Vec<TsId>)> {
    let cur = v.tlt;
    let (mut ids, mut fill, mut who) = (ids.to_vec(), fill.clone(), Vec::new());
    for x in returned {
        let Some(a) = v.members.get(x).and_then(|m| m.reported.as_ref()) else { continue };
        if a.cluster_id != cur.cluster_id {
            continue;
        }
        let Some(held) = a.rows.iter().find(|r| r.row as usize == i && r.version < cur.rows[i].version)
        else {
            continue;
        };
        let Some(col) = held.members.iter().position(|m| m == x).filter(|c| *c < ids.len()) else { continue };
        let taker = ids[col];
        let domain = v.domain_of(x);
        let free = ids.iter().enumerate().all(|(c, id)| c == col || (id != x && v.domain_of(id) != domain));
        if taker == *x
            || !fill.contains(&taker)
            || !free
            || pend.iter().any(|(_, p)| p == x)
            || cur.column_class(i, col).is_some_and(|c| v.class_of(x) != Some(c))
        {
            continue;
        }
        ids[col] = *x;
        fill.remove(&taker);
        fill.insert(*x);
        who.push(*x);
    }
    (!who.is_empty()).then_some((ids, fill, who))
}

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
mod tests;
