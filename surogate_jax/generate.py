"""Greedy decoding for chat prompts and exact-match scoring, for small models and quick evaluations.

`greedy_generate` renders each conversation with the tokenizer's chat template
(`add_generation_prompt=True`), groups prompts of similar length into batches, and decodes each batch
in one jitted `lax.while_loop`: the rows sit right-padded in a fixed [B, L] token buffer, every step
runs the causal model over the whole buffer (no KV cache: fine for tiny models and short answers)
and writes row b's argmax at its own next position. Causality makes the padding after a row's
current position invisible to it, so no attention mask or left padding is needed. Shapes are static
per (batch size, bucketed length, max_new_tokens), so nothing is re-traced per token and few shapes
compile. A row stops at `<|im_end|>` / the tokenizer's eos / `<|endoftext|>`.

`exact_match` scores rows `{"messages": [..., {"role": "assistant", "content": answer}]}`: the
prompt is every message before the last, the reference the last message's content; stripped
strings must be equal.

`params` is the parameter tree, or a full variables dict such as {"params": ..., "lora": ...}.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
LENGTH_BUCKET = 16  # buffer lengths are rounded up to a multiple of this (fewer compiled shapes)


def stop_token_ids(tokenizer) -> list[int]:
    """The tokenizer's eos id plus ChatML's end tokens, where the vocabulary has them."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    if not ids:
        raise ValueError("the tokenizer has no eos token and no <|im_end|>: cannot tell where an answer ends")
    return sorted(ids)


def encode_prompts(tokenizer, prompts: Sequence[Sequence[dict]]) -> list[list[int]]:
    """Chat-templated token ids of each conversation, ending with the assistant generation prompt."""
    out = []
    for messages in prompts:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def _variables(params: Any) -> Any:
    """`params` may be the params tree or a full variables dict (e.g. {"params": ..., "lora": ...})."""
    return params if isinstance(params, Mapping) and "params" in params else {"params": params}


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def _decode(model, params, tokens_BL, lengths_B, stop_S, *, max_new_tokens: int):
    """Greedy continuation of right-padded rows: tokens [B, L] with row b's prompt in
    [0, lengths_B[b]); returns new tokens [B, max_new_tokens] and how many of them each row kept
    (up to and excluding its stop token)."""
    B, L = tokens_BL.shape
    rows = jnp.arange(B)

    def cond(carry):
        t, _, _, done_B, _ = carry
        return (t < max_new_tokens) & ~jnp.all(done_B)

    def body(carry):
        t, tokens_BL, out_BN, done_B, kept_B = carry
        logits_BLV = model.apply(_variables(params), tokens_BL)
        pos_B = lengths_B + t - 1  # the last filled position of each row
        next_B = jnp.argmax(logits_BLV[rows, pos_B], axis=-1).astype(tokens_BL.dtype)
        is_stop_B = jnp.any(next_B[:, None] == stop_S[None, :], axis=-1)
        keep_B = ~done_B & ~is_stop_B
        out_BN = out_BN.at[:, t].set(jnp.where(keep_B, next_B, 0))
        tokens_BL = tokens_BL.at[rows, jnp.minimum(pos_B + 1, L - 1)].set(next_B)
        return t + 1, tokens_BL, out_BN, done_B | is_stop_B, kept_B + keep_B

    init = (
        jnp.int32(0),
        tokens_BL,
        jnp.zeros((B, max_new_tokens), tokens_BL.dtype),
        jnp.zeros((B,), jnp.bool_),
        jnp.zeros((B,), jnp.int32),
    )
    _, _, out_BN, _, kept_B = jax.lax.while_loop(cond, body, init)
    return out_BN, kept_B


def greedy_generate_ids(
    model, params: Any, prompt_ids: Sequence[Sequence[int]], stop_ids: Sequence[int], *,
    max_new_tokens: int = 16, batch_size: int = 32, pad_id: int = 0,
) -> list[list[int]]:
    """Greedy continuations (token ids, stop token excluded) of already tokenized prompts."""
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} and batch_size={batch_size} must be >= 1")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    results: list[list[int]] = [[] for _ in prompt_ids]
    stop_S = jnp.asarray(np.asarray(stop_ids, np.int32))
    B = min(batch_size, len(prompt_ids))
    for start in range(0, len(order), B):
        idx = order[start : start + B]
        longest = max(len(prompt_ids[i]) for i in idx)
        L = -(-(longest + max_new_tokens) // LENGTH_BUCKET) * LENGTH_BUCKET
        if max_pos is not None and longest + max_new_tokens > max_pos:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_position_embeddings={max_pos}"
            )
        # Always B rows (a short last batch repeats its first prompt), so every batch has one shape.
        tokens = np.full((B, L), pad_id, np.int32)
        lengths = np.zeros((B,), np.int32)
        for r, i in enumerate([*idx, *[idx[0]] * (B - len(idx))]):
            tokens[r, : len(prompt_ids[i])] = prompt_ids[i]
            lengths[r] = len(prompt_ids[i])
        out, kept = _decode(
            model, params, jnp.asarray(tokens), jnp.asarray(lengths), stop_S, max_new_tokens=max_new_tokens
        )
        out, kept = np.asarray(out), np.asarray(kept)
        for r, i in enumerate(idx):
            results[i] = out[r, : kept[r]].tolist()
    return results


def greedy_generate(
    model, params: Any, tokenizer, prompts: Sequence[Sequence[dict]], max_new_tokens: int = 16,
    batch_size: int = 32,
) -> list[str]:
    """The greedy answer (decoded, special tokens dropped) to each chat conversation in `prompts`."""
    prompt_ids = encode_prompts(tokenizer, prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    new_ids = greedy_generate_ids(
        model, params, prompt_ids, stop_token_ids(tokenizer),
        max_new_tokens=max_new_tokens, batch_size=batch_size, pad_id=pad_id,
    )
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in new_ids]


def split_row(row: dict, index: int = 0) -> tuple[list[dict], str]:
    """(prompt messages, reference answer) of a chat row whose last message is the assistant's."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or len(messages) < 2:
        raise ValueError(f"row {index}: expected {{'messages': [...]}} with a prompt and an assistant answer")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        raise ValueError(f"row {index}: the last message must be an assistant message with string content")
    return messages[:-1], last["content"]


def exact_match(
    model, params: Any, tokenizer, rows: Sequence[dict], max_samples: int | None = None, *,
    max_new_tokens: int | None = None, batch_size: int = 32,
) -> tuple[float, list[tuple[str, str, str]]]:
    """(accuracy, [(prompt, expected, got), ...]) of greedy answers on the first `max_samples` rows.

    `prompt` in the examples is the content of the last prompt message (what was asked).
    `max_new_tokens` defaults to the longest reference answer's token count + 2, so a correct answer
    is never cut short and a wrong one cannot run on for long.
    """
    rows = list(rows)[:max_samples] if max_samples is not None else list(rows)
    if not rows:
        raise ValueError("exact_match needs at least one row")
    split = [split_row(r, i) for i, r in enumerate(rows)]
    prompts = [p for p, _ in split]
    expected = [e for _, e in split]
    if max_new_tokens is None:
        max_new_tokens = max(len(tokenizer(e, add_special_tokens=False)["input_ids"]) for e in expected) + 2
    got = greedy_generate(model, params, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    examples = [(str(p[-1].get("content", "")), e, g) for p, e, g in zip(prompts, expected, got, strict=True)]
    correct = sum(e.strip() == g.strip() for _, e, g in examples)
    return correct / len(examples), examples
