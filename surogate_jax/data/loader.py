"""`BatchLoader`: TokenizedDocs -> endless, deterministic, resumable [B, T] training batches.

Each epoch shuffles the documents (numpy Generator seeded from (seed, epoch)) and lays them out
in rows of T tokens. With packing, documents fill rows greedily in that order and never straddle
rows: a document that does not fit closes the row (padded) and starts the next, and so does the
document past `max_docs_per_row`, so `max_segments` (that cap plus a padding run) bounds the segments of
every row: the model's packed attention needs a static bound (surogate_jax/ops/attention.py), and its cost
grows with it. The cap is by default the most documents any row of the first epoch holds when packed
without one (`docs_per_row_cap`): the first epoch packs exactly as uncapped, later ones rarely close a row
early. `positions` restart at 0 and `segment_ids` count 1, 2, ... per
document in a row (0 = padding). Without
packing, one document per row. Documents longer than T (tokenized with a larger sequence_len) are
cut to T here too.

A batch: input_ids [B, T] int32 (padding = docs.pad_id); targets [B, T] int32: the next token of
the same document (pad_id where there is none); loss_mask [B, T] float32: 1 where that target is
supervised, so the last token of each document, padding and cross-document positions are 0;
positions, segment_ids [B, T] int32.

Multi-process: global row i goes to process i % process_count; a step consumes
batch_size x process_count global rows, so every process serves the same number of batches. The
last batch of an epoch is completed with empty rows (loss 0), so every document is seen exactly
once per epoch and the next epoch starts with a fresh shuffle. The position is (epoch, next global
row): state()/restore() round-trip it exactly, and batch_size/process_count may change across a
restore (the layout of rows depends only on seed, epoch and the documents).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .docs import DataError, TokenizedDocs

STATE_VERSION = 1


def pack_rows(lengths: np.ndarray, sequence_len: int, cap: int | None) -> np.ndarray:
    """Row pointers of greedy packing: documents of `lengths` (<= sequence_len each), in this order, fill a row
    until the next does not fit or the row holds `cap` documents; row r holds documents ptr[r]:ptr[r + 1]."""
    cap = len(lengths) + 1 if cap is None else cap
    ptr = [0]
    fill = 0
    for i, n in enumerate(np.asarray(lengths).tolist()):
        if fill + n > sequence_len or i - ptr[-1] == cap:
            ptr.append(i)
            fill = 0
        fill += n
    ptr.append(len(lengths))
    return np.asarray(ptr, np.int64)


def docs_per_row_cap(ptr: np.ndarray) -> int:
    """The most documents any row of a layout (`pack_rows`' row pointers) holds; at least 1."""
    return int(np.diff(ptr).max(initial=1))


class BatchLoader:
    def __init__(self, docs: TokenizedDocs, *, batch_size: int, sequence_len: int, packing: bool, seed: int,
                 shuffle: bool = True, process_index: int = 0, process_count: int = 1,
                 max_docs_per_row: int | None = None):
        if len(docs) == 0:
            raise DataError("the split has no documents to load")
        if batch_size < 1 or sequence_len < 2:
            raise ValueError(f"batch_size={batch_size} must be >= 1 and sequence_len={sequence_len} >= 2")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        if max_docs_per_row is not None and (isinstance(max_docs_per_row, bool) or not isinstance(max_docs_per_row, int)
                                             or max_docs_per_row < 1):
            raise ValueError(f"max_docs_per_row={max_docs_per_row!r}: a positive int, or None (from the data)")
        self.docs = docs
        self.batch_size = batch_size
        self.sequence_len = sequence_len
        self.packing = packing
        self.seed = int(seed)
        self.shuffle = shuffle
        self.process_index = process_index
        self.process_count = process_count
        self._lengths = np.minimum(docs.lengths, sequence_len)
        self._epoch = 0
        self._row = 0  # next global row of the current epoch
        self._layout_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        if not packing:
            self.max_docs_per_row = 1
        elif max_docs_per_row is None:  # the first epoch packed uncapped: its layout is also the capped one
            order = self._order(0)
            ptr = pack_rows(self._lengths[order], sequence_len, None)
            self.max_docs_per_row = docs_per_row_cap(ptr)
            self._layout_cache = (0, order, ptr)
        else:
            self.max_docs_per_row = max_docs_per_row

    @property
    def max_segments(self) -> int:
        """Bound on the segments of any row: its documents and a trailing padding run."""
        return self.max_docs_per_row + 1

    # --- position ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (advances right after an epoch's last batch)."""
        return self._epoch

    def batches_per_epoch(self, epoch: int | None = None) -> int:
        """Batches in `epoch` (default: the current one). With packing the count can differ by a
        little between epochs, since how documents pack depends on their shuffled order."""
        _, ptr = self._layout(self._epoch if epoch is None else epoch)
        return -(-(len(ptr) - 1) // self._rows_per_step)

    def state(self) -> dict:
        """JSON-serializable position; also records what must match on restore."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "row": self._row,
                "index": self._row // self._rows_per_step, "seed": self.seed, "shuffle": self.shuffle,
                "packing": self.packing, "sequence_len": self.sequence_len, "n_docs": len(self.docs),
                "n_tokens": int(len(self.docs.tokens)), "batch_size": self.batch_size,
                "process_count": self.process_count, "max_docs_per_row": self.max_docs_per_row}

    def restore(self, state: dict) -> None:
        """Continue exactly where `state` was taken (on any process of the same run)."""
        if state.get("version") != STATE_VERSION:
            raise DataError(f"data loader state version {state.get('version')!r} is not {STATE_VERSION}")
        mine = self.state()
        for key in ("seed", "shuffle", "packing", "sequence_len", "n_docs", "n_tokens", "max_docs_per_row"):
            if key == "max_docs_per_row" and key not in state:
                continue  # a state from before the cap: its layout had none (equal unless a row held more)
            if state.get(key) != mine[key]:
                raise DataError(f"cannot resume the data position: {key} was {state.get(key)!r} and is now "
                                f"{mine[key]!r} (the dataset or data settings changed since the checkpoint)")
        self._epoch, self._row = int(state["epoch"]), int(state["row"])
        if self._row >= len(self._layout(self._epoch)[1]) - 1:
            self._epoch, self._row = self._epoch + 1, 0

    # --- iteration -----------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        order, ptr = self._layout(self._epoch)
        batch = self._assemble(order, ptr, self._row)
        self._row += self._rows_per_step
        if self._row >= len(ptr) - 1:
            self._epoch, self._row = self._epoch + 1, 0
        return batch

    def one_pass(self) -> Iterator[dict[str, np.ndarray]]:
        """Every document once, in order, unshuffled (for eval); the last batch is padded with
        empty rows (loss_mask 0). Does not move the training position."""
        order = np.arange(len(self.docs))
        ptr = self._rows(order)
        for start in range(0, len(ptr) - 1, self._rows_per_step):
            yield self._assemble(order, ptr, start)

    # --- layout --------------------------------------------------------------------------------

    @property
    def _rows_per_step(self) -> int:
        return self.batch_size * self.process_count

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, row pointers): row r holds documents order[ptr[r]:ptr[r + 1]]."""
        if self._layout_cache is None or self._layout_cache[0] != epoch:
            order = self._order(epoch)
            self._layout_cache = (epoch, order, self._rows(order))
        return self._layout_cache[1], self._layout_cache[2]

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.docs)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _rows(self, order: np.ndarray) -> np.ndarray:
        if not self.packing:
            return np.arange(len(order) + 1)
        return pack_rows(self._lengths[order], self.sequence_len, self.max_docs_per_row)

    def _assemble(self, order: np.ndarray, ptr: np.ndarray, first_row: int) -> dict[str, np.ndarray]:
        B, T = self.batch_size, self.sequence_len
        pad = self.docs.pad_id
        input_ids = np.full((B, T), pad, np.int32)
        targets = np.full((B, T), pad, np.int32)
        loss_mask = np.zeros((B, T), np.float32)
        positions = np.zeros((B, T), np.int32)
        segment_ids = np.zeros((B, T), np.int32)
        tokens, mask, offsets = self.docs.tokens, self.docs.loss_mask, self.docs.offsets
        n_rows = len(ptr) - 1
        for b in range(B):
            row = first_row + self.process_index + b * self.process_count
            if row >= n_rows:
                continue  # an empty row completing the epoch's last batch
            t = 0
            for seg, d in enumerate(order[ptr[row]:ptr[row + 1]], start=1):
                n, o = int(self._lengths[d]), int(offsets[d])
                input_ids[b, t:t + n] = tokens[o:o + n]
                targets[b, t:t + n - 1] = tokens[o + 1:o + n]
                loss_mask[b, t:t + n - 1] = mask[o + 1:o + n]
                positions[b, t:t + n] = np.arange(n)
                segment_ids[b, t:t + n] = seg
                t += n
        return {"input_ids": input_ids, "targets": targets, "loss_mask": loss_mask,
                "positions": positions, "segment_ids": segment_ids}
