"""Environments for multi-turn rollouts: the protocol (base.py), a calculator and a sandboxed
Python tool (tools.py), a speed workload (synthetic.py), chosen by name from `ENVIRONMENTS`,
or a user's class "package.module:Class" (constructed with the tokenizer and the run's
verifier, in a host process: hosted.py)."""
from __future__ import annotations

from isolation.workers import load_callable
from jaxrl.envs.base import Environment, EnvironmentFactory, Step, ToolEnvironment
from jaxrl.envs.contained import ContainedEnvironment, EnvError
from jaxrl.envs.hosted import EnvHosts
from jaxrl.envs.synthetic import FixedReplies, LongTail, ShortReplies
from jaxrl.envs.tools import Calculator, PythonTool

ENVIRONMENTS: dict[str, EnvironmentFactory] = {"calculator": Calculator, "python": PythonTool,
                                               "synthetic": FixedReplies,
                                               "synthetic_longtail": LongTail,
                                               "synthetic_short": ShortReplies}


def environment_factory(spec: str) -> EnvironmentFactory:
  """`ENVIRONMENTS[spec]`, or the class `spec` names as "package.module:Class"."""
  if spec in ENVIRONMENTS:
    return ENVIRONMENTS[spec]
  if ":" not in spec:
    raise EnvError(f"environment {spec!r}: expected one of {sorted(ENVIRONMENTS)} or "
                   "'package.module:Class'")
  return load_callable(spec, "environment", "package.module:Class", EnvError)


__all__ = ["ENVIRONMENTS", "Calculator", "ContainedEnvironment", "EnvHosts", "Environment",
           "EnvError", "EnvironmentFactory", "PythonTool", "Step", "ToolEnvironment",
           "environment_factory"]
