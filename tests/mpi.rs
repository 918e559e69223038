//! Multi-process runs under `mpirun` (feature `mpi`; needs Open MPI): ranks
//! train like one process with as many devices, for every sharding type
//! and with key-value tables; a
//! rank that dies or hangs stops the job with an error naming it; a resumed
//! run ends where an uninterrupted one does.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output};

use ember_models::{Checkpoint, Dlrm};

mod common;

fn ember(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs")
}

/// `mpirun -np N ember ARGS` with `env` exported to the ranks.
fn mpirun(np: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &np.to_string(),
    ]);
    for (k, v) in env {
        c.env(k, v).args(["-x", k]);
    }
    c.arg(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("mpirun runs (Open MPI: apt install openmpi-bin libopenmpi-dev)")
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Stdout and stderr of a job that must fail.
fn failed(what: &str, out: Output) -> String {
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{what} must fail the job: {text}");
    text
}

fn json(what: &str, out: Output) -> serde_json::Value {
    let text = ok(what, out);
    let last = text.trim().lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text}"))
}

fn close(what: &str, a: f64, b: f64, tol: f64) {
    assert!(
        (a - b).abs() <= tol * b.abs().max(1.0),
        "{what}: {a} vs {b}"
    );
}

/// Every table (weights and optimizer state) and dense parameter of two
/// checkpoints, to `tol` relative to each tensor's largest value.
fn same_model(what: &str, a: &Path, b: &Path, tol: f32) {
    let load = |p: &Path| -> Dlrm {
        let c = Checkpoint::open(p).unwrap_or_else(|e| panic!("{what}: {e}"));
        c.builder()
            .optimizers(c.table_optimizer().unwrap(), c.dense_optimizer().unwrap())
            .build()
            .unwrap()
    };
    let (mut x, mut y) = (load(a), load(b));
    let compare = |name: &str, u: &[f32], v: &[f32]| {
        assert_eq!(u.len(), v.len(), "{what} {name}");
        let scale = v.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for (i, (p, q)) in u.iter().zip(v).enumerate() {
            assert!(
                (p - q).abs() <= tol * scale,
                "{what} {name}[{i}]: {p} vs {q}"
            );
        }
    };
    {
        let (tx, ty) = (
            x.sparse_arch().unsharded().unwrap(),
            y.sparse_arch().unsharded().unwrap(),
        );
        let rows = |t: &ember::sparse::EmbeddingTable| {
            let mut out = vec![0f32; t.num_embeddings() * t.dim()];
            for (id, row) in out.chunks_exact_mut(t.dim()).enumerate() {
                t.read_row(id, row);
            }
            out
        };
        for (s, t) in tx.tables().iter().zip(ty.tables()) {
            assert_eq!(s.data_type(), t.data_type(), "{what}");
            compare(s.name(), &rows(s), &rows(t));
            compare(s.name(), s.optimizer_state(), t.optimizer_state());
        }
    }
    use ember_dense::HasParams;
    for (p, q) in x
        .dense_arch_mut()
        .params()
        .iter()
        .zip(y.dense_arch_mut().params().iter())
    {
        compare(&p.name, p.value, q.value);
    }
}

/// `bench dlrm` on a small model for `batches` batches of 64, one thread.
fn bench_args(batches: &str) -> Vec<&str> {
    vec![
        "bench",
        "dlrm",
        "--arch-embedding-size",
        "300-40-700-90",
        "--arch-sparse-feature-size",
        "8",
        "--arch-mlp-bot",
        "13-16-8",
        "--arch-mlp-top",
        "16-1",
        "--mini-batch-size",
        "64",
        "--num-batches",
        batches,
        "--devices-per-host",
        "2",
        "--threads",
        "1",
        "--json",
    ]
}

