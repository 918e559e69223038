//! Writing Criteo-schema Parquet: a builder of record batches, and a sink
//! that splits rows into files and row groups and never leaves a partial
//! file under a final name.
//!
//! Every file goes through [`AtomicFile`], so `*.parquet` files are always
//! complete; the loader reads only `*.parquet` names. Each part of a sink
//! names its set in the footer ([`PART_OF_KEY`]), so the loader can tell
//! the parts of an ingest whose completion marker was never written.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Int32Builder, Int64Builder, Int8Builder, ListBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};

/// Moved to [`crate::atomic`]; kept here for callers of earlier versions.
pub use crate::atomic::write_atomic;
use crate::atomic::AtomicFile;
use crate::criteo::CriteoRecord;
use crate::schema::{cat_column, criteo_schema, NUM_CAT, NUM_INT};
use crate::DataError;

/// Parquet page compression.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// Zstandard at its default level (the default).
    #[default]
    Zstd,
    /// Snappy: faster to read and write, larger files.
    Snappy,
    /// Uncompressed.
    None,
}

impl Codec {
    pub(crate) fn compression(self) -> Compression {
        match self {
            Codec::Zstd => Compression::ZSTD(ZstdLevel::default()),
            Codec::Snappy => Compression::SNAPPY,
            Codec::None => Compression::UNCOMPRESSED,
        }
    }
}

/// How rows are laid out in files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkOptions {
    /// Rows per output file (`None`: one file per input).
    pub rows_per_file: Option<u64>,
    /// Rows per Parquet row group, the loader's unit of shuffling and sharding.
    pub row_group_size: usize,
    /// Page compression of every column.
    pub compression: Codec,
}

impl Default for SinkOptions {
    fn default() -> Self {
        Self {
            rows_per_file: None,
            row_group_size: 1 << 16,
            compression: Codec::Zstd,
        }
    }
}

impl std::str::FromStr for Codec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "zstd" => Ok(Codec::Zstd),
            "snappy" => Ok(Codec::Snappy),
            "none" => Ok(Codec::None),
            _ => Err(format!("'{s}' is not one of: zstd, snappy, none")),
        }
    }
}

enum CatBuilder {
    Scalar(Int64Builder),
    List(ListBuilder<Int64Builder>),
}

/// Accumulates rows of the Criteo schema column by column.
pub struct CriteoBatchBuilder {
    schema: SchemaRef,
    label: Int8Builder,
    ints: Vec<Int32Builder>,
    cats: Vec<CatBuilder>,
    rows: usize,
}

impl CriteoBatchBuilder {
    /// `multi_hot[i]`: `cat_i` is a `list<int64>` column.
    pub fn new(multi_hot: &[bool; NUM_CAT]) -> Self {
        let schema = criteo_schema(multi_hot);
        let cats = multi_hot
            .iter()
            .map(|&m| match m {
                true => {
                    CatBuilder::List(ListBuilder::new(Int64Builder::new()).with_field(Arc::new(
                        arrow_schema::Field::new("item", arrow_schema::DataType::Int64, true),
                    )))
                }
                false => CatBuilder::Scalar(Int64Builder::new()),
            })
            .collect();
        Self {
            schema,
            label: Int8Builder::new(),
            ints: (0..NUM_INT).map(|_| Int32Builder::new()).collect(),
            cats,
            rows: 0,
        }
    }

    /// The Arrow schema of the batches it builds (see [`criteo_schema`]).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Rows appended since the last [`finish`](Self::finish).
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether no rows were appended since the last [`finish`](Self::finish).
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Appends a parsed Criteo line (every categorical column must be scalar).
    pub fn push_record(&mut self, r: &CriteoRecord) {
        self.push_row(r.label, &r.ints, |i| {
            r.cats[i].map(Bag::One).unwrap_or(Bag::Missing)
        });
    }

