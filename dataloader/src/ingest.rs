//! `ember ingest criteo`: Criteo TSV (plain or gzip) into Parquet in one
//! streaming pass. Memory is bounded by one row group: lines are parsed into
//! column builders and written out every `row_group_size` rows.
//!
//! Each input `NAME[.tsv|.txt][.gz]` becomes `NAME-00000.parquet`, ... and,
//! once all its parts are complete, a marker `_NAME.ingest.json` holding its
//! counts and the input's size and modification time. `resume` skips inputs
//! whose marker exists and matches the input as it is now; any other input's
//! old parts are deleted and rewritten.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::criteo::{parse_line, CriteoRecord, Reject};
use crate::lock::DirLock;
use crate::multi_hot::MultiHot;
use crate::schema::{cat_column, int_column, NUM_CAT, NUM_INT};
use crate::vocabulary::{
    check_output, refuse_raw_into, Vocabulary, VocabularyInfo, VocabularyOptions, VocabularyStamp,
    VOCABULARY_DIR, VOCABULARY_FILE,
};
use crate::writer::{Bag, CriteoBatchBuilder, ParquetSink, SinkOptions};
use crate::DataError;

/// Longer lines are rejected without being read whole (a Criteo line is
/// under 1 KB).
pub const MAX_LINE_BYTES: usize = 1 << 16;

/// Rejected lines reported one by one; the rest are only counted.
pub const REPORTED_REJECTS: usize = 10;

/// Options of [`ingest_criteo`].
#[derive(Clone, Debug, Default)]
pub struct IngestOptions {
    /// Expand each categorical id into MLPerf DLRMv2's multi-hot bag
    /// ([`MultiHot`]: the reference's `multi_hot.py`); features of more
    /// than one id become `list<int64>` columns, and every id is reduced
    /// below its table's rows. `None`: the ids as they are.
    pub multi_hot: Option<std::sync::Arc<MultiHot>>,
    /// Map each column's ids to contiguous ids over all inputs first
    /// (TorchRec's `sparse_to_contiguous`: [`Vocabulary`]), writing the
    /// vocabulary and the table sizes beside the data. Multi-hot expansion,
    /// if any, draws from the contiguous ids, as MLPerf's does.
    pub vocabulary: Option<VocabularyOptions>,
    /// File and row-group layout and compression of the output.
    pub sink: SinkOptions,
    /// Stop at the first malformed line instead of skipping it.
    pub strict: bool,
    /// Skip inputs whose output is complete.
    pub resume: bool,
    /// The largest fraction of an input's lines that may be rejected; an
    /// input over it (a binary file, a file of another format) is an error,
    /// and so is an input with no line. `None`: [`DEFAULT_MAX_REJECT_FRACTION`].
    pub max_reject_fraction: Option<f64>,
}

/// Half the lines: real Criteo days reject none, a file of another format
/// nearly all.
pub const DEFAULT_MAX_REJECT_FRACTION: f64 = 0.5;

/// A rejected line, with where it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedLine {
    /// The input file.
    pub file: PathBuf,
    /// The 1-based line number.
    pub line: u64,
    /// Why it was rejected, as [`Reject`]'s message.
    pub reason: String,
}

/// Null count of one column.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ColumnNulls {
    /// The column's name (`int_i` or `cat_i`).
    pub column: String,
    /// Accepted rows where it was empty (missing).
    pub nulls: u64,
}

/// What one input file produced (also the content of its marker file).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputSummary {
    /// The input file.
    pub input: PathBuf,
    /// The input's size and modification time when it was read: `resume`
    /// redoes an input that has changed since.
    #[serde(default)]
    pub input_stamp: Option<InputStamp>,
    /// The Parquet parts written for it, in order.
    pub files: Vec<PathBuf>,
    /// Rows written: the accepted lines.
    pub rows_written: u64,
    /// Rejected lines by reason (`field_count`, `label`, `integer`,
    /// `categorical`, `too_long`).
    pub rejected: BTreeMap<String, u64>,
    /// The first [`REPORTED_REJECTS`] rejected lines.
    pub first_rejected: Vec<RejectedLine>,
    /// Null count of every column, `int_0..int_12` then `cat_0..cat_25`.
    pub nulls: Vec<ColumnNulls>,
    /// Bytes read from the input file (compressed, for gzip).
    pub bytes_in: u64,
    /// Bytes of the Parquet files written.
    pub bytes_out: u64,
    /// The multi-hot expansion the output was made with
    /// ([`MultiHot::describe`]; `None`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub multi_hot: Option<String>,
    /// The vocabulary the ids were mapped by (`None`: the raw ids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<VocabularyStamp>,
}

