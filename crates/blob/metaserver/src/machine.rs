//! The metadata service's replicated state (design 0007): what a new
//! leader must continue from, as a `blizzard_replicated::Service`. The
//! served TLT and its filling marks, the members declared dead or to be
//! settled, the version floors (every table and row version ever handed
//! to a tractserver), and the volume leases. Heartbeats stay out of it:
//! they live in the leader's memory (`server`).
//!
//! | update | footprint | applies |
//! |---|---|---|
//! | `Reserve` | barrier | before a round pushes anything: raises the floors to the versions it will hand out, records the members declared dead and adds the members it may leave unsettled |
//! | `Serve` | barrier | the table a round made every tractserver store; refused if it does not follow the served one (`plan::check_change` against it) |
//! | `Renew` | exclusive on the volume's blob | `lease::Leases` (pure, time from the update) |
//! | `Acquire`, `Release` | barrier (they may change the scope table, whose versions every replica must pass through alike) | `lease::Leases`; the certificate a lease was taken with serves the volume (`scope`) |
//! | `SetAccess`, `DropVolume`, `Revoke`, `AttachReader` | barrier | the scope table (`scope`): access lists, revocations, read-only NBD servers |
//! | `ExtendAll` | barrier | a new leader's first update: every lease lasts a term from its takeover |
//!
//! Every update is checked whole before it changes anything, and applies
//! the same on every replica (time is the proposer's, carried in the
//! update). Snapshot format (version 2), the `blizzard_proto` codec:
//! magic u64, version u32, the served table (`Option<Tlt>`), filling
//! marks, dead, unsettled, table floor, row floors, last token, lease
//! clock, leases, then the scope table (`blizzard_proto::scope::Scope`;
//! version 1 had none: it reads as the empty table).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use blizzard_core::limits::NAME_LEN_MAX;
use blizzard_core::tlt::Tlt;
use blizzard_core::{BlobId, TsId};
use blizzard_proto::scope::{check_entries, Scope, ScopeEntry, IDENTITY_LEN_MAX, SERIAL_LEN_MAX};
use blizzard_proto::{wire_struct, DecodeError, Reader, RowRef, Wire, Writer};
use blizzard_replicated::service::{Footprint, Position, Service};

use crate::lease::{Lease, Leases, Outcome};
use crate::plan::{check_change, Filling};
use crate::server::MetaPlant;

/// Longest lease a holder may ask for.
pub const LEASE_TTL_MAX_MS: u64 = 10 * 60 * 1000;

const SNAPSHOT_MAGIC: u64 = 0x424c_5a4d_4554_4131; // "BLZMETA1"
const SNAPSHOT_VERSION: u32 = 2;

/// One row's members still copying it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowFilling {
    pub row: u32,
    pub members: Vec<TsId>,
}
wire_struct!(RowFilling { row: u32, members: Vec<TsId> });

/// One volume's lease, as stored and read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseEntry {
    pub blob: BlobId,
    pub holder: String,
    pub token: u64,
    pub expires_ms: u64,
}
wire_struct!(LeaseEntry { blob: BlobId, holder: String, token: u64, expires_ms: u64 });

/// An update of the replicated state (module header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaOp {
    /// `dead` replaces the set; `unsettled` joins it.
    Reserve {
        tlt_version: u64,
        rows: Vec<RowRef>,
        dead: Vec<TsId>,
        unsettled: Vec<TsId>,
    },
    Serve {
        tlt: Tlt,
        filling: Vec<RowFilling>,
        dead: Vec<TsId>,
        unsettled: Vec<TsId>,
    },
    Acquire {
        blob: BlobId,
        holder: String,
        now_ms: u64,
        ttl_ms: u64,
        take_over: bool,
        /// The name on the certificate the request came with ("" for
        /// none): it serves the volume while the lease lasts (`scope`).
        peer: String,
    },
    Renew {
        blob: BlobId,
        holder: String,
        token: u64,
        now_ms: u64,
        ttl_ms: u64,
    },
    Release {
        blob: BlobId,
        token: u64,
    },
    ExtendAll {
        now_ms: u64,
        ttl_ms: u64,
    },
    SetAccess {
        blob: BlobId,
        name: String,
        entries: Vec<ScopeEntry>,
    },
    DropVolume {
        blob: BlobId,
    },
    Revoke {
        serial: String,
        name: String,
    },
    AttachReader {
        blob: BlobId,
        peer: String,
    },
}

