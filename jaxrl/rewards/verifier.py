"""Verifiers `(response, answer) -> reward`: exact match on the extracted answer, partial
credit by position (`char_match`), or mathematical equivalence (`math`, see
jaxrl/rewards/math.py)."""
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


def char_match(response: str, answer: str) -> float:
  """Partial credit for string answers: the share of positions at which the extracted answer
  has the reference's character, over the longer of the two (a missing or extra character
  counts as a miss); 1.0 exactly when `exact_match` is, for non-numeric answers."""
  got, want = extract_answer(response), answer.strip()
  if not got or not want:
    return float(got == want)
  return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))


VERIFIERS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match,
                                                      "char_match": char_match,
                                                      "math": math_equal}
