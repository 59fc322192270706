//! Linearizability checker for histories of a key-value map (Wing & Gong's
//! search with Lowe's memoization, as Porcupine does it).
//!
//! A [`History`] records each client operation's invocation and, if the
//! client heard back, its response and return value. [`check`] decides
//! whether some total order of the operations (1) respects real time, an
//! operation that responded before another was invoked comes first, and
//! (2) replays on a sequential map, starting with every key absent, to the
//! very return values the clients saw.
//!
//! Pending operations (no response: the client crashed or gave up) may
//! take effect at any instant after their invocation, possibly after the
//! same client's later operations (a timed-out request can still sit in a
//! replicated log), or never; their return value is unconstrained. Leaving
//! one out is the same as placing it after everything else, so a pending
//! operation's response is put at infinity and the search succeeds once
//! every completed operation is placed. Pending `Get`s change nothing and
//! are dropped up front.
//!
//! Times are compared strictly: a response and an invocation at the same
//! nanosecond are concurrent, so the checker never reports a violation
//! that hinges on a tie.
//!
//! The search is P-compositional: every operation touches one key and the
//! keys are independent, so the map is linearizable iff each key's
//! sub-history is (Herlihy & Wing's locality), and each key is searched on
//! its own, which keeps the state space small. Per key, a depth-first
//! search walks a doubly linked list of call and return entries sorted by
//! time: it linearizes the first call whose operation fits the current
//! value, lifts its two entries out of the list and starts over; meeting a
//! return entry means that operation had to be placed already, so it
//! backtracks. `(placed set, value)` pairs already explored are remembered
//! and never searched twice (Lowe). Four reductions keep pending
//! operations, which stay placeable forever, from multiplying the states;
//! each maps any successful order onto one the search still tries:
//! - values no operation compares against are merged into one (`classes`);
//! - a node is skipped when one with the same completed operations and
//!   value but a subset of its pending ones was explored (`Memo`);
//! - pending operations with the same effect are placed in invocation
//!   order only;
//! - a pending operation that would not change the value is not placed.
//!
//! A return that no value of the key could produce (a read of a value
//! nobody wrote, a `Cas` that swapped yet reports another value) is
//! reported before any search.
//!
//! Bounds: each search step (one attempt to place one operation in one
//! state, rejected or not) counts against `max_states_per_key`; past it
//! the key is reported [`Outcome::Unknown`] rather than searched for
//! hours. The memo grows by at most one entry of about `n / 64 + 2` words
//! per step for a key of `n` operations, so the limit bounds memory too.
//! A few hundred operations per key from a handful of concurrent clients
//! take milliseconds; refuting a key with hundreds of operations, many of
//! them pending, can take millions of steps.

use std::collections::{BTreeMap, HashMap, HashSet};

/// A limit that checks a few hundred operations per key with a wide margin
/// and still ends in seconds on a pathological history.
pub const MAX_STATES_PER_KEY_DEFAULT: u64 = 10_000_000;

/// An operation on the map; each touches exactly one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOp {
    /// Sets the value; returns the previous one.
    Put { key: Vec<u8>, value: Vec<u8> },
    /// Returns the value.
    Get { key: Vec<u8> },
    /// Removes the key; returns whether it existed.
    Delete { key: Vec<u8> },
    /// Sets the value to `new` (`None` removes it) if it is `expected`
    /// (`None`: absent); returns whether it did and the value after.
    Cas { key: Vec<u8>, expected: Option<Vec<u8>>, new: Option<Vec<u8>> },
}

impl KvOp {
    /// The key this operation touches.
    pub fn key(&self) -> &[u8] {
        match self {
            KvOp::Put { key, .. } | KvOp::Get { key } | KvOp::Delete { key } | KvOp::Cas { key, .. } => key,
        }
    }
}

/// What a completed operation returned; the variant matches its [`KvOp`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvRet {
    /// The previous value.
    Put(Option<Vec<u8>>),
    /// The value.
    Get(Option<Vec<u8>>),
    /// Whether the key existed.
    Delete(bool),
    /// Whether the value was swapped, and the value after the operation.
    Cas { swapped: bool, current: Option<Vec<u8>> },
}

/// One client operation: invoked at `invoked`, and answered at
/// `completed.0` with `completed.1`, or pending (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub client: u64,
    pub op: KvOp,
    /// Simulated time, nanoseconds.
    pub invoked: u64,
    /// Response time (nanoseconds, `>= invoked`) and return value.
    pub completed: Option<(u64, KvRet)>,
}

