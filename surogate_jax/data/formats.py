"""Dataset rows -> examples: a `Chat` (messages for the tokenizer's own chat template) or a `Text`.

One formatter per `datasets[].type` (Surogate's semantics, reference section 4):
- conversation: `messages_field` holds a list of messages; `message_property_mappings` renames the
  role/content keys (ShareGPT: {"role": "from", "content": "value"}; without it each message may
  use role/from and content/value); roles human/gpt/bot/model become user/assistant; an optional
  `system_field` column becomes a leading system message, `completion_field` a final assistant
  turn, `tools_field` the template's `tools`. Tool-call arguments given as JSON strings are parsed.
- instruction: `prompt_format` (default "{instruction}\\n\\n{input}") or, when the input is empty,
  `prompt_format_no_input` (default "{instruction}") builds the user turn, `output_field` the
  assistant turn; `system_prompt_type` field|fixed adds a system message (when unset, a given
  `system_prompt_field` or `system_prompt` implies it).
- text: the `text_field` string as raw text (see chat.encode_text for how it is trained).
- auto: from the columns: a messages/conversations column -> conversation; instruction + output
  -> instruction; text -> text; otherwise a prompt/response pair (prompt, query, question, problem,
  input, instruction -> user; response, answer, output, completion, solution, target -> assistant;
  optional system).
A row missing a mapped field, or malformed, raises `RowError(reason)`: it is skipped and counted.
Formatters are plain picklable objects so tokenizer worker processes can use them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..config import DatasetConfig
from .docs import DataError


class RowError(Exception):
    """This row cannot be used; str(e) is the reason (counted in stats["skip_reasons"])."""


@dataclass(frozen=True)
class Chat:
    messages: list[dict]
    tools: list | None = None


@dataclass(frozen=True)
class Text:
    text: str


ROLES = {
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
}
MESSAGE_COLUMNS = ("messages", "conversations", "conversation")
USER_COLUMNS = ("prompt", "query", "question", "problem", "input", "instruction")
ASSISTANT_COLUMNS = ("response", "answer", "output", "completion", "solution", "target")
# Message keys passed through to the template besides role and content.
EXTRA_KEYS = ("tool_calls", "name", "tool_call_id", "reasoning_content")


def _present(value: Any) -> bool:
    return value is not None


def _string(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        raise RowError(f"missing field {key!r}")
    if not isinstance(value, str):
        raise RowError(f"field {key!r} is not a string")
    return value


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise RowError(f"{what} is a string but not valid JSON") from None
    return value


@dataclass(frozen=True)
class ConversationFormat:
    messages_field: str = "messages"
    role_key: str | None = None  # None: "role", else "from"
    content_key: str | None = None  # None: "content", else "value"
    system_field: str | None = None
    completion_field: str | None = None
    tools_field: str | None = None

    def fields(self) -> list[str]:
        return [f for f in (self.messages_field, self.system_field, self.completion_field) if f]

    def __call__(self, row: dict) -> Chat:
        raw = _json_value(row.get(self.messages_field), f"field {self.messages_field!r}")
        if raw is None:
            raise RowError(f"missing field {self.messages_field!r}")
        if not isinstance(raw, list) or not raw:
            raise RowError(f"field {self.messages_field!r} is not a non-empty list of messages")
        messages = [self._message(m) for m in raw]
        system = row.get(self.system_field) if self.system_field else None
        if isinstance(system, str) and system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        if self.completion_field:
            messages.append({"role": "assistant", "content": _string(row, self.completion_field)})
        tools = None
        if self.tools_field and _present(row.get(self.tools_field)):
            tools = _json_value(row[self.tools_field], f"field {self.tools_field!r}")
            if not isinstance(tools, list):
                raise RowError(f"field {self.tools_field!r} is not a list of tools")
            tools = tools or None
        return Chat(messages, tools)

    def _message(self, m: Any) -> dict:
        if not isinstance(m, dict):
            raise RowError("a message is not a mapping")
        role_key = self.role_key or ("role" if _present(m.get("role")) else "from")
        content_key = self.content_key or ("content" if _present(m.get("content")) or "value" not in m else "value")
        role = m.get(role_key)
        role = ROLES.get(role.lower()) if isinstance(role, str) else None
        if role is None:
            raise RowError(f"a message has no known role in {role_key!r} (got {m.get(role_key)!r})")
        out = {"role": role, "content": _content(m.get(content_key))}
        for k in EXTRA_KEYS:
            if _present(m.get(k)):
                out[k] = _tool_calls(m[k]) if k == "tool_calls" else m[k]
        if out["content"] is None:
            if "tool_calls" not in out:
                raise RowError(f"a message has no {content_key!r}")
            out["content"] = ""
        return out


def _content(value: Any) -> str | None:
    """Strings as they are; a list of {"type": "text", "text": ...} parts joined; else malformed."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text") or "") for p in value)
    raise RowError("a message content is neither a string nor a list of text parts")


