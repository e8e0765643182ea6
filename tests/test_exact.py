"""Exact decoding (train/loop/exact.py, `rl.rollout.exact`): the log-prob of every token
drawn is the trainer's scoring pass's, bit for bit, in float32 and bfloat16, rows ending at EOS,
for dense, scanned, Gemma 3 (a sliding window) and mixture-of-experts models; in a run, the
mismatch is exactly 0."""
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError
from jaxrl.config_files import shipped
from jaxrl.models.config import from_fields
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.transformer import LanguageModel
from model_checks import perturbed
from sampler.methods import SamplingConfig
from train.loop.exact import exact_generate, exact_step
from train.run import Experiment
from train.updates.batching import map_minibatches
from train.updates.forward import completion_logprobs
from train.updates.replay import decode_loop, replay_generate, replayed_logprobs, ride

B, P, N, PIECES, TEMPERATURE = 8, 6, 10, 2, 0.7
ROOT = __file__.rsplit("/tests/", 1)[0]
tiny = shipped("tiny")


BASE = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)
MODELS = {  # (a window of 3 on every other layer; experts with their own routes)
    "llama": {}, "llama_scanned": {"layers.scan": True},
    "gemma3": {"family": "gemma3", "n_layers": 3, "attention.sliding_window": 3,
               "attention.global_every": 2},
    "qwen3_moe": {"family": "qwen3_moe", "moe.experts": 4, "moe.per_token": 2, "moe.d_ff": 16},
    "llama_lora": {}}  # (LoRA adapters on every projection, unmerged, off their init)


@pytest.mark.parametrize("model,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                         ("llama_scanned", "float32"), ("gemma3", "bfloat16"),
                                         ("qwen3_moe", "float32"), ("llama_lora", "bfloat16")])
def test_exact_decoding_reports_the_trainers_logprobs_bit_for_bit(model, dtype):
  cfg = from_fields({**BASE, **MODELS[model], "dtype": dtype})
  if model.endswith("lora"):
    graphdef, params = perturbed(cfg, LoRAConfig(rank=4, alpha=8.0))
  else:
    graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  prompts_BP = jax.random.randint(jax.random.key(1), (B, P), 3, cfg.vocab_size)
  valid_BP = jnp.arange(P)[None, :] >= jnp.arange(B)[:, None] % 3  # (some left padding)

  def generate(eos_id: int):
    sampling = SamplingConfig(max_new_tokens=N, eos_id=eos_id, pad_id=0, temperature=TEMPERATURE)
    step = jax.jit(functools.partial(exact_step, graphdef, prompt_len=P, cfg=sampling,
                                     pieces=PIECES))
    return exact_generate(lambda *a: step(params, *a), prompts_BP, valid_BP, jax.random.key(2),
                          cfg=sampling)
  eos = int(generate(-1).tokens_BT[0, P + 3])  # (a token row 0 draws: it ends there)
  r = generate(eos)

  # the scoring pass as the trainer runs it (train/loop/passes.py `scorer`): pieces of rows
  score = jax.jit(lambda q, t, v: map_minibatches(
      lambda mb: completion_logprobs(graphdef, q, *mb, P, temperature=TEMPERATURE)[0],
      (t, v), PIECES))
  pi_BN = np.asarray(score(params, r.tokens_BT, r.valid_BT))
  mask_BN, mu_BN = np.asarray(r.completion_mask_BN), np.asarray(r.logprobs_BN)
  assert np.array_equal(pi_BN[mask_BN], mu_BN[mask_BN])
  assert (mu_BN[~mask_BN] == 0).all() and (mu_BN[mask_BN] < 0).all()
  tokens_BN = np.asarray(r.tokens_BT[:, P:])
  ended = ~mask_BN.all(axis=1)
  assert ended.any()  # (some rows drew EOS: their slots after it are PAD, masked)
  for row in np.flatnonzero(ended):
    length = int(r.lengths_B[row])
    assert tokens_BN[row, length - 1] == eos and (tokens_BN[row, length:] == 0).all()


@pytest.mark.parametrize("model",
                         ["llama", "llama_scanned", "gemma3", "llama_lora", "qwen3_moe"])
