//! Decoding a Parquet record batch into a [`Chunk`]'s labels, dense
//! values and ids, as the dataset spec says; every bad value is an error
//! naming the file, the column and the row.

use std::path::Path;

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, Int8Type};
use arrow_array::{Array, ArrayRef, RecordBatch};

use arrow_schema::DataType;

use crate::spec::{DatasetSpec, SparseColumn};
use crate::transform::IdTransform;
use crate::DataError;

/// The ids of one sparse column over a chunk's rows.
#[derive(Clone, Debug, Default)]
pub struct FeatureChunk {
    /// `rows + 1` offsets into `values`.
    pub offsets: Vec<u32>,
    /// The transformed ids of every row, row after row; missing values add none.
    pub values: Vec<i64>,
    /// One weight per id when the column is weighted, else empty.
    pub weights: Vec<f32>,
}

/// One decoded row group, transformed.
#[derive(Clone, Debug, Default)]
pub struct Chunk {
    /// Rows decoded.
    pub rows: usize,
    /// Row-major `[rows, dense columns]`.
    pub dense: Vec<f32>,
    /// One label per row, 0.0 or 1.0.
    pub labels: Vec<f32>,
    /// One per sparse column of the spec, in that order.
    pub features: Vec<FeatureChunk>,
}

/// The column types the spec's roles accept, as the errors name them.
pub(crate) const LABEL_TYPES: &str =
    "Int8, Int16, Int32, Int64, Boolean, Float32 or Float64 (0 or 1)";
pub(crate) const DENSE_TYPES: &str = "Int32, Int64, Float32 or Float64";
pub(crate) const ID_TYPES: &str = "Int64 or List(Int64)";

pub(crate) fn is_label_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Int8 | Int16 | Int32 | Int64 | Boolean | Float32 | Float64
    )
}

pub(crate) fn is_dense_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(t, Int32 | Int64 | Float32 | Float64)
}

pub(crate) fn is_id_column(t: &DataType) -> bool {
    match t {
        DataType::Int64 => true,
        DataType::List(item) => *item.data_type() == DataType::Int64,
        _ => false,
    }
}

pub(crate) fn is_float(t: &DataType) -> bool {
    matches!(t, DataType::Float32 | DataType::Float64)
}

/// The weights a column of ids of type `ids` takes: floats of its shape.
pub(crate) fn weights_fit(ids: &DataType, weights: &DataType) -> bool {
    match (ids, weights) {
        (DataType::List(_), DataType::List(w)) => is_float(w.data_type()),
        (DataType::Int64, w) => is_float(w),
        _ => false,
    }
}

/// Every value of a numeric column as f32 (`None`: null).
pub(crate) fn numeric_f32(col: &dyn Array) -> Option<Vec<Option<f32>>> {
    use arrow_array::types::*;
    macro_rules! prim {
        ($t:ty) => {
            col.as_primitive_opt::<$t>()
                .map(|a| a.iter().map(|x| x.map(|x| x as f32)).collect())
        };
    }
    match col.data_type() {
        DataType::Int8 => prim!(Int8Type),
        DataType::Int16 => prim!(Int16Type),
        DataType::Int32 => prim!(Int32Type),
        DataType::Int64 => prim!(Int64Type),
        DataType::Float32 => prim!(Float32Type),
        DataType::Float64 => prim!(Float64Type),
        DataType::Boolean => Some(
            col.as_boolean_opt()?
                .iter()
                .map(|x| x.map(|b| b as u8 as f32))
                .collect(),
        ),
        _ => None,
    }
}

/// A weight read from the data: present and finite, or an error naming the row.
pub(crate) fn weight(
    path: &Path,
    column: &str,
    w: Option<f32>,
    row: usize,
) -> Result<f32, DataError> {
    match w {
        Some(w) if w.is_finite() => Ok(w),
        Some(w) => Err(DataError::column(
            path,
            column,
            format!("row {row} of the row group has weight {w}"),
        )),
        None => Err(DataError::column(
            path,
            column,
            format!("row {row} of the row group has a null weight for an id"),
        )),
    }
}

