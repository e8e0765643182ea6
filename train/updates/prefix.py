"""Shared prefixes over the [B, T] batch (`rl.batching.share_prefix` without packing): the
consecutive rows of a piece that share a prompt (`RLConfig.share_group`) run it once, as the
sampler's prefill does, and their completions continue from its KV cache, repeated for each
(its gradient the sum of theirs). G completions of a P-token prompt cost P + G * N tokens of
the linear layers and P^2 + G * N * (P + N) attention scores instead of G * (P + N) and
G * (P + N)^2. The logits of completion slot 0 come from the prompt's last position, the
others from the completion's own positions, so every downstream array is the unshared pass's
(tests/test_shared_prefix.py: losses and gradients to 1e-5). Packed rows share a prompt as a
tree instead (train/updates/packing.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.attention import grow_kv_cache, init_kv_cache
from jaxrl.models.lm_head import chunked_logprobs
from jaxrl.models.moe import pooled_stats
from jaxrl.models.rope import positions_from_valid
from train.updates.forward import completion_values, routed_logprobs, router_loss
from train.updates.state import model_of


def prefix_states(decoder, tokens_BT, valid_BT, prompt_len: int, group: int, routes_BTLK=None):
  """(hidden states [B, N + 1, D]: the prompt's last position's, then the N completion
  positions', each predicting the next slot; the pooled routing statistics or None) of a
  `Decoder` over a batch whose every `group` consecutive rows share their prompt, run once."""
  (b, t), p = tokens_BT.shape, prompt_len
  positions_BT = positions_from_valid(valid_BT)
  prompt = lambda x: None if x is None else x[::group, :p]  # noqa: E731
  weights_BP = prompt(valid_BT).astype(jnp.float32) * group  # (the rows each token stands for)
  # (a cache of the prompt's slots alone: its pass attends over them, fused where it can)
  h_BPD, cache, first = decoder.forward(
      prompt(tokens_BT), prompt(positions_BT), prompt(valid_BT),
      init_kv_cache(decoder.cfg, b // group, p), 0, routes_BTLK=prompt(routes_BTLK),
      weights_BT=weights_BP, shared=True)
  cache = grow_kv_cache(decoder.cfg, cache, t)
  h_B1D, cache = jax.tree.map(lambda x: jnp.repeat(x, group, axis=0), (h_BPD[:, -1:], cache))
  weights_BN = valid_BT[:, p:].astype(jnp.float32)
  h_BND, _, rest = decoder.forward(
      tokens_BT[:, p:], positions_BT[:, p:], valid_BT, cache, p,
      routes_BTLK=None if routes_BTLK is None else routes_BTLK[:, p:], weights_BT=weights_BN,
      shared=True)
  routing = None if first is None else pooled_stats(
      first, weights_BP.sum(), rest, weights_BN.sum(),
      jnp.concatenate([jnp.repeat(first.ids, group, axis=0), rest.ids], axis=1))
  return jnp.concatenate([h_B1D, h_BND], axis=1), routing


def prefix_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len: int, group: int,
                    routes_BTLK=None, temperature: float = 1.0):
  """`forward.routed_logprobs` of the completion slots (log-probs, entropies [B, N], the
  router's loss and metrics), every `group` consecutive rows' prompt run once."""
  model = model_of(graphdef, params)
  h_BSD, routing = prefix_states(model.decoder, tokens_BT, valid_BT, prompt_len, group,
                                 routes_BTLK)
  logp_BN, entropy_BN = chunked_logprobs(
      h_BSD[:, :-1], model.head_VD(), tokens_BT[:, prompt_len:],
      softcap=model.cfg.logit_softcap, temperature=temperature)
  loss, metrics = router_loss(model.cfg, routing, compared=routes_BTLK is not None)
  return logp_BN, entropy_BN, loss, metrics


def completion_pass(graphdef, params, tokens_BT, valid_BT, prompt_len: int, routes_BTLK=None,
                    temperature: float = 1.0, group: int = 1):
  """`forward.routed_logprobs` of the completion slots (log-probs, entropies [B, N], the
  router's loss and metrics); `group` > 1 (`RLConfig.share_group`): `prefix_logprobs`."""
  if group > 1:
    return prefix_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len, group,
                           routes_BTLK, temperature)
  return routed_logprobs(graphdef, params, tokens_BT, valid_BT, start=prompt_len - 1,
                         routes_BTLK=routes_BTLK, temperature=temperature)


def values_pass(graphdef, params, tokens_BT, valid_BT, prompt_len: int, group: int = 1):
  """A critic's values [B, N] (`forward.completion_values`); `group` > 1: `prefix_values`."""
  if group > 1:
    return prefix_values(graphdef, params, tokens_BT, valid_BT, prompt_len, group)
  return completion_values(graphdef, params, tokens_BT, valid_BT, prompt_len)


def prefix_values(graphdef, params, tokens_BT, valid_BT, prompt_len: int, group: int):
  """`forward.completion_values` (a critic's values [B, N], read where each completion token
  is predicted), every `group` consecutive rows' prompt run once."""
  model = model_of(graphdef, params)
  h_BSD, _ = prefix_states(model.decoder, tokens_BT, valid_BT, prompt_len, group)
  return model.values(h_BSD[:, :-1])


def prefix_sequence_logprobs(graphdef, params, tokens_BT, valid_BT, completion_mask_BN,
                             prompt_len: int, group: int):
  """`forward.sequence_logprobs` (the response tokens' log-probs summed per row, [B]), every
  `group` consecutive rows' prompt run once (DPO's chosen and rejected response: 2)."""
  logp_BN = prefix_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len, group)[0]
  return (logp_BN * completion_mask_BN).sum(axis=1)


def prefix_scores(graphdef, params, tokens_BT, valid_BT, prompt_len: int, group: int):
  """`forward.sequence_scores` (a reward model's score of each row, read at its last valid
  token), every `group` consecutive rows' prompt run once."""
  model = model_of(graphdef, params)
  h_BSD, _ = prefix_states(model.decoder, tokens_BT, valid_BT, prompt_len, group)
  last_B = valid_BT[:, prompt_len:].sum(axis=1)  # (0: the prompt's last token)
  return jnp.take_along_axis(model.values(h_BSD), last_B[:, None], axis=1)[:, 0]
