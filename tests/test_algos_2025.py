"""GSPO, CISPO, decoupled PPO, the rollout-correction masks and weights, the mismatch metrics and
DAPO's reward shaping against plain numpy, with the degenerate cases: all-equal groups,
zero-length responses, ratios at the clip edges."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config_rl import BatchingConfig, DAPOConfig, RLConfig, RolloutConfig
from jaxrl.algos.advantages import informative_groups, overlong_penalty
from jaxrl.algos.correction import mismatch, rollout_weights
from jaxrl.algos.losses import cispo_loss, gspo_loss, ppo_clip_loss

RNG = np.random.default_rng(7)
LOGP = RNG.normal(size=(4, 5)) * 0.3 - 1.0
OLD = LOGP + RNG.normal(size=(4, 5)) * 0.2
MU = OLD + RNG.normal(size=(4, 5)) * 0.3
ADV = np.repeat(RNG.normal(size=(4, 1)), 5, axis=1)
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]], bool)


def np_gspo(logp, old, adv, mask, lo, hi):
  out = np.zeros_like(logp)
  for b in range(len(logp)):
    n = mask[b].sum()
    if n == 0:
      continue  # a zero-length response adds nothing
    s = np.exp((logp[b] - old[b])[mask[b]].mean())
    a = adv[b][mask[b]].mean()
    out[b, mask[b]] = -min(s * a, np.clip(s, 1 - lo, 1 + hi) * a)
  return out


def test_gspo_matches_numpy_and_clips_whole_sequences():
  got = gspo_loss(jnp.asarray(LOGP), jnp.asarray(ADV), old_BN=jnp.asarray(OLD),
                  mask_BN=jnp.asarray(MASK), eps_low=0.05, eps_high=0.1)[0]
  np.testing.assert_allclose(got, np_gspo(LOGP, OLD, ADV, MASK, 0.05, 0.1), rtol=1e-5, atol=1e-7)
  # The gradient of a sequence's mean loss reaches every token equally (1 / |y| of s * A), and
  # none once the sequence ratio leaves the band on the side that the advantage pushes.
  logp, old = jnp.zeros((1, 4)), jnp.zeros((1, 4))
  adv, mask = jnp.ones((1, 4)), jnp.ones((1, 4), bool)
  seq_mean = lambda lp: gspo_loss(lp, adv, old_BN=old, mask_BN=mask, eps_low=0.2,
                                  eps_high=0.2)[0].mean()
  np.testing.assert_allclose(jax.grad(seq_mean)(logp), np.full((1, 4), -1 / 4), rtol=1e-6)
  assert not jax.grad(seq_mean)(jnp.full((1, 4), 0.19)).any()  # s = e^0.19 > 1.2, A > 0
  assert jax.grad(seq_mean)(jnp.full((1, 4), 0.18)).all()  # s = e^0.18 < 1.2: inside


def test_gspo_at_the_clip_edge_and_on_policy_equals_the_sequence_advantage():
  adv, mask = jnp.asarray([[2.0, 2.0]]), jnp.ones((1, 2), bool)
  edge = jnp.full((1, 2), np.log(1.2))  # s exactly 1 + eps_high
  got = gspo_loss(edge, adv, old_BN=jnp.zeros((1, 2)), mask_BN=mask, eps_low=0.2, eps_high=0.2)[0]
  np.testing.assert_allclose(got, [[-2.4, -2.4]], rtol=1e-6)
  on = gspo_loss(jnp.zeros((1, 2)), adv, old_BN=jnp.zeros((1, 2)), mask_BN=mask, eps_low=0.2,
                 eps_high=0.2)[0]
  np.testing.assert_allclose(on, [[-2.0, -2.0]])


def test_cispo_keeps_every_tokens_gradient_with_a_clipped_weight():
  lo, hi = 0.1, 0.28
  got = cispo_loss(jnp.asarray(LOGP), jnp.asarray(ADV), old_BN=jnp.asarray(OLD), eps_low=lo,
                   eps_high=hi)[0]
  w = np.clip(np.exp(LOGP - OLD), 1 - lo, 1 + hi)
  np.testing.assert_allclose(got, -w * ADV * LOGP, rtol=1e-5)
  grad = jax.grad(lambda lp: cispo_loss(lp, jnp.asarray(ADV), old_BN=jnp.asarray(OLD),
                                        eps_low=lo, eps_high=hi)[0].sum())(jnp.asarray(LOGP))
  np.testing.assert_allclose(grad, -w * ADV, rtol=1e-5)  # the weight is a constant
  assert (np.asarray(grad) != 0).all()  # no token loses its gradient, clipped or not
  assert (w == 1 + hi).any() and (w == 1 - lo).any()  # both edges were hit
  # PPO's clip zeroes the gradient of the tokens CISPO keeps
  ppo = jax.grad(lambda lp: ppo_clip_loss(lp, jnp.asarray(ADV), old_BN=jnp.asarray(OLD),
                                          eps_low=lo, eps_high=hi)[0].sum())(jnp.asarray(LOGP))
  assert (np.asarray(ppo) == 0).any()


def test_decoupled_ppo_is_the_behaviour_weight_times_ppo_around_the_proximal_policy():
  from jaxrl.algos.losses import POLICY_LOSSES
  loss = POLICY_LOSSES["decoupled_ppo"]
  mask = jnp.ones(LOGP.shape, bool)
  weight, _ = rollout_weights(jnp.asarray(OLD), jnp.asarray(MU), mask,
                              behaviour=loss.behaviour_weighted)
  got = loss(jnp.asarray(LOGP), jnp.asarray(ADV), {"old_BN": jnp.asarray(OLD),
                                                   "eps_low": 0.2, "eps_high": 0.2})[0] * weight
  ratio = np.exp(LOGP - OLD)
  ppo = -np.minimum(ratio * ADV, np.clip(ratio, 0.8, 1.2) * ADV)
  np.testing.assert_allclose(got, np.exp(OLD - MU) * ppo, rtol=1e-5)
  # behaviour == proximal: plain PPO
  same, _ = rollout_weights(jnp.asarray(OLD), jnp.asarray(OLD), mask, behaviour=True)
  np.testing.assert_allclose(same, 1.0)


def np_weights(old, mu, mask, mode, low, high, cap):
  d = (old - mu) * mask
  w = np.exp(d) if cap > 0 or mode == "icepop" else np.ones_like(d)
  w = np.minimum(w, cap) if cap > 0 else w
  inside = lambda x: (x >= low) & (x <= high)
  if mode in ("token", "icepop"):
    kept = inside(np.exp(d))
  elif mode == "sequence":
    kept = np.repeat(inside(np.exp(d.sum(1)))[:, None], d.shape[1], 1)
  elif mode == "geometric":
    mean = d.sum(1) / np.maximum(mask.sum(1), 1)
    kept = np.repeat(inside(np.exp(mean))[:, None], d.shape[1], 1)
  else:
    kept = np.ones(d.shape, bool)
  kept &= mask
  return w * kept, kept


@pytest.mark.parametrize("mode", ["none", "token", "sequence", "geometric", "icepop"])
@pytest.mark.parametrize("cap", [0.0, 1.5])
def test_rollout_weights_match_numpy(mode, cap):
  low, high = (0.5, 1.3) if mode == "sequence" else (0.9, 1.1)  # each cuts this data somewhere
  got_w, got_kept = rollout_weights(jnp.asarray(OLD), jnp.asarray(MU), jnp.asarray(MASK),
                                    mask=mode, mask_low=low, mask_high=high, tis_cap=cap)
  want_w, want_kept = np_weights(OLD, MU, MASK, mode, low, high, cap)
  np.testing.assert_array_equal(got_kept, want_kept)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
  assert not np.asarray(got_w)[2].any()  # the zero-length row keeps nothing
  if mode != "none":
    assert 0 < np.asarray(got_kept)[MASK].mean() < 1  # this data has tokens on both sides


def test_rollout_masks_hand_computed():
  # ratios e^0.5, e^-0.5, 1 in row 0; e^0.1, e^0.1 in row 1 (third slot empty)
  old = jnp.asarray([[0.5, -0.5, 0.0], [0.1, 0.1, 0.0]])
  mu = jnp.zeros((2, 3))
  mask = jnp.asarray([[True, True, True], [True, True, False]])
  band = dict(mask_low=0.8, mask_high=1.25)
  _, kept = rollout_weights(old, mu, mask, mask="token", **band)
  np.testing.assert_array_equal(kept, [[False, False, True], [True, True, False]])
  _, kept = rollout_weights(old, mu, mask, mask="sequence", **band)  # e^0 and e^0.2 (> 1.25? no)
  np.testing.assert_array_equal(kept, [[True, True, True], [True, True, False]])
  _, kept = rollout_weights(old, mu, mask, mask="sequence", mask_low=0.8,
                            mask_high=1.2)  # e^0.2 > 1.2
  np.testing.assert_array_equal(kept, [[True, True, True], [False, False, False]])
  _, kept = rollout_weights(old, mu, mask, mask="geometric", mask_low=0.8,
                            mask_high=1.2)  # e^0.1 inside
  np.testing.assert_array_equal(kept, [[True, True, True], [True, True, False]])
  w, _ = rollout_weights(old, mu, mask, mask="icepop", **band)
  np.testing.assert_allclose(w, [[0, 0, 1], [np.exp(0.1), np.exp(0.1), 0]], rtol=1e-6)
  w, _ = rollout_weights(old, mu, mask, mask="icepop", tis_cap=1.05, **band)  # the ratio, capped
  np.testing.assert_allclose(w, [[0, 0, 1], [1.05, 1.05, 0]], rtol=1e-6)
  w, _ = rollout_weights(old, mu, mask, tis_cap=1.05)  # TIS alone: min(r, cap) everywhere
  np.testing.assert_allclose(w, [[1.05, np.exp(-0.5), 1], [1.05, 1.05, 0]], rtol=1e-6)
  # at the band's edges a ratio is kept
  edge = jnp.log(jnp.asarray([[0.8, 1.25]]))
  _, kept = rollout_weights(edge, jnp.zeros((1, 2)), jnp.ones((1, 2), bool), mask="token", **band)
  assert np.asarray(kept).all()


@pytest.mark.parametrize("mode,cap", [("none", 1.05), ("icepop", 0.0), ("icepop", 1.05),
                                      ("token", 0.0), ("none", 0.0)])
def test_decoupled_ppo_weight_is_capped_and_masked_never_squared(mode, cap):
  """Decoupled PPO is weighted by r = pi_old / mu: with TIS or IcePop its weight is min(r, cap)
  on the kept tokens (what the correction gives a loss without its own weight), not r times
  that; a mask alone keeps r on the kept tokens; no correction: r."""
  from jaxrl.algos.losses import POLICY_LOSSES, ppo_clip_loss
  old = jnp.asarray([[0.5, -0.5, 0.0], [0.1, 0.1, 0.0]])
  mu, mask = jnp.zeros((2, 3)), jnp.asarray([[True, True, True], [True, True, False]])
  logp, adv = old + 0.05, jnp.asarray([[1.0, -2.0, 0.5], [1.5, 1.0, 0.0]])
  band = dict(mask=mode, mask_low=0.8, mask_high=1.25, tis_cap=cap)
  loss = POLICY_LOSSES["decoupled_ppo"]
  weight, _ = rollout_weights(old, mu, mask, behaviour=loss.behaviour_weighted, **band)
  got = loss(logp, adv, {"old_BN": old, "mu_BN": mu, "eps_low": 0.2, "eps_high": 0.2})[0] * weight
  want_weight, _ = rollout_weights(old, mu, mask, **band)  # min(r, cap) where kept
  if cap == 0 and mode != "icepop":  # no ratio in the correction: the loss's own r stays
    want_weight = want_weight * jnp.exp(old - mu)
  want = ppo_clip_loss(logp, adv, old_BN=old, eps_low=0.2, eps_high=0.2)[0] * want_weight
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_name,mode,cap,want", [
    ("decoupled_ppo", "none", 2.0, 2.0),  # the cap
    ("decoupled_ppo", "icepop", 0.0, 0.0),  # dropped by IcePop: 0, not inf x 0
    ("decoupled_ppo", "token", 2.0, 0.0),
    ("ppo_clip", "icepop", 0.0, 0.0),
    ("ppo_clip", "icepop", 2.0, 0.0)])
def test_overflowing_log_ratio_gives_finite_loss_and_gradient(loss_name, mode, cap, want):
  """A log-ratio log pi_old - log mu of 200 on one token (exp overflows float32 past ~88.7):
  the loss and its gradient stay finite, that token's weight is what the cap or mask says, and
  the other tokens' weights are their ratios."""
  from jaxrl.algos.losses import POLICY_LOSSES
  old = jnp.asarray([[200.0, 0.1, 0.0]])
  mu, mask = jnp.zeros((1, 3)), jnp.asarray([[True, True, False]])
  adv = jnp.asarray([[1.0, -1.0, 0.0]])
  loss = POLICY_LOSSES[loss_name]
  weight, _ = rollout_weights(old, mu, mask, mask=mode, mask_low=0.5, mask_high=2.0, tis_cap=cap,
                              behaviour=loss.behaviour_weighted)
  np.testing.assert_allclose(weight, [[want, np.exp(0.1), 0.0]], rtol=1e-6)

  def total(logp):
    per_token, _ = loss(logp, adv, {"old_BN": logp, "mu_BN": mu, "eps_low": 0.2, "eps_high": 0.2})
    return (per_token * weight).sum()
  value, grad = jax.value_and_grad(total)(old)
  assert np.isfinite(value) and np.isfinite(np.asarray(grad)).all()


