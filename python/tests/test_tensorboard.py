"""`--tensorboard-dir` event files read back by TensorBoard's own reader
(`EventAccumulator`): the losses and evaluations equal the run's JSON
lines, the learning rates follow the schedule, and `bench dlrm` writes
them too."""

import glob
import json

from conftest import require
from test_metrics_torchrec import run

accumulator = require("tensorboard.backend.event_processing.event_accumulator")

SIZES = "-".join(["100"] * 26)


def scalars(logdir):
    files = glob.glob(str(logdir / "events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = accumulator.EventAccumulator(files[0], size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_train_events_read_back_with_tensorboard(tmp_path):
    for name, seed, rows in (("train", "1", "4000"), ("eval", "2", "1000")):
        run("ingest", "synthetic", "--rows", rows, "--seed", seed, "--arch-embedding-size",
            SIZES, "--output", str(tmp_path / name))
    logdir = tmp_path / "tb"
    out = run("train", "--data", str(tmp_path / "train"), "--eval-data", str(tmp_path / "eval"),
              "--arch-embedding-size", SIZES, "--arch-mlp-bot", "13-8-2", "--mini-batch-size", "128",
              "--learning-rate", "0.5", "--lr-linear-warmup-steps", "20", "--eval-every", "10",
              "--print-freq", "5", "--tensorboard-dir", str(logdir), "--json")
    events = [json.loads(line) for line in out.splitlines()]
    got = scalars(logdir)
    for tag in ("train/loss", "train/samples_per_s", "phase_ms/sparse_forward",
                "phase_ms/dense_backward", "lr/sparse", "lr/dense", "eval/auc", "eval/ne",
                "eval/calibration", "eval/logloss"):
        assert got.get(tag), (tag, sorted(got))
    losses = [(e["steps"], e["loss"]) for e in events if e["event"] == "train"]
    assert [s for s, _ in got["train/loss"]] == [s for s, _ in losses]
    for (_, a), (_, b) in zip(got["train/loss"], losses):
        assert abs(a - b) <= 1e-6 * abs(b)  # TensorBoard keeps float32
    evals = [(e["steps"], e["auc"], e["ne"]) for e in events if e["event"] == "eval"]
    assert [(s, round(v, 5)) for s, v in got["eval/auc"]] == [(s, round(a, 5)) for s, a, _ in evals]
    # DLRMv4's warmup: the step logged at count s ran at 0.5 * min(1, s / 20).
    for step, lr in got["lr/dense"]:
        assert abs(lr - 0.5 * min(1.0, step / 20)) < 1e-7, (step, lr)
    assert got["lr/sparse"] == got["lr/dense"]
    assert all(v > 0 for _, v in got["train/samples_per_s"])


def test_zero_values_are_written(tmp_path):
    # A rate of 0 is a value (protobuf leaves a plain 0 float unwritten).
    logdir = tmp_path / "tb"
    run("bench", "dlrm", "--num-batches", "10", "--print-freq", "5", "--learning-rate", "0",
        "--tensorboard-dir", str(logdir))
    got = scalars(logdir)
    assert got["lr/dense"] == [(5, 0.0), (10, 0.0)], got.get("lr/dense")


def test_bench_dlrm_writes_events(tmp_path):
    logdir = tmp_path / "tb"
    run("bench", "dlrm", "--num-batches", "20", "--print-freq", "5", "--test-freq", "10",
        "--data-generation", "learnable", "--tensorboard-dir", str(logdir))
    got = scalars(logdir)
    assert [s for s, _ in got["train/loss"]] == [5, 10, 15, 20]
    assert [s for s, _ in got["eval/auc"]] == [10, 20]


def test_sequence_models_write_events(tmp_path):
    data = tmp_path / "histories.parquet"
    run("ingest", "synthetic-histories", "--output", str(data), "--users", "300",
        "--items", "120", "--topics", "6", "--max-len", "20")
    for model, extra in (("hstu-ranking", ["--num-candidates", "3"]), ("sasrec", [])):
        logdir = tmp_path / model
        out = run("train", "--model", model, "--data", str(data), "--max-seq-len", "20",
                  "--embedding-dim", "16", "--mini-batch-size", "32", "--epochs", "2",
                  "--print-freq", "3", "--tensorboard-dir", str(logdir), "--json", *extra)
        lines = [json.loads(line) for line in out.splitlines()]
        got = scalars(logdir)
        losses = [(e["steps"], e["loss"]) for e in lines if e["event"] == "train"]
        assert [s for s, _ in got["train/loss"]] == [s for s, _ in losses], model
        assert got.get("lr/dense") and got.get("train/samples_per_s"), (model, sorted(got))
        if model == "hstu-ranking":
            # The first task's AUC at each evaluation (epoch ends).
            evals = [(e["steps"], e["tasks"][0]["auc"]) for e in lines
                     if e["event"] == "eval"]
            assert [(s, round(v, 5)) for s, v in got["eval/auc"]] == \
                [(s, round(a, 5)) for s, a in evals]
