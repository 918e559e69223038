//! `ember plot-latency`: a load test's JSON drawn as a PNG of the size it
//! promises, and bad input refused naming the file.

use std::path::PathBuf;

mod common;
use common::{ember_fails, json, s};

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