def test_mismatch_metrics_match_numpy():
  tokens = MASK.sum()
  weights = MASK / tokens
  got = mismatch(jnp.asarray(OLD), jnp.asarray(MU), jnp.asarray(MASK), jnp.asarray(weights))
  d = (OLD - MU)[MASK]
  np.testing.assert_allclose(got["mismatch_mean"], np.abs(d).mean(), rtol=1e-5)
  np.testing.assert_allclose(got["mismatch_max"], np.abs(d).max(), rtol=1e-6)
  np.testing.assert_allclose(got["mismatch_kl"], (np.exp(d) - d - 1).mean(), rtol=1e-5)
  zero = mismatch(jnp.asarray(OLD), jnp.asarray(OLD), jnp.asarray(MASK), jnp.asarray(weights))
  assert all(float(v) == 0.0 for v in zero.values())
  empty = mismatch(jnp.asarray(OLD), jnp.asarray(MU), jnp.zeros((4, 5), bool), jnp.zeros((4, 5)))
  assert all(float(v) == 0.0 for v in empty.values())  # masked tokens never count


def test_overlong_penalty_hand_computed():
  lengths = jnp.asarray([0, 5, 6, 7, 8])
  got = overlong_penalty(lengths, budget=8, buffer=3, factor=2.0)
  np.testing.assert_allclose(got, [0, 0, -2 / 3, -4 / 3, -2.0], rtol=1e-6)
  np.testing.assert_allclose(overlong_penalty(lengths, budget=8, buffer=0), [0, 0, 0, 0, 0])


