"""The async generator's run state in a checkpoint (train.rollout.batches.WorkerState): its arrays as the
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
from flax import nnx
from jax.sharding import Mesh

from sharding.crossing import abstract, describe
from train.rollout.batches import WorkerState


def to_checkpoint(state: WorkerState) -> tuple[dict, dict]:
  """(orbax item, JSON meta) of a generator's run state (several generators': each's, nested
  by replica)."""
  if "replicas" in state.meta:
    parts = [to_checkpoint(WorkerState(state.arrays[f"replica{r}"], m))
             for r, m in enumerate(state.meta["replicas"])]
    return ({f"replica{r}": a for r, (a, _) in enumerate(parts)},
            {"replicas": [m for _, m in parts]})
  arrays = {k: v for k, v in state.arrays.items() if k != "params"}
  meta = {"worker": state.meta, "arrays": describe(arrays)}
  if "params" in state.arrays:
    arrays["params"] = nnx.to_pure_dict(state.arrays["params"])
  return arrays, meta


def abstract_checkpoint(meta: dict, mesh: Mesh, sampler_params: nnx.State) -> dict:
  """What `to_checkpoint` saved, as abstract arrays; `sampler_params`: the sampler copy's
  abstract parameters (for older weights saved with the fixed schedule)."""
  if "replicas" in meta:
    return {f"replica{r}": abstract_checkpoint(m, mesh, sampler_params)
            for r, m in enumerate(meta["replicas"])}
  out = abstract(meta["arrays"], mesh)
  if meta["worker"]["installed_params"]:
    out["params"] = nnx.to_pure_dict(sampler_params)
  return out


def from_checkpoint(arrays: dict, meta: dict, sampler_params: nnx.State) -> WorkerState:
  if "replicas" in meta:
    parts = [from_checkpoint(arrays[f"replica{r}"], m, sampler_params)
             for r, m in enumerate(meta["replicas"])]
    return WorkerState({f"replica{r}": p.arrays for r, p in enumerate(parts)},
                       {"replicas": [p.meta for p in parts]})
  arrays = dict(arrays)
  if "params" in arrays:
    params = jax.tree.map(lambda x: x, sampler_params)
    nnx.replace_by_pure_dict(params, arrays.pop("params"))
    arrays["params"] = params
  return WorkerState(arrays, meta["worker"])
