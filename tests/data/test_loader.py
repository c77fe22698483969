"""BatchLoader: packing invariants, targets, determinism, resume, process sharding, eval pass.

Synthetic documents make every token unique: document d's token at position p is d * 100 + p,
so any token in a batch says which document and position it came from.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from surogate_jax.data import BatchLoader, DataError, TokenizedDocs

PAD = 99999
KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")


def synthetic_docs(n_docs=37, max_len=30, seed=0) -> TokenizedDocs:
    rng = np.random.default_rng(seed)
    docs = []
    for d in range(n_docs):
        n = int(rng.integers(2, max_len + 1))
        docs.append((d * 100 + np.arange(n), rng.random(n) < 0.6))
    return TokenizedDocs.from_docs(docs, pad_id=PAD)


def supervised_targets(docs: TokenizedDocs) -> Counter:
    return Counter(docs.tokens[docs.loss_mask].tolist())


def take(loader, n):
    return [next(loader) for _ in range(n)]


def check_row_invariants(batch, docs: TokenizedDocs, T: int, packing: bool):
    """Every row: whole documents laid end to end from column 0, then padding."""
    lengths = docs.lengths
    for b in range(batch["input_ids"].shape[0]):
        ids, tgt, loss, pos, seg = (batch[k][b] for k in KEYS)
        assert ids.shape == (T,) and ids.dtype == np.int32 and loss.dtype == np.float32
        t, expect_seg = 0, 1
        while t < T and seg[t] != 0:
            d = int(ids[t]) // 100
            n = int(lengths[d])
            assert seg[t] == expect_seg and t + n <= T
            np.testing.assert_array_equal(ids[t:t + n], docs.doc(d)[0])  # the whole document, no straddling
            np.testing.assert_array_equal(pos[t:t + n], np.arange(n))  # positions restart per document
            assert (seg[t:t + n] == expect_seg).all()
            np.testing.assert_array_equal(tgt[t:t + n - 1], ids[t + 1:t + n])  # next token, same document
            np.testing.assert_array_equal(loss[t:t + n - 1], docs.doc(d)[1][1:])
            assert loss[t + n - 1] == 0 and tgt[t + n - 1] == PAD  # no target across documents
            t += n
            expect_seg += 1
        assert (seg[t:] == 0).all() and (ids[t:] == PAD).all() and (loss[t:] == 0).all() and (pos[t:] == 0).all()
        if not packing:
            assert expect_seg <= 2


def epoch_targets(batches) -> Counter:
    out: Counter = Counter()
    for batch in batches:
        out.update(batch["targets"][batch["loss_mask"] > 0].tolist())
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_one_epoch_sees_every_supervised_token_exactly_once(packing):
    docs, T = synthetic_docs(), 64
    loader = BatchLoader(docs, batch_size=3, sequence_len=T, packing=packing, seed=5)
    n = loader.batches_per_epoch()
    batches = take(loader, n)
    assert loader.epoch == 1
    for batch in batches:
        check_row_invariants(batch, docs, T, packing)
    assert epoch_targets(batches) == supervised_targets(docs)
    assert epoch_targets(take(loader, loader.batches_per_epoch())) == supervised_targets(docs)
    if not packing:
        assert n == -(-len(docs) // 3)


def test_packing_is_greedy_in_shuffled_order():
    docs, T = synthetic_docs(), 64
    loader = BatchLoader(docs, batch_size=1, sequence_len=T, packing=True, seed=1)
    rows = []
    for batch in take(loader, loader.batches_per_epoch()):
        seg, ids = batch["segment_ids"][0], batch["input_ids"][0]
        starts = np.flatnonzero(np.diff(seg, prepend=0) > 0)
        rows.append([int(ids[s]) // 100 for s in starts])
    order = [d for row in rows for d in row]
    assert sorted(order) == list(range(len(docs))) and order != sorted(order)  # shuffled, each once
    used = [int(docs.lengths[row].sum()) for row in rows]
    for r in range(len(rows) - 1):
        assert used[r] + docs.lengths[rows[r + 1][0]] > T  # a row closes only when the next doc does not fit
    assert np.mean(used) > 0.7 * T


def test_documents_longer_than_the_row_are_cut():
    docs = TokenizedDocs.from_docs([(np.arange(50), np.ones(50, bool)), (np.arange(3) + 100, np.ones(3, bool))])
    batch = next(BatchLoader(docs, batch_size=2, sequence_len=16, packing=True, seed=0, shuffle=False))
    assert batch["input_ids"][0].tolist() == list(range(16)) and batch["loss_mask"][0, :15].all()
    assert batch["loss_mask"][0, 15] == 0


def test_same_seed_same_batches_other_seed_other_batches():
    docs = synthetic_docs()
    def make(seed):
        return BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=seed)

    a, b, c = (take(make(s), 30) for s in (7, 7, 8))  # 30 batches: more than one epoch
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(a, c))


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("where", ["start", "mid_epoch", "last_batch_of_epoch", "next_epoch"])
def test_state_restore_continues_exactly(packing, where):
    docs = synthetic_docs()
    loader = BatchLoader(docs, batch_size=2, sequence_len=64, packing=packing, seed=3)
    n = loader.batches_per_epoch()
    skip = {"start": 0, "mid_epoch": n // 2, "last_batch_of_epoch": n - 1, "next_epoch": n + 2}[where]
    take(loader, skip)
    state = json.loads(json.dumps(loader.state()))  # must survive JSON
    expected = take(loader, n + 3)  # crosses an epoch boundary from every starting point
    resumed = BatchLoader(docs, batch_size=2, sequence_len=64, packing=packing, seed=3)
    resumed.restore(state)
    assert resumed.epoch == state["epoch"]
    for x, y in zip(expected, take(resumed, n + 3)):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert resumed.state() == loader.state()


def test_restore_refuses_a_different_dataset_or_settings():
    docs = synthetic_docs()
    state = BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=3).state()
    with pytest.raises(DataError, match="n_docs was 37 and is now 36"):
        BatchLoader(synthetic_docs(36), batch_size=2, sequence_len=64, packing=True, seed=3).restore(state)
    with pytest.raises(DataError, match="seed was 3 and is now 4"):
        BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=4).restore(state)


def test_two_processes_see_disjoint_rows_that_cover_everything():
    docs = synthetic_docs(n_docs=41)
    loaders = [BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=9, process_index=p, process_count=2)
               for p in range(2)]
    n = loaders[0].batches_per_epoch()
    assert loaders[1].batches_per_epoch() == n
    seen = []
    for _ in range(n):
        pair = [next(ld) for ld in loaders]
        rows = [set(map(int, b["input_ids"][b["segment_ids"] > 0])) for b in pair]
        assert not rows[0] & rows[1]
        seen += pair
        for b in pair:
            check_row_invariants(b, docs, 64, True)
    assert epoch_targets(seen) == supervised_targets(docs)
    # process p gets global rows p, p + 2, ...: the same rows a single process lays out
    single = BatchLoader(docs, batch_size=4, sequence_len=64, packing=True, seed=9)
    whole = next(single)["input_ids"]
    restart = [BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=9, process_index=p,
                           process_count=2) for p in range(2)]
    firsts = [next(ld)["input_ids"] for ld in restart]
    np.testing.assert_array_equal(whole[0::2], firsts[0])
    np.testing.assert_array_equal(whole[1::2], firsts[1])


def test_one_pass_is_every_document_in_order_and_leaves_training_alone():
    docs = synthetic_docs(n_docs=11)
    loader = BatchLoader(docs, batch_size=4, sequence_len=32, packing=False, seed=0)
    next(loader)
    before = loader.state()
    batches = list(loader.one_pass())
    assert len(batches) == 3 and loader.state() == before
    firsts = [int(b["input_ids"][r, 0]) // 100 for b in batches for r in range(4) if b["segment_ids"][r, 0] > 0]
    assert firsts == list(range(11))
    assert (batches[-1]["loss_mask"][3] == 0).all() and (batches[-1]["segment_ids"][3] == 0).all()
    assert epoch_targets(batches) == supervised_targets(docs)
    again = list(loader.one_pass())
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again))


def test_epoch_counter_and_empty_split():
    docs = synthetic_docs(n_docs=5)
    loader = BatchLoader(docs, batch_size=2, sequence_len=64, packing=False, seed=0)
    assert loader.batches_per_epoch() == 3 and loader.epoch == 0
    take(loader, 3)
    assert loader.epoch == 1 and loader.state()["row"] == 0
    with pytest.raises(DataError):
        BatchLoader(TokenizedDocs.from_docs([]), batch_size=1, sequence_len=8, packing=True, seed=0)


def test_one_pass_shards_across_processes():
    docs = synthetic_docs(n_docs=13)
    passes = [list(BatchLoader(docs, batch_size=2, sequence_len=64, packing=True, seed=0, process_index=p,
                               process_count=2).one_pass()) for p in range(2)]
    assert len(passes[0]) == len(passes[1])
    assert epoch_targets(passes[0] + passes[1]) == supervised_targets(docs)
