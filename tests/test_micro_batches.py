"""Gradient accumulation over micro-batches gives exactly the minibatch's update."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.algos import AGGREGATIONS
from jaxrl.algos.losses import aggregation_weights
from jaxrl.config import ConfigError, ExperimentConfig
from jaxrl.config_rl import BatchingConfig, CriticConfig, KLConfig, LossConfig, RLConfig
from jaxrl.config_files import from_mapping
from jaxrl.models import LanguageModel, ValueModel
from train.loop.experience import Experience
from train.updates.forward import completion_logprobs
from train.updates.policy import critic_update, policy_update
from train.updates.state import TrainState


def _uneven_mask(b=8, n=6) -> np.ndarray:
  """Rows with very different token counts, so each micro-batch's own normaliser differs."""
  mask = np.zeros((b, n), bool)
  for row, length in enumerate([6, 1, 6, 2, 5, 6, 1, 3][:b]):
    mask[row, :length] = True
  return mask


@pytest.mark.parametrize("name", sorted(AGGREGATIONS))
def test_aggregation_weights_reproduce_each_aggregation(name):
  mask = jnp.asarray(_uneven_mask())
  loss = jax.random.normal(jax.random.key(0), mask.shape)
  weights = aggregation_weights(name, mask)
  np.testing.assert_allclose((loss * weights).sum(), AGGREGATIONS[name](loss, mask), rtol=1e-6)
  assert (weights[~mask] == 0).all()


def _experience(graphdef, params, p=3):
  mask = _uneven_mask()
  b, n = mask.shape
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 256, (b, p + n)), jnp.int32)
  valid = jnp.asarray(np.concatenate([np.ones((b, p), bool), mask], 1))
  logp, _ = completion_logprobs(graphdef, params, tokens, valid, p)
  noise = lambda: jnp.asarray(rng.normal(size=(b, n)) * 0.3, jnp.float32)
  return Experience(tokens_BT=tokens, valid_BT=valid, completion_mask_BN=jnp.asarray(mask),
                    sampler_logprobs_BN=logp + noise(), ref_logprobs_BN=logp + noise(),
                    advantages_BN=jnp.asarray(rng.normal(size=(b, n)), jnp.float32) * mask,
                    old_values_BN=noise(), returns_BN=noise())


def _updated(update, params, exp):
  optimizer = optax.sgd(1.0)  # Adam would blow rounding-level gradient differences up to lr
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(params))
  return jax.jit(lambda s, e: update(s, e, optimizer=optimizer))(state, exp)


def _assert_same(a, b, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol, rtol=0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_give_the_minibatch_update(tiny_cfg, aggregation):
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(4)))
  exp = _experience(graphdef, params)
  results = {}
  for micro in (0, 2, 4):
    cfg = RLConfig(prompts_per_step=4, group_size=2,
                   batching=BatchingConfig(num_minibatches=1, micro_batch_size=micro),
                   kl=KLConfig(coef=0.05), loss=LossConfig(entropy_coef=0.01,
                                                           aggregation=aggregation))
    update = lambda s, e, optimizer: policy_update(s, e, graphdef=graphdef,
                                                     optimizer=optimizer, cfg=cfg)
    results[micro] = _updated(update, params, exp)
  (whole, m0) = results[0]
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(whole.params),
                                                          jax.tree.leaves(params)))
  assert moved > 1e-4
  for micro in (2, 4):
    state, metrics = results[micro]
    _assert_same(whole.params, state.params)
    for key in ("loss", "kl", "entropy", "clip_frac", "grad_norm"):
      np.testing.assert_allclose(metrics[key], m0[key], atol=1e-6, rtol=1e-5)


def test_naive_micro_batch_means_would_differ():
  """Guard on the test data: normalising per micro-batch (the gradient-accumulation bug) gives
  another loss here, so the equality above is not an accident of equal lengths."""
  mask = jnp.asarray(_uneven_mask())
  loss = jax.random.normal(jax.random.key(1), mask.shape)
  naive = np.mean([AGGREGATIONS["token_mean"](loss[i::4], mask[i::4]) for i in range(4)])
  assert abs(naive - AGGREGATIONS["token_mean"](loss, mask)) > 1e-2


def test_critic_micro_batches_give_the_minibatch_update(tiny_cfg):
  graphdef, params = nnx.split(ValueModel(tiny_cfg, rngs=nnx.Rngs(1)))
  lm_graphdef, lm_params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(4)))
  exp = _experience(lm_graphdef, lm_params)
  results = []
  for micro in (0, 2):
    cfg = RLConfig(prompts_per_step=4, group_size=2,
                   batching=BatchingConfig(num_minibatches=2, micro_batch_size=micro),
                   critic=CriticConfig(clip_eps=0.5))
    update = lambda s, e, optimizer: critic_update(s, e, graphdef=graphdef,
                                                         optimizer=optimizer, cfg=cfg)
    results.append(_updated(update, params, exp))
  (a, ma), (b, mb) = results
  _assert_same(a.params, b.params)
  np.testing.assert_allclose(ma["value_loss"], mb["value_loss"], rtol=1e-5)


def test_micro_batch_size_must_divide_the_minibatch():
  with pytest.raises(ConfigError,
                     match=r"config\.rl\.batching\.micro_batch_size: must divide .* 256 rows"):
    from_mapping(ExperimentConfig, {"rl": {"batching": {"micro_batch_size": 96}}})
