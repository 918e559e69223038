//! What a DLRM run needs in memory, estimated from its configuration before
//! anything is allocated, so that a configuration that cannot fit is refused
//! with the estimate in the message instead of aborting the process in the
//! middle of building it.
//!
//! The estimate is a floor, not a measurement: it counts the big buffers
//! (tables and their optimizer state, dense parameters with gradients and
//! optimizer state, a step's activations, the batches in flight), each
//! exactly from the shapes, and leaves out what is small next to them.

pub use ember_sparse::storage::available_memory;
use ember_sparse::TableOptimizer;

use crate::{DlrmConfig, InteractionType, ModelError};

/// Bytes each in-process device costs beyond its tables: its thread, queues
/// and per-device buffers (about 3.5 MB measured with tiny tables).
pub const DEVICE_OVERHEAD_BYTES: u64 = 4 << 20;

/// A run's memory, by what holds it. Sums saturate: an absurd
/// configuration estimates as `u64::MAX`, never as a small wrapped number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryEstimate {
    /// Table rows in their types, and their optimizer state.
    pub tables: u64,
    /// Dense parameters, their gradients and optimizer state (Adam's two
    /// moments at most).
    pub dense_params: u64,
    /// One step's activations and their gradients, forward and backward.
    pub activations: u64,
    /// The batches in flight: ids, lengths, dense features and labels.
    pub batches: u64,
    /// In-process devices (threads with their own buffers), beyond tables.
    pub devices: u64,
}

/// What a run is: the model, its table optimizer and how it is fed.
#[derive(Clone, Copy, Debug)]
pub struct RunShape<'a> {
    /// The architecture.
    pub config: &'a DlrmConfig,
    /// The tables' optimizer (its state per row).
    pub table_optimizer: TableOptimizer,
    /// Rows per batch.
    pub batch_size: usize,
    /// Ids in one batch, over all features.
    pub ids_per_batch: u64,
    /// Batches decoded or generated ahead of the step, plus the step's own.
    pub batches_in_flight: usize,
    /// In-process devices the tables are sharded over (0 or 1: none).
    pub devices: usize,
}

fn mul(a: u64, b: u64) -> u64 {
    a.saturating_mul(b)
}

/// Parameters of an MLP of `sizes` (input first): weights and biases.
fn mlp_params(sizes: &[usize]) -> u64 {
    (sizes.windows(2))
        .map(|w| mul(w[0] as u64, w[1] as u64).saturating_add(w[1] as u64))
        .fold(0, u64::saturating_add)
}

impl MemoryEstimate {
    /// The estimate for `run`.
    pub fn of(run: &RunShape<'_>) -> Self {
        let c = run.config;
        let (b, f, d) = (
            run.batch_size as u64,
            c.num_sparse_features() as u64,
            c.embedding_dim() as u64,
        );
        let tables = (c.tables.iter())
            .map(|t| {
                let rows = t.bytes().map_or(u64::MAX, |v| v as u64);
                let state = mul(
                    t.num_embeddings as u64,
                    mul(
                        run.table_optimizer.state_floats_per_row(t.embedding_dim) as u64,
                        4,
                    ),
                );
                // A key-value table's map, headers and sketch.
                let kv = t.kv.as_ref().map_or(0, |k| k.bytes(t.num_embeddings));
                rows.saturating_add(state).saturating_add(kv)
            })
            .fold(0, u64::saturating_add);
        let top = c.top_mlp_sizes();
        let (mut params, mut widths) = (
            mlp_params(&c.bottom_mlp).saturating_add(mlp_params(&top)),
            (c.bottom_mlp.iter().chain(&top))
                .map(|&w| w as u64)
                .fold(0, u64::saturating_add),
        );
        // Pooled embeddings and their gradients.
        widths = widths.saturating_add(mul(f, d));
        match c.interaction {
            // The Gram matrix of the features and the bottom output.
            InteractionType::Dot => widths = widths.saturating_add(mul(f + 1, f + 1)),
            InteractionType::Dcn { layers, rank } => {
                let n = mul(f + 1, d);
                let layer = mul(2, mul(n, rank as u64)).saturating_add(n);
                params = params.saturating_add(mul(layers as u64, layer));
                widths = widths.saturating_add(mul(layers as u64, n.saturating_add(rank as u64)));
            }
        }
        // Weight, gradient and two moments; forward value, pre-activation
        // and gradient of every activation.
        let dense_params = mul(params, 4 * 4);
        let activations = mul(mul(b, widths), 4 * 3);
        let per_batch = mul(run.ids_per_batch, 8)
            .saturating_add(mul(mul(b, f), 4))
            .saturating_add(mul(mul(b, (c.num_dense() as u64).saturating_add(1)), 4));
        let batches = mul(per_batch, run.batches_in_flight.max(1) as u64);
        let devices = match run.devices {
            0 | 1 => 0,
            n => mul(n as u64, DEVICE_OVERHEAD_BYTES),
        };
        Self {
            tables,
            dense_params,
            activations,
            batches,
            devices,
        }
    }

