"""The model's forward pass for one new token per row, feature-major: activations [features, B].

A decode step's matrix products have as many rows as the batch shard (tens). On XLA:CPU such a
product runs ~14% faster as weight [out, in] @ activations [in, B] than as activations [B, in] @
weight [in, out] (docs/benchmarks.md), so on a CPU the sampler's loop keeps its activations
transposed (elsewhere it runs the model's own layout); the weights are stored [out, in] already
(llama.py), so nothing is copied per call.
The math is `LanguageModel.__call__` with one query per row and a KV cache (tests compare them);
the cache layout is the model's (keys [B, K, H, S], values [B, K, S, H]).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.lora import adapter
from jaxrl.models.llama import (KVCache, LanguageModel, ModelConfig, attention_mask,
                                init_kv_cache, positions_from_valid)
from jaxrl.models.rope import rope_table
from jaxrl.partitioning import constrain


def decode_weights(model: LanguageModel, head_VD: jax.Array | None = None) -> dict:
  """Every weight as a matrix [out, in] (norm scales as [D, 1] columns); `head_VD`: the LM head
  computed ahead (`model.head_VD()` by default). The parameters are stored [out, in], so these are
  views, not copies; they keep the parameters' dtype (the engine casts once per call)."""
  cfg = model.cfg
  column = lambda norm: norm.scale[...][:, None]
  matrix = lambda w, out: w[...].reshape(out, -1)
  nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layers = []
  for b in model.decoder.blocks:
    w = dict(attn_norm=column(b.attn_norm), wq=matrix(b.attn.wq, nh), wk=matrix(b.attn.wk, kh),
             wv=matrix(b.attn.wv, kh), wo=matrix(b.attn.wo, cfg.d_model),
             mlp_norm=column(b.mlp_norm), w_gate=matrix(b.mlp.w_gate, cfg.d_ff),
             w_up=matrix(b.mlp.w_up, cfg.d_ff), w_down=matrix(b.mlp.w_down, cfg.d_model))
    for owner, names in ((b.attn, ("wq", "wk", "wv", "wo")),
                         (b.mlp, ("w_gate", "w_up", "w_down"))):
      for name in names:  # LoRA: A [r, in] and scale * B [out, r]
        ad = adapter(owner, name)
        if ad is not None:
          r = ad.a.shape[0]
          w[name + "_a"] = ad.a[...].reshape(r, -1)
          w[name + "_b"] = ad.b[...].reshape(-1, r) * jnp.asarray(ad.scale, ad.b.dtype)
    if cfg.qkv_bias:  # [N * H, 1] columns
      w.update(bq=matrix(b.attn.bq, nh), bk=matrix(b.attn.bk, kh), bv=matrix(b.attn.bv, kh))
    if cfg.qk_norm:  # [H, 1] columns: per head, over head_dim (axis 1 of [N, H, B])
      w.update(q_norm=column(b.attn.q_norm), k_norm=column(b.attn.k_norm))
    layers.append(w)
  return dict(embed_VD=model.decoder.embed[...], layers=layers,
              final_norm=column(model.decoder.final_norm),
              head_VD=model.head_VD() if head_VD is None else head_VD)


def _rms_norm(x_DB, scale_D1, eps: float):
  x32 = x_DB.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
  return (x32 * scale_D1).astype(x_DB.dtype)


def _rope(x_NHB, sin_HB, cos_HB):
  """`rope.rope` on feature-major heads (pairs (i, i + head_dim / 2) of axis 1)."""
  x1, x2 = jnp.split(x_NHB.astype(jnp.float32), 2, axis=1)
  return jnp.concatenate([x1 * cos_HB - x2 * sin_HB, x2 * cos_HB + x1 * sin_HB],
                         axis=1).astype(x_NHB.dtype)


