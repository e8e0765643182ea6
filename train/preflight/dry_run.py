"""`--dry_run`: check a config on the CPU for the hardware it targets, allocating nothing.

The cluster is built abstractly (`RoleCluster(initialize=False)`: `nnx.eval_shape`, every
parameter sharding resolved on a fake mesh of `placement.cpu_devices` devices, batch sizes checked
against the meshes). Per-device memory is tallied from the shardings themselves: what stays
through a step (each role's parameter shard, the trained roles' Adam moments, the sampler's
compute-dtype copy), plus the largest of the step's phases, which never overlap on one device:
generation (the KV cache), the scoring passes, each update (gradients, activations, log-prob
logits: planner/footprint.py, the planner's memory model too). The verdict is against
the memory the runtime really gets (`usable_memory_gb`); a config that does not fit is told the
largest micro-batch, or the remat, that would.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxrl import platform
from jaxrl.config import ConfigError, ExperimentConfig, offload_items, usable_memory_gb
from jaxrl.models.attention import attention_impl, flash
from jaxrl.models.config import from_fields
from jaxrl.models.lm_head import chunk_length
from planner import footprint, footprint_tpu
from sharding.crossing import trainers_mirror
from sharding.placement import PlacementError
from sharding.rules import SAMPLER_RULES, batch_ways
from train.roles.cluster import RoleCluster
from train.updates.batching import micro_batches

GIB = 1 << 30


def shard_bytes(abstract, itemsize: int | None = None) -> dict:
  """Bytes each device holds of an abstract state (ShapeDtypeStructs carrying shardings)."""
  out = collections.Counter()
  for leaf in jax.tree.leaves(abstract):
    size = itemsize or np.dtype(leaf.dtype).itemsize
    for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
      shape = [len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)]
      out[device.id] += int(np.prod(shape)) * size
  return out


def _dtype_name(abstract) -> str:
  """The dtype holding most of a state's bytes (a bf16 copy keeps its norms in float32)."""
  sizes = collections.Counter()
  for leaf in jax.tree.leaves(abstract):
    sizes[np.dtype(leaf.dtype).name] += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
  return sizes.most_common(1)[0][0]


def _roles(cfg: ExperimentConfig) -> tuple[list[str], list[str]]:
  trained = ["actor"] + ["critic"] * cfg.rl.trains_critic
  return trained, ["reference"] + (["reward"] if cfg.rl.reward == "reward_model" else [])


def resident_table(cfg: ExperimentConfig, cluster: RoleCluster) -> dict[str, dict]:
  """{item: {device id: bytes}} of what stays on the devices through a whole RL step (before
  `placement.offload`: `offloaded`)."""
  trained, frozen = _roles(cfg)
  table = {}
  for name in trained + frozen:
    role = cluster.get(name) or cluster.add(name, initialize=False)
    if name == "reference" and _reference_is_base(cfg, cluster, role):
      continue  # LoRA: the reference is the actor's own base
    learned, base = role.split(role.abstract())
    if base is None:
      table[f"{name} parameters ({_dtype_name(learned)})"] = shard_bytes(learned)
    else:
      table[f"{name} frozen base ({_dtype_name(base)})"] = shard_bytes(base)
      table[f"{name} LoRA adapters ({_dtype_name(learned)})"] = shard_bytes(learned)
    if name in trained:
      table[f"{name} Adam moments"] = {d: 2 * b for d, b in shard_bytes(learned, 4).items()}
  copy = cluster.sampler_weights
  if copy.shares_base:  # LoRA, adapters mode: the sampler reads the actor's base
    table["sampler's LoRA adapters"] = shard_bytes(cluster.actor.split(copy.abstract())[0])
  else:
    table[f"sampler copy ({_dtype_name(copy.abstract())})"] = shard_bytes(copy.abstract())
  return table


PUSHED = "the trainer's mirror, made for the push"  # (a "weight push" phase item)


