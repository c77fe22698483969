"""`build_datasets`: DataConfig -> tokenized train and validation splits (cached).

Per dataset entry: find the source, read its rows (first `samples`), format each row (formats.py),
render + tokenize it (chat.py), truncate to sequence_len, drop rows that are malformed, miss a
mapped field or end up with no supervised target (each counted with its reason). Entries are
concatenated in config order. Validation: `validation_datasets` when given, else a seeded
`validation_split_ratio` share of the training documents (cut after the cache, so changing the
ratio does not re-tokenize), else None. Large datasets are tokenized by a pool of `spawn` worker
processes (dataloader_num_workers; 0 = min(#CPU, 8); env SUROGATE_DATASET_PROCESSES overrides),
with a tqdm bar from PROGRESS_MIN_ROWS rows on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import DataConfig, DatasetConfig
from . import cache
from .chat import encode
from .docs import DataError, TokenizedDocs
from .formats import Formatter, RowError, TextFormat, make_formatter
from .sources import Source, resolve

log = logging.getLogger("surogate_jax.data")

PROGRESS_MIN_ROWS = 1000
PARALLEL_MIN_ROWS = 5_000  # below this, starting worker processes (~5 s of imports) costs more than it saves
CHUNK_ROWS = 512
MODES = ("sft", "pretrain")


@dataclass(frozen=True)
class _Job:
    tokenizer: object
    sequence_len: int
    loss_scale: str
    mode: str
    workers: int


def build_datasets(cfg: DataConfig, tokenizer, *, sequence_len: int, cache_dir: Path | None, seed: int,
                   mode: str = "sft") -> tuple[TokenizedDocs, TokenizedDocs | None]:
    """Train and validation splits (validation None when there is none).

    mode="sft": chats are masked by `cfg.loss_scale`; mode="pretrain": loss on every token (chats
    are rendered with the template, text rows are raw text + EOS). `seed` drives the validation
    split. `cache_dir` None disables caching.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if sequence_len < 2:
        raise ValueError(f"sequence_len={sequence_len}: must be >= 2")
    job = _Job(tokenizer, sequence_len, "all" if mode == "pretrain" else cfg.loss_scale, mode,
               _workers(cfg.dataloader_num_workers))
    cache_dir = None if cache_dir is None else Path(cache_dir)
    pending: list = []  # cache files are written once every split has built: a refused run writes nothing
    train = _build_split(cfg.datasets, job, cache_dir, pending)
    if cfg.validation_datasets:
        valid = _build_split(cfg.validation_datasets, job, cache_dir, pending)
    elif cfg.validation_split_ratio > 0:
        train, valid = split_validation(train, cfg.validation_split_ratio, seed)
    else:
        valid = None
    for path, docs in pending:
        cache.save(path, docs)
    for name, docs in (("train", train), ("validation", valid)):
        if docs is not None:
            log.info("%s", describe(name, docs.stats, sequence_len))
    return train, valid


def split_validation(docs: TokenizedDocs, ratio: float, seed: int) -> tuple[TokenizedDocs, TokenizedDocs | None]:
    """A seeded random `ratio` of the documents (at least 1, never all) becomes validation; both
    parts keep document order. The row counts stay with train."""
    n = len(docs)
    if n < 2:
        log.warning("validation_split_ratio=%s: only %d document, so there is no validation split", ratio, n)
        return docs, None
    n_val = min(max(1, round(ratio * n)), n - 1)
    val = np.sort(np.random.default_rng(seed).permutation(n)[:n_val])
    keep = np.ones(n, bool)
    keep[val] = False
    valid = docs.select(val, rows_read=n_val, rows_skipped=0, skip_reasons={}, datasets=[],
                        split_from="train")
    return docs.select(np.flatnonzero(keep)), valid


def _workers(configured: int) -> int:
    env = os.environ.get("SUROGATE_DATASET_PROCESSES")
    if env:
        return max(1, int(env))
    return configured if configured > 0 else min(os.cpu_count() or 1, 8)


