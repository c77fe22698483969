"""Examples -> (token ids, loss mask): chat templates, completion-only masks, raw text.

Chats use the tokenizer's own chat template (`apply_chat_template`), so the model is trained on
exactly what it will see at inference. Which characters are supervised comes from rendering the
conversation prefix by prefix, the way Surogate does, so any template works, with or without
`{% generation %}` tags: for assistant turn k, the text between render(messages[:k],
add_generation_prompt=True) and render(messages[:k + 1]) is the reply plus its end-of-turn marker
(ChatML: "reply<|im_end|>\\n"), and is supervised. `loss_scale`: default = every assistant reply,
last_round = only the last assistant message, all = every token (also what pretrain mode uses).
In default/last_round mode messages after the last assistant turn are dropped (nothing to learn);
an assistant message that opens the conversation has no prompt and is context only.

Spans are located in the full render of the conversation (what inference sees), then mapped to
tokens with the fast tokenizer's offset mapping on that one string: a token is supervised when any
of its characters is (so a token straddling prompt and reply still trains the reply). One
tokenization of the whole text gives the same tokens the model meets at inference, which encoding
segment by segment would not guarantee at segment joins. Tokenizers without offsets (slow, Python
ones) fall back to encoding the supervised and unsupervised segments one by one.

Templates that rewrite earlier turns: Qwen3's drops the <think> block of assistant turns before the
last user message, so an earlier reply renders differently in the full conversation than when it
was the newest turn. When the reply is not found verbatim at its place in the full render, the
longest tail of it that is found there (for Qwen3: the visible answer + end-of-turn marker) is
supervised; if there is none, the row is skipped. `enable_thinking` (only for templates that mention
it) is set per turn from whether the reply has a <think> block or reasoning_content, so an empty
Qwen3 "<think>\\n\\n</think>" block of a non-thinking reply is part of the prompt, not trained.

Raw text (`type: text`, both sft and pretrain mode) is tokenized as is, with the tokenizer's own
special tokens (e.g. Llama's BOS) and EOS appended; every token is supervised (a plain
continued-pretraining / completion document: there is no prompt to leave out).
"""

from __future__ import annotations

import os

import numpy as np

from .formats import Chat, RowError, Text


def encode(example: Chat | Text, tokenizer, *, loss_scale: str, use_offsets: bool | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, bool mask: token is supervised) of one example, not truncated."""
    if isinstance(example, Text):
        return encode_text(example.text, tokenizer)
    text, spans = chat_spans(tokenizer, example, loss_scale)
    return tokenize_spans(tokenizer, text, spans, use_offsets=use_offsets)


def encode_text(text: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    ids = list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return np.asarray(ids, np.int32), np.ones(len(ids), bool)


def thinks(message: dict) -> bool:
    content = message.get("content") or ""
    return "<think>" in content or "</think>" in content or bool(message.get("reasoning_content"))


def chat_spans(tokenizer, chat: Chat, loss_scale: str) -> tuple[str, list[tuple[int, int]]]:
    """The full render of `chat` and its supervised character spans [start, end)."""
    messages = chat.messages
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if loss_scale == "all":
        thinking = thinks(messages[turns[-1]]) if turns else None
        text = render(tokenizer, messages, chat.tools, generation=False, thinking=thinking)
        return text, [(0, len(text))]
    turns = [k for k in turns if k > 0]
    if not turns:
        raise RowError("no assistant reply after a prompt")
    messages = messages[: turns[-1] + 1]
    if loss_scale == "last_round":
        turns = turns[-1:]
    full = render(tokenizer, messages, chat.tools, generation=False, thinking=thinks(messages[-1]))
    spans: list[tuple[int, int]] = []
    floor = 0
    for k in turns:
        thinking = thinks(messages[k])
        prompt = render(tokenizer, messages[:k], chat.tools, generation=True, thinking=thinking)
        upto = render(tokenizer, messages[: k + 1], chat.tools, generation=False, thinking=thinking)
        cut = len(prompt) if upto.startswith(prompt) else len(os.path.commonprefix([upto, prompt]))
        reply = upto[cut:]
        if full.startswith(upto):
            start, end = cut, len(upto)
        else:  # the template renders this turn differently once later turns follow it
            start = cut if full.startswith(upto[:cut]) else len(os.path.commonprefix([full, upto[:cut]]))
            rest = full[start:]
            tail = next((j for j in range(len(reply)) if rest.startswith(reply[j:])), len(reply))
            end = start + len(reply) - tail
        if end <= start or start < floor:
            raise RowError("cannot find an assistant turn of the conversation in its full chat-template render")
        spans.append((start, end))
        floor = end
    return full, spans


def render(tokenizer, messages: list[dict], tools, *, generation: bool, thinking: bool | None) -> str:
    kwargs = {}
    if thinking is not None and "enable_thinking" in _template_source(tokenizer):
        kwargs["enable_thinking"] = thinking
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                            tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja2 TemplateError, raise_exception(), errors in template code
        raise RowError(f"the chat template failed: {' '.join(str(e).split())[:200] or type(e).__name__}") from None
    return out


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else str(template or "")


def tokenize_spans(tokenizer, text: str, spans: list[tuple[int, int]], *, use_offsets: bool | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of `text` and whether each overlaps a supervised span."""
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if not use_offsets:
        return _tokenize_segments(tokenizer, text, spans)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = np.asarray(enc["input_ids"], np.int32)
    offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
    sup = np.zeros(len(text) + 1, bool)
    for s, e in spans:
        sup[s:e] = True
    cum = np.concatenate([[0], np.cumsum(sup[:-1])])
    s, e = offsets[:, 0], offsets[:, 1]
    mask = np.where(e > s, cum[e] > cum[s], sup[np.minimum(s, len(text))])
    return ids, mask


def _tokenize_segments(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    ids: list[int] = []
    mask: list[bool] = []
    pos = 0
    for s, e in [*spans, (len(text), len(text))]:
        for a, b, supervised in ((pos, s, False), (s, e, True)):
            if b > a:
                piece = tokenizer(text[a:b], add_special_tokens=False, verbose=False)["input_ids"]
                ids += piece
                mask += [supervised] * len(piece)
        pos = e
    return np.asarray(ids, np.int32), np.asarray(mask, bool)
