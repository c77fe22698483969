"""BatchLoader's cap on documents per packed row: `docs_per_row_cap` (the default: the fullest row of the first epoch
packed without a cap), `max_docs_per_row` / `max_segments` as bounds
on every row, the layout where the cap does not bind (plain greedy packing by length), state()/restore() of the cap,
and `segment_offsets` (the packed attention's view of a row) on real loader batches.

As in test_loader.py, document d's token at position p is d * 100 + p, so any token in a batch says which document
and position it came from.
"""

from __future__ import annotations

import json
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest

from surogate_jax.data import BatchLoader, DataError, TokenizedDocs
from surogate_jax.data.loader import docs_per_row_cap, pack_rows
from surogate_jax.ops.attention import segment_offsets

PAD = 10**9
KEYS = ("input_ids", "targets", "loss_mask", "positions", "segment_ids")
T = 64


def make_docs(lengths, seed=0) -> TokenizedDocs:
    rng = np.random.default_rng(seed)
    return TokenizedDocs.from_docs([(d * 100 + np.arange(n), rng.random(n) < 0.6) for d, n in enumerate(lengths)],
                                   pad_id=PAD)


def heavy_tailed_lengths(n=3000, p_long=0.12, seed=0):
    """Mostly 1-2 token documents, ~12% of 48-64 tokens: the long ones raise the mean length (so the cap is low) and
    runs of short ones in the shuffled order fill a row's document budget long before its tokens."""
    rng = np.random.default_rng(seed)
    return [int(rng.integers(T - 16, T + 1)) if rng.random() < p_long else int(rng.integers(1, 3)) for _ in range(n)]


def clustered_lengths():
    """12 long documents (64 and 54 tokens) then 150 one-token ones: in file order (shuffle=False) the cap must cut the
    run of short ones."""
    return [64 - (d % 2) * 10 for d in range(12)] + [1] * 150


def similar_lengths(n=61, seed=4):
    rng = np.random.default_rng(seed)
    return rng.integers(20, 31, n).tolist()


def exact_fit_lengths(n=61, seed=5):
    """16 or 32 tokens: rows that end exactly at T are common (a document that just fits must stay in the row)."""
    rng = np.random.default_rng(seed)
    return rng.choice([16, 32], n).tolist()


def take(loader, n):
    return [next(loader) for _ in range(n)]


def expected_rows(lengths, order, seq_len, cap=None):
    """Greedy packing, written independently of the loader: documents in `order` fill a row until the next does not
    fit in seq_len tokens (or, with `cap`, the row already holds cap documents)."""
    rows, cur, fill = [], [], 0
    for d in order:
        n = min(int(lengths[d]), seq_len)
        if cur and (fill + n > seq_len or (cap is not None and len(cur) == cap)):
            rows.append(cur)
            cur, fill = [], 0
        cur.append(int(d))
        fill += n
    rows.append(cur)
    return rows


def row_docs(batch, b):
    """Documents of row b, in order, from the tokens at each document start (position 0 inside a segment)."""
    ids, pos, seg = batch["input_ids"][b], batch["positions"][b], batch["segment_ids"][b]
    starts = np.flatnonzero((pos == 0) & (seg > 0))
    return [int(ids[s]) // 100 for s in starts]


def runs(row):
    """(start, length) of each contiguous run of equal ids, by a plain walk."""
    out, start = [], 0
    for t in range(1, len(row) + 1):
        if t == len(row) or row[t] != row[t - 1]:
            out.append((start, t - start))
            start = t
    return out


def epochs(loader, n_epochs):
    """The batches of each of the next n_epochs epochs."""
    out = []
    for _ in range(n_epochs):
        e = loader.epoch
        out.append(take(loader, loader.batches_per_epoch()))
        assert loader.epoch == e + 1
    return out


def rows_of(batches):
    """Document lists of all non-empty rows, in global row order (one process)."""
    return [r for batch in batches for b in range(batch["input_ids"].shape[0]) if (r := row_docs(batch, b))]


# --- docs_per_row_cap ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "seq_len", "cap"), [
    ([10] * 12, 64, 6),  # rows of 6 (60 tokens)
    ([64] * 5, 64, 1),
    ([1] * 200, 64, 64),  # rows of 64, 64, 64, 8
    ([30, 30, 5, 40, 20, 4], 64, 2),  # [30, 30] [5, 40] [20, 4]: each next one would overflow
    ([3] * 21 + [64], 64, 21),  # 63 tokens, then a full-row document
    ([], 64, 1),
])
def test_docs_per_row_cap(lengths, seq_len, cap):
    got = docs_per_row_cap(pack_rows(np.asarray(lengths, np.int64), seq_len, None))
    assert got == cap and isinstance(got, int)


