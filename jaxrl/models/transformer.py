"""The decoder in Flax NNX, written once: RMSNorm, RoPE, grouped-query attention, a gated MLP,
with the block options of the model's family (jaxrl/models/families.py: Qwen2's q/k/v biases,
Qwen3's q/k norms; Gemma's offset norms, sandwich norms, GeGLU and scaled embedding, each an
option of its own) and, where the config has one, sliding-window attention in its local layers
(each with its own RoPE base). The LM head is jaxrl/models/lm_head.py's.

One forward pass serves training, scoring, prefill and the sampler's cached decode step; the
activation layout it runs in (jaxrl/models/layouts.py: rows everywhere, feature-major for decode
steps on a CPU) is an argument, not a second copy of the model. Every parameter carries
`logical_axes` metadata and every large activation is constrained with logical names (see
sharding/rules.py); no mesh axis is named here. Projection weights are stored [out, in]
(PyTorch's order).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention import (KVCache, StackedLayer, Tree, TreeMask, ValidPrefix,
                                    attention_impl, attention_mask, valid_first, windowed)
from jaxrl.models.config import ModelConfig
from jaxrl.models.families import ACTIVATIONS
from jaxrl.models.layouts import ROWS
from jaxrl.models.lora import LoRA, LoRAConfig
from jaxrl.models.scan import layer_view, period, scan_periods, stack_blocks
from jaxrl.models.moe import MoE, stack_stats
from jaxrl.models.norm import RMSNorm
from jaxrl.models.remat import remat_block, remat_cached
from jaxrl.models.splash import Segments


def _param(rngs: nnx.Rngs, shape, axes, scale: float) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32) * scale, logical_axes=axes)


def _adapters(module: nnx.Module, lora: LoRAConfig | None, rngs: nnx.Rngs, **weights) -> None:
  """A LoRA adapter `NAME_lora` beside each weight NAME=(out dims, in dims) that `lora`
  targets (jaxrl/models/lora.py), shaped and sharded like the weight it adapts."""
  for name, out_dims in weights.items():
    if lora is None or not lora.on(name):
      continue
    w = getattr(module, name)
    axes = w.get_metadata()["logical_axes"]
    setattr(module, name + "_lora", LoRA(w.shape[:out_dims], axes[:out_dims], w.shape[out_dims:],
                                         axes[out_dims:], lora, rngs))


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.wq = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), d**-0.5)
    self.wk = _param(rngs, (k, h, d), ("kv_heads", "head_dim", "embed"), d**-0.5)
    self.wv = _param(rngs, (k, h, d), ("kv_heads", "head_dim", "embed"), d**-0.5)
    self.wo = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), (n * h)**-0.5 / cfg.n_layers)
    _adapters(self, lora, lora_rngs, wq=2, wk=2, wv=2, wo=1)
    if cfg.block.qkv_bias:
      zeros = lambda heads, axis: nnx.Param(jnp.zeros((heads, h), jnp.float32),
                                            logical_axes=(axis, "head_dim"))
      self.bq, self.bk, self.bv = zeros(n, "heads"), zeros(k, "kv_heads"), zeros(k, "kv_heads")
    if cfg.block.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, "head_dim", cfg.block.norm_offset, cfg.scanned)
      self.k_norm = RMSNorm(h, cfg.norm_eps, "head_dim", cfg.block.norm_offset, cfg.scanned)

  def project(self, x, name: str, bias_name: str, norm_name: str, layout):
    """Queries, keys or values split into heads: the projection `name` (with its adapter), its
    bias (Qwen2) and its per-head RMSNorm (Qwen3 queries and keys), before RoPE."""
    w_NHD = getattr(self, name)
    n, h, d = w_NHD.shape
    out = layout.adapt(self, name, x, layout.dense(x, w_NHD[...].reshape(n * h, d)))
    out = layout.heads(out, n, h)
    if self.cfg.block.qkv_bias:
      out = out + layout.head_bias(getattr(self, bias_name)[...]).astype(x.dtype)
    if self.cfg.block.qk_norm and norm_name:
      out = getattr(self, norm_name)(out, layout.head_axis)
    return out

  def __call__(self, x, rope, mask, layer_cache, cache_index, last_only=False, layout=ROWS):
    """`last_only` (rows): queries (and so the output) for the last position only; keys and
    values for every position still go to the cache."""
    cfg = self.cfg
    x_q, rope_q, mask_q = x, rope, mask
    if last_only:
      x_q, mask_q, rope_q = x[:, -1:], mask[:, -1:], tuple(a[:, -1:] for a in rope)
    # Queries carry the logits' scale (1/sqrt(head_dim), or Gemma's own) from here on.
    q = layout.rope(self.project(x_q, "wq", "bq", "q_norm", layout), rope_q,
                    cfg.query_scale_factor)
    k = layout.rope(self.project(x, "wk", "bk", "k_norm", layout), rope)
    v = self.project(x, "wv", "bv", "", layout)
    out, layer_cache = layout.attention(q, k, v, layer_cache, cache_index, mask_q, cfg)
    # One (n * h) contraction on flat views: XLA:CPU would otherwise transpose wo every call.
    wo = self.wo[...].reshape(cfg.d_model, -1)
    return layout.adapt(self, "wo", out, layout.dense(out, wo)), layer_cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    d, f = cfg.d_model, cfg.d_ff
    self.w_gate = _param(rngs, (f, d), ("mlp", "embed"), d**-0.5)
    self.w_up = _param(rngs, (f, d), ("mlp", "embed"), d**-0.5)
    self.w_down = _param(rngs, (d, f), ("embed", "mlp"), f**-0.5 / cfg.n_layers)
    _adapters(self, lora, lora_rngs, w_gate=1, w_up=1, w_down=1)
    self.frozen = lora is not None and lora.enabled  # LoRA: no gradient reaches the base
    self.activation = cfg.block.mlp_activation  # SwiGLU (silu), GeGLU (gelu_tanh)
    self.recompute = cfg.scanned

  def __call__(self, x, layout=ROWS):
    def linear(name, x):
      w = getattr(self, name)[...]
      return layout.adapt(self, name, x, layout.dense(x, w, trained=not self.frozen))
    gated = _recomputed_gated if self.recompute else _gated
    hidden = gated(linear("w_gate", x), linear("w_up", x), self.activation)
    return linear("w_down", layout.hidden(hidden))


def _gated(gate, up, activation: str):
  return ACTIVATIONS[activation].fn(gate) * up


# In a scanned decoder, recomputed by the backward from gate and up (as norm.RMSNorm's)
_recomputed_gated = jax.checkpoint(_gated, static_argnums=(2,))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None,
               lora_rngs: nnx.Rngs | None = None):
    offset, scan = cfg.block.norm_offset, cfg.scanned
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset, recompute=scan)
    self.attn = Attention(cfg, rngs, lora, lora_rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset, recompute=scan)
    self.moe = bool(cfg.moe.experts)
    if self.moe:
      self.mlp = MoE(cfg, rngs, ACTIVATIONS[cfg.block.mlp_activation].fn)
    else:
      self.mlp = MLP(cfg, rngs, lora, lora_rngs)
    self.sandwich = cfg.block.sandwich_norms
    if self.sandwich:  # the sublayers' outputs normed before the residual adds
      self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset, recompute=scan)
      self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset, recompute=scan)

  def __call__(self, x, rope, mask, layer_cache, cache_index, last_only=False, layout=ROWS,
               valid_BT=None, routes_BTK=None):
    """(output, the layer's updated cache, its `MoEStats` or None for a dense MLP).
    `valid_BT`: which tokens count in the routing statistics; `routes_BTK`: the experts the
    sampler used (routing replay, jaxrl/models/moe.py)."""
    axis = layout.feature_axis
    post = lambda name, y: getattr(self, name)(y, axis) if self.sandwich else y
    attn, layer_cache = self.attn(self.attn_norm(x, axis), rope, mask, layer_cache,
                                  cache_index, last_only, layout)
    if last_only:
      x = x[:, -1:]
      valid_BT = None if valid_BT is None else valid_BT[:, -1:]
      routes_BTK = None if routes_BTK is None else routes_BTK[:, -1:]
    x = x + post("post_attn_norm", attn)
    h, stats = self.mlp_norm(x, axis), None
    if self.moe:
      y_BTD, stats = self.mlp(layout.as_rows(h), valid_BT, routes_BTK)
      h = layout.from_rows(y_BTD)
    else:
      h = self.mlp(h, layout)
    x = x + post("post_mlp_norm", h)
    return layout.residual(x), layer_cache, stats


@dataclasses.dataclass(frozen=True)
class _Pass:
  """What every layer of one pass shares: `kind(j)` (layer j's rope table and mask), where the
  new tokens' keys go, whether the last layer runs for the last position alone, the layout,
  which tokens count in routing statistics, tokens per row."""
  kind: Callable
  cache_index: Any
  last_only: bool
  layout: Any
  valid_BT: Any
  length: int
  remat: bool = False  # a differentiated cached pass: its blocks under `model.layers.remat`


class Decoder(nnx.Module):
  """Embedding + blocks + final norm; returns hidden states (heads are separate modules)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    self.cfg = cfg
    # An untied or scaled head reads N(0, 1) embeddings; a head that IS the embedding (HF style)
    # needs them at 1 / sqrt(d_model) for unit-scale initial logits.
    hf_tied = cfg.tie_embeddings and not cfg.scale_tied_head
    self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                        cfg.d_model**-0.5 if hf_tied else 1.0)
    # The adapters draw from a stream of their own: the base weights are the same with or without.
    lora_rngs = None if lora is None else nnx.Rngs(jax.random.fold_in(rngs.default.key[...],
                                                                       0x10A))
    blocks = [Block(cfg, rngs, lora, lora_rngs) for _ in range(cfg.n_layers)]
    self.blocks = stack_blocks(blocks) if cfg.scanned else nnx.List(blocks)
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.block.norm_offset)

  def __call__(self, tokens, positions, key_valid_BS, kv_cache: KVCache | None = None,
               cache_index=0, segment_ids_BT=None, last_only=False, layout=ROWS):
    """Hidden states in `layout` ([B, T, D] for rows), and the updated cache (`forward`
    without the routing)."""
    return self.forward(tokens, positions, key_valid_BS, kv_cache, cache_index, segment_ids_BT,
                        last_only, layout)[:2]

  def forward(self, tokens, positions, key_valid_BS, kv_cache: KVCache | None = None,
              cache_index=0, segment_ids_BT=None, last_only=False, layout=ROWS,
              routes_BTLK=None, tree: Tree | None = None, weights_BT=None, shared=False):
    """(hidden states, the updated cache, the MoE layers' stacked `MoEStats` or None).
    `positions`: RoPE positions, or their (sin, cos) table computed ahead (a decode loop does).
    `segment_ids_BT` (training): packed rows, attention stays inside a segment. `last_only` (a
    prefill that samples from the last position): the final block's queries, attention and MLP
    run for the last position alone, and the states come back as [B, 1, D]. `routes_BTLK`:
    each token's experts per MoE layer when it was sampled (replayed or compared: moe.py).
    `tree` (with `segment_ids_BT`): prefix trees, each segment also seeing its parent segment
    (`TreeMask`; `positions` the tokens' own, a branch's continuing from its prefix).
    `weights_BT`: the tokens' weights in a mixture of experts' routing statistics (default:
    the tokens' validity, where the key mask is over the tokens). `shared`: a shared prefix's
    cached pass (train/updates/prefix.py), differentiated: its blocks under `model.layers.remat`,
    and where attention is the splash kernel's, the kernel over the cache."""
    if tree is not None:
      mask = TreeMask.of(key_valid_BS, segment_ids_BT, tree, positions)
      return self.blocks_over(tokens, positions, mask, None, 0, False, ROWS, tree.copies_BT,
                              routes_BTLK)
    impl = attention_impl(self.cfg)
    cacheless = kv_cache is None and not last_only and layout is ROWS
    if cacheless and impl == "cudnn":
      return self.over_valid_prefix(tokens, positions, key_valid_BS, routes_BTLK, segment_ids_BT)
    if (cacheless or shared) and impl == "splash":  # left padding is segment 0; packed rows
      mask = Segments(key_valid_BS if segment_ids_BT is None else segment_ids_BT)  # keep theirs
    else:
      mask = attention_mask(key_valid_BS, layout.length(tokens), cache_index, segment_ids_BT)
    # The tokens' own validity (the routing statistics count only valid tokens): a decode
    # step's key mask is over the cache's slots instead.
    valid_BT = key_valid_BS if key_valid_BS.shape[-1] == layout.length(tokens) else None
    valid_BT = valid_BT if weights_BT is None else weights_BT
    return self.blocks_over(tokens, positions, mask, kv_cache, cache_index, last_only, layout,
                            valid_BT, routes_BTLK, shared)

  def over_valid_prefix(self, tokens_BT, positions_BT, key_valid_BT, routes_BTLK=None,
                        segment_ids_BT=None):
    """A cacheless pass with each row's valid tokens moved to its front (`valid_first`), so
    attention is causal over a prefix of known length (cuDNN's padding-causal flash kernel, no
    mask array but packed rows' segments); the hidden states (and expert choices) go back to
    the rows' own order. Per position the blocks compute the same thing: RoPE reads the
    positions moved along with the tokens."""
    order_BT, inverse_BT = valid_first(key_valid_BT)
    take = lambda a_BT, order: jnp.take_along_axis(
        a_BT, order.reshape(order.shape + (1,) * (a_BT.ndim - 2)), axis=1)
    # A row with no valid token (batch padding) attends to its first: finite, and unused.
    lengths_B = jnp.maximum(key_valid_BT.sum(axis=1, dtype=jnp.int32), 1)
    routes = None if routes_BTLK is None else take(routes_BTLK, order_BT)
    segments = None if segment_ids_BT is None else take(segment_ids_BT, order_BT)
    h_BTD, _, routing = self.blocks_over(
        take(tokens_BT, order_BT), take(positions_BT, order_BT), ValidPrefix(lengths_B, segments),
        None, 0, False, ROWS, take(key_valid_BT, order_BT), routes)
    if routing is not None:
      routing = dataclasses.replace(routing, ids=take(routing.ids, inverse_BT))
    return take(h_BTD, inverse_BT), None, routing

  def blocks_over(self, tokens, positions, mask, kv_cache, cache_index, last_only, layout,
                  valid_BT=None, routes_BTLK=None, remat=False):
    """Embedding, the blocks under `mask`, the final norm: (hidden states, updated cache,
    stacked `MoEStats` or None)."""
    cfg = self.cfg
    x = layout.embed(self.embed[...], tokens, cfg.compute_dtype)
    if cfg.block.scale_embedding:  # (in the compute dtype, as Gemma rounds it)
      x = x * jnp.asarray(cfg.d_model**0.5, cfg.compute_dtype)
    rope = layout.rope_table(positions, cfg)
    if isinstance(mask, TreeMask):  # its window counts positions
      local, mask = mask.within(cfg.attention.sliding_window), mask.mask_BTS
    else:
      local = windowed(mask, cfg.attention.sliding_window, layout.length(tokens), cache_index)
    kind = lambda i: (layout.rope_part(rope, cfg, cfg.is_local(i)),
                      local if cfg.is_local(i) else mask)
    run = _Pass(kind, cache_index, last_only, layout, valid_BT, layout.length(tokens),
                remat and cfg.layers.remat != "none")
    if self.stacked:
      x, kv_cache, stats = self.scanned(run, x, kv_cache, routes_BTLK)
    else:
      stats = []
      for i in range(cfg.n_layers):
        routes = None if routes_BTLK is None else routes_BTLK[:, :, i]
        x, kv_cache, st = self.layer_step(run, self.blocks[i], i, i, x, kv_cache, routes)
        stats.append(st)
      stats = stack_stats(stats)
    return self.final_norm(x, layout.feature_axis), kv_cache, stats

  def layer_step(self, run: _Pass, block: Block, j: int, i, x, kv_cache, routes_BTK):
    """Layer `i` (an int, or traced in a scan; its kind of attention that of layer `j`) of a
    pass: (output, the whole updated cache or None, its `MoEStats` or None). A cacheless pass
    runs under `model.layers.remat`; a cached one writes the layer's keys and values into the
    cache (a stacked one in place: attention.StackedLayer), under remat where `run.remat`."""
    if kv_cache is None:
      x, st = self.cacheless(block, x, *run.kind(j), run.valid_BT, routes_BTK)
      return x, None, st
    if run.remat:
      return remat_cached(self.cfg, self.stacked, run, block, j, i, x, kv_cache, routes_BTK)
    last = run.last_only and isinstance(i, int) and i == self.cfg.n_layers - 1
    layer_cache = StackedLayer(*kv_cache, i) if self.stacked else kv_cache[i]
    x, layer_cache, st = block(x, *run.kind(j), layer_cache, run.cache_index, last, run.layout,
                               run.valid_BT, routes_BTK)
    if last and st is not None:  # the last block routed the last position alone: the
      ids = jnp.pad(st.ids, ((0, 0), (run.length - 1, 0), (0, 0)), constant_values=-1)
      st = dataclasses.replace(st, ids=ids)  # others' experts are not recorded (-1)
    if self.stacked:
      return x, (layer_cache.k_BLKHS, layer_cache.v_BLKSH), st
    return x, kv_cache[:i] + (layer_cache,) + kv_cache[i + 1:], st

  @property
  def stacked(self) -> bool:
    """Whether the blocks are one stacked block (`model.layers.scan`)."""
    return not isinstance(self.blocks, nnx.List)

  def layer(self, i: int) -> Block:
    """Decoder layer `i` (of a scanned decoder: its slice of the stacked block)."""
    return layer_view(self.blocks, i) if self.stacked else self.blocks[i]

  def cacheless(self, block: Block, x_BTD, rope_BTH, mask_BTS, valid_BT, routes_BTK):
    """`block` on a pass without a cache, under `model.layers.remat`: (output, its `MoEStats`)."""
    if self.cfg.layers.remat != "none":
      x_BTD, _, stats = remat_block(self.cfg, block, x_BTD, rope_BTH, mask_BTS, None, 0,
                                    valid_BT, routes_BTK)
    else:
      x_BTD, _, stats = block(x_BTD, rope_BTH, mask_BTS, None, 0, False, ROWS, valid_BT,
                              routes_BTK)
    return x_BTD, stats

  def scanned(self, run: _Pass, x, kv_cache, routes_BTLK):
    """The blocks of a pass as a scan over whole periods of the layer pattern, the layers after
    the last whole period (and, for `last_only`, the last layer) unrolled (jaxrl/models/scan.py):
    (output, the updated stacked cache or None, the MoE layers' stacked `MoEStats` or None)."""
    cfg, size = self.cfg, period(self.cfg)
    whole = (cfg.n_layers - run.last_only) // size
    routes_LBTK = None if routes_BTLK is None else jnp.moveaxis(routes_BTLK, 2, 0)

    def step(j, i, block, carry, routes):
      x, cache, st = self.layer_step(run, block, j, i, *carry, routes)
      return (x, cache), st
    (x, kv_cache), stats = scan_periods(self.blocks, whole, size, (x, kv_cache), step,
                                        routes_LBTK, indexed=kv_cache is not None)
    parts = [stats]
    for i in range(whole * size, cfg.n_layers):
      routes = None if routes_LBTK is None else routes_LBTK[i]
      x, kv_cache, st = self.layer_step(run, self.layer(i), i % size, i, x, kv_cache, routes)
      parts.append(None if st is None else jax.tree.map(lambda a: a[None], st))
    found = [p for p in parts if p is not None]
    if not found:  # (a dense model)
      return x, kv_cache, None
    stats = jax.tree.map(lambda *a: jnp.concatenate(a), *found)
    return x, kv_cache, dataclasses.replace(stats, ids=jnp.moveaxis(stats.ids, 0, 2))


