#!/usr/bin/env python3
"""A paper estimate of DLRM training on many hosts (one rank each), from the
planner's cost model (`ember plan`) and the dense step measured on one host.

step = the planner's estimate for the most loaded device (its lookups and the
       ids, pooled rows and gradients it exchanges, at the network bandwidth)
     + the dense forward, backward and update of one host's batch (measured)
     + the dense gradients' all-reduce: each rank sends 2(N-1)/N of them,
       in 2(N-1) messages (reduce-scatter, then all-gather).

Weak scaling: every host keeps a batch of 2048, the global batch grows with N.
Usage: scripts/scaling_estimate.py [path/to/ember]
"""
import json
import subprocess
import sys
import tempfile

EMBER = sys.argv[1] if len(sys.argv) > 1 else "target/release/ember"
HOST_BATCH = 2048
LATENCY_S = 5e-6  # one message on the network
MEMORY_BANDWIDTH = 13e9  # random row reads per device, measured here (the planner's default)

# Dense parameters (floats) and the dense step per 2048 samples on one host
# (native backend, 2 threads; the PJRT guide's table: forward + backward + update).
PRESETS = {
    "kaggle": {"dense_params": 476_001, "dense_ms": 6.4 + 11.7 + 0.2},
    "mlperf": {"dense_params": 16_044_545, "dense_ms": 167 + 329 + 4.2},
}


def planner_ms(preset, hosts, bandwidth):
    topo = {
        "devices": [{"memory_bytes": 64 << 30, "memory_bandwidth": MEMORY_BANDWIDTH}] * hosts,
        "devices_per_host": 1,
        "device_bandwidth": bandwidth,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as t, tempfile.NamedTemporaryFile(suffix=".json") as out:
        json.dump(topo, t)
        t.flush()
        r = subprocess.run(
            [EMBER, "plan", "--preset", preset, "--topology", t.name, "--optimizer", "rowwise-adagrad",
             "--mini-batch-size", str(HOST_BATCH * hosts), "--output", out.name, "--json"],
            capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["stats"]["max_cost_s"] * 1e3


def main():
    print("| preset | hosts | network | embeddings (planner) ms | dense ms | all-reduce ms | step ms | samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, p in PRESETS.items():
        for gbit in [100, 400]:
            bw = gbit / 8 * 1e9
            for hosts in [8, 64, 512]:
                emb = planner_ms(preset, hosts, bw)
                reduce = (2 * (hosts - 1) / hosts * p["dense_params"] * 4 / bw
                          + 2 * (hosts - 1) * LATENCY_S) * 1e3
                step = emb + p["dense_ms"] + reduce
                rate = HOST_BATCH * hosts / step * 1e3
                print(f"| {preset} | {hosts} | {gbit} Gb/s | {emb:.1f} | {p['dense_ms']:.1f} | {reduce:.1f} | {step:.1f} | {rate / 1e6:.2f} M |")


if __name__ == "__main__":
    main()
