#!/usr/bin/env python3
"""Latency against offered load for `ember serve`, measured with MLPerf's
load generator (mlcommons-loadgen): its server scenario (Poisson arrivals
at a target rate, one query at a time per arrival), over gRPC with Triton's
client (tritonclient), on loopback.

Each query is one inference request of --rows-per-query samples, taken in
turn from the raw rows of a Parquet directory in Criteo's schema (`int_*`
dense columns, one column per sparse feature, as `ember ingest` writes
them). For each target rate the run is bounded by --duration-s and
--max-queries and run --repeats times; loadgen's summaries give the
completed rate and the latency percentiles, each reported as the median
of the runs. Writes one JSON object: every rate's figures, the rows per
query, and the machine.

    python scripts/serve_loadtest.py --grpc 127.0.0.1:8001 --data rows/ \\
        --qps 5,10,20 --duration-s 20 --output latency.json
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import tritonclient.grpc as grpcclient
import mlperf_loadgen as lg


def cpu_name():
    """lscpu's model name, with the family and model numbers (a cloud
    machine's name is often just "Intel(R) Xeon(R) Processor")."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except (OSError, subprocess.CalledProcessError, AttributeError):
        return platform.processor() or "unknown"
    family = re.search(r"CPU family:\s*(\d+)", out)
    model = re.search(r"^Model:\s*(\d+)", out, re.MULTILINE)
    if family and model:
        name += f" (family {family.group(1)}, model {model.group(1)})"
    return name


def queries_of(metadata, table, rows_per_query, count):
    """`count` queries of `rows_per_query` consecutive rows each (wrapping
    round the table), as tritonclient inputs."""
    names = [i["name"] for i in metadata["inputs"]]
    dense_width = next((int(i["shape"][1]) for i in metadata["inputs"] if i["name"] == "dense"), 0)
    features = [n[: -len(".lengths")] for n in names if n.endswith(".lengths")]
    columns = {c: table[c].to_pylist() for c in table.column_names}
    n = table.num_rows
    if n < rows_per_query:
        sys.exit(f"--data holds {n} rows, fewer than --rows-per-query {rows_per_query}")
    queries = []
    for q in range(count):
        rows = [(q * rows_per_query + r) % n for r in range(rows_per_query)]
        arrays = {}
        if dense_width:
            dense = np.zeros((rows_per_query, dense_width), np.float32)
            for j in range(dense_width):
                values = columns[f"int_{j}"]
                dense[:, j] = [values[r] or 0 for r in rows]
            arrays["dense"] = dense
        for f in features:
            if f not in columns:
                sys.exit(f"--data has no column '{f}' (the model's feature)")
            lengths, ids = [], []
            for r in rows:
                v = columns[f][r]
                bag = [] if v is None else (v if isinstance(v, list) else [v])
                lengths.append(len(bag))
                ids.extend(bag)
            arrays[f"{f}.lengths"] = np.array(lengths, np.int64)
            arrays[f"{f}.values"] = np.array(ids, np.int64)
        inputs = []
        for name, array in arrays.items():
            item = grpcclient.InferInput(name, list(array.shape),
                                         "FP32" if array.dtype == np.float32 else "INT64")
            item.set_data_from_numpy(array)
            inputs.append(item)
        queries.append(inputs)
    return queries


SUMMARY = {
    "completed_qps": r"Completed samples per second\s*:\s*([\d.]+)",
    "scheduled_qps": r"Scheduled samples per second\s*:\s*([\d.]+)",
    "p50_ns": r"50.00 percentile latency \(ns\)\s*:\s*(\d+)",
    "p90_ns": r"90.00 percentile latency \(ns\)\s*:\s*(\d+)",
    "p99_ns": r"99.00 percentile latency \(ns\)\s*:\s*(\d+)",
    "p999_ns": r"99.90 percentile latency \(ns\)\s*:\s*(\d+)",
    "mean_ns": r"Mean latency \(ns\)\s*:\s*(\d+)",
}


