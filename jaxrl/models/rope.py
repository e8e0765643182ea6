"""Rotary position embeddings (RoPE): the per-pair frequencies with the config's scaling
(none, linear, Llama 3's), the (sin, cos) table of a batch's positions, and the rotation."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
  from jaxrl.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """RoPE's per-pair angular frequencies [head_dim / 2] (float32), with the config's scaling:
  `linear` divides them all by the factor; `llama3` divides the low ones (wavelengths above
  original_max_positions / low_freq_factor), keeps the high ones and blends in between."""
  half = cfg.head_dim // 2
  freq_H = 1.0 / cfg.rope.theta ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_dim)
  if cfg.rope.scaling == "linear":
    freq_H = freq_H / cfg.rope.factor
  elif cfg.rope.scaling == "llama3":
    wavelen_H = 2 * math.pi / freq_H
    old = cfg.rope.original_max_positions
    low, high = cfg.rope.low_freq_factor, cfg.rope.high_freq_factor
    smooth_H = (old / wavelen_H - low) / (high - low)
    blended_H = (1 - smooth_H) * freq_H / cfg.rope.factor + smooth_H * freq_H
    freq_H = np.where(wavelen_H > old / low, freq_H / cfg.rope.factor,
                      np.where(wavelen_H < old / high, freq_H, blended_H))
  return freq_H.astype(np.float32)


def table_frequencies(cfg: ModelConfig) -> np.ndarray:
  """The frequencies of a pass's table: the global layers', then, with sliding-window layers,
  the local layers' (their own base, unscaled): [head_dim / 2] or [head_dim]."""
  freq_H = inverse_frequencies(cfg)
  if not cfg.attention.sliding_window:
    return freq_H
  local = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, theta=cfg.rope.local_theta,
                                                            scaling="none"))
  return np.concatenate([freq_H, inverse_frequencies(local)])


def rope_table(positions_BT: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """(sin, cos) of the RoPE angles, [B, T, head_dim / 2] (twice that with local layers: the
  global part, then the local): computed once per forward pass and shared by every layer's
  queries and keys."""
  angle_BTH = positions_BT[..., None].astype(jnp.float32) * table_frequencies(cfg)
  return jnp.sin(angle_BTH), jnp.cos(angle_BTH)


def table_part(table: tuple, cfg: ModelConfig, local: bool, axis: int = -1) -> tuple:
  """A layer's part of a pass's table (`axis`: its frequency axis)."""
  if not cfg.attention.sliding_window:
    return table
  half = cfg.head_dim // 2
  start = half if local else 0
  return tuple(jax.lax.slice_in_dim(a, start, start + half, axis=axis % a.ndim) for a in table)


def rope(x_BTNH: jax.Array, table: tuple[jax.Array, jax.Array], scale: float = 1.0) -> jax.Array:
  """Rotates pairs (i, i + head_dim / 2) by the table's angles; `scale` multiplies the result."""
  sin, cos = (a[:, :, None, :] * scale for a in table)
  x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BTNH.dtype)


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
  """Positions restarting at 0 where a packed row's segment id changes."""
  t = segment_ids_BT.shape[1]
  idx_BT = jnp.broadcast_to(jnp.arange(t), segment_ids_BT.shape)
  starts_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                               segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  return idx_BT - jax.lax.cummax(jnp.where(starts_BT, idx_BT, 0), axis=1)


def positions_from_valid(valid_BT: jax.Array) -> jax.Array:
  """RoPE positions counting only valid tokens, so left padding does not shift a row."""
  return jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)