    /// Appends `batch` as raw rows (13 dense, 26 sparse features),
    /// inverting the loader's default transforms: a dense value `u` is
    /// written as `round(exp(8u) - 1)` (so `ln(1 + x)` gives back about
    /// `8u`), ids as they are (the loader's `id mod rows` leaves ids below
    /// the table's rows unchanged). Synthetic data made into files.
    pub fn push_batch(&mut self, batch: &crate::Batch) -> Result<(), DataError> {
        let (dense, sparse) = (&batch.dense, &batch.sparse);
        if dense.cols() != NUM_INT || sparse.keys().len() != NUM_CAT {
            return Err(DataError::NotCriteo(format!(
                "it needs {NUM_INT} dense and {NUM_CAT} sparse features, not {} and {}",
                dense.cols(),
                sparse.keys().len()
            )));
        }
        if let Some((k, key)) =
            (sparse.keys().iter().enumerate()).find(|(k, key)| **key != cat_column(*k))
        {
            return Err(DataError::NotCriteo(format!(
                "its sparse feature {k} is {}, not {key}",
                cat_column(k)
            )));
        }
        if sparse.weights().is_some() {
            return Err(DataError::NotCriteo(
                "it has no per-id weights; the batch has".into(),
            ));
        }
        if let Some(r) = batch.labels.iter().position(|&y| y != 0.0 && y != 1.0) {
            return Err(DataError::NotCriteo(format!(
                "row {r} has label {}: its labels are 0 or 1",
                batch.labels[r]
            )));
        }
        let (offsets, values, n) = (sparse.offsets(), sparse.values(), batch.size());
        for s in 0..n {
            let mut ints = [None; NUM_INT];
            for (x, &u) in ints.iter_mut().zip(dense.row(s)) {
                *x = Some((8.0 * u as f64).exp_m1().round() as i32);
            }
            let bag = |f: usize| match &values[offsets[f * n + s]..offsets[f * n + s + 1]] {
                [] => Bag::Missing,
                ids => Bag::Many(ids),
            };
            self.push_row(batch.labels[s] as i8, &ints, bag);
        }
        Ok(())
    }

    /// Appends one row; `cat(i)` gives feature `i`'s ids.
    pub fn push_row<'a>(
        &mut self,
        label: i8,
        ints: &[Option<i32>; NUM_INT],
        cat: impl Fn(usize) -> Bag<'a>,
    ) {
        self.label.append_value(label);
        for (b, &v) in self.ints.iter_mut().zip(ints) {
            b.append_option(v);
        }
        for (i, b) in self.cats.iter_mut().enumerate() {
            match (b, cat(i)) {
                (CatBuilder::Scalar(b), Bag::One(id)) => b.append_value(id),
                (CatBuilder::Scalar(b), Bag::Missing) => b.append_null(),
                (CatBuilder::Scalar(b), Bag::Many(ids)) => b.append_option(ids.first().copied()),
                (CatBuilder::List(b), Bag::One(id)) => {
                    b.values().append_value(id);
                    b.append(true)
                }
                (CatBuilder::List(b), Bag::Many(ids)) => {
                    b.values().append_slice(ids);
                    b.append(true)
                }
                (CatBuilder::List(b), Bag::Missing) => b.append(false),
            }
        }
        self.rows += 1;
    }

    /// The rows so far as a record batch; the builder starts empty again.
    pub fn finish(&mut self) -> RecordBatch {
        let mut columns: Vec<ArrayRef> = vec![Arc::new(self.label.finish())];
        columns.extend(
            self.ints
                .iter_mut()
                .map(|b| Arc::new(b.finish()) as ArrayRef),
        );
        columns.extend(self.cats.iter_mut().map(|b| match b {
            CatBuilder::Scalar(b) => Arc::new(b.finish()) as ArrayRef,
            CatBuilder::List(b) => Arc::new(b.finish()) as ArrayRef,
        }));
        self.rows = 0;
        RecordBatch::try_new(self.schema.clone(), columns)
            .expect("the builders follow the schema they were made from")
    }
}

/// The ids of one categorical feature of one row.
#[derive(Clone, Copy, Debug)]
pub enum Bag<'a> {
    /// No ids: a null (scalar or list) value.
    Missing,
    /// One id.
    One(i64),
    /// Several ids (possibly none): a list for a `list<int64>` column; a scalar
    /// column keeps only the first (null if empty).
    Many(&'a [i64]),
}

/// The footer key of a sink's parts: the sink's prefix, the name of the set
/// (an ingest's input) whose completion marker lists the part.
pub const PART_OF_KEY: &str = "ember.part_of";

struct OpenFile {
    writer: ArrowWriter<File>,
    out: AtomicFile,
    rows: u64,
}

