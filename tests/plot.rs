//! `ember plot-latency` and `ember plot`: a load test's JSON, and training
//! runs' JSON-lines logs, drawn as PNGs of the size they promise, and bad
//! input refused naming the file (and line).

use std::path::PathBuf;

mod common;
use common::{ember, ember_fails, json, s, synthetic, ARCH};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ember-plot-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A load test as `scripts/serve_loadtest.py` writes it (the fields the
/// plot reads, and some it does not).
fn load_test(label: &str, scale: f64) -> serde_json::Value {
    let rates: Vec<_> = [(1000.0, 2.0), (4000.0, 5.0), (8000.0, 40.0)]
        .iter()
        .map(|&(samples, p50)| {
            serde_json::json!({
                "target_qps": samples / 256.0,
                "target_samples_per_s": samples,
                "completed_samples_per_s": samples,
                "p50_ms": p50 * scale,
                "p99_ms": 3.0 * p50 * scale,
                "p999_ms": 4.0 * p50 * scale,
                "failed": 0,
            })
        })
        .collect();
    serde_json::json!({"label": label, "target_latency_ms": 60.0, "rows_per_query": 256, "rates": rates})
}

#[test]
fn a_load_test_becomes_a_png_and_bad_input_is_named() {
    let dir = temp_dir("latency");
    let (fp32, int8) = (dir.join("fp32.json"), dir.join("int8.json"));
    std::fs::write(&fp32, load_test("fp32 tables", 1.0).to_string()).unwrap();
    std::fs::write(&int8, load_test("", 0.5).to_string()).unwrap();
    let png = dir.join("latency.png");
    let report = json(&[
        "plot-latency",
        s(&fp32),
        s(&int8),
        "--output",
        s(&png),
        "--json",
    ]);
    // A label left empty is the file's name.
    assert_eq!(report["series"], serde_json::json!(["fp32 tables", "int8"]));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&bytes[12..16], b"IHDR");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert_eq!((width, height), (900, 560));
    // Lines, labels and text compress far worse than a blank picture.
    assert!(bytes.len() > 20_000, "{} bytes", bytes.len());

    let broken = dir.join("broken.json");
    std::fs::write(&broken, "{\"label\": \"x\"").unwrap();
    let out = dir.join("never.png");
    let err = ember_fails(&["plot-latency", s(&broken), "--output", s(&out)]);
    assert!(
        err.contains("broken.json") && err.contains("not a load test"),
        "{err}"
    );
    let empty = dir.join("empty.json");
    let mut no_rates = load_test("x", 1.0);
    no_rates["rates"] = serde_json::json!([]);
    std::fs::write(&empty, no_rates.to_string()).unwrap();
    let err = ember_fails(&["plot-latency", s(&empty), "--output", s(&out)]);
    assert!(err.contains("empty.json: no rates"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A PNG's width and height, checked to be one.
fn png_size(path: &std::path::Path) -> (u32, u32) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let at = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
    (at(16), at(20))
}

#[test]
fn training_logs_become_a_png_of_loss_auc_and_ne() {
    let dir = temp_dir("train");
    let data = synthetic(&dir, "train", "4000", "0");
    let eval = synthetic(&dir, "eval", "1000", "1");
    let mut logs = Vec::new();
    let runs: [(&str, &[&str]); 2] = [
        ("constant", &[]),
        ("warmup", &["--lr-linear-warmup-steps", "20"]),
    ];
    for (name, extra) in runs {
        let mut args = vec!["train", "--data", &data, "--eval-data", &eval, "--json"];
        args.extend_from_slice(ARCH);
        args.extend_from_slice(&["--eval-every", "8", "--print-freq", "4"]);
        args.extend_from_slice(extra);
        let log = dir.join(format!("{name}.jsonl"));
        std::fs::write(&log, ember(&args)).unwrap();
        logs.push(log);
    }
    let png = dir.join("runs.png");
    let report = json(&[
        "plot",
        s(&logs[0]),
        s(&logs[1]),
        "--label",
        "fast",
        "--output",
        s(&png),
        "--json",
    ]);
    // 32 batches: a loss every 4, an evaluation every 8; the second
    // run's label is its file's name.
    let series = &report["series"];
    assert_eq!(series[0]["label"], "fast");
    assert_eq!(series[1]["label"], "warmup");
    assert_eq!(
        (
            series[0]["losses"].as_u64(),
            series[0]["evaluations"].as_u64()
        ),
        (Some(8), Some(4))
    );
    assert_eq!(png_size(&png), (900, 1000));
    assert!(std::fs::metadata(&png).unwrap().len() > 30_000);

    // A line that is not JSON is named by file and line; a log with no
    // training or evaluation events is refused; no PNG is left either way.
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"event\":\"train\",\"steps\":1,\"loss\":0.5}\nnot json\n",
    )
    .unwrap();
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "{\"event\":\"summary\"}\n").unwrap();
    let out = dir.join("no.png");
    let err = ember_fails(&["plot", s(&bad), "--output", s(&out)]);
    assert!(err.contains("bad.jsonl line 2: not a JSON line"), "{err}");
    let err = ember_fails(&["plot", s(&empty), "--output", s(&out)]);
    assert!(err.contains("no `train` or `eval` events"), "{err}");
    assert!(!out.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_plan_is_drawn_beside_its_json() {
    let dir = temp_dir("plan");
    let (plan, png) = (dir.join("plan.json"), dir.join("plan.png"));
    ember(&[
        "plan",
        "--preset",
        "kaggle",
        "--devices",
        "3",
        "--output",
        s(&plan),
        "--plot",
        s(&png),
    ]);
    assert!(plan.exists());
    assert_eq!(png_size(&png), (900, 760));
    assert!(std::fs::metadata(&png).unwrap().len() > 20_000);
    std::fs::remove_dir_all(dir).unwrap();
}
