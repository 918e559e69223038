"""Train a DLRM in PyTorch with Ember's embedding tables.

This is a TorchRec user's training loop with the imports changed to
Ember's, and nothing else: the lines between the markers below replace
TorchRec's

    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

(python/tests/test_example.py runs the file both ways and compares). The
model is dlrm_s_pytorch's: a bottom MLP over the dense features, the dot
interaction of every pair of features, a top MLP. The data are synthetic
and learnable (a hidden logistic model over skewed ids and the dense
features), drawn from --seed, so a run repeats exactly.

    python python/examples/dlrm.py --steps 300 --json
"""

import argparse
import json
import math
import time

import torch
from torch import nn

# imports: begin
from ember import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from ember.optim import RowWiseAdagrad, apply_optimizer_in_backward, in_backward_optimizer_filter
# imports: end

NUM_DENSE = 13


def mlp(sizes, final_relu):
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, ebc, features, bottom, top):
        super().__init__()
        self.ebc = ebc
        self.features = features
        self.bottom = mlp([NUM_DENSE] + bottom, final_relu=True)
        f = len(features) + 1
        self.pairs = torch.tril_indices(f, f, offset=-1)
        self.top = mlp([bottom[-1] + f * (f - 1) // 2] + top, final_relu=False)

    def forward(self, dense, kjt):
        x = self.bottom(dense)
        pooled = self.ebc(kjt).to_dict()
        stacked = torch.stack([x] + [pooled[name] for name in self.features], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class SyntheticClicks:
    """Batches of a hidden logistic model: each id of each table has an
    effect, skewed ids (a power law) are common, and the dense features
    add a linear term. Batch i is drawn from its own seed."""

    def __init__(self, rows, batch_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.effects = [torch.randn(n, generator=g) for n in rows]
        self.dense_effect = torch.randn(NUM_DENSE, generator=g)
        self.names = [f"cat_{t}" for t in range(len(rows))]

    def batch(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        b = self.batch_size
        dense = torch.rand(b, NUM_DENSE, generator=g)
        ids = [(torch.rand(b, generator=g) ** 4 * n).long() for n in self.rows]
        logit = sum(e[t] for e, t in zip(self.effects, ids)) / math.sqrt(len(ids))
        logit = logit + (dense - 0.5) @ self.dense_effect
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.names,
            values=torch.cat(ids),
            lengths=torch.ones(len(ids) * b, dtype=torch.int64),
        )
        return dense, kjt, labels


def auc(scores, labels):
    """Area under the ROC curve by ranks (ties averaged)."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    for value in torch.unique(scores):  # average the ranks of ties
        tied = scores == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2)
                 / (positives * negatives))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8, help="sparse features, one table each")
    parser.add_argument("--rows", type=int, default=20_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300, help="training batches")
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()

    rows = [args.rows] * args.tables
    data = SyntheticClicks(rows, args.batch_size, args.seed)
    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=args.dim, num_embeddings=n,
                           feature_names=[name])
        for name, n in zip(data.names, rows)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    # Every random draw after the tables exist, in one order: the rows as
    # dlrm_s_pytorch initialises them, then the dense layers.
    torch.manual_seed(args.seed)
    with torch.no_grad():
        for table, param in zip(tables, ebc.parameters()):
            bound = math.sqrt(1.0 / table.num_embeddings)
            param.uniform_(-bound, bound)
    model = DLRM(ebc, data.names, bottom=[64, args.dim], top=[64, 1])
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(),
                                {"lr": args.lr, "eps": 1e-8})
    dense_params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    dense_optimizer = torch.optim.Adagrad(dense_params, lr=args.lr, eps=1e-8)
    loss_fn = nn.BCEWithLogitsLoss()

    model.train()
    losses = []
    started = time.perf_counter()
    for step in range(args.steps):
        dense, kjt, labels = data.batch(step)
        loss = loss_fn(model(dense, kjt), labels)
        dense_optimizer.zero_grad()
        loss.backward()  # the tables are updated here, inside the backward
        dense_optimizer.step()
        losses.append(float(loss.detach()))
    train_s = time.perf_counter() - started

    model.eval()
    scores, truth = [], []
    with torch.no_grad():
        for i in range(args.eval_batches):
            dense, kjt, labels = data.batch(args.steps + i)
            scores.append(torch.sigmoid(model(dense, kjt)))
            truth.append(labels)
    result = {
        "auc": auc(torch.cat(scores).double(), torch.cat(truth).double()),
        "train_loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
        "samples_per_s": args.steps * args.batch_size / train_s,
        "steps": args.steps,
        "batch_size": args.batch_size,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


if __name__ == "__main__":
    main()
