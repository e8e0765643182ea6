"""Environments stepped once for a group of processes: where several processes hold the mesh a
conversation decodes on, each builds the same conversations in the same order, but only the
group's first process runs an environment's `reset` and `step`; it posts what they return in
the coordination service's key-value store (sharding/crossing.py `Mailbox`), and the others
take it. A tool with side effects (the code sandbox) then runs once, and every process appends
the same observation ids, whatever a tool's timing or randomness.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from jaxrl.envs import EnvError, Environment, Step
from sharding import crossing


class SharedEnvironment:
  """One conversation's environment, stepped by the group's first process (`leader`)."""

  def __init__(self, env: Environment, mailbox: crossing.Mailbox, name: str, leader: bool):
    """`mailbox`: the group's, shared by its environments; `name`: this one's, in it."""
    self._env, self._mailbox, self._leader, self._calls = env, mailbox, leader, 0
    self._name, self.stop_strings = name, env.stop_strings

  def _shared(self, call: Callable[[], dict]) -> dict:
    key, self._calls = f"{self._name}/{self._calls}", self._calls + 1
    if not self._leader:
      return self._mailbox.take(key)
    try:
      out = call()
    except EnvError as e:  # (every process raises it: the run stops or scores 0 alike)
      self._mailbox.post(key, {"error": str(e)})
      raise
    self._mailbox.post(key, out)
    return out

  def reset(self, example) -> list[int]:
    out = self._shared(lambda: {"ids": [int(i) for i in self._env.reset(example)]})
    if "error" in out:
      raise EnvError(out["error"])
    return out["ids"]

  def step(self, turn_ids: list[int]) -> Step:
    def call():
      s = self._env.step(turn_ids)
      return {"observation": [int(i) for i in s.observation], "reward": float(s.reward),
              "done": bool(s.done)}
    out = self._shared(call)
    if "error" in out:
      raise EnvError(out["error"])
    return Step(out["observation"], out["reward"], out["done"])


def shared(factory: Callable[[], Environment], group: str,
           leader: bool) -> Callable[[], SharedEnvironment]:
  """`factory`'s environments, stepped once for the processes of `group` (named apart from
  other groups), by its first process (`leader`)."""
  ids, mailbox = itertools.count(), crossing.Mailbox(f"env/{group}", keep=1 << 16)
  return lambda: SharedEnvironment(factory(), mailbox, str(next(ids)), leader)
