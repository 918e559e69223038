//! One line of a Criteo display-advertising file: a 0/1 label, 13 integer
//! features and 26 categorical features as hexadecimal ids, tab-separated;
//! an empty field is a missing value.

use std::fmt;

use serde::Serialize;

use crate::schema::{cat_column, int_column, NUM_CAT, NUM_INT};

/// Fields on a Criteo line: the label, [`NUM_INT`] integers and [`NUM_CAT`]
/// categorical ids.
pub const NUM_FIELDS: usize = 1 + NUM_INT + NUM_CAT;

/// One parsed line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CriteoRecord {
    /// The click label, 0 or 1.
    pub label: i8,
    /// Integer features `int_0..int_12`, raw; `None` where the field was empty.
    pub ints: [Option<i32>; NUM_INT],
    /// Categorical features `cat_0..cat_25`, the hexadecimal id parsed (no
    /// modulo); `None` where the field was empty.
    pub cats: [Option<i64>; NUM_CAT],
}

/// Why a line was rejected.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Reject {
    /// The line does not have [`NUM_FIELDS`] tab-separated fields.
    FieldCount {
        /// How many fields it has.
        found: usize,
    },
    /// The label is not `0` or `1`.
    Label {
        /// The label as written (long values cut to 40 characters).
        value: String,
    },
    /// An integer field is not a decimal 32-bit integer.
    Integer {
        /// Its column, `int_0..int_12`.
        column: String,
        /// The field as written (long values cut to 40 characters).
        value: String,
    },
    /// A categorical field is not a hexadecimal id below 2^63.
    Categorical {
        /// Its column, `cat_0..cat_25`.
        column: String,
        /// The field as written (long values cut to 40 characters).
        value: String,
    },
    /// The line is at least [`MAX_LINE_BYTES`](crate::ingest::MAX_LINE_BYTES)
    /// long (no Criteo line is); it is skipped without being held in memory.
    TooLong {
        /// The line's length in bytes, counting its newline.
        bytes: usize,
    },
}

impl Reject {
    /// The reason's name, as counted in the ingest summary.
    pub fn kind(&self) -> &'static str {
        match self {
            Reject::FieldCount { .. } => "field_count",
            Reject::Label { .. } => "label",
            Reject::Integer { .. } => "integer",
            Reject::Categorical { .. } => "categorical",
            Reject::TooLong { .. } => "too_long",
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reject::FieldCount { found } => {
                write!(f, "{found} tab-separated fields, expected {NUM_FIELDS}")
            }
            Reject::Label { value } => write!(f, "label '{value}' is not 0 or 1"),
            Reject::Integer { column, value } => {
                write!(f, "column {column}: '{value}' is not a 32-bit integer")
            }
            Reject::Categorical { column, value } => {
                write!(
                    f,
                    "column {column}: '{value}' is not a hexadecimal id below 2^63"
                )
            }
            Reject::TooLong { bytes } => {
                write!(f, "a line of {bytes} bytes is not a Criteo line")
            }
        }
    }
}

fn shown(field: &[u8]) -> String {
    // Long garbage is cut so one bad line cannot flood the report.
    let text = String::from_utf8_lossy(field);
    match text.char_indices().nth(40) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.into_owned(),
    }
}

/// Parses `line` (without its newline; a trailing `\r` is ignored) into `out`.
pub fn parse_line(line: &[u8], out: &mut CriteoRecord) -> Result<(), Reject> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let found = line.iter().filter(|&&b| b == b'\t').count() + 1;
    if found != NUM_FIELDS {
        return Err(Reject::FieldCount { found });
    }
    let mut fields = line.split(|&b| b == b'\t');
    let label = fields.next().unwrap_or_default();
    out.label = match label {
        b"0" => 0,
        b"1" => 1,
        _ => {
            return Err(Reject::Label {
                value: shown(label),
            })
        }
    };
    for (i, slot) in out.ints.iter_mut().enumerate() {
        let field = fields.next().unwrap_or_default();
        *slot = parse_int(field).map_err(|()| Reject::Integer {
            column: int_column(i),
            value: shown(field),
        })?;
    }
    for (i, slot) in out.cats.iter_mut().enumerate() {
        let field = fields.next().unwrap_or_default();
        *slot = parse_hex(field).map_err(|()| Reject::Categorical {
            column: cat_column(i),
            value: shown(field),
        })?;
    }
    Ok(())
}

