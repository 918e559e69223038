//! A set of Parquet files opened once (footers parsed and kept), their row
//! groups as units of work, and the decoding of one row group into
//! transformed, columnar rows.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, Int8Type};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;

use crate::transform::{DenseTransform, IdTransform};
use crate::DataError;

/// One opened Parquet file.
pub struct ParquetFile {
    /// The file's path, as given or as found in its directory.
    pub path: PathBuf,
    metadata: ArrowReaderMetadata,
}

impl ParquetFile {
    /// Opens `path` and parses its footer, checking that the row groups' row
    /// counts add up to the file's.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let file = File::open(path).map_err(DataError::io(path))?;
        let metadata = ArrowReaderMetadata::load(&file, ArrowReaderOptions::new())
            .map_err(DataError::parquet(path))?;
        // Row counts come from the footer: check them before anything sums them.
        let meta = metadata.metadata();
        let mut total: u64 = 0;
        for (i, rg) in meta.row_groups().iter().enumerate() {
            let rows = u64::try_from(rg.num_rows()).map_err(|_| DataError::Parquet {
                path: path.to_path_buf(),
                message: format!("row group {i} claims {} rows", rg.num_rows()),
            })?;
            total = total.saturating_add(rows);
        }
        if i64::try_from(total).ok() != Some(meta.file_metadata().num_rows()) {
            return Err(DataError::Parquet {
                path: path.to_path_buf(),
                message: format!(
                    "the row groups hold {total} rows, the footer says {}",
                    meta.file_metadata().num_rows()
                ),
            });
        }
        Ok(Self {
            path: path.to_path_buf(),
            metadata,
        })
    }

    /// Rows of each row group.
    pub fn row_group_rows(&self) -> impl Iterator<Item = usize> + '_ {
        (self.metadata.metadata().row_groups().iter()).map(|rg| rg.num_rows() as usize)
    }

    /// Rows in the file (from the footer).
    pub fn num_rows(&self) -> u64 {
        self.row_group_rows().map(|r| r as u64).sum()
    }

    /// The column's type, or an error naming the file and column.
    fn column_type(&self, column: &str) -> Result<&DataType, DataError> {
        let schema = self.metadata.schema();
        schema
            .field_with_name(column)
            .map(|f| f.data_type())
            .map_err(|_| DataError::column(&self.path, column, "missing from the file".into()))
    }
}

/// One row group of one file: the unit of shuffling, sharding and decoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Index of the file in [`Dataset::files`].
    pub file: usize,
    /// Index of the row group within the file.
    pub row_group: usize,
    /// Rows in the row group (from the footer).
    pub rows: usize,
}

/// Parquet files read in a fixed order.
pub struct Dataset {
    files: Vec<ParquetFile>,
}

impl Dataset {
    /// Opens files and directories; a directory contributes its `*.parquet`
    /// files in name order (temporary files of an unfinished write are not
    /// `*.parquet`, so they are never read).
    pub fn open(inputs: &[PathBuf]) -> Result<Self, DataError> {
        let mut paths = Vec::new();
        for input in inputs {
            if input.is_dir() {
                let mut found = Vec::new();
                for entry in std::fs::read_dir(input).map_err(DataError::io(input))? {
                    let path = entry.map_err(DataError::io(input))?.path();
                    if path.extension().is_some_and(|e| e == "parquet") && path.is_file() {
                        found.push(path);
                    }
                }
                if found.is_empty() {
                    return Err(DataError::Config(format!(
                        "{}: no .parquet files in this directory",
                        input.display()
                    )));
                }
                found.sort();
                paths.extend(found);
            } else {
                paths.push(input.clone());
            }
        }
        if paths.is_empty() {
            return Err(DataError::Config("no input files".into()));
        }
        let files = paths
            .iter()
            .map(|p| ParquetFile::open(p))
            .collect::<Result<_, _>>()?;
        Ok(Self { files })
    }

