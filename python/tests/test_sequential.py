"""Ember's sequence models from Python: SASRec and HSTU trained by Ember's
Trainer on users' histories, evaluated on held-out items, checkpointed."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ember.data import ParquetLoader
from ember.train import DLRM, HSTURanking, HSTURetrieval, Histories, SASRec, Trainer

from test_train import tables as click_tables, write_clicks

ITEMS = 40


def cycles(users=240, length=16, seed=0):
    """Each user walks the items in steps of one from a start of its own:
    the next item is always the last one plus one (mod ITEMS), which a
    sequence model learns and chance (10 of 40 at HR@10) does not."""
    starts = [(7 * u + seed) % ITEMS for u in range(users)]
    items = [[(s + i) % ITEMS for i in range(length)] for s in starts]
    # Bit 0 set on even items, bit 1 on items below half: learnable actions.
    actions = [[(i % 2 == 0) | (i < ITEMS // 2) << 1 for i in row] for row in items]
    return Histories(items, actions=actions)


def test_sasrec_learns_the_next_item():
    train, valid, test = cycles().leave_out()
    assert len(train) == len(valid) == len(test) == 240
    assert test.items(0)[-1] == (valid.items(0)[-1] + 1) % ITEMS
    model = SASRec(ITEMS, maxlen=12, hidden_units=16, num_blocks=1, dropout_rate=0.0,
                   lr=5e-3, seed=1)
    before = model.evaluate(valid)
    events = []
    summary = Trainer(epochs=12, log_every=10).fit(
        model, model.loader(train, batch_size=32, shuffle_seed=2), on_event=events.append)
    assert summary["steps"] == 12 * 8
    assert summary["loss_last"] < summary["loss_first"]
    assert any(e["event"] == "step" for e in events)
    after = model.evaluate(test)
    assert set(after) >= {"hit_rate", "ndcg", "mrr", "users", "k"}
    assert after["users"] == 240 and after["k"] == 10
    assert before["hit_rate"] < 0.5 < after["hit_rate"], (before, after)
    sampled = model.evaluate(test, negatives=20, top_k=5)
    assert sampled["k"] == 5


def test_hstu_retrieval_and_ranking_train_and_evaluate(tmp_path):
    train, valid, test = cycles().leave_out()
    retrieval = HSTURetrieval(ITEMS, 12, embedding_dim=16, num_blocks=1, num_negatives=16,
                              dropout_rate=0.0, learning_rate=5e-3, seed=3)
    before = retrieval.evaluate(test)["hit_rate"]
    summary = Trainer(epochs=4).fit(retrieval, retrieval.loader(train, batch_size=32))
    assert summary["loss_last"] < summary["loss_first"]
    assert retrieval.evaluate(test)["hit_rate"] > before + 0.2

    train, valid, test = cycles().leave_out(held=4)
    ranking = HSTURanking(ITEMS, 12, embedding_dim=16, num_heads=2, attention_dim=8,
                          linear_dim=8, num_candidates=4, head_hidden=16, dropout_rate=0.0,
                          learning_rate=5e-3, seed=4)
    Trainer(epochs=6).fit(ranking, ranking.loader(train, batch_size=32, shuffle_seed=1))
    quality = ranking.evaluate(test)
    assert quality["candidates"] == 240 * 4
    assert [t["auc"] > 0.6 for t in quality["tasks"]] == [True, True], quality

    # A checkpoint carries the model: another one loaded from it scores alike.
    path = ranking.save(tmp_path)
    loaded = HSTURanking(ITEMS, 12, embedding_dim=16, num_heads=2, attention_dim=8,
                         linear_dim=8, num_candidates=4, head_hidden=16, seed=9)
    assert loaded.evaluate(test) != quality
    loaded.load(path)
    assert loaded.evaluate(test) == quality


def test_histories_read_the_ingested_format(tmp_path):
    # The user-history file `ember ingest sequences` writes, written here by
    # pyarrow: users, then item, timestamp and action lists.
    items = [[3, 1, 4, 1, 5], [9, 2, 6]]
    times = [[10, 11, 11, 15, 20], [1, 2, 3]]
    table = pa.table({"user": pa.array([7, 8], pa.int64()),
                      "items": pa.array(items, pa.list_(pa.int64())),
                      "timestamps": pa.array(times, pa.list_(pa.int64()))})
    pq.write_table(table, tmp_path / "histories.parquet")
    histories = Histories.read(str(tmp_path / "histories.parquet"))
    assert len(histories) == 2 and histories.num_items == 10
    assert histories.items(0) == items[0]
    with pytest.raises(OSError):
        Histories.read(str(tmp_path / "absent.parquet"))


def test_bad_histories_and_pairings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="user 1: items: item -3 is negative"):
        Histories([[1, 2], [-3]])
    with pytest.raises(ValueError, match="user 0: timestamps: 1 timestamps for 2 items"):
        Histories([[1, 2]], timestamps=[[5]])
    with pytest.raises(ValueError, match="user 0: timestamps: not in time order at item 1"):
        Histories([[1, 2]], timestamps=[[5, 4]])
    with pytest.raises(ValueError, match="user 0: actions: 1 actions for 2 items"):
        Histories([[1, 2]], actions=[[1]])
    with pytest.raises(IndexError, match="user 5: there are 1"):
        Histories([[1, 2]]).items(5)
    with pytest.raises(ValueError, match="timestamps: 2 users, but items has 1"):
        Histories([[1, 2]], timestamps=[[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="no user has 2 items"):
        SASRec(5, maxlen=4).loader(Histories([[1], [2]]))
    with pytest.raises(ValueError, match="loss 'hinge'"):
        SASRec(5, maxlen=4, loss="hinge")
    with pytest.raises(ValueError, match="negative_sampling 'nearby'"):
        HSTURetrieval(5, 4, negative_sampling="nearby")
    with pytest.raises(ValueError, match="negatives 'some'"):
        SASRec(5, maxlen=4).evaluate(cycles(), negatives="some")
    model = SASRec(ITEMS, maxlen=4)
    data = model.loader(cycles())
    clicks = ParquetLoader([write_clicks(tmp_path / "clicks", 256, 1)], 64,
                           tables=click_tables())
    with pytest.raises(ValueError, match="evaluated on held-out items by its own"):
        Trainer().fit(model, data, eval=clicks)
    with pytest.raises(TypeError, match="trains on its loader"):
        Trainer().fit(model, clicks)
    dlrm = DLRM(click_tables(), 13, [16, 8], [8, 1])
    with pytest.raises(TypeError, match="DLRM trains on an ember.data.ParquetLoader"):
        Trainer().fit(dlrm, data)
    with pytest.raises(TypeError, match="model: a DLRM or a sequence model"):
        Trainer().fit(object(), data)
