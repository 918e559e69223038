//! User histories on disk. [`ingest_sequences`] reads an interactions
//! table (Parquet, CSV, TSV, MovieLens' `ratings.dat` or SASRec's `user
//! item` lines), groups it by user, orders each user's interactions by
//! time (stable: file order among equal times) and writes one Parquet row
//! per user with list columns:
//!
//! | column       | type          | holds                                   |
//! |--------------|---------------|-----------------------------------------|
//! | `user`       | int64         | the user's id as the input wrote it     |
//! | `items`      | list\<int64\> | item ids, oldest first                  |
//! | `timestamps` | list\<int64\> | one per item (the line number if none)  |
//! | `actions`    | list\<int64\> | one per item; only when the input has them |
//!
//! [`read_histories`] reads that file back into [`UserHistory`]s.

use std::io::BufRead;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{Array, ArrayRef, Int64Array, RecordBatch, RecordBatchReader};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use serde::Serialize;

use crate::atomic::AtomicFile;
use crate::writer::{finish_parquet, Codec};
use crate::DataError;

/// One user's interactions in time order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserHistory {
    /// Item ids, oldest first.
    pub items: Vec<i64>,
    /// Seconds (or any non-decreasing clock), one per item.
    pub timestamps: Vec<i64>,
    /// The action on each item (a rating, an event type, a bit mask of
    /// events), one per item; empty when the data has none.
    pub actions: Vec<i64>,
}

impl UserHistory {
    /// The history without its last `n` items (leave-one-out: 1 for the
    /// validation input, 2 for training).
    pub fn without_last(&self, n: usize) -> UserHistory {
        let keep = self.items.len().saturating_sub(n);
        UserHistory {
            items: self.items[..keep].to_vec(),
            timestamps: self.timestamps[..keep].to_vec(),
            actions: self.actions[..keep.min(self.actions.len())].to_vec(),
        }
    }

    /// What is wrong with the history, if anything: the column at fault
    /// and why (a timestamp an item, no actions or one an item, no
    /// negative item, time order).
    pub fn fault(&self) -> Option<(&'static str, String)> {
        let (items, timestamps, actions) = (&self.items, &self.timestamps, &self.actions);
        if timestamps.len() != items.len() {
            let m = format!("{} timestamps for {} items", timestamps.len(), items.len());
            return Some(("timestamps", m));
        }
        if !actions.is_empty() && actions.len() != items.len() {
            let m = format!("{} actions for {} items", actions.len(), items.len());
            return Some(("actions", m));
        }
        if let Some(i) = items.iter().position(|&i| i < 0) {
            return Some(("items", format!("item {} is negative", items[i])));
        }
        if let Some(t) = timestamps.windows(2).position(|w| w[1] < w[0]) {
            return Some(("timestamps", format!("not in time order at item {}", t + 1)));
        }
        None
    }
}

/// How an interactions file is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum InteractionFormat {
    /// Parquet with integer columns `user`, `item` and optionally
    /// `timestamp` and `action` (or the names CSV headers may use).
    Parquet,
    /// Comma-separated `user,item[,timestamp][,action]`, with or without a
    /// header line naming the columns.
    Csv,
    /// The same, tab-separated.
    Tsv,
    /// MovieLens' `ratings.dat`: `user::item::rating::timestamp`; the
    /// rating is the action.
    MovieLens,
    /// SASRec's published files: `user item` a line, whitespace-separated,
    /// each user's lines in time order (the line number is the time).
    UserItem,
}

impl InteractionFormat {
    /// The format a file's extension implies: `.parquet`, `.csv`, `.tsv`,
    /// `.dat` (MovieLens) or `.txt` (`user item`).
    pub fn of_path(path: &Path) -> Option<Self> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        Some(match ext.as_str() {
            "parquet" => Self::Parquet,
            "csv" => Self::Csv,
            "tsv" => Self::Tsv,
            "dat" => Self::MovieLens,
            "txt" => Self::UserItem,
            _ => return None,
        })
    }
}

impl FromStr for InteractionFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "parquet" => Self::Parquet,
            "csv" => Self::Csv,
            "tsv" => Self::Tsv,
            "movielens" => Self::MovieLens,
            "user-item" => Self::UserItem,
            _ => {
                return Err(format!(
                    "'{s}': expected parquet, csv, tsv, movielens or user-item"
                ))
            }
        })
    }
}

/// What [`ingest_sequences`] does.
#[derive(Clone, Debug)]
pub struct SequenceIngestOptions {
    /// The input's format (`None`: from its extension).
    pub format: Option<InteractionFormat>,
    /// Keep the input's action (or rating) column, when it has one.
    pub actions: bool,
    /// Users per Parquet row group.
    pub row_group_size: usize,
    /// The output's compression.
    pub compression: Codec,
}

