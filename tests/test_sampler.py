import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models.transformer import LanguageModel
from jaxrl.models.rope import positions_from_valid
from sampler.engine import generate
from sampler.methods import SamplingConfig, temperature
from train.updates.forward import completion_logprobs

TOK = ByteTokenizer()


def _gen(model, prompts, n, method="greedy", eos_id=TOK.eos_id, **kw):
  graphdef, params = nnx.split(model)
  tokens, valid = TOK.pad_left([TOK.encode(p, bos=True) for p in prompts], 8)
  cfg = SamplingConfig(max_new_tokens=n, eos_id=eos_id, pad_id=TOK.pad_id, method=method, **kw)
  fn = jax.jit(functools.partial(generate, graphdef, cfg=cfg))
  return fn(params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(0))


LAYOUTS = pytest.mark.parametrize("layout", ["features", "rows"])


@LAYOUTS
@pytest.mark.accelerator
def test_greedy_with_cache_equals_recomputing_without_cache(tiny_model, layout):
  rollout = _gen(tiny_model, ["12+34=", "7+5="], 6, eos_id=-1, decode_layout=layout)
  tokens_BT, valid_BT = rollout.tokens_BT[:, :8], rollout.valid_BT[:, :8]
  for _ in range(6):  # no cache: re-run the whole sequence for every new token
    logits = tiny_model(tokens_BT, positions_from_valid(valid_BT), valid_BT)[0][:, -1]
    tokens_BT = jnp.concatenate([tokens_BT, jnp.argmax(logits, -1)[:, None].astype(jnp.int32)], 1)
    valid_BT = jnp.concatenate([valid_BT, jnp.ones((2, 1), bool)], 1)
  np.testing.assert_array_equal(rollout.tokens_BT, tokens_BT)


@LAYOUTS
@pytest.mark.accelerator
def test_sampled_logprobs_equal_full_forward(tiny_model, layout):
  rollout = _gen(tiny_model, ["12+34=", "7+5=", "rev ab=", "1="], 7, method="temperature",
                 temperature=1.0, decode_layout=layout)
  graphdef, params = nnx.split(tiny_model)
  logp_BN, _ = completion_logprobs(graphdef, params, rollout.tokens_BT, rollout.valid_BT, 8)
  mask = np.asarray(rollout.completion_mask_BN)
  np.testing.assert_allclose(np.where(mask, logp_BN, 0), rollout.logprobs_BN, atol=1e-4)


@LAYOUTS
def test_soft_capped_logprobs_of_sampler_and_trainer_agree(tiny_cfg, layout):
  """`logit_softcap`: the sampler's per-token log-probs (prefill and decode steps) equal the
  trainer's chunked ones, and both differ from the uncapped model's (the cap of 1 bends these
  logits, which reach several units)."""
  capped = dataclasses.replace(tiny_cfg, logit_softcap=1.0)
  graphdef, params = nnx.split(LanguageModel(capped, rngs=nnx.Rngs(0)))
  rollout = _gen(nnx.merge(graphdef, params), ["12+34=", "7+5=", "rev ab="], 6,
                 method="temperature", temperature=1.0, eos_id=-1, decode_layout=layout)
  logp_BN, _ = completion_logprobs(graphdef, params, rollout.tokens_BT, rollout.valid_BT, 8)
  np.testing.assert_allclose(logp_BN, rollout.logprobs_BN, atol=1e-4)
  uncapped, _ = completion_logprobs(nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))[0],
                                    params, rollout.tokens_BT, rollout.valid_BT, 8)
  assert float(np.abs(uncapped - logp_BN).max()) > 0.1


@LAYOUTS
def test_bf16_sampling_stays_close_to_the_float32_forward(tiny_cfg, layout):
  """A bf16 model keeps float32 parameters; the decode loop casts them once per call."""
  cfg16 = dataclasses.replace(tiny_cfg, dtype="bfloat16")
  rollout = _gen(LanguageModel(cfg16, rngs=nnx.Rngs(0)), ["12+34=", "7+5="], 6,
                 method="temperature", temperature=1.0, decode_layout=layout)
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))  # same weights, fp32
  logp_BN, _ = completion_logprobs(graphdef, params, rollout.tokens_BT, rollout.valid_BT, 8)
  mask = np.asarray(rollout.completion_mask_BN)
  np.testing.assert_allclose(np.where(mask, logp_BN, 0), rollout.logprobs_BN, atol=0.1)


