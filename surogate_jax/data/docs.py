"""`TokenizedDocs`: every document of one split as one flat token array + loss mask + boundaries.

One flat int32 array (not a list of arrays) keeps a split cheap to cache (`.npz`), to slice and to
shuffle by index. `loss_mask[i]` says whether token i is a prediction target; the first token of a
document is never one (nothing precedes it), so `loss_mask[offsets[d]]` is always False and
`loss_mask.sum()` is the number of supervised targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import SurogateError


class DataError(SurogateError):
    """A data problem the user must fix: a missing file, an empty dataset, no usable rows left..."""


@dataclass
class TokenizedDocs:
    tokens: np.ndarray  # int32 [N]
    loss_mask: np.ndarray  # bool [N]: True where this token is a supervised prediction target
    offsets: np.ndarray  # int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
    # rows_read, rows_skipped, skip_reasons, datasets, docs, tokens, supervised_tokens, truncated_docs, cache...
    stats: dict = field(default_factory=dict)
    pad_id: int = 0  # the tokenizer's pad id (0 when it has none): what BatchLoader pads rows with
    truncated: np.ndarray | None = None  # bool [n_docs]: cut to sequence_len when tokenized

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, bool)
        self.offsets = np.asarray(self.offsets, np.int64)
        if self.truncated is None:
            self.truncated = np.zeros(len(self), bool)
        self.truncated = np.asarray(self.truncated, bool)
        assert self.tokens.shape == self.loss_mask.shape, (self.tokens.shape, self.loss_mask.shape)
        assert self.offsets[0] == 0 and self.offsets[-1] == len(self.tokens), "offsets must cover tokens"
        assert self.truncated.shape == (len(self),)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """int64 [n_docs]: tokens per document."""
        return np.diff(self.offsets)

    def doc(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, loss_mask) of document d."""
        a, b = self.offsets[d], self.offsets[d + 1]
        return self.tokens[a:b], self.loss_mask[a:b]

    @classmethod
    def from_docs(cls, docs: Sequence[tuple[np.ndarray, np.ndarray]], *, pad_id: int = 0,
                  truncated: Sequence[bool] | None = None, stats: dict | None = None) -> TokenizedDocs:
        """From a list of (token ids, loss mask) pairs; the first token of each loses its mask bit."""
        lengths = np.array([len(t) for t, _ in docs], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([np.asarray(t, np.int32) for t, _ in docs]) if docs else np.zeros(0, np.int32)
        mask = np.concatenate([np.asarray(m, bool) for _, m in docs]) if docs else np.zeros(0, bool)
        mask[offsets[:-1][lengths > 0]] = False
        out = cls(tokens, mask, offsets, dict(stats or {}), pad_id,
                  None if truncated is None else np.asarray(truncated, bool))
        out.stats.update(out.content_stats())
        return out

    def content_stats(self) -> dict:
        """The stats that follow from the arrays alone (docs, tokens, supervised, truncated)."""
        return {"docs": len(self), "tokens": int(len(self.tokens)),
                "supervised_tokens": int(self.loss_mask.sum()), "truncated_docs": int(self.truncated.sum())}

    def select(self, doc_ids: np.ndarray, **stats) -> TokenizedDocs:
        """A new split holding documents `doc_ids` in that order; `stats` overrides row counts."""
        doc_ids = np.asarray(doc_ids, np.int64)
        lengths = self.lengths[doc_ids]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        # token index = start of its source document + its position inside the document
        idx = np.repeat(self.offsets[doc_ids] - offsets[:-1], lengths) + np.arange(offsets[-1])
        out = TokenizedDocs(self.tokens[idx], self.loss_mask[idx], offsets, {**self.stats, **stats},
                            self.pad_id, self.truncated[doc_ids])
        out.stats.update(out.content_stats())
        return out

    @classmethod
    def concat(cls, parts: Sequence[TokenizedDocs]) -> TokenizedDocs:
        """Documents of every part, in order; row counts and skip reasons add up."""
        assert parts, "nothing to concatenate"
        sizes = [len(p.tokens) for p in parts]
        shifts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, shifts)]).astype(np.int64)
        stats: dict = {"rows_read": 0, "rows_skipped": 0, "skip_reasons": {}, "datasets": []}
        for p in parts:
            stats["rows_read"] += p.stats.get("rows_read", 0)
            stats["rows_skipped"] += p.stats.get("rows_skipped", 0)
            for reason, n in p.stats.get("skip_reasons", {}).items():
                stats["skip_reasons"][reason] = stats["skip_reasons"].get(reason, 0) + n
            stats["datasets"] += p.stats.get("datasets", [])
        out = cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.loss_mask for p in parts]),
                  offsets, stats, parts[0].pad_id, np.concatenate([p.truncated for p in parts]))
        out.stats.update(out.content_stats())
        return out
