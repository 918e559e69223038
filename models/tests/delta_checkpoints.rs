//! Delta checkpoints: a full save, then deltas of only what training
//! changed. A chain loads bitwise as a full save of the same state (fp32,
//! fp16 and key-value tables, every table optimizer, RAM and the disk
//! tier), trains on bitwise, compacts into the very tensors and metadata a
//! full save writes, forks where a model loaded from an earlier delta goes
//! on, and a chain with a link missing is refused, naming the file.

use std::path::{Path, PathBuf};

use ember_dense::{DenseOptimizerConfig, HasParams, NativeBackend};
use ember_models::checkpoint::{compact, delta_file_name, save, save_delta, TrainState};
use ember_models::{
    Backend, Checkpoint, DataGeneration, Dlrm, DlrmConfig, ExecMode, FitOptions, InteractionType,
    Model, SyntheticBatches, SyntheticConfig, SyntheticData, Trainer, TrainerConfig,
};
use ember_sparse::{Admission, DataType, DiskTierConfig, Eviction, KvConfig, TableOptimizer};
use safetensors::SafeTensors;

/// An fp32 table, an fp16 table of `fp16_rows` and a key-value table of 8
/// rows over 40 raw ids (it admits on the second sighting, fills and
/// evicts).
fn setup_with(fp16_rows: usize) -> (DlrmConfig, SyntheticData) {
    let mut config = DlrmConfig {
        tables: DlrmConfig::criteo_tables(&[300, fp16_rows, 40, 40], 4),
        bottom_mlp: vec![3, 6, 4],
        top_mlp: vec![5, 3, 1],
        interaction: InteractionType::Dot,
    };
    let data = SyntheticConfig::for_model(&config, DataGeneration::Learnable, 3, 4);
    let data = SyntheticData::new(data).unwrap();
    config.tables[1].data_type = DataType::Fp16;
    config.tables[2].num_embeddings = 9;
    config.tables[2].kv = Some(KvConfig {
        admission: Admission::Count {
            min_count: 2,
            sketch_width: 64,
            halve_every: None,
        },
        eviction: Eviction::Lru,
        eviction_window: Some(4),
        ..KvConfig::default()
    });
    // A key-value table of 30 rows: a delta lists the rows it changed.
    config.tables[3].num_embeddings = 31;
    config.tables[3].kv = config.tables[2].kv.clone();
    (config, data)
}

fn setup() -> (DlrmConfig, SyntheticData) {
    setup_with(30)
}

fn build(config: &DlrmConfig, optimizer: TableOptimizer) -> Dlrm {
    Dlrm::builder(config.clone())
        .optimizers(optimizer, DenseOptimizerConfig::adam(0.01))
        .seed(5)
        .build()
        .unwrap()
}

fn train(model: &mut Dlrm, data: &SyntheticData, batches: std::ops::Range<u64>) -> Vec<u32> {
    let be = Backend::Native(NativeBackend::new(1));
    (batches.map(|i| {
        let out = model.train_step(&be, &data.batch(i, 8), ExecMode::Strict);
        out.unwrap().loss.to_bits()
    }))
    .collect()
}

fn at(steps: u64) -> TrainState {
    TrainState {
        steps,
        batches_in_epoch: steps,
        batch_size: 8,
        ..TrainState::default()
    }
}

