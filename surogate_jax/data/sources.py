"""Where a dataset's rows come from: a local file or directory, or a Hugging Face Hub dataset.

`DatasetConfig.path` is, in order: an existing local file (.jsonl/.json/.parquet/.csv/.txt; a .txt
file is one row per line with the field "text"), an existing local directory of such files (one
format per directory), or otherwise a Hub id loaded with `subset`/`split` (needs the network or
HF's local cache). Local files go through HF `datasets` (memory-mapped Arrow), except that a JSON
file whose rows Arrow cannot put in one schema (say, a field that is a string in one row and a list
in another) is read with the `json` module instead, so such rows reach the formatter and are
skipped and counted there rather than failing the whole file. `samples` keeps the first N rows.

`Source.fingerprint()` is what the tokenization cache keys on: size + mtime of every local file, or
the Hub dataset's own `datasets` fingerprint.
"""

from __future__ import annotations

import json
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
    rows that could not even be parsed (`unparsed`, reason -> count)."""

    def __init__(self, data: Any, columns: list[str], unparsed: Counter | None = None):
        self._data = data  # a datasets.Dataset or a list of dicts
        self.columns = columns
        self.unparsed = unparsed or Counter()

    def __len__(self) -> int:
        return len(self._data)

    def head(self, n: int) -> Rows:
        if n >= len(self):
            return self
        data = self._data[:n] if isinstance(self._data, list) else self._data.select(range(n))
        return Rows(data, self.columns, self.unparsed)

    def chunk(self, a: int, b: int) -> list[dict]:
        if isinstance(self._data, list):
            return self._data[a:b]
        cols = self._data[a:b]  # datasets returns a dict of column lists
        keys = list(cols)
        return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))]


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
    try:
        import datasets
    except ImportError:  # JSON needs only the json module (e.g. a GPU image without `datasets`)
        if src.builder == "json":
            return _read_json(src.files)
        raise DataError(f"{src.name}: reading {src.builder} files needs the `datasets` package "
                        "(pip install datasets)") from None

    files = [str(f) for f in src.files]
    try:
        ds = datasets.load_dataset(src.builder, data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - any reader failure is reported or worked around below
        if src.builder == "json":
            return _read_json(src.files)
        raise DataError(f"{src.name}: cannot read {src.builder} data: {_reason(e)}") from None
    return Rows(ds, list(ds.column_names))


def _read_json(files: tuple[Path, ...]) -> Rows:
    """JSON array or JSON lines with the `json` module; unparsable lines are counted, not fatal."""
    rows: list[dict] = []
    bad: Counter = Counter()
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        items = whole if isinstance(whole, list) else [whole] if isinstance(whole, dict) else None
        if items is None:
            items = []
            for line in text.splitlines():
                if not line.strip():
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError:
                    bad["malformed JSON line"] += 1
        for item in items:
            if isinstance(item, dict):
                rows.append(item)
            else:
                bad["row is not a JSON object"] += 1
    columns = sorted({k for r in rows for k in r})
    return Rows(rows, columns, bad)


def _load_hub(cfg: DatasetConfig) -> Rows:
    import datasets

    try:
        ds = datasets.load_dataset(cfg.path, cfg.subset, split=cfg.split)
    except Exception as e:  # noqa: BLE001 - no network, unknown id, bad split...: all the user's to fix
        raise DataError(f"{cfg.path}: no such local file or directory, and loading it from the Hugging Face "
                        f"Hub failed: {_reason(e)}") from None
    return Rows(ds, list(ds.column_names))


def _reason(e: BaseException) -> str:
    """The message of an exception and of its root cause, on one line."""
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    parts = [str(e) or type(e).__name__] + ([str(inner) or type(inner).__name__] if inner is not e else [])
    return " ".join(": ".join(parts).split())[:500]
