//! The contract between a model and everything above one step: the
//! [`Trainer`](crate::Trainer), [`evaluate`](crate::evaluate), checkpoints
//! and data-parallel ranks. DLRM and DLRM-DCNv2 implement it, and so can a
//! user's model built from Ember's parts (see `examples/`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ember_dense::Param;
use ember_sharding::Collective;

use crate::checkpoint::{StateDict, StateFile};
use crate::{
    Backend, Batch, ExecMode, ModelError, Optimization, StepOutput, TrainState, Unsupported,
};

/// A model the [`Trainer`](crate::Trainer) can train, evaluate and
/// checkpoint. Every method is called by one thread at a time; on the ranks
/// of a world, every rank calls each method in the same order.
///
/// ```
/// use ember_models::checkpoint::{StateDict, StateFile};
/// use ember_models::{Backend, Batch, ExecMode, Model, ModelError, StepOutput};
///
/// /// Predicts the same logit for everyone and learns nothing.
/// struct Constant { logits: Vec<f32> }
///
/// impl Model for Constant {
///     fn train_step(&mut self, _: &Backend, batch: &Batch, _: ExecMode) -> Result<StepOutput, ModelError> {
///         Ok(StepOutput { loss: std::f32::consts::LN_2, times: Default::default() })
///     }
///     fn predict(&mut self, _: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
///         self.logits.resize(batch.size(), 0.0);
///         Ok(&self.logits)
///     }
///     fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
///         Ok(StateDict::new()) // nothing to save
///     }
///     fn load_state_dict(&mut self, _: &StateFile) -> Result<(), ModelError> {
///         Ok(())
///     }
/// }
/// ```
pub trait Model {
    /// One training step on `batch`: forward, loss, backward and both
    /// optimizers, run as `mode` says. Returns the batch's mean loss (on a
    /// world, the mean over every rank's samples). A mode the model does
    /// not support is an error, not a silent fallback.
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError>;

    /// The part of a step that reads no model state and so can run ahead,
    /// on another thread, while the previous batch steps: a sharded model's
    /// input dist (routing and deduplicating the batch's ids). The
    /// [`Trainer`](crate::Trainer) runs it on its pipeline thread, in batch
    /// order, and hands the result to [`Model::train_step_routed`]. `None`
    /// (the default): nothing runs ahead. On a world every rank calls this
    /// together.
    fn input_dist(&self) -> Option<Arc<dyn InputDist>> {
        None
    }

    /// [`Model::train_step`] on a batch whose input dist already ran
    /// (`routed`, from this model's [`Model::input_dist`] on this batch).
    /// The same bits as `train_step`. The default ignores `routed`.
    fn train_step_routed(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        routed: Routed,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        let _ = routed;
        self.train_step(backend, batch, mode)
    }

    /// Sets the optimizers for the step taken after `step` steps: the
    /// schedules' learning rates at that step, weight decay and gradient
    /// clipping ([`Optimization`]). The [`Trainer`](crate::Trainer) calls it
    /// before every step. The default takes only the plain one (nothing
    /// changed) and refuses the rest as unsupported by this model.
    fn set_optimization(
        &mut self,
        optimization: &Optimization,
        step: u64,
    ) -> Result<(), ModelError> {
        let _ = step;
        if optimization.is_plain() {
            Ok(())
        } else {
            Err(Unsupported::Optimization {
                model: std::any::type_name::<Self>(),
            }
            .into())
        }
    }

    /// The logits of `batch`, one per sample (no update), on `backend`'s
    /// dense side.
    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError>;

    /// Brings state kept on a device (the compiled mode's parameters) back
    /// to the host; called before every evaluation and checkpoint.
    fn sync_to_host(&mut self) -> Result<(), ModelError> {
        Ok(())
    }

    /// The world this model is one rank of, if any: its ranks step in
    /// lockstep and average their dense gradients.
    fn world(&self) -> Option<&Arc<dyn Collective>> {
        None
    }