@pytest.mark.accelerator
def test_eos_stops_a_row_and_masks_the_rest(tiny_model):
  first = _gen(tiny_model, ["12+34="], 1, eos_id=-1).tokens_BT[0, -1]  # greedy's first token
  rollout = _gen(tiny_model, ["12+34="], 5, eos_id=int(first))
  np.testing.assert_array_equal(rollout.completion_mask_BN[0], [True, False, False, False, False])
  assert (rollout.tokens_BT[0, 9:] == TOK.pad_id).all() and rollout.lengths_B[0] == 1


@pytest.mark.accelerator
def test_mixed_prompt_lengths_match_each_alone(tiny_model):
  prompts = ["12+34=", "7+5=", "rev abcdef="[:7]]
  together = _gen(tiny_model, prompts, 5, eos_id=-1)
  for i, p in enumerate(prompts):
    alone = _gen(tiny_model, [p], 5, eos_id=-1)
    np.testing.assert_array_equal(together.tokens_BT[i, 8:], alone.tokens_BT[0, 8:])
    np.testing.assert_allclose(together.logprobs_BN[i], alone.logprobs_BN[0], atol=1e-5)


def _uniforms(seed, b):  # the extremes of [0, 1) first, then random draws
  u = np.array(jax.random.uniform(jax.random.key(seed + 1), (b,)))
  u[:2] = 0.0, np.nextafter(np.float32(1), np.float32(0))
  return jnp.asarray(u)


def test_inverse_cdf_draws_follow_the_softmax():
  logits_V = jnp.asarray([2.0, -1.0, 0.5, -30.0, 1.0, 0.0])
  n = 60_000
  cfg = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=1, temperature=0.7)
  tokens_B, logp_B = temperature(jnp.broadcast_to(logits_V, (n, 6)),
                                 jax.random.uniform(jax.random.key(0), (n,)), cfg)
  want_V = np.asarray(jax.nn.softmax(logits_V / 0.7))
  freq_V = np.bincount(np.asarray(tokens_B), minlength=6) / n
  sigma_V = np.sqrt(want_V * (1 - want_V) / n)
  assert (np.abs(freq_V - want_V) <= 4 * sigma_V + 1e-9).all(), (freq_V, want_V)
  np.testing.assert_allclose(np.exp(logp_B), want_V[np.asarray(tokens_B)], rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**31 - 1), st.floats(0.2, 3.0))
def test_top_k_never_samples_outside_the_top_k(k, seed, temp):
  logits_BV = jax.random.normal(jax.random.key(seed), (16, 12)) * 3
  cfg = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=1, temperature=temp, top_k=k)
  tokens_B, logp_B = temperature(logits_BV, _uniforms(seed, 16), cfg)
  allowed_BK = np.asarray(jax.lax.top_k(logits_BV, k)[1])
  assert all(int(t) in allowed_BK[i] for i, t in enumerate(np.asarray(tokens_B)))
  assert (np.asarray(logp_B) <= 1e-6).all()


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 2**31 - 1))
def test_top_p_never_samples_outside_the_nucleus(p, seed):
  logits_BV = jax.random.normal(jax.random.key(seed), (16, 12)) * 3
  cfg = SamplingConfig(max_new_tokens=1, eos_id=0, pad_id=1, top_p=p)
  tokens_B, _ = temperature(logits_BV, _uniforms(seed, 16), cfg)
  probs_BV = np.asarray(jax.nn.softmax(logits_BV, -1), np.float64)
  for row, tok in enumerate(np.asarray(tokens_B)):
    order = np.argsort(-probs_BV[row])
    mass_before = np.cumsum(probs_BV[row][order]) - probs_BV[row][order]
    nucleus = set(order[mass_before < p - 1e-6].tolist()) | {order[0]}
    assert int(tok) in nucleus


def test_n_samples_share_the_prefix_and_match_repeated_prompts(tiny_model):
  graphdef, params = nnx.split(tiny_model)
  tokens, valid = TOK.pad_left([TOK.encode(p, bos=True) for p in ["12+34=", "7+5="]], 8)
  cfg = SamplingConfig(max_new_tokens=5, eos_id=-1, pad_id=TOK.pad_id)
  shared = generate(graphdef, params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(3),
                    cfg=cfg, n=3)
  repeated = generate(graphdef, params, jnp.asarray(np.repeat(tokens, 3, 0)),
                      jnp.asarray(np.repeat(valid, 3, 0)), jax.random.key(3), cfg=cfg)
  np.testing.assert_array_equal(shared.tokens_BT, repeated.tokens_BT)
  np.testing.assert_allclose(shared.logprobs_BN, repeated.logprobs_BN, atol=1e-5)
  assert len({tuple(r) for r in np.asarray(shared.tokens_BT[:3, 8:])}) > 1  # samples differ


