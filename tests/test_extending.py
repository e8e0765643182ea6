"""docs/architecture.md's "where to change what", done: each extension is its registry entry (and
its config field), nothing else. Each test adds one the way a newcomer would, registering it with
monkeypatch where the code would have a new line, and runs it through the code that uses it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl import envs, schedules
from jaxrl.algos import losses
from jaxrl.algos.losses import PolicyLoss, aggregation_weights
from jaxrl.config_checks import ConfigError
from jaxrl.config_files import from_mapping
from jaxrl.config_rl import EnvironmentConfig, LossConfig, RLConfig, ScheduleConfig
from jaxrl.data.tasks import Example
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.envs.base import Step
from jaxrl.models.transformer import LanguageModel
from sampler.methods import SamplingConfig
from sampler.sampler import Sampler
from train.loop.experience import Experience
from train.rollout.multiturn import MultiTurn
from train.rollout.whole import RolloutWorker
from train.updates.policy import policy_loss


def soft_gate_loss(logp_BN, adv_BN, *, old_BN, tau: float):
  """A loss with a hyperparameter no other loss has: -A * (1 + tanh(tau (r - 1)) / tau), a soft
  clip whose gradient fades as the ratio leaves 1; `saturated_frac`: tokens past |tau (r-1)| 2."""
  x_BN = tau * (jnp.exp(logp_BN - old_BN) - 1.0)
  return -adv_BN * (1.0 + jnp.tanh(x_BN) / tau), {"saturated_frac": (jnp.abs(x_BN) > 2.0) * 1.0}


@dataclasses.dataclass(frozen=True)
class SoftLossConfig(LossConfig):
  tau: float = 1.0  # (in jaxrl: one more field of LossConfig)


def test_a_loss_with_a_new_hyperparameter_is_its_entry_and_its_field(tiny_cfg, monkeypatch):
  monkeypatch.setitem(losses.POLICY_LOSSES, "soft_gate", PolicyLoss(soft_gate_loss))
  cfg = RLConfig(loss=SoftLossConfig(name="soft_gate", tau=4.0))  # the name is checked
  graphdef, params = nnx.split(LanguageModel(tiny_cfg, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  b, p, n = 2, 3, 4
  tokens_BT = jnp.asarray(rng.integers(0, 256, (b, p + n)), jnp.int32)
  mask_BN = jnp.ones((b, n), bool)
  from train.updates.forward import completion_logprobs
  logp_BN = completion_logprobs(graphdef, params, tokens_BT, jnp.ones((b, p + n), bool), p)[0]
  old_BN = logp_BN + jnp.asarray([[0.0, 0.01, 0.5, -0.9]] * b)
  adv_BN = jnp.asarray(rng.normal(size=(b, n)), jnp.float32)
  exp = Experience(tokens_BT=tokens_BT, valid_BT=jnp.ones((b, p + n), bool),
                   completion_mask_BN=mask_BN, sampler_logprobs_BN=old_BN,
                   ref_logprobs_BN=logp_BN, advantages_BN=adv_BN, old_logprobs_BN=old_BN)
  weights = aggregation_weights("token_mean", mask_BN)
  loss, metrics = policy_loss(params, (exp, weights, weights), graphdef=graphdef, cfg=cfg)
  r = np.exp(np.asarray(logp_BN - old_BN, np.float64))
  want = (-np.asarray(adv_BN) * (1 + np.tanh(4.0 * (r - 1)) / 4.0)).mean()
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert metrics["saturated_frac"] == pytest.approx(0.25)  # its own metric (r = e^0.9 only)
  assert "clip_frac" not in metrics  # (no other loss's bounds are applied to it)
  with pytest.raises(ConfigError, match=r"config.rl.loss.name: expected one of \[.*'soft_gate'"):
    from_mapping(RLConfig, {"loss": {"name": "soft_gaet"}}, "config.rl")


class Echo:
  """A tool environment: the model's turn, reversed, is the tool's reply; two turns."""

  def __init__(self, tok, verifier):
    self.tok, self.stop_strings, self.turns = tok, (")",), 0

  def reset(self, example):
    self.turns = 0
    return []

  def step(self, turn_ids):
    self.turns += 1
    return Step(list(reversed(turn_ids))[:3], float(self.turns), self.turns >= 2)


def test_a_tool_environment_is_one_registry_entry(monkeypatch):
  monkeypatch.setitem(envs.ENVIRONMENTS, "echo", Echo)
  assert RLConfig(environment=EnvironmentConfig(name="echo")).environment.name == "echo"
  with pytest.raises(ValueError, match=r"name: expected one of \[.*'echo'"):
    EnvironmentConfig(name="ehco")
  tok = ByteTokenizer()
  model = LanguageModel(dataclasses.replace(_tiny(), vocab_size=tok.vocab_size),
                        rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  sampler = Sampler(graphdef, SamplingConfig(max_new_tokens=12, eos_id=tok.eos_id,
                                             pad_id=tok.pad_id, method="temperature"))
  prompts = [tok.encode("echo ab"), tok.encode("echo c")]
  factory = envs.environment_factory("echo")
  with MultiTurn() as multiturn:
    talks = multiturn.converse(sampler, params, prompts, [Example("x", "1")] * 2,
                               [factory(tok, None) for _ in prompts], jax.random.key(0),
                               max_new_tokens=12, max_turns=2, max_turn_tokens=4, keep_cache=False)
  for talk in talks:  # turn, reply, turn (the last reply ends the conversation: not appended)
    assert talk.policy == [True] * 4 + [False] * 3 + [True] * 4
    assert talk.ids[4:7] == talk.ids[3::-1][:3]  # the first turn's ids, reversed
    assert talk.reward == 1.0 + 2.0 and talk.done  # its rewards (summed) and its end reached it


def _tiny():
  from jaxrl.models.config import ModelConfig
  return ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, d_ff=64)


class Lockstep(schedules.Free):
  """A schedule: every batch waits for the weights of all batches before it (whatever
  max_staleness says), so batch i is generated by policy version i."""

  def ready(self, view, index):
    return view.ahead(index) <= 0


def test_a_schedule_is_one_registry_entry(monkeypatch):
  monkeypatch.setitem(schedules.SCHEDULES, "lockstep", Lockstep)
  cfg = ScheduleConfig(mode="async", name="lockstep", max_staleness=2)
  assert cfg.entry is Lockstep and not RLConfig(schedule=cfg).schedule.entry.one_batch_per_step
  params = {"w": jnp.zeros(())}
  generate = jax.jit(lambda p, prompts, key: p["w"] + prompts)  # a batch: its weights' version
  with RolloutWorker(generate, [jnp.float32(0.0)] * 5, params, schedule=cfg.name,
                     max_staleness=cfg.max_staleness) as worker:
    for version, batch in enumerate(worker):
      assert batch.version == batch.index == version == float(batch.rollout)
      worker.update_weights({"w": jnp.float32(version + 1)}, version + 1)


def _relu2(x):
  """Squared ReLU (Primer's): an MLP activation jaxrl does not ship."""
  return jnp.square(jax.nn.relu(x))


def _capped_scores_family():
  """What a family with a new MLP activation and soft-capped attention scores adds: one
  `ACTIVATIONS` entry (its function and its Hugging Face name) and its `FAMILIES` entry, which
  names the activation and reads (and writes back) the config.json key of the scores' cap."""
  from jaxrl.models.families import Activation, BlockOptions, Family
  return Activation(_relu2, "relu2"), Family(
      "CappedScoresForCausalLM", BlockOptions(mlp_activation="relu2"),
      hf_read=lambda raw: {"attention.softcap": float(raw.get("attn_logit_softcapping") or 0)},
      hf_fields=lambda cfg: dict(attn_logit_softcapping=cfg.attention.softcap or None))


def test_a_family_with_a_new_activation_and_capped_scores_is_its_entries(tmp_path, monkeypatch):
  """docs/architecture.md's row, done in jaxrl/models/families.py alone: a checkpoint's
  config.json of the new architecture gives a model whose decoding matches its forward (the
  scores capped in the prefill's and the decode steps' einsum form alike), whose sampled tokens'
  log-probs equal the trainer's, other than the uncapped or SwiGLU model's; its export writes the
  cap and the activation back; a family that does not read the cap refuses it."""
  import json

  from jaxrl.data.tokenizer import ByteTokenizer
  from jaxrl.models import families
  from jaxrl.models.attention import attention_impl
  from jaxrl.models.config import from_fields
  from jaxrl.models.hf import HFError, model_config_from_hf
  from jaxrl.models.hf_config import hf_config_dict
  from model_checks import assert_decoding_matches_forward, perturbed
  from sampler.engine import generate
  from train.updates.forward import completion_logprobs
  activation, family = _capped_scores_family()
  monkeypatch.setitem(families.ACTIVATIONS, "relu2", activation)
  monkeypatch.setitem(families.FAMILIES, "capped_scores", family)
  raw = dict(architectures=["CappedScoresForCausalLM"], vocab_size=264, hidden_size=32,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10_000.0, hidden_act="relu2",
             tie_word_embeddings=True, attn_logit_softcapping=0.5)
  (tmp_path / "config.json").write_text(json.dumps(raw))
  cfg = model_config_from_hf(str(tmp_path))
  assert (cfg.family, cfg.attention.softcap, attention_impl(cfg)) == ("capped_scores", 0.5,
                                                                       "einsum")
  graphdef, params = perturbed(cfg)
  assert_decoding_matches_forward(nnx.merge(graphdef, params))
  tok = ByteTokenizer()
  tokens, valid = tok.pad_left([tok.encode(p, bos=True) for p in ["12+34=", "rev ab="]], 8)
  sampling = SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=tok.pad_id, method="temperature")
  rollout = jax.jit(lambda p, t, v: generate(graphdef, p, t, v, jax.random.key(0), cfg=sampling))(
      params, jnp.asarray(tokens), jnp.asarray(valid))
  logp = lambda g: completion_logprobs(g, params, rollout.tokens_BT, rollout.valid_BT, 8)[0]
  np.testing.assert_allclose(logp(graphdef), rollout.logprobs_BN, atol=1e-4)
  for other in ({"attention.softcap": 0.0}, {"family": "llama"}):  # each entry is in effect
    changed = nnx.split(LanguageModel(from_fields(other, base=cfg), rngs=nnx.Rngs(0)))[0]
    assert float(jnp.abs(logp(changed) - logp(graphdef)).max()) > 1e-2, other
  out = hf_config_dict(cfg, tied=True, dtype="float32", max_positions=64, token_ids={})
  assert (out["hidden_act"], out["attn_logit_softcapping"]) == ("relu2", 0.5)
  (tmp_path / "config.json").write_text(json.dumps(
      dict(raw, architectures=["LlamaForCausalLM"], hidden_act="silu")))
  with pytest.raises(HFError, match="attn_logit_softcapping=0.5 is not supported"):
    model_config_from_hf(str(tmp_path))