def test_replayed_decoding_scores_the_samplers_logprobs_bit_for_bit(model):
  """`exact="replay"`: the trainer's log-probs replayed through the sampler's decode loop
  (teacher-forced) are the ones the sampler drew with, bit for bit, float32, rows ending at EOS,
  in the same pieces of rows, each prompt prefilled once for the rows that share it; riding on
  the whole pass in the update's gradient program they keep their values, and their gradient
  (the whole pass's, a mixture of experts' routed as the loop routed:
  `model.moe.routing_replay`) is the decode loop's own to float32 rounding."""
  replay = {"moe.routing_replay": "rollout"} if model == "qwen3_moe" else {}
  cfg = from_fields({**BASE, **MODELS[model], **replay, "dtype": "float32"})
  if model.endswith("lora"):
    graphdef, params = perturbed(cfg, LoRAConfig(rank=4, alpha=8.0))
  else:
    graphdef, params = nnx.split(LanguageModel(cfg, rngs=nnx.Rngs(0)))
  # 4 rows a prompt (group-major): 2 rows of each in either piece, prefilled once
  group = lambda x: jnp.repeat(x, 4, axis=0)  # noqa: E731
  prompts_BP = group(jax.random.randint(jax.random.key(1), (B // 4, P), 3, cfg.vocab_size))
  valid_BP = group(jnp.arange(P)[None, :] >= jnp.arange(B // 4)[:, None] + 1)

  def generate(eos_id: int):
    sampling = SamplingConfig(max_new_tokens=N, eos_id=eos_id, pad_id=0, temperature=TEMPERATURE)
    return jax.jit(functools.partial(replay_generate, graphdef, cfg=sampling, pieces=PIECES,
                                     group=2))(params, prompts_BP, valid_BP, jax.random.key(2))
  r = generate(int(generate(-1).tokens_BT[0, P + 3]))

  values_BN = jax.jit(lambda q, t, v: map_minibatches(
      lambda mb: replayed_logprobs(graphdef, q, *mb, P, TEMPERATURE, 2), (t, v), PIECES))(
          params, r.tokens_BT, r.valid_BT)
  mask_BN, mu_BN = np.asarray(r.completion_mask_BN), np.asarray(r.logprobs_BN)
  assert not mask_BN.all() and mask_BN.any(axis=1).all()  # (rows that ended, none empty)
  assert np.array_equal(np.asarray(values_BN)[mask_BN], mu_BN[mask_BN])

  def riding(q, t, v):
    lp_BN = ride(values_BN, completion_logprobs(graphdef, q, t, v, P, r.routes_BTLK,
                                                TEMPERATURE)[0])
    return (lp_BN * r.completion_mask_BN).sum(), lp_BN
  (_, pi_BN), grads = jax.jit(jax.value_and_grad(riding, has_aux=True))(
      params, r.tokens_BT, r.valid_BT)
  assert np.array_equal(np.asarray(pi_BN), np.asarray(values_BN))
  assert (mu_BN[~mask_BN] == 0).all()
  # its gradient (the whole pass's, train/updates/replay.py) is the decode loop's own
  loop = jax.jit(jax.grad(lambda q, t, v: (decode_loop(graphdef, q, t, v, prompt_len=P,
                                                       temperature=TEMPERATURE)[2]
                                           * r.completion_mask_BN).sum()))
  for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(loop(params, r.tokens_BT,
                                                                 r.valid_BT)), strict=True):
    np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-4 * float(np.abs(want).max()))


def _exact_run(tmp_path, name: str, route: str = "pass", dtype: str = "bfloat16",
               schedule: dict | None = None, every: int = 1, moe: dict | None = None,
               slots: int = 0, steps: int = 2, lora: int = 0,
               **correction) -> tuple[list[dict], str]:
  """(the RL rows that measured the mismatch, the run's params fingerprint); sync runs measure
  it at the steps before an evaluation (`eval.every`: 1, each step); `slots`: in-flight."""
  raw = tiny.get_config().to_dict()
  raw["eval"]["every"] = every
  raw.update(run_dir=str(tmp_path), run_name=name)
  if route == "replay":  # (4 rows a prompt: 2 in either minibatch, prefilled once)
    raw["rl"].update(prompts_per_step=4, group_size=4)
  if schedule:  # (async: the sampler's mesh split by rows as the trainer's)
    raw["rl"]["schedule"].update(schedule)
    raw["placement"]["sampler_tensor"] = 1
  raw["model"]["dtype"] = dtype
  raw["lora"]["rank"] = lora
  if moe:  # (a mixture of experts: tiny's model with experts)
    raw["model"]["family"] = "qwen3_moe"
    raw["model"]["moe"].update(moe)
  raw["rl"].update(steps=steps)
  raw["rl"]["batching"]["num_minibatches"] = 1 if slots else 2
  raw["rl"]["rollout"].update(exact=route, temperature=0.7, inflight_slots=slots)
  raw["rl"]["correction"].update(correction)
  with Experiment(raw) as exp:
    summary = exp.run()
    rows = [r for r in exp.writer.rows if r["phase"] == "rl" and "mismatch_max" in r]
  return rows, summary["params_fingerprint"]


def test_an_exact_run_has_no_mismatch_and_its_corrections_are_no_ops(tmp_path):
  """`rl.rollout.exact` in a run (bfloat16, temperature 0.7, two minibatches: the old log-probs
  a pass of their own): the sampler's log-probs are the trainer's at every step, bit for bit
  (mismatch exactly 0, where the engine's are 1e-3 to 1e-2 off in bfloat16); a truncated IS
  weight capped at 1 with IcePop's mask then changes nothing, and so does taking the sampler's
  log-probs as pi_old on the steps that do not check them (the same weights at the end); async
  is refused in one line that names the field."""
  rows, fingerprint = _exact_run(tmp_path, "exact")
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["mismatch_max"] == r["mismatch_kl"] == r["mismatch_mean"] == 0.0 for r in rows)
  corrected, same = _exact_run(tmp_path, "corrected", every=2, tis_cap=1.0, mask="icepop")
  assert [r["step"] for r in corrected] == [2]  # (step 1: pi_old the sampler's, unchecked)
  assert all(r["tis_capped_frac"] == r["rollout_masked_frac"] == 0.0 for r in corrected)
  assert same == fingerprint
  raw = tiny.get_config().to_dict()
  raw["rl"]["rollout"]["exact"] = "pass"
  raw["rl"]["schedule"]["mode"] = "async"
  with pytest.raises(ConfigError, match=r"schedule.mode: not with rollout.exact='pass'; "
                                        r"expected 'sync', got 'async'"):
    Experiment(raw)


def test_a_replayed_exact_run_has_no_mismatch(tmp_path):
  """`rl.rollout.exact="replay"` in a run of a mixture of experts (float32, temperature 0.7, two
  minibatches: the old log-probs a replay of their own, the second minibatch's values a replay;
  the update's pass routes as the loop did, `routing_replay="rollout"`): the mismatch is
  exactly 0 at every step, and a run that checks only before its last step's evaluation
  (pi_old and the first minibatch's log-probs the sampler's, no replay) ends with the same
  weights; bfloat16 where XLA keeps excess precision and DAPO's dynamic sampling (its rounds
  padded to the widest prompt: other shapes than the sampler's) are refused in one line."""
  moe = {"experts": 4, "per_token": 2, "d_ff": 16, "routing_replay": "rollout"}
  rows, fingerprint = _exact_run(tmp_path, "replay", route="replay", dtype="float32", moe=moe)
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["mismatch_max"] == r["mismatch_kl"] == r["mismatch_mean"] == 0.0 for r in rows)
  assert all(r["router_balance"] > 0.0 for r in rows)  # (the pass's router loss)
  rows, same = _exact_run(tmp_path, "unchecked", route="replay", dtype="float32", every=2,
                          moe=moe)
  assert [r["step"] for r in rows] == [2] and rows[0]["mismatch_max"] == 0.0
  assert same == fingerprint
  raw = tiny.get_config().to_dict()
  raw["rl"]["rollout"]["exact"] = "replay"
  raw["model"]["dtype"] = "bfloat16"  # (this process's XLA keeps excess precision)
  with pytest.raises(ConfigError, match=r"rl.rollout.exact: 'replay' in bfloat16 needs "
                                        r"XLA_FLAGS=--xla_allow_excess_precision=false"):
    Experiment(raw)
  raw["model"]["dtype"] = "float32"
  raw["rl"]["dapo"]["dynamic_sampling"] = True
  with pytest.raises(ConfigError, match=r"dapo.dynamic_sampling: not with rollout.exact='replay'"):
    Experiment(raw)


def test_in_flight_rows_replayed_through_their_schedule_have_no_mismatch(tmp_path):
  """`exact="replay"` with in-flight slots (4 slots for 16 rows: refills, rows ending at EOS
  at uneven steps, the tail in fewer slots): the trainer's old log-probs, the engine's host loop
  run again on the actor's mesh with each row's tokens forced, are the sampler's bit for bit at
  every step, in bfloat16 with LoRA adapters and for a mixture of experts in float32 (sync),
  and in async mode where the sampler's copy drew on its own devices (fixed schedule, no
  staleness: step 3's weights moved); two minibatches or partial rollouts are refused in one
  line naming the field."""
  for name, dtype, moe, schedule in (
      ("lora", "bfloat16", None, None),
      ("moe", "float32", {"experts": 4, "per_token": 2, "d_ff": 16}, None),
      ("async", "float32", None, {"mode": "async", "name": "fixed", "max_staleness": 0})):
    steps = 3 if schedule else 2
    rows, _ = _exact_run(tmp_path, name, route="replay", dtype=dtype, moe=moe, slots=4,
                         schedule=schedule, steps=steps, lora=4 if name == "lora" else 0)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["mismatch_max"] == r["mismatch_kl"] == 0.0 for r in rows)
  raw = tiny.get_config().to_dict()
  raw["rl"]["rollout"].update(exact="replay", inflight_slots=4)
  raw["rl"]["batching"]["num_minibatches"] = 2
  with pytest.raises(ConfigError, match=r"batching.num_minibatches: not with "
                                        r"rollout.exact='replay'; expected 1 \(the engine's"):
    Experiment(raw)
  raw["rl"]["batching"]["num_minibatches"] = 1
  raw["rl"]["schedule"].update(mode="async", partial_rollouts=True)
  with pytest.raises(ConfigError, match=r"schedule.partial_rollouts: not with "
                                        r"rollout.exact='replay'; expected False"):
    Experiment(raw)