/// A decimal i32, or `None` for an empty field.
fn parse_int(field: &[u8]) -> Result<Option<i32>, ()> {
    if field.is_empty() {
        return Ok(None);
    }
    let (negative, digits) = match field.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, field),
    };
    if digits.is_empty() || digits.len() > 10 {
        return Err(());
    }
    let mut v: i64 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return Err(());
        }
        v = v * 10 + (b - b'0') as i64;
    }
    let v = if negative { -v } else { v };
    i32::try_from(v).map(Some).map_err(|_| ())
}

/// A hexadecimal id below 2^63 (either case), or `None` for an empty field.
fn parse_hex(field: &[u8]) -> Result<Option<i64>, ()> {
    if field.is_empty() {
        return Ok(None);
    }
    if field.len() > 16 {
        return Err(());
    }
    let mut v: u64 = 0;
    for &b in field {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => return Err(()),
        };
        v = (v << 4) | d as u64;
    }
    i64::try_from(v).map(Some).map_err(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(label: &str, ints: &[&str], cats: &[&str]) -> String {
        let mut f = vec![label.to_string()];
        f.extend(ints.iter().map(|s| s.to_string()));
        f.extend(cats.iter().map(|s| s.to_string()));
        f.join("\t")
    }

    #[test]
    fn parses_values_and_missing_fields() {
        let mut ints = vec!["1"; NUM_INT];
        ints[1] = "";
        ints[2] = "-2";
        let mut cats = vec!["68fd1e64"; NUM_CAT];
        cats[3] = "";
        cats[4] = "FFFFFFFF";
        let mut r = CriteoRecord::default();
        parse_line(format!("{}\r", line("1", &ints, &cats)).as_bytes(), &mut r).unwrap();
        assert_eq!(r.label, 1);
        assert_eq!(r.ints[0], Some(1));
        assert_eq!(r.ints[1], None);
        assert_eq!(r.ints[2], Some(-2));
        assert_eq!(r.cats[0], Some(0x68fd1e64));
        assert_eq!(r.cats[3], None);
        assert_eq!(r.cats[4], Some(0xFFFF_FFFF));
    }

    #[test]
    fn names_what_is_wrong() {
        let ints = vec!["1"; NUM_INT];
        let cats = vec!["a"; NUM_CAT];
        let mut r = CriteoRecord::default();
        let err = |s: String| parse_line(s.as_bytes(), &mut CriteoRecord::default()).unwrap_err();
        assert_eq!(err("1\t2".into()), Reject::FieldCount { found: 2 });
        assert_eq!(
            err(line("2", &ints, &cats)),
            Reject::Label { value: "2".into() }
        );
        let mut bad = ints.clone();
        bad[5] = "x1";
        assert_eq!(
            err(line("0", &bad, &cats)),
            Reject::Integer {
                column: "int_5".into(),
                value: "x1".into()
            }
        );
        let mut bad = ints.clone();
        bad[0] = "99999999999";
        assert!(matches!(
            err(line("0", &bad, &cats)),
            Reject::Integer { .. }
        ));
        let mut bad = cats.clone();
        bad[25] = "zz";
        assert_eq!(
            err(line("0", &ints, &bad)),
            Reject::Categorical {
                column: "cat_25".into(),
                value: "zz".into()
            }
        );
        bad[25] = "8000000000000000";
        assert!(matches!(
            err(line("0", &ints, &bad)),
            Reject::Categorical { .. }
        ));
        parse_line(line("0", &ints, &cats).as_bytes(), &mut r).unwrap();
    }
}