    /// The model's whole state as named tensors (weights, optimizer state
    /// and step counts), for the provided
    /// [`save_checkpoint`](Model::save_checkpoint). A model implements this
    /// and [`load_state_dict`](Model::load_state_dict), or (writing a
    /// format of its own, as [`Dlrm`](crate::Dlrm) does) overrides
    /// `save_checkpoint` and `load_checkpoint` instead; the default is an
    /// error saying so.
    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        Err(Unsupported::NoStateDict.into())
    }

    /// Restores what [`state_dict`](Model::state_dict) saved, from an
    /// opened checkpoint file (the default: an error, as `state_dict`'s).
    fn load_state_dict(&mut self, _file: &StateFile) -> Result<(), ModelError> {
        Err(Unsupported::NoStateDict.into())
    }

    /// Writes a checkpoint of the whole state (weights, optimizer state and
    /// step counts, and `train` when given) into `dir`, atomically; returns
    /// the file (or a set's index) it wrote. On a world every rank calls it.
    /// The default writes [`state_dict`](Model::state_dict) to
    /// `dir/model.safetensors`.
    fn save_checkpoint(
        &mut self,
        dir: &Path,
        train: Option<&TrainState>,
    ) -> Result<PathBuf, ModelError> {
        self.sync_to_host()?;
        self.state_dict()?.save_in(dir, train)
    }

    /// Writes a delta checkpoint into `dir`: only what training changed
    /// since the model's last checkpoint there, as the next file of the
    /// directory's chain; `None` when the model writes no delta here (no
    /// checkpoint of its own to build on, `max_chain` deltas already, or a
    /// model kind without deltas: the default), and the caller writes a
    /// full checkpoint instead. A chain loads as the full checkpoint would.
    fn save_checkpoint_delta(
        &mut self,
        _dir: &Path,
        _train: Option<&TrainState>,
        _max_chain: u64,
    ) -> Result<Option<PathBuf>, ModelError> {
        Ok(None)
    }

    /// Restores what [`Model::save_checkpoint`] wrote to `path`; returns the
    /// training position it held. A resumed run is then bitwise the run that
    /// never stopped. The default reads it with
    /// [`load_state_dict`](Model::load_state_dict).
    fn load_checkpoint(&mut self, path: &Path) -> Result<Option<TrainState>, ModelError> {
        let file = StateFile::open(path)?;
        self.load_state_dict(&file)?;
        file.train_state()
    }

    /// Hears the dataset spec of the data the [`Trainer`](crate::Trainer)
    /// feeds it, for its checkpoints to carry (so that evaluation reads
    /// inputs as training did). Models that record none ignore it.
    fn record_dataset_spec(&mut self, _spec: &ember_dataloader::DatasetSpec) {}
}

/// What a model's [`InputDist`] made of a batch, for its
/// [`Model::train_step_routed`] (each model knows its own type).
pub type Routed = Box<dyn std::any::Any + Send>;

/// A model's input dist, run ahead of its step ([`Model::input_dist`]).
pub trait InputDist: Send + Sync {
    /// The input dist of `batch`. Called in the order the batches step.
    fn run(&self, batch: &Batch) -> Result<Routed, ModelError>;
}

/// Data parallelism over the ranks of a world: every rank steps on its own
/// samples, then [`DataParallel::average`] makes the dense gradients and the
/// loss the means over every rank's samples, so every rank applies the same
/// dense update. One all-reduce per step, summed in rank order, so every
/// rank gets the same bits.
pub struct DataParallel {
    comm: Arc<dyn Collective>,
    /// Reused buffer of the all-reduce.
    flat: Vec<f32>,
}

impl DataParallel {
    /// Averaging over the ranks of `comm`.
    pub fn new(comm: Arc<dyn Collective>) -> Self {
        Self {
            comm,
            flat: Vec::new(),
        }
    }

    /// The world's collective.
    pub fn comm(&self) -> &Arc<dyn Collective> {
        &self.comm
    }

    /// Replaces every gradient of `params` (means over this rank's `samples`)
    /// with the mean over all ranks' samples, and returns the loss as the
    /// mean over all samples. Returns the factor `samples / total samples`,
    /// by which per-sample gradients of this rank's batch (the pooled
    /// embeddings', for the tables) are to be scaled, with the loss.
    pub fn average(
        &mut self,
        mut params: Vec<Param<'_, f32>>,
        samples: usize,
        loss: f32,
    ) -> Result<(f32, f32), ModelError> {
        let n = samples as f32;
        let flat = &mut self.flat;
        flat.clear();
        for p in &params {
            flat.extend(p.grad.iter().map(|g| g * n));
        }
        flat.extend([loss * n, n]);
        self.comm.all_reduce_sum(flat)?;
        let total = flat[flat.len() - 1];
        let mut at = 0;
        for p in &mut params {
            for (g, s) in p.grad.iter_mut().zip(&flat[at..]) {
                *g = s / total;
            }
            at += p.grad.len();
        }
        Ok((flat[flat.len() - 2] / total, n / total))
    }
}
