#!/usr/bin/env python3
"""Fits a Zipf exponent to each large Criteo Kaggle feature from the real rows
in tests/data/criteo_sample.csv (docs/src/formats/synthetic.md).

For a table of n rows under Zipf's law with exponent a, m draws show on
average sum_k 1 - (1 - p_k)^m distinct ids (p_k = k^-a / H(n, a)). For each
feature, the exponent whose expectation matches the distinct ids seen in the
sample is found by bisection. n is the feature's number of distinct values
in the whole Kaggle set (TorchRec's KAGGLE_NUM_EMBEDDINGS_PER_FEATURE, the
counts dlrm_s_pytorch's Kaggle preprocessing finds). Tables under 10,000
rows are left out: 200 draws barely tell their shape.

Usage: python3 scripts/criteo_skew.py [CSV]
"""
import csv
import math
import sys

KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
               8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18,
               15, 286181, 105, 142572]
HEAD = 20000  # ranks summed exactly; the rest integrated


def expected_distinct(n, a, m):
    head = min(n, HEAD)
    w = [k ** -a for k in range(1, head + 1)]
    tail = 0.0
    if n > head:
        if abs(1 - a) > 1e-9:
            tail = ((n + 0.5) ** (1 - a) - (head + 0.5) ** (1 - a)) / (1 - a)
        else:
            tail = math.log((n + 0.5) / (head + 0.5))
    total = sum(w) + tail
    # Past the head every id has p < 1/(m * 1000) here: seen once at most.
    return sum(1 - (1 - x / total) ** m for x in w) + m * tail / total


def fit(n, distinct, m):
    lo, hi = 0.01, 4.0
    if expected_distinct(n, lo, m) < distinct:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if expected_distinct(n, mid, m) > distinct:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "tests/data/criteo_sample.csv"
    rows = list(csv.DictReader(open(path)))
    alphas = []
    print(f"{'feature':<8} {'rows':>9} {'ids':>4} {'distinct':>8} {'alpha':>6}")
    for i, n in enumerate(KAGGLE_ROWS):
        ids = [r[f"C{i + 1}"] for r in rows if r[f"C{i + 1}"]]
        m, d = len(ids), len(set(ids))
        a = fit(n, d, m) if n >= 10000 else None
        if a is not None:
            alphas.append(a)
        shown = "" if a is None else f"{a:.2f}"
        print(f"C{i + 1:<7} {n:>9} {m:>4} {d:>8} {shown:>6}")
    alphas.sort()
    print(f"tables of 10,000 rows or more: alpha {alphas[0]:.2f} to {alphas[-1]:.2f}, "
          f"median {alphas[len(alphas) // 2]:.2f}")


if __name__ == "__main__":
    main()