/// The operations of a run, in invocation-call order; an operation's id is
/// its index.
#[derive(Debug, Clone, Default)]
pub struct History {
    events: Vec<Event>,
}

impl History {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records that `client` invoked `op` at `at`; returns the operation's id.
    pub fn invoke(&mut self, client: u64, op: KvOp, at: u64) -> usize {
        self.events.push(Event { client, op, invoked: at, completed: None });
        self.events.len() - 1
    }

    /// Records the response to operation `id`. Panics on a second response,
    /// a response before the invocation or a return of the wrong kind:
    /// each is a bug in the harness, and a history built from it would be
    /// judged wrongly.
    pub fn complete(&mut self, id: usize, ret: KvRet, at: u64) {
        let event = &mut self.events[id];
        assert!(event.completed.is_none(), "operation {id} completed twice");
        assert!(
            at >= event.invoked,
            "operation {id} completed at {at}, before its invocation at {}",
            event.invoked
        );
        let kinds_match = matches!(
            (&event.op, &ret),
            (KvOp::Put { .. }, KvRet::Put(_))
                | (KvOp::Get { .. }, KvRet::Get(_))
                | (KvOp::Delete { .. }, KvRet::Delete(_))
                | (KvOp::Cas { .. }, KvRet::Cas { .. })
        );
        assert!(kinds_match, "operation {id} ({:?}) returned {ret:?}", event.op);
        event.completed = Some((at, ret));
    }

    pub fn events(&self) -> &[Event] {
        &self.events
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// The verdict on a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Linearizable,
    /// No order of this key's operations fits; the first such key in key
    /// order. `explanation` shows the longest consistent order found and
    /// the operations that could not go next, with times and returns.
    NotLinearizable {
        key: Vec<u8>,
        explanation: String,
    },
    /// No key was found non-linearizable, but this one (the first in key
    /// order) ran out of its search budget after `explored` steps.
    Unknown {
        key: Vec<u8>,
        explored: u64,
    },
}

impl Outcome {
    pub fn is_linearizable(&self) -> bool {
        matches!(self, Outcome::Linearizable)
    }
}

/// Checks `history`, searching each key for at most `max_states_per_key`
/// steps. Keys are checked in order; the first non-linearizable key is
/// reported, and a key out of budget is reported only if no later key
/// fails outright.
pub fn check(history: &History, max_states_per_key: u64) -> Outcome {
    let mut by_key: BTreeMap<&[u8], Vec<usize>> = BTreeMap::new();
    for (id, event) in history.events.iter().enumerate() {
        if event.completed.is_none() && matches!(event.op, KvOp::Get { .. }) {
            continue; // a pending read changes nothing and returns nothing
        }
        by_key.entry(event.op.key()).or_default().push(id);
    }
    let mut unknown = None;
    for (key, ids) in by_key {
        match check_key(history, key, &ids, max_states_per_key) {
            KeyVerdict::Linearizable => {}
            KeyVerdict::NotLinearizable(explanation) => {
                return Outcome::NotLinearizable { key: key.to_vec(), explanation }
            }
            KeyVerdict::Unknown(explored) => {
                unknown.get_or_insert(Outcome::Unknown { key: key.to_vec(), explored });
            }
        }
    }
    unknown.unwrap_or(Outcome::Linearizable)
}

enum KeyVerdict {
    Linearizable,
    NotLinearizable(String),
    Unknown(u64),
}

/// Interned value of one key: `ABSENT` is `None`, others index `Values`.
type Val = u32;
const ABSENT: Val = 0;
/// In the search, every value that no op compares against: see `classes`.
const UNREAD: Val = Val::MAX;

/// The distinct values of one key's operations and returns.
#[derive(Default)]
struct Values<'h> {
    ids: HashMap<&'h [u8], Val>,
}

impl<'h> Values<'h> {
    fn id(&mut self, value: Option<&'h [u8]>) -> Val {
        let Some(bytes) = value else { return ABSENT };
        let next = Val::try_from(self.ids.len() + 1)
            .ok()
            .filter(|&id| id != UNREAD)
            .expect("fewer than 2^32 - 1 values per key");
        *self.ids.entry(bytes).or_insert(next)
    }
}