/// Writes record batches into `<dir>/<prefix>-NNNNN.parquet` files.
pub struct ParquetSink {
    dir: PathBuf,
    prefix: String,
    schema: SchemaRef,
    options: SinkOptions,
    open: Option<OpenFile>,
    files: Vec<PathBuf>,
    rows_written: u64,
    bytes_written: u64,
}

/// A set written beside the one it replaces: its parts and marker go to a
/// hidden staging directory `<dir>/.<prefix>.staging` (which no reader
/// lists), and [`replace`](Self::replace) swaps them in once whole. Until
/// then the previous set stays as it was; dropped unreplaced (an error, a
/// full disk) the staging directory goes, and one a killed run left is
/// removed by the next [`begin`](Self::begin).
///
/// The swap removes the old marker first, so a reader never sees a mix:
/// between that and the new marker (moved in last) the loader refuses the
/// parts as a set whose ingest never finished.
#[derive(Debug)]
pub struct StagedSet {
    dir: PathBuf,
    prefix: String,
    staging: PathBuf,
    replaced: bool,
}

impl StagedSet {
    /// Starts the set `prefix` of `dir` (which must exist) anew in its
    /// staging directory.
    pub fn begin(dir: &Path, prefix: &str) -> Result<Self, DataError> {
        let staging = dir.join(format!(".{prefix}.staging"));
        match std::fs::remove_dir_all(&staging) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(DataError::io(&staging)(e))
            }
            _ => {}
        }
        std::fs::create_dir(&staging).map_err(DataError::io(&staging))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            staging,
            replaced: false,
        })
    }

    /// Where the new set is written (a [`ParquetSink`]'s directory).
    pub fn staging_dir(&self) -> &Path {
        &self.staging
    }

    /// Swaps the staged set (its parts `files`, and its marker) in for the
    /// previous one; returns the parts' new paths.
    pub fn replace(mut self, files: &[PathBuf]) -> Result<Vec<PathBuf>, DataError> {
        let staged_marker = ParquetSink::marker_path(&self.staging, &self.prefix);
        let marker = ParquetSink::marker_path(&self.dir, &self.prefix);
        let text = std::fs::read(&staged_marker).map_err(DataError::io(&staged_marker))?;
        let mut json: serde_json::Value =
            serde_json::from_slice(&text).map_err(|e| DataError::Spec {
                path: staged_marker.clone(),
                message: format!("not a completion marker: {e}"),
            })?;
        let moved: Vec<PathBuf> = (files.iter())
            .map(|f| self.dir.join(f.file_name().unwrap_or_default()))
            .collect();
        json["files"] = serde_json::to_value(&moved).expect("paths serialise");
        ParquetSink::remove_set(&self.dir, &self.prefix)?;
        for (from, to) in files.iter().zip(&moved) {
            std::fs::rename(from, to).map_err(DataError::io(to))?;
        }
        let json = serde_json::to_vec_pretty(&json).expect("a marker serialises");
        crate::atomic::write_atomic(&marker, &json)?;
        self.replaced = true;
        std::fs::remove_dir_all(&self.staging).map_err(DataError::io(&self.staging))?;
        Ok(moved)
    }
}

