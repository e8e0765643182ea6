"""`math_equal`: the final answer of a response against a reference, by mathematical equivalence
(Hugging Face `math_verify`: LaTeX and plain expressions parsed to sympy, then compared).

Rewards are computed in worker threads, where math_verify's default `signal.alarm` timeouts
raise, and a timeout would make the reward depend on machine load anyway. So timeouts are off
and inputs are bounded instead, deterministically: only a response's last `_MAX_CHARS`
characters are read (the extraction regexes are quadratic in the worst case), and expressions
that would make sympy build numbers of more than `_MAX_DIGITS` digits (power towers, huge
factorials) or expand to more than `_MAX_TERMS` terms score 0 without being compared. Other
inputs can still be slow (sympy's simplification has no bound), but never by chance.
"""
from __future__ import annotations

import functools
import logging
import math
import re

_MAX_CHARS = 2000
_MAX_DIGITS = 100_000
_MAX_TERMS = 300


@functools.lru_cache(maxsize=1)
def _math_verify():
  """math_verify and its configs, imported on first use: sympy takes about a second to import,
  which every run would pay through the verifier registry otherwise."""
  import math_verify

  # Timeouts are off on purpose (see above); math_verify would warn about it on first use.
  for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).addFilter(lambda r: "Timeout is disabled" not in r.getMessage())
  response = [math_verify.LatexExtractionConfig(boxed_match_priority=0),
              math_verify.ExprExtractionConfig()]
  return math_verify, response


def _log10_size(expr) -> float:
  """An upper bound on the decimal digits of the numbers sympy may build evaluating `expr`."""
  import sympy

  if isinstance(expr, sympy.MatrixBase):
    return sum(_log10_size(e) for e in expr)
  if not isinstance(expr, sympy.Basic):
    return 0.0
  if expr.is_Rational:
    return math.log10(max(abs(int(expr.p)), abs(int(expr.q)), 1))
  if expr.is_Float:
    return math.log10(max(abs(float(expr)), 1.0))
  if isinstance(expr, sympy.Pow):
    base, exponent = expr.args
    exp_size = _log10_size(exponent)
    return math.inf if exp_size > 9 else 10**exp_size * max(_log10_size(base), 0.5)
  if isinstance(expr, (sympy.factorial, sympy.factorial2, sympy.gamma)):
    n = _log10_size(expr.args[0])
    return math.inf if n > 9 else 10**n * (n + 1)
  sizes = [_log10_size(a) for a in expr.args]  # a sum of n terms: up to n times the largest
  return sum(sizes) + (math.log10(len(sizes)) if sizes else 0.0)


def _expanded_terms(expr) -> float:
  """The number of terms `expr` has when expanded: sympy expands while comparing, and a
  multinomial such as (a+b+c+d+e)^16 (4845 terms) takes seconds."""
  import sympy

  if not isinstance(expr, sympy.Basic) or not expr.free_symbols:
    return 1.0
  if isinstance(expr, sympy.Add):
    return sum(_expanded_terms(a) for a in expr.args)
  if isinstance(expr, sympy.Mul):
    return math.prod(_expanded_terms(a) for a in expr.args)
  if isinstance(expr, sympy.Pow) and expr.args[1].is_Integer:
    base, n = _expanded_terms(expr.args[0]), abs(int(expr.args[1]))
    if base == 1.0:
      return 1.0
    return math.inf if base > _MAX_TERMS or n > _MAX_TERMS else float(
        math.comb(n + int(base) - 1, int(base) - 1))
  return max([1.0] + [_expanded_terms(a) for a in expr.args])


def _too_large(parsed: list) -> bool:
  try:
    return any(_log10_size(p) > _MAX_DIGITS or _expanded_terms(p) > _MAX_TERMS for p in parsed)
  except RecursionError:  # a deeply nested expression is no answer either
    return True


def _final_answer(response: str) -> str:
  """The part of a response that holds its final answer: GSM8K's '#### N' line if any (which
  math_verify does not know), else the response's tail."""
  text = response[-_MAX_CHARS:]
  at = text.rfind("####")
  if at >= 0:
    lines = text[at + 4:].strip().splitlines()
    return lines[0] if lines else ""
  return text


def _parse_reference(answer: str) -> list:
  mv, configs = _math_verify()
  # A bare reference such as `\sqrt{2}` has no delimiters for math_verify's LaTeX extraction.
  wrapped = answer if "$" in answer or "\\boxed" in answer else f"\\boxed{{{answer}}}"
  return (mv.parse(wrapped, configs, parsing_timeout=None)
          or mv.parse(answer, configs, parsing_timeout=None))


_ARITHMETIC = re.compile(r"\d[\s\\,{}()]*(?:[-+*/^×÷]|\\times|\\cdot|\\div)[\s\\,{}()]*\d")


def _unevaluated(gold: list, pred: list) -> bool:
  """An integer reference against arithmetic left undone (`967+589` for 1556): math_verify
  evaluates it and calls it equal, so a policy could score by copying the question's numbers
  into an expression (one did: docs/environments.md). An answer must be stated, not computed by
  the verifier; fractions, percentages and roots are answers."""
  g, p = gold[0], pred[0]
  return (getattr(g, "is_Integer", False) and not getattr(p, "is_Number", False)
          and bool(_ARITHMETIC.search(str(pred[-1]).rsplit("=", 1)[-1])))  # "12*5 = 60" is 60


def math_equal(response: str, answer: str) -> float:
  """1.0 when the response's final answer equals the reference mathematically.

  The final answer is GSM8K's `#### N`, else (by math_verify's priorities) the last `\\boxed{}`,
  an 'answer is N' / 'final answer is N' phrase, the last LaTeX expression, or the last number.
  `1,000` = `1000`, `$5` = `5 dollars` = `5`, `0.5` = `\\frac{1}{2}`, `50%` = `50` = `0.5`; but
  `967+589` is not `1556` (arithmetic left undone is no answer to an integer question)."""
  mv, configs = _math_verify()
  gold = _parse_reference(answer.strip()[:_MAX_CHARS])
  pred = mv.parse(_final_answer(response), configs, parsing_timeout=None)
  if not gold or not pred or _unevaluated(gold, pred):
    return 0.0
  if _too_large(gold) or _too_large(pred):
    # Too costly to compare: only the same text (parse's last item is the matched string) counts.
    return float(str(gold[-1]).strip() == str(pred[-1]).strip() != "")
  return float(mv.verify(gold, pred, timeout_seconds=None))
