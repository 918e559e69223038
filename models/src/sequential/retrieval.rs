//! HSTU for retrieval: next-item prediction over a user's history with
//! sampled softmax, as the reference's research configs train it
//! (meta-recsys/generative-recommenders, `research/`).
//!
//! Each history token is its item's embedding times `sqrt(D)` plus a
//! learned position embedding, with dropout (the reference's input
//! preprocessor, at the layers' rate); a stack of [`HstuLayer`](ember_dense::HstuLayer)s reads the
//! sequence; each output, L2-normalised, is the query for the next item.
//! The loss at each position is the softmax cross-entropy of the next
//! item against `num_negatives` items drawn uniformly, or from the batch's
//! positives ([`NegativeSampling`]) (with replacement;
//! one equal to the positive is left out), on cosine similarities divided
//! by `temperature`; item embeddings are L2-normalised as targets too.
//! Adam with betas (0.9, 0.98) trains everything, as the reference's AdamW
//! without weight decay. Where it differs from the reference: the item
//! table's Adam updates the
//! rows of the batch only; items start uniform (TorchRec's range) rather
//! than normal(0, 0.02).

use ember_dense::jagged::Jagged;
use ember_dense::{
    DenseBackend, DenseOptimizer, HstuConfig, HstuInput, Initializer, Param, Tensor,
};
use ember_sparse::rng::Rng;
use ember_sparse::{EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, TableOptimizer};
use serde::{Deserialize, Serialize};

use super::histories::{Tokens, HISTORY_FEATURE, TARGETS_FEATURE};
use super::loss::{sampled_softmax, SoftmaxBuffers};
use super::metrics::SequenceRetriever;
use super::readout::{item_rows, last_item_scores, last_rows};
use super::stack::{reference_adam, strict_only, HstuStack};
use super::{dropout, undrop};
use crate::checkpoint::{StateDict, StateFile};
use crate::{Backend, Batch, ExecMode, Model, ModelError, StepOutput};

/// Where a sampled softmax draws its negatives (the reference's two
/// samplers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NegativeSampling {
    /// Uniformly from every item (the reference's `local` sampler, its
    /// research configs' choice).
    #[default]
    Uniform,
    /// From the batch's positives: items as often as the batch holds them
    /// (the reference's in-batch sampler, without its popularity
    /// correction).
    InBatch,
}

/// An [`HstuRetrieval`]'s shape and training options; names follow the
/// reference's gin configs where they exist.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HstuRetrievalConfig {
    /// Items (ids `0..num_items`).
    pub num_items: usize,
    /// Item embedding and token width.
    pub embedding_dim: usize,
    /// HSTU layers.
    pub num_blocks: usize,
    /// Heads a layer.
    pub num_heads: usize,
    /// Query and key width per head.
    pub attention_dim: usize,
    /// Value and gate width per head.
    pub linear_dim: usize,
    /// The longest history read (longer ones: their most recent items).
    pub max_sequence_len: usize,
    /// Random negatives a position.
    pub num_negatives: usize,
    /// Where the negatives come from.
    pub negative_sampling: NegativeSampling,
    /// Divides the cosine similarities.
    pub temperature: f32,
    /// The layers' dropout.
    pub dropout_rate: f64,
    /// Adam's learning rate, for the layers, the positions and the items.
    pub learning_rate: f32,
    /// Seeds the weights, the dropout and the negatives.
    pub seed: u64,
}

impl HstuRetrievalConfig {
    /// The reference's MovieLens-1M shape: dim 50, 2 blocks of 1 head,
    /// 128 negatives at temperature 0.05, dropout 0.2, Adam at 1e-3.
    pub fn new(num_items: usize, max_sequence_len: usize) -> Self {
        Self {
            num_items,
            embedding_dim: 50,
            num_blocks: 2,
            num_heads: 1,
            attention_dim: 50,
            linear_dim: 50,
            max_sequence_len,
            num_negatives: 128,
            negative_sampling: NegativeSampling::Uniform,
            temperature: 0.05,
            dropout_rate: 0.2,
            learning_rate: 1e-3,
            seed: 0,
        }
    }
}

/// HSTU trained for next-item retrieval (see the [module docs](self)).
pub struct HstuRetrieval {
    config: HstuRetrievalConfig,
    items: EmbeddingCollection,
    dense: DenseParts,
    optimizer: DenseOptimizer<f32>,
    /// Clip the dense gradients at this global norm (set by the Trainer).
    max_grad_norm: Option<f32>,
    negatives: Rng,
    /// Draws the input dropout's masks.
    input_dropout: Initializer,
    scores: Vec<f32>,
    buffers: Buffers,
}

/// A step's big buffers, kept from step to step.
#[derive(Default)]
struct Buffers {
    /// The lookup: the inputs' rows, then every target row.
    looked: ember_sparse::JaggedEmbeddings,
    softmax: SoftmaxBuffers,
    /// The lookup's gradient.
    grad: Vec<f32>,
    /// The input dropout's mask (empty when not training).
    input_mask: Vec<f32>,
}

