"""Exact decoding: each token drawn from the trainer's own distribution, bit for bit.

Two routes (`rl.rollout.exact`): "pass", below, decodes by the trainer's pass; "replay"
(train/updates/replay.py) has the trainer score in the decode loop's shapes instead, and the
sampler here draws in that loop (`replay_generate` there).

The engine (sampler/engine.py) decodes a token per step over a KV cache: each step's products
have B rows where the trainer's scoring pass has B x T, and XLA rounds a row's result by the
shape it is computed in (`benchmarks.batch_invariance`), so the sampler's log-probs and the
trainer's part by ULPs (`benchmarks.logprob_mismatch`). Here each step runs the trainer's pass
itself (train/updates/forward.py `completion_logprobs`: the decoder over the whole [B, T] buffer,
the LM head in the same chunks of positions) over the tokens drawn so far, the later slots empty
and masked (masked keys add exact zeros), and draws the next token from that distribution at
the sampling temperature. The log-prob it reports is the one the trainer's pass computes for the
token, in the same formula (the target's logit picked out of its chunk, less the chunk's
log-sum-exp), so it equals the trainer's `pi_old` bit for bit where both run in the same pieces
of rows (`pieces`: the scoring pass's `rollouts // pass_rows`, strided as `map_minibatches`
cuts them), in float32 and bfloat16. Its price is the trainer's pass once per new token
(docs/benchmarks.md: `trainer_decode_cost`). Sampling is plain temperature sampling (top-k or
top-p would draw from a distribution the trainer does not score), rows ending at EOS; a dense or
a mixture-of-experts model with its own routes (no replay: nothing to replay).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.lm_head import _chunk_stats, _split, chunk_length
from jaxrl.models.rope import positions_from_valid
from sampler.engine import Rollout
from sampler.methods import SamplingConfig
from train.updates.batching import map_minibatches
from train.updates.replay import replay_generate, stop_ids
from train.updates.state import model_of


def _next_token(graphdef, params, tokens_BT, valid_BT, gumbel_BV, i, *, prompt_len: int,
                temperature: float):
  """(the token each row draws at completion slot `i`, its log-prob): the trainer's pass over
  the buffer, the head's chunk that holds position `prompt_len - 1 + i` as the pass cuts it."""
  model = model_of(graphdef, params)
  h_BTD, _, _ = model.decoder.forward(tokens_BT, positions_from_valid(valid_BT), valid_BT)
  h_BND = h_BTD[:, prompt_len - 1:-1]
  b, length, _ = h_BND.shape
  head_VD = model.head_VD()
  n = chunk_length(b, length, head_VD.shape[0])
  h_BnD = jax.lax.dynamic_index_in_dim(_split(h_BND, n), i // n, keepdims=False)
  no_targets = jnp.zeros(h_BnD.shape[:2], jnp.int32)  # (the stats' log-probs are not read)
  logits_BnV, lse_Bn = _chunk_stats(h_BnD, head_VD.astype(h_BND.dtype), no_targets,
                                    float(model.cfg.logit_softcap), float(temperature))[:2]
  logits_BV = jax.lax.dynamic_index_in_dim(logits_BnV, i % n, 1, keepdims=False)
  lse_B = jax.lax.dynamic_index_in_dim(lse_Bn, i % n, 1, keepdims=False)
  tok_B = jnp.argmax(logits_BV + gumbel_BV, axis=-1).astype(jnp.int32)  # (Gumbel-max)
  hit_BV = jnp.arange(logits_BV.shape[-1]) == tok_B[:, None]
  return tok_B, jnp.where(hit_BV, logits_BV, 0.0).sum(-1) - lse_B


def exact_step(graphdef, params, tokens_BT, valid_BT, done_B, key, i, *, prompt_len: int,
               cfg: SamplingConfig, pieces: int = 1):
  """One exact decode step at completion slot `i` (a device int): (tokens, valid, done, the
  drawn tokens' log-probs [B], i + 1); rows already `done` keep PAD there, masked. Pure: jit it
  on the trainer's mesh as the scoring pass is (the role's rules), so the pieces match."""
  vocab = model_of(graphdef, params).head_VD().shape[0]
  gumbel_BV = jax.random.gumbel(jax.random.fold_in(key, i), (tokens_BT.shape[0], vocab))
  draw = lambda mb: _next_token(graphdef, params, *mb, i, prompt_len=prompt_len,  # noqa: E731
                                temperature=cfg.temperature)
  tok_B, logp_B = map_minibatches(draw, (tokens_BT, valid_BT, gumbel_BV), pieces)
  tok_B = jnp.where(done_B, cfg.pad_id, tok_B)
  slot = prompt_len + i
  tokens_BT = jax.lax.dynamic_update_index_in_dim(tokens_BT, tok_B, slot, 1)
  valid_BT = jax.lax.dynamic_update_index_in_dim(valid_BT, ~done_B, slot, 1)
  ends_B = jnp.isin(tok_B, jnp.asarray(stop_ids(cfg), jnp.int32))
  return tokens_BT, valid_BT, done_B | ends_B, jnp.where(done_B, 0.0, logp_B), i + 1


def exact_generate(step, prompt_tokens_BP, prompt_valid_BP, key, *,
                   cfg: SamplingConfig) -> Rollout:
  """Rows of `cfg.max_new_tokens` completion slots (the prompts on the device already),
  decoded by `step` (`exact_step` jitted, all but the arrays bound: (tokens, valid, done, key,
  i) -> ...), one call per slot: the trainer's pass compiled once, the slot counted on the
  device (nothing from the host)."""
  stop_ids(cfg)
  b, n = prompt_tokens_BP.shape[0], cfg.max_new_tokens
  tokens_BT = jnp.pad(prompt_tokens_BP, ((0, 0), (0, n)), constant_values=cfg.pad_id)
  valid_BT = jnp.pad(prompt_valid_BP, ((0, 0), (0, n)))
  done_B, i, logps = jnp.zeros((b,), bool), jnp.zeros((), jnp.int32), []
  for _ in range(n):
    tokens_BT, valid_BT, done_B, logp_B, i = step(tokens_BT, valid_BT, done_B, key, i)
    logps.append(logp_B)
  mask_BN = valid_BT[:, -n:]
  return Rollout(tokens_BT=tokens_BT, valid_BT=valid_BT, completion_mask_BN=mask_BN,
                 logprobs_BN=jnp.stack(logps, axis=1), lengths_B=mask_BN.sum(axis=1))


class ExactSampler:
  """`rl.rollout.exact`: a step's rollouts decoded on the actor's mesh from the actor's own
  parameters (the sampler's copy is not read), by the trainer's pass ("pass") or in the loop
  the trainer replays ("replay"), `group_size` rows per prompt (group-major), in the trainer's
  passes' pieces (`rollouts // pass_rows`; "replay": `RLConfig.replay_pieces`). (Replays of
  the engine's own schedule: train/loop/engine_replay.py.)"""

  def __init__(self, rl, role, sampling: SamplingConfig, transfers):
    """`role`: the actor; `sampling`: the RL sampler's settings; `transfers`: the run's named
    host transfers (the prompts go up)."""
    self.role, self.sampling, self.group, self.transfers = role, sampling, rl.group_size, transfers
    self.pieces = rl.rollouts // rl.pass_rows
    self._steps: dict[int, object] = {}  # "pass": prompt width -> its jitted step
    self._replay = None  # "replay": one program, traced per prompt width
    if rl.rollout.exact == "replay":
      self._replay = role.jit(functools.partial(replay_generate, role.graphdef, cfg=sampling,
                                                pieces=rl.replay_pieces,
                                                group=rl.replay_group))

  def sample(self, prompts: dict, key) -> Rollout:
    rows = lambda x: np.repeat(x, self.group, axis=0)  # noqa: E731
    host = (rows(prompts["prompt_tokens"]), rows(prompts["prompt_valid"]))
    tokens_BP, valid_BP = self.transfers.to_device(host, self.role.batch_shardings(host),
                                                   "prompts")
    if self._replay is not None:
      return self._replay(self.role.params, tokens_BP, valid_BP, key)
    width = tokens_BP.shape[1]
    if width not in self._steps:
      self._steps[width] = self.role.jit(functools.partial(
          exact_step, self.role.graphdef, prompt_len=width, cfg=self.sampling,
          pieces=self.pieces))
    step = functools.partial(self._steps[width], self.role.params)
    return exact_generate(step, tokens_BP, valid_BP, key, cfg=self.sampling)
