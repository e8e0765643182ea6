"""User reward functions, named "package.module:function" and called TRL-style, batched:

  def my_reward(prompts: list[str], completions: list[str], **fields) -> list[float]

where each dataset field (e.g. `answer`, `level`) arrives as a list with one value per sample.
A function should accept `**kwargs` so that new dataset columns do not break it.
"""
from __future__ import annotations

import importlib
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

POLICIES = ("stop", "zero")  # what a misbehaving user function does to the run
# Names the call itself passes; dataset fields with these names are not forwarded.
_RESERVED = ("prompts", "completions")


class RewardFnError(ValueError):
  """A reward function that cannot be loaded or that misbehaved; one line naming it."""


def load_reward_fn(spec: str) -> Callable[..., Any]:
  """Imports `module:attribute` (the attribute may be dotted, e.g. `mod:Class.method`)."""
  return load_callable(spec, "reward function", "package.module:function", RewardFnError)


def load_callable(spec: str, what: str, form: str, error: type[Exception]) -> Callable[..., Any]:
  """The callable `spec` names as "module:attribute"; anything wrong is an `error` whose one
  line names `what` and `spec`."""
  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise error(f"{what} {spec!r}: expected {form!r}")
  try:
    obj = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):
      raise error(f"{what} {spec!r}: no module named {e.name!r}") from None
    raise error(f"{what} {spec!r}: importing {module_name!r} failed "
                f"({type(e).__name__}: {e})") from None
  except Exception as e:  # the module's own code failed at import
    raise error(f"{what} {spec!r}: importing {module_name!r} failed "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise error(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise error(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
  return obj


def _name(fn: Callable) -> str:
  return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def error_line(e: BaseException) -> str:
  """`Type: first line of the message` (the type alone when it has none)."""
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _columns(fields: Sequence[Mapping[str, Any]]) -> dict[str, list]:
  """Per-sample dicts -> one list per field name (None where a sample lacks the field)."""
  names = dict.fromkeys(k for f in fields for k in f if k not in _RESERVED)
  return {k: [f.get(k) for f in fields] for k in names}


def _call(fn: Callable, prompts: list[str], completions: list[str], fields) -> Any:
  return fn(prompts=prompts, completions=completions, **_columns(fields))


def _values(fn: Callable, out: Any, n: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
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


def call_reward_fn(fn: Callable, prompts: Sequence[str], completions: Sequence[str],
                   fields: Sequence[Mapping[str, Any]] | None = None, *,
                   timeout_s: float | None = None, policy: str = "stop",
                   report: Callable[[int], None] | None = None) -> np.ndarray:
  """rewards_B float32 from one batched call `fn(prompts=, completions=, **field_lists)`, run
  with `timeout_s` (the call is abandoned when it runs over: a hang cannot stall the run).

  What goes wrong is named with the sample's index: a raise (each sample is then retried alone
  to find it), a timeout, a wrong type, shape or length, a NaN. `policy="stop"` raises a
  RewardFnError; `"zero"` scores those samples 0 and tells `report(count)`."""
  prompts, completions = list(prompts), list(completions)
  fields = list(fields) if fields is not None else [{} for _ in prompts]
  n = len(prompts)
  if not n == len(completions) == len(fields):
    raise ValueError(f"call_reward_fn: {n} prompts, {len(completions)} completions and "
                     f"{len(fields)} field rows")
  try:
    rewards, bad = _values(fn, call_with_timeout(_call, timeout_s, fn, prompts, completions,
                                                 fields), n)
  except UserCodeTimeout as e:
    rewards, bad = np.zeros(n, np.float32), [(i, str(e)) for i in range(n)]
  except Exception as e:
    rewards, bad = _each_alone(fn, prompts, completions, fields, timeout_s, e)
  if bad and policy == "stop":
    at, message = bad[0]
    where = "" if len(bad) == n and at == 0 and n > 1 else f" on sample {at}"
    raise RewardFnError(f"reward function {_name(fn)}{where}: {message}")
  if bad and report is not None:
    report(len(bad))
  return rewards


def _each_alone(fn, prompts, completions, fields, timeout_s, error: Exception):
  """After a batched call raised: every sample alone, the ones that raise scored 0."""
  rewards, bad = np.zeros(len(prompts), np.float32), []
  for i in range(len(prompts)):
    try:
      value, wrong = _values(fn, call_with_timeout(_call, timeout_s, fn, prompts[i:i + 1],
                                                   completions[i:i + 1], fields[i:i + 1]), 1)
    except Exception as e:  # noqa: BLE001 - user code: anything, a timeout too
      bad.append((i, f"raised {error_line(e)}"))
      continue
    rewards[i] = value[0]
    bad += [(i, message) for _, message in wrong]
  if not bad:  # every sample passes alone: the batch as a whole was the problem
    bad = [(0, f"raised {error_line(error)} on the batch, not on any sample alone")]
  return rewards, bad


class UserCodeTimeout(TimeoutError):
  """A user function that did not return in time (its thread is abandoned, not waited for)."""


def call_with_timeout(fn: Callable, timeout_s: float | None, *args, **kwargs):
  """`fn(*args, **kwargs)` in a daemon thread, or UserCodeTimeout after `timeout_s` seconds
  (None: no limit, called in place). A Python thread cannot be killed: a function that hangs
  goes on in the background, but the run does not wait for it."""
  if timeout_s is None:
    return fn(*args, **kwargs)
  box: dict = {}

  def run():
    try:
      box["out"] = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller
      box["error"] = e

  thread = threading.Thread(target=run, name="user-code", daemon=True)
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise UserCodeTimeout(f"did not return within {timeout_s:g} s")
  if "error" in box:
    raise box["error"]
  return box["out"]
