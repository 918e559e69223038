//! A two-tower retrieval model, trained by Ember's `Trainer`: a user tower
//! and an item tower, each embedding bags and an MLP, scored by the dot
//! product of the two towers' outputs. Only Ember's public API is used.
//!
//! The data is synthetic with something to learn: users and items belong to
//! hidden clusters; a user's history holds items of its cluster, and a pair
//! is a click (label 1) when user and item share a cluster. After training
//! it prints the test AUC and recall@k: for each test user, how often a
//! held-out item of its cluster ranks in the top k of 100 candidates (the
//! other 99 drawn at random).
//!
//! `cargo run --release --example two_tower [-- BATCHES]`

use std::path::PathBuf;

use ember::dense::{BceWithLogits, DotInteraction};
use ember::models::checkpoint::{StateDict, StateFile};
use ember::prelude::*;
use ember::sparse::rng::{mix, Rng};

const USERS: usize = 20_000;
const ITEMS: usize = 5_000;
const CLUSTERS: u64 = 20;
const HISTORY: usize = 5;
const DIM: usize = 16;

/// The hidden cluster of a user or an item.
fn cluster(kind: u64, id: u64) -> u64 {
    mix(&[kind, id]) % CLUSTERS
}

/// An item of cluster `c`, drawn by `rng`.
fn item_of_cluster(rng: &mut Rng, c: u64) -> u64 {
    loop {
        let item = rng.below(ITEMS as u64);
        if cluster(1, item) == c {
            return item;
        }
    }
}

/// A batch of (user, item) pairs with `user_id`, `user_hist`, `item_id` and
/// `item_cat` features; half the pairs are clicks.
fn pairs(pairs: &[(u64, u64)], seed: u64) -> Batch {
    let n = pairs.len();
    let mut rng = Rng::new(seed);
    let (mut values, mut lengths) = (Vec::new(), Vec::new());
    for &(u, _) in pairs {
        values.push(u as i64);
        lengths.push(1);
    }
    for &(u, _) in pairs {
        // The user's history: items of its cluster, fixed per user.
        let mut hist = Rng::new(mix(&[7, u]));
        for _ in 0..HISTORY {
            values.push(item_of_cluster(&mut hist, cluster(0, u)) as i64);
        }
        lengths.push(HISTORY as i64);
    }
    for &(_, i) in pairs {
        values.push(i as i64);
        lengths.push(1);
    }
    for &(_, i) in pairs {
        // A noisy category: the item's cluster, one time in four another.
        let cat = match rng.below(4) {
            0 => rng.below(CLUSTERS),
            _ => cluster(1, i),
        };
        values.push(cat as i64);
        lengths.push(1);
    }
    let keys = ["user_id", "user_hist", "item_id", "item_cat"]
        .map(String::from)
        .to_vec();
    let labels = (pairs.iter())
        .map(|&(u, i)| (cluster(0, u) == cluster(1, i)) as u8 as f32)
        .collect();
    Batch {
        dense: Tensor::zeros(n, 0),
        sparse: KeyedJaggedTensor::from_lengths(keys, values, &lengths, None)
            .expect("lengths match the values"),
        labels,
    }
}

/// Training or test pairs: batch `i` is a pure function of (seed, i).
struct PairData {
    seed: u64,
    batches: u64,
    size: usize,
}

impl TrainData for PairData {
    fn batches_per_epoch(&self, _: u64) -> u64 {
        self.batches
    }

    fn epoch(
        &self,
        epoch: u64,
        skip: u64,
    ) -> Box<dyn Iterator<Item = Result<Batch, ModelError>> + Send + '_> {
        Box::new((skip..self.batches).map(move |i| {
            let mut rng = Rng::new(mix(&[self.seed, epoch, i]));
            let pairs_: Vec<(u64, u64)> = (0..self.size)
                .map(|k| {
                    let user = rng.below(USERS as u64);
                    let item = match k % 2 {
                        0 => item_of_cluster(&mut rng, cluster(0, user)),
                        _ => rng.below(ITEMS as u64),
                    };
                    (user, item)
                })
                .collect();
            Ok(pairs(&pairs_, rng.next_u64()))
        }))
    }
}

