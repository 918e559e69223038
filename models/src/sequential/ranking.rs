//! HSTU for ranking, in the shape of DLRMv4 (MLPerf Training's HSTU
//! ranking benchmark; `DlrmHSTU` in meta-recsys/generative-recommenders):
//! a user's history of (item, action, timestamp) tokens followed by
//! candidate items, whose actions a head predicts.
//!
//! For a user whose history holds `L` items, the last `c = min(C, L - 1)`
//! are the candidates and the rest the history (`C`: `num_candidates`);
//! the most recent `max_sequence_len` tokens are read. Each token is
//!
//! ```text
//! x_j = sqrt(D) · e(item_j) + Σ_b bit_b(action_j) · A_b     (history tokens)
//! x_j = sqrt(D) · e(item_j) + A_cand                        (candidates: action unknown)
//! ```
//!
//! (`A`: a learned row per action bit, the reference's action encoder,
//! and one for "not yet acted on"). A stack of [`HstuLayer`](ember_dense::HstuLayer)s reads the
//! sequence with the candidate mask (a candidate sees the history and
//! itself, never another candidate). At each candidate, with `h` its
//! output and `e` its item's row,
//!
//! ```text
//! logits = MLP([h, h ⊙ sqrt(D) · e])        ([2D] → hidden → num_tasks, ReLU between)
//! loss   = mean over candidates and tasks of BCE(logit_t, bit_t(action))
//! ```
//!
//! Adam (betas 0.9, 0.98 unless set) trains the layers, the action rows and the
//! head; the item table has its own fused optimizer (DLRMv4: row-wise
//! Adagrad). Quality is reported as AUC per task ([`HstuRanking::evaluate`]).

use ember_dense::jagged::Jagged;
use ember_dense::{
    Activation, DenseBackend, DenseOptimizer, DenseOptimizerConfig, HasParams, HstuConfig,
    HstuInput, Mlp, Param, Tensor,
};
use ember_sparse::{
    EmbeddingCollection, EmbeddingConfig, JaggedEmbeddings, KeyedJaggedTensor, TableOptimizer,
};
use serde::{Deserialize, Serialize};

use super::histories::{history_batches, UserHistory, ACTIONS_FEATURE, HISTORY_FEATURE};
use super::stack::{reference_betas, strict_only, HstuStack};
use crate::checkpoint::{StateDict, StateFile};
use crate::metrics::{Metrics, MetricsAccumulator};
use crate::{Backend, Batch, ExecMode, Model, ModelError, StepOutput, Unsupported};

/// An [`HstuRanking`]'s shape and training options.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HstuRankingConfig {
    /// Items (ids `0..num_items`).
    pub num_items: usize,
    /// Item embedding and token width `D`.
    pub embedding_dim: usize,
    /// HSTU layers.
    pub num_blocks: usize,
    /// Heads a layer.
    pub num_heads: usize,
    /// Query and key width per head.
    pub attention_dim: usize,
    /// Value and gate width per head.
    pub linear_dim: usize,
    /// The most tokens read, candidates included (older history dropped).
    pub max_sequence_len: usize,
    /// Candidates a user: the last items of its history.
    pub num_candidates: usize,
    /// Action bits, each a task the head predicts (bit `t` of an action is
    /// task `t`'s label) and an action row of the tokens.
    pub num_tasks: usize,
    /// The head's hidden width.
    pub head_hidden: usize,
    /// The layers' dropout.
    pub dropout_rate: f64,
    /// Adam's learning rate for the dense parts.
    pub learning_rate: f32,
    /// Adam's two decays (HSTU's reference: 0.9, 0.98; DLRMv4's rules:
    /// 0.95, 0.999).
    #[serde(default = "reference_betas")]
    pub adam_betas: (f32, f32),
    /// The item table's fused optimizer.
    pub table_optimizer: TableOptimizer,
    /// Seeds the weights and the dropout.
    pub seed: u64,
}

