"""Completion-only loss masks from prefix rendering, checked token by token.

The expected tokens and mask are built independently of the code under test: each piece of the
ChatML text is tokenized on its own and labelled by hand (ChatML pieces end at special tokens or
newlines, so piecewise tokenization equals tokenizing the whole render).
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_tokenizers import QWEN3, make_tokenizer

from surogate_jax.data.chat import chat_spans, encode
from surogate_jax.data.formats import Chat, RowError, Text

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "what is the answer?"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "Translate to French: good morning"},
    {"role": "assistant", "content": "Bonjour"},
]
# (text, belongs to assistant turn #) for the ChatML render of CONVERSATION; None = prompt
PIECES = [
    ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwhat is the answer?<|im_end|>\n"
     "<|im_start|>assistant\n", None),
    ("The answer is 42.<|im_end|>\n", 0),
    ("<|im_start|>user\nTranslate to French: good morning<|im_end|>\n<|im_start|>assistant\n", None),
    ("Bonjour<|im_end|>\n", 1),
]


def expected(tok, supervised_turns):
    ids, mask = [], []
    for text, turn in PIECES:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [turn is not None and (supervised_turns == "all" or turn in supervised_turns)] * len(piece)
    if supervised_turns == "all":
        mask = [True] * len(ids)
    return np.array(ids), np.array(mask)


@pytest.mark.parametrize("loss_scale, turns", [("default", (0, 1)), ("last_round", (1,)), ("all", "all")])
@pytest.mark.parametrize("use_offsets", [True, False])
def test_multi_turn_masks_token_by_token(tok, loss_scale, turns, use_offsets):
    ids, mask = encode(Chat(CONVERSATION), tok, loss_scale=loss_scale, use_offsets=use_offsets)
    want_ids, want_mask = expected(tok, turns)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
    if loss_scale == "default":
        assert tok.decode(ids[mask].tolist()) == "The answer is 42.<|im_end|>\nBonjour<|im_end|>\n"


def test_tool_turns_are_context_and_every_assistant_message_trains(tok):
    chat = Chat([{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": "calling add"},
                 {"role": "tool", "content": "3"}, {"role": "assistant", "content": "it is 3"}])
    ids, mask = encode(chat, tok, loss_scale="default")
    assert tok.decode(ids[mask].tolist()) == "calling add<|im_end|>\nit is 3<|im_end|>\n"
    ids, mask = encode(chat, tok, loss_scale="last_round")
    assert tok.decode(ids[mask].tolist()) == "it is 3<|im_end|>\n"


def test_trailing_prompt_turns_are_dropped_except_with_all(tok):
    chat = Chat(CONVERSATION[:3] + [{"role": "user", "content": "and now?"}])
    text, _ = chat_spans(tok, chat, "default")
    assert not text.endswith("and now?<|im_end|>\n")
    text, spans = chat_spans(tok, chat, "all")
    assert text.endswith("and now?<|im_end|>\n") and spans == [(0, len(text))]


def test_assistant_first_is_context_only(tok):
    with pytest.raises(RowError, match="no assistant reply after a prompt"):
        chat_spans(tok, Chat([{"role": "assistant", "content": "hi"}]), "default")
    text, spans = chat_spans(tok, Chat([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "u"},
                                        {"role": "assistant", "content": "a"}]), "default")
    assert [text[a:b] for a, b in spans] == ["a<|im_end|>\n"]


def test_template_without_enable_thinking_keeps_think_text_as_reply(tok):
    chat = Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hmm</think>ok"}])
    text, spans = chat_spans(tok, chat, "default")
    assert [text[a:b] for a, b in spans] == ["<think>hmm</think>ok<|im_end|>\n"]


def test_qwen3_thinking_reply_trains_its_think_block(qwen3_tok):
    chat = Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}])
    text, spans = chat_spans(qwen3_tok, chat, "default")
    assert text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["<think>\nhmm\n</think>\n\nok<|im_end|>\n"]


def test_qwen3_non_thinking_reply_leaves_the_empty_think_block_in_the_prompt(qwen3_tok):
    chat = Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}])
    text, spans = chat_spans(qwen3_tok, chat, "default")
    assert text == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>\n"
    assert [text[a:b] for a, b in spans] == ["ok<|im_end|>\n"]


def test_qwen3_history_turns_lose_their_think_block_but_keep_their_answer(qwen3_tok):
    chat = Chat([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
                 {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                 {"role": "user", "content": "q3"}, {"role": "assistant", "content": "<think>\nr3\n</think>\n\na3"}])
    text, spans = chat_spans(qwen3_tok, chat, "default")
    assert "r1" not in text  # the template drops history thinking: what inference sees
    assert [text[a:b] for a, b in spans] == ["a1<|im_end|>\n", "a2<|im_end|>\n",
                                             "<think>\nr3\n</think>\n\na3<|im_end|>\n"]
    ids, mask = encode(chat, qwen3_tok, loss_scale="default")
    assert qwen3_tok.decode(ids[mask].tolist()) == "".join(text[a:b] for a, b in spans)


def test_reasoning_content_field_counts_as_thinking(qwen3_tok):
    chat = Chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok", "reasoning_content": "r"}])
    text, spans = chat_spans(qwen3_tok, chat, "default")
    assert [text[a:b] for a, b in spans] == ["<think>\nr\n</think>\n\nok<|im_end|>\n"]


def test_a_failing_template_skips_the_row():
    tok = make_tokenizer("{% if messages|length > 2 %}{{ raise_exception('too long') }}{% endif %}"
                         + QWEN3)
    with pytest.raises(RowError, match="the chat template failed: too long"):
        chat_spans(tok, Chat(CONVERSATION), "default")


def test_raw_text_gets_eos_and_full_supervision(tok):
    ids, mask = encode(Text("hello world"), tok, loss_scale="default")
    assert tok.decode(ids.tolist()) == "hello world<|im_end|>" and mask.all()
