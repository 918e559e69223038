//! `Dlrm` and `Trainer`: Ember's whole engine from Python (the model's
//! tables and dense towers in Rust, the Trainer's loop, evaluations and
//! checkpoints), with the GIL released while it runs. The Trainer trains
//! the sequence models of `sequential` too.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use ember_dataloader::{Batch, DataError, DatasetSpec};
use ember_dense::{DenseOptimizerConfig, Tensor as DenseTensor};
use ember_models::{
    evaluate_data, Backend, Dlrm as DlrmModel, DlrmConfig, FitOptions, Metrics, Model, ModelError,
    Optimization, TrainData, TrainEvent, TrainState, TrainerConfig,
};
use ember_sharding::plan::MAX_DEVICES;
use ember_sparse::TableOptimizer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::kjt::Kjt;
use crate::loader::Loader;
use crate::sequential::{HistoryLoader, SequenceModel};
use crate::tensor::Tensor;
use crate::{errors, input};

/// A DLRM (or DLRM-DCNv2) trained by Ember (Ember's `Dlrm`).
#[pyclass(module = "ember._native")]
pub struct Dlrm {
    model: DlrmModel,
    backend: Backend,
}

#[pymethods]
impl Dlrm {
    /// From Ember's `DlrmConfig`, `TableOptimizer` and
    /// `DenseOptimizerConfig` as JSON (`null`: Ember's defaults);
    /// `shard_over` devices in this process (the planner's plan), or one
    /// collection.
    #[new]
    #[pyo3(signature = (config_json, table_optimizer_json, dense_optimizer_json, seed, shard_over=None))]
    fn new(
        py: Python<'_>,
        config_json: &str,
        table_optimizer_json: &str,
        dense_optimizer_json: &str,
        seed: u64,
        shard_over: Option<usize>,
    ) -> PyResult<Self> {
        let config: DlrmConfig =
            serde_json::from_str(config_json).map_err(|e| errors::json("model config", e))?;
        let table: Option<TableOptimizer> = serde_json::from_str(table_optimizer_json)
            .map_err(|e| errors::json("table optimizer", e))?;
        let dense: Option<DenseOptimizerConfig> = serde_json::from_str(dense_optimizer_json)
            .map_err(|e| errors::json("dense optimizer", e))?;
        if let Some(devices) = shard_over.filter(|&d| d == 0 || d > MAX_DEVICES) {
            return Err(PyValueError::new_err(format!(
                "shard_over {devices}: from 1 to {MAX_DEVICES} devices"
            )));
        }
        let model = py
            .detach(|| {
                let mut builder = DlrmModel::builder(config).seed(seed);
                if let Some(table) = table {
                    builder = builder.table_optimizer(table);
                }
                if let Some(dense) = dense {
                    builder = builder.dense_optimizer(dense);
                }
                if let Some(devices) = shard_over {
                    builder = builder.shard_over(devices);
                }
                builder.build()
            })
            .map_err(errors::model)?;
        Ok(Self {
            model,
            backend: Backend::native(),
        })
    }

    /// Logits of a batch: `dense` a float32 `[batch, num_dense]` array,
    /// `kjt` its sparse features; a float32 `[batch]` tensor. The GIL is
    /// released while it runs.
    fn predict(
        &mut self,
        py: Python<'_>,
        dense: &Bound<'_, PyAny>,
        kjt: PyRef<'_, Kjt>,
    ) -> PyResult<Tensor> {
        let imported = input::import(dense, "dense")?.ok_or_else(|| {
            PyValueError::new_err(
                "dense: expected a float32 [batch, num_dense] array (torch, numpy)",
            )
        })?;
        let shape = imported.shape();
        let [rows, cols] = shape[..] else {
            return Err(PyValueError::new_err(format!(
                "dense: expected a 2-D array, got shape {shape:?}"
            )));
        };
        let values = imported.f32s("dense")?.to_vec();
        let dense = DenseTensor::from_vec(rows as usize, cols as usize, values)
            .map_err(|e| PyValueError::new_err(format!("dense: {e}")))?;
        let batch = Batch {
            dense,
            sparse: kjt.kjt.clone(),
            labels: vec![f32::NAN; rows as usize],
        };
        let (model, backend) = (&mut self.model, &self.backend);
        let logits = py
            .detach(|| model.predict(backend, &batch).map(<[f32]>::to_vec))
            .map_err(errors::model)?;
        let n = logits.len();
        Ok(Tensor::from_vec(logits, &[n]))
    }

