"""The trainer's log-probs in the sampler's shapes: `rl.rollout.exact="replay"`.

XLA rounds a row's products and reductions by the shape they are computed in, so a decode step
(B rows, one query over a KV cache) and the trainer's pass over the whole sequence (B x T rows,
T queries) give a token log-probs a few ULPs apart (docs/benchmarks.md,
`benchmarks.logprob_mismatch`). Here both sides run one decode loop: a prefill of the prompt
slots, then a `lax.scan` of one-token steps over a KV cache of every slot (the rows layout), the
LM head and the log-softmax at the sampling temperature per step. The sampler draws each token
in it (`replay_generate`, on the trainer's mesh or the sampler's); the trainer's scoring passes
and its update feed the drawn tokens back (teacher-forced) through the same loop, so in float32
every log-prob is the sampler's bit for bit, and a gradient program's forward rounds as the
plain one (`decode_replay` measured 0). Only the values need the loop: their gradient is the
whole-sequence pass's (`ride`), since T backward steps of B rows cost about twice one
backward pass of B x T rows (docs/benchmarks.md). The loop is a forward alone (its memory the KV
cache's), so both sides run it a minibatch of rows at a time (`RLConfig.replay_pieces`), the
sampler's batch shape. In sync mode the sampler drew at the very weights the trainer then holds,
so its log-probs are the trainer's own, and the loop runs only where the weights moved (the later
minibatches) or to check (train/loop/scoring.py).

Rows that ended (EOS) carry PAD in their later slots, invalid; the mask every query sees is the
same on both sides (keys at or before its slot), so the sampler's growing `valid` and the
trainer's final one give the same numbers. A mixture of experts' sampler records each token's
experts in the loop; the trainer's loop and the update's pass (its gradient and router loss)
replay or compare them as they do the engine's (`model.moe.routing_replay`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models.attention import init_kv_cache
from jaxrl.models.decoding import ROUTE_DTYPE
from jaxrl.models.layouts import ROWS
from jaxrl.models.rope import positions_from_valid
from sampler.engine import Rollout
from sampler.methods import SamplingConfig
from train.updates.batching import map_minibatches
from train.updates.state import model_of


def decode_loop(graphdef, params, tokens_BT, valid_BT, *, prompt_len: int, temperature: float,
                draw=None, group: int = 1, routes_BTLK=None):
  """(tokens [B, T], valid [B, T], log-probs [B, N] of the N = T - prompt_len completion slots,
  a mixture of experts' routes [B, T, L, k] or None): each token's experts per layer as the
  loop routed them (-1 where not routed: the prefill's last layer runs for the last prompt
  position alone), for the update's pass to replay or compare as the engine's
  (`model.moe.routing_replay`). `draw(logp_BV, i, done_B) -> (tokens_B, ends_B)` picks slot
  i's tokens from its log-probs (the sampler: `valid` grows, rows that ended keep PAD);
  without it the buffer's tokens are fed (the trainer), with `routes_BTLK` the experts they were
  drawn with. `group`: consecutive rows share their prompt (`RLConfig.replay_group`): each
  prompt is prefilled once, its cache then repeated."""
  model, (b, t) = model_of(graphdef, params), tokens_BT.shape
  valid_BS = jnp.pad(valid_BT, ((0, 0), (0, 1)))  # (a slot for the last step's unused forward)
  tokens_BS = jnp.pad(tokens_BT, ((0, 0), (0, 1)))
  prompts = lambda x: x[::group, :prompt_len]  # noqa: E731
  given = lambda at: None if routes_BTLK is None else at(routes_BTLK)  # noqa: E731
  h_B1D, cache, routing = model.decoder.forward(
      prompts(tokens_BS), prompts(positions_from_valid(valid_BS)), valid_BS[::group],
      init_kv_cache(model.cfg, b // group, t + 1), 0, last_only=True,
      routes_BTLK=given(prompts))
  routes = () if routing is None else (routing.ids.astype(ROUTE_DTYPE),)  # [B, P, L, k]
  h_B1D, cache, routes = jax.tree.map(lambda x: jnp.repeat(x, group, axis=0),
                                      (h_B1D, cache, routes))

  def step(carry, i):
    h_B1D, cache, tokens_BS, valid_BS, done_B = carry
    slot = prompt_len + i
    logits_BV = ROWS.next_logits(h_B1D[:, -1:], model.head_VD(), model.cfg.logit_softcap)
    logp_BV = jax.nn.log_softmax(logits_BV / temperature)
    if draw is None:
      tok_B = jax.lax.dynamic_index_in_dim(tokens_BS, slot, 1, keepdims=False)
    else:
      tok_B, ends_B = draw(logp_BV, i, done_B)
      tokens_BS = jax.lax.dynamic_update_index_in_dim(tokens_BS, tok_B, slot, 1)
      valid_BS = jax.lax.dynamic_update_index_in_dim(valid_BS, ~done_B, slot, 1)
      done_B = done_B | ends_B
    pos_B1 = jax.lax.dynamic_slice_in_dim(positions_from_valid(valid_BS), slot, 1, 1)
    h_B1D, cache, routing = model.decoder.forward(
        tok_B[:, None], pos_B1, valid_BS, cache, slot,
        routes_BTLK=given(lambda r: jax.lax.dynamic_slice_in_dim(r, slot, 1, 1)))
    logp_B = jnp.take_along_axis(logp_BV, tok_B[:, None], 1)[:, 0]
    ids = () if routing is None else (routing.ids[:, 0].astype(ROUTE_DTYPE),)  # [B, L, k]
    return (h_B1D, cache, tokens_BS, valid_BS, done_B), (logp_B, ids)
  carry = (h_B1D, cache, tokens_BS, valid_BS, jnp.zeros((b,), bool))
  (_, _, tokens_BS, valid_BS, _), (logp_NB, ids) = jax.lax.scan(
      step, carry, jnp.arange(t - prompt_len))
  routes_BTLK = None if not routes else jnp.concatenate(
      [routes[0], jnp.moveaxis(ids[0], 0, 1)], axis=1)
  return tokens_BS[:, :t], valid_BS[:, :t], logp_NB.T, routes_BTLK


def replayed_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len: int,
                      temperature: float = 1.0, group: int = 1, routes_BTLK=None):
  """The completion tokens' log-probs [B, N] as the sampler computed them when it drew them
  (`decode_loop`, teacher-forced, `group` rows a prompt): the scoring passes'
  `completion_logprobs` for `exact="replay"`; a mixture of experts' recorded `routes_BTLK`
  replayed or compared as the model says (`model.moe.routing_replay`)."""
  return decode_loop(graphdef, params, tokens_BT, valid_BT, prompt_len=prompt_len,
                     temperature=temperature, group=group, routes_BTLK=routes_BTLK)[2]


def minibatch_values(graphdef, params, tokens_BT, valid_BT, prompt_len: int,
                     temperature: float, known_BN=None, known=False, group: int = 1,
                     routes_BTLK=None):
  """A minibatch's log-probs [B, N] as the sampler computed them (`replayed_logprobs`, all its
  rows at once as the sampler drew them: `RLConfig.replay_pieces`), or `known_BN` where `known`:
  the trainer's own at these very weights (the old log-probs, before the update's first
  minibatch: a Python True compiles no loop), so the loop need not run. A forward alone,
  outside the gradient; `routes_BTLK`: the sampler's experts, replayed or compared."""
  loop = lambda: replayed_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len,  # noqa
                                   temperature, group, routes_BTLK)
  if known_BN is None or known is False:
    return loop()
  return known_BN if known is True else jax.lax.cond(known, lambda: known_BN, loop)


