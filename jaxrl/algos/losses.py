"""Per-token policy losses, KL estimators and loss aggregation: small pure jnp functions.

A policy loss is `fn(logp_BN, adv_BN, *, ...) -> (loss_BN, metrics)` whose keyword-only
parameters are what it reads (jaxrl/registry.py): `old_BN` (the trainer's policy before the
update), `mu_BN` (the sampler's, the behaviour policy), `mask_BN` (the policy's own tokens) and
the hyperparameters of the config's `rl.loss` section (`eps_low`, `eps_high`, `rho`), by those
names. Its metrics are its own, per token ([B, N], or [B, 1] per sequence), averaged by the
update with the loss's aggregation weights: `clip_frac` is the share of what the loss clipped
(the ratio outside the clip band for the PPO family, the sequence ratio for GSPO, the importance
weight for CISPO, pi / mu above rho for AIPO).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from jaxrl.registry import declared


def outside(ratio, eps_low: float, eps_high: float):
  """Whether a ratio lies outside the clip band [1 - eps_low, 1 + eps_high], as float32."""
  return ((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).astype(jnp.float32)


def ppo_clip_loss(logp_BN, adv_BN, *, old_BN, eps_low: float, eps_high: float):
  """Clipped surrogate, per token: -min(r * A, clip(r, 1-eps_low, 1+eps_high) * A), r = pi/pi_old.
  eps_high > eps_low is DAPO's clip-higher."""
  ratio_BN = jnp.exp(logp_BN - old_BN)
  clipped_BN = jnp.clip(ratio_BN, 1.0 - eps_low, 1.0 + eps_high)
  loss_BN = -jnp.minimum(ratio_BN * adv_BN, clipped_BN * adv_BN)
  return loss_BN, {"clip_frac": outside(ratio_BN, eps_low, eps_high)}


def aipo_loss(logp_BN, adv_BN, *, mu_BN, rho: float):
  """AIPO (LlamaRL): -min(pi/mu, rho) * A * log pi, the weight a stop-gradient constant."""
  ratio_BN = jax.lax.stop_gradient(jnp.exp(logp_BN - mu_BN))
  loss_BN = -jnp.minimum(ratio_BN, rho) * adv_BN * logp_BN
  return loss_BN, {"clip_frac": (ratio_BN > rho).astype(jnp.float32)}


def sequence_log_ratio(logp_BN, old_BN, mask_BN):
  """GSPO's length-normalised sequence log-ratio, [B]: mean over the row's tokens of
  log pi - log pi_old (0 for an empty row)."""
  mask_BN = mask_BN.astype(jnp.float32)
  return ((logp_BN - old_BN) * mask_BN).sum(1) / jnp.maximum(mask_BN.sum(1), 1.0)


def gspo_loss(logp_BN, adv_BN, *, old_BN, mask_BN, eps_low: float, eps_high: float):
  """GSPO (Qwen, 2025): one importance ratio per sequence, s = exp(mean_t log pi/pi_old), clipped
  at the sequence level: -min(s * A, clip(s, 1-eps_low, 1+eps_high) * A), the row's value on
  each of its tokens (aggregate with `seq_mean_token_mean` for the paper's per-sequence mean).
  A is the row's mean token advantage (a sequence advantage for GRPO-style estimators)."""
  maskf_BN = mask_BN.astype(jnp.float32)
  adv_B = (adv_BN * maskf_BN).sum(1) / jnp.maximum(maskf_BN.sum(1), 1.0)
  ratio_B = jnp.exp(sequence_log_ratio(logp_BN, old_BN, mask_BN))
  clipped_B = jnp.clip(ratio_B, 1.0 - eps_low, 1.0 + eps_high)
  loss_BN = -jnp.minimum(ratio_B * adv_B, clipped_B * adv_B)[:, None] * maskf_BN
  return loss_BN, {"clip_frac": outside(ratio_B, eps_low, eps_high)[:, None]}


def cispo_loss(logp_BN, adv_BN, *, old_BN, eps_low: float, eps_high: float):
  """CISPO (MiniMax-M1): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi. The importance
  weight is clipped, never the gradient: every token keeps its log-prob gradient."""
  ratio_BN = jax.lax.stop_gradient(jnp.exp(logp_BN - old_BN))
  loss_BN = -jnp.clip(ratio_BN, 1.0 - eps_low, 1.0 + eps_high) * adv_BN * logp_BN
  return loss_BN, {"clip_frac": outside(ratio_BN, eps_low, eps_high)}


