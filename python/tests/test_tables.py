"""Ember's tables from torch: outputs against a plain torch reference, the
fused update, zero-copy tensors, errors and the GIL."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import ember
from ember import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from ember.optim import RowWiseAdagrad, apply_optimizer_in_backward

from conftest import batch, tables


def reference_pooled(ebc, kjt, pooling):
    """torch's embedding_bag on the same rows: the plain reference."""
    lengths = torch.as_tensor(kjt.lengths())
    values = torch.as_tensor(kjt.values())
    weights = kjt.weights_or_none()
    size = kjt.stride()
    owner = {"f0": "t0", "f1": "t1", "f2": "t1"}
    out, start = [], 0
    for k, key in enumerate(kjt.keys()):
        ls = lengths[k * size:(k + 1) * size]
        n = int(ls.sum())
        ids = values[start:start + n]
        w = None if weights is None else weights[start:start + n]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), ls.cumsum(0)[:-1]])
        weight = ebc.embedding_bags[owner[key]].weight.detach()
        mode = "sum" if pooling == PoolingType.SUM else "mean"
        out.append(torch.nn.functional.embedding_bag(
            ids, weight, offsets, mode=mode, per_sample_weights=w))
        start += n
    return torch.cat(out, dim=1)


# torch's embedding_bag takes per-sample weights with sum pooling only.
@pytest.mark.parametrize("pooling,weighted", [(PoolingType.SUM, False), (PoolingType.SUM, True),
                                              (PoolingType.MEAN, False)])
def test_pooled_output_equals_torch_embedding_bag(pooling, weighted):
    ebc = EmbeddingBagCollection(tables(pooling), is_weighted=weighted, seed=3)
    kjt = batch(1, weighted=weighted)
    with torch.no_grad():
        kt = ebc(kjt)
    assert kt.keys() == ["f0", "f1", "f2"]
    assert kt.length_per_key() == [4, 8, 8]
    torch.testing.assert_close(kt.values(), reference_pooled(ebc, kjt, pooling))
    parts = kt.to_dict()
    torch.testing.assert_close(parts["f1"], kt["f1"])
    assert parts["f2"].shape == (16, 8)


def test_weights_are_pooled_by_weighted_collections_only():
    # TorchRec's is_weighted: an unweighted collection ignores a batch's
    # weights, a weighted one requires them.
    weighted = EmbeddingBagCollection(tables(), is_weighted=True, seed=3)
    plain = EmbeddingBagCollection(tables(), seed=3)
    kjt = batch(2, weighted=True)
    unweighted = KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths())
    with torch.no_grad():
        assert torch.equal(plain(kjt).values(), plain(unweighted).values())
        assert not torch.equal(weighted(kjt).values(), plain(kjt).values())
        with pytest.raises(ValueError, match="is_weighted=True.*no weights"):
            weighted(unweighted)


def test_frozen_and_inference_tables():
    ebc = EmbeddingBagCollection(tables(), optimizer=(torch.optim.SGD, {"lr": 0.1}))
    kjt = batch(3)
    ebc.embedding_bags["t0"].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"tables \['t0'\] are frozen"):
        ebc(kjt)
    ebc.requires_grad_(False)
    before = ebc.embedding_bags["t1"].weight.detach().clone()
    out = ebc(kjt).values()
    assert not out.requires_grad
    assert torch.equal(ebc.embedding_bags["t1"].weight, before)
    # Inference types: the rows as stored, bytes, no gradient.
    int8 = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name="q",
                               feature_names=["f"], data_type=ember.DataType.INT8)]
    quantized = EmbeddingBagCollection(int8)
    weight = quantized.embedding_bags["q"].weight
    assert weight.dtype == torch.uint8 and weight.shape == (10, 12) and not weight.requires_grad
    assert quantized(KeyedJaggedTensor(["f"], [1, 2], lengths=[2])).values().shape == (1, 8)
    half = [EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name="h",
                               feature_names=["f"], data_type=ember.DataType.BF16)]
    assert EmbeddingBagCollection(half).embedding_bags["h"].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,torch_dtype", [(ember.DataType.FP16, torch.float16),
                                               (ember.DataType.BF16, torch.bfloat16)])
