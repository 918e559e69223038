//! Causal multi-head self-attention on jagged sequences, as torch's
//! `nn.MultiheadAttention(dim, heads)` computes it with a causal mask
//! (SASRec's blocks): `[Q, K, V] = x W_inᵀ + b_in`; per head,
//! `softmax(Q Kᵀ / sqrt(dim / heads) + mask) V`; then `W_out · + b_out`.
//! Each sample attends over its own tokens only, samples in parallel.
//! Attention-weight dropout (torch's `dropout`) applies while training
//! ([`MultiheadAttention::set_dropout`]); each step draws new masks.

use super::attention::{self, per_sample, Sample, Shape};
use crate::backend::{Activation, DenseBackend};
use crate::init::Initializer;
use crate::jagged::{split_by_offsets, Jagged};
use crate::layers::linear::Linear;
use crate::param::{HasParams, Param};
use crate::real::Real;
use crate::tensor::Tensor;

/// See the [module docs](self).
#[derive(Clone, Debug)]
pub struct MultiheadAttention<T> {
    heads: usize,
    /// Dropout on the attention weights, and the key of the last
    /// forward's masks and of the next's.
    dropout: f64,
    masks: (u64, u64),
    /// `[3·dim, dim]` and `[3·dim]`: torch's `in_proj_weight`, `in_proj_bias`.
    pub in_proj: Linear<T>,
    /// torch's `out_proj`.
    pub out_proj: Linear<T>,
    input: Tensor<T>,
    offsets: Vec<usize>,
    qkv: Tensor<T>,
    attn: Tensor<T>,
    out: Tensor<T>,
}

impl<T: Real> MultiheadAttention<T> {
    /// `heads` heads over tokens of `dim` (a multiple of `heads`),
    /// initialised as torch: xavier-uniform projections in, zero biases.
    pub fn new(dim: usize, heads: usize, seed: u64) -> Self {
        assert!(
            heads > 0 && dim.is_multiple_of(heads),
            "MultiheadAttention: dim {dim} is not a multiple of {heads} heads"
        );
        let mut init = Initializer::new(seed);
        let mut in_proj = Linear::from_init(dim, 3 * dim, Activation::None, &mut init);
        let bound = (6.0 / (4 * dim) as f64).sqrt();
        in_proj.weight = init.uniform_tensor(3 * dim, dim, bound);
        in_proj.bias.iter_mut().for_each(|b| *b = T::ZERO);
        let mut out_proj = Linear::from_init(dim, dim, Activation::None, &mut init);
        out_proj.bias.iter_mut().for_each(|b| *b = T::ZERO);
        Self {
            heads,
            dropout: 0.0,
            masks: (0, seed),
            in_proj,
            out_proj,
            input: Tensor::zeros(0, dim),
            offsets: Vec::new(),
            qkv: Tensor::zeros(0, 3 * dim),
            attn: Tensor::zeros(0, dim),
            out: Tensor::zeros(0, dim),
        }
    }

    /// The chance each attention weight is dropped in the coming forwards
    /// (0: none, for evaluation).
    pub fn set_dropout(&mut self, p: f64) {
        self.dropout = p;
    }

    /// Restarts the masks' keys from `seed` (see
    /// [`HstuLayer::reseed`](crate::HstuLayer::reseed)).
    pub fn reseed(&mut self, seed: u64) {
        self.masks = (0, seed);
    }

    fn shape(&self) -> Shape {
        let head = self.in_proj.in_features() / self.heads;
        Shape {
            heads: self.heads,
            qk_dim: head,
            v_dim: head,
            alpha: 1.0 / (head as f64).sqrt(),
            n: 1.0,
            softmax: true,
            dropout: (self.dropout, self.masks.0),
        }
    }

