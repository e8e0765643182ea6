"""The shipped environments: a calculator (the restricted evaluator of expression.py) and a
Python tool that runs whole programs in the run's sandbox (isolation/sandbox.py)."""
from __future__ import annotations

import signal

from isolation.sandbox import CodeSandbox
from jaxrl.envs.base import MAX_OUTPUT_CHARS, ToolEnvironment
from jaxrl.envs.expression import EvalError, run_expression


def _shown(value) -> str:
  """A result as the model reads it: whole floats without their '.0', others to 10 digits."""
  if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    return str(int(value))
  if isinstance(value, float):
    return f"{value:.10g}"
  return str(value)


class Calculator(ToolEnvironment):
  """`<calc>12*7+3</calc>` -> ` <result>87</result>`: arithmetic only (numbers, + - * / // % **,
  parentheses), for GSM8K-style problems whose numbers outgrow a small model's arithmetic. The
  value is rendered inside the error handling (it is bounded in size by then); the reply is cut
  to `max_output_chars` before it is encoded."""
  tag, result_tag = "calc", "result"

  def run(self, text: str) -> str:
    try:
      return _shown(run_expression(text, functions=None, time_limit_s=0.1))
    except EvalError as e:
      return f"error: {e}"


def _ending(result: dict, cpu_limit_s: int) -> str:
  """How a program ended, as the model reads it after its output ("" for a clean exit or a
  traceback, which the output shows)."""
  status = result["status"]
  if status in (0, 1):
    return ""
  if status == "timeout":
    return "[killed: the time limit]"
  if status == 128 + signal.SIGXCPU or (status == 128 + signal.SIGKILL
                                        and result["cpu_s"] >= cpu_limit_s + 1):
    return f"[killed: the CPU time limit, {cpu_limit_s} s]"
  if isinstance(status, str):  # the sandbox's own failure
    return f"[{status}]"
  if status > 128:
    return f"[ended by signal {status - 128}]"
  return f"[exit status {status}]"


class PythonTool(ToolEnvironment):
  """`<python>print(sum(i*i for i in range(10)))</python>` -> ` <output>285\\n</output>`: a whole
  program (statements, `print`, imports of `sandbox.MODULES`) run in `sandbox`, the run's
  (its conversations share its servers: train/task/processes.py starts it once per run): its
  stdout and stderr (a traceback on an error) and how it ended if not cleanly."""
  tag, result_tag = "python", "output"

  def __init__(self, tok, verifier, *, sandbox: CodeSandbox,
               max_output_chars: int = MAX_OUTPUT_CHARS):
    super().__init__(tok, verifier, max_output_chars=max_output_chars)
    self.sandbox = sandbox

  def run(self, text: str) -> str:
    result = self.sandbox.run(text)
    ending = _ending(result, self.sandbox.config["limits"]["cpu_s"])
    if result["output_bytes"] > len(result["output"].encode()):
      ending = f"[{result['output_bytes']} bytes of output or more; cut] {ending}"
    return result["output"] + ending
