"""Unpooled lookups from torch (TorchRec's EmbeddingCollection): every id's
row in place, against TorchRec's own module, trained side by side."""

import pytest
import torch

import ember
import ember.optim
from ember import EmbeddingConfig, KeyedJaggedTensor

from conftest import require

KEYS = ["history", "candidate", "user"]


def tables():
    # An item table read by the history and the candidate; a user table.
    return [
        EmbeddingConfig(num_embeddings=50, embedding_dim=4, name="t_items",
                        feature_names=["history", "candidate"]),
        EmbeddingConfig(num_embeddings=30, embedding_dim=4, name="t_users", feature_names=["user"]),
    ]


def batch(seed, size=8):
    g = torch.Generator().manual_seed(seed)
    history = torch.randint(0, 6, (size,), generator=g)  # empty histories included
    lengths = torch.cat([history, torch.ones(2 * size, dtype=torch.int64)])
    rows = [50] * int(history.sum()) + [50] * size + [30] * size
    values = torch.tensor([int(torch.randint(0, r, (1,), generator=g)) for r in rows])
    return KeyedJaggedTensor(KEYS, values, lengths=lengths)


def test_rows_in_place_and_their_update():
    ec = ember.EmbeddingCollection(tables(), optimizer=(torch.optim.SGD, {"lr": 0.5}), seed=3)
    kjt = KeyedJaggedTensor(KEYS, [3, 5, 3, 9, 5, 1, 7, 8], lengths=[3, 1, 1, 1, 1, 1])
    items = ec.embeddings["t_items"].weight.detach().clone()
    users = ec.embeddings["t_users"].weight.detach().clone()
    out = ec(kjt)
    assert list(out) == KEYS
    history = out["history"]
    assert history.lengths().tolist() == [3, 1] and history.offsets().tolist() == [0, 3, 4]
    assert torch.equal(history.values(), items[[3, 5, 3, 9]])
    assert torch.equal(out["user"].values(), users[[7, 8]])
    assert [t.shape[0] for t in history.to_dense()] == [3, 1]
    # Id 3's two rows in the history and id 5's in the history and the
    # candidate: one update each with the summed gradient.
    loss = history.values().sum() + out["candidate"].values().sum()
    loss.backward()
    after = ec.embeddings["t_items"].weight.detach()
    torch.testing.assert_close(after[3], items[3] - 0.5 * 2)
    torch.testing.assert_close(after[5], items[5] - 0.5 * 2)
    torch.testing.assert_close(after[1], items[1] - 0.5)
    assert torch.equal(ec.embeddings["t_users"].weight, users)  # no gradient reached them
    assert ec.step == 1 and list(ec.state_dict()) == ["embeddings.t_items.weight",
                                                      "embeddings.t_users.weight"]


def test_outputs_follow_the_tables_not_the_batch_and_match_without_grad():
    ec = ember.EmbeddingCollection(tables(), optimizer=(torch.optim.SGD, {"lr": 0.1}))
    # The batch's keys in another order, and one no table reads.
    kjt = KeyedJaggedTensor(["user", "other", "candidate", "history"], [7, 99, 5, 3, 9],
                            lengths=[1, 1, 1, 2])
    trained = ec(kjt)
    with torch.no_grad():
        inference = ec(kjt)
    assert list(trained) == list(inference) == KEYS
    for key in KEYS:
        assert torch.equal(trained[key].values(), inference[key].values())
        assert torch.equal(trained[key].offsets(), inference[key].offsets())
    assert trained["history"].lengths().tolist() == [2]
    assert not inference["history"].values().requires_grad
    assert trained["history"].values().requires_grad


def test_jagged_tensor_takes_torchrecs_arguments():
    from ember import JaggedTensor

    values = torch.arange(12.0).view(6, 2)
    jt = JaggedTensor(values, None, torch.tensor([2, 0, 4]))
    assert jt.offsets().tolist() == [0, 2, 2, 6] and jt.weights_or_none() is None
    both = JaggedTensor(values, lengths=[2, 0, 4], offsets=[0, 2, 2, 6])
    assert torch.equal(both.lengths(), jt.lengths())
    with pytest.raises(ValueError, match="disagree"):
        JaggedTensor(values, lengths=[2, 4], offsets=[0, 1, 6])


def test_embers_checkpoints(tmp_path):
    ec = ember.EmbeddingCollection(tables(), optimizer=(torch.optim.Adagrad, {"lr": 0.1}))
    ec(batch(1))["history"].values().sum().backward()
    ec.save_checkpoint(tmp_path / "ec.safetensors")
    fresh = ember.EmbeddingCollection(tables(), optimizer=(torch.optim.Adagrad, {"lr": 0.1}),
                                      seed=5)
    fresh.load_checkpoint(tmp_path / "ec.safetensors")
    for key, value in ec.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    assert torch.equal(fresh.optimizer_state("t_items"), ec.optimizer_state("t_items"))
    assert fresh.step == 1


