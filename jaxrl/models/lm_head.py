"""The LM head, written once: hidden states x the head's weight -> float32 logits, soft-capped.

`lm_head(h, head_VD, softcap=..., product=...)` is the only place logits are made: the sampler's
prefill and decode steps (each activation layout of jaxrl/models/layouts.py passes its own matrix
product: rows, or [V, D] @ [D, B] feature-major on a CPU), `LanguageModel.logits`, and the
log-probs below. Every product multiplies in the compute dtype with float32 accumulation; the
logits are float32 and, with `softcap` > 0 (`ModelConfig.logit_softcap`, Gemma 2's final-logit
soft-capping), `softcap * tanh(logits / softcap)`. A change to the logits is a change here, and
the sampler and the trainer see it alike.

`chunked_logprobs(h_BND, head_VD, targets_BN, softcap=...)` computes, for every position, the
log-prob of its target token and the entropy of the next-token distribution, in chunks of
positions along the sequence: a chunk's logits [B, n, V] live only inside its step of a loop, in
the forward and in the backward (a custom VJP recomputes each chunk's logits with `lm_head`
rather than saving them). Peak memory is then one chunk's logits (about `LOGITS_BUDGET` floats)
instead of B x N x V: 8 x 1024 tokens of a 152k vocabulary need 5 GB of float32 logits at once,
and log-softmax, its exponent and their gradients as much again each
(benchmarks/logprob_memory.py measures both).

The backward is written by hand, next to the head, rather than left to autodiff of a chunk under
`jax.checkpoint`: measured at 8 x 1024 tokens of a 152k vocabulary on this CPU, autodiff's
backward held 4% (float32) to 10% (bfloat16) more memory at its peak (six chunk-sized arrays
live in its loop against four) at the same speed, and it rounds the gradients differently, so a
run's weights would no longer be the ones it has always produced (docs/benchmarks.md). It is
tested against autodiff of `dense_logprobs` and of the plain formula, soft cap included
(tests/test_logprobs.py).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

LOGITS_BUDGET = 1 << 25  # floats of one chunk's logits over the whole batch (128 MB in float32)


def _matmul(a, b, contract: tuple):
  """`dot_general` contracting `contract`, float32 accumulation and result: a bf16 model's
  logits are not rounded to bf16 (and XLA:CPU runs a 152k x 896 bf16 head 6-10x faster so than
  with a bf16 result)."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


# Each product multiplies in the hidden states' dtype and casts the head itself, so that the
# log-probs' backward returns the head's gradient in the head's own dtype (float32 for a trained
# head), summed over the chunks in it (XLA moves the cast out of the chunks' loop).
def rows_product(h_BTD, head_VD):
  """[B, T, V], one 2-D product over the flattened rows (as `layouts.dense`)."""
  b, t, d = h_BTD.shape
  h_RD = h_BTD.reshape(b * t, d)
  return _matmul(h_RD, head_VD.astype(h_RD.dtype), ((1,), (1,))).reshape(b, t, -1)


def features_product(h_DB, head_VD):
  """[V, B]: weight @ activations, the product XLA:CPU runs fastest for a decode step's few rows
  (jaxrl/models/layouts.py)."""
  return _matmul(head_VD.astype(h_DB.dtype), h_DB, ((1,), (0,)))


def chunk_product(h_BnD, head_VD):
  """[B, n, V] as one einsum: the log-probs' product."""
  return jnp.einsum("bnd,vd->bnv", h_BnD, head_VD.astype(h_BnD.dtype),
                    preferred_element_type=jnp.float32)


def lm_head(h, head_VD, *, softcap: float, product: Callable):
  """The LM head: float32 logits of hidden states `h` (in the compute dtype) under the head's
  weight [V, D], `product(h, head)` in the caller's layout (`rows_product`, `features_product`,
  `chunk_product`), soft-capped to (-softcap, softcap) where `softcap` > 0."""
  logits = product(h, head_VD).astype(jnp.float32)
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  return logits


