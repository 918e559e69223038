//! Sequential recommenders: a user's history read as a sequence of items.
//!
//! - [`histories`]: [`UserHistory`], [`SyntheticHistories`] with learnable
//!   structure, and [`history_batches`] (the [`HISTORY_FEATURE`] of a
//!   [`Batch`](crate::Batch), seconds as weights).
//! - [`retrieval`]: [`HstuRetrieval`], HSTU trained for next-item
//!   retrieval with sampled softmax; a [`Model`](crate::Model).
//! - [`sasrec`]: [`SasRec`], the transformer baseline, as the public
//!   PyTorch SASRec trains it; a [`Model`](crate::Model).
//! - [`metrics`]: [`evaluate_retrieval`] (HR@k, NDCG@k, MRR over the whole
//!   catalogue or sampled negatives) for any [`SequenceRetriever`].

pub mod histories;
mod loss;
pub mod metrics;
mod readout;
pub mod retrieval;
pub mod sasrec;

pub use histories::{
    history_batches, read_user_item_file, write_user_item_file, SyntheticHistories, UserHistory,
    Zipf, HISTORY_FEATURE,
};
pub use metrics::{evaluate_retrieval, EvalNegatives, RetrievalMetrics, SequenceRetriever};
pub use retrieval::{HstuRetrieval, HstuRetrievalConfig, NegativeSampling};
pub use sasrec::{SasRec, SasRecConfig, SasRecLoss};
