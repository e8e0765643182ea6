"""Synthetic verifiable tasks, generated deterministically from a seed.

Each task yields `Example(prompt, answer)`; the model is asked to emit `answer` then EOS.
Train and held-out sets are disjoint by prompt.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  answer: str


def addition(rng: np.random.Generator, num_digits: int) -> Example:
  a, b = (int(rng.integers(0, 10**num_digits)) for _ in range(2))
  return Example(f"{a}+{b}=", str(a + b))


def reverse(rng: np.random.Generator, num_digits: int) -> Example:
  s = "".join(rng.choice(list("abcdefghij"), size=num_digits))
  return Example(f"rev {s}=", s[::-1])


def sort_digits(rng: np.random.Generator, num_digits: int) -> Example:
  s = "".join(str(d) for d in rng.integers(0, 10, size=num_digits))
  return Example(f"sort {s}=", "".join(sorted(s)))


TASKS: dict[str, Callable[[np.random.Generator, int], Example]] = {
    "addition": addition,
    "reverse": reverse,
    "sort_digits": sort_digits,
}


def make_splits(task: str, num_digits: int, n_train: int, n_heldout: int,
                seed: int) -> tuple[list[Example], list[Example]]:
  """Draws unique prompts until both splits are full; raises if the task space is too small."""
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
  return examples[n_heldout:], examples[:n_heldout]
