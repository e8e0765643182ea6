"""User reward functions, named "package.module:function" and called TRL-style, batched:

  def my_reward(prompts: list[str], completions: list[str], **fields) -> list[float]

where each dataset field (e.g. `answer`, `level`) arrives as a list with one value per sample.
A function should accept `**kwargs` so that new dataset columns do not break it.
"""
from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

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


def _one_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _columns(fields: Sequence[Mapping[str, Any]]) -> dict[str, list]:
  """Per-sample dicts -> one list per field name (None where a sample lacks the field)."""
  names = dict.fromkeys(k for f in fields for k in f if k not in _RESERVED)
  return {k: [f.get(k) for f in fields] for k in names}


def _call(fn: Callable, prompts: list[str], completions: list[str], fields) -> Any:
  return fn(prompts=prompts, completions=completions, **_columns(fields))


def _failing_sample(fn, prompts, completions, fields) -> int | None:
  """The first sample on which `fn` raises when called alone, to name it in the error."""
  for i in range(len(prompts)):
    try:
      _call(fn, prompts[i:i + 1], completions[i:i + 1], fields[i:i + 1])
    except Exception:
      return i
  return None


def call_reward_fn(fn: Callable, prompts: Sequence[str], completions: Sequence[str],
                   fields: Sequence[Mapping[str, Any]] | None = None) -> np.ndarray:
  """rewards_B float32 from one batched call `fn(prompts=, completions=, **field_lists)`.

  When the batched call raises, each sample is retried alone to name the first failing one."""
  prompts, completions = list(prompts), list(completions)
  fields = list(fields) if fields is not None else [{} for _ in prompts]
  if not len(prompts) == len(completions) == len(fields):
    raise ValueError(f"call_reward_fn: {len(prompts)} prompts, {len(completions)} completions "
                     f"and {len(fields)} field rows")
  try:
    out = _call(fn, prompts, completions, fields)
  except Exception as e:
    at = _failing_sample(fn, prompts, completions, fields)
    where = f" on sample {at}" if at is not None else ""
    raise RewardFnError(f"reward function {_name(fn)} raised{where} ({_one_line(e)})") from e
  if isinstance(out, (str, bytes, Mapping)) or not hasattr(out, "__len__"):
    raise RewardFnError(f"reward function {_name(fn)} returned a {type(out).__name__}, "
                        f"not a list of {len(prompts)} numbers")
  if hasattr(out, "__array__"):  # numpy or jax arrays: plain Python numbers, one per sample
    array = np.asarray(out)
    if array.ndim != 1:
      raise RewardFnError(f"reward function {_name(fn)} returned an array of shape "
                          f"{array.shape}, not ({len(prompts)},)")
    out = array.tolist()
  out = list(out)
  if len(out) != len(prompts):
    raise RewardFnError(f"reward function {_name(fn)} returned {len(out)} rewards for "
                        f"{len(prompts)} samples")
  for i, value in enumerate(out):
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
      raise RewardFnError(f"reward function {_name(fn)}: sample {i}: returned {value!r}, not a "
                          "finite number")
  return np.asarray(out, np.float32)
