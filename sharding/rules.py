"""Rules tables: one small table per layout, mapping the models' logical axis names
(jaxrl/partitioning.py) to mesh axes; `data_axes`, the mesh axes a layout splits the batch over;
and `jit_on` (or `jit_per_shard`, its data-parallel sibling), the one way a step is jitted under a
layout.

Parameters use the bare names, activations the `act_*` names, so that fsdp can shard a weight's
`embed` dimension while the activations stay sharded over the batch. Changing the parallel layout
means choosing another table here, never touching model code.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxrl.partitioning import Rules, activation_rules, logical_to_spec

MESH_AXES = ("data", "fsdp", "tensor")

# Tensor parallelism over heads / mlp / vocab, for weights and activations alike. A mixture of
# experts' weights split by width (`mlp`) too, not by `expert`: a tensor group holds the same
# tokens, and split by expert each device would run the blocked products' static worst case,
# every assignment, on its own experts (jaxrl/models/moe.split_experts; docs/models.md).
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


class NotDivisible(ValueError):
  """A mesh axis that does not divide a parameter's dimension (what, which axis, the sizes)."""

  def __init__(self, path: str, dim: int, axis, size: int):
    super().__init__(f"{path}: dimension {dim} is not divisible by mesh axis {axis}={size}")
    self.path, self.dim, self.axis, self.size = path, dim, axis, size


def check_divisible(path: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
  for dim, entry in zip(shape, spec):
    size = _axis_size(mesh, entry)
    if dim % size:
      raise NotDivisible(path, dim, entry, size)


def data_axes(mesh: Mesh | None, rules: Rules) -> tuple[str, ...]:
  """The mesh axes `rules` split the batch over (those `batch` maps to that have more than one
  device); none without a mesh."""
  data = None if mesh is None else logical_to_spec(("batch",), rules, mesh)[0]
  return () if data is None else (data,) if isinstance(data, str) else tuple(data)


def batch_ways(mesh: Mesh | None, rules: Rules) -> int:
  """How many ways a mesh splits the batch (the product of its data axes' sizes)."""
  return math.prod(mesh.shape[axis] for axis in data_axes(mesh, rules))


def _traced_under(mesh: Mesh | None, rules: Rules, fn):
  """`fn` tracing under `mesh`'s activation rules (jaxrl.partitioning.constrain), keeping its
  name, so that a profile tells the programs apart."""

  def traced(*args):
    with activation_rules(mesh, rules):
      return fn(*args)

  traced.__name__ = getattr(fn, "__name__", traced.__name__)
  return traced


def jit_on(mesh: Mesh | None, rules: Rules, fn, **kwargs):
  """jit whose trace runs under `mesh`'s activation rules."""
  return jax.jit(_traced_under(mesh, rules, fn), **kwargs)


def jit_per_shard(mesh: Mesh | None, rules: Rules, fn, split: Sequence[bool], **kwargs):
  """`jit_on` with the data axes manual: every data shard runs `fn` on its own rows (shard_map;
  argument i is divided along its first axis where `split[i]`, else replicated, and the outputs
  are divided), traced under `rules` less `batch`, while the other mesh axes stay automatic.
  `fn` may name the data axes (`data_axes`) in collectives. Without data axes it is `jit_on`."""
  axes = data_axes(mesh, rules)
  if not axes:
    return jit_on(mesh, rules, fn, **kwargs)
  no_batch = tuple(rule for rule in rules if rule[0] != "batch")
  spec = lambda divided: PartitionSpec(axes) if divided else PartitionSpec()
  return jax.jit(jax.shard_map(_traced_under(mesh, no_batch, fn), mesh=mesh,
                               in_specs=tuple(map(spec, split)), out_specs=PartitionSpec(axes),
                               axis_names=set(axes), check_vma=False), **kwargs)
