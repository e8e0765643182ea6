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

import jax
import jax.numpy as jnp

from jaxrl.models.llama import KVCache, LanguageModel, ModelConfig, attention_mask
from sharding.rules import constrain


def decode_weights(model: LanguageModel, head_VD: jax.Array | None = None) -> dict:
  """Every weight as a matrix [out, in] (norm scales as [D, 1] columns); `head_VD`: the LM head
  computed ahead (`model.head_VD()` by default). The parameters are stored [out, in], so these are
  views, not copies; they keep the parameters' dtype (the engine casts once per call)."""
  cfg = model.cfg
  column = lambda norm: norm.scale[...][:, None]
  matrix = lambda w, out: w[...].reshape(out, -1)
  nh, kh = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  layers = [dict(attn_norm=column(b.attn_norm), wq=matrix(b.attn.wq, nh),
                 wk=matrix(b.attn.wk, kh), wv=matrix(b.attn.wv, kh),
                 wo=matrix(b.attn.wo, cfg.d_model), mlp_norm=column(b.mlp_norm),
                 w_gate=matrix(b.mlp.w_gate, cfg.d_ff), w_up=matrix(b.mlp.w_up, cfg.d_ff),
                 w_down=matrix(b.mlp.w_down, cfg.d_model))
            for b in model.decoder.blocks]
  return dict(embed_VD=model.decoder.embed[...], layers=layers,
              final_norm=column(model.decoder.final_norm),
              head_VD=model.head_VD() if head_VD is None else head_VD)


def _rms_norm(x_DB, scale_D1, eps: float):
  x32 = x_DB.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=0, keepdims=True) + eps)
  return (x32 * scale_D1).astype(x_DB.dtype)


def _rope(x_NHB, sin_HB, cos_HB):
  """`llama.rope` on feature-major heads (pairs (i, i + head_dim / 2) of axis 1)."""
  x1, x2 = jnp.split(x_NHB.astype(jnp.float32), 2, axis=1)
  return jnp.concatenate([x1 * cos_HB - x2 * sin_HB, x2 * cos_HB + x1 * sin_HB],
                         axis=1).astype(x_NHB.dtype)


def decode_step(weights: dict, cfg: ModelConfig, tokens_B, rope_HB: tuple[jax.Array, jax.Array],
                key_valid_BS, kv_cache: KVCache, slot) -> tuple[jax.Array, KVCache]:
  """Logits [B, V] (float32) for `tokens_B` at cache slot `slot`, and the updated cache.
  `rope_HB`: the (sin, cos) of `llama.rope_table` for the rows' positions, as [head_dim / 2, B]."""
  dt, b = cfg.compute_dtype, tokens_B.shape[0]
  k, g, h = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  sin_HB, cos_HB = rope_HB
  q_sin, q_cos = sin_HB * h**-0.5, cos_HB * h**-0.5  # queries carry 1/sqrt(head_dim)
  mask_BKGS = attention_mask(key_valid_BS, 1, slot)[:, None, None, 0, :]
  x_DB = constrain(jnp.take(weights["embed_VD"], tokens_B, axis=0).T.astype(dt), (None, "batch"))
  new_cache = []
  for w, (k_BKHS, v_BKSH) in zip(weights["layers"], kv_cache):
    a_DB = _rms_norm(x_DB, w["attn_norm"], cfg.norm_eps)
    q_KGHB = _rope((w["wq"] @ a_DB).reshape(k * g, h, b), q_sin, q_cos).reshape(k, g, h, b)
    q_BKGH = constrain(q_KGHB.transpose(3, 0, 1, 2), ("batch", "act_kv_heads", None, None))
    k_KHB = _rope((w["wk"] @ a_DB).reshape(k, h, b), sin_HB, cos_HB)
    v_KHB = (w["wv"] @ a_DB).reshape(k, h, b)
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
    x_DB = x_DB + w["wo"] @ out_FB
    m_DB = _rms_norm(x_DB, w["mlp_norm"], cfg.norm_eps)
    hidden_FB = jax.nn.silu(w["w_gate"] @ m_DB) * (w["w_up"] @ m_DB)
    x_DB = constrain(x_DB + w["w_down"] @ constrain(hidden_FB, ("act_mlp", "batch")),
                     (None, "batch"))
  h_DB = _rms_norm(x_DB, weights["final_norm"], cfg.norm_eps)
  logits_VB = constrain((weights["head_VD"] @ h_DB).astype(jnp.float32), ("act_vocab", "batch"))
  # The barrier keeps XLA from folding the transpose into the product, which turns it into one
  # XLA:CPU runs several times slower (activations as the left operand, contracted on rows).
  return jax.lax.optimization_barrier(logits_VB).T, tuple(new_cache)
