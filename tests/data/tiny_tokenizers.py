"""Helpers for data tests: tiny local tokenizers (no downloads), data files, configs.

The tokenizer is a byte-level BPE trained in milliseconds on a small corpus, wrapped in
`PreTrainedTokenizerFast`, with one of two chat templates:

- CHATML: plain ChatML (<|im_start|>role\\n...<|im_end|>\\n), no generation tags.
- QWEN3: a small Qwen3-like template written for these tests: it splits "<think>...</think>" off an
  assistant reply, shows the think block only for turns after the last user message (dropping it
  from earlier turns, as Qwen3 does), and with enable_thinking=false the generation prompt carries an
  empty think block.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from surogate_jax.config import DataConfig, DatasetConfig
from surogate_jax.data import build_datasets

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

QWEN3 = r"""
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- set content = m.content if m.content is string else '' -%}
  {%- if m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if not reasoning and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "user assistant system tool: what is the answer? The answer is 42.",
    "Translate to French: good morning. Bonjour. Let me think about it step by step.",
    "def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9",
] * 20


@functools.cache
def _backend_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<think>", "</think>"])
    return tok.to_str()


def make_tokenizer(chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A fresh tokenizer object (tests may monkeypatch it): eos <|im_end|>, pad <|endoftext|>."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_backend_json()), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=chat_template)


def save_tokenizer(path: Path, chat_template: str | None = CHATML) -> Path:
    make_tokenizer(chat_template).save_pretrained(path)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_config(*datasets, validation=(), ratio=0.0, **kw) -> DataConfig:
    """DataConfig from dataset entries (paths or dicts); no validation split unless asked."""
    def entries(ds):
        return tuple(DatasetConfig(**{**d, "path": str(d["path"])}) if isinstance(d, dict)
                     else DatasetConfig(path=str(d)) for d in ds)

    return DataConfig(datasets=entries(datasets), validation_datasets=entries(validation),
                      validation_split_ratio=ratio, **kw)


def build(tokenizer, *datasets, sequence_len=64, cache_dir=None, seed=0, mode="sft", **kw):
    """build_datasets on a DataConfig made by data_config(*datasets, **kw)."""
    return build_datasets(data_config(*datasets, **kw), tokenizer, sequence_len=sequence_len,
                          cache_dir=cache_dir, seed=seed, mode=mode)


def docs_text(tokenizer, docs) -> list[str]:
    """Every document decoded back to text."""
    return [tokenizer.decode(docs.doc(d)[0].tolist()) for d in range(len(docs))]


def supervised_text(tokenizer, docs, d: int) -> str:
    ids, mask = docs.doc(d)
    return tokenizer.decode(ids[mask].tolist())
