//! SASRec (Kang and McAuley, ICDM 2018), the transformer baseline of
//! sequential recommendation, as the public PyTorch SASRec
//! (pmixer/SASRec.pytorch, `model.py`) defines and trains it:
//!
//! ```text
//! x   = Dropout(E[items] · sqrt(d) + P[positions])   (positions: the window's, right-aligned)
//! per block (post-norm, the default; pre-norm with `norm_first`):
//!     x = LN(x + MHA(x))                              (causal, softmax, torch's MultiheadAttention)
//!     x = LN(x + Dropout(W2 Dropout(ReLU(W1 x + b1)) + b2))
//! f   = LN(x)
//! loss = mean BCE(f · E[next], 1) + mean BCE(f · E[negative], 0)   (one negative a position)
//! ```
//!
//! Layer norms have eps 1e-8; Adam has betas (0.9, 0.98), for the layers
//! and the item table alike. A window of `maxlen` inputs is read from
//! batches of `maxlen + 1` items (the last is only a target), as SASRec's
//! sampler cuts histories.
//!
//! Where it differs from that code: a sequence attends over its own items
//! only (the PyTorch code left-pads to `maxlen`, and after the first block
//! the padding positions it attends to are no longer zero); the item
//! table's Adam updates the rows of the batch only (torch's dense Adam
//! moves every row with its momentum); a negative is drawn again while it
//! is one of the user's items in the window, at most 100 times.

use ember_dense::jagged::Jagged;
use ember_dense::{
    Activation, DenseBackend, DenseOptimizer, DenseOptimizerConfig, HasParams, Initializer,
    LayerNorm, Linear, MultiheadAttention, Param, Tensor,
};
use ember_sparse::rng::Rng;
use ember_sparse::{EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor, TableOptimizer};
use serde::{Deserialize, Serialize};

use super::histories::{Tokens, HISTORY_FEATURE, TARGETS_FEATURE};
use super::loss::{sampled_softmax, SoftmaxBuffers};
use super::metrics::SequenceRetriever;
use super::readout::{item_rows, last_item_scores, last_rows};
use super::{dropout, undrop};
use crate::checkpoint::{StateDict, StateFile};
use crate::{Backend, Batch, ExecMode, Model, ModelError, StepOutput};

const LN_EPS: f64 = 1e-8;

/// A [`SasRec`]'s shape and training options, under the PyTorch SASRec's
/// flag names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SasRecConfig {
    /// Items (ids `0..num_items`).
    pub num_items: usize,
    /// Token width (`--hidden_units`).
    pub hidden_units: usize,
    /// Blocks (`--num_blocks`).
    pub num_blocks: usize,
    /// Heads a block (`--num_heads`).
    pub num_heads: usize,
    /// Inputs read (`--maxlen`).
    pub maxlen: usize,
    /// Dropout everywhere it applies (`--dropout_rate`).
    pub dropout_rate: f64,
    /// Adam's learning rate (`--lr`).
    pub lr: f32,
    /// Layer norm before each sublayer instead of after (`--norm_first`).
    pub norm_first: bool,
    /// What it is trained to tell apart.
    pub loss: SasRecLoss,
    /// Seeds the weights, the dropout and the negatives.
    pub seed: u64,
}

/// A [`SasRec`]'s training loss.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SasRecLoss {
    /// SASRec's own: binary cross-entropy of the next item and of one
    /// item the user never saw.
    Bce,
    /// HSTU's reference's: softmax cross-entropy of the next item against
    /// `negatives` uniform random items, on cosine similarities over
    /// `temperature` (scored by cosine too), as the HSTU paper compares
    /// the two architectures.
    SampledSoftmax {
        /// Random items a position.
        negatives: usize,
        /// Divides the cosine similarities.
        temperature: f32,
    },
}

