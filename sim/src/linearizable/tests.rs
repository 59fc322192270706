//! The linearizability checker's tests (`linearizable.rs`).

use super::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

fn b(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}
fn some(s: &str) -> Option<Vec<u8>> {
    Some(b(s))
}
fn put(key: &str, value: &str) -> KvOp {
    KvOp::Put { key: b(key), value: b(value) }
}
fn get(key: &str) -> KvOp {
    KvOp::Get { key: b(key) }
}
fn delete(key: &str) -> KvOp {
    KvOp::Delete { key: b(key) }
}
fn cas(key: &str, expected: Option<&str>, new: Option<&str>) -> KvOp {
    KvOp::Cas { key: b(key), expected: expected.map(b), new: new.map(b) }
}
fn swapped(current: Option<&str>) -> KvRet {
    KvRet::Cas { swapped: true, current: current.map(b) }
}

/// Appends an op completed at `responded` with `ret`.
fn done(h: &mut History, client: u64, op: KvOp, invoked: u64, responded: u64, ret: KvRet) -> usize {
    let id = h.invoke(client, op, invoked);
    h.complete(id, ret, responded);
    id
}

fn verdict(h: &History) -> Outcome {
    check(h, MAX_STATES_PER_KEY_DEFAULT)
}

/// The explanation of a non-linearizable verdict (panics otherwise).
fn explanation(h: &History) -> String {
    match verdict(h) {
        Outcome::NotLinearizable { explanation, .. } => {
            println!("{explanation}");
            explanation
        }
        other => panic!("expected NotLinearizable, got {other:?}"),
    }
}

/// An empty history, and one of pending ops only, are linearizable.
#[test]
fn empty_and_all_pending_histories_are_linearizable() {
    let mut h = History::new();
    assert!(h.is_empty());
    assert_eq!(verdict(&h), Outcome::Linearizable);
    h.invoke(1, put("k", "a"), 0);
    h.invoke(2, get("k"), 5);
    h.invoke(3, delete("k"), 7);
    assert_eq!(h.len(), 3);
    assert_eq!(verdict(&h), Outcome::Linearizable);
}

/// A read that misses a write completed before it was invoked is caught;
/// reading the write is fine.
#[test]
fn stale_read_after_completed_write() {
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    let read = done(&mut h, 2, get("k"), 20, 30, KvRet::Get(None));
    let text = explanation(&h);
    assert!(text.contains("#1 client 2 Get = absent [20, 30]: needs absent"), "{text}");
    assert!(text.contains("leaves \"a\""), "{text}");

    h.events[read].completed = Some((30, KvRet::Get(some("a"))));
    assert_eq!(verdict(&h), Outcome::Linearizable);
}

/// A read that sees a concurrent write, followed in real time by a read
/// that does not (time travel), is caught; the other way round is fine.
#[test]
fn time_travel_read() {
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 100, KvRet::Put(None));
    let first = done(&mut h, 2, get("k"), 10, 20, KvRet::Get(some("a")));
    let second = done(&mut h, 3, get("k"), 30, 40, KvRet::Get(None));
    let text = explanation(&h);
    assert!(text.contains("Get = absent [30, 40]"), "{text}");

    h.events[first].completed = Some((20, KvRet::Get(None)));
    h.events[second].completed = Some((40, KvRet::Get(some("a"))));
    assert_eq!(verdict(&h), Outcome::Linearizable);
}

/// Two concurrent writes with reads are accepted in either order the
/// returns imply, and rejected when the reads contradict the Puts'
/// returned previous values.
#[test]
fn concurrent_writes_in_either_order() {
    for (a_prev, b_prev, reads) in [
        (None, Some("a"), ["a", "b"]), // a then b
        (Some("b"), None, ["b", "a"]), // b then a
    ] {
        let mut h = History::new();
        done(&mut h, 1, put("k", "a"), 0, 100, KvRet::Put(a_prev.map(b)));
        done(&mut h, 2, put("k", "b"), 0, 100, KvRet::Put(b_prev.map(b)));
        done(&mut h, 3, get("k"), 10, 50, KvRet::Get(some(reads[0])));
        done(&mut h, 3, get("k"), 60, 90, KvRet::Get(some(reads[1])));
        assert_eq!(verdict(&h), Outcome::Linearizable, "order {reads:?}");
    }

    // The Puts say a then b, the reads say b then a.
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 100, KvRet::Put(None));
    done(&mut h, 2, put("k", "b"), 0, 100, KvRet::Put(some("a")));
    done(&mut h, 3, get("k"), 10, 50, KvRet::Get(some("b")));
    done(&mut h, 3, get("k"), 60, 90, KvRet::Get(some("a")));
    explanation(&h);
}

