"""Reward-model, DPO, critic and policy-loss variants of train/updates/, and role copies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config_rl import (AdvantageConfig, BatchingConfig, CorrectionConfig, CriticConfig,
                             KLConfig, LossConfig, RLConfig)
from jaxrl.algos.losses import aggregation_weights
from jaxrl.data.pipeline import Encoding
from jaxrl.data.preferences import Pair, pair_batch, pair_lengths
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models import LanguageModel, RewardModel, ValueModel
from jaxrl.models.rope import positions_from_valid
from sharding.mesh import make_mesh
from train.loop.experience import Experience, advantages
from train.roles.role import ModelRole
from train.updates.batching import split_minibatches
from train.updates.forward import (completion_logprobs, completion_values, sequence_logprobs,
                                   sequence_scores)
from train.updates.preference import dpo_update, reward_model_update
from train.updates.policy import critic_update, policy_loss
from train.updates.state import TrainState, make_optimizer

PAIRS = [Pair("rev abc=", "cba", "bca"), Pair("rev bad=", "dab", "abd"),
         Pair("rev cab=", "bac", "acb"), Pair("rev dcb=", "bcd", "cbd")]


def _weights(exp, cfg):
  """The loss's token weights and the token mean's (for the mismatch metrics)."""
  return (aggregation_weights(cfg.loss.aggregation, exp.completion_mask_BN),
          aggregation_weights("token_mean", exp.completion_mask_BN))


def _pair_batch():
  tok = ByteTokenizer()
  lengths = pair_lengths(PAIRS, Encoding(tok))
  return {
      k: jnp.asarray(v) for k, v in pair_batch(PAIRS, Encoding(tok), *lengths).items()
  }, lengths[0]


def _state(model, lr=3e-3):
  graphdef, params = nnx.split(model)
  opt = make_optimizer(lr, warmup_steps=1, total_steps=100)
  return graphdef, opt, TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))


def test_reward_model_learns_pairs(tiny_cfg):
  batch, _ = _pair_batch()
  graphdef, opt, state = _state(RewardModel(tiny_cfg, rngs=nnx.Rngs(0)))
  update = jax.jit(lambda s, b: reward_model_update(s, b, graphdef=graphdef, optimizer=opt))
  state, first = update(state, batch)
  assert float(first["loss"]) == pytest.approx(np.log(2), abs=1e-6)  # zero-initialised head
  for _ in range(40):
    state, m = update(state, batch)
  assert float(m["loss"]) < 0.2 and float(m["accuracy"]) == 1.0 and float(m["margin"]) > 1.0
  scores = sequence_scores(graphdef, state.params, batch["tokens"], batch["valid"])
  np.testing.assert_array_less(scores[4:], scores[:4])


def test_dpo_raises_margin_from_zero(tiny_cfg):
  batch, prompt_len = _pair_batch()
  graphdef, opt, state = _state(LanguageModel(tiny_cfg, rngs=nnx.Rngs(1)))
  batch["ref_logprobs"] = sequence_logprobs(graphdef, state.params, batch["tokens"],
                                                  batch["valid"], batch["completion_mask"],
                                                  prompt_len)
  update = jax.jit(lambda s, b: dpo_update(s, b, graphdef=graphdef, optimizer=opt, beta=0.1,
                                                 prompt_len=prompt_len))
  state, first = update(state, batch)
  assert float(first["margin"]) == pytest.approx(0.0, abs=1e-5)  # policy == reference
  for _ in range(30):
    state, m = update(state, batch)
  assert float(m["margin"]) > 0.5 and float(m["accuracy"]) == 1.0


def test_sequence_logprobs_sum_completion_tokens(tiny_cfg):
  batch, prompt_len = _pair_batch()
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(2)))
  logp_BN, _ = completion_logprobs(graphdef, params, batch["tokens"], batch["valid"], prompt_len)
  want = (np.asarray(logp_BN) * np.asarray(batch["completion_mask"])).sum(1)
  got = sequence_logprobs(graphdef, params, batch["tokens"], batch["valid"],
                                batch["completion_mask"], prompt_len)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_critic_values_align_and_regress(tiny_cfg):
  batch, prompt_len = _pair_batch()
  model = ValueModel(tiny_cfg, rngs=nnx.Rngs(3))
  graphdef, opt, state = _state(model, lr=1e-2)
  values = completion_values(graphdef, state.params, batch["tokens"], batch["valid"], prompt_len)
  n = batch["completion_mask"].shape[1]
  full = model(batch["tokens"], positions_from_valid(batch["valid"]), batch["valid"])
  np.testing.assert_allclose(values, full[:, prompt_len - 1:prompt_len - 1 + n], rtol=1e-6)
  returns = jnp.where(batch["completion_mask"], 1.5, 0.0)
  zeros = jnp.zeros_like(values)
  cb = Experience(tokens_BT=batch["tokens"], valid_BT=batch["valid"],
                  completion_mask_BN=batch["completion_mask"], sampler_logprobs_BN=zeros,
                  old_logprobs_BN=zeros, ref_logprobs_BN=zeros, advantages_BN=zeros,
                  old_values_BN=values, returns_BN=returns)
  cfg = RLConfig(critic=CriticConfig(clip_eps=10.0), batching=BatchingConfig(num_minibatches=2))
  update = jax.jit(lambda s, b: critic_update(s, b, graphdef=graphdef, optimizer=opt, cfg=cfg))
  state, first = update(state, cb)
  for _ in range(30):
    state, m = update(state, cb)
  assert float(m["value_loss"]) < 0.1 * float(first["value_loss"])


def test_whitened_advantages_and_raw_returns():
  rng = np.random.default_rng(0)
  rewards = jnp.asarray(rng.normal(size=6), jnp.float32)
  mask = np.ones((6, 4), np.float32)
  mask[2, 2:] = 0
  values = jnp.asarray(rng.normal(size=(6, 4)) * mask, jnp.float32)
  kl = jnp.asarray(np.abs(rng.normal(size=(6, 4))) * mask, jnp.float32)
  cfg = RLConfig(advantage=AdvantageConfig(name="gae", whiten=True, lam=0.9),
                 kl=KLConfig(mode="reward", coef=0.1))
  adv, raw = advantages(rewards, jnp.asarray(mask), kl, values, cfg=cfg)
  sel = mask > 0
  assert abs(float(np.asarray(adv)[sel].mean())) < 1e-5
  assert float(np.asarray(adv)[sel].std()) == pytest.approx(1.0, abs=1e-4)
  assert (np.asarray(adv)[~sel] == 0).all()
  from jaxrl.algos.advantages import gae
  np.testing.assert_allclose(raw, gae(rewards, jnp.asarray(mask), values_BN=values, kl_BN=kl,
                                      kl_coef=0.1, lam=0.9), rtol=1e-6)
  # kl_mode="loss": the KL stays out of the rewards.
  _, raw_loss = advantages(
      rewards, jnp.asarray(mask), kl, values,
      cfg=RLConfig(advantage=AdvantageConfig(name="gae", lam=0.9), kl=KLConfig(coef=0.1)))
  np.testing.assert_allclose(raw_loss, gae(rewards, jnp.asarray(mask), values_BN=values, lam=0.9),
                             rtol=1e-6)


def _policy_batch(tiny_cfg):
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(4)))
  batch, p = _pair_batch()
  logp, _ = completion_logprobs(graphdef, params, batch["tokens"], batch["valid"], p)
  rng = np.random.default_rng(1)
  noise = lambda: jnp.asarray(rng.normal(size=logp.shape) * 0.3, jnp.float32)
  exp = Experience(tokens_BT=batch["tokens"], valid_BT=batch["valid"],
                   completion_mask_BN=batch["completion_mask"], old_logprobs_BN=logp + noise(),
                   ref_logprobs_BN=logp + noise(), sampler_logprobs_BN=logp + noise(),
                   advantages_BN=jnp.asarray(rng.normal(size=logp.shape), jnp.float32)
                   * batch["completion_mask"])
  return graphdef, params, exp, p, np.asarray(logp, np.float64)


def test_policy_loss_aipo_and_kl_in_reward(tiny_cfg):
  graphdef, params, exp, p, logp = _policy_batch(tiny_cfg)
  m = np.asarray(exp.completion_mask_BN, np.float64)
  adv, mu = np.asarray(exp.advantages_BN), np.asarray(exp.sampler_logprobs_BN)
  cfg = RLConfig(loss=LossConfig(name="aipo", rho=1.5), kl=KLConfig(mode="reward", coef=0.5))
  loss, _ = policy_loss(params, (exp, *_weights(exp, cfg)), graphdef=graphdef, cfg=cfg)
  want = -np.minimum(np.exp(logp - mu), 1.5) * adv * logp  # no KL term: it is in the rewards
  np.testing.assert_allclose(loss, (want * m).sum() / m.sum(), rtol=1e-4, atol=1e-6)


def test_policy_loss_truncated_is_and_entropy(tiny_cfg):
  graphdef, params, exp, p, logp = _policy_batch(tiny_cfg)
  m = np.asarray(exp.completion_mask_BN, np.float64)
  adv = np.asarray(exp.advantages_BN)
  old, mu = np.asarray(exp.old_logprobs_BN), np.asarray(exp.sampler_logprobs_BN)
  cfg = RLConfig(correction=CorrectionConfig(tis_cap=1.2), kl=KLConfig(coef=0.0),
                 loss=LossConfig(entropy_coef=0.01))
  loss, metrics = policy_loss(params, (exp, *_weights(exp, cfg)), graphdef=graphdef, cfg=cfg)
  ratio = np.exp(logp - old)
  pg = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv) * np.minimum(np.exp(old - mu), 1.2)
  want = (pg * m).sum() / m.sum() - 0.01 * float(metrics["entropy"])
  np.testing.assert_allclose(loss, want, rtol=1e-4, atol=1e-6)


def test_role_copies_survive_donation_of_the_source(tiny_cfg):
  mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  make = lambda: LanguageModel(tiny_cfg, rngs=nnx.Rngs(5))
  actor = ModelRole("actor", make, mesh).initialize()
  reference = ModelRole("reference", make, mesh)
  reference.load(actor.params)
  want = [np.asarray(x) for x in jax.tree.leaves(actor.params)]
  jax.tree.map(lambda x: x.delete(), actor.params)  # what a donated update does
  for w, x in zip(want, jax.tree.leaves(reference.params)):
    np.testing.assert_array_equal(np.asarray(x), w)
  critic = ModelRole("critic", lambda: ValueModel(tiny_cfg, rngs=nnx.Rngs(6)), mesh).initialize()
  critic.load(reference.params, subtree="decoder")
  np.testing.assert_array_equal(np.asarray(critic.params["decoder"]["embed"][...]),
                                np.asarray(reference.params["decoder"]["embed"][...]))
  assert critic.params["decoder"]["embed"][...].sharding == reference.params["decoder"]["embed"][
      ...].sharding


def test_minibatches_take_strided_rows_without_moving_data():
  x = jnp.arange(8 * 3).reshape(8, 3)
  mbs = split_minibatches({"x": x}, 2)["x"]
  np.testing.assert_array_equal(mbs[0], x[0::2])
  np.testing.assert_array_equal(mbs[1], x[1::2])
  mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  # Minibatch 0, still split over the 4 devices (as the update constrains it): no collective.
  # (Contiguous minibatches, x.reshape(2, 4, 3)[0], compile to an all-to-all here.)
  first = lambda a: jax.lax.with_sharding_constraint(split_minibatches(a, 2)[0] * 2, rows)
  hlo = jax.jit(first).lower(jax.device_put(x, rows)).compile().as_text()
  assert not any(op in hlo for op in ("all-to-all", "all-gather", "collective-permute"))
