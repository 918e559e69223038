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

The sequence models train the same way, on users' histories (a Parquet
file of ``ember ingest sequences``, or lists), split as SASRec's and HSTU's
references evaluate (each user's last item for test, the one before for
validation):

    from ember.train import Histories, SASRec, Trainer

    histories = Histories.read("histories.parquet")
    train, valid, test = histories.leave_out()
    model = SASRec(num_items=histories.num_items, maxlen=200)
    Trainer(epochs=20).fit(model, model.loader(train, batch_size=128, shuffle_seed=0))
    print(model.evaluate(test, negatives=100))   # HR@10, NDCG@10, MRR

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
import operator
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ember import _native
from ember.configs import EmbeddingBagConfig, table_optimizer_spec
from ember.data import ParquetLoader

Histories = _native.Histories
"""Users' histories in time order: ``Histories(items, timestamps=None,
actions=None)`` from lists (one a user), ``Histories.read(path)`` from a
user-history Parquet file; ``len()``, ``num_items``, ``items(u)``, and
``leave_out(held=1)`` -> ``(train, valid, test)``."""

_DENSE = {"sgd": "Sgd", "adagrad": "Adagrad", "adam": "Adam"}


def _dense_optimizer(spec: Union[dict, tuple]) -> dict:
    if isinstance(spec, dict):
        return spec
    rule = table_optimizer_spec(spec)
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
            json.dumps(None if table_optimizer is None else table_optimizer_spec(table_optimizer)),
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


class _SequenceModel:
    """What the sequence models share: their loader, evaluation and
    checkpoints (the model itself is Ember's, in Rust)."""

    _native: Any

    def loader(self, histories, batch_size: int = 128, shuffle_seed: Optional[int] = None,
               bucket_batches: int = 1):
        """``histories`` as this model's training batches of ``batch_size``
        users, each cut to the items the model reads, shuffled by
        ``shuffle_seed`` every epoch (None: in order), sorted by length in
        windows of ``bucket_batches`` batches (1: not)."""
        return self._native.loader(histories, batch_size, shuffle_seed, bucket_batches)

    def evaluate(self, histories, negatives: Union[int, str] = "all",
                 top_k: int = 10) -> Dict[str, Any]:
        """Quality on ``histories`` whose last items were held out (the
        ``valid`` or ``test`` of ``Histories.leave_out``). Retrieval models:
        ``hit_rate`` (HR@top_k), ``ndcg``, ``mrr`` and ``users``, each last
        item ranked against ``negatives``: ``"all"`` items, or that many
        sampled ones the user never saw (SASRec's paper: 100)."""
        if isinstance(negatives, str) and negatives == "all":
            negatives = None
        else:
            try:
                negatives = operator.index(negatives)
            except TypeError:
                raise ValueError(
                    f"negatives {negatives!r}: 'all' or a number of sampled items") from None
        return self._native.evaluate(histories, negatives, operator.index(top_k))

    def save(self, directory: Union[str, os.PathLike]) -> str:
        """Writes a checkpoint into ``directory``; its path."""
        return str(self._native.save(os.fspath(directory)))

    def load(self, path: Union[str, os.PathLike]) -> None:
        """Loads a checkpoint's weights and optimizer state."""
        self._native.load(os.fspath(path))


class SASRec(_SequenceModel):
    """SASRec as the public PyTorch SASRec trains it (its argument names
    and defaults), Adam at ``lr``: causal self-attention over the ``maxlen``
    most recent items. ``loss="bce"`` is its own (the next item against one
    the user never saw); ``"sampled_softmax"`` is HSTU's (``num_negatives``
    at ``temperature``)."""

    def __init__(self, num_items: int, maxlen: int = 200, *, hidden_units: int = 50,
                 num_blocks: int = 2, num_heads: int = 1, dropout_rate: float = 0.2,
                 lr: float = 1e-3, norm_first: bool = False, loss: str = "bce",
                 num_negatives: int = 128, temperature: float = 0.05, seed: int = 0) -> None:
        self._native = _native.SequenceModel.sasrec(
            num_items, maxlen, hidden_units, num_blocks, num_heads, dropout_rate, lr,
            norm_first, loss, num_negatives, temperature, seed)


class HSTURetrieval(_SequenceModel):
    """HSTU trained for next-item retrieval with a sampled softmax (the
    generative-recommenders reference's MovieLens shape by default):
    ``negative_sampling`` ``"uniform"`` or ``"in_batch"``; ``attention_dim``
    and ``linear_dim`` per head default to ``embedding_dim / num_heads``."""

    def __init__(self, num_items: int, max_sequence_len: int = 200, *,
                 embedding_dim: int = 50, num_blocks: int = 2, num_heads: int = 1,
                 attention_dim: Optional[int] = None, linear_dim: Optional[int] = None,
                 num_negatives: int = 128, negative_sampling: str = "uniform",
                 temperature: float = 0.05, dropout_rate: float = 0.2,
                 learning_rate: float = 1e-3, seed: int = 0) -> None:
        per_head = embedding_dim // max(num_heads, 1)
        self._native = _native.SequenceModel.hstu_retrieval(
            num_items, max_sequence_len, embedding_dim, num_blocks, num_heads,
            per_head if attention_dim is None else attention_dim,
            per_head if linear_dim is None else linear_dim, num_negatives, negative_sampling,
            temperature, dropout_rate, learning_rate, seed)