impl MetaOp {
    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        match self {
            MetaOp::Reserve { tlt_version, rows, dead, unsettled } => {
                1u8.put(&mut w);
                tlt_version.put(&mut w);
                rows.put(&mut w);
                dead.put(&mut w);
                unsettled.put(&mut w);
            }
            MetaOp::Serve { tlt, filling, dead, unsettled } => {
                2u8.put(&mut w);
                tlt.put(&mut w);
                filling.put(&mut w);
                dead.put(&mut w);
                unsettled.put(&mut w);
            }
            MetaOp::Acquire { blob, holder, now_ms, ttl_ms, take_over, peer } => {
                // 3: without a certificate (as before certificates served
                // volumes), 7: with its name last.
                (if peer.is_empty() { 3u8 } else { 7u8 }).put(&mut w);
                blob.put(&mut w);
                holder.put(&mut w);
                now_ms.put(&mut w);
                ttl_ms.put(&mut w);
                take_over.put(&mut w);
                if !peer.is_empty() {
                    peer.put(&mut w);
                }
            }
            MetaOp::Renew { blob, holder, token, now_ms, ttl_ms } => {
                4u8.put(&mut w);
                blob.put(&mut w);
                holder.put(&mut w);
                token.put(&mut w);
                now_ms.put(&mut w);
                ttl_ms.put(&mut w);
            }
            MetaOp::Release { blob, token } => {
                5u8.put(&mut w);
                blob.put(&mut w);
                token.put(&mut w);
            }
            MetaOp::ExtendAll { now_ms, ttl_ms } => {
                6u8.put(&mut w);
                now_ms.put(&mut w);
                ttl_ms.put(&mut w);
            }
            MetaOp::SetAccess { blob, name, entries } => {
                8u8.put(&mut w);
                blob.put(&mut w);
                name.put(&mut w);
                entries.put(&mut w);
            }
            MetaOp::DropVolume { blob } => {
                9u8.put(&mut w);
                blob.put(&mut w);
            }
            MetaOp::Revoke { serial, name } => {
                10u8.put(&mut w);
                serial.put(&mut w);
                name.put(&mut w);
            }
            MetaOp::AttachReader { blob, peer } => {
                11u8.put(&mut w);
                blob.put(&mut w);
                peer.put(&mut w);
            }
        }
        w.buf.freeze()
    }

    /// Decodes and checks an update (untrusted bytes: every length and
    /// value bounded, the table valid).
    pub fn decode(bytes: &[u8]) -> Result<MetaOp, DecodeError> {
        let mut r = Reader::new(bytes);
        let holder = |r: &mut Reader<'_>| -> Result<String, DecodeError> {
            let h = String::get(r)?;
            if h.is_empty() || h.len() > NAME_LEN_MAX {
                return Err(DecodeError::BadValue { field: "lease holder length", value: h.len() as u64 });
            }
            Ok(h)
        };
        let ttl = |r: &mut Reader<'_>| -> Result<u64, DecodeError> {
            let t = u64::get(r)?;
            if t == 0 || t > LEASE_TTL_MAX_MS {
                return Err(DecodeError::BadValue { field: "lease ttl ms", value: t });
            }
            Ok(t)
        };
        let bounded = |r: &mut Reader<'_>, field: &'static str, min: usize, max: usize| {
            let v = String::get(r)?;
            if v.len() < min || v.len() > max {
                return Err(DecodeError::BadValue { field, value: v.len() as u64 });
            }
            Ok(v)
        };
        let op = match u8::get(&mut r)? {
            1 => MetaOp::Reserve {
                tlt_version: u64::get(&mut r)?,
                rows: Wire::get(&mut r)?,
                dead: Wire::get(&mut r)?,
                unsettled: Wire::get(&mut r)?,
            },
            2 => {
                let tlt = Tlt::get(&mut r)?;
                tlt.validate()
                    .map_err(|_| DecodeError::BadValue { field: "served TLT", value: tlt.version })?;
                let filling: Vec<RowFilling> = Wire::get(&mut r)?;
                if let Some(f) = filling.iter().find(|f| f.row as usize >= tlt.rows.len()) {
                    return Err(DecodeError::BadValue { field: "filling row", value: f.row as u64 });
                }
                MetaOp::Serve { tlt, filling, dead: Wire::get(&mut r)?, unsettled: Wire::get(&mut r)? }
            }
            t @ (3 | 7) => MetaOp::Acquire {
                blob: BlobId::get(&mut r)?,
                holder: holder(&mut r)?,
                now_ms: u64::get(&mut r)?,
                ttl_ms: ttl(&mut r)?,
                take_over: bool::get(&mut r)?,
                peer: if t == 7 {
                    bounded(&mut r, "lease certificate name", 1, IDENTITY_LEN_MAX)?
                } else {
                    String::new()
                },
            },
            4 => MetaOp::Renew {
                blob: BlobId::get(&mut r)?,
                holder: holder(&mut r)?,
                token: u64::get(&mut r)?,
                now_ms: u64::get(&mut r)?,
                ttl_ms: ttl(&mut r)?,
            },
            5 => MetaOp::Release { blob: BlobId::get(&mut r)?, token: u64::get(&mut r)? },
            6 => MetaOp::ExtendAll { now_ms: u64::get(&mut r)?, ttl_ms: ttl(&mut r)? },
            8 => {
                let blob = BlobId::get(&mut r)?;
                let name = bounded(&mut r, "volume name", 1, NAME_LEN_MAX)?;
                let entries: Vec<ScopeEntry> = Wire::get(&mut r)?;
                if check_entries(&entries).is_err() {
                    return Err(DecodeError::BadValue { field: "access list", value: entries.len() as u64 });
                }
                MetaOp::SetAccess { blob, name, entries }
            }
            9 => MetaOp::DropVolume { blob: BlobId::get(&mut r)? },
            10 => MetaOp::Revoke {
                serial: bounded(&mut r, "serial number", 1, SERIAL_LEN_MAX)?,
                name: bounded(&mut r, "revoked name", 0, IDENTITY_LEN_MAX)?,
            },
            11 => MetaOp::AttachReader {
                blob: BlobId::get(&mut r)?,
                peer: bounded(&mut r, "reader's certificate name", 1, IDENTITY_LEN_MAX)?,
            },
            t => return Err(DecodeError::BadValue { field: "metadata update", value: t as u64 }),
        };
        r.finish()?;
        Ok(op)
    }
}

