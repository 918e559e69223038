//! This machine's own limit for the lookup kernel: a plain random gather with
//! sum-pooling and software prefetch over a buffer of the table's size, with
//! none of the collection's bookkeeping (no bounds checks, no jagged offsets,
//! no per-feature dispatch). `ember bench embedding --roofline` reports the
//! collection's throughput as a fraction of this.

use rayon::prelude::*;

use crate::storage::{prefetch, AlignedBuffer};

/// Gathers `ids.len()` rows of `dim` floats from `table` and sums each run of
/// `pooling` ids into one output row; returns a checksum so the work is not
/// optimised away.
pub fn gather_sum(table: &AlignedBuffer, dim: usize, ids: &[u32], pooling: usize) -> f32 {
    const AHEAD: usize = 12;
    const TASK_IDS: usize = 4096;
    let data = table.as_slice();
    let row_bytes = dim * 4;
    ids.par_chunks(TASK_IDS.div_ceil(pooling) * pooling)
        .map(|chunk| {
            let base = data.as_ptr();
            let mut acc = vec![0.0f32; dim];
            let mut check = 0.0f32;
            for (i, &id) in chunk.iter().enumerate() {
                if let Some(&next) = chunk.get(i + AHEAD) {
                    prefetch(base.wrapping_add(next as usize * dim), row_bytes);
                }
                let row = &data[id as usize * dim..id as usize * dim + dim];
                for (a, r) in acc.iter_mut().zip(row) {
                    *a += r;
                }
                if (i + 1) % pooling == 0 {
                    check += acc[0];
                    acc.fill(0.0);
                }
            }
            check
        })
        .sum()
}
