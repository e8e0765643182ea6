"""Memory per device of a plan, and how many rows the sampler's KV cache holds at once.

Trainer devices hold the trained models' float32 weights and Adam moments for the whole run,
gradients (two copies with micro-batches: the accumulator and the micro-batch's) and the
activations the backward needs during the update, and the frozen models they host (float32).
Sampler devices hold the compute-dtype copy of the actor and the KV cache. Colocated, both live
on the same devices: the KV cache gets what the trainer's resident state leaves.
"""
from __future__ import annotations

import math

from sharding.planner.cost import Mesh, Plan, Workload

HEADROOM = 0.9  # of a device's memory a plan may fill (allocator slack, XLA temporaries)


def _shard(w: Workload, mesh: Mesh) -> float:
  return w.params / (mesh.fsdp * mesh.tensor)


def activation_bytes(w: Workload, mesh: Mesh, micro_batch_size: int = 0,
                     remat: bool = False) -> float:
  """What the update keeps for its backward on one device: per layer and token the block's
  inputs, projections and MLP hidden states, and (without flash attention) per head the float32
  attention probabilities; with `remat` only each layer's input, and one layer's worth."""
  m = w.model
  rows = (micro_batch_size or w.rows // w.num_minibatches) / (mesh.data * mesh.fsdp)
  per_token_layer = w.compute_bytes * (4 * m.d_model + (m.n_heads + 2 * m.n_kv_heads)
                                       * m.head_dim / mesh.tensor + 3 * m.d_ff / mesh.tensor)
  if not w.flash_attention:
    per_token_layer += 4 * m.n_heads / mesh.tensor * w.seq_len
  if remat:
    return rows * w.seq_len * (m.n_layers * w.compute_bytes * m.d_model + per_token_layer)
  return rows * w.seq_len * m.n_layers * per_token_layer


def trainer_bytes(w: Workload, plan: Plan) -> tuple[float, float]:
  """(resident, peak) bytes per trainer device: resident between updates, peak during one."""
  t = plan.trainer
  trained = 2 if w.critic else 1
  frozen = 0 if plan.strategy == "interleave" else int(w.reference) + int(w.reward_model)
  resident = (12 * trained + 4 * frozen) * _shard(w, t)
  gradients = (8 if plan.micro_batch_size else 4) * trained * _shard(w, t)
  return resident, resident + gradients + activation_bytes(w, t, plan.micro_batch_size,
                                                          plan.remat)


def kv_row_bytes(w: Workload, sampler: Mesh) -> float:
  """One row's KV cache, per device of its tensor group: at its longest (prompt + budget), or
  paged, at its mean length."""
  heads = min(sampler.tensor, w.model.n_kv_heads)  # KV heads are replicated beyond that
  tokens = w.prompt_len + (w.mean_response if w.paged else w.new_tokens)
  return tokens * w.kv_bytes_per_token / heads


def sampler_weight_bytes(w: Workload, sampler: Mesh) -> float:
  return w.params * w.sampler_weight_bytes / sampler.tensor


def kv_rows(w: Workload, plan: Plan, device_bytes: float) -> float:
  """Rows one sampler replica decodes at once: as many as its KV cache fits beside the weights
  (and, colocated or interleaved, the trainer's resident state); at most all of its rows."""
  free = HEADROOM * device_bytes - sampler_weight_bytes(w, plan.sampler)
  if plan.strategy in ("colocate", "interleave"):
    free -= trainer_bytes(w, plan)[0]
  return min(w.rows / plan.sampler.data, max(0.0, free / kv_row_bytes(w, plan.sampler)))


def memory(w: Workload, plan: Plan, device_bytes: float = math.inf) -> dict[str, float]:
  """Peak bytes per device of each device group: trainer (during the update), sampler (weights
  and the KV cache of the rows decoding at once), scorer groups (interleave)."""
  resident, peak = trainer_bytes(w, plan)
  rows = min(w.rows / plan.sampler.data, kv_rows(w, plan, device_bytes))
  sampler = sampler_weight_bytes(w, plan.sampler) + rows * kv_row_bytes(w, plan.sampler)
  out = {"trainer": peak, "sampler": sampler}
  if plan.strategy == "interleave":  # reference and reward model: a group each
    out["scorer"] = 4 * _shard(w, plan.scorer)
  if plan.strategy in ("colocate", "interleave"):  # the sampler shares the trainer's devices
    # Its weights stay through the update; the KV cache lives only while generating.
    both = max(peak + sampler_weight_bytes(w, plan.sampler), resident + sampler)
    out["trainer"] = out["sampler"] = both
  return out


def total_bytes(mem: dict[str, float], plan: Plan) -> float:
  """All devices' bytes together (what fake CPU devices take from one machine's memory)."""
  if plan.strategy == "colocate":
    return mem["trainer"] * plan.trainer.size
  total = mem["trainer"] * plan.trainer.size + mem.get("scorer", 0.0) * 2 * plan.scorer.size
  return total + (mem["sampler"] * plan.sampler.size if plan.strategy == "separate" else 0.0)
