//! Criteo vocabularies: TorchRec's `sparse_to_contiguous`
//! (`torchrec/datasets/criteo.py`) as a streaming two-pass step.
//!
//! Per categorical column, over all inputs in the order given: a missing id
//! is raw id 0 (TorchRec's `tsv_to_npys`), ids seen at least `threshold`
//! times get contiguous ids from 2 in the order of their first appearance,
//! and every rarer id gets 1. So a column's table needs `2 + frequent ids`
//! rows (its `num_embeddings_per_feature`); row 0 is never used.
//!
//! Memory stays bounded however many distinct ids the inputs hold: the
//! first pass spills each (column, id, line) by the id's hash into
//! partition files (`spill.rs`), and the ids are counted one
//! partition at a time. What is held at the end is the frequent ids'
//! numbering (about 40 bytes an id, twice that while it is built), which
//! the tables need anyway. One partition is counted in memory without a
//! spill.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::criteo::CriteoRecord;
use crate::ingest::{read_records, InputSummary};
use crate::schema::{cat_column, NUM_CAT};
use crate::spill::{partitions_for, read_part, Spill, MAX_PARTITIONS};
use crate::writer::AtomicParquet;
use crate::DataError;

/// The file beside the data that `train` reads the table sizes from.
pub const VOCABULARY_FILE: &str = "_vocabulary.json";

/// The directory beside the data holding each column's ids, `cat_i.parquet`.
pub const VOCABULARY_DIR: &str = "_vocabulary";

/// The contiguous id of every id seen fewer than the threshold times.
pub const RARE_ID: i64 = 1;

/// The first contiguous id of a frequent id.
pub const FIRST_ID: i64 = 2;

/// Memory the counting of one partition may take, by default.
pub const DEFAULT_COUNT_MEMORY: u64 = 2 << 30;

/// How a vocabulary is built.
#[derive(Clone, Debug)]
pub struct VocabularyOptions {
    /// Ids seen fewer times than this over all inputs map to
    /// [`RARE_ID`] (TorchRec's `frequency_threshold`; 0 and 1: none do).
    pub threshold: u64,
    /// Memory the counting of one partition may take; the number of
    /// partitions follows from the inputs' size.
    pub count_memory: u64,
    /// The number of partitions (at most 256), instead of one from
    /// `count_memory` (for tests and tuning).
    pub partitions: Option<usize>,
}

impl VocabularyOptions {
    /// `threshold`, with the default memory.
    pub fn new(threshold: u64) -> Self {
        Self {
            threshold,
            count_memory: DEFAULT_COUNT_MEMORY,
            partitions: None,
        }
    }
}

/// What identifies a vocabulary: its threshold and a fingerprint of every
/// column's frequent ids in order. Part of each input's marker, so a
/// resume never mixes the outputs of two vocabularies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VocabularyStamp {
    /// The frequency threshold.
    pub frequency_threshold: u64,
    /// A hash of the frequent ids of every column, in contiguous order.
    pub fingerprint: u64,
}

/// `_vocabulary.json`: the table sizes and how they were made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VocabularyInfo {
    /// The frequency threshold.
    pub frequency_threshold: u64,
    /// Rows each column's table needs: `2 +` its frequent ids (TorchRec's
    /// `num_embeddings_per_feature`), `cat_0..cat_25`.
    pub num_embeddings_per_feature: Vec<u64>,
    /// Distinct ids seen in each column (missing counted as id 0).
    pub distinct_ids: Vec<u64>,
    /// The accepted lines counted.
    pub rows: u64,
    /// The input bytes the counting read (compressed, for gzip).
    pub bytes_read: u64,
    /// The inputs, in the order their ids were numbered.
    pub inputs: Vec<PathBuf>,
    /// The partitions the ids were counted in.
    pub partitions: usize,
    /// What identifies it (in each input's marker too).
    pub stamp: VocabularyStamp,
}

impl VocabularyInfo {
    /// The vocabulary of the data in `dir` (a directory of Parquet files or
    /// one file's directory), if it was ingested with one.
    pub fn beside(data: &Path) -> Result<Option<Self>, DataError> {
        let dir = match data.is_dir() {
            true => data,
            false => data.parent().unwrap_or(Path::new(".")),
        };
        let path = dir.join(VOCABULARY_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(DataError::io(&path)(e)),
        };
        let bad = |why: String| DataError::Vocabulary(format!("{}: {why}", path.display()));
        let info: Self = serde_json::from_slice(&bytes)
            .map_err(|e| bad(format!("not a vocabulary file ({e})")))?;
        let sizes = info.num_embeddings_per_feature.len();
        if sizes != NUM_CAT {
            return Err(bad(format!("{sizes} table sizes, expected {NUM_CAT}")));
        }
        Ok(Some(info))
    }

