"""The config's checks: `ConfigError` (a user's mistake: one line, exit code 2) and the field
checks every config section's `__post_init__` runs, each a ValueError naming the field."""
from __future__ import annotations


class ConfigError(ValueError):
  """A user error in the config: reported in one line, exit code 2."""


def first_line(error: BaseException) -> str:
  """An exception's first line (its type when it has no message): for one-line reports."""
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def choice(obj, name: str, options) -> None:
  if getattr(obj, name) not in options:
    raise ValueError(f"{name}: expected one of {sorted(options)}, got {getattr(obj, name)!r}")


def check(obj, names, ok, expected: str) -> None:
  for name in names:
    if not ok(getattr(obj, name)):
      raise ValueError(f"{name}: expected {expected}, got {getattr(obj, name)!r}")


positive = lambda obj, *names: check(obj, names, lambda v: v > 0, "> 0")  # noqa: E731
at_least_zero = lambda obj, *names: check(obj, names, lambda v: v >= 0, ">= 0")  # noqa: E731
unit = lambda obj, *names: check(obj, names, lambda v: 0 <= v <= 1, "in [0, 1]")  # noqa: E731
