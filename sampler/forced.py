"""The sampler's full next-token distributions along given completions: its prefill and decode
step (sampler/engine.py) run over tokens already drawn, each step fed the completion's next
token instead of a sampled one, keeping the log-softmax at the temperature it samples at (top-k
not applied: the distribution the trainer scores) at chosen steps only. Not on the sampling
path: the run's held-out evaluation compares these with the trainer's distributions at the same
positions (train/loop/full_kl.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.decoding import LMDecoding
from sampler.engine import decode_forward, resolve_layout
from sampler.methods import SamplingConfig
from sharding.mesh import batch_sharding
from sharding.rules import SAMPLER_RULES, jit_per_shard


def forced_logprobs(graphdef: nnx.GraphDef, params: nnx.State, prompt_tokens_BP, prompt_valid_BP,
                    completion_BN, steps_BK, *, cfg: SamplingConfig):
  """[B, K, V] float32: log p(. | prompt, completion[:k]) of the sampler at each row's steps
  `steps_BK` (step i: the distribution completion token i was drawn from; the prefill's for
  i = 0), at `cfg.temperature`."""
  model = LMDecoding.of(nnx.merge(graphdef, params))
  (b, p), n, k = prompt_tokens_BP.shape, completion_BN.shape[1], steps_BK.shape[1]
  logits_BV, kv_cache, _ = model.prefill(prompt_tokens_BP, prompt_valid_BP)
  kv_cache = model.grow_cache(kv_cache, p + n - 1)
  key_valid_BS = jnp.concatenate([prompt_valid_BP, jnp.ones((b, n - 1), bool)], axis=1)
  forward = decode_forward(model, resolve_layout(cfg), key_valid_BS,
                           prompt_valid_BP.sum(axis=1).astype(jnp.int32), n, p)

  def keep(i, logits_BV, out_BKV):
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / cfg.temperature, axis=-1)
    return jnp.where((steps_BK == i)[..., None], logp_BV[:, None, :], out_BKV)

  def body(i, carry):  # the forward of token i - 1 gives token i's distribution
    kv_cache, out_BKV = carry
    logits_BV, kv_cache, _ = forward(completion_BN[:, i - 1], i - 1, kv_cache, p + n - 1)
    return kv_cache, keep(i, logits_BV, out_BKV)

  out_BKV = keep(0, logits_BV, jnp.zeros((b, k, logits_BV.shape[-1]), jnp.float32))
  return jax.lax.fori_loop(1, n, body, (kv_cache, out_BKV))[1]


def forced_program(graphdef: nnx.GraphDef, cfg: SamplingConfig, mesh, param_shardings):
  """`forced_logprobs` jitted on the sampler's mesh in its layout, every data shard on its own
  rows (as the sampler's own programs: sampler/sampler.py): `fn(params, prompt_tokens_BP,
  prompt_valid_BP, completion_BN, steps_BK)`."""
  def run(params, tokens_BP, valid_BP, completion_BN, steps_BK):
    return forced_logprobs(graphdef, params, tokens_BP, valid_BP, completion_BN, steps_BK,
                           cfg=cfg)
  shardings = {}
  if mesh is not None:
    grid = batch_sharding(mesh, SAMPLER_RULES, 2)
    shardings = dict(in_shardings=(param_shardings, grid, grid, grid, grid))
  return jit_per_shard(mesh, SAMPLER_RULES, run, (False, True, True, True, True), **shardings)