impl Default for SequenceIngestOptions {
    fn default() -> Self {
        Self {
            format: None,
            actions: true,
            row_group_size: 65536,
            compression: Codec::Zstd,
        }
    }
}

/// What an ingest of interactions read and wrote.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SequenceIngestSummary {
    /// The format the input was read as.
    pub format: InteractionFormat,
    /// Interactions read.
    pub interactions: u64,
    /// Users written (rows of the output).
    pub users: u64,
    /// Distinct items.
    pub items: u64,
    /// The largest item id (a table of `max_item + 1` rows holds them all).
    pub max_item: i64,
    /// The longest history.
    pub max_len: u64,
    /// The input had a time column (else line numbers stand in).
    pub timestamps: bool,
    /// The output has an `actions` column.
    pub actions: bool,
}

/// Interactions in file order.
#[derive(Default)]
struct Interactions {
    rows: Vec<Interaction>,
    timestamps: bool,
    actions: bool,
}

#[derive(Clone, Copy)]
struct Interaction {
    user: i64,
    time: i64,
    item: i64,
    action: i64,
}

/// Reads the interactions in `input`, groups them by user (users in id
/// order, each user's items by time, file order among equal times) and
/// writes them to `output` as one Parquet row per user (the module's
/// schema), atomically. `progress` hears the input bytes (Parquet: rows)
/// read so far. Errors name the file, and the line or column.
pub fn ingest_sequences(
    input: &Path,
    output: &Path,
    options: &SequenceIngestOptions,
    progress: &mut dyn FnMut(u64),
) -> Result<SequenceIngestSummary, DataError> {
    let format =
        match options.format.or_else(|| InteractionFormat::of_path(input)) {
            Some(f) => f,
            None => return Err(DataError::Option {
                option: "--format",
                value: input.display().to_string(),
                expected:
                    "the extension says nothing (.parquet, .csv, .tsv, .dat, .txt): name the format"
                        .into(),
            }),
        };
    let read = match format {
        InteractionFormat::Parquet => read_parquet_interactions(input, options.actions, progress)?,
        text => read_text_interactions(input, text, options.actions, progress)?,
    };
    if read.rows.is_empty() {
        return Err(DataError::NoInteractions {
            path: input.to_path_buf(),
        });
    }
    let interactions = read.rows.len() as u64;
    let (users, histories) = group_by_user(read.rows, read.actions);
    let mut distinct: Vec<i64> = histories
        .iter()
        .flat_map(|h| h.items.iter().copied())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    let summary = SequenceIngestSummary {
        format,
        interactions,
        users: users.len() as u64,
        items: distinct.len() as u64,
        max_item: distinct.last().copied().unwrap_or(0),
        max_len: histories
            .iter()
            .map(|h| h.items.len() as u64)
            .max()
            .unwrap_or(0),
        timestamps: read.timestamps,
        actions: read.actions,
    };
    write_histories(&histories, Some(&users), output, options)?;
    Ok(summary)
}

/// Users in id order and their histories, each sorted by time (stably).
fn group_by_user(mut rows: Vec<Interaction>, actions: bool) -> (Vec<i64>, Vec<UserHistory>) {
    rows.sort_by_key(|r| (r.user, r.time));
    let (mut users, mut histories) = (Vec::new(), Vec::<UserHistory>::new());
    for r in rows {
        if users.last() != Some(&r.user) {
            users.push(r.user);
            histories.push(UserHistory::default());
        }
        let h = histories.last_mut().expect("pushed above");
        h.items.push(r.item);
        h.timestamps.push(r.time);
        if actions {
            h.actions.push(r.action);
        }
    }
    (users, histories)
}

/// Which field of a line holds what (`None`: not there).
#[derive(Clone, Copy)]
struct Columns {
    user: usize,
    item: usize,
    time: Option<usize>,
    action: Option<usize>,
}

/// The column a header's name stands for (names as datasets spell them:
/// MovieLens' `userId,movieId,rating,timestamp`, Amazon's, RecBole's).
fn column_role(name: &str) -> Option<&'static str> {
    let n = name.trim().to_ascii_lowercase().replace(['_', ' '], "");
    let n = n.split(':').next().unwrap_or("");
    Some(match n {
        "user" | "userid" | "uid" => "user",
        "item" | "itemid" | "movieid" | "iid" | "asin" => "item",
        "timestamp" | "time" | "ts" | "unixtime" => "timestamp",
        "action" | "rating" | "event" | "eventtype" | "actionweights" => "action",
        _ => return None,
    })
}