impl Drop for StagedSet {
    fn drop(&mut self) {
        if !self.replaced {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// The completion marker [`ParquetSink::finish`] writes.
#[derive(Serialize)]
struct SetMarker {
    files: Vec<PathBuf>,
    rows_written: u64,
    bytes_out: u64,
}

impl ParquetSink {
    /// A sink writing batches of `schema` into `dir` (which must exist) as
    /// `<prefix>-00000.parquet`, `<prefix>-00001.parquet`, ... Nothing is created
    /// until the first [`write`](Self::write).
    pub fn new(dir: &Path, prefix: &str, schema: SchemaRef, options: SinkOptions) -> Self {
        Self {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            schema,
            options,
            open: None,
            files: Vec::new(),
            rows_written: 0,
            bytes_written: 0,
        }
    }

    /// The final name of part `n` (also used to clean up before a rerun).
    pub fn part_name(prefix: &str, n: usize) -> String {
        format!("{prefix}-{n:05}.parquet")
    }

    /// The completion marker of the set `prefix` in `dir`:
    /// `_<prefix>.ingest.json`, a JSON object whose `files` lists the set's
    /// parts. Written last, once every part is; the loader refuses a part
    /// whose set has no marker. The leading `_` makes pyarrow, pandas and
    /// Spark skip it when they read the directory as a dataset.
    pub fn marker_path(dir: &Path, prefix: &str) -> PathBuf {
        dir.join(format!("_{prefix}.ingest.json"))
    }

    /// Deletes the set `prefix` from `dir`: its marker first (so a reader
    /// never takes what is left for a whole set), then its parts and the
    /// temporary files of an earlier, unfinished run (before a rewrite).
    pub fn remove_set(dir: &Path, prefix: &str) -> Result<(), DataError> {
        let marker = Self::marker_path(dir, prefix);
        match std::fs::remove_file(&marker) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(DataError::io(&marker)(e))
            }
            _ => {}
        }
        let entries = std::fs::read_dir(dir).map_err(DataError::io(dir))?;
        // Markers of earlier versions had no leading `_`; a killed run
        // may have left a marker's temporary file.
        let markers = [
            format!("_{prefix}.ingest.json"),
            format!("{prefix}.ingest.json"),
            format!("._{prefix}.ingest.json.tmp"),
        ];
        for entry in entries {
            let entry = entry.map_err(DataError::io(dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let bare = name.strip_prefix('.').unwrap_or(&name);
            let part = bare.strip_prefix(prefix).and_then(|r| r.strip_prefix('-'));
            let is_part = part.is_some_and(|r| {
                let r = r.strip_suffix(".tmp").unwrap_or(r);
                r.strip_suffix(".parquet")
                    .is_some_and(|n| n.len() == 5 && n.bytes().all(|b| b.is_ascii_digit()))
            });
            if is_part || markers.contains(&name) {
                std::fs::remove_file(entry.path()).map_err(DataError::io(entry.path()))?;
            }
        }
        Ok(())
    }

    /// Appends `batch`'s rows, closing and committing a file whenever it reaches
    /// `rows_per_file` and opening the next. Row groups hold at most
    /// `row_group_size` rows and never span two files.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<(), DataError> {
        let limit = self.options.rows_per_file;
        let mut start = 0;
        while start < batch.num_rows() {
            let file = self.open_file()?;
            let room = match limit {
                Some(limit) => (limit - file.rows) as usize,
                None => usize::MAX,
            };
            let n = room.min(batch.num_rows() - start);
            file.writer
                .write(&batch.slice(start, n))
                .map_err(DataError::parquet(file.out.temp()))?;
            file.rows += n as u64;
            start += n;
            let full = Some(file.rows) == limit;
            self.rows_written += n as u64;
            if full {
                self.close_file()?;
            }
        }
        Ok(())
    }

    /// Closes the last file and writes the set's completion marker
    /// ([`marker_path`](Self::marker_path)) listing the parts, their rows
    /// and bytes; returns every file written, in order, and their bytes.
    pub fn finish(self) -> Result<(Vec<PathBuf>, u64), DataError> {
        let marker = Self::marker_path(&self.dir, &self.prefix);
        let rows_written = self.rows_written;
        let (files, bytes_out) = self.finish_parts()?;
        let set = SetMarker {
            files,
            rows_written,
            bytes_out,
        };
        let json = serde_json::to_vec_pretty(&set).expect("a marker serialises");
        if let Err(e) = crate::atomic::write_atomic(&marker, &json) {
            // Parts without their marker are refused by the loader anyway:
            // leave nothing.
            for f in &set.files {
                let _ = std::fs::remove_file(f);
            }
            return Err(e);
        }
        Ok((set.files, bytes_out))
    }

    /// Closes the last file, without a marker: the caller writes its own
    /// (an ingest's, with its counts), once the set is known to be good.
    pub(crate) fn finish_parts(mut self) -> Result<(Vec<PathBuf>, u64), DataError> {
        self.close_file()?;
        Ok((std::mem::take(&mut self.files), self.bytes_written))
    }

    fn open_file(&mut self) -> Result<&mut OpenFile, DataError> {
        if self.open.is_none() {
            let name = Self::part_name(&self.prefix, self.files.len());
            let mut out = AtomicFile::create(&self.dir.join(&name))?;
            let part_of = KeyValue::new(PART_OF_KEY.into(), self.prefix.clone());
            let props = WriterProperties::builder()
                .set_compression(self.options.compression.compression())
                .set_max_row_group_row_count(Some(self.options.row_group_size.max(1)))
                .set_key_value_metadata(Some(vec![part_of]))
                .build();
            let writer = ArrowWriter::try_new(out.take_file(), self.schema.clone(), Some(props))
                .map_err(DataError::parquet(out.temp()))?;
            self.open = Some(OpenFile {
                writer,
                out,
                rows: 0,
            });
        }
        Ok(self.open.as_mut().expect("opened above"))
    }

    fn close_file(&mut self) -> Result<(), DataError> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        let file = finish_parquet(open.writer, open.out.temp())?;
        let path = open.out.path().to_path_buf();
        self.bytes_written += open.out.commit_file(file)?;
        self.files.push(path);
        Ok(())
    }
}

/// A Parquet file of one schema (zstd), written to its temporary file and
/// committed whole: what prediction files share.
pub(crate) struct AtomicParquet {
    writer: ArrowWriter<File>,
    out: AtomicFile,
    rows: u64,
}

impl AtomicParquet {
    /// Opens `path`'s temporary file (`.<name>.tmp` beside it) for `schema`.
    pub(crate) fn create(path: &Path, schema: SchemaRef) -> Result<Self, DataError> {
        let mut out = AtomicFile::create(path)?;
        let props = WriterProperties::builder()
            .set_compression(Codec::Zstd.compression())
            .build();
        let writer = ArrowWriter::try_new(out.take_file(), schema, Some(props))
            .map_err(DataError::parquet(out.temp()))?;
        Ok(Self {
            writer,
            out,
            rows: 0,
        })
    }

