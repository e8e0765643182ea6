"""The async generator's run state in a checkpoint (train.rollout.worker.WorkerState): its arrays as the
RL stage's orbax item, each described in the JSON meta (shape, dtype, how it was split over the
sampler's mesh), so that a resume reads every array straight back into the layout it had: a
resumed decode runs the same programs on the same layouts, bit for bit.

What it holds: the finished batches the trainer had not taken, the in-flight decode state of
partial rollouts (slots, KV cache, output buffers, the open batches' progress and token
versions) and, with the fixed schedule, the weights the generator decodes with where they are
older than the trainer's (in the sampler's layout).
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.rollout.worker import WorkerState


def _spec(x) -> list | None:
  """The PartitionSpec of a mesh-split array as JSON (None: not split over a mesh)."""
  if not isinstance(x.sharding, NamedSharding):
    return None
  return [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]


def _flat(tree: dict, prefix: str = ""):
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict):
      yield from _flat(value, path + "/")
    else:
      yield path, value


def _nest(flat: dict) -> dict:
  out: dict = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def describe(arrays: dict) -> dict:
  """{path: [shape, dtype, spec]} of a nested dict of arrays (string keys)."""
  return {path: [list(x.shape), str(x.dtype), _spec(x)] for path, x in _flat(arrays)}


def abstract(described: dict, mesh: Mesh) -> dict:
  """The nested dict of ShapeDtypeStructs `describe` recorded, laid out on `mesh`."""
  def one(shape, dtype, spec):
    parts = () if spec is None else tuple(tuple(e) if isinstance(e, list) else e for e in spec)
    return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype),
                                sharding=NamedSharding(mesh, PartitionSpec(*parts)))
  return _nest({path: one(*d) for path, d in described.items()})


def to_checkpoint(state: WorkerState) -> tuple[dict, dict]:
  """(orbax item, JSON meta) of a generator's run state."""
  arrays = {k: v for k, v in state.arrays.items() if k != "params"}
  meta = {"worker": state.meta, "arrays": describe(arrays)}
  if "params" in state.arrays:
    arrays["params"] = nnx.to_pure_dict(state.arrays["params"])
  return arrays, meta


def abstract_checkpoint(meta: dict, mesh: Mesh, sampler_params: nnx.State) -> dict:
  """What `to_checkpoint` saved, as abstract arrays; `sampler_params`: the sampler copy's
  abstract parameters (for older weights saved with the fixed schedule)."""
  out = abstract(meta["arrays"], mesh)
  if meta["worker"]["installed_params"]:
    out["params"] = nnx.to_pure_dict(sampler_params)
  return out


def from_checkpoint(arrays: dict, meta: dict, sampler_params: nnx.State) -> WorkerState:
  arrays = dict(arrays)
  if "params" in arrays:
    params = jax.tree.map(lambda x: x, sampler_params)
    nnx.replace_by_pure_dict(params, arrays.pop("params"))
    arrays["params"] = params
  return WorkerState(arrays, meta["worker"])