@pytest.mark.parametrize("shuffle", [True, False])
def test_default_cap_is_the_fullest_row_of_the_first_epoch_which_packs_as_uncapped(shuffle):
    lengths = heavy_tailed_lengths()
    loader = BatchLoader(make_docs(lengths), batch_size=4, sequence_len=T, packing=True, seed=3, shuffle=shuffle)
    order = np.random.default_rng([3, 0]).permutation(len(lengths)) if shuffle else range(len(lengths))
    uncapped = expected_rows(lengths, order, T)
    assert loader.max_docs_per_row == max(map(len, uncapped)) and loader.max_segments == loader.max_docs_per_row + 1
    assert rows_of(take(loader, loader.batches_per_epoch())) == uncapped


def test_an_explicit_cap_must_be_a_positive_int():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="max_docs_per_row"):
            BatchLoader(make_docs([3, 4]), batch_size=1, sequence_len=T, packing=True, seed=0, max_docs_per_row=bad)


@pytest.mark.parametrize("lengths", [heavy_tailed_lengths(), similar_lengths(), [1] * 9, [200, 3]])
def test_without_packing_one_document_per_row(lengths):
    loader = BatchLoader(make_docs(lengths), batch_size=4, sequence_len=T, packing=False, seed=0)
    assert loader.max_docs_per_row == 1 and loader.max_segments == 2
    assert loader.state()["max_docs_per_row"] == 1


# --- the cap bounds every row ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "shuffle", "batch_size", "cap"), [
    (heavy_tailed_lengths(), True, 8, 32),
    (clustered_lengths(), False, 3, 52),
], ids=["shuffled_heavy_tail", "clustered_in_order"])
def test_every_row_respects_the_cap_and_every_document_comes_once_per_epoch(lengths, shuffle, batch_size, cap):
    docs = make_docs(lengths)
    loader = BatchLoader(docs, batch_size=batch_size, sequence_len=T, packing=True, seed=0, shuffle=shuffle,
                         max_docs_per_row=cap)
    assert loader.max_docs_per_row == cap and loader.max_segments == cap + 1
    short = [n for n in lengths if n <= 2]
    assert cap * np.mean(short) < T and len(short) > cap  # a row of short documents reaches the cap before T tokens
    supervised = Counter(docs.tokens[docs.loss_mask].tolist())
    for e, batches in enumerate(epochs(loader, 2)):
        binding = 0
        seen: Counter = Counter()
        targets: Counter = Counter()
        for batch in batches:
            targets.update(batch["targets"][batch["loss_mask"] > 0].tolist())
            for b in range(batch_size):
                seg, ids, pos = batch["segment_ids"][b], batch["input_ids"][b], batch["positions"][b]
                n_docs = len(set(seg[seg > 0].tolist()))
                n_runs = int((seg[1:] != seg[:-1]).sum()) + 1
                assert n_docs <= cap, (e, b, n_docs, cap)
                assert n_runs <= loader.max_segments, (e, b, n_runs, loader.max_segments)
                got = row_docs(batch, b)
                assert len(got) == n_docs
                seen.update(got)
                for t in np.flatnonzero((pos == 0) & (seg > 0)):  # each document whole, from its start
                    d = int(ids[t]) // 100
                    n = int(docs.lengths[d])
                    np.testing.assert_array_equal(ids[t:t + n], docs.doc(d)[0])
                    assert (seg[t:t + n] == seg[t]).all()
                if n_docs == cap and (seg == 0).any():
                    binding += 1  # closed by the cap with tokens to spare
                    assert n_runs == loader.max_segments
        assert seen == Counter(range(len(docs))), e  # every document exactly once per epoch
        assert targets == supervised, e
        assert binding >= 1, e  # the cap did bind in this epoch (else this test proves nothing about it)


