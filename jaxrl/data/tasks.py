"""Synthetic verifiable tasks, generated deterministically from a seed.

Each task yields `Example(prompt, answer, mistake)`; the model is asked to emit `answer` then EOS.
`mistake` is the systematic error an imperfect teacher makes on that prompt (a dropped carry, a
mis-ordered pair), or "" where the teacher cannot go wrong that way. SFT demonstrations come from
that teacher (`demo`), so SFT data can be as imperfect as real demonstrations are, while rewards and
held-out accuracy always check the true `answer`. Train and held-out sets are disjoint by prompt.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  answer: str
  mistake: str = ""
  demo: str = ""  # the SFT target; the teacher's answer (== answer unless it erred)
  # A dataset row's fields, for user reward functions. Left out of ==/hash: rows hold lists.
  fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @property
  def target(self) -> str:
    return self.demo or self.answer


def addition(rng: np.random.Generator, num_digits: int) -> Example:
  a, b = (int(rng.integers(0, 10**num_digits)) for _ in range(2))
  carries = a % 10 + b % 10 >= 10
  return Example(f"{a}+{b}=", str(a + b), mistake=str(a + b - 10) if carries else "")


def reverse(rng: np.random.Generator, num_digits: int) -> Example:
  s = "".join(rng.choice(list("abcdefghij"), size=num_digits))
  wrong = s[-2::-1] + s[-1]  # reverses all but the last character
  return Example(f"rev {s}=", s[::-1], mistake=wrong if wrong != s[::-1] else "")


TAIL_EXPONENT = 2.0  # reverse_tail: P(length L) proportional to L ** -TAIL_EXPONENT


def reverse_tail(rng: np.random.Generator, num_digits: int) -> Example:
  """`reverse` with a long tail of lengths: L in [2, num_digits] with P(L) ~ L^-2, so most
  answers are a few letters and a few are num_digits (a workload of uneven response lengths:
  with num_digits=32 the mean is ~5, a 512-row batch's longest ~30)."""
  lengths = np.arange(2, max(num_digits, 2) + 1)
  p = lengths.astype(float) ** -TAIL_EXPONENT
  return reverse(rng, int(rng.choice(lengths, p=p / p.sum())))


def sort_digits(rng: np.random.Generator, num_digits: int) -> Example:
  s = "".join(str(d) for d in rng.integers(0, 10, size=num_digits))
  answer = "".join(sorted(s))
  wrong = answer[:-2] + answer[-1] + answer[-2]  # last two swapped
  return Example(f"sort {s}=", answer, mistake=wrong if wrong != answer else "")


TASKS: dict[str, Callable[[np.random.Generator, int], Example]] = {
    "addition": addition,
    "reverse": reverse,
    "reverse_tail": reverse_tail,
    "sort_digits": sort_digits,
}


def make_splits(task: str, num_digits: int, n_train: int, n_heldout: int, seed: int,
                teacher_error: float = 0.0) -> tuple[list[Example], list[Example]]:
  """Draws unique prompts until both splits are full; raises if the task space is too small.

  With probability `teacher_error` a training example's demo is its `mistake` (where it has one).
  """
  if task not in TASKS:
    raise ValueError(f"task.name: expected one of {sorted(TASKS)}, got {task!r}")
  rng = np.random.default_rng(seed)
  seen: dict[str, Example] = {}
  want, tries = n_train + n_heldout, 0
  while len(seen) < want:
    ex = TASKS[task](rng, num_digits)
    seen.setdefault(ex.prompt, ex)
    tries += 1
    if tries > 20 * want:
      raise ValueError(f"task {task!r} with num_digits={num_digits} has fewer than {want} "
                       f"distinct prompts; lower task.n_train or task.n_heldout")
  examples = list(seen.values())
  errs = rng.random(len(examples)) < teacher_error
  train = [dataclasses.replace(ex, demo=ex.mistake if err and ex.mistake else ex.answer)
           for ex, err in zip(examples[n_heldout:], errs[n_heldout:])]
  return train, examples[:n_heldout]
