"""Search over execution plans: placements, the device split between roles, mesh shapes per role,
micro-batch sizes, rematerialisation (model.layers.remat), idle-role offload (colocated sync plans:
placement.offload) and sync / async, under the memory limit,
ranked by predicted step time.

`presets_only=True` searches what `sharding/placement.make_placement` builds (the trainer
fsdp-shards inside each host and is data-parallel across hosts, or on a TPU slice fsdp-shards
over all its chips; the sampler is {data, tensor});
that is what `placement.strategy = "plan"` runs. Without it the search also takes trainer meshes
with a tensor axis and fsdp across nodes, which the simulator needs for 70B and larger models.
"""
from __future__ import annotations

import dataclasses
import itertools

from sharding.placement import PlacementError, make_placement
from planner.cost import (Mesh, Plan, Workload, apart, crossing_bytes_per_s, hosts,
                          stage_times, step_time)
from planner.devices import DeviceSpec, Efficiency
from planner.footprint import REMATS
from planner.memory import HEADROOM, kv_rows, memory, total_bytes


@dataclasses.dataclass(frozen=True)
class Ranked:
  plan: Plan
  step_s: float
  stages: dict
  memory: dict  # bytes per device of each device group
  reason: str


def _powers_of_two(limit: int) -> list[int]:
  return [2 ** i for i in range(limit.bit_length()) if 2 ** i <= limit]


def _divides_model(w: Workload, tensor: int, fsdp: int = 1, replicate_kv: bool = False) -> bool:
  """jaxrl's rules shard heads, KV heads, MLP and vocabulary over `tensor`; `replicate_kv`
  (simulation only, as vLLM does) copies KV heads to a tensor group larger than their count."""
  m = w.model
  kv = m.n_kv_heads % tensor == 0 or (replicate_kv and tensor % m.n_kv_heads == 0)
  dims = (m.n_heads, m.moe.d_ff if m.moe.experts else m.d_ff, m.vocab_size)
  return kv and all(d % tensor == 0 for d in dims) and m.d_model % fsdp == 0


