"""Local JSON data is read row by row with the `json` module: no row is lost or changed because of
another row's types, and bad bytes cost only their own row (json) or are one clear error (csv/txt)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from tiny_tokenizers import build, save_tokenizer, supervised_text, write_jsonl

from surogate_jax.config import DatasetConfig
from surogate_jax.data import DataError
from surogate_jax.data.sources import resolve

BAD = b"\xff\xfe"  # never valid UTF-8


def chat(q, a) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def load(path):
    rows = resolve(DatasetConfig(path=str(path))).load()
    return rows, rows.chunk(0, len(rows))


def test_one_row_with_content_parts_loses_no_string_row(tmp_path, tok):
    rows = [chat(f"what is {i} + 1?", str(i % 9 + 1)) for i in range(4000)]
    rows[1234] = chat([{"type": "text", "text": "what is 1 + 1?"}], [{"type": "text", "text": "2"}])
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    _, loaded = load(f)
    answers = [r["messages"][1]["content"] for r in loaded]
    assert answers[:3] == ["1", "2", "3"] and sum(isinstance(a, str) for a in answers) == 3999
    train, _ = build(tok, f, dataloader_num_workers=1)
    assert train.stats["rows_read"] == 4000 and train.stats["rows_skipped"] == 0 and len(train) == 4000
    assert supervised_text(tok, train, 1) == "2<|im_end|>\n"
    assert supervised_text(tok, train, 1234) == "2<|im_end|>\n"


def test_mixed_types_per_field_reach_the_formatter_unchanged(tmp_path, tok):
    rows = [chat("q0", "a string"), chat("q1", [{"type": "text", "text": "parts"}]), chat("q2", 7),
            {"question": "q3", "answer": 3, "extra": None}]
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    got, loaded = load(f)
    assert loaded == rows and got.columns == ["messages", "question", "answer", "extra"]
    train, _ = build(tok, f)
    assert len(train) == 2 and train.stats["rows_skipped"] == 2
    assert train.stats["skip_reasons"] == {"a message content is neither a string nor a list of text parts": 1,
                                           "missing field 'messages'": 1}
    assert [supervised_text(tok, train, d) for d in range(2)] == ["a string<|im_end|>\n", "parts<|im_end|>\n"]


def test_json_array_file(tmp_path):
    rows = [{"text": "a"}, {"text": ["b"]}, {"text": 3}]
    f = tmp_path / "arr.json"
    f.write_text(json.dumps(rows + [[1, 2], "x"], indent=2))
    got, loaded = load(f)
    assert loaded == rows and dict(got.unparsed) == {"row is not a JSON object": 2}


def test_single_object_file_pretty_or_compact(tmp_path):
    row = {"question": "q", "answer": "2", "meta": {"n": [1, "2"]}}
    for name, text in (("pretty.json", json.dumps(row, indent=2)), ("compact.json", json.dumps(row))):
        (tmp_path / name).write_text(text)
        got, loaded = load(tmp_path / name)
        assert loaded == [row] and not got.unparsed, name


def test_blank_lines_bom_and_crlf_are_not_rows(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\r\n\r\n   \n{"text": "b"}\n\n')
    got, loaded = load(f)
    assert loaded == [{"text": "a"}, {"text": "b"}] and not got.unparsed


def test_malformed_first_line_costs_only_that_row(tmp_path):
    f = tmp_path / "m.json"
    f.write_text('{"text": "a",\n{"text": "b"}\n{"text": "c"}\n[1]\n')
    got, loaded = load(f)
    assert loaded == [{"text": "b"}, {"text": "c"}]
    assert dict(got.unparsed) == {"malformed JSON line": 1, "row is not a JSON object": 1}


def test_broken_json_array_names_the_file_and_position(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text('[\n  {"text": "a"},\n  {"text": "b",}\n]\n')
    with pytest.raises(DataError, match=r"broken\.json: not valid JSON \(.* at line 3, column"):
        load(f)


def test_non_utf8_json_lines_are_counted_with_the_first_line(tmp_path, tok):
    lines = [json.dumps({"text": f"doc {i}"}).encode() for i in range(10)]
    for i in (6, 8):  # lines 7 and 9
        lines[i] = b'{"text": "bad ' + BAD + b'"}'
    f = tmp_path / "u.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    got, loaded = load(f)
    assert [r["text"] for r in loaded] == [f"doc {i}" for i in (0, 1, 2, 3, 4, 5, 7, 9)]
    assert dict(got.unparsed) == {"not valid UTF-8 (first at line 7)": 2}
    train, _ = build(tok, {"path": f, "type": "text"})
    assert len(train) == 8 and train.stats["rows_read"] == 10
    assert train.stats["skip_reasons"] == {"not valid UTF-8 (first at line 7)": 2}


def test_non_utf8_row_in_a_json_array_costs_only_that_row(tmp_path):
    f = tmp_path / "u.json"
    f.write_bytes(b'[\n {"text": "a"},\n {"text": "b' + BAD + b'"},\n {"text": "c"}\n]\n')
    got, loaded = load(f)
    assert loaded == [{"text": "a"}, {"text": "c"}] and dict(got.unparsed) == {"not valid UTF-8 (first at line 3)": 1}


def test_lone_surrogate_escapes_cost_only_their_row(tmp_path, tok):
    f = tmp_path / "s.jsonl"
    f.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "bad \\ud800"}\n{"text": "fine"}\n')
    train, _ = build(tok, {"path": f, "type": "text"})
    assert len(train) == 2 and train.stats["skip_reasons"] == {
        "lone UTF-16 surrogate escape in a string (first at line 2)": 1}
    g = tmp_path / "s.json"
    g.write_text('[{"text": "a"}, {"text": "b \\udc00"}]')
    got, loaded = load(g)
    assert loaded == [{"text": "a"}] and list(got.unparsed.values()) == [1]
    assert "first at item 2" in next(iter(got.unparsed))


def test_every_row_not_utf8_is_a_data_error(tmp_path, tok):
    f = tmp_path / "all_bad.jsonl"
    f.write_bytes(b'{"text": "' + BAD + b'"}\n')
    with pytest.raises(DataError, match=r"no usable rows \(all 1 skipped\).*not valid UTF-8 \(first at line 1\)"):
        build(tok, {"path": f, "type": "text"})


@pytest.mark.parametrize("name, data, line", [("u.csv", b"question,answer\nq1,a1\nq2,a" + BAD + b"\n", 3),
                                              ("u.txt", b"first line\nsecond " + BAD + b" line\n", 2)])
def test_non_utf8_csv_and_txt_are_a_data_error_naming_the_file(tmp_path, name, data, line):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path / name))}: not UTF-8 text "
                                        rf"\(first invalid byte on line {line}\)"):
        load(tmp_path / name)


def test_non_utf8_parquet_string_is_a_data_error_naming_the_file(tmp_path, tok):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = pa.py_buffer(np.array([0, 4, 9], np.int32).tobytes())
    text = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"goodb" + BAD + b"ad")])
    pq.write_table(pa.table({"text": text}), tmp_path / "u.parquet")  # Arrow writes the bytes unvalidated
    with pytest.raises(DataError, match=r"u\.parquet: not UTF-8 text \(first invalid string in row 2\)"):
        build(tok, tmp_path / "u.parquet")


def test_directory_of_jsonl_names_the_file_of_the_first_non_utf8_line(tmp_path):
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "a"}])
    (tmp_path / "d" / "b.jsonl").write_bytes(b'{"text": "b"}\n{"text": "' + BAD + b'"}\n')
    got, loaded = load(tmp_path / "d")
    assert loaded == [{"text": "a"}, {"text": "b"}]
    assert dict(got.unparsed) == {f"not valid UTF-8 (first at line 2 of {(tmp_path / 'd' / 'b.jsonl').resolve()})": 1}


def test_tokenize_cli_non_utf8_csv_is_one_error_line(tmp_path):
    save_tokenizer(tmp_path / "tok")
    (tmp_path / "qa.csv").write_bytes(b"question,answer\nwhat is 1?,it is 1\nwhat is 2?,it is " + BAD + b"\n")
    (tmp_path / "cfg.yaml").write_text("model: tok\nsequence_len: 64\noutput_dir: out\ndatasets:\n  - path: qa.csv\n")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1",
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "surogate_jax.tokenize", "cfg.yaml"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0]
    assert errors[0] == "error: qa.csv: not UTF-8 text (first invalid byte on line 3); re-save it as UTF-8"