/// The model: one collection holds both towers' tables (so one fused
/// backward updates them), its pooled output is split into the towers'
/// inputs, and the score is DLRM's dot interaction of the two tower
/// outputs (with one "sparse" vector it is exactly `u · v`).
struct TwoTower {
    tables: EmbeddingBagCollection,
    user_mlp: Mlp<f32>,
    item_mlp: Mlp<f32>,
    dot: DotInteraction<f32>,
    optimizer: DenseOptimizer<f32>,
    loss: BceWithLogits<f32>,
    buffers: [Tensor<f32>; 6],
}

impl TwoTower {
    fn new(seed: u64) -> Result<Self, ModelError> {
        let table = |name: &str, rows| EmbeddingBagConfig::new(name, rows, DIM, &[name]);
        let tables = vec![
            table("user_id", USERS),
            table("user_hist", ITEMS),
            table("item_id", ITEMS),
            table("item_cat", CLUSTERS as usize),
        ];
        let tables =
            EmbeddingBagCollection::new(tables, TableOptimizer::rowwise_adagrad(0.1), seed)?;
        Ok(Self {
            tables,
            user_mlp: Mlp::new(&[2 * DIM, 64, DIM], Activation::None, seed ^ 1),
            item_mlp: Mlp::new(&[2 * DIM, 64, DIM], Activation::None, seed ^ 2),
            dot: DotInteraction::new(1, DIM),
            optimizer: DenseOptimizer::new(DenseOptimizerConfig::adagrad(0.05)),
            loss: BceWithLogits::new(),
            buffers: Default::default(),
        })
    }

    /// The logits of `batch`, left in `buffers[3]`.
    fn forward(&mut self, be: &dyn DenseBackend<f32>, batch: &Batch) -> Result<(), ModelError> {
        let [pooled, user_in, item_in, logits, head, _] = &mut self.buffers;
        // The pooled embeddings straight into the towers' input tensor.
        pooled.resize(batch.size(), self.tables.width());
        self.tables
            .forward_into_slice(&batch.sparse, pooled.data_mut())?;
        be.split_columns(pooled, 2 * DIM, user_in, item_in);
        let u = self.user_mlp.forward(be, user_in);
        let v = self.item_mlp.forward(be, item_in);
        // [u, u·v]: the last column is the score.
        let out = self.dot.forward(be, u, v);
        be.split_columns(out, DIM, head, logits);
        Ok(())
    }
}

/// Both towers' parameters, named `user_tower.*` and `item_tower.*`.
fn tower_params<'a>(user: &'a mut Mlp<f32>, item: &'a mut Mlp<f32>) -> Vec<Param<'a, f32>> {
    let user = user
        .params()
        .into_iter()
        .map(|p| p.with_prefix("user_tower."));
    let item = item
        .params()
        .into_iter()
        .map(|p| p.with_prefix("item_tower."));
    user.chain(item).collect()
}

impl Model for TwoTower {
    fn train_step(
        &mut self,
        backend: &Backend,
        batch: &Batch,
        mode: ExecMode,
    ) -> Result<StepOutput, ModelError> {
        if !matches!(mode, ExecMode::Strict | ExecMode::Debug) {
            let (model, runs) = ("the two-tower example", "strict or debug");
            return Err(Unsupported::Mode { model, runs, mode }.into());
        }
        let be = backend.dense();
        self.forward(be, batch)?;
        let [pooled, _, _, logits, zeros, d_out] = &mut self.buffers;
        self.loss.forward_backward(be, logits, &batch.labels);
        // d[u, u·v] = [0, d score].
        be.zeros(zeros, batch.size(), DIM);
        be.concat_columns(zeros, self.loss.grad(), d_out);
        let (du, dv) = self.dot.backward(be, d_out);
        let du_in = self.user_mlp.backward(be, du, true).expect("asked for");
        let dv_in = self.item_mlp.backward(be, dv, true).expect("asked for");
        be.concat_columns(du_in, dv_in, pooled);
        self.tables.backward_update(&batch.sparse, pooled.data())?;
        self.optimizer
            .step(tower_params(&mut self.user_mlp, &mut self.item_mlp));
        Ok(StepOutput {
            loss: self.loss.loss(),
            times: Default::default(),
        })
    }

