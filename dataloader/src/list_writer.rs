//! A sequence model's predictions as Parquet: one row a history, each
//! output a fixed-size list column (a retrieval model's `items` (int64)
//! and `scores` (float32), `k` each; a ranking model's `logit` and
//! `probability`, one a candidate and task), committed atomically.

use std::sync::Arc;

use crate::writer::AtomicParquet;
use crate::DataError;
use arrow_array::types::{Float32Type, Int64Type};
use arrow_array::{ArrayRef, FixedSizeListArray, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};

/// One output's values for some rows, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum ListValues<'a> {
    /// int64 values.
    Ints(&'a [i64]),
    /// float32 values.
    Floats(&'a [f32]),
}

/// Streams rows of fixed-size list columns into a Parquet file.
pub struct ListPredictionWriter {
    file: AtomicParquet,
    schema: SchemaRef,
    /// Each column's width.
    widths: Vec<usize>,
}

impl ListPredictionWriter {
    /// Opens `path`'s temporary file for `columns` (name, int64 or not,
    /// values a row); `path` itself appears only at
    /// [`finish`](Self::finish).
    pub fn create(
        path: &std::path::Path,
        columns: &[(&str, bool, usize)],
    ) -> Result<Self, DataError> {
        let fields: Vec<Field> = (columns.iter())
            .map(|&(name, ints, width)| {
                let item = match ints {
                    true => DataType::Int64,
                    false => DataType::Float32,
                };
                let list =
                    DataType::FixedSizeList(Arc::new(Field::new("item", item, true)), width as i32);
                Field::new(name, list, false)
            })
            .collect();
        let schema = Arc::new(Schema::new(fields));
        Ok(Self {
            file: AtomicParquet::create(path, schema.clone())?,
            schema,
            widths: columns.iter().map(|c| c.2).collect(),
        })
    }

    /// Appends `rows` rows: each column's values, `rows` times its width,
    /// of its type.
    pub fn write(&mut self, rows: usize, columns: &[ListValues<'_>]) -> Result<(), DataError> {
        let temp = self.file.temp().to_path_buf();
        let wrong = |column: &str, message: String| DataError::Column {
            path: temp.clone(),
            column: column.into(),
            message,
        };
        if columns.len() != self.widths.len() {
            let names: Vec<&str> = self
                .schema
                .fields()
                .iter()
                .map(|f| f.name().as_str())
                .collect();
            let message = format!("{} columns given", columns.len());
            return Err(wrong(&names.join(", "), message));
        }
        let mut arrays: Vec<ArrayRef> = Vec::with_capacity(columns.len());
        for (c, (values, &w)) in columns.iter().zip(&self.widths).enumerate() {
            let name = self.schema.field(c).name();
            let len = match values {
                ListValues::Ints(v) => v.len(),
                ListValues::Floats(v) => v.len(),
            };
            if len != rows * w {
                return Err(wrong(name, format!("{len} values for {rows} rows of {w}")));
            }
            let array = match values {
                ListValues::Ints(v) => list::<Int64Type, _>(v, w),
                ListValues::Floats(v) => list::<Float32Type, _>(v, w),
            };
            arrays.push(Arc::new(array));
        }
        let batch = RecordBatch::try_new(self.schema.clone(), arrays)
            .map_err(|e| wrong("*", e.to_string()))?;
        self.file.write(&batch)
    }

    /// Closes, fsyncs and renames the file; returns the rows written.
    pub fn finish(self) -> Result<u64, DataError> {
        self.file.finish()
    }
}

/// `values` as a fixed-size list array of `width` (`width` > 0).
fn list<T, V>(values: &[V], width: usize) -> FixedSizeListArray
where
    T: arrow_array::types::ArrowPrimitiveType<Native = V>,
    V: Copy,
{
    let rows = values
        .chunks(width.max(1))
        .map(|row| Some(row.iter().map(|&v| Some(v))));
    FixedSizeListArray::from_iter_primitive::<T, _, _>(rows, width as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_lists_read_back_and_a_wrong_width_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.parquet");
        let mut w =
            ListPredictionWriter::create(&path, &[("items", true, 2), ("scores", false, 2)])
                .unwrap();
        w.write(
            2,
            &[
                ListValues::Ints(&[3, 1, 0, 2]),
                ListValues::Floats(&[0.5, 0.25, 1.0, -1.0]),
            ],
        )
        .unwrap();
        let err = w.write(
            1,
            &[ListValues::Ints(&[3]), ListValues::Floats(&[0.5, 0.25])],
        );
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("column 'items': 1 values for 1 rows of 2"));
        assert!(!path.exists(), "nothing before finish");
        assert_eq!(w.finish().unwrap(), 2);

        let file = std::fs::File::open(&path).unwrap();
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .unwrap()
            .build()
            .unwrap();
        let batch = reader.into_iter().next().unwrap().unwrap();
        let items = batch
            .column(0)
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .unwrap();
        let second = items.value(1);
        let second = second
            .as_any()
            .downcast_ref::<arrow_array::Int64Array>()
            .unwrap();
        assert_eq!(second.values().to_vec(), vec![0, 2]);
    }
}
