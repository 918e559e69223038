"""Writes the docs' result files from one sitting of scripts/bench-results-python:
RUNS/{python,torchrec,rust,dlrm-ember,dlrm-torchrec} (one JSON line per run,
in pairs) into OUT/python-torchrec.json (Ember from Python against
TorchRec), OUT/python-rust.json (Ember from Python against Ember from
Rust) and OUT/python-dlrm.json (TorchRec's DLRM module on Ember's tables
against TorchRec's).

    python python/benches/results.py RUNS OUT
"""

import json
import os
import sys

SHAPE = ("26 tables x 1M rows x 128 fp32, batch 2048, one uniform id per bag: "
         "`pooled = ebc(kjt); pooled.values().backward(grad)` from Python, the update "
         "(row-wise Adagrad) fused into the backward.")


def lines(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def write(path, result):
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main():
    runs, out = sys.argv[1:]
    python, torchrec, rust, dlrm_ember, dlrm_torchrec = (
        lines(os.path.join(runs, n))
        for n in ("python", "torchrec", "rust", "dlrm-ember", "dlrm-torchrec"))
    write(os.path.join(out, "python-torchrec.json"), {
        "title": "From Python: embedding bags against TorchRec",
        "about": SHAPE + " The peer is TorchRec's EmbeddingBagCollection on its CPU production "
                 "path: DistributedModelParallel on one rank, FBGEMM's fused TBE.",
        "ember": python,
        "peer": {"name": "TorchRec + FBGEMM (CPU)",
                 "command": torchrec[0]["run"]["command"], "runs": torchrec},
    })
    write(os.path.join(out, "python-dlrm.json"), {
        "title": "From Python: the DLRM kaggle preset against TorchRec",
        "about": "TorchRec's DLRM module (torchrec.models.dlrm.DLRM) in torch at the kaggle "
                 "preset's shape: 26 tables x 100k rows x 16, bottom 13-512-256-64-16, top "
                 "512-256-1, dot interaction, batch 2048 of random samples; row-wise Adagrad "
                 "fused into the tables' backward, Adagrad on the dense layers. Ember: the "
                 "module's tables are Ember's EmbeddingBagCollection. The peer: TorchRec's, "
                 "the model under DistributedModelParallel on one rank (FBGEMM's fused TBE). "
                 "The dense towers are torch's in both.",
        "ember": dlrm_ember,
        "peer": {"name": "TorchRec + FBGEMM (CPU)",
                 "command": dlrm_torchrec[0]["run"]["command"], "runs": dlrm_torchrec},
    })
    write(os.path.join(out, "python-rust.json"), {
        "title": "From Python: the cost of the crossing",
        "about": SHAPE + " The peer is Ember itself from Rust on the same shape "
                 "(`ember bench embedding`): the ratio is what the Python crossing keeps.",
        "ember": python,
        "peer": {"name": "Ember from Rust",
                 "command": rust[0]["run"]["command"], "runs": rust},
    })


if __name__ == "__main__":
    main()
