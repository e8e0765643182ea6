"""Chunked log-probs (jaxrl/models/lm_head.py) against the full-logits version, and the on-policy
update that takes its old log-probs from its own forward pass."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl.config_rl import (AdvantageConfig, BatchingConfig, CorrectionConfig, KLConfig,
                             LossConfig, RLConfig)
from jaxrl.models import lm_head
from jaxrl.models.lm_head import chunk_length, chunked_logprobs, dense_logprobs
from jaxrl.models.transformer import LanguageModel
from train.loop.experience import Experience
from train.updates.forward import completion_logprobs, token_logprobs
from train.updates.policy import policy_update
from train.updates.state import TrainState


def _inputs(b=3, n=10, d=16, v=50, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (b, n, d)) * 0.5, jax.random.normal(k2, (v, d)) * 0.5,
          jax.random.randint(k3, (b, n), 0, v))


def _loss(fn):
  """A loss that weighs every position's log-prob and entropy differently."""
  def loss(h, w, t):
    logp, ent = fn(h, w, t)
    weights = jnp.arange(1, logp.shape[1] + 1) / logp.shape[1]
    return (logp * weights).sum() + (ent * weights[::-1]).sum()
  return loss


def _reference(h, w, t, softcap: float = 0.0, temperature: float = 1.0):
  """The full logits in plain jnp, the soft cap and the temperature written out here (not
  lm_head.py's)."""
  z = jnp.einsum("bnd,vd->bnv", h, w)
  if softcap:
    z = softcap * jnp.tanh(z / softcap)
  z = z / temperature
  logp_all = jax.nn.log_softmax(z, axis=-1)
  return (jnp.take_along_axis(logp_all, t[..., None], axis=-1)[..., 0],
          -(jnp.exp(logp_all) * logp_all).sum(-1))


@pytest.mark.parametrize("chunk", [None, 1, 3, 4, 10])
@pytest.mark.parametrize("softcap,temperature", [(0.0, 1.0), (2.0, 1.0), (0.0, 0.6), (2.0, 1.7)])
@pytest.mark.accelerator
def test_chunked_equals_dense_values_and_gradients(chunk, softcap, temperature):
  """Chunked (its hand-written backward) against autodiff of lm_head.py's full logits and of the
  plain formula; a cap of 2 bends these logits (std ~1) a lot; the temperature divides the
  capped logits, as the sampler's does (sampler/methods.py)."""
  h, w, t = _inputs()
  chunked = lambda h, w, t: chunked_logprobs(h, w, t, softcap=softcap, chunk=chunk,
                                             temperature=temperature)
  dense = lambda h, w, t: dense_logprobs(h, w, t, softcap=softcap, temperature=temperature)
  reference = lambda h, w, t: _reference(h, w, t, softcap, temperature)
  for want_fn in (dense, reference):
    for got, want in zip(chunked(h, w, t), want_fn(h, w, t)):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    got = jax.grad(_loss(chunked), argnums=(0, 1))(h, w, t)
    want = jax.grad(_loss(want_fn), argnums=(0, 1))(h, w, t)
    for g, e in zip(got, want):
      assert float(jnp.abs(e).max()) > 1e-2  # a real gradient, not zeros on both sides
      np.testing.assert_allclose(g, e, atol=1e-5, rtol=1e-5)
  if softcap or temperature != 1.0:  # each changes the log-probs: one ignored would fail above
    assert float(jnp.abs(chunked(h, w, t)[0] - _reference(h, w, t)[0]).max()) > 0.1


def test_chunk_length_keeps_logits_within_budget():
  assert chunk_length(64, 32, 264) == 32  # a small vocabulary: one chunk
  n = chunk_length(8, 1024, 151_936)
  assert 1 <= n < 1024 and 8 * n * 151_936 <= 1 << 25
  assert chunk_length(1024, 8, 10**7) == 1  # never below one position


