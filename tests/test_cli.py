"""Every CLI's --help, and bad flags as one line with exit code 2; pass@k against hand-computed
cases (jaxrl-eval's own run against a training run is in test_e2e)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from train.cli import evaluate, export, plan, sample, train
from jaxrl.data.tasks import Example
from train.task.heldout import Evaluation, pass_at_k

MAINS = {"jaxrl-train": train.main, "jaxrl-eval": evaluate.main, "jaxrl-plan": plan.main,
         "jaxrl-export": lambda argv: export.main(argv[1:]),
         "jaxrl-sample": lambda argv: sample.main(argv[1:])}


def _call(main, argv) -> int:
  try:
    return main(argv)
  except SystemExit as e:  # argparse exits itself
    return e.code


@pytest.mark.parametrize("name", sorted(MAINS))
def test_help(name, capsys):
  assert _call(MAINS[name], [name, "--help"]) == 0
  out = capsys.readouterr().out
  assert "--" in out and len(out.splitlines()) > 3, out


@pytest.mark.parametrize("name, argv, message", [
    ("jaxrl-train", ["--nope=1"], "Unknown command line flag 'nope'"),
    ("jaxrl-eval", ["--model", "x", "--n", "2"], "--model: expected a Hugging Face directory "
                                                 "or RUN/checkpoints/STAGE[/STEP], got '"),
    ("jaxrl-eval", ["--n", "2"], "--model: required"),
    ("jaxrl-export", ["--checkpoint", "a"], "jaxrl-export: the following arguments are "
                                            "required: --out"),
    ("jaxrl-sample", ["--model", "m", "--prompt", "p", "--n", "two"],
     "jaxrl-sample: argument --n: invalid int value: 'two'"),
    ("jaxrl-plan", ["--top", "x"], "jaxrl-plan: argument --top: invalid int value: 'x'"),
])
def test_bad_flags_one_line_exit_2(name, argv, message, capsys):
  assert _call(MAINS[name], [name, *argv]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err, err


def test_eval_flag_errors(tmp_path, capsys):
  """The eval's own flags are checked before a model loads (the run dir is a real one)."""
  run = tmp_path / "run"
  (run / "checkpoints" / "rl").mkdir(parents=True)
  (run / "config.json").write_text("{}")
  model = str(run / "checkpoints" / "rl")
  for argv, message in [(["--n", "4"], "--n: greedy decoding (--temperature 0) gives one "
                                       "completion per prompt, got 4"),
                        (["--n", "4", "--temperature", "1", "--k", "8"],
                         "--k: expected each k in [1, n=4], got [8]"),
                        (["--config.data.nope=1"], "config.data.nope: unknown field"),
                        (["--config=a.py", "--config=b.py"], "--config: given 2 times")]:
    assert evaluate.main(["jaxrl-eval", "--model", model, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
  # the run dir itself (its config.json is jaxrl's, not a Hugging Face one): where to point
  for name in ("jaxrl-eval", "jaxrl-sample", "jaxrl-export"):
    flag = "--checkpoint" if name == "jaxrl-export" else "--model"
    extra = {"jaxrl-eval": [], "jaxrl-sample": ["--prompt", "p"], "jaxrl-export": ["--out", "o"]}
    assert _call(MAINS[name], [name, flag, str(run), *extra[name]]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxrl: error: {flag}: {run} is a jaxrl run directory, not a checkpoint: "
                   f"pass {run}/checkpoints/STAGE (its stages: rl)\n"), err


def test_console_script_installed():
  """`pip install -e .` put the entry point next to this Python."""
  script = os.path.join(os.path.dirname(sys.executable), "jaxrl-eval")
  proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0 and "--temperature" in proc.stdout


def test_pass_at_k_hand_computed():
  # n=5 samples, 2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10;
  # pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10; pass@4: fewer than 4 wrong ones, so 1.
  assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
  assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
  assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
  assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0
  with pytest.raises(ValueError, match="k=6"):
    pass_at_k(5, 2, 6)


def test_summary_hand_computed():
  # Two prompts x 4 samples: the first solved by 1 sample, the second by 3 (one of them
  # scoring 1.5, a user reward above the threshold); 0.5 is below it.
  scores = np.array([[0, 1, 0, 0.5], [1, 1.5, 0, 1]])
  lengths = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  ev = Evaluation([Example("a", "x"), Example("b", "y")], scores, lengths,
                  [["p", "q", "r", "s"], ["t", "u", "v", "w"]])
  got = ev.summary(ks=(1, 2, 4))
  assert got["accuracy"] == 0.5 and got["reward_mean"] == pytest.approx(5 / 8)
  # pass@2: prompt a 1 - C(3,2)/C(4,2) = 0.5, prompt b 1 - 0 = 1
  assert got["pass@1"] == pytest.approx((0.25 + 0.75) / 2)
  assert got["pass@2"] == pytest.approx((0.5 + 1.0) / 2)
  assert got["pass@4"] == 1.0 and got["response_len"] == 4.5
  rows = list(ev.records())
  assert len(rows) == 8 and rows[5] == {"example": 1, "sample": 1, "prompt": "b", "answer": "y",
                                        "completion": "u", "score": 1.5, "tokens": 6}
