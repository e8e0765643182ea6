"""Verifiers `(response, answer) -> reward`: exact match on the extracted answer, or
mathematical equivalence (`math`, see jaxrl/rewards/math.py)."""
from __future__ import annotations

import re
from collections.abc import Callable

from jaxrl.rewards.math import math_equal

_MARKERS = ("####", "answer:", "answer is")


def extract_answer(response: str) -> str:
  """The answer after the last marker ('####', 'answer:', 'answer is') or else the first line."""
  text = response.strip()
  lowered = text.lower()
  for marker in _MARKERS:
    at = lowered.rfind(marker)
    if at >= 0:
      text = text[at + len(marker):].strip()
      break
  text = text.splitlines()[0].strip() if text else ""
  return text.rstrip(".")


def _normalise(answer: str) -> str:
  answer = answer.strip().replace(",", "") if re.fullmatch(r"[-+]?[\d,]+", answer.strip()) else answer
  if re.fullmatch(r"[-+]?\d+", answer):
    return str(int(answer))
  return answer.strip()


def exact_match(response: str, answer: str) -> float:
  """1.0 when the extracted answer equals the reference (integers compared by value)."""
  got = extract_answer(response)
  return float(bool(got) and _normalise(got) == _normalise(answer))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match,
                                                      "math": math_equal}
