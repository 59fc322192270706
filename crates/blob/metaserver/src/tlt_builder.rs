//! Building the tract locator table (FDS §2.2, §3.3). Pure: members and a
//! random source in, rows of member indexes out.
//!
//! - **1-way**: the concatenation of m random permutations of the
//!   tractservers. One permutation would let clients that bunch up behind
//!   a slow tractserver walk the table in lockstep (a convoy); after m > 1
//!   permutations they fan out to different servers. Weighted by disk
//!   speed, a faster disk appears proportionally more often.
//! - **k-way (k ≥ 2)**: every pair of tractservers in different failure
//!   domains shares one row ("all pairs"), so when a disk dies every other
//!   disk holds some of its replicas and all of them re-replicate in
//!   parallel; each row then gets k − 2 random extra members. No two
//!   members of a row share a failure domain (FDS §3.3.1).
//!
//! The first member of a row is its primary: it serializes the metadata of
//! blobs whose tract −1 maps there, and it is the only replica a 1-way blob
//! in a k-way cluster uses (FDS §3.1). Primaries are therefore spread as
//! evenly as the rows allow.

use std::collections::BTreeMap;

use rand::RngCore;

use blizzard_core::TsId;

/// One candidate tractserver for the table.
#[derive(Clone, Debug)]
pub struct BuilderMember {
    pub id: TsId,
    pub domain: String,
    /// Relative disk speed; 0 means unknown and counts as the median.
    pub weight: u32,
}

