//! Property-based fuzzing of the parsers of outside input: the Criteo line
//! parser and the Parquet reader on mutated files. Each case asserts no
//! panic, and either a clean error or the result a reference gives.
//!
//! CI runs a few hundred cases; `EMBER_FUZZ_CASES=N` runs N per test (the
//! CHANGELOG reports a long run).

use std::path::Path;
use std::sync::OnceLock;

use ember_dataloader::criteo::{parse_line, CriteoRecord};
use ember_dataloader::schema::{NUM_CAT, NUM_INT};
use ember_dataloader::writer::{Bag, Codec, CriteoBatchBuilder, ParquetSink, SinkOptions};
use ember_dataloader::{Loader, LoaderConfig};
use ember_sparse::EmbeddingBagConfig;
use proptest::prelude::*;

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("EMBER_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    ProptestConfig::with_cases(n.unwrap_or(default))
}

/// One field of a line as a generator writes it: valid, empty, or garbage.
fn field(valid: impl Strategy<Value = String>) -> impl Strategy<Value = String> {
    prop_oneof![
        6 => valid,
        1 => Just(String::new()),
        1 => "[ -~]{0,12}",
    ]
}

/// What the parser must make of a line: the record, or `None` (rejected),
/// by the format's definition written out plainly.
fn reference(fields: &[String]) -> Option<CriteoRecord> {
    if fields.len() != 1 + NUM_INT + NUM_CAT {
        return None;
    }
    let mut r = CriteoRecord {
        label: match fields[0].as_str() {
            "0" => 0,
            "1" => 1,
            _ => return None,
        },
        ..Default::default()
    };
    for i in 0..NUM_INT {
        let f = &fields[1 + i];
        let digits = f.strip_prefix('-').unwrap_or(f);
        let ok =
            !digits.is_empty() && digits.len() <= 10 && digits.bytes().all(|b| b.is_ascii_digit());
        r.ints[i] = match (f.is_empty(), ok) {
            (true, _) => None,
            (false, true) => Some(f.parse::<i32>().ok()?),
            (false, false) => return None,
        };
    }
    for i in 0..NUM_CAT {
        let f = &fields[1 + NUM_INT + i];
        r.cats[i] = match f.is_empty() {
            true => None,
            false if f.len() <= 16 && f.bytes().all(|b| b.is_ascii_hexdigit()) => {
                let v = u64::from_str_radix(f, 16).ok()?;
                Some(i64::try_from(v).ok()?)
            }
            false => return None,
        };
    }
    Some(r)
}

proptest! {
    #![proptest_config(cases(512))]

    #[test]
    fn any_bytes_parse_or_are_rejected(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let mut r = CriteoRecord::default();
        let _ = parse_line(&bytes, &mut r);
    }

    #[test]
    fn lines_parse_as_the_format_defines(
        label in field("[01]".prop_map(String::from)),
        ints in proptest::collection::vec(field(any::<i64>().prop_map(|v| (v >> (v & 31)).to_string())), NUM_INT),
        cats in proptest::collection::vec(field(any::<u64>().prop_map(|v| format!("{:x}", v >> (v & 15)))), NUM_CAT),
        drop_one in any::<bool>(),
    ) {
        let mut fields: Vec<String> = std::iter::once(label).chain(ints).chain(cats).collect();
        if drop_one {
            fields.pop();
        }
        let text = fields.join("\t");
        let mut got = CriteoRecord::default();
        let parsed = parse_line(text.as_bytes(), &mut got).ok().map(|()| got);
        // A garbage field with a tab in it changes the field count: the
        // reference splits the text the same way the format does.
        let split: Vec<String> = text.split('\t').map(String::from).collect();
        prop_assert_eq!(parsed, reference(&split));
    }
}

/// The bytes of a small Criteo-schema Parquet file (3 row groups, zstd),
/// made once.
fn fixture() -> &'static [u8] {
    static FIXTURE: OnceLock<Vec<u8>> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let dir = dir.path();
        let mut builder = CriteoBatchBuilder::new(&[false; NUM_CAT]);
        let opts = SinkOptions {
            rows_per_file: None,
            row_group_size: 20,
            compression: Codec::Zstd,
        };
        let mut sink = ParquetSink::new(dir, "f", builder.schema().clone(), opts);
        for r in 0..60 {
            let ints: [Option<i32>; NUM_INT] =
                std::array::from_fn(|i| (r % 7 != i).then_some((r * i) as i32));
            builder.push_row((r % 2) as i8, &ints, |i| match (r + i) % 5 {
                0 => Bag::Missing,
                k => Bag::One((r * 31 + k) as i64),
            });
        }
        sink.write(&builder.finish()).unwrap();
        let (files, _) = sink.finish().unwrap();
        std::fs::read(&files[0]).unwrap()
    })
}

