//! A served model: its [`Inputs`] (what requests hold and how their raw
//! features are transformed) and the [`Scorer`]s that turn a batch into
//! its outputs, one an instance (Triton's instance group): a checkpoint's
//! DLRM or DCNv2 (any table dtype, tables in memory or on the disk tier),
//! SASRec or HSTU (in memory), or scorers of a caller's own.

use std::path::Path;

use ember_dataloader::Batch;
use ember_dense::DenseOptimizerConfig;
use ember_models::sequential::{SequenceModelConfig, SequenceScorer, SequenceScores};
use ember_models::{Backend, BatchShape, Checkpoint, DiskTierOptions, Dlrm, Model};
use ember_sparse::TableOptimizer;

use crate::inputs::{Inputs, Limits};
use crate::outputs::Column;
use crate::ServeError;

/// What turns a batch into the model's outputs. The server calls it from
/// one thread at a time; a panic fails the requests of that call only.
pub trait Scorer: Send {
    /// `batch`'s outputs: one column each of the model's
    /// [`Inputs::outputs`], in order, its samples' values in order (a
    /// DLRM's: [`logit_and_probability`] of its logits).
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError>;

    /// The disk tier's cache so far: lookups and misses (`None`: no table
    /// on the disk tier).
    fn cache(&self) -> Option<(u64, u64)> {
        None
    }
}

/// How a checkpoint's model is opened to serve.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// What a request may hold.
    pub limits: Limits,
    /// Tables on the disk tier (a model larger than memory), as `ember
    /// predict --disk-dir` puts them.
    pub disk_tier: Option<DiskTierOptions>,
    /// Copies of the model that run batches side by side (Triton's
    /// `instance_group` count), each on its share of the threads. On few
    /// cores, whole batches in parallel beat one batch's layers split
    /// across threads; each copy holds its own tables.
    pub instances: usize,
    /// Items a retrieval model (SASRec, HSTU retrieval) answers a history
    /// with, best first.
    pub top_k: usize,
}

impl Default for ModelOptions {
    /// The default limits, tables in memory, one instance, the top 10
    /// items.
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            disk_tier: None,
            instances: 1,
            top_k: 10,
        }
    }
}

/// A model ready to serve: its inputs and its instances.
pub struct ServedModel {
    /// What requests hold.
    pub inputs: Inputs,
    /// What scores them: one scorer an instance, each running batches on
    /// a thread of its own (at least one).
    pub instances: Vec<Box<dyn Scorer>>,
}

impl ServedModel {
    /// The model of `checkpoint` (a file, a set's index, or a run's
    /// directory), named `name`, as `options.instances` copies: a DLRM
    /// reading its inputs as its recorded dataset spec says (Criteo's
    /// columns for a file that records none), or a sequence model reading
    /// histories.
    pub fn open(checkpoint: &Path, name: &str, options: &ModelOptions) -> Result<Self, ServeError> {
        if options.instances == 0 {
            return Err(ServeError::Config(
                "a model needs at least 1 instance".into(),
            ));
        }
        if let Some(config) = SequenceModelConfig::of_checkpoint(checkpoint)? {
            return Self::open_sequence(checkpoint, name, config, options);
        }
        if options.instances > 1 && options.disk_tier.is_some() {
            return Err(ServeError::Config(format!(
                "the disk tier serves one instance ({} asked): its cache is the model's memory",
                options.instances
            )));
        }
        let ckpt = Checkpoint::open(checkpoint)?;
        let mut spec = ckpt.input_spec();
        // The model's key-value tables take raw ids, as `ember predict` reads them.
        for s in &mut spec.tables {
            let model = ckpt.config().tables.iter().find(|t| t.name == s.name);
            s.kv = model.and_then(|t| t.kv.clone());
        }
        let inputs = Inputs::new(name, spec, options.limits)?;
        let mut instances: Vec<Box<dyn Scorer>> = Vec::with_capacity(options.instances);
        for _ in 0..options.instances {
            let model = ckpt
                .builder()
                .optimizers(TableOptimizer::None, DenseOptimizerConfig::sgd(0.0))
                .disk_tier(options.disk_tier.clone())
                .batches(BatchShape {
                    batch_size: options.limits.max_batch_size,
                    ..Default::default()
                })
                .build()?;
            instances.push(Box::new(DlrmScorer {
                model,
                backend: Backend::native(),
            }));
        }
        Ok(Self { inputs, instances })
    }