impl SasRecConfig {
    /// The PyTorch SASRec's defaults: 50 hidden units, 2 blocks of 1
    /// head, dropout 0.2, learning rate 0.001, post-norm.
    pub fn new(num_items: usize, maxlen: usize) -> Self {
        Self {
            num_items,
            hidden_units: 50,
            num_blocks: 2,
            num_heads: 1,
            maxlen,
            dropout_rate: 0.2,
            lr: 1e-3,
            norm_first: false,
            loss: SasRecLoss::Bce,
            seed: 0,
        }
    }
}

/// One block's layers and what its forward keeps.
#[derive(Clone, Debug)]
struct Block {
    attn_norm: LayerNorm<f32>,
    attn: MultiheadAttention<f32>,
    fwd_norm: LayerNorm<f32>,
    conv1: Linear<f32>,
    conv2: Linear<f32>,
    /// Inputs and outputs of the feed-forward, and its dropout masks.
    ffn_in: Tensor<f32>,
    hidden: Tensor<f32>,
    dropped: Tensor<f32>,
    ffn_out: Tensor<f32>,
    masks: (Vec<f32>, Vec<f32>),
}

/// See the [module docs](self).
pub struct SasRec {
    config: SasRecConfig,
    items: EmbeddingCollection,
    positions: Tensor<f32>,
    positions_grad: Tensor<f32>,
    blocks: Vec<Block>,
    last_norm: LayerNorm<f32>,
    optimizer: DenseOptimizer<f32>,
    /// Clip the dense gradients at this global norm (set by the Trainer).
    max_grad_norm: Option<f32>,
    rng: Rng,
    dropout: Initializer,
    training: bool,
    emb_mask: Vec<f32>,
    scores: Vec<f32>,
    /// A step's big buffers, kept from step to step (memory allocated
    /// afresh is memory the kernel maps afresh): the lookup, the loss's,
    /// the lookup's gradient.
    looked: ember_sparse::JaggedEmbeddings,
    softmax: SoftmaxBuffers,
    grad: Vec<f32>,
}

fn jagged(t: Tensor<f32>, offsets: &[usize]) -> Jagged<f32> {
    Jagged::new(t, offsets.to_vec()).expect("the batch's offsets")
}

impl SasRec {
    /// A new model of `config`, initialised as the PyTorch SASRec's
    /// `main.py` does: xavier-normal for every weight of two or more
    /// dimensions (the item table uniform with that spread), torch's
    /// defaults for the rest.
    pub fn new(config: SasRecConfig) -> Result<Self, ModelError> {
        let d = config.hidden_units;
        let bad = |what: &str| Err(crate::ArchitectureError::Sequence(what.to_string()).into());
        if d == 0 || config.num_heads == 0 || !d.is_multiple_of(config.num_heads) {
            return bad("hidden_units must be a multiple (at least 1) of num_heads (at least 1)");
        }
        if config.maxlen == 0 || config.num_items == 0 {
            return bad("maxlen and num_items are at least 1");
        }
        if let SasRecLoss::SampledSoftmax {
            negatives,
            temperature,
        } = config.loss
        {
            if negatives == 0 || !(temperature > 0.0 && temperature.is_finite()) {
                return bad("the sampled softmax needs negatives and a temperature above 0");
            }
        }
        let (b1, b2) = (0.9, 0.98);
        let mut table = EmbeddingConfig::new(
            "items",
            config.num_items,
            d,
            &[HISTORY_FEATURE, TARGETS_FEATURE],
        );
        // Xavier-normal's standard deviation, as a uniform range.
        let bound = (3.0 * 2.0 / (config.num_items + d) as f64).sqrt() as f32;
        (table.weight_init_min, table.weight_init_max) = (Some(-bound), Some(bound));
        let table_adam = TableOptimizer::Adam {
            lr: config.lr,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
        };
        let items = EmbeddingCollection::new(vec![table], table_adam, config.seed)?;
        let mut init = Initializer::new(config.seed ^ 0x5a5);
        let positions = init.xavier_normal(config.maxlen + 1, d);
        let blocks = (0..config.num_blocks)
            .map(|b| {
                let seed = config.seed + 10 * b as u64;
                let mut attn = MultiheadAttention::new(d, config.num_heads, seed + 1);
                attn.in_proj.weight = init.xavier_normal(3 * d, d);
                attn.out_proj.weight = init.xavier_normal(d, d);
                // Conv1d's weight [d, d, 1]: fans of d and d.
                let mut conv1 = Linear::new(d, d, Activation::Relu, seed + 2);
                conv1.weight = init.xavier_normal(d, d);
                let mut conv2 = Linear::new(d, d, Activation::None, seed + 3);
                conv2.weight = init.xavier_normal(d, d);
                Block {
                    attn_norm: LayerNorm::new(d, LN_EPS, true),
                    attn,
                    fwd_norm: LayerNorm::new(d, LN_EPS, true),
                    conv1,
                    conv2,
                    ffn_in: Tensor::zeros(0, d),
                    hidden: Tensor::zeros(0, d),
                    dropped: Tensor::zeros(0, d),
                    ffn_out: Tensor::zeros(0, d),
                    masks: (Vec::new(), Vec::new()),
                }
            })
            .collect();
        let adam = DenseOptimizerConfig::Adam {
            lr: config.lr,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
        };
        Ok(Self {
            positions_grad: Tensor::zeros(config.maxlen + 1, d),
            positions,
            blocks,
            last_norm: LayerNorm::new(d, LN_EPS, true),
            optimizer: DenseOptimizer::new(adam),
            max_grad_norm: None,
            rng: Rng::new(config.seed ^ 0x6e6567),
            dropout: Initializer::new(config.seed ^ 0xd20),
            training: true,
            emb_mask: Vec::new(),
            scores: Vec::new(),
            looked: Default::default(),
            softmax: SoftmaxBuffers::default(),
            grad: Vec::new(),
            items,
            config,
        })
    }