def test_per_row_budget_stop_sequences_and_ignore_eos(tiny_model):
  graphdef, params = nnx.split(tiny_model)
  tokens, valid = TOK.pad_left([TOK.encode("12+34=", bos=True)] * 2, 8)
  args = (graphdef, params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(0))
  free = generate(*args, cfg=SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=TOK.pad_id,
                                            method="greedy"))
  out = np.asarray(free.tokens_BT[0, 8:])
  budget = generate(*args, jnp.asarray([2, 6]), cfg=SamplingConfig(
      max_new_tokens=6, eos_id=-1, pad_id=TOK.pad_id, method="greedy"))
  np.testing.assert_array_equal(budget.lengths_B, [2, 6])
  np.testing.assert_array_equal(budget.tokens_BT[0, 8:10], out[:2])
  stop = tuple(int(t) for t in out[1:3])
  stopped = generate(*args, cfg=SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=TOK.pad_id,
                                               method="greedy", stop_sequences=(stop,)))
  first_end = next(i + 2 for i in range(len(out) - 1) if tuple(out[i:i + 2]) == stop)
  assert first_end <= 3 and int(stopped.lengths_B[0]) == first_end  # the stop is kept, like EOS
  ignore = generate(*args, cfg=SamplingConfig(max_new_tokens=6, eos_id=int(out[0]),
                                              pad_id=TOK.pad_id, method="greedy", ignore_eos=True))
  np.testing.assert_array_equal(ignore.lengths_B, [6, 6])


def test_sampler_buckets_do_not_retrace(tiny_model):
  from sampler.sampler import Sampler
  graphdef, params = nnx.split(tiny_model)
  sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=4, eos_id=TOK.eos_id, pad_id=TOK.pad_id),
                    n=2)
  first = sampler.complete(params, [TOK.encode("12+34=", bos=True)] * 3, jax.random.key(0))
  second = sampler.complete(params, [TOK.encode(p, bos=True) for p in ["1=", "rev abc=", "9+9=",
                                                                        "x"]],
                            jax.random.key(1), max_new_tokens=[1, 4, 4, 2])
  assert sampler.traces == 1
  assert first.tokens_BT.shape == (6, 16 + 4) and second.tokens_BT.shape == (8, 20)
  assert second.lengths_B[0] <= 1 and second.lengths_B[1] <= 1 and second.lengths_B[6] <= 2


def test_variants_are_built_once_in_one_cache(tiny_model):
  """`Sampler.variant`: the same settings give the same (compiled) sampler, from any variant."""
  from sampler.sampler import Sampler
  graphdef, _ = nnx.split(tiny_model)
  base = Sampler(graphdef, SamplingConfig(max_new_tokens=4, eos_id=TOK.eos_id, pad_id=TOK.pad_id),
                 n=2)
  greedy = base.variant(n=1, method="greedy")
  assert base.variant() is base and base.variant(n=2) is base
  assert greedy is base.variant(method="greedy", n=1) and greedy.cfg.method == "greedy"
  assert greedy.variant(method="temperature", n=2) is base  # back again: no new sampler
  hot = greedy.variant(temperature=0.5, method="temperature")
  assert hot is base.variant(n=1, temperature=0.5) and (hot.n, hot.cfg.temperature) == (1, 0.5)


def test_sharded_sampler_matches_single_device(tiny_model):
  from sampler.sampler import Sampler
  from sharding.mesh import make_mesh, param_shardings
  from sharding.rules import SAMPLER_RULES
  graphdef, params = nnx.split(tiny_model)
  cfg = SamplingConfig(max_new_tokens=5, eos_id=-1, pad_id=TOK.pad_id, method="greedy")
  prompts = [TOK.encode(p, bos=True) for p in ["12+34=", "7+5=", "rev ab=", "1="] * 2]
  want = Sampler(graphdef, cfg).complete(params, prompts, jax.random.key(0))
  mesh = make_mesh({"data": 4, "tensor": 2})
  shardings = param_shardings(params, SAMPLER_RULES, mesh)
  sharded = Sampler(graphdef, cfg, mesh=mesh, param_shardings=shardings)
  got = sharded.complete(jax.device_put(params, shardings), prompts, jax.random.key(0))
  np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
  np.testing.assert_allclose(got.logprobs_BN, want.logprobs_BN, atol=1e-5)
  # Data shards that finish early (2 rows each here: shards 0 and 2 are done after one token)
  # must keep step with the others, whose tensor-parallel collectives they share (sampling's
  # cumulative sum over the vocab-sharded logits is a collective permute over all 4 devices;
  # a shard leaving its loop early used to hang the others until XLA aborted the process).
  budget = [1, 1, 5, 5, 1, 1, 5, 5]
  sampled = Sampler(graphdef, dataclasses.replace(cfg, method="temperature"), mesh=mesh,
                    param_shardings=shardings)
  got = sampled.complete(jax.device_put(params, shardings), prompts, jax.random.key(0),
                max_new_tokens=budget)
  np.testing.assert_array_equal(got.lengths_B, budget)