/// What identifies an input file's content without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputStamp {
    /// Size in bytes.
    pub bytes: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    pub modified_ns: u128,
}

impl InputStamp {
    /// `path`'s stamp now.
    pub fn of(path: &Path) -> Result<Self, DataError> {
        let meta = std::fs::metadata(path).map_err(DataError::io(path))?;
        let modified = meta.modified().map_err(DataError::io(path))?;
        Ok(Self {
            bytes: meta.len(),
            modified_ns: (modified.duration_since(std::time::UNIX_EPOCH))
                .map_or(0, |d| d.as_nanos()),
        })
    }
}

/// The whole run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct IngestSummary {
    /// Rows written over all inputs.
    pub rows_written: u64,
    /// Lines rejected over all inputs (the sum of `rejected`).
    pub lines_rejected: u64,
    /// Rejected lines by reason, as in [`InputSummary::rejected`].
    pub rejected: BTreeMap<String, u64>,
    /// The first rejected lines, with file and line number (at most
    /// [`REPORTED_REJECTS`]).
    pub first_rejected: Vec<RejectedLine>,
    /// Null count of every column over all inputs.
    pub nulls: Vec<ColumnNulls>,
    /// Bytes read from the inputs (compressed, for gzip).
    pub bytes_in: u64,
    /// Bytes of the Parquet files written.
    pub bytes_out: u64,
    /// Wall-clock time of the run, in seconds.
    pub seconds: f64,
    /// `rows_written / seconds`.
    pub rows_per_s: f64,
    /// Every Parquet file, of every input, in order.
    pub files: Vec<PathBuf>,
    /// Inputs skipped by `resume` (their counts are included above).
    pub resumed_inputs: Vec<PathBuf>,
    /// The vocabulary, when the ids were mapped by one: the table sizes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vocabulary: Option<VocabularyInfo>,
}

impl IngestSummary {
    fn add(&mut self, s: &InputSummary) {
        self.rows_written += s.rows_written;
        for (k, v) in &s.rejected {
            *self.rejected.entry(k.clone()).or_default() += v;
            self.lines_rejected += v;
        }
        let room = REPORTED_REJECTS.saturating_sub(self.first_rejected.len());
        (self.first_rejected).extend(s.first_rejected.iter().take(room).cloned());
        if self.nulls.is_empty() {
            self.nulls = s.nulls.clone();
        } else {
            for (a, b) in self.nulls.iter_mut().zip(&s.nulls) {
                a.nulls += b.nulls;
            }
        }
        self.bytes_in += s.bytes_in;
        self.bytes_out += s.bytes_out;
        self.files.extend(s.files.iter().cloned());
    }
}

/// The output prefix of an input: its file name without `.gz` and a
/// `.tsv`/`.txt`/`.csv` extension.
pub fn output_prefix(input: &Path) -> String {
    let mut name = input
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    for ext in [".gz", ".tsv", ".txt", ".csv"] {
        if let Some(stem) = name.strip_suffix(ext) {
            name = stem.to_string();
        }
    }
    name
}

