"""Writes the docs' result files from one sitting of scripts/bench-results-python:
RUNS/{python,torchrec,rust} (one JSON line per run, in pairs) into
OUT/python-torchrec.json (Ember from Python against TorchRec) and
OUT/python-rust.json (Ember from Python against Ember from Rust).

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
    python, torchrec, rust = (lines(os.path.join(runs, n)) for n in ("python", "torchrec", "rust"))
    write(os.path.join(out, "python-torchrec.json"), {
        "title": "From Python: embedding bags against TorchRec",
        "about": SHAPE + " The peer is TorchRec's EmbeddingBagCollection on its CPU production "
                 "path: DistributedModelParallel on one rank, FBGEMM's fused TBE.",
        "ember": python,
        "peer": {"name": "TorchRec + FBGEMM (CPU)",
                 "command": torchrec[0]["run"]["command"], "runs": torchrec},
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