/// A pending write may have happened (at any time after its invocation,
/// even after its client's next op) or not, but cannot be undone.
#[test]
fn pending_write_may_or_may_not_have_happened() {
    for seen in [None, some("a")] {
        let mut h = History::new();
        h.invoke(1, put("k", "a"), 0);
        done(&mut h, 2, get("k"), 10, 20, KvRet::Get(seen.clone()));
        assert_eq!(verdict(&h), Outcome::Linearizable, "read {seen:?}");
    }

    // Client 1 timed out on Put a and moved on to Put b; a lands late.
    let mut h = History::new();
    h.invoke(1, put("k", "a"), 0);
    done(&mut h, 1, put("k", "b"), 10, 20, KvRet::Put(None));
    done(&mut h, 2, get("k"), 30, 40, KvRet::Get(some("a")));
    assert_eq!(verdict(&h), Outcome::Linearizable);

    // Seen, then not seen: the write cannot be undone.
    let mut h = History::new();
    h.invoke(1, put("k", "a"), 0);
    done(&mut h, 2, get("k"), 10, 20, KvRet::Get(some("a")));
    done(&mut h, 2, get("k"), 30, 40, KvRet::Get(None));
    explanation(&h);

    // Not before its invocation.
    let mut h = History::new();
    done(&mut h, 2, get("k"), 10, 20, KvRet::Get(some("a")));
    h.invoke(1, put("k", "a"), 30);
    explanation(&h);
}

/// A Cas that claims to have swapped although the value was not its
/// expected one is caught, by the search when the expected value was
/// written earlier, and up front when it never was or the return is
/// self-contradictory.
#[test]
fn cas_whose_success_is_inconsistent() {
    let mut h = History::new();
    done(&mut h, 1, put("k", "b"), 0, 10, KvRet::Put(None));
    let a = done(&mut h, 1, put("k", "a"), 20, 30, KvRet::Put(some("b")));
    let c = done(&mut h, 2, cas("k", Some("b"), Some("c")), 40, 50, swapped(Some("c")));
    let text = explanation(&h);
    assert!(
        text.contains("Cas \"b\" -> \"c\" = swapped, now \"c\" [40, 50]: needs \"b\" (written by #0)"),
        "{text}"
    );

    // Concurrent with Put a, the Cas may have gone first, if Put a saw its "c".
    h.events[c].invoked = 15;
    explanation(&h);
    h.events[a].completed = Some((30, KvRet::Put(some("c"))));
    assert_eq!(verdict(&h), Outcome::Linearizable);

    // Expected value never written.
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    done(&mut h, 2, cas("k", Some("z"), Some("c")), 20, 30, swapped(Some("c")));
    assert!(explanation(&h).contains("needs \"z\" (written by no op)"));

    // A failed Cas that saw its expected value.
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    let ret = KvRet::Cas { swapped: false, current: some("a") };
    done(&mut h, 2, cas("k", Some("a"), Some("c")), 20, 30, ret);
    assert!(explanation(&h).contains("no value explains"));
}

/// An acknowledged Put that later reads do not reflect (lost) is caught.
#[test]
fn lost_acknowledged_put() {
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    done(&mut h, 1, put("k", "b"), 20, 30, KvRet::Put(some("a")));
    done(&mut h, 2, get("k"), 40, 50, KvRet::Get(some("a")));
    let text = explanation(&h);
    assert!(text.contains("Get = \"a\" [40, 50]: needs \"a\" (written by #0)"), "{text}");

    // Lost, and then overwritten by a Put that saw the older value.
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    done(&mut h, 1, put("k", "b"), 20, 30, KvRet::Put(some("a")));
    done(&mut h, 2, put("k", "c"), 40, 50, KvRet::Put(some("a")));
    explanation(&h);
}

