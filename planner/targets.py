"""TPU targets by name, for compiling a run's programs before a chip is rented
(train/preflight/target_compile.py): a generation of the device table (planner/devices.py) and a slice
topology, as Google names them.

Two spellings: the accelerator type (`v5p-64`, `v5litepod-16`, `v6e-8`: for v4 and v5p the number
counts TensorCores, two per chip; for v5e and v6e it counts chips) or the topology (`v5p:2x4x4`,
`v5e:4x4`), each optionally prefixed `tpu:`. v4 and v5p chips are one JAX device each
(megacore).
"""
from __future__ import annotations

import dataclasses
import math
import re

from jaxrl.config import ConfigError
from planner.devices import DEVICES, DeviceSpec


@dataclasses.dataclass(frozen=True)
class Generation:
  device: str  # key of planner.devices.DEVICES
  dims: int  # torus dimensions of a slice
  cores_per_chip: int  # what the accelerator type's number counts per chip
  shapes: tuple[str, ...]  # the slice topologies Google offers, smallest first


_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
          "8x16x16", "16x16x16")
_SQUARES = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
GENERATIONS = {"v4": Generation("tpu_v4", 3, 2, _CUBES),
               "v5e": Generation("tpu_v5e", 2, 1, _SQUARES),
               "v5p": Generation("tpu_v5p", 3, 2, _CUBES),
               "v6e": Generation("tpu_v6e", 2, 1, _SQUARES)}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e"}


class TargetError(ConfigError):
  """A target name that names no known slice; the message lists the known ones."""


@dataclasses.dataclass(frozen=True)
class Target:
  generation: str
  topology: str  # "2x4x4"

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.topology.split("x"))

  @property
  def spec(self) -> DeviceSpec:
    return DEVICES[GENERATIONS[self.generation].device]

  @property
  def topology_name(self) -> str:
    """The name `jax.experimental.topologies.get_topology_desc` takes."""
    return f"{self.generation}:{self.topology}"

  @property
  def accelerator_type(self) -> str:
    gen = GENERATIONS[self.generation]
    return f"{self.generation}-{self.chips * gen.cores_per_chip}"

  def describe(self) -> str:
    return (f"{self.spec.name} {self.accelerator_type} (topology {self.topology}: "
            f"{self.chips} chips, {self.spec.memory_bytes / 1e9:g} GB HBM each)")


def known() -> str:
  """One line: every target this module knows."""
  parts = []
  for name, gen in GENERATIONS.items():
    sizes = [math.prod(int(n) for n in s.split("x")) * gen.cores_per_chip for s in gen.shapes]
    parts.append(f"{name}-{{{','.join(map(str, sizes))}}}")
  return "known targets: " + "; ".join(parts) + " (or GEN:AxB[xC], e.g. v5p:2x4x4)"


def parse_target(text: str) -> Target:
  """`v5p-64` | `v5p:2x4x4` | `tpu:v5e-16` -> Target; TargetError naming the known ones."""
  name = text.strip().lower().removeprefix("tpu:")
  match = re.fullmatch(r"([a-z0-9]+?)(?:-(\d+)|:(\d+(?:x\d+)+))", name)
  gen_name = _ALIASES.get(match.group(1), match.group(1)) if match else ""
  if gen_name not in GENERATIONS:
    raise TargetError(f"--target: unknown TPU target {text!r}; {known()}")
  gen = GENERATIONS[gen_name]
  if match.group(3):
    topology = match.group(3)
    if topology.count("x") + 1 != gen.dims:
      raise TargetError(f"--target: {gen_name} slices have {gen.dims}-D topologies, got "
                        f"{topology!r}; {known()}")
    return Target(gen_name, topology)
  count = int(match.group(2))
  for shape in gen.shapes:
    if math.prod(int(n) for n in shape.split("x")) * gen.cores_per_chip == count:
      return Target(gen_name, shape)
  raise TargetError(f"--target: no {gen_name} slice of {count}; {known()}")
