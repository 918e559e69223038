"""Tables sharded over in-process devices (``shard_over``, ``plan``): every
sharding type trains as the whole tables do; state dicts and checkpoints
cross between sharded and whole; bad plans and combinations are refused."""

import pytest
import torch

from ember import EmbeddingBagCollection, EmbeddingBagConfig
from ember.optim import RowWiseAdagrad
from ember.sharding import plan

from conftest import batch, tables

TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel",
         "row_wise_mod"]


def close(a, b):
    """Row-wise shards pool partial sums, added up in another order."""
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def train(ebc, steps, first=40):
    """`steps` lookups, each followed by the backward of a fixed loss; the
    pooled outputs."""
    outs = []
    for step in range(steps):
        kjt = batch(first + step)
        out = ebc(kjt).values()
        g = torch.Generator().manual_seed(step)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        outs.append(out.detach().clone())
    return outs


@pytest.mark.parametrize("sharding", TYPES + [None])
@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.5}),
                                       (torch.optim.Adagrad, {"lr": 0.1})])
def test_sharded_tables_train_as_whole_ones(sharding, optimizer):
    whole = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=5)
    p = plan(tables(), 3, sharding_type=sharding, optimizer=optimizer)
    sharded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=5, plan=p)
    assert sharded.plan == p
    if sharding is not None:
        assert {t["sharding"] for t in p["tables"]} == {sharding}
    assert list(sharded.parameters()) == []
    for ours, theirs in zip(train(sharded, 5), train(whole, 5)):
        # Data-parallel replicas sum their gradients in another order.
        close(ours, theirs)
    assert sharded.step == whole.step == 5
    state, expected = sharded.state_dict(), whole.state_dict()
    assert list(state) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight"]
    for key, value in expected.items():
        close(state[key], value)
    if optimizer[0] is torch.optim.Adagrad:
        for name in ("t0", "t1"):
            close(sharded.optimizer_state(name), whole.optimizer_state(name))


def test_shard_over_takes_the_planners_plan():
    optimizer = (RowWiseAdagrad, {"lr": 0.1})
    ebc = EmbeddingBagCollection(tables(), optimizer=optimizer, shard_over=2)
    assert ebc.plan == plan(tables(), 2, optimizer=optimizer)
    assert ebc.plan["num_devices"] == 2
    assert "sharded over 2 devices" in repr(ebc._collection)
    whole = EmbeddingBagCollection(tables(), optimizer=optimizer)
    assert whole.plan is None
    for ours, theirs in zip(train(ebc, 3), train(whole, 3)):
        assert torch.equal(ours, theirs)


def test_state_dicts_cross_between_sharded_and_whole_tables():
    optimizer = (torch.optim.SGD, {"lr": 0.5})
    whole = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=1)
    train(whole, 2)
    sharded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=2,
                                     plan=plan(tables(), 2, sharding_type="row_wise"))
    # Held by a parent module, as in a model: the keys carry its prefix.
    parent = torch.nn.Module()
    parent.sparse = sharded
    parent.load_state_dict({"sparse." + k: v for k, v in whole.state_dict().items()})
    assert list(parent.state_dict()) == ["sparse.embedding_bags.t0.weight",
                                         "sparse.embedding_bags.t1.weight"]
    with torch.no_grad():
        close(sharded(batch(9)).values(), whole(batch(9)).values())
    # And back: the sharded tables trained on, loaded into whole ones (the
    # loss's gradient does not depend on the outputs: the rows stay exact).
    for ours, theirs in zip(train(sharded, 2, first=70), train(whole, 2, first=70)):
        close(ours, theirs)
    fresh = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=3)
    fresh.load_state_dict(sharded.state_dict())
    for key, value in whole.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    # torch's rules: strict=False loads the tables given and reports the
    # rest; a wrong shape is an error and leaves that table as it was.
    t1 = sharded.state_dict()["embedding_bags.t1.weight"]
    result = sharded.load_state_dict({"embedding_bags.t0.weight": torch.ones(50, 4)},
                                     strict=False)
    assert result.missing_keys == ["embedding_bags.t1.weight"]
    assert torch.equal(sharded.state_dict()["embedding_bags.t0.weight"], torch.ones(50, 4))
    with pytest.raises(RuntimeError, match="Missing key.*embedding_bags.t1.weight"):
        sharded.load_state_dict({"embedding_bags.t0.weight": torch.zeros(50, 4)})
    with pytest.raises(RuntimeError, match="size mismatch for embedding_bags.t1.weight"):
        sharded.load_state_dict({"embedding_bags.t0.weight": torch.zeros(50, 4),
                                 "embedding_bags.t1.weight": torch.zeros(8, 8)})
    assert torch.equal(sharded.state_dict()["embedding_bags.t1.weight"], t1)
    with pytest.raises(ValueError, match="assign=True would detach"):
        parent.load_state_dict({"sparse." + k: v for k, v in whole.state_dict().items()},
                               assign=True)


