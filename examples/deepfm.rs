//! DeepFM (Guo et al., 2017) from Ember's parts, with its
//! factorization-machine interaction added as a user op: an op Ember does
//! not ship, run through `DenseBackend::host_op` without editing Ember.
//!
//! logit = FM(v_1..v_F) + MLP([dense, v_1, ..., v_F]), where v_f is feature
//! f's pooled embedding and FM = Σ_{i<j} <v_i, v_j>
//!     = ½ Σ_d ((Σ_f v_fd)² − Σ_f v_fd²).
//!
//! Trained by the `Trainer` on synthetic `learnable` data (the same
//! generator as `ember bench dlrm --data-generation learnable`).
//!
//! `cargo run --release --example deepfm [-- BATCHES]`

use std::path::PathBuf;

use ember::dense::BceWithLogits;
use ember::models::checkpoint::{StateDict, StateFile};
use ember::prelude::*;

const FIELDS: usize = 8;
const DIM: usize = 8;
const DENSE: usize = 13;

/// The FM interaction over `fields` pooled embeddings of `dim` each: one
/// output per sample, and its gradient in closed form,
/// d FM / d v_fd = S_d − v_fd with S_d = Σ_f v_fd.
struct FmInteraction {
    fields: usize,
    dim: usize,
    out: Tensor<f32>,
    d_in: Tensor<f32>,
}

impl FmInteraction {
    fn new(fields: usize, dim: usize) -> Self {
        Self {
            fields,
            dim,
            out: Tensor::zeros(0, 1),
            d_in: Tensor::zeros(0, 0),
        }
    }

    /// `[batch, 1]` from `v`, `[batch, fields * dim]`.
    fn forward(&mut self, be: &dyn DenseBackend<f32>, v: &Tensor<f32>) -> &Tensor<f32> {
        let (f, d, out) = (self.fields, self.dim, &mut self.out);
        be.host_op("fm_interaction", &mut || {
            out.resize(v.rows(), 1);
            for (row, y) in v.data().chunks_exact(f * d).zip(out.data_mut()) {
                let mut total = 0.0f32;
                for k in 0..d {
                    let (mut s, mut sq) = (0.0f32, 0.0f32);
                    for x in row.iter().skip(k).step_by(d) {
                        s += x;
                        sq += x * x;
                    }
                    total += s * s - sq;
                }
                *y = 0.5 * total;
            }
        });
        &self.out
    }

    /// The gradient of `v` from the output's, `dy` `[batch, 1]`.
    fn backward(
        &mut self,
        be: &dyn DenseBackend<f32>,
        v: &Tensor<f32>,
        dy: &Tensor<f32>,
    ) -> &Tensor<f32> {
        let (f, d, d_in) = (self.fields, self.dim, &mut self.d_in);
        be.host_op("fm_interaction_backward", &mut || {
            d_in.resize(v.rows(), f * d);
            let rows = v
                .data()
                .chunks_exact(f * d)
                .zip(d_in.data_mut().chunks_exact_mut(f * d));
            for ((row, grad), g) in rows.zip(dy.data()) {
                for k in 0..d {
                    let s: f32 = row.iter().skip(k).step_by(d).sum();
                    for field in 0..f {
                        grad[field * d + k] = g * (s - row[field * d + k]);
                    }
                }
            }
        });
        &self.d_in
    }
}

/// What the synthetic data looks like (the generator takes a DLRM-shaped
/// description: dense features and one table per sparse feature).
fn data_shape() -> DlrmConfig {
    DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[5000; FIELDS], DIM),
        bottom_mlp: vec![DENSE, DIM],
        top_mlp: vec![1],
        interaction: InteractionType::Dot,
    }
}

struct DeepFm {
    tables: EmbeddingBagCollection,
    fm: FmInteraction,
    deep: Mlp<f32>,
    optimizer: DenseOptimizer<f32>,
    loss: BceWithLogits<f32>,
    /// The pooled embeddings, the deep part's input, the logits and the
    /// deep input's gradient.
    buffers: [Tensor<f32>; 4],
}

impl DeepFm {
    fn new(seed: u64) -> Result<Self, ModelError> {
        let tables = EmbeddingBagCollection::new(
            data_shape().tables,
            TableOptimizer::rowwise_adagrad(0.05),
            seed,
        )?;
        Ok(Self {
            tables,
            fm: FmInteraction::new(FIELDS, DIM),
            deep: Mlp::new(
                &[DENSE + FIELDS * DIM, 64, 32, 1],
                Activation::None,
                seed ^ 3,
            ),
            optimizer: DenseOptimizer::new(DenseOptimizerConfig::adagrad(0.05)),
            loss: BceWithLogits::new(),
            buffers: Default::default(),
        })
    }

    /// The logits, left in `buffers[2]`.
    fn forward(&mut self, be: &dyn DenseBackend<f32>, batch: &Batch) -> Result<(), ModelError> {
        let [v, deep_in, logits, _] = &mut self.buffers;
        // The pooled embeddings straight into the FM's input tensor.
        v.resize(batch.size(), self.tables.width());
        self.tables
            .forward_into_slice(&batch.sparse, v.data_mut())?;
        be.concat_columns(&batch.dense, v, deep_in);
        be.copy(logits, self.deep.forward(be, deep_in));
        be.add_assign(logits, self.fm.forward(be, v));
        Ok(())
    }
}

