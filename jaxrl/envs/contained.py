"""A user's environment, contained: it lives in a host process the run can kill (hosted.py:
every `reset` and `step` is bounded in time there), and what it returns is checked (a list of
token ids, a finite reward, a bool). When it raises, hangs, dies or returns something else, the
policy decides: "stop" raises an EnvError naming the environment, the call and what went wrong;
"zero" ends that conversation with no further reward and tells `report(1)`. The shipped
environments run in place: the calculator's evaluator bounds every call itself (expression.py)
and the python tool runs its programs in a sandbox (isolation/sandbox.py).
"""
from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable

from isolation.workers import error_line
from jaxrl.envs.base import Environment, Step


class EnvError(ValueError):
  """An environment that cannot be found, loaded or run; one line naming it."""


def _checked_ids(ids, what: str) -> list[int]:
  if isinstance(ids, (str, bytes)) or not all(isinstance(i, numbers.Integral) for i in ids):
    raise TypeError(f"{what} returned {ids!r:.60}, not a list of token ids")
  return [int(i) for i in ids]


def _checked_step(step) -> Step:
  if not isinstance(step, Step):
    raise TypeError(f"step returned a {type(step).__name__}, not a jaxrl.envs.Step")
  try:
    reward = float(step.reward)
  except (TypeError, ValueError, OverflowError):  # e.g. 10**400
    reward = math.nan
  if not isinstance(step.reward, numbers.Real) or not math.isfinite(reward):
    raise TypeError(f"step returned the reward {step.reward!r:.60}, not a finite number")
  if not isinstance(step.done, (bool, numbers.Integral)):
    raise TypeError(f"step returned done={step.done!r:.60}, not a bool")
  return Step(_checked_ids(step.observation, "step"), reward, bool(step.done))


class ContainedEnvironment:
  """`env` behind a time limit and the policy (module docstring)."""

  def __init__(self, env: Environment, *, name: str, policy: str,
               report: Callable[[int], None]):
    self.env, self.name, self.policy, self.report = env, name, policy, report
    self.stop_strings = tuple(env.stop_strings)
    self.failed = False

  def _call(self, what: str, fn, check, *args):
    """`check(fn(*args))`, contained: a raise, a hang (the host's timeout) or a wrong return
    goes to the policy (None when it says go on)."""
    try:
      out = fn(*args)
    except Exception as e:  # noqa: BLE001 - user code: anything, a timeout too
      return self._failed(EnvError(f"environment {self.name}: {what}: {error_line(e)}"))
    try:
      return check(out)
    except TypeError as e:  # a wrong return: what `check` says of it
      return self._failed(EnvError(f"environment {self.name}: {e}"))

  @contextlib.contextmanager
  def uncounted(self):
    """Failures meanwhile are not reported (a replay of calls whose failures already were)."""
    report, self.report = self.report, lambda n: None
    try:
      yield
    finally:
      self.report = report

  def _failed(self, error: EnvError) -> None:
    if self.policy == "stop":
      raise error
    self.failed = True
    self.report(1)

  def reset(self, example) -> list[int]:
    ids = self._call("reset", self.env.reset, lambda ids: _checked_ids(ids, "reset"), example)
    return [] if ids is None else ids

  def step(self, turn_ids: list[int]) -> Step:
    if self.failed:
      return Step([], 0.0, True)
    step = self._call("step", self.env.step, _checked_step, turn_ids)
    return Step([], 0.0, True) if step is None else step