def test_half_precision_tables_train(dtype, torch_dtype):
    # The rows are stored in half precision (updated with stochastic
    # rounding); outputs and gradients stay float32.
    config = EmbeddingBagConfig(num_embeddings=20, embedding_dim=8, name="h",
                                feature_names=["f"], data_type=dtype)
    ebc = EmbeddingBagCollection([config], optimizer=(torch.optim.SGD, {"lr": 0.5}), seed=4)
    weight = ebc.embedding_bags["h"].weight
    assert weight.dtype == torch_dtype
    before = weight.detach().float().clone()
    kjt = KeyedJaggedTensor(["f"], [3, 5], lengths=[1, 1])
    out = ebc(kjt).values()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, before[[3, 5]])
    out.sum().backward()
    after = weight.detach().float()
    # w -= 0.5 * 1 on the two rows looked up, to the type's precision.
    torch.testing.assert_close(after[[3, 5]], before[[3, 5]] - 0.5, atol=1e-2, rtol=0)
    assert torch.equal(after[0], before[0])


def test_optimizer_options_take_the_classes_defaults():
    from ember.optim import table_optimizer

    assert table_optimizer(torch.optim.SGD, {}) == {"type": "sgd", "lr": 1e-3}
    assert table_optimizer(torch.optim.Adagrad, {}) == {"type": "adagrad", "lr": 1e-2, "eps": 1e-10}
    assert table_optimizer(RowWiseAdagrad, {"lr": 0.5}) == {
        "type": "row_wise_adagrad", "lr": 0.5, "eps": 1e-10}
    assert table_optimizer(torch.optim.Adam, {"betas": (0.8, 0.9)}) == {
        "type": "adam", "lr": 1e-3, "beta1": 0.8, "beta2": 0.9, "eps": 1e-8}
    # torch's own defaults, given explicitly, are fine; anything else is refused.
    assert table_optimizer(torch.optim.Adam, {"fused": None, "amsgrad": False})["type"] == "adam"
    with pytest.raises(ValueError, match="unknown option eps"):
        table_optimizer(torch.optim.SGD, {"eps": 0.1})
    with pytest.raises(ValueError, match="momentum=0.9 is not offered"):
        table_optimizer(torch.optim.SGD, {"momentum": 0.9})
    with pytest.raises(ValueError, match="weight_decay=0.01 is not offered"):
        table_optimizer(torch.optim.AdamW, {})
    with pytest.raises(ValueError, match="unknown option momentun"):
        table_optimizer(torch.optim.SGD, {"momentun": 0.9})


def test_embers_checkpoints_save_and_load_tables_state_and_step(tmp_path):
    ebc = EmbeddingBagCollection(tables(), optimizer=(RowWiseAdagrad, {"lr": 0.1}), seed=1)
    for step in range(3):
        ebc(batch(step)).values().square().sum().backward()
    ebc.save_checkpoint(tmp_path / "tables.safetensors")
    fresh = EmbeddingBagCollection(tables(), optimizer=(RowWiseAdagrad, {"lr": 0.1}), seed=2)
    fresh.load_checkpoint(tmp_path / "tables.safetensors")
    for key, value in ebc.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    assert torch.equal(fresh.optimizer_state("t1"), ebc.optimizer_state("t1"))
    assert fresh.step == 3
    # Both go on the same way.
    for module in (ebc, fresh):
        module(batch(9)).values().square().sum().backward()
    assert torch.equal(fresh.embedding_bags["t1"].weight, ebc.embedding_bags["t1"].weight)
    with pytest.raises(OSError, match="nothing.safetensors"):
        fresh.load_checkpoint(tmp_path / "nothing.safetensors")
    other = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=7, embedding_dim=4,
                                                       name="t0", feature_names=["f0"])])
    with pytest.raises(ValueError, match="t0"):
        other.load_checkpoint(tmp_path / "tables.safetensors")


def test_conversions_that_would_copy_the_tables_are_refused():
    ebc = EmbeddingBagCollection(tables())
    ebc.to("cpu").float()  # no copies: fine
    with pytest.raises(ValueError, match="stays in Ember's memory"):
        ebc.half()
    with pytest.raises(ValueError, match="assign=True"):
        ebc.load_state_dict(ebc.state_dict(), assign=True)
    with pytest.raises(ValueError, match="shared memory"):
        ebc.share_memory()
    with pytest.raises(TypeError, match="got the string 'f0'"):
        KeyedJaggedTensor("f0", [1], lengths=[1])


