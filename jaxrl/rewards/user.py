"""User reward functions, named "package.module:function" and called TRL-style, batched:

  def my_reward(prompts: list[str], completions: list[str], **fields) -> list[float]

where each dataset field (e.g. `answer`, `level`) arrives as a list with one value per sample.
A function should accept `**kwargs` so that new dataset columns do not break it.
"""
from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from isolation.workers import UserCodePool, UserCodeTimeout, WorkerDied, error_line, load_callable

POLICIES = ("stop", "zero")  # what a misbehaving user function does to the run
# Names the call itself passes; dataset fields with these names are not forwarded.
_RESERVED = ("prompts", "completions")


class RewardFnError(ValueError):
  """A reward function that cannot be loaded or that misbehaved; one line naming it."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
  """Imports `module:attribute` (the attribute may be dotted, e.g. `mod:Class.method`)."""
  return load_callable(spec, "reward function", "package.module:function", RewardFnError)


def _name(fn: Callable) -> str:
  return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def columns(fields: Sequence[Mapping[str, Any]], reserved: Sequence[str]) -> dict[str, list]:
  """Per-sample dicts -> one list per field name (None where a sample lacks the field)."""
  names = dict.fromkeys(k for f in fields for k in f if k not in reserved)
  return {k: [f.get(k) for f in fields] for k in names}


def _values(out: Any, n: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
  """The rewards a call returned, and what was wrong, per sample ((index, message); a wrong
  type, shape or length is wrong for every sample). Bad samples' rewards are 0."""
  if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
    return np.zeros(n, np.float32), [(i, f"returned a {type(out).__name__}, not a list of {n} "
                                        "numbers") for i in range(n)]
  if hasattr(out, "__array__"):  # numpy or jax arrays: plain Python numbers, one per sample
    array = np.asarray(out)
    if array.ndim != 1:
      return np.zeros(n, np.float32), [(i, f"returned an array of shape {array.shape}, not "
                                          f"({n},)") for i in range(n)]
    out = array.tolist()
  out = list(out)
  if len(out) != n:
    return np.zeros(n, np.float32), [(i, f"returned {len(out)} rewards for {n} samples")
                                     for i in range(n)]
  bad = [(i, f"returned {v!r}, not a finite number") for i, v in enumerate(out)
         if not isinstance(v, numbers.Real) or not math.isfinite(float(v))]
  skip = {i for i, _ in bad}
  return np.asarray([0.0 if i in skip else float(v) for i, v in enumerate(out)], np.float32), bad


def call_reward_fn(fn: Callable | None, prompts: Sequence[str], completions: Sequence[str],
                   fields: Sequence[Mapping[str, Any]] | None = None, *,
                   pool: UserCodePool | None = None, spec: str = "", group: int = 1,
                   policy: str = "stop", report: Callable[[int], None] | None = None
                   ) -> np.ndarray:
  """rewards_B float32 from batched calls `fn(prompts=, completions=, **field_lists)`: in place,
  or with `pool` in its worker processes (found there by `spec`, "module:name", default
  `fn`'s own; `fn` may then be None: this process need not import it), the batch split over the workers in whole groups of `group` rows (a group's
  samples, adjacent, stay in one call), each call under the pool's time limit (over it, the
  worker is killed).

  What goes wrong is named with the sample's index: a raise (each sample of that part is then
  retried alone, all at once, within two more time limits), a timeout, a worker that died, a
  wrong type, shape or length, a NaN. `policy="stop"` raises a RewardFnError; `"zero"` scores
  those samples 0 and tells `report(count)`."""
  prompts, completions = list(prompts), list(completions)
  fields = list(fields) if fields is not None else [{} for _ in prompts]
  n = len(prompts)
  if not n == len(completions) == len(fields):
    raise ValueError(f"call_reward_fn: {n} prompts, {len(completions)} completions and "
                     f"{len(fields)} field rows")
  parts = _parts(n, pool.workers if pool else 1, group)
  name = spec or _name(fn)
  call = _caller(fn, pool, name, prompts, completions, columns(fields, _RESERVED))
  outcomes = call(parts)
  rewards, bad, retry = np.zeros(n, np.float32), [], []
  for (a, b), (out, error) in zip(parts, outcomes):
    if error is None:
      rewards[a:b], wrong = _values(out, b - a)
      bad += [(a + i, message) for i, message in wrong]
    elif isinstance(error, _CONTAINED):
      bad += [(i, str(error)) for i in range(a, b)]
    else:
      retry += [(i, error) for i in range(a, b)]
  if retry:
    bad += _each_alone(call, retry, rewards, pool)
  if bad and policy == "stop":
    at, message = min(bad)
    where = "" if len(bad) == n and at == 0 and n > 1 else f" on sample {at}"
    raise RewardFnError(f"reward function {name}{where}: {message}")
  if bad and report is not None:
    report(len(bad))
  return rewards


_CONTAINED = (UserCodeTimeout, WorkerDied)  # what the pool stopped, not what the code raised


def _parts(n: int, ways: int, group: int) -> list[tuple[int, int]]:
  """[a, b) ranges splitting n samples `ways` ways in whole groups (none empty)."""
  group = max(1, group)
  per_way = -(-n // max(1, ways))
  size = max(1, -(-per_way // group) * group)
  return [(a, min(n, a + size)) for a in range(0, n, size)] or [(0, 0)]


def _caller(fn, pool, spec: str, prompts, completions, field_lists: dict):
  """`call(parts, deadline=None)`: (returned value, None) or (None, exception) per [a, b)
  part; the field lists' names are the whole batch's, in every part."""
  def sliced(a, b):
    return dict(prompts=prompts[a:b], completions=completions[a:b],
                **{k: v[a:b] for k, v in field_lists.items()})

  def call(parts, deadline=None):
    if pool is not None:
      return pool.results([pool.submit(spec, **sliced(a, b)) for a, b in parts], deadline)
    out = []
    for a, b in parts:
      try:
        out.append((fn(**sliced(a, b)), None))
      except Exception as e:  # noqa: BLE001 - user code: anything
        out.append((None, e))
    return out
  return call


def _each_alone(call, retry, rewards, pool):
  """After parts of the batch raised: each of their samples alone, all at once, the round
  within two time limits (so a bad batch costs at most three); the ones that fail score 0."""
  deadline = None if pool is None else time.monotonic() + 2 * pool.timeout_s
  outcomes = call([(i, i + 1) for i, _ in retry], deadline)
  bad = []
  for (i, _), (out, error) in zip(retry, outcomes):
    if error is not None:
      bad.append((i, str(error) if isinstance(error, _CONTAINED) else
                  f"raised {error_line(error)}"))
      continue
    value, wrong = _values(out, 1)
    rewards[i] = value[0]
    bad += [(i, message) for _, message in wrong]
  if not bad:  # every sample passes alone: the batch as a whole was the problem
    bad = [(retry[0][0], f"raised {error_line(retry[0][1])} on the batch, not on any sample "
                         "alone")]
  return bad