    /// The files, in the order they are read.
    pub fn files(&self) -> &[ParquetFile] {
        &self.files
    }

    /// Rows in all files (from the footers).
    pub fn num_rows(&self) -> u64 {
        self.files.iter().map(|f| f.num_rows()).sum()
    }

    /// A hash of the file names (not their directory) and every row group's
    /// row count: what a resumed run checks to be reading the same data.
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        for f in &self.files {
            eat(f.path.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
            for rows in f.row_group_rows() {
                eat(&(rows as u64).to_le_bytes());
            }
            eat(b"/");
        }
        h
    }

    /// Every row group, in file order.
    pub fn units(&self) -> Vec<Unit> {
        (self.files.iter().enumerate())
            .flat_map(|(file, f)| {
                f.row_group_rows()
                    .enumerate()
                    .map(move |(row_group, rows)| Unit {
                        file,
                        row_group,
                        rows,
                    })
            })
            .collect()
    }
}

/// Which columns to decode and how.
#[derive(Clone, Debug)]
pub struct DecodeSpec {
    /// The label column (int8, 0 or 1).
    pub label: String,
    /// The integer columns (int32) read as dense features, in this order.
    pub dense: Vec<String>,
    /// Categorical columns with the row count their ids are reduced to.
    pub sparse: Vec<(String, u64)>,
    /// Applied to every dense value.
    pub dense_transform: DenseTransform,
    /// Reduces each raw id to a row of its table.
    pub id_transform: IdTransform,
}

/// The ids of one categorical column over a chunk's rows.
#[derive(Clone, Debug, Default)]
pub struct FeatureChunk {
    /// `rows + 1` offsets into `values`.
    pub offsets: Vec<u32>,
    /// The transformed ids of every row, row after row; missing values add none.
    pub values: Vec<i64>,
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
    /// One per [`DecodeSpec::sparse`] column, in that order.
    pub features: Vec<FeatureChunk>,
}

impl DecodeSpec {
    /// Checks that every file has every column, with the right type.
    pub fn check(&self, dataset: &Dataset) -> Result<(), DataError> {
        for f in dataset.files() {
            let expect = |column: &str, ok: &dyn Fn(&DataType) -> bool, want: &str| {
                let t = f.column_type(column)?;
                if ok(t) {
                    Ok(())
                } else {
                    Err(DataError::column(
                        &f.path,
                        column,
                        format!("has type {t}, expected {want}"),
                    ))
                }
            };
            expect(&self.label, &|t| *t == DataType::Int8, "Int8")?;
            for c in &self.dense {
                expect(c, &|t| *t == DataType::Int32, "Int32")?;
            }
            for (c, _) in &self.sparse {
                expect(c, &is_id_column, "Int64 or List(Int64)")?;
            }
        }
        Ok(())
    }

