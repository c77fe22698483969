"""greedy_generate vs a naive per-token argmax loop and vs transformers' greedy `generate`, on
builtin:tiny-qwen3 with sharpened random weights; stop tokens; batching; no per-token retrace; and
exact_match's scoring logic with a stub generator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import surogate_jax
from surogate_jax import builtin_models as bm
from surogate_jax import generate as gen

PROMPTS = [
    [{"role": "user", "content": "reverse: q x k"}],
    [{"role": "user", "content": "what is 12 + 7?"}],
    [{"role": "user", "content": "count the letters: a b c d e f g"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort: 3 1 2"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "h i"},
     {"role": "user", "content": "first letter: z y"}],
]
NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, params, tokenizer, HF model) with weights perturbed and logits sharpened: random-init
    logits are tiny, and a near-tie in argmax could flip between two correct implementations."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.getbasetemp() / "surogate_jax_cache"  # shared with test_builtin_models.py
    mp.setenv("SUROGATE_JAX_CACHE", str(root))
    src = bm.resolve("builtin:tiny-qwen3")
    mp.undo()
    model, params = surogate_jax.load_pretrained(src)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: p * jnp.asarray(1.0 + 0.5 * rng.standard_normal(p.shape), p.dtype), params)
    params["embedding"] = params["embedding"] * 25.0
    out = surogate_jax.save_pretrained(tmp_path_factory.mktemp("sharp"), model, params, copy_side_files_from=src)
    tok = transformers.AutoTokenizer.from_pretrained(src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    return model, params, tok, hf


def _naive(model, params, ids, stop, n):
    """Un-jitted greedy loop over the exact-length sequence: no buffer, no padding, no while_loop."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = model.apply({"params": params}, jnp.asarray([ids], jnp.int32))
        nxt = int(jnp.argmax(logits[0, -1]))
        if nxt in stop:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def test_matches_naive_loop_and_transformers(tiny):
    model, params, tok, hf = tiny
    stop = gen.stop_token_ids(tok)
    assert stop == sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")})
    prompt_ids = gen.encode_prompts(tok, PROMPTS)
    assert prompt_ids[0] == tok(tok.apply_chat_template(PROMPTS[0], tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)["input_ids"]
    got = gen.greedy_generate_ids(model, params, prompt_ids, stop, max_new_tokens=NEW, batch_size=4)
    assert any(len(g) == NEW for g in got), "no row ran to max_new_tokens: weak test"
    # The un-jitted loop costs ~1 s a token on CPU: check 6 tokens of the shortest prompt (the one
    # with the most padding in its batch); transformers checks every prompt to the end.
    assert got[0][:6] == _naive(model, params, prompt_ids[0], stop, 6)
    for ids, g in zip(prompt_ids, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=stop,
                              pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        ref = ref[: next((i for i, t in enumerate(ref) if t in stop), len(ref))]
        assert g == ref
    texts = gen.greedy_generate(model, params, tok, PROMPTS, max_new_tokens=NEW, batch_size=4)
    assert texts == [tok.decode(g, skip_special_tokens=True) for g in got]


def test_stops_at_stop_tokens_and_batching_does_not_change_results(tiny):
    model, params, tok, _ = tiny
    prompt_ids = gen.encode_prompts(tok, PROMPTS * 2)
    free = gen.greedy_generate_ids(model, params, prompt_ids, [-1], max_new_tokens=NEW, batch_size=3)
    assert all(len(g) == NEW for g in free)
    stop = free[0][4]  # a token row 0 produces: it must now end there (and cut other rows too)
    cut = gen.greedy_generate_ids(model, params, prompt_ids, [stop], max_new_tokens=NEW, batch_size=32)
    for f, c in zip(free, cut, strict=True):
        assert c == (f[: f.index(stop)] if stop in f else f)
    assert len(cut[0]) <= 4


def test_decode_is_compiled_once_per_shape(tiny):
    model, params, tok, _ = tiny
    same_length = [[{"role": "user", "content": f"reverse: {c} x k"}] for c in "abcdefg"]
    gen.greedy_generate(model, params, tok, same_length[:2], max_new_tokens=5, batch_size=2)
    size = gen._decode._cache_size()
    gen.greedy_generate(model, params, tok, same_length[2:], max_new_tokens=5, batch_size=2)
    assert gen._decode._cache_size() == size


def test_too_long_prompt_is_refused(tiny):
    model, params, tok, _ = tiny
    with pytest.raises(ValueError, match="max_position_embeddings"):
        gen.greedy_generate_ids(model, params, [[5] * 510], [2], max_new_tokens=8)


def _rows(pairs):
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]


def test_exact_match_scoring_with_a_stub_generator(monkeypatch, tiny):
    _, _, tok, _ = tiny
    rows = _rows([("reverse: a b", "b a"), ("add 1 and 2", "3"), ("sort: 2 1 0", "0 1 2"),
                  ("last letter: x y", "y")])
    rows[0]["messages"].insert(0, {"role": "system", "content": "sys"})
    answers = {"reverse: a b": "  b a\n", "add 1 and 2": "4", "sort: 2 1 0": "0 1 2", "last letter: x y": "y z"}
    seen = {}

    def stub(model, params, tokenizer, prompts, max_new_tokens=16, batch_size=32):
        seen.update(prompts=prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
        return [answers[p[-1]["content"]] for p in prompts]

    monkeypatch.setattr(gen, "greedy_generate", stub)
    acc, examples = gen.exact_match(None, None, tok, rows, batch_size=7)
    assert acc == 0.5
    assert examples == [("reverse: a b", "b a", "  b a\n"), ("add 1 and 2", "3", "4"),
                        ("sort: 2 1 0", "0 1 2", "0 1 2"), ("last letter: x y", "y", "y z")]
    assert seen["prompts"][0] == rows[0]["messages"][:2] and all(p[-1]["role"] == "user" for p in seen["prompts"])
    assert seen["batch_size"] == 7
    assert seen["max_new_tokens"] == len(tok("0 1 2", add_special_tokens=False)["input_ids"]) + 2

    acc, examples = gen.exact_match(None, None, tok, rows, max_samples=2)
    assert (acc, len(examples)) == (0.5, 2)
    with pytest.raises(ValueError, match="row 1"):
        gen.exact_match(None, None, tok, rows[:1] + [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(ValueError, match="row 0"):
        gen.exact_match(None, None, tok, [{"text": "no messages"}])