/// What Adam steps: the positions and the layers.
struct DenseParts {
    /// `[max_sequence_len, D]`, the reference's `_pos_emb`.
    positions: Tensor<f32>,
    positions_grad: Tensor<f32>,
    layers: HstuStack,
}

impl DenseParts {
    /// Under the reference's names.
    fn params(&mut self) -> Vec<Param<'_, f32>> {
        let (n, d) = self.positions.shape();
        let mut params = vec![Param::new(
            "_input_features_preproc._pos_emb.weight",
            self.positions.data_mut(),
            self.positions_grad.data_mut(),
        )
        .with_shape(&[n, d])];
        params.extend(self.layers.params());
        params
    }
}

impl HstuRetrieval {
    /// A new model of `config`.
    pub fn new(config: HstuRetrievalConfig) -> Result<Self, ModelError> {
        let (d, n) = (config.embedding_dim, config.max_sequence_len);
        let bad = |what: &str| Err(crate::ArchitectureError::Sequence(what.to_string()).into());
        let sizes = [
            d,
            n,
            config.num_items,
            config.num_heads,
            config.attention_dim,
            config.linear_dim,
        ];
        if sizes.contains(&0) || config.num_negatives == 0 {
            return bad("every size and num_negatives are at least 1");
        }
        if !(config.temperature > 0.0 && config.temperature.is_finite()) {
            return bad("the temperature is a finite number above 0");
        }
        let table = EmbeddingConfig::new(
            "items",
            config.num_items,
            d,
            &[HISTORY_FEATURE, TARGETS_FEATURE],
        );
        let items = EmbeddingCollection::new(
            vec![table],
            TableOptimizer::Adam {
                lr: config.learning_rate,
                beta1: 0.9,
                beta2: 0.98,
                eps: 1e-8,
            },
            config.seed,
        )?;
        let mut init = Initializer::new(config.seed ^ 0x9e37);
        let layer = HstuConfig {
            attention_dim: config.attention_dim,
            linear_dim: config.linear_dim,
            dropout: config.dropout_rate,
            ..HstuConfig::new(d, config.num_heads, n)
        };
        let layers = HstuStack::new(&layer, config.num_blocks, config.seed);
        let std = 1.0 / (d.max(1) as f64).sqrt();
        let positions = Tensor::from_fn(n, d, |_, _| init.normal(0.0, std) as f32);
        Ok(Self {
            dense: DenseParts {
                positions,
                positions_grad: Tensor::zeros(n, d),
                layers,
            },
            optimizer: DenseOptimizer::new(reference_adam(config.learning_rate)),
            max_grad_norm: None,
            negatives: Rng::new(config.seed ^ 0x6e65),
            input_dropout: Initializer::new(config.seed ^ 0xd20),
            scores: Vec::new(),
            buffers: Buffers::default(),
            items,
            config,
        })
    }

    /// The item table's fused optimizer and the dense layers' optimizer.
    pub fn optimizers(&self) -> (TableOptimizer, ember_dense::DenseOptimizerConfig) {
        (*self.items.optimizer(), self.optimizer.config())
    }

    /// The model's shape and options.
    pub fn config(&self) -> &HstuRetrievalConfig {
        &self.config
    }

    /// Looks up `kjt` (history first) into the buffers; returns the
    /// layers' input: history rows times sqrt(D) plus their positions,
    /// with dropout when `training`.
    fn embed(
        &mut self,
        kjt: &KeyedJaggedTensor,
        t: &Tokens,
        training: bool,
    ) -> Result<Jagged<f32>, ModelError> {
        let d = self.config.embedding_dim;
        self.items.forward_into(kjt, &mut self.buffers.looked)?;
        let looked = &self.buffers.looked;
        let scale = (d as f32).sqrt();
        let total: usize = t.input_lengths.iter().sum();
        let mut x = Tensor::zeros(total, d);
        let mut r = 0;
        for &n in &t.input_lengths {
            for p in 0..n {
                let (e, pos) = (
                    &looked.values()[r * d..(r + 1) * d],
                    self.dense.positions.row(p),
                );
                for ((o, &ev), &pv) in x.row_mut(r).iter_mut().zip(e).zip(pos) {
                    *o = ev * scale + pv;
                }
                r += 1;
            }
        }
        let (p, mask) = (self.config.dropout_rate, &mut self.buffers.input_mask);
        dropout(x.data_mut(), p, training, &mut self.input_dropout, mask);
        Ok(Jagged::from_lengths(x, &t.input_lengths)?)
    }

    /// The layers' outputs on `t`'s inputs.
    fn encode(&mut self, be: &dyn DenseBackend<f32>, t: &Tokens, x: Jagged<f32>) -> Jagged<f32> {
        let query: Vec<i64> = t.last.iter().map(|l| l.1).collect();
        let input = HstuInput {
            timestamps: Some(&t.times),
            query_times: Some(&query),
            targets: None,
        };
        self.dense.layers.forward(be, x, input)
    }

