"""One GRPO workload in sync-colocate, sync-separate and async-separate modes, in one process.

  python -m benchmarks.rl_step --json

The default experiment's model and batch (64 prompts x 8 samples, reverse task, 2 minibatches)
on the fake 8-device CPU mesh, from a freshly initialised policy (so every response runs to
max_new_tokens: the same work in every mode). Per mode: samples/s and seconds per RL step over
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
  from configs import default
  from jaxrl.config import ExperimentConfig, from_mapping, validate
  from jaxrl.data.pipeline import answer_length, prompt_dataset, prompt_length
  from jaxrl.data.tasks import make_splits
  from jaxrl.data.tokenizer import ByteTokenizer
  from jaxrl.rewards.verifier import VERIFIERS
  from train.controller import Controller
  from train.timeline import Timeline
  from train.trainer import Trainer

  raw = default.get_config().to_dict()
  raw["placement"]["strategy"] = strategy
  raw["rl"].update(mode=mode, steps=steps + warmup, max_staleness=max_staleness)
  cfg = validate(from_mapping(ExperimentConfig, raw))
  tok = ByteTokenizer()
  train_set, heldout = make_splits(cfg.task.name, cfg.task.num_digits, cfg.task.n_train,
                                   cfg.task.n_heldout, cfg.seed, cfg.task.teacher_error)
  p_len = prompt_length(train_set + heldout, tok)
  trainer = Trainer(cfg, prompt_len=p_len, max_new_tokens=answer_length(train_set, tok) + 2,
                    eos_id=tok.eos_id, pad_id=tok.pad_id)
  trainer.start_rl()
  timeline = Timeline()
  controller = Controller(trainer, tok, VERIFIERS[cfg.task.verifier], timeline)
  controller.start(iter(prompt_dataset(train_set, tok, batch_size=cfg.rl.prompts_per_step,
                                       length=p_len, seed=cfg.seed)), cfg.seed)
  try:
    for _ in range(warmup):
      controller.step()
    t0 = time.perf_counter()
    lags = [controller.step()[1]["policy_lag"] for _ in range(steps)]
    wall = time.perf_counter() - t0
    summary = timeline.summary(t0)
  finally:
    controller.close()
  samples = cfg.rl.prompts_per_step * cfg.rl.group_size
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
