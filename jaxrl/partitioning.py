"""Logical axes: model code names its dimensions (`embed`, `mlp`, `heads`, `batch`, ...) and a
rules table (sharding/rules.py) maps the names to mesh axes.

Parameters carry their names as `logical_axes` metadata; activations are pinned with
`constrain`, which does nothing unless a layout is active (`activation_rules`, entered by
whoever jits a step on a mesh), so the same model code runs unsharded in a notebook and sharded
under a mesh. This module is all that the models know of sharding.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for one array; mesh axes absent from `mesh` (or already used) are dropped."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in axes:
    target = table.get(name) if name is not None else None
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(n for n in names if n in mesh.shape and mesh.shape[n] > 1 and n not in used)
    used.update(names)
    spec.append(None if not names else names[0] if len(names) == 1 else names)
  return PartitionSpec(*spec)


_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_rules(mesh: Mesh | None, rules: Rules) -> Iterator[None]:
  prev = getattr(_ACTIVE, "value", None)
  _ACTIVE.value = None if mesh is None else (mesh, rules)
  try:
    yield
  finally:
    _ACTIVE.value = prev


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  active = getattr(_ACTIVE, "value", None)
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, rules, mesh)))


def active_spec(axes: Sequence[str | None]) -> tuple[Mesh, PartitionSpec] | None:
  """The active layout's mesh and its PartitionSpec for logical `axes` (None outside
  `activation_rules`): what a kernel run per shard (`jax.shard_map`) splits its operands by.
  Inside a `shard_map` (jit_per_shard's data shards) the mesh is the context's, whose manual
  axes a nested `shard_map` must see."""
  active = getattr(_ACTIVE, "value", None)
  if active is None:
    return None
  mesh, rules = active
  context = jax.sharding.get_abstract_mesh()
  return (mesh if context.empty else context), logical_to_spec(axes, rules, mesh)

