//! The table's sections by placement (Ursa §3.1, design 0009): over disks
//! of both classes, rows for `ssd`, `hdd` and `hybrid` after the `any`
//! rows [`build_rows`] makes. Pure, like the rest of the builder.

use std::collections::BTreeSet;

use rand::seq::SliceRandom;
use rand::{Rng, RngCore};

use blizzard_core::limits::TLT_ROWS_MAX;
use blizzard_core::{DiskClass, Placement, TltSection};

use super::{build_rows, BuildError, BuildParams, BuilderMember};

/// A table's rows and its layout by placement.
#[derive(Debug)]
pub struct Layout {
    pub rows: Vec<Vec<u32>>,
    /// Empty for a single-class cluster: every row is `any`.
    pub sections: Vec<TltSection>,
    /// Placements the members could not serve, and why (for the log).
    pub skipped: Vec<BuildError>,
}

/// Builds the whole table: the `any` rows over every member
/// ([`build_rows`]), then, when the members have both disk classes, a
/// section for each of `ssd` (all pairs of fast disks), `hdd` (of slow
/// disks) and `hybrid` (every fast disk paired with every slow one outside
/// its failure domain, the fast one as primary, [`hybrid_rows`]) that the
/// members can form. Sections are fixed from here on (`blizzard_core::tlt`).
pub fn build_layout(
    members: &[BuilderMember],
    params: &BuildParams,
    rng: &mut impl RngCore,
) -> Result<Layout, BuildError> {
    let mut rows = build_rows(members, params, rng)?;
    let classes: BTreeSet<DiskClass> = members.iter().map(|m| m.class).collect();
    if classes.len() < 2 {
        return Ok(Layout { rows, sections: Vec::new(), skipped: Vec::new() });
    }
    let mut sections = vec![TltSection { placement: Placement::Any, start: 0, len: rows.len() as u32 }];
    let mut skipped = Vec::new();
    for placement in [Placement::Ssd, Placement::Hdd, Placement::Hybrid] {
        let built = match placement {
            Placement::Hybrid => hybrid_rows(members, params, rng),
            p => class_rows(members, p, params, rng),
        };
        match built {
            Ok(more) => {
                let total = (rows.len() + more.len()) as u64;
                if total > TLT_ROWS_MAX as u64 {
                    return Err(BuildError::TooManyRows { rows: total, max: TLT_ROWS_MAX });
                }
                sections.push(TltSection { placement, start: rows.len() as u32, len: more.len() as u32 });
                rows.extend(more);
            }
            Err(e) => skipped.push(e),
        }
    }
    Ok(Layout { rows, sections, skipped })
}

/// Indexes (into `members`) of the members of `class`.
fn of_class(members: &[BuilderMember], class: DiskClass) -> Vec<u32> {
    (0..members.len()).filter(|&i| members[i].class == class).map(|i| i as u32).collect()
}

/// The rows of an all-`ssd` or all-`hdd` section: [`build_rows`] over the
/// members of that class alone.
fn class_rows(
    members: &[BuilderMember],
    placement: Placement,
    params: &BuildParams,
    rng: &mut impl RngCore,
) -> Result<Vec<Vec<u32>>, BuildError> {
    let Some(class) = placement.column_class(0) else { return build_rows(members, params, rng) };
    let picked = of_class(members, class);
    let subset: Vec<BuilderMember> = picked.iter().map(|&i| members[i as usize].clone()).collect();
    let rows = build_rows(&subset, params, rng).map_err(|e| BuildError::NoSection {
        placement,
        needs: format!("{class} tractservers enough for its rows ({e})"),
    })?;
    Ok(rows.into_iter().map(|r| r.into_iter().map(|m| picked[m as usize]).collect()).collect())
}

