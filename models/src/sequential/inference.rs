//! A sequence model's checkpoint opened to score histories: what `ember
//! predict` writes and `ember serve` answers for SASRec and HSTU.
//!
//! A checkpoint records its model's kind and shape
//! ([`SEQUENCE_MODEL_KEY`]), so it opens without flags. Retrieval models
//! (SASRec, HSTU retrieval) give each history its `k` best next items
//! over the whole catalogue (the query reads every item given; ties go to
//! the lower id); HSTU ranking gives each history's last `num_candidates`
//! items a logit per task, as its training and evaluation read them.
//! [`history_batch`] is the one place histories become the model's batch,
//! so a server joining requests and `predict` reading a file score the
//! same batch alike, bit for bit.

use std::path::{Path, PathBuf};

use ember_dense::{DenseBackend, NativeBackend, Tensor};
use serde::{Deserialize, Serialize};

use super::histories::{history_batches, UserHistory};
use super::metrics::SequenceRetriever;
use super::{HstuRanking, HstuRankingConfig, HstuRetrieval, HstuRetrievalConfig};
use super::{SasRec, SasRecConfig};
use crate::checkpoint::{StateFile, CHECKPOINT_FILE};
use crate::{Batch, BatchError, Model, ModelError};

/// The checkpoint metadata key holding a sequence model's
/// [`SequenceModelConfig`] (JSON).
pub const SEQUENCE_MODEL_KEY: &str = "ember.sequence_model";

/// A sequence model's kind and shape, as its checkpoint records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "model", content = "config", rename_all = "kebab-case")]
pub enum SequenceModelConfig {
    /// SASRec.
    Sasrec(SasRecConfig),
    /// HSTU trained for retrieval.
    HstuRetrieval(HstuRetrievalConfig),
    /// HSTU ranking candidates (DLRMv4's shape).
    HstuRanking(HstuRankingConfig),
}

impl SequenceModelConfig {
    /// The model's name, as `train --model` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Sasrec(_) => "sasrec",
            Self::HstuRetrieval(_) => "hstu-retrieval",
            Self::HstuRanking(_) => "hstu-ranking",
        }
    }

    /// Items in the catalogue (ids `0..num_items`).
    pub fn num_items(&self) -> usize {
        match self {
            Self::Sasrec(c) => c.num_items,
            Self::HstuRetrieval(c) => c.num_items,
            Self::HstuRanking(c) => c.num_items,
        }
    }

    /// The most items of a history read (older ones are dropped).
    pub fn max_len(&self) -> usize {
        match self {
            Self::Sasrec(c) => c.maxlen,
            Self::HstuRetrieval(c) => c.max_sequence_len,
            Self::HstuRanking(c) => c.max_sequence_len,
        }
    }

    /// The candidates each history ends with and the tasks each is scored
    /// for (ranking), or `None` (retrieval).
    pub fn candidates(&self) -> Option<(usize, usize)> {
        match self {
            Self::HstuRanking(c) => Some((c.num_candidates, c.num_tasks)),
            _ => None,
        }
    }

    /// The fewest items a history holds: one for retrieval, the
    /// candidates and one item before them for ranking.
    pub fn min_history(&self) -> usize {
        self.candidates().map_or(1, |(c, _)| c + 1)
    }

    /// The recorded configuration of the checkpoint at `path` (a file, or
    /// a training run's `--checkpoint-dir`): `None` when it holds no
    /// sequence model.
    pub fn of_checkpoint(path: &Path) -> Result<Option<Self>, ModelError> {
        // Not one safetensors file (a set's index, a missing file): not a
        // sequence model's; the DLRM reader names what is wrong with it.
        match StateFile::open(&checkpoint_file(path)) {
            Ok(file) => Self::recorded(&file),
            Err(_) => Ok(None),
        }
    }

    /// The configuration `file` records, if any.
    fn recorded(file: &StateFile) -> Result<Option<Self>, ModelError> {
        let Some(json) = file.metadata(SEQUENCE_MODEL_KEY) else {
            return Ok(None);
        };
        let config = serde_json::from_str(json).map_err(|e| ModelError::Checkpoint {
            path: file.path().to_path_buf(),
            tensor: None,
            message: format!("metadata '{SEQUENCE_MODEL_KEY}': {e}"),
        })?;
        Ok(Some(config))
    }

    /// The JSON the checkpoint's metadata holds.
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain fields serialize")
    }
}

