"""Copies of a model's parameters in its compute dtype (the sampler's, a frozen role's, the
update's once-per-minibatch cast of its layers): which leaves to cast, and the cast."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.config import ModelConfig
from jaxrl.models.lora import SUFFIX


def compute_dtypes(cfg: ModelConfig, params):
  """What a copy of `params` can hold already in the compute dtype (a tree of dtypes; None: as
  is): every matrix, except a scaled tied embedding, whose LM head the model computes from the
  float32 values. The model casts its matrices to the compute dtype where it multiplies, so
  such a copy (the sampler's, a frozen role's) gives the same results as the float32
  parameters."""
  dt = jnp.dtype(cfg.compute_dtype)
  keep = cfg.tie_embeddings and cfg.scale_tied_head

  def rule(path, x):
    embed = any(getattr(k, "key", None) == "embed" for k in path)
    return dt if x.ndim > 1 and x.dtype != dt and not (keep and embed) else None
  return jax.tree_util.tree_map_with_path(rule, params)


def cast_to(params, dtypes):
  """`params` with the leaves `dtypes` names cast (see `compute_dtypes`)."""
  return jax.tree.map(lambda x, d: x if d is None else x.astype(d), params, dtypes)


def frozen_base_dtypes(cfg: ModelConfig, params):
  """An adapted model's stored dtypes: its frozen base as `compute_dtypes` gives (what a frozen
  role holds), its LoRA adapters (trained) as they are, float32."""
  adapter = lambda path: any(str(getattr(k, "key", "")).endswith(SUFFIX) for k in path)
  return jax.tree_util.tree_map_with_path(lambda path, d: None if adapter(path) else d,
                                          compute_dtypes(cfg, params))
