//! Arrays from Python: anything that speaks DLPack (torch tensors, numpy
//! arrays) is imported without a copy (a gradient is then read in place;
//! ids, lengths and weights are copied once, into the batch Ember
//! validates); lists and other sequences are converted. Every failure
//! names the argument and says what it should be.

use dlpark::ffi::{DLDataType, DLDataTypeCode, DLDeviceType};
use dlpark::python::{from_dlpack, ImportedDlpack};
use dlpark::TensorRef;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

/// A DLPack array, imported and checked to be a compact CPU array.
pub struct Imported(ImportedDlpack);

impl Imported {
    fn tensor(&self) -> TensorRef<'_> {
        self.0
            .validate()
            .expect("validated when imported (Imported::new)")
    }

    /// The element type.
    pub fn dtype(&self) -> DLDataType {
        self.tensor().dtype()
    }

    /// The shape.
    pub fn shape(&self) -> Vec<i64> {
        self.tensor().shape().to_vec()
    }

    /// The values, when of element type `T` (checked by the caller's
    /// `code` and `bits`).
    fn slice<T: dlpark::DlpackElement>(&self, name: &str) -> PyResult<&[T]> {
        // SAFETY: the imported tensor (owned by self) keeps its memory
        // alive and unchanged for as long as self is borrowed; its dtype,
        // device and layout were checked.
        unsafe { self.tensor().cpu_slice::<T>() }
            .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))
    }

    /// The values as f32, in place (the array must hold float32).
    pub fn f32s(&self, name: &str) -> PyResult<&[f32]> {
        let dtype = self.dtype();
        if dtype.code != DLDataTypeCode::FLOAT || dtype.bits != 32 || dtype.lanes != 1 {
            return Err(PyTypeError::new_err(format!(
                "{name}: expected float32 values, got {}",
                dtype_name(dtype)
            )));
        }
        self.slice(name)
    }
}

/// Imports `object` through DLPack when it offers the protocol; `None`
/// otherwise. A non-CPU or strided array is an error naming `name`.
pub fn import(object: &Bound<'_, PyAny>, name: &str) -> PyResult<Option<Imported>> {
    if !object.hasattr("__dlpack__")? {
        return Ok(None);
    }
    let imported = from_dlpack(object.as_borrowed(), None, Some(false)).map_err(|e| {
        PyValueError::new_err(format!("{name}: cannot read it through DLPack: {e}"))
    })?;
    let tensor = imported
        .validate()
        .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?;
    if tensor.device().device_type != DLDeviceType::CPU {
        return Err(PyValueError::new_err(format!(
            "{name}: the array is not in CPU memory (DLPack device {:?}): move it with .cpu()",
            tensor.device().device_type
        )));
    }
    if !tensor
        .is_compact()
        .map_err(|e| PyValueError::new_err(format!("{name}: {e}")))?
    {
        return Err(PyValueError::new_err(format!(
            "{name}: the array is not contiguous: pass .contiguous() (torch) or \
             numpy.ascontiguousarray"
        )));
    }
    Ok(Some(Imported(imported)))
}

/// A one-dimensional integer array (int64 or int32, through DLPack), or
/// a sequence of ints, as i64.
pub fn ints(object: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<i64>> {
    if let Some(array) = import(object, name)? {
        let shape = array.shape();
        if shape.len() != 1 {
            return Err(PyValueError::new_err(format!(
                "{name}: expected a 1-D array, got shape {shape:?}"
            )));
        }
        let dtype = array.dtype();
        return match (dtype.code, dtype.bits, dtype.lanes) {
            (DLDataTypeCode::INT, 64, 1) => Ok(array.slice::<i64>(name)?.to_vec()),
            (DLDataTypeCode::INT, 32, 1) => Ok(array
                .slice::<i32>(name)?
                .iter()
                .map(|&v| v.into())
                .collect()),
            _ => Err(PyTypeError::new_err(format!(
                "{name}: expected int64 or int32 values, got {}",
                dtype_name(dtype)
            ))),
        };
    }
    object.extract::<Vec<i64>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name}: expected a 1-D int64/int32 array (torch, numpy) or a list of ints, \
             got {}",
            type_name(object)
        ))
    })
}

/// A one-dimensional float32 array, or a sequence of floats, as f32.
pub fn floats(object: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f32>> {
    if let Some(array) = import(object, name)? {
        let shape = array.shape();
        if shape.len() != 1 {
            return Err(PyValueError::new_err(format!(
                "{name}: expected a 1-D array, got shape {shape:?}"
            )));
        }
        return Ok(array.f32s(name)?.to_vec());
    }
    object.extract::<Vec<f32>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name}: expected a 1-D float32 array (torch, numpy) or a list of floats, got {}",
            type_name(object)
        ))
    })
}

fn type_name(object: &Bound<'_, PyAny>) -> String {
    object
        .get_type()
        .name()
        .map_or_else(|_| "an object".into(), |n| n.to_string())
}

/// torch's and numpy's name of a DLPack element type.
pub fn dtype_name(dtype: DLDataType) -> String {
    let kind = match dtype.code {
        DLDataTypeCode::INT => "int",
        DLDataTypeCode::UINT => "uint",
        DLDataTypeCode::FLOAT => "float",
        DLDataTypeCode::BFLOAT => "bfloat",
        DLDataTypeCode::BOOL => return "bool".into(),
        _ => "code",
    };
    format!("{kind}{}", dtype.bits)
}