/// What an update comes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaReply {
    Done,
    /// `Serve` of a table that does not follow the served one.
    Refused(String),
    Lease(Outcome),
}

impl MetaReply {
    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        match self {
            MetaReply::Done => 0u8.put(&mut w),
            MetaReply::Refused(why) => {
                1u8.put(&mut w);
                why.put(&mut w);
            }
            MetaReply::Lease(o) => {
                2u8.put(&mut w);
                match o {
                    Outcome::Granted { token, expires_ms } => {
                        0u8.put(&mut w);
                        token.put(&mut w);
                        expires_ms.put(&mut w);
                    }
                    Outcome::Held { holder, expires_ms } => {
                        1u8.put(&mut w);
                        holder.put(&mut w);
                        expires_ms.put(&mut w);
                    }
                    Outcome::Lost { holder } => {
                        2u8.put(&mut w);
                        holder.put(&mut w);
                    }
                    Outcome::Full => 3u8.put(&mut w),
                }
            }
        }
        w.buf.freeze()
    }

    pub fn decode(bytes: &[u8]) -> Result<MetaReply, DecodeError> {
        let mut r = Reader::new(bytes);
        let reply = match u8::get(&mut r)? {
            0 => MetaReply::Done,
            1 => MetaReply::Refused(String::get(&mut r)?),
            2 => MetaReply::Lease(match u8::get(&mut r)? {
                0 => Outcome::Granted { token: u64::get(&mut r)?, expires_ms: u64::get(&mut r)? },
                1 => Outcome::Held { holder: String::get(&mut r)?, expires_ms: u64::get(&mut r)? },
                2 => Outcome::Lost { holder: Wire::get(&mut r)? },
                3 => Outcome::Full,
                t => return Err(DecodeError::BadValue { field: "lease outcome", value: t as u64 }),
            }),
            t => return Err(DecodeError::BadValue { field: "metadata reply", value: t as u64 }),
        };
        r.finish()?;
        Ok(reply)
    }
}

