//! User histories through the `ember` binary: interactions ingested into
//! per-user list columns (read back by pyarrow), each sequence model
//! trained and evaluated from them, a stopped run resumed, and flags that
//! make no sense refused by name.

mod common;

use std::path::Path;

use common::{ember, ember_fails, have_pyarrow, json, python, s};

/// Interactions in MovieLens' `ratings.dat` form: 60 users, each reading
/// items of its own topic (user u: items u%6, u%6+6, ...) at rising times,
/// written out of order.
fn ratings(dir: &Path) -> std::path::PathBuf {
    let mut lines = Vec::new();
    for u in 1..=60 {
        for k in 0..12 {
            let item = u % 6 + 6 * ((k * 7 + u) % 20);
            lines.push(format!(
                "{u}::{item}::{}::{}",
                1 + (k + u) % 5,
                1000 + 10 * k
            ));
        }
    }
    lines.reverse();
    let path = dir.join("ratings.dat");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

#[test]
fn movielens_ratings_ingest_into_histories_that_pyarrow_reads() {
    let dir = tempfile::tempdir().unwrap();
    let input = ratings(dir.path());
    let out = dir.path().join("h.parquet");
    let v = json(&[
        "ingest",
        "sequences",
        s(&input),
        "--output",
        s(&out),
        "--json",
    ]);
    assert_eq!(v["format"], "movie-lens");
    assert_eq!(
        (v["users"].as_u64(), v["interactions"].as_u64()),
        (Some(60), Some(720))
    );
    assert_eq!(v["actions"], true);
    if have_pyarrow() {
        let got = python(&format!(
            "import pyarrow.parquet as pq; t = pq.read_table({:?}).to_pylist(); \
             u = t[0]; print(len(t), u['user'], u['items'][:3], u['timestamps'][:3], u['actions'][:3])",
            s(&out)
        ));
        // User 1, in time order though the file is reversed.
        assert_eq!(got.trim(), "60 1 [7, 49, 91] [1000, 1010, 1020] [2, 3, 4]");
    }
}

fn histories(dir: &Path) -> String {
    let out = dir.join("syn.parquet");
    let args = [
        "--users",
        "600",
        "--items",
        "200",
        "--topics",
        "10",
        "--max-len",
        "30",
    ];
    let mut all = vec!["ingest", "synthetic-histories", "--output", s(&out)];
    all.extend_from_slice(&args);
    ember(&all);
    s(&out).to_string()
}

const SMALL: &[&str] = &[
    "--max-seq-len",
    "30",
    "--embedding-dim",
    "16",
    "--num-heads",
    "2",
    "--mini-batch-size",
    "64",
    "--learning-rate",
    "0.003",
    "--threads",
    "2",
];

fn train(data: &str, model: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["train", "--model", model, "--data", data, "--json"];
    args.extend_from_slice(SMALL);
    args.extend_from_slice(extra);
    let out = ember(&args);
    serde_json::from_str(out.lines().last().unwrap()).unwrap()
}

#[test]
fn every_sequence_model_trains_and_reports_its_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    for model in ["sasrec", "hstu-retrieval"] {
        let v = train(&data, model, &["--epochs", "3", "--eval-negatives", "100"]);
        assert_eq!(v["model"], model);
        assert_eq!(v["evals"].as_array().unwrap().len(), 3, "{v}");
        let (first, last) = (&v["evals"][0]["hit_rate"], &v["evals"][2]["hit_rate"]);
        assert!(
            last.as_f64() > first.as_f64(),
            "{model}: HR@10 {first} -> {last}"
        );
        // Better than chance among 101 items by far.
        assert!(v["test"]["hit_rate"].as_f64().unwrap() > 0.3, "{v}");
        assert_eq!(v["test"]["k"], 10);
    }
    let v = train(
        &data,
        "hstu-ranking",
        &["--epochs", "2", "--num-candidates", "3"],
    );
    let tasks = v["test"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 2);
    assert!(
        tasks.iter().all(|t| t["auc"].as_f64().unwrap() > 0.0),
        "{v}"
    );
    assert!(v["padded_over_real_tokens"].as_f64().unwrap() >= 1.0);
}