/// What an operation does to the value, whatever it returned.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Effect {
    Put(Val),
    Get,
    Delete,
    Cas { expected: Val, new: Val },
}

impl Effect {
    fn next(self, state: Val) -> Val {
        match self {
            Effect::Put(value) => value,
            Effect::Get => state,
            Effect::Delete => ABSENT,
            Effect::Cas { expected, new } => {
                if state == expected {
                    new
                } else {
                    state
                }
            }
        }
    }
}

/// Which values before the operation explain what it returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Need {
    /// Pending: any value.
    Any,
    /// Exactly this value (possibly `ABSENT`).
    Value(Val),
    /// Some value, not absent (a `Delete` that returned true).
    Present,
    /// None at all (a swapped `Cas` whose value after is not its `new`;
    /// a failed one that saw its `expected`).
    Impossible,
}

impl Need {
    fn admits(self, state: Val) -> bool {
        match self {
            Need::Any => true,
            Need::Value(value) => state == value,
            Need::Present => state != ABSENT,
            Need::Impossible => false,
        }
    }
}

/// One operation of the key under check.
struct KeyOp {
    /// Its id in the history.
    id: usize,
    effect: Effect,
    need: Need,
    invoked: u64,
    /// Response time; `None` while pending.
    responded: Option<u64>,
}

impl KeyOp {
    /// The value after this operation, if it can go when the value is `state`.
    fn step(&self, state: Val) -> Option<Val> {
        self.need.admits(state).then(|| self.effect.next(state))
    }

    /// Which value it writes, if any (for explanations).
    fn writes(&self) -> Option<Val> {
        match self.effect {
            Effect::Put(value) => Some(value),
            Effect::Cas { new, .. } if new != ABSENT => Some(new),
            _ => None,
        }
    }
}

fn key_op<'h>(id: usize, event: &'h Event, values: &mut Values<'h>) -> KeyOp {
    let (effect, need) = match &event.op {
        KvOp::Put { value, .. } => {
            let need = match &event.completed {
                None => Need::Any,
                Some((_, KvRet::Put(prev))) => Need::Value(values.id(prev.as_deref())),
                Some(_) => Need::Impossible,
            };
            (Effect::Put(values.id(Some(value))), need)
        }
        KvOp::Get { .. } => {
            let need = match &event.completed {
                None => Need::Any,
                Some((_, KvRet::Get(seen))) => Need::Value(values.id(seen.as_deref())),
                Some(_) => Need::Impossible,
            };
            (Effect::Get, need)
        }
        KvOp::Delete { .. } => {
            let need = match &event.completed {
                None => Need::Any,
                Some((_, KvRet::Delete(true))) => Need::Present,
                Some((_, KvRet::Delete(false))) => Need::Value(ABSENT),
                Some(_) => Need::Impossible,
            };
            (Effect::Delete, need)
        }
        KvOp::Cas { expected, new, .. } => {
            let expected = values.id(expected.as_deref());
            let new = values.id(new.as_deref());
            let need = match &event.completed {
                None => Need::Any,
                Some((_, KvRet::Cas { swapped, current })) => {
                    let current = values.id(current.as_deref());
                    match (*swapped, current == new, current == expected) {
                        (true, true, _) => Need::Value(expected),
                        (false, _, false) => Need::Value(current),
                        (true, false, _) | (false, _, true) => Need::Impossible,
                    }
                }
                Some(_) => Need::Impossible,
            };
            (Effect::Cas { expected, new }, need)
        }
    };
    KeyOp { id, effect, need, invoked: event.invoked, responded: event.completed.as_ref().map(|(at, _)| *at) }
}

fn check_key(history: &History, key: &[u8], ids: &[usize], max_steps: u64) -> KeyVerdict {
    let mut values = Values::default();
    let ops: Vec<KeyOp> = ids.iter().map(|&id| key_op(id, &history.events[id], &mut values)).collect();
    let names = Names::new(history, &ops, &values);

    // A return no value of this key could produce (a value nobody wrote,
    // an impossible combination) fails without a search, and says so.
    let written: HashSet<Val> = ops.iter().filter_map(KeyOp::writes).collect();
    for (index, op) in ops.iter().enumerate() {
        let possible = match op.need {
            Need::Any => true,
            Need::Value(value) => value == ABSENT || written.contains(&value),
            Need::Present => !written.is_empty(),
            Need::Impossible => false,
        };
        if !possible {
            return KeyVerdict::NotLinearizable(format!(
                "key {}: {} returned what no value of the key could produce: it {}, and the key only \
                 ever holds absent or a value one of its {} ops writes",
                show(Some(key)),
                names.op(index),
                names.need(op.need),
                ops.len(),
            ));
        }
    }

    match search(&classes(&ops), max_steps) {
        Search::Linearizable => KeyVerdict::Linearizable,
        Search::Unknown(explored) => KeyVerdict::Unknown(explored),
        Search::NotLinearizable { deepest } => {
            KeyVerdict::NotLinearizable(explain(key, &ops, &names, &deepest))
        }
    }
}

