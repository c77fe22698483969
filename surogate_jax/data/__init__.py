"""Data pipeline: dataset rows -> token documents with loss masks -> packed, resumable batches.

    from surogate_jax.data import DataError, TokenizedDocs, build_datasets, BatchLoader

    train, valid = build_datasets(cfg.data, tokenizer, sequence_len=T, cache_dir=out / "tokenized", seed=s)
    loader = BatchLoader(train, batch_size=B, sequence_len=T, packing=cfg.data.sample_packing, seed=s)
    batch = next(loader)  # input_ids, targets, loss_mask, positions, segment_ids: [B, T]

Modules: sources (where rows come from), formats (rows -> chats or text per dataset type), chat
(chat-template rendering, loss masks, tokenization), build (build_datasets, validation split,
worker pool), cache (keyed .npz files), docs (TokenizedDocs, DataError), loader (BatchLoader).
`python -m surogate_jax.tokenize config.yaml` runs build_datasets alone and shows the result.
"""

from .build import build_datasets
from .docs import DataError, TokenizedDocs
from .loader import BatchLoader

__all__ = ["BatchLoader", "DataError", "TokenizedDocs", "build_datasets"]
