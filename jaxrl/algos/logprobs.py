"""Token log-probs and entropies from hidden states without a [B, T, V] logits tensor.

`chunked_logprobs(h_BND, head_VD, targets_BN)` computes, for every position, the log-prob of its
target token and the entropy of the next-token distribution, in chunks of positions along the
sequence: a chunk's logits [B, n, V] live only inside its step of a loop, in the forward and in
the backward (a custom VJP recomputes each chunk's logits rather than saving them). Peak memory
is then one chunk's logits (about `LOGITS_BUDGET` floats) instead of B x N x V: 8 x 1024 tokens
of a 152k vocabulary need 5 GB of float32 logits at once, and log-softmax, its exponent and
their gradients as much again each (benchmarks/logprob_memory.py measures both).

Gradients, with z the logits, p = softmax(z) and H the entropy:
  d logp(y) / dz = onehot(y) - p          d H / dz = -p * (log p + H)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

LOGITS_BUDGET = 1 << 25  # floats of one chunk's logits over the whole batch (128 MB in float32)


def chunk_length(batch: int, length: int, vocab: int, budget: int | None = None) -> int:
  """Positions per chunk: as many as keep [batch, chunk, vocab] within `budget` floats
  (default `LOGITS_BUDGET`)."""
  budget = LOGITS_BUDGET if budget is None else budget
  return max(1, min(length, budget // max(batch * vocab, 1)))


def _chunk_stats(h_BnD, head_VD, targets_Bn):
  """Logits of one chunk (float32), their log-sum-exp, the targets' log-probs, the entropy."""
  logits_BnV = jnp.einsum("bnd,vd->bnv", h_BnD, head_VD.astype(h_BnD.dtype),
                          preferred_element_type=jnp.float32)
  lse_Bn = jax.nn.logsumexp(logits_BnV, axis=-1)
  hit_BnV = jnp.arange(logits_BnV.shape[-1]) == targets_Bn[..., None]
  logp_Bn = jnp.where(hit_BnV, logits_BnV, 0.0).sum(-1) - lse_Bn
  p_BnV = jnp.exp(logits_BnV - lse_Bn[..., None])
  entropy_Bn = lse_Bn - (p_BnV * logits_BnV).sum(-1)
  return logits_BnV, lse_Bn, p_BnV, hit_BnV, logp_Bn, entropy_Bn


def _split(x_BN, n: int):
  """[B, N, ...] -> [N / n, B, n, ...] (N padded with zeros to a multiple of n)."""
  b, length = x_BN.shape[:2]
  pad = -length % n
  x_BN = jnp.pad(x_BN, [(0, 0), (0, pad)] + [(0, 0)] * (x_BN.ndim - 2))
  return jnp.moveaxis(x_BN.reshape(b, (length + pad) // n, n, *x_BN.shape[2:]), 1, 0)


def _join(x_CBn, length: int):
  """The inverse of `_split`: [C, B, n, ...] -> [B, length, ...]."""
  c, b, n = x_CBn.shape[:3]
  return jnp.moveaxis(x_CBn, 0, 1).reshape(b, c * n, *x_CBn.shape[3:])[:, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _chunked(h_BND, head_VD, targets_BN, n: int):
  head_VD = head_VD.astype(h_BND.dtype)  # once, not in every chunk's step
  step = lambda xs: _chunk_stats(xs[0], head_VD, xs[1])[4:]
  logp_CBn, entropy_CBn = jax.lax.map(step, (_split(h_BND, n), _split(targets_BN, n)))
  return _join(logp_CBn, h_BND.shape[1]), _join(entropy_CBn, h_BND.shape[1])


def _fwd(h_BND, head_VD, targets_BN, n: int):
  return _chunked(h_BND, head_VD, targets_BN, n), (h_BND, head_VD, targets_BN)


def _bwd(n: int, res, grads):
  """Recomputes each chunk's logits and turns the cotangents of (logp, entropy) into the
  chunk's hidden-state gradient and its share of the head's."""
  h_BND, head_VD, targets_BN = res
  g_logp_BN, g_entropy_BN = grads
  head_dt_VD = head_VD.astype(h_BND.dtype)  # once, not in every chunk's step

  def step(dhead_VD, xs):
    h_BnD, targets_Bn, g_logp_Bn, g_ent_Bn = xs
    logits_BnV, lse_Bn, p_BnV, hit_BnV, _, entropy_Bn = _chunk_stats(h_BnD, head_dt_VD,
                                                                      targets_Bn)
    logp_BnV = logits_BnV - lse_Bn[..., None]
    dz_BnV = (g_logp_Bn[..., None] * (hit_BnV - p_BnV)
              - g_ent_Bn[..., None] * p_BnV * (logp_BnV + entropy_Bn[..., None]))
    # Both products in the compute dtype with float32 accumulation, as the forward's (a bf16
    # model's backward would otherwise run float32 matrix products: TF32 at best on a GPU).
    dt = h_BnD.dtype
    dz_BnV = dz_BnV.astype(dt)
    dh_BnD = jnp.einsum("bnv,vd->bnd", dz_BnV, head_dt_VD,
                        preferred_element_type=jnp.float32)
    dhead_VD = dhead_VD + jnp.einsum("bnv,bnd->vd", dz_BnV, h_BnD,
                                     preferred_element_type=jnp.float32)
    return dhead_VD, dh_BnD.astype(dt)

  xs = (_split(h_BND, n), _split(targets_BN, n), _split(g_logp_BN, n), _split(g_entropy_BN, n))
  dhead_VD, dh_CBnD = jax.lax.scan(step, jnp.zeros(head_VD.shape, jnp.float32), xs)
  return _join(dh_CBnD, h_BND.shape[1]), dhead_VD.astype(head_VD.dtype), None


_chunked.defvjp(_fwd, _bwd)


def chunked_logprobs(h_BND, head_VD, targets_BN, *, chunk: int | None = None):
  """(log p(targets_BN), entropy), each [B, N] float32, from hidden states h_BND (any compute
  dtype) and the LM head [V, D], `chunk` positions at a time (default: `chunk_length`)."""
  b, length, _ = h_BND.shape
  return _chunked(h_BND, head_VD, targets_BN, chunk or chunk_length(b, length, head_VD.shape[0]))


def dense_logprobs(h_BND, head_VD, targets_BN):
  """The same from the full [B, N, V] logits at once: the reference the tests and
  benchmarks/logprob_memory.py compare `chunked_logprobs` with."""
  logits_BNV = jnp.einsum("bnd,vd->bnv", h_BND, head_VD.astype(h_BND.dtype),
                          preferred_element_type=jnp.float32)
  logp_all_BNV = jax.nn.log_softmax(logits_BNV, axis=-1)
  logp_BN = jnp.take_along_axis(logp_all_BNV, targets_BN[..., None], axis=-1)[..., 0]
  return logp_BN, -(jnp.exp(logp_all_BNV) * logp_all_BNV).sum(-1)
