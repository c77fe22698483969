"""Every dataset type and field mapping: rows -> rendered documents and supervised text."""

from __future__ import annotations

import json

import pytest
from tiny_tokenizers import build, docs_text, supervised_text, write_jsonl

from surogate_jax.config import ConfigError, DatasetConfig
from surogate_jax.data import DataError
from surogate_jax.data.formats import Chat, RowError, Text, make_formatter


def chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def test_conversation_messages(tmp_path, tok):
    f = write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
    ])
    train, valid = build(tok, {"path": f, "type": "conversation"})
    assert valid is None
    assert docs_text(tok, train) == [chatml(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"))]
    assert supervised_text(tok, train, 0) == "hello<|im_end|>\n"


@pytest.mark.parametrize("mapping", [{"role": "from", "content": "value"}, None])
def test_sharegpt_roles_and_property_mappings(tmp_path, tok, mapping):
    f = write_jsonl(tmp_path / "s.jsonl", [
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q1"},
                           {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"},
                           {"from": "bot", "value": "a2"}]},
    ])
    train, _ = build(tok, {"path": f, "type": "conversation", "messages_field": "conversations",
                           "message_property_mappings": mapping})
    assert docs_text(tok, train) == [chatml(("system", "S"), ("user", "q1"), ("assistant", "a1"),
                                            ("user", "q2"), ("assistant", "a2"))]
    assert supervised_text(tok, train, 0) == "a1<|im_end|>\na2<|im_end|>\n"


def test_conversation_system_and_completion_fields(tmp_path, tok):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt_msgs": [{"role": "user", "content": "2+2?"}], "sys": "You add.", "completion": "4"},
        {"prompt_msgs": [{"role": "user", "content": "3+3?"}], "sys": None, "completion": "6"},
    ])
    train, _ = build(tok, {"path": f, "type": "conversation", "messages_field": "prompt_msgs",
                           "system_field": "sys", "completion_field": "completion"})
    assert docs_text(tok, train) == [
        chatml(("system", "You add."), ("user", "2+2?"), ("assistant", "4")),
        chatml(("user", "3+3?"), ("assistant", "6")),
    ]
    assert [supervised_text(tok, train, d) for d in range(2)] == ["4<|im_end|>\n", "6<|im_end|>\n"]


def test_conversation_tools_and_tool_call_arguments_are_parsed():
    fmt = make_formatter(DatasetConfig(path="x", type="conversation", tools_field="tools"), ["messages", "tools"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chat = fmt({"tools": json.dumps(tools), "messages": [
        {"role": "user", "content": "add 1 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "content": "3", "name": "add"},
        {"role": "assistant", "content": "3"},
    ]})
    assert chat.tools == tools
    assert chat.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    assert chat.messages[2] == {"role": "tool", "content": "3", "name": "add"}


def test_content_as_text_parts():
    fmt = make_formatter(DatasetConfig(path="x", type="conversation"), ["messages"])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = fmt({"messages": [{"role": "user", "content": parts},
                             {"role": "assistant", "content": "c"}]})
    assert chat.messages[0]["content"] == "ab"
    with pytest.raises(RowError, match="neither a string"):
        fmt({"messages": [{"role": "user", "content": [{"type": "image", "url": "u"}]}]})


def test_instruction_default_formats(tmp_path, tok):
    f = write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Translate.", "input": "good morning", "output": "Bonjour"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Count.", "output": "1 2 3"},
    ])
    train, _ = build(tok, {"path": f, "type": "instruction"})
    assert docs_text(tok, train) == [
        chatml(("user", "Translate.\n\ngood morning"), ("assistant", "Bonjour")),
        chatml(("user", "Say hi."), ("assistant", "hi")),
        chatml(("user", "Count."), ("assistant", "1 2 3")),
    ]
    assert supervised_text(tok, train, 0) == "Bonjour<|im_end|>\n"