    /// The item table's fused optimizer and the dense layers' optimizer.
    pub fn optimizers(&self) -> (TableOptimizer, ember_dense::DenseOptimizerConfig) {
        (*self.items.optimizer(), self.optimizer.config())
    }

    /// The model's shape and options.
    pub fn config(&self) -> &SasRecConfig {
        &self.config
    }

    /// Each input's position row: the window's, right-aligned (the last
    /// input at `maxlen`).
    fn position(&self, n: usize, t: usize) -> usize {
        self.config.maxlen + 1 - n.min(self.config.maxlen) + t
    }

    /// The features of `t`'s inputs (and the inputs' embedding rows, for
    /// the backward's scale).
    fn features(
        &mut self,
        be: &dyn DenseBackend<f32>,
        looked: &[f32],
        t: &Tokens,
    ) -> Result<Jagged<f32>, ModelError> {
        let d = self.config.hidden_units;
        let total: usize = t.input_lengths.iter().sum();
        let scale = (d as f32).sqrt();
        let mut x = Tensor::zeros(total, d);
        let mut r = 0;
        for &n in &t.input_lengths {
            for p in 0..n {
                let pos = self.positions.row(self.position(n, p));
                for ((o, &e), &pv) in x
                    .row_mut(r)
                    .iter_mut()
                    .zip(&looked[r * d..(r + 1) * d])
                    .zip(pos)
                {
                    *o = e * scale + pv;
                }
                r += 1;
            }
        }
        let (p, on) = (self.config.dropout_rate, self.training);
        let mut mask = Vec::new();
        dropout(x.data_mut(), p, on, &mut self.dropout, &mut mask);
        self.emb_mask = mask;
        let offsets = ember_dense::jagged::complete_cumsum(&t.input_lengths);
        let mut x = jagged(x, &offsets);
        for block in &mut self.blocks {
            block.attn.set_dropout(if on { p } else { 0.0 });
            x = block.forward(be, x, self.config.norm_first, (p, on), &mut self.dropout);
        }
        let mut f = Tensor::zeros(0, 0);
        self.last_norm.forward(x.values(), &mut f);
        Ok(jagged(f, &offsets))
    }
}