/// The replicated state (module header).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaState {
    pub tlt: Option<Arc<Tlt>>,
    pub filling: Filling,
    pub dead: BTreeSet<TsId>,
    pub unsettled: BTreeSet<TsId>,
    /// Above every version handed out: a new round numbers above these.
    pub tlt_floor: u64,
    pub row_floors: BTreeMap<usize, u64>,
    pub leases: Leases,
    /// Who may touch which volume (`scope`).
    pub scope: Scope,
}

impl MetaState {
    fn apply(&mut self, op: &MetaOp, plant: MetaPlant) -> MetaReply {
        match op {
            MetaOp::Reserve { tlt_version, rows, dead, unsettled } => {
                self.tlt_floor = self.tlt_floor.max(*tlt_version);
                for r in rows {
                    let f = self.row_floors.entry(r.row as usize).or_default();
                    *f = (*f).max(r.version);
                }
                self.dead = dead.iter().copied().collect();
                self.unsettled.extend(unsettled.iter().copied());
                MetaReply::Done
            }
            MetaOp::Serve { tlt, filling, dead, unsettled } => {
                if let Some(cur) = self.tlt.as_ref().filter(|_| plant != MetaPlant::ForgetRowBump) {
                    // Checked against the served table only: the floors
                    // were raised to this very round's versions.
                    if let Err(e) = check_change(cur, tlt, &HashMap::new(), 0) {
                        return MetaReply::Refused(format!("table {} not served: {e}", tlt.version));
                    }
                }
                self.tlt_floor = self.tlt_floor.max(tlt.version);
                for (i, r) in tlt.rows.iter().enumerate() {
                    let f = self.row_floors.entry(i).or_default();
                    *f = (*f).max(r.version);
                }
                self.tlt = Some(Arc::new(tlt.clone()));
                self.filling = filling
                    .iter()
                    .filter(|f| !f.members.is_empty())
                    .map(|f| (f.row as usize, f.members.iter().copied().collect()))
                    .collect();
                self.dead = dead.iter().copied().collect();
                self.unsettled = unsettled.iter().copied().collect();
                MetaReply::Done
            }
            MetaOp::Acquire { blob, holder, now_ms, ttl_ms, take_over, peer } => {
                let outcome = self.leases.acquire(*blob, holder, *now_ms, *ttl_ms, *take_over);
                if matches!(outcome, Outcome::Granted { .. }) {
                    crate::scope::served_by(&mut self.scope, *blob, peer);
                }
                MetaReply::Lease(outcome)
            }
            MetaOp::Renew { blob, holder, token, now_ms, ttl_ms } => {
                MetaReply::Lease(self.leases.renew(*blob, holder, *token, *now_ms, *ttl_ms))
            }
            MetaOp::Release { blob, token } => {
                if self.leases.release(*blob, *token) {
                    crate::scope::released(&mut self.scope, *blob);
                }
                MetaReply::Done
            }
            MetaOp::ExtendAll { now_ms, ttl_ms } => {
                self.leases.extend_all(*now_ms, *ttl_ms);
                MetaReply::Done
            }
            MetaOp::SetAccess { blob, name, entries } => {
                crate::scope::set_access(&mut self.scope, *blob, name, entries);
                MetaReply::Done
            }
            MetaOp::DropVolume { blob } => {
                crate::scope::drop_volume(&mut self.scope, *blob);
                MetaReply::Done
            }
            MetaOp::Revoke { serial, name } => {
                crate::scope::revoke(&mut self.scope, serial, name);
                MetaReply::Done
            }
            MetaOp::AttachReader { blob, peer } => match crate::scope::reader(&mut self.scope, *blob, peer) {
                Ok(()) => MetaReply::Done,
                Err(why) => MetaReply::Refused(why),
            },
        }
    }

    fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        SNAPSHOT_MAGIC.put(&mut w);
        SNAPSHOT_VERSION.put(&mut w);
        self.tlt.as_deref().cloned().put(&mut w);
        let filling: Vec<RowFilling> = self
            .filling
            .iter()
            .map(|(row, m)| RowFilling { row: *row as u32, members: m.iter().copied().collect() })
            .collect();
        filling.put(&mut w);
        self.dead.iter().copied().collect::<Vec<TsId>>().put(&mut w);
        self.unsettled.iter().copied().collect::<Vec<TsId>>().put(&mut w);
        self.tlt_floor.put(&mut w);
        let floors: Vec<RowRef> =
            self.row_floors.iter().map(|(row, v)| RowRef { row: *row as u32, version: *v }).collect();
        floors.put(&mut w);
        self.leases.last_token().put(&mut w);
        self.leases.clock_ms().put(&mut w);
        let leases: Vec<LeaseEntry> = self
            .leases
            .iter()
            .map(|(blob, l)| LeaseEntry {
                blob: *blob,
                holder: l.holder.clone(),
                token: l.token,
                expires_ms: l.expires_ms,
            })
            .collect();
        leases.put(&mut w);
        self.scope.put(&mut w);
        w.buf.freeze()
    }

    fn decode(bytes: &[u8]) -> Result<MetaState, DecodeError> {
        let mut r = Reader::new(bytes);
        let magic = u64::get(&mut r)?;
        if magic != SNAPSHOT_MAGIC {
            return Err(DecodeError::BadValue { field: "metadata snapshot magic", value: magic });
        }
        let version = u32::get(&mut r)?;
        if version != SNAPSHOT_VERSION && version != 1 {
            return Err(DecodeError::BadValue { field: "metadata snapshot version", value: version as u64 });
        }
        let tlt: Option<Tlt> = Wire::get(&mut r)?;
        let tlt = tlt.map(Arc::new);
        if let Some(t) = &tlt {
            t.validate().map_err(|_| DecodeError::BadValue { field: "snapshot TLT", value: t.version })?;
        }
        let filling: Vec<RowFilling> = Wire::get(&mut r)?;
        let dead: Vec<TsId> = Wire::get(&mut r)?;
        let unsettled: Vec<TsId> = Wire::get(&mut r)?;
        let tlt_floor = u64::get(&mut r)?;
        let floors: Vec<RowRef> = Wire::get(&mut r)?;
        let last_token = u64::get(&mut r)?;
        let clock_ms = u64::get(&mut r)?;
        let leases: Vec<LeaseEntry> = Wire::get(&mut r)?;
        let scope = if version >= 2 { Scope::get(&mut r)? } else { Scope::default() };
        r.finish()?;
        Ok(MetaState {
            tlt,
            filling: filling.into_iter().map(|f| (f.row as usize, f.members.into_iter().collect())).collect(),
            dead: dead.into_iter().collect(),
            unsettled: unsettled.into_iter().collect(),
            tlt_floor,
            row_floors: floors.into_iter().map(|f| (f.row as usize, f.version)).collect(),
            leases: Leases::from_parts(
                leases
                    .into_iter()
                    .map(|l| (l.blob, Lease { holder: l.holder, token: l.token, expires_ms: l.expires_ms })),
                last_token,
                clock_ms,
            ),
            scope,
        })
    }
}

/// Reads of the replicated state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaQuery {
    /// The served table.
    Tlt,
    /// The live lease on a volume's blob at `now_ms`.
    Lease { blob: BlobId, now_ms: u64 },
}

impl MetaQuery {
    pub fn encode(&self) -> Bytes {
        let mut w = Writer::new();
        match self {
            MetaQuery::Tlt => 1u8.put(&mut w),
            MetaQuery::Lease { blob, now_ms } => {
                2u8.put(&mut w);
                blob.put(&mut w);
                now_ms.put(&mut w);
            }
        }
        w.buf.freeze()
    }

