"""The planner's calibration on this machine: short RL runs of the default experiment (and a
4-layer d_model-256 model) in each placement, timed stage by stage, fitted to the cost model
(planner/calibrate.py); `jaxrl-plan --calibrate` runs them, the benchmarks time runs the same
way (`bench_config`, `run_steps`)."""
from __future__ import annotations

import tempfile

# Short runs the calibration fits to, in sync mode (each stage's time is its own): the default
# model and a 4-layer d_model-256 one on 64 rows, in each placement, and the default experiment
# itself (512 rows in 2 minibatches: the old-log-prob pass runs beside the reference's).
SHORT_RL = {"prompts_per_step": 16, "group_size": 4, "rollout": {"max_new_tokens": 16},
            "batching": {"num_minibatches": 1}}
MEDIUM_MODEL = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024)
CALIBRATION_RUNS = (
    {"rl": SHORT_RL, "placement": {"strategy": "colocate"}},
    {"model": MEDIUM_MODEL, "rl": SHORT_RL, "placement": {"strategy": "separate"}},
    {"model": MEDIUM_MODEL, "rl": SHORT_RL, "placement": {"strategy": "interleave"}},
    {"placement": {"strategy": "separate"}},
)


def run_steps(raw: dict, steps: int) -> tuple[str, list[float], object]:
  """(run dir with its trace.json and metrics.jsonl, RL step seconds, ExperimentConfig) of
  `steps` RL steps from a fresh policy (responses run to max_new_tokens)."""
  from train.run import Experiment
  with Experiment(raw) as exp:
    times = [exp.rl.step()["step_time"] for _ in range(steps)]
    exp.ctx.timeline.write_chrome_trace(f"{exp.run_dir}/trace.json")
    return exp.run_dir, times, exp.cfg


def bench_config(overrides: dict, steps: int) -> dict:
  """The default experiment with `overrides`, set up for timing `steps` RL steps."""
  from jaxrl.config import ExperimentConfig, to_dict
  from jaxrl.config_files import merge
  raw = merge(to_dict(ExperimentConfig()), overrides)
  raw.update(run_dir=tempfile.mkdtemp(prefix="jaxrl-bench-"), progress=False,
             checkpoint_every=10**6, checkpoint_minutes=0.0)
  raw["eval"]["every"] = 10**6
  raw["task"]["n_heldout"] = 32
  raw["rl"]["steps"] = steps + 1  # the timed steps end before the stage's final evaluation
  return raw


def calibrate_here(steps: int = 6, warmup: int = 2):
  """Measures this machine and fits the factors to CALIBRATION_RUNS: (Calibration, samples)."""
  import jax

  from jaxrl.config import ExperimentConfig
  from planner import calibrate as cal
  from planner.plan import calibration_for
  base = calibration_for(ExperimentConfig(), jax.devices()[0], jax.local_device_count())
  dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  dev = cal.profile(base.device, dtype)
  samples = []
  for overrides in CALIBRATION_RUNS:
    run_dir, _, _ = run_steps(bench_config(overrides, steps + warmup), steps + warmup)
    samples += cal.samples_from_run(run_dir, dev, jax.device_count(), skip=warmup)
  return cal.Calibration(dev, cal.fit(samples, dev, base.efficiency)), samples
