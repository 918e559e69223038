//! `--id-distribution uniform|zipf --zipf-alpha A`: how the synthetic ids of
//! `bench dlrm`, `bench embedding` and `ingest synthetic` fall on the rows.

use clap::{Args, ValueEnum};
use ember_sparse::IdDistribution;
use serde::Serialize;

/// The Zipf exponent when `--zipf-alpha` is not given (see the book's
/// synthetic-data page for what it corresponds to in Criteo).
pub const DEFAULT_ZIPF_ALPHA: f64 = 1.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IdKind {
    /// Every row equally likely.
    Uniform,
    /// Zipf's law: the k-th most frequent row with probability ~ k^-alpha.
    Zipf,
}

#[derive(Args, Clone, Debug, Default)]
pub struct IdArgs {
    /// How ids fall on a table's rows [default: the data generator's own]
    #[arg(long, value_enum)]
    pub id_distribution: Option<IdKind>,
    /// The exponent of --id-distribution zipf (above 0; larger is more skewed)
    #[arg(long)]
    pub zipf_alpha: Option<f64>,
}

impl IdArgs {
    /// The distribution asked for, `None` when the flags are absent.
    pub fn distribution(&self) -> anyhow::Result<Option<IdDistribution>> {
        match (self.id_distribution, self.zipf_alpha) {
            (None, None) => Ok(None),
            (Some(IdKind::Uniform), None) => Ok(Some(IdDistribution::Uniform)),
            (Some(IdKind::Uniform), Some(_)) => {
                anyhow::bail!("--zipf-alpha is for --id-distribution zipf, not uniform")
            }
            (Some(IdKind::Zipf) | None, alpha) => {
                let alpha = alpha.unwrap_or(DEFAULT_ZIPF_ALPHA);
                anyhow::ensure!(
                    alpha.is_finite() && alpha > 0.0,
                    "--zipf-alpha {alpha}: the exponent must be a finite number above 0"
                );
                Ok(Some(IdDistribution::Zipf { alpha }))
            }
        }
    }
}
