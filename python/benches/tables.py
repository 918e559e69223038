"""Forward + backward + fused row-wise Adagrad of embedding-bag tables from
Python: Ember's module against TorchRec's EmbeddingBagCollection on its CPU
production path (DistributedModelParallel, one rank: FBGEMM's fused TBE).

The shape is FBGEMM's TBE benchmark's (26 tables x 1M rows x dim 128, batch
2048, one uniform id per bag), the peer's in ../shared/peer. Each iteration
is `pooled = ebc(kjt); pooled.values().backward(grad)`: the update happens
inside the backward. Prints one JSON line per implementation: the median
iteration and samples/s. Run one implementation per process (each holds
the tables: 13.3 GB at the default shape):

    python python/benches/tables.py --impl ember --json
    python python/benches/tables.py --impl torchrec --json
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch


def inputs(args):
    """The peer's inputs: uniform ids per table, one per bag; random gradients."""
    g = torch.Generator().manual_seed(1234)
    ids = [torch.randint(0, args.rows, (args.tables * args.batch,), generator=g)
           for _ in range(args.input_batches)]
    grads = [torch.randn(args.batch, args.tables * args.dim, generator=g)
             for _ in range(args.input_batches)]
    lengths = torch.ones(args.tables * args.batch, dtype=torch.int64)
    return ids, lengths, grads


def build_ember(args):
    import ember
    from ember.optim import RowWiseAdagrad

    tables = [ember.EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim,
                                       num_embeddings=args.rows, feature_names=[f"f{i}"])
              for i in range(args.tables)]
    ebc = ember.EmbeddingBagCollection(
        tables, optimizer=(RowWiseAdagrad, {"lr": 0.01, "eps": 1e-8}))
    return ebc, ember.KeyedJaggedTensor


def build_torchrec(args):
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim,
                                          num_embeddings=args.rows, feature_names=[f"f{i}"])
              for i in range(args.tables)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01, "eps": 1e-8})
    dmp = DistributedModelParallel(module=ebc, device=torch.device("cpu"),
                                   env=ShardingEnv.from_process_group(dist.group.WORLD))
    return dmp, torchrec.KeyedJaggedTensor


def run_info():
    """What `ember bench`'s `--json` says of a run: command, CPU, date, version."""
    info = open("/proc/cpuinfo").read().splitlines()
    field = lambda name: next((l.split(":", 1)[1].strip() for l in info
                               if l.split(":")[0].strip() == name), "")
    avx512 = "avx512f" in field("flags").split()
    try:
        import ember
        version = ember.__version__
    except ImportError:
        version = "unknown"
    return {
        "command": " ".join(["python"] + sys.argv),
        "cpu": f"{field('model name')} (family {field('cpu family')}, model {field('model')}; "
               f"{'AVX-512' if avx512 else 'no AVX-512'})",
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "version": version,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["ember", "torchrec"], required=True)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--input-batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    ebc, kjt_class = (build_ember if args.impl == "ember" else build_torchrec)(args)
    init_s = time.perf_counter() - started
    ids, lengths, grads = inputs(args)
    keys = [f"f{i}" for i in range(args.tables)]
    batches = [kjt_class.from_lengths_sync(keys, v, lengths) for v in ids]

    times = []
    for i in range(args.warmup + args.iters):
        started = time.perf_counter()
        pooled = ebc(batches[i % len(batches)])
        pooled.values().backward(grads[i % len(grads)])
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {
        "run": run_info(),
        "case": "fwd_bwd_rowwise_adagrad",
        "impl": args.impl,
        "tables": args.tables, "rows": args.rows, "dim": args.dim, "batch": args.batch,
        "threads": args.threads, "iters": args.iters,
        "iter_ms_median": statistics.median(times) * 1e3,
        # As `ember bench embedding` counts it: every timed iteration's samples
        # over their total time.
        "samples_per_s": args.batch * len(times) / sum(times),
        "init_s": init_s,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
