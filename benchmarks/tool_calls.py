"""Tool calls per second: the calculator in place, the same calculator as a user environment in
host processes (jaxrl/envs/hosted.py), and the Python tool's sandboxed programs
(isolation/sandbox.py), alternately in one process.

  python -m benchmarks.tool_calls --json

The calls are gsm8k_tools' (configs/gsm8k_tools.py): the worked solutions' turns of
`gsm8k_synth.generate`, each ending at a `<calc>a*b</calc>` call, stepped one after another as
a multi-turn rollout steps its rows; for the Python tool the same calls as programs,
`<python>print(a*b)</python>`. Byte tokenizer (the run's BPE costs the same each way).
Reported: calls per second each way and the extra milliseconds per call of the host (its
round trip) and of the sandbox (a fork in a warm server, namespaces, limits), best of
`--rounds` alternating rounds of `--calls` calls.
"""
from __future__ import annotations

import argparse
import re
import time

from benchmarks.common import emit


def _turns(n: int) -> list[str]:
  """The first `n` calculator turns of the synthetic GSM8K solutions, each ending at its call."""
  from jaxrl.data.gsm8k_synth import generate, tool_calls
  turns = []
  for seed in range(100):
    for row in generate(64, seed=seed):
      text = tool_calls(row["answer"])
      turns += [t + "</calc>" for t in text.split("</calc>")[:-1]]
    if len(turns) >= n:
      return turns[:n]
  return turns


def _stepper(env, turns_ids):
  from jaxrl.data.tasks import Example

  def run():
    for ids in turns_ids:
      env.reset(Example("?", "0"))
      env.step(ids)
  return run


def measure(args) -> dict:
  from jaxrl.data.tokenizer import ByteTokenizer
  from jaxrl.envs import Calculator, EnvHosts, PythonTool
  from isolation.sandbox import CodeSandbox
  from jaxrl.rewards.math import math_equal
  tok = ByteTokenizer()
  turns = _turns(args.calls)
  programs = [re.sub(r"<calc>(.*)</calc>$", r"<python>print(\1)</python>", t) for t in turns]
  hosts = EnvHosts("jaxrl.envs.tools:Calculator", tok, "math", workers=1, timeout_s=60.0)
  sandbox = CodeSandbox(workers=1)
  try:
    envs = {"in_place": (Calculator(tok, math_equal), turns), "hosted": (hosts.new(), turns),
            "python_tool": (PythonTool(tok, math_equal, sandbox=sandbox), programs)}
    assert envs["hosted"][0].step(tok.encode(turns[0])) == envs["in_place"][0].step(
        tok.encode(turns[0]))
    ways = {k: _stepper(env, [tok.encode(t) for t in ts]) for k, (env, ts) in envs.items()}
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.rounds):  # alternate, so that drift on a shared machine hits all
      for name, fn in ways.items():
        t0 = time.perf_counter()
        fn()
        best[name] = min(best[name], (time.perf_counter() - t0) / len(turns))
  finally:
    hosts.close()
    sandbox.close()
  return {**{f"{k}_calls_per_s": round(1 / v, 1) for k, v in best.items()},
          "hosted_overhead_ms_per_call": round(1e3 * (best["hosted"] - best["in_place"]), 3),
          "python_tool_ms_per_call": round(1e3 * best["python_tool"], 3),
          "calls": len(turns), "rounds": args.rounds}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args(argv)
  emit(measure(args), args.json)


if __name__ == "__main__":
  main()
