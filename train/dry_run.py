"""`--dry_run`: check a config on the CPU for the hardware it targets, allocating nothing.

The cluster is built abstractly (`RoleCluster(initialize=False)`: `nnx.eval_shape`, every
parameter sharding resolved on a fake mesh of `placement.cpu_devices` devices, batch sizes checked
against the meshes), and per-device memory is tallied from the shardings themselves: each
parameter's shard on each device, times what the role keeps of it (optimizer moments and gradients
for the trained roles, a compute-dtype copy for the sampler), plus the sampler's KV cache and an
estimate of the update's activations. The verdict is against `placement.device_memory_gb`.
"""
from __future__ import annotations

import collections

import jax
import numpy as np

from jaxrl.algos.logprobs import chunk_length
from jaxrl.config import ConfigError, ExperimentConfig
from sharding.placement import PlacementError
from sharding.rules import SAMPLER_RULES
from train.cluster import RoleCluster, batch_ways

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


def _kv_cache(cfg: ExperimentConfig, cluster: RoleCluster) -> dict:
  """The sampler's KV cache at its largest (every rollout at prompt + completion slots)."""
  m, mesh = cfg.model, cluster.meshes["sampler"]
  rows = cfg.rl.rollouts / batch_ways(mesh, SAMPLER_RULES)
  slots = cfg.data.max_prompt_tokens + cfg.rl.max_new_tokens
  kv_heads = m.n_kv_heads / min(mesh.shape.get("tensor", 1), m.n_kv_heads)
  per = rows * slots * m.n_layers * 2 * kv_heads * m.head_dim * np.dtype(m.compute_dtype).itemsize
  return {d.id: int(per) for d in mesh.devices.flat}


def _logits(cfg: ExperimentConfig, rows: float, rows_global: int, copies: int) -> float:
  """Bytes of one chunk's float32 logits-sized arrays (jaxrl/algos/logprobs.py: log-probs are
  computed a chunk of completion positions at a time; `copies` such arrays live at once)."""
  v = cfg.model.vocab_size
  return rows * chunk_length(rows_global, cfg.rl.max_new_tokens, v) * v * 4 * copies


def _activations(cfg: ExperimentConfig, cluster: RoleCluster) -> dict:
  """Rough bytes the update keeps for its backward pass on one micro-batch (`rl.pass_rows`, no
  rematerialisation): per layer and token the block's inputs, projections and MLP hidden
  states, per head the attention probabilities (float32), and one chunk's logits, probabilities
  and their gradient."""
  m, rl = cfg.model, cfg.rl
  mesh = cluster.meshes["actor"]
  rows_global = rl.pass_rows
  rows = rows_global / batch_ways(mesh, cluster.actor.rules)
  t = cfg.data.max_prompt_tokens + rl.max_new_tokens
  dt = np.dtype(m.compute_dtype).itemsize
  per_token_layer = dt * (4 * m.d_model + (m.n_heads + 2 * m.n_kv_heads) * m.head_dim
                          + 3 * m.d_ff) + 4 * m.n_heads * t
  total = rows * t * m.n_layers * per_token_layer + _logits(cfg, rows, rows_global, 3)
  return {d.id: int(total) for d in mesh.devices.flat}


def _scoring(cfg: ExperimentConfig, cluster: RoleCluster) -> dict:
  """A scoring pass (old or reference log-probs) on `rl.pass_rows` rows: one chunk's float32
  logits and their exponent (the passes run piece by piece, train/steps.map_minibatches)."""
  rl, mesh = cfg.rl, cluster.meshes["reference"]
  rows_global = rl.pass_rows
  rows = rows_global / batch_ways(mesh, cluster.actor.rules)
  return {d.id: int(_logits(cfg, rows, rows_global, 2)) for d in mesh.devices.flat}


def memory_table(cfg: ExperimentConfig, cluster: RoleCluster) -> dict[str, dict]:
  """{item: {device id: bytes}} for everything an RL step holds at its peak."""
  trained = ["actor"] + (["critic"] if cfg.rl.advantage == "gae" else [])
  frozen = ["reference"] + (["reward"] if cfg.rl.reward == "reward_model" else [])
  table = {}
  for name in trained + frozen:
    role = cluster.get(name) or cluster.add(name, initialize=False)
    table[f"{name} parameters (float32)"] = shard_bytes(role.abstract())
  for name in trained:
    params = table[f"{name} parameters (float32)"]
    table[f"{name} Adam moments"] = {d: 2 * b for d, b in params.items()}
    copies = 2 if cfg.rl.micro_batch_size else 1  # accumulated + the micro-batch's
    table[f"{name} gradients"] = {d: copies * b for d, b in params.items()}
  itemsize = np.dtype(cfg.model.compute_dtype).itemsize
  sampler = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         cluster.actor.abstract(), cluster.sampler_shardings)
  table[f"sampler copy ({cfg.model.dtype})"] = shard_bytes(sampler, itemsize)
  table["sampler KV cache"] = _kv_cache(cfg, cluster)
  table["update activations (estimate)"] = _activations(cfg, cluster)
  table["scoring pass logits (one chunk)"] = _scoring(cfg, cluster)
  return table


def report(cfg: ExperimentConfig) -> tuple[list[str], bool]:
  """The dry run's lines, and whether the busiest device fits `placement.device_memory_gb`."""
  if cfg.placement.strategy == "plan":  # the plan depends on the target's devices, not these
    raise ConfigError("config.placement.strategy: --dry_run checks a fixed placement; "
                      "`jaxrl-plan --config FILE --device KIND --devices N` prints the plan to set")
  cluster = RoleCluster(cfg, initialize=False)
  try:
    table = memory_table(cfg, cluster)
  except PlacementError as e:  # a role's mesh axis does not divide a parameter
    raise ConfigError(str(e)) from None
  totals = collections.Counter()
  for per_device in table.values():
    totals.update(per_device)
  groups = {"trainer": cluster.meshes["actor"], "sampler": cluster.meshes["sampler"]}
  busiest = {name: max((d.id for d in mesh.devices.flat), key=totals.get)
             for name, mesh in groups.items()}
  if busiest["trainer"] == busiest["sampler"]:
    busiest = {"trainer and sampler": busiest["trainer"]}
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(cluster.actor.abstract()))
  meshes = ", ".join(f"{role} {dict(mesh.shape)}" for role, mesh in cluster.meshes.items())
  lines = [f"model: {n_params / 1e9:.3f} B parameters, {cfg.model.n_layers} layers, "
           f"d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}",
           f"placement {cfg.placement.strategy} on {len(cluster.devices)} devices: {meshes}",
           "every parameter sharding resolved; batch sizes divide their meshes",
           "GiB per device, on the busiest " + " and ".join(
               f"{name} device ({d})" for name, d in busiest.items()) + ":"]
  cells = lambda per_device: "".join(f"{per_device.get(d, 0) / GIB:10.2f}"
                                     for d in busiest.values())
  for item, per_device in table.items():
    lines.append(f"  {item:<34}{cells(per_device)}")
  need, have = max(totals[d] for d in busiest.values()) / GIB, cfg.placement.device_memory_gb
  fits = not have or need <= have
  verdict = ("fits" if fits else "DOES NOT FIT") if have else "no device_memory_gb to check"
  lines.append(f"  {'total':<34}{cells(totals)}   (device memory {have:g} GiB: {verdict})")
  return lines, fits
