#!/usr/bin/env python3
"""Writes dense/tests/fixtures/hstu_layer.safetensors: one HSTU layer in
PyTorch, written from the reference (meta-recsys/generative-recommenders,
research/modeling/sequential/hstu.py: SequentialTransductionUnitJagged and
RelativeBucketedTimeAndPositionBasedBias, which run on padded tensors with
torch's own ops; the candidate mask of ops/pytorch/pt_hstu_attention.py),
with its inputs, weights, output and autograd gradients, so a Rust test
compares Ember's jagged layer with it (CI needs no torch).

Run with the peer environment (../shared/peer/setup.sh):
    /tmp/peer-venv/bin/python scripts/hstu_fixture.py
"""
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, DQK, DV, N, BUCKETS, ALPHA = 8, 2, 4, 3, 7, 128, 1.0
lengths = [5, 0, 1, 7, 3]
targets = [1, 0, 0, 2, 0]
B, T = len(lengths), sum(lengths)
offsets = [0]
for n in lengths:
    offsets.append(offsets[-1] + n)

x = torch.randn(T, D, requires_grad=True)
uvqk = (torch.randn(D, 2 * H * (DV + DQK)) * 0.3).requires_grad_()
o_w = (torch.randn(D, H * DV) * 0.3).requires_grad_()
o_b = (torch.randn(D) * 0.1).requires_grad_()
ts_w = (torch.randn(BUCKETS + 1) * 0.3).requires_grad_()
pos_w = (torch.randn(2 * N - 1) * 0.3).requires_grad_()

# Each user's timestamps increase (gaps of seconds to days); the query
# time follows the last one by an hour.
ts_list = []
query_list = []
for b in range(B):
    seq = sorted(torch.randint(0, 200_000, (lengths[b],)).tolist())
    ts_list += seq
    query_list.append((seq[-1] if seq else 0) + 3600)
ts = torch.tensor(ts_list, dtype=torch.int64)
query = torch.tensor(query_list, dtype=torch.int64)


def padded(values, width):
    """[B, N, width], zeros past each user's tokens (fbgemm's jagged_to_padded_dense)."""
    out = values.new_zeros(B, N, width)
    for b in range(B):
        out[b, : lengths[b]] = values[offsets[b] : offsets[b + 1]]
    return out


def rel_bias():
    """RelativeBucketedTimeAndPositionBasedBias: position and log-time buckets, [B, N, N]."""
    all_ts = torch.zeros(B, N + 1, dtype=torch.int64)
    for b in range(B):
        all_ts[b, : lengths[b]] = ts[offsets[b] : offsets[b + 1]]
        all_ts[b, lengths[b]] = query[b]  # the target's time, scattered at `len`
    # ext[b, i + 1] - ts[b, j]: the time the query token is followed at.
    diff = all_ts[:, 1:].unsqueeze(2) - all_ts[:, :N].unsqueeze(1)
    bucket = torch.clamp((torch.log(torch.abs(diff).clamp(min=1)) / 0.301).long(), 0, BUCKETS).detach()
    rel_ts = ts_w[bucket]
    i = torch.arange(N).unsqueeze(1)
    j = torch.arange(N).unsqueeze(0)
    rel_pos = pos_w[N - 1 + j - i]
    return rel_pos.unsqueeze(0) + rel_ts


def mask():
    """Causal with the diagonal; candidates see the history and themselves."""
    m = torch.zeros(B, N, N)
    for b in range(B):
        n, hist = lengths[b], lengths[b] - targets[b]
        for i in range(n):
            for j in range(n):
                if j == i or (j < i and j < hist):
                    m[b, i, j] = 1.0
    return m


normed = F.layer_norm(x, normalized_shape=[D], eps=1e-6)
u, v, q, k = torch.split(F.silu(normed @ uvqk), [H * DV, H * DV, H * DQK, H * DQK], dim=1)
pq = padded(q, H * DQK).view(B, N, H, DQK)
pk = padded(k, H * DQK).view(B, N, H, DQK)
pv = padded(v, H * DV).view(B, N, H, DV)
qk = torch.einsum("bnhd,bmhd->bhnm", pq, pk) * ALPHA
qk = qk + rel_bias().unsqueeze(1)
qk = F.silu(qk) / N
qk = qk * mask().unsqueeze(1)
attn = torch.einsum("bhnm,bmhd->bnhd", qk, pv).reshape(B, N, H * DV)
attn = torch.cat([attn[b, : lengths[b]] for b in range(B)])
gated = u * F.layer_norm(attn, normalized_shape=[H * DV], eps=1e-6)
y = F.linear(gated, o_w, o_b) + x

dy = torch.randn(T, D)
y.backward(dy)

tensors = {
    "config": torch.tensor([D, H, DQK, DV, N, BUCKETS], dtype=torch.float64),
    "alpha": torch.tensor([ALPHA]),
    "lengths": torch.tensor(lengths, dtype=torch.float64),
    "targets": torch.tensor(targets, dtype=torch.float64),
    "timestamps": ts.to(torch.float64),
    "query_times": query.to(torch.float64),
    "x": x.detach(),
    "_uvqk": uvqk.detach(),
    "_o.weight": o_w.detach(),
    "_o.bias": o_b.detach(),
    "_rel_attn_bias._ts_w": ts_w.detach(),
    "_rel_attn_bias._pos_w": pos_w.detach(),
    "y": y.detach(),
    "dy": dy,
    "grad.x": x.grad,
    "grad._uvqk": uvqk.grad,
    "grad._o.weight": o_w.grad,
    "grad._o.bias": o_b.grad,
    "grad._rel_attn_bias._ts_w": ts_w.grad,
    "grad._rel_attn_bias._pos_w": pos_w.grad,
}
path = Path(__file__).resolve().parent.parent / "dense/tests/fixtures/hstu_layer.safetensors"
path.parent.mkdir(parents=True, exist_ok=True)
save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
print(path, f"{path.stat().st_size} bytes")
