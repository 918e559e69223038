//! End-to-end runs of the `ember` binary on small shapes: the JSON reports
//! carry the promised fields, and bad flags give clear errors.

use std::process::Command;

fn ember(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ember"))
        .args(args)
        .output()
        .expect("the ember binary runs")
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
        "--optimizer",
        "adam",
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
    assert_eq!(v["optimizer"], "adam");
}

#[test]
fn bad_flags_are_named() {
    let out = ember(&["bench", "dlrm", "--arch-mlp-bot", "13-x-2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--arch-mlp-bot") && err.contains("'x'"),
        "{err}"
    );
    let out = ember(&[
        "bench",
        "dlrm",
        "--arch-mlp-bot",
        "13-4-3",
        "--arch-sparse-feature-size",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("embedding dim"),
        "{err}"
    );
}