def test_the_fused_update_bumps_torchs_version_counter():
    # A graph that saved a table's weight must not backward through rows
    # the fused update has changed since.
    ebc = EmbeddingBagCollection(tables(), optimizer=(torch.optim.SGD, {"lr": 0.1}))
    weight = ebc.embedding_bags["t0"].weight
    saved = (weight * weight).sum()
    ebc(batch(5)).values().sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.backward()


def test_inputs_from_lists_numpy_and_torch_agree():
    ebc = EmbeddingBagCollection(tables(), seed=1)
    keys, values, lengths = ["f0", "f1", "f2"], [1, 2, 3, 4, 5], [1, 0, 2, 1, 0, 1]
    offsets = [0, 1, 1, 3, 4, 4, 5]
    inputs = [
        KeyedJaggedTensor(keys, values, lengths=lengths),
        KeyedJaggedTensor(keys, np.array(values), lengths=np.array(lengths, dtype=np.int32)),
        KeyedJaggedTensor(keys, torch.tensor(values, dtype=torch.int32), offsets=torch.tensor(offsets)),
        KeyedJaggedTensor.from_offsets_sync(keys, torch.tensor(values), offsets),
    ]
    with torch.no_grad():
        outs = [ebc(kjt).values() for kjt in inputs]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert inputs[0].stride() == 2 and inputs[2].lengths() == lengths


def test_sgd_update_in_backward_equals_the_rule_by_hand():
    # One table, one id twice in the batch: the rows get one update with the
    # summed gradient (w -= lr * sum g), the others stay.
    config = EmbeddingBagConfig(num_embeddings=5, embedding_dim=2, name="t", feature_names=["f"])
    ebc = EmbeddingBagCollection([config], optimizer=(torch.optim.SGD, {"lr": 0.5}))
    before = ebc.embedding_bags["t"].weight.detach().clone()
    kjt = KeyedJaggedTensor(["f"], [3, 3, 1], lengths=[2, 1])
    out = ebc(kjt).values()
    (out * torch.tensor([[1.0, 2.0], [3.0, -1.0]])).sum().backward()
    after = ebc.embedding_bags["t"].weight.detach()
    expected = before.clone()
    expected[3] -= 0.5 * 2 * torch.tensor([1.0, 2.0])
    expected[1] -= 0.5 * torch.tensor([3.0, -1.0])
    torch.testing.assert_close(after, expected)
    assert ebc.embedding_bags["t"].weight.grad is None
    assert ebc.step == 1


def test_outputs_and_weights_cross_without_copies():
    ebc = EmbeddingBagCollection(tables(), seed=2)
    kjt = batch(0)
    native_out = ebc._collection.forward(kjt._native)
    assert torch.from_dlpack(native_out).data_ptr() == native_out.data_ptr()
    assert np.from_dlpack(native_out).ctypes.data == native_out.data_ptr()
    view = ebc._collection.weight("t0")
    state = ebc.state_dict()
    assert state["embedding_bags.t0.weight"].data_ptr() == view.data_ptr()
    # load_state_dict writes Ember's rows in place: the next lookup sees them.
    ones = {k: torch.ones_like(v) for k, v in state.items()}
    ebc.load_state_dict(ones)
    with torch.no_grad():
        out = ebc(KeyedJaggedTensor(["f0", "f1", "f2"], [7, 1, 2], lengths=[1, 1, 1]))
    assert torch.equal(out.values(), torch.ones(1, 20))


def test_optimizer_state_is_a_view_and_guards_replacement():
    ebc = EmbeddingBagCollection(tables(), optimizer=(RowWiseAdagrad, {"lr": 0.1}))
    state = ebc.optimizer_state("t1")
    assert state.shape == (80, 1) and float(state.sum()) == 0.0
    ebc(batch(4)).values().square().sum().backward()
    assert float(state.sum()) > 0.0  # the view sees the update
    with pytest.raises(RuntimeError, match="viewed by a live tensor"):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    del state
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    assert ebc.fused_optimizer == {"type": "sgd", "lr": 0.1}
    assert ebc.optimizer_state("t1") is None


