"""A user reward function in place against the same function in worker processes
(isolation/workers.py), alternately in one process: calls per second and the overhead per call.

  python -m benchmarks.user_code --json

The function is GSM8K's answer check (`jaxrl.rewards.math.math_equal` on the completion's
`#### N` line against the reference), called batched as the RL step calls a user verifier:
`--batch` completions (a gsm8k_tools step's 32 prompts x 8 samples) per call, in `--workers`
worker processes, the batch split over them. Reported: calls per second and completions per
second each way, and the pool's extra seconds per call (its round trips, pickling and the
split), measured as the best of `--repeats` calls over `--rounds` alternating rounds; and the
same for a function that does nothing (`lengths`): the pool's round trip alone.
"""
from __future__ import annotations

import argparse

from benchmarks.common import best_seconds, emit


def gsm8k_reward(prompts, completions, answer, **_):
  """1.0 where the completion's `#### N` equals the row's answer (math-verify's equivalence)."""
  from jaxrl.rewards.math import math_equal
  return [float(math_equal(c, a)) for c, a in zip(completions, answer)]


def lengths(prompts, completions, **_):
  """Next to no work: the pool's cost alone."""
  return [float(len(c)) for c in completions]


def _batch(n: int):
  """Synthetic GSM8K rows: every other completion the worked solution, the rest a wrong number."""
  from jaxrl.data.gsm8k_synth import final_answer, generate
  rows = generate(n, seed=0)
  answers = [final_answer(r["answer"]) for r in rows]
  completions = [r["answer"] if i % 2 else f"... #### {int(a) + 1}"
                 for i, (r, a) in enumerate(zip(rows, answers))]
  return [r["question"] for r in rows], completions, [{"answer": a} for a in answers]


def measure(args) -> dict:
  from benchmarks.user_code import gsm8k_reward, lengths  # (by module name, not __main__'s)
  from jaxrl.rewards.user import call_reward_fn
  from isolation.workers import UserCodePool
  prompts, completions, fields = _batch(args.batch)
  names = [f"benchmarks.user_code:{f.__name__}" for f in (gsm8k_reward, lengths)]
  pool = UserCodePool(workers=args.workers, timeout_s=60.0, preload=names)
  call = lambda fn, **kw: lambda: call_reward_fn(fn, prompts, completions, fields, **kw)
  try:
    ways = {"in_place": call(gsm8k_reward), "pool": call(gsm8k_reward, pool=pool),
            "trivial_in_place": call(lengths), "trivial_pool": call(lengths, pool=pool)}
    same = (ways["in_place"]() == ways["pool"]()).all()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.rounds):  # alternate, so that drift on a shared machine hits both
      for name, fn in ways.items():
        best[name] = min(best[name], best_seconds(fn, repeats=args.repeats))
  finally:
    pool.close()
  return {**{f"{k}_calls_per_s": round(1 / v, 2) for k, v in best.items()},
          **{f"{k}_completions_per_s": round(args.batch / v, 1) for k, v in best.items()
             if not k.startswith("trivial")},
          "pool_over_in_place": round(best["in_place"] / best["pool"], 2),
          "pool_round_trip_s": round(best["trivial_pool"] - best["trivial_in_place"], 5),
          "same_rewards": bool(same)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  emit({**measure(args), "batch": args.batch, "workers": args.workers}, args.json)


if __name__ == "__main__":
  main()
