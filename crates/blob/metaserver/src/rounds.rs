//! The leader's rounds (design 0007): only the replica that leads runs
//! them, one at a time (`MetaServer::change`). Each reads the replicated
//! state and the heartbeats, decides (`plan`, `tlt_builder`), and changes
//! the table in the order that keeps FDS §3.1's invariant across leaders:
//!
//! 1. propose `Reserve` (the versions it will hand out, the members
//!    declared dead, the members it may leave unsettled);
//! 2. push every affected tractserver its assignment;
//! 3. propose `Serve` (the new table): only then is it served.
//!
//! A leader lost between 1 and 3 leaves versions reserved and maybe
//! stored but never served; whoever leads next numbers above them and
//! settles the members named unsettled.
//!
//! | round | when | what it proposes |
//! |---|---|---|
//! | take over | this replica starts leading a term | waits for everything committed to apply, then `ExtendAll`: every volume lease lasts a term from now |
//! | initial build | no table, no reports, `init_tractservers` registered | `Reserve`, push, `Serve` |
//! | rebuild | no table, assignments reported (a single server restarted) | `Serve` of the table the reports make (they are stored already) |
//! | moved | a member heartbeats from an address the table lacks | `Serve` of the table with its address, a new table version |
//! | recovery | every round once a table is served (`plan`'s cases) | `Reserve` of the plan's member states; if it commits, push and `Serve` |

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::SeedableRng;

use blizzard_core::tlt::{Pending, Tlt, TltMember, TltRow};
use blizzard_core::TsId;
use blizzard_proto::{AssignedRow, Assignment, Request, RowRef};

use crate::machine::{MetaOp, RowFilling};
use crate::plan::{self, assignment_for, Filling, Member, RowChange, Rules, View};
use crate::replica::done;
use crate::server::{lock, MetaError, MetaPlant, MetaServer};
use crate::tlt_builder::{build_layout, BuildParams, BuilderMember};

/// The member states a change starts from (recorded by its `Reserve`).
#[derive(Clone, Debug, Default)]
struct Marks {
    dead: BTreeSet<TsId>,
    /// To be given their current assignment in this round.
    settle: BTreeSet<TsId>,
    tlt_floor: u64,
    row_floors: BTreeMap<usize, u64>,
}

fn filling_list(f: &Filling) -> Vec<RowFilling> {
    f.iter()
        .filter(|(_, m)| !m.is_empty())
        .map(|(row, m)| RowFilling { row: *row as u32, members: m.iter().copied().collect() })
        .collect()
}

