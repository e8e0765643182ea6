"""How the registries' entries (`ADVANTAGES`, `POLICY_LOSSES`, `ENVIRONMENTS`) are called: each
entry's keyword-only parameters are what it reads, and the caller hands over one mapping of
everything it has (inputs such as `old_BN`, hyperparameters such as `eps_low` or
`max_output_chars`, what the run provides such as its code `sandbox`), of which each entry takes
its own. A new estimator, loss or environment declares a new input by naming it; the code that
calls it names no entry."""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping


@functools.cache
def reads(fn: Callable) -> tuple[tuple[str, bool], ...]:
  """(name, required) of `fn`'s keyword-only parameters."""
  params = inspect.signature(fn).parameters.values()
  return tuple((p.name, p.default is p.empty) for p in params if p.kind is p.KEYWORD_ONLY)


def declared(fn: Callable, available: Mapping) -> dict:
  """The keyword arguments `fn` declares, from `available` (a parameter with a default that
  `available` lacks keeps its default; a required one it lacks is a KeyError naming it)."""
  out = {}
  for name, required in reads(fn):
    if name in available:
      out[name] = available[name]
    elif required:
      raise KeyError(f"{fn.__name__} reads {name!r}, which the caller does not provide")
  return out
