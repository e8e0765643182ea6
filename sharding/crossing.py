"""Arrays between role meshes on disjoint processes (MPMD), device to device.

Where a placement puts the sampler on processes of its own (sharding/placement.py), the trainer's
processes and the sampler's hand each other arrays: the new weights one way, the rollout batches
the other. `jax.device_put` moves an array between meshes on disjoint processes when both sides
have the same shard shapes (the same mesh shape and spec: `mirror` builds the other side's mesh
shape over one's own devices), through the backend's transfer server
(`sharding/distributed.py` gives it a socket on the CPU). Every process of both groups calls each
crossing, in the same order: JAX matches the two ends by their order, not by a name. The sender's
`device_put` returns at once (the receiver pulls the shards); the receiver's waits for them.

A `Mailbox` carries what goes with the arrays: small JSON messages under numbered keys of the
coordination service's key-value store (what each array is, which batch, which weight version,
stop and pause requests). A receiver reads a crossing's description there before it calls
`device_put`, so it never waits inside the transfer for a sender that has not sent yet.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.distributed import kv_client
from sharding.placement import (ROLES, Placement, PlacementError, generator_group,
                                host_major_devices)


def mirror(mesh: Mesh, devices) -> Mesh:
  """`mesh`'s axes and shape over the first `mesh.size` of `devices` (host-major): the layout
  the other side of a crossing needs for the same shard shapes."""
  if len(devices) < mesh.size:
    raise ValueError(f"a crossing needs {mesh.size} devices on each side ({dict(mesh.shape)}), "
                     f"this side has {len(devices)}")
  picked = np.asarray(list(devices)[:mesh.size], dtype=object)
  return Mesh(picked.reshape(mesh.devices.shape), mesh.axis_names)


def _spec(x) -> list | None:
  """The PartitionSpec of a mesh-split array as JSON (None: not split over a mesh)."""
  if not isinstance(x.sharding, NamedSharding):
    return None
  return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


def flat(tree: dict, prefix: str = ""):
  """(path, leaf) of a nested dict with string keys, paths joined by '/'."""
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      yield from flat(value, path + "/")
    else:
      yield path, value


def nest(pairs) -> dict:
  """The nested dict of (path, leaf) pairs (`flat`'s inverse)."""
  out: dict = {}
  for path, value in pairs:
    *parents, leaf = path.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def numbered(tree) -> dict:
  """A tree's leaves as a flat dict {"0": leaf, ...}, in tree order (both ends know the tree)."""
  return {str(i): x for i, x in enumerate(jax.tree.leaves(tree))}


def in_order(arrays: dict) -> list:
  """`numbered`'s leaves, in order."""
  return [arrays[str(i)] for i in range(len(arrays))]


def unnumbered(like, arrays: dict):
  """The tree shaped like `like` from its `numbered` leaves."""
  return jax.tree.unflatten(jax.tree.structure(like), in_order(arrays))


def describe(arrays: dict) -> dict:
  """{path: [shape, dtype, spec]} of a nested dict of arrays (string keys): JSON."""
  return {path: [list(x.shape), str(x.dtype), _spec(x)] for path, x in flat(arrays)}


def _sharding(mesh: Mesh, spec) -> NamedSharding:
  parts = () if spec is None else tuple(tuple(e) if isinstance(e, list) else e for e in spec)
  return NamedSharding(mesh, PartitionSpec(*parts))


def _struct(shape, dtype, spec, mesh: Mesh) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=_sharding(mesh, spec))


def abstract(described: dict, mesh: Mesh) -> dict:
  """The nested dict of ShapeDtypeStructs `describe` recorded, laid out on `mesh`."""
  return nest((path, _struct(*d, mesh)) for path, d in described.items())


def send(arrays: dict, to: Mesh) -> dict:
  """This side's half of a crossing: `arrays` (nested dict, on this side's mesh) to the same
  specs on mesh `to`; their description, for the receiver. Returns without waiting."""
  pairs = list(flat(arrays))
  if pairs:
    jax.device_put([x for _, x in pairs], [_sharding(to, _spec(x)) for _, x in pairs])
  return describe(arrays)


def receive(described: dict, source: Mesh, to: Mesh) -> dict:
  """The other half: the arrays `described` (as `send` returned it) that the other side sent
  from mesh `source`, on mesh `to`."""
  if not described:
    return {}
  sent = {path: _struct(*d, source) for path, d in described.items()}  # (not on this side)
  arrived = jax.device_put(
      [jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype)
       for x in sent.values()], [_sharding(to, spec) for _, _, spec in described.values()])
  return nest(zip(sent, arrived))


