"""The scoring passes over a rollout batch, jitted on a role's mesh: the log-probs of its
completions (the reference's and the actor's old ones, over the [B, T] batch or its packed rows)
and the critic's values (train/loop/scoring.py runs them; the reference apart's processes too,
train/loop/remote_scorers.py)."""
from __future__ import annotations

import functools

from jaxrl.config_rl import RLConfig
from train.updates.batching import map_minibatches
from train.updates.forward import sequence_scores
from train.updates.packing import packed_logprobs
from train.updates.prefix import completion_pass, prefix_scores, values_pass
from train.updates.replay import replayed_logprobs


def logprobs(graphdef, params, tokens_BT, valid_BT, routes_BTLK=None, *, prompt_len: int,
             temperature: float, group: int = 1):
  """The completion tokens' log-probs at RL's sampling `temperature` (`prefix.completion_pass`
  without its entropies; `group` > 1: every `group` rows' prompt run once)."""
  return completion_pass(graphdef, params, tokens_BT, valid_BT, prompt_len, routes_BTLK,
                         temperature, group)[0]


def replayed(graphdef, params, tokens_BT, valid_BT, routes_BTLK=None, *, prompt_len: int,
             temperature: float, group: int = 1):
  """`logprobs` in the sampler's decode loop (`rl.rollout.exact="replay"`: replay.py)."""
  return replayed_logprobs(graphdef, params, tokens_BT, valid_BT, prompt_len, temperature, group,
                           routes_BTLK)


def policy_logprobs(cfg: RLConfig):
  """`logprobs` at RL's sampling temperature (`rl.rollout.temperature`): the policy's and the
  reference's, for `scorer` (each prompt run once for a piece's rows of it: `share_group`)."""
  return functools.partial(logprobs, temperature=cfg.rollout.temperature,
                           group=cfg.share_group)


def critic_values(cfg: RLConfig):
  """The critic's values for `scorer` (`prefix.values_pass`, each prompt run once for a
  piece's rows of it: `share_group`)."""
  return functools.partial(values_pass, group=cfg.share_group)


def reward_scores(cfg: RLConfig, graphdef):
  """The reward model's scores of a rollout batch, (params, tokens [B, T], valid [B, T],
  completion mask [B, N]) -> [B]: with `batching.share_prefix` each prompt run once for its
  `group_size` rows (the whole batch in one pass: train/updates/prefix.py)."""
  def score(params, tokens_BT, valid_BT, mask_BN):
    if cfg.shares_prefix and cfg.group_size > 1:
      return prefix_scores(graphdef, params, tokens_BT, valid_BT,
                           tokens_BT.shape[1] - mask_BN.shape[1], cfg.group_size)
    return sequence_scores(graphdef, params, tokens_BT, valid_BT)
  return score


def logprob_scorer(cfg: RLConfig, role, actor: bool = False):
  """`scorer` of `policy_logprobs`; the `actor`'s under `rl.rollout.exact="replay"` replayed
  in the sampler's decode loop, in its pieces of rows (`RLConfig.replay_pieces`; the
  reference's need not be: the KL reads them, not the correction)."""
  if actor and cfg.rollout.exact == "replay":
    return scorer(cfg, role, functools.partial(replayed, temperature=cfg.rollout.temperature,
                                               group=cfg.replay_group), cfg.replay_pieces)
  return scorer(cfg, role, policy_logprobs(cfg))


def packed_scorer(cfg: RLConfig, role):
  """`scorer(cfg, role, policy_logprobs(cfg))` over packed rows: (params, tokens [B, T],
  completion mask [B, N], pack[, routes]) -> [B, N], piece p of the pack holding rows p, p + n,
  ... (as trees of shared prompts: `rl.batching.share_prefix`)."""
  n = cfg.rollouts // cfg.pass_rows

  def score(params, tokens_BT, mask_BN, pack, *routes):
    return map_minibatches(lambda mb: packed_logprobs(
        role.graphdef, params, *mb, temperature=cfg.rollout.temperature,
        tree=cfg.shares_prefix)[0],
        (tokens_BT, pack, mask_BN, *routes), n)
  return role.jit(score)


def scorer(cfg: RLConfig, role, fn, pieces: int = 0):
  """`fn` (logprobs, completion_values) over a rollout batch on `role`'s mesh, jitted:
  (params, tokens [B, T], valid [B, T], completion mask [B, N][, routes [B, T, L, k]]) ->
  [B, N], in the update's pieces of `cfg.pass_rows` rows (or in `pieces`); log-probs at RL's
  sampling temperature (`policy_logprobs`)."""
  n = pieces or cfg.rollouts // cfg.pass_rows

  def score(params, tokens_BT, valid_BT, mask_BN, *routes):  # the prompt length: the shapes
    p_len = tokens_BT.shape[1] - mask_BN.shape[1]
    return map_minibatches(lambda mb: fn(role.graphdef, params, *mb, prompt_len=p_len),
                           (tokens_BT, valid_BT, *routes), n)
  return role.jit(score)