impl HstuRankingConfig {
    /// DLRMv4's layer shape scaled to a small table: width 64, 2 blocks of
    /// 2 heads, 8 candidates, 2 tasks, dropout 0.2; Adam at 1e-3 and
    /// row-wise Adagrad at 0.05 for the items.
    pub fn new(num_items: usize, max_sequence_len: usize) -> Self {
        Self {
            num_items,
            embedding_dim: 64,
            num_blocks: 2,
            num_heads: 2,
            attention_dim: 32,
            linear_dim: 32,
            max_sequence_len,
            num_candidates: 8,
            num_tasks: 2,
            head_hidden: 64,
            dropout_rate: 0.2,
            learning_rate: 1e-3,
            adam_betas: reference_betas(),
            table_optimizer: TableOptimizer::RowWiseAdagrad {
                lr: 0.05,
                eps: 1e-8,
            },
            seed: 0,
        }
    }
}

/// AUC and log loss per task over a set of users' candidates.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankingMetrics {
    /// Candidates scored.
    pub candidates: usize,
    /// One per task (action bit), in bit order.
    pub tasks: Vec<Metrics>,
}

/// HSTU trained to rank candidates by their actions (see the
/// [module docs](self)).
pub struct HstuRanking {
    config: HstuRankingConfig,
    items: EmbeddingCollection,
    dense: DenseParts,
    optimizer: DenseOptimizer<f32>,
    /// Clip the dense gradients at this global norm (set by the Trainer).
    max_grad_norm: Option<f32>,
    /// Each candidate's logits, task by task.
    logits: Vec<f32>,
    /// The last forward's item rows, kept from step to step.
    looked: JaggedEmbeddings,
}

struct DenseParts {
    /// `[num_tasks + 1, D]`: a row per action bit, then the candidates'.
    actions: Tensor<f32>,
    actions_grad: Tensor<f32>,
    layers: HstuStack,
    head: Mlp<f32>,
}

impl DenseParts {
    fn params(&mut self) -> Vec<Param<'_, f32>> {
        let (n, d) = self.actions.shape();
        let mut params = vec![Param::new(
            "_action_encoder._action_embedding.weight",
            self.actions.data_mut(),
            self.actions_grad.data_mut(),
        )
        .with_shape(&[n, d])];
        params.extend(self.layers.params());
        params
            .extend((self.head.params().into_iter()).map(|p| p.with_prefix("_multitask_module.")));
        params
    }
}

/// One batch's tokens: per user, its history then its candidates.
struct RankTokens {
    lengths: Vec<usize>,
    candidates: Vec<usize>,
    ids: Vec<i64>,
    times: Vec<i64>,
    actions: Vec<i64>,
    /// The rows of every candidate, in order.
    candidate_rows: Vec<usize>,
}

impl RankTokens {
    fn of(batch: &Batch, num_candidates: usize, max_len: usize) -> Result<Self, ModelError> {
        let kjt = &batch.sparse;
        let feature = |name: &str| {
            kjt.key_index(name)
                .ok_or_else(|| ember_sparse::SparseError::MissingFeature(name.into()))
        };
        let (h, a) = (feature(HISTORY_FEATURE)?, feature(ACTIONS_FEATURE)?);
        let b = kjt.stride();
        let (offsets, values) = (kjt.offsets(), kjt.values());
        let weights = kjt.weights();
        let mut t = RankTokens {
            lengths: Vec::with_capacity(b),
            candidates: Vec::with_capacity(b),
            ids: Vec::new(),
            times: Vec::new(),
            actions: Vec::new(),
            candidate_rows: Vec::new(),
        };
        for s in 0..b {
            let (start, end) = (offsets[h * b + s], offsets[h * b + s + 1]);
            let a_start = offsets[a * b + s];
            let len = end - start;
            if offsets[a * b + s + 1] - a_start != len {
                let what =
                    format!("sample {s}: {ACTIONS_FEATURE} and {HISTORY_FEATURE} differ in length");
                return Err(crate::BatchError::Histories(what).into());
            }
            // At least one history token before the candidates.
            let c = num_candidates.min(len.saturating_sub(1));
            let skip = len.saturating_sub(max_len.max(c + 1));
            t.lengths.push(len - skip);
            t.candidates.push(c);
            t.ids.extend_from_slice(&values[start + skip..end]);
            let actions = &values[a_start + skip..a_start + len];
            if let Some(a) = actions.iter().find(|&&a| a < 0) {
                let what = format!("sample {s}: action {a} is negative (actions are bit masks)");
                return Err(crate::BatchError::Histories(what).into());
            }
            t.actions.extend_from_slice(actions);
            t.times
                .extend((start + skip..end).map(|p| weights.map_or(0, |w| w[p] as i64)));
        }
        let mut at = 0;
        for (&n, &c) in t.lengths.iter().zip(&t.candidates) {
            t.candidate_rows.extend(at + n - c..at + n);
            at += n;
        }
        Ok(t)
    }