def _mm(w: dict, name: str, x_IB):
  """Weight `name` [out, in] @ x [in, B], plus its LoRA adapter's B (A x) where it has one."""
  out_OB = w[name] @ x_IB
  if name + "_a" in w:
    out_OB = out_OB + w[name + "_b"].astype(x_IB.dtype) @ (w[name + "_a"].astype(x_IB.dtype) @ x_IB)
  return out_OB


def _project(w: dict, name: str, x_DB, heads: int, cfg: ModelConfig):
  """Queries, keys or values [heads, H, B]: the projection, its bias and its per-head norm."""
  out_FB = _mm(w, "w" + name, x_DB)
  if cfg.qkv_bias:
    out_FB = out_FB + w["b" + name].astype(out_FB.dtype)
  out_NHB = out_FB.reshape(heads, cfg.head_dim, -1)
  if cfg.qk_norm and name != "v":
    x32 = out_NHB.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=1, keepdims=True) + cfg.norm_eps)
    out_NHB = (x32 * w[name + "_norm"]).astype(out_NHB.dtype)
  return out_NHB


def decode_step(weights: dict, cfg: ModelConfig, tokens_B, rope_HB: tuple[jax.Array, jax.Array],
                key_valid_BS, kv_cache: KVCache, slot) -> tuple[jax.Array, KVCache]:
  """Logits [B, V] (float32) for `tokens_B` at cache slot `slot`, and the updated cache.
  `rope_HB`: the (sin, cos) of `rope.rope_table` for the rows' positions, as [head_dim / 2, B]."""
  dt, b = cfg.compute_dtype, tokens_B.shape[0]
  k, g, h = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  sin_HB, cos_HB = rope_HB
  q_sin, q_cos = sin_HB * h**-0.5, cos_HB * h**-0.5  # queries carry 1/sqrt(head_dim)
  mask_BKGS = attention_mask(key_valid_BS, 1, slot)[:, None, None, 0, :]
  x_DB = constrain(jnp.take(weights["embed_VD"], tokens_B, axis=0).T.astype(dt), (None, "batch"))
  new_cache = []
  for w, (k_BKHS, v_BKSH) in zip(weights["layers"], kv_cache):
    a_DB = _rms_norm(x_DB, w["attn_norm"], cfg.norm_eps)
    q_KGHB = _rope(_project(w, "q", a_DB, k * g, cfg), q_sin, q_cos).reshape(k, g, h, b)
    q_BKGH = constrain(q_KGHB.transpose(3, 0, 1, 2), ("batch", "act_kv_heads", None, None))
    k_KHB = _rope(_project(w, "k", a_DB, k, cfg), sin_HB, cos_HB)
    v_KHB = _project(w, "v", a_DB, k, cfg)
    k_BKHS = jax.lax.dynamic_update_slice_in_dim(
        k_BKHS, k_KHB.transpose(2, 0, 1)[..., None].astype(k_BKHS.dtype), slot, axis=3)
    v_BKSH = jax.lax.dynamic_update_slice_in_dim(
        v_BKSH, v_KHB.transpose(2, 0, 1)[:, :, None].astype(v_BKSH.dtype), slot, axis=2)
    new_cache.append((k_BKHS, v_BKSH))
    # Attention itself is per row (a small product per kv head over its cache), as in the model.
    logits_BKGS = jnp.einsum("bkgh,bkhs->bkgs", q_BKGH, k_BKHS.astype(dt)).astype(jnp.float32)
    logits_BKGS = jnp.where(mask_BKGS, logits_BKGS, jnp.finfo(jnp.float32).min)
    probs_BKGS = jax.nn.softmax(logits_BKGS, axis=-1).astype(dt)
    out_BKGH = jnp.einsum("bkgs,bksh->bkgh", probs_BKGS, v_BKSH.astype(dt))
    out_FB = out_BKGH.reshape(b, k * g * h).T
    x_DB = x_DB + _mm(w, "wo", out_FB)
    m_DB = _rms_norm(x_DB, w["mlp_norm"], cfg.norm_eps)
    hidden_FB = jax.nn.silu(_mm(w, "w_gate", m_DB)) * _mm(w, "w_up", m_DB)
    x_DB = constrain(x_DB + _mm(w, "w_down", constrain(hidden_FB, ("act_mlp", "batch"))),
                     (None, "batch"))
  h_DB = _rms_norm(x_DB, weights["final_norm"], cfg.norm_eps)
  logits_VB = constrain((weights["head_VD"] @ h_DB).astype(jnp.float32), ("act_vocab", "batch"))
  # The barrier keeps XLA from folding the transpose into the product, which turns it into one
  # XLA:CPU runs several times slower (activations as the left operand, contracted on rows).
  return jax.lax.optimization_barrier(logits_VB).T, tuple(new_cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LMDecoding:
  """A `LanguageModel` as the sampler decodes it (the `DecodeModel` protocol of
  sampler/engine.py): weights in the compute dtype and the LM head, computed once per call."""
  model: LanguageModel
  head_VD: jax.Array

  @classmethod
  def of(cls, model: LanguageModel) -> LMDecoding:
    dt = model.cfg.compute_dtype
    # The head from the float32 embedding, as the trainer's forward computes it; then every
    # matrix in the compute dtype (norm scales stay float32, as the model uses them).
    head_VD = model.head_VD().astype(dt)
    graphdef, params = nnx.split(model)
    cast = jax.tree.map(lambda x: x.astype(dt) if x.ndim > 1 else x, params)
    return cls(nnx.merge(graphdef, cast), head_VD)

  def init_cache(self, batch: int, slots: int) -> KVCache:
    return init_kv_cache(self.model.cfg, batch, slots)

  def grow_cache(self, kv_cache: KVCache, slots: int) -> KVCache:
    """The cache with its slot axis zero-padded to `slots` (keys [B,K,H,S], values [B,K,S,H])."""
    def grow(x, axis):
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, slots - x.shape[axis])
      return jnp.pad(x, pad)
    return tuple((grow(k, 3), grow(v, 2)) for k, v in kv_cache)

  def rope(self, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [B, T, head_dim / 2] for any positions (a decode loop computes them ahead)."""
    return rope_table(positions_BT, self.model.cfg)

  def prefill(self, tokens_BP, valid_BP) -> tuple[jax.Array, KVCache]:
    """Next-token logits [B, V] and the prompt's KV cache (exactly its P slots). Only the last
    position is sampled from, so the final block's queries, attention and MLP (and the LM
    head) run for it alone."""
    b, p = tokens_BP.shape
    h_B1D, kv_cache = self.model.decoder(tokens_BP, positions_from_valid(valid_BP), valid_BP,
                                         self.init_cache(b, p), last_only=True)
    return self.model.logits(h_B1D, self.head_VD)[:, 0], kv_cache

  def decode_fn(self, layout: str):
    """`step(tok_B, (sin_BH, cos_BH), key_valid_BS, kv_cache, slot) -> (logits_BV, kv_cache)`:
    one new token per row, in `layout` ("rows": the model's own forward; "features": the
    feature-major step above, faster on XLA:CPU)."""
    model = self.model
    if layout == "features":
      weights = decode_weights(model, self.head_VD)

      def step(tok_B, rope_BH, key_valid_BS, kv_cache, slot):
        return decode_step(weights, model.cfg, tok_B, (rope_BH[0].T, rope_BH[1].T), key_valid_BS,
                           kv_cache, slot)
      return step

    def step(tok_B, rope_BH, key_valid_BS, kv_cache, slot):
      h_B1D, kv_cache = model.decoder(tok_B[:, None], tuple(a[:, None] for a in rope_BH),
                                      key_valid_BS, kv_cache, slot)
      return model.logits(h_B1D, self.head_VD)[:, 0], kv_cache
    return step
