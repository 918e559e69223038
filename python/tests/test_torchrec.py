"""Against TorchRec itself (the peer these names come from): the same tables,
inputs and optimizer give the same pooled outputs, dense gradients, updated
rows and optimizer state; state dicts load both ways."""

import copy

import pytest
import torch

import ember
import ember.optim
from ember import PoolingType

from conftest import batch, require, tables

torchrec = require("torchrec")
from torchrec.optim.apply_optimizer_in_backward import (  # noqa: E402
    apply_optimizer_in_backward as torchrec_apply,
)
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad as TorchRecRowWiseAdagrad  # noqa: E402

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "rowwise_adagrad": (TorchRecRowWiseAdagrad, ember.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
}


def torchrec_tables(pooling):
    pooling = getattr(torchrec.PoolingType, pooling.name)
    return [
        torchrec.EmbeddingBagConfig(num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                    name=c.name, feature_names=c.feature_names, pooling=pooling)
        for c in tables()
    ]


def torchrec_kjt(kjt):
    return torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(),
                                      lengths=kjt.lengths(), weights=kjt.weights_or_none())


def in_backward_state(param):
    """The state TorchRec's in-backward optimizer keeps for a table's weight."""
    optimizer = param._in_backward_optimizers[0]
    return optimizer.state[param]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("pooling,weighted", [(PoolingType.SUM, False), (PoolingType.SUM, True),
                                              (PoolingType.MEAN, False)])
def test_training_steps_equal_torchrec(name, pooling, weighted):
    torchrec_class, ember_class, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=torchrec_tables(pooling), is_weighted=weighted,
                                             device=torch.device("cpu"))
    ours = ember.EmbeddingBagCollection(tables(pooling), is_weighted=weighted, seed=5)
    ours.load_state_dict(theirs.state_dict())  # TorchRec -> Ember
    torchrec_apply(torchrec_class, theirs.parameters(), kwargs)
    ember.optim.apply_optimizer_in_backward(ember_class, ours.parameters(), kwargs)
    dense_theirs = torch.nn.Linear(20, 1)
    dense_ours = copy.deepcopy(dense_theirs)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step in range(6):
        kjt = batch(100 + step, weighted=weighted)
        labels = (torch.arange(kjt.stride()) % 3 == 0).float().unsqueeze(1)
        pooled_theirs = theirs(torchrec_kjt(kjt)).values()
        pooled_ours = ours(kjt).values()
        torch.testing.assert_close(pooled_ours, pooled_theirs, rtol=1e-5, atol=1e-6)
        loss_theirs = loss_fn(dense_theirs(pooled_theirs), labels)
        loss_ours = loss_fn(dense_ours(pooled_ours), labels)
        loss_theirs.backward()
        loss_ours.backward()
        torch.testing.assert_close(dense_ours.weight.grad, dense_theirs.weight.grad,
                                   rtol=1e-5, atol=1e-6)
        dense_theirs.zero_grad()
        dense_ours.zero_grad()
    for key, weight in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], weight, rtol=1e-5, atol=1e-6)
    assert ours.step == 6
    if name != "sgd":
        for config in tables():
            param = theirs.embedding_bags[config.name].weight
            their_state = in_backward_state(param)["sum"]
            our_state = ours.optimizer_state(config.name)
            torch.testing.assert_close(our_state, their_state.reshape(our_state.shape),
                                       rtol=1e-5, atol=1e-7)
    # Ember -> TorchRec: a fresh TorchRec module takes Ember's state dict.
    fresh = torchrec.EmbeddingBagCollection(tables=torchrec_tables(pooling), is_weighted=weighted,
                                            device=torch.device("cpu"))
    fresh.load_state_dict(ours.state_dict())
    kjt = batch(7, weighted=weighted)
    with torch.no_grad():
        torch.testing.assert_close(ours(kjt).values(), fresh(torchrec_kjt(kjt)).values(),
                                   rtol=1e-5, atol=1e-6)


def test_torchrecs_optimizer_classes_are_taken_by_name():
    import torchrec.optim as torchrec_optim
    from ember.optim import table_optimizer

    assert table_optimizer(torchrec_optim.SGD, {"lr": 0.1}) == {"type": "sgd", "lr": 0.1}
    assert table_optimizer(torchrec_optim.Adagrad, {"lr": 0.1})["type"] == "adagrad"
    assert table_optimizer(TorchRecRowWiseAdagrad, {})["eps"] == 1e-10
    assert table_optimizer(torchrec_optim.Adam, {"lr": 0.1})["type"] == "adam"


def test_state_dict_names_are_torchrecs():
    theirs = torchrec.EmbeddingBagCollection(tables=torchrec_tables(PoolingType.SUM),
                                             device=torch.device("cpu"))
    ours = ember.EmbeddingBagCollection(tables())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for key, value in theirs.state_dict().items():
        assert ours.state_dict()[key].shape == value.shape
        assert ours.state_dict()[key].dtype == value.dtype
