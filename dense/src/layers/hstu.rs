//! One HSTU layer (Zhai et al., "Actions Speak Louder than Words",
//! ICML 2024, arXiv 2402.17152) on jagged sequences, forward and backward.
//!
//! The form is the paper's and its research code's
//! (`SequentialTransductionUnitJagged` in meta-recsys/generative-recommenders,
//! `research/modeling/sequential/hstu.py`), with the production layer's
//! candidate masking (`ops/pytorch/pt_hstu_attention.py`). For a sequence
//! `x` of `len` tokens of width `D`, `H` heads of query/key width `dqk` and
//! value width `dv`, the layer's maximum sequence length `N`:
//!
//! ```text
//! x̂          = LayerNorm(x)                          (no affine, eps 1e-6)
//! U, V, Q, K = split(SiLU(x̂ W_uvqk))                 (W_uvqk: [D, 2·H·dv + 2·H·dqk], no bias)
//! S_h        = alpha · Q_h K_hᵀ + rab                 (alpha 1 in the paper's form)
//! rab[i, j]  = pos_w[N - 1 + j - i] + ts_w[bucket(t_next(i) - t_j)]
//! bucket(d)  = min(floor(ln(max(|d|, 1)) / 0.301), time_buckets)
//! P_h        = SiLU(S_h) / N ⊙ M                      (M: token i sees j when j = i, or
//!                                                      j < i and j is history, not a candidate)
//! A          = [P_1 V_1, ..., P_H V_H]
//! y          = x + Dropout(U ⊙ LayerNorm(A)) W_oᵀ + b_o   (LayerNorm over all H·dv, no affine)
//! ```
//!
//! `t_next(i)` is the next token's timestamp, and for the last token the
//! sample's query time (the target's timestamp in the reference). `N`
//! divides as the reference's fixed `max_sequence_len`; a longer sequence
//! is refused. Parameters keep the reference's names (`_uvqk`,
//! `_o.weight`, `_o.bias`, `_rel_attn_bias._ts_w`, `_rel_attn_bias._pos_w`).

use super::attention::{self, map_samples, per_sample, Sample, Shape};

use crate::backend::{Activation, DenseBackend};
use crate::init::Initializer;
use crate::jagged::Jagged;
use crate::layers::norm::LayerNorm;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// The shape and options of an [`HstuLayer`].
#[derive(Clone, Debug, PartialEq)]
pub struct HstuConfig {
    /// Token width `D`.
    pub dim: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Query and key width per head (`attention_dim`).
    pub attention_dim: usize,
    /// Value and gate width per head (`linear_dim`, the reference's `hidden_dim`).
    pub linear_dim: usize,
    /// `N`: the longest sequence, and the attention's divisor.
    pub max_seq_len: usize,
    /// Multiplies `Q Kᵀ` (1 in the paper's form; the production layer's
    /// `1 / sqrt(attention_dim)`).
    pub alpha: f64,
    /// Whether the relative attention bias (position and time) is learned.
    pub relative_bias: bool,
    /// Buckets of log time differences (the reference's 128).
    pub time_buckets: usize,
    /// Dropout before the output projection (training only).
    pub dropout: f64,
}

impl HstuConfig {
    /// `heads` heads of `dim / heads` each, the paper's form (alpha 1,
    /// relative bias, 128 time buckets, dropout 0.2).
    pub fn new(dim: usize, heads: usize, max_seq_len: usize) -> Self {
        let per_head = dim / heads.max(1);
        Self {
            dim,
            heads,
            attention_dim: per_head,
            linear_dim: per_head,
            max_seq_len,
            alpha: 1.0,
            relative_bias: true,
            time_buckets: 128,
            dropout: 0.2,
        }
    }

    fn uvqk_width(&self) -> usize {
        2 * self.heads * (self.linear_dim + self.attention_dim)
    }
}

