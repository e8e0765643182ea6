"""Per-token policy losses, KL estimators and loss aggregation: small pure jnp functions."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def ppo_clip_loss(logp_BN, old_logp_BN, adv_B, *, eps_low: float, eps_high: float) -> jax.Array:
  """Clipped surrogate, per token: -min(ratio * A, clip(ratio, 1-eps_low, 1+eps_high) * A)."""
  ratio_BN = jnp.exp(logp_BN - old_logp_BN)
  adv_B1 = adv_B[:, None]
  clipped_BN = jnp.clip(ratio_BN, 1.0 - eps_low, 1.0 + eps_high)
  return -jnp.minimum(ratio_BN * adv_B1, clipped_BN * adv_B1)


def kl_k1(logp_BN, ref_logp_BN):
  return logp_BN - ref_logp_BN


def kl_k2(logp_BN, ref_logp_BN):
  return 0.5 * (logp_BN - ref_logp_BN)**2


def kl_k3(logp_BN, ref_logp_BN):
  """Schulman's unbiased, non-negative estimator of KL(pi || ref): e^d - d - 1, d = ref - pi."""
  d_BN = ref_logp_BN - logp_BN
  return jnp.exp(d_BN) - d_BN - 1.0


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def token_mean(loss_BN, mask_BN):
  return (loss_BN * mask_BN).sum() / jnp.maximum(mask_BN.sum(), 1)


def seq_mean_token_mean(loss_BN, mask_BN):
  per_seq_B = (loss_BN * mask_BN).sum(1) / jnp.maximum(mask_BN.sum(1), 1)
  return per_seq_B.mean()


def seq_mean_token_sum(loss_BN, mask_BN):
  return (loss_BN * mask_BN).sum(1).mean()


AGGREGATIONS = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
}
POLICY_LOSSES = {"ppo_clip": ppo_clip_loss}
