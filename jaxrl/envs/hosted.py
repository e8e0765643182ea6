"""A user's environments in host processes the run can kill (isolation/hosts.py).

`EnvHosts` starts the hosts of the class `spec` names ("package.module:Class"); each host imports
it (nowhere else does) and builds its environments with the run's tokenizer and verifier, rebuilt
there by name (a built-in verifier, or a user's function imported there). An environment lives in
one host; its `reset` and `step` are messages of plain data (token ids, the dataset row, a
`Step`), bounded in time there: a call that hangs has its host killed and replaced
(`UserCodeTimeout`; the other conversations held there end with `HostRestarted`), a host that
died is a `WorkerDied`, and what the environment raised an `ObjectCallError`.
"""
from __future__ import annotations

from collections.abc import Callable

from isolation.hosts import Hosted, ObjectHosts
from isolation.workers import load_callable
from jaxrl.envs.base import Environment, Step
from jaxrl.registry import declared


def host_verifier(spec: str) -> Callable[[str, str], float]:
  """In a host: the run's verifier by name, or the user's reward function `spec` called on one
  completion (its `answer` field the reference)."""
  if ":" not in spec:
    from jaxrl.rewards.verifier import VERIFIERS
    return VERIFIERS[spec]
  fn = load_callable(spec, "reward function", "module:function", ValueError)
  import numpy as np
  return lambda text, answer: float(np.asarray(fn([""], [text], answer=[answer]),
                                               np.float64).reshape(-1)[0])


def environment_maker(spec: str, tok, verifier_spec: str, options: dict
                      ) -> Callable[[], Environment]:
  """In a host, once: the class `spec` imported, and a maker of its environments (constructed
  with the tokenizer, the verifier and the keyword arguments it declares, from `options`: the
  run's `rl.environment` as plain data)."""
  factory = load_callable(spec, "environment", "package.module:Class", ValueError)
  verifier, keywords = host_verifier(verifier_spec), declared(factory, options)
  return lambda: factory(tok, verifier, **keywords)


class EnvHosts(ObjectHosts):
  """Host processes of the environment class `spec`, built with `tok`, the verifier
  `verifier_spec` and what it declares of `options` (plain data: `rl.environment`'s fields),
  under the limits of `ObjectHosts` (`workers`, `timeout_s`, `memory_gb`, ...)."""

  def __init__(self, spec: str, tok, verifier_spec: str, options: dict | None = None, **limits):
    super().__init__(environment_maker, (spec, tok, verifier_spec, dict(options or {})),
                     attribute_names=("stop_strings",), what="environment hosts", **limits)

  def new(self) -> HostedEnvironment:
    return HostedEnvironment(super().new())


class HostedEnvironment:
  """One environment in a host: the Environment protocol over messages."""

  def __init__(self, handle: Hosted):
    self.handle = handle
    self.stop_strings = tuple(handle.attributes[0])

  def reset(self, example) -> list[int]:
    return self.handle.call("reset", example)

  def step(self, turn_ids: list[int]) -> Step:
    return self.handle.call("step", list(turn_ids))