    /// Each token attends to itself and its sample's earlier tokens.
    pub fn forward(&mut self, be: &dyn DenseBackend<T>, x: &Jagged<T>) -> Jagged<T> {
        let d = self.in_proj.in_features();
        assert_eq!(
            x.dim(),
            d,
            "MultiheadAttention::forward: tokens of width {d}"
        );
        self.input.copy_from(x.values());
        self.offsets = x.offsets().to_vec();
        self.in_proj.forward(be, x.values(), &mut self.qkv);
        // This forward's masks (the backward's too), and the next's key.
        self.masks = (
            self.masks.1,
            self.masks
                .1
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        );
        self.attn.resize(x.total_len(), d);
        let (shape, offsets, qkv) = (self.shape(), &self.offsets, &self.qkv);
        let work: usize = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]).pow(2))
            .sum::<usize>()
            * d;
        let outs = split_by_offsets(self.attn.data_mut(), offsets, d);
        per_sample(outs, work, |b, out| {
            let sample = sample(qkv, offsets, b, d);
            attention::forward(&sample, &shape, &|_, _| T::ZERO, out);
        });
        self.out_proj.forward(be, &self.attn, &mut self.out);
        Jagged::new(self.out.clone(), self.offsets.clone()).expect("the input's offsets")
    }

    /// The input's gradient from the output's; the parameters' gradients
    /// overwritten.
    pub fn backward(&mut self, be: &dyn DenseBackend<T>, dy: &Jagged<T>) -> Jagged<T> {
        let d = self.in_proj.in_features();
        assert_eq!(
            dy.offsets(),
            &self.offsets[..],
            "MultiheadAttention::backward: dy of the forward's shape"
        );
        let mut d_out = dy.values().clone();
        let mut d_attn = Tensor::zeros(0, 0);
        self.out_proj
            .backward(be, &self.attn, &self.out, &mut d_out, Some(&mut d_attn));
        let mut d_qkv = Tensor::zeros(dy.total_len(), 3 * d);
        let (shape, offsets, qkv) = (self.shape(), &self.offsets, &self.qkv);
        let work: usize = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]).pow(2))
            .sum::<usize>()
            * d;
        let rows = split_by_offsets(d_qkv.data_mut(), offsets, 3 * d);
        per_sample(rows, work, |b, d_rows| {
            let sample = sample(qkv, offsets, b, d);
            let d_o = &d_attn.data()[offsets[b] * d..offsets[b + 1] * d];
            attention::backward(
                &sample,
                &shape,
                &|_, _| T::ZERO,
                d_o,
                d_rows,
                &mut |_, _, _| {},
            );
        });
        let mut dx = Tensor::zeros(0, 0);
        self.in_proj
            .backward(be, &self.input, &self.qkv, &mut d_qkv, Some(&mut dx));
        Jagged::new(dx, self.offsets.clone()).expect("the input's offsets")
    }
}

/// Sample `b`'s rows of the projections `[Q, K, V]`.
fn sample<'a, T>(qkv: &'a Tensor<T>, offsets: &[usize], b: usize, d: usize) -> Sample<'a, T>
where
    T: Real,
{
    let (r0, r1) = (offsets[b], offsets[b + 1]);
    Sample {
        first_row: r0,
        rows: &qkv.data()[r0 * 3 * d..r1 * 3 * d],
        width: 3 * d,
        q_at: 0,
        k_at: d,
        v_at: 2 * d,
        len: r1 - r0,
        targets: 0,
    }
}

impl<T: Real> HasParams<T> for MultiheadAttention<T> {
    /// torch's names: `in_proj_weight`, `in_proj_bias`, `out_proj.weight`, `out_proj.bias`.
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let mut params: Vec<Param<'_, T>> = self.in_proj.params();
        params[0].name = "in_proj_weight".into();
        params[1].name = "in_proj_bias".into();
        params.extend(
            self.out_proj
                .params()
                .into_iter()
                .map(|p| p.with_prefix("out_proj.")),
        );
        params
    }
}