    /// A sequence model's checkpoint, its tables in memory.
    fn open_sequence(
        checkpoint: &Path,
        name: &str,
        config: SequenceModelConfig,
        options: &ModelOptions,
    ) -> Result<Self, ServeError> {
        if options.disk_tier.is_some() {
            return Err(ServeError::Config(format!(
                "{} serves its tables from memory, not the disk tier",
                config.name()
            )));
        }
        let mut instances: Vec<Box<dyn Scorer>> = Vec::with_capacity(options.instances);
        for _ in 0..options.instances {
            let model = SequenceScorer::open(checkpoint)?;
            // The file read again: it must still hold the model the
            // inputs describe (a checkpoint written meanwhile may not).
            if model.config() != &config {
                return Err(ServeError::Config(format!(
                    "{}: the checkpoint changed while it was opened; try again",
                    checkpoint.display()
                )));
            }
            let top_k = options.top_k;
            instances.push(Box::new(HistoryScorer { model, top_k }));
        }
        let inputs = Inputs::histories(name, config, options.limits, options.top_k)?;
        Ok(Self { inputs, instances })
    }

    /// `inputs` scored by `instances` copies of a model that computes
    /// nothing (every logit 0): what the server itself costs (protocol,
    /// batching, threads).
    pub fn empty(inputs: Inputs, instances: usize) -> Self {
        let outputs: Vec<(bool, usize)> = (inputs.outputs().iter())
            .map(|o| (o.ints, o.width()))
            .collect();
        // A DLRM's probability is its logit's, as ever (0.5 for 0).
        let dlrm = inputs.spec().is_some();
        let instances = (0..instances.max(1))
            .map(|_| Box::new(EmptyScorer(outputs.clone(), dlrm)) as Box<dyn Scorer>)
            .collect();
        Self { inputs, instances }
    }
}

/// A DLRM (or DCNv2) from a checkpoint.
struct DlrmScorer {
    model: Dlrm,
    backend: Backend,
}

impl Scorer for DlrmScorer {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        let logits = self.model.predict(&self.backend, batch)?.to_vec();
        Ok(logit_and_probability(logits))
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

/// A DLRM's outputs from its logits: the logits, and the probabilities
/// `ember predict` writes beside them (for a [`Scorer`] of one's own).
pub fn logit_and_probability(logits: Vec<f32>) -> Vec<Column> {
    let probabilities = (logits.iter())
        .map(|&z| ember_dataloader::writer::probability(z))
        .collect();
    vec![Column::Floats(logits), Column::Floats(probabilities)]
}

/// A sequence model: each history's top items, or its candidates' logits.
struct HistoryScorer {
    model: SequenceScorer,
    top_k: usize,
}

impl Scorer for HistoryScorer {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        Ok(match self.model.score_batch(batch, self.top_k)? {
            SequenceScores::TopItems { items, scores } => {
                vec![Column::Ints(items), Column::Floats(scores)]
            }
            SequenceScores::Candidates { logits } => logit_and_probability(logits),
        })
    }
}

/// Every output 0 (a DLRM's probability 0.5), at no cost: (integers,
/// width) of each output, and whether they are a DLRM's.
struct EmptyScorer(Vec<(bool, usize)>, bool);

impl Scorer for EmptyScorer {
    fn score(&mut self, batch: &Batch) -> Result<Vec<Column>, ServeError> {
        let n = batch.labels.len();
        if self.1 {
            return Ok(logit_and_probability(vec![0.0; n]));
        }
        Ok((self.0.iter())
            .map(|&(ints, w)| match ints {
                true => Column::Ints(vec![0; n * w]),
                false => Column::Floats(vec![0.0; n * w]),
            })
            .collect())
    }
}