/// The ops with every value no op compares against merged into `UNREAD`.
/// A value is compared against when a completed op needs exactly it (a
/// read, a Put's previous value, a Cas's expected or seen value) or a Cas
/// expects it. Values outside that set are told apart by no admission test
/// and no effect (a Put or Delete overwrites whatever was there; a Cas
/// only compares with its expected value), so merging them changes no
/// verdict, and a key's many writes nobody read (pending ones above all)
/// become one state instead of one each.
fn classes(ops: &[KeyOp]) -> Vec<KeyOp> {
    let mut compared: HashSet<Val> = HashSet::from([ABSENT]);
    for op in ops {
        if let (Need::Value(value), Some(_)) = (op.need, op.responded) {
            compared.insert(value);
        }
        if let Effect::Cas { expected, .. } = op.effect {
            compared.insert(expected);
        }
    }
    let class = |value: Val| if compared.contains(&value) { value } else { UNREAD };
    ops.iter()
        .map(|op| KeyOp {
            id: op.id,
            effect: match op.effect {
                Effect::Put(value) => Effect::Put(class(value)),
                Effect::Cas { expected, new } => Effect::Cas { expected, new: class(new) },
                other => other,
            },
            need: match op.need {
                Need::Value(value) => Need::Value(class(value)),
                other => other,
            },
            invoked: op.invoked,
            responded: op.responded,
        })
        .collect()
}

enum Search {
    Linearizable,
    /// The consistent order found that places the most completed ops
    /// (indices into the key's ops).
    NotLinearizable {
        deepest: Vec<usize>,
    },
    Unknown(u64),
}

const NIL: usize = usize::MAX;
const HEAD: usize = 0;

/// The time-ordered list of call and return entries, with removal and
/// reinsertion in O(1) (dancing links): node 0 is the head, node
/// `1 + 2 * op` is an op's call and `2 + 2 * op` its return.
struct Entries {
    next: Vec<usize>,
    prev: Vec<usize>,
}

impl Entries {
    fn new(ops: &[KeyOp]) -> Self {
        // Sorted by time; at equal times calls first (concurrent); pending
        // returns after everything.
        let mut order: Vec<(u8, u64, u8, usize)> = Vec::with_capacity(2 * ops.len());
        for (index, op) in ops.iter().enumerate() {
            order.push((0, op.invoked, 0, 1 + 2 * index));
            match op.responded {
                Some(at) => order.push((0, at, 1, 2 + 2 * index)),
                None => order.push((1, 0, 1, 2 + 2 * index)),
            }
        }
        order.sort_unstable();
        // Within each run of calls (the ops that become candidates
        // together) completed ops go first: the search then tries orders
        // with fewer pending ops first, which the memo's dominance check
        // (`Memo::visit`) turns into pruning of the orders with more.
        let mut nodes: Vec<usize> = order.iter().map(|&(_, _, _, node)| node).collect();
        for run in nodes.chunk_by_mut(|a, b| a % 2 == 1 && b % 2 == 1) {
            run.sort_by_key(|&node| ops[(node - 1) / 2].responded.is_none());
        }
        let mut next = vec![NIL; 1 + 2 * ops.len()];
        let mut prev = vec![NIL; 1 + 2 * ops.len()];
        let mut last = HEAD;
        for node in nodes {
            next[last] = node;
            prev[node] = last;
            last = node;
        }
        Entries { next, prev }
    }

    fn unlink(&mut self, node: usize) {
        let (before, after) = (self.prev[node], self.next[node]);
        self.next[before] = after;
        if after != NIL {
            self.prev[after] = before;
        }
    }

    /// Undoes `unlink(node)`; undos must come in reverse order.
    fn relink(&mut self, node: usize) {
        let (before, after) = (self.prev[node], self.next[node]);
        self.next[before] = node;
        if after != NIL {
            self.prev[after] = node;
        }
    }

