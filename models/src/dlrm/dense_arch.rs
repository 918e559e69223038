//! The dense arch of a DLRM: bottom MLP, interaction (dot or low-rank cross
//! network) and top MLP, its parameters named as in TorchRec's `state_dict`,
//! and its checks for NaN and infinity.

use ember_dense::{
    Activation, DenseBackend, DotInteraction, HasParams, LowRankCrossNet, Mlp, Param, Real, Tensor,
};

use super::{DlrmConfig, InteractionType};
use crate::ModelError;

// One arch per model, so the size difference of the variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum InteractionArch<T: Real> {
    Dot(DotInteraction<T>),
    Dcn {
        net: LowRankCrossNet<T>,
        dim: usize,
        combined: Tensor<T>,
        d_dense: Tensor<T>,
        d_sparse: Tensor<T>,
    },
}

/// Everything of a DLRM after the embedding lookups: bottom MLP, interaction,
/// top MLP. Generic over the float type so gradients can be checked in f64.
pub struct DenseArch<T: Real> {
    bottom: Mlp<T>,
    interaction: InteractionArch<T>,
    top: Mlp<T>,
}

impl<T: Real> DenseArch<T> {
    /// A freshly initialised dense arch for `config` (validated first);
    /// `seed` makes the initial weights.
    pub fn new(config: &DlrmConfig, seed: u64) -> Result<Self, ModelError> {
        config.validate()?;
        let (f, d) = (config.num_sparse_features(), config.embedding_dim());
        let interaction = match config.interaction {
            InteractionType::Dot => InteractionArch::Dot(DotInteraction::new(f, d)),
            InteractionType::Dcn { layers, rank } => InteractionArch::Dcn {
                net: LowRankCrossNet::new((f + 1) * d, layers, rank, seed ^ 0xDC17),
                dim: d,
                combined: Tensor::zeros(0, 0),
                d_dense: Tensor::zeros(0, 0),
                d_sparse: Tensor::zeros(0, 0),
            },
        };
        Ok(Self {
            // TorchRec's DenseArch MLP applies ReLU after its last layer too.
            bottom: Mlp::new(&config.bottom_mlp, Activation::Relu, seed ^ 0xB0770),
            interaction,
            top: Mlp::new(&config.top_mlp_sizes(), Activation::None, seed ^ 0x70B),
        })
    }

