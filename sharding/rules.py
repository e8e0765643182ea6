"""Rules tables: one small table per layout, mapping the models' logical axis names
(jaxrl/partitioning.py) to mesh axes, and `jit_on`, the one way a step is jitted under a layout.

Parameters use the bare names, activations the `act_*` names, so that fsdp can shard a weight's
`embed` dimension while the activations stay sharded over the batch. Changing the parallel layout
means choosing another table here, never touching model code.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxrl.partitioning import Rules, activation_rules

MESH_AXES = ("data", "fsdp", "tensor")

# Tensor parallelism over heads / mlp / vocab, for weights and activations alike.
_TENSOR: Rules = (
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)

# Training layout: batch over data x fsdp; weights fsdp-sharded on `embed`, tensor-parallel.
TRAIN_RULES: Rules = (("batch", ("data", "fsdp")), ("embed", "fsdp")) + _TENSOR

# Sampling layout: tensor parallel, weights replicated over data (no per-token all-gathers).
SAMPLER_RULES: Rules = (("batch", ("data", "fsdp")),) + _TENSOR


def _axis_size(mesh: Mesh, entry) -> int:
  names = (entry,) if isinstance(entry, str) else tuple(entry or ())
  size = 1
  for n in names:
    size *= mesh.shape[n]
  return size


def check_divisible(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
  for dim, entry in zip(shape, spec):
    size = _axis_size(mesh, entry)
    if dim % size:
      raise ValueError(f"{path}: dimension {dim} is not divisible by mesh axis {entry}={size}")


def jit_on(mesh: Mesh | None, rules: Rules, fn, **kwargs):
  """jit whose trace runs under `mesh`'s activation rules (jaxrl.partitioning.constrain)."""

  def traced(*args):
    with activation_rules(mesh, rules):
      return fn(*args)

  return jax.jit(traced, **kwargs)
