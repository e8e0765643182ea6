"""Prompt batches padded to a bucket and rollouts trimmed to their longest response train exactly
as batches padded to the config's maxima."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config_rl import CorrectionConfig, KLConfig, LossConfig, RLConfig, RolloutConfig
from jaxrl.data.pipeline import bucket_length
from jaxrl.models import LanguageModel, ModelConfig
from sampler.engine import Rollout
from train.loop.experience import Experience, trim_rollout
from train.updates.forward import completion_logprobs
from train.updates.policy import policy_loss


def test_bucket_length():
  assert [bucket_length(n, 160, 8) for n in (1, 20, 24, 60, 159, 160, 400)] == \
      [24, 24, 24, 72, 160, 160, 160]
  assert (bucket_length(5, 12, 8), bucket_length(9, 12, 8)) == (8, 12)  # steps of 8 at least
  assert bucket_length(60, 160, 0) == 160  # no buckets: always the maximum
  assert len({bucket_length(n, 512, 8) for n in range(1, 513)}) == 8


def _rows(p_max=9, n_max=7):
  """Left-padded prompts of 2..5 tokens and responses of 1..4 tokens: the padded batch, and how
  much of it (leading prompt columns, trailing completion slots) no row uses."""
  rng = np.random.default_rng(0)
  prompt_lens, response_lens = [2, 5, 3, 4, 2, 5, 3, 4], [1, 4, 2, 3, 4, 1, 2, 3]
  b = len(prompt_lens)
  tokens = rng.integers(3, 60, (b, p_max + n_max)).astype(np.int32)
  valid = np.zeros((b, p_max + n_max), bool)
  for i, (p, n) in enumerate(zip(prompt_lens, response_lens)):
    valid[i, p_max - p:p_max + n] = True
  tokens[~valid] = 0
  return tokens, valid, p_max - max(prompt_lens), max(response_lens)


def _experience(graphdef, params, tokens, valid, n):
  b, t = tokens.shape
  mask = jnp.asarray(valid[:, t - n:])
  rng = np.random.default_rng(1)
  logp, _ = completion_logprobs(graphdef, params, jnp.asarray(tokens), jnp.asarray(valid),
                                      t - n)
  noise = jnp.asarray(rng.normal(size=(b, n)) * 0.2, jnp.float32)
  adv = jnp.asarray(np.repeat(rng.normal(size=(b, 1)), n, 1), jnp.float32) * mask
  return Experience(tokens_BT=jnp.asarray(tokens), valid_BT=jnp.asarray(valid),
                    completion_mask_BN=mask, sampler_logprobs_BN=logp + noise,
                    ref_logprobs_BN=logp - noise, advantages_BN=adv)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_trimmed_batch_same_loss_and_gradients(aggregation):
  cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    d_ff=64)
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens, valid, skip, n = _rows()
  n_max = 7
  rl = RLConfig(loss=LossConfig(aggregation=aggregation,
                                entropy_coef=0.01), rollout=RolloutConfig(max_new_tokens=n_max),
                kl=KLConfig(coef=0.1), correction=CorrectionConfig(tis_cap=2.0))
  full = _experience(graphdef, params, tokens, valid, n_max)
  end = tokens.shape[1] - (n_max - n)
  short_tokens, short_valid = tokens[:, skip:end], valid[:, skip:end]
  trimmed = _experience(graphdef, params, short_tokens, short_valid, n)
  # The trimmed experience is the padded one with its unused columns cut (same per-token values).
  trimmed = dataclasses.replace(
      trimmed, sampler_logprobs_BN=full.sampler_logprobs_BN[:, :n],
      ref_logprobs_BN=full.ref_logprobs_BN[:, :n], advantages_BN=full.advantages_BN[:, :n])

  def loss_and_grads(exp):
    from jaxrl.algos.losses import aggregation_weights
    weights = aggregation_weights(aggregation, exp.completion_mask_BN, horizon=n_max)
    tokens = aggregation_weights("token_mean", exp.completion_mask_BN)
    fn = lambda p: policy_loss(p, (exp, weights, tokens), graphdef=graphdef, cfg=rl)[0]
    return jax.jit(jax.value_and_grad(fn))(params)

  (loss_full, g_full), (loss_trim, g_trim) = loss_and_grads(full), loss_and_grads(trimmed)
  np.testing.assert_allclose(loss_trim, loss_full, rtol=1e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(g_trim), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  assert float(jnp.abs(jax.tree.leaves(g_full)[0]).max()) > 0  # a real gradient was compared


def test_trim_rollout_keeps_the_prompt_and_the_first_slots():
  tokens, valid, _, n = _rows()
  t = tokens.shape[1]
  rollout = Rollout(tokens_BT=jnp.asarray(tokens), valid_BT=jnp.asarray(valid),
                    completion_mask_BN=jnp.asarray(valid[:, t - 7:]),
                    logprobs_BN=jnp.asarray(-valid[:, t - 7:].astype(np.float32)),
                    lengths_B=jnp.asarray(valid[:, t - 7:].sum(1)))
  short = trim_rollout(rollout, n)
  assert short.tokens_BT.shape == (8, t - 7 + n) and short.completion_mask_BN.shape == (8, n)
  np.testing.assert_array_equal(short.valid_BT, valid[:, :t - 7 + n])
  assert int(short.completion_mask_BN.sum()) == int(rollout.completion_mask_BN.sum())
