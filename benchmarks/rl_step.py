"""The RL step, stage by stage, against this machine's matmul peak measured in the same process.

  python -m benchmarks.rl_step --json                 # the default experiment, + mode comparison
  python -m benchmarks.rl_step --json --workload w1   # the 4-layer d_model-256 workload

Workloads (`WORKLOADS`), each built by `train.experiment.Experiment` from a fresh policy (so
almost every response runs to max_new_tokens):
  default  the default experiment's RL stage (64 prompts x 8 samples, reverse task, 2 minibatches)
           in its own placement; `--modes` (on by default here) also runs it in sync-colocate,
           sync-separate and async-separate and reports samples/s, seconds per step and the
           bubble of each (`async_over_sync` = async-separate / sync-separate samples/s).
  w1       vocab 264, d_model 256, 4 layers, 4 heads / 2 KV heads, head_dim 64, MLP 1024, untied
           embeddings; reverse task with 30 letters (36-token prompts with BOS), 8 prompts x 8 samples,
           32 new tokens, KL to the reference, one minibatch accumulated over 8-row micro-batches
           (`--micro-batch-size` overrides); colocated on one CPU device.
Per stage (generate, reward, reference, old_logprobs, update, weight_push): the mean seconds of
its calls on the timeline, its model FLOPs (jaxrl/models/flops.py: only the work the step needs;
a skipped pass counts zero) and `flops_utilization` = FLOPs / (seconds x matmul peak). The
step's utilization is all stages' FLOPs over the step's wall time. `peak_memory_bytes`: the
device's peak on an accelerator, the process's peak resident memory on a CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import time

from benchmarks.common import add_host_flags, emit, matmul_flops_per_s, setup_host
from sharding.host import force_cpu_devices

MODES = {"sync-colocate": ("colocate", "sync"), "sync-separate": ("separate", "sync"),
         "async-separate": ("separate", "async")}
# Timeline labels (train/controller.py) of each stage.
STAGE_LABELS = {"generate": ("generate",), "reward": ("score",), "reference": ("ref logprobs",),
                "old_logprobs": ("old logprobs",), "update": ("update",),
                "weight_push": ("reshard", "push")}


@dataclasses.dataclass(frozen=True)
class Workload:
  devices: int  # fake CPU devices
  overrides: dict  # config sections -> fields, over the default experiment
  modes: bool  # also compare the placements and modes


W1_MODEL = dict(vocab_size=264, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64,
                d_ff=1024, tie_embeddings=False)
WORKLOADS = {
    "default": Workload(8, {}, modes=True),
    "w1": Workload(1, {"model": W1_MODEL, "task": {"num_digits": 30},
                       "data": {"max_prompt_tokens": 36},
                       "rl": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 32,
                              "num_minibatches": 1, "kl_coef": 0.02, "micro_batch_size": 8},
                       "placement": {"strategy": "colocate", "cpu_devices": 1,
                                     "sampler_tensor": 1}}, modes=False),
}


def build_config(workload: Workload, steps: int, **rl) -> dict:
  from train.plan_cli import bench_config
  raw = bench_config(workload.overrides, steps)
  raw["rl"].update(rl)
  return raw


def step_flops(exp, rows: list[dict], ran_old_pass: bool) -> dict[str, float]:
  """Model FLOPs per stage of one step, from the config and the responses' mean length; the old
  log-prob pass counts only where the step needed it (and so ran it)."""
  from jaxrl.models import flops
  rl, p, n = exp.cfg.rl, exp.ctx.task.prompt_len, exp.cfg.rl.max_new_tokens
  model = exp.cfg.model
  mean_len = sum(r["response_len"] for r in rows) / len(rows)
  forward = flops.forward_flops(model, rl.rollouts, p + n, n)
  return {"generate": flops.generate_flops(model, rl.prompts_per_step, p, rl.group_size,
                                           mean_len),
          "reward": 0.0, "reference": forward, "old_logprobs": forward if ran_old_pass else 0.0,
          "update": flops.train_flops(model, rl.rollouts, p + n, n), "weight_push": 0.0}


def peak_memory_bytes() -> int:
  import jax
  stats = jax.devices()[0].memory_stats()
  if stats and "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_stages(workload: Workload, *, steps: int, warmup: int, peak: float, **rl) -> dict:
  """Per-stage seconds, FLOPs and utilization of the workload's sync RL step."""
  from train.experiment import Experiment
  with Experiment(build_config(workload, steps + warmup, **rl)) as exp:
    for _ in range(warmup):
      exp.rl.step()
    t0 = time.perf_counter()
    rows = [exp.rl.step() for _ in range(steps)]
    wall = time.perf_counter() - t0
    calls = exp.ctx.timeline.durations(t0)
    stage_flops = step_flops(exp, rows, ran_old_pass="old logprobs" in calls)
  stages = {}
  for name, labels in STAGE_LABELS.items():
    times = [t for label in labels for t in calls.get(label, [])]
    seconds = sum(times) / steps
    stages[name] = {"seconds": round(seconds, 4), "flops": stage_flops[name],
                    "flops_utilization": round(stage_flops[name] / (seconds * peak), 3)
                    if seconds and stage_flops[name] else 0.0}
  step_s = wall / steps
  return {"stages": stages, "step_s": round(step_s, 4),
          "flops_utilization": round(sum(stage_flops.values()) / (step_s * peak), 3),
          "response_len": sum(r["response_len"] for r in rows) / steps}