impl MetaServer {
    /// One round of the leader's work (module header); on a replica that
    /// does not lead, nothing.
    pub async fn tick(&self) {
        let _change = self.change.lock().await;
        match self.take_over_if_new().await {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                self.complain(Duration::from_secs(5), &format!("cannot take over as leader yet: {e}"));
                return;
            }
        }
        if self.replica.read(|s| s.tlt.is_none()) {
            self.build_first().await;
            return;
        }
        let r = match self.serve_moved().await {
            Ok(()) => self.recover().await,
            Err(e) => Err(e),
        };
        lock(&self.state).last_recover = Some(self.env.now());
        if let Err(e) = r {
            self.complain(Duration::from_secs(5), &format!("recovery round failed; retrying: {e}"));
        }
    }

    /// Whether this replica leads with its state loaded; takes over when it
    /// has just started leading a term (module header's table).
    async fn take_over_if_new(&self) -> Result<bool, MetaError> {
        let Some(term) = self.replica.leading_term() else {
            let mut st = lock(&self.state);
            if st.term.take().is_some() {
                tracing::warn!("no longer the metadata leader");
                st.members.clear();
                st.asked.clear();
            }
            return Ok(false);
        };
        if lock(&self.state).term == Some(term) {
            return Ok(true);
        }
        self.replica.confirm().await.map_err(|e| MetaError::Replica(e.to_string()))?;
        let now_ms = self.wall_ms();
        let ttl_ms = self.cfg.volume_lease_ttl.as_millis() as u64;
        done(&self.propose(&MetaOp::ExtendAll { now_ms, ttl_ms }).await?)
            .map_err(|e| MetaError::Replica(e.to_string()))?;
        let now = self.env.now();
        let mut st = lock(&self.state);
        st.term = Some(term);
        // Silence is counted from now: a new leader heard nobody yet.
        st.ready_since = Some(now);
        st.last_recover = None;
        st.members.clear();
        st.asked.clear();
        if self.replica.group_status().is_some() {
            tracing::info!(term, "leading the metadata service");
        }
        Ok(true)
    }

    /// No table yet: rebuild it from reported assignments, or build the
    /// first one once enough tractservers registered.
    async fn build_first(&self) {
        let now = self.env.now();
        let (members, first_report) = {
            let st = lock(&self.state);
            (st.members.clone(), st.first_report)
        };
        let reports: Vec<&Assignment> = members.values().filter_map(|m| m.reported.as_ref()).collect();
        let result = if !reports.is_empty() {
            let named: BTreeSet<TsId> =
                reports.iter().flat_map(|a| a.rows.iter().flat_map(|r| r.members.iter().copied())).collect();
            let all_here = named.iter().all(|id| members.contains_key(id));
            let grace_over = first_report.is_some_and(|t| now.duration_since(t) >= self.cfg.rebuild_grace);
            if !(all_here || grace_over) {
                return;
            }
            match self.rebuild(&members) {
                Ok((tlt, filling)) => self.serve(tlt, filling, Vec::new()).await,
                Err(e) => Err(e),
            }
        } else if members.len() >= self.cfg.init_tractservers.max(1)
            && members.values().all(|m| m.stores_nothing)
        {
            // Every member said it stores no rows (`Member::stores_nothing`):
            // a new cluster. A member that has not answered yet may hold the
            // old cluster's rows; building now would start a new cluster
            // over them (`blob-sim --seed 210772 --replication 1
            // --tractservers 4 --joining 2`).
            self.initial_build(&members).await
        } else {
            return;
        };
        match result {
            Ok(tlt) => {
                tracing::info!(
                    rows = tlt.rows.len(),
                    members = tlt.members.len(),
                    replication = tlt.replication,
                    version = tlt.version,
                    "TLT ready"
                );
                lock(&self.state).ready_since = Some(now);
            }
            Err(e) => self.complain(Duration::from_secs(10), &format!("cannot build the TLT yet: {e}")),
        }
    }

    async fn propose(&self, op: &MetaOp) -> Result<crate::machine::MetaReply, MetaError> {
        self.replica.propose(op).await.map_err(|e| MetaError::Replica(e.to_string()))
    }

    /// Serves `tlt` (the last step of a round).
    async fn serve(&self, tlt: Tlt, filling: Filling, unsettled: Vec<TsId>) -> Result<Arc<Tlt>, MetaError> {
        let dead = self.replica.read(|s| s.dead.iter().copied().collect());
        let op = MetaOp::Serve { tlt, filling: filling_list(&filling), dead, unsettled };
        done(&self.propose(&op).await?).map_err(|e| MetaError::BadChange(e.to_string()))?;
        self.replica.read(|s| s.tlt.clone()).ok_or(MetaError::NotReady)
    }

    /// A new cluster: build the table and store every member's positions.
    async fn initial_build(&self, members: &BTreeMap<TsId, Member>) -> Result<Arc<Tlt>, MetaError> {
        let ids: Vec<TsId> = members.keys().copied().collect();
        let builder: Vec<BuilderMember> = members
            .iter()
            .map(|(id, m)| BuilderMember {
                id: *id,
                domain: m.domain.clone(),
                weight: m.disk_mbps,
                class: m.class,
            })
            .collect();
        let params = BuildParams {
            replication: self.cfg.replication,
            permutations: self.cfg.permutations,
            weighted: self.cfg.weighted,
        };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(self.env.random_u64());
        let layout =
            build_layout(&builder, &params, &mut rng).map_err(|e| MetaError::BadChange(e.to_string()))?;
        for why in &layout.skipped {
            tracing::warn!("{why}");
        }
        // Above anything a predecessor reserved for a first table it never
        // served (1 on a new group).
        let version =
            self.replica.read(|s| s.row_floors.values().copied().max().unwrap_or(0).max(s.tlt_floor)) + 1;
        let tlt = Tlt {
            cluster_id: self.env.random_u128().max(1),
            tract_size: self.cfg.tract_size,
            replication: self.cfg.replication,
            version,
            members: ids
                .iter()
                .map(|id| {
                    let m = &members[id];
                    TltMember { id: *id, addr: m.addr.clone(), domain: m.domain.clone() }
                })
                .collect(),
            rows: layout.rows.into_iter().map(|members| TltRow::new(version, members)).collect(),
            sections: layout.sections,
        };
        tlt.validate().map_err(|e| MetaError::BadChange(e.to_string()))?;
        let reserve = MetaOp::Reserve {
            tlt_version: version,
            rows: (0..tlt.rows.len()).map(|row| RowRef { row: row as u32, version }).collect(),
            dead: Vec::new(),
            unsettled: ids.clone(),
        };
        done(&self.propose(&reserve).await?).map_err(|e| MetaError::Replica(e.to_string()))?;
        self.push_assignments(&tlt, &BTreeMap::new(), &ids).await?;
        self.serve(tlt, BTreeMap::new(), Vec::new()).await
    }

    /// A restarted single metadata server: the table is what the
    /// tractservers say, row by row taking the highest version reported.
    fn rebuild(&self, members: &BTreeMap<TsId, Member>) -> Result<(Tlt, Filling), MetaError> {
        let reports: Vec<&Assignment> = members.values().filter_map(|m| m.reported.as_ref()).collect();
        let Some(newest) = reports.iter().max_by_key(|a| a.tlt_version) else {
            return Err(MetaError::NotReady);
        };
        let len = newest.tlt_len as usize;
        // Per row, the report from the newest assignment round that named
        // it (highest table version, then row version): the previous
        // server's latest decision about the row. Not simply the highest
        // row version: a round that failed part-way leaves a version that
        // was never served on the members it reached, and the server then
        // pushed the row's served version to the ones it could reach, in a
        // newer round; a member cut off meanwhile still holds the unserved
        // one (it is given its current assignment once it reports).
        let mut rows: Vec<Option<(&AssignedRow, u64)>> = vec![None; len];
        for a in reports.iter().filter(|a| a.cluster_id == newest.cluster_id) {
            for r in &a.rows {
                if let Some(slot) = rows.get_mut(r.row as usize) {
                    if slot.is_none_or(|(cur, tv)| (a.tlt_version, r.version) > (tv, cur.version)) {
                        *slot = Some((r, a.tlt_version));
                    }
                }
            }
        }
        let rows: Vec<Option<&AssignedRow>> = rows.into_iter().map(|r| r.map(|(r, _)| r)).collect();
        let missing = rows.iter().filter(|r| r.is_none()).count();
        if missing > 0 {
            return Err(MetaError::BadChange(format!(
                "{missing} of {len} TLT rows are held by no reporting tractserver; start the missing tractservers"
            )));
        }
        let ids: BTreeSet<TsId> = rows
            .iter()
            .flatten()
            .flat_map(|r| r.members.iter().copied().chain(r.pending.iter().map(|p| p.id)))
            .collect();
        let ids: Vec<TsId> = ids.into_iter().collect();
        let index: HashMap<TsId, u32> = ids.iter().enumerate().map(|(i, id)| (*id, i as u32)).collect();
        let tlt = Tlt {
            cluster_id: newest.cluster_id,
            tract_size: newest.tract_size,
            replication: newest.replication,
            version: newest.tlt_version,
            members: ids
                .iter()
                .map(|id| match members.get(id) {
                    Some(m) => TltMember { id: *id, addr: m.addr.clone(), domain: m.domain.clone() },
                    // Named by others but silent: listed so rows stay whole.
                    None => TltMember { id: *id, addr: String::new(), domain: id.to_string() },
                })
                .collect(),
            rows: rows
                .iter()
                .flatten()
                .map(|r| TltRow {
                    version: r.version,
                    members: r.members.iter().filter_map(|m| index.get(m).copied()).collect(),
                    pending: r
                        .pending
                        .iter()
                        .filter_map(|p| index.get(&p.id).map(|&member| Pending { column: p.column, member }))
                        .collect(),
                })
                .collect(),
            sections: newest.sections.clone(),
        };
        tlt.validate()
            .map_err(|e| MetaError::BadChange(format!("reported assignments are inconsistent: {e}")))?;
        if tlt.tract_size != self.cfg.tract_size || tlt.replication != self.cfg.replication {
            tracing::warn!(
                tract_size = tlt.tract_size,
                replication = tlt.replication,
                "adopting the cluster's stored parameters, which differ from this server's flags"
            );
        }
        let filling: Filling = rows
            .iter()
            .flatten()
            .map(|r| {
                let holder = |id: &TsId| r.members.contains(id) || r.pending.iter().any(|p| p.id == *id);
                (r.row as usize, r.filling.iter().copied().filter(holder).collect::<BTreeSet<TsId>>())
            })
            .filter(|(_, f)| !f.is_empty())
            .collect();
        tracing::info!(
            version = tlt.version,
            rows_filling = filling.len(),
            "rebuilt the TLT from tractserver reports"
        );
        Ok((tlt, filling))
    }

    /// Sends each of `ids` its assignment under `tlt` and waits for all to
    /// store it.
    async fn push_assignments(&self, tlt: &Tlt, filling: &Filling, ids: &[TsId]) -> Result<(), MetaError> {
        let calls = ids.iter().map(|id| async move {
            // A member that left every row is not in the table any more:
            // its address is the one it heartbeats from.
            let addr = match tlt.member_index(*id) {
                Some(i) => tlt.members[i as usize].addr.clone(),
                None => lock(&self.state).members.get(id).map(|m| m.addr.clone()).unwrap_or_default(),
            };
            let assignment = assignment_for(tlt, filling, *id);
            let req = Request::AssignRows { assignment: assignment.clone() };
            let res = match self.conns.get(&self.env, &addr).await {
                Ok(c) => c.call_timeout(&self.env, self.cfg.request_timeout, &req, Bytes::new()).await,
                Err(e) => Err(e),
            };
            // What it holds now, for judging whether it may serve.
            if res.is_ok() {
                if let Some(m) = lock(&self.state).members.get_mut(id) {
                    m.reported = Some(assignment);
                }
            }
            res.map(|_| ()).map_err(|error| MetaError::AssignFailed { id: *id, error })
        });
        for r in futures::future::join_all(calls).await {
            r?;
        }
        Ok(())
    }

    /// Changes the members of some rows: bumps their versions, has every
    /// tractserver of the old and new rows store its new assignment, and
    /// only then serves the new table (FDS §3.1). Giving a row its current
    /// members just bumps its version.
    pub async fn reassign_rows(&self, changes: &[(usize, Vec<TsId>)]) -> Result<Arc<Tlt>, MetaError> {
        let _change = self.change.lock().await;
        if !self.take_over_if_new().await? {
            return Err(MetaError::Replica("this replica does not lead the metadata service".into()));
        }
        let (cur, filling, marks) = self.replica.read(|s| {
            let marks = Marks {
                dead: s.dead.clone(),
                settle: BTreeSet::new(),
                tlt_floor: s.tlt_floor,
                row_floors: s.row_floors.clone(),
            };
            (s.tlt.clone(), s.filling.clone(), marks)
        });
        let cur = cur.ok_or(MetaError::NotReady)?;
        let changes: Vec<RowChange> = changes
            .iter()
            .map(|(row, ids)| RowChange {
                row: *row,
                members: ids.clone(),
                filling: filling.get(row).cloned().unwrap_or_default(),
                pending: cur
                    .rows
                    .get(*row)
                    .map(|r| {
                        r.pending
                            .iter()
                            .map(|p| (p.column, cur.members[p.member as usize].id))
                            .filter(|(_, id)| !ids.contains(id))
                            .collect()
                    })
                    .unwrap_or_default(),
                bump: true,
            })
            .collect();
        let t = self.commit(&cur, &changes, &marks).await?;
        tracing::info!(rows = changes.len(), version = t.version, "TLT rows reassigned");
        Ok(t)
    }

    /// Applies row changes to `cur` (module header's order): new versions
    /// for changed memberships, `Reserve`, every live tractserver of the
    /// old and new rows (and every unsettled one) stores its new
    /// assignment, `Serve`. Runs under `change`.
    async fn commit(
        &self,
        cur: &Arc<Tlt>,
        changes: &[RowChange],
        marks: &Marks,
    ) -> Result<Arc<Tlt>, MetaError> {
        let members = lock(&self.state).members.clone();
        let (mut filling, unsettled, mut floors, mut tlt_floor) = self
            .replica
            .read(|s| (s.filling.clone(), s.unsettled.clone(), s.row_floors.clone(), s.tlt_floor));
        for (row, v) in &marks.row_floors {
            let f = floors.entry(*row).or_default();
            *f = (*f).max(*v);
        }
        tlt_floor = tlt_floor.max(marks.tlt_floor);
        let dead = &marks.dead;
        let mut t = (**cur).clone();
        let mut affected = BTreeSet::new();
        let mut bumped = Vec::new();
        for c in changes {
            let Some(r) = t.rows.get(c.row) else {
                return Err(MetaError::BadChange(format!("row {} does not exist", c.row)));
            };
            affected.extend(
                r.members
                    .iter()
                    .chain(r.pending.iter().map(|p| &p.member))
                    .map(|&m| t.members[m as usize].id),
            );
            if c.members.len() != t.replication as usize {
                return Err(MetaError::BadChange(format!("row {} needs {} members", c.row, t.replication)));
            }
            let mut index = |t: &mut Tlt, id: TsId| -> Result<u32, MetaError> {
                affected.insert(id);
                match t.member_index(id) {
                    Some(i) => Ok(i),
                    None => {
                        let Some(m) = members.get(&id) else {
                            return Err(MetaError::BadChange(format!("tractserver {id} is not registered")));
                        };
                        t.members.push(TltMember { id, addr: m.addr.clone(), domain: m.domain.clone() });
                        Ok((t.members.len() - 1) as u32)
                    }
                }
            };
            let mut idx = Vec::with_capacity(c.members.len());
            for id in &c.members {
                idx.push(index(&mut t, *id)?);
            }
            let mut pending = Vec::with_capacity(c.pending.len());
            for (column, id) in &c.pending {
                pending.push(Pending { column: *column, member: index(&mut t, *id)? });
            }
            let r = &mut t.rows[c.row];
            r.members = idx;
            r.pending = pending;
            // Only the row's holders can be filling it: a filling member
            // replaced by a committed pending one leaves the row, and a
            // mark it kept would wait forever for a report.
            let c_filling: BTreeSet<TsId> = c
                .filling
                .iter()
                .copied()
                .filter(|id| c.members.contains(id) || c.pending.iter().any(|(_, p)| p == id))
                .collect();
            // (Indices into `t.members` equal `cur`'s for the members `cur`
            // has: new ones are appended.)
            let moved = (&r.members, &r.pending) != (&cur.rows[c.row].members, &cur.rows[c.row].pending);
            let forget = self.cfg.plant == MetaPlant::ForgetRowBump && moved;
            if c.bump && !forget {
                r.version =
                    r.version.max(floors.get(&c.row).copied().unwrap_or(0)).max(self.version_base) + 1;
                bumped.push(RowRef { row: c.row as u32, version: r.version });
            }
            if c_filling.is_empty() {
                filling.remove(&c.row);
            } else {
                filling.insert(c.row, c_filling);
            }
        }
        t.version = t.version.max(tlt_floor).max(self.version_base) + 1;
        t.validate().map_err(|e| MetaError::BadChange(e.to_string()))?;
        // FDS §3.1's invariant, checked rather than trusted: a refused
        // change is logged and retried next round, never served.
        let floors: HashMap<usize, u64> = floors.into_iter().collect();
        if self.cfg.plant != MetaPlant::ForgetRowBump {
            let class = |id: TsId| members.get(&id).map(|m| m.class);
            plan::check_change(cur, &t, &floors, tlt_floor)
                .and_then(|()| plan::check_classes(cur, &t, &class))
                .map_err(|e| MetaError::BadChange(format!("invariant violated, change not served: {e}")))?;
        }
        // A dead member cannot store anything: it is told to stop serving
        // when it heartbeats again, and then given its assignment.
        let to_settle: BTreeSet<TsId> = unsettled.union(&marks.settle).copied().collect();
        let ids: Vec<TsId> = affected.union(&to_settle).copied().filter(|id| !dead.contains(id)).collect();
        let mut rows: Vec<RowRef> =
            marks.row_floors.iter().map(|(row, v)| RowRef { row: *row as u32, version: *v }).collect();
        rows.extend(bumped);
        let reserve = MetaOp::Reserve {
            tlt_version: t.version,
            rows,
            dead: dead.iter().copied().collect(),
            unsettled: to_settle.iter().chain(&ids).copied().collect::<BTreeSet<_>>().into_iter().collect(),
        };
        done(&self.propose(&reserve).await?).map_err(|e| MetaError::Replica(e.to_string()))?;
        self.push_assignments(&t, &filling, &ids).await?;
        let left: Vec<TsId> = to_settle.iter().copied().filter(|id| !ids.contains(id)).collect();
        self.serve(t, filling, left).await
    }

    /// Members heard from at an address the table lacks (back on a new
    /// one, or listed by a rebuild before they reported): clients must
    /// learn it, so the table's version moves (row versions do not).
    pub(crate) async fn serve_moved(&self) -> Result<(), MetaError> {
        let Some(cur) = self.replica.read(|s| s.tlt.clone()) else { return Ok(()) };
        let moved: Vec<(usize, String)> = {
            let st = lock(&self.state);
            cur.members
                .iter()
                .enumerate()
                .filter_map(|(i, m)| {
                    st.members.get(&m.id).filter(|h| h.addr != m.addr).map(|h| (i, h.addr.clone()))
                })
                .collect()
        };
        if moved.is_empty() {
            return Ok(());
        }
        let mut t = (*cur).clone();
        for (i, addr) in &moved {
            tracing::info!(id = %t.members[*i].id, %addr, "tractserver moved");
            t.members[*i].addr = addr.clone();
        }
        let floor = self.replica.read(|s| s.tlt_floor);
        t.version = t.version.max(floor).max(self.version_base) + 1;
        let (filling, unsettled) =
            self.replica.read(|s| (s.filling.clone(), s.unsettled.iter().copied().collect()));
        let t = self.serve(t, filling, unsettled).await?;
        tracing::info!(version = t.version, "TLT serves the new addresses");
        Ok(())
    }

    /// One recovery round (FDS §3.2; the cases are `plan`'s): snapshot
    /// the view, plan, record the plan's member states, commit its row
    /// changes and settle its members in one assignment round, log.
    async fn recover(&self) -> Result<(), MetaError> {
        let now = self.env.now();
        let (members, ready_since) = {
            let mut st = lock(&self.state);
            // Rounds start every half heartbeat interval after the last one
            // ended; a much longer gap means this process was stalled, and
            // heartbeats may be queued.
            if st.last_recover.is_some_and(|t| now.duration_since(t) > self.cfg.heartbeat_interval * 4) {
                tracing::warn!("metadata server was stalled; restarting every member's silence clock");
                st.ready_since = Some(now);
            }
            (st.members.clone(), st.ready_since.unwrap_or(now))
        };
        let Some((cur, filling, dead, unsettled)) = self
            .replica
            .read(|s| s.tlt.clone().map(|t| (t, s.filling.clone(), s.dead.clone(), s.unsettled.clone())))
        else {
            return Ok(());
        };
        let silent: BTreeMap<TsId, Duration> = members
            .iter()
            .map(|(id, m)| (*id, now.duration_since(m.last_heartbeat.max(ready_since))))
            .collect();
        let view = View {
            tlt: &cur,
            members: &members,
            filling: &filling,
            dead: &dead,
            silent: &silent,
            silence: now.duration_since(ready_since),
        };
        let rules =
            Rules { dead_after: self.cfg.dead_after, recovery: self.cfg.recovery, grow: self.cfg.grow };
        let mut rng = rand::rngs::SmallRng::seed_from_u64(self.env.random_u64());
        let plan = plan::plan(&view, &rules, &mut rng);
        for (id, silent) in &plan.died {
            tracing::error!(%id, silent_ms = silent.as_millis() as u64, "tractserver declared dead");
        }
        if plan.stuck > 0 {
            self.complain(
                Duration::from_secs(10),
                &format!(
                    "{} rows name a dead tractserver and cannot be re-replicated (no complete member alive, or no \
                     live tractserver outside the row's failure domains): restart the dead tractservers or add new ones",
                    plan.stuck
                ),
            );
        }
        let marks = Marks {
            dead: plan.dead.clone(),
            settle: plan.settle().copied().collect(),
            tlt_floor: plan.tlt_floor,
            row_floors: plan.row_floors.clone(),
        };
        if !plan.commits() {
            // Member states still change (a death with recovery off, a
            // floor raised): recorded, so the next leader knows them.
            let floors_rise = self.replica.read(|s| {
                plan.tlt_floor > s.tlt_floor
                    || plan.row_floors.iter().any(|(r, v)| s.row_floors.get(r).is_none_or(|f| v > f))
            });
            if plan.dead != dead || floors_rise || !marks.settle.is_subset(&unsettled) {
                let reserve = MetaOp::Reserve {
                    tlt_version: plan.tlt_floor,
                    rows: plan
                        .row_floors
                        .iter()
                        .map(|(r, v)| RowRef { row: *r as u32, version: *v })
                        .collect(),
                    dead: plan.dead.iter().copied().collect(),
                    unsettled: marks.settle.iter().copied().collect(),
                };
                done(&self.propose(&reserve).await?).map_err(|e| MetaError::Replica(e.to_string()))?;
            }
            return Ok(());
        }
        let t = self.commit(&cur, &plan.changes, &marks).await?;
        for id in &plan.returned {
            let rows = self.replica.read(|s| assignment_for(&t, &s.filling, *id).rows.len());
            tracing::info!(%id, rows, "declared-dead tractserver is back and holds its current assignment");
        }
        for id in &plan.stale {
            tracing::info!(%id, "gave a tractserver with a stale assignment its current one");
        }
        for (rows, what) in plan.summary(&cur).into_iter().filter(|(n, _)| *n > 0) {
            tracing::info!(rows, version = t.version, "{what}");
        }
        let joined: BTreeSet<TsId> = plan
            .changes
            .iter()
            .flat_map(|c| c.pending.iter().map(|(_, id)| *id))
            .filter(|id| {
                !cur.rows.iter().any(|r| r.pending.iter().any(|p| cur.members[p.member as usize].id == *id))
            })
            .collect();
        for id in joined {
            tracing::info!(%id, "tractserver joined the TLT: copying its share of rows (pending)");
        }
        Ok(())
    }
}
