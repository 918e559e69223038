//! Retrieval quality as sequential recommenders report it: each user's
//! held-out item ranked against the whole catalogue or against 100
//! sampled items (SASRec's protocol), as hit rate, NDCG and MRR.

use ember_dense::{DenseBackend, Tensor};
use ember_sparse::rng::Rng;
use serde::Serialize;

use super::histories::{history_batches, UserHistory, HISTORY_FEATURE};
use crate::ModelError;

/// What a sequence model gives retrieval: a query per user and an
/// embedding per item, compared by dot product.
pub trait SequenceRetriever {
    /// Each user's query from its history in `batch` less the last item
    /// (the one to retrieve, whose time the query may use), `[users, dim]`.
    fn user_queries(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &crate::Batch,
    ) -> Result<Tensor<f32>, ModelError>;
    /// Every item's embedding as queries are compared with it, `[items, dim]`.
    fn item_embeddings(&self) -> Tensor<f32>;
    /// Items in the catalogue.
    fn num_items(&self) -> usize;
}

/// What the held-out item is ranked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum EvalNegatives {
    /// Every other item.
    All,
    /// This many items the user never saw, drawn uniformly (SASRec's 100).
    Sampled(usize),
}

/// Ranking metrics over users, at a cut-off `k`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RetrievalMetrics {
    /// Users ranked.
    pub users: usize,
    /// The cut-off.
    pub k: usize,
    /// Share of users whose item ranks in the top `k` (HR@k).
    pub hit_rate: f64,
    /// Mean over users of `1 / log2(rank + 2)` when the item ranks in the
    /// top `k`, 0 otherwise (NDCG@k).
    pub ndcg: f64,
    /// Mean of `1 / (rank + 1)` (MRR, no cut-off).
    pub mrr: f64,
}

/// Ranks each user's last item given the rest of its history (most recent
/// `max_len` items), in batches of `batch_size`: leave-one-out evaluation
/// (pass histories without their last item for validation). Sampled
/// negatives come from `seed`.
pub fn evaluate_retrieval(
    model: &mut dyn SequenceRetriever,
    be: &dyn DenseBackend<f32>,
    users: &[UserHistory],
    (max_len, batch_size): (usize, usize),
    (negatives, k): (EvalNegatives, usize),
    seed: u64,
) -> Result<RetrievalMetrics, ModelError> {
    let items = model.item_embeddings();
    let mut rng = Rng::new(seed);
    let users: Vec<&UserHistory> = users.iter().filter(|u| u.items.len() >= 2).collect();
    let owned: Vec<UserHistory> = users.iter().map(|u| (*u).clone()).collect();
    let (mut n, mut hits, mut ndcg, mut mrr) = (0usize, 0.0, 0.0, 0.0);
    for (batch, chunk) in history_batches(&owned, batch_size, max_len)?
        .iter()
        .zip(owned.chunks(batch_size.max(1)))
    {
        let queries = model.user_queries(be, batch)?;
        for (b, user) in chunk.iter().enumerate() {
            let q = queries.row(b);
            let score =
                |id: usize| -> f32 { q.iter().zip(items.row(id)).map(|(a, b)| a * b).sum() };
            let last = *user.items.last().expect("at least 2 items");
            let target = match usize::try_from(last) {
                Ok(t) if t < model.num_items() => t,
                _ => {
                    let (items, feature) = (model.num_items(), HISTORY_FEATURE.to_string());
                    return Err(ember_sparse::SparseError::IdOutOfRange {
                        table: "items".into(),
                        feature,
                        sample: b,
                        id: last,
                        rows: items,
                    }
                    .into());
                }
            };
            let s = score(target);
            let rank = match negatives {
                EvalNegatives::All => (0..model.num_items())
                    .filter(|&id| id != target && score(id) > s)
                    .count(),
                EvalNegatives::Sampled(m) => {
                    let seen: std::collections::HashSet<i64> = user.items.iter().copied().collect();
                    let mut drawn = 0;
                    let mut above = 0;
                    // Draws until m unseen items (or give up on a catalogue the user nearly exhausted).
                    for _ in 0..m * 100 {
                        if drawn == m {
                            break;
                        }
                        let id = rng.below(model.num_items() as u64) as usize;
                        if seen.contains(&(id as i64)) {
                            continue;
                        }
                        drawn += 1;
                        above += usize::from(score(id) > s);
                    }
                    above
                }
            };
            n += 1;
            mrr += 1.0 / (rank + 1) as f64;
            if rank < k {
                hits += 1.0;
                ndcg += 1.0 / ((rank + 2) as f64).log2();
            }
        }
    }
    let per = |v: f64| if n == 0 { 0.0 } else { v / n as f64 };
    Ok(RetrievalMetrics {
        users: n,
        k,
        hit_rate: per(hits),
        ndcg: per(ndcg),
        mrr: per(mrr),
    })
}