impl Model for DeepFm {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        if !matches!(mode, ExecMode::Strict | ExecMode::Debug) {
            // The FM op runs on the host: no fused or compiled window.
            let (model, runs) = ("DeepFM", "strict or debug");
            return Err(Unsupported::Mode { model, runs, mode }.into());
        }
        let be = backend.dense();
        self.forward(be, batch)?;
        let [v, _, logits, d_v] = &mut self.buffers;
        self.loss.forward_backward(be, logits, &batch.labels);
        let d_logits = self.loss.grad();
        // Both parts add into the logit: each gets its gradient whole.
        let d_deep_in = self.deep.backward(be, d_logits, true).expect("asked for");
        let mut d_dense = Tensor::zeros(0, 0);
        be.split_columns(d_deep_in, DENSE, &mut d_dense, d_v);
        be.add_assign(d_v, self.fm.backward(be, v, d_logits));
        self.tables.backward_update(&batch.sparse, d_v.data())?;
        self.optimizer.step(self.deep.params());
        Ok(StepOutput {
            loss: self.loss.loss(),
            times: Default::default(),
        })
    }

    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
        self.forward(backend.dense(), batch)?;
        Ok(self.buffers[2].data())
    }

    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        let mut state = StateDict::new();
        state.add_trained("deep.", &self.optimizer, self.deep.params());
        state.add_collection("tables.", &self.tables);
        Ok(state)
    }

    fn load_state_dict(&mut self, file: &StateFile) -> Result<(), ModelError> {
        file.load_collection("tables.", &mut self.tables)?;
        file.load_trained("deep.", &mut self.optimizer, self.deep.params())
    }
}

/// Trains on `batches` batches of 1024 (with a checkpoint each epoch end
/// when `dir` is given); returns the test metrics.
fn run(batches: u64, dir: Option<PathBuf>) -> Result<Metrics, Box<dyn std::error::Error>> {
    let data = |first| -> Result<SyntheticBatches, ModelError> {
        let config = SyntheticConfig::for_model(&data_shape(), DataGeneration::Learnable, 3, 11);
        Ok(SyntheticBatches {
            data: SyntheticData::new(config)?,
            first,
            batches,
            size: 1024,
            rank: 0,
            world_size: 1,
        })
    };
    let (train, test) = (
        data(0)?,
        SyntheticBatches {
            batches: 10,
            ..data(1 << 40)?
        },
    );
    let mut model = DeepFm::new(5)?;
    let trainer = Trainer::new(
        TrainerConfig {
            checkpoint_dir: dir,
            log_every: 100,
            ..TrainerConfig::default()
        },
        Backend::native(),
    );
    let started = std::time::Instant::now();
    let summary = trainer.fit(
        &mut model,
        &train,
        FitOptions {
            eval: Some(&test),
            on_event: Some(&mut |e: &TrainEvent| {
                if let TrainEvent::Log { steps, loss, .. } = e {
                    println!("step {steps}: loss {loss:.4}");
                }
            }),
            ..FitOptions::default()
        },
    )?;
    let m = summary.eval.expect("evaluated at the epoch's end");
    println!(
        "{} steps in {:.1} s: test AUC {:.4}, log loss {:.4}",
        summary.steps,
        started.elapsed().as_secs_f64(),
        m.auc,
        m.logloss
    );
    Ok(m)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batches = std::env::args().nth(1).map_or(Ok(400), |s| s.parse())?;
    run(batches, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fm_matches_the_sum_over_pairs_and_finite_differences() {
        let be = NativeBackend::new(1);
        let mut rng = ember::sparse::rng::Rng::new(3);
        let v =
            Tensor::from_vec(2, 3 * 4, (0..24).map(|_| rng.next_f32() - 0.5).collect()).unwrap();
        let mut fm = FmInteraction::new(3, 4);
        let out = fm.forward(&be, &v).data().to_vec();
        // The definition: Σ_{i<j} <v_i, v_j>, in f64.
        let pairs = |row: &[f32]| -> f64 {
            let field = |i: usize| &row[i * 4..(i + 1) * 4];
            let dot = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| *x as f64 * *y as f64)
                    .sum::<f64>()
            };
            (0..3)
                .flat_map(|i| (i + 1..3).map(move |j| (i, j)))
                .map(|(i, j)| dot(field(i), field(j)))
                .sum()
        };
        for (s, y) in out.iter().enumerate() {
            assert!((*y as f64 - pairs(&v.data()[s * 12..(s + 1) * 12])).abs() < 1e-5);
        }
        // The gradient of Σ_s out_s against central differences of the definition.
        let ones = Tensor::from_vec(2, 1, vec![1.0; 2]).unwrap();
        let grad = fm.backward(&be, &v, &ones).data().to_vec();
        for i in 0..24 {
            let (s, h) = (i / 12, 1e-3);
            let mut row: Vec<f32> = v.data()[s * 12..(s + 1) * 12].to_vec();
            row[i % 12] += h as f32;
            let up = pairs(&row);
            row[i % 12] -= 2.0 * h as f32;
            let down = pairs(&row);
            assert!(
                (grad[i] as f64 - (up - down) / (2.0 * h)).abs() < 1e-3,
                "element {i}"
            );
        }
    }

    #[test]
    fn deepfm_learns_and_resumes() {
        let dir = std::env::temp_dir().join(format!("ember-deepfm-{}", std::process::id()));
        let m = run(60, Some(dir.clone())).expect("trains");
        assert!(m.auc > 0.7, "test AUC {}", m.auc);
        // The checkpoint at the epoch's end restores the same predictions.
        let mut model = DeepFm::new(9).unwrap();
        let state = model
            .load_checkpoint(&dir.join(ember::models::checkpoint::CHECKPOINT_FILE))
            .unwrap()
            .unwrap();
        assert_eq!((state.epoch, state.steps), (1, 60));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
