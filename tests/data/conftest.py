"""Data-test fixtures: tiny local tokenizers, an isolated HF datasets cache, config helpers."""

from __future__ import annotations

import pytest
from tiny_tokenizers import CHATML, QWEN3, make_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _isolated_hf_datasets_cache(tmp_path_factory):
    """HF `datasets` writes Arrow caches of local files; keep them out of the user's home."""
    import datasets

    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets_cache")
    datasets.disable_progress_bars()
    yield
    datasets.config.HF_DATASETS_CACHE = old


@pytest.fixture
def tok():
    return make_tokenizer(CHATML)


@pytest.fixture
def qwen3_tok():
    return make_tokenizer(QWEN3)