#[test]
fn a_stopped_sequence_run_resumes_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    let ckpt = dir.path().join("ckpt");
    let whole = train(&data, "hstu-retrieval", &["--epochs", "2"]);
    let c = s(&ckpt);
    let first = train(
        &data,
        "hstu-retrieval",
        &["--epochs", "1", "--checkpoint-dir", c],
    );
    let rest = train(
        &data,
        "hstu-retrieval",
        &["--epochs", "2", "--checkpoint-dir", c, "--resume"],
    );
    assert_eq!(
        first["steps"].as_u64().unwrap() * 2,
        whole["steps"].as_u64().unwrap()
    );
    assert_eq!(rest["steps"], whole["steps"]);
    // The same bits: the resumed run ends where the whole one did.
    assert_eq!(rest["loss_last"], whole["loss_last"], "{rest}\n{whole}");
    assert_eq!(rest["test"], whole["test"]);
}

#[test]
fn ranking_evaluates_on_the_data_grid_and_stops_at_the_target() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    let grid = [
        "--epochs",
        "1",
        "--num-candidates",
        "3",
        "--eval-every-data-pct",
        "20",
    ];
    let v = train(&data, "hstu-ranking", &grid);
    // 20 % of 600 users in batches of 64: ceil(1.875) = every 2 steps, of 10.
    let steps: Vec<u64> = (v["evals"].as_array().unwrap().iter())
        .map(|e| e["steps"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [2, 4, 6, 8, 10], "{v}");
    let v = train(
        &data,
        "hstu-ranking",
        &[&grid[..], &["--mlperf-auc-threshold", "0.01"]].concat(),
    );
    assert_eq!(v["steps"], 2, "{v}");
    assert_eq!(v["evals"].as_array().unwrap().len(), 1, "{v}");

    let base = ["train", "--data", &data, "--model"];
    let err = ember_fails(&[&base[..], &["sasrec", "--mlperf-logging", "x.log"]].concat());
    assert!(err.contains("is for --model hstu-ranking"), "{err}");
    let both = ["--eval-every", "3", "--eval-every-data-pct", "10"];
    let err = ember_fails(&[&base[..], &["hstu-ranking"], &both[..]].concat());
    assert!(err.contains("give one evaluation schedule"), "{err}");
    let err = ember_fails(&[&base[..], &["sasrec", "--adam-betas", "0.9,0.99"]].concat());
    assert!(err.contains("has no use for --adam-betas"), "{err}");
    let err = ember_fails(&[&base[..], &["hstu-ranking", "--eval-every-data-pct", "0"]].concat());
    assert!(
        err.contains("a percentage of the epoch in (0, 100]"),
        "{err}"
    );
    let err = ember_fails(&[&base[..], &["hstu-ranking", "--adam-betas", "0.9,1.5"]].concat());
    assert!(err.contains("two betas in [0, 1)"), "{err}");
}

#[test]
fn flags_that_do_not_fit_a_sequence_model_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    let err = ember_fails(&[
        "train",
        "--model",
        "sasrec",
        "--data",
        &data,
        "--arch-mlp-bot",
        "13-4",
    ]);
    assert!(
        err.contains("--arch-mlp-bot") && err.contains("DLRM runs only"),
        "{err}"
    );
    let err = ember_fails(&[
        "train",
        "--model",
        "sasrec",
        "--data",
        &data,
        "--eval-negatives",
        "0",
    ]);
    assert!(err.contains("--eval-negatives"), "{err}");
    let err = ember_fails(&["train", "--model", "sasrec", "--data", s(dir.path())]);
    assert!(err.contains("one user-history Parquet file"), "{err}");
    let bad = dir.path().join("bad.csv");
    std::fs::write(&bad, "user,item\n1,2\n1,two\n").unwrap();
    let out = dir.path().join("o.parquet");
    let err = ember_fails(&["ingest", "sequences", s(&bad), "--output", s(&out)]);
    assert!(
        err.contains("bad.csv:3: item 'two' is not an integer"),
        "{err}"
    );
}

