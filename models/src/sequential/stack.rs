//! What the HSTU models share: their stack of [`HstuLayer`]s (built from
//! one layer shape, reseeded each step, named as the reference names
//! them), the reference's Adam, and the strict-mode check.

use ember_dense::jagged::Jagged;
use ember_dense::{
    DenseBackend, DenseOptimizerConfig, HasParams, HstuConfig, HstuInput, HstuLayer, Param,
};

use crate::{ExecMode, ModelError, Unsupported};

/// The reference's optimizer (AdamW without weight decay, betas 0.9 and
/// 0.98) at `lr`.
pub(crate) fn reference_adam(lr: f32) -> DenseOptimizerConfig {
    let (beta1, beta2) = reference_betas();
    DenseOptimizerConfig::Adam {
        lr,
        beta1,
        beta2,
        eps: 1e-8,
    }
}

/// The references' Adam decays (SASRec's and HSTU's).
pub(crate) fn reference_betas() -> (f32, f32) {
    (0.9, 0.98)
}

/// Refuses every mode but strict, naming `model`.
pub(crate) fn strict_only(model: &'static str, mode: ExecMode) -> Result<(), ModelError> {
    match mode {
        ExecMode::Strict => Ok(()),
        mode => Err(Unsupported::Mode {
            model,
            runs: "strict",
            mode,
        }
        .into()),
    }
}

/// `blocks` HSTU layers of one shape; layer `l` seeded `seed + 1 + l`.
pub(crate) struct HstuStack(Vec<HstuLayer<f32>>);

impl HstuStack {
    pub(crate) fn new(layer: &HstuConfig, blocks: usize, seed: u64) -> Self {
        Self(
            (0..blocks)
                .map(|l| HstuLayer::new(layer.clone(), seed + 1 + l as u64))
                .collect(),
        )
    }

    /// Restarts every layer's dropout draws from a step's seed.
    pub(crate) fn reseed(&mut self, seed: u64) {
        for (l, layer) in self.0.iter_mut().enumerate() {
            layer.reseed(seed + 1 + l as u64);
        }
    }

    pub(crate) fn set_training(&mut self, training: bool) {
        self.0.iter_mut().for_each(|l| l.set_training(training));
    }

    /// The last layer's output on `x`.
    pub(crate) fn forward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        x: Jagged<f32>,
        input: HstuInput,
    ) -> Jagged<f32> {
        self.0
            .iter_mut()
            .fold(x, |h, layer| layer.forward(be, &h, input).clone())
    }

    /// The gradient of the first layer's input, from the last one's output's
    /// (every layer's parameter gradients set on the way).
    pub(crate) fn backward(&mut self, be: &dyn DenseBackend<f32>, dy: Jagged<f32>) -> Jagged<f32> {
        (self.0.iter_mut().rev()).fold(dy, |d, layer| layer.backward(be, &d).clone())
    }

    /// Every layer's parameters, under `_hstu._attention_layers.<l>.`.
    pub(crate) fn params(&mut self) -> Vec<Param<'_, f32>> {
        (self.0.iter_mut().enumerate())
            .flat_map(|(l, layer)| {
                let prefix = format!("_hstu._attention_layers.{l}.");
                let params = layer.params().into_iter();
                params.map(move |p| p.with_prefix(&prefix))
            })
            .collect()
    }
}