#[derive(Clone, Debug)]
pub struct BuildParams {
    pub replication: u8,
    /// m: permutations concatenated for 1-way tables (FDS uses 20).
    pub permutations: u32,
    /// Weight 1-way tables by measured disk speed (FDS §2.2).
    pub weighted: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BuildError {
    #[error("no tractservers to build a TLT from; start some tractservers")]
    NoMembers,
    #[error("replication must be at least 1")]
    NoReplication,
    #[error("{replication}-way replication needs tractservers in at least {replication} failure domains, but there are {domains}; add tractservers in other failure domains or lower --replication")]
    NotEnoughDomains { replication: u8, domains: usize },
}

/// At most this many appearances of one member per permutation in a
/// weighted table, so one very fast disk cannot make the table huge.
const WEIGHT_COPIES_MAX: u32 = 16;

fn below(rng: &mut impl RngCore, n: usize) -> usize {
    ((rng.next_u64() as u128 * n.max(1) as u128) >> 64) as usize
}

fn shuffle<T>(v: &mut [T], rng: &mut impl RngCore) {
    for i in (1..v.len()).rev() {
        let j = below(rng, i + 1);
        v.swap(i, j);
    }
}

/// Builds rows of member indexes (into `members`), primary first in each row.
pub fn build_rows(
    members: &[BuilderMember],
    params: &BuildParams,
    rng: &mut impl RngCore,
) -> Result<Vec<Vec<u32>>, BuildError> {
    if members.is_empty() {
        return Err(BuildError::NoMembers);
    }
    match params.replication {
        0 => Err(BuildError::NoReplication),
        1 => Ok(one_way(members, params, rng)),
        k => all_pairs(members, k as usize, rng),
    }
}

fn one_way(members: &[BuilderMember], params: &BuildParams, rng: &mut impl RngCore) -> Vec<Vec<u32>> {
    let copies: Vec<u32> = if params.weighted {
        let mut known: Vec<u32> = members.iter().map(|m| m.weight).filter(|w| *w > 0).collect();
        known.sort_unstable();
        let median = known.get(known.len() / 2).copied().unwrap_or(1).max(1);
        let weights: Vec<u32> =
            members.iter().map(|m| if m.weight == 0 { median } else { m.weight }).collect();
        let min = weights.iter().copied().min().unwrap_or(1).max(1);
        weights
            .iter()
            .map(|w| ((*w as f64 / min as f64).round() as u32).clamp(1, WEIGHT_COPIES_MAX))
            .collect()
    } else {
        vec![1; members.len()]
    };
    let multiset: Vec<u32> =
        copies.iter().enumerate().flat_map(|(i, c)| std::iter::repeat_n(i as u32, *c as usize)).collect();
    let mut rows = Vec::with_capacity(multiset.len() * params.permutations.max(1) as usize);
    for _ in 0..params.permutations.max(1) {
        let mut p = multiset.clone();
        shuffle(&mut p, rng);
        rows.extend(p.into_iter().map(|m| vec![m]));
    }
    rows
}

fn all_pairs(
    members: &[BuilderMember],
    k: usize,
    rng: &mut impl RngCore,
) -> Result<Vec<Vec<u32>>, BuildError> {
    // Failure domains by first appearance, so the result does not depend
    // on how strings hash.
    let mut domain_ids: BTreeMap<&str, usize> = BTreeMap::new();
    let dom: Vec<usize> = members
        .iter()
        .map(|m| {
            let next = domain_ids.len();
            *domain_ids.entry(m.domain.as_str()).or_insert(next)
        })
        .collect();
    let domains = domain_ids.len();
    if domains < k || domains < 2 {
        return Err(BuildError::NotEnoughDomains { replication: k as u8, domains });
    }
    let n = members.len();
    let mut rows: Vec<Vec<u32>> = Vec::with_capacity(n * (n - 1) / 2);
    for i in 0..n {
        for j in i + 1..n {
            if dom[i] != dom[j] {
                rows.push(vec![i as u32, j as u32]);
            }
        }
    }
    // k − 2 random extra members per row, each from a domain the row does
    // not use yet. One exists: the row uses fewer than k ≤ `domains` domains.
    for row in rows.iter_mut() {
        while row.len() < k {
            let candidates: Vec<u32> =
                (0..n as u32).filter(|c| row.iter().all(|r| dom[*r as usize] != dom[*c as usize])).collect();
            if candidates.is_empty() {
                return Err(BuildError::NotEnoughDomains { replication: k as u8, domains });
            }
            row.push(candidates[below(rng, candidates.len())]);
        }
    }
    shuffle(&mut rows, rng);
    // Primaries: visiting rows in random order, give column 0 to the member
    // with the fewest primaries so far (ties broken at random).
    let mut primaries = vec![0u32; n];
    for row in rows.iter_mut() {
        shuffle(row, rng);
        let best = row.iter().map(|m| primaries[*m as usize]).min().unwrap_or(0);
        let ties: Vec<usize> = (0..row.len()).filter(|c| primaries[row[*c] as usize] == best).collect();
        let pick = ties[below(rng, ties.len())];
        row.swap(0, pick);
        primaries[row[0] as usize] += 1;
    }
    // Greedy leaves a little spread; hand primaries from the busiest member
    // of a row to its least busy one until no such move narrows it.
    for _ in 0..32 {
        let mut moved = false;
        for row in rows.iter_mut() {
            let cur = row[0] as usize;
            let Some(c) = (1..row.len()).min_by_key(|c| primaries[row[*c] as usize]) else { continue };
            let cand = row[c] as usize;
            if primaries[cur] > primaries[cand] + 1 {
                primaries[cur] -= 1;
                primaries[cand] += 1;
                row.swap(0, c);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    Ok(rows)
}

/// How many rows each member appears in, and how many as primary (column 0).
pub fn row_counts(n_members: usize, rows: &[Vec<u32>]) -> (Vec<u32>, Vec<u32>) {
    let mut appears = vec![0u32; n_members];
    let mut primary = vec![0u32; n_members];
    for row in rows {
        for (col, &m) in row.iter().enumerate() {
            if let Some(a) = appears.get_mut(m as usize) {
                *a += 1;
                if col == 0 {
                    primary[m as usize] += 1;
                }
            }
        }
    }
    (appears, primary)
}

#[cfg(test)]
mod tests {
    use super::{build_rows, row_counts, BuildError, BuildParams, BuilderMember};
    use blizzard_core::tlt::{blob_hash, locator};
    use blizzard_core::TsId;
    use blizzard_core::{BlobId, TractNo};
    use proptest::prelude::*;
    use rand::rngs::SmallRng;
    use rand::RngCore;
    use rand::SeedableRng;
    use std::collections::HashSet;

    fn members(n: usize, domains: usize) -> Vec<BuilderMember> {
        (0..n)
            .map(|i| BuilderMember {
                id: TsId(i as u128 + 1),
                domain: format!("rack{}", i % domains),
                weight: 0,
            })
            .collect()
    }

    fn params(replication: u8) -> BuildParams {
        BuildParams { replication, permutations: 20, weighted: false }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// k-way tables: every cross-domain pair shares a row, every row has
        /// k distinct members from k distinct failure domains.
        #[test]
        fn all_pairs_and_failure_domains(k in 2u8..=4, extra in 0usize..=20, spread in 0usize..=20, seed in any::<u64>()) {
            let n = k as usize + extra;
            let domains = (k as usize + spread % (n - k as usize + 1)).min(n);
            let ms = members(n, domains);
            let rows = build_rows(&ms, &params(k), &mut SmallRng::seed_from_u64(seed))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut pairs = HashSet::new();
            for row in &rows {
                prop_assert_eq!(row.len(), k as usize);
                let doms: HashSet<_> = row.iter().map(|m| &ms[*m as usize].domain).collect();
                prop_assert_eq!(doms.len(), k as usize, "row {:?} repeats a failure domain", row);
                for a in row {
                    prop_assert!((*a as usize) < n);
                    for b in row {
                        if a < b {
                            pairs.insert((*a, *b));
                        }
                    }
                }
            }
            for i in 0..n as u32 {
                for j in i + 1..n as u32 {
                    if ms[i as usize].domain != ms[j as usize].domain {
                        prop_assert!(pairs.contains(&(i, j)), "pair ({}, {}) shares no row", i, j);
                    }
                }
            }
        }

        /// 1-way tables: each member exactly m times, n·m rows.
        #[test]
        fn one_way_is_m_permutations(n in 1usize..50, m in 1u32..30, seed in any::<u64>()) {
            let ms = members(n, n);
            let p = BuildParams { replication: 1, permutations: m, weighted: false };
            let rows = build_rows(&ms, &p, &mut SmallRng::seed_from_u64(seed))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(rows.len(), n * m as usize);
            let (appears, _) = row_counts(n, &rows);
            prop_assert!(appears.iter().all(|a| *a == m));
            // Each block of n rows is one permutation.
            for block in rows.chunks(n) {
                let set: HashSet<_> = block.iter().map(|r| r[0]).collect();
                prop_assert_eq!(set.len(), n);
            }
        }
    }

    /// FDS §2.2: 1 TB of 8 MiB tracts over 100 tractservers (1-way, m = 20)
    /// loads the busiest tractserver at most 5% above the mean with the
    /// locator (hash(blob) + tract) mod len, while hashing blob and tract
    /// together (the design FDS discarded) does not.
    #[test]
    fn locator_balances_load_and_naive_hash_does_not() {
        const TRACTS: u64 = (1u64 << 40) / (8 << 20);
        let n = 100;
        for seed in [1u64, 2, 3] {
            let mut rng = SmallRng::seed_from_u64(seed);
            let rows = build_rows(&members(n, n), &params(1), &mut rng).expect("table");
            let count = |place: &mut dyn FnMut(&mut Vec<u64>)| {
                let mut c = vec![0u64; n];
                place(&mut c);
                let mean = TRACTS as f64 / n as f64;
                c.iter().copied().max().unwrap_or(0) as f64 / mean
            };
            // (a) one blob of 1 TB.
            let blob = BlobId(rng.next_u64() as u128);
            let one_blob = count(&mut |c| {
                for t in 0..TRACTS {
                    c[rows[locator(blob, TractNo(t as i64), rows.len())][0] as usize] += 1;
                }
            });
            // (b) 1024 blobs of 128 tracts.
            let ids: Vec<BlobId> =
                (0..1024).map(|_| BlobId((rng.next_u64() as u128) << 64 | rng.next_u64() as u128)).collect();
            let many = count(&mut |c| {
                for b in &ids {
                    for t in 0..TRACTS / 1024 {
                        c[rows[locator(*b, TractNo(t as i64), rows.len())][0] as usize] += 1;
                    }
                }
            });
            // The discarded design: Hash(g + i), a binomial spread.
            let naive = count(&mut |c| {
                for b in &ids {
                    for t in 0..TRACTS / 1024 {
                        let h = blob_hash(BlobId(
                            b.0 ^ (t as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835),
                        ));
                        c[rows[(h % rows.len() as u64) as usize][0] as usize] += 1;
                    }
                }
            });
            println!(
                "seed {seed}: max/mean one blob {one_blob:.4}, 1024 blobs {many:.4}, naive hash {naive:.4}"
            );
            assert!(one_blob <= 1.05, "one blob: busiest tractserver {one_blob:.3}× the mean");
            assert!(many <= 1.05, "many blobs: busiest tractserver {many:.3}× the mean");
            assert!(naive > 1.05, "the naive hash balanced well ({naive:.3}); the test shows nothing");
        }
    }

    /// A member with twice the disk speed appears about twice as often.
    #[test]
    fn weighted_one_way_follows_disk_speed() {
        let mut ms = members(10, 10);
        for (i, m) in ms.iter_mut().enumerate() {
            m.weight = if i == 0 { 200 } else { 100 };
        }
        ms[9].weight = 0; // unknown counts as the median
        let p = BuildParams { replication: 1, permutations: 20, weighted: true };
        let rows = build_rows(&ms, &p, &mut SmallRng::seed_from_u64(5)).expect("table");
        let (appears, _) = row_counts(10, &rows);
        assert_eq!(appears[0], 40);
        assert!(appears[1..].iter().all(|a| *a == 20), "{appears:?}");
        let unweighted = BuildParams { weighted: false, ..p };
        let rows = build_rows(&ms, &unweighted, &mut SmallRng::seed_from_u64(5)).expect("table");
        assert!(row_counts(10, &rows).0.iter().all(|a| *a == 20));
    }

    /// Primaries are spread evenly: a 1-way blob in a 3-way cluster loads
    /// every tractserver about the same.
    #[test]
    fn primaries_are_balanced() {
        for (n, d) in [(8usize, 8usize), (8, 4), (12, 3), (30, 5)] {
            for seed in 0..5 {
                let rows = build_rows(&members(n, d), &params(3), &mut SmallRng::seed_from_u64(seed))
                    .expect("table");
                let (_, prim) = row_counts(n, &rows);
                let (lo, hi) =
                    (prim.iter().min().copied().unwrap_or(0), prim.iter().max().copied().unwrap_or(0));
                assert!(hi - lo <= 2, "n={n} d={d}: primaries {prim:?}");
            }
        }
    }

    /// Impossible requests are clear errors, never panics.
    #[test]
    fn impossible_tables_are_errors() {
        let mut rng = SmallRng::seed_from_u64(1);
        assert_eq!(build_rows(&[], &params(1), &mut rng), Err(BuildError::NoMembers));
        assert_eq!(build_rows(&members(3, 3), &params(0), &mut rng), Err(BuildError::NoReplication));
        assert_eq!(
            build_rows(&members(6, 2), &params(3), &mut rng),
            Err(BuildError::NotEnoughDomains { replication: 3, domains: 2 })
        );
        assert_eq!(
            build_rows(&members(4, 1), &params(2), &mut rng),
            Err(BuildError::NotEnoughDomains { replication: 2, domains: 1 })
        );
        assert!(build_rows(&members(1, 1), &params(1), &mut rng).is_ok());
        assert!(build_rows(&members(2, 2), &params(2), &mut rng).is_ok());
    }
}