    /// AUC, log loss and accuracy on `data`'s first `batches` batches of
    /// epoch 0 (all of them by default), as a dict.
    #[pyo3(signature = (data, batches=None))]
    fn evaluate<'py>(
        &mut self,
        py: Python<'py>,
        data: PyRef<'py, Loader>,
        batches: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let data = data.labelled("evaluate")?;
        let batches = batches.unwrap_or_else(|| data.batches_per_epoch(0));
        let (model, backend) = (&mut self.model, &self.backend);
        let metrics = py
            .detach(|| evaluate_data(model, backend, &*data, batches))
            .map_err(errors::model)?;
        metrics_dict(py, &metrics)
    }

    /// Saves a checkpoint (Ember's safetensors, TorchRec's names) into
    /// `dir`; returns its path.
    fn save(&mut self, py: Python<'_>, dir: PathBuf) -> PyResult<PathBuf> {
        let model = &mut self.model;
        py.detach(|| model.save_checkpoint(&dir, None))
            .map_err(errors::model)
    }

    /// Loads a checkpoint's weights and optimizer state.
    fn load(&mut self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        let model = &mut self.model;
        py.detach(|| model.load_checkpoint(&path))
            .map(|_| ())
            .map_err(errors::model)
    }
}

/// Ember's training loop: epochs, evaluations, checkpoints, resumption.
#[pyclass(module = "ember._native", frozen)]
pub struct Trainer {
    config: TrainerConfig,
}

#[pymethods]
impl Trainer {
    #[new]
    #[pyo3(signature = (epochs=1, max_steps=None, eval_every=0, eval_at_epoch_end=true, checkpoint_dir=None, checkpoint_every=0, log_every=100, pipeline=true, optimization_json=None, eval_every_fraction=None, stop_at_auc=None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        epochs: u64,
        max_steps: Option<u64>,
        eval_every: u64,
        eval_at_epoch_end: bool,
        checkpoint_dir: Option<PathBuf>,
        checkpoint_every: u64,
        log_every: u64,
        pipeline: bool,
        optimization_json: Option<&str>,
        eval_every_fraction: Option<f64>,
        stop_at_auc: Option<f64>,
    ) -> PyResult<Self> {
        let optimization: Optimization = match optimization_json {
            Some(json) => {
                serde_json::from_str(json).map_err(|e| errors::json("optimization", e))?
            }
            None => Optimization::default(),
        };
        optimization.validate().map_err(PyValueError::new_err)?;
        let config = TrainerConfig {
            epochs,
            max_steps,
            eval_every,
            eval_at_epoch_end,
            checkpoint_dir,
            checkpoint_every,
            log_every,
            pipeline,
            optimization,
            eval_every_fraction,
            stop_at_auc,
            ..TrainerConfig::default()
        };
        Ok(Self { config })
    }

    /// Trains `model` (a `Dlrm` on a `Loader`, or a `SequenceModel` on
    /// its `HistoryLoader`) on `train`, evaluating a `Dlrm` on `eval`; with
    /// `resume`, from the latest checkpoint of the checkpoint directory (if
    /// any).
    /// `on_event(dict)` hears Ember's `TrainEvent`s as dicts (all but
    /// `before_step`; durations in seconds); an exception it raises, or
    /// Ctrl-C, stops the run within two batches (those the pipeline had
    /// taken) and is raised. Returns the summary.
    #[pyo3(signature = (model, train, eval=None, on_event=None, resume=false))]
    fn fit<'py>(
        &self,
        py: Python<'py>,
        model: &Bound<'py, PyAny>,
        train: &Bound<'py, PyAny>,
        eval: Option<PyRef<'py, Loader>>,
        on_event: Option<Py<PyAny>>,
        resume: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        if resume && self.config.checkpoint_dir.is_none() {
            return Err(PyValueError::new_err(
                "resume=True needs the Trainer's checkpoint_dir to resume from",
            ));
        }
        let trainer = ember_models::Trainer::new(self.config.clone(), Backend::native());
        // What the model is decides the data it takes.
        let mut dlrm: PyRefMut<Dlrm>;
        let mut sequence: PyRefMut<SequenceModel>;
        let labelled;
        let (model, train): (&mut (dyn Model + Send), &dyn TrainData) =
            if let Ok(m) = model.cast::<Dlrm>() {
                let data = train.cast::<Loader>().map_err(|_| {
                    PyTypeError::new_err("a DLRM trains on an ember.data.ParquetLoader")
                })?;
                labelled = data.borrow().labelled("fit")?;
                dlrm = m.try_borrow_mut()?;
                (&mut dlrm.model, &*labelled)
            } else if let Ok(m) = model.cast::<SequenceModel>() {
                let data = train.cast::<HistoryLoader>().map_err(|_| {
                    PyTypeError::new_err("a sequence model trains on its loader (model.loader)")
                })?;
                if eval.is_some() {
                    return Err(PyValueError::new_err(
                        "eval: a sequence model is evaluated on held-out items by its own \
                         evaluate(histories)",
                    ));
                }
                sequence = m.try_borrow_mut()?;
                (sequence.model(), &data.get().loader)
            } else {
                return Err(PyTypeError::new_err(format!(
                    "model: a DLRM or a sequence model of ember.train, not {}",
                    model.get_type().name()?
                )));
            };
        let eval = eval.map(|e| e.labelled("evaluation")).transpose()?;
        let mut raised: Option<PyErr> = None;
        let stop = AtomicBool::new(false);
        let result = py.detach(|| {
            let from = if resume {
                trainer.resume(model).map_err(errors::model)?
            } else {
                Default::default()
            };
            let mut hear = |event: &TrainEvent| {
                // After a stop, the steps the pipeline had already taken
                // run to their end unheard.
                if stop.load(Ordering::Relaxed) || matches!(event, TrainEvent::BeforeStep { .. }) {
                    return;
                }
                Python::attach(|py| {
                    let heard = py.check_signals().and_then(|()| match on_event.as_ref() {
                        Some(callback) => callback.call1(py, (to_python(py, event)?,)).map(drop),
                        None => Ok(()),
                    });
                    if let Err(error) = heard {
                        raised.get_or_insert(error);
                        stop.store(true, Ordering::Relaxed);
                    }
                });
            };
            let train = Interruptible {
                data: train,
                stop: &stop,
            };
            let eval = eval
                .as_deref()
                .map(|data| Interruptible { data, stop: &stop });
            let options = FitOptions {
                eval: eval.as_ref().map(|e| e as &dyn TrainData),
                from,
                on_event: Some(&mut hear),
            };
            trainer.fit(model, &train, options).map_err(errors::train)
        });
        // What stopped the run (a callback's exception, Ctrl-C) comes
        // before the error the stop made.
        if let Some(error) = raised {
            return Err(error);
        }
        let summary = result?;
        let out = PyDict::new(py);
        out.set_item("steps", summary.steps)?;
        out.set_item("samples", summary.samples)?;
        out.set_item("train_seconds", summary.train_seconds)?;
        out.set_item("data_wait_seconds", summary.data_wait_seconds)?;
        out.set_item("input_dist_seconds", summary.input_dist_seconds)?;
        out.set_item("compute_seconds", summary.compute_seconds)?;
        out.set_item("loss_first", summary.loss_first)?;
        out.set_item("loss_last", summary.loss_last)?;
        out.set_item("resumed_at_step", summary.resumed_at_step)?;
        out.set_item("checkpoint", summary.checkpoint)?;
        let eval = summary.eval.map(|m| metrics_dict(py, &m)).transpose()?;
        out.set_item("eval", eval)?;
        Ok(out)
    }
}