def _dots(jaxpr):
  """Every dot_general of a jaxpr, inside loops, checkpoints and custom VJPs too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else [param]:
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          yield from _dots(sub)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_bfloat16_states_give_float32_results(softcap):
  """bf16 hidden states: float32 log-probs; in the backward, too, every product multiplies bf16
  operands into float32 (not the float32 cotangent, which would make it a float32 product);
  the hidden states' gradient is bf16, the float32 head's float32."""
  h, w, t = _inputs()
  fn = lambda h, w, t: chunked_logprobs(h, w, t, softcap=softcap, chunk=4)
  logp, ent = fn(h.astype(jnp.bfloat16), w, t)
  assert logp.dtype == ent.dtype == jnp.float32
  np.testing.assert_allclose(logp, _reference(h, w, t, softcap)[0], atol=0.1)
  grad = jax.grad(_loss(fn), argnums=(0, 1))
  dh, dw = grad(h.astype(jnp.bfloat16), w, t)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  want = jax.grad(_loss(lambda h, w, t: _reference(h, w, t, softcap)), argnums=(0, 1))(h, w, t)
  np.testing.assert_allclose(dw, want[1], atol=0.05 * float(jnp.abs(want[1]).max()))
  dots = list(_dots(jax.make_jaxpr(grad)(h.astype(jnp.bfloat16), w, t).jaxpr))
  assert len(dots) >= 3  # the forward's product, the backward's recomputed one, its transposes
  for eqn in dots:
    assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
    assert eqn.outvars[0].aval.dtype == jnp.float32, eqn


@pytest.mark.accelerator
def test_model_logprobs_match_its_full_logits(tiny_cfg):
  model = LanguageModel(dataclasses.replace(tiny_cfg, tie_embeddings=False), rngs=nnx.Rngs(2))
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(5), (2, 9), 0, tiny_cfg.vocab_size)
  valid = jnp.ones_like(tokens, bool)
  logp, ent = token_logprobs(graphdef, params, tokens, valid, start=3)
  logits = model(tokens, jnp.broadcast_to(jnp.arange(9), (2, 9)), valid)[0]
  logp_all = jax.nn.log_softmax(logits[:, 3:-1], axis=-1)
  np.testing.assert_allclose(
      logp, jnp.take_along_axis(logp_all, tokens[:, 4:, None], -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(ent, -(jnp.exp(logp_all) * logp_all).sum(-1), atol=1e-5)


def _experience(graphdef, params, *, with_old: bool, p=3, n=5, b=4):
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 256, (b, p + n)), jnp.int32)
  mask = np.ones((b, n), bool)
  mask[2, 3:] = False
  valid = jnp.asarray(np.concatenate([np.ones((b, p), bool), mask], 1))
  logp, _ = completion_logprobs(graphdef, params, tokens, valid, p)
  ref = logp + jnp.asarray(rng.normal(size=(b, n)) * 0.3, jnp.float32)
  return Experience(tokens_BT=tokens, valid_BT=valid, completion_mask_BN=jnp.asarray(mask),
                    sampler_logprobs_BN=logp - 0.1, ref_logprobs_BN=ref,
                    advantages_BN=jnp.asarray(rng.normal(size=(b, n)), jnp.float32) * mask,
                    old_logprobs_BN=logp if with_old else None)


@pytest.mark.parametrize("policy_loss,tis_cap", [("ppo_clip", 0.0), ("ppo_clip", 2.0),
                                                 ("aipo", 0.0)])
def test_on_policy_update_needs_no_old_logprob_pass(tiny_cfg, policy_loss, tis_cap):
  cfg = RLConfig(batching=BatchingConfig(num_minibatches=1), kl=KLConfig(coef=0.05),
                 loss=LossConfig(entropy_coef=0.01,
                                 name=policy_loss), correction=CorrectionConfig(tis_cap=tis_cap))
  assert not cfg.needs_old_logprobs
  assert RLConfig(batching=BatchingConfig(num_minibatches=2)).needs_old_logprobs
  assert RLConfig(batching=BatchingConfig(num_minibatches=1),
                  advantage=AdvantageConfig(name="reinforce_pp"),
                  kl=KLConfig(mode="reward")).needs_old_logprobs
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(4)))
  optimizer = optax.sgd(1.0)  # Adam would blow rounding-level gradient differences up to lr
  results = []
  for with_old in (True, False):
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                             opt_state=optimizer.init(params))
    exp = _experience(graphdef, params, with_old=with_old)
    state, metrics = jax.jit(lambda s, e: policy_update(
        s, e, graphdef=graphdef, optimizer=optimizer, cfg=cfg))(state, exp)
    results.append((state.params, metrics))
  (with_pass, m1), (without, m2) = results
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(with_pass),
                                                          jax.tree.leaves(params)))
  assert moved > 1e-4  # the update did change the weights
  for a, b in zip(jax.tree.leaves(with_pass), jax.tree.leaves(without)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  np.testing.assert_allclose(m1["loss"], m2["loss"], atol=1e-6)


def _largest_buffer(fn, *args) -> int:
  """Elements of the largest array in the compiled program of `fn` (every instruction's
  result, fusions' insides included)."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  sizes = [np.prod([int(d) for d in dims.split(",") if d]) if dims else 1
           for dims in re.findall(r"= [a-z]+\d*\[([\d,]*)\]", hlo)]
  return int(max(sizes))


def test_train_step_never_holds_the_batch_logits(tiny_cfg, monkeypatch):
  """Peak memory, not only values: the compiled gradient of a loss on every position's log-prob
  and entropy has no array anywhere near [B, T, V], while the full-logits version does."""
  cfg = dataclasses.replace(tiny_cfg, vocab_size=2048)
  b, t = 4, 64
  monkeypatch.setattr(lm_head, "LOGITS_BUDGET", b * 8 * cfg.vocab_size)  # 8 positions a chunk
  graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  tokens = jax.random.randint(jax.random.key(0), (b, t), 0, cfg.vocab_size)
  valid = jnp.ones_like(tokens, bool)

  def grad(token_logprobs):
    def loss(params):
      logp, ent = token_logprobs(graphdef, params, tokens, valid)
      return -logp.mean() - 0.01 * ent.mean()
    return jax.grad(loss)

  def full(graphdef, params, tokens, valid):
    h = nnx.merge(graphdef, params).decoder(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                                            valid)[0]
    return dense_logprobs(h[:, :-1], nnx.merge(graphdef, params).head_VD(), tokens[:, 1:],
                          softcap=0.0)

  batch_logits = b * (t - 1) * cfg.vocab_size
  assert _largest_buffer(grad(full), params) >= batch_logits  # the check can see them
  assert _largest_buffer(grad(token_logprobs), params) <= b * 8 * cfg.vocab_size