/// A run's directory holds its checkpoint as [`CHECKPOINT_FILE`].
fn checkpoint_file(path: &Path) -> PathBuf {
    match path.is_dir() {
        true => path.join(CHECKPOINT_FILE),
        false => path.to_path_buf(),
    }
}

/// Histories as the model reads them, `users` in one batch: retrieval
/// models read each history whole and score what follows it (a
/// placeholder next item, at the last item's time, stands for it);
/// ranking models read the last items as the candidates.
pub fn history_batch(
    config: &SequenceModelConfig,
    users: &[UserHistory],
) -> Result<Batch, ModelError> {
    if let Some(u) = users
        .iter()
        .position(|u| u.items.len() < config.min_history())
    {
        return Err(BatchError::Histories(format!(
            "user {u} has {} items: {} reads at least {}",
            users[u].items.len(),
            config.name(),
            config.min_history()
        ))
        .into());
    }
    let batch_size = users.len().max(1);
    let mut batches = match config {
        SequenceModelConfig::Sasrec(c) => {
            history_batches(&with_next(users), batch_size, c.maxlen + 1)
        }
        SequenceModelConfig::HstuRetrieval(c) => {
            history_batches(&with_next(users), batch_size, c.max_sequence_len + 1)
        }
        SequenceModelConfig::HstuRanking(c) => {
            history_batches(users, batch_size, c.max_sequence_len)
        }
    }?;
    match (batches.len(), batches.pop()) {
        (1, Some(batch)) => Ok(batch),
        (n, _) => {
            Err(BatchError::Histories(format!("{} users made {n} batches", users.len())).into())
        }
    }
}

/// Each history followed by a placeholder item (its last, at its time).
fn with_next(users: &[UserHistory]) -> Vec<UserHistory> {
    users
        .iter()
        .map(|u| {
            let mut u = u.clone();
            if let (Some(&item), Some(&t)) = (u.items.last(), u.timestamps.last()) {
                u.items.push(item);
                u.timestamps.push(t);
            }
            u.actions.clear();
            u
        })
        .collect()
}

/// What a batch of histories scored to.
#[derive(Clone, Debug, PartialEq)]
pub enum SequenceScores {
    /// Retrieval: each user's `k` best items, best first, and their scores
    /// (`[users, k]` row-major).
    TopItems {
        /// Item ids.
        items: Vec<i64>,
        /// Their scores (query times item, as training compares them).
        scores: Vec<f32>,
    },
    /// Ranking: each user's candidates' logits, task by task
    /// (`[users, candidates, tasks]` row-major).
    Candidates {
        /// One logit a candidate and task.
        logits: Vec<f32>,
    },
}

/// The model a checkpoint holds.
enum Loaded {
    Retriever(Box<dyn Retriever>),
    Ranking(Box<HstuRanking>),
}

/// The retrieval models' two faces.
trait Retriever: SequenceRetriever + Model + Send {}
impl<T: SequenceRetriever + Model + Send> Retriever for T {}

/// A sequence model's checkpoint, opened to score histories.
pub struct SequenceScorer {
    config: SequenceModelConfig,
    model: Loaded,
    /// Every item's row as queries meet it (retrieval; the weights do not
    /// change while scoring).
    items: Tensor<f32>,
}

