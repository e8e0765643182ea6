"""The GPU benchmark's workloads at their reduced CPU size, and the fixed-length rollouts
(`rl.rollout.ignore_eos`) they rely on."""
import json
import os
import subprocess
import sys

import pytest

from jaxrl.config_files import shipped
from train.run import Experiment

tiny = shipped("tiny")

ROOT = __file__.rsplit("/tests/", 1)[0]
STAGES = ("generate", "reward", "reference", "old_logprobs", "update", "weight_push")
MATMUL_STAGES = ("generate", "reference", "old_logprobs", "update")  # the stages with FLOPs


@pytest.mark.slow
def test_accelerator_check_runs_the_qwen_workload_at_reduced_size():
  """`benchmarks.accelerator` (here one of its parts, on the CPU) runs `benchmarks.rl_step` for
  the workload: every stage timed, and the dry run's estimate beside the measured peak."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the workload's own devices
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-m", "benchmarks.accelerator", "--json", "--parts",
                        "qwen0.5b", "--budget", "280"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  check = json.loads(out.stdout.strip().splitlines()[-1])
  part = check["parts"]["qwen0.5b"]
  assert part["status"] == "ok", part.get("tail")
  assert check["targets_h100"] == {}  # a reduced run is no measurement
  assert part["dry_run_bytes"] > 0 and part["estimate_over_peak"] > 0
  result = part["rl_step"]
  assert result["scale"] == "reduced" and result["n_devices"] == 1
  assert set(result["stages"]) == set(STAGES)
  for name, stage in result["stages"].items():
    assert stage["seconds"] > 0, name
    assert stage["compile_s"] >= 0, name
  for name in MATMUL_STAGES:
    assert 0 < result["stages"][name]["flops_utilization"] <= 1, name
  assert 0 < result["flops_utilization"] <= 1
  assert result["response_len"] == 16  # forced to the budget (rl.rollout.ignore_eos)
  assert result["decode"]["tokens_per_s"] > 0 and result["decode"]["roofline_fraction"] > 0
  assert result["compile_s"] >= 0 and result["peak_memory_bytes"] > 0


def test_accelerator_targets_and_pytest_counts():
  from benchmarks.accelerator import pytest_summary, targets
  assert pytest_summary("....\n22 passed, 1 failed, 2 errors in 9.1s") == {
      "passed": 22, "failed": 1, "errors": 2}
  met = targets({"qwen0.5b": {"step_s": 1.9, "update_s": 0.84},
                 "qwen1.5b": {"step_s": 4.57, "update_mfu": 0.41}})
  assert met == {"qwen0.5b step_s <= 2.0": True, "qwen0.5b update_s <= 0.7": False,
                 "qwen1.5b step_s <= 4.5": False, "qwen1.5b update_mfu >= 0.4": True}


def test_accelerator_check_names_the_packages_missing_before_it_starts(tmp_path):
  """A GPU image without pebble failed every part at import (2026-11-28); the check now names
  what is missing from pyproject.toml's dependencies in one line, before any part runs."""
  from benchmarks.accelerator import missing_requirements
  assert missing_requirements() == []  # this venv has the project installed
  (tmp_path / "pyproject.toml").write_text(
      '[project]\ndependencies = ["numpy>=1.26,<3", "no-such-dist-xyz>=5.1,<6"]\n')
  assert missing_requirements(str(tmp_path / "pyproject.toml")) == ["no-such-dist-xyz"]


@pytest.mark.slow
def test_ignore_eos_runs_every_rollout_to_its_budget_past_sampled_eos(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="eos")
  raw["sft"]["steps"] = 0  # a fresh policy samples EOS as often as any token
  raw["rl"]["rollout"]["ignore_eos"] = True
  with Experiment(raw) as exp:
    eos = exp.ctx.tok.eos_id
    groups = exp.sample([f"rev {s}=" for s in ("abcde", "jihgf", "aabbc", "cdefg")], n=16,
                        max_new_tokens=24)
  tokens = [c.tokens for group in groups for c in group]
  assert all(len(t) == 24 for t in tokens)
  # Without this the flag would be untested: some rollout did sample EOS and went on.
  assert any(eos in t[:-1] for t in tokens)


