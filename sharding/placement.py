"""Placement of the RLHF roles on device slices, as presets over one role -> (devices, mesh) map.

Strategies (adaptive placement, docs/architecture.md "Placement: roles on sub-meshes"):
  colocate   every role on every device, run in turn (flattening); the sampler re-lays the
             actor's weights out for decoding on the same devices (ReaL-style reallocation).
  interleave the trainer (actor, critic) and the sampler share the first `train_devices`;
             reference and reward get exclusive halves of the rest and run concurrently
             (with `scorers_apart`: both and the critic on the other half, of the
             trainer's mesh shape).
  separate   trainer roles on the first `train_devices`, the sampler on the rest, holding a
             shadow copy of the actor refreshed after every update.
Devices are taken host by host. On several hosts `separate` gives the trainer whole hosts where
`train_devices` fills them, and the sampler the other hosts: each role group then runs on
processes of its own (MPMD: train/rollout/remote.py), and the weights and rollouts cross
between them device to device (sharding/crossing.py); so does `interleave` with the scorers
apart (the trainer's and the sampler's hosts, the scorers' hosts). Otherwise each host
gives its first devices to training and the rest to sampling, every process runs every program,
and the train -> sampler transfer stays inside a host: on GPU nodes; a TPU slice's compiler
refuses collectives over part of several hosts' chips, so there it is a PlacementError.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl.config import STRATEGIES
from sharding.rules import MESH_AXES

ROLES = ("actor", "critic", "reference", "reward", "sampler")


class PlacementError(ValueError):
  """A placement that cannot work; the message names the role, the axis and the numbers."""


@dataclasses.dataclass(frozen=True)
class RoleSpec:
  devices: tuple[int, ...]  # positions in the host-major device list
  mesh: tuple[tuple[str, int], ...]  # ((axis, size), ...) over MESH_AXES
  # the process group that runs the role's programs: "trainer", or on hosts of their own
  # "sampler" (the first generator's; `generator_group` names the others) or "scorers"
  group: str = "trainer"

  @property
  def shape(self) -> dict[str, int]:
    return dict(self.mesh)


@dataclasses.dataclass(frozen=True)
class Placement:
  strategy: str
  roles: dict[str, RoleSpec]  # the sampler's: its first replica's devices (the shape of each)
  replicas: tuple[tuple[int, ...], ...] = ()  # several generators: each one's devices

  def groups(self) -> dict[str, tuple[int, ...]]:
    """Each process group's devices (positions in the host-major list): the trainer's (with
    every role that runs on its processes), and where the placement gives them hosts of their
    own, each generator's (`generator_group`) and the scorers'. One group: every process runs
    every program."""
    out: dict[str, set[int]] = {}
    for role, spec in self.roles.items():
      if role != "sampler" or spec.group == "trainer":
        out.setdefault(spec.group, set()).update(spec.devices)
    if self.roles["sampler"].group != "trainer":
      for k, devices in enumerate(self.replicas or (self.roles["sampler"].devices,)):
        out[generator_group(k)] = set(devices)
    return {group: tuple(sorted(devices)) for group, devices in out.items()}

  def replica_meshes(self, devices=None) -> list[Mesh]:
    """Each generator replica's mesh (the sampler's alone where there is one)."""
    if not self.replicas:
      return [self.mesh("sampler", devices)]
    spec = self.roles["sampler"]
    return [self.mesh("sampler", devices, RoleSpec(r, spec.mesh, spec.group))
            for r in self.replicas]

  def describe(self) -> str:
    """One line: each role's devices (positions in the host-major list) and mesh."""
    roles = "; ".join(f"{role} on devices {list(spec.devices)} mesh {spec.shape}"
                      for role, spec in self.roles.items())
    if self.replicas:
      roles += f"; {len(self.replicas)} generators on devices " + ", ".join(
          str(list(r)) for r in self.replicas)
    groups = self.groups()
    if len(groups) > 1:
      roles += "; process groups: " + ", ".join(f"{g} on devices {list(at)}"
                                                for g, at in groups.items())
    return f"{self.strategy}: {roles}"

  def mesh(self, role: str, devices=None, spec: RoleSpec | None = None) -> Mesh:
    devices = host_major_devices() if devices is None else list(devices)
    spec = spec or self.roles[role]
    sizes = tuple(spec.shape.get(a, 1) for a in MESH_AXES)
    picked = np.asarray([devices[i] for i in spec.devices], dtype=object)
    return Mesh(picked.reshape(sizes), MESH_AXES)