/// Ingests `inputs` into `output`; `progress` is called with the input bytes
/// read so far (of the sum of the inputs' sizes; twice that with a
/// vocabulary, whose first pass reads them once more).
pub fn ingest_criteo(
    inputs: &[PathBuf],
    output: &Path,
    options: &IngestOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<IngestSummary, DataError> {
    let start = Instant::now();
    if options.sink.row_group_size == 0 || options.sink.rows_per_file == Some(0) {
        return Err(DataError::Option {
            option: "row group size and rows per file",
            value: format!(
                "{} and {:?}",
                options.sink.row_group_size, options.sink.rows_per_file
            ),
            expected: "must be at least 1".into(),
        });
    }
    let max_reject = options
        .max_reject_fraction
        .unwrap_or(DEFAULT_MAX_REJECT_FRACTION);
    if !(0.0..=1.0).contains(&max_reject) {
        return Err(DataError::Option {
            option: "the largest reject fraction (--max-reject-fraction)",
            value: max_reject.to_string(),
            expected: "must be within 0 and 1".into(),
        });
    }
    let mut prefixes = BTreeMap::new();
    for input in inputs {
        if let Some(other) = prefixes.insert(output_prefix(input), input) {
            return Err(DataError::SameOutputs {
                first: other.to_path_buf(),
                second: input.to_path_buf(),
            });
        }
    }
    let _lock = DirLock::acquire(output, "ember ingest criteo")?;
    let mut summary = IngestSummary::default();
    let mut done_bytes = 0;
    // What each input was when the vocabulary counted it.
    let mut counted = Vec::new();
    let vocabulary = match &options.vocabulary {
        Some(v) => {
            check_output(output, inputs, &prefixes, options.resume, v.threshold)?;
            for input in inputs {
                counted.push(InputStamp::of(input)?);
            }
            let spill = output.join(format!("{VOCABULARY_DIR}.spill"));
            let vocabulary = Vocabulary::build(inputs, &spill, v, options.strict, progress)?;
            done_bytes = vocabulary.info().bytes_read;
            // The table sizes appear once every input is numbered by them;
            // until then the markers tell the loader what each part holds.
            let old = output.join(VOCABULARY_FILE);
            if old.exists() {
                std::fs::remove_file(&old).map_err(DataError::io(&old))?;
            }
            Some(vocabulary)
        }
        None => {
            refuse_raw_into(output)?;
            None
        }
    };
    for (k, input) in inputs.iter().enumerate() {
        let prefix = output_prefix(input);
        let marker = ParquetSink::marker_path(output, &prefix);
        let stamp = InputStamp::of(input)?;
        if counted.get(k).is_some_and(|&c| c != stamp) {
            return Err(DataError::Vocabulary(format!(
                "{}: changed after its ids were counted; ingest it again",
                input.display()
            )));
        }
        let done = match options.resume {
            true => resumable(output, &prefix, stamp, options, vocabulary.as_ref())?,
            false => None,
        };
        let s = match done {
            Some(s) => {
                summary.resumed_inputs.push(input.clone());
                s
            }
            None => {
                ParquetSink::remove_set(output, &prefix)?;
                let done = ingest_one(
                    input,
                    output,
                    &prefix,
                    options,
                    vocabulary.as_ref(),
                    &mut |b| progress(done_bytes + b),
                )
                .and_then(|mut s| {
                    s.input_stamp = Some(stamp);
                    check_rejects(&s, max_reject)?;
                    let json = serde_json::to_vec_pretty(&s).expect("a summary serialises");
                    write_atomic(&marker, &json).map(|()| s)
                });
                // A failed input leaves none of its parts: finished parts
                // without a marker would be read as if the input were whole.
                done.inspect_err(|_| {
                    let _ = ParquetSink::remove_set(output, &prefix);
                })?
            }
        };
        done_bytes += s.bytes_in;
        progress(done_bytes);
        summary.add(&s);
    }
    if let Some(v) = &vocabulary {
        v.write(output)?;
        summary.vocabulary = Some(v.info().clone());
    }
    summary.seconds = start.elapsed().as_secs_f64();
    summary.rows_per_s = summary.rows_written as f64 / summary.seconds.max(1e-9);
    Ok(summary)
}

/// The summary of an input done before, as it is now (`stamp`), with its
/// files all still there; `None`: redo it. A marker of an earlier version
/// (`NAME.ingest.json`, no stamp) counts when the input's size is the size
/// it read; it is rewritten in today's form, stamp included.
fn resumable(
    output: &Path,
    prefix: &str,
    stamp: InputStamp,
    options: &IngestOptions,
    vocabulary: Option<&Vocabulary>,
) -> Result<Option<InputSummary>, DataError> {
    let read = |path: &Path| -> Option<InputSummary> {
        let s: InputSummary = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        s.files.iter().all(|f| f.is_file()).then_some(s)
    };
    let marker = ParquetSink::marker_path(output, prefix);
    if let Some(s) = read(&marker) {
        // One directory, one expansion: a resume never mixes outputs.
        let given = options.multi_hot.as_ref().map(|m| m.describe());
        if s.multi_hot != given {
            let say = |m: &Option<String>| m.clone().unwrap_or_else(|| "no multi-hot".into());
            return Err(DataError::MultiHot(format!(
                "{}: its output in {} was written with {}, this run asks for {}: \
                 resume with the same --multi-hot and --multi-hot-rows, or ingest into another directory",
                s.input.display(),
                output.display(),
                say(&s.multi_hot),
                say(&given)
            )));
        }
        let given = vocabulary.map(|v| v.info().stamp);
        let threshold = |v: Option<VocabularyStamp>| v.map(|v| v.frequency_threshold);
        if threshold(s.vocabulary) != threshold(given) {
            let say = |t: Option<u64>| {
                t.map_or("no vocabulary".into(), |t| {
                    format!("--vocabulary-threshold {t}")
                })
            };
            return Err(DataError::Vocabulary(format!(
                "{}: its output in {} was written with {}, this run asks for {}: \
                 resume with the same threshold, or ingest into another directory",
                s.input.display(),
                output.display(),
                say(threshold(s.vocabulary)),
                say(threshold(given))
            )));
        }
        // Another vocabulary (the inputs changed): its ids are redone.
        return Ok((s.input_stamp == Some(stamp) && s.vocabulary == given).then_some(s));
    }
    let legacy = output.join(format!("{prefix}.ingest.json"));
    match read(&legacy) {
        // Written before vocabularies: raw ids.
        Some(mut s)
            if s.input_stamp.is_none() && s.bytes_in == stamp.bytes && vocabulary.is_none() =>
        {
            s.input_stamp = Some(stamp);
            let json = serde_json::to_vec_pretty(&s).expect("a summary serialises");
            write_atomic(&marker, &json)?;
            std::fs::remove_file(&legacy).map_err(DataError::io(&legacy))?;
            Ok(Some(s))
        }
        _ => Ok(None),
    }
}

/// An input with more than `max` of its lines rejected is not Criteo data:
/// an error naming it and its first rejected line. So is an empty input,
/// unless `max` is 1 (anything goes).
fn check_rejects(s: &InputSummary, max: f64) -> Result<(), DataError> {
    let rejected: u64 = s.rejected.values().sum();
    let lines = s.rows_written + rejected;
    if lines == 0 && max < 1.0 {
        let path = s.input.clone();
        return Err(DataError::EmptyInput { path });
    }
    if rejected as f64 <= max * lines as f64 {
        return Ok(());
    }
    Err(DataError::TooManyRejects {
        path: s.input.clone(),
        rejected,
        lines,
        first: (s.first_rejected.first()).map(|r| (r.line, r.reason.clone())),
        max,
    })
}

/// Bytes read so far from an input file, shared with the reader that counts them.
type ByteCount = Rc<Cell<u64>>;

/// Counts the bytes read from the file underneath any decompression.
struct Counting<R> {
    inner: R,
    bytes: ByteCount,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes.set(self.bytes.get() + n as u64);
        Ok(n)
    }
}