#[test]
fn flags_of_another_model_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    let err = ember_fails(&["train", "--data", &data, "--max-seq-len", "20"]);
    assert!(
        err.contains("--max-seq-len are flags of sequence models"),
        "{err}"
    );
    let err = ember_fails(&[
        "train",
        "--model",
        "sasrec",
        "--data",
        &data,
        "--num-candidates",
        "3",
    ]);
    assert!(
        err.contains("--model sasrec has no use for --num-candidates"),
        "{err}"
    );
    let err = ember_fails(&[
        "train",
        "--model",
        "hstu-retrieval",
        "--data",
        &data,
        "--mode",
        "debug",
    ]);
    assert!(err.contains("--mode (sequence models run strict)"), "{err}");
    let args = ["--max-seq-len", "8", "--num-candidates", "8"];
    let mut all = vec!["train", "--model", "hstu-ranking", "--data", &data];
    all.extend_from_slice(&args);
    let err = ember_fails(&all);
    assert!(
        err.contains("num_candidates 8 leaves no history in max_sequence_len 8"),
        "{err}"
    );
    // Ranking needs actions: SASRec's files have none.
    let txt = dir.path().join("u.txt");
    std::fs::write(&txt, "1 1\n1 2\n1 3\n2 2\n2 3\n").unwrap();
    let out = dir.path().join("u.parquet");
    ember(&["ingest", "sequences", s(&txt), "--output", s(&out)]);
    let err = ember_fails(&["train", "--model", "hstu-ranking", "--data", s(&out)]);
    assert!(err.contains("row 0 has no actions"), "{err}");
}

#[test]
fn predict_scores_a_sequence_checkpoint_and_refuses_what_it_cannot_read() {
    let dir = tempfile::tempdir().unwrap();
    let data = histories(dir.path());
    let (sasrec, ranking) = (dir.path().join("sasrec"), dir.path().join("ranking"));
    train(
        &data,
        "sasrec",
        &["--epochs", "1", "--checkpoint-dir", s(&sasrec)],
    );
    let extra = [
        "--epochs",
        "1",
        "--num-candidates",
        "3",
        "--checkpoint-dir",
        s(&ranking),
    ];
    train(&data, "hstu-ranking", &extra);
    let out = dir.path().join("p.parquet");
    fn predict<'a>(ckpt: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["predict", "--checkpoint", s(ckpt), "--output", s(out)];
        args.extend_from_slice(extra);
        args
    }
    let v = json(&predict(
        &sasrec,
        &out,
        &["--data", &data, "--top-k", "3", "--json"],
    ));
    assert_eq!(v["rows"], 600, "{v}");
    if have_pyarrow() {
        let got = python(&format!(
            "import pyarrow.parquet as pq; t = pq.read_table({:?}); \
             print(t.num_rows, t.schema.field('items').type, t['scores'][0].as_py() == sorted(t['scores'][0].as_py(), reverse=True))",
            s(&out)
        ));
        assert_eq!(got.trim(), "600 fixed_size_list<item: int64>[3] True");
    }
    // Ranking reads the candidates and one item before them: a history
    // too short is named by file and row, and nothing is written.
    std::fs::remove_file(&out).unwrap();
    let err = ember_fails(&predict(&ranking, &out, &["--data", &data]));
    assert!(
        err.contains("syn.parquet: row 2: 3 items; hstu-ranking reads at least 4"),
        "{err}"
    );
    assert!(!out.exists());
    let err = ember_fails(&predict(
        &ranking,
        &out,
        &["--data", &data, "--disk-dir", s(dir.path())],
    ));
    assert!(
        err.contains("--disk-dir (sequence models predict from memory)"),
        "{err}"
    );
    let err = ember_fails(&["eval", "--checkpoint", s(&ranking), "--data", &data]);
    assert!(
        err.contains("is a hstu-ranking checkpoint: eval reads DLRM checkpoints"),
        "{err}"
    );
}
