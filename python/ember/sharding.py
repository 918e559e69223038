"""Ember's planner: how a module's tables are sharded over devices of this
process, each a thread (TorchRec's ``EmbeddingShardingPlanner`` over a
``Topology``). Pass ``shard_over=N`` to ``ember.EmbeddingBagCollection`` for
the planner's plan, or ``plan=`` for one of your own:

    from ember.sharding import plan
    p = plan(tables, world_size=4, batch_size=2048, sharding_type="row_wise")
    ebc = EmbeddingBagCollection(tables, plan=p, optimizer=(RowWiseAdagrad, {"lr": 0.01}))

A plan is Ember's ``ShardingPlan`` as a dict (the JSON ``ember plan --json``
writes): per table its sharding type (TorchRec's names: ``table_wise``,
``row_wise``, ``column_wise``, ``table_row_wise``, ``data_parallel``, and
Ember's ``row_wise_mod``) and its shards' devices, rows and columns.
"""

from __future__ import annotations

import json
import operator
from typing import List, Optional

from ember import _native
from ember.configs import EmbeddingBagConfig, table_optimizer_spec, tables_json


def _sharding_name(sharding_type) -> Optional[str]:
    if sharding_type is None or isinstance(sharding_type, str):
        return sharding_type
    # TorchRec's ShardingType enum: its value is the name.
    return str(getattr(sharding_type, "value", sharding_type))


def optimizer_json(optimizer) -> str:
    """A table optimizer ((class, kwargs) or Ember's dict) as Ember's
    ``TableOptimizer`` JSON (None: ``{"type": "none"}``)."""
    if optimizer is None:
        return '{"type": "none"}'
    return json.dumps(table_optimizer_spec(optimizer))


def plan(tables: List[EmbeddingBagConfig], world_size: int, *, batch_size: int = 512,
         pooling_factor: float = 1.0, sharding_type=None, optimizer=None,
         memory_bytes: Optional[int] = None) -> dict:
    """The planner's plan of ``tables`` over ``world_size`` devices of
    ``memory_bytes`` each (None: unbounded, the load balanced alone), for
    batches of ``batch_size`` (TorchRec's ``Topology`` default, 512) with
    ``pooling_factor`` ids a bag on average. ``sharding_type`` (a name, or
    TorchRec's ``ShardingType``) forces one type on every table;
    ``optimizer`` ((class, kwargs) or Ember's dict) sizes the optimizer
    state and rules out what it cannot run on (row-wise Adagrad:
    column-wise)."""
    if isinstance(world_size, bool):
        raise ValueError(f"world_size {world_size!r}: a number of devices")
    return json.loads(_native.plan(
        tables_json(tables), operator.index(world_size), operator.index(batch_size),
        float(pooling_factor), optimizer_json(optimizer), _sharding_name(sharding_type),
        None if memory_bytes is None else int(memory_bytes)))
