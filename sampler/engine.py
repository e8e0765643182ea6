"""Jitted generation: one prefill call over the prompt batch, then decode in `lax.while_loop`.

Layout: prompts are left-padded to P tokens, so every row's first new token goes to cache slot P
and a decode step writes the same slot for all rows. RoPE positions count valid tokens only, so a
row's result does not depend on how much padding it got. With `n > 1` samples per prompt the
prompt is prefilled once and its KV cache repeated (group-major rows: prompt i -> rows i*n..).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.llama import KVCache, init_kv_cache, positions_from_valid
from sampler.methods import SAMPLERS, SamplingConfig


@flax.struct.dataclass
class Rollout:
  tokens_BT: jax.Array  # prompt (P, left-padded) followed by N completion slots
  valid_BT: jax.Array  # prompt validity, then completion_mask
  completion_mask_BN: jax.Array  # generated tokens up to and including EOS / a stop sequence
  logprobs_BN: jax.Array  # log mu(token) under the sampling distribution; 0 where masked
  lengths_B: jax.Array


@flax.struct.dataclass
class DecodeState:
  step: jax.Array
  logits_BV: jax.Array  # next-token logits
  kv_cache: KVCache
  tokens_BN: jax.Array
  mask_BN: jax.Array
  logprobs_BN: jax.Array
  recent_BK: jax.Array  # the last K tokens, K = longest stop sequence (at least 1)
  done_B: jax.Array


def _hit_stop(recent_BK: jax.Array, cfg: SamplingConfig) -> jax.Array:
  hit_B = jnp.zeros(recent_BK.shape[:1], bool)
  for seq in cfg.stop_sequences:
    hit_B |= jnp.all(recent_BK[:, -len(seq):] == jnp.asarray(seq, jnp.int32), axis=1)
  return hit_B


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens_BP: jax.Array,
             prompt_valid_BP: jax.Array, key: jax.Array, max_new_B: jax.Array | None = None, *,
             cfg: SamplingConfig, n: int = 1) -> Rollout:
  """Samples `n` completions per prompt; `max_new_B` (per output row) caps each row's length."""
  model = nnx.merge(graphdef, params)
  p, steps = prompt_tokens_BP.shape[1], cfg.max_new_tokens
  kv_cache = init_kv_cache(model.cfg, prompt_tokens_BP.shape[0], p + steps)
  key_valid_BS = jnp.concatenate(
      [prompt_valid_BP, jnp.ones((prompt_tokens_BP.shape[0], steps), bool)], axis=1)
  logits_BPV, kv_cache = model(prompt_tokens_BP, positions_from_valid(prompt_valid_BP),
                               key_valid_BS, kv_cache, 0)
  if n > 1:  # share the prefix: prefill once, then give each sample its own copy of the cache
    repeat = lambda x: jnp.repeat(x, n, axis=0)
    kv_cache = jax.tree.map(repeat, kv_cache)
    prompt_tokens_BP, prompt_valid_BP, key_valid_BS, logits_BPV = map(
        repeat, (prompt_tokens_BP, prompt_valid_BP, key_valid_BS, logits_BPV))
  b = prompt_tokens_BP.shape[0]
  next_pos_B = prompt_valid_BP.sum(axis=1).astype(jnp.int32)
  max_new_B = jnp.full((b,), steps, jnp.int32) if max_new_B is None else max_new_B
  sample = SAMPLERS[cfg.method]
  k = max([len(s) for s in cfg.stop_sequences], default=1)

  def cond(s: DecodeState):
    return (s.step < steps) & ~jnp.all(s.done_B)

  uniforms_NB = jax.random.uniform(key, (steps, b))  # all of the call's randomness, drawn once

  def body(s: DecodeState) -> DecodeState:
    done_B = s.done_B | (s.step >= max_new_B)
    tok_B, logp_B = sample(s.logits_BV, uniforms_NB[s.step], cfg)
    tok_B = jnp.where(done_B, cfg.pad_id, tok_B)
    write = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None], s.step, axis=1)
    recent_BK = jnp.concatenate([s.recent_BK[:, 1:], tok_B[:, None]], axis=1)
    finished_B = _hit_stop(recent_BK, cfg)
    if not cfg.ignore_eos:
      finished_B |= tok_B == cfg.eos_id
    logits_B1V, kv_cache = model(tok_B[:, None], (next_pos_B + s.step)[:, None], key_valid_BS,
                                 s.kv_cache, p + s.step)
    return DecodeState(step=s.step + 1, logits_BV=logits_B1V[:, 0], kv_cache=kv_cache,
                       tokens_BN=write(s.tokens_BN, tok_B), mask_BN=write(s.mask_BN, ~done_B),
                       logprobs_BN=write(s.logprobs_BN, jnp.where(done_B, 0.0, logp_B)),
                       recent_BK=recent_BK, done_B=done_B | finished_B)

  init = DecodeState(step=jnp.int32(0), logits_BV=logits_BPV[:, -1], kv_cache=kv_cache,
                     tokens_BN=jnp.full((b, steps), cfg.pad_id, jnp.int32),
                     mask_BN=jnp.zeros((b, steps), bool), logprobs_BN=jnp.zeros((b, steps)),
                     recent_BK=jnp.full((b, k), -1, jnp.int32), done_B=jnp.zeros((b,), bool))
  # The mask comes from the done flags, not from comparing with PAD, so a sampled PAD token
  # mid-answer stays a real (masked-in) token for the trainer as it was for the sampler.
  final = jax.lax.while_loop(cond, body, init)
  return Rollout(
      tokens_BT=jnp.concatenate([prompt_tokens_BP, final.tokens_BN], axis=1),
      valid_BT=jnp.concatenate([prompt_valid_BP, final.mask_BN], axis=1),
      completion_mask_BN=final.mask_BN,
      logprobs_BN=final.logprobs_BN,
      lengths_B=final.mask_BN.sum(axis=1),
  )