    /// The sum.
    pub fn total(&self) -> u64 {
        [
            self.tables,
            self.dense_params,
            self.activations,
            self.batches,
            self.devices,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    /// Refuses a run that needs more than `available` bytes (`None`: not
    /// known, nothing is refused), with the estimate in the error.
    pub fn check(&self, available: Option<u64>) -> Result<(), ModelError> {
        match available {
            Some(available) if self.total() > available => Err(ModelError::Memory(OutOfMemory {
                estimate: *self,
                available,
            })),
            _ => Ok(()),
        }
    }
}

/// A run that needs more memory than the machine has ([`ModelError::Memory`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "this run needs at least {} of memory and {} is available: tables {}, \
     dense parameters and optimizer state {}, activations of one step {}, \
     batches in flight {}{}; make what dominates smaller",
    gib(estimate.total()),
    gib(*available),
    gib(estimate.tables),
    gib(estimate.dense_params),
    gib(estimate.activations),
    gib(estimate.batches),
    match estimate.devices {
        0 => String::new(),
        v => format!(", in-process devices {}", gib(v)),
    }
)]
pub struct OutOfMemory {
    /// What the run needs, by part.
    pub estimate: MemoryEstimate,
    /// The bytes the machine has available.
    pub available: u64,
}

/// `bytes` in GiB, for messages.
fn gib(bytes: u64) -> String {
    match bytes {
        u64::MAX => "more than 16 EiB".into(),
        b => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(bottom: &[usize], top: &[usize], interaction: InteractionType) -> DlrmConfig {
        DlrmConfig {
            tables: DlrmConfig::criteo_tables(&[10, 20], 4),
            bottom_mlp: bottom.to_vec(),
            top_mlp: top.to_vec(),
            interaction,
        }
    }

    fn run(config: &DlrmConfig, batch: usize) -> MemoryEstimate {
        MemoryEstimate::of(&RunShape {
            config,
            table_optimizer: TableOptimizer::rowwise_adagrad(0.1),
            batch_size: batch,
            ids_per_batch: (batch as u64).saturating_mul(2),
            batches_in_flight: 3,
            devices: 0,
        })
    }

    #[test]
    fn the_estimate_counts_each_buffer_from_its_shape() {
        let c = config(&[3, 4], &[8, 1], InteractionType::Dot);
        let e = run(&c, 16);
        // Rows (30 x 4 fp32) and one row-wise Adagrad value per row.
        assert_eq!(e.tables, 30 * 16 + 30 * 4);
        // Bottom 3-4, top 7-8-1 (4 + 3 dot pairs in): 16 + 64 + 9 weights and biases.
        assert_eq!(e.dense_params, (16 + 64 + 9) * 16);
        // Widths 3+4, 7+8+1, pooled 2x4, Gram 3x3.
        assert_eq!(e.activations, 16 * (7 + 16 + 8 + 9) * 12);
        assert_eq!(e.batches, 3 * (32 * 8 + 16 * 2 * 4 + 16 * 4 * 4));
        assert!(e.check(Some(e.total())).is_ok());
        let error = e.check(Some(e.total() - 1)).unwrap_err().to_string();
        assert!(
            error.contains("needs at least") && error.contains("tables"),
            "{error}"
        );
    }

    #[test]
    fn absurd_configurations_saturate_and_are_refused() {
        let wide = config(&[3, 100_000_000, 4], &[8, 1], InteractionType::Dot);
        assert!(run(&wide, 2048).check(Some(24 << 30)).is_err());
        let deep = config(
            &[3, 4],
            &[8, 1],
            InteractionType::Dcn {
                layers: 1_000_000,
                rank: 512,
            },
        );
        assert!(run(&deep, 2048).check(Some(24 << 30)).is_err());
        let huge = config(
            &[3, usize::MAX / 2, 4],
            &[usize::MAX / 2, 1],
            InteractionType::Dot,
        );
        assert_eq!(run(&huge, usize::MAX).total(), u64::MAX);
        let e = run(&huge, 1).check(Some(1 << 30)).unwrap_err().to_string();
        assert!(e.contains("more than 16 EiB"), "{e}");
    }
}
