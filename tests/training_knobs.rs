//! `ember train`'s schedules, weight decay, clipping, evaluation grid and
//! AUC target through the binary: recorded in the checkpoint, refused when
//! a resume gives others, and the run stopped at the target.

mod common;

use common::{ember, ember_fails, s, synthetic, ARCH};

/// dlrm_s_pytorch's schedule flags and every other knob at once.
const KNOBS: &[&str] = &[
    "--lr-num-warmup-steps",
    "10",
    "--lr-decay-start-step",
    "20",
    "--lr-num-decay-steps",
    "30",
    "--dense-lr-schedule",
    "linear-warmup:15",
    "--weight-decay",
    "0.001",
    "--weight-decay-mode",
    "decoupled",
    "--table-weight-decay",
    "0.0001",
    "--clip-grad-norm",
    "1.0",
];

fn lines(out: &str) -> Vec<serde_json::Value> {
    (out.lines())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

#[test]
fn knobs_are_recorded_and_a_resume_must_give_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "8000", "0");
    let ckpt = dir.path().join("ckpt");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            &data,
            "--checkpoint-dir",
            s(&ckpt),
            "--json",
        ];
        args.extend_from_slice(ARCH);
        args.extend_from_slice(extra);
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        lines(&ember(&refs))
    };
    let mut first = train(KNOBS);
    first.extend(["--max-steps".into(), "25".into()]);
    let events = run(first);
    assert_eq!(events.last().unwrap()["steps"], 25);

    // Resumed without the flags: refused, naming what the checkpoint holds.
    let mut bare = train(&[]);
    bare.push("--resume".into());
    let refs: Vec<&str> = bare.iter().map(String::as_str).collect();
    let err = ember_fails(&refs);
    assert!(
        err.contains("\"warmup_steps\":10") && err.contains("resume with the same"),
        "{err}"
    );

    // With them: it goes on to the epoch's end (8000 rows, 63 batches).
    let mut again = train(KNOBS);
    again.push("--resume".into());
    let events = run(again);
    let summary = events.last().unwrap();
    assert_eq!(
        (
            summary["steps"].as_u64(),
            summary["resumed_at_step"].as_u64()
        ),
        (Some(63), Some(25))
    );
}

#[test]
fn the_auc_target_stops_the_run_on_the_evaluation_grid() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "8000", "0");
    let eval = synthetic(dir.path(), "eval", "2000", "1");
    let mut args = vec![
        "train",
        "--data",
        &data,
        "--eval-data",
        &eval,
        "--epochs",
        "3",
        "--eval-every-data-pct",
        "25",
        "--mlperf-auc-threshold",
        "0.6",
        "--json",
    ];
    args.extend_from_slice(ARCH);
    let events = lines(&ember(&args));
    let evals: Vec<u64> = (events.iter())
        .filter(|e| e["event"] == "eval")
        .map(|e| e["steps"].as_u64().unwrap())
        .collect();
    // 63 batches an epoch: evaluations after batches 16, 32, 48 and 63 of
    // each epoch, until one reaches the target.
    let grid = [16, 32, 48, 63, 79, 95, 111, 126, 142, 158, 174, 189];
    assert_eq!(evals[..], grid[..evals.len()]);
    let reached = (events.iter())
        .find(|e| e["event"] == "target_reached")
        .expect("reached");
    let summary = events.last().unwrap();
    assert_eq!(summary["target_reached_at_step"], reached["steps"]);
    assert_eq!(summary["steps"], reached["steps"]);
    assert!(reached["auc"].as_f64().unwrap() >= 0.6);
    assert!(
        summary["steps"].as_u64() < Some(189),
        "a learnable task reaches 0.6: {summary}"
    );
}

#[test]
fn knobs_no_run_can_use_are_refused_by_flag() {
    let dir = tempfile::tempdir().unwrap();
    let data = synthetic(dir.path(), "train", "1000", "0");
    let cases: [(&[&str], &str); 4] = [
        (
            &["--lr-num-warmup-steps", "10", "--lr-decay-start-step", "5"],
            "must finish before its decay starts",
        ),
        (
            &["--sparse-lr-schedule", "cosine:3"],
            "expected constant, policy",
        ),
        (&["--clip-grad-norm", "0"], "--clip-grad-norm"),
        (
            &["--optimizer", "adam", "--table-weight-decay", "0.1"],
            "not Adam",
        ),
    ];
    for (extra, says) in cases {
        let mut args = vec!["train", "--data", &data];
        args.extend_from_slice(ARCH);
        args.extend_from_slice(extra);
        let err = ember_fails(&args);
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}