def chunk_length(batch: int, length: int, vocab: int, budget: int | None = None) -> int:
  """Positions per chunk: as many as keep [batch, chunk, vocab] within `budget` floats
  (default `LOGITS_BUDGET`)."""
  budget = LOGITS_BUDGET if budget is None else budget
  return max(1, min(length, budget // max(batch * vocab, 1)))


def _chunk_stats(h_BnD, head_VD, targets_Bn, softcap: float, temperature: float):
  """One chunk's float32 logits [B, n, V] (the head's, divided by `temperature` as the sampler
  divides them: sampler/methods.py), their log-sum-exp, softmax and target one-hot, and the
  targets' log-probs and the entropy [B, n]."""
  logits_BnV = lm_head(h_BnD, head_VD, softcap=softcap, product=chunk_product)
  if temperature != 1.0:
    logits_BnV = logits_BnV / temperature
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _chunked(h_BND, head_VD, targets_BN, n: int, softcap: float, temperature: float):
  head_VD = head_VD.astype(h_BND.dtype)  # once, not in every chunk's step
  step = lambda xs: _chunk_stats(xs[0], head_VD, xs[1], softcap, temperature)[4:]
  logp_CBn, entropy_CBn = jax.lax.map(step, (_split(h_BND, n), _split(targets_BN, n)))
  return _join(logp_CBn, h_BND.shape[1]), _join(entropy_CBn, h_BND.shape[1])


def _fwd(h_BND, head_VD, targets_BN, n: int, softcap: float, temperature: float):
  return (_chunked(h_BND, head_VD, targets_BN, n, softcap, temperature),
          (h_BND, head_VD, targets_BN))


def _bwd(n: int, softcap: float, temperature: float, res, grads):
  """Recomputes each chunk's logits z and turns the cotangents of (logp, entropy) into the
  chunk's hidden-state gradient and its share of the head's: d logp(y) / dz = onehot(y) - p,
  d H / dz = -p (log p + H), through the temperature z = c / t, dz / dc = 1 / t, and through
  the soft cap c = s tanh(y / s), dc / dy = 1 - (c / s)^2."""
  h_BND, head_VD, targets_BN = res
  g_logp_BN, g_entropy_BN = grads
  head_dt_VD = head_VD.astype(h_BND.dtype)  # once, not in every chunk's step

  def step(dhead_VD, xs):
    h_BnD, targets_Bn, g_logp_Bn, g_ent_Bn = xs
    logits_BnV, lse_Bn, p_BnV, hit_BnV, _, entropy_Bn = _chunk_stats(
        h_BnD, head_dt_VD, targets_Bn, softcap, temperature)
    logp_BnV = logits_BnV - lse_Bn[..., None]
    dz_BnV = (g_logp_Bn[..., None] * (hit_BnV - p_BnV)
              - g_ent_Bn[..., None] * p_BnV * (logp_BnV + entropy_Bn[..., None]))
    if temperature != 1.0:
      dz_BnV, logits_BnV = dz_BnV / temperature, logits_BnV * temperature  # (the capped ones)
    if softcap:
      dz_BnV = dz_BnV * (1.0 - jnp.square(logits_BnV / softcap))
    # Both products in the compute dtype with float32 accumulation, as the forward's (a bf16
    # model's backward would otherwise run float32 matrix products: TF32 at best on a GPU).
    dt = h_BnD.dtype
    dz_BnV = dz_BnV.astype(dt)
    dh_BnD = jnp.einsum("bnv,vd->bnd", dz_BnV, head_dt_VD, preferred_element_type=jnp.float32)
    dhead_VD = dhead_VD + jnp.einsum("bnv,bnd->vd", dz_BnV, h_BnD,
                                     preferred_element_type=jnp.float32)
    return dhead_VD, dh_BnD.astype(dt)

  xs = (_split(h_BND, n), _split(targets_BN, n), _split(g_logp_BN, n), _split(g_entropy_BN, n))
  dhead_VD, dh_CBnD = jax.lax.scan(step, jnp.zeros(head_VD.shape, jnp.float32), xs)
  return _join(dh_CBnD, h_BND.shape[1]), dhead_VD.astype(head_VD.dtype), None


_chunked.defvjp(_fwd, _bwd)


def chunked_logprobs(h_BND, head_VD, targets_BN, *, softcap: float, chunk: int | None = None,
                     temperature: float = 1.0):
  """(log p(targets_BN), entropy), each [B, N] float32, from hidden states h_BND (any compute
  dtype) and the LM head [V, D] with its `softcap`, `chunk` positions at a time (default:
  `chunk_length`), of the distribution at `temperature` (the one RL samples from)."""
  b, length, _ = h_BND.shape
  n = chunk or chunk_length(b, length, head_VD.shape[0])
  return _chunked(h_BND, head_VD, targets_BN, n, float(softcap), float(temperature))


def dense_logprobs(h_BND, head_VD, targets_BN, *, softcap: float, temperature: float = 1.0):
  """The same from the full [B, N, V] logits at once: the reference the tests and
  benchmarks/logprob_memory.py compare `chunked_logprobs` with."""
  logits_BNV = lm_head(h_BND, head_VD, softcap=softcap, product=chunk_product) / temperature
  logp_all_BNV = jax.nn.log_softmax(logits_BNV, axis=-1)
  logp_BN = jnp.take_along_axis(logp_all_BNV, targets_BN[..., None], axis=-1)[..., 0]
  return logp_BN, -(jnp.exp(logp_all_BNV) * logp_all_BNV).sum(-1)
