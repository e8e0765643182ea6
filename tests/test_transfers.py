"""An RL step keeps rollouts on devices: with every host transfer but the named ones disallowed
(JAX's transfer guard, implicit and explicit), a step runs, and the host sees only the prompts,
the completions' token ids (for the verifier), the rewards and the metrics; plus the weight
push, whose layout change jax.device_put routes through the host (train/io/host_transfers.py)."""
import jax
import numpy as np

from configs import tiny
from train.io.host_transfers import RECORD
from train.run import Experiment


def test_rl_step_has_no_hidden_host_round_trip(tmp_path):
  raw = tiny.get_config().to_dict()
  raw.update(run_dir=str(tmp_path), run_name="guard", checkpoint_every=1000)
  raw["eval"]["every"] = 1000
  raw["rl"]["steps"] = 3
  with Experiment(raw) as exp:
    exp.rl.step()  # compiles, evaluates the starting policy
    RECORD.clear()
    guards = ("jax_transfer_guard_host_to_device", "jax_transfer_guard_device_to_host")
    before = {name: getattr(jax.config, name) for name in guards}
    try:
      for name in guards:  # global, so the executors' threads are guarded too
        jax.config.update(name, "disallow_explicit")
      row = exp.rl.step()
    finally:
      for name, value in before.items():
        jax.config.update(name, value)
    rollouts, new_tokens = 8 * 2, exp.ctx.task.max_new_tokens
  assert row["step"] == 2 and np.isfinite(row["loss"])
  assert set(RECORD) == {"prompts", "lengths", "completions", "rewards", "metrics", "weights"}
  assert RECORD["completions"] == rollouts * new_tokens * 4  # int32 token ids, nothing else
  assert RECORD["lengths"] == RECORD["rewards"] == rollouts * 4  # one int32 / float32 per row
