"""DAPO's dynamic sampling refills a batch whose groups are mostly uniform, counts its extra
rounds and keeps the data position exact across a resume; the sampler/trainer mismatch is
logged every step, at rounding level in float32, and a perturbed sampler raises it."""
import json
import os

import numpy as np
import pytest

from jaxrl.config_files import shipped
from jaxrl.algos.advantages import informative_groups
from train.loop.batch_fill import fill_batch
from train.loop.controller import Controller
from train.rollout.generator import Generator
from train.run import Experiment
from train.run.hooks import Hook

tiny = shipped("tiny")

GROUP, PROMPTS = 4, 8


def reward(prompts, completions, **_):
  """Half the prompts (first letter a-m) score the completion's length parity, so their groups
  mostly differ; the others always score 0: uniform groups."""
  return [float(p[4] <= "m" and len(c) % 2 == 0) for p, c in zip(prompts, completions)]


def _raw(tmp_path, name, **rl):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name=name, checkpoint_every=1)
  raw["rl"].update(group_size=GROUP, prompts_per_step=PROMPTS,
                   verifier="test_dynamic_sampling:reward", **rl)
  raw["rl"]["dapo"].update(dynamic_sampling=True, dynamic_sampling_rounds=6)
  return raw


def test_uniform_groups_are_refilled_and_the_rounds_counted(tmp_path):
  with Experiment(_raw(tmp_path, "fill", steps=1)) as exp:
    exp.run()
    ctx = exp.ctx
    ctl = Controller(exp.cfg, cluster=ctx.cluster, generator=ctx.generator, task=ctx.task,
                     judge=ctx.judge, timeline=ctx.timeline, transfers=ctx.transfers,
                     actor=exp.stages["rl"].actor, critic=None, next_index=5, version=1)
    batch, _ = ctl.rollouts.next(ctl.version)
    first = ctx.judge.score(ctx.judge.texts(batch.rollout),
                            np.repeat(batch.prompts["examples"], GROUP))
    assert informative_groups(first, GROUP).sum() < PROMPTS  # this batch needs a refill
    filled = fill_batch(batch, cfg=exp.cfg.rl, judge=ctx.judge,
                        next_batch=lambda: ctl.rollouts.next(ctl.version),
                        transfers=ctx.transfers)
    out, out_prompts, verified_B, metrics = (filled.rollout, filled.prompts, filled.verified_B,
                                             filled.metrics)
    assert filled.versions_BN.shape == np.asarray(out.completion_mask_BN).shape
    ctl.close()
    # rows, prompts and rewards still belong together after the batches were stacked and cut
    # (scored again while the run's reward workers are up: they stop with it)
    again = ctx.judge.score(ctx.judge.texts(out), np.repeat(out_prompts["examples"], GROUP))
  assert out.tokens_BT.shape[0] == PROMPTS * GROUP == len(verified_B)
  assert metrics["dynamic_rounds"] >= 1 and ctl.next_index == 6 + metrics["dynamic_rounds"]
  informative = np.asarray(informative_groups(verified_B, GROUP))
  if metrics["dynamic_rounds"] < 6:
    assert informative.all() and metrics["informative_frac"] == 1.0
  else:  # out of rounds: the informative groups first, then the others
    assert not np.any(np.diff(informative.astype(int)) > 0)
  np.testing.assert_array_equal(again, verified_B)
  lengths = np.asarray(out.completion_mask_BN).sum(1)
  np.testing.assert_array_equal(np.asarray(out.lengths_B), lengths)
  assert (np.asarray(out.logprobs_BN)[np.asarray(out.completion_mask_BN)] < 0).all()


class _StopAt(Hook):
  def __init__(self, exp, step):
    self.exp, self.step = exp, step

  def after_step(self, stage, row):
    if stage.name == "rl" and stage.progress.done == self.step:
      self.exp.stop.event.set()


def _rl_rows(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if r["phase"] == "rl" and "dynamic_rounds" in r]


def test_dynamic_sampling_resumes_exactly_and_float32_mismatch_is_rounding(tmp_path):
  with Experiment(_raw(tmp_path, "whole")) as exp:
    whole = exp.run()
  with Experiment(_raw(tmp_path, "stopped")) as exp:
    exp.hooks.insert(-1, _StopAt(exp, 2))
    assert exp.run()["stopped"] == "stop request"
  with Experiment.restore(str(tmp_path / "stopped")) as again:
    resumed = again.run()
  assert resumed["params_fingerprint"] == whole["params_fingerprint"]
  rows, rows_resumed = _rl_rows(tmp_path / "whole"), _rl_rows(tmp_path / "stopped")
  key = lambda rs: [(r["step"], r["samples_generated"], r["dynamic_rounds"]) for r in rs]
  assert key(rows) == key(rows_resumed) and len(rows) == 3
  assert rows[-1]["samples_generated"] > rows[-1]["samples"]  # extra rounds were generated
  # float32: the sampler's log-probs are the trainer's up to rounding
  assert all(0.0 <= r["mismatch_max"] <= 1e-5 for r in rows)
  assert whole["mismatch_max"] == max(r["mismatch_max"] for r in rows)
  assert resumed["mismatch_max"] == whole["mismatch_max"]


def _one_step(tmp_path, name, rollout=(), **model):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name=name)
  raw["rl"]["steps"] = 1
  raw["rl"]["rollout"].update(rollout)
  raw["model"].update(model)
  with Experiment(raw) as exp:
    exp.run()
    return [r for r in exp.writer.rows if r["phase"] == "rl" and "mismatch_max" in r][-1]


@pytest.mark.parametrize("temperature", [0.5, 1.6])
def test_a_tempered_sampler_is_scored_at_its_temperature(tmp_path, temperature):
  """The trainer's log-probs (pi_old, the update's, the reference's) are those of the
  distribution the sampler draws from, its logits divided by `rl.rollout.temperature`: in
  float32 the sampler's log-probs are the trainer's up to rounding (scored at temperature 1,
  as before, they were up to 1.68 apart at temperature 0.5 on this model)."""
  row = _one_step(tmp_path, f"t{temperature}", rollout={"temperature": temperature})
  assert 0.0 <= row["mismatch_max"] <= 1e-5, row
  # the whole distributions too (train/loop/full_kl.py), at the evaluation after the step
  assert 0.0 <= row["sampler_kl_full"] <= row["sampler_kl_full_max"] < 1e-10, row


def test_bf16_mismatch_is_reported_and_a_perturbed_sampler_raises_it(tmp_path, monkeypatch):
  bf16 = _one_step(tmp_path, "bf16", dtype="bfloat16")
  assert 0.0 < bf16["mismatch_max"] < 1.0 and 0.0 < bf16["mismatch_mean"] <= bf16["mismatch_max"]
  assert bf16["mismatch_kl"] >= 0.0
  assert bf16["sampler_kl_full_max"] > 1e-8  # (float32: < 1e-10, above)
  sample = Generator.sample

  def perturbed(self, params, prompts, key):  # a sampler whose log-probs are off by 0.05
    rollout = sample(self, params, prompts, key)
    return rollout.replace(logprobs_BN=rollout.logprobs_BN - 0.05 * rollout.completion_mask_BN)

  monkeypatch.setattr(Generator, "sample", perturbed)
  off = _one_step(tmp_path, "perturbed")
  assert 0.049 < off["mismatch_max"] < 0.051 and 0.049 < off["mismatch_mean"] < 0.051
  assert off["mismatch_kl"] > 1e-3  # e^0.05 - 1.05 = 1.27e-3 per token