def test_instruction_custom_fields_formats_and_system_prompts(tmp_path, tok):
    f = write_jsonl(tmp_path / "a.jsonl", [
        {"task": "Add", "data": "1 2", "answer": "3", "persona": "You are a calculator."},
        {"task": "Add nothing", "answer": "0", "persona": None},
    ])
    common = {"path": f, "type": "instruction", "instruction_field": "task", "input_field": "data",
              "output_field": "answer", "prompt_format": "### Task: {instruction}\n### Input: {input}",
              "prompt_format_no_input": "### Task: {instruction}"}
    train, _ = build(tok, {**common, "system_prompt_type": "field", "system_prompt_field": "persona"})
    assert docs_text(tok, train) == [
        chatml(("system", "You are a calculator."), ("user", "### Task: Add\n### Input: 1 2"), ("assistant", "3")),
        chatml(("user", "### Task: Add nothing"), ("assistant", "0")),
    ]
    train, _ = build(tok, {**common, "system_prompt_type": "fixed", "system_prompt": "Fixed."})
    assert docs_text(tok, train)[1] == chatml(("system", "Fixed."), ("user", "### Task: Add nothing"),
                                              ("assistant", "0"))


@pytest.mark.parametrize("entry, error", [
    ({"type": "instruction", "prompt_format": "{instruction} {question}"}, "not a valid format string"),
    ({"type": "instruction", "system_prompt_type": "field"}, "needs system_prompt_field"),
    ({"type": "instruction", "system_prompt_type": "fixed"}, "needs system_prompt"),
    ({"type": "conversation", "message_property_mappings": {"speaker": "from"}}, "unknown keys"),
])
def test_bad_format_settings_are_refused_when_the_entry_is_built(entry, error):
    with pytest.raises(ConfigError, match=error):
        DatasetConfig(path="x", **entry)


def test_text_type_in_sft_is_fully_supervised_with_eos(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"body": "the quick brown fox"}, {"body": ""}])
    train, _ = build(tok, {"path": f, "type": "text", "text_field": "body"})
    ids, mask = train.doc(0)
    assert tok.decode(ids.tolist()) == "the quick brown fox<|im_end|>"
    assert ids[-1] == tok.eos_token_id
    assert not mask[0] and mask[1:].all()
    assert train.stats["rows_skipped"] == 1 and train.stats["skip_reasons"] == {"field 'body' is empty": 1}


@pytest.mark.parametrize("row, kind, messages", [
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}, Chat,
     [("user", "u"), ("assistant", "a")]),
    ({"conversations": [{"from": "human", "value": "u"}, {"from": "gpt", "value": "a"}]}, Chat,
     [("user", "u"), ("assistant", "a")]),
    ({"instruction": "i", "input": "x", "output": "a"}, Chat, [("user", "i\n\nx"), ("assistant", "a")]),
    ({"text": "plain"}, Text, None),
    ({"prompt": "p", "completion": "c", "system": "s"}, Chat, [("system", "s"), ("user", "p"), ("assistant", "c")]),
    ({"question": "q", "answer": "a"}, Chat, [("user", "q"), ("assistant", "a")]),
    ({"query": "q", "response": "r"}, Chat, [("user", "q"), ("assistant", "r")]),
    ({"problem": "p", "solution": "s"}, Chat, [("user", "p"), ("assistant", "s")]),
    ({"input": "x", "output": "y"}, Chat, [("user", "x"), ("assistant", "y")]),
])
def test_auto_detects_the_type_from_columns(row, kind, messages):
    example = make_formatter(DatasetConfig(path="x"), list(row))(row)
    assert isinstance(example, kind)
    if messages is not None:
        assert [(m["role"], m["content"]) for m in example.messages] == messages


def test_auto_with_unknown_columns_names_what_it_looked_for():
    with pytest.raises(DataError, match=r"type auto does not recognise the columns \['a', 'b'\].*messages"):
        make_formatter(DatasetConfig(path="d.jsonl"), ["a", "b"])


def test_rows_missing_fields_or_malformed_are_skipped_and_counted(tmp_path, tok):
    f = write_jsonl(tmp_path / "m.jsonl", [
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "ok"}]},
        {"other": 1},  # messages missing
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]},
    ])
    train, _ = build(tok, {"path": f, "type": "conversation"})
    assert len(train) == 1
    s = train.stats
    assert (s["rows_read"], s["rows_skipped"], s["docs"]) == (6, 5, 1)
    assert s["skip_reasons"] == {
        "missing field 'messages'": 1,
        "a message has no known role in 'role' (got 'narrator')": 1,
        "field 'messages' is a string but not valid JSON": 1,
        "no assistant reply after a prompt": 1,
        "a message has no 'content'": 1,
    }
