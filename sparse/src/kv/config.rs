//! How a key-value table admits, evicts and falls back (serde, in a
//! table's [`EmbeddingBagConfig::kv`](crate::EmbeddingBagConfig::kv)).

use serde::{Deserialize, Serialize};

/// A table whose rows are found by the raw 64-bit id, not `id mod rows`:
/// ids earn a row by [`admission`](Self::admission), lose it by
/// [`eviction`](Self::eviction) when the table is full, and read the
/// [`fallback`](Self::fallback) row while they have none.
///
/// A key-value table of `num_embeddings` rows keys `num_embeddings - 1`
/// ids: its last row is the fallback row.
///
/// ```rust
/// use ember_sparse::{Admission, Eviction, EmbeddingBagConfig, Fallback, KvConfig};
///
/// let table = EmbeddingBagConfig {
///     kv: Some(KvConfig {
///         admission: Admission::Count { min_count: 2, sketch_width: 1 << 20, halve_every: None },
///         eviction: Eviction::Lru,
///         fallback: Fallback::SharedRow,
///         ..KvConfig::default()
///     }),
///     ..EmbeddingBagConfig::new("t_item", 1_000_001, 64, &["item"])
/// };
/// let json = r#"{"name": "t_item", "num_embeddings": 1000001, "embedding_dim": 64,
///  "feature_names": ["item"],
///  "kv": {"admission": {"kind": "count", "min_count": 2, "sketch_width": 1048576},
///         "eviction": {"kind": "lru"}, "fallback": "shared_row"}}"#;
/// assert_eq!(serde_json::from_str::<EmbeddingBagConfig>(json).unwrap(), table);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvConfig {
    /// When a new id gets a row (every id, when absent).
    #[serde(default)]
    pub admission: Admission,
    /// Which rows a full table gives up (LRU when absent).
    #[serde(default)]
    pub eviction: Eviction,
    /// What an id without a row reads (zeros when absent).
    #[serde(default)]
    pub fallback: Fallback,
    /// Rows one eviction pass looks at ([`DEFAULT_EVICTION_WINDOW`] when
    /// absent): the pass gives up an eighth of them (TTL: every expired
    /// one), so eviction is amortised over the admissions it makes room
    /// for.
    #[serde(default)]
    pub eviction_window: Option<usize>,
    /// Rows eviction may look at per batch ([`DEFAULT_SCAN_PER_BATCH`]
    /// when absent): the bound on the time it adds to a step. New ids that
    /// find no room within it read the fallback (counted as `full`).
    #[serde(default)]
    pub max_scan_per_batch: Option<usize>,
    /// Buckets of the ids' hash ([`DEFAULT_BUCKETS`] when absent): a
    /// row-wise sharded table gives each shard a range of them, and they,
    /// not rows, move when it is loaded onto another device count
    /// (TorchRec's `total_num_buckets`). At least the devices it is
    /// sharded over.
    #[serde(default)]
    pub buckets: Option<usize>,
}

/// The widest admission sketch: 4 rows of 2^28 counters, 4 GiB.
pub const MAX_SKETCH_WIDTH: usize = 1 << 28;
/// Rows one eviction pass looks at, unless configured.
pub const DEFAULT_EVICTION_WINDOW: usize = 4096;
/// Rows eviction looks at per batch at most, unless configured.
pub const DEFAULT_SCAN_PER_BATCH: usize = 1 << 16;
/// Buckets of the ids' hash, unless configured.
pub const DEFAULT_BUCKETS: usize = 1024;

impl KvConfig {
    /// Rows one eviction pass looks at.
    pub fn window(&self) -> usize {
        self.eviction_window
            .unwrap_or(DEFAULT_EVICTION_WINDOW)
            .max(1)
    }
    /// Rows eviction looks at per batch at most.
    pub fn scan_per_batch(&self) -> usize {
        self.max_scan_per_batch.unwrap_or(DEFAULT_SCAN_PER_BATCH)
    }
    /// Buckets of the ids' hash.
    pub fn buckets(&self) -> usize {
        self.buckets.unwrap_or(DEFAULT_BUCKETS)
    }
    /// Bytes of the map, headers and sketch of a table of `rows` rows, as
    /// planned: per row an id (8), a header (4 + 4) and the hash table's
    /// slot and control byte at its 7/8 load (about 6); the sketch's
    /// counters.
    pub fn bytes(&self, rows: usize) -> u64 {
        let sketch = match self.admission {
            Admission::Count { sketch_width, .. } => 4 * 4 * sketch_width as u64,
            _ => 0,
        };
        (rows as u64).saturating_mul(22).saturating_add(sketch)
    }

    /// What is wrong with the config, if anything.
    pub(crate) fn problem(&self) -> Option<String> {
        match self.admission {
            Admission::Count { min_count: 0, .. } => {
                Some("admission min_count must be at least 1".into())
            }
            Admission::Count { sketch_width, .. }
                if !(1..=MAX_SKETCH_WIDTH).contains(&sketch_width) =>
            {
                Some(format!(
                    "admission sketch_width {sketch_width} is not in 1..={MAX_SKETCH_WIDTH}"
                ))
            }
            Admission::Probability { p } if !(p > 0.0 && p <= 1.0) => {
                Some(format!("admission probability {p} is not in (0, 1]"))
            }
            Admission::Count {
                halve_every: Some(0),
                ..
            } => Some("admission halve_every must be at least 1".into()),
            _ => match self.eviction {
                Eviction::Ttl { steps: 0 } => Some("eviction ttl steps must be at least 1".into()),
                _ if self.buckets == Some(0) => Some("buckets must be at least 1".into()),
                _ => None,
            },
        }
    }
}

/// When a new id gets a row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Admission {
    /// At its first sighting.
    #[default]
    Always,
    /// At its `min_count`-th sighting, counted (over-counted, never
    /// under) in a count-min sketch of 4 rows of `sketch_width` counters:
    /// memory bounded whatever the id space (DeepRec's counter filter,
    /// TorchRec's threshold admission).
    Count {
        /// Sightings that earn a row.
        min_count: u32,
        /// Counters per sketch row.
        sketch_width: usize,
        /// Halve every counter each this many training batches (TinyLFU's
        /// aging), so sightings long past fade and a long stream does not
        /// saturate the sketch; never when absent.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        halve_every: Option<u32>,
    },
    /// At each sighting with chance `p` (TorchRec's probabilistic
    /// admission): frequent ids get in soon, one-off ids rarely.
    Probability {
        /// The chance per sighting.
        p: f64,
    },
}

/// Which rows a full table gives up. Rows looked up in the current batch
/// are never given up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Eviction {
    /// The least recently seen.
    #[default]
    Lru,
    /// The least often seen (ties: the least recently).
    Lfu,
    /// Those not seen for more than `steps` steps, and no others: a full
    /// table with nothing expired admits nobody.
    Ttl {
        /// Steps a row lives unseen.
        steps: u32,
    },
    /// The smallest in L2 norm (the rows that matter least to a pooled
    /// sum).
    L2Norm,
}

/// What an id without a row reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Zeros; nothing is trained.
    #[default]
    Zeros,
    /// One row shared by every such id, trained by their gradients.
    SharedRow,
}