impl SequenceScorer {
    /// The model of the checkpoint at `path` (a file, or a training run's
    /// `--checkpoint-dir`), which must hold a sequence model.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = checkpoint_file(path);
        let state = StateFile::open(&file)?;
        let Some(config) = SequenceModelConfig::recorded(&state)? else {
            return Err(ModelError::Checkpoint {
                path: file,
                tensor: None,
                message: format!("no sequence model recorded ('{SEQUENCE_MODEL_KEY}')"),
            });
        };
        let mut model = match &config {
            SequenceModelConfig::Sasrec(c) => {
                Loaded::Retriever(Box::new(SasRec::new(c.clone())?) as Box<dyn Retriever>)
            }
            SequenceModelConfig::HstuRetrieval(c) => {
                Loaded::Retriever(Box::new(HstuRetrieval::new(c.clone())?))
            }
            SequenceModelConfig::HstuRanking(c) => {
                Loaded::Ranking(Box::new(HstuRanking::new(c.clone())?))
            }
        };
        let items = match &mut model {
            Loaded::Retriever(m) => {
                m.load_state_dict(&state)?;
                m.item_embeddings()
            }
            Loaded::Ranking(m) => {
                m.load_state_dict(&state)?;
                Tensor::zeros(0, 0)
            }
        };
        Ok(Self {
            config,
            model,
            items,
        })
    }

    /// The model's kind and shape.
    pub fn config(&self) -> &SequenceModelConfig {
        &self.config
    }

    /// `users`' scores, in one batch: their `k` best items (retrieval),
    /// or their candidates' logits (ranking; `k` unused).
    pub fn score(&mut self, users: &[UserHistory], k: usize) -> Result<SequenceScores, ModelError> {
        let batch = history_batch(&self.config, users)?;
        self.score_batch(&batch, k)
    }

    /// What [`history_batch`] made of some histories, scored as
    /// [`score`](Self::score) does.
    /// Runs on the threads of the current rayon pool.
    pub fn score_batch(&mut self, batch: &Batch, k: usize) -> Result<SequenceScores, ModelError> {
        let be = NativeBackend::new(rayon::current_num_threads());
        match &mut self.model {
            Loaded::Retriever(m) => {
                let queries = m.user_queries(&be, batch)?;
                let (items, scores) = top_k(&be, &queries, &self.items, k);
                Ok(SequenceScores::TopItems { items, scores })
            }
            Loaded::Ranking(m) => Ok(SequenceScores::Candidates {
                logits: m.candidate_logits(&be, batch)?.to_vec(),
            }),
        }
    }
}

/// Each query's `k` best rows of `items` (`k` at most the rows), best
/// first, ties to the lower id.
fn top_k(
    be: &dyn DenseBackend<f32>,
    queries: &Tensor<f32>,
    items: &Tensor<f32>,
    k: usize,
) -> (Vec<i64>, Vec<f32>) {
    let mut scores = Tensor::zeros(0, 0);
    be.matmul(queries, false, items, true, 1.0, 0.0, &mut scores);
    let k = k.min(items.rows());
    let (mut ids, mut best) = (Vec::new(), Vec::new());
    let mut order: Vec<usize> = Vec::new();
    for u in 0..queries.rows() {
        let row = scores.row(u);
        let before = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        order.clear();
        order.extend(0..row.len());
        if k < order.len() && k > 0 {
            order.select_nth_unstable_by(k - 1, before);
        }
        order.truncate(k);
        order.sort_unstable_by(before);
        ids.extend(order.iter().map(|&i| i as i64));
        best.extend(order.iter().map(|&i| row[i]));
    }
    (ids, best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_the_best_rows_in_order_ties_to_the_lower_id() {
        let be = NativeBackend::new(1);
        let queries = Tensor::from_vec(2, 2, vec![1.0, 0.0, 0.0, 1.0]).unwrap();
        let items = Tensor::from_vec(4, 2, vec![0.5, 3.0, 2.0, 1.0, 2.0, -1.0, -4.0, 3.0]).unwrap();
        let (ids, scores) = top_k(&be, &queries, &items, 3);
        assert_eq!(ids, vec![1, 2, 0, 0, 3, 1]);
        assert_eq!(scores, vec![2.0, 2.0, 0.5, 3.0, 3.0, 1.0]);
        // More than the catalogue: every item.
        assert_eq!(top_k(&be, &queries, &items, 9).0.len(), 8);
    }

    #[test]
    fn the_config_round_trips_through_its_json() {
        let configs = [
            SequenceModelConfig::Sasrec(SasRecConfig::new(7, 5)),
            SequenceModelConfig::HstuRetrieval(HstuRetrievalConfig::new(7, 5)),
            SequenceModelConfig::HstuRanking(HstuRankingConfig::new(7, 5)),
        ];
        for c in configs {
            assert_eq!(
                serde_json::from_str::<SequenceModelConfig>(&c.to_json()).unwrap(),
                c
            );
        }
    }

    #[test]
    fn a_history_too_short_is_refused_naming_the_user() {
        let config = SequenceModelConfig::HstuRanking(HstuRankingConfig::new(20, 12));
        let user = |n: i64| UserHistory {
            items: (0..n).collect(),
            timestamps: (0..n).collect(),
            actions: vec![1; n as usize],
        };
        let err = history_batch(&config, &[user(9), user(8)]).unwrap_err();
        assert!(err.to_string().contains("user 1 has 8 items"), "{err}");
        let batch = history_batch(&config, &[user(9), user(12)]).unwrap();
        assert_eq!(batch.labels.len(), 2);
    }
}
