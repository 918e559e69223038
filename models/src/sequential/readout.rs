//! Reading a sequence model out: each user's query (its last output) and
//! the item rows it is scored against, raw (dot product) or unit-length
//! (cosine), for both models.

use ember_dense::jagged::Jagged;
use ember_dense::Tensor;
use ember_sparse::EmbeddingCollection;

use super::loss::normalize;

/// Each sequence's last row of `h` (zeros for an empty one), unit-length
/// when `cosine`.
pub(crate) fn last_rows(h: &Jagged<f32>, cosine: bool) -> Tensor<f32> {
    let d = h.dim();
    let (mut out, mut unit) = (Tensor::zeros(h.batch(), d), Vec::new());
    for (b, w) in h.offsets().windows(2).enumerate() {
        if w[1] > w[0] {
            let last = h.values().row(w[1] - 1);
            match cosine {
                true => drop(normalize(last, d, &mut unit)),
                false => unit = last.to_vec(),
            }
            out.row_mut(b).copy_from_slice(&unit);
        }
    }
    out
}

/// Row `id` of the collection's (only) table as it is scored.
pub(crate) fn item_row(items: &EmbeddingCollection, id: usize, cosine: bool) -> Vec<f32> {
    let mut row = vec![0.0f32; items.dim()];
    items.tables()[0].read_row(id, &mut row);
    if !cosine {
        return row;
    }
    let mut unit = Vec::with_capacity(row.len());
    normalize(&row, row.len(), &mut unit);
    unit
}

/// Every item's row as it is scored, `[items, dim]`.
pub(crate) fn item_rows(items: &EmbeddingCollection, cosine: bool) -> Tensor<f32> {
    let (n, d) = (items.tables()[0].num_embeddings(), items.dim());
    let mut rows = Tensor::zeros(n, d);
    for id in 0..n {
        rows.row_mut(id)
            .copy_from_slice(&item_row(items, id, cosine));
    }
    rows
}

/// Each user's score of its last item (`None`: 0): the dot product of its
/// query with the item's row, times `scale`. Reads only those items' rows.
pub(crate) fn last_item_scores(
    queries: &Tensor<f32>,
    items: &EmbeddingCollection,
    last: &[Option<usize>],
    (cosine, scale): (bool, f32),
) -> Vec<f32> {
    (last.iter().enumerate())
        .map(|(b, id)| match id {
            Some(id) => {
                let e = item_row(items, *id, cosine);
                queries
                    .row(b)
                    .iter()
                    .zip(&e)
                    .map(|(a, b)| a * b)
                    .sum::<f32>()
                    * scale
            }
            None => 0.0,
        })
        .collect()
}
