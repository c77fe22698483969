"""Where a dataset's rows come from: a local file or directory, or a Hugging Face Hub dataset.

`DatasetConfig.path` is, in order: an existing local file (.jsonl/.json/.parquet/.csv/.txt; a .txt
file is one row per line with the field "text"), an existing local directory of such files (one
format per directory), or otherwise a Hub id loaded with `subset`/`split` (needs the network or
HF's local cache). `samples` keeps the first N rows.

Local .json/.jsonl files are read with the `json` module, never through HF `datasets`: Arrow infers
one schema per file, which silently changes values (a string "2" becomes the int 2 once another row
has a list where this one has a string) and so loses valid rows. Each row reaches the formatter
exactly as parsed and the formatter decides per row. A file is a JSON array of rows, one object
(pretty-printed or not), or JSON lines, streamed line by line. A JSON line that is not valid UTF-8
or not valid JSON, or a value that is not an object, is one skipped row, counted with its reason
(`Rows.unparsed`; the UTF-8 reason names the first such line); a broken JSON array is a DataError.
Parquet/csv/txt files go through `datasets` (memory-mapped Arrow); one that is not UTF-8 is a
DataError naming the file (and line, for csv/txt).

`Source.fingerprint()` is what the tokenization cache keys on: size + mtime of every local file, or
the Hub dataset's own `datasets` fingerprint.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import DatasetConfig
from .docs import DataError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class Rows:
    """The rows of one dataset: `len`, `chunk(a, b)` -> list of dicts, `columns`, and the count of
    rows that could not even be parsed (`unparsed`, reason -> count). `name` is for error messages."""

    def __init__(self, data: Any, columns: list[str], unparsed: Counter | None = None, name: str = "the dataset"):
        self._data = data  # a datasets.Dataset or a list of dicts
        self.columns = columns
        self.unparsed = unparsed or Counter()
        self.name = name

    def __len__(self) -> int:
        return len(self._data)

    def head(self, n: int) -> Rows:
        if n >= len(self):
            return self
        data = self._data[:n] if isinstance(self._data, list) else self._data.select(range(n))
        return Rows(data, self.columns, self.unparsed, self.name)

    def chunk(self, a: int, b: int) -> list[dict]:
        if isinstance(self._data, list):
            return self._data[a:b]
        try:
            cols = self._data[a:b]  # datasets returns a dict of column lists
        except UnicodeDecodeError:  # Arrow keeps unvalidated bytes (parquet, Hub data) until they are read
            row = self._first_undecodable(a, b) + 1
            raise DataError(f"{self.name}: not UTF-8 text (first invalid string in row {row}); "
                            "re-save it as UTF-8") from None
        keys = list(cols)
        return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))]

    def _first_undecodable(self, a: int, b: int) -> int:
        for i in range(a, min(b, len(self))):
            try:
                self._data[i]
            except UnicodeDecodeError:
                return i
        return a


@dataclass
class Source:
    cfg: DatasetConfig
    files: tuple[Path, ...] = ()  # empty: a Hub dataset
    builder: str | None = None
    _rows: Rows | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.cfg.path

    def fingerprint(self) -> dict:
        if self.files:
            return {"files": [[str(f), st.st_size, st.st_mtime_ns] for f in self.files for st in [f.stat()]]}
        return {"hub": self.cfg.path, "subset": self.cfg.subset, "split": self.cfg.split,
                "fingerprint": getattr(self.load()._data, "_fingerprint", None)}

    def load(self) -> Rows:
        """All rows (before `samples`); cached, so fingerprint() and tokenization share one load."""
        if self._rows is None:
            self._rows = _load_local(self) if self.files else _load_hub(self.cfg)
        return self._rows


def resolve(cfg: DatasetConfig) -> Source:
    """Finds the files of a dataset entry (nothing is read yet); DataError when there are none."""
    path = cfg.path
    if path.startswith(("s3://", "gs://")):
        raise DataError(f"{path}: s3:// and gs:// datasets are not supported yet "
                        "(download the files and use a local path)")
    p = Path(path).expanduser()
    if p.is_file():
        builder = BUILDERS.get(p.suffix.lower())
        if builder is None:
            raise DataError(f"{path}: unsupported file type {p.suffix!r}; use one of {sorted(BUILDERS)}")
        return Source(cfg, (p.resolve(),), builder)
    if p.is_dir():
        files = sorted(f.resolve() for f in p.rglob("*") if f.is_file() and f.suffix.lower() in BUILDERS
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise DataError(f"{path}: the directory has no {'/'.join(sorted(BUILDERS))} files")
        builders = {BUILDERS[f.suffix.lower()] for f in files}
        if len(builders) > 1:
            raise DataError(f"{path}: the directory mixes file formats ({', '.join(sorted(builders))}); "
                            "use one format per dataset entry")
        return Source(cfg, tuple(files), builders.pop())
    if not HUB_ID.match(path) or p.suffix.lower() in BUILDERS:
        raise DataError(f"{path}: no such file or directory")
    return Source(cfg)  # a Hub id: loading tells whether it exists


def _load_local(src: Source) -> Rows:
    if src.builder == "json":
        return _JsonReader(src.files).read(src.name)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{src.name}: reading {src.builder} files needs the `datasets` package "
                        "(pip install datasets)") from None

    files = [str(f) for f in src.files]
    reader_log = logging.getLogger(f"datasets.packaged_modules.{src.builder}.{src.builder}")
    reader_log.addFilter(_drop_read_failures)
    try:
        ds = datasets.load_dataset(src.builder, data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure is the user's data to fix
        if _is_decode_error(e):
            raise DataError(_not_utf8(src)) from None
        raise DataError(f"{src.name}: cannot read {src.builder} data: {_reason(e)}") from None
    finally:
        reader_log.removeFilter(_drop_read_failures)
    return Rows(ds, list(ds.column_names), name=src.name)


def _drop_read_failures(record: logging.LogRecord) -> bool:
    """`datasets` logs a reader failure and then raises it; our DataError says it once, on one line."""
    return not record.getMessage().startswith("Failed to read file")


def _is_decode_error(e: BaseException) -> bool:
    """A UnicodeDecodeError anywhere in the cause chain, or Arrow's invalid-UTF-8 error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, UnicodeDecodeError) or re.search(r"invalid utf-?8", str(e), re.IGNORECASE):
            return True
        e = e.__cause__ or e.__context__
    return False


