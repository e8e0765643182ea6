"""Meshes and parameter shardings derived from the model's logical-axis metadata."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.partitioning import Rules, logical_to_spec
from sharding.rules import MESH_AXES, check_divisible


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
  """A mesh with axes (data, fsdp, tensor) over `devices` (default: all devices)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = tuple(int(shape.get(a, 1)) for a in MESH_AXES)
  need = int(np.prod(sizes))
  if need != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {need} devices, "
                     f"but {len(devices)} are available")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_specs(state: nnx.State, rules: Rules, mesh: Mesh) -> nnx.State:
  """PartitionSpec per parameter (same tree structure as `state`); checks divisibility."""

  def spec(path, v):
    axes = v.get_metadata().get("logical_axes")
    if axes is None:
      raise ValueError(f"parameter {_path_str(path)} has no logical_axes metadata")
    p = logical_to_spec(axes, rules, mesh)
    check_divisible(_path_str(path), v.shape, p, mesh)
    return v.replace(p)

  return jax.tree_util.tree_map_with_path(spec, state, is_leaf=_is_variable)


def param_shardings(state: nnx.State, rules: Rules, mesh: Mesh) -> nnx.State:
  return jax.tree.map(lambda p: NamedSharding(mesh, p), param_specs(state, rules, mesh),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))
