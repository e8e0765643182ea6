"""Rollout correction: per-token weights and masks for the gap between the sampler's policy mu
(what drew the tokens) and the trainer's pi_old (the same weights as the trainer computes them,
or newer ones in async mode), and the diagnostics of that gap.

Every piece works on the token log-ratio d = log pi_old - log mu, a constant for the gradient,
and multiplies the per-token policy loss, whichever loss it is (`POLICY_LOSSES`):

  tis_cap > 0   truncated importance sampling: weight min(pi_old / mu, cap)
  mask (a `ROLLOUT_MASKS` name, the band [mask_low, mask_high]):
       "token"      drop the tokens whose ratio pi_old / mu lies outside [low, high]
       "sequence"   drop the rows whose sequence ratio prod_t pi_old / mu lies outside it
       "geometric"  drop the rows whose geometric-mean ratio exp(mean_t d) lies outside it
       "icepop"     IcePop's two-sided token mask, with the kept tokens weighted by their
                    ratio: k(r) = r inside [low, high], 0 outside (min(r, cap) with tis_cap)

Dropped tokens keep their place in the loss's normaliser (they add 0), so a batch's other
tokens weigh the same whatever the mask removes. A loss that weights by pi_old / mu itself
(decoupled PPO: `PolicyLoss.behaviour_weighted`) gets that ratio here (`behaviour`), capped
and masked, never multiplied twice. (AIPO's own weight is min(pi / mu,
rho); TIS and the masks apply on top of it, as docs/algorithms.md says.)
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _inside(log_ratio, low: float, high: float):
  """low <= exp(log_ratio) <= high, compared in log space (a sequence ratio can overflow)."""
  return (log_ratio >= jnp.log(low)) & (log_ratio <= jnp.log(high))


def token_kept(d_BN, maskf_BN, low: float, high: float):
  return _inside(d_BN, low, high)


def sequence_kept(d_BN, maskf_BN, low: float, high: float):
  return jnp.broadcast_to(_inside(d_BN.sum(1), low, high)[:, None], d_BN.shape)


def geometric_kept(d_BN, maskf_BN, low: float, high: float):
  mean_B = d_BN.sum(1) / jnp.maximum(maskf_BN.sum(1), 1.0)
  return jnp.broadcast_to(_inside(mean_B, low, high)[:, None], d_BN.shape)


@dataclasses.dataclass(frozen=True)
class RolloutMask:
  """Which tokens a mask keeps, `kept(d_BN, maskf_BN, low, high)` from the log-ratios d, and
  whether the kept ones are weighted by their ratio (IcePop)."""
  kept: Callable
  weighted: bool = False


# `rl.correction.mask`; "none" keeps every token.
ROLLOUT_MASKS = {"none": None, "token": RolloutMask(token_kept),
                 "sequence": RolloutMask(sequence_kept),
                 "geometric": RolloutMask(geometric_kept),
                 "icepop": RolloutMask(token_kept, weighted=True)}


def rollout_weights(old_BN, mu_BN, mask_BN, *, mask: str = "none", mask_low: float = 0.5,
                    mask_high: float = 2.0, tis_cap: float = 0.0, behaviour: bool = False):
  """(weight_BN, kept_BN): the stop-gradient factor on each token's policy loss, and which
  valid tokens the mask kept (for the masked fraction). The keywords are the config's
  `rl.correction` fields; `behaviour`: the loss is weighted by r = pi_old / mu whatever the
  correction (decoupled PPO), so r is the weight before the cap and the mask, never squared.

  The weight is formed in log space: min(d, log cap) exponentiated only where the mask keeps
  the token, so a log-ratio past float32's exp range (~88.7) gives the cap, and a dropped
  token 0, never inf x 0 = NaN."""
  entry = ROLLOUT_MASKS[mask]
  maskf_BN = mask_BN.astype(jnp.float32)
  d_BN = jax.lax.stop_gradient((old_BN - mu_BN) * maskf_BN)
  weighted = behaviour or tis_cap > 0 or (entry is not None and entry.weighted)
  log_weight_BN = d_BN if weighted else jnp.zeros_like(d_BN)
  if tis_cap > 0:
    log_weight_BN = jnp.minimum(log_weight_BN, math.log(tis_cap))
  kept_BN = (jnp.ones(d_BN.shape, bool) if entry is None
             else entry.kept(d_BN, maskf_BN, mask_low, mask_high))
  kept_BN = kept_BN & mask_BN.astype(bool)
  return jnp.where(kept_BN, jnp.exp(jnp.where(kept_BN, log_weight_BN, 0.0)), 0.0), kept_BN


def tis_capped(old_BN, mu_BN, tis_cap: float = 0.0):
  """Which tokens' truncated IS weight min(pi_old / mu, tis_cap) is the cap (none without one)."""
  if tis_cap <= 0:
    return jnp.zeros(old_BN.shape, bool)
  return jax.lax.stop_gradient(old_BN - mu_BN) > math.log(tis_cap)


def mismatch(old_BN, mu_BN, mask_BN, token_weights_BN):
  """The sampler/trainer gap over the valid tokens: |log mu - log pi_old| summed with
  `token_weights_BN` (a token mean when they are 1 / valid tokens), its maximum, and
  KL(mu || pi_old) estimated from mu's own samples with k3 (r - 1 - log r, r = pi_old / mu;
  unbiased, never negative)."""
  valid_BN = mask_BN.astype(bool)
  d_BN = jnp.where(valid_BN, jax.lax.stop_gradient(old_BN - mu_BN), 0.0)
  kl_BN = jnp.maximum(jnp.expm1(d_BN) - d_BN, 0.0)  # >= 0, also after rounding
  return {"mismatch_mean": (jnp.abs(d_BN) * token_weights_BN).sum(),
          "mismatch_max": jnp.abs(d_BN).max(initial=0.0),
          "mismatch_kl": (kl_BN * token_weights_BN).sum()}