def generator_group(replica: int) -> str:
  """The process group of generator `replica` on hosts of its own: "sampler", "sampler1", ..."""
  return "sampler" if replica == 0 else f"sampler{replica}"


def host_major_devices(devices=None) -> list:
  """`devices` (default: all of this job's) ordered host by host."""
  return sorted(jax.devices() if devices is None else devices,
                key=lambda d: (d.process_index, d.id))


def host_count(devices) -> int:
  """How many hosts (processes) `devices` belong to."""
  return len({d.process_index for d in devices})


def _mesh(**sizes: int) -> tuple[tuple[str, int], ...]:
  return tuple((a, int(sizes.get(a, 1))) for a in MESH_AXES)


def _trainer_mesh(n_train: int, n_hosts: int, train_fsdp: int, one_network: bool):
  """fsdp over `train_fsdp` devices, data-parallel over the rest. By default, across hosts
  linked by a network (GPU nodes) the trainer is hybrid-sharded: fsdp inside a host,
  data-parallel over hosts, so every host holds a whole copy and its transfer to the local
  sampler devices stays local; on a TPU slice, whose chips share the ICI across hosts, fsdp
  spans them all (a 70B model's Adam state does not fit one host's 4 chips)."""
  fsdp = train_fsdp or (n_train if one_network else n_train // n_hosts)
  if n_train % fsdp:
    raise PlacementError(f"placement.train_fsdp: {fsdp} does not divide the trainer's "
                         f"{n_train} devices")
  return _mesh(data=n_train // fsdp, fsdp=fsdp)


def _per_host_split(n_devices: int, n_hosts: int, train_per_host: int):
  local = n_devices // n_hosts
  train = tuple(h * local + i for h in range(n_hosts) for i in range(train_per_host))
  rest = tuple(h * local + i for h in range(n_hosts) for i in range(train_per_host, local))
  return train, rest


def whole_hosts(strategy: str, n_devices: int, *, train_devices: int, n_hosts: int,
                scorers_apart: bool = False) -> bool:
  """Whether `strategy` gives each group hosts of its own, `train_devices` filling whole ones
  on several hosts: `separate` (the trainer's, the sampler's), or `interleave` with the scorers
  apart (the trainer's with the sampler, the scorers')."""
  return ((strategy == "separate" or strategy == "interleave" and scorers_apart)
          and n_hosts > 1 and 0 < train_devices < n_devices
          and train_devices % (n_devices // n_hosts) == 0)


def _check_replicas(replicas: int, whole: bool, n_sampler: int, local: int) -> None:
  """Each generator replica on whole hosts of the sampler's `n_sampler` devices."""
  if replicas > 1 and not whole:
    raise PlacementError(
        f"placement.sampler_replicas: {replicas} generators need the sampler on hosts of its "
        f"own: placement.strategy='separate' with train_devices a multiple of {local}, on "
        f"several hosts")
  hosts = n_sampler // local
  if replicas > 1 and hosts % replicas:
    raise PlacementError(
        f"placement.sampler_replicas: {replicas} generators do not split the sampler's {hosts} "
        f"hosts ({n_sampler} devices) into whole hosts each: expected a divisor of {hosts}")


def _check_mirror(train_devices: int, per_generator: int, local: int) -> None:
  """The trainer mirrors a generator's layout on its first devices (sharding/crossing.py): as
  many as one generator has, reaching every trainer host (each reads what it evaluates)."""
  if per_generator > train_devices or (train_devices > local
                                       and per_generator <= train_devices - local):
    raise PlacementError(
        f"placement.train_devices: {train_devices} gives each generator {per_generator} devices "
        f"on hosts of its own, whose layout the trainer mirrors on its first {per_generator}, "
        f"which must reach each of its hosts: give the trainer as many devices as one "
        f"generator, or one host ({local} devices)")


def _check_tensor(sampler_tensor: int, per_generator: int, replicas: int) -> None:
  if per_generator % sampler_tensor:
    raise PlacementError(
        f"placement.sampler_tensor: the sampler's mesh axis tensor={sampler_tensor} does not "
        f"divide its {per_generator} devices" + (" per generator" if replicas > 1 else ""))


def _check_scorers_apart(whole: bool, strategy: str, n_devices: int, train_devices: int,
                         local: int) -> None:
  """The scorers on devices of their own, as many as the trainer's (on several hosts,
  whole hosts), after them: `separate`, the sampler on the rest; `interleave`, the sampler on
  the trainer's devices and nothing left."""
  one_host = local == n_devices
  if strategy == "interleave" and 2 * train_devices == n_devices and (whole or one_host):
    return
  if strategy != "separate" or not (whole or one_host) or 2 * train_devices >= n_devices:
    multiple = "" if one_host else f" a multiple of each host's {local} devices and"
    raise PlacementError(
        f"placement.scorers_apart: the reference, the reward model and the critic stand on "
        f"devices of their own (on several hosts, hosts of their own), as many as the "
        f"trainer's, after them: placement.strategy='separate' with train_devices{multiple} "
        f"below half of the {n_devices} devices (the sampler takes the rest), or 'interleave' with "
        f"train_devices={n_devices // 2} (the sampler on the trainer's); got "
        f"strategy={strategy!r}, train_devices={train_devices}")


def _split_error(strategy: str, train_devices: int, n_devices: int, n_hosts: int) -> str:
  """Why `train_devices` cannot split `n_devices` for `strategy`, what would, and the preset
  that needs no split."""
  rest = "the sampler" if strategy == "separate" else "the reference and reward models"
  want = f"1 to {n_devices - 1}"
  if n_hosts > 1:
    want += f", a multiple of {n_hosts} (as many on each host)"
    if strategy == "separate":
      want += f" or of {n_devices // n_hosts} (whole hosts)"
  return (f"placement.train_devices: {train_devices} does not split the {n_devices} devices "
          f"({strategy} gives the trainer train_devices of them and {rest} the rest): expected "
          f"{want}; or --config.placement.strategy=colocate, every role on all {n_devices}")


def _split_slice_error(strategy: str, n_devices: int, n_hosts: int) -> str:
  """Why `strategy` cannot split each host of a TPU slice, and what places it instead."""
  local = n_devices // n_hosts
  whole_interleave = (f", 'interleave' with placement.scorers_apart=True and train_devices="
                      f"{n_devices // 2}" if (n_devices // 2) % local == 0 else "")
  return (f"placement.strategy: {strategy} on {n_hosts} hosts of a TPU slice gives each role "
          f"part of every host's {local} chips, which the TPU compiler refuses (collectives over "
          f"part of several hosts' chips, docs/hosts.md); use 'separate' with "
          f"placement.train_devices a multiple of {local} (hosts of their own)"
          f"{whole_interleave}, or 'colocate'")


def _interleaved_scorers(rest: tuple[int, ...]) -> dict[str, RoleSpec]:
  """`interleave`'s reference and reward model: exclusive halves of the devices `rest`."""
  half = len(rest) // 2
  if half == 0:
    raise PlacementError(f"placement.train_devices: interleave needs >= 2 devices left for "
                         f"reference and reward, got {len(rest)}")
  return {"reference": RoleSpec(rest[:half], _mesh(fsdp=half)),
          "reward": RoleSpec(rest[half:2 * half], _mesh(fsdp=half))}


def make_placement(strategy: str, n_devices: int, *, train_devices: int, sampler_tensor: int = 1,
                   n_hosts: int = 1, train_fsdp: int = 0, one_network: bool = False,
                   replicas: int = 1, scorers_apart: bool = False) -> Placement:
  """The preset for `strategy`; `train_devices` counts devices over all hosts. `train_fsdp`: the
  trainer's fsdp degree, the rest of its devices data-parallel; 0: all of them where the hosts
  share one network of chips (`one_network`: a TPU slice's ICI), else one host's. `replicas`:
  independent generators, each on whole hosts of the sampler's (`separate` on hosts of its own).
  `scorers_apart`: the scorers (the reference, the reward model and the critic, which trains
  there) on the `train_devices` after the trainer's (hosts of their own), their mesh the
  trainer's shape, so that the batch and its scores cross as they are."""
  if strategy not in STRATEGIES:
    raise PlacementError(f"placement.strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
  if n_devices % n_hosts:
    raise PlacementError(f"placement: {n_devices} devices do not split over {n_hosts} hosts")
  everything, local = tuple(range(n_devices)), n_devices // n_hosts
  whole = whole_hosts(strategy, n_devices, train_devices=train_devices, n_hosts=n_hosts,
                      scorers_apart=scorers_apart)
  apart = train_devices if scorers_apart else 0  # the scorers' own devices
  if scorers_apart:
    _check_scorers_apart(whole, strategy, n_devices, train_devices, local)
  _check_replicas(replicas, whole, n_devices - train_devices - apart, local)
  if strategy == "colocate":
    train, rest = everything, everything
    sampler_devices = everything
  else:
    if not whole and (train_devices % n_hosts or not 0 < train_devices < n_devices):
      raise PlacementError(_split_error(strategy, train_devices, n_devices, n_hosts))
    if whole or apart:  # (apart on one host: devices of its own)
      if whole and strategy == "separate":
        _check_mirror(train_devices, (n_devices - train_devices - apart) // replicas, local)
      if whole:
        n_hosts = train_devices // local  # the trainer's
      train, rest = everything[:train_devices], everything[train_devices + apart:]
    elif one_network and n_hosts > 1:
      raise PlacementError(_split_slice_error(strategy, n_devices, n_hosts))
    else:
      train, rest = _per_host_split(n_devices, n_hosts, train_devices // n_hosts)
    sampler_devices = train if strategy == "interleave" else rest
  _check_tensor(sampler_tensor, len(sampler_devices) // replicas, replicas)
  trainer = RoleSpec(train, _trainer_mesh(len(train), n_hosts, train_fsdp, one_network))
  per = len(sampler_devices) // replicas
  generators = tuple(sampler_devices[k * per:(k + 1) * per] for k in range(replicas))
  roles = {"actor": trainer, "critic": trainer, "reference": trainer, "reward": trainer,
           "sampler": RoleSpec(generators[0], _mesh(data=per // sampler_tensor,
                                                 tensor=sampler_tensor),
                               "sampler" if whole and strategy == "separate" else "trainer")}
  if scorers_apart:  # (the critic with them: it scores each batch and trains on it there)
    roles["reference"] = roles["reward"] = roles["critic"] = RoleSpec(
        everything[train_devices:train_devices + apart], trainer.mesh,
        "scorers" if whole else "trainer")
  elif strategy == "interleave":
    roles.update(_interleaved_scorers(rest))
  placement = Placement(strategy, roles, generators if replicas > 1 else ())
  validate(placement, n_devices)
  return placement


def validate(placement: Placement, n_devices: int) -> None:
  """Fails before any compile, naming the role and the numbers. (Whether mesh axes divide the
  model's dimensions is checked per parameter by sharding.mesh.param_specs.)"""
  for role, spec in placement.roles.items():
    size = int(np.prod([s for _, s in spec.mesh]))
    if size != len(spec.devices):
      raise PlacementError(f"{role}: mesh {spec.shape} has {size} devices but the role is given "
                           f"{len(spec.devices)}")
    if max(spec.devices) >= n_devices:
      raise PlacementError(f"{role}: asks for device {max(spec.devices)} but only {n_devices} exist")
  if placement.strategy == "separate":
    train = set(placement.roles["actor"].devices)
    sampler = set(sum(placement.replicas, placement.roles["sampler"].devices))
    if sampler & set(placement.roles["reference"].devices):
      raise PlacementError(f"sampler: separate placement overlaps the reference on devices "
                           f"{sorted(sampler & set(placement.roles['reference'].devices))}")
    if train & sampler:
      raise PlacementError(f"sampler: separate placement overlaps the actor on devices "
                           f"{sorted(train & sampler)}")
  if placement.strategy == "interleave":
    ref, reward = set(placement.roles["reference"].devices), set(placement.roles["reward"].devices)
    if (ref & reward and ref != reward) or (ref | reward) & set(placement.roles["actor"].devices):
      raise PlacementError("reference/reward: interleave needs exclusive device groups")