#[test]
fn ranks_train_like_one_process_with_as_many_devices() {
    let dir = tempfile::tempdir().unwrap();
    let base = bench_args("4");
    // The dense gradients are summed in another order over ranks than over
    // one batch, so the runs differ by rounding: with SGD within 1e-6; an
    // adaptive optimizer divides by the gradients' size and amplifies it
    // (to a few 1e-6 here), so it gets 1e-5.
    // fp16 and bf16 tables round each update stochastically by global
    // position: where the dense rounding moves an update across a rounding
    // threshold, a value lands one step (2^-10, 2^-7 of it) away.
    let cases = [
        ("table-wise", "sgd", 1e-6, "fp32"),
        ("row-wise", "sgd", 1e-6, "fp32"),
        ("row-wise-mod", "sgd", 1e-6, "fp32"),
        ("column-wise", "sgd", 1e-6, "fp32"),
        ("table-row-wise", "sgd", 1e-6, "fp32"),
        ("data-parallel", "sgd", 1e-6, "fp32"),
        ("row-wise", "adagrad", 1e-5, "fp32"),
        ("table-wise", "rowwise-adagrad", 1e-5, "fp32"),
        ("row-wise", "sgd", 2e-3, "fp16"),
        ("column-wise", "adagrad", 1e-2, "bf16"),
    ];
    for (kind, optimizer, tol, dtype) in cases {
        for np in [2, 4] {
            let what = format!("{kind} with {optimizer} on {np}, {dtype} tables");
            let (one, ranks) = (
                dir.path().join(format!("{kind}-{np}-{dtype}-one")),
                dir.path().join(format!("{kind}-{np}-{dtype}-ranks")),
            );
            let mut single: Vec<&str> = base.to_vec();
            let n = np.to_string();
            single.extend([
                "--optimizer",
                optimizer,
                "--table-dtype",
                dtype,
                "--sharding",
                kind,
                "--devices",
                &n,
            ]);
            let mut multi = single[..single.len() - 2].to_vec();
            single.extend(["--save", one.to_str().unwrap()]);
            multi.extend(["--save", ranks.to_str().unwrap()]);
            let a = json(&format!("{what}: one process"), ember(&single));
            let b = json(&format!("{what}: mpirun"), mpirun(np, &multi, &[]));
            assert_eq!(b["world_size"], np, "{what}");
            assert_eq!(a["world_size"], 1, "{what}");
            for key in ["loss_first", "loss_last"] {
                close(
                    &format!("{what} {key}"),
                    b[key].as_f64().unwrap(),
                    a[key].as_f64().unwrap(),
                    tol,
                );
            }
            let sent = b["sharding"]["per_device_bytes_sent_per_step"]
                .as_array()
                .unwrap();
            assert_eq!(sent.len(), np, "{what}: bytes of every rank");
            assert!(
                sent.iter().all(|v| v.as_f64().unwrap() > 0.0),
                "{what}: every rank exchanges (the dense all-reduce at least)"
            );
            same_model(&what, &one.join("model.safetensors"), &ranks, tol as f32);
        }
    }
}

#[test]
fn key_value_tables_on_ranks_hold_the_ids_one_process_holds() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("buckets.json");
    let sizes = [
        ("t_cat_0", 300),
        ("t_cat_1", 40),
        ("t_cat_2", 700),
        ("t_cat_3", 90),
    ];
    std::fs::write(&plan, common::bucket_plan(&sizes, 8, 50)).unwrap();
    // Every table but the 40-row one key-value: each whole on one rank
    // (planned), or split by buckets over both (the plan file).
    let kv = [
        "--kv-min-rows",
        "50",
        "--kv-admission",
        "count:2:1024",
        "--kv-eviction",
        "lfu",
    ];
    let placed = [
        ("table-wise", vec!["--devices", "2"]),
        ("by buckets", vec!["--plan", plan.to_str().unwrap()]),
    ];
    for (k, (what, place)) in placed.iter().enumerate() {
        let what = format!("key-value tables {what}");
        let base = [&bench_args("6")[..], &kv].concat();
        let (one, ranks) = (
            dir.path().join(format!("one{k}")),
            dir.path().join(format!("ranks{k}")),
        );
        let single = [&base[..], place, &["--save", one.to_str().unwrap()]].concat();
        // A plan file goes to the ranks too; --devices is their number.
        let on_ranks = if k == 1 { &place[..] } else { &[][..] };
        let multi = [&base[..], on_ranks, &["--save", ranks.to_str().unwrap()]].concat();
        let a = json(&format!("{what}: one process"), ember(&single));
        let b = json(&format!("{what}: mpirun"), mpirun(2, &multi, &[]));
        assert_eq!(b["world_size"], 2);
        // Admission and eviction follow the ids alone: the same figures.
        let tables = &a["key_value_tables"];
        assert_eq!(tables.as_array().map(Vec::len), Some(3), "{a}");
        assert_eq!(&b["key_value_tables"], tables, "{what}: {b}");
        let loss = |r: &serde_json::Value| r["loss_last"].as_f64().unwrap();
        // The default optimizer is adaptive: rounding as above, to 1e-5.
        close(&what, loss(&b), loss(&a), 1e-5);
        // One process saves shards of buckets as a set too.
        let file = one.join("model.safetensors");
        let saved = if file.exists() { file } else { one.clone() };
        same_model(&what, &saved, &ranks, 1e-5);
    }
}