def test_decode_segments_match_one_loop(tiny_model):
  """Segmented decode (attention over a growing cache prefix) changes nothing but speed."""
  graphdef, params = nnx.split(tiny_model)
  tokens, valid = TOK.pad_left([TOK.encode(p, bos=True) for p in ["12+34=", "rev ab="]], 8)
  args = (params, jnp.asarray(tokens), jnp.asarray(valid), jax.random.key(5))
  outs = []
  for segments in (1, 4):
    cfg = SamplingConfig(max_new_tokens=33, eos_id=-1, pad_id=TOK.pad_id, decode_segments=segments)
    outs.append(jax.jit(functools.partial(generate, graphdef, cfg=cfg))(*args))
  np.testing.assert_array_equal(outs[0].tokens_BT, outs[1].tokens_BT)
  np.testing.assert_allclose(outs[0].logprobs_BN, outs[1].logprobs_BN, atol=1e-5)
  logp_BN, _ = completion_logprobs(graphdef, params, outs[1].tokens_BT, outs[1].valid_BT, 8)
  np.testing.assert_allclose(logp_BN, outs[1].logprobs_BN, atol=1e-4)


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=0.0), "temperature: expected > 0, got 0.0"),
    (dict(top_p=1.5), "top_p: expected in (0, 1], got 1.5"),
    (dict(decode_segments=0), "decode_segments: expected >= 1, got 0"),
    (dict(decode_layout="cols"), "decode_layout: expected one of ['auto', 'features', 'rows'], "
                                 "got 'cols'"),
])
def test_bad_sampling_config_fails_with_one_line(kw, message):
  with pytest.raises(ValueError) as e:
    SamplingConfig(max_new_tokens=4, eos_id=0, pad_id=0, **kw)
  assert str(e.value) == message


@LAYOUTS
def test_forced_decode_gives_the_distributions_the_sampler_drew_from(tiny_model, layout):
  """sampler/forced.py: the sampler's prefill and decode step fed the tokens it drew give at
  each step the distribution it drew from (the drawn token's log-prob is the one it reported,
  at temperature 0.7), and the trainer's distributions at those positions
  (train/loop/full_kl.py) are within float32 rounding of them over the whole vocabulary."""
  from sampler.forced import forced_logprobs
  from train.loop.full_kl import kl_stats, spread_steps, trainer_logprobs
  rollout = _gen(tiny_model, ["12+34=", "7+5=", "rev ab=", "1="], 7, method="temperature",
                 temperature=0.7, eos_id=-1, decode_layout=layout)
  graphdef, params = nnx.split(tiny_model)
  cfg = SamplingConfig(max_new_tokens=7, eos_id=-1, pad_id=TOK.pad_id, temperature=0.7,
                       decode_layout=layout)
  tokens_BT, valid_BT = rollout.tokens_BT, rollout.valid_BT
  steps_BK, weights_BK = spread_steps(np.ones((4, 7), bool), 7)
  assert (steps_BK == np.arange(7)).all() and np.isclose(weights_BK.sum(), 1.0)
  sampler_BKV = jax.jit(functools.partial(forced_logprobs, graphdef, cfg=cfg))(
      params, tokens_BT[:, :8], valid_BT[:, :8], tokens_BT[:, 8:], jnp.asarray(steps_BK))
  drawn_BN = np.take_along_axis(np.asarray(sampler_BKV), np.asarray(tokens_BT[:, 8:, None]),
                                -1)[..., 0]
  np.testing.assert_allclose(drawn_BN, rollout.logprobs_BN, atol=1e-6, rtol=0)
  trainer_BKV = jax.jit(functools.partial(trainer_logprobs, graphdef, prompt_len=8,
                                          temperature=0.7))(params, tokens_BT, valid_BT,
                                                            jnp.asarray(steps_BK))
  mean, peak = kl_stats(np.asarray(sampler_BKV), np.asarray(trainer_BKV), weights_BK)
  assert 0.0 <= mean <= peak < 1e-10, (mean, peak)
  other = np.asarray(trainer_BKV)[::-1]  # another row's distributions: far apart
  assert kl_stats(np.asarray(sampler_BKV), other, weights_BK)[0] > 1e-3
