//! The commutativity scheduler's plan (the paper's Algorithm 1, §6.2, as
//! a dependency graph): which earlier operations each operation of a run
//! of committed operations must wait for.
//!
//! Rule: operation `i` waits for every earlier operation `j` it does not
//! commute with ([`conflicts`]). Applying the run in any order that
//! respects these edges gives, on every replica, the state and replies of
//! applying it in log order, as long as the service declared commutativity
//! honestly (two operations it says commute give the same state and
//! replies in either order). Commuting operations run concurrently.
//!
//! The paper's scheduler starts the head of its queue only once it
//! commutes with everything executing; a graph lets an operation behind a
//! blocked one start as soon as its own conflicts are done.
//!
//! [`groups`] computes what execution needs directly: the connected
//! components of the conflict relation (operations of different groups
//! commute pairwise), in one pass with a union-find, without building the
//! graph's edges (the plan is the specification; the groups are cheap
//! enough to compute for every run: a map update costs about as much as
//! planning it).
//!
//! Pure: no I/O, no clocks; `machine::exec` runs the groups.

use std::collections::BTreeMap;

use smallvec::SmallVec;

use crate::service::{Access, Footprint};

/// For each operation of a run, the earlier operations it waits for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub waits_for: Vec<SmallVec<[u32; 4]>>,
}

impl Plan {
    /// A plan that applies everything in log order (serial apply).
    pub fn serial(n: usize) -> Plan {
        Plan {
            waits_for: (0..n)
                .map(|i| if i == 0 { SmallVec::new() } else { smallvec::smallvec![i as u32 - 1] })
                .collect(),
        }
    }

    /// A plan with no edges at all: everything at once. Wrong for any
    /// service with conflicting operations; the simulator plants it to
    /// show its checkers catch a scheduler that ignores conflicts.
    pub fn unordered(n: usize) -> Plan {
        Plan { waits_for: vec![SmallVec::new(); n] }
    }

    /// For each operation, the later operations that wait for it.
    pub fn dependents(&self) -> Vec<SmallVec<[u32; 4]>> {
        let mut out = vec![SmallVec::new(); self.waits_for.len()];
        for (i, ws) in self.waits_for.iter().enumerate() {
            for &j in ws {
                out[j as usize].push(i as u32);
            }
        }
        out
    }
}

/// Whether two footprints' operations must keep their log order
/// (`Callback` pairs are decided by the service, not here).
pub fn keys_conflict(a: &[(u64, Access)], b: &[(u64, Access)]) -> bool {
    a.iter().any(|(ka, xa)| {
        b.iter().any(|(kb, xb)| ka == kb && (*xa == Access::Exclusive || *xb == Access::Exclusive))
    })
}

/// Whether `a` and `b` (in either order) must keep their log order.
pub fn conflicts<O>(
    a: &O,
    fa: &Footprint,
    b: &O,
    fb: &Footprint,
    commutes: &impl Fn(&O, &O) -> bool,
) -> bool {
    match (fa, fb) {
        (Footprint::Barrier, _) | (_, Footprint::Barrier) => true,
        (Footprint::Keys(ka), Footprint::Keys(kb)) => keys_conflict(ka, kb),
        _ => !commutes(a, b),
    }
}

/// Per key: the last exclusive access, and the shared accesses since.
#[derive(Default)]
struct KeyState {
    exclusive: Option<u32>,
    shared: SmallVec<[u32; 4]>,
}

/// Plans a run of operations (`footprints[i]` is operation `i`'s).
/// Costs O(keys) per keyed operation, plus one `commutes` call per pair
/// involving a `Callback` operation, and one edge per operation since the
/// last barrier for a barrier.
pub fn plan<O>(ops: &[O], footprints: &[Footprint], commutes: impl Fn(&O, &O) -> bool) -> Plan {
    assert_eq!(ops.len(), footprints.len(), "one footprint per operation");
    let mut keys: BTreeMap<u64, KeyState> = BTreeMap::new();
    let mut last_barrier: Option<u32> = None;
    // Operations since the last barrier (a barrier waits for all of them).
    let mut since_barrier: Vec<u32> = Vec::new();
    // `Callback` operations since the last barrier (every later operation
    // asks the service about each).
    let mut callbacks: Vec<u32> = Vec::new();
    let mut waits_for: Vec<SmallVec<[u32; 4]>> = Vec::with_capacity(ops.len());

    for (i, fp) in footprints.iter().enumerate() {
        let me = i as u32;
        let mut w: SmallVec<[u32; 4]> = SmallVec::new();
        match fp {
            Footprint::Barrier => {
                w.extend(since_barrier.iter().copied());
                if since_barrier.is_empty() {
                    w.extend(last_barrier);
                }
                keys.clear();
                callbacks.clear();
                since_barrier.clear();
                last_barrier = Some(me);
                waits_for.push(w);
                continue;
            }
            Footprint::Keys(ks) => {
                for (k, access) in ks {
                    let st = keys.entry(*k).or_default();
                    w.extend(st.exclusive);
                    if *access == Access::Exclusive {
                        w.extend(st.shared.iter().copied());
                        st.exclusive = Some(me);
                        st.shared.clear();
                    } else {
                        st.shared.push(me);
                    }
                }
                for &c in &callbacks {
                    if conflicts(&ops[c as usize], &footprints[c as usize], &ops[i], fp, &commutes) {
                        w.push(c);
                    }
                }
            }
            Footprint::Callback => {
                for &j in &since_barrier {
                    if conflicts(&ops[j as usize], &footprints[j as usize], &ops[i], fp, &commutes) {
                        w.push(j);
                    }
                }
                callbacks.push(me);
            }
        }
        // After a barrier, everything waits for it (directly: the barrier
        // has no later keyed state to carry the edge).
        w.extend(last_barrier);
        // A footprint naming one key twice must not make the op wait for
        // itself.
        w.retain(|j| *j != me);
        w.sort_unstable();
        w.dedup();
        since_barrier.push(me);
        waits_for.push(w);
    }
    Plan { waits_for }
}