/// Returns no value of the key could produce are caught without a
/// search: a Put returning a value never written, a Delete of a key
/// never written that says it existed.
#[test]
fn returns_no_state_explains() {
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(some("ghost")));
    let text = explanation(&h);
    assert!(text.contains("needs \"ghost\" (written by no op)"), "{text}");

    let mut h = History::new();
    done(&mut h, 1, delete("k"), 0, 10, KvRet::Delete(true));
    assert!(explanation(&h).contains("needs the key present"));

    // Deletes and Cas to absent behave like a map.
    let mut h = History::new();
    done(&mut h, 1, put("k", "a"), 0, 10, KvRet::Put(None));
    done(&mut h, 1, delete("k"), 20, 30, KvRet::Delete(true));
    done(&mut h, 1, delete("k"), 40, 50, KvRet::Delete(false));
    done(&mut h, 1, cas("k", None, Some("b")), 60, 70, swapped(Some("b")));
    done(&mut h, 1, cas("k", Some("b"), None), 80, 90, swapped(None));
    done(&mut h, 1, get("k"), 100, 110, KvRet::Get(None));
    assert_eq!(verdict(&h), Outcome::Linearizable);
}

/// Keys are judged separately: the failing key is named, and a key out
/// of budget does not hide a later key that fails outright.
#[test]
fn keys_are_checked_separately() {
    let mut h = History::new();
    done(&mut h, 1, put("a", "1"), 0, 10, KvRet::Put(None));
    done(&mut h, 2, put("b", "1"), 0, 10, KvRet::Put(None));
    done(&mut h, 1, get("a"), 20, 30, KvRet::Get(some("1")));
    done(&mut h, 2, get("b"), 20, 30, KvRet::Get(None));
    match verdict(&h) {
        Outcome::NotLinearizable { key, .. } => assert_eq!(key, b("b")),
        other => panic!("{other:?}"),
    }

    // Key "a" needs more than one step; key "b" fails without a search.
    let mut h = History::new();
    done(&mut h, 1, put("a", "1"), 0, 10, KvRet::Put(None));
    done(&mut h, 1, get("a"), 20, 30, KvRet::Get(some("1")));
    done(&mut h, 2, get("b"), 0, 10, KvRet::Get(some("never")));
    match check(&h, 1) {
        Outcome::NotLinearizable { key, .. } => assert_eq!(key, b("b")),
        other => panic!("{other:?}"),
    }
}

/// The search stops at its budget and says Unknown with the steps it
/// took; a larger budget finishes.
#[test]
fn budget_ends_in_unknown() {
    let w = Workload {
        clients: 4,
        ops: 200,
        keys: 1,
        pending_pct: 5,
        gap_max: 50,
        duration_max: 400,
        values: None,
    };
    let h = generate(7, &w);
    assert_eq!(check(&h, 10), Outcome::Unknown { key: b("k0"), explored: 10 });
    assert_eq!(check(&h, MAX_STATES_PER_KEY_DEFAULT), Outcome::Linearizable);
}

/// A random concurrent workload: ops, key count, timing, pending share.
struct Workload {
    clients: u64,
    ops: usize,
    keys: usize,
    /// Percent of responses dropped (the op stays pending).
    pending_pct: u32,
    gap_max: u64,
    duration_max: u64,
    /// Written values are drawn from this many (`None`: all unique).
    values: Option<u64>,
}