def test_conversations_replayed_turn_by_turn_have_no_mismatch(tmp_path):
  """`exact="replay"` with an environment (3 turns, kept caches; bfloat16): the conversations
  drawn on the actor's mesh are replayed with each turn forced and each reply the recorded
  one, in the requests engine's programs: the old log-probs are the sampler's bit for bit
  at every step; so in async mode (float32, fixed schedule, no staleness), where the
  sampler's copy conversed on its own devices and the replay is every step's old pass."""
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="turns")
  raw["eval"]["every"] = 1
  raw["model"]["dtype"] = "bfloat16"
  raw["rl"].update(steps=2)
  raw["rl"]["environment"].update(name="test_multiturn:Recorder", max_turns=3)
  raw["rl"]["rollout"].update(max_new_tokens=16, exact="replay", temperature=0.7)
  raw["rl"]["batching"]["num_minibatches"] = 1
  with Experiment(raw) as exp:
    exp.run()
    rows = [r for r in exp.writer.rows if r["phase"] == "rl" and "mismatch_max" in r]
    turns = exp.ctx.generator.multiturn.stats()
  assert [r["step"] for r in rows] == [1, 2]
  assert turns["continued"] > 0  # (turns continued in their kept caches)
  assert all(r["mismatch_max"] == r["mismatch_kl"] == 0.0 for r in rows)
  raw.update(run_name="turns_async")
  raw["model"]["dtype"] = "float32"
  raw["rl"]["schedule"].update(mode="async", name="fixed", max_staleness=0)
  raw["placement"]["sampler_tensor"] = 1
  with Experiment(raw) as exp:
    exp.run()
    rows = [r for r in exp.writer.rows if r["phase"] == "rl" and "mismatch_max" in r]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["mismatch_max"] == r["mismatch_kl"] == 0.0 for r in rows)