def test_bad_inputs_raise_clear_exceptions():
    ebc = EmbeddingBagCollection(tables())
    with pytest.raises(ValueError, match="negative length -1 at position 1"):
        KeyedJaggedTensor(["f0"], [1], lengths=[2, -1])
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        KeyedJaggedTensor(["f0"], [1, 2], lengths=[3])
    with pytest.raises(ValueError, match="not monotonic"):
        KeyedJaggedTensor(["f0"], [1, 2], offsets=[0, 2, 1, 2])
    with pytest.raises(TypeError, match="values: expected int64 or int32 values, got float32"):
        KeyedJaggedTensor(["f0"], torch.tensor([1.0]), lengths=[1])
    with pytest.raises(ValueError, match="not contiguous"):
        KeyedJaggedTensor(["f0"], torch.arange(6)[::2], lengths=[3])
    with pytest.raises(ValueError, match="exactly one of lengths and offsets"):
        KeyedJaggedTensor(["f0"], [1])
    with pytest.raises(ValueError,
                       match=r"id 50 out of range for table .t0. \(50 rows\), feature .f0., sample 0"):
        ebc(KeyedJaggedTensor(["f0", "f1", "f2"], [50, 1, 1], lengths=[1, 1, 1]))
    with pytest.raises(ValueError, match="f2"):
        ebc(KeyedJaggedTensor(["f0", "f1"], [1, 1], lengths=[1, 1]))
    with pytest.raises(ValueError, match="num_embeddings must be a non-negative int"):
        EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=-1, embedding_dim=4, name="t")])
    with pytest.raises(ValueError, match="runs on the CPU"):
        EmbeddingBagCollection(tables(), device=torch.device("meta"))
    with pytest.raises(ValueError, match="momentum=0.9 is not offered"):
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match="cannot be fused"):
        apply_optimizer_in_backward(torch.optim.RMSprop, ebc.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="not in params"):
        apply_optimizer_in_backward(torch.optim.SGD, [ebc.embedding_bags["t0"].weight], {"lr": 0.1})
    with pytest.raises(ValueError, match="not a table of an Ember collection"):
        apply_optimizer_in_backward(torch.optim.SGD, [torch.nn.Parameter(torch.zeros(2))], {})
    # Without an optimizer, backward refuses rather than leaving the tables as they were.
    with pytest.raises(RuntimeError, match="no optimizer to apply in backward"):
        ebc(batch(0)).values().sum().backward()
    native = ebc._collection
    kjt = batch(0)
    with pytest.raises(ValueError, match=r"grad: shape \[16, 3\], but the output was \[16, 20\]"):
        native.backward(kjt._native, torch.zeros(16, 3))
    with pytest.raises(TypeError, match="grad: expected float32 values, got float64"):
        native.backward(kjt._native, torch.zeros(16, 20, dtype=torch.float64))
    with pytest.raises(KeyError, match="no table named 'nope'"):
        native.weight("nope")
    rows = ebc.embedding_bags["t1"].weight.detach()
    with pytest.raises(ValueError, match="grad: it lies in the rows of table 't1'"):
        native.backward(kjt._native, rows.view(-1)[: 16 * 20].view(16, 20))


def test_lookups_release_the_gil():
    # With a huge switch interval the interpreter never forces the GIL from
    # a running thread: the other thread runs only where a call releases it.
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=100_000, embedding_dim=64, name="t0",
                            feature_names=["f0"])], seed=0)
    g = torch.Generator().manual_seed(0)
    kjt = KeyedJaggedTensor(["f0"], torch.randint(0, 100_000, (40_000,), generator=g),
                            lengths=torch.full((2_000,), 20))
    ebc_grad = torch.zeros(2_000, 64)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.0})
    ticks, seen, done = [0], [], threading.Event()

    def other():
        while not done.is_set():
            ticks[0] += 1
            done.wait(0.0001)  # releases the GIL itself too

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=other)
        thread.start()
        start = ticks[0]
        for _ in range(10):
            ebc._collection.forward(kjt._native)
            seen.append(ticks[0] - start)
        start = ticks[0]
        for _ in range(10):
            ebc._collection.backward(kjt._native, ebc_grad)
            seen.append(ticks[0] - start)
        done.set()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert seen[9] > 0, "the other thread never ran during 10 lookups"
    assert seen[19] > 0, "the other thread never ran during 10 backwards"


