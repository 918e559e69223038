//! This machine's own limit for the lookup kernel: a plain random gather with
//! sum-pooling and software prefetch over the tables' own memory, with none of
//! the collection's bookkeeping (no id validation, no jagged offsets, no
//! per-feature dispatch, no output layout). `ember bench embedding --roofline`
//! reports the collection's throughput as a fraction of this.

use rayon::prelude::*;

use crate::simd::multiversion;
use crate::storage::prefetch_every;

/// Ids gathered per parallel task.
const TASK_IDS: usize = 4096;
const AHEAD: usize = 12;

/// For each table `t`, gathers the rows `ids[t]` (of `dim` floats) from
/// `tables[t]` and sums each run of `pooling` ids; returns a checksum so the
/// work cannot be optimised away.
pub fn gather_sum(tables: &[&[f32]], ids: &[&[u32]], dim: usize, pooling: usize) -> f32 {
    let per_task = TASK_IDS.div_ceil(pooling) * pooling;
    let tasks: Vec<(usize, usize)> = ids
        .iter()
        .enumerate()
        .flat_map(|(t, ids)| {
            (0..ids.len())
                .step_by(per_task)
                .map(move |start| (t, start))
        })
        .collect();
    tasks
        .par_iter()
        .map(|&(t, start)| {
            let chunk = &ids[t][start..(start + per_task).min(ids[t].len())];
            gather_task(tables[t], chunk, dim, pooling)
        })
        .sum()
}

multiversion!(fn gather_task(table: &[f32], ids: &[u32], dim: usize, pooling: usize) -> f32 = gather_task_body);

/// Same fixed-dim specialisation as the collection's kernel, so the two
/// differ in the work around the gather, not in how rows are summed. (With
/// many ids per bag the collection's loop, leaner still, can beat it.)
#[inline(always)]
fn gather_task_body(table: &[f32], ids: &[u32], dim: usize, pooling: usize) -> f32 {
    match dim {
        16 => gather::<16>(table, ids, dim, pooling),
        32 => gather::<32>(table, ids, dim, pooling),
        64 => gather::<64>(table, ids, dim, pooling),
        128 => gather::<128>(table, ids, dim, pooling),
        _ => gather::<0>(table, ids, dim, pooling),
    }
}

/// `D > 0`: the dim at compile time, the sum in registers; `D = 0`: any dim.
#[inline(always)]
fn gather<const D: usize>(table: &[f32], ids: &[u32], dim: usize, pooling: usize) -> f32 {
    let base = table.as_ptr();
    // The same hint spacing as the collection's forward (see `prefetch_every`).
    let step = if pooling >= 3 { 128 } else { 64 };
    let mut fixed = [0.0f32; D];
    let mut any = vec![0.0f32; if D > 0 { 0 } else { dim }];
    let mut check = 0.0f32;
    for (b, bag) in ids.chunks(pooling).enumerate() {
        for (j, &id) in bag.iter().enumerate() {
            if let Some(&next) = ids.get(b * pooling + j + AHEAD) {
                prefetch_every(base.wrapping_add(next as usize * dim), dim * 4, step);
            }
            let row = &table[id as usize * dim..id as usize * dim + dim];
            if D > 0 {
                let row: &[f32; D] = row.try_into().expect("D is the dim");
                for d in 0..D {
                    fixed[d] += row[d];
                }
            } else {
                any.iter_mut().zip(row).for_each(|(a, r)| *a += r);
            }
        }
        // Every element must be computed: hide the pooled row from the optimiser.
        check += if D > 0 {
            std::hint::black_box(&fixed)[0]
        } else {
            std::hint::black_box(&any)[0]
        };
        fixed = [0.0; D];
        any.fill(0.0);
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum is the sum over bags of each pooled row's first element.
    #[test]
    fn gather_sum_matches_plain_sums() {
        let mut rng = crate::rng::Rng::new(5);
        for (dim, pooling) in [(16, 1), (16, 3), (5, 2), (128, 20)] {
            let rows = 300;
            let tables: Vec<Vec<f32>> = (0..2)
                .map(|_| (0..rows * dim).map(|_| rng.next_f32() - 0.5).collect())
                .collect();
            let ids: Vec<Vec<u32>> = (0..2)
                .map(|_| {
                    (0..pooling * 50)
                        .map(|_| rng.below(rows as u64) as u32)
                        .collect()
                })
                .collect();
            let expected: f64 = (0..2)
                .map(|t| {
                    ids[t]
                        .iter()
                        .map(|&id| tables[t][id as usize * dim] as f64)
                        .sum::<f64>()
                })
                .sum();
            let table_refs: Vec<&[f32]> = tables.iter().map(|t| t.as_slice()).collect();
            let id_refs: Vec<&[u32]> = ids.iter().map(|i| i.as_slice()).collect();
            let got = gather_sum(&table_refs, &id_refs, dim, pooling) as f64;
            assert!(
                (got - expected).abs() < 1e-3,
                "dim {dim}, pooling {pooling}: {got} vs {expected}"
            );
        }
    }
}
