//! The native module of the `ember` Python package (`ember._native`):
//! Ember's embedding-bag tables, their jagged inputs and their tensors,
//! for the Python layer (`python/ember/`) that gives them TorchRec's names
//! and torch's autograd. The Rust API (ember-sparse) stays the source of
//! truth; this crate only converts.

use pyo3::prelude::*;

mod collection;
mod errors;
mod input;
mod kjt;
mod loader;
mod planner;
mod sequence;
mod sequential;
mod tables;
mod tensor;
mod train;

/// `ember._native`: `Collection`, `SequenceCollection`, `Kjt`, `Tensor`,
/// `Loader`, `Dlrm`, `Trainer`, `Histories`, `HistoryLoader`,
/// `SequenceModel`, and the planner's `plan`.
#[pymodule]
#[pyo3(name = "_native")]
fn native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<tensor::Tensor>()?;
    module.add_class::<kjt::Kjt>()?;
    module.add_class::<collection::Collection>()?;
    module.add_class::<sequence::SequenceCollection>()?;
    module.add_class::<loader::Loader>()?;
    module.add_class::<loader::Epoch>()?;
    module.add_class::<train::Dlrm>()?;
    module.add_class::<train::Trainer>()?;
    module.add_class::<sequential::Histories>()?;
    module.add_class::<sequential::HistoryLoader>()?;
    module.add_class::<sequential::SequenceModel>()?;
    module.add_function(wrap_pyfunction!(loader::criteo_spec, module)?)?;
    module.add_function(wrap_pyfunction!(loader::read_spec, module)?)?;
    module.add_function(wrap_pyfunction!(planner::plan, module)?)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
