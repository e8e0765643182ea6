"""Docs that run: every command in README.md and docs/*.md that a user would copy.

Fenced blocks tagged `sh` are commands a user copies: each is checked (its program exists, each
`--flag` is one its `--help` lists, each `--config.a.b` is a config field, each file it names
exists) and then run, in this process, with small overrides where it would train for long (few
steps, the run dir in a temporary directory; `runs/NAME` is a run made first, `runs/LORA` a
LoRA one). Blocks tagged `sh hardware` need an accelerator, a cluster or weights and data not in the repo, and blocks
tagged `sh long` measure for minutes (the planner's calibration) or rewrite the docs themselves:
both are checked, not run. Renaming a documented flag, field or file fails here.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from train.cli import evaluate, export, plan, sample, train
from jaxrl.config import ExperimentConfig
from planner import scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]
BLOCK = re.compile(r"^```(sh(?: hardware| long)?)\n(.*?)^```", re.M | re.S)
TRAIN = "jaxrl-train"  # also `python -m train.cli.train`, `make run`, the launch scripts
PROGRAMS = {"jaxrl-train": TRAIN, "train.cli.train": TRAIN, "launch/tpu_pod.sh": TRAIN,
            "launch/slurm_gpu.sbatch": TRAIN, "jaxrl-eval": "jaxrl-eval",
            "train.cli.evaluate": "jaxrl-eval", "jaxrl-export": "jaxrl-export",
            "jaxrl-sample": "jaxrl-sample", "jaxrl-plan": "jaxrl-plan", "train.cli.plan": "jaxrl-plan",
            "planner.scaling": "planner.scaling"}
MAINS = {TRAIN: train.main, "jaxrl-eval": evaluate.main, "jaxrl-plan": plan.main,
         "jaxrl-export": lambda argv: export.main(argv[1:]),
         "jaxrl-sample": lambda argv: sample.main(argv[1:]),
         "planner.scaling": lambda argv: scaling.main(argv[1:])}
# Tools of the ecosystem a hardware block may use (not jaxrl's to check).
OTHERS = ("tensorboard", "gcloud", "pip", "git")


def commands(text: str):
  """(tag, command words) of each command in `text`'s sh blocks (continuations joined, comments,
  leading VAR=value assignments and the brackets of optional arguments dropped; a template's
  configs/CONFIG.py is configs/grpo_reverse.py)."""
  for tag, body in BLOCK.findall(text):
    for line in body.replace("\\\n", " ").splitlines():
      line = line.replace("configs/CONFIG.py", "configs/grpo_reverse.py")
      words = [w.strip("[]") for w in shlex.split(line, comments=True)]
      while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words = words[1:]
      if words:
        yield tag, words


ALL = [(doc, tag, words) for doc in DOCS
       for tag, words in commands(open(os.path.join(ROOT, doc), encoding="utf-8").read())]


def program(words: list[str]) -> tuple[str, list[str]]:
  """(the jaxrl program or make target, its arguments)."""
  if words[0] == "make":
    return f"make {words[1]}", [a.split("=", 1)[1] for a in words[2:] if a.startswith("ARGS=")]
  if words[0] == "sbatch":  # sbatch's own flags come before the script
    words = [w for w in words[1:] if not w.startswith("--") or "." in w.split("=")[0]]
    words = words[next(i for i, w in enumerate(words) if w.endswith(".sbatch")):]
  if words[0].endswith("python") and words[1] == "-m":
    return words[2], words[3:]
  return os.path.basename(words[0]) if "jaxrl-" in words[0] else words[0], words[1:]


def _config_field(dotted: str) -> bool:
  node = ExperimentConfig
  for name in dotted.split("."):
    fields = {f.name: f for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) \
        else {}
    if name not in fields:
      return False
    node = fields[name].default_factory if fields[name].default_factory \
        is not dataclasses.MISSING else None
  return True


def _help(name: str, capsys) -> str:
  capsys.readouterr()
  try:
    MAINS[name]([name, "--help"])
  except SystemExit:
    pass
  return capsys.readouterr().out


def _args_of(name: str, args: list[str]) -> list[str]:
  if name.startswith("make "):
    return [w for a in args for w in shlex.split(a)]
  return args


def test_every_documented_command_is_known(capsys):
  """Each sh block's program, flags, config fields and files exist."""
  assert len(ALL) > 10 and {doc for doc, _, _ in ALL} >= {"README.md", "docs/evaluation.md"}
  assert "make test" in open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
  helps = {}
  makefile = open(os.path.join(ROOT, "Makefile"), encoding="utf-8").read()
  for doc, tag, words in ALL:
    where = f"{doc}: {' '.join(words)}"
    name, args = program(words)
    if name.startswith("make "):  # `make test` is run by CI (.ci/run): this suite
      assert re.search(rf"^{name[5:]}:", makefile, re.M), where
      name = TRAIN if name == "make run" else None
    elif name in PROGRAMS:
      if "/" in name:
        assert os.access(os.path.join(ROOT, name), os.X_OK), where
      name = PROGRAMS[name]
    else:
      assert tag != "sh" and name in OTHERS, f"unknown program: {where}"
      continue
    if name is None:
      continue
    if name not in helps:
      helps[name] = _help(name, capsys)
    for arg in _args_of(f"make {words[1]}" if words[0] == "make" else name, args):
      flag = arg.split("=", 1)[0]
      if flag.startswith("--config."):
        assert _config_field(flag[len("--config."):]), f"no field {flag}: {where}"
      elif flag.startswith("--"):
        assert re.search(rf"{re.escape(flag)}\b", helps[name]), f"no flag {flag}: {where}"
      if arg.startswith("--config=") or arg.startswith("--gin_file="):
        path = arg.split("=", 1)[1]
        assert os.path.isfile(os.path.join(ROOT, path)), where