/// Lines of a plain or gzip file (told apart by the gzip magic bytes).
fn open_lines(path: &Path) -> Result<(Box<dyn BufRead>, ByteCount), DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    let bytes = Rc::new(Cell::new(0));
    let mut raw = BufReader::with_capacity(
        1 << 16,
        Counting {
            inner: file,
            bytes: bytes.clone(),
        },
    );
    let gzip = raw
        .fill_buf()
        .map_err(DataError::io(path))?
        .starts_with(&[0x1f, 0x8b]);
    let lines: Box<dyn BufRead> = if gzip {
        Box::new(BufReader::with_capacity(
            1 << 16,
            flate2::bufread::MultiGzDecoder::new(raw),
        ))
    } else {
        Box::new(raw)
    };
    Ok((lines, bytes))
}

/// Reads `input`'s lines in order and hands each to `each` with its
/// 1-based number, parsed or rejected; under `strict` a rejected line is an
/// error naming it instead. `progress` is called with the input bytes read
/// now and then. Returns the lines read and the input bytes.
pub(crate) fn read_records(
    input: &Path,
    strict: bool,
    mut each: impl FnMut(u64, Result<&mut CriteoRecord, Reject>) -> Result<(), DataError>,
    progress: &mut dyn FnMut(u64),
) -> Result<(u64, u64), DataError> {
    let (mut lines, bytes_read) = open_lines(input)?;
    let mut record = CriteoRecord::default();
    let mut buf = Vec::with_capacity(512);
    let mut line_no = 0u64;
    loop {
        buf.clear();
        let n = (&mut lines)
            .take(MAX_LINE_BYTES as u64)
            .read_until(b'\n', &mut buf)
            .map_err(DataError::io(input))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        let parsed = if buf.len() == MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
            // Not a Criteo line (a binary file, a missing newline): skip to
            // the next newline without holding the rest in memory.
            let skipped = lines.skip_until(b'\n').map_err(DataError::io(input))?;
            Err(Reject::TooLong {
                bytes: MAX_LINE_BYTES + skipped,
            })
        } else {
            parse_line(buf.strip_suffix(b"\n").unwrap_or(&buf), &mut record)
        };
        match parsed {
            Err(reason) if strict => {
                return Err(DataError::Malformed {
                    path: input.to_path_buf(),
                    line: line_no,
                    reason,
                })
            }
            parsed => each(line_no, parsed.map(|()| &mut record))?,
        }
        if line_no.is_multiple_of(PROGRESS_LINES) {
            progress(bytes_read.get());
        }
    }
    Ok((line_no, bytes_read.get()))
}

