"""The shipped environments: a calculator and a Python-expression sandbox (jaxrl/envs/sandbox.py
says why a restricted evaluator rather than a subprocess)."""
from __future__ import annotations

from jaxrl.envs.base import ToolEnvironment
from jaxrl.envs.sandbox import FUNCTIONS, EvalError, run_expression


def _shown(value) -> str:
  """A result as the model reads it: whole floats without their '.0', others to 10 digits."""
  if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
    return str(int(value))
  if isinstance(value, float):
    return f"{value:.10g}"
  return str(value)


class Calculator(ToolEnvironment):
  """`<calc>12*7+3</calc>` -> ` <result>87</result>`: arithmetic only (numbers, + - * / // % **,
  parentheses), for GSM8K-style problems whose numbers outgrow a small model's arithmetic."""
  tag, result_tag = "calc", "result"

  def run(self, text: str) -> str:
    try:
      return _shown(run_expression(text, time_limit_s=0.1))
    except EvalError as e:
      return f"error: {e}"


class PythonSandbox(ToolEnvironment):
  """`<python>sum(i*i for i in range(10))</python>` -> ` <output>285</output>`: one Python
  expression with the whitelisted functions (sandbox.FUNCTIONS), comprehensions over bounded
  ranges, no statements, attributes, imports, files or network, 1 s at most."""
  tag, result_tag = "python", "output"

  def run(self, text: str) -> str:
    try:
      return _shown(run_expression(text, functions=FUNCTIONS, time_limit_s=1.0))
    except EvalError as e:
      return f"error: {e}"