class Replies:
  """A tool environment with a hyperparameter: its replies are `reply_len` ids long."""

  def __init__(self, tok, verifier, *, reply_len: int):
    self.stop_strings, self.reply_len = (), reply_len

  def reset(self, example):
    return []

  def step(self, turn_ids):
    return Step([7] * self.reply_len, 0.0, True)


@dataclasses.dataclass(frozen=True)
class RepliesConfig(EnvironmentConfig):
  reply_len: int = 2  # (in jaxrl: one more field of EnvironmentConfig)


def test_an_environment_with_a_hyperparameter_is_its_entry_and_its_field(monkeypatch):
  """An environment's keyword-only parameters are what it reads: its hyperparameter is a field
  of `rl.environment` by that name, the run's code sandbox is `sandbox`; the run hands each
  (train/task/environment.py), in its own process or a user's class in its hosts."""
  import types

  from jaxrl.config import ExperimentConfig
  from train.io.tally import Tally
  from train.task.environment import environment_for
  from train.task.processes import UserProcesses
  monkeypatch.setitem(envs.ENVIRONMENTS, "replies", Replies)
  tok = ByteTokenizer()
  task = types.SimpleNamespace(verifier=lambda text, answer: 0.0, user_code_errors=Tally())
  with UserProcesses() as processes:
    def made(environment):
      cfg = ExperimentConfig(rl=RLConfig(environment=environment))
      return environment_for(cfg, tok, task, processes)()
    assert made(RepliesConfig(name="replies", reply_len=5)).step([1]).observation == [7] * 5
    with pytest.raises(ConfigError, match="reads 'reply_len', which the caller does not"):
      made(EnvironmentConfig(name="replies"))  # a field nothing declares: named
    python = made(EnvironmentConfig(name="python", max_output_chars=300))
    assert python.max_output_chars == 300 and python.sandbox is processes.sandbox()
    hosted = made(RepliesConfig(name="test_extending:Replies", reply_len=3))  # in its hosts
    assert hosted.step([1]) == Step([7] * 3, 0.0, True)