def test_checkpoints_cross_between_sharded_and_whole_tables(tmp_path):
    optimizer = (RowWiseAdagrad, {"lr": 0.1})
    sharded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=4,
                                     plan=plan(tables(), 2, sharding_type="table_wise"))
    whole = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=4)
    train(sharded, 3)
    train(whole, 3)
    sharded.save_checkpoint(tmp_path / "sharded.safetensors")
    loaded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=9)
    loaded.load_checkpoint(tmp_path / "sharded.safetensors")
    assert loaded.step == 3
    for name in ("t0", "t1"):
        assert torch.equal(loaded.optimizer_state(name), whole.optimizer_state(name))
    # Into sharded tables of another plan, and training goes on alike.
    whole.save_checkpoint(tmp_path / "whole.safetensors")
    other = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=9,
                                   plan=plan(tables(), 3, sharding_type="row_wise"))
    other.load_checkpoint(tmp_path / "whole.safetensors")
    assert other.step == 3
    for ours, theirs in zip(train(other, 2, first=90), train(whole, 2, first=90)):
        close(ours, theirs)


def test_bad_plans_and_combinations_are_refused(tmp_path):
    rowwise = (RowWiseAdagrad, {"lr": 0.1})
    with pytest.raises(ValueError, match="row-wise Adagrad|row_wise_adagrad|column"):
        plan(tables(), 2, sharding_type="column_wise", optimizer=rowwise)
    with pytest.raises(ValueError, match="sharding type"):
        plan(tables(), 2, sharding_type="diagonal")
    with pytest.raises(ValueError, match="0 devices: from 1 to 4096"):
        plan(tables(), 0)
    with pytest.raises(ValueError, match="10000 devices: from 1 to 4096"):
        EmbeddingBagCollection(tables(), optimizer=rowwise, shard_over=10_000)
    too_many = dict(plan(tables(), 2), num_devices=10**9)
    with pytest.raises(ValueError, match="1 to 4096 devices"):
        EmbeddingBagCollection(tables(), optimizer=rowwise, plan=too_many)
    on_disk = plan(tables(), 2)
    on_disk["tables"][0]["cache_rows"] = 16
    with pytest.raises(ValueError, match="puts table 't0' on the disk tier"):
        EmbeddingBagCollection(tables(), optimizer=rowwise, plan=on_disk)
    with pytest.raises(ValueError, match="shard_over.*or plan, not both"):
        EmbeddingBagCollection(tables(), shard_over=2, plan=plan(tables(), 2))
    # A plan made for other tables names what is wrong.
    other = [EmbeddingBagConfig(num_embeddings=50, embedding_dim=4, name="x",
                                feature_names=["f0"])]
    with pytest.raises(ValueError, match="'x'|'t0'|'t1'"):
        EmbeddingBagCollection(tables(), plan=plan(other, 2))
    with pytest.raises(ValueError, match="disk tier and sharding"):
        EmbeddingBagCollection(tables(), optimizer=rowwise, shard_over=2,
                               disk_dir=tmp_path, cache_rows=64)
    kv = [EmbeddingBagConfig(num_embeddings=64, embedding_dim=4, name="kv",
                             feature_names=["f"], kv={})]
    with pytest.raises(ValueError, match="'kv' is a key-value table"):
        EmbeddingBagCollection(kv, optimizer=rowwise, shard_over=2)
    ebc = EmbeddingBagCollection(tables(), optimizer=rowwise, shard_over=2)
    with pytest.raises(ValueError, match="sharded over 2 devices.*gathered"):
        ebc._collection.weight("t0")
    with pytest.raises(ValueError, match="the tables stay in Ember's memory"):
        ebc.half()
    untrained = EmbeddingBagCollection(tables(), shard_over=2)
    with torch.no_grad():
        untrained(batch(1))
    with pytest.raises(RuntimeError, match="not parameters, so pass optimizer= when building"):
        untrained(batch(1)).values().sum().backward()
    with pytest.raises(ValueError, match="not sharded"):
        EmbeddingBagCollection(tables())._collection.gathered()


def test_a_backward_updates_its_own_batchs_rows():
    # Two lookups before their backwards (two towers, positives and
    # negatives): the shards route each backward's ids again, so each
    # updates its own batch's rows, as whole tables do.
    optimizer = (torch.optim.Adagrad, {"lr": 0.1})
    whole = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=8)
    sharded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=8,
                                     plan=plan(tables(), 2, sharding_type="row_wise"))
    for ebc in (whole, sharded):
        first, second = ebc(batch(1)).values(), ebc(batch(2)).values()
        (first * 2).sum().backward()
        (second * 3).sum().backward()
        with torch.no_grad():
            ebc(batch(3))  # a lookup between does not move the next backward either
        ebc(batch(4)).values().sum().backward()
    for key, value in whole.state_dict().items():
        close(sharded.state_dict()[key], value)
    for name in ("t0", "t1"):
        close(sharded.optimizer_state(name), whole.optimizer_state(name))


def test_torchrecs_sharding_types_name_the_same_plans():
    from conftest import require

    types = require("torchrec.distributed.types")
    for ours in TYPES[:-1]:
        theirs = types.ShardingType(ours)
        assert plan(tables(), 2, sharding_type=theirs) == plan(tables(), 2, sharding_type=ours)


def test_staged_tables_refuse_a_parents_state_dict(tmp_path):
    # The refusal is in the hook torch calls for a child too, not only in
    # the module's own state_dict(): a model's state dict never drops them.
    parent = torch.nn.Module()
    parent.sparse = EmbeddingBagCollection(tables(), optimizer=(torch.optim.SGD, {"lr": 0.1}),
                                           disk_dir=tmp_path, cache_rows=64)
    with pytest.raises(ValueError, match="on the disk tier.*save_checkpoint"):
        parent.state_dict()
    with pytest.raises(ValueError, match="on the disk tier.*save_checkpoint"):
        parent.load_state_dict({})