/// The columns `names` hold; a missing one is `(its role, the message)`.
fn columns_of_header(names: &[&str]) -> Result<Columns, (&'static str, String)> {
    let find = |role| names.iter().position(|n| column_role(n) == Some(role));
    let need = |role: &'static str| {
        find(role).ok_or_else(|| {
            let names = names.join(", ");
            let m = format!("the header ({names}) has no {role} column (user, item, timestamp, action or their usual names)");
            (role, m)
        })
    };
    Ok(Columns {
        user: need("user")?,
        item: need("item")?,
        time: find("timestamp"),
        action: find("action"),
    })
}

fn read_text_interactions(
    path: &Path,
    format: InteractionFormat,
    actions: bool,
    progress: &mut dyn FnMut(u64),
) -> Result<Interactions, DataError> {
    let file = std::fs::File::open(path).map_err(DataError::io(path))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let split = |line: &str| -> Vec<String> {
        match format {
            InteractionFormat::Csv => line.split(',').map(str::to_string).collect(),
            InteractionFormat::Tsv => line.split('\t').map(str::to_string).collect(),
            InteractionFormat::MovieLens => line.split("::").map(str::to_string).collect(),
            _ => line.split_whitespace().map(str::to_string).collect(),
        }
    };
    let mut out = Interactions::default();
    let mut columns: Option<Columns> = match format {
        InteractionFormat::MovieLens => Some(Columns {
            user: 0,
            item: 1,
            action: Some(2),
            time: Some(3),
        }),
        InteractionFormat::UserItem => Some(Columns {
            user: 0,
            item: 1,
            time: None,
            action: None,
        }),
        _ => None,
    };
    let (mut line, mut number, mut bytes) = (String::new(), 0u64, 0u64);
    loop {
        line.clear();
        let n = reader.read_line(&mut line).map_err(DataError::io(path))?;
        if n == 0 {
            break;
        }
        number += 1;
        bytes += n as u64;
        if number % 65536 == 0 {
            progress(bytes);
        }
        let text = line.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        let bad = |message: String| DataError::BadLine {
            path: path.to_path_buf(),
            line: number,
            message,
        };
        let fields = split(text);
        if format == InteractionFormat::UserItem && fields.len() != 2 {
            let m = format!("'{text}' is not `user item` (two integers)");
            return Err(bad(m));
        }
        let cols = match columns {
            Some(c) if format == InteractionFormat::MovieLens && !actions => {
                Columns { action: None, ..c }
            }
            Some(c) => c,
            None => {
                // The first line: a header when its first field is not a number.
                if fields[0].trim().parse::<i64>().is_err() {
                    let names: Vec<&str> = fields.iter().map(String::as_str).collect();
                    let mut c = columns_of_header(&names).map_err(|(_, m)| bad(m))?;
                    c.action = c.action.filter(|_| actions);
                    columns = Some(c);
                    continue;
                }
                let c = Columns {
                    user: 0,
                    item: 1,
                    time: (fields.len() > 2).then_some(2),
                    action: (fields.len() > 3 && actions).then_some(3),
                };
                columns = Some(c);
                c
            }
        };
        out.timestamps = cols.time.is_some();
        out.actions = cols.action.is_some();
        let field = |at: usize, what: &str| -> Result<i64, DataError> {
            let f = fields.get(at).map(|f| f.trim()).ok_or_else(|| {
                bad(format!(
                    "no {what} column (field {} of a line with {})",
                    at + 1,
                    fields.len()
                ))
            })?;
            f.parse::<i64>().map_err(|_| {
                let hint = match what {
                    "action" => " (--no-actions leaves the column out)",
                    _ => "",
                };
                bad(format!("{what} '{f}' is not an integer{hint}"))
            })
        };
        let item = field(cols.item, "item")?;
        if item < 0 {
            return Err(bad(format!("item {item} is negative (ids are table rows)")));
        }
        out.rows.push(Interaction {
            user: field(cols.user, "user")?,
            item,
            time: match cols.time {
                Some(t) => field(t, "timestamp")?,
                None => number as i64,
            },
            action: match cols.action {
                Some(a) => field(a, "action")?,
                None => 0,
            },
        });
    }
    progress(bytes);
    Ok(out)
}

