"""One GRPO workload in sync-colocate, sync-separate and async-separate modes, in one process.

  python -m benchmarks.rl_step --json

The default experiment's RL stage (64 prompts x 8 samples, reverse task, 2 minibatches), built
by `train.experiment.Experiment` exactly as `make run` builds it, on the fake 8-device CPU mesh,
from a freshly initialised policy (so every response runs to max_new_tokens: the same work in
every mode). Per mode: samples/s and seconds per RL step over
`--steps` steps after `--warmup` (compilation), and the bubble (mean idle fraction of the
executors, from the timeline). `async_over_sync` = async-separate / sync-separate samples/s.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import add_host_flags, setup_host, emit
from sharding.host import force_cpu_devices

MODES = {"sync-colocate": ("colocate", "sync"), "sync-separate": ("separate", "sync"),
         "async-separate": ("separate", "async")}


def run_mode(strategy: str, mode: str, *, steps: int, warmup: int, max_staleness: int) -> dict:
  """The default experiment's RL stage in one placement and mode, built by `Experiment`."""
  import tempfile

  from jaxrl.config import ExperimentConfig, to_dict
  from train.experiment import Experiment

  raw = to_dict(ExperimentConfig())
  raw.update(run_dir=tempfile.mkdtemp(prefix="jaxrl-bench-"), run_name=f"{strategy}-{mode}",
             progress=False, checkpoint_every=10**6, checkpoint_minutes=0.0)
  raw["placement"]["strategy"] = strategy
  raw["eval"]["every"] = 10**6
  # One step more than timed, so the timed ones end before the stage's final evaluation.
  raw["rl"].update(mode=mode, steps=steps + warmup + 1, max_staleness=max_staleness)
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
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--max-staleness", type=int, default=1)
  add_host_flags(parser)
  args = parser.parse_args()
  retained = setup_host(args)
  force_cpu_devices(8)
  import jax

  modes = {name: run_mode(strategy, mode, steps=args.steps, warmup=args.warmup,
                          max_staleness=args.max_staleness)
           for name, (strategy, mode) in MODES.items()}
  emit({"modes": modes, "retain_freed_memory": retained,
        "async_over_sync": modes["async-separate"]["samples_per_s"]
                           / modes["sync-separate"]["samples_per_s"],
        "steps": args.steps, "max_staleness": args.max_staleness,
        "device": str(jax.devices()[0].platform), "n_devices": jax.device_count()}, args.json)


if __name__ == "__main__":
  main()
