//! Runs a plan (`schedule`) with up to `workers` at a time (the paper's
//! executor threads, §6.3).
//!
//! The plan's edges split a run into **groups**: the connected components
//! of "must keep its order with". Operations of different groups commute
//! pairwise (no edge, direct or through others, joins them), so groups may
//! be applied concurrently in any interleaving; inside a group operations
//! are applied in log order (which respects every edge). Groups are
//! assigned whole to workers, largest first to the least loaded, so a
//! worker applies a list of operations with no synchronization between
//! them: a per-operation hand-off (a lock and a wake-up each) cost more
//! than applying a map update, and made "parallel" slower than serial.
//!
//! With one worker, or one group, operations apply in log order on the
//! caller's task. Workers are tokio tasks: on the multi-threaded runtime
//! they run on as many cores; under the simulator (one thread) each runs
//! its list to the end in turn, so a seed replays.

use std::sync::Arc;

use bytes::Bytes;

use super::schedule::Plan;
use crate::service::{Position, Service};

/// The groups of a plan: for each operation, its group's id (the lowest
/// operation in it), by union-find over the plan's edges.
pub fn groups(plan: &Plan) -> Vec<u32> {
    let n = plan.waits_for.len();
    let mut parent: Vec<u32> = (0..n as u32).collect();
    fn find(parent: &mut [u32], mut x: u32) -> u32 {
        while parent[x as usize] != x {
            let p = parent[x as usize];
            parent[x as usize] = parent[p as usize];
            x = p;
        }
        x
    }
    for (i, ws) in plan.waits_for.iter().enumerate() {
        for &j in ws {
            let (a, b) = (find(&mut parent, i as u32), find(&mut parent, j));
            if a != b {
                // The lower id is the root: a group's id is its first op.
                let (lo, hi) = if a < b { (a, b) } else { (b, a) };
                parent[hi as usize] = lo;
            }
        }
    }
    (0..n as u32).map(|i| find(&mut parent, i)).collect()
}

/// Splits operations `0..n` into at most `workers` lists, each a union of
/// whole groups, each in ascending (log) order; largest groups first to the
/// least loaded list.
pub fn assign(groups: &[u32], workers: usize) -> Vec<Vec<u32>> {
    let mut members: std::collections::BTreeMap<u32, Vec<u32>> = std::collections::BTreeMap::new();
    for (i, g) in groups.iter().enumerate() {
        members.entry(*g).or_default().push(i as u32);
    }
    let mut by_size: Vec<Vec<u32>> = members.into_values().collect();
    // Stable: equal sizes keep their group order, so the assignment is the
    // same on every run.
    by_size.sort_by_key(|g| std::cmp::Reverse(g.len()));
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); workers.max(1).min(by_size.len().max(1))];
    for g in by_size {
        let least = lists.iter().enumerate().min_by_key(|(i, l)| (l.len(), *i)).map(|(i, _)| i).unwrap_or(0);
        lists[least].extend(g);
    }
    for l in &mut lists {
        l.sort_unstable();
    }
    lists.retain(|l| !l.is_empty());
    lists
}

/// Applies `ops` as `plan` allows, with up to `workers` at once; returns
/// each operation's reply, in the operations' order.
pub async fn run<S: Service>(
    service: &Arc<S>,
    ops: Vec<(S::Op, Position)>,
    plan: &Plan,
    workers: usize,
) -> Vec<Bytes> {
    assert_eq!(plan.waits_for.len(), ops.len(), "one plan entry per operation");
    let groups = if workers <= 1 { vec![0; ops.len()] } else { groups(plan) };
    run_groups(service, ops, &groups, workers).await
}

/// Applies `ops` in their `groups` (`schedule::groups`: each operation's
/// group id), groups concurrently on up to `workers`, each in log order;
/// returns each operation's reply, in the operations' order.
pub async fn run_groups<S: Service>(
    service: &Arc<S>,
    ops: Vec<(S::Op, Position)>,
    groups: &[u32],
    workers: usize,
) -> Vec<Bytes> {
    let n = ops.len();
    assert_eq!(groups.len(), n, "one group per operation");
    if workers <= 1 || n <= 1 {
        // In log order: every conflict keeps its order.
        return ops.iter().map(|(op, at)| service.apply(op, *at)).collect();
    }
    let lists = assign(groups, workers);
    if lists.len() <= 1 {
        return ops.iter().map(|(op, at)| service.apply(op, *at)).collect();
    }
    let ops = Arc::new(ops);
    let tasks: Vec<_> = lists
        .into_iter()
        .map(|list| {
            let (service, ops) = (service.clone(), ops.clone());
            tokio::spawn(async move {
                list.into_iter()
                    .map(|i| {
                        let (op, at) = &ops[i as usize];
                        (i, service.apply(op, *at))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut replies = vec![Bytes::new(); n];
    for t in tasks {
        match t.await {
            Ok(done) => {
                for (i, r) in done {
                    replies[i as usize] = r;
                }
            }
            // A panicking apply is a bug in the service: propagate it.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    replies
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::schedule::{self, conflicts};
    use crate::service::Footprint;
    use proptest::prelude::*;

    #[test]
    fn groups_are_the_components_of_the_plan() {
        let f = [
            Footprint::exclusive(1),
            Footprint::exclusive(2),
            Footprint::exclusive(1),
            Footprint::exclusive(3),
            Footprint::exclusive(2),
        ];
        let p = schedule::plan(&[(); 5], &f, |_, _| false);
        assert_eq!(groups(&p), vec![0, 1, 0, 3, 1]);
        let lists = assign(&groups(&p), 2);
        assert_eq!(lists, vec![vec![0, 2, 3], vec![1, 4]]);
        assert_eq!(assign(&groups(&p), 1), vec![vec![0, 1, 2, 3, 4]]);
    }

    proptest! {
        /// Every pair of operations that conflict ends up in the same list,
        /// in log order; lists cover every operation once.
        #[test]
        fn conflicting_operations_share_a_list_in_order(keys in proptest::collection::vec((0u64..8, any::<bool>()), 0..60), workers in 1usize..4) {
            let f: Vec<Footprint> = keys.iter().map(|(k, x)| if *x { Footprint::exclusive(*k) } else { Footprint::shared(*k) }).collect();
            let ops: Vec<u32> = (0..f.len() as u32).collect();
            let p = schedule::plan(&ops, &f, |_, _| false);
            let lists = assign(&groups(&p), workers);
            let mut seen = vec![None; ops.len()];
            for (w, l) in lists.iter().enumerate() {
                prop_assert!(l.windows(2).all(|x| x[0] < x[1]), "a list is in log order");
                for &i in l {
                    prop_assert!(seen[i as usize].is_none());
                    seen[i as usize] = Some(w);
                }
            }
            prop_assert!(seen.iter().all(Option::is_some));
            for i in 0..ops.len() {
                for j in 0..i {
                    if conflicts(&ops[j], &f[j], &ops[i], &f[i], &|_: &u32, _: &u32| false) {
                        prop_assert_eq!(seen[i], seen[j], "ops {} and {} conflict", j, i);
                    }
                }
            }
        }
    }
}
