"""The weight push's program, lowered for a target compile (target_compile.py), where the
sampler has hosts of its own: the trainer reshards the actor's weights into its mirror of the
sampler's layout (sharding/crossing.py `trainers_mirror`) a bucket at a time, each leaf cast to
the compute dtype and laid out as the sampler's layout repeated over all the trainer's devices
(sharding/reshard.py `replicas_over`: collectives inside the trainer's mesh, no host copy); the
first repeat is kept, and crosses to the sampler from there.

The program lowered is the push's largest bucket (the buckets run one after another: the largest
is the phase's program peak); the copy landed so far is the dry run's "weight push" item, which
the compile's peak adds (target_compile.py `phase_peaks`).
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from jaxrl.config import ExperimentConfig
from sharding.crossing import trainers_mirror
from sharding.reshard import cast_sizes, plan_buckets, replicas_over
from train.roles.cluster import RoleCluster


def push_bucket(cfg: ExperimentConfig, cluster: RoleCluster):
  """(name, lower, state) of the push's largest bucket; None where the trainer's mirror is not a
  whole fraction of the actor's devices (the push then copies within each host, not lowered)."""
  weights, actor = cluster.sampler_weights, cluster.actor
  devices = set(actor.mesh.devices.flat)
  mirror = trainers_mirror(cluster.meshes)
  if not set(mirror.devices.flat) <= devices or len(devices) % mirror.size:
    return None
  like, dtypes = weights.sources()
  like, targets = jax.tree.leaves(like), jax.tree.leaves(weights.shardings)
  casts = jax.tree.leaves(dtypes, is_leaf=lambda v: v is None)
  sizes = cast_sizes(like, casts)
  bucket = max(plan_buckets(sizes, cfg.placement.reshard_bucket_mb << 20),
               key=lambda idx: sum(sizes[i] for i in idx))
  sources = [like[i] for i in bucket]  # (the bucket's leaves, as the actor holds them)
  spread = [replicas_over(NamedSharding(mirror, targets[i].spec), devices) for i in bucket]

  def cast(leaves):
    return [x.astype(casts[i] or x.dtype) for i, x in zip(bucket, leaves)]

  lower = lambda: jax.jit(cast, out_shardings=spread).lower(sources)  # noqa: E731
  return "weight push (largest bucket)", lower, sources