def ride(values_BN, pass_BN):
  """The update's log-probs under `exact="replay"`: the values `values_BN` (`minibatch_values`:
  the sampler's), the gradient the whole-sequence pass's `pass_BN` (the same function rounded
  as one pass: T backward steps of B rows cost twice one backward pass of B x T rows), as
  `values + (pass - pass)`: exactly the values, the pass's gradient."""
  return jax.lax.stop_gradient(values_BN) + (pass_BN - jax.lax.stop_gradient(pass_BN))


def stop_ids(cfg: SamplingConfig) -> tuple[int, ...]:
  """The tokens that end a row: EOS and single-token stop sequences (ValueError for what exact
  decoding does not sample: top-k, top-p, longer stop sequences, stop strings)."""
  if cfg.method != "temperature" or cfg.top_k or cfg.top_p < 1.0 or cfg.stop_text is not None \
      or any(len(s) != 1 for s in cfg.stop_sequences):
    raise ValueError("exact decoding samples at a temperature, rows ending at EOS or a stop "
                     "token (no top-k, top-p, stop strings: the trainer scores every token)")
  return () if cfg.ignore_eos else (cfg.eos_id, *(s[0] for s in cfg.stop_sequences))


def replay_generate(graphdef, params, prompt_tokens_BP, prompt_valid_BP, key, *,
                    cfg: SamplingConfig, pieces: int = 1, group: int = 1) -> Rollout:
  """`exact="replay"`: rows of `cfg.max_new_tokens` slots drawn in the decode loop the trainer
  replays (`decode_loop`), in `pieces` strided pieces of rows as the trainer's passes
  hold them, `group` consecutive rows of a piece sharing a prompt (prefilled once); each row's
  Gumbel noise from its own key (the draw does not depend on the pieces).
  Pure: jit it on the actor's mesh (sync) or on the sampler's, as many rows a device (async)."""
  b, p, n = *prompt_tokens_BP.shape, cfg.max_new_tokens
  stops = jnp.asarray(stop_ids(cfg), jnp.int32)

  def rows(mb):
    tokens_BT, valid_BT, keys_B = mb

    def draw(logp_BV, i, done_B):
      gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, i),
                                                       logp_BV.shape[-1:]))(keys_B)
      tok_B = jnp.argmax(logp_BV + gumbel_BV, axis=-1).astype(jnp.int32)
      tok_B = jnp.where(done_B, cfg.pad_id, tok_B)
      return tok_B, jnp.isin(tok_B, stops)
    tokens_BT, valid_BT, logp_BN, routes_BTLK = decode_loop(
        graphdef, params, tokens_BT, valid_BT, prompt_len=p, temperature=cfg.temperature,
        draw=draw, group=group)
    return tokens_BT, valid_BT, jnp.where(valid_BT[:, p:], logp_BN, 0.0), routes_BTLK
  tokens_BT = jnp.pad(prompt_tokens_BP, ((0, 0), (0, n)), constant_values=cfg.pad_id)
  valid_BT = jnp.pad(prompt_valid_BP, ((0, 0), (0, n)))
  tokens_BT, valid_BT, logp_BN, routes_BTLK = map_minibatches(
      rows, (tokens_BT, valid_BT, jax.random.split(key, b)), pieces)
  mask_BN = valid_BT[:, p:]
  return Rollout(tokens_BT=tokens_BT, valid_BT=valid_BT, completion_mask_BN=mask_BN,
                 logprobs_BN=logp_BN, lengths_B=mask_BN.sum(axis=1), routes_BTLK=routes_BTLK)
