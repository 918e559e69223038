//! The sequence models from Python: users' histories, their loader, and
//! SASRec, HSTU retrieval and HSTU ranking as Ember trains them (tables
//! and layers in Rust), for `Trainer.fit` and their own evaluations.

use std::path::PathBuf;

use ember_models::sequential::{
    evaluate_retrieval, read_histories, EvalNegatives, HistoryLoader as Loader, HstuRanking,
    HstuRankingConfig, HstuRetrieval, HstuRetrievalConfig, LeaveOut, NegativeSampling, SasRec,
    SasRecConfig, SasRecLoss, SequenceRetriever, UserHistory,
};
use ember_models::{Backend, Model};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::errors;
use crate::train::to_python;

/// Users' histories in time order (Ember's `UserHistory`s).
#[pyclass(module = "ember._native", frozen)]
pub struct Histories {
    pub users: Vec<UserHistory>,
}

#[pymethods]
impl Histories {
    /// From lists, one a user: item ids, and optionally timestamps
    /// (non-decreasing; default: positions) and actions (bit masks).
    #[new]
    #[pyo3(signature = (items, timestamps=None, actions=None))]
    fn new(
        items: Vec<Vec<i64>>,
        timestamps: Option<Vec<Vec<i64>>>,
        actions: Option<Vec<Vec<i64>>>,
    ) -> PyResult<Self> {
        let n = items.len();
        for (what, given) in [("timestamps", &timestamps), ("actions", &actions)] {
            if let Some(g) = given.as_ref().filter(|g| g.len() != n) {
                return Err(PyValueError::new_err(format!(
                    "{what}: {} users, but items has {n}",
                    g.len()
                )));
            }
        }
        let mut timestamps = timestamps.map(Vec::into_iter);
        let mut actions = actions.map(Vec::into_iter);
        let mut users = Vec::with_capacity(n);
        for (u, items) in items.into_iter().enumerate() {
            let timestamps = match timestamps.as_mut().and_then(Iterator::next) {
                Some(t) => t,
                None => (0..items.len() as i64).collect(),
            };
            let actions = actions
                .as_mut()
                .and_then(Iterator::next)
                .unwrap_or_default();
            let user = UserHistory {
                items,
                timestamps,
                actions,
            };
            if let Some((column, m)) = user.fault() {
                return Err(PyValueError::new_err(format!("user {u}: {column}: {m}")));
            }
            users.push(user);
        }
        Ok(Self { users })
    }

    /// A user-history Parquet file (`ember ingest sequences`).
    #[staticmethod]
    fn read(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let users = py.detach(|| read_histories(&path)).map_err(errors::data)?;
        Ok(Self { users })
    }

    fn __len__(&self) -> usize {
        self.users.len()
    }

    /// One more than the largest item id (the item table's rows).
    #[getter]
    fn num_items(&self) -> usize {
        let max = self.users.iter().flat_map(|u| &u.items).max();
        max.map_or(0, |&m| m as usize + 1)
    }

    /// User `u`'s items.
    fn items(&self, u: usize) -> PyResult<Vec<i64>> {
        let user = self.users.get(u).ok_or_else(|| {
            PyIndexError::new_err(format!("user {u}: there are {}", self.users.len()))
        })?;
        Ok(user.items.clone())
    }

    /// The references' evaluation split (`held` items a user for
    /// validation, `held` for test): `(train, valid, test)`.
    #[pyo3(signature = (held=1))]
    fn leave_out(&self, held: usize) -> PyResult<(Self, Self, Self)> {
        if held == 0 {
            return Err(PyValueError::new_err("held: at least 1 item a user"));
        }
        let LeaveOut { train, valid, test } = LeaveOut::split(&self.users, held);
        Ok((
            Self { users: train },
            Self { users: valid },
            Self { users: test },
        ))
    }
}

/// Histories as shuffled batches for a sequence model (Ember's
/// `HistoryLoader`), made by `SequenceModel.loader`.
#[pyclass(module = "ember._native", frozen)]
pub struct HistoryLoader {
    pub loader: Loader,
}

#[pymethods]
impl HistoryLoader {
    /// Batches an epoch.
    fn batches_per_epoch(&self, epoch: u64) -> u64 {
        ember_models::TrainData::batches_per_epoch(&self.loader, epoch)
    }
}

/// The model being trained (boxed: one of them lives for the run).
enum Built {
    SasRec(Box<SasRec>),
    Retrieval(Box<HstuRetrieval>),
    Ranking(Box<HstuRanking>),
}

/// SASRec, HSTU retrieval or HSTU ranking (Ember's).
#[pyclass(module = "ember._native")]
pub struct SequenceModel {
    built: Built,
    backend: Backend,
}

