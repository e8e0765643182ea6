"""Logical-axis rules: one small table per layout, mapping model axis names to mesh axes.

Model code only names logical axes (`embed`, `mlp`, `heads`, ...). Parameters use the bare names,
activations the `act_*` names, so that fsdp can shard a weight's `embed` dimension while the
activations stay sharded over the batch. Changing the parallel layout means choosing another
table here, never touching model code.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

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

RULES = {"train": TRAIN_RULES, "sampler": SAMPLER_RULES}


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


# Activation constraints are applied only while a layout is active (set by whoever jits the step),
# so the same model code runs unsharded in a notebook and sharded under a mesh.
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
