"""Ember's whole engine from Python: a DLRM trained by Ember's Trainer on
the Parquet loader, with evaluations, events, checkpoints and resumption."""

import math

import pytest
import torch

from ember import EmbeddingBagConfig
from ember.data import ParquetLoader
from ember.train import DLRM, Trainer

from conftest import require

pa = require("pyarrow")
pq = require("pyarrow.parquet")

NUM_CAT, ROWS = 4, 200


def tables():
    return [EmbeddingBagConfig(num_embeddings=ROWS, embedding_dim=8, name=f"t_cat_{j}",
                               feature_names=[f"cat_{j}"]) for j in range(NUM_CAT)]


def write_clicks(path, samples, seed):
    """Criteo-schema rows whose labels follow a hidden model of the ids."""
    g = torch.Generator().manual_seed(seed)
    effects = torch.randn(NUM_CAT, ROWS, generator=torch.Generator().manual_seed(99)) * 2
    ids = (torch.rand(NUM_CAT, samples, generator=g) ** 2 * ROWS).long()
    logit = sum(effects[j][ids[j]] for j in range(NUM_CAT)) / math.sqrt(NUM_CAT)
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g).to(torch.int8)
    columns = {"label": pa.array(labels.tolist(), pa.int8())}
    columns.update({f"int_{j}": pa.array([1] * samples, pa.int32()) for j in range(13)})
    columns.update({f"cat_{j}": pa.array(ids[j].tolist(), pa.int64()) for j in range(NUM_CAT)})
    path.mkdir()
    pq.write_table(pa.table(columns), path / "part-0.parquet", row_group_size=1024)
    return path


def model(seed=1):
    return DLRM(tables(), dense_in_features=13, dense_arch_layer_sizes=[16, 8],
                over_arch_layer_sizes=[16, 1], seed=seed,
                table_optimizer={"type": "row_wise_adagrad", "lr": 0.1, "eps": 1e-8},
                dense_optimizer=(torch.optim.Adagrad, {"lr": 0.05}))


def test_trainer_fits_a_dlrm_from_parquet(tmp_path):
    train = ParquetLoader([write_clicks(tmp_path / "train", 8192, 1)], 256, tables=tables(),
                          shuffle_seed=5)
    test = ParquetLoader([write_clicks(tmp_path / "test", 2048, 2)], 256, tables=tables())
    events = []
    dlrm = model()
    summary = Trainer(epochs=2, eval_every=16, checkpoint_dir=tmp_path / "ckpt").fit(
        dlrm, train, eval=test, on_event=events.append)
    assert summary["steps"] == 64 and summary["samples"] == 2 * 8192
    assert summary["eval"]["auc"] > 0.7, summary  # learned (0.5 is chance)
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 64 and all(math.isfinite(e["loss"]) for e in steps)
    # Durations arrive in seconds.
    times = steps[-1]["times"]
    assert times and all(isinstance(v, float) and 0 <= v < 60 for v in times.values()), times
    assert [e["steps"] for e in events if e["event"] == "eval"] == [16, 32, 48, 64]
    # The evaluation the Trainer made is the model's own on the same data.
    assert dlrm.evaluate(test)["auc"] == pytest.approx(summary["eval"]["auc"], abs=1e-9)
    # A checkpoint loads into a fresh model and predicts the same.
    dense, kjt, _ = next(iter(test))
    fresh = model(seed=2)
    fresh.load(summary["checkpoint"])
    assert torch.equal(fresh.predict(dense, kjt), dlrm.predict(dense, kjt))
    # Resuming a finished run takes no step.
    again = Trainer(epochs=2, checkpoint_dir=tmp_path / "ckpt").fit(model(), train, resume=True)
    assert again["resumed_at_step"] == 64 and again["steps"] == 64


def test_a_stopped_run_resumes_bitwise(tmp_path):
    train = ParquetLoader([write_clicks(tmp_path / "train", 4096, 1)], 256, tables=tables(),
                          shuffle_seed=5)
    whole = model()
    Trainer(epochs=2).fit(whole, train)
    stopped = model()
    first = Trainer(epochs=2, max_steps=11, checkpoint_dir=tmp_path / "ckpt").fit(stopped, train)
    assert first["steps"] == 11 and first["checkpoint"] is not None
    resumed = model(seed=9)  # its own weights are replaced by the checkpoint's
    rest = Trainer(epochs=2, checkpoint_dir=tmp_path / "ckpt").fit(resumed, train, resume=True)
    assert rest["resumed_at_step"] == 11 and rest["steps"] == 32
    dense, kjt, _ = next(iter(train))
    assert torch.equal(resumed.predict(dense, kjt), whole.predict(dense, kjt))