    /// The vocabulary shared by all of `data` (files or directories):
    /// `None` when none has one; an error when some have one and some not,
    /// or two differ, naming them.
    pub fn of_data(data: &[PathBuf]) -> Result<Option<Self>, DataError> {
        let mut found: Option<(Self, &PathBuf)> = None;
        let mut without = None;
        for path in data {
            match (Self::beside(path)?, &found) {
                (None, _) => without = Some(path),
                (Some(v), Some((first, at))) if v.stamp != first.stamp => {
                    return Err(DataError::Vocabulary(format!(
                        "{} and {} were ingested with different vocabularies: \
                         ingest every day in one call so they share one",
                        at.display(),
                        path.display()
                    )))
                }
                (Some(v), None) => found = Some((v, path)),
                (Some(_), Some(_)) => {}
            }
        }
        match (found, without) {
            (Some((_, with)), Some(without)) => Err(DataError::Vocabulary(format!(
                "{} has a vocabulary ({VOCABULARY_FILE}) and {} has none: \
                 its ids would be read as another numbering",
                with.display(),
                without.display()
            ))),
            (found, _) => Ok(found.map(|(v, _)| v)),
        }
    }
}

/// What a vocabulary run must find in `output` before it counts anything,
/// so that a refused run changes nothing: no other input's output (the
/// vocabulary would not cover its ids; `prefixes` are this run's), on a
/// `resume` no output of this run's inputs made by another threshold, and
/// inputs that are regular files (read twice: a pipe would be empty the
/// second time).
pub(crate) fn check_output(
    output: &Path,
    inputs: &[PathBuf],
    prefixes: &BTreeMap<String, &PathBuf>,
    resume: bool,
    threshold: u64,
) -> Result<(), DataError> {
    if let Some(input) = inputs.iter().find(|p| !p.is_file()) {
        return Err(DataError::Vocabulary(format!(
            "{}: not a regular file; a vocabulary reads its inputs twice",
            input.display()
        )));
    }
    for (prefix, marker) in markers(output) {
        let prefix = prefix.as_str();
        if !prefixes.contains_key(prefix) {
            return Err(DataError::Vocabulary(format!(
                "{} holds the output of another input ({prefix}), which this vocabulary \
                 would not cover: ingest every day in one call, into a fresh directory",
                output.display()
            )));
        }
        let made_by = marker.map(|m| m.vocabulary.map(|v| v.frequency_threshold));
        match made_by {
            Some(t) if resume && t != Some(threshold.max(1)) => {
                let say = t.map_or("no vocabulary".into(), |t| {
                    format!("--vocabulary-threshold {t}")
                });
                return Err(DataError::Vocabulary(format!(
                    "{}: the output of {prefix} was written with {say}: resume with the same \
                     threshold, or ingest into another directory",
                    output.display()
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Refuses raw ids into `output` when it holds data numbered by a
/// vocabulary: its table sizes, or a marker of a vocabulary run that did
/// not finish.
pub(crate) fn refuse_raw_into(output: &Path) -> Result<(), DataError> {
    let refuse = |what: String| {
        Err(DataError::Vocabulary(format!(
            "{} holds data numbered by a vocabulary ({what}): ingest raw ids into another directory",
            output.display()
        )))
    };
    let sizes = output.join(VOCABULARY_FILE);
    if sizes.exists() {
        return refuse(sizes.display().to_string());
    }
    for (prefix, marker) in markers(output) {
        if marker.is_some_and(|m| m.vocabulary.is_some()) {
            return refuse(format!("the marker of {prefix}, of an unfinished run"));
        }
    }
    Ok(())
}

/// The input markers in `output`: each input's output prefix, and its
/// summary when it reads as one. Today's markers are `_NAME.ingest.json`,
/// earlier ones `NAME.ingest.json`.
fn markers(output: &Path) -> Vec<(String, Option<InputSummary>)> {
    let Ok(entries) = std::fs::read_dir(output) else {
        return Vec::new();
    };
    (entries.flatten())
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let prefix = name.strip_suffix(".ingest.json")?;
            let prefix = prefix.strip_prefix('_').unwrap_or(prefix).to_string();
            let summary =
                (std::fs::read(entry.path()).ok()).and_then(|b| serde_json::from_slice(&b).ok());
            Some((prefix, summary))
        })
        .collect()
}

/// Hashes an id with splitmix64 (std's SipHash is several times slower,
/// and ids are not chosen by an adversary).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        ember_sparse::rng::splitmix(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_i64(&mut self, id: i64) {
        self.0 = id as u64;
    }
}

type IdMap<V> = HashMap<i64, V, BuildHasherDefault<IdHasher>>;

/// Every column's raw id → contiguous id, built by [`Vocabulary::build`].
#[derive(Clone, Debug)]
pub struct Vocabulary {
    ids: Vec<IdMap<u32>>,
    info: VocabularyInfo,
}

/// The count and first line of one id.
#[derive(Clone, Copy)]
struct Seen {
    count: u64,
    first: u64,
}

/// Counts of the ids of one partition, per column.
struct Counts(Vec<IdMap<Seen>>);

impl Counts {
    fn new() -> Self {
        Self((0..NUM_CAT).map(|_| IdMap::default()).collect())
    }

    fn add(&mut self, column: usize, id: i64, line: u64) {
        let seen = (self.0[column].entry(id)).or_insert(Seen {
            count: 0,
            first: line,
        });
        seen.count += 1;
    }

    /// Moves the ids seen at least `threshold` times, with their first line,
    /// into `frequent`, and counts the distinct ids into `distinct`.
    fn drain(&mut self, threshold: u64, frequent: &mut [Vec<(u64, i64)>], distinct: &mut [u64]) {
        for (column, ids) in self.0.iter_mut().enumerate() {
            distinct[column] += ids.len() as u64;
            for (id, seen) in ids.drain() {
                if seen.count >= threshold {
                    frequent[column].push((seen.first, id));
                }
            }
        }
    }
}

/// The id of a column, as TorchRec counts it (missing is 0).
fn raw(record: &CriteoRecord, column: usize) -> i64 {
    record.cats[column].unwrap_or(0)
}

impl Vocabulary {
    /// The first pass: counts every column's ids over `inputs` (spilling to
    /// partition files in `spill_dir`, removed before it returns) and
    /// numbers the frequent ones. Malformed lines are skipped, or an error
    /// under `strict`, as ingestion does; `progress` gets the input bytes
    /// read.
    pub fn build(
        inputs: &[PathBuf],
        spill_dir: &Path,
        options: &VocabularyOptions,
        strict: bool,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Self, DataError> {
        let partitions = match options.partitions {
            Some(p) => p.clamp(1, MAX_PARTITIONS),
            None => partitions_for(inputs, options.count_memory)?,
        };
        // 0 and 1 both number every id.
        let threshold = options.threshold.max(1);
        let mut frequent: Vec<Vec<(u64, i64)>> = vec![Vec::new(); NUM_CAT];
        let mut distinct = vec![0u64; NUM_CAT];
        let mut counts = Counts::new();
        let mut line = 0u64;
        let mut rows = 0u64;
        let mut done = 0u64;
        // A spill a killed run left is stale whether or not this one spills.
        if spill_dir.exists() {
            std::fs::remove_dir_all(spill_dir).map_err(DataError::io(spill_dir))?;
        }
        let mut spill = match partitions {
            1 => None,
            n => Some(Spill::create(spill_dir, n)?),
        };
        for input in inputs {
            let (_, bytes) = read_records(
                input,
                strict,
                |_, parsed| {
                    line += 1;
                    let Ok(record) = parsed else { return Ok(()) };
                    rows += 1;
                    for column in 0..NUM_CAT {
                        let id = raw(record, column);
                        match &mut spill {
                            None => counts.add(column, id, line),
                            Some(s) => s.push(column, id, line)?,
                        }
                    }
                    Ok(())
                },
                &mut |b| progress(done + b),
            )?;
            done += bytes;
        }
        match spill {
            None => counts.drain(threshold, &mut frequent, &mut distinct),
            Some(spill) => {
                let (_dir, parts) = spill.finish()?;
                for part in parts {
                    read_part(&part, &mut |c, id, line| counts.add(c, id, line))?;
                    counts.drain(threshold, &mut frequent, &mut distinct);
                    // Free the disk as the counting goes.
                    std::fs::remove_file(&part).map_err(DataError::io(&part))?;
                }
            }
        }
        let mut fingerprint = threshold;
        let mut ids = Vec::with_capacity(NUM_CAT);
        let mut sizes = Vec::with_capacity(NUM_CAT);
        for column in &mut frequent {
            // Lines are unique within a column: the first appearance orders them.
            let mut column = std::mem::take(column);
            column.sort_unstable_by_key(|&(first, _)| first);
            let mut map = IdMap::with_capacity_and_hasher(column.len(), Default::default());
            for (k, &(_, id)) in column.iter().enumerate() {
                map.insert(id, k as u32);
                fingerprint = ember_sparse::rng::splitmix(fingerprint ^ id as u64);
            }
            fingerprint = ember_sparse::rng::splitmix(fingerprint ^ column.len() as u64);
            sizes.push(FIRST_ID as u64 + column.len() as u64);
            ids.push(map);
        }
        let info = VocabularyInfo {
            frequency_threshold: threshold,
            num_embeddings_per_feature: sizes,
            distinct_ids: distinct,
            rows,
            bytes_read: done,
            inputs: inputs.to_vec(),
            partitions,
            stamp: VocabularyStamp {
                frequency_threshold: threshold,
                fingerprint,
            },
        };
        Ok(Self { ids, info })
    }

    /// The table sizes and how they were made.
    pub fn info(&self) -> &VocabularyInfo {
        &self.info
    }

    /// The contiguous id of `column`'s raw id (`None`: missing, as id 0).
    pub fn id(&self, column: usize, raw_id: Option<i64>) -> i64 {
        match self.ids[column].get(&raw_id.unwrap_or(0)) {
            Some(&k) => FIRST_ID + k as i64,
            None => RARE_ID,
        }
    }

    /// Replaces `record`'s categorical ids by their contiguous ids (missing
    /// ones included: every id is present after it).
    pub fn apply(&self, record: &mut CriteoRecord) {
        for column in 0..NUM_CAT {
            record.cats[column] = Some(self.id(column, record.cats[column]));
        }
    }

    /// Writes `dir/_vocabulary/cat_i.parquet` (each column's raw ids in
    /// contiguous order: row `k` is contiguous id `k + 2`) and then
    /// `dir/_vocabulary.json`, each file atomically.
    pub fn write(&self, dir: &Path) -> Result<(), DataError> {
        let tables = dir.join(VOCABULARY_DIR);
        std::fs::create_dir_all(&tables).map_err(DataError::io(&tables))?;
        let schema = Arc::new(Schema::new(vec![
            Field::new("raw_id", DataType::Int64, false),
            Field::new("id", DataType::Int64, false),
        ]));
        for (column, map) in self.ids.iter().enumerate() {
            let mut raw_ids = vec![0i64; map.len()];
            for (&id, &k) in map {
                raw_ids[k as usize] = id;
            }
            let contiguous: Int64Array = (0..map.len() as i64).map(|k| k + FIRST_ID).collect();
            let batch = RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(Int64Array::from(raw_ids)), Arc::new(contiguous)],
            )
            .expect("two int64 columns of one length");
            let path = tables.join(format!("{}.parquet", cat_column(column)));
            let mut file = AtomicParquet::create(&path, schema.clone())?;
            file.write(&batch)?;
            file.finish()?;
        }
        let json = serde_json::to_vec_pretty(&self.info).expect("a vocabulary serialises");
        write_atomic(&dir.join(VOCABULARY_FILE), &json)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// TorchRec's loops, transcribed: `rows` of every file in order, per
    /// column (missing as 0).
    fn reference(files: &[Vec<[Option<i64>; 3]>], threshold: u64) -> Vec<Vec<[i64; 3]>> {
        let mut out: Vec<Vec<[i64; 3]>> = files.iter().map(|f| vec![[0; 3]; f.len()]).collect();
        for col in 0..3 {
            let id = |r: &[Option<i64>; 3]| r[col].unwrap_or(0);
            let mut freq = HashMap::new();
            for r in files.iter().flatten() {
                *freq.entry(id(r)).or_insert(0u64) += 1;
            }
            let (mut next, mut map) = (2, HashMap::new());
            for (f, file) in files.iter().enumerate() {
                for (i, r) in file.iter().enumerate() {
                    let v = *map.entry(id(r)).or_insert_with(|| {
                        if threshold > 1 && freq[&id(r)] < threshold {
                            1
                        } else {
                            next += 1;
                            next - 1
                        }
                    });
                    out[f][i][col] = v;
                }
            }
        }
        out
    }

    /// A Criteo line with the first three categorical fields from `r`
    /// (hexadecimal, empty when missing) and the rest fixed.
    fn line(r: &[Option<i64>; 3]) -> String {
        let mut fields = vec!["1".to_string(); 1 + 13];
        fields.extend(
            r.iter()
                .map(|c| c.map_or(String::new(), |c| format!("{c:x}"))),
        );
        fields.extend((3..NUM_CAT).map(|_| "ab".to_string()));
        fields.join("\t") + "\n"
    }

    fn check(files: &[Vec<[Option<i64>; 3]>], threshold: u64, partitions: usize) {
        let dir = tempfile::tempdir().unwrap();
        let inputs: Vec<PathBuf> = files
            .iter()
            .enumerate()
            .map(|(k, rows)| {
                let path = dir.path().join(format!("day_{k}"));
                std::fs::write(&path, rows.iter().map(line).collect::<String>()).unwrap();
                path
            })
            .collect();
        let options = VocabularyOptions {
            partitions: Some(partitions),
            ..VocabularyOptions::new(threshold)
        };
        let spill = dir.path().join("spill");
        let v = Vocabulary::build(&inputs, &spill, &options, true, &mut |_| {}).unwrap();
        assert!(!spill.exists(), "the spill files are removed");
        let want = reference(files, threshold);
        for (f, rows) in files.iter().enumerate() {
            for (i, r) in rows.iter().enumerate() {
                let got: [i64; 3] = std::array::from_fn(|c| v.id(c, r[c]));
                assert_eq!(got, want[f][i], "file {f} row {i}");
            }
        }
        for c in 0..3 {
            let max = want.iter().flatten().map(|r| r[c]).max().unwrap_or(1);
            assert_eq!(
                v.info().num_embeddings_per_feature[c],
                max.max(1) as u64 + 1
            );
        }
        // The fixed columns: one frequent id each (or rare under a threshold
        // above the rows).
        let rows = files.iter().map(Vec::len).sum::<usize>() as u64;
        let one = if rows == 0 || threshold > rows { 2 } else { 3 };
        assert_eq!(v.info().num_embeddings_per_feature[NUM_CAT - 1], one);
        assert_eq!(v.info().rows, rows);
    }

    #[test]
    fn torchrecs_docstring_example() {
        // sparse_to_contiguous's docstring, threshold 2: abc iop / iop lkj
        // in column 0, xyz xyz / tuv xyz in column 1.
        let (abc, iop, lkj, xyz, tuv) = (0xabc, 0x10f, 0x1c7, 0x7e, 0x70);
        let files = vec![
            vec![[Some(abc), Some(xyz), None], [Some(iop), Some(xyz), None]],
            vec![[Some(iop), Some(tuv), None], [Some(lkj), Some(xyz), None]],
        ];
        check(&files, 2, 1);
        assert_eq!(reference(&files, 2)[0][0][..2], [1, 2]);
        assert_eq!(reference(&files, 2)[1][0][..2], [2, 1]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn numbers_ids_as_torchrec_does(
            files in prop::collection::vec(
                prop::collection::vec(
                    prop::array::uniform3(prop::option::weighted(0.9, 0i64..40)), 0..60),
                1..4),
            threshold in 0u64..5,
            partitions in 1usize..5,
        ) {
            check(&files, threshold, partitions);
        }
    }

    #[test]
    fn a_failed_count_removes_its_spill() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("day_0");
        std::fs::write(&input, line(&[Some(1), None, Some(2)]) + "bad\n").unwrap();
        let spill = dir.path().join("spill");
        let options = VocabularyOptions {
            partitions: Some(3),
            ..VocabularyOptions::new(2)
        };
        let err = Vocabulary::build(&[input], &spill, &options, true, &mut |_| {}).unwrap_err();
        assert!(err.to_string().contains("day_0:2"), "{err}");
        assert!(!spill.exists());
    }
}