    fn predict(&mut self, backend: &Backend, batch: &Batch) -> Result<&[f32], ModelError> {
        self.forward(backend.dense(), batch)?;
        Ok(self.buffers[3].data())
    }

    fn state_dict(&mut self) -> Result<StateDict<'_>, ModelError> {
        let mut state = StateDict::new();
        let params = tower_params(&mut self.user_mlp, &mut self.item_mlp);
        state.add_trained("", &self.optimizer, params);
        state.add_collection("tables.", &self.tables);
        Ok(state)
    }

    fn load_state_dict(&mut self, file: &StateFile) -> Result<(), ModelError> {
        file.load_collection("tables.", &mut self.tables)?;
        let params = tower_params(&mut self.user_mlp, &mut self.item_mlp);
        file.load_trained("", &mut self.optimizer, params)
    }
}

/// recall@k over `users` test users: a held-out item of the user's cluster
/// among 99 random ones; the fraction whose item ranks in the top `k`.
fn recall_at(model: &mut TwoTower, be: &Backend, users: u64, k: usize) -> Result<f64, ModelError> {
    let mut hits = 0;
    for u in 0..users {
        let user = mix(&[99, u]) % USERS as u64;
        let mut rng = Rng::new(mix(&[98, u]));
        let mut candidates = vec![(user, item_of_cluster(&mut rng, cluster(0, user)))];
        candidates.extend((0..99).map(|_| (user, rng.below(ITEMS as u64))));
        let scores = model.predict(be, &pairs(&candidates, u))?;
        let better = scores[1..].iter().filter(|&&s| s > scores[0]).count();
        hits += (better < k) as u64;
    }
    Ok(hits as f64 / users as f64)
}

/// Trains for `batches` batches of 1024 and returns (test AUC, recall@10).
fn run(
    batches: u64,
    checkpoint_dir: Option<PathBuf>,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let mut model = TwoTower::new(42)?;
    let train = PairData {
        seed: 1,
        batches,
        size: 1024,
    };
    let test = PairData {
        seed: 2,
        batches: 8,
        size: 1024,
    };
    let config = TrainerConfig {
        epochs: 1,
        checkpoint_dir,
        log_every: 50,
        ..TrainerConfig::default()
    };
    let trainer = Trainer::new(config, Backend::native());
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
    let auc = summary.eval.map_or(f64::NAN, |m| m.auc);
    let recall = recall_at(&mut model, trainer.backend(), 500, 10)?;
    println!(
        "{} steps in {:.1} s: test AUC {auc:.4}, recall@10 {recall:.3} (chance: 0.100)",
        summary.steps,
        started.elapsed().as_secs_f64()
    );
    Ok((auc, recall))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batches = std::env::args().nth(1).map_or(Ok(300), |s| s.parse())?;
    run(batches, None)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_tower_learns_the_clusters() {
        let (auc, recall) = run(150, None).expect("trains");
        assert!(auc > 0.75, "test AUC {auc}");
        assert!(recall > 0.3, "recall@10 {recall}");
    }

    #[test]
    fn checkpoint_restores_every_tensor() {
        let dir = std::env::temp_dir().join(format!("ember-two-tower-{}", std::process::id()));
        let mut a = TwoTower::new(1).unwrap();
        let be = Backend::native();
        let data = PairData {
            seed: 3,
            batches: 3,
            size: 256,
        };
        for b in data.epoch(0, 0) {
            a.train_step(&be, &b.unwrap(), ExecMode::Strict).unwrap();
        }
        let path = a.save_checkpoint(&dir, None).unwrap();
        let mut b = TwoTower::new(2).unwrap();
        b.load_checkpoint(&path).unwrap();
        // The same next step from both: bitwise the same logits after it.
        let next = data.epoch(1, 0).next().unwrap().unwrap();
        a.train_step(&be, &next, ExecMode::Strict).unwrap();
        b.train_step(&be, &next, ExecMode::Strict).unwrap();
        let (la, lb) = (
            a.predict(&be, &next).unwrap().to_vec(),
            b.predict(&be, &next).unwrap().to_vec(),
        );
        assert_eq!(la, lb);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
