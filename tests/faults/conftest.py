"""The fault suite: bad input a user really types, faults a run meets, and what jaxrl promises
for each (docs/reliability.md). `cli(*args)` runs the training CLI in this process on the tiny
config (fast: the checks come before any training) and returns its exit code and its one
error line, asserting there was no traceback and exactly one `jaxrl: error:` line."""
import os

import pytest

from train.cli.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)

  def run(*args, config="configs/tiny.py"):
    rc = main(["jaxrl-train", f"--config={config}", f"--config.run_dir={tmp_path / 'runs'}",
               *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("jaxrl: error:")]
    assert rc == 0 or len(lines) == 1, err[-3000:]
    return rc, lines[0][len("jaxrl: error: "):] if lines else ""
  return run