class LanguageModel(nnx.Module):
  """Decoder with an LM head (tied to the embedding unless `tie_embeddings=False`); with `lora`
  (rank > 0), LoRA adapters on its targets (jaxrl/models/lora.py)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoRAConfig | None = None):
    self.cfg = cfg
    self.decoder = Decoder(cfg, rngs, lora)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                            cfg.d_model**-0.5)

  def __call__(self, tokens_BT, positions_BT, key_valid_BS, kv_cache=None, cache_index=0,
               segment_ids_BT=None):
    """float32 logits [B, T, V] and the updated cache (see `Decoder.__call__`)."""
    h_BTD, kv_cache = self.decoder(tokens_BT, positions_BT, key_valid_BS, kv_cache, cache_index,
                                   segment_ids_BT)
    return self.logits(h_BTD), kv_cache

  def logits(self, h_BTD, head_VD: jax.Array | None = None):
    """The LM head over decoder states (float32 logits, soft-capped by `logit_softcap`:
    jaxrl/models/lm_head.py); `head_VD`: `self.head_VD()` computed ahead (a decode loop does, once
    per call)."""
    head_VD = self.head_VD() if head_VD is None else head_VD
    return ROWS.logits(h_BTD, head_VD, self.cfg.logit_softcap)

  def head_VD(self) -> jax.Array:
    """The LM head's weight, [vocab, d_model]."""
    if not self.cfg.tie_embeddings:
      return self.lm_head[...]
    if self.cfg.scale_tied_head:
      return self.decoder.embed[...] * self.cfg.d_model**-0.5
    return self.decoder.embed[...]