    /// Reads and transforms one row group.
    pub fn decode(&self, dataset: &Dataset, unit: Unit) -> Result<Chunk, DataError> {
        let f = &dataset.files[unit.file];
        let at = |e| DataError::Parquet {
            path: f.path.clone(),
            message: format!("row group {}: {e}", unit.row_group),
        };
        let file = File::open(&f.path).map_err(DataError::io(&f.path))?;
        let schema = f.metadata.schema();
        let roots = std::iter::once(&self.label)
            .chain(&self.dense)
            .chain(self.sparse.iter().map(|(c, _)| c))
            .filter_map(|c| schema.index_of(c).ok());
        let mask = ProjectionMask::roots(f.metadata.parquet_schema(), roots);
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, f.metadata.clone())
            .with_row_groups(vec![unit.row_group])
            .with_projection(mask)
            .with_batch_size(unit.rows.max(1))
            .build()
            .map_err(at)?;
        let mut chunk = Chunk {
            features: vec![FeatureChunk::default(); self.sparse.len()],
            ..Chunk::default()
        };
        for feature in &mut chunk.features {
            feature.offsets.push(0);
        }
        for batch in reader {
            let batch = batch.map_err(|e| at(parquet::errors::ParquetError::from(e)))?;
            self.append(&f.path, &batch, &mut chunk)?;
        }
        if chunk.rows != unit.rows {
            return Err(DataError::Parquet {
                path: f.path.clone(),
                message: format!(
                    "row group {} has {} rows, its footer says {}",
                    unit.row_group, chunk.rows, unit.rows
                ),
            });
        }
        Ok(chunk)
    }

    fn append(&self, path: &Path, batch: &RecordBatch, chunk: &mut Chunk) -> Result<(), DataError> {
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| DataError::column(path, name, "missing from the file".into()))
        };
        let n = batch.num_rows();
        let labels = column(&self.label)?;
        let labels = labels
            .as_primitive_opt::<Int8Type>()
            .ok_or_else(|| DataError::column(path, &self.label, "is not Int8".into()))?;
        if labels.null_count() > 0 {
            let row = (0..n).find(|&r| labels.is_null(r)).unwrap_or(0);
            return Err(DataError::column(
                path,
                &self.label,
                format!("row {} of the row group has no label", row),
            ));
        }
        if let Some(r) = labels.values().iter().position(|&y| y != 0 && y != 1) {
            return Err(DataError::column(
                path,
                &self.label,
                format!(
                    "row {r} of the row group has label {}, not 0 or 1",
                    labels.value(r)
                ),
            ));
        }
        chunk
            .labels
            .extend(labels.values().iter().map(|&y| y as f32));

        let nd = self.dense.len();
        let base = chunk.dense.len();
        chunk.dense.resize(base + n * nd, 0.0);
        for (j, name) in self.dense.iter().enumerate() {
            let col = column(name)?;
            let col = col
                .as_primitive_opt::<Int32Type>()
                .ok_or_else(|| DataError::column(path, name, "is not Int32".into()))?;
            let out = &mut chunk.dense[base..];
            if col.null_count() == 0 {
                for (r, &x) in col.values().iter().enumerate() {
                    out[r * nd + j] = self.dense_transform.apply(Some(x));
                }
            } else {
                for (r, x) in col.iter().enumerate() {
                    out[r * nd + j] = self.dense_transform.apply(x);
                }
            }
        }

        for ((name, rows), out) in self.sparse.iter().zip(&mut chunk.features) {
            let col = column(name)?;
            let t = self.id_transform;
            let mut last = *out.offsets.last().unwrap_or(&0);
            if let Some(ids) = col.as_primitive_opt::<Int64Type>() {
                for id in ids.iter() {
                    if let Some(id) = id {
                        out.values.push(t.apply(id, *rows));
                        last += 1;
                    }
                    out.offsets.push(last);
                }
            } else if let Some(lists) = col.as_list_opt::<i32>() {
                let ids = lists
                    .values()
                    .as_primitive_opt::<Int64Type>()
                    .ok_or_else(|| {
                        DataError::column(
                            path,
                            name,
                            "is a list of something other than Int64".into(),
                        )
                    })?;
                let offsets = lists.value_offsets();
                for r in 0..n {
                    if lists.is_valid(r) {
                        for k in offsets[r] as usize..offsets[r + 1] as usize {
                            if ids.is_valid(k) {
                                out.values.push(t.apply(ids.value(k), *rows));
                                last += 1;
                            }
                        }
                    }
                    out.offsets.push(last);
                }
            } else {
                return Err(DataError::column(
                    path,
                    name,
                    format!(
                        "has type {}, expected Int64 or List(Int64)",
                        col.data_type()
                    ),
                ));
            }
        }
        chunk.rows += n;
        Ok(())
    }
}

fn is_id_column(t: &DataType) -> bool {
    match t {
        DataType::Int64 => true,
        DataType::List(item) => *item.data_type() == DataType::Int64,
        _ => false,
    }
}
