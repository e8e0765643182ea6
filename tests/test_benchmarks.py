"""The GPU benchmark's workloads at their reduced CPU size, and the fixed-length rollouts
(`rl.ignore_eos`) they rely on."""
import json
import os
import subprocess
import sys

import pytest

from configs import tiny
from train.run import Experiment

ROOT = __file__.rsplit("/tests/", 1)[0]
STAGES = ("generate", "reward", "reference", "old_logprobs", "update", "weight_push")
MATMUL_STAGES = ("generate", "reference", "old_logprobs", "update")  # the stages with FLOPs


@pytest.mark.slow
def test_rl_step_qwen_workload_reports_every_stage_at_reduced_size():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the workload's own devices
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-m", "benchmarks.rl_step", "--json", "--workload",
                        "qwen0.5b", "--steps", "1", "--warmup", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["scale"] == "reduced" and result["n_devices"] == 1
  assert set(result["stages"]) == set(STAGES)
  for name, stage in result["stages"].items():
    assert stage["seconds"] > 0, name
    assert stage["compile_s"] >= 0, name
  for name in MATMUL_STAGES:
    assert 0 < result["stages"][name]["flops_utilization"] <= 1, name
  assert 0 < result["flops_utilization"] <= 1
  assert result["response_len"] == 16  # forced to the budget (rl.ignore_eos)
  assert result["decode"]["tokens_per_s"] > 0 and result["decode"]["roofline_fraction"] > 0
  assert result["compile_s"] >= 0 and result["peak_memory_bytes"] > 0


@pytest.mark.slow
def test_ignore_eos_runs_every_rollout_to_its_budget_past_sampled_eos(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="eos")
  raw["sft"]["steps"] = 0  # a fresh policy samples EOS as often as any token
  raw["rl"]["ignore_eos"] = True
  with Experiment(raw) as exp:
    eos = exp.ctx.tok.eos_id
    groups = exp.sample([f"rev {s}=" for s in ("abcde", "jihgf", "aabbc", "cdefg")], n=16,
                        max_new_tokens=24)
  tokens = [c.tokens for group in groups for c in group]
  assert all(len(t) == 24 for t in tokens)
  # Without this the flag would be untested: some rollout did sample EOS and went on.
  assert any(eos in t[:-1] for t in tokens)
