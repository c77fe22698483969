"""Tokenized splits on disk: `<cache_dir>/<key>.npz`, keyed on everything that changes the tokens.

The key hashes the dataset entries (every DatasetConfig field), each source's fingerprint (size and
mtime of every local file, or the Hub dataset's fingerprint), the tokenizer (its full
tokenizer.json or vocabulary, chat template and special tokens), sequence_len, loss_scale, mode and
CODE_VERSION (bump it whenever tokenization output changes). The validation split ratio and seed
are not in it: the split is cut from the cached documents after loading. Writes go to a temporary
file in the same directory and are renamed into place, so a crash never leaves a half file that a
later run would trust. Arrays only, no pickles: stats travel as JSON bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import zipfile
from pathlib import Path

import numpy as np

from ..atomic import atomic_file
from .docs import TokenizedDocs

CODE_VERSION = 1
log = logging.getLogger("surogate_jax.data")


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True, default=str).encode())
    special = {k: str(getattr(tokenizer, k, None)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special["added"] = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    h.update(json.dumps(special, sort_keys=True).encode())
    return h.hexdigest()


def cache_key(datasets: list, fingerprints: list[dict], tokenizer_fp: str, *, sequence_len: int,
              loss_scale: str, mode: str) -> str:
    payload = {
        "code": CODE_VERSION, "mode": mode, "sequence_len": sequence_len, "loss_scale": loss_scale,
        "tokenizer": tokenizer_fp,
        "datasets": [{"config": dataclasses.asdict(d), "source": fp} for d, fp in zip(datasets, fingerprints)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def save(path: Path, docs: TokenizedDocs) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        np.savez(f, tokens=docs.tokens, loss_mask=docs.loss_mask, offsets=docs.offsets,
                 truncated=docs.truncated, pad_id=np.int64(docs.pad_id),
                 stats=np.frombuffer(json.dumps(docs.stats).encode(), np.uint8))


def load(path: Path) -> TokenizedDocs | None:
    """The cached split, or None when there is none or it cannot be read (then it is rebuilt)."""
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            docs = TokenizedDocs(z["tokens"], z["loss_mask"], z["offsets"],
                                 json.loads(z["stats"].tobytes().decode()), int(z["pad_id"]), z["truncated"])
    except (OSError, ValueError, KeyError, AssertionError, zipfile.BadZipFile) as e:
        log.warning("ignoring unreadable tokenization cache %s (%s); tokenizing again", path, e)
        return None
    return docs