def test_core_works_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ember\n"
        "from ember import _native, EmbeddingBagConfig, KeyedJaggedTensor\n"
        "from ember.configs import tables_json\n"
        "c = _native.Collection(tables_json([EmbeddingBagConfig(4, 2, 't', feature_names=['f'],"
        " weight_init_min=1.0, weight_init_max=1.0)]), '{\"type\": \"none\"}', 0)\n"
        "kjt = KeyedJaggedTensor(['f'], [1, 2, 3], lengths=[2, 1])\n"
        "print(c.forward(kjt._native).tolist())\n"
        "try:\n    ember.EmbeddingBagCollection\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "[[2.0, 2.0], [1.0, 1.0]]"
    assert "install torch" in lines[1]
    assert ember.__version__
    if os.environ.get("EMBER_REQUIRE_TORCHREC") == "1":
        # The suite of scripts/test-python tests the installed wheel.
        assert "site-packages" in ember.__file__, ember.__file__


@pytest.mark.parametrize("optimizer", [(torch.optim.SGD, {"lr": 0.5}),
                                       (RowWiseAdagrad, {"lr": 0.1})])
def test_tables_on_the_disk_tier_train_as_in_memory(tmp_path, optimizer):
    # Caches of 64 rows (4 sets of 16) for tables of 50 and 80, batches of
    # at most 16 of a table's ids: rows are evicted to the files and read
    # back, and every figure stays as in RAM.
    ram = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=6)
    disk = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=6,
                                  disk_dir=tmp_path, cache_rows=64)
    assert list(disk.parameters()) == []
    for step in range(30):
        kjt = batch(30 + step, size=4, max_len=2)
        ours, theirs = disk(kjt).values(), ram(kjt).values()
        assert torch.equal(ours, theirs)
        (ours * ours).sum().backward()
        (theirs * theirs).sum().backward()
    assert disk.step == ram.step == 30
    disk.save_checkpoint(tmp_path / "disk.safetensors")
    loaded = EmbeddingBagCollection(tables(), optimizer=optimizer, seed=7)
    loaded.load_checkpoint(tmp_path / "disk.safetensors")
    for key, value in ram.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    with pytest.raises(ValueError, match="on the disk tier.*save_checkpoint"):
        disk.state_dict()
    with pytest.raises(ValueError, match="disk_dir and cache_rows"):
        EmbeddingBagCollection(tables(), disk_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(disk(batch(1, size=4, max_len=2)).values(),
                           ram(batch(1, size=4, max_len=2)).values())


def test_key_value_tables_take_raw_ids(tmp_path):
    # Raw ids far beyond the rows; a table of 64 rows, fed 48 ids.
    config = [EmbeddingBagConfig(num_embeddings=64, embedding_dim=4, name="kv",
                                 feature_names=["f"], kv={})]
    optimizer = (RowWiseAdagrad, {"lr": 0.1})
    ebc = EmbeddingBagCollection(config, optimizer=optimizer, seed=1)
    assert list(ebc.parameters()) == []
    ids = [10**12 + 7 * i for i in range(48)]
    for step in range(4):
        kjt = KeyedJaggedTensor(["f"], ids[step * 12:(step + 1) * 12], lengths=[3] * 4)
        ebc(kjt).values().square().sum().backward()
    assert ebc.step == 4
    seen = KeyedJaggedTensor(["f"], ids[:4], lengths=[1] * 4)
    ebc.eval()
    with torch.no_grad():
        before = ebc(seen).values()
        # A new id in evaluation reads the zero fallback and is not admitted.
        new = KeyedJaggedTensor(["f"], [5], lengths=[1])
        assert torch.equal(ebc(new).values(), torch.zeros(1, 4))
    assert before.abs().sum() > 0
    ebc.save_checkpoint(tmp_path / "kv.safetensors")
    loaded = EmbeddingBagCollection(config, optimizer=optimizer, seed=2)
    loaded.load_checkpoint(tmp_path / "kv.safetensors")
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(seen).values(), before)
    with pytest.raises(ValueError, match="keyed by raw ids.*save_checkpoint"):
        ebc.state_dict()
