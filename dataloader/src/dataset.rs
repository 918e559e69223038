//! A set of Parquet files opened once (footers parsed and kept), their row
//! groups as units of work, and the decoding of one row group into
//! transformed, columnar rows.

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};
use parquet::arrow::ProjectionMask;

use crate::decode::{
    append_dense, append_ids, append_labels, column, is_dense_type, is_id_column, is_label_type,
    weights_fit, DENSE_TYPES, ID_TYPES, LABEL_TYPES,
};
pub use crate::decode::{Chunk, FeatureChunk};
use crate::spec::DatasetSpec;
use crate::transform::IdTransform;
use crate::vocabulary::{VocabularyInfo, VocabularyStamp, VOCABULARY_FILE};
use crate::writer::{ParquetSink, PART_OF_KEY};
use crate::DataError;

/// One opened Parquet file.
pub struct ParquetFile {
    /// The file's path, as given or as found in its directory.
    pub path: PathBuf,
    metadata: ArrowReaderMetadata,
}

/// The part of a marker file the loader reads: the set's parts, and the
/// vocabulary their ids were numbered by.
#[derive(serde::Deserialize)]
struct Marker {
    files: Vec<PathBuf>,
    #[serde(default)]
    vocabulary: Option<VocabularyStamp>,
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

/// Refuses a part of a set (an ingest's input) whose completion marker is
/// missing or does not list it: the set may be partial (a killed ingest),
/// or the part left from an earlier run.
/// Returns the vocabularies the parts were numbered by, each once.
fn check_sets_complete(files: &[ParquetFile]) -> Result<Vec<VocabularyStamp>, DataError> {
    let mut markers: std::collections::HashMap<PathBuf, Option<Marker>> = Default::default();
    // Each directory's vocabulary, whose numbering its parts must share.
    let mut vocabularies: std::collections::HashMap<PathBuf, Option<VocabularyStamp>> =
        Default::default();
    let mut stamps = Vec::new();
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
        match &markers[&marker] {
            None => {
                return Err(DataError::PartialSet {
                    path: f.path.clone(),
                    why: format!(
                        "a part of '{prefix}', whose ingest never finished (no {}), so its \
                         data may be partial",
                        marker.display()
                    ),
                })
            }
            Some(m) if !m.files.iter().any(|p| p.file_name() == name) => {
                return Err(DataError::PartialSet {
                    path: f.path.clone(),
                    why: format!(
                        "not among the parts {} lists (left by an earlier run?)",
                        marker.display()
                    ),
                })
            }
            Some(m) => {
                let table_sizes = match vocabularies.get(dir) {
                    Some(v) => *v,
                    None => {
                        let v = VocabularyInfo::beside(dir)?.map(|v| v.stamp);
                        *vocabularies.entry(dir.to_path_buf()).or_insert(v)
                    }
                };
                if let (Some(v), None) = (m.vocabulary, &table_sizes) {
                    return Err(DataError::Vocabulary(format!(
                        "{}: its ids were numbered by {}, but {} has no {VOCABULARY_FILE}: \
                         its vocabulary ingest did not finish (run it again with --resume)",
                        f.path.display(),
                        numbering(Some(v)),
                        dir.display()
                    )));
                }
                if m.vocabulary != table_sizes {
                    return Err(DataError::Vocabulary(format!(
                        "{}: its ids were numbered by {}, but {} says {}: ingest its \
                         directory again (every day in one call)",
                        f.path.display(),
                        numbering(m.vocabulary),
                        dir.join(VOCABULARY_FILE).display(),
                        numbering(table_sizes)
                    )));
                }
                if let Some(v) = m.vocabulary.filter(|v| !stamps.contains(v)) {
                    stamps.push(v);
                }
            }
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
            return Err(DataError::PartialSet {
                path: marker.clone(),
                why: format!(
                    "lists the part {}, which is missing, so the set is not whole",
                    dir.join(name).display()
                ),
            });
        }
    }
    Ok(stamps)
}

/// A numbering, as an error names it.
fn numbering(v: Option<VocabularyStamp>) -> String {
    match v {
        Some(v) => format!(
            "a vocabulary of threshold {} (fingerprint {:016x})",
            v.frequency_threshold, v.fingerprint
        ),
        None => "no vocabulary (raw ids)".into(),
    }
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
    /// The vocabularies the files' ids were numbered by, each once, in the
    /// files' order (none: raw ids).
    vocabularies: Vec<VocabularyStamp>,
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
                    let path = Some(input.to_path_buf());
                    return Err(DataError::NoInput { path });
                }
                found.sort();
                paths.extend(found);
            } else {
                paths.push(input.clone());
            }
        }
        if paths.is_empty() {
            return Err(DataError::NoInput { path: None });
        }
        let mut seen = std::collections::HashMap::new();
        for p in &paths {
            let real = std::fs::canonicalize(p).map_err(DataError::io(p))?;
            if let Some(first) = seen.insert(real, p) {
                return Err(DataError::GivenTwice {
                    path: p.clone(),
                    first: first.clone(),
                });
            }
        }
        let files: Vec<ParquetFile> = paths
            .iter()
            .map(|p| ParquetFile::open(p))
            .collect::<Result<_, _>>()?;
        let vocabularies = check_sets_complete(&files)?;
        Ok(Self {
            files,
            vocabularies,
        })
    }

    /// The files, in the order they are read.
    pub fn files(&self) -> &[ParquetFile] {
        &self.files
    }

    /// Rows in all files (from the footers).
    pub fn num_rows(&self) -> u64 {
        self.files.iter().map(|f| f.num_rows()).sum()
    }

    /// A hash of the file names (not their directory), every row group's
    /// row count and the vocabularies the ids were numbered by: what a
    /// resumed run checks to be reading the same data.
    pub fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        };
        // Re-ingested with another vocabulary, the same files hold other ids.
        for v in &self.vocabularies {
            eat(&v.fingerprint.to_le_bytes());
        }
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
    /// The rows of each sparse column's table, and how its ids reach
    /// them, in column order.
    rows: Vec<(u64, IdTransform)>,
    /// Whether the label column is read (else every label is NaN).
    labels: bool,
}

impl DecodeSpec {
    /// A checked `spec`.
    pub fn new(spec: DatasetSpec) -> Result<Self, DataError> {
        spec.validate()?;
        let rows = (spec.sparse.iter())
            .map(|c| {
                let rows = (spec.rows_of(c.key())).expect("validated: every feature has a table");
                (rows, spec.id_transform_of(c.key()))
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
        let labels = match self.labels {
            true => Some(column(path, batch, &s.label)?),
            false => None,
        };
        let rows = (first, batch.num_rows());
        append_labels(path, (&s.label, labels), rows, &mut chunk.labels)?;
        append_dense(path, batch, s, first, &mut chunk.dense)?;
        let features = s.sparse.iter().zip(&self.rows).zip(&mut chunk.features);
        for ((c, &(table_rows, transform)), out) in features {
            append_ids(path, batch, (c, table_rows, transform), first, out)?;
        }
        chunk.rows += batch.num_rows();
        Ok(())
    }
}
