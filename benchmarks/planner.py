"""The planner's cost model, predicted against measured step times on this machine, in one run.

  python -m benchmarks.planner --json

1. Calibrate as `jaxrl-plan --calibrate` does: measure the matmul peak, memory and transfer
   bandwidth, run train/plan_cli.CALIBRATION_RUNS for a few steps, fit the factors to them.
2. Predict, then measure, the CONFIGS (other model sizes, placements and modes than the
   calibration runs): `pairs` of predicted vs measured median step seconds, `worst_error`.
3. The default experiment's RL step under each fixed preset and under the plan the planner
   picks for it (same steps each): `default_plan`.
Every run starts from a fresh policy, so responses run to max_new_tokens as the model assumes.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile

from benchmarks.common import add_host_flags, emit, setup_host
from sharding.host import force_cpu_devices

SMALL = {}  # the default experiment's model: d_model 128, 2 layers
MEDIUM = dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=1024)
LARGE = dict(d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, head_dim=64, d_ff=1536)
BATCH = {"prompts_per_step": 16, "group_size": 4, "max_new_tokens": 16, "num_minibatches": 1}


def _config(model: dict, strategy: str, mode: str = "sync") -> dict:
  return {"model": model, "rl": {**BATCH, "mode": mode}, "placement": {"strategy": strategy}}


# Other sizes, placements and modes than train/plan_cli.CALIBRATION_RUNS (small colocate sync,
# medium separate and interleave sync), which the factors are fitted to.
CONFIGS = {"small interleave sync": _config(SMALL, "interleave"),
           "small separate async": _config(SMALL, "separate", "async"),
           "medium colocate sync": _config(MEDIUM, "colocate"),
           "medium separate async": _config(MEDIUM, "separate", "async"),
           "large colocate sync": _config(LARGE, "colocate"),
           "large separate sync": _config(LARGE, "separate"),
           "large interleave sync": _config(LARGE, "interleave")}


def median_step_s(overrides: dict, steps: int, warmup: int) -> tuple[float, object]:
  from train.plan_cli import bench_config, run_steps
  _, times, cfg = run_steps(bench_config(overrides, steps + warmup), steps + warmup)
  return sorted(times[warmup:])[steps // 2], cfg


def predicted_s(cfg, cal) -> float:
  from sharding.planner.calibrate import preset_plan
  from sharding.planner.cost import Workload, stage_times, step_time
  plan = preset_plan(cfg, cfg.placement.cpu_devices, cal.device)
  return step_time(stage_times(Workload.from_config(cfg), cal.device, cal.efficiency, plan),
                   plan, cal.device)


def default_plan(cal_path: str, steps: int, warmup: int) -> dict:
  """The default experiment's RL step under the three presets and under `strategy=plan`."""
  out = {}
  for name in ("colocate", "interleave", "separate", "plan"):
    seconds, cfg = median_step_s({"placement": {"strategy": name, "calibration": cal_path}},
                                 steps, warmup)
    out[f"{name}_measured_s"] = round(seconds, 4)
    if name == "plan":
      out["plan"] = f"{cfg.placement.strategy}, train_devices {cfg.placement.train_devices}, " \
                    f"sampler_tensor {cfg.placement.sampler_tensor}, " \
                    f"micro_batch_size {cfg.rl.micro_batch_size}"
  out["plan_at_least_as_fast"] = all(out["plan_measured_s"] <= out[f"{n}_measured_s"]
                                     for n in ("colocate", "interleave", "separate"))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  add_host_flags(parser)
  args = parser.parse_args()
  setup_host(args)
  force_cpu_devices(8)
  from train.plan_cli import calibrate_here

  cal, samples = calibrate_here(args.steps, args.warmup)
  cal_path = tempfile.mktemp(prefix="jaxrl-calibration-", suffix=".json")
  cal.save(cal_path)
  pairs = []
  for name, overrides in CONFIGS.items():
    measured, cfg = median_step_s(overrides, args.steps, args.warmup)
    predicted = predicted_s(cfg, cal)
    pairs.append({"config": name, "predicted_s": round(predicted, 4),
                  "measured_s": round(measured, 4), "error": round(predicted / measured - 1, 3)})
  emit({"pairs": pairs, "worst_error": max(abs(p["error"]) for p in pairs),
        "calibration_samples": len(samples), "efficiency": dataclasses.asdict(cal.efficiency),
        "matmul_flops_per_s": cal.device.matmul_flops,
        "memory_bytes_per_s": cal.device.hbm_bytes_per_s,
        "default_plan": default_plan(cal_path, args.steps, args.warmup)}, args.json)


if __name__ == "__main__":
  main()