/// What a batch carries besides its tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct HstuInput<'a> {
    /// Each token's timestamp (seconds), for the time bias; `None`: all 0.
    pub timestamps: Option<&'a [i64]>,
    /// Each sample's query time (the time its last token is followed at);
    /// `None`: its last token's own.
    pub query_times: Option<&'a [i64]>,
    /// Each sample's candidates: its last tokens, which see the history and
    /// themselves only. `None`: none.
    pub targets: Option<&'a [usize]>,
}

/// One HSTU layer: parameters, their gradients, and what the forward keeps
/// for the backward. See the [module docs](self) for the equations.
#[derive(Clone, Debug)]
pub struct HstuLayer<T> {
    config: HstuConfig,
    /// `[D, 2·H·dv + 2·H·dqk]`, the reference's `_uvqk`.
    pub uvqk: Tensor<T>,
    /// Its gradient.
    pub uvqk_grad: Tensor<T>,
    /// `[D, H·dv]` (torch `Linear` layout), the reference's `_o.weight`.
    pub out_weight: Tensor<T>,
    /// `[D]`, `_o.bias`.
    pub out_bias: Vec<T>,
    /// Its gradient.
    pub out_weight_grad: Tensor<T>,
    /// Its gradient.
    pub out_bias_grad: Vec<T>,
    /// `[2N - 1]`, `_rel_attn_bias._pos_w` (empty without relative bias).
    pub pos_w: Vec<T>,
    /// `[time_buckets + 1]`, `_rel_attn_bias._ts_w`.
    pub ts_w: Vec<T>,
    /// Its gradient.
    pub pos_w_grad: Vec<T>,
    /// Its gradient.
    pub ts_w_grad: Vec<T>,
    input_norm: LayerNorm<T>,
    attn_norm: LayerNorm<T>,
    training: bool,
    rng: Initializer,
    saved: Saved<T>,
    output: Jagged<T>,
    input_grad: Jagged<T>,
    /// Seconds the last forward's and backward's attention took.
    attention_s: (f64, f64),
}

/// The forward's values the backward reads.
#[derive(Clone, Debug, Default)]
struct Saved<T> {
    offsets: Vec<usize>,
    targets: Vec<usize>,
    /// Per token: its time bucket's row of keys is made from these.
    timestamps: Vec<i64>,
    next_times: Vec<i64>,
    normed_x: Tensor<T>,
    pre_act: Tensor<T>,
    /// SiLU(pre_act): [u, v, q, k] by columns.
    act: Tensor<T>,
    attn: Tensor<T>,
    normed_attn: Tensor<T>,
    /// Dropout's multiplier per value (empty: none).
    keep: Vec<T>,
    /// `U ⊙ LayerNorm(A)` after dropout: the output projection's input.
    gated: Tensor<T>,
}

impl<T: Real> HstuLayer<T> {
    /// A layer of `config`, initialised as the reference: `_uvqk` and the
    /// bias weights normal(0, 0.02), `_o` as torch's `Linear` (xavier-uniform weight).
    pub fn new(config: HstuConfig, seed: u64) -> Self {
        let mut init = Initializer::new(seed);
        let (d, w, hv) = (
            config.dim,
            config.uvqk_width(),
            config.heads * config.linear_dim,
        );
        let uvqk = Tensor::from_fn(d, w, |_, _| T::from_f64(init.normal(0.0, 0.02)));
        let bound = (6.0 / (d + hv).max(1) as f64).sqrt();
        let out_weight = init.uniform_tensor(d, hv, bound);
        let out_bias = init.uniform_vec(d, 1.0 / (hv.max(1) as f64).sqrt());
        let (np, nt) = match config.relative_bias {
            true => (
                (2 * config.max_seq_len).saturating_sub(1),
                config.time_buckets + 1,
            ),
            false => (0, 0),
        };
        let mut normal = |n: usize| {
            (0..n)
                .map(|_| T::from_f64(init.normal(0.0, 0.02)))
                .collect()
        };
        let (pos_w, ts_w): (Vec<T>, Vec<T>) = (normal(np), normal(nt));
        Self {
            uvqk_grad: Tensor::zeros(d, w),
            out_weight_grad: Tensor::zeros(d, hv),
            out_bias_grad: vec![T::ZERO; d],
            pos_w_grad: vec![T::ZERO; pos_w.len()],
            ts_w_grad: vec![T::ZERO; ts_w.len()],
            input_norm: LayerNorm::new(d, 1e-6, false),
            attn_norm: LayerNorm::new(hv, 1e-6, false),
            rng: Initializer::new(seed ^ 0x5eed),
            training: true,
            saved: Saved::default(),
            output: Jagged::default(),
            input_grad: Jagged::default(),
            attention_s: (0.0, 0.0),
            uvqk,
            out_weight,
            out_bias,
            pos_w,
            ts_w,
            config,
        }
    }