def _key(words: list[str]) -> tuple:
  name, args = program(words)
  return (PROGRAMS.get(name, name), *args)


def _what_next() -> str:
  """The README's "What next" section: the commands a newcomer copies first."""
  text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
  start = text.index("## What next")
  return text[start:text.index("\n## ", start)]


# The README's "What next" commands that run on a CPU without weights: run as written
# (test_what_next_runs_as_written), each checked against the figure the README quotes of it.
AS_WRITTEN = [words for tag, words in commands(_what_next()) if tag == "sh"]
# Each other distinct command once (`jaxrl-train X` = `python -m train.cli.train X`; the first
# doc that shows it names it), run with small overrides.
RUNNABLE = list({_key(words): (doc, words) for doc, tag, words in reversed(ALL)
                 if tag == "sh" and words[:2] != ["make", "test"]
                 and _key(words) not in {_key(w) for w in AS_WRITTEN}}.values())[::-1]


# Batches a run splits evenly on the 8 CPU devices (not for a dry run: it checks the config's own)
SMALL_BATCHES = ["--config.sft.batch_size=16", "--config.rl.prompts_per_step=8",
                 "--config.rl.group_size=2", "--config.eval.batch_size=16"]


def _runnable(doc: str, words: list[str], tmp: str) -> tuple[str, list[str]]:
  """The command as this test runs it: (program, argv) with the small overrides."""
  name, args = program([w.replace("runs/NAME", f"{tmp}/runs/NAME")
                        .replace("runs/LORA", f"{tmp}/runs/LORA") for w in words])
  if name == "make run":
    name, args = TRAIN, ["--config=configs/default.py", *_args_of("make run", args)]
  name = PROGRAMS[name]
  if name == TRAIN:
    named = any(a.startswith("--config.run_name=") for a in args)
    args = [*args, "--config.sft.steps=2", "--config.rl.steps=1", "--config.progress=False",
            "--config.task.n_heldout=16", "--config.data.heldout_size=16",
            *([] if "--dry_run" in args else SMALL_BATCHES),
            f"--config.run_dir={tmp}/runs",
            *([] if named else [f"--config.run_name=doc{RUNNABLE.index((doc, words))}"])]
  elif name == "jaxrl-eval":
    args = [*args, "--limit", "8", "--samples", f"{tmp}/samples.jsonl"]
  elif name == "jaxrl-export":
    args = [a.replace("exported/", f"{tmp}/exported/") for a in args]
  elif name == "jaxrl-sample":
    args = [*args, "--max_new_tokens", "8"]
  return name, [name, *args]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
  """A directory with `runs/NAME`, a finished tiny run for the commands that read one, and
`runs/LORA`, the same with LoRA adapters (`lora.rank=4`)."""
  out = str(tmp_path_factory.mktemp("docs"))
  for name, extra in (("NAME", []), ("LORA", ["--config.lora.rank=4"])):
    assert train.main([TRAIN, "--config=configs/tiny.py", f"--config.run_dir={out}/runs",
                       f"--config.run_name={name}", "--config.progress=False", *extra]) == 0
  return out


