#!/usr/bin/env python3
"""Moves DLRM and DLRM-DCNv2 models between TorchRec and Ember through
safetensors, and checks that both predict the same logits on the same rows.

TorchRec -> Ember: `safetensors.torch.save_file(model.state_dict(), path)`,
then `ember predict --checkpoint path` (no architecture flags: Ember infers
it from the names and shapes).
Ember -> TorchRec: `ember train --checkpoint-dir d`, then
`model.load_state_dict(load_file(d/model.safetensors) minus "optimizer.*")`.

Needs the peer environment (torch, torchrec, safetensors, pyarrow), e.g. the
one ../shared/peer/setup.sh installs, and a release build of ember:
    python scripts/torchrec_interop.py target/release/ember
"""
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

EMBER = sys.argv[1] if len(sys.argv) > 1 else "target/release/ember"
ROWS = [50, 70, 30]  # three tables: t_cat_0..2 for features cat_0..2
DIM, N = 8, 300
rng = np.random.default_rng(0)


def model(dcn: bool):
    tables = [
        EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=DIM, num_embeddings=r,
                           feature_names=[f"cat_{i}"])
        for i, r in enumerate(ROWS)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    if dcn:
        return DLRM_DCN(ebc, 13, [16, DIM], [16, 8, 1], dcn_num_layers=2, dcn_low_rank_dim=4)
    return DLRM(ebc, 13, [16, DIM], [16, 8, 1])


def write_rows(path: Path):
    """Raw Criteo TSV rows (some missing values) and the model inputs that
    Ember's default transforms make of them."""
    ints = rng.integers(-2, 1000, size=(N, 13))
    int_missing = rng.random((N, 13)) < 0.2
    ids = rng.integers(0, 2**32, size=(N, 26))
    cat_missing = rng.random((N, 26)) < 0.2
    labels = rng.integers(0, 2, size=N)
    with open(path, "w") as f:
        for r in range(N):
            fields = [str(labels[r])]
            fields += ["" if int_missing[r, j] else str(ints[r, j]) for j in range(13)]
            fields += ["" if cat_missing[r, j] else f"{ids[r, j]:x}" for j in range(26)]
            f.write("\t".join(fields) + "\n")
    dense = np.log1p(np.maximum(np.where(int_missing, 0, ints), 0)).astype(np.float32)
    lengths, values = [], []
    for i, rows in enumerate(ROWS):  # KJT order: key-major
        for r in range(N):
            if cat_missing[r, i]:
                lengths.append(0)
            else:
                lengths.append(1)
                values.append(ids[r, i] % rows)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"cat_{i}" for i in range(len(ROWS))],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )
    return torch.from_numpy(dense), kjt


def ember(*args):
    subprocess.run([EMBER, *map(str, args)], check=True, stdout=subprocess.DEVNULL)


def ember_logits(ckpt: Path, data: Path, out: Path):
    ember("predict", "--checkpoint", ckpt, "--data", data, "--output", out)
    return torch.from_numpy(pq.read_table(out).column("logit").to_numpy())


def main():
    tmp = Path(tempfile.mkdtemp())
    dense, kjt = write_rows(tmp / "rows.tsv")
    ember("ingest", "criteo", tmp / "rows.tsv", "--output", tmp / "data")
    worst = 0.0
    for dcn in (False, True):
        torch.manual_seed(1)
        m = model(dcn).eval()
        with torch.no_grad():
            want = m(dense, kjt).squeeze(1)
        # TorchRec -> Ember.
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp / "torchrec.safetensors")
        got = ember_logits(tmp / "torchrec.safetensors", tmp / "data", tmp / "p.parquet")
        d1 = (got - want).abs().max().item()
        # Ember -> TorchRec: train a step in Ember, load the result into TorchRec.
        arch = ["--arch-sparse-feature-size", DIM, "--arch-embedding-size", "-".join(map(str, ROWS)),
                "--arch-mlp-bot", f"13-16-{DIM}", "--arch-mlp-top", "16-8-1",
                "--arch-interaction-op", "dcn" if dcn else "dot", "--dcn-num-layers", 2,
                "--dcn-low-rank-dim", 4, "--mini-batch-size", 64]
        ember("train", "--data", tmp / "data", "--checkpoint-dir", tmp / "ckpt", *arch)
        state = {k: v for k, v in load_file(tmp / "ckpt" / "model.safetensors").items()
                 if not k.startswith("optimizer.")}
        m.load_state_dict(state, strict=True)
        with torch.no_grad():
            want = m(dense, kjt).squeeze(1)
        got = ember_logits(tmp / "ckpt" / "model.safetensors", tmp / "data", tmp / "p.parquet")
        d2 = (got - want).abs().max().item()
        name = "DLRM_DCN" if dcn else "DLRM"
        print(f"{name}: TorchRec->Ember max |logit diff| {d1:.2e}, Ember->TorchRec {d2:.2e}")
        worst = max(worst, d1, d2)
    assert worst < 1e-4, f"logits differ by {worst}"
    print("ok")


if __name__ == "__main__":
    main()