    /// The layer's shape and options.
    pub fn config(&self) -> &HstuConfig {
        &self.config
    }

    /// Seconds the attention (the part that grows with the square of the
    /// lengths) took in the last forward and the last backward.
    pub fn attention_seconds(&self) -> (f64, f64) {
        self.attention_s
    }

    /// Floating-point operations of a forward and of a backward on
    /// sequences of `lengths` (multiply and add count two; the attention
    /// as computed, every token pair of a sample).
    pub fn flops(&self, lengths: &[usize]) -> (f64, f64) {
        let c = &self.config;
        let tokens: usize = lengths.iter().sum();
        let pairs: f64 = lengths.iter().map(|&n| (n * n) as f64).sum();
        let (hv, hq) = (
            (c.heads * c.linear_dim) as f64,
            (c.heads * c.attention_dim) as f64,
        );
        let proj = 2.0 * tokens as f64 * c.dim as f64 * (c.uvqk_width() as f64 + hv);
        // Forward: scores and P V; backward: scores again, dP, dV, dQ, dK.
        let (attn_f, attn_b) = (2.0 * pairs * (hq + hv), 2.0 * pairs * (3.0 * hq + 2.0 * hv));
        (proj + attn_f, 2.0 * proj + attn_b)
    }

    /// Training (dropout on) or evaluation (off).
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// Restarts the dropout draws from `seed`. A model reseeds its layers
    /// from its step count, so that a run resumed from a checkpoint draws
    /// the masks the uninterrupted run drew.
    pub fn reseed(&mut self, seed: u64) {
        self.rng = Initializer::new(seed ^ 0x5eed);
    }

    fn shape(&self) -> Shape {
        Shape {
            heads: self.config.heads,
            qk_dim: self.config.attention_dim,
            v_dim: self.config.linear_dim,
            alpha: self.config.alpha,
            n: self.config.max_seq_len as f64,
            softmax: false,
            dropout: (0.0, 0),
        }
    }

