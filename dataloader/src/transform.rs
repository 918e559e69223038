//! The named transforms applied while decoding, as the reference pipelines
//! name them.

use serde::{Deserialize, Serialize};

/// Raw integer feature → model input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DenseTransform {
    /// `ln(1 + max(x, 0))`, missing as 0: dlrm_s_pytorch's Criteo loader.
    #[default]
    Log1p,
    /// `ln(x + 3)`, missing as 0 (so `ln 3`): TorchRec's Criteo Parquet path.
    /// Criteo's integers are at least -2; anything lower is clamped to -2 so
    /// the log stays finite.
    LogPlus3,
    /// The value as it is (a float column, already normalised), missing as 0.
    Identity,
}

impl DenseTransform {
    /// The model input for raw value `x` (`None`: missing).
    #[inline]
    pub fn apply(self, x: Option<i32>) -> f32 {
        self.apply_f32(x.map(|x| x as f32))
    }

    /// The model input for raw value `x` of any numeric column, as f32
    /// (`None`: missing).
    #[inline]
    pub fn apply_f32(self, x: Option<f32>) -> f32 {
        let x = x.unwrap_or(0.0);
        match self {
            DenseTransform::Log1p => x.max(0.0).ln_1p(),
            DenseTransform::LogPlus3 => (x.max(-2.0) + 3.0).ln(),
            DenseTransform::Identity => x,
        }
    }
}

/// Integers below this are transformed by table lookup: most counts in
/// click logs are small, and a lookup is far cheaper than a logarithm.
const SMALL_INTS: usize = 4096;

impl DenseTransform {
    /// [`apply`](Self::apply) for an int32 column: small non-negative values
    /// from a table of the same function's results (so the same bits).
    #[inline]
    pub fn apply_int(self, x: Option<i32>) -> f32 {
        match x {
            Some(v) if (v as u32 as usize) < SMALL_INTS => self.small_ints()[v as usize],
            x => self.apply(x),
        }
    }

    fn small_ints(self) -> &'static [f32] {
        static TABLES: std::sync::OnceLock<[Vec<f32>; 3]> = std::sync::OnceLock::new();
        let tables = TABLES.get_or_init(|| {
            let table =
                |t: DenseTransform| (0..SMALL_INTS as i32).map(|x| t.apply(Some(x))).collect();
            [
                table(DenseTransform::Log1p),
                table(DenseTransform::LogPlus3),
                table(DenseTransform::Identity),
            ]
        });
        &tables[self as usize]
    }
}

/// Raw categorical id → row of a table with `rows` rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IdTransform {
    /// `id mod rows` (non-negative): TorchRec and MLPerf.
    #[default]
    Modulo,
    /// `splitmix64(id) mod rows`: spreads ids whose low bits are correlated
    /// (sequential or bucketed ids) evenly over the rows.
    Hash,
    /// The id unchanged: a key-value table's (its map finds the row), or
    /// ids already known to be rows.
    Raw,
}

impl IdTransform {
    /// The table row for raw id `id`, in `0..rows` (`Raw`: the id itself);
    /// `rows` must be at least 1 (the loader checks this).
    #[inline]
    pub fn apply(self, id: i64, rows: u64) -> i64 {
        match self {
            // Ids already below the table's rows need no division.
            IdTransform::Modulo if (id as u64) < rows => id,
            IdTransform::Modulo => id.rem_euclid(rows as i64),
            IdTransform::Hash => (ember_sparse::rng::splitmix(id as u64) % rows) as i64,
            IdTransform::Raw => id,
        }
    }
}

/// Parses the names above (`log1p`, `log-plus3`, `identity`; `modulo`, `hash`), as the
/// command line takes them.
macro_rules! named {
    ($t:ty, $($name:literal => $v:path),+) => {
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($v),)+
                    _ => Err(format!("'{s}' is not one of: {}", [$($name),+].join(", "))),
                }
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                let name = match *self {
                    $($v => $name,)+
                };
                f.write_str(name)
            }
        }
    };
}
named!(DenseTransform, "log1p" => DenseTransform::Log1p, "log-plus3" => DenseTransform::LogPlus3, "identity" => DenseTransform::Identity);
named!(IdTransform, "modulo" => IdTransform::Modulo, "hash" => IdTransform::Hash, "raw" => IdTransform::Raw);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_transforms() {
        assert_eq!(DenseTransform::Log1p.apply(None), 0.0);
        assert_eq!(DenseTransform::Log1p.apply(Some(-5)), 0.0);
        assert!((DenseTransform::Log1p.apply(Some(9)) - 10f32.ln()).abs() < 1e-6);
        assert!((DenseTransform::LogPlus3.apply(None) - 3f32.ln()).abs() < 1e-6);
        assert!((DenseTransform::LogPlus3.apply(Some(7)) - 10f32.ln()).abs() < 1e-6);
        assert_eq!(DenseTransform::LogPlus3.apply(Some(-9)), 0.0);
    }

    #[test]
    fn the_small_int_table_gives_the_same_bits() {
        for t in [
            DenseTransform::Log1p,
            DenseTransform::LogPlus3,
            DenseTransform::Identity,
        ] {
            for x in [
                None,
                Some(-7),
                Some(-2),
                Some(0),
                Some(1),
                Some(4095),
                Some(4096),
                Some(i32::MAX),
            ] {
                assert_eq!(
                    t.apply_int(x).to_bits(),
                    t.apply(x).to_bits(),
                    "{t:?} {x:?}"
                );
            }
            for x in 0..SMALL_INTS as i32 {
                assert_eq!(t.apply_int(Some(x)).to_bits(), t.apply(Some(x)).to_bits());
            }
        }
    }

    #[test]
    fn id_transforms_stay_in_range() {
        assert_eq!(IdTransform::Modulo.apply(0x68fd1e64, 100), 0x68fd1e64 % 100);
        assert_eq!(IdTransform::Modulo.apply(-3, 10), 7);
        assert_eq!(IdTransform::Modulo.apply(9, 10), 9);
        assert_eq!(IdTransform::Modulo.apply(10, 10), 0);
        assert_eq!(
            IdTransform::Modulo.apply(i64::MIN, 10),
            i64::MIN.rem_euclid(10)
        );
        for id in [-5i64, 0, 1, i64::MAX] {
            assert!((0..7).contains(&IdTransform::Hash.apply(id, 7)));
        }
    }
}
