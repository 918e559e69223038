#!/usr/bin/env python3
"""What TorchRec on CPU does with the full MLPerf DLRMv2 tables (26 tables,
204,184,588 rows of dim 128), the shape `ember bench dlrm --preset mlperf
--max-ind-range 40000000 --table-dtype fp16 --disk-dir D --cache-memory 12GiB`
trains on one 24 GiB machine.

TorchRec keeps every table in memory. This builds its EmbeddingBagCollection
on the CPU (fp32, TorchRec's default, or fp16 with `--fp16`) in a child
process, table by table, and reports how far it got: the tables built and
their bytes, then how the child ended (an allocation error, or killed by the
kernel when memory ran out). The child is expected to fail; the script
exits 0 once it has reported.

Needs the peer environment (torch, torchrec), e.g. ../shared/peer/setup.sh's:
    /tmp/peer-venv/bin/python scripts/torchrec_mlperf_tables.py [--fp16]
"""
import json
import subprocess
import sys

# The MLPerf DLRMv2 table sizes (the reference's --num_embeddings_per_feature),
# as Ember's --preset mlperf.
ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
    11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
DIM = 128

CHILD = r"""
import sys, torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
rows, fp16 = eval(sys.argv[1]), sys.argv[2] == "1"
built = 0
for i, r in enumerate(rows):
    config = EmbeddingBagConfig(name=f"t_cat_{i}", embedding_dim=%d, num_embeddings=r,
                                feature_names=[f"cat_{i}"],
                                data_type=DataType.FP16 if fp16 else DataType.FP32)
    # One collection per table, so that the report says how far it got; the
    # model would hold all of them at once, as these stay alive.
    globals().setdefault("kept", []).append(
        EmbeddingBagCollection(tables=[config], device=torch.device("cpu")))
    built += r * %d * (2 if fp16 else 4)
    print(f"built {i} {r} {built}", flush=True)
print("all built", flush=True)
""" % (DIM, DIM)


def main():
    fp16 = "--fp16" in sys.argv[1:]
    width = 2 if fp16 else 4
    total = sum(ROWS) * DIM * width
    child = subprocess.run(
        [sys.executable, "-c", CHILD, repr(ROWS), "1" if fp16 else "0"],
        capture_output=True, text=True)
    built = [line.split() for line in child.stdout.splitlines() if line.startswith("built")]
    report = {
        "dtype": "fp16" if fp16 else "fp32",
        "tables": len(ROWS),
        "rows": sum(ROWS),
        "table_bytes": total,
        "tables_built": len(built),
        "bytes_built": int(built[-1][3]) if built else 0,
        "all_built": "all built" in child.stdout,
        "returncode": child.returncode,
        "killed_by_signal": -child.returncode if child.returncode < 0 else None,
        "error": child.stderr.strip().splitlines()[-1] if child.stderr.strip() else None,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