def pushed_mirror(cluster: RoleCluster):
  """Where the sampler has hosts of its own (a target's several hosts, checked from one
  process): the copy the trainer makes in the sampler's layout on its own first devices for a
  push (or a held-out evaluation), which crosses from there and is dropped once sent
  (train/roles/sampler_weights.py `release`), as abstract arrays; None elsewhere (in a job of
  several processes the trainer's cluster holds its mirror as the sampler copy)."""
  if cluster.split is not None or cluster.placement.roles["sampler"].group == "trainer":
    return None
  on = trainers_mirror(cluster.meshes)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(on, x.sharding.spec)),
      cluster.sampler_weights.abstract())


def _reference_is_base(cfg: ExperimentConfig, cluster: RoleCluster, reference) -> bool:
  """Whether RL's reference will be the LoRA actor's own base arrays: the layouts agree and the
  adapters start at zero: no earlier stage trains them, and no `init_checkpoint` (which may hold
  trained ones) gives them; otherwise the reference is counted as a merged copy."""
  trained_before = cfg.sft.steps or cfg.dpo.steps or cfg.init_checkpoint
  return cluster.reference_shares_base(reference) and not trained_before


def offloaded(cfg: ExperimentConfig, resident: dict, phases: dict) -> tuple[dict, dict]:
  """The tables with `placement.offload` applied (train/roles/offload.py): an offloaded item leaves
  what stays and is counted only in the phases that have it on the devices (the optimizer
  state in its update, the frozen models while scoring, the sampler's copy outside updates)."""
  items = offload_items(cfg.placement.offload)
  resident, phases = dict(resident), {p: dict(v) for p, v in phases.items()}
  def move(key: str, into) -> None:
    per_device = resident.pop(key)
    for phase in into:
      phases[phase][f"{key} (onloaded)"] = per_device
  for key in list(resident):
    role = key.split(" ")[0]
    if "optimizer" in items and key.endswith("Adam moments"):
      move(key, [f"{role} update"])
    elif "frozen" in items and role in ("reference", "reward"):
      move(key, ["scoring"])
    elif "sampler" in items and key.startswith("sampler copy"):
      move(key, [p for p in phases if not p.endswith("update")])
  return resident, phases


def target_platform() -> str:
  """The platform the dry run counts memory for: a target compile's (a TPU slice), the
  accelerator's it runs on, or on the CPU a GPU's (the memory `placement.device_memory_gb`
  describes is an accelerator's)."""
  backend = platform.backend()
  return "gpu" if backend == "cpu" else backend


def _per_device(mesh, value: float) -> dict:
  return {d.id: int(value) for d in mesh.devices.flat}


def _pass(cfg: ExperimentConfig, mesh, rules, lm_head: bool = True) -> dict:
  """What the memory model needs of an update or scoring pass on `mesh`: rows per device,
  tokens per row, log-prob chunk (0: a value or reward head, no logits), tensor degree, and
  whether attention is a flash kernel on the target (jaxrl/models/attention.flash)."""
  rl, m = cfg.rl, cfg.model
  return dict(
      rows=rl.pass_rows / batch_ways(mesh, rules),
      seq_len=cfg.data.max_prompt_tokens + rl.rollout.max_new_tokens,
      logit_chunk=chunk_length(rl.pass_rows, rl.rollout.max_new_tokens, m.vocab_size) * lm_head,
      tensor=mesh.shape.get("tensor", 1), flash_attention=_flash(cfg))


def _flash(cfg: ExperimentConfig) -> bool:
  """Whether the passes' attention is a flash kernel on the target. With shared prefixes
  (`rl.batching.share_prefix`) only the splash kernel's over a cached chunk (a TPU's); cuDNN's
  route has dense scores there, and a tree a dense mask."""
  backend = target_platform()
  if not cfg.rl.shares_prefix:
    return flash(cfg.model, backend)
  return attention_impl(cfg.model, backend) == "splash" and not cfg.rl.batching.pack_length