    fn lift(&mut self, op: usize) {
        self.unlink(1 + 2 * op);
        self.unlink(2 + 2 * op);
    }

    fn unlift(&mut self, op: usize) {
        self.relink(2 + 2 * op);
        self.relink(1 + 2 * op);
    }
}

/// The explored nodes of one key's search: `(completed ops placed, value)`
/// maps to the sets of pending ops placed with them. A node is dominated by
/// an explored one with the same completed set and value and a subset of
/// its pending ops: whatever order finishes from the dominated node also
/// finishes from the other (it just leaves those pending ops out), so the
/// dominated node is skipped. With no pending ops this is Lowe's memo.
struct Memo {
    /// Words per pending set.
    pending_words: usize,
    /// Pending sets, `pending_words` words each, none a subset of another.
    explored: HashMap<Vec<u64>, Vec<u64>>,
}

impl Memo {
    /// Whether the node is new (not dominated); if so, records it.
    fn visit(&mut self, completed_and_value: &[u64], pending: &[u64]) -> bool {
        let Some(sets) = self.explored.get_mut(completed_and_value) else {
            self.explored.insert(completed_and_value.to_vec(), pending.to_vec());
            return true;
        };
        if self.pending_words == 0 {
            return false; // no pending ops: the plain memo
        }
        let is_subset = |small: &[u64], big: &[u64]| small.iter().zip(big).all(|(s, b)| s & !b == 0);
        if sets.chunks(self.pending_words).any(|set| is_subset(set, pending)) {
            return false;
        }
        // Sets the new one dominates are no longer needed.
        let kept: Vec<u64> = sets
            .chunks(self.pending_words)
            .filter(|set| !is_subset(pending, set))
            .flatten()
            .copied()
            .collect();
        *sets = kept;
        sets.extend_from_slice(pending);
        true
    }
}

/// One key's op in the search's bitsets: completed and pending ops are
/// numbered apart, so the memo can tell them apart cheaply.
#[derive(Clone, Copy)]
struct Bit {
    pending: bool,
    word: usize,
    mask: u64,
}

fn search(ops: &[KeyOp], max_steps: u64) -> Search {
    let mut entries = Entries::new(ops);
    let (mut completed_count, mut pending_count) = (0, 0);
    let bits: Vec<Bit> = ops
        .iter()
        .map(|op| {
            let pending = op.responded.is_none();
            let count = if pending { &mut pending_count } else { &mut completed_count };
            let bit = Bit { pending, word: *count / 64, mask: 1 << (*count % 64) };
            *count += 1;
            bit
        })
        .collect();
    let completed_words = completed_count.div_ceil(64);
    // The completed ops placed, then the value: the memo's key.
    let mut placed_completed = vec![0u64; completed_words + 1];
    let mut placed_pending = vec![0u64; pending_count.div_ceil(64)];
    // Pending ops with the same effect are interchangeable once invoked,
    // so they are placed in invocation order: each only after the one
    // before it (`Entries` lists calls by time). A successful order that
    // used them otherwise still succeeds with them renamed.
    let mut chain_prev: Vec<Option<usize>> = vec![None; ops.len()];
    let mut last_with: HashMap<Effect, usize> = HashMap::new();
    let mut pending_by_time: Vec<usize> = (0..ops.len()).filter(|&op| bits[op].pending).collect();
    pending_by_time.sort_by_key(|&op| (ops[op].invoked, op));
    for op in pending_by_time {
        chain_prev[op] = last_with.insert(ops[op].effect, op);
    }
    let mut memo = Memo { pending_words: placed_pending.len(), explored: HashMap::new() };
    let flip = |completed: &mut [u64], pending: &mut [u64], op: usize| {
        let bit = bits[op];
        let set = if bit.pending { pending } else { completed };
        set[bit.word] ^= bit.mask;
    };
    // Placed ops and the value before each.
    let mut stack: Vec<(usize, Val)> = Vec::with_capacity(ops.len());
    let mut unplaced_completed = completed_count;
    let mut deepest: Vec<usize> = Vec::new();
    let mut deepest_unplaced = unplaced_completed;
    let mut state = ABSENT;
    let mut steps = 0u64;
    let mut node = entries.next[HEAD];
    loop {
        if unplaced_completed == 0 {
            return Search::Linearizable; // pending ops left over go last, or never
        }
        let is_call = node != NIL && node % 2 == 1;
        if is_call {
            let op = (node - 1) / 2;
            steps += 1;
            if steps > max_steps {
                return Search::Unknown(steps - 1);
            }
            // A pending op that would not change the value is never worth
            // placing: leaving it out keeps every option.
            let waits =
                chain_prev[op].is_some_and(|prev| placed_pending[bits[prev].word] & bits[prev].mask == 0);
            let step = ops[op].step(state).filter(|&after| !(bits[op].pending && (after == state || waits)));
            if let Some(after) = step {
                flip(&mut placed_completed, &mut placed_pending, op);
                placed_completed[completed_words] = u64::from(after);
                if memo.visit(&placed_completed, &placed_pending) {
                    stack.push((op, state));
                    state = after;
                    entries.lift(op);
                    if !bits[op].pending {
                        unplaced_completed -= 1;
                    }
                    // The deepest order by completed ops placed: at it,
                    // no completed candidate fits (`explain`).
                    if unplaced_completed < deepest_unplaced {
                        deepest = stack.iter().map(|&(placed_op, _)| placed_op).collect();
                        deepest_unplaced = unplaced_completed;
                    }
                    node = entries.next[HEAD];
                    continue;
                }
                flip(&mut placed_completed, &mut placed_pending, op);
            }
            node = entries.next[node];
        } else {
            // A return entry (or the list's end): its op should have been
            // placed by now, so undo the last choice and try the next call.
            let Some((op, before)) = stack.pop() else {
                return Search::NotLinearizable { deepest };
            };
            state = before;
            flip(&mut placed_completed, &mut placed_pending, op);
            entries.unlift(op);
            if !bits[op].pending {
                unplaced_completed += 1;
            }
            node = entries.next[1 + 2 * op];
        }
    }
}

