#!/usr/bin/env python3
"""Writes models/tests/fixtures/torchrec_embedding_collection.safetensors: a
TorchRec EmbeddingCollection's state_dict (two tables, one shared by two
features), a KeyedJaggedTensor batch and TorchRec's forward of it, so that
a Rust test checks Ember's EmbeddingCollection against TorchRec itself
(names, shapes, which row lands where) without torch in CI.

Tensors: `embeddings.<table>.weight` (the state_dict, as TorchRec names
it); `batch.lengths`, `batch.values` (the KJT, keys history, candidate,
action, as f32); `output.<feature>` (each feature's JaggedTensor values).

Run with the peer environment (../shared/peer/setup.sh):
    /tmp/peer-venv/bin/python scripts/torchrec_sequence_fixture.py
"""
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

torch.manual_seed(0)
ec = EmbeddingCollection(
    tables=[
        EmbeddingConfig(name="t_items", embedding_dim=4, num_embeddings=50,
                        feature_names=["history", "candidate"]),
        EmbeddingConfig(name="t_actions", embedding_dim=4, num_embeddings=5,
                        feature_names=["action"]),
    ],
    device=torch.device("cpu"),
)
keys = ["history", "candidate", "action"]
# Three users: histories of 3, 0 and 1 items; a candidate each; actions of
# the histories.
lengths = torch.tensor([3, 0, 1, 1, 1, 1, 3, 0, 1])
values = torch.tensor([7, 12, 7, 49, 3, 7, 0, 0, 2, 4, 1])
kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
out = ec(kjt)

tensors = {k: v.detach().clone().contiguous() for k, v in ec.state_dict().items()}
tensors["batch.lengths"] = lengths.to(torch.float32)
tensors["batch.values"] = values.to(torch.float32)
for k in keys:
    tensors[f"output.{k}"] = out[k].values().detach().clone().contiguous()
path = Path(__file__).resolve().parent.parent / "models/tests/fixtures/torchrec_embedding_collection.safetensors"
path.parent.mkdir(parents=True, exist_ok=True)
save_file(tensors, str(path), metadata={"format": "pt"})
print(path, sorted(tensors))
