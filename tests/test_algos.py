"""Advantages and losses against plain-numpy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos.advantages import grpo_advantages
from jaxrl.algos.losses import AGGREGATIONS, kl_k1, kl_k2, kl_k3, ppo_clip_loss


def np_grpo(rewards, group_size, eps=1e-6):
  out = np.zeros_like(rewards, dtype=np.float64)
  for g in range(len(rewards) // group_size):
    r = rewards[g * group_size:(g + 1) * group_size].astype(np.float64)
    if group_size == 1:
      continue
    out[g * group_size:(g + 1) * group_size] = (r - r.mean()) / (r.std(ddof=1) + eps)
  return out


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_grpo_advantages_match_numpy(group_size):
  rng = np.random.default_rng(group_size)
  rewards = rng.integers(0, 2, 32).astype(np.float32) * rng.normal(size=32).astype(np.float32)
  got = grpo_advantages(jnp.asarray(rewards), group_size)
  np.testing.assert_allclose(got, np_grpo(rewards, group_size), rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()


def test_grpo_constant_group_has_zero_advantage():
  got = grpo_advantages(jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]), 4)
  np.testing.assert_allclose(got[:4], 0.0)
  np.testing.assert_allclose(got[4:], [-0.866025, 0.866025, -0.866025, 0.866025], atol=1e-5)


def np_ppo(logp, old, adv, eps_low, eps_high):
  ratio = np.exp(logp - old)
  return -np.minimum(ratio * adv[:, None], np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv[:, None])


def test_ppo_clip_loss_matches_numpy():
  rng = np.random.default_rng(0)
  logp = rng.normal(size=(6, 5)) * 0.3 - 1
  old = logp + rng.normal(size=(6, 5)) * 0.3
  adv = rng.normal(size=6)
  got = ppo_clip_loss(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), eps_low=0.2,
                      eps_high=0.28)
  np.testing.assert_allclose(got, np_ppo(logp, old, adv, 0.2, 0.28), rtol=1e-5)


def test_ppo_clip_blocks_gradient_outside_trust_region():
  old = jnp.zeros((1, 1))
  adv = jnp.ones((1,))
  grad = jax.grad(lambda lp: ppo_clip_loss(lp, old, adv, eps_low=0.2, eps_high=0.2).sum())
  assert grad(jnp.full((1, 1), 0.5))[0, 0] == 0.0  # ratio e^0.5 > 1.2 with A > 0: clipped
  assert grad(jnp.full((1, 1), 0.05))[0, 0] < 0.0  # inside: pushes logp up


def test_kl_estimators_match_numpy():
  rng = np.random.default_rng(1)
  logp, ref = rng.normal(size=(4, 3)) - 1, rng.normal(size=(4, 3)) - 1
  d = ref - logp
  np.testing.assert_allclose(kl_k1(logp, ref), logp - ref)
  np.testing.assert_allclose(kl_k2(logp, ref), 0.5 * (logp - ref)**2)
  np.testing.assert_allclose(kl_k3(logp, ref), np.exp(d) - d - 1, rtol=1e-6)
  assert (np.asarray(kl_k3(logp, ref)) >= 0).all()
  np.testing.assert_allclose(kl_k3(logp, logp), 0.0)


def test_aggregations_with_padding():
  loss = np.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
  mask = np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  assert AGGREGATIONS["token_mean"](loss, mask) == pytest.approx(2.0)
  assert AGGREGATIONS["seq_mean_token_mean"](loss, mask) == pytest.approx((1.5 + 3.0) / 2)
  assert AGGREGATIONS["seq_mean_token_sum"](loss, mask) == pytest.approx((3.0 + 3.0) / 2)
  assert AGGREGATIONS["token_mean"](loss, np.zeros_like(mask)) == 0.0