impl Block {
    /// The block's output for `x`; keeps what the backward needs.
    fn forward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        x: Jagged<f32>,
        norm_first: bool,
        (p, on): (f64, bool),
        rng: &mut Initializer,
    ) -> Jagged<f32> {
        let offsets = x.offsets().to_vec();
        let mut s1 = Tensor::zeros(0, 0);
        let x = match norm_first {
            true => {
                let mut xn = Tensor::zeros(0, 0);
                self.attn_norm.forward(x.values(), &mut xn);
                let a = self.attn.forward(be, &jagged(xn, &offsets));
                s1.copy_from(x.values());
                be.add_assign(&mut s1, a.values());
                let mut fed = Tensor::zeros(0, 0);
                self.fwd_norm.forward(&s1, &mut fed);
                self.ffn_in = fed;
                s1
            }
            false => {
                let a = self.attn.forward(be, &x);
                s1.copy_from(x.values());
                be.add_assign(&mut s1, a.values());
                self.attn_norm.forward(&s1, &mut self.ffn_in);
                self.ffn_in.clone()
            }
        };
        self.conv1.forward(be, &self.ffn_in, &mut self.hidden);
        self.dropped.copy_from(&self.hidden);
        dropout(self.dropped.data_mut(), p, on, rng, &mut self.masks.0);
        self.conv2.forward(be, &self.dropped, &mut self.ffn_out);
        let mut f = self.ffn_out.clone();
        dropout(f.data_mut(), p, on, rng, &mut self.masks.1);
        let mut s2 = x;
        be.add_assign(&mut s2, &f);
        if norm_first {
            return jagged(s2, &offsets);
        }
        let mut out = Tensor::zeros(0, 0);
        self.fwd_norm.forward(&s2, &mut out);
        jagged(out, &offsets)
    }

    /// The feed-forward's input gradient from its output's.
    fn ffn_backward(&mut self, be: &dyn DenseBackend<f32>, d_out: &Tensor<f32>) -> Tensor<f32> {
        let mut df = d_out.clone();
        undrop(df.data_mut(), &self.masks.1);
        let mut d_dropped = Tensor::zeros(0, 0);
        self.conv2.backward(
            be,
            &self.dropped,
            &self.ffn_out,
            &mut df,
            Some(&mut d_dropped),
        );
        undrop(d_dropped.data_mut(), &self.masks.0);
        let mut d_in = Tensor::zeros(0, 0);
        self.conv1.backward(
            be,
            &self.ffn_in,
            &self.hidden,
            &mut d_dropped,
            Some(&mut d_in),
        );
        d_in
    }

    /// The block's input gradient from its output's; every parameter's
    /// gradient overwritten.
    fn backward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        dy: &Jagged<f32>,
        norm_first: bool,
    ) -> Jagged<f32> {
        let offsets = dy.offsets().to_vec();
        let mut ds1 = Tensor::zeros(0, 0);
        if norm_first {
            // y = s1 + FFN(LN(s1)), s1 = x + MHA(LN(x)).
            let d_fed = self.ffn_backward(be, dy.values());
            self.fwd_norm.backward(&d_fed, &mut ds1);
            be.add_assign(&mut ds1, dy.values());
            let d_xn = self.attn.backward(be, &jagged(ds1.clone(), &offsets));
            let mut dx = Tensor::zeros(0, 0);
            self.attn_norm.backward(d_xn.values(), &mut dx);
            be.add_assign(&mut dx, &ds1);
            return jagged(dx, &offsets);
        }
        // y = LN(x1 + FFN(x1)), x1 = LN(x + MHA(x)).
        let mut ds2 = Tensor::zeros(0, 0);
        self.fwd_norm.backward(dy.values(), &mut ds2);
        let mut dx1 = self.ffn_backward(be, &ds2);
        be.add_assign(&mut dx1, &ds2);
        self.attn_norm.backward(&dx1, &mut ds1);
        let mut dx = self
            .attn
            .backward(be, &jagged(ds1.clone(), &offsets))
            .into_parts()
            .0;
        be.add_assign(&mut dx, &ds1);
        jagged(dx, &offsets)
    }

    /// Under the PyTorch SASRec's names, block `i`.
    fn params(&mut self, i: usize) -> Vec<Param<'_, f32>> {
        let d = self.conv1.in_features();
        fn named(prefix: String, params: Vec<Param<'_, f32>>) -> Vec<Param<'_, f32>> {
            params.into_iter().map(|p| p.with_prefix(&prefix)).collect()
        }
        let mut params = named(
            format!("attention_layernorms.{i}."),
            self.attn_norm.params(),
        );
        params.extend(named(format!("attention_layers.{i}."), self.attn.params()));
        params.extend(named(
            format!("forward_layernorms.{i}."),
            self.fwd_norm.params(),
        ));
        for (name, conv) in [("conv1", &mut self.conv1), ("conv2", &mut self.conv2)] {
            let mut p = named(format!("forward_layers.{i}.{name}."), conv.params());
            // torch's Conv1d weight: [out, in, 1].
            let w = p.remove(0).with_shape(&[d, d, 1]);
            p.insert(0, w);
            params.extend(p);
        }
        params
    }
}

