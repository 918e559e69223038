//! A model's outputs: their names, types and shapes a sample, and the
//! values a scorer gives for a batch, split back into its requests.
//!
//! A DLRM gives one `logit` and `probability` a sample; a retrieval model
//! a sample's `k` best `items` and their `scores`; HSTU ranking a `logit`
//! and `probability` for each candidate and task.

use crate::protocol::{OutputData, TensorMetadata};
use crate::ServeError;

/// One output of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputSpec {
    /// Its name in requests and responses.
    pub name: &'static str,
    /// Integer (`INT64`) or float (`FP32`) values.
    pub ints: bool,
    /// Its shape a sample (empty: one value).
    pub sample_shape: Vec<usize>,
}

impl OutputSpec {
    /// One `FP32` value a sample.
    pub fn scalar(name: &'static str) -> Self {
        Self {
            name,
            ints: false,
            sample_shape: Vec::new(),
        }
    }

    /// Values a sample.
    pub fn width(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The protocol's datatype.
    pub fn datatype(&self) -> &'static str {
        match self.ints {
            true => "INT64",
            false => "FP32",
        }
    }

    /// Its shape in responses for `samples`.
    pub fn shape(&self, samples: usize) -> Vec<i64> {
        let rest = self.sample_shape.iter().map(|&d| d as i64);
        std::iter::once(samples as i64).chain(rest).collect()
    }

    /// As the metadata endpoint gives it (the batch dimension `-1`).
    pub fn metadata(&self) -> TensorMetadata {
        let mut shape = self.shape(0);
        shape[0] = -1;
        TensorMetadata {
            name: self.name.into(),
            datatype: self.datatype().into(),
            shape,
        }
    }
}

/// One output's values for some samples, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Column {
    /// `FP32` values.
    Floats(Vec<f32>),
    /// `INT64` values.
    Ints(Vec<i64>),
}

impl Column {
    /// How many values it holds.
    pub fn len(&self) -> usize {
        match self {
            Self::Floats(v) => v.len(),
            Self::Ints(v) => v.len(),
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `from..to`.
    pub fn slice(&self, from: usize, to: usize) -> Self {
        match self {
            Self::Floats(v) => Self::Floats(v[from..to].to_vec()),
            Self::Ints(v) => Self::Ints(v[from..to].to_vec()),
        }
    }

    /// Its little-endian bytes (the binary tensor data extension, gRPC's
    /// raw contents).
    pub fn le_bytes(&self) -> Vec<u8> {
        match self {
            Self::Floats(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Self::Ints(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// As JSON data.
    pub fn data(&self) -> OutputData {
        match self {
            Self::Floats(v) => OutputData::Floats(v.clone()),
            Self::Ints(v) => OutputData::Ints(v.clone()),
        }
    }

    /// The first value that is not finite, and where.
    fn first_not_finite(&self) -> Option<(usize, f32)> {
        match self {
            Self::Floats(v) => v.iter().position(|x| !x.is_finite()).map(|at| (at, v[at])),
            Self::Ints(_) => None,
        }
    }
}

/// A batch's columns checked against `outputs` for `count` samples: one
/// column each, of its type and `count` rows of its width.
pub(crate) fn check_columns(
    columns: &[Column],
    outputs: &[OutputSpec],
    count: usize,
) -> Result<(), ServeError> {
    if columns.len() != outputs.len() {
        return Err(ServeError::Internal(format!(
            "the model gave {} outputs, not {}",
            columns.len(),
            outputs.len()
        )));
    }
    for (c, o) in columns.iter().zip(outputs) {
        if matches!(c, Column::Ints(_)) != o.ints || c.len() != count * o.width() {
            return Err(ServeError::Internal(format!(
                "the model gave {} values of output '{}' for {count} samples of {}",
                c.len(),
                o.name,
                o.width()
            )));
        }
    }
    Ok(())
}

/// Samples `from..to` of a batch's checked columns; a 500 naming the
/// first sample (of these) whose value is not finite.
pub(crate) fn request_columns(
    columns: &[Column],
    outputs: &[OutputSpec],
    (from, to): (usize, usize),
) -> Result<Vec<Column>, ServeError> {
    let mut mine = Vec::with_capacity(columns.len());
    for (c, o) in columns.iter().zip(outputs) {
        let w = o.width();
        let part = c.slice(from * w, to * w);
        if let Some((at, x)) = part.first_not_finite() {
            return Err(ServeError::Internal(format!(
                "output '{}' of sample {} is {x}: the model's output is not finite",
                o.name,
                at / w.max(1)
            )));
        }
        mine.push(part);
    }
    Ok(mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_split_by_samples_of_their_width() {
        let outputs = [
            OutputSpec {
                name: "items",
                ints: true,
                sample_shape: vec![2],
            },
            OutputSpec::scalar("logit"),
        ];
        let columns = [
            Column::Ints(vec![1, 2, 3, 4, 5, 6]),
            Column::Floats(vec![0.5, 1.5, 2.5]),
        ];
        check_columns(&columns, &outputs, 3).unwrap();
        assert!(check_columns(&columns, &outputs, 2).is_err());
        assert!(check_columns(&columns[..1], &outputs, 3).is_err());
        let mine = request_columns(&columns, &outputs, (1, 3)).unwrap();
        assert_eq!(
            mine,
            vec![
                Column::Ints(vec![3, 4, 5, 6]),
                Column::Floats(vec![1.5, 2.5])
            ]
        );
        assert_eq!(outputs[0].shape(2), vec![2, 2]);
        assert_eq!(outputs[0].metadata().shape, vec![-1, 2]);

        let bad = [
            Column::Ints(vec![0; 6]),
            Column::Floats(vec![0.0, f32::NAN, 0.0]),
        ];
        let err = request_columns(&bad, &outputs, (1, 3)).unwrap_err();
        assert!(
            err.to_string().contains("'logit' of sample 0 is NaN"),
            "{err}"
        );
    }
}
