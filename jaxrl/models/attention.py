"""Attention's math on the fixed slot layout: masks, the KV-cache write, the explicit einsum
products (their scores soft-capped with `model.attention.softcap`), and which implementation
`model.attention.impl` picks for `jax.nn.dot_product_attention` (the rows layout takes that path
where no earlier cache slots exist: layouts.py).

A batch row occupies cache slots [0, S), with left padding marked invalid in `key_valid_BS`.
Training passes the whole sequence (S == T); the sampler passes a KV cache of S slots and the
slot index of the first new token. Keys are cached transposed, [B, K, H, S] (head_dim before
slots), values [B, K, S, H], so that both attention products are plain matrix products over a
contiguous cache (no per-step transpose of the keys).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxrl import platform
from jaxrl.models.splash import Segments, splash

if TYPE_CHECKING:
  from jaxrl.models.config import ModelConfig

# One (k_BKHS, v_BKSH) pair per layer: kv heads first; keys transposed (head_dim before slots).
# A scanned decoder's (`model.layers.scan`) is one pair, every layer's on axis 1: (k_BLKHS,
# v_BLKSH), rows still first.
KVCache = tuple


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k_BLKHS", "v_BLKSH", "layer"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StackedLayer:
  """Layer `layer` (an int, or traced inside a scan) of a stacked KV cache: `write_cache`
  writes its new keys and values at [:, layer] of the whole cache, in place."""
  k_BLKHS: jax.Array
  v_BLKSH: jax.Array
  layer: jax.Array | int


def attention_mask(key_valid_BS: jax.Array, t: int, cache_index,
                   segment_ids_BS: jax.Array | None = None) -> jax.Array:
  """Query i (slot cache_index + i) sees valid keys at slots <= its own (and, for packed rows,
  only keys of its own segment)."""
  s = key_valid_BS.shape[1]
  query_slot_T = cache_index + jnp.arange(t)
  causal_TS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
  mask_BTS = causal_TS[None] & key_valid_BS[:, None, :]
  if segment_ids_BS is not None:
    mask_BTS &= segment_ids_BS[:, -t:, None] == segment_ids_BS[:, None, :]
  return mask_BTS


@functools.partial(jax.tree_util.register_dataclass, data_fields=["parent_ids_BT", "copies_BT"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Tree:
  """Prefix trees in packed rows (with their segment ids: train/updates/packing.py): the segment
  each position's segment sees besides itself (its own, or the prefix a branch shares), and how
  many of the batch's rows each position stands for (a shared prefix's: its branches' rows; 0:
  padding), which weighs a mixture of experts' routing statistics as the unshared batch's."""
  parent_ids_BT: jax.Array
  copies_BT: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mask_BTS", "positions_BT"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TreeMask:
  """The mask of a cacheless pass over prefix trees (packed rows in which several branch
  segments follow the prefix segment they share: train/updates/packing.py): a token sees the
  earlier tokens of its own segment and of its segment's parent. A sliding window counts
  positions (`within`), not slots: a branch's slots follow its siblings'. Dense on every
  backend (no flash kernel here takes a parent)."""
  mask_BTS: jax.Array
  positions_BT: jax.Array

  @classmethod
  def of(cls, key_valid_BT, segment_ids_BT, tree: Tree, positions_BT) -> TreeMask:
    t = key_valid_BT.shape[1]
    seg_BT1, seg_B1T = segment_ids_BT[:, :, None], segment_ids_BT[:, None, :]
    related_BTT = (seg_B1T == seg_BT1) | (seg_B1T == tree.parent_ids_BT[:, :, None])
    causal_TT = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return cls(causal_TT[None] & key_valid_BT[:, None, :] & related_BTT, positions_BT)

  def within(self, window: int) -> jax.Array:
    """The dense mask narrowed to keys fewer than `window` positions before each query."""
    if not window:
      return self.mask_BTS
    pos_BT = self.positions_BT
    return self.mask_BTS & (pos_BT[:, :, None] - pos_BT[:, None, :] < window)


def windowed(mask, window: int, t: int, cache_index):
  """`mask` (a dense [B, T, S] mask, a `ValidPrefix` or splash's `Segments`) narrowed to keys
  fewer than `window` slots before each query (a sliding-window layer's; 0: no window). A
  row's valid tokens are contiguous slots, so slots apart are positions apart."""
  if not window:
    return mask
  if isinstance(mask, (ValidPrefix, Segments)):
    return dataclasses.replace(mask, window=window)
  query_slot_T = cache_index + jnp.arange(t)
  near_TS = query_slot_T[:, None] - jnp.arange(mask.shape[-1])[None, :] < window
  return mask & near_TS[None]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["lengths_B", "segment_ids_BT"],
                   meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class ValidPrefix:
  """The mask of a cacheless pass whose rows hold their valid tokens first (`valid_first`):
  causal attention over each row's first `lengths_B` tokens (within `window` of each query,
  if set; within equal `segment_ids_BT`, if set: packed rows). cuDNN takes it as its
  padding-causal mask type: whole tiles above the diagonal or past a row's length are skipped,
  and no [B, T, S] mask or bias exists but packed rows' segment mask."""
  lengths_B: jax.Array
  segment_ids_BT: jax.Array | None = None
  window: int = 0


def valid_first(key_valid_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The permutation of each row that moves its valid tokens to the front, in their order (a
  left-padded prompt and right-padded response become one valid prefix), and its inverse."""
  order_BT = jnp.argsort(~key_valid_BT, axis=1, stable=True)
  return order_BT, jnp.argsort(order_BT, axis=1)


FLASH = ("cudnn", "splash")  # the implementations that hold no [B, heads, T, S] scores


def attention_impl(cfg: ModelConfig, backend: str | None = None) -> str:
  """`cfg.attention.impl`, with "auto" resolved for `backend` (default: the platform the programs
  are built for, jaxrl/platform.py): cuDNN's fused flash attention on a GPU in bf16 (no
  [B, heads, T, S] scores in memory, forward or backward); elsewhere XLA's form of
  `jax.nn.dot_product_attention` (on the CPU its forward and backward took 9.2 ms against
  11.4 ms for the einsum form at 4 x 128 tokens, 9 heads: docs/models.md); on a TPU the splash
  kernel (jaxrl/models/splash.py); with soft-capped scores (`attention.softcap`) the einsum
  form, the one that caps them. The one place this is decided: the model runs it, the memory
  models (planner/, the dry run) count its scores by it (`flash`)."""
  if cfg.attention.impl != "auto":
    return cfg.attention.impl
  if cfg.attention.softcap:
    return "einsum"
  backend = backend or platform.backend()
  if backend == "tpu":
    return "splash"
  return "cudnn" if backend == "gpu" and cfg.dtype == "bfloat16" else "xla"


def flash(cfg: ModelConfig, backend: str | None = None) -> bool:
  """Whether training attention on `backend` holds no [T, T] scores (a flash kernel)."""
  return attention_impl(cfg, backend) in FLASH


def fused(q_BTNH, k_BTKH, v_BTKH, mask, impl: str) -> jax.Array:
  """Attention over a cacheless pass (queries scaled already), [B, T, N, H]: `Segments` by the
  splash kernel; else `jax.nn.dot_product_attention`, a `ValidPrefix` as causality plus
  sequence lengths, or the dense mask."""
  dt = q_BTNH.dtype
  k_BTKH, v_BTKH = k_BTKH.astype(dt), v_BTKH.astype(dt)
  if isinstance(mask, Segments):
    return splash(q_BTNH, k_BTKH, v_BTKH, mask)
  if isinstance(mask, ValidPrefix):
    extra = {"local_window_size": (mask.window - 1, 0)} if mask.window else {}
    if mask.segment_ids_BT is not None:  # packed rows: the segments ride along as a mask
      ids_BT = mask.segment_ids_BT
      extra["mask"] = ids_BT[:, None, :, None] == ids_BT[:, None, None, :]
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, scale=1.0, is_causal=True, query_seq_lengths=mask.lengths_B,
        key_value_seq_lengths=mask.lengths_B, implementation=impl, **extra)
  # A dense mask over as many keys as queries (a cacheless pass, a prefill) lies within the
  # causal one: cuDNN is told so (its causal mask type skips the tiles above the diagonal)
  causal = {"is_causal": True} if impl == "cudnn" and q_BTNH.shape[1] == k_BTKH.shape[1] else {}
  return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, mask=mask[:, None], scale=1.0,
                                      implementation="xla" if impl == "splash" else impl,
                                      **causal)


def write_cache(layer_cache, k_BKHT, v_BKTH, cache_index, slots: int | None = None):
  """T new keys and values written from slot `cache_index`: (the layer's keys and values to
  attend over, its first `slots` slots (all: None); its updated cache). No cache: the new ones
  are all there is; a `StackedLayer`: written into the whole stacked cache, the layer's slots
  read back (a stacked cache is grown once to its final size: sampler/engine.py)."""
  if layer_cache is None:
    return k_BKHT, v_BKTH, None
  if isinstance(layer_cache, StackedLayer):
    i, s = jnp.asarray(layer_cache.layer, jnp.int32), jnp.asarray(cache_index, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    k_all = jax.lax.dynamic_update_slice(
        layer_cache.k_BLKHS, k_BKHT[:, None].astype(layer_cache.k_BLKHS.dtype),
        (zero, i, zero, zero, s))
    v_all = jax.lax.dynamic_update_slice(
        layer_cache.v_BLKSH, v_BKTH[:, None].astype(layer_cache.v_BLKSH.dtype),
        (zero, i, zero, s, zero))
    b, _, k, h, n = k_all.shape
    n = n if slots is None else slots
    k_BKHS = jax.lax.dynamic_slice(k_all, (zero, i, zero, zero, zero), (b, 1, k, h, n))[:, 0]
    v_BKSH = jax.lax.dynamic_slice(v_all, (zero, i, zero, zero, zero), (b, 1, k, n, h))[:, 0]
    return k_BKHS, v_BKSH, StackedLayer(k_all, v_all, layer_cache.layer)
  k_BKHS = jax.lax.dynamic_update_slice_in_dim(layer_cache[0], k_BKHT.astype(layer_cache[0].dtype),
                                               cache_index, axis=3)
  v_BKSH = jax.lax.dynamic_update_slice_in_dim(layer_cache[1], v_BKTH.astype(layer_cache[1].dtype),
                                               cache_index, axis=2)
  return k_BKHS[..., :slots], v_BKSH[:, :, :slots], (k_BKHS, v_BKSH)


def capped(scores, softcap: float):
  """`softcap * tanh(scores / softcap)` (`model.attention.softcap`; 0: the scores as they are)."""
  return softcap * jnp.tanh(scores / softcap) if softcap else scores


def attend(q_BTKGH, k_BKHS, v_BKSH, mask_BTS, softcap: float = 0.0):
  logits_BKGTS = jnp.einsum("btkgh,bkhs->bkgts", q_BTKGH, k_BKHS).astype(jnp.float32)
  logits_BKGTS = jnp.where(mask_BTS[:, None, None], capped(logits_BKGTS, softcap),
                           jnp.finfo(jnp.float32).min)
  probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(q_BTKGH.dtype)
  return jnp.einsum("bkgts,bksh->btkgh", probs_BKGTS, v_BKSH)


def attend_one(q_BKGH, k_BKHS, v_BKSH, mask_BS, softcap: float = 0.0):
  """Decode (one query per row): a small matrix product per kv head over its cache slots."""
  logits_BKGS = jnp.einsum("bkgh,bkhs->bkgs", q_BKGH, k_BKHS).astype(jnp.float32)
  logits_BKGS = jnp.where(mask_BS[:, None, None, :], capped(logits_BKGS, softcap),
                          jnp.finfo(jnp.float32).min)
  probs_BKGS = jax.nn.softmax(logits_BKGS, axis=-1).astype(q_BKGH.dtype)
  return jnp.einsum("bkgs,bksh->bkgh", probs_BKGS, v_BKSH)


def init_kv_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
  """Zeros: per layer keys [B, K, H, S] and values [B, K, S, H]; a scanned decoder's stacked,
  [B, L, K, H, S] and [B, L, K, S, H] (attention.KVCache)."""
  k_shape = (batch, cfg.n_kv_heads, cfg.head_dim, slots)
  v_shape = (batch, cfg.n_kv_heads, slots, cfg.head_dim)
  if cfg.scanned:
    k_shape, v_shape = ((batch, cfg.n_layers) + s[1:] for s in (k_shape, v_shape))
    return jnp.zeros(k_shape, cfg.compute_dtype), jnp.zeros(v_shape, cfg.compute_dtype)
  return tuple((jnp.zeros(k_shape, cfg.compute_dtype), jnp.zeros(v_shape, cfg.compute_dtype))
               for _ in range(cfg.n_layers))


def grow_kv_cache(cfg: ModelConfig, kv_cache: KVCache, slots: int) -> KVCache:
  """The cache with its slot axis (keys' last, values' second last) zero-padded to `slots`."""
  def grow(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, slots - x.shape[axis])
    return jnp.pad(x, pad)
  pairs = (kv_cache,) if cfg.scanned else kv_cache
  grown = tuple((grow(k, k.ndim - 1), grow(v, v.ndim - 2)) for k, v in pairs)
  return grown[0] if cfg.scanned else grown
