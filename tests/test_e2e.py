"""End-to-end smoke: the CLI on the tiny config writes metrics, a plot and a checkpoint."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from train.cli import evaluate, train
from jaxrl.config import ConfigError
from train.io.checkpoint import RunCheckpointer, load_actor_params
from train.run import Experiment

ROOT = __file__.rsplit("/tests/", 1)[0]


@pytest.mark.slow
def test_tiny_run_through_main(tmp_path, capsys):
  proc = subprocess.run([
      sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
      "--config.run_name=smoke"
  ], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run_dir = tmp_path / "smoke"
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl" and "reward_mean" in r]
  assert [r["step"] for r in rl] == [1, 2, 3]
  for key in ("reward_mean", "kl", "entropy", "response_len", "step_time", "tokens_per_s", "loss"):
    assert all(np.isfinite(r[key]) for r in rl), key
  # the smoke run's RL moves the policy: every step rewarded and with a gradient
  assert all(r["reward_mean"] > 0 and r["grad_norm"] > 0 for r in rl), rl
  assert "heldout_acc" in rl[-1] and any(r["phase"] == "sft" for r in rows)
  assert (run_dir / "metrics.png").stat().st_size > 10_000
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["sft_checkpoint_step"] == 40 and summary["rl_checkpoint_step"] == 3

  # The run state restores (into the config's layouts) with finite values; the SFT weights
  # stay on disk apart from RL's and differ from them.
  ckpt = RunCheckpointer(str(run_dir), ["sft", "rl"])
  assert ckpt.saved()[0] == ("rl", 3) and ckpt.read_meta("rl", 3)["finished"]
  ckpt.close()
  with Experiment.restore(str(run_dir)) as exp:
    assert exp.stages["rl"].progress.finished and exp.position == 2
    params = exp.params
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    sft_params, step = load_actor_params(str(run_dir / "checkpoints" / "sft"),
                                         exp.ctx.cluster.actor.abstract())
    assert step == 40
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(params),
                                                     jax.tree.leaves(sft_params)))
  # Another model size does not fit: a one-line config error, not a silent fresh start.
  with pytest.raises(ConfigError, match=r"checkpoints/rl/3 does not fit this config: "
                     r"actor/decoder/blocks/0/attn/wk is \(2, 16, 32\) there, \(2, 16, 48\) here"):
    Experiment.restore(str(run_dir), model={"d_model": 48})
  assert json.loads((run_dir / "config.json").read_text())["model"]["d_model"] == 32  # kept

  # jaxrl-eval of the checkpoints is the run's own held-out evaluation (the same code): the
  # policy as RL started (SFT step 40) and after RL; then sampled, with pass@k and every sample.
  for stage, key in (("sft", "heldout_acc_rl_start"), ("rl", "heldout_acc_rl")):
    got = _eval(capsys, run_dir / "checkpoints" / stage, tmp_path / f"{stage}.jsonl")
    # (the held-out score is the verifier's mean: with tiny's partial credit, at least the
    # share of exact answers)
    assert got["reward_mean"] == summary[key] >= got["accuracy"], (stage, got, summary[key])
    assert got["examples"] == 16 and got["response_len"] > 0
  got = _eval(capsys, run_dir / "checkpoints" / "rl" / "2", tmp_path / "s.jsonl", "--n", "4",
              "--temperature", "1.0", "--k", "1,2,4", "--limit", "8")
  samples = [json.loads(l) for l in (tmp_path / "s.jsonl").read_text().splitlines()]
  assert len(samples) == 32 and got["model"].endswith("checkpoints/rl step 2")
  assert got["pass@1"] <= got["pass@2"] <= got["pass@4"]
  assert got["reward_mean"] == pytest.approx(np.mean([s["score"] for s in samples]))

  # A second run with the same name refuses to touch the existing checkpoints.
  before = {
      os.path.join(dp, p): os.path.getmtime(os.path.join(dp, p))
      for dp, _, fs in os.walk(run_dir / "checkpoints") for p in fs
  }
  again = subprocess.run([
      sys.executable, "-m", "train.cli.train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
      "--config.run_name=smoke"
  ], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert again.returncode == 2 and "already holds checkpoints" in again.stderr
  after = {
      os.path.join(dp, p): os.path.getmtime(os.path.join(dp, p))
      for dp, _, fs in os.walk(run_dir / "checkpoints") for p in fs
  }
  assert after == before and len(before) > 0

  # Two more RL steps end at other weights (RL moved the policy; it did not with reward 0).
  assert train.main(["train", f"--config={ROOT}/configs/tiny.py", f"--config.run_dir={tmp_path}",
                     "--config.run_name=five", "--config.rl.steps=5"]) == 0
  five = json.loads((tmp_path / "five" / "summary.json").read_text())
  assert five["params_fingerprint"] != summary["params_fingerprint"]


def _eval(capsys, model, samples, *args) -> dict:
  """jaxrl-eval in this process: its last line of output."""
  capsys.readouterr()
  code = evaluate.main(["jaxrl-eval", "--model", str(model), "--samples", str(samples), *args])
  out, err = capsys.readouterr()
  assert code == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["colocate", "interleave"])
def test_tiny_run_with_other_placements(tmp_path, strategy, capsys, monkeypatch):
  monkeypatch.chdir(ROOT)  # the CLI in this process (the run above went through a new one)
  code = train.main(["jaxrl-train", "--config=configs/tiny.py", f"--config.run_dir={tmp_path}",
                     "--config.run_name=p", f"--config.placement.strategy={strategy}"])
  assert code == 0, capsys.readouterr().err[-3000:]
  rows = [json.loads(l) for l in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if r["phase"] == "rl" and "reward_mean" in r]
  assert len(rl) == 3 and all(r["time_reshard"] > 0 for r in rl)


@pytest.mark.slow
def test_tiny_rlhf_run_with_dpo_reward_model_and_critic(tmp_path):
  """SFT -> DPO -> reward model -> PPO (gae critic) through the CLI on the tiny model."""
  proc = subprocess.run(
      [sys.executable, "-m", "train.cli.train", "--config=configs/ppo_rlhf_tiny.py",
       "--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.n_heads=2",
       "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.d_ff=64",
       "--config.task.n_train=128", "--config.task.n_heldout=16", "--config.sft.steps=3",
       "--config.sft.batch_size=16", "--config.dpo.steps=3", "--config.dpo.batch_size=8",
       "--config.reward_model.steps=3", "--config.reward_model.batch_size=8",
       "--config.rl.steps=2", "--config.rl.prompts_per_step=8", "--config.rl.group_size=2",
       "--config.eval.every=1", "--config.eval.batch_size=16", "--config.progress=False",
       f"--config.run_dir={tmp_path}", "--config.run_name=rlhf"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run_dir = tmp_path / "rlhf"
  rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert {"sft", "dpo", "reward_model", "rl"} <= {r["phase"] for r in rows}
  rl = [r for r in rows if r["phase"] == "rl" and "reward_mean" in r]
  assert len(rl) == 2 and all(np.isfinite(r["value_loss"]) and "verified_mean" in r for r in rl)
  summary = json.loads((run_dir / "summary.json").read_text())
  assert 0.0 <= summary["rm_heldout_pair_acc"] <= 1.0 and "dpo_heldout_logp_margin" in summary
  for stage in ("dpo", "reward_model"):
    for split in ("train", "heldout"):
      assert (run_dir / f"{stage}_pairs_{split}.jsonl").stat().st_size > 0
  assert sorted(os.listdir(run_dir / "checkpoints")) == ["dpo", "reward_model", "rl", "sft"]