def _build_split(datasets: tuple[DatasetConfig, ...], job: _Job, cache_dir: Path | None,
                 pending: list) -> TokenizedDocs:
    sources = [resolve(d) for d in datasets]
    path = None
    if cache_dir is not None:
        key = cache.cache_key(list(datasets), [s.fingerprint() for s in sources],
                              cache.tokenizer_fingerprint(job.tokenizer), sequence_len=job.sequence_len,
                              loss_scale=job.loss_scale, mode=job.mode)
        path = cache_dir / f"{key}.npz"
        docs = cache.load(path)
        if docs is not None:
            docs.stats.update(cache=str(path), from_cache=True)
            return docs
    docs = TokenizedDocs.concat([_tokenize_dataset(d, s, job) for d, s in zip(datasets, sources)])
    if path is not None:
        pending.append((path, docs))
    docs.stats.update(cache=None if path is None else str(path), from_cache=False)
    return docs


def _tokenize_dataset(ds: DatasetConfig, src: Source, job: _Job) -> TokenizedDocs:
    rows = src.load()
    if len(rows) == 0 and not rows.unparsed:
        raise DataError(f"{ds.path}: the dataset is empty")
    if ds.samples is not None:
        rows = rows.head(ds.samples)
    fmt = make_formatter(ds, rows.columns)
    if not isinstance(fmt, TextFormat) and not getattr(job.tokenizer, "chat_template", None):
        raise DataError(f"{ds.path}: {type(fmt).__name__.removesuffix('Format').lower()} rows need a chat "
                        "template, and the tokenizer has none (use a tokenizer with one, or type: text)")
    ids, mask, lengths, truncated, reasons = _encode_rows(rows, fmt, job, ds.path)
    reasons.update(rows.unparsed)
    n_read = len(rows) + sum(rows.unparsed.values())
    if len(lengths) == 0:
        raise DataError(f"{ds.path}: no usable rows (all {n_read} skipped); it was read as "
                        f"{_kind(fmt)} and looked for the fields {fmt.fields()}; reasons: {_top(reasons)}")
    stats = {"rows_read": n_read, "rows_skipped": sum(reasons.values()), "skip_reasons": dict(reasons),
             "datasets": [{"path": ds.path, "type": _kind(fmt), "rows_read": n_read,
                           "rows_skipped": sum(reasons.values()), "docs": len(lengths)}]}
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pad = job.tokenizer.pad_token_id
    docs = TokenizedDocs(ids, mask, offsets, stats, 0 if pad is None else int(pad), truncated)
    docs.stats.update(docs.content_stats())
    return docs


def _kind(fmt: Formatter) -> str:
    return {"ConversationFormat": "conversation", "InstructionFormat": "instruction",
            "PairFormat": "prompt/response pairs", "TextFormat": "text"}[type(fmt).__name__]


def _top(reasons: Counter, n: int = 5) -> str:
    items = [f"{r} ({c})" for r, c in reasons.most_common(n)]
    more = len(reasons) - n
    return "; ".join(items) + (f"; and {more} more" if more > 0 else "") if items else "none"


# --- encoding rows, in this process or in a pool ------------------------------------------------

_WORKER: tuple | None = None  # (formatter, job) in pool workers


def _encode_chunk(rows: list[dict], fmt: Formatter, job: _Job):
    """-> concatenated ids, masks, per-document lengths, truncated flags, skip reasons."""
    ids_out, mask_out, lengths, truncated = [], [], [], []
    reasons: Counter = Counter()
    T = job.sequence_len
    for row in rows:
        try:
            ids, mask = encode(fmt(row), job.tokenizer, loss_scale=job.loss_scale)
        except RowError as e:
            reasons[str(e)] += 1
            continue
        cut = len(ids) > T
        ids, mask = ids[:T], mask[:T].copy()
        if len(mask):
            mask[0] = False  # nothing precedes the first token: it is never a target
        if not mask.any():
            reasons[f"no supervised token in the first {T} tokens" if cut else "no supervised token"] += 1
            continue
        ids_out.append(ids)
        mask_out.append(mask)
        lengths.append(len(ids))
        truncated.append(cut)
    return (_cat(ids_out, np.int32), _cat(mask_out, bool), np.asarray(lengths, np.int64),
            np.asarray(truncated, bool), reasons)