def update_footprint(cfg: ExperimentConfig, mesh, rules, param_bytes: float, params: int,
                     lm_head: bool = True) -> dict[str, float]:
  """One device's peak during an RL update beyond its resident state (footprint.update_peak):
  `param_bytes` of float32 parameters on it, `params` in the whole model."""
  m = cfg.model
  fsdp, tensor = mesh.shape.get("fsdp", 1), mesh.shape.get("tensor", 1)
  gathered = params * np.dtype(m.compute_dtype).itemsize / tensor if fsdp > 1 else 0.0
  tpu = (dict(params=params, fsdp=fsdp, lora=cfg.lora.enabled and lm_head)
         if platform.backend() == "tpu" else None)  # (building for a TPU target)
  rl = cfg.rl  # (one micro-batch per minibatch accumulates nothing: train/updates/batching.py)
  accumulate = micro_batches(rl.rollouts // rl.batching.num_minibatches,
                             rl.batching.micro_batch_size) > 1
  return footprint.update_peak(m, **_pass(cfg, mesh, rules, lm_head), param_bytes=param_bytes,
                               gathered_bytes=gathered, remat=m.layers.remat,
                               accumulate=accumulate, tpu=tpu)


def _update_items(cfg: ExperimentConfig, role, lm_head: bool) -> dict[str, dict]:
  """{item: {device id: bytes}} of `role`'s update at its peak, on each device of its mesh."""
  params = shard_bytes(role.split(role.abstract())[0], 4)  # what trains (LoRA: the adapters)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(role.abstract()))
  peaks = {d: update_footprint(cfg, role.mesh, role.rules, b, n, lm_head)
           for d, b in params.items()}
  scores = "flash attention" if _flash(cfg) else "[T, T] scores"
  names = {"activations": f"activations (remat={cfg.model.layers.remat}, {scores})"}
  return {names.get(item, item): {d: int(p[item]) for d, p in peaks.items()}
          for item in footprint.UPDATE_ITEMS}


def phase_table(cfg: ExperimentConfig, cluster: RoleCluster) -> dict[str, dict[str, dict]]:
  """{phase: {item: {device id: bytes}}}: what each phase of a step adds at its peak."""
  trained, _ = _roles(cfg)
  m, rl = cfg.model, cfg.rl
  smesh = cluster.meshes["sampler"]
  rows = rl.rollouts / batch_ways(smesh, SAMPLER_RULES)
  slots = cfg.data.max_prompt_tokens + rl.rollout.max_new_tokens
  kv = footprint.kv_cache_bytes(m, rows, slots, smesh.shape.get("tensor", 1))
  phases = {"generation": {"KV cache": _per_device(smesh, kv)}}
  for name in trained:
    phases[f"{name} update"] = _update_items(cfg, cluster.get(name), lm_head=name == "actor")
  if rl.rollout.exact == "replay" and not (rl.batching.num_minibatches == 1
                                           and rl.carries_old_logprobs):
    actor = cluster.get("actor")  # (the later minibatches' values: a decode loop's KV cache)
    rows = rl.rollouts / rl.replay_pieces / batch_ways(actor.mesh, actor.rules)
    replay = footprint.kv_cache_bytes(m, rows, slots + 1, actor.mesh.shape.get("tensor", 1))
    phases["actor update"]["the replayed decode loop's KV cache"] = _per_device(actor.mesh,
                                                                                replay)
  scoring = [("reference", "reference")] + [("reward", "reward")] * (rl.reward == "reward_model")
  scoring += [("actor", "old log-probs")] * rl.carries_old_logprobs
  scoring += [("critic", "values")] * rl.trains_critic
  phases["scoring"] = {}
  for name, what in scoring:  # started together: on shared devices they add up
    role = cluster.get(name)
    peak = scoring_footprint(cfg, role)
    phases["scoring"][what] = _per_device(role.mesh, sum(peak.values()))
  if (mirrored := pushed_mirror(cluster)) is not None:  # (resident only while it is sent)
    phases["weight push"] = {PUSHED: shard_bytes(mirrored)}
  return phases


