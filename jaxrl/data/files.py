"""Rows of dataset files: JSON lines (`.jsonl`, or `.json` as `datasets.Dataset.to_json` writes
them; a `.json` array also works) or parquet; a path may be a glob (`data/train-*.parquet`).

Rows are numbered from 1 (the line number for JSON lines) and named `FILE:ROW`; a row that does
not parse comes as a `BadRow`, so the reader's bad-row policy (sources.py) decides, while a file
that cannot be read at all is a `DataError`.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any


class DataError(ValueError):
  """A dataset problem; the message is one line naming the file and row, or the option."""


class BadRow(Exception):
  def __init__(self, reason: str, detail: str = ""):
    super().__init__(reason)
    self.reason, self.detail = reason, detail


def _paths(path: str) -> list[str]:
  paths = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
  if not paths or not all(os.path.isfile(p) for p in paths):
    raise DataError(f"{path}: no such file")
  return paths


def _json_rows(path: str) -> Iterator[tuple[str, Any]]:
  with open(path, encoding="utf-8") as f:
    try:
      if path.endswith(".json") and f.read(4096).lstrip().startswith("["):
        f.seek(0)
        try:
          rows = json.load(f)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        yield from ((f"{path}:{n}", row) for n, row in enumerate(rows, 1))
        return
      f.seek(0)
      for n, line in enumerate(f, 1):  # splits at \n only, not at U+2028 inside strings
        if line.strip():
          try:
            yield f"{path}:{n}", json.loads(line)
          except json.JSONDecodeError as e:
            yield f"{path}:{n}", BadRow("not valid JSON", f" ({e.msg})")
    except UnicodeDecodeError:
      raise DataError(f"{path}: not UTF-8 text") from None


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
  import pyarrow.parquet as pq  # only parquet datasets need it

  try:
    batches = pq.ParquetFile(path).iter_batches(batch_size=8192)
    n = 0
    for batch in batches:
      for row in batch.to_pylist():
        n += 1
        yield f"{path}:{n}", row
  except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) for a damaged file
    raise DataError(f"{path}: cannot read parquet ({str(e).splitlines()[0]})") from None


def read_rows(path: str) -> Iterator[tuple[str, dict | BadRow]]:
  """('FILE:ROW', row) for every row of every file `path` names; unreadable rows come as a
  `BadRow` so that the caller's bad-row policy decides."""
  for p in _paths(path):
    if p.endswith((".jsonl", ".json")):
      rows = _json_rows(p)
    elif p.endswith(".parquet"):
      rows = _parquet_rows(p)
    else:
      raise DataError(f"{p}: unknown file type; expected .jsonl, .json or .parquet")
    for where, row in rows:
      if not isinstance(row, (dict, BadRow)):
        row = BadRow("not a JSON object", f" (got {type(row).__name__})")
      yield where, row