/// The rows of the `hybrid` section (Ursa §3.1): column 0 a fast disk,
/// the others slow disks, no two members of a row in one failure domain.
/// With k ≥ 2, every (fast, slow) pair in different domains shares exactly
/// one row, with k − 2 random slow extras, so when any disk dies every disk
/// of the other class holds some of its rows; each fast disk leads as many
/// rows as it has slow partners. With k = 1 it is the 1-way table of the
/// fast disks.
pub fn hybrid_rows(
    members: &[BuilderMember],
    params: &BuildParams,
    rng: &mut impl RngCore,
) -> Result<Vec<Vec<u32>>, BuildError> {
    let k = usize::from(params.replication);
    let fast = of_class(members, DiskClass::Ssd);
    let slow = of_class(members, DiskClass::Hdd);
    let no = |needs: String| BuildError::NoSection { placement: Placement::Hybrid, needs };
    if fast.is_empty() {
        return Err(no("at least one ssd tractserver".into()));
    }
    if k == 1 {
        return class_rows(members, Placement::Ssd, params, rng);
    }
    let dom = |i: u32| members[i as usize].domain.as_str();
    let mut table: Vec<Vec<u32>> = Vec::new();
    for &f in &fast {
        let partners: Vec<u32> = slow.iter().copied().filter(|&s| dom(s) != dom(f)).collect();
        let domains: BTreeSet<&str> = partners.iter().map(|&s| dom(s)).collect();
        if domains.len() < k - 1 {
            return Err(no(format!(
                "hdd tractservers in {} failure domains other than each ssd's ({} has {})",
                k - 1,
                members[f as usize].id,
                domains.len()
            )));
        }
        for &s in &partners {
            let mut row = vec![f, s];
            while row.len() < k {
                let free: Vec<u32> =
                    partners.iter().copied().filter(|&c| row.iter().all(|&r| dom(r) != dom(c))).collect();
                // Some domain is free: the row uses fewer than k - 1 slow
                // domains out of at least k - 1.
                let Some(&extra) = free.get(rng.random_range(0..free.len().max(1))) else {
                    return Err(no(format!("hdd tractservers in {} failure domains", k - 1)));
                };
                row.push(extra);
            }
            // The primary stays in column 0; the backups' order is spread.
            row[1..].shuffle(rng);
            table.push(row);
        }
    }
    if table.len() > TLT_ROWS_MAX {
        return Err(BuildError::TooManyRows { rows: table.len() as u64, max: TLT_ROWS_MAX });
    }
    table.shuffle(rng);
    Ok(table)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use blizzard_core::{DiskClass, Placement, Tlt, TltMember, TltRow, TsId};
    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::super::tests::{members, params};
    use super::{build_layout, BuildError, BuilderMember};

    /// Over disks of both classes the table gets a section per placement:
    /// `ssd` and `hdd` rows of one class, `hybrid` rows with a fast primary
    /// and slow backups in distinct domains, every cross-class pair of
    /// domains sharing a hybrid row. A single-class cluster gets none.
    #[test]
    fn mixed_classes_get_a_section_per_placement() {
        for (ssd, hdd, k) in [(3usize, 6usize, 3u8), (2, 4, 2), (4, 4, 3), (3, 3, 1)] {
            for seed in 0..4 {
                let members: Vec<BuilderMember> = (0..ssd + hdd)
                    .map(|i| BuilderMember {
                        id: TsId(i as u128 + 1),
                        domain: format!("rack{i}"),
                        weight: 0,
                        class: if i < ssd { DiskClass::Ssd } else { DiskClass::Hdd },
                    })
                    .collect();
                let mut rng = SmallRng::seed_from_u64(seed);
                let layout = build_layout(&members, &params(k), &mut rng).expect("builds");
                assert!(layout.skipped.is_empty(), "{:?}", layout.skipped);
                let placements: Vec<Placement> = layout.sections.iter().map(|s| s.placement).collect();
                assert_eq!(placements, Placement::ALL.to_vec());
                let t = Tlt {
                    cluster_id: 1,
                    tract_size: 4096,
                    replication: k,
                    version: 1,
                    members: members
                        .iter()
                        .map(|m| TltMember { id: m.id, addr: "h:1".into(), domain: m.domain.clone() })
                        .collect(),
                    rows: layout.rows.iter().map(|m| TltRow::new(1, m.clone())).collect(),
                    sections: layout.sections.clone(),
                };
                t.validate().expect("valid");
                let mut pairs = HashSet::new();
                for (r, row) in t.rows.iter().enumerate() {
                    for (c, &m) in row.members.iter().enumerate() {
                        if let Some(want) = t.column_class(r, c) {
                            assert_eq!(members[m as usize].class, want, "{ssd}+{hdd} k={k}: row {r}");
                        }
                    }
                    if t.row_placement(r) == Placement::Hybrid && k > 1 {
                        for &b in &row.members[1..] {
                            pairs.insert((row.members[0], b));
                        }
                    }
                }
                if k > 1 {
                    assert_eq!(pairs.len(), ssd * hdd, "every (ssd, hdd) pair shares a hybrid row");
                }
            }
        }
        // One class: no sections, the FDS table alone.
        let mut rng = SmallRng::seed_from_u64(1);
        let layout = build_layout(&members(6, 6), &params(3), &mut rng).expect("builds");
        assert!(layout.sections.is_empty());
        // Too few slow domains for hybrid rows: skipped with a reason, the
        // rest built.
        let mut two = members(4, 4);
        two[3].class = DiskClass::Hdd;
        let layout = build_layout(&two, &params(3), &mut SmallRng::seed_from_u64(1)).expect("builds");
        assert!(layout.sections.iter().all(|s| s.placement != Placement::Hybrid));
        assert!(layout
            .skipped
            .iter()
            .any(|e| matches!(e, BuildError::NoSection { placement: Placement::Hybrid, .. })));
    }
}
