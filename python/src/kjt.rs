//! `Kjt`: a validated `KeyedJaggedTensor` built from Python arrays or
//! lists (TorchRec's layout: key-major values, lengths or offsets).

use ember_sparse::KeyedJaggedTensor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::tensor::Tensor;
use crate::{errors, input};

/// A batch of jagged ids, checked once when built (negative lengths,
/// sums, offsets, weights: Ember's errors as `ValueError`).
#[pyclass(module = "ember._native", frozen)]
pub struct Kjt {
    pub(crate) kjt: KeyedJaggedTensor,
}

#[pymethods]
impl Kjt {
    /// `keys`, and `values` with exactly one of `lengths` (one per key and
    /// sample, key-major) or `offsets` (`len(keys) * batch + 1`), and
    /// optional per-value `weights`. Arrays are int64/int32 (float32 for
    /// weights) through DLPack, or Python lists.
    #[new]
    #[pyo3(signature = (keys, values, lengths=None, offsets=None, weights=None))]
    fn new(
        keys: Vec<String>,
        values: &Bound<'_, PyAny>,
        lengths: Option<&Bound<'_, PyAny>>,
        offsets: Option<&Bound<'_, PyAny>>,
        weights: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let values = input::ints(values, "values")?;
        let weights = weights.map(|w| input::floats(w, "weights")).transpose()?;
        let kjt = match (lengths, offsets) {
            (Some(lengths), None) => {
                let lengths = input::ints(lengths, "lengths")?;
                KeyedJaggedTensor::from_lengths(keys, values, &lengths, weights)
            }
            (None, Some(offsets)) => {
                let offsets = input::ints(offsets, "offsets")?;
                KeyedJaggedTensor::from_offsets(keys, values, &offsets, weights)
            }
            _ => {
                return Err(PyValueError::new_err(
                    "give exactly one of lengths and offsets",
                ))
            }
        };
        Ok(Self {
            kjt: kjt.map_err(errors::sparse)?,
        })
    }

    /// The keys, in input order.
    fn keys(&self) -> Vec<String> {
        self.kjt.keys().to_vec()
    }

    /// The batch size (samples per key).
    fn stride(&self) -> usize {
        self.kjt.stride()
    }

    /// The number of ids.
    fn num_values(&self) -> usize {
        self.kjt.values().len()
    }

    /// One length per key and sample, key-major.
    fn lengths(&self) -> Vec<usize> {
        self.kjt.lengths()
    }

    /// `len(keys) * stride + 1` offsets into the values.
    fn offsets(&self) -> Vec<usize> {
        self.kjt.offsets().to_vec()
    }

    /// The ids, as an int64 tensor (a copy: the batch stays as checked).
    fn values_tensor(&self) -> Tensor {
        let values = self.kjt.values().to_vec();
        let n = values.len();
        Tensor::from_vec(values, &[n])
    }

    /// The lengths, as an int64 tensor.
    fn lengths_tensor(&self) -> Tensor {
        let lengths: Vec<i64> = self.kjt.lengths().into_iter().map(|l| l as i64).collect();
        let n = lengths.len();
        Tensor::from_vec(lengths, &[n])
    }

    /// The offsets, as an int64 tensor.
    fn offsets_tensor(&self) -> Tensor {
        let offsets: Vec<i64> = self.kjt.offsets().iter().map(|&o| o as i64).collect();
        let n = offsets.len();
        Tensor::from_vec(offsets, &[n])
    }

    /// Whether the ids carry weights.
    fn has_weights(&self) -> bool {
        self.kjt.weights().is_some()
    }

    /// The same batch without its weights (an unweighted collection's
    /// input, as TorchRec's `is_weighted=False` reads it).
    fn without_weights(&self) -> PyResult<Self> {
        let offsets: Vec<i64> = self.kjt.offsets().iter().map(|&o| o as i64).collect();
        let kjt = KeyedJaggedTensor::from_offsets(
            self.kjt.keys().to_vec(),
            self.kjt.values().to_vec(),
            &offsets,
            None,
        );
        Ok(Self {
            kjt: kjt.map_err(errors::sparse)?,
        })
    }

    /// The per-id weights, as a float32 tensor, or None.
    fn weights_tensor(&self) -> Option<Tensor> {
        let weights = self.kjt.weights()?.to_vec();
        let n = weights.len();
        Some(Tensor::from_vec(weights, &[n]))
    }
}
