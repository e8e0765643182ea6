"""`model.layers.remat` over a decoder's blocks (jaxrl/models/transformer.py): a cacheless
training pass's, and a cached pass that is differentiated (a shared prefix's two passes:
train/updates/prefix.py). The sampler's cached passes never remat."""
from __future__ import annotations

import jax
from flax import nnx

from jaxrl.models.config import REMAT_POLICIES, ModelConfig
from jaxrl.models.layouts import ROWS


def remat_cached(cfg: ModelConfig, stacked: bool, run, block, j: int, i, x, kv_cache,
                 routes_BTK):
  """Layer `i` of a differentiated cached pass (`run`: transformer._Pass) under remat: its
  keys and values taken out of the cache (a stacked one's slice: the backward keeps that, not
  the whole cache per layer), the block checkpointed over them, the updated ones written
  back: (output, the whole updated cache, its `MoEStats` or None)."""
  if stacked:
    layer_cache = tuple(jax.lax.dynamic_index_in_dim(c, i, 1, keepdims=False)
                        for c in kv_cache)
  else:
    layer_cache = kv_cache[i]
  x, layer_cache, st = remat_block(cfg, block, x, *run.kind(j), layer_cache, run.cache_index,
                                   run.valid_BT, routes_BTK)
  if stacked:
    return x, tuple(jax.lax.dynamic_update_index_in_dim(c, u, i, 1)
                    for c, u in zip(kv_cache, layer_cache)), st
  return x, kv_cache[:i] + (layer_cache,) + kv_cache[i + 1:], st


def remat_block(cfg: ModelConfig, block, x_BTD, rope_BTH, mask_BTS, layer_cache,
                cache_index: int, valid_BT, routes_BTK):
  """`block` under `jax.checkpoint` (over `layer_cache` where one is given): its backward
  recomputes what the `model.layers.remat` policy does not save. The block is split into its
  pure state, so the checkpointed function closes over no traced module."""
  graphdef, state = nnx.split(block)

  def run(state, x_BTD, rope_BTH, mask_BTS, layer_cache, valid_BT, routes_BTK):
    return nnx.merge(graphdef, state)(x_BTD, rope_BTH, mask_BTS, layer_cache, cache_index,
                                      False, ROWS, valid_BT, routes_BTK)
  policy = REMAT_POLICIES[cfg.layers.remat]
  return jax.checkpoint(run, policy=policy)(state, x_BTD, rope_BTH, mask_BTS, layer_cache,
                                            valid_BT, routes_BTK)