def scoring_footprint(cfg: ExperimentConfig, role) -> dict[str, float]:
  """One device's peak during `role`'s scoring pass beyond its resident state
  (footprint.scoring_peak)."""
  lm_head = role.name in ("actor", "reference")
  shape = _pass(cfg, role.mesh, role.rules, lm_head)
  if platform.backend() != "tpu":
    return footprint.scoring_peak(cfg.model, **shape)
  m, abstract = cfg.model, role.abstract()
  cb = np.dtype(m.compute_dtype).itemsize
  wide = [x for x in jax.tree.leaves(abstract) if np.dtype(x.dtype).itemsize > cb]
  shape.pop("flash_attention")
  return footprint_tpu.scoring_peak(
      m, **shape, fsdp=role.mesh.shape.get("fsdp", 1), pieces=cfg.rl.rollouts // cfg.rl.pass_rows,
      cast_bytes=max(shard_bytes(wide, cb).values(), default=0), cb=cb)


def summed(table: dict) -> collections.Counter:
  """{device id: bytes} of all of a table's items together."""
  out = collections.Counter()
  for per_device in table.values():
    out.update(per_device)
  return out


def _totals(resident: dict, phases: dict) -> tuple[dict, dict]:
  """Per device: its resident bytes plus its largest phase, and that phase's name."""
  base = summed(resident)
  sums = {phase: summed(items) for phase, items in phases.items()}
  devices = set(base).union(*sums.values())
  largest = {d: max(phases, key=lambda p: sums[p].get(d, 0)) for d in devices}
  return {d: base.get(d, 0) + sums[largest[d]].get(d, 0) for d in devices}, largest


def _micro_batches(cfg: ExperimentConfig, cluster: RoleCluster) -> list[int]:
  """Micro-batch sizes smaller than today's pass that split a minibatch and every mesh's batch
  split, largest first."""
  rl = cfg.rl
  ways = math.lcm(*(batch_ways(cluster.meshes[r], cluster.actor.rules)
                    for r in ("actor", "reference", "reward", "critic")))
  minibatch = rl.rollouts // rl.batching.num_minibatches
  return [m for m in range(rl.pass_rows - 1, 0, -1) if minibatch % m == 0 and m % ways == 0]


def remedy(cfg: ExperimentConfig, cluster: RoleCluster, resident: dict, usable: float) -> str:
  """The cheapest change that makes `cfg` fit in `usable` bytes per device: the largest
  micro-batch that fits, else the lightest remat (with the largest micro-batch it then needs),
  else more devices. A change shrinks only the update and scoring passes; what stays does not."""
  stays = max(summed(resident).values())
  if stays > usable:
    return f"more devices: what stays through a step alone takes {stays / GIB:.2f} GiB"
  remats = footprint.REMATS[footprint.REMATS.index(cfg.model.layers.remat):]
  smallest = cfg.rl.pass_rows
  for remat in remats:
    for micro in [0] + _micro_batches(cfg, cluster):
      if not micro and remat == cfg.model.layers.remat:
        continue
      try:
        trial = dataclasses.replace(
            cfg, model=from_fields({"layers.remat": remat}, base=cfg.model),
            rl=dataclasses.replace(cfg.rl, batching=dataclasses.replace(
                cfg.rl.batching, micro_batch_size=micro or cfg.rl.batching.micro_batch_size)))
      except ValueError:
        continue
      smallest = min(smallest, trial.rl.pass_rows)
      if max(_totals(resident, phase_table(trial, cluster))[0].values()) <= usable:
        changes = ([f"rl.batching.micro_batch_size={micro}"] * bool(micro)
                   + [f"model.layers.remat={remat}"] * (remat != cfg.model.layers.remat))
        return "try " + " and ".join(changes)
  return (f"more devices (or shorter sequences): not even model.layers.remat=full with "
          f"{smallest}-row micro-batches fits")