def _cat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype)


def _init_worker(fmt: Formatter, job: _Job) -> None:
    global _WORKER
    _WORKER = (fmt, job)


def _encode_in_worker(rows: list[dict]):
    fmt, job = _WORKER
    return _encode_chunk(rows, fmt, job)


def _encode_rows(rows, fmt: Formatter, job: _Job, name: str):
    from tqdm import tqdm

    n = len(rows)
    results = None
    with tqdm(total=n, desc=f"tokenizing {name}", unit=" rows", disable=n < PROGRESS_MIN_ROWS) as bar:
        if job.workers > 1 and n >= PARALLEL_MIN_ROWS:
            try:
                results = []
                for size, r in _pool_chunks(rows, fmt, job):
                    results.append(r)
                    bar.update(size)
            except BrokenProcessPool as e:
                results = None
                log.warning("tokenizer worker processes failed (%s); tokenizing in this process instead. A script "
                            "that calls build_datasets at top level needs an `if __name__ == '__main__':` guard "
                            "for worker processes (or set dataloader_num_workers: 1)", e)
                bar.reset()
        if results is None:
            results = []
            for a in range(0, n, CHUNK_ROWS):
                results.append(_encode_chunk(rows.chunk(a, a + CHUNK_ROWS), fmt, job))
                bar.update(min(CHUNK_ROWS, n - a))
    reasons: Counter = Counter()
    for r in results:
        reasons.update(r[4])
    ids, mask, lengths, truncated = (_cat([r[i] for r in results], dt)
                                     for i, dt in enumerate((np.int32, bool, np.int64, bool)))
    return ids, mask, lengths, truncated, reasons


def _pool_chunks(rows, fmt: Formatter, job: _Job):
    """(rows in chunk, chunk result) in order, from `spawn` workers (fork is unsafe once JAX
    threads exist), with at most 4 chunks per worker in flight."""
    n = len(rows)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(job.workers, mp_context=ctx, initializer=_init_worker, initargs=(fmt, job)) as pool:
        pending: deque = deque()
        for a in range(0, n, CHUNK_ROWS):
            pending.append((min(CHUNK_ROWS, n - a), pool.submit(_encode_in_worker, rows.chunk(a, a + CHUNK_ROWS))))
            if len(pending) >= 4 * job.workers:
                size, future = pending.popleft()
                yield size, future.result()
        while pending:
            size, future = pending.popleft()
            yield size, future.result()


def describe(name: str, stats: dict, sequence_len: int | None = None) -> str:
    """One line for logs and the tokenize CLI."""
    sup = stats["supervised_tokens"]
    pct = 100.0 * sup / max(stats["tokens"], 1)
    source = (f"{stats['docs']:,} documents split from {stats['split_from']}" if stats.get("split_from")
              else f"{stats['rows_read']:,} rows -> {stats['docs']:,} documents")
    line = f"{name}: {source}, {stats['tokens']:,} tokens ({sup:,} supervised, {pct:.1f}%)"
    if stats.get("rows_skipped"):
        line += f"; {stats['rows_skipped']:,} rows skipped: {_top(Counter(stats.get('skip_reasons', {})), 3)}"
    if stats.get("truncated_docs"):
        line += f"; {stats['truncated_docs']:,} documents truncated to {sequence_len or 'sequence_len'} tokens"
    if stats.get("from_cache"):
        line += f" [from cache {stats['cache']}]"
    return line