def test_logprob_mismatch_measures_each_source_against_its_baseline():
  """`benchmarks.logprob_mismatch` (small): each source's largest log-prob gap and bitwise
  share, per dtype; the sampler's and the trainer's log-probs agree as a run's mismatch does; a
  gradient program's log-probs and a decode by the trainer's own pass are the scoring pass's,
  bit for bit, and a decode loop replayed in a gradient program is the loop's in float32 (what
  the exact routes stand on)."""
  from benchmarks.logprob_mismatch import main
  result = main(["--rows", "2", "--new_tokens", "6", "--d_model", "32", "--layers", "2",
                 "--pad", "5", "--json"])
  sources = {"sampler", "rows", "length", "head", "rules", "fsdp", "tensor", "f32_one",
             "f32_mesh", "decode_rows", "grad", "trainer_decode", "decode_replay"}
  for dtype, bound in (("float32", 1e-4), ("bfloat16", 0.1)):
    gaps = {k: v for k, v in result[dtype].items()
            if k not in ("depth", "trainer_decode_cost", "decode_replay_cost")}
    assert gaps["grad"] == gaps["trainer_decode"] == {"max": 0.0, "bitwise_frac": 1.0}
    assert result[dtype]["trainer_decode_cost"] > 0 and result[dtype]["decode_replay_cost"] > 0
    assert set(gaps) == sources and len(result[dtype]["depth"]) == 2  # (--layers 2)
    assert all(0 <= g["bitwise_frac"] <= 1 and g["max"] >= 0
               for g in [*gaps.values(), *result[dtype]["depth"]])
    assert result[dtype]["sampler"]["max"] < bound
    assert result[dtype]["depth"][-1] == result[dtype]["sampler"]  # (the whole model)
  assert result["float32"]["f32_one"] == {"max": 0.0, "bitwise_frac": 1.0}  # (itself)
  assert result["float32"]["decode_replay"] == {"max": 0.0, "bitwise_frac": 1.0}
  assert result["bfloat16"]["f32_one"]["max"] > 0


def test_without_excess_precision_a_bf16_mesh_scores_as_one_device():
  """XLA's excess precision, off (its flag is read as JAX starts: a process of its own): the
  bfloat16 pass over an fsdp mesh of 4 equals one device's bit for bit, and both are as far
  from the float32 pass; a bfloat16 decode loop replayed in a gradient program is the loop's,
  bit for bit (`rl.rollout.exact="replay"` in bfloat16)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-m", "benchmarks.logprob_mismatch", "--rows", "2",
                        "--new_tokens", "6", "--d_model", "32", "--layers", "2", "--pad", "5",
                        "--no_excess_precision", "--json"], cwd=ROOT, env=env, check=True,
                       capture_output=True, text=True, timeout=600).stdout
  result = json.loads(out.strip().splitlines()[-1])
  assert result["excess_precision"] is False
  bf16 = result["bfloat16"]
  assert bf16["fsdp"] == {"max": 0.0, "bitwise_frac": 1.0}
  assert bf16["f32_one"] == bf16["f32_mesh"] and bf16["f32_one"]["max"] > 0
  assert bf16["decode_replay"] == {"max": 0.0, "bitwise_frac": 1.0}


def test_batch_invariance_compares_each_rows_result_with_the_same_rows_among_more():
  """`benchmarks.batch_invariance` (small): per op the share of rows equal to the same rows
  computed among all of them; all of them against themselves is every row (the ops are
  deterministic on this machine)."""
  from benchmarks.batch_invariance import MATMULS, main
  result = main(["--rows", "128", "--counts", "1", "8", "128", "--json"])
  assert set(result["matmul"]) == {f"{k}x{n}" for k, n in MATMULS}
  for shares in result["matmul"].values():
    assert shares[128] == 1.0 and all(0.0 <= v <= 1.0 for v in shares.values())
  assert all(0.0 <= result[op] <= 1.0 for op in ("scores", "mix", "log_softmax"))