/// Column `name`'s values as i64 (any integer type; no nulls); `first`:
/// the file's row of the array's first value, for messages.
fn int_values(
    path: &Path,
    column: &str,
    array: &ArrayRef,
    first: usize,
) -> Result<Vec<i64>, DataError> {
    let bad = |message: String| DataError::column(path, column, message);
    if let Some(r) = (0..array.len()).find(|&r| array.is_null(r)) {
        return Err(bad(format!("row {}: null", first + r)));
    }
    use arrow_array::types::*;
    macro_rules! ints {
        ($($t:ty),*) => {
            $(if let Some(a) = array.as_primitive_opt::<$t>() {
                return (a.values().iter().enumerate())
                    .map(|(r, &v)| i64::try_from(v).map_err(|_| bad(format!("row {}: {v} does not fit an int64", first + r))))
                    .collect();
            })*
        };
    }
    ints!(Int64Type, Int32Type, Int16Type, Int8Type, UInt64Type, UInt32Type, UInt16Type, UInt8Type);
    let hint = match column_role(column) {
        Some("action") => " (--no-actions leaves the column out)",
        _ => "",
    };
    Err(bad(format!(
        "{} is not an integer type{hint}",
        array.data_type()
    )))
}

/// `path`'s record batches.
fn open_parquet(path: &Path) -> Result<ParquetRecordBatchReader, DataError> {
    let file = std::fs::File::open(path).map_err(DataError::io(path))?;
    ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(DataError::parquet(path))?
        .build()
        .map_err(DataError::parquet(path))
}

/// A record batch of `path` that could not be decoded.
fn unreadable(path: &Path, e: arrow_schema::ArrowError) -> DataError {
    DataError::Parquet {
        path: path.to_path_buf(),
        message: e.to_string(),
    }
}

fn read_parquet_interactions(
    path: &Path,
    actions: bool,
    progress: &mut dyn FnMut(u64),
) -> Result<Interactions, DataError> {
    let reader = open_parquet(path)?;
    let schema = reader.schema();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    let mut cols =
        columns_of_header(&names).map_err(|(role, m)| DataError::column(path, role, m))?;
    cols.action = cols.action.filter(|_| actions);
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let mut out = Interactions {
        timestamps: cols.time.is_some(),
        actions: cols.action.is_some(),
        ..Interactions::default()
    };
    for batch in reader {
        let batch = batch.map_err(|e| unreadable(path, e))?;
        let first = out.rows.len();
        let column = |at: usize| int_values(path, &names[at], batch.column(at), first);
        let users = column(cols.user)?;
        let items = column(cols.item)?;
        if let Some(row) = items.iter().position(|&i| i < 0) {
            let message = format!(
                "row {}: item {} is negative (ids are table rows)",
                out.rows.len() + row,
                items[row]
            );
            return Err(DataError::column(path, &names[cols.item], message));
        }
        let first = out.rows.len() as i64;
        let times = match cols.time {
            Some(t) => column(t)?,
            None => (first..first + users.len() as i64).collect(),
        };
        let actions = match cols.action {
            Some(a) => column(a)?,
            None => vec![0; users.len()],
        };
        for r in 0..users.len() {
            out.rows.push(Interaction {
                user: users[r],
                item: items[r],
                time: times[r],
                action: actions[r],
            });
        }
        progress(out.rows.len() as u64);
    }
    Ok(out)
}

fn list_column(lists: impl Iterator<Item = impl AsRef<[i64]>>) -> ArrayRef {
    let mut builder = ListBuilder::new(Int64Builder::new());
    for list in lists {
        builder.values().append_slice(list.as_ref());
        builder.append(true);
    }
    Arc::new(builder.finish())
}

/// Writes `histories` to `path` in the module's schema (user ids from
/// `users`, or 1, 2, ... when `None`), atomically; an `actions` column
/// when every history has its actions.
pub fn write_histories(
    histories: &[UserHistory],
    users: Option<&[i64]>,
    path: &Path,
    options: &SequenceIngestOptions,
) -> Result<(), DataError> {
    if let Some(u) = users.filter(|u| u.len() != histories.len()) {
        return Err(DataError::Option {
            option: "user ids",
            value: u.len().to_string(),
            expected: format!("one per history ({})", histories.len()),
        });
    }
    let with_actions = histories.iter().any(|h| !h.items.is_empty())
        && (histories.iter()).all(|h| h.actions.len() == h.items.len());
    let list = || DataType::List(Arc::new(Field::new("item", DataType::Int64, true)));
    let mut fields = vec![
        Field::new("user", DataType::Int64, false),
        Field::new("items", list(), false),
        Field::new("timestamps", list(), false),
    ];
    if with_actions {
        fields.push(Field::new("actions", list(), false));
    }
    let schema = Arc::new(Schema::new(fields));
    let mut out = AtomicFile::create(path)?;
    let props = WriterProperties::builder()
        .set_compression(options.compression.compression())
        .set_max_row_group_row_count(Some(options.row_group_size.max(1)))
        .build();
    let mut writer = ArrowWriter::try_new(out.take_file(), schema.clone(), Some(props))
        .map_err(DataError::parquet(out.temp()))?;
    for (c, chunk) in histories.chunks(options.row_group_size.max(1)).enumerate() {
        let from = c * options.row_group_size.max(1);
        let ids: Int64Array = match users {
            Some(u) => u[from..from + chunk.len()].to_vec().into(),
            None => (from as i64 + 1..=(from + chunk.len()) as i64).collect(),
        };
        let mut columns: Vec<ArrayRef> = vec![
            Arc::new(ids),
            list_column(chunk.iter().map(|h| &h.items)),
            list_column(chunk.iter().map(|h| &h.timestamps)),
        ];
        if with_actions {
            columns.push(list_column(chunk.iter().map(|h| &h.actions)));
        }
        let batch = RecordBatch::try_new(schema.clone(), columns)
            .expect("columns of the schema, one length");
        writer
            .write(&batch)
            .map_err(DataError::parquet(out.temp()))?;
    }
    let file = finish_parquet(writer, out.temp())?;
    out.commit_file(file).map(drop)
}