/// Column `name` of `batch`.
pub(crate) fn column<'a>(
    path: &Path,
    batch: &'a RecordBatch,
    name: &str,
) -> Result<&'a ArrayRef, DataError> {
    batch
        .column_by_name(name)
        .ok_or_else(|| DataError::column(path, name, "missing from the file".into()))
}

/// Column `name` is of another type than `want`.
fn wrong(path: &Path, name: &str, col: &dyn Array, want: &str) -> DataError {
    DataError::column(
        path,
        name,
        format!("has type {}, expected {want}", col.data_type()),
    )
}

/// Appends the labels of rows `first..first + n` (column `label`, or NaN
/// for each row when the data is read without labels).
pub(crate) fn append_labels(
    path: &Path,
    (label, labels): (&str, Option<&ArrayRef>),
    (first, n): (usize, usize),
    labels_out: &mut Vec<f32>,
) -> Result<(), DataError> {
    if labels.is_none() {
        labels_out.resize(labels_out.len() + n, f32::NAN);
    } else if let Some(l) = (labels.and_then(|l| l.as_primitive_opt::<Int8Type>()))
        // Criteo's int8 label, the common case, without the generic path.
        .filter(|l| l.null_count() == 0)
    {
        if let Some(r) = l.values().iter().position(|&y| y != 0 && y != 1) {
            return Err(DataError::column(
                path,
                label,
                format!(
                    "row {} of the row group has label {}, not 0 or 1",
                    first + r,
                    l.value(r)
                ),
            ));
        }
        labels_out.extend(l.values().iter().map(|&y| y as f32));
    } else if let Some(labels) = labels {
        let values =
            numeric_f32(labels.as_ref()).ok_or_else(|| wrong(path, label, labels, LABEL_TYPES))?;
        for (r, y) in values.into_iter().enumerate() {
            match y {
                Some(y) if y == 0.0 || y == 1.0 => labels_out.push(y),
                Some(y) => {
                    return Err(DataError::column(
                        path,
                        label,
                        format!(
                            "row {} of the row group has label {y}, not 0 or 1",
                            first + r
                        ),
                    ))
                }
                None => {
                    return Err(DataError::column(
                        path,
                        label,
                        format!("row {} of the row group has no label", first + r),
                    ))
                }
            }
        }
    }
    Ok(())
}

/// Appends the dense columns' values, transformed, row-major.
pub(crate) fn append_dense(
    path: &Path,
    batch: &RecordBatch,
    s: &DatasetSpec,
    first: usize,
    dense_out: &mut Vec<f32>,
) -> Result<(), DataError> {
    let n = batch.num_rows();
    let nd = s.dense.len();
    let base = dense_out.len();
    dense_out.resize(base + n * nd, 0.0);
    for (j, c) in s.dense.iter().enumerate() {
        let col = column(path, batch, &c.column)?;
        let transform = s.transform_of(j);
        let out = &mut dense_out[base..];
        // Criteo's int32 columns, the common case, directly.
        match col.as_primitive_opt::<Int32Type>() {
            Some(ints) if ints.null_count() == 0 => {
                for (r, &x) in ints.values().iter().enumerate() {
                    out[r * nd + j] = transform.apply_int(Some(x));
                }
            }
            Some(ints) => {
                for (r, x) in ints.iter().enumerate() {
                    out[r * nd + j] = transform.apply_int(x);
                }
            }
            _ => {
                let values = numeric_f32(col.as_ref())
                    .filter(|_| is_dense_type(col.data_type()))
                    .ok_or_else(|| wrong(path, &c.column, col, DENSE_TYPES))?;
                for (r, x) in values.into_iter().enumerate() {
                    // One rule for every transform: a NaN or infinite
                    // input is an error (log1p would read NaN as 0).
                    if let Some(x) = x.filter(|x| !x.is_finite()) {
                        return Err(DataError::column(
                            path,
                            &c.column,
                            format!("row {} of the row group is {x}: dense values must be finite (a missing value is a null)", first + r),
                        ));
                    }
                    let y = transform.apply_f32(x);
                    if !y.is_finite() {
                        return Err(DataError::column(
                            path,
                            &c.column,
                            format!(
                                "row {} of the row group is {} ({y} after the transform)",
                                first + r,
                                x.unwrap_or(0.0)
                            ),
                        ));
                    }
                    out[r * nd + j] = y;
                }
            }
        }
    }
    Ok(())
}