    /// Whether token `r` of sample `s` (whose first token is `at`) is a candidate.
    fn is_candidate(&self, s: usize, at: usize, r: usize) -> bool {
        r >= at + self.lengths[s] - self.candidates[s]
    }

    /// The action rows token `r` of sample `s` (whose first token is `at`)
    /// adds: the candidates' row (`tasks`) for a candidate, else one per
    /// bit of its action below `tasks`.
    fn action_rows(
        &self,
        s: usize,
        at: usize,
        r: usize,
        tasks: usize,
    ) -> impl Iterator<Item = usize> {
        // Bit k set: row k added (tasks <= 62, actions checked non-negative).
        let mask = match self.is_candidate(s, at, r) {
            true => 1u64 << tasks,
            false => self.actions[r] as u64 & ((1u64 << tasks) - 1),
        };
        (0..=tasks).filter(move |&k| mask >> k & 1 == 1)
    }
}

impl HstuRanking {
    /// A new model of `config`.
    pub fn new(config: HstuRankingConfig) -> Result<Self, ModelError> {
        let d = config.embedding_dim;
        let sizes = [
            d,
            config.max_sequence_len,
            config.num_items,
            config.num_heads,
            config.attention_dim,
            config.linear_dim,
            config.num_candidates,
            config.num_tasks,
            config.head_hidden,
        ];
        let bad = |what: String| Err(crate::ArchitectureError::Sequence(what).into());
        if sizes.contains(&0) {
            return bad(format!("every size is at least 1: {config:?}"));
        }
        if config.num_tasks > 62 {
            return bad(format!(
                "num_tasks {}: at most 62 action bits",
                config.num_tasks
            ));
        }
        if config.num_candidates >= config.max_sequence_len {
            return bad(format!(
                "num_candidates {} leaves no history in max_sequence_len {}",
                config.num_candidates, config.max_sequence_len
            ));
        }
        let table = EmbeddingConfig::new("items", config.num_items, d, &[HISTORY_FEATURE]);
        let items = EmbeddingCollection::new(vec![table], config.table_optimizer, config.seed)?;
        let layer = HstuConfig {
            attention_dim: config.attention_dim,
            linear_dim: config.linear_dim,
            dropout: config.dropout_rate,
            ..HstuConfig::new(d, config.num_heads, config.max_sequence_len)
        };
        let layers = HstuStack::new(&layer, config.num_blocks, config.seed);
        let mut init = ember_dense::Initializer::new(config.seed ^ 0xac71);
        let std = 1.0 / (d as f64).sqrt();
        let actions = Tensor::from_fn(config.num_tasks + 1, d, |_, _| init.normal(0.0, std) as f32);
        let head_sizes = [2 * d, config.head_hidden, config.num_tasks];
        Ok(Self {
            dense: DenseParts {
                actions_grad: Tensor::zeros(config.num_tasks + 1, d),
                actions,
                layers,
                head: Mlp::new(&head_sizes, Activation::None, config.seed ^ 0x4ead),
            },
            optimizer: DenseOptimizer::new(DenseOptimizerConfig::Adam {
                lr: config.learning_rate,
                beta1: config.adam_betas.0,
                beta2: config.adam_betas.1,
                eps: 1e-8,
            }),
            max_grad_norm: None,
            logits: Vec::new(),
            looked: JaggedEmbeddings::default(),
            items,
            config,
        })
    }

    /// The item table's fused optimizer and the dense layers' optimizer.
    pub fn optimizers(&self) -> (TableOptimizer, ember_dense::DenseOptimizerConfig) {
        (*self.items.optimizer(), self.optimizer.config())
    }

    /// The model's shape and options.
    pub fn config(&self) -> &HstuRankingConfig {
        &self.config
    }

    /// The tokens' lookup (every token of the one item table).
    fn lookup(t: &RankTokens) -> Result<KeyedJaggedTensor, ModelError> {
        let lengths: Vec<i64> = t.lengths.iter().map(|&n| n as i64).collect();
        let keys = vec![HISTORY_FEATURE.to_string()];
        Ok(KeyedJaggedTensor::from_lengths(
            keys,
            t.ids.clone(),
            &lengths,
            None,
        )?)
    }

