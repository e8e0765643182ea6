"""Memory per device of a plan, and how many rows the sampler's KV cache holds at once.

Trainer devices hold the trained models' float32 weights and Adam moments for the whole run and
the frozen models they host (the reference in the compute dtype unless `frozen_float32`, as
train/roles/cluster.py stores it; a reward model in float32), and during an update what footprint.py
counts (the one memory model, the dry run's too): gradients, activations by `remat`, log-prob
logits, fsdp's gathered weights. Sampler devices hold the compute-dtype copy of the actor and the
KV cache. Colocated, both live on the same devices: the KV cache gets what the trainer's resident
state leaves.
"""
from __future__ import annotations

import math

from planner import footprint
from planner.cost import Mesh, Plan, Workload

HEADROOM = 0.9  # of a device's memory a plan may fill (allocator slack, XLA temporaries)


def _shard(n: float, mesh: Mesh) -> float:
  """One device's part of `n` (parameters, bytes) split over `mesh`'s fsdp and tensor axes."""
  return n / (mesh.fsdp * mesh.tensor)


def update_bytes(w: Workload, plan: Plan, tpu: bool = False) -> float:
  """What an update adds on one trainer device at its peak (footprint.update_peak): one
  micro-batch (or minibatch) of rows, the plan's remat; gradients of what trains. `tpu`: as the
  TPU compiler lays it out (planner/footprint_tpu.py)."""
  t = plan.trainer
  rows = plan.micro_batch_size or w.rows // w.num_minibatches
  gathered = w.compute_bytes * w.params / t.tensor if t.fsdp > 1 else 0.0
  peak = footprint.update_peak(
      w.model, rows=rows / (t.data * t.fsdp), seq_len=w.seq_len, logit_chunk=w.logit_chunk(rows),
      param_bytes=_shard(4 * w.trained_params, t), gathered_bytes=gathered,
      tensor=t.tensor, remat=plan.remat, flash_attention=w.flash_attention,
      accumulate=bool(plan.micro_batch_size),
      tpu=dict(params=w.params, fsdp=t.fsdp, lora=bool(w.lora_params)) if tpu else None)
  return sum(peak.values())


def trainer_bytes(w: Workload, plan: Plan, tpu: bool = False) -> tuple[float, float]:
  """(resident, peak) bytes per trainer device: resident between updates (what stays through
  generation), peak during one. The actor holds float32 weights and Adam moments (12 bytes per
  parameter), or with LoRA its frozen base (and the reference with it) plus 12 bytes per
  adapter parameter; the critic 12 per parameter. `plan.offload` keeps the Adam moments and the
  frozen models on the host outside their phases."""
  t = plan.trainer
  base = w.frozen_bytes[0] if w.lora_params else 4
  adam = 8 * w.trained_params + 8 * w.params * int(w.critic)
  frozen = 0.0 if plan.strategy == "interleave" else w.params * w.separate_frozen_bytes
  weights = _shard(base * w.params + 4 * w.lora_params + 4 * w.params * int(w.critic), t)
  if plan.offload:
    return weights, weights + _shard(adam, t) + update_bytes(w, plan, tpu)
  resident = weights + _shard(adam + frozen, t)
  return resident, resident + update_bytes(w, plan, tpu)


def kv_row_bytes(w: Workload, sampler: Mesh) -> float:
  """One row's KV cache, per device of its tensor group: at its longest (prompt + budget), or
  paged, at its mean length."""
  tokens = w.prompt_len + (w.mean_response if w.paged else w.new_tokens)
  return footprint.kv_cache_bytes(w.model, 1, tokens, sampler.tensor)


def sampler_weight_bytes(w: Workload, sampler: Mesh) -> float:
  return w.params * w.sampler_weight_bytes / sampler.tensor


def kv_rows(w: Workload, plan: Plan, device_bytes: float) -> float:
  """Rows one sampler replica decodes at once: as many as its KV cache fits beside the weights
  (and, colocated or interleaved, the trainer's resident state); at most all of its rows."""
  free = HEADROOM * device_bytes - sampler_weight_bytes(w, plan.sampler)
  if plan.strategy in ("colocate", "interleave"):
    free -= trainer_bytes(w, plan)[0]
  return min(w.rows / plan.sampler.data, max(0.0, free / kv_row_bytes(w, plan.sampler)))


def memory(w: Workload, plan: Plan, device_bytes: float = math.inf,
           tpu: bool = False) -> dict[str, float]:
  """Peak bytes per device of each device group: trainer (during the update), sampler (weights
  and the KV cache of the rows decoding at once), scorer groups (interleave). `tpu`: the
  update's as the TPU compiler lays it out."""
  resident, peak = trainer_bytes(w, plan, tpu)
  rows = min(w.rows / plan.sampler.data, kv_rows(w, plan, device_bytes))
  sampler = sampler_weight_bytes(w, plan.sampler) + rows * kv_row_bytes(w, plan.sampler)
  out = {"trainer": peak, "sampler": sampler}
  if plan.strategy == "interleave":  # reference and reward model: a group each
    out["scorer"] = _shard(max(w.frozen_bytes) * w.params, plan.scorer)
  if plan.strategy in ("colocate", "interleave"):  # the sampler shares the trainer's devices
    # Its weights stay through the update (offload: dropped for it); the KV cache lives only
    # while generating.
    during_update = peak + (0.0 if plan.offload else sampler_weight_bytes(w, plan.sampler))
    both = max(during_update, resident + sampler)
    out["trainer"] = out["sampler"] = both
  return out


def total_bytes(mem: dict[str, float], plan: Plan) -> float:
  """All devices' bytes together (what fake CPU devices take from one machine's memory)."""
  if plan.strategy == "colocate":
    return mem["trainer"] * plan.trainer.size
  total = mem["trainer"] * plan.trainer.size + mem.get("scorer", 0.0) * 2 * plan.scorer.size
  return total + (mem["sampler"] * plan.sampler.size if plan.strategy == "separate" else 0.0)
