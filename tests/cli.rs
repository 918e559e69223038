//! End-to-end runs of the `ember` binary on small shapes: the JSON reports
//! carry the promised fields, and bad flags give clear errors.

use std::process::Command;

mod common;

fn ember(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs")
}

/// Stderr of a run that must fail.
fn fails(args: &[&str]) -> String {
    let out = ember(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "ember {args:?} must fail: {err}");
    err
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = ember(args);
    assert!(
        out.status.success(),
        "ember {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"))
}

#[test]
fn bench_dlrm_json_has_the_promised_fields() {
    for op in ["dot", "dcn"] {
        let v = json(&[
            "bench",
            "dlrm",
            "--arch-sparse-feature-size",
            "8",
            "--arch-embedding-size",
            "50-60-70",
            "--arch-mlp-bot",
            "13-16-8",
            "--arch-mlp-top",
            "16-1",
            "--arch-interaction-op",
            op,
            "--dcn-low-rank-dim",
            "4",
            "--mini-batch-size",
            "64",
            "--num-batches",
            "6",
            "--test-freq",
            "3",
            "--test-num-batches",
            "2",
            "--threads",
            "2",
            "--json",
        ]);
        for field in [
            "samples_per_s",
            "ids_per_s",
            "step_ms_median",
            "loss_first",
            "loss_last",
            "auc",
            "logloss",
            "peak_rss_bytes",
        ] {
            assert!(v[field].is_number(), "{op}: {field} missing in {v}");
        }
        for phase in [
            "sparse_forward",
            "dense_forward",
            "dense_backward",
            "sparse_backward_update",
        ] {
            assert!(v["phase_ms"][phase].as_f64().unwrap() >= 0.0);
        }
        assert_eq!(
            v["architecture"]["config"]["tables"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
    }
}

#[test]
fn bench_dlrm_single_batch_reports_numbers() {
    let v = json(&[
        "bench",
        "dlrm",
        "--num-batches",
        "1",
        "--mini-batch-size",
        "8",
        "--json",
    ]);
    assert!(v["samples_per_s"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn bench_dlrm_is_reproducible() {
    let args = [
        "bench",
        "dlrm",
        "--arch-embedding-size",
        "100-100",
        "--arch-mlp-bot",
        "13-4-2",
        "--mini-batch-size",
        "32",
        "--num-batches",
        "5",
        "--data-generation",
        "learnable",
        "--json",
        "--threads",
        "1",
    ];
    let (a, b) = (json(&args), json(&args));
    assert_eq!(a["loss_first"], b["loss_first"]);
    assert_eq!(a["loss_last"], b["loss_last"]);
}

#[test]
fn bench_embedding_reports_roofline() {
    let v = json(&[
        "bench",
        "embedding",
        "--tables",
        "3",
        "--rows",
        "1000",
        "--dim",
        "16",
        "--batch",
        "64",
        "--pooling-factor",
        "4",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--roofline",
        "--json",
    ]);
    for field in [
        "ids_per_s",
        "samples_per_s",
        "gb_per_s",
        "peak_rss_bytes",
        "limit_ids_per_s",
        "fraction_of_limit",
    ] {
        assert!(v[field].as_f64().unwrap() > 0.0, "{field} in {v}");
    }
    assert_eq!(v["optimizer"], "none");
    let v = json(&[
        "bench",
        "embedding",
        "--tables",
        "2",
        "--rows",
        "100",
        "--dim",
        "8",
        "--batch",
        "16",
        "--optimizer",
        "adam",
        "--iters",
        "2",
        "--json",
    ]);
    assert_eq!(v["optimizer"], "adam");
    assert!(v["ids_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["id_distribution"]["kind"], "uniform");
}

#[test]
fn bench_embedding_on_the_disk_tier() {
    let dir = std::env::temp_dir().join(format!("ember-tier-{}", std::process::id()));
    let args = |extra: &[&str]| {
        let mut a = vec![
            "bench",
            "embedding",
            "--tables",
            "3",
            "--rows",
            "5000",
            "--dim",
            "16",
            "--batch",
            "64",
            "--optimizer",
            "rowwise-adagrad",
            "--iters",
            "6",
            "--warmup",
            "2",
            "--input-batches",
            "8",
            "--id-distribution",
            "zipf",
            "--json",
        ];
        a.extend_from_slice(extra);
        a.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let run = |extra: &[&str]| {
        let owned = args(extra);
        json(&owned.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let ram = run(&[]);
    assert!(ram.get("disk_tier").is_none());
    let disk = run(&["--disk-dir", dir.to_str().unwrap(), "--cache-memory", "20%"]);
    let tier = &disk["disk_tier"];
    // 20% of 5000 rows, rounded to whole sets of 16 (8 batches of 64 fit).
    assert_eq!(tier["cache_rows_per_table"], 992, "{disk}");
    let hit = tier["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{disk}");
    // The cache holds every row the 8 batches use: each miss is a row's
    // first lookup, made from the seed rather than read.
    assert_eq!(tier["hit_rate_bound"].as_f64().unwrap(), hit, "{disk}");
    assert_eq!(tier["bytes_read_per_iter"].as_f64().unwrap(), 0.0, "{disk}");
    // The tables' files are gone with the run.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
    for (extra, needle) in [
        (&["--cache-memory", "0%"][..], "--cache-memory"),
        (&["--cache-memory", "1KiB?"][..], "--cache-memory"),
        (&["--cache-memory", "5%"][..], "8 batches"),
        (&["--roofline"][..], "--roofline"),
    ] {
        let mut a = args(&["--disk-dir", dir.to_str().unwrap()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        let out = ember(&a.iter().map(String::as_str).collect::<Vec<_>>());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A disk that refuses the tables' files (here a file size limit, with
/// its signal ignored as a full disk has none): an error naming the table
/// and its file, exit code 1, and no file left behind.
#[test]
fn a_disk_tier_file_the_disk_refuses_is_an_error() {
    let dir = std::env::temp_dir().join(format!("ember-tier-full-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let command = format!(
        "trap '' XFSZ; ulimit -f 64; exec {} bench embedding --tables 1 --rows 100000 --dim 16 \
         --batch 64 --iters 1 --input-batches 8 --disk-dir {}",
        env!("CARGO_BIN_EXE_ember"),
        dir.display()
    );
    let out = Command::new("sh").args(["-c", &command]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("t0") && err.contains(".rows"), "{err}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_dlrm_on_the_disk_tier_trains_as_in_ram() {
    let dir = std::env::temp_dir().join(format!("ember-dlrm-tier-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let base = [
        "bench",
        "dlrm",
        "--arch-embedding-size",
        "40000-50-30000",
        "--arch-sparse-feature-size",
        "4",
        "--arch-mlp-bot",
        "13-8-4",
        "--arch-mlp-top",
        "8-1",
        "--mini-batch-size",
        "64",
        "--num-batches",
        "12",
        "--num-indices-per-lookup",
        "2",
        "--data-generation",
        "learnable",
        "--id-distribution",
        "zipf",
        "--json",
    ];
    let ram = json(&base);
    let mut args = base.to_vec();
    args.extend(["--disk-dir", d, "--cache-memory", "20%"]);
    let disk = json(&args);
    assert_eq!(ram["loss_last"], disk["loss_last"], "{disk}");
    let mut ahead = args.clone();
    ahead.push("--read-ahead");
    assert_eq!(ram["loss_last"], json(&ahead)["loss_last"]);
    // Under LFU too: a policy chooses only which rows are read.
    let lfu = json(&[&args[..], &["--cache-policy", "lfu"]].concat());
    assert_eq!(ram["loss_last"], lfu["loss_last"]);
    assert_eq!(disk["disk_tier"]["cache_policy"], "lru", "{disk}");
    assert_eq!(lfu["disk_tier"]["cache_policy"], "lfu", "{lfu}");
    let hit = disk["disk_tier"]["hit_rate"].as_f64().unwrap();
    assert!(hit > 0.0 && hit < 1.0, "{disk}");
    // Saved, the disk-tier tables stream into the RAM run's checkpoint.
    let saved = |args: &[&str], name: &str| {
        let out = dir.join(name);
        json(&[args, &["--save", out.to_str().unwrap()]].concat());
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut all: Vec<(String, Vec<u8>)> = (file.tensors().into_iter())
            .map(|(n, t)| (n, t.data().to_vec()))
            .collect();
        all.sort();
        all
    };
    assert!(saved(&base, "ram") == saved(&args, "disk"));
    // Planned over two devices of 500 KiB: the two large tables (800 and
    // 600 KB with their state) cannot fit, so the planner puts them on
    // the disk tier, each device caching its own; table-wise keeps the
    // unsharded order of sums, so the run ends as in RAM.
    let two = [
        "--devices",
        "2",
        "--sharding",
        "table-wise",
        "--memory-per-device",
        "500KiB",
    ];
    let planned = json(&[&args[..], &two].concat());
    assert_eq!(ram["loss_last"], planned["loss_last"], "{planned}");
    let shards = planned["sharding"]["shards"].to_string();
    assert!(
        shards.contains("t_cat_0:table_wise+disk") && shards.contains("t_cat_2:table_wise+disk"),
        "{shards}"
    );
    assert!(
        !shards.contains("t_cat_1:table_wise+disk"),
        "the small table stays in memory: {shards}"
    );
    assert!(planned["disk_tier"]["hit_rate"].as_f64().unwrap() > 0.0);
    // Without --disk-dir the plan cannot place them.
    assert!(fails(&[&base[..], &two].concat()).contains("do not fit"));
    // `ember plan` writes the same placement; a run under it needs
    // --disk-dir for the files.
    let plan_file = dir.join("plan.json");
    let plan = [
        "plan",
        "--output",
        plan_file.to_str().unwrap(),
        "--arch-embedding-size",
        "40000-50-30000",
        "--arch-sparse-feature-size",
        "4",
        "--arch-mlp-bot",
        "13-8-4",
        "--arch-mlp-top",
        "8-1",
        "--mini-batch-size",
        "64",
        "--num-indices-per-lookup",
        "2",
        "--disk-dir",
        d,
        "--cache-memory",
        "20%",
        "--json",
    ];
    json(&[&plan[..], &two].concat());
    let text = std::fs::read_to_string(&plan_file).unwrap();
    assert!(text.contains("\"cache_rows\""), "{text}");
    let under = ["--plan", plan_file.to_str().unwrap()];
    assert!(fails(&[&base[..], &under].concat()).contains("give --disk-dir"));
    let planned_run = json(&[&args[..], &under].concat());
    assert_eq!(ram["loss_last"], planned_run["loss_last"]);
    // Saved, the shards stream into a set (never gathered into memory).
    let out = dir.join("sharded");
    let save = ["--save", out.to_str().unwrap()];
    json(&[&args[..], &two, &save].concat());
    assert!(out.join("model.safetensors.index.json").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn benches_report_the_id_distribution() {
    let small = ["--iters", "1", "--warmup", "0", "--json"];
    let embedding = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "embedding",
            "--tables",
            "2",
            "--rows",
            "500",
            "--dim",
            "8",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&small);
        json(&args)
    };
    let v = embedding(&["--id-distribution", "zipf"]);
    assert_eq!(v["id_distribution"]["kind"], "zipf");
    assert_eq!(v["id_distribution"]["alpha"], 1.0);
    let v = embedding(&["--zipf-alpha", "1.3"]);
    assert_eq!(v["id_distribution"]["alpha"], 1.3);
    let dlrm = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "dlrm",
            "--arch-embedding-size",
            "100-100",
            "--arch-mlp-bot",
            "13-4-2",
            "--mini-batch-size",
            "16",
            "--num-batches",
            "2",
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&args)
    };
    assert!(dlrm(&[]).get("id_distribution").is_none());
    let v = dlrm(&["--id-distribution", "zipf", "--zipf-alpha", "0.9"]);
    assert_eq!(v["id_distribution"]["alpha"], 0.9);
}

#[test]
fn bad_flags_are_named() {
    let err = fails(&["bench", "dlrm", "--arch-mlp-bot", "13-x-2"]);
    assert!(
        err.contains("--arch-mlp-bot") && err.contains("'x'"),
        "{err}"
    );
    let err = fails(&[
        "bench",
        "dlrm",
        "--arch-mlp-bot",
        "13-4-3",
        "--arch-sparse-feature-size",
        "2",
    ]);
    assert!(err.contains("embedding dim"), "{err}");
    // Each bad value is an error naming it (exit code 1 from anyhow, 2 from
    // clap's own parsing), never a panic (101).
    for (args, needle) in [
        (
            &["bench", "dlrm", "--arch-embedding-size", "5-0"][..],
            "--arch-embedding-size",
        ),
        (
            &["bench", "dlrm", "--mini-batch-size", "0"][..],
            "--mini-batch-size",
        ),
        (
            &["bench", "dlrm", "--max-ind-range", "0"][..],
            "--max-ind-range",
        ),
        (&["bench", "dlrm", "--threads", "0"][..], "--threads"),
        (
            &["bench", "dlrm", "--learning-rate", "NaN"][..],
            "--learning-rate",
        ),
        (
            &[
                "bench",
                "dlrm",
                "--test-freq",
                "1",
                "--test-num-batches",
                "0",
            ][..],
            "--test-num-batches",
        ),
        (&["bench", "embedding", "--rows", "0"][..], "--rows"),
        (
            &["bench", "embedding", "--roofline", "--optimizer", "sgd"][..],
            "--roofline",
        ),
        (&["bench", "embedding", "--dim", "abc"][..], "--dim"),
        (
            &["bench", "embedding", "--zipf-alpha", "0"][..],
            "--zipf-alpha",
        ),
        (
            &[
                "bench",
                "dlrm",
                "--id-distribution",
                "uniform",
                "--zipf-alpha",
                "1.1",
            ][..],
            "--zipf-alpha",
        ),
        (
            &["bench", "embedding", "--id-distribution", "pareto"][..],
            "--id-distribution",
        ),
    ] {
        let out = ember(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(1 | 2)), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn plan_then_bench_sharded_with_every_type() {
    let dir = std::env::temp_dir().join(format!("ember-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plan = dir.join("plan.json");
    let arch = [
        "--arch-sparse-feature-size",
        "4",
        "--arch-embedding-size",
        "300-20-90-7",
        "--arch-mlp-bot",
        "13-8-4",
        "--arch-mlp-top",
        "8-1",
    ];
    let mut args = vec![
        "plan",
        "--devices",
        "3",
        "--memory-per-device",
        "1GiB",
        "--output",
        plan.to_str().unwrap(),
        "--json",
    ];
    args.extend(arch);
    let p = json(&args);
    assert_eq!(p["stats"]["devices"].as_array().unwrap().len(), 3);
    // The written plan runs, and so does every forced type; losses agree
    // with the unsharded run (the same model and data).
    let bench = |extra: &[&str]| {
        let mut a = vec![
            "bench",
            "dlrm",
            "--mini-batch-size",
            "32",
            "--num-batches",
            "3",
            "--threads",
            "2",
            "--json",
        ];
        a.extend(arch);
        a.extend_from_slice(extra);
        json(&a)
    };
    let plain = bench(&[]);
    assert!(plain.get("sharding").is_none());
    let from_file = bench(&["--plan", plan.to_str().unwrap()]);
    assert_eq!(from_file["sharding"]["devices"], 3);
    // The unsharded run every sharding type must match.
    let unsharded = bench(&["--optimizer", "adagrad"]);
    for kind in [
        "table-wise",
        "row-wise",
        "row-wise-mod",
        "column-wise",
        "table-row-wise",
        "data-parallel",
    ] {
        let v = bench(&[
            "--devices",
            "2",
            "--sharding",
            kind,
            "--optimizer",
            "adagrad",
        ]);
        let sh = &v["sharding"];
        assert_eq!(sh["devices"], 2, "{kind}");
        assert_eq!(
            sh["per_device_lookups_per_step"].as_array().unwrap().len(),
            2
        );
        assert!(sh["stage_ms"]["input_dist"].is_number());
        let (x, y) = (
            v["loss_last"].as_f64().unwrap(),
            unsharded["loss_last"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < 1e-5, "{kind}: {x} vs {y}");
    }
    // A hand-edited plan with a table missing is refused, naming it and the file.
    let text = std::fs::read_to_string(&plan).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    value["tables"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["table"] != "t_cat_2");
    std::fs::write(&plan, value.to_string()).unwrap();
    let mut a = vec![
        "bench",
        "dlrm",
        "--num-batches",
        "1",
        "--plan",
        plan.to_str().unwrap(),
    ];
    a.extend(arch);
    let err = fails(&a);
    assert!(
        err.contains("t_cat_2") && err.contains("plan.json"),
        "{err}"
    );
    // Too little memory: the error lists the tables and what is missing.
    let mut a = vec![
        "plan",
        "--devices",
        "2",
        "--memory-per-device",
        "10KB",
        "--output",
        plan.to_str().unwrap(),
    ];
    a.extend(arch);
    let err = fails(&a);
    assert!(err.contains("t_cat_0") && err.contains("missing"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn pjrt_backend_trains_like_native_and_a_second_run_hits_the_compile_cache() {
    if ember::dense::pjrt::plugin_for_tests().is_none() {
        return;
    }
    let cache = std::env::temp_dir().join(format!("ember-cli-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let args = |backend: &'static str| {
        let mut a = vec![
            "bench",
            "dlrm",
            "--arch-embedding-size",
            "50-60-70",
            "--arch-mlp-bot",
            "13-8-2",
            "--arch-interaction-op",
            "dcn",
            "--dcn-low-rank-dim",
            "4",
            "--mini-batch-size",
            "32",
            "--num-batches",
            "4",
            "--threads",
            "2",
            "--json",
            "--dense-backend",
            backend,
        ];
        a.extend(["--compile-cache", cache.to_str().unwrap()]);
        a
    };
    let native = json(&args("native"));
    let first = json(&args("pjrt"));
    assert_eq!(first["backend"], "pjrt");
    assert!(first["compiles"].as_u64().unwrap() > 0);
    let (x, y) = (
        first["loss_last"].as_f64().unwrap(),
        native["loss_last"].as_f64().unwrap(),
    );
    assert!(
        (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
        "pjrt {x} vs native {y}"
    );
    let second = json(&args("pjrt"));
    assert_eq!(second["compiles"], 0);
    assert_eq!(second["compile_cache_hits"], first["compiles"]);
    assert_eq!(second["loss_last"], first["loss_last"]);
    // A cache path that is a file: the run goes on uncached, and says so.
    let file = cache.with_extension("file");
    std::fs::write(&file, b"").unwrap();
    let mut uncached = args("pjrt");
    *uncached.last_mut().unwrap() = file.to_str().unwrap();
    let out = ember(&uncached);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("not cached"), "{err}");
    let _ = std::fs::remove_file(&file);
    // The whole dense step as one executable: the same training, evaluated on the host.
    let mut compiled = args("pjrt");
    compiled.extend([
        "--mode",
        "compiled",
        "--test-freq",
        "2",
        "--test-num-batches",
        "1",
    ]);
    let c = json(&compiled);
    assert_eq!(c["mode"], "compiled");
    let z = c["loss_last"].as_f64().unwrap();
    assert!(
        (z - y).abs() <= 1e-5 * (1.0 + y.abs()),
        "compiled {z} vs native {y}"
    );
    assert!(c["auc"].is_number());
    let mut debug = args("pjrt");
    debug.extend(["--mode", "debug"]);
    let dbg = json(&debug);
    assert_eq!(dbg["mode"], "debug");
    assert_eq!(dbg["loss_last"], first["loss_last"]);
    // One recorded window per step: one program, the same training.
    let mut fused = args("pjrt");
    fused.extend(["--mode", "defer-fuse"]);
    let f = json(&fused);
    assert_eq!(f["mode"], "defer-fuse");
    assert_eq!(
        f["compiles"].as_u64().unwrap() + f["compile_cache_hits"].as_u64().unwrap(),
        1
    );
    let v = f["loss_last"].as_f64().unwrap();
    assert!(
        (v - y).abs() <= 1e-5 * (1.0 + y.abs()),
        "defer-fuse {v} vs native {y}"
    );
    for mode in ["compiled", "defer-fuse"] {
        let mut wrong = args("native");
        wrong.extend(["--mode", mode]);
        let err = fails(&wrong);
        assert!(
            err.contains(&format!("--mode {mode}")) && err.contains("--dense-backend pjrt"),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn absurd_flag_values_are_refused_before_anything_is_allocated() {
    // Each once aborted (an allocation of terabytes), panicked (an
    // overflow) or was silently saturated; now each is exit code 1 with a
    // message naming the flag, or the estimate that cannot fit.
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("syn");
    let plan = dir.path().join("plan.json");
    let (data, plan) = (data.to_str().unwrap(), plan.to_str().unwrap());
    json(&[
        "ingest",
        "synthetic",
        "--rows",
        "300",
        "--output",
        data,
        "--json",
    ]);
    for (args, needle) in [
        (
            &[
                "bench",
                "loader",
                "--data",
                data,
                "--prefetch",
                "1000000000",
            ][..],
            "--prefetch",
        ),
        (
            &[
                "bench",
                "loader",
                "--data",
                data,
                "--prefetch",
                "18446744073709551615",
            ][..],
            "--prefetch",
        ),
        (
            &[
                "bench",
                "loader",
                "--data",
                data,
                "--loader-threads",
                "100000",
            ][..],
            "--loader-threads",
        ),
        (
            &["bench", "loader", "--data", data, data][..],
            "given twice",
        ),
        (
            &[
                "plan",
                "--devices",
                "18446744073709551615",
                "--output",
                plan,
            ][..],
            "--devices",
        ),
        (
            &["plan", "--devices", "4097", "--output", plan][..],
            "at most 4096",
        ),
        (&["bench", "dlrm", "--devices", "100000"][..], "--devices"),
        (&["bench", "dlrm", "--threads", "100000"][..], "--threads"),
        (
            &["bench", "dlrm", "--arch-mlp-top", "100000000-1"][..],
            "needs at least",
        ),
        (
            &["bench", "dlrm", "--arch-mlp-bot", "4-100000000-2"][..],
            "needs at least",
        ),
        (
            &[
                "bench",
                "dlrm",
                "--num-indices-per-lookup",
                "100000000",
                "--num-indices-per-lookup-fixed",
            ][..],
            "batches in flight",
        ),
        (
            &[
                "bench",
                "dlrm",
                "--arch-interaction-op",
                "dcn",
                "--dcn-low-rank-dim",
                "100000000",
            ][..],
            "needs at least",
        ),
        (
            &[
                "bench",
                "dlrm",
                "--arch-interaction-op",
                "dcn",
                "--dcn-num-layers",
                "1000000",
            ][..],
            "at most 128",
        ),
        (
            &["bench", "embedding", "--pooling-factor", "1000000000"][..],
            "--pooling-factor",
        ),
        (
            &["bench", "embedding", "--batch", "1000000000"][..],
            "needs at least",
        ),
    ] {
        let out = ember(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    for size in [
        "18446744073709551616",
        "18446744073709551615TiB",
        "99999999999999999999999999GiB",
    ] {
        let args = [
            "plan",
            "--devices",
            "2",
            "--memory-per-device",
            size,
            "--output",
            plan,
        ];
        let err = fails(&args);
        assert!(
            err.contains("--memory-per-device") && err.contains("more than"),
            "{err}"
        );
    }
    assert!(!std::path::Path::new(plan).exists());
}

#[test]
fn bench_hstu_reports_its_split_and_padded_against_jagged() {
    let args = [
        "bench",
        "hstu",
        "--preset",
        "ml1m",
        "--layers",
        "1",
        "--max-seq-len",
        "40",
        "--batch-size",
        "8",
        "--num-batches",
        "2",
        "--padded",
        "--json",
    ];
    let r = json(&args);
    assert_eq!(r["shape"]["num_heads"], 1);
    assert_eq!(r["shape"]["max_seq_len"], 40);
    assert!(r["samples_per_s"].as_f64().unwrap() > 0.0, "{r}");
    let s = &r["split"];
    let parts = ["lookup_ms", "attention_ms", "rest_ms"].map(|k| s[k].as_f64().unwrap());
    assert!(parts.iter().all(|&p| p >= 0.0), "{s}");
    let sum: f64 = parts.iter().sum();
    assert!((sum - s["step_ms"].as_f64().unwrap()).abs() < 1e-6, "{s}");
    assert!(r["gemm_peak_gflops"].as_f64().unwrap() > 0.0);
    let p = &r["padded"];
    assert!(p["token_ratio"].as_f64().unwrap() >= 1.0, "{p}");
    assert!(p["tokens_per_batch"].as_f64().unwrap() >= r["tokens_per_batch"].as_f64().unwrap());
    assert!(r["run"]["command"].as_str().unwrap().contains("bench hstu"));
    for (flag, value) in [
        ("--num-heads", "0"),
        ("--length-alpha", "0"),
        ("--max-seq-len", "0"),
    ] {
        let err = fails(&["bench", "hstu", "--preset", "ml1m", flag, value]);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

#[test]
fn key_value_tables_from_the_command_line() {
    let dir = std::env::temp_dir().join(format!("ember-kv-{}", std::process::id()));
    let base = [
        "bench",
        "dlrm",
        "--arch-embedding-size",
        "4000-50-3000",
        "--arch-sparse-feature-size",
        "4",
        "--arch-mlp-bot",
        "13-8-4",
        "--arch-mlp-top",
        "8-1",
        "--mini-batch-size",
        "64",
        "--num-batches",
        "8",
        "--num-indices-per-lookup",
        "2",
        "--num-indices-per-lookup-fixed",
        "--data-generation",
        "learnable",
        "--json",
    ];
    let kv = [
        "--kv-min-rows",
        "100",
        "--kv-admission",
        "count:2:1024",
        "--kv-eviction",
        "lfu",
    ];
    let out = json(&[&base[..], &kv].concat());
    let tables = out["key_value_tables"].as_array().unwrap();
    // The two large tables are key-value, the 50-row one is not.
    let names: Vec<&str> = tables
        .iter()
        .map(|t| t["table"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["t_cat_0", "t_cat_2"], "{out}");
    for t in tables {
        assert_eq!(t["seen"], 8 * 64 * 2, "{t}");
        assert!(t["admitted"].as_u64().unwrap() > 0 && t["rejected"].as_u64().unwrap() > 0);
    }
    assert!(json(&base).get("key_value_tables").is_none());
    // Sharded over two devices, row-wise asked: each key-value table goes
    // whole on one device, and admits, rejects and holds the same ids.
    let sharded = json(
        &[
            &base[..],
            &kv,
            &["--devices", "2", "--sharding", "row-wise"],
        ]
        .concat(),
    );
    assert_eq!(
        sharded["key_value_tables"], out["key_value_tables"],
        "{sharded}"
    );
    let shards = sharded["sharding"]["shards"].to_string();
    assert!(
        shards.contains("t_cat_0:table_wise") && shards.contains("t_cat_1:row_wise"),
        "{shards}"
    );
    // A plan file splitting them row-wise by buckets: every id looked up
    // once, on the shard of its bucket; the shards' rows add up.
    let plan = dir.join("buckets.json");
    std::fs::create_dir_all(&dir).unwrap();
    let tables = [("t_cat_0", 4000), ("t_cat_1", 50), ("t_cat_2", 3000)];
    std::fs::write(&plan, common::bucket_plan(&tables, 4, 100)).unwrap();
    let split = dir.join("split");
    let split_args = [
        "--plan",
        plan.to_str().unwrap(),
        "--save",
        split.to_str().unwrap(),
    ];
    let by_buckets = json(&[&base[..], &kv, &split_args].concat());
    let shards = by_buckets["sharding"]["shards"].to_string();
    assert!(shards.matches("t_cat_0:row_wise").count() == 2, "{shards}");
    let tables = by_buckets["key_value_tables"].as_array().unwrap();
    for (t, rows) in tables.iter().zip([3999, 2999]) {
        assert_eq!(
            (t["seen"].as_u64(), t["capacity"].as_u64()),
            (Some(8 * 64 * 2), Some(rows)),
            "{t}"
        );
        assert!(t["admitted"].as_u64() > Some(0), "{t}");
    }
    // Saved, the maps travel with the rows.
    let saved = dir.join("kv");
    let run = json(&[&base[..], &kv, &["--save", saved.to_str().unwrap()]].concat());
    // `checkpoint inspect` reads the figures back from the metadata: one
    // file, and the set of shards of buckets (summed).
    for (ckpt, run) in [(&saved, &run), (&split, &by_buckets)] {
        let report = json(&["checkpoint", "inspect", ckpt.to_str().unwrap(), "--json"]);
        let tables = report["tables"].as_array().unwrap();
        let figures: Vec<serde_json::Value> = (tables.iter())
            .filter(|t| t.get("key_value").is_some())
            .map(|t| {
                let mut f = t["key_value"].clone();
                f["table"] = t["table"].clone();
                f
            })
            .collect();
        assert_eq!(
            serde_json::Value::from(figures),
            run["key_value_tables"],
            "{report}"
        );
        assert!(tables[1].get("key_value").is_none(), "{report}");
    }
    let bytes = std::fs::read(saved.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let names: Vec<String> = (file.names().into_iter())
        .filter(|n| n.contains(".kv."))
        .map(str::to_string)
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with("t_cat_0.kv.sketch")),
        "{names:?}"
    );
    let err = fails(&[&base[..], &["--kv-min-rows", "100", "--kv-eviction", "mru"]].concat());
    assert!(
        err.contains("--kv-eviction") && err.contains("'mru'"),
        "{err}"
    );
    let err = fails(&[&base[..], &["--kv-eviction", "lru"]].concat());
    assert!(err.contains("--kv-min-rows"), "{err}");
    // On the disk tier (the files' bytes reported); with ids from 10
    // times the rows, more distinct ids arrive and are admitted.
    let tier = dir.join("tier");
    let tier = tier.to_str().unwrap();
    let on_disk = [
        "--kv-min-rows",
        "100",
        "--disk-dir",
        tier,
        "--cache-memory",
        "64K",
    ];
    let admitted = |space: &str| -> Vec<u64> {
        let out = json(&[&base[..], &on_disk, &["--kv-id-space", space]].concat());
        assert!(out["disk_tier"]["disk_bytes"].as_u64() > Some(0), "{out}");
        (out["key_value_tables"].as_array().unwrap().iter())
            .map(|t| t["admitted"].as_u64().unwrap())
            .collect()
    };
    let (within, wider) = (admitted("1"), admitted("10"));
    assert!(
        within.iter().zip(&wider).all(|(a, b)| a < b),
        "{within:?} {wider:?}"
    );
    // L2-norm eviction reads candidates' rows: those tables stay in RAM,
    // however large the caches (here none is left for the disk tier,
    // which says why).
    let l2 = [
        "--kv-min-rows",
        "100",
        "--kv-eviction",
        "l2-norm",
        "--disk-dir",
        tier,
    ];
    let err = fails(&[&base[..], &l2, &["--cache-memory", "10M"]].concat());
    assert!(
        err.contains("no table goes to the disk tier") && err.contains("L2-norm"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_stream_evaluates_each_window_before_training_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = json(&[
        "bench",
        "stream",
        "--checkpoint-dir",
        dir.path().to_str().unwrap(),
        "--arch-embedding-size",
        "500-500",
        "--arch-sparse-feature-size",
        "4",
        "--arch-mlp-bot",
        "13-8-4",
        "--arch-mlp-top",
        "8-1",
        "--windows",
        "3",
        "--window-batches",
        "4",
        "--mini-batch-size",
        "128",
        "--kv-min-rows",
        "2",
        "--json",
    ]);
    let windows = out["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 3, "{out}");
    let mean = (windows[1]["auc"].as_f64().unwrap() + windows[2]["auc"].as_f64().unwrap()) / 2.0;
    assert!(
        (out["mean_auc"].as_f64().unwrap() - mean).abs() < 1e-12,
        "{out}"
    );
    // A full checkpoint after window 0, deltas after the others.
    assert!(
        windows
            .iter()
            .all(|w| w["checkpoint_bytes"].as_u64() > Some(0)),
        "{out}"
    );
    assert!(out["delta_over_full"].as_f64().is_some(), "{out}");
    let files = [
        "model.safetensors",
        "model.delta-000001.safetensors",
        "model.delta-000002.safetensors",
    ];
    assert!(files.iter().all(|f| dir.path().join(f).exists()), "{out}");
    let tables = out["key_value_tables"].as_array().unwrap();
    // Raw ids 100x the rows: the tables fill and evict.
    assert!(
        tables.iter().all(|t| t["evicted"].as_u64().unwrap() > 0),
        "{out}"
    );
}