@pytest.mark.slow
@pytest.mark.parametrize("doc, words", RUNNABLE,
                         ids=[f"{doc}:{' '.join(w)[:60]}" for doc, w in RUNNABLE])
def test_documented_command_runs(doc, words, tmp, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)
  name, argv = _runnable(doc, words, tmp)
  try:
    rc = MAINS[name](argv)
  except SystemExit as e:
    rc = e.code
  err = capsys.readouterr().err
  allowed = (0, 1) if "--dry_run" in argv else (0,)  # a dry run says "does not fit" with 1
  assert rc in allowed, f"{doc}: {' '.join(argv)}\n{err[-3000:]}"


def _as_written(words: list[str], tmp: str) -> list[str]:
  """The README's command with only the places it writes moved under `tmp` (/tmp/jaxrl,
  exported/, and runs/: runs/NAME is the module's finished tiny run), its program the console
  script beside this Python (what .venv/bin/ holds)."""
  argv = [w.replace("/tmp/jaxrl", f"{tmp}/jaxrl").replace("runs/NAME", f"{tmp}/runs/NAME")
          .replace("exported/", f"{tmp}/exported/") for w in words]
  if "--resume" in argv:  # the run it names lives in the default runs/
    argv.append(f"--config.run_dir={tmp}/runs")
  assert argv[0].startswith(".venv/bin/jaxrl-"), argv
  return [os.path.join(os.path.dirname(sys.executable), os.path.basename(argv[0])), *argv[1:]]


def _quoted_range(pattern: str) -> list[tuple[float, float]]:
  """The README's `LO-HI` ranges matched by `pattern` (one group per `LO-HI`)."""
  found = re.search(pattern, " ".join(_what_next().split()))
  assert found, f"the README no longer quotes {pattern!r}"
  return [tuple(map(float, g.split("-"))) for g in found.groups()]


def _check_quoted(argv: list[str], output: str) -> None:
  """What the README says of this command's output, checked on it."""
  if "--dry_run" in argv:  # the README shows the configs that fit their hardware
    assert "verdict: fits" in output, output[-3000:]
  if "--config=configs/gsm8k_tiny.py" in argv:
    sft, rl = _quoted_range(r"held-out (\d\.\d+-\d\.\d+) after SFT and "
                            r"(\d\.\d+-\d\.\d+) after 40 GRPO steps")
    got = {k: float(v) for k, v in re.findall(r"(heldout_acc_(?:sft|rl))=([\d.]+)", output)}
    assert sft[0] <= got["heldout_acc_sft"] <= sft[1], (got, sft)
    assert rl[0] <= got["heldout_acc_rl"] <= rl[1], (got, rl)


@pytest.mark.slow
@pytest.mark.parametrize("words", AS_WRITTEN, ids=[" ".join(w)[:70] for w in AS_WRITTEN])
def test_what_next_runs_as_written(words, tmp, optimised_xla):
  """Every command of the README's "What next" that runs here, as a newcomer types it: its own
  process, XLA's default optimisation, no fewer steps or smaller batches. Its exit code, and the
  figures the README quotes of it."""
  argv = _as_written(words, tmp)
  proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, f"{' '.join(argv)}\n{proc.stderr[-3000:]}"
  _check_quoted(argv, proc.stdout + proc.stderr)