/// The histories of a file [`ingest_sequences`] (or [`write_histories`])
/// wrote, in its row order. An error names the file, the column and the
/// row.
pub fn read_histories(path: &Path) -> Result<Vec<UserHistory>, DataError> {
    let reader = open_parquet(path)?;
    let schema = reader.schema();
    let index = |name: &str| schema.index_of(name).ok();
    let missing = |name: &str| {
        DataError::column(
            path,
            name,
            "missing: not a user-history file (write one with `ember ingest sequences`)".into(),
        )
    };
    let items_at = index("items").ok_or_else(|| missing("items"))?;
    let times_at = index("timestamps").ok_or_else(|| missing("timestamps"))?;
    let actions_at = index("actions");
    let mut out = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| unreadable(path, e))?;
        let lists = |at: usize, name: &str| -> Result<Vec<Vec<i64>>, DataError> {
            let bad = |m: String| DataError::column(path, name, m);
            let list = (batch.column(at).as_list_opt::<i32>())
                .ok_or_else(|| bad(format!("{} is not a list", batch.column(at).data_type())))?;
            let values = (list.values().as_primitive_opt::<Int64Type>())
                .ok_or_else(|| bad("is not a list of int64".into()))?;
            if list.null_count() > 0 || values.null_count() > 0 {
                return Err(bad("holds nulls".into()));
            }
            let offsets = list.value_offsets();
            Ok((0..list.len())
                .map(|r| values.values()[offsets[r] as usize..offsets[r + 1] as usize].to_vec())
                .collect())
        };
        let items = lists(items_at, "items")?;
        let times = lists(times_at, "timestamps")?;
        let actions = match actions_at {
            Some(a) => lists(a, "actions")?,
            None => vec![Vec::new(); items.len()],
        };
        for ((items, timestamps), actions) in items.into_iter().zip(times).zip(actions) {
            let history = UserHistory {
                items,
                timestamps,
                actions,
            };
            if let Some((column, m)) = history.fault() {
                let row = out.len();
                return Err(DataError::column(path, column, format!("row {row}: {m}")));
            }
            out.push(history);
        }
    }
    Ok(out)
}

/// Reads SASRec's published data files: one `user item` pair of integers a
/// line (whitespace-separated), each user's lines in time order. Returns
/// the histories in order of the users' ids, with item ids as written and
/// each line's number as its time (the files have none). An error names
/// the file, the line and what is wrong.
pub fn read_user_item_file(path: &Path) -> Result<Vec<UserHistory>, DataError> {
    let read = read_text_interactions(path, InteractionFormat::UserItem, false, &mut |_| {})?;
    Ok(group_by_user(read.rows, false).1)
}

/// Writes histories as SASRec's `user item` lines (users numbered from 1
/// in order; items as they are, plus `item_offset`: 1 for SASRec's code,
/// whose item 0 is padding).
pub fn write_user_item_file(
    users: &[UserHistory],
    item_offset: i64,
    path: &Path,
) -> Result<(), DataError> {
    use std::io::Write;
    let mut file = AtomicFile::create(path)?;
    let mut out = std::io::BufWriter::new(file.file());
    for (u, history) in users.iter().enumerate() {
        for item in &history.items {
            writeln!(out, "{} {}", u + 1, item + item_offset).map_err(DataError::io(path))?;
        }
    }
    out.flush().map_err(DataError::io(path))?;
    drop(out);
    file.commit().map(drop)
}
