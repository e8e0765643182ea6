"""Numerical guards: an update whose gradients hold a NaN or an Inf (from a NaN reward,
advantage or loss too) is skipped inside the jitted step and counted; `max_skipped_updates` in a
row stop the run with one line, its last checkpoint holding the weights from before them."""
import os

import jax
import jax.numpy as jnp
import numpy as np

from train.io.checkpoint import RunCheckpointer, params_fingerprint
from train.loop.scoring import Scoring
from train.run import Experiment
from train.updates.state import TrainState, apply_gradients, make_optimizer


def test_a_non_finite_gradient_is_skipped_and_counted():
  params = {"w": jnp.ones(3)}
  opt = make_optimizer(0.1, warmup_steps=1, total_steps=10)
  state = TrainState(step=jnp.int32(0), params=params, opt_state=opt.init(params))
  state, _ = apply_gradients(state, {"w": jnp.ones(3)}, opt, {})  # (the warm-up's first lr is 0)
  seen = []
  for grad in (1.0, np.nan, np.inf, 1.0):
    before = state.params["w"]
    state, m = apply_gradients(state, {"w": jnp.full(3, grad)}, opt, {})
    seen.append((float(m["skipped_updates"]), int(m["skipped_in_a_row_max"])))
    changed = not np.array_equal(before, state.params["w"])
    assert changed == np.isfinite(grad) and np.isfinite(state.params["w"]).all()
  assert seen == [(0.0, 0), (1.0, 1), (1.0, 2), (0.0, 0)]


def _poison(monkeypatch, at):
  """The rewards of the RL steps in `at` (1-based) become NaN on their way to the update."""
  real, calls = Scoring._rewards, []

  def score(self, *args):
    rewards_B, verified_B = real(self, *args)
    calls.append(1)
    return (rewards_B * jnp.nan if len(calls) in at else rewards_B), verified_B
  monkeypatch.setattr(Scoring, "_rewards", score)


def _raw(tmp_path, name, **over):
  from jaxrl.config_files import shipped
  tiny = shipped("tiny")
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name=name, checkpoint_every=1, **over)
  raw["rl"].update(steps=4)
  return raw


def test_a_nan_reward_skips_that_update_and_the_run_goes_on(tmp_path, monkeypatch):
  _poison(monkeypatch, at={2})
  with Experiment(_raw(tmp_path, "one")) as exp:
    summary = exp.run()
    rows = [r for r in exp.writer.rows if r["phase"] == "rl" and "loss" in r]
  # (each step is 2 optimizer updates, one per minibatch: both skipped)
  assert [(r["skipped_updates"], r["skipped_in_a_row_max"]) for r in rows] == \
      [(0.0, 0), (1.0, 2), (0.0, 0), (0.0, 0)]
  assert np.isnan(rows[1]["loss"]) and all(np.isfinite(r["loss"]) for r in rows[2:])
  assert "stopped" not in summary and all(np.isfinite(np.asarray(x)).all()
                                          for x in jax.tree.leaves(exp.params))


def test_too_many_in_a_row_stop_the_run_with_the_last_checkpoint_good(tmp_path, monkeypatch,
                                                                      capsys):
  from train.cli.train import main
  _poison(monkeypatch, at={1, 2, 3, 4})
  run_dir = os.path.join(tmp_path, "stop")
  rc = main(["jaxrl-train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
             "--config.run_name=stop", "--config.checkpoint_every=1",
             "--config.max_skipped_updates=4", "--config.rl.steps=4"])
  err = capsys.readouterr().err
  assert rc == 1 and "Traceback" not in err
  assert ("jaxrl: error: rl step 2: 4 updates in a row had a NaN or an Inf in their gradients "
          "and were skipped (max_skipped_updates=4); checkpoints/rl/1 is intact") in err
  ckpt = RunCheckpointer(run_dir, ["sft", "rl"])
  assert ckpt.saved()[:2] == [("rl", 1), ("sft", 40)]  # nothing after the stop
  ckpt.close()
  # The RL checkpoint holds the SFT policy: both RL updates were skipped, not applied.
  with Experiment.restore(run_dir) as exp:
    rl_params = params_fingerprint(exp.params)
  sft = os.path.join(run_dir, "checkpoints", "sft")
  with Experiment(_raw(tmp_path, "check", init_checkpoint=sft, sft={"steps": 0})) as exp:
    assert params_fingerprint(exp.params) == rl_params
