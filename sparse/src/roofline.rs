//! This machine's own limit for the lookup kernel: a plain random gather with
//! sum-pooling and software prefetch over the tables' own memory, with none of
//! the collection's bookkeeping (no id validation, no jagged offsets, no
//! per-feature dispatch, no output layout). `ember bench embedding --roofline`
//! reports the collection's throughput as a fraction of this: for fp32
//! tables the summed gather, for other formats the bytes gathered and the
//! pooled rows written ([`gather_bytes`]).

use rayon::prelude::*;

use crate::simd::multiversion;
use crate::storage::prefetch_every;

/// Ids gathered per parallel task.
const TASK_IDS: usize = 4096;
const AHEAD: usize = 12;
/// Output rows fetched ahead by [`gather_bytes`], in bags (the forward's).
const OUT_AHEAD: usize = 8;

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

/// The byte limit of a lookup in any row format: for each table `t`,
/// gathers the rows `ids[t]` (`row_bytes` each, of `tables[t]`), reading
/// every byte as it comes (8-byte words summed, no decoding), and writes
/// `out_row_bytes` of output for each run of `pooling` ids into
/// `out[t]` (one output row a bag, in order): the rows read plus the pooled
/// rows written that a forward moves. Returns a checksum.
///
/// # Panics
/// When `pooling` or `out_row_bytes` is 0, the tables, ids and outputs are
/// not as many, `out[t]` holds fewer than one output row a bag of
/// `ids[t]`, or an id's row lies outside its table.
pub fn gather_bytes(
    tables: &[&[u8]],
    row_bytes: usize,
    ids: &[&[u32]],
    pooling: usize,
    out: &mut [&mut [u8]],
    out_row_bytes: usize,
) -> u64 {
    assert!(
        pooling > 0 && out_row_bytes > 0,
        "bags of ids, rows of bytes"
    );
    assert!(
        tables.len() == ids.len() && ids.len() == out.len(),
        "one table, ids and output each"
    );
    let per_task = TASK_IDS.div_ceil(pooling) * pooling;
    let out_per_task = per_task / pooling * out_row_bytes;
    let mut tasks = Vec::new();
    for ((table, ids), out) in tables.iter().zip(ids).zip(out.iter_mut()) {
        let bags = ids.len().div_ceil(pooling);
        assert!(out.len() >= bags * out_row_bytes, "one output row a bag");
        let outs = out[..bags * out_row_bytes].chunks_mut(out_per_task);
        tasks.extend(ids.chunks(per_task).zip(outs).map(|(i, o)| (*table, i, o)));
    }
    tasks
        .into_par_iter()
        .map(|(table, ids, out)| {
            gather_bytes_task(table, row_bytes, ids, pooling, out, out_row_bytes)
        })
        .reduce(|| 0, u64::wrapping_add)
}

multiversion!(fn gather_bytes_task(table: &[u8], row_bytes: usize, ids: &[u32], pooling: usize, out: &mut [u8], out_row_bytes: usize) -> u64 = gather_bytes_body);

#[inline(always)]
fn gather_bytes_body(
    table: &[u8],
    row_bytes: usize,
    ids: &[u32],
    pooling: usize,
    out: &mut [u8],
    out_row_bytes: usize,
) -> u64 {
    let base = table.as_ptr();
    let step = if pooling >= 3 { 128 } else { 64 };
    let words = row_bytes / 8;
    let mut acc = vec![0u64; words.max(1)];
    let mut check = 0u64;
    let out_base = out.as_ptr();
    let bags = out.len() / out_row_bytes.max(1);
    for (b, (bag, out)) in ids
        .chunks(pooling)
        .zip(out.chunks_mut(out_row_bytes))
        .enumerate()
    {
        // The output row OUT_AHEAD bags on, fetched now as the forward
        // fetches its own: a store to a line not in cache waits for it.
        if b + OUT_AHEAD < bags {
            let ahead = out_base.wrapping_add((b + OUT_AHEAD) * out_row_bytes);
            prefetch_every(ahead, out_row_bytes, 64);
        }
        for (j, &id) in bag.iter().enumerate() {
            if let Some(&next) = ids.get(b * pooling + j + AHEAD) {
                prefetch_every(
                    base.wrapping_add(next as usize * row_bytes),
                    row_bytes,
                    step,
                );
            }
            let row = &table[id as usize * row_bytes..(id as usize + 1) * row_bytes];
            let (whole, tail) = row.split_at(words * 8);
            for (a, w) in acc.iter_mut().zip(whole.chunks_exact(8)) {
                *a = a.wrapping_add(u64::from_le_bytes(w.try_into().expect("8 bytes")));
            }
            acc[0] = tail.iter().fold(acc[0], |a, &t| a.wrapping_add(t as u64));
        }
        // The pooled row: the sum's bytes, repeated to the output row's length.
        let sum = as_bytes(&acc);
        for o in out.chunks_mut(sum.len()) {
            o.copy_from_slice(&sum[..o.len()]);
        }
        check = check.wrapping_add(acc[0]);
        acc.fill(0);
    }
    check
}

/// The words' bytes, in memory order.
fn as_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: u64 has no padding and u8 no alignment: the same memory.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 8) }
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

    /// Each output row is its bag's rows summed as 8-byte words (the bytes
    /// past the last whole word added to the first), repeated to its length.
    #[test]
    fn gather_bytes_writes_each_bags_word_sums() {
        let mut rng = crate::rng::Rng::new(9);
        let (rows, row_bytes, pooling, out_row_bytes) = (40, 12, 2, 20);
        let tables: Vec<Vec<u8>> = (0..2)
            .map(|_| {
                (0..rows * row_bytes)
                    .map(|_| rng.below(256) as u8)
                    .collect()
            })
            .collect();
        let ids: Vec<Vec<u32>> = (0..2)
            .map(|_| (0..9).map(|_| rng.below(rows as u64) as u32).collect())
            .collect();
        let bags = 9usize.div_ceil(pooling);
        let mut outs = vec![vec![0u8; bags * out_row_bytes]; 2];
        let table_refs: Vec<&[u8]> = tables.iter().map(|t| t.as_slice()).collect();
        let id_refs: Vec<&[u32]> = ids.iter().map(|i| i.as_slice()).collect();
        let mut out_refs: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        let check = gather_bytes(
            &table_refs,
            row_bytes,
            &id_refs,
            pooling,
            &mut out_refs,
            out_row_bytes,
        );
        let mut want_check = 0u64;
        for t in 0..2 {
            for (b, bag) in ids[t].chunks(pooling).enumerate() {
                let mut sum = 0u64;
                for &id in bag {
                    let row = &tables[t][id as usize * row_bytes..][..row_bytes];
                    sum = sum.wrapping_add(u64::from_le_bytes(row[..8].try_into().unwrap()));
                    sum = row[8..].iter().fold(sum, |a, &x| a.wrapping_add(x as u64));
                }
                want_check = want_check.wrapping_add(sum);
                let want: Vec<u8> = sum
                    .to_ne_bytes()
                    .iter()
                    .cycle()
                    .take(out_row_bytes)
                    .copied()
                    .collect();
                assert_eq!(
                    &outs[t][b * out_row_bytes..][..out_row_bytes],
                    &want[..],
                    "table {t}, bag {b}"
                );
            }
        }
        assert_eq!(check, want_check);
    }
}