    /// Logits `[batch, 1]` from dense features `[batch, num_dense]` and pooled
    /// embeddings `[batch, F * D]`.
    pub fn forward(
        &mut self,
        be: &dyn DenseBackend<T>,
        dense: &Tensor<T>,
        pooled: &Tensor<T>,
    ) -> &Tensor<T> {
        let bottom_out = self.bottom.forward(be, dense);
        let top_in = match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.forward(be, bottom_out, pooled),
            InteractionArch::Dcn { net, combined, .. } => {
                be.concat_columns(bottom_out, pooled, combined);
                net.forward(be, combined)
            }
        };
        self.top.forward(be, top_in)
    }

    /// The gradient of the pooled embeddings from the last backward.
    pub fn pooled_grad(&self) -> &Tensor<T> {
        match &self.interaction {
            InteractionArch::Dot(dot) => dot.dsparse(),
            InteractionArch::Dcn { d_sparse, .. } => d_sparse,
        }
    }

    pub(super) fn pooled_grad_mut(&mut self) -> &mut Tensor<T> {
        match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.dsparse_mut(),
            InteractionArch::Dcn { d_sparse, .. } => d_sparse,
        }
    }

    /// Backward from the logits' gradient; fills every parameter's gradient
    /// and returns the gradient of the pooled embeddings `[batch, F * D]`.
    pub fn backward(&mut self, be: &dyn DenseBackend<T>, d_logits: &Tensor<T>) -> &Tensor<T> {
        let d_top_in = self
            .top
            .backward(be, d_logits, true)
            .expect("asked for the input gradient");
        let (d_bottom_out, d_pooled) = match &mut self.interaction {
            InteractionArch::Dot(dot) => dot.backward(be, d_top_in),
            InteractionArch::Dcn {
                net,
                dim,
                d_dense,
                d_sparse,
                ..
            } => {
                let d_combined = net.backward(be, d_top_in);
                be.split_columns(d_combined, *dim, d_dense, d_sparse);
                (&*d_dense, &*d_sparse)
            }
        };
        self.bottom.backward(be, d_bottom_out, false);
        d_pooled
    }

    /// The first NaN or infinity among the last forward's layer outputs, in
    /// forward order, named after the layer.
    pub fn first_non_finite_activation(&self) -> Option<ModelError> {
        let (_, outs) = self.bottom.activations();
        for (i, t) in outs.iter().enumerate() {
            if let Some(e) = non_finite(
                &format!("dense_arch.model._mlp.{i} output"),
                t.data(),
                t.cols(),
            ) {
                return Some(e);
            }
        }
        let (top_in, outs) = self.top.activations();
        if let Some(e) = non_finite("inter_arch output", top_in.data(), top_in.cols()) {
            return Some(e);
        }
        let last = outs.len() - 1;
        for (i, t) in outs.iter().enumerate() {
            let what = match i == last {
                true => "over_arch.model.1 output (the logits)".to_string(),
                false => format!("over_arch.model.0._mlp.{i} output"),
            };
            if let Some(e) = non_finite(&what, t.data(), t.cols()) {
                return Some(e);
            }
        }
        None
    }

    /// The first NaN or infinity among the last backward's parameter
    /// gradients, named after the parameter.
    pub fn first_non_finite_gradient(&mut self) -> Option<ModelError> {
        self.params().into_iter().find_map(|p| {
            let i = p.grad.iter().position(|g| !g.to_f64().is_finite())?;
            Some(ModelError::NonFinite {
                what: format!("the gradient of {}", p.name),
                location: format!("element {i}"),
                value: p.grad[i].to_f64() as f32,
            })
        })
    }

    /// The bottom MLP (TorchRec's `dense_arch`), ReLU after every layer.
    pub fn bottom(&self) -> &Mlp<T> {
        &self.bottom
    }
    /// The top MLP (TorchRec's `over_arch`), its last layer giving the logit.
    pub fn top(&self) -> &Mlp<T> {
        &self.top
    }
    /// The cross network of a DLRM-DCNv2 (TorchRec's `inter_arch.crossnet`);
    /// `None` for the dot interaction, which has no parameters.
    pub fn cross_net(&self) -> Option<&LowRankCrossNet<T>> {
        match &self.interaction {
            InteractionArch::Dcn { net, .. } => Some(net),
            InteractionArch::Dot(_) => None,
        }
    }
}

/// TorchRec's name prefix of bottom MLP layer `i`.
pub(crate) fn bottom_linear_prefix(i: usize) -> String {
    format!("dense_arch.model._mlp.{i}._linear.")
}

/// TorchRec's name prefix of top layer `i` of `layers`: its OverArch is
/// Sequential(MLP(all but the last layer), Linear).
pub(crate) fn top_linear_prefix(i: usize, layers: usize) -> String {
    match i + 1 == layers {
        true => "over_arch.model.1.".into(),
        false => format!("over_arch.model.0._mlp.{i}._linear."),
    }
}

impl<T: Real> HasParams<T> for DenseArch<T> {
    /// Parameters named as in TorchRec's DLRM `state_dict`.
    fn params(&mut self) -> Vec<Param<'_, T>> {
        let mut params: Vec<_> = (self.bottom.params().into_iter())
            .map(|p| p.with_prefix("dense_arch.model."))
            .collect();
        if let InteractionArch::Dcn { net, .. } = &mut self.interaction {
            params.extend(
                net.params()
                    .into_iter()
                    .map(|p| p.with_prefix("inter_arch.crossnet.")),
            );
        }
        // TorchRec's OverArch is Sequential(MLP(all but the last layer), Linear).
        let last = format!("_mlp.{}._linear.", self.top.layers().len() - 1);
        params.extend(self.top.params().into_iter().map(|mut p| {
            p.name = match p.name.strip_prefix(&last) {
                Some(tensor) => format!("over_arch.model.1.{tensor}"),
                None => format!("over_arch.model.0.{}", p.name),
            };
            p
        }));
        params
    }
}

/// The first NaN or infinity of a row-major `[rows, cols]` buffer, as an error.
fn non_finite<T: Real>(what: &str, data: &[T], cols: usize) -> Option<ModelError> {
    let i = data.iter().position(|v| !v.to_f64().is_finite())?;
    Some(ModelError::NonFinite {
        what: what.to_string(),
        location: format!("sample {}, column {}", i / cols.max(1), i % cols.max(1)),
        value: data[i].to_f64() as f32,
    })
}
