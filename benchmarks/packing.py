"""RL steps with the scoring passes and the update over packed rows (`rl.batching.pack_length`)
against the [B, T] batch trimmed to its length bucket, alternately in one run.

  python -m benchmarks.packing --json                         # longtail
  python -m benchmarks.packing --json --workload multiturn    # gsm8k_tools (multi-turn)

Workloads:
  longtail   configs/partial_reverse.py (reverse strings of 2-32 letters, P(L) ~ L^-2: most
             answers a few letters, a batch's longest ~30), after `--sft-steps` (300) SFT
             steps, its async RL with partial rollouts; packed to `--pack-length` (96) tokens.
  multiturn  configs/gsm8k_tools.py (the calculator, 2-4 turns, 64-token prompts, 96 new
             tokens), after `--sft-steps` (400) SFT steps; packed to `--pack-length` (320) tokens.

After `--warmup` (2) untimed steps each (compiles: the passes compile once per packed row count
met), each round runs one RL step per variant in alternating order. Reported per variant,
medians over `--rounds`: the step's seconds, the update's, the scoring passes' (reference and
old log-probs), and `padding_fraction` (the share of the [B, T] slots, or of the packed rows'
slots, that hold no token); then packed over unpacked.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from benchmarks.common import emit
from benchmarks.rl_step import sig


def build(args) -> dict:
  from benchmarks.multiturn import timed_config
  steps = 2 * (args.rounds + args.warmup) + 1  # (its first step starts the controller)
  if args.workload == "multiturn":
    from jaxrl.config_files import shipped
    gsm8k_tools = shipped("gsm8k_tools")
    return timed_config(gsm8k_tools.get_config().to_dict(), {"sft": {"steps": args.sft_steps}},
                        steps)
  from jaxrl.config_files import shipped
  partial_reverse = shipped("partial_reverse")
  return timed_config(partial_reverse.get_config().to_dict(), {"sft": {"steps": args.sft_steps}},
                      steps)


def one_step(exp, scoring, pack_length: int) -> dict:
  scoring.cfg = dataclasses.replace(scoring.cfg, pack_length=pack_length)
  start = time.perf_counter()
  row = exp.rl.step()
  calls = exp.ctx.timeline.durations(start)
  seconds = lambda *labels: sum(t for label in labels for t in calls.get(label, []))
  return {"step_s": time.perf_counter() - start, "update_s": seconds("update"),
          "scoring_s": seconds("ref logprobs", "old logprobs"),
          "padding_fraction": float(row["padding_fraction"])}


def measure(raw: dict, rounds: int, warmup: int, pack_length: int) -> dict:
  from train.run import Experiment
  with Experiment(raw) as exp:
    if "sft" in exp.stage_names:
      exp.stage("sft").run()
    exp.rl.step()  # starts the controller
    scoring = exp.stages["rl"].controller.scoring
    variants = {"packed": pack_length, "unpacked": 0}
    for _ in range(warmup):  # compiles: a program per packed row count met
      for length in variants.values():
        one_step(exp, scoring, length)
    runs = {name: [] for name in variants}
    for r in range(rounds):
      for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
        runs[name].append(one_step(exp, scoring, variants[name]))
  out = {name: {k: sig(statistics.median(x[k] for x in rs)) for k in rs[0]}
         for name, rs in runs.items()}
  out["packed_over_unpacked"] = {k: sig(out["packed"][k] / out["unpacked"][k])
                                 for k in out["packed"] if out["unpacked"][k]}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--workload", choices=("longtail", "multiturn"), default="longtail")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
  parser.add_argument("--sft-steps", type=int, default=0, help="0: 300 (longtail), 400")
  parser.add_argument("--pack-length", type=int, default=None)
  args = parser.parse_args()
  from sharding.host import force_cpu_devices
  force_cpu_devices(8)  # the configs' placements
  length = args.pack_length or (320 if args.workload == "multiturn" else 96)
  args.sft_steps = args.sft_steps or (400 if args.workload == "multiturn" else 300)
  emit({"workload": args.workload, "pack_length": length, "rounds": args.rounds,
        **measure(build(args), args.rounds, args.warmup, length)}, args.json)


if __name__ == "__main__":
  main()
