"""Advantages and losses against plain-numpy references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.algos.advantages import ADVANTAGES, gae, grpo, reinforce_pp
from jaxrl.algos.correction import rollout_weights
from jaxrl.algos.losses import (AGGREGATIONS, aipo_loss, bradley_terry_loss, dpo_loss, kl_k1, kl_k2,
                                kl_k3, ppo_clip_loss, value_loss)


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
  mask = np.ones((32, 3), np.float32)
  mask[5, 1:] = 0  # padding: masked tokens get no advantage
  got = grpo(jnp.asarray(rewards), jnp.asarray(mask), group_size=group_size)
  want = np_grpo(rewards, group_size)[:, None] * mask
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.isfinite(np.asarray(got)).all()


def test_grpo_constant_group_has_zero_advantage():
  got = grpo(jnp.asarray([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]), jnp.ones((8, 1)),
             group_size=4)[:, 0]
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
  got = ppo_clip_loss(jnp.asarray(logp), jnp.asarray(adv)[:, None], old_BN=jnp.asarray(old),
                      eps_low=0.2, eps_high=0.28)[0]
  np.testing.assert_allclose(got, np_ppo(logp, old, adv, 0.2, 0.28), rtol=1e-5)


def test_ppo_clip_blocks_gradient_outside_trust_region():
  old = jnp.zeros((1, 1))
  adv = jnp.ones((1, 1))
  grad = jax.grad(lambda lp: ppo_clip_loss(lp, adv, old_BN=old, eps_low=0.2, eps_high=0.2)[0].sum())
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


@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_dr_grpo_and_rloo_match_numpy(group_size):
  rng = np.random.default_rng(group_size)
  r = rng.normal(size=16).astype(np.float32)
  mask = np.ones((16, 2), np.float32)
  dr = np.asarray(ADVANTAGES["dr_grpo"](jnp.asarray(r), jnp.asarray(mask), {
      "group_size": group_size
  }))
  loo = np.asarray(ADVANTAGES["rloo"](jnp.asarray(r), jnp.asarray(mask), {
      "group_size": group_size
  }))
  for g in range(16 // group_size):
    rg = r[g * group_size:(g + 1) * group_size].astype(np.float64)
    np.testing.assert_allclose(dr[g * group_size:(g + 1) * group_size, 0], rg - rg.mean(),
                               atol=1e-5)
    want = (np.zeros_like(rg) if group_size == 1 else
            np.array([rg[i] - np.delete(rg, i).mean() for i in range(group_size)]))
    np.testing.assert_allclose(loo[g * group_size:(g + 1) * group_size, 0], want, atol=1e-5)
  assert np.isfinite(dr).all() and np.isfinite(loo).all()


def np_returns(r, mask, gamma):
  out = np.zeros_like(r)
  for b in range(r.shape[0]):
    acc = 0.0
    for t in reversed(range(r.shape[1])):
      acc = (r[b, t] + gamma * acc) * mask[b, t]
      out[b, t] = acc
  return out


def _padded_mask():
  mask = np.ones((4, 5), np.float32)
  mask[1, 3:] = 0
  mask[2, 1:] = 0
  return mask


def test_reinforce_pp_matches_numpy():
  rng = np.random.default_rng(0)
  rewards, kl, mask = rng.normal(size=4), rng.normal(size=(4, 5)) * 0.1, _padded_mask()
  got = reinforce_pp(jnp.asarray(rewards), jnp.asarray(mask), kl_BN=jnp.asarray(kl), kl_coef=0.5,
                     gamma=0.9)
  r = -0.5 * kl * mask
  for b in range(4):
    r[b, int(mask[b].sum()) - 1] += rewards[b]
  ret = np_returns(r, mask, 0.9)
  valid = ret[mask > 0]
  want = (ret - valid.mean()) / (valid.std() + 1e-6) * mask
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_gae_matches_numpy():
  rng = np.random.default_rng(1)
  rewards, values, mask = rng.normal(size=4), rng.normal(size=(4, 5)), _padded_mask()
  got = gae(jnp.asarray(rewards), jnp.asarray(mask), values_BN=jnp.asarray(values), gamma=0.99,
            lam=0.9)
  want = np.zeros((4, 5))
  for b in range(4):
    n = int(mask[b].sum())
    r = np.zeros(n)
    r[-1] = rewards[b]
    acc = 0.0
    for t in reversed(range(n)):
      next_v = values[b, t + 1] if t + 1 < n else 0.0
      acc = r[t] + 0.99 * next_v - values[b, t] + 0.99 * 0.9 * acc
      want[b, t] = acc
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_aipo_gradient_truncation_and_on_policy_limit():
  rng = np.random.default_rng(2)
  logp = jnp.asarray(rng.normal(size=(3, 4)) - 1.0)
  mu = logp + jnp.asarray(rng.normal(size=(3, 4)) * 2.0)
  adv = jnp.asarray(rng.normal(size=(3, 4)))
  rho = 2.0
  grad = jax.grad(lambda lp: aipo_loss(lp, adv, mu_BN=mu, rho=rho)[0].sum())(logp)
  weight = np.minimum(np.exp(np.asarray(logp - mu)), rho)
  np.testing.assert_allclose(grad, -weight * np.asarray(adv), rtol=1e-5)  # d/dlogp, w held fixed
  assert weight.max() <= rho and (weight == rho).any()  # truncated at rho
  on_policy = jax.grad(lambda lp: aipo_loss(lp, adv, mu_BN=lp, rho=rho)[0].sum())(logp)
  np.testing.assert_allclose(on_policy, -np.asarray(adv), rtol=1e-6)  # REINFORCE when pi == mu


def test_truncated_is_weight_and_value_loss():
  old, mu = jnp.asarray([[0.0, -1.0]]), jnp.asarray([[-2.0, -1.0]])
  weight, _ = rollout_weights(old, mu, jnp.ones((1, 2)), tis_cap=3.0)
  np.testing.assert_allclose(weight, [[3.0, 1.0]], rtol=1e-6)
  v, v_old, ret = jnp.asarray([[1.0, 0.0]]), jnp.asarray([[0.0, 0.0]]), jnp.asarray([[0.0, 1.0]])
  # token 0: unclipped 0.5, clipped (0.2 - 0)^2/2 = 0.02 -> max 0.5; token 1: both 0.5
  np.testing.assert_allclose(value_loss(v, v_old, ret, clip_eps=0.2), [[0.5, 0.5]], rtol=1e-6)
  v2 = jnp.asarray([[0.5, 0.0]])
  ret2 = jnp.asarray([[1.0, 0.0]])
  # clip(0.5) -> 0.2: (0.2 - 1)^2/2 = 0.32 > (0.5 - 1)^2/2 = 0.125: the clipped term wins
  np.testing.assert_allclose(value_loss(v2, v_old, ret2, clip_eps=0.2)[0, 0], 0.32, rtol=1e-6)


def test_bradley_terry_and_dpo_losses_match_numpy():
  rng = np.random.default_rng(7)
  c, r, rc, rr = (rng.normal(size=16) * 3 for _ in range(4))
  np.testing.assert_allclose(bradley_terry_loss(jnp.asarray(c), jnp.asarray(r)),
                             np.log1p(np.exp(-(c - r))), rtol=1e-5)
  loss, margin = dpo_loss(*(jnp.asarray(x) for x in (c, r, rc, rr)), beta=0.1)
  want_margin = 0.1 * ((c - rc) - (r - rr))
  np.testing.assert_allclose(margin, want_margin, rtol=1e-5)
  np.testing.assert_allclose(loss, np.log1p(np.exp(-want_margin)), rtol=1e-5)
  # Policy equal to the reference: margin 0, loss log 2, gradient pushes chosen up.
  grad_c = jax.grad(
      lambda x: dpo_loss(x, jnp.zeros(1), jnp.zeros(1), jnp.zeros(1), beta=0.5)[0].sum())
  np.testing.assert_allclose(grad_c(jnp.zeros(1)), [-0.25], rtol=1e-6)