    /// The temporary file, for errors.
    pub(crate) fn temp(&self) -> &Path {
        self.out.temp()
    }

    /// Appends `batch`'s rows.
    pub(crate) fn write(&mut self, batch: &RecordBatch) -> Result<(), DataError> {
        self.writer
            .write(batch)
            .map_err(DataError::parquet(self.out.temp()))?;
        self.rows += batch.num_rows() as u64;
        Ok(())
    }

    /// Closes, fsyncs and renames the file; returns the rows written.
    pub(crate) fn finish(self) -> Result<u64, DataError> {
        let file = finish_parquet(self.writer, self.out.temp())?;
        self.out.commit_file(file)?;
        Ok(self.rows)
    }
}

/// Streams model outputs into a Parquet file with columns `logit` and
/// `probability` (float32), one row per input row, committed atomically.
pub struct PredictionWriter {
    file: AtomicParquet,
    schema: SchemaRef,
}

impl PredictionWriter {
    /// Opens `path`'s temporary file (`.<name>.tmp` beside it); `path` itself
    /// appears only at [`finish`](Self::finish).
    pub fn create(path: &Path) -> Result<Self, DataError> {
        use arrow_schema::{DataType, Field, Schema};
        let schema = Arc::new(Schema::new(vec![
            Field::new("logit", DataType::Float32, false),
            Field::new("probability", DataType::Float32, false),
        ]));
        let file = AtomicParquet::create(path, schema.clone())?;
        Ok(Self { file, schema })
    }

    /// Appends one row per logit, with its probability `1 / (1 + e^-logit)`.
    pub fn write(&mut self, logits: &[f32]) -> Result<(), DataError> {
        use arrow_array::Float32Array;
        let p: Float32Array = logits.iter().map(|&z| probability(z)).collect();
        let columns: Vec<ArrayRef> =
            vec![Arc::new(Float32Array::from(logits.to_vec())), Arc::new(p)];
        let batch = RecordBatch::try_new(self.schema.clone(), columns)
            .expect("two float columns of one length");
        self.file.write(&batch)
    }

    /// Closes, fsyncs and renames the file; returns the rows written.
    pub fn finish(self) -> Result<u64, DataError> {
        self.file.finish()
    }
}

/// Writes the footer and flushes, then hands the file back (a second
/// descriptor of it). Finished so, a failed write (a full disk) keeps its
/// I/O error; left to `into_inner`, the last flush's error reaches us only
/// as text.
pub(crate) fn finish_parquet(
    mut writer: ArrowWriter<std::fs::File>,
    temp: &std::path::Path,
) -> Result<std::fs::File, DataError> {
    writer.finish().map_err(DataError::parquet(temp))?;
    writer.inner().try_clone().map_err(DataError::io(temp))
}
/// A logit's probability, `1 / (1 + e^-logit)`, as prediction files and
/// the server give it.
pub fn probability(logit: f32) -> f32 {
    1.0 / (1.0 + (-logit).exp())
}
