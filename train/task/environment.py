"""The run's environment (`rl.environment.name`): a built-in `ENVIRONMENTS` entry made in place,
given what it declares (its hyperparameters from `rl.environment`, the run's code sandbox), or a
user's class in host processes of the run's own, contained (jaxrl/envs/contained.py)."""
from __future__ import annotations

import dataclasses

from isolation.hosts import HostRestarted, ObjectCallError
from isolation.sandbox import SandboxUnavailable
from isolation.workers import UserCodeTimeout, WorkerDied
from jaxrl.config import ConfigError, ExperimentConfig, first_line
from jaxrl.data.tokenizer import Tokenizer
from jaxrl.envs import ENVIRONMENTS, ContainedEnvironment, EnvError, EnvHosts, environment_factory
from jaxrl.registry import declared, reads
from train.task.data import TaskData
from train.task.processes import UserProcesses
from train.task.reward import counter


def environment_for(cfg: ExperimentConfig, tok: Tokenizer, task: TaskData,
                    processes: UserProcesses):
  """A zero-argument factory of the run's environment (`rl.environment.name`), or None; a user's
  class lives in host processes of `processes` (jaxrl/envs/hosted.py), contained
  (jaxrl/envs/contained.py), its failures counted in the task's `user_code_errors`. One
  environment is made here, so a constructor that fails (or a sandbox the kernel refuses) is a
  one-line config error."""
  rl = cfg.rl
  if not rl.environment.name:
    return None
  options = dataclasses.asdict(rl.environment)  # the hyperparameters an environment declares
  try:
    if rl.environment.name in ENVIRONMENTS or ":" not in rl.environment.name:
      factory = environment_factory(rl.environment.name)
      try:
        keywords = declared(factory, {**options, **_provided(factory, processes)})
      except KeyError as e:  # a keyword nothing provides
        raise EnvError(f"{rl.environment.name}: {e.args[0]}") from None
      factory(tok, task.verifier, **keywords)
      return lambda: factory(tok, task.verifier, **keywords)
    # a user's class: imported in its host processes only (`hosts.new()`, within the time limit)
    hosts = processes.hosts(rl.user_code, rl.environment.name, tok, rl.verifier, options)
    hosts.new()
  except (EnvError, SandboxUnavailable) as e:
    raise ConfigError(f"config.rl.environment.name: {e}") from None
  except (ObjectCallError, UserCodeTimeout, WorkerDied, HostRestarted) as e:
    raise ConfigError(f"config.rl.environment.name: {rl.environment.name}: the constructor failed: "
                      f"{first_line(e)}") from None
  count = counter(task.user_code_errors, "environment")
  return lambda: ContainedEnvironment(_new(hosts), name=rl.environment.name,
                                      policy=rl.user_code.on_error, report=count)


def _provided(factory, processes: UserProcesses) -> dict:
  """What the run provides that `factory` declares: its code sandbox, started for it."""
  return {"sandbox": processes.sandbox()} if "sandbox" in dict(reads(factory)) else {}


def _new(hosts: EnvHosts):
  """A new hosted environment; a failure to make it is the conversation's first failure."""
  try:
    return hosts.new()
  except Exception as e:  # noqa: BLE001 - user code: contained at its first call
    return _Failed(e)


class _Failed:
  """An environment whose construction failed: every call raises what it raised."""
  stop_strings = ()

  def __init__(self, error: Exception):
    self.error = error

  def reset(self, example):
    raise self.error

  def step(self, turn_ids):
    raise self.error