def test_clustered_layout_is_greedy_with_the_cap():
    lengths = clustered_lengths()
    docs = make_docs(lengths)
    loader = BatchLoader(docs, batch_size=4, sequence_len=T, packing=True, seed=0, shuffle=False, max_docs_per_row=52)
    cap = loader.max_docs_per_row
    want = expected_rows(lengths, range(len(lengths)), T, cap)
    assert sum(len(r) == cap and sum(lengths[d] for d in r) < T for r in want) >= 2  # closed by the cap
    assert max(len(r) for r in expected_rows(lengths, range(len(lengths)), T)) > cap  # without the cap: more
    got = rows_of(take(loader, loader.batches_per_epoch()))
    assert got == want
    assert rows_of(list(loader.one_pass())) == want  # the eval pass lays rows out the same way


# --- where the cap does not bind: plain greedy packing ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("make_lengths", [similar_lengths, exact_fit_lengths])
def test_layout_without_binding_is_greedy_by_length(make_lengths, seed):
    lengths = make_lengths()
    docs = make_docs(lengths)
    B = 3
    loader = BatchLoader(docs, batch_size=B, sequence_len=T, packing=True, seed=seed, max_docs_per_row=12)
    cap = loader.max_docs_per_row
    assert cap * min(lengths) > T  # no row can reach the cap
    for epoch in range(2):
        order = np.random.default_rng([seed, epoch]).permutation(len(docs))
        want = expected_rows(lengths, order, T)
        assert max(map(len, want)) < cap
        assert loader.epoch == epoch and loader.batches_per_epoch() == -(-len(want) // B)
        batches = take(loader, loader.batches_per_epoch())
        # the segment ids the greedy layout implies, row by row (empty rows complete the last batch)
        seg_want = np.zeros((len(batches) * B, T), np.int32)
        for r, row in enumerate(want):
            t = 0
            for s, d in enumerate(row, start=1):
                seg_want[r, t:t + lengths[d]] = s
                t += lengths[d]
        np.testing.assert_array_equal(np.concatenate([b["segment_ids"] for b in batches]), seg_want)
        assert rows_of(batches) == want
    assert loader.epoch == 2


# --- state() / restore() ---------------------------------------------------------------------------------------------


def test_state_records_the_cap():
    lengths = heavy_tailed_lengths()
    loader = BatchLoader(make_docs(lengths), batch_size=4, sequence_len=T, packing=True, seed=1)
    state = json.loads(json.dumps(loader.state()))
    order = np.random.default_rng([1, 0]).permutation(len(lengths))
    want = docs_per_row_cap(pack_rows(np.asarray(lengths)[order], T, None))
    assert state["max_docs_per_row"] == loader.max_docs_per_row == want


def test_restore_refuses_a_different_cap():
    docs = make_docs(heavy_tailed_lengths())
    loader = BatchLoader(docs, batch_size=4, sequence_len=T, packing=True, seed=1)
    take(loader, 3)
    state = loader.state()
    before = loader.state()
    bad = dict(state, max_docs_per_row=state["max_docs_per_row"] + 1)
    other = BatchLoader(docs, batch_size=4, sequence_len=T, packing=True, seed=1)
    cap = state["max_docs_per_row"]
    with pytest.raises(DataError, match=rf"max_docs_per_row was {cap + 1} and is now {cap}"):
        other.restore(bad)
    assert other.state()["row"] == 0 and other.epoch == 0  # a refused restore leaves the position alone
    assert loader.state() == before


def test_restore_refuses_documents_whose_cut_lengths_give_another_cap():
    # same n_docs, n_tokens, seed, sequence_len: only the lengths cut to T (so the cap) differ
    a = BatchLoader(make_docs([200, 2, 2]), batch_size=1, sequence_len=T, packing=True, seed=0, shuffle=False)
    b = BatchLoader(make_docs([68, 68, 68]), batch_size=1, sequence_len=T, packing=True, seed=0, shuffle=False)
    assert (a.state()["n_docs"], a.state()["n_tokens"]) == (b.state()["n_docs"], b.state()["n_tokens"])
    assert (a.max_docs_per_row, b.max_docs_per_row) == (2, 1)  # rows [64] [2, 2] and [64] [64] [64]
    with pytest.raises(DataError, match="max_docs_per_row was 2 and is now 1"):
        b.restore(a.state())


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("skip", [0, 5, "last_of_epoch"])
def test_restore_accepts_a_state_from_before_the_cap(packing, skip):
    docs = make_docs(clustered_lengths())
    def make():
        return BatchLoader(docs, batch_size=3, sequence_len=T, packing=packing, seed=2)

    loader = make()
    n = loader.batches_per_epoch()
    take(loader, n - 1 if skip == "last_of_epoch" else skip)
    state = json.loads(json.dumps(loader.state()))
    del state["max_docs_per_row"]  # what a checkpoint written before the cap holds
    expected = take(loader, n + 3)  # crosses an epoch boundary
    resumed = make()
    resumed.restore(state)
    for x, y in zip(expected, take(resumed, n + 3), strict=True):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert resumed.state() == loader.state() and "max_docs_per_row" in resumed.state()


# --- segment_offsets on real batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("lengths", "shuffle", "cap"), [(clustered_lengths(), False, 52),
                                                         (heavy_tailed_lengths(), True, None)],
                         ids=["clustered_in_order", "shuffled_heavy_tail"])