    pub fn decode(bytes: &[u8]) -> Result<MetaQuery, DecodeError> {
        let mut r = Reader::new(bytes);
        let q = match u8::get(&mut r)? {
            1 => MetaQuery::Tlt,
            2 => MetaQuery::Lease { blob: BlobId::get(&mut r)?, now_ms: u64::get(&mut r)? },
            t => return Err(DecodeError::BadValue { field: "metadata query", value: t as u64 }),
        };
        r.finish()?;
        Ok(q)
    }
}

/// The state as a replicated service.
#[derive(Default)]
pub struct MetaMachine {
    state: Mutex<MetaState>,
    plant: MetaPlant,
}

impl MetaMachine {
    pub fn new(plant: MetaPlant) -> MetaMachine {
        MetaMachine { state: Mutex::default(), plant }
    }

    fn state(&self) -> MutexGuard<'_, MetaState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// A copy of the applied state (for the leader's shell and status).
    pub fn view(&self) -> MetaState {
        self.state().clone()
    }

    /// Reads the applied state without copying it.
    pub fn read_state<R>(&self, f: impl FnOnce(&MetaState) -> R) -> R {
        f(&self.state())
    }

    /// Starts from `scope` (a single server's, loaded from its disk).
    pub fn set_scope(&self, scope: Scope) {
        self.state().scope = scope;
    }

    /// Applies an update here, outside any log: a single metadata server
    /// without a replica group keeps its state this way (in memory).
    pub fn apply_here(&self, op: &MetaOp) -> MetaReply {
        self.state().apply(op, self.plant)
    }
}

/// A lease update's key: its blob, folded to 64 bits.
fn blob_key(b: BlobId) -> u64 {
    (b.0 as u64) ^ ((b.0 >> 64) as u64).rotate_left(17)
}

impl Service for MetaMachine {
    type Op = MetaOp;
    type Snapshot = MetaState;

    fn decode(&self, bytes: &Bytes) -> Result<MetaOp, DecodeError> {
        MetaOp::decode(bytes)
    }

    fn footprint(&self, op: &MetaOp) -> Footprint {
        match op {
            MetaOp::Renew { blob, .. } => Footprint::exclusive(blob_key(*blob)),
            // These may change the scope table: its versions must be the
            // same tables on every replica (`scope`).
            MetaOp::Acquire { .. }
            | MetaOp::Release { .. }
            | MetaOp::SetAccess { .. }
            | MetaOp::DropVolume { .. }
            | MetaOp::Revoke { .. }
            | MetaOp::AttachReader { .. }
            | MetaOp::Reserve { .. }
            | MetaOp::Serve { .. }
            | MetaOp::ExtendAll { .. } => Footprint::Barrier,
        }
    }

    fn apply(&self, op: &MetaOp, _at: Position) -> Bytes {
        self.state().apply(op, self.plant).encode()
    }

    fn read(&self, query: &Bytes) -> Result<Bytes, String> {
        let q = MetaQuery::decode(query).map_err(|e| format!("malformed metadata query: {e}"))?;
        let st = self.state();
        let mut w = Writer::new();
        match q {
            MetaQuery::Tlt => st.tlt.as_deref().cloned().put(&mut w),
            MetaQuery::Lease { blob, now_ms } => st
                .leases
                .holder(blob, now_ms)
                .map(|l| LeaseEntry {
                    blob,
                    holder: l.holder.clone(),
                    token: l.token,
                    expires_ms: l.expires_ms,
                })
                .put(&mut w),
        }
        Ok(w.buf.freeze())
    }

    fn snapshot(&self) -> MetaState {
        self.view()
    }

    fn write_snapshot(&self, snap: &MetaState, out: &mut dyn FnMut(Bytes)) {
        out(snap.encode());
    }

