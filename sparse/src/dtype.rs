//! The data type of a table's rows (TorchRec's `DataType` of an
//! `EmbeddingBagConfig`), and how many bytes one row takes in each.
//!
//! Training types (`fp32`, `fp16`, `bf16`) hold one value per column; the
//! pooled sums and the optimizer run in fp32 and updated rows are written
//! back with stochastic rounding. Quantized types (`int8`, `int4`, `fp8`,
//! `mxfp4`) are for inference: a row carries its own scale, and the tables
//! take no optimizer. The byte layout of each is in [`DataType::row_bytes`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The data type of a table's rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataType {
    /// 32-bit IEEE floats (the default).
    #[default]
    Fp32,
    /// 16-bit IEEE floats (1 sign, 5 exponent, 10 mantissa bits).
    Fp16,
    /// bfloat16 (the top half of an fp32: 8 exponent, 7 mantissa bits).
    Bf16,
    /// Row-wise 8-bit: a row is an fp16 scale and an fp16 bias, then one
    /// unsigned byte `q` per column; the value is `scale * q + bias`
    /// (FBGEMM's fused row-wise layout of `IntNBitTableBatchedEmbeddingBagsCodegen`).
    Int8,
    /// Row-wise 4-bit: the int8 layout with two columns per byte (the
    /// even column in the low nibble).
    Int4,
    /// FP8 E4M3 (OCP "E4M3FN": bias 7, largest 448, no infinities) scaled
    /// per row: a row is an fp32 scale, then one E4M3 byte per column; the
    /// value is `scale * e4m3`.
    Fp8,
    /// OCP microscaling MXFP4: groups of 32 columns (the row's last group
    /// may be shorter) of E2M1 values sharing an E8M0 scale; a group is its
    /// values, two per byte (the even column in the low nibble), then its
    /// scale byte (FBGEMM's MX4 layout).
    Mxfp4,
}

/// Columns per MXFP4 group (the OCP MX block size).
pub const MX_GROUP: usize = 32;

/// Bytes of an int8 or int4 row's header: an fp16 scale and an fp16 bias.
pub(crate) const NBIT_HEADER: usize = 4;
/// Bytes of an fp8 row's header: its fp32 scale.
pub(crate) const FP8_HEADER: usize = 4;

impl DataType {
    /// Every data type, training types first.
    pub const ALL: [DataType; 7] = [
        Self::Fp32,
        Self::Fp16,
        Self::Bf16,
        Self::Int8,
        Self::Int4,
        Self::Fp8,
        Self::Mxfp4,
    ];

    /// Its name in configs, flags and reports (`fp32`, `int8`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
            Self::Int4 => "int4",
            Self::Fp8 => "fp8",
            Self::Mxfp4 => "mxfp4",
        }
    }

    /// Whether tables of this type can be trained (fp32, fp16, bf16); the
    /// quantized types are for inference.
    pub fn is_trainable(self) -> bool {
        matches!(self, Self::Fp32 | Self::Fp16 | Self::Bf16)
    }

    /// Bytes of one row of `dim` columns:
    /// fp32 `4 dim`; fp16 and bf16 `2 dim`; int8 `4 + dim`; int4
    /// `4 + ceil(dim / 2)`; fp8 `4 + dim`; mxfp4 `ceil(dim / 2)` plus one
    /// scale byte per group of 32 columns. `None` when it overflows.
    pub const fn row_bytes(self, dim: usize) -> Option<usize> {
        match self {
            Self::Fp32 => dim.checked_mul(4),
            Self::Fp16 | Self::Bf16 => dim.checked_mul(2),
            Self::Int8 => dim.checked_add(NBIT_HEADER),
            Self::Int4 => dim.div_ceil(2).checked_add(NBIT_HEADER),
            Self::Fp8 => dim.checked_add(FP8_HEADER),
            Self::Mxfp4 => dim.div_ceil(2).checked_add(dim.div_ceil(MX_GROUP)),
        }
    }
}

impl DataType {
    /// Bytes per column for the types that store each column on its own
    /// (fp32, fp16, bf16); `None` for the quantized types, whose rows share
    /// a scale.
    pub fn column_bytes(self) -> Option<usize> {
        match self {
            Self::Fp32 => Some(4),
            Self::Fp16 | Self::Bf16 => Some(2),
            _ => None,
        }
    }

    /// The byte range, within a row of `dim` columns, that holds columns
    /// `cols` as they are when copied on their own: any columns of fp32,
    /// fp16 and bf16 rows; only the whole row of a quantized one (its
    /// columns share the row's scale). `None` when `cols` cannot be copied
    /// as bytes.
    pub fn column_range(
        self,
        dim: usize,
        cols: std::ops::Range<usize>,
    ) -> Option<std::ops::Range<usize>> {
        match self.column_bytes() {
            Some(b) => Some(cols.start * b..cols.end * b),
            None if cols == (0..dim) => Some(0..self.row_bytes(dim)?),
            None => None,
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = String;

    /// Parses a name of [`DataType::name`] (case-insensitive, so TorchRec's
    /// `FP16` reads too).
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|t| t.name()).collect();
                format!("unknown data type '{s}' (one of {})", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_and_json() {
        for t in DataType::ALL {
            assert_eq!(t.name().parse::<DataType>(), Ok(t));
            assert_eq!(t.name().to_uppercase().parse::<DataType>(), Ok(t));
            let json = serde_json::to_string(&t).unwrap();
            assert_eq!(json, format!("\"{}\"", t.name()));
            assert_eq!(serde_json::from_str::<DataType>(&json).unwrap(), t);
        }
        assert!("fp64".parse::<DataType>().unwrap_err().contains("mxfp4"));
    }

    #[test]
    fn row_bytes_follow_the_layouts() {
        let bytes = |t: DataType| t.row_bytes(16).unwrap();
        assert_eq!(
            DataType::ALL.map(bytes),
            [64, 32, 32, 20, 12, 20, 9],
            "dim 16"
        );
        assert_eq!(DataType::Mxfp4.row_bytes(128), Some(64 + 4));
        assert_eq!(DataType::Mxfp4.row_bytes(33), Some(17 + 2));
        assert_eq!(DataType::Int4.row_bytes(7), Some(4 + 4));
        assert_eq!(DataType::Fp32.row_bytes(usize::MAX), None);
    }
}
