"""The activation layouts the one forward pass (transformer.py) runs in.

`ROWS`, activations [B, T, D], serves every pass: training, scoring, prefill, and decoding off
the CPU. `FEATURES`, activations [D, B] with one new token per row, serves the sampler's decode
step on a CPU: there a decode step's matrix products have as many rows as the batch shard (tens),
and XLA:CPU runs such a product ~14% faster as weight [out, in] @ activations [in, B] than as
activations [B, in] @ weight [in, out] (docs/benchmarks.md). The weights are stored [out, in]
(PyTorch's order), so neither layout copies a weight.

A layout owns only how its activations are shaped: a projection, a norm's axis, the heads' split,
RoPE's rotation, the way queries, keys and values meet the KV cache, the sharding constraints and
the LM head's matrix product. The blocks' math is written once, in transformer.py, and the
head's (float32 logits, soft cap) in lm_head.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl import platform
from jaxrl.models.lm_head import features_product, lm_head, rows_product
from jaxrl.models.attention import attend, attend_one, attention_impl, fused, write_cache
from jaxrl.models.lora import adapted, adapter
from jaxrl.models.rope import rope, rope_table, table_part
from jaxrl.models.splash import Segments, splash
from jaxrl.partitioning import constrain


def dense(x_BTD: jax.Array, w_OD: jax.Array, *, trained: bool = True) -> jax.Array:
  """x @ w.T over the last axis, [B, T, O], as one 2-D matrix product over the flattened rows:
  XLA:CPU runs the backward's weight gradient (a contraction over rows) ~1.6x faster that way
  than as a contraction over both B and T. On a CPU a `trained` weight with more outputs than
  inputs (the MLP's gate and up) is multiplied as an explicit [in, out] transpose, kept by a
  barrier: its gradient is then computed [in, out] too, which XLA:CPU runs at ~0.88 of its
  matmul peak instead of ~0.62 for [out, in] (the update: -5%; docs/benchmarks.md). Where no
  gradient reaches `w` (LoRA's frozen base weights) the transpose would be a copy for nothing:
  `trained=False`."""
  b, t, d = x_BTD.shape
  x_RD, w_OD = x_BTD.reshape(b * t, d), w_OD.astype(x_BTD.dtype)
  if trained and w_OD.shape[0] > w_OD.shape[1] and platform.backend() == "cpu":
    out = x_RD @ jax.lax.optimization_barrier(w_OD.T)
  else:
    out = jax.lax.dot_general(x_RD, w_OD, (((1,), (1,)), ((), ())))
  return out.reshape(b, t, w_OD.shape[0])


class Rows:
  """Activations [B, T, D] (queries and keys [B, T, heads, H])."""
  feature_axis = head_axis = -1

  def step_inputs(self, tok_B, rope_BH):
    """A decode step's tokens and (sin, cos) table, one position per row."""
    return tok_B[:, None], tuple(a[:, None] for a in rope_BH)

  def length(self, tokens_BT) -> int:
    return tokens_BT.shape[1]

  def rope_table(self, positions_BT, cfg):
    """(sin, cos) [B, T, H / 2]: given (a decode loop computes them ahead) or computed here."""
    return positions_BT if isinstance(positions_BT, tuple) else rope_table(positions_BT, cfg)

  def rope_part(self, table, cfg, local: bool):
    """A global or local layer's part of the pass's table (rope.table_part)."""
    return table_part(table, cfg, local)

  def embed(self, table_VD, tokens_BT, dtype):
    return constrain(jnp.take(table_VD, tokens_BT, axis=0).astype(dtype), ("batch", None, None))

  def dense(self, x_BTI, w_OI, *, trained: bool = True):
    return dense(x_BTI, w_OI, trained=trained)

  def adapt(self, module, name: str, x_BTI, out_BTO):
    return adapted(module, name, x_BTI, out_BTO)

  def heads(self, out_BTF, n: int, h: int):
    return out_BTF.reshape(*out_BTF.shape[:2], n, h)

  def head_bias(self, b_NH):
    return b_NH

  def rope(self, x_BTNH, table, scale: float = 1.0):
    return rope(x_BTNH, table, scale)

  def hidden(self, h_BTF):
    return constrain(h_BTF, ("batch", None, "act_mlp"))

  def as_rows(self, x_BTD):
    """Activations as [B, T, D] (what the MoE layer takes), and back (`from_rows`)."""
    return x_BTD

  def from_rows(self, x_BTD):
    return x_BTD

  def residual(self, x_BTD):
    return constrain(x_BTD, ("batch", None, None))

  def attention(self, q_BTNH, k_BTKH, v_BTKH, layer_cache, cache_index, mask_BTS, cfg):
    """(attention output [B, T, N * H], the layer's updated cache). `mask_BTS`: a dense mask, or
    a cacheless pass's `ValidPrefix` (cuDNN) or `Segments` (splash: attention.fused), or a
    shared prefix's completion pass's `Segments` over the cache (splash.splash)."""
    q_BTNH = constrain(q_BTNH, ("batch", None, "act_heads", None))
    slots = None if layer_cache is None or isinstance(mask_BTS, Segments) else mask_BTS.shape[-1]
    k_BKHS, v_BKSH, new_cache = write_cache(layer_cache, k_BTKH.transpose(0, 2, 3, 1),
                                            v_BTKH.transpose(0, 2, 1, 3), cache_index, slots)
    b, t, n, h = q_BTNH.shape
    dt, kh = q_BTNH.dtype, cfg.n_kv_heads
    impl = attention_impl(cfg)
    if isinstance(mask_BTS, Segments) and k_BKHS.shape[-1] > t:  # a shared prefix's completions
      out_BTKGH = splash(q_BTNH, k_BKHS.transpose(0, 3, 1, 2), v_BKSH.transpose(0, 2, 1, 3),
                         mask_BTS).reshape(b, t, kh, n // kh, h)
    elif impl != "einsum" and k_BKHS.shape[-1] == k_BTKH.shape[1]:  # no earlier cache slots
      out_BTKGH = fused(q_BTNH, k_BTKH, v_BTKH, mask_BTS, impl).reshape(b, t, kh, n // kh, h)
    elif t == 1:
      out_BTKGH = attend_one(q_BTNH.reshape(b, kh, n // kh, h), k_BKHS.astype(dt),
                             v_BKSH.astype(dt), mask_BTS[:, 0], cfg.attention.softcap)[:, None]
    else:
      out_BTKGH = attend(q_BTNH.reshape(b, t, kh, n // kh, h), k_BKHS.astype(dt),
                         v_BKSH.astype(dt), mask_BTS, cfg.attention.softcap)
    return out_BTKGH.reshape(b, t, n * h), new_cache

  def logits(self, h_BTD, head_VD, softcap: float):
    """float32 logits [B, T, V] (the LM head: jaxrl/models/lm_head.py)."""
    logits_BTV = lm_head(h_BTD, head_VD, softcap=softcap, product=rows_product)
    return constrain(logits_BTV, ("batch", None, "act_vocab"))

  def next_logits(self, h_B1D, head_VD, softcap: float):
    return self.logits(h_B1D, head_VD, softcap)[:, 0]


class Features:
  """Activations [D, B], one token per row (queries and keys [heads, H, B]): decode steps."""
  feature_axis, head_axis = 0, 1

  def step_inputs(self, tok_B, rope_BH):
    return tok_B, rope_BH

  def length(self, tok_B) -> int:
    return 1

  def rope_table(self, table_BH, cfg):
    """The decode loop's (sin, cos) [B, H / 2], as [H / 2, B]."""
    return tuple(a.T for a in table_BH)

  def rope_part(self, table_HB, cfg, local: bool):
    return table_part(table_HB, cfg, local, axis=0)

  def embed(self, table_VD, tok_B, dtype):
    return constrain(jnp.take(table_VD, tok_B, axis=0).T.astype(dtype), (None, "batch"))

  def dense(self, x_IB, w_OI, *, trained: bool = True):
    return w_OI.astype(x_IB.dtype) @ x_IB

  def adapt(self, module, name: str, x_IB, out_OB):
    """`out_OB` plus the adapter's scale * B (A x), if `name` has one."""
    lora = adapter(module, name)
    if lora is None:
      return out_OB
    r, dt = lora.a.shape[0], x_IB.dtype
    b_OR = lora.b[...].reshape(-1, r) * jnp.asarray(lora.scale, lora.b.dtype)
    return out_OB + b_OR.astype(dt) @ (lora.a[...].reshape(r, -1).astype(dt) @ x_IB)

  def heads(self, out_FB, n: int, h: int):
    return out_FB.reshape(n, h, -1)

  def head_bias(self, b_NH):
    return b_NH[:, :, None]

  def rope(self, x_NHB, table, scale: float = 1.0):
    """`rope.rope` on feature-major heads (pairs (i, i + head_dim / 2) of axis 1)."""
    sin_HB, cos_HB = (a * scale for a in table)
    x1, x2 = jnp.split(x_NHB.astype(jnp.float32), 2, axis=1)
    return jnp.concatenate([x1 * cos_HB - x2 * sin_HB, x2 * cos_HB + x1 * sin_HB],
                           axis=1).astype(x_NHB.dtype)

  def hidden(self, h_FB):
    return constrain(h_FB, ("act_mlp", "batch"))

  def as_rows(self, x_DB):
    return x_DB.T[:, None]

  def from_rows(self, x_B1D):
    return x_B1D[:, 0].T

  def residual(self, x_DB):
    return constrain(x_DB, (None, "batch"))

  def attention(self, q_NHB, k_KHB, v_KHB, layer_cache, slot, mask_B1S, cfg):
    """(attention output [N * H, B], the layer's updated cache): per row, a small product per
    kv head over its cache, as the rows layout's decode step."""
    n, h, b = q_NHB.shape
    kh, dt = cfg.n_kv_heads, q_NHB.dtype
    q_BKGH = constrain(q_NHB.reshape(kh, n // kh, h, b).transpose(3, 0, 1, 2),
                       ("batch", "act_kv_heads", None, None))
    k_BKHS, v_BKSH, new_cache = write_cache(layer_cache, k_KHB.transpose(2, 0, 1)[..., None],
                                            v_KHB.transpose(2, 0, 1)[:, :, None], slot,
                                            mask_B1S.shape[-1])
    out_BKGH = attend_one(q_BKGH, k_BKHS.astype(dt), v_BKSH.astype(dt), mask_B1S[:, 0],
                          cfg.attention.softcap)
    return out_BKGH.reshape(b, n * h).T, new_cache

  def logits(self, h_DB, head_VD, softcap: float):
    """float32 logits [B, V] (the LM head: jaxrl/models/lm_head.py), multiplied as [V, D] @ [D, B].
    The barrier keeps XLA from folding the transpose into the product, which turns it into one
    XLA:CPU runs several times slower (activations as the left operand, contracted on rows)."""
    logits_VB = lm_head(h_DB, head_VD, softcap=softcap, product=features_product)
    return jax.lax.optimization_barrier(constrain(logits_VB, ("act_vocab", "batch"))).T

  def next_logits(self, h_DB, head_VD, softcap: float):
    return self.logits(h_DB, head_VD, softcap)


ROWS, FEATURES = Rows(), Features()
LAYOUTS = {"rows": ROWS, "features": FEATURES}