/// Everything a model holds that training reads: every table's stored
/// rows, optimizer state and map, the step, the dense weights and state.
fn state(model: &mut Dlrm) -> String {
    let mut out = String::new();
    let ebc = model.sparse_arch().local().unwrap();
    out += &format!("step {} ", ebc.step());
    for t in ebc.tables() {
        let (n, stride, per_row) = (
            t.num_embeddings(),
            t.bytes_per_row(),
            t.state_floats_per_row(),
        );
        let (mut rows, mut state) = (vec![0u8; n * stride], vec![0f32; n * per_row]);
        t.read_stored_rows(0, &mut rows, &mut state).unwrap();
        let bits: Vec<u32> = state.iter().map(|v| v.to_bits()).collect();
        out += &format!("{} {rows:?} {bits:?} {:?}\n", t.name(), t.kv_state());
    }
    let opt = model.dense_optimizer();
    out += &format!("dense steps {}\n", opt.steps());
    let dense: Vec<String> = opt
        .state()
        .map(|(n, _, m, v)| format!("{n} {m:?} {v:?}"))
        .collect();
    out += &dense.join("\n");
    for p in model.dense_arch_mut().params() {
        let bits: Vec<u32> = p.value.iter().map(|v| v.to_bits()).collect();
        out += &format!("{} {bits:?}\n", p.name);
    }
    out
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

/// Names and what they hold, in order.
type Named = Vec<(String, String)>;

/// Every tensor's dtype, shape and bytes, and the metadata, of a file.
fn contents(path: &Path) -> (Named, Named) {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, String)> = (file.tensors().into_iter())
        .map(|(n, t)| {
            let text = format!("{:?} {:?} {:?}", t.dtype(), t.shape(), t.data());
            (n, text)
        })
        .collect();
    tensors.sort();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta: Vec<(String, String)> = header.metadata().clone().unwrap().into_iter().collect();
    meta.sort();
    (tensors, meta)
}

/// Full save, three deltas; returns the chain's directory and the file
/// of a full save of the same state.
fn chain_of_three(model: &mut Dlrm, data: &SyntheticData, root: &Path) -> (PathBuf, PathBuf) {
    let chain = root.join("chain");
    train(model, data, 0..3);
    model.save_checkpoint(&chain, Some(&at(3))).unwrap();
    for k in 1..=3u64 {
        train(model, data, 3 * k..3 * k + 3);
        let path = model.save_checkpoint_delta(&chain, Some(&at(3 * k + 3)), 10);
        assert_eq!(path.unwrap(), Some(chain.join(delta_file_name(k))));
    }
    let full = root.join("full.safetensors");
    save(model, &full, Some(&at(12))).unwrap();
    (chain, full)
}