/// How many ops of the longest order and how many candidates to show.
const EXPLAIN_TAIL_MAX: usize = 6;
const EXPLAIN_NEXT_MAX: usize = 6;

fn explain(key: &[u8], ops: &[KeyOp], names: &Names, deepest: &[usize]) -> String {
    // The search ran on merged values; replaying the order on the real ones
    // names the value it leaves.
    let state = deepest.iter().fold(ABSENT, |state, &op| ops[op].effect.next(state));
    let completed = ops.iter().filter(|op| op.responded.is_some()).count();
    let mut lines = vec![format!(
        "key {}: no order of its {} ops ({} completed, {} pending) fits both real time and a map",
        show(Some(key)),
        ops.len(),
        completed,
        ops.len() - completed,
    )];
    let placed_completed = deepest.iter().filter(|&&op| ops[op].responded.is_some()).count();
    lines.push(format!(
        "longest consistent order found places {} of the {} completed ops and leaves {}{}",
        placed_completed,
        completed,
        names.value(state),
        if deepest.is_empty() { "" } else { "; it ends:" },
    ));
    let tail = deepest.len().saturating_sub(EXPLAIN_TAIL_MAX);
    if tail > 0 {
        lines.push(format!("  ... {tail} earlier ops"));
    }
    for &op in &deepest[tail..] {
        lines.push(format!("  {}", names.op(op)));
    }

    // The completed ops that could go next: not placed, and invoked before
    // every other unplaced op's response. At the deepest order (by
    // completed ops placed) none of them fits the value: one that fitted
    // would have made a deeper order. Pending ops always fit; placing them
    // did not help, which the search tried.
    let mut is_placed = vec![false; ops.len()];
    for &op in deepest {
        is_placed[op] = true;
    }
    let first_response = (0..ops.len())
        .filter(|&op| !is_placed[op])
        .filter_map(|op| ops[op].responded)
        .min()
        .unwrap_or(u64::MAX);
    let mut next: Vec<usize> = (0..ops.len())
        .filter(|&op| !is_placed[op] && ops[op].responded.is_some() && ops[op].invoked <= first_response)
        .collect();
    next.sort_by_key(|&op| (ops[op].invoked, op));
    let pending_next = (0..ops.len())
        .filter(|&op| !is_placed[op] && ops[op].responded.is_none() && ops[op].invoked <= first_response)
        .count();
    let pending_note = match pending_next {
        0 => String::new(),
        n => format!(" (nor does placing any of the {n} pending ops invoked by then first)"),
    };
    lines.push(format!(
        "then none of the {} completed ops that may go next fits {}{pending_note}:",
        next.len(),
        names.value(state)
    ));
    for &op in next.iter().take(EXPLAIN_NEXT_MAX) {
        let why = if ops[op].need.admits(state) {
            "fits, but every order continuing with it fails later".to_string()
        } else {
            names.need(ops[op].need)
        };
        lines.push(format!("  {}: {}", names.op(op), why));
    }
    if next.len() > EXPLAIN_NEXT_MAX {
        lines.push(format!("  ... {} more", next.len() - EXPLAIN_NEXT_MAX));
    }
    lines.join("\n")
}

