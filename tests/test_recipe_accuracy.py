"""benchmarks/experiments/recipe_accuracy.py's pure parts: how the corpus is cut into documents and how the
verdict against the issue's bars (fp8-hybrid within 1%, nvfp4 within 3% of bf16) is computed.
The training runs themselves are ordinary `python -m surogate_jax.pretrain` runs (tests/train)."""

from __future__ import annotations

import pytest


@pytest.fixture
def ra(benchmark_module):
    return benchmark_module("experiments/recipe_accuracy")


def test_pieces_cut_at_line_ends_and_lose_nothing(ra):
    text = "".join(f"line {i} " + "x" * (i % 23) + "\n" for i in range(300)) + "y" * 130 + "\nlast"
    out = ra.pieces(text, 64)
    assert "".join(out) == text
    assert all(0 < len(p) <= 64 for p in out)
    # a piece ends at a line end unless a single line was longer than the limit
    assert all(p.endswith("\n") or len(p) == 64 or p is out[-1] for p in out)


def _run(recipe, seed, ev, tr):
    return {"recipe": recipe, "seed": seed, "error": None, "final_eval_loss": ev, "final_train_loss": tr}


def test_verdicts_use_the_bars_and_pair_seeds(ra):
    runs = [_run("bf16", 1, 1.00, 0.90), _run("bf16", 2, 1.02, 0.92),
            _run("fp8-hybrid", 1, 1.02, 0.92), _run("fp8-hybrid", 2, 1.03, 0.93),   # means +1.5%: out
            _run("nvfp4", 1, 1.02, 0.91), _run("nvfp4", 2, 1.04, 0.94)]             # means +2.0%: in
    text, v = ra.summarize(runs, ["bf16", "fp8-hybrid", "nvfp4"])
    assert v["fp8-hybrid"]["eval_gap"] == pytest.approx(2.05 / 2.02 - 1)
    assert v["fp8-hybrid"]["train_gap"] == pytest.approx(1.85 / 1.82 - 1)
    assert v["fp8-hybrid"]["paired_eval_gaps"] == pytest.approx([0.02, 1.03 / 1.02 - 1])
    assert not v["fp8-hybrid"]["within"] and v["fp8-hybrid"]["bar"] == 0.01
    assert v["nvfp4"]["within"] and v["nvfp4"]["bar"] == 0.03
    assert "NOT within" in text and "| nvfp4 | 2 |" in text


def test_a_failed_recipe_is_reported_not_judged(ra):
    runs = [_run("bf16", 1, 1.0, 1.0), {**_run("nvfp4", 1, None, None), "error": "boom"}]
    text, v = ra.summarize(runs, ["bf16", "nvfp4"])
    assert "nvfp4" not in v and "| nvfp4 | 0 | failed |" in text
