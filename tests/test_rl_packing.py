"""Packed RL batches (train/updates/packing.py): every policy loss, aggregation and rollout
correction gives the same loss and gradients over packed rows as over the [B, T] batch, and an
update over minibatches and micro-batches the same weights."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config_rl import (BatchingConfig, CorrectionConfig, KLConfig, LossConfig, RLConfig,
                             RolloutConfig)
from jaxrl.algos.losses import AGGREGATIONS, POLICY_LOSSES, aggregation_weights
from jaxrl.models.config import ModelConfig
from jaxrl.models.transformer import LanguageModel
from train.loop.experience import Experience
from train.updates.forward import completion_logprobs
from train.updates.packing import plan
from train.updates.policy import policy_loss, policy_update
from train.updates.state import TrainState

P, N, B = 6, 10, 8
CFG = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64)  # float32


@pytest.fixture(scope="module")
def batch():
  rng = np.random.default_rng(0)
  graphdef, params = nnx.split(LanguageModel(CFG, rngs=nnx.Rngs(1)))
  prompt_lens = rng.integers(1, P + 1, B)
  lengths = np.array([0, 10, 3, 1, 7, 10, 2, 5])  # long-tailed, an empty one, two full
  valid = np.zeros((B, P + N), bool)
  for b in range(B):
    valid[b, P - prompt_lens[b]:P + lengths[b]] = True
  tokens = np.where(valid, rng.integers(2, 48, (B, P + N)), 0).astype(np.int32)
  mask = valid[:, P:]
  logp, _ = completion_logprobs(graphdef, params, jnp.asarray(tokens), jnp.asarray(valid), P)
  noisy = lambda scale: jnp.where(mask, logp + scale * rng.standard_normal(mask.shape), 0.0)
  exp = Experience(tokens_BT=jnp.asarray(tokens), valid_BT=jnp.asarray(valid),
                   completion_mask_BN=jnp.asarray(mask), sampler_logprobs_BN=noisy(0.3),
                   ref_logprobs_BN=noisy(0.5),
                   advantages_BN=jnp.asarray(rng.standard_normal((B, N)) * mask, jnp.float32),
                   old_logprobs_BN=noisy(0.2),
                   loss_mask_BN=jnp.asarray(mask & (rng.random((B, N)) < 0.8)))
  return graphdef, params, exp, prompt_lens, lengths


def _packed(exp, prompt_lens, lengths, pieces, length=20):
  pack = plan(prompt_lens, lengths, prompt_width=P, completion_slots=N, pieces=pieces,
              length=length, row_buckets=(B // pieces,))
  return exp.replace(pack=jax.tree.map(jnp.asarray, pack)), pack


def test_the_plan_packs_each_pieces_own_rows_and_their_tokens(batch):
  _, _, exp, prompt_lens, lengths = batch
  _, pack = _packed(exp, prompt_lens, lengths, pieces=2)
  tokens = np.asarray(exp.tokens_BT)
  assert pack.source_PRL.shape == (2, 4, 20)
  for p in range(2):
    rows = tokens[p::2]  # piece p: rows p, p + 2, ...
    src = pack.source_PRL[p]
    assert (np.sort(src[src >= 0]) == np.flatnonzero(np.asarray(exp.valid_BT)[p::2])).all()
    for r in range(src.shape[0]):  # each segment: one row's span, in order
      for seg in set(pack.segment_ids_PRL[p, r][pack.segment_ids_PRL[p, r] > 0]):
        span = src[r][pack.segment_ids_PRL[p, r] == seg]
        assert (np.diff(span) == 1).all() and len(set(span // rows.shape[1])) == 1
  whole = plan(prompt_lens, lengths, prompt_width=P, completion_slots=N, pieces=1, length=32,
               row_buckets=(2, 4, 8))
  assert whole.source_PRL.shape[1] < B  # fewer rows than the batch, same tokens
  assert (whole.source_PRL >= 0).sum() == np.asarray(exp.valid_BT).sum()


CASES = [(loss, list(AGGREGATIONS)[i % 4], ("none", "sequence", "geometric")[i % 3])
         for i, loss in enumerate(POLICY_LOSSES)] + [
    ("ppo_clip", agg, "token") for agg in list(AGGREGATIONS)[1:]]


@pytest.mark.parametrize("loss,aggregation,rollout_mask", CASES)
def test_packed_loss_and_gradients_equal_the_unpacked(batch, loss, aggregation, rollout_mask):
  graphdef, params, exp, prompt_lens, lengths = batch
  cfg = RLConfig(
      loss=LossConfig(name=loss, aggregation=aggregation, entropy_coef=0.01),
      correction=CorrectionConfig(mask=rollout_mask,
                                  tis_cap=2.0 if rollout_mask == "none" else 0.0),
      kl=KLConfig(coef=0.1), rollout=RolloutConfig(max_new_tokens=N))
  weights = aggregation_weights(aggregation, exp.policy_mask_BN, horizon=N)
  tokens = aggregation_weights("token_mean", exp.policy_mask_BN)
  fn = jax.jit(jax.value_and_grad(
      lambda p, e: policy_loss(p, (e, weights, tokens), graphdef=graphdef, cfg=cfg),
      has_aux=True))
  (want, want_m), want_g = fn(params, exp)
  (got, got_m), got_g = fn(params, _packed(exp, prompt_lens, lengths, pieces=1, length=32)[0])
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], atol=1e-5, rtol=0, err_msg=k)
  assert float(jnp.abs(want)) > 1e-3
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_an_update_over_minibatches_and_micro_batches_moves_the_weights_alike(batch):
  graphdef, params, exp, prompt_lens, lengths = batch
  cfg = RLConfig(prompts_per_step=2, group_size=4,
                 batching=BatchingConfig(num_minibatches=2, micro_batch_size=2),
                 kl=KLConfig(coef=0.1), rollout=RolloutConfig(max_new_tokens=N))
  optimizer = optax.sgd(1.0)
  update = jax.jit(
      lambda s, e: policy_update(s, e, graphdef=graphdef, optimizer=optimizer, cfg=cfg))
  new = lambda: TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           opt_state=optimizer.init(params))
  want, want_m = update(new(), exp)
  # 4 pieces of 2 rows: minibatch j, micro-batch k holds piece j + 2k (rows p, p + 4)
  got, got_m = update(new(), _packed(exp, prompt_lens, lengths, pieces=4)[0])
  np.testing.assert_allclose(got_m["loss"], want_m["loss"], atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
