"""Host-side front end of the engine: buckets, padding, sharded decode on the sampler mesh.

A list of prompts (token ids) is left-padded into a (batch, length) bucket so that new batches of
similar size reuse the compiled program instead of recompiling; padding rows are dropped from the
result. With a mesh, decode runs under the sampling rules (tensor parallel over heads / mlp,
data parallel over the batch).
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from sampler.engine import Rollout, generate
from sampler.methods import SamplingConfig
from sharding.mesh import batch_sharding
from jaxrl.partitioning import Rules, activation_rules, logical_to_spec
from sharding.rules import SAMPLER_RULES

LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024)


def bucket(size: int, buckets: Sequence[int]) -> int:
  at = bisect.bisect_left(buckets, size)
  if at == len(buckets):
    raise ValueError(f"size {size} is larger than the largest bucket {buckets[-1]}")
  return buckets[at]


def jit_generate(graphdef: nnx.GraphDef, cfg: SamplingConfig, *, n: int = 1,
                 mesh: Mesh | None = None, rules: Rules = SAMPLER_RULES, param_shardings=None,
                 on_trace: Callable[[], None] | None = None):
  """`generate` jitted for a mesh: `fn(params, tokens_BP, valid_BP, key, max_new_B=None)`.

  Data parallelism is manual (shard_map over the mesh axes `batch` maps to): every data shard
  runs its own decode loop on its rows with its own random stream (the key folded with the shard
  index). Without other mesh axes a shard stops when its own rows are done, with no per-token
  collective; with tensor parallelism inside the shards, whose collectives span every device of
  the program, all shards stop together (one all-reduce of the done flags per step). Inside a
  shard the remaining axes stay automatic, following `rules`.
  """

  def run(params, tokens_BP, valid_BP, key, max_new_B, inner_rules=rules, all_done=jnp.all):
    if on_trace is not None:
      on_trace()
    with activation_rules(mesh, inner_rules):
      return generate(graphdef, params, tokens_BP, valid_BP, key, max_new_B, cfg=cfg, n=n,
                      all_done=all_done)

  if mesh is None:
    fn = jax.jit(run)
  else:
    fn = _jit_on_mesh(run, mesh, rules, param_shardings)
  return lambda params, tokens_BP, valid_BP, key, max_new_B=None: fn(
      params, tokens_BP, valid_BP, key, max_new_B)


def _jit_on_mesh(run, mesh: Mesh, rules: Rules, param_shardings):
  """`run` jitted on `mesh`: manual over the data axes, automatic over the rest."""
  rows, grid = batch_sharding(mesh, rules, 1), batch_sharding(mesh, rules, 2)
  data = logical_to_spec(("batch",), rules, mesh)[0]
  data_axes = () if data is None else (data,) if isinstance(data, str) else tuple(data)
  if not data_axes:
    fn = jax.jit(run, in_shardings=(param_shardings, grid, grid, None, rows))
  else:
    no_batch = tuple(rule for rule in rules if rule[0] != "batch")
    lockstep = any(size > 1 for name, size in mesh.shape.items() if name not in data_axes)

    def all_done(done_B):
      local = jnp.all(done_B).astype(jnp.int32)
      return (jax.lax.pmin(local, data_axes) if lockstep else local) > 0

    def shard(params, tokens_BP, valid_BP, key, max_new_B):
      key = jax.random.fold_in(key, jax.lax.axis_index(data_axes))
      return run(params, tokens_BP, valid_BP, key, max_new_B, inner_rules=no_batch,
                 all_done=all_done)

    split = PartitionSpec(data_axes)
    fn = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(PartitionSpec(), split, split,
                                                           PartitionSpec(), split),
                               out_specs=split, axis_names=set(data_axes), check_vma=False),
                 in_shardings=(param_shardings, grid, grid, None, rows))
  return fn


class Sampler:

  def __init__(self, graphdef: nnx.GraphDef, cfg: SamplingConfig, *, n: int = 1,
               mesh: Mesh | None = None, rules: Rules = SAMPLER_RULES, param_shardings=None,
               length_buckets: Sequence[int] = LENGTH_BUCKETS,
               batch_buckets: Sequence[int] = BATCH_BUCKETS):
    self.cfg, self.n, self.mesh, self.rules = cfg, n, mesh, rules
    self.length_buckets, self.batch_buckets = tuple(length_buckets), tuple(batch_buckets)
    self.traces = 0  # how many times the engine was traced (a retrace means a new bucket)

    self._fn = jit_generate(graphdef, cfg, n=n, mesh=mesh, rules=rules,
                            param_shardings=param_shardings, on_trace=self._count_trace)

  def _count_trace(self):
    self.traces += 1

  def __call__(self, params, prompts: Sequence[Sequence[int]], key: jax.Array,
               max_new_tokens: Sequence[int] | None = None) -> Rollout:
    """Generates `n` samples per prompt (rows group-major), as host numpy arrays."""
    b, p = bucket(len(prompts), self.batch_buckets), bucket(max(map(len, prompts)), self.length_buckets)
    tokens_BP = np.full((b, p), self.cfg.pad_id, np.int32)
    valid_BP = np.zeros((b, p), bool)
    for row, ids in enumerate(prompts):
      tokens_BP[row, p - len(ids):] = ids
      valid_BP[row, p - len(ids):] = True
    valid_BP[len(prompts):, -1] = True  # padding rows: one dummy token, so attention is defined
    budget = np.full((b,), self.cfg.max_new_tokens, np.int32)
    if max_new_tokens is not None:
      budget[:len(prompts)] = np.minimum(np.asarray(max_new_tokens, np.int32),
                                         self.cfg.max_new_tokens)
    budget_B = np.repeat(budget, self.n)
    out = jax.device_get(self._fn(params, tokens_BP, valid_BP, key, budget_B))
    keep = len(prompts) * self.n
    return jax.tree.map(lambda x: x[:keep], out)