    /// The forward's KJT: the inputs, and for each a positive and
    /// `num_negatives` random items (see [`NegativeSampling`]).
    fn lookup_input(&mut self, t: &Tokens) -> Result<KeyedJaggedTensor, ModelError> {
        let r = self.config.num_negatives;
        let positives = t.next_items();
        let (pool, from_batch) = match self.config.negative_sampling {
            NegativeSampling::Uniform => (self.config.num_items as u64, false),
            NegativeSampling::InBatch => (positives.len() as u64, true),
        };
        let mut targets = Vec::with_capacity(t.ids.len() * (1 + r));
        for &pos in &positives {
            targets.push(pos);
            targets.extend((0..r).map(|_| {
                let k = self.negatives.below(pool.max(1));
                if from_batch {
                    positives[k as usize]
                } else {
                    k as i64
                }
            }));
        }
        t.lookup(targets, 1 + r)
    }
}

impl Model for HstuRetrieval {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        strict_only("HSTU retrieval", mode)?;
        let be = backend.dense();
        let (d, r, temp) = (
            self.config.embedding_dim,
            self.config.num_negatives,
            self.config.temperature,
        );
        let seed = super::step_seed(self.config.seed, self.items.step());
        self.negatives = Rng::new(seed ^ 0x6e65);
        self.input_dropout = Initializer::new(seed ^ 0xd20);
        self.dense.layers.reseed(seed);
        let t = Tokens::of(batch)?.cut(self.config.max_sequence_len);
        let kjt = self.lookup_input(&t)?;
        self.dense.layers.set_training(true);
        let x = self.embed(&kjt, &t, true)?;
        let tokens = x.total_len();
        let h = self.encode(be, &t, x);
        // Cosine logits of each position against its positive and negatives.
        let Buffers {
            looked,
            softmax,
            grad,
            input_mask,
        } = &mut self.buffers;
        let scored = (h.values().data(), &looked.values()[tokens * d..]);
        let ids = &kjt.values()[tokens..];
        let loss = sampled_softmax(scored, ids, (1 + r, d), temp, softmax);
        let dq = std::mem::take(&mut softmax.dq);
        let dh = Jagged::new(Tensor::from_vec(tokens, d, dq)?, h.offsets().to_vec())?;
        let mut dx = self.dense.layers.backward(be, dh);
        undrop(dx.values_mut().data_mut(), input_mask);
        // x = e * sqrt(D) + position: the items' gradient, then the positions'.
        self.dense.positions_grad.fill(0.0);
        let scale = (d as f32).sqrt();
        grad.clear();
        let mut r0 = 0;
        for &n in &t.input_lengths {
            for p in 0..n {
                let g = dx.values().row(r0 + p);
                grad.extend(g.iter().map(|v| v * scale));
                for (pg, &v) in self.dense.positions_grad.row_mut(p).iter_mut().zip(g) {
                    *pg += v;
                }
            }
            r0 += n;
        }
        grad.extend_from_slice(&softmax.de);
        self.items.backward_update(&kjt, grad)?;
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

    /// Each user's score of its last item (its history's others before
    /// it): the cosine of query and item over the temperature.
    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
        let q = self.user_queries(backend.dense(), batch)?;
        let t = Tokens::of(batch)?.cut(self.config.max_sequence_len);
        let last = t.last_items(self.config.num_items)?;
        let scale = 1.0 / self.config.temperature;
        self.scores = last_item_scores(&q, &self.items, &last, (true, scale));
        Ok(&self.scores)
    }

    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        let mut state = StateDict::new();
        let config = super::SequenceModelConfig::HstuRetrieval(self.config.clone());
        state.metadata(super::SEQUENCE_MODEL_KEY, config.to_json());
        state.add_trained("", &self.optimizer, self.dense.params());
        state.add_embedding_collection("_embedding_module.", &self.items);
        Ok(state)
    }

    fn load_state_dict(&mut self, file: &StateFile) -> Result<(), ModelError> {
        file.load_embedding_collection("_embedding_module.", &mut self.items)?;
        file.load_trained("", &mut self.optimizer, self.dense.params())
    }
}

impl SequenceRetriever for HstuRetrieval {
    fn user_queries(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<Tensor<f32>, ModelError> {
        let t = Tokens::of(batch)?.cut(self.config.max_sequence_len);
        let kjt = t.lookup(Vec::new(), 0)?;
        self.dense.layers.set_training(false);
        let x = self.embed(&kjt, &t, false)?;
        let h = self.encode(be, &t, x);
        Ok(last_rows(&h, true))
    }

    fn item_embeddings(&self) -> Tensor<f32> {
        item_rows(&self.items, true)
    }

    fn num_items(&self) -> usize {
        self.config.num_items
    }
}