/// Every dense parameter, under the PyTorch SASRec's names.
fn dense_params<'a>(
    (positions, grad): (&'a mut Tensor<f32>, &'a mut Tensor<f32>),
    blocks: &'a mut [Block],
    last_norm: &'a mut LayerNorm<f32>,
) -> Vec<Param<'a, f32>> {
    let (n, d) = positions.shape();
    let pos = Param::new("pos_emb.weight", positions.data_mut(), grad.data_mut());
    let mut params = vec![pos.with_shape(&[n, d])];
    for (i, block) in blocks.iter_mut().enumerate() {
        params.extend(block.params(i));
    }
    params.extend(
        last_norm
            .params()
            .into_iter()
            .map(|p| p.with_prefix("last_layernorm.")),
    );
    params
}

impl SasRec {
    /// Target rows an input scores: its next item and the negatives.
    fn targets_per_input(&self) -> usize {
        match self.config.loss {
            SasRecLoss::Bce => 2,
            SasRecLoss::SampledSoftmax { negatives, .. } => 1 + negatives,
        }
    }

    /// The lookup of `t`'s inputs and, per input, its next item and the
    /// negatives: one item of none of the user's inputs (drawn again until
    /// so) for BCE, uniform random ones for the sampled softmax.
    fn lookup_input(&mut self, t: &Tokens) -> Result<KeyedJaggedTensor, ModelError> {
        let items = self.config.num_items as u64;
        let next = t.next_items();
        let per = self.targets_per_input();
        let mut targets = Vec::with_capacity(per * next.len());
        let mut draw = || self.rng.below(items) as i64;
        match self.config.loss {
            SasRecLoss::SampledSoftmax { negatives, .. } => {
                for &pos in &next {
                    targets.push(pos);
                    targets.extend((0..negatives).map(|_| draw()));
                }
            }
            SasRecLoss::Bce => {
                let mut at = 0;
                for (b, &n) in t.input_lengths.iter().enumerate() {
                    let user = t.ids[at..at + n].iter().copied().chain([t.last[b].0]);
                    let seen: std::collections::HashSet<i64> = user.collect();
                    for &pos in &next[at..at + n] {
                        let mut neg = draw();
                        for _ in 0..100 {
                            if !seen.contains(&neg) {
                                break;
                            }
                            neg = draw();
                        }
                        targets.extend([pos, neg]);
                    }
                    at += n;
                }
            }
        }
        t.lookup(targets, per)
    }
}

