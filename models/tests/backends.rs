//! The PJRT backend runs the same DLRM and DLRM-DCNv2 as the native one:
//! forward outputs, losses and updated parameters agree to 1e-5 relative.
//! Needs the PJRT CPU plugin (scripts/fetch-pjrt-plugin.sh); CI sets
//! EMBER_REQUIRE_PJRT=1 so that a missing plugin fails there.

use ember_dense::pjrt::{plugin_for_tests, Client, PjrtBackend, Plugin};
use ember_dense::{DenseOptimizerConfig, HasParams, NativeBackend};
use ember_models::{
    Backend, DataGeneration, Dlrm, DlrmConfig, ExecMode, InteractionType, Model, SyntheticConfig,
    SyntheticData,
};
use ember_sparse::TableOptimizer;

fn pjrt() -> Option<PjrtBackend> {
    let path = plugin_for_tests()?;
    Some(PjrtBackend::new(
        Client::new(Plugin::load(&path).unwrap()).unwrap(),
    ))
}

/// Synthetic batches for `config`.
fn data(config: &DlrmConfig, kind: DataGeneration, ids: usize, seed: u64) -> SyntheticData {
    SyntheticData::new(SyntheticConfig::for_model(config, kind, ids, seed)).unwrap()
}

fn close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{what}[{i}]: pjrt {x} vs native {y}"
        );
    }
}

