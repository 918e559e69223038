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
//! partition files, and the ids are counted one partition at a time. What
//! is held at the end is the frequent ids only, which the tables need
//! anyway. One partition is counted in memory without a spill.

use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use serde::{Deserialize, Serialize};

use crate::atomic::write_atomic;
use crate::criteo::CriteoRecord;
use crate::ingest::{read_records, InputStamp};
use crate::schema::{cat_column, NUM_CAT};
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

/// Bytes of memory one distinct id takes while counted (the map's entry,
/// its control byte and spare room).
const COUNT_BYTES_PER_ID: u64 = 40;

/// How a vocabulary is built.
#[derive(Clone, Debug)]
pub struct VocabularyOptions {
    /// Ids seen fewer times than this over all inputs map to
    /// [`RARE_ID`] (TorchRec's `frequency_threshold`; 0 and 1: none do).
    pub threshold: u64,
    /// Memory the counting of one partition may take; the number of
    /// partitions follows from the inputs' size.
    pub count_memory: u64,
    /// The number of partitions, instead of one from `count_memory` (for
    /// tests and tuning).
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
    fn drain(
        &mut self,
        threshold: u64,
        frequent: &mut [Vec<(u64, i64, u64)>],
        distinct: &mut [u64],
    ) {
        for (column, ids) in self.0.iter_mut().enumerate() {
            distinct[column] += ids.len() as u64;
            for (id, seen) in ids.drain() {
                if seen.count >= threshold {
                    frequent[column].push((seen.first, id, seen.count));
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
            Some(p) => p.max(1),
            None => partitions_for(inputs, options.count_memory)?,
        };
        let threshold = options.threshold.max(1);
        let mut frequent: Vec<Vec<(u64, i64, u64)>> = vec![Vec::new(); NUM_CAT];
        let mut distinct = vec![0u64; NUM_CAT];
        let mut counts = Counts::new();
        let mut line = 0u64;
        let mut rows = 0u64;
        let mut done = 0u64;
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
                    read_part(&part, &mut |column, id, line| counts.add(column, id, line))?;
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
            column.sort_unstable_by_key(|&(first, _, _)| first);
            let mut map = IdMap::with_capacity_and_hasher(column.len(), Default::default());
            for (k, &(_, id, _)) in column.iter().enumerate() {
                map.insert(id, k as u32);
                fingerprint = ember_sparse::rng::splitmix(fingerprint ^ id as u64);
            }
            fingerprint = ember_sparse::rng::splitmix(fingerprint ^ column.len() as u64);
            sizes.push(FIRST_ID as u64 + column.len() as u64);
            ids.push(map);
        }
        let info = VocabularyInfo {
            frequency_threshold: options.threshold,
            num_embeddings_per_feature: sizes,
            distinct_ids: distinct,
            rows,
            bytes_read: done,
            inputs: inputs.to_vec(),
            partitions,
            stamp: VocabularyStamp {
                frequency_threshold: options.threshold,
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

/// Enough partitions that one partition's distinct ids fit `memory`,
/// taking every id of the inputs as distinct (a gzip input as four times
/// its size) and a Criteo line as about 10 bytes per id.
fn partitions_for(inputs: &[PathBuf], memory: u64) -> Result<usize, DataError> {
    let mut ids = 0u64;
    for input in inputs {
        let bytes = InputStamp::of(input)?.bytes;
        let mut magic = [0u8; 2];
        let gzip = File::open(input)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
            && magic == [0x1f, 0x8b];
        ids += bytes * if gzip { 4 } else { 1 } / 10;
    }
    Ok((ids * COUNT_BYTES_PER_ID)
        .div_ceil(memory.max(1))
        .clamp(1, 256) as usize)
}

/// The partition files of the first pass: `(column, id, line)` records,
/// written in line order, each id to the partition of its hash.
struct Spill {
    dir: SpillDir,
    files: Vec<BufWriter<File>>,
    last_line: Vec<u64>,
}

/// The spill directory, removed when dropped (on success and on every failure).
struct SpillDir(PathBuf);

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Spill {
    fn create(dir: &Path, partitions: usize) -> Result<Self, DataError> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(DataError::io(dir))?;
        let guard = SpillDir(dir.to_path_buf());
        let files = (0..partitions)
            .map(|p| {
                let path = dir.join(format!("part-{p}"));
                File::create(&path)
                    .map(|f| BufWriter::with_capacity(1 << 16, f))
                    .map_err(DataError::io(&path))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            dir: guard,
            files,
            last_line: vec![0; partitions],
        })
    }

    fn path(&self, p: usize) -> PathBuf {
        self.dir.0.join(format!("part-{p}"))
    }

    /// A record: the column (one byte), the id and the line's distance from
    /// the partition's last record, both as LEB128 varints (a Criteo id
    /// takes 5 bytes, the distance one).
    fn push(&mut self, column: usize, id: i64, line: u64) -> Result<(), DataError> {
        let p = (ember_sparse::rng::splitmix(id as u64) % self.files.len() as u64) as usize;
        let mut record = [0u8; MAX_RECORD];
        record[0] = column as u8;
        let mut n = 1 + leb128(id as u64, &mut record[1..]);
        n += leb128(line - self.last_line[p], &mut record[n..]);
        self.last_line[p] = line;
        let path = self.path(p);
        self.files[p]
            .write_all(&record[..n])
            .map_err(DataError::io(&path))
    }

    /// Flushes every partition; returns the directory's guard and the files.
    fn finish(mut self) -> Result<(SpillDir, Vec<PathBuf>), DataError> {
        for p in 0..self.files.len() {
            let path = self.path(p);
            self.files[p].flush().map_err(DataError::io(&path))?;
        }
        let parts = (0..self.files.len()).map(|p| self.path(p)).collect();
        Ok((self.dir, parts))
    }
}

/// Hands each record of a partition file to `each`, in the order written.
fn read_part(path: &Path, each: &mut dyn FnMut(usize, i64, u64)) -> Result<(), DataError> {
    let mut file = File::open(path).map_err(DataError::io(path))?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut have, mut line) = (0usize, 0u64);
    loop {
        let n = file.read(&mut buf[have..]).map_err(DataError::io(path))?;
        have += n;
        let mut at = 0;
        // Whole records only, unless the file has ended.
        while at < have && (n == 0 || have - at >= MAX_RECORD) {
            let column = buf[at] as usize;
            at += 1;
            let id = leb128_read(&buf[..have], &mut at, path)?;
            line += leb128_read(&buf[..have], &mut at, path)?;
            each(column, id as i64, line);
        }
        buf.copy_within(at..have, 0);
        have -= at;
        if n == 0 {
            return Ok(());
        }
    }
}

/// The longest record: a column byte and two 10-byte varints.
const MAX_RECORD: usize = 21;

fn leb128(mut v: u64, out: &mut [u8]) -> usize {
    let mut n = 0;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out[n] = byte;
            return n + 1;
        }
        out[n] = byte | 0x80;
        n += 1;
    }
}

fn leb128_read(bytes: &[u8], at: &mut usize, path: &Path) -> Result<u64, DataError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let Some(&byte) = bytes.get(*at) else { break };
        *at += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(DataError::Vocabulary(format!(
        "{}: a spill file ends mid-record (was it changed while counting?)",
        path.display()
    )))
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

    #[test]
    fn varints_round_trip() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = [0u8; MAX_RECORD];
            let n = leb128(v, &mut out);
            let mut at = 0;
            assert_eq!(leb128_read(&out[..n], &mut at, Path::new("x")).unwrap(), v);
            assert_eq!(at, n);
            assert!(leb128_read(&out[..n - 1], &mut 0, Path::new("x")).is_err() || n == 1);
        }
    }
}