/// Appends one sparse column's ids (and weights), as bags of a table of
/// `rows` rows.
pub(crate) fn append_ids(
    path: &Path,
    batch: &RecordBatch,
    (c, rows, t): (&SparseColumn, u64, IdTransform),
    first: usize,
    out: &mut FeatureChunk,
) -> Result<(), DataError> {
    let n = batch.num_rows();
    let name = &c.column;
    let col = column(path, batch, name)?;
    let weights = match &c.weights {
        Some(w) => Some((w, column(path, batch, w)?)),
        None => None,
    };
    out.offsets.reserve(n);
    let mut last = *out.offsets.last().unwrap_or(&0);
    if let Some(ids) = col.as_primitive_opt::<Int64Type>() {
        let w = match &weights {
            Some((wname, w)) => Some(
                numeric_f32(w.as_ref())
                    .filter(|_| is_float(w.data_type()))
                    .ok_or_else(|| wrong(path, wname, w, "Float32 or Float64"))?,
            ),
            None => None,
        };
        out.values.reserve(n);
        if ids.null_count() == 0 && w.is_none() {
            // One id a row, the common case, without the null checks.
            out.values
                .extend(ids.values().iter().map(|&id| t.apply(id, rows)));
            out.offsets.extend((1..=n as u32).map(|k| last + k));
            return Ok(());
        }
        for (r, id) in ids.iter().enumerate() {
            if let Some(id) = id {
                out.values.push(t.apply(id, rows));
                if let (Some(w), Some((wname, _))) = (&w, &weights) {
                    out.weights.push(weight(path, wname, w[r], first + r)?);
                }
                last += 1;
            }
            out.offsets.push(last);
        }
    } else if let Some(lists) = col.as_list_opt::<i32>() {
        let ids = lists
            .values()
            .as_primitive_opt::<Int64Type>()
            .ok_or_else(|| {
                DataError::column(path, name, "is a list of something other than Int64".into())
            })?;
        let w = match &weights {
            Some((wname, w)) => {
                let lw = w
                    .as_list_opt::<i32>()
                    .ok_or_else(|| wrong(path, wname, w, "List(Float32) or List(Float64)"))?;
                let values = numeric_f32(lw.values().as_ref())
                    .filter(|_| is_float(lw.values().data_type()))
                    .ok_or_else(|| wrong(path, wname, w, "List(Float32) or List(Float64)"))?;
                Some((*wname, lw.clone(), values))
            }
            None => None,
        };
        let offsets = lists.value_offsets();
        for r in 0..n {
            let (start, end) = (offsets[r] as usize, offsets[r + 1] as usize);
            if let Some((wname, lw, _)) = &w {
                let got = if lw.is_valid(r) {
                    lw.value_length(r) as usize
                } else {
                    0
                };
                let want = if lists.is_valid(r) { end - start } else { 0 };
                if got != want {
                    return Err(DataError::column(
                        path,
                        wname,
                        format!(
                            "row {} of the row group has {got} weights for {want} ids of '{name}'",
                            first + r
                        ),
                    ));
                }
            }
            if lists.is_valid(r) {
                let w_at = w.as_ref().map(|(_, lw, _)| lw.value_offsets()[r] as usize);
                for k in start..end {
                    if ids.is_valid(k) {
                        out.values.push(t.apply(ids.value(k), rows));
                        if let (Some((wname, _, values)), Some(at)) = (&w, w_at) {
                            let v = values[at + (k - start)];
                            out.weights.push(weight(path, wname, v, first + r)?);
                        }
                        last += 1;
                    }
                }
            }
            out.offsets.push(last);
        }
    } else {
        return Err(wrong(path, name, col, ID_TYPES));
    }
    Ok(())
}