impl SequenceModel {
    fn of(built: Built) -> Self {
        Self {
            built,
            backend: Backend::native(),
        }
    }

    /// The model, for the Trainer.
    pub fn model(&mut self) -> &mut (dyn Model + Send) {
        match &mut self.built {
            Built::SasRec(m) => m.as_mut(),
            Built::Retrieval(m) => m.as_mut(),
            Built::Ranking(m) => m.as_mut(),
        }
    }

    /// The most recent items read a user.
    fn max_len(&self) -> usize {
        match &self.built {
            Built::SasRec(m) => m.config().maxlen,
            Built::Retrieval(m) => m.config().max_sequence_len,
            Built::Ranking(m) => m.config().max_sequence_len,
        }
    }
}

fn sampling(name: &str) -> PyResult<NegativeSampling> {
    match name {
        "uniform" => Ok(NegativeSampling::Uniform),
        "in_batch" => Ok(NegativeSampling::InBatch),
        other => Err(PyValueError::new_err(format!(
            "negative_sampling '{other}': 'uniform' or 'in_batch'"
        ))),
    }
}

#[pymethods]
impl SequenceModel {
    /// SASRec with the public PyTorch SASRec's arguments (`loss`: "bce",
    /// its own, or "sampled_softmax" with `num_negatives` and `temperature`).
    #[staticmethod]
    #[pyo3(signature = (num_items, maxlen, hidden_units, num_blocks, num_heads, dropout_rate, lr, norm_first, loss, num_negatives, temperature, seed))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn sasrec(
        py: Python<'_>,
        num_items: usize,
        maxlen: usize,
        hidden_units: usize,
        num_blocks: usize,
        num_heads: usize,
        dropout_rate: f64,
        lr: f32,
        norm_first: bool,
        loss: &str,
        num_negatives: usize,
        temperature: f32,
        seed: u64,
    ) -> PyResult<Self> {
        let loss = match loss {
            "bce" => SasRecLoss::Bce,
            "sampled_softmax" => SasRecLoss::SampledSoftmax {
                negatives: num_negatives,
                temperature,
            },
            other => {
                return Err(PyValueError::new_err(format!(
                    "loss '{other}': 'bce' or 'sampled_softmax'"
                )))
            }
        };
        let config = SasRecConfig {
            hidden_units,
            num_blocks,
            num_heads,
            dropout_rate,
            lr,
            norm_first,
            loss,
            seed,
            ..SasRecConfig::new(num_items, maxlen)
        };
        let model = py.detach(|| SasRec::new(config)).map_err(errors::model)?;
        Ok(Self::of(Built::SasRec(Box::new(model))))
    }

    /// HSTU trained for next-item retrieval with sampled softmax.
    #[staticmethod]
    #[pyo3(signature = (num_items, max_sequence_len, embedding_dim, num_blocks, num_heads, attention_dim, linear_dim, num_negatives, negative_sampling, temperature, dropout_rate, learning_rate, seed))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn hstu_retrieval(
        py: Python<'_>,
        num_items: usize,
        max_sequence_len: usize,
        embedding_dim: usize,
        num_blocks: usize,
        num_heads: usize,
        attention_dim: usize,
        linear_dim: usize,
        num_negatives: usize,
        negative_sampling: &str,
        temperature: f32,
        dropout_rate: f64,
        learning_rate: f32,
        seed: u64,
    ) -> PyResult<Self> {
        let config = HstuRetrievalConfig {
            embedding_dim,
            num_blocks,
            num_heads,
            attention_dim,
            linear_dim,
            num_negatives,
            negative_sampling: sampling(negative_sampling)?,
            temperature,
            dropout_rate,
            learning_rate,
            seed,
            ..HstuRetrievalConfig::new(num_items, max_sequence_len)
        };
        let model = py
            .detach(|| HstuRetrieval::new(config))
            .map_err(errors::model)?;
        Ok(Self::of(Built::Retrieval(Box::new(model))))
    }

    /// HSTU ranking candidates' actions (DLRMv4's shape); the item table's
    /// optimizer is Ember's `TableOptimizer` as JSON (`None`: row-wise
    /// Adagrad at 0.05).
    #[staticmethod]
    #[pyo3(signature = (num_items, max_sequence_len, embedding_dim, num_blocks, num_heads, attention_dim, linear_dim, num_candidates, num_tasks, head_hidden, dropout_rate, learning_rate, table_optimizer_json, seed))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn hstu_ranking(
        py: Python<'_>,
        num_items: usize,
        max_sequence_len: usize,
        embedding_dim: usize,
        num_blocks: usize,
        num_heads: usize,
        attention_dim: usize,
        linear_dim: usize,
        num_candidates: usize,
        num_tasks: usize,
        head_hidden: usize,
        dropout_rate: f64,
        learning_rate: f32,
        table_optimizer_json: Option<&str>,
        seed: u64,
    ) -> PyResult<Self> {
        let defaults = HstuRankingConfig::new(num_items, max_sequence_len);
        let table_optimizer = match table_optimizer_json {
            Some(json) => crate::tables::parse_optimizer(json)?,
            None => defaults.table_optimizer,
        };
        let config = HstuRankingConfig {
            embedding_dim,
            num_blocks,
            num_heads,
            attention_dim,
            linear_dim,
            num_candidates,
            num_tasks,
            head_hidden,
            dropout_rate,
            learning_rate,
            table_optimizer,
            seed,
            ..defaults
        };
        let model = py
            .detach(|| HstuRanking::new(config))
            .map_err(errors::model)?;
        Ok(Self::of(Built::Ranking(Box::new(model))))
    }

    /// `histories` as batches of `batch_size` users for this model (each
    /// cut to the items it reads), shuffled by `shuffle_seed` each epoch
    /// if given, sorted by length in windows of `bucket_batches` batches.
    #[pyo3(signature = (histories, batch_size=128, shuffle_seed=None, bucket_batches=1))]
    fn loader(
        &self,
        histories: &Histories,
        batch_size: usize,
        shuffle_seed: Option<u64>,
        bucket_batches: usize,
    ) -> PyResult<HistoryLoader> {
        if batch_size == 0 || bucket_batches == 0 {
            return Err(PyValueError::new_err(
                "batch_size and bucket_batches: at least 1 each",
            ));
        }
        // Retrieval reads the inputs and the item after them.
        let window = match self.built {
            Built::Ranking(_) => self.max_len(),
            _ => self.max_len() + 1,
        };
        let mut loader =
            Loader::new(histories.users.clone(), batch_size, window).bucketed(bucket_batches);
        if let Some(seed) = shuffle_seed {
            loader = loader.shuffled(seed);
        }
        if loader.users().is_empty() {
            return Err(PyValueError::new_err(
                "no user has 2 items or more to train on",
            ));
        }
        Ok(HistoryLoader { loader })
    }

    /// Quality on `histories` (each user's last items held out, as
    /// `leave_out` makes them), as a dict. Retrieval (SASRec, HSTU
    /// retrieval): HR@`top_k`, NDCG@`top_k` and MRR, each last item ranked
    /// against `negatives` ("all" items, or that many sampled ones the user
    /// never saw). Ranking: AUC and log loss by task. The GIL is released
    /// while it runs.
    #[pyo3(signature = (histories, negatives=None, top_k=10))]
    fn evaluate<'py>(
        &mut self,
        py: Python<'py>,
        histories: &Histories,
        negatives: Option<usize>,
        top_k: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let max_len = self.max_len();
        let (built, backend, users) = (&mut self.built, &self.backend, &histories.users);
        let retriever: &mut (dyn SequenceRetriever + Send) = match built {
            Built::SasRec(m) => m.as_mut(),
            Built::Retrieval(m) => m.as_mut(),
            Built::Ranking(m) => {
                let metrics = py
                    .detach(|| m.evaluate(backend.dense(), users, 256))
                    .map_err(errors::model)?;
                return to_python(py, &metrics);
            }
        };
        if top_k == 0 {
            return Err(PyValueError::new_err("top_k: at least 1"));
        }
        let negatives = match negatives {
            None => EvalNegatives::All,
            Some(0) => return Err(PyValueError::new_err("negatives: at least 1, or all")),
            Some(n) => EvalNegatives::Sampled(n),
        };
        let metrics = py
            .detach(|| {
                evaluate_retrieval(
                    retriever,
                    backend.dense(),
                    users,
                    (max_len + 1, 256),
                    (negatives, top_k),
                    1,
                )
            })
            .map_err(errors::model)?;
        to_python(py, &metrics)
    }

    /// Saves a checkpoint into `dir`; returns its path.
    fn save(&mut self, py: Python<'_>, dir: PathBuf) -> PyResult<PathBuf> {
        let model = self.model();
        py.detach(|| model.save_checkpoint(&dir, None))
            .map_err(errors::model)
    }

    /// Loads a checkpoint's weights and optimizer state.
    fn load(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let model = self.model();
        py.detach(|| model.load_checkpoint(&path))
            .map(|_| ())
            .map_err(errors::model)
    }
}
