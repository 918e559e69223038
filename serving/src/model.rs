//! A served model: its [`Inputs`] (what requests hold and how their raw
//! features are transformed) and a [`Scorer`] that turns a batch into
//! logits: a checkpoint's DLRM or DCNv2 (any table dtype, tables in memory
//! or on the disk tier), or one of a caller's own.

use std::path::Path;

use ember_dataloader::Batch;
use ember_dense::DenseOptimizerConfig;
use ember_models::{Backend, BatchShape, Checkpoint, DiskTierOptions, Dlrm, Model};
use ember_sparse::TableOptimizer;

use crate::inputs::{Inputs, Limits};
use crate::ServeError;

/// What turns a batch into one logit a sample. The server calls it from
/// one thread at a time; a panic fails the requests of that call only.
pub trait Scorer: Send {
    /// The logits of `batch`'s samples, in order.
    fn score(&mut self, batch: &Batch) -> Result<Vec<f32>, ServeError>;

    /// The disk tier's cache so far: lookups and misses (`None`: no table
    /// on the disk tier).
    fn cache(&self) -> Option<(u64, u64)> {
        None
    }
}

/// How a checkpoint's model is opened to serve.
#[derive(Clone, Debug, Default)]
pub struct ModelOptions {
    /// What a request may hold.
    pub limits: Limits,
    /// Tables on the disk tier (a model larger than memory), as `ember
    /// predict --disk-dir` puts them.
    pub disk_tier: Option<DiskTierOptions>,
}

/// A model ready to serve: its inputs and its scorer.
pub struct ServedModel {
    /// What requests hold.
    pub inputs: Inputs,
    /// What scores them.
    pub scorer: Box<dyn Scorer>,
}

impl ServedModel {
    /// The model of `checkpoint` (a file, a set's index, or a run's
    /// directory), named `name`, reading its inputs as its recorded dataset
    /// spec says (Criteo's columns for a file that records none).
    pub fn open(checkpoint: &Path, name: &str, options: &ModelOptions) -> Result<Self, ServeError> {
        let ckpt = Checkpoint::open(checkpoint)?;
        let mut spec = ckpt.input_spec();
        // The model's key-value tables take raw ids, as `ember predict` reads them.
        for s in &mut spec.tables {
            let model = ckpt.config().tables.iter().find(|t| t.name == s.name);
            s.kv = model.and_then(|t| t.kv.clone());
        }
        let inputs = Inputs::new(name, spec, options.limits)?;
        let model = ckpt
            .builder()
            .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
            .disk_tier(options.disk_tier.clone())
            .batches(BatchShape {
                batch_size: options.limits.max_batch_size,
                ..Default::default()
            })
            .build()?;
        Ok(Self {
            inputs,
            scorer: Box::new(DlrmScorer {
                model,
                backend: Backend::native(),
            }),
        })
    }

    /// `inputs` scored by a model that computes nothing (every logit 0):
    /// what the server itself costs (protocol, batching, threads).
    pub fn empty(inputs: Inputs) -> Self {
        Self {
            inputs,
            scorer: Box::new(EmptyScorer),
        }
    }
}

/// A DLRM (or DCNv2) from a checkpoint.
struct DlrmScorer {
    model: Dlrm,
    backend: Backend,
}

impl Scorer for DlrmScorer {
    fn score(&mut self, batch: &Batch) -> Result<Vec<f32>, ServeError> {
        Ok(self.model.predict(&self.backend, batch)?.to_vec())
    }

    fn cache(&self) -> Option<(u64, u64)> {
        let tables = self.model.sparse_arch().local()?.tables();
        let stats: ember_sparse::TierStats = tables.iter().filter_map(|t| t.tier_stats()).sum();
        tables
            .iter()
            .any(|t| t.is_on_disk())
            .then_some((stats.lookups, stats.misses))
    }
}

/// Every logit 0, at no cost.
struct EmptyScorer;

impl Scorer for EmptyScorer {
    fn score(&mut self, batch: &Batch) -> Result<Vec<f32>, ServeError> {
        Ok(vec![0.0; batch.labels.len()])
    }
}
