"""Jitted generation: one prefill call over the prompt batch, then decode in `lax.while_loop`.

Layout: prompts are left-padded to P tokens, so every row's first new token goes to cache slot P
and a decode step writes the same slot for all rows. RoPE positions count valid tokens only, so a
row's result does not depend on how much padding it got.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.llama import init_kv_cache, positions_from_valid
from sampler.methods import SAMPLERS, SamplingConfig


@flax.struct.dataclass
class Rollout:
  tokens_BT: jax.Array  # prompt (P, left-padded) followed by N completion slots
  valid_BT: jax.Array  # prompt validity, then completion_mask
  completion_mask_BN: jax.Array  # generated tokens up to and including EOS
  logprobs_BN: jax.Array  # log mu(token) under the sampling distribution; 0 where masked
  lengths_B: jax.Array


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens_BP: jax.Array,
             prompt_valid_BP: jax.Array, key: jax.Array, *, cfg: SamplingConfig) -> Rollout:
  model = nnx.merge(graphdef, params)
  b, p = prompt_tokens_BP.shape
  n = cfg.max_new_tokens
  sample = SAMPLERS[cfg.method]
  kv_cache = init_kv_cache(model.cfg, b, p + n)
  key_valid_BS = jnp.concatenate([prompt_valid_BP, jnp.ones((b, n), bool)], axis=1)
  positions_BP = positions_from_valid(prompt_valid_BP)
  logits_BPV, kv_cache = model(prompt_tokens_BP, positions_BP, key_valid_BS, kv_cache, 0)
  next_pos_B = prompt_valid_BP.sum(axis=1).astype(jnp.int32)

  def cond(carry):
    step, *_, done_B, _ = carry
    return (step < n) & ~jnp.all(done_B)

  def body(carry):
    step, logits_BV, kv_cache, tokens_BN, mask_BN, logprobs_BN, done_B, key = carry
    key, sub = jax.random.split(key)
    tok_B, logp_B = sample(logits_BV, sub, cfg)
    tok_B = jnp.where(done_B, cfg.pad_id, tok_B)
    tokens_BN = jax.lax.dynamic_update_slice_in_dim(tokens_BN, tok_B[:, None], step, axis=1)
    mask_BN = jax.lax.dynamic_update_slice_in_dim(mask_BN, ~done_B[:, None], step, axis=1)
    logprobs_BN = jax.lax.dynamic_update_slice_in_dim(
        logprobs_BN, jnp.where(done_B, 0.0, logp_B)[:, None], step, axis=1)
    done_B = done_B | (tok_B == cfg.eos_id)
    logits_B1V, kv_cache = model(tok_B[:, None], (next_pos_B + step)[:, None], key_valid_BS,
                                 kv_cache, p + step)
    return step + 1, logits_B1V[:, 0], kv_cache, tokens_BN, mask_BN, logprobs_BN, done_B, key

  carry = (jnp.int32(0), logits_BPV[:, -1], kv_cache, jnp.full((b, n), cfg.pad_id, jnp.int32),
           jnp.zeros((b, n), bool), jnp.zeros((b, n), jnp.float32), jnp.zeros((b,), bool), key)
  # The mask comes from the done flags, not from comparing with PAD, so a sampled PAD token
  # mid-answer stays a real (masked-in) token for the trainer as it was for the sampler.
  _, _, _, tokens_BN, completion_mask_BN, logprobs_BN, _, _ = jax.lax.while_loop(cond, body, carry)
  return Rollout(
      tokens_BT=jnp.concatenate([prompt_tokens_BP, tokens_BN], axis=1),
      valid_BT=jnp.concatenate([prompt_valid_BP, completion_mask_BN], axis=1),
      completion_mask_BN=completion_mask_BN,
      logprobs_BN=logprobs_BN,
      lengths_B=completion_mask_BN.sum(axis=1),
  )


def make_generate(graphdef: nnx.GraphDef, cfg: SamplingConfig, *, param_shardings=None,
                  batch_sharding=None):
  """The one place `generate` is jitted: `fn(params, prompt_tokens_BP, prompt_valid_BP, key)`."""
  fn = functools.partial(generate, graphdef, cfg=cfg)
  if param_shardings is None:
    return jax.jit(fn)
  return jax.jit(fn, in_shardings=(param_shardings, batch_sharding, batch_sharding, None))