    /// The layer's output for `x` (`[total, D]`); keeps what the backward
    /// needs. Panics (a programming error, as every dense op) when `x`'s
    /// width is not `D`, a sequence is longer than `N`, or `input`'s slices
    /// do not fit `x`.
    pub fn forward(
        &mut self,
        be: &dyn DenseBackend<T>,
        x: &Jagged<T>,
        input: HstuInput<'_>,
    ) -> &Jagged<T> {
        let (c, shape) = (self.config.clone(), self.shape());
        let (total, hv) = (x.total_len(), c.heads * c.linear_dim);
        assert_eq!(
            x.dim(),
            c.dim,
            "HstuLayer::forward: tokens of width {}",
            c.dim
        );
        assert!(
            x.max_len() <= c.max_seq_len,
            "HstuLayer::forward: a sequence of {} tokens, at most {}",
            x.max_len(),
            c.max_seq_len
        );
        let s = &mut self.saved;
        s.offsets = x.offsets().to_vec();
        s.targets = input.targets.map_or(vec![0; x.batch()], <[usize]>::to_vec);
        s.timestamps = input.timestamps.map_or(vec![0; total], <[i64]>::to_vec);
        assert!(
            s.targets.len() == x.batch() && s.timestamps.len() == total,
            "HstuLayer::forward: targets a sample, timestamps a token"
        );
        assert!(
            input.query_times.is_none_or(|q| q.len() == x.batch()),
            "HstuLayer::forward: query times a sample"
        );
        s.next_times = next_times(&s.offsets, &s.timestamps, input.query_times);
        self.input_norm.forward(x.values(), &mut s.normed_x);
        be.matmul(
            &s.normed_x,
            false,
            &self.uvqk,
            false,
            T::ONE,
            T::ZERO,
            &mut s.pre_act,
        );
        s.act.resize(total, c.uvqk_width());
        for (a, &z) in s.act.data_mut().iter_mut().zip(s.pre_act.data()) {
            *a = z * sigmoid(z);
        }
        // The attention, sample by sample, on [.., v, q, k]'s columns.
        s.attn.resize(total, hv);
        let start = std::time::Instant::now();
        attend(&c, shape, &self.pos_w, &self.ts_w, s);
        self.attention_s.0 = start.elapsed().as_secs_f64();
        self.attn_norm.forward(&s.attn, &mut s.normed_attn);
        s.gated.resize(total, hv);
        let u_width = c.uvqk_width();
        for (r, g) in s.gated.data_mut().chunks_mut(hv.max(1)).enumerate() {
            let u = &s.act.data()[r * u_width..r * u_width + hv];
            for ((o, &uu), &a) in g.iter_mut().zip(u).zip(s.normed_attn.row(r)) {
                *o = uu * a;
            }
        }
        s.keep.clear();
        if self.training && c.dropout > 0.0 {
            let scale = T::from_f64(1.0 / (1.0 - c.dropout));
            let rng = &mut self.rng;
            s.keep = (0..s.gated.len())
                .map(|_| {
                    if rng.unit() < c.dropout {
                        T::ZERO
                    } else {
                        scale
                    }
                })
                .collect();
            for (g, &k) in s.gated.data_mut().iter_mut().zip(&s.keep) {
                *g *= k;
            }
        }
        let (mut out, _) = std::mem::take(&mut self.output).into_parts();
        be.linear_forward(
            &s.gated,
            &self.out_weight,
            &self.out_bias,
            Activation::None,
            &mut out,
        );
        be.add_assign(&mut out, x.values());
        self.output = Jagged::new(out, s.offsets.clone()).expect("the input's offsets");
        &self.output
    }

    /// From the output's gradient `dy` (of the last forward's shape): the
    /// input's, returned, and every parameter's (overwritten).
    pub fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Jagged<T>) -> &Jagged<T> {
        let (c, shape) = (self.config.clone(), self.shape());
        let s = &mut self.saved;
        assert_eq!(
            dy.offsets(),
            &s.offsets[..],
            "HstuLayer::backward: dy of the forward's shape"
        );
        let (total, hv, width) = (dy.total_len(), c.heads * c.linear_dim, c.uvqk_width());
        // out = x + gated W_oᵀ + b_o.
        let mut d_out = dy.values().clone();
        let mut d_gated = Tensor::zeros(0, 0);
        be.linear_backward(
            &s.gated,
            &self.out_weight,
            self.output.values(),
            Activation::None,
            &mut d_out,
            &mut self.out_weight_grad,
            &mut self.out_bias_grad,
            Some(&mut d_gated),
        );
        for (g, &k) in d_gated.data_mut().iter_mut().zip(&s.keep) {
            *g *= k;
        }
        // gated = U ⊙ LayerNorm(A).
        let mut d_act = Tensor::zeros(total, width);
        let mut d_normed = Tensor::zeros(total, hv);
        for r in 0..total {
            let (u, na, dg) = (&s.act.row(r)[..hv], s.normed_attn.row(r), d_gated.row(r));
            let du = &mut d_act.row_mut(r)[..hv];
            for c in 0..hv {
                du[c] = dg[c] * na[c];
            }
            for (o, (&g, &uu)) in d_normed.row_mut(r).iter_mut().zip(dg.iter().zip(u)) {
                *o = g * uu;
            }
        }
        let mut d_attn = Tensor::zeros(0, 0);
        self.attn_norm.backward(&d_normed, &mut d_attn);
        let start = std::time::Instant::now();
        let (d_pos, d_ts) =
            attend_backward(&c, shape, (&self.pos_w, &self.ts_w), s, &d_attn, &mut d_act);
        self.attention_s.1 = start.elapsed().as_secs_f64();
        self.pos_w_grad = d_pos;
        self.ts_w_grad = d_ts;
        // act = SiLU(pre_act), pre_act = x̂ W_uvqk.
        for (g, &z) in d_act.data_mut().iter_mut().zip(s.pre_act.data()) {
            let sg = sigmoid(z);
            *g *= sg * (T::ONE + z * (T::ONE - sg));
        }
        be.matmul(
            &s.normed_x,
            true,
            &d_act,
            false,
            T::ONE,
            T::ZERO,
            &mut self.uvqk_grad,
        );
        let mut d_normed_x = Tensor::zeros(0, 0);
        be.matmul(
            &d_act,
            false,
            &self.uvqk,
            true,
            T::ONE,
            T::ZERO,
            &mut d_normed_x,
        );
        let (mut dx, _) = std::mem::take(&mut self.input_grad).into_parts();
        self.input_norm.backward(&d_normed_x, &mut dx);
        be.add_assign(&mut dx, dy.values());
        self.input_grad = Jagged::new(dx, s.offsets.clone()).expect("the input's offsets");
        &self.input_grad
    }
}

