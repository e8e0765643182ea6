"""Experience: one RL batch as device arrays, and the pure function that assembles it.

The rollout's tokens never visit the host on their way to the update: the sampler's arrays move
device to device to the scorers' meshes (reference, critic, reward model) and to the trainer's,
where `make_experience` computes KL and advantages. Only the completions' token ids are fetched
for the host verifier (train/task/reward.py, `Judge`), and its rewards come back as one [B] array.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jaxrl.algos import KL_ESTIMATORS
from jaxrl.algos.advantages import overlong_penalty
from jaxrl.config_rl import RLConfig
from train.updates.packing import Pack


@flax.struct.dataclass
class Experience:
  tokens_BT: jax.Array  # prompt (P, left-padded) followed by N completion slots
  valid_BT: jax.Array  # prompt validity, then the completion mask
  completion_mask_BN: jax.Array
  sampler_logprobs_BN: jax.Array  # mu: what the sampler drew with
  ref_logprobs_BN: jax.Array
  advantages_BN: jax.Array
  # The trainer's policy before this update (exact sync rollouts: the sampler's, the same
  # numbers); None when the update's own (detached) log-probs are these (one minibatch:
  # RLConfig.carries_old_logprobs).
  old_logprobs_BN: jax.Array | None = None
  old_values_BN: jax.Array | None = None  # critic (gae) only
  returns_BN: jax.Array | None = None
  # The completion mask less the rows the policy loss skips (overlong_filter); None: all of it.
  loss_mask_BN: jax.Array | None = None
  # A mixture of experts: each token's experts in the sampler (replayed or compared).
  routes_BTLK: jax.Array | None = None
  # `rl.batching.pack_length`: the forward passes' packed rows, per piece
  # (train/updates/packing.py).
  pack: Pack | None = None

  @property
  def policy_mask_BN(self) -> jax.Array:
    return self.completion_mask_BN if self.loss_mask_BN is None else self.loss_mask_BN

  @property
  def prompt_len(self) -> int:
    return self.tokens_BT.shape[1] - self.completion_mask_BN.shape[1]


CRITIC_FIELDS = ("tokens_BT", "valid_BT", "completion_mask_BN", "old_values_BN", "returns_BN")


def critic_batch(exp) -> Experience:
  """What the critic's update reads (train/updates/policy.py `critic_update`): the fields
  `CRITIC_FIELDS` of `exp` (an Experience, or a dict of them), the others None."""
  get = exp.get if isinstance(exp, dict) else functools.partial(getattr, exp)
  return Experience(*(get(k) for k in CRITIC_FIELDS[:3]), None, None, None,
                    old_values_BN=get("old_values_BN"), returns_BN=get("returns_BN"))


def advantages(rewards_B, mask_BN, kl_BN=None, values_BN=None, *, cfg: RLConfig):
  """Per-token advantages from sequence rewards by `cfg.advantage` (its entry reading the
  section's hyperparameters): `(adv_BN, raw_BN)`, where `raw_BN` is before `advantage.whiten`
  (normalising over the batch's valid tokens); with a critic the value targets are
  `raw_BN + values_BN`. With `cfg.kl.mode == "reward"`, `kl.coef * kl_BN` is taken from the
  per-token rewards (reinforce_pp, PPO); an estimator with a critic needs its `values_BN`."""
  mask_BN = mask_BN.astype(jnp.float32)
  # kl_coef: the KL folded into the rewards (kl.mode="reward"; in the loss, policy_loss adds it)
  available = {**vars(cfg.advantage), "group_size": cfg.group_size, "kl_BN": kl_BN,
               "values_BN": values_BN, "kl_coef": cfg.kl.coef if cfg.kl.mode == "reward" else 0.0}
  raw_BN = cfg.advantage.entry(rewards_B, mask_BN, available)
  adv_BN = raw_BN
  if cfg.advantage.whiten:
    count = jnp.maximum(mask_BN.sum(), 1.0)
    mean = (raw_BN * mask_BN).sum() / count
    std = jnp.sqrt((((raw_BN - mean) * mask_BN)**2).sum() / count)
    adv_BN = (raw_BN - mean) / (std + 1e-6) * mask_BN
  return adv_BN, raw_BN


def truncated(rollout, budget: int, stop_ids: tuple[int, ...]) -> jax.Array:
  """[B] the rows cut off at the budget: every slot used and the last token not a stop token
  (EOS, `<|eot_id|>`, ...; a row that ends on its last slot is finished, not truncated)."""
  n = rollout.completion_mask_BN.shape[1]
  last_B1 = jnp.maximum(rollout.lengths_B - 1, 0).astype(jnp.int32)[:, None]
  last_B = jnp.take_along_axis(rollout.tokens_BT[:, -n:], last_B1, axis=1)[:, 0]
  stopped_B = (jnp.isin(last_B, jnp.asarray(stop_ids, last_B.dtype)) if stop_ids
               else jnp.zeros(last_B.shape, bool))
  return (rollout.lengths_B >= budget) & ~stopped_B


def make_experience(rollout, rewards_B, old_BN, ref_BN, values_BN, *, cfg: RLConfig,
                    stop_ids: tuple[int, ...] = ()):
  """Per-token KL to the reference (when the rewards carry it) and advantages from the
  sequence rewards (with DAPO's soft overlong penalty when `cfg.dapo.overlong_buffer`);
  (Experience, metrics). `rollout` is the sampler's `Rollout`, already moved onto this mesh;
  `old_BN` is None when the update computes it itself. A response cut off at the budget
  (`truncated`: `cfg.rollout.max_new_tokens` used, the last token none of `stop_ids`) is
  overlong; with `cfg.dapo.overlong_filter` the policy loss skips it (DAPO filters truncated
  samples)."""
  mask_BN = rollout.completion_mask_BN
  maskf_BN = mask_BN.astype(jnp.float32)
  budget, dapo = cfg.rollout.max_new_tokens, cfg.dapo
  overlong_B = truncated(rollout, budget, stop_ids)
  scored_B = rewards_B
  if dapo.overlong_buffer:
    scored_B = rewards_B + overlong_penalty(rollout.lengths_B, budget=budget,
                                            buffer=dapo.overlong_buffer,
                                            factor=dapo.overlong_penalty)
  # The policy's own tokens (multi-turn: not the environment's replies) carry KL and advantages.
  own_BN = mask_BN if rollout.loss_mask_BN is None else rollout.loss_mask_BN
  kl_BN = None
  if cfg.kl.mode == "reward":
    kl_BN = KL_ESTIMATORS[cfg.kl.estimator](old_BN, ref_BN) * own_BN.astype(jnp.float32)
  if values_BN is not None:
    values_BN = values_BN * maskf_BN
  adv_BN, raw_BN = advantages(scored_B, own_BN, kl_BN, values_BN, cfg=cfg)
  loss_mask_BN = rollout.loss_mask_BN  # None: every completion token (a single turn)
  if dapo.overlong_filter:
    loss_mask_BN = (mask_BN if loss_mask_BN is None else loss_mask_BN) & ~overlong_B[:, None]
  experience = Experience(
      tokens_BT=rollout.tokens_BT, valid_BT=rollout.valid_BT, completion_mask_BN=mask_BN,
      sampler_logprobs_BN=rollout.logprobs_BN, old_logprobs_BN=old_BN, ref_logprobs_BN=ref_BN,
      advantages_BN=adv_BN, loss_mask_BN=loss_mask_BN, old_values_BN=values_BN,
      returns_BN=None if values_BN is None else raw_BN + values_BN,
      routes_BTLK=rollout.routes_BTLK)
  lengths_B = maskf_BN.sum(axis=1)
  # The share of the scored and trained [B, T] slots that hold no token (prompt padding and
  # completion slots after a row ended), after trimming to the batch's buckets.
  metrics = {"reward_mean": scored_B.mean(), "response_len": lengths_B.mean(),
             "response_tokens": lengths_B.sum(),
             "overlong_frac": overlong_B.astype(jnp.float32).mean(),
             "padding_fraction": 1.0 - rollout.valid_BT.astype(jnp.float32).mean()}
  return experience, metrics


@functools.partial(jax.jit, static_argnums=1)
def trim_rollout(rollout, n: int):
  """The rollout's first `n` completion slots (every row has ended by then), where it lives."""
  p = rollout.tokens_BT.shape[1] - rollout.completion_mask_BN.shape[1]
  loss_mask = None if rollout.loss_mask_BN is None else rollout.loss_mask_BN[:, :n]
  routes = None if rollout.routes_BTLK is None else rollout.routes_BTLK[:, :p + n]
  return rollout.replace(tokens_BT=rollout.tokens_BT[:, :p + n],
                         valid_BT=rollout.valid_BT[:, :p + n],
                         completion_mask_BN=rollout.completion_mask_BN[:, :n],
                         logprobs_BN=rollout.logprobs_BN[:, :n], loss_mask_BN=loss_mask,
                         routes_BTLK=routes)


@functools.partial(jax.jit, static_argnums=2)
def combine_rollouts(rollouts: tuple, rows_K, rows_sharding):
  """Rows `rows_K` of the rollouts stacked in order (DAPO's dynamic sampling keeps the groups of
  several prompt batches): prompts left-padded to the longest one, laid out as `rows_sharding`
  (the sampler's batch split) where the rollouts live."""
  p = max(r.tokens_BT.shape[1] - r.completion_mask_BN.shape[1] for r in rollouts)

  def widen(r):
    pad = ((0, 0), (p - (r.tokens_BT.shape[1] - r.completion_mask_BN.shape[1]), 0))
    routes = None if r.routes_BTLK is None else jnp.pad(r.routes_BTLK, pad + ((0, 0),) * 2,
                                                        constant_values=-1)
    return r.replace(tokens_BT=jnp.pad(r.tokens_BT, pad), valid_BT=jnp.pad(r.valid_BT, pad),
                     routes_BTLK=routes)

  whole = jax.tree.map(lambda *xs: jnp.concatenate(xs), *map(widen, rollouts))
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(jnp.take(x, rows_K, axis=0),
                                                                 rows_sharding), whole)
