//! `Loader`: Ember's Parquet loader (its decoding and batching threads)
//! from Python, an epoch at a time; waiting for a batch releases the GIL.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ember_dataloader::loader::Batches;
use ember_dataloader::{DatasetSpec, LoaderConfig};
use ember_sparse::EmbeddingBagConfig;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::errors;
use crate::kjt::Kjt;
use crate::tensor::Tensor;

/// Parquet files (or directories of them) read as batches by a
/// `LoaderConfig` (Ember's, as JSON): the files' columns are checked when
/// it is made.
#[pyclass(module = "ember._native", frozen)]
pub struct Loader {
    loader: Arc<ember_dataloader::Loader>,
}

impl Loader {
    /// The loader, shared (the Trainer reads it on its threads).
    pub fn loader(&self) -> Arc<ember_dataloader::Loader> {
        Arc::clone(&self.loader)
    }

    /// The loader, refused (naming `what` needs them) when it reads no
    /// labels.
    pub fn labelled(&self, what: &str) -> PyResult<Arc<ember_dataloader::Loader>> {
        if !self.loader.config().labels {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "{what} needs labels, and this loader reads none (labels=False)"
            )));
        }
        Ok(self.loader())
    }
}

#[pymethods]
impl Loader {
    #[new]
    fn new(py: Python<'_>, paths: Vec<PathBuf>, config_json: &str) -> PyResult<Self> {
        let config: LoaderConfig =
            serde_json::from_str(config_json).map_err(|e| errors::json("loader config", e))?;
        let loader = py
            .detach(|| ember_dataloader::Loader::open(&paths, config))
            .map_err(errors::data)?;
        Ok(Self {
            loader: Arc::new(loader),
        })
    }

    /// Batches of `epoch` (from the files' metadata).
    fn batches_per_epoch(&self, epoch: u64) -> u64 {
        self.loader.batches_per_epoch(epoch)
    }

    /// The sparse features' keys, in batch order.
    #[getter]
    fn keys(&self) -> Vec<String> {
        let spec = &self.loader.config().spec;
        spec.sparse.iter().map(|c| c.key().to_string()).collect()
    }

    /// Dense features per sample.
    #[getter]
    fn num_dense(&self) -> usize {
        self.loader.config().spec.num_dense()
    }

    /// The batches of `epoch`, after its first `skip`.
    #[pyo3(signature = (epoch=0, skip=0))]
    fn epoch(&self, epoch: u64, skip: u64) -> Epoch {
        Epoch {
            batches: Mutex::new(Some(self.loader.epoch(epoch, skip))),
        }
    }
}

/// One epoch's batches: an iterator of `(dense, kjt, labels)`.
#[pyclass(module = "ember._native", frozen)]
pub struct Epoch {
    batches: Mutex<Option<Batches>>,
}

impl Drop for Epoch {
    fn drop(&mut self) {
        // An epoch left early stops its threads, which finish the row
        // group they decode first: wait for them on a thread of its own,
        // not on one holding the GIL.
        let batches = self.batches.get_mut().ok().and_then(Option::take);
        if let Some(batches) = batches {
            std::thread::spawn(move || drop(batches));
        }
    }
}

#[pymethods]
impl Epoch {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next batch: dense `[batch, num_dense]` float32, the sparse
    /// features as a `Kjt`, labels `[batch]` float32. The GIL is released
    /// while the loader's threads make it.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<(Tensor, Kjt, Tensor)>> {
        let next = py.detach(|| {
            let mut batches = self.batches.lock().map_err(|_| {
                PyRuntimeError::new_err("the epoch's iterator failed in another thread")
            })?;
            let next = batches.as_mut().and_then(Iterator::next);
            if !matches!(next, Some(Ok(_))) {
                // The epoch ends at its last batch or its first error:
                // stop its threads now.
                *batches = None;
            }
            Ok::<_, PyErr>(next)
        })?;
        let Some(batch) = next.transpose().map_err(errors::data)? else {
            return Ok(None);
        };
        let rows = batch.dense.rows();
        let cols = batch.dense.cols();
        let dense = Tensor::from_vec(batch.dense.into_vec(), &[rows, cols]);
        let labels = Tensor::from_vec(batch.labels, &[rows]);
        Ok(Some((dense, Kjt { kjt: batch.sparse }, labels)))
    }
}

/// The Criteo schema's dataset spec (`label`, `int_0..12`, `cat_0..25`)
/// for tables given as JSON, as JSON.
#[pyfunction]
pub fn criteo_spec(tables_json: &str) -> PyResult<String> {
    let tables: Vec<EmbeddingBagConfig> =
        serde_json::from_str(tables_json).map_err(|e| errors::json("tables", e))?;
    serde_json::to_string(&DatasetSpec::criteo(&tables)).map_err(|e| errors::json("spec", e))
}

/// A dataset spec file (Ember's JSON), checked, as JSON.
#[pyfunction]
pub fn read_spec(path: PathBuf) -> PyResult<String> {
    let spec = DatasetSpec::from_file(&path).map_err(errors::data)?;
    serde_json::to_string(&spec).map_err(|e| errors::json("spec", e))
}