#[test]
fn the_pipeline_on_ranks_gives_the_bits_of_the_order_in_turn() {
    // Each rank routes the next batch on its own MPI channel while this
    // one computes; in turn (--no-pipeline) it routes inside the step.
    let dir = tempfile::tempdir().unwrap();
    for (np, kind) in [(2, "row-wise"), (4, "table-row-wise"), (2, "data-parallel")] {
        let mut last = Vec::new();
        for pipeline in [true, false] {
            let what = format!("{kind} on {np}, pipeline {pipeline}");
            let save = dir.path().join(format!("{kind}-{np}-{pipeline}"));
            let mut args = bench_args("6");
            args.extend([
                "--optimizer",
                "adagrad",
                "--sharding",
                kind,
                "--save",
                save.to_str().unwrap(),
            ]);
            if !pipeline {
                args.push("--no-pipeline");
            }
            let out = json(&what, mpirun(np, &args, &[]));
            last.push((out["loss_first"].clone(), out["loss_last"].clone(), save));
        }
        assert_eq!(
            (&last[0].0, &last[0].1),
            (&last[1].0, &last[1].1),
            "{kind} on {np}: losses"
        );
        same_model(&format!("{kind} on {np}"), &last[0].2, &last[1].2, 0.0);
    }
}

/// Training flags of the failure test: small tables, checkpoints every 5 steps.
fn train_args<'a>(data: &'a str, ckpt: &'a str, steps: &'a str) -> Vec<&'a str> {
    vec![
        "train",
        "--data",
        data,
        "--max-ind-range",
        "400",
        "--arch-sparse-feature-size",
        "8",
        "--arch-mlp-bot",
        "13-16-8",
        "--arch-mlp-top",
        "16-1",
        "--mini-batch-size",
        "64",
        "--sharding",
        "row-wise",
        "--optimizer",
        "adagrad",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "5",
        "--max-steps",
        steps,
        "--epochs",
        "3",
        "--threads",
        "1",
    ]
}

#[test]
fn a_dead_or_hung_rank_stops_the_job_and_resume_ends_like_a_run_that_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let data = p("data");
    ok(
        "ingest",
        ember(&[
            "ingest",
            "synthetic",
            "--rows",
            "4096",
            "--output",
            &data,
            "--row-group-size",
            "256",
            "--max-ind-range",
            "400",
        ]),
    );
    let whole = p("whole");
    let mut args = train_args(&data, &whole, "22");
    args.push("--json");
    let summary = json("uninterrupted", mpirun(2, &args, &[]));
    assert_eq!(summary["world_size"], 2, "{summary}");
    let sent = summary["per_rank_bytes_sent"].as_array().unwrap();
    assert!(sent.len() == 2 && sent.iter().all(|b| b.as_u64().unwrap() > 0));

    // Rank 1 killed at step 12: mpirun stops the job and names the rank.
    let stopped = p("stopped");
    let out = mpirun(
        2,
        &train_args(&data, &stopped, "22"),
        &[("EMBER_FAULT", "1:12:kill"), ("EMBER_PEER_TIMEOUT", "20")],
    );
    let text = failed("a killed rank", out);
    assert!(text.contains("rank 1"), "the dead rank is named: {text}");

    // Rank 1 hung at step 7: rank 0 gives up after the timeout, naming it.
    let hung = p("hung");
    let out = mpirun(
        2,
        &train_args(&data, &hung, "22"),
        &[("EMBER_FAULT", "1:7:hang"), ("EMBER_PEER_TIMEOUT", "2")],
    );
    let text = failed("a hung rank", out);
    assert!(
        text.contains("rank 1 did not exchange for 2 s"),
        "the hung rank is named: {text}"
    );

    // Resumed from the checkpoint at step 10: the end equals the uninterrupted run's.
    let mut resume = train_args(&data, &stopped, "22");
    resume.push("--resume");
    let out = ok("resume", mpirun(2, &resume, &[]));
    assert!(out.contains("resuming from"), "{out}");
    // The same ranks, so the same sums: exactly.
    same_model(
        "resumed vs uninterrupted",
        Path::new(&stopped),
        Path::new(&whole),
        0.0,
    );

    // The set reads back under another number of ranks, each reading only
    // its rows, and in one process: rewritten with no step taken, it holds
    // the same tensors.
    ok("read on 4 ranks", mpirun(4, &resume, &[]));
    same_model(
        "read on 4 ranks",
        Path::new(&stopped),
        Path::new(&whole),
        0.0,
    );
    let mut one = train_args(&data, &stopped, "22");
    one.extend(["--resume", "--devices", "3"]);
    ok("read in one process", ember(&one));
    assert!(Path::new(&stopped).join("model.safetensors").exists());
    assert!(!Path::new(&stopped)
        .join("model.safetensors.index.json")
        .exists());
    same_model(
        "read in one process",
        &Path::new(&stopped).join("model.safetensors"),
        Path::new(&whole),
        0.0,
    );
    // And training goes on from there on 4 ranks.
    let mut more = train_args(&data, &stopped, "26");
    more.push("--resume");
    let out = ok("train on 4 ranks", mpirun(4, &more, &[]));
    assert!(out.contains("26 steps"), "{out}");
}