def test_schedules_resume_bitwise_and_must_be_given_again(tmp_path):
    # dlrm_s_pytorch's policy for the tables, DLRMv4's warmup and clipping
    # for the dense layers: recorded in the checkpoint.
    optimization = {
        "sparse_schedule": {"type": "policy", "warmup_steps": 4, "decay_start_step": 8,
                            "decay_steps": 10},
        "dense_schedule": {"type": "linear_warmup", "steps": 6},
        "max_grad_norm": 1.0,
    }
    train = ParquetLoader([write_clicks(tmp_path / "train", 4096, 1)], 256, tables=tables(),
                          shuffle_seed=5)
    whole = model()
    Trainer(epochs=2, optimization=optimization).fit(whole, train)
    plain = model()
    Trainer(epochs=2).fit(plain, train)
    dense, kjt, _ = next(iter(train))
    assert not torch.equal(plain.predict(dense, kjt), whole.predict(dense, kjt))
    first = Trainer(epochs=2, max_steps=11, checkpoint_dir=tmp_path / "ckpt",
                    optimization=optimization).fit(model(), train)
    assert first["steps"] == 11
    with pytest.raises(Exception, match="resume with the same schedules"):
        Trainer(epochs=2, checkpoint_dir=tmp_path / "ckpt").fit(model(), train, resume=True)
    resumed = model(seed=9)
    rest = Trainer(epochs=2, checkpoint_dir=tmp_path / "ckpt", optimization=optimization).fit(
        resumed, train, resume=True)
    assert rest["resumed_at_step"] == 11 and rest["steps"] == 32
    assert torch.equal(resumed.predict(dense, kjt), whole.predict(dense, kjt))
    with pytest.raises(ValueError, match="must finish before"):
        Trainer(optimization={"dense_schedule": {"type": "policy", "warmup_steps": 5,
                                                 "decay_start_step": 1, "decay_steps": 1}})


def test_training_releases_the_gil(tmp_path):
    # With a switch interval this long the interpreter never takes the GIL
    # from a running thread: the ticker runs only while a call releases it.
    import sys
    import threading

    train = ParquetLoader([write_clicks(tmp_path / "train", 8192, 1)], 256, tables=tables())
    ticks, seen, done = [0], [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks[0] += 1
            done.wait(0.0001)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=ticker)
        thread.start()
        start = ticks[0]
        batches = sum(1 for _ in train)
        seen.append(ticks[0] - start)
        start = ticks[0]
        Trainer(epochs=1).fit(model(), train)
        seen.append(ticks[0] - start)
        done.set()
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert batches == 32
    assert seen[0] > 0, "the ticker never ran while the loader made 32 batches"
    assert seen[1] > 0, "the ticker never ran during fit"


def test_errors_from_the_engine_are_python_exceptions(tmp_path):
    train = ParquetLoader([write_clicks(tmp_path / "train", 512, 1)], 256, tables=tables())
    with pytest.raises(ValueError, match="bottom MLP"):
        DLRM(tables(), 13, [16, 4], [16, 1])  # must end at the embedding dim, 8
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        Trainer().fit(DLRM(tables(), 13, [16, 8], [16, 1],
                           dense_optimizer={"Sgd": {"lr": 1e30}}), train)

    heard = []

    def broken(event):
        heard.append(event["event"])
        if event["event"] == "step":
            raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        Trainer(epochs=50).fit(model(), train, on_event=broken)
    # The run stopped within the batches its pipeline had taken, not after
    # its 100 steps, and the callback was not called again.
    assert heard.count("step") == 1, heard
    unlabelled = ParquetLoader([tmp_path / "train"], 256, tables=tables(), labels=False)
    with pytest.raises(ValueError, match="labels=False"):
        Trainer().fit(model(), unlabelled)
    with pytest.raises(ValueError, match="checkpoint_dir to resume from"):
        Trainer().fit(model(), train, resume=True)
    with pytest.raises(ValueError, match="shard_over 0"):
        DLRM(tables(), 13, [16, 8], [16, 1], shard_over=0)
    with pytest.raises(OSError, match="nothing.safetensors"):
        model().load(tmp_path / "nothing.safetensors")