fn config() -> LoaderConfig {
    let tables: Vec<EmbeddingBagConfig> = (0..NUM_CAT)
        .map(|i| EmbeddingBagConfig::new(&format!("t{i}"), 100, 4, &[&format!("cat_{i}")]))
        .collect();
    LoaderConfig::criteo(16, &tables)
}

/// Reads every batch; the first error.
fn read_all(path: &Path) -> Result<(), String> {
    let loader = Loader::open(&[path.to_path_buf()], config()).map_err(|e| e.to_string())?;
    for batch in loader.epoch(0, 0) {
        batch.map_err(|e| e.to_string())?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(128))]

    /// Flipped bytes anywhere (data pages, page headers, the footer) or a
    /// cut: no panic, and an error names the file. (Rows may come back
    /// changed: the parquet crate writes no page checksums, so a flip
    /// inside a page that still decodes is not seen; files with checksums
    /// are verified, see tests/workflow.rs.)
    #[test]
    fn mutated_parquet_is_refused_by_name_or_read(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..6),
        cut in proptest::option::weighted(0.2, any::<prop::sample::Index>()),
        in_footer in any::<bool>(),
    ) {
        let mut bytes = fixture().to_vec();
        // Half the cases hit the footer (the last 2 KiB), where a flip is
        // most likely to reach the metadata parser.
        let (start, len) = match in_footer {
            true => (bytes.len().saturating_sub(2048), bytes.len().min(2048)),
            false => (0, bytes.len()),
        };
        for (at, x) in flips {
            bytes[start + at.index(len)] ^= x;
        }
        if let Some(c) = cut {
            bytes.truncate(c.index(bytes.len()));
        }
        let flips_are_none = bytes == fixture();
        let dir = tempfile::tempdir().unwrap();
        let mutated = dir.path().join("m.parquet");
        std::fs::write(&mutated, &bytes).unwrap();
        // The set's marker, so the cases reach the reader.
        std::fs::write(dir.path().join("_f.ingest.json"), r#"{"files": ["m.parquet"]}"#).unwrap();
        let got = std::panic::catch_unwind(|| read_all(&mutated));
        if flips_are_none {
            prop_assert!(matches!(got, Ok(Ok(()))));
        }
        prop_assert!(got.is_ok(), "the reader panicked");
        if let Err(message) = got.unwrap() {
            prop_assert!(message.contains("m.parquet"), "{}", message);
        }
    }
}

/// The fixture with its footer rewritten by `edit` on every column chunk:
/// corruptions a mutation once found to panic inside the parquet crate.
fn with_footer(
    edit: impl Fn(
        parquet::file::metadata::ColumnChunkMetaDataBuilder,
    ) -> parquet::file::metadata::ColumnChunkMetaDataBuilder,
) -> Vec<u8> {
    use parquet::file::metadata::{ParquetMetaDataReader, ParquetMetaDataWriter};
    let bytes = fixture();
    let footer = u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap());
    let data_end = bytes.len() - 8 - footer as usize;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("good.parquet");
    std::fs::write(&path, bytes).unwrap();
    let file = std::fs::File::open(&path).unwrap();
    let meta = ParquetMetaDataReader::new()
        .parse_and_finish(&file)
        .unwrap();
    let groups = (meta.row_groups().iter())
        .map(|rg| {
            let columns = (rg.columns().iter())
                .map(|c| edit(c.clone().into_builder()).build().unwrap())
                .collect();
            rg.clone()
                .into_builder()
                .set_column_metadata(columns)
                .build()
                .unwrap()
        })
        .collect();
    let meta = meta.into_builder().set_row_groups(groups).build();
    let mut out = bytes[..data_end].to_vec();
    ParquetMetaDataWriter::new(&mut out, &meta)
        .finish()
        .unwrap();
    out
}

#[test]
fn corrupt_footers_that_once_panicked_are_errors_naming_the_file() {
    let negative_start =
        with_footer(|c| c.set_dictionary_page_offset(None).set_data_page_offset(-5));
    let no_dictionary = with_footer(|c| c.set_dictionary_page_offset(None));
    for (name, bytes) in [
        ("negative_start", negative_start),
        ("no_dictionary", no_dictionary),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{name}.parquet"));
        std::fs::write(&path, &bytes).unwrap();
        let marker = format!(r#"{{"files": ["{name}.parquet"]}}"#);
        std::fs::write(dir.path().join("_f.ingest.json"), marker).unwrap();
        let got = std::panic::catch_unwind(|| read_all(&path));
        let message = got.expect("no panic reaches the caller").unwrap_err();
        assert!(message.contains(&format!("{name}.parquet")), "{message}");
    }
}
