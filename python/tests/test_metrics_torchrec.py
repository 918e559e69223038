"""`ember eval`'s NE, calibration and CTR against TorchRec's own metric
code (`torchrec.metrics.ne`, `.calibration`), computed from `ember
predict`'s probabilities of the same rows and the rows' labels."""

import json
import subprocess

import numpy as np

from conftest import require
from test_serve import ember_bin

pq = require("pyarrow.parquet")
torch = require("torch")
ne = require("torchrec.metrics.ne")
calibration = require("torchrec.metrics.calibration")


def run(*args):
    done = subprocess.run([ember_bin(), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ne_and_calibration_are_torchrecs(tmp_path):
    sizes = "-".join(["100"] * 26)
    for name, seed in (("train", "1"), ("eval", "2")):
        run("ingest", "synthetic", "--rows", "3000", "--seed", seed, "--arch-embedding-size",
            sizes, "--output", str(tmp_path / name))
    run("train", "--data", str(tmp_path / "train"), "--arch-embedding-size", sizes,
        "--arch-mlp-bot", "13-8-2",
        "--epochs", "1", "--mini-batch-size", "256", "--checkpoint-dir", str(tmp_path / "ckpt"))
    report = json.loads(run("eval", "--checkpoint", str(tmp_path / "ckpt"), "--data",
                            str(tmp_path / "eval"), "--json").strip().splitlines()[-1])
    run("predict", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(tmp_path / "eval"),
        "--output", str(tmp_path / "p.parquet"))
    p = torch.tensor(pq.read_table(tmp_path / "p.parquet")["probability"].to_numpy(),
                     dtype=torch.float64)
    labels = torch.tensor(pq.read_table(tmp_path / "eval", columns=["label"])["label"]
                          .to_numpy().astype(np.float64))
    weights = torch.ones_like(p)
    states = ne.get_ne_states(labels, p, weights, 1e-12)
    want_ne = ne.compute_ne(states["cross_entropy_sum"], states["weighted_num_samples"],
                            states["pos_labels"], states["neg_labels"], 1e-12).item()
    want_calibration = calibration.compute_calibration(
        torch.sum(p * weights), torch.sum(labels * weights)).item()
    assert report["rows"] == 3000
    # TorchRec reads the fp32 probability; Ember the logit in f64.
    assert abs(report["ne"] - want_ne) < 1e-5, (report["ne"], want_ne)
    assert abs(report["calibration"] - want_calibration) < 1e-5
    assert abs(report["ctr"] - labels.mean().item()) < 1e-12
    assert 0.5 < report["ne"] < 1.5
    # dlrm_s_pytorch's scikit-learn metrics (a probability above 0.5
    # predicts a click), against torchmetrics' binary ones.
    tm = require("torchmetrics.functional.classification")
    y = labels.to(torch.int64)
    want = {
        "precision": tm.binary_precision(p, y).item(),
        "recall": tm.binary_recall(p, y).item(),
        "f1": tm.binary_f1_score(p, y).item(),
        "average_precision": tm.binary_average_precision(p, y, thresholds=None).item(),
    }
    for key, value in want.items():
        # Ember ranks by the f64 logit, torchmetrics by the fp32 probability.
        assert abs(report[key] - value) < 1e-4, (key, report[key], value)