def tables(cfg: ExperimentConfig, devices=None) -> tuple[RoleCluster, dict, dict]:
  """The cluster built abstractly on `devices`, what stays through a step and each phase's
  items (`placement.offload` applied); a mesh axis that does not divide a parameter is a
  ConfigError."""
  cluster = RoleCluster(cfg, devices, initialize=False)
  try:
    resident, phases = offloaded(cfg, resident_table(cfg, cluster), phase_table(cfg, cluster))
  except PlacementError as e:  # a role's mesh axis does not divide a parameter
    raise ConfigError(str(e)) from None
  return cluster, resident, phases


def busiest_total(cfg: ExperimentConfig, devices=None) -> int:
  """The dry run's estimate for its busiest device: what stays plus its largest phase, bytes."""
  _, resident, phases = tables(cfg, devices)
  return max(_totals(resident, phases)[0].values())


def report(cfg: ExperimentConfig, devices=None) -> tuple[list[str], bool]:
  """The dry run's lines, and whether the busiest device fits the memory the runtime gets;
  `devices`: the fake devices to place on (default: all of this process's)."""
  if cfg.placement.strategy == "plan":  # the plan depends on the target's devices, not these
    raise ConfigError("config.placement.strategy: --dry_run checks a fixed placement; "
                      "`jaxrl-plan --config FILE --device KIND --devices N` prints the plan to set")
  cluster, resident, phases = tables(cfg, devices)
  totals, largest = _totals(resident, phases)
  groups = {"trainer": cluster.meshes["actor"], "sampler": cluster.meshes["sampler"]}
  busiest = {name: max((d.id for d in mesh.devices.flat), key=totals.get)
             for name, mesh in groups.items()}
  if busiest["trainer"] == busiest["sampler"]:
    busiest = {"trainer and sampler": busiest["trainer"]}
  lines = _header(cfg, cluster, busiest)
  cells = lambda per_device: "".join(f"{per_device.get(d, 0) / GIB:10.2f}"
                                     for d in busiest.values())
  rows = list(resident.items()) + [(f"{phase}: {item}", per_device)
                                   for phase, items in phases.items()
                                   for item, per_device in items.items()]
  for item, per_device in rows:
    if any(per_device.get(d, 0) for d in busiest.values()):
      lines.append(f"  {item:<56}{cells(per_device)}")
  at = ", ".join(f"{largest[d]} on {d}" for d in busiest.values())
  lines.append(f"  {'total (what stays + the largest phase)':<56}{cells(totals)}   ({at})")
  lines.append(_verdict(cfg, cluster, resident, max(totals[d] for d in busiest.values())))
  return lines, not lines[-1].startswith("verdict: DOES NOT FIT")


def _header(cfg: ExperimentConfig, cluster: RoleCluster, busiest: dict) -> list[str]:
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(cluster.actor.abstract()))
  meshes = ", ".join(f"{role} {dict(mesh.shape)}" for role, mesh in cluster.meshes.items())
  return [f"model: {n_params / 1e9:.3f} B parameters, {cfg.model.n_layers} layers, "
          f"d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}",
          f"placement {cfg.placement.strategy} on {len(cluster.devices)} devices: {meshes}",
          "every parameter sharding resolved; batch sizes divide their meshes",
          "GiB per device, on the busiest " + " and ".join(
              f"{name} device ({d})" for name, d in busiest.items()) + ":"]


def _verdict(cfg: ExperimentConfig, cluster: RoleCluster, resident: dict, need: float) -> str:
  """fits | DOES NOT FIT: the remedy, against `usable_memory_gb` (JAX's share of a device)."""
  pl = cfg.placement
  if not pl.device_memory_gb:
    return "verdict: no placement.device_memory_gb to check against"
  usable = usable_memory_gb(pl)
  where = (f"{need / GIB:.2f} GiB of the {usable:g} GiB JAX gets of each "
           f"{pl.device_memory_gb:g} GiB device (placement.device_memory_fraction)")
  if need <= usable * GIB:
    return f"verdict: fits: {where}"
  return f"verdict: DOES NOT FIT: {remedy(cfg, cluster, resident, usable * GIB)}; {where}"
