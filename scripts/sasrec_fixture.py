#!/usr/bin/env python3
"""Writes models/tests/fixtures/sasrec_block.safetensors: one SASRec block
as the public PyTorch SASRec builds it (pmixer/SASRec.pytorch, model.py:
torch.nn.MultiheadAttention with a causal mask, LayerNorm eps 1e-8, the
Conv1d point-wise feed-forward; post-norm, its default), run on each
user's sequence alone (what Ember's jagged block computes), with inputs,
weights, output and autograd gradients, dropout off.

Run with the peer environment (../shared/peer/setup.sh):
    /tmp/peer-venv/bin/python scripts/sasrec_fixture.py
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, "/work/shared/peer/sasrec")  # the public SASRec, unchanged
from model import PointWiseFeedForward  # noqa: E402

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, HEADS = 6, 2
lengths = [4, 1, 0, 6]

attn_norm = torch.nn.LayerNorm(D, eps=1e-8)
attn = torch.nn.MultiheadAttention(D, HEADS, 0.0)
fwd_norm = torch.nn.LayerNorm(D, eps=1e-8)
ffn = PointWiseFeedForward(D, 0.0)
for m in (attn_norm, fwd_norm):  # not the identity: weights of their own
    torch.nn.init.uniform_(m.weight, 0.5, 1.5)
    torch.nn.init.uniform_(m.bias, -0.2, 0.2)
torch.nn.init.uniform_(attn.in_proj_bias, -0.2, 0.2)
torch.nn.init.uniform_(attn.out_proj.bias, -0.2, 0.2)
modules = {"attention_layernorms.0.": attn_norm, "attention_layers.0.": attn,
           "forward_layernorms.0.": fwd_norm, "forward_layers.0.": ffn}

x = torch.randn(sum(lengths), D, requires_grad=True)
outs, at = [], 0
for n in lengths:
    seqs = x[at:at + n].unsqueeze(0)  # (1, n, D), as model.log2feats, post-norm
    at += n
    if n == 0:
        continue
    mask = ~torch.tril(torch.ones((n, n), dtype=torch.bool))
    s = torch.transpose(seqs, 0, 1)
    mha_outputs, _ = attn(s, s, s, attn_mask=mask)
    s = attn_norm(s + mha_outputs)
    s = torch.transpose(s, 0, 1)
    s = fwd_norm(s + ffn(s))
    outs.append(s.squeeze(0))
y = torch.cat(outs)
dy = torch.randn_like(y)
y.backward(dy)

tensors = {"lengths": torch.tensor(lengths, dtype=torch.float64), "x": x.detach(), "y": y.detach(),
           "dy": dy, "grad.x": x.grad}
for prefix, m in modules.items():
    for name, p in m.named_parameters():
        tensors[prefix + name] = p.detach()
        tensors["grad." + prefix + name] = p.grad
path = Path(__file__).resolve().parent.parent / "models/tests/fixtures/sasrec_block.safetensors"
save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
print(path, sorted(tensors))
