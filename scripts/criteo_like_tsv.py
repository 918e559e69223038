#!/usr/bin/env python3
"""Writes learnable Criteo-format day files (raw TSV: a label, 13 integers,
26 hexadecimal categorical ids; empty fields missing) for
`ember ingest criteo`, to measure vocabularies (scripts/vocabulary-auc).

Each categorical feature draws ranks from a power law (density 1/rank, as
click logs' ids are) over a universe a tenth of the Criteo Kaggle table's
size, and writes rank r as a fixed random 32-bit id; 5 % are missing. The
label follows a hidden logistic model: every (feature, rank) has its own
effect. So frequent ids carry learnable signal and rare ones mostly noise.

    python scripts/criteo_like_tsv.py OUT_DIR --rows N --days K [--seed S]

Needs numpy (the Python test environment has it).
"""
import argparse
import os

import numpy as np

KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
               8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18,
               15, 286181, 105, 142572]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, required=True, help="rows per day")
    ap.add_argument("--days", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    universe = [max(3, n // 10) for n in KAGGLE_ROWS]
    raw_ids = [rng.choice(2**32, size=n, replace=False) for n in universe]
    effects = [rng.normal(0.0, 0.6, size=n) for n in universe]
    os.makedirs(a.out, exist_ok=True)
    for day in range(a.days):
        n = a.rows
        logit = np.full(n, -1.2)
        cats = []
        for f, u in enumerate(universe):
            rank = np.minimum((u ** rng.random(n)).astype(np.int64) - 1, u - 1)
            missing = rng.random(n) < 0.05
            logit += np.where(missing, 0.0, effects[f][rank])
            hexes = np.char.mod("%08x", raw_ids[f][rank])
            cats.append(np.where(missing, "", hexes))
        label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(int)
        ints = rng.poisson(3.0, size=(13, n)).astype(str)
        ints = np.where(rng.random((13, n)) < 0.1, "", ints)
        columns = [c.tolist() for c in (label.astype(str), *ints, *cats)]
        with open(os.path.join(a.out, f"day_{day}"), "w") as out:
            out.writelines("\t".join(row) + "\n" for row in zip(*columns))


if __name__ == "__main__":
    main()