/// Renders one key's ops and interned values for explanations.
struct Names<'h> {
    events: Vec<&'h Event>,
    /// The history id of each op, by index.
    ids: Vec<usize>,
    /// Interned value to its bytes (index 0, absent, is `None`).
    bytes: Vec<Option<&'h [u8]>>,
    /// Interned value to the history ids of the ops that write it.
    writers: HashMap<Val, Vec<usize>>,
}

impl<'h> Names<'h> {
    fn new(history: &'h History, ops: &[KeyOp], values: &Values<'h>) -> Self {
        let mut bytes = vec![None; values.ids.len() + 1];
        for (&value, &id) in &values.ids {
            bytes[id as usize] = Some(value);
        }
        let mut writers: HashMap<Val, Vec<usize>> = HashMap::new();
        for op in ops {
            if let Some(value) = op.writes() {
                writers.entry(value).or_default().push(op.id);
            }
        }
        Names {
            events: ops.iter().map(|op| &history.events[op.id]).collect(),
            ids: ops.iter().map(|op| op.id).collect(),
            bytes,
            writers,
        }
    }

    fn value(&self, value: Val) -> String {
        show(self.bytes.get(value as usize).copied().flatten())
    }

    /// `#id client c Op -> return [invoked, responded]`.
    fn op(&self, index: usize) -> String {
        let event = self.events[index];
        let op = match &event.op {
            KvOp::Put { value, .. } => format!("Put {}", show(Some(value))),
            KvOp::Get { .. } => "Get".to_string(),
            KvOp::Delete { .. } => "Delete".to_string(),
            KvOp::Cas { expected, new, .. } => {
                format!("Cas {} -> {}", show(expected.as_deref()), show(new.as_deref()))
            }
        };
        let id = self.ids[index];
        match &event.completed {
            None => format!("#{id} client {} {op} pending [{}, -]", event.client, event.invoked),
            Some((at, ret)) => {
                let ret = match ret {
                    KvRet::Put(prev) => format!("prev {}", show(prev.as_deref())),
                    KvRet::Get(seen) => show(seen.as_deref()),
                    KvRet::Delete(existed) => format!("existed {existed}"),
                    KvRet::Cas { swapped, current } => {
                        let verb = if *swapped { "swapped" } else { "failed" };
                        format!("{verb}, now {}", show(current.as_deref()))
                    }
                };
                format!("#{id} client {} {op} = {ret} [{}, {at}]", event.client, event.invoked)
            }
        }
    }

    fn need(&self, need: Need) -> String {
        match need {
            Need::Any => "fits any value".to_string(),
            Need::Present => "needs the key present".to_string(),
            Need::Impossible => "returned a combination no value explains".to_string(),
            Need::Value(value) => {
                let by = match self.writers.get(&value) {
                    _ if value == ABSENT => String::new(),
                    None => " (written by no op)".to_string(),
                    Some(ids) => {
                        let shown: Vec<String> = ids.iter().take(3).map(|id| format!("#{id}")).collect();
                        let more = if ids.len() > 3 { ", ..." } else { "" };
                        format!(" (written by {}{more})", shown.join(", "))
                    }
                };
                format!("needs {}{by}", self.value(value))
            }
        }
    }
}

/// A value as escaped ASCII in quotes, cut at 32 bytes; `absent` for `None`.
fn show(value: Option<&[u8]>) -> String {
    const SHOW_BYTES_MAX: usize = 32;
    match value {
        None => "absent".to_string(),
        Some(bytes) if bytes.len() > SHOW_BYTES_MAX => {
            format!("\"{}\"...({} bytes)", bytes[..SHOW_BYTES_MAX].escape_ascii(), bytes.len())
        }
        Some(bytes) => format!("\"{}\"", bytes.escape_ascii()),
    }
}

#[cfg(test)]
mod tests;
