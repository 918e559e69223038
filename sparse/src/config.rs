//! Table configuration, serialisable as JSON (names follow TorchRec's
//! `EmbeddingBagConfig`).

use serde::{Deserialize, Serialize};

use crate::{DataType, KvConfig, SparseError};

/// How the rows of a bag are combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolingType {
    /// Sum of the bag's (weighted) rows; an empty bag pools to zeros. The default.
    #[default]
    Sum,
    /// Sum divided by the bag length; an empty bag pools to zeros.
    Mean,
}

/// One embedding table and the features that look it up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingBagConfig {
    /// Table name; unique within a collection.
    pub name: String,
    /// Number of rows (the id range is `0..num_embeddings`).
    pub num_embeddings: usize,
    /// Floats per row: the width of each of this table's pooled outputs.
    pub embedding_dim: usize,
    /// Features (input keys) that look this table up; each gets its own
    /// pooled output, so tables are shared between features this way.
    pub feature_names: Vec<String>,
    /// How each bag's rows are combined (`"sum"` or `"mean"` in JSON; sum when absent).
    #[serde(default)]
    pub pooling: PoolingType,
    /// Lower end of the uniform initialisation range; TorchRec's default
    /// -sqrt(1/num_embeddings) when absent.
    #[serde(default)]
    pub weight_init_min: Option<f32>,
    /// Upper end of the uniform initialisation range; TorchRec's default
    /// +sqrt(1/num_embeddings) when absent.
    #[serde(default)]
    pub weight_init_max: Option<f32>,
    /// The rows' data type (TorchRec's `data_type`; `"fp32"` when absent).
    /// `fp16` and `bf16` tables train; the quantized types are for inference.
    #[serde(default)]
    pub data_type: DataType,
    /// Rows found by the raw id through a map, with admission and
    /// eviction ([`KvConfig`]); `None` (absent in JSON): the id is the
    /// row. Not part of TorchRec's config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvConfig>,
}

impl EmbeddingBagConfig {
    /// A table `name` of `num_embeddings` rows of `embedding_dim` floats,
    /// looked up by `features`, with sum pooling and the default init range.
    /// Nothing is checked here; the collection validates configs when it is
    /// built.
    pub fn new(name: &str, num_embeddings: usize, embedding_dim: usize, features: &[&str]) -> Self {
        Self {
            name: name.to_string(),
            num_embeddings,
            embedding_dim,
            feature_names: features.iter().map(|f| f.to_string()).collect(),
            pooling: PoolingType::Sum,
            weight_init_min: None,
            weight_init_max: None,
            data_type: DataType::Fp32,
            kv: None,
        }
    }

    /// The same config with rows of `data_type` instead.
    pub fn with_data_type(mut self, data_type: DataType) -> Self {
        self.data_type = data_type;
        self
    }

    /// Bytes of the table's rows in its data type (without optimizer
    /// state), if that fits in a `usize`.
    pub fn bytes(&self) -> Option<usize> {
        self.data_type
            .row_bytes(self.embedding_dim)?
            .checked_mul(self.num_embeddings)
    }

    /// The same config with `pooling` instead.
    pub fn with_pooling(mut self, pooling: PoolingType) -> Self {
        self.pooling = pooling;
        self
    }

    /// The uniform initialisation range `(min, max)`: the configured bounds,
    /// or ±sqrt(1/num_embeddings) for those not set.
    pub fn init_range(&self) -> (f32, f32) {
        let bound = (1.0 / self.num_embeddings.max(1) as f64).sqrt() as f32;
        (
            self.weight_init_min.unwrap_or(-bound),
            self.weight_init_max.unwrap_or(bound),
        )
    }

    pub(crate) fn validate(&self) -> Result<(), SparseError> {
        let fail = |reason: &str| {
            Err(SparseError::InvalidConfig {
                table: self.name.clone(),
                reason: reason.to_string(),
            })
        };
        if self.num_embeddings == 0 {
            return fail("num_embeddings must be at least 1");
        }
        if self.embedding_dim == 0 {
            return fail("embedding_dim must be at least 1");
        }
        // The backward's scratch and a fp32 view of the rows need the
        // fp32 size to be addressable too.
        let too_big = self
            .num_embeddings
            .checked_mul(self.embedding_dim)
            .and_then(|n| n.checked_mul(std::mem::size_of::<f32>()))
            .zip(self.bytes())
            .is_none_or(|(floats, rows)| floats.max(rows) > isize::MAX as usize);
        if too_big {
            return fail("num_embeddings x embedding_dim values do not fit in memory");
        }
        if self.feature_names.is_empty() {
            return fail("no feature looks this table up (feature_names is empty)");
        }
        if let Some(kv) = &self.kv {
            if self.num_embeddings < 2 {
                return fail("a key-value table needs 2 rows at least (one is the fallback)");
            }
            // Its map numbers rows in 32 bits (4 bytes a row, not 8).
            if self.num_embeddings - 1 > u32::MAX as usize {
                return fail("a key-value table keys 2^32 - 1 ids at most");
            }
            if let Some(problem) = kv.problem() {
                return fail(&problem);
            }
        }
        let (lo, hi) = self.init_range();
        if lo.is_nan() || hi.is_nan() || lo > hi {
            return fail("weight_init_min is above weight_init_max");
        }
        Ok(())
    }
}
