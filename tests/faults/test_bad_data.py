"""Bad dataset files: one line naming the file (and the row, or how many rows were skipped for
what), exit code 2, no traceback (tests/faults/conftest.py runs the CLI)."""
import json

import pytest

GOOD = {"question": "1+1=", "answer": "#### 2"}


def _jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


def _write_text(path, text):
  path.write_text(text)
  return str(path)


def _write_bytes(path, data):
  path.write_bytes(data)
  return str(path)


# name -> (make the file at a path: its path, the config overrides, the message)
CASES = {
    "missing.jsonl": (str, [], "config.data.train_path: {path}: no such file"),
    "empty.jsonl": (lambda p: _jsonl(p, []), [], "config.data.train_path: {path}: no usable rows"),
    "bad_json.jsonl": (lambda p: _jsonl(p, ["{oops"]), [],
                       "{path}: no usable rows (1 skipped: not valid JSON, first {path}:1 "
                       "(Expecting property name enclosed in double quotes))"),
    "no_field.jsonl": (lambda p: _jsonl(p, [{"q": "1+1=", "answer": "#### 2"}]), [],
                       "{path}: no usable rows (1 skipped: field 'question': missing, first "
                       "{path}:1)"),
    "too_long.jsonl": (lambda p: _jsonl(p, [{**GOOD, "question": "x" * 300}] * 20), [],
                       "{path}: no usable rows (20 skipped: prompt longer than "
                       "data.max_prompt_tokens=12, first {path}:1 (301 > 12))"),
    "not_object.jsonl": (lambda p: _jsonl(p, ["[1, 2]"]), [],
                         "{path}: no usable rows (1 skipped: not a JSON object, first "
                         "{path}:1 (got list))"),
    "strict.jsonl": (lambda p: _jsonl(p, [GOOD] * 30 + ["{oops"]),
                     ["--config.data.on_bad_row=error"], "strict.jsonl:31: not valid JSON"),
    "data.csv": (lambda p: _write_text(p, "question,answer\n1+1=,2\n"), [],
                 "data.csv: unknown file type; expected .jsonl, .json or .parquet"),
    "broken.parquet": (lambda p: _write_text(p, "not parquet"), [],
                       "broken.parquet: cannot read parquet"),
    "latin1.jsonl": (lambda p: _write_bytes(p, json.dumps({**GOOD, "question": "caf\u00e9"},
                                                          ensure_ascii=False).encode("latin-1")),
                     [], "latin1.jsonl: not UTF-8 text"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_bad_training_file_is_one_line_and_exit_2(cli, tmp_path, name):
  make, extra, message = CASES[name]
  path = make(tmp_path / name)
  rc, line = cli(f"--config.data.train_path={path}", *extra)
  assert rc == 2 and message.format(path=path) in line, line


def test_a_held_out_file_with_no_usable_row(cli, tmp_path):
  train = _jsonl(tmp_path / "train.jsonl", [GOOD] * 40)
  held = _jsonl(tmp_path / "held.jsonl", [{**GOOD, "question": "y" * 300}] * 256)
  rc, line = cli(f"--config.data.train_path={train}", f"--config.data.heldout_path={held}")
  assert rc == 2
  assert line == (f"config.data.heldout_path: {held}: no usable rows (256 skipped: "
                  f"prompt longer than data.max_prompt_tokens=12, first {held}:1 (301 > 12))"), line
