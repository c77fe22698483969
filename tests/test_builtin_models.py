"""builtin:tiny-qwen3: builds offline into the cache, loads with ours and with transformers (same
logits), has a working ChatML tokenizer, is reused, never uses a half-built directory; and the
quickstart dataset is deterministic, held-out, and matches the committed jsonl files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import surogate_jax
from surogate_jax import builtin_models as bm
from surogate_jax.errors import ModelLoadError

TOL = 1e-4  # max |ours - HF| / max |HF| in fp32, as in tests/models/test_hf_parity.py
REPO = Path(__file__).resolve().parents[1]
ROW = {"messages": [{"role": "user", "content": "reverse: q x k"}, {"role": "assistant", "content": "k x q"}]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache under this session's pytest temp dir (tests/test_generate.py reuses the build)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.getbasetemp() / "surogate_jax_cache"
    mp.setenv("SUROGATE_JAX_CACHE", str(root))
    yield root
    mp.undo()


@pytest.fixture(scope="module")
def model_dir(cache):
    return bm.resolve("builtin:tiny-qwen3")


def test_builds_into_the_cache_as_an_hf_directory(cache, model_dir):
    assert model_dir == cache / "builtin" / "tiny-qwen3"
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", bm.MARKER} <= names
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")], "staging dirs left behind"
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] % 64 == 0


def test_ours_and_transformers_agree(model_dir):
    model, params = surogate_jax.load_pretrained(model_dir)
    c = model.config
    assert (c.model_type, c.qk_norm, c.tie_word_embeddings) == ("qwen3", True, True)
    assert (c.num_layers, c.max_position_embeddings, c.rope_theta) == (4, 512, 10000.0)
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    assert 1_000_000 <= n_params <= 3_000_000
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() for p in hf.parameters()) == n_params
    ids = np.random.default_rng(0).integers(0, c.vocab_size, size=(2, 37), dtype=np.int32)
    ours = np.asarray(model.apply({"params": params}, jnp.asarray(ids)), np.float64)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids).long()).logits.double().numpy()
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < TOL


def test_tokenizer_chat_template_and_token_ids(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(ROW["messages"], tokenize=False)
    assert text == "<|im_start|>user\nreverse: q x k<|im_end|>\n<|im_start|>assistant\nk x q<|im_end|>\n"
    prompt = tok.apply_chat_template(ROW["messages"][:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nreverse: q x k<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    toks = tok.convert_ids_to_tokens(ids)
    assert toks.count("<|im_start|>") == 2 and toks.count("<|im_end|>") == 2
    # A letter is one token, the same in the prompt (" q") and at the start of the answer ("k").
    assert [toks.count(c) for c in "qxk"] == [2, 2, 2], toks
    text = "héllo wörld 123 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any text encodes
    assert 300 <= len(tok) <= 1024
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg["pad_token_id"] == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    assert len(tok) <= cfg["vocab_size"] < len(tok) + 64
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # a name transformers 4.x knows too


def test_tokenizer_training_is_deterministic():
    rows = bm.quickstart_rows(300, 20, seed=5)
    a, b = (json.loads(bm.train_tokenizer(rows[0] + rows[1]).backend_tokenizer.to_str()) for _ in range(2))
    assert a == b


def test_second_resolve_reuses_the_build(model_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def must_not_build(out):
        raise AssertionError("rebuilt although a complete build exists")

    monkeypatch.setitem(bm.BUILTINS, "tiny-qwen3", (must_not_build, ""))
    assert bm.resolve("builtin:tiny-qwen3") == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_unknown_builtin_names_the_available_ones(cache):
    with pytest.raises(ModelLoadError, match=r"builtin:nope.*builtin:tiny-qwen3"):
        bm.resolve("builtin:nope")
    assert not (cache / "builtin" / "nope").exists()


def test_killed_build_leaves_nothing_usable_and_stale_dirs_are_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("SUROGATE_JAX_CACHE", str(tmp_path))
    calls = []

    def flaky(out):
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        if len(calls) == 1:
            raise KeyboardInterrupt  # killed halfway

    monkeypatch.setitem(bm.BUILTINS, "tiny-qwen3", (flaky, ""))
    with pytest.raises(KeyboardInterrupt):
        bm.resolve("builtin:tiny-qwen3")
    assert list((tmp_path / "builtin").iterdir()) == []  # no final dir, no staging left
    # A directory without the marker (e.g. from an older recipe, or copied by hand) is not trusted.
    final = tmp_path / "builtin" / "tiny-qwen3"
    final.mkdir()
    (final / "junk").write_text("x")
    assert bm.resolve("builtin:tiny-qwen3") == final
    assert len(calls) == 2 and bm._is_complete(final, "tiny-qwen3") and not (final / "junk").exists()
    assert [p.name for p in (tmp_path / "builtin").iterdir()] == ["tiny-qwen3"]


def test_unwritable_cache_is_a_model_load_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SUROGATE_JAX_CACHE", str(blocker))
    with pytest.raises(ModelLoadError, match="SUROGATE_JAX_CACHE"):
        bm.resolve("builtin:tiny-qwen3")


# ------------------------------------------------------------------------------------------------
# The quickstart dataset


def _task_key(content: str) -> tuple[str, str]:
    """(task, input) of a user prompt, parsed back through the phrasings."""
    for task, phrasings in bm.PHRASINGS.items():
        for p in phrasings:
            m = re.fullmatch(re.escape(p).replace(re.escape("{x}"), "(.+)"), content)
            if m:
                return task, m.group(1)
    raise AssertionError(f"unparsable prompt {content!r}")


def test_quickstart_rows_are_deterministic_held_out_and_correct():
    train, evaluation = bm.quickstart_rows()
    assert (train, evaluation) == bm.quickstart_rows()
    assert len(train) == bm.QUICKSTART_TRAIN_ROWS and len(evaluation) == bm.QUICKSTART_EVAL_ROWS
    keys = {"train": [], "eval": []}
    for split, rows in (("train", train), ("eval", evaluation)):
        for row in rows:
            user, assistant = row["messages"]
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            task, x = _task_key(user["content"])
            keys[split].append((task, x))
            answer = assistant["content"]
            if task == "next":
                assert answer == str(int(x) + 1) and 0 <= int(x) < 1000
            elif task == "sort":
                assert answer == " ".join(sorted(x.split())) and len(x.split()) == 3
            else:
                letters = x.split(" ")
                assert all(len(c) == 1 and c.islower() for c in letters)
                expect = {"reverse": " ".join(letters[::-1]), "count": str(len(letters)),
                          "first": letters[0], "last": letters[-1]}[task]
                assert answer == expect
    assert len(set(keys["train"])) == len(train) and len(set(keys["eval"])) == len(evaluation)
    assert not set(keys["train"]) & set(keys["eval"])
    assert {t for t, _ in keys["eval"]} == set(bm.TASKS)


@pytest.mark.skipif(not (REPO / "examples" / "data").is_dir(), reason="no examples/ folder (installed wheel)")
def test_committed_quickstart_files_match_the_generator():
    train, evaluation = bm.quickstart_rows()
    for name, rows in (("quickstart_train.jsonl", train), ("quickstart_eval.jsonl", evaluation)):
        path = REPO / "examples" / "data" / name
        assert path.stat().st_size < 1_000_000
        lines = path.read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == rows, f"{path} is stale: rerun make_quickstart_data.py"
