"""Advantage estimators, selected by name from `ADVANTAGES`:

  fn(rewards_B, mask_BN, *, ...) -> adv_BN

each reading the keyword-only parameters it declares (jaxrl/registry.py) from what the
caller has: the inputs `group_size`, `kl_BN`, `kl_coef`, `values_BN` and the hyperparameters of
the config's `rl.advantage` section (`gamma`, `lam`), by those names. An entry (`Advantage`)
also says whether its estimator needs a critic (one is then trained) and whether it takes the KL in
its rewards (`rl.kl.mode` must then be "reward").

Rows are group-major (rows [g*n, (g+1)*n) share a prompt); `rewards_B` is the sequence reward,
credited at the last valid token; masked tokens get advantage 0.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.registry import declared


def _per_token(adv_B, mask_BN):
  return adv_B[:, None] * mask_BN


def _grouped(rewards_B, group_size):
  r_GN = rewards_B.reshape(-1, group_size).astype(jnp.float32)
  return r_GN, r_GN.mean(axis=1, keepdims=True)


def grpo(rewards_B, mask_BN, *, group_size, eps=1e-6):
  """(r - group mean) / (group std + eps), std unbiased; groups of one get advantage 0."""
  if group_size == 1:
    return jnp.zeros(mask_BN.shape, jnp.float32)
  r_GN, mean_G1 = _grouped(rewards_B, group_size)
  centred_GN = r_GN - mean_G1
  std_G1 = jnp.sqrt((centred_GN**2).sum(axis=1, keepdims=True) / (group_size - 1))
  return _per_token((centred_GN / (std_G1 + eps)).reshape(-1), mask_BN)


def dr_grpo(rewards_B, mask_BN, *, group_size):
  """Dr. GRPO: r - group mean, no std normalisation (pair with a length-free aggregation)."""
  r_GN, mean_G1 = _grouped(rewards_B, group_size)
  return _per_token((r_GN - mean_G1).reshape(-1), mask_BN)


def rloo(rewards_B, mask_BN, *, group_size):
  """Leave-one-out baseline: r_i - mean of the other samples of the prompt (0 for groups of 1)."""
  if group_size == 1:
    return jnp.zeros(mask_BN.shape, jnp.float32)
  r_GN, _ = _grouped(rewards_B, group_size)
  others_GN = (r_GN.sum(axis=1, keepdims=True) - r_GN) / (group_size - 1)
  return _per_token((r_GN - others_GN).reshape(-1), mask_BN)


def token_rewards(rewards_B, mask_BN, kl_BN=None, kl_coef=0.0):
  """Sequence reward on the last valid token, minus kl_coef * KL on every token."""
  n = mask_BN.shape[1]
  last_B = jnp.maximum(mask_BN.sum(axis=1).astype(jnp.int32) - 1, 0)
  r_BN = jax.nn.one_hot(last_B, n) * rewards_B[:, None] * (mask_BN.sum(axis=1, keepdims=True) > 0)
  if kl_BN is not None:
    r_BN = r_BN - kl_coef * kl_BN
  return r_BN * mask_BN


def discounted_returns(r_BN, mask_BN, gamma):
  def step(carry_B, x):
    r_B, m_B = x
    carry_B = (r_B + gamma * carry_B) * m_B
    return carry_B, carry_B

  _, ret_NB = jax.lax.scan(step, jnp.zeros(r_BN.shape[:1]), (r_BN.T, mask_BN.T), reverse=True)
  return ret_NB.T


def reinforce_pp(rewards_B, mask_BN, *, kl_BN=None, kl_coef=0.0, gamma=1.0, eps=1e-6):
  """REINFORCE++: KL folded into per-token rewards, returns-to-go, normalised over the batch."""
  mask = mask_BN.astype(jnp.float32)
  ret_BN = discounted_returns(token_rewards(rewards_B, mask, kl_BN, kl_coef), mask, gamma)
  count = jnp.maximum(mask.sum(), 1.0)
  mean = (ret_BN * mask).sum() / count
  var = (((ret_BN - mean) * mask)**2).sum() / count
  return (ret_BN - mean) / (jnp.sqrt(var) + eps) * mask


def gae(rewards_B, mask_BN, *, values_BN, kl_BN=None, kl_coef=0.0, gamma=1.0, lam=0.95):
  """Generalised advantage estimation with a critic; returns = advantages + values."""
  mask = mask_BN.astype(jnp.float32)
  r_BN = token_rewards(rewards_B, mask, kl_BN, kl_coef)
  next_v_BN = jnp.concatenate([values_BN[:, 1:], jnp.zeros_like(values_BN[:, :1])], 1)
  next_v_BN = next_v_BN * jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], 1)
  delta_BN = (r_BN + gamma * next_v_BN - values_BN) * mask
  return discounted_returns(delta_BN, mask, gamma * lam)


@dataclasses.dataclass(frozen=True)
class Advantage:
  """An estimator (its keyword-only parameters: what it reads), whether it needs a critic's
  values (`values_BN`: a critic is trained beside the actor) and whether the KL must reach it
  folded into the rewards (`kl_BN`)."""
  fn: Callable
  critic: bool = False
  kl_in_reward: bool = False

  def __call__(self, rewards_B, mask_BN, available: Mapping):
    """Per-token advantages [B, N], taking from `available` what `fn` declares."""
    return self.fn(rewards_B, mask_BN, **declared(self.fn, available))


ADVANTAGES = {"grpo": Advantage(grpo), "dr_grpo": Advantage(dr_grpo), "rloo": Advantage(rloo),
              "reinforce_pp": Advantage(reinforce_pp, kl_in_reward=True),
              "gae": Advantage(gae, critic=True)}


# -- DAPO's reward and batch shaping -----------------------------------------------------------
def overlong_penalty(lengths_B, *, budget: int, buffer: int, factor: float = 1.0):
  """DAPO's soft overlong punishment, [B]: 0 up to `budget - buffer` tokens, then falling
  linearly to -factor at the budget ((budget - buffer - length) / buffer * factor)."""
  free = budget - buffer
  over_B = jnp.maximum(lengths_B.astype(jnp.float32) - free, 0.0)
  return -factor * jnp.minimum(over_B / max(buffer, 1), 1.0)


def informative_groups(rewards_B, group_size: int) -> np.ndarray:
  """[G] whether a prompt's group of rewards differs at all: DAPO's dynamic sampling keeps only
  those (a group of equal rewards has zero advantage under every group baseline). On the host,
  where the verifier's rewards are."""
  r_GN = np.asarray(rewards_B).reshape(-1, group_size)
  return np.any(r_GN != r_GN[:, :1], axis=1)
