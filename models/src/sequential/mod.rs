//! Sequential recommenders: a user's history read as a sequence of items.
//!
//! - [`histories`]: [`UserHistory`], [`SyntheticHistories`] with learnable
//!   structure, and [`history_batches`] (the [`HISTORY_FEATURE`] of a
//!   [`Batch`](crate::Batch), seconds as weights).
//! - [`loader`]: [`HistoryLoader`], histories as shuffled batches bucketed
//!   by length.
//! - [`ranking`]: [`HstuRanking`], HSTU scoring candidates' actions
//!   (DLRMv4's shape); a [`Model`](crate::Model).
//! - [`retrieval`]: [`HstuRetrieval`], HSTU trained for next-item
//!   retrieval with sampled softmax; a [`Model`](crate::Model).
//! - [`sasrec`]: [`SasRec`], the transformer baseline, as the public
//!   PyTorch SASRec trains it; a [`Model`](crate::Model).
//! - [`metrics`]: [`evaluate_retrieval`] (HR@k, NDCG@k, MRR over the whole
//!   catalogue or sampled negatives) for any [`SequenceRetriever`].

pub mod histories;
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
    history_batches, SyntheticHistories, UserHistory, Zipf, ACTIONS_FEATURE, HISTORY_FEATURE,
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