def _not_utf8(src: Source) -> str:
    """The DataError message for a text file that does not decode, naming the file and line."""
    if src.builder in ("csv", "text"):
        for f in src.files:
            line = _first_bad_utf8_line(f)
            if line is not None:
                where = src.name if len(src.files) == 1 else f
                return f"{where}: not UTF-8 text (first invalid byte on line {line}); re-save it as UTF-8"
    return f"{src.name}: the {src.builder} data is not valid UTF-8 text; re-save it as UTF-8"


def _first_bad_utf8_line(f: Path) -> int | None:
    with f.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return lineno
    return None


# --- JSON and JSON lines: the json module, row by row -------------------------------------------

BOM = b"\xef\xbb\xbf"
NOT_OBJECT = "row is not a JSON object"
MALFORMED = "malformed JSON line"
NOT_UTF8 = "not valid UTF-8"
LONE_SURROGATE = "lone UTF-16 surrogate escape in a string"  # tokenizers reject such strings
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a cheap pre-check before walking a parsed row


class _JsonReader:
    """Reads JSON files into `rows` (dicts exactly as parsed) and counts what is not a row in `bad`;
    the reasons for bad text name where it first occurs."""

    def __init__(self, files: tuple[Path, ...]):
        self.files = files
        self.rows: list[dict] = []
        self.bad: Counter = Counter()
        self.first: dict[str, str] = {}  # reason -> where it first occurred

    def read(self, name: str) -> Rows:
        for f in self.files:
            if _is_json_document(f):
                self._document(f)
            else:
                self._lines(f)
        for reason, where in self.first.items():
            self.bad[f"{reason} (first at {where})"] = self.bad.pop(reason)
        columns = list(dict.fromkeys(k for r in self.rows for k in r))
        return Rows(self.rows, columns, self.bad, name)

    def _skip(self, reason: str, f: Path, where: str) -> None:
        self.bad[reason] += 1
        self.first.setdefault(reason, where + (f" of {f}" if len(self.files) > 1 else ""))

    def _add(self, item: Any) -> None:
        if isinstance(item, dict):
            self.rows.append(item)
        else:
            self.bad[NOT_OBJECT] += 1

    def _lines(self, f: Path) -> None:
        """JSON lines, streamed: one row per non-blank line; a bad line costs only that row."""
        with f.open("rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if lineno == 1:
                    raw = raw.removeprefix(BOM)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    self._skip(NOT_UTF8, f, f"line {lineno}")
                    continue
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    self.bad[MALFORMED] += 1
                    continue
                if SURROGATE_ESCAPE.search(line) and _has_surrogates(item):
                    self._skip(LONE_SURROGATE, f, f"line {lineno}")
                    continue
                self._add(item)

    def _document(self, f: Path) -> None:
        """One JSON document: an array of rows or a single (pretty-printed) object."""
        data = f.read_bytes().removeprefix(BOM)
        bad_at = None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            bad_at = data.count(b"\n", 0, e.start) + 1
            # undecodable bytes become lone surrogates, so the rows around them still parse
            text = data.decode("utf-8", "surrogateescape")
        del data
        try:
            whole = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise DataError(f"{f}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
            del text
            self._lines(f)  # not one document after all: JSON lines whose first line is malformed
            return
        check = bad_at is not None or SURROGATE_ESCAPE.search(text) is not None
        del text
        for i, item in enumerate(whole if isinstance(whole, list) else [whole]):
            if check and _has_surrogates(item):
                if bad_at is not None:
                    self._skip(NOT_UTF8, f, f"line {bad_at}")
                else:
                    self._skip(LONE_SURROGATE, f, f"item {i + 1}")
            else:
                self._add(item)


def _is_json_document(f: Path) -> bool:
    """True for a JSON array file, and for an object that spans lines (its first line alone is not
    JSON); otherwise the file is read as JSON lines."""
    with f.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = (raw.removeprefix(BOM) if lineno == 1 else raw).strip()
            if not line:
                continue
            if line.startswith(b"["):
                return True
            if not line.startswith(b"{"):
                return False
            try:
                json.loads(line.decode("utf-8", "surrogateescape"))
            except json.JSONDecodeError:
                return True
            return False
    return False


SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogates(v) for v in value)
    return False


def _load_hub(cfg: DatasetConfig) -> Rows:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except Exception as e:  # noqa: BLE001 - no network, unknown id, bad split...: all the user's to fix
        raise DataError(f"{cfg.path}: no such local file or directory, and loading it from the Hugging Face "
                        f"Hub failed: {_reason(e)}") from None
    return Rows(ds, list(ds.column_names), name=cfg.path)


def _reason(e: BaseException) -> str:
    """The message of an exception and of its root cause, on one line."""
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    parts = [str(e) or type(e).__name__] + ([str(inner) or type(inner).__name__] if inner is not e else [])
    return " ".join(": ".join(parts).split())[:500]