/// A key's accesses so far in a run (for [`groups`]).
#[derive(Default)]
struct KeyGroup {
    /// The first operation that touched the key.
    first: Option<u32>,
    /// Whether any access was exclusive: then every access of the key is
    /// in one group (each conflicts with the exclusive one).
    exclusive: bool,
    /// Shared accesses before the first exclusive one.
    shared: SmallVec<[u32; 4]>,
}

/// Keys are already hashes: the identity is the best hash of them.
#[derive(Default)]
struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) ^ (self.0 >> 56) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

/// For each operation of a run, the id of its group (the lowest operation
/// in it): operations in different groups commute pairwise, and with the
/// order kept inside each group any interleaving of groups is equivalent
/// to log order. A run with a barrier is one group.
pub fn groups<O>(ops: &[O], footprints: &[Footprint], commutes: impl Fn(&O, &O) -> bool) -> Vec<u32> {
    assert_eq!(ops.len(), footprints.len(), "one footprint per operation");
    let n = ops.len();
    if footprints.iter().any(|f| matches!(f, Footprint::Barrier)) {
        return vec![0; n];
    }
    let mut parent: Vec<u32> = (0..n as u32).collect();
    fn find(parent: &mut [u32], mut x: u32) -> u32 {
        while parent[x as usize] != x {
            let p = parent[x as usize];
            parent[x as usize] = parent[p as usize];
            x = p;
        }
        x
    }
    fn union(parent: &mut [u32], a: u32, b: u32) {
        let (a, b) = (find(parent, a), find(parent, b));
        if a != b {
            let (lo, hi) = if a < b { (a, b) } else { (b, a) };
            parent[hi as usize] = lo;
        }
    }
    // Only looked up, never iterated: the hasher cannot change an outcome.
    let mut keys: std::collections::HashMap<u64, KeyGroup, std::hash::BuildHasherDefault<KeyHasher>> =
        std::collections::HashMap::default();
    let mut callbacks: Vec<u32> = Vec::new();
    for (i, fp) in footprints.iter().enumerate() {
        let me = i as u32;
        match fp {
            Footprint::Barrier => {}
            Footprint::Keys(ks) => {
                for (k, access) in ks {
                    let st = keys.entry(*k).or_default();
                    if st.exclusive {
                        let first = st.first.unwrap_or(me);
                        union(&mut parent, me, first);
                    } else if *access == Access::Exclusive {
                        st.exclusive = true;
                        let earlier: SmallVec<[u32; 4]> =
                            st.first.into_iter().chain(st.shared.drain(..)).collect();
                        for j in earlier {
                            union(&mut parent, me, j);
                        }
                    } else {
                        st.shared.push(me);
                    }
                    st.first.get_or_insert(me);
                }
                for &c in &callbacks {
                    if conflicts(&ops[c as usize], &footprints[c as usize], &ops[i], fp, &commutes) {
                        union(&mut parent, me, c);
                    }
                }
            }
            Footprint::Callback => {
                for j in 0..me {
                    if conflicts(&ops[j as usize], &footprints[j as usize], &ops[i], fp, &commutes) {
                        union(&mut parent, me, j);
                    }
                }
                callbacks.push(me);
            }
        }
    }
    (0..n as u32).map(|i| find(&mut parent, i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fx(k: u64) -> Footprint {
        Footprint::exclusive(k)
    }

    fn fs(k: u64) -> Footprint {
        Footprint::shared(k)
    }

    #[test]
    fn a_key_orders_its_writers_and_nothing_else() {
        let f = [fx(1), fx(2), fx(1), fs(3), fs(3), fx(3)];
        let p = plan(&[(); 6], &f, |_, _| false);
        assert_eq!(p.waits_for[0].as_slice(), &[] as &[u32]);
        assert_eq!(p.waits_for[1].as_slice(), &[] as &[u32], "another key: no wait");
        assert_eq!(p.waits_for[2].as_slice(), &[0], "same key: after the first");
        assert_eq!(p.waits_for[3].as_slice(), &[] as &[u32]);
        assert_eq!(p.waits_for[4].as_slice(), &[] as &[u32], "shared accesses commute");
        assert_eq!(p.waits_for[5].as_slice(), &[3, 4], "exclusive waits for every shared one");
    }

    #[test]
    fn a_barrier_waits_for_all_and_all_wait_for_it() {
        let f = [fx(1), fx(2), Footprint::Barrier, fx(1), fx(9), Footprint::Barrier, Footprint::Barrier];
        let p = plan(&[(); 7], &f, |_, _| false);
        assert_eq!(p.waits_for[2].as_slice(), &[0, 1]);
        assert_eq!(p.waits_for[3].as_slice(), &[2]);
        assert_eq!(p.waits_for[4].as_slice(), &[2]);
        assert_eq!(p.waits_for[5].as_slice(), &[3, 4]);
        assert_eq!(p.waits_for[6].as_slice(), &[5], "back-to-back barriers chain");
    }

    #[test]
    fn callbacks_ask_the_service() {
        // Ops are numbers; the service says odd and even commute.
        let ops = [1u32, 2, 3, 4];
        let f = [Footprint::Callback, Footprint::Callback, Footprint::Callback, fx(7)];
        let p = plan(&ops, &f, |a, b| (a % 2) != (b % 2));
        assert_eq!(p.waits_for[1].as_slice(), &[] as &[u32]);
        assert_eq!(p.waits_for[2].as_slice(), &[0]);
        assert_eq!(p.waits_for[3].as_slice(), &[1], "a keyed op asks about earlier callback ops");
    }

    /// The model the plan must honour, checked directly: a schedule is a
    /// topological order of the plan; every pair that conflicts keeps its
    /// log order in every such schedule (so a plan that respects edges is
    /// equivalent to log order for an honest service).
    fn any_footprint() -> impl Strategy<Value = Footprint> {
        prop_oneof![
            8 => (0u64..6, any::<bool>()).prop_map(|(k, x)| if x { fx(k) } else { fs(k) }),
            2 => (0u64..6, 0u64..6).prop_map(|(a, b)| Footprint::Keys(smallvec::smallvec![(a, Access::Exclusive), (b, Access::Shared)])),
            1 => Just(Footprint::Barrier),
            1 => Just(Footprint::Callback),
        ]
    }

    /// Transitive closure of the plan's edges: `reach[i]` holds every j < i
    /// that i waits for directly or through others.
    fn closure(p: &Plan) -> Vec<std::collections::BTreeSet<u32>> {
        let mut reach: Vec<std::collections::BTreeSet<u32>> = Vec::new();
        for ws in &p.waits_for {
            let mut r = std::collections::BTreeSet::new();
            for &j in ws {
                r.insert(j);
                r.extend(reach[j as usize].iter().copied());
            }
            reach.push(r);
        }
        reach
    }

    proptest! {
        /// The groups computed in one pass are exactly the connected
        /// components of the plan's edges.
        #[test]
        fn groups_are_the_plans_components(fps in proptest::collection::vec(any_footprint(), 0..40), parity in any::<u8>()) {
            let ops: Vec<u32> = (0..fps.len() as u32).collect();
            let commutes = |a: &u32, b: &u32| !(a ^ b ^ parity as u32).is_multiple_of(3);
            let got = groups(&ops, &fps, commutes);
            let plan = plan(&ops, &fps, commutes);
            let want = crate::machine::exec::groups(&plan);
            if fps.iter().any(|f| matches!(f, Footprint::Barrier)) {
                prop_assert!(got.iter().all(|g| *g == 0));
            } else {
                prop_assert_eq!(got, want);
            }
        }

        #[test]
        fn every_conflicting_pair_is_ordered(fps in proptest::collection::vec(any_footprint(), 0..40), parity in any::<u8>()) {
            let ops: Vec<u32> = (0..fps.len() as u32).collect();
            let commutes = |a: &u32, b: &u32| !(a ^ b ^ parity as u32).is_multiple_of(3);
            let p = plan(&ops, &fps, commutes);
            let reach = closure(&p);
            for i in 0..ops.len() {
                prop_assert!(p.waits_for[i].iter().all(|&j| (j as usize) < i), "edges point back");
                for j in 0..i {
                    if conflicts(&ops[j], &fps[j], &ops[i], &fps[i], &commutes) {
                        prop_assert!(reach[i].contains(&(j as u32)), "op {} must follow op {}: {:?} / {:?}", i, j, fps[j], fps[i]);
                    }
                }
            }
        }
    }
}