/// SASRec's loss: for each of the `features` (`[tokens, d]`), binary
/// cross-entropy of its dot product with its positive (the first of its
/// two `targets` rows) as 1 and with its negative as 0, each averaged over
/// the tokens; returns it with the features' and targets' gradients.
fn bce(features: &[f32], targets: &[f32], d: usize) -> (f64, Vec<f32>, Vec<f32>) {
    let tokens = features.len() / d.max(1);
    let (mut loss, mut df) = (0.0f64, vec![0.0f32; features.len()]);
    let mut de = vec![0.0f32; targets.len()];
    let per = 1.0 / tokens.max(1) as f32;
    for tok in 0..tokens {
        let ft = &features[tok * d..(tok + 1) * d];
        for (j, label) in [(0, 1.0f32), (1, 0.0)] {
            let at = (2 * tok + j) * d;
            let row = &targets[at..at + d];
            let logit: f32 = ft.iter().zip(row).map(|(a, b)| a * b).sum();
            loss += f64::from(if label > 0.5 {
                softplus(-logit)
            } else {
                softplus(logit)
            });
            let g = (sigmoid(logit) - label) * per;
            for c in 0..d {
                df[tok * d + c] += g * row[c];
                de[at + c] += g * ft[c];
            }
        }
    }
    (loss / tokens.max(1) as f64, df, de)
}

fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl Model for SasRec {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        super::stack::strict_only("SASRec", mode)?;
        let be = backend.dense();
        let d = self.config.hidden_units;
        let seed = super::step_seed(self.config.seed, self.items.step());
        self.rng = Rng::new(seed ^ 0x6e6567);
        self.dropout = Initializer::new(seed ^ 0xd20);
        for (b, block) in self.blocks.iter_mut().enumerate() {
            block.attn.reseed(seed + 1 + b as u64);
        }
        let t = Tokens::of(batch)?.cut(self.config.maxlen);
        let kjt = self.lookup_input(&t)?;
        let mut looked = std::mem::take(&mut self.looked);
        self.items.forward_into(&kjt, &mut looked)?;
        let tokens: usize = t.input_lengths.iter().sum();
        self.training = true;
        let f = self.features(be, looked.values(), &t)?;
        let e = &looked.values()[tokens * d..];
        let (loss, df, de) = match self.config.loss {
            SasRecLoss::Bce => bce(f.values().data(), e, d),
            SasRecLoss::SampledSoftmax {
                negatives,
                temperature,
            } => {
                let ids = &kjt.values()[tokens..];
                let b = &mut self.softmax;
                let scored = (f.values().data(), e);
                let loss = sampled_softmax(scored, ids, (1 + negatives, d), temperature, b);
                (loss, b.dq.clone(), std::mem::take(&mut b.de))
            }
        };
        let mut dx = Tensor::zeros(0, 0);
        self.last_norm
            .backward(&Tensor::from_vec(tokens, d, df)?, &mut dx);
        let mut dx = jagged(dx, f.offsets());
        let norm_first = self.config.norm_first;
        for block in self.blocks.iter_mut().rev() {
            dx = block.backward(be, &dx, norm_first);
        }
        let mut dx = dx.into_parts().0;
        undrop(dx.data_mut(), &self.emb_mask);
        self.positions_grad.fill(0.0);
        let scale = (d as f32).sqrt();
        let mut grad = std::mem::take(&mut self.grad);
        grad.clear();
        let mut r = 0;
        for &n in &t.input_lengths {
            for p in 0..n {
                let pos = self.position(n, p);
                let g = dx.row(r);
                grad.extend(g.iter().map(|v| v * scale));
                for (pg, &v) in self.positions_grad.row_mut(pos).iter_mut().zip(g) {
                    *pg += v;
                }
                r += 1;
            }
        }
        grad.extend_from_slice(&de);
        if self.config.loss != SasRecLoss::Bce {
            self.softmax.de = de; // its capacity, for the next step
        }
        let updated = self.items.backward_update(&kjt, &grad);
        (self.grad, self.looked) = (grad, looked);
        updated?;
        let params = dense_params(
            (&mut self.positions, &mut self.positions_grad),
            &mut self.blocks,
            &mut self.last_norm,
        );
        super::dense_step(&mut self.optimizer, params, self.max_grad_norm);
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

    /// Each user's logit of its last item after the others.
    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
        let q = self.user_queries(backend.dense(), batch)?;
        let t = Tokens::of(batch)?.cut(self.config.maxlen);
        let last = t.last_items(self.config.num_items)?;
        let cosine = self.config.loss != SasRecLoss::Bce;
        self.scores = last_item_scores(&q, &self.items, &last, (cosine, 1.0));
        Ok(&self.scores)
    }

    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        let mut state = StateDict::new();
        let config = super::SequenceModelConfig::Sasrec(self.config.clone());
        state.metadata(super::SEQUENCE_MODEL_KEY, config.to_json());
        let params = dense_params(
            (&mut self.positions, &mut self.positions_grad),
            &mut self.blocks,
            &mut self.last_norm,
        );
        state.add_trained("", &self.optimizer, params);
        state.add_embedding_collection("item_emb.", &self.items);
        Ok(state)
    }

    fn load_state_dict(&mut self, file: &StateFile) -> Result<(), ModelError> {
        file.load_embedding_collection("item_emb.", &mut self.items)?;
        let params = dense_params(
            (&mut self.positions, &mut self.positions_grad),
            &mut self.blocks,
            &mut self.last_norm,
        );
        file.load_trained("", &mut self.optimizer, params)
    }
}