class Mailbox:
  """JSON messages under keys in the coordination service's key-value store: one writer (a
  group's first process) posts message `key`, any number of readers take it. `name` keeps two
  mailboxes apart. The writer deletes a message once `keep` newer ones were posted: its
  readers, which take part in the same programs between messages, are never that far behind,
  and the store's memory stays bounded over a long run."""

  def __init__(self, name: str, *, keep: int = 1024):
    self.name, self._client, self._keep = name, kv_client(), keep
    self._posted: collections.deque[str] = collections.deque()
    self._lock = threading.Lock()  # (environments post from several threads)

  def post(self, key, message: dict) -> None:
    path = f"jaxrl/{self.name}/{key}"
    self._client.key_value_set(path, json.dumps(message))
    with self._lock:
      self._posted.append(path)
      old = self._posted.popleft() if len(self._posted) > self._keep else None
    if old is not None:
      self._client.key_value_delete(old)

  def has(self, key) -> bool:
    """Message `key` is posted."""
    try:
      self._client.key_value_try_get(f"jaxrl/{self.name}/{key}")
      return True
    except Exception:  # noqa: BLE001 - NOT_FOUND
      return False

  def take(self, key, *, poll_s: float = 5.0, timeout_s: float | None = None,
           instead: Callable[[], dict | None] | None = None) -> dict:
    """Message `key`, waited for (a peer that died ends the job through the heartbeat
    first). `instead()`, asked every `poll_s` while it has not come: a message to post in its
    place (None: wait on); whichever is posted first is the message, for every reader."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
      try:
        return json.loads(self._client.blocking_key_value_get(f"jaxrl/{self.name}/{key}",
                                                               int(poll_s * 1000)))
      except Exception as e:  # noqa: BLE001 - the store's timeout: wait again
        if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
          raise
        if deadline is not None and time.monotonic() > deadline:
          raise TimeoutError(f"no message {key} in mailbox {self.name} within {timeout_s} s") \
              from None
      substitute = None if instead is None else instead()
      if substitute is not None:
        try:  # (not over one posted meanwhile: the store refuses to overwrite)
          self._client.key_value_set(f"jaxrl/{self.name}/{key}", json.dumps(substitute))
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS: the message came first
          pass


@dataclasses.dataclass(frozen=True)
class ProcessSplit:
  """The placement's process groups where some stand on hosts of their own (role -> group ->
  processes: `groups`, named as sharding/placement.py's `Placement.groups`): the trainer's, each
  generator replica's, the scorers'. `replicas`: each generator's real mesh (the same shape
  each; none where the sampler runs on the trainer's processes), `mirror` their shape over the
  trainer's devices (where the trainer keeps its copy of the sampler's weights and evaluates);
  `scorer` the frozen scorers' mesh where they stand apart (`placement.scorers_apart`),
  `trainer` the actor's (its shape: both ends of their crossings)."""
  groups: dict[str, frozenset[int]]
  replicas: tuple[Mesh, ...]
  mirror: Mesh | None
  scorer: Mesh | None
  trainer: Mesh

  @property
  def generators(self) -> bool:
    """The generator stands on processes of its own."""
    return bool(self.replicas)

  @property
  def sampler_processes(self) -> frozenset[int]:
    return frozenset().union(*map(self.processes, range(len(self.replicas))))

  @property
  def scorer_processes(self) -> frozenset[int]:
    return self.groups.get("scorers", frozenset())

  @property
  def trainer_processes(self) -> frozenset[int]:
    """The trainer's processes (with every role that runs there)."""
    return self.groups["trainer"]

  @property
  def here(self) -> str:
    """This process's group."""
    return self.group_of(jax.process_index())

  def group_of(self, process: int) -> str:
    return next(g for g, processes in self.groups.items() if process in processes)

  def replica_of(self, process: int) -> int | None:
    """The generator replica `process` serves (None: none)."""
    return next((r for r in range(len(self.replicas)) if process in self.processes(r)), None)

  def processes(self, replica: int) -> frozenset[int]:
    return self.groups[generator_group(replica)]


def process_split(placement: Placement, devices) -> ProcessSplit | None:
  """`placement`'s process groups on `devices` (this job's, host-major) where it gives some
  hosts of their own in a job of several processes; else None (every process runs every
  program; a target topology's hosts are compiled from one process)."""
  positions = placement.groups()
  if jax.process_count() == 1 or len(positions) == 1:
    return None
  groups = {g: frozenset(devices[i].process_index for i in at) for g, at in positions.items()}
  shared = [(a, b) for a in groups for b in groups if a < b and groups[a] & groups[b]]
  if shared:  # (the presets give groups whole hosts: a devices list that is not this job's)
    raise PlacementError(f"placement: process groups {shared[0]} share processes "
                         f"{sorted(groups[shared[0][0]] & groups[shared[0][1]])}")
  meshes = {role: placement.mesh(role, devices) for role in ROLES}
  generators = placement.roles["sampler"].group != "trainer"
  return ProcessSplit(groups,
                      tuple(placement.replica_meshes(devices)) if generators else (),
                      trainers_mirror(meshes) if generators else None,
                      meshes["reference"] if "scorers" in groups else None, meshes["actor"])


def trainers_mirror(meshes: dict[str, Mesh]) -> Mesh:
  """The sampler's mesh shape over the trainer's devices (the roles' on the actor's processes),
  host-major: where the trainer keeps its copy of the sampler's weights when the sampler is
  apart (each generator's shape alike)."""
  hosts = {d.process_index for d in meshes["actor"].devices.flat}
  trainer = host_major_devices({d for role, m in meshes.items() if role != "sampler"
                                for d in m.devices.flat if d.process_index in hosts})
  return mirror(meshes["sampler"], trainer)
