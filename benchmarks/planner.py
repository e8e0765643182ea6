"""The planner's cost model, predicted against measured step times on this machine, in one run.

  python -m benchmarks.planner --json

1. Calibrate as `jaxrl-plan --calibrate` does: measure the matmul peak, memory and transfer
   bandwidth, run train/preflight/calibration.CALIBRATION_RUNS for a few steps, fit the factors to them.
2. Predict, then measure, the CONFIGS (other model sizes, placements and modes than the
   calibration runs): `pairs` of predicted vs measured median step seconds, `worst_error`.
3. The default experiment's RL step under each fixed preset and under the plan the planner
   picks for it, the four run in turn for `--rounds` rounds (same steps each): `default_plan`,
   each one's median step; the presets other than the calibrated one (separate) and the plan
   are pairs too.
Every run starts from a fresh policy, so responses run to max_new_tokens as the model assumes.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile

import numpy as np

from benchmarks.common import add_host_flags, emit, setup_host
from sharding.host import force_cpu_devices

from train.preflight.calibration import MEDIUM_MODEL as MEDIUM, SHORT_RL as BATCH

SMALL = {}  # the default experiment's model: d_model 128, 2 layers
LARGE = dict(d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, head_dim=64, d_ff=1536)


def _config(model: dict, strategy: str, mode: str = "sync") -> dict:
  return {"model": model, "rl": {**BATCH, "schedule": {"mode": mode}},
          "placement": {"strategy": strategy}}


# Other sizes, placements and modes than train/preflight/calibration.CALIBRATION_RUNS (small
# colocate sync, medium separate and interleave sync, the default experiment separate), which the factors are
# fitted to.
CONFIGS = {"small interleave sync": _config(SMALL, "interleave"),
           "small separate async": _config(SMALL, "separate", "async"),
           "medium colocate sync": _config(MEDIUM, "colocate"),
           "medium separate async": _config(MEDIUM, "separate", "async"),
           "large colocate sync": _config(LARGE, "colocate"),
           "large separate sync": _config(LARGE, "separate"),
           "large interleave sync": _config(LARGE, "interleave")}


def step_times(overrides: dict, steps: int, warmup: int) -> tuple[list[float], object]:
  """The step seconds of `steps` RL steps after `warmup` ones, and the resolved config."""
  from train.preflight.calibration import bench_config, run_steps
  _, times, cfg = run_steps(bench_config(overrides, steps + warmup), steps + warmup)
  return times[warmup:], cfg


def median_step_s(overrides: dict, steps: int, warmup: int) -> tuple[float, object]:
  times, cfg = step_times(overrides, steps, warmup)
  return float(np.median(times)), cfg


def predicted_s(cfg, cal) -> float:
  from planner.calibrate import Sample, predict, preset_plan
  from planner.cost import Workload
  n = cfg.placement.cpu_devices
  sample = Sample(Workload.from_config(cfg, cal.device.platform), preset_plan(cfg, n, cal.device),
                  "step", 0.0, n)
  return predict(sample, cal.device, cal.efficiency)


def default_plan(cal, cal_path: str, steps: int, warmup: int, rounds: int) -> dict:
  """The default experiment's RL step under the three presets and under `strategy=plan`, run in
  turn for `rounds` rounds (the machine's drift hits all four alike); each one's median over
  every measured step, and the presets' predictions (the plan's is the planner's own)."""
  names = ("colocate", "interleave", "separate", "plan")
  times = {name: [] for name in names}
  for _ in range(rounds):
    for name in names:
      t, cfg = step_times({"placement": {"strategy": name, "calibration": cal_path}}, steps,
                          warmup)
      times[name] += t
      if name == "plan":
        plan_cfg = cfg
  out = {f"{n}_measured_s": round(float(np.median(times[n])), 4) for n in names}
  for n in names[:3]:
    out[f"{n}_predicted_s"] = round(predicted_s(_resolved(n, cal_path), cal), 4)
  from planner.plan import choose
  from sharding.placement import host_major_devices
  _, best = choose(_resolved("plan", cal_path), host_major_devices())
  out["plan"] = best.plan.describe()
  out["plan_predicted_s"] = round(best.step_s, 4)
  out["plan_config"] = (f"{plan_cfg.placement.strategy}, train_devices "
                        f"{plan_cfg.placement.train_devices}, sampler_tensor "
                        f"{plan_cfg.placement.sampler_tensor}, micro_batch_size "
                        f"{plan_cfg.rl.batching.micro_batch_size}")
  fastest = min(out[f"{n}_measured_s"] for n in names[:3])
  out["plan_over_fastest_preset"] = round(out["plan_measured_s"] / fastest, 3)
  out["plan_at_least_as_fast"] = out["plan_measured_s"] <= fastest
  return out


def _resolved(strategy: str, cal_path: str):
  from jaxrl.config import ExperimentConfig
  from jaxrl.config_files import from_mapping
  from train.preflight.calibration import bench_config
  raw = bench_config({"placement": {"strategy": strategy, "calibration": cal_path}}, 1)
  return from_mapping(ExperimentConfig, raw)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=3, help="turns of the default-plan runs")
  add_host_flags(parser)
  args = parser.parse_args()
  setup_host(args)
  force_cpu_devices(8)
  from train.preflight.calibration import calibrate_here

  cal, samples = calibrate_here(args.steps, args.warmup)
  cal_path = tempfile.mktemp(prefix="jaxrl-calibration-", suffix=".json")
  cal.save(cal_path)
  pairs = []
  for name, overrides in CONFIGS.items():
    measured, cfg = median_step_s(overrides, args.steps, args.warmup)
    pairs.append(_pair(name, predicted_s(cfg, cal), measured))
  plan = default_plan(cal, cal_path, args.steps, args.warmup, args.rounds)
  for name in ("colocate", "interleave"):  # the default's separate run is a calibration run
    pairs.append(_pair(f"default {name} sync", plan[f"{name}_predicted_s"],
                       plan[f"{name}_measured_s"]))
  pairs.append(_pair(f"default plan ({plan['plan_config']})", plan["plan_predicted_s"],
                     plan["plan_measured_s"]))
  emit({"pairs": pairs, "worst_error": max(abs(p["error"]) for p in pairs),
        "calibration_samples": len(samples), "efficiency": dataclasses.asdict(cal.efficiency),
        "matmul_flops_per_s": cal.device.matmul_flops,
        "memory_bytes_per_s": cal.device.hbm_bytes_per_s,
        "transfer_bytes_per_s": cal.device.link_bytes_per_s, "default_plan": plan}, args.json)


def _pair(name: str, predicted: float, measured: float) -> dict:
  return {"config": name, "predicted_s": round(predicted, 4), "measured_s": round(measured, 4),
          "error": round(predicted / measured - 1, 3)}


if __name__ == "__main__":
  main()