#[test]
fn ranks_cache_their_own_disk_tier_shards_save_them_as_a_set_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let tier = p("tier");
    // Devices of 1 MiB cannot hold the 26 tables of 3,000 rows (5 MB with
    // their state): the planner puts most on the disk tier, caches of 30%
    // (900 rows, at least 8 batches of 64 ids), each rank caching its own.
    let on_disk = [
        "--disk-dir",
        &tier,
        "--cache-memory",
        "30%",
        "--memory-per-device",
        "1MiB",
    ];
    let data = p("data");
    let tables = ["3000"; 26].join("-");
    ok(
        "ingest",
        ember(&[
            "ingest",
            "synthetic",
            "--rows",
            "2048",
            "--output",
            &data,
            "--row-group-size",
            "256",
            "--arch-embedding-size",
            &tables,
        ]),
    );
    let train = |ranks: usize, ckpt: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            &data,
            "--arch-embedding-size",
            &tables,
            "--arch-sparse-feature-size",
            "8",
            "--arch-mlp-bot",
            "13-16-8",
            "--arch-mlp-top",
            "16-1",
            "--mini-batch-size",
            "64",
            "--sharding",
            "row-wise",
            "--optimizer",
            "adagrad",
            "--checkpoint-dir",
            ckpt,
            "--checkpoint-every",
            "5",
            "--epochs",
            "2",
            "--threads",
            "1",
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&format!("train {extra:?}"), mpirun(ranks, &args, &[]))
    };
    let (ram, disk) = (p("ram"), p("disk"));
    let a = train(2, &ram, &[]);
    let stopped = [&on_disk[..], &["--max-steps", "20"]].concat();
    let b = train(2, &disk, &stopped);
    let hit = b["disk_tier"]["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{b}");
    // Resharded on ranks through its set: the same checkpoint resumed on 4
    // ranks (another plan), each reading only its shards' pieces onto its
    // disk tier, trains on.
    let moved = p("moved");
    std::fs::create_dir(&moved).unwrap();
    for f in std::fs::read_dir(&disk).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, Path::new(&moved).join(f.file_name().unwrap())).unwrap();
    }
    let r = train(4, &moved, &[&on_disk[..], &["--resume"]].concat());
    assert_eq!(r["resumed_at_step"], 20);
    // The rest of epoch 0 is skipped (its position counts 2 ranks'
    // batches); epoch 1 is whole: 32 batches of 64.
    assert_eq!(r["steps"], 20 + 32, "{r}");
    assert!(r["disk_tier"]["hit_rate"].as_f64().unwrap() > 0.0, "{r}");
    // Resumed from the set at step 20 onto the ranks' disk tiers: the end
    // is the RAM run's, bit for bit.
    let c = train(2, &disk, &[&on_disk[..], &["--resume"]].concat());
    assert_eq!(c["resumed_at_step"], 20);
    assert_eq!(
        (&c["steps"], &c["loss_last"]),
        (&a["steps"], &a["loss_last"])
    );
    same_model("disk tier on ranks", Path::new(&disk), Path::new(&ram), 0.0);
    // The tables' files went with the runs.
    assert_eq!(std::fs::read_dir(&tier).unwrap().count(), 0);
}