    /// Forward to the logits, which land in `self.logits` (the looked-up
    /// rows in `self.looked`); returns the lookup and the layers' output,
    /// for the backward.
    fn forward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        t: &RankTokens,
        training: bool,
    ) -> Result<(KeyedJaggedTensor, Jagged<f32>), ModelError> {
        let (d, tasks) = (self.config.embedding_dim, self.config.num_tasks);
        let scale = (d as f32).sqrt();
        let kjt = Self::lookup(t)?;
        self.items.forward_into(&kjt, &mut self.looked)?;
        let e = self.looked.values();
        let total = t.ids.len();
        let mut x = Tensor::zeros(total, d);
        let mut at = 0;
        for s in 0..t.lengths.len() {
            for r in at..at + t.lengths[s] {
                let row = x.row_mut(r);
                for (o, &v) in row.iter_mut().zip(&e[r * d..(r + 1) * d]) {
                    *o = v * scale;
                }
                for k in t.action_rows(s, at, r, tasks) {
                    for (o, &v) in row.iter_mut().zip(self.dense.actions.row(k)) {
                        *o += v;
                    }
                }
            }
            at += t.lengths[s];
        }
        let input = HstuInput {
            timestamps: Some(&t.times),
            query_times: None,
            targets: Some(&t.candidates),
        };
        self.dense.layers.set_training(training);
        let h = (self.dense.layers).forward(be, Jagged::from_lengths(x, &t.lengths)?, input);
        let rows = &t.candidate_rows;
        let mut z = Tensor::zeros(rows.len(), 2 * d);
        for (c, &r) in rows.iter().enumerate() {
            let (hr, er) = (h.values().row(r), &e[r * d..(r + 1) * d]);
            let zr = z.row_mut(c);
            zr[..d].copy_from_slice(hr);
            for ((o, &hv), &ev) in zr[d..].iter_mut().zip(hr).zip(er) {
                *o = hv * ev * scale;
            }
        }
        let logits = self.dense.head.forward(be, &z);
        self.logits.clear();
        self.logits.extend_from_slice(logits.data());
        Ok((kjt, h))
    }

    /// Each candidate's labels, task by task (bit `t` of its action).
    fn labels(&self, t: &RankTokens) -> Vec<f32> {
        let tasks = self.config.num_tasks;
        (t.candidate_rows.iter())
            .flat_map(|&r| (0..tasks).map(move |b| (t.actions[r] >> b & 1) as f32))
            .collect()
    }

    /// The mean loss of `t` and every gradient: the dense parts' in place,
    /// the lookup's returned with its KJT (nothing updated).
    fn loss_backward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        t: &RankTokens,
    ) -> Result<(f64, KeyedJaggedTensor, Vec<f32>), ModelError> {
        let (d, tasks) = (self.config.embedding_dim, self.config.num_tasks);
        let scale = (d as f32).sqrt();
        let (kjt, h) = self.forward(be, t, true)?;
        let e = self.looked.values();
        // Mean BCE over candidates and tasks, and its gradient.
        let labels = self.labels(t);
        let n = labels.len().max(1) as f64;
        let mut loss = 0.0;
        let dlogits: Vec<f32> = (self.logits.iter().zip(&labels))
            .map(|(&z, &y)| {
                let z64 = z as f64;
                loss += z64.max(0.0) - z64 * y as f64 + (-z64.abs()).exp().ln_1p();
                ((1.0 / (1.0 + (-z64).exp()) - y as f64) / n) as f32
            })
            .collect();
        let rows = &t.candidate_rows;
        let dlogits = Tensor::from_vec(rows.len(), tasks, dlogits)?;
        let dz = self
            .dense
            .head
            .backward(be, &dlogits, true)
            .expect("asked for")
            .clone();
        // z = [h, h ⊙ s·e]: into the layers' output gradient and the items'.
        let total = t.ids.len();
        let h_values = h.values();
        let mut dh = Tensor::zeros(total, d);
        let mut de = vec![0.0f32; total * d];
        for (c, &r) in rows.iter().enumerate() {
            let (dzr, hr, er) = (dz.row(c), h_values.row(r), &e[r * d..(r + 1) * d]);
            let dhr = dh.row_mut(r);
            for k in 0..d {
                dhr[k] = dzr[k] + dzr[d + k] * er[k] * scale;
                de[r * d + k] = dzr[d + k] * hr[k] * scale;
            }
        }
        let dx = (self.dense.layers).backward(be, Jagged::from_lengths(dh, &t.lengths)?);
        // x = s·e + action rows.
        self.dense.actions_grad.fill(0.0);
        let mut at = 0;
        for s in 0..t.lengths.len() {
            for r in at..at + t.lengths[s] {
                let g = dx.values().row(r);
                for (o, &v) in de[r * d..(r + 1) * d].iter_mut().zip(g) {
                    *o += v * scale;
                }
                for k in t.action_rows(s, at, r, tasks) {
                    for (o, &v) in self.dense.actions_grad.row_mut(k).iter_mut().zip(g) {
                        *o += v;
                    }
                }
            }
            at += t.lengths[s];
        }
        Ok((loss / n, kjt, de))
    }

    /// Every candidate's logits in `batch`, task by task (`[candidates,
    /// num_tasks]` row-major; each user's candidates in order).
    pub fn candidate_logits(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<&[f32], ModelError> {
        let (c, n) = (self.config.num_candidates, self.config.max_sequence_len);
        let t = RankTokens::of(batch, c, n)?;
        self.forward(be, &t, false)?;
        Ok(&self.logits)
    }

    /// AUC and log loss per task of every candidate of `users` (each
    /// user's last `num_candidates` items, as training reads them), in
    /// batches of `batch_size`.
    pub fn evaluate(
        &mut self,
        be: &dyn DenseBackend<f32>,
        users: &[UserHistory],
        batch_size: usize,
    ) -> Result<RankingMetrics, ModelError> {
        let tasks = self.config.num_tasks;
        let mut acc = vec![MetricsAccumulator::default(); tasks];
        let mut candidates = 0;
        for batch in history_batches(users, batch_size, self.config.max_sequence_len)? {
            let t = RankTokens::of(
                &batch,
                self.config.num_candidates,
                self.config.max_sequence_len,
            )?;
            self.forward(be, &t, false)?;
            let labels = self.labels(&t);
            candidates += labels.len() / tasks;
            for (k, a) in acc.iter_mut().enumerate() {
                let column =
                    |v: &[f32]| v.iter().skip(k).step_by(tasks).copied().collect::<Vec<_>>();
                a.push(&column(&self.logits), &column(&labels));
            }
        }
        Ok(RankingMetrics {
            candidates,
            tasks: acc.iter().map(MetricsAccumulator::finish).collect(),
        })
    }
}