/// An evaluation's metrics as a dict (`rows` as the command line names
/// the count).
fn metrics_dict<'py>(py: Python<'py>, metrics: &Metrics) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("auc", metrics.auc)?;
    out.set_item("logloss", metrics.logloss)?;
    out.set_item("ne", metrics.ne)?;
    out.set_item("calibration", metrics.calibration)?;
    out.set_item("ctr", metrics.ctr)?;
    out.set_item("accuracy", metrics.accuracy)?;
    out.set_item("precision", metrics.precision)?;
    out.set_item("recall", metrics.recall)?;
    out.set_item("f1", metrics.f1)?;
    out.set_item("average_precision", metrics.average_precision)?;
    out.set_item("rows", metrics.count)?;
    Ok(out)
}

/// Training data that ends with an error once `stop` is set (a Python
/// exception or Ctrl-C while the run had the GIL released).
struct Interruptible<'a> {
    data: &'a dyn TrainData,
    stop: &'a AtomicBool,
}

impl TrainData for Interruptible<'_> {
    fn batches_per_epoch(&self, epoch: u64) -> u64 {
        self.data.batches_per_epoch(epoch)
    }

    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        let stop = self.stop;
        Box::new(self.data.epoch(epoch, skip).map(move |batch| {
            if stop.load(Ordering::Relaxed) {
                // Replaced by what set `stop` (see `fit`).
                Err(ModelError::Data(DataError::DecoderStopped))
            } else {
                batch
            }
        }))
    }

    fn fingerprint(&self) -> u64 {
        self.data.fingerprint()
    }

    fn start_state(&self) -> TrainState {
        self.data.start_state()
    }

    fn dataset_spec(&self) -> Option<&DatasetSpec> {
        self.data.dataset_spec()
    }
}

/// A `TrainEvent` or a report as Python values (through JSON), durations
/// in seconds.
pub fn to_python<'py>(
    py: Python<'py>,
    value: &impl serde::Serialize,
) -> PyResult<Bound<'py, PyAny>> {
    fn seconds(value: serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match value {
            Value::Object(map)
                if map.len() == 2 && map.contains_key("secs") && map.contains_key("nanos") =>
            {
                let secs = map["secs"].as_f64().unwrap_or(0.0);
                let nanos = map["nanos"].as_f64().unwrap_or(0.0);
                Value::from(secs + nanos * 1e-9)
            }
            Value::Object(map) => {
                Value::Object(map.into_iter().map(|(k, v)| (k, seconds(v))).collect())
            }
            other => other,
        }
    }
    let value = serde_json::to_value(value).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    let json = serde_json::to_string(&seconds(value))
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    py.import("json")?.call_method1("loads", (json,))
}
