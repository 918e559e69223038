"""The DLRM kaggle preset trained from Python: TorchRec's DLRM module
(torchrec.models.dlrm.DLRM: dense arch, dot interaction, over arch) in torch,
its tables either Ember's EmbeddingBagCollection or TorchRec's on its CPU
production path (DistributedModelParallel on one rank, FBGEMM's fused TBE).

The shape is `ember bench dlrm --preset kaggle`'s: 26 tables x 100k rows x
16, bottom 13-512-256-64-16, top 512-256-1, batch 2048, one uniform id per
bag; row-wise Adagrad on the tables and Adagrad on the dense layers, both at
0.01. Prints one JSON line: the median step and samples/s (as `ember bench`
counts them: every timed step's samples over their total time).

    python python/benches/dlrm.py --impl ember --json
    python python/benches/dlrm.py --impl torchrec --json
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tables import run_info  # noqa: E402

NUM_DENSE, NUM_TABLES = 13, 26


def build(impl, args):
    import torchrec
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if impl == "ember":
        import ember
        from ember.optim import RowWiseAdagrad, apply_optimizer_in_backward

        tables = [ember.EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim,
                                           num_embeddings=args.rows, feature_names=[f"f{i}"])
                  for i in range(NUM_TABLES)]
        ebc = ember.EmbeddingBagCollection(tables)
        model = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                     dense_arch_layer_sizes=[512, 256, 64, args.dim],
                     over_arch_layer_sizes=[512, 256, 1])
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.01, "eps": 1e-8})
        dense = torch.optim.Adagrad(
            [p for _, p in in_backward_optimizer_filter(model.named_parameters())],
            lr=0.01, eps=1e-8)
        return model, dense, ember.KeyedJaggedTensor
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim,
                                          num_embeddings=args.rows, feature_names=[f"f{i}"])
              for i in range(NUM_TABLES)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                 dense_arch_layer_sizes=[512, 256, 64, args.dim],
                 over_arch_layer_sizes=[512, 256, 1], dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(),
                                {"lr": 0.01, "eps": 1e-8})
    net = DistributedModelParallel(module=model, device=torch.device("cpu"),
                                   env=ShardingEnv.from_process_group(dist.group.WORLD))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(net.named_parameters())),
                                  lambda params: torch.optim.Adagrad(params, lr=0.01, eps=1e-8))
    return net, CombinedOptimizer([net.fused_optimizer, dense]), torchrec.KeyedJaggedTensor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["ember", "torchrec"], required=True)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--input-batches", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, optimizer, kjt_class = build(args.impl, args)
    g = torch.Generator().manual_seed(7)
    keys = [f"f{i}" for i in range(NUM_TABLES)]
    lengths = torch.ones(NUM_TABLES * args.batch, dtype=torch.int64)
    batches = [(torch.rand(args.batch, NUM_DENSE, generator=g),
                kjt_class.from_lengths_sync(
                    keys, torch.randint(0, args.rows, (NUM_TABLES * args.batch,), generator=g),
                    lengths),
                torch.randint(0, 2, (args.batch,), generator=g).float())
               for _ in range(args.input_batches)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    model.train()
    times = []
    for i in range(args.warmup + args.iters):
        dense, kjt, labels = batches[i % len(batches)]
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(dense, kjt).squeeze(-1), labels)
        loss.backward()
        optimizer.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    result = {
        "run": run_info(),
        "case": "dlrm_kaggle_step",
        "impl": args.impl,
        "rows": args.rows, "dim": args.dim, "batch": args.batch, "threads": args.threads,
        "iters": args.iters,
        "step_ms_median": statistics.median(times) * 1e3,
        "samples_per_s": args.batch * len(times) / sum(times),
        "loss_last": float(loss.detach()),
        "torch": torch.__version__,
    }
    print(json.dumps(result) if args.json else result)


if __name__ == "__main__":
    main()