def run_mode(strategy: str, mode: str, *, steps: int, warmup: int, max_staleness: int,
             **rl) -> dict:
  """The default experiment's RL stage in one placement and mode."""
  from train.experiment import Experiment
  raw = build_config(WORKLOADS["default"], steps + warmup, mode=mode, max_staleness=max_staleness,
                     **rl)
  raw["placement"]["strategy"] = strategy
  with Experiment(raw) as exp:
    for _ in range(warmup):
      exp.rl.step()
    t0 = time.perf_counter()
    lags = [exp.rl.step()["policy_lag"] for _ in range(steps)]
    wall = time.perf_counter() - t0
    summary = exp.ctx.timeline.summary(t0)
    samples = exp.cfg.rl.rollouts
  return {"samples_per_s": samples * steps / wall, "step_s": wall / steps,
          "bubble": summary["bubble"], "busy": summary["busy"], "max_lag": max(lags)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--workload", default="default", choices=sorted(WORKLOADS))
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--modes", action=argparse.BooleanOptionalAction, default=None,
                      help="also compare placements and modes (default: on for `default`)")
  parser.add_argument("--max-staleness", type=int, default=1)
  parser.add_argument("--micro-batch-size", type=int, default=None,
                      help="rl.micro_batch_size (default: the workload's)")
  add_host_flags(parser)
  args = parser.parse_args()
  retained = setup_host(args)
  workload = WORKLOADS[args.workload]
  force_cpu_devices(workload.devices)
  import jax

  peak = matmul_flops_per_s()
  rl = {} if args.micro_batch_size is None else {"micro_batch_size": args.micro_batch_size}
  result = {"workload": args.workload,
            **run_stages(workload, steps=args.steps, warmup=args.warmup, peak=peak, **rl)}
  if workload.modes if args.modes is None else args.modes:
    modes = {name: run_mode(strategy, mode, steps=args.steps, warmup=args.warmup,
                            max_staleness=args.max_staleness, **rl)
             for name, (strategy, mode) in MODES.items()}
    result.update(modes=modes, max_staleness=args.max_staleness,
                  async_over_sync=modes["async-separate"]["samples_per_s"]
                  / modes["sync-separate"]["samples_per_s"])
  emit({**result, "peak_memory_bytes": peak_memory_bytes(), "matmul_flops_per_s": round(peak),
        "retain_freed_memory": retained, "steps": args.steps,
        "device": jax.devices()[0].device_kind, "n_devices": jax.device_count()}, args.json)


if __name__ == "__main__":
  main()