def value_loss(values_BN, old_values_BN, returns_BN, *, clip_eps: float) -> jax.Array:
  """Clipped value loss, per token: 0.5 * max((V - R)^2, (clip(V, V_old +- eps) - R)^2)."""
  clipped_BN = old_values_BN + jnp.clip(values_BN - old_values_BN, -clip_eps, clip_eps)
  return 0.5 * jnp.maximum((values_BN - returns_BN)**2, (clipped_BN - returns_BN)**2)


def kl_k1(logp_BN, ref_logp_BN):
  return logp_BN - ref_logp_BN


def kl_k2(logp_BN, ref_logp_BN):
  return 0.5 * (logp_BN - ref_logp_BN)**2


def kl_k3(logp_BN, ref_logp_BN):
  """Schulman's unbiased, non-negative estimator of KL(pi || ref): e^d - d - 1, d = ref - pi."""
  d_BN = ref_logp_BN - logp_BN
  return jnp.exp(d_BN) - d_BN - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def bradley_terry_loss(chosen_B, rejected_B) -> jax.Array:
  """Reward-model loss, per pair: -log sigmoid(r_chosen - r_rejected)."""
  return -jax.nn.log_sigmoid(chosen_B - rejected_B)


def dpo_loss(logp_chosen_B, logp_rejected_B, ref_chosen_B, ref_rejected_B, *, beta: float):
  """DPO's sigmoid loss on sequence log-probs, per pair, and the implicit reward margin
  beta * ((pi_c - ref_c) - (pi_r - ref_r))."""
  margin_B = beta * ((logp_chosen_B - ref_chosen_B) - (logp_rejected_B - ref_rejected_B))
  return -jax.nn.log_sigmoid(margin_B), margin_B


def token_mean(loss_BN, mask_BN):
  return (loss_BN * mask_BN).sum() / jnp.maximum(mask_BN.sum(), 1)


def seq_mean_token_mean(loss_BN, mask_BN):
  per_seq_B = (loss_BN * mask_BN).sum(1) / jnp.maximum(mask_BN.sum(1), 1)
  return per_seq_B.mean()


def seq_mean_token_sum(loss_BN, mask_BN):
  return (loss_BN * mask_BN).sum(1).mean()


def seq_mean_token_sum_norm(loss_BN, mask_BN):
  """Dr. GRPO's length-free aggregation: token sums divided by the fixed horizon N."""
  return (loss_BN * mask_BN).sum() / (loss_BN.shape[0] * loss_BN.shape[1])


AGGREGATIONS = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


def aggregation_weights(name: str, mask_BN, horizon: int | None = None) -> jax.Array:
  """Per-token weights w_BN with `AGGREGATIONS[name](loss_BN, mask_BN) == sum(loss_BN * w_BN)`.

  Every aggregation is linear in the per-token loss, so these weights (the aggregation's
  gradient) depend on the mask alone. A minibatch split into micro-batches sums each one's
  `sum(loss * w)` and gets exactly the minibatch's loss and gradient: the normaliser stays the
  whole minibatch's, not each micro-batch's token count. `horizon`: the generation budget, when
  the completion slots were trimmed below it (the weights are those of the untrimmed mask, so
  Dr. GRPO still divides by the budget)."""
  n = mask_BN.shape[1]
  mask_BH = jnp.pad(mask_BN.astype(jnp.float32), ((0, 0), (0, max(0, (horizon or n) - n))))
  return jax.grad(AGGREGATIONS[name])(jnp.zeros_like(mask_BH), mask_BH)[:, :n]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """A policy loss (its keyword-only parameters: what it reads) and whether it is weighted by
  the behaviour policy's ratio pi_old / mu (`behaviour_weighted`: the rollout correction,
  jaxrl/algos/correction.py, forms that weight, capped and masked, in log space)."""
  fn: Callable
  behaviour_weighted: bool = False

  def __call__(self, logp_BN, adv_BN, available: Mapping):
    """(the per-token loss [B, N], its metrics), taking from `available` what `fn` declares."""
    return self.fn(logp_BN, adv_BN, **declared(self.fn, available))


POLICY_LOSSES = {"ppo_clip": PolicyLoss(ppo_clip_loss),
                 "aipo": PolicyLoss(aipo_loss),
                 "gspo": PolicyLoss(gspo_loss),
                 "cispo": PolicyLoss(cispo_loss),
                 # Decoupled PPO (AReaL): the clip around the proximal policy pi_old (the
                 # trainer's weights before this update), the behaviour policy mu (the
                 # sampler's, possibly several versions older) only in the stop-gradient weight
                 # pi_old / mu, which the rollout correction forms in log space with its cap
                 "decoupled_ppo": PolicyLoss(ppo_clip_loss, behaviour_weighted=True)}