class HSTURanking(_SequenceModel):
    """HSTU ranking each user's last ``num_candidates`` items' actions
    (DLRMv4's shape): ``num_tasks`` action bits, each a task, scored by AUC
    and log loss (``evaluate`` returns ``candidates`` and ``tasks``). The
    dense parts train with Adam at ``learning_rate``; the item table with
    ``table_optimizer`` ((class, kwargs) or Ember's ``TableOptimizer`` dict;
    None: row-wise Adagrad at 0.05). Its histories need actions."""

    def __init__(self, num_items: int, max_sequence_len: int = 200, *,
                 embedding_dim: int = 64, num_blocks: int = 2, num_heads: int = 2,
                 attention_dim: int = 32, linear_dim: int = 32, num_candidates: int = 8,
                 num_tasks: int = 2, head_hidden: int = 64, dropout_rate: float = 0.2,
                 learning_rate: float = 1e-3,
                 table_optimizer: Optional[Union[dict, tuple]] = None, seed: int = 0) -> None:
        table = (None if table_optimizer is None
                 else json.dumps(table_optimizer_spec(table_optimizer)))
        self._native = _native.SequenceModel.hstu_ranking(
            num_items, max_sequence_len, embedding_dim, num_blocks, num_heads, attention_dim,
            linear_dim, num_candidates, num_tasks, head_hidden, dropout_rate, learning_rate,
            table, seed)


class Trainer:
    """Ember's training loop (its ``TrainerConfig``): ``epochs``, ``max_steps``,
    evaluation every ``eval_every`` steps, every ``eval_every_fraction`` of
    an epoch and at epoch ends, a stop at the first evaluation whose AUC
    reaches ``stop_at_auc``, checkpoints in ``checkpoint_dir`` every
    ``checkpoint_every`` steps and at epoch ends, a log event every
    ``log_every`` batches, the batch pipeline thread.

    ``optimization`` is Ember's ``Optimization`` as a dict: learning-rate
    schedules for the tables and the dense layers, weight decay and
    clipping, e.g. ``{"sparse_schedule": {"type": "policy", "warmup_steps":
    100, "decay_start_step": 1000, "decay_steps": 500}, "dense_schedule":
    {"type": "linear_warmup", "steps": 100}, "dense_weight_decay": {"type":
    "decoupled", "rate": 0.01}, "table_weight_decay": 1e-5,
    "max_grad_norm": 1.0}`` (fields left out: none). A checkpoint records
    it; a resume must give the same."""

    def __init__(self, epochs: int = 1, *, max_steps: Optional[int] = None, eval_every: int = 0,
                 eval_at_epoch_end: bool = True,
                 checkpoint_dir: Optional[Union[str, os.PathLike]] = None,
                 checkpoint_every: int = 0, log_every: int = 100, pipeline: bool = True,
                 optimization: Optional[dict] = None,
                 eval_every_fraction: Optional[float] = None,
                 stop_at_auc: Optional[float] = None) -> None:
        self._native = _native.Trainer(
            epochs, max_steps, eval_every, eval_at_epoch_end,
            None if checkpoint_dir is None else os.fspath(checkpoint_dir),
            checkpoint_every, log_every, pipeline,
            None if optimization is None else json.dumps(optimization),
            eval_every_fraction, stop_at_auc)

    def fit(self, model: Union[DLRM, _SequenceModel], train: Any,
            eval: Optional[ParquetLoader] = None,
            on_event: Optional[Callable[[dict], None]] = None,
            resume: bool = False) -> Dict[str, Any]:
        """Trains ``model`` on ``train`` (evaluating on ``eval``); with
        ``resume``, from the checkpoint directory's latest checkpoint. A
        ``DLRM`` trains on a ``ParquetLoader``; a sequence model on its
        ``loader(histories)``, and is evaluated by its ``evaluate``.

        ``on_event`` hears Ember's ``TrainEvent``s as dicts, ``event`` naming
        each: ``start``, ``step`` (``loss``; ``times`` in seconds), ``train``
        (a log line every ``log_every`` batches; its ``ms_per_step`` in
        milliseconds), ``eval_start``, ``eval`` (``auc``, ``logloss``,
        ``accuracy``, ``ne``, ``calibration``, ``precision``, ``recall``,
        ``f1``, ``average_precision``, ``rows``; NaN arrives as None),
        ``target_reached`` (``auc``, ``target``), ``checkpoint`` (``path``),
        ``epoch_rest_skipped``, ``batches_left_out``. It runs while the model is training: it may not
        use the model. An exception it raises, or Ctrl-C, stops the run
        within two batches (those the pipeline had already taken, which run
        unheard) and is raised. Returns the summary: steps, samples, seconds, first and
        last loss, the last evaluation (None without one), the last
        checkpoint."""
        return self._native.fit(getattr(model, "_native", model), getattr(train, "_native", train),
                                None if eval is None else eval._native, on_event, resume)