def test_replay_in_async_mode_is_exact_and_its_mismatch_is_the_policy_lag(tmp_path):
  """`exact="replay"` in async mode (fixed schedule): the sampler's copy draws on its own devices,
  each holding the trainer's rows a device. A batch drawn by the weights the trainer scores it
  with has no mismatch (step 1; every step of a run with no staleness allowed: the bfloat16
  test below); a batch a version behind (`max_staleness=1`) then differs from pi_old by the
  policy lag alone."""
  rows, _ = _exact_run(tmp_path, "async1", route="replay", dtype="float32",
                       schedule={"mode": "async", "name": "fixed", "max_staleness": 1})
  assert [r["policy_lag"] for r in rows] == [0, 1]
  assert rows[0]["mismatch_max"] == 0.0 and rows[1]["mismatch_max"] > 0.0


ASYNC = ["--config.rl.schedule.mode=async", "--config.rl.schedule.name=fixed",
         "--config.rl.schedule.max_staleness=0", "--config.placement.sampler_tensor=1"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_train_command_runs_a_bfloat16_replay_exactly(tmp_path, mode):
  """`jaxrl-train` turns XLA's excess precision off for `exact="replay"` before JAX starts
  (train/cli/flags.py): a bfloat16 run at temperature 0.7 with two minibatches (the old
  log-probs a replay of their own, checked at each step) has no mismatch at any step. Sync:
  its update's pass runs over packed rows (`pack_length`: only the gradient comes from the
  pass); async: the sampler's bfloat16 copy draws on its own devices, no staleness allowed."""
  flags = ASYNC if mode == "async" else ["--config.rl.batching.pack_length=56"]
  subprocess.run([sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py",
                  f"--config.run_dir={tmp_path}", "--config.run_name=bf16",
                  "--config.model.dtype=bfloat16", "--config.rl.rollout.exact=replay",
                  "--config.rl.rollout.temperature=0.7", "--config.rl.batching.num_minibatches=2",
                  "--config.eval.every=1", "--config.rl.rollout.max_new_tokens=24",
                  "--config.progress=False", *flags],
                 cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
  lines = (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
  rows = [r for r in map(json.loads, lines) if r["phase"] == "rl" and "mismatch_max" in r]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(r["mismatch_max"] == r["mismatch_kl"] == 0.0 for r in rows)
  if mode == "async":
    assert all(r["policy_lag"] == 0 for r in rows)
  else:  # packed: less padding than the [B, 12 + 24] rows could have (prompts of <= 12 tokens)
    assert all(r["padding_fraction"] < 1 - (12 + r["response_len"]) / 36 for r in rows)