impl<T: Real> HasParams<T> for HstuLayer<T> {
    /// The reference's names: `_uvqk`, `_o.weight`, `_o.bias`,
    /// `_rel_attn_bias._ts_w`, `_rel_attn_bias._pos_w` (the last two with
    /// the relative bias).
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let (d, w, hv) = (
            self.config.dim,
            self.config.uvqk_width(),
            self.out_weight.cols(),
        );
        let mut params = vec![
            Param::new("_uvqk", self.uvqk.data_mut(), self.uvqk_grad.data_mut())
                .with_shape(&[d, w]),
            Param::new(
                "_o.weight",
                self.out_weight.data_mut(),
                self.out_weight_grad.data_mut(),
            )
            .with_shape(&[d, hv]),
            Param::new("_o.bias", &mut self.out_bias, &mut self.out_bias_grad),
        ];
        if !self.ts_w.is_empty() {
            params.push(Param::new(
                "_rel_attn_bias._ts_w",
                &mut self.ts_w,
                &mut self.ts_w_grad,
            ));
            params.push(Param::new(
                "_rel_attn_bias._pos_w",
                &mut self.pos_w,
                &mut self.pos_w_grad,
            ));
        }
        params
    }
}

/// Where `V`, `Q` and `K` start in the projection's output `[u, v, q, k]`.
fn columns(c: &HstuConfig) -> (usize, usize, usize) {
    let hv = c.heads * c.linear_dim;
    (hv, 2 * hv, 2 * hv + c.heads * c.attention_dim)
}

/// `rab[i, j]` of a sample whose tokens have `ts` and next times `next`.
fn rel_bias<T: Real>(
    c: &HstuConfig,
    (pos_w, ts_w): (&[T], &[T]),
    (ts, next): (&[i64], &[i64]),
    i: usize,
    j: usize,
) -> T {
    if pos_w.is_empty() {
        return T::ZERO;
    }
    let p = c.max_seq_len - 1 + j - i;
    pos_w[p] + ts_w[bucket(next[i].saturating_sub(ts[j]), c.time_buckets)]
}

/// The attention of every sample into `s.attn`.
fn attend<T: Real>(c: &HstuConfig, shape: Shape, pos_w: &[T], ts_w: &[T], s: &mut Saved<T>) {
    let Saved {
        offsets,
        targets,
        timestamps,
        next_times,
        act,
        attn,
        ..
    } = s;
    let (width, hv) = (c.uvqk_width(), c.heads * c.linear_dim);
    let (v_at, q_at, k_at) = columns(c);
    let work: usize = offsets
        .windows(2)
        .map(|w| (w[1] - w[0]).pow(2))
        .sum::<usize>()
        * width;
    let outs = crate::jagged::split_by_offsets(attn.data_mut(), offsets, hv);
    per_sample(outs, work, |b, out| {
        let (r0, r1) = (offsets[b], offsets[b + 1]);
        assert!(
            targets[b] <= r1 - r0,
            "HstuLayer: sample {b} has more candidates than tokens"
        );
        let sample = Sample {
            first_row: r0,
            rows: &act.data()[r0 * width..r1 * width],
            width,
            v_at,
            q_at,
            k_at,
            len: r1 - r0,
            targets: targets[b],
        };
        let times = (&timestamps[r0..r1], &next_times[r0..r1]);
        let bias = |i, j| rel_bias(c, (pos_w, ts_w), times, i, j);
        attention::forward(&sample, &shape, &bias, out);
    });
}