def test_informative_groups():
  rewards = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
  np.testing.assert_array_equal(informative_groups(rewards, 4), [True, False, False])
  np.testing.assert_array_equal(informative_groups(rewards, 1), [False] * 12)


def test_make_experience_applies_dapos_overlong_penalty_and_filter():
  from sampler.engine import Rollout
  from train.loop.experience import make_experience
  cfg = RLConfig(prompts_per_step=2, group_size=2, batching=BatchingConfig(num_minibatches=1),
                 rollout=RolloutConfig(max_new_tokens=4),
                 dapo=DAPOConfig(overlong_filter=True, overlong_buffer=2, overlong_penalty=1.0))
  mask = jnp.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
  rollout = Rollout(tokens_BT=jnp.zeros((4, 6), jnp.int32),
                    valid_BT=jnp.concatenate([jnp.ones((4, 2), bool), mask], 1),
                    completion_mask_BN=mask, logprobs_BN=jnp.zeros((4, 4)),
                    lengths_B=mask.sum(1))
  zeros = jnp.zeros((4, 4))
  exp, metrics = make_experience(rollout, jnp.ones(4), zeros, zeros, None, cfg=cfg)
  # lengths 4, 2, 3, 0 of a budget of 4 with a 2-token buffer: penalties -1, 0, -0.5, 0
  np.testing.assert_allclose(metrics["reward_mean"], (0 + 1 + 0.5 + 1) / 4)
  np.testing.assert_allclose(metrics["overlong_frac"], 0.25)
  np.testing.assert_array_equal(exp.policy_mask_BN, mask.at[0].set(False))  # row 0 is filtered
  ends_on_eos = rollout.replace(tokens_BT=rollout.tokens_BT.at[0, -1].set(2))  # on its last slot
  finished, metrics = make_experience(ends_on_eos, jnp.ones(4), zeros, zeros, None, cfg=cfg,
                                      stop_ids=(2, 7))
  np.testing.assert_array_equal(finished.policy_mask_BN, mask)  # finished, not truncated
  assert float(metrics["overlong_frac"]) == 0.0
  adv = np.asarray(exp.advantages_BN)[:, 0]
  assert adv[0] < 0 < adv[1] and adv[2] < 0  # groups (0, 1) and (2, 3): penalised rows lose
  assert not np.asarray(exp.advantages_BN)[3].any()  # a zero-length response has no advantage


def test_tis_capped_marks_the_tokens_at_the_cap():
  from jaxrl.algos.correction import tis_capped
  old, mu = jnp.asarray([[0.5, -0.5, 0.0]]), jnp.zeros((1, 3))
  np.testing.assert_array_equal(tis_capped(old, mu, 1.2), [[True, False, False]])
  assert not np.asarray(tis_capped(old, mu)).any()  # no cap, nothing capped