#[test]
fn pjrt_and_native_train_the_same_model() {
    let Some(pjrt) = pjrt() else { return };
    let pjrt = Backend::Pjrt(std::sync::Arc::new(pjrt));
    let native = Backend::Native(NativeBackend::new(1));
    for interaction in [
        InteractionType::Dot,
        InteractionType::Dcn { layers: 2, rank: 4 },
    ] {
        let config = DlrmConfig {
            tables: DlrmConfig::criteo_tables(&[40, 30, 20, 50], 8),
            bottom_mlp: vec![13, 16, 8],
            top_mlp: vec![16, 8, 1],
            interaction,
        };
        let data = data(&config, DataGeneration::Learnable, 3, 2);
        let make = || {
            Dlrm::builder(config.clone())
                .optimizers(
                    TableOptimizer::adagrad(0.05),
                    DenseOptimizerConfig::adam(0.01),
                )
                .seed(11)
                .build()
                .unwrap()
        };
        let (mut a, mut b) = (make(), make());
        for step in 0..3 {
            let batch = data.batch(step, 32);
            let la = a.train_step(&pjrt, &batch, ExecMode::Strict).unwrap().loss;
            let lb = b
                .train_step(&native, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            close(
                &format!("{interaction:?} loss at step {step}"),
                &[la],
                &[lb],
            );
        }
        let test = data.batch(99, 16);
        let pa = a.predict(&pjrt, &test).unwrap().to_vec();
        let pb = b.predict(&native, &test).unwrap().to_vec();
        close(&format!("{interaction:?} logits"), &pa, &pb);
        // Parameters after three updates: the gradients agreed too.
        for (p, q) in a
            .dense_arch_mut()
            .params()
            .iter()
            .zip(b.dense_arch_mut().params().iter())
        {
            close(&p.name, p.value, q.value);
        }
        let (ta, tb) = (
            a.sparse_arch().unsharded().unwrap(),
            b.sparse_arch().unsharded().unwrap(),
        );
        for (x, y) in ta.tables().iter().zip(tb.tables()) {
            close(x.name(), x.weights(), y.weights());
        }
    }
}

#[test]
fn the_compiled_step_trains_like_the_native_backend() {
    let Some(pjrt) = pjrt() else { return };
    let pjrt = std::sync::Arc::new(pjrt);
    let native = Backend::Native(NativeBackend::new(1));
    let optimizers = [
        DenseOptimizerConfig::adam(0.01),
        DenseOptimizerConfig::adagrad(0.05),
        DenseOptimizerConfig::sgd(0.1),
    ];
    for interaction in [
        InteractionType::Dot,
        InteractionType::Dcn { layers: 2, rank: 4 },
    ] {
        for dense_opt in optimizers {
            let config = DlrmConfig {
                tables: DlrmConfig::criteo_tables(&[40, 30, 20], 8),
                bottom_mlp: vec![13, 16, 8],
                top_mlp: vec![16, 8, 1],
                interaction,
            };
            let data = data(&config, DataGeneration::Learnable, 2, 3);
            let make = || {
                Dlrm::builder(config.clone())
                    .optimizers(TableOptimizer::rowwise_adagrad(0.05), dense_opt)
                    .seed(5)
                    .build()
                    .unwrap()
            };
            let (mut a, mut b) = (make(), make());
            let mut step = ember_models::CompiledDenseStep::new(pjrt.clone(), &mut a, 24).unwrap();
            // A warmup's rate changes every step: an argument of the compiled step.
            let warmup = ember_models::LrSchedule::LinearWarmup { steps: 3 };
            let scheduled = ember_models::Optimization {
                sparse_schedule: warmup,
                dense_schedule: warmup,
                ..Default::default()
            };
            for i in 0..3 {
                let batch = data.batch(i, 24);
                a.set_optimization(&scheduled, i).unwrap();
                b.set_optimization(&scheduled, i).unwrap();
                let la = a.train_step_compiled(&mut step, &batch).unwrap().loss;
                let lb = b
                    .train_step(&native, &batch, ExecMode::Strict)
                    .unwrap()
                    .loss;
                close(
                    &format!("{interaction:?} {dense_opt:?} loss {i}"),
                    &[la],
                    &[lb],
                );
            }
            step.sync_to_host(&mut a).unwrap();
            for (p, q) in a
                .dense_arch_mut()
                .params()
                .iter()
                .zip(b.dense_arch_mut().params().iter())
            {
                close(
                    &format!("{interaction:?} {dense_opt:?} {}", p.name),
                    p.value,
                    q.value,
                );
            }
            let (ta, tb) = (
                a.sparse_arch().unsharded().unwrap(),
                b.sparse_arch().unsharded().unwrap(),
            );
            for (x, y) in ta.tables().iter().zip(tb.tables()) {
                close(x.name(), x.weights(), y.weights());
            }
            assert_eq!(a.dense_optimizer().steps(), b.dense_optimizer().steps());
        }
    }
}

#[test]
fn random_models_and_batches_agree_across_backends_and_modes() {
    use ember_sparse::rng::Rng;
    let Some(pjrt) = pjrt() else { return };
    let pjrt = std::sync::Arc::new(pjrt);
    let native = Backend::Native(NativeBackend::new(2));
    let on_pjrt = Backend::Pjrt(pjrt.clone());
    let mut rng = Rng::new(77);
    let mut pick = |lo: usize, hi: usize| lo + rng.below((hi - lo + 1) as u64) as usize;
    for case in 0..6 {
        let dim = pick(2, 8);
        let num_tables = pick(1, 5);
        let rows: Vec<usize> = (0..num_tables).map(|_| pick(3, 60)).collect();
        let bottom = vec![13, pick(2, 20), dim];
        let mut top: Vec<usize> = (0..pick(0, 2)).map(|_| pick(2, 16)).collect();
        top.push(1);
        let interaction = match case % 2 {
            0 => InteractionType::Dot,
            _ => InteractionType::Dcn {
                layers: pick(1, 3),
                rank: pick(1, 6),
            },
        };
        let config = DlrmConfig {
            tables: DlrmConfig::criteo_tables(&rows, dim),
            bottom_mlp: bottom,
            top_mlp: top,
            interaction,
        };
        let batch_size = pick(1, 40);
        let data = data(&config, DataGeneration::Random, pick(1, 4), case);
        let opt = [
            DenseOptimizerConfig::sgd(0.1),
            DenseOptimizerConfig::adagrad(0.1),
            DenseOptimizerConfig::adam(0.01),
        ][case as usize % 3];
        let make = || {
            Dlrm::builder(config.clone())
                .optimizers(TableOptimizer::sgd(0.1), opt)
                .seed(case)
                .build()
                .unwrap()
        };
        let (mut want, mut strict, mut fused, mut compiled) = (make(), make(), make(), make());
        let mut step =
            ember_models::CompiledDenseStep::new(pjrt.clone(), &mut compiled, batch_size).unwrap();
        for i in 0..2 {
            let batch = data.batch(i, batch_size);
            let w = want
                .train_step(&native, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            let s = strict
                .train_step(&on_pjrt, &batch, ExecMode::Strict)
                .unwrap()
                .loss;
            let d = fused
                .train_step(&on_pjrt, &batch, ExecMode::DeferFuse)
                .unwrap()
                .loss;
            let c = compiled
                .train_step_compiled(&mut step, &batch)
                .unwrap()
                .loss;
            close(&format!("case {case} strict loss"), &[s], &[w]);
            close(&format!("case {case} defer-fuse loss"), &[d], &[w]);
            close(&format!("case {case} compiled loss"), &[c], &[w]);
        }
        step.sync_to_host(&mut compiled).unwrap();
        let test = data.batch(9, batch_size);
        let w = want.predict(&native, &test).unwrap().to_vec();
        close(
            &format!("case {case} strict logits"),
            strict.predict(&on_pjrt, &test).unwrap(),
            &w,
        );
        close(
            &format!("case {case} defer-fuse logits"),
            fused.predict(&on_pjrt, &test).unwrap(),
            &w,
        );
        close(
            &format!("case {case} compiled logits"),
            compiled.predict(&native, &test).unwrap(),
            &w,
        );
        for (((p, q), d), r) in want
            .dense_arch_mut()
            .params()
            .iter()
            .zip(strict.dense_arch_mut().params().iter())
            .zip(fused.dense_arch_mut().params().iter())
            .zip(compiled.dense_arch_mut().params().iter())
        {
            close(&format!("case {case} strict {}", p.name), q.value, p.value);
            close(
                &format!("case {case} defer-fuse {}", p.name),
                d.value,
                p.value,
            );
            close(
                &format!("case {case} compiled {}", p.name),
                r.value,
                p.value,
            );
        }
    }
}
