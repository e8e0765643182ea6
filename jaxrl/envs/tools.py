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


def evaluated(text: str, functions: dict | None, time_limit_s: float) -> str:
  """The expression's value as the model reads it, or `error: REASON`: rendered inside the
  error handling (the value is bounded in size by then; the reply is cut to
  `base.MAX_OUTPUT_CHARS` before it is encoded)."""
  try:
    return _shown(run_expression(text, functions=functions, time_limit_s=time_limit_s))
  except EvalError as e:
    return f"error: {e}"


class Calculator(ToolEnvironment):
  """`<calc>12*7+3</calc>` -> ` <result>87</result>`: arithmetic only (numbers, + - * / // % **,
  parentheses), for GSM8K-style problems whose numbers outgrow a small model's arithmetic."""
  tag, result_tag = "calc", "result"

  def run(self, text: str) -> str:
    return evaluated(text, None, time_limit_s=0.1)


class PythonSandbox(ToolEnvironment):
  """`<python>sum(i*i for i in range(10))</python>` -> ` <output>285</output>`: one Python
  expression with the whitelisted functions (sandbox.FUNCTIONS), comprehensions over bounded
  ranges, no statements, attributes, imports, files or network, 1 s at most."""
  tag, result_tag = "python", "output"

  def run(self, text: str) -> str:
    return evaluated(text, FUNCTIONS, time_limit_s=1.0)