#[test]
fn a_chain_of_deltas_loads_trains_on_and_compacts_as_a_full_save() {
    let (config, data) = setup();
    for optimizer in [
        TableOptimizer::rowwise_adagrad(0.05),
        TableOptimizer::adam(0.01),
        TableOptimizer::sgd(0.1),
        TableOptimizer::adagrad(0.05),
    ] {
        let mut model = build(&config, optimizer);
        let root = tempfile::tempdir().unwrap();
        let (chain, full) = chain_of_three(&mut model, &data, root.path());
        let want = state(&mut model);

        let opened = Checkpoint::open(&chain).unwrap();
        assert_eq!(opened.delta_count(), 3);
        assert_eq!(opened.train_state(), Some(&at(12)));
        let mut from_chain = opened.builder().build().unwrap();
        let mut from_full = Checkpoint::open(&full).unwrap().builder().build().unwrap();
        assert_eq!(state(&mut from_chain), want, "{optimizer:?}");
        assert_eq!(state(&mut from_full), want, "{optimizer:?}");
        let go_on = train(&mut model, &data, 12..15);
        assert_eq!(train(&mut from_chain, &data, 12..15), go_on);
        assert_eq!(train(&mut from_full, &data, 12..15), go_on);

        // The small key-value table changed whole: written whole; the
        // others list their changed rows.
        let (tensors, meta) = contents(&chain.join(delta_file_name(1)));
        let link = &meta.iter().find(|(k, _)| k == "ember.delta").unwrap().1;
        assert!(link.contains(r#""whole_tables":["t_cat_2"]"#), "{link}");
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        for listed in ["t_cat_0.rows", "t_cat_3.rows", "t_cat_3.kv.ids"] {
            assert!(
                names.iter().any(|n| n.ends_with(listed)),
                "{listed}: {names:?}"
            );
        }
        assert!(
            !names.iter().any(|n| n.ends_with("t_cat_2.rows")),
            "{names:?}"
        );
        // A delta holds the changed rows only: smaller than a full file.
        for k in 1..=3 {
            let delta = size(&chain.join(delta_file_name(k)));
            assert!(delta < size(&full), "{delta} of {}", size(&full));
        }
        let summary = compact(&chain).unwrap();
        assert_eq!(summary.deltas, 3);
        assert!(!chain.join(delta_file_name(1)).exists());
        assert_eq!(
            contents(&chain.join("model.safetensors")),
            contents(&full),
            "{optimizer:?}"
        );
    }
}

#[test]
fn a_model_loaded_from_an_earlier_delta_forks_the_chain_there() {
    let (config, data) = setup();
    let mut model = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    let root = tempfile::tempdir().unwrap();
    let (chain, _) = chain_of_three(&mut model, &data, root.path());
    let mut fork = Checkpoint::open(&chain.join(delta_file_name(1)))
        .unwrap()
        .builder()
        .build()
        .unwrap();
    train(&mut fork, &data, 100..103);
    let path = fork
        .save_checkpoint_delta(&chain, Some(&at(9)), 10)
        .unwrap();
    assert_eq!(path, Some(chain.join(delta_file_name(2))));
    assert!(!chain.join(delta_file_name(3)).exists());
    let mut loaded = Checkpoint::open(&chain).unwrap().builder().build().unwrap();
    assert_eq!(state(&mut loaded), state(&mut fork));
    // At the chain's limit the model writes none: the caller saves full.
    assert_eq!(fork.save_checkpoint_delta(&chain, None, 2).unwrap(), None);
}

#[test]
fn deltas_build_only_on_the_models_own_checkpoint() {
    let (config, data) = setup();
    let mut model = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    let root = tempfile::tempdir().unwrap();
    let error = save_delta(&mut model, root.path(), None).unwrap_err();
    assert!(
        error.to_string().contains("save a full checkpoint first"),
        "{error}"
    );
    model.save_checkpoint(root.path(), None).unwrap();
    train(&mut model, &data, 0..2);
    // Another model's full file replaces the chain's base.
    let mut other = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    train(&mut other, &data, 50..51);
    other.save_checkpoint(root.path(), None).unwrap();
    assert_eq!(
        model.save_checkpoint_delta(root.path(), None, 10).unwrap(),
        None
    );
    let error = save_delta(&mut model, root.path(), None).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("another model's checkpoint replaced it"),
        "{error}"
    );
}

#[test]
fn a_model_with_cast_tables_or_another_optimizer_saves_full_first() {
    let (config, data) = setup();
    let mut model = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    let root = tempfile::tempdir().unwrap();
    let (chain, _) = chain_of_three(&mut model, &data, root.path());
    let mut cast = Checkpoint::open(&chain).unwrap();
    cast.cast_tables(DataType::Bf16);
    let mut cast = cast.builder().build().unwrap();
    train(&mut cast, &data, 20..21);
    assert_eq!(cast.save_checkpoint_delta(&chain, None, 10).unwrap(), None);
    let ckpt = Checkpoint::open(&chain).unwrap();
    let mut other = ckpt
        .builder()
        .optimizers(
            TableOptimizer::adagrad(0.05),
            DenseOptimizerConfig::adam(0.01),
        )
        .build()
        .unwrap();
    train(&mut other, &data, 20..21);
    assert_eq!(other.save_checkpoint_delta(&chain, None, 10).unwrap(), None);
    // The chain still loads.
    assert_eq!(Checkpoint::open(&chain).unwrap().delta_count(), 3);
}

#[test]
fn a_broken_chain_is_refused_naming_the_file() {
    let (config, data) = setup();
    let mut model = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    let root = tempfile::tempdir().unwrap();
    let (chain, _) = chain_of_three(&mut model, &data, root.path());
    std::fs::remove_file(chain.join(delta_file_name(2))).unwrap();
    for error in [
        Checkpoint::open(&chain).err().unwrap(),
        ember_models::checkpoint::resume(&chain, None)
            .err()
            .unwrap(),
    ] {
        let text = error.to_string();
        assert!(text.contains("broken delta chain"), "{text}");
        assert!(text.contains(&delta_file_name(3)), "{text}");
    }
    // The chain up to delta 1 is whole: it loads.
    let earlier = Checkpoint::open(&chain.join(delta_file_name(1))).unwrap();
    assert_eq!(earlier.delta_count(), 1);
    // Delta 3 put in delta 2's place: out of sequence.
    std::fs::copy(
        chain.join(delta_file_name(3)),
        chain.join(delta_file_name(2)),
    )
    .unwrap();
    let text = Checkpoint::open(&chain).err().unwrap().to_string();
    assert!(text.contains(&delta_file_name(2)), "{text}");
    // Delta 2 of a fork of the chain at delta 1: its delta 3 builds on
    // another delta 2.
    let (chain, _) = chain_of_three(&mut model, &data, &root.path().join("again"));
    let forked = root.path().join("fork");
    std::fs::create_dir(&forked).unwrap();
    for k in [0, 1] {
        let name = if k == 0 {
            "model.safetensors".to_string()
        } else {
            delta_file_name(k)
        };
        std::fs::copy(chain.join(&name), forked.join(&name)).unwrap();
    }
    let mut fork = Checkpoint::open(&forked.join(delta_file_name(1)))
        .unwrap()
        .builder()
        .build()
        .unwrap();
    train(&mut fork, &data, 100..101);
    fork.save_checkpoint_delta(&forked, None, 10)
        .unwrap()
        .unwrap();
    std::fs::copy(
        forked.join(delta_file_name(2)),
        chain.join(delta_file_name(2)),
    )
    .unwrap();
    let text = Checkpoint::open(&chain).err().unwrap().to_string();
    assert!(text.contains(&delta_file_name(3)), "{text}");
    assert!(text.contains("builds on"), "{text}");
    // A fresh run in the directory is not held up by its broken chain:
    // its full checkpoint replaces it.
    let run = TrainerConfig {
        checkpoint_dir: Some(chain.clone()),
        ..TrainerConfig::default()
    };
    let batches = SyntheticBatches {
        data,
        first: 0,
        batches: 2,
        size: 8,
        rank: 0,
        world_size: 1,
    };
    let mut fresh = build(&config, TableOptimizer::rowwise_adagrad(0.05));
    Trainer::new(run, Backend::native())
        .fit(&mut fresh, &batches, FitOptions::default())
        .unwrap();
    assert_eq!(Checkpoint::open(&chain).unwrap().delta_count(), 0);
}

#[test]
fn a_chain_on_the_disk_tier_loads_as_the_model_in_ram() {
    // Every table on the disk tier, the key-value one too. The fp16
    // table's one row changes: its deltas hold it whole.
    let (config, data) = setup_with(1);
    let root = tempfile::tempdir().unwrap();
    // Caches of 16 rows (one set), the 30-row key-value table's of 32.
    let tier = |dir: &Path| {
        (vec![16, 16, 16, 32].into_iter())
            .map(|cache_rows| {
                Some(DiskTierConfig {
                    dir: dir.to_path_buf(),
                    cache_rows,
                    policy: Default::default(),
                })
            })
            .collect::<Vec<_>>()
    };
    let tier_dir = root.path().join("tier");
    std::fs::create_dir(&tier_dir).unwrap();
    let mut model = Dlrm::builder(config.clone())
        .optimizers(
            TableOptimizer::rowwise_adagrad(0.05),
            DenseOptimizerConfig::adam(0.01),
        )
        .seed(5)
        .disk_tiers(tier(&tier_dir))
        .build()
        .unwrap();
    let (chain, _) = chain_of_three(&mut model, &data, root.path());
    let want = state(&mut model);
    let (_, meta) = contents(&chain.join(delta_file_name(2)));
    let link = &meta.iter().find(|(k, _)| k == "ember.delta").unwrap().1;
    assert!(
        link.contains(r#""whole_tables":["t_cat_1","t_cat_2"]"#),
        "{link}"
    );
    let opened = Checkpoint::open(&chain).unwrap();
    let mut in_ram = opened.builder().build().unwrap();
    assert_eq!(state(&mut in_ram), want);
    let load_dir = root.path().join("load");
    std::fs::create_dir(&load_dir).unwrap();
    let mut on_disk = opened
        .builder()
        .disk_tiers(tier(&load_dir))
        .build()
        .unwrap();
    assert_eq!(state(&mut on_disk), want);
    assert_eq!(
        train(&mut on_disk, &data, 12..14),
        train(&mut model, &data, 12..14)
    );
}