def run_rate(client, model, queries, qps, args, outdir):
    """One loadgen run at `qps`; its summary's figures and the failures."""
    failures = []
    lock = threading.Lock()

    issued = [0]

    def issue(samples):
        issued[0] += len(samples)
        for s in samples:
            def done(result, error, s=s):
                if error is not None:
                    with lock:
                        failures.append(str(error))
                lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, 0, 0)])
            client.async_infer(model, queries[s.index % len(queries)], done)

    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(len(queries), len(queries), lambda _: None, lambda _: None)
    settings = lg.TestSettings()
    settings.scenario = lg.TestScenario.Server
    settings.mode = lg.TestMode.PerformanceOnly
    settings.server_target_qps = qps
    settings.server_target_latency_ns = int(args.target_latency_ms * 1e6)
    settings.min_duration_ms = int(args.duration_s * 1000)
    settings.max_duration_ms = int(args.duration_s * 1000 * 3)
    settings.min_query_count = 1
    settings.max_query_count = args.max_queries
    log = lg.LogSettings()
    log.log_output.outdir = outdir
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = False
    lg.StartTestWithLogSettings(sut, qsl, settings, log)
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)
    text = open(os.path.join(outdir, "mlperf_log_summary.txt")).read()
    figures = {}
    for key, pattern in SUMMARY.items():
        match = re.search(pattern, text)
        if match is None:
            sys.exit(f"loadgen's summary has no '{pattern}':\n{text}")
        figures[key] = float(match.group(1))
    figures["valid"] = "Result is : VALID" in text
    figures["queries"] = issued[0]
    return figures, failures


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grpc", required=True, help="ember serve's gRPC address (host:port)")
    p.add_argument("--model", default="dlrm")
    p.add_argument("--data", required=True, help="a Parquet file or directory of raw rows")
    p.add_argument("--rows-per-query", type=int, default=256)
    p.add_argument("--qps", required=True, help="target queries/s, comma-separated, rising")
    p.add_argument("--duration-s", type=float, default=20.0, help="each rate's shortest run")
    p.add_argument("--max-queries", type=int, default=100000, help="each rate's most queries")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs at each rate; each figure reported is their median")
    p.add_argument("--target-latency-ms", type=float, default=60.0,
                   help="the p99 bound (MLPerf DLRMv2's server scenario: 60 ms)")
    p.add_argument("--distinct-queries", type=int, default=64)
    p.add_argument("--label", default="", help="what is served, for the JSON")
    p.add_argument("--offline-samples-per-s", type=float,
                   help="ember predict's throughput on the same model: rates are reported "
                        "as fractions of it")
    p.add_argument("--output", required=True, help="the JSON written")
    args = p.parse_args()

    client = grpcclient.InferenceServerClient(args.grpc)
    if not client.is_model_ready(args.model):
        sys.exit(f"{args.grpc}: model '{args.model}' is not ready")
    metadata = client.get_model_metadata(args.model, as_json=True)
    table = pq.read_table(args.data)
    queries = queries_of(metadata, table, args.rows_per_query, args.distinct_queries)
    # A warm-up request: the first batch pays for page faults.
    client.infer(args.model, queries[0])
    rates = []
    for qps in [float(q) for q in args.qps.split(",")]:
        started = time.time()
        runs, failures = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as outdir:
                figures, failed = run_rate(client, args.model, queries, qps, args, outdir)
            runs.append(figures)
            failures += failed
            if failed:
                break
        # Each figure the median of the runs (a stall of the machine in one
        # run moves its p99 a long way).
        figures = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        figures["valid"] = all(r["valid"] for r in runs)
        row = {
            "target_qps": qps,
            "target_samples_per_s": qps * args.rows_per_query,
            "completed_samples_per_s": figures["completed_qps"] * args.rows_per_query,
            **figures,
            "p50_ms": figures["p50_ns"] / 1e6,
            "p99_ms": figures["p99_ns"] / 1e6,
            "p999_ms": figures["p999_ns"] / 1e6,
            "p99_ms_runs": [r["p99_ns"] / 1e6 for r in runs],
            "seconds": time.time() - started,
            "failed": len(failures),
        }
        rates.append(row)
        print(f"{qps:g} q/s: completed {figures['completed_qps']:.1f} q/s, "
              f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms "
              f"(runs: {', '.join(f'{v:.1f}' for v in row['p99_ms_runs'])}), "
              f"p99.9 {row['p999_ms']:.2f} ms", file=sys.stderr)
        if failures:
            # Past what the server holds (it sheds): higher rates only shed more.
            print(f"{len(failures)} requests failed at {qps:g} queries/s, the last rate run: "
                  f"{failures[0]}", file=sys.stderr)
            break
    # The highest rate sustained (loadgen scheduled it and every query
    # completed) with its p99 within the bound.
    held = [r for r in rates
            if r["p99_ms"] <= args.target_latency_ms and r["failed"] == 0
            and r["completed_qps"] >= 0.95 * r["target_qps"]]
    best = max(held, key=lambda r: r["target_qps"], default=None)
    if args.offline_samples_per_s:
        for r in rates:
            r["fraction_of_offline"] = r["target_samples_per_s"] / args.offline_samples_per_s
    result = {
        "label": args.label,
        "offline_samples_per_s": args.offline_samples_per_s,
        "highest_within_bound": best,
        "model": args.model,
        "rows_per_query": args.rows_per_query,
        "repeats": args.repeats,
        "target_latency_ms": args.target_latency_ms,
        "loadgen": "mlcommons-loadgen server scenario (Poisson arrivals), tritonclient.grpc",
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "rates": rates,
    }
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.output)


if __name__ == "__main__":
    main()