impl SequenceRetriever for SasRec {
    fn user_queries(
        &mut self,
        be: &dyn DenseBackend<f32>,
        batch: &Batch,
    ) -> Result<Tensor<f32>, ModelError> {
        let t = Tokens::of(batch)?.cut(self.config.maxlen);
        let kjt = t.lookup(Vec::new(), 0)?;
        let looked = self.items.forward(&kjt)?;
        self.training = false;
        let f = self.features(be, looked.values(), &t)?;
        Ok(last_rows(&f, self.config.loss != SasRecLoss::Bce))
    }

    fn item_embeddings(&self) -> Tensor<f32> {
        item_rows(&self.items, self.config.loss != SasRecLoss::Bce)
    }

    fn num_items(&self) -> usize {
        self.config.num_items
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One block of the public PyTorch SASRec on each sequence alone
    /// (scripts/sasrec_fixture.py): Ember's jagged block gives the same
    /// output and gradients.
    #[test]
    fn a_block_is_the_pytorch_sasrecs() {
        let bytes = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sasrec_block.safetensors"
        ))
        .unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let get = |name: &str| -> Vec<f32> {
            let t = file.tensor(name).unwrap();
            let bytes = t.data().chunks_exact(8);
            bytes
                .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as f32)
                .collect()
        };
        let lengths: Vec<usize> = get("lengths").iter().map(|&v| v as usize).collect();
        let d = 6;
        let config = SasRecConfig {
            hidden_units: d,
            num_heads: 2,
            num_blocks: 1,
            ..SasRecConfig::new(10, 8)
        };
        let model = SasRec::new(config).unwrap();
        let mut block = model.blocks[0].clone();
        for p in block.params(0) {
            let name = p.name.clone();
            p.value.copy_from_slice(&get(&name));
        }
        let total = lengths.iter().sum();
        let x =
            Jagged::from_lengths(Tensor::from_vec(total, d, get("x")).unwrap(), &lengths).unwrap();
        let be = ember_dense::NativeBackend::new(1);
        let mut rng = Initializer::new(0);
        let y = block.forward(&be, x.clone(), false, (0.0, false), &mut rng);
        let close = |what: &str, got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                let err = (g - w).abs() / w.abs().max(1e-2);
                assert!(err < 1e-4, "{what}[{i}]: {g} vs {w}");
            }
        };
        close("y", y.values().data(), &get("y"));
        let dy =
            Jagged::from_lengths(Tensor::from_vec(total, d, get("dy")).unwrap(), &lengths).unwrap();
        let dx = block.backward(&be, &dy, false);
        close("grad.x", dx.values().data(), &get("grad.x"));
        for p in block.params(0) {
            close(&p.name, p.grad, &get(&format!("grad.{}", p.name)));
        }
    }
}