    fn restore(&self, bytes: &Bytes) -> Result<(), DecodeError> {
        let st = MetaState::decode(bytes)?;
        *self.state() = st;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blizzard_core::tlt::{TltMember, TltRow};

    fn table(version: u64, row_versions: &[u64]) -> Tlt {
        Tlt {
            cluster_id: 9,
            tract_size: 1 << 20,
            replication: 2,
            version,
            members: (1..=3)
                .map(|i| TltMember { id: TsId(i), addr: format!("ts{i}"), domain: format!("d{i}") })
                .collect(),
            rows: row_versions.iter().map(|v| TltRow::new(*v, vec![0, 1])).collect(),
            sections: Vec::new(),
        }
    }

    fn at(i: u64) -> Position {
        Position { index: i, op: 0 }
    }

    fn run(m: &MetaMachine, i: u64, op: MetaOp) -> MetaReply {
        let bytes = op.encode();
        let decoded = m.decode(&bytes).expect("decodes");
        assert_eq!(decoded, op);
        MetaReply::decode(&m.apply(&decoded, at(i))).expect("reply decodes")
    }

    fn serve(tlt: Tlt) -> MetaOp {
        MetaOp::Serve { tlt, filling: vec![], dead: vec![], unsettled: vec![] }
    }

    #[test]
    fn a_served_table_must_follow_the_served_one() {
        let m = MetaMachine::default();
        assert_eq!(run(&m, 1, serve(table(10, &[5, 5]))), MetaReply::Done);
        assert!(matches!(run(&m, 2, serve(table(10, &[5, 5]))), MetaReply::Refused(_)), "same version");
        assert!(matches!(run(&m, 3, serve(table(11, &[4, 5]))), MetaReply::Refused(_)), "a row going back");
        let mut moved = table(11, &[5, 5]);
        moved.rows[0].members = vec![0, 2];
        assert!(
            matches!(run(&m, 4, serve(moved.clone())), MetaReply::Refused(_)),
            "new members, same version"
        );
        moved.rows[0].version = 6;
        assert_eq!(run(&m, 5, serve(moved)), MetaReply::Done);
        let st = m.view();
        assert_eq!(st.tlt.as_ref().map(|t| t.version), Some(11));
        assert_eq!((st.tlt_floor, st.row_floors.get(&0)), (11, Some(&6)), "served versions are floors too");
    }

    #[test]
    fn reserve_raises_the_floors_and_marks_members() {
        let m = MetaMachine::default();
        run(
            &m,
            1,
            MetaOp::Reserve {
                tlt_version: 20,
                rows: vec![RowRef { row: 1, version: 9 }],
                dead: vec![TsId(2)],
                unsettled: vec![TsId(1)],
            },
        );
        run(
            &m,
            2,
            MetaOp::Reserve {
                tlt_version: 15,
                rows: vec![RowRef { row: 1, version: 7 }],
                dead: vec![],
                unsettled: vec![TsId(3)],
            },
        );
        let st = m.view();
        assert_eq!((st.tlt_floor, st.row_floors.get(&1)), (20, Some(&9)));
        assert!(st.tlt.is_none());
        assert!(st.dead.is_empty(), "the dead set is replaced");
        assert_eq!(st.unsettled, [TsId(1), TsId(3)].into(), "members to settle accumulate");
    }

    #[test]
    fn leases_apply_through_the_machine() {
        let m = MetaMachine::default();
        let acquire = |holder: &str, now_ms| MetaOp::Acquire {
            blob: BlobId(5),
            holder: holder.into(),
            now_ms,
            ttl_ms: 10_000,
            take_over: false,
            peer: String::new(),
        };
        assert_eq!(
            run(&m, 1, acquire("a", 0)),
            MetaReply::Lease(Outcome::Granted { token: 1, expires_ms: 10_000 })
        );
        assert_eq!(
            run(&m, 2, acquire("b", 1)),
            MetaReply::Lease(Outcome::Held { holder: "a".into(), expires_ms: 10_000 })
        );
        let q = MetaQuery::Lease { blob: BlobId(5), now_ms: 2 }.encode();
        let got: Option<LeaseEntry> =
            blizzard_proto::codec::decode(&m.read(&q).expect("read")).expect("decodes");
        assert_eq!(got.map(|l| (l.holder, l.token)), Some(("a".to_string(), 1)));
        let renew =
            MetaOp::Renew { blob: BlobId(5), holder: "a".into(), token: 1, now_ms: 3, ttl_ms: 10_000 };
        assert_eq!(m.footprint(&renew), Footprint::exclusive(blob_key(BlobId(5))));
        assert_eq!(m.footprint(&acquire("a", 0)), Footprint::Barrier, "it may change the scope table");
        assert_eq!(m.footprint(&serve(table(1, &[1]))), Footprint::Barrier);
    }

    #[test]
    fn a_snapshot_restores_the_same_state() {
        let m = MetaMachine::default();
        run(
            &m,
            1,
            MetaOp::Serve {
                tlt: table(10, &[5, 5]),
                filling: vec![RowFilling { row: 1, members: vec![TsId(3)] }],
                dead: vec![TsId(2)],
                unsettled: vec![TsId(1)],
            },
        );
        run(
            &m,
            2,
            MetaOp::Reserve {
                tlt_version: 30,
                rows: vec![RowRef { row: 0, version: 8 }],
                dead: vec![TsId(2)],
                unsettled: vec![],
            },
        );
        run(
            &m,
            3,
            MetaOp::Acquire {
                blob: BlobId(7),
                holder: "h".into(),
                now_ms: 100,
                ttl_ms: 5000,
                take_over: false,
                peer: "nbd1".into(),
            },
        );
        run(
            &m,
            4,
            MetaOp::SetAccess {
                blob: BlobId(8),
                name: "db".into(),
                entries: vec![ScopeEntry { identity: "vm1".into(), read_only: true }],
            },
        );
        run(&m, 5, MetaOp::Revoke { serial: "0a".into(), name: "vm2".into() });
        run(&m, 6, MetaOp::AttachReader { blob: BlobId(8), peer: "nbd2".into() });
        assert_eq!(m.view().scope.version, 4);
        let mut bytes = Vec::new();
        m.write_snapshot(&m.snapshot(), &mut |b| bytes.extend_from_slice(&b));
        let other = MetaMachine::default();
        other.restore(&Bytes::from(bytes.clone())).expect("restores");
        assert_eq!(other.view(), m.view());
        // Damage is refused, leaving the state as it was.
        for cut in [0, 8, 12, bytes.len() - 1] {
            assert!(other.restore(&Bytes::from(bytes[..cut].to_vec())).is_err(), "cut at {cut}");
        }
        assert_eq!(other.view(), m.view());
    }

    #[test]
    fn malformed_updates_are_refused() {
        let long = "x".repeat(NAME_LEN_MAX + 1);
        for op in [
            MetaOp::Acquire {
                blob: BlobId(1),
                holder: long.clone(),
                now_ms: 0,
                ttl_ms: 1,
                take_over: false,
                peer: String::new(),
            },
            MetaOp::Acquire {
                blob: BlobId(1),
                holder: "h".into(),
                now_ms: 0,
                ttl_ms: 0,
                take_over: false,
                peer: String::new(),
            },
            MetaOp::Acquire {
                blob: BlobId(1),
                holder: "h".into(),
                now_ms: 0,
                ttl_ms: 1,
                take_over: false,
                peer: "x".repeat(IDENTITY_LEN_MAX + 1),
            },
            MetaOp::ExtendAll { now_ms: 0, ttl_ms: LEASE_TTL_MAX_MS + 1 },
            MetaOp::SetAccess { blob: BlobId(1), name: String::new(), entries: vec![] },
            MetaOp::SetAccess {
                blob: BlobId(1),
                name: "v".into(),
                entries: vec![ScopeEntry { identity: " x".into(), read_only: false }],
            },
            MetaOp::Revoke { serial: String::new(), name: "x".into() },
            MetaOp::Revoke { serial: "0".repeat(SERIAL_LEN_MAX + 1), name: "x".into() },
        ] {
            assert!(MetaOp::decode(&op.encode()).is_err(), "{op:?}");
        }
        let mut bad = table(1, &[1]);
        bad.rows[0].members = vec![0, 7];
        assert!(MetaOp::decode(&serve(bad).encode()).is_err(), "an invalid table");
        assert!(MetaOp::decode(&[9]).is_err());
        assert!(MetaOp::decode(&[]).is_err());
        let mut trailing = serve(table(1, &[1])).encode().to_vec();
        trailing.push(0);
        assert!(MetaOp::decode(&trailing).is_err(), "trailing bytes");
    }
}