def _tool_calls(calls: Any) -> list:
    calls = _json_value(calls, "tool_calls")
    if not isinstance(calls, list):
        raise RowError("tool_calls is not a list")
    out = []
    for c in calls:
        if not isinstance(c, dict):
            raise RowError("a tool call is not a mapping")
        c = {k: v for k, v in c.items() if v is not None}
        fn = c.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            c["function"] = {**fn, "arguments": _json_value(fn["arguments"], "tool call arguments")}
        out.append(c)
    return out


@dataclass(frozen=True)
class InstructionFormat:
    instruction_field: str = "instruction"
    input_field: str = "input"
    output_field: str = "output"
    prompt_format: str = "{instruction}\n\n{input}"
    prompt_format_no_input: str = "{instruction}"
    system_prompt_field: str | None = None  # set: system prompt from this column
    system_prompt: str | None = None  # set: this fixed system prompt

    def fields(self) -> list[str]:
        return [self.instruction_field, self.output_field]

    def __call__(self, row: dict) -> Chat:
        instruction = _string(row, self.instruction_field)
        output = _string(row, self.output_field)
        inp = row.get(self.input_field)
        if inp is not None and not isinstance(inp, str):
            raise RowError(f"field {self.input_field!r} is not a string")
        if inp:
            user = self.prompt_format.format(instruction=instruction, input=inp)
        else:
            user = self.prompt_format_no_input.format(instruction=instruction, input="")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        system = self.system_prompt
        if self.system_prompt_field:
            system = row.get(self.system_prompt_field)
            if system is not None and not isinstance(system, str):
                raise RowError(f"field {self.system_prompt_field!r} is not a string")
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return Chat(messages)


@dataclass(frozen=True)
class PairFormat:
    """auto's generic mapper: one user column, one assistant column, optional system column."""

    user_field: str
    assistant_field: str
    system_field: str | None = None

    def fields(self) -> list[str]:
        return [self.user_field, self.assistant_field]

    def __call__(self, row: dict) -> Chat:
        messages = [{"role": "user", "content": _string(row, self.user_field)},
                    {"role": "assistant", "content": _string(row, self.assistant_field)}]
        if self.system_field and isinstance(row.get(self.system_field), str) and row[self.system_field]:
            messages.insert(0, {"role": "system", "content": row[self.system_field]})
        return Chat(messages)


@dataclass(frozen=True)
class TextFormat:
    text_field: str = "text"

    def fields(self) -> list[str]:
        return [self.text_field]

    def __call__(self, row: dict) -> Text:
        text = _string(row, self.text_field)
        if not text.strip():
            raise RowError(f"field {self.text_field!r} is empty")
        return Text(text)


Formatter = ConversationFormat | InstructionFormat | PairFormat | TextFormat


def make_formatter(ds: DatasetConfig, columns: list[str]) -> Formatter:
    """The formatter for one dataset entry; `auto` looks at the dataset's column names."""
    kind = ds.type
    if kind == "auto":
        kind, found = _detect(ds, columns)
        if kind == "pair":
            return PairFormat(*found)
        if kind == "conversation":
            ds = dataclasses.replace(ds, messages_field=found)
    if kind == "conversation":
        mapping = ds.message_property_mappings or {}  # keys checked by DatasetConfig
        return ConversationFormat(ds.messages_field, mapping.get("role"), mapping.get("content"),
                                  ds.system_field, ds.completion_field, ds.tools_field)
    if kind == "instruction":
        return _instruction(ds)
    return TextFormat(ds.text_field)


def _detect(ds: DatasetConfig, columns: list[str]) -> tuple[str, Any]:
    cols = set(columns)
    for c in (ds.messages_field, *MESSAGE_COLUMNS):
        if c in cols:
            return "conversation", c
    if ds.instruction_field in cols and ds.output_field in cols:
        return "instruction", None
    if ds.text_field in cols:
        return "text", None
    user = next((c for c in USER_COLUMNS if c in cols), None)
    assistant = next((c for c in ASSISTANT_COLUMNS if c in cols and c != user), None)
    if user and assistant:
        return "pair", (user, assistant, "system" if "system" in cols else None)
    raise DataError(
        f"{ds.path}: type auto does not recognise the columns {sorted(cols)}; expected a "
        f"{'/'.join(MESSAGE_COLUMNS)} column, instruction + output, text, or a prompt column "
        f"({', '.join(USER_COLUMNS)}) with a response column ({', '.join(ASSISTANT_COLUMNS)}); "
        "or set type and the *_field keys")


def _instruction(ds: DatasetConfig) -> InstructionFormat:
    # DatasetConfig checked these settings (system prompt source, format strings) when it was built
    kind = ds.system_prompt_type or ("field" if ds.system_prompt_field else "fixed" if ds.system_prompt else None)
    return InstructionFormat(
        ds.instruction_field, ds.input_field, ds.output_field,
        ds.prompt_format or InstructionFormat.prompt_format,
        ds.prompt_format_no_input or InstructionFormat.prompt_format_no_input,
        ds.system_prompt_field if kind == "field" else None,
        ds.system_prompt if kind == "fixed" else None,
    )
