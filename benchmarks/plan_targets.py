"""The planner's best plans for a config on a TPU slice, each compiled by the TPU compiler on this
CPU: what the planner predicts (per-device peak, update and scoring seconds) against what the
compiler says (its busiest device, its programs' time estimates: train/preflight/target_report.py).

  python -m benchmarks.plan_targets --config=configs/llama3_1_8b_gsm8k.py --target=v5p-16 --json

The search is `jaxrl-plan --device=tpu_v5p --devices=CHIPS`'s (presets only, the config's RL
mode). Programs the plans share (the sampler's, the scoring passes when only the update differs)
compile once. Tens of minutes per plan at 7B/8B on a 2-core machine.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import emit

GIB = 1 << 30
DEVICE_OF = {"v4": "tpu_v4", "v5e": "tpu_v5e", "v5p": "tpu_v5p", "v6e": "tpu_v6e"}


def ranked_plans(cfg, target, top: int):
  from planner.cost import Workload
  from planner.plan import builtin_calibration
  from planner.search import search
  cal = builtin_calibration(DEVICE_OF[target.generation])
  return search(Workload.from_config(cfg, cal.device.platform), target.chips, cal.device,
                cal.efficiency,
                modes=(cfg.rl.schedule.mode,), top=top, staleness=cfg.rl.schedule.max_staleness)


def compared(rank: int, ranked, run) -> dict:
  """One plan: the planner's numbers beside the compiler's."""
  from train.preflight.target_report import summary
  s = summary(run)
  per_step = lambda names: sum(p["seconds"] for p in s["programs"] if p["name"] in names)
  planned = ranked.stages
  return {"rank": rank, "plan": ranked.plan.describe(), "planner_step_s": ranked.step_s,
          "planner_peak_gib": max(ranked.memory.values()) / GIB,
          "compiler_peak_gib": s["worst_bytes"] / GIB, "compiler_peak_phase": s["worst_phase"],
          "planner_update_s": planned["update"],
          "compiler_update_s": per_step(("actor update",)),
          "planner_scoring_s": planned["reference"] + planned["old_logprobs"],
          "compiler_scoring_s": per_step(("reference log-probs", "old log-probs")),
          "compile_seconds": sum(p["compile_seconds"] for p in s["programs"]),
          "summary": s}


def markdown(rows: list[dict]) -> list[str]:
  lines = ["| rank | plan | peak GiB: planner / compiler | update s: planner / compiler | "
           "scoring s: planner / compiler |", "|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['rank']} | {r['plan']} | {r['planner_peak_gib']:.1f} / "
                 f"{r['compiler_peak_gib']:.1f} | {r['planner_update_s']:.2f} / "
                 f"{r['compiler_update_s']:.2f} | {r['planner_scoring_s']:.2f} / "
                 f"{r['compiler_scoring_s']:.2f} |")
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/llama3_1_8b_gsm8k.py")
  parser.add_argument("--target", default="v5p-16")
  parser.add_argument("--top", type=int, default=3)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args()
  from sharding.host import cpu_only_here
  cpu_only_here()
  from train.cli.flags import load_config_file
  from train.preflight.target_compile import compile_run
  from jaxrl.config_files import resolve
  from planner.plan import applied
  from planner.targets import parse_target
  target = parse_target(args.target)
  cfg = resolve(load_config_file(args.config), hf=False)
  memo, rows = {}, []
  for i, r in enumerate(ranked_plans(cfg, target, args.top), 1):
    print(f"plan_targets: {i}. {r.plan.describe()}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    rows.append(compared(i, r, compile_run(applied(cfg, r.plan), target, memo)))
    rows[-1]["wall_seconds"] = time.perf_counter() - start
    print(markdown(rows)[-1], file=sys.stderr, flush=True)
  print("\n".join(markdown(rows)))
  emit({"config": args.config, "target": args.target, "plans": rows}, args.json)


if __name__ == "__main__":
  main()