/// Runs a real sequential map under concurrent clients: each op takes
/// effect at a random instant between its invocation and response; a
/// pending op takes effect at a random instant after its invocation
/// (possibly after its client moved on) or never. Written values are
/// unique (`v<op index>`) unless `values` says otherwise.
fn generate(seed: u64, w: &Workload) -> History {
    struct Planned {
        client: u64,
        op: KvOp,
        invoked: u64,
        responded: Option<u64>,
        effect: Option<u64>,
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut free_at = vec![0u64; w.clients as usize];
    let mut written: Vec<Vec<Vec<u8>>> = vec![Vec::new(); w.keys];
    let mut planned = Vec::with_capacity(w.ops);
    for i in 0..w.ops {
        let client = rng.random_range(0..w.clients);
        let invoked = free_at[client as usize] + rng.random_range(0..=w.gap_max);
        let responded = invoked + rng.random_range(1..=w.duration_max);
        free_at[client as usize] = responded;
        let k = rng.random_range(0..w.keys);
        let key = format!("k{k}").into_bytes();
        let fresh = match w.values {
            None => format!("v{i}").into_bytes(),
            Some(n) => format!("v{}", rng.random_range(0..n)).into_bytes(),
        };
        let op = match rng.random_range(0..20) {
            0..7 => {
                written[k].push(fresh.clone());
                KvOp::Put { key, value: fresh }
            }
            7..14 => KvOp::Get { key },
            14..16 => KvOp::Delete { key },
            _ => {
                let recent = &written[k][written[k].len().saturating_sub(3)..];
                let pick = rng.random_range(0..=recent.len());
                let expected = recent.get(pick).cloned();
                let new = (!rng.random_ratio(1, 5)).then(|| fresh.clone());
                if let Some(new) = &new {
                    written[k].push(new.clone());
                }
                KvOp::Cas { key, expected, new }
            }
        };
        let pending = rng.random_range(0..100) < w.pending_pct;
        let effect = if !pending {
            Some(rng.random_range(invoked..=responded))
        } else if rng.random_ratio(1, 3) {
            None
        } else {
            Some(rng.random_range(invoked..=responded + 2 * w.duration_max))
        };
        planned.push(Planned { client, op, invoked, responded: (!pending).then_some(responded), effect });
    }
    let mut order: Vec<usize> = (0..planned.len()).filter(|&i| planned[i].effect.is_some()).collect();
    order.sort_by_key(|&i| (planned[i].effect, i));
    let mut map = BTreeMap::new();
    let mut rets: Vec<Option<KvRet>> = vec![None; planned.len()];
    for i in order {
        rets[i] = Some(apply(&mut map, &planned[i].op));
    }
    let mut h = History::new();
    for (p, ret) in planned.into_iter().zip(rets) {
        let id = h.invoke(p.client, p.op, p.invoked);
        if let Some(at) = p.responded {
            h.complete(id, ret.expect("a completed op took effect"), at);
        }
    }
    h
}

/// The sequential map, written independently of the checker's model.
fn apply(map: &mut BTreeMap<Vec<u8>, Vec<u8>>, op: &KvOp) -> KvRet {
    match op {
        KvOp::Put { key, value } => KvRet::Put(map.insert(key.clone(), value.clone())),
        KvOp::Get { key } => KvRet::Get(map.get(key).cloned()),
        KvOp::Delete { key } => KvRet::Delete(map.remove(key).is_some()),
        KvOp::Cas { key, expected, new } => {
            let swapped = map.get(key) == expected.as_ref();
            if swapped {
                match new {
                    Some(new) => map.insert(key.clone(), new.clone()),
                    None => map.remove(key),
                };
            }
            KvRet::Cas { swapped, current: map.get(key).cloned() }
        }
    }
}

/// Brute force over the whole map (no keys, no memo, no lists): tries
/// every order of the ops that respects real time, until every
/// completed op is placed with its return.
fn brute_force(events: &[Event]) -> bool {
    fn go(events: &[Event], placed: &mut [bool], map: &BTreeMap<Vec<u8>, Vec<u8>>) -> bool {
        let open: Vec<usize> = (0..events.len()).filter(|&i| !placed[i]).collect();
        if open.iter().all(|&i| events[i].completed.is_none()) {
            return true;
        }
        for &i in &open {
            let preceded = open
                .iter()
                .any(|&j| events[j].completed.as_ref().is_some_and(|(at, _)| *at < events[i].invoked));
            if preceded {
                continue;
            }
            let mut after = map.clone();
            let ret = apply(&mut after, &events[i].op);
            if events[i].completed.as_ref().is_none_or(|(_, want)| *want == ret) {
                placed[i] = true;
                if go(events, placed, &after) {
                    return true;
                }
                placed[i] = false;
            }
        }
        false
    }
    go(events, &mut vec![false; events.len()], &BTreeMap::new())
}

/// Replaces a random completed Get's return with a value no op writes.
fn mutate_never_written(h: &mut History, rng: &mut SmallRng) -> Option<usize> {
    let gets: Vec<usize> =
        (0..h.len()).filter(|&i| matches!(h.events[i].completed, Some((_, KvRet::Get(_))))).collect();
    let id = *gets.get(rng.random_range(0..gets.len().max(1)))?;
    let at = h.events[id].completed.as_ref()?.0;
    h.events[id].completed = Some((at, KvRet::Get(some("never written"))));
    Some(id)
}

/// Makes a random completed Get return the value of a Put to its key
/// invoked only after the Get responded (values are unique, so that Put
/// is its only writer): a read from the future, which only the search
/// can rule out.
fn mutate_read_from_future(h: &mut History, rng: &mut SmallRng) -> Option<usize> {
    let mut pairs = Vec::new();
    for (g, get) in h.events.iter().enumerate() {
        let Some((responded, KvRet::Get(_))) = &get.completed else { continue };
        for (p, write) in h.events.iter().enumerate() {
            if matches!(write.op, KvOp::Put { .. })
                && write.op.key() == get.op.key()
                && write.invoked > *responded
            {
                pairs.push((g, p));
            }
        }
    }
    let (g, p) = *pairs.get(rng.random_range(0..pairs.len().max(1)))?;
    let KvOp::Put { value, .. } = &h.events[p].op else { return None };
    let value = value.clone();
    let at = h.events[g].completed.as_ref()?.0;
    h.events[g].completed = Some((at, KvRet::Get(Some(value))));
    Some(g)
}

/// Makes a random completed Get return the value of a completed Put to
/// its key that another completed Put overwrote before the Get was
/// invoked (values are unique, so nothing wrote it again): a stale read
/// that only the search can rule out, since the value was written.
fn mutate_stale_read(h: &mut History, rng: &mut SmallRng) -> Option<usize> {
    let completed_put = |e: &Event| match (&e.op, &e.completed) {
        (KvOp::Put { value, .. }, Some((at, _))) => Some((value.clone(), *at)),
        _ => None,
    };
    let mut triples = Vec::new();
    for (g, get) in h.events.iter().enumerate() {
        if !matches!(get.completed, Some((_, KvRet::Get(_)))) {
            continue;
        }
        for old in &h.events {
            let Some((value, old_done)) = completed_put(old) else { continue };
            let overwritten = h.events.iter().any(|new| {
                completed_put(new).is_some_and(|(_, new_done)| {
                    new.op.key() == get.op.key() && new.invoked > old_done && new_done < get.invoked
                })
            });
            if old.op.key() == get.op.key() && overwritten {
                triples.push((g, value));
            }
        }
    }
    let (g, value) = triples.get(rng.random_range(0..triples.len().max(1)))?.clone();
    let at = h.events[g].completed.as_ref()?.0;
    h.events[g].completed = Some((at, KvRet::Get(Some(value))));
    Some(g)
}

/// Histories of a real linearizable map under random concurrent
/// clients (with dropped responses) are accepted; a read of a value
/// never written, of a value written only later, or of a value
/// overwritten before the read began, is rejected.
#[test]
fn generated_histories_pass_and_their_mutations_fail() {
    let mut mutated = [0u32; 3];
    for seed in 0..200u64 {
        let w = Workload {
            clients: 1 + seed % 6,
            ops: 20 + (seed as usize % 7) * 20,
            keys: 1 + seed as usize % 4,
            pending_pct: (seed % 4) as u32 * 5,
            gap_max: 30,
            duration_max: 1 + seed % 300,
            values: None,
        };
        let h = generate(seed, &w);
        assert_eq!(verdict(&h), Outcome::Linearizable, "seed {seed}");
        let mut rng = SmallRng::seed_from_u64(seed ^ 0x5eed);
        for (which, mutate) in
            [mutate_never_written, mutate_read_from_future, mutate_stale_read].into_iter().enumerate()
        {
            let mut bad = h.clone();
            let Some(id) = mutate(&mut bad, &mut rng) else { continue };
            mutated[which] += 1;
            match verdict(&bad) {
                Outcome::NotLinearizable { explanation, .. } => {
                    assert!(explanation.contains(&format!("#{id} ")), "seed {seed}: {explanation}")
                }
                other => panic!("seed {seed}: mutation {which} of op {id}: {other:?}"),
            }
        }
    }
    println!("mutated histories: {mutated:?}");
    assert!(mutated.iter().all(|&n| n > 100), "{mutated:?}");
}

/// On small random histories, some with one return replaced at random,
/// the checker agrees with a brute-force search over the whole map.
#[test]
fn agrees_with_brute_force_on_small_histories() {
    let mut outcomes = [0u32; 2];
    for seed in 0..3000u64 {
        let w = Workload {
            clients: 2 + seed % 3,
            ops: 2 + seed as usize % 7,
            keys: 1 + seed as usize % 2,
            pending_pct: 10 + (seed % 3) as u32 * 20,
            gap_max: 5,
            duration_max: 10,
            values: (seed % 2 == 0).then_some(2 + seed % 2),
        };
        let mut h = generate(seed, &w);
        let mut rng = SmallRng::seed_from_u64(seed ^ 0xb0b);
        if rng.random_ratio(2, 3) {
            let completed: Vec<usize> = (0..h.len()).filter(|&i| h.events[i].completed.is_some()).collect();
            if let Some(&id) = completed.get(rng.random_range(0..completed.len().max(1))) {
                let pool = [None, some("v0"), some("v1"), some("v2"), some("v3"), some("x")];
                let mut value = || pool[rng.random_range(0..pool.len())].clone();
                let ret = match &h.events[id].op {
                    KvOp::Put { .. } => KvRet::Put(value()),
                    KvOp::Get { .. } => KvRet::Get(value()),
                    KvOp::Delete { .. } => KvRet::Delete(value().is_some()),
                    KvOp::Cas { .. } => KvRet::Cas { swapped: value().is_some(), current: value() },
                };
                let at = h.events[id].completed.as_ref().map_or(0, |(at, _)| *at);
                h.events[id].completed = Some((at, ret));
            }
        }
        let expected = brute_force(h.events());
        let got = verdict(&h);
        assert_eq!(got.is_linearizable(), expected, "seed {seed}: {got:?}\n{h:#?}");
        outcomes[usize::from(expected)] += 1;
    }
    println!("not linearizable / linearizable: {outcomes:?}");
    assert!(outcomes.iter().all(|&n| n > 500), "{outcomes:?}");
}

/// 8 clients, 2,000 overlapping ops over 20 keys (some pending) check
/// quickly, linearizable and with a read from the future.
#[test]
// Wall time of the checker itself, printed only; nothing simulated.
#[allow(clippy::disallowed_methods)]
fn two_thousand_ops_check_quickly() {
    let w = Workload {
        clients: 8,
        ops: 2000,
        keys: 20,
        pending_pct: 3,
        gap_max: 50,
        duration_max: 500,
        values: None,
    };
    let h = generate(42, &w);
    let start = std::time::Instant::now();
    assert_eq!(verdict(&h), Outcome::Linearizable);
    println!("2000 ops, linearizable: {:?}", start.elapsed());

    let mut bad = h.clone();
    let mut rng = SmallRng::seed_from_u64(42);
    let id = mutate_read_from_future(&mut bad, &mut rng).expect("a Get and a later Put on its key");
    let start = std::time::Instant::now();
    assert!(matches!(verdict(&bad), Outcome::NotLinearizable { .. }), "op {id}");
    println!("2000 ops, read from the future: {:?}", start.elapsed());
}