/// The attention's backward for every sample: `V`, `Q`, `K`'s gradients
/// into `d_act`, and the relative bias's gradients, returned.
fn attend_backward<T: Real>(
    c: &HstuConfig,
    shape: Shape,
    (pos_w, ts_w): (&[T], &[T]),
    s: &Saved<T>,
    d_attn: &Tensor<T>,
    d_act: &mut Tensor<T>,
) -> (Vec<T>, Vec<T>) {
    let (width, hv) = (c.uvqk_width(), c.heads * c.linear_dim);
    let (v_at, q_at, k_at) = columns(c);
    let offsets = &s.offsets;
    let work: usize = offsets
        .windows(2)
        .map(|w| (w[1] - w[0]).pow(2))
        .sum::<usize>()
        * width;
    let rows = crate::jagged::split_by_offsets(d_act.data_mut(), offsets, width);
    let one = |b: usize, d_rows: &mut [T]| {
        let (r0, r1) = (offsets[b], offsets[b + 1]);
        let sample = Sample {
            first_row: r0,
            rows: &s.act.data()[r0 * width..r1 * width],
            width,
            v_at,
            q_at,
            k_at,
            len: r1 - r0,
            targets: s.targets[b],
        };
        let (ts, next) = (&s.timestamps[r0..r1], &s.next_times[r0..r1]);
        let bias = |i, j| rel_bias(c, (pos_w, ts_w), (ts, next), i, j);
        let (mut d_pos, mut d_ts) = (vec![T::ZERO; pos_w.len()], vec![T::ZERO; ts_w.len()]);
        let mut d_bias = |i: usize, j: usize, g: T| {
            if !pos_w.is_empty() {
                d_pos[c.max_seq_len - 1 + j - i] += g;
                d_ts[bucket(next[i].saturating_sub(ts[j]), c.time_buckets)] += g;
            }
        };
        let d_out = &d_attn.data()[r0 * hv..r1 * hv];
        attention::backward(&sample, &shape, &bias, d_out, d_rows, &mut d_bias);
        (d_pos, d_ts)
    };
    let partials = map_samples(rows, work, one);
    let (mut d_pos, mut d_ts) = (vec![T::ZERO; pos_w.len()], vec![T::ZERO; ts_w.len()]);
    for (p, t) in partials {
        d_pos.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        d_ts.iter_mut().zip(t).for_each(|(a, b)| *a += b);
    }
    (d_pos, d_ts)
}

/// Each token's next timestamp: the following token's, and for a sample's
/// last token its query time (or its own).
fn next_times(offsets: &[usize], ts: &[i64], query: Option<&[i64]>) -> Vec<i64> {
    let mut next = vec![0; ts.len()];
    for (b, w) in offsets.windows(2).enumerate() {
        for i in w[0]..w[1] {
            next[i] = match i + 1 < w[1] {
                true => ts[i + 1],
                false => query.map_or(ts[i], |q| q[b]),
            };
        }
    }
    next
}

/// The reference's time bucket of a difference: `floor(ln(max(|d|, 1)) / 0.301)`, at most `buckets`.
fn bucket(d: i64, buckets: usize) -> usize {
    let d = (d.unsigned_abs().max(1)) as f64;
    ((d.ln() / 0.301) as usize).min(buckets)
}

fn sigmoid<T: Real>(z: T) -> T {
    T::ONE / (T::ONE + (-z).exp())
}