def _trainer_meshes(devices: int, dev: DeviceSpec, presets_only: bool):
  if presets_only:  # fsdp inside each host, data parallel across hosts; a TPU slice: fsdp
    data = 1 if dev.platform == "tpu" else hosts(devices, dev)
    yield Mesh(data=data, fsdp=devices // data)
    return
  for tensor in _powers_of_two(min(devices, dev.devices_per_node)):
    for fsdp in _powers_of_two(devices // tensor):
      yield Mesh(data=devices // (tensor * fsdp), fsdp=fsdp, tensor=tensor)


def _sampler_meshes(devices: int, dev: DeviceSpec, presets_only: bool):
  """Tensor parallel inside a host; beyond the presets also over two (a model too large for
  one host's memory in the compute dtype)."""
  widest = dev.devices_per_node * (1 if presets_only else 2)
  for tensor in _powers_of_two(min(devices, widest)):
    yield Mesh(data=devices // tensor, tensor=tensor)


def _splits(n: int, dev: DeviceSpec) -> list[int]:
  """Trainer device counts for separate / interleave: eighths of the devices, whole per host."""
  h = hosts(n, dev)
  return sorted({n * i // 8 for i in range(1, 8) if (n * i // 8) % h == 0 and n * i % 8 == 0})


def candidates(w: Workload, n: int, dev: DeviceSpec, *, modes=("sync", "async"),
               presets_only: bool = True, staleness: int = 1):
  """Every plan for `n` devices of kind `dev` (not yet checked against memory or batch sizes)."""
  layouts = [("colocate", n, n)]
  for k in _splits(n, dev):
    layouts += [("separate", k, n - k), ("interleave", k, k)]
  for (strategy, k, ns), mode in itertools.product(layouts, modes):
    if mode == "async" and strategy != "separate":
      continue
    scorer_size = (n - k) // 2 if strategy == "interleave" else k
    for trainer in _trainer_meshes(k, dev, presets_only):
      scorer = Mesh(fsdp=scorer_size) if strategy == "interleave" else trainer
      for sampler in _sampler_meshes(ns, dev, presets_only):
        offloads = (False, True) if (strategy, mode) == ("colocate", "sync") else (False,)
        for micro, remat, offload in itertools.product(_micro_batches(w, trainer), REMATS,
                                                       offloads):
          yield Plan(strategy, trainer, sampler, scorer, mode, micro, remat, staleness, offload)


def _micro_batches(w: Workload, trainer: Mesh) -> list[int]:
  minibatch, ways = w.rows // w.num_minibatches, trainer.data * trainer.fsdp
  sizes = [minibatch // 2 ** i for i in range(1, 6)]
  return [0] + [s for s in sizes if s >= ways and s % ways == 0 and minibatch % s == 0]


def problem(w: Workload, plan: Plan, n: int, dev: DeviceSpec, presets_only: bool) -> str:
  """Why a plan cannot run ('' when it can): batch splits, model dimensions, the presets."""
  t, s, r = plan.trainer, plan.sampler, plan.scorer
  if w.rows % (w.num_minibatches * t.data * t.fsdp):
    return "the minibatch does not split over the trainer's batch axes"
  if w.prompts % s.data or w.rows % (r.data * r.fsdp):
    return "the prompts do not split over the sampler's (or scorers') batch axes"
  if not (_divides_model(w, t.tensor, t.fsdp) and _divides_model(w, r.tensor, r.fsdp)
          and _divides_model(w, s.tensor, replicate_kv=not presets_only)):
    return "a mesh axis does not divide the model's dimensions"
  if apart(plan, dev) and t.size < s.size:
    return "the trainer has fewer devices than the sampler it mirrors (sharding/crossing.py)"
  if apart(plan, dev) and not crossing_bytes_per_s(dev):
    return f"no figure for the network between {dev.name} hosts (a crossing)"
  if presets_only:
    try:
      make_placement(plan.strategy, n, train_devices=t.size if plan.strategy != "colocate"
                     else 1, sampler_tensor=s.tensor, n_hosts=hosts(n, dev),
                     one_network=dev.platform == "tpu")
    except PlacementError as e:
      return str(e)
  return ""


def _reason(stages: dict, peak: float, rows: float, w: Workload, plan: Plan,
            dev: DeviceSpec) -> str:
  top = sorted(((v, k) for k, v in stages.items() if v > 0), reverse=True)[:2]
  parts = ", ".join(f"{k} {v:.3g} s" for v, k in top)
  waves = ""
  if rows < w.rows / plan.sampler.data:
    waves = f"; KV cache holds {rows:.0f} of {w.rows / plan.sampler.data:.0f} rows per replica"
  where = "in all" if dev.shared_compute else "per device"
  return (f"{parts}; peak {peak / 2**30:.1f} GiB {where} "
          f"({peak / dev.memory_bytes:.0%} of {dev.name}){waves}")


def search(w: Workload, n: int, dev: DeviceSpec, eff: Efficiency, *, modes=("sync", "async"),
           presets_only: bool = True, top: int | None = 10, staleness: int = 1) -> list[Ranked]:
  """The `top` (None: all) fastest plans that fit in memory, fastest first; async plans lag
  by up to `staleness` versions. On fake CPU devices memory is one pool: all devices' bytes
  together must fit it."""
  ranked = []
  per_device = dev.memory_bytes / n if dev.shared_compute else dev.memory_bytes
  for plan in candidates(w, n, dev, modes=modes, presets_only=presets_only,
                         staleness=staleness):
    if problem(w, plan, n, dev, presets_only):
      continue
    rows = kv_rows(w, plan, per_device)
    mem = memory(w, plan, per_device, tpu=dev.platform == "tpu")
    peak = total_bytes(mem, plan) if dev.shared_compute else max(mem.values())
    if rows < 1 or peak > HEADROOM * dev.memory_bytes:
      continue
    stages = stage_times(w, dev, eff, plan, rows)
    step = step_time(stages, plan, dev, eff)
    ranked.append(Ranked(plan, step, stages, mem, _reason(stages, peak, rows, w, plan, dev)))
  ranked.sort(key=lambda r: (r.step_s, r.plan.trainer.size))
  return ranked if top is None else ranked[:top]
