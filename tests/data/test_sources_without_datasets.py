"""Local JSON data loads without the `datasets` package (the GPU image has none); other local
formats then say what to install."""

from __future__ import annotations

import json
import sys

import pytest

from surogate_jax.config import DatasetConfig
from surogate_jax.data import DataError
from surogate_jax.data.sources import resolve


def test_local_jsonl_without_datasets(tmp_path, monkeypatch):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(3)) + "\n")
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    rows = resolve(DatasetConfig(path=str(f), type="text")).load()
    assert rows.columns == ["text"] and [r["text"] for r in rows.chunk(0, len(rows))] == ["doc 0", "doc 1", "doc 2"]


def test_local_csv_without_datasets_says_what_to_install(tmp_path, monkeypatch):
    f = tmp_path / "d.csv"
    f.write_text("text\nhello\n")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets"):
        resolve(DatasetConfig(path=str(f), type="text")).load()