def test_errors():
    with pytest.raises(ValueError, match="share one dim"):
        ember.EmbeddingCollection([EmbeddingConfig(10, 4, "a", feature_names=["x"]),
                                   EmbeddingConfig(10, 8, "b", feature_names=["y"])])
    ec = ember.EmbeddingCollection(tables())
    with pytest.raises(ValueError, match="user"):
        ec(KeyedJaggedTensor(["history", "candidate"], [1, 2], lengths=[1, 1]))
    with pytest.raises(RuntimeError, match="no optimizer to apply in backward"):
        ec(batch(0))["user"].values().sum().backward()
    kjt = batch(0)
    rows = int(kjt.lengths().sum())
    with pytest.raises(ValueError, match=r"grad: shape \[4, \d+\], but the rows are \[rows, 4\]"):
        ec._collection.backward(kjt._native, torch.zeros(4, rows))


OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_steps_equal_torchrecs_embedding_collection(name):
    torchrec = require("torchrec")
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    classes = {"sgd": (torch.optim.SGD, torch.optim.SGD),
               "adagrad": (torch.optim.Adagrad, torch.optim.Adagrad),
               "rowwise_adagrad": (RowWiseAdagrad, ember.optim.RowWiseAdagrad)}[name]
    kwargs = {"lr": 0.1} if name == "sgd" else {"lr": 0.1, "eps": 1e-8}
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingCollection(
        tables=[torchrec.EmbeddingConfig(num_embeddings=c.num_embeddings,
                                         embedding_dim=c.embedding_dim, name=c.name,
                                         feature_names=c.feature_names) for c in tables()],
        device=torch.device("cpu"))
    ours = ember.EmbeddingCollection(tables(), seed=1)
    ours.load_state_dict(theirs.state_dict())
    apply_optimizer_in_backward(classes[0], theirs.parameters(), kwargs)
    ember.optim.apply_optimizer_in_backward(classes[1], ours.parameters(), kwargs)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        kjt = batch(10 + step)
        their_kjt = torchrec.KeyedJaggedTensor(keys=KEYS, values=kjt.values(),
                                               lengths=kjt.lengths())
        their_out, our_out = theirs(their_kjt), ours(kjt)
        loss_theirs = loss_ours = 0
        for key in KEYS:
            t, o = their_out[key], our_out[key]
            assert torch.equal(o.lengths(), t.lengths())
            torch.testing.assert_close(o.values(), t.values())
            scale = torch.randn(t.values().shape, generator=g)
            loss_theirs = loss_theirs + (t.values() * scale).square().sum()
            loss_ours = loss_ours + (o.values() * scale).square().sum()
        loss_theirs.backward()
        loss_ours.backward()
    for key, weight in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], weight, rtol=1e-5, atol=1e-6)
    if name != "sgd":
        for config in tables():
            param = theirs.embeddings[config.name].weight
            their_state = param._in_backward_optimizers[0].state[param]["sum"]
            our_state = ours.optimizer_state(config.name)
            torch.testing.assert_close(our_state, their_state.reshape(our_state.shape),
                                       rtol=1e-5, atol=1e-7)


def test_sequence_tables_on_the_disk_tier_train_as_in_memory(tmp_path):
    # Caches of 32 rows (2 sets of 16) for tables of 50 and 30 rows,
    # batches of at most 16 of a table's ids.
    optimizer = (torch.optim.Adagrad, {"lr": 0.1})
    ram = ember.EmbeddingCollection(tables(), optimizer=optimizer, seed=2)
    disk = ember.EmbeddingCollection(tables(), optimizer=optimizer, seed=2,
                                     disk_dir=tmp_path, cache_rows=32)
    for step in range(30):
        kjt = batch(40 + step, size=2)
        ours, theirs = disk(kjt), ram(kjt)
        loss_ours = loss_theirs = 0
        for key in KEYS:
            assert torch.equal(ours[key].values(), theirs[key].values())
            loss_ours = loss_ours + ours[key].values().square().sum()
            loss_theirs = loss_theirs + theirs[key].values().square().sum()
        loss_ours.backward()
        loss_theirs.backward()
    disk.save_checkpoint(tmp_path / "disk.safetensors")
    loaded = ember.EmbeddingCollection(tables(), optimizer=optimizer, seed=3)
    loaded.load_checkpoint(tmp_path / "disk.safetensors")
    for key, value in ram.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
