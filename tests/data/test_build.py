"""build_datasets: sources, samples, truncation, validation, pretrain mode, caching, bad input."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest
from tiny_tokenizers import CHATML, build, data_config, docs_text, make_tokenizer, write_jsonl

from surogate_jax.data import DataError, TokenizedDocs, build_datasets
from surogate_jax.data import build as build_module

QA = [{"question": f"what is {i}?", "answer": f"it is {i}"} for i in range(12)]


def qa_text(i: int) -> str:
    return f"<|im_start|>user\nwhat is {i}?<|im_end|>\n<|im_start|>assistant\nit is {i}<|im_end|>\n"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_file_formats(tmp_path, tok, fmt):
    path = tmp_path / f"qa.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, QA)
    elif fmt == "json":
        path.write_text(json.dumps(QA))
    elif fmt == "parquet":
        pd.DataFrame(QA).to_parquet(path)
    else:
        pd.DataFrame(QA).to_csv(path, index=False)
    train, _ = build(tok, path)
    assert docs_text(tok, train) == [qa_text(i) for i in range(12)]


def test_txt_is_one_text_row_per_line(tmp_path, tok):
    (tmp_path / "t.txt").write_text("first line\nsecond line\n")
    train, _ = build(tok, tmp_path / "t.txt")
    assert docs_text(tok, train) == ["first line<|im_end|>", "second line<|im_end|>"]


def test_directory_samples_and_concatenation(tmp_path, tok):
    write_jsonl(tmp_path / "dir" / "a.jsonl", QA[:3])
    write_jsonl(tmp_path / "dir" / "b.jsonl", QA[3:6])
    (tmp_path / "dir" / "README.md").write_text("ignored")
    write_jsonl(tmp_path / "other.jsonl", QA[6:])
    train, _ = build(tok, tmp_path / "dir", {"path": tmp_path / "other.jsonl", "samples": 2})
    assert docs_text(tok, train) == [qa_text(i) for i in (0, 1, 2, 3, 4, 5, 6, 7)]
    assert train.stats["rows_read"] == 8
    assert [(d["rows_read"], d["docs"]) for d in train.stats["datasets"]] == [(6, 6), (2, 2)]


def test_truncation_is_counted_and_keeps_the_first_tokens(tmp_path, tok):
    long = {"question": "q", "answer": "the quick brown fox " * 20}
    f = write_jsonl(tmp_path / "l.jsonl", [QA[0], long])
    train, _ = build(tok, f, sequence_len=24)
    assert train.stats["truncated_docs"] == 1 and train.truncated.tolist() == [False, True]
    assert train.lengths.tolist()[1] == 24 and train.lengths[0] < 24
    full, _ = build(tok, f, sequence_len=1000)
    np.testing.assert_array_equal(train.doc(1)[0], full.doc(1)[0][:24])
    # A row whose supervised part lies entirely past sequence_len has nothing to train: skipped.
    g = write_jsonl(tmp_path / "g.jsonl", [QA[0], {"question": "x " * 40, "answer": "y"}])
    train, _ = build(tok, g, sequence_len=16)
    assert len(train) == 1 and train.stats["skip_reasons"] == {"no supervised token in the first 16 tokens": 1}


def test_validation_split_is_seeded_disjoint_and_complete(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", QA)
    train, valid = build(tok, f, ratio=0.25, seed=3)
    assert (len(train), len(valid)) == (9, 3)
    assert sorted(docs_text(tok, train) + docs_text(tok, valid)) == sorted(qa_text(i) for i in range(12))
    again, valid2 = build(tok, f, ratio=0.25, seed=3)
    assert docs_text(tok, valid2) == docs_text(tok, valid)
    _, other = build(tok, f, ratio=0.25, seed=4)
    assert docs_text(tok, other) != docs_text(tok, valid)
    assert valid.stats["docs"] == 3 and train.stats["docs"] == 9 and train.stats["rows_read"] == 12
    assert build(tok, f, ratio=0.0)[1] is None


def test_validation_datasets_win_over_the_ratio(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", QA[:8])
    v = write_jsonl(tmp_path / "v.jsonl", QA[8:])
    train, valid = build(tok, f, validation=[v], ratio=0.5)
    assert docs_text(tok, train) == [qa_text(i) for i in range(8)]
    assert docs_text(tok, valid) == [qa_text(i) for i in range(8, 12)]


def test_pretrain_mode_trains_every_token(tmp_path, tok):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}])
    train, _ = build(tok, f, mode="pretrain")
    assert train.stats["supervised_tokens"] == train.stats["tokens"] - 1  # all but the first
    g = write_jsonl(tmp_path / "qa.jsonl", QA[:1])
    train, _ = build(tok, g, mode="pretrain")
    assert docs_text(tok, train) == [qa_text(0)] and train.loss_mask[1:].all()


def test_loss_scale_comes_from_the_config(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", QA[:1])
    default, _ = build(tok, f)
    everything, _ = build(tok, f, loss_scale="all")
    assert default.stats["supervised_tokens"] < everything.stats["supervised_tokens"] == everything.stats["tokens"] - 1


def test_pad_id_is_the_tokenizers(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", QA[:1])
    assert build(tok, f)[0].pad_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


# --- caching -----------------------------------------------------------------------------------

def test_second_call_loads_the_cache_without_tokenizing(tmp_path, tok, monkeypatch):
    f = write_jsonl(tmp_path / "qa.jsonl", QA)
    cache = tmp_path / "cache"
    first, _ = build(tok, f, cache_dir=cache)
    assert not first.stats["from_cache"] and len(list(cache.glob("*.npz"))) == 1
    assert not [p for p in cache.iterdir() if p.suffix != ".npz"]  # no temporary file left behind

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(type(tok), "__call__", boom)
    monkeypatch.setattr(type(tok), "apply_chat_template", boom)
    second, valid = build(tok, f, cache_dir=cache, ratio=0.25)  # the split is cut after the cache
    assert second.stats["from_cache"] and len(second) + len(valid) == len(first)
    full, _ = build(tok, f, cache_dir=cache)
    for name in ("tokens", "loss_mask", "offsets", "truncated"):
        np.testing.assert_array_equal(getattr(full, name), getattr(first, name))
    assert full.pad_id == first.pad_id and full.stats["docs"] == first.stats["docs"]


@pytest.mark.parametrize("change", ["file", "sequence_len", "template", "loss_scale", "mode", "dataset_key"])
def test_cache_misses_when_an_input_changes(tmp_path, tok, change):
    f = write_jsonl(tmp_path / "qa.jsonl", QA)
    cache = tmp_path / "cache"
    build(tok, f, cache_dir=cache)
    kw = {"cache_dir": cache}
    entry = {"path": f}
    if change == "file":
        write_jsonl(f, QA[:5])
        os.utime(f, ns=(1, 1))
    elif change == "sequence_len":
        kw["sequence_len"] = 63
    elif change == "template":
        tok = make_tokenizer(CHATML.replace("<|im_start|>'", "<|im_start|> '"))
    elif change == "loss_scale":
        kw["loss_scale"] = "all"
    elif change == "mode":
        kw["mode"] = "pretrain"
    else:
        entry["samples"] = 100
    docs, _ = build(tok, entry, **kw)
    assert not docs.stats["from_cache"] and len(list(cache.glob("*.npz"))) == 2


def test_a_corrupt_cache_file_is_rebuilt(tmp_path, tok):
    f = write_jsonl(tmp_path / "qa.jsonl", QA)
    first, _ = build(tok, f, cache_dir=tmp_path / "c")
    (cache_file,) = (tmp_path / "c").glob("*.npz")
    cache_file.write_bytes(b"garbage")
    again, _ = build(tok, f, cache_dir=tmp_path / "c")
    assert not again.stats["from_cache"] and len(again) == len(first)
    assert build(tok, f, cache_dir=tmp_path / "c")[0].stats["from_cache"]


# --- bad input ---------------------------------------------------------------------------------

def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file or directory"):
        build(tok, tmp_path / "missing.jsonl")


def test_hub_failure_says_both_what_was_tried_and_why(tok, monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match="someone/some_set: no such local file or directory, and loading it from "
                                        "the Hugging Face Hub failed: no network"):
        build(tok, "someone/some_set")


def test_empty_file(tmp_path, tok):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match=r"e\.jsonl: the dataset is empty"):
        build(tok, tmp_path / "e.jsonl")


def test_no_rows_left_names_the_dataset_and_fields(tmp_path, tok):
    rows = [{"instruction": "a", "output": None}, {"instruction": None, "output": "b"}]
    f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl: no usable rows \(all 2 skipped\); it was read as instruction and "
                                        r"looked for the fields \['instruction', 'output'\]; reasons: missing field"):
        build(tok, f)


def test_malformed_json_lines_are_counted(tmp_path, tok):
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps(QA[0]) + "\n{not json\n[1, 2]\n" + json.dumps(QA[1]) + "\n")
    train, _ = build(tok, f)
    assert len(train) == 2 and train.stats["rows_read"] == 4 and train.stats["rows_skipped"] == 2
    assert train.stats["skip_reasons"] == {"malformed JSON line": 1, "row is not a JSON object": 1}


def test_chats_need_a_chat_template(tmp_path):
    f = write_jsonl(tmp_path / "qa.jsonl", QA[:1])
    with pytest.raises(DataError, match="need a chat template"):
        build(make_tokenizer(None), f)
    train, _ = build(make_tokenizer(None), write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}]))
    assert len(train) == 1


def test_bad_mode(tmp_path, tok):
    with pytest.raises(ValueError, match="mode"):
        build_datasets(data_config("x"), tok, sequence_len=8, cache_dir=None, seed=0, mode="dpo")


def test_tokenizers_without_offsets_encode_segment_by_segment(tmp_path, tok, monkeypatch):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b"},
                          {"role": "user", "content": "again?"}, {"role": "assistant", "content": "yes"}]}]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    fast, _ = build(tok, f)
    monkeypatch.setattr(type(tok), "is_fast", property(lambda self: False))
    slow, _ = build(tok, f)
    np.testing.assert_array_equal(slow.tokens, fast.tokens)
    np.testing.assert_array_equal(slow.loss_mask, fast.loss_mask)


# --- worker pool -------------------------------------------------------------------------------

def test_worker_processes_give_the_same_documents(tmp_path, tok, monkeypatch):
    rows = QA * 30 + [{"question": None, "answer": "x"}]
    f = write_jsonl(tmp_path / "qa.jsonl", rows)
    serial, _ = build(tok, f, dataloader_num_workers=1)
    monkeypatch.setattr(build_module, "PARALLEL_MIN_ROWS", 1)
    monkeypatch.setattr(build_module, "CHUNK_ROWS", 50)
    parallel, _ = build(tok, f, dataloader_num_workers=2)
    for name in ("tokens", "loss_mask", "offsets"):
        np.testing.assert_array_equal(getattr(parallel, name), getattr(serial, name))
    assert parallel.stats["rows_skipped"] == serial.stats["rows_skipped"] == 1


def test_tokenized_docs_select_and_concat():
    a = TokenizedDocs.from_docs([([1, 2, 3], [1, 1, 1]), ([4, 5], [0, 1])], pad_id=9)
    b = TokenizedDocs.from_docs([([6], [1])], truncated=[True])
    assert a.loss_mask.tolist() == [False, True, True, False, True]  # first token of a doc is never a target
    c = TokenizedDocs.concat([a, b])
    assert c.tokens.tolist() == [1, 2, 3, 4, 5, 6] and c.offsets.tolist() == [0, 3, 5, 6] and c.pad_id == 9
    s = c.select(np.array([2, 0]))
    assert s.tokens.tolist() == [6, 1, 2, 3] and s.offsets.tolist() == [0, 1, 4]
    assert s.truncated.tolist() == [True, False] and s.stats["docs"] == 2 and s.stats["truncated_docs"] == 1