def test_segment_offsets_of_loader_batches_cover_every_token(lengths, shuffle, cap):
    loader = BatchLoader(make_docs(lengths), batch_size=8, sequence_len=T, packing=True, seed=0, shuffle=shuffle,
                         max_docs_per_row=cap)
    M = loader.max_segments
    checked_full = 0
    for batch in take(loader, loader.batches_per_epoch()):
        seg = batch["segment_ids"]
        n_runs = [len(runs(seg[b].tolist())) for b in range(seg.shape[0])]
        if max(n_runs) < M:
            continue  # keep it quick: only batches holding a row that uses every segment slot
        checked_full += 1
        lengths_BM, offsets_BM1 = (np.asarray(x) for x in segment_offsets(jnp.asarray(seg), M))
        assert lengths_BM.shape == (seg.shape[0], M) and offsets_BM1.shape == (seg.shape[0], M + 1)
        for b in range(seg.shape[0]):
            want = runs(seg[b].tolist())
            k = len(want)
            assert k <= M
            assert lengths_BM[b].clip(0).sum() == T  # no segment dropped
            np.testing.assert_array_equal(lengths_BM[b, :k], [n for _, n in want])
            np.testing.assert_array_equal(offsets_BM1[b, :k], [s for s, _ in want])
            assert (lengths_BM[b, k:] == -1).all() and (offsets_BM1[b, k:] == -1).all()
        # one slot fewer than the loader's bound would drop the last segment of the full row(s)
        short = np.asarray(segment_offsets(jnp.asarray(seg), M - 1)[0]).clip(0).sum(1)
        assert (short[np.array(n_runs) == M] < T).all()
    assert checked_full >= 1
