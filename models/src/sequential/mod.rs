//! Sequential recommenders: a user's history read as a sequence of items.
//!
//! - [`histories`]: [`UserHistory`], [`SyntheticHistories`] with learnable
//!   structure, and [`history_batches`] (the [`HISTORY_FEATURE`] of a
//!   [`Batch`](crate::Batch), seconds as weights), [`LeaveOut`] (the
//!   references' evaluation split).
//! - [`loader`]: [`HistoryLoader`], histories as shuffled batches bucketed
//!   by length.
//! - [`ranking`]: [`HstuRanking`], HSTU scoring candidates' actions
//!   (DLRMv4's shape); a [`Model`](crate::Model).
//! - [`retrieval`]: [`HstuRetrieval`], HSTU trained for next-item
//!   retrieval with sampled softmax; a [`Model`](crate::Model).
//! - [`sasrec`]: [`SasRec`], the transformer baseline, as the public
//!   PyTorch SASRec trains it; a [`Model`](crate::Model).
//! - [`inference`]: [`SequenceScorer`], a checkpoint's model scoring
//!   histories (top items, or candidates' logits) for `predict` and
//!   `serve`; checkpoints record their [`SequenceModelConfig`].
//! - [`metrics`]: [`evaluate_retrieval`] (HR@k, NDCG@k, MRR over the whole
//!   catalogue or sampled negatives) for any [`SequenceRetriever`].

pub mod histories;
pub mod inference;
pub mod loader;
mod loss;
pub mod metrics;
pub mod ranking;
mod readout;
pub mod retrieval;
pub mod sasrec;
mod stack;

pub use ember_dataloader::sequences::{
    read_histories, read_user_item_file, write_histories, write_user_item_file,
};
pub use histories::{
    history_batches, LeaveOut, SyntheticHistories, UserHistory, Zipf, ACTIONS_FEATURE,
    HISTORY_FEATURE,
};
pub use inference::{
    history_batch, SequenceModelConfig, SequenceScorer, SequenceScores, SEQUENCE_MODEL_KEY,
};
pub use loader::HistoryLoader;
pub use metrics::{evaluate_retrieval, EvalNegatives, RetrievalMetrics, SequenceRetriever};
pub use ranking::{HstuRanking, HstuRankingConfig, RankingMetrics};
pub use retrieval::{HstuRetrieval, HstuRetrievalConfig, NegativeSampling};
pub use sasrec::{SasRec, SasRecConfig, SasRecLoss};

/// The seed of a model's draws (dropout, negatives) at `step`: models
/// reseed from it before each step, so that a run resumed from a
/// checkpoint (which keeps the step) draws what the uninterrupted run drew.
pub(crate) fn step_seed(seed: u64, step: u64) -> u64 {
    ember_sparse::rng::mix(&[seed, step])
}

/// Multiplies `x` by a fresh dropout mask (kept for the backward), or
/// leaves it when not training.
pub(crate) fn dropout(
    x: &mut [f32],
    p: f64,
    on: bool,
    rng: &mut ember_dense::Initializer,
    mask: &mut Vec<f32>,
) {
    mask.clear();
    if !on || p <= 0.0 {
        return;
    }
    let keep = (1.0 / (1.0 - p)) as f32;
    mask.extend((0..x.len()).map(|_| if rng.unit() < p { 0.0 } else { keep }));
    x.iter_mut().zip(mask.iter()).for_each(|(v, m)| *v *= m);
}

/// Applies a kept mask to a gradient (nothing when there is none).
pub(crate) fn undrop(g: &mut [f32], mask: &[f32]) {
    if !mask.is_empty() {
        g.iter_mut().zip(mask).for_each(|(v, m)| *v *= m);
    }
}

/// Sets a sequence model's optimizers for the step taken after `step`
/// steps, as [`Model::set_optimization`](crate::Model::set_optimization)
/// says: the item table's rate and decay, the dense rate and decay; returns
/// the clipping norm for [`dense_step`].
pub(crate) fn set_optimization(
    o: &crate::Optimization,
    step: u64,
    items: &mut ember_sparse::EmbeddingCollection,
    dense: &mut ember_dense::DenseOptimizer<f32>,
) -> Result<Option<f32>, crate::ModelError> {
    o.validate()
        .map_err(crate::ModelError::InvalidOptimization)?;
    let table = *items.optimizer();
    items.set_step_settings(o.table_settings(&table, step))?;
    o.set_dense(dense, step);
    Ok(o.max_grad_norm)
}

/// The dense update: the gradients clipped at `max_grad_norm` (their
/// global norm), then the optimizer's step.
pub(crate) fn dense_step(
    optimizer: &mut ember_dense::DenseOptimizer<f32>,
    mut params: Vec<ember_dense::Param<'_, f32>>,
    max_grad_norm: Option<f32>,
) {
    if let Some(max) = max_grad_norm {
        ember_dense::clip_grad_norm(&mut params, max as f64);
    }
    optimizer.step(params);
}
