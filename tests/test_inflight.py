"""In-flight batching (sampler/inflight.py, a `Sampler` with `inflight_slots`) against the static
engine and the model's forward."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config_rl import RLConfig, RolloutConfig
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.models.rope import positions_from_valid
from sampler.engine import generate
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler

TOK = ByteTokenizer()
PROMPTS = ["12+34=", "7+5=", "rev ab=", "1=", "hello", "x", "99-1=", "abc"]
BUDGETS = [3, 12, 1, 7, 12, 2, 5, 9]  # uneven; 8 rows in 3 slots: several refills


def _prompts():
  tokens, valid = TOK.pad_left([TOK.encode(p, bos=True) for p in PROMPTS], 8)
  return jnp.asarray(tokens), jnp.asarray(valid)


def _static(graphdef, params, cfg, budget_B=None):
  fn = jax.jit(functools.partial(generate, graphdef, cfg=cfg))
  return fn(params, *_prompts(), jax.random.key(0), budget_B)


def _assert_same(got, want):
  np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
  np.testing.assert_array_equal(got.valid_BT, want.valid_BT)
  np.testing.assert_array_equal(got.lengths_B, want.lengths_B)
  np.testing.assert_allclose(got.logprobs_BN, want.logprobs_BN, atol=1e-5)


def test_greedy_equals_the_static_engine_with_uneven_budgets_and_eos_on_a_mesh(tiny_model):
  from sharding.mesh import make_mesh, param_shardings
  from sharding.rules import SAMPLER_RULES
  graphdef, params = nnx.split(tiny_model)
  free = _static(graphdef, params, SamplingConfig(max_new_tokens=12, eos_id=-1,
                                                  pad_id=TOK.pad_id, method="greedy"))
  eos = int(free.tokens_BT[1, 8 + 4])  # a token row 1 emits mid-way ends rows as EOS
  cfg = SamplingConfig(max_new_tokens=12, eos_id=eos, pad_id=TOK.pad_id, method="greedy")
  budget_B = jnp.asarray(BUDGETS, jnp.int32)
  want = _static(graphdef, params, cfg, budget_B)
  lengths_B = np.asarray(want.lengths_B)
  assert (lengths_B < BUDGETS).any() and (lengths_B == BUDGETS).sum() > 1  # EOS and budgets
  _assert_same(Sampler(graphdef, cfg, inflight_slots=3).generate(
      params, *_prompts(), jax.random.key(0), budget_B), want)
  mesh = make_mesh({"data": 4, "tensor": 2})  # 4 slots, one per data shard
  params = jax.device_put(params, param_shardings(params, SAMPLER_RULES, mesh))
  _assert_same(Sampler(graphdef, cfg, mesh=mesh, inflight_slots=4).generate(
      params, *_prompts(), jax.random.key(0), budget_B), want)
  with pytest.raises(ValueError, match="multiple of the mesh's 4 data shards, got 6"):
    Sampler(graphdef, cfg, mesh=mesh, inflight_slots=6)


@functools.partial(jax.jit, static_argnums=2)
def _teacher_forced_logprobs(model, rollout, p: int):
  """log p(token) of each completion token from one full forward over the returned rows."""
  logits_BTV, _ = model(rollout.tokens_BT, positions_from_valid(rollout.valid_BT),
                        rollout.valid_BT)
  logp_BTV = jax.nn.log_softmax(logits_BTV[:, p - 1:-1], axis=-1)
  return jnp.take_along_axis(logp_BTV, rollout.tokens_BT[:, p:, None], axis=-1)[..., 0]


def test_samples_every_prompt_once_in_order_with_the_models_logprobs(tiny_model):
  graphdef, params = nnx.split(tiny_model)
  cfg = SamplingConfig(max_new_tokens=10, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
                       method="temperature", temperature=1.0)
  tokens_BP, valid_BP = _prompts()
  runs = [Sampler(graphdef, cfg, n=2, inflight_slots=slots).generate(params, tokens_BP,
                                                                     valid_BP, jax.random.key(7))
          for slots in (5, 8)]
  got = runs[0]
  np.testing.assert_array_equal(got.tokens_BT[:, :8], np.repeat(tokens_BP, 2, axis=0))
  np.testing.assert_array_equal(got.valid_BT[:, :8], np.repeat(valid_BP, 2, axis=0))
  mask_BN = np.asarray(got.completion_mask_BN)
  np.testing.assert_array_equal(mask_BN.sum(1), got.lengths_B)
  assert (mask_BN[:, 0]).all() and (np.diff(mask_BN.astype(int), axis=1) <= 0).all()
  logp_BN = _teacher_forced_logprobs(tiny_model, got, 8)
  np.testing.assert_allclose(np.where(mask_BN, logp_BN, 0), got.logprobs_BN, atol=1e-5)
  assert any((got.tokens_BT[2 * i] != got.tokens_BT[2 * i + 1]).any() for i in range(8))
  # A row's draws depend on its row index only, not on the slot or time it decoded in (8
  # slots: the tail also runs in a batch of 2).
  np.testing.assert_array_equal(runs[1].tokens_BT, got.tokens_BT)
  np.testing.assert_allclose(runs[1].logprobs_BN, got.logprobs_BN, atol=1e-5)


def test_inflight_slots_config_is_validated():
  with pytest.raises(ValueError, match=r"^inflight_slots: expected >= 0, got -1$"):
    RLConfig(rollout=RolloutConfig(inflight_slots=-1))


@pytest.mark.slow
def test_rl_step_generates_in_flight_without_hidden_host_transfers(tmp_path, monkeypatch):
  """`rl.rollout.inflight_slots` in a run: sampling and the greedy evaluation go through the in-flight
  generator, whose host loop moves only its own control bytes (as tests/test_transfers.py)."""
  from jaxrl.config_files import shipped
  tiny = shipped("tiny")
  from sampler import sampler
  from sampler.inflight import jit_inflight
  from train.run import Experiment
  built = []

  def counted(*args, **kw):
    built.append(kw["slots"])
    return jit_inflight(*args, **kw)
  monkeypatch.setattr(sampler, "jit_inflight", counted)
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="inflight", checkpoint_every=1000)
  raw["eval"]["every"] = 1000
  raw["rl"].update(steps=3)
  raw["rl"]["rollout"].update(inflight_slots=4)  # 8 prompts x 2 samples in 4 slots
  with Experiment(raw) as exp:
    exp.rl.step()  # compiles, evaluates the starting policy (greedy, in flight)
    exp.ctx.transfers.clear()
    guards = ("jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host")
    before = {name: getattr(jax.config, name) for name in guards}
    try:
      for name in guards:
        jax.config.update(name, "disallow_explicit")
      row = exp.rl.step()
    finally:
      for name, value in before.items():
        jax.config.update(name, value)
    new_tokens = exp.ctx.task.max_new_tokens
    record = exp.ctx.transfers.record()
  assert built == [4, 4]  # sample and greedy
  assert row["step"] == 2 and np.isfinite(row["loss"]) and row["response_len"] <= new_tokens
  assert record["completions"] == 8 * 2 * new_tokens * 4  # int32 token ids, nothing else


def test_a_forced_replay_runs_the_schedule_that_drew_and_gives_its_logprobs(tiny_model):
  """`forced`: a batch drawn at a temperature in 4 slots (16 rows: refills, uneven budgets and
  EOS, the tail in 1 slot), then run again with each row's tokens forced and its length as
  budget, gives the same tokens and, bit for bit, the same log-probs (rl.rollout.exact="replay"
  in in-flight slots); the key no longer matters."""
  from sampler.inflight import jit_inflight
  graphdef, params = nnx.split(tiny_model)
  free = SamplingConfig(max_new_tokens=12, eos_id=-1, pad_id=TOK.pad_id, temperature=0.7)
  drawn = np.asarray(jit_inflight(graphdef, free, slots=4, n=2)(
      params, *_prompts(), jax.random.key(1)).tokens_BT[:, 8:])
  values, counts = np.unique(drawn, return_counts=True)
  cfg = dataclasses.replace(free, eos_id=int(values[np.argmax(counts)]))  # ends rows mid-way
  run = jit_inflight(graphdef, cfg, slots=4, n=2, forced=True)
  budget_B = jnp.asarray(BUDGETS * 2, jnp.int32)
  got = run(params, *_prompts(), jax.random.key(1), budget_B)
  lengths_B = np.asarray(got.lengths_B)
  assert (lengths_B < BUDGETS * 2).any() and len(set(lengths_B)) > 3
  forced_BN = jnp.where(got.completion_mask_BN, got.tokens_BT[:, 8:], -1)
  again = run(params, *_prompts(), jax.random.key(9), got.lengths_B.astype(jnp.int32), forced_BN)
  np.testing.assert_array_equal(again.tokens_BT, got.tokens_BT)
  assert np.array_equal(again.logprobs_BN, got.logprobs_BN)
