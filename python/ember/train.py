"""Ember's whole engine from Python: a DLRM whose tables and dense towers
both run in Rust, trained by Ember's Trainer (epochs, evaluations,
checkpoints in TorchRec's names, resumption) on the Parquet loader. For
users who want the engine rather than a torch model of their own; torch is
not needed.

    from ember.data import ParquetLoader
    from ember.train import DLRM, Trainer

    model = DLRM(tables, dense_in_features=13, dense_arch_layer_sizes=[512, 256, 64, 16],
                 over_arch_layer_sizes=[512, 256, 1])
    summary = Trainer(epochs=1).fit(model, ParquetLoader(["train/"], 2048, tables=tables),
                                    eval=ParquetLoader(["test/"], 2048, tables=tables))
    print(summary["eval"]["auc"])

The arguments follow TorchRec's ``DLRM`` and ``DLRM_DCN`` (``dcn_num_layers``
and ``dcn_low_rank_dim`` make the DCNv2 interaction). Optimizers are
``(class, kwargs)`` as for ``ember.optim.apply_optimizer_in_backward``, or
Ember's own configs as dicts: a ``TableOptimizer``
(``{"type": "row_wise_adagrad", "lr": 0.01, "eps": 1e-8}``) for the tables, a
``DenseOptimizerConfig`` (``{"Adagrad": {"lr": 0.01, "eps": 1e-8}}``) for the
dense towers. Without them, Ember's defaults: row-wise Adagrad on the
tables and Adagrad on the dense towers, both at 0.01.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ember import _native
from ember.configs import EmbeddingBagConfig
from ember.data import ParquetLoader

_DENSE = {"sgd": "Sgd", "adagrad": "Adagrad", "adam": "Adam"}


def _table_optimizer(spec: Union[dict, tuple]) -> dict:
    if isinstance(spec, dict):
        return spec
    from ember.optim import table_optimizer

    optimizer_class, kwargs = spec
    return table_optimizer(optimizer_class, kwargs)


def _dense_optimizer(spec: Union[dict, tuple]) -> dict:
    if isinstance(spec, dict):
        return spec
    rule = _table_optimizer(spec)
    kind = _DENSE.get(rule.pop("type"))
    if kind is None:
        raise ValueError("the dense towers take SGD, Adagrad or Adam")
    return {kind: rule}


class DLRM:
    """A DLRM trained by Ember: ``tables`` (one embedding dim), a bottom MLP
    from ``dense_in_features`` through ``dense_arch_layer_sizes`` (ending at
    the embedding dim), the dot interaction (or DCNv2's), and a top MLP of
    ``over_arch_layer_sizes`` (ending at 1). ``shard_over`` shards the tables
    over that many in-process devices by the planner's plan."""

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        dense_in_features: int,
        dense_arch_layer_sizes: Sequence[int],
        over_arch_layer_sizes: Sequence[int],
        *,
        dcn_num_layers: Optional[int] = None,
        dcn_low_rank_dim: Optional[int] = None,
        table_optimizer: Optional[Union[dict, tuple]] = None,
        dense_optimizer: Optional[Union[dict, tuple]] = None,
        seed: int = 0,
        shard_over: Optional[int] = None,
    ) -> None:
        if (dcn_num_layers is None) != (dcn_low_rank_dim is None):
            raise ValueError("give both dcn_num_layers and dcn_low_rank_dim, or neither")
        interaction = ({"type": "dot"} if dcn_num_layers is None else
                       {"type": "dcn", "layers": dcn_num_layers, "rank": dcn_low_rank_dim})
        config = {
            "tables": [t._to_ember() for t in tables],
            "bottom_mlp": [int(dense_in_features)] + [int(s) for s in dense_arch_layer_sizes],
            "top_mlp": [int(s) for s in over_arch_layer_sizes],
            "interaction": interaction,
        }
        self._native = _native.Dlrm(
            json.dumps(config),
            json.dumps(None if table_optimizer is None else _table_optimizer(table_optimizer)),
            json.dumps(None if dense_optimizer is None else _dense_optimizer(dense_optimizer)),
            int(seed), shard_over)

    def predict(self, dense: Any, kjt: Any) -> Any:
        """Logits ``[batch]`` of a batch (dense float32 ``[batch, num_dense]``
        and an ``ember.KeyedJaggedTensor``)."""
        logits = self._native.predict(dense, kjt._native)
        try:
            import torch
        except ImportError:
            return logits
        return torch.from_dlpack(logits)

    def evaluate(self, data: ParquetLoader, batches: Optional[int] = None) -> Dict[str, float]:
        """AUC, log loss and accuracy on the first ``batches`` of ``data``."""
        return self._native.evaluate(data._native, batches)

    def save(self, directory: Union[str, os.PathLike]) -> str:
        """Writes a checkpoint into ``directory`` (TorchRec's names); its path."""
        return str(self._native.save(os.fspath(directory)))

    def load(self, path: Union[str, os.PathLike]) -> None:
        """Loads a checkpoint's weights and optimizer state. A checkpoint that
        fails to load part-way leaves the model without its tables: build a
        new one."""
        self._native.load(os.fspath(path))


class Trainer:
    """Ember's training loop (its ``TrainerConfig``): ``epochs``, ``max_steps``,
    evaluation every ``eval_every`` steps and at epoch ends, checkpoints in
    ``checkpoint_dir`` every ``checkpoint_every`` steps and at epoch ends, a
    log event every ``log_every`` batches, the batch pipeline thread."""

    def __init__(self, epochs: int = 1, *, max_steps: Optional[int] = None, eval_every: int = 0,
                 eval_at_epoch_end: bool = True,
                 checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_every: int = 0, log_every: int = 100, pipeline: bool = True) -> None:
        self._native = _native.Trainer(
            epochs, max_steps, eval_every, eval_at_epoch_end,
            None if checkpoint_dir is None else os.fspath(checkpoint_dir),
            checkpoint_every, log_every, pipeline)

    def fit(self, model: DLRM, train: ParquetLoader, eval: Optional[ParquetLoader] = None,
            on_event: Optional[Callable[[dict], None]] = None,
            resume: bool = False) -> Dict[str, Any]:
        """Trains ``model`` on ``train`` (evaluating on ``eval``); with
        ``resume``, from the checkpoint directory's latest checkpoint.

        ``on_event`` hears Ember's ``TrainEvent``s as dicts, ``event`` naming
        each: ``start``, ``step`` (``loss``; ``times`` in seconds), ``train``
        (a log line every ``log_every`` batches; its ``ms_per_step`` in
        milliseconds), ``eval`` (``auc``, ``logloss``, ``accuracy``, ``rows``;
        NaN arrives as None), ``checkpoint`` (``path``), ``epoch_rest_skipped``,
        ``batches_left_out``. It runs while the model is training: it may not
        use the model. An exception it raises, or Ctrl-C, stops the run
        within two batches (those the pipeline had already taken, which run
        unheard) and is raised. Returns the summary: steps, samples, seconds, first and
        last loss, the last evaluation (None without one), the last
        checkpoint."""
        return self._native.fit(model._native, train._native,
                                None if eval is None else eval._native, on_event, resume)