impl Model for HstuRanking {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        strict_only("HSTU ranking", mode)?;
        let seed = super::step_seed(self.config.seed, self.items.step());
        self.dense.layers.reseed(seed);
        let t = RankTokens::of(
            batch,
            self.config.num_candidates,
            self.config.max_sequence_len,
        )?;
        let (loss, kjt, de) = self.loss_backward(backend.dense(), &t)?;
        self.items.backward_update(&kjt, &de)?;
        super::dense_step(&mut self.optimizer, self.dense.params(), self.max_grad_norm);
        Ok(StepOutput {
            loss: loss as f32,
            times: Default::default(),
        })
    }

    /// The item table's rate and decay, the dense rate and decay, and
    /// the clipping of the dense gradients.
    fn set_optimization(
        &mut self,
        optimization: &crate::Optimization,
        step: u64,
    ) -> Result<(), ModelError> {
        self.max_grad_norm =
            super::set_optimization(optimization, step, &mut self.items, &mut self.optimizer)?;
        Ok(())
    }

    /// Refused: the model scores each candidate for each task, not one
    /// logit per sample; [`HstuRanking::candidate_logits`] gives the scores
    /// and [`HstuRanking::evaluate`] the metrics.
    fn predict(&mut self, _: &Backend, _: &Batch) -> Result<&[f32], ModelError> {
        Err(Unsupported::NotPerSample {
            model: "HSTU ranking",
            what: "each candidate for each task",
            instead: "HstuRanking::candidate_logits or HstuRanking::evaluate",
        }
        .into())
    }

    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        let mut state = StateDict::new();
        let config = super::SequenceModelConfig::HstuRanking(self.config.clone());
        state.metadata(super::SEQUENCE_MODEL_KEY, config.to_json());
        state.add_trained("", &self.optimizer, self.dense.params());
        state.add_embedding_collection("_embedding_collection.", &self.items);
        Ok(state)
    }

    fn load_state_dict(&mut self, file: &StateFile) -> Result<(), ModelError> {
        file.load_embedding_collection("_embedding_collection.", &mut self.items)?;
        file.load_trained("", &mut self.optimizer, self.dense.params())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_dense::NativeBackend;

    /// The model's own gradients (the action rows, the head, the item
    /// rows: the parts around the layers, whose own are checked in
    /// ember-dense) against central differences of its loss.
    #[test]
    fn gradients_match_finite_differences() {
        let config = HstuRankingConfig {
            embedding_dim: 8,
            num_blocks: 1,
            attention_dim: 4,
            linear_dim: 4,
            num_candidates: 2,
            head_hidden: 6,
            dropout_rate: 0.0,
            ..HstuRankingConfig::new(12, 10)
        };
        let mut model = HstuRanking::new(config).unwrap();
        let user = |items: &[i64], actions: &[i64]| UserHistory {
            items: items.to_vec(),
            timestamps: (0..items.len() as i64).map(|t| 100 + 50 * t).collect(),
            actions: actions.to_vec(),
        };
        let users = [
            user(&[1, 2, 3, 4, 5], &[1, 3, 0, 2, 1]),
            user(&[6, 2], &[2, 3]),
            user(&[7, 8, 9, 1], &[0, 1, 3, 2]),
        ];
        let batch = history_batches(&users, 3, 20).unwrap().remove(0);
        let be = NativeBackend::new(1);
        let t = RankTokens::of(&batch, 2, 10).unwrap();
        let (_, kjt, de) = model.loss_backward(&be, &t).unwrap();
        let actions_grad = model.dense.actions_grad.data().to_vec();
        let head_grad: Vec<f32> = model
            .dense
            .head
            .params()
            .iter()
            .flat_map(|p| p.grad.to_vec())
            .collect();
        let loss = |m: &mut HstuRanking| m.loss_backward(&be, &t).unwrap().0;
        let eps = 1e-2f32;
        let close = |fd: f64, g: f32, what: String| {
            assert!(
                (fd - g as f64).abs() <= 1e-3 + 2e-2 * fd.abs(),
                "{what}: {fd} vs {g}"
            );
        };
        for k in [0, 5, 9, 17, 20] {
            let at = model.dense.actions.data()[k];
            model.dense.actions.data_mut()[k] = at + eps;
            let up = loss(&mut model);
            model.dense.actions.data_mut()[k] = at - eps;
            let down = loss(&mut model);
            model.dense.actions.data_mut()[k] = at;
            close(
                (up - down) / (2.0 * eps as f64),
                actions_grad[k],
                format!("action {k}"),
            );
        }
        for k in [0, 7, 30, 95, 101] {
            let nudge = |m: &mut HstuRanking, v: f32| {
                let mut seen = 0;
                for p in m.dense.head.params() {
                    if k < seen + p.value.len() {
                        p.value[k - seen] += v;
                        return;
                    }
                    seen += p.value.len();
                }
            };
            nudge(&mut model, eps);
            let up = loss(&mut model);
            nudge(&mut model, -2.0 * eps);
            let down = loss(&mut model);
            nudge(&mut model, eps);
            close(
                (up - down) / (2.0 * eps as f64),
                head_grad[k],
                format!("head {k}"),
            );
        }
        // Item 2 is read twice (by two users); its gradient is the sum.
        for (item, col) in [(2usize, 3usize), (5, 0), (8, 7)] {
            let g: f32 = (kjt.values().iter().enumerate())
                .filter(|(_, &id)| id as usize == item)
                .map(|(r, _)| de[r * 8 + col])
                .sum();
            let row = model.items.tables()[0].row(item).to_vec();
            let set = |m: &mut HstuRanking, v: f32| {
                let mut r = row.clone();
                r[col] += v;
                m.items.tables_mut()[0].write_row(item, &r);
            };
            set(&mut model, eps);
            let up = loss(&mut model);
            set(&mut model, -eps);
            let down = loss(&mut model);
            set(&mut model, 0.0);
            close((up - down) / (2.0 * eps as f64), g, format!("item {item}"));
        }
    }
}