/// Lines between progress reports.
const PROGRESS_LINES: u64 = 1 << 16;

fn ingest_one(
    input: &Path,
    output: &Path,
    prefix: &str,
    options: &IngestOptions,
    vocabulary: Option<&Vocabulary>,
    progress: &mut dyn FnMut(u64),
) -> Result<InputSummary, DataError> {
    let multi: [bool; NUM_CAT] = match &options.multi_hot {
        Some(m) => std::array::from_fn(|i| m.sizes()[i] > 1),
        None => [false; NUM_CAT],
    };
    let mut builder = CriteoBatchBuilder::new(&multi);
    let mut bags: Vec<Vec<i64>> = vec![Vec::new(); NUM_CAT];
    let mut sink = ParquetSink::new(output, prefix, builder.schema().clone(), options.sink);
    let mut s = InputSummary {
        input: input.to_path_buf(),
        multi_hot: options.multi_hot.as_ref().map(|m| m.describe()),
        vocabulary: vocabulary.map(|v| v.info().stamp),
        ..Default::default()
    };
    let mut int_nulls = [0u64; NUM_INT];
    let mut cat_nulls = [0u64; NUM_CAT];
    let (lines, bytes_in) = read_records(
        input,
        options.strict,
        |line_no, parsed| {
            match parsed {
                Ok(record) => {
                    count_nulls(record, &mut int_nulls, &mut cat_nulls);
                    if let Some(v) = vocabulary {
                        v.apply(record);
                    }
                    match &options.multi_hot {
                        None => builder.push_record(record),
                        Some(m) => {
                            for (f, bag) in bags.iter_mut().enumerate() {
                                match record.cats[f] {
                                    Some(id) => m.expand(f, id, bag),
                                    None => bag.clear(),
                                }
                            }
                            builder.push_row(record.label, &record.ints, |f| {
                                match record.cats[f] {
                                    Some(_) => Bag::Many(&bags[f]),
                                    None => Bag::Missing,
                                }
                            });
                        }
                    }
                    if builder.len() == options.sink.row_group_size {
                        sink.write(&builder.finish())?;
                    }
                }
                Err(reason) => note_reject(&mut s, input, line_no, &reason),
            }
            Ok(())
        },
        progress,
    )?;
    if !builder.is_empty() {
        sink.write(&builder.finish())?;
    }
    let (files, bytes_out) = sink.finish_parts()?;
    s.rows_written = lines - s.rejected.values().sum::<u64>();
    s.files = files;
    s.bytes_out = bytes_out;
    s.bytes_in = bytes_in;
    s.nulls = (0..NUM_INT)
        .map(|i| (int_column(i), int_nulls[i]))
        .chain((0..NUM_CAT).map(|i| (cat_column(i), cat_nulls[i])))
        .map(|(column, nulls)| ColumnNulls { column, nulls })
        .collect();
    Ok(s)
}

fn count_nulls(r: &CriteoRecord, ints: &mut [u64; NUM_INT], cats: &mut [u64; NUM_CAT]) {
    for (n, v) in ints.iter_mut().zip(&r.ints) {
        *n += v.is_none() as u64;
    }
    for (n, v) in cats.iter_mut().zip(&r.cats) {
        *n += v.is_none() as u64;
    }
}

fn note_reject(s: &mut InputSummary, input: &Path, line: u64, reason: &Reject) {
    *s.rejected.entry(reason.kind().to_string()).or_default() += 1;
    if s.first_rejected.len() < REPORTED_REJECTS {
        s.first_rejected.push(RejectedLine {
            file: input.to_path_buf(),
            line,
            reason: reason.to_string(),
        });
    }
}
