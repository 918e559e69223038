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

use crate::spec::DatasetSpec;
use crate::writer::{ParquetSink, PART_OF_KEY};
use crate::DataError;

/// One opened Parquet file.
pub struct ParquetFile {
    /// The file's path, as given or as found in its directory.
    pub path: PathBuf,
    metadata: ArrowReaderMetadata,
}

/// The part of a marker file the loader reads: the set's parts.
#[derive(serde::Deserialize)]
struct Marker {
    files: Vec<PathBuf>,
}

impl ParquetFile {
    /// Opens `path` and parses its footer, checking that the row groups' row
    /// counts add up to the file's.
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let file = File::open(path).map_err(DataError::io(path))?;
        let metadata = ArrowReaderMetadata::load(&file, ArrowReaderOptions::new())
            .map_err(DataError::parquet(path))?;
        let metadata = plain_columns(metadata).map_err(DataError::parquet(path))?;
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

    /// The set this file is a part of, when a [`ParquetSink`] wrote it.
    pub fn part_of(&self) -> Option<&str> {
        let kv = self
            .metadata
            .metadata()
            .file_metadata()
            .key_value_metadata()?;
        (kv.iter().find(|kv| kv.key == PART_OF_KEY)).and_then(|kv| kv.value.as_deref())
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

/// How a set that is not whole is repaired.
const REPAIR: &str = "rerun the ingest that wrote it (`ember ingest criteo --resume` repairs it, `ember ingest synthetic` writes the set anew), or remove the part";

/// Refuses a part of a set (an ingest's input) whose completion marker is
/// missing or does not list it: the set may be partial (a killed ingest),
/// or the part left from an earlier run.
fn check_sets_complete(files: &[ParquetFile]) -> Result<(), DataError> {
    let mut markers: std::collections::HashMap<PathBuf, Option<Marker>> = Default::default();
    for f in files {
        let Some(prefix) = f.part_of() else { continue };
        let dir = f.path.parent().unwrap_or(Path::new("."));
        let marker = ParquetSink::marker_path(dir, prefix);
        if !markers.contains_key(&marker) {
            // Parts that name their set were written with `_` markers (the
            // earlier, unprefixed ones came with untagged parts).
            let read = match marker.is_file() {
                false => None,
                true => {
                    let text = std::fs::read(&marker).map_err(DataError::io(&marker))?;
                    let parsed = serde_json::from_slice(&text).map_err(|e| DataError::Spec {
                        path: marker.clone(),
                        message: format!("not a completion marker: {e}"),
                    })?;
                    Some(parsed)
                }
            };
            markers.insert(marker.clone(), read);
        }
        let name = f.path.file_name();
        let repair = REPAIR;
        match &markers[&marker] {
            None => {
                return Err(DataError::Config(format!(
                    "{}: a part of '{prefix}', whose ingest never finished (no {}), so its \
                     data may be partial: {repair}",
                    f.path.display(),
                    marker.display()
                )))
            }
            Some(m) if !m.files.iter().any(|p| p.file_name() == name) => {
                return Err(DataError::Config(format!(
                    "{}: not among the parts {} lists (left by an earlier run?): {repair}",
                    f.path.display(),
                    marker.display()
                )))
            }
            Some(_) => {}
        }
    }
    // A marker's parts must all be there: a set missing some (a rewrite
    // killed while it removed the old parts) is not whole.
    for (marker, read) in &markers {
        let Some(m) = read else { continue };
        let dir = marker.parent().unwrap_or(Path::new("."));
        let missing = (m.files.iter())
            .filter_map(|p| p.file_name())
            .find(|name| !dir.join(name).is_file());
        if let Some(name) = missing {
            return Err(DataError::Config(format!(
                "{}: lists the part {}, which is missing, so the set is not whole: {REPAIR}",
                marker.display(),
                dir.join(name).display()
            )));
        }
    }
    Ok(())
}

/// The reader's view of a file with its dictionary-typed columns (pandas'
/// categoricals, pyarrow's `dictionary<int32, int64>`) read as their value
/// type: the dictionary is a storage detail, the loader wants the values.
fn plain_columns(metadata: ArrowReaderMetadata) -> parquet::errors::Result<ArrowReaderMetadata> {
    let schema = metadata.schema();
    let plain = |t: &DataType| match t {
        DataType::Dictionary(_, value) => Some(value.as_ref().clone()),
        _ => None,
    };
    if !schema
        .fields()
        .iter()
        .any(|f| plain(f.data_type()).is_some())
    {
        return Ok(metadata);
    }
    let fields: Vec<arrow_schema::Field> = (schema.fields().iter())
        .map(|f| match plain(f.data_type()) {
            Some(t) => f.as_ref().clone().with_data_type(t),
            None => f.as_ref().clone(),
        })
        .collect();
    let schema = arrow_schema::Schema::new_with_metadata(fields, schema.metadata().clone());
    let options = ArrowReaderOptions::new().with_schema(std::sync::Arc::new(schema));
    ArrowReaderMetadata::try_new(metadata.metadata().clone(), options)
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
        let mut seen = std::collections::HashMap::new();
        for p in &paths {
            let real = std::fs::canonicalize(p).map_err(DataError::io(p))?;
            if let Some(first) = seen.insert(real, p) {
                return Err(DataError::Config(format!(
                    "{}: given twice (also as {}); each file is read once",
                    p.display(),
                    first.display()
                )));
            }
        }
        let files: Vec<ParquetFile> = paths
            .iter()
            .map(|p| ParquetFile::open(p))
            .collect::<Result<_, _>>()?;
        check_sets_complete(&files)?;
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

/// Which columns to decode and how: a checked [`DatasetSpec`].
#[derive(Clone, Debug)]
pub struct DecodeSpec {
    spec: DatasetSpec,
    /// The rows of each sparse column's table, in column order.
    rows: Vec<u64>,
    /// Whether the label column is read (else every label is NaN).
    labels: bool,
}

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
const LABEL_TYPES: &str = "Int8, Int16, Int32, Int64, Boolean, Float32 or Float64 (0 or 1)";
const DENSE_TYPES: &str = "Int32, Int64, Float32 or Float64";
const ID_TYPES: &str = "Int64 or List(Int64)";

fn is_label_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(
        t,
        Int8 | Int16 | Int32 | Int64 | Boolean | Float32 | Float64
    )
}

fn is_dense_type(t: &DataType) -> bool {
    use DataType::*;
    matches!(t, Int32 | Int64 | Float32 | Float64)
}

fn is_id_column(t: &DataType) -> bool {
    match t {
        DataType::Int64 => true,
        DataType::List(item) => *item.data_type() == DataType::Int64,
        _ => false,
    }
}

fn is_float(t: &DataType) -> bool {
    matches!(t, DataType::Float32 | DataType::Float64)
}

/// The weights a column of ids of type `ids` takes: floats of its shape.
fn weights_fit(ids: &DataType, weights: &DataType) -> bool {
    match (ids, weights) {
        (DataType::List(_), DataType::List(w)) => is_float(w.data_type()),
        (DataType::Int64, w) => is_float(w),
        _ => false,
    }
}

/// Every value of a numeric column as f32 (`None`: null).
fn numeric_f32(col: &dyn Array) -> Option<Vec<Option<f32>>> {
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

impl DecodeSpec {
    /// A checked `spec`.
    pub fn new(spec: DatasetSpec) -> Result<Self, DataError> {
        spec.validate()?;
        let rows = (spec.sparse.iter())
            .map(|c| {
                spec.rows_of(c.key())
                    .expect("validated: every feature has a table")
            })
            .collect();
        Ok(Self {
            spec,
            rows,
            labels: true,
        })
    }

    /// The same spec, reading the label column or not (`false`: the data
    /// may have none, and every label is NaN: for prediction).
    pub fn with_labels(self, labels: bool) -> Self {
        Self { labels, ..self }
    }

    /// The spec it decodes.
    pub fn spec(&self) -> &DatasetSpec {
        &self.spec
    }

    /// Checks that every file has every column, with a type its role takes.
    pub fn check(&self, dataset: &Dataset) -> Result<(), DataError> {
        let s = &self.spec;
        for f in dataset.files() {
            let expect = |column: &str, ok: &dyn Fn(&DataType) -> bool, want: &str| {
                let t = f.column_type(column)?;
                if ok(t) {
                    Ok(t)
                } else {
                    Err(DataError::column(
                        &f.path,
                        column,
                        format!("has type {t}, expected {want}"),
                    ))
                }
            };
            if self.labels {
                if f.column_type(&s.label).is_err() {
                    return Err(DataError::column(
                        &f.path,
                        &s.label,
                        "missing from the file: the label column is needed to train or evaluate (`ember predict` reads data without labels)".into(),
                    ));
                }
                expect(&s.label, &is_label_type, LABEL_TYPES)?;
            }
            for c in &s.dense {
                expect(&c.column, &is_dense_type, DENSE_TYPES)?;
            }
            for c in &s.sparse {
                let ids = expect(&c.column, &is_id_column, ID_TYPES)?;
                if let Some(w) = &c.weights {
                    let want = match ids {
                        DataType::Int64 => "Float32 or Float64, as its ids are one per row",
                        _ => "List(Float32) or List(Float64), of its ids' lengths",
                    };
                    expect(w, &|t| weights_fit(ids, t), want)?;
                }
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
        let s = &self.spec;
        let label = Some(&s.label).filter(|_| self.labels);
        let roots = (label.into_iter())
            .chain(s.dense.iter().map(|c| &c.column))
            .chain(s.sparse.iter().map(|c| &c.column))
            .chain(s.sparse.iter().filter_map(|c| c.weights.as_ref()))
            .filter_map(|c| schema.index_of(c).ok());
        let mask = ProjectionMask::roots(f.metadata.parquet_schema(), roots);
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, f.metadata.clone())
            .with_row_groups(vec![unit.row_group])
            .with_projection(mask)
            .with_batch_size(unit.rows.max(1))
            .build()
            .map_err(at)?;
        let mut chunk = Chunk {
            features: vec![FeatureChunk::default(); s.sparse.len()],
            ..Chunk::default()
        };
        for feature in &mut chunk.features {
            feature.offsets.push(0);
        }
        for batch in reader {
            let batch = batch.map_err(|e| at(parquet::errors::ParquetError::from(e)))?;
            self.append(&f.path, &batch, chunk.rows, &mut chunk)?;
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

    /// Appends `batch`, whose first row is row `first` of the row group.
    fn append(
        &self,
        path: &Path,
        batch: &RecordBatch,
        first: usize,
        chunk: &mut Chunk,
    ) -> Result<(), DataError> {
        let s = &self.spec;
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| DataError::column(path, name, "missing from the file".into()))
        };
        let wrong = |name: &str, col: &dyn Array, want: &str| {
            DataError::column(
                path,
                name,
                format!("has type {}, expected {want}", col.data_type()),
            )
        };
        let n = batch.num_rows();
        let labels = match self.labels {
            true => Some(column(&s.label)?),
            false => None,
        };
        if labels.is_none() {
            chunk.labels.resize(chunk.labels.len() + n, f32::NAN);
        } else if let Some(l) = (labels.and_then(|l| l.as_primitive_opt::<Int8Type>()))
            // Criteo's int8 label, the common case, without the generic path.
            .filter(|l| l.null_count() == 0)
        {
            if let Some(r) = l.values().iter().position(|&y| y != 0 && y != 1) {
                return Err(DataError::column(
                    path,
                    &s.label,
                    format!(
                        "row {} of the row group has label {}, not 0 or 1",
                        first + r,
                        l.value(r)
                    ),
                ));
            }
            chunk.labels.extend(l.values().iter().map(|&y| y as f32));
        } else if let Some(labels) = labels {
            let values =
                numeric_f32(labels.as_ref()).ok_or_else(|| wrong(&s.label, labels, LABEL_TYPES))?;
            for (r, y) in values.into_iter().enumerate() {
                match y {
                    Some(y) if y == 0.0 || y == 1.0 => chunk.labels.push(y),
                    Some(y) => {
                        return Err(DataError::column(
                            path,
                            &s.label,
                            format!(
                                "row {} of the row group has label {y}, not 0 or 1",
                                first + r
                            ),
                        ))
                    }
                    None => {
                        return Err(DataError::column(
                            path,
                            &s.label,
                            format!("row {} of the row group has no label", first + r),
                        ))
                    }
                }
            }
        }

        let nd = s.dense.len();
        let base = chunk.dense.len();
        chunk.dense.resize(base + n * nd, 0.0);
        for (j, c) in s.dense.iter().enumerate() {
            let col = column(&c.column)?;
            let transform = s.transform_of(j);
            let out = &mut chunk.dense[base..];
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
                        .ok_or_else(|| wrong(&c.column, col, DENSE_TYPES))?;
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

        for ((c, &rows), out) in s.sparse.iter().zip(&self.rows).zip(&mut chunk.features) {
            let name = &c.column;
            let col = column(name)?;
            let weights = match &c.weights {
                Some(w) => Some((w, column(w)?)),
                None => None,
            };
            let t = s.id_transform;
            out.offsets.reserve(n);
            let mut last = *out.offsets.last().unwrap_or(&0);
            if let Some(ids) = col.as_primitive_opt::<Int64Type>() {
                let w = match &weights {
                    Some((wname, w)) => Some(
                        numeric_f32(w.as_ref())
                            .filter(|_| is_float(w.data_type()))
                            .ok_or_else(|| wrong(wname, w, "Float32 or Float64"))?,
                    ),
                    None => None,
                };
                out.values.reserve(n);
                if ids.null_count() == 0 && w.is_none() {
                    // One id a row, the common case, without the null checks.
                    out.values
                        .extend(ids.values().iter().map(|&id| t.apply(id, rows)));
                    out.offsets.extend((1..=n as u32).map(|k| last + k));
                    continue;
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
                        DataError::column(
                            path,
                            name,
                            "is a list of something other than Int64".into(),
                        )
                    })?;
                let w = match &weights {
                    Some((wname, w)) => {
                        let lw = w
                            .as_list_opt::<i32>()
                            .ok_or_else(|| wrong(wname, w, "List(Float32) or List(Float64)"))?;
                        let values = numeric_f32(lw.values().as_ref())
                            .filter(|_| is_float(lw.values().data_type()))
                            .ok_or_else(|| wrong(wname, w, "List(Float32) or List(Float64)"))?;
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
                return Err(wrong(name, col, ID_TYPES));
            }
        }
        chunk.rows += n;
        Ok(())
    }
}

/// A weight read from the data: present and finite, or an error naming the row.
fn weight(path: &Path, column: &str, w: Option<f32>, row: usize) -> Result<f32, DataError> {
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
